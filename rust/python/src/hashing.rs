//! `__hash__` for value classes whose core types hold floats (so they derive PartialEq but not Hash). Equal
//! values hash equally: floats hash by bits with -0.0 folded onto 0.0 (NaN never compares equal anyway).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use stepllm_core::coordinator::{Config, ParallelConfig};
use stepllm_core::request::{
    GenerationRequest, GenerationResponse, Message, Prompt, SamplingParams, TokenLogprob,
};
use stepllm_core::state::context_cache::ContextCacheConfig;
use stepllm_core::step::{AdmissionIntent, BatchResult, StepResult, TokenDelta};

pub trait HashValue {
    fn hash_value(&self, h: &mut DefaultHasher);
}

/// The Python hash of a value.
pub fn py_hash<T: HashValue + ?Sized>(v: &T) -> u64 {
    let mut h = DefaultHasher::new();
    v.hash_value(&mut h);
    h.finish()
}

macro_rules! via_hash {
    ($($t:ty),*) => {$(
        impl HashValue for $t {
            fn hash_value(&self, h: &mut DefaultHasher) {
                self.hash(h)
            }
        }
    )*};
}
via_hash!(
    u32,
    u64,
    usize,
    bool,
    String,
    str,
    Message,
    stepllm_core::ids::SequenceIdentity,
    stepllm_core::ids::ResidentRef,
    stepllm_core::request::FinishReason,
    stepllm_core::step::SequenceWork,
    stepllm_core::step::ScheduledSequenceDescriptor,
    stepllm_core::step::StepExecution,
    stepllm_core::model::WeightDtype,
    stepllm_core::backend::KvCacheDtype
);

// Floats hash their bits, with -0.0 as 0.0 (they compare equal).
macro_rules! float_hash {
    ($($t:ty),*) => {$(
        impl HashValue for $t {
            fn hash_value(&self, h: &mut DefaultHasher) {
                let bits = if *self == 0.0 { 0 } else { self.to_bits() };
                bits.hash(h)
            }
        }
    )*};
}
float_hash!(f32, f64);

impl<T: HashValue> HashValue for Option<T> {
    fn hash_value(&self, h: &mut DefaultHasher) {
        match self {
            None => 0u8.hash(h),
            Some(v) => {
                1u8.hash(h);
                v.hash_value(h)
            }
        }
    }
}

impl<T: HashValue> HashValue for Vec<T> {
    fn hash_value(&self, h: &mut DefaultHasher) {
        self.len().hash(h);
        for v in self {
            v.hash_value(h);
        }
    }
}

impl<A: HashValue, B: HashValue> HashValue for (A, B) {
    fn hash_value(&self, h: &mut DefaultHasher) {
        self.0.hash_value(h);
        self.1.hash_value(h);
    }
}

/// Hash each listed field in order.
macro_rules! fields {
    ($t:ty: $($f:ident),*) => {
        impl HashValue for $t {
            fn hash_value(&self, h: &mut DefaultHasher) {
                $(self.$f.hash_value(h);)*
            }
        }
    };
}

fields!(TokenLogprob: token_id, logprob, top);

impl HashValue for TokenDelta {
    fn hash_value(&self, h: &mut DefaultHasher) {
        self.token_ids.as_slice().hash(h);
        self.text.as_str().hash(h);
        self.logprobs.hash_value(h);
        self.prompt_logprobs.hash_value(h);
    }
}
fields!(SamplingParams: max_tokens, temperature, top_k, top_p, min_p, seed, repetition_penalty, presence_penalty,
    frequency_penalty, logit_bias, logprobs, stop, stop_token_ids, ignore_eos, skip_special_tokens, min_tokens,
    include_stop_str_in_output, prompt_logprobs);
fields!(GenerationRequest: prompt, sampling, add_special_tokens, cache_salt, lora_name);
fields!(GenerationResponse: request_id, original_index, prompt_ids, output_ids, output_text, finish_reason, stop_reason,
    logprobs, prompt_logprobs, cached_prompt_tokens, error);
fields!(BatchResult: identity, prompt_ids, output_ids, text, finish_reason, stop_reason, logprobs, prompt_logprobs,
    cached_prompt_tokens, error);
fields!(StepResult: ok, work, step_id, participants, execution, deltas, finished, published_prefix);
fields!(AdmissionIntent: request_id, original_index, request, prompt_ids);
fields!(ParallelConfig: tensor_parallel_size, devices);
fields!(Config: model, device, max_batch_size, max_prefill_tokens, kv_cache_tokens, gpu_memory_utilization, block_size, max_model_len, context_cache,
    parallel, dtype, kv_cache_dtype);

impl HashValue for Prompt {
    fn hash_value(&self, h: &mut DefaultHasher) {
        match self {
            Prompt::Text(t) => {
                0u8.hash(h);
                t.hash_value(h)
            }
            Prompt::Messages(m) => {
                1u8.hash(h);
                m.hash_value(h)
            }
            Prompt::TokenIds(ids) => {
                2u8.hash(h);
                ids.hash_value(h)
            }
        }
    }
}

impl HashValue for ContextCacheConfig {
    fn hash_value(&self, h: &mut DefaultHasher) {
        self.enabled.hash(h);
        format!("{:?}/{:?}", self.lookup, self.commit).hash(h);
        self.max_records.hash(h);
    }
}
