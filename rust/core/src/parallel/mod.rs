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
use crate::error::{Error, Result};
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
    /// Wait until this rank's queued device work is done, before the host reads a result. Where that work waits
    /// on the other ranks (device-side collectives), a rank that failed must end the wait with an error, not hang
    /// it; backends whose collectives run on the host have nothing to wait for.
    fn settle(&self, _backend: &B) -> Result<()> {
        Ok(())
    }
}

/// What every rank's hooks share, whatever the backend: its place in the group, the group's in-process collective
/// (host-side exchanges and failure), and a fault switch for tests.
pub struct RankLink {
    pub rank: usize,
    pub collective: Arc<Collective>,
    /// A [`Fault`] this rank's next collective suffers (then the switch clears): rank-failure tests.
    pub fault: Arc<AtomicU8>,
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

impl RankLink {
    /// Suffer the fault injected into this rank's next collective, if any (then the switch clears).
    pub fn check_fault(&self) -> Result<()> {
        let rank = self.rank;
        match self.fault.swap(0, Ordering::SeqCst) {
            0 => Ok(()),
            f if f == Fault::Panic as u8 => panic!("tensor-parallel rank {rank} panicked (injected fault)"),
            _ => Err(self.collective.poison(format!("tensor-parallel rank {rank} failed (injected fault)"))),
        }
    }

    /// Sum host values over every rank, in place (the caller has checked for a fault).
    pub fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()> {
        self.collective.all_reduce_sum(self.rank, values)
    }

    pub fn all_gather_columns(&self, piece: Vec<f32>, rows: usize) -> Result<Vec<f32>> {
        self.check_fault()?;
        self.collective.all_gather_columns(self.rank, piece, rows)
    }

    pub fn broadcast_sampled(&self, sampled: Option<Vec<Sampled>>) -> Result<Vec<Sampled>> {
        self.check_fault()?;
        self.collective.broadcast_sampled(self.rank, sampled)
    }

    /// Fail the current command on every rank with `error`.
    pub fn fail(&self, error: Error) -> Error {
        self.collective.poison(error.to_string())
    }
}

/// In-process collectives for CPU ranks.
pub struct CpuRankHooks(pub RankLink);

impl TensorParallelHooks<CpuBackend> for CpuRankHooks {
    fn rank(&self) -> usize {
        self.0.rank
    }

    fn all_reduce(&self, backend: &CpuBackend, x: &mut CpuTensor) -> Result<()> {
        self.0.check_fault()?;
        let mut host = Vec::new();
        backend.copy_to_host(x, &mut host)?;
        self.0.all_reduce_sum(&mut host)?;
        crate::backend::overwrite_cpu_tensor(x, &host)
    }

    fn all_gather_columns(&self, piece: Vec<f32>, rows: usize) -> Result<Vec<f32>> {
        self.0.all_gather_columns(piece, rows)
    }

    fn broadcast_sampled(&self, sampled: Option<Vec<Sampled>>) -> Result<Vec<Sampled>> {
        self.0.broadcast_sampled(sampled)
    }

    fn fail(&self, error: Error) -> Error {
        self.0.fail(error)
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

/// Load an opened checkpoint (a Hugging Face directory or a GGUF) as `world` ranks, each holding its shard: CPU
/// ranks, or CUDA ranks on `devices` (one ordinal per rank; none listed: consecutive GPUs from the device's).
pub fn load_parallel(
    checkpoint: Checkpoint,
    device: Device,
    dtype: Option<WeightDtype>,
    world: usize,
    devices: &[usize],
    progress: Option<LoadProgress>,
) -> Result<ParallelModel> {
    let Checkpoint { config, tokenizer, chat_template, weights, source } = checkpoint;
    let counted = ProgressSource::new(weights.as_ref(), &config, world, progress);
    let collective = Collective::new(world);
    let faults: Vec<Arc<AtomicU8>> = (0..world).map(|_| Arc::new(AtomicU8::new(0))).collect();
    let runners = match device {
        Device::Cpu => load_cpu_ranks(&config, &counted, dtype, &collective, &faults)?,
        Device::Cuda(first) => {
            let ordinals = rank_ordinals(first, devices, world, crate::backend::cuda::device::device_count())?;
            crate::backend::cuda::load_ranks(&config, &counted, &ordinals, &collective, &faults)?
        }
    };
    counted.finish();
    Ok(ParallelModel { config, runners, collective, faults, tokenizer, chat_template, source })
}

fn load_cpu_ranks(
    config: &ModelConfig,
    weights: &dyn crate::model::loader::WeightSource,
    dtype: Option<WeightDtype>,
    collective: &Arc<Collective>,
    faults: &[Arc<AtomicU8>],
) -> Result<Vec<Box<dyn ModelRunner>>> {
    let format = CpuWeightFormat::from(dtype.unwrap_or(WeightDtype::F32));
    let mut runners: Vec<Box<dyn ModelRunner>> = Vec::with_capacity(faults.len());
    for (rank, fault) in faults.iter().enumerate() {
        let hooks = CpuRankHooks(RankLink { rank, collective: Arc::clone(collective), fault: Arc::clone(fault) });
        let model = load_rank_model(CpuBackend::new(format), config, weights, rank, faults.len(), Box::new(hooks))?;
        runners.push(Box::new(model));
    }
    Ok(runners)
}

/// Rank `rank` of `world`: its shard of `weights`, loaded onto `backend`.
pub(crate) fn load_rank_model<B: Backend>(
    backend: B,
    config: &ModelConfig,
    weights: &dyn crate::model::loader::WeightSource,
    rank: usize,
    world: usize,
    hooks: Box<dyn TensorParallelHooks<B>>,
) -> Result<LlamaModel<B>> {
    let layout = ShardLayout::new(config, rank, world)?;
    let local = layout.local_config(config);
    let vocab_start = layout.vocab_start();
    let source = ShardedSource { inner: weights, layout, head_dim: config.head_dim };
    LlamaModel::load_rank(backend, config, &local, &source, vocab_start, hooks)
}

/// Each rank's GPU: the listed ordinals, or `world` consecutive ones from `first`; all of them among the
/// `visible` devices. Ranks may share a GPU (they then all-reduce through host memory).
pub fn rank_ordinals(first: usize, listed: &[usize], world: usize, visible: usize) -> Result<Vec<usize>> {
    let ordinals: Vec<usize> = if listed.is_empty() { (first..first + world).collect() } else { listed.to_vec() };
    if ordinals.len() != world {
        return Err(Error::InvalidRequest(format!("parallel.devices lists {} devices for {world} ranks", ordinals.len())));
    }
    if let Some(&missing) = ordinals.iter().find(|&&o| o >= visible) {
        let hint = if listed.is_empty() {
            format!(
                "; list the GPUs in ParallelConfig(devices=...): e.g. devices={:?} runs every rank on cuda:{first} (a test \
                 setup with no speed-up)",
                vec![first; world]
            )
        } else {
            String::new()
        };
        return Err(Error::Device(format!(
            "tensor_parallel_size {world} needs cuda:{missing}, but {visible} CUDA device(s) are visible{hint}"
        )));
    }
    Ok(ordinals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_consecutive_gpus_or_the_listed_ones_and_a_missing_gpu_is_named() {
        assert_eq!(rank_ordinals(0, &[], 2, 2).unwrap(), vec![0, 1]);
        assert_eq!(rank_ordinals(2, &[], 2, 4).unwrap(), vec![2, 3]);
        assert_eq!(rank_ordinals(0, &[0, 0], 2, 1).unwrap(), vec![0, 0], "ranks may share a GPU");
        assert_eq!(rank_ordinals(0, &[3, 1], 2, 4).unwrap(), vec![3, 1]);
        let short = rank_ordinals(0, &[], 2, 1).unwrap_err().to_string();
        assert!(short.contains("needs cuda:1, but 1 CUDA device(s) are visible") && short.contains("devices=[0, 0]"), "{short}");
        let listed = rank_ordinals(0, &[0, 5], 2, 2).unwrap_err().to_string();
        assert!(listed.contains("needs cuda:5") && !listed.contains("devices="), "{listed}");
        assert!(rank_ordinals(0, &[0], 2, 2).is_err());
    }
}
