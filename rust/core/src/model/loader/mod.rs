//! Model file formats. Every format yields tensors under Hugging Face names, so the model code is written
//! once: a GGUF source translates names and un-permutes llama.cpp's Q/K rows itself.

/// A dense host tensor in f32, row-major; `shape` as stored by Hugging Face (out_features, in_features).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    /// The values, row-major; empty when `blocks` carries them (a GGUF's quantized tensor as loaded): read them
    /// through [`HostTensor::values`].
    pub data: Vec<f32>,
    /// The integer blocks `data` was dequantized from, when the file stored it quantized (a GGUF's Q4_K,
    /// Q8_0, ...): a backend may keep those instead of the floats.
    pub blocks: Option<HostBlocks>,
}

/// A quantized tensor as its integer levels and, for each run of `group` consecutive elements of a row, a scale
/// and a minimum: element `i` is `fma(levels[i], scales[i / group], mins[i / group])`, bit for bit the f32 value
/// the format's dequantizer gives. Laid out row-major like [`HostTensor::data`]; `group` divides a row.
#[derive(Debug, Clone, PartialEq)]
pub struct HostBlocks {
    pub group: usize,
    pub levels: Vec<i8>,
    pub scales: Vec<f32>,
    pub mins: Vec<f32>,
    /// The same constants as super-block factors times small integers, where the format builds them so.
    pub factors: Option<Factors>,
}

/// A K-quant super-block's constants: one factor per super-block (its f16 `d`, or `-dmin` for minimums) times a
/// small integer per group, so that `scales[g] == scale_factors[g / per_super] * scale_steps[g]` and likewise
/// for `mins`, bit for bit in f32 (the product of an f16 value and a 6- or 8-bit integer is exact). A backend
/// may keep these instead of the products: a byte per group instead of four.
#[derive(Debug, Clone, PartialEq)]
pub struct Factors {
    /// Groups per super-block.
    pub per_super: usize,
    pub scale_factors: Vec<f32>,
    pub scale_steps: Vec<i8>,
    pub min_factors: Vec<f32>,
    pub min_steps: Vec<i8>,
}

/// Elements per parallel task of the loader's element-wise passes (checks, integer steps, ranges): large enough
/// that rayon's per-task cost and its short-circuit flag vanish beside the work.
pub const PAR_CHUNK: usize = 1 << 14;

impl Factors {
    /// Whether every scale and minimum is its factor times its step, bit for bit.
    pub fn rebuild(&self, scales: &[f32], mins: &[f32]) -> bool {
        use rayon::prelude::*;
        let exact = |factors: &[f32], steps: &[i8], values: &[f32]| {
            steps.len() == values.len()
                && factors.len() * self.per_super == values.len()
                && values.par_chunks(PAR_CHUNK).zip(steps.par_chunks(PAR_CHUNK)).enumerate().all(|(chunk, (values, steps))| {
                    values.iter().zip(steps).enumerate().all(|(i, (v, &s))| {
                        (factors[(chunk * PAR_CHUNK + i) / self.per_super] * s as f32).to_bits() == v.to_bits()
                    })
                })
        };
        exact(&self.scale_factors, &self.scale_steps, scales) && exact(&self.min_factors, &self.min_steps, mins)
    }

    /// Each step repeated `times` (groups split into `times` smaller ones).
    fn regrouped(self, times: usize) -> Factors {
        let repeat = |v: Vec<i8>| v.into_iter().flat_map(|s| std::iter::repeat_n(s, times)).collect();
        Factors { per_super: self.per_super * times, scale_steps: repeat(self.scale_steps), min_steps: repeat(self.min_steps), ..self }
    }

    fn extend(&mut self, other: &Factors) {
        self.scale_factors.extend_from_slice(&other.scale_factors);
        self.scale_steps.extend_from_slice(&other.scale_steps);
        self.min_factors.extend_from_slice(&other.min_factors);
        self.min_steps.extend_from_slice(&other.min_steps);
    }
}

impl HostBlocks {
    /// Element `i` as its level, scale and minimum give it.
    pub fn value(&self, i: usize) -> f32 {
        let g = i / self.group;
        (self.levels[i] as f32).mul_add(self.scales[g], self.mins[g])
    }

    /// Every element's value, `fma(level, scale, min)`.
    pub fn values(&self) -> Vec<f32> {
        use rayon::prelude::*;
        let group = self.group;
        let mut values = vec![0.0; self.levels.len()];
        values.par_chunks_mut(group).zip(self.levels.par_chunks(group)).zip(self.scales.par_iter().zip(&self.mins)).for_each(
            |((values, levels), (&scale, &min))| {
                values.iter_mut().zip(levels).for_each(|(v, &q)| *v = (q as f32).mul_add(scale, min));
            },
        );
        values
    }

    /// Whether every element of `values` is what its level, scale and minimum give, bit for bit.
    pub fn rebuild(&self, values: &[f32]) -> bool {
        use rayon::prelude::*;
        let group = self.group;
        values.len() == self.levels.len()
            && self.scales.len() * group == values.len()
            && self.mins.len() == self.scales.len()
            && values.par_chunks(group).zip(self.levels.par_chunks(group)).zip(self.scales.par_iter().zip(&self.mins)).all(
                |((values, levels), (&scale, &min))| {
                    values.iter().zip(levels).all(|(v, &q)| (q as f32).mul_add(scale, min).to_bits() == v.to_bits())
                },
            )
    }

    /// The same values with constants per run of `group` elements (a divisor of the current group).
    fn regrouped(self, group: usize) -> HostBlocks {
        assert!(self.group.is_multiple_of(group), "cannot regroup blocks of {} into {group}", self.group);
        let times = self.group / group;
        let repeat = |v: Vec<f32>| v.into_iter().flat_map(|c| std::iter::repeat_n(c, times)).collect();
        let factors = self.factors.map(|f| f.regrouped(times));
        HostBlocks { group, levels: self.levels, scales: repeat(self.scales), mins: repeat(self.mins), factors }
    }

    /// Elements per super-block when the constants are factored.
    fn super_block(&self) -> Option<usize> {
        self.factors.as_ref().map(|f| f.per_super * self.group)
    }
}

impl HostTensor {
    /// A tensor with no quantized form.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> HostTensor {
        HostTensor { shape, data, blocks: None }
    }

    /// Whether the floats are left to the blocks (`data` empty).
    pub fn values_in_blocks(&self) -> bool {
        self.data.is_empty() && self.blocks.as_ref().is_some_and(|b| !b.levels.is_empty())
    }

    /// How many values the tensor holds, as floats or as blocks.
    pub fn value_count(&self) -> usize {
        match &self.blocks {
            Some(blocks) if self.data.is_empty() => blocks.levels.len(),
            _ => self.data.len(),
        }
    }

    /// The values as floats, computed from the blocks where `data` leaves them there.
    pub fn values(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.blocks {
            Some(blocks) if self.values_in_blocks() => std::borrow::Cow::Owned(blocks.values()),
            _ => std::borrow::Cow::Borrowed(&self.data),
        }
    }

    /// [`values`](Self::values), consuming the tensor.
    pub fn into_values(self) -> Vec<f32> {
        match self.blocks {
            Some(blocks) if self.data.is_empty() => blocks.values(),
            _ => self.data,
        }
    }

    /// The same tensor with `data` filled in.
    fn with_floats(mut self) -> HostTensor {
        if self.values_in_blocks() {
            self.data = self.values().into_owned();
        }
        self
    }

    /// Elements per row: every dimension after the first (a vector's rows are its elements).
    fn cols(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// Matrices of equal width stacked row-wise. The result keeps quantized blocks only when every part has them
    /// (in the smallest group any part uses).
    pub fn stack_rows(parts: Vec<HostTensor>) -> HostTensor {
        let cols = parts.first().map_or(0, HostTensor::cols);
        assert!(parts.iter().all(|p| p.shape.len() == 2 && p.cols() == cols), "stack_rows needs matrices of one width");
        let rows = parts.iter().map(|p| p.shape[0]).sum();
        let group = parts.iter().map(|p| p.blocks.as_ref().map(|b| b.group)).collect::<Option<Vec<_>>>().and_then(|g| g.into_iter().min());
        // Floats stay in the blocks only where every part keeps them there; otherwise all parts bring floats.
        let lazy = group.is_some() && parts.iter().all(HostTensor::values_in_blocks);
        let mut parts = parts.into_iter().map(|p| if lazy { p } else { p.with_floats() });
        let Some(first) = parts.next() else { return HostTensor::new(vec![0, 0], Vec::new()) };
        // The first part's buffers grow into the result: the allocator remaps a large buffer instead of copying it.
        let mut data = first.data;
        if !lazy {
            data.reserve_exact(rows * cols - data.len());
        }
        let mut blocks = group.zip(first.blocks).map(|(group, b)| b.regrouped(group));
        for part in parts {
            data.extend_from_slice(&part.data);
            if let (Some(all), Some(own)) = (blocks.as_mut(), part.blocks) {
                let own = own.regrouped(all.group);
                all.levels.extend_from_slice(&own.levels);
                all.scales.extend_from_slice(&own.scales);
                all.mins.extend_from_slice(&own.mins);
                // Factors stay only while every part has them over super-blocks of one size.
                if all.super_block() == own.super_block() {
                    if let (Some(mine), Some(theirs)) = (all.factors.as_mut(), own.factors.as_ref()) {
                        mine.extend(theirs);
                    }
                } else {
                    all.factors = None;
                }
            }
        }
        HostTensor { shape: vec![rows, cols], data, blocks }
    }

    /// Append a row of zeros (blocks included: level 0 with scale and minimum 0 is +0).
    pub fn append_zero_row(&mut self) {
        let cols = self.cols();
        if !self.values_in_blocks() {
            self.data.extend(std::iter::repeat_n(0.0, cols));
        }
        self.shape[0] += 1;
        if let Some(blocks) = self.blocks.as_mut() {
            blocks.levels.extend(std::iter::repeat_n(0, cols));
            blocks.scales.extend(std::iter::repeat_n(0.0, cols / blocks.group));
            blocks.mins.extend(std::iter::repeat_n(0.0, cols / blocks.group));
            if let Some(f) = blocks.factors.as_mut() {
                let (groups, supers) = (cols / blocks.group, cols / blocks.group / f.per_super);
                f.scale_factors.extend(std::iter::repeat_n(0.0, supers));
                f.min_factors.extend(std::iter::repeat_n(0.0, supers));
                f.scale_steps.extend(std::iter::repeat_n(0, groups));
                f.min_steps.extend(std::iter::repeat_n(0, groups));
            }
        }
    }

    /// Columns `start..start + len` of a matrix. Blocks stay where the cut falls on group boundaries (and the
    /// super-block factors where it falls on super-block boundaries); otherwise the result is floats.
    pub fn with_cols(&self, start: usize, len: usize) -> HostTensor {
        let (rows, cols) = (self.shape[0], self.cols());
        assert!(self.shape.len() == 2 && start + len <= cols, "with_cols: columns {start}..{} of {:?}", start + len, self.shape);
        // Row r's elements [from, from + count) of a row-major array with `width` elements per row.
        fn cut<T: Copy>(v: &[T], rows: usize, width: usize, from: usize, count: usize) -> Vec<T> {
            (0..rows).flat_map(|r| v[r * width + from..r * width + from + count].iter().copied()).collect()
        }
        let aligned = |unit: usize| start.is_multiple_of(unit) && len.is_multiple_of(unit);
        let blocks = self.blocks.as_ref().filter(|b| aligned(b.group)).map(|b| {
            let (g, width) = (b.group, cols / b.group);
            let factors = b.factors.as_ref().filter(|f| aligned(g * f.per_super)).map(|f| {
                let supers = width / f.per_super;
                let s = g * f.per_super;
                Factors {
                    per_super: f.per_super,
                    scale_factors: cut(&f.scale_factors, rows, supers, start / s, len / s),
                    scale_steps: cut(&f.scale_steps, rows, width, start / g, len / g),
                    min_factors: cut(&f.min_factors, rows, supers, start / s, len / s),
                    min_steps: cut(&f.min_steps, rows, width, start / g, len / g),
                }
            });
            HostBlocks {
                group: g,
                levels: cut(&b.levels, rows, cols, start, len),
                scales: cut(&b.scales, rows, width, start / g, len / g),
                mins: cut(&b.mins, rows, width, start / g, len / g),
                factors,
            }
        });
        let data = match &blocks {
            Some(_) if self.values_in_blocks() => Vec::new(),
            _ => cut(&self.values(), rows, cols, start, len),
        };
        HostTensor { shape: vec![rows, len], data, blocks }
    }

    /// The tensor whose row `r` is row `order[r]` of this one (a vector's elements are rows of one).
    pub fn with_rows(&self, order: &[usize]) -> HostTensor {
        let cols = self.cols();
        let gather = |v: &[f32], width: usize| order.iter().flat_map(|&r| v[r * width..(r + 1) * width].iter().copied()).collect::<Vec<_>>();
        let blocks = self.blocks.as_ref().map(|b| {
            let width = cols / b.group;
            let steps = |v: &[i8]| order.iter().flat_map(|&r| v[r * width..(r + 1) * width].iter().copied()).collect();
            HostBlocks {
                group: b.group,
                levels: order.iter().flat_map(|&r| b.levels[r * cols..(r + 1) * cols].iter().copied()).collect(),
                scales: gather(&b.scales, width),
                mins: gather(&b.mins, width),
                factors: b.factors.as_ref().map(|f| Factors {
                    per_super: f.per_super,
                    scale_factors: gather(&f.scale_factors, width / f.per_super),
                    scale_steps: steps(&f.scale_steps),
                    min_factors: gather(&f.min_factors, width / f.per_super),
                    min_steps: steps(&f.min_steps),
                }),
            }
        });
        let data = if self.values_in_blocks() { Vec::new() } else { gather(&self.data, cols) };
        HostTensor { shape: self.shape.clone(), data, blocks }
    }
}

/// The part of a tensor that a tensor-parallel rank keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorPart {
    /// Rows `[start, start + len)` of a matrix, or elements of a vector.
    Rows { start: usize, len: usize },
    /// Columns `[start, start + len)` of a matrix.
    Cols { start: usize, len: usize },
}

impl TensorPart {
    /// Why a tensor of `shape` has no such part, if it has none.
    pub fn check(self, hf_name: &str, shape: &[usize]) -> crate::Result<()> {
        let rows = shape.first().copied().unwrap_or(0);
        match (self, shape.len()) {
            (_, 0) | (_, 3..) => crate::error::load_err(format!("tensor {hf_name:?} of shape {shape:?} cannot be sharded")),
            (TensorPart::Rows { start, len }, _) if start + len > rows => {
                crate::error::load_err(format!("tensor {hf_name:?} has {rows} rows; the shard needs rows {start}..{}", start + len))
            }
            (TensorPart::Cols { start, len }, n) if n == 1 || start + len > shape[1] => crate::error::load_err(format!(
                "tensor {hf_name:?} of shape {shape:?} has no columns {start}..{} for the shard",
                start + len
            )),
            _ => Ok(()),
        }
    }

    /// The shape of the part of a tensor of `shape` (checked).
    fn shape(self, shape: &[usize]) -> Vec<usize> {
        let mut out = shape.to_vec();
        match self {
            TensorPart::Rows { len, .. } => out[0] = len,
            TensorPart::Cols { len, .. } => out[1] = len,
        }
        out
    }
}

impl HostTensor {
    /// `part` of this tensor. Whole rows keep a quantized tensor's blocks, and so do columns cut on the format's
    /// group boundaries.
    pub fn into_part(self, hf_name: &str, part: TensorPart) -> crate::Result<HostTensor> {
        part.check(hf_name, &self.shape)?;
        Ok(match part {
            TensorPart::Rows { start, len } => {
                let mut rows = self.with_rows(&(start..start + len).collect::<Vec<_>>());
                rows.shape = part.shape(&self.shape);
                rows
            }
            TensorPart::Cols { start, len } => self.with_cols(start, len),
        })
    }
}

/// Anything that can hand out weights by Hugging Face tensor name, e.g. "model.layers.0.self_attn.q_proj.weight".
pub trait WeightSource {
    fn tensor(&self, hf_name: &str) -> crate::Result<HostTensor>;

    /// `part` of a tensor (a tensor-parallel rank's shard). The default reads the whole tensor and cuts it; a
    /// source that can read a part alone overrides it, so that N ranks convert the checkpoint once, not N times.
    fn tensor_part(&self, hf_name: &str, part: TensorPart) -> crate::Result<HostTensor> {
        self.tensor(hf_name)?.into_part(hf_name, part)
    }

    fn has(&self, hf_name: &str) -> bool;
}

pub mod safetensors;

pub use self::safetensors::{load_hf_config, SafetensorsSource};

/// Open a Hugging Face model directory: its config (EOS ids merged from generation_config.json) and its
/// memory-mapped safetensors weights.
pub fn open_hf_model(dir: &std::path::Path) -> crate::Result<(crate::model::ModelConfig, SafetensorsSource)> {
    Ok((load_hf_config(dir)?, SafetensorsSource::open(dir)?))
}
pub mod gguf_model;
pub mod hf_dir;
pub mod gguf;
pub mod gguf_quant;
