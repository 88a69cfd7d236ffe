//! A model whose weights a GGUF stored in quantized blocks keeps those blocks on the CPU (exact f32 format) and
//! computes exactly what it computes from the same weights held as f32: bit-identical logits, for every block type
//! we read, in prefill (many rows: the widening path) and decode, at a fraction of the bytes.

use stepllm_core::backend::KvCacheDtype;
use stepllm_core::model::llama::build_runner_with;
use stepllm_core::model::loader::gguf_quant::{dequantize, GgmlType};
use stepllm_core::model::loader::{HostTensor, WeightSource};
use stepllm_core::model::{Architecture, Device, ForwardBatch, ModelConfig, ModelRunner, SeqSlice, WeightDtype};
use stepllm_core::test_support::random_quantized;

const BLOCK_SIZE: usize = 16;

/// Widths that are whole K-quant super-blocks (256), two layers.
fn config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        rope: stepllm_core::model::Rope::plain(10000.0),
        rms_norm_eps: 1e-5,
        max_position_embeddings: 256,
        tie_word_embeddings: true,
        qkv_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![2],
    }
}

/// The type each matrix is stored in: every type we read. Layer 0's q, k (Q4_K) and v (Q6_K) stack into one
/// matrix of two group sizes, as in a Q4_K_M file; its gate (Q2_K) and up (Q4_K) into one of 4-bit levels with
/// f32 constants; layer 1's o (Q4_1) is 4-bit with f16 constants.
fn ggml_type(name: &str) -> GgmlType {
    use GgmlType::*;
    let (layer0, layer1) = match name.rsplit('.').nth(1).unwrap() {
        "embed_tokens" => (Q8_0, Q8_0),
        "q_proj" => (Q4_K, Q5_0),
        "k_proj" => (Q4_K, Q5_1),
        "v_proj" => (Q6_K, Q8_0),
        "o_proj" => (Q5_K, Q4_1),
        "gate_proj" => (Q2_K, IQ4_NL),
        "up_proj" => (Q4_K, Q3_K),
        "down_proj" => (IQ4_XS, Q4_0),
        other => panic!("no type for {other}"),
    };
    if name.contains("layers.1.") {
        layer1
    } else {
        layer0
    }
}

/// Random blocks of each matrix's type, dequantized as the GGUF loader does; `keep_blocks` false hands over the
/// f32 values alone, so the CPU backend keeps them as f32.
struct QuantizedWeights {
    config: ModelConfig,
    keep_blocks: bool,
}

impl QuantizedWeights {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let c = &self.config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Some(match name.strip_suffix(".weight")?.rsplit('.').next()? {
            "embed_tokens" => vec![c.vocab_size, h],
            "q_proj" => vec![c.q_dim(), h],
            "k_proj" | "v_proj" => vec![c.kv_dim(), h],
            "o_proj" => vec![h, c.q_dim()],
            "gate_proj" | "up_proj" => vec![i, h],
            "down_proj" => vec![h, i],
            "input_layernorm" | "post_attention_layernorm" | "norm" => vec![h],
            _ => return None,
        })
    }
}

impl WeightSource for QuantizedWeights {
    fn tensor(&self, name: &str) -> stepllm_core::Result<HostTensor> {
        let shape = self.shape(name).expect("QuantizedWeights serves only the weights it lists");
        let seed = name.bytes().fold(17u64, |s, b| s.wrapping_mul(31).wrapping_add(b as u64));
        if shape.len() == 1 {
            let norm = (0..shape[0]).map(|j| 1.0 + ((j as u64).wrapping_mul(seed) % 7) as f32 / 20.0).collect();
            return Ok(HostTensor::new(shape, norm));
        }
        let (ty, n) = (ggml_type(name), shape.iter().product());
        let (data, blocks) = dequantize(ty, &random_quantized(ty, n, seed), n)?;
        Ok(HostTensor { shape, data, blocks: blocks.filter(|_| self.keep_blocks) })
    }

    fn has(&self, name: &str) -> bool {
        self.shape(name).is_some()
    }
}

/// The logits of a prefill of two prompts (23 rows) and of one decode step of both (2 rows).
fn logits(runner: &mut dyn ModelRunner) -> Vec<Vec<f32>> {
    runner.allocate_kv_cache(8, BLOCK_SIZE, KvCacheDtype::Auto).unwrap();
    let prompts: [Vec<u32>; 2] = [(0..9).map(|t| t * 31 % 300).collect(), (0..14).map(|t| (t * 57 + 3) % 300).collect()];
    let table = |s: usize| vec![4 * s as u32, 4 * s as u32 + 1];
    let mut prefill = ForwardBatch::default();
    for (s, prompt) in prompts.iter().enumerate() {
        let start = prefill.tokens.len();
        prefill.tokens.extend(prompt);
        prefill.positions.extend(0..prompt.len() as u32);
        prefill.seqs.push(SeqSlice { start, len: prompt.len(), past_len: 0, block_table: table(s) });
        prefill.logits_for.extend(start..start + prompt.len());
    }
    let mut decode = ForwardBatch::default();
    for (s, prompt) in prompts.iter().enumerate() {
        decode.tokens.push(7 + s as u32);
        decode.positions.push(prompt.len() as u32);
        decode.seqs.push(SeqSlice { start: s, len: 1, past_len: prompt.len(), block_table: table(s) });
        decode.logits_for.push(s);
    }
    vec![runner.forward(&prefill).unwrap(), runner.forward(&decode).unwrap()]
}

#[test]
fn a_model_kept_in_its_blocks_gives_the_f32_logits_bit_for_bit() {
    let config = config();
    let load = |keep_blocks| {
        let weights = QuantizedWeights { config: config.clone(), keep_blocks };
        build_runner_with(&config, &weights, Device::Cpu, Some(WeightDtype::F32)).unwrap()
    };
    let (mut blocked, mut plain) = (load(true), load(false));
    let (ours, f32s) = (logits(blocked.as_mut()), logits(plain.as_mut()));
    for (step, (a, b)) in ["prefill", "decode"].iter().zip(ours.iter().zip(&f32s)) {
        assert!(b.iter().all(|v| v.is_finite()), "{step}: the f32 model's logits are finite");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "{step}: blocked logits differ from f32's");
    }
    assert_eq!(blocked.parameter_count(), plain.parameter_count());
    let (bytes, f32_bytes) = (blocked.weight_bytes(), plain.weight_bytes());
    println!("weights: {bytes} bytes in blocks, {f32_bytes} as f32");
    if blocked.device_description().contains("portable kernels") {
        assert_eq!(bytes, f32_bytes, "the portable kernels keep f32");
    } else {
        assert!(bytes * 3 < f32_bytes, "blocks take {bytes} bytes against f32's {f32_bytes}: they were not kept");
    }
}
