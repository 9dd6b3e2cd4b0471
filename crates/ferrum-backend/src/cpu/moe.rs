//! The CPU backend's MoE layer: every active expert's products on the integer path, in a
//! few hand-offs to the threads a layer.
//!
//! The default composition ([`crate::moe_ffn_default`]) runs each active expert as its own
//! matrix products: its tokens gathered and quantised, gate and up in one hand-off, the GLU
//! and down in a second. A 128-expert layer's prefill is then some 256 hand-offs of a few
//! hundred microseconds of work each, and every token is quantised once for each of its
//! experts.
//! - [`decode`] (one token): every selected expert's gate and up rows in one hand-off, every
//!   down row in a second.
//! - [`prefill`]: each token quantised once; then, a group of experts at a time, every gate
//!   and up of the group in one hand-off and every GLU and down in a second. A group holds
//!   at most [`GROUP_ROWS`] (token, expert) rows, so its intermediate rows stay in the
//!   cache between the two.
//!
//! Both give the default composition's bits (tested): the same kernels meet the same
//! quantised rows (a token's blocks are the same wherever it is quantised), and the results
//! are added to the output in the same order.

use std::cell::RefCell;

use super::quant::{self, iq_tile, q8::BlockQ8, q8::BlockQ8K, Kernel};
use super::{check_view, packed_unit, simd, ActRow, CpuBackend, CpuWeight};
use super::{run_parts, run_rows, HasPart, QuantPart, SharedMut, SCRATCH};
use crate::{Activation, Backend, ExpertBatch, ExpertWeights, MoeScratch, Rows};

/// (token, expert) rows a group of experts holds at most, unless one expert alone has more:
/// a group's gate/up rows (2 · 768 values a row in Qwen3-30B-A3B's shape) and down rows
/// (2048) then take some 14 MB, which the last-level cache keeps between the two passes.
const GROUP_ROWS: usize = 1024;

/// Rows a prologue task of the down pass takes through the GLU and quantisation.
const GLU_ROWS: usize = 8;

thread_local! {
    /// The layer's tokens, quantised once for every expert's gate and up.
    static X_Q8: RefCell<Vec<BlockQ8>> = const { RefCell::new(Vec::new()) };
    static X_Q8K: RefCell<Vec<BlockQ8K>> = const { RefCell::new(Vec::new()) };
    /// A group's GLU rows, quantised for the down projections.
    static A_Q8: RefCell<Vec<BlockQ8>> = const { RefCell::new(Vec::new()) };
    static A_Q8K: RefCell<Vec<BlockQ8K>> = const { RefCell::new(Vec::new()) };
    /// Each expert's tokens laid out for the codebook formats' tile kernel: gate/up's, down's.
    static TILES: RefCell<(Vec<iq_tile::Tokens>, Vec<iq_tile::Tokens>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
    /// A prologue task's GLU row before it is quantised.
    static GLU_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Whether the matrix runs on the integer path, and with which activation format.
fn integer(w: &CpuWeight) -> Option<bool> {
    match (w.precise, w.kernel) {
        (false, Some(Kernel::Q8 { .. })) => Some(false),
        (false, Some(Kernel::Q8K { .. })) => Some(true),
        _ => None,
    }
}

/// Which activation formats a set of matrices needs: (Q8, Q8_K).
fn formats<'w>(ws: impl Iterator<Item = &'w CpuWeight>) -> (bool, bool) {
    ws.fold((false, false), |(a, b), w| match integer(w) {
        Some(true) => (a, true),
        Some(false) => (true, b),
        None => (a, b),
    })
}

/// Whether an expert's tokens are laid out for the tile kernel of one of these matrices, as
/// [`super::quantized_matmuls`] decides for a matrix product of `m` tokens.
fn tiled(m: usize, needk: bool, ws: &[&CpuWeight]) -> bool {
    needk && m >= 8 && ws.iter().any(|w| iq_tile::takes(w.dtype))
}

/// Decode (one token): all selected experts' gate and up rows in one parallel pass, then
/// every output row as the routing-weighted sum over the experts' down rows in a second
/// pass — two hand-offs per layer instead of three per expert. Same arithmetic, in the
/// same order, as the default composition (tested). No biases.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode(
    be: &CpuBackend,
    x: &[f32],
    xv: Rows,
    experts: &[ExpertWeights<CpuWeight>],
    batches: &[ExpertBatch],
    scratch: &mut MoeScratch<Vec<f32>>,
    out: &mut [f32],
    ov: Rows,
    act: Activation,
) {
    check_view("moe x", xv, x.len());
    check_view("moe out", ov, out.len());
    let sel: Vec<(&ExpertWeights<CpuWeight>, f32)> = batches
        .iter()
        .map(|b| (&experts[b.expert], b.weights[0]))
        .collect();
    let Some(first) = sel.first() else {
        return out[ov.offset..ov.offset + ov.width()].fill(0.0);
    };
    let (f, h) = (first.0.gate.rows, first.0.gate.cols);
    let k = sel.len();
    let xin = ActRow::new(
        &x[xv.offset..xv.offset + h],
        sel.iter().flat_map(|(e, _)| [&e.gate, &e.up]),
    );
    // Pass 1: gate and up rows of every selected expert; scratch.gu holds k rows of [gate | up].
    let gu_len = k * 2 * f;
    if scratch.gu.len() < gu_len {
        scratch.gu.resize(gu_len, 0.0);
    }
    let gu = SharedMut(scratch.gu.as_mut_ptr());
    // Rows go in units of a packed group when every matrix a pass reads is packed whole
    // (then its row count is a multiple of 8 and a unit never straddles two matrices).
    let unit = packed_unit(sel.iter().flat_map(|(e, _)| [&e.gate, &e.up]));
    let units = k * 2 * f / unit;
    let per_task = (units / (be.threads * 8)).clamp(1, 256);
    be.pool.run(units.div_ceil(per_task), &|task| {
        SCRATCH.with(|sc| {
            let mut sc = sc.borrow_mut();
            let mut v = [0f32; 2 * quant::packed::ROWS];
            for u in task * per_task..((task + 1) * per_task).min(units) {
                let r = u * unit;
                let (slot, within) = (r / (2 * f), r % (2 * f));
                let e = sel[slot].0;
                let w = if within < f { &e.gate } else { &e.up };
                w.dot_rows(within % f, &xin, &mut v[..unit], &mut sc);
                for (i, &vi) in v[..unit].iter().enumerate() {
                    // SAFETY: r + i < gu_len; each row is written by one task.
                    unsafe { gu.write(r + i, vi) };
                }
            }
        })
    });
    if scratch.act.len() < k * f {
        scratch.act.resize(k * f, 0.0);
    }
    be.glu(
        &scratch.gu,
        Rows::dense(k, 2 * f),
        &mut scratch.act,
        Rows::dense(k, f),
        act,
    );
    let acts: Vec<ActRow> = sel
        .iter()
        .enumerate()
        .map(|(slot, (e, _))| {
            ActRow::new(
                &scratch.act[slot * f..(slot + 1) * f],
                [&e.down].into_iter(),
            )
        })
        .collect();
    // Pass 2: each selected expert's down rows into scratch.y (k rows of h), each task one
    // contiguous run of one expert's matrix, as in pass 1; then every output element is
    // the weighted sum over the experts, in expert order.
    let unit = packed_unit(sel.iter().map(|(e, _)| &e.down));
    let ys = k * h;
    if scratch.y.len() < ys {
        scratch.y.resize(ys, 0.0);
    }
    let yp = SharedMut(scratch.y.as_mut_ptr());
    let units = ys / unit;
    let per_task = (units / (be.threads * 8)).clamp(1, 256);
    be.pool.run(units.div_ceil(per_task), &|task| {
        SCRATCH.with(|sc| {
            let mut sc = sc.borrow_mut();
            let mut v = [0f32; 2 * quant::packed::ROWS];
            for u in task * per_task..((task + 1) * per_task).min(units) {
                let r = u * unit;
                let (slot, row) = (r / h, r % h);
                sel[slot]
                    .0
                    .down
                    .dot_rows(row, &acts[slot], &mut v[..unit], &mut sc);
                for (i, &vi) in v[..unit].iter().enumerate() {
                    // SAFETY: r + i < ys; each row is written by one task.
                    unsafe { yp.write(r + i, vi) };
                }
            }
        })
    });
    let o = &mut out[ov.offset..ov.offset + h];
    o.fill(0.0);
    for ((_, wgt), y) in sel.iter().zip(scratch.y.chunks_exact(h)) {
        for (o, &yi) in o.iter_mut().zip(y) {
            *o += wgt * yi;
        }
    }
}

/// The prefill's expert products; `false`, with nothing done, where a matrix of an active
/// expert is off the integer path or the shapes disagree (the caller then runs the default
/// composition, which reports a bad shape).
#[allow(clippy::too_many_arguments)]
pub(super) fn prefill(
    be: &CpuBackend,
    x: &[f32],
    xv: Rows,
    experts: &[ExpertWeights<CpuWeight>],
    batches: &[ExpertBatch],
    scratch: &mut MoeScratch<Vec<f32>>,
    out: &mut [f32],
    ov: Rows,
    act: Activation,
) -> bool {
    prefill_in_groups(
        be, x, xv, experts, batches, scratch, out, ov, act, GROUP_ROWS,
    )
}

/// [`prefill`] with groups of at most `group_rows` rows (tests take small groups).
#[allow(clippy::too_many_arguments)]
pub(super) fn prefill_in_groups(
    be: &CpuBackend,
    x: &[f32],
    xv: Rows,
    experts: &[ExpertWeights<CpuWeight>],
    batches: &[ExpertBatch],
    scratch: &mut MoeScratch<Vec<f32>>,
    out: &mut [f32],
    ov: Rows,
    act: Activation,
    group_rows: usize,
) -> bool {
    let (n, h) = (xv.count, xv.width());
    let Some(first) = batches.first() else {
        return false;
    };
    let Some(f) = experts.get(first.expert).map(|e| e.gate.rows) else {
        return false;
    };
    let fits = |b: &ExpertBatch| {
        let Some(e) = experts.get(b.expert) else {
            return false;
        };
        let shapes = [(&e.gate, f, h), (&e.up, f, h), (&e.down, h, f)];
        shapes
            .iter()
            .all(|(w, r, c)| w.rows == *r && w.cols == *c && integer(w).is_some())
            && b.tokens.len() == b.weights.len()
            && b.tokens.iter().all(|&t| (t as usize) < n)
    };
    if ov.width() != h || ov.count != n || !batches.iter().all(fits) {
        return false;
    }
    check_view("moe x", xv, x.len());
    check_view("moe out", ov, out.len());
    let used = || batches.iter().map(|b| &experts[b.expert]);
    let (need8, needk) = formats(used().flat_map(|e| [&e.gate, &e.up]));
    let (per8, perk) = (h / quant::q8::QK8, h / quant::k_quants::QK_K);
    for t in 0..n {
        out[ov.offset + t * ov.stride..][..h].fill(0.0);
    }
    X_Q8.with(|x8| {
        X_Q8K.with(|xk| {
            let (mut x8, mut xk) = (x8.borrow_mut(), xk.borrow_mut());
            x8.clear();
            x8.resize(if need8 { n * per8 } else { 0 }, BlockQ8::default());
            xk.clear();
            xk.resize(if needk { n * perk } else { 0 }, BlockQ8K::default());
            let (p8, pk) = (SharedMut(x8.as_mut_ptr()), SharedMut(xk.as_mut_ptr()));
            let (len8, lenk) = (if need8 { per8 } else { 0 }, if needk { perk } else { 0 });
            let per_task = n.div_ceil(be.threads * 4).max(1);
            be.pool.run(n.div_ceil(per_task), &|task| {
                for t in task * per_task..((task + 1) * per_task).min(n) {
                    let row = &x[xv.offset + t * xv.stride..][..h];
                    // SAFETY: token t's blocks are in bounds (sized for n tokens) and written
                    // by this task alone.
                    unsafe {
                        if need8 {
                            quant::q8::quantize_q8(row, p8.slice(t * len8, len8));
                        }
                        if needk {
                            quant::q8::quantize_q8k(row, pk.slice(t * lenk, lenk));
                        }
                    }
                }
            });
            let xq = Quantised {
                q8: &x8,
                qk: &xk,
                per8: len8,
                perk: lenk,
            };
            let mut from = 0;
            while from < batches.len() {
                let mut to = from + 1;
                let mut rows = batches[from].tokens.len();
                while to < batches.len() && rows + batches[to].tokens.len() <= group_rows {
                    rows += batches[to].tokens.len();
                    to += 1;
                }
                let group = Group {
                    experts,
                    batches: &batches[from..to],
                    f,
                    h,
                };
                group.run(be, &xq, scratch, act);
                group.scatter(scratch, out, ov);
                from = to;
            }
        })
    });
    true
}

/// A token's quantised blocks in each activation format.
struct Quantised<'a> {
    q8: &'a [BlockQ8],
    qk: &'a [BlockQ8K],
    per8: usize,
    perk: usize,
}

impl Quantised<'_> {
    fn q8(&self, t: usize) -> &[BlockQ8] {
        &self.q8[t * self.per8..][..self.per8]
    }
    fn qk(&self, t: usize) -> &[BlockQ8K] {
        &self.qk[t * self.perk..][..self.perk]
    }
}

/// Experts whose rows go to the threads together.
struct Group<'a> {
    experts: &'a [ExpertWeights<CpuWeight>],
    batches: &'a [ExpertBatch<'a>],
    f: usize,
    h: usize,
}

/// One matrix of one expert in a pass.
struct Job<'a> {
    part: QuantPart<'a>,
    /// The expert's place in the group.
    slot: usize,
}

impl Group<'_> {
    /// Each expert's first row in the group's intermediate buffers, and the rows in all.
    fn starts(&self) -> (Vec<usize>, usize) {
        let mut next = 0;
        let starts = self
            .batches
            .iter()
            .map(|b| {
                let s = next;
                next += b.tokens.len();
                s
            })
            .collect();
        (starts, next)
    }

    fn expert(&self, slot: usize) -> &ExpertWeights<CpuWeight> {
        &self.experts[self.batches[slot].expert]
    }

    /// Gate and up of every expert into `scratch.gu` (a row of `[gate | up]` per (token,
    /// expert)), then the GLU and down of every expert into `scratch.y`.
    fn run(
        &self,
        be: &CpuBackend,
        xq: &Quantised,
        scratch: &mut MoeScratch<Vec<f32>>,
        act: Activation,
    ) {
        let (f, h) = (self.f, self.h);
        let (starts, rows) = self.starts();
        if scratch.gu.len() < rows * 2 * f {
            scratch.gu.resize(rows * 2 * f, 0.0);
        }
        if scratch.y.len() < rows * h {
            scratch.y.resize(rows * h, 0.0);
        }
        let bias = |slot: usize, i: usize| self.expert(slot).biases.as_ref().map(|b| &b[i]);
        TILES.with(|tiles| {
            let mut tiles = tiles.borrow_mut();
            let (up_tiles, down_tiles) = &mut *tiles;
            for t in [&mut *up_tiles, &mut *down_tiles] {
                if t.len() < self.batches.len() {
                    t.resize_with(self.batches.len(), Default::default);
                }
            }
            // Gate and up.
            let gu_len = scratch.gu.len();
            let mut jobs = Vec::with_capacity(2 * self.batches.len());
            let mut tile_ptrs = Vec::with_capacity(self.batches.len());
            for (slot, b) in self.batches.iter().enumerate() {
                let (e, m) = (self.expert(slot), b.tokens.len());
                if m == 0 {
                    tile_ptrs.push(None);
                    continue;
                }
                let xv = Rows::dense(m, h);
                for (i, w) in [&e.gate, &e.up].into_iter().enumerate() {
                    let ov = Rows {
                        offset: starts[slot] * 2 * f + i * f,
                        ..Rows::columns(m, 2 * f, 0, f)
                    };
                    // Checked by `prefill`: every matrix of the group has a kernel.
                    if let Some(part) = be.quant_part(xv, w, bias(slot, i), ov, gu_len) {
                        jobs.push(Job { part, slot });
                    }
                }
                let tile = tiled(m, !xq.qk.is_empty(), &[&e.gate, &e.up]).then(|| {
                    up_tiles[slot].reset(m, xq.perk);
                    up_tiles[slot].shared()
                });
                tile_ptrs.push(tile);
            }
            let tiled_slots: Vec<usize> = (0..self.batches.len())
                .filter(|&s| tile_ptrs[s].is_some())
                .collect();
            let dst = SharedMut(scratch.gu.as_mut_ptr());
            run_parts(
                &be.pool,
                tiled_slots.len(),
                &|task| {
                    let slot = tiled_slots[task];
                    if let Some(tile) = tile_ptrs[slot] {
                        for (i, &t) in self.batches[slot].tokens.iter().enumerate() {
                            // SAFETY: this expert's layout is written by this task alone,
                            // and read only after every prologue task has ended.
                            unsafe { tile.put(i, xq.qk(t as usize)) };
                        }
                    }
                },
                &jobs,
                &|job, rows| {
                    let tok = self.batches[job.slot].tokens;
                    run_rows(
                        &job.part,
                        rows,
                        tok.len(),
                        &|t| xq.q8(tok[t] as usize),
                        &|t| xq.qk(tok[t] as usize),
                        tile_ptrs[job.slot],
                        dst,
                    )
                },
            );
            // The GLU and down: each (token, expert) row's GLU computed and quantised by a
            // prologue task, then every expert's down rows.
            let (need8, needk) = formats(self.batches.iter().map(|b| &self.experts[b.expert].down));
            let (per8, perk) = (f / quant::q8::QK8, f / quant::k_quants::QK_K);
            let (len8, lenk) = (if need8 { per8 } else { 0 }, if needk { perk } else { 0 });
            let y_len = scratch.y.len();
            let mut jobs = Vec::with_capacity(self.batches.len());
            let mut tile_ptrs = Vec::with_capacity(self.batches.len());
            for (slot, b) in self.batches.iter().enumerate() {
                let (e, m) = (self.expert(slot), b.tokens.len());
                if m == 0 {
                    tile_ptrs.push(None);
                    continue;
                }
                let ov = Rows {
                    offset: starts[slot] * h,
                    ..Rows::dense(m, h)
                };
                if let Some(part) =
                    be.quant_part(Rows::dense(m, f), &e.down, bias(slot, 2), ov, y_len)
                {
                    jobs.push(Job { part, slot });
                }
                let tile = tiled(m, needk, &[&e.down]).then(|| {
                    down_tiles[slot].reset(m, perk);
                    down_tiles[slot].shared()
                });
                tile_ptrs.push(tile);
            }
            A_Q8.with(|a8| {
                A_Q8K.with(|ak| {
                    let (mut a8, mut ak) = (a8.borrow_mut(), ak.borrow_mut());
                    a8.clear();
                    a8.resize(rows * len8, BlockQ8::default());
                    ak.clear();
                    ak.resize(rows * lenk, BlockQ8K::default());
                    let (p8, pk) = (SharedMut(a8.as_mut_ptr()), SharedMut(ak.as_mut_ptr()));
                    let gu = &scratch.gu;
                    let dst = SharedMut(scratch.y.as_mut_ptr());
                    run_parts(
                        &be.pool,
                        rows.div_ceil(GLU_ROWS),
                        &|task| {
                            GLU_ROW.with(|g| {
                                let mut g = g.borrow_mut();
                                g.resize(f, 0.0);
                                for r in task * GLU_ROWS..((task + 1) * GLU_ROWS).min(rows) {
                                    let slot = starts.partition_point(|&s| s <= r) - 1;
                                    let row = &gu[r * 2 * f..][..2 * f];
                                    simd::glu(&row[..f], &row[f..], &mut g, act);
                                    // SAFETY: row r's blocks are in bounds (sized for `rows`)
                                    // and written by this task alone, as is row r's token of
                                    // its expert's layout; all are read only after every
                                    // prologue task has ended.
                                    unsafe {
                                        if need8 {
                                            quant::q8::quantize_q8(&g, p8.slice(r * len8, len8));
                                        }
                                        if needk {
                                            let qk = pk.slice(r * lenk, lenk);
                                            quant::q8::quantize_q8k(&g, qk);
                                            if let Some(tile) = tile_ptrs[slot] {
                                                tile.put(r - starts[slot], qk);
                                            }
                                        }
                                    }
                                }
                            })
                        },
                        &jobs,
                        &|job, rows| {
                            let s = starts[job.slot];
                            let m = self.batches[job.slot].tokens.len();
                            // SAFETY (both): the rows were written by the prologue, which has
                            // ended, and are not written again in this pass.
                            run_rows(
                                &job.part,
                                rows,
                                m,
                                &|t| unsafe { p8.slice_ref((s + t) * len8, len8) },
                                &|t| unsafe { pk.slice_ref((s + t) * lenk, lenk) },
                                tile_ptrs[job.slot],
                                dst,
                            )
                        },
                    );
                })
            });
        });
    }

    /// Each expert's down rows, weighted, added to its tokens' output rows: experts in the
    /// order of the batches, as the default composition adds them.
    fn scatter(&self, scratch: &MoeScratch<Vec<f32>>, out: &mut [f32], ov: Rows) {
        let h = self.h;
        let mut r = 0;
        for b in self.batches {
            for (&t, &c) in b.tokens.iter().zip(b.weights) {
                let o = &mut out[ov.offset + t as usize * ov.stride..][..h];
                for (o, &y) in o.iter_mut().zip(&scratch.y[r * h..(r + 1) * h]) {
                    *o += c * y;
                }
                r += 1;
            }
        }
    }
}

impl<'w> HasPart<'w> for Job<'w> {
    fn part(&self) -> &QuantPart<'w> {
        &self.part
    }
}
