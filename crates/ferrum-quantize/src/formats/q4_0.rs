//! Q4_0: blocks of 32, `d = max / -8` where `max` is the signed value of largest magnitude,
//! nibbles `min(15, trunc(x / d + 8.5))`. Layout: `d: f16, qs: [u8; 16]` (18 bytes); element
//! `j` is the low nibble of `qs[j]`, element `j + 16` the high nibble.

use super::{put_f16, signed_absmax};

pub const QK: usize = 32;
pub const BLOCK_BYTES: usize = 18;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let (_, max) = signed_absmax(xb);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[0..2], d);
        for j in 0..QK / 2 {
            let q0 = ((xb[j] * id + 8.5) as i8).clamp(0, 15) as u8;
            let q1 = ((xb[j + QK / 2] * id + 8.5) as i8).clamp(0, 15) as u8;
            ob[2 + j] = q0 | (q1 << 4);
        }
    }
}
