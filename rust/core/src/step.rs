//! The typed operations of a tick and the immutable records they commit.

use compact_str::CompactString;
use smallvec::SmallVec;

use crate::ids::{RequestId, ResidentRef, SequenceIdentity, StepId};
use crate::request::{FinishReason, GenerationRequest, GenerationResponse, TokenLogprob};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SequenceWork {
    /// Prompt tokens computed into the KV cache (prefill).
    Context,
    /// One generated token per sequence.
    Decode,
    /// A step's work only (never a sequence's): some sequences decoded and a seated group prefilled in the same
    /// forward; each participant's descriptor says which it did.
    Mixed,
}

/// One participant of a step as it was scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScheduledSequenceDescriptor {
    pub identity: SequenceIdentity,
    pub work: SequenceWork,
    /// Tokens computed for this sequence in this step.
    pub query_length: usize,
    /// Tokens already in the KV cache before this step (cache hits included).
    pub past_length: usize,
    pub select_last_token_logits: bool,
}

/// Tokens past a surviving resident's watermark, committed by one step. The ids and the text keep short contents
/// inline (up to 4 ids, up to 24 bytes of text), so a decode tick builds every row's delta without allocating
/// unless the request asked for logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenDelta {
    pub token_ids: SmallVec<[u32; 4]>,
    /// Text these tokens completed, safe to show: held-back stop-string prefixes are not in it yet.
    pub text: CompactString,
    /// One per token when the request asked for logprobs, so a stream can carry them with its tokens.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The request's whole prompt logprobs (one per prompt token, None for the first), on the first delta of a
    /// request that asked for prompt_logprobs; None on every other delta. They are complete by then (the step
    /// that samples the first token computes the prompt's last chunk), so a stream can send an echoed prompt's
    /// logprobs before the completion's tokens instead of waiting for the finished response.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
}

/// The snapshot of a sequence that reached a terminal state; everything `materialize` needs.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchResult {
    pub identity: SequenceIdentity,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    /// Detokenized output, cut before a stop string that ended it.
    pub text: String,
    pub finish_reason: FinishReason,
    pub stop_reason: Option<String>,
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// With `prompt_logprobs`: one entry per prompt token, None for the first.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub cached_prompt_tokens: usize,
    pub error: Option<String>,
}

/// How a step was executed; informational.
///
/// The host time of a step (scheduling, batch planning, sampling bookkeeping, detokenization, stop matching,
/// launching work) is `elapsed_us - device_wait_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StepExecution {
    /// Sequences computed in this step.
    pub rows: usize,
    /// Tokens computed in this step (prompt tokens in prefill, one per row in decode).
    pub tokens: usize,
    /// Wall time of the whole step inside the stepper, in microseconds.
    pub elapsed_us: u64,
    /// Part of `elapsed_us` the step's forward spent blocked waiting for the device (0 on the CPU, and
    /// when no forward ran); never more than `elapsed_us`.
    pub device_wait_us: u64,
    /// Whether the step's forward was replayed from a captured CUDA graph.
    pub cuda_graph: bool,
    /// Whether that replay continued the one before it on the device (the same rows, one token on), so the host
    /// skipped packing and copying the step's batch metadata.
    pub metadata_on_device: bool,
}

/// The single commit unit: everything in it happened together, nothing outside it happened.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    pub ok: bool,
    pub work: SequenceWork,
    pub step_id: StepId,
    /// The work this step computed: a decode token, or a prompt chunk, per sequence. A cancelled sequence ends in
    /// `finished` without being scheduled.
    pub participants: Vec<ScheduledSequenceDescriptor>,
    pub execution: StepExecution,
    pub deltas: Vec<(ResidentRef, TokenDelta)>,
    pub finished: Vec<(ResidentRef, BatchResult)>,
    pub published_prefix: bool,
}

/// A validated, tokenized request ready for reservation. Building it touches no resident state.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionIntent {
    pub request_id: RequestId,
    pub original_index: u32,
    pub request: GenerationRequest,
    pub prompt_ids: Vec<u32>,
}

impl AdmissionIntent {
    /// The response of a request that ends before it ever runs (rejected, or cancelled while waiting).
    pub fn unstarted_response(&self, reason: FinishReason, error: Option<String>) -> GenerationResponse {
        GenerationResponse {
            request_id: self.request_id,
            original_index: self.original_index,
            prompt_ids: self.prompt_ids.clone(),
            output_ids: Vec::new(),
            output_text: String::new(),
            finish_reason: reason,
            stop_reason: None,
            logprobs: None,
            prompt_logprobs: None,
            cached_prompt_tokens: 0,
            error,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdmissionStatus {
    Admitted,
    NoCapacity,
    Rejected,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AdmissionResult {
    pub status: AdmissionStatus,
    pub resident: Option<ResidentRef>,
    pub reason: Option<String>,
}

impl AdmissionResult {
    pub fn admitted(r: ResidentRef) -> Self {
        Self { status: AdmissionStatus::Admitted, resident: Some(r), reason: None }
    }
    pub fn no_capacity(why: impl Into<String>) -> Self {
        Self { status: AdmissionStatus::NoCapacity, resident: None, reason: Some(why.into()) }
    }
    pub fn rejected(why: impl Into<String>) -> Self {
        Self { status: AdmissionStatus::Rejected, resident: None, reason: Some(why.into()) }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImmutablePrefillBatch {
    pub target: ResidentRef,
}

/// Every request seated by [`crate::stepper::RuntimeStepper::admit_into_group`], in admission order: one prefill
/// tick computes all their prompts (beyond the seed, whose prefill names a single target).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImmutablePrefillGroup {
    pub targets: Vec<ResidentRef>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImmutableDecodeBatch {
    pub residents: Vec<ResidentRef>,
}

/// A decode step and the seated group's prefill in one forward (beyond the seed, whose ticks do one or the
/// other): each listed resident gets one generated token while the group's prompts are computed, so running
/// sequences keep generating while new ones join (vLLM's mixed batches).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImmutableMixedBatch {
    pub residents: Vec<ResidentRef>,
    pub targets: Vec<ResidentRef>,
}
