"""Async iteration over a RequestStream: every wait runs in a worker thread, so the event loop never blocks."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator

if TYPE_CHECKING:
    from ._core import RequestStream, StreamChunk

# Each wait is short so a worker thread is never held long by one stream: many concurrent streams share the
# default executor's few threads fairly.
_POLL_SECONDS = 0.05


async def aiter_stream(stream: RequestStream) -> AsyncIterator[StreamChunk]:
    while True:
        ended, chunk = await asyncio.to_thread(stream._poll, _POLL_SECONDS)
        if ended:
            return
        if chunk is not None:
            yield chunk
