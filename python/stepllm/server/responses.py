"""Response bodies in the OpenAI shape: full responses, stream chunks, usage and logprobs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Sequence

from .._core import FinishReason, GenerationResponse, TokenLogprob

Kind = Literal["completion", "chat"]
TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def finish_reason(response: GenerationResponse) -> str:
    r = response.finish_reason
    if r in (FinishReason.EOS, FinishReason.STOP):
        return "stop"
    if r == FinishReason.LENGTH:
        return "length"
    return "abort" if r == FinishReason.CANCELLED else "error"


def stop_reason(response: GenerationResponse) -> str | int | None:
    """vLLM's extension: the stop string (or stop token id) that ended the request; None for EOS / length."""
    if response.finish_reason != FinishReason.STOP or response.stop_reason is None:
        return None
    s = response.stop_reason
    return int(s) if s.isdigit() else s


@dataclass
class Context:
    """What every body of one request shares. Choice i answers prompt i // samples (its samples-th draw)."""

    kind: Kind
    id: str
    model: str
    token_text: TokenText  # Engine.decode_token
    token_bytes: TokenBytes  # Engine.token_bytes
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False
    samples: int = 1
    echoes: Sequence[str] = ()  # each prompt's text, when the completion echoes its prompts
    echo_ids: Sequence[Sequence[int]] = ()  # each prompt's token ids, when a stream echoes them with their logprobs
    # Where each streamed completion choice's next token starts in its text (logprobs' text_offset).
    stream_offsets: dict[int, int] = field(default_factory=dict)

    def echo(self, index: int) -> str:
        """What choice `index` repeats before its completion: its prompt, with echo, else nothing."""
        return self.echoes[index // self.samples] if self.echoes else ""

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    # --------------------------------------------------------------------------------------- full responses

    def full(self, responses: Sequence[GenerationResponse]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self._full_choice(index, response) for index, response in enumerate(responses)],
            "usage": self.usage(responses),
            "system_fingerprint": None,
        }

    def _full_choice(self, index: int, response: GenerationResponse) -> dict[str, Any]:
        text = response.output_text
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(response), "stop_reason": stop_reason(response)}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text, "refusal": None, "tool_calls": []}
            choice["logprobs"] = self.chat_logprobs(response.logprobs)
        else:
            echo = self.echo(index)
            choice["text"] = echo + text
            choice["logprobs"] = self.completion_logprobs(response.logprobs, offset=len(echo))
            if echo and response.prompt_logprobs is not None:  # the echoed prompt's tokens first
                prompt = self.prompt_logprobs(response.prompt_ids, response.prompt_logprobs)
                choice["logprobs"] = {key: prompt[key] + (choice["logprobs"] or {}).get(key, []) for key in prompt}
        return choice

    def usage(self, responses: Sequence[GenerationResponse]) -> dict[str, Any]:
        """Prompt tokens once per prompt (its first choice's), completion tokens of every choice."""
        firsts = responses[:: self.samples]
        p = sum(len(r.prompt_ids) for r in firsts)
        c = sum(len(r.output_ids) for r in responses)
        cached = sum(r.cached_prompt_tokens for r in firsts)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": {"cached_tokens": cached}}

    # --------------------------------------------------------------------------------------- stream chunks

    def chunk(
        self,
        text: str | None,
        *,
        index: int = 0,
        role: bool = False,
        logprobs: Sequence[TokenLogprob] | None = None,
        finish: GenerationResponse | None = None,
    ) -> str:
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            choice["logprobs"] = self.chat_logprobs(logprobs)
        else:
            choice["text"] = text or ""
            start = self.stream_offsets.get(index, len(self.echo(index)))
            choice["logprobs"] = self.completion_logprobs(logprobs, offset=start)
            if choice["logprobs"] is not None:
                self.stream_offsets[index] = start + sum(len(t) for t in choice["logprobs"]["tokens"])
        choice["finish_reason"] = finish_reason(finish) if finish is not None else None
        if finish is not None:
            choice["stop_reason"] = stop_reason(finish)
        return sse(self._chunk_envelope([choice]))

    def echo_chunk(self, index: int, prompt_logprobs: Sequence[TokenLogprob | None] | None = None) -> str:
        """The completion chunk that repeats choice `index`'s prompt, with the prompt's logprobs when given (a stream
        that echoes with logprobs sends it at the choice's first token, which brings them). The choice's tokens
        still count their text offsets from the end of the echo, as in the full response."""
        logprobs = None
        if prompt_logprobs is not None:
            logprobs = self.prompt_logprobs(self.echo_ids[index // self.samples], prompt_logprobs)
        return sse(self._chunk_envelope([{"index": index, "text": self.echo(index), "logprobs": logprobs, "finish_reason": None}]))

    def usage_chunk(self, responses: Sequence[GenerationResponse]) -> str:
        body = self._chunk_envelope([])
        body["usage"] = self.usage(responses)
        return sse(body)

    def _chunk_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    # --------------------------------------------------------------------------------------- logprobs

    def _top(self, lp: TokenLogprob) -> list[tuple[str, float]]:
        return [(self.token_text(t), v) for t, v in lp.top]

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        # bytes, not the text: a token holding part of a UTF-8 character reads as U+FFFD alone
        return {"token": self.token_text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        content = [
            self._chat_entry(lp.token_id, lp.logprob) | {"top_logprobs": [self._chat_entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}

    def completion_logprobs(self, logprobs: Sequence[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        return self._legacy_logprobs(((lp.token_id, lp) for lp in logprobs), offset)

    def prompt_logprobs(self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """An echoed prompt's completions logprobs, as OpenAI and vLLM: its first token with no logprob (null)."""
        return self._legacy_logprobs(zip(prompt_ids, logprobs), offset=0)

    def _legacy_logprobs(self, entries: Iterable[tuple[int, TokenLogprob | None]], offset: int) -> dict[str, Any]:
        """The completions shape of (token id, logprob) entries whose text starts at `offset`; an entry without a
        logprob (an echoed prompt's first token) has null for its logprob and alternatives."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, lp in entries:
            tok = self.token_text(token_id)
            offsets.append(offset)
            offset += len(tok)
            tokens.append(tok)
            token_logprobs.append(None if lp is None else lp.logprob)
            top.append(None if lp is None else dict(self._top(lp)) or None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def sse(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
