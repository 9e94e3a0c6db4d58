"""An OpenAI-compatible chat-completions endpoint in front of a rollout engine, with sessions.

An agent program written against any OpenAI client runs an episode through it
(docs/agentic.md, "The OpenAI-compatible endpoint"): ``POST /v1/chat/completions`` as the
``openai`` Python client sends it, one session per episode. The endpoint is ours, not the
engine's: it keeps each session's token history and sends the engine token ids, so the trainer
learns from exactly the tokens the engine saw and produced.

Session id: the ``X-Session-Id`` header (``OpenAI(default_headers={"X-Session-Id": id})``) or a
``session_id`` body field (``extra_body={"session_id": id}``). Sessions are opened by the
trainer (:meth:`ChatEndpoint.open_session`) with their sampling settings and limits; a request
for an unknown session is refused (404), so a client cannot start episodes of its own.

Tokens of a session. The first request's messages (and ``tools``) go through the tokenizer's
chat template once, with the generation prompt. A later request normally repeats the
conversation so far (the session's messages and the assistant messages it was answered) and
adds new ones (tool results, a user message): then only the new messages are encoded and
appended to the session's token history, never the earlier turns again. Their text is the
template's rendering of the whole conversation minus its rendering up to the last assistant
message, starting after that message's end-of-turn marker (the ``\\n`` of ChatML's
``<|im_end|>\\n``), since the model's own tokens up to and including the marker are already in
the history. Decoding and re-encoding the model's turns could change their ids (merges,
special tokens, whitespace); this way the history is always ``context + turn_0 + new_0 +
turn_1 + ...`` with every model token as the engine produced it. A request whose messages do
not extend the session's (an agent that rewrote or summarised its context), whose tools
changed, or whose rendering does not extend the previous one, starts from a fresh rendering
of its messages instead: a *rewrite*, recorded on the call (``appended=False``); such an episode
trains as per-turn samples (``agent.per_turn_samples``).

Every model call is recorded (:class:`ModelCall`): its input ids and the engine's result
(output ids, log-probs at the sampling temperature, per-token weight versions, R3 routes).

Sampling is the run's: the temperature, top-p and top-k of the session's settings (the
trainer's log-probs are at that temperature); a request that asks for other values is refused
(400) rather than trained on wrong log-probs. ``max_tokens`` / ``max_completion_tokens``
lower the turn's limit; ``n`` must be 1; ``stream``, ``stop`` strings and ``logit_bias`` are
refused. Tool calls in the answer are parsed by the endpoint's ``tool_call_format``
(:mod:`~megatron_gspo.rollout.tool_calls`).

Security is the embedded server's (:mod:`megatron_gspo.rollout.server`): it binds 127.0.0.1,
refuses a ``Host`` that is not a loopback name (403), a missing or wrong ``Authorization:
Bearer <key>`` (401; the run's key, :mod:`~megatron_gspo.rollout.auth`), and a body that is not
``application/json`` (415).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlparse

from megatron_gspo.rollout.auth import bearer_matches, host_header_is_loopback, new_api_key
from megatron_gspo.rollout.peer_events import PeerEvents, peer_cut
from megatron_gspo.rollout.tool_calls import TOOL_CALL_FORMATS, parse_tool_calls
from megatron_gspo.rollout.types import (
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    RolloutEngineError,
    derive_turn_seed,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

LOOPBACK_HOST = "127.0.0.1"
SESSION_HEADER = "X-Session-Id"
CHAT_PATH = "/v1/chat/completions"
_CHAT_KEYS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "session_id",
    "stream",
    "stop",
    "logit_bias",
    "user",
    "parallel_tool_calls",
}
_REFUSED = {"stream": False, "stop": None, "logit_bias": None}


class EndpointError(ValueError):
    """A request the endpoint refuses; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SessionSettings:
    """How a session samples and where it stops (the run's sampling and ``agent.*`` limits)."""

    seed: int
    """Turn ``k`` samples with ``derive_turn_seed(seed, k)``."""
    response_budget: int
    """``algo.response_length``: tokens after the first context (model and appended)."""
    max_turns: int
    """Most model calls of the session."""
    max_tokens_per_turn: Optional[int] = None
    """Most tokens of one model turn; None: what is left of the budget."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a model turn (EOS and the template's end-of-turn token)."""
    return_routes: bool = False
    """Ask the engine for R3 routes."""
    return_route_weights: bool = False
    """With ``return_routes``: also their combine weights (R3 with replayed weights)."""


@dataclass
class ModelCall:
    """One engine call of a session: what it was given and what it answered."""

    input_ids: list[int]
    result: GenerateResult
    appended: bool
    """True when ``input_ids`` extends the previous call's input and output (the first call
    too); False after a rewrite (module docstring)."""


@dataclass
class ChatSession:
    """A session's state: its messages so far, token history and recorded calls."""

    session_id: str
    settings: SessionSettings
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The canonical messages the session holds: the last request's and the answer."""
    tools: Any = None
    tokens: list[int] = field(default_factory=list)
    """Context of the last call plus its output: what the next appended messages follow."""
    first_context_length: int = 0
    calls: list[ModelCall] = field(default_factory=list)
    ended: Optional[str] = None
    """Why no further call is served: ``length`` (budget or turns spent) or ``abort``."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def rewrites(self) -> int:
        return sum(not call.appended for call in self.calls)


def canonical_message(message: Any) -> dict[str, Any]:
    """The parts of a chat message that its rendering depends on, in one form: role, text
    content, tool calls (name and arguments as parsed JSON), tool call id and name. Harnesses
    send back the answer's message in many shapes (the client's object dumped with or without
    ``None`` fields, refusal and annotation fields, ids); these compare equal."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise EndpointError(
            HTTPStatus.BAD_REQUEST, f"a message must be an object with a role: {message!r:.200}"
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise EndpointError(HTTPStatus.BAD_REQUEST, "only text content parts are supported")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "{}")
        # Arguments that are not JSON compare as the text the harness sent.
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        calls.append({"name": function.get("name"), "arguments": arguments})
    canonical: dict[str, Any] = {"role": message["role"], "content": content or ""}
    if calls:
        canonical["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            canonical[key] = message[key]
    return canonical


def _template_message(canonical: dict[str, Any]) -> dict[str, Any]:
    """A canonical message in the form chat templates read (Qwen's and Hermes' templates take
    ``tool_calls`` as ``{"type": "function", "function": {"name", "arguments"}}``)."""
    message = {key: value for key, value in canonical.items() if key != "tool_calls"}
    if "tool_calls" in canonical:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in canonical["tool_calls"]
        ]
    return message


class ChatEndpoint:
    """Serves ``/v1/chat/completions`` for the sessions it was given, on
    ``http://127.0.0.1:<port>/v1`` (:attr:`base_url`), from a daemon thread.

    ``engine``: the rollout engine every call goes to; ``tokenizer``: the policy's, with its chat
    template; ``tool_call_format``: how answers are parsed for tool calls; ``api_key``: the
    secret clients send (None: a fresh one, :attr:`api_key`).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        tool_call_format: str = "hermes",
        api_key: Optional[str] = None,
        model_name: str = "policy",
        port: int = 0,
    ):
        if tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"tool_call_format {tool_call_format!r} is not one of {TOOL_CALL_FORMATS}"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat endpoint needs a tokenizer with a chat template")
        self.engine, self.tokenizer = engine, tokenizer
        self.tool_call_format = tool_call_format
        self.api_key = api_key or new_api_key()
        self.model_name = model_name
        self.peer_events = PeerEvents(logger)
        self._sessions: dict[str, ChatSession] = {}
        self._sessions_lock = threading.Lock()
        # The tokenizer is shared by the request threads; HF fast tokenizers are thread-safe
        # for encoding, and template rendering is pure Python.
        handler = type("_BoundChatHandler", (_ChatHandler,), {"endpoint": self})
        self._http = _ChatHTTPServer((LOOPBACK_HOST, port), handler)
        self._http.peer_events = self.peer_events
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return self._http.server_address[1]

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return f"http://{LOOPBACK_HOST}:{self.port}/v1"

    def start(self) -> ChatEndpoint:
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"chat-endpoint-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.peer_events.summarise()

    def __enter__(self) -> ChatEndpoint:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sessions

    def open_session(self, settings: SessionSettings, session_id: Optional[str] = None) -> str:
        """Open a session (a fresh id unless given); returns its id."""
        session_id = session_id or uuid.uuid4().hex
        with self._sessions_lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open")
            self._sessions[session_id] = ChatSession(session_id, settings)
        return session_id

    def close_session(self, session_id: str) -> ChatSession:
        """Close a session and return what it recorded; later requests for it get 404. The
        engine forgets the session's server (sticky routing, :meth:`RolloutEngine.end_session`)."""
        with self._sessions_lock:
            session = self._sessions.pop(session_id)
        # Wait for a call still running in the session (an agent that gave up on its request).
        with session.lock:
            self.engine.end_session(session_id)
            return session

    def _session(self, session_id: Optional[str]) -> ChatSession:
        if not session_id:
            raise EndpointError(
                HTTPStatus.BAD_REQUEST,
                f"no session id: send the {SESSION_HEADER} header (OpenAI(default_headers="
                f"{{'{SESSION_HEADER}': id}})) or extra_body={{'session_id': id}}",
            )
        with self._sessions_lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise EndpointError(HTTPStatus.NOT_FOUND, f"session {session_id!r} is not open")
        return session

    # ------------------------------------------------------------------ chat completions

    def chat_completion(self, body: Any, header_session: Optional[str]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise EndpointError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        unknown = set(body) - _CHAT_KEYS
        if unknown:
            raise EndpointError(HTTPStatus.BAD_REQUEST, f"unsupported fields {sorted(unknown)}")
        for key, neutral in _REFUSED.items():
            if body.get(key) not in (None, neutral, [], {}):
                raise EndpointError(
                    HTTPStatus.BAD_REQUEST, f"{key}={body[key]!r} is not supported by this endpoint"
                )
        if int(body.get("n") or 1) != 1:
            raise EndpointError(HTTPStatus.BAD_REQUEST, "n must be 1 (one session, one answer)")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list")
        session = self._session(body.get("session_id") or header_session)
        canonical = [canonical_message(message) for message in messages]
        with session.lock:
            self._check_sampling(body, session.settings)
            if session.ended is not None:
                raise EndpointError(
                    HTTPStatus.CONFLICT,
                    f"session {session.session_id!r} has ended ({session.ended}); end the episode",
                )
            context, appended = self._context(session, canonical, body.get("tools"))
            result = self._generate(session, context, appended, body)
            return self._answer(session, canonical, result, len(context))

    def _check_sampling(self, body: dict[str, Any], settings: SessionSettings) -> None:
        for key in ("temperature", "top_p", "top_k"):
            value, required = body.get(key), getattr(settings, key)
            if value is not None and float(value) != float(required):
                raise EndpointError(
                    HTTPStatus.BAD_REQUEST,
                    f"{key}={value} differs from the run's {key}={required}: the trainer's "
                    f"log-probs are at the run's sampling settings; leave {key} unset",
                )

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=generation,
            tokenize=False,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _context(
        self, session: ChatSession, messages: list[dict[str, Any]], tools: Any
    ) -> tuple[list[int], bool]:
        """The token ids of the next call and whether they extend the history (module
        docstring)."""
        held = session.messages
        if (
            held
            and len(messages) > len(held)
            and messages[: len(held)] == held
            and tools == session.tools
        ):
            new_ids = self._appended_ids(session, messages, tools)
            if new_ids is not None:
                return session.tokens + new_ids, True
        if session.calls:
            logger.info(
                "session %s: the messages do not extend the session's; rendered afresh "
                "(per-turn samples train it)",
                session.session_id,
            )
        session.tools = tools
        return self._encode(self._render(messages, tools, generation=True)), not session.calls

    def _appended_ids(
        self, session: ChatSession, messages: list[dict[str, Any]], tools: Any
    ) -> Optional[list[int]]:
        previous = self._render(session.messages, tools, generation=False)
        full = self._render(messages, tools, generation=True)
        if not full.startswith(previous):
            return None
        last = session.calls[-1].result
        stops = session.settings.stop_token_ids
        markers = {self.tokenizer.decode([token]) for token in stops}
        positions = [(previous.rfind(m), m) for m in markers if m and previous.rfind(m) >= 0]
        if not positions:
            return None
        position, marker = max(positions)
        ended_with_stop = bool(last.output_ids) and last.output_ids[-1] in stops
        # The model's tokens up to its end-of-turn marker are in the history already; a turn cut
        # before its marker gets the marker from the template.
        glue = previous[position + len(marker) :] if ended_with_stop else previous[position:]
        return self._encode(glue + full[len(previous) :])

    def _generate(
        self, session: ChatSession, context: list[int], appended: bool, body: dict[str, Any]
    ) -> Optional[GenerateResult]:
        settings = session.settings
        if not session.calls:
            session.first_context_length = len(context)
        used = len(context) - session.first_context_length if appended else 0
        if not appended:
            # After a rewrite the budget counts the model's tokens so far (the context changed).
            used = sum(len(call.result.output_ids) for call in session.calls)
        left = settings.response_budget - used
        limit = min(left, settings.max_tokens_per_turn or left)
        for key in ("max_tokens", "max_completion_tokens"):
            if body.get(key) is not None:
                limit = min(limit, int(body[key]))
        if left < 1 or len(session.calls) >= settings.max_turns:
            session.ended = "length"
            return None
        request = GenerateRequest(
            input_ids=context,
            max_new_tokens=max(1, limit),
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            stop_token_ids=settings.stop_token_ids,
            seed=derive_turn_seed(settings.seed, len(session.calls)),
            return_logprob=True,
            return_routed_experts=settings.return_routes,
            return_routed_expert_weights=settings.return_route_weights,
            session_id=session.session_id,
        )
        (result,) = self.engine.generate([request], n=1)
        session.calls.append(ModelCall(list(context), result, appended))
        session.tokens = list(context) + list(result.output_ids)
        if result.finish_reason == "abort":
            session.ended = "abort"
            raise EndpointError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the engine aborted the request ({result.abort_message}); the episode ends",
            )
        if (
            result.finish_reason == "length"
            and len(session.tokens) - session.first_context_length >= settings.response_budget
        ):
            session.ended = "length"
        return result

    def _answer(
        self,
        session: ChatSession,
        messages: list[dict[str, Any]],
        result: Optional[GenerateResult],
        context_length: int,
    ) -> dict[str, Any]:
        if result is None:
            content, calls, finish, completion = "", [], "length", 0
        else:
            stops = set(session.settings.stop_token_ids)
            output = [t for t in result.output_ids if t not in stops]
            text = self.tokenizer.decode(output, skip_special_tokens=False)
            content, calls = parse_tool_calls(text, self.tool_call_format)
            finish = "tool_calls" if calls else result.finish_reason
            completion = len(result.output_ids)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ]
        session.messages = [*messages, canonical_message(message)]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": context_length,
                "completion_tokens": completion,
                "total_tokens": context_length + completion,
            },
        }


class _ChatHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    peer_events: PeerEvents

    def handle_error(self, request: Any, client_address: Any) -> None:
        # As the embedded server: no traceback per connection a local process cuts.
        error = sys.exc_info()[1]
        kind = "cut connections" if peer_cut(error) else "failed requests"
        level = logging.INFO if peer_cut(error) else logging.ERROR
        self.peer_events.note(kind, level, "chat endpoint: %s from %s", kind, client_address[0])


class _ChatHandler(BaseHTTPRequestHandler):
    endpoint: ChatEndpoint
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # see server._Handler: 40 ms per answer otherwise

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("chat endpoint %s: " + format, self.address_string(), *args)

    def _reply(self, status: int, payload: Any, headers: tuple[tuple[str, str], ...] = ()) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        # OpenAI's error shape, which the client turns into its exception's message.
        self._reply(
            status, {"error": {"message": message, "type": "invalid_request_error"}}, headers
        )

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _refusal(self, method: str) -> Optional[tuple[int, str, tuple]]:
        if not host_header_is_loopback(self.headers.get("Host")):
            return HTTPStatus.FORBIDDEN, "Host is not a loopback name", ()
        if not bearer_matches(self.headers.get("Authorization"), self.endpoint.api_key):
            return (
                HTTPStatus.UNAUTHORIZED,
                "missing or wrong API key: send the run's key as 'Authorization: Bearer <key>' "
                "(OpenAI(api_key=...))",
                (("WWW-Authenticate", "Bearer"),),
            )
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if method == "POST" and content_type != "application/json":
            return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "bodies must be application/json", ()
        return None

    def _dispatch(self, method: str) -> None:
        endpoint = self.endpoint
        path = urlparse(self.path).path.rstrip("/")
        refusal = self._refusal(method)
        if refusal is not None:
            status, message, headers = refusal
            self.close_connection = True
            endpoint.peer_events.note(
                "refused requests",
                logging.WARNING,
                "chat endpoint refused %s %.100s from %s (HTTP %d): %s",
                method,
                path,
                self.client_address[0],
                status,
                message,
            )
            self._error(status, message, headers)
            return
        try:
            if path == CHAT_PATH and method == "POST":
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except json.JSONDecodeError as error:
                    raise EndpointError(
                        HTTPStatus.BAD_REQUEST, f"the body is not JSON: {error}"
                    ) from None
                answer = endpoint.chat_completion(body, self.headers.get(SESSION_HEADER))
                self._reply(HTTPStatus.OK, answer)
            elif path == "/v1/models" and method == "GET":
                model = {"id": endpoint.model_name, "object": "model", "owned_by": "megatron_gspo"}
                self._reply(HTTPStatus.OK, {"object": "list", "data": [model]})
            else:
                self._error(HTTPStatus.NOT_FOUND, f"{method} {path} is not served here")
        except EndpointError as error:
            self._error(error.status, str(error))
        except Exception as error:
            if peer_cut(error):
                raise
            status = (
                HTTPStatus.SERVICE_UNAVAILABLE
                if isinstance(error, RolloutEngineError)
                else HTTPStatus.INTERNAL_SERVER_ERROR
            )
            endpoint.peer_events.note(
                "failed requests", logging.ERROR, "chat endpoint: %s failed", path, exc_info=True
            )
            self._error(status, f"{type(error).__name__}: {error}")
