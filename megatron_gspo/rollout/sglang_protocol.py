"""SGLang 0.5.x ``/generate`` JSON: building requests, parsing responses, routed-experts codec.

Pure functions shared by the SGLang client (which parses) and the embedded loopback server (which
answers in the same shape). No sglang import. Shapes and fields follow
``docs/sglang-protocol.md`` sections 1-2:

* request: ``input_ids`` (one list, or a list of lists for a batch), ``rid``,
  ``sampling_params`` (dict, or one per prompt), ``return_logprob``, ``return_routed_experts``;
  ``n > 1`` expands prompt-major: prompt0 x n, then prompt1 x n.
* response: a dict (single prompt, n == 1) or a list; each item has ``output_ids`` and
  ``meta_info`` with ``finish_reason {type: stop|length|abort, matched|length|message}``,
  ``output_token_logprobs [[logprob, token_id, text|null], ...]``, ``weight_version`` (a string)
  and ``routed_experts``: base64 of a flat int32 array ``[L - 1, num_hidden_layers, K]`` with
  dense layers zero-filled.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from megatron_gspo.rollout.types import (
    GenerateRequest,
    GenerateResult,
    RolloutEngineError,
    sample_request_id,
)
from megatron_gspo.samples.routes import route_numpy_dtype


@dataclass(frozen=True)
class RouteLayout:
    """How routed experts are laid out: which hidden layers are MoE, top-k, expert count."""

    num_hidden_layers: int
    moe_layer_indices: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def from_model_config(cls, model: Any) -> RouteLayout:
        """From a :class:`~megatron_gspo.config.ModelConfig`."""
        return cls(
            num_hidden_layers=model.num_layers,
            moe_layer_indices=tuple(model.moe_layer_indices),
            top_k=model.moe_router_topk,
            num_experts=model.num_experts,
        )


def encode_routed_experts(routes: np.ndarray, layout: RouteLayout) -> str:
    """``[rows, M, K]`` ids (MoE layers only) -> SGLang's base64 int32 ``[rows, layers, K]``."""
    rows = routes.shape[0]
    full = np.zeros((rows, layout.num_hidden_layers, layout.top_k), dtype=np.int32)
    full[:, list(layout.moe_layer_indices), :] = routes
    return base64.b64encode(full.tobytes()).decode("ascii")


def decode_routed_experts(value: Any, num_rows: int, layout: RouteLayout) -> np.ndarray:
    """SGLang's base64 int32 routes -> ``[num_rows, M, K]`` ids of the MoE layers.

    Raises ``ValueError`` when the string is not base64, its element count is not
    ``num_rows * num_hidden_layers * K`` (slime checks the same), or an id is out of range.
    """
    if not isinstance(value, str):
        raise ValueError(f"routed_experts is {type(value).__name__}, expected a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"routed_experts is not valid base64 ({error})") from None
    if len(raw) % 4:
        raise ValueError(f"routed_experts holds {len(raw)} bytes, not a whole number of int32")
    flat = np.frombuffer(raw, dtype=np.int32)
    expected = num_rows * layout.num_hidden_layers * layout.top_k
    if flat.size != expected:
        raise ValueError(
            f"routed_experts holds {flat.size} int32, expected {expected} = (prompt + response - 1 "
            f"= {num_rows}) x {layout.num_hidden_layers} layers x top-{layout.top_k}; was the "
            "server started with --enable-return-routed-experts for this model?"
        )
    routes = flat.reshape(num_rows, layout.num_hidden_layers, layout.top_k)
    routes = routes[:, list(layout.moe_layer_indices), :]
    if routes.size and (routes.min() < 0 or routes.max() >= layout.num_experts):
        raise ValueError(
            f"routed_experts has ids in [{routes.min()}, {routes.max()}], outside "
            f"[0, {layout.num_experts})"
        )
    return routes.astype(route_numpy_dtype(layout.num_experts))


def sampling_params_json(request: GenerateRequest, n: int = 1) -> dict[str, Any]:
    """SGLang ``sampling_params`` of one request (token-level: no stop strings, no trimming)."""
    params: dict[str, Any] = {
        "max_new_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "n": n,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if request.stop_token_ids:
        params["stop_token_ids"] = list(request.stop_token_ids)
    if request.min_new_tokens:
        params["min_new_tokens"] = request.min_new_tokens
    if request.seed is not None:
        params["sampling_seed"] = request.seed
    return params


def build_generate_payload(requests: Sequence[GenerateRequest], n: int = 1) -> dict[str, Any]:
    """The ``/generate`` body for ``requests`` (a batch when there are several).

    All requests of one call must agree on ``return_logprob`` and ``return_routed_experts``
    (SGLang takes one ``return_routed_experts`` per call, and lists of logprob flags are refused
    with ``n > 1``).
    """
    if not requests:
        raise ValueError("build_generate_payload: no requests")
    flags = {(r.return_logprob, r.return_routed_experts) for r in requests}
    if len(flags) > 1:
        raise ValueError("requests of one /generate call must share return_logprob/routed_experts")
    return_logprob, return_routed_experts = flags.pop()
    payload: dict[str, Any] = {
        "return_logprob": return_logprob,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
        payload["routed_experts_start_len"] = 0
    if len(requests) == 1:
        payload.update(
            input_ids=list(requests[0].input_ids),
            rid=requests[0].request_id,
            sampling_params=sampling_params_json(requests[0], n),
        )
    else:
        payload.update(
            input_ids=[list(r.input_ids) for r in requests],
            rid=[r.request_id for r in requests],
            sampling_params=[sampling_params_json(r, n) for r in requests],
        )
    return payload


def build_score_payload(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """The ``/generate`` body that scores each ``prompt + response`` teacher-forced: nothing
    generated (``max_new_tokens=0``), the prompt log-probs asked from position ``len(prompt) -
    1`` on. SGLang 0.5.23 answers ``input_token_logprobs`` ``[[logprob, token_id, text], ...]``
    for the tokens from ``logprob_start_len`` on, the first entry's log-prob null (it computes
    the predictions made at the positions from ``logprob_start_len`` on, so the token at that
    position itself gets none), and at temperature 1 whatever ``temperature`` says
    (docs/distillation.md; checked against a float64 forward by tests/real_sglang)."""
    return {
        "input_ids": [[*map(int, p), *map(int, r)] for p, r in zip(prompts, responses)],
        "sampling_params": [{"max_new_tokens": 0, "temperature": 1.0} for _ in prompts],
        "return_logprob": True,
        "logprob_start_len": [len(p) - 1 for p in prompts],
        "top_logprobs_num": 0,
    }


def parse_score_response(
    body: Any, responses: Sequence[Sequence[int]], *, source: str = "SGLang"
) -> list[np.ndarray]:
    """``[R_i]`` float32 log-probs of each response from the answer to
    :func:`build_score_payload` (its first, null entry dropped), the token ids checked."""
    items = body if isinstance(body, list) else [body]
    if len(items) != len(responses):
        raise RolloutEngineError(
            f"{source}: {len(items)} answers to {len(responses)} scoring requests"
        )
    results = []
    for index, (item, response) in enumerate(zip(items, responses)):
        entries = (
            (item.get("meta_info") or {}).get("input_token_logprobs")
            if isinstance(item, dict)
            else None
        )
        if not isinstance(entries, list) or len(entries) != len(response) + 1:
            raise RolloutEngineError(
                f"{source}: scoring answer {index} holds {len(entries or [])} prompt log-probs, "
                f"expected {len(response) + 1} (the last prompt token and {len(response)} "
                "response tokens)"
            )
        tokens = [int(entry[1]) for entry in entries[1:]]
        if tokens != [int(t) for t in response]:
            raise RolloutEngineError(
                f"{source}: scoring answer {index} scored tokens {tokens}, not {list(response)}"
            )
        results.append(np.array([float(entry[0]) for entry in entries[1:]], dtype=np.float32))
    return results


def parse_weight_version(value: Any) -> int:
    """SGLang's weight version string as our int (``"default"``, a fresh server's, is 0)."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"weight_version {value!r} is not an integer; launch the server with "
            "--weight-version 0 and sync weights through this client"
        ) from None


def parse_weight_version_spans(spans: Any, num_tokens: int) -> Optional[np.ndarray]:
    """``[R]`` int64 weight version per output token from SGLang's ``weight_versions``: spans
    ``{"version", "start", "end"}`` over output-token offsets, ``end`` exclusive, covering every
    token once. None when the answer has none (older servers)."""
    if spans is None:
        return None
    if not isinstance(spans, list) or not all(isinstance(span, dict) for span in spans):
        raise ValueError(f"weight_versions {spans!r} is not a list of spans")
    versions = np.full(num_tokens, -1, dtype=np.int64)
    for span in spans:
        start, end = span.get("start"), span.get("end")
        if not (
            isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= num_tokens
        ):
            raise ValueError(f"weight_versions span {span!r} is outside the {num_tokens} tokens")
        if (versions[start:end] != -1).any():
            raise ValueError(f"weight_versions spans overlap at {span!r}")
        versions[start:end] = parse_weight_version(span.get("version"))
    if (versions == -1).any():
        missing = int(np.flatnonzero(versions == -1)[0])
        raise ValueError(f"weight_versions spans do not cover output token {missing}")
    return versions


def weight_version_spans(versions: np.ndarray) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions`` spans of per-token versions (runs of equal versions)."""
    spans: list[dict[str, Any]] = []
    for position, version in enumerate(int(v) for v in versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": str(version), "start": position, "end": position + 1})
    return spans


def _parse_item(
    item: Any, request: GenerateRequest, result_id: str, layout: Optional[RouteLayout]
) -> GenerateResult:
    if not isinstance(item, dict):
        raise ValueError(f"item is {type(item).__name__}, expected an object")
    output_ids = item.get("output_ids")
    meta = item.get("meta_info")
    if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
        raise ValueError("output_ids is missing or not a list of ints")
    if not isinstance(meta, dict):
        raise ValueError("meta_info is missing or not an object")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise ValueError(f"finish_reason {finish!r} is not {{type: stop|length|abort, ...}}")
    prompt_tokens = meta.get("prompt_tokens", len(request.input_ids))
    if prompt_tokens != len(request.input_ids):
        raise ValueError(
            f"prompt_tokens={prompt_tokens} but the request had {len(request.input_ids)} tokens"
        )
    log_probs = None
    if request.return_logprob:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(output_ids):
            raise ValueError(
                f"output_token_logprobs has {len(entries) if isinstance(entries, list) else entries!r}"
                f" entries for {len(output_ids)} output tokens"
            )
        for position, (entry, token) in enumerate(zip(entries, output_ids)):
            if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token:
                raise ValueError(
                    f"output_token_logprobs[{position}] = {entry!r} does not match output token "
                    f"{token} ([logprob, token_id, text])"
                )
        log_probs = np.asarray([float(entry[0]) for entry in entries], dtype=np.float32)
    token_versions = parse_weight_version_spans(meta.get("weight_versions"), len(output_ids))
    if token_versions is not None and len(token_versions):
        # A sample whose tokens span several versions (an in-place update mid-generation) is
        # attributed to its oldest policy.
        weight_version = int(token_versions.min())
    else:
        weight_version = parse_weight_version(meta.get("weight_version"))
    routes = None
    if request.return_routed_experts:
        if layout is None:
            raise ValueError("routed experts returned but the client has no RouteLayout")
        if "routed_experts" not in meta:
            raise ValueError(
                "meta_info has no routed_experts: start the server with "
                "--enable-return-routed-experts and do not route through sglang-router 0.3.2 "
                "(it drops return_routed_experts)"
            )
        num_rows = len(request.input_ids) + len(output_ids) - 1
        routes = decode_routed_experts(meta["routed_experts"], num_rows, layout)
    return GenerateResult(
        request_id=result_id,
        output_ids=list(output_ids),
        output_log_probs=log_probs,
        finish_reason=finish["type"],
        prompt_length=len(request.input_ids),
        weight_version=weight_version,
        routed_experts=routes,
        output_weight_versions=token_versions,
        matched_stop_token=finish.get("matched")
        if isinstance(finish.get("matched"), int)
        else None,
        abort_message=finish.get("message") if finish["type"] == "abort" else None,
        cached_tokens=(
            int(meta["cached_tokens"]) if isinstance(meta.get("cached_tokens"), int) else None
        ),
    )


def parse_generate_response(
    body: Any,
    requests: Sequence[GenerateRequest],
    n: int = 1,
    layout: Optional[RouteLayout] = None,
    source: str = "server",
) -> list[GenerateResult]:
    """Results of a ``/generate`` answer, prompt-major (``len(requests) * n``).

    Raises :class:`RolloutEngineError` naming ``source`` (the URL) and the faulty item when the
    answer is not shaped like SGLang 0.5.x's.
    """
    expected = len(requests) * n
    items = [body] if isinstance(body, dict) else body
    if not isinstance(items, list) or len(items) != expected:
        count = len(items) if isinstance(items, list) else type(body).__name__
        raise RolloutEngineError(
            f"{source}/generate: malformed answer: expected {expected} results "
            f"({len(requests)} prompts x n={n}), got {count}"
        )
    results = []
    for index, item in enumerate(items):
        request = requests[index // n]
        result_id = sample_request_id(request.request_id, index % n, n)
        try:
            results.append(_parse_item(item, request, result_id, layout))
        except ValueError as error:
            raise RolloutEngineError(
                f"{source}/generate: malformed result {index} (request {result_id!r}): {error}"
            ) from None
    return results


def result_json(
    result: GenerateResult,
    layout: Optional[RouteLayout],
    return_logprob: bool,
    return_routed_experts: bool,
    routed_experts_start_len: int = 0,
) -> dict[str, Any]:
    """One ``/generate`` answer item for ``result``, shaped like SGLang 0.5.x's with
    ``--skip-tokenizer-init`` (no ``text``)."""
    if result.finish_reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": result.matched_stop_token}
    elif result.finish_reason == "length":
        finish = {"type": "length", "length": len(result.output_ids)}
    else:
        finish = {
            "type": "abort",
            "message": result.abort_message or "Aborted",
            "status_code": None,
            "err_type": None,
        }
    meta: dict[str, Any] = {
        "id": result.request_id,
        "finish_reason": finish,
        "prompt_tokens": result.prompt_length,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": str(result.weight_version),
    }
    if result.output_weight_versions is not None:
        meta["weight_versions"] = weight_version_spans(result.output_weight_versions)
    if return_logprob:
        meta["output_token_logprobs"] = [
            [float(log_prob), int(token), None]
            for log_prob, token in zip(result.output_log_probs, result.output_ids)
        ]
    if return_routed_experts:
        if layout is None or result.routed_experts is None:
            raise ValueError("result_json: routed experts asked but not recorded")
        meta["routed_experts"] = encode_routed_experts(
            result.routed_experts[routed_experts_start_len:], layout
        )
    return {"output_ids": list(result.output_ids), "meta_info": meta}
