//! Q4_K: super-blocks of 256 = 8 groups of 32, 4-bit codes with a per-group scale and
//! minimum (`make_qkx2_quants`, squared error weighted by `rms(group) + |x|`), both stored as
//! 6-bit integers relative to f16 `d` and `dmin`. Layout: `d: f16, dmin: f16,
//! scales: [u8; 12]` (eight 6-bit scales and eight 6-bit mins), `qs: [u8; 128]` (144 bytes).

use super::k_search::{make_qkx2_quants, nearest_int, Qkx2};
use super::{put_f16, round_f16};

pub const QK_K: usize = 256;
pub const BLOCK_BYTES: usize = 144;

/// The per-group weights of Q4_K and Q5_K: the group's RMS plus each weight's magnitude.
pub(crate) fn group_weights(g: &[f32]) -> [f32; 32] {
    let sum_x2: f32 = g.iter().fold(0.0, |s, v| s + v * v);
    let av_x = (sum_x2 / 32.0).sqrt();
    let mut w = [0f32; 32];
    for (w, v) in w.iter_mut().zip(g) {
        *w = av_x + v.abs();
    }
    w
}

/// Searches scales and mins for the eight groups, quantises them to 6 bits, and re-derives
/// each weight's code (`0..=nmax`) from the stored (rounded) scales. Returns the packed
/// scales, `d`, `dmin` and the codes.
pub(crate) fn scales_and_codes(
    xb: &[f32],
    nmax: i32,
    search: &Qkx2,
) -> ([u8; 12], f32, f32, [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..8 {
        let g = &xb[32 * j..32 * j + 32];
        let weights = group_weights(g);
        let (s, m) = make_qkx2_quants(nmax, g, &weights, &mut l[32 * j..32 * j + 32], search);
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls[j];
            packed[j + 4] = lm[j];
        } else {
            packed[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
            packed[j - 4] |= (ls[j] >> 4) << 6;
            packed[j] |= (lm[j] >> 4) << 6;
        }
    }
    let d = max_scale / 63.0;
    let dmin = max_min / 63.0;
    let (d16, dmin16) = (round_f16(d), round_f16(dmin));
    for j in 0..8 {
        let dl = d16 * ls[j] as f32;
        if dl == 0.0 {
            continue;
        }
        let dm = dmin16 * lm[j] as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((xb[32 * j + ii] + dm) / dl).clamp(0, nmax) as u8;
        }
    }
    (packed, d, dmin, l)
}

pub fn quantize(x: &[f32], out: &mut [u8]) {
    let search = Qkx2 {
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
    };
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let (packed, d, dmin, l) = scales_and_codes(xb, 15, &search);
        put_f16(&mut ob[0..2], d);
        put_f16(&mut ob[2..4], dmin);
        ob[4..16].copy_from_slice(&packed);
        for chunk in 0..4 {
            for i in 0..32 {
                ob[16 + chunk * 32 + i] = l[chunk * 64 + i] | (l[chunk * 64 + 32 + i] << 4);
            }
        }
    }
}
