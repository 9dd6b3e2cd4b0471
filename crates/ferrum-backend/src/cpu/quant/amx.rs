//! AMX int8 tiles (Intel Sapphire Rapids and later) for prefill: two packed groups (16 weight
//! rows) against sixteen tokens per tile product, over the packed layouts made at load.
//!
//! One `tdpbsud` multiplies a tile of sixteen tokens' signed activation bytes (A: 16 rows of
//! K bytes) by a tile of sixteen weight rows' unsigned quants (B: K/4 rows of sixteen 4-byte
//! groups, the VNNI order the packed layouts already use), giving each (token, row) pair's
//! exact integer sum over K values in one 16×16 int32 tile. Where a scale is an integer it
//! is folded into the weight bytes so the products run over the whole 256-value
//! super-block: Q4_K/Q5_K's 6-bit sub-block scales in two parts (`8·hi + lo`, each product
//! under 256), Q6_K's signed 8-bit ones in three digits (`d₀ + 8·d₁ + 64·d₂`, each in
//! −3..=4, times the offset quant `q − 32`: signed bytes, `tdpbssd`). Where a scale is a
//! float (the 32-value formats) each block gets its own product. The tiles are stored and
//! AVX-512 applies the rest in the scalar twins' order; so every (row, token) gets the bits
//! of [`Packed::gemm_k_scalar`] / [`Packed::gemm_scalar`], as every other instance does, and
//! a token's result does not depend on whether its pass used tiles.
//!
//! A pass goes block by block: the block of both groups is unpacked (nibbles and high bits
//! to bytes, scales folded in) into a scratch that stays in L1 and then multiplied by every
//! token, two tiles of sixteen tokens against each weight tile (the 2×2 blocking that keeps
//! the tile unit busy: a weight tile loaded once per 32 tokens). Activations are read in
//! place when the tokens' rows are equally spaced, as a matmul's are; otherwise they are
//! copied into a scratch tile.
//!
//! The tile instructions sit behind [`Tiles`], with two instances: [`Amx`] (the
//! instructions, only where [`hardware`] says the CPU runs them and Linux granted the tile
//! state) and [`Emulated`], which does the instructions' documented arithmetic in plain code.
//! Tests run the kernels on both where the CPU has AMX, and on the emulation (with the same
//! AVX-512 code around it) on any CPU with AVX-512 F/BW/VL; so everything but the tile
//! instructions themselves is held to the scalar twins on machines without AMX too.
//!
//! Measured on an Intel Xeon with AMX (2 vCPUs, a shared host): the 2×2 tile loop runs at
//! 2.4–5.3 T int8 ops/s a core (`peak/tdpbsud_2x2`), against 0.96 T for 512-bit
//! `vpdpbusd`; see docs/performance.md for the passes' figures.

use std::cell::RefCell;

use super::k_quants::QK_K;
use super::packed::{BlockX8, K4x8, Offset, Packed, Q4_0x8, Q4_1x8, Q6Kx8, Q8_0x8, ROWS};
use super::q8::{BlockQ8, BlockQ8K};

/// Rows per tile pass: two packed groups.
pub const PAIR: usize = 2 * ROWS;
/// Tokens per tile (the tile's rows).
pub const TOKENS: usize = 16;
/// Fewest tokens a pass takes the tiles for: below this a tile is mostly empty rows and the
/// 512-bit VNNI kernels are as fast.
pub const MIN_TOKENS: usize = 16;

/// The tile configuration `ldtilecfg` reads (palette 1).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<Config>() == 64);

impl Config {
    /// Two sets of (A, B, C) tiles, set `s` in tiles `3s`, `3s + 1`, `3s + 2`: A is sixteen
    /// rows of `k` activation bytes, B `k / 4` rows of 64 weight bytes, C sixteen rows of
    /// sixteen int32.
    pub fn new(k: usize) -> Config {
        assert!(k.is_multiple_of(4) && (4..=64).contains(&k));
        let mut c = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for s in 0..2 {
            c.colsb[3 * s] = k as u16;
            c.rows[3 * s] = TOKENS as u8;
            c.colsb[3 * s + 1] = 64;
            c.rows[3 * s + 1] = (k / 4) as u8;
            c.colsb[3 * s + 2] = 64;
            c.rows[3 * s + 2] = TOKENS as u8;
        }
        c
    }

    /// Every tile sixteen rows of 64 bytes: the accumulating forms. Tiles 0 and 1 hold
    /// activations (A), 2 and 3 weights (B), 4 to 7 sums (C); [`Tiles::dot_pairs`] uses all
    /// eight, [`Tiles::dot_digits`] tiles 0 to 6 (A in 0, B in 1 to 3, C in 4 to 6).
    pub fn full() -> Config {
        let mut c = Config::new(64);
        for t in 0..8 {
            c.colsb[t] = 64;
            c.rows[t] = 16;
        }
        c
    }
}

/// The tile operations the kernels use.
pub trait Tiles {
    /// Loads `cfg` (`ldtilecfg`).
    ///
    /// # Safety
    /// For [`Amx`]: the CPU runs AMX-INT8 and the process has the tile state ([`hardware`]).
    unsafe fn configure(&mut self, cfg: &Config);

    /// Tile set `set` (0 or 1): loads A from `a` (rows `stride` bytes apart) and B from `b`
    /// (rows 64 bytes apart), zeroes C, adds A·B (`tdpbsud`: A's bytes signed, B's
    /// unsigned; `C[m][n] = Σ_k Σ_i A[m][4k + i]·B[k][4n + i]`) and stores C at `c` (rows of
    /// sixteen int32, 64 bytes apart).
    ///
    /// # Safety
    /// As `configure`, after it; `a` readable for 16 rows of `k` bytes at `stride`, `b` for
    /// `k / 4` rows of 64, `c` writable for 256 int32.
    unsafe fn dot(&mut self, set: usize, a: *const u8, stride: usize, b: *const u8, c: *mut i32);

    /// [`Config::full`]: zeroes C tiles 4 to 7.
    ///
    /// # Safety
    /// As `configure`, after [`Config::full`].
    unsafe fn zero_c(&mut self);

    /// [`Config::full`], two token tiles against two weight tiles: loads A tiles 0 and 1 from
    /// `a0` and `a1` (rows `s0` and `s1` apart) and B tiles 2 and 3 from `lo` and `hi` (rows
    /// 64 apart), then adds (`tdpbsud`) A₀·B₂ to tile 4, A₀·B₃ to 5, A₁·B₂ to 6, A₁·B₃ to 7:
    /// each weight tile loaded once for 32 tokens.
    ///
    /// # Safety
    /// As `zero_c`; `a0`, `a1` readable for 16 rows of 64 bytes at their strides, `lo` and
    /// `hi` for 16 rows of 64.
    unsafe fn dot_pairs(
        &mut self,
        a0: *const u8,
        s0: usize,
        a1: *const u8,
        s1: usize,
        lo: *const u8,
        hi: *const u8,
    );

    /// [`Config::full`], signed weights (`tdpbssd`): loads A tile 0 from `a` (rows `stride`
    /// apart) and B tiles 1 to 3 from `b`, `b + plane` and `b + 2·plane` (rows 64 apart),
    /// then adds A·B₁ to tile 4, A·B₂ to 5 and A·B₃ to 6.
    ///
    /// # Safety
    /// As `zero_c`; `a` readable for 16 rows of 64 bytes at `stride`, `b` for three planes
    /// `plane` bytes apart of 16 rows of 64.
    unsafe fn dot_digits(&mut self, a: *const u8, stride: usize, b: *const u8, plane: usize);

    /// [`Config::full`]: stores the first `n` (3 or 4) C tiles, tile 4 + i at `c + 256·i`
    /// (rows of sixteen int32).
    ///
    /// # Safety
    /// As `zero_c`; `c` writable for `256·n` int32.
    unsafe fn store_c(&mut self, c: *mut i32, n: usize);

    /// Gives the tile state back (`tilerelease`), so the OS need not save it.
    ///
    /// # Safety
    /// As `configure`.
    unsafe fn release(&mut self);
}

/// The tile instructions.
pub struct Amx;

#[cfg(target_arch = "x86_64")]
impl Tiles for Amx {
    #[inline(always)]
    unsafe fn configure(&mut self, cfg: &Config) {
        // SAFETY: the contract; `cfg` is 64 readable bytes.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) cfg as *const Config, options(nostack, readonly))
        }
    }

    #[inline(always)]
    unsafe fn dot(&mut self, set: usize, a: *const u8, stride: usize, b: *const u8, c: *mut i32) {
        // Two sets, so one product's store overlaps the next one's loads.
        // SAFETY: the contract.
        unsafe {
            if set == 0 {
                std::arch::asm!(
                    "tileloadd tmm0, [{a} + {s}*1]",
                    "tileloadd tmm1, [{b} + {n}*1]",
                    "tilezero tmm2",
                    "tdpbsud tmm2, tmm0, tmm1",
                    "tilestored [{c} + {n}*1], tmm2",
                    a = in(reg) a, s = in(reg) stride, b = in(reg) b, c = in(reg) c,
                    n = in(reg) 64usize, options(nostack)
                )
            } else {
                std::arch::asm!(
                    "tileloadd tmm3, [{a} + {s}*1]",
                    "tileloadd tmm4, [{b} + {n}*1]",
                    "tilezero tmm5",
                    "tdpbsud tmm5, tmm3, tmm4",
                    "tilestored [{c} + {n}*1], tmm5",
                    a = in(reg) a, s = in(reg) stride, b = in(reg) b, c = in(reg) c,
                    n = in(reg) 64usize, options(nostack)
                )
            }
        }
    }

    #[inline(always)]
    unsafe fn zero_c(&mut self) {
        // SAFETY: the contract.
        unsafe {
            std::arch::asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                options(nostack, nomem)
            )
        }
    }

    #[inline(always)]
    unsafe fn dot_pairs(
        &mut self,
        a0: *const u8,
        s0: usize,
        a1: *const u8,
        s1: usize,
        lo: *const u8,
        hi: *const u8,
    ) {
        // SAFETY: the contract.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm2, [{lo} + {n}*1]",
                "tileloadd tmm0, [{a0} + {s0}*1]",
                "tdpbsud tmm4, tmm0, tmm2",
                "tileloadd tmm3, [{hi} + {n}*1]",
                "tdpbsud tmm5, tmm0, tmm3",
                "tileloadd tmm1, [{a1} + {s1}*1]",
                "tdpbsud tmm6, tmm1, tmm2",
                "tdpbsud tmm7, tmm1, tmm3",
                a0 = in(reg) a0, s0 = in(reg) s0, a1 = in(reg) a1, s1 = in(reg) s1,
                lo = in(reg) lo, hi = in(reg) hi, n = in(reg) 64usize,
                options(nostack, readonly)
            )
        }
    }

    #[inline(always)]
    unsafe fn dot_digits(&mut self, a: *const u8, stride: usize, b: *const u8, plane: usize) {
        // SAFETY: the contract.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm0, [{a} + {s}*1]",
                "tileloadd tmm1, [{b} + {n}*1]",
                "tdpbssd tmm4, tmm0, tmm1",
                "tileloadd tmm2, [{b1} + {n}*1]",
                "tdpbssd tmm5, tmm0, tmm2",
                "tileloadd tmm3, [{b2} + {n}*1]",
                "tdpbssd tmm6, tmm0, tmm3",
                a = in(reg) a, s = in(reg) stride, b = in(reg) b,
                b1 = in(reg) b.add(plane), b2 = in(reg) b.add(2 * plane),
                n = in(reg) 64usize, options(nostack, readonly)
            )
        }
    }

    #[inline(always)]
    unsafe fn store_c(&mut self, c: *mut i32, n: usize) {
        // SAFETY: the contract.
        unsafe {
            std::arch::asm!(
                "tilestored [{c} + {n}*1], tmm4",
                "tilestored [{c1} + {n}*1], tmm5",
                "tilestored [{c2} + {n}*1], tmm6",
                c = in(reg) c, c1 = in(reg) c.add(256), c2 = in(reg) c.add(512),
                n = in(reg) 64usize, options(nostack)
            );
            if n > 3 {
                std::arch::asm!(
                    "tilestored [{c} + {n}*1], tmm7",
                    c = in(reg) c.add(768), n = in(reg) 64usize, options(nostack)
                );
            }
        }
    }

    #[inline(always)]
    unsafe fn release(&mut self) {
        // SAFETY: the contract.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) }
    }
}

/// The tile instructions' arithmetic in plain code, for tests on CPUs without AMX: eight
/// tiles of up to 1 KiB, shaped by the loaded [`Config`], and `tileloadd`, `tilezero`,
/// `tdpbsud` and `tilestored` on them as the instruction set reference defines them.
pub struct Emulated {
    cfg: Config,
    tiles: Box<[[u8; 1024]; 8]>,
}

impl Default for Emulated {
    fn default() -> Self {
        Emulated {
            cfg: Config::new(4),
            tiles: Box::new([[0; 1024]; 8]),
        }
    }
}

impl Emulated {
    fn shape(&self, t: usize) -> (usize, usize) {
        (self.cfg.rows[t] as usize, self.cfg.colsb[t] as usize)
    }

    /// # Safety
    /// `p` readable for the tile's rows of its bytes, `stride` apart.
    unsafe fn load(&mut self, t: usize, p: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(t);
        for r in 0..rows {
            for c in 0..colsb {
                // SAFETY: the contract.
                self.tiles[t][64 * r + c] = unsafe { *p.add(r * stride + c) };
            }
        }
    }

    /// # Safety
    /// `p` writable for the tile's rows of its bytes, `stride` apart.
    unsafe fn store(&self, t: usize, p: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(t);
        for r in 0..rows {
            for c in 0..colsb {
                // SAFETY: the contract.
                unsafe { *p.add(r * stride + c) = self.tiles[t][64 * r + c] };
            }
        }
    }

    fn zero(&mut self, t: usize) {
        self.tiles[t] = [0; 1024];
    }

    /// `tdpbsud c, a, b`: C[m][n] += Σ_k Σ_i sext(A[m][4k + i])·zext(B[k][4n + i]); with
    /// `signed`, `tdpbssd` (B's bytes sign-extended too).
    fn dpbsud(&mut self, c: usize, a: usize, b: usize, signed: bool) {
        let (m, k) = self.shape(a);
        let (kb, nb) = self.shape(b);
        let (mc, nc) = self.shape(c);
        assert!(
            m == mc && k / 4 == kb && nb == nc,
            "tdpbsud: tile shapes disagree"
        );
        for row in 0..m {
            for col in 0..nc / 4 {
                let at = 64 * row + 4 * col;
                let old = i32::from_le_bytes(self.tiles[c][at..at + 4].try_into().expect("4"));
                let mut sum = old;
                for kk in 0..k / 4 {
                    for i in 0..4 {
                        let x = self.tiles[a][64 * row + 4 * kk + i] as i8 as i32;
                        let y = self.tiles[b][64 * kk + 4 * col + i];
                        let y = if signed { y as i8 as i32 } else { y as i32 };
                        sum = sum.wrapping_add(x * y);
                    }
                }
                self.tiles[c][at..at + 4].copy_from_slice(&sum.to_le_bytes());
            }
        }
    }
}

impl Tiles for Emulated {
    unsafe fn configure(&mut self, cfg: &Config) {
        self.cfg = *cfg;
        // `ldtilecfg` zeroes every tile.
        self.tiles.iter_mut().for_each(|t| *t = [0; 1024]);
    }

    unsafe fn dot(&mut self, set: usize, a: *const u8, stride: usize, b: *const u8, c: *mut i32) {
        let t = 3 * set;
        // SAFETY: the contract.
        unsafe {
            self.load(t, a, stride);
            self.load(t + 1, b, 64);
            self.zero(t + 2);
            self.dpbsud(t + 2, t, t + 1, false);
            self.store(t + 2, c as *mut u8, 64);
        }
    }

    unsafe fn zero_c(&mut self) {
        (4..8).for_each(|t| self.zero(t));
    }

    unsafe fn dot_pairs(
        &mut self,
        a0: *const u8,
        s0: usize,
        a1: *const u8,
        s1: usize,
        lo: *const u8,
        hi: *const u8,
    ) {
        // SAFETY: the contract.
        unsafe {
            self.load(0, a0, s0);
            self.load(1, a1, s1);
            self.load(2, lo, 64);
            self.load(3, hi, 64);
        }
        self.dpbsud(4, 0, 2, false);
        self.dpbsud(5, 0, 3, false);
        self.dpbsud(6, 1, 2, false);
        self.dpbsud(7, 1, 3, false);
    }

    unsafe fn dot_digits(&mut self, a: *const u8, stride: usize, b: *const u8, plane: usize) {
        // SAFETY: the contract.
        unsafe {
            self.load(0, a, stride);
            for i in 0..3 {
                self.load(1 + i, b.add(i * plane), 64);
            }
        }
        for i in 0..3 {
            self.dpbsud(4 + i, 0, 1 + i, true);
        }
    }

    unsafe fn store_c(&mut self, c: *mut i32, n: usize) {
        for i in 0..n {
            // SAFETY: the contract.
            unsafe { self.store(4 + i, c.add(256 * i) as *mut u8, 64) };
        }
    }

    unsafe fn release(&mut self) {}
}

/// Whether this CPU runs AMX-INT8 with the kernels' AVX-512 (F, BW, VL) and the OS lets this
/// process use the tile state: CPUID's AMX-TILE and AMX-INT8 bits, XCR0's tile bits (the OS
/// saves the state), Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM)` granted, and a small product
/// on the tiles equal to its emulation. Asked once; the permission is the process's.
pub fn hardware() -> bool {
    static HW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HW.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // SAFETY: the features are checked before each instruction that needs them.
            unsafe { detect() }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// Which tiles prefill passes take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// None: the VNNI kernels throughout.
    Off,
    /// The AMX instructions ([`hardware`]).
    Amx,
    /// [`Emulated`] tiles (`FERRUM_AMX=emulate` on a CPU with the kernels' AVX-512): slow,
    /// for tests of the whole pass on machines without AMX.
    Emulated,
}

/// The tiles prefill passes take, fixed at the first call: the AMX ones where
/// [`hardware`] says they run, unless `FERRUM_AMX=0` (to measure the 512-bit VNNI kernels
/// on the same machine); `FERRUM_AMX=emulate` for [`Mode::Emulated`].
pub fn mode() -> Mode {
    static MODE: std::sync::OnceLock<Mode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("FERRUM_AMX").as_deref() {
        Ok("0") => Mode::Off,
        Ok("emulate") if vectors_run() => Mode::Emulated,
        _ if hardware() => Mode::Amx,
        _ => Mode::Off,
    })
}

/// Whether a pass of `tokens` tokens over `p` takes the tiles: the K-quant layouts, whose
/// integer scales fold into the weights so that a product spans a 256-value super-block, at
/// [`MIN_TOKENS`]; the 32-value formats only in passes of [`MIN_TOKENS_32`]. Their float
/// scale per block needs its own half-width product and stored sums: on an Intel Xeon with
/// AMX a 1B-shape Q8_0 or Q4_0 prefill (the decoder's passes of 64 tokens) ran at 164–171
/// tok/s on them against 208–215 without, while an encoder's passes of 256 tokens
/// (all-MiniLM-L6-v2 in Q8_0, 1,000 sentences) ran at 446 sentences/s against 403.
pub fn pays(p: &Packed, tokens: usize) -> bool {
    if p.is_k_quant() {
        tokens >= MIN_TOKENS
    } else {
        tokens >= MIN_TOKENS_32
    }
}

/// Fewest tokens a pass over a 32-value format takes the tiles for (see [`pays`]).
pub const MIN_TOKENS_32: usize = 128;

/// Whether the kernels' AVX-512 part runs here (so the emulated tiles can be tested).
pub fn vectors_run() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::has_avx2()
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
unsafe fn detect() -> bool {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    const AMX_TILE: u32 = 1 << 24;
    const AMX_INT8: u32 = 1 << 25;
    const XTILE: u64 = (1 << 17) | (1 << 18);
    if !vectors_run() {
        return false;
    }
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 7 exists on every CPU with AVX-512 (checked above).
    let leaf7 = unsafe { __cpuid_count(7, 0) };
    if leaf7.edx & (AMX_TILE | AMX_INT8) != AMX_TILE | AMX_INT8 {
        return false;
    }
    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        _xgetbv(0)
    }
    // SAFETY: the AVX-512 detection above already required the OS to enable XSAVE (it reads
    // XCR0 itself).
    if unsafe { xcr0() } & XTILE != XTILE {
        return false;
    }
    // Linux keeps the tile data disabled per process until asked (a first use faults).
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the `arch_prctl` system call (158 on x86-64) reads its two integer arguments;
    // `syscall` clobbers rcx and r11.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") 158i64 => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    if ret != 0 {
        // ENOSPC, say, where a thread's alternate signal stack is too small for the tile
        // state: said, so that a machine with AMX running without it is not a mystery.
        eprintln!("ferrum: Linux refused the AMX tile state (arch_prctl: {ret}); not used");
        return false;
    }
    // Products of known bytes, both forms, on both instances: a wrong encoding or
    // configuration turns the tiles off instead of giving wrong logits.
    // SAFETY: AMX and the permission checked above.
    if unsafe { self_check(&mut Amx) } != self_check(&mut Emulated::default()) {
        eprintln!("ferrum: the AMX tiles disagree with their emulation; not used");
        return false;
    }
    true
}

/// Both tile forms on fixed bytes: what [`detect`] compares between the instances.
///
/// # Safety
/// As [`Tiles::configure`].
unsafe fn self_check<T: Tiles>(t: &mut T) -> Vec<i32> {
    let a: Vec<u8> = (0..(TOKENS + 1) * 64)
        .map(|i| (i * 37 % 251) as u8)
        .collect();
    let b: Vec<u8> = (0..2 * 16 * 64).map(|i| (i * 11 % 253) as u8).collect();
    let mut out = vec![0i32; 3 * 256 + 1024 + 768];
    // SAFETY: the contract; every buffer is the size its operation reads or writes.
    unsafe {
        t.configure(&Config::new(32));
        t.dot(1, a.as_ptr(), 64, b.as_ptr(), out.as_mut_ptr());
        t.dot(
            0,
            a.as_ptr().add(5),
            64,
            b.as_ptr().add(512),
            out.as_mut_ptr().add(256),
        );
        t.configure(&Config::new(16));
        t.dot(
            0,
            a.as_ptr().add(9),
            64,
            b.as_ptr().add(64),
            out.as_mut_ptr().add(512),
        );
        t.configure(&Config::full());
        t.zero_c();
        t.dot_pairs(
            a.as_ptr(),
            64,
            a.as_ptr().add(64),
            64,
            b.as_ptr(),
            b.as_ptr().add(1024),
        );
        t.dot_pairs(
            a.as_ptr().add(7),
            64,
            a.as_ptr(),
            64,
            b.as_ptr().add(3),
            b.as_ptr(),
        );
        t.store_c(out.as_mut_ptr().add(768), 4);
        t.zero_c();
        t.dot_digits(a.as_ptr().add(2), 64, b.as_ptr(), 320);
        t.dot_digits(a.as_ptr(), 64, b.as_ptr().add(11), 64);
        t.store_c(out.as_mut_ptr().add(768 + 1024), 3);
        t.release();
    }
    out
}

/// Each thread's scratch: the unpacked weights of a group pair, the C tiles of one block, a
/// tile of copied activations.
#[derive(Default)]
struct Scratch {
    b: Vec<u8>,
    c: Vec<i32>,
    a: Vec<u8>,
    /// Per tile of sixteen tokens: its activations' row stride where read in place.
    places: Vec<Option<usize>>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Rows `8·group .. 8·group + 16` (two packed groups) against every activation row, on the
/// tiles: `out[t][r]` is row `8·group + r` · token `t`. Returns `false`, doing nothing, for
/// the formats without a tile kernel (Q5_0, Q5_1, MXFP4 here; they keep the VNNI kernels).
///
/// # Panics
/// If group `group + 1` is out of range, an activation row is shorter than a weight row, or
/// `out` is shorter than `acts`.
///
/// # Safety
/// The CPU runs the kernels' AVX-512 ([`vectors_run`]), and for [`Amx`] [`hardware`] is true.
pub unsafe fn gemm_pair<T: Tiles, A: Act>(
    tiles: &mut T,
    p: &Packed,
    group: usize,
    acts: &[&[A]],
    out: &mut [[f32; PAIR]],
) -> bool {
    assert!(out.len() >= acts.len());
    #[cfg(target_arch = "x86_64")]
    {
        A::dispatch(tiles, p, group, acts, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (tiles, p, group, acts, out);
        false
    }
}

/// The activation formats: Q8_K for the K-quant layouts, Q8 for the 32-value ones.
pub trait Act: Copy + Sync + 'static {
    /// Offset of the quants in the block, and their count.
    const QS: (usize, usize);

    /// # Safety
    /// As [`gemm_pair`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn dispatch<T: Tiles>(
        tiles: &mut T,
        p: &Packed,
        group: usize,
        acts: &[&[Self]],
        out: &mut [[f32; PAIR]],
    ) -> bool;
}

/// Both groups' blocks of a pair, row-checked against the activations.
fn pair_of<'a, B, A>(
    v: &'a [B],
    per_row: usize,
    group: usize,
    acts: &[&[A]],
) -> (&'a [B], &'a [B]) {
    assert!(
        acts.iter().all(|a| a.len() >= per_row),
        "activation rows too short"
    );
    (
        &v[group * per_row..(group + 1) * per_row],
        &v[(group + 1) * per_row..(group + 2) * per_row],
    )
}

/// One group pair of a packed matrix through [`run`] with kernel `$k`.
#[cfg(target_arch = "x86_64")]
macro_rules! pass {
    ($tiles:expr, $v:expr, $per:expr, $group:expr, $acts:expr, $out:expr, $k:ident $(<$t:ty>)?) => {{
        let (a, b) = pair_of($v, *$per, $group, $acts);
        run($tiles, &kernels::$k $(::<$t>)? { a, b }, $acts, $out)
    }};
}

impl Act for BlockQ8K {
    const QS: (usize, usize) = (std::mem::offset_of!(BlockQ8K, qs), QK_K);

    #[cfg(target_arch = "x86_64")]
    unsafe fn dispatch<T: Tiles>(
        tiles: &mut T,
        p: &Packed,
        group: usize,
        acts: &[&[Self]],
        out: &mut [[f32; PAIR]],
    ) -> bool {
        // SAFETY (each arm): the contract.
        unsafe {
            match p {
                Packed::Q4K(v, per) => pass!(tiles, v, per, group, acts, out, K4),
                Packed::Q5K(v, per) => pass!(tiles, v, per, group, acts, out, K4),
                Packed::Q6K(v, per) => pass!(tiles, v, per, group, acts, out, K6),
                _ => return false,
            }
        }
        true
    }
}

impl Act for BlockQ8 {
    const QS: (usize, usize) = (std::mem::offset_of!(BlockQ8, qs), 32);

    #[cfg(target_arch = "x86_64")]
    unsafe fn dispatch<T: Tiles>(
        tiles: &mut T,
        p: &Packed,
        group: usize,
        acts: &[&[Self]],
        out: &mut [[f32; PAIR]],
    ) -> bool {
        // SAFETY (each arm): the contract.
        unsafe {
            match p {
                Packed::Q8_0(v, per) => pass!(tiles, v, per, group, acts, out, Q8),
                Packed::Q4_0(v, per) => {
                    pass!(tiles, v, per, group, acts, out, Nib<Q4_0x8>)
                }
                Packed::Q4_1(v, per) => {
                    pass!(tiles, v, per, group, acts, out, Nib<Q4_1x8>)
                }
                _ => return false,
            }
        }
        true
    }
}

/// What a format's tile kernel supplies to [`run`].
#[cfg(target_arch = "x86_64")]
trait Format {
    type Act: Act;
    /// Per block: whatever the float step needs of the two groups' scales.
    type Prep;
    /// Bytes of one block's unpacked weights (both groups).
    const UNPACKED: usize;
    /// C tiles per block and sixteen tokens.
    const TILES: usize;
    /// Values per product where each scale's span gets its own ([`per_span`]).
    const SPAN: usize;
    fn config() -> Config {
        Config::new(Self::SPAN)
    }
    fn blocks(&self) -> usize;
    /// Unpacks block `blk` of both groups into `out` (`UNPACKED` bytes).
    unsafe fn unpack(&self, blk: usize, out: *mut u8);
    /// The block's products for one or two tiles of sixteen tokens: their quants at `a0`
    /// and `a1` (rows `s0` and `s1` apart; `a1` null for one tile), the unpacked weights
    /// at `b`; the first tile's `TILES` C tiles stored at `c`, the second's after them. By
    /// default one product per span.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn products<T: Tiles>(
        t: &mut T,
        a0: *const u8,
        s0: usize,
        a1: *const u8,
        s1: usize,
        b: *const u8,
        c: *mut i32,
    ) {
        // SAFETY: the contract (`TILES` spans of `SPAN` values per tile of tokens).
        unsafe {
            per_span(t, Self::SPAN, Self::TILES, a0, s0, b, c);
            if !a1.is_null() {
                per_span(
                    t,
                    Self::SPAN,
                    Self::TILES,
                    a1,
                    s1,
                    b,
                    c.add(256 * Self::TILES),
                );
            }
        }
    }
    unsafe fn prep(&self, blk: usize) -> Self::Prep;
    /// Token row `i` of the block's C tiles (`c`) into `acc`.
    unsafe fn step(
        p: &Self::Prep,
        c: *const i32,
        i: usize,
        a: &Self::Act,
        acc: std::arch::x86_64::__m512,
    ) -> std::arch::x86_64::__m512;
}

/// One product per span of `k` values (a scale's span) into its own C tile, alternating the
/// two tile sets of [`Config::new`]: the products of the formats whose scales apply per span
/// (the 32-value formats). B tile `d` is `k / 4` rows of 64 bytes at `b + 16·k·d`.
///
/// # Safety
/// As [`Tiles::dot`], for each span.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn per_span<T: Tiles>(
    t: &mut T,
    k: usize,
    spans: usize,
    a: *const u8,
    stride: usize,
    b: *const u8,
    c: *mut i32,
) {
    for d in 0..spans {
        // SAFETY: the contract.
        unsafe {
            t.dot(
                d & 1,
                a.add(d * k),
                stride,
                b.add(d * k * 16),
                c.add(d * 256),
            )
        };
    }
}

/// Where a tile of sixteen tokens' quants lies: in place, rows `stride` apart (a matmul's
/// rows, equally spaced and all sixteen there), or `None`: copied per block.
fn in_place<A>(chunk: &[&[A]], qs_len: usize) -> Option<usize> {
    if chunk.len() < TOKENS {
        return None;
    }
    let base = chunk[0].as_ptr() as usize;
    let stride = (chunk[1].as_ptr() as usize).checked_sub(base)?;
    let equal = chunk
        .iter()
        .enumerate()
        .all(|(i, a)| a.as_ptr() as usize == base + i * stride);
    (equal && stride >= qs_len).then_some(stride)
}

/// The pass, block by block: each block of the pair unpacked once (into a scratch that
/// stays in L1) and then multiplied by every token, two tiles of sixteen at a time, so a
/// weight tile is loaded once per 32 tokens; the float steps add each block into the
/// tokens' sums in `out`, which go through the blocks in order, as in the twins.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn run<T: Tiles, F: Format>(
    tiles: &mut T,
    f: &F,
    acts: &[&[F::Act]],
    out: &mut [[f32; PAIR]],
) {
    use std::arch::x86_64::*;
    let n = acts.len();
    let (qs_at, qs_len) = F::Act::QS;
    out[..n].iter_mut().for_each(|o| *o = [0.0; PAIR]);
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let s = &mut *s;
        s.places.clear();
        s.places
            .extend(acts.chunks(TOKENS).map(|c| in_place(c, qs_len)));
        s.b.resize(F::UNPACKED, 0);
        s.c.resize(2 * F::TILES * 256, 0);
        s.a.resize(2 * TOKENS * qs_len, 0);
        // SAFETY: the contract.
        unsafe { tiles.configure(&F::config()) };
        for blk in 0..f.blocks() {
            // SAFETY: `b` holds `UNPACKED` bytes; the block exists in both groups.
            let p = unsafe {
                f.unpack(blk, s.b.as_mut_ptr());
                f.prep(blk)
            };
            for t0 in (0..n).step_by(2 * TOKENS) {
                // Each tile's A: in place, or its rows' quants copied into the scratch.
                let mut a = [(std::ptr::null::<u8>(), 0usize); 2];
                for (h, a) in a.iter_mut().enumerate() {
                    let from = t0 + h * TOKENS;
                    if from >= n {
                        break;
                    }
                    let chunk = &acts[from..(from + TOKENS).min(n)];
                    *a = match s.places[from / TOKENS] {
                        // SAFETY: block `blk` of the tile's first row exists (rows checked
                        // by `pair_of`).
                        Some(stride) => unsafe {
                            ((chunk[0].as_ptr().add(blk) as *const u8).add(qs_at), stride)
                        },
                        None => {
                            let dst = s.a[h * TOKENS * qs_len..].as_mut_ptr();
                            for (i, row) in chunk.iter().enumerate() {
                                // SAFETY: a block's quants are `qs_len` bytes from `qs_at`;
                                // the scratch holds sixteen rows of `qs_len` per tile.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        (row.as_ptr().add(blk) as *const u8).add(qs_at),
                                        dst.add(i * qs_len),
                                        qs_len,
                                    );
                                }
                            }
                            (dst as *const u8, qs_len)
                        }
                    };
                }
                // SAFETY: sixteen rows of A per tile at its stride (in place: rows of the
                // same activation matrix; copied: the scratch), the block's unpacked
                // weights, two tiles' C in `c`; the contract for the rest.
                unsafe {
                    F::products(
                        tiles,
                        a[0].0,
                        a[0].1,
                        a[1].0,
                        a[1].1,
                        s.b.as_ptr(),
                        s.c.as_mut_ptr(),
                    )
                };
                for t in t0..(t0 + 2 * TOKENS).min(n) {
                    let (h, i) = ((t - t0) / TOKENS, (t - t0) % TOKENS);
                    // SAFETY: `c` holds the block's tiles; `out[t]` is sixteen f32.
                    unsafe {
                        let c = s.c.as_ptr().add(h * F::TILES * 256);
                        let o = out[t].as_mut_ptr();
                        let acc = F::step(&p, c, i, &acts[t][blk], _mm512_loadu_ps(o));
                        _mm512_storeu_ps(o, acc);
                    }
                }
            }
        }
        // SAFETY: the contract.
        unsafe { tiles.release() };
    });
}

#[cfg(target_arch = "x86_64")]
mod kernels {
    use super::*;
    use std::arch::x86_64::*;

    /// Two groups' eight f16 scales as sixteen f32 lanes.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn halves(a: &[half::f16; ROWS], b: &[half::f16; ROWS]) -> __m512 {
        // SAFETY: eight f16 are 16 bytes each.
        unsafe {
            let lo = _mm_loadu_si128(a.as_ptr() as *const __m128i);
            let hi = _mm_loadu_si128(b.as_ptr() as *const __m128i);
            _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
        }
    }

    /// Two groups' eight bytes as sixteen i32 lanes, zero- or sign-extended.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn bytes16<const SIGNED: bool>(a: &[u8; ROWS], b: &[u8; ROWS]) -> __m512i {
        let x = _mm_set_epi64x(u64::from_le_bytes(*b) as i64, u64::from_le_bytes(*a) as i64);
        if SIGNED {
            _mm512_cvtepi8_epi32(x)
        } else {
            _mm512_cvtepu8_epi32(x)
        }
    }

    /// 32 bytes of each group side by side: a B row's halves.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn join(a: *const u8, b: *const u8) -> __m512i {
        // SAFETY: the callers pass 32 readable bytes at each.
        unsafe {
            let lo = _mm256_loadu_si256(a as *const __m256i);
            let hi = _mm256_loadu_si256(b as *const __m256i);
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn shr16(x: __m512i, n: usize) -> __m512i {
        _mm512_srl_epi16(x, _mm_cvtsi64_si128(n as i64))
    }

    /// Q4_K and Q5_K. The 6-bit sub-block scale goes into the weights: with `sc = 8·hi + lo`
    /// (`lo`, `hi` < 8), the bytes `q·lo` and `q·hi` (at most 31·7) make two B tiles whose
    /// products over the whole super-block, `P_lo + 8·P_hi`, are `Σ_j sc_j·Σ q·y` exactly:
    /// eight 64-value products a super-block and no integer multiply per token. Then the
    /// minimums' `Σ_j mn_j·Σ y` from the activation's sums, and the twin's two fused steps.
    pub struct K4<'a, B> {
        pub a: &'a [B],
        pub b: &'a [B],
    }

    pub struct K4Prep {
        d: __m512,
        dmin: __m512,
        /// Minimums of sub-blocks `2c` and `2c + 1` as the two i16 halves of each lane.
        mn: [__m512i; 4],
    }

    impl<B: K4x8> Format for K4<'_, B> {
        type Act = BlockQ8K;
        type Prep = K4Prep;
        /// Per super-block: the `lo` tiles (four of 64 values by sixteen rows, 1 KiB each),
        /// then the `hi` ones.
        const UNPACKED: usize = 8192;
        const TILES: usize = 2;
        /// Unused: the products below span the super-block.
        const SPAN: usize = 64;

        fn config() -> Config {
            Config::full()
        }

        fn blocks(&self) -> usize {
            self.a.len()
        }

        /// Tile `c` (values `64c..64c + 64`): B row `v < 8` holds sub-block `2c`'s values
        /// `4v..4v + 4` (the low nibbles of packed vector `v`), row `8 + v` sub-block
        /// `2c + 1`'s (the high nibbles); each byte times its row's `lo` or `hi` scale part.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn unpack(&self, blk: usize, out: *mut u8) {
            let (ga, gb) = (&self.a[blk], &self.b[blk]);
            let (ka, kb) = (ga.k4(), gb.k4());
            let low = _mm512_set1_epi8(0x0f);
            let one = _mm512_set1_epi8(1);
            let seven = _mm512_set1_epi32(7);
            // Sub-block j's `lo` and `hi` scale parts in both halves of row r's dword: a
            // 16-bit multiply scales two quants at once, the even one's product (at most
            // 31·7) staying in its byte.
            let mut parts = [[_mm512_setzero_si512(); 2]; 8];
            for (j, part) in parts.iter_mut().enumerate() {
                let x = _mm_set_epi64x(
                    u64::from_le_bytes(kb.sc[j]) as i64,
                    u64::from_le_bytes(ka.sc[j]) as i64,
                );
                let sc = _mm512_cvtepu8_epi32(x);
                let lo = _mm512_and_si512(sc, seven);
                let hi = _mm512_and_si512(_mm512_srli_epi32::<3>(sc), seven);
                // SAFETY: the features (the contract).
                *part = unsafe { [both(lo), both(hi)] };
            }
            for c in 0..4 {
                for v in 0..8 {
                    let at = 256 * c + 32 * v;
                    // SAFETY: `at + 32 <= 1024`; `out` holds `UNPACKED` bytes.
                    unsafe {
                        let x = join(ka.qs.as_ptr().add(at), kb.qs.as_ptr().add(at));
                        let mut q0 = _mm512_and_si512(x, low);
                        let mut q1 = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
                        if let (Some(ha), Some(hb)) = (ga.qh(), gb.qh()) {
                            let h = join(ha.as_ptr().add(32 * v), hb.as_ptr().add(32 * v));
                            let b0 = _mm512_and_si512(shr16(h, 2 * c), one);
                            let b1 = _mm512_and_si512(shr16(h, 2 * c + 1), one);
                            q0 = _mm512_or_si512(q0, _mm512_slli_epi16::<4>(b0));
                            q1 = _mm512_or_si512(q1, _mm512_slli_epi16::<4>(b1));
                        }
                        for (row, q, [lo, hi]) in
                            [(v, q0, parts[2 * c]), (8 + v, q1, parts[2 * c + 1])]
                        {
                            let at = 1024 * c + 64 * row;
                            _mm512_storeu_si512(out.add(at) as *mut _, _mm512_mullo_epi16(q, lo));
                            _mm512_storeu_si512(
                                out.add(4096 + at) as *mut _,
                                _mm512_mullo_epi16(q, hi),
                            );
                        }
                    }
                }
            }
        }

        /// Both token tiles against each 64-value step's `lo` and `hi` tiles (a lone tile
        /// goes twice, its second sums unread).
        #[inline(always)]
        unsafe fn products<T: Tiles>(
            t: &mut T,
            a0: *const u8,
            s0: usize,
            a1: *const u8,
            s1: usize,
            b: *const u8,
            c: *mut i32,
        ) {
            let (a1, s1) = if a1.is_null() { (a0, s0) } else { (a1, s1) };
            // SAFETY: the contract (256 quants a row at `a0`, `a1`, 8 KiB of tiles at `b`).
            unsafe {
                t.zero_c();
                for k in 0..4 {
                    t.dot_pairs(
                        a0.add(64 * k),
                        s0,
                        a1.add(64 * k),
                        s1,
                        b.add(1024 * k),
                        b.add(4096 + 1024 * k),
                    );
                }
                t.store_c(c, 4);
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn prep(&self, blk: usize) -> K4Prep {
            let (ga, gb) = (self.a[blk].k4(), self.b[blk].k4());
            let mut mn = [_mm512_setzero_si512(); 4];
            for (c, mn) in mn.iter_mut().enumerate() {
                // SAFETY: the features (the contract).
                *mn = unsafe {
                    let even = bytes16::<false>(&ga.mn[2 * c], &gb.mn[2 * c]);
                    let odd = bytes16::<false>(&ga.mn[2 * c + 1], &gb.mn[2 * c + 1]);
                    _mm512_or_si512(even, _mm512_slli_epi32::<16>(odd))
                };
            }
            // SAFETY: as above.
            unsafe {
                K4Prep {
                    d: halves(&ga.d, &gb.d),
                    dmin: halves(&ga.dmin, &gb.dmin),
                    mn,
                }
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn step(p: &K4Prep, c: *const i32, i: usize, a: &BlockQ8K, acc: __m512) -> __m512 {
            // SAFETY: the two C tiles, token row `i`.
            let (lo, hi) = unsafe {
                (
                    _mm512_loadu_si512(c.add(16 * i) as *const _),
                    _mm512_loadu_si512(c.add(256 + 16 * i) as *const _),
                )
            };
            let isum = _mm512_add_epi32(lo, _mm512_slli_epi32::<3>(hi));
            // The sub-blocks' activation sums (each under 2^15 in size) as i16, sub-blocks
            // 2c and 2c + 1 side by side in one dword, broadcast against `mn[c]`.
            // SAFETY: sixteen i16.
            let bs = unsafe { _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i) };
            let sums = _mm256_madd_epi16(bs, _mm256_set1_epi16(1));
            let sums = _mm512_castsi256_si512(_mm256_packs_epi32(sums, sums));
            let mut msum = _mm512_setzero_si512();
            for (mn, at) in p.mn.iter().zip([0, 1, 4, 5]) {
                let pair = _mm512_permutexvar_epi32(_mm512_set1_epi32(at), sums);
                msum = _mm512_add_epi32(msum, _mm512_madd_epi16(*mn, pair));
            }
            let qd = _mm512_set1_ps(a.d);
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(p.d, qd), acc);
            _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(p.dmin, qd), acc)
        }
    }

    /// Q6_K. Each 16-value sub-block's signed scale is split into three digits,
    /// `sc = d₀ + 8·d₁ + 64·d₂` with every `dᵢ` in −3..=4, and each digit goes into the
    /// offset quants `q − 32` (−32..=31, so every product is a signed byte): three planes of
    /// weight bytes whose products over the whole super-block (`tdpbssd`), `P₀ + 8·P₁ + 64·P₂`,
    /// are the twin's `Σ_j sc_j·(Σ q·y − 32·Σ y)` exactly: twelve 64-value products a
    /// super-block in place of sixteen 16-value ones with their sixteen stored sums, and one
    /// fused step.
    pub struct K6<'a> {
        pub a: &'a [Q6Kx8],
        pub b: &'a [Q6Kx8],
    }

    /// The digits of a signed byte: `sc = d₀ + 8·d₁ + 64·d₂`, each in −3..=4 (lanes of i32).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn digits(sc: __m512i) -> [__m512i; 3] {
        let three = _mm512_set1_epi32(3);
        let seven = _mm512_set1_epi32(7);
        let d0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(sc, three), seven), three);
        let r1 = _mm512_srai_epi32::<3>(_mm512_sub_epi32(sc, d0));
        let d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r1, three), seven), three);
        let d2 = _mm512_srai_epi32::<3>(_mm512_sub_epi32(r1, d1));
        [d0, d1, d2]
    }

    /// A 16-bit lane's low half in both halves of each dword (row r's dword holds two 16-bit
    /// lanes of row r).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn both(x: __m512i) -> __m512i {
        let x = _mm512_and_si512(x, _mm512_set1_epi32(0xffff));
        _mm512_or_si512(x, _mm512_slli_epi32::<16>(x))
    }

    impl Format for K6<'_> {
        type Act = BlockQ8K;
        type Prep = __m512;
        /// Three planes (the digits) of four 64-value tiles by sixteen rows.
        const UNPACKED: usize = 3 * 4096;
        const TILES: usize = 3;
        /// Unused: the products span the super-block.
        const SPAN: usize = 64;

        fn config() -> Config {
            Config::full()
        }

        fn blocks(&self) -> usize {
            self.a.len()
        }

        /// 32-value chunk `cc` (`n = cc / 4` the half, `k = cc % 4` the quarter) into B rows
        /// `8cc .. 8cc + 8` of each plane, which are sub-blocks `2cc` and `2cc + 1`; each byte
        /// `(q − 32)·d`, `d` its row's digit of the sub-block's scale.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn unpack(&self, blk: usize, out: *mut u8) {
            let (ga, gb) = (&self.a[blk], &self.b[blk]);
            let low = _mm512_set1_epi8(0x0f);
            let two = _mm512_set1_epi8(3);
            let flip = _mm512_set1_epi16(0x80);
            let (m32, c128) = (_mm512_set1_epi32(-32 * 257), _mm512_set1_epi32(128));
            for cc in 0..8 {
                let (n, k) = (cc / 4, cc % 4);
                // Per sub-block and plane: the digit `d`, and `128 − 32·d` in each byte: a
                // 16-bit multiply of two quants `q` (0..=63) by `d` plus this gives
                // `(q − 32)·d + 128` in the even byte (0..=252: no borrow from the odd one)
                // and `(q − 32)·d` in the odd byte; the even byte's 128 is flipped off.
                let mut ds = [[(_mm512_setzero_si512(), _mm512_setzero_si512()); 3]; 2];
                for (h, ds) in ds.iter_mut().enumerate() {
                    let j = 2 * cc + h;
                    // SAFETY: the features (the contract); i8 and u8 share a layout.
                    let sc = unsafe {
                        bytes16::<true>(
                            &*(ga.sc[j].as_ptr() as *const [u8; ROWS]),
                            &*(gb.sc[j].as_ptr() as *const [u8; ROWS]),
                        )
                    };
                    // SAFETY: as above.
                    let dg = unsafe { digits(sc) };
                    for (slot, d) in ds.iter_mut().zip(dg) {
                        let off = _mm512_add_epi32(_mm512_mullo_epi32(d, m32), c128);
                        // SAFETY: as above.
                        *slot = unsafe { (both(d), both(off)) };
                    }
                }
                for v in 0..8 {
                    let l_at = 32 * (16 * n + 8 * (k % 2) + v);
                    let h_at = 32 * (8 * n + v);
                    // SAFETY: `l_at + 32 <= 1024`, `h_at + 32 <= 512`; `out` holds three
                    // planes of 4096 bytes.
                    unsafe {
                        let l = join(ga.ql.as_ptr().add(l_at), gb.ql.as_ptr().add(l_at));
                        let h = join(ga.qh.as_ptr().add(h_at), gb.qh.as_ptr().add(h_at));
                        let lo = if k < 2 {
                            _mm512_and_si512(l, low)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(l), low)
                        };
                        let hi = _mm512_slli_epi16::<4>(_mm512_and_si512(shr16(h, 2 * k), two));
                        let q = _mm512_or_si512(lo, hi);
                        for (plane, (d, off)) in ds[v / 4].iter().enumerate() {
                            let p = _mm512_add_epi16(_mm512_mullo_epi16(q, *d), *off);
                            _mm512_storeu_si512(
                                out.add(4096 * plane + 512 * cc + 64 * v) as *mut _,
                                _mm512_xor_si512(p, flip),
                            );
                        }
                    }
                }
            }
        }

        #[inline(always)]
        unsafe fn products<T: Tiles>(
            t: &mut T,
            a0: *const u8,
            s0: usize,
            a1: *const u8,
            s1: usize,
            b: *const u8,
            c: *mut i32,
        ) {
            // SAFETY: the contract (256 quants a row at `a0`, `a1`; three planes of 4 KiB
            // at `b`; six C tiles at `c`).
            unsafe {
                for (a, s, c) in [(a0, s0, c), (a1, s1, c.add(3 * 256))] {
                    if a.is_null() {
                        break;
                    }
                    t.zero_c();
                    for k in 0..4 {
                        t.dot_digits(a.add(64 * k), s, b.add(1024 * k), 4096);
                    }
                    t.store_c(c, 3);
                }
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn prep(&self, blk: usize) -> __m512 {
            // SAFETY: the features (the contract).
            unsafe { halves(&self.a[blk].d, &self.b[blk].d) }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn step(d: &__m512, c: *const i32, i: usize, a: &BlockQ8K, acc: __m512) -> __m512 {
            // SAFETY: the three C tiles, token row `i`.
            let (p0, p1, p2) = unsafe {
                (
                    _mm512_loadu_si512(c.add(16 * i) as *const _),
                    _mm512_loadu_si512(c.add(256 + 16 * i) as *const _),
                    _mm512_loadu_si512(c.add(512 + 16 * i) as *const _),
                )
            };
            let isum = _mm512_add_epi32(
                p0,
                _mm512_add_epi32(_mm512_slli_epi32::<3>(p1), _mm512_slli_epi32::<6>(p2)),
            );
            let qd = _mm512_set1_ps(a.d);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(*d, qd), acc)
        }
    }

    /// Q8_0, its quants stored plus 128: the product is `Σ (w + 128)·a`, and the
    /// activation's `offset` (`−128·Σ a`) makes it `Σ w·a`.
    pub struct Q8<'a> {
        pub a: &'a [Q8_0x8],
        pub b: &'a [Q8_0x8],
    }

    impl Format for Q8<'_> {
        type Act = BlockQ8;
        type Prep = __m512;
        const UNPACKED: usize = 512;
        const TILES: usize = 1;
        const SPAN: usize = 32;

        fn blocks(&self) -> usize {
            self.a.len()
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn unpack(&self, blk: usize, out: *mut u8) {
            let (qa, qb) = (&self.a[blk].qs, &self.b[blk].qs);
            for v in 0..8 {
                // SAFETY: `32v + 32 <= 256`; `out` holds 512 bytes.
                unsafe {
                    let x = join(qa.as_ptr().add(32 * v), qb.as_ptr().add(32 * v));
                    _mm512_storeu_si512(out.add(64 * v) as *mut _, x);
                }
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn prep(&self, blk: usize) -> __m512 {
            // SAFETY: the features (the contract).
            unsafe { halves(&self.a[blk].d, &self.b[blk].d) }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn step(d: &__m512, c: *const i32, i: usize, a: &BlockQ8, acc: __m512) -> __m512 {
            // SAFETY: the tile, token row `i`.
            let dot = unsafe { _mm512_loadu_si512(c.add(16 * i) as *const _) };
            let isum = _mm512_add_epi32(dot, _mm512_set1_epi32(a.offset));
            _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(isum),
                _mm512_mul_ps(*d, _mm512_set1_ps(a.d)),
                acc,
            )
        }
    }

    /// Q4_0 and Q4_1: the nibbles as they are stored, then the offset step (`−8·d·s` or
    /// `m·s`, `s` the activation's scaled sum) as in the twin.
    pub struct Nib<'a, B> {
        pub a: &'a [B],
        pub b: &'a [B],
    }

    pub struct NibPrep {
        d: __m512,
        /// `d·c` (Q4_0) or the minimums (Q4_1).
        off: __m512,
    }

    /// The 4-bit layouts' shared view: scales, minimums and the 128 nibble bytes.
    pub trait Nibbles: BlockX8 {
        fn qs(&self) -> &[u8; 128];
    }
    impl Nibbles for Q4_0x8 {
        fn qs(&self) -> &[u8; 128] {
            &self.qs
        }
    }
    impl Nibbles for Q4_1x8 {
        fn qs(&self) -> &[u8; 128] {
            &self.qs
        }
    }

    impl<B: Nibbles> Format for Nib<'_, B> {
        type Act = BlockQ8;
        type Prep = NibPrep;
        const UNPACKED: usize = 512;
        const TILES: usize = 1;
        const SPAN: usize = 32;

        fn blocks(&self) -> usize {
            self.a.len()
        }

        /// B row `v < 4` is the low nibbles of packed vector `v`, row `v + 4` its high ones
        /// (elements `16 + 4v ..`).
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn unpack(&self, blk: usize, out: *mut u8) {
            let (qa, qb) = (self.a[blk].qs(), self.b[blk].qs());
            let low = _mm512_set1_epi8(0x0f);
            for v in 0..4 {
                // SAFETY: `32v + 32 <= 128`; `out` holds 512 bytes.
                unsafe {
                    let x = join(qa.as_ptr().add(32 * v), qb.as_ptr().add(32 * v));
                    let lo = _mm512_and_si512(x, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
                    _mm512_storeu_si512(out.add(64 * v) as *mut _, lo);
                    _mm512_storeu_si512(out.add(64 * (v + 4)) as *mut _, hi);
                }
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn prep(&self, blk: usize) -> NibPrep {
            let (ga, gb) = (&self.a[blk], &self.b[blk]);
            // SAFETY: the features (the contract).
            let d = unsafe { halves(ga.d(), gb.d()) };
            let off = match B::OFFSET {
                Offset::None => _mm512_setzero_ps(),
                Offset::Scaled(c) => _mm512_mul_ps(d, _mm512_set1_ps(c)),
                // SAFETY: as above.
                Offset::Min => unsafe { halves(ga.m(), gb.m()) },
            };
            NibPrep { d, off }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        unsafe fn step(p: &NibPrep, c: *const i32, i: usize, a: &BlockQ8, acc: __m512) -> __m512 {
            // SAFETY: the tile, token row `i`.
            let dot = unsafe { _mm512_loadu_si512(c.add(16 * i) as *const _) };
            let acc = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(dot),
                _mm512_mul_ps(p.d, _mm512_set1_ps(a.d)),
                acc,
            );
            match B::OFFSET {
                Offset::None => acc,
                _ => _mm512_fmadd_ps(p.off, _mm512_set1_ps(a.s), acc),
            }
        }
    }
}
