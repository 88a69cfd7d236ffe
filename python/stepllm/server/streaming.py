"""Server-sent events: the OpenAI chunk stream of one request, and an ASGI response that notices a client that
goes away at once (not only at its next write), so the engine drops the request by its next tick."""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Callable, Mapping

import anyio
from anyio import CancelScope
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .._core import FinishReason, GenerationResponse
from .bridge import GenerationHandle
from .errors import error_body
from .responses import DONE, Context, sse


async def stream_events(handle: GenerationHandle, ctx: Context, want_logprobs: bool) -> AsyncGenerator[str, None]:
    """The request's chunks as SSE events, then the finish chunk, the usage chunk if asked, and [DONE]. An engine
    failure after the headers went out is an error event (the official client raises it as an APIError). However
    the generator ends, the request is cancelled if it is still running."""
    try:
        if ctx.kind == "chat":
            yield ctx.chunk("", role=True)
        if ctx.echo:
            yield ctx.chunk(ctx.echo)
        try:
            async for chunk in handle.chunks():
                if chunk.text:
                    yield ctx.chunk(chunk.text)
        except Exception as e:
            yield sse(error_body(f"the engine failed this request: {e}", "server_error", code="engine_error"))
            yield DONE
            return
        response = handle.response
        assert response is not None
        if response.finish_reason == FinishReason.ERROR:
            yield sse(error_body(engine_error_message(response), "server_error", code="engine_error"))
            yield DONE
            return
        if want_logprobs and response.logprobs:
            # The core streams text without logprobs; they arrive with the final response, in one chunk.
            yield ctx.chunk("", logprobs=response.logprobs)
        yield ctx.chunk(None if ctx.kind == "chat" else "", finish=response)
        if ctx.include_usage:
            yield ctx.usage_chunk(response)
        yield DONE
    finally:
        handle.cancel()


def engine_error_message(response: GenerationResponse) -> str:
    return f"the engine failed this request: {response.error or 'unknown error'}"


class EventStreamResponse(Response):
    """Streams `events` as text/event-stream while watching for the client's disconnect; on disconnect (seen on
    the receive channel or as a failed write) calls `on_disconnect` and stops."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_disconnect: Callable[[], None],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                try:
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                    async for event in self.events:
                        await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the write failed: the client is gone
                    self.on_disconnect()
                finally:
                    tg.cancel_scope.cancel()
        finally:
            await self.events.aclose()

    async def _watch(self, receive: Receive, scope: CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.on_disconnect()
                scope.cancel()
                return


async def wait_unless_disconnected(receive: Receive, handle: GenerationHandle) -> GenerationResponse | None:
    """The final response of a non-streamed request, or None if the client went away first (the request is then
    cancelled)."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(handle.result())
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        watch.exception()  # a receive channel that broke counts as a disconnect too
        return None
    finally:
        watch.cancel()
        if not result.done():
            handle.cancel()
            result.cancel()
