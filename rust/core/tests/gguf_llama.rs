//! A tiny llama GGUF whose q/k rows were permuted as llama.cpp's convert_hf_to_gguf.py does
//! (tests/fixtures/gguf/make_gguf_fixtures.py): config, vocabulary, names and the un-permutation.

mod common;

use serde_json::Value;
use std::path::PathBuf;
use stepllm_core::model::loader::gguf::{gguf_tensor_name, unpermute_rotary_rows, GgufModel};
use stepllm_core::model::loader::{HostTensor, WeightSource};
use stepllm_core::model::Architecture;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)
}

fn open() -> (GgufModel, Value) {
    let model = GgufModel::open(fixture("tiny_llama.gguf")).unwrap();
    let expected = serde_json::from_str(&std::fs::read_to_string(fixture("tiny_llama_expected.json")).unwrap()).unwrap();
    (model, expected)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

#[test]
fn gguf_config_comes_from_llama_metadata() {
    let (model, want) = open();
    let cfg = model.config().unwrap();
    let c = &want["config"];
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    assert_eq!(cfg.architecture, Architecture::Llama);
    assert_eq!(cfg.vocab_size, n("vocab_size"));
    assert_eq!(cfg.hidden_size, n("hidden_size"));
    assert_eq!(cfg.intermediate_size, n("intermediate_size"));
    assert_eq!(cfg.num_layers, n("num_layers"));
    assert_eq!(cfg.num_heads, n("num_heads"));
    assert_eq!(cfg.num_kv_heads, n("num_kv_heads"));
    assert_eq!(cfg.head_dim, n("head_dim"));
    assert_eq!(cfg.max_position_embeddings, n("max_position_embeddings"));
    assert_eq!(cfg.rope.theta, c["rope_theta"].as_f64().unwrap() as f32);
    assert_eq!(cfg.rms_norm_eps, c["rms_norm_eps"].as_f64().unwrap() as f32);
    assert!(!cfg.tie_word_embeddings, "the fixture has output.weight");
    assert!(!cfg.qkv_bias && !cfg.qk_norm);
    assert_eq!(cfg.bos_token_id, Some(1));
    assert_eq!(cfg.eos_token_ids, vec![2]);
}

#[test]
fn gguf_vocab_and_chat_template() {
    let (model, want) = open();
    let vocab = model.vocab().unwrap();
    let v = &want["vocab"];
    let strings = |x: &Value| x.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect::<Vec<_>>();
    assert_eq!(vocab.tokens, strings(&v["tokens"]));
    assert_eq!(vocab.merges, strings(&v["merges"]));
    let types: Vec<i32> = v["token_types"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap() as i32).collect();
    assert_eq!(vocab.token_types, types);
    assert_eq!((vocab.bos_id, vocab.eos_id, vocab.add_bos), (Some(1), Some(2), true));
    assert_eq!(vocab.pre.as_deref(), Some("smollm"));
    assert_eq!(model.chat_template().as_deref(), want["chat_template"].as_str());
}

#[test]
fn gguf_tensor_parallel_parts_read_alone_equal_parts_cut_from_the_whole_tensor() {
    let (model, _) = open();
    common::assert_parts_read_alone_equal_parts_cut(&model, &model.config().unwrap());
}

#[test]
fn gguf_q_and_k_come_back_in_hugging_face_order() {
    let (model, want) = open();
    for (hf_name, w) in want["weights"].as_object().unwrap() {
        let got = model.tensor(hf_name).unwrap();
        let shape: Vec<usize> = w["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        assert_eq!(got.shape, shape, "{hf_name}");
        assert_eq!(*got.values(), floats(&w["values"]), "{hf_name} differs from the original Hugging Face weight");
        // Layer 1 is stored as Q8_0: its blocks move with the rows.
        if hf_name.contains("layers.1.") {
            let blocks = got.blocks.as_ref().unwrap_or_else(|| panic!("{hf_name} keeps its Q8_0 blocks"));
            assert!(got.values_in_blocks(), "{hf_name}: loaded as blocks alone");
            assert!(blocks.rebuild(&floats(&w["values"])), "{hf_name}: un-permuted blocks rebuild the un-permuted weights");
        }
    }
    // The stored (GGUF) layout really is permuted, so the test above is not vacuous.
    let stored = model.dequantize("blk.0.attn_q.weight").unwrap();
    assert_ne!(stored.data, floats(&want["weights"]["model.layers.0.self_attn.q_proj.weight"]["values"]));
}

#[test]
fn gguf_other_weights_are_renamed_and_transposed_only() {
    let (model, _) = open();
    let v = model.tensor("model.layers.1.self_attn.v_proj.weight").unwrap();
    let stored = model.dequantize("blk.1.attn_v.weight").unwrap();
    assert_eq!((v.values(), &v.blocks), (stored.values(), &stored.blocks));
    assert_eq!(v.shape, vec![16, 32], "HF [out, in] from GGUF ne [in, out]");
    let expected_shapes: &[(&str, &[usize])] = &[
        ("model.embed_tokens.weight", &[40, 32]),
        ("lm_head.weight", &[40, 32]),
        ("model.norm.weight", &[32]),
        ("model.layers.0.self_attn.q_proj.weight", &[32, 32]),
        ("model.layers.0.self_attn.k_proj.weight", &[16, 32]),
        ("model.layers.0.self_attn.o_proj.weight", &[32, 32]),
        ("model.layers.0.mlp.gate_proj.weight", &[48, 32]),
        ("model.layers.0.mlp.up_proj.weight", &[48, 32]),
        ("model.layers.0.mlp.down_proj.weight", &[32, 48]),
        ("model.layers.1.input_layernorm.weight", &[32]),
        ("model.layers.1.post_attention_layernorm.weight", &[32]),
    ];
    for (name, shape) in expected_shapes {
        assert!(model.has(name), "{name}");
        assert_eq!(model.tensor(name).unwrap().shape, *shape, "{name}");
    }
    for absent in ["model.layers.2.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias", "model.bogus", ""] {
        assert!(!model.has(absent), "{absent}");
        assert!(model.tensor(absent).is_err(), "{absent}");
    }
}

#[test]
fn gguf_hugging_face_names_map_to_gguf_names() {
    let cases = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
        ("model.layers.12.self_attn.k_proj.bias", "blk.12.attn_k.bias"),
        ("model.layers.3.self_attn.v_proj.weight", "blk.3.attn_v.weight"),
        ("model.layers.3.self_attn.o_proj.weight", "blk.3.attn_output.weight"),
        ("model.layers.3.self_attn.q_norm.weight", "blk.3.attn_q_norm.weight"),
        ("model.layers.3.self_attn.k_norm.weight", "blk.3.attn_k_norm.weight"),
        ("model.layers.3.mlp.gate_proj.weight", "blk.3.ffn_gate.weight"),
        ("model.layers.3.mlp.up_proj.weight", "blk.3.ffn_up.weight"),
        ("model.layers.3.mlp.down_proj.weight", "blk.3.ffn_down.weight"),
        ("model.layers.3.input_layernorm.weight", "blk.3.attn_norm.weight"),
        ("model.layers.3.post_attention_layernorm.weight", "blk.3.ffn_norm.weight"),
    ];
    for (hf, gguf) in cases {
        assert_eq!(gguf_tensor_name(hf).as_deref(), Some(gguf), "{hf}");
    }
    for bad in ["model.layers.x.mlp.up_proj.weight", "model.layers..mlp.up_proj.weight", "model.layers.0.mlp.up_proj.scale"] {
        assert_eq!(gguf_tensor_name(bad), None, "{bad}");
    }
}

#[test]
fn gguf_unpermute_by_hand() {
    // One head of 4 rows stored as llama.cpp orders them: [r0, r2, r1, r3] (pairs (0,2) and (1,3) adjacent).
    let stored = HostTensor::new(vec![4, 2], vec![0., 0.5, 2., 2.5, 1., 1.5, 3., 3.5]);
    let hf = unpermute_rotary_rows(stored, 1).unwrap();
    assert_eq!(hf.data, vec![0., 0.5, 1., 1.5, 2., 2.5, 3., 3.5]);
    // Two heads, 1-D (a bias): each head un-permuted on its own.
    let bias = HostTensor::new(vec![8], vec![0., 2., 1., 3., 4., 6., 5., 7.]);
    assert_eq!(unpermute_rotary_rows(bias, 2).unwrap().data, (0..8).map(|x| x as f32).collect::<Vec<_>>());
    assert!(unpermute_rotary_rows(HostTensor::new(vec![6, 1], vec![0.; 6]), 2).is_err(), "odd head_dim");
    assert!(unpermute_rotary_rows(HostTensor::new(vec![4, 1], vec![0.; 4]), 0).is_err());
}
