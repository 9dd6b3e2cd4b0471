//! Element formats of stored tensors. The numeric ids are GGML's (`ggml_type`), so a GGUF
//! tensor's type maps straight onto this enum; safetensors dtypes map onto F32/F16/BF16.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    /// OCP microscaling FP4 (gpt-oss's experts): 32 E2M1 values and one E8M0 exponent.
    Mxfp4,
    /// Raw bytes (safetensors' U8: the `_blocks` and `_scales` of MXFP4 checkpoints), read
    /// only by the loader that knows their layout. GGML has no such type.
    U8,
}

impl DType {
    /// Maps a GGML type id; `None` for ids this build does not know (IQ formats, etc.).
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            9 => DType::Q8_1,
            10 => DType::Q2K,
            11 => DType::Q3K,
            12 => DType::Q4K,
            13 => DType::Q5K,
            14 => DType::Q6K,
            15 => DType::Q8K,
            30 => DType::BF16,
            39 => DType::Mxfp4,
            _ => return None,
        })
    }

    /// GGML's id for the type; `None` for [`DType::U8`], which GGML has not.
    pub fn ggml_id(self) -> Option<u32> {
        Some(match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q8_1 => 9,
            DType::Q2K => 10,
            DType::Q3K => 11,
            DType::Q4K => 12,
            DType::Q5K => 13,
            DType::Q6K => 14,
            DType::Q8K => 15,
            DType::BF16 => 30,
            DType::Mxfp4 => 39,
            DType::U8 => return None,
        })
    }

    /// Number of elements in one block (1 for plain float formats).
    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::U8 => 1,
            DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::Q8_1
            | DType::Mxfp4 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K | DType::Q8K => 256,
        }
    }

    /// Bytes in one block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q8_1 => 36,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
            DType::Q8K => 292,
            DType::Mxfp4 => 17,
        }
    }

    pub fn is_quantized(self) -> bool {
        !matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of blocks
    /// (or the size overflows).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::Q8_1 => "Q8_1",
            DType::Q2K => "Q2_K",
            DType::Q3K => "Q3_K",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
            DType::Q8K => "Q8_K",
            DType::Mxfp4 => "MXFP4",
            DType::U8 => "U8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for id in 0..40 {
            if let Some(t) = DType::from_ggml_id(id) {
                assert_eq!(t.ggml_id(), Some(id));
            }
        }
        assert_eq!(DType::from_ggml_id(4), None, "Q4_2 was removed from GGML");
    }

    #[test]
    fn partial_blocks_have_no_size() {
        assert_eq!(DType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(DType::Q4_0.bytes_for(33), None);
        assert_eq!(DType::Q6K.bytes_for(256), Some(210));
    }
}
