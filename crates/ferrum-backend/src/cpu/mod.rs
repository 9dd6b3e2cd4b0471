//! The CPU backend: f32 activations in plain vectors, weights kept in their file format and
//! dequantised row by row inside the matmul, rows split across cores with rayon.
//!
//! Reduction order never depends on how many rows or tokens a call carries (each output is
//! one dot product computed the same way), which keeps results batch-invariant.

pub mod arena;
pub mod kv;
pub mod linear;
mod moe;
pub mod pool;
pub mod quant;
pub mod simd;
mod span_attn;
mod tile;

use std::cell::RefCell;

use ferrum_core::{DType, Error, Result};
use ferrum_loader::RawTensor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arena::ArenaVec;
pub use kv::{CpuKv, KvDtype};
use pool::ThreadPool;

use crate::{
    moe_ffn_default, Activation, AttentionParams, AttnSeq, Backend, DeltaParams, ExpertBatch,
    ExpertWeights, KvShape, KvTable, MatmulPart, MoeScratch, RopeLayout, RopeParams, Rows,
    StateSeq,
};

pub struct CpuBackend {
    threads: usize,
    pool: Arc<ThreadPool>,
    /// Element format of the KV cache.
    kv: KvDtype,
    /// Keep activations in f32 for quantised weights (dequantise the weight row instead of
    /// quantising the activations): slower, and exactly the math of the reference.
    exact: bool,
    /// The last pass's rotary cos/sin: every layer rotates queries and keys at the same
    /// positions, so they are computed once per pass rather than twice per layer (in f64,
    /// they cost more per token than the rotation itself).
    rope_cache: Arc<std::sync::Mutex<Vec<RopeCache>>>,
    /// Where weight matrices live: on huge pages, several to a page (see [`arena`]).
    arena: Arc<arena::Arena>,
    /// The same for KV caches, apart: a short-lived cache (an embedding request's) then never
    /// takes the tail of a chunk of weights, where its space would stay lost with the model.
    kv_arena: Arc<arena::Arena>,
}

#[derive(Default)]
struct RopeCache {
    positions: Vec<u32>,
    inv_freq: Vec<f32>,
    factor: f32,
    /// cos and sin of position `positions[t]` and pair `i`, each at `t * inv_freq.len() + i`
    /// (two arrays, so that a head's rotation is element-wise over slices and vectorises).
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// RoPE's cos and sin for each position and rotated pair (row-major), as every backend
/// rotates with them: Hugging Face forms the angle in f32 and takes cos/sin of that f32
/// value (then multiplies by the attention factor, in f32).
pub(crate) fn rope_tables(positions: &[u32], p: &RopeParams) -> (Vec<f32>, Vec<f32>) {
    let n = positions.len() * p.inv_freq.len();
    let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for &pos in positions {
        for &f in p.inv_freq {
            let angle = (pos as f32 * f) as f64;
            cos.push(angle.cos() as f32 * p.factor);
            sin.push(angle.sin() as f32 * p.factor);
        }
    }
    (cos, sin)
}

impl RopeCache {
    fn new(positions: &[u32], p: &RopeParams) -> RopeCache {
        let (cos, sin) = rope_tables(positions, p);
        RopeCache {
            positions: positions.to_vec(),
            inv_freq: p.inv_freq.to_vec(),
            factor: p.factor,
            cos,
            sin,
        }
    }

    /// By bits: equal floats of different bits (0.0 and -0.0) give sines of other signs.
    fn matches(&self, positions: &[u32], p: &RopeParams) -> bool {
        self.positions == positions
            && self.factor.to_bits() == p.factor.to_bits()
            && self.inv_freq.len() == p.inv_freq.len()
            && self
                .inv_freq
                .iter()
                .zip(p.inv_freq)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

/// Tokens from which an encoder's float matmul ([`Backend::load_weight_encoder`]) takes the
/// tiled GEMM: below, its panels' conversion would cost more than the tiles save.
const TILED_MIN: usize = 48;

/// The bytes of token rows a float matmul keeps in L2 while every weight row of its task
/// passes over them (half of a 1 MB L2, leaving room for the weights).
const L2_TOKEN_BYTES: usize = 512 * 1024;

/// The inputs a float matmul's rows are taken at a time with 512-bit dots: four f32 weight
/// rows' stretch is 16 KiB (in L1), and `L2_TOKEN_BYTES` hold 126 tokens' stretches.
const K_STRETCH: usize = 1024;

/// Weight rows and tokens of one tile of [`stretched_rows`]: `dot_f32_4x3`'s shape. Six rows
/// by four tokens (24 pairs a half pass, ten loads for 24 multiply-adds) measured no faster on
/// a Zen 4: 1B-shaped F16 pp512 54.2 against 57.1 tok/s, medians of 3, two alternating runs.
const ROWS_AT_ONCE: usize = 4;
const TOKENS_AT_ONCE: usize = 3;

/// A float matmul task's `rows` over `n` tokens (`x_t`) of `k` inputs, `K_STRETCH` inputs at a
/// time: `ROWS_AT_ONCE` weight rows (the last group padded with its last row) over every
/// `TOKENS_AT_ONCE` tokens (padded with the last token), their sums carried between stretches
/// ([`simd::dot_f32_carry`]), so every (row, token) gets `dot_f32`'s bits.
#[allow(clippy::too_many_arguments)]
fn stretched_rows<'x>(
    w: &CpuWeight,
    (k, n): (usize, usize),
    rows: std::ops::Range<usize>,
    x_t: &dyn Fn(usize) -> &'x [f32],
    bias: Option<&[f32]>,
    scratch: &mut [Vec<f32>; ROWS_AT_ONCE],
    write: &dyn Fn(usize, usize, f32),
) {
    const R: usize = ROWS_AT_ONCE;
    const T: usize = TOKENS_AT_ONCE;
    let tokens = (L2_TOKEN_BYTES / (4 * K_STRETCH)) / T * T;
    let stretches = k.div_ceil(K_STRETCH).max(1);
    let mut carries: Vec<simd::F32Carry<R, T>> = Vec::new();
    let mut from = 0;
    while from < n {
        let to = (from + tokens).min(n);
        let tok = |i: usize| x_t((from + i).min(to - 1));
        let mut j = rows.start;
        while j < rows.end {
            let r = (rows.end - j).min(R);
            (j..j + r).for_each(|j| w.prefetch_ahead(j));
            carries.clear();
            carries.resize((to - from).div_ceil(T), simd::F32Carry::default());
            for st in 0..stretches {
                let (a, b) = (st * K_STRETCH, ((st + 1) * K_STRETCH).min(k));
                let last = st + 1 == stretches;
                // Only the last stretch ends off a multiple of 32: its tail is the rows'.
                let m = if last { (b - a) / 32 * 32 } else { b - a };
                // Rows past the task's last are its last again (computed, not written).
                let mut rows_in = scratch.iter_mut().enumerate();
                let ws: [&[f32]; R] = std::array::from_fn(|_| {
                    let (i, s) = rows_in.next().expect("R scratch rows");
                    w.row_block(j + i.min(r - 1), a, b, s)
                });
                for (tg, carry) in carries.iter_mut().enumerate() {
                    let t = T * tg;
                    let xs: [&[f32]; T] = std::array::from_fn(|d| &tok(t + d)[a..b]);
                    simd::dot_f32_carry(ws.map(|w| &w[..m]), xs.map(|x| &x[..m]), carry);
                    if !last {
                        continue;
                    }
                    let v = simd::dot_f32_finish(carry, ws.map(|w| &w[m..]), xs.map(|x| &x[m..]));
                    for (i, v) in v.iter().enumerate().take(r) {
                        let bi = bias.map_or(0.0, |b| b[j + i]);
                        for (d, v) in v.iter().enumerate() {
                            if from + t + d < to {
                                write(from + t + d, j + i, v + bi);
                            }
                        }
                    }
                }
            }
            j += r;
        }
        from = to;
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The checks of one weight's matmul from input rows `xv` into the view `ov` of an
    /// output buffer of `out_len` (shapes agree, the view fits, its rows do not overlap, the
    /// bias fits), then its bias values, rows per task and tasks: enough tasks to balance the
    /// cores, few enough that each amortises its start; packed weights' tasks start on a
    /// packed group. `matmul` and `matmul_many` share it.
    fn checked_part<'a>(
        &self,
        xv: Rows,
        w: &'a CpuWeight,
        bias: Option<&'a CpuWeight>,
        ov: Rows,
        out_len: usize,
    ) -> (Option<&'a [f32]>, usize, usize) {
        let m = w.rows;
        assert_eq!(xv.width(), w.cols, "matmul: input width vs weight columns");
        assert_eq!(ov.width(), m, "matmul: output width vs weight rows");
        assert_eq!(xv.count, ov.count);
        check_view("matmul out", ov, out_len);
        // Tasks write different columns of every row: rows must not overlap.
        assert!(
            ov.count <= 1 || ov.stride >= ov.width(),
            "matmul: output rows overlap"
        );
        let bias = bias.map(|b| b.as_f32());
        if let Some(b) = bias {
            assert_eq!(b.len(), m);
        }
        // Four tasks per thread: large enough that a thread's rows run on contiguously (see
        // `pool`), small enough to rebalance when a thread falls behind.
        let mut per_task = (m / (self.threads * 4)).clamp(4, 256);
        if w.packed.is_some() {
            per_task = per_task.next_multiple_of(quant::packed::ROWS);
        }
        (bias, per_task, m.div_ceil(per_task))
    }

    /// [`checked_part`](Self::checked_part) as a part of a quantised pass; `None` for a weight
    /// off the integer path.
    fn quant_part<'a>(
        &self,
        xv: Rows,
        w: &'a CpuWeight,
        bias: Option<&'a CpuWeight>,
        ov: Rows,
        out_len: usize,
    ) -> Option<QuantPart<'a>> {
        if w.precise {
            return None;
        }
        let kernel = w.kernel?;
        let (bias, per_task, n_tasks) = self.checked_part(xv, w, bias, ov, out_len);
        Some(QuantPart {
            w,
            kernel,
            bias,
            ov,
            per_task,
            n_tasks,
        })
    }

    /// The fast backend: quantised weights meet 8-bit quantised activations in integer
    /// dot products, as in llama.cpp.
    pub fn new() -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads(threads)
    }

    pub fn with_threads(threads: usize) -> Self {
        let threads = threads.max(1);
        CpuBackend {
            threads,
            pool: Arc::new(ThreadPool::new(threads)),
            kv: KvDtype::F16,
            exact: false,
            rope_cache: Arc::default(),
            arena: Arc::default(),
            kv_arena: Arc::default(),
        }
    }

    /// A weight as the file stores it (no packed copy): matrices stay mapped.
    fn load_mapped(&self, t: &RawTensor) -> Result<CpuWeight> {
        let cols = t.row_len();
        let rows = t.n_rows();
        if !quant::can_dequantize(t.dtype) {
            return Err(Error::Unsupported(format!(
                "tensor {}: no CPU kernel for {}",
                t.name, t.dtype
            )));
        }
        if t.dtype.bytes_for(cols).is_none() {
            return Err(Error::Weights(format!(
                "tensor {}: row length {cols} is not a whole number of {} blocks",
                t.name, t.dtype
            )));
        }
        let is_vector = t.shape.len() == 1;
        let unaligned_f32 = t.dtype == DType::F32 && quant::cast_blocks::<f32>(t.bytes()).is_none();
        let data = if is_vector || unaligned_f32 {
            let mut v = vec![0.0; t.numel()];
            if !quant::dequantize(t.dtype, t.bytes(), &mut v) {
                return Err(Error::Weights(format!("tensor {}: cannot convert", t.name)));
            }
            WeightData::F32(v)
        } else {
            WeightData::Mapped(t.clone())
        };
        let kernel = match &data {
            WeightData::Mapped(_) if !self.exact => quant::best_kernel(t.dtype),
            _ => None,
        };
        if kernel.is_some() && !(t.bytes().as_ptr() as usize).is_multiple_of(4) {
            return Err(Error::Weights(format!(
                "tensor {}: data is not aligned",
                t.name
            )));
        }
        Ok(CpuWeight {
            dtype: t.dtype,
            rows,
            cols,
            data,
            kernel,
            packed: None,
            recoded: None,
            precise: false,
            encoder: false,
        })
    }

    /// `t`'s bytes on the arena's huge pages, copied on the pool in stretches of a megabyte,
    /// each stretch's mapped pages dropped once copied (as packing does: resident once).
    fn copy_to_arena(&self, t: &RawTensor) -> ArenaVec<u8> {
        const STRETCH: usize = 1 << 20;
        let src = t.bytes();
        let fill = |p: *mut u8| {
            let dst = SharedMut(p);
            self.pool.run(src.len().div_ceil(STRETCH), &|task| {
                let r = task * STRETCH..((task + 1) * STRETCH).min(src.len());
                // SAFETY: `r` is within the `src.len()` bytes at `p` (not yet initialised,
                // hence a raw copy rather than a slice), and each task has its own stretch.
                unsafe { dst.copy_from(r.start, &src[r.clone()]) };
                t.release_pages(r);
            });
        };
        // SAFETY: the tasks cover every byte of `0..src.len()` (`run` runs each once, and
        // panics on the caller if one panics).
        let v = unsafe { ArenaVec::from_fn(&self.arena, src.len(), fill) };
        // The pages that straddle two stretches were inside neither.
        t.release_pages(0..src.len());
        v
    }

    /// Re-encodes a matrix's owned bytes into `form` on the pool, in stretches of whole blocks;
    /// `false`, the bytes untouched, when they are not whole, aligned blocks (which load
    /// checked already).
    fn recode(&self, form: quant::Recoded, bytes: &mut [u8]) -> bool {
        const STRETCH_BLOCKS: usize = 1 << 14;
        if !form.takes(bytes) {
            return false;
        }
        let (len, stretch) = (bytes.len(), STRETCH_BLOCKS * form.dtype().block_bytes());
        let dst = SharedMut(bytes.as_mut_ptr());
        self.pool.run(len.div_ceil(stretch), &|task| {
            let at = task * stretch;
            // SAFETY: in bounds of `bytes`, which this call borrows exclusively; each task has
            // its own stretch.
            let part = unsafe { dst.slice(at, stretch.min(len - at)) };
            // Whole blocks from a whole-block offset of bytes `takes` accepted: a stretch
            // that failed would leave the matrix half in each form.
            let done = form.recode(part);
            assert!(
                done,
                "a stretch of whole, aligned blocks failed to re-encode"
            );
        });
        true
    }

    /// The same backend with another KV-cache format.
    pub fn with_kv(self, kv: KvDtype) -> Self {
        CpuBackend { kv, ..self }
    }

    /// A matmul over bf16 weights on `vdpbf16ps` ([`simd::bf16_dot`]): the activation rows
    /// rounded to bf16 once, then eight (or four, or one) weight rows against three tokens per
    /// kernel call where there are that many, against one otherwise; every (row, token) gets
    /// the bits of [`simd::dot_bf16_scalar`], however many tokens share the pass.
    #[allow(clippy::too_many_arguments)]
    fn matmul_bf16(
        &self,
        x: &[f32],
        xv: Rows,
        w: &CpuWeight,
        bias: Option<&[f32]>,
        (per_task, n_tasks): (usize, usize),
        dst: SharedMut,
        ov: Rows,
    ) {
        let (m, k, n) = (w.rows, w.cols, xv.count);
        let mut xb = vec![0u16; n * k];
        for (t, row) in xb.chunks_exact_mut(k).enumerate() {
            simd::f32_to_bf16_rne(&x[xv.offset + t * xv.stride..][..k], row);
        }
        let x_t = |t: usize| &xb[t * k..(t + 1) * k];
        let w_j = |j: usize| match w.half_row(j) {
            Some(simd::HalfRow::Bf16(r)) => r,
            _ => unreachable!("a bf16 matrix in the file's layout (checked by the caller)"),
        };
        // SAFETY (every write): in bounds (`checked_part`); column j belongs to this task.
        let write =
            |t: usize, j: usize, v: f32| unsafe { dst.write(ov.offset + t * ov.stride + j, v) };
        let b = |j: usize| bias.map_or(0.0, |b| b[j]);
        self.pool.run(n_tasks, &|task| {
            let rows = task * per_task..((task + 1) * per_task).min(m);
            // Eight rows at a time, then four, then one by one; against three tokens at a
            // time, then one by one. Rows longer than `STRETCH` go in stretches of it, every
            // token's sums carried from one to the next (the same bits): eight whole rows of
            // 8192 values are 128 KB, which a pass would fetch from L2 again for every three
            // tokens; a stretch's 32 KB stay in L1. With one triple or less nothing is
            // fetched twice, so a decode keeps the one-pass kernels (and allocates nothing).
            const STRETCH: usize = 2048;
            fn tile<'a, const R: usize>(
                j: usize,
                n: usize,
                w_j: &impl Fn(usize) -> &'a [u16],
                x_t: &impl Fn(usize) -> &'a [u16],
                put: &impl Fn(usize, usize, f32),
            ) {
                let ws: [&[u16]; R] = std::array::from_fn(|i| w_j(j + i));
                let k = ws[0].len();
                let triples = n / 3;
                if k > STRETCH && triples > 1 {
                    let mut c3 = vec![simd::BfCarry::<R, 3>::default(); triples];
                    let mut c1 = vec![simd::BfCarry::<R, 1>::default(); n - 3 * triples];
                    for c0 in (0..k).step_by(STRETCH) {
                        let r = c0..(c0 + STRETCH).min(k);
                        let wc = ws.map(|w| &w[r.clone()]);
                        for (i, c) in c3.iter_mut().enumerate() {
                            let x = std::array::from_fn(|d| &x_t(3 * i + d)[r.clone()]);
                            simd::dot_bf16_carry(wc, x, c);
                        }
                        for (i, c) in c1.iter_mut().enumerate() {
                            simd::dot_bf16_carry(wc, [&x_t(3 * triples + i)[r.clone()]], c);
                        }
                    }
                    for (i, c) in c3.iter().enumerate() {
                        for (row, v) in c.finish().iter().enumerate() {
                            v.iter()
                                .enumerate()
                                .for_each(|(d, v)| put(3 * i + d, j + row, *v));
                        }
                    }
                    for (i, c) in c1.iter().enumerate() {
                        for (row, v) in c.finish().iter().enumerate() {
                            put(3 * triples + i, j + row, v[0]);
                        }
                    }
                    return;
                }
                for i in 0..triples {
                    let t = 3 * i;
                    let v = simd::dot_bf16_rx3(ws, [x_t(t), x_t(t + 1), x_t(t + 2)]);
                    for (row, v) in v.iter().enumerate() {
                        for (d, v) in v.iter().enumerate() {
                            put(t + d, j + row, *v);
                        }
                    }
                }
                for t in 3 * triples..n {
                    let v = simd::dot_bf16_rx1(ws, x_t(t));
                    v.iter().enumerate().for_each(|(i, v)| put(t, j + i, *v));
                }
            }
            let put = |t: usize, j: usize, v: f32| write(t, j, v + b(j));
            let mut j = rows.start;
            while j < rows.end {
                let r = match rows.end - j {
                    8.. => 8,
                    4.. => 4,
                    _ => 1,
                };
                (j..j + r).for_each(|j| w.prefetch_ahead(j));
                match r {
                    8 => tile::<8>(j, n, &w_j, &x_t, &put),
                    4 => tile::<4>(j, n, &w_j, &x_t, &put),
                    _ => tile::<1>(j, n, &w_j, &x_t, &put),
                }
                j += r;
            }
        });
    }

    /// A precise quantised weight ([`Backend::load_weight_precise`]) in the default mode: each
    /// activation row `x` goes to the integer kernels as two tokens, `x` and what its 8-bit
    /// quantisation drops (`q8::residual_q8`/`residual_q8k`), and the two products are summed:
    /// the activation keeps about 16 significant bits for the price of a second token in the
    /// same pass over the weights (a decode's weights are still read once). Each (row, token)
    /// gets the same bits whatever the batch, as the kernels give.
    #[allow(clippy::too_many_arguments)]
    fn matmul_two_level(
        &self,
        x: &[f32],
        xv: Rows,
        w: &CpuWeight,
        kernel: quant::Kernel,
        bias: Option<&CpuWeight>,
        out: &mut [f32],
        ov: Rows,
    ) {
        let (m, k, n) = (w.rows, w.cols, xv.count);
        let (bias, _, _) = self.checked_part(xv, w, bias, ov, out.len());
        let mut rows = vec![0f32; 2 * n * k];
        let pairs = SharedMut(rows.as_mut_ptr());
        self.pool.run(n, &|t| {
            // SAFETY: token t's two rows, in bounds, are this task's alone.
            let pair = unsafe { pairs.slice(2 * t * k, 2 * k) };
            let src = &x[xv.offset + t * xv.stride..][..k];
            let (hi, lo) = pair.split_at_mut(k);
            hi.copy_from_slice(src);
            match kernel {
                quant::Kernel::Q8 { .. } => quant::q8::residual_q8(src, lo),
                quant::Kernel::Q8K { .. } => quant::q8::residual_q8k(src, lo),
            }
        });
        let mut y = vec![0f32; 2 * n * m];
        let yv = Rows::dense(2 * n, m);
        let (_, per_task, n_tasks) = self.checked_part(Rows::dense(2 * n, k), w, None, yv, y.len());
        let part = QuantPart {
            w,
            kernel,
            bias: None,
            ov: yv,
            per_task,
            n_tasks,
        };
        let row = |t: usize| &rows[t * k..(t + 1) * k];
        quantized_matmuls(
            &self.pool,
            &row,
            2 * n,
            k,
            &[part],
            SharedMut(y.as_mut_ptr()),
        );
        for (t, pair) in y.chunks_exact(2 * m).enumerate() {
            let (hi, lo) = pair.split_at(m);
            let dst = &mut out[ov.offset + t * ov.stride..][..m];
            for (j, d) in dst.iter_mut().enumerate() {
                *d = hi[j] + lo[j] + bias.map_or(0.0, |b| b[j]);
            }
        }
    }

    /// Runs `f` on every row of `xv` (its full width), rows split among the threads.
    fn rows_in_place(&self, x: &mut [f32], xv: Rows, f: &(dyn Fn(&mut [f32]) + Sync)) {
        let (n, w) = (xv.count, xv.width());
        if n == 0 {
            return;
        }
        assert!(n <= 1 || xv.stride >= w, "rows overlap");
        let per_task = n.div_ceil(self.threads * 4).max(1);
        let dst = SharedMut(x.as_mut_ptr());
        self.pool.run(n.div_ceil(per_task), &|task| {
            for t in task * per_task..((task + 1) * per_task).min(n) {
                // SAFETY: in bounds (check_view); rows do not overlap and each is one task's.
                f(unsafe { dst.slice(xv.offset + t * xv.stride, w) });
            }
        });
    }

    /// f32 activations everywhere: each quantised weight row is dequantised and multiplied in
    /// f32. Used to check the model against an exact reference.
    pub fn exact() -> Self {
        CpuBackend {
            exact: true,
            kv: KvDtype::F32,
            ..CpuBackend::new()
        }
    }
}

/// Whether [`Backend::load_weight_precise`] is honoured: `FERRUM_PRECISE=0` loads those
/// weights like any other (to measure what the precision costs and buys). Fixed at the first
/// call.
fn precise_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRUM_PRECISE").map_or(true, |v| v != "0"))
}

/// A weight in its stored format. Vectors (norm weights, biases) and unaligned f32 matrices
/// are converted to owned f32 at load; matrices are copied onto the arena (packed where a
/// layout exists, else as the file stores them); stacked expert tensors, and the rows of a
/// matrix past its last multiple of eight, are read from the mapped file.
pub struct CpuWeight {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: WeightData,
    /// The integer kernel for quantised matrices (absent in exact mode and for floats).
    kernel: Option<quant::Kernel>,
    /// Rows `0..packed.rows()` interleaved eight at a time (the 32-value block formats, Q4_K,
    /// Q5_K and Q6_K, with AVX2); the matmul reads these instead of the mapped rows. See
    /// [`quant::packed`].
    packed: Option<quant::packed::Packed>,
    /// The form the owned bytes were re-encoded into at load ([`quant::Recoded`]): every
    /// reader of them (the kernel, the prefill tile, dequantisation) takes this form, not
    /// `dtype`'s.
    recoded: Option<quant::Recoded>,
    /// Loaded by [`Backend::load_weight_precise`]: multiplied with f32 activations even in
    /// the default mode (no integer kernel, no `vdpbf16ps`).
    precise: bool,
    /// Loaded by [`Backend::load_weight_encoder`]: a float matrix whose passes over many
    /// tokens take the tiled GEMM ([`tile::gemm`]), whose sums need not be `dot_f32`'s.
    encoder: bool,
}

enum WeightData {
    Mapped(RawTensor),
    /// A matrix no packed layout covers, copied in the file's layout onto the arena's huge
    /// pages (its mapped pages dropped), read like `Mapped`.
    Owned(ArenaVec<u8>),
    F32(Vec<f32>),
    /// Every row is in [`CpuWeight::packed`].
    Packed,
}

impl CpuWeight {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn row_bytes(&self) -> usize {
        // Checked at load: rows are whole blocks.
        self.dtype.bytes_for(self.cols).unwrap_or(0)
    }

    /// Row `j` as stored, when that is f16 or bf16 (aligned, as on the arena) and not packed.
    fn half_row(&self, j: usize) -> Option<simd::HalfRow<'_>> {
        if self.packed.is_some() || !cfg!(target_endian = "little") {
            return None;
        }
        match self.dtype {
            DType::F16 => quant::cast_blocks(self.row_bytes_of(j)).map(simd::HalfRow::F16),
            DType::BF16 => quant::cast_blocks(self.row_bytes_of(j)).map(simd::HalfRow::Bf16),
            _ => None,
        }
    }

    /// Row `j` as f32: borrowed when stored as f32, else dequantised into `scratch`.
    fn row<'a>(&'a self, j: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        if let Some(p) = self.packed.as_ref().filter(|p| j < p.rows()) {
            // The mapped pages of packed rows were dropped; reading them would fault them
            // back in (with the kernel's read-around, far more than one row).
            let buf = aligned(scratch, self.cols);
            p.dequantize_row(j, buf);
            return buf;
        }
        match &self.data {
            WeightData::F32(v) => &v[j * self.cols..(j + 1) * self.cols],
            WeightData::Packed => panic!("row {j} of a {}-row weight", self.rows),
            WeightData::Mapped(_) | WeightData::Owned(_) => {
                let bytes = self.row_bytes_of(j);
                if self.dtype == DType::F32 {
                    if let Some(f) = quant::cast_blocks::<f32>(bytes) {
                        return f;
                    }
                }
                let buf = aligned(scratch, self.cols);
                match self.recoded {
                    Some(form) => form.dequantize(bytes, buf),
                    None => quant::dequantize(self.dtype, bytes, buf),
                };
                buf
            }
        }
    }

    /// Elements `a..b` of row `j` of a float weight (f32, f16, bf16) as f32: borrowed when
    /// stored as f32, else converted into `scratch`.
    fn row_block<'a>(
        &'a self,
        j: usize,
        a: usize,
        b: usize,
        scratch: &'a mut Vec<f32>,
    ) -> &'a [f32] {
        match self.half_row(j) {
            Some(h) => {
                let buf = aligned(scratch, b - a);
                h.range(a, b).to_f32(buf);
                buf
            }
            None => &self.row(j, scratch)[a..b],
        }
    }

    /// Rows `first..first + out.len()` dotted with one activation row. A whole packed group
    /// (eight rows from a multiple of eight) is one kernel call, and so are two of a K-quant or
    /// Q8_0 on the 512-bit kernels (sixteen rows from a multiple of sixteen: [`packed_unit`]); a packed row on its own is
    /// taken from its group's result, so every path gives a row the matmul's value.
    fn dot_rows(&self, first: usize, a: &ActRow, out: &mut [f32], scratch: &mut Vec<f32>) {
        use quant::packed::ROWS;
        if let Some(p) = self.packed.as_ref().filter(|p| first < p.rows()) {
            if out.len() == 2 * ROWS && p.pairs_wide() && first.is_multiple_of(2 * ROWS) {
                let (mut va, mut vb) = ([[0f32; ROWS]], [[0f32; ROWS]]);
                if p.is_k_quant() {
                    p.gemm_k2(first / ROWS, &[&a.q8k], &mut va, &mut vb);
                } else {
                    p.gemm2(first / ROWS, &[&a.q8], &mut va, &mut vb);
                }
                out[..ROWS].copy_from_slice(&va[0]);
                out[ROWS..].copy_from_slice(&vb[0]);
                return;
            }
            let mut v = [[0f32; ROWS]];
            if p.is_k_quant() {
                p.gemm_k(first / ROWS, &[&a.q8k], &mut v);
            } else {
                p.gemm(first / ROWS, &[&a.q8], &mut v);
            }
            let at = first % ROWS;
            out.copy_from_slice(&v[0][at..at + out.len()]);
            return;
        }
        for (j, o) in (first..).zip(out.iter_mut()) {
            *o = self.dot_file_row(j, a, scratch);
        }
    }

    /// Row `j` in the file's layout dotted with one activation row.
    fn dot_file_row(&self, j: usize, a: &ActRow, scratch: &mut Vec<f32>) -> f32 {
        match self.kernel {
            Some(quant::Kernel::Q8 { dot, .. }) => dot(self.row_bytes_of(j), &a.q8),
            Some(quant::Kernel::Q8K { dot, .. }) => dot(self.row_bytes_of(j), &a.q8k),
            None => simd::dot_f32(self.row(j, scratch), &a.f32),
        }
    }

    /// Asks for the stored bytes [`quant::q8::PREFETCH_BYTES`] past row `j`'s start, a row's
    /// worth (into L2, as the quantised kernels do for their blocks): the rows of a task are
    /// read in order, and without it a row's conversion waited on memory.
    fn prefetch_ahead(&self, j: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let rb = self.row_bytes();
            let base = match &self.data {
                WeightData::Mapped(t) => t.bytes().as_ptr(),
                WeightData::Owned(v) => v.as_ptr(),
                WeightData::F32(v) => v.as_ptr() as *const u8,
                WeightData::Packed => return,
            };
            quant::q8::prefetch_lines_ahead(base.wrapping_add(j * rb), 0..rb.div_ceil(64));
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = j;
    }

    fn row_bytes_of(&self, j: usize) -> &[u8] {
        self.file_rows().row(j)
    }

    /// The rows as stored, to slice many: `row_bytes` divides by the block's length, and the
    /// decode loop's rows are short (an IQ2_XXS row of 2048 values is ~130 ns).
    fn file_rows(&self) -> FileRows<'_> {
        let bytes: &[u8] = match &self.data {
            WeightData::Mapped(t) => t.bytes(),
            WeightData::Owned(v) => v,
            WeightData::F32(_) | WeightData::Packed => &[],
        };
        FileRows {
            bytes,
            len: if bytes.is_empty() {
                0
            } else {
                self.row_bytes()
            },
        }
    }

    /// The whole weight as f32 (vectors only; callers use it for norms and biases).
    fn as_f32(&self) -> &[f32] {
        match &self.data {
            WeightData::F32(v) => v,
            WeightData::Mapped(_) | WeightData::Owned(_) | WeightData::Packed => &[],
        }
    }
}

/// A weight's stored rows ([`CpuWeight::file_rows`]); empty where it keeps none (f32, packed).
#[derive(Clone, Copy)]
struct FileRows<'a> {
    bytes: &'a [u8],
    len: usize,
}

impl<'a> FileRows<'a> {
    fn row(self, j: usize) -> &'a [u8] {
        &self.bytes[j * self.len..(j + 1) * self.len]
    }
}

/// One activation row as f32 and, when some weight's kernel needs them, quantised to the
/// 8-bit activation formats (each computed once, as the matmul does).
struct ActRow {
    f32: Vec<f32>,
    q8: Vec<quant::q8::BlockQ8>,
    q8k: Vec<quant::q8::BlockQ8K>,
}

impl ActRow {
    fn new<'w>(x: &[f32], weights: impl Iterator<Item = &'w CpuWeight>) -> ActRow {
        let (mut q8, mut q8k) = (Vec::new(), Vec::new());
        for w in weights {
            match w.kernel {
                Some(quant::Kernel::Q8 { .. }) if q8.is_empty() => {
                    q8 = vec![Default::default(); x.len() / quant::q8::QK8];
                    quant::q8::quantize_q8(x, &mut q8);
                }
                Some(quant::Kernel::Q8K { .. }) if q8k.is_empty() => {
                    q8k = vec![Default::default(); x.len() / quant::k_quants::QK_K];
                    quant::q8::quantize_q8k(x, &mut q8k);
                }
                _ => {}
            }
        }
        ActRow {
            f32: x.to_vec(),
            q8,
            q8k,
        }
    }
}

/// A raw pointer that pool tasks may share. Each task writes a disjoint set of elements.
struct SharedMut<T = f32>(*mut T);
// SAFETY: used only to write disjoint elements from parallel tasks (and to read them after
// those writes, ordered by the pool or an atomic), while the owning buffer is exclusively
// borrowed by the op that created the pointer.
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

// By hand: derived, they would ask `T: Copy`, and a pointer is Copy for any `T`.
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// Writes element `i`, which need not hold a value yet (nothing is read or dropped).
    ///
    /// # Safety
    /// `i` is in bounds of the buffer and no other task writes element `i`.
    #[inline]
    unsafe fn write(self, i: usize, v: T) {
        self.0.add(i).write(v);
    }

    /// Copies `src` to elements `offset..offset + src.len()`, which need not hold values yet.
    ///
    /// # Safety
    /// Those elements are in bounds of the buffer and no other task touches them meanwhile.
    #[inline]
    unsafe fn copy_from(self, offset: usize, src: &[T]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(offset), src.len())
    }

    /// # Safety
    /// `offset..offset + len` is in bounds of the buffer and no other task touches it while
    /// the slice lives.
    #[inline]
    unsafe fn slice<'a>(self, offset: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }

    /// # Safety
    /// `offset..offset + len` is in bounds of the buffer and no task writes it while the
    /// slice lives.
    #[inline]
    unsafe fn slice_ref<'a>(self, offset: usize, len: usize) -> &'a [T] {
        std::slice::from_raw_parts(self.0.add(offset), len)
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static SCRATCH2: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The f32 matmul path's converted weight rows (or their stretches), four at a time.
    static ROW_SCRATCH: RefCell<[Vec<f32>; ROWS_AT_ONCE]> = const {
        RefCell::new([const { Vec::new() }; ROWS_AT_ONCE])
    };
}

fn check_view(what: &str, v: Rows, len: usize) {
    assert!(
        v.end() <= len,
        "{what}: view {v:?} ends at {} past buffer of {len}",
        v.end()
    );
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Weight = CpuWeight;
    type KvBuf = CpuKv;

    fn name(&self) -> String {
        format!(
            "cpu ({} threads, {}, {} KV{})",
            self.threads,
            simd::simd_name(),
            self.kv.name(),
            if self.exact { ", exact" } else { "" }
        )
    }

    fn kv_dtype(&self) -> &'static str {
        self.kv.name()
    }

    fn alloc_kv(&self, shape: KvShape) -> CpuKv {
        CpuKv::new(self.kv, shape, &self.kv_arena)
    }

    fn kv_row_bytes(&self, width: usize) -> usize {
        self.kv.row_bytes(width)
    }

    fn write_kv(
        &self,
        src: &Vec<f32>,
        sv: Rows,
        dst: &mut CpuKv,
        table: KvTable,
        first_pos: usize,
    ) {
        check_view("kv src", sv, src.len());
        assert_eq!(
            table.block_size,
            dst.shape().block_size,
            "block table of another block size"
        );
        let w = sv.width();
        for t in 0..sv.count {
            let row = table.slot(first_pos + t).unwrap_or_else(|| {
                panic!("write_kv: position {} past the block table", first_pos + t)
            });
            dst.write_row(row, &src[sv.offset + t * sv.stride..][..w]);
        }
    }

    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn buf_len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn write(&self, buf: &mut Vec<f32>, offset: usize, data: &[f32]) {
        buf[offset..offset + data.len()].copy_from_slice(data);
    }

    fn read(&self, buf: &Vec<f32>, offset: usize, out: &mut [f32]) {
        out.copy_from_slice(&buf[offset..offset + out.len()]);
    }

    fn host_view<'a>(&self, buf: &'a Vec<f32>, offset: usize, len: usize) -> Option<&'a [f32]> {
        Some(&buf[offset..offset + len])
    }

    fn load_weight_precise(&self, t: &RawTensor) -> Result<CpuWeight> {
        if !precise_allowed() {
            return self.load_weight(t);
        }
        if t.dtype.is_quantized() {
            // Packed as usual: the integer kernels take two-level activations
            // (`matmul_two_level`), which cost a second token in the same pass rather than
            // the exact path's dequantised rows.
            let mut w = self.load_weight(t)?;
            w.precise = true;
            return Ok(w);
        }
        // Float weights have no integer kernel: `precise` keeps them off `vdpbf16ps`, so the
        // matmul converts their rows and keeps f32 activations.
        let mut w = self.load_mapped(t)?;
        w.precise = true;
        if let (WeightData::Mapped(_), 2) = (&w.data, t.shape.len()) {
            w.data = WeightData::Owned(self.copy_to_arena(t));
        }
        Ok(w)
    }

    /// Float matrices (f32, f16, bf16) keep their format and are marked: a pass of
    /// 48 tokens or more (`TILED_MIN`) takes the tiled GEMM.
    fn load_weight_encoder(&self, t: &RawTensor) -> Result<CpuWeight> {
        let mut w = self.load_weight(t)?;
        w.encoder = matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16)
            && t.shape.len() == 2
            && w.packed.is_none();
        Ok(w)
    }

    /// Float matrices whose rows are whole Q8_0 blocks become Q8_0 (then packed) unless the
    /// backend is exact: an encoder's batch runs on the VNNI integer kernels.
    fn load_weight_compute(&self, t: &RawTensor) -> Result<CpuWeight> {
        let float = matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16);
        let cols = t.row_len();
        if self.exact || !float || t.shape.len() != 2 || !cols.is_multiple_of(quant::q8_0::QK) {
            return self.load_weight(t);
        }
        let mut row = vec![0f32; cols];
        let row_bytes = t.dtype.bytes_for(cols).unwrap_or(0);
        let mut bytes = Vec::with_capacity(t.n_rows() * (cols / 32) * 34);
        for r in t.bytes().chunks_exact(row_bytes) {
            if !quant::dequantize(t.dtype, r, &mut row) {
                return self.load_weight(t);
            }
            quant::q8_0::quantize_row(&row, &mut bytes);
        }
        let q = RawTensor::from_bytes(&t.name, DType::Q8_0, t.shape.clone(), bytes).ok_or_else(
            || Error::Weights(format!("tensor {}: cannot make its Q8_0 copy", t.name)),
        )?;
        self.load_weight(&q)
    }

    fn load_weight(&self, t: &RawTensor) -> Result<CpuWeight> {
        let mut w = self.load_mapped(t)?;
        #[cfg(target_arch = "x86_64")]
        // Only plain matrices: a stacked expert tensor is only ever read through its
        // per-expert row views (`weight_rows`), which are packed one by one here.
        if w.kernel.is_some() && t.shape.len() == 2 && quant::has_avx2() {
            // Each packed stretch of the mapped rows is dropped from memory as soon as it is
            // copied: resident memory holds the weights once, never twice (not even at the
            // peak of loading). An embedding lookup of a tied head reads its row back.
            w.packed = quant::packed::Packed::new(
                t.dtype,
                t.bytes(),
                w.rows,
                w.cols,
                &self.pool,
                &self.arena,
                &|range| t.release_pages(range),
            );
            if w.packed.as_ref().is_some_and(|p| p.rows() == w.rows) {
                // Nothing reads the file's layout any more. Dropping the tensor matters for
                // owned bytes (tests, converters), which would otherwise stay in memory
                // beside their packed copy; mapped pages are already released.
                w.data = WeightData::Packed;
            }
        }
        if let (WeightData::Mapped(_), None, 2) = (&w.data, &w.packed, t.shape.len()) {
            let mut owned = self.copy_to_arena(t);
            if let Some(form) = quant::Recoded::of(t.dtype).filter(|_| w.kernel.is_some()) {
                if self.recode(form, &mut owned) {
                    w.kernel = Some(form.best_kernel());
                    w.recoded = Some(form);
                }
            }
            w.data = WeightData::Owned(owned);
        }
        Ok(w)
    }

    fn weight_shape(&self, w: &CpuWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    /// The codebook formats (and Q2_K, Q3_K): a prefill decodes their rows into bytes once a
    /// matrix product (`iq_tile`), which a 64-token pass repeats eight times over a 512-token
    /// prompt.
    fn long_prefill(&self, w: &CpuWeight) -> bool {
        !w.precise && quant::iq_tile::takes(w.dtype)
    }

    fn embed(&self, table: &CpuWeight, tokens: &[u32], out: &mut Vec<f32>, ov: Rows) {
        assert_eq!(ov.width(), table.cols);
        assert_eq!(ov.count, tokens.len());
        check_view("embed out", ov, out.len());
        let mut scratch = Vec::new();
        for (t, &tok) in tokens.iter().enumerate() {
            let row = table.row(tok as usize, &mut scratch);
            let o = ov.offset + t * ov.stride;
            out[o..o + table.cols].copy_from_slice(row);
        }
    }

    fn matmul(
        &self,
        x: &Vec<f32>,
        xv: Rows,
        w: &CpuWeight,
        bias: Option<&CpuWeight>,
        out: &mut Vec<f32>,
        ov: Rows,
    ) {
        let (m, k) = (w.rows, w.cols);
        check_view("matmul x", xv, x.len());
        let n = xv.count;
        if let (true, Some(kernel)) = (w.precise, w.kernel) {
            return self.matmul_two_level(x, xv, w, kernel, bias, out, ov);
        }
        let dst = SharedMut(out.as_mut_ptr());
        if let Some(part) = self.quant_part(xv, w, bias, ov, out.len()) {
            let row = |t: usize| &x[xv.offset + t * xv.stride..][..k];
            return quantized_matmuls(&self.pool, &row, n, k, &[part], dst);
        }
        let (bias, per_task, n_tasks) = self.checked_part(xv, w, bias, ov, out.len());
        if w.encoder && n >= TILED_MIN {
            let row = |j: usize, dst: &mut [f32]| {
                SCRATCH2.with(|s| dst.copy_from_slice(w.row(j, &mut s.borrow_mut())))
            };
            return tile::gemm(
                &self.pool,
                tile::Isa::detect(),
                (x, xv.offset, xv.stride),
                n,
                k,
                m,
                &row,
                bias,
                dst,
                (ov.offset, ov.stride),
            );
        }
        if !self.exact
            && !w.precise
            && w.dtype == DType::BF16
            && simd::bf16_dot()
            && w.half_row(0).is_some()
        {
            return self.matmul_bf16(x, xv, w, bias, (per_task, n_tasks), dst, ov);
        }
        // An f16/bf16 row read by one or two tokens is converted as it is dotted; for more
        // tokens rows are converted into scratch (four at a time, below) and shared. Same
        // bits either way (`dot_half`).
        let fused = n <= 2 && m > 0 && simd::dot_half_is_vectorised() && w.half_row(0).is_some();
        // A prefill's token rows, read over and over, start on 32-byte boundaries (see
        // `aligned`): copied there once for all tasks when they do not already.
        let mut copy = Vec::new();
        let at_32 = |i: usize| (x[i..].as_ptr() as usize).is_multiple_of(32);
        let (xs, x0, step) = if n >= 3 && !(at_32(xv.offset) && xv.stride.is_multiple_of(8)) {
            let step = k.next_multiple_of(8);
            let buf = aligned(&mut copy, n * step);
            for t in 0..n {
                buf[t * step..][..k].copy_from_slice(&x[xv.offset + t * xv.stride..][..k]);
            }
            (&*buf, 0, step)
        } else {
            (&x[..], xv.offset, xv.stride)
        };
        let x_t = |t: usize| &xs[x0 + t * step..][..k];
        // With 512-bit f32 dots, a float weight's rows are taken `K_STRETCH` inputs at a time
        // (`dot_f32_carry`): four weight rows' stretch stays in L1 while every token's passes
        // over it, and the tokens' stretches in L2, however long the rows. Taken whole, rows
        // of 5,120 or 32,768 inputs fitted neither: a 32,768-input projection was converted
        // from f16 again for every three tokens. Same bits as whole rows.
        let stretched = n >= 3
            && simd::zmm_f32()
            && w.packed.is_none()
            && (w.dtype == DType::F32 || w.half_row(0).is_some());
        // SAFETY (every write): in bounds (check_view above); column j belongs to this task
        // only.
        let write =
            |t: usize, j: usize, v: f32| unsafe { dst.write(ov.offset + t * ov.stride + j, v) };
        self.pool.run(n_tasks, &|task| {
            let rows = task * per_task..((task + 1) * per_task).min(m);
            if fused {
                for j in rows {
                    w.prefetch_ahead(j);
                    let b = bias.map_or(0.0, |b| b[j]);
                    match w.half_row(j) {
                        Some(wr) => {
                            (0..n).for_each(|t| write(t, j, simd::dot_half(x_t(t), wr) + b))
                        }
                        None => SCRATCH.with(|s| {
                            let mut scratch = s.borrow_mut();
                            let wr = w.row(j, &mut scratch);
                            (0..n).for_each(|t| write(t, j, simd::dot_f32(x_t(t), wr) + b));
                        }),
                    }
                }
                return;
            }
            if stretched {
                ROW_SCRATCH.with(|s| {
                    let mut scratch = s.borrow_mut();
                    stretched_rows(w, (k, n), rows, &x_t, bias, &mut scratch, &write);
                });
                return;
            }
            // Four weight rows at a time against each three tokens: the three tokens' rows, in
            // L2 in a prefill (64 tokens of a 1536-wide input are 393 KB), are then fetched
            // from L2 once for four weight rows and stay in L1 for the other three. Each (row,
            // token) pair still gets `dot_f32`'s arithmetic, so the grouping changes no bit.
            // Many tokens (a vision tower's thousands of patches) are taken a stretch at a
            // time that fits L2, all of the task's rows over each stretch: streaming every
            // token past each group of four rows would read them from memory each time.
            let stretch = (L2_TOKEN_BYTES / (4 * k.max(1))).max(3) / 3 * 3;
            ROW_SCRATCH.with(|s| {
                let mut scratch = s.borrow_mut();
                let [s0, s1, s2, s3] = &mut *scratch;
                let mut from = 0;
                while from < n {
                    let to = (from + stretch).min(n);
                    let mut j = rows.start;
                    while j < rows.end {
                        let r = (rows.end - j).min(4);
                        (j..j + r).for_each(|j| w.prefetch_ahead(j));
                        let ws = [
                            w.row(j, s0),
                            if r > 1 { w.row(j + 1, s1) } else { &[] },
                            if r > 2 { w.row(j + 2, s2) } else { &[] },
                            if r > 3 { w.row(j + 3, s3) } else { &[] },
                        ];
                        let b = |i: usize| bias.map_or(0.0, |b| b[j + i]);
                        let mut t = from;
                        while t + 3 <= to {
                            let xs = [x_t(t), x_t(t + 1), x_t(t + 2)];
                            if r == 4 {
                                let v = simd::dot_f32_4x3(ws, xs);
                                for (i, v) in v.iter().enumerate() {
                                    for (d, v) in v.iter().enumerate() {
                                        write(t + d, j + i, v + b(i));
                                    }
                                }
                                t += 3;
                                continue;
                            }
                            for (i, wr) in ws[..r].iter().enumerate() {
                                let v = simd::dot_f32_x3(wr, xs);
                                for (d, v) in v.iter().enumerate() {
                                    write(t + d, j + i, v + b(i));
                                }
                            }
                            t += 3;
                        }
                        for t in t..to {
                            for (i, wr) in ws[..r].iter().enumerate() {
                                write(t, j + i, simd::dot_f32(x_t(t), wr) + b(i));
                            }
                        }
                        j += r;
                    }
                    from = to;
                }
            })
        });
    }

    /// All parts on the integer path and writing disjoint columns of the same rows: the input
    /// quantised once, every part's tasks in one hand-off. Otherwise one `matmul` each.
    fn matmul_many(
        &self,
        x: &Vec<f32>,
        xv: Rows,
        parts: &[MatmulPart<'_, CpuWeight>],
        out: &mut Vec<f32>,
    ) {
        check_view("matmul x", xv, x.len());
        let views: Vec<Rows> = parts.iter().map(|p| p.out).collect();
        let quant_parts = parts
            .iter()
            .map(|p| self.quant_part(xv, p.weight, p.bias, p.out, out.len()))
            .collect::<Option<Vec<_>>>();
        match quant_parts {
            Some(qp) if parts.len() > 1 && side_by_side(&views, xv.count) => {
                let dst = SharedMut(out.as_mut_ptr());
                let row = |t: usize| &x[xv.offset + t * xv.stride..][..xv.width()];
                quantized_matmuls(&self.pool, &row, xv.count, xv.width(), &qp, dst)
            }
            _ => {
                for p in parts {
                    self.matmul(x, xv, p.weight, p.bias, out, p.out);
                }
            }
        }
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        xv: Rows,
        weight: &CpuWeight,
        eps: f32,
        out: &mut Vec<f32>,
        ov: Rows,
    ) {
        assert_eq!(xv.count, ov.count);
        assert_eq!(xv.head_dim, ov.head_dim);
        assert_eq!(xv.heads, ov.heads);
        check_view("rms_norm x", xv, x.len());
        check_view("rms_norm out", ov, out.len());
        let w = weight.as_f32();
        let d = xv.head_dim;
        assert_eq!(w.len(), d, "rms_norm weight length");
        for t in 0..xv.count {
            for h in 0..xv.heads {
                let xi = xv.offset + t * xv.stride + h * d;
                let oi = ov.offset + t * ov.stride + h * d;
                let xr = &x[xi..xi + d];
                let inv = rms_inv(xr, eps);
                for ((o, &xv), &wi) in out[oi..oi + d].iter_mut().zip(xr).zip(w) {
                    *o = wi * (xv * inv);
                }
            }
        }
    }

    fn rms_norm_inplace(&self, x: &mut Vec<f32>, xv: Rows, weight: &CpuWeight, eps: f32) {
        check_view("rms_norm_inplace", xv, x.len());
        let w = weight.as_f32();
        let d = xv.head_dim;
        assert_eq!(w.len(), d, "rms_norm weight length");
        for t in 0..xv.count {
            for h in 0..xv.heads {
                let xi = xv.offset + t * xv.stride + h * d;
                let row = &mut x[xi..xi + d];
                let inv = rms_inv(row, eps);
                for (v, wi) in row.iter_mut().zip(w) {
                    *v = wi * (*v * inv);
                }
            }
        }
    }

    fn rope(&self, x: &mut Vec<f32>, xv: Rows, positions: &[u32], p: RopeParams) {
        check_view("rope", xv, x.len());
        assert_eq!(positions.len(), xv.count);
        let half = p.inv_freq.len();
        assert!(2 * half <= xv.head_dim);
        let mut caches = self.rope_cache.lock().unwrap_or_else(|e| e.into_inner());
        // Models with two frequency sets (Gemma 3's local and global layers) alternate between
        // them every few layers: a cache per set, so neither is recomputed each layer.
        let hit = caches.iter().position(|c| c.matches(positions, &p));
        let cache = match hit {
            Some(i) => &caches[i],
            None => {
                if caches.len() >= 4 {
                    caches.remove(0);
                }
                caches.push(RopeCache::new(positions, &p));
                &caches[caches.len() - 1]
            }
        };
        for t in 0..positions.len() {
            let cos = &cache.cos[t * half..(t + 1) * half];
            let sin = &cache.sin[t * half..(t + 1) * half];
            for h in 0..xv.heads {
                let base = xv.offset + t * xv.stride + h * xv.head_dim;
                let head = &mut x[base..base + 2 * half];
                // Plain products and sums, no fused multiply-add: the same bits as the scalar
                // loop, whether or not the compiler vectorises it.
                match p.layout {
                    RopeLayout::Neox => {
                        let (a, b) = head.split_at_mut(half);
                        for (((x0, x1), &c), &s) in a.iter_mut().zip(b).zip(cos).zip(sin) {
                            (*x0, *x1) = (*x0 * c - *x1 * s, *x1 * c + *x0 * s);
                        }
                    }
                    RopeLayout::Interleaved => {
                        for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                            let (x0, x1) = (pair[0], pair[1]);
                            pair[0] = x0 * c - x1 * s;
                            pair[1] = x1 * c + x0 * s;
                        }
                    }
                }
            }
        }
    }

    fn copy_rows(&self, src: &Vec<f32>, sv: Rows, dst: &mut Vec<f32>, dv: Rows) {
        assert_eq!(sv.count, dv.count);
        assert_eq!(sv.width(), dv.width());
        check_view("copy src", sv, src.len());
        check_view("copy dst", dv, dst.len());
        let w = sv.width();
        for t in 0..sv.count {
            let s = sv.offset + t * sv.stride;
            let d = dv.offset + t * dv.stride;
            dst[d..d + w].copy_from_slice(&src[s..s + w]);
        }
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        qv: Rows,
        k_cache: &CpuKv,
        v_cache: &CpuKv,
        seqs: &[AttnSeq],
        out: &mut Vec<f32>,
        ov: Rows,
        p: AttentionParams,
    ) {
        assert_eq!(ov.heads, qv.heads);
        assert_eq!(ov.head_dim, qv.head_dim);
        assert_eq!(ov.count, qv.count);
        assert!(p.n_kv_heads > 0 && qv.heads.is_multiple_of(p.n_kv_heads));
        check_view("attention q", qv, q.len());
        check_view("attention out", ov, out.len());
        assert_eq!(seqs.iter().map(|s| s.rows).sum::<usize>(), qv.count);
        kv::attention(&self.pool, q, qv, k_cache, v_cache, seqs, out, ov, p);
    }

    fn span_attention(
        &self,
        qkv: &Vec<f32>,
        n: usize,
        heads: usize,
        head_dim: usize,
        spans: &[(usize, usize)],
        out: &mut Vec<f32>,
    ) -> bool {
        span_attn::span_attention(
            &self.pool,
            tile::Isa::detect(),
            simd::attn_kernels().softmax,
            qkv,
            n,
            heads,
            head_dim,
            spans,
            out,
        );
        true
    }

    fn glu(&self, x: &Vec<f32>, xv: Rows, out: &mut Vec<f32>, ov: Rows, act: Activation) {
        let f = check_glu(xv, x.len(), ov, out.len());
        for t in 0..xv.count {
            let xi = xv.offset + t * xv.stride;
            let oi = ov.offset + t * ov.stride;
            simd::glu(
                &x[xi..xi + f],
                &x[xi + f..xi + 2 * f],
                &mut out[oi..oi + f],
                act,
            );
        }
    }

    /// On the integer path, each token's SwiGLU row is computed by the task that quantises it,
    /// in the matmul's hand-off: a decode batch's rows no longer wait for one thread.
    fn glu_matmul(
        &self,
        gu: &Vec<f32>,
        gv: Rows,
        act: &mut Vec<f32>,
        av: Rows,
        w: &CpuWeight,
        out: &mut Vec<f32>,
        ov: Rows,
        fun: Activation,
    ) {
        let Some(part) = self.quant_part(av, w, None, ov, out.len()) else {
            self.glu(gu, gv, act, av, fun);
            return self.matmul(act, av, w, None, out, ov);
        };
        let f = check_glu(gv, gu.len(), av, act.len());
        assert!(
            av.count <= 1 || av.stride >= f,
            "swiglu: activation rows overlap"
        );
        let a = SharedMut(act.as_mut_ptr());
        let row = |t: usize| -> &[f32] {
            let gi = gv.offset + t * gv.stride;
            // SAFETY: in bounds (check_view above); rows do not overlap, and `quantized_matmuls`
            // calls this once per token, so row t is written by this call alone and read only
            // through the returned slice.
            let o = unsafe { a.slice(av.offset + t * av.stride, f) };
            simd::glu(&gu[gi..gi + f], &gu[gi + f..gi + 2 * f], o, fun);
            o
        };
        quantized_matmuls(
            &self.pool,
            &row,
            av.count,
            f,
            &[part],
            SharedMut(out.as_mut_ptr()),
        );
    }

    fn add_inplace(&self, x: &mut Vec<f32>, xv: Rows, y: &Vec<f32>, yv: Rows) {
        assert_eq!(xv.count, yv.count);
        assert_eq!(xv.width(), yv.width());
        check_view("add x", xv, x.len());
        check_view("add y", yv, y.len());
        let w = xv.width();
        for t in 0..xv.count {
            let xi = xv.offset + t * xv.stride;
            let yi = yv.offset + t * yv.stride;
            for (a, &b) in x[xi..xi + w].iter_mut().zip(&y[yi..yi + w]) {
                *a += b;
            }
        }
    }

    fn low_rank_shrink(&self, x: &Vec<f32>, xv: Rows, a: &[f32], low: &mut Vec<f32>, lv: Rows) {
        assert_eq!(xv.count, lv.count);
        let (n, k, r) = (xv.count, xv.width(), lv.width());
        assert_eq!(a.len(), r * k, "low_rank_shrink: factor size");
        check_view("low_rank_shrink x", xv, x.len());
        check_view("low_rank_shrink low", lv, low.len());
        assert!(n <= 1 || lv.stride >= r, "rows overlap");
        if n == 0 || r == 0 {
            return;
        }
        // A task a few of the factor's rows, for every row of the pass (each factor row read
        // once a call).
        let per_task = r.div_ceil(self.threads * 2).max(1);
        let dst = SharedMut(low.as_mut_ptr());
        self.pool.run(r.div_ceil(per_task), &|task| {
            let (j0, j1) = (task * per_task, ((task + 1) * per_task).min(r));
            for (j, aj) in a.chunks_exact(k).enumerate().take(j1).skip(j0) {
                for t in 0..n {
                    let xt = &x[xv.offset + t * xv.stride..][..k];
                    // SAFETY: in bounds (check_view); element (t, j) is this task's alone.
                    unsafe { dst.write(lv.offset + t * lv.stride + j, simd::dot_f32(xt, aj)) };
                }
            }
        });
    }

    fn add_low_rank(&self, low: &Vec<f32>, lv: Rows, bt: &[f32], out: &mut Vec<f32>, ov: Rows) {
        assert_eq!(lv.count, ov.count);
        let (n, r, w) = (ov.count, lv.width(), ov.width());
        assert_eq!(bt.len(), r * w, "add_low_rank: factor size");
        check_view("add_low_rank low", lv, low.len());
        check_view("add_low_rank out", ov, out.len());
        assert!(n <= 1 || ov.stride >= w, "rows overlap");
        if n == 0 {
            return;
        }
        // A task a stretch of columns: it reads the factor's stretch once (it stays in L1 for
        // every row of the pass) and owns those columns of every output row.
        let stretch = crate::host_ops::LOW_RANK_STRETCH;
        let mix = simd::attn_kernels().mix;
        let dst = SharedMut(out.as_mut_ptr());
        self.pool.run(w.div_ceil(stretch), &|task| {
            let (c0, c1) = (task * stretch, ((task + 1) * stretch).min(w));
            let block = &bt[r * c0..r * c1];
            for t in 0..n {
                // SAFETY: in bounds (check_view); rows do not overlap and these columns are
                // this task's alone.
                let o = unsafe { dst.slice(ov.offset + t * ov.stride + c0, c1 - c0) };
                mix(&low[lv.offset + t * lv.stride..][..r], block, o);
            }
        });
    }

    fn fill(&self, x: &mut Vec<f32>, xv: Rows, value: f32) {
        check_view("fill", xv, x.len());
        let w = xv.width();
        for t in 0..xv.count {
            let xi = xv.offset + t * xv.stride;
            x[xi..xi + w].fill(value);
        }
    }

    fn gather_rows(&self, src: &Vec<f32>, sv: Rows, rows: &[u32], dst: &mut Vec<f32>, dv: Rows) {
        assert_eq!(sv.width(), dv.width());
        assert_eq!(rows.len(), dv.count);
        check_view("gather src", sv, src.len());
        check_view("gather dst", dv, dst.len());
        let w = sv.width();
        for (t, &r) in rows.iter().enumerate() {
            assert!((r as usize) < sv.count, "gather: row {r} of {}", sv.count);
            let s = sv.offset + r as usize * sv.stride;
            let d = dv.offset + t * dv.stride;
            dst[d..d + w].copy_from_slice(&src[s..s + w]);
        }
    }

    fn scatter_add_rows(
        &self,
        src: &Vec<f32>,
        sv: Rows,
        rows: &[u32],
        scales: &[f32],
        dst: &mut Vec<f32>,
        dv: Rows,
    ) {
        assert_eq!(sv.width(), dv.width());
        assert_eq!(rows.len(), sv.count);
        assert_eq!(scales.len(), rows.len());
        check_view("scatter src", sv, src.len());
        check_view("scatter dst", dv, dst.len());
        let w = sv.width();
        for (t, (&r, &c)) in rows.iter().zip(scales).enumerate() {
            assert!((r as usize) < dv.count, "scatter: row {r} of {}", dv.count);
            let s = sv.offset + t * sv.stride;
            let d = dv.offset + r as usize * dv.stride;
            for i in 0..w {
                dst[d + i] += c * src[s + i];
            }
        }
    }

    fn weight_rows(&self, w: &CpuWeight, first: usize, count: usize) -> Result<CpuWeight> {
        let WeightData::Mapped(t) = &w.data else {
            return Err(Error::Weights(
                "row views need a stacked weight as the file maps it".into(),
            ));
        };
        let view = t.rows(first, count).ok_or_else(|| {
            Error::Weights(format!(
                "{}: rows {first}..{} out of range",
                t.name,
                first + count
            ))
        })?;
        self.load_weight(&view)
    }

    /// Decode (one token, no biases) takes `moe::decode`: two hand-offs a layer. A
    /// prefill, or an expert with biases, takes `moe::prefill`: each expert a
    /// matrix-matrix product over its tokens, as in the default composition, but a group of
    /// experts a hand-off. Both give the default composition's bits (tested).
    fn moe_ffn(
        &self,
        x: &Vec<f32>,
        xv: Rows,
        experts: &[ExpertWeights<CpuWeight>],
        batches: &[ExpertBatch],
        scratch: &mut MoeScratch<Vec<f32>>,
        out: &mut Vec<f32>,
        ov: Rows,
        act: Activation,
    ) {
        if xv.count == 1 && experts.iter().all(|e| e.biases.is_none()) {
            return moe::decode(self, x, xv, experts, batches, scratch, out, ov, act);
        }
        if !moe::prefill(self, x, xv, experts, batches, scratch, out, ov, act) {
            moe_ffn_default(self, x, xv, experts, batches, scratch, out, ov, act);
        }
    }

    fn sigmoid_mul(&self, x: &mut Vec<f32>, xv: Rows, g: &Vec<f32>, gv: Rows) {
        assert_eq!(xv.count, gv.count);
        let w = xv.width();
        let per_row = gv.width() == 1 && w != 1;
        assert!(per_row || gv.width() == w, "sigmoid_mul: gate width");
        check_view("sigmoid_mul x", xv, x.len());
        check_view("sigmoid_mul gate", gv, g.len());
        for t in 0..xv.count {
            let xi = xv.offset + t * xv.stride;
            let gi = gv.offset + t * gv.stride;
            if per_row {
                let s = linear::sigmoid(g[gi]);
                x[xi..xi + w].iter_mut().for_each(|v| *v *= s);
            } else {
                for (v, &gate) in x[xi..xi + w].iter_mut().zip(&g[gi..gi + w]) {
                    *v *= linear::sigmoid(gate);
                }
            }
        }
    }

    fn copy_within(&self, x: &mut Vec<f32>, src: Rows, dst: Rows) {
        assert_eq!(src.count, dst.count);
        assert_eq!(src.width(), dst.width());
        check_view("copy_within src", src, x.len());
        check_view("copy_within dst", dst, x.len());
        let w = src.width();
        for t in 0..src.count {
            let (s, d) = (src.offset + t * src.stride, dst.offset + t * dst.stride);
            assert!(s + w <= d || d + w <= s, "copy_within: rows overlap");
            x.copy_within(s..s + w, d);
        }
    }

    fn causal_conv1d(
        &self,
        x: &mut Vec<f32>,
        xv: Rows,
        w: &Vec<f32>,
        kernel: usize,
        state: &mut Vec<f32>,
        seqs: &[StateSeq],
    ) {
        check_view("causal_conv1d x", xv, x.len());
        let hist = kernel.saturating_sub(1) * xv.width();
        let top = seqs.iter().map(|s| s.slot + 1).max().unwrap_or(0);
        assert!(
            state.len() >= top * hist,
            "causal_conv1d: state slot out of range"
        );
        linear::causal_conv1d(x, xv, w, kernel, state, seqs);
    }

    fn gated_delta(
        &self,
        x: &Vec<f32>,
        q: Rows,
        k: Rows,
        v: Rows,
        a: Rows,
        b: Rows,
        p: DeltaParams,
        state: &mut Vec<f32>,
        seqs: &[StateSeq],
        out: &mut Vec<f32>,
        ov: Rows,
    ) {
        linear::gated_delta(
            &self.pool,
            linear::DeltaIsa::best(),
            x,
            q,
            k,
            v,
            a,
            b,
            p,
            state,
            seqs,
            out,
            ov,
        );
    }

    /// In place, rows shared among the threads (the default copies the buffer out and back
    /// on one thread, which leaves the others waiting between an encoder's matmuls). The
    /// same row function, so the same bits.
    fn layer_norm(&self, x: &mut Vec<f32>, xv: Rows, weight: &[f32], bias: &[f32], eps: f32) {
        check_view("layer_norm", xv, x.len());
        let w = xv.width();
        assert!(
            weight.len() == w && bias.len() == w,
            "layer_norm: parameter length"
        );
        self.rows_in_place(x, xv, &|row| {
            crate::host_ops::layer_norm_row(row, weight, bias, eps)
        });
    }

    fn gelu(&self, x: &mut Vec<f32>, xv: Rows) {
        check_view("gelu", xv, x.len());
        self.rows_in_place(x, xv, &crate::host_ops::gelu_erf);
    }

    fn gelu_tanh(&self, x: &mut Vec<f32>, xv: Rows) {
        check_view("gelu_tanh", xv, x.len());
        // `g / (1 + e^−2y)` rather than PyTorch's `½ g (1 + tanh y)`: the same function, within
        // a few ulp, vectorised (the host body's `tanhf` is scalar).
        self.rows_in_place(x, xv, &simd::gelu_tanh);
    }

    fn scale_inplace(&self, x: &mut Vec<f32>, xv: Rows, s: f32) {
        check_view("scale", xv, x.len());
        let w = xv.width();
        for t in 0..xv.count {
            let xi = xv.offset + t * xv.stride;
            for v in &mut x[xi..xi + w] {
                *v *= s;
            }
        }
    }
}

thread_local! {
    /// Codebook-format weight rows decoded for a prefill (`quantized_rows`), a chunk of
    /// [`TILE_CHUNK`] groups of eight.
    static DECODED: RefCell<Vec<quant::iq_tile::Rows>> = const { RefCell::new(Vec::new()) };
    /// A prefill's tokens laid out for the codebook formats' tile kernel.
    static ACT_TILE: RefCell<quant::iq_tile::Tokens> = RefCell::new(Default::default());
    static ACT_Q8: RefCell<Vec<quant::q8::BlockQ8>> = const { RefCell::new(Vec::new()) };
    static ACT_Q8K: RefCell<Vec<quant::q8::BlockQ8K>> = const { RefCell::new(Vec::new()) };
}

/// Groups of eight codebook rows decoded before a pass over the tokens: each block of
/// sixteen tokens is read from the cache once for 32 rows.
const TILE_CHUNK: usize = 4;

/// Rows per unit of work for a pass over these matrices: two packed groups when all are
/// K-quants or Q8_0 packed whole in multiples of 16 rows and the CPU runs the 512-bit
/// two-group kernels ([`Packed::pairs_wide`](quant::packed::Packed::pairs_wide)), a packed group when all are packed
/// whole (their row counts are then multiples of 8), else single rows.
fn packed_unit<'w>(ws: impl Iterator<Item = &'w CpuWeight> + Clone) -> usize {
    use quant::packed::ROWS;
    let whole = |w: &CpuWeight| w.packed.as_ref().is_some_and(|p| p.rows() == w.rows);
    if !ws.clone().all(whole) {
        return 1;
    }
    if ws.clone().all(|w| {
        w.rows.is_multiple_of(2 * ROWS) && w.packed.as_ref().is_some_and(|p| p.pairs_wide())
    }) {
        return 2 * ROWS;
    }
    ROWS
}

/// The packed part of a matmul task, for either activation format (Q8 for the 32-value
/// layouts, Q8_K for the K-quant ones: [`quant::packed::PackedAct`]).
trait PackedRows: quant::amx::Act + quant::packed::PackedAct + Sized + 'static {
    /// Computes the packed rows of `rows` for all `n` tokens; returns the first row left
    /// for the file-layout kernels.
    fn run<'a>(
        w: &CpuWeight,
        rows: std::ops::Range<usize>,
        n: usize,
        act: &impl Fn(usize) -> &'a [Self],
        write8: &impl Fn(usize, usize, &[f32; quant::packed::ROWS]),
    ) -> usize {
        use quant::packed::ROWS;
        let Some(p) = w.packed.as_ref().filter(|p| Self::takes(p)) else {
            return rows.start;
        };
        let end = rows.end.min(p.rows());
        if rows.start >= end {
            return rows.start;
        }
        debug_assert!(rows.start.is_multiple_of(ROWS), "tasks start on a group");
        let mut out = [[0f32; ROWS]; 8];
        let mut out_b = [[0f32; ROWS]; 8];
        // Two groups per pass where a kernel does both: fewer instructions per weight byte,
        // which prefill and batched decode need (the arithmetic is their limit). The 512-bit
        // kernels pair for one token's decode too (from the last-level cache the 256-bit
        // one-group kernels read Q4_K and Q6_K slower than main memory delivers on AMD Zen 5);
        // AVX2's Q4_K and Q8_0 pairs only where each group serves several four-token passes.
        let pairs = Self::pairs(p, n);
        let mut g = rows.start / ROWS;
        // A prefill's pass on the AMX tiles: two groups against sixteen tokens per product,
        // the same bits as the kernels below.
        #[cfg(target_arch = "x86_64")]
        if n >= quant::amx::MIN_TOKENS
            && g + 1 < end / ROWS
            && quant::amx::pays(p, n)
            && quant::amx::mode() != quant::amx::Mode::Off
        {
            use quant::amx::{gemm_pair, Amx, Emulated, Mode};
            let mode = quant::amx::mode();
            let acts: Vec<&[Self]> = (0..n).map(act).collect();
            let mut out = vec![[0f32; quant::amx::PAIR]; n];
            while g + 1 < end / ROWS {
                // SAFETY: `mode` checked that the CPU runs the kernels' AVX-512 and, for the
                // AMX tiles, the tile instructions, and that this process has their state.
                let done = unsafe {
                    match mode {
                        Mode::Amx => gemm_pair(&mut Amx, p, g, &acts, &mut out),
                        _ => gemm_pair(&mut Emulated::default(), p, g, &acts, &mut out),
                    }
                };
                if !done {
                    break;
                }
                for (t, o) in out.iter().enumerate() {
                    let (a, b) = o.split_at(ROWS);
                    write8(t, g * ROWS, a.try_into().expect("eight rows"));
                    write8(t, (g + 1) * ROWS, b.try_into().expect("eight rows"));
                }
                g += 2;
            }
        }
        while g < end / ROWS {
            let two = pairs && g + 1 < end / ROWS;
            // Four tokens per pass (eight where a two-group kernel takes them): each weight
            // block is unpacked once for all of them.
            let step = p.tokens_per_pass(two);
            for t in (0..n).step_by(step) {
                let c = (n - t).min(step);
                let acts: [&[Self]; 8] = std::array::from_fn(|i| act((t + i).min(n - 1)));
                if two {
                    Self::gemm2(p, g, &acts[..c], &mut out[..c], &mut out_b[..c]);
                } else {
                    Self::gemm(p, g, &acts[..c], &mut out[..c]);
                }
                for (i, o) in out[..c].iter().enumerate() {
                    write8(t + i, g * ROWS, o);
                }
                if two {
                    for (i, o) in out_b[..c].iter().enumerate() {
                        write8(t + i, (g + 1) * ROWS, o);
                    }
                }
            }
            g += if two { 2 } else { 1 };
        }
        end
    }
}

impl<A: quant::amx::Act + quant::packed::PackedAct> PackedRows for A {}

/// Whether `views` are column windows of the same `count` rows that no two share: then tasks
/// of different views never write the same element, in any order.
fn side_by_side(views: &[Rows], count: usize) -> bool {
    let Some(first) = views.first() else {
        return true;
    };
    let (lo, hi) = views.iter().fold((usize::MAX, 0), |(lo, hi), v| {
        (lo.min(v.offset), hi.max(v.offset + v.width()))
    });
    let disjoint = views.iter().enumerate().all(|(i, a)| {
        views[i + 1..]
            .iter()
            .all(|b| a.offset + a.width() <= b.offset || b.offset + b.width() <= a.offset)
    });
    let same_rows = views
        .iter()
        .all(|v| v.stride == first.stride && v.count == count);
    // Row t of the last window must end before row t + 1 of the first begins.
    disjoint && same_rows && (count <= 1 || hi - lo <= first.stride)
}

/// One weight of a quantised matmul pass: its rows, split into tasks, written (plus the bias)
/// to the columns of `ov`.
struct QuantPart<'a> {
    w: &'a CpuWeight,
    kernel: quant::Kernel,
    bias: Option<&'a [f32]>,
    ov: Rows,
    per_task: usize,
    n_tasks: usize,
}

/// Quantises each activation row once (to each activation format the parts need), then runs
/// every part's integer kernel for every (row, token) pair, all parts' tasks in one hand-off
/// to the threads. Rows are split across tasks; each task reads its weight rows once for all
/// tokens. Results do not depend on how many parts share the pass.
/// `input(t)` gives token `t`'s row of `k` values; it is called once per token, before any
/// matmul task starts (so it may compute the row: [`Backend::glu_matmul`]).
fn quantized_matmuls<'x>(
    pool: &ThreadPool,
    input: &(dyn Fn(usize) -> &'x [f32] + Sync),
    n: usize,
    k: usize,
    parts: &[QuantPart],
    dst: SharedMut,
) {
    use quant::q8::{BlockQ8, BlockQ8K, QK8};
    let needs = |q8k: bool| {
        parts
            .iter()
            .any(|p| matches!(p.kernel, quant::Kernel::Q8K { .. }) == q8k)
    };
    let (need8, needk) = (needs(false), needs(true));
    // A prefill of a codebook format: its tokens also laid out for the tile kernel.
    let tiled = needk && n >= 8 && parts.iter().any(|p| quant::iq_tile::takes(p.w.dtype));
    ACT_Q8.with(|a8| {
        ACT_Q8K.with(|ak| {
            ACT_TILE.with(|at| {
                let (mut a8, mut ak, mut at) = (a8.borrow_mut(), ak.borrow_mut(), at.borrow_mut());
                let (per8, perk) = (k / QK8, k / quant::k_quants::QK_K);
                let quantize = |t: usize, q8: &mut [BlockQ8], qk: &mut [BlockQ8K]| {
                    let row = input(t);
                    debug_assert_eq!(row.len(), k);
                    if need8 {
                        quant::q8::quantize_q8(row, q8);
                    }
                    if needk {
                        quant::q8::quantize_q8k(row, qk);
                    }
                };
                a8.clear();
                a8.resize(if need8 { n * per8 } else { 0 }, BlockQ8::default());
                ak.clear();
                ak.resize(if needk { n * perk } else { 0 }, BlockQ8K::default());
                at.reset(if tiled { n } else { 0 }, perk);
                let pt = at.shared();
                // Several tokens are quantised in the same hand-off as the matmul, one task per
                // token ahead of the matmul's tasks (a decode batch would otherwise leave the
                // other threads waiting while one quantises every stream's row); one token is
                // quantised here, as a task would cost more than it saves.
                let pre = if n > 1 && pool.threads() > 1 { n } else { 0 };
                let (p8, pk) = (SharedMut(a8.as_mut_ptr()), SharedMut(ak.as_mut_ptr()));
                let (len8, lenk) = (if need8 { per8 } else { 0 }, if needk { perk } else { 0 });
                // Token t's blocks, which only its quantisation writes.
                // SAFETY: in bounds (the buffers were sized for n tokens, or are empty with a
                // length of zero); the caller quantises token t once, before any slice of its
                // blocks is read.
                // Token t's bytes of the tile layout are likewise written only by its quantisation.
                let quantize_token = |t: usize| unsafe {
                    let qk = pk.slice(t * lenk, lenk);
                    quantize(t, p8.slice(t * len8, len8), qk);
                    if tiled {
                        pt.put(t, qk);
                    }
                };
                if pre == 0 {
                    (0..n).for_each(quantize_token);
                }
                // SAFETY (both): the blocks of every token are written (by the prologue tasks or
                // above) before any matmul task reads them, and not written again in this call.
                let act8 = |t: usize| unsafe { p8.slice_ref(t * len8, len8) };
                let actk = |t: usize| unsafe { pk.slice_ref(t * lenk, lenk) };
                let tile = tiled.then_some(pt);
                run_parts(pool, pre, &quantize_token, parts, &|p, rows| {
                    run_rows(p, rows, n, &act8, &actk, tile, dst)
                });
            })
        })
    })
}

/// A pass's unit of work: a matrix part whose rows go to the threads in tasks of its size.
trait HasPart<'w> {
    fn part(&self) -> &QuantPart<'w>;
}

impl<'w> HasPart<'w> for QuantPart<'w> {
    fn part(&self) -> &QuantPart<'w> {
        self
    }
}

/// One hand-off to the threads: `pre` prologue tasks, then every part's rows in tasks of the
/// part's size (`run(part, rows)`). `run_after` has every prologue task claimed, by a thread
/// that does not wait, before any part's task starts, and a part's task waits until every
/// prologue task has ended (Release by each, Acquire here): the prologue may write what the
/// parts read.
fn run_parts<'w, P: HasPart<'w> + Sync>(
    pool: &ThreadPool,
    pre: usize,
    prologue: &(dyn Fn(usize) + Sync),
    parts: &[P],
    run: &(dyn Fn(&P, std::ops::Range<usize>) + Sync),
) {
    // Each part's first task.
    let starts: Vec<usize> = parts
        .iter()
        .scan(0, |next, p| {
            let first = *next;
            *next += p.part().n_tasks;
            Some(first)
        })
        .collect();
    let total: usize = parts.iter().map(|p| p.part().n_tasks).sum();
    let ready = AtomicUsize::new(0);
    pool.run_after(pre, pre + total, &|task| {
        if task < pre {
            // Counted even if the prologue panics, so the tasks waiting below end and the
            // pool can hand the panic to the caller.
            let _counted = Count(&ready);
            prologue(task);
            return;
        }
        let mut spins = 0;
        while ready.load(Ordering::Acquire) < pre {
            pool::relax(spins);
            spins = spins.saturating_add(1);
        }
        let task = task - pre;
        let pi = starts.partition_point(|&s| s <= task) - 1;
        let (part, local) = (parts[pi].part(), task - starts[pi]);
        let rows = local * part.per_task..((local + 1) * part.per_task).min(part.w.rows);
        run(&parts[pi], rows);
    });
}

/// Rows `rows` of a part for `n` tokens, whose 8-bit rows `q8(t)` or `qk(t)` its kernel reads
/// (a codebook format on the tile layout `tile`, where there is one).
fn run_rows<'a>(
    p: &QuantPart,
    rows: std::ops::Range<usize>,
    n: usize,
    q8: &impl Fn(usize) -> &'a [quant::q8::BlockQ8],
    qk: &impl Fn(usize) -> &'a [quant::q8::BlockQ8K],
    tile: Option<quant::iq_tile::TokensPtr>,
    dst: SharedMut,
) {
    match p.kernel {
        quant::Kernel::Q8 {
            dot,
            dot4,
            rows4,
            dot2x4,
        } => quantized_rows(p, rows, n, q8, None, dst, dot, dot4, rows4, dot2x4),
        quant::Kernel::Q8K {
            dot,
            dot4,
            rows4,
            dot2x4,
        } => quantized_rows(p, rows, n, qk, tile, dst, dot, dot4, rows4, dot2x4),
    }
}

/// Adds one (Release) when dropped, on return or unwind.
struct Count<'a>(&'a AtomicUsize);

impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// One task of [`quantized_matmuls`]: rows `rows` of part `p` for all `n` tokens.
#[allow(clippy::too_many_arguments)]
fn quantized_rows<'a, B: PackedRows>(
    p: &QuantPart,
    rows: std::ops::Range<usize>,
    n: usize,
    act: &impl Fn(usize) -> &'a [B],
    tile: Option<quant::iq_tile::TokensPtr>,
    dst: SharedMut,
    dot: fn(&[u8], &[B]) -> f32,
    dot4: fn(&[u8], [&[B]; 4]) -> [f32; 4],
    rows4: fn([&[u8]; 4], &[B]) -> [f32; 4],
    dot2x4: quant::Dot2x4<B>,
) {
    let (w, bias, ov) = (p.w, p.bias, p.ov);
    let write = |t: usize, j: usize, v: f32| {
        let b = bias.map_or(0.0, |b| b[j]);
        // SAFETY: in bounds (checked by the caller); column j is this task's.
        unsafe { dst.write(ov.offset + t * ov.stride + j, v + b) };
    };
    // A packed group's eight results go out in one copy.
    let write8 = |t: usize, j: usize, v: &[f32; quant::packed::ROWS]| {
        // SAFETY: in bounds (checked by the caller); columns j..j+8 are this task's.
        let d = unsafe { dst.slice(ov.offset + t * ov.stride + j, v.len()) };
        match bias {
            Some(b) => {
                for ((d, v), b) in d.iter_mut().zip(v).zip(&b[j..j + v.len()]) {
                    *d = v + b;
                }
            }
            None => d.copy_from_slice(v),
        }
    };
    let mut first = B::run(w, rows.clone(), n, act, &write8);
    let stored = w.file_rows();
    if n < 4 {
        // Decode: four weight rows per pass keep four memory streams in flight.
        while first + 4 <= rows.end {
            let wr = [0, 1, 2, 3].map(|r| stored.row(first + r));
            for t in 0..n {
                let v = rows4(wr, act(t));
                for (r, vr) in v.iter().enumerate() {
                    write(t, first + r, *vr);
                }
            }
            first += 4;
        }
    }
    // A codebook format's prefill: rows decoded once, eight at a time (their decoding costs
    // more than the products), against sixteen tokens a pass; the row kernels' bits.
    if let Some(tile) = tile.filter(|t| t.tokens() == n && quant::iq_tile::takes(w.dtype)) {
        use quant::iq_tile::{ROWS, TOKENS};
        DECODED.with(|d| {
            let mut d = d.borrow_mut();
            d.resize_with(TILE_CHUNK, Default::default);
            while first < rows.end {
                // Up to TILE_CHUNK groups of up to eight rows each.
                let mut groups = 0;
                let mut at = first;
                while groups < TILE_CHUNK && at < rows.end {
                    let r = (rows.end - at).min(ROWS);
                    let wr: [&[u8]; ROWS] = std::array::from_fn(|k| stored.row(at + k.min(r - 1)));
                    let decoded = match w.recoded {
                        Some(form) => {
                            quant::iq_tile::decode_recoded_rows(form, &wr[..r], &mut d[groups])
                        }
                        None => quant::iq_tile::decode_rows(w.dtype, &wr[..r], &mut d[groups]),
                    };
                    if !decoded {
                        break;
                    }
                    groups += 1;
                    at += r;
                }
                if groups == 0 {
                    break;
                }
                for j in 0..tile.count() {
                    // SAFETY: j in range; every token was written before the matmul's tasks
                    // began (`quantized_matmuls`), and the buffer lives until they end.
                    let block = unsafe { tile.block(j) };
                    let mut row = first;
                    for g in &d[..groups] {
                        let v = quant::iq_tile::dot(g, block);
                        let tokens = (n - TOKENS * j).min(TOKENS);
                        if g.len() == ROWS {
                            // A token's eight results in one copy.
                            let by_token: [[f32; ROWS]; TOKENS] =
                                std::array::from_fn(|i| std::array::from_fn(|k| v[k][i]));
                            for (i, x) in by_token.iter().enumerate().take(tokens) {
                                write8(TOKENS * j + i, row, x);
                            }
                        } else {
                            for (k, v) in v.iter().enumerate().take(g.len()) {
                                for (i, &x) in v.iter().enumerate().take(tokens) {
                                    write(TOKENS * j + i, row + k, x);
                                }
                            }
                        }
                        row += g.len();
                    }
                }
                first = at;
            }
        });
    }
    // Prefill: two weight rows × four tokens per pass where possible (each activation block
    // loaded once for both rows), then single rows. Every kernel shape gives a (row, token)
    // pair the same arithmetic, so results do not depend on how rows or tokens are grouped.
    let mut j = first;
    while j < rows.end {
        let pair = j + 1 < rows.end;
        let mut t = 0;
        while t + 4 <= n {
            let a4 = [act(t), act(t + 1), act(t + 2), act(t + 3)];
            if pair {
                let v = dot2x4([stored.row(j), stored.row(j + 1)], a4);
                for (r, vr) in v.iter().enumerate() {
                    for (i, vi) in vr.iter().enumerate() {
                        write(t + i, j + r, *vi);
                    }
                }
            } else {
                let v = dot4(stored.row(j), a4);
                for (i, vi) in v.iter().enumerate() {
                    write(t + i, j, *vi);
                }
            }
            t += 4;
        }
        for t in t..n {
            write(t, j, dot(stored.row(j), act(t)));
            if pair {
                write(t, j + 1, dot(stored.row(j + 1), act(t)));
            }
        }
        j += if pair { 2 } else { 1 };
    }
}

/// `glu`'s shape checks (gate/up rows `xv` of a buffer of `x_len`, output rows `ov` of one
/// of `out_len`); returns the output width.
fn check_glu(xv: Rows, x_len: usize, ov: Rows, out_len: usize) -> usize {
    let f = ov.width();
    assert_eq!(xv.width(), 2 * f);
    assert_eq!(xv.count, ov.count);
    check_view("glu x", xv, x_len);
    check_view("glu out", ov, out_len);
    f
}

/// `len` floats of `scratch` from a 32-byte boundary. A row there is read by whole AVX2 loads
/// that never straddle two cache lines; from the allocator's 16-byte alignment every other
/// load did, and the f32 dot products ran about a quarter slower.
fn aligned(scratch: &mut Vec<f32>, len: usize) -> &mut [f32] {
    scratch.resize(len + 8, 0.0);
    let off = scratch.as_ptr().align_offset(32).min(8);
    &mut scratch[off..off + len]
}

/// `1 / sqrt(mean(x²) + eps)`, accumulated in f64 so long rows lose nothing to rounding.
fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let ss = simd::sum_sq_f64(x);
    let mean = (ss / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

#[cfg(test)]
mod tests;
