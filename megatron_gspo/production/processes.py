"""Sample production in processes of its own, beside the trainer (``rollout.producer_processes``).

Making samples is Python work per sample: an environment's steps or an agent program's loop,
decoding the engine's answers, sending them to the reward functions, building each
:class:`~megatron_gspo.samples.TrainSample`.
Run by a thread of the trainer process it takes the trainer's interpreter lock away from the
training step (docs/async.md measured 1.3-1.4x the synchronous training phase at the CPU demo's
size). A :class:`ProducerProcess` is a child process with a producer of its own, built from the
run's configuration like the driver's (the same task, reward functions, environment and sampling)
and a generation-only client of the same rollout servers (their URLs and API key, no weight
transport): the trainer sends it a chunk's prompts and its index, and gets the scored samples
back (pickled tensors, once per chunk). Its samples are those the driver's own producer makes for
the same call: the producer is a function of the prompts, the index and the engine's answers.
An agent (``agent.function``) runs in the child behind a chat endpoint of the child's own (a
loopback server in front of the child's client, with a key of its own), so that its OpenAI
client, its tools and the endpoint's sessions all stay off the trainer's interpreter.

Weights, pauses, aborts and recoveries stay with the trainer's client: a weight sync pauses the
servers, which pauses every process's requests; an abort reaches them all. The trainer's weight
version reaches the children through shared memory (:meth:`ProducerProcess.set_weight_version`),
so that their requests carry the prefix-cache salt of the weights the servers hold
(``SGLangEngine.cache_salt``): a new version never reuses an old version's KV. An engine error in a
child comes back as the call's :class:`~megatron_gspo.rollout.RolloutEngineError` and the trainer
recovers the engine. A child dies with the trainer (``PR_SET_PDEATHSIG``: started from the
trainer's main thread).

What crosses the pipe is plain ``pickle`` of numpy arrays (:func:`pack_samples`), never
``multiprocessing``'s own pickling: with torch imported that shares every tensor's storage
through a shared-memory file and a descriptor passed between the processes, which cost the
trainer more CPU per chunk than the work moved off it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from megatron_gspo.config import TrainConfig
from megatron_gspo.envs import EnvironmentSpec, load_environment
from megatron_gspo.production.producer import SampleProducer, ScoredSamples
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.selection import agent_endpoint, select_producer
from megatron_gspo.production.task import build_task
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout import RolloutEngine, RolloutEngineError
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.runtime.lifetime import die_with_parent
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""How long a producer process may take to import torch and build its producer."""


def build_producer(
    cfg: TrainConfig,
    engine: RolloutEngine,
    rewards: Optional[RewardRunner],
    sampling: Sampling,
    resources: contextlib.ExitStack,
) -> SampleProducer:
    """The run's producer on ``engine``, chosen as the driver chooses it: an agent's episodes
    (``agent.function``, behind a chat endpoint of this process's own that ``resources``
    closes), an environment's (``env.name``) or one completion per sample."""
    task = build_task(cfg)
    endpoint = (
        resources.enter_context(agent_endpoint(cfg, engine, task))
        if cfg.agent.function is not None
        else None
    )
    factory = (
        load_environment(EnvironmentSpec(cfg.env.name, dict(cfg.env.options)))
        if cfg.env.name is not None
        else None
    )
    return select_producer(
        cfg, engine, task, rewards, sampling, chat_endpoint=endpoint, environment_factory=factory
    )


class ProducerProcess:
    """One child process that produces chunks (see the module docstring). ``produce`` blocks
    the calling thread without holding the interpreter lock; one call at a time."""

    def __init__(self, cfg: TrainConfig, client_options: dict[str, Any], weight_version: int = 0):
        context = multiprocessing.get_context("spawn")  # the trainer has threads: never fork
        self.connection, child = context.Pipe()
        self.weight_version = context.Value("q", weight_version, lock=False)
        """The servers' weight version, written here and read by the child's client."""
        self.process = context.Process(
            target=_serve,
            args=(child, cfg, client_options, os.getpid(), self.weight_version),
            name="sample-producer",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.ready = False
        self.closing = False
        """Set by the trainer when the run stops: a wait for the child's start gives up."""

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once the child has built its producer; raise what it failed with."""
        if self.ready:
            return
        deadline = time.monotonic() + timeout_s
        while not self.connection.poll(0.2):
            if self.closing:
                raise RuntimeError("the run stopped before the sample producer process started")
            if time.monotonic() > deadline or not self.process.is_alive():
                raise RuntimeError(
                    f"the sample producer process did not start in {timeout_s:.0f} s "
                    f"(exit code {self.process.exitcode})"
                )
        _raise_if_failed(pickle.loads(self.connection.recv_bytes()))
        self.ready = True

    def set_weight_version(self, version: int) -> None:
        """The servers now hold ``version`` (after the trainer's sync)."""
        self.weight_version.value = int(version)

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    def produce(self, prompts: list[Prompt], index: int) -> ScoredSamples:
        """The child's ``produce(prompts, index)``; its exception is raised here. The first
        call waits for the child to be ready (it starts while the trainer builds its model)."""
        self.wait_ready()
        try:
            self.connection.send_bytes(pickle.dumps((prompts, index)))
            answer = pickle.loads(self.connection.recv_bytes())
        except (EOFError, OSError) as error:
            raise RuntimeError(
                f"the sample producer process (pid {self.pid}) is gone: "
                f"exit code {self.process.exitcode}"
            ) from error
        _raise_if_failed(answer)
        samples, metrics = answer
        return ScoredSamples(unpack_samples(samples), metrics)

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError, ValueError):  # a child already gone
            self.connection.send_bytes(pickle.dumps(None))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.connection.close()


def following_client(weight_version: Any, **options: Any) -> SGLangEngine:
    """A generation-only client whose weight version is the trainer's (``weight_version``, a
    shared value the trainer sets after each sync): its requests' prefix-cache salt follows the
    servers' weights."""
    return SGLangEngine(**options, weight_version_source=lambda: int(weight_version.value))


class _Array:
    """A tensor field of a :class:`TrainSample` on the wire (a numpy array, pickled by value)."""

    def __init__(self, array: np.ndarray):
        self.array = array


def pack_samples(samples: list[TrainSample]) -> list[dict[str, Any]]:
    """``samples`` as dictionaries of plain values and numpy arrays (:class:`_Array`)."""
    return [
        {
            field.name: _Array(value.numpy()) if isinstance(value, torch.Tensor) else value
            for field in dataclasses.fields(sample)
            for value in (getattr(sample, field.name),)
        }
        for sample in samples
    ]


def unpack_samples(packed: list[dict[str, Any]]) -> list[TrainSample]:
    """The samples of :func:`pack_samples`, their tensors on the arrays' memory."""
    return [
        TrainSample(
            **{
                name: torch.from_numpy(value.array) if isinstance(value, _Array) else value
                for name, value in fields.items()
            }
        )
        for fields in packed
    ]


class _Failure:
    """An exception of the child, sent back: its type (an engine error stays one, so that the
    trainer recovers the engine) and its traceback."""

    def __init__(self, error: BaseException):
        self.engine_error = isinstance(error, RolloutEngineError)
        self.message = f"{type(error).__name__}: {error}"
        self.traceback = "".join(traceback.format_exception(error))


def _raise_if_failed(answer: Any) -> None:
    if isinstance(answer, _Failure):
        if answer.engine_error:
            raise RolloutEngineError(answer.message)
        raise RuntimeError(f"the sample producer process failed:\n{answer.traceback}")


def _serve(
    connection: Connection, cfg: TrainConfig, client_options: dict, parent: int, version: Any
) -> None:
    """The child: build the producer, then answer ``(prompts, index)`` with scored samples
    until ``None`` (or the trainer's death)."""
    die_with_parent(parent)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s producer: %(message)s")
    with contextlib.ExitStack() as resources:
        try:
            engine = following_client(version, **client_options)
            resources.callback(engine.close)
            rewards = RewardRunner(cfg.reward) if cfg.reward.functions else None
            if rewards is not None:
                resources.callback(rewards.close)
            producer = build_producer(cfg, engine, rewards, Sampling.training(cfg), resources)
        except BaseException as error:  # noqa: BLE001 - reported to the trainer
            connection.send_bytes(pickle.dumps(_Failure(error)))
            return
        connection.send_bytes(pickle.dumps("ready"))
        _answer_chunks(connection, producer)


def _answer_chunks(connection: Connection, producer: SampleProducer) -> None:
    """Answers ``(prompts, index)`` with ``producer``'s scored samples until ``None`` or the end
    of the pipe."""
    while True:
        try:
            message = pickle.loads(connection.recv_bytes())
        except EOFError:
            return
        if message is None:
            return
        prompts, index = message
        try:
            scored = producer.produce(prompts, index)
            answer: Any = (pack_samples(scored.samples), scored.metrics)
        except BaseException as error:  # noqa: BLE001 - reported to the trainer
            answer = _Failure(error)
        connection.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


def start_producer_processes(cfg: TrainConfig, engine: RolloutEngine) -> list[ProducerProcess]:
    """``rollout.producer_processes`` producer processes on ``engine``'s servers, started
    together; they build their producers while the trainer goes on (importing torch takes
    seconds), and the first chunk of each waits for it."""
    if not isinstance(engine, SGLangEngine):
        raise TypeError(
            f"rollout.producer_processes needs an engine reachable over HTTP, not "
            f"{type(engine).__name__} (rollout.engine=embedded_http or sglang)"
        )
    options = engine.generation_client_options()
    return [
        ProducerProcess(cfg, options, engine.weight_version)
        for _ in range(cfg.rollout.producer_processes)
    ]
