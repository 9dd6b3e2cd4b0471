//! Linear-attention ops (Gated DeltaNet: Qwen3.5, Qwen3-Next): the depthwise causal
//! convolution and the gated delta rule over a recurrent state per sequence.
//!
//! The delta rule runs token by token in prefill as in decode. On a CPU the state update is
//! a few multiply-adds per state element per token — well under 1% of a layer's matmul
//! work — and running it the same way whatever the chunk keeps a sequence's numbers
//! independent of how its tokens were batched (the chunked form regroups the sums). The
//! state's two passes per token are vector kernels (AVX2 + FMA, AVX-512F) with a scalar twin
//! of the same fused multiply-adds per element: every element's arithmetic is independent
//! of the others', so the instances give the same bits.

use crate::{DeltaParams, Rows, StateSeq};

use super::pool::ThreadPool;
use super::SharedMut;

/// `silu(x) = x · sigmoid(x)`, as the reference computes it.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn softplus(x: f64) -> f64 {
    // torch's default threshold: above 20 softplus is x to f32 precision.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// [`crate::Backend::causal_conv1d`].
pub(super) fn causal_conv1d(
    x: &mut [f32],
    xv: Rows,
    w: &[f32],
    kernel: usize,
    state: &mut [f32],
    seqs: &[StateSeq],
) {
    let c = xv.width();
    let hist = kernel.saturating_sub(1);
    assert!(kernel >= 1, "conv1d: kernel of 0 taps");
    assert_eq!(
        w.len(),
        kernel * c,
        "conv1d: weight is not kernel × channels"
    );
    assert_eq!(seqs.iter().map(|s| s.rows).sum::<usize>(), xv.count);
    // The inputs a row's taps read: the state's rows, then the sequence's own, in order.
    let mut window = Vec::new();
    let mut row = 0;
    for s in seqs {
        let st = &mut state[s.slot * hist * c..(s.slot + 1) * hist * c];
        if s.fresh {
            st.fill(0.0);
        }
        window.clear();
        window.extend_from_slice(st);
        for t in 0..s.rows {
            let xi = xv.offset + (row + t) * xv.stride;
            window.extend_from_slice(&x[xi..xi + c]);
        }
        for t in 0..s.rows {
            let xi = xv.offset + (row + t) * xv.stride;
            let out = &mut x[xi..xi + c];
            out.fill(0.0);
            for j in 0..kernel {
                let inp = &window[(t + j) * c..(t + j + 1) * c];
                let wj = &w[j * c..(j + 1) * c];
                for ((o, &a), &b) in out.iter_mut().zip(inp).zip(wj) {
                    *o += a * b;
                }
            }
            for o in out.iter_mut() {
                *o = silu(*o);
            }
        }
        let total = window.len() / c;
        st.copy_from_slice(&window[(total - hist) * c..]);
        row += s.rows;
    }
}

/// `v · (1 / √(Σv² + 1e-6))`, the reference's L2 normalisation, with `extra` folded into
/// the factor (the query's `1/√k_dim`). The sum and factor in f64: per-token scalars cost
/// nothing beside the state update, and the rule compounds their rounding over a sequence.
fn l2norm(v: &mut [f32], extra: f64) {
    let ss: f64 = v.iter().map(|&a| a as f64 * a as f64).sum();
    let inv = extra / (ss + 1e-6).sqrt();
    for a in v {
        *a = (*a as f64 * inv) as f32;
    }
}

/// The vector instance the gated delta rule runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaIsa {
    Scalar,
    Avx2,
    Avx512,
}

impl DeltaIsa {
    /// The widest instance this CPU runs, fixed at the first call.
    pub fn best() -> DeltaIsa {
        static BEST: std::sync::OnceLock<DeltaIsa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            DeltaIsa::available()
                .last()
                .copied()
                .unwrap_or(DeltaIsa::Scalar)
        })
    }

    /// The instances this CPU runs, narrowest first.
    pub fn available() -> Vec<DeltaIsa> {
        let mut v = vec![DeltaIsa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(DeltaIsa::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(DeltaIsa::Avx512);
            }
        }
        v
    }
}

/// One token's update of one head's state `s` (`k.len()` rows of `v.len()`): decays it,
/// reads it at `k`, writes `β (v − Sᵀk)` along `k`, and reads it at `q` into `out`.
/// `mem` is scratch of `v.len()`.
#[allow(clippy::too_many_arguments)]
pub fn delta_step(
    isa: DeltaIsa,
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    mem: &mut [f32],
    out: &mut [f32],
) {
    let dv = v.len();
    assert_eq!(s.len(), k.len() * dv);
    assert_eq!(q.len(), k.len());
    assert!(mem.len() == dv && out.len() == dv);
    match isa {
        #[cfg(target_arch = "x86_64")]
        DeltaIsa::Avx2 if dv.is_multiple_of(8) => {
            // SAFETY: the caller picked this instance from `DeltaIsa::best`/`available`, so
            // the CPU has AVX2 and FMA; lengths are checked above.
            unsafe { x86::step_avx2(s, q, k, v, decay, beta, mem, out) }
        }
        #[cfg(target_arch = "x86_64")]
        DeltaIsa::Avx512 if dv.is_multiple_of(16) => {
            // SAFETY: as above, for AVX-512F.
            unsafe { x86::step_avx512(s, q, k, v, decay, beta, mem, out) }
        }
        _ => step_scalar(s, q, k, v, decay, beta, mem, out),
    }
}

/// The scalar twin: the vector kernels' per-element operations (a multiply, then fused
/// multiply-adds) in the same order.
#[allow(clippy::too_many_arguments)]
fn step_scalar(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    mem: &mut [f32],
    out: &mut [f32],
) {
    let dv = v.len();
    mem.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (e, m) in row.iter_mut().zip(mem.iter_mut()) {
            *e *= decay;
            *m = e.mul_add(ki, *m);
        }
    }
    for (m, &vj) in mem.iter_mut().zip(v) {
        *m = (vj - *m) * beta;
    }
    out.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
        for ((e, &d), o) in row.iter_mut().zip(mem.iter()).zip(out.iter_mut()) {
            *e = ki.mul_add(d, *e);
            *o = e.mul_add(qi, *o);
        }
    }
}

/// One instance of the delta-rule step per vector width: the scalar twin's operations on
/// `$lanes` elements at a time.
#[cfg(target_arch = "x86_64")]
macro_rules! delta_step_kernel {
    ($name:ident, $feat:literal, $lanes:literal, $set1:ident, $zero:ident, $load:ident,
     $store:ident, $mul:ident, $sub:ident, $fmadd:ident) => {
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn $name(
            s: &mut [f32],
            q: &[f32],
            k: &[f32],
            v: &[f32],
            decay: f32,
            beta: f32,
            mem: &mut [f32],
            out: &mut [f32],
        ) {
            let dv = v.len();
            let sp = s.as_mut_ptr();
            let mp = mem.as_mut_ptr();
            let op = out.as_mut_ptr();
            let dec = $set1(decay);
            for j in (0..dv).step_by($lanes) {
                $store(mp.add(j), $zero());
            }
            for (i, &ki) in k.iter().enumerate() {
                let kb = $set1(ki);
                let row = sp.add(i * dv);
                for j in (0..dv).step_by($lanes) {
                    let e = $mul($load(row.add(j)), dec);
                    $store(row.add(j), e);
                    $store(mp.add(j), $fmadd(e, kb, $load(mp.add(j))));
                }
            }
            let bb = $set1(beta);
            for j in (0..dv).step_by($lanes) {
                let d = $sub($load(v.as_ptr().add(j)), $load(mp.add(j)));
                $store(mp.add(j), $mul(d, bb));
                $store(op.add(j), $zero());
            }
            for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
                let (kb, qb) = ($set1(ki), $set1(qi));
                let row = sp.add(i * dv);
                for j in (0..dv).step_by($lanes) {
                    let e = $fmadd(kb, $load(mp.add(j)), $load(row.add(j)));
                    $store(row.add(j), e);
                    $store(op.add(j), $fmadd(e, qb, $load(op.add(j))));
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    delta_step_kernel!(
        step_avx2,
        "avx2,fma",
        8,
        _mm256_set1_ps,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_mul_ps,
        _mm256_sub_ps,
        _mm256_fmadd_ps
    );
    delta_step_kernel!(
        step_avx512,
        "avx512f",
        16,
        _mm512_set1_ps,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_mul_ps,
        _mm512_sub_ps,
        _mm512_fmadd_ps
    );
}

/// [`crate::Backend::gated_delta`]: one task per (sequence, value head), each running its
/// sequence's tokens in order.
#[allow(clippy::too_many_arguments)]
pub(super) fn gated_delta(
    pool: &ThreadPool,
    isa: DeltaIsa,
    x: &[f32],
    qv: Rows,
    kv: Rows,
    vv: Rows,
    av: Rows,
    bv: Rows,
    p: DeltaParams,
    state: &mut [f32],
    seqs: &[StateSeq],
    out: &mut [f32],
    ov: Rows,
) {
    let (nk, nv, dk, dv) = (p.k_heads, p.v_heads, p.k_dim, p.v_dim);
    assert!(
        nk > 0 && nv.is_multiple_of(nk),
        "delta rule: value heads per key head"
    );
    assert!(qv.heads == nk && kv.heads == nk && qv.head_dim == dk && kv.head_dim == dk);
    assert!(vv.heads == nv && vv.head_dim == dv && ov.heads == nv && ov.head_dim == dv);
    assert!(av.width() == nv && bv.width() == nv);
    assert!(p.a.len() == nv && p.dt_bias.len() == nv);
    let n = qv.count;
    assert!(kv.count == n && vv.count == n && av.count == n && bv.count == n && ov.count == n);
    assert_eq!(seqs.iter().map(|s| s.rows).sum::<usize>(), n);
    for v in [qv, kv, vv, av, bv] {
        super::check_view("gated_delta input", v, x.len());
    }
    super::check_view("gated_delta out", ov, out.len());
    let per = dk * dv;
    let top = seqs.iter().map(|s| s.slot + 1).max().unwrap_or(0);
    assert!(
        state.len() >= top * nv * per,
        "gated_delta: state slot out of range"
    );
    let mut first = Vec::with_capacity(seqs.len());
    let mut row = 0;
    for s in seqs {
        first.push(row);
        row += s.rows;
    }
    let st = SharedMut(state.as_mut_ptr());
    let o = SharedMut(out.as_mut_ptr());
    let task = |t: usize| {
        let (si, h) = (t / nv, t % nv);
        let s = seqs[si];
        let kh = p.key_head(h);
        // SAFETY: each task owns one (slot, head) state region (slots are distinct per
        // sequence, asserted before the tasks run; in range, checked above) and writes only
        // its own head's columns of its sequence's rows of `out`.
        let sh = unsafe { st.slice((s.slot * nv + h) * per, per) };
        if s.fresh {
            sh.fill(0.0);
        }
        let (mut qb, mut kb, mut mem) = (vec![0f32; dk], vec![0f32; dk], vec![0f32; dv]);
        let scale = 1.0 / (dk as f64).sqrt();
        for r in first[si]..first[si] + s.rows {
            let qi = qv.offset + r * qv.stride + kh * dk;
            let ki = kv.offset + r * kv.stride + kh * dk;
            let vi = vv.offset + r * vv.stride + h * dv;
            qb.copy_from_slice(&x[qi..qi + dk]);
            kb.copy_from_slice(&x[ki..ki + dk]);
            l2norm(&mut qb, scale);
            l2norm(&mut kb, 1.0);
            let a = x[av.offset + r * av.stride + h] as f64;
            let b = x[bv.offset + r * bv.stride + h] as f64;
            let decay = (p.a[h] as f64 * softplus(a + p.dt_bias[h] as f64)).exp() as f32;
            let beta = (1.0 / (1.0 + (-b).exp())) as f32;
            // SAFETY: as above: this head's columns of this row.
            let out = unsafe { o.slice(ov.offset + r * ov.stride + h * dv, dv) };
            delta_step(
                isa,
                sh,
                &qb,
                &kb,
                &x[vi..vi + dv],
                decay,
                beta,
                &mut mem,
                out,
            );
        }
    };
    let mut slots: Vec<usize> = seqs.iter().map(|s| s.slot).collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(
        slots.len(),
        seqs.len(),
        "gated_delta: two sequences share a state slot"
    );
    pool.run(seqs.len() * nv, &task);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every instance this CPU has gives the scalar twin's bits, over many tokens.
    #[test]
    fn delta_step_instances_equal_scalar() {
        let (dk, dv) = (32, 48);
        let avail = DeltaIsa::available();
        eprintln!("delta rule instances run here: {avail:?}");
        for isa in avail {
            let mut seed = 0x9e3779b97f4a7c15;
            let mut s_ref = rand(&mut seed, dk * dv);
            let mut s = s_ref.clone();
            let (mut m1, mut m2) = (vec![0.0; dv], vec![0.0; dv]);
            let (mut o1, mut o2) = (vec![0.0; dv], vec![0.0; dv]);
            for step in 0..50 {
                let q = rand(&mut seed, dk);
                let k = rand(&mut seed, dk);
                let v = rand(&mut seed, dv);
                let decay = 0.5 + 0.01 * step as f32;
                step_scalar(&mut s_ref, &q, &k, &v, decay, 0.7, &mut m1, &mut o1);
                delta_step(isa, &mut s, &q, &k, &v, decay, 0.7, &mut m2, &mut o2);
                assert_eq!(
                    o1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    o2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{isa:?} step {step}"
                );
            }
            assert!(s
                .iter()
                .zip(&s_ref)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    /// The delta rule against its definition, written with plain sums (f64).
    #[test]
    fn delta_step_matches_definition() {
        let (dk, dv) = (8, 16);
        let mut seed = 42;
        let mut s = rand(&mut seed, dk * dv);
        let s0: Vec<f64> = s.iter().map(|&x| x as f64).collect();
        let (q, k, v) = (
            rand(&mut seed, dk),
            rand(&mut seed, dk),
            rand(&mut seed, dv),
        );
        let (decay, beta) = (0.8f32, 0.3f32);
        let (mut mem, mut out) = (vec![0.0; dv], vec![0.0; dv]);
        delta_step(
            DeltaIsa::best(),
            &mut s,
            &q,
            &k,
            &v,
            decay,
            beta,
            &mut mem,
            &mut out,
        );
        let mut want = s0.clone();
        for e in &mut want {
            *e *= decay as f64;
        }
        for j in 0..dv {
            let kv: f64 = (0..dk).map(|i| want[i * dv + j] * k[i] as f64).sum();
            let d = (v[j] as f64 - kv) * beta as f64;
            for i in 0..dk {
                want[i * dv + j] += k[i] as f64 * d;
            }
        }
        for j in 0..dv {
            let o: f64 = (0..dk).map(|i| want[i * dv + j] * q[i] as f64).sum();
            assert!(
                (o - out[j] as f64).abs() < 1e-5,
                "out {j}: {o} vs {}",
                out[j]
            );
        }
        for (a, b) in s.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5);
        }
    }

    /// A sequence run in one call equals the same run split into calls that carry the state.
    #[test]
    fn conv_state_carries_across_calls() {
        let (c, kernel, n) = (12, 4, 9);
        let mut seed = 7;
        let w = rand(&mut seed, kernel * c);
        let x0 = rand(&mut seed, n * c);
        let mut whole = x0.clone();
        let mut st = vec![0.0; (kernel - 1) * c];
        let one = |rows, fresh| StateSeq {
            rows,
            slot: 0,
            fresh,
        };
        causal_conv1d(
            &mut whole,
            Rows::dense(n, c),
            &w,
            kernel,
            &mut st,
            &[one(n, true)],
        );
        let mut parts = x0.clone();
        let mut st2 = vec![1.0; (kernel - 1) * c];
        let (a, b) = parts.split_at_mut(2 * c);
        causal_conv1d(a, Rows::dense(2, c), &w, kernel, &mut st2, &[one(2, true)]);
        causal_conv1d(
            b,
            Rows::dense(n - 2, c),
            &w,
            kernel,
            &mut st2,
            &[one(n - 2, false)],
        );
        assert_eq!(whole, parts);
        assert_eq!(st, st2);
        // Position 0 sees only its own input: silu(w[last] · x).
        let y0 = silu(w[(kernel - 1) * c] * x0[0]);
        assert_eq!(whole[0], y0);
    }
}
