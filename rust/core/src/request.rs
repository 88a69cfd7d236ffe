//! What a caller asks for and what it gets back.

use crate::error::{invalid, Result};
use crate::ids::RequestId;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The prompt: raw text, a conversation rendered through the model's chat template, or token ids as given.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
    TokenIds(Vec<u32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_tokens: usize,
    /// 0.0 means greedy.
    pub temperature: f32,
    /// 0 means disabled.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// Seeded draws depend only on (seed, absolute position); None draws from a per-request random seed.
    pub seed: Option<u64>,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    /// Return this many top alternatives per generated token (None: no logprobs at all).
    pub logprobs: Option<usize>,
    /// Return each prompt token's logprob and this many top alternatives at its position (vLLM's
    /// prompt_logprobs; None: none). Such a request computes its whole prompt, cached or not.
    pub prompt_logprobs: Option<usize>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// As vLLM: until this many tokens are generated, EOS and `stop_token_ids` cannot be sampled and stop
    /// strings that end inside that text do not stop the request.
    pub min_tokens: usize,
    /// Keep the stop string that ended the request at the end of its text (vLLM's include_stop_str_in_output).
    pub include_stop_str_in_output: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            skip_special_tokens: true,
            min_tokens: 0,
            include_stop_str_in_output: false,
        }
    }
}

/// Most alternatives a caller may ask for per token (OpenAI allows 20).
pub const MAX_LOGPROBS: usize = 20;

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self { max_tokens, temperature: 0.0, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Range checks that need no model; vocabulary checks happen at intent building.
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == 0 {
            return invalid("max_tokens must be at least 1");
        }
        if self.min_tokens > self.max_tokens {
            return invalid(format!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                self.min_tokens, self.max_tokens
            ));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return invalid(format!("temperature must be a finite number >= 0 (0 means greedy), got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        check_finite_range("min_p", self.min_p, 0.0, 1.0)?;
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return invalid(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        check_finite_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_finite_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        for (name, n) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if let Some(n) = n.filter(|&n| n > MAX_LOGPROBS) {
                return invalid(format!("{name} must be at most {MAX_LOGPROBS}, got {n}"));
            }
        }
        for &(_, bias) in &self.logit_bias {
            check_finite_range("logit_bias value", bias, -100.0, 100.0)?;
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return invalid("stop strings must not be empty");
        }
        Ok(())
    }
}

fn check_finite_range(name: &str, v: f32, lo: f32, hi: f32) -> Result<()> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(())
    } else {
        invalid(format!("{name} must be in [{lo}, {hi}], got {v}"))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Add the tokenizer's BOS (when it has one) before raw text prompts.
    pub add_special_tokens: bool,
    /// Extra keys mixed into context-cache block hashes: requests with different salts never share blocks.
    pub cache_salt: Option<String>,
    pub lora_name: Option<String>,
}

impl GenerationRequest {
    pub fn new(prompt: Prompt, sampling: SamplingParams) -> Self {
        Self { prompt, sampling, add_special_tokens: true, cache_salt: None, lora_name: None }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    Eos,
    Length,
    Stop,
    Cancelled,
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
        }
    }
}

/// Log-probability of a chosen token plus the top alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationResponse {
    pub request_id: RequestId,
    pub original_index: u32,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub output_text: String,
    pub finish_reason: FinishReason,
    /// The stop string or stop token that ended generation, if one did.
    pub stop_reason: Option<String>,
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// With `prompt_logprobs`: one entry per prompt token, None for the first (vLLM's layout).
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub cached_prompt_tokens: usize,
    pub error: Option<String>,
}
