//! GGUF, llama.cpp's single-file model format (versions 2 and 3, little-endian).
//!
//! Layout: magic "GGUF", version u32, tensor count u64, metadata count u64, the metadata key/values,
//! the tensor directory (name, dims fastest-first, ggml type, offset), padding to the alignment
//! (`general.alignment`, default 32), then the tensor data. Everything read from the file is
//! bounds-checked: a truncated or corrupt file is an `Error::Load` naming what broke and where.
//!
//! `GgufModel` also serves weights under Hugging Face names (see `gguf_tensor_name`) in HF layout,
//! undoing the Q/K row permutation llama.cpp applies to llama models.

use super::gguf_quant::{self, GgmlType};
use super::{HostTensor, TensorPart, WeightSource};
use crate::text::tokenizer::{BpeVocab, VocabModel};
use crate::error::{load_err, with_context, Error, Result};
use crate::model::config::{Architecture, ModelConfig};
use crate::model::rope::{Rope, RopeScaling};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::Path;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal; this bound only stops a hostile file from recursing us off the stack.
const MAX_ARRAY_NESTING: u32 = 8;

/// One metadata value. Arrays keep their elements as values (GGUF arrays are homogeneous).
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// Any integer value, widened.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer value that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer value that fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// Any numeric value (integers converted).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v as f64),
            Self::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(items) => Some(items),
            _ => None,
        }
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::I8(_) => "i8",
            Self::U16(_) => "u16",
            Self::I16(_) => "i16",
            Self::U32(_) => "u32",
            Self::I32(_) => "i32",
            Self::U64(_) => "u64",
            Self::I64(_) => "i64",
            Self::F32(_) => "f32",
            Self::F64(_) => "f64",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
        }
    }
}

/// One entry of the tensor directory, already checked to lie inside the file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml `ne`: dimensions fastest-varying first, so a matrix of HF shape [out, in] has dims [in, out].
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl GgufTensorInfo {
    /// The shape in Hugging Face (row-major, slowest first) order: `dims` reversed.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// An opened GGUF file: parsed metadata and tensor directory over the (memory-mapped) bytes.
pub struct GgufModel {
    source: String,
    bytes: Bytes,
    header: Header,
    metadata_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel")
            .field("source", &self.source)
            .field("version", &self.header.version)
            .field("metadata_entries", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufModel {
    /// Open and memory-map a .gguf file, parsing and validating its header and tensor directory.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let source = path.display().to_string();
        let file = std::fs::File::open(path).or_else(|e| load_err(format!("cannot open GGUF file {source}: {e}")))?;
        // SAFETY: the map is read-only; as with every mmap-based loader, the file must not be truncated
        // by another process while it is open.
        let map = unsafe { Mmap::map(&file) }.or_else(|e| load_err(format!("cannot memory-map {source}: {e}")))?;
        Self::parse(source, Bytes::Mapped(map))
    }

    /// Parse a GGUF image held in memory (tests, embedded models).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse("<in-memory GGUF>".to_string(), Bytes::Owned(bytes))
    }

    fn parse(source: String, bytes: Bytes) -> Result<Self> {
        let header = parse_header(bytes.as_slice()).map_err(|e| with_context(e, &format!("GGUF file {source}")))?;
        let metadata_index = header.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let tensor_index = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self { source, bytes, header, metadata_index, tensor_index })
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Byte offset of the tensor data section in the file.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.header.metadata[i].1)
    }

    /// All metadata entries in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.header.metadata
    }

    /// The tensor directory in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.header.tensors
    }

    pub fn tensor_info(&self, gguf_name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(gguf_name).map(|&i| &self.header.tensors[i])
    }

    /// The stored bytes of a tensor (quantized blocks as in the file).
    pub fn tensor_data(&self, gguf_name: &str) -> Result<&[u8]> {
        let info = self.require_tensor(gguf_name)?;
        // Bounds were checked at open time.
        let start = (self.header.data_offset + info.offset) as usize;
        Ok(&self.bytes.as_slice()[start..start + info.n_bytes as usize])
    }

    /// A tensor by its GGUF name, dequantized to f32 in HF shape (dims reversed), with the blocks it was
    /// stored in when quantized; no renaming or un-permuting.
    pub fn dequantize(&self, gguf_name: &str) -> Result<HostTensor> {
        self.read_tensor(gguf_name, true)
    }

    /// A tensor by its GGUF name in HF shape; a quantized one as its blocks, with its floats too when `floats`
    /// (loading leaves them to `HostTensor::values`: only a backend that does not keep the blocks pays for them).
    fn read_tensor(&self, gguf_name: &str, floats: bool) -> Result<HostTensor> {
        let info = self.require_tensor(gguf_name)?;
        let (data, blocks) = gguf_quant::decode(info.ggml_type, self.tensor_data(gguf_name)?, info.n_elements as usize, floats)
            .map_err(|e| with_context(e, &format!("tensor {gguf_name:?} in {}", self.source)))?;
        Ok(HostTensor { shape: info.hf_shape(), data, blocks })
    }

    fn require_tensor(&self, gguf_name: &str) -> Result<&GgufTensorInfo> {
        self.tensor_info(gguf_name)
            .ok_or_else(|| Error::Load(format!("GGUF file {} has no tensor {gguf_name:?}", self.source)))
    }

    /// `general.architecture`, e.g. "llama".
    pub fn architecture(&self) -> Result<&str> {
        self.required("general.architecture")?
            .as_str()
            .ok_or_else(|| Error::Load(format!("{}: general.architecture is not a string", self.source)))
    }

    /// `tokenizer.chat_template`, the Jinja chat template, when the file carries one.
    pub fn chat_template(&self) -> Option<String> {
        self.metadata("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string)
    }

    /// Architecture hyper-parameters from `{arch}.*` metadata (llama, qwen2, qwen3).
    pub fn config(&self) -> Result<ModelConfig> {
        let arch = self.architecture()?;
        let architecture = match arch {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            other => return load_err(format!("{}: unsupported GGUF architecture {other:?}; stepllm reads llama, qwen2 and qwen3", self.source)),
        };
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = self.required_usize(&key("embedding_length"))?;
        let num_heads = self.required_usize(&key("attention.head_count"))?;
        let num_kv_heads = self.optional_usize(&key("attention.head_count_kv"))?.unwrap_or(num_heads);
        // Qwen3 states head_dim (attention.key_length); llama derives it. A zero head count is left to
        // validate() to report, so divide only when it is safe.
        let derived_head_dim = hidden_size.checked_div(num_heads).unwrap_or(0);
        let head_dim = self.optional_usize(&key("attention.key_length"))?.unwrap_or(derived_head_dim);
        let cfg = ModelConfig {
            architecture,
            vocab_size: self.vocab_size(arch)?,
            hidden_size,
            intermediate_size: self.required_usize(&key("feed_forward_length"))?,
            num_layers: self.required_usize(&key("block_count"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope: self.rope(arch, head_dim)?,
            rms_norm_eps: self.required_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            max_position_embeddings: self.required_usize(&key("context_length"))?,
            tie_word_embeddings: !self.tensor_index.contains_key("output.weight"),
            qkv_bias: architecture == Architecture::Qwen2 || self.tensor_index.contains_key("blk.0.attn_q.bias"),
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id: self.optional_u32("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: self.eos_token_ids()?,
        };
        cfg.validate().map_err(|e| with_context(e, &self.source))?;
        Ok(cfg)
    }

    /// Rows of the embedding matrix are the logits width; fall back to metadata when it is missing.
    fn vocab_size(&self, arch: &str) -> Result<usize> {
        if let Some(embd) = self.tensor_info("token_embd.weight") {
            if embd.dims.len() == 2 {
                return Ok(embd.dims[1] as usize);
            }
            return load_err(format!("{}: token_embd.weight has dims {:?}, expected 2", self.source, embd.dims));
        }
        if let Some(n) = self.optional_usize(&format!("{arch}.vocab_size"))? {
            return Ok(n);
        }
        match self.metadata("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(tokens) => Ok(tokens.len()),
            None => load_err(format!("{}: cannot tell the vocabulary size (no token_embd.weight, vocab_size or tokens)", self.source)),
        }
    }

    /// EOS plus end-of-turn (llama.cpp stops on both; chat models often end turns with EOT).
    fn eos_token_ids(&self) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Some(id) = self.optional_u32(key)? {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        Ok(ids)
    }

    /// RoPE's base and scaling. Linear scaling is metadata; llama.cpp's converter turns llama3 scaling into the
    /// per-frequency factors of `rope_freqs.weight`. Other kinds (YaRN, ...) would silently give wrong logits
    /// with these frequencies, so they are refused.
    fn rope(&self, arch: &str, head_dim: usize) -> Result<Rope> {
        let theta = self.optional_f64(&format!("{arch}.rope.freq_base"))?.unwrap_or(10000.0) as f32;
        let kind = self.metadata(&format!("{arch}.rope.scaling.type")).and_then(|v| v.as_str()).unwrap_or("none");
        let linear_factor = match kind {
            "none" => None,
            "linear" => Some(self.required_f64(&format!("{arch}.rope.scaling.factor"))? as f32),
            other => {
                return load_err(format!(
                    "{}: rope scaling {other:?} is not supported yet; stepllm runs none, linear and llama3 \
                     (rope_freqs.weight) RoPE",
                    self.source
                ))
            }
        };
        let factors = self.rope_frequency_factors(head_dim)?;
        let scaling = match (linear_factor, factors) {
            (Some(f), _) if !(f.is_finite() && f > 0.0) => {
                return load_err(format!("{}: {arch}.rope.scaling.factor is {f}; it must be a positive number", self.source))
            }
            (Some(_), Some(_)) => {
                return load_err(format!("{}: linear rope scaling together with rope_freqs.weight is not supported", self.source))
            }
            (Some(factor), None) if factor != 1.0 => RopeScaling::Linear { factor },
            (_, Some(factors)) => RopeScaling::FrequencyFactors(factors.into()),
            _ => RopeScaling::None,
        };
        Ok(Rope { theta, scaling })
    }

    /// `rope_freqs.weight`: one positive divisor per rotated pair.
    fn rope_frequency_factors(&self, head_dim: usize) -> Result<Option<Vec<f32>>> {
        if !self.tensor_index.contains_key("rope_freqs.weight") {
            return Ok(None);
        }
        let factors = self.dequantize("rope_freqs.weight")?.data;
        if factors.len() != head_dim / 2 {
            return load_err(format!(
                "{}: rope_freqs.weight has {} factors; a head of {head_dim} values rotates {} pairs",
                self.source,
                factors.len(),
                head_dim / 2
            ));
        }
        if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return load_err(format!("{}: rope_freqs.weight holds {bad}; every factor must be a positive number", self.source));
        }
        Ok(Some(factors))
    }

    /// The byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2").
    pub fn vocab(&self) -> Result<BpeVocab> {
        let model = match self.required("tokenizer.ggml.model")?.as_str().unwrap_or("") {
            "gpt2" => VocabModel::ByteLevel,
            "llama" => VocabModel::SentencePiece,
            other => {
                return load_err(format!(
                    "{}: tokenizer model {other:?} is not supported; stepllm reads byte-level BPE (\"gpt2\") and \
                     SentencePiece BPE (\"llama\") vocabularies",
                    self.source
                ))
            }
        };
        let tokens = self.string_array("tokenizer.ggml.tokens")?;
        let (merges, scores) = match model {
            VocabModel::ByteLevel => (self.string_array("tokenizer.ggml.merges")?, Vec::new()),
            VocabModel::SentencePiece => (Vec::new(), self.f32_array("tokenizer.ggml.scores")?),
        };
        // Absent types mean every token is a normal one (llama.cpp's LLAMA_TOKEN_TYPE_NORMAL = 1).
        let token_types = self.i32_array("tokenizer.ggml.token_type")?.unwrap_or_else(|| vec![1; tokens.len()]);
        if token_types.len() != tokens.len() {
            return load_err(format!("{}: {} token types for {} tokens", self.source, token_types.len(), tokens.len()));
        }
        let bos_id = self.optional_u32("tokenizer.ggml.bos_token_id")?;
        let eos_id = self.optional_u32("tokenizer.ggml.eos_token_id")?;
        let unk_id = self.optional_u32("tokenizer.ggml.unknown_token_id")?;
        for (what, id) in [("bos", bos_id), ("eos", eos_id), ("unknown", unk_id)] {
            if id.is_some_and(|id| id as usize >= tokens.len()) {
                return load_err(format!("{}: {what} token id {} is outside the {}-token vocabulary", self.source, id.unwrap(), tokens.len()));
            }
        }
        let flag = |key: &str| self.metadata(key).and_then(|v| v.as_bool());
        Ok(BpeVocab {
            model,
            tokens,
            merges,
            scores,
            token_types,
            bos_id,
            eos_id,
            add_bos: flag("tokenizer.ggml.add_bos_token").unwrap_or(false),
            pre: self.metadata("tokenizer.ggml.pre").and_then(|v| v.as_str()).map(str::to_string),
            unk_id,
            // llama.cpp's default for SentencePiece vocabularies that do not say.
            add_space_prefix: model == VocabModel::SentencePiece && flag("tokenizer.ggml.add_space_prefix").unwrap_or(true),
        })
    }

    fn required(&self, key: &str) -> Result<&GgufValue> {
        self.metadata(key).ok_or_else(|| self.missing(key))
    }

    fn missing(&self, key: &str) -> Error {
        Error::Load(format!("{}: metadata key {key:?} is missing", self.source))
    }

    /// A metadata value converted by `convert`; None when absent, an error when present but of another type.
    fn typed<T>(&self, key: &str, expected: &str, convert: impl Fn(&GgufValue) -> Option<T>) -> Result<Option<T>> {
        match self.metadata(key) {
            None => Ok(None),
            Some(v) => match convert(v) {
                Some(x) => Ok(Some(x)),
                None => load_err(format!("{}: metadata {key:?} should be {expected}, found {}", self.source, v.type_name())),
            },
        }
    }

    fn optional_usize(&self, key: &str) -> Result<Option<usize>> {
        self.typed(key, "a non-negative integer", |v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
    }

    fn required_usize(&self, key: &str) -> Result<usize> {
        self.optional_usize(key)?.ok_or_else(|| self.missing(key))
    }

    fn optional_u32(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "a 32-bit token id", |v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
    }

    fn optional_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", GgufValue::as_f64)
    }

    fn required_f64(&self, key: &str) -> Result<f64> {
        self.optional_f64(key)?.ok_or_else(|| self.missing(key))
    }

    fn string_array(&self, key: &str) -> Result<Vec<String>> {
        let strings = |v: &GgufValue| v.as_array()?.iter().map(|s| s.as_str().map(str::to_string)).collect();
        self.typed(key, "an array of strings", strings)?.ok_or_else(|| self.missing(key))
    }

    fn f32_array(&self, key: &str) -> Result<Vec<f32>> {
        let floats = |v: &GgufValue| v.as_array()?.iter().map(|x| x.as_f64().map(|x| x as f32)).collect();
        self.typed(key, "an array of numbers", floats)?.ok_or_else(|| self.missing(key))
    }

    fn i32_array(&self, key: &str) -> Result<Option<Vec<i32>>> {
        let ints = |v: &GgufValue| v.as_array()?.iter().map(|n| n.as_i64().and_then(|n| i32::try_from(n).ok())).collect();
        self.typed(key, "an array of 32-bit integers", ints)
    }

    /// How many heads to un-permute a Q/K weight over, or None when the tensor is stored as HF has it.
    /// llama.cpp's convert_hf_to_gguf.py permutes q_proj/k_proj (weight and bias) for llama only.
    fn rotary_heads(&self, hf_name: &str) -> Result<Option<usize>> {
        let is_q = hf_name.ends_with(".self_attn.q_proj.weight") || hf_name.ends_with(".self_attn.q_proj.bias");
        let is_k = hf_name.ends_with(".self_attn.k_proj.weight") || hf_name.ends_with(".self_attn.k_proj.bias");
        if !(is_q || is_k) || self.architecture()? != "llama" {
            return Ok(None);
        }
        let heads = self.required_usize("llama.attention.head_count")?;
        if is_q {
            return Ok(Some(heads));
        }
        Ok(Some(self.optional_usize("llama.attention.head_count_kv")?.unwrap_or(heads)))
    }
}

impl WeightSource for GgufModel {
    fn tensor(&self, hf_name: &str) -> Result<HostTensor> {
        let gguf_name = gguf_name_of(hf_name)?;
        let tensor = self.read_tensor(&gguf_name, false)?;
        match self.rotary_heads(hf_name)? {
            Some(heads) => unpermute_rotary_rows(tensor, heads).map_err(|e| with_context(e, &format!("tensor {gguf_name:?}"))),
            None => Ok(tensor),
        }
    }

    /// Whole rows are read alone (a row of the file is whole blocks), so each tensor-parallel rank decodes only its
    /// shard; columns, and rows that would split a rotary head, are cut from the whole tensor.
    fn tensor_part(&self, hf_name: &str, part: TensorPart) -> Result<HostTensor> {
        let gguf_name = gguf_name_of(hf_name)?;
        let info = self.require_tensor(&gguf_name)?;
        let shape = info.hf_shape();
        part.check(hf_name, &shape)?;
        let rotary = self.rotary_heads(hf_name)?;
        // Rows per rotary head: llama.cpp permutes rows within each head, so a part of whole heads un-permutes alone.
        let head_rows = rotary.map_or(1, |heads| shape[0] / heads.max(1));
        let cols: usize = shape[1..].iter().product();
        let whole_heads = |start: usize, len: usize| head_rows > 0 && start.is_multiple_of(head_rows) && len.is_multiple_of(head_rows);
        let (start, len, row_bytes) = match (part, info.ggml_type.bytes_for(cols as u64)) {
            (TensorPart::Rows { start, len }, Some(row_bytes)) if whole_heads(start, len) => (start, len, row_bytes as usize),
            _ => return self.tensor(hf_name)?.into_part(hf_name, part),
        };
        let bytes = &self.tensor_data(&gguf_name)?[start * row_bytes..(start + len) * row_bytes];
        let (data, blocks) = gguf_quant::decode(info.ggml_type, bytes, len * cols, false)
            .map_err(|e| with_context(e, &format!("tensor {gguf_name:?} in {}", self.source)))?;
        let tensor = HostTensor { shape: part.shape(&shape), data, blocks };
        match rotary {
            Some(_) => unpermute_rotary_rows(tensor, len / head_rows).map_err(|e| with_context(e, &format!("tensor {gguf_name:?}"))),
            None => Ok(tensor),
        }
    }

    fn has(&self, hf_name: &str) -> bool {
        gguf_tensor_name(hf_name).is_some_and(|name| self.tensor_index.contains_key(&name))
    }
}

fn gguf_name_of(hf_name: &str) -> Result<String> {
    gguf_tensor_name(hf_name).ok_or_else(|| Error::Load(format!("no GGUF tensor corresponds to Hugging Face tensor {hf_name:?}")))
}

/// The GGUF name of a Hugging Face (Llama/Qwen naming) tensor, e.g.
/// "model.layers.3.self_attn.o_proj.weight" -> "blk.3.attn_output.weight".
pub fn gguf_tensor_name(hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (module, param) = rest.rsplit_once('.')?;
    if param != "weight" && param != "bias" {
        return None;
    }
    let gguf_module = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf_module}.{param}"))
}

/// Undo llama.cpp's rotary permutation of Q/K rows. HF rotates the two halves of each head
/// (row i pairs with row i + head_dim/2); llama.cpp's converter interleaves them so pairs are adjacent:
/// stored row 2i is HF row i and stored row 2i+1 is HF row i + head_dim/2.
pub fn unpermute_rotary_rows(tensor: HostTensor, n_heads: usize) -> Result<HostTensor> {
    let rows = tensor.shape.first().copied().unwrap_or(0);
    if n_heads == 0 || !rows.is_multiple_of(n_heads) || !(rows / n_heads).is_multiple_of(2) {
        return load_err(format!("cannot un-permute {rows} rows over {n_heads} heads: need an even number of rows per head"));
    }
    let half = rows / n_heads / 2;
    let mut order = vec![0; rows];
    for head in 0..n_heads {
        let base = head * 2 * half;
        for i in 0..half {
            (order[base + i], order[base + half + i]) = (base + 2 * i, base + 2 * i + 1);
        }
    }
    Ok(tensor.with_rows(&order))
}

// ---------------------------------------------------------------------------------------------------
// Header parsing

struct Header {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// A bounds-checked little-endian cursor; every failure names the byte offset and what was being read.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return load_err(format!(
                "truncated at byte {} reading {what}: need {n} bytes, {} left",
                self.pos,
                self.remaining()
            ));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn raw_string(&mut self, what: &str) -> Result<&'a [u8]> {
        let start = self.pos;
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return load_err(format!("string at byte {start} ({what}) claims {len} bytes, only {} left", self.remaining()));
        }
        self.take(len as usize, what)
    }

    /// Names (keys, tensor names) must be valid UTF-8.
    fn name(&mut self, what: &str) -> Result<String> {
        let start = self.pos;
        let bytes = self.raw_string(what)?;
        String::from_utf8(bytes.to_vec()).or_else(|_| load_err(format!("{what} at byte {start} is not valid UTF-8")))
    }

    fn value(&mut self, type_id: u32, depth: u32) -> Result<GgufValue> {
        Ok(match type_id {
            0 => GgufValue::U8(u8::from_le_bytes(self.array("u8 value")?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array("i8 value")?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array("u16 value")?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array("i16 value")?)),
            4 => GgufValue::U32(self.u32("u32 value")?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array("i32 value")?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array("f32 value")?)),
            7 => {
                let at = self.pos;
                match self.array::<1>("bool value")?[0] {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    b => return load_err(format!("bool at byte {at} has value {b}, expected 0 or 1")),
                }
            }
            // Token texts are not guaranteed valid UTF-8 by every converter; keep them readable rather
            // than refuse an otherwise good model.
            8 => GgufValue::String(String::from_utf8_lossy(self.raw_string("string value")?).into_owned()),
            9 => self.array_value(depth)?,
            10 => GgufValue::U64(self.u64("u64 value")?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array("i64 value")?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array("f64 value")?)),
            other => return load_err(format!("unknown metadata value type {other} before byte {}", self.pos)),
        })
    }

    fn array_value(&mut self, depth: u32) -> Result<GgufValue> {
        let start = self.pos;
        if depth >= MAX_ARRAY_NESTING {
            return load_err(format!("array at byte {start} is nested more than {MAX_ARRAY_NESTING} deep"));
        }
        let elem_type = self.u32("array element type")?;
        let count = self.u64("array length")?;
        // Check the claimed length against the bytes left before allocating anything for it.
        let min_elem = min_value_size(elem_type)
            .ok_or_else(|| Error::Load(format!("array at byte {start} has unknown element type {elem_type}")))?;
        if count.checked_mul(min_elem).is_none_or(|need| need > self.remaining() as u64) {
            return load_err(format!("array at byte {start} claims {count} elements, more than the {} bytes left can hold", self.remaining()));
        }
        let mut items = Vec::with_capacity(count as usize);
        for i in 0..count {
            items.push(self.value(elem_type, depth + 1).map_err(|e| with_context(e, &format!("array element {i}")))?);
        }
        Ok(GgufValue::Array(items))
    }
}

/// The fewest bytes a value of this type takes (strings: their length field; arrays: type + length).
fn min_value_size(type_id: u32) -> Option<u64> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

fn parse_header(buf: &[u8]) -> Result<Header> {
    let mut r = Reader { buf, pos: 0 };
    let magic = r.array::<4>("magic")?;
    if &magic != MAGIC {
        return load_err(format!("not a GGUF file: magic is {magic:?}, expected \"GGUF\""));
    }
    let version = r.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return load_err("GGUF version 1 is not supported (re-convert the model with a current llama.cpp)"),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => return load_err("big-endian GGUF files are not supported"),
        v => return load_err(format!("unsupported GGUF version {v}; stepllm reads versions 2 and 3")),
    }
    let tensor_count = r.u64("tensor count")?;
    let kv_count = r.u64("metadata count")?;
    let metadata = parse_metadata(&mut r, kv_count)?;
    let alignment = alignment_from(&metadata)?;
    let mut tensors = parse_tensor_infos(&mut r, tensor_count)?;
    let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
    for (i, t) in tensors.iter_mut().enumerate() {
        check_tensor_extent(t, alignment, data_offset, buf.len() as u64)
            .map_err(|e| with_context(e, &format!("tensor {i} ({:?})", t.name)))?;
    }
    Ok(Header { version, metadata, tensors, alignment, data_offset })
}

fn parse_metadata(r: &mut Reader, kv_count: u64) -> Result<Vec<(String, GgufValue)>> {
    // Each entry takes at least a key length, a type and one value byte.
    if kv_count.checked_mul(13).is_none_or(|need| need > r.remaining() as u64) {
        return load_err(format!("metadata count {kv_count} is more than the file can hold"));
    }
    let mut metadata: Vec<(String, GgufValue)> = Vec::with_capacity(kv_count as usize);
    let mut seen = std::collections::HashSet::new();
    for i in 0..kv_count {
        let entry = (|| {
            let key = r.name("metadata key")?;
            let type_id = r.u32("metadata value type")?;
            let value = r.value(type_id, 0).map_err(|e| with_context(e, &format!("key {key:?}")))?;
            Ok((key, value))
        })()
        .map_err(|e| with_context(e, &format!("metadata entry {i}")))?;
        if !seen.insert(entry.0.clone()) {
            return load_err(format!("metadata entry {i}: duplicate key {:?}", entry.0));
        }
        metadata.push(entry);
    }
    Ok(metadata)
}

fn alignment_from(metadata: &[(String, GgufValue)]) -> Result<u64> {
    let Some((_, value)) = metadata.iter().find(|(k, _)| k == "general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match value.as_u64() {
        Some(a) if a.is_power_of_two() => Ok(a),
        _ => load_err(format!("general.alignment must be a power of two, found {value:?}")),
    }
}

fn parse_tensor_infos(r: &mut Reader, tensor_count: u64) -> Result<Vec<GgufTensorInfo>> {
    // Each entry takes at least a name length, n_dims, type and offset.
    if tensor_count.checked_mul(24).is_none_or(|need| need > r.remaining() as u64) {
        return load_err(format!("tensor count {tensor_count} is more than the file can hold"));
    }
    let mut tensors = Vec::with_capacity(tensor_count as usize);
    let mut seen = std::collections::HashSet::new();
    for i in 0..tensor_count {
        let info = parse_tensor_info(r).map_err(|e| with_context(e, &format!("tensor info {i}")))?;
        if !seen.insert(info.name.clone()) {
            return load_err(format!("tensor info {i}: duplicate tensor name {:?}", info.name));
        }
        tensors.push(info);
    }
    Ok(tensors)
}

fn parse_tensor_info(r: &mut Reader) -> Result<GgufTensorInfo> {
    let name = r.name("tensor name")?;
    let at = r.pos;
    let n_dims = r.u32("dimension count")?;
    if n_dims > MAX_DIMS {
        return load_err(format!("tensor {name:?}: {n_dims} dimensions at byte {at}, ggml allows at most {MAX_DIMS}"));
    }
    let dims = (0..n_dims).map(|_| r.u64("tensor dimension")).collect::<Result<Vec<u64>>>()?;
    let at = r.pos;
    let type_id = r.u32("tensor type")?;
    let ggml_type = GgmlType::from_id(type_id)
        .ok_or_else(|| Error::Load(format!("tensor {name:?}: unknown ggml type id {type_id} at byte {at}")))?;
    let offset = r.u64("tensor data offset")?;
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::Load(format!("tensor {name:?}: element count of dims {dims:?} overflows")))?;
    if dims.first().is_some_and(|&d0| !d0.is_multiple_of(ggml_type.block_size() as u64)) {
        return load_err(format!(
            "tensor {name:?}: innermost dimension {} is not a multiple of the {} block size {}",
            dims[0],
            ggml_type.name(),
            ggml_type.block_size()
        ));
    }
    let n_bytes = ggml_type
        .bytes_for(n_elements)
        .ok_or_else(|| Error::Load(format!("tensor {name:?}: byte size of {n_elements} {} elements overflows", ggml_type.name())))?;
    Ok(GgufTensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes })
}

fn check_tensor_extent(t: &GgufTensorInfo, alignment: u64, data_offset: u64, file_len: u64) -> Result<()> {
    if !t.offset.is_multiple_of(alignment) {
        return load_err(format!("data offset {} is not a multiple of the alignment {alignment}", t.offset));
    }
    let end = data_offset.checked_add(t.offset).and_then(|start| start.checked_add(t.n_bytes));
    match end {
        Some(end) if end <= file_len => Ok(()),
        _ => load_err(format!(
            "data (bytes {}..+{} from the data section at {data_offset}) runs past the end of the {file_len}-byte file",
            t.offset, t.n_bytes
        )),
    }
}
