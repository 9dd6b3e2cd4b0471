//! Q5_1: 32 weights per block, 5-bit unsigned with an f16 scale and minimum.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

pub fn dequantize(blocks: &[BlockQ5_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            y[j] = ((b.qs[j] as u32 & 0x0f) | h0) as f32 * d + m;
            y[j + QK / 2] = ((b.qs[j] as u32 >> 4) | h1) as f32 * d + m;
        }
    }
}
