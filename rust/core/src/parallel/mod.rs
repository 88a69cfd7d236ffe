//! Tensor parallelism under stepped execution: `tensor_parallel_size` rank threads, each owning a
//! [`RuntimeStepper`](crate::stepper::RuntimeStepper) over its Megatron-style shard of the model, execute every
//! stepped command collectively ([`rank::RankGroup`]). The forward's collectives go through
//! [`TensorParallelHooks`]; the CPU backend's are in-process ([`collective::Collective`]).

pub mod collective;
pub mod rank;
pub mod shard;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::backend::cpu::CpuTensor;
use crate::backend::{Backend, CpuBackend, CpuWeightFormat};
use crate::error::{load_err, Error, Result};
use crate::model::llama::LlamaModel;
use crate::model::{Checkpoint, Device, LoadProgress, ModelConfig, ModelRunner, ProgressSource, WeightDtype};
use crate::sampling::Sampled;
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;
use collective::Collective;
use shard::{ShardLayout, ShardedSource};

/// The collectives a rank's forward needs; one implementation per backend (in-process for the CPU).
pub trait TensorParallelHooks<B: Backend>: Send {
    fn rank(&self) -> usize;
    /// Sum `x` over every rank, in place (the same bits on every rank).
    fn all_reduce(&self, backend: &B, x: &mut B::Tensor) -> Result<()>;
    /// Join every rank's row-major `[rows, cols_r]` host piece column-wise.
    fn all_gather_columns(&self, piece: Vec<f32>, rows: usize) -> Result<Vec<f32>>;
    /// Rank 0 passes its sampled tokens; every rank gets them.
    fn broadcast_sampled(&self, sampled: Option<Vec<Sampled>>) -> Result<Vec<Sampled>>;
    /// This rank failed on its own: fail the command on every rank; returns the error to report.
    fn fail(&self, error: Error) -> Error;
}

/// In-process collectives for CPU ranks, with a fault switch for tests.
pub struct CpuRankHooks {
    rank: usize,
    collective: Arc<Collective>,
    /// A [`Fault`] this rank's next collective suffers (then the switch clears): rank-failure tests.
    fault: Arc<AtomicU8>,
}

/// What an injected fault does to a rank, for tests of rank failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// The rank's forward returns an error (the step fails alike on every rank; the group stays usable).
    Error = 1,
    /// The rank's thread panics mid-forward (the group fails the step and is unusable afterwards).
    Panic = 2,
}

impl CpuRankHooks {
    fn check_fault(&self) -> Result<()> {
        match self.fault.swap(0, Ordering::SeqCst) {
            0 => Ok(()),
            f if f == Fault::Panic as u8 => panic!("tensor-parallel rank {} panicked (injected fault)", self.rank),
            _ => Err(self.collective.poison(format!("tensor-parallel rank {} failed (injected fault)", self.rank))),
        }
    }
}

impl TensorParallelHooks<CpuBackend> for CpuRankHooks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn all_reduce(&self, backend: &CpuBackend, x: &mut CpuTensor) -> Result<()> {
        self.check_fault()?;
        let mut host = Vec::new();
        backend.copy_to_host(x, &mut host)?;
        self.collective.all_reduce_sum(self.rank, &mut host)?;
        crate::backend::overwrite_cpu_tensor(x, &host)
    }

    fn all_gather_columns(&self, piece: Vec<f32>, rows: usize) -> Result<Vec<f32>> {
        self.check_fault()?;
        self.collective.all_gather_columns(self.rank, piece, rows)
    }

    fn broadcast_sampled(&self, sampled: Option<Vec<Sampled>>) -> Result<Vec<Sampled>> {
        self.check_fault()?;
        self.collective.broadcast_sampled(self.rank, sampled)
    }

    fn fail(&self, error: Error) -> Error {
        self.collective.poison(error.to_string())
    }
}

/// A model loaded as a tensor-parallel group: one runner per rank, and what they share.
pub struct ParallelModel {
    pub config: ModelConfig,
    pub runners: Vec<Box<dyn ModelRunner>>,
    pub collective: Arc<Collective>,
    /// Per rank: the fault switch of its hooks.
    pub faults: Vec<Arc<AtomicU8>>,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub source: String,
}

/// Load an opened checkpoint (a Hugging Face directory or a GGUF) as `world` CPU ranks, each holding its shard.
pub fn load_parallel(checkpoint: Checkpoint, device: Device, dtype: Option<WeightDtype>, world: usize, progress: Option<LoadProgress>) -> Result<ParallelModel> {
    if device != Device::Cpu {
        return load_err(
            "tensor parallelism runs on the CPU backend only for now (multi-GPU needs NCCL); use device=\"cpu\" or tensor_parallel_size=1",
        );
    }
    let format = match dtype.unwrap_or(WeightDtype::F32) {
        WeightDtype::F32 => CpuWeightFormat::F32,
        WeightDtype::Bf16 => CpuWeightFormat::Bf16,
        WeightDtype::Int8 => CpuWeightFormat::Int8,
    };
    let Checkpoint { config, tokenizer, chat_template, weights, source } = checkpoint;
    let counted = ProgressSource::new(weights.as_ref(), &config, progress);
    let collective = Collective::new(world);
    let mut runners: Vec<Box<dyn ModelRunner>> = Vec::with_capacity(world);
    let mut faults = Vec::with_capacity(world);
    for rank in 0..world {
        let layout = ShardLayout::new(&config, rank, world)?;
        let local = layout.local_config(&config);
        let vocab_start = layout.vocab_start();
        let source = ShardedSource { inner: &counted, layout, head_dim: config.head_dim };
        let fault = Arc::new(AtomicU8::new(0));
        let hooks = CpuRankHooks { rank, collective: Arc::clone(&collective), fault: Arc::clone(&fault) };
        let model = LlamaModel::load_rank(CpuBackend::new(format), &config, &local, &source, vocab_start, Box::new(hooks))?;
        runners.push(Box::new(model));
        faults.push(fault);
    }
    counted.finish();
    Ok(ParallelModel { config, runners, collective, faults, tokenizer, chat_template, source })
}
