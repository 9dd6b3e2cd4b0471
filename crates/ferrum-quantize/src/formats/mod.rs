//! Row quantisers, one module per GGUF block format, each following llama.cpp's reference
//! (`quantize_row_*_ref` in `ggml-quants.c`, no importance matrix). Every function takes
//! whole blocks of f32 and writes the block bytes in GGML's layout (`ggml-common.h`), so the
//! output can be read back by `ferrum_backend::cpu::quant`.

pub mod float;
pub mod iq4;
pub mod k_search;
pub mod mxfp4;
pub mod q2_k;
pub mod q3_k;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;

use half::f16;

/// Writes an f32 as the little-endian f16 GGML stores (round to nearest even).
#[inline]
pub(crate) fn put_f16(out: &mut [u8], v: f32) {
    out.copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The value an f32 takes once stored as f16; later steps of the K-quant algorithms use the
/// rounded super-scale, as llama.cpp does.
#[inline]
pub(crate) fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Index and value of the element with the largest magnitude (the first one on ties).
#[inline]
pub(crate) fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// Minimum and maximum of a block.
#[inline]
pub(crate) fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}
