//! A .gguf file: weights, config, tokenizer and chat template all from one file.

use std::path::Path;
use std::sync::Arc;

use super::gguf::GgufModel;
use crate::error::Result;
use crate::model::Checkpoint;
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;

/// Config, tokenizer and chat template from the file's metadata; the weights stay in the file until read.
pub fn open(path: &Path) -> Result<Checkpoint> {
    let gguf = GgufModel::open(path)?;
    let config = gguf.config()?;
    let vocab = gguf.vocab()?;
    let special = |id: Option<u32>| id.and_then(|i| vocab.tokens.get(i as usize).cloned());
    let (bos, eos) = (special(vocab.bos_id), special(vocab.eos_id));
    let chat_template = gguf.chat_template().map(|t| ChatTemplate::new(&t, bos, eos)).transpose()?;
    let tokenizer = Arc::new(Tokenizer::from_bpe_vocab(vocab)?);
    Ok(Checkpoint { config, tokenizer, chat_template, weights: Box::new(gguf), source: path.display().to_string() })
}
