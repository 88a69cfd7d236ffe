//! A Hugging Face model directory: config.json, safetensors weights, tokenizer.json, chat template.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::error::{load_err, Result};
use crate::model::Checkpoint;
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;

/// Config, tokenizer and chat template read; the safetensors weights mapped, to be read when loaded.
pub fn open(dir: &Path) -> Result<Checkpoint> {
    let config = super::safetensors::load_hf_config(dir)?;
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.exists() {
        return load_err(format!("{} has no tokenizer.json; stepllm needs the fast-tokenizer file", dir.display()));
    }
    let tokenizer = Arc::new(Tokenizer::from_file(&tokenizer_path)?);
    let chat_template = read_chat_template(dir)?;
    let weights = Box::new(super::safetensors::SafetensorsSource::open(dir)?);
    Ok(Checkpoint { config, tokenizer, chat_template, weights, source: dir.display().to_string() })
}

/// The chat template from chat_template.jinja or tokenizer_config.json, with its bos/eos token strings.
fn read_chat_template(dir: &Path) -> Result<Option<ChatTemplate>> {
    let tc: Value = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
        Ok(text) => serde_json::from_str(&text).or_else(|e| load_err(format!("tokenizer_config.json is not valid JSON: {e}")))?,
        Err(_) => Value::Null,
    };
    let source = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
        Ok(s) => Some(s),
        Err(_) => template_from_config(&tc["chat_template"]),
    };
    let Some(source) = source else { return Ok(None) };
    Ok(Some(ChatTemplate::new(&source, token_string(&tc["bos_token"]), token_string(&tc["eos_token"]))?))
}

/// `chat_template` is a string or a list of {name, template}; the "default" entry wins.
fn template_from_config(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => items
            .iter()
            .find(|t| t["name"] == "default")
            .or(items.first())
            .and_then(|t| t["template"].as_str().map(str::to_string)),
        _ => None,
    }
}

/// Special token entries are a string or {"content": ...}.
fn token_string(v: &Value) -> Option<String> {
    v.as_str().map(str::to_string).or_else(|| v["content"].as_str().map(str::to_string))
}
