//! The K-quant super-block formats (Q2_K … Q6_K): 256 weights per super-block, split into
//! sub-blocks with their own 4-, 6- or 8-bit scales (and minimums for the "_1"-style types)
//! relative to f16 super-scales.

use half::f16;

pub const QK_K: usize = 256;
const K_SCALE_SIZE: usize = 12;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ2K {
    /// Low nibble: sub-block scale; high nibble: sub-block minimum.
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ3K {
    /// The high (third) bit of each weight.
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    /// Sixteen 6-bit scales packed in 12 bytes.
    pub scales: [u8; 12],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    /// Eight 6-bit scales and eight 6-bit minimums packed in 12 bytes.
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ6K {
    /// Low four bits.
    pub ql: [u8; QK_K / 2],
    /// High two bits.
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

pub fn dequantize_q2k(blocks: &[BlockQ2K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let mut i = 0;
        let mut is = 0;
        for half in 0..2 {
            let q = &b.qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let sc = b.scales[is];
                    is += 1;
                    let dl = d * (sc & 0x0f) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for &ql in &q[part * 16..part * 16 + 16] {
                        y[i] = dl * ((ql >> shift) & 3) as f32 - ml;
                        i += 1;
                    }
                }
            }
        }
    }
}

/// Unpacks Q3_K's sixteen 6-bit scales (stored biased by 32).
fn q3k_scales(packed: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let a0 = u32::from_le_bytes([packed[0], packed[1], packed[2], packed[3]]);
    let a1 = u32::from_le_bytes([packed[4], packed[5], packed[6], packed[7]]);
    let tmp = u32::from_le_bytes([packed[8], packed[9], packed[10], packed[11]]);
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut s = [0i8; 16];
    for (i, w) in aux.iter().enumerate() {
        for (j, byte) in w.to_le_bytes().iter().enumerate() {
            s[i * 4 + j] = *byte as i8 - 32;
        }
    }
    s
}

pub fn dequantize_q3k(blocks: &[BlockQ3K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d_all = b.d.to_f32();
        let scales = q3k_scales(&b.scales);
        let mut i = 0;
        let mut is = 0;
        let mut m: u8 = 1;
        for half in 0..2 {
            let q = &b.qs[half * 32..half * 32 + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    for l in part * 16..part * 16 + 16 {
                        let low = ((q[l] >> shift) & 3) as i32;
                        let high = if b.hmask[l] & m != 0 { 0 } else { 4 };
                        y[i] = dl * (low - high) as f32;
                        i += 1;
                    }
                }
                m = m.wrapping_shl(1);
            }
        }
    }
}

/// Scale and minimum `j` (0..8) of the packed 6-bit pairs used by Q4_K and Q5_K.
fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

pub fn dequantize_q4k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for chunk in 0..4 {
            let q = &b.qs[chunk * 32..chunk * 32 + 32];
            let (sc1, m1) = scale_min_k4(2 * chunk, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[chunk * 64..chunk * 64 + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q5k(blocks: &[BlockQ5K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for chunk in 0..4 {
            let ql = &b.qs[chunk * 32..chunk * 32 + 32];
            let u1 = 1u8 << (2 * chunk);
            let u2 = 2u8 << (2 * chunk);
            let (sc1, m1) = scale_min_k4(2 * chunk, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[chunk * 64..chunk * 64 + 64];
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q6k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for half in 0..2 {
            let ql = &b.ql[half * 64..half * 64 + 64];
            let qh = &b.qh[half * 32..half * 32 + 32];
            let sc = &b.scales[half * 8..half * 8 + 8];
            let y = &mut y[half * 128..half * 128 + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}
