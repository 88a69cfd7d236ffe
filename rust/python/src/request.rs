//! What a caller asks for and what it gets back: SamplingParams, GenerationRequest, GenerationResponse,
//! TokenLogprob, FinishReason, and the conversion of Python prompts.

use std::collections::BTreeMap;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyMapping, PyString};
use stepllm_core::request::{
    FinishReason, GenerationRequest, GenerationResponse, Message, Prompt, SamplingParams,
    TokenLogprob,
};

use crate::errors::{invalid, to_py};
use crate::types::py_repr;

#[pyclass(
    module = "stepllm._core",
    name = "FinishReason",
    frozen,
    eq,
    hash,
    from_py_object,
    rename_all = "SCREAMING_SNAKE_CASE"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PyFinishReason {
    Eos,
    Length,
    Stop,
    Cancelled,
    Error,
}

impl From<FinishReason> for PyFinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Eos => Self::Eos,
            FinishReason::Length => Self::Length,
            FinishReason::Stop => Self::Stop,
            FinishReason::Cancelled => Self::Cancelled,
            FinishReason::Error => Self::Error,
        }
    }
}

impl From<PyFinishReason> for FinishReason {
    fn from(r: PyFinishReason) -> Self {
        match r {
            PyFinishReason::Eos => Self::Eos,
            PyFinishReason::Length => Self::Length,
            PyFinishReason::Stop => Self::Stop,
            PyFinishReason::Cancelled => Self::Cancelled,
            PyFinishReason::Error => Self::Error,
        }
    }
}

#[pymethods]
impl PyFinishReason {
    /// The lowercase wire name ("eos", "length", "stop", "cancelled", "error").
    #[getter]
    fn value(&self) -> &'static str {
        FinishReason::from(*self).as_str()
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "TokenLogprob",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyTokenLogprob(pub TokenLogprob);

impl PyTokenLogprob {
    pub fn list(v: &Option<Vec<TokenLogprob>>) -> Option<Vec<PyTokenLogprob>> {
        v.as_ref()
            .map(|l| l.iter().cloned().map(PyTokenLogprob).collect())
    }

    /// Prompt logprobs: None for the first prompt token, as vLLM.
    pub fn prompt_list(v: &Option<Vec<Option<TokenLogprob>>>) -> Option<Vec<Option<PyTokenLogprob>>> {
        v.as_ref().map(|l| l.iter().map(|t| t.clone().map(PyTokenLogprob)).collect())
    }
}

#[pymethods]
impl PyTokenLogprob {
    #[new]
    #[pyo3(signature = (token_id, logprob, top = Vec::new()))]
    fn new(token_id: u32, logprob: f32, top: Vec<(u32, f32)>) -> Self {
        Self(TokenLogprob {
            token_id,
            logprob,
            top,
        })
    }
    #[getter]
    fn token_id(&self) -> u32 {
        self.0.token_id
    }
    #[getter]
    fn logprob(&self) -> f32 {
        self.0.logprob
    }
    /// The top alternatives at this position, most likely first: (token_id, logprob).
    #[getter]
    fn top(&self) -> Vec<(u32, f32)> {
        self.0.top.clone()
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "TokenLogprob", "token_id" => self.0.token_id, "logprob" => self.0.logprob, "top" => self.top())
    }
}

/// A non-negative integer that fits `T`, else InvalidRequestError naming the parameter.
fn uint<T: TryFrom<i128>>(py: Python<'_>, name: &str, v: i128) -> PyResult<T> {
    T::try_from(v).map_err(|_| {
        invalid(
            py,
            format!("{name} must be a non-negative integer in range, got {v}"),
        )
    })
}

fn token_ids(py: Python<'_>, name: &str, v: Vec<i128>) -> PyResult<Vec<u32>> {
    v.into_iter().map(|t| uint::<u32>(py, name, t)).collect()
}

#[pyclass(
    module = "stepllm._core",
    name = "SamplingParams",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PySamplingParams(pub SamplingParams);

#[pymethods]
impl PySamplingParams {
    /// Unset arguments take the core's defaults; the result is validated (InvalidRequestError).
    #[new]
    #[pyo3(signature = (*, max_tokens=None, temperature=None, top_k=None, top_p=None, min_p=None, seed=None,
        repetition_penalty=None, presence_penalty=None, frequency_penalty=None, logit_bias=None, logprobs=None,
        stop=None, stop_token_ids=None, ignore_eos=None, skip_special_tokens=None, min_tokens=None,
        include_stop_str_in_output=None, prompt_logprobs=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_tokens: Option<i128>,
        temperature: Option<f64>,
        top_k: Option<i128>,
        top_p: Option<f64>,
        min_p: Option<f64>,
        seed: Option<i128>,
        repetition_penalty: Option<f64>,
        presence_penalty: Option<f64>,
        frequency_penalty: Option<f64>,
        logit_bias: Option<BTreeMap<i128, f64>>,
        logprobs: Option<i128>,
        stop: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<Vec<i128>>,
        ignore_eos: Option<bool>,
        skip_special_tokens: Option<bool>,
        min_tokens: Option<i128>,
        include_stop_str_in_output: Option<bool>,
        prompt_logprobs: Option<i128>,
    ) -> PyResult<Self> {
        let mut p = SamplingParams::default();
        if let Some(v) = max_tokens {
            p.max_tokens = uint(py, "max_tokens", v)?;
        }
        if let Some(v) = temperature {
            p.temperature = v as f32;
        }
        if let Some(v) = top_k {
            p.top_k = uint(py, "top_k", v)?;
        }
        if let Some(v) = top_p {
            p.top_p = v as f32;
        }
        if let Some(v) = min_p {
            p.min_p = v as f32;
        }
        if let Some(v) = seed {
            p.seed = Some(uint(py, "seed", v)?);
        }
        if let Some(v) = repetition_penalty {
            p.repetition_penalty = v as f32;
        }
        if let Some(v) = presence_penalty {
            p.presence_penalty = v as f32;
        }
        if let Some(v) = frequency_penalty {
            p.frequency_penalty = v as f32;
        }
        if let Some(map) = logit_bias {
            p.logit_bias = map
                .into_iter()
                .map(|(t, b)| Ok((uint::<u32>(py, "logit_bias token", t)?, b as f32)))
                .collect::<PyResult<_>>()?;
        }
        if let Some(v) = logprobs {
            p.logprobs = Some(uint(py, "logprobs", v)?);
        }
        if let Some(s) = stop {
            p.stop = if let Ok(one) = s.cast::<PyString>() {
                vec![one.to_str()?.to_owned()]
            } else {
                s.extract()
                    .map_err(|_| invalid(py, "stop must be a str or a list of str"))?
            };
        }
        if let Some(v) = stop_token_ids {
            p.stop_token_ids = token_ids(py, "stop_token_ids", v)?;
        }
        if let Some(v) = ignore_eos {
            p.ignore_eos = v;
        }
        if let Some(v) = skip_special_tokens {
            p.skip_special_tokens = v;
        }
        if let Some(v) = min_tokens {
            p.min_tokens = uint(py, "min_tokens", v)?;
        }
        if let Some(v) = include_stop_str_in_output {
            p.include_stop_str_in_output = v;
        }
        if let Some(v) = prompt_logprobs {
            p.prompt_logprobs = Some(uint(py, "prompt_logprobs", v)?);
        }
        p.validate().map_err(|e| to_py(py, e))?;
        Ok(Self(p))
    }

    #[getter]
    fn max_tokens(&self) -> usize {
        self.0.max_tokens
    }
    #[getter]
    fn temperature(&self) -> f32 {
        self.0.temperature
    }
    #[getter]
    fn top_k(&self) -> usize {
        self.0.top_k
    }
    #[getter]
    fn top_p(&self) -> f32 {
        self.0.top_p
    }
    #[getter]
    fn min_p(&self) -> f32 {
        self.0.min_p
    }
    #[getter]
    fn seed(&self) -> Option<u64> {
        self.0.seed
    }
    #[getter]
    fn repetition_penalty(&self) -> f32 {
        self.0.repetition_penalty
    }
    #[getter]
    fn presence_penalty(&self) -> f32 {
        self.0.presence_penalty
    }
    #[getter]
    fn frequency_penalty(&self) -> f32 {
        self.0.frequency_penalty
    }
    /// None when no bias is set.
    #[getter]
    fn logit_bias(&self) -> Option<BTreeMap<u32, f32>> {
        if self.0.logit_bias.is_empty() {
            None
        } else {
            Some(self.0.logit_bias.iter().copied().collect())
        }
    }
    #[getter]
    fn logprobs(&self) -> Option<usize> {
        self.0.logprobs
    }
    #[getter]
    fn stop(&self) -> Vec<String> {
        self.0.stop.clone()
    }
    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> {
        self.0.stop_token_ids.clone()
    }
    #[getter]
    fn ignore_eos(&self) -> bool {
        self.0.ignore_eos
    }
    #[getter]
    fn skip_special_tokens(&self) -> bool {
        self.0.skip_special_tokens
    }
    #[getter]
    fn min_tokens(&self) -> usize {
        self.0.min_tokens
    }
    #[getter]
    fn include_stop_str_in_output(&self) -> bool {
        self.0.include_stop_str_in_output
    }
    #[getter]
    fn prompt_logprobs(&self) -> Option<usize> {
        self.0.prompt_logprobs
    }
    /// Whether sampling reduces to argmax (temperature 0 or top_k 1).
    #[getter]
    fn is_greedy(&self) -> bool {
        self.0.is_greedy()
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "SamplingParams",
            "max_tokens" => self.0.max_tokens, "temperature" => self.0.temperature, "top_k" => self.0.top_k,
            "top_p" => self.0.top_p, "min_p" => self.0.min_p, "seed" => self.0.seed,
            "repetition_penalty" => self.0.repetition_penalty, "presence_penalty" => self.0.presence_penalty,
            "frequency_penalty" => self.0.frequency_penalty, "logit_bias" => self.logit_bias(),
            "logprobs" => self.0.logprobs, "stop" => self.stop(), "stop_token_ids" => self.stop_token_ids(),
            "ignore_eos" => self.0.ignore_eos, "skip_special_tokens" => self.0.skip_special_tokens,
            "min_tokens" => self.0.min_tokens, "include_stop_str_in_output" => self.0.include_stop_str_in_output,
            "prompt_logprobs" => self.0.prompt_logprobs)
    }
}

const PROMPT_KINDS: &str =
    "prompt must be a str, a list of token ids, or a list of {\"role\", \"content\"} messages";

/// str -> text; list of ints -> token ids; list of {role, content} mappings -> messages.
pub fn prompt_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Prompt> {
    let py = obj.py();
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Prompt::Text(s.to_str()?.to_owned()));
    }
    if obj.is_instance_of::<PyDict>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(invalid(py, PROMPT_KINDS));
    }
    let items: Vec<Bound<'_, PyAny>> = match obj.extract() {
        Ok(items) => items,
        Err(_) => return Err(invalid(py, PROMPT_KINDS)),
    };
    if items.is_empty() {
        return Ok(Prompt::TokenIds(Vec::new()));
    }
    if items[0].cast::<PyMapping>().is_ok() || items[0].is_instance_of::<PyDict>() {
        let messages = items
            .iter()
            .map(|m| {
                let field = |key: &str| -> PyResult<String> {
                    m.get_item(key)
                        .ok()
                        .and_then(|v| v.extract::<String>().ok())
                        .ok_or_else(|| {
                            invalid(py, format!("every message needs a string {key:?}; got {m}"))
                        })
                };
                Ok(Message {
                    role: field("role")?,
                    content: field("content")?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(Prompt::Messages(messages));
    }
    let ids = items
        .iter()
        .map(|t| match t.extract::<i128>() {
            Ok(v) if !t.is_instance_of::<pyo3::types::PyBool>() => {
                uint::<u32>(py, "prompt token", v)
            }
            _ => Err(invalid(py, PROMPT_KINDS)),
        })
        .collect::<PyResult<Vec<u32>>>()?;
    Ok(Prompt::TokenIds(ids))
}

pub fn prompt_to_py<'py>(py: Python<'py>, prompt: &Prompt) -> PyResult<Bound<'py, PyAny>> {
    Ok(match prompt {
        Prompt::Text(t) => PyString::new(py, t).into_any(),
        Prompt::TokenIds(ids) => PyList::new(py, ids)?.into_any(),
        Prompt::Messages(ms) => {
            let list = PyList::empty(py);
            for m in ms {
                let d = PyDict::new(py);
                d.set_item("role", &m.role)?;
                d.set_item("content", &m.content)?;
                list.append(d)?;
            }
            list.into_any()
        }
    })
}

#[pyclass(
    module = "stepllm._core",
    name = "GenerationRequest",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyGenerationRequest(pub GenerationRequest);

#[pymethods]
impl PyGenerationRequest {
    #[new]
    #[pyo3(signature = (prompt, sampling=None, add_special_tokens=true, cache_salt=None, lora_name=None))]
    fn new(
        prompt: &Bound<'_, PyAny>,
        sampling: Option<PySamplingParams>,
        add_special_tokens: bool,
        cache_salt: Option<String>,
        lora_name: Option<String>,
    ) -> PyResult<Self> {
        let prompt = prompt_from_py(prompt)?;
        let sampling = sampling.map(|s| s.0).unwrap_or_default();
        Ok(Self(GenerationRequest {
            prompt,
            sampling,
            add_special_tokens,
            cache_salt,
            lora_name,
        }))
    }
    #[getter]
    fn prompt<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        prompt_to_py(py, &self.0.prompt)
    }
    #[getter]
    fn sampling(&self) -> PySamplingParams {
        PySamplingParams(self.0.sampling.clone())
    }
    #[getter]
    fn add_special_tokens(&self) -> bool {
        self.0.add_special_tokens
    }
    #[getter]
    fn cache_salt(&self) -> Option<String> {
        self.0.cache_salt.clone()
    }
    #[getter]
    fn lora_name(&self) -> Option<String> {
        self.0.lora_name.clone()
    }
    fn __hash__(&self) -> u64 {
        crate::hashing::py_hash(&self.0)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        py_repr!(py, "GenerationRequest", "prompt" => self.prompt(py)?, "sampling" => self.sampling(),
            "add_special_tokens" => self.0.add_special_tokens, "cache_salt" => self.cache_salt(),
            "lora_name" => self.lora_name())
    }
}

#[pyclass(
    module = "stepllm._core",
    name = "GenerationResponse",
    frozen,
    eq,
    from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub struct PyGenerationResponse(pub GenerationResponse);

#[pymethods]
impl PyGenerationResponse {
    #[new]
    #[pyo3(signature = (request_id, original_index, prompt_ids, output_ids, output_text, finish_reason,
        stop_reason=None, logprobs=None, cached_prompt_tokens=0, error=None, prompt_logprobs=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        request_id: u64,
        original_index: u32,
        prompt_ids: Vec<u32>,
        output_ids: Vec<u32>,
        output_text: String,
        finish_reason: PyFinishReason,
        stop_reason: Option<String>,
        logprobs: Option<Vec<PyTokenLogprob>>,
        cached_prompt_tokens: usize,
        error: Option<String>,
        prompt_logprobs: Option<Vec<Option<PyTokenLogprob>>>,
    ) -> Self {
        Self(GenerationResponse {
            request_id,
            original_index,
            prompt_ids,
            output_ids,
            output_text,
            finish_reason: finish_reason.into(),
            stop_reason,
            logprobs: logprobs.map(|l| l.into_iter().map(|t| t.0).collect()),
            prompt_logprobs: prompt_logprobs.map(|l| l.into_iter().map(|t| t.map(|t| t.0)).collect()),
            cached_prompt_tokens,
            error,
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
    fn prompt_ids(&self) -> Vec<u32> {
        self.0.prompt_ids.clone()
    }
    #[getter]
    fn output_ids(&self) -> Vec<u32> {
        self.0.output_ids.clone()
    }
    #[getter]
    fn output_text(&self) -> &str {
        &self.0.output_text
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
        py_repr!(py, "GenerationResponse",
            "request_id" => self.0.request_id, "original_index" => self.0.original_index,
            "prompt_ids" => self.prompt_ids(), "output_ids" => self.output_ids(), "output_text" => self.output_text(),
            "finish_reason" => self.finish_reason(), "stop_reason" => self.stop_reason(), "logprobs" => self.logprobs(),
            "prompt_logprobs" => self.prompt_logprobs(), "cached_prompt_tokens" => self.0.cached_prompt_tokens,
            "error" => self.error())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFinishReason>()?;
    m.add_class::<PyTokenLogprob>()?;
    m.add_class::<PySamplingParams>()?;
    m.add_class::<PyGenerationRequest>()?;
    m.add_class::<PyGenerationResponse>()?;
    Ok(())
}
