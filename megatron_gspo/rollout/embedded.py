"""The embedded rollout engine: the current policy as a transformers model in this process.

The default engine and the CPU path. It follows SGLang's semantics so that swapping it for
SGLang changes speed, not numbers:

* log-probs at the sampling temperature, before top-k/top-p truncation (see ``sampling.py``);
  greedy decoding for ``temperature == 0`` (log-probs then at temperature 1);
* routed experts ``[L - 1, M, K]`` of its own routers, logical ids, dense layers skipped; with
  ``return_routed_expert_weights`` also the float32 combine weight its router gave each of them
  (the router's second output, renormalised and scaled: what its MoE block multiplied the
  expert's output by), which R3 with ``algo.routing_replay_weights=replayed`` replays;
* a weight version that only ``sync_weights`` changes;
* in a reduced precision (``dtype`` bfloat16 / float16, ``rollout.dtype``) every layer, the MoE
  router included, computes in that dtype and the output layer returns logits in it; they are
  upcast to float32 before the temperature, the log-softmax and sampling, as SGLang's
  ``LogitsProcessor`` (``logits.float()``) and ``Sampler`` (softmax / log in float32) do. So
  routes and log-probs differ from the fp32 trainer's as SGLang's do;
* with ``route_source="float32_twin"`` (``rollout.embedded_route_source``) a float32 copy of the
  model (``route_twin.py``) runs first at every forward and its experts are forced in the
  engine's routers (``route_forcing.py``): the trainer's routes in a bf16 / fp16 engine, whose
  gap is then its precision's without routing flips; the routes it reports are the forced ones.

One difference: it stops on ``stop_token_ids`` only, whereas SGLang also stops on the model's
EOS token unless ``ignore_eos``; put the EOS id in ``stop_token_ids`` (the trainer does) to get
the same samples from both.

Generation is batched with a KV cache: prompts are left-padded, positions come from the
attention mask, and rows that finish are dropped from the cache. Each request samples from its
own ``torch.Generator`` (its ``seed``; one uniform per token, inverse CDF, see ``sampling.py``),
so its tokens depend on its seed and its logits only: the batch it shares changes logits by
float rounding (padding changes reduction lengths), which can flip a sample only when its
uniform falls within that rounding of a token boundary of the CDF.

Thread safety: ``generate`` may run concurrently from several threads (the loopback server does);
each forward and each weight commit hold the model lock, so a sync lands between decode steps.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from megatron_gspo.config import (
    EMBEDDED_MAX_BATCH_SIZE,
    EMBEDDED_ROUTE_SOURCES,
    ModelConfig,
    RolloutConfig,
)
from megatron_gspo.rollout.hf_model import RouteRecorder, build_hf_model, moe_layer_indices
from megatron_gspo.rollout.route_forcing import RouteForcer
from megatron_gspo.rollout.route_twin import Float32RouteTwin
from megatron_gspo.rollout.sampling import UniformStreams, sample_tokens, temperature_log_probs
from megatron_gspo.rollout.types import (
    PAUSE_MODES,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    RolloutEngineError,
    check_score_inputs,
    expand_samples,
)
from megatron_gspo.rollout.weight_loader import HFWeightLayout, iter_safetensors_directory
from megatron_gspo.samples.routes import route_numpy_dtype
from megatron_gspo.weight_sync import StableTensorStream, SyncStats

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    """One in-flight sample and what it has produced so far."""

    request: GenerateRequest
    seed: int
    length_limit: int
    """Most tokens it may generate: ``max_new_tokens``, or less near ``max_positions``."""
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    """Weight version of the forward whose logits sampled each output token."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """Chunks of ``[rows, M, K]`` expert ids, in token order."""
    route_weights: list[torch.Tensor] = field(default_factory=list)
    """Chunks of ``[rows, M, K]`` float32 combine weights beside ``routes`` (when asked)."""
    weight_version: int = 0
    finish_reason: Optional[str] = None
    matched_stop_token: Optional[int] = None
    abort_message: Optional[str] = None

    @property
    def prompt_length(self) -> int:
        return len(self.request.input_ids)


def _held_back_stops(
    batch: Sequence[_Sample], generated: int, vocab_size: int
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``([N] rows, [N] token ids)``: the stop tokens SGLang's ``min_new_tokens`` forbids in rows
    that have generated fewer tokens than it (None when there are none). Sparse, since a
    ``[B, V]`` mask costs a pass over 10M entries per step at a 150k vocabulary."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, sample in enumerate(batch):
        if sample.request.min_new_tokens > generated:
            stops = {t for t in sample.request.stop_token_ids if t < vocab_size}
            rows.extend([row] * len(stops))
            tokens.extend(sorted(stops))
    if not rows:
        return None
    return torch.tensor(rows), torch.tensor(tokens)


class EmbeddedEngine(RolloutEngine):
    """Generates with a transformers copy of the policy (see the module docstring).

    Args:
        model_config: architecture of the policy.
        seed: initialises the random weights and the seeds of requests that carry none.
        max_batch_size: most samples decoded together (longer lists run in several batches,
            grouped by prompt length to limit padding; ``rollout.embedded_max_batch_size``).
            The batch a sample shares changes its log-probs by rounding (batch variance).
        dtype: parameter and compute dtype of the whole forward, router included (``rollout.
            dtype``): float32 is the trainer's exact twin; bfloat16 / float16 cast the weights
            at each sync and compute in that dtype, as SGLang does (a real mismatch).
        pause_wait_timeout_s: how long ``generate`` waits for ``resume`` after ``pause``.
        hf_model: use this transformers model instead of building one (shares its weights).
        route_source: ``own`` (the routers choose) or ``float32_twin`` (``rollout.
            embedded_route_source``): a float32 copy of the model, started from the same
            weights and loaded by every sync, chooses the experts of every forward (generation
            and ``score``) and the engine's routers are forced to them (weights recomputed by
            the engine's routers). Its routes are the fp32 trainer's; in float32 the engine is
            unchanged bit for bit. MoE models only (``ValueError`` otherwise).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        seed: int = 0,
        max_batch_size: int = EMBEDDED_MAX_BATCH_SIZE,
        dtype: torch.dtype = torch.float32,
        pause_wait_timeout_s: float = 600.0,
        hf_model: Any = None,
        route_source: str = "own",
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if route_source not in EMBEDDED_ROUTE_SOURCES:
            raise ValueError(
                f"route_source={route_source!r} is not one of {EMBEDDED_ROUTE_SOURCES}"
            )
        self.model_config = model_config
        self.hf_model = (
            hf_model
            if hf_model is not None
            else build_hf_model(model_config, dtype=dtype, seed=seed)
        )
        self.hf_model.eval()
        self.reduced_precision = next(self.hf_model.parameters()).dtype != torch.float32
        self.max_batch_size = max_batch_size
        self.pause_wait_timeout_s = pause_wait_timeout_s
        self.moe_layer_indices = moe_layer_indices(self.hf_model)
        self.num_hidden_layers = self.hf_model.config.num_hidden_layers
        self.vocab_size = self.hf_model.config.vocab_size
        self.max_positions = self.hf_model.config.max_position_embeddings
        self.route_dtype = route_numpy_dtype(max(model_config.num_experts, 1))
        self._layout = HFWeightLayout(self.hf_model)
        # The router hooks stay registered for the engine's life; forwards (and so recordings)
        # are serialised by the model lock, which keeps concurrent generate calls apart.
        self._recorder = RouteRecorder(self.hf_model, enabled=False).__enter__()
        self.route_source = route_source
        self._forcer: Optional[RouteForcer] = None
        self._twin: Optional[Float32RouteTwin] = None
        if route_source == "float32_twin":
            # The forcer refuses a dense model or a router whose weight rule it does not know.
            self._forcer = RouteForcer(self.hf_model)
            # Built like the engine's model (the same fp32 initial weights, before the engine's
            # cast), or from the model the engine was given.
            self._twin = Float32RouteTwin(
                model_config,
                seed=seed,
                weights=None if hf_model is None else self._layout.disk_state(),
            )
        self._seed_rng = random.Random(seed)
        self._weight_version = 0
        self._model_lock = threading.Lock()
        self._state = threading.Condition()
        self._paused: Optional[str] = None
        self._abort_epoch = 0
        self._aborted_ids: set[str] = set()
        self._running_calls = 0
        self._in_flight_ids: set[str] = set()
        self._closed = False

    @classmethod
    def from_config(
        cls, model: ModelConfig, rollout: Optional[RolloutConfig] = None, *, seed: int = 0
    ) -> EmbeddedEngine:
        """The engine for ``model`` in ``rollout.dtype`` (float32 without ``rollout``) with
        ``rollout.embedded_max_batch_size`` and ``rollout.embedded_route_source``; the sampling
        settings travel in each request."""
        rollout = rollout if rollout is not None else RolloutConfig()
        return cls(
            model,
            seed=seed,
            dtype=getattr(torch, rollout.dtype),
            max_batch_size=rollout.embedded_max_batch_size,
            route_source=rollout.embedded_route_source,
        )

    # ------------------------------------------------------------------ properties and info

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def info(self) -> dict[str, Any]:
        return {
            "engine": "embedded",
            "architecture": self.model_config.architecture,
            "hf_architecture": type(self.hf_model).__name__,
            "weight_version": self._weight_version,
            "num_hidden_layers": self.num_hidden_layers,
            "moe_layer_indices": list(self.moe_layer_indices),
            "num_experts": self.model_config.num_experts if self.moe_layer_indices else 0,
            "moe_router_topk": self.model_config.moe_router_topk if self.moe_layer_indices else 0,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_positions,
            "dtype": str(next(self.hf_model.parameters()).dtype).removeprefix("torch."),
            "route_source": self.route_source,
        }

    @property
    def num_running(self) -> int:
        """``generate`` calls in progress."""
        with self._state:
            return self._running_calls

    # ------------------------------------------------------------------ control

    def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        with self._state:
            if request_ids is None:
                self._abort_epoch += 1
            else:
                self._aborted_ids.update(request_ids)
            self._state.notify_all()

    def pause(self, mode: str = "abort") -> None:
        """``abort``: end in-flight requests and return once none is running; ``in_place``:
        freeze them between decode steps. New ``generate`` calls wait for :meth:`resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        with self._state:
            self._paused = mode
            if mode == "abort":
                self._abort_epoch += 1
                self._state.notify_all()
                if not self._state.wait_for(
                    lambda: self._running_calls == 0, timeout=self.pause_wait_timeout_s
                ):
                    raise RolloutEngineError(
                        f"embedded engine: {self._running_calls} generate calls still running "
                        f"{self.pause_wait_timeout_s:.0f}s after pause(abort)"
                    )

    def resume(self) -> None:
        with self._state:
            self._paused = None
            self._state.notify_all()

    def flush_cache(self) -> None:
        """There is no prefix cache to flush; like SGLang, refuse while requests are running
        (their caches would hold KV of the old weights)."""
        with self._state:
            if self._running_calls and self._paused != "in_place":
                raise RolloutEngineError(
                    f"embedded engine: cannot flush the cache while {self._running_calls} "
                    "generate calls are running; pause() first"
                )

    def health(self) -> bool:
        if self._closed:
            return False
        with self._model_lock, torch.no_grad():
            logits = self.hf_model(input_ids=torch.zeros(1, 1, dtype=torch.long)).logits
        return bool(torch.isfinite(logits).all())

    def close(self) -> None:
        self._closed = True
        self.abort()
        self.resume()

    # ------------------------------------------------------------------ weights

    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> SyncStats:
        """Load a full set of on-disk-named HF tensors by value (see ``weight_loader.py``).

        The stream is staged and checked before any parameter changes, so a failed sync leaves
        the weights and the version as they were. ``version`` must not go backwards.
        """
        if version < self._weight_version:
            raise ValueError(
                f"weight sync: version {version} is older than the current {self._weight_version}"
            )
        start = time.perf_counter()
        # Staging runs outside the model lock (the stream may read disk or a network), so
        # generation only stops for the final copy.
        # A stable stream (the trainer's own parameters, unchanged during the sync) is staged by
        # reference: no second copy of the model exists at any time.
        borrow = isinstance(named_tensors, StableTensorStream)
        tensors = ((name, torch.as_tensor(tensor)) for name, tensor in named_tensors)
        # The float32 twin takes the same stream, read once: each tensor is kept for it (a
        # float32 copy, or the stable stream's own tensor) and staged after the engine's
        # staging has checked the whole set, so a failed sync changes neither model.
        kept_for_twin: list = []
        if self._twin is not None:
            tensors = self._twin.tap(tensors, kept_for_twin, borrow=borrow)
        staged, num_tensors, num_bytes = self._layout.stage(tensors, borrow=borrow)
        twin_staged = self._twin.stage(kept_for_twin) if self._twin is not None else None
        with self._model_lock:
            self._layout.commit(staged)
            if self._twin is not None:
                self._twin.commit(twin_staged)
            self._weight_version = int(version)
        return SyncStats(
            weight_version=int(version),
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            seconds=time.perf_counter() - start,
        )

    def load_weights_from_directory(self, path: str, version: int) -> SyncStats:
        """``sync_weights`` from the ``*.safetensors`` files of an HF checkpoint directory."""
        return self.sync_weights(iter_safetensors_directory(path), version)

    def hf_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights under their on-disk HF names (views; copy before mutating)."""
        return self._layout.disk_state()

    # ------------------------------------------------------------------ scoring

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> list[np.ndarray]:
        """Teacher-forced log-probs (:meth:`RolloutEngine.score`): one forward per batch of at
        most ``max_batch_size`` sequences, right-padded (causal attention: padding after a
        sequence never reaches its positions), logits upcast to float32 before the
        log-softmax as in generation."""
        check_score_inputs(prompts, responses, temperature)
        sequences = [[*map(int, p), *map(int, r)] for p, r in zip(prompts, responses)]
        for index, sequence in enumerate(sequences):
            if max(sequence) >= self.vocab_size:
                raise ValueError(
                    f"score: pair {index} has token id {max(sequence)} outside the vocabulary "
                    f"(size {self.vocab_size})"
                )
            if len(sequence) > self.max_positions:
                raise ValueError(
                    f"score: pair {index} has {len(sequence)} tokens, more than "
                    f"max_position_embeddings={self.max_positions}"
                )
        results: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(sequences)
        # Similar lengths together: less padding per forward.
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        for begin in range(0, len(order), self.max_batch_size):
            batch = order[begin : begin + self.max_batch_size]
            width = max(len(sequences[i]) for i in batch)
            input_ids = torch.zeros(len(batch), width, dtype=torch.long)
            attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, index in enumerate(batch):
                input_ids[row, : len(sequences[index])] = torch.tensor(sequences[index])
                attention_mask[row, : len(sequences[index])] = 1
            with self._model_lock, torch.inference_mode():
                if self._closed:
                    raise RolloutEngineError("embedded engine: score() after close()")
                forced = (
                    self._twin.routes(input_ids, attention_mask, None)
                    if self._twin is not None
                    else None
                )
                with self._forced_routes(forced):
                    logits = self.hf_model(
                        input_ids=input_ids, attention_mask=attention_mask
                    ).logits
            for row, index in enumerate(batch):
                prompt_length, response = len(prompts[index]), responses[index]
                if not len(response):
                    continue
                # Position prompt_length + j - 1 predicts response token j.
                rows = logits[row, prompt_length - 1 : prompt_length - 1 + len(response)]
                log_probs = torch.log_softmax(rows.float() / temperature, dim=-1)
                targets = torch.tensor([int(t) for t in response]).unsqueeze(-1)
                results[index] = log_probs.gather(-1, targets).squeeze(-1).numpy().copy()
        return results

    # ------------------------------------------------------------------ generation

    def generate(self, requests: Sequence[GenerateRequest], n: int = 1) -> list[GenerateResult]:
        samples = [self._new_sample(request) for request in expand_samples(requests, n)]
        if not samples:
            return []
        self._enter_generate([sample.request.request_id for sample in samples])
        try:
            # Similar lengths together: less padding, and results do not depend on the order.
            order = sorted(range(len(samples)), key=lambda i: samples[i].prompt_length)
            for begin in range(0, len(order), self.max_batch_size):
                self._generate_batch(
                    [samples[i] for i in order[begin : begin + self.max_batch_size]]
                )
        finally:
            self._leave_generate([sample.request.request_id for sample in samples])
        return [self._result(sample) for sample in samples]

    def _new_sample(self, request: GenerateRequest) -> _Sample:
        prompt_length = len(request.input_ids)
        if max(request.input_ids) >= self.vocab_size:
            raise ValueError(
                f"request {request.request_id!r}: token id {max(request.input_ids)} is outside "
                f"the vocabulary (size {self.vocab_size})"
            )
        if prompt_length >= self.max_positions:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {prompt_length} tokens leaves no room "
                f"to generate within max_position_embeddings={self.max_positions}"
            )
        if (
            request.min_new_tokens
            and len({t for t in request.stop_token_ids if t < self.vocab_size}) == self.vocab_size
        ):
            raise ValueError(
                f"request {request.request_id!r}: every token of the vocabulary is a stop token, "
                f"so none may be sampled before min_new_tokens={request.min_new_tokens}; leave "
                "at least one token out of stop_token_ids"
            )
        if request.return_routed_expert_weights and not request.return_routed_experts:
            raise ValueError(
                f"request {request.request_id!r}: routed expert weights asked without the routed "
                "experts"
            )
        if request.return_routed_experts and not self.moe_layer_indices:
            raise ValueError(
                f"request {request.request_id!r}: routed experts asked of the dense "
                f"{self.model_config.architecture} model"
            )
        seed = request.seed if request.seed is not None else self._seed_rng.getrandbits(63)
        limit = min(request.max_new_tokens, self.max_positions - prompt_length)
        return _Sample(request=request, seed=seed, length_limit=limit)

    def _enter_generate(self, request_ids: list[str]) -> None:
        with self._state:
            if self._closed:
                raise RolloutEngineError("embedded engine: generate() after close()")
            if not self._state.wait_for(
                lambda: self._paused is None, timeout=self.pause_wait_timeout_s
            ):
                raise RolloutEngineError(
                    f"embedded engine: paused for more than {self.pause_wait_timeout_s:.0f}s; "
                    "call resume() after the weight sync"
                )
            self._running_calls += 1
            self._in_flight_ids.update(request_ids)

    def _leave_generate(self, request_ids: list[str]) -> None:
        with self._state:
            self._running_calls -= 1
            self._in_flight_ids.difference_update(request_ids)
            self._aborted_ids.difference_update(request_ids)
            self._state.notify_all()

    def _abort_reasons(self, samples: Sequence[_Sample], epoch: int) -> list[Optional[str]]:
        """Why each sample must stop now, or None; waits here while paused in place. One lock
        per decode step (not per sample): the check runs before every token."""
        with self._state:
            while self._paused == "in_place" and self._abort_epoch == epoch:
                self._state.wait()
            if self._abort_epoch != epoch:
                reason = "Aborted by pause_generation or abort_all" if self._paused else "Aborted"
                return [reason] * len(samples)
            if not self._aborted_ids:
                return [None] * len(samples)
            reasons: list[Optional[str]] = []
            for sample in samples:
                request_id = sample.request.request_id
                parent_id = request_id.rsplit("/", 1)[0]
                aborted = request_id in self._aborted_ids or parent_id in self._aborted_ids
                reasons.append("Aborted by abort_request" if aborted else None)
            return reasons

    def _forced_routes(self, routes: Optional[list[torch.Tensor]]):
        """The context of a forward whose routers are forced to ``routes`` (the float32
        twin's), or of one whose routers choose (``routes`` None)."""
        if self._forcer is None:
            return contextlib.nullcontext()
        return self._forcer.forcing(routes)

    def _forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        cache,
        want_routes: bool,
        twin_cache=None,
        want_weights: bool = False,
    ) -> tuple[torch.Tensor, int, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(logits, version, routes, route_weights)``: last-position fp32 logits ``[B, V]``,
        the weight version that produced them and, if asked, the routes ``[B, S, M, K]`` of
        every position and (``want_weights``) the float32 combine weights the routers gave them.
        With a float32 twin, it runs first on the same inputs (``twin_cache``: its KV cache)
        and the engine's routers follow its choice (the weights are then the engine's routers'
        at the forced ids: what multiplied the experts' outputs).
        """
        batch_size, seq_len = input_ids.shape
        with self._model_lock, torch.inference_mode():
            forced = None
            if self._twin is not None:
                forced = self._twin.routes(input_ids, attention_mask, position_ids, twin_cache)
            self._recorder.enabled = want_routes
            self._recorder.record_weights = want_routes and want_weights
            try:
                with self._forced_routes(forced):
                    logits = self._logits(input_ids, attention_mask, position_ids, cache)
                routes = weights = None
                if want_routes:
                    routes = torch.stack(self._recorder.pop(batch_size, seq_len), dim=2)
                if want_routes and want_weights:
                    weights = torch.stack(self._recorder.pop_weights(batch_size, seq_len), dim=2)
            finally:
                self._recorder.enabled = self._recorder.record_weights = False
            # In a reduced-precision engine the logits leave the output layer in bf16/fp16; the
            # softmax that follows runs in float32, as in SGLang (see the module docstring).
            return logits.float(), self._weight_version, routes, weights

    def _logits(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """``[B, V]`` last-position logits of one forward (in the model's dtype)."""
        if self.reduced_precision:
            return self._reduced_precision_logits(input_ids, attention_mask, position_ids, cache)
        return self.hf_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]

    def _reduced_precision_logits(self, input_ids, attention_mask, position_ids, cache):
        """``[B, V]`` last-position logits of a bf16 / fp16 model: the decoder, then the output
        layer on the contiguous ``[B, H]`` last hidden states. (transformers applies it to the
        strided ``[B, 1, H]`` slice of a prefill, for which torch's CPU matmul copies the
        ``[V, H]`` weight once per row in bf16: 512 MB and seconds per prefill at V = 8,192.)
        Same operations as the ``*ForCausalLM`` forward of the supported architectures."""
        hidden = self.hf_model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        return self.hf_model.lm_head(hidden[:, -1, :].contiguous())

    def _generate_batch(self, batch: list[_Sample]) -> None:
        # Inference mode, not just no_grad: no version counters or view tracking on the ~100
        # small ops of a decode step (~10% of a step of a small model on CPU); the tensors that
        # leave (tokens, log-probs, routes) are read, never updated in place.
        with torch.inference_mode():
            self._decode_batch(batch)

    def _decode_batch(self, batch: list[_Sample]) -> None:
        from transformers import DynamicCache

        with self._state:
            epoch = self._abort_epoch
        padded_length = max(sample.prompt_length for sample in batch)
        input_ids = torch.zeros(len(batch), padded_length, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), padded_length, dtype=torch.long)
        for row, sample in enumerate(batch):
            start = padded_length - sample.prompt_length
            input_ids[row, start:] = torch.tensor(sample.request.input_ids)
            attention_mask[row, start:] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        # Without left padding the mask is all ones: leave it out (same attention, and the
        # model then skips building and checking it at every step).
        if all(sample.prompt_length == padded_length for sample in batch):
            attention_mask = None
        temperatures = torch.tensor([s.request.temperature for s in batch], dtype=torch.float32)
        top_p = torch.tensor([s.request.top_p for s in batch], dtype=torch.float32)
        top_k = torch.tensor([s.request.top_k for s in batch], dtype=torch.long)
        streams = UniformStreams([s.seed if s.request.temperature > 0 else None for s in batch])
        prompt_lengths = torch.tensor([s.prompt_length for s in batch], dtype=torch.long)
        # The held-back stop tokens change only when rows leave or reach min_new_tokens.
        thresholds = {
            s.request.min_new_tokens
            for s in batch
            if s.request.min_new_tokens and s.request.stop_token_ids
        }
        held_back = _held_back_stops(batch, 0, self.vocab_size) if thresholds else None
        want_routes = any(s.request.return_routed_experts for s in batch)
        want_weights = any(s.request.return_routed_expert_weights for s in batch)
        cache = DynamicCache(config=self.hf_model.config)
        twin_cache = self._twin.new_cache() if self._twin is not None else None

        logits, version, routes, route_weights = self._forward(
            input_ids, attention_mask, position_ids, cache, want_routes, twin_cache, want_weights
        )
        for row, sample in enumerate(batch):
            sample.weight_version = version
            if want_routes:
                sample.routes.append(routes[row, padded_length - sample.prompt_length :])
            if want_weights:
                start = padded_length - sample.prompt_length
                sample.route_weights.append(route_weights[row, start:])

        live = list(batch)
        # Rows decode in lockstep (one token per live row per step; finished rows leave), so
        # every live row has generated exactly ``generated`` tokens.
        generated = 0
        while live:
            for sample, reason in zip(live, self._abort_reasons(live, epoch)):
                if reason is not None:
                    sample.finish_reason, sample.abort_message = "abort", reason
            running = [row for row, sample in enumerate(live) if sample.finish_reason is None]
            if running:
                log_probs = temperature_log_probs(logits, temperatures)
                # Only sampling sees the held-back stops; the reported log-probs stay the full ones.
                tokens = sample_tokens(
                    log_probs, temperatures, top_p, top_k, streams.next(), excluded=held_back
                )
                # One conversion per step instead of one tensor index per row.
                token_list = tokens.tolist()
                chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
                for row in running:
                    self._append_token(live[row], token_list[row], chosen[row], version)
                generated += 1
            keep = [row for row, sample in enumerate(live) if sample.finish_reason is None]
            if not keep:
                break
            rows_left = len(keep) < len(live)
            if rows_left:
                # Finished rows leave the batch (and the KV cache) instead of decoding padding.
                index = torch.tensor(keep)
                cache.batch_select_indices(index)
                if twin_cache is not None:
                    twin_cache.batch_select_indices(index)
                tokens = tokens[index]
                temperatures, top_p, top_k = temperatures[index], top_p[index], top_k[index]
                prompt_lengths = prompt_lengths[index]
                streams.keep(keep)
                live = [live[row] for row in keep]
                if attention_mask is not None:
                    attention_mask = attention_mask[index]
            if thresholds and (rows_left or generated in thresholds):
                held_back = _held_back_stops(live, generated, self.vocab_size)
            if attention_mask is not None:
                attention_mask = torch.cat(
                    [attention_mask, torch.ones(len(live), 1, dtype=torch.long)], dim=1
                )
            # The token just sampled sits at position prompt_length + generated - 1.
            position_ids = (prompt_lengths + (generated - 1)).unsqueeze(1)
            logits, version, routes, route_weights = self._forward(
                tokens.unsqueeze(1),
                attention_mask,
                position_ids,
                cache,
                want_routes,
                twin_cache,
                want_weights,
            )
            for row, sample in enumerate(live):
                sample.weight_version = min(sample.weight_version, version)
                if want_routes:
                    sample.routes.append(routes[row])
                if want_weights:
                    sample.route_weights.append(route_weights[row])

    def _append_token(self, sample: _Sample, token: int, log_prob: float, version: int) -> None:
        sample.output_ids.append(token)
        sample.log_probs.append(log_prob)
        sample.token_versions.append(version)
        if token in sample.request.stop_token_ids:
            sample.finish_reason, sample.matched_stop_token = "stop", token
        elif len(sample.output_ids) >= sample.length_limit:
            sample.finish_reason = "length"

    def _result(self, sample: _Sample) -> GenerateResult:
        request = sample.request
        routed_experts = routed_expert_weights = None
        if request.return_routed_experts:
            # The last generated token is never run forward: L - 1 rows (an abort before the
            # first token drops the last prompt row the same way).
            num_rows = sample.prompt_length + len(sample.output_ids) - 1
            routes = torch.cat(sample.routes, dim=0)[:num_rows]
            routed_experts = routes.numpy().astype(self.route_dtype)
            if request.return_routed_expert_weights:
                weights = torch.cat(sample.route_weights, dim=0)[:num_rows]
                routed_expert_weights = weights.numpy().astype(np.float32)
        return GenerateResult(
            request_id=request.request_id,
            output_ids=list(sample.output_ids),
            output_log_probs=np.asarray(sample.log_probs, dtype=np.float32)
            if request.return_logprob
            else None,
            finish_reason=sample.finish_reason or "abort",
            prompt_length=sample.prompt_length,
            weight_version=sample.weight_version,
            routed_experts=routed_experts,
            routed_expert_weights=routed_expert_weights,
            output_weight_versions=np.asarray(sample.token_versions, dtype=np.int64),
            matched_stop_token=sample.matched_stop_token,
            abort_message=sample.abort_message,
        )
