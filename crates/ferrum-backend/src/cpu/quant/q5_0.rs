//! Q5_0: 32 weights per block, 5-bit with an implicit offset of 16: four low bits in
//! nibbles, the fifth bits packed in a 32-bit mask.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);

pub fn dequantize(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            let x0 = ((b.qs[j] as u32 & 0x0f) | h0) as i32 - 16;
            let x1 = ((b.qs[j] as u32 >> 4) | h1) as i32 - 16;
            y[j] = x0 as f32 * d;
            y[j + QK / 2] = x1 as f32 * d;
        }
    }
}

use super::q8::BlockQ8;

pub fn vec_dot(w: &[BlockQ5_0], a: &[BlockQ8]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let qh = u32::from_le_bytes(b.qh);
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            isum += (((b.qs[j] as u32 & 0x0f) | h0) as i32 - 16) * q.qs[j] as i32;
            isum += (((b.qs[j] as u32 >> 4) | h1) as i32 - 16) * q.qs[j + QK / 2] as i32;
        }
        sum += isum as f32 * (b.d.to_f32() * q.d);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::q8::{
        bytes_from_bits, fp16, hsum_ps, mul_sum_i8, mul_sum_u8_i8, nibbles, prefetch,
    };
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot(w: &[BlockQ5_0], a: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let high = _mm256_set1_epi8(0xf0u8 as i8);
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let d = _mm256_set1_ps(fp16(b.d) * q.d);
            // (q | bit << 4) - 16 as a signed byte: q - 16 (= q | 0xf0) where the bit is clear,
            // q where it is set.
            let hbits = bytes_from_bits(u32::from_le_bytes(b.qh));
            let x = _mm256_or_si256(nibbles(b.qs.as_ptr()), _mm256_andnot_si256(hbits, high));
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
    pub unsafe fn vec_dot_x4(w: &[BlockQ5_0], a: [&[BlockQ8]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let high = _mm256_set1_epi8(0xf0u8 as i8);
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let hbits = bytes_from_bits(u32::from_le_bytes(b.qh));
            let x = _mm256_or_si256(nibbles(b.qs.as_ptr()), _mm256_andnot_si256(hbits, high));
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

    /// Two weight rows against four activation rows (a prefill tile).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; both rows have as many blocks as the activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_2x4(w: [&[BlockQ5_0]; 2], a: [&[BlockQ8]; 4]) -> crate::cpu::quant::Tile {
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        let high = _mm256_set1_epi8(0xf0u8 as i8);
        for i in 0..w[0].len() {
            let (b0, b1) = (w[0].get_unchecked(i), w[1].get_unchecked(i));
            prefetch(b0);
            prefetch(b1);
            let h0 = bytes_from_bits(u32::from_le_bytes(b0.qh));
            let h1 = bytes_from_bits(u32::from_le_bytes(b1.qh));
            let x0 = _mm256_or_si256(nibbles(b0.qs.as_ptr()), _mm256_andnot_si256(h0, high));
            let x1 = _mm256_or_si256(nibbles(b1.qs.as_ptr()), _mm256_andnot_si256(h1, high));
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
