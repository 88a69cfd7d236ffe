//! Golden test: our forward against Hugging Face transformers' logits for tiny random-weight Llama (plain and
//! with Llama 3.1's RoPE scaling), Qwen2 and Qwen3 checkpoints (tests/fixtures, made by make_fixtures.py). The
//! same token sequences are fed in four schedules: (a) one prefill, (b) prefill then one-token decode steps,
//! (c) every fixture row in ONE ragged batch per step with staggered starts (decodes beside prefills), (d) the
//! prompt in two chunks. All of them go through a paged KV cache with 4-token blocks and scrambled,
//! non-contiguous block tables.

use std::path::{Path, PathBuf};

use serde_json::Value;
use stepllm_core::backend::KvCacheDtype;
use stepllm_core::model::llama::build_runner;
use stepllm_core::model::loader::{load_hf_config, SafetensorsSource, WeightSource};
use stepllm_core::model::{load_model, Device, ForwardBatch, ModelRunner, RopeScaling, SeqSlice};
use stepllm_core::Error;

const BLOCK_SIZE: usize = 4;
const BLOCKS_PER_SEQ: usize = 10;
const NUM_BLOCKS: usize = 50;
const TOLERANCE: f32 = 1e-4;

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

/// One fixture row: the sequence fed is prompt + greedy minus its last token; reference row i holds the
/// logits predicting token i + 1.
struct Case {
    prompt_len: usize,
    greedy: Vec<u32>,
    fed: Vec<u32>,
    reference: Vec<f32>,
}

struct Fixture {
    name: &'static str,
    runner: Box<dyn ModelRunner>,
    vocab: usize,
    cases: Vec<Case>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn load_fixture(name: &'static str) -> Fixture {
    let dir = fixture_dir(name);
    let config = load_hf_config(&dir).unwrap();
    let weights = SafetensorsSource::open(&dir).unwrap();
    fixture_with_runner(name, build_runner(&config, &weights, Device::Cpu).unwrap())
}

/// Fixture `name`'s expected outputs, computed by `runner` (which may have loaded the model another way).
fn fixture_with_runner(name: &'static str, runner: Box<dyn ModelRunner>) -> Fixture {
    let dir = fixture_dir(name);
    let config = load_hf_config(&dir).unwrap();
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let logits = SafetensorsSource::open_files(&[dir.join("expected.safetensors")]).unwrap();
    let rows = expected["rows"].as_array().unwrap();
    let cases = rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let (prompt, greedy) = (ids(&row["prompt_ids"]), ids(&row["greedy_ids"]));
            let mut fed = prompt.clone();
            fed.extend_from_slice(&greedy[..greedy.len() - 1]);
            let reference = logits.tensor(&format!("logits_{i}")).unwrap();
            assert_eq!(reference.shape, vec![fed.len(), config.vocab_size], "{name} logits_{i} shape");
            Case { prompt_len: prompt.len(), greedy, fed, reference: reference.data }
        })
        .collect();
    Fixture { name, runner, vocab: config.vocab_size, cases }
}

/// Steps of `(case, token count)` pairs.
type Schedule = Vec<Vec<(usize, usize)>>;
type MakeSchedule = fn(&Fixture) -> Schedule;

/// A step feeds `(case, token count)` pairs, all in one ForwardBatch; returns every case's logits, one row
/// per fed token, in sequence order.
fn run_schedule(fx: &mut Fixture, steps: &Schedule) -> Vec<Vec<f32>> {
    fx.runner.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, KvCacheDtype::Auto).unwrap();
    let mut fed_so_far = vec![0usize; fx.cases.len()];
    let mut logits = vec![Vec::new(); fx.cases.len()];
    for step in steps {
        let mut batch = ForwardBatch::default();
        for &(c, n) in step {
            let past = fed_so_far[c];
            let start = batch.tokens.len();
            batch.tokens.extend_from_slice(&fx.cases[c].fed[past..past + n]);
            batch.positions.extend((past..past + n).map(|p| p as u32));
            let table = &block_table(c)[..(past + n).div_ceil(BLOCK_SIZE)];
            batch.seqs.push(SeqSlice { start, len: n, past_len: past, block_table: table.to_vec() });
            fed_so_far[c] += n;
        }
        batch.logits_for = (0..batch.tokens.len()).collect();
        let out = fx.runner.forward(&batch).unwrap();
        assert_eq!(out.len(), batch.tokens.len() * fx.vocab);
        for (seq, &(c, _)) in batch.seqs.iter().zip(step) {
            logits[c].extend_from_slice(&out[seq.start * fx.vocab..(seq.start + seq.len) * fx.vocab]);
        }
    }
    logits
}

/// Scrambled physical blocks, distinct per case, so tables are non-contiguous and out of order.
fn block_table(case: usize) -> Vec<u32> {
    (0..BLOCKS_PER_SEQ).map(|i| ((case * BLOCKS_PER_SEQ + i) * 37 + 11) as u32 % NUM_BLOCKS as u32).collect()
}

fn check(fx: &Fixture, schedule: &str, logits: &[Vec<f32>]) {
    let mut worst = 0.0f32;
    for (c, (case, ours)) in fx.cases.iter().zip(logits).enumerate() {
        assert_eq!(ours.len(), case.reference.len(), "{} {schedule}: case {c} row count", fx.name);
        for (pos, (row, reference)) in ours.chunks(fx.vocab).zip(case.reference.chunks(fx.vocab)).enumerate() {
            let bound = TOLERANCE * reference.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let error = row.iter().zip(reference).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(error <= bound, "{} {schedule}: case {c} position {pos}: max |diff| {error} > {bound}", fx.name);
            worst = worst.max(error / bound * TOLERANCE);
        }
        for (j, &expected) in case.greedy.iter().enumerate() {
            let row = &ours[(case.prompt_len - 1 + j) * fx.vocab..][..fx.vocab];
            assert_eq!(argmax(row), expected, "{} {schedule}: case {c} greedy token {j}", fx.name);
        }
    }
    eprintln!("{} {schedule}: ok, worst relative error {worst:.2e}", fx.name);
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0 as u32
}

fn whole_sequence_prefill(fx: &Fixture) -> Schedule {
    fx.cases.iter().enumerate().map(|(c, case)| vec![(c, case.fed.len())]).collect()
}

fn prefill_then_decode(fx: &Fixture) -> Schedule {
    let mut steps = Vec::new();
    for (c, case) in fx.cases.iter().enumerate() {
        steps.push(vec![(c, case.prompt_len)]);
        steps.extend((case.prompt_len..case.fed.len()).map(|_| vec![(c, 1)]));
    }
    steps
}

/// Case c starts at step c: its first step prefills its whole prompt while earlier cases decode.
fn staggered_ragged(fx: &Fixture) -> Schedule {
    let mut remaining: Vec<usize> = fx.cases.iter().map(|case| case.fed.len()).collect();
    let mut steps = Vec::new();
    for step in 0.. {
        let mut batch = Vec::new();
        for (c, case) in fx.cases.iter().enumerate() {
            if c == step {
                batch.push((c, case.prompt_len));
            } else if c < step && remaining[c] > 0 {
                batch.push((c, 1));
            }
        }
        if batch.is_empty() && step >= fx.cases.len() {
            break;
        }
        batch.iter().for_each(|&(c, n)| remaining[c] -= n);
        steps.push(batch);
    }
    let everyone_mixed = steps.iter().any(|s| s.len() == fx.cases.len() && s.iter().any(|&(_, n)| n > 1));
    assert!(everyone_mixed, "schedule should hold one step with every case, prefill beside decode");
    steps
}

/// The prompt in two prefill chunks, then the rest of the sequence as one more multi-token chunk.
fn chunked_prefill(fx: &Fixture) -> Schedule {
    let mut steps = Vec::new();
    for (c, case) in fx.cases.iter().enumerate() {
        let first = (case.prompt_len / 2).max(1);
        steps.push(vec![(c, first)]);
        if case.prompt_len > first {
            steps.push(vec![(c, case.prompt_len - first)]);
        }
        steps.push(vec![(c, case.fed.len() - case.prompt_len)]);
    }
    steps
}

fn check_all_schedules(name: &'static str) {
    check_all_schedules_of(load_fixture(name));
}

fn check_all_schedules_of(mut fx: Fixture) {
    let schedules: [(&str, MakeSchedule); 4] = [
        ("(a) whole-sequence prefill", whole_sequence_prefill),
        ("(b) prefill + paged decode", prefill_then_decode),
        ("(c) one ragged batch, staggered", staggered_ragged),
        ("(d) two-chunk prefill", chunked_prefill),
    ];
    for (label, make) in schedules {
        let steps = make(&fx);
        let logits = run_schedule(&mut fx, &steps);
        check(&fx, label, &logits);
    }
}

#[test]
fn llama_matches_transformers() {
    check_all_schedules("llama");
}

#[test]
fn qwen2_matches_transformers() {
    check_all_schedules("qwen2");
}

#[test]
fn qwen3_matches_transformers() {
    check_all_schedules("qwen3");
}

/// Llama 3.1's RoPE scaling (the "llama3" rope_type), with an original context short enough that the head's
/// pairs fall in all three of its bands.
#[test]
fn llama3_rope_scaling_matches_transformers() {
    check_all_schedules("llama3");
}

/// The same model as a GGUF converted the way llama.cpp converts Llama 3.1 (tests/fixtures/gguf/llama3_rope.gguf):
/// the scaling arrives as the per-frequency divisors of rope_freqs.weight.
#[test]
fn llama3_gguf_with_rope_freqs_matches_transformers() {
    let gguf = fixture_dir("gguf").join("llama3_rope.gguf");
    let loaded = load_model(&gguf, Device::Cpu, None, None).unwrap();
    assert!(matches!(loaded.config.rope.scaling, RopeScaling::FrequencyFactors(_)), "{:?}", loaded.config.rope);
    check_all_schedules_of(fixture_with_runner("llama3", loaded.runner));
}

/// The inverse frequencies themselves, against the ones transformers computed for the fixture.
#[test]
fn llama3_inverse_frequencies_are_transformers_own() {
    let dir = fixture_dir("llama3");
    let config = load_hf_config(&dir).unwrap();
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let reference: Vec<f32> =
        expected["rope_inv_freq"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert!(!config.rope.is_plain());
    assert_eq!(config.rope.inverse_frequencies(config.head_dim), reference);
    let plain = stepllm_core::model::Rope::plain(config.rope.theta).inverse_frequencies(config.head_dim);
    assert_eq!(plain.iter().zip(&reference).filter(|(p, r)| p == r).count(), 1, "only the shortest wavelength is kept");
}

/// Where no GPU is usable, asking for CUDA is an `Error::Device` value, never a panic.
#[test]
fn cuda_without_a_gpu_is_a_device_error() {
    let dir = fixture_dir("llama");
    let config = load_hf_config(&dir).unwrap();
    let weights = SafetensorsSource::open(&dir).unwrap();
    if let Err(err) = build_runner(&config, &weights, Device::Cuda(0)) {
        assert!(matches!(err, Error::Device(_)), "{err}");
    }
}

#[test]
fn shape_mismatch_names_the_tensor() {
    let dir = fixture_dir("qwen2");
    let mut config = load_hf_config(&dir).unwrap();
    config.intermediate_size += 1;
    let weights = SafetensorsSource::open(&dir).unwrap();
    let err = build_runner(&config, &weights, Device::Cpu).err().expect("shapes disagree");
    let msg = err.to_string();
    assert!(matches!(err, Error::Load(_)), "{msg}");
    assert!(msg.contains("model.layers.0.mlp.gate_proj.weight") && msg.contains("[129, 64]"), "{msg}");
}

#[test]
fn forward_before_kv_cache_is_a_protocol_error() {
    let dir = fixture_dir("qwen3");
    let config = load_hf_config(&dir).unwrap();
    let mut runner = build_runner(&config, &SafetensorsSource::open(&dir).unwrap(), Device::Cpu).unwrap();
    let batch = ForwardBatch {
        tokens: vec![5],
        positions: vec![0],
        seqs: vec![SeqSlice { start: 0, len: 1, past_len: 0, block_table: vec![0] }],
        logits_for: vec![0],
    };
    assert!(matches!(runner.forward(&batch), Err(Error::Protocol(_))));
    runner.allocate_kv_cache(2, 4, KvCacheDtype::Auto).unwrap();
    assert_eq!(runner.forward(&batch).unwrap().len(), config.vocab_size);
}
