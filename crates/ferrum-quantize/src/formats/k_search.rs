//! The scale searches shared by the K-quants, after llama.cpp's reference helpers in
//! `ggml-quants.c` (`make_qx_quants`, `make_q3_quants`, `make_qkx2_quants`). Each one picks
//! the scale (and minimum) of one small group of weights; the callers then quantise those
//! per-group scales again against one f16 super-scale per 256 weights.
//!
//! The arithmetic is written in the same order as the reference so the f32 rounding, and
//! therefore the chosen integers, are the same.

/// Groups whose largest magnitude is below this are stored as zeros.
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even, via the 1.5·2^23 trick the reference uses (valid for
/// |x| < 2^22, which every call here satisfies).
#[inline]
pub fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits();
    (bits & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Symmetric quantisation to `[-nmax, nmax)` with a weighted least-squares scale, refined
/// over 18 nearby trial scales (`rmse_type` 1: weights `x²`). Writes `L[i] = l + nmax` and
/// returns the scale.
pub fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8], rmse_type: i32) -> f32 {
    let (amax, max) = super::signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l_out.iter_mut().for_each(|l| *l = 0);
        return 0.0;
    }
    let weight = |v: f32| match rmse_type {
        1 => v * v,
        2 => 1.0,
        3 => v.abs(),
        _ => v.abs().sqrt(),
    };
    let mut iscale = -(nmax as f32) / max;
    if rmse_type == 0 {
        for (l, &v) in l_out.iter_mut().zip(x) {
            let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            *l = (nmax + q) as i8;
        }
        return 1.0 / iscale;
    }
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for (l, &v) in l_out.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *l = (q + nmax) as i8;
        let w = weight(v);
        let qf = q as f32;
        sumlx += w * v * qf;
        suml2 += w * qf * qf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let qf = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = weight(v);
            sumlx += w * v * qf;
            suml2 += w * qf * qf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (l, &v) in l_out.iter_mut().zip(x) {
                let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
                *l = (nmax + q) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q3_K's group search: start from the max-based scale, then move single weights to the
/// integer that most improves the `x²`-weighted fit (up to five passes). Writes
/// `L[i] = l + nmax` and returns the scale.
pub fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (amax, max) = super::signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l_out.iter_mut().for_each(|l| *l = 0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for (l, &v) in l_out.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *l = q as i8;
        let w = v * v;
        let qf = q as f32;
        sumlx += w * v * qf;
        suml2 += w * qf * qf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let li = l_out[i] as f32;
            let mut slx = sumlx - w * v * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l_out[i] as i32 {
                    let nf = new_l as f32;
                    slx += w * v * nf;
                    sl2 += w * nf * nf;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for l in l_out.iter_mut() {
        *l += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Parameters of [`make_qkx2_quants`]'s search over trial scales
/// `(nmax + rmin + rdelta·k) / (max - min)`, `k = 0..=nstep`.
pub struct Qkx2 {
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    /// Minimise weighted absolute error instead of squared error.
    pub use_mad: bool,
}

/// Asymmetric quantisation to `[0, nmax]` with a scale and a (non-positive) minimum: for
/// each trial scale, round, then solve the weighted least-squares fit for scale and minimum,
/// keeping the best. Writes `L`, returns `(scale, -min)`.
pub fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    p: &Qkx2,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.iter_mut().for_each(|l| *l = 0);
        return (0.0, -min);
    }
    let err = |d: f32| if p.use_mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if p.nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    let laux = &mut laux[..n];
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l_out.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-0.4), 0);
        assert_eq!(nearest_int(2.6), 3);
        assert_eq!(nearest_int(-31.7), -32);
    }
}
