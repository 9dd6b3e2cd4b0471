//! Q4_1: 32 weights per block, 4-bit unsigned with an f16 scale and an f16 minimum.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

pub fn dequantize(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        for j in 0..QK / 2 {
            y[j] = (b.qs[j] & 0x0f) as f32 * d + m;
            y[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

use super::q8::BlockQ8;

/// `Σ w·a`: `d_w·d_a·Σ q_w·q_a + m_w·s_a` per block.
pub fn vec_dot(w: &[BlockQ4_1], a: &[BlockQ8]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            isum += (b.qs[j] & 0x0f) as i32 * q.qs[j] as i32;
            isum += (b.qs[j] >> 4) as i32 * q.qs[j + QK / 2] as i32;
        }
        sum += isum as f32 * (b.d.to_f32() * q.d) + b.m.to_f32() * q.s;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::q8::{fp16, hsum_ps, mul_sum_u8_i8, nibbles, prefetch};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot(w: &[BlockQ4_1], a: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0f32;
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let d = _mm256_set1_ps(fp16(b.d) * q.d);
            let x = nibbles(b.qs.as_ptr());
            let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(d, mul_sum_u8_i8(x, y), acc);
            mins += fp16(b.m) * q.s;
        }
        hsum_ps(acc) + mins
    }

    /// One weight row against four activation rows: nibbles and scales decoded once.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_x4(w: &[BlockQ4_1], a: [&[BlockQ8]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut mins = [0f32; 4];
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let x = nibbles(b.qs.as_ptr());
            let (dw, mw) = (fp16(b.d), fp16(b.m));
            for r in 0..4 {
                let q = a[r].get_unchecked(i);
                let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * q.d), mul_sum_u8_i8(x, y), acc[r]);
                mins[r] += mw * q.s;
            }
        }
        [
            hsum_ps(acc[0]) + mins[0],
            hsum_ps(acc[1]) + mins[1],
            hsum_ps(acc[2]) + mins[2],
            hsum_ps(acc[3]) + mins[3],
        ]
    }

    /// Four weight rows against one activation row.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; the rows have `a.len()` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_rows4(w: [&[BlockQ4_1]; 4], a: &[BlockQ8]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut mins = [0f32; 4];
        for (i, q) in a.iter().enumerate() {
            let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
            for r in 0..4 {
                let b = w[r].get_unchecked(i);
                prefetch(b);
                let x = nibbles(b.qs.as_ptr());
                acc[r] =
                    _mm256_fmadd_ps(_mm256_set1_ps(fp16(b.d) * q.d), mul_sum_u8_i8(x, y), acc[r]);
                mins[r] += fp16(b.m) * q.s;
            }
        }
        [
            hsum_ps(acc[0]) + mins[0],
            hsum_ps(acc[1]) + mins[1],
            hsum_ps(acc[2]) + mins[2],
            hsum_ps(acc[3]) + mins[3],
        ]
    }

    /// Two weight rows against four activation rows (a prefill tile).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; both rows have as many blocks as the activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_2x4(w: [&[BlockQ4_1]; 2], a: [&[BlockQ8]; 4]) -> crate::cpu::quant::Tile {
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        let mut mins = [[0f32; 4]; 2];
        for i in 0..w[0].len() {
            let (b0, b1) = (w[0].get_unchecked(i), w[1].get_unchecked(i));
            prefetch(b0);
            prefetch(b1);
            let (x0, x1) = (nibbles(b0.qs.as_ptr()), nibbles(b1.qs.as_ptr()));
            let (d0, m0, d1, m1) = (fp16(b0.d), fp16(b0.m), fp16(b1.d), fp16(b1.m));
            for r in 0..4 {
                let q = a[r].get_unchecked(i);
                let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
                acc[0][r] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d0 * q.d), mul_sum_u8_i8(x0, y), acc[0][r]);
                acc[1][r] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d1 * q.d), mul_sum_u8_i8(x1, y), acc[1][r]);
                mins[0][r] += m0 * q.s;
                mins[1][r] += m1 * q.s;
            }
        }
        let mut out = [[0f32; 4]; 2];
        for k in 0..2 {
            for r in 0..4 {
                out[k][r] = hsum_ps(acc[k][r]) + mins[k][r];
            }
        }
        out
    }
}
