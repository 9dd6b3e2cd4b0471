//! The codebook formats' prefill (IQ2, IQ3, IQ1, TQ, and Q2_K, Q3_K): weight rows decoded once into signed
//! bytes, then multiplied against sixteen tokens at a time, one token a lane.
//!
//! Decoding a codebook group (grid lookups, sign masks, scales) costs more than its products,
//! so a prefill decodes eight rows once ([`Rows`]: per value its magnitude times its sign as
//! i8, per 16-value half its integer scale) and runs every block of sixteen tokens against
//! them. The tokens are laid out once per matmul ([`Tokens`]): per four values of a
//! super-block, the sixteen tokens' bytes plus 128 side by side, unsigned, as `vpdpbusd` and
//! `maddubs` want their left operand. One broadcast weight word then meets sixteen tokens in
//! one instruction, and a half's scale is one multiply of a whole vector (llama.cpp's tiled
//! CPU kernels orient their tiles the same way).
//!
//! The 128 comes back out as one integer per row and super-block, 128 · Σ scale · Σ w, so
//! each (row, token) gets the row kernels' integer sum and their float step:
//! [`dot`] gives [`vec_dot`](super::iq_grid::vec_dot)'s bits in every instance.
//!
//! Two K-quants take the tile as codebooks: Q3_K, and Q2_K, whose per-half minimums come out
//! as the row kernel's `dmin · d_a · Σ min · bsum`, from the tokens' sixteen-value sums that
//! [`Tokens`] keeps beside their bytes. Their values, as IQ1's and the TQs', are small
//! ([`Codebook::SMALL`]), and for those the AVX2 kernel adds a half's products in i16 before
//! scaling them, which saves three of its eight multiply-unit instructions.

use super::iq_grid::{
    is_codebook, with_codebook, BlockIq2XxsRecoded, BlockIq3XxsRecoded, Codebook, SMALL_MAX,
};
use super::k_quants::QK_K;
use super::q8::BlockQ8K;
use super::Recoded;
use ferrum_core::DType;

/// Weight rows a [`Rows`] holds.
pub const ROWS: usize = 8;
/// Tokens a [`Block`] holds.
pub const TOKENS: usize = 16;
/// Four-value words a super-block.
const WORDS: usize = QK_K / 4;
/// 16-value halves a super-block.
const HALVES: usize = QK_K / 16;

/// Up to [`ROWS`] weight rows of one codebook format, decoded.
#[derive(Default)]
pub struct Rows {
    /// `[row][block][256]`: magnitude · sign (|v| ≤ 127).
    w: Vec<i8>,
    /// `[row][block][16]`: each half's integer scale.
    scales: Vec<i32>,
    /// `[row][block]`: 128 · Σ_h scale_h · Σ_{v ∈ h} w_v, what the +128 of the tokens adds.
    bias: Vec<i32>,
    /// `[row][block]`: d · FACTOR, as the row kernels compute it.
    d: Vec<f32>,
    /// `[row][block][16]`: each half's integer minimum, for a format with minimums
    /// ([`Codebook::MINS`], Q2_K); else empty.
    mins: Vec<i16>,
    /// `[row][block]`: the minimums' scale `dmin` (else empty).
    dmin: Vec<f32>,
    /// Whether the format has minimums: then each (row, token) also takes off
    /// `dmin · d_a · Σ_h min_h · bsum_h` per super-block.
    minned: bool,
    /// Whether the format's values are within ±[`SMALL_MAX`] ([`Codebook::SMALL`]).
    small: bool,
    /// Super-blocks a row.
    blocks: usize,
    /// Rows given; the rest are zero.
    rows: usize,
    /// Whether both halves of every 32 values share their scale (IQ2_XXS, IQ3_XXS, IQ3_S,
    /// IQ1_S, the TQs): then one multiply serves 32 values.
    paired: bool,
}

impl Rows {
    /// Rows given to [`decode_rows`].
    pub fn len(&self) -> usize {
        self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    fn fill<B: Codebook>(&mut self, r: usize, w: &[B], simd: bool) -> bool {
        #[cfg(target_arch = "x86_64")]
        if simd && super::avx2_rows() {
            // SAFETY: AVX2, FMA and F16C detected.
            return unsafe { avx2::fill(self, r, w) };
        }
        let _ = simd;
        self.fill_scalar(r, w)
    }

    /// Where row `r`'s `blocks` super-blocks start, checked to fit every buffer (the SIMD
    /// fills write them unchecked).
    #[cfg(target_arch = "x86_64")]
    fn row_start(&self, r: usize, blocks: usize) -> usize {
        let at = r * self.blocks;
        assert!(
            self.w.len() >= (at + blocks) * QK_K && self.scales.len() >= (at + blocks) * HALVES
        );
        assert!(self.bias.len() >= at + blocks && self.d.len() >= at + blocks);
        at
    }

    /// Super-block `at`'s minimums from `b`, for a format that has them.
    fn put_mins<B: Codebook>(&mut self, at: usize, b: &B) {
        if B::MINS {
            let (dmin, mins) = b.mins();
            self.dmin[at] = half::f16::from_bits(dmin).to_f32();
            self.mins[at * HALVES..(at + 1) * HALVES].copy_from_slice(&mins);
        }
    }

    /// The portable twin of the AVX2 fill; whether the halves of every group share a scale.
    fn fill_scalar<B: Codebook>(&mut self, r: usize, w: &[B]) -> bool {
        let mut paired = true;
        for (i, b) in w.iter().enumerate() {
            let at = r * self.blocks + i;
            self.d[at] = b.d() * B::FACTOR;
            self.put_mins(at, b);
            let mut bias = 0i32;
            for ib in 0..QK_K / 32 {
                let g = b.group(ib);
                paired &= g.scales[0] == g.scales[1];
                for k in 0..4 {
                    let (m, sg) = (g.words[k].to_le_bytes(), g.signs[k].to_le_bytes());
                    for j in 0..8 {
                        let v = (m[j] as i8).wrapping_mul(sg[j] as i8);
                        // What lets the AVX2 kernel sum a half in i16.
                        assert!(!B::SMALL || (v as i32).abs() <= SMALL_MAX, "{v} too large");
                        self.w[at * QK_K + 32 * ib + 8 * k + j] = v;
                        bias = bias.wrapping_add(g.scales[k / 2].wrapping_mul(v as i32));
                    }
                }
                self.scales[at * HALVES + 2 * ib..at * HALVES + 2 * ib + 2]
                    .copy_from_slice(&g.scales);
            }
            self.bias[at] = bias.wrapping_mul(128);
        }
        paired
    }
}

/// The decoded rows and their scales, for the tests.
impl PartialEq for Rows {
    fn eq(&self, o: &Self) -> bool {
        let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (self.blocks, self.rows, self.paired, self.minned, self.small)
            == (o.blocks, o.rows, o.paired, o.minned, o.small)
            && self.w == o.w
            && self.scales == o.scales
            && self.bias == o.bias
            && self.mins == o.mins
            && bits(&self.d) == bits(&o.d)
            && bits(&self.dmin) == bits(&o.dmin)
    }
}

/// Whether [`decode_rows`] takes `dtype`.
pub fn takes(dtype: DType) -> bool {
    is_codebook(dtype)
}

/// Decodes up to [`ROWS`] rows (each whole super-blocks of `dtype`, all the same length) into
/// `out`, the rows past them zero; `false` for a format that is not a codebook format, or bytes
/// that are not whole, aligned blocks.
pub fn decode_rows(dtype: DType, rows: &[&[u8]], out: &mut Rows) -> bool {
    decode_rows_on(dtype, rows, out, true)
}

/// [`decode_rows`] on the portable twin of its SIMD decoding (for the tests: the same values).
pub fn decode_rows_scalar(dtype: DType, rows: &[&[u8]], out: &mut Rows) -> bool {
    decode_rows_on(dtype, rows, out, false)
}

/// [`decode_rows`] of rows re-encoded at load ([`Recoded`]): the rows of the file's form
/// decode to the same values.
pub fn decode_recoded_rows(form: Recoded, rows: &[&[u8]], out: &mut Rows) -> bool {
    decode_recoded_on(form, rows, out, true)
}

/// [`decode_recoded_rows`] on the portable twin of its SIMD decoding (for the tests).
pub fn decode_recoded_rows_scalar(form: Recoded, rows: &[&[u8]], out: &mut Rows) -> bool {
    decode_recoded_on(form, rows, out, false)
}

fn decode_recoded_on(form: Recoded, rows: &[&[u8]], out: &mut Rows, simd: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd && super::avx2_rows() {
        return match form {
            Recoded::Iq2Xxs => decode_blocks::<BlockIq2XxsRecoded>(rows, out, fill_sign_bytes),
            Recoded::Iq3Xxs => decode_blocks::<BlockIq3XxsRecoded>(rows, out, fill_sign_bytes),
        };
    }
    let _ = simd;
    match form {
        Recoded::Iq2Xxs => decode_blocks::<BlockIq2XxsRecoded>(rows, out, Rows::fill_scalar),
        Recoded::Iq3Xxs => decode_blocks::<BlockIq3XxsRecoded>(rows, out, Rows::fill_scalar),
    }
}

fn decode_rows_on(dtype: DType, rows: &[&[u8]], out: &mut Rows, simd: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd && super::avx2_rows() {
        use super::iq_grid as G;
        match dtype {
            DType::Iq2Xxs => return decode_blocks::<G::BlockIq2Xxs>(rows, out, fill_sign_bytes),
            DType::Iq2Xs => return decode_blocks::<G::BlockIq2Xs>(rows, out, fill_sign_bytes),
            DType::Iq2S => return decode_blocks::<G::BlockIq2S>(rows, out, fill_sign_bytes),
            DType::Iq3Xxs => return decode_blocks::<G::BlockIq3Xxs>(rows, out, fill_sign_bytes),
            DType::Iq3S => return decode_blocks::<G::BlockIq3S>(rows, out, fill_sign_bytes),
            DType::Q3K => {
                // SAFETY: AVX2, FMA and F16C detected (`avx2_rows`).
                let fill = |o: &mut Rows, r, w: &[G::BlockQ3K]| unsafe { avx2::fill_q3k(o, r, w) };
                return decode_blocks::<G::BlockQ3K>(rows, out, fill);
            }
            DType::Q2K => {
                // SAFETY: as above.
                let fill = |o: &mut Rows, r, w: &[G::BlockQ2K]| unsafe { avx2::fill_q2k(o, r, w) };
                return decode_blocks::<G::BlockQ2K>(rows, out, fill);
            }
            _ => {}
        }
    }
    with_codebook!(
        dtype,
        B => decode_blocks::<B>(rows, out, |o: &mut Rows, r, w: &[B]| o.fill(r, w, simd)),
        _ => false
    )
}

/// [`avx2::fill_sign_bytes`], for a CPU checked to run it.
#[cfg(target_arch = "x86_64")]
fn fill_sign_bytes<B: super::iq_grid::avx2::SignBytes>(out: &mut Rows, r: usize, w: &[B]) -> bool {
    assert!(super::has_avx2(), "the AVX2 decoding on a CPU without AVX2");
    // SAFETY: AVX2, FMA and F16C checked above.
    unsafe { avx2::fill_sign_bytes(out, r, w) }
}

/// Decodes `rows` of blocks `B` into `out` by `fill` (a row's blocks into row r of `out`;
/// whether its halves share their scales).
fn decode_blocks<B: Codebook>(
    rows: &[&[u8]],
    out: &mut Rows,
    fill: impl Fn(&mut Rows, usize, &[B]) -> bool,
) -> bool {
    let Some(first) = rows.first() else {
        return false;
    };
    let blocks = first.len() / std::mem::size_of::<B>();
    if rows.len() > ROWS || rows.iter().any(|r| r.len() != first.len()) {
        return false;
    }
    out.blocks = blocks;
    out.rows = rows.len();
    out.w.clear();
    out.w.resize(ROWS * blocks * QK_K, 0);
    out.scales.clear();
    out.scales.resize(ROWS * blocks * HALVES, 0);
    out.bias.clear();
    out.bias.resize(ROWS * blocks, 0);
    out.d.clear();
    out.d.resize(ROWS * blocks, 0.0);
    (out.minned, out.small) = (B::MINS, B::SMALL);
    let minned = if B::MINS { ROWS * blocks } else { 0 };
    out.mins.clear();
    out.mins.resize(minned * HALVES, 0);
    out.dmin.clear();
    out.dmin.resize(minned, 0.0);
    let mut paired = true;
    for (r, bytes) in rows.iter().enumerate() {
        match super::cast_blocks::<B>(bytes) {
            Some(w) if w.len() == blocks => paired &= fill(out, r, w),
            _ => return false,
        }
    }
    out.paired = paired;
    true
}

/// A matmul's tokens for [`dot`]: per block of [`TOKENS`] tokens and super-block, per four
/// values, the sixteen tokens' activations plus 128 (`[block][super-block][word][token][4]`),
/// the tokens' scales (`[block][super-block][token]`) and their sixteen-value sums, two
/// halves' side by side as `madd` takes them (`[block][super-block][pair][token][2]`, for
/// the formats with minimums). Tokens past the last have a zero scale.
#[derive(Default)]
pub struct Tokens {
    q: Vec<u8>,
    d: Vec<f32>,
    bs: Vec<i16>,
    /// Super-blocks a token.
    blocks: usize,
    n: usize,
}

/// One block of [`TOKENS`] tokens of a [`Tokens`].
#[derive(Clone, Copy)]
pub struct Block<'a> {
    q: &'a [u8],
    d: &'a [f32],
    bs: &'a [i16],
    blocks: usize,
}

/// A [`Tokens`] shared by a matmul's tasks: those that quantise its tokens write them
/// ([`TokensPtr::put`]), and the matmul's tasks read them once all are written
/// ([`TokensPtr::block`]).
#[derive(Clone, Copy)]
pub struct TokensPtr {
    q: *mut u8,
    d: *mut f32,
    bs: *mut i16,
    blocks: usize,
    n: usize,
}
// SAFETY: tasks write the disjoint bytes of their own tokens through it (`put`'s contract),
// while the `Tokens` it came from is exclusively borrowed by the matmul that made it.
unsafe impl Send for TokensPtr {}
unsafe impl Sync for TokensPtr {}

impl Tokens {
    /// Room for `n` tokens of `blocks` super-blocks, each to be written by [`put`](Self::put)
    /// (until then they hold whatever they held), and tokens of scale zero past them in the
    /// last block (their results are zero).
    pub fn reset(&mut self, n: usize, blocks: usize) {
        let padded = n.div_ceil(TOKENS) * TOKENS;
        // Not cleared first: `put` writes every byte of a token, and a prefill's matmuls would
        // otherwise spend a fill of the whole buffer each.
        self.q.resize(padded * blocks * QK_K, 128);
        self.d.resize(padded * blocks, 0.0);
        self.bs.resize(padded * blocks * HALVES, 0);
        (self.blocks, self.n) = (blocks, n);
        let (j, first) = (n / TOKENS, n % TOKENS);
        if first == 0 {
            return;
        }
        // A zero scale is enough: any bytes make a finite integer sum, which it turns to 0.
        for sb in j * blocks..(j + 1) * blocks {
            self.d[sb * TOKENS + first..(sb + 1) * TOKENS].fill(0.0);
        }
    }

    /// Token `t` (below `n`), from its Q8_K blocks.
    pub fn put(&mut self, t: usize, a: &[BlockQ8K]) {
        // SAFETY: `self` is exclusively borrowed, and `put` checks `t` and the length.
        unsafe { self.shared().put(t, a) }
    }

    /// A pointer for tasks that each write their own tokens.
    pub fn shared(&mut self) -> TokensPtr {
        TokensPtr {
            q: self.q.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            bs: self.bs.as_mut_ptr(),
            blocks: self.blocks,
            n: self.n,
        }
    }

    /// Blocks of [`TOKENS`] tokens.
    pub fn count(&self) -> usize {
        self.n.div_ceil(TOKENS)
    }

    /// Tokens `TOKENS · j ..` (the last block padded with zero tokens).
    pub fn block(&self, j: usize) -> Block<'_> {
        let (q, d) = (TOKENS * self.blocks * QK_K, TOKENS * self.blocks);
        Block {
            q: &self.q[j * q..(j + 1) * q],
            d: &self.d[j * d..(j + 1) * d],
            bs: &self.bs[j * d * HALVES..(j + 1) * d * HALVES],
            blocks: self.blocks,
        }
    }
}

impl TokensPtr {
    /// Blocks of [`TOKENS`] tokens.
    pub fn count(self) -> usize {
        self.n.div_ceil(TOKENS)
    }

    /// Tokens given to [`Tokens::reset`].
    pub fn tokens(self) -> usize {
        self.n
    }

    /// Tokens `TOKENS · j ..`, as [`Tokens::block`].
    ///
    /// # Safety
    /// `j < self.count()`; every write to the tokens is ordered before this call, none
    /// follows while the block lives, and the `Tokens` is neither moved nor resized meanwhile.
    pub unsafe fn block<'a>(self, j: usize) -> Block<'a> {
        assert!(j < self.count(), "token block out of range");
        let (q, d) = (TOKENS * self.blocks * QK_K, TOKENS * self.blocks);
        Block {
            q: std::slice::from_raw_parts(self.q.add(j * q), q),
            d: std::slice::from_raw_parts(self.d.add(j * d), d),
            bs: std::slice::from_raw_parts(self.bs.add(j * d * HALVES), d * HALVES),
            blocks: self.blocks,
        }
    }

    /// Writes token `t` from its Q8_K blocks.
    ///
    /// # Safety
    /// No other task writes token `t` meanwhile, nobody reads the `Tokens` until the writes are
    /// ordered before the read, and the `Tokens` is neither moved nor resized meanwhile.
    pub unsafe fn put(self, t: usize, a: &[BlockQ8K]) {
        assert!(t < self.n && a.len() >= self.blocks, "token out of range");
        let (j, lane) = (t / TOKENS, t % TOKENS);
        for (i, b) in a.iter().take(self.blocks).enumerate() {
            let sb = j * self.blocks + i;
            self.d.add(sb * TOKENS + lane).write(b.d);
            let bs = self.bs.add(sb * TOKENS * HALVES + 2 * lane);
            for (p, s) in b.bsums.chunks_exact(2).enumerate() {
                bs.add(p * 2 * TOKENS).write(s[0]);
                bs.add(p * 2 * TOKENS + 1).write(s[1]);
            }
            let base = self.q.add(sb * TOKENS * QK_K + 4 * lane);
            for (k, w) in b.qs.chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([w[0] as u8, w[1] as u8, w[2] as u8, w[3] as u8]);
                // The sign bit flipped: the activation plus 128, unsigned.
                (base.add(k * 4 * TOKENS) as *mut u32).write_unaligned(v ^ 0x8080_8080);
            }
        }
    }
}

/// The decoded rows against a block of tokens (each at least as many super-blocks as the
/// rows): `out[r][t]`, in the fastest kernel this CPU runs (all give the row kernels' bits).
/// `FERRUM_ISA` (`packed::Isa::best`) picks the instance as for the packed kernels.
pub fn dot(w: &Rows, a: Block) -> [[f32; TOKENS]; ROWS] {
    assert!(a.blocks >= w.blocks, "activation too short");
    #[cfg(target_arch = "x86_64")]
    {
        use super::packed::Isa;
        match Isa::best() {
            // SAFETY: the instance runs here (`Isa::available`): AVX512-F/BW/VNNI.
            Isa::Avx512Vnni | Isa::AvxVnni if Isa::Avx512Vnni.runs() => {
                return unsafe { avx512::dot(w, a) };
            }
            // SAFETY: the instance runs here: AVX2, FMA and F16C.
            Isa::Avx2 | Isa::AvxVnni | Isa::Avx512Vnni => return unsafe { avx2::dot(w, a) },
            Isa::Scalar => {}
        }
    }
    dot_scalar(w, a)
}

/// The portable twin of [`dot`]: per (row, token) and super-block the same integer sum,
/// then the row kernels' float step.
pub fn dot_scalar(w: &Rows, a: Block) -> [[f32; TOKENS]; ROWS] {
    assert!(a.blocks >= w.blocks, "activation too short");
    let nb = w.blocks;
    let mut out = [[0f32; TOKENS]; ROWS];
    for (r, out) in out.iter_mut().enumerate() {
        for (t, out) in out.iter_mut().enumerate() {
            for i in 0..nb {
                let at = r * nb + i;
                let mut isum = 0i32;
                for h in 0..HALVES {
                    let mut part = 0i32;
                    for v in 16 * h..16 * h + 16 {
                        let x = a.q[(i * WORDS + v / 4) * 4 * TOKENS + 4 * t + v % 4] as i32;
                        part = part.wrapping_add(w.w[at * QK_K + v] as i32 * x);
                    }
                    isum = isum.wrapping_add(w.scales[at * HALVES + h].wrapping_mul(part));
                }
                let isum = isum.wrapping_sub(w.bias[at]);
                let dt = a.d[i * TOKENS + t];
                let step = isum as f32 * (w.d[at] * dt);
                *out += if w.minned {
                    let summs: i32 = (0..HALVES)
                        .map(|h| {
                            let bs = a.bs[((i * HALVES / 2 + h / 2) * TOKENS + t) * 2 + h % 2];
                            w.mins[at * HALVES + h] as i32 * bs as i32
                        })
                        .sum();
                    // The row kernel's two products, then one subtraction.
                    step - summs as f32 * (w.dmin[at] * dt)
                } else {
                    step
                };
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`dot`](super::dot) on AVX-512: sixteen tokens a vector, per four values one `vpdpbusd`
    /// a row with the row's word broadcast; per 32 values (16 where the halves' scales
    /// differ) each row's sums times the scale, once a super-block the bias out and the
    /// scalar twin's float step per lane.
    ///
    /// # Safety
    /// The CPU supports AVX512-F, AVX512-BW and AVX512-VNNI.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dot(w: &Rows, a: Block) -> [[f32; TOKENS]; ROWS] {
        // Rows with minimums (Q2_K) take the AVX2 kernel: its minimum step is tested on every
        // x86 host, where an AVX-512 one would be only on AVX-512 hosts.
        if w.minned {
            return super::avx2::dot(w, a);
        }
        if w.paired {
            run::<8>(w, a)
        } else {
            run::<4>(w, a)
        }
    }

    /// `S` words (four values each) share a scale.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    unsafe fn run<const S: usize>(w: &Rows, a: Block) -> [[f32; TOKENS]; ROWS] {
        let nb = w.blocks;
        assert!(a.blocks >= nb && a.q.len() >= nb * TOKENS * QK_K && a.d.len() >= nb * TOKENS);
        assert!(w.w.len() >= ROWS * nb * QK_K && w.scales.len() >= ROWS * nb * HALVES);
        assert!(w.bias.len() >= ROWS * nb && w.d.len() >= ROWS * nb);
        let mut total = [_mm512_setzero_ps(); ROWS];
        for i in 0..nb {
            let q = a.q.as_ptr().add(i * TOKENS * QK_K);
            let rows: [*const i8; ROWS] =
                std::array::from_fn(|r| w.w.as_ptr().add((r * nb + i) * QK_K));
            let scales: [*const i32; ROWS] =
                std::array::from_fn(|r| w.scales.as_ptr().add((r * nb + i) * HALVES));
            let mut sum = [_mm512_setzero_si512(); ROWS];
            for s in 0..WORDS / S {
                let mut acc = [_mm512_setzero_si512(); ROWS];
                for k in S * s..S * s + S {
                    let x = _mm512_loadu_si512(q.add(64 * k) as *const __m512i);
                    for r in 0..ROWS {
                        let wv = (rows[r].add(4 * k) as *const i32).read_unaligned();
                        acc[r] = _mm512_dpbusd_epi32(acc[r], x, _mm512_set1_epi32(wv));
                    }
                }
                // Words `S·s..` are half `S·s / 4`'s (and, paired, the next's, the same scale).
                for r in 0..ROWS {
                    let sc = _mm512_set1_epi32(*scales[r].add(S * s / 4));
                    sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(acc[r], sc));
                }
            }
            let dt = _mm512_loadu_ps(a.d.as_ptr().add(i * TOKENS));
            for r in 0..ROWS {
                let at = r * nb + i;
                let isum = _mm512_sub_epi32(sum[r], _mm512_set1_epi32(*w.bias.get_unchecked(at)));
                let scale = _mm512_mul_ps(_mm512_set1_ps(*w.d.get_unchecked(at)), dt);
                let step = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), scale);
                total[r] = _mm512_add_ps(total[r], step);
            }
        }
        let mut out = [[0f32; TOKENS]; ROWS];
        for (o, t) in out.iter_mut().zip(&total) {
            _mm512_storeu_ps(o.as_mut_ptr(), *t);
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::iq_grid::avx2::{half_to_f32, hsum_i32, signed_values, SignBytes};
    use crate::cpu::quant::k_quants::{q3k_scales, BlockQ2K, BlockQ3K};
    use std::arch::x86_64::*;

    /// [`Rows`]' fill on AVX2: per group the magnitudes' signs applied (`sign_epi8`), and the
    /// bias's sums by `maddubs` against ones and `madd` against the halves' scales; the
    /// scalar twin's values.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fill<B: Codebook>(out: &mut Rows, r: usize, w: &[B]) -> bool {
        let at = out.row_start(r, w.len());
        let mut paired = true;
        let v4 =
            |v: [u64; 4]| _mm256_setr_epi64x(v[0] as i64, v[1] as i64, v[2] as i64, v[3] as i64);
        for (i, b) in w.iter().enumerate() {
            let sb = at + i;
            *out.d.get_unchecked_mut(sb) = half_to_f32(b.d_bits()) * B::FACTOR;
            out.put_mins(sb, b);
            let mut bias = _mm256_setzero_si256();
            for ib in 0..QK_K / 32 {
                let g = b.group(ib);
                paired &= g.scales[0] == g.scales[1];
                let v = _mm256_sign_epi8(v4(g.words), v4(g.signs));
                bias = _mm256_add_epi32(bias, put_group(out, sb, ib, v, g.scales));
            }
            *out.bias.get_unchecked_mut(sb) = hsum_i32(bias).wrapping_mul(128);
        }
        paired
    }

    /// Stores group `ib` of super-block `sb` (its 32 values and two half scales) and returns
    /// its part of the bias ([`half_sums`]): what every fill does per group once it has the
    /// values.
    ///
    /// # Safety
    /// The CPU supports AVX2; `sb` is inside `out` (`Rows::row_start` checked the row).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn put_group(
        out: &mut Rows,
        sb: usize,
        ib: usize,
        v: __m256i,
        scales: [i32; 2],
    ) -> __m256i {
        let p = out.w.as_mut_ptr().add(sb * QK_K + 32 * ib);
        _mm256_storeu_si256(p as *mut __m256i, v);
        let s = out.scales.as_mut_ptr().add(sb * HALVES + 2 * ib);
        *s = scales[0];
        *s.add(1) = scales[1];
        half_sums(v, scales)
    }

    /// A group's 32 values summed per 16-value half, each half's sum times its scale (in the
    /// eight i32 lanes): its part of [`Rows`]' bias.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn half_sums(v: __m256i, scales: [i32; 2]) -> __m256i {
        let sc = _mm256_set_m128i(
            _mm_set1_epi16(scales[1] as i16),
            _mm_set1_epi16(scales[0] as i16),
        );
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), sc)
    }

    /// [`fill`] for the formats with sign bytes, whose values [`signed_values`] makes in
    /// vector from the row kernel's side data: the same values, scales and bias.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fill_sign_bytes<B: SignBytes>(out: &mut Rows, r: usize, w: &[B]) -> bool {
        let at = out.row_start(r, w.len());
        let mut paired = true;
        for (i, b) in w.iter().enumerate() {
            let sb = at + i;
            *out.d.get_unchecked_mut(sb) = half_to_f32(b.d_bits()) * B::FACTOR;
            let vals: &mut [i8; QK_K] = (&mut out.w[sb * QK_K..(sb + 1) * QK_K])
                .try_into()
                .unwrap_or_else(|_| unreachable!("a super-block's slice is QK_K long"));
            let scales = signed_values(b, vals);
            let mut bias = _mm256_setzero_si256();
            for (ib, sc) in scales.iter().enumerate() {
                paired &= sc[0] == sc[1];
                let v = _mm256_loadu_si256(vals.as_ptr().add(32 * ib) as *const __m256i);
                bias = _mm256_add_epi32(bias, half_sums(v, *sc));
            }
            out.scales[sb * HALVES..(sb + 1) * HALVES].copy_from_slice(scales.as_flattened());
            *out.bias.get_unchecked_mut(sb) = hsum_i32(bias).wrapping_mul(128);
        }
        paired
    }

    /// [`fill`] for the two-bit K-quants, their values made in vector from the block's bytes:
    /// group `ib` is bits `2 · (ib % 4)..` of `qs`' 32 bytes `32 · (ib / 4)..` (one 16-bit
    /// shift and a mask: the bits kept never cross a byte), which `group` turns into the
    /// group's values and half scales from what `block` took once per block (with `qs`).
    /// The generic fill's values, scales, minimums and bias.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn fill_two_bit<B: Codebook, P>(
        out: &mut Rows,
        r: usize,
        w: &[B],
        block: impl Fn(&B) -> ([u8; 64], P),
        group: impl Fn(&P, __m256i, usize) -> (__m256i, [i32; 2]),
    ) -> bool {
        let at = out.row_start(r, w.len());
        let three = _mm256_set1_epi8(3);
        let mut paired = true;
        for (i, b) in w.iter().enumerate() {
            let sb = at + i;
            *out.d.get_unchecked_mut(sb) = half_to_f32(b.d_bits()) * B::FACTOR;
            out.put_mins(sb, b);
            let (qs, p) = block(b);
            let mut bias = _mm256_setzero_si256();
            for half in 0..2 {
                let q = _mm256_loadu_si256(qs.as_ptr().add(32 * half) as *const __m256i);
                for s in 0..4 {
                    let ib = 4 * half + s;
                    let low = _mm256_and_si256(
                        _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * s as i32)),
                        three,
                    );
                    let (v, scales) = group(&p, low, ib);
                    paired &= scales[0] == scales[1];
                    bias = _mm256_add_epi32(bias, put_group(out, sb, ib, v, scales));
                }
            }
            *out.bias.get_unchecked_mut(sb) = hsum_i32(bias).wrapping_mul(128);
        }
        paired
    }

    /// [`fill`] for Q3_K ([`fill_two_bit`]): the two low bits plus four times the `hmask` bit
    /// of the group, less 4, under the signed 6-bit half scales.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fill_q3k(out: &mut Rows, r: usize, w: &[BlockQ3K]) -> bool {
        let (one, four) = (_mm256_set1_epi8(1), _mm256_set1_epi8(4));
        let block = |b: &BlockQ3K| {
            let hm = _mm256_loadu_si256(b.hmask.as_ptr() as *const __m256i);
            (b.qs, (q3k_scales(&b.scales), hm))
        };
        fill_two_bit(out, r, w, block, |(sc, hm), low, ib| {
            let high = _mm256_and_si256(_mm256_srl_epi16(*hm, _mm_cvtsi32_si128(ib as i32)), one);
            let v = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), four);
            (v, [sc[2 * ib] as i32, sc[2 * ib + 1] as i32])
        })
    }

    /// [`fill`] for Q2_K ([`fill_two_bit`]): the two bits are the value, the low nibbles of
    /// `scales` the half scales (the high nibbles, its minimums, go in through `put_mins`).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fill_q2k(out: &mut Rows, r: usize, w: &[BlockQ2K]) -> bool {
        fill_two_bit(
            out,
            r,
            w,
            |b: &BlockQ2K| (b.qs, b.scales),
            |sc, low, ib| {
                (
                    low,
                    [(sc[2 * ib] & 0x0f) as i32, (sc[2 * ib + 1] & 0x0f) as i32],
                )
            },
        )
    }

    /// [`dot`](super::dot) on AVX2: eight tokens a vector, two rows a pass (more spill the
    /// sums out of the sixteen registers); per four values and row the row's word broadcast
    /// and `maddubs` with the tokens' bytes, the products summed in i16 as far as their
    /// bound allows, then `madd` with the half's scale (exact in i32); once a super-block the
    /// scalar twin's float step per lane, and for a format with minimums their sum, one
    /// `madd` per two halves of the tokens' sums. The multiply unit is the bound, so each
    /// `madd` saved counts.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot(w: &Rows, a: Block) -> [[f32; TOKENS]; ROWS] {
        match (w.minned, w.small) {
            (true, true) => run::<true, true>(w, a),
            (false, true) => run::<false, true>(w, a),
            (true, false) => run::<true, false>(w, a),
            (false, false) => run::<false, false>(w, a),
        }
    }

    /// `SMALL`: the values are within ±[`SMALL_MAX`]: the tokens plus 128 against the values
    /// (a pair sum at most 2 · 255 · 16), a half's four `maddubs` added in i16, one `madd`
    /// (five multiply-unit instructions per half and eight tokens, not eight), and the bias
    /// (128 · the values' scaled sum) taken off. Otherwise (every grid's magnitudes are at
    /// most 64): |value| against the signed tokens given the value's sign (a pair sum at most
    /// 2 · 64 · 127), two `maddubs` added in i16, one `madd` (six per half, not eight), no
    /// bias. The same integer sums either way.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const MINS: bool, const SMALL: bool>(
        w: &Rows,
        a: Block,
    ) -> [[f32; TOKENS]; ROWS] {
        const R: usize = 2;
        // How many `maddubs` (four values each) add up in i16 before a `madd`.
        let flush = if SMALL { 4 } else { 2 };
        let nb = w.blocks;
        assert!(a.blocks >= nb && a.q.len() >= nb * TOKENS * QK_K && a.d.len() >= nb * TOKENS);
        assert!(w.w.len() >= ROWS * nb * QK_K && w.scales.len() >= ROWS * nb * HALVES);
        assert!(w.bias.len() >= ROWS * nb && w.d.len() >= ROWS * nb);
        assert!(!MINS || (w.mins.len() >= ROWS * nb * HALVES && w.dmin.len() >= ROWS * nb));
        assert!(!MINS || a.bs.len() >= nb * TOKENS * HALVES);
        let mut out = [[0f32; TOKENS]; ROWS];
        for i in 0..nb {
            let q = a.q.as_ptr().add(i * TOKENS * QK_K);
            let bs = a.bs.as_ptr().add(i * TOKENS * HALVES);
            let dt = [0, 8].map(|o| _mm256_loadu_ps(a.d.as_ptr().add(i * TOKENS + o)));
            for r0 in (0..ROWS).step_by(R) {
                let rows: [*const i8; R] =
                    std::array::from_fn(|r| w.w.as_ptr().add(((r0 + r) * nb + i) * QK_K));
                let scales: [*const i32; R] =
                    std::array::from_fn(|r| w.scales.as_ptr().add(((r0 + r) * nb + i) * HALVES));
                // Row r's sums for tokens 0..8 and 8..16.
                let mut acc = [[_mm256_setzero_si256(); 2]; R];
                for h in 0..HALVES {
                    let sc: [__m256i; R] =
                        std::array::from_fn(|r| _mm256_set1_epi16(*scales[r].add(h) as i16));
                    let mut part = [[_mm256_setzero_si256(); 2]; R];
                    for k in 4 * h..4 * h + 4 {
                        let x = [0, 32]
                            .map(|o| _mm256_loadu_si256(q.add(64 * k + o) as *const __m256i));
                        // Larger values: the tokens signed again (without their 128) and
                        // given each value's sign, against |value| (a pair sum at most
                        // 2 · 64 · 127), so two `maddubs` add up in i16 before the `madd`.
                        let x = if SMALL {
                            x
                        } else {
                            x.map(|x| _mm256_xor_si256(x, _mm256_set1_epi8(-128)))
                        };
                        for r in 0..R {
                            let wv = (rows[r].add(4 * k) as *const i32).read_unaligned();
                            let wv = _mm256_set1_epi32(wv);
                            let aw = if SMALL { wv } else { _mm256_abs_epi8(wv) };
                            for j in 0..2 {
                                let p = if SMALL {
                                    _mm256_maddubs_epi16(x[j], wv)
                                } else {
                                    _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x[j], wv))
                                };
                                part[r][j] = _mm256_add_epi16(part[r][j], p);
                            }
                        }
                        if (k + 1) % flush != 0 {
                            continue;
                        }
                        for r in 0..R {
                            for j in 0..2 {
                                let p = _mm256_madd_epi16(part[r][j], sc[r]);
                                acc[r][j] = _mm256_add_epi32(acc[r][j], p);
                                part[r][j] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                for (r, acc) in acc.iter().enumerate() {
                    let at = (r0 + r) * nb + i;
                    let bias = _mm256_set1_epi32(*w.bias.get_unchecked(at));
                    let d = _mm256_set1_ps(*w.d.get_unchecked(at));
                    for (half, acc) in acc.iter().enumerate() {
                        // The sums of larger values are already without the tokens' 128.
                        let isum = if SMALL {
                            _mm256_sub_epi32(*acc, bias)
                        } else {
                            *acc
                        };
                        let mut step =
                            _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dt[half]));
                        if MINS {
                            // Halves 2p and 2p + 1 of eight tokens against the row's two
                            // minimums (one i32 of two i16): the row kernel's `summs`.
                            let mins = w.mins.as_ptr().add(at * HALVES);
                            let mut summs = _mm256_setzero_si256();
                            for p in 0..HALVES / 2 {
                                let x = _mm256_loadu_si256(
                                    bs.add(2 * TOKENS * p + 16 * half) as *const __m256i
                                );
                                let m = (mins.add(2 * p) as *const i32).read_unaligned();
                                let m = _mm256_set1_epi32(m);
                                summs = _mm256_add_epi32(summs, _mm256_madd_epi16(x, m));
                            }
                            let dmin = _mm256_set1_ps(*w.dmin.get_unchecked(at));
                            let off = _mm256_mul_ps(
                                _mm256_cvtepi32_ps(summs),
                                _mm256_mul_ps(dmin, dt[half]),
                            );
                            step = _mm256_sub_ps(step, off);
                        }
                        let o = out[r0 + r].as_mut_ptr().add(8 * half);
                        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), step));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::iq_grids::{
        IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
    };

    /// The AVX2 kernel's `maddubs` pair sums stay inside i16 only for magnitudes up to 64
    /// (2 · 255 · 64 < 32768): every grid's bytes, and IQ1's 8 · |g| + 1.
    #[test]
    fn grid_magnitudes_fit_the_avx2_pair_sums() {
        let two = IQ2XXS_GRID.iter().chain(&IQ2XS_GRID).chain(&IQ2S_GRID);
        let three = IQ3XXS_GRID.iter().chain(&IQ3S_GRID);
        let m = (two.flat_map(|w| w.to_le_bytes()))
            .chain(three.flat_map(|w| w.to_le_bytes()))
            .max()
            .unwrap_or(0);
        assert!(m <= 64, "grid magnitude {m}");
        let iq1 = IQ1S_GRID
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .map(|b| 8 * (b as i8 as i32).abs() + 1)
            .max()
            .unwrap_or(0);
        assert!(iq1 <= 64, "IQ1 magnitude {iq1}");
    }
}
