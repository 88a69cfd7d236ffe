//! Tensor parallelism on CUDA: one [`CudaBackend`] per rank, each on its own device (or several ranks sharing
//! one), driven by the rank threads of `parallel::rank`. The row-parallel projections' partial sums are
//! all-reduced through NCCL when every rank has a GPU of its own, and through host memory (the ranks'
//! in-process collective) when GPUs are shared or NCCL is missing. The vocab-parallel logits are joined on the
//! host and rank 0 samples, as on the CPU; decode CUDA graphs are not captured under tensor parallelism.
//!
//! NCCL's all-reduce waits on the device for every rank's contribution, so a rank that fails before it
//! contributes would leave the others' streams waiting forever. Ranks therefore never block on their stream:
//! [`CudaRankHooks::settle`] polls it and the group's collective, and when another rank has failed it aborts
//! this rank's communicator, which ends the wait with an error. An aborted group cannot run again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys as driver;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::backend::{CudaBackend, CudaTensor};
use crate::error::{Error, Result};
use crate::model::llama::LlamaModel;
use crate::backend::KvCacheDtype;
use crate::model::{ForwardBatch, ModelConfig, ModelRunner};
use crate::parallel::{RankLink, TensorParallelHooks};
use crate::sampling::{RowContext, Sampled};

/// How the ranks of a CUDA group add up their partial sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReducePath {
    /// On the devices, through NCCL: every rank on a GPU of its own.
    Nccl,
    /// Through host memory and the in-process collective: ranks share a GPU, NCCL is missing, or
    /// STEPLLM_NO_NCCL is set.
    Host,
}

/// NCCL needs one GPU per rank (it refuses a communicator that lists a device twice).
pub fn all_reduce_path(ordinals: &[usize], nccl_present: bool, nccl_disabled: bool) -> AllReducePath {
    let mut distinct = ordinals.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if ordinals.len() > 1 && distinct.len() == ordinals.len() && nccl_present && !nccl_disabled {
        AllReducePath::Nccl
    } else {
        AllReducePath::Host
    }
}

/// Whether libnccl can be loaded here (never panics).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { nccl_sys::is_culib_present() }
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    raw: nccl_sys::ncclComm_t,
    aborted: AtomicBool,
    /// Shared by the group's communicators: set once any of them is aborted, after which none may be destroyed
    /// normally (a destroy waits for operations that will never complete).
    group_aborted: Arc<AtomicBool>,
}

// SAFETY: a communicator may be used from any thread, one at a time; each rank's lives in its own hooks and is
// used only by its rank thread.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Communicators for `backends`' devices (one per rank, in rank order), created together.
    pub fn create_group(backends: &[CudaBackend]) -> Result<Vec<NcclComm>> {
        let ordinals: Vec<i32> = backends.iter().map(|b| b.gpu().ctx.ordinal() as i32).collect();
        let mut raw = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `raw` has one slot per listed device.
        unsafe { nccl::comm_init_all(raw.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }
            .map_err(|e| Error::Device(format!("NCCL could not connect cuda:{ordinals:?} ({e:?}); set STEPLLM_NO_NCCL=1 to all-reduce through host memory instead")))?;
        let group_aborted = Arc::new(AtomicBool::new(false));
        Ok(raw.into_iter().map(|raw| NcclComm { raw, aborted: AtomicBool::new(false), group_aborted: Arc::clone(&group_aborted) }).collect())
    }

    fn usable(&self) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Error::Device(
                "this tensor-parallel group's NCCL communicators were aborted when a rank failed; it cannot run \
                 again: load the model again"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Sum `count` bf16 values at `ptr` over every rank, in place, ordered on `stream`.
    fn all_reduce_bf16(&self, ptr: u64, count: usize, stream: driver::CUstream) -> Result<()> {
        self.usable()?;
        let buffer = ptr as *mut std::ffi::c_void;
        // SAFETY: `ptr` holds `count` bf16 values on this communicator's device; `stream` belongs to it.
        unsafe {
            nccl::all_reduce(
                buffer,
                buffer,
                count,
                nccl_sys::ncclDataType_t::ncclBfloat16,
                nccl_sys::ncclRedOp_t::ncclSum,
                self.raw,
                stream as nccl_sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(|e| Error::Device(format!("NCCL all-reduce of {count} values: {e:?}")))
    }

    /// An error NCCL met asynchronously (a peer lost, a failed kernel), if any.
    fn async_error(&self) -> Option<String> {
        let mut state = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator and `state` a valid out-pointer.
        let asked = unsafe { nccl_sys::ncclCommGetAsyncError(self.raw, &mut state) };
        match (asked, state) {
            (nccl_sys::ncclResult_t::ncclSuccess, nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress) => None,
            (nccl_sys::ncclResult_t::ncclSuccess, e) => Some(format!("NCCL reported {e:?}")),
            (e, _) => Some(format!("NCCL could not report its state: {e:?}")),
        }
    }

    /// Abort the communicator: its pending operations end, on this device, and it cannot be used again.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            self.group_aborted.store(true, Ordering::SeqCst);
            // SAFETY: `raw` is live and aborted only once. An abort that fails leaves nothing else to do.
            let _ = unsafe { nccl::comm_abort(self.raw) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: `raw` is live and released once here.
        let _ = unsafe {
            if self.group_aborted.load(Ordering::SeqCst) {
                nccl::comm_abort(self.raw)
            } else {
                nccl::comm_destroy(self.raw)
            }
        };
    }
}

/// One CUDA rank's collectives: device all-reduce through NCCL or host memory; the rest on the host.
pub struct CudaRankHooks {
    pub link: RankLink,
    pub nccl: Option<NcclComm>,
}

impl TensorParallelHooks<CudaBackend> for CudaRankHooks {
    fn rank(&self) -> usize {
        self.link.rank
    }

    fn all_reduce(&self, backend: &CudaBackend, x: &mut CudaTensor) -> Result<()> {
        self.link.check_fault()?;
        if let Some(comm) = &self.nccl {
            return comm.all_reduce_bf16(x.ptr(), x.rows() * x.cols(), backend.gpu().cu_stream());
        }
        let mut host = Vec::new();
        backend.download_f32(x, &mut host)?;
        self.link.all_reduce_sum(&mut host)?;
        backend.upload_f32(x, &host)
    }

    fn all_gather_columns(&self, piece: Vec<f32>, rows: usize) -> Result<Vec<f32>> {
        self.link.all_gather_columns(piece, rows)
    }

    fn broadcast_sampled(&self, sampled: Option<Vec<Sampled>>) -> Result<Vec<Sampled>> {
        self.link.broadcast_sampled(sampled)
    }

    fn fail(&self, error: Error) -> Error {
        if let Some(comm) = &self.nccl {
            comm.abort();
        }
        self.link.fail(error)
    }

    /// Poll the stream until its work is done, the group has failed, or NCCL reports an error.
    fn settle(&self, backend: &CudaBackend) -> Result<()> {
        let Some(comm) = &self.nccl else {
            return Ok(());
        };
        let stream = backend.gpu().cu_stream();
        let mut polls = 0u32;
        loop {
            // SAFETY: the stream is this rank's, live for the backend's lifetime.
            match unsafe { driver::cuStreamQuery(stream) } {
                driver::CUresult::CUDA_SUCCESS => return Ok(()),
                driver::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(self.fail(Error::Device(format!("tensor-parallel rank {}: the CUDA stream failed: {e:?}", self.link.rank)))),
            }
            if let Some(e) = self.link.collective.failure_now() {
                comm.abort();
                return Err(e);
            }
            if let Some(why) = comm.async_error() {
                return Err(self.fail(Error::Device(format!("tensor-parallel rank {}: {why}", self.link.rank))));
            }
            // A step takes from tens of microseconds to seconds: spin briefly, then yield, then sleep a little.
            polls = polls.saturating_add(1);
            match polls {
                0..1000 => std::hint::spin_loop(),
                1000..100_000 => std::thread::yield_now(),
                _ => std::thread::sleep(std::time::Duration::from_micros(50)),
            }
        }
    }
}

/// A CUDA rank's runner: the sharded model on its backend, with the context bound on the rank thread.
pub struct CudaRankRunner {
    model: LlamaModel<CudaBackend>,
    backend: CudaBackend,
    all_reduce: AllReducePath,
}

impl CudaRankRunner {
    pub fn new(model: LlamaModel<CudaBackend>, backend: CudaBackend, all_reduce: AllReducePath) -> Self {
        Self { model, backend, all_reduce }
    }
}

impl ModelRunner for CudaRankRunner {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize, dtype: KvCacheDtype) -> Result<()> {
        self.backend.gpu().bind()?;
        self.model.allocate_kv_cache(num_blocks, block_size, dtype)
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>> {
        self.backend.gpu().bind()?;
        self.model.forward(batch)
    }

    fn forward_and_sample(&mut self, batch: &ForwardBatch, rows: &[RowContext]) -> Result<Vec<Sampled>> {
        self.backend.gpu().bind()?;
        self.model.forward_and_sample(batch, rows)
    }

    fn sample_host_logits(&mut self, logits: &mut [f32], rows: &[RowContext]) -> Result<Vec<Sampled>> {
        self.model.sample_host_logits(logits, rows)
    }

    fn device_description(&self) -> String {
        let path = match self.all_reduce {
            AllReducePath::Nccl => "NCCL",
            AllReducePath::Host => "host memory",
        };
        format!("{}, all-reduce through {path}", self.model.device_description())
    }

    fn parameter_count(&self) -> usize {
        self.model.parameter_count()
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.backend.gpu().memory_in_use()
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_only_when_every_rank_has_its_own_gpu_and_nccl_is_there() {
        assert_eq!(all_reduce_path(&[0, 1], true, false), AllReducePath::Nccl);
        assert_eq!(all_reduce_path(&[2, 0, 1, 3], true, false), AllReducePath::Nccl);
        assert_eq!(all_reduce_path(&[0, 0], true, false), AllReducePath::Host, "a shared GPU");
        assert_eq!(all_reduce_path(&[0, 1, 1], true, false), AllReducePath::Host, "a shared GPU");
        assert_eq!(all_reduce_path(&[0, 1], false, false), AllReducePath::Host, "no libnccl");
        assert_eq!(all_reduce_path(&[0, 1], true, true), AllReducePath::Host, "STEPLLM_NO_NCCL");
        assert_eq!(all_reduce_path(&[0], true, false), AllReducePath::Host, "one rank");
    }
}
