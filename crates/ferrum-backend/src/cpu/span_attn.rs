//! Attention within spans of rows, with no mask and no cache: an encoder's layer (a vision
//! tower's patches, or a window of them), where every row of a span attends to every row of it.
//!
//! The paged attention serves one query row at a time against a cache, which is right for a
//! decoder but reads each key and value once per row (or per few rows). Here a task takes a
//! block of [`QB`] query rows of one head and computes their scores against all of the span's
//! keys as one small GEMM (the keys laid out transposed, in panels of [`PANEL`]), the softmax
//! of each row, then their outputs as a second GEMM against the values. Each key and value is
//! read once per block, and the tiles keep their sums in registers.
//!
//! Every score is one fused multiply-add chain over the head's dimensions, and every output
//! one chain over the keys, in order: lanes run across keys or output dimensions, never across
//! a sum. So the width of the vectors changes no bit, and the AVX-512, AVX2 and scalar
//! instances agree exactly (tested).

use super::tile::{panel_row, panel_tile, Isa, Lanes, Scalar, MS, PANEL};
use super::{pool::ThreadPool, SharedMut};
use std::cell::RefCell;

/// Query rows a task takes. Their scores (`QB` × keys, 384 KiB at 4,096 keys) stay in L2.
const QB: usize = 24;
/// Keys whose values an output pass takes at once (80 KiB at 80 dimensions, in L2): all of a
/// span's values, read once per tile of rows, came from L3 for each.
const KEYS: usize = 256;
/// Each value row is padded with zeros to a multiple of this (one 512-bit vector).
const DIM_PAD: usize = 16;

/// A span's keys and values for one head, laid out for the tiles.
struct Packed {
    /// Offset of the transposed keys: panel `p` holds keys `p·PANEL..`, dimension by
    /// dimension (`[d][PANEL]`), zero past the span's last key.
    kt: usize,
    /// Offset of the values: `[len][dp]`, zero past the head's dimensions.
    v: usize,
}

/// The shape of one call.
struct Shape {
    heads: usize,
    d: usize,
    /// `d` rounded up to [`DIM_PAD`].
    dp: usize,
    scale: f32,
}

impl Shape {
    fn width(&self) -> usize {
        self.heads * self.d
    }
    fn padded_keys(len: usize) -> usize {
        len.div_ceil(PANEL) * PANEL
    }
    /// Floats the packed keys and values of one (span, head) take.
    fn packed_len(&self, len: usize) -> usize {
        Self::padded_keys(len) * self.d + len * self.dp
    }
}

thread_local! {
    /// A task's scores (`QB` rows of padded keys) and outputs (`QB` rows of `dp`).
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention within each span `(first, len)` of the rows of `qkv` (`[n, 3·heads·d]`: every
/// row's queries, keys and values, head by head), `out` (`[n, heads·d]`) receiving each row's
/// `softmax(scale · q·kᵀ) · v` per head over the keys of its span. Rows outside every span are
/// not written. `softmax` is [`super::simd::AttnKernels::softmax`] (scale, then normalise).
#[allow(clippy::too_many_arguments)]
pub(crate) fn span_attention(
    pool: &ThreadPool,
    isa: Isa,
    softmax: fn(&mut [f32], f32),
    qkv: &[f32],
    n: usize,
    heads: usize,
    d: usize,
    spans: &[(usize, usize)],
    out: &mut [f32],
) {
    assert!(
        isa.runs(),
        "span_attention: {isa:?} does not run on this CPU"
    );
    let w = heads * d;
    assert!(qkv.len() >= n * 3 * w, "span_attention: qkv is short");
    assert!(out.len() >= n * w, "span_attention: out is short");
    for &(first, len) in spans {
        assert!(first + len <= n, "span_attention: span past the rows");
    }
    let shape = Shape {
        heads,
        d,
        dp: d.div_ceil(DIM_PAD) * DIM_PAD,
        scale: (d as f32).powf(-0.5),
    };
    if d == 0 || heads == 0 {
        return;
    }
    // Lay out every (span, head)'s keys and values.
    let mut at = Vec::with_capacity(spans.len() * heads);
    let mut total = 0;
    for &(_, len) in spans {
        for _ in 0..heads {
            let kt = total;
            let v = kt + Shape::padded_keys(len) * d;
            at.push(Packed { kt, v });
            total += shape.packed_len(len);
        }
    }
    let mut packed = vec![0f32; total];
    let dst = SharedMut(packed.as_mut_ptr());
    pool.run(at.len(), &|i| {
        let (first, len) = spans[i / heads];
        let h = i % heads;
        let p = &at[i];
        // SAFETY: this (span, head)'s part of `packed` is this task's alone.
        let kt = unsafe { dst.slice(p.kt, Shape::padded_keys(len) * d) };
        let v = unsafe { dst.slice(p.v, len * shape.dp) };
        for j in 0..len {
            let row = &qkv[(first + j) * 3 * w..][..3 * w];
            let key = &row[w + h * d..][..d];
            let panel = &mut kt[(j / PANEL) * PANEL * d..][..PANEL * d];
            for (c, &x) in key.iter().enumerate() {
                panel[c * PANEL + j % PANEL] = x;
            }
            v[j * shape.dp..][..d].copy_from_slice(&row[2 * w + h * d..][..d]);
        }
    });
    // Then blocks of query rows: tasks in (span, head, block) order.
    let blocks: Vec<usize> = spans.iter().map(|s| s.1.div_ceil(QB)).collect();
    let mut starts = Vec::with_capacity(spans.len() + 1);
    let mut n_tasks = 0;
    for &b in &blocks {
        starts.push(n_tasks);
        n_tasks += b * heads;
    }
    let o = SharedMut(out.as_mut_ptr());
    let packed = &packed;
    pool.run(n_tasks, &|task| {
        let s = starts.partition_point(|&x| x <= task) - 1;
        let r = task - starts[s];
        let (h, b) = (r / blocks[s], r % blocks[s]);
        let job = Job {
            shape: &shape,
            qkv,
            packed,
            at: &at[s * heads + h],
            span: spans[s],
            head: h,
            rows: b * QB..((b + 1) * QB).min(spans[s].1),
            softmax,
            out: o,
        };
        TILE.with(|t| {
            let t = &mut t.borrow_mut();
            // SAFETY: the instance runs on this CPU (asserted above); the job's rows of head
            // `h` are this task's alone.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Zmm => block_zmm(&job, t),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Ymm => block_ymm(&job, t),
                    _ => block::<Scalar, 2, 6, 2>(&job, t),
                }
            }
        })
    });
}

/// One task: rows `rows` of span `span` (relative to its first row), head `head`.
struct Job<'a> {
    shape: &'a Shape,
    qkv: &'a [f32],
    packed: &'a [f32],
    at: &'a Packed,
    span: (usize, usize),
    head: usize,
    rows: std::ops::Range<usize>,
    softmax: fn(&mut [f32], f32),
    out: SharedMut,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block_zmm(job: &Job, tile: &mut Vec<f32>) {
    // 6 × 4 score sums and 4 × 5 output sums, of the 32 registers.
    block::<super::tile::x86::Zmm, 4, 4, 5>(job, tile)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_ymm(job: &Job, tile: &mut Vec<f32>) {
    // 6 × 2 score sums and 6 × 2 output sums, of the 16 registers.
    block::<super::tile::x86::Ymm, 2, 6, 2>(job, tile)
}

/// Score tiles of 6 rows × `NR` vectors of keys; output tiles of `MO` rows × up to `CV`
/// vectors of dimensions (`CV` at most 5). `tile` is the task's scratch (scores, then outputs). No closure
/// in here or below calls `V`'s methods: a closure does not take the instruction set of the
/// function around it, so they would not be inlined.
///
/// # Safety
/// `V`'s instruction set is the CPU's; the job's output rows are its own.
#[inline(always)]
unsafe fn block<V: Lanes, const NR: usize, const MO: usize, const CV: usize>(
    job: &Job,
    tile: &mut Vec<f32>,
) {
    let sh = job.shape;
    let (d, dp, w) = (sh.d, sh.dp, sh.width());
    let (first, len) = job.span;
    let lp = Shape::padded_keys(len);
    let nb = job.rows.len();
    let q0 = job.rows.start;
    let kt = job.packed[job.at.kt..].as_ptr();
    let vals = job.packed[job.at.v..].as_ptr();
    // The query of row `i` of the block (rows past the block's end repeat its last one, so
    // a tile is always whole; their results are dropped).
    let query = |i: usize| -> *const f32 {
        let row = first + q0 + i.min(nb - 1);
        job.qkv[row * 3 * w + job.head * d..][..d].as_ptr()
    };
    let need = QB * lp + QB * dp;
    if tile.len() < need {
        tile.resize(need, 0.0);
    }
    let (scores, outs) = tile.split_at_mut(QB * lp);
    let sp = scores.as_mut_ptr();
    // Scores: panel by panel, every row tile of the block against it (the panel, d ×
    // PANEL, stays in L1).
    for p in 0..lp / PANEL {
        let panel = kt.add(p * PANEL * d);
        for g in (0..nb).step_by(MS) {
            let mut qs = [std::ptr::null::<f32>(); MS];
            let mut ss = [std::ptr::null_mut::<f32>(); MS];
            for r in 0..MS {
                qs[r] = query(g + r);
                // Rows past the block go to rows of the tile buffer that are never read
                // (it has QB rows; g + r < QB since QB is a multiple of MS).
                ss[r] = sp.add((g + r) * lp + p * PANEL);
            }
            panel_row::<V, NR>(&qs, panel, d, &ss, false);
        }
    }
    for i in 0..nb {
        (job.softmax)(&mut scores[i * lp..i * lp + len], sh.scale);
    }
    // Outputs: the keys a stretch at a time (its values, KEYS × dp, stay in L2), every
    // tile of rows × dimensions over each stretch, its sums carried in `outs` from one
    // stretch to the next (the same chain over the keys).
    let sp = scores.as_ptr();
    let op = outs.as_mut_ptr();
    let nv = dp / V::N;
    for j0 in (0..len).step_by(KEYS) {
        let keys = (len - j0).min(KEYS);
        let more = j0 > 0;
        for g in (0..nb).step_by(MO) {
            let ps: [*const f32; MO] =
                std::array::from_fn(|r| sp.add((g + r).min(nb - 1) * lp + j0));
            let os: [*mut f32; MO] = std::array::from_fn(|r| op.add((g + r) * dp));
            let vs = vals.add(j0 * dp);
            let mut v0 = 0;
            while v0 < nv {
                let col = v0 * V::N;
                let cs: [*mut f32; MO] = std::array::from_fn(|r| os[r].add(col));
                let vp = (vs.add(col), dp);
                let cv = (nv - v0).min(CV);
                match cv {
                    1 => panel_tile::<V, MO, 1>(&ps, vp, keys, &cs, more),
                    2 => panel_tile::<V, MO, 2>(&ps, vp, keys, &cs, more),
                    3 => panel_tile::<V, MO, 3>(&ps, vp, keys, &cs, more),
                    4 => panel_tile::<V, MO, 4>(&ps, vp, keys, &cs, more),
                    _ => panel_tile::<V, MO, 5>(&ps, vp, keys, &cs, more),
                }
                v0 += cv;
            }
        }
    }
    for i in 0..nb {
        let row = first + q0 + i;
        job.out
            .copy_from(row * w + job.head * d, &outs[i * dp..i * dp + d]);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tile::tests::{instances_equal_twin, random};
    use super::*;

    /// A row's attention over its span in f64, the reference.
    fn reference(
        qkv: &[f32],
        heads: usize,
        d: usize,
        spans: &[(usize, usize)],
        n: usize,
    ) -> Vec<f64> {
        let w = heads * d;
        let mut out = vec![0f64; n * w];
        let scale = (d as f64).powf(-0.5);
        for &(first, len) in spans {
            for i in first..first + len {
                for h in 0..heads {
                    let q = &qkv[i * 3 * w + h * d..][..d];
                    let s: Vec<f64> = (first..first + len)
                        .map(|j| {
                            let k = &qkv[j * 3 * w + w + h * d..][..d];
                            q.iter()
                                .zip(k)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (jj, j) in (first..first + len).enumerate() {
                        let v = &qkv[j * 3 * w + 2 * w + h * d..][..d];
                        for c in 0..d {
                            out[i * w + h * d + c] += e[jj] / z * v[c] as f64;
                        }
                    }
                }
            }
        }
        out
    }

    /// Every instance this CPU runs gives the scalar twin's bits, and the twin is within f32
    /// rounding of the f64 reference, over head sizes off and on the vector width, spans
    /// shorter than a tile, across panel and block edges, and rows outside every span.
    #[test]
    fn instances_equal_the_scalar_twin_and_the_reference() {
        let pool = ThreadPool::new(2);
        let softmax = super::super::simd::attn_kernels().softmax;
        // (heads, head size, spans, rows)
        type Case<'a> = (usize, usize, &'a [(usize, usize)], usize);
        let cases: &[Case] = &[
            (2, 72, &[(0, 100)], 100),
            (3, 16, &[(1, 5), (6, 70)], 80),
            (1, 80, &[(0, 1), (1, 64), (65, 65)], 130),
            (2, 7, &[(0, 30), (40, 24)], 70),
        ];
        for &(heads, d, spans, n) in cases {
            let qkv = random(n * 3 * heads * d, (heads * 1000 + d) as u64, 2.0);
            let run = |isa| {
                let mut out = vec![-7f32; n * heads * d];
                span_attention(&pool, isa, softmax, &qkv, n, heads, d, spans, &mut out);
                out
            };
            let twin = run(Isa::Scalar);
            let want = reference(&qkv, heads, d, spans, n);
            let w = heads * d;
            for (i, (&a, &b)) in twin.iter().zip(&want).enumerate() {
                let inside = spans.iter().any(|&(f, l)| (f..f + l).contains(&(i / w)));
                if inside {
                    assert!(
                        (a as f64 - b).abs() < 2e-5,
                        "heads {heads} d {d} at {i}: {a} vs {b}"
                    );
                } else {
                    assert_eq!(a, -7.0, "row outside every span written");
                }
            }
            instances_equal_twin(&twin, run, &format!("heads {heads}, d {d}"));
        }
    }
}
