//! Q8_0: 32 weights per block, signed 8-bit with one f16 scale.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

pub fn dequantize(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (yj, &q) in y.iter_mut().zip(b.qs.iter()) {
            *yj = q as f32 * d;
        }
    }
}

/// A row of floats as Q8_0 blocks in the file's byte layout, as llama.cpp's
/// `quantize_row_q8_0_ref` makes them (the scale `max |x| / 127`, each value rounded half
/// away from zero): the weights an encoder's fast path multiplies in 8 bits.
pub fn quantize_row(x: &[f32], out: &mut Vec<u8>) {
    for block in x.chunks(QK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for i in 0..QK {
            let v = block.get(i).copied().unwrap_or(0.0) * id;
            out.push(v.round() as i8 as u8);
        }
    }
}

use super::q8::BlockQ8;

pub fn vec_dot(w: &[BlockQ8_0], a: &[BlockQ8]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let isum: i32 =
            b.qs.iter()
                .zip(&q.qs)
                .map(|(&x, &y)| x as i32 * y as i32)
                .sum();
        sum += isum as f32 * (b.d.to_f32() * q.d);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::q8::{fp16, hsum_ps, mul_sum_i8, mul_sum_u8_i8, prefetch};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot(w: &[BlockQ8_0], a: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let d = _mm256_set1_ps(fp16(b.d) * q.d);
            let x = _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i);
            let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(d, mul_sum_i8(x, y), acc);
        }
        hsum_ps(acc)
    }

    /// One weight row against four activation rows.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_x4(w: &[BlockQ8_0], a: [&[BlockQ8]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let x = _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i);
            let ax = _mm256_sign_epi8(x, x);
            let dw = fp16(b.d);
            for r in 0..4 {
                let q = a[r].get_unchecked(i);
                let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
                let p = mul_sum_u8_i8(ax, _mm256_sign_epi8(y, x));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * q.d), p, acc[r]);
            }
        }
        [
            hsum_ps(acc[0]),
            hsum_ps(acc[1]),
            hsum_ps(acc[2]),
            hsum_ps(acc[3]),
        ]
    }

    /// Two weight rows against four activation rows (a prefill tile): each activation
    /// block is loaded once for both rows. Per (row, token) the same arithmetic as `vec_dot`.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; both rows have as many blocks as the activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_2x4(w: [&[BlockQ8_0]; 2], a: [&[BlockQ8]; 4]) -> [[f32; 4]; 2] {
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        for i in 0..w[0].len() {
            let (b0, b1) = (w[0].get_unchecked(i), w[1].get_unchecked(i));
            prefetch(b0);
            prefetch(b1);
            let x0 = _mm256_loadu_si256(b0.qs.as_ptr() as *const __m256i);
            let x1 = _mm256_loadu_si256(b1.qs.as_ptr() as *const __m256i);
            let (ax0, ax1) = (_mm256_sign_epi8(x0, x0), _mm256_sign_epi8(x1, x1));
            let (d0, d1) = (fp16(b0.d), fp16(b1.d));
            for r in 0..4 {
                let q = a[r].get_unchecked(i);
                let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
                let p0 = mul_sum_u8_i8(ax0, _mm256_sign_epi8(y, x0));
                let p1 = mul_sum_u8_i8(ax1, _mm256_sign_epi8(y, x1));
                acc[0][r] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * q.d), p0, acc[0][r]);
                acc[1][r] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * q.d), p1, acc[1][r]);
            }
        }
        acc.map(|row| row.map(|v| hsum_ps(v)))
    }
}
