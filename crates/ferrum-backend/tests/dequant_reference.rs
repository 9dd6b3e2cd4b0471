//! Every block format's dequantisation against the `gguf` Python package's, on random blocks
//! (`scripts/fixtures/make_dequant_vectors.py`).

use ferrum_backend::cpu::quant::dequantize;
use ferrum_core::DType;

#[test]
fn dequantize_matches_gguf_python_reference() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/dequant/vectors.json"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let types = [
        ("F16", DType::F16),
        ("BF16", DType::BF16),
        ("Q4_0", DType::Q4_0),
        ("Q4_1", DType::Q4_1),
        ("Q5_0", DType::Q5_0),
        ("Q5_1", DType::Q5_1),
        ("Q8_0", DType::Q8_0),
        ("Q2_K", DType::Q2K),
        ("Q3_K", DType::Q3K),
        ("Q4_K", DType::Q4K),
        ("Q5_K", DType::Q5K),
        ("Q6_K", DType::Q6K),
        ("MXFP4", DType::Mxfp4),
    ];
    for (name, dt) in types {
        let v = &json[name];
        let hex = v["bytes_hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = v["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        // Copy into an aligned buffer, as a mapped GGUF tensor would be.
        let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
        let buf =
            unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, bytes.len()) };
        buf.copy_from_slice(&bytes);
        let mut got = vec![0f32; want.len()];
        assert!(dequantize(dt, buf, &mut got), "{name}: not dequantised");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name}[{i}]: {g} vs {w}"
            );
        }
    }
}
