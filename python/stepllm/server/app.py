"""The OpenAI-compatible app: `create_app(engine, api_key=None, max_waiting=256)` -> a Starlette ASGI app.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed or not), GET /v1/models, GET /health,
GET /metrics. With an api_key, /v1/* needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Union

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._core import FinishReason, GenerationRequest, InvalidRequestError
from . import errors
from . import metrics as m
from .bridge import EngineLike, GenerationHandle
from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse
from .responses import Context, Kind, TokenBytes, TokenText
from .streaming import EventStreamResponse, engine_error_message, stream_events, wait_unless_disconnected

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024  # when a chat request names no limit (clipped to what the context leaves)
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 32 << 20

AnyRequest = Union[CompletionRequest, ChatCompletionRequest]


class ServerState:
    """The engine, its description, the in-flight count that backpressure reads, and the metrics."""

    def __init__(
        self,
        engine: EngineLike,
        *,
        api_key: str | None,
        max_waiting: int,
        model_name: str | None,
        chat_default_max_tokens: int,
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.info = engine.info()
        self.model_name = model_name or model_id(self.info["source"])
        self.api_key = api_key
        self.max_waiting = max_waiting
        self.max_running = int(self.info["max_batch_size"])
        self.chat_default_max_tokens = chat_default_max_tokens
        self.created = int(time.time())
        self.metrics = m.ServerMetrics(engine.stats)
        self.token_text: TokenText = engine.decode_token
        self.token_bytes: TokenBytes = engine.token_bytes
        self._lock = threading.Lock()
        self._handles: set[GenerationHandle] = set()

    # ---------------------------------------------------------------------------------------- admission

    @property
    def inflight(self) -> int:
        """Requests submitted to the engine and not yet let go by it."""
        return len(self._handles)

    @property
    def waiting(self) -> int:
        return max(0, self.inflight - self.max_running)

    def cancel_all(self) -> int:
        """Cancel every request in flight (server shutdown); returns how many."""
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            h.cancel()
        return len(handles)

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise errors.unauthorized()

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.info["source"]):
            raise errors.model_not_found(name)

    def check_capacity(self, choices: int) -> None:
        """429 when the queue behind the running requests has no room for `choices` more; 400 when it never could.
        Every slot is either running or waiting, so in-flight beyond the slots is the waiting queue; counted here,
        without a round trip to the engine."""
        room = self.max_running + self.max_waiting
        if choices > room:
            raise errors.bad_request(
                f"this request asks for {choices} choices (n times the prompts), more than the server runs and queues "
                f"at once ({room}); send fewer prompts or a smaller n",
                param="n",
                code="invalid_value",
            )
        if self.inflight + choices > room:
            raise errors.overloaded(RETRY_AFTER_S, self.waiting)

    def submit(
        self, endpoint: str, req: AnyRequest, arrived: float, prompt_ids: list[list[int]] | None = None
    ) -> list[GenerationHandle]:
        """Queue every choice of the request (InvalidRequestError -> 400, with none of its choices left queued); a
        completion's prompts as `prompt_ids` when the server tokenized them already. A chat request without a limit
        gets the default, clipped to what its prompt leaves of the context."""
        on_end = self._ended(endpoint)
        requested = req.requested_max_tokens()
        if requested is not None or isinstance(req, CompletionRequest):
            limit = requested if requested is not None else COMPLETION_DEFAULT_MAX_TOKENS
            if limit >= int(self.info["kv_cache_tokens"]):  # the engine would reject it at admission, as a 500
                raise errors.bad_request(
                    f"max_tokens ({limit}) and the prompt cannot fit the KV cache ({self.info['kv_cache_tokens']} tokens); "
                    "lower max_tokens",
                    param="max_tokens",
                    code="invalid_value",
                )
            if isinstance(req, CompletionRequest):
                return self._start_all(req.generation_requests(limit, prompt_ids), arrived, on_end)
            return self._start_all(req.generation_requests(limit), arrived, on_end)
        # As vLLM: what the context leaves after the prompt (a prompt that leaves nothing is refused with the
        # engine's reason). The conversation is tokenized once: its choices run the ids.
        assert isinstance(req, ChatCompletionRequest)
        prompt_ids = self.engine.tokenize(req.generation_requests(1)[0])
        context = min(int(self.info["max_model_len"]), int(self.info["kv_cache_tokens"]))
        limit = min(self.chat_default_max_tokens, context - len(prompt_ids))
        return self._start_all(req.generation_requests(max(limit, 1), prompt_ids), arrived, on_end)

    def _start_all(
        self, requests: list[GenerationRequest], arrived: float, on_end: Callable[[GenerationHandle], None]
    ) -> list[GenerationHandle]:
        """Start every choice, or none: one the engine refuses cancels those already started."""
        handles: list[GenerationHandle] = []
        try:
            for request in requests:
                handles.append(self._start(request, arrived, on_end))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    def _start(self, request: GenerationRequest, arrived: float, on_end: Callable[[GenerationHandle], None]) -> GenerationHandle:
        handle = GenerationHandle.start(self.engine, request, arrived=arrived, on_end=on_end)
        with self._lock:
            if not handle.ended:
                self._handles.add(handle)
        return handle

    def _ended(self, endpoint: str) -> Callable[[GenerationHandle], None]:
        def on_end(handle: GenerationHandle) -> None:
            with self._lock:
                self._handles.discard(handle)
            self.metrics.finished(endpoint, handle.response, handle.timing, time.monotonic())

        return on_end


def model_id(source: str) -> str:
    """The served model's name: its directory or file name (a GGUF file without the extension)."""
    path = Path(source)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def request_id(request: Request, req: AnyRequest) -> str:
    """The caller's id (X-Request-Id header, else the request_id field), else a fresh one."""
    return request.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused with 413 past `limit` bytes (checked as it arrives, not only by Content-Length)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit // (1 << 20)} MiB.", code="request_too_large")


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.stepllm
    return state


async def _generate(request: Request, kind: Kind) -> Response:
    arrived = time.monotonic()
    state = state_of(request)
    endpoint = "chat" if kind == "chat" else "completions"
    try:
        state.authorize(request)
        req: AnyRequest = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, await read_body(request))
        state.check_model(req.model)
        state.check_capacity(req.choice_count())
        echo_ids = req.streamed_echo_ids(state.engine.tokenize) if isinstance(req, CompletionRequest) else []
        handles = state.submit(endpoint, req, arrived, echo_ids)
        echoes: list[str] = []
        try:  # after submit, which refuses token ids outside the vocabulary
            if isinstance(req, CompletionRequest):
                echoes = req.echo_texts(state.engine.decode)
        except BaseException:
            cancel_all(handles)()
            raise
    except APIError as e:
        state.metrics.refused(endpoint, _refusal_outcome(e.status))
        raise
    except InvalidRequestError as e:
        state.metrics.refused(endpoint, m.INVALID)
        raise errors.bad_request(str(e), code="invalid_value") from None

    rid = request_id(request, req)
    ctx = Context(
        kind=kind,
        id=("chatcmpl-" if kind == "chat" else "cmpl-") + rid,
        model=state.model_name,
        token_text=state.token_text,
        token_bytes=state.token_bytes,
        include_usage=req.include_usage,
        samples=req.samples,
        echoes=echoes,
        echo_ids=echo_ids,
    )
    headers = {"X-Request-Id": rid}
    want_logprobs = req.requested_logprobs() is not None
    if req.stream:
        return EventStreamResponse(stream_events(handles, ctx, want_logprobs), on_disconnect=cancel_all(handles), headers=headers)

    try:
        responses = await wait_unless_disconnected(request.receive, handles)
    except Exception as e:
        raise errors.server_error(f"the engine failed this request: {e}") from None
    if responses is None:  # the client left; nothing will read what we answer
        return Response(status_code=499)
    failed = [r for r in responses if r.finish_reason == FinishReason.ERROR]
    if failed:
        raise errors.server_error(engine_error_message(failed[0]))
    return JSONResponse(ctx.full(responses), headers=headers)


def cancel_all(handles: list[GenerationHandle]) -> Callable[[], None]:
    def cancel() -> None:
        for handle in handles:
            handle.cancel()

    return cancel


def _refusal_outcome(status: int) -> str:
    return {401: m.UNAUTHORIZED, 429: m.OVERLOADED}.get(status, m.INVALID)


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def models(request: Request) -> Response:
    state = state_of(request)
    state.authorize(request)
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "stepllm",
        "root": state.info["source"],
        "parent": None,
        "max_model_len": state.info["max_model_len"],
    }
    return JSONResponse({"object": "list", "data": [card]})


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: the prompt's token ids as a completion or chat request would see them."""
    state, req = await _authorized_body(request, TokenizeRequest)
    tokens = await _on_engine_thread(state.engine.tokenize, req.generation_request())
    return JSONResponse({"count": len(tokens), "max_model_len": state.info["max_model_len"], "tokens": tokens, "token_strs": None})


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: token ids back to text."""
    state, req = await _authorized_body(request, DetokenizeRequest)
    return JSONResponse({"prompt": await _on_engine_thread(state.engine.decode, req.tokens, param="tokens")})


async def _authorized_body(request: Request, model: type[Any]) -> tuple[ServerState, Any]:
    state = state_of(request)
    state.authorize(request)
    req = parse(model, await read_body(request))
    state.check_model(req.model)
    return state, req


async def _on_engine_thread(call: Callable[..., Any], *args: Any, param: str | None = None) -> Any:
    """`call(*args)` off the event loop (it may wait for the engine's tokenizer); bad input is a 400."""
    try:
        return await asyncio.to_thread(call, *args)
    except (InvalidRequestError, OverflowError) as e:
        raise errors.bad_request(str(e), param=param, code="invalid_value") from None


async def health(request: Request) -> Response:
    state = state_of(request)
    if getattr(state.engine, "is_shut_down", False):
        return JSONResponse({"status": "engine shut down"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    # stats() may wait for the engine's current step: keep that off the event loop.
    body = await asyncio.to_thread(state_of(request).metrics.render)
    return Response(body, media_type=m.CONTENT_TYPE)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(errors.error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(errors.error_body(f"internal server error: {exc}", "server_error"), status_code=500)


def create_app(
    engine: EngineLike,
    api_key: str | None = None,
    max_waiting: int = 256,
    *,
    model_name: str | None = None,
    chat_default_max_tokens: int = CHAT_DEFAULT_MAX_TOKENS,
) -> Starlette:
    """An ASGI app serving `engine`. The engine's lifetime stays the caller's: the app never shuts it down."""
    state = ServerState(
        engine, api_key=api_key, max_waiting=max_waiting, model_name=model_name, chat_default_max_tokens=chat_default_max_tokens
    )
    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.stepllm = state
    return app
