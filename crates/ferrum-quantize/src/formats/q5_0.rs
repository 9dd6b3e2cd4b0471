//! Q5_0: blocks of 32, `d = max / -16`, 5-bit values `min(31, trunc(x / d + 16.5))`: low
//! nibbles as in Q4_0, the fifth bits gathered in a little-endian u32 (bit `j` for element
//! `j`). Layout: `d: f16, qh: [u8; 4], qs: [u8; 16]` (22 bytes).

use super::{put_f16, signed_absmax};

pub const QK: usize = 32;
pub const BLOCK_BYTES: usize = 22;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let (_, max) = signed_absmax(xb);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[0..2], d);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let q0 = ((xb[j] * id + 16.5) as i8).clamp(0, 31) as u8;
            let q1 = ((xb[j + QK / 2] * id + 16.5) as i8).clamp(0, 31) as u8;
            ob[6 + j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
            qh |= ((q0 as u32) >> 4) << j;
            qh |= ((q1 as u32) >> 4) << (j + QK / 2);
        }
        ob[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}
