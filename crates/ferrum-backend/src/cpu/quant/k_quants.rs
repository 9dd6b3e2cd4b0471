//! The K-quant super-block formats (Q2_K … Q6_K): 256 weights per super-block, split into
//! sub-blocks with their own 4-, 6- or 8-bit scales (and minimums for the "_1"-style types)
//! relative to f16 super-scales.

use half::f16;

pub const QK_K: usize = 256;
const K_SCALE_SIZE: usize = 12;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ2K {
    /// Low nibble: sub-block scale; high nibble: sub-block minimum.
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ3K {
    /// The high (third) bit of each weight.
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    /// Sixteen 6-bit scales packed in 12 bytes.
    pub scales: [u8; 12],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    /// Eight 6-bit scales and eight 6-bit minimums packed in 12 bytes.
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ6K {
    /// Low four bits.
    pub ql: [u8; QK_K / 2],
    /// High two bits.
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

pub fn dequantize_q2k(blocks: &[BlockQ2K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let mut i = 0;
        let mut is = 0;
        for half in 0..2 {
            let q = &b.qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let sc = b.scales[is];
                    is += 1;
                    let dl = d * (sc & 0x0f) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for &ql in &q[part * 16..part * 16 + 16] {
                        y[i] = dl * ((ql >> shift) & 3) as f32 - ml;
                        i += 1;
                    }
                }
            }
        }
    }
}

/// Unpacks Q3_K's sixteen 6-bit scales (stored biased by 32).
fn q3k_scales(packed: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let a0 = u32::from_le_bytes([packed[0], packed[1], packed[2], packed[3]]);
    let a1 = u32::from_le_bytes([packed[4], packed[5], packed[6], packed[7]]);
    let tmp = u32::from_le_bytes([packed[8], packed[9], packed[10], packed[11]]);
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut s = [0i8; 16];
    for (i, w) in aux.iter().enumerate() {
        for (j, byte) in w.to_le_bytes().iter().enumerate() {
            s[i * 4 + j] = *byte as i8 - 32;
        }
    }
    s
}

pub fn dequantize_q3k(blocks: &[BlockQ3K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d_all = b.d.to_f32();
        let scales = q3k_scales(&b.scales);
        let mut i = 0;
        let mut is = 0;
        let mut m: u8 = 1;
        for half in 0..2 {
            let q = &b.qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    let range = part * 16..part * 16 + 16;
                    for (&ql, &hm) in q[range.clone()].iter().zip(&b.hmask[range]) {
                        let low = ((ql >> shift) & 3) as i32;
                        let high = if hm & m != 0 { 0 } else { 4 };
                        y[i] = dl * (low - high) as f32;
                        i += 1;
                    }
                }
                m = m.wrapping_shl(1);
            }
        }
    }
}

/// Scale and minimum `j` (0..8) of the packed 6-bit pairs used by Q4_K and Q5_K.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

pub fn dequantize_q4k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for chunk in 0..4 {
            let q = &b.qs[chunk * 32..chunk * 32 + 32];
            let (sc1, m1) = scale_min_k4(2 * chunk, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[chunk * 64..chunk * 64 + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q5k(blocks: &[BlockQ5K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for chunk in 0..4 {
            let ql = &b.qs[chunk * 32..chunk * 32 + 32];
            let u1 = 1u8 << (2 * chunk);
            let u2 = 2u8 << (2 * chunk);
            let (sc1, m1) = scale_min_k4(2 * chunk, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[chunk * 64..chunk * 64 + 64];
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q6k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for half in 0..2 {
            let ql = &b.ql[half * 64..half * 64 + 64];
            let qh = &b.qh[half * 32..half * 32 + 32];
            let sc = &b.scales[half * 8..half * 8 + 8];
            let y = &mut y[half * 128..half * 128 + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}

use super::q8::BlockQ8K;

/// All eight (scale, min) pairs of a Q4_K / Q5_K block.
#[inline(always)]
pub(crate) fn scales_mins(q: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        (sc[j], mn[j]) = scale_min_k4(j, q);
    }
    (sc, mn)
}

/// `Σ_j mins[j] · (sum of the 32 activations of sub-block j)`.
#[inline(always)]
fn mins_dot(mins: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8)
        .map(|j| mins[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32))
        .sum()
}

pub fn vec_dot_q2k(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let summs: i32 = (0..16)
            .map(|g| (b.scales[g] >> 4) as i32 * q.bsums[g] as i32)
            .sum();
        let mut isum = 0i32;
        let mut i = 0;
        let mut is = 0;
        for half in 0..2 {
            let qs = &b.qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let sc = (b.scales[is] & 0x0f) as i32;
                    is += 1;
                    let mut s = 0i32;
                    for &ql in &qs[part * 16..part * 16 + 16] {
                        s += ((ql >> shift) & 3) as i32 * q.qs[i] as i32;
                        i += 1;
                    }
                    isum += sc * s;
                }
            }
        }
        sum += q.d * b.d.to_f32() * isum as f32 - q.d * b.dmin.to_f32() * summs as f32;
    }
    sum
}

pub fn vec_dot_q3k(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let scales = q3k_scales(&b.scales);
        let mut isum = 0i32;
        let mut i = 0;
        let mut is = 0;
        let mut m: u8 = 1;
        for half in 0..2 {
            let qs = &b.qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let mut s = 0i32;
                    let range = part * 16..part * 16 + 16;
                    for (&ql, &hm) in qs[range.clone()].iter().zip(&b.hmask[range]) {
                        let low = ((ql >> shift) & 3) as i32;
                        let high = if hm & m != 0 { 0 } else { 4 };
                        s += (low - high) * q.qs[i] as i32;
                        i += 1;
                    }
                    isum += scales[is] as i32 * s;
                    is += 1;
                }
                m = m.wrapping_shl(1);
            }
        }
        sum += q.d * b.d.to_f32() * isum as f32;
    }
    sum
}

pub fn vec_dot_q4k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let (sc, mn) = scales_mins(&b.scales);
        let mut isum = 0i32;
        for c in 0..4 {
            let qs = &b.qs[c * 32..c * 32 + 32];
            let y = &q.qs[c * 64..c * 64 + 64];
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                lo += (qs[l] & 0x0f) as i32 * y[l] as i32;
                hi += (qs[l] >> 4) as i32 * y[l + 32] as i32;
            }
            isum += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
        }
        sum += q.d * b.d.to_f32() * isum as f32
            - q.d * b.dmin.to_f32() * mins_dot(&mn, &q.bsums) as f32;
    }
    sum
}

pub fn vec_dot_q5k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let (sc, mn) = scales_mins(&b.scales);
        let mut isum = 0i32;
        for c in 0..4 {
            let qs = &b.qs[c * 32..c * 32 + 32];
            let y = &q.qs[c * 64..c * 64 + 64];
            let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                lo += ((qs[l] & 0x0f) + h1) as i32 * y[l] as i32;
                hi += ((qs[l] >> 4) + h2) as i32 * y[l + 32] as i32;
            }
            isum += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
        }
        sum += q.d * b.d.to_f32() * isum as f32
            - q.d * b.dmin.to_f32() * mins_dot(&mn, &q.bsums) as f32;
    }
    sum
}

pub fn vec_dot_q6k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let mut isum = 0i32;
        for half in 0..2 {
            let ql = &b.ql[half * 64..half * 64 + 64];
            let qh = &b.qh[half * 32..half * 32 + 32];
            let sc = &b.scales[half * 8..half * 8 + 8];
            let y = &q.qs[half * 128..half * 128 + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                isum += sc[is] as i32 * q1 * y[l] as i32
                    + sc[is + 2] as i32 * q2 * y[l + 32] as i32
                    + sc[is + 4] as i32 * q3 * y[l + 64] as i32
                    + sc[is + 6] as i32 * q4 * y[l + 96] as i32;
            }
        }
        sum += q.d * b.d.to_f32() * isum as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::q8::{fp16, hsum_ps, prefetch};
    use std::arch::x86_64::*;

    /// Sum of the eight i32 lanes (exact: the caller's sums fit in i32).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum_epi32(v: __m256i) -> i32 {
        let q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let h = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0b01_00_11_10));
        _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0b10_11_00_01)))
    }

    /// Sub-block scales `s[i]` (low 128 bits) and `s[i + 1]` (high) as sixteen i16, to `madd`
    /// the two 16-weight sub-blocks of a 32-byte vector by their own scale.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_pair(s: &[i16; 16], i: usize) -> __m256i {
        _mm256_set_m128i(_mm_set1_epi16(s[i + 1]), _mm_set1_epi16(s[i]))
    }

    /// Q2_K: each 2-bit vector (one shift of 32 stored bytes) is two sub-blocks of sixteen,
    /// multiplied in `maddubs` and scaled in `madd`. The sums are exact integers and the
    /// per-block float arithmetic is `vec_dot_q2k`'s, so the result has its bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q2k(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let m4 = _mm_set1_epi8(0x0f);
        let mut sum = 0f32;
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let packed = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
            // Minimums (high nibbles) against the activation's sixteen-value sums.
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4));
            let bsums = _mm256_loadu_si256(q.bsums.as_ptr() as *const __m256i);
            let summs = hsum_epi32(_mm256_madd_epi16(mins, bsums));
            let mut sc = [0i16; 16];
            _mm256_storeu_si256(
                sc.as_mut_ptr() as *mut __m256i,
                _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4)),
            );
            let mut isum = _mm256_setzero_si256();
            for half in 0..2 {
                let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * half) as *const __m256i);
                for j in 0..4 {
                    let v = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * j)), m3);
                    let y = _mm256_loadu_si256(
                        q.qs.as_ptr().add(128 * half + 32 * j as usize) as *const __m256i
                    );
                    let p = _mm256_maddubs_epi16(v, y);
                    let is = 8 * half + 2 * j as usize;
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scale_pair(&sc, is)));
                }
            }
            let isum = hsum_epi32(isum);
            sum += q.d * b.d.to_f32() * isum as f32 - q.d * b.dmin.to_f32() * summs as f32;
        }
        sum
    }

    /// Q3_K: a weight is its two low bits minus 4 where its hmask bit is clear; both parts
    /// go through `maddubs` unsigned and are subtracted in i16 (at most 2 · 7 · 128 per
    /// pair), then each sub-block is scaled in `madd` by its signed scale. Exact integer sums
    /// and `vec_dot_q3k`'s per-block float arithmetic: the result has its bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q3k(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let four = _mm256_set1_epi8(4);
        let mut sum = 0f32;
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let sc = q3k_scales(&b.scales).map(|s| s as i16);
            let hmask = _mm256_loadu_si256(b.hmask.as_ptr() as *const __m256i);
            let mut isum = _mm256_setzero_si256();
            for half in 0..2 {
                let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * half) as *const __m256i);
                for j in 0..4 {
                    let low = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * j)), m3);
                    let bit = _mm256_set1_epi8((1u8 << (4 * half + j as usize)) as i8);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
                    // 4 where the bit is clear.
                    let high = _mm256_andnot_si256(set, four);
                    let y = _mm256_loadu_si256(
                        q.qs.as_ptr().add(128 * half + 32 * j as usize) as *const __m256i
                    );
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(low, y),
                        _mm256_maddubs_epi16(high, y),
                    );
                    let is = 8 * half + 2 * j as usize;
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scale_pair(&sc, is)));
                }
            }
            let isum = hsum_epi32(isum);
            sum += q.d * b.d.to_f32() * isum as f32;
        }
        sum
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q4k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0f);
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0f32;
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let (sc, mn) = scales_mins(&b.scales);
            let mut isum = _mm256_setzero_si256();
            for c in 0..4 {
                let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * c) as *const __m256i);
                let lo = _mm256_and_si256(raw, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                let ylo = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c) as *const __m256i);
                let yhi = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c + 32) as *const __m256i);
                let plo = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(lo, ylo),
                    _mm256_set1_epi16(sc[2 * c] as i16),
                );
                let phi = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(hi, yhi),
                    _mm256_set1_epi16(sc[2 * c + 1] as i16),
                );
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(plo, phi));
            }
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(q.d * fp16(b.d)),
                _mm256_cvtepi32_ps(isum),
                acc,
            );
            mins += q.d * fp16(b.dmin) * mins_dot(&mn, &q.bsums) as f32;
        }
        hsum_ps(acc) - mins
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q5k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0f32;
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let (sc, mn) = scales_mins(&b.scales);
            let qh = _mm256_loadu_si256(b.qh.as_ptr() as *const __m256i);
            let mut isum = _mm256_setzero_si256();
            for c in 0..4 {
                let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * c) as *const __m256i);
                // Fifth bits: bit 2c of each qh byte for the low nibbles, 2c+1 for the high.
                let hlo =
                    _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32)), one);
                let hhi = _mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32 + 1)),
                    one,
                );
                let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_slli_epi16(hlo, 4));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                    _mm256_slli_epi16(hhi, 4),
                );
                let ylo = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c) as *const __m256i);
                let yhi = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c + 32) as *const __m256i);
                let plo = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(lo, ylo),
                    _mm256_set1_epi16(sc[2 * c] as i16),
                );
                let phi = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(hi, yhi),
                    _mm256_set1_epi16(sc[2 * c + 1] as i16),
                );
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(plo, phi));
            }
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(q.d * fp16(b.d)),
                _mm256_cvtepi32_ps(isum),
                acc,
            );
            mins += q.d * fp16(b.dmin) * mins_dot(&mn, &q.bsums) as f32;
        }
        hsum_ps(acc) - mins
    }

    /// Q6_K: the 6-bit values are used unsigned (0..63) in `maddubs`, and the offset of 32
    /// is taken back out through the activation group sums.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q6k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let mut acc = _mm256_setzero_ps();
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let mut isum = _mm256_setzero_si256();
            for half in 0..2 {
                let ql0 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * half) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * half + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * half) as *const __m256i);
                let h = |shift: i32| -> __m256i {
                    // Two high bits at `shift`, moved up to bits 4-5 of each byte.
                    let bits = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m2);
                    _mm256_slli_epi16(bits, 4)
                };
                let v = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), h(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), h(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), h(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), h(6)),
                ];
                for (k, vk) in v.iter().enumerate() {
                    let y = _mm256_loadu_si256(
                        q.qs.as_ptr().add(128 * half + 32 * k) as *const __m256i
                    );
                    let g = 8 * half + 2 * k;
                    let scales = _mm256_set_m128i(
                        _mm_set1_epi16(b.scales[g + 1] as i16),
                        _mm_set1_epi16(b.scales[g] as i16),
                    );
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*vk, y), scales);
                    isum = _mm256_add_epi32(isum, p);
                }
            }
            // Take the offset of 32 back out in integers: isum -= 32 · Σ_g scale[g]·bsum[g],
            // sixteen groups at once.
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.scales.as_ptr() as *const __m128i));
            let bs16 = _mm256_loadu_si256(q.bsums.as_ptr() as *const __m256i);
            let off = _mm256_madd_epi16(sc16, bs16);
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(off, 5));
            let d = q.d * fp16(b.d);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum), acc);
        }
        hsum_ps(acc)
    }

    /// One Q4_K row against four activation rows: nibbles and scales decoded once per block.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q4k_x4(w: &[BlockQ4K], a: [&[BlockQ8K]; 4]) -> [f32; 4] {
        let m4 = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut mins = [0f32; 4];
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let (sc, mn) = scales_mins(&b.scales);
            let mut x = [_mm256_setzero_si256(); 8];
            let mut s = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let raw = _mm256_loadu_si256(b.qs.as_ptr().add(32 * c) as *const __m256i);
                x[2 * c] = _mm256_and_si256(raw, m4);
                x[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                s[2 * c] = _mm256_set1_epi16(sc[2 * c] as i16);
                s[2 * c + 1] = _mm256_set1_epi16(sc[2 * c + 1] as i16);
            }
            let (d, dmin) = (fp16(b.d), fp16(b.dmin));
            for r in 0..4 {
                let q = a[r].get_unchecked(i);
                let mut isum = _mm256_setzero_si256();
                for c in 0..4 {
                    let ylo = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c) as *const __m256i);
                    let yhi = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c + 32) as *const __m256i);
                    let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(x[2 * c], ylo), s[2 * c]);
                    let phi =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(x[2 * c + 1], yhi), s[2 * c + 1]);
                    isum = _mm256_add_epi32(isum, _mm256_add_epi32(plo, phi));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(q.d * d), _mm256_cvtepi32_ps(isum), acc[r]);
                mins[r] += q.d * dmin * mins_dot(&mn, &q.bsums) as f32;
            }
        }
        [
            hsum_ps(acc[0]) - mins[0],
            hsum_ps(acc[1]) - mins[1],
            hsum_ps(acc[2]) - mins[2],
            hsum_ps(acc[3]) - mins[3],
        ]
    }
}
