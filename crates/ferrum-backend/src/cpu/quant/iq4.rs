//! The 4-bit non-linear i-quants. Each 4-bit code indexes [`VALUES`], sixteen int8 levels
//! spaced more closely near zero (where most weights are) than a linear grid.
//! - IQ4_NL: 32 values a block, one f16 scale: GGML's Q4_0 layout with the levels looked up
//!   instead of `q − 8`.
//! - IQ4_XS: 256 values a super-block, an f16 scale and eight 6-bit sub-block scales
//!   (`ls − 32`, signed), the low four bits in `scales_l`'s nibbles and the high two in
//!   `scales_h`; each 32-value sub-block's 16 bytes are laid out as one IQ4_NL block's.
//!
//! A block's dot product with 8-bit activations is an exact integer sum of level × quant
//! (|level| ≤ 127) times one scale (IQ4_NL against Q8), or the sub-block sums times their
//! integer scales, summed exactly, times one scale (IQ4_XS against Q8_K).

use half::f16;

use super::k_quants::QK_K;
use super::q8::{BlockQ8, BlockQ8K};

pub const QK4_NL: usize = 32;

/// The sixteen levels, by code.
pub const VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq4Nl {
    pub d: f16,
    /// Low nibbles: values 0..16; high nibbles: values 16..32.
    pub qs: [u8; QK4_NL / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Nl>() == 18);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq4Xs {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Xs>() == 136);

impl BlockIq4Xs {
    /// Sub-block `ib`'s signed scale, `ls − 32` (−32..=31).
    #[inline]
    pub fn scale(&self, ib: usize) -> i32 {
        let lo = (self.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
        let hi = (self.scales_h >> (2 * ib)) & 3;
        (lo as i32 | (hi as i32) << 4) - 32
    }
}

/// The level of code `q` (a nibble).
#[inline]
fn level(q: u8) -> i32 {
    VALUES[(q & 0x0f) as usize] as i32
}

pub fn dequantize_nl(blocks: &[BlockIq4Nl], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK4_NL)) {
        let d = b.d.to_f32();
        for j in 0..QK4_NL / 2 {
            y[j] = d * VALUES[(b.qs[j] & 0x0f) as usize] as f32;
            y[j + QK4_NL / 2] = d * VALUES[(b.qs[j] >> 4) as usize] as f32;
        }
    }
}

pub fn dequantize_xs(blocks: &[BlockIq4Xs], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let dl = d * b.scale(ib) as f32;
            let qs = &b.qs[16 * ib..16 * ib + 16];
            for j in 0..16 {
                y[j] = dl * VALUES[(qs[j] & 0x0f) as usize] as f32;
                y[j + 16] = dl * VALUES[(qs[j] >> 4) as usize] as f32;
            }
        }
    }
}

/// `Σ level·a` over one 32-value block's 16 packed bytes.
#[inline]
fn block_sum(qs: &[u8], a: &[i8]) -> i32 {
    let mut s = 0;
    for j in 0..16 {
        s += level(qs[j]) * a[j] as i32;
        s += level(qs[j] >> 4) * a[j + 16] as i32;
    }
    s
}

/// `Σ w·a` over matching IQ4_NL and Q8 blocks.
pub fn vec_dot_nl(w: &[BlockIq4Nl], a: &[BlockQ8]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let isum = block_sum(&b.qs, &q.qs);
        sum += isum as f32 * (b.d.to_f32() * q.d);
    }
    sum
}

/// `Σ w·a` over matching IQ4_XS and Q8_K super-blocks: per super-block the exact integer
/// `Σ_ib scale_ib · Σ level·a`, then one multiply by both scales.
pub fn vec_dot_xs(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let mut isum = 0i32;
        for ib in 0..QK_K / 32 {
            let s = block_sum(&b.qs[16 * ib..16 * ib + 16], &q.qs[32 * ib..32 * ib + 32]);
            isum += b.scale(ib) * s;
        }
        sum += isum as f32 * (b.d.to_f32() * q.d);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::iq_grid::avx2::hsum_i32;
    use crate::cpu::quant::q8::{hsum_ps, nibbles, prefetch};
    use std::arch::x86_64::*;

    /// 32 codes (16 packed bytes) as their levels: a byte shuffle per 128-bit lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels(qs: *const u8) -> __m256i {
        let table = _mm_loadu_si128(VALUES.as_ptr() as *const __m128i);
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles(qs))
    }

    /// `Σ x·y` of 32 signed bytes (|x| ≤ 127) as eight i32 lanes: `maddubs` takes |x| with x's
    /// sign moved onto y; a pair sum is at most 2 · 127 · 128, inside i16.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_i8(x: __m256i, y: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_nl(w: &[BlockIq4Nl], a: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let y = _mm256_loadu_si256(q.qs.as_ptr() as *const __m256i);
            let s = _mm256_cvtepi32_ps(dot_i8(levels(b.qs.as_ptr()), y));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(b.d.to_f32() * q.d), s, acc);
        }
        hsum_ps(acc)
    }

    /// The scalar kernel's integer sums and float steps, so its bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_xs(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
        let mut sum = 0f32;
        for (b, q) in w.iter().zip(a) {
            prefetch(b);
            let mut isum = _mm256_setzero_si256();
            for ib in 0..QK_K / 32 {
                let x = levels(b.qs.as_ptr().add(16 * ib));
                let y = _mm256_loadu_si256(q.qs.as_ptr().add(32 * ib) as *const __m256i);
                let s = _mm256_mullo_epi32(dot_i8(x, y), _mm256_set1_epi32(b.scale(ib)));
                isum = _mm256_add_epi32(isum, s);
            }
            sum += hsum_i32(isum) as f32 * (b.d.to_f32() * q.d);
        }
        sum
    }
}
