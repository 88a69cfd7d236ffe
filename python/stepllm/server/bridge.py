"""One engine request bridged into asyncio.

A pump thread blocks on the RequestStream (the GIL is released while it waits) and hands each chunk to the event
loop, so a token reaches its client as soon as the engine publishes it and no event-loop worker is held by a slow
stream. The pump always drains the stream to its end, so whatever happens to the client, the request's outcome is
observed exactly once (`on_end`) and the in-flight count goes down only when the engine has let the request go.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol, Sequence, Union

from .._core import FinishReason, GenerationRequest, GenerationResponse, RequestStream, StreamChunk

if TYPE_CHECKING:
    from .._core import EngineStats, ModelInfo, PoolCounts


class EngineLike(Protocol):
    """What the server needs of an engine: stepllm.Engine, or a wrapper around one."""

    def submit(self, request: GenerationRequest) -> RequestStream: ...
    def tokenize(self, request: GenerationRequest) -> list[int]: ...
    def decode_token(self, token_id: int) -> str: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def cancel(self, request_id: int) -> None: ...
    def stats(self) -> EngineStats: ...
    def info(self) -> ModelInfo: ...
    def counts(self) -> PoolCounts: ...


@dataclass
class Timing:
    """Monotonic timestamps of one request, for TTFT / TPOT."""

    arrived: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    def tpot(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


_END = object()
_Item = Union[StreamChunk, BaseException, object]
EndCallback = Callable[["GenerationHandle"], None]


@dataclass(eq=False)  # identity semantics: handles live in sets
class GenerationHandle:
    """Submit with `start`; consume `chunks()`; read `response` after the end; `cancel()` at any time."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    timing: Timing
    on_end: EndCallback | None = None
    error: BaseException | None = None
    _queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    _ended: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(
        cls, engine: EngineLike, request: GenerationRequest, *, arrived: float | None = None, on_end: EndCallback | None = None
    ) -> GenerationHandle:
        """Validate and queue now (InvalidRequestError propagates); a pump thread then follows the stream."""
        loop = asyncio.get_running_loop()
        stream = engine.submit(request)
        handle = cls(stream, loop, Timing(arrived if arrived is not None else time.monotonic()), on_end)
        threading.Thread(target=handle._pump, name=f"stepllm-stream-{stream.request_id}", daemon=True).start()
        return handle

    @property
    def request_id(self) -> int:
        return self.stream.request_id

    @property
    def response(self) -> GenerationResponse | None:
        return self.stream.response

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def cancel(self) -> None:
        """Ask the engine to stop this request (its slot and blocks go by the next tick); idempotent."""
        if not self._ended.is_set() and not self.stream.finished:
            self.stream.cancel()

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The chunks as they come; ends when the engine finished the request; raises if the stream broke."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, StreamChunk)
            yield item

    async def result(self) -> GenerationResponse:
        """Drain and return the final response."""
        async for _ in self.chunks():
            pass
        response = self.response
        if response is None:  # pragma: no cover - the core always ends a stream with a response
            raise RuntimeError(f"request {self.request_id} ended without a response")
        return response

    # ---------------------------------------------------------------------------------------- pump thread

    def _pump(self) -> None:
        try:
            for chunk in self.stream:
                if chunk.token_ids:
                    now = time.monotonic()
                    if self.timing.first_token is None:
                        self.timing.first_token = now
                    self.timing.last_token = now
                    self.timing.tokens += len(chunk.token_ids)
                self._put(chunk)
            self._put(_END)
        except BaseException as e:  # the stream broke (the engine stopped under it)
            self.error = e
            self._put(e)
        finally:
            self._ended.set()
            if self.on_end is not None:
                try:
                    self.on_end(self)
                except Exception:  # pragma: no cover - bookkeeping must never kill the pump
                    pass

    def _put(self, item: _Item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody will read this request
            if not self.stream.finished:
                self.stream.cancel()


def finished_ok(response: GenerationResponse) -> bool:
    return response.finish_reason not in (FinishReason.ERROR, FinishReason.CANCELLED)
