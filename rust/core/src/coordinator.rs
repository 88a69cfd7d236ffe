//! RuntimeCoordinator: loads a model, owns the stepper, and begins stepped sessions or runs whole batches.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::KvCacheDtype;
use crate::error::{invalid, protocol, Result};
use crate::ids::RequestId;
use crate::intent::IntentBuilder;
use crate::model::{Checkpoint, Device, LoadProgress, LoadedModel, WeightDtype};
use crate::request::{FinishReason, GenerationRequest, GenerationResponse, Prompt};
use crate::state::context_cache::ContextCacheConfig;
use crate::state::PoolCounts;
use crate::prefill_group::{continue_seated_prompts, left_prompts_seated, seat_prefill_group, step_seated_group, DEFAULT_MAX_PREFILL_TOKENS};
use crate::step::{AdmissionIntent, ImmutableDecodeBatch, StepResult};
use crate::parallel::rank::{RankCommand, RankGroup, RankReply};
use crate::stepped::{materialize, SteppedRequest};
use crate::stepper::{RuntimeStepper, StepperConfig};
use crate::stepper_handle::StepperHandle;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelConfig {
    pub tensor_parallel_size: usize,
    pub devices: Vec<usize>,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self { tensor_parallel_size: 1, devices: Vec::new() }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// A Hugging Face directory or a .gguf file; None means the default model (resolved by the Python layer).
    pub model: String,
    /// "cpu", "cuda", "cuda:N" or "auto".
    pub device: String,
    /// Resident slots: the most sequences live at once.
    pub max_batch_size: usize,
    /// Most prompt tokens one step computes. The schedulers (engine, dispatch) prefill prompts together up to it;
    /// a longer prompt is computed in chunks of it over several steps (chunked prefill), while running requests
    /// keep decoding in the same forwards.
    pub max_prefill_tokens: usize,
    /// KV cache budget in tokens (rounded up to whole blocks).
    pub kv_cache_tokens: usize,
    pub block_size: usize,
    /// Longest prompt + output; None means the model's max_position_embeddings.
    pub max_model_len: Option<usize>,
    pub context_cache: ContextCacheConfig,
    pub parallel: ParallelConfig,
    /// How weights are kept: None is the device's default (f32 on the CPU, bf16 on CUDA).
    pub dtype: Option<WeightDtype>,
    /// How the KV cache stores K and V (fp8 on CUDA only).
    pub kv_cache_dtype: KvCacheDtype,
}

impl Config {
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            device: "auto".into(),
            max_batch_size: 8,
            max_prefill_tokens: DEFAULT_MAX_PREFILL_TOKENS,
            kv_cache_tokens: 16384,
            block_size: 16,
            max_model_len: None,
            context_cache: ContextCacheConfig::default(),
            parallel: ParallelConfig::default(),
            dtype: None,
            kv_cache_dtype: KvCacheDtype::Auto,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.max_batch_size == 0 {
            return invalid("max_batch_size must be at least 1");
        }
        if self.max_prefill_tokens == 0 {
            return invalid("max_prefill_tokens must be at least 1");
        }
        if self.block_size == 0 || self.block_size > 1024 {
            return invalid(format!("block_size must be in 1..=1024, got {}", self.block_size));
        }
        if self.kv_cache_tokens < self.block_size {
            return invalid(format!("kv_cache_tokens ({}) must hold at least one block ({})", self.kv_cache_tokens, self.block_size));
        }
        let tp = self.parallel.tensor_parallel_size;
        if tp == 0 {
            return invalid("tensor_parallel_size must be at least 1");
        }
        if !self.parallel.devices.is_empty() && self.parallel.devices.len() != tp {
            return invalid(format!(
                "parallel.devices lists {} devices but tensor_parallel_size is {tp}; list one device per rank or none",
                self.parallel.devices.len()
            ));
        }
        let device = parse_device(&self.device)?;
        if self.kv_cache_dtype == KvCacheDtype::Fp8 && device == Device::Cpu {
            return invalid(format!(
                "kv_cache_dtype=\"fp8\" needs the CUDA backend, but device {:?} is the CPU here (the CPU keeps its KV \
                 cache in f32); use kv_cache_dtype=\"auto\" or a CUDA device",
                self.device
            ));
        }
        if matches!(device, Device::Cuda(_)) && !cuda_available() {
            return Err(crate::Error::Device(format!(
                "device {:?} needs a CUDA GPU, but none is usable here (no driver or GPU, or stepllm was built \
                 without CUDA kernels); use device=\"cpu\" or \"auto\"",
                self.device
            )));
        }
        Ok(())
    }
}

/// Resolve "cpu" / "cuda" / "cuda:N" / "auto".
pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(if cuda_available() { Device::Cuda(0) } else { Device::Cpu }),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Ok(Device::Cuda(n)),
            None => invalid(format!("unknown device {other:?}; use \"cpu\", \"cuda\", \"cuda:N\" or \"auto\"")),
        },
    }
}

/// device="auto" picks the GPU, unless the CUDA kernels cannot run this model: then it runs on the CPU, with a
/// warning that says why (device="cuda" refuses such a model instead). Under tensor parallelism it picks the GPUs
/// when the ranks' devices are listed or enough GPUs are `visible`, and the CPU otherwise.
fn auto_device(config: &Config, device: Device, model: &crate::model::ModelConfig, visible: usize) -> Result<Device> {
    if device == Device::Cpu {
        return Ok(device);
    }
    let world = config.parallel.tensor_parallel_size;
    let why = if world > 1 && config.parallel.devices.is_empty() && visible < world {
        Some(format!("tensor_parallel_size {world} needs {world} GPUs but {visible} are visible (list them in ParallelConfig(devices=...) to share one)"))
    } else {
        crate::backend::cuda::unsupported(model)
    };
    let Some(why) = why else {
        return Ok(device);
    };
    if config.kv_cache_dtype == KvCacheDtype::Fp8 {
        return invalid(format!("kv_cache_dtype=\"fp8\" needs the CUDA backend, but {why}; use kv_cache_dtype=\"auto\""));
    }
    eprintln!("stepllm: warning: {why}; device=\"auto\" runs this model on the CPU");
    Ok(Device::Cpu)
}

/// Whether a CUDA device can be used: kernels were built in and a driver sees a GPU (never panics).
pub fn cuda_available() -> bool {
    crate::backend::cuda::available()
}

/// What callers may want to know about the loaded model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub source: String,
    pub architecture: String,
    /// RoPE's scaling: "default", "linear", "llama3" or llama.cpp's per-frequency factors.
    pub rope: String,
    pub parameters: usize,
    /// Bytes the weights take where they are kept, all ranks together.
    pub weight_bytes: usize,
    pub device: String,
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub kv_cache_tokens: usize,
    pub block_size: usize,
    pub max_batch_size: usize,
    pub max_prefill_tokens: usize,
    pub kv_cache_dtype: KvCacheDtype,
    pub eos_token_ids: Vec<u32>,
}

pub struct RuntimeCoordinator {
    stepper: StepperHandle,
    /// The rank group when tensor_parallel_size > 1.
    ranks: Option<Arc<RankGroup>>,
    intents: Arc<IntentBuilder>,
    active: Arc<AtomicBool>,
    info: ModelInfo,
}

impl RuntimeCoordinator {
    pub fn new(config: Config) -> Result<Self> {
        Self::with_progress(config, None)
    }

    /// Load with a progress callback, called with (tensors loaded, tensors in all).
    pub fn with_progress(config: Config, progress: Option<LoadProgress>) -> Result<Self> {
        config.validate()?;
        let device = parse_device(&config.device)?;
        let checkpoint = Checkpoint::open(std::path::Path::new(&config.model))?;
        let device = if config.device == "auto" {
            auto_device(&config, device, &checkpoint.config, crate::backend::cuda::device::device_count())?
        } else {
            device
        };
        let world = config.parallel.tensor_parallel_size;
        if world > 1 {
            let model = crate::parallel::load_parallel(checkpoint, device, config.dtype, world, &config.parallel.devices, progress)?;
            return Self::from_parallel(model, &config);
        }
        let loaded = checkpoint.load(device, config.dtype, progress)?;
        Self::from_loaded(loaded, &config)
    }

    /// A tensor-parallel coordinator: one rank worker thread (and stepper) per shard.
    pub fn from_parallel(model: crate::parallel::ParallelModel, config: &Config) -> Result<Self> {
        config.validate()?;
        let crate::parallel::ParallelModel { config: model_config, runners, collective, faults, tokenizer, chat_template, source } = model;
        let world = runners.len();
        let (stepper_config, mut info, intents) = Self::plan(&model_config, config, &tokenizer, chat_template, source, runners[0].as_ref())?;
        info.parameters = runners.iter().map(|r| r.parameter_count()).sum();
        info.weight_bytes = runners.iter().map(|r| r.weight_bytes()).sum();
        info.device = format!("{} x{world} (tensor parallel)", info.device);
        let steppers = runners
            .into_iter()
            .map(|r| RuntimeStepper::new(r, Arc::clone(&tokenizer), model_config.eos_token_ids.clone(), stepper_config.clone()))
            .collect::<Result<Vec<_>>>()?;
        let group = Arc::new(RankGroup::start(steppers, collective, faults)?);
        Ok(Self {
            stepper: StepperHandle::Ranks(Arc::clone(&group)),
            ranks: Some(group),
            intents: Arc::new(intents),
            active: Arc::new(AtomicBool::new(false)),
            info,
        })
    }

    fn plan(
        model_config: &crate::model::ModelConfig,
        config: &Config,
        tokenizer: &Arc<crate::text::tokenizer::Tokenizer>,
        chat_template: Option<crate::text::chat_template::ChatTemplate>,
        source: String,
        runner: &dyn crate::model::ModelRunner,
    ) -> Result<(StepperConfig, ModelInfo, IntentBuilder)> {
        let max_model_len = resolve_max_model_len(model_config.max_position_embeddings, config.max_model_len)?;
        let num_blocks = config.kv_cache_tokens.div_ceil(config.block_size);
        let stepper_config = StepperConfig {
            max_batch_size: config.max_batch_size,
            num_blocks,
            block_size: config.block_size,
            max_model_len,
            cache: config.context_cache.clone(),
            kv_cache_dtype: config.kv_cache_dtype,
            max_prefill_tokens: config.max_prefill_tokens,
        };
        let info = ModelInfo {
            source,
            architecture: model_config.architecture.hf_name().to_string(),
            rope: model_config.rope.scaling_name().to_string(),
            parameters: runner.parameter_count(),
            weight_bytes: runner.weight_bytes(),
            device: runner.device_description(),
            vocab_size: model_config.vocab_size,
            max_model_len,
            kv_cache_tokens: num_blocks * config.block_size,
            block_size: config.block_size,
            max_batch_size: config.max_batch_size,
            max_prefill_tokens: config.max_prefill_tokens,
            kv_cache_dtype: config.kv_cache_dtype,
            eos_token_ids: model_config.eos_token_ids.clone(),
        };
        let intents = IntentBuilder {
            tokenizer: Arc::clone(tokenizer),
            chat_template,
            vocab_size: model_config.vocab_size,
            max_model_len,
            kv_capacity_tokens: num_blocks * config.block_size,
        };
        Ok((stepper_config, info, intents))
    }

    pub fn from_loaded(loaded: LoadedModel, config: &Config) -> Result<Self> {
        config.validate()?;
        if config.parallel.tensor_parallel_size != 1 {
            return invalid("a loaded single-rank model cannot serve tensor_parallel_size > 1; load it through RuntimeCoordinator::new");
        }
        let LoadedModel { config: model_config, runner, tokenizer, chat_template, source } = loaded;
        let (stepper_config, info, intents) = Self::plan(&model_config, config, &tokenizer, chat_template, source, runner.as_ref())?;
        let stepper = RuntimeStepper::new(runner, tokenizer, model_config.eos_token_ids.clone(), stepper_config)?;
        Ok(Self {
            stepper: StepperHandle::Local(Arc::new(Mutex::new(stepper))),
            ranks: None,
            intents: Arc::new(intents),
            active: Arc::new(AtomicBool::new(false)),
            info,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn intents(&self) -> &Arc<IntentBuilder> {
        &self.intents
    }

    /// The shared stepper (or rank group), for the engine's actor thread.
    pub fn stepper(&self) -> &StepperHandle {
        &self.stepper
    }

    pub fn counts(&self) -> PoolCounts {
        self.stepper.counts()
    }

    /// Begin a stepped session with a founder request; its prefill runs now and is reported by the first
    /// prefill tick.
    pub fn begin_stepped(&self, request: GenerationRequest, request_id: RequestId, original_index: u32) -> Result<SteppedRequest> {
        self.claim_session()?;
        SteppedRequest::begin(self.stepper.clone(), Arc::clone(&self.intents), Arc::clone(&self.active), request, request_id, original_index)
    }

    pub(crate) fn claim_session(&self) -> Result<()> {
        if self.active.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return protocol("a stepped session or batch is already running on this coordinator; finish() or abort() it first");
        }
        Ok(())
    }

    pub(crate) fn release_session(&self) {
        self.active.store(false, Ordering::SeqCst);
    }

    pub fn count_prompt_tokens(&self, request: &GenerationRequest) -> Result<usize> {
        Ok(self.intents.prompt_ids(request)?.len())
    }

    /// Run a whole batch to completion; responses in request order. Invalid requests raise before anything
    /// runs; requests that can never fit the KV cache come back with finish reason ERROR.
    pub fn dispatch_request(&self, requests: Vec<GenerationRequest>) -> Result<Vec<GenerationResponse>> {
        let intents = requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| self.intents.build(r, i as RequestId + 1, i as u32))
            .collect::<Result<Vec<_>>>()?;
        self.claim_session()?;
        let result = run_batch(&self.stepper, intents, self.info.max_prefill_tokens);
        self.release_session();
        result
    }

    /// Prefill a system prompt and pin its full KV blocks in the context cache. Returns the cached tokens.
    pub fn gen_and_save_system_prompt_kv_cache(&self, prompt: Prompt) -> Result<usize> {
        let ids = match prompt {
            Prompt::Messages(m) => {
                let template = self.intents.chat_template.as_ref().ok_or_else(|| crate::Error::InvalidRequest("this model has no chat template".into()))?;
                self.intents.tokenizer.encode(&template.render(&m, false)?, false)?
            }
            other => self.intents.prompt_ids(&GenerationRequest::new(other, Default::default()))?,
        };
        self.claim_session()?;
        let result = self.stepper.save_pinned_prefix(&ids);
        self.release_session();
        result
    }

    /// Capture decode CUDA graphs per batch-size bucket; false where the backend has none (the CPU).
    pub fn capture_decoding_cuda_graph(&self) -> Result<bool> {
        self.stepper.capture_decode_graphs()
    }

    pub fn supports_stepped_execution(&self) -> bool {
        true
    }

    pub fn supports_boundary_scheduling(&self) -> bool {
        true
    }

    pub fn world_size(&self) -> usize {
        self.ranks.as_ref().map_or(1, |g| g.world_size())
    }

    /// Every rank of the group runs in this process, so it owns every rank below world_size.
    pub fn owns_global_rank(&self, rank: usize) -> bool {
        rank < self.world_size()
    }

    /// Whether every rank (all local) succeeded, and agreed, in the latest stepped command.
    pub fn local_ranks_succeeded(&self) -> bool {
        self.ranks.as_ref().is_none_or(|g| g.local_ranks_succeeded())
    }

    /// Rank `rank`'s own result of the latest prefill or decode step, once; None for other commands, a
    /// rank outside the group, or a response already taken. A rank's error comes back as Err.
    pub fn take_rank_response(&self, rank: usize) -> Option<Result<StepResult>> {
        let group = self.ranks.as_ref()?;
        match group.take_rank_response(rank)? {
            Ok(RankReply::Step(step)) => Some(Ok(step)),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Make rank `rank` fail (an error, or a panic) in its next collective: for tests of rank failure. A
    /// protocol error without ranks.
    #[doc(hidden)]
    pub fn inject_rank_fault(&self, rank: usize, fault: crate::parallel::Fault) -> Result<()> {
        match &self.ranks {
            Some(g) => g.inject_fault(rank, fault),
            None => protocol("inject_rank_fault needs tensor_parallel_size > 1"),
        }
    }

    /// Every rank's own pool counts and residents, for invariant checks on every rank.
    pub fn per_rank_state(&self) -> Result<Vec<(PoolCounts, Vec<crate::ids::ResidentRef>)>> {
        let Some(g) = &self.ranks else {
            return Ok(vec![(self.stepper.counts(), self.stepper.residents()?)]);
        };
        let counts = g.per_rank(RankCommand::Counts)?;
        let residents = g.per_rank(RankCommand::Residents)?;
        counts
            .into_iter()
            .zip(residents)
            .map(|pair| match pair {
                (RankReply::Counts(c), RankReply::Residents(r)) => Ok((c, r)),
                other => Err(crate::Error::Internal(format!("unexpected rank replies {other:?}"))),
            })
            .collect()
    }
}

/// FCFS: seat the queue's heads as one prefill group while capacity and the token budget allow, and prefill
/// them (with a decode step of the running residents, when any run: `step_seated_group`), over several steps when
/// a prompt is longer than the budget; otherwise decode every resident.
fn run_batch(stepper: &StepperHandle, intents: Vec<AdmissionIntent>, max_prefill_tokens: usize) -> Result<Vec<GenerationResponse>> {
    let n = intents.len();
    let mut waiting: VecDeque<AdmissionIntent> = intents.into();
    let mut responses: Vec<Option<GenerationResponse>> = (0..n).map(|_| None).collect();
    // Whether the last step left a prompt seated short of its end (chunked prefill): the next step goes on with it.
    let mut prompts_seated = false;
    let collect = |step: &StepResult, responses: &mut Vec<Option<GenerationResponse>>| {
        for (_, batch) in &step.finished {
            responses[batch.identity.original_index as usize] = Some(materialize(batch, &[]));
        }
        left_prompts_seated(step)
    };
    while !waiting.is_empty() || !stepper.residents()?.is_empty() {
        if let Some(step) = continue_seated_prompts(stepper, prompts_seated)? {
            prompts_seated = collect(&step, &mut responses);
            continue;
        }
        if !waiting.is_empty() {
            let mut rejected = Vec::new();
            let group = seat_prefill_group(stepper, &mut waiting, |i| i, max_prefill_tokens, |_, _| {}, |i, why| rejected.push((i, why)))?;
            for (intent, why) in rejected {
                responses[intent.original_index as usize] = Some(intent.unstarted_response(FinishReason::Error, why));
            }
            if !group.targets.is_empty() {
                let step = step_seated_group(stepper, group.targets)?;
                prompts_seated = collect(&step, &mut responses);
                continue;
            }
            if let Some(why) = group.head_refused {
                if stepper.residents()?.is_empty() {
                    let head = waiting.front().expect("a refused head stays queued");
                    return Err(crate::Error::Internal(format!("request {} cannot be admitted into an idle runtime: {why}", head.request_id)));
                }
            }
        }
        let residents = stepper.residents()?;
        if !residents.is_empty() {
            let step = stepper.decode(&ImmutableDecodeBatch { residents })?;
            prompts_seated = collect(&step, &mut responses);
        }
    }
    Ok(responses.into_iter().map(|r| r.expect("every request finished")).collect())
}

/// The context length requests may use: the model's (`max_position_embeddings`) unless `max_model_len` asks
/// for less. More than the model was trained for is refused, as vLLM refuses it: RoPE positions past it were
/// never trained and the output degrades without any error. STEPLLM_ALLOW_LONG_MAX_MODEL_LEN=1 allows it for a
/// caller who knows the model extrapolates.
fn resolve_max_model_len(trained: usize, asked: Option<usize>) -> Result<usize> {
    let Some(asked) = asked else { return Ok(trained.max(2)) };
    if asked > trained && std::env::var_os("STEPLLM_ALLOW_LONG_MAX_MODEL_LEN").is_none() {
        return invalid(format!(
            "max_model_len {asked} is longer than the model's max_position_embeddings ({trained}); use at most \
             {trained}, or set STEPLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if the model is known to handle longer contexts"
        ));
    }
    Ok(asked.max(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    #[test]
    fn auto_runs_a_model_the_cuda_kernels_cannot_run_on_the_cpu() {
        // The llama fixture has head_dim 16, which no CUDA attention kernel covers.
        let path = crate::test_support::fixture_dir("llama");
        let model = crate::model::loader::load_hf_config(&path).unwrap();
        let config = Config::new(path.display().to_string());
        assert_eq!(auto_device(&config, Device::Cuda(0), &model, 1).unwrap(), Device::Cpu);
        assert_eq!(auto_device(&config, Device::Cpu, &model, 1).unwrap(), Device::Cpu);
        let fp8 = Config { kv_cache_dtype: KvCacheDtype::Fp8, ..config };
        let message = auto_device(&fp8, Device::Cuda(0), &model, 1).unwrap_err().to_string();
        assert!(message.contains("head_dim 16 with 2 query heads") && message.contains("fp8"), "{message}");
    }

    #[test]
    fn auto_keeps_the_gpus_for_a_shape_they_cover_when_every_rank_has_one() {
        let smollm2_shape = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}"#;
        let model = ModelConfig::from_hf_json(smollm2_shape).unwrap();
        let config = Config::new("smollm2-shape");
        assert_eq!(auto_device(&config, Device::Cuda(0), &model, 1).unwrap(), Device::Cuda(0));
        let parallel = Config { parallel: ParallelConfig { tensor_parallel_size: 3, devices: Vec::new() }, ..config };
        assert_eq!(auto_device(&parallel, Device::Cuda(0), &model, 4).unwrap(), Device::Cuda(0));
        assert_eq!(auto_device(&parallel, Device::Cuda(0), &model, 2).unwrap(), Device::Cpu, "3 ranks, 2 GPUs");
        let listed = Config { parallel: ParallelConfig { tensor_parallel_size: 3, devices: vec![0, 0, 1] }, ..parallel.clone() };
        assert_eq!(auto_device(&listed, Device::Cuda(0), &model, 2).unwrap(), Device::Cuda(0), "ranks may share the listed GPUs");
        let parallel_fp8 = Config { kv_cache_dtype: KvCacheDtype::Fp8, ..parallel };
        let message = auto_device(&parallel_fp8, Device::Cuda(0), &model, 2).unwrap_err().to_string();
        assert!(message.contains("needs 3 GPUs but 2 are visible") && message.contains("fp8"), "{message}");
    }
}
