//! Plain float rows: F32, F16 (IEEE half, round to nearest even) and BF16 (rounded the way
//! ggml's `ggml_compute_fp32_to_bf16` does, NaNs kept quiet).

use half::f16;

pub fn quantize_f32(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn quantize_f16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
}

/// One f32 to bf16 bits.
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        // NaN: truncate and force the quiet bit, so rounding cannot turn it into infinity.
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

pub fn quantize_bf16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
    }
}
