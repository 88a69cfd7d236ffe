//! The CPU backend: f32 compute, multithreaded (our SIMD matmul kernels, rayon for the rest). With f32
//! weights (the default) it is exact and the reference every GPU kernel is checked against; bf16 or int8
//! weights halve or quarter the bytes a decode step streams, still multiplied and summed in f32; a8 rounds the
//! activations to 8 bits too and multiplies integers (`cpu_matmul_a8`), as llama.cpp does.

use super::batch::BatchPlan;
use super::cpu_attention::{self, CpuKvCache};
use super::cpu_kernels::{for_each_row, rms_norm_row, silu, PARALLEL_ELEMENTS};
use super::cpu_matmul_a8::{self, A8Matrix};
use super::cpu_matmul::{matmul_transposed, pack_bf16, pack_blocks, pack_f32, pack_int8, BlockMatrix, Kernels, Weights};
use super::{AttentionShape, Backend, KvCacheDtype, KvCacheShape};
use crate::error::{invalid, Error, Result};
use crate::model::loader::HostTensor;
use crate::model::WeightDtype;
use rayon::prelude::*;

/// How the CPU backend keeps weight matrices (linear layers and the embedding table) in memory. Norm
/// weights, biases, activations and the KV cache stay f32 in every format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuWeightFormat {
    /// Exact: the checkpoint's values (a matrix dequantized from 4- or 8-bit GGUF blocks is kept as those
    /// blocks, which rebuild the same values).
    #[default]
    F32,
    /// Rounded to bf16 (nearest even): half the bytes, about 3 significant digits per weight.
    Bf16,
    /// Symmetric int8 with one f32 scale per weight row: a quarter of the bytes, coarser still.
    Int8,
    /// Integer levels times activations rounded to 8 bits: integer dot products (`cpu_matmul_a8`).
    A8,
}

impl From<WeightDtype> for CpuWeightFormat {
    fn from(dtype: WeightDtype) -> Self {
        match dtype {
            WeightDtype::F32 => CpuWeightFormat::F32,
            WeightDtype::Bf16 => CpuWeightFormat::Bf16,
            WeightDtype::Int8 => CpuWeightFormat::Int8,
            WeightDtype::A8 => CpuWeightFormat::A8,
        }
    }
}

impl CpuWeightFormat {
    pub fn name(self) -> &'static str {
        match self {
            CpuWeightFormat::F32 => "f32",
            CpuWeightFormat::Bf16 => "bf16",
            CpuWeightFormat::Int8 => "int8",
            CpuWeightFormat::A8 => "a8",
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    weight_format: CpuWeightFormat,
}

impl CpuBackend {
    pub fn new(weight_format: CpuWeightFormat) -> Self {
        Self { weight_format }
    }
}

/// A row-major activation `[rows, cols]`. Reshaping keeps the allocation, so buffers reused across steps
/// stop allocating once they have seen the largest batch.
#[derive(Debug, Clone, Default)]
pub struct CpuTensor {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl CpuTensor {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    pub(super) fn reshape(&mut self, rows: usize, cols: usize) {
        self.rows = rows;
        self.cols = cols;
        self.data.resize(rows * cols, 0.0);
    }
}

/// A weight matrix `[rows = out_features, cols = in_features]`, stored in the matmul kernels' column panels
/// (`cpu_matmul::Weights`); an embedding lookup gathers its row from them.
#[derive(Debug, Clone)]
pub struct CpuMatrix {
    rows: usize,
    cols: usize,
    storage: MatrixStorage,
}

#[derive(Debug, Clone)]
enum MatrixStorage {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Int8 { values: Vec<i8>, scales: Vec<f32> },
    A8(A8Matrix),
    /// The f32 format's weights, exactly, as the integer blocks of the file (`cpu_matmul::pack_blocks`).
    Blocks(BlockMatrix),
}

impl MatrixStorage {
    fn bytes(&self) -> usize {
        match self {
            MatrixStorage::F32(data) => 4 * data.len(),
            MatrixStorage::Bf16(data) => 2 * data.len(),
            MatrixStorage::Int8 { values, scales } => values.len() + 4 * scales.len(),
            MatrixStorage::Blocks(blocks) => blocks.bytes(),
            MatrixStorage::A8(matrix) => matrix.bytes(),
        }
    }
}

impl CpuMatrix {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The matmul kernels' view of the weights (the `a8` format has kernels of its own).
    fn weights(&self) -> Weights<'_> {
        match &self.storage {
            MatrixStorage::F32(data) => Weights::F32(data),
            MatrixStorage::Bf16(data) => Weights::Bf16(data),
            MatrixStorage::Int8 { values, scales } => Weights::Int8 { values, scales },
            MatrixStorage::Blocks(blocks) => blocks.weights(),
            MatrixStorage::A8(_) => unreachable!("a8 matrices go to cpu_matmul_a8"),
        }
    }

    fn copy_row(&self, r: usize, out: &mut [f32]) {
        match &self.storage {
            MatrixStorage::A8(matrix) => matrix.row_to_f32(r, out),
            _ => self.weights().row_to_f32(r, out),
        }
    }

    /// `out[m, rows] = x[m, cols] · selfᵀ`.
    fn multiply_transposed(&self, x: &[f32], m: usize, out: &mut [f32]) {
        match &self.storage {
            MatrixStorage::A8(matrix) => cpu_matmul_a8::matmul(x, matrix, out, m, self.rows),
            _ => matmul_transposed(x, self.weights(), out, m, self.cols, self.rows),
        }
    }
}

#[derive(Debug, Clone)]
pub struct CpuVector(Vec<f32>);

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Matrix = CpuMatrix;
    type Vector = CpuVector;
    type KvCache = CpuKvCache;
    type Batch = BatchPlan;

    fn description(&self) -> String {
        let weights = match self.weight_format {
            CpuWeightFormat::F32 => "f32".to_string(),
            CpuWeightFormat::A8 => format!("a8: integer weights times 8-bit activations, {:?} kernel", cpu_matmul_a8::A8Kernel::detect()),
            other => format!("{} weights, f32 compute", other.name()),
        };
        format!("cpu ({weights}, {} threads, {} kernels)", rayon::current_num_threads(), Kernels::detect().name())
    }

    fn upload_matrix(&self, host: HostTensor) -> Result<CpuMatrix> {
        let [rows, cols] = host.shape[..] else {
            return internal(format!("upload_matrix wants a 2-D tensor, got shape {:?}", host.shape));
        };
        check_host_len(&host)?;
        let storage = match self.weight_format {
            // Weights dequantized from a GGUF's quantized blocks keep that form: the same values, a sixth to a
            // third of the bytes each matmul streams. Not for the portable kernels (no AVX2), which would widen
            // every panel element by element, slower than streaming f32.
            CpuWeightFormat::F32 => {
                let blocks = host.blocks.as_ref().filter(|_| Kernels::detect() != Kernels::Portable);
                match blocks.and_then(|blocks| pack_blocks(&host.data, blocks, rows, cols)) {
                    Some(blocks) => MatrixStorage::Blocks(blocks),
                    None => MatrixStorage::F32(pack_f32(&host.values(), rows, cols)),
                }
            }
            CpuWeightFormat::Bf16 => MatrixStorage::Bf16(pack_bf16(&host.values(), rows, cols)),
            CpuWeightFormat::Int8 => {
                let (values, scales) = pack_int8(&host.values(), rows, cols);
                MatrixStorage::Int8 { values, scales }
            }
            // A width that is no multiple of the activations' groups of 32 (tiny test models) stays exact.
            CpuWeightFormat::A8 => match A8Matrix::pack(&host, rows, cols) {
                Some(matrix) => MatrixStorage::A8(matrix),
                None => MatrixStorage::F32(pack_f32(&host.values(), rows, cols)),
            },
        };
        Ok(CpuMatrix { rows, cols, storage })
    }

    fn matrix_bytes(&self, matrix: &CpuMatrix) -> usize {
        matrix.storage.bytes()
    }

    fn upload_vector(&self, host: HostTensor) -> Result<CpuVector> {
        if host.shape.len() != 1 {
            return internal(format!("upload_vector wants a 1-D tensor, got shape {:?}", host.shape));
        }
        check_host_len(&host)?;
        Ok(CpuVector(host.into_values()))
    }

    fn new_tensor(&self) -> CpuTensor {
        CpuTensor::default()
    }

    fn allocate_kv_cache(&self, shape: KvCacheShape) -> Result<CpuKvCache> {
        if shape.dtype != KvCacheDtype::Auto {
            return invalid(format!(
                "kv_cache_dtype={:?} is a CUDA option; the CPU backend keeps its KV cache in f32 (use \"auto\")",
                shape.dtype.name()
            ));
        }
        CpuKvCache::new(shape)
    }

    fn new_batch(&self) -> BatchPlan {
        BatchPlan::default()
    }

    fn upload_batch(&self, plan: &BatchPlan, batch: &mut BatchPlan) -> Result<()> {
        batch.clone_from(plan);
        Ok(())
    }

    fn embed(&self, table: &CpuMatrix, batch: &BatchPlan, out: &mut CpuTensor) -> Result<()> {
        out.reshape(batch.num_tokens(), table.cols);
        if let Some(&t) = batch.tokens.iter().find(|&&t| t as usize >= table.rows) {
            return internal(format!("embed: token {t} outside a {}-row table", table.rows));
        }
        for_each_row(&mut out.data, table.cols, |r, row| table.copy_row(batch.tokens[r] as usize, row));
        Ok(())
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuVector, eps: f32, out: &mut CpuTensor) -> Result<()> {
        check_width("rms_norm", x.cols, weight.0.len())?;
        out.reshape(x.rows, x.cols);
        for_each_row(&mut out.data, x.cols, |r, row| rms_norm_row(x.row(r), &weight.0, eps, row));
        Ok(())
    }

    fn add(&self, x: &mut CpuTensor, delta: &CpuTensor) -> Result<()> {
        check_same_shape("add", x, delta)?;
        let add_row = |(xs, ds): (&mut [f32], &[f32])| {
            for (xi, di) in xs.iter_mut().zip(ds) {
                *xi += di;
            }
        };
        let cols = x.cols.max(1);
        if x.data.len() >= PARALLEL_ELEMENTS {
            x.data.par_chunks_mut(cols).zip(delta.data.par_chunks(cols)).for_each(add_row);
        } else {
            x.data.chunks_mut(cols).zip(delta.data.chunks(cols)).for_each(add_row);
        }
        Ok(())
    }

    fn linear(&self, x: &CpuTensor, weight: &CpuMatrix, bias: Option<&CpuVector>, out: &mut CpuTensor) -> Result<()> {
        check_width("linear", x.cols, weight.cols)?;
        out.reshape(x.rows, weight.rows);
        weight.multiply_transposed(&x.data, x.rows, &mut out.data);
        if let Some(bias) = bias {
            check_width("linear bias", weight.rows, bias.0.len())?;
            for_each_row(&mut out.data, weight.rows, |_, row| {
                for (o, b) in row.iter_mut().zip(&bias.0) {
                    *o += b;
                }
            });
        }
        Ok(())
    }

    fn rope_and_write_kv(
        &self,
        qkv: &mut CpuTensor,
        qk_norm: Option<(&CpuVector, &CpuVector)>,
        shape: &AttentionShape,
        batch: &BatchPlan,
        cache: &mut CpuKvCache,
        layer: usize,
    ) -> Result<()> {
        let norms = qk_norm.map(|(q, k)| (q.0.as_slice(), k.0.as_slice()));
        cpu_attention::rope_and_write_kv(qkv, norms, shape, batch, cache, layer)
    }

    fn paged_attention(
        &self,
        qkv: &CpuTensor,
        shape: &AttentionShape,
        batch: &BatchPlan,
        cache: &CpuKvCache,
        layer: usize,
        out: &mut CpuTensor,
    ) -> Result<()> {
        cpu_attention::paged_attention(qkv, shape, batch, cache, layer, out)
    }

    fn silu_mul(&self, gate_up: &CpuTensor, out: &mut CpuTensor) -> Result<()> {
        if !gate_up.cols.is_multiple_of(2) {
            return internal(format!("silu_mul wants [gate | up] rows, got odd width {}", gate_up.cols));
        }
        let half = gate_up.cols / 2;
        out.reshape(gate_up.rows, half);
        for_each_row(&mut out.data, half, |r, row| {
            let (gate, up) = gate_up.row(r).split_at(half);
            for ((o, g), u) in row.iter_mut().zip(gate).zip(up) {
                *o = silu(*g) * u;
            }
        });
        Ok(())
    }

    fn select_logits_rows(&self, x: &CpuTensor, batch: &BatchPlan, out: &mut CpuTensor) -> Result<()> {
        out.reshape(batch.logits_rows.len(), x.cols);
        if let Some(&r) = batch.logits_rows.iter().find(|&&r| r as usize >= x.rows) {
            return internal(format!("select_logits_rows: row {r} of a {}-row tensor", x.rows));
        }
        for_each_row(&mut out.data, x.cols, |i, row| row.copy_from_slice(x.row(batch.logits_rows[i] as usize)));
        Ok(())
    }

    fn copy_to_host(&self, x: &CpuTensor, out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        out.extend_from_slice(&x.data);
        Ok(())
    }
}

fn check_host_len(host: &HostTensor) -> Result<()> {
    let expected: usize = host.shape.iter().product();
    if host.value_count() != expected {
        return internal(format!("host tensor of shape {:?} carries {} values", host.shape, host.value_count()));
    }
    Ok(())
}

fn check_width(op: &str, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return internal(format!("{op}: input width {got} but weight width {expected}"));
    }
    Ok(())
}

fn check_same_shape(op: &str, a: &CpuTensor, b: &CpuTensor) -> Result<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return internal(format!("{op}: shapes [{}, {}] and [{}, {}] differ", a.rows, a.cols, b.rows, b.cols));
    }
    Ok(())
}

pub(super) fn internal<T>(msg: String) -> Result<T> {
    Err(Error::Internal(msg))
}

/// A CPU model runner whose forward passes run on a rayon worker thread.
///
/// A forward fans out to the thread pool a few hundred times (every matmul, most attention calls). Called
/// from a thread outside the pool, each fan-out injects its job and puts the caller to sleep until the pool
/// finishes: two context switches per op, a measurable share of a batch-1 decode step on a small machine.
/// Run on a worker, the same fan-outs split work with the other workers while this one takes part.
pub struct InRayonPool<R>(pub R);

impl<R> InRayonPool<R> {
    fn run<T: Send>(f: impl FnOnce() -> T + Send) -> T {
        if rayon::current_thread_index().is_some() {
            f()
        } else {
            rayon::scope(|_| f())
        }
    }
}

impl<R: crate::model::ModelRunner> crate::model::ModelRunner for InRayonPool<R> {
    fn config(&self) -> &crate::model::ModelConfig {
        self.0.config()
    }

    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize, dtype: KvCacheDtype) -> Result<()> {
        self.0.allocate_kv_cache(num_blocks, block_size, dtype)
    }

    fn forward(&mut self, batch: &crate::model::ForwardBatch) -> Result<Vec<f32>> {
        let inner = &mut self.0;
        Self::run(move || inner.forward(batch))
    }

    fn forward_and_sample(
        &mut self,
        batch: &crate::model::ForwardBatch,
        rows: &[crate::sampling::RowContext],
    ) -> Result<Vec<crate::sampling::Sampled>> {
        let inner = &mut self.0;
        Self::run(move || inner.forward_and_sample(batch, rows))
    }

    fn sample_host_logits(
        &mut self,
        logits: &mut [f32],
        rows: &[crate::sampling::RowContext],
    ) -> Result<Vec<crate::sampling::Sampled>> {
        let inner = &mut self.0;
        Self::run(move || inner.sample_host_logits(logits, rows))
    }

    fn forward_sample_and_score(
        &mut self,
        batch: &crate::model::ForwardBatch,
        rows: &[crate::sampling::RowContext],
        scores: &[crate::sampling::ScoreRow],
    ) -> Result<(Vec<crate::sampling::Sampled>, Vec<crate::request::TokenLogprob>)> {
        let inner = &mut self.0;
        Self::run(move || inner.forward_sample_and_score(batch, rows, scores))
    }

    fn device_description(&self) -> String {
        self.0.device_description()
    }

    fn parameter_count(&self) -> usize {
        self.0.parameter_count()
    }

    fn weight_bytes(&self) -> usize {
        self.0.weight_bytes()
    }

    fn capture_decode_graphs(&mut self, max_batch_size: usize) -> Result<bool> {
        self.0.capture_decode_graphs(max_batch_size)
    }

    fn last_step_timing(&self) -> crate::model::StepTiming {
        self.0.last_step_timing()
    }
}
