//! Eight weight rows interleaved, made once at load for the 32-value block formats (Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL) and for Q4_K, Q5_K, Q6_K and IQ4_XS.
//!
//! In the file's layout one 256-bit register holds one block of one row, so every
//! (row, token, block) needs its own convert-and-scale step (`cvtepi32_ps` + `fmadd`) on top of
//! the integer multiply, and the eight lanes of each accumulator must be summed at the end.
//! Interleaved, a register holds four consecutive quants of each of eight rows: one
//! activation word broadcast to all lanes feeds eight rows at once, the integer sums of a block
//! stay in their lanes (one lane per row), and the scale step runs once per eight rows. The
//! same packed block serves decode (one token) and prefill (up to four tokens per pass, each
//! weight block unpacked once for all of them). llama.cpp's `--repack` does the same for Q4_0
//! and Q4_K on x86; the layout here is ours.
//!
//! Layout of one packed block (the same block index of eight consecutive rows): the eight
//! f16 scales, then the eight minimums (Q4_1, Q5_1), then for Q5_0/Q5_1 the fifth bits, bit-sliced
//! (32 bytes: bit `m` of byte `i` is the fifth bit of byte `i` of nibble vector `m`, so a
//! vector's bits come out with one shift and one mask), then the quants. Quant vector `j` (32 bytes) holds elements `4j..4j+4` of
//! row 0, then of row 1, ... of row 7. For the 4- and 5-bit formats the bytes are the file's
//! packed bytes interleaved the same way, so vector `j < 4` is the low nibbles and vector
//! `j + 4` the high nibbles of the same 32 bytes (GGML keeps elements 16.. in the high nibbles).
//!
//! Per (row, token) the arithmetic is fixed: per block, the exact integer sum of the products,
//! converted to f32 and fused-multiply-added with `d_w · d_a` into the row's accumulator, then
//! (formats with an offset) the offset times the activation block's scaled sum fused in. The
//! scalar twin [`Packed::gemm_scalar`] does exactly that, so the two agree bit for bit, and a
//! row's value does not depend on how many tokens share the pass.

use std::ops::Range;

use half::f16;

use super::iq4::{self, BlockIq4Nl, BlockIq4Xs};
use super::k_quants::{scales_mins, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use super::q8::{BlockQ8, BlockQ8K};
use super::{cast_blocks, mxfp4, q4_0, q4_1, q5_0, q5_1, q8_0};
use crate::cpu::arena::{Arena, ArenaVec};
use crate::cpu::pool::ThreadPool;
use crate::cpu::SharedMut;
use ferrum_core::DType;

/// Rows per packed group.
pub const ROWS: usize = 8;

/// The instruction sets the packed kernels come in. AVX-VNNI (Intel since Alder Lake /
/// Sapphire Rapids, AMD since Zen 5) adds `vpdpbusd`, which does the work of AVX2's
/// `maddubs` + `madd` + `add` in one instruction. AVX512-VNNI with AVX512VL has the same
/// instruction in its EVEX form on the same 256-bit registers: AMD Zen 4 has it without
/// AVX-VNNI, as do Intel Ice Lake and Cascade Lake servers. The integer sums, and so the
/// results, are the same bit for bit in all four.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512Vnni,
    AvxVnni,
}

impl Isa {
    /// Whether this CPU runs it.
    pub fn runs(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => super::has_avx2() && std::is_x86_feature_detected!("avxvnni"),
            // The detection checks that the OS saves the AVX-512 state (XCR0), so a VM that
            // lists the instructions but does not enable them is not taken for one that runs
            // them.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                super::has_avx2()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every one this CPU runs, the portable one first and the preferred one last (the VEX
    /// AVX-VNNI where both VNNI forms run: the same speed, and the longer-measured one).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::AvxVnni]
            .into_iter()
            .filter(|i| i.runs())
            .collect()
    }

    /// The fastest this CPU runs, fixed at the first call. `FERRUM_AVXVNNI=0` leaves both
    /// VNNI forms out, to compare with a build of another engine that does not use them;
    /// `FERRUM_ISA=scalar|avx2|avx512-vnni|avx-vnni` picks one (if this CPU runs it), to
    /// measure one instance against another on the same machine.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            if let Ok(want) = std::env::var("FERRUM_ISA") {
                if let Some(i) = Isa::available().into_iter().find(|i| i.name() == want) {
                    return i;
                }
                eprintln!("ferrum: FERRUM_ISA={want:?} is not an instance this CPU runs; ignored");
            }
            let vnni_allowed = std::env::var("FERRUM_AVXVNNI").map_or(true, |v| v != "0");
            let mut isas = Isa::available();
            isas.retain(|&i| !matches!(i, Isa::AvxVnni | Isa::Avx512Vnni) || vnni_allowed);
            isas.last().copied().unwrap_or(Isa::Scalar)
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q8_0x8 {
    pub d: [f16; ROWS],
    /// The quants plus 128, as unsigned bytes (see `pack_q8_0`).
    pub qs: [u8; 256],
}
const _: () = assert!(std::mem::size_of::<Q8_0x8>() == 8 * 34);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q4_0x8 {
    pub d: [f16; ROWS],
    pub qs: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<Q4_0x8>() == 8 * 18);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q4_1x8 {
    pub d: [f16; ROWS],
    pub m: [f16; ROWS],
    pub qs: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<Q4_1x8>() == 8 * 20);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q5_0x8 {
    pub d: [f16; ROWS],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<Q5_0x8>() == 8 * 22);

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q5_1x8 {
    pub d: [f16; ROWS],
    pub m: [f16; ROWS],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<Q5_1x8>() == 8 * 24);

/// MXFP4's eight exponent bytes, then its nibbles interleaved as Q4_0's (16 bytes a row): the
/// file's 17 bytes a block and row, no more. The kernels look each nibble up as its doubled
/// E2M1 value plus 12 (unsigned, for `maddubs` / `vpdpbusd`; −12 · Σ a starts each token's
/// chain, so the integer sum is exactly Σ v·a) and make the scale 2^(e − 128) from the byte.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Mxfp4x8 {
    pub e: [u8; ROWS],
    pub qs: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<Mxfp4x8>() == 8 * 17);

/// IQ4_NL: Q4_0's layout (eight f16 scales, the nibbles interleaved), each nibble a code for
/// one of [`iq4::VALUES`]. The kernels look the codes up as the level plus 128 (unsigned) and
/// then run Q8_0's arithmetic on them.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Iq4Nlx8 {
    pub d: [f16; ROWS],
    pub qs: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<Iq4Nlx8>() == 8 * 18);

/// IQ4_XS, eight rows of one 256-value super-block: the f16 scales, the signed 6-bit
/// sub-block scales unpacked to bytes (`sc[sub-block][row]`, `ls − 32`) and the nibbles, each
/// 32-value sub-block's 16 bytes a row interleaved as IQ4_NL's (`qs[128ib + 32v + 4r + b]` is
/// byte `16ib + 4v + b` of row `r`): 1.5% more bytes than the file.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Iq4Xsx8 {
    pub d: [f16; ROWS],
    pub sc: [[i8; ROWS]; 8],
    pub qs: [u8; 1024],
}
const _: () = assert!(std::mem::size_of::<Iq4Xsx8>() == 8 * 136 + 16);

impl Iq4Xsx8 {
    /// Level of value `e` (0..256) of row `r`.
    fn level(&self, r: usize, e: usize) -> i32 {
        let (ib, l) = (e / 32, e % 32);
        let byte = self.qs[128 * ib + at(r, l % 16)];
        iq4::VALUES[(if l >= 16 { byte >> 4 } else { byte & 0x0f }) as usize] as i32
    }
}

/// IQ4_NL's and IQ4_XS's levels plus 128, as unsigned bytes (what `vpdpbusd` and Q8_0's
/// kernels take).
#[cfg(target_arch = "x86_64")]
const IQ4_PLUS_128: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (iq4::VALUES[i] as i16 + 128) as u8;
        i += 1;
    }
    t
};

fn pack_iq4xs(b: [&BlockIq4Xs; ROWS]) -> Iq4Xsx8 {
    Iq4Xsx8 {
        d: b.map(|x| x.d),
        sc: std::array::from_fn(|ib| b.map(|x| x.scale(ib) as i8)),
        qs: interleave(b.map(|x| &x.qs)),
    }
}

impl Mxfp4x8 {
    /// Element `e`'s doubled E2M1 value in row `r`.
    fn value(&self, r: usize, e: usize) -> i32 {
        mxfp4::VALUES[nibble(&self.qs, r, e) as usize] as i32
    }
}

/// Q4_K, eight rows of one 256-value super-block. The 6-bit scales and minimums are unpacked
/// to bytes, `[sub-block][row]` (2.8% more bytes than the file, for no bit twiddling in the
/// kernel). Chunk `c` (values `64c..64c+64`, 32 packed bytes per row) is interleaved like the
/// 32-value formats: `qs[256c + 32v + 4r + b]` is byte `4v + b` of row `r`'s chunk, whose low
/// nibble is value `64c + 4v + b` (sub-block `2c`) and high nibble value `64c + 32 + 4v + b`
/// (sub-block `2c + 1`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q4Kx8 {
    pub d: [f16; ROWS],
    pub dmin: [f16; ROWS],
    pub sc: [[u8; ROWS]; 8],
    pub mn: [[u8; ROWS]; 8],
    pub qs: [u8; 1024],
}
const _: () = assert!(std::mem::size_of::<Q4Kx8>() == 8 * 144 + 32);

impl Q4Kx8 {
    /// Quant of value `e` (0..256) of row `r`.
    fn quant(&self, r: usize, e: usize) -> i32 {
        let (c, l) = (e / 64, e % 64);
        let byte = self.qs[at(r, 32 * c + l % 32)];
        (if l >= 32 { byte >> 4 } else { byte & 0x0f }) as i32
    }
}

/// Q5_K: Q4_K's layout for the low four bits, and the fifth bits in the file's 32 bytes per
/// row interleaved the same way (`qh[32v + 4r + b]` is byte `4v + b` of row `r`): bit `2c` of
/// it belongs to value `64c + 4v + b` (the low nibble of chunk `c`'s vector `v`), bit `2c + 1`
/// to value `64c + 32 + 4v + b` (the high nibble).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q5Kx8 {
    pub k4: Q4Kx8,
    pub qh: [u8; 256],
}
const _: () = assert!(std::mem::size_of::<Q5Kx8>() == 8 * 176 + 32);

/// The super-block layouts with Q4_K's scales and minimums: Q4_K and Q5_K.
pub trait K4x8: Copy + Send + Sync + 'static {
    fn k4(&self) -> &Q4Kx8;
    /// Quant of value `e` (0..256) of row `r` (0..8), fifth bit included for Q5_K.
    fn quant(&self, r: usize, e: usize) -> i32;
    /// The fifth bits, for Q5_K.
    fn qh(&self) -> Option<&[u8; 256]>;
}

impl K4x8 for Q4Kx8 {
    fn k4(&self) -> &Q4Kx8 {
        self
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        Q4Kx8::quant(self, r, e)
    }
    fn qh(&self) -> Option<&[u8; 256]> {
        None
    }
}

impl K4x8 for Q5Kx8 {
    fn k4(&self) -> &Q4Kx8 {
        &self.k4
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        let (c, l) = (e / 64, e % 64);
        let h = self.qh[at(r, l % 32)] >> (2 * c + usize::from(l >= 32));
        self.k4.quant(r, e) | ((h & 1) as i32) << 4
    }
    fn qh(&self) -> Option<&[u8; 256]> {
        Some(&self.qh)
    }
}

/// Q6_K, eight rows of one super-block, the file's bytes interleaved four at a time:
/// `ql[32w + 4r + b]` is byte `4w + b` of row `r`'s 128 low-bit bytes, `qh[32w + 4r + b]` byte
/// `4w + b` of its 64 high-bit bytes; `sc[j][r]` the signed scale of sub-block `j` (16 values).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Q6Kx8 {
    pub d: [f16; ROWS],
    pub sc: [[i8; ROWS]; 16],
    pub ql: [u8; 1024],
    pub qh: [u8; 512],
}
const _: () = assert!(std::mem::size_of::<Q6Kx8>() == 8 * 210);

impl Q6Kx8 {
    /// The 6-bit quant (0..64, before the −32 offset) of value `e` of row `r`. GGML's order:
    /// in each half `n` of 128 values, value `32k + i` takes the low (k < 2) or high nibble of
    /// low-bit byte `64n + 32·(k % 2) + i` and bits `2k, 2k+1` of high-bit byte `32n + i`.
    fn quant(&self, r: usize, e: usize) -> i32 {
        let (n, k, i) = (e / 128, e % 128 / 32, e % 32);
        let l = self.ql[at(r, 64 * n + 32 * (k % 2) + i)];
        let h = self.qh[at(r, 32 * n + i)];
        let low = if k < 2 { l & 0x0f } else { l >> 4 };
        (low | ((h >> (2 * k)) & 3) << 4) as i32
    }
}

fn pack_q6k(b: [&BlockQ6K; ROWS]) -> Q6Kx8 {
    Q6Kx8 {
        d: b.map(|x| x.d),
        sc: std::array::from_fn(|j| b.map(|x| x.scales[j])),
        ql: interleave(b.map(|x| &x.ql)),
        qh: interleave(b.map(|x| &x.qh)),
    }
}

fn pack_q5k(b: [&BlockQ5K; ROWS]) -> Q5Kx8 {
    Q5Kx8 {
        k4: pack_k4(b.map(|x| (&x.scales, x.d, x.dmin, &x.qs))),
        qh: interleave(b.map(|x| &x.qh)),
    }
}

fn pack_q4k(b: [&BlockQ4K; ROWS]) -> Q4Kx8 {
    pack_k4(b.map(|x| (&x.scales, x.d, x.dmin, &x.qs)))
}

/// Q4_K's layout from eight rows' packed scales and minimums, d, dmin and nibbles (the part
/// Q4_K and Q5_K blocks share).
fn pack_k4(b: [(&[u8; 12], f16, f16, &[u8; 128]); ROWS]) -> Q4Kx8 {
    let unpacked = b.map(|(scales, ..)| scales_mins(scales));
    Q4Kx8 {
        d: b.map(|(_, d, _, _)| d),
        dmin: b.map(|(_, _, dmin, _)| dmin),
        sc: std::array::from_fn(|j| unpacked.map(|(sc, _)| sc[j])),
        mn: std::array::from_fn(|j| unpacked.map(|(_, mn)| mn[j])),
        qs: interleave(b.map(|(.., qs)| qs)),
    }
}

/// What the kernels need to know of a packed format.
pub trait BlockX8: Copy + Send + Sync + 'static {
    /// A row's offset term: `None` (Q8_0), a constant times the scale (Q4_0: −8, Q5_0: −16),
    /// or a stored minimum (Q4_1, Q5_1).
    const OFFSET: Offset;
    fn d(&self) -> &[f16; ROWS];
    /// The minimums, for [`Offset::Min`] formats.
    fn m(&self) -> &[f16; ROWS] {
        self.d()
    }
    /// The stored quant of element `e` of row `r` (before any offset).
    fn quant(&self, r: usize, e: usize) -> i32;
}

#[derive(Clone, Copy, PartialEq)]
pub enum Offset {
    None,
    Scaled(f32),
    Min,
}

/// Position of element `e` (0..32) of row `r` in the packed quant bytes, and whether it sits
/// in the high nibble (4- and 5-bit formats: 16 bytes per row).
#[inline]
fn nibble_at(r: usize, e: usize) -> (usize, bool) {
    (at(r, e % 16), e >= 16)
}

#[inline]
fn nibble(qs: &[u8; 128], r: usize, e: usize) -> i32 {
    let (i, high) = nibble_at(r, e);
    (if high { qs[i] >> 4 } else { qs[i] & 0x0f }) as i32
}

/// Element `e`'s fifth bit of row `r`: byte `4r + e % 4`, bit `e / 4` (the nibble vector).
#[inline]
fn fifth_bit(qh: &[u8; 32], r: usize, e: usize) -> i32 {
    (((qh[4 * r + e % 4] >> (e / 4)) & 1) << 4) as i32
}

impl BlockX8 for Q8_0x8 {
    const OFFSET: Offset = Offset::None;
    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        self.qs[at(r, e)] as i32 - 128
    }
}

impl BlockX8 for Q4_0x8 {
    const OFFSET: Offset = Offset::Scaled(-8.0);
    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        nibble(&self.qs, r, e)
    }
}

impl BlockX8 for Iq4Nlx8 {
    const OFFSET: Offset = Offset::None;
    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        iq4::VALUES[nibble(&self.qs, r, e) as usize] as i32
    }
}

impl BlockX8 for Q4_1x8 {
    const OFFSET: Offset = Offset::Min;
    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }
    fn m(&self) -> &[f16; ROWS] {
        &self.m
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        nibble(&self.qs, r, e)
    }
}

impl BlockX8 for Q5_0x8 {
    const OFFSET: Offset = Offset::Scaled(-16.0);
    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        nibble(&self.qs, r, e) | fifth_bit(&self.qh, r, e)
    }
}

impl BlockX8 for Q5_1x8 {
    const OFFSET: Offset = Offset::Min;
    fn d(&self) -> &[f16; ROWS] {
        &self.d
    }
    fn m(&self) -> &[f16; ROWS] {
        &self.m
    }
    fn quant(&self, r: usize, e: usize) -> i32 {
        nibble(&self.qs, r, e) | fifth_bit(&self.qh, r, e)
    }
}

/// Where byte `i` of row `r` goes when eight rows are interleaved four bytes at a time (see
/// the module docs): every packed layout's quant bytes follow this one rule.
#[inline]
fn at(r: usize, i: usize) -> usize {
    32 * (i / 4) + 4 * r + i % 4
}

/// Eight rows of `N` bytes each, interleaved by [`at`] into `M = 8N`.
fn interleave<T: Copy + Default, const N: usize, const M: usize>(rows: [&[T; N]; ROWS]) -> [T; M] {
    const { assert!(N * ROWS == M) };
    let mut out = [T::default(); M];
    for (r, row) in rows.iter().enumerate() {
        for (i, &byte) in row.iter().enumerate() {
            out[at(r, i)] = byte;
        }
    }
    out
}

/// The fifth bits of eight rows, bit-sliced as the kernels read them (see [`fifth_bit`]).
fn interleave_high_bits(qh: [u32; ROWS]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (r, &bits) in qh.iter().enumerate() {
        for e in 0..32 {
            out[4 * r + e % 4] |= (((bits >> e) & 1) as u8) << (e / 4);
        }
    }
    out
}

/// Stored plus 128 (the sign bit flipped), so AVX-VNNI's `vpdpbusd`, whose left operand is
/// unsigned, takes the weights as they are: `Σ (w + 128)·a − 128·Σ a` is `Σ w·a` exactly, and
/// the correction is each token's chain's starting value (`BlockQ8::offset`), where moving the
/// weights' signs onto the activations cost eight instructions (one per vector, every token).
fn pack_q8_0(b: [&q8_0::BlockQ8_0; ROWS]) -> Q8_0x8 {
    let qs: [i8; 256] = interleave(b.map(|x| &x.qs));
    Q8_0x8 {
        d: b.map(|x| x.d),
        qs: qs.map(|q| q as u8 ^ 0x80),
    }
}

fn pack_q4_0(b: [&q4_0::BlockQ4_0; ROWS]) -> Q4_0x8 {
    Q4_0x8 {
        d: b.map(|x| x.d),
        qs: interleave(b.map(|x| &x.qs)),
    }
}

fn pack_iq4nl(b: [&BlockIq4Nl; ROWS]) -> Iq4Nlx8 {
    Iq4Nlx8 {
        d: b.map(|x| x.d),
        qs: interleave(b.map(|x| &x.qs)),
    }
}

fn pack_mxfp4(b: [&mxfp4::BlockMxfp4; ROWS]) -> Mxfp4x8 {
    Mxfp4x8 {
        e: b.map(|x| x.e),
        qs: interleave(b.map(|x| &x.qs)),
    }
}

fn pack_q4_1(b: [&q4_1::BlockQ4_1; ROWS]) -> Q4_1x8 {
    Q4_1x8 {
        d: b.map(|x| x.d),
        m: b.map(|x| x.m),
        qs: interleave(b.map(|x| &x.qs)),
    }
}

fn pack_q5_0(b: [&q5_0::BlockQ5_0; ROWS]) -> Q5_0x8 {
    Q5_0x8 {
        d: b.map(|x| x.d),
        qh: interleave_high_bits(b.map(|x| u32::from_le_bytes(x.qh))),
        qs: interleave(b.map(|x| &x.qs)),
    }
}

fn pack_q5_1(b: [&q5_1::BlockQ5_1; ROWS]) -> Q5_1x8 {
    Q5_1x8 {
        d: b.map(|x| x.d),
        m: b.map(|x| x.m),
        qh: interleave_high_bits(b.map(|x| u32::from_le_bytes(x.qh))),
        qs: interleave(b.map(|x| &x.qs)),
    }
}

/// Packs the first `groups · 8` rows of a matrix: group `g`'s blocks are
/// `out[g · per_row .. (g + 1) · per_row]`. The groups are split into tasks of about a
/// megabyte of source run on `pool` (most of the time goes in first touches of the new
/// pages, which the threads then take in parallel); `done(range)` hears once per task that
/// source bytes `range` are packed.
fn pack_all<S: Copy + Sync, P: Copy + Send>(
    bytes: &[u8],
    rows: usize,
    per_row: usize,
    pack: fn([&S; ROWS]) -> P,
    pool: &ThreadPool,
    arena: &Arena,
    done: &(dyn Fn(Range<usize>) + Sync),
) -> Option<ArenaVec<P>> {
    let src = cast_blocks::<S>(bytes)?;
    if src.len() != rows * per_row {
        return None;
    }
    let groups = rows / ROWS;
    let total = groups * per_row;
    let group_bytes = ROWS * per_row * std::mem::size_of::<S>();
    let per_task = ((1 << 20) / group_bytes.max(1)).max(1);
    let fill = |p: *mut P| {
        let dst = SharedMut(p);
        pool.run(groups.div_ceil(per_task), &|task| {
            let gs = task * per_task..((task + 1) * per_task).min(groups);
            for g in gs.clone() {
                for i in 0..per_row {
                    let b = pack(std::array::from_fn(|r| &src[(g * ROWS + r) * per_row + i]));
                    // SAFETY: g · per_row + i < total; each (g, i) belongs to one task.
                    unsafe { dst.write(g * per_row + i, b) };
                }
            }
            done(gs.start * group_bytes..gs.end * group_bytes);
        });
    };
    // SAFETY: `run` returns after every task ran once, so `fill` writes all `total`
    // elements; a task that panics makes `run` panic, and no half-written array is returned.
    let out = unsafe { ArenaVec::from_fn(arena, total, fill) };
    Some(out)
}

/// An activation format of the packed kernels, Q8 for the 32-value layouts and Q8_K for the
/// K-quants: one name per operation, so that the matmul tasks and the AVX2 two-group
/// wrappers are written once for both.
pub trait PackedAct: Sized {
    /// Whether `p`'s kernels take this format.
    fn takes(p: &Packed) -> bool;

    /// These activations as Q8_K blocks, if they are (for the codebook formats' decoded-row
    /// prefill, which takes only Q8_K).
    fn as_q8k(a: &[Self]) -> Option<&[BlockQ8K]>;

    /// [`Packed::gemm`] or [`Packed::gemm_k`].
    fn gemm(p: &Packed, group: usize, acts: &[&[Self]], out: &mut [[f32; ROWS]]);

    /// [`Packed::gemm_on`] or [`Packed::gemm_k_on`].
    fn gemm_on(p: &Packed, isa: Isa, group: usize, acts: &[&[Self]], out: &mut [[f32; ROWS]]);

    /// [`Packed::pairs`] or [`Packed::pairs_k`].
    fn pairs(p: &Packed, n: usize) -> bool;

    /// Whether `p`'s layout has an AVX2 pair kernel for this format (Q8_0, Q4_K).
    fn has_pair_avx2(p: &Packed) -> bool;

    /// [`Packed::gemm2`] or [`Packed::gemm_k2`].
    fn gemm2(
        p: &Packed,
        group: usize,
        acts: &[&[Self]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    );

    /// [`Packed::gemm2`] or [`Packed::gemm_k2`] on the 512-bit kernels wherever the layout has
    /// one (one group after the other where not).
    ///
    /// # Safety
    /// The CPU runs AVX-512 F/BW/VL/VNNI.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemm2_wide(
        p: &Packed,
        group: usize,
        acts: &[&[Self]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    );

    /// Groups `group` and `group + 1` of `p` against four tokens on the AVX2 pair kernel of
    /// `p`'s layout (Q8_0, Q4_K); `false`, nothing done, for a layout without one.
    ///
    /// # Safety
    /// The CPU runs AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn pair_avx2(
        p: &Packed,
        group: usize,
        acts: [&[Self]; 4],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) -> bool;
}

/// [`PackedAct`] for an activation format: its `Packed` methods, whether a layout takes it,
/// and the one layout with an AVX2 pair kernel and that kernel.
macro_rules! packed_act {
    ($act:ty, $takes:expr, $as_q8k:expr, $gemm:ident, $gemm_on:ident, $pairs:ident,
     $gemm2:ident, $wide:ident, $paired:ident, $pair:ident) => {
        impl PackedAct for $act {
            fn takes(p: &Packed) -> bool {
                $takes(p)
            }
            fn as_q8k(a: &[Self]) -> Option<&[BlockQ8K]> {
                $as_q8k(a)
            }
            fn gemm(p: &Packed, group: usize, acts: &[&[Self]], out: &mut [[f32; ROWS]]) {
                p.$gemm(group, acts, out)
            }
            fn gemm_on(
                p: &Packed,
                isa: Isa,
                group: usize,
                acts: &[&[Self]],
                out: &mut [[f32; ROWS]],
            ) {
                p.$gemm_on(isa, group, acts, out)
            }
            fn pairs(p: &Packed, n: usize) -> bool {
                p.$pairs(n)
            }
            fn has_pair_avx2(p: &Packed) -> bool {
                matches!(p, Packed::$paired(..))
            }
            fn gemm2(
                p: &Packed,
                group: usize,
                acts: &[&[Self]],
                out_a: &mut [[f32; ROWS]],
                out_b: &mut [[f32; ROWS]],
            ) {
                p.$gemm2(group, acts, out_a, out_b)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn gemm2_wide(
                p: &Packed,
                group: usize,
                acts: &[&[Self]],
                out_a: &mut [[f32; ROWS]],
                out_b: &mut [[f32; ROWS]],
            ) {
                // SAFETY: the CPU's features (the contract).
                unsafe { p.$wide(group, acts, out_a, out_b) }
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn pair_avx2(
                p: &Packed,
                group: usize,
                acts: [&[Self]; 4],
                out_a: &mut [[f32; ROWS]],
                out_b: &mut [[f32; ROWS]],
            ) -> bool {
                let Packed::$paired(v, per_row) = p else {
                    return false;
                };
                let (wa, wb) = two(v, group, *per_row);
                assert!(
                    acts.iter().all(|a| a.len() >= *per_row)
                        && out_a.len() >= 4
                        && out_b.len() >= 4
                );
                // SAFETY: the CPU runs AVX2 (the contract); lengths checked just above.
                unsafe { avx2::$pair(wa, wb, acts, out_a, out_b) };
                true
            }
        }
    };
}

packed_act!(
    BlockQ8,
    |p: &Packed| !p.is_k_quant(),
    |_| None,
    gemm,
    gemm_on,
    pairs,
    gemm2,
    gemm2_wide,
    Q8_0,
    tile_q8_0_pair
);
packed_act!(
    BlockQ8K,
    Packed::is_k_quant,
    Some,
    gemm_k,
    gemm_k_on,
    pairs_k,
    gemm_k2,
    gemm_k2_wide,
    Q4K,
    tile_q4k_pair
);

/// Groups `group` and `group + 1` of a packed matrix of `p` blocks a row group.
#[cfg(target_arch = "x86_64")]
fn two<T>(v: &[T], group: usize, p: usize) -> (&[T], &[T]) {
    (
        &v[group * p..(group + 1) * p],
        &v[(group + 1) * p..(group + 2) * p],
    )
}

/// The packed groups of a weight matrix (its first `rows / 8 · 8` rows; the rest stay in
/// the file's layout).
pub enum Packed {
    Q8_0(ArenaVec<Q8_0x8>, usize),
    Q4_0(ArenaVec<Q4_0x8>, usize),
    Q4_1(ArenaVec<Q4_1x8>, usize),
    Q5_0(ArenaVec<Q5_0x8>, usize),
    Q5_1(ArenaVec<Q5_1x8>, usize),
    Iq4Nl(ArenaVec<Iq4Nlx8>, usize),
    Q4K(ArenaVec<Q4Kx8>, usize),
    Q5K(ArenaVec<Q5Kx8>, usize),
    Q6K(ArenaVec<Q6Kx8>, usize),
    Mxfp4(ArenaVec<Mxfp4x8>, usize),
    Iq4Xs(ArenaVec<Iq4Xsx8>, usize),
}

/// Applies `$body` to the variant's block vector and blocks per row.
macro_rules! with_blocks {
    ($p:expr, |$v:ident, $per_row:ident| $body:expr) => {
        match $p {
            Packed::Q8_0($v, $per_row) => $body,
            Packed::Q4_0($v, $per_row) => $body,
            Packed::Q4_1($v, $per_row) => $body,
            Packed::Q5_0($v, $per_row) => $body,
            Packed::Q5_1($v, $per_row) => $body,
            Packed::Iq4Nl($v, $per_row) => $body,
            Packed::Q4K(..)
            | Packed::Q5K(..)
            | Packed::Q6K(..)
            | Packed::Iq4Xs(..)
            | Packed::Mxfp4(..) => {
                unreachable!("K-quants, IQ4_XS and MXFP4 have their own arms")
            }
        }
    };
}

impl Packed {
    /// Packs a `[rows, cols]` matrix stored as `bytes` on `pool`'s threads into `arena`;
    /// `None` for other formats, for fewer than eight rows, or bytes that are not whole
    /// aligned blocks. `done(range)` is told as the packing goes that source bytes `range` are
    /// copied (a caller may then drop them from memory, so that the matrix is never resident
    /// twice).
    pub fn new(
        dtype: DType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        pool: &ThreadPool,
        arena: &Arena,
        done: &(dyn Fn(Range<usize>) + Sync),
    ) -> Option<Packed> {
        if rows < ROWS || !cols.is_multiple_of(32) {
            return None;
        }
        // `per_row` blocks per row; the pack function fixes the source and packed types.
        macro_rules! packed {
            ($variant:ident, $pack:expr, $per_row:expr) => {
                Packed::$variant(
                    pack_all(bytes, rows, $per_row, $pack, pool, arena, done)?,
                    $per_row,
                )
            };
        }
        if matches!(dtype, DType::Q4K | DType::Q5K | DType::Q6K | DType::Iq4Xs) {
            if !cols.is_multiple_of(QK_K) {
                return None;
            }
            return Some(match dtype {
                DType::Q4K => packed!(Q4K, pack_q4k, cols / QK_K),
                DType::Q5K => packed!(Q5K, pack_q5k, cols / QK_K),
                DType::Iq4Xs => packed!(Iq4Xs, pack_iq4xs, cols / QK_K),
                _ => packed!(Q6K, pack_q6k, cols / QK_K),
            });
        }
        let per_row = cols / 32;
        Some(match dtype {
            DType::Q8_0 => packed!(Q8_0, pack_q8_0, per_row),
            DType::Q4_0 => packed!(Q4_0, pack_q4_0, per_row),
            DType::Q4_1 => packed!(Q4_1, pack_q4_1, per_row),
            DType::Q5_0 => packed!(Q5_0, pack_q5_0, per_row),
            DType::Q5_1 => packed!(Q5_1, pack_q5_1, per_row),
            DType::Mxfp4 => packed!(Mxfp4, pack_mxfp4, per_row),
            DType::Iq4Nl => packed!(Iq4Nl, pack_iq4nl, per_row),
            _ => return None,
        })
    }

    /// Rows covered by the packed groups (a multiple of 8).
    pub fn rows(&self) -> usize {
        match self {
            Packed::Q4K(v, per_row) => v.len() / per_row * ROWS,
            Packed::Q5K(v, per_row) => v.len() / per_row * ROWS,
            Packed::Q6K(v, per_row) => v.len() / per_row * ROWS,
            Packed::Mxfp4(v, per_row) => v.len() / per_row * ROWS,
            Packed::Iq4Xs(v, per_row) => v.len() / per_row * ROWS,
            p => with_blocks!(p, |v, per_row| v.len() / per_row * ROWS),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Packed::Q4K(v, _) => std::mem::size_of_val(&v[..]),
            Packed::Q5K(v, _) => std::mem::size_of_val(&v[..]),
            Packed::Q6K(v, _) => std::mem::size_of_val(&v[..]),
            Packed::Mxfp4(v, _) => std::mem::size_of_val(&v[..]),
            Packed::Iq4Xs(v, _) => std::mem::size_of_val(&v[..]),
            p => with_blocks!(p, |v, _per_row| std::mem::size_of_val(&v[..])),
        }
    }

    /// Whether the kernels take Q8_K activations ([`gemm_k`](Self::gemm_k)) rather than Q8.
    pub fn is_k_quant(&self) -> bool {
        matches!(
            self,
            Packed::Q4K(..) | Packed::Q5K(..) | Packed::Q6K(..) | Packed::Iq4Xs(..)
        )
    }

    /// Row `j` (below [`rows`](Self::rows)) as f32 into `out` (one row long): bit for bit
    /// what the file layout's dequantiser gives, so an embedding lookup can read a packed
    /// table.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        fn k4_row<B: K4x8>(v: &[B], per_row: usize, j: usize, out: &mut [f32]) {
            let (g, r) = (j / ROWS, j % ROWS);
            for (b, y) in v[g * per_row..(g + 1) * per_row]
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                let k = b.k4();
                let (d, dmin) = (k.d[r].to_f32(), k.dmin[r].to_f32());
                for (e, y) in y.iter_mut().enumerate() {
                    let (dl, ml) = (d * k.sc[e / 32][r] as f32, dmin * k.mn[e / 32][r] as f32);
                    *y = dl * b.quant(r, e) as f32 - ml;
                }
            }
        }
        match self {
            Packed::Q4K(v, per_row) => return k4_row(v, *per_row, j, out),
            Packed::Q5K(v, per_row) => return k4_row(v, *per_row, j, out),
            _ => {}
        }
        if let Packed::Mxfp4(v, per_row) = self {
            let (g, r) = (j / ROWS, j % ROWS);
            for (b, y) in v[g * per_row..(g + 1) * per_row]
                .iter()
                .zip(out.chunks_exact_mut(32))
            {
                let d = mxfp4::half_scale(b.e[r]);
                for (e, y) in y.iter_mut().enumerate() {
                    *y = b.value(r, e) as f32 * d;
                }
            }
            return;
        }
        if let Packed::Iq4Xs(v, per_row) = self {
            let (g, r) = (j / ROWS, j % ROWS);
            for (b, y) in v[g * per_row..(g + 1) * per_row]
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                let d = b.d[r].to_f32();
                for (e, y) in y.iter_mut().enumerate() {
                    *y = d * b.sc[e / 32][r] as f32 * b.level(r, e) as f32;
                }
            }
            return;
        }
        if let Packed::Q6K(v, per_row) = self {
            let (g, r) = (j / ROWS, j % ROWS);
            for (b, y) in v[g * per_row..(g + 1) * per_row]
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                let d = b.d[r].to_f32();
                for (e, y) in y.iter_mut().enumerate() {
                    *y = d * b.sc[e / 16][r] as f32 * (b.quant(r, e) - 32) as f32;
                }
            }
            return;
        }
        with_blocks!(self, |v, per_row| {
            let (g, r) = (j / ROWS, j % ROWS);
            for (b, y) in v[g * per_row..(g + 1) * per_row]
                .iter()
                .zip(out.chunks_exact_mut(32))
            {
                dequantize_block(b, r, y)
            }
        })
    }

    /// Rows `8g..8g+8` against each activation row: `out[t][r]` is row `8g + r` · token `t`.
    /// Uses the fastest kernels the CPU runs ([`Isa::best`]; all give the same results).
    ///
    /// # Panics
    /// If `group` is out of range, an activation row is shorter than a weight row, or `out`
    /// is shorter than `acts`.
    pub fn gemm(&self, group: usize, acts: &[&[BlockQ8]], out: &mut [[f32; ROWS]]) {
        // SAFETY: `best` only ever names an instruction set the CPU runs, so no check per
        // call here (a matmul calls this once per group of eight rows).
        unsafe { self.gemm_isa(Isa::best(), group, acts, out) }
    }

    /// [`gemm`](Self::gemm) with the kernels of `isa` (tests hold each to the scalar twin).
    ///
    /// # Panics
    /// As `gemm`, or if this CPU does not run `isa`.
    pub fn gemm_on(&self, isa: Isa, group: usize, acts: &[&[BlockQ8]], out: &mut [[f32; ROWS]]) {
        assert!(isa.runs(), "this CPU does not run {}", isa.name());
        // SAFETY: checked just above.
        unsafe { self.gemm_isa(isa, group, acts, out) }
    }

    /// `gemm_on` without the check.
    ///
    /// # Safety
    /// The CPU runs `isa`.
    unsafe fn gemm_isa(
        &self,
        isa: Isa,
        group: usize,
        acts: &[&[BlockQ8]],
        out: &mut [[f32; ROWS]],
    ) {
        assert!(!self.is_k_quant(), "Q4_K takes Q8_K activations (gemm_k)");
        if let Packed::Mxfp4(v, per_row) = self {
            let w = &v[group * per_row..(group + 1) * per_row];
            assert!(acts.iter().all(|a| a.len() >= *per_row) && out.len() >= acts.len());
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU runs `isa` (the contract); lengths checked just above.
            unsafe {
                match isa {
                    Isa::AvxVnni => return vnni::gemm(w, acts, out),
                    Isa::Avx512Vnni => return vnni512::gemm(w, acts, out),
                    Isa::Avx2 => return avx2::gemm(w, acts, out),
                    Isa::Scalar => {}
                }
            }
            return gemm_mxfp4_scalar(w, acts, out);
        }
        #[cfg(target_arch = "x86_64")]
        {
            if isa != Isa::Scalar {
                return with_blocks!(self, |v, per_row| {
                    let w = &v[group * per_row..(group + 1) * per_row];
                    assert!(acts.iter().all(|a| a.len() >= *per_row) && out.len() >= acts.len());
                    // SAFETY: the CPU runs `isa` (the contract); lengths checked just above.
                    unsafe {
                        match isa {
                            Isa::AvxVnni => vnni::gemm(w, acts, out),
                            Isa::Avx512Vnni => vnni512::gemm(w, acts, out),
                            _ => avx2::gemm(w, acts, out),
                        }
                    }
                });
            }
        }
        self.gemm_scalar(group, acts, out)
    }

    /// Groups `group` and `group + 1` against each activation row, into `out_a` and `out_b`:
    /// [`gemm`](Self::gemm) twice, or on an AVX2-only CPU the Q8_0 pair kernel for four
    /// tokens (`tile_q8_0_pair`: the same bits).
    ///
    /// # Panics
    /// As `gemm`, for either group.
    pub fn gemm2(
        &self,
        group: usize,
        acts: &[&[BlockQ8]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        #[cfg(target_arch = "x86_64")]
        if matches!(self, Packed::Q8_0(..)) && wide_k() {
            // SAFETY: `wide_k` checked the CPU's features.
            return unsafe { self.gemm2_wide(group, acts, out_a, out_b) };
        }
        self.gemm2_256(group, acts, out_a, out_b)
    }

    /// Whether [`gemm2`](Self::gemm2) has a kernel for two groups at once on this CPU that
    /// pays for a pass of `n` tokens: the 512-bit Q8_0 kernel always (as the K-quants',
    /// [`pairs_k`](Self::pairs_k)); the AVX2 Q8_0 pair where a group's weights serve several
    /// four-token passes.
    pub fn pairs(&self, n: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(self, Packed::Q8_0(..)) && wide_k() {
            return true;
        }
        self.pairs_avx2::<BlockQ8>(n)
    }

    /// Whether a matmul pass over this layout runs two packed groups at a time on this CPU's
    /// 512-bit kernels ([`gemm_k2`](Self::gemm_k2) for the K-quants, [`gemm2`](Self::gemm2)
    /// for Q8_0), one token included.
    pub fn pairs_wide(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            wide_k() && (self.is_k_quant() || matches!(self, Packed::Q8_0(..)))
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// [`gemm2`](Self::gemm2) or [`gemm_k2`](Self::gemm_k2) on the 512-bit kernels wherever
    /// they exist (Q8_0; Q4_K, Q6_K, IQ4_XS; other layouts one group after the other), for
    /// tests on CPUs that run them.
    ///
    /// # Panics
    /// As `gemm2`, or if this CPU lacks AVX-512 F/BW/VL/VNNI.
    pub fn gemm2_wide_on<A: PackedAct>(
        &self,
        group: usize,
        acts: &[&[A]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            assert!(has_wide(), "this CPU does not run the 512-bit kernels");
            // SAFETY: checked just above.
            unsafe { A::gemm2_wide(self, group, acts, out_a, out_b) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        panic!("no 512-bit kernels on this architecture");
    }

    /// # Safety
    /// The CPU runs AVX-512 F/BW/VL/VNNI.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemm2_wide(
        &self,
        group: usize,
        acts: &[&[BlockQ8]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        let Packed::Q8_0(v, p) = self else {
            // Other layouts have no 512-bit kernel: the 256-bit one twice.
            self.gemm(group, acts, out_a);
            return self.gemm(group + 1, acts, out_b);
        };
        assert!(acts.iter().all(|x| x.len() >= *p));
        assert!(out_a.len() >= acts.len() && out_b.len() >= acts.len());
        let (a, b) = two(v, group, *p);
        // SAFETY: the CPU's features (the contract); lengths checked just above (slicing
        // checks the groups).
        unsafe {
            wide::gemm2(
                a,
                b,
                acts,
                out_a,
                out_b,
                wide::tile_q8_0::<1>,
                wide::tile_q8_0::<2>,
                wide::tile_q8_0::<3>,
                wide::tile_q8_0::<4>,
                None,
            )
        }
    }

    /// Two groups on the 256-bit kernels: the AVX2 pair where the CPU has nothing better
    /// ([`gemm2_avx2`](Self::gemm2_avx2)), else one group after the other.
    fn gemm2_256<A: PackedAct>(
        &self,
        group: usize,
        acts: &[&[A]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        #[cfg(target_arch = "x86_64")]
        if Isa::best() == Isa::Avx2 {
            // SAFETY: `best` only names an instruction set the CPU runs.
            return unsafe { self.gemm2_avx2(group, acts, out_a, out_b) };
        }
        A::gemm(self, group, acts, out_a);
        A::gemm(self, group + 1, acts, out_b);
    }

    /// Whether an AVX2 pair kernel runs for this layout and pays for passes of `n` tokens:
    /// only where a group's weights serve several four-token passes (from memory the Q4_K
    /// pair is slower than two single-group passes: see `tile_q4k_pair`), and only where
    /// AVX2 is the best the CPU has (the VNNI instances have `vpdpbusd`).
    fn pairs_avx2<A: PackedAct>(&self, n: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            A::has_pair_avx2(self) && n > 4 && Isa::best() == Isa::Avx2
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = n;
            false
        }
    }

    /// [`gemm`](Self::gemm) for the K-quant layouts, against Q8_K activations.
    ///
    /// # Panics
    /// On a 32-value layout, or as `gemm`.
    pub fn gemm_k(&self, group: usize, acts: &[&[BlockQ8K]], out: &mut [[f32; ROWS]]) {
        // SAFETY: as in `gemm`.
        unsafe { self.gemm_k_isa(Isa::best(), group, acts, out) }
    }

    /// [`gemm_k`](Self::gemm_k) with the kernels of `isa`.
    ///
    /// # Panics
    /// As `gemm_k`, or if this CPU does not run `isa`.
    pub fn gemm_k_on(&self, isa: Isa, group: usize, acts: &[&[BlockQ8K]], out: &mut [[f32; ROWS]]) {
        assert!(isa.runs(), "this CPU does not run {}", isa.name());
        // SAFETY: checked just above.
        unsafe { self.gemm_k_isa(isa, group, acts, out) }
    }

    /// `gemm_k_on` without the check.
    ///
    /// # Safety
    /// The CPU runs `isa`.
    unsafe fn gemm_k_isa(
        &self,
        isa: Isa,
        group: usize,
        acts: &[&[BlockQ8K]],
        out: &mut [[f32; ROWS]],
    ) {
        let per_row = match self {
            Packed::Q4K(_, p) | Packed::Q5K(_, p) | Packed::Q6K(_, p) | Packed::Iq4Xs(_, p) => *p,
            _ => panic!("gemm_k on a 32-value layout"),
        };
        assert!(acts.iter().all(|a| a.len() >= per_row) && out.len() >= acts.len());
        let blocks = group * per_row..(group + 1) * per_row;
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the CPU runs `isa` (the contract); lengths checked just above.
            unsafe {
                match (isa, self) {
                    (Isa::Avx2, Packed::Q4K(v, _)) => return avx2::gemm(&v[blocks], acts, out),
                    (Isa::Avx2, Packed::Q5K(v, _)) => return avx2::gemm(&v[blocks], acts, out),
                    (Isa::Avx2, Packed::Q6K(v, _)) => return avx2::gemm(&v[blocks], acts, out),
                    (Isa::Avx2, Packed::Iq4Xs(v, _)) => return avx2::gemm(&v[blocks], acts, out),
                    (Isa::AvxVnni, Packed::Iq4Xs(v, _)) => {
                        return vnni::gemm(&v[blocks], acts, out)
                    }
                    (Isa::Avx512Vnni, Packed::Iq4Xs(v, _)) => {
                        return vnni512::gemm(&v[blocks], acts, out)
                    }
                    (Isa::AvxVnni, Packed::Q4K(v, _)) => return vnni::gemm(&v[blocks], acts, out),
                    (Isa::AvxVnni, Packed::Q5K(v, _)) => return vnni::gemm(&v[blocks], acts, out),
                    (Isa::AvxVnni, Packed::Q6K(v, _)) => return vnni::gemm(&v[blocks], acts, out),
                    (Isa::Avx512Vnni, Packed::Q4K(v, _)) => {
                        return vnni512::gemm(&v[blocks], acts, out)
                    }
                    (Isa::Avx512Vnni, Packed::Q5K(v, _)) => {
                        return vnni512::gemm(&v[blocks], acts, out)
                    }
                    (Isa::Avx512Vnni, Packed::Q6K(v, _)) => {
                        return vnni512::gemm(&v[blocks], acts, out)
                    }
                    _ => {}
                }
            }
        }
        self.gemm_k_scalar(group, acts, out)
    }

    /// Groups `group` and `group + 1` against each activation row, into `out_a` and
    /// `out_b`: [`gemm_k`](Self::gemm_k) twice, or — for Q4_K and Q6_K where the CPU has AVX-512
    /// (F, BW, VL, VNNI) and a VNNI instance is in use — one pass of 512-bit kernels over
    /// both, each group in one half of every register ([`wide_k`]). The same bits either
    /// way: every lane's integer sums are exact and its float steps the 256-bit kernels'.
    ///
    /// # Panics
    /// As `gemm_k`, for either group.
    pub fn gemm_k2(
        &self,
        group: usize,
        acts: &[&[BlockQ8K]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        #[cfg(target_arch = "x86_64")]
        if wide_k() {
            // SAFETY: `wide_k` checked the CPU's features.
            return unsafe { self.gemm_k2_wide(group, acts, out_a, out_b) };
        }
        self.gemm2_256(group, acts, out_a, out_b)
    }

    /// Whether [`gemm_k2`](Self::gemm_k2) has a kernel for two groups at once on this CPU
    /// that pays for a pass of `n` tokens: the 512-bit kernels (Q4_K, Q6_K) always; the AVX2
    /// Q4_K pair when a group's weights serve several four-token passes (`pairs_avx2`).
    pub fn pairs_k(&self, n: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(self, Packed::Q4K(..) | Packed::Q6K(..) | Packed::Iq4Xs(..)) && wide_k() {
            return true;
        }
        self.pairs_avx2::<BlockQ8K>(n)
    }

    /// Tokens a matmul hands to one [`gemm`](Self::gemm) / [`gemm2`](Self::gemm2) call
    /// (`two`: a two-group call): eight for IQ4_XS's 512-bit two-group kernel, whose decoding
    /// of the codes then serves eight tokens; four for everything else (the AVX2 pair kernels
    /// take exactly four).
    pub fn tokens_per_pass(&self, two: bool) -> usize {
        #[cfg(target_arch = "x86_64")]
        if two && matches!(self, Packed::Iq4Xs(..)) && wide_k() {
            return 8;
        }
        let _ = two;
        4
    }

    /// [`gemm2`](Self::gemm2) or [`gemm_k2`](Self::gemm_k2) on the AVX2 kernels: the Q8_0 or
    /// Q4_K pair for four tokens, single groups otherwise. For tests.
    ///
    /// # Panics
    /// As `gemm2`, or if this CPU does not run AVX2.
    pub fn gemm2_avx2_on<A: PackedAct>(
        &self,
        group: usize,
        acts: &[&[A]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        assert!(Isa::Avx2.runs(), "this CPU does not run AVX2");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: checked just above.
        unsafe {
            self.gemm2_avx2(group, acts, out_a, out_b)
        }
    }

    /// # Safety
    /// The CPU runs AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemm2_avx2<A: PackedAct>(
        &self,
        group: usize,
        acts: &[&[A]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        if let Ok(a) = <[&[A]; 4]>::try_from(acts) {
            // SAFETY: the CPU runs AVX2 (the contract).
            if unsafe { A::pair_avx2(self, group, a, out_a, out_b) } {
                return;
            }
        }
        A::gemm_on(self, Isa::Avx2, group, acts, out_a);
        A::gemm_on(self, Isa::Avx2, group + 1, acts, out_b);
    }

    /// # Safety
    /// The CPU runs AVX-512 F/BW/VL/VNNI.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemm_k2_wide(
        &self,
        group: usize,
        acts: &[&[BlockQ8K]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        let p = match self {
            Packed::Q4K(_, p) | Packed::Q6K(_, p) | Packed::Iq4Xs(_, p) => *p,
            _ => {
                // Other layouts have no 512-bit kernel: the 256-bit one twice.
                self.gemm_k(group, acts, out_a);
                return self.gemm_k(group + 1, acts, out_b);
            }
        };
        assert!(acts.iter().all(|x| x.len() >= p));
        assert!(out_a.len() >= acts.len() && out_b.len() >= acts.len());
        // SAFETY: the CPU's features (the contract); lengths checked just above (slicing
        // checks the groups).
        unsafe {
            match self {
                Packed::Q4K(v, _) => {
                    let (a, b) = two(v, group, p);
                    wide::gemm2(
                        a,
                        b,
                        acts,
                        out_a,
                        out_b,
                        wide::tile_q4k::<1>,
                        wide::tile_q4k::<2>,
                        wide::tile_q4k::<3>,
                        wide::tile_q4k::<4>,
                        None,
                    )
                }
                Packed::Q6K(v, _) => {
                    let (a, b) = two(v, group, p);
                    wide::gemm2(
                        a,
                        b,
                        acts,
                        out_a,
                        out_b,
                        wide::tile_q6k::<1>,
                        wide::tile_q6k::<2>,
                        wide::tile_q6k::<3>,
                        wide::tile_q6k::<4>,
                        None,
                    )
                }
                Packed::Iq4Xs(v, _) => {
                    let (a, b) = two(v, group, p);
                    wide::gemm2(
                        a,
                        b,
                        acts,
                        out_a,
                        out_b,
                        wide::tile_iq4xs::<1>,
                        wide::tile_iq4xs::<2>,
                        wide::tile_iq4xs::<3>,
                        wide::tile_iq4xs::<4>,
                        Some(wide::tile_iq4xs::<8>),
                    )
                }
                _ => unreachable!("matched above"),
            }
        }
    }

    /// The portable twin of [`gemm_k`](Self::gemm_k).
    pub fn gemm_k_scalar(&self, group: usize, acts: &[&[BlockQ8K]], out: &mut [[f32; ROWS]]) {
        match self {
            Packed::Q4K(v, p) => gemm_q4k_scalar(&v[group * p..(group + 1) * p], acts, out),
            Packed::Q5K(v, p) => gemm_q4k_scalar(&v[group * p..(group + 1) * p], acts, out),
            Packed::Q6K(v, p) => gemm_q6k_scalar(&v[group * p..(group + 1) * p], acts, out),
            Packed::Iq4Xs(v, p) => gemm_iq4xs_scalar(&v[group * p..(group + 1) * p], acts, out),
            _ => panic!("gemm_k on a 32-value layout"),
        }
    }

    /// The portable twin of [`gemm`](Self::gemm), the reference its tests hold it to.
    pub fn gemm_scalar(&self, group: usize, acts: &[&[BlockQ8]], out: &mut [[f32; ROWS]]) {
        if let Packed::Mxfp4(v, per_row) = self {
            return gemm_mxfp4_scalar(&v[group * per_row..(group + 1) * per_row], acts, out);
        }
        with_blocks!(self, |v, per_row| {
            gemm_scalar(&v[group * per_row..(group + 1) * per_row], acts, out)
        })
    }
}

/// Per (row, token) and super-block: the exact integer sums `Σ_j sc_j·Σ q·y` and
/// `Σ_j mn_j·Σ y`, then `acc += isum·(d·d_a)` and `acc −= msum·(dmin·d_a)`, each fused.
fn gemm_q4k_scalar<B: K4x8>(w: &[B], acts: &[&[BlockQ8K]], out: &mut [[f32; ROWS]]) {
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        for (r, or) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (bq, q) in w.iter().zip(a.iter()) {
                let b = bq.k4();
                let mut isum = 0i32;
                let mut msum = 0i32;
                for j in 0..8 {
                    let s: i32 = (32 * j..32 * j + 32)
                        .map(|e| bq.quant(r, e) * q.qs[e] as i32)
                        .sum();
                    isum += b.sc[j][r] as i32 * s;
                    msum += b.mn[j][r] as i32 * (q.bsums[2 * j] as i32 + q.bsums[2 * j + 1] as i32);
                }
                acc = (isum as f32).mul_add(b.d[r].to_f32() * q.d, acc);
                acc = (-(msum as f32)).mul_add(b.dmin[r].to_f32() * q.d, acc);
            }
            *or = acc;
        }
    }
}

/// Per (row, token) and super-block: `isum = Σ_j sc_j·Σ q·y − 32·Σ_j sc_j·Σ_j y` exactly in
/// integers (`Σ_j y` is the activation's 16-value sum), then `acc += isum·(d·d_a)`, fused.
fn gemm_q6k_scalar(w: &[Q6Kx8], acts: &[&[BlockQ8K]], out: &mut [[f32; ROWS]]) {
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        for (r, or) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (b, q) in w.iter().zip(a.iter()) {
                let (mut dot, mut offs) = (0i32, 0i32);
                for j in 0..16 {
                    let s: i32 = (16 * j..16 * j + 16)
                        .map(|e| b.quant(r, e) * q.qs[e] as i32)
                        .sum();
                    dot += b.sc[j][r] as i32 * s;
                    offs += b.sc[j][r] as i32 * q.bsums[j] as i32;
                }
                acc = ((dot - 32 * offs) as f32).mul_add(b.d[r].to_f32() * q.d, acc);
            }
            *or = acc;
        }
    }
}

/// Per (row, token) and super-block: the exact integer sum `Σ_ib sc_ib · Σ level·a`, then
/// `acc += isum · (d · d_a)`, fused.
fn gemm_iq4xs_scalar(w: &[Iq4Xsx8], acts: &[&[BlockQ8K]], out: &mut [[f32; ROWS]]) {
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        for (r, or) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (b, q) in w.iter().zip(a.iter()) {
                let mut isum = 0i32;
                for ib in 0..8 {
                    let s: i32 = (32 * ib..32 * ib + 32)
                        .map(|e| b.level(r, e) * q.qs[e] as i32)
                        .sum();
                    isum += b.sc[ib][r] as i32 * s;
                }
                acc = (isum as f32).mul_add(b.d[r].to_f32() * q.d, acc);
            }
            *or = acc;
        }
    }
}

/// Per (row, token) and block: the exact integer sum `Σ v·a` of the doubled E2M1 values, then
/// `acc += isum · (2^(e − 128) · d_a)`, fused.
fn gemm_mxfp4_scalar(w: &[Mxfp4x8], acts: &[&[BlockQ8]], out: &mut [[f32; ROWS]]) {
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        for (r, or) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (b, q) in w.iter().zip(a.iter()) {
                let isum: i32 = (0..32).map(|e| b.value(r, e) * q.qs[e] as i32).sum();
                acc = (isum as f32).mul_add(mxfp4::half_scale(b.e[r]) * q.d, acc);
            }
            *or = acc;
        }
    }
}

fn dequantize_block<B: BlockX8>(b: &B, r: usize, y: &mut [f32]) {
    let d = b.d()[r].to_f32();
    for (e, v) in y.iter_mut().enumerate() {
        let q = b.quant(r, e) as f32;
        *v = match B::OFFSET {
            Offset::None => q * d,
            Offset::Scaled(c) => (q + c) * d,
            Offset::Min => q * d + b.m()[r].to_f32(),
        };
    }
}

fn gemm_scalar<B: BlockX8>(w: &[B], acts: &[&[BlockQ8]], out: &mut [[f32; ROWS]]) {
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        for (r, or) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (b, q) in w.iter().zip(a.iter()) {
                let isum: i32 = (0..32).map(|e| b.quant(r, e) * q.qs[e] as i32).sum();
                let dw = b.d()[r].to_f32();
                acc = (isum as f32).mul_add(dw * q.d, acc);
                match B::OFFSET {
                    Offset::None => {}
                    Offset::Scaled(c) => acc = (dw * c).mul_add(q.s, acc),
                    Offset::Min => acc = b.m()[r].to_f32().mul_add(q.s, acc),
                }
            }
            *or = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
macro_rules! nibble_kernel {
    ($feat:literal, $t:ty, $qh:expr) => {
        impl Tile<BlockQ8> for $t {
            #[target_feature(enable = $feat)]
            unsafe fn tile<const N: usize>(
                w: &[Self],
                a: [&[BlockQ8]; N],
                out: &mut [[f32; ROWS]],
            ) {
                tile_nibbles(w, a, out, |b: &Self| &b.qs, $qh)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
macro_rules! packed_kernels {
    ($name:ident, $feat:literal, $vnni:expr, $dpbusd:ident) => {
        mod $name {
            use super::*;
            use crate::cpu::quant::q8::{prefetch, prefetch_part};
            use std::arch::x86_64::*;

            /// Whether this instance of the kernels may use AVX-VNNI's `vpdpbusd` (four u8·i8
            /// products summed into each i32 lane, no intermediate i16 saturation). Where a kernel
            /// keeps exact integer sums either way, both instances give bit-equal results.
            const VNNI: bool = $vnni;

            /// `acc + Σ u·s` over each lane's four byte pairs: one instruction with either VNNI;
            /// never called in the AVX2 instance (its kernels keep i16 partial sums instead).
            #[target_feature(enable = $feat)]
            unsafe fn dp(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
                debug_assert!(VNNI);
                $dpbusd(acc, u, s)
            }

            /// Eight rows' unsigned bytes, one per i32 lane.
            #[target_feature(enable = $feat)]
            unsafe fn widen_u8(s: &[u8; ROWS]) -> __m256i {
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(s.as_ptr() as *const __m128i))
            }

            /// Any packed layout over any number of tokens, four per pass (activation format `A`:
            /// Q8 for the 32-value layouts, Q8_K for the K-quants).
            ///
            /// # Safety
            /// The CPU runs this instance's features (AVX2, FMA and F16C; AVX-VNNI for `vnni`,
            /// AVX512 F/VL/VNNI for `vnni512`); every activation row has at least `w.len()`
            /// blocks; `out` is at least as long as `acts`.
            #[target_feature(enable = $feat)]
            pub unsafe fn gemm<A, B: Tile<A>>(w: &[B], acts: &[&[A]], out: &mut [[f32; ROWS]]) {
                let mut t = 0;
                while t < acts.len() {
                    let o = &mut out[t..];
                    match acts.len() - t {
                        1 => B::tile::<1>(w, [acts[t]], o),
                        2 => B::tile::<2>(w, [acts[t], acts[t + 1]], o),
                        3 => B::tile::<3>(w, [acts[t], acts[t + 1], acts[t + 2]], o),
                        _ => B::tile::<4>(w, [acts[t], acts[t + 1], acts[t + 2], acts[t + 3]], o),
                    }
                    t += 4;
                }
            }

            /// The pass of a packed format over up to four tokens of activation format `A`.
            pub trait Tile<A>: Sized {
                /// # Safety
                /// As [`gemm`].
                unsafe fn tile<const N: usize>(w: &[Self], a: [&[A]; N], out: &mut [[f32; ROWS]]);
            }

            #[target_feature(enable = $feat)]
            unsafe fn scales(d: &[f16; ROWS]) -> __m256 {
                _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr() as *const __m128i))
            }

            /// Four activation quants (`qs[e..e+4]`) in every lane.
            #[target_feature(enable = $feat)]
            unsafe fn word(qs: &[i8], e: usize) -> __m256i {
                debug_assert!(e + 4 <= qs.len());
                _mm256_set1_epi32((qs.as_ptr().add(e) as *const i32).read_unaligned())
            }

            /// `acc += isum · (d_w · d_a)`, then the offset term: the fixed per-block arithmetic.
            #[target_feature(enable = $feat)]
            unsafe fn scale_block<B: BlockX8>(
                acc: __m256,
                isum: __m256i,
                b: &B,
                q: &BlockQ8,
            ) -> __m256 {
                let dw = scales(b.d());
                let acc = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(isum),
                    _mm256_mul_ps(dw, _mm256_set1_ps(q.d)),
                    acc,
                );
                match B::OFFSET {
                    Offset::None => acc,
                    Offset::Scaled(c) => _mm256_fmadd_ps(
                        _mm256_mul_ps(dw, _mm256_set1_ps(c)),
                        _mm256_set1_ps(q.s),
                        acc,
                    ),
                    Offset::Min => _mm256_fmadd_ps(scales(b.m()), _mm256_set1_ps(q.s), acc),
                }
            }

            #[target_feature(enable = $feat)]
            unsafe fn store<const N: usize>(acc: [__m256; N], out: &mut [[f32; ROWS]]) {
                for (a, o) in acc.iter().zip(out.iter_mut()) {
                    _mm256_storeu_ps(o.as_mut_ptr(), *a);
                }
            }

            /// Eight rows' MXFP4 scales 2^(e − 128) from their exponent bytes, as
            /// `mxfp4::half_scale` makes them: `(e − 1) << 23` as float bits, and for e < 2 the
            /// subnormals `0x0020_0000 << e`.
            #[target_feature(enable = $feat)]
            unsafe fn e8m0_half_scales(e: &[u8; ROWS]) -> __m256 {
                let e = widen_u8(e);
                let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
                let tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
                let is_tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
                _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, is_tiny))
            }

            impl Tile<BlockQ8> for Mxfp4x8 {
                /// Each nibble looked up (a byte shuffle) as its doubled E2M1 value plus 12, so
                /// unsigned; each token's chain starts from −12 · Σ a (exact: `offset` is
                /// −128 · Σ a), so the block's integer sum is Σ v·a exactly. AVX2: a pair sum is
                /// at most 2 · 24 · 128, so two vectors' low and high halves add up in i16
                /// before each widening.
                #[target_feature(enable = $feat)]
                unsafe fn tile<const N: usize>(
                    w: &[Self],
                    a: [&[BlockQ8]; N],
                    out: &mut [[f32; ROWS]],
                ) {
                    let ones = _mm256_set1_epi16(1);
                    let low = _mm256_set1_epi8(0x0f);
                    let mut shifted = [0u8; 16];
                    for (s, v) in shifted.iter_mut().zip(mxfp4::VALUES) {
                        *s = (v + 12) as u8;
                    }
                    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                        shifted.as_ptr() as *const __m128i
                    ));
                    let mut acc = [_mm256_setzero_ps(); N];
                    for (i, b) in w.iter().enumerate() {
                        prefetch(b);
                        let q = a.map(|r| r.get_unchecked(i));
                        // −12 · Σ a = offset · 12 / 128, exact since 128 divides offset.
                        let start = q.map(|q| _mm256_set1_epi32(q.offset / 32 * 3));
                        let mut isum = if VNNI {
                            start
                        } else {
                            [_mm256_setzero_si256(); N]
                        };
                        let mut s16 = [_mm256_setzero_si256(); N];
                        for j in 0..4 {
                            let raw =
                                _mm256_loadu_si256(b.qs.as_ptr().add(32 * j) as *const __m256i);
                            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low));
                            let hi = _mm256_shuffle_epi8(
                                table,
                                _mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                            );
                            if VNNI {
                                // s16 doubles as the second chain of i32 sums.
                                for t in 0..N {
                                    isum[t] = dp(isum[t], lo, word(&q[t].qs, 4 * j));
                                    s16[t] = dp(s16[t], hi, word(&q[t].qs, 4 * j + 16));
                                }
                                continue;
                            }
                            for t in 0..N {
                                let pl = _mm256_maddubs_epi16(lo, word(&q[t].qs, 4 * j));
                                let ph = _mm256_maddubs_epi16(hi, word(&q[t].qs, 4 * j + 16));
                                s16[t] = _mm256_add_epi16(s16[t], _mm256_add_epi16(pl, ph));
                            }
                            if j % 2 == 1 {
                                for t in 0..N {
                                    isum[t] =
                                        _mm256_add_epi32(isum[t], _mm256_madd_epi16(s16[t], ones));
                                    s16[t] = _mm256_setzero_si256();
                                }
                            }
                        }
                        let dw = e8m0_half_scales(&b.e);
                        for t in 0..N {
                            isum[t] = if VNNI {
                                _mm256_add_epi32(isum[t], s16[t])
                            } else {
                                _mm256_add_epi32(isum[t], start[t])
                            };
                            acc[t] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(isum[t]),
                                _mm256_mul_ps(dw, _mm256_set1_ps(q[t].d)),
                                acc[t],
                            );
                        }
                    }
                    store(acc, out)
                }
            }

            impl Tile<BlockQ8> for Q8_0x8 {
                #[target_feature(enable = $feat)]
                unsafe fn tile<const N: usize>(
                    w: &[Self],
                    a: [&[BlockQ8]; N],
                    out: &mut [[f32; ROWS]],
                ) {
                    tile_bytes(w, a, out, |b: &Self, j| {
                        _mm256_loadu_si256(b.qs.as_ptr().add(32 * j) as *const __m256i)
                    })
                }
            }

            impl Tile<BlockQ8> for Iq4Nlx8 {
                /// Each code looked up (a byte shuffle) as its level plus 128: then Q8_0's
                /// arithmetic, vector `j` being values `4j..4j+4` of each row.
                #[target_feature(enable = $feat)]
                unsafe fn tile<const N: usize>(
                    w: &[Self],
                    a: [&[BlockQ8]; N],
                    out: &mut [[f32; ROWS]],
                ) {
                    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                        IQ4_PLUS_128.as_ptr() as *const __m128i
                    ));
                    let low = _mm256_set1_epi8(0x0f);
                    tile_bytes(w, a, out, |b: &Self, j| {
                        let raw =
                            _mm256_loadu_si256(b.qs.as_ptr().add(32 * (j % 4)) as *const __m256i);
                        let codes = if j < 4 {
                            raw
                        } else {
                            _mm256_srli_epi16(raw, 4)
                        };
                        _mm256_shuffle_epi8(table, _mm256_and_si256(codes, low))
                    })
                }
            }

            /// Eight rows of signed 8-bit weights stored plus 128 (`vector(b, j)` gives vector
            /// `j`, values `4j..4j+4` of each row, as unsigned bytes). AVX-VNNI: the bytes
            /// (w + 128) go straight into `vpdpbusd`, each token's chain starting from −128 · Σ a.
            /// AVX2: `maddubs` takes |w| and moves w's sign onto the activation; the pair sums
            /// can reach 2 · 128 · 127, so each product vector is widened to i32 at once.
            #[target_feature(enable = $feat)]
            unsafe fn tile_bytes<B: BlockX8, const N: usize>(
                w: &[B],
                a: [&[BlockQ8]; N],
                out: &mut [[f32; ROWS]],
                vector: impl Fn(&B, usize) -> __m256i,
            ) {
                let ones = _mm256_set1_epi16(1);
                let flip = _mm256_set1_epi8(-128);
                let mut acc = [_mm256_setzero_ps(); N];
                for (i, b) in w.iter().enumerate() {
                    prefetch(b);
                    let q = a.map(|r| r.get_unchecked(i));
                    let mut isum = [_mm256_setzero_si256(); N];
                    let mut isum2 = [[_mm256_setzero_si256(); N]; 2];
                    if VNNI {
                        for t in 0..N {
                            isum2[0][t] = _mm256_set1_epi32(q[t].offset);
                        }
                    }
                    // Four tokens without VNNI run this loop rolled (`black_box` hides the
                    // trip count; it changes speed only, never the result): unrolled, LLVM
                    // schedules the eight vectors' sign work for all four tokens at once and
                    // spills half of it. On AMD Zen 3 the four-token pass ran 48 → 55 G
                    // multiply-adds a second on one core rolled; fewer tokens run faster
                    // unrolled.
                    let vectors = if VNNI || N < 4 {
                        8
                    } else {
                        std::hint::black_box(8)
                    };
                    for j in 0..vectors {
                        let u = vector(b, j);
                        if VNNI {
                            for t in 0..N {
                                // Two chains, so consecutive `vpdpbusd`s need not wait on
                                // each other.
                                isum2[j % 2][t] = dp(isum2[j % 2][t], u, word(&q[t].qs, 4 * j));
                            }
                            continue;
                        }
                        let x = _mm256_xor_si256(u, flip);
                        let ax = _mm256_sign_epi8(x, x);
                        for t in 0..N {
                            let y = _mm256_sign_epi8(word(&q[t].qs, 4 * j), x);
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, y), ones);
                            isum[t] = _mm256_add_epi32(isum[t], p);
                        }
                    }
                    for t in 0..N {
                        if VNNI {
                            isum[t] = _mm256_add_epi32(isum2[0][t], isum2[1][t]);
                        }
                        acc[t] = scale_block(acc[t], isum[t], b, q[t]);
                    }
                }
                store(acc, out)
            }

            /// The 4- and 5-bit formats: unsigned quants go straight into `maddubs`. A pair sum is at
            /// most 2 · 31 · 127, so four of them (all eight for 4-bit quants) add up in i16 before one
            /// widening to i32.
            #[target_feature(enable = $feat)]
            unsafe fn tile_nibbles<B: BlockX8, const N: usize>(
                w: &[B],
                a: [&[BlockQ8]; N],
                out: &mut [[f32; ROWS]],
                qs: impl Fn(&B) -> &[u8; 128],
                qh: impl Fn(&B) -> Option<&[u8; 32]>,
            ) {
                let ones = _mm256_set1_epi16(1);
                let low = _mm256_set1_epi8(0x0f);
                let bit4 = _mm256_set1_epi8(0x10);
                let mut acc = [_mm256_setzero_ps(); N];
                for (i, b) in w.iter().enumerate() {
                    prefetch(b);
                    let q = a.map(|r| r.get_unchecked(i));
                    let mut isum = [_mm256_setzero_si256(); N];
                    let mut s16 = [_mm256_setzero_si256(); N];
                    let h = qh(b).map(|h| _mm256_loadu_si256(h.as_ptr() as *const __m256i));
                    for j in 0..4 {
                        let raw = _mm256_loadu_si256(qs(b).as_ptr().add(32 * j) as *const __m256i);
                        let mut lo = _mm256_and_si256(raw, low);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                        if let Some(h) = h {
                            // Bit m of each byte to bit 4: 16-bit shifts are safe, as bit 4 of each
                            // byte only ever receives a bit of the same byte.
                            let (hl, hh) = match j {
                                0 => (_mm256_slli_epi16(h, 4), h),
                                1 => (_mm256_slli_epi16(h, 3), _mm256_srli_epi16(h, 1)),
                                2 => (_mm256_slli_epi16(h, 2), _mm256_srli_epi16(h, 2)),
                                _ => (_mm256_slli_epi16(h, 1), _mm256_srli_epi16(h, 3)),
                            };
                            lo = _mm256_or_si256(lo, _mm256_and_si256(hl, bit4));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(hh, bit4));
                        }
                        if VNNI {
                            // s16 doubles as the second chain of i32 sums.
                            for t in 0..N {
                                isum[t] = dp(isum[t], lo, word(&q[t].qs, 4 * j));
                                s16[t] = dp(s16[t], hi, word(&q[t].qs, 4 * j + 16));
                            }
                            continue;
                        }
                        for t in 0..N {
                            let pl = _mm256_maddubs_epi16(lo, word(&q[t].qs, 4 * j));
                            let ph = _mm256_maddubs_epi16(hi, word(&q[t].qs, 4 * j + 16));
                            s16[t] = _mm256_add_epi16(s16[t], _mm256_add_epi16(pl, ph));
                        }
                        let widen = if qh(b).is_some() { j % 2 == 1 } else { j == 3 };
                        if widen {
                            for t in 0..N {
                                isum[t] =
                                    _mm256_add_epi32(isum[t], _mm256_madd_epi16(s16[t], ones));
                                s16[t] = _mm256_setzero_si256();
                            }
                        }
                    }
                    for t in 0..N {
                        if VNNI {
                            isum[t] = _mm256_add_epi32(isum[t], s16[t]);
                        }
                        acc[t] = scale_block(acc[t], isum[t], b, q[t]);
                    }
                }
                store(acc, out)
            }

            /// Q4_K and Q5_K share one tile.
            impl<B: K4x8> Tile<BlockQ8K> for B {
                #[target_feature(enable = $feat)]
                unsafe fn tile<const N: usize>(
                    w: &[Self],
                    a: [&[BlockQ8K]; N],
                    out: &mut [[f32; ROWS]],
                ) {
                    tile_q4k(w, a, out)
                }
            }

            impl Tile<BlockQ8K> for Iq4Xsx8 {
                /// Per 32-value sub-block the exact i32 sum of level · activation: with VNNI,
                /// `vpdpbusd` over the levels plus 128 times the sub-block's scale, and once a
                /// super-block 128 · Σ scale · (the activation's 32-value sum) taken off; without, `maddubs` of |level| and the
                /// activation given the level's sign (a pair sum is at most 2 · 127 · 127), then
                /// `madd` with the scale in both halves of each lane. One float step a
                /// super-block.
                #[target_feature(enable = $feat)]
                unsafe fn tile<const N: usize>(
                    w: &[Self],
                    a: [&[BlockQ8K]; N],
                    out: &mut [[f32; ROWS]],
                ) {
                    let low = _mm256_set1_epi8(0x0f);
                    let levels = if VNNI {
                        IQ4_PLUS_128.as_ptr()
                    } else {
                        iq4::VALUES.as_ptr() as *const u8
                    };
                    let table =
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(levels as *const __m128i));
                    let mut acc = [_mm256_setzero_ps(); N];
                    for (i, b) in w.iter().enumerate() {
                        let q = a.map(|r| r.get_unchecked(i));
                        let mut isum = [_mm256_setzero_si256(); N];
                        for ib in 0..8 {
                            prefetch_part(b, ib, 8);
                            let mut d = [_mm256_setzero_si256(); N];
                            let sc16 = signed_pairs(&b.sc[ib], &b.sc[ib]);
                            for v in 0..4 {
                                let raw = _mm256_loadu_si256(
                                    b.qs.as_ptr().add(128 * ib + 32 * v) as *const __m256i
                                );
                                let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low));
                                let hi = _mm256_shuffle_epi8(
                                    table,
                                    _mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                );
                                let e = 32 * ib + 4 * v;
                                for t in 0..N {
                                    let (wl, wh) = (word(&q[t].qs, e), word(&q[t].qs, e + 16));
                                    if VNNI {
                                        d[t] = dp(dp(d[t], lo, wl), hi, wh);
                                        continue;
                                    }
                                    let pl = _mm256_maddubs_epi16(
                                        _mm256_sign_epi8(lo, lo),
                                        _mm256_sign_epi8(wl, lo),
                                    );
                                    let ph = _mm256_maddubs_epi16(
                                        _mm256_sign_epi8(hi, hi),
                                        _mm256_sign_epi8(wh, hi),
                                    );
                                    let p = _mm256_add_epi32(
                                        _mm256_madd_epi16(pl, sc16),
                                        _mm256_madd_epi16(ph, sc16),
                                    );
                                    isum[t] = _mm256_add_epi32(isum[t], p);
                                }
                            }
                            if VNNI {
                                let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                    b.sc[ib].as_ptr() as *const __m128i
                                ));
                                for t in 0..N {
                                    isum[t] =
                                        _mm256_add_epi32(isum[t], _mm256_mullo_epi32(d[t], sc));
                                }
                            }
                        }
                        if VNNI {
                            // The levels went in plus 128: less 128 · Σ_ib sc_ib · (the
                            // activation's 32-value sum), two sub-blocks per `madd`.
                            let sc: [__m256i; 4] = std::array::from_fn(|p| {
                                signed_pairs(&b.sc[2 * p], &b.sc[2 * p + 1])
                            });
                            for t in 0..N {
                                let mut off = _mm256_setzero_si256();
                                for (p, sc) in sc.iter().enumerate() {
                                    let y = _mm256_set1_epi32(q[t].sums32_pair(p));
                                    off = _mm256_add_epi32(off, _mm256_madd_epi16(*sc, y));
                                }
                                isum[t] = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(off, 7));
                            }
                        }
                        let dw = scales(&b.d);
                        for t in 0..N {
                            acc[t] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(isum[t]),
                                _mm256_mul_ps(dw, _mm256_set1_ps(q[t].d)),
                                acc[t],
                            );
                        }
                    }
                    store(acc, out)
                }
            }

            impl Tile<BlockQ8K> for Q6Kx8 {
                #[target_feature(enable = $feat)]
                unsafe fn tile<const N: usize>(
                    w: &[Self],
                    a: [&[BlockQ8K]; N],
                    out: &mut [[f32; ROWS]],
                ) {
                    tile_q6k(w, a, out)
                }
            }

            /// Eight rows' signed bytes as i16 pairs `lo[r] | hi[r] << 16` per lane (`hi = lo` puts
            /// the same value in both halves, for `madd` against a lane's two partial sums).
            #[target_feature(enable = $feat)]
            unsafe fn signed_pairs(lo: &[i8; ROWS], hi: &[i8; ROWS]) -> __m256i {
                let l = _mm256_cvtepi8_epi32(_mm_loadl_epi64(lo.as_ptr() as *const __m128i));
                let h = _mm256_cvtepi8_epi32(_mm_loadl_epi64(hi.as_ptr() as *const __m128i));
                _mm256_or_si256(
                    _mm256_and_si256(l, _mm256_set1_epi32(0xffff)),
                    _mm256_slli_epi32(h, 16),
                )
            }

            /// Q6_K: unsigned 6-bit quants into `maddubs` (a pair sum is at most 2 · 63 · 127, so two
            /// product vectors add in i16), each 16-value sub-block scaled by `madd` with its signed
            /// scale; the −32 offset comes in once per super-block through the activation's 16-value
            /// sums.
            #[target_feature(enable = $feat)]
            unsafe fn tile_q6k<const N: usize>(
                w: &[Q6Kx8],
                a: [&[BlockQ8K]; N],
                out: &mut [[f32; ROWS]],
            ) {
                let mut acc = [_mm256_setzero_ps(); N];
                for (i, b) in w.iter().enumerate() {
                    let q = a.map(|r| r.get_unchecked(i));
                    let mut isum = [_mm256_setzero_si256(); N];
                    // The quarters one by one, each its own instance, so that the bit
                    // positions are constants and every loop inside unrolls.
                    for n in 0..2 {
                        q6k_quarter::<0, N>(b, n, &q, &mut isum);
                        q6k_quarter::<1, N>(b, n, &q, &mut isum);
                        q6k_quarter::<2, N>(b, n, &q, &mut isum);
                        q6k_quarter::<3, N>(b, n, &q, &mut isum);
                    }
                    let dw = scales(&b.d);
                    for t in 0..N {
                        let bs = &q[t].bsums;
                        let mut offs = _mm256_setzero_si256();
                        for p in 0..8 {
                            let sc = signed_pairs(&b.sc[2 * p], &b.sc[2 * p + 1]);
                            let word =
                                (bs[2 * p] as u16 as u32) | ((bs[2 * p + 1] as u16 as u32) << 16);
                            offs = _mm256_add_epi32(
                                offs,
                                _mm256_madd_epi16(sc, _mm256_set1_epi32(word as i32)),
                            );
                        }
                        let isum = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(offs, 5));
                        acc[t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum),
                            _mm256_mul_ps(dw, _mm256_set1_ps(q[t].d)),
                            acc[t],
                        );
                    }
                }
                store(acc, out)
            }

            /// Quarter `K` of half `n` of a Q6_K block (values `128n + 32K..+32`, sub-blocks
            /// `8n + 2K` and `8n + 2K + 1`) into each token's integer sum.
            #[target_feature(enable = $feat)]
            unsafe fn q6k_quarter<const K: usize, const N: usize>(
                b: &Q6Kx8,
                n: usize,
                q: &[&BlockQ8K; N],
                isum: &mut [__m256i; N],
            ) {
                let low = _mm256_set1_epi8(0x0f);
                let (m03, m30) = (_mm256_set1_epi8(0x03), _mm256_set1_epi8(0x30));
                prefetch_part(b, 4 * n + K, 8);
                for h in 0..2 {
                    let si = 8 * n + 2 * K + h;
                    let sc = signed_pairs(&b.sc[si], &b.sc[si]);
                    // With VNNI, the sub-block's four vectors sum in i32 and the scale
                    // multiplies once.
                    let mut d = [_mm256_setzero_si256(); N];
                    for pair in 0..2 {
                        let mut s16 = [_mm256_setzero_si256(); N];
                        for w4 in 0..2 {
                            let wi = 4 * h + 2 * pair + w4;
                            let l = _mm256_loadu_si256(
                                b.ql.as_ptr().add(32 * (16 * n + 8 * (K % 2) + wi))
                                    as *const __m256i,
                            );
                            let hb = _mm256_loadu_si256(
                                b.qh.as_ptr().add(32 * (8 * n + wi)) as *const __m256i
                            );
                            let lo4 = if K < 2 {
                                _mm256_and_si256(l, low)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16(l, 4), low)
                            };
                            let hi2 = match K {
                                0 => _mm256_slli_epi16(_mm256_and_si256(hb, m03), 4),
                                1 => _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30),
                                2 => _mm256_and_si256(hb, m30),
                                _ => _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30),
                            };
                            let v = _mm256_or_si256(lo4, hi2);
                            let e = 128 * n + 32 * K + 4 * wi;
                            for t in 0..N {
                                if VNNI {
                                    d[t] = dp(d[t], v, word(&q[t].qs, e));
                                } else {
                                    let p = _mm256_maddubs_epi16(v, word(&q[t].qs, e));
                                    s16[t] = _mm256_add_epi16(s16[t], p);
                                }
                            }
                        }
                        if !VNNI {
                            for t in 0..N {
                                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s16[t], sc));
                            }
                        }
                    }
                    if VNNI {
                        let sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            b.sc[si].as_ptr() as *const __m128i
                        ));
                        for t in 0..N {
                            isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(d[t], sc32));
                        }
                    }
                }
            }

            /// From two consecutive rows-of-eight byte arrays `p[0..8]`, `p[8..16]` (one 128-bit load
            /// broadcast to both halves), lane `r` as the i16 pair `(p[lo + r], p[hi + r])`: `lo`, `hi`
            /// are 0 or 8. One shuffle instead of widening each array on its own.
            #[target_feature(enable = $feat)]
            unsafe fn byte_pairs<const LO: i8, const HI: i8>(p: __m256i) -> __m256i {
                const Z: i8 = -128; // a set top bit makes `pshufb` write zero
                let c = _mm256_setr_epi8(
                    LO,
                    Z,
                    HI,
                    Z,
                    LO + 1,
                    Z,
                    HI + 1,
                    Z,
                    LO + 2,
                    Z,
                    HI + 2,
                    Z,
                    LO + 3,
                    Z,
                    HI + 3,
                    Z,
                    LO + 4,
                    Z,
                    HI + 4,
                    Z,
                    LO + 5,
                    Z,
                    HI + 5,
                    Z,
                    LO + 6,
                    Z,
                    HI + 6,
                    Z,
                    LO + 7,
                    Z,
                    HI + 7,
                    Z,
                );
                _mm256_shuffle_epi8(p, c)
            }

            #[target_feature(enable = $feat)]
            unsafe fn load_pairs(p: &[[u8; ROWS]]) -> __m256i {
                debug_assert!(p.len() >= 2);
                _mm256_broadcastsi128_si256(_mm_loadu_si128(p.as_ptr() as *const __m128i))
            }

            /// A sub-block's 32 sums of two products stay below 2 · 15 · 127 · 8 < 2¹⁵ in i16; `madd`
            /// with the row's scale in both halves of its lane then gives `sc · Σ q·y` in i32. With
            /// Q5_K's fifth bit a quant reaches 31, so without VNNI the i16 sums are scaled and
            /// widened every four vectors instead (2 · 31 · 127 · 4 < 2¹⁵).
            #[target_feature(enable = $feat)]
            unsafe fn tile_q4k<B: K4x8, const N: usize>(
                w: &[B],
                a: [&[BlockQ8K]; N],
                out: &mut [[f32; ROWS]],
            ) {
                let low = _mm256_set1_epi8(0x0f);
                let bit4 = _mm256_set1_epi8(0x10);
                let mut acc = [_mm256_setzero_ps(); N];
                for (i, bq) in w.iter().enumerate() {
                    let b = bq.k4();
                    let q = a.map(|r| r.get_unchecked(i));
                    let mut isum = [_mm256_setzero_si256(); N];
                    let flush_every = if bq.qh().is_some() { 4 } else { 8 };
                    // The four-token AVX2 pass asks for the whole block ahead at once: with a
                    // quarter asked for before each quarter's loop it ran 86-90 G multiply-adds
                    // a second on one core against 95-100 (AMD Zen 3, weights in cache or
                    // streamed from memory alike). One token keeps the quarters (2-3% faster).
                    let whole = !VNNI && N == 4;
                    if whole {
                        prefetch(bq);
                    }
                    for c in 0..4 {
                        // A quarter of the block ahead, before the loop over its vectors:
                        // a branch in that loop keeps it from unrolling.
                        if !whole {
                            prefetch_part(bq, c, 4);
                        }
                        let mut s_lo = [_mm256_setzero_si256(); N];
                        let mut s_hi = [_mm256_setzero_si256(); N];
                        for v in 0..8 {
                            let raw = _mm256_loadu_si256(
                                b.qs.as_ptr().add(256 * c + 32 * v) as *const __m256i
                            );
                            let mut lo = _mm256_and_si256(raw, low);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                            if let Some(qh) = bq.qh() {
                                // Bits 2c and 2c + 1 of each byte to bit 4 (16-bit shifts: bit 4
                                // of a byte only receives bits of the same byte).
                                let h =
                                    _mm256_loadu_si256(qh.as_ptr().add(32 * v) as *const __m256i);
                                let (hl, hh) = match c {
                                    0 => (_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 3)),
                                    1 => (_mm256_slli_epi16(h, 2), _mm256_slli_epi16(h, 1)),
                                    2 => (h, _mm256_srli_epi16(h, 1)),
                                    _ => (_mm256_srli_epi16(h, 2), _mm256_srli_epi16(h, 3)),
                                };
                                lo = _mm256_or_si256(lo, _mm256_and_si256(hl, bit4));
                                hi = _mm256_or_si256(hi, _mm256_and_si256(hh, bit4));
                            }
                            for t in 0..N {
                                let e = 64 * c + 4 * v;
                                if VNNI {
                                    // i32 sums per sub-block, scaled below by one multiply.
                                    s_lo[t] = dp(s_lo[t], lo, word(&q[t].qs, e));
                                    s_hi[t] = dp(s_hi[t], hi, word(&q[t].qs, e + 32));
                                    continue;
                                }
                                s_lo[t] = _mm256_add_epi16(
                                    s_lo[t],
                                    _mm256_maddubs_epi16(lo, word(&q[t].qs, e)),
                                );
                                s_hi[t] = _mm256_add_epi16(
                                    s_hi[t],
                                    _mm256_maddubs_epi16(hi, word(&q[t].qs, e + 32)),
                                );
                            }
                            if VNNI || (v + 1) % flush_every != 0 {
                                continue;
                            }
                            let sc = load_pairs(&b.sc[2 * c..]);
                            let (sc_lo, sc_hi) = (byte_pairs::<0, 0>(sc), byte_pairs::<8, 8>(sc));
                            for t in 0..N {
                                let p = _mm256_add_epi32(
                                    _mm256_madd_epi16(s_lo[t], sc_lo),
                                    _mm256_madd_epi16(s_hi[t], sc_hi),
                                );
                                isum[t] = _mm256_add_epi32(isum[t], p);
                                s_lo[t] = _mm256_setzero_si256();
                                s_hi[t] = _mm256_setzero_si256();
                            }
                        }
                        if VNNI {
                            let (sc_lo, sc_hi) =
                                (widen_u8(&b.sc[2 * c]), widen_u8(&b.sc[2 * c + 1]));
                            for t in 0..N {
                                let p = _mm256_add_epi32(
                                    _mm256_mullo_epi32(s_lo[t], sc_lo),
                                    _mm256_mullo_epi32(s_hi[t], sc_hi),
                                );
                                isum[t] = _mm256_add_epi32(isum[t], p);
                            }
                        }
                    }
                    q4k_block_end(b, &q, &isum, &mut acc);
                }
                store(acc, out)
            }

            /// Q4_K over two packed groups and four tokens at once (AVX2): each activation
            /// word is broadcast once for both groups' weight vectors. The low and high nibbles'
            /// sub-blocks run as separate passes over a quarter's vectors, so the eight i16 sums
            /// fit the registers. Per (row, token) the same integer sums and float steps as
            /// `tile_q4k`, so the same bits.
            ///
            /// On AMD Zen 3, one core, 64 tokens with the weights in cache: 103 G multiply-adds
            /// a second for two single-group passes, 111 for this one; four tokens with the
            /// weights streamed from memory: 97 against 77 (two streams of weights), so it
            /// runs only where a group's weights serve more than one pass
            /// ([`Packed::pairs_k`]). Only the AVX2 instance calls it (the VNNI instances have
            /// `vpdpbusd`).
            ///
            /// # Safety
            /// As [`gemm`]; `wa` and `wb` equally long.
            #[allow(dead_code)]
            #[target_feature(enable = $feat)]
            pub unsafe fn tile_q4k_pair(
                wa: &[Q4Kx8],
                wb: &[Q4Kx8],
                a: [&[BlockQ8K]; 4],
                out_a: &mut [[f32; ROWS]],
                out_b: &mut [[f32; ROWS]],
            ) {
                debug_assert_eq!(wa.len(), wb.len());
                let low = _mm256_set1_epi8(0x0f);
                let mut acc_a = [_mm256_setzero_ps(); 4];
                let mut acc_b = [_mm256_setzero_ps(); 4];
                for i in 0..wa.len() {
                    let (x, y) = (wa.get_unchecked(i), wb.get_unchecked(i));
                    prefetch(x);
                    prefetch(y);
                    let q = a.map(|r| r.get_unchecked(i));
                    let mut isum_a = [_mm256_setzero_si256(); 4];
                    let mut isum_b = [_mm256_setzero_si256(); 4];
                    for c in 0..4 {
                        let (sx, sy) = (load_pairs(&x.sc[2 * c..]), load_pairs(&y.sc[2 * c..]));
                        for half in 0..2 {
                            let mut sa = [_mm256_setzero_si256(); 4];
                            let mut sb = [_mm256_setzero_si256(); 4];
                            // Rolled (the trip count hidden): unrolled, LLVM hoisted the
                            // broadcasts of several vectors and spilled the sums to the stack.
                            for v in 0..std::hint::black_box(8) {
                                let off = 256 * c + 32 * v;
                                let ra =
                                    _mm256_loadu_si256(x.qs.as_ptr().add(off) as *const __m256i);
                                let rb =
                                    _mm256_loadu_si256(y.qs.as_ptr().add(off) as *const __m256i);
                                let (va, vb) = if half == 0 {
                                    (_mm256_and_si256(ra, low), _mm256_and_si256(rb, low))
                                } else {
                                    (
                                        _mm256_and_si256(_mm256_srli_epi16(ra, 4), low),
                                        _mm256_and_si256(_mm256_srli_epi16(rb, 4), low),
                                    )
                                };
                                let e = 64 * c + 32 * half + 4 * v;
                                for t in 0..4 {
                                    let w = word(&q[t].qs, e);
                                    sa[t] = _mm256_add_epi16(sa[t], _mm256_maddubs_epi16(va, w));
                                    sb[t] = _mm256_add_epi16(sb[t], _mm256_maddubs_epi16(vb, w));
                                }
                            }
                            let (ca, cb) = if half == 0 {
                                (byte_pairs::<0, 0>(sx), byte_pairs::<0, 0>(sy))
                            } else {
                                (byte_pairs::<8, 8>(sx), byte_pairs::<8, 8>(sy))
                            };
                            for t in 0..4 {
                                isum_a[t] =
                                    _mm256_add_epi32(isum_a[t], _mm256_madd_epi16(sa[t], ca));
                                isum_b[t] =
                                    _mm256_add_epi32(isum_b[t], _mm256_madd_epi16(sb[t], cb));
                            }
                        }
                    }
                    q4k_block_end(x, &q, &isum_a, &mut acc_a);
                    q4k_block_end(y, &q, &isum_b, &mut acc_b);
                }
                store(acc_a, out_a);
                store(acc_b, out_b);
            }

            /// Q8_0 over two packed groups and four tokens at once (AVX2): each token's
            /// activation word is broadcast once for both groups' weight vectors, and w's sign
            /// moved onto it for each as in the one-group kernel. Per (row, token) the same
            /// integer sums and float step as that kernel, so the same bits.
            ///
            /// On AMD Zen 3 an asm loop of the two schemes took 11.3 cycles for two weight
            /// vectors against 12.1; like `tile_q4k_pair` it runs only where a group's weights
            /// serve several four-token passes ([`Packed::pairs`]).
            ///
            /// # Safety
            /// As [`gemm`]; `wa` and `wb` equally long.
            #[allow(dead_code)]
            #[target_feature(enable = $feat)]
            pub unsafe fn tile_q8_0_pair(
                wa: &[Q8_0x8],
                wb: &[Q8_0x8],
                a: [&[BlockQ8]; 4],
                out_a: &mut [[f32; ROWS]],
                out_b: &mut [[f32; ROWS]],
            ) {
                debug_assert_eq!(wa.len(), wb.len());
                let ones = _mm256_set1_epi16(1);
                let flip = _mm256_set1_epi8(-128);
                let mut acc_a = [_mm256_setzero_ps(); 4];
                let mut acc_b = [_mm256_setzero_ps(); 4];
                for i in 0..wa.len() {
                    let (x, y) = (wa.get_unchecked(i), wb.get_unchecked(i));
                    prefetch(x);
                    prefetch(y);
                    let q = a.map(|r| r.get_unchecked(i));
                    let mut sa = [_mm256_setzero_si256(); 4];
                    let mut sb = [_mm256_setzero_si256(); 4];
                    // Rolled, as in the one-group kernel's four-token pass (unrolled, LLVM
                    // spills the sign work).
                    for j in 0..std::hint::black_box(8) {
                        let load = |b: &Q8_0x8| {
                            _mm256_xor_si256(
                                _mm256_loadu_si256(b.qs.as_ptr().add(32 * j) as *const __m256i),
                                flip,
                            )
                        };
                        let (ua, ub) = (load(x), load(y));
                        let (aa, ab) = (_mm256_sign_epi8(ua, ua), _mm256_sign_epi8(ub, ub));
                        for t in 0..4 {
                            let w = word(&q[t].qs, 4 * j);
                            let pa = _mm256_maddubs_epi16(aa, _mm256_sign_epi8(w, ua));
                            let pb = _mm256_maddubs_epi16(ab, _mm256_sign_epi8(w, ub));
                            sa[t] = _mm256_add_epi32(sa[t], _mm256_madd_epi16(pa, ones));
                            sb[t] = _mm256_add_epi32(sb[t], _mm256_madd_epi16(pb, ones));
                        }
                    }
                    for t in 0..4 {
                        acc_a[t] = scale_block(acc_a[t], sa[t], x, q[t]);
                        acc_b[t] = scale_block(acc_b[t], sb[t], y, q[t]);
                    }
                }
                store(acc_a, out_a);
                store(acc_b, out_b);
            }

            /// The float step at the end of a Q4_K block, as `tile_q4k` does it: the scaled
            /// integer sums, less the minimums times the activations' 32-value sums.
            #[target_feature(enable = $feat)]
            unsafe fn q4k_block_end<const N: usize>(
                b: &Q4Kx8,
                q: &[&BlockQ8K; N],
                isum: &[__m256i; N],
                acc: &mut [__m256; N],
            ) {
                let (dw, dm) = (scales(&b.d), scales(&b.dmin));
                for t in 0..N {
                    let mut msum = _mm256_setzero_si256();
                    for p in 0..4 {
                        let m = byte_pairs::<0, 8>(load_pairs(&b.mn[2 * p..]));
                        let y = _mm256_set1_epi32(q[t].sums32_pair(p));
                        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, y));
                    }
                    let da = _mm256_set1_ps(q[t].d);
                    acc[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(dw, da), acc[t]);
                    acc[t] =
                        _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dm, da), acc[t]);
                }
            }

            nibble_kernel!($feat, Q4_0x8, |_: &Q4_0x8| None);
            nibble_kernel!($feat, Q4_1x8, |_: &Q4_1x8| None);
            nibble_kernel!($feat, Q5_0x8, |b: &Q5_0x8| Some(&b.qh));
            nibble_kernel!($feat, Q5_1x8, |b: &Q5_1x8| Some(&b.qh));
        }
    };
}

#[cfg(target_arch = "x86_64")]
packed_kernels!(avx2, "avx2,fma,f16c", false, _mm256_dpbusd_avx_epi32);
#[cfg(target_arch = "x86_64")]
packed_kernels!(vnni, "avx2,fma,f16c,avxvnni", true, _mm256_dpbusd_avx_epi32);
#[cfg(target_arch = "x86_64")]
packed_kernels!(
    vnni512,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    true,
    _mm256_dpbusd_epi32
);

/// Whether this CPU runs the 512-bit kernels (the OS-state check included).
#[cfg(target_arch = "x86_64")]
pub fn has_wide() -> bool {
    super::has_avx2()
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512vnni")
}

/// Whether [`Packed::gemm_k2`] takes the 512-bit Q4_K and Q6_K kernels: the CPU runs it, a VNNI
/// instance is the one in use ([`Isa::best`]; `FERRUM_ISA=avx2` or `FERRUM_AVXVNNI=0` keep
/// 256-bit kernels throughout), and `FERRUM_WIDE=0` is not set. Fixed at the first call.
#[cfg(target_arch = "x86_64")]
pub fn wide_k() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| {
        has_wide()
            && matches!(Isa::best(), Isa::AvxVnni | Isa::Avx512Vnni)
            && std::env::var("FERRUM_WIDE").map_or(true, |v| v != "0")
    })
}

/// Q4_K and Q6_K over two packed groups at once: the 256-bit VNNI kernels' arithmetic, lane for lane,
/// on 512-bit registers whose low half holds group A's eight rows and whose high half group
/// B's. One broadcast activation word then feeds sixteen rows, and each `vpdpbusd` does
/// twice the work.
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::*;
    use crate::cpu::quant::q8::prefetch_part_at;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }

    /// Eight rows' unsigned bytes from each group, one per i32 lane.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn widen2(a: &[u8; ROWS], b: &[u8; ROWS]) -> __m512i {
        let lo = _mm_loadl_epi64(a.as_ptr() as *const __m128i);
        let hi = _mm_loadl_epi64(b.as_ptr() as *const __m128i);
        _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi))
    }

    /// Eight rows' signed bytes from each group, one per i32 lane.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn signed2(a: &[i8; ROWS], b: &[i8; ROWS]) -> __m512i {
        let lo = _mm_loadl_epi64(a.as_ptr() as *const __m128i);
        let hi = _mm_loadl_epi64(b.as_ptr() as *const __m128i);
        _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(lo, hi))
    }

    /// Eight rows' f16 scales from each group as f32.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn halves(a: &[f16; ROWS], b: &[f16; ROWS]) -> __m512 {
        let lo = _mm_loadu_si128(a.as_ptr() as *const __m128i);
        let hi = _mm_loadu_si128(b.as_ptr() as *const __m128i);
        _mm512_cvtph_ps(_mm256_set_m128i(hi, lo))
    }

    /// The bytes of rows-of-eight arrays `2p` and `2p + 1` interleaved, group A's in the low
    /// half and group B's in the high half: byte pair `r` of each half is `(v[2p][r], v[2p +
    /// 1][r])`, ready to widen into i16 pairs. `T` is a byte (u8 or i8).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn interleave_pairs<T: Copy>(a: &[[T; ROWS]], b: &[[T; ROWS]], p: usize) -> __m256i {
        const { assert!(std::mem::size_of::<T>() == 1) };
        let ld = |v: &[T; ROWS]| _mm_loadl_epi64(v.as_ptr() as *const __m128i);
        let lo = _mm_unpacklo_epi8(ld(&a[2 * p]), ld(&a[2 * p + 1]));
        let hi = _mm_unpacklo_epi8(ld(&b[2 * p]), ld(&b[2 * p + 1]));
        _mm256_set_m128i(hi, lo)
    }

    /// Lane `r` of each group as the i16 pair `(v[2p][r], v[2p + 1][r])`, zero-extended.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn pairs_u8(a: &[[u8; ROWS]; 8], b: &[[u8; ROWS]; 8], p: usize) -> __m512i {
        _mm512_cvtepu8_epi16(interleave_pairs(a, b, p))
    }

    /// As [`pairs_u8`], for signed bytes (Q6_K's and IQ4_XS's scales), sign-extended.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn pairs_i8(a: &[[i8; ROWS]], b: &[[i8; ROWS]], p: usize) -> __m512i {
        _mm512_cvtepi8_epi16(interleave_pairs(a, b, p))
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn word(qs: &[i8], e: usize) -> __m512i {
        debug_assert!(e + 4 <= qs.len());
        _mm512_set1_epi32((qs.as_ptr().add(e) as *const i32).read_unaligned())
    }

    /// A two-group tile over `N` tokens; the last argument is how far ahead of each block to
    /// prefetch (the next pair's block), or 0 for not at all (the passes after the first over
    /// a pair find its blocks in cache).
    pub type Tile2<W, A, const N: usize> =
        unsafe fn(&[W], &[W], [&[A]; N], &mut [[f32; ROWS]], &mut [[f32; ROWS]], usize);

    /// Any number of tokens, four per pass, with the tiles of one layout.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F/BW/VL/VNNI; every activation row has `a.len()` blocks; the
    /// groups have as many blocks each; `out_a` and `out_b` are as long as `acts`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn gemm2<W, A>(
        a: &[W],
        b: &[W],
        acts: &[&[A]],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
        t1: Tile2<W, A, 1>,
        t2: Tile2<W, A, 2>,
        t3: Tile2<W, A, 3>,
        t4: Tile2<W, A, 4>,
        t8: Option<Tile2<W, A, 8>>,
    ) {
        // The groups of a matrix lie one after the other: the next pair starts two groups on.
        let ahead = 2 * std::mem::size_of_val(a);
        let mut t = 0;
        while t < acts.len() {
            let (oa, ob) = (&mut out_a[t..], &mut out_b[t..]);
            let x = &acts[t..];
            let pf = if t == 0 { ahead } else { 0 };
            if let (Some(t8), Ok(x8)) = (t8, <[&[A]; 8]>::try_from(&x[..x.len().min(8)])) {
                t8(a, b, x8, oa, ob, pf);
                t += 8;
                continue;
            }
            match x.len() {
                1 => t1(a, b, [x[0]], oa, ob, pf),
                2 => t2(a, b, [x[0], x[1]], oa, ob, pf),
                3 => t3(a, b, [x[0], x[1], x[2]], oa, ob, pf),
                _ => t4(a, b, [x[0], x[1], x[2], x[3]], oa, ob, pf),
            }
            t += 4;
        }
    }

    /// The low half of each accumulator to `out_a`, the high half to `out_b`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn store2<const N: usize>(
        acc: [__m512; N],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
    ) {
        for t in 0..N {
            let v = _mm512_castps_pd(acc[t]);
            _mm256_storeu_ps(
                out_a[t].as_mut_ptr(),
                _mm256_castpd_ps(_mm512_castpd512_pd256(v)),
            );
            _mm256_storeu_ps(
                out_b[t].as_mut_ptr(),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(v, 1)),
            );
        }
    }

    /// Q8_0: the 256-bit VNNI kernel's arithmetic per lane (`tile_bytes`) — each token's two
    /// chains of `vpdpbusd` over the weights plus 128, the first from −128 · Σ a, their sum
    /// times the two scales —, group A's rows in the low half of each register, group B's in
    /// the high half, so one broadcast activation word feeds sixteen rows.
    ///
    /// # Safety
    /// As [`gemm2`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn tile_q8_0<const N: usize>(
        wa: &[Q8_0x8],
        wb: &[Q8_0x8],
        q: [&[BlockQ8]; N],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
        pf: usize,
    ) {
        let mut acc = [_mm512_setzero_ps(); N];
        for i in 0..wa.len() {
            let (x, y) = (wa.get_unchecked(i), wb.get_unchecked(i));
            if pf > 0 {
                prefetch_part_at(x, 0, 1, pf);
                prefetch_part_at(y, 0, 1, pf);
            }
            let q = q.map(|r| r.get_unchecked(i));
            // Two chains a token (four for one token, whose chains would otherwise wait on
            // the `vpdpbusd` latency); integer sums, so the same bits.
            let chains = if N == 1 { 4 } else { 2 };
            let mut d = [[_mm512_setzero_si512(); N]; 4];
            for t in 0..N {
                d[0][t] = _mm512_set1_epi32(q[t].offset);
            }
            let (px, py) = (x.qs.as_ptr(), y.qs.as_ptr());
            for j in 0..8 {
                let u = join(
                    _mm256_loadu_si256(px.add(32 * j) as *const __m256i),
                    _mm256_loadu_si256(py.add(32 * j) as *const __m256i),
                );
                let k = j % chains;
                for t in 0..N {
                    d[k][t] = _mm512_dpbusd_epi32(d[k][t], u, word(&q[t].qs, 4 * j));
                }
            }
            if chains == 4 {
                let [d0, d1, d2, d3] = &mut d;
                for (a, b) in d0
                    .iter_mut()
                    .zip(d2.iter())
                    .chain(d1.iter_mut().zip(d3.iter()))
                {
                    *a = _mm512_add_epi32(*a, *b);
                }
            }
            let dw = halves(&x.d, &y.d);
            for t in 0..N {
                acc[t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_add_epi32(d[0][t], d[1][t])),
                    _mm512_mul_ps(dw, _mm512_set1_ps(q[t].d)),
                    acc[t],
                );
            }
        }
        store2(acc, out_a, out_b)
    }

    /// Q6_K: the 256-bit VNNI kernel's arithmetic per lane — each 16-value sub-block's
    /// `vpdpbusd` sums times its signed scale, the −32 offset through the activation's sums.
    ///
    /// # Safety
    /// As [`gemm2`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn tile_q6k<const N: usize>(
        wa: &[Q6Kx8],
        wb: &[Q6Kx8],
        q: [&[BlockQ8K]; N],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
        pf: usize,
    ) {
        let mut acc = [_mm512_setzero_ps(); N];
        for i in 0..wa.len() {
            let (x, y) = (wa.get_unchecked(i), wb.get_unchecked(i));
            let q = q.map(|r| r.get_unchecked(i));
            let mut isum = [_mm512_setzero_si512(); N];
            for n in 0..2 {
                for h in 0..2 {
                    q6k_part(x, y, n, h, &q, &mut isum, pf);
                }
            }
            let dw = halves(&x.d, &y.d);
            // Σ scale · (16-value activation sum), two sub-blocks per `madd`.
            let mut offs = [_mm512_setzero_si512(); N];
            for p in 0..8 {
                let sc = pairs_i8(&x.sc, &y.sc, p);
                for t in 0..N {
                    let bs = &q[t].bsums;
                    let w = (bs[2 * p] as u16 as u32) | ((bs[2 * p + 1] as u16 as u32) << 16);
                    let s = _mm512_set1_epi32(w as i32);
                    offs[t] = _mm512_add_epi32(offs[t], _mm512_madd_epi16(sc, s));
                }
            }
            for t in 0..N {
                let isum = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(offs[t], 5));
                acc[t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(isum),
                    _mm512_mul_ps(dw, _mm512_set1_ps(q[t].d)),
                    acc[t],
                );
            }
        }
        store2(acc, out_a, out_b)
    }

    /// Part `h` of half `n` of both groups' Q6_K blocks into each token's integer sum: the
    /// four 16-value sub-blocks `8n + 2k + h` (k = 0..4), whose quants share their low-bit
    /// vectors two by two and their high-bit vectors four by four, so each is loaded once;
    /// each sub-block's `vpdpbusd` sums times its signed scale.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_part<const N: usize>(
        x: &Q6Kx8,
        y: &Q6Kx8,
        n: usize,
        h: usize,
        q: &[&BlockQ8K; N],
        isum: &mut [__m512i; N],
        pf: usize,
    ) {
        // `a | (b & c)`, one instruction.
        const OR_AND: i32 = 0xf8;
        let low = _mm512_set1_epi8(0x0f);
        let m30 = _mm512_set1_epi8(0x30);
        if pf > 0 {
            prefetch_part_at(x, 2 * n + h, 4, pf);
            prefetch_part_at(y, 2 * n + h, 4, pf);
        }
        // Vector `at / 32` of both groups' byte arrays, A's in the low half.
        let pair = |a: &[u8], b: &[u8], at: usize| {
            debug_assert!(at + 32 <= a.len() && at + 32 <= b.len());
            join(
                _mm256_loadu_si256(a.as_ptr().add(at) as *const __m256i),
                _mm256_loadu_si256(b.as_ptr().add(at) as *const __m256i),
            )
        };
        let mut d = [[_mm512_setzero_si512(); N]; 4];
        for wi in 4 * h..4 * h + 4 {
            let l0 = pair(&x.ql, &y.ql, 32 * (16 * n + wi));
            let l1 = pair(&x.ql, &y.ql, 32 * (16 * n + 8 + wi));
            let hb = pair(&x.qh, &y.qh, 32 * (8 * n + wi));
            // Quarter k: the low (k < 2) or high nibbles of l0 / l1, and bits 2k, 2k + 1 of
            // the high-bit byte as bits 4 and 5 (16-bit shifts: the mask drops what crosses
            // a byte).
            let v = [
                _mm512_ternarylogic_epi32::<OR_AND>(
                    _mm512_and_si512(l0, low),
                    _mm512_slli_epi16(hb, 4),
                    m30,
                ),
                _mm512_ternarylogic_epi32::<OR_AND>(
                    _mm512_and_si512(l1, low),
                    _mm512_slli_epi16(hb, 2),
                    m30,
                ),
                _mm512_ternarylogic_epi32::<OR_AND>(
                    _mm512_and_si512(_mm512_srli_epi16(l0, 4), low),
                    hb,
                    m30,
                ),
                _mm512_ternarylogic_epi32::<OR_AND>(
                    _mm512_and_si512(_mm512_srli_epi16(l1, 4), low),
                    _mm512_srli_epi16(hb, 2),
                    m30,
                ),
            ];
            for (k, (dk, vk)) in d.iter_mut().zip(v).enumerate() {
                let e = 128 * n + 32 * k + 4 * wi;
                for t in 0..N {
                    dk[t] = _mm512_dpbusd_epi32(dk[t], vk, word(&q[t].qs, e));
                }
            }
        }
        for (k, dk) in d.iter().enumerate() {
            let si = 8 * n + 2 * k + h;
            let sc = signed2(&x.sc[si], &y.sc[si]);
            for t in 0..N {
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(dk[t], sc));
            }
        }
    }

    /// IQ4_XS: the 256-bit VNNI kernel's arithmetic per lane — each sub-block's `vpdpbusd`
    /// sums over the levels plus 128 times its signed scale, then 128 · Σ scale · (the
    /// activation's 32-value sum) taken off.
    ///
    /// # Safety
    /// As [`gemm2`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn tile_iq4xs<const N: usize>(
        wa: &[Iq4Xsx8],
        wb: &[Iq4Xsx8],
        q: [&[BlockQ8K]; N],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
        pf: usize,
    ) {
        let low = _mm512_set1_epi8(0x0f);
        let table =
            _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_PLUS_128.as_ptr() as *const __m128i));
        let mut acc = [_mm512_setzero_ps(); N];
        for i in 0..wa.len() {
            let (x, y) = (wa.get_unchecked(i), wb.get_unchecked(i));
            let q = q.map(|r| r.get_unchecked(i));
            let mut isum = [_mm512_setzero_si512(); N];
            for ib in 0..8 {
                if pf > 0 && ib % 2 == 0 {
                    prefetch_part_at(x, ib / 2, 4, pf);
                    prefetch_part_at(y, ib / 2, 4, pf);
                }
                let (px, py) = (x.qs.as_ptr().add(128 * ib), y.qs.as_ptr().add(128 * ib));
                // Two chains a token (low and high nibbles) for up to four tokens, so that
                // consecutive `vpdpbusd`s need not wait on each other; eight tokens are chains
                // enough (and two each would not fit the registers).
                const { assert!(N <= 8) };
                let two = N <= 4;
                let mut d = [[_mm512_setzero_si512(); N]; 2];
                for v in 0..4 {
                    let raw = join(
                        _mm256_loadu_si256(px.add(32 * v) as *const __m256i),
                        _mm256_loadu_si256(py.add(32 * v) as *const __m256i),
                    );
                    let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low));
                    let hi = _mm512_shuffle_epi8(
                        table,
                        _mm512_and_si512(_mm512_srli_epi16(raw, 4), low),
                    );
                    let e = 32 * ib + 4 * v;
                    for t in 0..N {
                        d[0][t] = _mm512_dpbusd_epi32(d[0][t], lo, word(&q[t].qs, e));
                        let c = usize::from(two);
                        d[c][t] = _mm512_dpbusd_epi32(d[c][t], hi, word(&q[t].qs, e + 16));
                    }
                }
                let sc = signed2(&x.sc[ib], &y.sc[ib]);
                for t in 0..N {
                    let s = if two {
                        _mm512_add_epi32(d[0][t], d[1][t])
                    } else {
                        d[0][t]
                    };
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s, sc));
                }
            }
            let sc: [__m512i; 4] = std::array::from_fn(|p| pairs_i8(&x.sc, &y.sc, p));
            let dw = halves(&x.d, &y.d);
            for t in 0..N {
                let mut off = _mm512_setzero_si512();
                for (p, sc) in sc.iter().enumerate() {
                    let s = _mm512_set1_epi32(q[t].sums32_pair(p));
                    off = _mm512_add_epi32(off, _mm512_madd_epi16(*sc, s));
                }
                let isum = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(off, 7));
                acc[t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(isum),
                    _mm512_mul_ps(dw, _mm512_set1_ps(q[t].d)),
                    acc[t],
                );
            }
        }
        store2(acc, out_a, out_b)
    }

    /// # Safety
    /// As [`gemm2`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn tile_q4k<const N: usize>(
        wa: &[Q4Kx8],
        wb: &[Q4Kx8],
        q: [&[BlockQ8K]; N],
        out_a: &mut [[f32; ROWS]],
        out_b: &mut [[f32; ROWS]],
        pf: usize,
    ) {
        let low = _mm512_set1_epi8(0x0f);
        let high = _mm512_set1_epi8(0xf0u8 as i8);
        let mut acc = [_mm512_setzero_ps(); N];
        for i in 0..wa.len() {
            let (x, y) = (wa.get_unchecked(i), wb.get_unchecked(i));
            let q = q.map(|r| r.get_unchecked(i));
            let mut isum = [_mm512_setzero_si512(); N];
            for c in 0..4 {
                if pf > 0 {
                    prefetch_part_at(x, c, 4, pf);
                    prefetch_part_at(y, c, 4, pf);
                }
                let (px, py) = (x.qs.as_ptr().add(256 * c), y.qs.as_ptr().add(256 * c));
                // Each sum in two chains (even and odd vectors) for one token, whose two
                // chains of eight dependent `vpdpbusd`s would otherwise wait on their latency
                // (decode); more tokens are chains enough. Integer sums: the same bits.
                let chains = if N == 1 { 2 } else { 1 };
                let mut s_lo = [[_mm512_setzero_si512(); N]; 2];
                let mut s_hi = [[_mm512_setzero_si512(); N]; 2];
                // No branch in this loop, so that it unrolls: eight vectors of both groups.
                for v in 0..8 {
                    let raw = join(
                        _mm256_loadu_si256(px.add(32 * v) as *const __m256i),
                        _mm256_loadu_si256(py.add(32 * v) as *const __m256i),
                    );
                    let lo = _mm512_and_si512(raw, low);
                    // The high nibbles in place, sixteen times their value: one shift of the
                    // sums below instead of one of the bytes here.
                    let hi = _mm512_and_si512(raw, high);
                    let e = 64 * c + 4 * v;
                    let k = v % chains;
                    for t in 0..N {
                        s_lo[k][t] = _mm512_dpbusd_epi32(s_lo[k][t], lo, word(&q[t].qs, e));
                        s_hi[k][t] = _mm512_dpbusd_epi32(s_hi[k][t], hi, word(&q[t].qs, e + 32));
                    }
                }
                for t in 0..N {
                    if chains == 2 {
                        s_lo[0][t] = _mm512_add_epi32(s_lo[0][t], s_lo[1][t]);
                        s_hi[0][t] = _mm512_add_epi32(s_hi[0][t], s_hi[1][t]);
                    }
                    // Exact: every product was a multiple of 16 (|sum| < 2^21).
                    s_hi[0][t] = _mm512_srai_epi32(s_hi[0][t], 4);
                }
                let (s_lo, s_hi) = (&s_lo[0], &s_hi[0]);
                let sc_lo = widen2(&x.sc[2 * c], &y.sc[2 * c]);
                let sc_hi = widen2(&x.sc[2 * c + 1], &y.sc[2 * c + 1]);
                for t in 0..N {
                    let p = _mm512_add_epi32(
                        _mm512_mullo_epi32(s_lo[t], sc_lo),
                        _mm512_mullo_epi32(s_hi[t], sc_hi),
                    );
                    isum[t] = _mm512_add_epi32(isum[t], p);
                }
            }
            let (dw, dm) = (halves(&x.d, &y.d), halves(&x.dmin, &y.dmin));
            // Σ over sub-blocks of min · (its activation sum), two sub-blocks per `madd`: the
            // 256-bit kernels' integers (a min is at most 63 and a sum of 32 activations fits
            // in 16 bits).
            let mins: [__m512i; 4] = std::array::from_fn(|p| pairs_u8(&x.mn, &y.mn, p));
            for t in 0..N {
                let mut msum = _mm512_setzero_si512();
                for (p, m) in mins.iter().enumerate() {
                    let y = _mm512_set1_epi32(q[t].sums32_pair(p));
                    msum = _mm512_add_epi32(msum, _mm512_madd_epi16(*m, y));
                }
                let da = _mm512_set1_ps(q[t].d);
                acc[t] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dw, da), acc[t]);
                acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dm, da), acc[t]);
            }
        }
        store2(acc, out_a, out_b)
    }
}
