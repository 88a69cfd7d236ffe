//! A .gguf file: weights, config, tokenizer and chat template all from one file.

use std::path::Path;
use std::sync::Arc;

use super::gguf::GgufModel;
use crate::error::Result;
use crate::model::{llama, Device, LoadProgress, LoadedModel, ProgressSource, WeightDtype};
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;

pub fn load(path: &Path, device: Device, dtype: Option<WeightDtype>, progress: Option<LoadProgress>) -> Result<LoadedModel> {
    let gguf = GgufModel::open(path)?;
    let (config, tokenizer, chat_template) = load_metadata(&gguf)?;
    let counted = ProgressSource::new(&gguf, &config, progress);
    let runner = llama::build_runner_with(&config, &counted, device, dtype)?;
    counted.finish();
    Ok(LoadedModel { config, runner, tokenizer, chat_template, source: path.display().to_string() })
}

/// Everything but the weights: config, tokenizer and chat template, all from the file's metadata.
pub fn load_metadata(gguf: &GgufModel) -> Result<(crate::model::ModelConfig, Arc<Tokenizer>, Option<ChatTemplate>)> {
    let config = gguf.config()?;
    let vocab = gguf.vocab()?;
    let special = |id: Option<u32>| id.and_then(|i| vocab.tokens.get(i as usize).cloned());
    let (bos, eos) = (special(vocab.bos_id), special(vocab.eos_id));
    let chat_template = gguf.chat_template().map(|t| ChatTemplate::new(&t, bos, eos)).transpose()?;
    let tokenizer = Arc::new(Tokenizer::from_bpe_vocab(vocab)?);
    Ok((config, tokenizer, chat_template))
}
