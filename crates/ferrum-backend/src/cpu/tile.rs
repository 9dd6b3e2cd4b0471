//! Register tiles over a panel: `c[r][x] (+)= Σ_i a[r][i] · panel[i][x]` for six rows `a`
//! and a panel of [`PANEL`] columns laid out `[i][PANEL]`, the sums held in vector registers
//! across `x`. They serve the many-token products that need not share a decode's bits: an
//! encoder's float matmuls ([`gemm`]: a vision tower's thousands of patches) and its
//! attention's scores (`span_attn`).
//!
//! Every sum is one fused multiply-add chain over `i`, in order; lanes run across `x`, never
//! across a sum. So the vectors' width changes no bit: the AVX-512, AVX2 and scalar instances
//! agree exactly (tested), and a sum cut into blocks of `i` (continued from its stored value)
//! is the same chain.

use super::{pool::ThreadPool, SharedMut};
use std::cell::RefCell;

/// Columns of a panel: one tile of four 512-bit vectors, or four of two 256-bit ones.
pub(crate) const PANEL: usize = 64;
/// Rows of a tile.
pub(crate) const MS: usize = 6;

/// One instruction set's vectors of f32.
pub(crate) trait Lanes: Copy {
    /// Lanes a vector holds.
    const N: usize;
    /// # Safety
    /// The instruction set is the CPU's.
    unsafe fn zero() -> Self;
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn splat(x: f32) -> Self;
    /// # Safety
    /// `p..p + N` is readable, and as [`Lanes::zero`].
    unsafe fn load(p: *const f32) -> Self;
    /// # Safety
    /// `p..p + N` is writable, and as [`Lanes::zero`].
    unsafe fn store(self, p: *mut f32);
    /// `a · b + c`, rounded once.
    ///
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
}

/// The scalar twin: eight lanes of `f32::mul_add`.
#[derive(Clone, Copy)]
pub(crate) struct Scalar([f32; 8]);

impl Lanes for Scalar {
    const N: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Scalar([0.0; 8])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Scalar([x; 8])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Scalar(std::ptr::read_unaligned(p as *const [f32; 8]))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        std::ptr::write_unaligned(p as *mut [f32; 8], self.0)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Scalar(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::Lanes;
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub struct Ymm(__m256);

    impl Lanes for Ymm {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Ymm(_mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Ymm(_mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Ymm(_mm256_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Ymm(_mm256_fmadd_ps(a.0, b.0, c.0))
        }
    }

    #[derive(Clone, Copy)]
    pub struct Zmm(__m512);

    impl Lanes for Zmm {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Zmm(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Zmm(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Zmm(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Zmm(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
    }
}

/// Which instance of the tiles runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F (and FMA).
    Zmm,
    /// AVX2 and FMA.
    Ymm,
    Scalar,
}

impl Isa {
    /// The widest instance this CPU runs (`FERRUM_WIDE=0` keeps to AVX2, as for the matmuls).
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if super::simd::zmm_f32() {
                return Isa::Zmm;
            }
            if super::quant::has_avx2() {
                return Isa::Ymm;
            }
        }
        Isa::Scalar
    }

    /// Whether this CPU runs the instance.
    pub(crate) fn runs(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Ymm => super::quant::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Isa::Zmm => super::quant::has_avx2() && is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// `MR` rows × `NR` vectors of columns: `c[r][x] = (c[r][x] if accumulate) + Σ_{i<k}
/// a[r][i] · panel[i·stride + x]`. `panel` and `c[r]` point at the tile's first column
/// (`stride` is [`PANEL`] for a panel; the attention's outputs take its values' rows).
/// No closure in here calls `V`'s methods: a closure does not take the instruction set of the
/// function it is inlined into, so they would stay calls.
///
/// # Safety
/// `V`'s instruction set is the CPU's; `a[r][..k]`, `panel[..k·stride]` (from the tile's
/// column) and `c[r][..NR·N]` are valid, and no one else touches `c`'s meanwhile.
#[inline(always)]
pub(crate) unsafe fn panel_tile<V: Lanes, const MR: usize, const NR: usize>(
    a: &[*const f32; MR],
    (panel, stride): (*const f32, usize),
    k: usize,
    c: &[*mut f32; MR],
    accumulate: bool,
) {
    let mut acc = [[V::zero(); NR]; MR];
    if accumulate {
        for (acc, &c) in acc.iter_mut().zip(c) {
            for (x, v) in acc.iter_mut().enumerate() {
                *v = V::load(c.add(x * V::N));
            }
        }
    }
    for i in 0..k {
        let prow = panel.add(i * stride);
        let mut p = [V::zero(); NR];
        for (x, p) in p.iter_mut().enumerate() {
            *p = V::load(prow.add(x * V::N));
        }
        for r in 0..MR {
            let b = V::splat(*a[r].add(i));
            for x in 0..NR {
                acc[r][x] = V::fma(b, p[x], acc[r][x]);
            }
        }
    }
    for (acc, &c) in acc.iter().zip(c) {
        for (x, v) in acc.iter().enumerate() {
            v.store(c.add(x * V::N));
        }
    }
}

/// The tiles of one panel: rows `a[r]` against columns `0..PANEL`, `NR · N` at a time.
///
/// # Safety
/// As [`panel_tile`], for every column of the panel.
#[inline(always)]
pub(crate) unsafe fn panel_row<V: Lanes, const NR: usize>(
    a: &[*const f32; MS],
    panel: *const f32,
    k: usize,
    c: &[*mut f32; MS],
    accumulate: bool,
) {
    let mut x0 = 0;
    while x0 < PANEL {
        let cx: [*mut f32; MS] = [
            c[0].add(x0),
            c[1].add(x0),
            c[2].add(x0),
            c[3].add(x0),
            c[4].add(x0),
            c[5].add(x0),
        ];
        panel_tile::<V, MS, NR>(a, (panel.add(x0), PANEL), k, &cx, accumulate);
        x0 += NR * V::N;
    }
}

/// Inputs of a [`gemm`] taken a block at a time: a panel's block of this many `i` (128 KiB)
/// stays in L2 while every row of a stretch passes over it.
const KC: usize = 512;
/// Rows of `x` a stretch holds: their sums for one panel (24 KiB) stay in L1.
const STRETCH: usize = 96;

thread_local! {
    /// A task's panel of weight rows (`k × PANEL`), a row being converted, and a stretch's
    /// sums.
    static GEMM: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// `out[t][j] = Σ_i x[t][i] · w[j][i] (+ bias[j])` for `n` rows `x[t]` (`xs[x0 + t·step..]`,
/// `k` long) and `m` weight rows, which `row(j, dst)` writes as f32 into `dst` (`k` long).
/// `out[t][j]` is element `ov0 + t·ostride + j` of `out`. A task takes [`PANEL`] weight rows,
/// converted and laid out `[i][PANEL]` once, and passes every row of `x` over them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    pool: &ThreadPool,
    isa: Isa,
    (xs, x0, step): (&[f32], usize, usize),
    n: usize,
    k: usize,
    m: usize,
    row: &(dyn Fn(usize, &mut [f32]) + Sync),
    bias: Option<&[f32]>,
    out: SharedMut,
    (ov0, ostride): (usize, usize),
) {
    assert!(isa.runs(), "gemm: {isa:?} does not run on this CPU");
    if n == 0 || m == 0 {
        return;
    }
    assert!(xs.len() >= x0 + (n - 1) * step + k, "gemm: x is short");
    assert!(bias.is_none_or(|b| b.len() >= m), "gemm: bias is short");
    let panels = m.div_ceil(PANEL);
    pool.run(panels, &|p| {
        GEMM.with(|g| {
            let (panel, conv, sums) = &mut *g.borrow_mut();
            panel.clear();
            panel.resize(k * PANEL, 0.0);
            conv.resize(k, 0.0);
            sums.resize(STRETCH * PANEL, 0.0);
            let cols = (m - p * PANEL).min(PANEL);
            for jj in 0..cols {
                row(p * PANEL + jj, conv);
                for (i, &v) in conv.iter().enumerate() {
                    panel[i * PANEL + jj] = v;
                }
            }
            let mut job = GemmJob {
                x: (xs, x0, step),
                k,
                panel,
                sums,
            };
            let mut s0 = 0;
            while s0 < n {
                let s1 = (s0 + STRETCH).min(n);
                // SAFETY: the instance runs here (asserted above); the buffers are this
                // task's.
                unsafe {
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Zmm => stretch_zmm(&mut job, s0..s1),
                        #[cfg(target_arch = "x86_64")]
                        Isa::Ymm => stretch_ymm(&mut job, s0..s1),
                        _ => stretch::<Scalar, 2>(&mut job, s0..s1),
                    }
                }
                for t in s0..s1 {
                    let sum = &job.sums[(t - s0) * PANEL..][..cols];
                    let at = ov0 + t * ostride + p * PANEL;
                    for (jj, &v) in sum.iter().enumerate() {
                        let b = bias.map_or(0.0, |b| b[p * PANEL + jj]);
                        // SAFETY: in bounds (the caller's view); these columns are this
                        // task's.
                        unsafe { out.write(at + jj, v + b) };
                    }
                }
                s0 = s1;
            }
        })
    });
}

struct GemmJob<'a> {
    x: (&'a [f32], usize, usize),
    k: usize,
    panel: &'a [f32],
    sums: &'a mut [f32],
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn stretch_zmm(job: &mut GemmJob, rows: std::ops::Range<usize>) {
    stretch::<x86::Zmm, 4>(job, rows)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn stretch_ymm(job: &mut GemmJob, rows: std::ops::Range<usize>) {
    stretch::<x86::Ymm, 2>(job, rows)
}

/// Rows `rows` of `x` (at most [`STRETCH`]) against the job's panel, block by block of `KC`
/// inputs, into `sums`.
///
/// # Safety
/// `V`'s instruction set is the CPU's.
#[inline(always)]
unsafe fn stretch<V: Lanes, const NR: usize>(job: &mut GemmJob, rows: std::ops::Range<usize>) {
    let (xs, x0, step) = job.x;
    let last = rows.end - 1;
    let sums = job.sums.as_mut_ptr();
    let mut kb = 0;
    while kb < job.k {
        let kc = (job.k - kb).min(KC);
        let panel = job.panel.as_ptr().add(kb * PANEL);
        let mut g = rows.start;
        while g < rows.end {
            // Rows past the stretch repeat its last one (a tile is always whole); their
            // sums land in rows of `sums` that are never read.
            let mut a = [std::ptr::null::<f32>(); MS];
            let mut c = [std::ptr::null_mut::<f32>(); MS];
            for r in 0..MS {
                a[r] = xs.as_ptr().add(x0 + (g + r).min(last) * step + kb);
                c[r] = sums.add((g - rows.start + r) * PANEL);
            }
            panel_row::<V, NR>(&a, panel, kc, &c, kb > 0);
            g += MS;
        }
        kb += kc;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `n` values in `[-scale, scale)` from a seeded LCG.
    pub(crate) fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    /// Asserts that every wider instance this CPU runs gives `twin`'s bits (`run(Scalar)`).
    pub(crate) fn instances_equal_twin(twin: &[f32], run: impl Fn(Isa) -> Vec<f32>, what: &str) {
        for isa in [Isa::Ymm, Isa::Zmm] {
            if isa.runs() {
                let got = run(isa);
                assert!(
                    got.iter()
                        .zip(twin)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} differs from the scalar twin ({what})"
                );
            }
        }
    }

    /// Every instance this CPU runs gives the scalar twin's bits, and the twin is within f32
    /// rounding of the products in f64: over rows, weight rows and inputs off the tiles'
    /// multiples (a partial tile, panel, stretch and block of `KC`), strided rows, a bias,
    /// and output columns outside the product left alone.
    #[test]
    fn gemm_instances_equal_the_scalar_twin_and_f64() {
        let pool = ThreadPool::new(2);
        for &(n, k, m, bias) in &[
            (1, 3, 1, false),
            (7, 40, 70, true),
            (100, 1100, 65, true),
            (200, 64, 130, false),
        ] {
            let step = k + 5;
            let xs = random(3 + n * step, (n * 31 + k) as u64, 1.0);
            let w = random(m * k, (m * 17 + k) as u64, 1.0);
            let b = random(m, 9, 1.0);
            let ostride = m + 3;
            let run = |isa| {
                let mut out = vec![-7f32; n * ostride + 2];
                let row = |j: usize, dst: &mut [f32]| dst.copy_from_slice(&w[j * k..][..k]);
                gemm(
                    &pool,
                    isa,
                    (&xs, 3, step),
                    n,
                    k,
                    m,
                    &row,
                    bias.then_some(&b[..]),
                    SharedMut(out.as_mut_ptr()),
                    (2, ostride),
                );
                out
            };
            let twin = run(Isa::Scalar);
            for (i, &v) in twin.iter().enumerate() {
                let (t, j) = ((i.wrapping_sub(2)) / ostride, (i.wrapping_sub(2)) % ostride);
                if i < 2 || t >= n || j >= m {
                    assert_eq!(v, -7.0, "element {i} outside the product written");
                    continue;
                }
                let x = &xs[3 + t * step..][..k];
                let want: f64 = x
                    .iter()
                    .zip(&w[j * k..][..k])
                    .map(|(&a, &c)| a as f64 * c as f64)
                    .sum::<f64>()
                    + if bias { b[j] as f64 } else { 0.0 };
                assert!(
                    (v as f64 - want).abs() < 1e-5 * (k as f64).sqrt(),
                    "n {n} k {k} m {m} ({t}, {j}): {v} vs {want}"
                );
            }
            instances_equal_twin(&twin, run, &format!("n {n} k {k} m {m}"));
        }
    }
}
