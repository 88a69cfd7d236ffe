//! RoPE's frequencies: the base `theta` and how a checkpoint rescales them for a longer context.
//!
//! The frequencies are computed in f32 in the order of transformers' operations, so the angles (and so the
//! logits) match the reference; `tests/fixtures/llama3` holds transformers' own inverse frequencies.

use std::sync::Arc;

use crate::error::{load_err, Result};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f32,
    pub scaling: RopeScaling,
}

/// How the inverse frequencies `1 / theta^(2i/d)` are rescaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// transformers' "linear": every inverse frequency divided by `factor`.
    Linear { factor: f32 },
    /// transformers' "llama3" (Llama 3.1 and later): long wavelengths divided by `factor`, short ones kept,
    /// and a smooth blend between the two.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position_embeddings: f32 },
    /// llama.cpp's `rope_freqs.weight`, how a GGUF stores llama3 scaling: pair i's inverse frequency is
    /// divided by `factors[i]`.
    FrequencyFactors(Arc<[f32]>),
}

impl Rope {
    pub fn plain(theta: f32) -> Self {
        Self { theta, scaling: RopeScaling::None }
    }

    pub fn is_plain(&self) -> bool {
        self.scaling == RopeScaling::None
    }

    /// The inverse frequency of each rotated pair (`head_dim / 2` of them).
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f32> {
        let plain = (0..head_dim / 2).map(|i| 1.0 / self.theta.powf((2 * i) as f32 / head_dim as f32));
        match &self.scaling {
            RopeScaling::None => plain.collect(),
            RopeScaling::Linear { factor } => plain.map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let scaling = Llama3Scaling {
                    factor: *factor,
                    low: *low_freq_factor,
                    high: *high_freq_factor,
                    context: *original_max_position_embeddings,
                };
                plain.map(|f| scaling.apply(f)).collect()
            }
            RopeScaling::FrequencyFactors(factors) => plain.zip(factors.iter()).map(|(f, d)| f / d).collect(),
        }
    }

    /// The scaling by name, as `info` and errors report it.
    pub fn scaling_name(&self) -> &'static str {
        match self.scaling {
            RopeScaling::None => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::FrequencyFactors(_) => "per-frequency factors (rope_freqs.weight)",
        }
    }

    /// From a config.json: `rope_parameters` (transformers 5) or `rope_theta` and `rope_scaling` (earlier).
    pub fn from_hf_config(v: &Value) -> Result<Self> {
        let params = if v["rope_parameters"].is_object() { &v["rope_parameters"] } else { &v["rope_scaling"] };
        let theta = params["rope_theta"].as_f64().or_else(|| v["rope_theta"].as_f64()).unwrap_or(10000.0) as f32;
        // Older configs name the kind "type".
        let kind = params["rope_type"].as_str().or_else(|| params["type"].as_str()).unwrap_or("default");
        let number = |key: &str| -> Result<f32> {
            match params[key].as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x as f32),
                _ => load_err(format!("rope scaling {kind:?} needs a positive number {key:?} in config.json")),
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: number("factor")? },
            "llama3" => {
                let (low_freq_factor, high_freq_factor) = (number("low_freq_factor")?, number("high_freq_factor")?);
                if high_freq_factor <= low_freq_factor {
                    return load_err(format!(
                        "llama3 rope scaling needs high_freq_factor ({high_freq_factor}) above low_freq_factor ({low_freq_factor})"
                    ));
                }
                RopeScaling::Llama3 {
                    factor: number("factor")?,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: number("original_max_position_embeddings")?,
                }
            }
            other => {
                return load_err(format!(
                    "rope scaling {other:?} is not supported yet; stepllm runs default, linear and llama3 RoPE"
                ))
            }
        };
        Ok(Self { theta, scaling })
    }
}

/// transformers' `_compute_llama3_parameters`, one frequency at a time and in its f32 operations (`a / t` on a
/// tensor is `t.reciprocal() * a` in torch).
struct Llama3Scaling {
    factor: f32,
    low: f32,
    high: f32,
    context: f32,
}

impl Llama3Scaling {
    fn apply(&self, inv_freq: f32) -> f32 {
        let wavelen = (1.0 / inv_freq) * std::f32::consts::TAU;
        let (low_wavelen, high_wavelen) = (self.context / self.low, self.context / self.high);
        let long = if wavelen > low_wavelen { inv_freq / self.factor } else { inv_freq };
        if wavelen < high_wavelen || wavelen > low_wavelen {
            return long;
        }
        let smooth = ((1.0 / wavelen) * self.context - self.low) / (self.high - self.low);
        (1.0 - smooth) * long / self.factor + smooth * long
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama3(theta: f32) -> Rope {
        let v = json!({"rope_theta": theta, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
        Rope::from_hf_config(&v).unwrap()
    }

    #[test]
    fn llama3_keeps_short_wavelengths_divides_long_ones_and_blends_between() {
        let (rope, head_dim) = (llama3(500000.0), 64);
        let plain = Rope::plain(500000.0).inverse_frequencies(head_dim);
        let scaled = rope.inverse_frequencies(head_dim);
        for (p, s) in plain.iter().zip(&scaled) {
            let wavelen = std::f32::consts::TAU / p;
            if wavelen < 8192.0 / 4.0 {
                assert_eq!(s, p);
            } else if wavelen > 8192.0 {
                assert_eq!(*s, p / 8.0);
            } else {
                assert!(*s < *p && *s > p / 8.0, "blended {s} outside ({}, {p})", p / 8.0);
            }
        }
        // Llama 3's head_dim 64 at theta 500000 has pairs in all three bands.
        let bands = |f: &dyn Fn(f32) -> bool| plain.iter().filter(|p| f(std::f32::consts::TAU / **p)).count();
        assert!(bands(&|w| w < 2048.0) > 0 && bands(&|w| w > 8192.0) > 0 && bands(&|w| (2048.0..=8192.0).contains(&w)) > 0);
    }

    #[test]
    fn config_forms_old_and_new_name_the_same_scaling() {
        let new = json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}});
        let old = json!({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}});
        assert_eq!(Rope::from_hf_config(&new).unwrap(), Rope::from_hf_config(&old).unwrap());
        let rope = Rope::from_hf_config(&new).unwrap();
        assert_eq!(rope.inverse_frequencies(8)[1], Rope::plain(1e6).inverse_frequencies(8)[1] / 2.0);
        assert!(Rope::from_hf_config(&json!({"rope_theta": 1e4, "rope_scaling": null})).unwrap().is_plain());
    }

    #[test]
    fn unknown_or_incomplete_scaling_is_refused_with_what_is_missing() {
        let yarn = json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}});
        assert!(Rope::from_hf_config(&yarn).unwrap_err().to_string().contains("\"yarn\" is not supported"));
        let no_factor = json!({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0}});
        assert!(Rope::from_hf_config(&no_factor).unwrap_err().to_string().contains("\"high_freq_factor\""));
    }

    #[test]
    fn frequency_factors_divide_each_pair() {
        let rope = Rope { theta: 10000.0, scaling: RopeScaling::FrequencyFactors(vec![1.0, 2.0, 4.0, 8.0].into()) };
        let plain = Rope::plain(10000.0).inverse_frequencies(8);
        assert_eq!(rope.inverse_frequencies(8), vec![plain[0], plain[1] / 2.0, plain[2] / 4.0, plain[3] / 8.0]);
    }
}
