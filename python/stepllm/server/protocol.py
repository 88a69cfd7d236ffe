"""Request schemas for the OpenAI endpoints, validated strictly (a wrong type or an unknown field is a 400),
and their translation into the core's SamplingParams / GenerationRequest.

Beyond OpenAI's fields, vLLM's common extensions are honoured: top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, skip_special_tokens, min_tokens, include_stop_str_in_output, add_special_tokens (completions) and
request_id. A request becomes one core
request per choice: `n` per prompt, and /v1/completions takes a batch of prompts.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .._core import GenerationRequest, InvalidRequestError, SamplingParams
from .errors import APIError, bad_request, from_validation

MAX_TOP_LOGPROBS = 20
TokenIds = list[int]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    include_stop_str_in_output: bool | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # Accepted and ignored, as they change nothing about generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token when the response scores the prompt (completions' echo with logprobs)."""
        return None

    @property
    def samples(self) -> int:
        """Choices per prompt (`n`)."""
        return self.n or 1

    def prompt_count(self) -> int:
        return 1

    def choice_count(self) -> int:
        """Core requests this request becomes: `n` per prompt."""
        return self.prompt_count() * self.samples

    def sampling_params(self, max_tokens: int | None, sample: int = 0) -> SamplingParams:
        """The core's SamplingParams for the prompt's `sample`-th choice; its own validation errors become 400s.
        With a seed, choice j draws with seed + j, so the choices differ and the whole answer repeats."""
        top_k = self.top_k
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_k=0 if top_k == -1 else top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                seed=None if self.seed is None else (self.seed + sample) % 2**64,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                logprobs=self.requested_logprobs(),
                prompt_logprobs=self.requested_prompt_logprobs(),
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                min_tokens=self.min_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except (InvalidRequestError, ValueError, OverflowError, TypeError) as e:
            raise bad_request(str(e), code="invalid_value") from e


Prompt = Union[str, TokenIds, list[str], list[TokenIds]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = True

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of = 1 is supported")
        return self

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | TokenIds]:
        """The prompts in order: one string or token list, or a batch of either."""
        p = self.prompt
        batch: list[Any] = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        for one in batch:
            if isinstance(one, list) and not one:
                raise bad_request("prompt is empty: give at least one character or token", param="prompt")
        return batch

    def prompt_count(self) -> int:
        return len(self.prompts())

    def echo_texts(self, decode: Callable[[list[int]], str]) -> list[str]:
        """Each prompt's text when the completions echo their prompts (token ids through `decode`), else none."""
        if not self.echo:
            return []
        return [p if isinstance(p, str) else decode(p) for p in self.prompts()]

    def streamed_echo_ids(self, tokenize: Callable[[GenerationRequest], list[int]]) -> list[list[int]]:
        """Each prompt's token ids when a stream echoes its prompts with their logprobs, else none: the echo chunk
        lists every prompt token, and the prompt logprobs a stream gets have nothing for the first one. The
        choices then run these ids (`generation_requests`), so a text prompt is tokenized once."""
        if not (self.stream and self.echo and self.logprobs is not None):
            return []
        add_special_tokens = bool(self.add_special_tokens)
        return [p if isinstance(p, list) else tokenize(GenerationRequest(p, add_special_tokens=add_special_tokens)) for p in self.prompts()]

    def generation_requests(self, max_tokens: int | None, prompt_ids: list[list[int]] | None = None) -> list[GenerationRequest]:
        """One request per choice: each prompt's `n` samples, prompt by prompt (choice i is prompt i // n); the
        prompts as `prompt_ids` when they are already tokenized."""
        add_special_tokens = bool(self.add_special_tokens)
        prompts: list[Any] = prompt_ids if prompt_ids else self.prompts()
        return [
            GenerationRequest(prompt, self.sampling_params(max_tokens, sample), add_special_tokens=add_special_tokens)
            for prompt in prompts
            for sample in range(self.samples)
        ]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # Fields of an assistant message as this server (and OpenAI) returns it, so that a client can send a reply
    # back in the next turn; only their empty values are accepted, since this server makes no tool calls.
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _no_tool_calls(self) -> ChatMessage:
        if self.tool_calls or self.function_call or self.audio:
            raise ValueError("messages with tool calls, function calls or audio are not supported")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs = true")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return conversation_of(self.messages)

    def generation_requests(self, max_tokens: int | None, prompt_ids: list[int] | None = None) -> list[GenerationRequest]:
        """One request per choice: the conversation's `n` samples (as `prompt_ids` when it is already tokenized)."""
        prompt: Any = self.conversation() if prompt_ids is None else prompt_ids
        return [GenerationRequest(prompt, self.sampling_params(max_tokens, sample)) for sample in range(self.samples)]


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, str]]:
    # Chat templates know system/user/assistant; OpenAI's newer "developer" role is a system message.
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.add_generation_prompt is False:
            raise ValueError("add_generation_prompt false is not supported: chat prompts end with the assistant's turn")
        return self

    def generation_request(self) -> GenerationRequest:
        if self.messages is not None:
            return GenerationRequest(conversation_of(self.messages))
        return GenerationRequest(self.prompt, add_special_tokens=self.add_special_tokens is not False)


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to text (special tokens included)."""

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def parse(model: type[_Strict], body: bytes) -> Any:
    """Validate a raw JSON body; every failure is a 400 with an OpenAI error body."""
    if not body.strip():
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first: dict[str, Any] = dict(e.errors(include_url=False)[0]) if e.error_count() else {}
        if first.get("type") == "json_invalid":
            raise bad_request(f"The request body is not valid JSON: {first.get('msg', '')}", code="invalid_json") from None
        if first.get("type") == "model_type" and not first.get("loc"):
            raise bad_request("The request body must be a JSON object.", code="invalid_json") from None
        raise from_validation(e) from None


__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "StreamOptions", "TokenizeRequest", "parse"]
