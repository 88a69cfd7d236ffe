//! Bad GGUF input must give `Error::Load` saying what broke, never a panic: hand-made corruptions,
//! every truncation of the fixtures, and seeded random byte damage.

use std::path::PathBuf;
use stepllm_core::model::loader::gguf::GgufModel;
use stepllm_core::model::loader::WeightSource;
use stepllm_core::Error;

fn fixture_bytes(name: &str) -> Vec<u8> {
    std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)).unwrap()
}

fn load_error(bytes: Vec<u8>) -> String {
    match GgufModel::from_bytes(bytes) {
        Err(Error::Load(msg)) => msg,
        Err(other) => panic!("expected a load error, got {other:?}"),
        Ok(_) => panic!("corrupt GGUF was accepted"),
    }
}

/// A minimal GGUF writer for hand-made files.
struct Builder {
    version: u32,
    kvs: Vec<u8>,
    kv_count: u64,
    infos: Vec<u8>,
    tensor_count: u64,
    data: Vec<u8>,
}

impl Builder {
    fn new() -> Self {
        Self { version: 3, kvs: vec![], kv_count: 0, infos: vec![], tensor_count: 0, data: vec![] }
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A key with a raw (type id, payload) value.
    fn kv(mut self, key: &str, type_id: u32, payload: &[u8]) -> Self {
        Self::string(&mut self.kvs, key);
        self.kvs.extend(type_id.to_le_bytes());
        self.kvs.extend(payload);
        self.kv_count += 1;
        self
    }

    fn f32_tensor(mut self, name: &str, dims: &[u64], offset: u64, values: &[f32]) -> Self {
        Self::string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| self.infos.extend(d.to_le_bytes()));
        self.infos.extend(0u32.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.tensor_count += 1;
        values.iter().for_each(|v| self.data.extend(v.to_le_bytes()));
        self
    }

    fn build(self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(self.tensor_count.to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(self.kvs);
        out.extend(self.infos);
        out.resize(out.len().div_ceil(32) * 32, 0);
        out.extend(self.data);
        out
    }
}

#[test]
fn gguf_hand_made_file_round_trips() {
    let bytes = Builder::new()
        .kv("general.architecture", 8, &[&4u64.to_le_bytes()[..], b"test"].concat())
        .f32_tensor("x", &[2, 1], 0, &[1.5, -2.0])
        .build();
    let model = GgufModel::from_bytes(bytes).unwrap();
    assert_eq!(model.dequantize("x").unwrap().data, vec![1.5, -2.0]);
    assert_eq!(model.dequantize("x").unwrap().shape, vec![1, 2]);
}

#[test]
fn gguf_bad_headers_are_named() {
    assert!(load_error(vec![]).contains("magic"));
    assert!(load_error(b"GGML\x03\0\0\0".to_vec()).contains("not a GGUF file"));
    let mut b = Builder::new();
    b.version = 1;
    assert!(load_error(b.build()).contains("version 1"));
    let mut b = Builder::new();
    b.version = 4;
    assert!(load_error(b.build()).contains("unsupported GGUF version 4"));
    let mut b = Builder::new();
    b.version = 3u32.swap_bytes();
    assert!(load_error(b.build()).contains("big-endian"));
    let msg = load_error(b"GGUF\x03\0\0\0\0\0".to_vec());
    assert!(msg.contains("truncated at byte 8") && msg.contains("tensor count"), "{msg}");
}

#[test]
fn gguf_version_2_is_read_like_version_3() {
    let mut bytes = fixture_bytes("tiny_llama.gguf");
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let model = GgufModel::from_bytes(bytes).unwrap();
    assert_eq!(model.version(), 2);
    assert!(model.config().is_ok());
}

#[test]
fn gguf_bad_metadata_is_named() {
    let huge_array = [&0u32.to_le_bytes()[..], &u64::MAX.to_le_bytes()].concat();
    let msg = load_error(Builder::new().kv("a", 9, &huge_array).build());
    assert!(msg.contains("claims") && msg.contains("\"a\""), "{msg}");
    let long_string = [&1_000_000u64.to_le_bytes()[..], b"abc"].concat();
    assert!(load_error(Builder::new().kv("s", 8, &long_string).build()).contains("claims 1000000 bytes"));
    assert!(load_error(Builder::new().kv("t", 13, &[]).build()).contains("unknown metadata value type 13"));
    assert!(load_error(Builder::new().kv("b", 7, &[2]).build()).contains("expected 0 or 1"));
    let dup = Builder::new().kv("k", 0, &[1]).kv("k", 0, &[2]).build();
    assert!(load_error(dup).contains("duplicate key"));
    let not_pow2 = Builder::new().kv("general.alignment", 4, &48u32.to_le_bytes()).build();
    assert!(load_error(not_pow2).contains("power of two"));
    let mut nested = vec![];
    for _ in 0..20 {
        nested.extend(9u32.to_le_bytes());
        nested.extend(1u64.to_le_bytes());
    }
    let msg = load_error(Builder::new().kv("n", 9, &nested).build());
    assert!(msg.contains("nested"), "{msg}");
    let mut counts = Builder::new().build();
    counts[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(load_error(counts).contains("metadata count"));
}

#[test]
fn gguf_bad_tensor_directory_is_named() {
    let msg = load_error(Builder::new().f32_tensor("x", &[4], 0, &[1.0]).build());
    assert!(msg.contains("\"x\"") && msg.contains("runs past the end"), "{msg}");
    let msg = load_error(Builder::new().f32_tensor("x", &[1], 4, &[1.0, 2.0]).build());
    assert!(msg.contains("not a multiple of the alignment"), "{msg}");
    let msg = load_error(Builder::new().f32_tensor("x", &[1, 1, 1, 1, 1], 0, &[1.0]).build());
    assert!(msg.contains("5 dimensions"), "{msg}");
    let msg = load_error(Builder::new().f32_tensor("x", &[u64::MAX, 2], 0, &[]).build());
    assert!(msg.contains("overflows"), "{msg}");
    let dup = Builder::new().f32_tensor("x", &[1], 0, &[1.0]).f32_tensor("x", &[1], 0, &[]).build();
    assert!(load_error(dup).contains("duplicate tensor name"));
    // A Q8_0 (type 8) tensor whose row is not whole blocks.
    let mut b = Builder::new().f32_tensor("q", &[31], 0, &[0.0; 8]);
    let type_at = b.infos.len() - 12;
    b.infos[type_at..type_at + 4].copy_from_slice(&8u32.to_le_bytes());
    assert!(load_error(b.build()).contains("not a multiple of the Q8_0 block size 32"));
    let mut b = Builder::new().f32_tensor("q", &[1], 0, &[0.0]);
    let type_at = b.infos.len() - 12;
    b.infos[type_at..type_at + 4].copy_from_slice(&9u32.to_le_bytes());
    assert!(load_error(b.build()).contains("unknown ggml type id 9"));
}

#[test]
fn gguf_config_and_vocab_errors_are_values() {
    let arch = |name: &str| [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
    let model = GgufModel::from_bytes(Builder::new().kv("general.architecture", 8, &arch("gpt9")).build()).unwrap();
    assert!(model.config().unwrap_err().to_string().contains("unsupported GGUF architecture \"gpt9\""));
    assert!(model.vocab().unwrap_err().to_string().contains("tokenizer.ggml.model"));
    let model = GgufModel::from_bytes(Builder::new().kv("general.architecture", 8, &arch("llama")).build()).unwrap();
    assert!(model.config().unwrap_err().to_string().contains("llama.embedding_length"));
    let wrong_type = Builder::new()
        .kv("general.architecture", 8, &arch("llama"))
        .kv("llama.embedding_length", 6, &1.5f32.to_le_bytes())
        .build();
    let msg = GgufModel::from_bytes(wrong_type).unwrap().config().unwrap_err().to_string();
    assert!(msg.contains("should be a non-negative integer, found f32"), "{msg}");
}

#[test]
fn gguf_every_truncation_is_an_error_not_a_panic() {
    for name in ["dequant.gguf", "tiny_llama.gguf"] {
        let bytes = fixture_bytes(name);
        let needed = {
            let model = GgufModel::from_bytes(bytes.clone()).unwrap();
            model.tensor_infos().iter().map(|t| model.data_offset() + t.offset + t.n_bytes).max().unwrap() as usize
        };
        for len in 0..bytes.len() {
            match GgufModel::from_bytes(bytes[..len].to_vec()) {
                Err(Error::Load(msg)) => assert!(!msg.is_empty()),
                Err(other) => panic!("{name}[..{len}]: unexpected error kind {other:?}"),
                Ok(_) => assert!(len >= needed, "{name} truncated to {len} of {needed} needed bytes was accepted"),
            }
        }
    }
}

/// xorshift64*: a fixed-seed generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Everything a loader would do with a file that opened.
fn exercise(model: &GgufModel) {
    for t in model.tensor_infos() {
        let _ = model.dequantize(&t.name);
    }
    let _ = model.config();
    let _ = model.vocab();
    let _ = model.chat_template();
    for layer in 0..3 {
        for part in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"] {
            let _ = model.tensor(&format!("model.layers.{layer}.{part}.weight"));
        }
    }
    let _ = model.tensor("model.embed_tokens.weight");
}

#[test]
fn gguf_random_damage_never_panics() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for name in ["dequant.gguf", "tiny_llama.gguf"] {
        let original = fixture_bytes(name);
        let header_len = GgufModel::from_bytes(original.clone()).unwrap().data_offset() as usize;
        for round in 0..1500 {
            let mut bytes = original.clone();
            // Damage mostly the header and directory, where the parser makes its decisions.
            for _ in 0..1 + rng.below(4) {
                let at = if round % 4 == 0 { rng.below(bytes.len()) } else { rng.below(header_len) };
                bytes[at] = match rng.below(3) {
                    0 => rng.next() as u8,
                    1 => bytes[at] ^ (1 << rng.below(8)),
                    _ => 0xFF,
                };
            }
            if let Ok(model) = GgufModel::from_bytes(bytes) {
                exercise(&model);
            }
        }
    }
}

#[test]
fn gguf_random_files_are_rejected() {
    let mut rng = Rng(42);
    for round in 0..3000 {
        let len = rng.below(512);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if round % 2 == 0 && len >= 8 {
            // A valid magic and version push the parser past the first checks.
            bytes[..4].copy_from_slice(b"GGUF");
            bytes[4..8].copy_from_slice(&3u32.to_le_bytes());
        }
        if let Ok(model) = GgufModel::from_bytes(bytes) {
            exercise(&model);
        }
    }
}

/// A llama header with 2 heads of 8 values (4 rotated pairs) and no weights: enough for `config()`.
fn llama_header() -> Builder {
    let string = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
    let u32s = [("embedding_length", 16u32), ("attention.head_count", 2), ("feed_forward_length", 8), ("block_count", 1),
        ("context_length", 64), ("vocab_size", 8)];
    let mut b = Builder::new().kv("general.architecture", 8, &string("llama"));
    for (key, value) in u32s {
        b = b.kv(&format!("llama.{key}"), 4, &value.to_le_bytes());
    }
    b.kv("llama.attention.layer_norm_rms_epsilon", 6, &1e-5f32.to_le_bytes())
}

fn config_error(b: Builder) -> String {
    GgufModel::from_bytes(b.build()).unwrap().config().unwrap_err().to_string()
}

#[test]
fn gguf_rope_scaling_is_read_or_refused_by_name() {
    use stepllm_core::model::RopeScaling;
    let string = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
    assert!(GgufModel::from_bytes(llama_header().build()).unwrap().config().unwrap().rope.is_plain());
    let linear = llama_header().kv("llama.rope.scaling.type", 8, &string("linear"));
    let config = GgufModel::from_bytes(linear.kv("llama.rope.scaling.factor", 6, &4f32.to_le_bytes()).build()).unwrap().config();
    assert_eq!(config.unwrap().rope.scaling, RopeScaling::Linear { factor: 4.0 });

    let msg = config_error(llama_header().kv("llama.rope.scaling.type", 8, &string("linear")));
    assert!(msg.contains("llama.rope.scaling.factor"), "{msg}");
    let msg = config_error(llama_header().kv("llama.rope.scaling.type", 8, &string("yarn")));
    assert!(msg.contains("rope scaling \"yarn\" is not supported"), "{msg}");
    let msg = config_error(llama_header().f32_tensor("rope_freqs.weight", &[3], 0, &[1.0, 2.0, 4.0]));
    assert!(msg.contains("rope_freqs.weight has 3 factors") && msg.contains("rotates 4 pairs"), "{msg}");
    let msg = config_error(llama_header().f32_tensor("rope_freqs.weight", &[4], 0, &[1.0, 2.0, 0.0, 4.0]));
    assert!(msg.contains("rope_freqs.weight holds 0"), "{msg}");
    let factors = GgufModel::from_bytes(llama_header().f32_tensor("rope_freqs.weight", &[4], 0, &[1.0, 2.0, 3.0, 4.0]).build());
    let rope = factors.unwrap().config().unwrap().rope;
    assert_eq!(rope.scaling, RopeScaling::FrequencyFactors(vec![1.0, 2.0, 3.0, 4.0].into()));
}

#[test]
fn gguf_tokenizer_models_are_read_or_refused_by_name() {
    let string = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
    let strings = |items: &[&str]| {
        let mut out = 8u32.to_le_bytes().to_vec();
        out.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| out.extend(string(s)));
        out
    };
    let vocab_error = |b: Builder| GgufModel::from_bytes(b.build()).unwrap().vocab().unwrap_err().to_string();
    let msg = vocab_error(llama_header().kv("tokenizer.ggml.model", 8, &string("bert")));
    assert!(msg.contains("\"bert\" is not supported") && msg.contains("SentencePiece"), "{msg}");
    let spm = || llama_header().kv("tokenizer.ggml.model", 8, &string("llama")).kv("tokenizer.ggml.tokens", 9, &strings(&["<unk>", "a"]));
    assert!(vocab_error(spm()).contains("\"tokenizer.ggml.scores\" is missing"));
    let mut scores = 6u32.to_le_bytes().to_vec();
    scores.extend(2u64.to_le_bytes());
    [0f32, -1.0].iter().for_each(|s| scores.extend(s.to_le_bytes()));
    let vocab = GgufModel::from_bytes(spm().kv("tokenizer.ggml.scores", 9, &scores).build()).unwrap().vocab().unwrap();
    assert_eq!((vocab.scores, vocab.add_space_prefix), (vec![0.0, -1.0], true));
}
