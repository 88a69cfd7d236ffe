//! Host-side, validated and flattened form of a [`ForwardBatch`]: what every backend uploads.
//!
//! Validation happens here, once, so device code can index without checks: every token belongs to exactly
//! one sequence, positions follow `past_len`, block tables cover the positions and stay inside the cache,
//! and no two tokens write the same KV slot.

use crate::error::{Error, Result};
use crate::model::ForwardBatch;

/// One sequence of the batch, with its block table located in [`BatchPlan::block_tables`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlannedSeq {
    /// First query token's row in the batch.
    pub start: u32,
    /// Query tokens in this step.
    pub len: u32,
    /// Tokens already cached; query token `j` sits at position `past_len + j`.
    pub past_len: u32,
    pub table_start: u32,
    pub table_len: u32,
}

impl PlannedSeq {
    /// Tokens visible to this sequence's last query: cached past plus this step's tokens.
    pub fn context_len(&self) -> usize {
        (self.past_len + self.len) as usize
    }
}

/// Flat, device-friendly batch metadata (plain `u32` arrays, as GPU kernels want them).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BatchPlan {
    pub block_size: usize,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// KV slot each token's K/V is written to: `block_table[pos / block_size] * block_size + pos % block_size`.
    pub slots: Vec<u32>,
    /// Index into `seqs` of each token.
    pub token_seq: Vec<u32>,
    pub seqs: Vec<PlannedSeq>,
    /// Every sequence's block table, concatenated.
    pub block_tables: Vec<u32>,
    /// Rows whose logits are wanted, in output order.
    pub logits_rows: Vec<u32>,
}

impl BatchPlan {
    /// Check `batch` against the cache geometry and the vocabulary, and flatten it.
    pub fn new(batch: &ForwardBatch, block_size: usize, num_blocks: usize, vocab_size: usize) -> Result<Self> {
        let n = batch.tokens.len();
        if batch.positions.len() != n {
            return bad_batch(format!("{} tokens but {} positions", n, batch.positions.len()));
        }
        if n > u32::MAX as usize / 2 {
            return bad_batch(format!("{n} tokens is more than one step can hold"));
        }
        check_token_ids(&batch.tokens, vocab_size)?;
        let mut plan = BatchPlan {
            block_size,
            tokens: batch.tokens.clone(),
            positions: batch.positions.clone(),
            slots: vec![0; n],
            token_seq: vec![u32::MAX; n],
            seqs: Vec::with_capacity(batch.seqs.len()),
            // Sized up front: growing it table by table would copy it over and over.
            block_tables: Vec::with_capacity(batch.seqs.iter().map(|s| s.block_table.len()).sum()),
            logits_rows: Vec::with_capacity(batch.logits_for.len()),
        };
        for (index, seq) in batch.seqs.iter().enumerate() {
            plan.add_seq(index, seq, num_blocks)?;
        }
        if let Some(orphan) = plan.token_seq.iter().position(|&s| s == u32::MAX) {
            return bad_batch(format!("token row {orphan} belongs to no sequence"));
        }
        check_unique_slots(&plan.slots)?;
        for &row in &batch.logits_for {
            if row >= n {
                return bad_batch(format!("logits_for asks for row {row} of a {n}-token batch"));
            }
            plan.logits_rows.push(row as u32);
        }
        Ok(plan)
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Most query tokens of one sequence. 1 means a decode step: no token then attends to another token of the
    /// same step, so a backend may write each new K/V inside its attention.
    pub fn max_query_len(&self) -> usize {
        self.seqs.iter().map(|s| s.len as usize).max().unwrap_or(0)
    }

    /// The block table of sequence `seq`.
    pub fn block_table(&self, seq: &PlannedSeq) -> &[u32] {
        &self.block_tables[seq.table_start as usize..(seq.table_start + seq.table_len) as usize]
    }

    fn add_seq(&mut self, index: usize, seq: &crate::model::SeqSlice, num_blocks: usize) -> Result<()> {
        let n = self.tokens.len();
        if seq.len == 0 || seq.start + seq.len > n {
            return bad_batch(format!(
                "sequence {index} covers rows {}..{} of a {n}-token batch (it needs at least one token)",
                seq.start,
                seq.start + seq.len
            ));
        }
        let context = seq.past_len + seq.len;
        let blocks_needed = context.div_ceil(self.block_size);
        if seq.block_table.len() < blocks_needed {
            return bad_batch(format!(
                "sequence {index} reaches position {} but its block table has {} blocks of {} (needs {blocks_needed})",
                context - 1,
                seq.block_table.len(),
                self.block_size
            ));
        }
        // The maximum is one vectorized pass (a plain u32 fold); the offending block is only looked for when
        // there is one.
        let largest = seq.block_table.iter().fold(0u32, |m, &b| m.max(b));
        if !seq.block_table.is_empty() && largest as usize >= num_blocks {
            let block = seq.block_table.iter().find(|&&b| b as usize >= num_blocks).expect("the maximum is out of range");
            return bad_batch(format!("sequence {index} uses block {block} but the KV cache has {num_blocks} blocks"));
        }
        let table_start = self.block_tables.len();
        self.block_tables.extend_from_slice(&seq.block_table[..blocks_needed]);
        for j in 0..seq.len {
            let row = seq.start + j;
            let position = seq.past_len + j;
            if self.positions[row] as usize != position {
                return bad_batch(format!(
                    "row {row} of sequence {index} has position {} but past_len {} + offset {j} = {position}",
                    self.positions[row], seq.past_len
                ));
            }
            if self.token_seq[row] != u32::MAX {
                return bad_batch(format!("row {row} belongs to sequences {} and {index}", self.token_seq[row]));
            }
            self.token_seq[row] = index as u32;
            let block = seq.block_table[position / self.block_size] as usize;
            self.slots[row] = (block * self.block_size + position % self.block_size) as u32;
        }
        self.seqs.push(PlannedSeq {
            start: seq.start as u32,
            len: seq.len as u32,
            past_len: seq.past_len as u32,
            table_start: table_start as u32,
            table_len: blocks_needed as u32,
        });
        Ok(())
    }
}

fn check_token_ids(tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().position(|&t| t as usize >= vocab_size) {
        Some(row) => Err(Error::InvalidRequest(format!(
            "token id {} at row {row} is outside the vocabulary (size {vocab_size})",
            tokens[row]
        ))),
        None => Ok(()),
    }
}

/// Two tokens writing one slot would be a scheduler bug that silently corrupts the cache.
fn check_unique_slots(slots: &[u32]) -> Result<()> {
    let mut sorted = slots.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => bad_batch(format!("two tokens write KV slot {} in the same step", w[0])),
        None => Ok(()),
    }
}

fn bad_batch<T>(msg: String) -> Result<T> {
    Err(Error::Internal(format!("malformed ForwardBatch: {msg}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SeqSlice;

    fn one_seq(past_len: usize, len: usize, table: Vec<u32>) -> ForwardBatch {
        ForwardBatch {
            tokens: vec![1; len],
            positions: (past_len..past_len + len).map(|p| p as u32).collect(),
            seqs: vec![SeqSlice { start: 0, len, past_len, block_table: table }],
            logits_for: vec![len - 1],
        }
    }

    #[test]
    fn slots_follow_the_block_table() {
        let plan = BatchPlan::new(&one_seq(3, 3, vec![7, 2]), 4, 8, 10).unwrap();
        assert_eq!(plan.slots, vec![7 * 4 + 3, 2 * 4, 2 * 4 + 1]);
        assert_eq!(plan.block_tables, vec![7, 2]);
    }

    #[test]
    fn short_block_table_is_refused() {
        let err = BatchPlan::new(&one_seq(3, 3, vec![7]), 4, 8, 10).unwrap_err();
        assert!(err.to_string().contains("needs 2"), "{err}");
    }

    #[test]
    fn out_of_vocab_token_is_invalid_request() {
        let mut batch = one_seq(0, 2, vec![0]);
        batch.tokens[1] = 10;
        assert!(matches!(BatchPlan::new(&batch, 4, 8, 10), Err(Error::InvalidRequest(_))));
    }

    #[test]
    fn decode_means_one_query_token_per_sequence() {
        assert_eq!(BatchPlan::new(&one_seq(3, 1, vec![7]), 4, 8, 10).unwrap().max_query_len(), 1);
        assert_eq!(BatchPlan::new(&one_seq(3, 2, vec![7, 2]), 4, 8, 10).unwrap().max_query_len(), 2);
    }

    #[test]
    fn duplicate_slots_are_refused() {
        let mut batch = one_seq(0, 2, vec![0]);
        batch.tokens.extend([1, 1]);
        batch.positions.extend([0, 1]);
        batch.seqs.push(SeqSlice { start: 2, len: 2, past_len: 0, block_table: vec![0] });
        let err = BatchPlan::new(&batch, 4, 8, 10).unwrap_err();
        assert!(err.to_string().contains("same step"), "{err}");
    }
}
