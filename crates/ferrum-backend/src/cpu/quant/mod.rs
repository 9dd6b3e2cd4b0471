//! Quantised block formats, one module each, following GGML's block layouts
//! (`ggml-common.h`): the `#[repr(C)]` block with a compile-time size check, and the reference
//! dequantisation to f32. The fast dot products against 8-bit activations build on these.

pub mod amx;
pub mod iq4;
pub mod iq_grid;
pub mod iq_grids;
pub mod iq_tile;
pub mod k_quants;
pub mod mxfp4;
pub mod packed;
pub mod q4_0;
pub mod q4_1;
pub mod q5_0;
pub mod q5_1;
pub mod q8;
pub mod q8_0;

use ferrum_core::DType;
use half::f16;

/// Reinterprets bytes as blocks. `None` when the length is not a whole number of blocks or
/// the bytes are not aligned for `B` (GGUF aligns tensor data to 32 bytes, so mapped
/// tensors always are).
pub fn cast_blocks<B: Copy>(bytes: &[u8]) -> Option<&[B]> {
    let size = std::mem::size_of::<B>();
    if !bytes.len().is_multiple_of(size)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<B>())
    {
        return None;
    }
    // SAFETY: length and alignment checked above; every block type is plain old data made of
    // integers and f16s, for which any bit pattern is a valid value.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const B, bytes.len() / size) })
}

/// Dequantises `bytes` (a whole number of blocks of `dtype`) into `out`.
/// Returns `false` if the format has no dequantiser or the sizes disagree.
pub fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) -> bool {
    if dtype.bytes_for(out.len()) != Some(bytes.len()) {
        return false;
    }
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            true
        }
        DType::F16 => {
            // F16C where the bytes are aligned (always, on the arena): a matmul over f16
            // weights converts every row it reads, and one value at a time was most of it.
            match cast_blocks::<f16>(bytes).filter(|_| cfg!(target_endian = "little")) {
                Some(h) => crate::cpu::simd::f16_to_f32(h, out),
                None => {
                    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
            }
            true
        }
        DType::BF16 => {
            // As `bf16::to_f32`; with AVX2 where the bytes are aligned (always, on the arena).
            match cast_blocks::<u16>(bytes).filter(|_| cfg!(target_endian = "little")) {
                Some(h) => crate::cpu::simd::bf16_to_f32(h, out),
                None => {
                    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                        let b = u16::from_le_bytes([c[0], c[1]]);
                        crate::cpu::simd::bf16_to_f32_scalar(&[b], std::slice::from_mut(o));
                    }
                }
            }
            true
        }
        DType::Q4_0 => run(bytes, out, q4_0::dequantize),
        DType::Q4_1 => run(bytes, out, q4_1::dequantize),
        DType::Q5_0 => run(bytes, out, q5_0::dequantize),
        DType::Q5_1 => run(bytes, out, q5_1::dequantize),
        DType::Q8_0 => run(bytes, out, q8_0::dequantize),
        DType::Q2K => run(bytes, out, k_quants::dequantize_q2k),
        DType::Q3K => run(bytes, out, k_quants::dequantize_q3k),
        DType::Q4K => run(bytes, out, k_quants::dequantize_q4k),
        DType::Q5K => run(bytes, out, k_quants::dequantize_q5k),
        DType::Q6K => run(bytes, out, k_quants::dequantize_q6k),
        DType::Mxfp4 => run(bytes, out, mxfp4::dequantize),
        DType::Iq4Nl => run(bytes, out, iq4::dequantize_nl),
        DType::Iq4Xs => run(bytes, out, iq4::dequantize_xs),
        DType::Iq2Xxs => run(bytes, out, iq_grid::dequantize_iq2_xxs),
        DType::Iq2Xs => run(bytes, out, iq_grid::dequantize_iq2_xs),
        DType::Iq2S => run(bytes, out, iq_grid::dequantize_iq2_s),
        DType::Iq3Xxs => run(bytes, out, iq_grid::dequantize_iq3_xxs),
        DType::Iq3S => run(bytes, out, iq_grid::dequantize_iq3_s),
        DType::Iq1S => run(bytes, out, iq_grid::dequantize_iq1_s),
        DType::Iq1M => run(bytes, out, iq_grid::dequantize_iq1_m),
        DType::Tq1_0 => run(bytes, out, iq_grid::dequantize_tq1_0),
        DType::Tq2_0 => run(bytes, out, iq_grid::dequantize_tq2_0),
        // Raw bytes are no numbers until their loader says what they hold.
        DType::Q8_1 | DType::Q8K | DType::U8 => false,
    }
}

fn run<B: Copy>(bytes: &[u8], out: &mut [f32], f: fn(&[B], &mut [f32])) -> bool {
    match cast_blocks::<B>(bytes) {
        Some(blocks) => {
            f(blocks, out);
            true
        }
        None => false,
    }
}

/// Whether [`dequantize`] handles a format.
pub fn can_dequantize(dtype: DType) -> bool {
    !matches!(dtype, DType::Q8_1 | DType::Q8K)
}

use q8::{BlockQ8, BlockQ8K};

/// Results of a two-row × four-token tile: `tile[row][token]`.
pub type Tile = [[f32; 4]; 2];

/// Two weight rows × four activation rows of activation format `A`.
pub type Dot2x4<A> = fn([&[u8]; 2], [&[A]; 4]) -> Tile;

/// A weight row's dot product against one quantised activation row (`dot`); one weight row
/// against four activation rows (`dot4`: weight blocks decoded once for four tokens, which
/// makes prefill fast); and four weight rows against one activation row (`rows4`: four
/// independent weight streams in flight, which makes decode reach the memory bandwidth).
/// All three give each (row, token) pair bit-for-bit the same value. Which activation format a weight format pairs with is part of
/// the kernel.
#[derive(Clone, Copy)]
pub enum Kernel {
    Q8 {
        dot: fn(&[u8], &[BlockQ8]) -> f32,
        dot4: fn(&[u8], [&[BlockQ8]; 4]) -> [f32; 4],
        rows4: fn([&[u8]; 4], &[BlockQ8]) -> [f32; 4],
        dot2x4: Dot2x4<BlockQ8>,
    },
    Q8K {
        dot: fn(&[u8], &[BlockQ8K]) -> f32,
        dot4: fn(&[u8], [&[BlockQ8K]; 4]) -> [f32; 4],
        rows4: fn([&[u8]; 4], &[BlockQ8K]) -> [f32; 4],
        dot2x4: Dot2x4<BlockQ8K>,
    },
}

/// Casts bytes to a block slice for a kernel. Weight rows were checked at load to be whole,
/// aligned blocks, so the empty fallback is unreachable in practice.
#[inline]
fn blocks<B: Copy>(w: &[u8]) -> &[B] {
    let b = cast_blocks::<B>(w);
    debug_assert!(b.is_some(), "weight row not aligned to its block type");
    b.unwrap_or(&[])
}

macro_rules! kernel {
    ($variant:ident, $block:ty, $f:path) => {
        Kernel::$variant {
            dot: |w, a| $f(blocks::<$block>(w), a),
            dot4: |w, a| {
                let w = blocks::<$block>(w);
                [$f(w, a[0]), $f(w, a[1]), $f(w, a[2]), $f(w, a[3])]
            },
            rows4: |w, a| w.map(|r| $f(blocks::<$block>(r), a)),
            dot2x4: |w, a| w.map(|r| a.map(|t| $f(blocks::<$block>(r), t))),
        }
    };
    (unsafe $variant:ident, $block:ty, $f:path) => {
        // SAFETY: only chosen after runtime detection of AVX2, FMA and F16C.
        Kernel::$variant {
            dot: |w, a| unsafe { $f(blocks::<$block>(w), a) },
            dot4: |w, a| {
                let w = blocks::<$block>(w);
                unsafe { [$f(w, a[0]), $f(w, a[1]), $f(w, a[2]), $f(w, a[3])] }
            },
            rows4: |w, a| w.map(|r| unsafe { $f(blocks::<$block>(r), a) }),
            dot2x4: |w, a| w.map(|r| a.map(|t| unsafe { $f(blocks::<$block>(r), t) })),
        }
    };
    (unsafe $variant:ident, $block:ty, $f:path, $f4:path) => {
        // SAFETY: only chosen after runtime detection of AVX2, FMA and F16C, and for a VNNI
        // instance of the codebook kernels (`codebook_kernel_on`) of that instance's features
        // too (`Isa::runs`).
        Kernel::$variant {
            dot: |w, a| unsafe { $f(blocks::<$block>(w), a) },
            dot4: |w, a| unsafe { $f4(blocks::<$block>(w), a) },
            rows4: |w, a| w.map(|r| unsafe { $f(blocks::<$block>(r), a) }),
            dot2x4: |w, a| w.map(|r| unsafe { $f4(blocks::<$block>(r), a) }),
        }
    };
    (unsafe $variant:ident, $block:ty, $f:path, $f4:path, none, $d24:path) => {
        // SAFETY: only chosen after runtime detection of AVX2, FMA and F16C.
        Kernel::$variant {
            dot: |w, a| unsafe { $f(blocks::<$block>(w), a) },
            dot4: |w, a| unsafe { $f4(blocks::<$block>(w), a) },
            rows4: |w, a| w.map(|r| unsafe { $f(blocks::<$block>(r), a) }),
            dot2x4: |w, a| unsafe { $d24(w.map(blocks::<$block>), a) },
        }
    };
    (unsafe $variant:ident, $block:ty, $f:path, $f4:path, $r4:path, $d24:path) => {
        // SAFETY: only chosen after runtime detection of AVX2, FMA and F16C.
        Kernel::$variant {
            dot: |w, a| unsafe { $f(blocks::<$block>(w), a) },
            dot4: |w, a| unsafe { $f4(blocks::<$block>(w), a) },
            rows4: |w, a| unsafe { $r4(w.map(blocks::<$block>), a) },
            dot2x4: |w, a| unsafe { $d24(w.map(blocks::<$block>), a) },
        }
    };
    (unsafe $variant:ident, $block:ty, $f:path, $f4:path, $r4:path) => {
        // SAFETY: only chosen after runtime detection of AVX2, FMA and F16C.
        Kernel::$variant {
            dot: |w, a| unsafe { $f(blocks::<$block>(w), a) },
            dot4: |w, a| unsafe { $f4(blocks::<$block>(w), a) },
            rows4: |w, a| unsafe { $r4(w.map(blocks::<$block>), a) },
            dot2x4: |w, a| w.map(|r| unsafe { $f4(blocks::<$block>(r), a) }),
        }
    };
}

/// The portable integer kernel of a weight format (also the reference the SIMD kernels are
/// tested against). `None` for float formats, which take the f32 path.
pub fn scalar_kernel(dtype: DType) -> Option<Kernel> {
    Some(match dtype {
        DType::Q4_0 => kernel!(Q8, q4_0::BlockQ4_0, q4_0::vec_dot),
        DType::Q4_1 => kernel!(Q8, q4_1::BlockQ4_1, q4_1::vec_dot),
        DType::Q5_0 => kernel!(Q8, q5_0::BlockQ5_0, q5_0::vec_dot),
        DType::Q5_1 => kernel!(Q8, q5_1::BlockQ5_1, q5_1::vec_dot),
        DType::Q8_0 => kernel!(Q8, q8_0::BlockQ8_0, q8_0::vec_dot),
        DType::Q2K => kernel!(Q8K, k_quants::BlockQ2K, k_quants::vec_dot_q2k),
        DType::Q3K => kernel!(Q8K, k_quants::BlockQ3K, k_quants::vec_dot_q3k),
        DType::Q4K => kernel!(Q8K, k_quants::BlockQ4K, k_quants::vec_dot_q4k),
        DType::Q5K => kernel!(Q8K, k_quants::BlockQ5K, k_quants::vec_dot_q5k),
        DType::Q6K => kernel!(Q8K, k_quants::BlockQ6K, k_quants::vec_dot_q6k),
        DType::Mxfp4 => kernel!(Q8, mxfp4::BlockMxfp4, mxfp4::vec_dot),
        DType::Iq4Nl => kernel!(Q8, iq4::BlockIq4Nl, iq4::vec_dot_nl),
        DType::Iq4Xs => kernel!(Q8K, iq4::BlockIq4Xs, iq4::vec_dot_xs),
        _ => {
            return iq_grid::with_codebook!(
                dtype,
                B => Some(kernel!(Q8K, B, iq_grid::vec_dot::<B>)),
                _ => None
            )
        }
    })
}

/// `$block`'s codebook row kernel on instance `$isa` (one the CPU runs, not the scalar one),
/// for `sign_bytes` (`iq_grid::avx2::SignBytes`: IQ2/IQ3 and their re-encoded forms) or
/// `offset_bytes` (`iq_grid::avx2::OffsetBytes`: IQ1 and TQ).
#[cfg(target_arch = "x86_64")]
macro_rules! codebook_on {
    ($isa:expr, sign_bytes, $block:ty) => {
        codebook_on!(
            $isa,
            $block,
            vec_dot_sign_bytes,
            vec_dot_sign_bytes_x4,
            vec_dot_sign_bytes_avxvnni,
            vec_dot_sign_bytes_x4_avxvnni,
            vec_dot_sign_bytes_vnni512,
            vec_dot_sign_bytes_x4_vnni512
        )
    };
    ($isa:expr, offset_bytes, $block:ty) => {
        codebook_on!(
            $isa,
            $block,
            vec_dot_offset_bytes,
            vec_dot_offset_bytes_x4,
            vec_dot_offset_bytes_avxvnni,
            vec_dot_offset_bytes_x4_avxvnni,
            vec_dot_offset_bytes_vnni512,
            vec_dot_offset_bytes_x4_vnni512
        )
    };
    ($isa:expr, $block:ty, $dot:ident, $dot4:ident, $dot_avxvnni:ident, $dot4_avxvnni:ident,
     $dot_512:ident, $dot4_512:ident) => {{
        use iq_grid::avx2 as GA;
        match $isa {
            packed::Isa::AvxVnni => {
                kernel!(unsafe Q8K, $block, GA::$dot_avxvnni, GA::$dot4_avxvnni)
            }
            packed::Isa::Avx512Vnni => kernel!(unsafe Q8K, $block, GA::$dot_512, GA::$dot4_512),
            _ => kernel!(unsafe Q8K, $block, GA::$dot, GA::$dot4),
        }
    }};
}

/// A codebook format's row kernel (`iq_grid::avx2`'s sign-bytes and offset-bytes kernels) on
/// instance `isa`: the VNNI ones add each group's scaled pair sums with one `vpdpwssd`, the
/// AVX2 one with `madd` and an add, the same integers either way. `None` for another format,
/// for the scalar instance, or where this CPU does not run `isa` (the tests hold every
/// instance the CPU runs to the scalar kernel).
#[cfg(target_arch = "x86_64")]
pub fn codebook_kernel_on(dtype: DType, isa: packed::Isa) -> Option<Kernel> {
    if isa == packed::Isa::Scalar || !isa.runs() {
        return None;
    }
    Some(match dtype {
        DType::Iq2Xxs => codebook_on!(isa, sign_bytes, iq_grid::BlockIq2Xxs),
        DType::Iq2Xs => codebook_on!(isa, sign_bytes, iq_grid::BlockIq2Xs),
        DType::Iq2S => codebook_on!(isa, sign_bytes, iq_grid::BlockIq2S),
        DType::Iq3Xxs => codebook_on!(isa, sign_bytes, iq_grid::BlockIq3Xxs),
        DType::Iq3S => codebook_on!(isa, sign_bytes, iq_grid::BlockIq3S),
        DType::Iq1S => codebook_on!(isa, offset_bytes, iq_grid::BlockIq1S),
        DType::Iq1M => codebook_on!(isa, offset_bytes, iq_grid::BlockIq1M),
        DType::Tq1_0 => codebook_on!(isa, offset_bytes, iq_grid::BlockTq1_0),
        DType::Tq2_0 => codebook_on!(isa, offset_bytes, iq_grid::BlockTq2_0),
        _ => return None,
    })
}

/// The fastest kernel this CPU runs for a weight format.
pub fn best_kernel(dtype: DType) -> Option<Kernel> {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_rows() {
            let k = match dtype {
                DType::Q4_0 => Some(kernel!(
                    unsafe Q8,
                    q4_0::BlockQ4_0,
                    q4_0::avx2::vec_dot,
                    q4_0::avx2::vec_dot_x4,
                    q4_0::avx2::vec_dot_rows4
                )),
                DType::Q4_1 => Some(kernel!(
                    unsafe Q8,
                    q4_1::BlockQ4_1,
                    q4_1::avx2::vec_dot,
                    q4_1::avx2::vec_dot_x4,
                    q4_1::avx2::vec_dot_rows4,
                    q4_1::avx2::vec_dot_2x4
                )),
                DType::Q5_0 => Some(kernel!(
                    unsafe Q8,
                    q5_0::BlockQ5_0,
                    q5_0::avx2::vec_dot,
                    q5_0::avx2::vec_dot_x4,
                    none,
                    q5_0::avx2::vec_dot_2x4
                )),
                DType::Q5_1 => Some(kernel!(unsafe Q8, q5_1::BlockQ5_1, q5_1::avx2::vec_dot)),
                DType::Q8_0 => Some(kernel!(
                    unsafe Q8,
                    q8_0::BlockQ8_0,
                    q8_0::avx2::vec_dot,
                    // Interleaving four Q8_0 rows measured slower than one row at a time.
                    q8_0::avx2::vec_dot_x4,
                    none,
                    q8_0::avx2::vec_dot_2x4
                )),
                DType::Q2K => Some(kernel!(
                    unsafe Q8K,
                    k_quants::BlockQ2K,
                    k_quants::avx2::vec_dot_q2k,
                    k_quants::avx2::vec_dot_q2k_x4
                )),
                DType::Q3K => Some(kernel!(
                    unsafe Q8K,
                    k_quants::BlockQ3K,
                    k_quants::avx2::vec_dot_q3k,
                    k_quants::avx2::vec_dot_q3k_x4
                )),
                DType::Q4K => Some(kernel!(
                    unsafe Q8K,
                    k_quants::BlockQ4K,
                    k_quants::avx2::vec_dot_q4k,
                    k_quants::avx2::vec_dot_q4k_x4
                )),
                DType::Q5K => Some(kernel!(
                    unsafe Q8K,
                    k_quants::BlockQ5K,
                    k_quants::avx2::vec_dot_q5k,
                    k_quants::avx2::vec_dot_q5k_x4
                )),
                DType::Q6K => {
                    Some(kernel!(unsafe Q8K, k_quants::BlockQ6K, k_quants::avx2::vec_dot_q6k))
                }
                DType::Mxfp4 => Some(kernel!(
                    unsafe Q8,
                    mxfp4::BlockMxfp4,
                    mxfp4::avx2::vec_dot,
                    mxfp4::avx2::vec_dot_x4
                )),
                DType::Iq4Nl => Some(kernel!(unsafe Q8, iq4::BlockIq4Nl, iq4::avx2::vec_dot_nl)),
                DType::Iq4Xs => Some(kernel!(unsafe Q8K, iq4::BlockIq4Xs, iq4::avx2::vec_dot_xs)),
                _ => codebook_kernel_on(dtype, packed::Isa::best()),
            };
            if k.is_some() {
                return k;
            }
        }
    }
    scalar_kernel(dtype)
}

/// A file format the CPU re-encodes at load into a form of its own, where its row kernel
/// reads that form faster (ik_llama.cpp's `-rtr` repacks go further, interleaving rows). Each
/// form keeps the file's block size, so rows keep their byte offsets and lengths, and gives the
/// file's values exactly: dequantisation, the kernels and the prefill tile all give the file
/// form's bits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Recoded {
    /// [`iq_grid::BlockIq2XxsRecoded`]: IQ2_XXS's signs ready to unpack in vector.
    Iq2Xxs,
    /// [`iq_grid::BlockIq3XxsRecoded`]: the same for IQ3_XXS.
    Iq3Xxs,
}

impl Recoded {
    /// Every form (for the tests, which hold each to its file form on any CPU).
    pub const ALL: &'static [Recoded] = &[Recoded::Iq2Xxs, Recoded::Iq3Xxs];

    /// The form this CPU re-encodes `dtype` into, if any: only where the AVX2 kernels run,
    /// which are what the forms are for. `FERRUM_RECODE=0` keeps every weight in its file's
    /// form (to measure what a form buys); fixed at the first call.
    pub fn of(dtype: DType) -> Option<Recoded> {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if !*ON.get_or_init(|| std::env::var("FERRUM_RECODE").map_or(true, |v| v != "0")) {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2_rows() {
            return Recoded::ALL.iter().copied().find(|f| f.dtype() == dtype);
        }
        let _ = dtype;
        None
    }

    /// The file format the form came from.
    pub fn dtype(self) -> DType {
        match self {
            Recoded::Iq2Xxs => DType::Iq2Xxs,
            Recoded::Iq3Xxs => DType::Iq3Xxs,
        }
    }

    /// Whether `bytes` are whole, aligned blocks of [`Self::dtype`]: what [`Self::recode`]
    /// takes.
    pub fn takes(self, bytes: &[u8]) -> bool {
        match self {
            Recoded::Iq2Xxs => cast_blocks::<iq_grid::BlockIq2Xxs>(bytes).is_some(),
            Recoded::Iq3Xxs => cast_blocks::<iq_grid::BlockIq3Xxs>(bytes).is_some(),
        }
    }

    /// Re-encodes whole blocks of [`Self::dtype`] in place; `false` (the bytes untouched)
    /// when they are not whole, aligned blocks.
    pub fn recode(self, bytes: &mut [u8]) -> bool {
        use iq_grid::{BlockIq2XxsRecoded as R2, BlockIq3XxsRecoded as R3};
        match self {
            Recoded::Iq2Xxs => recode_blocks(bytes, R2::from_file),
            Recoded::Iq3Xxs => recode_blocks(bytes, R3::from_file),
        }
    }

    /// [`dequantize`] of the bytes before re-encoding, from the re-encoded ones.
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) -> bool {
        if self.dtype().bytes_for(out.len()) != Some(bytes.len()) {
            return false;
        }
        match self {
            Recoded::Iq2Xxs => run(bytes, out, iq_grid::dequantize_iq2_xxs_recoded),
            Recoded::Iq3Xxs => run(bytes, out, iq_grid::dequantize_iq3_xxs_recoded),
        }
    }

    /// The portable kernel over the form (the SIMD one's reference).
    pub fn scalar_kernel(self) -> Kernel {
        match self {
            Recoded::Iq2Xxs => kernel!(
                Q8K,
                iq_grid::BlockIq2XxsRecoded,
                iq_grid::vec_dot::<iq_grid::BlockIq2XxsRecoded>
            ),
            Recoded::Iq3Xxs => kernel!(
                Q8K,
                iq_grid::BlockIq3XxsRecoded,
                iq_grid::vec_dot::<iq_grid::BlockIq3XxsRecoded>
            ),
        }
    }

    /// The fastest kernel this CPU runs over the form.
    pub fn best_kernel(self) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if avx2_rows() {
            if let Some(k) = self.kernel_on(packed::Isa::best()) {
                return k;
            }
        }
        self.scalar_kernel()
    }

    /// The form's row kernel on instance `isa`, as [`codebook_kernel_on`].
    #[cfg(target_arch = "x86_64")]
    pub fn kernel_on(self, isa: packed::Isa) -> Option<Kernel> {
        if isa == packed::Isa::Scalar || !isa.runs() {
            return None;
        }
        Some(match self {
            Recoded::Iq2Xxs => codebook_on!(isa, sign_bytes, iq_grid::BlockIq2XxsRecoded),
            Recoded::Iq3Xxs => codebook_on!(isa, sign_bytes, iq_grid::BlockIq3XxsRecoded),
        })
    }
}

/// Rewrites each block `F` of `bytes` in place as `to(block)`, a block of the same size; `false`
/// (nothing written) when the bytes are not whole, aligned blocks.
fn recode_blocks<F: Copy, R: Copy>(bytes: &mut [u8], to: fn(&F) -> R) -> bool {
    let size = std::mem::size_of::<F>();
    assert_eq!(
        size,
        std::mem::size_of::<R>(),
        "a re-encoded form keeps the block size"
    );
    if cast_blocks::<F>(bytes).is_none() {
        return false;
    }
    for c in bytes.chunks_exact_mut(size) {
        let Some(&[b]) = cast_blocks::<F>(c) else {
            return false;
        };
        // SAFETY: `c` is `size` bytes, the size of `R`; the write is unaligned, and `R` is
        // plain old data (integers and f16s) with no padding, as its size assert says.
        unsafe { std::ptr::write_unaligned(c.as_mut_ptr() as *mut R, to(&b)) };
    }
    true
}

/// Whether the file-layout row kernels, the re-encoded forms and the codebook tiles' decoding
/// take their AVX2 instance: the CPU runs it, and `FERRUM_ISA` does not ask for the portable
/// one. So a `FERRUM_ISA=scalar` process runs every integer kernel's scalar twin, the packed
/// ones' ([`packed::Isa::best`]) and these alike, and whole-model tests hold them to the
/// references too.
#[cfg(target_arch = "x86_64")]
pub fn avx2_rows() -> bool {
    has_avx2() && packed::Isa::best() != packed::Isa::Scalar
}

/// AVX2 with FMA and F16C: every x86-64 CPU since Haswell / Zen 1.
#[cfg(target_arch = "x86_64")]
pub fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}
