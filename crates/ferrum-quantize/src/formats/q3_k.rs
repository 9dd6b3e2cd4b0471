//! Q3_K: super-blocks of 256 = 16 groups of 16, symmetric 3-bit codes (`make_q3_quants`),
//! 6-bit signed group scales relative to one f16 `d`. Layout: `hmask: [u8; 32]` (third bit
//! of each code), `qs: [u8; 64]` (low two bits), `scales: [u8; 12]` (sixteen 6-bit scales
//! biased by 32), `d: f16` (110 bytes).

use super::k_search::{make_q3_quants, nearest_int};
use super::{put_f16, round_f16};

pub const QK_K: usize = 256;
pub const BLOCK_BYTES: usize = 110;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let mut max_scale = 0f32;
        let mut amax = 0f32;
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &xb[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        let mut packed = [0u8; 12];
        // The biased 6-bit scale of each group, as the dequantiser will see it.
        let mut sc = [0i32; 16];
        let d = if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                let q = nearest_int(iscale * scales[j]).clamp(-32, 31) + 32;
                sc[j] = q - 32;
                let q = q as u8;
                if j < 8 {
                    packed[j] = q & 0x0f;
                } else {
                    packed[j - 8] |= (q & 0x0f) << 4;
                }
                packed[j % 4 + 8] |= (q >> 4) << (2 * (j / 4));
            }
            1.0 / iscale
        } else {
            0.0
        };
        let d16 = round_f16(d);
        for j in 0..16 {
            let dl = d16 * sc[j] as f32;
            if dl == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l[16 * j + ii] = (nearest_int(xb[16 * j + ii] / dl).clamp(-4, 3) + 4) as i8;
            }
        }
        let mut hmask = [0u8; 32];
        let mut low = [0u8; QK_K];
        for (j, &q) in l.iter().enumerate() {
            let mut q = q as u8;
            if q > 3 {
                hmask[j % 32] |= 1 << (j / 32);
                q -= 4;
            }
            low[j] = q;
        }
        ob[0..32].copy_from_slice(&hmask);
        for half in 0..2 {
            let lh = &low[half * 128..half * 128 + 128];
            for i in 0..32 {
                ob[32 + half * 32 + i] =
                    lh[i] | (lh[i + 32] << 2) | (lh[i + 64] << 4) | (lh[i + 96] << 6);
            }
        }
        ob[96..108].copy_from_slice(&packed);
        put_f16(&mut ob[108..110], d);
    }
}
