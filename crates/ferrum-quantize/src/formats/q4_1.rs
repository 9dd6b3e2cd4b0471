//! Q4_1: blocks of 32 with a minimum: `d = (max - min) / 15`, `m = min`, nibbles
//! `min(15, trunc((x - min) / d + 0.5))`. Layout: `d: f16, m: f16, qs: [u8; 16]` (20 bytes).

use super::{min_max, put_f16};

pub const QK: usize = 32;
pub const BLOCK_BYTES: usize = 20;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let (min, max) = min_max(xb);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[0..2], d);
        put_f16(&mut ob[2..4], min);
        for j in 0..QK / 2 {
            let q0 = (((xb[j] - min) * id + 0.5) as i8).clamp(0, 15) as u8;
            let q1 = (((xb[j + QK / 2] - min) * id + 0.5) as i8).clamp(0, 15) as u8;
            ob[4 + j] = q0 | (q1 << 4);
        }
    }
}
