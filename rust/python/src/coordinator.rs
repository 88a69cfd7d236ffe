//! RuntimeCoordinator and SteppedRequest. Every call that computes runs through `compute` (GIL released).

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use stepllm_core::coordinator::{ModelInfo, RuntimeCoordinator};
use stepllm_core::state::PoolCounts;
use stepllm_core::stepped::{materialize, SteppedExecution, SteppedRequest};

use crate::config::PyConfig;
use crate::errors::{compute, compute_ok};
use crate::request::{prompt_from_py, PyGenerationRequest, PyGenerationResponse};
use crate::types::{
    refs, PyAdmissionIntent, PyAdmissionResult, PyBatchResult, PyImmutableDecodeBatch,
    PyImmutableMixedBatch, PyImmutablePrefillBatch, PyImmutablePrefillGroup, PyResidentRef, PyStepResult,
};

pub fn counts_dict<'py>(py: Python<'py>, c: &PoolCounts) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("slot_capacity", c.slot_capacity)?;
    d.set_item("free_slots", c.free_slots)?;
    d.set_item("live_slots", c.live_slots)?;
    d.set_item("total_blocks", c.total_blocks)?;
    d.set_item("free_blocks", c.free_blocks)?;
    d.set_item("leased_blocks", c.leased_blocks)?;
    d.set_item("cached_blocks", c.cached_blocks)?;
    d.set_item("pinned_blocks", c.pinned_blocks)?;
    Ok(d)
}

pub fn info_dict<'py>(py: Python<'py>, i: &ModelInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("source", &i.source)?;
    d.set_item("architecture", &i.architecture)?;
    d.set_item("rope", &i.rope)?;
    d.set_item("parameters", i.parameters)?;
    d.set_item("weight_bytes", i.weight_bytes)?;
    d.set_item("device", &i.device)?;
    d.set_item("vocab_size", i.vocab_size)?;
    d.set_item("max_model_len", i.max_model_len)?;
    d.set_item("kv_cache_tokens", i.kv_cache_tokens)?;
    d.set_item("block_size", i.block_size)?;
    d.set_item("max_batch_size", i.max_batch_size)?;
    d.set_item("max_prefill_tokens", i.max_prefill_tokens)?;
    d.set_item("kv_cache_dtype", i.kv_cache_dtype.name())?;
    d.set_item("eos_token_ids", &i.eos_token_ids)?;
    Ok(d)
}

#[pyclass(module = "stepllm._core", name = "RuntimeCoordinator", frozen)]
pub struct PyRuntimeCoordinator {
    inner: RuntimeCoordinator,
}

#[pymethods]
impl PyRuntimeCoordinator {
    /// Load the model named by `config` (the default model when None or when `config.model` is None).
    #[new]
    #[pyo3(signature = (config=None, progress=None))]
    fn new(py: Python<'_>, config: Option<PyConfig>, progress: Option<Py<PyAny>>) -> PyResult<Self> {
        let config = PyConfig::resolve(py, config)?;
        let inner = compute(py, move || load_coordinator(config, progress))?;
        Ok(Self { inner })
    }

    /// Begin a stepped session; the founder's prefill runs now and the first prefill tick reports it.
    #[pyo3(signature = (request, request_id=1, original_index=0))]
    fn begin_stepped(
        &self,
        py: Python<'_>,
        request: PyGenerationRequest,
        request_id: u64,
        original_index: u32,
    ) -> PyResult<PySteppedRequest> {
        let stepped = compute(py, || {
            self.inner
                .begin_stepped(request.0, request_id, original_index)
        })?;
        Ok(PySteppedRequest {
            inner: Mutex::new(stepped),
        })
    }

    /// Run a whole batch to completion; responses in request order.
    fn dispatch_request(
        &self,
        py: Python<'_>,
        requests: Vec<PyGenerationRequest>,
    ) -> PyResult<Vec<PyGenerationResponse>> {
        let requests = requests.into_iter().map(|r| r.0).collect();
        let responses = compute(py, || self.inner.dispatch_request(requests))?;
        Ok(responses.into_iter().map(PyGenerationResponse).collect())
    }

    fn count_prompt_tokens(&self, py: Python<'_>, request: PyGenerationRequest) -> PyResult<usize> {
        compute(py, || self.inner.count_prompt_tokens(&request.0))
    }

    fn capture_decoding_cuda_graph(&self, py: Python<'_>) -> PyResult<bool> {
        compute(py, || self.inner.capture_decoding_cuda_graph())
    }

    /// Prefill a system prompt (str, token ids or messages) and pin its full KV blocks; returns cached tokens.
    fn gen_and_save_system_prompt_kv_cache(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let prompt = prompt_from_py(prompt)?;
        compute(py, || {
            self.inner.gen_and_save_system_prompt_kv_cache(prompt)
        })
    }

    fn supports_stepped_execution(&self) -> bool {
        self.inner.supports_stepped_execution()
    }

    fn supports_boundary_scheduling(&self) -> bool {
        self.inner.supports_boundary_scheduling()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn owns_global_rank(&self, rank: usize) -> bool {
        self.inner.owns_global_rank(rank)
    }

    /// Whether every rank (all in this process) succeeded, and agreed, in the latest stepped command.
    fn local_ranks_succeeded(&self) -> bool {
        self.inner.local_ranks_succeeded()
    }

    /// Rank `rank`'s own StepResult of the latest prefill or decode, once; None otherwise. A rank's error raises.
    fn take_rank_response(&self, py: Python<'_>, rank: usize) -> PyResult<Option<PyStepResult>> {
        match self.inner.take_rank_response(rank) {
            None => Ok(None),
            Some(Ok(step)) => Ok(Some(PyStepResult(step))),
            Some(Err(e)) => Err(crate::errors::to_py(py, e)),
        }
    }

    /// Every rank's own pool counts, rank 0 first (one entry without tensor parallelism).
    fn rank_counts<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let state = compute(py, || self.inner.per_rank_state())?;
        state.iter().map(|(c, _)| counts_dict(py, c)).collect()
    }

    /// Testing only: make rank `rank` fail (raise, or panic when `panic`) in its next collective.
    #[pyo3(signature = (rank, panic=false))]
    fn _inject_rank_fault(&self, py: Python<'_>, rank: usize, panic: bool) -> PyResult<()> {
        let fault = if panic { stepllm_core::parallel::Fault::Panic } else { stepllm_core::parallel::Fault::Error };
        compute(py, || self.inner.inject_rank_fault(rank, fault))
    }

    /// Pool and cache counts (PoolCounts fields).
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = compute_ok(py, || self.inner.counts())?;
        counts_dict(py, &c)
    }

    /// What was loaded (ModelInfo fields).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        info_dict(py, self.inner.info())
    }

    fn __repr__(&self) -> String {
        let i = self.inner.info();
        format!(
            "RuntimeCoordinator(model={:?}, architecture={:?}, device={:?})",
            i.source, i.architecture, i.device
        )
    }
}

/// A stepped session. Usable from any Python thread; one operation runs at a time.
#[pyclass(module = "stepllm._core", name = "SteppedRequest", frozen)]
pub struct PySteppedRequest {
    inner: Mutex<SteppedRequest>,
}

impl PySteppedRequest {
    fn lock(&self) -> MutexGuard<'_, SteppedRequest> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PySteppedRequest {
    /// Stage 1 of admission: validate and tokenize; touches no resident state.
    fn build_intent(
        &self,
        py: Python<'_>,
        request: PyGenerationRequest,
        original_index: u32,
        request_id: u64,
    ) -> PyResult<PyAdmissionIntent> {
        let intent = compute(py, || {
            self.lock()
                .build_intent(request.0, original_index, request_id)
        })?;
        Ok(PyAdmissionIntent(intent))
    }

    /// Stages 2 and 3 for an intent: reserve (NO_CAPACITY / REJECTED change nothing) and seat.
    fn admit_intent(
        &self,
        py: Python<'_>,
        intent: PyAdmissionIntent,
    ) -> PyResult<PyAdmissionResult> {
        let result = compute(py, || self.lock().admit(intent.0))?;
        Ok(PyAdmissionResult(result))
    }

    /// build_intent then admit_intent.
    fn admit(
        &self,
        py: Python<'_>,
        request: PyGenerationRequest,
        original_index: u32,
        request_id: u64,
    ) -> PyResult<PyAdmissionResult> {
        Ok(PyAdmissionResult(compute(py, || self.lock().admit_request(request.0, original_index, request_id))?))
    }

    fn prefill(&self, py: Python<'_>, batch: PyImmutablePrefillBatch) -> PyResult<PyStepResult> {
        Ok(PyStepResult(compute(py, || self.lock().prefill(&batch.0))?))
    }

    /// Reserve and seat an intent into the group that one prefill_group tick computes together.
    fn admit_intent_into_group(&self, py: Python<'_>, intent: PyAdmissionIntent) -> PyResult<PyAdmissionResult> {
        Ok(PyAdmissionResult(compute(py, || self.lock().admit_into_group(intent.0))?))
    }

    /// build_intent then admit_intent_into_group.
    fn admit_into_group(
        &self,
        py: Python<'_>,
        request: PyGenerationRequest,
        original_index: u32,
        request_id: u64,
    ) -> PyResult<PyAdmissionResult> {
        Ok(PyAdmissionResult(compute(py, || self.lock().admit_request_into_group(request.0, original_index, request_id))?))
    }

    fn prefill_group(&self, py: Python<'_>, group: PyImmutablePrefillGroup) -> PyResult<PyStepResult> {
        Ok(PyStepResult(compute(py, || self.lock().prefill_group(&group.0))?))
    }

    fn decode(&self, py: Python<'_>, batch: PyImmutableDecodeBatch) -> PyResult<PyStepResult> {
        Ok(PyStepResult(compute(py, || self.lock().decode(&batch.0))?))
    }

    fn mixed(&self, py: Python<'_>, batch: PyImmutableMixedBatch) -> PyResult<PyStepResult> {
        Ok(PyStepResult(compute(py, || self.lock().mixed(&batch.0))?))
    }

    fn residents(&self, py: Python<'_>) -> PyResult<Vec<PyResidentRef>> {
        Ok(refs(&compute(py, || self.lock().residents())?))
    }

    fn seated(&self, py: Python<'_>) -> PyResult<Vec<PyResidentRef>> {
        Ok(refs(&compute(py, || self.lock().seated())?))
    }

    /// The caller's response for a finished sequence, trimmed at `stop_strings`.
    #[pyo3(signature = (result, stop_strings=Vec::new()))]
    fn materialize(
        &self,
        py: Python<'_>,
        result: PyBatchResult,
        stop_strings: Vec<String>,
    ) -> PyResult<PyGenerationResponse> {
        Ok(PyGenerationResponse(compute_ok(py, || {
            materialize(&result.0, &stop_strings)
        })?))
    }

    /// Once, when nothing is resident: the founder's response. Closes the session.
    fn finish(&self, py: Python<'_>) -> PyResult<PyGenerationResponse> {
        Ok(PyGenerationResponse(compute(py, || self.lock().finish())?))
    }

    /// Release everything; idempotent. Closes the session.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        compute(py, || self.lock().abort())
    }

    /// Latch a cancel: the next step naming `ref` reports it finished with CANCELLED.
    fn cancel(&self, py: Python<'_>, r#ref: PyResidentRef) -> PyResult<()> {
        compute(py, || self.lock().cancel(r#ref.0))
    }

    fn founder(&self, py: Python<'_>) -> PyResult<PyResidentRef> {
        Ok(PyResidentRef(compute_ok(py, || self.lock().founder())?))
    }

    /// Whether finish() or abort() has closed the session.
    #[getter]
    fn closed(&self, py: Python<'_>) -> PyResult<bool> {
        compute_ok(py, || self.lock().is_closed())
    }

    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = compute_ok(py, || self.lock().counts())?;
        counts_dict(py, &c)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a `with` block aborts whatever is still open (a finished session is left as it is).
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Py<PyAny>,
        _exc: Py<PyAny>,
        _tb: Py<PyAny>,
    ) -> PyResult<bool> {
        self.abort(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let s = self.lock();
        let f = s.founder();
        format!(
            "SteppedRequest(founder=ResidentRef(slot={}, epoch={}), closed={})",
            f.slot,
            f.epoch,
            s.is_closed()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRuntimeCoordinator>()?;
    m.add_class::<PySteppedRequest>()?;
    Ok(())
}

/// Load a coordinator, forwarding the loader's (done, total) progress to an optional Python callable.
/// A callback that raises is ignored: progress display must never fail a load.
pub fn load_coordinator(
    config: stepllm_core::coordinator::Config,
    progress: Option<Py<PyAny>>,
) -> stepllm_core::Result<RuntimeCoordinator> {
    let report = progress.map(|cb| {
        move |done: usize, total: usize| {
            Python::attach(|py| {
                let _ = cb.call1(py, (done, total));
            })
        }
    });
    RuntimeCoordinator::with_progress(config, report.as_ref().map(|f| f as _))
}
