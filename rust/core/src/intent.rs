//! Admission stage 1: validate, apply the chat template, tokenize. Touches no resident state.

use std::sync::Arc;

use crate::error::{invalid, Result};
use crate::ids::RequestId;
use crate::request::{GenerationRequest, Prompt, SamplingParams};
use crate::step::AdmissionIntent;
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;

pub struct IntentBuilder {
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub kv_capacity_tokens: usize,
}

impl IntentBuilder {
    pub fn build(&self, request: GenerationRequest, request_id: RequestId, original_index: u32) -> Result<AdmissionIntent> {
        if request_id == 0 {
            return invalid("request_id must be non-zero (zero is reserved for 'no request')");
        }
        request.sampling.validate()?;
        if let Some(name) = &request.lora_name {
            return invalid(format!(
                "lora_name {name:?}: this runtime serves no LoRA adapters (none can be loaded); leave lora_name unset"
            ));
        }
        let prompt_ids = self.prompt_ids(&request)?;  // token ids checked here
        self.check_sampling_ids_and_lengths(&request.sampling, prompt_ids.len())?;
        Ok(AdmissionIntent { request_id, original_index, request, prompt_ids })
    }

    /// An intent built elsewhere (another coordinator's session), checked against this model when it is admitted.
    pub fn check_intent(&self, intent: &AdmissionIntent) -> Result<()> {
        self.check_token_ids("prompt token", intent.prompt_ids.iter().copied())?;
        self.check_sampling_ids_and_lengths(&intent.request.sampling, intent.prompt_ids.len())
    }

    fn check_sampling_ids_and_lengths(&self, sampling: &SamplingParams, prompt_len: usize) -> Result<()> {
        self.check_token_ids("logit_bias", sampling.logit_bias.iter().map(|(t, _)| *t))?;
        self.check_token_ids("stop_token_ids", sampling.stop_token_ids.iter().copied())?;
        self.check_lengths(prompt_len, sampling.max_tokens)
    }

    /// The prompt's token ids as the model will see them.
    pub fn prompt_ids(&self, request: &GenerationRequest) -> Result<Vec<u32>> {
        let ids = match &request.prompt {
            Prompt::Text(text) => {
                if text.is_empty() {
                    return invalid("prompt is empty: give at least one character or token");
                }
                self.tokenizer.encode(text, request.add_special_tokens)?
            }
            Prompt::Messages(messages) => {
                if messages.is_empty() {
                    return invalid("messages is empty: give at least one message");
                }
                let template = self.chat_template.as_ref().ok_or_else(|| {
                    crate::Error::InvalidRequest("this model has no chat template; pass a text prompt instead".into())
                })?;
                let text = template.render(messages, true)?;
                // The template already wrote any BOS it wants, as transformers' apply_chat_template assumes.
                self.tokenizer.encode(&text, false)?
            }
            Prompt::TokenIds(ids) => {
                self.check_token_ids("prompt token", ids.iter().copied())?;
                ids.clone()
            }
        };
        if ids.is_empty() {
            return invalid("prompt tokenizes to zero tokens");
        }
        Ok(ids)
    }

    /// Whether the whole generate budget (prompt + max_tokens, in whole KV blocks) fits the KV cache at all.
    pub fn check_fits_kv_cache(&self, intent: &AdmissionIntent, block_size: usize) -> Result<()> {
        let tokens = intent.prompt_ids.len().saturating_add(intent.request.sampling.max_tokens);
        if tokens.div_ceil(block_size).saturating_mul(block_size) > self.kv_capacity_tokens {
            return invalid(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the KV cache ({} tokens); lower max_tokens or raise kv_cache_tokens",
                intent.prompt_ids.len(),
                intent.request.sampling.max_tokens,
                self.kv_capacity_tokens
            ));
        }
        Ok(())
    }

    fn check_token_ids(&self, what: &str, ids: impl Iterator<Item = u32>) -> Result<()> {
        for id in ids {
            if id as usize >= self.vocab_size {
                return invalid(format!("{what} id {id} is outside the vocabulary (size {})", self.vocab_size));
            }
        }
        Ok(())
    }

    fn check_lengths(&self, prompt_len: usize, max_tokens: usize) -> Result<()> {
        let limit = self.max_model_len.min(self.kv_capacity_tokens);
        if prompt_len >= limit {
            return invalid(format!(
                "prompt has {prompt_len} tokens but at most {} fit (max_model_len {}, KV cache {} tokens)",
                limit - 1,
                self.max_model_len,
                self.kv_capacity_tokens
            ));
        }
        if prompt_len.saturating_add(max_tokens) > self.max_model_len {
            return invalid(format!(
                "prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length {}; lower max_tokens",
                self.max_model_len
            ));
        }
        Ok(())
    }
}
