//! The Python exception hierarchy and the mapping from the core's one error enum onto it, plus `compute`:
//! the single way a binding runs core work (GIL released, panics caught, errors mapped).

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use stepllm_core::Error;

/// The exception classes, made once per interpreter with `type(name, bases, namespace)` so that
/// `InvalidRequestError` can derive from both `StepllmError` and `ValueError`.
pub struct Exceptions {
    pub base: Py<PyType>,
    pub invalid_request: Py<PyType>,
    pub protocol: Py<PyType>,
    pub stale_ref: Py<PyType>,
    pub model_load: Py<PyType>,
    pub device: Py<PyType>,
}

static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

fn make_type<'py>(
    py: Python<'py>,
    name: &str,
    bases: Vec<Bound<'py, PyAny>>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "stepllm._core")?;
    namespace.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases)?;
    let ty = py.get_type::<PyType>().call1((name, bases, namespace))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

pub fn exceptions(py: Python<'_>) -> PyResult<&Exceptions> {
    EXCEPTIONS.get_or_try_init(py, || {
        let base = make_type(py, "StepllmError", vec![py.get_type::<PyException>().into_any()], "Base class of every stepllm error.")?;
        let b = || base.bind(py).clone().into_any();
        let invalid_request = make_type(
            py,
            "InvalidRequestError",
            vec![b(), py.get_type::<PyValueError>().into_any()],
            "The request can never be served as given (bad prompt, bad sampling value, too long, ...).",
        )?;
        let protocol = make_type(
            py,
            "ProtocolError",
            vec![b(), py.get_type::<PyRuntimeError>().into_any()],
            "An operation arrived in the wrong order or in the wrong state.",
        )?;
        let stale_ref = make_type(
            py,
            "StaleRefError",
            vec![protocol.bind(py).clone().into_any()],
            "A ResidentRef whose slot was released (its epoch moved on) or never existed.",
        )?;
        let model_load = make_type(py, "ModelLoadError", vec![b()], "Model files missing, corrupt or of an unsupported kind.")?;
        let device = make_type(py, "DeviceError", vec![b()], "The compute device failed or is unavailable.")?;
        Ok::<_, PyErr>(Exceptions { base, invalid_request, protocol, stale_ref, model_load, device })
    })
}

/// Add the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let e = exceptions(py)?;
    m.add("StepllmError", e.base.bind(py))?;
    m.add("InvalidRequestError", e.invalid_request.bind(py))?;
    m.add("ProtocolError", e.protocol.bind(py))?;
    m.add("StaleRefError", e.stale_ref.bind(py))?;
    m.add("ModelLoadError", e.model_load.bind(py))?;
    m.add("DeviceError", e.device.bind(py))?;
    Ok(())
}

fn raise(py: Python<'_>, pick: impl FnOnce(&Exceptions) -> &Py<PyType>, msg: String) -> PyErr {
    match exceptions(py) {
        Ok(e) => PyErr::from_type(pick(e).bind(py).clone(), msg),
        Err(err) => err,
    }
}

/// Map a core error onto its Python exception; the message is the core's Display text.
pub fn to_py(py: Python<'_>, err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::InvalidRequest(_) => raise(py, |e| &e.invalid_request, msg),
        Error::Protocol(_) => raise(py, |e| &e.protocol, msg),
        Error::StaleRef { .. } => raise(py, |e| &e.stale_ref, msg),
        Error::Load(_) => raise(py, |e| &e.model_load, msg),
        Error::Device(_) => raise(py, |e| &e.device, msg),
        Error::Internal(_) => raise(py, |e| &e.base, msg),
    }
}

pub fn invalid(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    to_py(py, Error::InvalidRequest(msg.into()))
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Run core work with the GIL released. A panic becomes `StepllmError` (internal error); it never unwinds
/// into Python's frames.
pub fn compute<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: FnOnce() -> stepllm_core::Result<T> + Send,
    T: Send,
{
    let outcome = py.detach(|| catch_unwind(AssertUnwindSafe(f)).map_err(panic_message));
    match outcome {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(panic) => Err(to_py(
            py,
            Error::Internal(format!("panic in the runtime: {panic}")),
        )),
    }
}

/// Like `compute` for infallible core work.
pub fn compute_ok<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    compute(py, || Ok(f()))
}
