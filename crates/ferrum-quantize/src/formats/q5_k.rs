//! Q5_K: Q4_K's scheme with 5-bit codes (`nmax` 31, a narrower scale search). Layout:
//! `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32]` (fifth bits), `qs: [u8; 128]`
//! (176 bytes).

use super::k_search::Qkx2;
use super::put_f16;
use super::q4_k::scales_and_codes;

pub const QK_K: usize = 256;
pub const BLOCK_BYTES: usize = 176;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    let search = Qkx2 {
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: false,
    };
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let (packed, d, dmin, l) = scales_and_codes(xb, 31, &search);
        put_f16(&mut ob[0..2], d);
        put_f16(&mut ob[2..4], dmin);
        ob[4..16].copy_from_slice(&packed);
        let mut qh = [0u8; 32];
        for chunk in 0..4 {
            let (m1, m2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
            for i in 0..32 {
                let mut l1 = l[chunk * 64 + i];
                let mut l2 = l[chunk * 64 + 32 + i];
                if l1 > 15 {
                    l1 -= 16;
                    qh[i] |= m1;
                }
                if l2 > 15 {
                    l2 -= 16;
                    qh[i] |= m2;
                }
                ob[48 + chunk * 32 + i] = l1 | (l2 << 4);
            }
        }
        ob[16..48].copy_from_slice(&qh);
    }
}
