//! The codebook i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) and the
//! ternary formats (TQ1_0, TQ2_0), all 256 values a super-block in GGML's layouts
//! (`ggml-common.h`).
//!
//! A codebook format stores, per group of eight (or four) values, an index into a fixed grid
//! of magnitudes ([`super::iq_grids`]), plus sign bits (seven stored, the eighth making the
//! count of minus signs even: [`KSIGNS`]) and 4-bit (IQ1: 3-bit) sub-block scales. Every value
//! is an integer times the super-block's f16 scale times a power of two, so a super-block's
//! dot product with a Q8_K activation block is an exact integer sum times one float scale:
//! each format says, for each 32-value group, its eight-byte words of magnitudes, the words
//! of their signs (bytes 1 or −1, looked up per stored sign byte, as llama.cpp's
//! `keven_signs_q2xs`) and the integer scales of its two 16-value halves
//! ([`Codebook::group`]); one scalar kernel ([`vec_dot`]) serves all nine formats. The AVX2
//! row kernels make a super-block's side data in vector instead: [`avx2::SignBytes`] for the
//! five whose signs come a byte per eight values, [`avx2::OffsetBytes`] for IQ1_S, IQ1_M and
//! the TQs, whose values are unsigned bytes less an offset per 16 values. All sum the same
//! integers, then make one multiply per super-block, so every kernel gives the scalar one's
//! bits. IQ2_XXS and IQ3_XXS also have forms the CPU re-encodes them into at load
//! ([`BlockIq2XxsRecoded`], [`BlockIq3XxsRecoded`]: each group's sign word as [`recode_word`]
//! makes it, which unpacks in a few vector operations), with the same values.
//!
//! The dequantisers follow llama.cpp's float steps one by one (`dequantize_row_*`), so they
//! give its bits (`tests/dequant_reference.rs` holds them to llama.cpp's own library).

use half::f16;

use super::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use ferrum_core::DType;

use super::k_quants::{q3k_scales, QK_K};
pub use super::k_quants::{BlockQ2K, BlockQ3K};
use super::q8::BlockQ8K;

/// Seven stored sign bits to eight: bit 7 set when the seven hold an odd number of ones.
pub const KSIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8 | (((i as u8).count_ones() as u8 & 1) << 7);
        i += 1;
    }
    t
};

/// Eight sign bits as eight bytes, 1 where the bit is clear and −1 (0xff) where it is set:
/// what `sign` multiplies an activation by.
pub const SIGN_BYTES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        let mut w = 0u64;
        let mut j = 0;
        while j < 8 {
            let b: u64 = if (i >> j) & 1 != 0 { 0xff } else { 0x01 };
            w |= b << (8 * j);
            j += 1;
        }
        t[i] = w;
        i += 1;
    }
    t
};

/// [`SIGN_BYTES`] of the eight signs seven stored bits stand for ([`KSIGNS`]).
pub const KSIGN_BYTES: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = SIGN_BYTES[KSIGNS[i] as usize];
        i += 1;
    }
    t
};

/// IQ1_S's and IQ1_M's offset, ±1/8 of a step, per group.
const IQ1_DELTA: f32 = 0.125;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq2Xxs {
    pub d: f16,
    pub qs: [u16; QK_K / 8],
}
const _: () = assert!(std::mem::size_of::<BlockIq2Xxs>() == 66);

/// A group's word of four seven-bit sign fields and a 4-bit scale (IQ2_XXS's, IQ3_XXS's) as
/// the re-encoded forms store it ([`super::Recoded`]), four bytes that vector code unpacks in
/// a few operations: byte k holds in bits 0..7 the seven-bit `t` whose `t ^ (t << 1)` is the
/// sign byte of values `8k..8k + 8` (a byte with an even count of ones, as every such sign
/// byte is, is that of exactly one such `t`), and in bit 7 bit k of the scale. The file's
/// words take some seventeen vector operations a super-block to lift the fields into bytes
/// and give each its parity bit; these take three, and five for the scales.
pub fn recode_word(aux: u32) -> [u8; 4] {
    std::array::from_fn(|l| {
        let s = KSIGNS[((aux >> (7 * l)) & 127) as usize];
        // The inverse of `t ^ (t << 1)`: bit i of t is the parity of bits 0..=i of s, so
        // bit 7 is s's own parity, which is even.
        let t = (0..8).fold(0u8, |t, i| t ^ (s << i));
        debug_assert!(t < 128);
        t | ((((aux >> (28 + l)) & 1) as u8) << 7)
    })
}

/// A re-encoded word's four sign bytes (byte k's bit j: value `8k + j` negative) and its
/// 4-bit scale ([`recode_word`]), a word at a time: the scalar paths (dequantisation, the
/// portable kernel, the prefill tile's twin) decode every group through here.
#[inline]
pub fn recoded_word(b: [u8; 4]) -> ([u8; 4], u32) {
    let w = u32::from_le_bytes(b);
    // Each byte's bit 7 is clear in `t`, so the shift carries nothing into the next byte.
    let t = w & 0x7f7f_7f7f;
    let signs = t ^ (t << 1);
    let scale = (w >> 7 & 1) | (w >> 14 & 2) | (w >> 21 & 4) | (w >> 28 & 8);
    (signs.to_le_bytes(), scale)
}

/// IQ2_XXS as the CPU re-encodes it at load ([`super::Recoded::Iq2Xxs`]): the same 66 bytes
/// a super-block, the grid indices first and then each group's word as [`recode_word`]
/// makes it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq2XxsRecoded {
    pub d: f16,
    /// Group g's four grid indices at `4g..4g + 4`.
    pub idx: [u8; QK_K / 8],
    pub signs: [u8; QK_K / 8],
}
const _: () = assert!(std::mem::size_of::<BlockIq2XxsRecoded>() == 66);

impl BlockIq2XxsRecoded {
    /// The block in this form: the same values.
    pub fn from_file(b: &BlockIq2Xxs) -> Self {
        let mut r = BlockIq2XxsRecoded {
            d: b.d,
            idx: [0; QK_K / 8],
            signs: [0; QK_K / 8],
        };
        for ib in 0..QK_K / 32 {
            let q = &b.qs[4 * ib..4 * ib + 4];
            let idx = (q[0] as u32 | (q[1] as u32) << 16).to_le_bytes();
            let aux = q[2] as u32 | (q[3] as u32) << 16;
            r.idx[4 * ib..4 * ib + 4].copy_from_slice(&idx);
            r.signs[4 * ib..4 * ib + 4].copy_from_slice(&recode_word(aux));
        }
        r
    }
}

/// IQ3_XXS as the CPU re-encodes it at load ([`super::Recoded::Iq3Xxs`]): the file's 98
/// bytes a super-block with each group's word (the last 32 bytes) as [`recode_word`] makes
/// it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq3XxsRecoded {
    pub d: f16,
    /// Grid indices, eight a group.
    pub qs: [u8; QK_K / 4],
    pub signs: [u8; QK_K / 8],
}
const _: () = assert!(std::mem::size_of::<BlockIq3XxsRecoded>() == 98);

impl BlockIq3XxsRecoded {
    /// The block in this form: the same values.
    pub fn from_file(b: &BlockIq3Xxs) -> Self {
        let mut r = BlockIq3XxsRecoded {
            d: b.d,
            qs: [0; QK_K / 4],
            signs: [0; QK_K / 8],
        };
        r.qs.copy_from_slice(&b.qs[..QK_K / 4]);
        for ib in 0..QK_K / 32 {
            r.signs[4 * ib..4 * ib + 4].copy_from_slice(&recode_word(b.aux(ib)));
        }
        r
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq2Xs {
    pub d: f16,
    pub qs: [u16; QK_K / 8],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIq2Xs>() == 74);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq2S {
    pub d: f16,
    /// Grid indices' low bytes (32), then the sign bytes (32).
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIq2S>() == 82);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq3Xxs {
    pub d: f16,
    /// Grid indices (64 bytes), then per 32 values a u32 of four seven-bit sign indices and
    /// the 4-bit scale.
    pub qs: [u8; 3 * QK_K / 8],
}
const _: () = assert!(std::mem::size_of::<BlockIq3Xxs>() == 98);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq3S {
    pub d: f16,
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub signs: [u8; QK_K / 8],
    pub scales: [u8; QK_K / 64],
}
const _: () = assert!(std::mem::size_of::<BlockIq3S>() == 110);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq1S {
    pub d: f16,
    pub qs: [u8; QK_K / 8],
    /// Per 32 values: three high index bits per group, the 3-bit scale (bits 12..15) and the
    /// offset's sign (bit 15).
    pub qh: [u16; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIq1S>() == 50);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockIq1M {
    pub qs: [u8; QK_K / 8],
    pub qh: [u8; QK_K / 16],
    /// Four u16: 3-bit scales, and the super-block's f16 scale in their top nibbles.
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIq1M>() == 56);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockTq1_0 {
    /// Five base-3 digits a byte (first 32 bytes: 160 values, next 16: 80 values).
    pub qs: [u8; 48],
    /// Four base-3 digits a byte: the last 16 values.
    pub qh: [u8; 4],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockTq1_0>() == 54);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockTq2_0 {
    pub qs: [u8; QK_K / 4],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockTq2_0>() == 66);

impl BlockIq1M {
    fn sc(&self, i: usize) -> u16 {
        u16::from_le_bytes([self.scales[2 * i], self.scales[2 * i + 1]])
    }

    /// The super-block scale's f16 bits, spread over the four words' top nibbles.
    fn d_bits(&self) -> u16 {
        (self.sc(0) >> 12)
            | ((self.sc(1) >> 8) & 0x00f0)
            | ((self.sc(2) >> 4) & 0x0f00)
            | (self.sc(3) & 0xf000)
    }
}

/// One 32-value group of a codebook super-block, as the integer kernels read it.
pub struct Group {
    /// The magnitudes of values `8k..8k+8` as the bytes of word `k` (at most 127).
    pub words: [u64; 4],
    /// Their signs, as the bytes of word `k`: 1, or 0xff for −1 ([`SIGN_BYTES`]).
    pub signs: [u64; 4],
    /// Integer scales of values 0..16 and 16..32.
    pub scales: [i32; 2],
}

/// The largest |value| of a [`Codebook::SMALL`] format: a half's four-value `maddubs` pair
/// sums against tokens plus 128 (at most 2 · 255 · 16 each) then add up, four to a lane, to at
/// most 32640, inside i16.
pub const SMALL_MAX: i32 = 16;

/// A super-block format whose values are `d · FACTOR · scale · v` for integers `v` (|v| ≤
/// 127) and integer scales (|scale · Σ v·a| over a super-block within i32).
pub trait Codebook: Copy {
    /// The power of two the integer scales are off by (IQ2: 1/8, IQ3_XXS: 1/4).
    const FACTOR: f32;
    /// The super-block's f16 scale, its bits.
    fn d_bits(&self) -> u16;
    /// The super-block's f16 scale as f32.
    fn d(&self) -> f32 {
        f16::from_bits(self.d_bits()).to_f32()
    }
    /// Group `ib` (0..8).
    fn group(&self, ib: usize) -> Group;
    /// Whether every value is within ±[`SMALL_MAX`] (IQ1, the TQs, Q2_K, Q3_K): then the
    /// AVX2 prefill tile sums a half's four `maddubs` in i16 before its one scale `madd`
    /// ([`super::iq_tile::avx2::dot`]).
    const SMALL: bool = false;
    /// Whether each 16-value half also has a minimum (Q2_K): then value `v` of half `h` is
    /// `d · FACTOR · scale_h · v − dmin · min_h`, and a super-block's dot product with a Q8_K
    /// block takes off `d_a · dmin · Σ_h min_h · bsum_h` ([`Codebook::mins`]).
    const MINS: bool = false;
    /// The minimums' f16 scale (its bits) and the sixteen halves' integer minimums; zero
    /// where the format has none.
    fn mins(&self) -> (u16, [i16; QK_K / 16]) {
        (0, [0; QK_K / 16])
    }
}

impl Codebook for BlockIq2Xxs {
    const FACTOR: f32 = 0.125;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        iq2_xxs_group(self, ib)
    }
}

impl Codebook for BlockIq2Xs {
    const FACTOR: f32 = 0.125;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        let q = &self.qs[4 * ib..4 * ib + 4];
        let sc = self.scales[ib];
        Group {
            words: std::array::from_fn(|l| IQ2XS_GRID[(q[l] & 511) as usize]),
            signs: std::array::from_fn(|l| KSIGN_BYTES[(q[l] >> 9) as usize]),
            scales: [2 * (sc & 0x0f) as i32 + 1, 2 * (sc >> 4) as i32 + 1],
        }
    }
}

impl Codebook for BlockIq2S {
    const FACTOR: f32 = 0.125;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        let qh = self.qh[ib] as usize;
        let sc = self.scales[ib];
        Group {
            words: std::array::from_fn(|l| {
                IQ2S_GRID[self.qs[4 * ib + l] as usize | ((qh << (8 - 2 * l)) & 0x300)]
            }),
            signs: std::array::from_fn(|l| SIGN_BYTES[self.qs[QK_K / 8 + 4 * ib + l] as usize]),
            scales: [2 * (sc & 0x0f) as i32 + 1, 2 * (sc >> 4) as i32 + 1],
        }
    }
}

impl BlockIq3Xxs {
    fn aux(&self, ib: usize) -> u32 {
        let at = QK_K / 4 + 4 * ib;
        u32::from_le_bytes([
            self.qs[at],
            self.qs[at + 1],
            self.qs[at + 2],
            self.qs[at + 3],
        ])
    }
}

impl Codebook for BlockIq3Xxs {
    const FACTOR: f32 = 0.25;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        iq3_xxs_group(self, ib)
    }
}

impl Codebook for BlockIq3XxsRecoded {
    const FACTOR: f32 = 0.25;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        iq3_xxs_group(self, ib)
    }
}

impl Codebook for BlockIq3S {
    const FACTOR: f32 = 1.0;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        let q = &self.qs[8 * ib..8 * ib + 8];
        let qh = self.qh[ib] as usize;
        let s = 2 * ((self.scales[ib / 2] >> (4 * (ib % 2))) & 0x0f) as i32 + 1;
        Group {
            words: std::array::from_fn(|l| {
                let i1 = q[2 * l] as usize | ((qh << (8 - 2 * l)) & 256);
                let i2 = q[2 * l + 1] as usize | ((qh << (7 - 2 * l)) & 256);
                IQ3S_GRID[i1] as u64 | (IQ3S_GRID[i2] as u64) << 32
            }),
            signs: std::array::from_fn(|l| SIGN_BYTES[self.signs[4 * ib + l] as usize]),
            scales: [s, s],
        }
    }
}

/// Eight signed values (i8 bytes of a word) as a magnitude word and a sign word.
/// A word at a time (no byte carries into the next: a negated byte is at most 0x80); the
/// values are above −128.
#[inline]
fn split_signed(v: u64) -> (u64, u64) {
    let neg = (v >> 7) & LSB;
    // 0xff in each negative byte, whose magnitude is its complement plus one.
    let mask = neg * 0xff;
    ((v ^ mask) + neg, LSB | (neg * 0xfe))
}

/// The low bit of each byte.
const LSB: u64 = 0x0101_0101_0101_0101;
/// The top bit of each byte.
const MSB: u64 = 0x80 * LSB;

/// Eight grid values (−1, 0, 1 as i8 bytes) times 8, plus `delta` (±1), as i8 bytes: a word
/// at a time, as `8·[g ≠ 0] + 16·[g ≥ 0] + delta + 8` (each byte at most 33, so no carries),
/// less 24 in each byte with its top bit set first, so that no byte borrows from the next.
#[inline]
fn iq1_word(grid: u64, delta: i8) -> u64 {
    let (nonzero, neg) = (grid & LSB, (grid >> 7) & LSB);
    let w = 8 * nonzero + 16 * (LSB ^ neg) + (delta + 8) as u64 * LSB;
    ((w | MSB) - 24 * LSB) ^ MSB
}

/// A group of four words of signed values.
fn signed_group(values: [u64; 4], scales: [i32; 2]) -> Group {
    let split = values.map(split_signed);
    Group {
        words: split.map(|(m, _)| m),
        signs: split.map(|(_, s)| s),
        scales,
    }
}

impl Codebook for BlockIq1S {
    /// Values are `8·g ± 1` eighths.
    const FACTOR: f32 = 0.125;
    const SMALL: bool = true;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        let qh = self.qh[ib];
        let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
        let s = 2 * ((qh >> 12) & 7) as i32 + 1;
        let words = std::array::from_fn(|l| {
            let i = self.qs[4 * ib + l] as usize | (((qh >> (3 * l)) & 7) as usize) << 8;
            iq1_word(IQ1S_GRID[i], delta)
        });
        signed_group(words, [s, s])
    }
}

impl BlockIq1M {
    /// Group `ib`'s four grid indices and offset signs: index l takes bits `4l..4l + 3` of
    /// the group's two qh bytes as its bits 8..11, and bit `4l + 3` is its offset's sign.
    #[inline]
    fn indices(&self, ib: usize) -> ([usize; 4], [i8; 4]) {
        let qh = u16::from_le_bytes([self.qh[2 * ib], self.qh[2 * ib + 1]]) as usize;
        let idx = std::array::from_fn(|l| self.qs[4 * ib + l] as usize | (qh >> (4 * l) & 7) << 8);
        let delta = std::array::from_fn(|l| 1 - 2 * ((qh >> (4 * l + 3)) & 1) as i8);
        (idx, delta)
    }

    /// Group `ib`'s two 3-bit scales.
    #[inline]
    fn scales3(&self, ib: usize) -> [u16; 2] {
        let sc = self.sc(ib / 2);
        let shift = 6 * (ib % 2);
        [(sc >> shift) & 7, (sc >> (shift + 3)) & 7]
    }
}

impl Codebook for BlockIq1M {
    const FACTOR: f32 = 0.125;
    const SMALL: bool = true;
    fn d_bits(&self) -> u16 {
        BlockIq1M::d_bits(self)
    }
    #[inline]
    fn group(&self, ib: usize) -> Group {
        let (idx, delta) = self.indices(ib);
        let [s1, s2] = self.scales3(ib);
        let words = std::array::from_fn(|l| iq1_word(IQ1S_GRID[idx[l]], delta[l]));
        signed_group(words, [2 * s1 as i32 + 1, 2 * s2 as i32 + 1])
    }
}

/// Base-3 digit `n` of a TQ1_0 byte, as GGML reads it: the byte times 3^n (mod 256), times 3,
/// over 256.
#[inline]
fn trit(q: u8, n: usize) -> i8 {
    const POW3: [u8; 6] = [1, 3, 9, 27, 81, 243];
    let q = q.wrapping_mul(POW3[n]);
    ((q as u16 * 3) >> 8) as i8
}

impl BlockTq1_0 {
    /// Value `e` (0..256), −1, 0 or 1.
    fn value(&self, e: usize) -> i8 {
        let t = if e < 160 {
            trit(self.qs[e % 32], e / 32)
        } else if e < 240 {
            trit(self.qs[32 + (e - 160) % 16], (e - 160) / 16)
        } else {
            trit(self.qh[(e - 240) % 4], (e - 240) / 4)
        };
        t - 1
    }
}

impl BlockTq2_0 {
    /// Value `e` (0..256), −1, 0, 1 or 2.
    fn value(&self, e: usize) -> i8 {
        let (j, l, m) = (e / 128, e % 128 / 32, e % 32);
        ((self.qs[32 * j + m] >> (2 * l)) & 3) as i8 - 1
    }
}

/// Each byte of `x` (values 0 to 3) less one, as i8 bytes: the top bit set first, so that
/// no byte borrows from the next.
#[inline]
fn less_one(x: u64) -> u64 {
    ((x | MSB) - LSB) ^ MSB
}

/// The even bytes of a word.
const EVEN: u64 = 0x00ff_00ff_00ff_00ff;

/// Each byte times `c`, modulo 256: even and odd bytes apart, each in a 16-bit field.
#[inline]
fn times_bytes(x: u64, c: u64) -> u64 {
    ((x & EVEN).wrapping_mul(c) & EVEN) | ((x & !EVEN).wrapping_mul(c) & !EVEN)
}

/// Each byte's top base-3 digit as GGML reads it (`trit` of digit 0), a word at a time.
#[inline]
fn top_trits(y: u64) -> u64 {
    ((((y & EVEN) * 3) >> 8) & EVEN) | ((((y >> 8) & EVEN) * 3) & !EVEN)
}

impl BlockTq1_0 {
    /// Word `k` of group `ib`: the digits of `value`, eight at a time (the bytes' digits
    /// made by multiplying by powers of three, as GGML's `trit` does).
    fn word(&self, ib: usize, k: usize) -> u64 {
        const POW3: [u64; 5] = [1, 3, 9, 27, 81];
        let bytes =
            |at: usize| u64::from_le_bytes(self.qs[at..at + 8].try_into().unwrap_or([0; 8]));
        let y = match (ib, k) {
            (0..5, _) => times_bytes(bytes(8 * k), POW3[ib]),
            (5 | 6, _) => times_bytes(bytes(32 + 8 * (k % 2)), POW3[2 * (ib - 5) + k / 2]),
            (_, 0 | 1) => times_bytes(bytes(32 + 8 * k), POW3[4]),
            _ => {
                // qh's four bytes, digit 2(k − 2) in the low four and the next in the high.
                let h = u32::from_le_bytes(self.qh) as u64 * 0x1_0000_0001;
                let n = 2 * (k - 2);
                (times_bytes(h, POW3[n]) & 0xffff_ffff)
                    | (times_bytes(h, POW3[n + 1]) & !0xffff_ffff)
            }
        };
        less_one(top_trits(y))
    }
}

impl Codebook for BlockTq1_0 {
    const FACTOR: f32 = 1.0;
    const SMALL: bool = true;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        signed_group(std::array::from_fn(|k| self.word(ib, k)), [1, 1])
    }
}

impl Codebook for BlockTq2_0 {
    const FACTOR: f32 = 1.0;
    const SMALL: bool = true;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    /// Group `ib`: bits `2 · (ib % 4)..` of bytes `32 · (ib / 4)..`.
    fn group(&self, ib: usize) -> Group {
        let words = std::array::from_fn(|k| {
            let at = 32 * (ib / 4) + 8 * k;
            let x = u64::from_le_bytes(self.qs[at..at + 8].try_into().unwrap_or([0; 8]));
            less_one((x >> (2 * (ib % 4))) & (3 * LSB))
        });
        signed_group(words, [1, 1])
    }
}

/// Q3_K as a codebook format: each value is `low + 4·hbit − 4` (two bits of `qs`, one of
/// `hmask`), each sixteen-value half its own signed 6-bit scale. It is not an i-quant, but
/// its values are small integers under per-half scales, which is all the prefill tiles
/// ([`super::iq_tile`]) need: they decode it to bytes once per pass, as the codebooks. The
/// row kernels stay `k_quants`' own; this gives their bits (the same integer sums, and
/// `d · d_a · isum` per block).
impl Codebook for BlockQ3K {
    const FACTOR: f32 = 1.0;
    const SMALL: bool = true;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    /// Group `ib`: bits `2 · (ib % 4)..` of bytes `32 · (ib / 4)..` of `qs`, and bit
    /// `4 · (ib / 4) + ib % 4` of each `hmask` byte.
    fn group(&self, ib: usize) -> Group {
        let (half, shift) = (ib / 4, ib % 4);
        let word =
            |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
        let values = std::array::from_fn(|k| {
            let low = (word(&self.qs, 32 * half + 8 * k) >> (2 * shift)) & (3 * LSB);
            let high = (word(&self.hmask, 8 * k) >> (4 * half + shift)) & LSB;
            // Each byte at most 7: less 4 without a borrow between bytes, as `less_one`.
            ((low + 4 * high) | MSB).wrapping_sub(4 * LSB) ^ MSB
        });
        let sc = q3k_scales(&self.scales);
        signed_group(values, [sc[2 * ib] as i32, sc[2 * ib + 1] as i32])
    }
}

/// Q2_K as a codebook format, as Q3_K: each value is two bits of `qs`, each sixteen-value
/// half its own 4-bit scale, and, unlike the others, its own 4-bit minimum under the
/// super-block's `dmin` ([`Codebook::MINS`]). The row kernels stay `k_quants`' own; this
/// gives their bits (`d_a · d · isum − d_a · dmin · Σ min · bsum` per block).
impl Codebook for BlockQ2K {
    const FACTOR: f32 = 1.0;
    const SMALL: bool = true;
    const MINS: bool = true;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    /// Group `ib`: bits `2 · (ib % 4)..` of bytes `32 · (ib / 4)..` of `qs`.
    fn group(&self, ib: usize) -> Group {
        let (half, shift) = (ib / 4, ib % 4);
        let values = std::array::from_fn(|k| {
            let at = 32 * half + 8 * k;
            let x = u64::from_le_bytes(self.qs[at..at + 8].try_into().unwrap_or([0; 8]));
            (x >> (2 * shift)) & (3 * LSB)
        });
        let sc = |h: usize| (self.scales[h] & 0x0f) as i32;
        signed_group(values, [sc(2 * ib), sc(2 * ib + 1)])
    }
    fn mins(&self) -> (u16, [i16; QK_K / 16]) {
        let m = std::array::from_fn(|h| (self.scales[h] >> 4) as i16);
        (self.dmin.to_bits(), m)
    }
}

impl Codebook for BlockIq2XxsRecoded {
    const FACTOR: f32 = 0.125;
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn group(&self, ib: usize) -> Group {
        iq2_xxs_group(self, ib)
    }
}

/// IQ2_XXS's and IQ3_XXS's 32-value groups in the file's form or the re-encoded one, the one
/// place the two differ: the group's grid indices (`I`: four for IQ2_XXS, eight for
/// IQ3_XXS), its four sign bytes and its 4-bit scale. Both forms' groups and dequantisation
/// are made from these.
trait XxsGroups<I>: Codebook {
    fn parts(&self, ib: usize) -> (I, [u8; 4], u32);
}

/// The sign bytes of a file word's four seven-bit fields ([`KSIGNS`]).
fn ksigns4(aux: u32) -> [u8; 4] {
    std::array::from_fn(|l| KSIGNS[((aux >> (7 * l)) & 127) as usize])
}

impl XxsGroups<[u8; 4]> for BlockIq2Xxs {
    #[inline]
    fn parts(&self, ib: usize) -> ([u8; 4], [u8; 4], u32) {
        let q = &self.qs[4 * ib..4 * ib + 4];
        let aux = q[2] as u32 | (q[3] as u32) << 16;
        let idx = (q[0] as u32 | (q[1] as u32) << 16).to_le_bytes();
        (idx, ksigns4(aux), aux >> 28)
    }
}

impl XxsGroups<[u8; 4]> for BlockIq2XxsRecoded {
    #[inline]
    fn parts(&self, ib: usize) -> ([u8; 4], [u8; 4], u32) {
        let (signs, scale) = recoded_word([0, 1, 2, 3].map(|k| self.signs[4 * ib + k]));
        ([0, 1, 2, 3].map(|k| self.idx[4 * ib + k]), signs, scale)
    }
}

impl XxsGroups<[u8; 8]> for BlockIq3Xxs {
    #[inline]
    fn parts(&self, ib: usize) -> ([u8; 8], [u8; 4], u32) {
        let aux = self.aux(ib);
        (
            std::array::from_fn(|k| self.qs[8 * ib + k]),
            ksigns4(aux),
            aux >> 28,
        )
    }
}

impl XxsGroups<[u8; 8]> for BlockIq3XxsRecoded {
    #[inline]
    fn parts(&self, ib: usize) -> ([u8; 8], [u8; 4], u32) {
        let (signs, scale) = recoded_word([0, 1, 2, 3].map(|k| self.signs[4 * ib + k]));
        (std::array::from_fn(|k| self.qs[8 * ib + k]), signs, scale)
    }
}

fn iq2_xxs_group(b: &impl XxsGroups<[u8; 4]>, ib: usize) -> Group {
    let (idx, signs, scale) = b.parts(ib);
    let s = 2 * scale as i32 + 1;
    Group {
        words: idx.map(|i| IQ2XXS_GRID[i as usize]),
        signs: signs.map(|b| SIGN_BYTES[b as usize]),
        scales: [s, s],
    }
}

fn iq3_xxs_group(b: &impl XxsGroups<[u8; 8]>, ib: usize) -> Group {
    let (q, signs, scale) = b.parts(ib);
    let s = 2 * scale as i32 + 1;
    Group {
        words: std::array::from_fn(|l| {
            IQ3XXS_GRID[q[2 * l] as usize] as u64
                | (IQ3XXS_GRID[q[2 * l + 1] as usize] as u64) << 32
        }),
        signs: signs.map(|b| SIGN_BYTES[b as usize]),
        scales: [s, s],
    }
}

/// Value `j` of a group: its magnitude times its sign.
#[inline]
fn group_value(g: &Group, j: usize) -> i32 {
    let m = (g.words[j / 8] >> (8 * (j % 8))) as u8 as i32;
    let s = (g.signs[j / 8] >> (8 * (j % 8))) as u8 as i8 as i32;
    m * s
}

/// `Σ w·a` over matching super-blocks: per super-block the exact integer sum
/// `Σ_groups Σ_halves scale · Σ v·a`, then `isum · (d · FACTOR · d_a)`.
pub fn vec_dot<B: Codebook>(w: &[B], a: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (b, q) in w.iter().zip(a) {
        let mut isum = 0i32;
        for ib in 0..QK_K / 32 {
            let g = b.group(ib);
            for (h, &s) in g.scales.iter().enumerate() {
                let part: i32 = (16 * h..16 * h + 16)
                    .map(|j| group_value(&g, j) * q.qs[32 * ib + j] as i32)
                    .sum();
                isum += s * part;
            }
        }
        let step = isum as f32 * (b.d() * B::FACTOR * q.d);
        sum += if B::MINS {
            // As `vec_dot_q2k`: the two products apart, then one subtraction.
            let (dmin, mins) = b.mins();
            let summs: i32 = (0..QK_K / 16)
                .map(|h| mins[h] as i32 * q.bsums[h] as i32)
                .sum();
            step - summs as f32 * (f16::from_bits(dmin).to_f32() * q.d)
        } else {
            step
        };
    }
    sum
}

/// llama.cpp's float steps for the grids with sign bytes: `db · magnitude · ±1`, eight at a
/// time, where `db` is the group's (or half's) scale.
#[inline]
fn signed_eight(y: &mut [f32], db: f32, grid: [u8; 8], signs: u8) {
    for j in 0..8 {
        let s = if signs >> j & 1 != 0 { -1.0 } else { 1.0 };
        y[j] = db * grid[j] as f32 * s;
    }
}

pub fn dequantize_iq2_xxs(blocks: &[BlockIq2Xxs], out: &mut [f32]) {
    dequantize_iq2_xxs_groups(blocks, out)
}

/// [`dequantize_iq2_xxs`] of the blocks the re-encoded ones came from: the same float steps.
pub fn dequantize_iq2_xxs_recoded(blocks: &[BlockIq2XxsRecoded], out: &mut [f32]) {
    dequantize_iq2_xxs_groups(blocks, out)
}

fn dequantize_iq2_xxs_groups<B: XxsGroups<[u8; 4]>>(blocks: &[B], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let (idx, signs, scale) = b.parts(ib);
            let db = d * (0.5 + scale as f32) * 0.25;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let grid = IQ2XXS_GRID[idx[l] as usize].to_le_bytes();
                signed_eight(y, db, grid, signs[l]);
            }
        }
    }
}

pub fn dequantize_iq2_xs(blocks: &[BlockIq2Xs], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let sc = b.scales[ib];
            let db = [
                d * (0.5 + (sc & 0x0f) as f32) * 0.25,
                d * (0.5 + (sc >> 4) as f32) * 0.25,
            ];
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let q = b.qs[4 * ib + l];
                let grid = IQ2XS_GRID[(q & 511) as usize].to_le_bytes();
                signed_eight(y, db[l / 2], grid, KSIGNS[(q >> 9) as usize]);
            }
        }
    }
}

pub fn dequantize_iq2_s(blocks: &[BlockIq2S], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let sc = b.scales[ib];
            let db = [
                d * (0.5 + (sc & 0x0f) as f32) * 0.25,
                d * (0.5 + (sc >> 4) as f32) * 0.25,
            ];
            let qh = b.qh[ib] as usize;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let i = b.qs[4 * ib + l] as usize | ((qh << (8 - 2 * l)) & 0x300);
                let grid = IQ2S_GRID[i].to_le_bytes();
                signed_eight(y, db[l / 2], grid, b.qs[QK_K / 8 + 4 * ib + l]);
            }
        }
    }
}

pub fn dequantize_iq3_xxs(blocks: &[BlockIq3Xxs], out: &mut [f32]) {
    dequantize_iq3_xxs_groups(blocks, out)
}

/// [`dequantize_iq3_xxs`] of the blocks the re-encoded ones came from: the same float steps.
pub fn dequantize_iq3_xxs_recoded(blocks: &[BlockIq3XxsRecoded], out: &mut [f32]) {
    dequantize_iq3_xxs_groups(blocks, out)
}

fn dequantize_iq3_xxs_groups<B: XxsGroups<[u8; 8]>>(blocks: &[B], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let (q, signs, scale) = b.parts(ib);
            let db = d * (0.5 + scale as f32) * 0.5;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let g1 = IQ3XXS_GRID[q[2 * l] as usize].to_le_bytes();
                let g2 = IQ3XXS_GRID[q[2 * l + 1] as usize].to_le_bytes();
                let grid = [g1[0], g1[1], g1[2], g1[3], g2[0], g2[1], g2[2], g2[3]];
                signed_eight(y, db, grid, signs[l]);
            }
        }
    }
}

pub fn dequantize_iq3_s(blocks: &[BlockIq3S], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let db = d * (1 + 2 * ((b.scales[ib / 2] >> (4 * (ib % 2))) & 0x0f) as i32) as f32;
            let group = b.group(ib);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                signed_eight(y, db, group.words[l].to_le_bytes(), b.signs[4 * ib + l]);
            }
        }
    }
}

pub fn dequantize_iq1_s(blocks: &[BlockIq1S], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let qh = b.qh[ib];
            let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
            let delta = if qh & 0x8000 != 0 {
                -IQ1_DELTA
            } else {
                IQ1_DELTA
            };
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let i = b.qs[4 * ib + l] as usize | (((qh >> (3 * l)) & 7) as usize) << 8;
                for (y, g) in y.iter_mut().zip(IQ1S_GRID[i].to_le_bytes()) {
                    *y = dl * (g as i8 as f32 + delta);
                }
            }
        }
    }
}

pub fn dequantize_iq1_m(blocks: &[BlockIq1M], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = BlockIq1M::d(b);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let (idx, delta) = b.indices(ib);
            let dl = b.scales3(ib).map(|s| d * (2 * s + 1) as f32);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let delta = if delta[l] < 0 { -IQ1_DELTA } else { IQ1_DELTA };
                for (y, g) in y.iter_mut().zip(IQ1S_GRID[idx[l]].to_le_bytes()) {
                    *y = dl[l / 2] * (g as i8 as f32 + delta);
                }
            }
        }
    }
}

pub fn dequantize_tq1_0(blocks: &[BlockTq1_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (e, y) in y.iter_mut().enumerate() {
            *y = b.value(e) as f32 * d;
        }
    }
}

pub fn dequantize_tq2_0(blocks: &[BlockTq2_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (e, y) in y.iter_mut().enumerate() {
            *y = b.value(e) as f32 * d;
        }
    }
}

/// `$body` with `$B` the block type of `$dtype` where that is one of the nine codebook
/// formats or one of the two K-quants the prefill tiles take as codebooks (Q2_K, Q3_K, whose
/// kernel-table arms come first), else `$other`: the one place their `DType`s meet their
/// block types (the kernel tables, `iq_tile::decode_rows` and [`is_codebook`] dispatch
/// through it).
macro_rules! with_codebook {
    ($dtype:expr, $B:ident => $body:expr, _ => $other:expr) => {
        $crate::cpu::quant::iq_grid::with_codebook!(@arms $dtype, $B, $body, $other;
            Iq2Xxs BlockIq2Xxs, Iq2Xs BlockIq2Xs, Iq2S BlockIq2S, Iq3Xxs BlockIq3Xxs,
            Iq3S BlockIq3S, Iq1S BlockIq1S, Iq1M BlockIq1M, Tq1_0 BlockTq1_0, Tq2_0 BlockTq2_0,
            Q2K BlockQ2K, Q3K BlockQ3K)
    };
    (@arms $dtype:expr, $B:ident, $body:expr, $other:expr; $($dt:ident $ty:ident),*) => {
        match $dtype {
            $(::ferrum_core::DType::$dt => {
                #[allow(dead_code)] // `is_codebook` asks only which formats are codebooks
                type $B = $crate::cpu::quant::iq_grid::$ty;
                $body
            })*
            _ => $other,
        }
    };
}
pub(crate) use with_codebook;

/// Whether `dtype` is one of the codebook formats.
pub fn is_codebook(dtype: DType) -> bool {
    with_codebook!(dtype, B => true, _ => false)
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use crate::cpu::quant::q8::prefetch;
    use std::arch::x86_64::*;

    /// `KSIGNS` of the four seven-bit fields of each of eight words, in vector: each byte
    /// gets its field's seven bits and, in bit 7, their parity (in place of a super-block's
    /// thirty-two loads from `KSIGN_BYTES`, each with a 64-bit insert).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ksigns_x8(aux: __m256i) -> __m256i {
        // Adding to a word its bits from bit 7 up shifts those left by one: fields 1..3 move
        // up a bit, then (from bit 15) fields 2 and 3, then (from bit 23) field 3, so field k
        // starts at bit 8k.
        let lift = |v: __m256i, from: i32| {
            _mm256_add_epi32(v, _mm256_and_si256(v, _mm256_set1_epi32(from)))
        };
        let b = lift(lift(lift(aux, -1 << 7), -1 << 15), -1 << 23);
        ksigns_x32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f7f_7f7f)))
    }

    /// `KSIGNS` of 32 seven-bit fields, one a byte: bit 7 set where the field holds an odd
    /// number of ones.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ksigns_x32(b: __m256i) -> __m256i {
        // 0x80 where a nibble holds an odd number of ones.
        let o = -128i8;
        let odd = _mm256_setr_epi8(
            0, o, o, 0, o, 0, 0, o, o, 0, 0, o, 0, o, o, 0, //
            0, o, o, 0, o, 0, 0, o, o, 0, 0, o, 0, o, o, 0,
        );
        let nib = _mm256_set1_epi8(0x0f);
        let lo = _mm256_shuffle_epi8(odd, _mm256_and_si256(b, nib));
        let hi = _mm256_shuffle_epi8(odd, _mm256_and_si256(_mm256_srli_epi16::<4>(b), nib));
        _mm256_or_si256(b, _mm256_xor_si256(lo, hi))
    }

    /// `vpshufb` controls, per group `p` of a lane's four (whose 32-bit lane is bytes
    /// `4p..4p + 4`): byte `i` of the vector takes byte `4p + (i / run) % len + half · (i / 16)`.
    const fn spread(run: usize, len: usize, half: usize) -> [[u8; 32]; 4] {
        let mut t = [[0u8; 32]; 4];
        let mut p = 0;
        while p < 4 {
            let mut i = 0;
            while i < 32 {
                t[p][i] = (4 * p + (i / run) % len + half * (i / 16)) as u8;
                i += 1;
            }
            p += 1;
        }
        t
    }

    /// A group's sign bytes 0 and 1 (low lane), 2 and 3 (high lane), each spread over the
    /// eight bytes it signs.
    const SIGN_SPREAD: [[u8; 32]; 4] = spread(8, 4, 0);

    /// A group's scale (its lane's low two bytes) in every 16-bit lane.
    const SCALE_SPREAD: [[u8; 32]; 4] = spread(1, 2, 0);

    /// A group's two half scales (its lane's low and high 16 bits) in every 16-bit lane of
    /// the low and high 128-bit lanes.
    const HALF_SCALE_SPREAD: [[u8; 32]; 4] = spread(1, 2, 2);

    /// The formats whose 32-value groups take their signs a byte per eight values and odd
    /// integer scales: IQ2_XXS and IQ3_XXS (a word of four seven-bit sign fields, each
    /// byte's eighth sign their parity, and the scale `2 · (word >> 28) + 1`), IQ2_XS (a
    /// seven-bit sign field over each grid index, a 4-bit scale per 16 values), IQ3_S (the
    /// sign bytes stored, a 4-bit scale per group) and IQ2_S (the sign bytes stored, a 4-bit
    /// scale per 16 values).
    pub trait SignBytes: Codebook {
        /// The eight groups' sign bytes (byte `4g + k` signs values `8k..8k + 8` of group
        /// `g`, bit `j` value `8k + j`) and their scales (i32 lane `g`; see `HALF_SCALES`).
        ///
        /// # Safety
        /// The CPU supports AVX2.
        unsafe fn signs_scales(&self) -> (__m256i, __m256i);
        /// Group `g`'s 32 magnitudes.
        ///
        /// # Safety
        /// The CPU supports AVX2, and `g < 8`.
        unsafe fn magnitudes(&self, g: usize) -> __m256i;
        /// How each group's scale reaches every 16-bit lane ([`ScaleSpread`]).
        const SCALE_BY: ScaleSpread;
        /// The same in the four-token kernel, where a group's one spread serves four tokens'
        /// products and the pipes' balance differs.
        const SCALE_BY_X4: ScaleSpread = Self::SCALE_BY;
        /// Whether each group has two scales, for values `0..16` (the low 16 bits of its
        /// lane in `signs_scales`) and `16..32` (the high). A constant per format, so that the
        /// one-scale formats keep their own code: with every format on the two-scale
        /// control, IQ2_XXS's kernel ran 15% slower on Zen 3.
        const HALF_SCALES: bool = false;
        /// Whether the next super-block's signs and scales are made a pass ahead, where a pass
        /// (~200 instructions) nearly fills the reorder buffer and the groups otherwise wait on
        /// that chain. On Zen 3 (`dot/FORMAT`): IQ2_S 395 → 354 ns, IQ2_XXS 284 → 279; IQ2_XS
        /// 312 → 322 and IQ3_XXS 386 → 391, so those make them in the pass as before.
        const AHEAD: bool = false;
        /// The same in the four-token kernel.
        const AHEAD_X4: bool = Self::AHEAD;
    }

    /// How [`vec_dot_sign_bytes`] spreads a group's scale over its 16-bit lanes. Measured on Zen 3
    /// (`dot/FORMAT`), each format keeps its fastest.
    #[derive(PartialEq, Eq)]
    pub enum ScaleSpread {
        /// One `vpshufb`, which LLVM lowers to two shuffles where it can see the control.
        Shuffle,
        /// One `vpshufb` with the control hidden from LLVM. With IQ3_XXS's and IQ3_S's eight
        /// grid entries a group the shuffle pipes are the kernel's limit, and hiding it took
        /// `dot/IQ3_XXS` from 445 to 385 ns; the four-entry formats ran slower with it
        /// (IQ2_XXS 15%, IQ2_S 2%).
        OpaqueShuffle,
        /// The eight scales stored once a super-block and each broadcast back by a load, no
        /// shuffle at all (one-scale formats only). `dot/IQ2_XXS` 292 → 285 ns; IQ3_XXS, whose
        /// groups already make nine loads, 388 → 468.
        Load,
    }

    /// Signs and scales from eight sign-and-scale words, in order (IQ2_XXS, IQ3_XXS).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn from_words(aux: __m256i) -> (__m256i, __m256i) {
        // 2 · (aux >> 28) + 1
        let scales = _mm256_or_si256(_mm256_srli_epi32::<27>(aux), _mm256_set1_epi32(1));
        (ksigns_x8(aux), scales)
    }

    /// Four 8-byte grid entries, `table[at[k]]` in lane k, each broadcast from memory (a load,
    /// no shuffle) and blended. Built as `setr_epi64x`, LLVM makes two `vpunpcklqdq` and a
    /// `vinserti128`: three operations on the two shuffle pipes that were the kernel's limit.
    ///
    /// # Safety
    /// The CPU supports AVX2, and every `at[k] < table.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn entries4(table: &[u64], at: [usize; 4]) -> __m256i {
        debug_assert!(at.iter().all(|&i| i < table.len()));
        // In assembly: LLVM turns broadcast loads that are blended back into those shuffles.
        let b = |k: usize| {
            let v: __m256i;
            std::arch::asm!(
                "vpbroadcastq {v}, qword ptr [{t} + 8*{i}]",
                v = out(ymm_reg) v,
                t = in(reg) table.as_ptr(),
                i = in(reg) at[k],
                options(pure, readonly, nostack, preserves_flags),
            );
            v
        };
        _mm256_blend_epi32::<0b1111_0000>(
            _mm256_blend_epi32::<0b0000_1100>(b(0), b(1)),
            _mm256_blend_epi32::<0b1100_0000>(b(2), b(3)),
        )
    }

    #[repr(align(32))]
    struct Aligned32([i32; 8]);

    /// `*at` in every 32-bit lane, by a broadcast load. In assembly: LLVM forwards a store
    /// the load reads back and makes a shuffle of it again.
    ///
    /// # Safety
    /// The CPU supports AVX2, and `at` is valid to read.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn broadcast32(at: *const i32) -> __m256i {
        let v: __m256i;
        std::arch::asm!(
            "vpbroadcastd {v}, dword ptr [{p}]",
            v = out(ymm_reg) v,
            p = in(reg) at,
            options(pure, readonly, nostack, preserves_flags),
        );
        v
    }

    /// Eight 4-byte grid entries, `grid(k)` in lane k (IQ3_XXS, IQ3_S).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn entries8(grid: impl Fn(usize) -> i32) -> __m256i {
        _mm256_setr_epi32(
            grid(0),
            grid(1),
            grid(2),
            grid(3),
            grid(4),
            grid(5),
            grid(6),
            grid(7),
        )
    }

    impl SignBytes for BlockIq2Xxs {
        /// Group g is eight bytes: four grid indices, then its word.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn signs_scales(&self) -> (__m256i, __m256i) {
            let qs = self.qs.as_ptr() as *const __m256i;
            let (g03, g47) = (_mm256_loadu_si256(qs), _mm256_loadu_si256(qs.add(1)));
            from_words(_mm256_permutevar8x32_epi32(
                _mm256_blend_epi32::<0b1010_1010>(_mm256_srli_epi64::<32>(g03), g47),
                _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7),
            ))
        }
        const SCALE_BY: ScaleSpread = ScaleSpread::Load;
        const AHEAD: bool = true;
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn magnitudes(&self, g: usize) -> __m256i {
            let qs = self.qs.as_ptr() as *const u8;
            // Volatile, so that each index is one byte load: LLVM otherwise takes some from the
            // vector `signs_scales` loaded (`vpextrb`, two operations on the ports the grid
            // loads use). `dot/IQ2_XXS` on Zen 3: 314 → 297 ns.
            let at = |k: usize| std::ptr::read_volatile(qs.add(8 * g + k)) as usize;
            entries4(&IQ2XXS_GRID, [at(0), at(1), at(2), at(3)])
        }
    }

    /// Signs and scales from eight re-encoded words ([`recode_word`]): the sign bytes
    /// `t ^ (t << 1)` of each byte's low seven bits `t` (a byte add is a shift left by one
    /// with no carry between bytes), and group g's scale from bit 7 of its four bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn from_recoded(v: __m256i) -> (__m256i, __m256i) {
        let t = _mm256_and_si256(v, _mm256_set1_epi8(0x7f));
        let signs = _mm256_xor_si256(t, _mm256_add_epi8(t, t));
        // Bit 7 of byte k (128 or 0) times 2^k, summed over the lane's four bytes: 128 · s.
        let top = _mm256_and_si256(v, _mm256_set1_epi8(-128));
        let s128 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(top, _mm256_set1_epi32(0x0804_0201)),
            _mm256_set1_epi16(1),
        );
        // 2 · s + 1
        let scales = _mm256_or_si256(_mm256_srli_epi32::<6>(s128), _mm256_set1_epi32(1));
        (signs, scales)
    }

    impl SignBytes for BlockIq2XxsRecoded {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn signs_scales(&self) -> (__m256i, __m256i) {
            from_recoded(_mm256_loadu_si256(self.signs.as_ptr() as *const __m256i))
        }
        /// Measured on Zen 3 (`dot/IQ2_XXS-recoded`), against the file form's `Load` and
        /// `AHEAD`: with both 267 ns, without `AHEAD` 262, by `Shuffle` without `AHEAD` 252,
        /// and by `Shuffle` with it 285. The file form takes 277.
        const SCALE_BY: ScaleSpread = ScaleSpread::Shuffle;
        /// `matmul_n4/IQ2_XXS` on Zen 3: by `Shuffle` 306 µs, by `Load` 286–290 (with
        /// `AHEAD` 291–293); the file form's kernel 300.
        const SCALE_BY_X4: ScaleSpread = ScaleSpread::Load;
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn magnitudes(&self, g: usize) -> __m256i {
            let idx = self.idx.as_ptr();
            // Volatile, as for the file's form.
            let at = |k: usize| std::ptr::read_volatile(idx.add(4 * g + k)) as usize;
            entries4(&IQ2XXS_GRID, [at(0), at(1), at(2), at(3)])
        }
    }

    impl SignBytes for BlockIq3Xxs {
        /// 64 bytes of grid indices, eight a group, then the eight words.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn signs_scales(&self) -> (__m256i, __m256i) {
            from_words(_mm256_loadu_si256(
                self.qs.as_ptr().add(QK_K / 4) as *const __m256i
            ))
        }
        const SCALE_BY: ScaleSpread = ScaleSpread::OpaqueShuffle;
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn magnitudes(&self, g: usize) -> __m256i {
            let qs = self.qs.as_ptr();
            let grid = |k: usize| IQ3XXS_GRID[*qs.add(8 * g + k) as usize] as i32;
            entries8(grid)
        }
    }

    impl SignBytes for BlockIq3XxsRecoded {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn signs_scales(&self) -> (__m256i, __m256i) {
            from_recoded(_mm256_loadu_si256(self.signs.as_ptr() as *const __m256i))
        }
        /// Measured on Zen 3 against the file form's `OpaqueShuffle` (`dot/IQ3_XXS-recoded`
        /// 374–391 ns, `matmul_n1/IQ3_XXS` 198–203 µs, `matmul_n4` 384–394 µs): by
        /// `Shuffle` 422–429 ns, 245–248 µs; by `Load` 437 ns, 234–236 µs, and 357–364 µs
        /// over four tokens; with `AHEAD` 381–397 ns, 203–207 µs, and 332–348 µs over four
        /// tokens. The file form takes 387–404 ns, 204–210 µs and 394–396 µs.
        const SCALE_BY: ScaleSpread = ScaleSpread::OpaqueShuffle;
        const AHEAD_X4: bool = true;
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn magnitudes(&self, g: usize) -> __m256i {
            let qs = self.qs.as_ptr();
            let grid = |k: usize| IQ3XXS_GRID[*qs.add(8 * g + k) as usize] as i32;
            entries8(grid)
        }
    }

    impl SignBytes for BlockIq2Xs {
        /// Group g is four u16, each a nine-bit grid index under a seven-bit sign field; its
        /// half scales are the nibbles of `scales[g]`.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn signs_scales(&self) -> (__m256i, __m256i) {
            let qs = self.qs.as_ptr() as *const __m256i;
            let f03 = _mm256_srli_epi16::<9>(_mm256_loadu_si256(qs));
            let f47 = _mm256_srli_epi16::<9>(_mm256_loadu_si256(qs.add(1)));
            // packus interleaves the lanes: groups 0, 1, 4, 5 | 2, 3, 6, 7.
            let fields = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(f03, f47));
            (ksigns_x32(fields), half_scales(&self.scales))
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn magnitudes(&self, g: usize) -> __m256i {
            let q = self.qs.as_ptr().add(4 * g);
            // Volatile, so that each index is one 16-bit load: LLVM otherwise loads the four
            // together, masks them in vector and extracts each (two operations apiece), and
            // the kernel ran no faster than one over `Codebook::group`.
            let grid =
                |k: usize| IQ2XS_GRID[(std::ptr::read_volatile(q.add(k)) & 511) as usize] as i64;
            _mm256_setr_epi64x(grid(0), grid(1), grid(2), grid(3))
        }
        const SCALE_BY: ScaleSpread = ScaleSpread::Shuffle;
        const HALF_SCALES: bool = true;
    }

    /// Eight groups' half scales from a byte each, its nibbles: `2s + 1` of the low nibble in
    /// the low 16 bits of lane g, of the high nibble in the high 16 (IQ2_XS, IQ2_S).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn half_scales(scales: &[u8; 8]) -> __m256i {
        let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(scales.as_ptr() as *const __m128i));
        // Low nibble to bits 1..5, high nibble to bits 17..21; then + 1 in both halves.
        let halves = _mm256_or_si256(
            _mm256_slli_epi32::<1>(_mm256_and_si256(sc, _mm256_set1_epi32(0x0f))),
            _mm256_slli_epi32::<13>(_mm256_and_si256(sc, _mm256_set1_epi32(0xf0))),
        );
        _mm256_or_si256(halves, _mm256_set1_epi32(0x0001_0001))
    }

    impl SignBytes for BlockIq2S {
        /// The sign bytes as stored; group g's half scales are the nibbles of `scales[g]`.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn signs_scales(&self) -> (__m256i, __m256i) {
            let signs = _mm256_loadu_si256(self.qs.as_ptr().add(QK_K / 8) as *const __m256i);
            (signs, half_scales(&self.scales))
        }
        /// Index l of group g: byte `4g + l` of `qs`, and bits `2l..2l + 2` of `qh[g]` as its
        /// ninth and tenth bits (made in scalar: four a group, unlike IQ3_S's eight, and
        /// gathered the kernel was no faster than one over `Codebook::group`).
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn magnitudes(&self, g: usize) -> __m256i {
            let (qs, qh) = (self.qs.as_ptr(), *self.qh.get_unchecked(g) as usize);
            let grid = |l: usize| {
                IQ2S_GRID[*qs.add(4 * g + l) as usize | ((qh << (8 - 2 * l)) & 0x300)] as i64
            };
            _mm256_setr_epi64x(grid(0), grid(1), grid(2), grid(3))
        }
        const SCALE_BY: ScaleSpread = ScaleSpread::Shuffle;
        const HALF_SCALES: bool = true;
        const AHEAD: bool = true;
    }

    impl SignBytes for BlockIq3S {
        /// The sign bytes as stored; group g's scale is nibble g of `scales`.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn signs_scales(&self) -> (__m256i, __m256i) {
            let signs = _mm256_loadu_si256(self.signs.as_ptr() as *const __m256i);
            let nibbles = _mm256_srlv_epi32(
                _mm256_set1_epi32(u32::from_le_bytes(self.scales) as i32),
                _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
            );
            let odd = _mm256_slli_epi32::<1>(_mm256_and_si256(nibbles, _mm256_set1_epi32(0x0f)));
            (signs, _mm256_or_si256(odd, _mm256_set1_epi32(1)))
        }
        const SCALE_BY: ScaleSpread = ScaleSpread::OpaqueShuffle;
        /// Index k of group g: byte `8g + k` of `qs`, and bit k of `qh[g]` as its ninth bit,
        /// made in vector and read back lane by lane (LLVM extracts them, `vpextrd`).
        /// `dot/IQ3_S` on Zen 3: 600 ns so; 645 gathered (`vpgatherdd`); 780 made in scalar as
        /// IQ3_XXS's are (LLVM kept 64 table addresses a super-block on the stack), no faster
        /// than a kernel over `Codebook::group`; slower still through memory with volatile loads.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn magnitudes(&self, g: usize) -> __m256i {
            let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                self.qs.as_ptr().add(8 * g) as *const __m128i
            ));
            let qh = _mm256_set1_epi32(*self.qh.get_unchecked(g) as i32);
            let hi = _mm256_and_si256(
                _mm256_sllv_epi32(qh, _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)),
                _mm256_set1_epi32(256),
            );
            let mut at = [0u32; 8];
            _mm256_storeu_si256(at.as_mut_ptr() as *mut __m256i, _mm256_or_si256(lo, hi));
            let grid = |k: usize| IQ3S_GRID[(at[k] & 511) as usize] as i32;
            entries8(grid)
        }
    }

    /// A vector's 128-bit lane `half` in both lanes: the side data of groups `4 · half..`,
    /// as the in-lane shuffles that spread it to a group want it.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn half_lanes(v: __m256i, half: usize) -> __m256i {
        if half == 0 {
            _mm256_permute4x64_epi64::<0x44>(v)
        } else {
            _mm256_permute4x64_epi64::<0xee>(v)
        }
    }

    /// A super-block's step into each token's sum: its two chains' integer sum, times
    /// `d · FACTOR · d_a`, as the scalar kernel does.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn add_superblock<B: Codebook, const N: usize>(
        sum: &mut [f32; N],
        b: &B,
        acc: &[[__m256i; 2]; N],
        q: [&BlockQ8K; N],
    ) {
        let d = half_to_f32(b.d_bits()) * B::FACTOR;
        for t in 0..N {
            let isum = hsum_i32(_mm256_add_epi32(acc[t][0], acc[t][1]));
            sum[t] += isum as f32 * (d * q[t].d);
        }
    }

    /// [`vec_dot`] for IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S, the formats
    /// the smallest downloads use. A super-block's eight groups' signs and scales are made
    /// together in vector ([`SignBytes`]), then each group takes its signs by one shuffle and
    /// its scale by one shuffle or one load ([`ScaleSpread`]) (a kernel over `Codebook::group`
    /// spent most of its time on sign-table loads and `Group` through memory). Two chains of
    /// sums. The same integers, so the scalar kernel's bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_sign_bytes<B: SignBytes>(w: &[B], a: &[BlockQ8K]) -> f32 {
        sign_bytes_n::<B, 1>(w, [a])[0]
    }

    /// [`vec_dot_sign_bytes`] against four tokens, each group decoded once for all four: per
    /// token the same integers and float steps, so its bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_sign_bytes_x4<B: SignBytes>(w: &[B], a: [&[BlockQ8K]; 4]) -> [f32; 4] {
        sign_bytes_n::<B, 4>(w, a)
    }

    /// A VNNI instance's public one-token and four-token row kernels over its body `$inner`
    /// (made by `sign_bytes_kernel!` or `offset_bytes_kernel!`); the AVX2 instance's, written
    /// out above each body, say what they compute.
    macro_rules! entry_points {
        ($bound:ident, $inner:ident, $feat:literal, $dot:ident, $dot4:ident) => {
            /// The AVX2 kernel's integers with `vpdpwssd`, so its bits: one token.
            ///
            /// # Safety
            #[doc = concat!("The CPU supports ", $feat, ".")]
            #[target_feature(enable = $feat)]
            pub unsafe fn $dot<B: $bound>(w: &[B], a: &[BlockQ8K]) -> f32 {
                $inner::<B, 1>(w, [a])[0]
            }

            /// The AVX2 kernel's integers with `vpdpwssd`, so its bits: four tokens.
            ///
            /// # Safety
            #[doc = concat!("The CPU supports ", $feat, ".")]
            #[target_feature(enable = $feat)]
            pub unsafe fn $dot4<B: $bound>(w: &[B], a: [&[BlockQ8K]; 4]) -> [f32; 4] {
                $inner::<B, 4>(w, a)
            }
        };
    }

    /// The sign-bytes row kernel's body, once per instruction set: `$acc(acc, pairs, sc)`
    /// adds the `madd` of a group's `maddubs` pair sums and its scales to an accumulator,
    /// which VNNI does in one `vpdpwssd` (the same wrapping i32 sum, so the same bits).
    macro_rules! sign_bytes_kernel {
        ($name:ident, $feat:literal, $acc:path) => {
            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn $name<B: SignBytes, const N: usize>(
                w: &[B],
                a: [&[BlockQ8K]; N],
            ) -> [f32; N] {
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let h7f = _mm256_set1_epi8(0x7f);
                let mut sum = [0f32; N];
                let table = if B::HALF_SCALES {
                    &HALF_SCALE_SPREAD
                } else {
                    &SCALE_SPREAD
                };
                let mut scale_ctl = [0, 1, 2, 3].map(|p| control(&table[p]));
                let scale_by = if N == 1 { B::SCALE_BY } else { B::SCALE_BY_X4 };
                let ahead = if N == 1 { B::AHEAD } else { B::AHEAD_X4 };
                if scale_by == ScaleSpread::OpaqueShuffle {
                    scale_ctl = std::hint::black_box(scale_ctl);
                }
                // `ScaleSpread::Load` (a one-scale format's): the eight scales, each in both halves
                // of its lane.
                let load = scale_by == ScaleSpread::Load && !B::HALF_SCALES;
                let mut lanes = Aligned32([0i32; 8]);
                let Some(first) = w.first() else {
                    return sum;
                };
                // `SignBytes::AHEAD`'s super-block a pass ahead (dead code for the other formats).
                let mut next = first.signs_scales();
                for (i, b) in w.iter().enumerate() {
                    prefetch(b);
                    let q = a.map(|r| r.get_unchecked(i));
                    let (signs, scales) = if ahead {
                        let now = next;
                        if let Some(after) = w.get(i + 1) {
                            next = after.signs_scales();
                        }
                        now
                    } else {
                        b.signs_scales()
                    };
                    if load {
                        _mm256_store_si256(
                            lanes.0.as_mut_ptr() as *mut __m256i,
                            _mm256_or_si256(scales, _mm256_slli_epi32::<16>(scales)),
                        );
                    }
                    // One token's sums in two chains; more tokens are chains enough.
                    let mut acc = [[_mm256_setzero_si256(); 2]; N];
                    for half in 0..2 {
                        let (sg4, sc4) = (half_lanes(signs, half), half_lanes(scales, half));
                        for p in 0..4 {
                            let g = 4 * half + p;
                            let x = b.magnitudes(g);
                            let bits = _mm256_shuffle_epi8(sg4, control(&SIGN_SPREAD[p]));
                            // 0x7f plus the sign's bit (1 to 128): negative exactly where it is set.
                            let sg = _mm256_add_epi8(_mm256_and_si256(bits, bit), h7f);
                            let sc = if load {
                                broadcast32(lanes.0.as_ptr().add(g))
                            } else {
                                _mm256_shuffle_epi8(sc4, scale_ctl[p])
                            };
                            let chain = if N == 1 { p % 2 } else { 0 };
                            // The signs moved onto the activations, `maddubs` with the magnitudes
                            // (a pair sum is at most 2 · 127 · 127, inside i16), then the scales.
                            for t in 0..N {
                                let y = _mm256_loadu_si256(
                                    q[t].qs.as_ptr().add(32 * g) as *const __m256i
                                );
                                let pairs = _mm256_maddubs_epi16(x, _mm256_sign_epi8(y, sg));
                                acc[t][chain] = $acc(acc[t][chain], pairs, sc);
                            }
                        }
                    }
                    add_superblock(&mut sum, b, &acc, q);
                }
                sum
            }
        };
    }
    sign_bytes_kernel!(sign_bytes_n, "avx2,fma,f16c", madd_add);
    sign_bytes_kernel!(
        sign_bytes_n_avxvnni,
        "avx2,fma,f16c,avxvnni",
        madd_add_avxvnni
    );
    sign_bytes_kernel!(
        sign_bytes_n_vnni512,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        madd_add_vnni512
    );
    entry_points!(
        SignBytes,
        sign_bytes_n_avxvnni,
        "avx2,fma,f16c,avxvnni",
        vec_dot_sign_bytes_avxvnni,
        vec_dot_sign_bytes_x4_avxvnni
    );
    entry_points!(
        SignBytes,
        sign_bytes_n_vnni512,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        vec_dot_sign_bytes_vnni512,
        vec_dot_sign_bytes_x4_vnni512
    );

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn madd_add(acc: __m256i, pairs: __m256i, sc: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, sc))
    }

    // The two VNNI steps are written out: LLVM split the `dpwssd` intrinsics back into
    // `vpmaddwd` + `vpaddd` (seven of a super-block's eight groups, in the disassembly), so
    // the kernel ran the AVX2 instance's instructions.

    /// `vpdpwssd` in its VEX form (AVX-VNNI).
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    #[inline]
    unsafe fn madd_add_avxvnni(mut acc: __m256i, pairs: __m256i, sc: __m256i) -> __m256i {
        std::arch::asm!(
            "{{vex}} vpdpwssd {acc}, {a}, {b}",
            acc = inout(ymm_reg) acc,
            a = in(ymm_reg) pairs,
            b = in(ymm_reg) sc,
            options(pure, nomem, nostack, preserves_flags),
        );
        acc
    }

    /// `vpdpwssd` in its EVEX form on 256-bit registers (AVX512-VNNI with AVX512VL).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn madd_add_vnni512(mut acc: __m256i, pairs: __m256i, sc: __m256i) -> __m256i {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(ymm_reg) acc,
            a = in(ymm_reg) pairs,
            b = in(ymm_reg) sc,
            options(pure, nomem, nostack, preserves_flags),
        );
        acc
    }

    /// A super-block's 256 values, each magnitude times its sign, into `w`, and each group's
    /// two half scales: the prefill tile's decoding of the [`SignBytes`] formats, from the
    /// side data the row kernel makes (where `Codebook::group` makes each group's in scalar).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn signed_values<B: SignBytes>(b: &B, w: &mut [i8; QK_K]) -> [[i32; 2]; 8] {
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let h7f = _mm256_set1_epi8(0x7f);
        let (signs, scales) = b.signs_scales();
        for half in 0..2 {
            let sg4 = half_lanes(signs, half);
            for (p, spread) in SIGN_SPREAD.iter().enumerate() {
                let g = 4 * half + p;
                let bits = _mm256_shuffle_epi8(sg4, control(spread));
                // As in `sign_bytes_n`: negative exactly where the sign's bit is set.
                let sg = _mm256_add_epi8(_mm256_and_si256(bits, bit), h7f);
                let v = _mm256_sign_epi8(b.magnitudes(g), sg);
                _mm256_storeu_si256(w.as_mut_ptr().add(32 * g) as *mut __m256i, v);
            }
        }
        let mut lanes = [0i32; 8];
        _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, scales);
        lanes.map(|s| {
            if B::HALF_SCALES {
                [s & 0xffff, s >> 16]
            } else {
                [s, s]
            }
        })
    }

    /// The formats whose values are small signed integers with no sign bits: IQ1_S and IQ1_M
    /// (`8 · grid ± 1`, the grid's bytes −1, 0 or 1), TQ1_0 and TQ2_0 (a base-3 digit or two
    /// bits, less one). A value times its scale is `c · u − o`, with `u` an unsigned byte and
    /// `c` and `o` fixed per 16-value half, so `maddubs` takes `u` as it stands and the `o`s
    /// come out through the activations' 16-value sums (`BlockQ8K::bsums`), once a
    /// super-block.
    pub trait OffsetBytes: Codebook {
        /// Per super-block: bytes the groups' values need (each format's own: IQ1_M's per
        /// eight-value offsets, byte `4g + k` for values `8k..8k + 8` of group g), the half
        /// scales `madd` applies (i32 lane g: values `0..16` in its low 16 bits, `16..32` in
        /// its high) and the coefficients of the activations' 16-value sums (i16 lane `2g + h`),
        /// so that a super-block's integer sum is `Σ scale · Σ u·a + Σ coef · bsum`. The grid
        /// formats also write their 32 grid indices to `idx`, made in vector.
        ///
        /// # Safety
        /// The CPU supports AVX2.
        unsafe fn parts(&self, idx: &mut [u16; 32]) -> (__m256i, __m256i, __m256i);
        /// Group `g`'s 32 bytes `u` (at most 127, so a `maddubs` pair stays inside i16):
        /// `side` is the first of [`parts`](OffsetBytes::parts), groups `4 · (g / 4)..` in
        /// both lanes, as the sign bytes are spread.
        ///
        /// # Safety
        /// The CPU supports AVX2, and `g < 8`.
        unsafe fn unsigned(&self, g: usize, side: __m256i, idx: &[u16; 32]) -> __m256i;
    }

    /// The four 8-byte IQ1 grid entries of a group, in order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn iq1_entries(idx: [usize; 4]) -> __m256i {
        let grid = |l: usize| IQ1S_GRID[idx[l] & 2047] as i64;
        _mm256_setr_epi64x(grid(0), grid(1), grid(2), grid(3))
    }

    /// Eight 16-bit lanes as eight i32 lanes, each lane's value in both of its halves (the
    /// two half scales of a one-scale group, or its two 16-value sums' coefficients).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn both_halves(x: __m128i) -> __m256i {
        _mm256_set_m128i(_mm_unpackhi_epi16(x, x), _mm_unpacklo_epi16(x, x))
    }

    impl OffsetBytes for BlockIq1S {
        /// `8g + δ = 8 · (g + 1) + (δ − 8)`: `u = g + 1`, the eight in the scale (`8s`, at
        /// most 120) and the rest, `s · (δ − 8)`, through the group's sums.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn parts(&self, idx: &mut [u16; 32]) -> (__m256i, __m256i, __m256i) {
            let qh = _mm_loadu_si128(self.qh.as_ptr() as *const __m128i);
            // Index 4g + l: byte 4g + l of qs, bits 3l..3l + 3 of qh[g] as bits 8..11 (qh[g]
            // times 2^8, 2^5, 2^2, or 2^-1 by the high half of times 2^15).
            let qs = self.qs.as_ptr() as *const __m128i;
            let (mul, mul_hi) = (
                _mm256_setr_epi16(256, 32, 4, 0, 256, 32, 4, 0, 256, 32, 4, 0, 256, 32, 4, 0),
                _mm256_setr_epi16(
                    0, 0, 0, -32768, 0, 0, 0, -32768, 0, 0, 0, -32768, 0, 0, 0, -32768,
                ),
            );
            for (half, q) in [_mm_unpacklo_epi16(qh, qh), _mm_unpackhi_epi16(qh, qh)]
                .into_iter()
                .enumerate()
            {
                // qh of groups 4·half.. each four times.
                let hi = _mm256_set_m128i(_mm_unpackhi_epi32(q, q), _mm_unpacklo_epi32(q, q));
                let at = idx.as_mut_ptr().add(16 * half) as *mut __m256i;
                let bits =
                    _mm256_or_si256(_mm256_mullo_epi16(hi, mul), _mm256_mulhi_epu16(hi, mul_hi));
                let lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(qs.add(half)));
                let bits = _mm256_and_si256(bits, _mm256_set1_epi16(0x700));
                _mm256_storeu_si256(at, _mm256_or_si256(lo, bits));
            }
            // 2 · bits 12..15 + 1, and δ − 8: −7, or −9 where bit 15 is set.
            let s = _mm_or_si128(
                _mm_and_si128(_mm_srli_epi16::<11>(qh), _mm_set1_epi16(0x0e)),
                _mm_set1_epi16(1),
            );
            let delta8 = _mm_add_epi16(
                _mm_set1_epi16(-7),
                _mm_slli_epi16::<1>(_mm_srai_epi16::<15>(qh)),
            );
            let coef = _mm_mullo_epi16(s, delta8);
            (
                _mm256_setzero_si256(),
                both_halves(_mm_slli_epi16::<3>(s)),
                both_halves(coef),
            )
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn unsigned(&self, g: usize, _side: __m256i, idx: &[u16; 32]) -> __m256i {
            let entries = iq1_entries([0, 1, 2, 3].map(|l| idx[4 * g + l] as usize));
            _mm256_add_epi8(entries, _mm256_set1_epi8(1))
        }
    }

    impl OffsetBytes for BlockIq1M {
        /// `8g + δ + 9`, from 0 to 18, with δ per eight values: `u = sign(8, g) + (9 + δ)`,
        /// the 9 + δ spread from a byte per eight values, and `−9 s` through the sums.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn parts(&self, _idx: &mut [u16; 32]) -> (__m256i, __m256i, __m256i) {
            // δ's bit is bit 3 of each qh nibble, the nibbles in value order: 10 − 2 · bit.
            let qh = _mm_loadu_si128(self.qh.as_ptr() as *const __m128i);
            let b3 = _mm_set1_epi8(0x08);
            let lo = _mm_and_si128(qh, b3);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(qh), b3);
            let bits = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
            let side = _mm256_sub_epi8(_mm256_set1_epi8(10), _mm256_srli_epi16::<2>(bits));
            // Group g's half scales: bits 6(g % 2).. of word g / 2, three bits each.
            let words =
                _mm256_cvtepu16_epi32(_mm_loadl_epi64(self.scales.as_ptr() as *const __m128i));
            let x = _mm256_srlv_epi32(
                _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
                _mm256_setr_epi32(0, 6, 0, 6, 0, 6, 0, 6),
            );
            let scales = _mm256_or_si256(
                _mm256_or_si256(
                    _mm256_slli_epi32::<1>(_mm256_and_si256(x, _mm256_set1_epi32(7))),
                    _mm256_slli_epi32::<14>(_mm256_and_si256(x, _mm256_set1_epi32(0x38))),
                ),
                _mm256_set1_epi32(0x0001_0001),
            );
            (
                side,
                scales,
                _mm256_mullo_epi16(scales, _mm256_set1_epi16(-9)),
            )
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        /// The indices made in scalar: made in vector, as IQ1_S's, `dot/IQ1_M` ran 16% slower
        /// on Zen 3.
        unsafe fn unsigned(&self, g: usize, side: __m256i, _idx: &[u16; 32]) -> __m256i {
            let qs = self.qs.as_ptr().add(4 * g);
            let qh = (self.qh.as_ptr().add(2 * g) as *const u16).read_unaligned() as usize;
            let idx = [0, 1, 2, 3].map(|l| *qs.add(l) as usize | (qh >> (4 * l) & 7) << 8);
            let off = _mm256_shuffle_epi8(side, control(&SIGN_SPREAD[g % 4]));
            _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), iq1_entries(idx)), off)
        }
    }

    /// The ternary formats' parts: scales 1, and −1 a value through the sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ternary_parts() -> (__m256i, __m256i, __m256i) {
        let one = _mm256_set1_epi16(1);
        (_mm256_setzero_si256(), one, _mm256_set1_epi16(-1))
    }

    impl OffsetBytes for BlockTq2_0 {
        /// `q − 1`: `u = q`, and −1 through the sums.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn parts(&self, _idx: &mut [u16; 32]) -> (__m256i, __m256i, __m256i) {
            ternary_parts()
        }
        /// Group g: bits `2 · (g % 4)..` of bytes `32 · (g / 4)..`.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn unsigned(&self, g: usize, _side: __m256i, _idx: &[u16; 32]) -> __m256i {
            let q = _mm256_loadu_si256(self.qs.as_ptr().add(32 * (g / 4)) as *const __m256i);
            let shifted = _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (g % 4) as i32));
            _mm256_and_si256(shifted, _mm256_set1_epi8(3))
        }
    }

    /// Bytes times three, modulo 256 (TQ1_0's next base-3 digit to the top).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn times3(y: __m256i) -> __m256i {
        _mm256_add_epi8(_mm256_add_epi8(y, y), y)
    }

    /// Each byte's top base-3 digit as GGML reads it, `(3y) >> 8`: 1 from 86 up, 2 from 171.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn top_trit(y: __m256i) -> __m256i {
        let at_least = |t: i8| _mm256_cmpeq_epi8(_mm256_max_epu8(y, _mm256_set1_epi8(t)), y);
        // Each comparison is −1 where it holds.
        _mm256_sub_epi8(
            _mm256_setzero_si256(),
            _mm256_add_epi8(at_least(86), at_least(-85)),
        )
    }

    impl OffsetBytes for BlockTq1_0 {
        /// `t − 1`: `u = t`, and −1 through the sums.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn parts(&self, _idx: &mut [u16; 32]) -> (__m256i, __m256i, __m256i) {
            ternary_parts()
        }
        /// Groups 0..5: digit g of `qs[0..32]`; then digits 0 and 1 (group 5), 2 and 3
        /// (group 6) of `qs[32..48]`, and digit 4 of those beside the sixteen of `qh`'s four
        /// digits (group 7). Digit n of a byte is the top digit of the byte times `3^n`.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn unsigned(&self, g: usize, _side: __m256i, _idx: &[u16; 32]) -> __m256i {
            let pow = |mut y: __m256i, n: usize| {
                for _ in 0..n {
                    y = times3(y);
                }
                y
            };
            if g < 5 {
                let q = _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i);
                return top_trit(pow(q, g));
            }
            let z = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                self.qs.as_ptr().add(32) as *const __m128i
            ));
            // z times 1 in the low lane, 3 in the high.
            let z01 = _mm256_blend_epi32::<0xf0>(z, times3(z));
            let y = match g {
                5 => z01,
                6 => pow(z01, 2),
                _ => {
                    let h = _mm256_set1_epi32(u32::from_le_bytes(self.qh) as i32);
                    let (h1, h2) = (times3(h), pow(h, 2));
                    let h3 = times3(h2);
                    let qh = _mm256_blend_epi32::<0b1000_0000>(
                        _mm256_blend_epi32::<0b0100_0000>(
                            _mm256_blend_epi32::<0b0010_0000>(h, h1),
                            h2,
                        ),
                        h3,
                    );
                    _mm256_blend_epi32::<0xf0>(pow(z, 4), qh)
                }
            };
            top_trit(y)
        }
    }

    /// A row of a [`spread`] table as a `vpshufb` control.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn control(t: &[u8; 32]) -> __m256i {
        _mm256_loadu_si256(t.as_ptr() as *const __m256i)
    }

    /// [`vec_dot`] for IQ1_S, IQ1_M, TQ1_0 and TQ2_0 ([`OffsetBytes`]): per group one
    /// `maddubs` of its unsigned bytes, one `madd` with its half scales; the offsets once a
    /// super-block, one `madd` of the activations' sums. The same integers, so the scalar
    /// kernel's bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_offset_bytes<B: OffsetBytes>(w: &[B], a: &[BlockQ8K]) -> f32 {
        offset_bytes_n::<B, 1>(w, [a])[0]
    }

    /// [`vec_dot_offset_bytes`] against four tokens, each group decoded once for all four:
    /// per token the same integers and float steps, so its bits.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot_offset_bytes_x4<B: OffsetBytes>(
        w: &[B],
        a: [&[BlockQ8K]; 4],
    ) -> [f32; 4] {
        offset_bytes_n::<B, 4>(w, a)
    }

    /// The offset-bytes row kernel's body, once per instruction set, as
    /// `sign_bytes_kernel`'s.
    macro_rules! offset_bytes_kernel {
        ($name:ident, $feat:literal, $acc:path) => {
            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn $name<B: OffsetBytes, const N: usize>(
                w: &[B],
                a: [&[BlockQ8K]; N],
            ) -> [f32; N] {
                let mut sum = [0f32; N];
                for (i, b) in w.iter().enumerate() {
                    prefetch(b);
                    let q = a.map(|r| r.get_unchecked(i));
                    let mut idx = [0u16; 32];
                    let (side, scales, coef) = b.parts(&mut idx);
                    let mut acc = q.map(|q| {
                        let bsums = _mm256_loadu_si256(q.bsums.as_ptr() as *const __m256i);
                        [_mm256_madd_epi16(bsums, coef), _mm256_setzero_si256()]
                    });
                    for half in 0..2 {
                        let (side4, sc4) = (half_lanes(side, half), half_lanes(scales, half));
                        for (p, ctl) in HALF_SCALE_SPREAD.iter().enumerate() {
                            let g = 4 * half + p;
                            let u = b.unsigned(g, side4, &idx);
                            let sc = _mm256_shuffle_epi8(sc4, control(ctl));
                            let chain = if N == 1 { p % 2 } else { 0 };
                            for t in 0..N {
                                let y = _mm256_loadu_si256(
                                    q[t].qs.as_ptr().add(32 * g) as *const __m256i
                                );
                                acc[t][chain] = $acc(acc[t][chain], _mm256_maddubs_epi16(u, y), sc);
                            }
                        }
                    }
                    add_superblock(&mut sum, b, &acc, q);
                }
                sum
            }
        };
    }
    offset_bytes_kernel!(offset_bytes_n, "avx2,fma,f16c", madd_add);
    offset_bytes_kernel!(
        offset_bytes_n_avxvnni,
        "avx2,fma,f16c,avxvnni",
        madd_add_avxvnni
    );
    offset_bytes_kernel!(
        offset_bytes_n_vnni512,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        madd_add_vnni512
    );
    entry_points!(
        OffsetBytes,
        offset_bytes_n_avxvnni,
        "avx2,fma,f16c,avxvnni",
        vec_dot_offset_bytes_avxvnni,
        vec_dot_offset_bytes_x4_avxvnni
    );
    entry_points!(
        OffsetBytes,
        offset_bytes_n_vnni512,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        vec_dot_offset_bytes_vnni512,
        vec_dot_offset_bytes_x4_vnni512
    );

    /// An f16's bits as f32 by F16C, in line (exact, as `half`'s conversion, which is a call
    /// that detects the CPU each time).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn half_to_f32(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// The sum of the eight i32 lanes (exact, wrapping as i32 addition does).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }
}
