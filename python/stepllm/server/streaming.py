"""Server-sent events: the OpenAI chunk stream of one request, and an ASGI response that notices a client that
goes away at once (not only at its next write), so the engine drops the request by its next tick."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncGenerator, Callable, Mapping, Sequence, Union

import anyio
from anyio import CancelScope
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .._core import FinishReason, GenerationResponse, StreamChunk, TokenLogprob
from .bridge import GenerationHandle
from .errors import error_body
from .responses import DONE, Context, sse


# What a choice's follower hands the stream: a chunk, the choice's end (None), or the error that broke it.
_Event = Union[StreamChunk, BaseException, None]


async def stream_events(handles: Sequence[GenerationHandle], ctx: Context, want_logprobs: bool) -> AsyncGenerator[str, None]:
    """The choices' chunks as SSE events in the order they come, each naming its choice; a choice's finish chunk
    when it ends; then the usage chunk if asked, and [DONE]. An echoed prompt is its choice's first chunk: sent up
    front, or with logprobs at the choice's first token (whose chunk brings the prompt's logprobs) or, if none
    comes, at its end. An engine failure of any choice after the headers went out is an error event that ends the
    stream (the official client raises it as an APIError). However the generator ends, every choice still running
    is cancelled."""
    merged: asyncio.Queue[tuple[int, _Event]] = asyncio.Queue()
    followers = [asyncio.ensure_future(_follow(index, handle, merged)) for index, handle in enumerate(handles)]
    # The choices whose echo waits for their prompt's logprobs.
    echo_later = {index for index in range(len(handles)) if ctx.echo(index) and want_logprobs}
    try:
        for index in range(len(handles)):
            if ctx.kind == "chat":
                yield ctx.chunk("", index=index, role=True)
            if ctx.echo(index) and index not in echo_later:
                yield ctx.echo_chunk(index)
        running = len(handles)
        held: deque[tuple[int, _Event]] = deque()
        while running:
            index, event = held.popleft() if held else await merged.get()
            if isinstance(event, StreamChunk):
                if echo := _late_echo(ctx, echo_later, index, event.prompt_logprobs):
                    yield echo
                chunks = [event, *_chunks_already_here(index, merged, held)]
                text = "".join(c.text for c in chunks)
                # Each chunk's logprobs are its tokens' (a token whose text is held back still has them).
                logprobs = [lp for c in chunks for lp in (c.logprobs or [])] if want_logprobs else []
                if text or logprobs:
                    yield ctx.chunk(text, index=index, logprobs=logprobs or None)
                continue
            if isinstance(event, BaseException):
                yield sse(error_body(f"the engine failed this request: {event}", "server_error", code="engine_error"))
                yield DONE
                return
            running -= 1
            response = handles[index].response
            assert response is not None
            if response.finish_reason == FinishReason.ERROR:
                yield sse(error_body(engine_error_message(response), "server_error", code="engine_error"))
                yield DONE
                return
            if echo := _late_echo(ctx, echo_later, index, response.prompt_logprobs):
                yield echo
            yield ctx.chunk(None if ctx.kind == "chat" else "", index=index, finish=response)
        if ctx.include_usage:
            yield ctx.usage_chunk([_response_of(h) for h in handles])
        yield DONE
    finally:
        for follower in followers:
            follower.cancel()
        for handle in handles:
            handle.cancel()


def _late_echo(ctx: Context, echo_later: set[int], index: int, prompt_logprobs: Sequence[TokenLogprob | None] | None) -> str | None:
    """The echo chunk of choice `index` if its echo still waits for the prompt's logprobs (here now), else None."""
    if index not in echo_later:
        return None
    echo_later.discard(index)
    return ctx.echo_chunk(index, prompt_logprobs)


def _chunks_already_here(index: int, merged: asyncio.Queue[tuple[int, _Event]], held: deque[tuple[int, _Event]]) -> list[StreamChunk]:
    """The chunks of choice `index` that are already queued behind the one in hand, so they leave as one event: a
    server that falls behind its streams (many clients, a fast GPU) then sends fewer, longer chunks instead of falling
    further behind. Stops at the first event of another kind or choice, kept in `held`."""
    chunks: list[StreamChunk] = []
    while not held and not merged.empty():
        item = merged.get_nowait()
        if item[0] == index and isinstance(item[1], StreamChunk):
            chunks.append(item[1])
        else:
            held.append(item)
    return chunks


async def _follow(index: int, handle: GenerationHandle, merged: asyncio.Queue[tuple[int, _Event]]) -> None:
    """Forward one choice's chunks, then its end or the error that broke its stream."""
    try:
        async for chunk in handle.chunks():
            merged.put_nowait((index, chunk))
        merged.put_nowait((index, None))
    except Exception as e:
        merged.put_nowait((index, e))


def _response_of(handle: GenerationHandle) -> GenerationResponse:
    response = handle.response
    assert response is not None, "a choice that ended has its response"
    return response


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


async def wait_unless_disconnected(receive: Receive, handles: Sequence[GenerationHandle]) -> list[GenerationResponse] | None:
    """The final responses of a non-streamed request's choices, or None if the client went away first. Raises if a
    choice's stream broke. Either way, no choice is left running."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
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
            result.cancel()
        for handle in handles:  # a no-op for the choices that finished
            handle.cancel()
