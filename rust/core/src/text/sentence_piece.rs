//! A SentencePiece BPE vocabulary from GGUF metadata (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral,
//! TinyLlama and their relatives) as a Hugging Face tokenizer that splits text as llama.cpp does.
//!
//! SentencePiece merges the adjacent pair whose joined piece scores highest. A BPE whose merge rules are every
//! split of every piece, ranked by the joined piece's score, makes the same choices (this is also how
//! transformers converts such a model to a tokenizer.json). Spaces become "▁", and each run of text gets a
//! leading "▁" (`tokenizer.ggml.add_space_prefix`): at the start and after every special token, as in llama.cpp.
//! A character outside the vocabulary becomes the byte tokens `<0xXX>` of its UTF-8 encoding.

use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::Sequence as NormalizerSequence;
use tokenizers::{DecoderWrapper, NormalizerWrapper};

use super::tokenizer::{BpeVocab, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED};
use crate::error::{load_err, Error, Result};

/// SentencePiece's whitespace mark, U+2581.
const SPACE: &str = "\u{2581}";

pub fn model(v: &BpeVocab) -> Result<BPE> {
    if v.scores.len() != v.tokens.len() {
        return load_err(format!(
            "GGUF tokenizer.ggml.scores has {} entries but tokenizer.ggml.tokens has {}; a SentencePiece vocabulary \
             needs one score per token",
            v.scores.len(),
            v.tokens.len()
        ));
    }
    let vocab: tokenizers::models::bpe::Vocab = v.tokens.iter().enumerate().map(|(id, t)| (t.clone(), id as u32)).collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges_by_score(v)).byte_fallback(true).fuse_unk(true);
    if let Some(unk) = v.unk_id.and_then(|id| v.tokens.get(id as usize)) {
        builder = builder.unk_token(unk.clone());
    }
    builder.build().map_err(|e| Error::Load(format!("cannot build the SentencePiece model from the GGUF vocabulary: {e}")))
}

/// Every split of every mergeable piece into two pieces of the vocabulary, highest-scoring joined piece first
/// (ties: the joined piece's id, then the halves' ids).
fn merges_by_score(v: &BpeVocab) -> Vec<(String, String)> {
    let ids: HashMap<&str, u32> = v.tokens.iter().enumerate().map(|(id, t)| (t.as_str(), id as u32)).collect();
    let mergeable = |id: usize| matches!(v.token_types.get(id).copied().unwrap_or(TOKEN_TYPE_NORMAL), TOKEN_TYPE_NORMAL | TOKEN_TYPE_USER_DEFINED);
    let mut ranked = Vec::new();
    for (id, piece) in v.tokens.iter().enumerate().filter(|(id, _)| mergeable(*id)) {
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                ranked.push((v.scores[id], id as u32, l, r));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3))));
    ranked.into_iter().map(|(_, _, l, r)| (v.tokens[l as usize].clone(), v.tokens[r as usize].clone())).collect()
}

/// Spaces to "▁", with a leading "▁" on each run of text when the vocabulary asks for it.
pub fn normalizer(add_space_prefix: bool) -> Result<NormalizerWrapper> {
    let spaces = Replace::new(" ", SPACE).map_err(|e| Error::Internal(format!("space normalizer: {e}")))?;
    let mut steps: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        steps.push(Prepend::new(SPACE.to_string()).into());
    }
    steps.push(spaces.into());
    Ok(NormalizerSequence::new(steps).into())
}

/// "▁" back to spaces, byte tokens back to their bytes, and the prefix space of the text dropped.
pub fn decoder(add_space_prefix: bool) -> Result<DecoderWrapper> {
    let spaces = Replace::new(SPACE, " ").map_err(|e| Error::Internal(format!("space decoder: {e}")))?;
    let mut steps: Vec<DecoderWrapper> = vec![spaces.into(), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        steps.push(Strip::new(' ', 1, 0).into());
    }
    Ok(DecoderSequence::new(steps).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tokenizer::{VocabModel, TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN};

    fn vocab(pieces: &[(&str, f32, i32)]) -> BpeVocab {
        BpeVocab {
            model: VocabModel::SentencePiece,
            tokens: pieces.iter().map(|p| p.0.to_string()).collect(),
            scores: pieces.iter().map(|p| p.1).collect(),
            token_types: pieces.iter().map(|p| p.2).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn merges_follow_the_joined_pieces_score_and_skip_special_pieces() {
        let v = vocab(&[
            ("<unk>", 0.0, TOKEN_TYPE_UNKNOWN),
            ("<s>", 0.0, TOKEN_TYPE_CONTROL),
            ("<0x41>", 0.0, TOKEN_TYPE_BYTE),
            ("a", -10.0, TOKEN_TYPE_NORMAL),
            ("b", -11.0, TOKEN_TYPE_NORMAL),
            ("ab", -2.0, TOKEN_TYPE_NORMAL),
            ("ba", -1.0, TOKEN_TYPE_NORMAL),
            ("aba", -3.0, TOKEN_TYPE_NORMAL),
            ("<", -12.0, TOKEN_TYPE_NORMAL),
            ("s>", -13.0, TOKEN_TYPE_NORMAL),
        ]);
        let pair = |l: &str, r: &str| (l.to_string(), r.to_string());
        // "aba" splits two ways, both after "ba" and "ab"; "<s>" is a control piece and merges nothing.
        assert_eq!(merges_by_score(&v), vec![pair("b", "a"), pair("a", "b"), pair("a", "ba"), pair("ab", "a")]);
    }

    #[test]
    fn a_score_per_token_is_required() {
        let mut v = vocab(&[("a", 0.0, TOKEN_TYPE_NORMAL)]);
        v.scores.clear();
        assert!(model(&v).unwrap_err().to_string().contains("tokenizer.ggml.scores has 0 entries"));
    }
}
