//! Vector kernels with a scalar twin each. The AVX2+FMA versions are picked once at start-up
//! by runtime feature detection, so one binary runs (correctly) on any x86-64 or other CPU.
//! The scalar twins use the same eight-lane, four-accumulator summation order as the SIMD
//! code, so the two agree to the last bits and tests can hold them nearly equal.

use std::sync::OnceLock;

pub type DotFn = fn(&[f32], &[f32]) -> f32;

/// Whether this CPU runs the AVX2+FMA kernels of this module.
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Whether the f32 kernels take 512-bit registers: AVX-512F passes the OS-state check and
/// `FERRUM_WIDE=0` is not set. Their lanes are the AVX2 kernels' four accumulators side by
/// side, two to a register, and the reduction is the same, so the bits are too; they halve
/// the instructions of a prefill over f32, f16 and bf16 weights. Fixed at the first call.
#[cfg(target_arch = "x86_64")]
pub fn zmm_f32() -> bool {
    static ZMM: OnceLock<bool> = OnceLock::new();
    *ZMM.get_or_init(|| {
        avx2_fma()
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("avx512f")
            && std::env::var("FERRUM_WIDE").map_or(true, |v| v != "0")
    })
}

fn pick_dot() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    {
        if zmm_f32() {
            return |a, b| {
                // SAFETY: `zmm_f32` checked AVX2, FMA and AVX-512F.
                unsafe { avx512::dot_f32(a, b) }
            };
        }
        if avx2_fma() {
            return |a, b| {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                unsafe { avx2::dot_f32(a, b) }
            };
        }
    }
    dot_f32_scalar
}

/// The dot kernel this CPU uses, resolved once (hot loops call it without the lookup).
pub fn dot_fn() -> DotFn {
    static DOT: OnceLock<DotFn> = OnceLock::new();
    *DOT.get_or_init(pick_dot)
}

/// `Σ a[i]·b[i]` over the shorter of the two slices' common length (callers pass equal
/// lengths).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_fn()(a, b)
}

/// Attention's kernels, over keys and values already converted to f32 (so each cache row is
/// converted once per block of query rows, not once per query row).
///
/// `dot8(q, k, out)`: `out[r] = q · k[r·n..(r+1)·n]` for eight key rows, `n = q.len()`: each
/// row summed in eight lanes (lane `l` takes elements `l, l+8, …` by fused multiply-add, the
/// tail past the last multiple of eight after the lanes), lanes added as
/// `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`. Which keys share a call never changes a result.
///
/// `mix(p, v, acc)`: `acc[d] += Σ_j p[j]·v[j·n + d]`, one fused multiply-add per (j, d) in
/// order of j, `n = acc.len()`.
///
/// `softmax(s, scale)`: `s[j] = exp(scale·s[j] − max) / Σ`, with [`exp_f32`]'s polynomial;
/// the sum taken in eight lanes (element `j` in lane `j % 8`, the tail past the last multiple
/// of eight in lanes `0..`) reduced as `hsum8`.
///
/// `dot4_f16(q, g, cache, offs, out)` and `mix_f16(p, g, cache, offs, acc)`: the same two
/// for `g` (1 to [`F16_HEADS`]) query heads at once, reading each key or value row straight
/// from an f16 cache (row `j` is `cache[offs[j]..][..n]`) instead of from a converted copy,
/// each row converted once for all the heads. f16 → f32 is exact, so they give the very bits
/// `dot8` and `mix` give on the converted rows; decode (one query row per sequence) reads the
/// cache once this way rather than converting it first. `dot4_f16`: `q` holds the heads' rows
/// one after another, `out[h][r]` is head `h` · key `r` for one to four offsets (the scores
/// of missing keys are unspecified). `mix_f16`: `p` holds `g` weight rows of equal length,
/// `acc` the `g` output rows.
#[derive(Clone, Copy)]
pub struct AttnKernels {
    pub dot8: fn(&[f32], &[f32], &mut [f32; 8]),
    pub mix: fn(&[f32], &[f32], &mut [f32]),
    pub softmax: fn(&mut [f32], f32),
    pub dot4_f16: Dot4Rows<half::f16>,
    pub mix_f16: MixRows<half::f16>,
}

/// A `dot4_f16`-shaped kernel over cache elements `T` (see [`AttnKernels`]).
pub type Dot4Rows<T> = fn(&[f32], usize, &[T], &[usize], &mut [[f32; 4]; F16_HEADS]);
/// A `mix_f16`-shaped kernel over cache elements `T` (see [`AttnKernels`]).
pub type MixRows<T> = fn(&[f32], usize, &[T], &[usize], &mut [f32]);

/// Asks for the cache lines of rows `cache[o..o + n]` (for `o` in `offs`) ahead of use.
/// Never faults.
pub fn prefetch_rows<T>(cache: &[T], offs: &[usize], n: usize) {
    #[cfg(target_arch = "x86_64")]
    for &o in offs {
        let p = cache.as_ptr().wrapping_add(o) as *const i8;
        for b in (0..n * std::mem::size_of::<T>()).step_by(64) {
            // SAFETY: prefetching has no architectural effect and never faults.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    p.wrapping_add(b),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (cache, offs, n);
}

/// How many value rows ahead `mix_f16` prefetches.
pub const PREFETCH_ROWS: usize = 16;

/// How many keys ahead the decode attention prefetches.
pub const PREFETCH_KEYS: usize = 16;

/// Most query heads the `_f16` attention kernels take at once (their accumulators must fit
/// the sixteen vector registers).
pub const F16_HEADS: usize = 3;

pub fn attn_kernels() -> AttnKernels {
    static K: OnceLock<AttnKernels> = OnceLock::new();
    *K.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // AVX2 and FMA, and F16C for the `_f16` kernels.
            if super::quant::has_avx2() {
                return AttnKernels {
                    // SAFETY: AVX2 and FMA detected just above.
                    dot8: |q, k, o| unsafe { avx2::dot8(q, k, o) },
                    mix: |p, v, a| unsafe { avx2::mix(p, v, a) },
                    softmax: |s, scale| unsafe { avx2::softmax(s, scale) },
                    // SAFETY: AVX2, FMA and F16C detected just above.
                    dot4_f16: |q, g, c, o, out| unsafe {
                        assert!((1..=F16_HEADS).contains(&g), "1 to {F16_HEADS} heads");
                        match g {
                            1 => avx2::dot4_f16::<1>(q, c, o, out),
                            2 => avx2::dot4_f16::<2>(q, c, o, out),
                            _ => avx2::dot4_f16::<3>(q, c, o, out),
                        }
                    },
                    // SAFETY: as above.
                    mix_f16: |p, g, c, o, a| unsafe {
                        assert!((1..=F16_HEADS).contains(&g), "1 to {F16_HEADS} heads");
                        match g {
                            1 => avx2::mix_f16::<1>(p, c, o, a),
                            2 => avx2::mix_f16::<2>(p, c, o, a),
                            _ => avx2::mix_f16::<3>(p, c, o, a),
                        }
                    },
                };
            }
        }
        AttnKernels {
            dot8: dot8_scalar,
            mix: mix_scalar,
            softmax: softmax_scalar,
            dot4_f16: dot4_f16_scalar,
            mix_f16: mix_f16_scalar,
        }
    })
}

/// Rows `offs[j]` of an f16 cache as f32, each `n` long, one after another (the scalar twins
/// of the `_f16` kernels are `dot8` and `mix` on this).
fn gather_f16(cache: &[half::f16], offs: &[usize], n: usize) -> Vec<f32> {
    offs.iter()
        .flat_map(|&o| cache[o..o + n].iter().map(|h| h.to_f32()))
        .collect()
}

pub fn dot4_f16_scalar(
    q: &[f32],
    g: usize,
    cache: &[half::f16],
    offs: &[usize],
    out: &mut [[f32; 4]; F16_HEADS],
) {
    assert!((1..=F16_HEADS).contains(&g) && q.len().is_multiple_of(g));
    assert!(!offs.is_empty() && offs.len() <= 4);
    let n = q.len() / g;
    let padded: Vec<usize> = (0..8).map(|r| offs[r.min(offs.len() - 1)]).collect();
    let keys = gather_f16(cache, &padded, n);
    for (h, o) in out.iter_mut().enumerate().take(g) {
        let mut s = [0f32; 8];
        dot8_scalar(&q[h * n..(h + 1) * n], &keys, &mut s);
        o.copy_from_slice(&s[..4]);
    }
}

pub fn mix_f16_scalar(p: &[f32], g: usize, cache: &[half::f16], offs: &[usize], acc: &mut [f32]) {
    assert!((1..=F16_HEADS).contains(&g) && p.len().is_multiple_of(g));
    let (m, n) = (p.len() / g, acc.len() / g);
    let vals = gather_f16(cache, &offs[..m], n);
    for h in 0..g {
        mix_scalar(&p[h * m..(h + 1) * m], &vals, &mut acc[h * n..(h + 1) * n]);
    }
}

pub fn dot8_scalar(q: &[f32], k: &[f32], out: &mut [f32; 8]) {
    let n = q.len();
    let main = n - n % 8;
    for (r, o) in out.iter_mut().enumerate() {
        let kr = &k[r * n..(r + 1) * n];
        let mut lanes = [0f32; 8];
        for c in (0..main).step_by(8) {
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = q[c + l].mul_add(kr[c + l], *lane);
            }
        }
        let mut sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
            + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for d in main..n {
            sum = q[d].mul_add(kr[d], sum);
        }
        *o = sum;
    }
}

pub fn mix_scalar(p: &[f32], v: &[f32], acc: &mut [f32]) {
    let n = acc.len();
    for (j, &pj) in p.iter().enumerate() {
        for (a, &x) in acc.iter_mut().zip(&v[j * n..(j + 1) * n]) {
            *a = pj.mul_add(x, *a);
        }
    }
}

// exp(x) = 2^k · e^r with k = round(x·log2 e) and |r| ≤ ln2/2: r from a two-part ln 2 (the
// high part exact in few bits, so k·LN2_HI is exact), e^r by a degree-6 Taylor polynomial
// (error below 2 ulp on that range), 2^k by building the float's exponent bits.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_C: [f32; 6] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0];
/// Below this, e^x is under f32's smallest normal; inputs are clamped to it, so e^x of a
/// score 87 below the maximum comes out as 1.6e-38 rather than 0 (no effect on a sum ≥ 1).
const EXP_MIN: f32 = -87.0;
/// Above this e^x overflows f32; inputs are clamped to it (e^88 = 1.65e38).
const EXP_MAX: f32 = 88.0;

/// e^x, in the operation order the SIMD kernels use.
pub fn exp_f32(x: f32) -> f32 {
    // max then min, as the SIMD code does (a NaN input comes out as e^EXP_MIN in both;
    // `clamp` would keep the NaN).
    #[allow(clippy::manual_clamp)]
    let x = x.max(EXP_MIN).min(EXP_MAX);
    let k = (x * LOG2E).round_ties_even();
    let r = k.mul_add(-LN2_LO, k.mul_add(-LN2_HI, x));
    let mut p = EXP_C[0];
    for &c in &EXP_C[1..] {
        p = p.mul_add(r, c);
    }
    let p = p.mul_add(r, 1.0);
    p * f32::from_bits(((k as i32 + 127) << 23) as u32)
}

pub fn softmax_scalar(s: &mut [f32], scale: f32) {
    let mut max = f32::NEG_INFINITY;
    for v in s.iter_mut() {
        *v *= scale;
        max = max.max(*v);
    }
    let mut lanes = [0f32; 8];
    for (j, v) in s.iter_mut().enumerate() {
        *v = exp_f32(*v - max);
        lanes[j % 8] += *v;
    }
    let inv = 1.0 / hsum8(&lanes);
    for v in s.iter_mut() {
        *v *= inv;
    }
}

/// SwiGLU's gate: `out[i] = g[i] / (1 + e^−g[i]) · u[i]` with [`exp_f32`].
pub fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma() {
            // SAFETY: AVX2 and FMA detected just above.
            return unsafe { avx2::silu_mul(g, u, out) };
        }
    }
    silu_mul_scalar(g, u, out)
}

pub fn silu_mul_scalar(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + exp_f32(-g)) * u;
    }
}

/// `2·√(2/π)`, and the cubic coefficient of the tanh approximation of GELU.
const GELU_2C: f32 = 1.595_769_2;
const GELU_K: f32 = 0.044_715;

/// GeGLU's gate, tanh-approximated GELU: `0.5·g·(1 + tanh(c·(g + k·g³)))·u`, computed as
/// `g / (1 + e^−2c(g + k·g³)) · u` (the same function: `1 + tanh(y) = 2 / (1 + e^−2y)`), with
/// [`exp_f32`], so it shares SiLU's kernel shape.
pub fn gelu_tanh_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma() {
            // SAFETY: AVX2 and FMA detected just above.
            return unsafe { avx2::gelu_tanh_mul(g, u, out) };
        }
    }
    gelu_tanh_mul_scalar(g, u, out)
}

/// Tanh-approximated GELU in place, as [`gelu_tanh_mul`] with `u = 1` (so its bits), for a
/// vision tower's MLP: `libm`'s `tanhf` there was a tenth of a tower's time.
pub fn gelu_tanh(x: &mut [f32]) {
    const CHUNK: usize = 64;
    let ones = [1f32; CHUNK];
    let mut g = [0f32; CHUNK];
    for c in x.chunks_mut(CHUNK) {
        let n = c.len();
        g[..n].copy_from_slice(c);
        gelu_tanh_mul(&g[..n], &ones[..n], c);
    }
}

pub fn gelu_tanh_mul_scalar(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        let z = GELU_2C * (g + GELU_K * (g * g * g));
        *o = g / (1.0 + exp_f32(-z)) * u;
    }
}

/// Exact-GELU GeGLU in plain code: only encoders (ModernBERT) use it, whose passes the
/// matmuls dominate.
pub fn gelu_erf_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = 0.5 * g * (1.0 + crate::host_ops::erf(g * std::f32::consts::FRAC_1_SQRT_2)) * u;
    }
}

/// A gated FFN's gate with the given nonlinearity.
pub fn glu(g: &[f32], u: &[f32], out: &mut [f32], act: crate::Activation) {
    match act {
        crate::Activation::Silu => silu_mul(g, u, out),
        crate::Activation::GeluTanh => gelu_tanh_mul(g, u, out),
        crate::Activation::GeluErf => gelu_erf_mul(g, u, out),
        crate::Activation::ClampedSwiglu { alpha, limit } => {
            clamped_swiglu(g, u, out, alpha, limit)
        }
    }
}

/// gpt-oss's gate (see [`crate::Activation::ClampedSwiglu`]), in plain code: only its
/// experts use it.
pub fn clamped_swiglu(g: &[f32], u: &[f32], out: &mut [f32], alpha: f32, limit: f32) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        let g = g.min(limit);
        let u = u.clamp(-limit, limit);
        *o = (u + 1.0) * (g / (1.0 + (-alpha * g).exp()));
    }
}

/// bf16 (as its bits) → f32 for a slice (rows of bf16 weights), as `half::bf16::to_f32`:
/// the bits moved up sixteen, a NaN's quiet bit set.
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma() {
            // SAFETY: AVX2 detected just above.
            return unsafe { avx2::bf16_to_f32(src, dst) };
        }
    }
    bf16_to_f32_scalar(src, dst)
}

pub fn bf16_to_f32_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        let b = if b & 0x7fff > 0x7f80 { b | 0x0040 } else { b };
        *d = f32::from_bits((b as u32) << 16);
    }
}

/// f16 → f32 for a slice (KV rows before attention); exact either way.
pub fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::quant::has_avx2() {
            // SAFETY: AVX2, FMA and F16C detected.
            return unsafe { avx2::f16_to_f32(src, dst) };
        }
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// `[dot_f32(x[0], w), dot_f32(x[1], w), dot_f32(x[2], w)]`, bit for bit, each weight vector
/// loaded once for the three tokens (a prefill's row against its tokens: `dot_f32` per token
/// was bound by its two loads per multiply-add).
///
/// # Panics
/// If a token's row is not as long as `w`.
pub fn dot_f32_x3(w: &[f32], x: [&[f32]; 3]) -> [f32; 3] {
    assert!(
        x.iter().all(|x| x.len() == w.len()),
        "dot_f32_x3: rows of unequal length"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if zmm_f32() {
            // SAFETY: `zmm_f32` checked AVX2, FMA and AVX-512F.
            return unsafe { avx512::dot_f32_x3(w, x) };
        }
        if avx2_fma() {
            // SAFETY: AVX2 and FMA detected.
            return unsafe { avx2::dot_f32_x3(w, x) };
        }
    }
    dot_f32_x3_scalar(w, x)
}

/// [`dot_f32_x3`] for four weight rows: `out[r][t]` is `dot_f32(x[t], w[r])`, bit for bit.
/// On 512-bit registers the twelve (row, token) sums' accumulators all stay in registers, so
/// each weight and activation vector is loaded once for four rows or three tokens.
///
/// # Panics
/// If a row of either is not as long as `w[0]`.
pub fn dot_f32_4x3(w: [&[f32]; 4], x: [&[f32]; 3]) -> [[f32; 3]; 4] {
    let n = w[0].len();
    assert!(
        w.iter().all(|w| w.len() == n) && x.iter().all(|x| x.len() == n),
        "dot_f32_4x3: rows of unequal length"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if zmm_f32() {
            // SAFETY: `zmm_f32` checked AVX2, FMA and AVX-512F; lengths checked above.
            return unsafe { avx512::dot_f32_4x3(w, x) };
        }
    }
    w.map(|w| dot_f32_x3(w, x))
}

/// [`dot_f32_4x3`]'s scalar twin.
pub fn dot_f32_4x3_scalar(w: [&[f32]; 4], x: [&[f32]; 3]) -> [[f32; 3]; 4] {
    w.map(|w| dot_f32_x3_scalar(w, x))
}

/// [`dot_f32_x3`]'s scalar twin.
pub fn dot_f32_x3_scalar(w: &[f32], x: [&[f32]; 3]) -> [f32; 3] {
    x.map(|x| dot_f32_scalar(x, w))
}

/// Sums of `R` weight rows dotted with `T` tokens carried from one stretch of the inputs to
/// the next: each (row, token) pair's 32 lanes, element `i` of a row adding to lane `i % 32`
/// as in [`dot_f32`]. Taking rows a stretch at a time (each a multiple of 32 elements) through
/// [`dot_f32_carry`], then their last `< 32` elements through [`dot_f32_finish`], gives each
/// pair [`dot_f32`]'s bits over the whole row: a matmul can then keep a stretch of its weight
/// rows and of its tokens in L1/L2 however long the rows are.
#[derive(Clone, Copy)]
pub struct F32Carry<const R: usize, const T: usize>([[[f32; 32]; T]; R]);

impl<const R: usize, const T: usize> Default for F32Carry<R, T> {
    fn default() -> Self {
        F32Carry([[[0.0; 32]; T]; R])
    }
}

/// Adds a stretch of `R` weight rows' products with `T` tokens' to `carry`.
///
/// # Panics
/// If the stretch is not a multiple of 32 long, or the rows are not all as long.
pub fn dot_f32_carry<const R: usize, const T: usize>(
    w: [&[f32]; R],
    x: [&[f32]; T],
    carry: &mut F32Carry<R, T>,
) {
    let n = w[0].len();
    assert!(
        n.is_multiple_of(32) && w.iter().all(|w| w.len() == n) && x.iter().all(|x| x.len() == n),
        "dot_f32_carry: a stretch of {n}, or rows of unequal length"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if zmm_f32() {
            // SAFETY: `zmm_f32` checked AVX2, FMA and AVX-512F; lengths checked above.
            return unsafe { avx512::dot_f32_carry(w, x, carry) };
        }
    }
    dot_f32_carry_scalar(w, x, carry)
}

/// [`dot_f32_carry`]'s scalar twin.
pub fn dot_f32_carry_scalar<const R: usize, const T: usize>(
    w: [&[f32]; R],
    x: [&[f32]; T],
    carry: &mut F32Carry<R, T>,
) {
    let n = w[0].len();
    for (w, accs) in w.iter().zip(carry.0.iter_mut()) {
        for (x, acc) in x.iter().zip(accs.iter_mut()) {
            for i in (0..n).step_by(32) {
                for (l, a) in acc.iter_mut().enumerate() {
                    *a = x[i + l].mul_add(w[i + l], *a);
                }
            }
        }
    }
}

/// The sums of `carry`: each pair's lanes reduced as [`dot_f32`] reduces its own, then the
/// products of the rows' last `< 32` elements (`w`, `x`) added in order.
pub fn dot_f32_finish<const R: usize, const T: usize>(
    carry: &F32Carry<R, T>,
    w: [&[f32]; R],
    x: [&[f32]; T],
) -> [[f32; T]; R] {
    std::array::from_fn(|r| {
        std::array::from_fn(|t| {
            let acc = &carry.0[r][t];
            let lanes: [f32; 8] =
                std::array::from_fn(|l| (acc[l] + acc[8 + l]) + (acc[16 + l] + acc[24 + l]));
            let mut sum = hsum8(&lanes);
            for (a, b) in x[t].iter().zip(w[r]) {
                sum = a.mul_add(*b, sum);
            }
            sum
        })
    })
}

/// Whether bf16 weights meet bf16 activations in `vdpbf16ps` (llama.cpp's path for BF16
/// matrices): only when asked for, `FERRUM_BF16=1` on a CPU with AVX512-BF16 and F/BW/VL (the
/// OS-state check included), or `FERRUM_BF16=emulate` on any CPU (its arithmetic then runs in
/// the kernels' scalar twins: tests, and machines without the instruction). Otherwise bf16
/// weights meet f32 activations, as f16 ones do: rounding every matrix's input to bf16 puts
/// the default path's logits about half as far from the exact ones as transformers' own bf16
/// run, but routing and attention amplify it, and on models with near ties that loses the
/// top-1 token or an expert choice transformers keeps (docs/accuracy.md). Measured on a
/// Zen 4, f32 activations prefill bf16 files at 0.68–0.73× the speed and decode them at
/// 1.23–1.36×.
/// Activations round to bf16 once per matmul; the products are exact and the sums f32. Fixed
/// at the first call.
pub fn bf16_dot() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match std::env::var("FERRUM_BF16").as_deref() {
        Ok("1") => bf16_dot_runs(),
        Ok("emulate") => true,
        _ => false,
    })
}

/// Whether the bf16 path runs on its scalar twins (`FERRUM_BF16=emulate`), whatever the CPU
/// has: the same bits as the instruction, slowly.
pub fn bf16_emulated() -> bool {
    static EMU: OnceLock<bool> = OnceLock::new();
    *EMU.get_or_init(|| std::env::var("FERRUM_BF16").as_deref() == Ok("emulate"))
}

/// Whether the `vdpbf16ps` kernels are the ones to run (not emulated, and the CPU has them).
#[cfg(target_arch = "x86_64")]
fn bf16_native() -> bool {
    bf16_dot_runs() && !bf16_emulated()
}

/// Whether this CPU runs the `vdpbf16ps` kernels (whatever `FERRUM_BF16` says). Fixed at the
/// first call (the kernels' entry points check it every call).
pub fn bf16_dot_runs() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static RUNS: OnceLock<bool> = OnceLock::new();
        *RUNS.get_or_init(|| {
            avx2_fma()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// f32 → bf16 as `vcvtneps2bf16` rounds: to nearest, ties to even; a subnormal input becomes
/// a zero of its sign; a NaN stays a (quiet) NaN.
pub fn f32_to_bf16_rne(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    {
        if bf16_dot_runs() {
            // SAFETY: AVX-512 F/BW/VL and BF16 detected.
            return unsafe { bf16k::f32_to_bf16(src, dst) };
        }
    }
    f32_to_bf16_rne_scalar(src, dst)
}

pub fn f32_to_bf16_rne_scalar(src: &[f32], dst: &mut [u16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = bf16_rne(x);
    }
}

fn bf16_rne(x: f32) -> u16 {
    if x.is_nan() {
        return (x.to_bits() >> 16) as u16 | 0x40;
    }
    let x = if x.is_subnormal() {
        0f32.copysign(x)
    } else {
        x
    };
    let b = x.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// `Σ x·w` over bf16 rows as the `vdpbf16ps` kernels sum it: 32 values a chunk, every chunk
/// into one accumulator of 16 lanes, lane `l` of a chunk taking values `2l + 1` then `2l`
/// (each product exact, each addition rounded to nearest with subnormal inputs and results as
/// zero), a short last chunk padded with zeros; then the lanes summed as halves, then
/// `hsum8`'s order. One chain per (row, token): the kernels take their parallelism from
/// several rows and tokens at once, and the sum needs one reduction. The scalar twin of
/// [`dot_bf16_rx1`] and [`dot_bf16_rx3`].
pub fn dot_bf16_scalar(x: &[u16], w: &[u16]) -> f32 {
    let mut acc = [0f32; 16];
    bf16_chain_scalar(x, w, &mut acc);
    sum16(&acc)
}

/// The sixteen lanes of [`dot_bf16_scalar`]'s accumulator, carried on over `x · w` (the scalar
/// twin of one stretch of [`dot_bf16_carry`]).
fn bf16_chain_scalar(x: &[u16], w: &[u16], acc: &mut [f32; 16]) {
    let n = x.len().min(w.len());
    for start in (0..n).step_by(32) {
        for (l, al) in acc.iter_mut().enumerate() {
            for e in [start + 2 * l + 1, start + 2 * l] {
                let (xv, wv) = if e < n { (x[e], w[e]) } else { (0, 0) };
                let p = daz(bf16_f32(xv)) * daz(bf16_f32(wv));
                *al = daz(*al + p);
            }
        }
    }
}

/// Sixteen lanes summed as the bf16 kernels reduce a register: halves, then [`hsum8`].
fn sum16(v: &[f32; 16]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|l| v[l] + v[l + 8]);
    hsum8(&h)
}

fn bf16_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

fn daz(x: f32) -> f32 {
    if x.is_subnormal() {
        0f32.copysign(x)
    } else {
        x
    }
}

/// `Σ x·w` of one bf16 activation row and `R` bf16 weight rows on `vdpbf16ps` (on the scalar
/// twin where the CPU lacks it or the path is emulated): `out[r]` has the bits of
/// [`dot_bf16_scalar`]`(x, w[r])`. Several rows at once keep several chains in flight (one
/// token's decode).
///
/// # Panics
/// If the rows differ in length.
pub fn dot_bf16_rx1<const R: usize>(w: [&[u16]; R], x: &[u16]) -> [f32; R] {
    assert!(
        w.iter().all(|w| w.len() == x.len()),
        "dot_bf16: rows of unequal length"
    );
    #[cfg(target_arch = "x86_64")]
    if bf16_native() {
        // SAFETY: the CPU has AVX-512 F/BW/VL and BF16 (`bf16_native`).
        return unsafe { bf16k::dot_rx::<R, 1>(w, [x]).map(|[v]| v) };
    }
    w.map(|w| dot_bf16_scalar(x, w))
}

/// [`dot_bf16_rx1`] for three activation rows: `out[r][t]` has the bits of
/// `dot_bf16_scalar(x[t], w[r])`. Eight rows by three tokens keep 24 chains in registers and
/// load each activation vector once for eight rows.
///
/// # Panics
/// As `dot_bf16_rx1`, for any pair.
pub fn dot_bf16_rx3<const R: usize>(w: [&[u16]; R], x: [&[u16]; 3]) -> [[f32; 3]; R] {
    let n = x[0].len();
    assert!(
        w.iter().all(|w| w.len() == n) && x.iter().all(|x| x.len() == n),
        "dot_bf16_rx3: rows of unequal length"
    );
    #[cfg(target_arch = "x86_64")]
    if bf16_native() {
        // SAFETY: the CPU has AVX-512 F/BW/VL and BF16 (`bf16_native`).
        return unsafe { bf16k::dot_rx::<R, 3>(w, x) };
    }
    w.map(|w| x.map(|x| dot_bf16_scalar(x, w)))
}

/// The running sums of `R` rows by `T` tokens of the `vdpbf16ps` dots, carried from one
/// stretch of the rows to the next (a long row in stretches that stay in cache): stretch after
/// stretch through [`dot_bf16_carry`], then [`BfCarry::finish`], gives the bits of one
/// [`dot_bf16_rx3`] / [`dot_bf16_rx1`] over the whole rows, as long as every stretch but the
/// last is a whole number of 32-value chunks.
#[derive(Clone, Copy)]
pub struct BfCarry<const R: usize, const T: usize>([[[f32; 16]; T]; R]);

impl<const R: usize, const T: usize> Default for BfCarry<R, T> {
    fn default() -> Self {
        BfCarry([[[0.0; 16]; T]; R])
    }
}

impl<const R: usize, const T: usize> BfCarry<R, T> {
    /// The sums: `out[r][t]` for weight row `r` and token `t`.
    pub fn finish(&self) -> [[f32; T]; R] {
        self.0.map(|a| a.map(|v| sum16(&v)))
    }
}

/// Adds one stretch of `R` weight rows against `T` activation rows to `carry` (see
/// [`BfCarry`]).
///
/// # Panics
/// If the stretches differ in length, one before the last is not a multiple of 32 long (the
/// caller's to keep).
pub fn dot_bf16_carry<const R: usize, const T: usize>(
    w: [&[u16]; R],
    x: [&[u16]; T],
    carry: &mut BfCarry<R, T>,
) {
    let n = x[0].len();
    assert!(
        w.iter().all(|w| w.len() == n) && x.iter().all(|x| x.len() == n),
        "dot_bf16_carry: stretches of unequal length"
    );
    #[cfg(target_arch = "x86_64")]
    if bf16_native() {
        // SAFETY: the CPU has AVX-512 F/BW/VL and BF16 (`bf16_native`).
        return unsafe { bf16k::carry(w, x, &mut carry.0) };
    }
    for (wr, acc) in w.iter().zip(carry.0.iter_mut()) {
        for (xt, a) in x.iter().zip(acc.iter_mut()) {
            bf16_chain_scalar(xt, wr, a);
        }
    }
}

/// A weight row of 16-bit floats, as stored.
#[derive(Clone, Copy)]
pub enum HalfRow<'a> {
    F16(&'a [half::f16]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
}

impl<'a> HalfRow<'a> {
    /// Elements `a..b` of the row.
    pub(crate) fn range(self, a: usize, b: usize) -> HalfRow<'a> {
        match self {
            HalfRow::F16(h) => HalfRow::F16(&h[a..b]),
            HalfRow::Bf16(h) => HalfRow::Bf16(&h[a..b]),
        }
    }

    fn len(self) -> usize {
        match self {
            HalfRow::F16(h) => h.len(),
            HalfRow::Bf16(h) => h.len(),
        }
    }

    pub(crate) fn to_f32(self, out: &mut [f32]) {
        match self {
            HalfRow::F16(h) => f16_to_f32(h, out),
            HalfRow::Bf16(h) => bf16_to_f32(h, out),
        }
    }
}

/// `dot_f32(a, b)` with `b` converted to f32 element by element as it is read, instead of into
/// a buffer first: the conversion is exact, and the lanes, accumulators and reduction are
/// `dot_f32`'s, so the result has the same bits (a NaN in `b` gives a NaN either way). For a
/// decode step, which reads each row of an f16/bf16 matrix once, the buffer's store and reload
/// were a third of the work.
pub fn dot_half(a: &[f32], b: HalfRow) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if zmm_f32() {
            // SAFETY: `zmm_f32` checked AVX2, FMA, F16C and AVX-512F.
            return unsafe {
                match b {
                    HalfRow::F16(h) => {
                        avx512::dot_half::<false>(a, h.as_ptr() as *const u16, h.len())
                    }
                    HalfRow::Bf16(h) => avx512::dot_half::<true>(a, h.as_ptr(), h.len()),
                }
            };
        }
        if super::quant::has_avx2() {
            // SAFETY: AVX2, FMA and F16C detected.
            return unsafe {
                match b {
                    HalfRow::F16(h) => {
                        avx2::dot_half::<false>(a, h.as_ptr() as *const u16, h.len())
                    }
                    HalfRow::Bf16(h) => avx2::dot_half::<true>(a, h.as_ptr(), h.len()),
                }
            };
        }
    }
    dot_half_scalar(a, b)
}

/// Whether [`dot_half`] runs vectorised here; its scalar twin converts into a new buffer
/// every call, slower than converting a row once for all tokens.
pub fn dot_half_is_vectorised() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::quant::has_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`dot_half`]'s scalar twin: convert, then [`dot_f32_scalar`].
pub fn dot_half_scalar(a: &[f32], b: HalfRow) -> f32 {
    let mut f = vec![0f32; b.len()];
    b.to_f32(&mut f);
    dot_f32_scalar(a, &f)
}

/// `Σ x²` in f64 (RMSNorm: long rows lose nothing to rounding). Eight lane sums, lane `l`
/// taking the elements `≡ l (mod 8)` in order, combined pairwise, then the tail: the order
/// the SIMD kernel keeps, so both give the same bits. Each square is exact in f64, so a
/// fused multiply-add and a multiply then add round alike.
pub fn sum_sq_f64(x: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma() {
            // SAFETY: AVX2 and FMA detected just above.
            return unsafe { avx2::sum_sq_f64(x) };
        }
    }
    sum_sq_f64_scalar(x)
}

pub fn sum_sq_f64_scalar(x: &[f32]) -> f64 {
    let main = x.len() - x.len() % 8;
    let mut lanes = [0f64; 8];
    for c in x[..main].chunks_exact(8) {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v as f64 * v as f64;
        }
    }
    let mut sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
        + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for &v in &x[main..] {
        sum += v as f64 * v as f64;
    }
    sum
}

/// f32 → f16 for a slice (KV rows as they are written), rounding to nearest even: F16C's
/// conversion and `half`'s software one give the same bits.
pub fn f32_to_f16(src: &[f32], dst: &mut [half::f16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        if super::quant::has_avx2() {
            // SAFETY: AVX2, FMA and F16C detected.
            return unsafe { avx2::f32_to_f16(src, dst) };
        }
    }
    f32_to_f16_scalar(src, dst)
}

/// In software (`from_f32` would itself pick F16C where the CPU has it).
pub fn f32_to_f16_scalar(src: &[f32], dst: &mut [half::f16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32_const(s);
    }
}

/// Which SIMD path is in use (for the load summary and `bench`): the packed kernels'
/// instruction set, "+zmm-k" where the 512-bit two-group Q4_K/Q6_K kernels run, "+bf16" where
/// BF16 weights take `vdpbf16ps`, "+amx" where
/// prefill takes the AMX tiles ("+amx-emulated" on emulated ones, for tests).
pub fn simd_name() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma() {
            use super::quant::packed::{wide_k, Isa};
            let mut name = String::from("avx2+fma");
            match Isa::best() {
                Isa::AvxVnni => name.push_str("+avx-vnni"),
                Isa::Avx512Vnni => name.push_str("+avx512-vnni"),
                _ => {}
            }
            if wide_k() {
                name.push_str("+zmm-k");
            }
            if bf16_dot() {
                name.push_str(if bf16_native() {
                    "+bf16"
                } else {
                    "+bf16-emulated"
                });
            }
            match super::quant::amx::mode() {
                super::quant::amx::Mode::Amx => name.push_str("+amx"),
                super::quant::amx::Mode::Emulated => name.push_str("+amx-emulated"),
                super::quant::amx::Mode::Off => {}
            }
            return name;
        }
    }
    "scalar".into()
}

pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let main = n - n % 32;
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i < main {
        for (r, accr) in acc.iter_mut().enumerate() {
            for (l, accl) in accr.iter_mut().enumerate() {
                let k = i + r * 8 + l;
                *accl = a[k].mul_add(b[k], *accl);
            }
        }
        i += 32;
    }
    let mut lanes = [0f32; 8];
    for l in 0..8 {
        lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    let mut sum = hsum8(&lanes);
    for k in main..n {
        sum = a[k].mul_add(b[k], sum);
    }
    sum
}

/// Horizontal sum in the order the AVX2 reduction uses.
fn hsum8(l: &[f32; 8]) -> f32 {
    let q = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let h = [q[0] + q[2], q[1] + q[3]];
    h[0] + h[1]
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::hsum_ps;

/// The `vdpbf16ps` kernels ([`bf16_dot_runs`]).
#[cfg(target_arch = "x86_64")]
mod bf16k {
    use super::avx2::hsum_ps;
    use std::arch::x86_64::*;

    /// 32 bf16 from `p`, the lanes past `n` (of 32) zero.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    unsafe fn load(p: *const u16, n: usize) -> __m512bh {
        let v = if n >= 32 {
            _mm512_loadu_si512(p as *const _)
        } else {
            _mm512_maskz_loadu_epi16((1u32 << n) - 1, p as *const i16)
        };
        std::mem::transmute::<__m512i, __m512bh>(v)
    }

    /// The 16 lanes summed as halves, then the AVX2 reduction.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    unsafe fn reduce(v: __m512) -> f32 {
        hsum_ps(_mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        ))
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn f32_to_bf16(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 16 <= n {
            let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src.as_ptr().add(i)));
            _mm256_storeu_si256(
                dst.as_mut_ptr().add(i) as *mut __m256i,
                std::mem::transmute::<__m256bh, __m256i>(v),
            );
            i += 16;
        }
        super::f32_to_bf16_rne_scalar(&src[i..n], &mut dst[i..n]);
    }

    /// `R` weight rows against `T` activation rows, one accumulator per pair, in one pass
    /// over the rows (callers check the lengths are equal).
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn dot_rx<const R: usize, const T: usize>(
        w: [&[u16]; R],
        x: [&[u16]; T],
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        accumulate(w, x, &mut acc);
        acc.map(|a| a.map(|v| reduce(v)))
    }

    /// [`dot_rx`]'s sums carried in `carry` (lanes as f32 arrays) instead of started at zero
    /// and reduced.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn carry<const R: usize, const T: usize>(
        w: [&[u16]; R],
        x: [&[u16]; T],
        carry: &mut [[[f32; 16]; T]; R],
    ) {
        let mut acc = carry.map(|a| a.map(|v| _mm512_loadu_ps(v.as_ptr())));
        accumulate(w, x, &mut acc);
        for (c, a) in carry.iter_mut().zip(acc) {
            for (c, a) in c.iter_mut().zip(a) {
                _mm512_storeu_ps(c.as_mut_ptr(), a);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    unsafe fn accumulate<const R: usize, const T: usize>(
        w: [&[u16]; R],
        x: [&[u16]; T],
        acc: &mut [[__m512; T]; R],
    ) {
        let n = x[0].len();
        let pw = w.map(|w| w.as_ptr());
        let px = x.map(|x| x.as_ptr());
        let mut i = 0;
        while i < n {
            let k = (n - i).min(32);
            let xs = px.map(|p| load(p.add(i), k));
            for (a, p) in acc.iter_mut().zip(pw) {
                let wv = load(p.add(i), k);
                for (a, x) in a.iter_mut().zip(xs) {
                    *a = _mm512_dpbf16_ps(*a, x, wv);
                }
            }
            i += 32;
        }
    }
}

/// The f32 dots on 512-bit registers ([`zmm_f32`]). Register `h` of a row's pair holds what
/// the AVX2 kernels keep in accumulators `2h` and `2h + 1`; the two halves of each are added
/// first, then the pairs, then the AVX2 kernels' eight-lane reduction, so every sum is theirs
/// bit for bit (and so the scalar twins').
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::hsum_ps;
    use std::arch::x86_64::*;

    /// `(a0 + a1) + (a2 + a3)` of the AVX2 kernels' accumulators, then their reduction.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    #[inline]
    unsafe fn sum2(lo: __m512, hi: __m512) -> f32 {
        let a01 = _mm256_add_ps(
            _mm512_castps512_ps256(lo),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(lo))),
        );
        let a23 = _mm256_add_ps(
            _mm512_castps512_ps256(hi),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(hi))),
        );
        hsum_ps(_mm256_add_ps(a01, a23))
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let main = n - n % 32;
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut lo, mut hi) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i < main {
            lo = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), lo);
            hi = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i + 16)),
                _mm512_loadu_ps(pb.add(i + 16)),
                hi,
            );
            i += 32;
        }
        let mut sum = sum2(lo, hi);
        for k in main..n {
            sum = (*pa.add(k)).mul_add(*pb.add(k), sum);
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub unsafe fn dot_f32_x3(w: &[f32], x: [&[f32]; 3]) -> [f32; 3] {
        let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
        let main = n - n % 32;
        let pw = w.as_ptr();
        let px = x.map(|x| x.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; 3];
        let mut i = 0;
        while i < main {
            for h in 0..2 {
                let wv = _mm512_loadu_ps(pw.add(i + 16 * h));
                for (a, p) in acc.iter_mut().zip(&px) {
                    a[h] = _mm512_fmadd_ps(_mm512_loadu_ps(p.add(i + 16 * h)), wv, a[h]);
                }
            }
            i += 32;
        }
        std::array::from_fn(|t| {
            let mut sum = sum2(acc[t][0], acc[t][1]);
            for k in main..n {
                sum = (*px[t].add(k)).mul_add(*pw.add(k), sum);
            }
            sum
        })
    }

    /// Callers check that every row is `w[0].len()` long.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub unsafe fn dot_f32_4x3(w: [&[f32]; 4], x: [&[f32]; 3]) -> [[f32; 3]; 4] {
        let n = w[0].len();
        let main = n - n % 32;
        let pw = w.map(|w| w.as_ptr());
        let px = x.map(|x| x.as_ptr());
        let zero = [[_mm512_setzero_ps(); 3]; 4];
        let lo = half_rt::<0, 4, 3>(pw, px, main, zero);
        let hi = half_rt::<1, 4, 3>(pw, px, main, zero);
        std::array::from_fn(|r| {
            std::array::from_fn(|t| {
                let mut sum = sum2(lo[r][t], hi[r][t]);
                for k in main..n {
                    sum = (*px[t].add(k)).mul_add(*pw[r].add(k), sum);
                }
                sum
            })
        })
    }

    /// One half of the lanes of `R` rows' dots with `T` tokens' ([`dot_f32_4x3`],
    /// [`super::dot_f32_carry`]): elements `32i + 16H ..` of every 32, into the pairs'
    /// accumulators of that half, from `acc`. The two halves run as two passes: both at once
    /// needed 24 accumulators and 7 operands for four rows by three tokens, more than the
    /// allocator kept in the 32 registers (it stored some every iteration); each half reads
    /// every other cache line, so each line is still read once. Index loops, not iterators'
    /// closures: a closure does not inherit its function's target features.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    #[inline]
    unsafe fn half_rt<const H: usize, const R: usize, const T: usize>(
        w: [*const f32; R],
        x: [*const f32; T],
        main: usize,
        mut acc: [[__m512; T]; R],
    ) -> [[__m512; T]; R] {
        let mut i = 16 * H;
        while i < main {
            let mut xs = [_mm512_setzero_ps(); T];
            for t in 0..T {
                xs[t] = _mm512_loadu_ps(x[t].add(i));
            }
            for r in 0..R {
                let wv = _mm512_loadu_ps(w[r].add(i));
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(xs[t], wv, acc[r][t]);
                }
            }
            i += 32;
        }
        acc
    }

    /// [`super::dot_f32_carry`]: `w[0].len()` a multiple of 32, every row as long (callers
    /// check). Lanes 0..16 of a pair's carry are its low half's accumulator, 16..32 its high
    /// half's; the halves run as two passes, as in [`dot_f32_4x3`]. Index loops, as in
    /// [`half_rt`].
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub unsafe fn dot_f32_carry<const R: usize, const T: usize>(
        w: [&[f32]; R],
        x: [&[f32]; T],
        carry: &mut super::F32Carry<R, T>,
    ) {
        let n = w[0].len();
        let mut pw = [std::ptr::null::<f32>(); R];
        for r in 0..R {
            pw[r] = w[r].as_ptr();
        }
        let mut px = [std::ptr::null::<f32>(); T];
        for t in 0..T {
            px[t] = x[t].as_ptr();
        }
        for h in 0..2 {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            for r in 0..R {
                for t in 0..T {
                    acc[r][t] = _mm512_loadu_ps(carry.0[r][t].as_ptr().add(16 * h));
                }
            }
            let acc = if h == 0 {
                half_rt::<0, R, T>(pw, px, n, acc)
            } else {
                half_rt::<1, R, T>(pw, px, n, acc)
            };
            for r in 0..R {
                for t in 0..T {
                    _mm512_storeu_ps(carry.0[r][t].as_mut_ptr().add(16 * h), acc[r][t]);
                }
            }
        }
    }

    /// Sixteen 16-bit floats from `p` as f32: F16C for f16, a 16-bit shift for bf16.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    #[inline]
    unsafe fn half16<const BF: bool>(p: *const u16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        if BF {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_cvtph_ps(h)
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub unsafe fn dot_half<const BF: bool>(a: &[f32], pb: *const u16, n: usize) -> f32 {
        let n = a.len().min(n);
        let main = n - n % 32;
        let pa = a.as_ptr();
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i < main {
            for (h, ah) in acc.iter_mut().enumerate() {
                let o = i + 16 * h;
                *ah = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(o)), half16::<BF>(pb.add(o)), *ah);
            }
            i += 32;
        }
        let mut sum = sum2(acc[0], acc[1]);
        for k in main..n {
            let b = *pb.add(k);
            let b = if BF {
                f32::from_bits((b as u32) << 16)
            } else {
                half::f16::from_bits(b).to_f32()
            };
            sum = (*pa.add(k)).mul_add(b, sum);
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let main = n - n % 32;
        let pa = a.as_ptr();
        let pb = b.as_ptr();
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut acc2 = _mm256_setzero_ps();
        let mut acc3 = _mm256_setzero_ps();
        let mut i = 0;
        while i < main {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
            acc2 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 16)),
                _mm256_loadu_ps(pb.add(i + 16)),
                acc2,
            );
            acc3 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 24)),
                _mm256_loadu_ps(pb.add(i + 24)),
                acc3,
            );
            i += 32;
        }
        let mut sum = sum4([acc0, acc1, acc2, acc3]);
        for k in main..n {
            sum = (*pa.add(k)).mul_add(*pb.add(k), sum);
        }
        sum
    }

    /// Sums eight f32 lanes in a fixed order, the one every AVX2 kernel uses (its scalar
    /// twin is `hsum8`): halves added, then [q0+q2, q1+q3], then lane 0 + lane 1.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) unsafe fn hsum_ps(v: __m256) -> f32 {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)))
    }

    /// `dot_f32`'s four accumulators summed: `(a0 + a1) + (a2 + a3)`, then [`hsum_ps`] (the
    /// fused-conversion and three-token dots share it, which is what keeps their bits equal).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn sum4(a: [__m256; 4]) -> f32 {
        hsum_ps(_mm256_add_ps(
            _mm256_add_ps(a[0], a[1]),
            _mm256_add_ps(a[2], a[3]),
        ))
    }

    /// `dot_f32` for three activation rows against one weight row: per token the same four
    /// accumulators, the same order and the same reduction; the weight vectors are loaded once.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32_x3(w: &[f32], x: [&[f32]; 3]) -> [f32; 3] {
        let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
        let main = n - n % 32;
        let pw = w.as_ptr();
        let px = x.map(|x| x.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 4]; 3];
        let mut i = 0;
        while i < main {
            for r in 0..4 {
                let wv = _mm256_loadu_ps(pw.add(i + 8 * r));
                for (a, p) in acc.iter_mut().zip(&px) {
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(i + 8 * r)), wv, a[r]);
                }
            }
            i += 32;
        }
        std::array::from_fn(|t| {
            let mut sum = sum4(acc[t]);
            for k in main..n {
                sum = (*px[t].add(k)).mul_add(*pw.add(k), sum);
            }
            sum
        })
    }

    /// Eight 16-bit floats from `p` as f32: F16C for f16, a 16-bit shift for bf16.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half8<const BF: bool>(p: *const u16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        if BF {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        } else {
            _mm256_cvtph_ps(h)
        }
    }

    /// `dot_f32`'s loop and reduction with `b` (`n` 16-bit floats, bf16 if `BF`) converted as
    /// it is loaded. A bf16 NaN is not quietened as `bf16_to_f32` does: the sum is a NaN either
    /// way.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_half<const BF: bool>(a: &[f32], pb: *const u16, n: usize) -> f32 {
        let n = a.len().min(n);
        let main = n - n % 32;
        let pa = a.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < main {
            for (r, ar) in acc.iter_mut().enumerate() {
                let o = i + 8 * r;
                *ar = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), half8::<BF>(pb.add(o)), *ar);
            }
            i += 32;
        }
        let mut sum = sum4(acc);
        for k in main..n {
            let b = *pb.add(k);
            let b = if BF {
                f32::from_bits((b as u32) << 16)
            } else {
                half::f16::from_bits(b).to_f32()
            };
            sum = (*pa.add(k)).mul_add(b, sum);
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot8(q: &[f32], k: &[f32], out: &mut [f32; 8]) {
        let n = q.len();
        let main = n - n % 8;
        assert!(k.len() >= 8 * n);
        let (pq, pk) = (q.as_ptr(), k.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut c = 0;
        while c < main {
            let qv = _mm256_loadu_ps(pq.add(c));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(pk.add(r * n + c)), *a);
            }
            c += 8;
        }
        // hadd pairs neighbouring lanes: per key, ((l0+l1)+(l2+l3)) and ((l4+l5)+(l6+l7)) end
        // up in the low and high 128-bit halves, then one add joins them.
        let t0 = _mm256_hadd_ps(acc[0], acc[1]);
        let t1 = _mm256_hadd_ps(acc[2], acc[3]);
        let t2 = _mm256_hadd_ps(acc[4], acc[5]);
        let t3 = _mm256_hadd_ps(acc[6], acc[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        let lo = _mm256_permute2f128_ps(u0, u1, 0x20);
        let hi = _mm256_permute2f128_ps(u0, u1, 0x31);
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
        for d in main..n {
            for (r, o) in out.iter_mut().enumerate() {
                *o = q[d].mul_add(k[r * n + d], *o);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn mix(p: &[f32], v: &[f32], acc: &mut [f32]) {
        let n = acc.len();
        assert!(v.len() >= p.len() * n);
        let (pv, pa) = (v.as_ptr(), acc.as_mut_ptr());
        let main = n - n % 8;
        // Up to 64 accumulators live in registers across all of p.
        let mut d = 0;
        while d < main {
            let w = ((main - d) / 8).min(8);
            let mut a = [_mm256_setzero_ps(); 8];
            for (i, ai) in a.iter_mut().enumerate().take(w) {
                *ai = _mm256_loadu_ps(pa.add(d + 8 * i));
            }
            for (j, &pj) in p.iter().enumerate() {
                let b = _mm256_set1_ps(pj);
                let row = pv.add(j * n + d);
                for (i, ai) in a.iter_mut().enumerate().take(w) {
                    *ai = _mm256_fmadd_ps(b, _mm256_loadu_ps(row.add(8 * i)), *ai);
                }
            }
            for (i, ai) in a.iter().enumerate().take(w) {
                _mm256_storeu_ps(pa.add(d + 8 * i), *ai);
            }
            d += 8 * w;
        }
        for d in main..n {
            for (j, &pj) in p.iter().enumerate() {
                *pa.add(d) = pj.mul_add(*pv.add(j * n + d), *pa.add(d));
            }
        }
    }

    /// `dot8` for `G` query heads and up to four keys read from an f16 cache (see
    /// `AttnKernels`): each key vector converted once, then one fused multiply-add per head.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot4_f16<const G: usize>(
        q: &[f32],
        cache: &[half::f16],
        offs: &[usize],
        out: &mut [[f32; 4]; super::F16_HEADS],
    ) {
        assert!(G <= super::F16_HEADS && q.len().is_multiple_of(G));
        assert!(!offs.is_empty() && offs.len() <= 4);
        let n = q.len() / G;
        let main = n - n % 8;
        assert!(offs.iter().all(|&o| o + n <= cache.len()));
        let rows: [*const u16; 4] =
            std::array::from_fn(|r| cache.as_ptr().add(offs[r.min(offs.len() - 1)]) as *const u16);
        let pq = q.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 4]; G];
        let mut c = 0;
        while c < main {
            for (r, row) in rows.iter().enumerate() {
                let k = _mm256_cvtph_ps(_mm_loadu_si128(row.add(c) as *const __m128i));
                for (h, a) in acc.iter_mut().enumerate() {
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(h * n + c)), k, a[r]);
                }
            }
            c += 8;
        }
        for (h, (a, o)) in acc.iter().zip(out.iter_mut()).enumerate() {
            // `dot8`'s reduction: per key ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
            let t0 = _mm256_hadd_ps(a[0], a[1]);
            let t1 = _mm256_hadd_ps(a[2], a[3]);
            let u = _mm256_hadd_ps(t0, t1);
            let sum = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
            _mm_storeu_ps(o.as_mut_ptr(), sum);
            for d in main..n {
                for (o, row) in o.iter_mut().zip(rows) {
                    let k = half::f16::from_bits(*row.add(d)).to_f32();
                    *o = q[h * n + d].mul_add(k, *o);
                }
            }
        }
    }

    /// `mix` for `G` heads, the value rows read from an f16 cache (see `AttnKernels`): each
    /// value vector converted once, then one fused multiply-add per head.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn mix_f16<const G: usize>(
        p: &[f32],
        cache: &[half::f16],
        offs: &[usize],
        acc: &mut [f32],
    ) {
        assert!(G <= super::F16_HEADS && p.len().is_multiple_of(G));
        assert!(acc.len().is_multiple_of(G));
        let (m, n) = (p.len() / G, acc.len() / G);
        assert!(offs.len() >= m && offs[..m].iter().all(|&o| o + n <= cache.len()));
        let (pc, pa, pp) = (cache.as_ptr() as *const u16, acc.as_mut_ptr(), p.as_ptr());
        let main = n - n % 8;
        // W vectors of each head's output stay in registers across all of p: W is a constant,
        // so the accumulators can be registers (with a run-time count they lived on the
        // stack, a store and a reload around every multiply-add).
        #[inline(always)]
        unsafe fn pass<const G: usize, const W: usize>(
            d: usize,
            (m, n): (usize, usize),
            offs: &[usize],
            (pc, pa, pp): (*const u16, *mut f32, *const f32),
        ) {
            let mut a = [[_mm256_setzero_ps(); W]; G];
            for (h, ah) in a.iter_mut().enumerate() {
                for (i, ai) in ah.iter_mut().enumerate() {
                    *ai = _mm256_loadu_ps(pa.add(h * n + d + 8 * i));
                }
            }
            for (j, &o) in offs[..m].iter().enumerate() {
                // The rows come in runs of one block, the blocks scattered over the cache:
                // fetch ahead of the hardware prefetcher.
                if let Some(&ahead) = offs[..m].get(j + super::PREFETCH_ROWS) {
                    _mm_prefetch::<_MM_HINT_T0>(pc.add(ahead + d) as *const i8);
                }
                let b: [__m256; G] = std::array::from_fn(|h| _mm256_set1_ps(*pp.add(h * m + j)));
                let row = pc.add(o + d);
                for i in 0..W {
                    let v = _mm256_cvtph_ps(_mm_loadu_si128(row.add(8 * i) as *const __m128i));
                    for (ah, bh) in a.iter_mut().zip(&b) {
                        ah[i] = _mm256_fmadd_ps(*bh, v, ah[i]);
                    }
                }
            }
            for (h, ah) in a.iter().enumerate() {
                for (i, ai) in ah.iter().enumerate() {
                    _mm256_storeu_ps(pa.add(h * n + d + 8 * i), *ai);
                }
            }
        }
        let ptrs = (pc, pa, pp);
        let mut d = 0;
        // One head: eight vectors, so eight independent chains of multiply-adds per value row.
        while G == 1 && d + 64 <= main {
            pass::<G, 8>(d, (m, n), offs, ptrs);
            d += 64;
        }
        while d + 32 <= main {
            pass::<G, 4>(d, (m, n), offs, ptrs);
            d += 32;
        }
        while d < main {
            pass::<G, 1>(d, (m, n), offs, ptrs);
            d += 8;
        }
        for d in main..n {
            for (j, &o) in offs[..m].iter().enumerate() {
                let v = half::f16::from_bits(*pc.add(o + d)).to_f32();
                for h in 0..G {
                    let x = pa.add(h * n + d);
                    *x = (*pp.add(h * m + j)).mul_add(v, *x);
                }
            }
        }
    }

    /// e^x for eight x; lane for lane the same operations as `super::exp_f32`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_f32(x: __m256) -> __m256 {
        use super::{EXP_C, EXP_MAX, EXP_MIN, LN2_HI, LN2_LO, LOG2E};
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
            _mm256_set1_ps(EXP_MAX),
        );
        let k = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_C[0]);
        for &c in &EXP_C[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(k),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n = out.len().min(g.len()).min(u.len());
        let main = n - n % 8;
        let (pg, pu, po) = (g.as_ptr(), u.as_ptr(), out.as_mut_ptr());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i < main {
            let x = _mm256_loadu_ps(pg.add(i));
            let e = exp_f32(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(po.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(pu.add(i))));
            i += 8;
        }
        super::silu_mul_scalar(&g[main..n], &u[main..n], &mut out[main..n]);
    }

    /// Plain products and sums (no fused multiply-add), in the scalar twin's order: the
    /// same bits.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gelu_tanh_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n = out.len().min(g.len()).min(u.len());
        let main = n - n % 8;
        let (pg, pu, po) = (g.as_ptr(), u.as_ptr(), out.as_mut_ptr());
        let one = _mm256_set1_ps(1.0);
        let (c2, k) = (
            _mm256_set1_ps(super::GELU_2C),
            _mm256_set1_ps(super::GELU_K),
        );
        let mut i = 0;
        while i < main {
            let x = _mm256_loadu_ps(pg.add(i));
            let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            let z = _mm256_mul_ps(c2, _mm256_add_ps(x, _mm256_mul_ps(k, x3)));
            let e = exp_f32(_mm256_sub_ps(_mm256_setzero_ps(), z));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(po.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(pu.add(i))));
            i += 8;
        }
        super::gelu_tanh_mul_scalar(&g[main..n], &u[main..n], &mut out[main..n]);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(s: &mut [f32], scale: f32) {
        let n = s.len();
        let main = n - n % 8;
        let ps = s.as_mut_ptr();
        let sc = _mm256_set1_ps(scale);
        let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < main {
            let v = _mm256_mul_ps(_mm256_loadu_ps(ps.add(i)), sc);
            _mm256_storeu_ps(ps.add(i), v);
            mx = _mm256_max_ps(mx, v);
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), mx);
        let mut max = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for v in &mut s[main..] {
            *v *= scale;
            max = max.max(*v);
        }
        let m = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        let mut i = 0;
        while i < main {
            let e = exp_f32(_mm256_sub_ps(_mm256_loadu_ps(ps.add(i)), m));
            _mm256_storeu_ps(ps.add(i), e);
            sum = _mm256_add_ps(sum, e);
            i += 8;
        }
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        for (j, v) in s[main..].iter_mut().enumerate() {
            *v = super::exp_f32(*v - max);
            lanes[j] += *v;
        }
        let inv = 1.0 / super::hsum8(&lanes);
        let invv = _mm256_set1_ps(inv);
        let mut i = 0;
        while i < main {
            _mm256_storeu_ps(ps.add(i), _mm256_mul_ps(_mm256_loadu_ps(ps.add(i)), invv));
            i += 8;
        }
        for v in &mut s[main..] {
            *v *= inv;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let main = n - n % 8;
        let (ps, pd) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
        let mut i = 0;
        while i < main {
            _mm256_storeu_ps(
                pd.add(i),
                _mm256_cvtph_ps(_mm_loadu_si128(ps.add(i) as *const __m128i)),
            );
            i += 8;
        }
        for (d, h) in dst[main..n].iter_mut().zip(&src[main..n]) {
            *d = h.to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let main = n - n % 8;
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        let (abs, inf, quiet) = (
            _mm256_set1_epi32(0x7fff_0000),
            _mm256_set1_epi32(0x7f80_0000),
            _mm256_set1_epi32(0x0040_0000),
        );
        let mut i = 0;
        while i < main {
            let w = _mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(ps.add(i) as *const __m128i)),
                16,
            );
            // |w| > inf as signed compares (both are positive): a NaN.
            let nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, abs), inf);
            let w = _mm256_or_si256(w, _mm256_and_si256(nan, quiet));
            _mm256_storeu_ps(pd.add(i), _mm256_castsi256_ps(w));
            i += 8;
        }
        super::bf16_to_f32_scalar(&src[main..n], &mut dst[main..n]);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sum_sq_f64(x: &[f32]) -> f64 {
        let main = x.len() - x.len() % 8;
        let p = x.as_ptr();
        // Lanes 0–3 and 4–7 of the scalar twin.
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        let mut i = 0;
        while i < main {
            let a = _mm256_cvtps_pd(_mm_loadu_ps(p.add(i)));
            let b = _mm256_cvtps_pd(_mm_loadu_ps(p.add(i + 4)));
            lo = _mm256_fmadd_pd(a, a, lo);
            hi = _mm256_fmadd_pd(b, b, hi);
            i += 8;
        }
        // (l0 + l4, l1 + l5, l2 + l6, l3 + l7), then (·0 + ·2, ·1 + ·3), then their sum.
        let q = _mm256_add_pd(lo, hi);
        let h = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
        let mut sum = _mm_cvtsd_f64(h) + _mm_cvtsd_f64(_mm_unpackhi_pd(h, h));
        for &v in &x[main..] {
            sum += v as f64 * v as f64;
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_to_f16(src: &[f32], dst: &mut [half::f16]) {
        let n = src.len().min(dst.len());
        let main = n - n % 8;
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr() as *mut u16);
        let mut i = 0;
        while i < main {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(ps.add(i)));
            _mm_storeu_si128(pd.add(i) as *mut __m128i, h);
            i += 8;
        }
        super::f32_to_f16_scalar(&src[main..n], &mut dst[main..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn sum_of_squares_equals_scalar_twin_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        // Magnitudes far apart, so a different summation order would show in the low bits.
        let x: Vec<f32> = (0..3000)
            .map(|i| rng.gen_range(-1.0f32..1.0) * 10f32.powi(i % 9 - 4))
            .collect();
        for n in [0, 1, 7, 8, 9, 64, 576, 1001, x.len()] {
            let (a, b) = (sum_sq_f64(&x[..n]), sum_sq_f64_scalar(&x[..n]));
            assert_eq!(a.to_bits(), b.to_bits(), "n = {n}");
            let plain: f64 = x[..n].iter().map(|&v| v as f64 * v as f64).sum();
            assert!((a - plain).abs() <= 1e-12 * plain.max(1e-300), "n = {n}");
        }
    }

    #[test]
    fn f16_conversion_equals_scalar_twin_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        // Normal values, values that round to subnormals and to infinity, ties, zeros.
        let mut x: Vec<f32> = (0..1000)
            .map(|i| match i % 5 {
                0 => rng.gen_range(-70000.0..70000.0),
                1 => rng.gen_range(-1e-6..1e-6),
                2 => half::f16::from_bits(rng.gen()).to_f32() * (1.0 + f32::EPSILON * 4096.0),
                _ => rng.gen_range(-4.0..4.0),
            })
            .collect();
        x.extend([0.0, -0.0, 65504.0, 65520.0, -65520.0, 1.0 + 1.0 / 2048.0]);
        x.extend([f32::NAN, -f32::NAN, f32::INFINITY, 1e-10, -7e-8]);
        for n in [0, 1, 7, 8, 9, 200, x.len()] {
            let mut a = vec![half::f16::ZERO; n];
            let mut b = vec![half::f16::ZERO; n];
            f32_to_f16(&x[..n], &mut a);
            f32_to_f16_scalar(&x[..n], &mut b);
            // A NaN stays a NaN (its payload bits may differ); everything else bit for bit.
            let bits = |v: &[half::f16]| {
                v.iter()
                    .map(|h| if h.is_nan() { u16::MAX } else { h.to_bits() })
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&a), bits(&b), "n = {n}");
        }
    }

    #[test]
    fn attention_kernels_equal_scalar_twins_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let k = attn_kernels();
        for n in [5, 8, 13, 64, 96, 104, 128, 200] {
            let q: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let keys: Vec<f32> = (0..8 * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
            (k.dot8)(&q, &keys, &mut a);
            dot8_scalar(&q, &keys, &mut b);
            assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "dot8 n={n}");
            for (r, &v) in a.iter().enumerate() {
                let e: f64 = (0..n).map(|d| q[d] as f64 * keys[r * n + d] as f64).sum();
                assert!((v as f64 - e).abs() < 1e-4, "dot8 n={n} row {r}");
            }
            let p: Vec<f32> = (0..7).map(|_| rng.gen_range(0.0..1.0)).collect();
            let vals: Vec<f32> = (0..7 * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (mut x, mut y) = (q.clone(), q.clone());
            (k.mix)(&p, &vals, &mut x);
            mix_scalar(&p, &vals, &mut y);
            assert_eq!(
                x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "mix n={n}"
            );
            // Straight from an f16 cache, rows scattered and out of order, for one to three
            // heads: the bits of the f32 kernels on the converted rows, and of the twins.
            let cache: Vec<half::f16> = (0..12 * n + 5)
                .map(|_| half::f16::from_f32(rng.gen_range(-1.0..1.0)))
                .collect();
            for g in 1..=F16_HEADS {
                let qs: Vec<f32> = (0..g * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
                // 1 to 4 keys for dot4; mix also past its prefetch distance.
                for m in [1, 2, 3, 4, 2 * PREFETCH_ROWS + 3] {
                    let offs: Vec<usize> = (0..m).map(|j| ((j * 5 + 3) % 12) * n + j % 5).collect();
                    let m4 = m.min(4);
                    let mut keys = gather_f16(&cache, &offs[..m4], n);
                    keys.resize(8 * n, 0.0);
                    let (mut a, mut c) = ([[0f32; 4]; F16_HEADS], [[0f32; 4]; F16_HEADS]);
                    (k.dot4_f16)(&qs, g, &cache, &offs[..m4], &mut a);
                    dot4_f16_scalar(&qs, g, &cache, &offs[..m4], &mut c);
                    for h in 0..g {
                        let mut b = [0f32; 8];
                        dot8_scalar(&qs[h * n..(h + 1) * n], &keys, &mut b);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&a[h][..m4]),
                            bits(&b[..m4]),
                            "dot4_f16 n={n} g={g} m={m}"
                        );
                        assert_eq!(
                            bits(&a[h][..m4]),
                            bits(&c[h][..m4]),
                            "twin n={n} g={g} m={m}"
                        );
                    }
                    let ps: Vec<f32> = (0..g * m).map(|_| rng.gen_range(0.0..1.0)).collect();
                    let acc0: Vec<f32> = (0..g * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let (mut x, mut z) = (acc0.clone(), acc0.clone());
                    (k.mix_f16)(&ps, g, &cache, &offs, &mut x);
                    mix_f16_scalar(&ps, g, &cache, &offs, &mut z);
                    let vals = gather_f16(&cache, &offs, n);
                    for h in 0..g {
                        let mut y = acc0[h * n..(h + 1) * n].to_vec();
                        mix_scalar(&ps[h * m..(h + 1) * m], &vals, &mut y);
                        let got = &x[h * n..(h + 1) * n];
                        assert!(
                            got.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "mix_f16 n={n} g={g} m={m}"
                        );
                    }
                    assert!(
                        x.iter().zip(&z).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "mix_f16 twin n={n} g={g} m={m}"
                    );
                }
            }
        }
        for n in [1, 7, 8, 9, 64, 77, 512] {
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-30.0..30.0)).collect();
            let (mut a, mut b) = (x.clone(), x.clone());
            (k.softmax)(&mut a, 0.125);
            softmax_scalar(&mut b, 0.125);
            assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "softmax n={n}"
            );
            let m = x
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64 * 0.125));
            let e: Vec<f64> = x.iter().map(|&v| (v as f64 * 0.125 - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (j, (&got, want)) in a.iter().zip(&e).enumerate() {
                let want = want / sum;
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * want + 1e-30,
                    "softmax n={n} j={j}"
                );
            }
        }
        // The polynomial against f64 between the clamps, and tiny (never 0 or NaN) below.
        for i in -20_000..=17_600 {
            let x = i as f32 * 0.005;
            let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
            if x >= EXP_MIN {
                assert!(
                    (got - want).abs() <= 3e-7 * want,
                    "exp_f32({x}) = {got}, want {want}"
                );
            } else {
                assert!(got > 0.0 && got < 1.7e-38, "exp_f32({x}) = {got}");
            }
        }
        assert_eq!(exp_f32(f32::NAN).to_bits(), exp_f32(EXP_MIN).to_bits());
        for n in [1, 8, 13, 1536] {
            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-20.0..20.0)).collect();
            let u: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            silu_mul(&g, &u, &mut a);
            silu_mul_scalar(&g, &u, &mut b);
            assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "silu n={n}"
            );
            for i in 0..n {
                let want = g[i] as f64 / (1.0 + (-g[i] as f64).exp()) * u[i] as f64;
                assert!(
                    (a[i] as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30,
                    "silu({})",
                    g[i]
                );
            }
        }
        for n in [1, 8, 13, 640] {
            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-12.0..12.0)).collect();
            let u: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            gelu_tanh_mul(&g, &u, &mut a);
            gelu_tanh_mul_scalar(&g, &u, &mut b);
            assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "gelu n={n}"
            );
            for i in 0..n {
                // PyTorch's formula, in f64. Far in the negative tail (GELU below 1e-9) the
                // f32 cube and exponent leave ~1e-5 relative error on a vanishing value: the
                // absolute floor covers it.
                let x = g[i] as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                let want = 0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh()) * u[i] as f64;
                assert!(
                    (a[i] as f64 - want).abs() <= 2e-6 * want.abs() + 1e-9 * (u[i] as f64).abs(),
                    "gelu({x}) · {} = {}, want {want}",
                    u[i],
                    a[i]
                );
            }
        }
        let h: Vec<half::f16> = (0..37)
            .map(|i| half::f16::from_f32(i as f32 * 0.37 - 5.0))
            .collect();
        let mut f = vec![0f32; 37];
        f16_to_f32(&h, &mut f);
        assert!(f.iter().zip(&h).all(|(a, b)| *a == b.to_f32()));
    }

    #[test]
    fn simd_dot_equals_scalar_twin_and_f64_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for n in [0, 1, 7, 31, 32, 33, 64, 100, 576, 1536, 4099] {
            let a: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let scalar = dot_f32_scalar(&a, &b);
            let fast = dot_f32(&a, &b);
            assert_eq!(
                scalar.to_bits(),
                fast.to_bits(),
                "n={n}: {scalar} vs {fast}"
            );
            assert!(
                (scalar as f64 - exact).abs() <= 1e-5 * (n as f64).sqrt().max(1.0),
                "n={n}"
            );
        }
    }

    /// Three tokens against one row give `dot_f32`'s bits per token, as does the scalar twin.
    #[test]
    fn three_token_dot_equals_dot_per_token_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for n in [0, 1, 7, 31, 32, 33, 64, 100, 576, 1536, 4099] {
            let w: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let xs: Vec<Vec<f32>> = (0..3)
                .map(|t| {
                    (0..n)
                        .map(|_| rng.gen_range(-1.0..1.0) * [0.01, 1.0, 100.0][t])
                        .collect()
                })
                .collect();
            let x = [&xs[0][..], &xs[1][..], &xs[2][..]];
            let (fast, scalar) = (dot_f32_x3(&w, x), dot_f32_x3_scalar(&w, x));
            for t in 0..3 {
                let want = dot_f32(x[t], &w);
                assert_eq!(fast[t].to_bits(), want.to_bits(), "n={n} token {t}");
                assert_eq!(
                    scalar[t].to_bits(),
                    want.to_bits(),
                    "n={n} token {t} (scalar)"
                );
            }
        }
    }

    /// Rows taken a stretch at a time through the carried kernel (and its scalar twin), then
    /// their tails through `dot_f32_4x3_finish`, give `dot_f32`'s bits per (row, token) pair,
    /// whatever the stretches (multiples of 32) and tails.
    #[test]
    fn carried_dots_equal_dot_per_pair_bit_for_bit() {
        fn part<const N: usize>(v: [&[f32]; N], a: usize, b: usize) -> [&[f32]; N] {
            v.map(|r| &r[a..b])
        }
        let xpart = part::<3>;
        let mut rng = rand::rngs::StdRng::seed_from_u64(10);
        for (n, stretch) in [
            (0, 32),
            (31, 32),
            (32, 32),
            (100, 32),
            (1536, 64),
            (4099, 1024),
            (3000, 96),
        ] {
            let rows: Vec<Vec<f32>> = (0..7)
                .map(|i| {
                    let s = [0.01, 1.0, 100.0, 1.0, 3.0, 0.5, 7.0][i];
                    (0..n).map(|_| rng.gen_range(-1.0..1.0) * s).collect()
                })
                .collect();
            let w = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
            let x = [&rows[4][..], &rows[5][..], &rows[6][..]];
            let main = n - n % 32;
            let (mut fast, mut scalar) = (F32Carry::default(), F32Carry::default());
            for a in (0..main).step_by(stretch) {
                let b = (a + stretch).min(main);
                dot_f32_carry(part(w, a, b), xpart(x, a, b), &mut fast);
                dot_f32_carry_scalar(part(w, a, b), xpart(x, a, b), &mut scalar);
            }
            let (tw, tx) = (part(w, main, n), xpart(x, main, n));
            let (fast, scalar) = (
                dot_f32_finish(&fast, tw, tx),
                dot_f32_finish(&scalar, tw, tx),
            );
            // The matmul's shape: six rows (the four, then two again) over four tokens.
            let w6 = [w[0], w[1], w[2], w[3], w[1], w[0]];
            let x4 = [x[0], x[1], x[2], x[1]];
            let mut wide = F32Carry::<6, 4>::default();
            for a in (0..main).step_by(stretch) {
                let b = (a + stretch).min(main);
                dot_f32_carry(part(w6, a, b), part(x4, a, b), &mut wide);
            }
            let wide = dot_f32_finish(&wide, part(w6, main, n), part(x4, main, n));
            for (r, wr) in w6.iter().enumerate() {
                for (t, xt) in x4.iter().enumerate() {
                    let want = dot_f32(xt, wr).to_bits();
                    assert_eq!(wide[r][t].to_bits(), want, "n={n} 6x4 ({r}, {t})");
                }
            }
            for r in 0..4 {
                for t in 0..3 {
                    let want = dot_f32(x[t], w[r]).to_bits();
                    assert_eq!(fast[r][t].to_bits(), want, "n={n} ({r}, {t})");
                    assert_eq!(scalar[r][t].to_bits(), want, "n={n} ({r}, {t}) scalar");
                    let twin = dot_f32_scalar(x[t], w[r]).to_bits();
                    assert_eq!(twin, want, "n={n} ({r}, {t}) dot_f32's twin");
                }
            }
        }
    }

    /// The fused f16/bf16 dot gives the bits of converting the row and taking `dot_f32`, as
    /// does its scalar twin, for every length shape (main loop, tail) and finite values of
    /// every exponent range, subnormals included.
    #[test]
    fn half_row_dot_equals_convert_then_dot_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for n in [0, 1, 7, 31, 32, 33, 64, 100, 576, 1536, 4099] {
            let a: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            // Random bit patterns below the all-ones exponent: every finite value.
            let f16: Vec<half::f16> = (0..n)
                .map(|_| {
                    half::f16::from_bits(rng.gen_range(0..0x7c00u16) | rng.gen::<u16>() & 0x8000)
                })
                .collect();
            let bf16: Vec<u16> = (0..n)
                .map(|_| rng.gen_range(0..0x7f80u16) | rng.gen::<u16>() & 0x8000)
                .collect();
            for row in [HalfRow::F16(&f16), HalfRow::Bf16(&bf16)] {
                let mut conv = vec![0f32; n];
                row.to_f32(&mut conv);
                let want = dot_f32(&a, &conv);
                let fused = dot_half(&a, row);
                let scalar = dot_half_scalar(&a, row);
                assert_eq!(fused.to_bits(), want.to_bits(), "n={n}: {fused} vs {want}");
                assert_eq!(
                    scalar.to_bits(),
                    want.to_bits(),
                    "n={n}: scalar {scalar} vs {want}"
                );
            }
        }
    }

    /// Every instance of the f32 dots this CPU runs (AVX2, and the 512-bit ones whatever
    /// `FERRUM_WIDE` says) gives the scalar twins' bits: one token, three, four rows by three,
    /// and rows of f16 and bf16 converted as they are read. A CPU without one says so.
    #[test]
    fn every_f32_dot_instance_equals_scalar_twin() {
        #[cfg(target_arch = "x86_64")]
        {
            let has_avx2 = super::super::quant::has_avx2();
            let has_512 = has_avx2 && is_x86_feature_detected!("avx512f");
            if !has_avx2 {
                eprintln!("no AVX2/FMA/F16C here: only the scalar twins ran");
                return;
            }
            if !has_512 {
                eprintln!("no AVX-512F here: the 512-bit f32 dots were not checked");
            }
            let mut rng = rand::rngs::StdRng::seed_from_u64(11);
            for n in [0, 1, 7, 31, 32, 33, 64, 100, 576, 1536, 4099] {
                let mut v = |s: f32| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-s..s)).collect() };
                let ws = [v(1.0), v(0.5), v(2.0), v(1.0)];
                let xs = [v(0.01), v(1.0), v(100.0)];
                let w = [&ws[0][..], &ws[1][..], &ws[2][..], &ws[3][..]];
                let x = [&xs[0][..], &xs[1][..], &xs[2][..]];
                let want = dot_f32_4x3_scalar(w, x);
                let f16: Vec<half::f16> = ws[0].iter().map(|&f| half::f16::from_f32(f)).collect();
                let bf16: Vec<u16> = ws[1]
                    .iter()
                    .map(|&f| half::bf16::from_f32(f).to_bits())
                    .collect();
                let (mut f16f, mut bf16f) = (vec![0f32; n], vec![0f32; n]);
                HalfRow::F16(&f16).to_f32(&mut f16f);
                HalfRow::Bf16(&bf16).to_f32(&mut bf16f);
                let (hw, bw) = (dot_f32_scalar(x[1], &f16f), dot_f32_scalar(x[1], &bf16f));
                let same = |a: f32, b: f32, what: &str| {
                    assert_eq!(a.to_bits(), b.to_bits(), "n={n} {what}: {a} vs {b}")
                };
                // SAFETY: AVX2/FMA/F16C (and AVX-512F for the second) detected above.
                unsafe {
                    same(avx2::dot_f32(x[0], w[0]), want[0][0], "avx2 dot_f32");
                    let three = avx2::dot_f32_x3(w[2], x);
                    (0..3).for_each(|t| same(three[t], want[2][t], "avx2 dot_f32_x3"));
                    let p16 = f16.as_ptr() as *const u16;
                    same(
                        avx2::dot_half::<false>(x[1], p16, n),
                        hw,
                        "avx2 dot_half f16",
                    );
                    same(
                        avx2::dot_half::<true>(x[1], bf16.as_ptr(), n),
                        bw,
                        "avx2 dot_half bf16",
                    );
                    if has_512 {
                        same(avx512::dot_f32(x[0], w[0]), want[0][0], "avx512 dot_f32");
                        let three = avx512::dot_f32_x3(w[2], x);
                        (0..3).for_each(|t| same(three[t], want[2][t], "avx512 dot_f32_x3"));
                        let all = avx512::dot_f32_4x3(w, x);
                        for r in 0..4 {
                            (0..3).for_each(|t| same(all[r][t], want[r][t], "avx512 dot_f32_4x3"));
                        }
                        same(
                            avx512::dot_half::<false>(x[1], p16, n),
                            hw,
                            "avx512 dot_half f16",
                        );
                        let b = avx512::dot_half::<true>(x[1], bf16.as_ptr(), n);
                        same(b, bw, "avx512 dot_half bf16");
                    }
                }
            }
        }
    }

    /// The emulated carry (the scalar chain carried over stretches of whole 32-value chunks,
    /// `FERRUM_BF16=emulate`'s path for long rows) gives the bits of one scalar dot over the
    /// whole row: it runs on every CPU.
    #[test]
    fn scalar_bf16_carry_equals_one_scalar_dot() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for n in [1usize, 32, 33, 100, 2049] {
            let row = |rng: &mut rand::rngs::StdRng| -> Vec<u16> {
                let f: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let mut b = vec![0u16; n];
                f32_to_bf16_rne_scalar(&f, &mut b);
                b
            };
            let (w, x) = (row(&mut rng), row(&mut rng));
            let mut acc = [0f32; 16];
            for c0 in (0..n).step_by(64) {
                let c1 = (c0 + 64).min(n);
                bf16_chain_scalar(&x[c0..c1], &w[c0..c1], &mut acc);
            }
            assert_eq!(
                sum16(&acc).to_bits(),
                dot_bf16_scalar(&x, &w).to_bits(),
                "{n}"
            );
        }
    }

    /// The `vdpbf16ps` kernels give their scalar twin's bits (one row, and four rows by three
    /// tokens, at lengths with and without a short last chunk, values from 1e-15 to 1e15 of
    /// either sign, bf16 subnormals included), and the conversion to bf16 rounds as its twin
    /// (ties, subnormals, NaN, the largest finite values). A CPU without AVX512-BF16 says so.
    #[test]
    fn bf16_kernels_equal_scalar_twin() {
        if !bf16_dot_runs() {
            eprintln!("no AVX512-BF16 here: the vdpbf16ps kernels were not checked");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let mut specials: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0e-40,
            -3.0e-39,
            f32::MIN_POSITIVE,
            f32::MAX,
            -f32::MAX,
            f32::NAN,
            f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
            f32::from_bits(0x7f7f_ffff),
        ];
        specials.extend((0..1000).map(|_| f32::from_bits(rng.gen())));
        let (mut hw, mut sw) = (vec![0u16; specials.len()], vec![0u16; specials.len()]);
        f32_to_bf16_rne(&specials, &mut hw);
        f32_to_bf16_rne_scalar(&specials, &mut sw);
        for ((x, h), s) in specials.iter().zip(&hw).zip(&sw) {
            let nan = |b: u16| b & 0x7fff > 0x7f80;
            assert!(
                h == s || (nan(*h) && nan(*s)),
                "{x:e}: {h:#06x} vs twin {s:#06x}"
            );
        }
        // Products stay finite (at overflow the instruction's infinities need not follow the
        // twin's order of additions); some values are bf16 subnormals.
        let val = |rng: &mut rand::rngs::StdRng| -> f32 {
            if rng.gen_ratio(1, 50) {
                return rng.gen_range(-1.0e-39..1.0e-39);
            }
            let e = rng.gen_range(-15.0f32..15.0);
            let v = 10f32.powf(e) * rng.gen_range(0.5..1.0);
            if rng.gen() {
                v
            } else {
                -v
            }
        };
        for n in [1usize, 31, 32, 33, 64, 100, 576, 2048, 2049] {
            for scale_mix in [false, true] {
                let row = |rng: &mut rand::rngs::StdRng| -> Vec<u16> {
                    let f: Vec<f32> = (0..n)
                        .map(|_| {
                            if scale_mix {
                                val(rng)
                            } else {
                                rng.gen_range(-2.0..2.0)
                            }
                        })
                        .collect();
                    let mut b = vec![0u16; n];
                    f32_to_bf16_rne_scalar(&f, &mut b);
                    b
                };
                let ws: Vec<Vec<u16>> = (0..4).map(|_| row(&mut rng)).collect();
                let xs: Vec<Vec<u16>> = (0..3).map(|_| row(&mut rng)).collect();
                let w = [&ws[0][..], &ws[1][..], &ws[2][..], &ws[3][..]];
                let x = [&xs[0][..], &xs[1][..], &xs[2][..]];
                let tile = dot_bf16_rx3(w, x);
                let w8 = [w[0], w[1], w[2], w[3], w[3], w[2], w[1], w[0]];
                let tile8 = dot_bf16_rx3(w8, x);
                let rows8: Vec<[f32; 8]> = x.iter().map(|x| dot_bf16_rx1(w8, x)).collect();
                // The same in stretches of 64 values, the sums carried.
                let mut carry = BfCarry::<8, 3>::default();
                for c0 in (0..n).step_by(64) {
                    let c1 = (c0 + 64).min(n);
                    dot_bf16_carry(w8.map(|w| &w[c0..c1]), x.map(|x| &x[c0..c1]), &mut carry);
                }
                let carried = carry.finish();
                for r in 0..4 {
                    for t in 0..3 {
                        let (one, twin) =
                            (dot_bf16_rx1([w[r]], x[t])[0], dot_bf16_scalar(x[t], w[r]));
                        let same =
                            |a: f32, b: f32| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan();
                        assert!(
                            same(one, twin),
                            "n={n} row {r} token {t}: {one:e} vs twin {twin:e}"
                        );
                        assert!(same(tile[r][t], twin), "n={n} 4x3 row {r} token {t}");
                        assert!(same(tile8[r][t], twin), "n={n} 8x3 row {r} token {t}");
                        assert!(
                            same(tile8[7 - r][t], twin),
                            "n={n} 8x3 row {} token {t}",
                            7 - r
                        );
                        assert!(same(rows8[t][r], twin), "n={n} 8x1 row {r} token {t}");
                        assert!(same(carried[r][t], twin), "n={n} carried row {r} token {t}");
                    }
                }
            }
        }
    }
}
