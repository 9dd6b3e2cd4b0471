//! Q4_1: 32 weights per block, 4-bit unsigned with an f16 scale and an f16 minimum.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

pub fn dequantize(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        for j in 0..QK / 2 {
            y[j] = (b.qs[j] & 0x0f) as f32 * d + m;
            y[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}
