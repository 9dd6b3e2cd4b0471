//! A conformance harness over the `Backend` trait, after llama.cpp's `test-backend-ops`: a table
//! of ops × shapes × formats, each case run on the backend under test and on the reference — the
//! CPU backend in exact mode (f32 activations, f32 KV cache) — from the same inputs, and judged
//! by the normalised mean squared error `Σ (got − want)² / Σ want²` against a per-op bound.
//! The fused ops are held to their default compositions on the backend under test.
//!
//! The cases aim at the places kernels switch: odd row counts (a packed group's tail), token
//! counts around the 1/2/3/4-token kernels and the 16-token tile passes, shuffled block tables
//! with a partial last block, GQA ratios 1, 4 and 6, sequences several hundred positions long,
//! decode rows beside prefill rows in one call, windows, soft-caps and sinks.
//!
//! Today it runs on the CPU backend's own fast paths (8-bit activations, the packed and tile
//! kernels, f16 and Q8_0 caches, the decode overrides); a device backend runs the same
//! [`conform`] where its device is present.

use ferrum_backend::{
    moe_ffn_default, Activation, AttentionParams, AttnSeq, Backend, CpuBackend, DeltaParams,
    ExpertBatch, ExpertWeights, KvShape, KvTable, MatmulPart, MoeScratch, RopeLayout, RopeParams,
    Rows, StateSeq,
};
use ferrum_core::{DType, Error};
use ferrum_loader::RawTensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[allow(dead_code)] // the helpers other test binaries use
mod common;
use common::blocks::{random_blocks, FORMATS, IQUANTS};

/// One case's result.
struct Outcome {
    op: &'static str,
    case: String,
    err: f64,
    tol: f64,
}

/// The error bounds a backend is held to.
#[derive(Clone, Copy)]
struct Bounds {
    /// Matmuls over quantised weights (8-bit activations) and bf16 ones (bf16 activations):
    /// llama.cpp's `test-backend-ops` allows 5e-4 for its matrix products.
    quant: f64,
    /// Ops in f32 throughout (norms, RoPE, f32 and f16 matmuls, element-wise ops).
    float: f64,
    /// Attention, which reads the backend's KV cache format.
    kv: f64,
    /// A fused op against its default composition on the same backend.
    fused: f64,
    /// Weight formats the backend refuses at load, with `Error::Unsupported` (checked).
    refuses: &'static [DType],
}

impl Bounds {
    /// The CPU backend's: its f32 paths are the reference's code, and its fused overrides
    /// give their compositions' bits.
    fn cpu(kv: &str) -> Bounds {
        Bounds {
            quant: 5e-4,
            float: 1e-12,
            kv: match kv {
                "f32" => 1e-12,
                "f16" => 1e-6,
                _ => 2e-4,
            },
            fused: 0.0,
            refuses: &[],
        }
    }
}

/// `Σ (got − want)² / Σ want²`; infinite where `got` has a NaN or infinity `want` lacks.
fn nmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "outputs of different lengths");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = g as f64 - w as f64;
        num += d * d;
        den += w as f64 * w as f64;
    }
    match (num.is_finite(), den > 0.0) {
        (false, _) => f64::INFINITY,
        (true, true) => num / den,
        (true, false) if num == 0.0 => 0.0,
        (true, false) => f64::INFINITY,
    }
}

fn buf<B: Backend>(be: &B, data: &[f32]) -> B::Buf {
    let mut b = be.alloc(data.len());
    be.write(&mut b, 0, data);
    b
}

fn read<B: Backend>(be: &B, b: &B::Buf) -> Vec<f32> {
    let mut v = vec![0f32; be.buf_len(b)];
    be.read(b, 0, &mut v);
    v
}

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

/// A `rows × cols` weight of `dt` with random contents (sane scales for the block formats).
fn weight_tensor(rng: &mut StdRng, dt: DType, rows: usize, cols: usize) -> RawTensor {
    let bytes = match dt {
        DType::F32 => rand_vec(rng, rows * cols, 0.5)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => rand_vec(rng, rows * cols, 0.5)
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::BF16 => rand_vec(rng, rows * cols, 0.5)
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => random_blocks(rng, dt, rows * cols),
    };
    let shape = if rows == 1 {
        vec![cols]
    } else {
        vec![rows, cols]
    };
    RawTensor::from_bytes("w", dt, shape, bytes).expect("sizes match")
}

/// Runs `$body` with `$be` bound to the backend under test, then to the reference, and
/// records the two outputs' error.
macro_rules! case {
    ($h:expr, $op:expr, $tol:expr, $case:expr, |$be:ident| $body:expr) => {{
        let got: Vec<f32> = {
            let $be = $h.be;
            $body
        };
        let want: Vec<f32> = {
            let $be = $h.re;
            $body
        };
        let err = nmse(&got, &want);
        $h.out.push(Outcome {
            op: $op,
            case: $case,
            err,
            tol: $tol,
        });
    }};
}

/// A fused op against its default composition, both on the backend under test.
macro_rules! fused {
    ($h:expr, $op:expr, $case:expr, |$be:ident| $fused:expr, $default:expr) => {{
        let $be = $h.be;
        let (got, want): (Vec<f32>, Vec<f32>) = ($fused, $default);
        let err = nmse(&got, &want);
        $h.out.push(Outcome {
            op: $op,
            case: $case,
            err,
            tol: $h.bounds.fused,
        });
    }};
}

struct Harness<'a, B: Backend> {
    be: &'a B,
    re: &'a CpuBackend,
    bounds: Bounds,
    out: Vec<Outcome>,
}

/// Every case of the table on `be` against the exact CPU backend; returns the outcomes.
fn conform<B: Backend>(be: &B, bounds: Bounds, seed: u64) -> Vec<Outcome> {
    let re = CpuBackend::exact();
    let mut h = Harness {
        be,
        re: &re,
        bounds,
        out: Vec::new(),
    };
    let mut rng = StdRng::seed_from_u64(seed);
    matmuls(&mut h, &mut rng);
    embeds(&mut h, &mut rng);
    norms_and_rope(&mut h, &mut rng);
    elementwise(&mut h, &mut rng);
    attention(&mut h, &mut rng);
    if be.recurrent_ops() {
        recurrent(&mut h, &mut rng);
    }
    fused_ops(&mut h, &mut rng);
    h.out
}

impl Bounds {
    /// The Vulkan backend's: weights dequantised inside its kernels meet f32 activations and
    /// the cache is f32, so only the order of additions differs from the reference.
    fn vulkan() -> Bounds {
        Bounds {
            quant: 1e-10,
            float: 1e-10,
            kv: 1e-10,
            fused: 1e-12,
            // No Vulkan kernels for the i-quants yet (issue 44 is the CPU's): refused clearly.
            refuses: IQUANTS,
        }
    }
}

use ferrum_backend::vulkan::test_device as vulkan;

/// Prints the table and fails on any case over its bound.
fn judge(name: &str, out: &[Outcome]) {
    let mut fails = Vec::new();
    for o in out {
        let ok = o.err <= o.tol;
        eprintln!(
            "{name:<10} {:<14} {:<48} nmse {:>9.2e} (≤ {:.0e}) {}",
            o.op,
            o.case,
            o.err,
            o.tol,
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            fails.push(format!(
                "{} {}: {:.3e} > {:.0e}",
                o.op, o.case, o.err, o.tol
            ));
        }
    }
    assert!(
        fails.is_empty(),
        "{name}: {} cases failed:\n{}",
        fails.len(),
        fails.join("\n")
    );
    eprintln!("{name}: {} cases passed", out.len());
}

/// The float formats; the block formats are `common::blocks::FORMATS`, every one with a kernel.
const FLOAT_FORMATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

fn is_float(dt: DType) -> bool {
    matches!(dt, DType::F32 | DType::F16 | DType::BF16)
}

fn matmuls<B: Backend>(h: &mut Harness<B>, rng: &mut StdRng) {
    // 77 rows: nine packed groups and a tail of five in the file's layout; 48: three pairs of
    // groups (the 512-bit and tile kernels' unit).
    for &dt in FLOAT_FORMATS.iter().chain(FORMATS) {
        if h.bounds.refuses.contains(&dt) {
            let wt = weight_tensor(rng, dt, 8, 256);
            let refused = matches!(h.be.load_weight(&wt), Err(Error::Unsupported(_)));
            h.out.push(Outcome {
                op: "refuses",
                case: format!("{dt}"),
                err: if refused { 0.0 } else { f64::INFINITY },
                tol: 0.0,
            });
            continue;
        }
        for (m, k) in [(48, 256), (77, 512)] {
            let wt = weight_tensor(rng, dt, m, k);
            let bias_t = weight_tensor(rng, DType::F32, 1, m);
            let (w, wr) = (
                h.be.load_weight(&wt).expect("loads"),
                h.re.load_weight(&wt).expect("loads"),
            );
            let (b, br) = (
                h.be.load_weight(&bias_t).expect("loads"),
                h.re.load_weight(&bias_t).expect("loads"),
            );
            // bf16 weights may meet bf16-rounded activations, as llama.cpp's do.
            let tol = if is_float(dt) && dt != DType::BF16 {
                h.bounds.float
            } else {
                h.bounds.quant
            };
            for n in [1usize, 2, 3, 4, 5, 8, 16, 17, 33] {
                // Inputs inside wider rows at an offset, outputs into columns of wider rows.
                let (xw, xo, ow, oo) = (k + 7, 3, m + 5, 2);
                let x = rand_vec(rng, n * xw, 2.0);
                let with_bias = n % 2 == 1;
                let xv = Rows::columns(n, xw, xo, k);
                let ov = Rows::columns(n, ow, oo, m);
                let mut ws = [Some(&w), None];
                let mut rs = [Some(&wr), None];
                if with_bias {
                    ws[1] = Some(&b);
                    rs[1] = Some(&br);
                }
                let case = format!(
                    "{dt} {m}×{k} n={n}{}",
                    if with_bias { " +bias" } else { "" }
                );
                let got = {
                    let xb = buf(h.be, &x);
                    let mut o = buf(h.be, &vec![0.0; n * ow]);
                    h.be.matmul(&xb, xv, ws[0].expect("weight"), ws[1], &mut o, ov);
                    read(h.be, &o)
                };
                let want = {
                    let xb = buf(h.re, &x);
                    let mut o = buf(h.re, &vec![0.0; n * ow]);
                    h.re.matmul(&xb, xv, rs[0].expect("weight"), rs[1], &mut o, ov);
                    read(h.re, &o)
                };
                h.out.push(Outcome {
                    op: "matmul",
                    case,
                    err: nmse(&got, &want),
                    tol,
                });
            }
        }
    }
}

fn embeds<B: Backend>(h: &mut Harness<B>, rng: &mut StdRng) {
    for dt in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4K,
        DType::Q6K,
        // Re-encoded at load on the CPU (`quant::Recoded`): its lookups read that form.
        DType::Iq2Xxs,
        DType::Iq3Xxs,
    ] {
        if h.bounds.refuses.contains(&dt) {
            continue;
        }
        let (vocab, d) = (37, 256);
        let t = weight_tensor(rng, dt, vocab, d);
        let (w, wr) = (
            h.be.load_weight(&t).expect("loads"),
            h.re.load_weight(&t).expect("loads"),
        );
        let tokens: Vec<u32> = (0..9).map(|_| rng.gen_range(0..vocab as u32)).collect();
        let ov = Rows::columns(tokens.len(), d + 4, 1, d);
        let n = tokens.len() * (d + 4);
        let got = {
            let mut o = buf(h.be, &vec![0.0; n]);
            h.be.embed(&w, &tokens, &mut o, ov);
            read(h.be, &o)
        };
        let want = {
            let mut o = buf(h.re, &vec![0.0; n]);
            h.re.embed(&wr, &tokens, &mut o, ov);
            read(h.re, &o)
        };
        h.out.push(Outcome {
            op: "embed",
            case: format!("{dt} {vocab}×{d}"),
            err: nmse(&got, &want),
            tol: h.bounds.float,
        });
    }
}

fn norms_and_rope<B: Backend>(h: &mut Harness<B>, rng: &mut StdRng) {
    let tol = h.bounds.float;
    for (n, heads, hd) in [
        (3usize, 1usize, 576usize),
        (5, 4, 32),
        (1, 2, 128),
        (17, 8, 64),
    ] {
        let w = n * heads * hd;
        let x = rand_vec(rng, w, 3.0);
        let nw = weight_tensor(rng, DType::F32, 1, hd);
        let xv = Rows::dense(n, heads * hd).split_heads(hd);
        let c = format!("{n} rows × {heads} heads × {hd}");
        case!(h, "rms_norm", tol, c.clone(), |be| {
            let wt = be.load_weight(&nw).expect("loads");
            let xb = buf(be, &x);
            let mut o = buf(be, &vec![0.0; w]);
            be.rms_norm(&xb, xv, &wt, 1e-6, &mut o, xv);
            read(be, &o)
        });
        case!(h, "rms_norm_inpl", tol, c.clone(), |be| {
            let wt = be.load_weight(&nw).expect("loads");
            let mut xb = buf(be, &x);
            be.rms_norm_inplace(&mut xb, xv, &wt, 1e-5);
            read(be, &xb)
        });
        let positions: Vec<u32> = (0..n).map(|_| rng.gen_range(0..5000)).collect();
        for layout in [RopeLayout::Neox, RopeLayout::Interleaved] {
            for (rot, factor) in [(hd, 1.0f32), (hd / 2, 1.3)] {
                let inv: Vec<f32> = (0..rot / 2)
                    .map(|i| 10000f32.powf(-2.0 * i as f32 / rot as f32))
                    .collect();
                let p = RopeParams {
                    layout,
                    inv_freq: &inv,
                    factor,
                };
                case!(
                    h,
                    "rope",
                    tol,
                    format!("{c} {layout:?} rot {rot} ×{factor}"),
                    |be| {
                        let mut xb = buf(be, &x);
                        be.rope(&mut xb, xv, &positions, p);
                        read(be, &xb)
                    }
                );
                // Three axes a row (M-RoPE), pairs spread over them in sections.
                let axes: Vec<u32> = (0..3 * n).map(|_| rng.gen_range(0..5000)).collect();
                let pair_axis: Vec<u8> =
                    (0..inv.len()).map(|i| (3 * i / inv.len()) as u8).collect();
                case!(
                    h,
                    "rope_axes",
                    tol,
                    format!("{c} {layout:?} rot {rot} ×{factor}"),
                    |be| {
                        let mut xb = buf(be, &x);
                        be.rope_axes(&mut xb, xv, &axes, 3, &pair_axis, p);
                        read(be, &xb)
                    }
                );
            }
        }
    }
}

fn elementwise<B: Backend>(h: &mut Harness<B>, rng: &mut StdRng) {
    let tol = h.bounds.float;
    let (n, w) = (7usize, 96usize);
    let x = rand_vec(rng, n * 2 * w, 4.0);
    let y = rand_vec(rng, n * 2 * w, 4.0);
    let gv = Rows::dense(n, 2 * w);
    let ov = Rows::dense(n, w);
    for act in [
        Activation::Silu,
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0,
        },
    ] {
        case!(h, "glu", tol, format!("{n}×{w} {act:?}"), |be| {
            let xb = buf(be, &x);
            let mut o = buf(be, &vec![0.0; n * w]);
            be.glu(&xb, gv, &mut o, ov, act);
            read(be, &o)
        });
    }
    let left = Rows::columns(n, 2 * w, 0, w);
    let right = Rows::columns(n, 2 * w, w, w);
    case!(h, "add", tol, format!("{n}×{w} into columns"), |be| {
        let mut xb = buf(be, &x);
        let yb = buf(be, &y);
        be.add_inplace(&mut xb, right, &yb, left);
        read(be, &xb)
    });
    // A LoRA update: `A x` (rank 5) from strided rows, then its expansion into a column
    // window, 96 and 600 wide (one and three column stretches on the CPU).
    let a = rand_vec(rng, 5 * w, 0.5);
    case!(h, "low_rank_shrink", tol, format!("{n}×{w} → 5"), |be| {
        let xb = buf(be, &x);
        let mut o = buf(be, &vec![0.0; n * 5]);
        be.low_rank_shrink(&xb, right, &a, &mut o, Rows::dense(n, 5));
        read(be, &o)
    });
    for out_w in [w, 600] {
        let bt = rand_vec(rng, 5 * out_w, 0.5);
        let low = rand_vec(rng, n * 5, 2.0);
        let base = rand_vec(rng, n * (out_w + 4), 1.0);
        case!(h, "add_low_rank", tol, format!("{n}×5 → {out_w}"), |be| {
            let lb = buf(be, &low);
            let mut o = buf(be, &base);
            let ov = Rows::columns(n, out_w + 4, 4, out_w);
            be.add_low_rank(&lb, Rows::dense(n, 5), &bt, &mut o, ov);
            read(be, &o)
        });
    }
    case!(h, "scale", tol, format!("{n}×{w}"), |be| {
        let mut xb = buf(be, &x);
        be.scale_inplace(&mut xb, left, 0.37);
        read(be, &xb)
    });
    case!(h, "fill", tol, format!("{n}×{w}"), |be| {
        let mut xb = buf(be, &x);
        be.fill(&mut xb, right, -2.5);
        read(be, &xb)
    });
    case!(
        h,
        "copy_rows",
        tol,
        format!("{n}×{w} to another stride"),
        |be| {
            let xb = buf(be, &x);
            let mut o = buf(be, &vec![0.0; n * (w + 3)]);
            be.copy_rows(&xb, right, &mut o, Rows::columns(n, w + 3, 3, w));
            read(be, &o)
        }
    );
    let rows: Vec<u32> = vec![6, 0, 3, 3, 5];
    case!(h, "gather_rows", tol, "5 of 7, one twice".into(), |be| {
        let xb = buf(be, &x);
        let mut o = buf(be, &vec![0.0; rows.len() * w]);
        be.gather_rows(&xb, left, &rows, &mut o, Rows::dense(rows.len(), w));
        read(be, &o)
    });
    let scales = [0.5f32, -1.0, 2.0, 0.25, 1.5];
    case!(h, "scatter_add", tol, "5 rows, one twice".into(), |be| {
        let yb = buf(be, &y);
        let mut xb = buf(be, &x);
        be.scatter_add_rows(
            &yb,
            Rows::dense(rows.len(), w),
            &rows,
            &scales,
            &mut xb,
            right,
        );
        read(be, &xb)
    });
    for gate_w in [w, 1] {
        case!(h, "sigmoid_mul", tol, format!("gate {gate_w} wide"), |be| {
            let mut xb = buf(be, &x);
            let yb = buf(be, &y);
            be.sigmoid_mul(&mut xb, left, &yb, Rows::columns(n, 2 * w, 5, gate_w));
            read(be, &xb)
        });
    }
    case!(h, "copy_within", tol, "3 rows".into(), |be| {
        let mut xb = buf(be, &x);
        be.copy_within(
            &mut xb,
            Rows::columns(3, 2 * w, 0, w),
            Rows::columns(3, 2 * w, 4 * 2 * w, w),
        );
        read(be, &xb)
    });
}

/// One attention case: sequences given as (positions already cached, new rows), their blocks
/// scattered over a shuffled pool, the new rows' keys and values written, then one batched
/// call over all the new rows.
#[allow(clippy::too_many_arguments)]
fn attention_case<B: Backend>(
    be: &B,
    seqs: &[(usize, usize)],
    heads: usize,
    kvh: usize,
    hd: usize,
    bs: usize,
    data: &AttnData,
    p: AttentionParams,
) -> Vec<f32> {
    let kvd = kvh * hd;
    let shape = KvShape {
        blocks: data.pool,
        block_size: bs,
        heads: kvh,
        head_dim: hd,
    };
    let (mut kb, mut vb) = (be.alloc_kv(shape), be.alloc_kv(shape));
    let mut attn = Vec::new();
    let mut q_rows = 0;
    for (s, &(cached, new)) in seqs.iter().enumerate() {
        let table = KvTable {
            blocks: &data.tables[s],
            block_size: bs,
        };
        let total = cached + new;
        let (k, v) = (&data.k[s], &data.v[s]);
        // The cached part in two writes (as an earlier prefill chunk and a decode), then the
        // new rows.
        let kx = buf(be, k);
        let vx = buf(be, v);
        let all = Rows::dense(total, kvd);
        let half = cached / 2;
        for (from, len) in [(0, half), (half, cached - half), (cached, new)] {
            if len > 0 {
                be.write_kv(&kx, all.slice(from, len), &mut kb, table, from);
                be.write_kv(&vx, all.slice(from, len), &mut vb, table, from);
            }
        }
        attn.push(AttnSeq {
            rows: new,
            first_pos: cached,
            table,
        });
        q_rows += new;
    }
    let qv = Rows::dense(q_rows, heads * hd).split_heads(hd);
    let qb = buf(be, &data.q[..q_rows * heads * hd]);
    let mut o = buf(be, &vec![0.0; q_rows * heads * hd]);
    be.attention(&qb, qv, &kb, &vb, &attn, &mut o, qv, p);
    read(be, &o)
}

struct AttnData {
    pool: usize,
    tables: Vec<Vec<u32>>,
    q: Vec<f32>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn attention<B: Backend>(h: &mut Harness<B>, rng: &mut StdRng) {
    let tol = h.bounds.kv;
    // (query heads, KV heads, head size): MHA, GQA 4, GQA 6 with a 64 and a 128 head.
    for (heads, kvh, hd) in [(4usize, 4usize, 32usize), (8, 2, 64), (6, 1, 128)] {
        let bs = 16;
        // A decode row after 300 cached positions, a 37-row prefill, a 5-row chunk after 21
        // (a partial last block), a decode after 1.
        let seqs = [(300usize, 1usize), (0, 37), (21, 5), (1, 1)];
        let blocks_of = |n: usize| n.div_ceil(bs);
        let pool: usize = seqs.iter().map(|&(c, n)| blocks_of(c + n)).sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..pool as u32).collect();
        // Shuffle (Fisher–Yates) so no sequence's blocks are in order.
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.gen_range(0..=i));
        }
        let mut tables = Vec::new();
        let mut next = 0;
        for &(c, n) in &seqs {
            tables.push(ids[next..next + blocks_of(c + n)].to_vec());
            next += blocks_of(c + n);
        }
        let q_rows: usize = seqs.iter().map(|s| s.1).sum();
        let data = AttnData {
            pool,
            tables,
            q: rand_vec(rng, q_rows * heads * hd, 1.0),
            k: seqs
                .iter()
                .map(|&(c, n)| rand_vec(rng, (c + n) * kvh * hd, 1.0))
                .collect(),
            v: seqs
                .iter()
                .map(|&(c, n)| rand_vec(rng, (c + n) * kvh * hd, 1.0))
                .collect(),
        };
        let sinks: Vec<f32> = (0..heads).map(|i| i as f32 * 0.7 - 1.0).collect();
        let variants: [(Option<usize>, Option<f32>, bool); 4] = [
            (None, None, false),
            (Some(64), None, false),
            (None, Some(30.0), false),
            (Some(48), None, true),
        ];
        for (window, softcap, with_sinks) in variants {
            let p = AttentionParams {
                n_kv_heads: kvh,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
                softcap,
                sinks: with_sinks.then_some(&sinks[..]),
            };
            let c = format!(
                "{heads}/{kvh}×{hd} win {window:?} cap {softcap:?}{}",
                if with_sinks { " sinks" } else { "" }
            );
            case!(h, "attention", tol, c, |be| attention_case(
                be, &seqs, heads, kvh, hd, bs, &data, p
            ));
        }
    }
}

fn recurrent<B: Backend>(h: &mut Harness<B>, rng: &mut StdRng) {
    let tol = h.bounds.float;
    // A depthwise convolution over two sequences, one fresh and one carrying state.
    let (ch, kernel) = (64usize, 4usize);
    let seqs = [
        StateSeq {
            rows: 5,
            slot: 1,
            fresh: true,
        },
        StateSeq {
            rows: 1,
            slot: 0,
            fresh: false,
        },
    ];
    let n = 6;
    let x = rand_vec(rng, n * ch, 2.0);
    let w = rand_vec(rng, kernel * ch, 0.5);
    let state = rand_vec(rng, 2 * (kernel - 1) * ch, 1.0);
    case!(
        h,
        "causal_conv1d",
        tol,
        format!("{ch} channels, taps {kernel}"),
        |be| {
            let mut xb = buf(be, &x);
            let wb = buf(be, &w);
            let mut sb = buf(be, &state);
            be.causal_conv1d(&mut xb, Rows::dense(n, ch), &wb, kernel, &mut sb, &seqs);
            let mut v = read(be, &xb);
            v.extend(read(be, &sb));
            v
        }
    );
    // The gated delta rule: 2 key heads, 4 value heads, both orders of value heads.
    let (nk, nv, dk, dv) = (2usize, 4usize, 32usize, 48usize);
    let width = 2 * nk * dk + nv * dv + 2 * nv;
    let x = rand_vec(rng, n * width, 1.0);
    let a: Vec<f32> = (0..nv).map(|i| -(0.2 + 0.3 * i as f32).exp()).collect();
    let dt_bias = rand_vec(rng, nv, 0.5);
    for tiled in [false, true] {
        let p = DeltaParams {
            k_heads: nk,
            v_heads: nv,
            k_dim: dk,
            v_dim: dv,
            tiled,
            a: &a,
            dt_bias: &dt_bias,
        };
        let state = rand_vec(rng, 2 * p.state_len(), 0.1);
        let col = |at: usize, len: usize| Rows::columns(n, width, at, len);
        let qv = col(0, nk * dk).split_heads(dk);
        let kv = col(nk * dk, nk * dk).split_heads(dk);
        let vv = col(2 * nk * dk, nv * dv).split_heads(dv);
        let av = col(2 * nk * dk + nv * dv, nv);
        let bv = col(2 * nk * dk + nv * dv + nv, nv);
        let ov = Rows::dense(n, nv * dv).split_heads(dv);
        case!(
            h,
            "gated_delta",
            tol,
            format!("{nk}/{nv} heads {dk}×{dv} tiled {tiled}"),
            |be| {
                let xb = buf(be, &x);
                let mut sb = buf(be, &state);
                let mut o = buf(be, &vec![0.0; n * nv * dv]);
                be.gated_delta(&xb, qv, kv, vv, av, bv, p, &mut sb, &seqs, &mut o, ov);
                let mut v = read(be, &o);
                v.extend(read(be, &sb));
                v
            }
        );
    }
}

fn fused_ops<B: Backend>(h: &mut Harness<B>, rng: &mut StdRng) {
    let (n, d) = (5usize, 256usize);
    // add_rms_norm.
    let x = rand_vec(rng, n * d, 2.0);
    let y = rand_vec(rng, n * d, 2.0);
    let nw = weight_tensor(rng, DType::F32, 1, d);
    fused!(
        h,
        "add_rms_norm",
        format!("{n}×{d}"),
        |be| {
            let wt = be.load_weight(&nw).expect("loads");
            let v = Rows::dense(n, d);
            let (mut xb, yb) = (buf(be, &x), buf(be, &y));
            let mut o = buf(be, &vec![0.0; n * d]);
            be.add_rms_norm(&mut xb, v, &yb, v, &wt, 1e-6, &mut o, v);
            let mut r = read(be, &o);
            r.extend(read(be, &xb));
            r
        },
        {
            let wt = be.load_weight(&nw).expect("loads");
            let v = Rows::dense(n, d);
            let (mut xb, yb) = (buf(be, &x), buf(be, &y));
            let mut o = buf(be, &vec![0.0; n * d]);
            be.add_inplace(&mut xb, v, &yb, v);
            be.rms_norm(&xb, v, &wt, 1e-6, &mut o, v);
            let mut r = read(be, &o);
            r.extend(read(be, &xb));
            r
        }
    );
    // matmul_many over parts of both activation formats, side by side.
    let shapes = [
        (DType::Q4_0, 40usize),
        (DType::Q4K, 24),
        (DType::Q8_0, 13),
        (DType::F16, 9),
    ];
    let tensors: Vec<RawTensor> = shapes
        .iter()
        .map(|&(dt, m)| weight_tensor(rng, dt, m, d))
        .collect();
    let width: usize = shapes.iter().map(|s| s.1).sum();
    for n in [1usize, 4, 17] {
        let x = rand_vec(rng, n * d, 2.0);
        fused!(
            h,
            "matmul_many",
            format!("4 parts, n={n}"),
            |be| {
                let ws: Vec<_> = tensors
                    .iter()
                    .map(|t| be.load_weight(t).expect("loads"))
                    .collect();
                let xb = buf(be, &x);
                let mut o = buf(be, &vec![0.0; n * width]);
                let mut at = 0;
                let parts: Vec<MatmulPart<_>> = ws
                    .iter()
                    .zip(&shapes)
                    .map(|(w, &(_, m))| {
                        at += m;
                        MatmulPart {
                            weight: w,
                            bias: None,
                            out: Rows::columns(n, width, at - m, m),
                        }
                    })
                    .collect();
                be.matmul_many(&xb, Rows::dense(n, d), &parts, &mut o);
                read(be, &o)
            },
            {
                let ws: Vec<_> = tensors
                    .iter()
                    .map(|t| be.load_weight(t).expect("loads"))
                    .collect();
                let xb = buf(be, &x);
                let mut o = buf(be, &vec![0.0; n * width]);
                let mut at = 0;
                for (w, &(_, m)) in ws.iter().zip(&shapes) {
                    be.matmul(
                        &xb,
                        Rows::dense(n, d),
                        w,
                        None,
                        &mut o,
                        Rows::columns(n, width, at, m),
                    );
                    at += m;
                }
                read(be, &o)
            }
        );
    }
    // glu_matmul: a dense FFN's tail.
    let f = 64usize;
    for dt in [DType::Q4K, DType::Q8_0, DType::BF16] {
        let down = weight_tensor(rng, dt, d, f.max(256));
        let ff = f.max(256);
        let gu = rand_vec(rng, n * 2 * ff, 2.0);
        fused!(
            h,
            "glu_matmul",
            format!("{dt} {d}×{ff}"),
            |be| {
                let w = be.load_weight(&down).expect("loads");
                let gb = buf(be, &gu);
                let mut act = buf(be, &vec![0.0; n * ff]);
                let mut o = buf(be, &vec![0.0; n * d]);
                be.glu_matmul(
                    &gb,
                    Rows::dense(n, 2 * ff),
                    &mut act,
                    Rows::dense(n, ff),
                    &w,
                    &mut o,
                    Rows::dense(n, d),
                    Activation::Silu,
                );
                let mut r = read(be, &o);
                r.extend(read(be, &act));
                r
            },
            {
                let w = be.load_weight(&down).expect("loads");
                let gb = buf(be, &gu);
                let mut act = buf(be, &vec![0.0; n * ff]);
                let mut o = buf(be, &vec![0.0; n * d]);
                be.glu(
                    &gb,
                    Rows::dense(n, 2 * ff),
                    &mut act,
                    Rows::dense(n, ff),
                    Activation::Silu,
                );
                be.matmul(
                    &act,
                    Rows::dense(n, ff),
                    &w,
                    None,
                    &mut o,
                    Rows::dense(n, d),
                );
                let mut r = read(be, &o);
                r.extend(read(be, &act));
                r
            }
        );
    }
    // moe_ffn: one token (the decode override), five and forty (the prefill's grouped pass;
    // forty gives its experts several tasks each), four experts, top two, with and without
    // biases.
    let (hh, ff, ne) = (256usize, 512usize, 4usize);
    for (dt, biased, act) in [
        (DType::Q4K, false, Activation::Silu),
        (
            DType::Q8_0,
            true,
            Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
        ),
        (DType::Q6K, false, Activation::Silu),
    ] {
        let ts: Vec<[RawTensor; 3]> = (0..ne)
            .map(|_| {
                [
                    weight_tensor(rng, dt, ff, hh),
                    weight_tensor(rng, dt, ff, hh),
                    weight_tensor(rng, dt, hh, ff),
                ]
            })
            .collect();
        let bs: Vec<[RawTensor; 3]> = (0..ne)
            .map(|_| {
                [
                    weight_tensor(rng, DType::F32, 1, ff),
                    weight_tensor(rng, DType::F32, 1, ff),
                    weight_tensor(rng, DType::F32, 1, hh),
                ]
            })
            .collect();
        for tokens in [1usize, 5, 40] {
            let x = rand_vec(rng, tokens * hh, 1.0);
            let all: Vec<u32> = (0..tokens as u32).collect();
            let firsts: Vec<u32> = all.iter().copied().filter(|t| t % 2 == 0).collect();
            let (wa, wb): (Vec<f32>, Vec<f32>) = (
                all.iter().map(|&t| 0.6 + 0.05 * t as f32).collect(),
                firsts.iter().map(|&t| 0.4 - 0.05 * t as f32).collect(),
            );
            let batches = [
                ExpertBatch {
                    expert: 2,
                    tokens: &all,
                    weights: &wa,
                },
                ExpertBatch {
                    expert: 0,
                    tokens: &firsts,
                    weights: &wb,
                },
            ];
            let c = format!(
                "{dt} {tokens} token(s){}",
                if biased { " +bias" } else { "" }
            );
            let load = |be: &B| -> Vec<ExpertWeights<B::Weight>> {
                ts.iter()
                    .zip(&bs)
                    .map(|(t, b)| ExpertWeights {
                        gate: be.load_weight(&t[0]).expect("loads"),
                        up: be.load_weight(&t[1]).expect("loads"),
                        down: be.load_weight(&t[2]).expect("loads"),
                        biases: biased
                            .then(|| b.clone().map(|t| be.load_weight(&t).expect("loads"))),
                    })
                    .collect()
            };
            let scratch = |be: &B| MoeScratch {
                x: buf(be, &vec![0.0; tokens * hh]),
                gu: buf(be, &vec![0.0; tokens * 2 * ff]),
                act: buf(be, &vec![0.0; tokens * ff]),
                y: buf(be, &vec![0.0; tokens * hh]),
            };
            let v = Rows::dense(tokens, hh);
            fused!(
                h,
                "moe_ffn",
                c,
                |be| {
                    let ex = load(be);
                    let xb = buf(be, &x);
                    let mut o = buf(be, &vec![1.0; tokens * hh]);
                    be.moe_ffn(&xb, v, &ex, &batches, &mut scratch(be), &mut o, v, act);
                    read(be, &o)
                },
                {
                    let ex = load(be);
                    let xb = buf(be, &x);
                    let mut o = buf(be, &vec![1.0; tokens * hh]);
                    moe_ffn_default(be, &xb, v, &ex, &batches, &mut scratch(be), &mut o, v, act);
                    read(be, &o)
                }
            );
        }
    }
}

/// The CPU backend's fast paths on two threads with its default f16 cache, and on one thread
/// with a Q8_0 cache, against the exact backend.
#[test]
fn cpu_backend_conforms_to_the_exact_reference() {
    for (name, be) in [
        ("cpu f16", CpuBackend::with_threads(2)),
        (
            "cpu q8_0",
            CpuBackend::with_threads(1).with_kv(ferrum_backend::cpu::kv::KvDtype::Q8_0),
        ),
    ] {
        let out = conform(&be, Bounds::cpu(be.kv_dtype()), 5);
        judge(name, &out);
    }
}

/// The Vulkan backend (lavapipe here and in CI) against the exact CPU backend, every case
/// but the recurrent ops, which it does not have yet.
#[test]
fn vulkan_backend_conforms_to_the_exact_reference() {
    let Some(be) = vulkan() else { return };
    let out = conform(&be, Bounds::vulkan(), 5);
    be.sync().expect("no device error");
    judge("vulkan", &out);
}

/// The same with every weight split into parts of at most 4 KiB (as a matrix larger than a
/// device's largest storage binding is): matmuls, embeddings and expert views across parts.
#[test]
fn vulkan_backend_with_weights_in_parts_conforms() {
    let Some(be) = vulkan() else { return };
    let be = be.with_weight_parts_of(4096);
    let mut out = conform(&be, Bounds::vulkan(), 6);
    // Expert views of a stacked `[E, F, H]` tensor in parts of two experts, one view across
    // the parts' boundary.
    let re = CpuBackend::exact();
    let mut rng = StdRng::seed_from_u64(7);
    let (e, f, h) = (4usize, 24usize, 256usize);
    let t = RawTensor::from_bytes(
        "experts",
        DType::Q8_0,
        vec![e, f, h],
        random_blocks(&mut rng, DType::Q8_0, e * f * h),
    )
    .expect("sizes match");
    let be = be.with_weight_parts_of(2 * f * 272);
    let (w, wr) = (
        be.load_weight(&t).expect("loads"),
        re.load_weight(&t).expect("loads"),
    );
    for (first, rows) in [(0, f), (f, f), (2 * f, f), (3 * f, f), (f + f / 2, f)] {
        let x = rand_vec(&mut rng, 3 * h, 1.0);
        let (got, want) = (
            expert_view(&be, &w, first, rows, &x),
            expert_view(&re, &wr, first, rows, &x),
        );
        out.push(Outcome {
            op: "weight_rows",
            case: format!("Q8_0 rows {first}..{}", first + rows),
            err: nmse(&got, &want),
            tol: 1e-10,
        });
    }
    be.sync().expect("no device error");
    judge("vulkan 4 KiB parts", &out);
}

/// `x · rows first..first + rows of w` through a `weight_rows` view.
fn expert_view<B: Backend>(
    be: &B,
    w: &B::Weight,
    first: usize,
    rows: usize,
    x: &[f32],
) -> Vec<f32> {
    let h = be.weight_shape(w).1;
    let n = x.len() / h;
    let v = be.weight_rows(w, first, rows).expect("view");
    let xb = buf(be, x);
    let mut o = buf(be, &vec![0.0; n * rows]);
    be.matmul(
        &xb,
        Rows::dense(n, h),
        &v,
        None,
        &mut o,
        Rows::dense(n, rows),
    );
    read(be, &o)
}

/// The harness can fail: the exact backend against itself passes with zero error, and a
/// backend whose answers are off is caught (here the fast backend held to the exact one's
/// own bounds, which 8-bit activations cannot meet).
#[test]
fn the_harness_tells_a_wrong_backend_from_a_right_one() {
    let exact = CpuBackend::exact();
    let out = conform(&exact, Bounds::cpu("f32"), 9);
    assert!(
        out.iter().all(|o| o.err == 0.0),
        "the reference against itself"
    );
    let fast = CpuBackend::with_threads(2);
    let strict = Bounds {
        quant: 1e-12,
        ..Bounds::cpu("f32")
    };
    let out = conform(&fast, strict, 9);
    let over = out.iter().filter(|o| o.err > o.tol).count();
    assert!(over > 10, "the strict bounds caught {over} cases");
}

/// `rope_axes` against the rotation written out pair by pair in f64, and, where a row's axes
/// agree, against `rope` to the bit (text rows of an M-RoPE model rotate as plain RoPE).
#[test]
fn rope_axes_rotates_each_pair_by_its_axis() {
    let be = CpuBackend::new();
    let mut rng = StdRng::seed_from_u64(7);
    let (n, heads, hd) = (5usize, 3usize, 16usize);
    let x = rand_vec(&mut rng, n * heads * hd, 2.0);
    let xv = Rows::dense(n, heads * hd).split_heads(hd);
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / hd as f32))
        .collect();
    let pair_axis: Vec<u8> = [0u8, 0, 1, 1, 1, 2, 2, 2].to_vec();
    let axes: Vec<u32> = (0..3 * n).map(|_| rng.gen_range(0..300)).collect();
    for layout in [RopeLayout::Neox, RopeLayout::Interleaved] {
        let p = RopeParams {
            layout,
            inv_freq: &inv,
            factor: 1.0,
        };
        let mut got = buf(&be, &x);
        be.rope_axes(&mut got, xv, &axes, 3, &pair_axis, p);
        let got = read(&be, &got);
        for t in 0..n {
            for h in 0..heads {
                for i in 0..hd / 2 {
                    let angle = axes[3 * t + pair_axis[i] as usize] as f64 * inv[i] as f64;
                    let (a, b) = match layout {
                        RopeLayout::Neox => (i, i + hd / 2),
                        RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let base = (t * heads + h) * hd;
                    let (x0, x1) = (x[base + a] as f64, x[base + b] as f64);
                    let want = [
                        x0 * angle.cos() - x1 * angle.sin(),
                        x1 * angle.cos() + x0 * angle.sin(),
                    ];
                    for (k, w) in [a, b].into_iter().zip(want) {
                        let d = (got[base + k] as f64 - w).abs();
                        assert!(d < 1e-4, "{layout:?} row {t} head {h} pair {i}: {d}");
                    }
                }
            }
        }
        let same: Vec<u32> = (0..n).flat_map(|t| [axes[3 * t]; 3]).collect();
        let mut a = buf(&be, &x);
        be.rope_axes(&mut a, xv, &same, 3, &pair_axis, p);
        let mut b = buf(&be, &x);
        let plain: Vec<u32> = (0..n).map(|t| axes[3 * t]).collect();
        be.rope(&mut b, xv, &plain, p);
        assert_eq!(
            read(&be, &a),
            read(&be, &b),
            "{layout:?}: equal axes as rope"
        );
    }
}
