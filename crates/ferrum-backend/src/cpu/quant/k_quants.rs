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
pub(crate) fn q3k_scales(packed: &[u8; 12]) -> [i8; 16] {
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

    /// Scales `s[8h + 2j]` (low 128 bits) and `s[8h + 2j + 1]` (high) in every i16 lane, from
    /// `half`, the sixteen i16 scales' half `h` in both 128-bit lanes: `madd` then scales the
    /// two sixteen-weight sub-blocks of the 32-byte vector `j` of half `h` by their own scale.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_pair(half: __m256i, j: usize) -> __m256i {
        let (a, b) = (4 * j as i8, 4 * j as i8 + 2);
        let lo = _mm_setr_epi8(
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
            a,
            a + 1,
        );
        let hi = _mm_setr_epi8(
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
            b,
            b + 1,
        );
        _mm256_shuffle_epi8(half, _mm256_set_m128i(hi, lo))
    }

    /// Half `h` (sub-blocks 8h..8h+8) of sixteen i16 scales, in both 128-bit lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales_half(s: __m256i, h: usize) -> __m256i {
        if h == 0 {
            _mm256_permute2x128_si256(s, s, 0x00)
        } else {
            _mm256_permute2x128_si256(s, s, 0x11)
        }
    }

    /// The shared part of Q2_K and Q3_K: each of a block's eight 32-byte vectors (half `h`,
    /// shift `j`: two low bits a byte, ORed with `high(h, j)`, Q3_K's third bit) against each
    /// token's activations, the two sixteen-weight sub-blocks scaled by their own scale from
    /// `sc` (sixteen i16); added into `isum`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn two_bit_sums<const N: usize>(
        qs: &[u8; 64],
        sc: __m256i,
        q: [&BlockQ8K; N],
        isum: &mut [__m256i; N],
        high: impl Fn(usize, usize) -> __m256i,
    ) {
        let m3 = _mm256_set1_epi8(3);
        for h in 0..2 {
            let raw = _mm256_loadu_si256(qs.as_ptr().add(32 * h) as *const __m256i);
            let sch = scales_half(sc, h);
            for j in 0..4 {
                let low =
                    _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * j as i32)), m3);
                let u = _mm256_or_si256(low, high(h, j));
                let scj = scale_pair(sch, j);
                for t in 0..N {
                    let y = _mm256_loadu_si256(
                        q[t].qs.as_ptr().add(128 * h + 32 * j) as *const __m256i
                    );
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), scj);
                    isum[t] = _mm256_add_epi32(isum[t], p);
                }
            }
        }
    }

    /// Q2_K for `N` tokens, each block's 2-bit vectors unpacked once for all of them: each
    /// vector (one shift of 32 stored bytes) is two sub-blocks of sixteen, multiplied in
    /// `maddubs` and scaled in `madd`. The sums are exact integers and the per-block float
    /// arithmetic is `vec_dot_q2k`'s, so every token gets its bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn q2k_n<const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // As the scalar kernel's `zip`: no block past the shortest row.
        let w = &w[..a.iter().fold(w.len(), |n, a| n.min(a.len()))];
        let m4 = _mm_set1_epi8(0x0f);
        let mut sum = [0f32; N];
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let q = a.map(|r| r.get_unchecked(i));
            let packed = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
            let sc = _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4));
            // Minimums (high nibbles) against each token's sixteen-value sums.
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4));
            let summs = q.map(|q| {
                let bsums = _mm256_loadu_si256(q.bsums.as_ptr() as *const __m256i);
                hsum_epi32(_mm256_madd_epi16(mins, bsums))
            });
            let mut isum = [_mm256_setzero_si256(); N];
            two_bit_sums(&b.qs, sc, q, &mut isum, |_, _| _mm256_setzero_si256());
            let (d, dmin) = (fp16(b.d), fp16(b.dmin));
            for t in 0..N {
                let isum = hsum_epi32(isum[t]);
                sum[t] += q[t].d * d * isum as f32 - q[t].d * dmin * summs[t] as f32;
            }
        }
        sum
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q2k(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
        q2k_n(w, [a])[0]
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q2k_x4(w: &[BlockQ2K], a: [&[BlockQ8K]; 4]) -> [f32; 4] {
        q2k_n(w, a)
    }

    /// `q3k_scales` as sixteen i16: the same bit moves on four 32-bit words at once (it was a
    /// sixth of the Q3_K kernel's time as a scalar call per block).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn q3k_scales_i16(packed: &[u8; 12]) -> __m256i {
        let a01 = _mm_loadl_epi64(packed.as_ptr() as *const __m128i);
        let tmp = (packed.as_ptr().add(8) as *const i32).read_unaligned();
        // [a0, a1, a0 >> 4, a1 >> 4] & 0x0f0f0f0f: the low four bits of each scale.
        let low = _mm_and_si128(
            _mm_unpacklo_epi64(a01, _mm_srli_epi16(a01, 4)),
            _mm_set1_epi8(0x0f),
        );
        // [tmp, tmp >> 2, tmp >> 4, tmp >> 6] & 0x03030303, to bits 4 and 5.
        let high = _mm_slli_epi32(
            _mm_and_si128(
                _mm_srlv_epi32(_mm_set1_epi32(tmp), _mm_setr_epi32(0, 2, 4, 6)),
                _mm_set1_epi8(3),
            ),
            4,
        );
        let biased = _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
        _mm256_cvtepi8_epi16(biased)
    }

    /// Q3_K for `N` tokens. A weight is `low + 4·hbit − 4` (two low bits, hmask bit): the
    /// unsigned `low + 4·hbit` (0..7) goes through `maddubs` and `madd` with the sub-block's
    /// signed scale, and the −4 comes out once per block as `4 · Σ scale · (sixteen-value
    /// activation sum)`. Exact integer sums and `vec_dot_q3k`'s per-block float arithmetic:
    /// every token gets its bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn q3k_n<const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // As the scalar kernel's `zip`: no block past the shortest row.
        let w = &w[..a.iter().fold(w.len(), |n, a| n.min(a.len()))];
        let four = _mm256_set1_epi8(4);
        let mut sum = [0f32; N];
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let q = a.map(|r| r.get_unchecked(i));
            let sc = q3k_scales_i16(&b.scales);
            let hmask = _mm256_loadu_si256(b.hmask.as_ptr() as *const __m256i);
            let mut isum: [__m256i; N] = std::array::from_fn(|t| {
                let bsums = _mm256_loadu_si256(q[t].bsums.as_ptr() as *const __m256i);
                _mm256_sub_epi32(
                    _mm256_setzero_si256(),
                    _mm256_slli_epi32(_mm256_madd_epi16(sc, bsums), 2),
                )
            });
            two_bit_sums(&b.qs, sc, q, &mut isum, |h, j| {
                // Bit 4h + j of each hmask byte to bit 2 (16-bit shifts: what crosses from the
                // neighbouring byte lands outside bit 2).
                let sh = 4 * h + j;
                let hb = if sh >= 2 {
                    _mm256_srl_epi16(hmask, _mm_cvtsi32_si128(sh as i32 - 2))
                } else {
                    _mm256_sll_epi16(hmask, _mm_cvtsi32_si128(2 - sh as i32))
                };
                _mm256_and_si256(hb, four)
            });
            let d = fp16(b.d);
            for t in 0..N {
                let isum = hsum_epi32(isum[t]);
                sum[t] += q[t].d * d * isum as f32;
            }
        }
        sum
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q3k(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
        q3k_n(w, [a])[0]
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q3k_x4(w: &[BlockQ3K], a: [&[BlockQ8K]; 4]) -> [f32; 4] {
        q3k_n(w, a)
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q4k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        k4_n(w, [a], |b| (&b.scales, (b.d, b.dmin), &b.qs, None))[0]
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q5k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
        k4_n(w, [a], |b| (&b.scales, (b.d, b.dmin), &b.qs, Some(&b.qh)))[0]
    }

    /// The per-token half of the Q4_K and Q5_K kernels: one block's unpacked quants `x` and
    /// sub-block scales `s` against each token's block `q`, added into `acc` and `mins`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn k4_block<const N: usize>(
        x: &[__m256i; 8],
        s: &[__m256i; 8],
        (d, dmin): (f32, f32),
        mn: &[u8; 8],
        q: [&BlockQ8K; N],
        acc: &mut [__m256; N],
        mins: &mut [f32; N],
    ) {
        for (r, q) in q.iter().enumerate() {
            let mut isum = _mm256_setzero_si256();
            for c in 0..4 {
                let ylo = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c) as *const __m256i);
                let yhi = _mm256_loadu_si256(q.qs.as_ptr().add(64 * c + 32) as *const __m256i);
                let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(x[2 * c], ylo), s[2 * c]);
                let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(x[2 * c + 1], yhi), s[2 * c + 1]);
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(plo, phi));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(q.d * d), _mm256_cvtepi32_ps(isum), acc[r]);
            mins[r] += q.d * dmin * mins_dot(mn, &q.bsums) as f32;
        }
    }

    /// `vec_dot_q5k` for four tokens, each block's 5-bit values assembled once for all of
    /// them; per token the same integer sums and the same float steps, so the same bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_q5k_x4(w: &[BlockQ5K], a: [&[BlockQ8K]; 4]) -> [f32; 4] {
        k4_n(w, a, |b| (&b.scales, (b.d, b.dmin), &b.qs, Some(&b.qh)))
    }

    /// A Q4_K-style block's parts: packed scales and minimums, (d, dmin), the low nibbles and,
    /// for Q5_K, the fifth bits.
    type K4Parts<'a> = (
        &'a [u8; 12],
        (f16, f16),
        &'a [u8; 128],
        Option<&'a [u8; 32]>,
    );

    /// Q4_K and Q5_K for `N` tokens (one kernel for one and for four tokens, so both give a
    /// token the same bits): a block's quants unpacked (fifth bits included) and its sub-block
    /// scales broadcast once, then [`k4_block`] per token.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn k4_n<B, const N: usize>(
        w: &[B],
        a: [&[BlockQ8K]; N],
        parts: impl Fn(&B) -> K4Parts<'_>,
    ) -> [f32; N] {
        // As the scalar kernels' `zip`: no block past the shortest row.
        let w = &w[..a.iter().fold(w.len(), |n, a| n.min(a.len()))];
        let m4 = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut mins = [0f32; N];
        for (i, b) in w.iter().enumerate() {
            prefetch(b);
            let (scales, (d, dmin), qs, qh) = parts(b);
            let (sc, mn) = scales_mins(scales);
            let qh = qh.map(|h| _mm256_loadu_si256(h.as_ptr() as *const __m256i));
            let mut x = [_mm256_setzero_si256(); 8];
            let mut s = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let raw = _mm256_loadu_si256(qs.as_ptr().add(32 * c) as *const __m256i);
                x[2 * c] = _mm256_and_si256(raw, m4);
                x[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                if let Some(qh) = qh {
                    // Fifth bits: bit 2c of each qh byte for the low nibbles, 2c+1 for the high.
                    let bit = |k: i32| {
                        let h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(k)), one);
                        _mm256_slli_epi16(h, 4)
                    };
                    x[2 * c] = _mm256_or_si256(x[2 * c], bit(2 * c as i32));
                    x[2 * c + 1] = _mm256_or_si256(x[2 * c + 1], bit(2 * c as i32 + 1));
                }
                s[2 * c] = _mm256_set1_epi16(sc[2 * c] as i16);
                s[2 * c + 1] = _mm256_set1_epi16(sc[2 * c + 1] as i16);
            }
            let dd = (fp16(d), fp16(dmin));
            let q = a.map(|r| r.get_unchecked(i));
            k4_block(&x, &s, dd, &mn, q, &mut acc, &mut mins);
        }
        std::array::from_fn(|r| hsum_ps(acc[r]) - mins[r])
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
        k4_n(w, a, |b| (&b.scales, (b.d, b.dmin), &b.qs, None))
    }
}
