"""The rollout contract: our request/result types and the engine interface.

These are the trainer's own types, not SGLang's: every backend (the embedded transformers engine,
the SGLang HTTP client) maps them onto its own protocol, so the RL loop never sees backend JSON.

Shapes: ``P`` prompt tokens, ``R`` generated tokens, ``L = P + R``, ``M`` MoE layers (dense layers
skipped), ``K`` experts per token (top-k).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from megatron_gspo.samples.routes import route_shape_problem
from megatron_gspo.weight_sync import SyncStats

FINISH_REASONS = ("stop", "length", "abort")
PAUSE_MODES = ("abort", "in_place")


class RolloutEngineError(RuntimeError):
    """A rollout engine failed: it died, answered malformed data or refused an operation.

    The message names the engine (URL for servers) and the operation.
    """


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to complete.

    ``temperature == 0`` means greedy decoding; the returned log-probs are then at temperature 1
    (SGLang turns ``temperature=0`` into ``temperature=1, top_k=1``). ``top_k=-1`` and
    ``top_p=1`` disable truncation. ``seed=None`` lets the engine pick a seed.
    ``min_new_tokens``: the stop tokens cannot be sampled before the response has this many
    tokens (SGLang's sampling parameter of that name).
    """

    input_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: Sequence[int] = ()
    min_new_tokens: int = 0
    seed: Optional[int] = None
    return_logprob: bool = True
    return_routed_experts: bool = False
    return_routed_expert_weights: bool = False
    """With ``return_routed_experts``: also the combine weight of each routed expert
    (``GenerateResult.routed_expert_weights``); the embedded engine only (SGLang returns ids)."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_id: Optional[str] = None
    """The episode (chat session) the request belongs to: an engine with several servers sends
    every request of a session to the server holding its prefix (sticky sessions); None: any."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", [int(token) for token in self.input_ids])
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems = []
        if not self.input_ids:
            problems.append("input_ids is empty (a prompt needs at least one token)")
        if any(token < 0 for token in self.input_ids):
            problems.append("input_ids has negative token ids")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} < 1")
        if self.min_new_tokens < 0:
            problems.append(f"min_new_tokens={self.min_new_tokens} < 0")
        if not self.temperature >= 0 or self.temperature != self.temperature:
            problems.append(f"temperature={self.temperature} is not >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} is outside (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            problems.append(f"top_k={self.top_k} is neither -1 (off) nor >= 1")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            problems.append(f"seed={self.seed} does not fit in int64")
        if not self.request_id:
            problems.append("request_id is empty")
        if self.return_routed_expert_weights and not self.return_routed_experts:
            problems.append("return_routed_expert_weights without return_routed_experts")
        if problems:
            raise ValueError(
                f"invalid GenerateRequest {self.request_id!r}: " + "; ".join(problems) + "."
            )


@dataclass
class GenerateResult:
    """One completion.

    ``output_log_probs[j]`` is ``log_softmax(logits / T)[output_ids[j]]`` at the sampling
    temperature ``T``, before top-p/top-k truncation (SGLang semantics); ``None`` when not asked.
    ``routed_experts`` is ``[L - 1, M, K]`` logical expert ids in the format of
    :mod:`megatron_gspo.samples.routes` (uint8 when there are at most 256 experts, int16 otherwise): rows
    are the prompt tokens and every generated token except the last, which is never run forward;
    ``None`` when not asked. ``output_weight_versions[j]`` is the weight version of the forward
    whose logits sampled ``output_ids[j]`` (and gave ``output_log_probs[j]``): a request that
    spans a weight sync (paused in place, continued with new weights) has tokens of several
    versions; ``weight_version`` is the oldest of them.
    """

    request_id: str
    output_ids: list[int]
    output_log_probs: Optional[np.ndarray]
    finish_reason: str
    prompt_length: int
    weight_version: int
    routed_experts: Optional[np.ndarray] = None
    routed_expert_weights: Optional[np.ndarray] = None
    """``[L - 1, M, K]`` float32 beside ``routed_experts``: the combine weight the engine's
    router gave each routed expert (after renormalisation and scaling), in the ids' order
    (:mod:`megatron_gspo.samples.routes`); None when not asked."""
    output_weight_versions: Optional[np.ndarray] = None
    """``[R]`` int64 weight version per generated token; None when the engine does not say
    (an SGLang answer without ``weight_versions`` spans)."""
    matched_stop_token: Optional[int] = None
    """The stop token that ended the sample (finish_reason == "stop")."""
    abort_message: Optional[str] = None
    """Why the sample was aborted (finish_reason == "abort")."""
    cached_tokens: Optional[int] = None
    """Prompt tokens the engine took from its prefix cache (SGLang's ``meta_info.cached_tokens``);
    None when the engine does not say."""

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"result {self.request_id!r}: finish_reason {self.finish_reason!r} is not one of "
                f"{FINISH_REASONS}"
            )
        if self.output_log_probs is not None and len(self.output_log_probs) != len(self.output_ids):
            raise ValueError(
                f"result {self.request_id!r}: {len(self.output_log_probs)} log-probs for "
                f"{len(self.output_ids)} output tokens"
            )
        if self.output_weight_versions is not None:
            if len(self.output_weight_versions) != len(self.output_ids):
                raise ValueError(
                    f"result {self.request_id!r}: {len(self.output_weight_versions)} weight "
                    f"versions for {len(self.output_ids)} output tokens"
                )
            if len(self.output_ids) and int(np.min(self.output_weight_versions)) != int(
                self.weight_version
            ):
                raise ValueError(
                    f"result {self.request_id!r}: weight_version {self.weight_version} is not the "
                    f"oldest of its tokens' versions ({int(np.min(self.output_weight_versions))})"
                )
        if self.routed_experts is not None:
            num_positions = self.prompt_length + len(self.output_ids) - 1
            problem = route_shape_problem(self.routed_experts.shape, num_positions)
            if problem is not None:
                raise ValueError(
                    f"result {self.request_id!r}: {problem}; prompt {self.prompt_length} + "
                    f"response {len(self.output_ids)} tokens"
                )
        if self.routed_expert_weights is not None and (
            self.routed_experts is None
            or self.routed_expert_weights.shape != self.routed_experts.shape
            or self.routed_expert_weights.dtype != np.float32
        ):
            raise ValueError(
                f"result {self.request_id!r}: routed expert weights "
                f"{self.routed_expert_weights.dtype}{tuple(self.routed_expert_weights.shape)} do "
                "not match the routed experts "
                f"{None if self.routed_experts is None else tuple(self.routed_experts.shape)} "
                "(float32, one weight per id)"
            )

    @property
    def response_length(self) -> int:
        return len(self.output_ids)


def derive_seed(seed: int, sample_index: int) -> int:
    """Seed of sample ``sample_index`` of a request with ``seed`` (for ``n > 1``).

    Sample 0 keeps ``seed``, so ``n=1`` and the first of ``n`` samples agree; the others get a
    hash of ``(seed, index)`` in ``[0, 2**63)`` so that the ``n`` samples are independent.
    """
    if sample_index == 0:
        return seed
    return _hashed_seed(f"{seed}:{sample_index}")


def derive_turn_seed(seed: int, turn: int) -> int:
    """Seed of model turn ``turn`` of an episode whose sample has ``seed``.

    Turn 0 keeps ``seed``, so an episode's first turn samples what one completion would. The
    later turns hash ``(seed, "turn", turn)``, a domain of their own: with
    ``derive_seed(seed, turn)`` instead, turn ``k`` of a prompt's sample 0 would draw the same
    uniforms as turn 0 of its sample ``k`` (``derive_seed(derive_seed(s, 0), k) =
    derive_seed(s, k)``), two samples of one group sharing their sampling noise.
    """
    if turn == 0:
        return seed
    return _hashed_seed(f"{seed}:turn:{turn}")


def _hashed_seed(key: str) -> int:
    """A seed in ``[0, 2**63)`` from ``key``, the same on every machine and Python process."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_request_id(request_id: str, sample_index: int, n: int) -> str:
    """Id of sample ``sample_index`` of ``n`` drawn for ``request_id`` (unchanged when n == 1)."""
    return request_id if n == 1 else f"{request_id}/{sample_index}"


def expand_samples(requests: Sequence[GenerateRequest], n: int) -> list[GenerateRequest]:
    """``n`` requests per prompt, prompt-major (p0 x n, p1 x n, ...), with derived seeds and ids."""
    if n < 1:
        raise ValueError(f"n={n} < 1: the number of samples per prompt must be positive")
    if n == 1:
        return list(requests)
    return [
        dataclasses.replace(
            request,
            seed=None if request.seed is None else derive_seed(request.seed, index),
            request_id=sample_request_id(request.request_id, index, n),
        )
        for request in requests
        for index in range(n)
    ]


class RolloutEngine(abc.ABC):
    """A policy that generates samples and takes new weights.

    Weight-sync protocol (what the RL loop does every step)::

        engine.pause()          # abort (or freeze) in-flight generation
        engine.flush_cache()    # prefix caches hold KV and routes of the old weights
        stats = engine.sync_weights(hf_named_tensors, version)
        engine.resume()

    :func:`sync_weights_paused` does exactly that.
    """

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerateRequest], n: int = 1) -> list[GenerateResult]:
        """Complete every request ``n`` times; results prompt-major (``len(requests) * n``).

        With ``n > 1`` sample ``j`` of a request has id ``request_id/j`` and seed
        ``derive_seed(seed, j)``.
        """

    @abc.abstractmethod
    def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        """Abort the given in-flight requests (all when ``None``); they finish with "abort"."""

    @abc.abstractmethod
    def pause(self, mode: str = "abort") -> None:
        """Stop generating until :meth:`resume`: ``abort`` ends in-flight requests (partial
        results come back with finish_reason "abort"), ``in_place`` freezes them."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Continue after :meth:`pause`."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop cached prefixes (KV and routes); raise :class:`RolloutEngineError` if it cannot."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can generate a token now."""

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> SyncStats:
        """Load full (unsharded) tensors under their on-disk Hugging Face names and set the
        weight version. Strict: unknown or missing names and shape mismatches raise."""

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> list[np.ndarray]:
        """Teacher-forced log-probs: for each pair ``(prompts[i], responses[i])`` the ``[R_i]``
        float32 ``log_softmax(logits / temperature)[responses[i][j]]`` of the model's prediction
        at position ``len(prompts[i]) + j - 1`` (the convention of ``output_log_probs``), for
        the whole batch in one call. Nothing is generated and no weight changes. Engines
        that cannot score raise :class:`RolloutEngineError`."""
        raise RolloutEngineError(f"{type(self).__name__} cannot score given tokens")

    def release_memory(self) -> None:
        """Free the engine's accelerator memory for the trainer until the next
        :meth:`sync_weights` (``rollout.sglang.release_memory``). Engines in the trainer's
        process hold nothing of their own to free."""
        raise RolloutEngineError(f"{type(self).__name__} has no memory of its own to release")

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights generating now."""

    def recover(self, timeout_s: float) -> Optional[SyncStats]:
        """Bring back an engine whose servers died or restarted, within ``timeout_s``: restart
        the servers it launched (or wait for the others to answer again) and load the newest
        weights it was sent into every server that lost them, so that it never serves older
        weights. Returns the stats of the weights sent again (None: none was needed). Raises
        :class:`RolloutEngineError` when it cannot; an in-process engine cannot die alone.

        A server that came back when the weight transport keeps no copy of the newest weights
        (``tensor``, ``distributed``) is not an error: :attr:`needs_full_sync` is then set
        until the next :meth:`sync_weights`, which only the trainer can make."""
        raise RolloutEngineError(f"{type(self).__name__} cannot be restarted")

    @property
    def needs_full_sync(self) -> bool:
        """Whether a server came back (:meth:`recover`) without the newest weights and waits for
        the trainer's: :meth:`generate` refuses until a :meth:`sync_weights` succeeded."""
        return False

    def end_session(self, session_id: str) -> None:  # noqa: B027 - optional hook
        """Forget a session's server (sticky sessions, :attr:`GenerateRequest.session_id`):
        the session's episode ended. Engines without session routing keep nothing."""

    def info(self) -> dict[str, Any]:
        """Static description of the engine (kind, model, versions) for logs."""
        return {"engine": type(self).__name__, "weight_version": self.weight_version}

    def close(self) -> None:  # noqa: B027 - optional hook with nothing to release by default
        """Release threads, servers and memory."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_score_inputs(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperature: float
) -> None:
    """Raise ValueError unless :meth:`RolloutEngine.score`'s arguments make sense: as many
    prompts as responses, every prompt non-empty (its last token predicts the first response
    token), token ids >= 0, a positive temperature."""
    if len(prompts) != len(responses):
        raise ValueError(f"score: {len(prompts)} prompts for {len(responses)} responses")
    if not temperature > 0:
        raise ValueError(f"score: temperature={temperature} is not > 0")
    for index, (prompt, response) in enumerate(zip(prompts, responses)):
        if not len(prompt):
            raise ValueError(f"score: prompt {index} is empty")
        if min(prompt) < 0 or (len(response) and min(response) < 0):
            raise ValueError(f"score: pair {index} has negative token ids")


def sync_weights_paused(
    engine: RolloutEngine,
    named_tensors: Iterator[tuple[str, Any]],
    version: int,
    pause_mode: str = "abort",
) -> SyncStats:
    """Pause, flush, sync and resume: the weight update of one RL step.

    ``in_place`` keeps the paused requests in the running batch with their KV cache, so nothing
    is flushed (SGLang refuses to while requests hold cache): the continued requests attend to
    the old weights' keys and values (measured on SGLang 0.5.23: docs/sglang-protocol.md). The
    engine is resumed even when the sync fails, so that the error, not a hang, reaches the
    caller.
    """
    engine.pause(pause_mode)
    try:
        if pause_mode != "in_place":
            engine.flush_cache()
        return engine.sync_weights(named_tensors, version)
    finally:
        engine.resume()


@dataclass(frozen=True)
class EngineOptions:
    """What building an engine needs besides its configuration: every builder of
    :data:`megatron_gspo.rollout.factory.ENGINE_BUILDERS` receives it and reads what it uses."""

    seed: int = 0
    """Initial random weights of an embedded engine (real weights arrive by sync)."""
    enable_routed_experts: bool = False
    """R3: the engine must return each sample's routed experts (launched SGLang servers get
    --enable-return-routed-experts)."""
    work_dir: Optional[str] = None
    """Weight files of the disk transport and server logs; None: a fresh temporary directory."""
    master_address: Optional[str] = None
    """Rendezvous of the distributed weight transport; None: ``rollout.weight_sync_address``,
    else this machine's address towards the first server."""
    master_port: Optional[int] = None
    """Its port; None: ``rollout.weight_sync_port``, else a free one."""

    def working_dir(self) -> str:
        """``work_dir``, or a fresh temporary directory when it is None."""
        return self.work_dir or tempfile.mkdtemp(prefix="megatron_gspo_rollout_")
