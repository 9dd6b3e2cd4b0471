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
}
