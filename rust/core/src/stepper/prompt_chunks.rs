//! How a step computes the seated prompts: each takes a chunk of what is left of it, within the step's budget of
//! `max_prefill_tokens` prompt tokens, and stays seated until the chunk that samples its first token (chunked
//! prefill). A prompt within the budget is one chunk: the seed's single prefill.

use crate::error::Result;
use crate::ids::ResidentRef;
use crate::session::Phase;
use crate::state::context_cache::CommitPolicy;
use crate::step::{ScheduledSequenceDescriptor, SequenceWork};

use super::RuntimeStepper;

/// Memory a step may spend on the logits of prompt positions scored for prompt logprobs, counted as f32 (as the
/// CPU keeps them; a GPU keeps them on the device in bf16, half of it, and scores them there): a prompt that asks
/// for them takes chunks of at most this many positions' logits (about 440 for a 152k vocabulary).
const SCORED_LOGITS_BYTES: usize = 256 << 20;

impl RuntimeStepper {
    /// Give the seated `targets` (none cancelled), in admission order, their prompt chunks for this step: each
    /// takes what is left of its prompt, up to what is left of the step's `max_prefill_tokens` (and, for prompts
    /// whose logprobs are wanted, of the step's scored positions). Returns the targets with a chunk: the step's
    /// prefill participants.
    pub(super) fn schedule_prompt_chunks(&mut self, targets: &[ResidentRef]) -> Result<Vec<ResidentRef>> {
        let mut budget = self.config.max_prefill_tokens;
        let mut scored_budget = (SCORED_LOGITS_BYTES / (4 * self.runner.config().vocab_size)).max(1);
        let mut participants = Vec::with_capacity(targets.len());
        for &r in targets {
            let row = self.row_mut(r)?;
            let mut chunk = (row.prompt_ids.len() - row.computed).min(budget);
            if row.sampling.prompt_logprobs.is_some() {
                chunk = chunk.min(scored_budget);
                scored_budget -= chunk;
            }
            row.prefill_end = row.computed + chunk;
            budget -= chunk;
            if chunk > 0 {
                participants.push(r);
            }
        }
        Ok(participants)
    }

    /// After a prefill step's forward: the `computed` targets whose prompts are complete run from now on, each
    /// computed chunk's full blocks are published, and the targets still short of their prompt's end (and not
    /// ended) stay seated, in admission order, for the next step. Returns whether anything was published.
    pub(super) fn finish_prompt_chunks(&mut self, targets: &[ResidentRef], computed: &[ResidentRef]) -> Result<bool> {
        let mut published = false;
        for &r in computed {
            let row = self.row_mut(r)?;
            if row.computed == row.prompt_ids.len() {
                row.phase = Phase::Running;
            }
            published |= self.publish_prefix(r, CommitPolicy::PrefillOnly)?;
        }
        let still_seated =
            |r: &ResidentRef| self.session.get(*r).is_some_and(|row| row.phase == Phase::Seated && row.ending.is_none());
        self.seated = targets.iter().copied().filter(still_seated).collect();
        Ok(published)
    }

    /// Each seated target's prompt work: its chunk of the prompt after what is computed (what the cache held,
    /// and earlier chunks); the chunk that ends the prompt selects its last token's logits.
    pub(super) fn prefill_descriptors(&self, targets: &[ResidentRef]) -> Result<Vec<ScheduledSequenceDescriptor>> {
        targets
            .iter()
            .map(|&r| {
                let row = self.row(r)?;
                Ok(ScheduledSequenceDescriptor {
                    identity: row.identity,
                    work: SequenceWork::Context,
                    query_length: row.prefill_end - row.computed,
                    past_length: row.computed,
                    select_last_token_logits: row.prefill_end == row.prompt_ids.len(),
                })
            })
            .collect()
    }
}
