//! Quantisation: f32 rows to every GGUF block format, and whole model files to GGUF.
//!
//! - [`formats`]: one row quantiser per block format, following llama.cpp's reference
//!   (non-imatrix) algorithms, byte-identical to the `gguf` Python package where it has one.
//! - [`writer`]: a streaming GGUF v3 writer (metadata first, then tensor data one tensor at a
//!   time).
//! - [`recipe`]: which block format each tensor gets for a file type (llama-quantize's rules
//!   for Q4_K_M and friends).
//! - [`convert`]: a Hugging Face folder (Llama, Qwen2, Qwen3) as GGUF tensors and metadata.
//! - [`quantize_file`]: the whole pipeline, GGUF or Hugging Face folder in, GGUF out.

pub mod convert;
pub mod formats;
mod pipeline;
pub mod recipe;
pub mod writer;

use std::fmt;
use std::str::FromStr;

use ferrum_core::{DType, Error, Result};

pub use pipeline::{quantize_file, QuantizeReport};

/// A whole-file quantisation target, as llama-quantize names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3KS,
    Q3KM,
    Q3KL,
    Q4KS,
    Q4KM,
    Q5KS,
    Q5KM,
    Q6K,
    /// gpt-oss's release format: expert stacks MXFP4, every other matrix Q8_0.
    Mxfp4Moe,
    /// The non-linear 4-bit i-quants (attn_v and the first eighth of ffn_down Q5_K, as
    /// llama-quantize without an importance matrix).
    Iq4Nl,
    Iq4Xs,
}

impl FileType {
    pub const ALL: [FileType; 20] = [
        FileType::F32,
        FileType::F16,
        FileType::BF16,
        FileType::Q8_0,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q2K,
        FileType::Q3KS,
        FileType::Q3KM,
        FileType::Q3KL,
        FileType::Q4KS,
        FileType::Q4KM,
        FileType::Q5KS,
        FileType::Q5KM,
        FileType::Q6K,
        FileType::Mxfp4Moe,
        FileType::Iq4Nl,
        FileType::Iq4Xs,
    ];

    /// The name llama-quantize uses (`Q4_K_M`, ...).
    pub fn name(self) -> &'static str {
        match self {
            FileType::F32 => "F32",
            FileType::F16 => "F16",
            FileType::BF16 => "BF16",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_0 => "Q4_0",
            FileType::Q4_1 => "Q4_1",
            FileType::Q5_0 => "Q5_0",
            FileType::Q5_1 => "Q5_1",
            FileType::Q2K => "Q2_K",
            FileType::Q3KS => "Q3_K_S",
            FileType::Q3KM => "Q3_K_M",
            FileType::Q3KL => "Q3_K_L",
            FileType::Q4KS => "Q4_K_S",
            FileType::Q4KM => "Q4_K_M",
            FileType::Q5KS => "Q5_K_S",
            FileType::Q5KM => "Q5_K_M",
            FileType::Q6K => "Q6_K",
            FileType::Mxfp4Moe => "MXFP4_MOE",
            FileType::Iq4Nl => "IQ4_NL",
            FileType::Iq4Xs => "IQ4_XS",
        }
    }

    /// llama.cpp's `llama_ftype` id, written to `general.file_type`.
    pub fn llama_ftype(self) -> u32 {
        match self {
            FileType::F32 => 0,
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q2K => 10,
            FileType::Q3KS => 11,
            FileType::Q3KM => 12,
            FileType::Q3KL => 13,
            FileType::Q4KS => 14,
            FileType::Q4KM => 15,
            FileType::Q5KS => 16,
            FileType::Q5KM => 17,
            FileType::Q6K => 18,
            FileType::BF16 => 32,
            FileType::Mxfp4Moe => 38,
            FileType::Iq4Nl => 25,
            FileType::Iq4Xs => 30,
        }
    }

    /// The block format most weights get (`llama_ftype_get_default_type`).
    pub fn default_dtype(self) -> DType {
        match self {
            FileType::F32 => DType::F32,
            FileType::F16 => DType::F16,
            FileType::BF16 => DType::BF16,
            FileType::Q8_0 => DType::Q8_0,
            FileType::Q4_0 => DType::Q4_0,
            FileType::Q4_1 => DType::Q4_1,
            FileType::Q5_0 => DType::Q5_0,
            FileType::Q5_1 => DType::Q5_1,
            FileType::Q2K => DType::Q2K,
            FileType::Q3KS | FileType::Q3KM | FileType::Q3KL => DType::Q3K,
            FileType::Q4KS | FileType::Q4KM => DType::Q4K,
            FileType::Q5KS | FileType::Q5KM => DType::Q5K,
            FileType::Q6K => DType::Q6K,
            FileType::Mxfp4Moe => DType::Mxfp4,
            FileType::Iq4Nl => DType::Iq4Nl,
            FileType::Iq4Xs => DType::Iq4Xs,
        }
    }
}

/// llama-quantize's low-bit i-quant and ternary recipes, which ferrum reads but does not make.
const CODEBOOK_TYPES: [&str; 12] = [
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
    "TQ1_0", "TQ2_0",
];

impl fmt::Display for FileType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FileType {
    type Err = Error;

    /// Accepts llama-quantize's names in any case (`Q4_K_M`, `q8_0`, `bf16`).
    fn from_str(s: &str) -> Result<FileType> {
        let wanted = s.trim().to_ascii_uppercase();
        if CODEBOOK_TYPES.contains(&wanted.as_str()) {
            return Err(Error::Unsupported(format!(
                "ferrum reads {wanted} files but does not make them: llama.cpp's codebook \
                 searches for the 1-3 bit i-quants need an importance matrix \
                 (`llama-imatrix`, then `llama-quantize --imatrix FILE`), which ferrum does \
                 not implement. Make the file with llama-quantize, or choose IQ4_XS or IQ4_NL."
            )));
        }
        FileType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                let names: Vec<&str> = FileType::ALL.iter().map(|t| t.name()).collect();
                Error::InvalidRequest(format!(
                    "unknown quantisation type {s:?} (one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// Quantises one row (or any run of whole blocks) of `x` into `out`, which must be exactly
/// `dtype.bytes_for(x.len())` bytes.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut [u8]) -> Result<()> {
    let want = dtype.bytes_for(x.len()).ok_or_else(|| {
        Error::InvalidRequest(format!(
            "{} values are not a whole number of {dtype} blocks ({})",
            x.len(),
            dtype.block_len()
        ))
    })?;
    if out.len() != want {
        return Err(Error::InvalidRequest(format!(
            "{dtype} output buffer is {} bytes, {} values need {want}",
            out.len(),
            x.len()
        )));
    }
    use formats::*;
    match dtype {
        DType::F32 => float::quantize_f32(x, out),
        DType::F16 => float::quantize_f16(x, out),
        DType::BF16 => float::quantize_bf16(x, out),
        DType::Q4_0 => q4_0::quantize(x, out),
        DType::Q4_1 => q4_1::quantize(x, out),
        DType::Q5_0 => q5_0::quantize(x, out),
        DType::Q5_1 => q5_1::quantize(x, out),
        DType::Q8_0 => q8_0::quantize(x, out),
        DType::Q2K => q2_k::quantize(x, out),
        DType::Q3K => q3_k::quantize(x, out),
        DType::Q4K => q4_k::quantize(x, out),
        DType::Q5K => q5_k::quantize(x, out),
        DType::Q6K => q6_k::quantize(x, out),
        DType::Mxfp4 => mxfp4::quantize(x, out),
        DType::Iq4Nl => iq4::quantize_nl(x, out),
        DType::Iq4Xs => iq4::quantize_xs(x, out),
        DType::Iq2Xxs
        | DType::Iq2Xs
        | DType::Iq2S
        | DType::Iq3Xxs
        | DType::Iq3S
        | DType::Iq1S
        | DType::Iq1M
        | DType::Tq1_0
        | DType::Tq2_0 => {
            return Err(Error::Unsupported(format!(
                "quantising to {dtype} is not supported: the codebook formats need llama.cpp's \
                 importance-matrix search (llama-quantize --imatrix); ferrum reads them, and \
                 quantises to IQ4_XS and IQ4_NL"
            )))
        }
        DType::U8 => {
            return Err(Error::Unsupported(
                "U8 holds raw bytes, not numbers to quantise".into(),
            ))
        }
        DType::Q8_1 | DType::Q8K => {
            return Err(Error::Unsupported(format!(
                "{dtype} is an activation format; weights are not stored in it"
            )))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_type_names_round_trip() {
        for t in FileType::ALL {
            assert_eq!(t.to_string().parse::<FileType>().unwrap(), t);
            assert_eq!(t.name().to_lowercase().parse::<FileType>().unwrap(), t);
        }
        assert_eq!("q4_k_m".parse::<FileType>().unwrap(), FileType::Q4KM);
        assert!("Q4_K".parse::<FileType>().is_err());
        assert_eq!("iq4_xs".parse::<FileType>().unwrap(), FileType::Iq4Xs);
        let e = "IQ2_XXS".parse::<FileType>().unwrap_err().to_string();
        assert!(e.contains("importance matrix"), "{e}");
    }
}
