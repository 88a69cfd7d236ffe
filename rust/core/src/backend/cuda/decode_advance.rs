//! Decode graphs that move their own metadata one step on (kernels/decode_advance.cu).
//!
//! A graph replay packs the step's metadata into pinned memory and copies it in before launching the graph; at
//! batch 64 that was a quarter of the host's time per tick, the copy alone a driver call of 4-7 µs. When a decode
//! step runs the same rows as the replay before it, each one position further with the token just sampled for
//! it, the device can derive the metadata from what it holds. The graph's first kernel does that unless the host
//! uploaded fresh metadata, so the host only checks that the step is such a continuation
//! ([`DeviceRows::continues`]) and launches the graph. Each row's block table goes up with the reserved blocks
//! after its context that the stepper passes along ([`crate::model::DECODE_TABLE_LOOKAHEAD`]), so a row crosses
//! into its next block on the device; a row about to run past what was uploaded, or any other change of the
//! batch, takes a fresh upload.

use super::backend::SEQ_INFO_WORDS;
use crate::model::ForwardBatch;

/// Words before a decode graph's metadata: [mode, rows, 0, 0]; four keep the metadata 16-byte aligned.
pub const HEADER_WORDS: usize = 4;
/// The header's mode after an upload: the graph's first kernel leaves the metadata as uploaded (ADVANCE_FRESH).
pub const FRESH: u32 = 0;

/// What the device holds for each row of the last replayed decode step, in batch order.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceRows {
    bucket: usize,
    rows: Vec<DeviceRow>,
    /// Whether the last replay's tokens are known (each row's next token).
    sampled: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct DeviceRow {
    /// Where the row's block table starts in the tables section.
    table_start: usize,
    /// Blocks of the row's table on the device: its context's and the reserved ones after them.
    table_len: usize,
    /// The row's `past_len` in the last replayed step.
    past_len: usize,
    /// The token sampled for the row by that step.
    token: u32,
}

/// Lay out every row's whole block table (reserved blocks included) from the start of `tables` and point the
/// row's `seq_info` entry (5 words a sequence, the table's start 4th) at it. Returns the entries written and,
/// when the graph of `bucket` can `advance`, the rows' device state; it is None when two rows could write one
/// KV slot as the device moves them on: a scheduler bug that `BatchPlan` reports when such a step comes; until
/// then every step is uploaded afresh. `tables` must hold every row's table.
pub fn write_tables(
    batch: &ForwardBatch,
    block_size: usize,
    bucket: usize,
    advance: bool,
    tables: &mut [u32],
    seq_info: &mut [u32],
) -> (usize, Option<DeviceRows>) {
    let mut rows = Vec::with_capacity(if advance { batch.seqs.len() } else { 0 });
    let mut at = 0;
    for (i, seq) in batch.seqs.iter().enumerate() {
        let table = &seq.block_table;
        tables[at..at + table.len()].copy_from_slice(table);
        seq_info[SEQ_INFO_WORDS * i + 3] = at as u32; // table_start
        if advance {
            rows.push(DeviceRow { table_start: at, table_len: table.len(), past_len: seq.past_len, token: 0 });
        }
        at += table.len();
    }
    let state = (advance && writable_blocks_distinct(batch, block_size)).then_some(DeviceRows { bucket, rows, sampled: false });
    (at, state)
}

/// Whether the blocks the rows may write while the device moves them on (each row's from the block of its
/// current position to the end of its table) are all distinct: the guarantee `BatchPlan`'s check of a step's slots
/// gives, for every step the device derives.
fn writable_blocks_distinct(batch: &ForwardBatch, block_size: usize) -> bool {
    let mut blocks: Vec<u32> = batch.seqs.iter().flat_map(|s| s.block_table.iter().skip(s.past_len / block_size).copied()).collect();
    blocks.sort_unstable();
    blocks.windows(2).all(|w| w[0] != w[1])
}

impl DeviceRows {
    /// Whether `batch` is the step the device derives by itself for graph `bucket`: the same number of rows, each
    /// one position further than in the last replay, with the token sampled for it there, and a context whose
    /// blocks are those on the device (`tables`: the tables section as last uploaded). The caller has checked that
    /// `batch` is a decode step (one token per sequence, every row's logits).
    pub fn continues(&self, batch: &ForwardBatch, bucket: usize, block_size: usize, tables: &[u32]) -> bool {
        self.sampled
            && bucket == self.bucket
            && batch.seqs.len() == self.rows.len()
            && batch.seqs.iter().zip(&self.rows).enumerate().all(|(i, (seq, row))| {
                let blocks = (seq.past_len + 1).div_ceil(block_size);
                seq.start == i
                    && seq.len == 1
                    && seq.past_len == row.past_len + 1
                    && batch.positions[i] as usize == seq.past_len
                    && batch.tokens[i] == row.token
                    && blocks <= row.table_len
                    && seq.block_table.get(..blocks) == tables.get(row.table_start..row.table_start + blocks)
            })
    }

    /// The graph was launched without an upload: the device moved every row one step on.
    pub fn step(&mut self) {
        for row in &mut self.rows {
            row.past_len += 1;
        }
        self.sampled = false;
    }

    /// The tokens the last replay sampled, row by row.
    pub fn record_sampled(&mut self, tokens: impl ExactSizeIterator<Item = u32>) {
        self.sampled = tokens.len() == self.rows.len();
        for (row, token) in self.rows.iter_mut().zip(tokens) {
            row.token = token;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SeqSlice;

    const BS: usize = 4;

    /// A decode batch: one row per (past_len, token, table).
    fn decode(rows: &[(usize, u32, Vec<u32>)]) -> ForwardBatch {
        ForwardBatch {
            tokens: rows.iter().map(|r| r.1).collect(),
            positions: rows.iter().map(|r| r.0 as u32).collect(),
            seqs: rows
                .iter()
                .enumerate()
                .map(|(i, r)| SeqSlice { start: i, len: 1, past_len: r.0, block_table: r.2.clone() })
                .collect(),
            logits_for: (0..rows.len()).collect(),
        }
    }

    /// Upload `batch` as a fresh step, then record `sampled`: the tables section and the device state.
    fn uploaded(batch: &ForwardBatch, sampled: &[u32]) -> (Vec<u32>, DeviceRows) {
        let mut tables = vec![0; 64];
        let mut seq_info = vec![0; SEQ_INFO_WORDS * batch.seqs.len()];
        let (_, rows) = write_tables(batch, BS, 8, true, &mut tables, &mut seq_info);
        let mut rows = rows.expect("distinct blocks");
        rows.record_sampled(sampled.iter().copied());
        (tables, rows)
    }

    #[test]
    fn tables_are_laid_out_whole_and_seq_info_points_at_them() {
        let batch = decode(&[(5, 1, vec![7, 8, 9]), (2, 2, vec![3, 4])]);
        let mut tables = vec![0; 8];
        let mut seq_info = vec![0; 10];
        let (entries, rows) = write_tables(&batch, BS, 8, true, &mut tables, &mut seq_info);
        assert_eq!(entries, 5);
        assert_eq!(&tables[..5], &[7, 8, 9, 3, 4]);
        assert_eq!((seq_info[3], seq_info[8]), (0, 3));
        assert!(rows.is_some());
    }

    #[test]
    fn the_next_step_of_the_same_rows_continues() {
        let (tables, rows) = uploaded(&decode(&[(5, 1, vec![7, 8, 9]), (3, 2, vec![3, 4])]), &[11, 12]);
        // Row 0 stays in block 8; row 1 crosses into block 4, reserved and uploaded with its table.
        assert!(rows.continues(&decode(&[(6, 11, vec![7, 8, 9]), (4, 12, vec![3, 4])]), 8, BS, &tables));
        // The step's own reserved blocks are not compared: the device has what it needs.
        assert!(rows.continues(&decode(&[(6, 11, vec![7, 8]), (4, 12, vec![3, 4])]), 8, BS, &tables));
    }

    #[test]
    fn any_other_step_is_uploaded() {
        let batch = decode(&[(5, 1, vec![7, 8, 9]), (2, 2, vec![3, 4])]);
        let (tables, rows) = uploaded(&batch, &[11, 12]);
        let next = |r0: (usize, u32, Vec<u32>)| decode(&[r0, (3, 12, vec![3, 4])]);
        assert!(rows.continues(&next((6, 11, vec![7, 8, 9])), 8, BS, &tables));
        assert!(!rows.continues(&next((6, 11, vec![7, 8, 9])), 16, BS, &tables), "another bucket's graph");
        assert!(!rows.continues(&next((6, 13, vec![7, 8, 9])), 8, BS, &tables), "not the sampled token");
        assert!(!rows.continues(&next((7, 11, vec![7, 8, 9])), 8, BS, &tables), "two positions on");
        assert!(!rows.continues(&next((6, 11, vec![7, 5, 9])), 8, BS, &tables), "another table");
        assert!(!rows.continues(&decode(&[(6, 11, vec![7, 8, 9])]), 8, BS, &tables), "a row fewer");
        assert!(!rows.continues(&decode(&[(3, 12, vec![3, 4]), (6, 11, vec![7, 8, 9])]), 8, BS, &tables), "reordered");
        // Position 12 needs a fourth block, beyond the three uploaded.
        let (tables, rows) = uploaded(&decode(&[(11, 1, vec![7, 8, 9, 10])]), &[11]);
        assert!(rows.continues(&decode(&[(12, 11, vec![7, 8, 9, 10])]), 8, BS, &tables));
        let (tables, rows) = uploaded(&decode(&[(11, 1, vec![7, 8, 9])]), &[11]);
        assert!(!rows.continues(&decode(&[(12, 11, vec![7, 8, 9, 10])]), 8, BS, &tables), "past the uploaded table");
    }

    #[test]
    fn a_launched_step_waits_for_its_tokens() {
        let (tables, mut rows) = uploaded(&decode(&[(5, 1, vec![7, 8, 9])]), &[11]);
        rows.step();
        assert!(!rows.continues(&decode(&[(7, 21, vec![7, 8, 9])]), 8, BS, &tables), "tokens not recorded yet");
        rows.record_sampled([21].into_iter());
        assert!(rows.continues(&decode(&[(7, 21, vec![7, 8, 9])]), 8, BS, &tables));
        rows.record_sampled([21, 22].into_iter());
        assert!(!rows.continues(&decode(&[(7, 21, vec![7, 8, 9])]), 8, BS, &tables), "a token per row");
    }

    #[test]
    fn rows_that_could_write_one_block_are_never_moved_on_the_device() {
        // Row 1's reserved block 8 is row 0's current block.
        let batch = decode(&[(5, 1, vec![7, 8, 9]), (2, 2, vec![3, 8])]);
        let mut tables = vec![0; 8];
        let mut seq_info = vec![0; 10];
        assert!(write_tables(&batch, BS, 8, true, &mut tables, &mut seq_info).1.is_none());
        assert!(write_tables(&batch, BS, 8, false, &mut tables, &mut seq_info).1.is_none(), "a graph without the kernel");
        // Shared blocks before the rows' current ones (a cached prompt prefix) are fine.
        let batch = decode(&[(5, 1, vec![7, 8, 9]), (5, 2, vec![7, 10, 11])]);
        assert!(write_tables(&batch, BS, 8, true, &mut tables, &mut seq_info).1.is_some());
    }
}
