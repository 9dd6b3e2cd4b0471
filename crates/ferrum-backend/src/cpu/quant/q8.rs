//! 8-bit activation formats. Before a quantised matmul, each activation row is quantised
//! once, so the dot products run on integers (AVX2 `maddubs`/`madd`):
//! - [`BlockQ8`]: 32 values, f32 scale, the scaled sum `s = d·Σq` (the sum lets Q4_1 and
//!   Q5_1 fold in their minimums without touching the values) and `−128·Σq` (the AVX-VNNI
//!   Q8_0 kernel's correction for weights stored plus 128). Paired with Q4_0/Q4_1/
//!   Q5_0/Q5_1/Q8_0 weights. Our own layout (GGML's Q8_1 keeps d and s in f16); f32 loses less.
//! - [`BlockQ8K`]: GGML's Q8_K, 256 values with sums of each 16 (for the K-quants).

use super::k_quants::QK_K;

pub const QK8: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    /// `−128 · Σ qs`, exact: where a chain of `vpdpbusd` over weights stored plus 128 starts
    /// (`s` is `d · Σ qs`). Stored ready, so a kernel broadcasts it straight from memory instead
    /// of spending four scalar and vector instructions per block and token on it.
    pub offset: i32,
    pub qs: [i8; QK8],
}
const _: () = assert!(std::mem::size_of::<BlockQ8>() == 44);

impl Default for BlockQ8 {
    fn default() -> Self {
        BlockQ8 {
            d: 0.0,
            s: 0.0,
            offset: 0,
            qs: [0; QK8],
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    /// Sum of each group of 16 quants. Kernels rely on it being exactly that (Q2_K's
    /// minimums, Q3_K's and Q6_K's offsets come out through it); both quantisers set it.
    pub bsums: [i16; QK_K / 16],
    /// Sum of each group of 32 quants (`bsums[2j] + bsums[2j + 1]`, exact: at most 32 · 127).
    /// Q4_K's and Q5_K's minimums take two of them at a time as one 32-bit word, read
    /// straight from here rather than added and packed with scalar instructions for every
    /// block, token and row group (15% of the four-token AVX2 pass).
    pub sums32: [i16; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 308);

impl BlockQ8K {
    /// 32-value sums `2p` and `2p + 1` as one word (`2p` in the low half): the i16 pair a
    /// kernel broadcasts into every lane for Q4_K's and Q5_K's minimums.
    #[inline(always)]
    pub(crate) fn sums32_pair(&self, p: usize) -> i32 {
        let (lo, hi) = (
            self.sums32[2 * p] as u16 as u32,
            self.sums32[2 * p + 1] as u16 as u32,
        );
        (lo | hi << 16) as i32
    }

    /// `bsums` and `sums32` from the quants, as both quantisers set them.
    fn set_sums(&mut self) {
        for (g, s) in self.bsums.iter_mut().enumerate() {
            *s = self.qs[g * 16..g * 16 + 16].iter().map(|&q| q as i16).sum();
        }
        self.sums32 = std::array::from_fn(|j| self.bsums[2 * j] + self.bsums[2 * j + 1]);
    }
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
            sums32: [0; QK_K / 32],
        }
    }
}

/// Round-to-nearest (ties to even, as the SIMD rounding does) with scale `max|x| / 127`.
pub fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::has_avx2() {
            // SAFETY: AVX2, FMA and F16C detected.
            return unsafe { avx2::quantize_q8(x, out) };
        }
    }
    quantize_q8_scalar(x, out)
}

pub fn quantize_q8_scalar(x: &[f32], out: &mut [BlockQ8]) {
    for (blk, o) in x.chunks_exact(QK8).zip(out.iter_mut()) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        o.d = d;
        o.s = d * sum as f32;
        o.offset = -128 * sum;
    }
}

pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::has_avx2() {
            // SAFETY: AVX2, FMA and F16C detected.
            return unsafe { avx2::quantize_q8k(x, out) };
        }
    }
    quantize_q8k_scalar(x, out)
}

pub fn quantize_q8k_scalar(x: &[f32], out: &mut [BlockQ8K]) {
    for (blk, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            *o = BlockQ8K::default();
            continue;
        }
        let d = amax / 127.0;
        let id = 1.0 / d;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            *q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        o.set_sums();
        o.d = d;
    }
}

/// What [`quantize_q8`] drops from each value of `x`: `x − d · q`, block by block, into `out`.
/// Quantised in turn, it is the second row of a two-level activation (`x ≈ d₁q₁ + d₂q₂`,
/// `d₂ ≤ d₁ / 254`), which the integer kernels multiply as a second token: about 16
/// significant bits of the activation for a precise weight (`Backend::load_weight_precise`).
pub fn residual_q8(x: &[f32], out: &mut [f32]) {
    let mut blocks = vec![BlockQ8::default(); x.len() / QK8];
    quantize_q8(x, &mut blocks);
    subtract_blocks(x, out, QK8, blocks.iter().map(|b| (b.d, &b.qs[..])));
}

/// [`residual_q8`] for the 256-value activation format ([`quantize_q8k`]).
pub fn residual_q8k(x: &[f32], out: &mut [f32]) {
    let mut blocks = vec![BlockQ8K::default(); x.len() / QK_K];
    quantize_q8k(x, &mut blocks);
    subtract_blocks(x, out, QK_K, blocks.iter().map(|b| (b.d, &b.qs[..])));
}

/// `out = x − d · q`, block by block (blocks of `len` values, given as scale and quants).
fn subtract_blocks<'a>(
    x: &[f32],
    out: &mut [f32],
    len: usize,
    blocks: impl Iterator<Item = (f32, &'a [i8])>,
) {
    for (((d, qs), xs), o) in blocks
        .zip(x.chunks_exact(len))
        .zip(out.chunks_exact_mut(len))
    {
        for ((o, &v), &q) in o.iter_mut().zip(xs).zip(qs) {
            *o = v - d * q as f32;
        }
    }
}

/// f16 → f32 with the F16C instruction, inlined into the kernels (the `half` crate's
/// conversion is an out-of-line call per block, which dominated the kernels' time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn fp16(h: half::f16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
}

/// How far ahead of the current weight block the kernels prefetch (into L2, see
/// `prefetch`). The weight stream is far larger than the caches, and the hardware
/// prefetchers (which stop at 4 KiB page boundaries) keep too little of it in flight.
/// Measured on SmolLM2 decode (2 threads, file-layout kernels, L1 hint): no prefetch
/// ≈ 58 tok/s (Q4_1), 1 KiB ≈ 110, 2 KiB ≈ 133, 4 KiB ≈ 140. With the packed kernels, the
/// L1 hint 4 KiB ahead held too many lines in flight: the synthetic Qwen3-MoE decode block
/// took 8.5 ms (Q8_0) and 5.3 ms (Q4_K_M) per token, 6.9 and 4.6 ms with the L2 hint
/// (8 and 16 KiB ahead: no better), SmolLM2 decode unchanged or faster.
pub const PREFETCH_BYTES: usize = 4096;

/// Prefetches into L2 the block `PREFETCH_BYTES` past `b`, every cache line of it (K-quant blocks
/// span up to four lines; prefetching only the first left Q6_K stalled on the rest). Past the
/// end of the tensor is harmless: a prefetch never faults.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch<B>(b: &B) {
    prefetch_part(b, 0, 1)
}

/// Share `part` of `parts` of [`prefetch`]'s lines, for blocks of twenty-odd lines (the
/// packed K-quants): asked for a few at a time as the block is worked through rather than in
/// one burst, which can fill the core's miss buffers ahead of the demand loads.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_part<B>(b: &B, part: usize, parts: usize) {
    prefetch_part_at(b, part, parts, PREFETCH_BYTES)
}

/// [`prefetch_part`] at `ahead` bytes past the block instead of [`PREFETCH_BYTES`]: the
/// 512-bit kernels read two packed groups side by side, so the bytes 4 KiB past one group's
/// block are the other group's, already on their way; theirs is the next pair's block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_part_at<B>(b: &B, part: usize, parts: usize, ahead: usize) {
    // Every part the same number of lines, so the count is a constant the loop unrolls to
    // even where `part` is known only at run time: a count that varied between parts cost a
    // loop with a mispredicted exit per call, which made Q6_K's one-token pass (rolled over
    // its two halves) 1.7x slower from the last-level cache on AMD Zen 3. The last part may
    // reach a few lines into the next block, which is wanted soon after anyway.
    let per = std::mem::size_of::<B>().div_ceil(64).div_ceil(parts);
    prefetch_lines(
        (b as *const B as *const u8).wrapping_add(ahead),
        part * per..(part + 1) * per,
    );
}

/// Prefetches into L2 cache lines `lines` of the bytes `PREFETCH_BYTES` past `at` (any
/// address: a prefetch never faults). What [`prefetch_part`] does for a block; the f32
/// matmul path does it for a weight row of any length.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_lines_ahead(at: *const u8, lines: std::ops::Range<usize>) {
    prefetch_lines(at.wrapping_add(PREFETCH_BYTES), lines)
}

/// Prefetches into L2 cache lines `lines` from `at` (any address).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines(at: *const u8, lines: std::ops::Range<usize>) {
    use std::arch::x86_64::*;
    for l in lines {
        // SAFETY: prefetching has no architectural effect and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(64 * l) as *const i8) };
    }
}

/// Sums eight f32 lanes in the fixed order the AVX2 kernels share.
#[cfg(target_arch = "x86_64")]
pub(crate) use crate::cpu::simd::hsum_ps;

/// `Σ x·y` of 32 signed bytes as eight f32 lanes: `maddubs` wants an unsigned left operand,
/// so the signs move onto `y` first.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn mul_sum_i8(
    x: std::arch::x86_64::__m256i,
    y: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    mul_sum_u8_i8(ax, sy)
}

/// `Σ x·y` of 32 unsigned × signed bytes as eight f32 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn mul_sum_u8_i8(
    x: std::arch::x86_64::__m256i,
    y: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let pairs = _mm256_maddubs_epi16(x, y);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// 32 bytes, byte `i` all ones where bit `i` of `bits` is set.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bytes_from_bits(bits: u32) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // Byte i takes source byte i / 8 (the 4 bytes are replicated in both 128-bit lanes).
    let shuf = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(bytes, sel), sel)
}

/// 16 packed bytes → 32 nibbles: low nibbles first, then high nibbles.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn nibbles(p: *const u8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let raw = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, m);
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    _mm256_set_m128i(hi, lo)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Largest |x| of `n` (a multiple of 32) floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn amax(p: *const f32, n: usize) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for i in (0..n).step_by(8) {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(i))));
        }
        let q = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let q = _mm_max_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)))
    }

    /// Rounds 32 floats × `id` to nearest-even and packs them to bytes in order.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn round_pack(p: *const f32, id: f32, out: *mut i8) -> __m256i {
        let idv = _mm256_set1_ps(id);
        let r = |i: usize| {
            _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), idv),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        };
        let (a, b, c, d) = (r(0), r(8), r(16), r(24));
        // packs interleave the 128-bit lanes; the permute restores element order.
        let ab = _mm256_packs_epi32(a, b);
        let cd = _mm256_packs_epi32(c, d);
        let bytes = _mm256_packs_epi16(ab, cd);
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out as *mut __m256i, ordered);
        ordered
    }

    /// Sum of 32 signed bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sum_i8(v: __m256i) -> i32 {
        let w = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_set1_epi8(1), v),
            _mm256_set1_epi16(1),
        );
        let q = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        let q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0b01_00_11_10));
        let q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0b10_11_00_01));
        _mm_cvtsi128_si32(q)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
        for (blk, o) in x.chunks_exact(QK8).zip(out.iter_mut()) {
            let d = amax(blk.as_ptr(), QK8) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let v = round_pack(blk.as_ptr(), id, o.qs.as_mut_ptr());
            let sum = sum_i8(v);
            o.d = d;
            o.s = d * sum as f32;
            o.offset = -128 * sum;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
        for (blk, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
            let amax = amax(blk.as_ptr(), QK_K);
            if amax == 0.0 {
                *o = BlockQ8K::default();
                continue;
            }
            let d = amax / 127.0;
            let id = 1.0 / d;
            for c in 0..QK_K / 32 {
                round_pack(blk.as_ptr().add(32 * c), id, o.qs.as_mut_ptr().add(32 * c));
            }
            o.set_sums();
            o.d = d;
        }
    }
}
