//! MXFP4: blocks of 32, an E8M0 exponent `e = floor(log2(max |x|)) − 2 + 127` (so the largest
//! value lands near the top code, 6) and each value the nearest of the sixteen E2M1 codes
//! times 2^(e − 127) (the first of equally near ones), as llama.cpp's reference quantiser.
//! Layout: `e: u8, qs: [u8; 16]` (17 bytes); element `j` is the low nibble of `qs[j]`,
//! element `j + 16` the high nibble.

pub const QK: usize = 32;
pub const BLOCK_BYTES: usize = 17;

use ferrum_backend::cpu::quant::mxfp4::{half_scale, VALUES};

fn nearest(x: f32, d: f32) -> u8 {
    let mut best = 0;
    let mut err = (VALUES[0] as f32 * d - x).abs();
    for (i, &v) in VALUES.iter().enumerate().skip(1) {
        let e = (v as f32 * d - x).abs();
        if e < err {
            best = i;
            err = e;
        }
    }
    best as u8
}

pub fn quantize(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = xb
            .iter()
            .fold(0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        let e = if amax > 0.0 {
            // In f32 until clamped: an infinite maximum must not overflow an integer.
            (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
        } else {
            0
        };
        let d = half_scale(e);
        ob[0] = e;
        for j in 0..QK / 2 {
            ob[1 + j] = nearest(xb[j], d) | (nearest(xb[j + QK / 2], d) << 4);
        }
    }
}
