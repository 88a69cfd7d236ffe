//! Host side of GPU sampling (kernels/sampling.cu): packs every row's parameters, penalty token ids and
//! logit biases into one buffer, copies it in one transfer, launches one block per row, and copies back only
//! the chosen tokens. A step whose rows are all plain greedy skips that: the forward already left each row's
//! argmax on the device (kernels/gemv.cu argmax_rows), so only those are copied back. Logprobs, when rows ask
//! for them, are computed on the host from their raw logits (copied back in one transfer).

use half::bf16;
use rayon::prelude::*;

use std::time::Instant;

use super::backend::{CudaBackend, DeviceLogits};
use super::device::{Arg, DeviceBuffer, PinnedBuffer};
use crate::error::Result;
use crate::request::TokenLogprob;
use crate::sampling::{is_greedy, score_rows, seeded_uniform, RowContext, Sampled, ScoreRow};

/// The logprobs of the rows that ask for them (None for the others): their logits rows come back, a run of
/// consecutive such rows in one transfer, and are scored on the host in parallel (row by row, each its own
/// transfer and all on one core, a batch of 64 rows took milliseconds).
fn logprobs_of_rows(
    backend: &CudaBackend,
    logits: DeviceLogits,
    vocab: usize,
    rows: &[RowContext],
    tokens: &[u32],
) -> Result<Vec<Option<TokenLogprob>>> {
    let asking: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].params.logprobs.is_some()).collect();
    let mut raw = vec![bf16::ZERO; asking.len() * vocab];
    let mut slot = 0;
    for run in asking.chunk_by(|a, b| b == &(a + 1)) {
        let dst = &mut raw[slot * vocab..(slot + run.len()) * vocab];
        backend.gpu().download(dst, logits.ptr + (run[0] * vocab * 2) as u64)?;
        slot += run.len();
    }
    Ok(score_bf16_rows(&raw, &asking, vocab, rows, tokens))
}

/// Each asking row's logprob of its token and its top alternatives (None for the other rows), from `raw`: the
/// bf16 logits rows of the rows `asking`, back to back; scored as prompt positions are ([`score_rows`]).
fn score_bf16_rows(raw: &[bf16], asking: &[usize], vocab: usize, rows: &[RowContext], tokens: &[u32]) -> Vec<Option<TokenLogprob>> {
    let raw: Vec<f32> = raw.par_iter().map(|v| v.to_f32()).collect();
    let scores: Vec<ScoreRow> =
        asking.iter().map(|&i| ScoreRow { token_id: tokens[i], top: rows[i].params.logprobs.unwrap_or(0) }).collect();
    let mut out = vec![None; rows.len()];
    for (&i, logprob) in asking.iter().zip(score_rows(&raw, vocab, &scores)) {
        out[i] = Some(logprob);
    }
    out
}

/// Words per row of `RowParams` in kernels/sampling.cu.
const PARAM_WORDS: usize = 16;
/// Index of the row's first bias pair within its `RowParams`.
const BIAS_START_WORD: usize = 11;

#[derive(Default)]
pub struct Sampler {
    host: Vec<u32>,
    staging: Option<PinnedBuffer<u32>>,
    meta: Option<DeviceBuffer>,
    work: Option<DeviceBuffer>,
    keep: Option<DeviceBuffer>,
    out: Option<PinnedBuffer<u32>>,
    /// Where the bias pairs start in `host`.
    bias_offset: usize,
    keys: Option<PinnedBuffer<u64>>,
    /// Microseconds the last `sample` spent blocked on the device (waiting for the forward and the sampler).
    pub last_wait_us: u64,
}


fn grow(backend: &CudaBackend, slot: &mut Option<DeviceBuffer>, bytes: usize) -> Result<u64> {
    if slot.as_ref().is_none_or(|b| b.bytes() < bytes) {
        *slot = None;
        *slot = Some(backend.gpu().alloc(bytes + bytes / 4)?);
    }
    Ok(slot.as_ref().unwrap().ptr())
}

impl Sampler {
    /// Sample one token per row from bf16 logits `[rows.len(), vocab]` on the device.
    pub fn sample(&mut self, backend: &CudaBackend, logits: DeviceLogits, vocab: usize, rows: &[RowContext]) -> Result<Vec<Sampled>> {
        let n = rows.len();
        self.last_wait_us = 0;
        if n == 0 {
            return Ok(Vec::new());
        }
        let tokens = if rows.iter().all(|ctx| ctx.is_plain_argmax()) { self.argmax_tokens(backend, logits.argmax, n)? } else { self.draw(backend, logits, vocab, rows)? };
        if rows.iter().all(|ctx| ctx.params.logprobs.is_none()) {
            // The usual decode step: no logits come back and nothing is scored.
            return Ok(tokens.into_iter().map(|token_id| Sampled { token_id, logprob: None }).collect());
        }
        let logprobs = logprobs_of_rows(backend, logits, vocab, rows, &tokens)?;
        Ok(tokens.into_iter().zip(logprobs).map(|(token_id, logprob)| Sampled { token_id, logprob }).collect())
    }

    /// The argmax the forward computed for each of `n` rows (keys at device address `keys`).
    fn argmax_tokens(&mut self, backend: &CudaBackend, keys: u64, n: usize) -> Result<Vec<u32>> {
        if self.keys.as_ref().is_none_or(|k| k.capacity() < n) {
            self.keys = None;
            self.keys = Some(PinnedBuffer::new(backend.gpu(), n * 2)?);
        }
        let host = self.keys.as_mut().unwrap();
        let waited = Instant::now();
        backend.gpu().download(&mut host.as_mut_slice()[..n], keys)?;
        self.last_wait_us = waited.elapsed().as_micros() as u64;
        Ok(host.as_slice()[..n].iter().map(|k| u32::MAX - (*k as u32)).collect())
    }

    /// Run the sampling kernel over every row; returns the drawn tokens. The kernel also leaves them in the argmax
    /// keys, where a decode graph's next replay reads its tokens (decode_advance.rs).
    fn draw(&mut self, backend: &CudaBackend, logits: DeviceLogits, vocab: usize, rows: &[RowContext]) -> Result<Vec<u32>> {
        let n = rows.len();
        self.pack(rows);
        let gpu = backend.gpu();
        let words = self.host.len();
        if self.staging.as_ref().is_none_or(|s| s.capacity() < words) {
            self.staging = None;
            self.staging = Some(PinnedBuffer::new(gpu, words * 2)?);
        }
        if self.out.as_ref().is_none_or(|s| s.capacity() < n) {
            self.out = None;
            self.out = Some(PinnedBuffer::new(gpu, n * 2)?);
        }
        let staging = self.staging.as_mut().unwrap();
        staging.as_mut_slice()[..words].copy_from_slice(&self.host);
        let meta = grow(backend, &mut self.meta, (words + n) * 4)?;
        let work = grow(backend, &mut self.work, n * vocab * 4)?;
        let keep = grow(backend, &mut self.keep, n * vocab)?;
        gpu.upload(meta, &staging.as_slice()[..words])?;
        let ids_at = PARAM_WORDS * n;
        let bias_at = self.bias_offset;
        let out_dev = meta + 4 * words as u64;
        let args = [
            Arg::Ptr(logits.ptr),
            Arg::I32(vocab as i32),
            Arg::Ptr(meta),
            Arg::Ptr(meta + 4 * ids_at as u64),
            Arg::Ptr(meta + 4 * bias_at as u64),
            Arg::Ptr(work),
            Arg::Ptr(keep),
            Arg::Ptr(out_dev),
            Arg::Ptr(logits.argmax),
        ];
        gpu.launch(backend.sample_kernel(), (n as u32, 1, 1), 1024, &args)?;
        let out = self.out.as_mut().unwrap();
        let waited = Instant::now();
        gpu.download(&mut out.as_mut_slice()[..n], out_dev)?;
        self.last_wait_us = waited.elapsed().as_micros() as u64;
        Ok(out.as_slice()[..n].to_vec())
    }

    /// Lay out [params (16 words a row) | ids | bias pairs] in `self.host`. Each row's parameters are written as
    /// its ids are appended; its bias start is filled in once the ids end, so no per-step lists are needed.
    fn pack(&mut self, rows: &[RowContext]) {
        let n = rows.len();
        self.host.clear();
        self.host.resize(PARAM_WORDS * n, 0);
        for (i, ctx) in rows.iter().enumerate() {
            let p = ctx.params;
            let ids_start = self.host.len() - PARAM_WORDS * n;
            let (prompt_len, output_len) = if p.repetition_penalty != 1.0 {
                self.host.extend_from_slice(ctx.prompt_ids);
                self.host.extend_from_slice(ctx.output_ids);
                (ctx.prompt_ids.len(), ctx.output_ids.len())
            } else if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
                self.host.extend_from_slice(ctx.output_ids);
                (0, ctx.output_ids.len())
            } else {
                (0, 0)
            };
            let greedy = is_greedy(p);
            let u = seeded_uniform(ctx.seed, ctx.position).to_bits();
            let words = [
                p.temperature.to_bits(),
                p.top_k.min(u32::MAX as usize) as u32,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.repetition_penalty.to_bits(),
                p.presence_penalty.to_bits(),
                p.frequency_penalty.to_bits(),
                greedy as u32,
                ids_start as u32,
                prompt_len as u32,
                output_len as u32,
                0, // bias start: written below
                (p.logit_bias.len() + ctx.banned.len()) as u32,
                u as u32,
                (u >> 32) as u32,
                0,
            ];
            self.host[PARAM_WORDS * i..PARAM_WORDS * (i + 1)].copy_from_slice(&words);
        }
        self.bias_offset = self.host.len();
        for (i, ctx) in rows.iter().enumerate() {
            self.host[PARAM_WORDS * i + BIAS_START_WORD] = ((self.host.len() - self.bias_offset) / 2) as u32;
            for &(id, b) in &ctx.params.logit_bias {
                self.host.push(id);
                self.host.push(b.to_bits());
            }
            // A banned id's bias of -inf leaves its logit -inf whatever else was added to it, as on the CPU.
            for &id in ctx.banned {
                self.host.push(id);
                self.host.push(f32::NEG_INFINITY.to_bits());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::SamplingParams;

    #[test]
    fn rows_asking_for_logprobs_are_scored_from_their_own_downloaded_rows() {
        let vocab = 7;
        let plain = SamplingParams::default();
        let asking = SamplingParams { logprobs: Some(2), ..SamplingParams::default() };
        let params = [&plain, &asking, &plain, &asking, &asking];
        let rows: Vec<RowContext> = params
            .iter()
            .map(|p| RowContext { params: p, prompt_ids: &[], output_ids: &[], position: 0, seed: 0, banned: &[] })
            .collect();
        let tokens = [0, 3, 1, 5, 2];
        // The asking rows came back (1, then the run 3-4), each with a different peak.
        let logits = |row: usize| (0..vocab).map(move |j| ((j * 3 + row * 5) % vocab) as f32 * 0.5 - 1.0);
        let raw: Vec<bf16> = [1, 3, 4].into_iter().flat_map(logits).map(bf16::from_f32).collect();
        let got = score_bf16_rows(&raw, &[1, 3, 4], vocab, &rows, &tokens);
        let want = |row: usize| {
            let row_f32: Vec<f32> = logits(row).map(|v| bf16::from_f32(v).to_f32()).collect();
            Some(crate::sampling::token_logprob(&row_f32, tokens[row], 2))
        };
        assert_eq!(got, vec![None, want(1), None, want(3), want(4)]);
        assert!(want(1) != want(3) && want(3) != want(4));
    }
}
