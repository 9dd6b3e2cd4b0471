//! Which block format each tensor gets, after llama.cpp's `llama-quant.cpp`
//! (`tensor_allows_quantization`, `llama_tensor_get_type_impl`, `tensor_type_fallback`), for
//! dense (non-MoE) decoders and without an importance matrix.
//!
//! The rules depend on the order tensors are visited (the `attn_v` / `ffn_down` counters), so
//! [`plan`] takes them in llama.cpp's order: see [`llama_order`].

use std::cmp::Ordering;

use ferrum_core::DType;

use crate::FileType;

/// A tensor to be planned: GGUF name, GGML dims (`dims[0]` = row length).
pub struct PlanInput<'a> {
    pub name: &'a str,
    pub dims: &'a [usize],
}

/// What the recipe needs to know about the model.
pub struct ModelInfo<'a> {
    pub arch: &'a str,
    pub n_layer: usize,
    /// `head_count / head_count_kv`.
    pub n_gqa: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnQ,
    /// `attn_v`, and the fused `attn_qkv` / `attn_kv_b`: llama.cpp gives all three the
    /// `attn_v` rules (its separate `attn_qkv` branch is never reached).
    AttnV,
    AttnK,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        Category::TokenEmbd
    } else if name.contains("attn_qkv.weight")
        || name.contains("attn_kv_b.weight")
        || name.contains("attn_v.weight")
    {
        Category::AttnV
    } else if name.contains("attn_k.weight") {
        Category::AttnK
    } else if name.contains("attn_q.weight") {
        Category::AttnQ
    } else if name.contains("attn_output.weight") {
        Category::AttnOutput
    } else if name.contains("ffn_up") {
        Category::FfnUp
    } else if name.contains("ffn_gate") {
        Category::FfnGate
    } else if name.contains("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// Whether llama-quantize would quantise this tensor at all: 2-D or more, a `weight`, not a
/// norm, a router or a positional table.
pub fn allows_quantization(name: &str, dims: &[usize]) -> bool {
    // ggml_n_dims: trailing dimensions of 1 do not count.
    let n_dims = dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
    n_dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && name != "position_embd.weight"
        && name != "token_types.weight"
        && !name.contains("ssm_conv1d")
        && !name.contains("attn_rel_b.weight")
}

/// llama.cpp's tensor order (`weight_name_comparer`): tensors outside `blk.N.` first, then by
/// layer number, then by name.
pub fn llama_order(a: &str, b: &str) -> Ordering {
    fn layer(s: &str) -> i64 {
        s.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(-1)
    }
    layer(a).cmp(&layer(b)).then_with(|| a.cmp(b))
}

fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    i_layer < n_layers / 8
        || i_layer >= 7 * n_layers / 8
        || (i_layer as i64 - (n_layers / 8) as i64) % 3 == 2
}

/// The fallback when a row length is not a multiple of the chosen block
/// (`tensor_type_fallback`): a 32-block type of similar quality, or F16 if even that fails.
pub fn fallback(dtype: DType, row_len: usize) -> DType {
    if row_len.is_multiple_of(dtype.block_len()) {
        return dtype;
    }
    let t = match dtype {
        DType::Q2K | DType::Q3K => DType::Q4_0,
        DType::Q4K => DType::Q5_0,
        DType::Q5K => DType::Q5_1,
        DType::Q6K => DType::Q8_0,
        DType::Iq4Xs => DType::Iq4Nl,
        other => other,
    };
    if row_len.is_multiple_of(t.block_len()) {
        t
    } else {
        DType::F16
    }
}

/// The target format of each tensor, `None` for tensors that are not quantised (kept in
/// their float format). `tensors` must be in [`llama_order`].
pub fn plan(ftype: FileType, model: &ModelInfo, tensors: &[PlanInput]) -> Vec<Option<DType>> {
    use FileType as F;
    let default = ftype.default_dtype();
    let falcon = model.arch == "falcon";
    let tied = !tensors.iter().any(|t| category(t.name) == Category::Output);
    let n_attention_wv = tensors
        .iter()
        .filter(|t| category(t.name) == Category::AttnV)
        .count();
    let n_layer = model.n_layer;
    let mut i_attention_wv = 0usize;
    let mut i_ffn_down = 0usize;

    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !allows_quantization(t.name, t.dims) {
            out.push(None);
            continue;
        }
        if !default.is_quantized() {
            out.push(Some(default));
            continue;
        }
        let row_len = t.dims[0];
        let cat = category(t.name);
        if ftype == F::Mxfp4Moe {
            // llama.cpp: stacked experts (a third dimension above 1) MXFP4, the rest Q8_0.
            let experts = t.dims.get(2).is_some_and(|&e| e > 1) && cat != Category::Output;
            let ty = if experts { DType::Mxfp4 } else { DType::Q8_0 };
            out.push(Some(fallback(ty, row_len)));
            continue;
        }
        let mut ty = default;
        match cat {
            Category::Output | Category::TokenEmbd if cat == Category::Output || tied => {
                if falcon || !row_len.is_multiple_of(ty.block_len()) {
                    ty = DType::Q8_0;
                } else if ty != DType::Q8_0 {
                    ty = DType::Q6K;
                }
            }
            Category::TokenEmbd => {}
            Category::AttnV => {
                match ftype {
                    F::Q2K => {
                        ty = if model.n_gqa >= 4 {
                            DType::Q4K
                        } else {
                            DType::Q3K
                        }
                    }
                    F::Q3KM => {
                        ty = if i_attention_wv < 2 {
                            DType::Q5K
                        } else {
                            DType::Q4K
                        }
                    }
                    F::Q3KL => ty = DType::Q5K,
                    F::Q4KM | F::Q5KM if use_more_bits(i_attention_wv, n_attention_wv) => {
                        ty = DType::Q6K
                    }
                    F::Q4KS if i_attention_wv < 4 => ty = DType::Q5K,
                    F::Iq4Nl | F::Iq4Xs if model.n_gqa >= 4 => ty = DType::Q5K,
                    _ => {}
                }
                i_attention_wv += 1;
            }
            Category::FfnDown => {
                let i = i_ffn_down;
                match ftype {
                    F::Q2K => ty = DType::Q3K,
                    F::Q3KM => {
                        ty = if i < n_layer / 16 {
                            DType::Q5K
                        } else if !falcon || use_more_bits(i, n_layer) {
                            DType::Q4K
                        } else {
                            DType::Q3K
                        }
                    }
                    F::Q3KL => ty = if falcon { DType::Q4K } else { DType::Q5K },
                    F::Q4KM => {
                        if falcon {
                            ty = if i < n_layer / 16 {
                                DType::Q6K
                            } else if use_more_bits(i, n_layer) {
                                DType::Q5K
                            } else {
                                DType::Q4K
                            };
                        } else if use_more_bits(i, n_layer) {
                            ty = DType::Q6K;
                        }
                    }
                    F::Q5KM if use_more_bits(i, n_layer) => ty = DType::Q6K,
                    F::Q4KS if !falcon && i < n_layer / 8 => ty = DType::Q5K,
                    // Without an importance matrix (ferrum has none to give).
                    F::Iq4Nl | F::Iq4Xs if i < n_layer / 8 => ty = DType::Q5K,
                    _ => {}
                }
                i_ffn_down += 1;
            }
            Category::AttnOutput => {
                if !falcon {
                    match ftype {
                        F::Q2K => ty = DType::Q3K,
                        F::Q3KM => ty = DType::Q4K,
                        F::Q3KL => ty = DType::Q5K,
                        _ => {}
                    }
                } else if ftype == F::Q3KL {
                    ty = DType::Q4K;
                }
            }
            Category::AttnQ
            | Category::AttnK
            | Category::FfnUp
            | Category::FfnGate
            | Category::Output
            | Category::Other => {}
        }
        out.push(Some(fallback(ty, row_len)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp_for_30_layers() {
        // SmolLM2-135M has 30 layers: llama.cpp gives attn_v/ffn_down Q6_K on these.
        let picked: Vec<usize> = (0..30).filter(|&i| use_more_bits(i, 30)).collect();
        assert_eq!(picked, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]);
    }

    #[test]
    fn order_puts_globals_first_then_layers_numerically() {
        let mut names = vec![
            "blk.10.attn_v.weight",
            "output.weight",
            "blk.2.attn_q.weight",
            "blk.2.attn_k.weight",
            "token_embd.weight",
        ];
        names.sort_by(|a, b| llama_order(a, b));
        assert_eq!(
            names,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.attn_k.weight",
                "blk.2.attn_q.weight",
                "blk.10.attn_v.weight"
            ]
        );
    }

    #[test]
    fn fallbacks() {
        assert_eq!(fallback(DType::Q4K, 64), DType::Q5_0);
        assert_eq!(fallback(DType::Q5K, 64), DType::Q5_1);
        assert_eq!(fallback(DType::Q6K, 576), DType::Q8_0);
        assert_eq!(fallback(DType::Q3K, 96), DType::Q4_0);
        assert_eq!(fallback(DType::Q2K, 512), DType::Q2K);
        assert_eq!(fallback(DType::Q4K, 48), DType::F16);
    }
}
