//! The CPU KV cache: keys or values in f32, f16 or Q8_0, and causal attention over them
//! through a sequence's block table.
//!
//! The cache is head-major: each KV head's rows, for every block in pool order, form one
//! region (`rows · head_dim` elements), then the next head's. An attention job reads one KV
//! head, so it streams contiguous runs instead of one head's slice out of every position's
//! row, and a sequence's blocks handed out one after another (as a prompt's are) are adjacent
//! too, which the hardware prefetcher follows. Measured on SmolLM2's shape: head-major within
//! each block took 11% less time than position-major rows over four sequences of 190
//! positions; head-major across blocks, a further 14% less for one sequence of 128–256
//! positions (median of 5 alternating pairs, in the engine) and 2% less for four.

use half::f16;

use super::arena::{Arena, ArenaVec};
use super::pool::ThreadPool;
use super::quant::q8_0::{BlockQ8_0, QK};
use super::{simd, SharedMut, SCRATCH, SCRATCH2};
use crate::{AttentionParams, AttnSeq, KvShape, KvTable, Rows};

/// Element format of the CPU backend's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    /// Half the memory and bandwidth; keys and values round to 11 significant bits.
    F16,
    /// About a quarter of f32: 32 values share one f16 scale. Needs a head size that is a
    /// multiple of 32.
    Q8_0,
}

impl KvDtype {
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvDtype::F32),
            "f16" => Some(KvDtype::F16),
            "q8_0" => Some(KvDtype::Q8_0),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Q8_0 => "q8_0",
        }
    }

    /// Bytes one row of `width` values takes.
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * width,
            KvDtype::F16 => 2 * width,
            KvDtype::Q8_0 => width.div_ceil(QK) * std::mem::size_of::<BlockQ8_0>(),
        }
    }
}

/// One layer's keys or values (see the module docs for the layout).
pub struct CpuKv {
    shape: KvShape,
    data: KvData,
}

enum KvData {
    F32(ArenaVec<f32>),
    F16(ArenaVec<f16>),
    Q8(ArenaVec<BlockQ8_0>),
}

impl CpuKv {
    /// A zeroed cache in `arena`, every page written now, so that it is resident from the
    /// start (what `ferrum plan` predicts, and no page faults while serving).
    pub(super) fn new(dtype: KvDtype, shape: KvShape, arena: &Arena) -> CpuKv {
        assert!(shape.block_size > 0, "KV blocks of at least one position");
        let (rows, width) = (shape.rows(), shape.width());
        let data = match dtype {
            KvDtype::F32 => KvData::F32(ArenaVec::filled(arena, rows * width, 0.0)),
            KvDtype::F16 => KvData::F16(ArenaVec::filled(arena, rows * width, f16::ZERO)),
            KvDtype::Q8_0 => {
                assert!(
                    shape.head_dim.is_multiple_of(QK),
                    "a q8_0 KV cache needs heads of whole 32-value blocks"
                );
                let zero = BlockQ8_0 {
                    d: f16::ZERO,
                    qs: [0; QK],
                };
                KvData::Q8(ArenaVec::filled(arena, rows * width / QK, zero))
            }
        };
        CpuKv { shape, data }
    }

    pub fn dtype(&self) -> KvDtype {
        match self.data {
            KvData::F32(_) => KvDtype::F32,
            KvData::F16(_) => KvDtype::F16,
            KvData::Q8(_) => KvDtype::Q8_0,
        }
    }

    pub fn rows(&self) -> usize {
        self.shape.rows()
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Stores `src` (every head of one position) at cache row `row`.
    pub(super) fn write_row(&mut self, row: usize, src: &[f32]) {
        assert!(row < self.rows(), "KV row {row} of {}", self.rows());
        assert_eq!(src.len(), self.shape.width());
        let hd = self.shape.head_dim;
        let lay = HeadMajor::of(self.shape, 1);
        for (h, x) in src.chunks_exact(hd).enumerate() {
            let o = lay.offset(row, h);
            match &mut self.data {
                KvData::F32(v) => v[o..o + hd].copy_from_slice(x),
                KvData::F16(v) => simd::f32_to_f16(x, &mut v[o..o + hd]),
                KvData::Q8(v) => {
                    for (b, x) in v[o / QK..(o + hd) / QK].iter_mut().zip(x.chunks_exact(QK)) {
                        *b = quantize_q8_0(x);
                    }
                }
            }
        }
    }
}

/// llama.cpp's reference Q8_0 rounding: scale = max|x| / 127, round to nearest.
fn quantize_q8_0(x: &[f32]) -> BlockQ8_0 {
    let amax = x.iter().fold(0f32, |m, &v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

fn dequantize_q8_0(k: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in k.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, &c) in o.iter_mut().zip(&b.qs) {
            *o = c as f32 * d;
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    pool: &ThreadPool,
    q: &[f32],
    qv: Rows,
    k: &CpuKv,
    v: &CpuKv,
    seqs: &[AttnSeq],
    out: &mut [f32],
    ov: Rows,
    p: AttentionParams,
) {
    let hd = qv.head_dim;
    assert!(k.shape == v.shape, "keys and values of different shapes");
    assert!(
        p.sinks.is_none_or(|s| s.len() == qv.heads),
        "attention: one sink per query head"
    );
    assert!(
        p.n_kv_heads == k.shape.heads && hd == k.shape.head_dim,
        "attention: {} KV heads of {hd} against a cache of {} of {}",
        p.n_kv_heads,
        k.shape.heads,
        k.shape.head_dim
    );
    for s in seqs {
        let kv_len = s.first_pos + s.rows;
        let t = s.table;
        assert_eq!(
            t.block_size, k.shape.block_size,
            "block table of another block size"
        );
        assert!(kv_len <= t.capacity(), "attention past the block table");
        // Blocks wholly behind a window are never read (a windowed KV group gives them
        // back, marking them with an id past the cache).
        let first = p
            .window
            .map_or(0, |w| (s.first_pos + 1).saturating_sub(w) / t.block_size);
        let max_row = t.blocks[first..kv_len.div_ceil(t.block_size)]
            .iter()
            .map(|&b| (b as usize + 1) * t.block_size)
            .max()
            .unwrap_or(0);
        assert!(max_row <= k.rows(), "block table past the cache");
    }
    // The same call for every element format; only the storage and its kernels differ.
    macro_rules! attend_as {
        ($kd:expr, $vd:expr, $per:expr, $to_f32:expr) => {
            attend_as!($kd, $vd, $per, $to_f32, None)
        };
        ($kd:expr, $vd:expr, $per:expr, $to_f32:expr, $direct:expr) => {
            attend(
                pool,
                q,
                qv,
                $kd,
                $vd,
                HeadMajor::of(k.shape, $per),
                seqs,
                out,
                ov,
                p,
                $to_f32,
                $direct,
            )
        };
    }
    match (&k.data, &v.data) {
        (KvData::F32(kd), KvData::F32(vd)) => {
            attend_as!(kd, vd, 1, |s: &[f32], d: &mut [f32]| d.copy_from_slice(s))
        }
        (KvData::F16(kd), KvData::F16(vd)) => {
            let kern = simd::attn_kernels();
            let direct = Direct {
                dot4: kern.dot4_f16,
                mix: kern.mix_f16,
            };
            attend_as!(kd, vd, 1, simd::f16_to_f32, Some(direct))
        }
        (KvData::Q8(kd), KvData::Q8(vd)) => {
            assert!(
                hd.is_multiple_of(QK),
                "q8_0 KV needs a head size divisible by 32"
            );
            attend_as!(kd, vd, QK, dequantize_q8_0)
        }
        _ => panic!("attention: keys and values in different formats"),
    }
}

/// Kernels that read keys and values straight from the cache at the given element offsets,
/// with the results of converting first (see [`simd::AttnKernels`]).
struct Direct<T> {
    dot4: simd::Dot4Rows<T>,
    mix: simd::MixRows<T>,
}

// By hand: derived, they would ask `T: Copy`, and function pointers are Copy for any `T`.
impl<T> Clone for Direct<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Direct<T> {}

thread_local! {
    /// Cache offsets of a job's key rows (decode).
    static OFFSETS: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Offsets into the head-major layout, in storage elements (`per` values each: 1, or 32 for
/// Q8_0 blocks).
#[derive(Clone, Copy)]
struct HeadMajor {
    rows: usize,
    head_units: usize,
}

impl HeadMajor {
    fn of(shape: KvShape, per: usize) -> HeadMajor {
        HeadMajor {
            rows: shape.rows(),
            head_units: shape.head_dim / per,
        }
    }

    /// Where head `h` of cache row `row` starts.
    fn offset(&self, row: usize, h: usize) -> usize {
        (h * self.rows + row) * self.head_units
    }
}

/// The keys (as f32) a prefill block's rows take at a time: a chunk stays in L1 while every
/// row of the block meets it.
const KEY_CHUNK_BYTES: usize = 16 * 1024;
/// The scores a prefill job holds at once (per thread): bounds how many (head, row) pairs
/// share the key chunks when the span is long.
const SCORES_BYTES: usize = 512 * 1024;

#[allow(clippy::too_many_arguments)]
fn attend<T: Sync>(
    pool: &ThreadPool,
    q: &[f32],
    qv: Rows,
    k_cache: &[T],
    v_cache: &[T],
    lay: HeadMajor,
    seqs: &[AttnSeq],
    out: &mut [f32],
    ov: Rows,
    p: AttentionParams,
    to_f32: fn(&[T], &mut [f32]),
    direct: Option<Direct<T>>,
) {
    let hd = qv.head_dim;
    let group = qv.heads / p.n_kv_heads;
    let dst = SharedMut(out.as_mut_ptr());
    let head_units = lay.head_units;
    let kern = simd::attn_kernels();
    // A job covers a block of up to ROWS query rows of one sequence: enough work to amortise
    // the hand-off and the K/V conversion in prefill, while a decode batch (one row per
    // sequence) still spreads sequences × heads over the threads in a single hand-off.
    const ROWS: usize = 16;
    // (sequence, the sequence's first row, the block's first and end rows).
    let mut blocks = Vec::new();
    let mut row = 0;
    for (si, s) in seqs.iter().enumerate() {
        let mut r = row;
        while r < row + s.rows {
            let end = (r + ROWS).min(row + s.rows);
            blocks.push((si, row, r, end));
            r = end;
        }
        row += s.rows;
    }
    // In prefill a job takes every query head of one KV head, so the block's keys and values
    // are converted once for all of them; when that leaves too few jobs to share among the
    // threads (decode of a few sequences), a job is one query head.
    let heads_per_job = if blocks.len() * p.n_kv_heads >= 4 * pool.threads() {
        group
    } else {
        1
    };
    let jobs_per_block = qv.heads / heads_per_job;
    pool.run(blocks.len() * jobs_per_block, &|job| {
        let (b, hj) = (job / jobs_per_block, job % jobs_per_block);
        let heads = hj * heads_per_job..(hj + 1) * heads_per_job;
        let (si, seq_row, lo_row, hi_row) = blocks[b];
        let (first_pos, table) = (seqs[si].first_pos, seqs[si].table);
        let kvh = heads.start / group;
        // Keys lo(first row) ..= pos(last row) cover every row of the block.
        let pos_of = |t: usize| first_pos + (t - seq_row);
        let lo_of = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let (klo, khi) = (lo_of(pos_of(lo_row)), pos_of(hi_row - 1));
        let span = khi + 1 - klo;
        let softmax = |scores: &mut [f32], h: usize| {
            let scale = match p.softcap {
                // Gemma 2's cap goes between the scaling and the softmax.
                Some(cap) => {
                    for sc in scores.iter_mut() {
                        *sc = cap * (*sc * p.scale / cap).tanh();
                    }
                    1.0
                }
                None => p.scale,
            };
            match p.sinks {
                Some(sinks) => softmax_with_sink(scores, scale, sinks[h]),
                None => (kern.softmax)(scores, scale),
            }
        };
        // Output rows of heads `h..h + g` of query row `t`, zeroed (consecutive heads'
        // rows are adjacent).
        let out_rows = |t: usize, h: usize, g: usize| {
            let oo = ov.offset + t * ov.stride + h * hd;
            // SAFETY: in bounds (checked by the caller); (t, h) belongs to this job alone,
            // and nothing else reads or writes these elements meanwhile.
            let o = unsafe { dst.slice(oo, g * hd) };
            o.fill(0.0);
            o
        };
        let q_of = |t: usize, h: usize, g: usize| {
            let qo = qv.offset + t * qv.stride + h * hd;
            &q[qo..qo + g * hd]
        };
        if let (Some(dk), 1) = (direct, hi_row - lo_row) {
            // One query row (decode): a key serves only this row's heads, so the keys and
            // values are read from the cache as they are, each vector converted once for up to
            // F16_HEADS of the job's heads (one head when decode of few sequences splits jobs
            // per head), not copied first.
            return SCRATCH2.with(|s| {
                OFFSETS.with(|offs| {
                    let (mut scores, mut offs) = (s.borrow_mut(), offs.borrow_mut());
                    offs.clear();
                    walk(table, klo, khi, lay, kvh, |o| offs.push(o));
                    scores.resize(simd::F16_HEADS * span, 0.0);
                    let mut acc = [[0f32; 4]; simd::F16_HEADS];
                    for h in heads.clone().step_by(simd::F16_HEADS) {
                        let g = (heads.end - h).min(simd::F16_HEADS);
                        let qh = q_of(lo_row, h, g);
                        for c in (0..span).step_by(4) {
                            let m = (span - c).min(4);
                            let ahead = (c + simd::PREFETCH_KEYS).min(span);
                            let ahead_end = (ahead + 4).min(span);
                            simd::prefetch_rows(k_cache, &offs[ahead..ahead_end], hd);
                            (dk.dot4)(qh, g, k_cache, &offs[c..c + m], &mut acc);
                            for (i, a) in acc[..g].iter().enumerate() {
                                let row = &mut scores[i * span + c..i * span + c + m];
                                // Four at a time as one fixed-size move: a copy of a run-time
                                // length is a call to `memcpy`, three per four keys.
                                match <&mut [f32; 4]>::try_from(&mut *row) {
                                    Ok(four) => *four = *a,
                                    Err(_) => row.copy_from_slice(&a[..m]),
                                }
                            }
                        }
                        for i in 0..g {
                            softmax(&mut scores[i * span..(i + 1) * span], h + i);
                        }
                        let o = out_rows(lo_row, h, g);
                        (dk.mix)(&scores[..g * span], g, v_cache, &offs, o);
                    }
                })
            });
        }
        let mut acc = [0f32; 8];
        SCRATCH2.with(|s| {
            SCRATCH.with(|kv| {
                let (mut scores, mut kv) = (s.borrow_mut(), kv.borrow_mut());
                // The block's keys and values as f32, converted once for all its rows (and
                // seven zero rows past the end, so `dot8` can always read eight keys), on a
                // 32-byte boundary (see `aligned`).
                let kv = super::aligned(&mut kv, (2 * span + 7) * hd);
                let (kf, vf) = kv.split_at_mut((span + 7) * hd);
                kf[span * hd..].fill(0.0);
                let mut i = 0;
                walk(table, klo, khi, lay, kvh, |o| {
                    to_f32(&k_cache[o..o + head_units], &mut kf[i * hd..(i + 1) * hd]);
                    to_f32(&v_cache[o..o + head_units], &mut vf[i * hd..(i + 1) * hd]);
                    i += 1;
                });
                // The block's rows of all the job's heads take the keys a chunk at a time,
                // every (head, row) against the chunk before the next chunk (and so the
                // values): the chunk is read from L1 by all of them rather than the whole span
                // from L2 (or L3) by each. A row's scores and sums are made by the same calls
                // in the same order of keys, so the same bits as one row at a time. As many
                // (head, row) pairs at once as SCORES_BYTES of scores hold (all of them up to
                // a few thousand keys).
                let chunk = (KEY_CHUNK_BYTES / (4 * hd.max(1))).max(8) / 8 * 8;
                let rows = hi_row - lo_row;
                let pairs = heads.len() * rows;
                let batch = (SCORES_BYTES / (4 * span.max(1))).clamp(1, pairs.max(1));
                scores.resize(batch * span, 0.0);
                // Pair `p`'s head and row (of the block).
                let pair = |p: usize| (heads.start + p / rows, p % rows);
                // Row i's first key (from the block's first) and its keys' count.
                let keys = |i: usize| {
                    let pos = pos_of(lo_row + i);
                    (lo_of(pos) - klo, pos + 1 - lo_of(pos))
                };
                for p0 in (0..pairs).step_by(batch) {
                    let p1 = (p0 + batch).min(pairs);
                    let (first, end) = (p0..p1)
                        .map(|p| keys(p % rows))
                        .fold((span, 0), |(f, e), (lo, n)| (f.min(lo), e.max(lo + n)));
                    for c0 in (first..end).step_by(chunk) {
                        let c1 = (c0 + chunk).min(end);
                        for p in p0..p1 {
                            let (h, i) = pair(p);
                            let (lo, n) = keys(i);
                            let qh = q_of(lo_row + i, h, 1);
                            for c in (c0.max(lo)..c1.min(lo + n)).step_by(8) {
                                (kern.dot8)(qh, &kf[c * hd..(c + 8) * hd], &mut acc);
                                let m = (c1.min(lo + n) - c).min(8);
                                let s = (p - p0) * span + c - lo;
                                scores[s..s + m].copy_from_slice(&acc[..m]);
                            }
                        }
                    }
                    let mut outs = Vec::with_capacity(p1 - p0);
                    for p in p0..p1 {
                        let (h, i) = pair(p);
                        let (s, n) = ((p - p0) * span, keys(i).1);
                        softmax(&mut scores[s..s + n], h);
                        outs.push(out_rows(lo_row + i, h, 1));
                    }
                    for c0 in (first..end).step_by(chunk) {
                        let c1 = (c0 + chunk).min(end);
                        for (j, o) in outs.iter_mut().enumerate() {
                            let (lo, n) = keys((p0 + j) % rows);
                            let (a, b) = (c0.max(lo), c1.min(lo + n));
                            if a < b {
                                let p = &scores[j * span + a - lo..j * span + b - lo];
                                (kern.mix)(p, &vf[a * hd..b * hd], o);
                            }
                        }
                    }
                }
            });
        });
    });
}

/// `scores · scale` turned into attention weights whose denominator also holds `e^sink`
/// (the weights sum to less than one). Plain code: only models with sinks take it.
fn softmax_with_sink(scores: &mut [f32], scale: f32, sink: f32) {
    let m = scores.iter().fold(sink, |m, &s| m.max(s * scale));
    let mut z = (sink - m).exp();
    for s in scores.iter_mut() {
        *s = (*s * scale - m).exp();
        z += *s;
    }
    let inv = 1.0 / z;
    for s in scores.iter_mut() {
        *s *= inv;
    }
}

/// Calls `f` with the storage offset of KV head `h` at each position `lo..=pos`, in order.
/// The table is looked up once per block, not once per key; within a block the offsets are
/// consecutive runs (the head-major layout).
#[inline]
fn walk(table: KvTable, lo: usize, pos: usize, lay: HeadMajor, h: usize, mut f: impl FnMut(usize)) {
    let bs = table.block_size;
    let mut j = lo;
    while j <= pos {
        let in_blk = j % bs;
        let run = (bs - in_blk).min(pos + 1 - j);
        let first = lay.offset(table.blocks[j / bs] as usize * bs + in_blk, h);
        for r in 0..run {
            f(first + r * lay.head_units);
        }
        j += run;
    }
}
