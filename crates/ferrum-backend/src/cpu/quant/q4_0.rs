//! Q4_0: 32 weights per block, 4-bit unsigned with an implicit offset of 8, one f16 scale.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_0 {
    pub d: f16,
    /// Low nibbles hold weights 0..16, high nibbles weights 16..32.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

pub fn dequantize(blocks: &[BlockQ4_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for j in 0..QK / 2 {
            y[j] = ((b.qs[j] & 0x0f) as i32 - 8) as f32 * d;
            y[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}
