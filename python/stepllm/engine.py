"""Engine: the request engine (an actor thread driving one operation per tick) behind a thin wrapper."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import _core
from ._core import Config, GenerationRequest, RequestStream

if TYPE_CHECKING:  # typed dicts that exist in the stubs only
    from ._core import EngineStats, ModelInfo, PoolCounts

ProgressCallback = Callable[[int, int], None]


class Engine:
    """Submit requests from any thread; each returns a RequestStream (sync or async iteration).

    `Engine(config)` takes a Config; `Engine(model=..., device=..., ...)` builds one from keywords.
    `progress(done, total)` is called as the model loads.
    """

    def __init__(self, config: Config | None = None, *, progress: ProgressCallback | None = None, **config_kwargs: Any) -> None:
        if config is not None and config_kwargs:
            raise TypeError("pass either a Config or Config keywords, not both")
        if config is None:
            config = Config(**config_kwargs)
        self.config = config
        self._engine = _core.Engine(config, progress)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Validate and tokenize now (bad input raises InvalidRequestError), then queue."""
        return self._engine.submit(request)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return self._engine.count_prompt_tokens(request)

    def tokenize(self, request: GenerationRequest) -> list[int]:
        return self._engine.tokenize(request)

    def decode_token(self, token_id: int) -> str:
        return self._engine.decode_token(token_id)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._engine.decode(token_ids, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return self._engine.token_bytes(token_id)

    def cancel(self, request_id: int) -> None:
        self._engine.cancel(request_id)

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def info(self) -> ModelInfo:
        return self._engine.info()

    def counts(self) -> PoolCounts:
        return self._engine.counts()

    @property
    def is_shut_down(self) -> bool:
        return self._engine.is_shut_down

    def shutdown(self) -> None:
        """Stop the engine; unfinished requests end CANCELLED. Idempotent."""
        self._engine.shutdown()

    close = shutdown

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Engine(config={self.config!r})"
