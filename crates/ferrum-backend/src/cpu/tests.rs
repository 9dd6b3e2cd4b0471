use super::*;
use rand::{Rng, SeedableRng};

fn rng() -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(42)
}

fn rand_vec(r: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
}

fn f32_tensor(name: &str, shape: Vec<usize>, data: &[f32]) -> RawTensor {
    let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    RawTensor::from_bytes(name, DType::F32, shape, bytes).unwrap()
}

/// Q8_0 quantisation, as GGML's reference does it (round-to-nearest, scale = amax / 127).
fn q8_0_bytes(data: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in data.chunks(32) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for v in blk {
            out.push((v * id).round() as i8 as u8);
        }
    }
    out
}

#[test]
fn matmul_matches_naive_for_f32_and_q8_0() {
    let be = CpuBackend::new();
    let mut r = rng();
    let (n, k, m) = (5, 64, 37);
    let x = rand_vec(&mut r, n * k);
    let w = rand_vec(&mut r, m * k);
    let bias = rand_vec(&mut r, m);
    let wt = be.load_weight(&f32_tensor("w", vec![m, k], &w)).unwrap();
    let bt = be.load_weight(&f32_tensor("b", vec![m], &bias)).unwrap();
    let mut out = vec![0.0; n * m];
    be.matmul(
        &x,
        Rows::dense(n, k),
        &wt,
        Some(&bt),
        &mut out,
        Rows::dense(n, m),
    );
    for t in 0..n {
        for j in 0..m {
            let e: f32 = (0..k).map(|i| x[t * k + i] * w[j * k + i]).sum::<f32>() + bias[j];
            assert!((out[t * m + j] - e).abs() < 1e-4, "{t},{j}");
        }
    }
    // Quantised weights: the result equals the f32 matmul of the dequantised weights.
    let q = RawTensor::from_bytes("wq", DType::Q8_0, vec![m, k], q8_0_bytes(&w)).unwrap();
    let mut deq = vec![0.0; m * k];
    assert!(quant::dequantize(DType::Q8_0, q.bytes(), &mut deq));
    for (a, b) in deq.iter().zip(&w) {
        assert!((a - b).abs() <= 1.0 / 127.0 * 0.51 + 1e-3);
    }
    // Exact mode: the dequantised weights times f32 activations. Fast mode: 8-bit
    // activations, off by at most half a quantisation step per activation.
    for (be, tol) in [
        (CpuBackend::exact(), 1e-4f32),
        (CpuBackend::new(), 1.0 / 127.0 * 0.5 * k as f32),
    ] {
        let wq = be.load_weight(&q).unwrap();
        // Write into a column window of a wider output, as the fused QKV projection does.
        let mut wide = vec![0.0; n * (m + 3)];
        be.matmul(
            &x,
            Rows::dense(n, k),
            &wq,
            None,
            &mut wide,
            Rows::columns(n, m + 3, 3, m),
        );
        for t in 0..n {
            for j in 0..m {
                let e: f32 = (0..k).map(|i| x[t * k + i] * deq[j * k + i]).sum();
                assert!((wide[t * (m + 3) + 3 + j] - e).abs() < tol);
            }
            assert_eq!(&wide[t * (m + 3)..t * (m + 3) + 3], &[0.0, 0.0, 0.0]);
        }
    }
}

/// Decode (one query row per sequence) reads an f16 cache directly, several query heads per
/// converted vector; prefill converts rows first. f16 → f32 is exact, so the two must give
/// the same bits: for group sizes 8, 7, 3 and 2 (chunks of three heads and a remainder), a
/// head size with a tail past the last multiple of eight, sliding windows and a softcap, with
/// one thread (a job then takes a whole group) and with two.
#[test]
fn decode_attention_on_f16_cache_equals_prefill_rows_bit_for_bit() {
    let mut r = rng();
    let (hd, n, bs) = (36, 37, 4);
    // Ten blocks for the sequence, scrambled among twelve.
    let blocks = [11u32, 2, 7, 0, 9, 4, 1, 10, 5, 8];
    let table = KvTable {
        blocks: &blocks,
        block_size: bs,
    };
    for (heads, kvh) in [(8, 1), (14, 2), (9, 3), (4, 2)] {
        let kvd = kvh * hd;
        let q = rand_vec(&mut r, n * heads * hd);
        let kc = rand_vec(&mut r, n * kvd);
        let vc = rand_vec(&mut r, n * kvd);
        for threads in [1, 2] {
            let be = CpuBackend::with_threads(threads).with_kv(KvDtype::F16);
            let shape = KvShape {
                blocks: 12,
                block_size: bs,
                heads: kvh,
                head_dim: hd,
            };
            let (mut kb, mut vb) = (be.alloc_kv(shape), be.alloc_kv(shape));
            let rows = Rows::dense(n, kvd);
            be.write_kv(&kc, rows, &mut kb, table, 0);
            be.write_kv(&vc, rows, &mut vb, table, 0);
            let qv = Rows::dense(n, heads * hd).split_heads(hd);
            for (window, softcap) in [(None, None), (Some(5), None), (None, Some(2.0))] {
                let sinks: Vec<f32> = (0..heads).map(|h| h as f32 * 0.7 - 1.0).collect();
                let p = AttentionParams {
                    n_kv_heads: kvh,
                    scale: 0.4,
                    window,
                    softcap,
                    sinks: softcap.is_none().then_some(&sinks[..]),
                };
                let whole = [AttnSeq {
                    rows: n,
                    first_pos: 0,
                    table,
                }];
                let mut out = vec![0.0; n * heads * hd];
                be.attention(&q, qv, &kb, &vb, &whole, &mut out, qv, p);
                // Six positions decoded in one batch (six one-row sequences), then one alone.
                let ts = [n - 1, 3, n - 2, 0, 17, 30];
                for batch in [&ts[..], &ts[..1]] {
                    let w = heads * hd;
                    let qd: Vec<f32> = batch
                        .iter()
                        .flat_map(|&t| q[t * w..(t + 1) * w].iter().copied())
                        .collect();
                    let seqs: Vec<AttnSeq> = batch
                        .iter()
                        .map(|&t| AttnSeq {
                            rows: 1,
                            first_pos: t,
                            table,
                        })
                        .collect();
                    let dv = Rows::dense(batch.len(), w).split_heads(hd);
                    let mut got = vec![0.0; batch.len() * w];
                    be.attention(&qd, dv, &kb, &vb, &seqs, &mut got, dv, p);
                    for (i, &t) in batch.iter().enumerate() {
                        let (a, b) = (&got[i * w..(i + 1) * w], &out[t * w..(t + 1) * w]);
                        assert!(
                            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "heads {heads}/{kvh}, {threads} threads, {window:?} {softcap:?}: \
                             position {t} decoded differs from its prefill row"
                        );
                    }
                }
            }
        }
    }
}

/// Attention through a shuffled block table, in every KV format, against a naive f64
/// computation on contiguous keys and values; queries split at `first_pos` see the same.
#[test]
fn paged_attention_matches_naive_causal_gqa_with_window() {
    let mut r = rng();
    let (heads, kvh, hd, n, bs) = (4, 2, 32, 19, 4);
    let kvd = kvh * hd;
    let q = rand_vec(&mut r, n * heads * hd);
    let kc = rand_vec(&mut r, n * kvd);
    let vc = rand_vec(&mut r, n * kvd);
    // Eight blocks of cache, the sequence's five in a scrambled order.
    let blocks = [6u32, 1, 7, 3, 0];
    let table = KvTable {
        blocks: &blocks,
        block_size: bs,
    };
    let qv = Rows::dense(n, heads * hd).split_heads(hd);
    for (kv, tol) in [
        (KvDtype::F32, 1e-5),
        (KvDtype::F16, 2e-3),
        (KvDtype::Q8_0, 3e-2),
    ] {
        let be = CpuBackend::new().with_kv(kv);
        let shape = KvShape {
            blocks: 8,
            block_size: bs,
            heads: kvh,
            head_dim: hd,
        };
        let (mut kb, mut vb) = (be.alloc_kv(shape), be.alloc_kv(shape));
        assert_eq!(kb.dtype(), kv);
        // Written in two pieces, as a chunked prefill would.
        let rows = Rows::dense(n, kvd);
        be.write_kv(&kc, rows.slice(0, 7), &mut kb, table, 0);
        be.write_kv(&kc, rows.slice(7, n - 7), &mut kb, table, 7);
        be.write_kv(&vc, rows, &mut vb, table, 0);
        // Sinks of either sign and one far above every score (its head attends to almost
        // nothing).
        let sinks = [0.8f32, -1.5, 6.0, 0.0];
        for (window, sink) in [
            (None, None),
            (Some(3), None),
            (None, Some(sinks)),
            (Some(3), Some(sinks)),
        ] {
            let whole = [AttnSeq {
                rows: n,
                first_pos: 0,
                table,
            }];
            let p = AttentionParams {
                n_kv_heads: kvh,
                scale: 0.3,
                window,
                softcap: None,
                sinks: sink.as_ref().map(|s| &s[..]),
            };
            let mut out = vec![0.0; n * heads * hd];
            be.attention(&q, qv, &kb, &vb, &whole, &mut out, qv, p);
            // The last rows alone, starting at position 12, give the same rows.
            let mut tail = vec![0.0; n * heads * hd];
            let tv = qv.slice(12, n - 12);
            let from12 = AttnSeq {
                rows: n - 12,
                first_pos: 12,
                table,
            };
            be.attention(&q, tv, &kb, &vb, &[from12], &mut tail, tv, p);
            assert_eq!(&tail[12 * heads * hd..], &out[12 * heads * hd..]);
            // And as two sequences of one batched call (as a prefill chunk beside a decode).
            let mut both = vec![0.0; n * heads * hd];
            let head12 = AttnSeq {
                rows: 12,
                first_pos: 0,
                table,
            };
            be.attention(&q, qv, &kb, &vb, &[head12, from12], &mut both, qv, p);
            assert_eq!(both, out);
            for t in 0..n {
                for h in 0..heads {
                    let g = h / (heads / kvh);
                    let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
                    let s: Vec<f64> = (lo..=t)
                        .map(|j| {
                            (0..hd)
                                .map(|d| {
                                    q[t * heads * hd + h * hd + d] as f64
                                        * kc[j * kvd + g * hd + d] as f64
                                })
                                .sum::<f64>()
                                * 0.3
                        })
                        .collect();
                    let sk = sink.map(|s| s[h] as f64);
                    let mx = s.iter().cloned().fold(sk.unwrap_or(f64::MIN), f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                    let z: f64 = e.iter().sum::<f64>() + sk.map_or(0.0, |k| (k - mx).exp());
                    for d in 0..hd {
                        let want: f64 = (lo..=t)
                            .zip(&e)
                            .map(|(j, w)| w / z * vc[j * kvd + g * hd + d] as f64)
                            .sum();
                        let got = out[t * heads * hd + h * hd + d] as f64;
                        assert!(
                            (got - want).abs() < tol,
                            "{kv:?} t{t} h{h} d{d} {window:?} {sink:?}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn interleaved_rope_is_neox_rope_on_permuted_dims() {
    let be = CpuBackend::new();
    let mut r = rng();
    let hd = 16;
    let x = rand_vec(&mut r, 2 * hd);
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / hd as f32))
        .collect();
    let pos = [3u32, 17];
    let v = Rows::dense(2, hd);
    let mut neox = x.clone();
    be.rope(
        &mut neox,
        v,
        &pos,
        RopeParams {
            layout: RopeLayout::Neox,
            inv_freq: &inv,
            factor: 1.0,
        },
    );
    // Interleave the halves: dims (i, i + hd/2) become (2i, 2i + 1).
    let perm = |src: &[f32]| -> Vec<f32> {
        let mut o = vec![0.0; src.len()];
        for t in 0..2 {
            for i in 0..hd / 2 {
                o[t * hd + 2 * i] = src[t * hd + i];
                o[t * hd + 2 * i + 1] = src[t * hd + i + hd / 2];
            }
        }
        o
    };
    let mut inter = perm(&x);
    be.rope(
        &mut inter,
        v,
        &pos,
        RopeParams {
            layout: RopeLayout::Interleaved,
            inv_freq: &inv,
            factor: 1.0,
        },
    );
    assert_eq!(inter, perm(&neox));
    // Position 0 is the identity.
    let mut same = x.clone();
    be.rope(
        &mut same,
        v,
        &[0, 0],
        RopeParams {
            layout: RopeLayout::Neox,
            inv_freq: &inv,
            factor: 1.0,
        },
    );
    assert_eq!(same, x);
    // Partial rotary with an attention factor (Phi-3's LongRoPE): the first 2·len(freqs)
    // dimensions rotate and are scaled, the rest pass through untouched.
    let quarter = &inv[..hd / 4];
    let mut part = x.clone();
    be.rope(
        &mut part,
        v,
        &pos,
        RopeParams {
            layout: RopeLayout::Neox,
            inv_freq: quarter,
            factor: 1.5,
        },
    );
    for t in 0..2 {
        let (row, got) = (&x[t * hd..(t + 1) * hd], &part[t * hd..(t + 1) * hd]);
        assert_eq!(&got[hd / 2..], &row[hd / 2..]);
        for i in 0..hd / 4 {
            let a = pos[t] as f32 * quarter[i];
            let (c, s) = ((a as f64).cos() as f32 * 1.5, (a as f64).sin() as f32 * 1.5);
            let (x0, x1) = (row[i], row[i + hd / 4]);
            assert_eq!(got[i], x0 * c - x1 * s);
            assert_eq!(got[i + hd / 4], x1 * c + x0 * s);
        }
    }
}

#[test]
fn fused_add_rms_norm_default_matches_primitives_and_formula() {
    let be = CpuBackend::new();
    let mut r = rng();
    let (n, d) = (3, 40);
    let mut x = rand_vec(&mut r, n * d);
    let y = rand_vec(&mut r, n * d);
    let w = rand_vec(&mut r, d);
    let wt = be.load_weight(&f32_tensor("n", vec![d], &w)).unwrap();
    let v = Rows::dense(n, d);
    let mut out = vec![0.0; n * d];
    let x0 = x.clone();
    be.add_rms_norm(&mut x, v, &y, v, &wt, 1e-6, &mut out, v);
    for t in 0..n {
        let s: Vec<f32> = (0..d).map(|i| x0[t * d + i] + y[t * d + i]).collect();
        let ms = s.iter().map(|v| v * v).sum::<f32>() / d as f32;
        for i in 0..d {
            assert!((x[t * d + i] - s[i]).abs() < 1e-6);
            let want = w[i] * s[i] / (ms + 1e-6).sqrt();
            assert!((out[t * d + i] - want).abs() < 1e-5);
        }
    }
}

#[test]
fn silu_mul_and_embed() {
    let be = CpuBackend::new();
    let x = vec![1.0f32, -2.0, 3.0, 0.5];
    let mut out = vec![0.0; 2];
    be.glu(
        &x,
        Rows::dense(1, 4),
        &mut out,
        Rows::dense(1, 2),
        Activation::Silu,
    );
    let silu = |g: f32| g / (1.0 + (-g).exp());
    assert!((out[0] - silu(1.0) * 3.0).abs() < 1e-6);
    assert!((out[1] - silu(-2.0) * 0.5).abs() < 1e-6);
    // Exact-GELU GeGLU: the encoders' tested GELU (host_ops::gelu_erf) times the up half.
    be.glu(
        &x,
        Rows::dense(1, 4),
        &mut out,
        Rows::dense(1, 2),
        Activation::GeluErf,
    );
    let mut g = vec![1.0f32, -2.0];
    crate::host_ops::gelu_erf(&mut g);
    assert!((out[0] - g[0] * 3.0).abs() < 1e-6 && (out[0] - 0.841_344_7 * 3.0).abs() < 1e-5);
    assert!((out[1] - g[1] * 0.5).abs() < 1e-6 && (out[1] + 0.045_500_26 * 0.5).abs() < 1e-5);

    let table: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let t = be
        .load_weight(&f32_tensor("e", vec![4, 3], &table))
        .unwrap();
    let mut e = vec![0.0; 6];
    be.embed(&t, &[2, 0], &mut e, Rows::dense(2, 3));
    assert_eq!(e, vec![6.0, 7.0, 8.0, 0.0, 1.0, 2.0]);
}

#[test]
fn unsupported_weight_type_is_an_error() {
    let be = CpuBackend::new();
    let t = RawTensor::from_bytes("x", DType::Q8K, vec![256], vec![0; 292]).unwrap();
    assert!(be.load_weight(&t).is_err());
}

#[test]
fn moe_decode_override_equals_default_composition() {
    use crate::{moe_ffn_default, ExpertBatch, ExpertWeights, MoeScratch};
    let be = CpuBackend::new();
    let mut r = rng();
    let (h, f, ne) = (64, 32, 4);
    let mk = |r: &mut rand::rngs::StdRng, rows: usize, cols: usize, q: bool| {
        let w = rand_vec(r, rows * cols);
        let t = if q {
            RawTensor::from_bytes("w", DType::Q8_0, vec![rows, cols], q8_0_bytes(&w)).unwrap()
        } else {
            f32_tensor("w", vec![rows, cols], &w)
        };
        be.load_weight(&t).unwrap()
    };
    for quantized in [false, true] {
        let experts: Vec<ExpertWeights<CpuWeight>> = (0..ne)
            .map(|_| ExpertWeights {
                gate: mk(&mut r, f, h, quantized),
                up: mk(&mut r, f, h, quantized),
                down: mk(&mut r, h, f, quantized),
                biases: None,
            })
            .collect();
        let x = rand_vec(&mut r, h);
        let tok = [0u32];
        let (w1, w3) = ([0.7f32], [0.3f32]);
        let batches = [
            ExpertBatch {
                expert: 1,
                tokens: &tok,
                weights: &w1,
            },
            ExpertBatch {
                expert: 3,
                tokens: &tok,
                weights: &w3,
            },
        ];
        let mut scratch = MoeScratch {
            x: vec![0.0; h],
            gu: vec![0.0; 2 * f * 2],
            act: vec![0.0; f * 2],
            y: vec![0.0; h],
        };
        let v = Rows::dense(1, h);
        let mut a = vec![0.0; h];
        let mut b = vec![1.0; h];
        let act = Activation::Silu;
        be.moe_ffn(&x, v, &experts, &batches, &mut scratch, &mut a, v, act);
        moe_ffn_default(&be, &x, v, &experts, &batches, &mut scratch, &mut b, v, act);
        assert_eq!(a, b, "quantized={quantized}");
    }
}

/// A weight of random blocks with small, finite f16 scales (at the byte offsets `scales`
/// of each block).
fn random_weight(
    r: &mut impl Rng,
    dt: DType,
    rows: usize,
    cols: usize,
    scales: &[usize],
) -> RawTensor {
    let mut b = vec![0u8; dt.bytes_for(rows * cols).unwrap()];
    r.fill(&mut b[..]);
    for blk in b.chunks_mut(dt.block_bytes()) {
        for &o in scales {
            let s = half::f16::from_f32(r.gen_range(0.002..0.02));
            blk[o..o + 2].copy_from_slice(&s.to_le_bytes());
        }
    }
    RawTensor::from_bytes("w", dt, vec![rows, cols], b).unwrap()
}

/// The prefill's grouped expert products give the default composition's bits: K-quants (Q8_K
/// activations), a codebook format (its tile layout, for experts of eight tokens or more),
/// the 32-value formats (Q8 activations) with biases, both activation formats in one group,
/// and groups of every size from one expert (larger than the budget) to all of them.
#[test]
fn moe_prefill_groups_equal_default_composition() {
    use crate::{moe_ffn_default, ExpertBatch, ExpertWeights, MoeScratch};
    let be = CpuBackend::with_threads(3);
    let mut r = rng();
    let (h, f, ne, n) = (256, 512, 5, 37);
    let scales = |dt: DType| -> &'static [usize] {
        match dt {
            DType::Q4K => &[0, 2],
            DType::Q6K => &[208],
            _ => &[0],
        }
    };
    let clamped = Activation::ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };
    // Each case: the experts' (gate/up, down) formats in turn, biases, the activation.
    type Case = (&'static [(DType, DType)], bool, Activation);
    let cases: [Case; 4] = [
        (&[(DType::Q4K, DType::Q6K)], false, Activation::Silu),
        (&[(DType::Iq2Xxs, DType::Iq2Xxs)], false, Activation::Silu),
        (&[(DType::Iq4Nl, DType::Q8_0)], true, clamped),
        (
            &[(DType::Q4K, DType::Q6K), (DType::Iq4Nl, DType::Q8_0)],
            false,
            Activation::GeluTanh,
        ),
    ];
    // Tokens of each expert, in the router's order (not the experts').
    let lists: Vec<(usize, Vec<u32>)> = vec![
        (3, (0..n as u32).collect()),
        (0, (0..n as u32).filter(|t| t % 2 == 0).collect()),
        (4, (0..n as u32).filter(|t| t % 3 == 0).collect()),
        (1, vec![5]),
        (2, (0..9).collect()),
    ];
    let weights: Vec<Vec<f32>> = lists
        .iter()
        .map(|(_, t)| t.iter().map(|_| r.gen_range(0.05..0.9)).collect())
        .collect();
    let batches: Vec<ExpertBatch> = lists
        .iter()
        .zip(&weights)
        .map(|((e, t), w)| ExpertBatch {
            expert: *e,
            tokens: t,
            weights: w,
        })
        .collect();
    for (formats, biased, act) in cases {
        let experts: Vec<ExpertWeights<CpuWeight>> = (0..ne)
            .map(|e| {
                let (gu, down) = formats[e % formats.len()];
                let mut w = |dt: DType, rows, cols| {
                    be.load_weight(&random_weight(&mut r, dt, rows, cols, scales(dt)))
                        .unwrap()
                };
                let (gate, up, down) = (w(gu, f, h), w(gu, f, h), w(down, h, f));
                let mut b = |len| {
                    be.load_weight(&f32_tensor("b", vec![len], &rand_vec(&mut r, len)))
                        .unwrap()
                };
                ExpertWeights {
                    gate,
                    up,
                    down,
                    biases: biased.then(|| [b(f), b(f), b(h)]),
                }
            })
            .collect();
        // The input and output one row into their buffers.
        let x = rand_vec(&mut r, (n + 1) * h);
        let v = Rows {
            offset: h,
            ..Rows::dense(n, h)
        };
        let scratch = || MoeScratch {
            x: vec![0.0; n * h],
            gu: vec![0.0; n * 2 * f],
            act: vec![0.0; n * f],
            y: vec![0.0; n * h],
        };
        let mut want = vec![1.0; (n + 1) * h];
        moe_ffn_default(
            &be,
            &x,
            v,
            &experts,
            &batches,
            &mut scratch(),
            &mut want,
            v,
            act,
        );
        for budget in [1, 20, 45, usize::MAX] {
            let mut got = vec![1.0; (n + 1) * h];
            let ran = super::moe::prefill_in_groups(
                &be,
                &x,
                v,
                &experts,
                &batches,
                &mut scratch(),
                &mut got,
                v,
                act,
                budget,
            );
            assert!(ran, "{formats:?}: the integer path takes every expert");
            assert_eq!(got, want, "{formats:?}, groups of {budget} rows");
        }
        let mut got = vec![1.0; (n + 1) * h];
        be.moe_ffn(&x, v, &experts, &batches, &mut scratch(), &mut got, v, act);
        assert_eq!(got, want, "{formats:?}: moe_ffn");
    }
}

/// A matmul over a packed weight whose row count is not a multiple of eight (three packed
/// groups and five rows in the file's layout) gives every token the same bits whether it
/// runs alone or with up to eight others, and the value of the file-layout kernel to rounding.
#[test]
fn packed_matmul_is_batch_invariant_and_covers_tail_rows() {
    let be = CpuBackend::new();
    let mut r = rng();
    let (k, m) = (96, 29);
    let w = rand_vec(&mut r, m * k);
    let q = RawTensor::from_bytes("w", DType::Q8_0, vec![m, k], q8_0_bytes(&w)).unwrap();
    let wq = be.load_weight(&q).unwrap();
    #[cfg(target_arch = "x86_64")]
    if quant::has_avx2() {
        assert_eq!(wq.packed.as_ref().map(|p| p.rows()), Some(24));
    }
    let x = rand_vec(&mut r, 9 * k);
    let run = |first: usize, n: usize| {
        let mut out = vec![0.0; n * m];
        be.matmul(
            &x[first * k..(first + n) * k].to_vec(),
            Rows::dense(n, k),
            &wq,
            None,
            &mut out,
            Rows::dense(n, m),
        );
        out
    };
    let all = run(0, 9);
    for t in 0..9 {
        let alone = run(t, 1);
        for j in 0..m {
            assert_eq!(
                all[t * m + j].to_bits(),
                alone[j].to_bits(),
                "token {t} row {j}"
            );
        }
    }
    let Some(quant::Kernel::Q8 { dot, .. }) = quant::scalar_kernel(DType::Q8_0) else {
        panic!("Q8_0 has a Q8 kernel")
    };
    let rb = q.bytes().len() / m;
    for t in 0..9 {
        let mut a = vec![quant::q8::BlockQ8::default(); k / 32];
        quant::q8::quantize_q8(&x[t * k..(t + 1) * k], &mut a);
        for j in 0..m {
            let e = dot(&q.bytes()[j * rb..(j + 1) * rb], &a);
            assert!((all[t * m + j] - e).abs() < 1e-4, "token {t} row {j}");
        }
    }
}

#[test]
fn packing_split_over_pool_tasks_keeps_every_row() {
    // 4096 rows × 256 columns of Q8_0 is ~4.4 MB of source: several ~1 MB packing tasks
    // shared between the threads. Every row must come back exactly as the file holds it.
    let be = CpuBackend::new();
    let mut r = rng();
    let (m, k) = (4096, 256);
    let w = rand_vec(&mut r, m * k);
    let q = RawTensor::from_bytes("w", DType::Q8_0, vec![m, k], q8_0_bytes(&w)).unwrap();
    let wq = be.load_weight(&q).unwrap();
    #[cfg(target_arch = "x86_64")]
    if quant::has_avx2() {
        let p = wq.packed.as_ref().expect("packed");
        assert_eq!(p.rows(), m);
        let mut want = vec![0f32; m * k];
        assert!(quant::dequantize(DType::Q8_0, q.bytes(), &mut want));
        let mut row = vec![0f32; k];
        for j in 0..m {
            p.dequantize_row(j, &mut row);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&row), bits(&want[j * k..(j + 1) * k]), "row {j}");
        }
    }
}

/// `matmul_many` takes its one-pass path only for views no two tasks could both write.
#[test]
fn matmul_many_one_pass_only_for_side_by_side_views() {
    let cols = |n, stride, start, width| Rows::columns(n, stride, start, width);
    // Q, K, V side by side.
    assert!(side_by_side(
        &[cols(4, 96, 0, 64), cols(4, 96, 64, 16), cols(4, 96, 80, 16)],
        4
    ));
    // Overlapping columns.
    assert!(!side_by_side(&[cols(4, 96, 0, 64), cols(4, 96, 60, 16)], 4));
    // Rows narrower than the windows' span: row t's last window runs into row t + 1.
    assert!(!side_by_side(&[cols(4, 70, 0, 64), cols(4, 70, 64, 16)], 4));
    // ... which is harmless with one row.
    assert!(side_by_side(&[cols(1, 70, 0, 64), cols(1, 70, 64, 16)], 1));
    // Different strides or row counts.
    assert!(!side_by_side(&[cols(4, 96, 0, 64), cols(4, 97, 64, 16)], 4));
    assert!(!side_by_side(&[cols(4, 96, 0, 64), cols(3, 96, 64, 16)], 4));
}

/// A precise quantised weight (`load_weight_precise`) on the default backend takes two-level
/// activations: each product is within 1e-4 of the largest of the exact backend's (f32 activations,
/// dequantised rows), where the one-level 8-bit product of the same weight is ~100 times
/// further; a bias is added once; and every token gets the bits it gets alone. Q8_0 (Q8
/// activations) and Q4_K (Q8_K), with rows left over past the packed groups.
#[test]
fn precise_quantised_matmul_is_two_level_and_batch_invariant() {
    let be = CpuBackend::new();
    let exact = CpuBackend::exact();
    let mut r = rng();
    for (dt, k, m) in [(DType::Q8_0, 96, 29), (DType::Q4K, 256, 21)] {
        let w = rand_vec(&mut r, m * k);
        let bytes = match dt {
            DType::Q8_0 => q8_0_bytes(&w),
            _ => {
                // Q4_K blocks from the scalar reference quantiser's layout: random bytes with
                // small scales, as the kernel tests make them.
                let mut b = vec![0u8; dt.bytes_for(m * k).unwrap()];
                r.fill(&mut b[..]);
                for blk in b.chunks_mut(dt.block_bytes()) {
                    blk[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                    blk[2..4].copy_from_slice(&half::f16::from_f32(0.005).to_le_bytes());
                }
                b
            }
        };
        let t = RawTensor::from_bytes("w", dt, vec![m, k], bytes).unwrap();
        let bias_v = rand_vec(&mut r, m);
        let bias = be.load_weight(&f32_tensor("b", vec![m], &bias_v)).unwrap();
        let ebias = exact
            .load_weight(&f32_tensor("b", vec![m], &bias_v))
            .unwrap();
        let precise = be.load_weight_precise(&t).unwrap();
        let plain = be.load_weight(&t).unwrap();
        let reference = exact.load_weight(&t).unwrap();
        // Activations of unequal sizes, as a residual stream's are.
        let n = 7;
        let x: Vec<f32> = (0..n * k)
            .map(|i| r.gen_range(-1.0..1.0) * if i % 13 == 0 { 20.0 } else { 1.0 })
            .collect();
        let run = |b: &CpuBackend, w: &CpuWeight, bias: &CpuWeight, first: usize, n: usize| {
            let mut out = vec![0.0; n * m];
            b.matmul(
                &x[first * k..(first + n) * k].to_vec(),
                Rows::dense(n, k),
                w,
                Some(bias),
                &mut out,
                Rows::dense(n, m),
            );
            out
        };
        let got = run(&be, &precise, &bias, 0, n);
        let one = run(&be, &plain, &bias, 0, n);
        let want = run(&exact, &reference, &ebias, 0, n);
        let err = |a: &[f32]| {
            a.iter()
                .zip(&want)
                .fold(0f32, |e, (a, b)| e.max((a - b).abs()))
        };
        let scale = want.iter().fold(0f32, |s, v| s.max(v.abs()));
        let (two, eight) = (err(&got), err(&one));
        assert!(
            two <= 1e-4 * scale,
            "{dt}: two-level error {two} of {scale}"
        );
        assert!(
            eight > 30.0 * two,
            "{dt}: one-level {eight} vs two-level {two}"
        );
        for t in 0..n {
            let alone = run(&be, &precise, &bias, t, 1);
            for j in 0..m {
                assert_eq!(
                    got[t * m + j].to_bits(),
                    alone[j].to_bits(),
                    "{dt}: token {t} row {j}"
                );
            }
        }
    }
}

/// What `residual_q8`/`residual_q8k` leave is what the 8-bit blocks dropped: `x` minus the
/// blocks' values, each within half a step of the block's scale.
#[test]
fn residuals_are_what_the_blocks_drop() {
    let mut r = rng();
    let x: Vec<f32> = (0..512).map(|_| r.gen_range(-3.0..3.0)).collect();
    let mut lo = vec![0f32; 512];
    quant::q8::residual_q8(&x, &mut lo);
    let mut b = vec![quant::q8::BlockQ8::default(); 16];
    quant::q8::quantize_q8(&x, &mut b);
    for (i, (&v, &l)) in x.iter().zip(&lo).enumerate() {
        let blk = &b[i / 32];
        assert_eq!(l, v - blk.d * blk.qs[i % 32] as f32);
        assert!(
            l.abs() <= 0.5 * blk.d * 1.0001,
            "{i}: {l} vs step {}",
            blk.d
        );
    }
    quant::q8::residual_q8k(&x, &mut lo);
    let mut bk = vec![quant::q8::BlockQ8K::default(); 2];
    quant::q8::quantize_q8k(&x, &mut bk);
    for (i, (&v, &l)) in x.iter().zip(&lo).enumerate() {
        let blk = &bk[i / 256];
        assert_eq!(l, v - blk.d * blk.qs[i % 256] as f32);
        assert!(l.abs() <= 0.5 * blk.d * 1.0001);
    }
}

/// A precise bf16 weight is multiplied with f32 activations: the products of the exact
/// backend, bit for bit (whatever `FERRUM_BF16` says for other weights).
#[test]
fn precise_bf16_weight_takes_f32_activations() {
    let be = CpuBackend::new();
    let exact = CpuBackend::exact();
    let mut r = rng();
    let (k, m, n) = (64, 16, 5);
    let w = rand_vec(&mut r, m * k);
    let bytes: Vec<u8> = w
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let t = RawTensor::from_bytes("w", DType::BF16, vec![m, k], bytes).unwrap();
    let x = rand_vec(&mut r, n * k);
    let mut got = vec![0.0; n * m];
    let mut want = vec![0.0; n * m];
    let p = be.load_weight_precise(&t).unwrap();
    be.matmul(&x, Rows::dense(n, k), &p, None, &mut got, Rows::dense(n, m));
    let e = exact.load_weight(&t).unwrap();
    exact.matmul(
        &x,
        Rows::dense(n, k),
        &e,
        None,
        &mut want,
        Rows::dense(n, m),
    );
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// The CPU's in-place, threaded LayerNorm and GELU give the trait's default bodies' bits (the
/// same row functions over a host copy), on a strided view that leaves its neighbours alone.
#[test]
fn layer_norm_and_gelu_overrides_equal_the_host_defaults() {
    let mut r = rng();
    let be = CpuBackend::with_threads(2);
    let (n, w, stride, at) = (37, 96, 130, 7);
    let x = rand_vec(&mut r, n * stride + at);
    let weight = rand_vec(&mut r, w);
    let bias = rand_vec(&mut r, w);
    let view = Rows::columns(n, stride, at, w);
    let mut got = x.clone();
    be.layer_norm(&mut got, view, &weight, &bias, 1e-12);
    let mut gelu = x.clone();
    be.gelu(&mut gelu, view);
    let (mut want_ln, mut want_gelu) = (x.clone(), x.clone());
    for t in 0..n {
        let o = at + t * stride;
        crate::host_ops::layer_norm_row(&mut want_ln[o..o + w], &weight, &bias, 1e-12);
        crate::host_ops::gelu_erf(&mut want_gelu[o..o + w]);
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want_ln));
    assert_eq!(bits(&gelu), bits(&want_gelu));
}

/// An encoder's float matrix on the fast path becomes Q8_0 as llama.cpp quantises it (the
/// same bytes as the test's reference quantiser), and an exact backend keeps it in f32.
#[test]
fn compute_weights_are_q8_0_on_the_fast_path_only() {
    let mut r = rng();
    let (m, k) = (16, 64);
    let data = rand_vec(&mut r, m * k);
    let t = f32_tensor("w", vec![m, k], &data);
    let q = RawTensor::from_bytes("w", DType::Q8_0, vec![m, k], q8_0_bytes(&data)).unwrap();
    let x = rand_vec(&mut r, 3 * k);
    let run = |be: &CpuBackend, w: &CpuWeight| {
        let mut out = vec![0f32; 3 * m];
        be.matmul(&x, Rows::dense(3, k), w, None, &mut out, Rows::dense(3, m));
        out
    };
    let fast = CpuBackend::with_threads(2);
    assert_eq!(
        run(&fast, &fast.load_weight_compute(&t).unwrap()),
        run(&fast, &fast.load_weight(&q).unwrap())
    );
    let exact = CpuBackend::exact();
    assert_eq!(
        run(&exact, &exact.load_weight_compute(&t).unwrap()),
        run(&exact, &exact.load_weight(&t).unwrap())
    );
}

/// A float matmul over more tokens than fit L2 at once takes them a stretch at a time (a
/// vision tower's thousands of patches), and with 512-bit dots its rows `K_STRETCH` inputs at
/// a time: every (token, row) still gets `dot_f32`'s bits, the stretches' edges (not multiples
/// of the stretch, a tail of tokens past the last three, a last input stretch off a multiple
/// of 32) included, for f32 and f16 weights.
#[test]
fn float_matmul_over_many_tokens_is_dot_f32_in_stretches() {
    let mut r = rng();
    // 6000 columns: without 512-bit dots a stretch is 21 tokens, so 100 tokens take five
    // stretches and a tail; with them, six input stretches (the last 880 long, 16 past a
    // multiple of 32) and, for 300 tokens, three token stretches of up to 126.
    for n in [100, 300] {
        float_matmul_case(&mut r, n);
    }
}

fn float_matmul_case(r: &mut impl rand::Rng, n: usize) {
    let (k, m) = (6000, 9);
    let x = rand_vec(r, n * k);
    let w = rand_vec(r, m * k);
    let bias = rand_vec(r, m);
    let half: Vec<u8> = w
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let f16 = RawTensor::from_bytes("w16", DType::F16, vec![m, k], half).unwrap();
    let w16: Vec<f32> = w.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
    for be in [CpuBackend::new(), CpuBackend::exact()] {
        for (t, rows) in [(f32_tensor("w", vec![m, k], &w), &w), (f16.clone(), &w16)] {
            let wt = be.load_weight(&t).unwrap();
            let bt = be.load_weight(&f32_tensor("b", vec![m], &bias)).unwrap();
            let mut out = vec![0.0; n * m];
            be.matmul(
                &x,
                Rows::dense(n, k),
                &wt,
                Some(&bt),
                &mut out,
                Rows::dense(n, m),
            );
            for t in 0..n {
                for j in 0..m {
                    let want = simd::dot_f32(&x[t * k..][..k], &rows[j * k..][..k]) + bias[j];
                    assert_eq!(out[t * m + j].to_bits(), want.to_bits(), "{t},{j}");
                }
            }
        }
    }
}

/// The CPU's tanh GELU (`g / (1 + e^−2y)`, vectorised) is PyTorch's `½ g (1 + tanh y)` (the
/// host body) within a few ulp of the row's scale, and gives `gelu_tanh_mul`'s bits with
/// `u = 1`, on a strided view that leaves its neighbours alone.
#[test]
fn gelu_tanh_is_the_host_form_within_ulps() {
    let mut r = rng();
    let be = CpuBackend::with_threads(2);
    let (n, w, stride, at) = (9, 200, 230, 5);
    let x: Vec<f32> = rand_vec(&mut r, n * stride + at)
        .iter()
        .map(|v| v * 8.0)
        .collect();
    let view = Rows::columns(n, stride, at, w);
    let mut got = x.clone();
    be.gelu_tanh(&mut got, view);
    for (i, (&g, &x0)) in got.iter().zip(&x).enumerate() {
        let (t, c) = ((i.wrapping_sub(at)) / stride, (i.wrapping_sub(at)) % stride);
        if i < at || t >= n || c >= w {
            assert_eq!(
                g.to_bits(),
                x0.to_bits(),
                "element {i} outside the view changed"
            );
            continue;
        }
        let mut host = [x0];
        crate::host_ops::gelu_tanh(&mut host);
        let mut twin = [0f32];
        simd::gelu_tanh_mul_scalar(&[x0], &[1.0], &mut twin);
        assert!(
            (g - host[0]).abs() <= 4.0 * f32::EPSILON * x0.abs().max(1.0),
            "{x0}: {g} vs {}",
            host[0]
        );
        assert!(
            (g - twin[0]).abs() <= f32::EPSILON * x0.abs().max(1e-30),
            "{x0}: {g} vs twin {}",
            twin[0]
        );
    }
}

/// A float matrix loaded as an encoder's takes the tiled GEMM from `TILED_MIN` tokens (within
/// f32 rounding of the plain matmul, bias included) and below it is the plain matmul, bit for
/// bit; f16 weights too.
#[test]
fn encoder_weights_take_the_tiled_gemm_over_many_tokens() {
    let mut r = rng();
    let (m, k) = (70, 96);
    let data = rand_vec(&mut r, m * k);
    let bias = rand_vec(&mut r, m);
    let be = CpuBackend::with_threads(2);
    let f16: Vec<u8> = data
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    for t in [
        f32_tensor("w", vec![m, k], &data),
        RawTensor::from_bytes("w", DType::F16, vec![m, k], f16).unwrap(),
    ] {
        let (plain, enc) = (
            be.load_weight(&t).unwrap(),
            be.load_weight_encoder(&t).unwrap(),
        );
        let b = be.load_weight(&f32_tensor("b", vec![m], &bias)).unwrap();
        for n in [TILED_MIN - 1, TILED_MIN, 3 * TILED_MIN + 5] {
            let x = rand_vec(&mut r, n * k);
            let run = |w: &CpuWeight| {
                let mut out = vec![0f32; n * m];
                be.matmul(
                    &x,
                    Rows::dense(n, k),
                    w,
                    Some(&b),
                    &mut out,
                    Rows::dense(n, m),
                );
                out
            };
            let (want, got) = (run(&plain), run(&enc));
            if n < TILED_MIN {
                assert!(want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            } else {
                for (a, b) in want.iter().zip(&got) {
                    assert!((a - b).abs() < 1e-4, "n {n}: {a} vs {b}");
                }
            }
        }
    }
}
