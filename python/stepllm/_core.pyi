"""Typed stubs for stepllm._core, the PyO3 bindings over the Rust core (stepllm-core)."""

import os
from typing import AsyncIterator, Callable, ClassVar, Iterator, Literal, Mapping, Sequence, TypedDict, final

__version__: str

# ----------------------------------------------------------------------------------------------- exceptions

class StepllmError(Exception):
    """Base class of every stepllm error (also: internal errors, panics caught at the boundary)."""

class InvalidRequestError(StepllmError, ValueError):
    """The request can never be served as given (bad prompt, bad sampling value, too long, ...)."""

class ProtocolError(StepllmError, RuntimeError):
    """An operation arrived in the wrong order or in the wrong state."""

class StaleRefError(ProtocolError):
    """A ResidentRef whose slot was released (its epoch moved on) or never existed."""

class ModelLoadError(StepllmError):
    """Model files missing, corrupt or of an unsupported kind."""

class DeviceError(StepllmError):
    """The compute device failed or is unavailable."""

# ----------------------------------------------------------------------------------------------- identities

@final
class ResidentRef:
    """Stable identity of a live sequence's resident state; releasing the slot bumps the epoch."""
    def __new__(cls, slot: int, epoch: int) -> ResidentRef: ...
    @property
    def slot(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __lt__(self, other: ResidentRef, /) -> bool: ...
    def __le__(self, other: ResidentRef, /) -> bool: ...
    def __gt__(self, other: ResidentRef, /) -> bool: ...
    def __ge__(self, other: ResidentRef, /) -> bool: ...

@final
class SequenceIdentity:
    def __new__(cls, request_id: int, original_index: int, resident: ResidentRef) -> SequenceIdentity: ...
    @property
    def request_id(self) -> int: ...
    @property
    def original_index(self) -> int: ...
    @property
    def resident(self) -> ResidentRef: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

# ----------------------------------------------------------------------------------------------- enums

@final
class SequenceWork:
    CONTEXT: ClassVar[SequenceWork]
    DECODE: ClassVar[SequenceWork]
    MIXED: ClassVar[SequenceWork]
    """A step's work only: some residents decoded and a seated group prefilled in one forward."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class AdmissionStatus:
    ADMITTED: ClassVar[AdmissionStatus]
    NO_CAPACITY: ClassVar[AdmissionStatus]
    REJECTED: ClassVar[AdmissionStatus]
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class FinishReason:
    EOS: ClassVar[FinishReason]
    LENGTH: ClassVar[FinishReason]
    STOP: ClassVar[FinishReason]
    CANCELLED: ClassVar[FinishReason]
    ERROR: ClassVar[FinishReason]
    @property
    def value(self) -> Literal["eos", "length", "stop", "cancelled", "error"]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

# ----------------------------------------------------------------------------------------------- step records

@final
class ScheduledSequenceDescriptor:
    @property
    def identity(self) -> SequenceIdentity: ...
    @property
    def work(self) -> SequenceWork: ...
    @property
    def query_length(self) -> int: ...
    @property
    def past_length(self) -> int: ...
    @property
    def select_last_token_logits(self) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class TokenDelta:
    """A surviving resident's tokens committed by one step, the text they completed (held-back stop-string
    prefixes excluded), and their logprobs when the request asked for them."""
    def __new__(
        cls,
        token_ids: Sequence[int],
        text: str,
        logprobs: Sequence[TokenLogprob] | None = None,
        prompt_logprobs: Sequence[TokenLogprob | None] | None = None,
    ) -> TokenDelta: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...
    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The whole prompt's logprobs (None for its first token) on a request's first delta when it asked for
        prompt_logprobs, else None: a stream can send an echoed prompt's logprobs before the completion's tokens."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class StepExecution:
    @property
    def rows(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def elapsed_us(self) -> int:
        """Wall time of the whole step inside the runtime, in microseconds."""
    @property
    def device_wait_us(self) -> int:
        """Part of ``elapsed_us`` spent blocked waiting for the device (0 on the CPU).

        The step's host time is ``elapsed_us - device_wait_us``.
        """
    @property
    def cuda_graph(self) -> bool:
        """Whether the step's forward was replayed from a captured CUDA graph."""
    @property
    def metadata_on_device(self) -> bool:
        """Whether that replay continued the one before it on the device (the same rows, one token on), so the
        host skipped packing and copying the step's batch metadata."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class TokenLogprob:
    def __new__(cls, token_id: int, logprob: float, top: Sequence[tuple[int, float]] = ...) -> TokenLogprob: ...
    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> list[tuple[int, float]]:
        """The top alternatives at this position, most likely first: (token_id, logprob)."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class BatchResult:
    """The snapshot of a sequence that reached a terminal state; what `materialize` needs."""
    @property
    def identity(self) -> SequenceIdentity: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> FinishReason: ...
    @property
    def stop_reason(self) -> str | None: ...
    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...
    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None: ...
    @property
    def cached_prompt_tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class StepResult:
    """The single commit unit: everything in it happened together, nothing outside it happened."""
    @property
    def ok(self) -> bool: ...
    @property
    def work(self) -> SequenceWork: ...
    @property
    def step_id(self) -> int: ...
    @property
    def participants(self) -> list[ScheduledSequenceDescriptor]:
        """The work this step computed, one descriptor per sequence: a decode token, or a prompt chunk
        (query_length tokens after past_length). A cancelled sequence ends in `finished` without being scheduled."""
    @property
    def execution(self) -> StepExecution: ...
    @property
    def deltas(self) -> list[tuple[ResidentRef, TokenDelta]]: ...
    @property
    def finished(self) -> list[tuple[ResidentRef, BatchResult]]: ...
    @property
    def published_prefix(self) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ImmutablePrefillBatch:
    def __new__(cls, target: ResidentRef) -> ImmutablePrefillBatch: ...
    @property
    def target(self) -> ResidentRef: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ImmutablePrefillGroup:
    """The whole seated group of SteppedRequest.admit_into_group, in admission order (beyond the seed)."""
    def __new__(cls, targets: Sequence[ResidentRef]) -> ImmutablePrefillGroup: ...
    @property
    def targets(self) -> list[ResidentRef]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ImmutableDecodeBatch:
    def __new__(cls, residents: Sequence[ResidentRef]) -> ImmutableDecodeBatch: ...
    @property
    def residents(self) -> list[ResidentRef]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ImmutableMixedBatch:
    """A decode step of `residents` and the prefill of the seated group `targets` (in admission order), in one
    forward (beyond the seed): running sequences keep generating while new ones join."""
    def __new__(cls, residents: Sequence[ResidentRef], targets: Sequence[ResidentRef]) -> ImmutableMixedBatch: ...
    @property
    def residents(self) -> list[ResidentRef]: ...
    @property
    def targets(self) -> list[ResidentRef]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

# ----------------------------------------------------------------------------------------------- requests

# The TypedDicts below exist for type checkers only; at run time these are plain dicts.

class Message(TypedDict):
    role: str
    content: str

PromptInput = str | Sequence[int] | Sequence[Mapping[str, str]]

@final
class SamplingParams:
    """Per-request sampling, validated on construction (InvalidRequestError). Every argument is keyword-only;
    None (or leaving it out) takes the core's default, shown in brackets:

    max_tokens [16], temperature [1.0; 0 = greedy], top_k [0 = off], top_p [1.0], min_p [0.0], seed [None: a fresh
    random seed per request], repetition_penalty [1.0], presence_penalty [0.0], frequency_penalty [0.0],
    logit_bias [none; token id -> bias in [-100, 100]], logprobs [None = none; up to 20 alternatives],
    stop [none; a str or a list of str], stop_token_ids [none], ignore_eos [False], skip_special_tokens [True],
    min_tokens [0; at most max_tokens], include_stop_str_in_output [False], prompt_logprobs [None = none; up to 20
    alternatives: each prompt token's logprob given what precedes it, in GenerationResponse.prompt_logprobs; such a
    request computes its whole prompt, without the context cache's hits].
    The token that ends a request (an EOS, or one of stop_token_ids) stays in output_ids but adds no text. As in
    vLLM, until min_tokens tokens are generated EOS and stop_token_ids cannot be sampled and a stop string that
    ends inside their text does not stop the request; include_stop_str_in_output keeps the stop string that ended
    the request at the end of its text.
    """
    def __new__(
        cls,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool | None = None,
        skip_special_tokens: bool | None = None,
        min_tokens: int | None = None,
        include_stop_str_in_output: bool | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> dict[int, float] | None: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def stop(self) -> list[str]: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def skip_special_tokens(self) -> bool: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def include_stop_str_in_output(self) -> bool: ...
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def is_greedy(self) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class GenerationRequest:
    """prompt: raw text, token ids, or a conversation of {"role", "content"} messages (chat template).
    lora_name is kept for Edge-LLM's API; no adapter can be loaded, so a request that names one is refused."""
    def __new__(
        cls,
        prompt: PromptInput,
        sampling: SamplingParams | None = None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> GenerationRequest: ...
    @property
    def prompt(self) -> str | list[int] | list[Message]: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def add_special_tokens(self) -> bool: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def lora_name(self) -> str | None: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class GenerationResponse:
    def __new__(
        cls,
        request_id: int,
        original_index: int,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        output_text: str,
        finish_reason: FinishReason,
        stop_reason: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        cached_prompt_tokens: int = 0,
        error: str | None = None,
        prompt_logprobs: Sequence[TokenLogprob | None] | None = None,
    ) -> GenerationResponse: ...
    @property
    def request_id(self) -> int: ...
    @property
    def original_index(self) -> int: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def output_text(self) -> str: ...
    @property
    def finish_reason(self) -> FinishReason: ...
    @property
    def stop_reason(self) -> str | None: ...
    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...
    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (vLLM's layout)."""
    @property
    def cached_prompt_tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class AdmissionIntent:
    """A validated, tokenized request; made only by SteppedRequest.build_intent."""
    @property
    def request_id(self) -> int: ...
    @property
    def original_index(self) -> int: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def request(self) -> GenerationRequest: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class AdmissionResult:
    @property
    def status(self) -> AdmissionStatus: ...
    @property
    def ref(self) -> ResidentRef | None:
        """The seated resident when ADMITTED, else None."""
    @property
    def resident(self) -> ResidentRef | None:
        """Alias of `ref`."""
    @property
    def reason(self) -> str | None: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

# ----------------------------------------------------------------------------------------------- configuration

@final
class ContextCacheConfig:
    """None takes the default: enabled [True], lookup ["use"], commit ["prefill"], max_records [0 = as many as the
    KV pool holds]."""
    def __new__(
        cls,
        enabled: bool | None = None,
        lookup: Literal["use", "bypass"] | None = None,
        commit: Literal["prefill", "generated"] | None = None,
        max_records: int | None = None,
    ) -> ContextCacheConfig: ...
    @property
    def enabled(self) -> bool: ...
    @property
    def lookup(self) -> Literal["use", "bypass"]: ...
    @property
    def commit(self) -> Literal["prefill", "generated"]: ...
    @property
    def max_records(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ParallelConfig:
    """None takes the default: tensor_parallel_size [1], devices [none]. `devices` lists each rank's CUDA device
    (one per rank; ranks may share one, then all-reducing through host memory); none listed, the ranks take
    consecutive GPUs from the Config's device. The CPU ignores it."""
    def __new__(cls, tensor_parallel_size: int | None = None, devices: Sequence[int] | None = None) -> ParallelConfig: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def devices(self) -> list[int]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Config:
    """Runtime configuration, validated on construction (InvalidRequestError). None takes the default: device
    ["auto": the GPU when there is one and its kernels cover the model's attention shape, else the CPU],
    max_batch_size [the device's: 8 on the CPU, 256 on a GPU], kv_cache_tokens [the device's: 16384 on the CPU; on
    a GPU the whole blocks that fit in gpu_memory_utilization (0.9) of its memory beside the weights, one step's
    activations (max_prefill_tokens prompt tokens, logits of every slot) and 512 MiB of workspace, at most every
    slot at max_model_len, as vLLM sizes its cache; RuntimeCoordinator.info() reports the sizes in use],
    block_size [16], max_model_len [the model's
    max_position_embeddings; a longer one is refused when the runtime is built, unless
    STEPLLM_ALLOW_LONG_MAX_MODEL_LEN=1], context_cache [ContextCacheConfig()], parallel [ParallelConfig()], dtype [the device's: "f32" on the CPU,
    "bf16" on CUDA], max_prefill_tokens [8192: the most prompt tokens one step computes; the engine and
    dispatch_request prefill prompts together up to it, and a longer prompt is computed in chunks of it over
    several steps (chunked prefill) while running requests keep decoding in the same forwards]. dtype is how weight matrices are kept: "f32" (exact), "bf16" (half the memory traffic)
    or "int8" (per-row scales, a quarter; CPU only), all computed in f32 on the CPU; or "a8" (CPU only): a GGUF's
    integer levels as the file stores them (a float checkpoint's rounded to 8 bits per 32 weights, as Q8_0)
    times activations rounded to 8 bits per 32 values, in integer dot products (llama.cpp's arithmetic; AVX-512
    VNNI or AVX2 kernels). kv_cache_dtype ["auto":
    bf16 on CUDA, f32 on the CPU] is how the KV cache stores K and V: "fp8" (e4m3, unscaled, CUDA only) halves its
    memory and the bytes every decode step reads, at 3 mantissa bits of precision. model None means
    the default model (stepllm.models.default_model_path(), resolved when a runtime is built from this config)."""
    def __new__(
        cls,
        model: str | os.PathLike[str] | None = None,
        device: str | None = None,
        max_batch_size: int | None = None,
        kv_cache_tokens: int | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        context_cache: ContextCacheConfig | None = None,
        parallel: ParallelConfig | None = None,
        dtype: Literal["f32", "bf16", "int8", "a8", "auto"] | None = None,
        max_prefill_tokens: int | None = None,
        kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] | None = None,
        gpu_memory_utilization: float | None = None,
    ) -> Config: ...
    @property
    def model(self) -> str | None: ...
    @property
    def device(self) -> str: ...
    @property
    def max_batch_size(self) -> int | None: ...
    @property
    def max_prefill_tokens(self) -> int: ...
    @property
    def kv_cache_tokens(self) -> int | None: ...
    @property
    def gpu_memory_utilization(self) -> float: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def context_cache(self) -> ContextCacheConfig: ...
    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def dtype(self) -> Literal["f32", "bf16", "int8", "a8"] | None: ...
    @property
    def kv_cache_dtype(self) -> Literal["auto", "fp8"]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

class PoolCounts(TypedDict):
    slot_capacity: int
    free_slots: int
    live_slots: int
    total_blocks: int
    free_blocks: int
    leased_blocks: int
    cached_blocks: int
    pinned_blocks: int

class ModelInfo(TypedDict):
    source: str
    architecture: str
    rope: str
    """RoPE's scaling: "default", "linear", "llama3" or "per-frequency factors (rope_freqs.weight)" (a GGUF's)."""
    parameters: int
    weight_bytes: int
    """Bytes the weights take where they are kept (host memory on the CPU, device memory on a GPU)."""
    device: str
    vocab_size: int
    max_model_len: int
    kv_cache_tokens: int
    block_size: int
    max_batch_size: int
    max_prefill_tokens: int
    kv_cache_dtype: Literal["auto", "fp8"]
    eos_token_ids: list[int]

class EngineStats(TypedDict):
    waiting: int
    running: int
    counts: PoolCounts
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    finished: dict[str, int]
    steps: int

# ----------------------------------------------------------------------------------------------- runtime

@final
class RuntimeCoordinator:
    """Loads a model and owns its stepper. One stepped session or batch runs at a time."""
    def __new__(cls, config: Config | None = None, progress: Callable[[int, int], object] | None = None) -> RuntimeCoordinator:
        """`progress(done, total)` is called as the weights load."""
    def begin_stepped(self, request: GenerationRequest, request_id: int = 1, original_index: int = 0) -> SteppedRequest:
        """Admit the founder and run its prefill now; the first prefill tick reports its first token."""
    def dispatch_request(self, requests: Sequence[GenerationRequest]) -> list[GenerationResponse]:
        """Run a whole batch to completion; responses in request order. Invalid requests raise before anything
        runs; a request that can never run (too big for the KV cache, or for what pinned system prompts leave of
        it) comes back with FinishReason.ERROR, the others are answered."""
    def count_prompt_tokens(self, request: GenerationRequest) -> int: ...
    def capture_decoding_cuda_graph(self) -> bool: ...
    def gen_and_save_system_prompt_kv_cache(self, prompt: PromptInput) -> int:
        """Prefill a system prompt and pin its full KV blocks for good; returns the tokens pinned (fewer when
        the context cache's max_records refuses some). InvalidRequestError when it could never serve a request:
        as long as max_model_len, pinning every free block, or the context cache disabled."""
    def supports_stepped_execution(self) -> bool: ...
    def supports_boundary_scheduling(self) -> bool: ...
    def world_size(self) -> int: ...
    def owns_global_rank(self, rank: int) -> bool: ...
    def local_ranks_succeeded(self) -> bool: ...
    def take_rank_response(self, rank: int) -> StepResult | None: ...
    def rank_counts(self) -> list[PoolCounts]: ...
    def _inject_rank_fault(self, rank: int, panic: bool = False) -> None: ...
    def counts(self) -> PoolCounts: ...
    def info(self) -> ModelInfo: ...

@final
class SteppedRequest:
    """A stepped session: one operation per tick, each committed as a StepResult. Thread-safe."""
    def build_intent(self, request: GenerationRequest, original_index: int, request_id: int) -> AdmissionIntent: ...
    def admit_intent(self, intent: AdmissionIntent) -> AdmissionResult: ...
    def admit(self, request: GenerationRequest, original_index: int, request_id: int) -> AdmissionResult:
        """build_intent then admit_intent; an ADMITTED ref's prefill must be the next operation."""
    def prefill(self, batch: ImmutablePrefillBatch) -> StepResult:
        """Compute the seated target's prompt and sample its first token. A prompt longer than
        Config.max_prefill_tokens takes one chunk per call: the target stays seated (seated()) and the step's
        participant has select_last_token_logits False until the chunk that samples the first token."""
    def admit_intent_into_group(self, intent: AdmissionIntent) -> AdmissionResult: ...
    def admit_into_group(self, request: GenerationRequest, original_index: int, request_id: int) -> AdmissionResult:
        """Beyond the seed: like admit, but earlier admissions may still be waiting for their prefill; one
        prefill_group tick then computes every seated request in one forward (batched prefill)."""
    def prefill_group(self, group: ImmutablePrefillGroup) -> StepResult:
        """Prefill the whole seated group; `group.targets` must list it exactly, in admission order. At most
        Config.max_prefill_tokens prompt tokens are computed, in admission order; the rest stays seated."""
    def decode(self, batch: ImmutableDecodeBatch) -> StepResult: ...
    def mixed(self, batch: ImmutableMixedBatch) -> StepResult:
        """Decode batch.residents and prefill the seated group batch.targets in one forward (beyond the seed)."""
    def residents(self) -> list[ResidentRef]: ...
    def seated(self) -> list[ResidentRef]:
        """The seated sequences, in admission order, that the next prefill, prefill_group or mixed must name
        (beyond the seed; after a chunk of a longer prompt, those not yet at their prompt's end)."""
    def materialize(self, result: BatchResult, stop_strings: Sequence[str] = ...) -> GenerationResponse: ...
    def finish(self) -> GenerationResponse:
        """Once, when nothing is resident: the founder's response. Closes the session."""
    def abort(self) -> None:
        """Release everything; idempotent. Closes the session."""
    def cancel(self, ref: ResidentRef) -> None: ...
    def founder(self) -> ResidentRef: ...
    @property
    def closed(self) -> bool: ...
    def counts(self) -> PoolCounts: ...
    def __enter__(self) -> SteppedRequest: ...
    def __exit__(self, exc_type: object, exc: object, tb: object, /) -> bool: ...

@final
class StreamChunk:
    """The tokens one step gave a request, the text they completed, and their logprobs when it asked for them."""
    def __new__(
        cls,
        token_ids: Sequence[int],
        text: str,
        logprobs: Sequence[TokenLogprob] | None = None,
        prompt_logprobs: Sequence[TokenLogprob | None] | None = None,
    ) -> StreamChunk: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...
    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The whole prompt's logprobs (None for its first token) on a request's first chunk when it asked for
        prompt_logprobs, else None: a stream can send an echoed prompt's logprobs before the completion's tokens."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class RequestStream:
    """One request's chunks (sync or async iteration), then its response in `response`."""
    @property
    def request_id(self) -> int: ...
    @property
    def response(self) -> GenerationResponse | None: ...
    @property
    def finished(self) -> bool: ...
    def cancel(self) -> None: ...
    def wait(self) -> GenerationResponse:
        """Drain the rest of the stream and return the final response."""
    def __iter__(self) -> Iterator[StreamChunk]: ...
    def __next__(self) -> StreamChunk: ...
    def __aiter__(self) -> AsyncIterator[StreamChunk]: ...
    def _poll(self, timeout: float) -> tuple[bool, StreamChunk | None]: ...

@final
class Engine:
    """The request engine: an actor thread over its own RuntimeCoordinator. See stepllm.Engine."""
    def __new__(cls, config: Config | None = None, progress: Callable[[int, int], object] | None = None) -> Engine:
        """`progress(done, total)` is called as the weights load."""
    def submit(self, request: GenerationRequest) -> RequestStream: ...
    def count_prompt_tokens(self, request: GenerationRequest) -> int: ...
    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The token ids of the request's prompt as the model sees it (chat template applied)."""
    def decode_token(self, token_id: int) -> str:
        """The text of one token id, special tokens included."""
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids, special tokens included unless skipped."""
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token id: part of a UTF-8 character for a token whose text alone is U+FFFD."""
    def cancel(self, request_id: int) -> None: ...
    def stats(self) -> EngineStats: ...
    def info(self) -> ModelInfo: ...
    def counts(self) -> PoolCounts: ...
    def shutdown(self) -> None: ...
    @property
    def is_shut_down(self) -> bool: ...
    def __enter__(self) -> Engine: ...
    def __exit__(self, exc_type: object, exc: object, tb: object, /) -> bool: ...


__all__ = [
    "__version__",
    "StepllmError",
    "InvalidRequestError",
    "ProtocolError",
    "StaleRefError",
    "ModelLoadError",
    "DeviceError",
    "ResidentRef",
    "SequenceIdentity",
    "SequenceWork",
    "ScheduledSequenceDescriptor",
    "TokenDelta",
    "StepExecution",
    "BatchResult",
    "StepResult",
    "AdmissionIntent",
    "AdmissionStatus",
    "AdmissionResult",
    "ImmutablePrefillBatch",
    "ImmutablePrefillGroup",
    "ImmutableDecodeBatch",
    "ImmutableMixedBatch",
    "FinishReason",
    "TokenLogprob",
    "SamplingParams",
    "GenerationRequest",
    "GenerationResponse",
    "ContextCacheConfig",
    "ParallelConfig",
    "Config",
    "RuntimeCoordinator",
    "SteppedRequest",
    "Engine",
    "StreamChunk",
    "RequestStream",
]
