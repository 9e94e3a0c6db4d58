"""The embedded engine behind a loopback HTTP server that speaks a subset of SGLang's JSON.

It lets the SGLang client code path run for real in CI (rollout engine ``embedded_http``), without
claiming to be SGLang: ``/model_info`` and ``/server_info`` say ``"engine": "embedded"``, and the
CUDA-IPC / NCCL weight endpoints (``/update_weights_from_tensor``,
``/update_weights_from_distributed``, ``/init_weights_update_group``) and the
``/begin_weight_update`` bracket are absent (404), as on an older SGLang.

Served (bodies and answers as SGLang 0.5.x, see ``sglang_protocol.py``):

=========================================  ==================================================
``POST /generate``                         token ids in, ``output_ids`` + ``meta_info`` out
``GET /health``                            200 while the server serves (no forward)
``GET /health_generate``                   with the key: 200 when a one-token forward works,
                                           else 503 (one forward per ``HEALTH_CACHE_S``);
                                           without it: as ``/health``
``GET /model_info``, ``GET /server_info``  engine description (``engine: embedded``)
``GET|POST /flush_cache``                  200, or 400 while generate calls run (as SGLang)
``POST /pause_generation``                 ``{"mode": "abort"|"in_place"}``
``POST /continue_generation``              resume
``POST /abort_request``                    ``{"rid": ..., "abort_all": bool}``
``POST /update_weights_from_disk``         ``{"model_path", "weight_version"?}``: safetensors
=========================================  ==================================================

It binds 127.0.0.1 only, and checks every request as SGLang with ``--api-key`` does, plus two
checks against requests a browser can be tricked into sending:

- ``Host`` must name the loopback interface (``127.0.0.1``, ``localhost``, ``[::1]``, any port),
  else 403: a web page that re-points its own domain at 127.0.0.1 (DNS rebinding) sends its
  domain's name;
- every endpoint except ``/health`` and ``/health_generate`` needs ``Authorization: Bearer
  <api_key>``, else 401: the key is the run's secret (:mod:`megatron_gspo.rollout.auth`), so
  other local processes cannot pause generation or swap the weights;
- a ``POST``/``PUT`` body must be ``Content-Type: application/json``, else 415: a cross-site
  form or ``text/plain`` post needs no CORS preflight, a JSON one does (and gets none here).

What a process without the key can do stays cheap, because any local process can do it as
often as it likes: a keyless ``/health_generate`` runs no forward (a flood of them made
``/generate`` 10-20x slower, each taking turns at the model lock), and refused requests, connections
the peer cut (reset, broken pipe: three tracebacks each before) and failed requests are counted
in :attr:`EmbeddedServer.peer_events`, which logs :data:`~megatron_gspo.rollout.peer_events.LOG_BURST` lines of each kind per
:data:`~megatron_gspo.rollout.peer_events.LOG_WINDOW_S` and sums up the rest in one line; a cut connection logs no traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import urlparse

import torch

from megatron_gspo.config import (
    EMBEDDED_MAX_BATCH_SIZE,
    EMBEDDED_ROUTE_SOURCES,
    ModelConfig,
    from_dict,
)
from megatron_gspo.rollout.auth import (
    API_KEY_ENV,
    api_key_from_environment,
    bearer_matches,
    host_header_is_loopback,
    new_api_key,
)
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.peer_events import PeerEvents, peer_cut
from megatron_gspo.rollout.sglang_protocol import RouteLayout, result_json
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError

logger = logging.getLogger(__name__)

LOOPBACK_HOST = "127.0.0.1"
UNAUTHENTICATED_PATHS = ("/health", "/health_generate")
"""Liveness probes answer without the key, as in SGLang (they reveal nothing and change
nothing); without the key ``/health_generate`` runs no forward (it answers as ``/health``)."""
HEALTH_CACHE_S = 1.0
"""How long the answer of a keyed ``/health_generate`` forward stands for the next ones: however
often it is asked, the model runs at most one health forward per period."""

_GENERATE_KEYS = {
    "input_ids",
    "rid",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_routed_experts",
    "routed_experts_start_len",
    "stream",
    "extra_key",  # SGLang's prefix-cache namespace: accepted, no cache here to namespace
}
# Sampling parameters this server honours, and the text-only or neutral ones it accepts at their
# neutral value (anything else is refused rather than silently ignored).
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "n", "stop_token_ids"}
_SAMPLING_KEYS |= {"sampling_seed", "no_stop_trim", "skip_special_tokens"}
_SAMPLING_KEYS |= {"spaces_between_special_tokens", "ignore_eos", "min_new_tokens"}
_NEUTRAL_SAMPLING = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": None,
    "logit_bias": None,
}
_GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperatures below it mean greedy
CLIENT_REQUESTS_PER_CALL = 4096
"""Prompts the client puts in one ``/generate`` call to this server (SGLang's client default:
32). Concurrent calls here take turns forward by forward under the engine's model lock (no
continuous batching across calls), so one call per ``generate`` lets the engine form batches of
``max_batch_size`` as in-process: calls of 32 prompts made twice the forwards and twice the
generation time of the CPU demo (``benchmarks/async_overlap.py``)."""


class BadRequest(ValueError):
    """A request this server refuses with HTTP 400 (the message says what and how to fix)."""


def _as_list(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def _sampling_request(
    input_ids: Any, rid: str, params: Any, return_logprob: bool, return_routes: bool
) -> GenerateRequest:
    params = dict(params or {})
    for key, neutral in _NEUTRAL_SAMPLING.items():
        value = params.pop(key, neutral)
        if not (value is None or value == neutral or value in ([], "")):
            raise BadRequest(
                f"sampling_params.{key}={value!r} is not supported by the embedded engine "
                f"(only {neutral!r}); stop strings need a tokenizer, send stop_token_ids"
            )
    unknown = set(params) - _SAMPLING_KEYS
    if unknown:
        raise BadRequest(
            f"unsupported sampling_params {sorted(unknown)}; supported: {sorted(_SAMPLING_KEYS)}"
        )
    temperature = params.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if 0 <= temperature < _GREEDY_EPS:
        temperature = 0.0
    if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
        raise BadRequest("input_ids must be a list of token ids (or a list of such lists)")
    try:
        return GenerateRequest(
            input_ids=input_ids,
            max_new_tokens=int(params.get("max_new_tokens", 128)),
            temperature=temperature,
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            stop_token_ids=params.get("stop_token_ids") or (),
            min_new_tokens=int(params.get("min_new_tokens") or 0),
            seed=params.get("sampling_seed"),
            return_logprob=bool(return_logprob),
            return_routed_experts=bool(return_routes),
            request_id=rid,
        )
    except (TypeError, ValueError) as error:
        raise BadRequest(str(error)) from None


def parse_generate_body(body: Any) -> tuple[list[GenerateRequest], int, bool, int]:
    """``(requests, n, is_single, routed_experts_start_len)`` of a ``/generate`` body.

    Follows SGLang's normalisation: a flat ``input_ids`` is one prompt, a list of lists a batch;
    a string ``rid`` of a batch becomes ``rid_i``; ``sampling_params`` is one dict or one per
    prompt with the same ``n``.
    """
    if not isinstance(body, dict):
        raise BadRequest("the /generate body must be a JSON object")
    if "text" in body:
        raise BadRequest("the embedded engine has no tokenizer: send input_ids, not text")
    unknown = set(body) - _GENERATE_KEYS
    if unknown:
        raise BadRequest(f"unsupported /generate fields {sorted(unknown)}")
    if body.get("stream"):
        raise BadRequest("streaming is not supported by the embedded engine")
    input_ids = body.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("input_ids must be a non-empty list")
    is_single = not isinstance(input_ids[0], list)
    prompts = [input_ids] if is_single else input_ids
    count = len(prompts)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(count)]
    elif isinstance(rid, str):
        rids = [rid] if is_single else [f"{rid}_{i}" for i in range(count)]
    else:
        rids = _as_list(rid, count, "rid")
    sampling = _as_list(body.get("sampling_params"), count, "sampling_params")
    n_values = {int((params or {}).get("n", 1) or 1) for params in sampling}
    if len(n_values) != 1:
        raise BadRequest("sampling_params.n must be the same for every prompt")
    n = n_values.pop()
    if n < 1:
        raise BadRequest(f"sampling_params.n={n} must be >= 1")
    return_logprob = _as_list(body.get("return_logprob") or False, count, "return_logprob")
    for name, neutral in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        values = _as_list(body.get(name, neutral), count, name)
        if any(value not in (None, neutral) for value in values):
            raise BadRequest(
                f"{name} other than {neutral} is not supported (output log-probs only)"
            )
    return_routes = bool(body.get("return_routed_experts", False))
    start_len = int(body.get("routed_experts_start_len", 0) or 0)
    requests = [
        _sampling_request(prompt, str(request_id), params, logprob, return_routes)
        for prompt, request_id, params, logprob in zip(prompts, rids, sampling, return_logprob)
    ]
    if return_routes and any(not 0 <= start_len <= len(r.input_ids) for r in requests):
        raise BadRequest(f"routed_experts_start_len={start_len} must be in [0, prompt tokens]")
    return requests, n, is_single and n == 1, start_len


class _LoopbackHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    peer_events: PeerEvents

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver's default prints a traceback to stderr for every failed connection,
        # those the peer cut included: any local process could fill the log at will.
        error = sys.exc_info()[1]
        if peer_cut(error):
            self.peer_events.note(
                "cut connections",
                logging.INFO,
                "embedded server: %s cut the connection (%s)",
                client_address[0],
                type(error).__name__,
            )
        else:
            self.peer_events.note(
                "failed requests",
                logging.ERROR,
                "embedded server: a request from %s failed",
                client_address[0],
                exc_info=True,
            )


class EmbeddedServer:
    """Serves an :class:`EmbeddedEngine` on ``http://127.0.0.1:<port>`` from a daemon thread.

    ``port=0`` picks a free port; :attr:`url` is the address to give the SGLang client, and
    :attr:`api_key` the secret it must send (``api_key=None`` makes a fresh one).
    """

    def __init__(self, engine: EmbeddedEngine, port: int = 0, *, api_key: Optional[str] = None):
        self.engine = engine
        self.api_key = api_key or new_api_key()
        self.layout = (
            RouteLayout(
                num_hidden_layers=engine.num_hidden_layers,
                moe_layer_indices=tuple(engine.moe_layer_indices),
                top_k=engine.model_config.moe_router_topk,
                num_experts=engine.model_config.num_experts,
            )
            if engine.moe_layer_indices
            else None
        )
        self.peer_events = PeerEvents(logger)
        """Refused requests, cut connections and failed requests: counted, logged boundedly."""
        self._health_lock = threading.Lock()
        self._health_checked_at: Optional[float] = None
        self._healthy = False
        handler = type("_BoundHandler", (_Handler,), {"server_state": self})
        self._http = _LoopbackHTTPServer((LOOPBACK_HOST, port), handler)
        self._http.peer_events = self.peer_events
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return self._http.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK_HOST}:{self.port}"

    def start(self) -> EmbeddedServer:
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.05},  # shutdown() waits up to one poll interval
            name=f"embedded-server-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve from the calling thread until interrupted (the command-line server)."""
        try:
            self._http.serve_forever()
        finally:
            self._http.server_close()
            self.peer_events.summarise()

    def close(self) -> None:
        """Abort running generation, stop serving and free the port."""
        self.engine.abort()
        self.engine.resume()
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.peer_events.summarise()

    def __enter__(self) -> EmbeddedServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ endpoint logic

    def info(self) -> dict[str, Any]:
        return {**self.engine.info(), "engine": "embedded", "is_generation": True, "url": self.url}

    def health_generate(self) -> bool:
        """Whether a one-token forward works, from a forward at most :data:`HEALTH_CACHE_S`
        old: concurrent callers wait for the one forward in flight rather than each running
        theirs (each forward takes a turn at the model lock between generation's forwards)."""
        with self._health_lock:
            checked_at = self._health_checked_at
            if checked_at is None or time.monotonic() - checked_at >= HEALTH_CACHE_S:
                self._healthy = self.engine.health()
                self._health_checked_at = time.monotonic()
            return self._healthy

    def generate(self, body: Any) -> Any:
        requests, n, is_single, start_len = parse_generate_body(body)
        try:
            results = self.engine.generate(requests, n)
        except ValueError as error:
            raise BadRequest(str(error)) from None
        items = [
            result_json(
                result,
                self.layout,
                return_logprob=requests[index // n].return_logprob,
                return_routed_experts=requests[index // n].return_routed_experts,
                routed_experts_start_len=start_len,
            )
            for index, result in enumerate(results)
        ]
        return items[0] if is_single else items

    def update_weights_from_disk(self, body: Any) -> tuple[int, dict[str, Any]]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("update_weights_from_disk needs {'model_path': <directory>}")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported (safetensors)")
        version = body.get("weight_version")
        try:
            version = self.engine.weight_version + 1 if version is None else int(version)
            if body.get("abort_all_requests"):
                self.engine.abort()
            stats = self.engine.load_weights_from_directory(body["model_path"], version)
        except (OSError, ValueError) as error:
            return HTTPStatus.BAD_REQUEST, {
                "success": False,
                "message": f"Failed to update weights: {error}",
                "num_paused_requests": 0,
            }
        message = f"Succeeded to update model weights ({stats.num_tensors} tensors)."
        return HTTPStatus.OK, {"success": True, "message": message, "num_paused_requests": 0}


class _Handler(BaseHTTPRequestHandler):
    server_state: EmbeddedServer
    protocol_version = "HTTP/1.1"
    # An answer leaves in two writes (headers, then body): with Nagle's algorithm the body
    # waits for the client's delayed ACK of the headers, 40 ms per call on Linux loopback
    # (pause + load + continue of one weight sync: 0.15 s for a 0.7 MB model).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("embedded server %s: " + format, self.address_string(), *args)

    def _reply(
        self,
        status: int,
        payload: Any = None,
        text: Optional[str] = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if text is not None:
            data, content_type = text.encode(), "text/plain; charset=utf-8"
        elif payload is not None:
            data, content_type = json.dumps(payload).encode(), "application/json"
        else:
            data, content_type = b"", "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as error:
            raise BadRequest(f"the body is not JSON: {error}") from None

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _refusal(self, method: str, path: str) -> Optional[tuple[int, str, tuple]]:
        """``(status, message, headers)`` when the request fails a check of the module
        docstring, else None."""
        if not host_header_is_loopback(self.headers.get("Host")):
            return (
                HTTPStatus.FORBIDDEN,
                f"Host {self.headers.get('Host')!r} is not a loopback name; this server answers "
                f"requests addressed to {LOOPBACK_HOST} or localhost only",
                (),
            )
        if path not in UNAUTHENTICATED_PATHS and not self._has_key():
            return (
                HTTPStatus.UNAUTHORIZED,
                "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                "server was started with",
                (("WWW-Authenticate", "Bearer"),),
            )
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if method in ("POST", "PUT") and content_type != "application/json":
            return (
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"Content-Type {content_type or '(none)'!r}: bodies must be application/json",
                (),
            )
        return None

    def _has_key(self) -> bool:
        return bearer_matches(self.headers.get("Authorization"), self.server_state.api_key)

    def _dispatch(self, method: str) -> None:
        state = self.server_state
        path = urlparse(self.path).path
        refusal = self._refusal(method, path)
        if refusal is not None:
            status, message, headers = refusal
            # The body is left unread, so this connection cannot carry another request.
            self.close_connection = True
            state.peer_events.note(
                "refused requests",
                logging.WARNING,
                "embedded server refused %s %.100s from %s (HTTP %d): %s",
                method,
                path,
                self.client_address[0],
                status,
                message,
            )
            self._reply(status, {"error": {"message": message}}, headers=headers)
            return
        try:
            body = self._body() if method in ("POST", "PUT") else {}
            if path == "/generate" and method in ("POST", "PUT"):
                self._reply(HTTPStatus.OK, state.generate(body))
            elif path == "/health" or (path == "/health_generate" and not self._has_key()):
                # Liveness only: a forward per keyless probe would let any local process slow
                # generation down at will.
                self._reply(HTTPStatus.OK)
            elif path == "/health_generate":
                healthy = state.health_generate()
                self._reply(HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE)
            elif path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
                self._reply(HTTPStatus.OK, state.info())
            elif path == "/flush_cache":
                self._flush()
            elif path == "/pause_generation" and method == "POST":
                state.engine.pause(body.get("mode", "abort"))
                self._reply(
                    HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"}
                )
            elif path == "/continue_generation" and method == "POST":
                state.engine.resume()
                self._reply(
                    HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"}
                )
            elif path == "/abort_request" and method == "POST":
                if body.get("abort_all"):
                    state.engine.abort()
                elif body.get("rid"):
                    state.engine.abort([body["rid"]])
                self._reply(HTTPStatus.OK)
            elif path == "/update_weights_from_disk" and method == "POST":
                self._reply(*state.update_weights_from_disk(body))
            else:
                self._reply(
                    HTTPStatus.NOT_FOUND,
                    {"error": {"message": f"{method} {path} is not served by the embedded engine"}},
                )
        except Exception as error:
            if peer_cut(error):
                raise  # nobody to answer: the HTTP server counts it (_LoopbackHTTPServer)
            if isinstance(error, (ValueError, RolloutEngineError)):  # BadRequest included
                self._reply(HTTPStatus.BAD_REQUEST, {"error": {"message": str(error)}})
                return
            # An engine failure must reach the client as a 500, not a hang.
            state.peer_events.note(
                "failed requests",
                logging.ERROR,
                "embedded server: %s %.100s failed",
                method,
                path,
                exc_info=True,
            )
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": repr(error)}})

    def _flush(self) -> None:
        try:
            self.server_state.engine.flush_cache()
        except RolloutEngineError as error:
            self._reply(HTTPStatus.BAD_REQUEST, text=f"{error}\n")
            return
        self._reply(HTTPStatus.OK, text="Cache flushed.\n")


def main(argv: Optional[list[str]] = None) -> None:
    """``MEGATRON_GSPO_SGLANG_API_KEY=KEY python -m megatron_gspo.rollout.server --port P
    [--model-config JSON] [--seed S] [--dtype float32|bfloat16|float16] [--max-batch-size B]
    [--route-source own|float32_twin] [--threads T]``: serve a
    randomly initialised embedded engine until interrupted (weights arrive through
    ``/update_weights_from_disk``). Clients must send the key, as with SGLang's ``--api-key``;
    it comes from the environment only, which other users cannot read (every local user reads a
    process's command line in ``/proc/<pid>/cmdline``)."""
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--host", default=LOOPBACK_HOST, help="must be 127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the engine's parameter and compute dtype (rollout.dtype)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=EMBEDDED_MAX_BATCH_SIZE,
        help="most samples decoded together (rollout.embedded_max_batch_size)",
    )
    parser.add_argument(
        "--route-source",
        default="own",
        choices=list(EMBEDDED_ROUTE_SOURCES),
        help="whose experts the MoE routers use (rollout.embedded_route_source)",
    )
    parser.add_argument(
        "--model-config",
        default="{}",
        help=f"JSON of ModelConfig fields ({', '.join(f.name for f in dataclasses.fields(ModelConfig))})",
    )
    args = parser.parse_args(argv)
    api_key = api_key_from_environment()
    if not api_key:
        parser.error(
            f"${API_KEY_ENV} is required (the secret clients send as 'Authorization: Bearer "
            "KEY'): the server refuses keyless use"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.host != LOOPBACK_HOST:
        parser.error(
            f"--host {args.host}: the embedded server binds {LOOPBACK_HOST} only (its key travels "
            "unencrypted)"
        )
    logging.basicConfig(level=logging.INFO)
    model_config = from_dict(ModelConfig, json.loads(args.model_config), prefix="model.")
    server = EmbeddedServer(
        EmbeddedEngine(
            model_config,
            seed=args.seed,
            dtype=getattr(torch, args.dtype),
            max_batch_size=args.max_batch_size,
            route_source=args.route_source,
        ),
        port=args.port,
        api_key=api_key,
    )
    logger.info("embedded rollout server on %s", server.url)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
