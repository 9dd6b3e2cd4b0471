//! Element-wise ops of the encoder models (BERT's LayerNorm with a bias, the erf form of
//! GELU) as plain host code: the bodies of [`Backend::layer_norm`](crate::Backend::layer_norm)
//! and [`Backend::gelu`](crate::Backend::gelu), which any backend can run by reading its
//! buffer out and writing it back. They are a small share of an encoder's work (one pass over
//! each activation row against a matmul's hundreds), so a backend overrides them only to
//! save the copies.

/// `row = (row − mean) / sqrt(var + eps) · weight + bias`, the population variance, in f32 as
/// PyTorch's `layer_norm` computes it on the CPU (two passes: the mean, then the centred
/// squares).
pub fn layer_norm_row(row: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    debug_assert!(weight.len() == row.len() && bias.len() == row.len());
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, w), b) in row.iter_mut().zip(weight).zip(bias) {
        *v = (*v - mean) * inv * w + b;
    }
}

/// The error function in f32: a rational approximation, `x · p(x²) / q(x²)` on x clamped to
/// ±4 (past which erf is ±1 in f32), a few ulp from the true value. Branch-free and without a
/// call into libm, so a loop of it vectorises.
#[inline]
pub fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10_f32;
    p = p * x2 + 2.770_681_4e-8;
    p = p * x2 - 2.101_024e-6;
    p = p * x2 - 5.692_506_4e-5;
    p = p * x2 - 7.349_906_3e-4;
    p = p * x2 - 2.954_600_3e-3;
    p = p * x2 - 1.609_603_3e-2;
    let mut q = -1.456_607_2e-5_f32;
    q = q * x2 - 2.133_740_6e-4;
    q = q * x2 - 1.682_827e-3;
    q = q * x2 - 7.373_329e-3;
    q = q * x2 - 1.426_474e-2;
    x * p / q
}

/// GELU in its exact form, `x · ½ (1 + erf(x / √2))` (BERT's `"gelu"`), in place.
pub fn gelu_erf(xs: &mut [f32]) {
    for v in xs {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// GELU's tanh approximation, `½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))`, in place, in f32
/// as PyTorch computes `gelu(approximate="tanh")`.
pub fn gelu_tanh(xs: &mut [f32]) {
    const C: f32 = 0.797_884_6; // √(2/π)
    for v in xs {
        let x = *v;
        *v = 0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh());
    }
}

/// Columns a stretch of [`Backend::add_low_rank`](crate::Backend::add_low_rank)'s factor
/// holds: its rows for those columns lie together, so a stretch of every row is read once
/// and stays in L1 while the pass's rows are updated.
pub const LOW_RANK_STRETCH: usize = 256;

/// A `rank × width` row-major matrix (a LoRA update's scaled `Bᵀ`) in the stretch layout
/// [`Backend::add_low_rank`](crate::Backend::add_low_rank) reads: stretch `k` (columns
/// `k·S..min((k+1)·S, width)`, `S` = [`LOW_RANK_STRETCH`]) holds those columns of row 0,
/// then of row 1, and so on.
pub fn low_rank_stretches(m: &[f32], rank: usize, width: usize) -> Vec<f32> {
    assert_eq!(m.len(), rank * width);
    let mut out = Vec::with_capacity(m.len());
    for c0 in (0..width).step_by(LOW_RANK_STRETCH) {
        let c1 = (c0 + LOW_RANK_STRETCH).min(width);
        for j in 0..rank {
            out.extend_from_slice(&m[j * width + c0..j * width + c1]);
        }
    }
    out
}

/// `out += Σ_j low[j] · bt[j]` for one row (`bt` in [`low_rank_stretches`]' layout), each
/// element's terms fused-multiply-added in `j` order: the CPU kernel's scalar twin (the
/// attention's `mix`, stretch by stretch), and the trait's default body.
pub fn add_low_rank_row(out: &mut [f32], low: &[f32], bt: &[f32]) {
    let (w, r) = (out.len(), low.len());
    let mut at = 0;
    for c0 in (0..w).step_by(LOW_RANK_STRETCH) {
        let acc = &mut out[c0..(c0 + LOW_RANK_STRETCH).min(w)];
        let n = acc.len();
        for (j, &lj) in low.iter().enumerate() {
            for (a, &b) in acc.iter_mut().zip(&bt[at + j * n..at + (j + 1) * n]) {
                *a = lj.mul_add(b, *a);
            }
        }
        at += r * n;
    }
}

/// One row of [`Backend::rope_axes`](crate::Backend::rope_axes): `heads` heads of
/// `head_dim`, pair `i` rotated by `pos[pair_axis[i]] · inv_freq[i]`. The angle is an f32
/// product and its cosine and sine are rounded from f64, as the CPU backend's `rope` takes
/// them, so a row whose axes agree is rotated to the same bits as by `rope`.
pub fn rope_axes_row(
    row: &mut [f32],
    heads: usize,
    head_dim: usize,
    pos: &[u32],
    pair_axis: &[u8],
    p: &crate::RopeParams,
) {
    let half = p.inv_freq.len();
    let (cos, sin): (Vec<f32>, Vec<f32>) = p
        .inv_freq
        .iter()
        .zip(pair_axis)
        .map(|(&f, &a)| {
            let angle = (pos[a as usize] as f32 * f) as f64;
            (angle.cos() as f32 * p.factor, angle.sin() as f32 * p.factor)
        })
        .unzip();
    for head in row.chunks_exact_mut(head_dim).take(heads) {
        match p.layout {
            crate::RopeLayout::Neox => {
                let (a, b) = head[..2 * half].split_at_mut(half);
                for (((x0, x1), &c), &s) in a.iter_mut().zip(b).zip(&cos).zip(&sin) {
                    (*x0, *x1) = (*x0 * c - *x1 * s, *x1 * c + *x0 * s);
                }
            }
            crate::RopeLayout::Interleaved => {
                for ((pair, &c), &s) in head[..2 * half].chunks_exact_mut(2).zip(&cos).zip(&sin) {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = x0 * c - x1 * s;
                    pair[1] = x1 * c + x0 * s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf in f64 by its Maclaurin series (converges everywhere; at |x| ≤ 4 the largest term
    /// is under 1e6, so the sum keeps ten significant digits).
    fn erf_series(x: f64) -> f64 {
        let mut term = x;
        let mut sum = x;
        let mut n = 0.0;
        loop {
            n += 1.0;
            term *= -x * x / n;
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn erf_is_within_a_few_ulp_of_the_series() {
        let mut worst = 0f64;
        for i in -6000..=6000 {
            let x = i as f32 / 1000.0;
            let want = if x.abs() >= 4.0 {
                x.signum() as f64 * erf_series(4.0)
            } else {
                erf_series(x as f64)
            };
            let got = erf(x) as f64;
            worst = worst.max((got - want).abs());
        }
        assert!(worst < 4e-7, "erf off by {worst}");
    }

    #[test]
    fn layer_norm_centres_and_scales() {
        let mut r = [1.0f32, 2.0, 3.0, 4.0];
        layer_norm_row(&mut r, &[1.0; 4], &[0.5; 4], 0.0);
        let want = [-1.341_640_8, -0.447_213_6, 0.447_213_6, 1.341_640_8];
        for (g, w) in r.iter().zip(want) {
            assert!((g - (w + 0.5)).abs() < 1e-6, "{r:?}");
        }
    }
}
