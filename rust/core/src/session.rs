//! GenerationSession: the live sequences, keyed by resident slot, with their watermarks and finish states.

use compact_str::CompactString;
use smallvec::SmallVec;

use crate::ids::{ResidentRef, SequenceIdentity};
use crate::request::{FinishReason, SamplingParams, TokenLogprob};
use crate::state::budget::Lease;
use crate::step::{BatchResult, TokenDelta};
use crate::text::stop::TextStream;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Reserved and seated; its prefill must be the stepper's next operation. A prompt longer than a step's
    /// budget (`StepperConfig::max_prefill_tokens`) stays seated over several prefill steps, one chunk each.
    Seated,
    /// Prefilled; takes part in decode steps.
    Running,
}

/// How a sequence ended, before it is reported.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub reason: FinishReason,
    pub stop_reason: Option<String>,
    pub error: Option<String>,
}

pub struct SequenceRow {
    pub identity: SequenceIdentity,
    pub sampling: SamplingParams,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub lease: Lease,
    pub extra_key: u64,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    /// Seated rows: where the prompt chunk of the current prefill step ends (`schedule_prompt_chunks`); the
    /// chunk that reaches the prompt's end samples the first token.
    pub prefill_end: usize,
    pub cached_prompt_tokens: usize,
    /// Output tokens already reported in deltas.
    pub watermark: usize,
    pub unreported_text: String,
    pub phase: Phase,
    pub seed: u64,
    pub stream: TextStream,
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// With `prompt_logprobs`: the prompt tokens' logprobs computed so far (None for the first token).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    /// The ids that end the sequence (EOS unless ignored, stop_token_ids), kept only while `min_tokens` bans
    /// them; empty otherwise.
    pub ending_ids: Vec<u32>,
    /// Cancel and error latch first: the next step reports the sequence finished without computing it.
    pub latched: Option<Ending>,
    pub ending: Option<Ending>,
}

impl SequenceRow {
    pub fn resident(&self) -> ResidentRef {
        self.identity.resident
    }

    /// Absolute position of the next token to compute.
    pub fn next_position(&self) -> usize {
        self.computed
    }

    pub fn total_len(&self) -> usize {
        self.prompt_ids.len() + self.output_ids.len()
    }

    /// Ids the next token may not be: those that would end the sequence before its `min_tokens`.
    pub fn banned_ids(&self) -> &[u32] {
        if self.output_ids.len() < self.sampling.min_tokens {
            &self.ending_ids
        } else {
            &[]
        }
    }

    /// The prompt positions whose logits this step scores for prompt logprobs: each of a seated row's chunk
    /// positions followed by a prompt token (position p gives the logprob of token p + 1); none once running.
    pub fn scored_positions(&self) -> std::ops::Range<usize> {
        self.computed..self.prefill_end.min(self.prompt_ids.len().saturating_sub(1)).max(self.computed)
    }

    /// Take this step's scores of the row's `scored_positions` from the step's scores, in forward order.
    pub fn record_prompt_logprobs(&mut self, scored: &mut impl Iterator<Item = TokenLogprob>) {
        let n = self.scored_positions().len();
        if let Some(list) = self.prompt_logprobs.as_mut() {
            list.extend(scored.take(n).map(Some));
        }
    }

    /// Whether this step samples a token for the row: a running row always, a seated one with its last chunk.
    pub fn samples(&self) -> bool {
        self.phase != Phase::Seated || self.prefill_end == self.prompt_ids.len()
    }

    /// The tokens this step computes for the row: its prompt chunk when seated, else its last token.
    pub fn query(&self) -> &[u32] {
        match self.phase {
            Phase::Seated => &self.prompt_ids[self.computed..self.prefill_end],
            Phase::Running => std::slice::from_ref(self.output_ids.last().expect("running rows have a token")),
        }
    }

    /// Tokens past the watermark, and the text they completed; advances the watermark. The first delta also
    /// carries the prompt logprobs, if asked for: the step that samples the first token scored the prompt's end.
    pub fn take_delta(&mut self) -> Option<TokenDelta> {
        if self.watermark == self.output_ids.len() {
            return None;
        }
        let token_ids = SmallVec::from_slice(&self.output_ids[self.watermark..]);
        let logprobs = self.logprobs.as_ref().map(|l| l[self.watermark.min(l.len())..].to_vec());
        let prompt_logprobs = if self.watermark == 0 { self.prompt_logprobs.clone() } else { None };
        self.watermark = self.output_ids.len();
        // Copied out, not taken: the buffer keeps its capacity for the next tick's text.
        let text = CompactString::from(self.unreported_text.as_str());
        self.unreported_text.clear();
        Some(TokenDelta { token_ids, text, logprobs, prompt_logprobs })
    }

    /// The snapshot carried by a finished result.
    pub fn into_batch_result(mut self) -> BatchResult {
        let ending = self.ending.take().or(self.latched.take()).expect("only ended rows are reported finished");
        // Releases text held back as a possible stop-string prefix (a stream stopped by a stop string keeps none).
        self.stream.flush();
        BatchResult {
            identity: self.identity,
            prompt_ids: self.prompt_ids,
            output_ids: self.output_ids,
            text: self.stream.text().to_string(),
            finish_reason: ending.reason,
            stop_reason: ending.stop_reason,
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            cached_prompt_tokens: self.cached_prompt_tokens,
            error: ending.error,
        }
    }
}

/// Live rows by slot. Dense execution rows are built per step and never reported.
#[derive(Default)]
pub struct GenerationSession {
    rows: Vec<Option<SequenceRow>>,
}

impl GenerationSession {
    pub fn with_capacity(slots: usize) -> Self {
        Self { rows: (0..slots).map(|_| None).collect() }
    }

    pub fn insert(&mut self, row: SequenceRow) {
        let slot = row.resident().slot as usize;
        debug_assert!(self.rows[slot].is_none(), "slot {slot} already holds a row");
        self.rows[slot] = Some(row);
    }

    /// Callers validate the ref against the slot pool first; the epoch check here is a second guard.
    pub fn get(&self, r: ResidentRef) -> Option<&SequenceRow> {
        self.rows.get(r.slot as usize)?.as_ref().filter(|row| row.resident() == r)
    }

    pub fn get_mut(&mut self, r: ResidentRef) -> Option<&mut SequenceRow> {
        self.rows.get_mut(r.slot as usize)?.as_mut().filter(|row| row.resident() == r)
    }

    pub fn remove(&mut self, r: ResidentRef) -> Option<SequenceRow> {
        let cell = self.rows.get_mut(r.slot as usize)?;
        if cell.as_ref().is_some_and(|row| row.resident() == r) {
            cell.take()
        } else {
            None
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &SequenceRow> {
        self.rows.iter().flatten()
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
