//! Random, well-formed quantised blocks for kernel tests and benches (the bench includes this
//! file with `#[path]`).

use ferrum_core::DType;
use rand::Rng;

/// Every format with an integer kernel.
pub const FORMATS: &[DType] = &[
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Mxfp4,
    DType::Iq4Nl,
    DType::Iq4Xs,
    DType::Iq2Xxs,
    DType::Iq2Xs,
    DType::Iq2S,
    DType::Iq3Xxs,
    DType::Iq3S,
    DType::Iq1S,
    DType::Iq1M,
    DType::Tq1_0,
    DType::Tq2_0,
];

/// The i-quants and TQ formats: the last eleven of [`FORMATS`].
#[allow(dead_code)] // dequant_reference's
pub const IQUANTS: &[DType] = FORMATS.split_at(FORMATS.len() - 11).1;

/// Byte offsets of each format's f16 scale fields inside a block: random bits there could
/// be NaN or infinity, so they get small finite scales instead.
pub fn f16_fields(dt: DType) -> &'static [usize] {
    match dt {
        DType::Q4_0
        | DType::Q5_0
        | DType::Q8_0
        | DType::Iq4Nl
        | DType::Iq4Xs
        | DType::Iq2Xxs
        | DType::Iq2Xs
        | DType::Iq2S
        | DType::Iq3Xxs
        | DType::Iq3S
        | DType::Iq1S => &[0],
        DType::Tq1_0 => &[52],
        DType::Tq2_0 => &[64],
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        _ => &[],
    }
}

/// `n` values of `dt` as random blocks with sane scales.
pub fn random_blocks(rng: &mut impl Rng, dt: DType, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; dt.bytes_for(n).expect("whole blocks")];
    rng.fill(&mut b[..]);
    for blk in b.chunks_mut(dt.block_bytes()) {
        for &off in f16_fields(dt) {
            let s = half::f16::from_f32(rng.gen_range(0.001..0.05));
            blk[off..off + 2].copy_from_slice(&s.to_le_bytes());
        }
        if dt == DType::Iq1M {
            // The f16 scale lies in the top nibbles of the four u16 scale words at byte 48.
            let bits = half::f16::from_f32(rng.gen_range(0.001..0.05)).to_bits();
            for k in 0..4 {
                blk[49 + 2 * k] = (blk[49 + 2 * k] & 0x0f) | (((bits >> (4 * k)) & 0xf) << 4) as u8;
            }
        }
        if dt == DType::Mxfp4 {
            // The E8M0 exponent: scales 2^-9 .. 2^-2 (weights up to about ±1.5).
            blk[0] = rng.gen_range(118..=125);
        }
    }
    b
}

/// A copy of some bytes at an 8-byte aligned address: the kernels read blocks in place, as
/// they do from the 32-byte aligned GGUF mapping.
pub struct Aligned {
    buf: Vec<u64>,
    len: usize,
}

impl Aligned {
    pub fn new(bytes: &[u8]) -> Aligned {
        let mut buf = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `buf` holds at least `bytes.len()` bytes; u8 has no alignment needs.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, bytes.len()) };
        dst.copy_from_slice(bytes);
        Aligned {
            buf,
            len: bytes.len(),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the first `len` bytes of `buf` were initialised in `new`.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr() as *const u8, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr() as *mut u8, self.len) }
    }
}
