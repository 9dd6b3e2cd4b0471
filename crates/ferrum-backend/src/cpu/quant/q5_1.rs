//! Q5_1: 32 weights per block, 5-bit unsigned with an f16 scale and minimum.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

pub fn dequantize(blocks: &[BlockQ5_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            y[j] = ((b.qs[j] as u32 & 0x0f) | h0) as f32 * d + m;
            y[j + QK / 2] = ((b.qs[j] as u32 >> 4) | h1) as f32 * d + m;
        }
    }
}

use super::q8::BlockQ8;

pub fn vec_dot(w: &[BlockQ5_1], a: &[BlockQ8]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let qh = u32::from_le_bytes(b.qh);
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            isum += ((b.qs[j] as u32 & 0x0f) | h0) as i32 * q.qs[j] as i32;
            isum += ((b.qs[j] as u32 >> 4) | h1) as i32 * q.qs[j + QK / 2] as i32;
        }
        sum += isum as f32 * (b.d.to_f32() * q.d) + b.m.to_f32() * q.s;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::q8::{bytes_from_bits, fp16, hsum_ps, mul_sum_u8_i8, nibbles, prefetch};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot(w: &[BlockQ5_1], a: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0f32;
        let bit4 = _mm256_set1_epi8(0x10);
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let d = _mm256_set1_ps(fp16(b.d) * q.d);
            let hbits = bytes_from_bits(u32::from_le_bytes(b.qh));
            let x = _mm256_or_si256(nibbles(b.qs.as_ptr()), _mm256_and_si256(hbits, bit4));
            let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(d, mul_sum_u8_i8(x, y), acc);
            mins += fp16(b.m) * q.s;
        }
        hsum_ps(acc) + mins
    }
}
