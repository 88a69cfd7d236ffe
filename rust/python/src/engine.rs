//! Engine (the core's RequestEngine actor) and RequestStream: submit from any thread, iterate a request's
//! chunks with the GIL released while waiting, synchronously or with `async for`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use stepllm_core::engine::{EngineEvent, RequestEngine};
use stepllm_core::request::GenerationResponse;
use stepllm_core::Error;

use crate::config::PyConfig;
use crate::coordinator::{counts_dict, info_dict, load_coordinator};
use crate::errors::{compute, compute_ok, to_py};
use crate::request::{PyGenerationRequest, PyGenerationResponse};
use crate::types::token_delta_class;

/// How long one blocking wait lasts before Python gets a chance to handle signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

type Shared = Arc<RwLock<Option<RequestEngine>>>;

fn read(engine: &Shared) -> RwLockReadGuard<'_, Option<RequestEngine>> {
    engine.read().unwrap_or_else(|p| p.into_inner())
}

fn shut_down() -> Error {
    Error::Protocol("the engine has shut down; create a new one".into())
}

#[pyclass(module = "stepllm._core", name = "Engine", frozen)]
pub struct PyEngine {
    inner: Shared,
}

#[pymethods]
impl PyEngine {
    /// Load the model and start the engine thread.
    #[new]
    #[pyo3(signature = (config=None, progress=None))]
    fn new(py: Python<'_>, config: Option<PyConfig>, progress: Option<Py<PyAny>>) -> PyResult<Self> {
        let config = PyConfig::resolve(py, config)?;
        let engine = compute(py, move || RequestEngine::new(load_coordinator(config, progress)?))?;
        Ok(Self {
            inner: Arc::new(RwLock::new(Some(engine))),
        })
    }

    /// Validate and tokenize now (bad input raises here), then queue. Returns the request's stream.
    fn submit(&self, py: Python<'_>, request: PyGenerationRequest) -> PyResult<PyRequestStream> {
        let handle = compute(py, || {
            read(&self.inner)
                .as_ref()
                .ok_or_else(shut_down)?
                .submit(request.0)
        })?;
        Ok(PyRequestStream {
            request_id: handle.id,
            events: Mutex::new(handle.events),
            engine: Arc::clone(&self.inner),
            response: Mutex::new(None),
            done: AtomicBool::new(false),
        })
    }

    /// Cancel a request wherever it is; its stream ends with CANCELLED. Unknown ids are ignored.
    fn cancel(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        compute_ok(py, || {
            if let Some(e) = read(&self.inner).as_ref() {
                e.cancel(request_id)
            }
        })
    }

    /// Load and resources: waiting, running, counts (PoolCounts fields), prompt_tokens, cached_prompt_tokens,
    /// generated_tokens, finished (per finish reason), steps.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = compute(py, || {
            Ok(read(&self.inner).as_ref().ok_or_else(shut_down)?.stats())
        })?;
        let d = PyDict::new(py);
        d.set_item("waiting", s.waiting)?;
        d.set_item("running", s.running)?;
        d.set_item("counts", counts_dict(py, &s.counts)?)?;
        d.set_item("prompt_tokens", s.prompt_tokens)?;
        d.set_item("cached_prompt_tokens", s.cached_prompt_tokens)?;
        d.set_item("generated_tokens", s.generated_tokens)?;
        d.set_item("finished", s.finished)?;
        d.set_item("steps", s.steps)?;
        Ok(d)
    }

    /// What was loaded (ModelInfo fields).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = compute(py, || {
            Ok(read(&self.inner)
                .as_ref()
                .ok_or_else(shut_down)?
                .coordinator()
                .info()
                .clone())
        })?;
        info_dict(py, &info)
    }

    /// Prompt tokens of a request as the model will see it (chat template applied).
    fn count_prompt_tokens(&self, py: Python<'_>, request: PyGenerationRequest) -> PyResult<usize> {
        compute(py, || read(&self.inner).as_ref().ok_or_else(shut_down)?.coordinator().count_prompt_tokens(&request.0))
    }

    /// The token ids of a request's prompt as the model will see it (chat template applied).
    fn tokenize(&self, py: Python<'_>, request: PyGenerationRequest) -> PyResult<Vec<u32>> {
        compute(py, || read(&self.inner).as_ref().ok_or_else(shut_down)?.coordinator().prompt_ids(&request.0))
    }

    /// The text of one token id, special tokens included (for logprob displays).
    fn decode_token(&self, py: Python<'_>, token_id: u32) -> PyResult<String> {
        compute(py, || read(&self.inner).as_ref().ok_or_else(shut_down)?.decode_token(token_id))
    }

    /// The text of token ids (special tokens included unless skipped).
    #[pyo3(signature = (token_ids, skip_special_tokens=false))]
    fn decode(&self, py: Python<'_>, token_ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        compute(py, || read(&self.inner).as_ref().ok_or_else(shut_down)?.decode(&token_ids, skip_special_tokens))
    }

    /// The bytes of one token id, which may be part of a UTF-8 character (logprobs `bytes`).
    fn token_bytes<'py>(&self, py: Python<'py>, token_id: u32) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = compute(py, || read(&self.inner).as_ref().ok_or_else(shut_down)?.token_bytes(token_id))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Pool and cache counts (PoolCounts fields).
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = compute(py, || {
            Ok(read(&self.inner)
                .as_ref()
                .ok_or_else(shut_down)?
                .coordinator()
                .counts())
        })?;
        counts_dict(py, &c)
    }

    /// Stop the engine thread; unfinished requests end with CANCELLED. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        compute_ok(py, move || {
            let engine = inner.write().unwrap_or_else(|p| p.into_inner()).take();
            drop(engine); // RequestEngine's Drop shuts the actor down and joins it
        })
    }

    #[getter]
    fn is_shut_down(&self) -> bool {
        read(&self.inner).is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Py<PyAny>,
        _exc: Py<PyAny>,
        _tb: Py<PyAny>,
    ) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }
}

// A stream's piece: the engine's TokenDelta of one step.
token_delta_class!(PyStreamChunk, "StreamChunk");

/// One request's stream: StreamChunk items, then the GenerationResponse in `response`.
#[pyclass(module = "stepllm._core", name = "RequestStream", frozen)]
pub struct PyRequestStream {
    request_id: u64,
    events: Mutex<Receiver<EngineEvent>>,
    engine: Shared,
    response: Mutex<Option<GenerationResponse>>,
    done: AtomicBool,
}

enum Polled {
    Chunk(PyStreamChunk),
    End,
    Timeout,
}

impl PyRequestStream {
    fn response_slot(&self) -> MutexGuard<'_, Option<GenerationResponse>> {
        self.response.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait up to `timeout` (GIL released) for the next event.
    fn poll(&self, py: Python<'_>, timeout: Duration) -> PyResult<Polled> {
        if self.done.load(Ordering::SeqCst) {
            return Ok(Polled::End);
        }
        let event = compute_ok(py, || {
            self.events
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .recv_timeout(timeout)
        })?;
        match event {
            Ok(EngineEvent::Delta(delta)) => Ok(Polled::Chunk(PyStreamChunk(delta))),
            Ok(EngineEvent::Finished(response)) => {
                *self.response_slot() = Some(response);
                self.done.store(true, Ordering::SeqCst);
                Ok(Polled::End)
            }
            Err(RecvTimeoutError::Timeout) => Ok(Polled::Timeout),
            Err(RecvTimeoutError::Disconnected) => {
                if self.done.swap(true, Ordering::SeqCst) || self.response_slot().is_some() {
                    return Ok(Polled::End);
                }
                Err(to_py(
                    py,
                    Error::Internal(format!(
                        "the engine stopped before finishing request {}",
                        self.request_id
                    )),
                ))
            }
        }
    }

    /// Block (GIL released, signals checked) until a chunk or the end.
    fn next_blocking(&self, py: Python<'_>) -> PyResult<Option<PyStreamChunk>> {
        loop {
            match self.poll(py, SIGNAL_POLL)? {
                Polled::Chunk(c) => return Ok(Some(c)),
                Polled::End => return Ok(None),
                Polled::Timeout => py.check_signals()?,
            }
        }
    }
}

#[pymethods]
impl PyRequestStream {
    #[getter]
    fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The final response once the stream has ended, else None.
    #[getter]
    fn response(&self) -> Option<PyGenerationResponse> {
        self.response_slot().clone().map(PyGenerationResponse)
    }

    #[getter]
    fn finished(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// Cancel this request; the stream still ends normally, with finish reason CANCELLED.
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        compute_ok(py, || {
            if let Some(e) = read(&self.engine).as_ref() {
                e.cancel(self.request_id)
            }
        })
    }

    /// Drain the rest of the stream and return the final response.
    fn wait(&self, py: Python<'_>) -> PyResult<PyGenerationResponse> {
        while self.next_blocking(py)?.is_some() {}
        self.response().ok_or_else(|| {
            to_py(
                py,
                Error::Internal("stream ended without a response".into()),
            )
        })
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyStreamChunk>> {
        self.next_blocking(py)
    }

    /// For async iteration: wait at most `timeout` seconds. Returns (ended, chunk); (False, None) on timeout.
    fn _poll(&self, py: Python<'_>, timeout: f64) -> PyResult<(bool, Option<PyStreamChunk>)> {
        let timeout = Duration::try_from_secs_f64(timeout.max(0.0)).unwrap_or(SIGNAL_POLL);
        Ok(match self.poll(py, timeout)? {
            Polled::Chunk(c) => (false, Some(c)),
            Polled::End => (true, None),
            Polled::Timeout => (false, None),
        })
    }

    /// `async for chunk in stream`: waits run in a worker thread, so the event loop never blocks.
    fn __aiter__(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(py
            .import("stepllm._aio")?
            .getattr("aiter_stream")?
            .call1((slf,))?
            .unbind())
    }

    fn __repr__(&self) -> String {
        format!(
            "RequestStream(request_id={}, finished={})",
            self.request_id,
            self.finished()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PyStreamChunk>()?;
    m.add_class::<PyRequestStream>()?;
    Ok(())
}
