//! Value types of the stepped control plane: identities, step records, admission records. Each wraps the
//! core type it mirrors; getters convert on access.

use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;
use stepllm_core::ids::{ResidentRef, SequenceIdentity};
use stepllm_core::step::{
    AdmissionIntent, AdmissionResult, AdmissionStatus, BatchResult, ImmutableDecodeBatch, ImmutableMixedBatch,
    ImmutablePrefillBatch, ImmutablePrefillGroup, ScheduledSequenceDescriptor, SequenceWork, StepExecution, StepResult,
};

use crate::request::{PyFinishReason, PyGenerationRequest, PyTokenLogprob};

/// `repr()` of any convertible value, for building reprs that show every field.
pub fn repr_of<'py, T: IntoPyObject<'py>>(py: Python<'py>, v: T) -> PyResult<String> {
    Ok(v.into_bound_py_any(py)?.repr()?.to_string())
}

/// `field=repr`, one argument of a repr.
pub fn repr_field<'py, T: IntoPyObject<'py>>(py: Python<'py>, field: &str, v: T) -> PyResult<String> {
    Ok(format!("{field}={}", repr_of(py, v)?))
}

/// `Name(arguments...)`.
pub fn repr_call(name: &str, parts: &[String]) -> String {
    format!("{name}({})", parts.join(", "))
}

/// `Name(field=repr, ...)`.
macro_rules! py_repr {
    ($py:expr, $name:expr, $($field:literal => $value:expr),* $(,)?) => {{
        let parts: Vec<String> = vec![$($crate::types::repr_field($py, $field, $value)?),*];
        Ok::<String, pyo3::PyErr>($crate::types::repr_call($name, &parts))
    }};
}
pub(crate) use py_repr;

#[pyclass(
    module = "stepllm._core",
    name = "ResidentRef",
    frozen,
    eq,
    ord,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PyResidentRef(pub ResidentRef);

#[pymethods]
impl PyResidentRef {
    #[new]
    fn new(slot: u32, epoch: u32) -> Self {
        Self(ResidentRef { slot, epoch })
    }
    #[getter]
    fn slot(&self) -> u32 {
        self.0.slot
    }
    #[getter]
    fn epoch(&self) -> u32 {
        self.0.epoch
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ResidentRef", "slot" => self.0.slot, "epoch" => self.0.epoch)
    }
}

pub fn refs(v: &[ResidentRef]) -> Vec<PyResidentRef> {
    v.iter().copied().map(PyResidentRef).collect()
}

/// The other way: the core refs of Python ones.
fn core_refs(v: Vec<PyResidentRef>) -> Vec<ResidentRef> {
    v.into_iter().map(|r| r.0).collect()
}

#[pyclass(
    module = "stepllm._core",
    name = "SequenceIdentity",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PySequenceIdentity(pub SequenceIdentity);

#[pymethods]
impl PySequenceIdentity {
    #[new]
    fn new(request_id: u64, original_index: u32, resident: PyResidentRef) -> Self {
        Self(SequenceIdentity {
            request_id,
            original_index,
            resident: resident.0,
        })
    }
    #[getter]
    fn request_id(&self) -> u64 {
        self.0.request_id
    }
    #[getter]
    fn original_index(&self) -> u32 {
        self.0.original_index
    }
    #[getter]
    fn resident(&self) -> PyResidentRef {
        PyResidentRef(self.0.resident)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "SequenceIdentity",
            "request_id" => self.0.request_id, "original_index" => self.0.original_index, "resident" => self.resident())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "SequenceWork",
    frozen,
    eq,
    hash,
    from_py_object,
    rename_all = "SCREAMING_SNAKE_CASE"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PySequenceWork {
    Context,
    Decode,
    Mixed,
}

impl From<SequenceWork> for PySequenceWork {
    fn from(w: SequenceWork) -> Self {
        match w {
            SequenceWork::Context => Self::Context,
            SequenceWork::Decode => Self::Decode,
            SequenceWork::Mixed => Self::Mixed,
        }
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "ScheduledSequenceDescriptor",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyScheduledSequenceDescriptor(pub ScheduledSequenceDescriptor);

#[pymethods]
impl PyScheduledSequenceDescriptor {
    #[getter]
    fn identity(&self) -> PySequenceIdentity {
        PySequenceIdentity(self.0.identity)
    }
    #[getter]
    fn work(&self) -> PySequenceWork {
        self.0.work.into()
    }
    #[getter]
    fn query_length(&self) -> usize {
        self.0.query_length
    }
    #[getter]
    fn past_length(&self) -> usize {
        self.0.past_length
    }
    #[getter]
    fn select_last_token_logits(&self) -> bool {
        self.0.select_last_token_logits
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ScheduledSequenceDescriptor",
            "identity" => self.identity(), "work" => self.work(), "query_length" => self.0.query_length,
            "past_length" => self.0.past_length, "select_last_token_logits" => self.0.select_last_token_logits)
    }
}

/// A Python class over the core's TokenDelta: the stepped API's `TokenDelta` and the engine stream's
/// `StreamChunk` are the same value under two names.
macro_rules! token_delta_class {
    ($rust:ident, $name:literal) => {
        #[pyclass(module = "stepllm._core", name = $name, frozen, eq, from_py_object)]
        #[derive(Debug, Clone, PartialEq)]
        pub struct $rust(pub stepllm_core::step::TokenDelta);

        #[pymethods]
        impl $rust {
            #[new]
            #[pyo3(signature = (token_ids, text, logprobs=None, prompt_logprobs=None))]
            fn new(
                token_ids: Vec<u32>,
                text: String,
                logprobs: Option<Vec<$crate::request::PyTokenLogprob>>,
                prompt_logprobs: Option<Vec<Option<$crate::request::PyTokenLogprob>>>,
            ) -> Self {
                let logprobs = logprobs.map(|l| l.into_iter().map(|lp| lp.0).collect());
                let prompt_logprobs = prompt_logprobs.map(|l| l.into_iter().map(|lp| lp.map(|lp| lp.0)).collect());
                Self(stepllm_core::step::TokenDelta { token_ids: token_ids.into(), text: text.into(), logprobs, prompt_logprobs })
            }
            #[getter]
            fn token_ids(&self) -> Vec<u32> {
                self.0.token_ids.to_vec()
            }
            #[getter]
            fn text(&self) -> &str {
                &self.0.text
            }
            /// One per token when the request asked for logprobs, else None.
            #[getter]
            fn logprobs(&self) -> Option<Vec<$crate::request::PyTokenLogprob>> {
                $crate::request::PyTokenLogprob::list(&self.0.logprobs)
            }
            /// The whole prompt's logprobs (None for its first token) on a request's first delta when it asked
            /// for prompt_logprobs, else None.
            #[getter]
            fn prompt_logprobs(&self) -> Option<Vec<Option<$crate::request::PyTokenLogprob>>> {
                $crate::request::PyTokenLogprob::prompt_list(&self.0.prompt_logprobs)
            }
            fn __hash__(&self) -> u64 {
                $crate::hashing::py_hash(&self.0)
            }
            /// Its constructor call: logprobs and prompt_logprobs only where present (most deltas have neither).
            fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
                use $crate::types::repr_field;
                let mut parts =
                    vec![repr_field(py, "token_ids", self.0.token_ids.to_vec())?, repr_field(py, "text", self.0.text.as_str())?];
                if self.0.logprobs.is_some() {
                    parts.push(repr_field(py, "logprobs", self.logprobs())?);
                }
                if self.0.prompt_logprobs.is_some() {
                    parts.push(repr_field(py, "prompt_logprobs", self.prompt_logprobs())?);
                }
                Ok($crate::types::repr_call($name, &parts))
            }
        }
    };
}
pub(crate) use token_delta_class;

token_delta_class!(PyTokenDelta, "TokenDelta");

#[pyclass(
    module = "stepllm._core",
    name = "StepExecution",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyStepExecution(pub StepExecution);

#[pymethods]
impl PyStepExecution {
    #[getter]
    fn rows(&self) -> usize {
        self.0.rows
    }
    #[getter]
    fn tokens(&self) -> usize {
        self.0.tokens
    }
    #[getter]
    fn elapsed_us(&self) -> u64 {
        self.0.elapsed_us
    }
    /// Part of `elapsed_us` the step's forward spent blocked waiting for the device (0 on the CPU); the
    /// step's host time is `elapsed_us - device_wait_us`.
    #[getter]
    fn device_wait_us(&self) -> u64 {
        self.0.device_wait_us
    }
    #[getter]
    fn cuda_graph(&self) -> bool {
        self.0.cuda_graph
    }
    #[getter]
    fn metadata_on_device(&self) -> bool {
        self.0.metadata_on_device
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "StepExecution", "rows" => self.0.rows, "tokens" => self.0.tokens,
            "elapsed_us" => self.0.elapsed_us, "device_wait_us" => self.0.device_wait_us,
            "cuda_graph" => self.0.cuda_graph, "metadata_on_device" => self.0.metadata_on_device)
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "BatchResult",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyBatchResult(pub BatchResult);

#[pymethods]
impl PyBatchResult {
    #[getter]
    fn identity(&self) -> PySequenceIdentity {
        PySequenceIdentity(self.0.identity)
    }
    #[getter]
    fn prompt_ids(&self) -> Vec<u32> {
        self.0.prompt_ids.clone()
    }
    #[getter]
    fn output_ids(&self) -> Vec<u32> {
        self.0.output_ids.clone()
    }
    #[getter]
    fn text(&self) -> &str {
        &self.0.text
    }
    #[getter]
    fn finish_reason(&self) -> PyFinishReason {
        self.0.finish_reason.into()
    }
    #[getter]
    fn stop_reason(&self) -> Option<String> {
        self.0.stop_reason.clone()
    }
    #[getter]
    fn logprobs(&self) -> Option<Vec<PyTokenLogprob>> {
        PyTokenLogprob::list(&self.0.logprobs)
    }
    /// With `prompt_logprobs`: one entry per prompt token, None for the first.
    #[getter]
    fn prompt_logprobs(&self) -> Option<Vec<Option<PyTokenLogprob>>> {
        PyTokenLogprob::prompt_list(&self.0.prompt_logprobs)
    }
    #[getter]
    fn cached_prompt_tokens(&self) -> usize {
        self.0.cached_prompt_tokens
    }
    #[getter]
    fn error(&self) -> Option<String> {
        self.0.error.clone()
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "BatchResult",
            "identity" => self.identity(), "prompt_ids" => self.prompt_ids(), "output_ids" => self.output_ids(),
            "text" => self.text(), "finish_reason" => self.finish_reason(), "stop_reason" => self.stop_reason(),
            "logprobs" => self.logprobs(), "prompt_logprobs" => self.prompt_logprobs(),
            "cached_prompt_tokens" => self.0.cached_prompt_tokens, "error" => self.error())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "StepResult",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyStepResult(pub StepResult);

#[pymethods]
impl PyStepResult {
    #[getter]
    fn ok(&self) -> bool {
        self.0.ok
    }
    #[getter]
    fn work(&self) -> PySequenceWork {
        self.0.work.into()
    }
    #[getter]
    fn step_id(&self) -> u64 {
        self.0.step_id
    }
    #[getter]
    fn participants(&self) -> Vec<PyScheduledSequenceDescriptor> {
        self.0
            .participants
            .iter()
            .copied()
            .map(PyScheduledSequenceDescriptor)
            .collect()
    }
    #[getter]
    fn execution(&self) -> PyStepExecution {
        PyStepExecution(self.0.execution)
    }
    #[getter]
    fn deltas(&self) -> Vec<(PyResidentRef, PyTokenDelta)> {
        self.0
            .deltas
            .iter()
            .map(|(r, d)| (PyResidentRef(*r), PyTokenDelta(d.clone())))
            .collect()
    }
    #[getter]
    fn finished(&self) -> Vec<(PyResidentRef, PyBatchResult)> {
        self.0
            .finished
            .iter()
            .map(|(r, b)| (PyResidentRef(*r), PyBatchResult(b.clone())))
            .collect()
    }
    #[getter]
    fn published_prefix(&self) -> bool {
        self.0.published_prefix
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "StepResult",
            "ok" => self.0.ok, "work" => self.work(), "step_id" => self.0.step_id, "participants" => self.participants(),
            "execution" => self.execution(), "deltas" => self.deltas(), "finished" => self.finished(),
            "published_prefix" => self.0.published_prefix)
    }
}

/// Built by `SteppedRequest.build_intent` only: it is the proof that validation and tokenization happened.
#[pyclass(
    module = "stepllm._core",
    name = "AdmissionIntent",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyAdmissionIntent(pub AdmissionIntent);

#[pymethods]
impl PyAdmissionIntent {
    #[getter]
    fn request_id(&self) -> u64 {
        self.0.request_id
    }
    #[getter]
    fn original_index(&self) -> u32 {
        self.0.original_index
    }
    #[getter]
    fn prompt_ids(&self) -> Vec<u32> {
        self.0.prompt_ids.clone()
    }
    #[getter]
    fn request(&self) -> PyGenerationRequest {
        PyGenerationRequest(self.0.request.clone())
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "AdmissionIntent", "request_id" => self.0.request_id, "original_index" => self.0.original_index,
            "prompt_ids" => self.prompt_ids(), "request" => self.request())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "AdmissionStatus",
    frozen,
    eq,
    hash,
    from_py_object,
    rename_all = "SCREAMING_SNAKE_CASE"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PyAdmissionStatus {
    Admitted,
    NoCapacity,
    Rejected,
}

impl From<AdmissionStatus> for PyAdmissionStatus {
    fn from(s: AdmissionStatus) -> Self {
        match s {
            AdmissionStatus::Admitted => Self::Admitted,
            AdmissionStatus::NoCapacity => Self::NoCapacity,
            AdmissionStatus::Rejected => Self::Rejected,
        }
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "AdmissionResult",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyAdmissionResult(pub AdmissionResult);

#[pymethods]
impl PyAdmissionResult {
    #[getter]
    fn status(&self) -> PyAdmissionStatus {
        self.0.status.into()
    }
    /// The seated resident when admitted, else None.
    #[getter(r#ref)]
    fn get_ref(&self) -> Option<PyResidentRef> {
        self.0.resident.map(PyResidentRef)
    }
    /// Alias of `ref`.
    #[getter]
    fn resident(&self) -> Option<PyResidentRef> {
        self.get_ref()
    }
    #[getter]
    fn reason(&self) -> Option<String> {
        self.0.reason.clone()
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "AdmissionResult", "status" => self.status(), "ref" => self.get_ref(), "reason" => self.reason())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "ImmutablePrefillBatch",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyImmutablePrefillBatch(pub ImmutablePrefillBatch);

#[pymethods]
impl PyImmutablePrefillBatch {
    #[new]
    fn new(target: PyResidentRef) -> Self {
        Self(ImmutablePrefillBatch { target: target.0 })
    }
    #[getter]
    fn target(&self) -> PyResidentRef {
        PyResidentRef(self.0.target)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ImmutablePrefillBatch", "target" => self.target())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "ImmutablePrefillGroup",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyImmutablePrefillGroup(pub ImmutablePrefillGroup);

#[pymethods]
impl PyImmutablePrefillGroup {
    #[new]
    fn new(targets: Vec<PyResidentRef>) -> Self {
        Self(ImmutablePrefillGroup {
            targets: core_refs(targets),
        })
    }
    #[getter]
    fn targets(&self) -> Vec<PyResidentRef> {
        refs(&self.0.targets)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ImmutablePrefillGroup", "targets" => self.targets())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "ImmutableDecodeBatch",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyImmutableDecodeBatch(pub ImmutableDecodeBatch);

#[pymethods]
impl PyImmutableDecodeBatch {
    #[new]
    fn new(residents: Vec<PyResidentRef>) -> Self {
        Self(ImmutableDecodeBatch {
            residents: core_refs(residents),
        })
    }
    #[getter]
    fn residents(&self) -> Vec<PyResidentRef> {
        refs(&self.0.residents)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ImmutableDecodeBatch", "residents" => self.residents())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "ImmutableMixedBatch",
    frozen,
    eq,
    hash,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyImmutableMixedBatch(pub ImmutableMixedBatch);

#[pymethods]
impl PyImmutableMixedBatch {
    #[new]
    fn new(residents: Vec<PyResidentRef>, targets: Vec<PyResidentRef>) -> Self {
        Self(ImmutableMixedBatch {
            residents: core_refs(residents),
            targets: core_refs(targets),
        })
    }
    #[getter]
    fn residents(&self) -> Vec<PyResidentRef> {
        refs(&self.0.residents)
    }
    #[getter]
    fn targets(&self) -> Vec<PyResidentRef> {
        refs(&self.0.targets)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ImmutableMixedBatch", "residents" => self.residents(), "targets" => self.targets())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyResidentRef>()?;
    m.add_class::<PySequenceIdentity>()?;
    m.add_class::<PySequenceWork>()?;
    m.add_class::<PyScheduledSequenceDescriptor>()?;
    m.add_class::<PyTokenDelta>()?;
    m.add_class::<PyStepExecution>()?;
    m.add_class::<PyBatchResult>()?;
    m.add_class::<PyStepResult>()?;
    m.add_class::<PyAdmissionIntent>()?;
    m.add_class::<PyAdmissionStatus>()?;
    m.add_class::<PyAdmissionResult>()?;
    m.add_class::<PyImmutablePrefillBatch>()?;
    m.add_class::<PyImmutablePrefillGroup>()?;
    m.add_class::<PyImmutableDecodeBatch>()?;
    m.add_class::<PyImmutableMixedBatch>()?;
    Ok(())
}
