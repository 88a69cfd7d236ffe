//! Timing of the CPU forward on a random SmolLM2-135M-shaped model (30 layers, hidden 576, 9 heads, 3 KV
//! heads, intermediate 1536, vocab 49152, tied embeddings). Not a pass/fail test; run it with
//!
//!     cargo test --release -p stepllm-core --test golden_speed -- --ignored --nocapture
//!
//! Every weight dtype is timed in turn; `STEPLLM_SPEED_DTYPES=bf16,int8` picks some, and
//! `STEPLLM_SPEED_SHAPES=short` (or `long`) runs only the short-context (long-context) cases.
//!
//! `--release` matters: the test profile keeps debug assertions, whose overflow and pointer checks in the
//! matmul and attention inner loops cost about a factor of two.

use std::time::Instant;

use stepllm_core::backend::KvCacheDtype;
use stepllm_core::model::llama::build_runner_with;
use stepllm_core::model::loader::{HostTensor, WeightSource};
use stepllm_core::model::{Architecture, Device, ForwardBatch, ModelConfig, ModelRunner, SeqSlice, WeightDtype};

const BLOCK_SIZE: usize = 16;
const DECODE_STEPS: usize = 32;

fn smollm2_135m() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        rope: stepllm_core::model::Rope::plain(100000.0),
        rms_norm_eps: 1e-5,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        qkv_bias: false,
        qk_norm: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// Deterministic pseudo-random weights, shaped from the tensor name.
struct RandomWeights(ModelConfig);

impl RandomWeights {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let c = &self.0;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let shape = match name.rsplit_once(".weight")?.0.rsplit('.').next()? {
            "embed_tokens" => vec![c.vocab_size, h],
            "q_proj" => vec![c.q_dim(), h],
            "k_proj" | "v_proj" => vec![c.kv_dim(), h],
            "o_proj" => vec![h, c.q_dim()],
            "gate_proj" | "up_proj" => vec![i, h],
            "down_proj" => vec![h, i],
            "input_layernorm" | "post_attention_layernorm" | "norm" => vec![h],
            _ => return None,
        };
        Some(shape)
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&self, name: &str) -> stepllm_core::Result<HostTensor> {
        let shape = self.shape(name).expect("RandomWeights serves only the weights it lists");
        let is_norm = shape.len() == 1;
        let mut state = name.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |s, b| (s ^ b as u64).wrapping_mul(0x100_0000_01B3));
        let data = (0..shape.iter().product::<usize>())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5; // in [-0.5, 0.5)
                if is_norm { 1.0 + 0.2 * unit } else { 0.1 * unit }
            })
            .collect();
        Ok(HostTensor::new(shape, data))
    }

    fn has(&self, name: &str) -> bool {
        self.shape(name).is_some()
    }
}

/// `batch` sequences, each with its own contiguous run of blocks.
struct Sequences {
    batch: usize,
    prompt: usize,
    fed: Vec<usize>,
}

impl Sequences {
    fn table(&self, seq: usize) -> Vec<u32> {
        let per_seq = (self.prompt + DECODE_STEPS).div_ceil(BLOCK_SIZE);
        (0..per_seq).map(|b| (seq * per_seq + b) as u32).collect()
    }

    /// Feed `n` tokens to every sequence in one batch; ask for the last token's logits of each.
    fn step(&mut self, runner: &mut dyn ModelRunner, n: usize) {
        let mut batch = ForwardBatch::default();
        for s in 0..self.batch {
            let (start, past) = (batch.tokens.len(), self.fed[s]);
            batch.tokens.extend((0..n).map(|j| ((s * 7919 + (past + j) * 104729) % 49152) as u32));
            batch.positions.extend((past..past + n).map(|p| p as u32));
            batch.seqs.push(SeqSlice { start, len: n, past_len: past, block_table: self.table(s) });
            batch.logits_for.push(start + n - 1);
            self.fed[s] += n;
        }
        runner.forward(&batch).expect("forward");
    }
}

fn time_decode(runner: &mut dyn ModelRunner, batch: usize, prompt: usize) {
    let per_seq = (prompt + DECODE_STEPS).div_ceil(BLOCK_SIZE);
    runner.allocate_kv_cache(batch * per_seq, BLOCK_SIZE, KvCacheDtype::Auto).unwrap();
    let mut seqs = Sequences { batch, prompt, fed: vec![0; batch] };
    let started = Instant::now();
    seqs.step(runner, prompt);
    let prefill = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for _ in 0..DECODE_STEPS {
        seqs.step(runner, 1);
    }
    let decode = started.elapsed().as_secs_f64();
    eprintln!(
        "batch {batch}: prefill {batch}x{prompt} tokens in {:.3} s ({:.0} tok/s); then {DECODE_STEPS} decode steps: \
         {:.1} ms/step, {:.1} tok/s",
        prefill,
        (batch * prompt) as f64 / prefill,
        decode * 1e3 / DECODE_STEPS as f64,
        (batch * DECODE_STEPS) as f64 / decode
    );
}

#[test]
#[ignore = "timing, not a check: run with --ignored --nocapture"]
fn smollm2_135m_shaped_decode_speed() {
    let config = smollm2_135m();
    let dtypes = std::env::var("STEPLLM_SPEED_DTYPES").unwrap_or_else(|_| "f32,bf16,int8".into());
    let which = std::env::var("STEPLLM_SPEED_SHAPES").unwrap_or_default();
    for dtype in dtypes.split(',') {
        let dtype = WeightDtype::parse(dtype.trim()).unwrap();
        let started = Instant::now();
        let mut runner = build_runner_with(&config, &RandomWeights(config.clone()), Device::Cpu, Some(dtype)).unwrap();
        eprintln!(
            "loaded {} parameters on {} in {:.1} s",
            runner.parameter_count(),
            runner.device_description(),
            started.elapsed().as_secs_f64()
        );
        let shapes: &[(usize, usize)] = match which.as_str() {
            "short" => &[(1, 64), (8, 64)],
            "long" => &[(1, 1024), (8, 512)],
            _ => &[(1, 64), (8, 64), (1, 1024), (8, 512)],
        };
        for &(batch, prompt) in shapes {
            time_decode(runner.as_mut(), batch, prompt); // warm-up: sizes scratch buffers and touches the cache
            time_decode(runner.as_mut(), batch, prompt);
        }
    }
}
