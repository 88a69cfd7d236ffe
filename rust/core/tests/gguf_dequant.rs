//! GGUF metadata and dequantization against values computed by llama.cpp's gguf-py
//! (tests/fixtures/gguf/make_gguf_fixtures.py).

use serde_json::Value;
use std::path::PathBuf;
use stepllm_core::model::loader::gguf::{GgufModel, GgufValue};
use stepllm_core::model::loader::gguf_quant::{self, GgmlType};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("dequant_expected.json")).unwrap()).unwrap()
}

#[test]
fn gguf_every_type_dequantizes_exactly_as_gguf_py() {
    let model = GgufModel::open(fixture("dequant.gguf")).unwrap();
    let tensors = expected()["tensors"].as_object().unwrap().clone();
    assert_eq!(tensors.len(), 15);
    for (name, want) in &tensors {
        let info = model.tensor_info(name).unwrap_or_else(|| panic!("fixture lacks {name}"));
        assert_eq!(info.ggml_type.name(), want["type"].as_str().unwrap(), "{name}");
        let got = model.dequantize(name).unwrap();
        let shape: Vec<usize> = want["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        assert_eq!(got.shape, shape, "{name} shape");
        let float = matches!(info.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        assert_eq!(got.blocks.is_none(), float, "{name}: the quantized types come with their blocks");
        let values: Vec<f32> = want["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(got.data.len(), values.len(), "{name} length");
        for (i, (g, w)) in got.data.iter().zip(&values).enumerate() {
            assert_eq!(g, w, "{name}[{i}]: got {g}, gguf-py gives {w}");
        }
        // Decoded for loading, a quantized tensor comes as the same blocks without its floats.
        let bytes = model.tensor_data(name).unwrap();
        let (floats, blocks) = gguf_quant::decode(info.ggml_type, bytes, values.len(), false).unwrap();
        assert_eq!(floats.is_empty(), !float, "{name}: floats only for the float types");
        assert_eq!(blocks, got.blocks, "{name}");
    }
}

#[test]
fn gguf_all_metadata_value_types_parse() {
    let model = GgufModel::open(fixture("dequant.gguf")).unwrap();
    assert_eq!(model.version(), 3);
    assert_eq!(model.metadata("test.u8"), Some(&GgufValue::U8(200)));
    assert_eq!(model.metadata("test.i8"), Some(&GgufValue::I8(-100)));
    assert_eq!(model.metadata("test.u16"), Some(&GgufValue::U16(60000)));
    assert_eq!(model.metadata("test.i16"), Some(&GgufValue::I16(-30000)));
    assert_eq!(model.metadata("test.u32"), Some(&GgufValue::U32(4_000_000_000)));
    assert_eq!(model.metadata("test.i32"), Some(&GgufValue::I32(-2_000_000_000)));
    assert_eq!(model.metadata("test.u64"), Some(&GgufValue::U64((1 << 63) + 5)));
    assert_eq!(model.metadata("test.i64"), Some(&GgufValue::I64(-(1 << 62))));
    assert_eq!(model.metadata("test.f32"), Some(&GgufValue::F32(0.25)));
    assert_eq!(model.metadata("test.f64"), Some(&GgufValue::F64(-1.5e300)));
    assert_eq!(model.metadata("test.bool"), Some(&GgufValue::Bool(true)));
    assert_eq!(model.metadata("test.string").and_then(|v| v.as_str()), Some("héllo ✓"));
    let ints = |xs: &[i32]| GgufValue::Array(xs.iter().map(|&x| GgufValue::I32(x)).collect());
    assert_eq!(model.metadata("test.array_i32"), Some(&ints(&[1, -2, 3])));
    let strings = model.metadata("test.array_str").and_then(|v| v.as_array()).unwrap();
    assert_eq!(strings.iter().map(|s| s.as_str().unwrap()).collect::<Vec<_>>(), ["a", "bc", ""]);
    assert_eq!(model.metadata("test.array_nested"), Some(&GgufValue::Array(vec![ints(&[1, 2]), ints(&[3])])));
    assert_eq!(model.metadata("general.architecture").and_then(|v| v.as_str()), Some("test"));
    assert_eq!(model.metadata("no.such.key"), None);
}

#[test]
fn gguf_value_accessors_convert_numbers() {
    assert_eq!(GgufValue::I8(-1).as_u64(), None);
    assert_eq!(GgufValue::I8(-1).as_i64(), Some(-1));
    assert_eq!(GgufValue::U64(u64::MAX).as_i64(), None);
    assert_eq!(GgufValue::U16(7).as_f64(), Some(7.0));
    assert_eq!(GgufValue::F32(0.5).as_u64(), None);
    assert_eq!(GgufValue::String("x".into()).as_f64(), None);
}

#[test]
fn gguf_custom_alignment_places_the_data_section() {
    let model = GgufModel::open(fixture("dequant.gguf")).unwrap();
    assert_eq!(model.alignment(), 64);
    assert_eq!(model.data_offset() % 64, 0);
    for t in model.tensor_infos() {
        assert_eq!(t.offset % 64, 0, "{}", t.name);
    }
    let q4k = model.tensor_info("t_q4_k").unwrap();
    assert_eq!((q4k.ggml_type, q4k.dims.as_slice(), q4k.n_elements, q4k.n_bytes), (GgmlType::Q4_K, &[256u64, 2][..], 512, 288));
    assert_eq!(model.tensor_data("t_q4_k").unwrap().len(), 288);
}

#[test]
fn gguf_default_alignment_is_32() {
    let model = GgufModel::open(fixture("tiny_llama.gguf")).unwrap();
    assert_eq!(model.metadata("general.alignment"), None);
    assert_eq!(model.alignment(), 32);
    assert_eq!(model.data_offset() % 32, 0);
}

#[test]
fn gguf_unsupported_types_open_but_do_not_dequantize() {
    // Retag t_f32 (4 bytes an element) as I32, which has the same geometry and is no weight type.
    let mut bytes = std::fs::read(fixture("dequant.gguf")).unwrap();
    let name = b"t_f32";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let type_at = at + 4 + 2 * 8; // n_dims, then two u64 dims
    assert_eq!(u32::from_le_bytes(bytes[type_at..type_at + 4].try_into().unwrap()), GgmlType::F32.id());
    bytes[type_at..type_at + 4].copy_from_slice(&GgmlType::I32.id().to_le_bytes());
    let model = GgufModel::from_bytes(bytes).unwrap();
    let err = model.dequantize("t_f32").unwrap_err().to_string();
    assert!(err.contains("I32") && err.contains("t_f32") && err.contains("IQ4_XS"), "{err}");
    assert!(model.dequantize("t_q4_1").is_ok());
}
