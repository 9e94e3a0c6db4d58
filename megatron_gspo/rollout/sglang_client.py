"""``SGLangEngine``: the rollout contract over HTTP to one or more SGLang servers (0.5.x).

Plain HTTP with ``requests``; sglang itself is imported only by the tensor weight transport
(``megatron_gspo.weight_sync.tensor``), lazily, for CUDA tensors. The embedded engine's
loopback server (``server.py``) answers the same subset, so CI runs this client for real.

* ``/generate``: requests are cut into batched calls of at most ``max_requests_per_call`` prompts,
  each sent to the server with the fewest calls in flight (least-in-flight balancing, so no
  router is needed; sglang-router 0.3.2 would drop ``return_routed_experts``). With ``n > 1``
  and a seeded request the client sends the ``n`` samples as separate prompts with
  ``derive_seed`` seeds, because SGLang would give all ``n`` copies the same ``sampling_seed``.
* Control calls (abort, pause, continue, flush) go to every server directly.
* Every call carries ``Authorization: Bearer <api_key>`` when the engine has a key (SGLang's
  ``--api-key``; the embedded server's per-run key), see ``auth.py``.
* Weight updates run inside ``/begin_weight_update`` ... ``/end_weight_update`` on servers that
  have them (probed once: 404 means absent; SGLang 0.5.23 refuses tensor and distributed updates
  outside the bracket).
* Transport errors (refused or reset connections, 503 while starting) are retried
  ``max_retries`` times with exponential backoff; a server that stays unreachable raises
  :class:`RolloutEngineError` naming its URL and the call. A ``/generate`` that timed out is not
  retried (the server may still be running it).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import requests

from megatron_gspo.rollout.sglang_protocol import (
    RouteLayout,
    build_generate_payload,
    build_score_payload,
    parse_generate_response,
    parse_score_response,
    parse_weight_version,
)
from megatron_gspo.rollout.types import (
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    RolloutEngineError,
    check_score_inputs,
    expand_samples,
)
from megatron_gspo.weight_sync import SyncStats, WeightTransport, transport_from_config

logger = logging.getLogger(__name__)

SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What ``/release_memory_occupation`` frees (SGLang 0.5.23's tags)."""


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    has_weight_update_bracket: Optional[bool] = None
    """None until probed; False when /begin_weight_update answers 404."""


class SGLangEngine(RolloutEngine):
    """Client of SGLang servers (see the module docstring).

    Args:
        urls: server addresses, ``http://host:port``.
        route_layout: layer/top-k layout of routed experts; required for R3.
        weight_transport: a transport from ``megatron_gspo.weight_sync`` (disk, tensor,
            distributed); ``None`` makes ``sync_weights`` raise.
        request_timeout_s: limit of one ``/generate`` call; control_timeout_s: of other calls.
        max_retries / retry_backoff_s: transport-error retries (backoff doubles each time).
        max_concurrency: most ``/generate`` calls in flight over all servers.
        max_requests_per_call: most prompts batched into one ``/generate`` call.
        flush_retries / flush_retry_interval_s: ``/flush_cache`` answers 400 while requests
            run; it is retried this many times (slime: 60 x 1 s).
        resume_empties_torch_cache: ``torch_empty_cache`` of ``/continue_generation`` (emptying
            the CUDA cache every step cost minutes per sync on large models, slime#67).
        on_close: callables run by :meth:`close` (stopping servers this client owns).
        api_key: the servers' ``--api-key``, sent as a bearer token on every call (None: none).
        restarters: URL -> callable(timeout_s) that restarts that server (one this client's
            owner launched) and returns once it is healthy; :meth:`recover` waits for the others.
    """

    def __init__(
        self,
        urls: Sequence[str],
        route_layout: Optional[RouteLayout] = None,
        *,
        weight_transport: Optional[WeightTransport] = None,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_concurrency: int = 256,
        max_requests_per_call: int = 32,
        flush_retries: int = 60,
        flush_retry_interval_s: float = 1.0,
        resume_empties_torch_cache: bool = False,
        initial_weight_version: int = 0,
        on_close: Sequence[Any] = (),
        api_key: Optional[str] = None,
        restarters: Optional[dict[str, Any]] = None,
        weight_version_source: Optional[Callable[[], int]] = None,
    ):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        if max_concurrency < 1 or max_requests_per_call < 1 or max_retries < 0:
            raise ValueError("max_concurrency and max_requests_per_call must be >= 1, retries >= 0")
        self.servers = [_Server(url.rstrip("/")) for url in urls]
        self.route_layout = route_layout
        self.weight_transport = weight_transport
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_concurrency = max_concurrency
        self.max_requests_per_call = max_requests_per_call
        self.flush_retries = flush_retries
        self.flush_retry_interval_s = flush_retry_interval_s
        self.resume_empties_torch_cache = resume_empties_torch_cache
        self._weight_version = initial_weight_version
        self._weight_version_source = weight_version_source
        """Where a client that never syncs (a producer process's) reads the servers' weight
        version, which another process's client sets; None: this client's own syncs set it."""
        self._lock = threading.Lock()
        self._request_server: dict[str, str] = {}
        self._session_servers: dict[str, _Server] = {}
        """Sticky sessions: the server holding each open session's prefix."""
        self._executor: Optional[ThreadPoolExecutor] = None
        self._local = threading.local()
        self._on_close = list(on_close)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pause_mode: Optional[str] = None
        self._memory_released = False
        self._restarters = {url.rstrip("/"): restart for url, restart in (restarters or {}).items()}
        self._recover_lock = threading.Lock()
        self._needs_full_sync = False

    @classmethod
    def from_config(
        cls,
        rollout: Any,
        model: Any,
        urls: Optional[Sequence[str]] = None,
        *,
        weight_transport: Optional[WeightTransport] = None,
        api_key: Optional[str] = None,
    ) -> SGLangEngine:
        """Client for ``rollout.sglang.urls`` (or ``urls``) with the layout of ``model``.

        ``weight_transport`` defaults to the one ``rollout.weight_transport`` names, built by
        :func:`megatron_gspo.weight_sync.transport_from_config`.
        """
        urls = list(urls if urls is not None else rollout.sglang.urls)
        layout = RouteLayout.from_model_config(model) if model.is_moe else None
        if weight_transport is None:
            weight_transport = transport_from_config(
                rollout, model, num_engines=len(urls), urls=urls
            )
        return cls(
            urls,
            layout,
            weight_transport=weight_transport,
            request_timeout_s=rollout.request_timeout_s,
            max_retries=rollout.max_retries,
            max_concurrency=rollout.max_concurrency,
            api_key=api_key,
        )

    @property
    def cache_salt(self) -> str:
        """The prefix-cache namespace of requests sent now: the weight version."""
        return f"weights-v{self.weight_version}"

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def weight_version(self) -> int:
        if self._weight_version_source is not None:
            return int(self._weight_version_source())
        return self._weight_version

    # ------------------------------------------------------------------ HTTP

    def _session(self) -> requests.Session:
        # requests.Session is not thread-safe; one per thread keeps connections pooled.
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers.update(self._headers)
        return session

    def request(
        self,
        method: str,
        url: str,
        path: str,
        payload: Any = None,
        *,
        timeout: Optional[float] = None,
        retry_timeouts: bool = True,
    ) -> requests.Response:
        """One HTTP call with bounded retries of transport errors and 503; returns the answer
        whatever its status (callers judge it)."""
        timeout = self.control_timeout_s if timeout is None else timeout
        # A server that dies while it sends its answer cuts the body short (ChunkedEncodingError):
        # a transport error like a refused connection, so that the caller sees RolloutEngineError
        # and can bring the engine back.
        retryable: tuple[type[Exception], ...] = (
            requests.ConnectionError,
            requests.exceptions.ChunkedEncodingError,
        )
        if retry_timeouts:
            retryable += (requests.Timeout,)
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                response = self._session().request(
                    method, url + path, json=payload, timeout=timeout
                )
            except retryable as error:
                last_error = f"{type(error).__name__}: {error}"
                logger.warning("%s%s attempt %d failed: %s", url, path, attempt + 1, last_error)
                continue
            except requests.Timeout as error:
                raise RolloutEngineError(
                    f"{url}{path}: no answer within {timeout:.0f}s ({error}); the server may be "
                    "overloaded or hung (raise rollout.request_timeout_s or check its log)"
                ) from None
            if response.status_code == 503:
                last_error = "503 Service Unavailable (starting or unhealthy)"
                continue
            return response
        raise RolloutEngineError(
            f"{url}{path}: failed after {self.max_retries + 1} attempts ({last_error}); the engine "
            "is unreachable or died: check its log"
        )

    def post_json(
        self,
        url: str,
        path: str,
        payload: Any = None,
        *,
        timeout: Optional[float] = None,
        retry_timeouts: bool = True,
    ) -> Any:
        """POST and return the JSON answer; non-200 or ``success: false`` raise.
        ``retry_timeouts=False`` for calls that must not be repeated (see :meth:`request`)."""
        response = self.request(
            "POST",
            url,
            path,
            payload if payload is not None else {},
            timeout=timeout,
            retry_timeouts=retry_timeouts,
        )
        body = _json_or_text(response)
        if response.status_code != 200:
            raise RolloutEngineError(f"{url}{path}: HTTP {response.status_code}: {_excerpt(body)}")
        if isinstance(body, dict) and body.get("success") is False:
            raise RolloutEngineError(f"{url}{path}: refused: {body.get('message', body)}")
        return body

    def post_all(
        self, path: str, payload: Any = None, *, timeout: Optional[float] = None
    ) -> list[Any]:
        """:meth:`post_json` to every server concurrently; answers in server order."""
        if len(self.servers) == 1:
            return [self.post_json(self.servers[0].url, path, payload, timeout=timeout)]
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            futures = [
                pool.submit(self.post_json, server.url, path, payload, timeout=timeout)
                for server in self.servers
            ]
            return [future.result() for future in futures]

    # ------------------------------------------------------------------ generation

    def generate(self, requests: Sequence[GenerateRequest], n: int = 1) -> list[GenerateResult]:
        if n < 1:
            raise ValueError(f"n={n} < 1")
        if self._memory_released:
            raise RolloutEngineError(
                "generate() after release_memory(): the servers hold no weights until the next "
                "sync_weights() restores them"
            )
        if self._needs_full_sync:
            raise RolloutEngineError(
                "generate() before the trainer's weights reached the restarted servers (the "
                "weight transport keeps no copy): sync_weights() first"
            )
        if any(request.seed is not None for request in requests) and n > 1:
            requests, n = expand_samples(requests, n), 1
        if any(r.return_routed_experts for r in requests) and self.route_layout is None:
            raise ValueError("routed experts requested but the SGLangEngine has no route_layout")
        if any(r.return_routed_expert_weights for r in requests):
            # SGLang's return_routed_experts carries expert ids only (docs/glm4-moe.md, section 2).
            raise ValueError(
                "routed expert weights requested of an SGLang server, which returns expert ids "
                "only; R3 with routing_replay_weights=replayed needs rollout.engine=embedded"
            )
        chunks = self._chunks(list(requests))
        if not chunks:
            return []
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.max_concurrency, thread_name_prefix="sglang-generate"
            )
        futures = [self._executor.submit(self._generate_call, chunk, n) for chunk in chunks]
        results: list[GenerateResult] = []
        errors = []
        for future in futures:
            try:
                results.extend(future.result())
            except Exception as error:  # collect every call's fate before raising the first
                errors.append(error)
        if errors:
            raise errors[0]
        return results

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> list[np.ndarray]:
        """Teacher-forced log-probs (:meth:`RolloutEngine.score`) from SGLang's prompt
        log-probs (:func:`build_score_payload`), in calls of at most ``max_requests_per_call``
        pairs spread over the servers. SGLang computes prompt log-probs at temperature 1 only,
        so any other temperature is refused."""
        check_score_inputs(prompts, responses, temperature)
        if temperature != 1.0:
            raise RolloutEngineError(
                f"SGLang scores prompt tokens at temperature 1 only (asked {temperature}); "
                "score with an embedded engine, or sample at rollout.temperature=1"
            )
        results: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(prompts)
        wanted = [index for index, response in enumerate(responses) if len(response)]
        chunks = [
            wanted[begin : begin + self.max_requests_per_call]
            for begin in range(0, len(wanted), self.max_requests_per_call)
        ]
        if not chunks:
            return results
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.max_concurrency, thread_name_prefix="sglang-generate"
            )
        futures = [
            self._executor.submit(
                self._score_call, [prompts[i] for i in chunk], [responses[i] for i in chunk]
            )
            for chunk in chunks
        ]
        for chunk, future in zip(chunks, futures):
            for index, log_probs in zip(chunk, future.result()):
                results[index] = log_probs
        return results

    def _score_call(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[np.ndarray]:
        server = self._acquire_server()
        try:
            body = self.post_json(
                server.url,
                "/generate",
                build_score_payload(prompts, responses),
                timeout=self.request_timeout_s,
            )
            return parse_score_response(body, responses, source=server.url)
        finally:
            with self._lock:
                server.in_flight -= 1

    def _chunks(self, requests: list[GenerateRequest]) -> list[list[GenerateRequest]]:
        """Consecutive requests with the same return flags, at most max_requests_per_call each."""
        chunks: list[list[GenerateRequest]] = []
        for request in requests:
            # A chunk goes to one server: requests of different sessions go apart (sticky).
            flags = (request.return_logprob, request.return_routed_experts, request.session_id)
            last = chunks[-1] if chunks else None
            if (
                last is None
                or len(last) >= self.max_requests_per_call
                or (last[0].return_logprob, last[0].return_routed_experts, last[0].session_id)
                != flags
            ):
                chunks.append([request])
            else:
                last.append(request)
        return chunks

    def _acquire_server(self, session_id: Optional[str] = None) -> _Server:
        """The server of the session (sticky: it holds the session's prefix in its cache), or,
        for a new session or none, the least loaded: fewest calls in flight, then fewest open
        sessions."""
        with self._lock:
            server = self._session_servers.get(session_id) if session_id else None
            if server is None:
                held = Counter(id(s) for s in self._session_servers.values())
                server = min(self.servers, key=lambda s: (s.in_flight, held[id(s)]))
                if session_id:
                    self._session_servers[session_id] = server
            server.in_flight += 1
            return server

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self._session_servers.pop(session_id, None)

    def session_server(self, session_id: str) -> Optional[str]:
        """The URL of the server holding an open session (None: not routed yet)."""
        with self._lock:
            server = self._session_servers.get(session_id)
            return server.url if server is not None else None

    def _generate_call(self, chunk: list[GenerateRequest], n: int) -> list[GenerateResult]:
        server = self._acquire_server(chunk[0].session_id)
        request_ids = [request.request_id for request in chunk]
        with self._lock:
            self._request_server.update(dict.fromkeys(request_ids, server.url))
        try:
            response = self.request(
                "POST",
                server.url,
                "/generate",
                # The prefix cache is salted by weight version (SGLang's extra_key namespaces
                # the radix cache): a request of a new version never reuses KV that an old
                # version computed, also when requests paused in place keep theirs.
                {**build_generate_payload(chunk, n), "extra_key": self.cache_salt},
                timeout=self.request_timeout_s,
                retry_timeouts=False,
            )
            body = _json_or_text(response)
            if response.status_code != 200:
                raise RolloutEngineError(
                    f"{server.url}/generate: HTTP {response.status_code}: {_excerpt(body)}"
                )
            return parse_generate_response(body, chunk, n, self.route_layout, source=server.url)
        finally:
            with self._lock:
                server.in_flight -= 1
                for request_id in request_ids:
                    self._request_server.pop(request_id, None)

    # ------------------------------------------------------------------ control

    def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        """Abort by id on the server running it (every server if unknown), or everything.

        With ``n > 1`` and no seed, SGLang renames the ``n`` copies, so only ``abort()`` (all)
        reaches them.
        """
        if request_ids is None:
            self.post_all("/abort_request", {"abort_all": True})
            return
        for request_id in request_ids:
            with self._lock:
                url = self._request_server.get(request_id)
            for target in [url] if url else self.urls:
                response = self.request("POST", target, "/abort_request", {"rid": request_id})
                if response.status_code != 200:
                    raise RolloutEngineError(
                        f"{target}/abort_request: HTTP {response.status_code}: "
                        f"{_excerpt(_json_or_text(response))}"
                    )

    def pause(self, mode: str = "abort") -> None:
        if mode not in SGLANG_PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {SGLANG_PAUSE_MODES}")
        self.post_all("/pause_generation", {"mode": mode})
        self._pause_mode = mode

    def resume(self) -> None:
        self.post_all(
            "/continue_generation", {"torch_empty_cache": self.resume_empties_torch_cache}
        )
        self._pause_mode = None

    @property
    def flushes_on_update(self) -> bool:
        """Whether weight updates ask the servers to flush their prefix cache: not while
        requests are paused ``in_place`` (they keep their KV cache; SGLang 0.5.23 would apply
        the update and still answer 400 "cache was not flushed")."""
        return self._pause_mode != "in_place"

    def flush_cache(self) -> None:
        """``/flush_cache`` on every server, retried while it answers 400 (requests running)."""
        for server in self.servers:
            for attempt in range(self.flush_retries + 1):
                response = self.request("GET", server.url, "/flush_cache")
                if response.status_code == 200:
                    break
                if response.status_code != 400 or attempt == self.flush_retries:
                    raise RolloutEngineError(
                        f"{server.url}/flush_cache: HTTP {response.status_code} after "
                        f"{attempt + 1} attempts: {_excerpt(_json_or_text(response))}; pause "
                        "generation before flushing"
                    )
                time.sleep(self.flush_retry_interval_s)

    def health(self) -> bool:
        for server in self.servers:
            try:
                response = self._session().get(
                    server.url + "/health_generate", timeout=self.control_timeout_s
                )
            except requests.RequestException as error:
                logger.warning("%s/health_generate: %s", server.url, error)
                return False
            if response.status_code != 200:
                logger.warning("%s/health_generate: HTTP %d", server.url, response.status_code)
                return False
        return True

    def recover(self, timeout_s: float) -> Optional[SyncStats]:
        """Restart (or wait for) servers that do not answer, then send the newest weights again
        to any server that holds another version (a restarted server starts from its initial
        weights). One recovery at a time."""
        deadline = time.monotonic() + timeout_s
        with self._recover_lock:
            came_back = set()
            for server in self.servers:
                if self._answers(server.url):
                    continue
                # Restarted, by us or its operator: its weights are its start-up ones, whatever
                # version it reports (at version 0 that is the trainer's version too).
                came_back.add(server.url)
                restart = self._restarters.get(server.url)
                if restart is not None:
                    logger.warning("rollout server %s is gone: restarting it", server.url)
                    restart(max(deadline - time.monotonic(), 0.0))
                    continue
                logger.warning("rollout server %s does not answer: waiting for it", server.url)
                while not self._answers(server.url):
                    if time.monotonic() > deadline:
                        raise RolloutEngineError(
                            f"{server.url} did not answer again within {timeout_s:.0f}s; it is "
                            "not a server this run launched, so it cannot be restarted from here"
                        )
                    time.sleep(min(1.0, self.retry_backoff_s))
            # The newest weights: the transport's copy (a sync that failed after writing it
            # counts), else the last version synced.
            copy = None if self.weight_transport is None else self.weight_transport.latest_version
            target = self._weight_version if copy is None else copy
            stale = [
                server.url
                for server in self.servers
                if server.url in came_back or self._server_version(server.url) != target
            ]
            stats = None
            if stale:
                if self.weight_transport is not None:
                    stats = self.weight_transport.resend(self)
                if stats is None:
                    # Only the trainer holds the weights (tensor, distributed): the next sync
                    # sends every server the whole set, over a fresh update group.
                    if self.weight_transport is not None:
                        self.weight_transport.reset()
                    self._needs_full_sync = True
                    logger.warning(
                        "rollout servers %s came back without the trainer's weights (version "
                        "%d) and the %s weight transport keeps no copy: they wait for the "
                        "trainer's next sync",
                        stale,
                        target,
                        getattr(self.weight_transport, "name", "configured"),
                    )
                    return None
                logger.warning("rollout servers %s re-synced to weight version %d", stale, target)
            self._weight_version = target
            return stats

    @property
    def needs_full_sync(self) -> bool:
        return self._needs_full_sync

    def generation_client_options(self) -> dict[str, Any]:
        """Keyword arguments of an :class:`SGLangEngine` that generates on the same servers
        from another process (the producer processes of asynchronous training): the URLs, the
        API key and the request limits; no weight transport, no restarters (weights and
        recoveries stay with this client)."""
        return {
            "urls": [server.url for server in self.servers],
            "route_layout": self.route_layout,
            "request_timeout_s": self.request_timeout_s,
            "control_timeout_s": self.control_timeout_s,
            "max_retries": self.max_retries,
            "retry_backoff_s": self.retry_backoff_s,
            "max_concurrency": self.max_concurrency,
            "max_requests_per_call": self.max_requests_per_call,
            "api_key": self._headers.get("Authorization", "").removeprefix("Bearer ") or None,
        }

    def _answers(self, url: str) -> bool:
        try:
            response = self._session().get(url + "/health_generate", timeout=self.control_timeout_s)
        except requests.RequestException:
            return False
        return response.status_code == 200

    def _server_version(self, url: str) -> int:
        body = _json_or_text(self.request("GET", url, "/model_info"))
        if not isinstance(body, dict):
            raise RolloutEngineError(f"{url}/model_info: malformed answer {_excerpt(body)}")
        return parse_weight_version(body.get("weight_version"))

    def info(self) -> dict[str, Any]:
        servers = []
        for server in self.servers:
            body = _json_or_text(self.request("GET", server.url, "/model_info"))
            servers.append(
                {"url": server.url, **(body if isinstance(body, dict) else {"raw": body})}
            )
        return {
            "engine": "sglang_client",
            "weight_version": self.weight_version,
            "servers": servers,
        }

    def close(self) -> None:
        """Stop the request threads, the weight transport and what ``on_close`` names (launched
        servers), newest first; each runs even when an earlier one fails."""
        with ExitStack() as stack:
            while self._on_close:
                stack.callback(self._on_close.pop(0))
            if self.weight_transport is not None:
                stack.callback(self.weight_transport.close)
            if self._executor is not None:
                stack.callback(self._executor.shutdown, wait=True, cancel_futures=True)
                self._executor = None

    # ------------------------------------------------------------------ weights

    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> SyncStats:
        """Send HF-named tensors through the configured transport, inside the weight-update
        bracket where servers have it; the servers take ``version`` as their weight version."""
        if self.weight_transport is None:
            raise RolloutEngineError(
                "SGLangEngine.sync_weights: no weight transport configured (disk, tensor or "
                "distributed; see rollout.weight_transport)"
            )
        if self._memory_released:
            # slime's order: the weights' memory back, the weights, then the caches.
            self.post_all("/resume_memory_occupation", {"tags": ["weights"]})
        # Only tensor and distributed updates need the bracket. /update_weights_from_disk
        # restores, loads and post-processes by itself; inside the bracket SGLang 0.5.23
        # post-processes a second time at /end_weight_update, which re-packs packed weights
        # (wrong log-probs on its AMX CPU path: docs/sglang-protocol.md, section 7).
        bracketed = self._begin_weight_update() if self.weight_transport.needs_bracket else []
        try:
            stats = self.weight_transport.sync(self, named_tensors, version)
        finally:
            self._end_weight_update(bracketed)
        if self._memory_released:
            self.post_all("/resume_memory_occupation", {"tags": list(MEMORY_TAGS[1:])})
            self._memory_released = False
        self._weight_version = int(version)
        self._needs_full_sync = False
        return stats

    def release_memory(self) -> None:
        """``/release_memory_occupation`` of weights, KV cache and CUDA graphs on every server,
        so that the colocated trainer can use that GPU memory; the next :meth:`sync_weights`
        takes it back (weights first, then the caches). The servers must run with
        ``--enable-memory-saver`` (:meth:`server_info` tells): without it SGLang 0.5.23 answers
        200 and frees nothing, and on CPU the memory saver does not exist (it needs libcuda)."""
        self.post_all("/release_memory_occupation", {"tags": list(MEMORY_TAGS)})
        self._memory_released = True

    def server_info(self) -> list[dict[str, Any]]:
        """Every server's ``/server_info`` (resolved ServerArgs, ``version``), in URL order."""
        infos = []
        for server in self.servers:
            response = self.request("GET", server.url, "/server_info")
            body = _json_or_text(response)
            if response.status_code != 200 or not isinstance(body, dict):
                raise RolloutEngineError(
                    f"{server.url}/server_info: HTTP {response.status_code}: {_excerpt(body)}"
                )
            infos.append(body)
        return infos

    def _begin_weight_update(self) -> list[_Server]:
        opened = []
        for server in self.servers:
            if server.has_weight_update_bracket is False:
                continue
            response = self.request("POST", server.url, "/begin_weight_update", {"selector": "all"})
            if response.status_code == 404:
                server.has_weight_update_bracket = False
                continue
            body = _json_or_text(response)
            if response.status_code != 200 or (
                isinstance(body, dict) and body.get("success") is False
            ):
                self._end_weight_update(opened)
                raise RolloutEngineError(
                    f"{server.url}/begin_weight_update: HTTP {response.status_code}: {_excerpt(body)}"
                )
            server.has_weight_update_bracket = True
            opened.append(server)
        return opened

    def _end_weight_update(self, opened: list[_Server]) -> None:
        for server in opened:
            self.post_json(server.url, "/end_weight_update", {})


def _json_or_text(response: requests.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _excerpt(body: Any, limit: int = 300) -> str:
    """One line of a server's answer for an error message. An HTML page (a proxy's or another
    web server's at the address) is named by its title: it says the URL points elsewhere, and
    its markup would bury the message."""
    text = body if isinstance(body, str) else repr(body)
    if text.lstrip()[:15].lower().startswith(("<!doctype html", "<html")):
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
        named = f" titled {' '.join(title.group(1).split())!r}" if title else ""
        return f"an HTML page{named}, not SGLang's answer: is the URL an SGLang server's?"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
