//! Phi-3 and Phi-4-mini.
//!
//! Against Llama: Q, K and V in one fused projection (`qkv_proj`, GGUF `attn_qkv`), gate and
//! up in one (`gate_up_proj`, GGUF `ffn_up` of twice the width) — both land in the decoder's
//! buffers in the layout the separate projections would, so they are single matmuls; partial
//! rotary (`partial_rotary_factor`: only the leading dimensions of a head rotate); LongRoPE
//! (per-frequency divisors, long ones past the original context, and an attention factor
//! on cos and sin); a sliding window on every layer where the config has one.

use ferrum_core::Result;
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{hf_f64, hf_opt_usize, ModelConfig, RopeScaling};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Phi3,
    name: "phi3",
    gguf_aliases: &[],
    hf_classes: &["Phi3ForCausalLM"],
    model_types: &["phi3"],
    from_hf,
    from_gguf,
    names: &[
        (
            "model.layers.{i}.self_attn.qkv_proj.weight",
            "blk.{i}.attn_qkv.weight",
        ),
        (
            "model.layers.{i}.mlp.gate_up_proj.weight",
            "blk.{i}.ffn_up.weight",
        ),
    ],
};

fn from_hf(j: &Json) -> Result<ModelConfig> {
    let mut c = ModelConfig::hf_base(Arch::Phi3, j)?;
    // transformers' Phi-3 attention always honours the window.
    c.set_window_all(hf_opt_usize(j, "sliding_window").filter(|&w| w > 0));
    if let Some(RopeScaling::LongRope {
        original_max_position,
        ..
    }) = &mut c.rope_scaling
    {
        if *original_max_position == 0 {
            *original_max_position =
                hf_opt_usize(j, "original_max_position_embeddings").unwrap_or(c.max_position);
        }
        let orig = *original_max_position;
        let params = j
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or(j.get("rope_parameters"));
        c.rope_factor = match params.and_then(|p| hf_f64(p, "attention_factor")) {
            Some(f) => f as f32,
            None => attn_factor(c.max_position, orig),
        };
    }
    c.check("config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::Phi3, g, vocab, tied)?;
    // The short/long factors are tensors (`rope_factors_short/long`), which the decoder
    // reads into these lists.
    if let Some(orig) = g.get_u64("phi3.rope.scaling.original_context_length") {
        c.rope_scaling = Some(RopeScaling::LongRope {
            short: Vec::new(),
            long: Vec::new(),
            original_max_position: orig as usize,
        });
    }
    c.rope_factor = g
        .get_f64("phi3.rope.scaling.attn_factor")
        .map_or(1.0, |v| v as f32);
    c.check(&g.path.display().to_string())
}

/// LongRoPE's scaling of cos and sin: `√(1 + ln s / ln original)` for a context stretched by
/// `s = max / original`, 1 when not stretched.
fn attn_factor(max: usize, original: usize) -> f32 {
    let s = max as f64 / original.max(1) as f64;
    if s <= 1.0 {
        1.0
    } else {
        (1.0 + s.ln() / (original as f64).ln()).sqrt() as f32
    }
}
