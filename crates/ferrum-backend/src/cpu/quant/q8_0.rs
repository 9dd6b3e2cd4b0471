//! Q8_0: 32 weights per block, signed 8-bit with one f16 scale.

use half::f16;

pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

pub fn dequantize(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (yj, &q) in y.iter_mut().zip(b.qs.iter()) {
            *yj = q as f32 * d;
        }
    }
}
