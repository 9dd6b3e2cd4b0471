//! IQ4_NL and IQ4_XS, as llama-quantize makes them without an importance matrix
//! (`quantize_iq4_nl` / `quantize_iq4_xs` → `quantize_row_iq4_nl_impl` with seven trial scales
//! each way and weights `x²`). Each 32-value group gets the least-squares scale over the
//! non-linear levels, searched around `max / level₀`; IQ4_XS then stores the groups' scales
//! as 6-bit multiples of one f16 super-scale and picks the levels again against them.
//!
//! Layouts (ggml-common.h): IQ4_NL `d: f16, qs: [u8; 16]` (18 bytes), IQ4_XS `d: f16,
//! scales_h: u16, scales_l: [u8; 4], qs: [u8; 128]` (136 bytes); nibbles as Q4_0's.

use super::k_search::{nearest_int, GROUP_MAX_EPS};
use super::put_f16;

/// The sixteen levels (ggml's `kvalues_iq4nl`).
pub const VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Trial scales on each side of the first guess.
const NTRY: i32 = 7;

pub const NL_BLOCK_BYTES: usize = 18;
pub const XS_BLOCK_BYTES: usize = 136;

/// The level nearest `x` (the lower one on ties), by bisection as ggml's `best_index_int8`.
fn best_index(x: f32) -> u8 {
    let v = |i: usize| VALUES[i] as f32;
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < v(mav) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - v(mu - 1) < v(mu) - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// One 32-value group: its scale (0 for a group of zeros) with its codes in `l`.
fn group_scale(xb: &[f32], l: &mut [u8]) -> f32 {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let v0 = VALUES[0] as f32;
    let mut d = -max / v0;
    let mut id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for (j, &x) in xb.iter().enumerate() {
        let code = best_index(id * x);
        l[j] = code;
        let q = VALUES[code as usize] as f32;
        let w = x * x;
        sumqx += w * q * x;
        sumq2 += w * q * q;
    }
    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        id = (itry + VALUES[0] as i32) as f32 / max;
        sumqx = 0.0;
        sumq2 = 0.0;
        for &x in xb {
            let q = VALUES[best_index(id * x) as usize] as f32;
            let w = x * x;
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Codes of a 32-value group as 16 bytes: value `j` in the low nibble of byte `j`, value
/// `j + 16` in its high nibble.
fn pack_nibbles(l: &[u8], out: &mut [u8]) {
    for j in 0..16 {
        out[j] = l[j] | (l[j + 16] << 4);
    }
}

pub fn quantize_nl(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(NL_BLOCK_BYTES)) {
        let mut l = [0u8; 32];
        let d = group_scale(xb, &mut l);
        put_f16(&mut ob[0..2], d);
        // The codes are picked again against the chosen scale (in f32, not its f16); a group
        // of zeros gets the level nearest zero, as in llama.cpp.
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (c, &v) in l.iter_mut().zip(xb) {
            *c = best_index(id * v);
        }
        pack_nibbles(&l, &mut ob[2..18]);
    }
}

pub fn quantize_xs(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x
        .chunks_exact(256)
        .zip(out.chunks_exact_mut(XS_BLOCK_BYTES))
    {
        let mut l = [0u8; 256];
        let mut scales = [0f32; 8];
        let (mut max_scale, mut amax_scale) = (0f32, 0f32);
        for (ib, s) in scales.iter_mut().enumerate() {
            *s = group_scale(&xb[32 * ib..32 * ib + 32], &mut l[32 * ib..32 * ib + 32]);
            if s.abs() > amax_scale {
                amax_scale = s.abs();
                max_scale = *s;
            }
        }
        let d = -max_scale / 32.0;
        put_f16(&mut ob[0..2], d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (mut scales_h, mut scales_l) = (0u16, [0u8; 4]);
        for (ib, &s) in scales.iter().enumerate() {
            let ls = nearest_int(id * s).clamp(-32, 31);
            let dl = d * ls as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for j in 32 * ib..32 * ib + 32 {
                l[j] = best_index(idl * xb[j]);
            }
            let ls = (ls + 32) as u8;
            scales_l[ib / 2] |= (ls & 0x0f) << (4 * (ib % 2));
            scales_h |= ((ls >> 4) as u16) << (2 * ib);
        }
        ob[2..4].copy_from_slice(&scales_h.to_le_bytes());
        ob[4..8].copy_from_slice(&scales_l);
        for ib in 0..8 {
            pack_nibbles(
                &l[32 * ib..32 * ib + 32],
                &mut ob[8 + 16 * ib..8 + 16 * ib + 16],
            );
        }
    }
}
