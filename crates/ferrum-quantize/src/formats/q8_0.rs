//! Q8_0: blocks of 32, one f16 scale `d = amax / 127`, 32 signed bytes (`round(x / d)`,
//! halves away from zero like C's `roundf`). Layout: `d: f16, qs: [i8; 32]` (34 bytes).

use super::put_f16;

pub const QK: usize = 32;
pub const BLOCK_BYTES: usize = 34;

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut ob[0..2], d);
        for (o, &v) in ob[2..].iter_mut().zip(xb) {
            // f32::round rounds halves away from zero, as roundf does.
            *o = ((v * id).round() as i8) as u8;
        }
    }
}
