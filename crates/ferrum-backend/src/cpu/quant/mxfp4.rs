//! MXFP4 (the OCP microscaling format gpt-oss ships its experts in): 32 weights per block,
//! each a 4-bit E2M1 float, sharing one E8M0 exponent byte. GGML's layout: the exponent, then
//! 16 bytes whose low nibbles hold weights 0..16 and high nibbles weights 16..32.
//!
//! E2M1 takes the values 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6. Doubled they are the integers of
//! [`VALUES`], so a block is an int8 vector times 2^(e − 128) — half the exponent's 2^(e − 127) —
//! and its dot product with a Q8 activation block is an exact integer sum times one scale,
//! as for Q4_0.

use super::q8::BlockQ8;

pub const QK: usize = 32;

/// Twice each E2M1 code's value, by code (bit 3 is the sign).
pub const VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockMxfp4 {
    /// E8M0: the block's scale is 2^(e − 127).
    pub e: u8,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 17);

/// Half the scale an E8M0 byte encodes, 2^(e − 128), exactly (subnormal for e < 2). The
/// all-ones byte (E8M0's NaN) comes out as 2^127, as in GGML.
pub fn half_scale(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

pub fn dequantize(blocks: &[BlockMxfp4], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = half_scale(b.e);
        for j in 0..QK / 2 {
            y[j] = VALUES[(b.qs[j] & 0x0f) as usize] as f32 * d;
            y[j + QK / 2] = VALUES[(b.qs[j] >> 4) as usize] as f32 * d;
        }
    }
}

/// `Σ w·a` over matching blocks, integer dot per block.
pub fn vec_dot(w: &[BlockMxfp4], a: &[BlockQ8]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            isum += VALUES[(b.qs[j] & 0x0f) as usize] as i32 * q.qs[j] as i32;
            isum += VALUES[(b.qs[j] >> 4) as usize] as i32 * q.qs[j + QK / 2] as i32;
        }
        sum += isum as f32 * (half_scale(b.e) * q.d);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::q8::{hsum_ps, mul_sum_i8, nibbles, prefetch};
    use std::arch::x86_64::*;

    /// The block's 32 codes looked up as int8 values (a byte shuffle per lane).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(b: &BlockMxfp4) -> __m256i {
        let table = _mm_loadu_si128(VALUES.as_ptr() as *const __m128i);
        let table = _mm256_broadcastsi128_si256(table);
        _mm256_shuffle_epi8(table, nibbles(b.qs.as_ptr()))
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot(w: &[BlockMxfp4], a: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let d = _mm256_set1_ps(half_scale(b.e) * q.d);
            let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(d, mul_sum_i8(values(b), y), acc);
        }
        hsum_ps(acc)
    }

    /// One weight row against four activation rows (each block looked up once).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_x4(w: &[BlockMxfp4], a: [&[BlockQ8]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let x = values(b);
            let dw = half_scale(b.e);
            for r in 0..4 {
                let q = a[r].get_unchecked(i);
                let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * q.d), mul_sum_i8(x, y), acc[r]);
            }
        }
        acc.map(|v| hsum_ps(v))
    }
}
