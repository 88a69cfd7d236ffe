//! `CudaRunner`: the Llama-family model on the CUDA backend, plus what only a GPU runner does: sampling on
//! the device and decode steps replayed from CUDA graphs (one per batch-size bucket).
//!
//! A graph is captured by running the ordinary forward (model::llama) while the stream is capturing; the
//! backend then points every kernel at one fixed metadata buffer. A replay packs the step's metadata (padded
//! to the bucket with rows that write and read a dummy KV block) into pinned memory, copies it in one
//! transfer, and launches the graph: no per-op host work and no allocation. A step that continues the replay
//! before it (the same rows, one token on) skips the packing and the copy: the graph's first kernel moves the
//! metadata on (decode_advance.rs).

use std::time::Instant;

use cudarc::driver::{sys, CudaGraph};

use super::backend::{CudaBackend, DeviceLogits, MetaLayout, SEQ_INFO_WORDS};
use super::decode_advance::{self, DeviceRows, HEADER_WORDS};
use super::device::{DeviceBuffer, PinnedBuffer};
use super::sampler::Sampler;
use crate::backend::{BatchPlan, KvCacheDtype};
use crate::error::{protocol, Error, Result};
use crate::model::llama::LlamaModel;
use crate::model::{ForwardBatch, ModelConfig, ModelRunner, SeqSlice, StepTiming};
use crate::request::TokenLogprob;
use crate::sampling::{RowContext, Sampled, ScoreRow};

/// Graph buckets past 8 step by this much up to 64, then by twice as much.
const BUCKET_STEP: usize = 8;
/// Block-table entries one replayed sequence may have (longer contexts decode eagerly).
const MAX_GRAPH_TABLE: usize = 4096;

struct Graph(CudaGraph);
// SAFETY: a graph is only launched by the runner that owns it, one thread at a time.
unsafe impl Send for Graph {}

struct DecodeGraphs {
    /// (batch size, graph, where it leaves its logits)
    buckets: Vec<(usize, Graph, DeviceLogits)>,
    /// The metadata's sections, after its header of HEADER_WORDS words.
    layout: MetaLayout,
    /// Header and metadata on the device, and as last packed on the host.
    meta: DeviceBuffer,
    staging: PinnedBuffer<u32>,
    table_cap: usize,
    /// Whether the graphs begin with the kernel that moves their metadata on (STEPLLM_NO_DECODE_ADVANCE=1: no).
    advance: bool,
    /// The rows of the last replay as the device holds them, while the next step may continue them.
    device_rows: Option<DeviceRows>,
}

impl DecodeGraphs {
    /// Pack the step `batch` (validated as `plan`) for the graph of `bucket` into the staging buffer: the header
    /// (the graph's first kernel leaves the metadata as uploaded), the metadata, each row's whole block table,
    /// and padding rows up to the bucket. Returns the words to upload, or None when the tables do not fit. Sets
    /// the device state the next step may continue from.
    fn pack_fresh(&mut self, batch: &ForwardBatch, plan: &BatchPlan, bucket: usize, num_blocks: usize, block_size: usize) -> Option<usize> {
        let entries: usize = batch.seqs.iter().map(|s| s.block_table.len()).sum();
        if entries + 1 > self.table_cap {
            return None;
        }
        let (n, lay) = (batch.seqs.len(), self.layout);
        let host = self.staging.as_mut_slice();
        host[..HEADER_WORDS].copy_from_slice(&[decode_advance::FRESH, n as u32, 0, 0]);
        let meta = &mut host[HEADER_WORDS..];
        lay.pack_rows(plan, meta);
        // Each row's whole table, with the blocks reserved past its context for the device to move into.
        let (head, tables) = meta.split_at_mut(lay.tables);
        let seq_info = &mut head[lay.seq_info..lay.logits_rows];
        let (entries, rows) = decode_advance::write_tables(batch, block_size, bucket, self.advance, tables, seq_info);
        // Padding rows: token 0 at position 0, writing and reading only the dummy block.
        let dummy_table = entries;
        meta[lay.tables + dummy_table] = num_blocks as u32;
        for i in n..bucket {
            meta[lay.tokens + i] = 0;
            meta[lay.positions + i] = 0;
            meta[lay.slots + i] = (num_blocks * block_size) as u32;
            meta[lay.token_seq + i] = i as u32;
            let at = lay.seq_info + SEQ_INFO_WORDS * i;
            meta[at..at + SEQ_INFO_WORDS].copy_from_slice(&[i as u32, 1, 0, dummy_table as u32, 1]);
            meta[lay.logits_rows + i] = i as u32;
        }
        self.device_rows = rows;
        Some(HEADER_WORDS + lay.tables + entries + 1)
    }
}

pub struct CudaRunner {
    model: LlamaModel<CudaBackend>,
    backend: CudaBackend,
    sampler: Sampler,
    graphs: Option<DecodeGraphs>,
    /// (num_blocks, block_size) of the allocated KV cache.
    kv: Option<(usize, usize)>,
    /// Whether the last forward was a graph replay, and whether it found its metadata on the device.
    last_replayed: bool,
    last_advanced: bool,
    /// Microseconds the last forward spent blocked on the device.
    last_wait_us: u64,
    trace: Option<ReplayTrace>,
}

/// STEPLLM_TRACE_REPLAY=1: the mean host time of each phase of a graph-replayed decode tick, printed to stderr
/// every TRACE_EVERY replays, to see on a given machine where a tick's host time (`elapsed_us - device_wait_us`)
/// goes: building the metadata, copying it, launching the graph, waiting for and reading back the tokens, and
/// everything between the end of one replay's sampling and the start of the next (the stepper's bookkeeping and
/// the caller's loop).
struct ReplayTrace {
    phases_ns: [u64; 5],
    replays: u64,
    /// The batch size being averaged: a change starts a new window.
    rows: usize,
    launched: Option<Instant>,
    sampled: Option<Instant>,
}

const TRACE_EVERY: u64 = 200;

impl ReplayTrace {
    fn from_env() -> Option<Self> {
        std::env::var_os("STEPLLM_TRACE_REPLAY").map(|_| Self::window(0))
    }

    /// An empty averaging window for batch size `rows`.
    fn window(rows: usize) -> Self {
        Self { phases_ns: [0; 5], replays: 0, rows, launched: None, sampled: None }
    }

    /// `marks`: before packing the metadata, before copying it in, before launching the graph, after.
    fn record_launch(&mut self, rows: usize, marks: [Instant; 4]) {
        if rows != self.rows {
            *self = Self::window(rows);
        }
        for (i, total) in self.phases_ns[..3].iter_mut().enumerate() {
            *total += (marks[i + 1] - marks[i]).as_nanos() as u64;
        }
        if let Some(sampled) = self.sampled.take() {
            self.phases_ns[4] += (marks[0] - sampled).as_nanos() as u64;
        }
        self.launched = Some(marks[3]);
    }

    /// The replay's tokens are on the host.
    fn record_sampled(&mut self) {
        let rows = self.rows;
        let Some(launched) = self.launched.take() else { return };
        let now = Instant::now();
        self.phases_ns[3] += (now - launched).as_nanos() as u64;
        self.sampled = Some(now);
        self.replays += 1;
        if self.replays.is_multiple_of(TRACE_EVERY) {
            let us = |ns: u64| ns as f64 / TRACE_EVERY as f64 / 1e3;
            let [pack, copy, launch, wait, between] = std::mem::take(&mut self.phases_ns);
            eprintln!(
                "stepllm: replay trace, batch {rows}, mean of {TRACE_EVERY}: metadata pack {:.1} us, copy {:.1} us, \
                 graph launch {:.1} us, wait + sample {:.1} us, between replays {:.1} us",
                us(pack),
                us(copy),
                us(launch),
                us(wait),
                us(between)
            );
        }
    }
}

/// 1, 2, 4, 8, then steps up to `max`.
pub fn decode_buckets(max: usize) -> Vec<usize> {
    let mut b: Vec<usize> = [1, 2, 4, 8].into_iter().filter(|&x| x < max).collect();
    let mut next = 8;
    while next < max {
        next += if next < 64 { BUCKET_STEP } else { 2 * BUCKET_STEP };
        b.push(next.min(max));
    }
    b.push(max);
    b.dedup();
    b
}

impl CudaRunner {
    pub fn new(model: LlamaModel<CudaBackend>, backend: CudaBackend) -> Self {
        let trace = ReplayTrace::from_env();
        Self { model, backend, sampler: Sampler::default(), graphs: None, kv: None, last_replayed: false, last_advanced: false, last_wait_us: 0, trace }
    }

    /// Forward on the device, leaving the logits there (None for an empty batch).
    fn forward_on_device(&mut self, batch: &ForwardBatch) -> Result<Option<DeviceLogits>> {
        self.last_replayed = false;
        self.last_advanced = false;
        if let Some(logits) = self.try_replay(batch)? {
            self.last_replayed = true;
            return Ok(Some(logits));
        }
        if let Some(trace) = self.trace.as_mut() {
            trace.sampled = None; // an eager forward is not "between replays"
        }
        self.forget_device_rows(); // it may overwrite the argmax keys
        self.backend.state().logits_on_device = true;
        let result = self.model.forward(batch);
        let last = {
            let mut st = self.backend.state();
            st.logits_on_device = false;
            st.last_logits.take()
        };
        result?;
        Ok(last)
    }

    /// Replay the bucket's graph when `batch` is a plain decode step that one can serve.
    fn try_replay(&mut self, batch: &ForwardBatch) -> Result<Option<DeviceLogits>> {
        let (Some(graphs), Some((num_blocks, block_size))) = (self.graphs.as_mut(), self.kv) else {
            return Ok(None);
        };
        let n = batch.tokens.len();
        let decode = n > 0
            && batch.seqs.len() == n
            && batch.logits_for.iter().enumerate().all(|(i, &r)| i == r)
            && batch.logits_for.len() == n
            && batch.seqs.iter().all(|s| s.len == 1);
        let Some(index) = graphs.buckets.iter().position(|(b, ..)| *b >= n) else {
            return Ok(None);
        };
        let (bucket, logits) = (graphs.buckets[index].0, graphs.buckets[index].2);
        if !decode {
            return Ok(None);
        }
        // The trace reads the clock only when it is on: a decode tick pays nothing for it otherwise.
        let tracing = self.trace.is_some();
        let mark = || tracing.then(Instant::now);
        let packing = mark();
        let lay = graphs.layout;
        let uploaded_tables = &graphs.staging.as_slice()[HEADER_WORDS + lay.tables..];
        let continues = graphs.device_rows.as_ref().is_some_and(|d| d.continues(batch, bucket, block_size, uploaded_tables));
        let mut copying = mark();
        if continues {
            graphs.device_rows.as_mut().expect("checked above").step();
            self.last_advanced = true;
        } else {
            graphs.device_rows = None;
            let plan = BatchPlan::new(batch, block_size, num_blocks, self.model.config().vocab_size)?;
            let Some(words) = graphs.pack_fresh(batch, &plan, bucket, num_blocks, block_size) else {
                return Ok(None);
            };
            copying = mark();
            // The context is bound by forward_and_sample, the only caller.
            self.backend.gpu().upload(graphs.meta.ptr(), &graphs.staging.as_slice()[..words])?;
        }
        let launching = mark();
        let Graph(graph) = &graphs.buckets[index].1;
        graph.launch().map_err(|e| Error::Device(format!("CUDA graph launch (batch {bucket}): {e:?}")))?;
        if let (Some(trace), Some(packing), Some(copying), Some(launching)) = (self.trace.as_mut(), packing, copying, launching) {
            trace.record_launch(n, [packing, copying, launching, Instant::now()]);
        }
        Ok(Some(logits))
    }

    /// The next replay uploads its metadata: the device's may no longer follow from the last replay.
    fn forget_device_rows(&mut self) {
        if let Some(graphs) = self.graphs.as_mut() {
            graphs.device_rows = None;
        }
    }

    fn capture(&mut self, max_batch_size: usize) -> Result<DecodeGraphs> {
        let (num_blocks, block_size) = self.kv.ok_or_else(|| Error::Protocol("allocate_kv_cache before capturing graphs".into()))?;
        let buckets: Vec<usize> =
            decode_buckets(max_batch_size.max(1)).into_iter().filter(|b| b.div_ceil(block_size) <= num_blocks).collect();
        let Some(&largest) = buckets.last() else {
            return Err(Error::Device("the KV cache is too small to capture any decode graph".into()));
        };
        let table_cap = largest * (num_blocks + 1).min(MAX_GRAPH_TABLE);
        let layout = MetaLayout::new(largest, largest, largest, table_cap);
        let gpu = self.backend.gpu();
        gpu.bind()?;
        let meta = gpu.alloc((HEADER_WORDS + layout.total) * 4)?;
        let staging = PinnedBuffer::new(gpu, HEADER_WORDS + layout.total)?;
        let advance = std::env::var_os("STEPLLM_NO_DECODE_ADVANCE").is_none();
        self.backend.reserve_attention(largest, self.model.attention_shape())?;
        self.backend.reserve_logits_rows(largest)?;
        gpu.synchronize()?;
        {
            let mut st = self.backend.state();
            st.capture = Some((meta.ptr() + 4 * HEADER_WORDS as u64, layout));
            st.keep_retired = true;
        }
        let mut captured = Vec::new();
        // Largest first: activations reach their final size in the first capture, so later ones reuse them.
        let first_kernel = advance.then_some((meta.ptr(), layout));
        for &b in buckets.iter().rev() {
            match self.capture_one(b, block_size, first_kernel) {
                Ok(entry) => captured.push(entry),
                Err(e) => {
                    self.backend.state().capture = None;
                    return Err(e);
                }
            }
        }
        self.backend.state().capture = None;
        captured.reverse();
        Ok(DecodeGraphs { buckets: captured, layout, meta, staging, table_cap, advance, device_rows: None })
    }

    /// Capture the graph of bucket `b`; `advance`: (header address, metadata layout) when it begins with the kernel
    /// that moves its metadata on.
    fn capture_one(&mut self, b: usize, block_size: usize, advance: Option<(u64, MetaLayout)>) -> Result<(usize, Graph, DeviceLogits)> {
        let dummy = ForwardBatch {
            tokens: vec![0; b],
            positions: (0..b).map(|i| (i % block_size) as u32).collect(),
            seqs: (0..b)
                .map(|i| SeqSlice { start: i, len: 1, past_len: i % block_size, block_table: vec![(i / block_size) as u32] })
                .collect(),
            logits_for: (0..b).collect(),
        };
        let stream = self.backend.gpu().stream.clone();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| Error::Device(format!("cuStreamBeginCapture: {e:?}")))?;
        let forward = match advance {
            Some((header, layout)) => self
                .backend
                .capture_decode_advance(header, header + 4 * HEADER_WORDS as u64, &layout, block_size)
                .and_then(|()| self.model.forward(&dummy)),
            None => self.model.forward(&dummy),
        };
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        forward?;
        let graph = graph
            .map_err(|e| Error::Device(format!("graph capture of batch {b}: {e:?}")))?
            .ok_or_else(|| Error::Device(format!("graph capture of batch {b} recorded nothing")))?;
        graph.upload().map_err(|e| Error::Device(format!("cuGraphUpload: {e:?}")))?;
        let logits = self.backend.state().last_logits.take().ok_or_else(|| Error::Device(format!("graph of batch {b} left no logits")))?;
        Ok((b, Graph(graph), logits))
    }
}

impl ModelRunner for CudaRunner {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize, dtype: KvCacheDtype) -> Result<()> {
        self.backend.gpu().bind()?;
        self.graphs = None; // they point into the old cache
        self.model.allocate_kv_cache(num_blocks, block_size, dtype)?;
        self.kv = Some((num_blocks, block_size));
        Ok(())
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>> {
        self.backend.gpu().bind()?;
        self.last_replayed = false;
        self.last_advanced = false;
        self.forget_device_rows();
        // Launches and the wait for the logits are not told apart here: the whole call counts as device wait.
        let started = Instant::now();
        let logits = self.model.forward(batch);
        self.last_wait_us = started.elapsed().as_micros() as u64;
        logits
    }

    fn forward_and_sample(&mut self, batch: &ForwardBatch, rows: &[RowContext]) -> Result<Vec<Sampled>> {
        if rows.len() != batch.logits_for.len() {
            return protocol(format!("{} sampling rows for {} logits rows", rows.len(), batch.logits_for.len()));
        }
        self.backend.gpu().bind()?;
        self.last_wait_us = 0;
        let Some(logits) = self.forward_on_device(batch)? else {
            return Ok(Vec::new());
        };
        let vocab = self.model.config().vocab_size;
        let sampled = self.sampler.sample(&self.backend, logits, vocab, rows);
        self.last_wait_us = self.sampler.last_wait_us;
        // The next replay reads these tokens from the device (the argmax keys, which the sampler also writes).
        match (&sampled, self.last_replayed, self.graphs.as_mut().and_then(|g| g.device_rows.as_mut())) {
            (Ok(tokens), true, Some(rows)) => rows.record_sampled(tokens.iter().map(|s| s.token_id)),
            _ => self.forget_device_rows(),
        }
        if let (Some(trace), true) = (self.trace.as_mut(), self.last_replayed) {
            trace.record_sampled();
        }
        sampled
    }

    /// Prompt positions are scored on the device beside the step's sampling: their logits never leave it.
    fn forward_sample_and_score(&mut self, batch: &ForwardBatch, rows: &[RowContext], scores: &[ScoreRow]) -> Result<(Vec<Sampled>, Vec<TokenLogprob>)> {
        if scores.is_empty() {
            return Ok((self.forward_and_sample(batch, rows)?, Vec::new()));
        }
        if rows.len() + scores.len() != batch.logits_for.len() {
            return protocol(format!(
                "{} sampling rows and {} scored rows for {} logits rows",
                rows.len(),
                scores.len(),
                batch.logits_for.len()
            ));
        }
        self.backend.gpu().bind()?;
        let logits = self.forward_on_device(batch)?.ok_or_else(|| Error::Device("a forward with scored rows left no logits".into()))?;
        let vocab = self.model.config().vocab_size;
        let sampled = self.sampler.sample(&self.backend, logits, vocab, rows)?;
        // The scored rows follow the sampled ones in `logits_for`.
        let scored: Vec<(usize, ScoreRow)> = scores.iter().enumerate().map(|(i, s)| (rows.len() + i, *s)).collect();
        let logprobs = self.sampler.score(&self.backend, logits.ptr, vocab, &scored)?;
        self.last_wait_us = self.sampler.last_wait_us;
        Ok((sampled, logprobs))
    }

    fn last_step_timing(&self) -> StepTiming {
        StepTiming { device_wait_us: self.last_wait_us, cuda_graph: self.last_replayed, metadata_on_device: self.last_advanced }
    }

    fn device_description(&self) -> String {
        self.model.device_description()
    }

    fn parameter_count(&self) -> usize {
        self.model.parameter_count()
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.backend.gpu().memory_in_use()
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    fn capture_decode_graphs(&mut self, max_batch_size: usize) -> Result<bool> {
        if self.kv.is_none() {
            return protocol("allocate_kv_cache must be called before capture_decode_graphs");
        }
        self.graphs = None;
        let start = Instant::now();
        match self.capture(max_batch_size) {
            Ok(graphs) => {
                if std::env::var_os("STEPLLM_VERBOSE").is_some() {
                    eprintln!(
                        "stepllm: captured {} decode graphs (batch {:?}) in {:.0} ms",
                        graphs.buckets.len(),
                        graphs.buckets.iter().map(|(b, ..)| *b).collect::<Vec<_>>(),
                        start.elapsed().as_secs_f64() * 1e3
                    );
                }
                self.graphs = Some(graphs);
                Ok(true)
            }
            Err(e) => {
                eprintln!("stepllm: warning: CUDA graph capture failed ({e}); decoding eagerly");
                let _ = self.backend.gpu().synchronize();
                Ok(false)
            }
        }
    }
}
