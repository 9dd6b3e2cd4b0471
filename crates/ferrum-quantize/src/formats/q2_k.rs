//! Q2_K: super-blocks of 256 = 16 groups of 16. Each group gets a 2-bit code, a 4-bit scale
//! and a 4-bit minimum (`make_qkx2_quants`, absolute-error fit weighted by `|x|`), both
//! relative to f16 super-values `d` and `dmin`. Layout:
//! `scales: [u8; 16]` (low nibble scale, high nibble min), `qs: [u8; 64]`, `d: f16`,
//! `dmin: f16` (84 bytes).

use super::k_search::{make_qkx2_quants, nearest_int, Qkx2};
use super::{put_f16, round_f16};

pub const QK_K: usize = 256;
pub const BLOCK_BYTES: usize = 84;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    let search = Qkx2 {
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: true,
    };
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let mut max_scale = 0f32;
        let mut max_min = 0f32;
        for j in 0..16 {
            let g = &xb[16 * j..16 * j + 16];
            let mut weights = [0f32; 16];
            for (w, v) in weights.iter_mut().zip(g) {
                *w = v.abs();
            }
            let (s, m) = make_qkx2_quants(3, g, &weights, &mut l[16 * j..16 * j + 16], &search);
            scales[j] = s;
            mins[j] = m;
            max_scale = max_scale.max(s);
            max_min = max_min.max(m);
        }
        let mut sc = [0u8; 16];
        let d = if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..16 {
                sc[j] = nearest_int(iscale * scales[j]) as u8;
            }
            max_scale / Q4SCALE
        } else {
            0.0
        };
        let dmin = if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..16 {
                sc[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
            max_min / Q4SCALE
        } else {
            0.0
        };
        let (d16, dmin16) = (round_f16(d), round_f16(dmin));
        for j in 0..16 {
            let dl = d16 * (sc[j] & 0x0f) as f32;
            if dl == 0.0 {
                continue;
            }
            let dm = dmin16 * (sc[j] >> 4) as f32;
            for ii in 0..16 {
                l[16 * j + ii] = nearest_int((xb[16 * j + ii] + dm) / dl).clamp(0, 3) as u8;
            }
        }
        ob[0..16].copy_from_slice(&sc);
        for half in 0..2 {
            let lh = &l[half * 128..half * 128 + 128];
            for i in 0..32 {
                ob[16 + half * 32 + i] =
                    lh[i] | (lh[i + 32] << 2) | (lh[i + 64] << 4) | (lh[i + 96] << 6);
            }
        }
        put_f16(&mut ob[80..82], d);
        put_f16(&mut ob[82..84], dmin);
    }
}
