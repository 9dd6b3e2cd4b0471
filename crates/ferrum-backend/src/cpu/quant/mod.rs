//! Quantised block formats, one module each, following GGML's block layouts
//! (`ggml-common.h`): the `#[repr(C)]` block with a compile-time size check, and the reference
//! dequantisation to f32. The fast dot products against 8-bit activations build on these.

pub mod k_quants;
pub mod q4_0;
pub mod q4_1;
pub mod q5_0;
pub mod q5_1;
pub mod q8_0;

use ferrum_core::DType;
use half::{bf16, f16};

/// Reinterprets bytes as blocks. `None` when the length is not a whole number of blocks or
/// the bytes are not aligned for `B` (GGUF aligns tensor data to 32 bytes, so mapped
/// tensors always are).
pub fn cast_blocks<B: Copy>(bytes: &[u8]) -> Option<&[B]> {
    let size = std::mem::size_of::<B>();
    if bytes.len() % size != 0 || (bytes.as_ptr() as usize) % std::mem::align_of::<B>() != 0 {
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
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
            true
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
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
        DType::Q8_1 | DType::Q8K => false,
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
