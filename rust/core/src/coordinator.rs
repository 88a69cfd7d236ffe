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
    /// Resident slots: the most sequences live at once. None: the device's default (8 on the CPU, 256 on a GPU).
    pub max_batch_size: Option<usize>,
    /// Most prompt tokens one step computes. The schedulers (engine, dispatch) prefill prompts together up to it;
    /// a longer prompt is computed in chunks of it over several steps (chunked prefill), while running requests
    /// keep decoding in the same forwards.
    pub max_prefill_tokens: usize,
    /// KV cache budget in tokens (rounded up to whole blocks). None: the device's default: 16,384 tokens on the CPU;
    /// on a GPU, what `gpu_memory_utilization` of its memory leaves after the weights and one step's activations.
    pub kv_cache_tokens: Option<usize>,
    /// The share of each GPU's memory the runtime may fill (weights, KV cache, activations) when it sizes the KV
    /// cache itself (kv_cache_tokens None); as vLLM's option of the same name.
    pub gpu_memory_utilization: f64,
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
            max_batch_size: None,
            max_prefill_tokens: DEFAULT_MAX_PREFILL_TOKENS,
            kv_cache_tokens: None,
            gpu_memory_utilization: DEFAULT_GPU_MEMORY_UTILIZATION,
            block_size: 16,
            max_model_len: None,
            context_cache: ContextCacheConfig::default(),
            parallel: ParallelConfig::default(),
            dtype: None,
            kv_cache_dtype: KvCacheDtype::Auto,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.max_batch_size == Some(0) {
            return invalid("max_batch_size must be at least 1");
        }
        if self.max_prefill_tokens == 0 {
            return invalid("max_prefill_tokens must be at least 1");
        }
        if self.block_size == 0 || self.block_size > 1024 {
            return invalid(format!("block_size must be in 1..=1024, got {}", self.block_size));
        }
        if let Some(tokens) = self.kv_cache_tokens.filter(|&t| t < self.block_size) {
            return invalid(format!("kv_cache_tokens ({tokens}) must hold at least one block ({})", self.block_size));
        }
        if let Some(tokens) = self.kv_cache_tokens.filter(|&t| t.div_ceil(self.block_size) > MAX_KV_BLOCKS) {
            return invalid(format!(
                "kv_cache_tokens ({tokens}) needs more than {MAX_KV_BLOCKS} KV blocks of {} tokens; lower it or raise \
                 block_size",
                self.block_size
            ));
        }
        if let Some(n) = self.max_batch_size.filter(|&n| n > MAX_BATCH_SIZE) {
            return invalid(format!("max_batch_size ({n}) must be at most {MAX_BATCH_SIZE}"));
        }
        if let Some(n) = self.max_model_len.filter(|&n| n < 2) {
            return invalid(format!("max_model_len ({n}) must be at least 2: one prompt token and one generated"));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return invalid(format!("gpu_memory_utilization must be in (0, 1], got {}", self.gpu_memory_utilization));
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

/// Most KV blocks a cache may have: block ids are 32-bit, and the pool's bookkeeping (a few bytes a block) stays
/// small. 2^24 blocks of 16 tokens are 268 million tokens, more than any GPU's memory holds.
pub const MAX_KV_BLOCKS: usize = 1 << 24;
/// Most resident slots: far more than any device can step at once.
pub const MAX_BATCH_SIZE: usize = 1 << 16;

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

/// Defaults of the sizes a Config may leave unset (None): on the CPU small ones (16,384 tokens of f32 K/V are
/// 0.75 GB for SmolLM2-135M); on a GPU vLLM's: hundreds of sequences and most of the device's memory for the KV
/// cache.
pub const DEFAULT_CPU_MAX_BATCH_SIZE: usize = 8;
pub const DEFAULT_CPU_KV_CACHE_TOKENS: usize = 16384;
pub const DEFAULT_GPU_MAX_BATCH_SIZE: usize = 256;
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;
/// Device memory a GPU keeps free beside the KV cache it sizes itself, beyond one step's activations: cuBLAS's
/// workspace, the attention's split-K workspace, CUDA graphs, allocator slack.
const GPU_RESERVE_BYTES: usize = 512 << 20;

/// The slot count and KV budget a runtime gets: the config's where set, else the device's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
struct RuntimeSizes {
    max_batch_size: usize,
    kv_cache_tokens: usize,
}

impl RuntimeSizes {
    /// `runner` is the model's (under tensor parallelism rank 0's: its GPU stands for every rank's).
    fn resolve(config: &Config, runner: &dyn crate::model::ModelRunner, max_model_len: usize) -> Result<Self> {
        let Some((in_use, total)) = runner.device_memory() else {
            return Ok(Self {
                max_batch_size: config.max_batch_size.unwrap_or(DEFAULT_CPU_MAX_BATCH_SIZE),
                kv_cache_tokens: config.kv_cache_tokens.unwrap_or(DEFAULT_CPU_KV_CACHE_TOKENS),
            });
        };
        let max_batch_size = config.max_batch_size.unwrap_or(DEFAULT_GPU_MAX_BATCH_SIZE);
        let kv_cache_tokens = match config.kv_cache_tokens {
            Some(tokens) => tokens,
            None => {
                let model = runner.config();
                let memory = GpuMemory { in_use, total, ranks_sharing: ranks_per_device(&config.parallel) };
                let step = StepShape { max_batch_size, max_prefill_tokens: config.max_prefill_tokens, max_model_len };
                gpu_kv_cache_tokens(model, config, memory, step)?
            }
        };
        Ok(Self { max_batch_size, kv_cache_tokens })
    }
}

/// A GPU's memory when the KV cache is sized: bytes in use (the CUDA context and the weights loaded), its total,
/// and how many tensor-parallel ranks will put a KV cache on it.
#[derive(Debug, Clone, Copy)]
struct GpuMemory {
    in_use: usize,
    total: usize,
    ranks_sharing: usize,
}

#[derive(Debug, Clone, Copy)]
struct StepShape {
    max_batch_size: usize,
    max_prefill_tokens: usize,
    max_model_len: usize,
}

/// Most ranks of one GPU: ranks take consecutive GPUs unless `devices` lists them (a test setup may share one).
fn ranks_per_device(parallel: &ParallelConfig) -> usize {
    parallel.devices.iter().map(|d| parallel.devices.iter().filter(|e| *e == d).count()).max().unwrap_or(1)
}

/// KV tokens that fit in `gpu_memory_utilization` of the GPU beside what is in use and one step's activations
/// (the largest prefill's, with its attention workspace, and the logits of every slot), in whole blocks; never more
/// than every slot can use at max_model_len.
fn gpu_kv_cache_tokens(model: &crate::model::ModelConfig, config: &Config, memory: GpuMemory, step: StepShape) -> Result<usize> {
    let per_token = model.num_layers * 2 * model.kv_dim() * config.kv_cache_dtype.gpu_value_bytes();
    let q_kv_width = model.q_dim() + 2 * model.kv_dim();
    // bf16 activations of a prompt token, and the f32 partials its attention leaves in the split-K workspace.
    let activation_row = 2 * (4 * model.hidden_size + 2 * q_kv_width + 3 * model.intermediate_size) + 4 * model.num_heads * (model.head_dim + 2);
    let activations = step.max_prefill_tokens * activation_row + step.max_batch_size * model.vocab_size * 2;
    let allowed = (memory.total as f64 * config.gpu_memory_utilization) as usize;
    let spare = allowed.saturating_sub(memory.in_use + activations + GPU_RESERVE_BYTES);
    let per_rank = spare / memory.ranks_sharing.max(1);
    let fits = per_rank / per_token.max(1) / config.block_size * config.block_size;
    let useful = step.max_batch_size * step.max_model_len.div_ceil(config.block_size) * config.block_size;
    if fits < config.block_size {
        return Err(crate::Error::Device(format!(
            "no room for a KV cache on the GPU: {:.2} of its {:.1} GiB are in use after the weights, and \
             gpu_memory_utilization {} allows {:.1} GiB with one step's activations ({:.2} GiB); raise \
             gpu_memory_utilization, lower max_batch_size or max_prefill_tokens, or set kv_cache_tokens",
            memory.in_use as f64 / GIB,
            memory.total as f64 / GIB,
            config.gpu_memory_utilization,
            allowed as f64 / GIB,
            activations as f64 / GIB
        )));
    }
    Ok(fits.min(useful))
}

const GIB: f64 = (1u64 << 30) as f64;

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
        let sizes = RuntimeSizes::resolve(config, runner, max_model_len)?;
        // A cache sized from the device's memory is capped as an explicit one is refused (Config::validate).
        let num_blocks = sizes.kv_cache_tokens.div_ceil(config.block_size).min(MAX_KV_BLOCKS);
        let stepper_config = StepperConfig {
            max_batch_size: sizes.max_batch_size,
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
            max_batch_size: sizes.max_batch_size,
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
        let claim = self.claim_session()?;
        let session = SteppedRequest::begin(self.stepper.clone(), Arc::clone(&self.intents), Arc::clone(&self.active), request, request_id, original_index);
        // The session owns the flag now (on an error `begin` has cleared it already).
        claim.keep();
        session
    }

    /// Mark the coordinator busy. The claim ends when dropped, a panic unwinding through the caller included
    /// (the bindings turn panics into errors, and the coordinator must stay usable), unless `keep` hands it on.
    pub(crate) fn claim_session(&self) -> Result<SessionClaim<'_>> {
        if self.active.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return protocol("a stepped session or batch is already running on this coordinator; finish() or abort() it first");
        }
        Ok(SessionClaim(Some(&self.active)))
    }

    pub(crate) fn release_session(&self) {
        self.active.store(false, Ordering::SeqCst);
    }

    pub fn count_prompt_tokens(&self, request: &GenerationRequest) -> Result<usize> {
        Ok(self.prompt_ids(request)?.len())
    }

    /// The token ids a request's prompt becomes (chat template applied, special tokens as the request asks).
    pub fn prompt_ids(&self, request: &GenerationRequest) -> Result<Vec<u32>> {
        self.intents.prompt_ids(request)
    }

    /// Run a whole batch to completion; responses in request order. Invalid requests raise before anything
    /// runs; requests that can never fit the KV cache come back with finish reason ERROR.
    pub fn dispatch_request(&self, requests: Vec<GenerationRequest>) -> Result<Vec<GenerationResponse>> {
        let intents = requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| self.intents.build(r, i as RequestId + 1, i as u32))
            .collect::<Result<Vec<_>>>()?;
        let _claim = self.claim_session()?;
        run_batch(&self.stepper, intents, self.info.max_prefill_tokens)
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
        let _claim = self.claim_session()?;
        self.stepper.save_pinned_prefix(&ids)
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

/// The coordinator's busy flag while set by one call (see `RuntimeCoordinator::claim_session`).
pub(crate) struct SessionClaim<'a>(Option<&'a AtomicBool>);

impl SessionClaim<'_> {
    /// Leave the flag set: a stepped session or the engine owns it now and clears it when it closes.
    pub(crate) fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for SessionClaim<'_> {
    fn drop(&mut self) {
        if let Some(active) = self.0 {
            active.store(false, Ordering::SeqCst);
        }
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
                    // Nothing running will free anything: this request cannot run, the others still can.
                    let head = waiting.pop_front().expect("a refused head stays queued");
                    let why = format!("cannot be admitted into an idle runtime: {why}");
                    responses[head.original_index as usize] = Some(head.unstarted_response(FinishReason::Error, Some(why)));
                    continue;
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

    const GB: usize = 1 << 30;

    fn qwen3_shape() -> ModelConfig {
        ModelConfig::from_hf_json(
            r#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024, "head_dim": 128,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "max_position_embeddings": 40960}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_gpu_fills_its_memory_share_with_kv_blocks_after_the_weights_and_one_steps_activations() {
        let model = qwen3_shape();
        let config = Config::new("qwen3-shape");
        let step = StepShape { max_batch_size: 256, max_prefill_tokens: 8192, max_model_len: 40960 };
        let memory = GpuMemory { in_use: 2 * GB, total: 80 * GB, ranks_sharing: 1 };
        let tokens = gpu_kv_cache_tokens(&model, &config, memory, step).unwrap();
        // 28 layers x K and V x 8 heads x 128 x bf16 = 112 KiB a token.
        let per_token = 28 * 2 * 8 * 128 * 2;
        let activations = 8192 * (2 * (4 * 1024 + 2 * 4096 + 3 * 3072) + 4 * 16 * 130) + 256 * 151936 * 2;
        let spare = (80.0 * 0.9) as usize * GB - 2 * GB - activations - GPU_RESERVE_BYTES;
        assert_eq!(tokens, spare / per_token / 16 * 16);
        assert!(tokens > 600_000, "{tokens}");
        // fp8 stores one byte a value: twice the tokens; two ranks on one GPU: half each.
        let fp8 = Config { kv_cache_dtype: KvCacheDtype::Fp8, ..config.clone() };
        assert_eq!(gpu_kv_cache_tokens(&model, &fp8, memory, step).unwrap(), spare / (per_token / 2) / 16 * 16);
        let shared = GpuMemory { ranks_sharing: 2, ..memory };
        assert_eq!(gpu_kv_cache_tokens(&model, &config, shared, step).unwrap(), spare / 2 / per_token / 16 * 16);
        // Never more than every slot can use.
        let few = StepShape { max_batch_size: 2, max_prefill_tokens: 8192, max_model_len: 1000 };
        assert_eq!(gpu_kv_cache_tokens(&model, &config, memory, few).unwrap(), 2 * 1008);
        // A full GPU says what to change.
        let full = GpuMemory { in_use: 72 * GB, ..memory };
        let message = gpu_kv_cache_tokens(&model, &config, full, step).unwrap_err().to_string();
        assert!(message.contains("no room for a KV cache") && message.contains("gpu_memory_utilization"), "{message}");
    }

    #[test]
    fn ranks_listed_on_one_gpu_share_its_kv_budget() {
        let parallel = |devices: Vec<usize>| ParallelConfig { tensor_parallel_size: devices.len().max(2), devices };
        assert_eq!(ranks_per_device(&parallel(Vec::new())), 1);
        assert_eq!(ranks_per_device(&parallel(vec![0, 1])), 1);
        assert_eq!(ranks_per_device(&parallel(vec![0, 0, 1])), 2);
    }

    #[test]
    fn unset_sizes_take_the_cpus_defaults_and_a_bad_utilization_is_refused() {
        let config = Config::new("m");
        assert_eq!((config.max_batch_size, config.kv_cache_tokens), (None, None));
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let c = Config { gpu_memory_utilization: bad, ..config.clone() };
            let message = c.validate().unwrap_err().to_string();
            assert!(message.contains("gpu_memory_utilization"), "{message}");
        }
        assert!(Config { max_batch_size: Some(0), ..config.clone() }.validate().is_err());
        assert!(Config { kv_cache_tokens: Some(8), ..config }.validate().is_err());
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
