//! Q6_K: super-blocks of 256 = 16 groups of 16, symmetric 6-bit codes (`make_qx_quants`
//! with `x²` weights), signed 8-bit group scales relative to one f16 `d`. Layout:
//! `ql: [u8; 128]` (low four bits), `qh: [u8; 64]` (high two bits), `scales: [i8; 16]`,
//! `d: f16` (210 bytes).

use super::k_search::{make_qx_quants, nearest_int, GROUP_MAX_EPS};
use super::{put_f16, round_f16};

pub const QK_K: usize = 256;
pub const BLOCK_BYTES: usize = 210;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let mut max_scale = 0f32;
        let mut max_abs_scale = 0f32;
        for ib in 0..16 {
            let s = make_qx_quants(
                32,
                &xb[16 * ib..16 * ib + 16],
                &mut l[16 * ib..16 * ib + 16],
                1,
            );
            scales[ib] = s;
            if s.abs() > max_abs_scale {
                max_abs_scale = s.abs();
                max_scale = s;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            ob.fill(0);
            continue;
        }
        let iscale = -128.0 / max_scale;
        let d = 1.0 / iscale;
        let mut sc = [0i8; 16];
        for ib in 0..16 {
            sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
        }
        let d16 = round_f16(d);
        for j in 0..16 {
            let dl = d16 * sc[j] as f32;
            if dl == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l[16 * j + ii] = (nearest_int(xb[16 * j + ii] / dl).clamp(-32, 31) + 32) as i8;
            }
        }
        let (ql, rest) = ob.split_at_mut(128);
        let (qh, rest) = rest.split_at_mut(64);
        for half in 0..2 {
            let lh = &l[half * 128..half * 128 + 128];
            let ql = &mut ql[half * 64..half * 64 + 64];
            let qh = &mut qh[half * 32..half * 32 + 32];
            for i in 0..32 {
                let q = [
                    lh[i] as u8,
                    lh[i + 32] as u8,
                    lh[i + 64] as u8,
                    lh[i + 96] as u8,
                ];
                ql[i] = (q[0] & 0x0f) | ((q[2] & 0x0f) << 4);
                ql[i + 32] = (q[1] & 0x0f) | ((q[3] & 0x0f) << 4);
                qh[i] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
            }
        }
        for (o, s) in rest[..16].iter_mut().zip(sc) {
            *o = s as u8;
        }
        put_f16(&mut rest[16..18], d);
    }
}
