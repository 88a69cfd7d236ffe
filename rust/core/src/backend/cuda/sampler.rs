//! Host side of GPU sampling (kernels/sampling.cu): packs every row's parameters, penalty token ids and
//! logit biases into one buffer, copies it in one transfer, launches one block per row, and copies back only
//! the chosen tokens. A step whose rows are all plain greedy skips that: the forward already left each row's
//! argmax on the device (kernels/gemv.cu argmax_rows), so only those are copied back. Logprobs, of sampled rows
//! that ask for them and of prompt positions, are scored on the device too (kernels/logprobs.cu): a few words a
//! row come back instead of its logits.

use std::time::Instant;

use super::backend::{CudaBackend, DeviceLogits};
use super::device::{Arg, DeviceBuffer, PinnedBuffer};
use crate::error::Result;
use crate::request::{TokenLogprob, MAX_LOGPROBS};
use crate::sampling::{is_greedy, seeded_uniform, RowContext, Sampled, ScoreRow};

/// Words kernels/logprobs.cu returns per scored row: the log-sum-exp, the token's logit, MAX_LOGPROBS ids and
/// their logits (f32 as bits).
const LOGPROB_WORDS: usize = 2 + 2 * MAX_LOGPROBS;
/// The id that ends a row's alternatives early (LOGPROB_NO_ID: the row holds fewer numbers than it asked for).
const NO_ID: u32 = u32::MAX;

/// A scored row's logprobs from its LOGPROB_WORDS words: its logits less their log-sum-exp, as
/// `sampling::token_logprob` computes them on the host.
fn token_logprob_of_words(words: &[u32], score: ScoreRow) -> TokenLogprob {
    let lse = f32::from_bits(words[0]);
    let (ids, logits) = words[2..].split_at(MAX_LOGPROBS);
    let top = ids[..score.top.min(MAX_LOGPROBS)]
        .iter()
        .zip(logits)
        .take_while(|(&id, _)| id != NO_ID)
        .map(|(&id, &logit)| (id, f32::from_bits(logit) - lse))
        .collect();
    TokenLogprob { token_id: score.token_id, logprob: f32::from_bits(words[1]) - lse, top }
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
    /// Scoring: each row's (logits row, token, alternatives) as kernels/logprobs.cu reads them, and its answers.
    score_host: Vec<u32>,
    score_meta: Option<DeviceBuffer>,
    score_out: Vec<u32>,
    /// Microseconds the last `sample`, and a `score` after it, spent blocked on the device (waiting for the forward,
    /// the sampler and the scorer).
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
        let asking: Vec<(usize, ScoreRow)> = (0..n)
            .filter_map(|i| rows[i].params.logprobs.map(|top| (i, ScoreRow { token_id: tokens[i], top })))
            .collect();
        let scored = self.score(backend, logits.ptr, vocab, &asking)?;
        let mut logprobs = vec![None; n];
        for ((i, _), logprob) in asking.iter().zip(scored) {
            logprobs[*i] = Some(logprob);
        }
        Ok(tokens.into_iter().zip(logprobs).map(|(token_id, logprob)| Sampled { token_id, logprob }).collect())
    }

    /// Logprobs on the device (kernels/logprobs.cu): `scored[i] = (row, score)` scores logits row `row` of the
    /// bf16 logits at `logits` (rows of `vocab`) for `score`'s token and alternatives. Called after `sample` for
    /// the same step: adds its own wait to `last_wait_us`, which `sample` set.
    pub fn score(&mut self, backend: &CudaBackend, logits: u64, vocab: usize, scored: &[(usize, ScoreRow)]) -> Result<Vec<TokenLogprob>> {
        let n = scored.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        self.score_host.clear();
        self.score_host.extend(scored.iter().map(|(row, _)| *row as u32));
        self.score_host.extend(scored.iter().map(|(_, s)| s.token_id));
        self.score_host.extend(scored.iter().map(|(_, s)| s.top as u32));
        let gpu = backend.gpu();
        let meta = grow(backend, &mut self.score_meta, (3 + LOGPROB_WORDS) * n * 4)?;
        gpu.upload(meta, &self.score_host)?;
        let out = meta + 4 * (3 * n) as u64;
        let args = [
            Arg::Ptr(logits),
            Arg::I32(vocab as i32),
            Arg::Ptr(meta),
            Arg::Ptr(meta + 4 * n as u64),
            Arg::Ptr(meta + 8 * n as u64),
            Arg::Ptr(out),
        ];
        gpu.launch(backend.score_kernel(), (n as u32, 1, 1), 1024, &args)?;
        self.score_out.resize(LOGPROB_WORDS * n, 0);
        let waited = Instant::now();
        gpu.download(&mut self.score_out, out)?;
        self.last_wait_us += waited.elapsed().as_micros() as u64;
        Ok(self.score_out.chunks(LOGPROB_WORDS).zip(scored).map(|(words, (_, score))| token_logprob_of_words(words, *score)).collect())
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

    #[test]
    fn scored_words_become_logprobs_less_the_log_sum_exp() {
        let lse = 2.5f32;
        let mut words = vec![0u32; LOGPROB_WORDS];
        words[0] = lse.to_bits();
        words[1] = 1.0f32.to_bits();
        // Two alternatives found, then the end mark: a row with two numbers that asked for three.
        for (k, (id, logit)) in [(7u32, 2.0f32), (3, 1.0)].into_iter().enumerate() {
            words[2 + k] = id;
            words[2 + MAX_LOGPROBS + k] = logit.to_bits();
        }
        words[4] = NO_ID;
        let got = token_logprob_of_words(&words, ScoreRow { token_id: 3, top: 3 });
        assert_eq!(got, TokenLogprob { token_id: 3, logprob: 1.0 - lse, top: vec![(7, 2.0 - lse), (3, 1.0 - lse)] });
        // Fewer asked for than found: only those come back.
        let one = token_logprob_of_words(&words, ScoreRow { token_id: 7, top: 1 });
        assert_eq!(one.top, vec![(7, 2.0 - lse)]);
        assert_eq!(token_logprob_of_words(&words, ScoreRow { token_id: 7, top: 0 }).top, vec![]);
    }
}
