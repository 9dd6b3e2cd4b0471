//! Ministral 3 and Mistral Small 3.x's language model (`Ministral3ForCausalLM`, the text
//! part of `Mistral3ForConditionalGeneration`; GGUF `mistral3`).
//!
//! Against Llama: YaRN RoPE, an optional window on every layer, and Llama 4's query
//! temperature: queries at position `p` are multiplied by
//! `1 + llama_4_scaling_beta · ln(1 + floor(p / original_max_position_embeddings))`, so only
//! positions past the original context change. llama.cpp's converter writes the beta as
//! `attention.temperature_scale` and takes the floor from the YaRN original context.

use ferrum_backend::RopeLayout;
use ferrum_core::Result;
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{hf_f64, hf_opt_usize, ModelConfig, RopeScaling};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Mistral3,
    name: "mistral3",
    gguf_aliases: &[],
    hf_classes: &["Ministral3ForCausalLM", "Mistral3ForConditionalGeneration"],
    model_types: &["ministral3", "mistral3"],
    from_hf,
    from_gguf,
    names: &[],
};

/// `(beta, floor)` of the query temperature from a `rope_parameters` object, where its
/// beta is set.
pub(crate) fn hf_temperature(j: &Json) -> Option<(f32, usize)> {
    let p = j.get("rope_parameters").or_else(|| j.get("rope_scaling"))?;
    let beta = hf_f64(p, "llama_4_scaling_beta").filter(|&b| b != 0.0)?;
    let floor = hf_opt_usize(p, "original_max_position_embeddings")
        .or_else(|| hf_opt_usize(j, "original_max_position_embeddings"))?;
    Some((beta as f32, floor))
}

/// The same from a GGUF's `attention.temperature_scale`, the floor being the YaRN original
/// context (what llama.cpp uses).
pub(crate) fn gguf_temperature(g: &GgufFile, arch: &str, c: &ModelConfig) -> Option<(f32, usize)> {
    let beta = g
        .get_f64(&format!("{arch}.attention.temperature_scale"))
        .filter(|&b| b != 0.0)?;
    let floor = match &c.rope_scaling {
        Some(RopeScaling::Yarn {
            original_max_position,
            ..
        }) => *original_max_position as usize,
        _ => g
            .get_u64(&format!("{arch}.rope.scaling.original_context_length"))
            .map_or(0, |v| v as usize),
    };
    Some((beta as f32, floor))
}

fn from_hf(j: &Json) -> Result<ModelConfig> {
    let j = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
    // Mistral Small 4's multimodal checkpoints share the class; their language model is
    // Mistral 4's.
    if j.get("model_type").and_then(Json::as_str) == Some("mistral4") {
        return super::deepseek2::from_hf(Arch::Mistral4, j);
    }
    let mut c = ModelConfig::hf_base(Arch::Mistral3, j)?;
    if c.sliding_window.is_none() {
        c.set_window_all(hf_opt_usize(j, "sliding_window").filter(|&w| w > 0));
    }
    c.attn_temp = hf_temperature(j);
    c.check("config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::Mistral3, g, vocab, tied)?;
    // The converter treats it as Llama: Q/K rows permuted for the interleaved rotation.
    c.rope_layout = RopeLayout::Interleaved;
    c.attn_temp = gguf_temperature(g, "mistral3", &c);
    c.check(&g.path.display().to_string())
}
