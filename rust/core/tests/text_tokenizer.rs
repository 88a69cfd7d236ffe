//! Tokenizer against the committed fixture (a byte-level BPE trained by Hugging Face tokenizers) and the
//! ids transformers produced with it (tests/fixtures/llama/expected.json).

use std::path::PathBuf;

use serde_json::Value;
use stepllm_core::request::Message;
use stepllm_core::text::tokenizer::{BpeVocab, Tokenizer, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL};
use stepllm_core::text::ChatTemplate;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama").join(name)
}

fn read_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The fixture's vocabulary laid out as a GGUF file would store it.
fn fixture_as_gguf_vocab() -> BpeVocab {
    let json = read_json("tokenizer.json");
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (token, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = token.clone();
    }
    let mut token_types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
    for added in json["added_tokens"].as_array().unwrap() {
        if added["special"].as_bool().unwrap() {
            token_types[added["id"].as_u64().unwrap() as usize] = TOKEN_TYPE_CONTROL;
        }
    }
    let merges = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pair| format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()))
        .collect();
    BpeVocab { tokens, merges, token_types, bos_id: Some(0), eos_id: Some(2), pre: Some("gpt2".into()), ..Default::default() }
}

const SAMPLES: &[&str] = &[
    "The capital of France is Paris.",
    "Hello, world! How are you today?",
    "naïve café 東京 🙂 — numbers 0123456789",
    "  two  spaces\tand\ttabs\n\nnew lines  ",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "it's we'll they've I'm",
    "",
];

#[test]
fn gguf_style_vocab_encodes_exactly_like_the_tokenizer_json() {
    let from_json = Tokenizer::from_file(&fixture("tokenizer.json")).unwrap();
    let from_vocab = Tokenizer::from_bpe_vocab(fixture_as_gguf_vocab()).unwrap();
    assert_eq!(from_vocab.vocab_size(), from_json.vocab_size());
    for text in SAMPLES {
        let expected = from_json.encode(text, true).unwrap();
        assert_eq!(from_vocab.encode(text, true).unwrap(), expected, "encoding {text:?}");
        assert_eq!(from_vocab.decode(&expected, false).unwrap(), *text, "decoding {text:?}");
    }
    for id in 0..3 {
        assert!(from_vocab.is_special(id) && from_json.is_special(id));
    }
    assert!(!from_vocab.is_special(3));
    assert_eq!(from_vocab.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(from_vocab.id_to_token(1).as_deref(), Some("<|im_start|>"));
}

#[test]
fn prompts_tokenize_and_greedy_ids_decode_as_in_transformers() {
    let tok = Tokenizer::from_file(&fixture("tokenizer.json")).unwrap();
    let config = read_json("tokenizer_config.json");
    let template =
        ChatTemplate::new(config["chat_template"].as_str().unwrap(), None, Some("<|im_end|>".into())).unwrap();
    for row in read_json("expected.json")["rows"].as_array().unwrap() {
        let prompt_text = match row["kind"].as_str().unwrap() {
            "raw" => row["prompt"].as_str().unwrap().to_string(),
            _ => {
                let messages: Vec<Message> = row["prompt"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| Message {
                        role: m["role"].as_str().unwrap().into(),
                        content: m["content"].as_str().unwrap().into(),
                    })
                    .collect();
                template.render(&messages, true).unwrap()
            }
        };
        assert_eq!(tok.encode(&prompt_text, false).unwrap(), ids_of(&row["prompt_ids"]), "{prompt_text:?}");
        // Random-weight greedy output is mostly partial UTF-8: decoding must be lossy exactly like Python's.
        let greedy = ids_of(&row["greedy_ids"]);
        assert_eq!(tok.decode(&greedy, false).unwrap(), row["greedy_text"].as_str().unwrap());
    }
}
