//! Configuration: Config, ContextCacheConfig, ParallelConfig. Unset values take the core's defaults; a
//! model of None is resolved by the Python function `stepllm.models.default_model_path()` when a runtime is
//! built from the config.

use std::path::PathBuf;

use pyo3::prelude::*;
use stepllm_core::backend::KvCacheDtype;
use stepllm_core::coordinator::{Config, ParallelConfig};
use stepllm_core::model::WeightDtype;
use stepllm_core::state::context_cache::{CommitPolicy, ContextCacheConfig, LookupPolicy};

use crate::errors::{invalid, to_py};
use crate::types::py_repr;

#[pyclass(
    module = "stepllm._core",
    name = "ContextCacheConfig",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyContextCacheConfig(pub ContextCacheConfig);

fn lookup_name(l: LookupPolicy) -> &'static str {
    match l {
        LookupPolicy::Use => "use",
        LookupPolicy::Bypass => "bypass",
    }
}

fn commit_name(c: CommitPolicy) -> &'static str {
    match c {
        CommitPolicy::PrefillOnly => "prefill",
        CommitPolicy::IncludingGenerated => "generated",
    }
}

#[pymethods]
impl PyContextCacheConfig {
    /// lookup: "use" | "bypass"; commit: "prefill" | "generated"; max_records 0 = as many as the pool holds.
    #[new]
    #[pyo3(signature = (enabled=None, lookup=None, commit=None, max_records=None))]
    fn new(
        py: Python<'_>,
        enabled: Option<bool>,
        lookup: Option<&str>,
        commit: Option<&str>,
        max_records: Option<usize>,
    ) -> PyResult<Self> {
        let mut c = ContextCacheConfig::default();
        if let Some(v) = enabled {
            c.enabled = v;
        }
        if let Some(v) = lookup {
            c.lookup = match v {
                "use" => LookupPolicy::Use,
                "bypass" => LookupPolicy::Bypass,
                other => {
                    return Err(invalid(
                        py,
                        format!("lookup must be \"use\" or \"bypass\", got {other:?}"),
                    ))
                }
            };
        }
        if let Some(v) = commit {
            c.commit = match v {
                "prefill" => CommitPolicy::PrefillOnly,
                "generated" => CommitPolicy::IncludingGenerated,
                other => {
                    return Err(invalid(
                        py,
                        format!("commit must be \"prefill\" or \"generated\", got {other:?}"),
                    ))
                }
            };
        }
        if let Some(v) = max_records {
            c.max_records = v;
        }
        Ok(Self(c))
    }
    #[getter]
    fn enabled(&self) -> bool {
        self.0.enabled
    }
    #[getter]
    fn lookup(&self) -> &'static str {
        lookup_name(self.0.lookup)
    }
    #[getter]
    fn commit(&self) -> &'static str {
        commit_name(self.0.commit)
    }
    #[getter]
    fn max_records(&self) -> usize {
        self.0.max_records
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ContextCacheConfig", "enabled" => self.0.enabled, "lookup" => self.lookup(),
            "commit" => self.commit(), "max_records" => self.0.max_records)
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "ParallelConfig",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyParallelConfig(pub ParallelConfig);

#[pymethods]
impl PyParallelConfig {
    #[new]
    #[pyo3(signature = (tensor_parallel_size=None, devices=None))]
    fn new(tensor_parallel_size: Option<usize>, devices: Option<Vec<usize>>) -> Self {
        let mut p = ParallelConfig::default();
        if let Some(v) = tensor_parallel_size {
            p.tensor_parallel_size = v;
        }
        if let Some(v) = devices {
            p.devices = v;
        }
        Self(p)
    }
    #[getter]
    fn tensor_parallel_size(&self) -> usize {
        self.0.tensor_parallel_size
    }
    #[getter]
    fn devices(&self) -> Vec<usize> {
        self.0.devices.clone()
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "ParallelConfig", "tensor_parallel_size" => self.0.tensor_parallel_size, "devices" => self.devices())
    }
}

/// The runtime configuration. `model` None means the default model, found when a runtime is built.
#[pyclass(module = "stepllm._core", name = "Config", frozen, eq, from_py_object)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyConfig {
    pub model: Option<String>,
    /// The core config with an empty model path; `to_core` fills it in.
    pub inner: Config,
}

impl PyConfig {
    /// The core config, resolving a missing model through `stepllm.models.default_model_path()`.
    pub fn to_core(&self, py: Python<'_>) -> PyResult<Config> {
        let model = match &self.model {
            Some(m) => m.clone(),
            None => py
                .import("stepllm.models")?
                .getattr("default_model_path")?
                .call0()?
                .extract::<String>()?,
        };
        Ok(Config {
            model,
            ..self.inner.clone()
        })
    }

    pub fn resolve(py: Python<'_>, config: Option<PyConfig>) -> PyResult<Config> {
        match config {
            Some(c) => c.to_core(py),
            None => Self::default_config().to_core(py),
        }
    }

    fn default_config() -> Self {
        Self {
            model: None,
            inner: Config::new(""),
        }
    }
}

#[pymethods]
impl PyConfig {
    /// Unset values take the core's defaults; validated on construction (InvalidRequestError).
    #[new]
    #[pyo3(signature = (model=None, device=None, max_batch_size=None, kv_cache_tokens=None, block_size=None,
        max_model_len=None, context_cache=None, parallel=None, dtype=None, max_prefill_tokens=None,
        kv_cache_dtype=None, gpu_memory_utilization=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: Option<PathBuf>,
        device: Option<String>,
        max_batch_size: Option<usize>,
        kv_cache_tokens: Option<usize>,
        block_size: Option<usize>,
        max_model_len: Option<usize>,
        context_cache: Option<PyContextCacheConfig>,
        parallel: Option<PyParallelConfig>,
        dtype: Option<&str>,
        max_prefill_tokens: Option<usize>,
        kv_cache_dtype: Option<&str>,
        gpu_memory_utilization: Option<f64>,
    ) -> PyResult<Self> {
        let mut c = Self::default_config();
        c.model = model.map(|m| m.to_string_lossy().into_owned());
        if let Some(v) = device {
            c.inner.device = v;
        }
        c.inner.max_batch_size = max_batch_size;
        if let Some(v) = max_prefill_tokens {
            c.inner.max_prefill_tokens = v;
        }
        c.inner.kv_cache_tokens = kv_cache_tokens;
        if let Some(v) = gpu_memory_utilization {
            c.inner.gpu_memory_utilization = v;
        }
        if let Some(v) = block_size {
            c.inner.block_size = v;
        }
        c.inner.max_model_len = max_model_len;
        if let Some(v) = context_cache {
            c.inner.context_cache = v.0;
        }
        if let Some(v) = parallel {
            c.inner.parallel = v.0;
        }
        c.inner.dtype = match dtype {
            None | Some("auto") => None,
            Some(name) => Some(WeightDtype::parse(name).map_err(|e| to_py(py, e))?),
        };
        if let Some(name) = kv_cache_dtype {
            c.inner.kv_cache_dtype = KvCacheDtype::parse(name).map_err(|e| to_py(py, e))?;
        }
        c.inner.validate().map_err(|e| to_py(py, e))?;
        Ok(c)
    }
    #[getter]
    fn model(&self) -> Option<String> {
        self.model.clone()
    }
    #[getter]
    fn device(&self) -> &str {
        &self.inner.device
    }
    /// None: the device's default (8 on the CPU, 256 on a GPU); `RuntimeCoordinator.info()` has the value used.
    #[getter]
    fn max_batch_size(&self) -> Option<usize> {
        self.inner.max_batch_size
    }
    #[getter]
    fn max_prefill_tokens(&self) -> usize {
        self.inner.max_prefill_tokens
    }
    /// None: the device's default (16,384 on the CPU; on a GPU, sized from gpu_memory_utilization).
    #[getter]
    fn kv_cache_tokens(&self) -> Option<usize> {
        self.inner.kv_cache_tokens
    }
    #[getter]
    fn gpu_memory_utilization(&self) -> f64 {
        self.inner.gpu_memory_utilization
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    #[getter]
    fn max_model_len(&self) -> Option<usize> {
        self.inner.max_model_len
    }
    #[getter]
    fn context_cache(&self) -> PyContextCacheConfig {
        PyContextCacheConfig(self.inner.context_cache.clone())
    }
    #[getter]
    fn parallel(&self) -> PyParallelConfig {
        PyParallelConfig(self.inner.parallel.clone())
    }
    /// "f32", "bf16", "int8", "a8", or None for the device's default (f32 on the CPU, bf16 on CUDA).
    #[getter]
    fn dtype(&self) -> Option<&'static str> {
        self.inner.dtype.map(WeightDtype::name)
    }
    /// "auto" (bf16 on CUDA, f32 on the CPU) or "fp8" (e4m3, CUDA only).
    #[getter]
    fn kv_cache_dtype(&self) -> &'static str {
        self.inner.kv_cache_dtype.name()
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&(self.model.clone(), self.inner.clone()))
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "Config", "model" => self.model(), "device" => self.device(),
            "max_batch_size" => self.inner.max_batch_size, "kv_cache_tokens" => self.inner.kv_cache_tokens,
            "block_size" => self.inner.block_size, "max_model_len" => self.inner.max_model_len,
            "context_cache" => self.context_cache(), "parallel" => self.parallel(), "dtype" => self.dtype(),
            "max_prefill_tokens" => self.inner.max_prefill_tokens, "kv_cache_dtype" => self.kv_cache_dtype(),
            "gpu_memory_utilization" => self.inner.gpu_memory_utilization)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyContextCacheConfig>()?;
    m.add_class::<PyParallelConfig>()?;
    m.add_class::<PyConfig>()?;
    Ok(())
}
