//! Hugging Face safetensors checkpoints: one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`, memory-mapped; F32, F16 and BF16 tensors are converted to f32 on request.

use super::{HostTensor, TensorPart, WeightSource};
use crate::error::{load_err, Error, Result};
use crate::model::config::{ids_from, ModelConfig};
use ::safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::Value;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
/// safetensors files start with the header length as a little-endian u64.
const HEADER_LEN_BYTES: usize = 8;

/// Weights of a Hugging Face checkpoint, served by tensor name.
pub struct SafetensorsSource {
    shards: Vec<Shard>,
    /// Tensor name -> index into `shards`.
    shard_of: HashMap<String, usize>,
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

impl SafetensorsSource {
    /// Open the checkpoint in a model directory (sharded when `model.safetensors.index.json` is there).
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_index(dir, &index);
        }
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            return Self::open_files(&[single]);
        }
        load_err(format!(
            "{} has neither {SINGLE_FILE} nor {INDEX_FILE}; point at a Hugging Face model directory with \
             safetensors weights (download one with `huggingface-cli download <repo> --local-dir <dir>`)",
            dir.display()
        ))
    }

    /// Open explicit safetensors files; every tensor of every file is served.
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut source = Self { shards: Vec::new(), shard_of: HashMap::new() };
        for path in paths {
            let shard = Shard::open(path)?;
            let at = source.shards.len();
            for name in shard.metadata.tensors().into_keys() {
                if let Some(previous) = source.shard_of.insert(name.clone(), at) {
                    return load_err(format!(
                        "tensor {name:?} is in both {} and {}; the checkpoint is inconsistent, re-download it",
                        source.shards[previous].path.display(),
                        path.display()
                    ));
                }
            }
            source.shards.push(shard);
        }
        Ok(source)
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Self> {
        let text = read_text(index)?;
        let parsed: Value = serde_json::from_str(&text)
            .or_else(|e| load_err(format!("{} is not valid JSON ({e}); re-download it", index.display())))?;
        let Some(weight_map) = parsed["weight_map"].as_object() else {
            return load_err(format!("{} has no \"weight_map\" object; re-download it", index.display()));
        };
        let mut files: Vec<&str> = Vec::new();
        let mut shard_of = HashMap::new();
        for (name, file) in weight_map {
            let Some(file) = file.as_str() else {
                return load_err(format!("{}: weight_map[{name:?}] is not a file name", index.display()));
            };
            let at = files.iter().position(|f| *f == file).unwrap_or_else(|| {
                files.push(file);
                files.len() - 1
            });
            shard_of.insert(name.clone(), at);
        }
        let mut shards = Vec::with_capacity(files.len());
        for file in &files {
            shards.push(Shard::open(&dir.join(file))?);
        }
        for (name, &at) in &shard_of {
            if shards[at].metadata.info(name).is_none() {
                return load_err(format!(
                    "{} lists {name:?} in {} but that file does not hold it; re-download the checkpoint",
                    index.display(),
                    files[at]
                ));
            }
        }
        Ok(Self { shards, shard_of })
    }

    /// Names of every tensor served, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.shard_of.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Shape as stored, without reading the data.
    pub fn shape(&self, hf_name: &str) -> Option<Vec<usize>> {
        let shard = &self.shards[*self.shard_of.get(hf_name)?];
        shard.metadata.info(hf_name).map(|info| info.shape.clone())
    }
}

impl WeightSource for SafetensorsSource {
    fn tensor(&self, hf_name: &str) -> Result<HostTensor> {
        let Some(&at) = self.shard_of.get(hf_name) else {
            return load_err(format!("the checkpoint has no tensor {hf_name:?}"));
        };
        self.shards[at].tensor(hf_name)
    }

    fn tensor_part(&self, hf_name: &str, part: TensorPart) -> Result<HostTensor> {
        let Some(&at) = self.shard_of.get(hf_name) else {
            return load_err(format!("the checkpoint has no tensor {hf_name:?}"));
        };
        self.shards[at].tensor_part(hf_name, part)
    }

    fn has(&self, hf_name: &str) -> bool {
        self.shard_of.contains_key(hf_name)
    }
}

impl Shard {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).or_else(|e| {
            load_err(format!("cannot open {} ({e}); check that the checkpoint is fully downloaded", path.display()))
        })?;
        // SAFETY: the map is read-only; like every safetensors reader we assume nobody truncates the
        // checkpoint while it is loaded.
        let mmap = unsafe { Mmap::map(&file) }
            .or_else(|e| load_err(format!("cannot memory-map {} ({e})", path.display())))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&mmap).or_else(|e| {
            load_err(format!("{} is not a valid safetensors file ({e}); re-download it", path.display()))
        })?;
        Ok(Self { path: path.to_path_buf(), mmap, header_len, metadata })
    }

    fn tensor(&self, name: &str) -> Result<HostTensor> {
        let info = self.info(name)?;
        Ok(HostTensor::new(info.shape.clone(), self.floats(name, info.dtype, self.bytes(info))?))
    }

    /// Only the part's bytes are converted: each tensor-parallel rank reads its shard, not the whole tensor.
    fn tensor_part(&self, name: &str, part: TensorPart) -> Result<HostTensor> {
        let info = self.info(name)?;
        part.check(name, &info.shape)?;
        let bytes = self.bytes(info);
        // Bytes per element; a dtype that `floats` does not read is refused there.
        let size = info.dtype.bitsize() / 8;
        let row = info.shape.iter().skip(1).product::<usize>() * size;
        let floats = match part {
            TensorPart::Rows { start, len } => self.floats(name, info.dtype, &bytes[start * row..(start + len) * row])?,
            TensorPart::Cols { start, len } => {
                let (from, to) = (start * size, (start + len) * size);
                // max(1): a tensor with no columns has no bytes, and chunks_exact(0) would panic.
                let cut: Vec<u8> = bytes.chunks_exact(row.max(1)).flat_map(|r| &r[from..to]).copied().collect();
                self.floats(name, info.dtype, &cut)?
            }
        };
        Ok(HostTensor::new(part.shape(&info.shape), floats))
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.metadata
            .info(name)
            .ok_or_else(|| Error::Load(format!("{} does not hold tensor {name:?}", self.path.display())))
    }

    /// `bytes` of tensor `name`, stored as `dtype`, as f32.
    fn floats(&self, name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
        // Converted on every core: a billion-parameter checkpoint is gigabytes, and loading is on the cold start.
        Ok(match dtype {
            Dtype::F32 => convert(bytes, |b: &[u8; 4]| f32::from_le_bytes(*b)),
            Dtype::F16 => convert(bytes, |b: &[u8; 2]| half::f16::from_le_bytes(*b).to_f32()),
            Dtype::BF16 => convert(bytes, |b: &[u8; 2]| half::bf16::from_le_bytes(*b).to_f32()),
            other => {
                return load_err(format!(
                    "tensor {name:?} in {} has dtype {other:?}; stepllm reads F32, F16 and BF16 checkpoints \
                     (quantized safetensors are not supported)",
                    self.path.display()
                ))
            }
        })
    }

    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        // read_metadata checked that every tensor's offsets lie inside the file.
        let data_start = HEADER_LEN_BYTES + self.header_len;
        let (begin, end) = info.data_offsets;
        &self.mmap[data_start + begin..data_start + end]
    }
}

/// Read `config.json` of a Hugging Face model directory, adding the EOS ids of `generation_config.json`
/// (when present) to the model's own: generation stops at any of them, as transformers' `generate` does.
pub fn load_hf_config(dir: &Path) -> Result<ModelConfig> {
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return load_err(format!(
            "{} has no config.json; point at a Hugging Face model directory (the one holding config.json and \
             model.safetensors)",
            dir.display()
        ));
    }
    let mut config = ModelConfig::from_hf_json(&read_text(&config_path)?)
        .map_err(|e| Error::Load(format!("{}: {e}", config_path.display())))?;
    let generation_path = dir.join("generation_config.json");
    if generation_path.is_file() {
        let text = read_text(&generation_path)?;
        let generation: Value = serde_json::from_str(&text).or_else(|e| {
            load_err(format!("{} is not valid JSON ({e}); fix or delete it", generation_path.display()))
        })?;
        for id in ids_from(&generation["eos_token_id"]) {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
    }
    Ok(config)
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).or_else(|e| load_err(format!("cannot read {} ({e})", path.display())))
}

/// Little-endian `N`-byte values to f32, in parallel chunks.
fn convert<const N: usize>(bytes: &[u8], to_f32: impl Fn(&[u8; N]) -> f32 + Sync) -> Vec<f32> {
    bytes
        .par_chunks_exact(N)
        .with_min_len(1 << 16)
        .map(|b| to_f32(b.try_into().expect("chunks_exact gives N bytes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::fixture_dir as fixture;

    #[test]
    fn sharded_and_single_checkpoints_open() {
        let llama = SafetensorsSource::open(&fixture("llama")).unwrap();
        assert!(llama.shards.len() > 1);
        assert_eq!(llama.tensor("model.norm.weight").unwrap().shape, vec![64]);
        let qwen2 = SafetensorsSource::open(&fixture("qwen2")).unwrap();
        assert!(qwen2.has("model.layers.0.self_attn.q_proj.bias"));
    }

    #[test]
    fn generation_config_eos_ids_are_merged() {
        let config = load_hf_config(&fixture("qwen3")).unwrap();
        assert_eq!(config.eos_token_ids, vec![2, 0]);
    }

    /// A tensor-parallel rank's part, read alone, equals the part cut from the whole tensor, for every dtype read;
    /// a part outside the tensor or an unread dtype is an error, not a panic.
    #[test]
    fn a_part_read_alone_equals_the_part_cut_from_the_whole_tensor() {
        use ::safetensors::tensor::{serialize_to_file, TensorView};
        let values: Vec<f32> = (0..15).map(|i| i as f32 * 0.25 - 1.5).collect();
        let f32s: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16s: Vec<u8> = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        let bf16s: Vec<u8> = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
        let ints = vec![7u8; 15];
        let dir = std::env::temp_dir().join(format!("stepllm-part-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tensors = [
            ("m.f32", TensorView::new(Dtype::F32, vec![3, 5], &f32s).unwrap()),
            ("m.f16", TensorView::new(Dtype::F16, vec![3, 5], &f16s).unwrap()),
            ("m.bf16", TensorView::new(Dtype::BF16, vec![3, 5], &bf16s).unwrap()),
            ("v.bf16", TensorView::new(Dtype::BF16, vec![15], &bf16s).unwrap()),
            ("m.i8", TensorView::new(Dtype::I8, vec![3, 5], &ints).unwrap()),
        ];
        serialize_to_file(tensors, None, &dir.join(SINGLE_FILE)).unwrap();
        let source = SafetensorsSource::open(&dir).unwrap();
        let parts = [
            TensorPart::Rows { start: 0, len: 3 },
            TensorPart::Rows { start: 1, len: 2 },
            TensorPart::Cols { start: 0, len: 5 },
            TensorPart::Cols { start: 2, len: 2 },
        ];
        for name in ["m.f32", "m.f16", "m.bf16"] {
            for part in parts {
                let alone = source.tensor_part(name, part).unwrap();
                assert_eq!(alone, source.tensor(name).unwrap().into_part(name, part).unwrap(), "{name} {part:?}");
            }
        }
        let cols = source.tensor_part("m.bf16", TensorPart::Cols { start: 2, len: 2 }).unwrap();
        assert_eq!((cols.shape.clone(), cols.data), (vec![3, 2], vec![-1.0, -0.75, 0.25, 0.5, 1.5, 1.75]));
        let elements = TensorPart::Rows { start: 4, len: 6 };
        let alone = source.tensor_part("v.bf16", elements).unwrap();
        assert_eq!((alone.shape.clone(), &alone.data[..]), (vec![6], &values[4..10]));
        for (name, part, why) in [
            ("m.f32", TensorPart::Rows { start: 2, len: 2 }, "has 3 rows; the shard needs rows 2..4"),
            ("m.f32", TensorPart::Cols { start: 4, len: 2 }, "has no columns 4..6"),
            ("v.bf16", TensorPart::Cols { start: 0, len: 1 }, "has no columns 0..1"),
            ("m.i8", TensorPart::Rows { start: 0, len: 1 }, "has dtype I8"),
        ] {
            let err = source.tensor_part(name, part).unwrap_err().to_string();
            assert!(err.contains(why), "{name} {part:?}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_directory_names_what_to_do() {
        let err = SafetensorsSource::open(Path::new("/nonexistent/model")).err().unwrap();
        assert!(err.to_string().contains("huggingface-cli download"), "{err}");
        let err = load_hf_config(Path::new("/nonexistent/model")).unwrap_err();
        assert!(err.to_string().contains("config.json"), "{err}");
    }
}
