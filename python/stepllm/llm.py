"""LLM: offline batch generation, chat and streaming over one Engine (vLLM-style)."""

from __future__ import annotations

import contextlib
import numbers
import os
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence, Union

from ._core import Config, GenerationRequest, GenerationResponse, InvalidRequestError, RequestStream, SamplingParams
from .engine import Engine

if TYPE_CHECKING:
    from ._core import ModelInfo

Prompt = Union[str, Sequence[int]]
Message = Mapping[str, str]
SamplingArg = Union[SamplingParams, Sequence[SamplingParams], None]


def _is_token_ids(x: object) -> bool:
    return (
        isinstance(x, (list, tuple, range))
        and len(x) > 0
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x)
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """str -> [str]; [int, ...] (or a 1-D integer array) -> one token prompt; [str | [int], ...] -> as given."""
    if isinstance(prompts, Mapping):
        raise InvalidRequestError("a prompt is a str or a list of token ids; pass chat messages to LLM.chat")
    if hasattr(prompts, "tolist"):  # a numpy array of token ids, or of prompts
        prompts = prompts.tolist()
    if isinstance(prompts, str) or _is_token_ids(prompts):
        return [prompts]  # type: ignore[list-item]
    return [list(p) if _is_token_ids(p) else p for p in prompts]  # type: ignore[union-attr]


def _as_conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[Sequence[Message]]:
    """One conversation (a list of {role, content}) or a list of them."""
    items = list(messages)
    if items and isinstance(items[0], Mapping):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _per_prompt(sampling_params: SamplingArg, n: int) -> list[SamplingParams | None]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params: list[SamplingParams | None] = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts; pass one, or one per prompt")
    return params


def _cancel_and_drain(streams: Sequence[RequestStream]) -> None:
    """Cancel the unfinished streams and return once the engine has let every one of them go."""
    for s in streams:
        if not s.finished:
            s.cancel()
    for s in streams:
        with contextlib.suppress(Exception):  # an error already being raised is the one that matters
            s.wait()


class LLM:
    """`LLM(model=None, device="auto", **config)`; config keywords are Config's (max_batch_size, kv_cache_tokens,
    block_size, max_model_len, context_cache, parallel). model None means the default model."""

    def __init__(self, model: str | os.PathLike[str] | None = None, device: str = "auto", **config: Any) -> None:
        self.config = Config(model=model, device=device, **config)
        self.engine = Engine(self.config)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingArg = None) -> list[GenerationResponse]:
        """Complete each prompt (text or token ids); responses in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        return self._run([GenerationRequest(p, s) for p, s in zip(prompts, params)])

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingArg = None,
    ) -> list[GenerationResponse]:
        """Reply to one conversation or to each of a list of conversations, through the chat template."""
        conversations = _as_conversations(messages)
        params = _per_prompt(sampling_params, len(conversations))
        return self._run([GenerationRequest([dict(m) for m in c], s) for c, s in zip(conversations, params)])

    def stream(self, prompt: Prompt | Sequence[Message], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Text chunks as they are generated; closing the iterator early cancels the request (and returns once
        the engine has let it go)."""
        stream = self.engine.submit(GenerationRequest(prompt, sampling_params))
        try:
            for chunk in stream:
                if chunk.text:
                    yield chunk.text
        finally:
            _cancel_and_drain([stream])

    def _run(self, requests: list[GenerationRequest]) -> list[GenerationResponse]:
        # Each request is validated as it is queued, so bad input raises. The requests queued before it are
        # cancelled and drained first: when the call raises, the engine has let every one of them go.
        streams = []
        try:
            for r in requests:
                streams.append(self.engine.submit(r))
            return [s.wait() for s in streams]
        except BaseException:
            _cancel_and_drain(streams)
            raise

    def info(self) -> ModelInfo:
        return self.engine.info()

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LLM(config={self.config!r})"
