//! Per-format quantiser tests: byte-exact against the `gguf` Python package and llama.cpp
//! (fixture from `scripts/make_quant_vectors.py`), and round-trip error through
//! `ferrum_backend`'s dequantisers within the bounds of llama.cpp's `test-quantize-fns.cpp`.

use ferrum_backend::cpu::quant::dequantize;
use ferrum_core::DType;
use ferrum_quantize::quantize_row;
use rand::{rngs::StdRng, Rng, SeedableRng};

const ALL: [DType; 16] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Mxfp4,
    DType::Iq4Nl,
    DType::Iq4Xs,
];

fn dtype_by_name(name: &str) -> DType {
    *ALL.iter().find(|d| d.name() == name).unwrap()
}

fn round_trip(dtype: DType, x: &[f32]) -> Vec<f32> {
    let mut q = vec![0u8; dtype.bytes_for(x.len()).unwrap()];
    quantize_row(dtype, x, &mut q).unwrap();
    // Copy into u64 storage so block casts are aligned whatever the allocator does.
    let mut aligned = vec![0u64; q.len().div_ceil(8)];
    let bytes = unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, q.len()) };
    bytes.copy_from_slice(&q);
    let mut y = vec![0f32; x.len()];
    assert!(
        dequantize(dtype, bytes, &mut y),
        "{dtype}: dequantize failed"
    );
    y
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn byte_identical_to_gguf_python_and_llama_cpp() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/quant_vectors.json"
    ))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let x: Vec<f32> = v["input_f32_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
        .collect();
    let row_len = v["row_len"].as_u64().unwrap() as usize;
    let mut checked = 0;
    for group in ["quantized_hex", "kquant_hex"] {
        for (name, want) in v[group].as_object().unwrap() {
            let dtype = dtype_by_name(name);
            let want = hex(want.as_str().unwrap());
            let row_bytes = dtype.bytes_for(row_len).unwrap();
            let mut got = vec![0u8; want.len()];
            for (xr, o) in x.chunks(row_len).zip(got.chunks_mut(row_bytes)) {
                quantize_row(dtype, xr, o).unwrap();
            }
            for (r, (g, w)) in got
                .chunks(row_bytes)
                .zip(want.chunks(row_bytes))
                .enumerate()
            {
                assert!(g == w, "{name}: row {r} differs from the reference");
            }
            checked += 1;
        }
    }
    assert_eq!(
        checked, 13,
        "fixture should hold 8 simple formats (MXFP4 among them) and 5 K-quants"
    );
}

/// IQ4_NL and IQ4_XS byte for byte against llama.cpp's `quantize_iq4_nl` / `quantize_iq4_xs`
/// without an importance matrix (what llama-quantize calls), on rows normal, heavy-tailed,
/// uniform, tiny, constant, zero, spiky and half zero (`scripts/fixtures/make_iq_fixtures.py`
/// on llama.cpp's compiled library).
#[test]
fn iq4_byte_identical_to_llama_cpp() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/iq4_vectors.json"
    ))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for dtype in [DType::Iq4Nl, DType::Iq4Xs] {
        let f = &v[dtype.name()];
        let x: Vec<f32> = f["x_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
            .collect();
        let row_len = f["n_per_row"].as_u64().unwrap() as usize;
        let want = hex(f["bytes_hex"].as_str().unwrap());
        let row_bytes = dtype.bytes_for(row_len).unwrap();
        assert_eq!(want.len(), x.len() / row_len * row_bytes);
        for (r, (xr, w)) in x.chunks(row_len).zip(want.chunks(row_bytes)).enumerate() {
            let mut got = vec![0u8; row_bytes];
            quantize_row(dtype, xr, &mut got).unwrap();
            let at = got.iter().zip(w).position(|(a, b)| a != b);
            assert!(at.is_none(), "{dtype}: row {r} differs at byte {at:?}");
        }
    }
}

/// llama.cpp's test data and metric: `0.1 + 2 cos(i + offset)`, `sqrt(Σ d²) / n`.
fn llama_cpp_total_error(dtype: DType) -> f32 {
    let x: Vec<f32> = (0..32 * 128)
        .map(|i| 0.1 + 2.0 * (i as f32).cos())
        .collect();
    let y = round_trip(dtype, &x);
    let sum: f64 = x
        .iter()
        .zip(&y)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    (sum.sqrt() as f32) / x.len() as f32
}

#[test]
fn total_error_within_llama_cpp_bounds() {
    for dtype in ALL {
        let bound = match dtype {
            DType::Q2K => 0.0075,
            DType::Q3K => 0.0040,
            DType::Mxfp4 => 0.0030,
            _ => 0.002,
        };
        let e = llama_cpp_total_error(dtype);
        eprintln!("{dtype:5} llama.cpp total error {e:.6} (bound {bound})");
        assert!(e < bound, "{dtype}: total error {e} >= {bound}");
    }
}

fn normal(rng: &mut StdRng) -> f32 {
    // Box-Muller: weights of trained layers are close to normal.
    let u1: f32 = rng.gen_range(f32::EPSILON..1.0);
    let u2: f32 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

fn rel_rmse(x: &[f32], y: &[f32]) -> f32 {
    let num: f32 = x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f32 = x.iter().map(|a| a * a).sum();
    (num / den).sqrt()
}

/// Relative RMS error on normal and uniform data, each bound set a little above what the
/// reference algorithm gives (and ordered by bits per weight).
#[test]
fn relative_error_on_random_and_normal_data() {
    let mut rng = StdRng::seed_from_u64(7);
    let n = 256 * 64;
    let normal_x: Vec<f32> = (0..n).map(|_| 0.02 * normal(&mut rng)).collect();
    let uniform_x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    for dtype in ALL {
        let bound = match dtype {
            DType::F32 => 0.0,
            DType::F16 => 0.001,
            DType::BF16 => 0.004,
            DType::Q8_0 => 0.006,
            DType::Q6K => 0.02,
            DType::Q5_0 | DType::Q5_1 | DType::Q5K => 0.045,
            DType::Q4_0 | DType::Q4_1 | DType::Q4K => 0.09,
            DType::Iq4Nl | DType::Iq4Xs => 0.09,
            // Power-of-two scales and the E2M1 grid (steps up to 2 at the top of 6).
            DType::Mxfp4 => 0.15,
            DType::Q3K => 0.17,
            DType::Q2K => 0.32,
            _ => unreachable!(),
        };
        for (what, x) in [("normal", &normal_x), ("uniform", &uniform_x)] {
            let e = rel_rmse(x, &round_trip(dtype, x));
            eprintln!("{dtype:5} {what:7} relative RMSE {e:.5} (bound {bound})");
            assert!(e <= bound, "{dtype} {what}: relative RMSE {e} > {bound}");
        }
    }
}

/// Plain min/max (or abs-max) rounding per group with exact f32 scales: what the K-quant
/// searches must beat even though their own scales are rounded to 4-8 bits.
fn naive(x: &[f32], group: usize, bits: u32, symmetric: bool) -> Vec<f32> {
    let mut y = Vec::with_capacity(x.len());
    let levels = ((1u32 << bits) - 1) as f32;
    for g in x.chunks(group) {
        if symmetric {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let half = (1u32 << (bits - 1)) as f32 - 1.0;
            let d = amax / half;
            y.extend(
                g.iter()
                    .map(|v| if d == 0.0 { 0.0 } else { (v / d).round() * d }),
            );
        } else {
            let min = g.iter().fold(f32::MAX, |m, &v| m.min(v));
            let max = g.iter().fold(f32::MIN, |m, &v| m.max(v));
            let d = (max - min) / levels;
            y.extend(g.iter().map(|v| {
                if d == 0.0 {
                    min
                } else {
                    ((v - min) / d).round() * d + min
                }
            }));
        }
    }
    y
}

#[test]
fn k_quants_beat_naive_rounding() {
    let mut rng = StdRng::seed_from_u64(11);
    let x: Vec<f32> = (0..256 * 64).map(|_| normal(&mut rng)).collect();
    for (dtype, group, bits, sym) in [
        (DType::Q2K, 16, 2, false),
        (DType::Q3K, 16, 3, true),
        (DType::Q4K, 32, 4, false),
        (DType::Q5K, 32, 5, false),
        (DType::Q6K, 16, 6, true),
    ] {
        let k = rel_rmse(&x, &round_trip(dtype, &x));
        let n = rel_rmse(&x, &naive(&x, group, bits, sym));
        eprintln!(
            "{dtype:5} K-quant {k:.5} vs naive {n:.5} ({:.1}% better)",
            100.0 * (1.0 - k / n)
        );
        assert!(
            k < 0.97 * n,
            "{dtype}: K-quant error {k} is not clearly below naive {n}"
        );
    }
}

#[test]
fn zeros_and_constant_rows_survive() {
    for dtype in ALL {
        let zeros = vec![0f32; 256];
        assert_eq!(round_trip(dtype, &zeros), zeros, "{dtype} zeros");
        let ones = vec![0.5f32; 256];
        let y = round_trip(dtype, &ones);
        assert!(
            rel_rmse(&ones, &y) < 0.02,
            "{dtype} constant row: {:?}",
            &y[..4]
        );
    }
}

#[test]
fn wrong_sizes_are_errors() {
    let x = vec![0f32; 100];
    let mut out = vec![0u8; 1000];
    assert!(quantize_row(DType::Q4_0, &x, &mut out).is_err());
    let x = vec![0f32; 256];
    assert!(quantize_row(DType::Q4K, &x, &mut out).is_err());
    assert!(quantize_row(DType::Q8K, &x, &mut out).is_err());
}
