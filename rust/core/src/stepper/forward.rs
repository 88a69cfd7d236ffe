//! How a step's rows become one forward: their order, the ragged batch, and the forward with sampling.

use crate::ids::ResidentRef;
use crate::model::{ForwardBatch, SeqSlice, DECODE_TABLE_LOOKAHEAD};
use crate::request::FinishReason;
use crate::request::TokenLogprob;
use crate::sampling::{RowContext, Sampled, ScoreRow};
use crate::session::{Ending, Phase};
use crate::step::SequenceWork;

use super::RuntimeStepper;

impl RuntimeStepper {
    /// The ragged batch: each sequence's tokens of this step (`SequenceRow::query`), their positions and its
    /// block table (a running row's with the reserved blocks of `DECODE_TABLE_LOOKAHEAD`), and the logits of the
    /// rows that sample, then of the prompt positions scored for prompt logprobs (`self.scores`). It is built in
    /// the previous step's batch
    /// (`batch_scratch`, handed back after the forward) to reuse its allocations.
    pub(super) fn plan_forward(&mut self, refs: &[ResidentRef]) -> ForwardBatch {
        let mut fb = std::mem::take(&mut self.batch_scratch);
        fb.tokens.clear();
        fb.positions.clear();
        fb.logits_for.clear();
        fb.seqs.truncate(refs.len());
        self.scores.clear();
        let mut scored_logits = Vec::new(); // allocates only in a step that scores prompt positions
        for (i, r) in refs.iter().enumerate() {
            let row = self.session.get(*r).expect("validated");
            let query = row.query();
            let start = fb.tokens.len();
            fb.tokens.extend_from_slice(query);
            fb.positions.extend((row.computed..row.computed + query.len()).map(|p| p as u32));
            let needed_blocks = (row.computed + query.len()).div_ceil(self.config.block_size);
            let table_len = match row.phase {
                Phase::Running => (needed_blocks + DECODE_TABLE_LOOKAHEAD).min(row.lease.blocks.len()),
                Phase::Seated => needed_blocks,
            };
            if i == fb.seqs.len() {
                fb.seqs.push(SeqSlice { start: 0, len: 0, past_len: 0, block_table: Vec::new() });
            }
            let seq = &mut fb.seqs[i];
            seq.start = start;
            seq.len = query.len();
            seq.past_len = row.computed;
            seq.block_table.clear();
            seq.block_table.extend_from_slice(&row.lease.blocks[..table_len]);
            if row.samples() {
                fb.logits_for.push(start + query.len() - 1);
            }
            if let Some(top) = row.sampling.prompt_logprobs {
                for p in row.scored_positions() {
                    scored_logits.push(start + p - row.computed);
                    self.scores.push(ScoreRow { token_id: row.prompt_ids[p + 1], top });
                }
            }
        }
        fb.logits_for.append(&mut scored_logits);
        fb
    }

    /// The order the forward takes `refs` in: for decode, the longest context first (ties by slot). A row's
    /// attention costs in proportion to its context, and a GPU starts a launch's blocks in row order, so a long
    /// row placed last would run on alone after the others are done; longest-first keeps the tail short (the
    /// mixed workload of benchmarks/gpu_decode.py, benchmarks/RESULTS.md). Rows are independent in the forward,
    /// so the order changes no result. Prefill keeps the admission order, and a mixed step puts its prefill
    /// rows, in admission order, after its decode rows.
    pub(super) fn forward_order(&mut self, refs: &[ResidentRef], work: SequenceWork) -> Vec<ResidentRef> {
        let mut order = std::mem::take(&mut self.order_scratch);
        order.clear();
        if work == SequenceWork::Context {
            order.extend_from_slice(refs);
            return order;
        }
        let session = &self.session;
        let seated = |r: &ResidentRef| session.get(*r).is_some_and(|row| row.phase == Phase::Seated);
        // Each row is looked up once: its key (longest first, then slot), packed so the sort compares integers;
        // a mixed step's seated rows are left for the end.
        let keys = &mut self.order_keys;
        keys.clear();
        keys.extend(refs.iter().filter_map(|r| {
            let row = session.get(*r);
            if row.is_some_and(|row| row.phase == Phase::Seated) {
                return None;
            }
            let context = row.map_or(0, |row| row.computed).min(u32::MAX as usize) as u64;
            Some((((u32::MAX as u64 - context) << 32) | r.slot as u64, *r))
        }));
        keys.sort_unstable_by_key(|&(key, _)| key);
        order.extend(keys.iter().map(|&(_, r)| r));
        if work == SequenceWork::Mixed {
            order.extend(refs.iter().filter(|r| seated(r)));
        }
        order
    }

    /// Forward then sample every row that samples (`SequenceRow::samples`), in order, and score the prompt
    /// positions of `self.scores`; an Err carries the ending that every participant latches.
    pub(super) fn run_and_sample(
        &mut self,
        fb: &ForwardBatch,
        refs: &[ResidentRef],
    ) -> std::result::Result<(Vec<Sampled>, Vec<TokenLogprob>), Ending> {
        // Sized for every row up front: a filtered iterator would grow the Vec a few times each tick.
        let mut ctxs: Vec<RowContext> = Vec::with_capacity(refs.len());
        for r in refs {
            let row = self.session.get(*r).expect("validated");
            if row.samples() {
                ctxs.push(RowContext {
                    params: &row.sampling,
                    prompt_ids: &row.prompt_ids,
                    output_ids: &row.output_ids,
                    position: row.total_len() as u64,
                    seed: row.seed,
                    banned: row.banned_ids(),
                });
            }
        }
        self.runner.forward_sample_and_score(fb, &ctxs, &self.scores).map_err(|e| Ending {
            reason: FinishReason::Error,
            stop_reason: None,
            error: Some(e.to_string()),
        })
    }
}
