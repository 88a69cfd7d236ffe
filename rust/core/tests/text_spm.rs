//! A SentencePiece vocabulary in a GGUF (`tokenizer.ggml.model = "llama"`, as llama.cpp stores Llama 2,
//! Mistral and TinyLlama) against llama.cpp's own tokenization of the same file, and against SentencePiece's
//! decoding (tests/fixtures/gguf/make_spm_fixture.py).

use std::path::PathBuf;

use serde_json::Value;
use stepllm_core::model::loader::gguf::GgufModel;
use stepllm_core::text::tokenizer::{Tokenizer, VocabModel};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load() -> (Tokenizer, Value) {
    let vocab = GgufModel::open(fixture("spm_vocab.gguf")).unwrap().vocab().unwrap();
    assert_eq!(vocab.model, VocabModel::SentencePiece);
    assert!(vocab.add_space_prefix && vocab.add_bos);
    let expected = serde_json::from_str(&std::fs::read_to_string(fixture("spm_vocab_expected.json")).unwrap()).unwrap();
    (Tokenizer::from_bpe_vocab(vocab).unwrap(), expected)
}

#[test]
fn spm_gguf_encodes_as_llama_cpp_does() {
    let (tok, expected) = load();
    assert_eq!(tok.vocab_size() as u64, expected["vocab_size"].as_u64().unwrap());
    let cases = expected["cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), ids(&case["ids"]), "encoding {text:?}");
        assert_eq!(tok.encode(text, true).unwrap(), ids(&case["with_bos"]), "encoding {text:?} with BOS");
    }
    // The cases must exercise merges, byte fallback and control tokens in text.
    let all: Vec<u32> = cases.iter().flat_map(|c| ids(&c["ids"])).collect();
    let byte_tokens = expected["byte_tokens"].as_u64().unwrap() as u32;
    assert!(all.iter().any(|&id| (3..3 + byte_tokens).contains(&id)), "no byte-fallback token");
    assert!(all.iter().any(|&id| id >= 3 + byte_tokens && tok.id_to_token(id).unwrap().chars().count() > 2), "no merge");
    assert!(all.contains(&1) && all.contains(&2), "no control token");
}

/// Decoding follows SentencePiece and transformers, which drop the prefix space (llama.cpp keeps it).
#[test]
fn spm_gguf_decodes_as_sentencepiece_does() {
    let (tok, expected) = load();
    for case in expected["cases"].as_array().unwrap() {
        let (text, ids) = (case["text"].as_str().unwrap(), ids(&case["ids"]));
        if let Some(decoded) = case["decoded"].as_str() {
            assert_eq!(tok.decode(&ids, false).unwrap(), decoded, "decoding {text:?}");
            assert_eq!(decoded, text, "round trip of {text:?}");
        }
    }
    // Control tokens in text split it, and each part gets its prefix space, as llama.cpp encodes it.
    let ids = tok.encode("<s>Hello</s> world", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello  world");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<s> Hello</s>  world");
}

#[test]
fn spm_byte_tokens_stand_for_their_bytes() {
    let (tok, _) = load();
    let ids = tok.encode("🙂", false).unwrap();
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect();
    // "▁" then the emoji's four UTF-8 bytes, each its own byte token.
    assert_eq!(&bytes[bytes.len() - 4..], "🙂".as_bytes());
    assert_eq!(tok.decode(&ids, false).unwrap(), "🙂");
    // A piece keeps its leading space, which decoding it alone would drop.
    let hello = tok.encode("Hello world", false).unwrap();
    let spelled: Vec<u8> = hello.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect();
    assert_eq!(spelled, b" Hello world");
}
