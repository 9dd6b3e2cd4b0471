//! Q5_1: blocks of 32 with a minimum: `d = (max - min) / 31`, `m = min`, 5-bit values
//! `trunc((x - min) / d + 0.5)`. Layout: `d: f16, m: f16, qh: [u8; 4], qs: [u8; 16]` (24 bytes).

use super::{min_max, put_f16};

pub const QK: usize = 32;
pub const BLOCK_BYTES: usize = 24;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let (min, max) = min_max(xb);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[0..2], d);
        put_f16(&mut ob[2..4], min);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            // Rounding can only push (x - min) / d a hair past 31, never to 31.5.
            let q0 = (((xb[j] - min) * id + 0.5) as u8).min(31);
            let q1 = (((xb[j + QK / 2] - min) * id + 0.5) as u8).min(31);
            ob[8 + j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
            qh |= ((q0 as u32) >> 4) << j;
            qh |= ((q1 as u32) >> 4) << (j + QK / 2);
        }
        ob[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}
