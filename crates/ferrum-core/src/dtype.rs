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
    /// The i-quants: 4-bit non-linear (32 values a block, one f16 scale; and 256 with 6-bit
    /// sub-block scales), then the codebook formats whose groups of four or eight values are
    /// indices into fixed grids (2, 3 and 1.5 bits a weight, and the ternary TQ formats).
    Iq4Nl,
    Iq4Xs,
    Iq2Xxs,
    Iq2Xs,
    Iq2S,
    Iq3Xxs,
    Iq3S,
    Iq1S,
    Iq1M,
    Tq1_0,
    Tq2_0,
    /// Raw bytes (safetensors' U8: the `_blocks` and `_scales` of MXFP4 checkpoints), read
    /// only by the loader that knows their layout. GGML has no such type.
    U8,
}

impl DType {
    /// Maps a GGML type id; `None` for ids this build does not know.
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
            16 => DType::Iq2Xxs,
            17 => DType::Iq2Xs,
            18 => DType::Iq3Xxs,
            19 => DType::Iq1S,
            20 => DType::Iq4Nl,
            21 => DType::Iq3S,
            22 => DType::Iq2S,
            23 => DType::Iq4Xs,
            29 => DType::Iq1M,
            34 => DType::Tq1_0,
            35 => DType::Tq2_0,
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
            DType::Iq2Xxs => 16,
            DType::Iq2Xs => 17,
            DType::Iq3Xxs => 18,
            DType::Iq1S => 19,
            DType::Iq4Nl => 20,
            DType::Iq3S => 21,
            DType::Iq2S => 22,
            DType::Iq4Xs => 23,
            DType::Iq1M => 29,
            DType::Tq1_0 => 34,
            DType::Tq2_0 => 35,
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
            | DType::Mxfp4
            | DType::Iq4Nl => 32,
            DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
            | DType::Q8K
            | DType::Iq4Xs
            | DType::Iq2Xxs
            | DType::Iq2Xs
            | DType::Iq2S
            | DType::Iq3Xxs
            | DType::Iq3S
            | DType::Iq1S
            | DType::Iq1M
            | DType::Tq1_0
            | DType::Tq2_0 => 256,
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
            DType::Iq4Nl => 18,
            DType::Iq4Xs => 136,
            DType::Iq2Xxs => 66,
            DType::Iq2Xs => 74,
            DType::Iq2S => 82,
            DType::Iq3Xxs => 98,
            DType::Iq3S => 110,
            DType::Iq1S => 50,
            DType::Iq1M => 56,
            DType::Tq1_0 => 54,
            DType::Tq2_0 => 66,
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
            DType::Iq4Nl => "IQ4_NL",
            DType::Iq4Xs => "IQ4_XS",
            DType::Iq2Xxs => "IQ2_XXS",
            DType::Iq2Xs => "IQ2_XS",
            DType::Iq2S => "IQ2_S",
            DType::Iq3Xxs => "IQ3_XXS",
            DType::Iq3S => "IQ3_S",
            DType::Iq1S => "IQ1_S",
            DType::Iq1M => "IQ1_M",
            DType::Tq1_0 => "TQ1_0",
            DType::Tq2_0 => "TQ2_0",
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
