//! Every block format's dequantisation against the `gguf` Python package's, on random blocks
//! (`scripts/fixtures/make_dequant_vectors.py`).

use ferrum_backend::cpu::quant::dequantize;
use ferrum_core::DType;

#[allow(dead_code)] // the format lists only
mod common;

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

/// splitmix64, as `scripts/fixtures/make_iq_fixtures.py` runs it: (next state, output).
fn splitmix64(state: u64) -> (u64, u64) {
    let s = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (s, z ^ (z >> 31))
}

/// The fixture script's `stream_blocks`: `n` blocks of `dt` from splitmix64 seeded with the
/// type's GGML id, each with an f16 scale `0x1400 + r % 0x0c00` where the format keeps one.
fn stream_blocks(dt: DType, n: usize) -> Vec<u8> {
    let bb = dt.block_bytes();
    let mut state = dt.ggml_id().unwrap() as u64;
    let mut raw = Vec::with_capacity(n * bb + 8);
    while raw.len() < n * bb {
        let (s, r) = splitmix64(state);
        state = s;
        raw.extend_from_slice(&r.to_le_bytes());
    }
    raw.truncate(n * bb);
    for blk in raw.chunks_mut(bb) {
        let (s, r) = splitmix64(state);
        state = s;
        set_scale(dt, blk, (0x1400 + r % 0x0c00) as u16);
    }
    raw
}

fn set_scale(dt: DType, blk: &mut [u8], bits: u16) {
    if dt == DType::Iq1M {
        // The f16 sits in the top nibbles of the four u16 scale words at byte 48.
        for k in 0..4 {
            let at = 48 + 2 * k;
            let w = u16::from_le_bytes([blk[at], blk[at + 1]]);
            let w = (w & 0x0fff) | (((bits >> (4 * k)) & 0xf) << 12);
            blk[at..at + 2].copy_from_slice(&w.to_le_bytes());
        }
        return;
    }
    let at = match dt {
        DType::Tq1_0 => 52,
        DType::Tq2_0 => 64,
        _ => 0,
    };
    blk[at..at + 2].copy_from_slice(&bits.to_le_bytes());
}

fn fnv1a(values: &[f32]) -> String {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for v in values {
        for b in v.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01B3);
        }
    }
    format!("{h:016x}")
}

fn dequantized(dt: DType, bytes: &[u8]) -> Vec<f32> {
    let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
    let buf =
        unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, bytes.len()) };
    buf.copy_from_slice(bytes);
    let n = bytes.len() / dt.block_bytes() * dt.block_len();
    let mut got = vec![0f32; n];
    assert!(dequantize(dt, buf, &mut got), "{dt}: not dequantised");
    got
}

/// The i-quants and TQ formats bit for bit against llama.cpp's own `dequantize_row_*`
/// (`scripts/fixtures/make_iq_fixtures.py`, run on llama.cpp's compiled library): a few
/// random blocks value by value, and 512 blocks per format — every codebook point met — by
/// a hash of the values' bits.
#[test]
fn iquants_dequantize_bit_equal_to_llama_cpp() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/dequant/iq_vectors.json"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(common::blocks::IQUANTS[0], DType::Iq4Nl);
    for &dt in common::blocks::IQUANTS {
        let v = &json[dt.name()];
        let hex = v["bytes_hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<u32> = v["values_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let got = dequantized(dt, &bytes);
        assert_eq!(got.len(), want.len(), "{dt}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), *w, "{dt}[{i}]: {g} vs {}", f32::from_bits(*w));
        }
        let n = v["many_blocks"].as_u64().unwrap() as usize;
        let many = dequantized(dt, &stream_blocks(dt, n));
        assert_eq!(
            fnv1a(&many),
            v["many_fnv1a"].as_str().unwrap(),
            "{dt}: {n} blocks differ from llama.cpp's dequantisation"
        );
    }
}
