//! Granite 3: Llama with four multipliers — on the embeddings (`embedding_multiplier`), on
//! the attention scores in place of 1/√head_dim (`attention_multiplier`), on each block's
//! output before the residual add (`residual_multiplier`), and logits divided by
//! `logits_scaling`.

use ferrum_backend::RopeLayout;
use ferrum_core::Result;
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{hf_f64, ModelConfig};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Granite,
    name: "granite",
    gguf_aliases: &[],
    hf_classes: &["GraniteForCausalLM"],
    model_types: &["granite"],
    from_hf,
    from_gguf,
    names: &[],
};

fn from_hf(j: &Json) -> Result<ModelConfig> {
    let mut c = ModelConfig::hf_base(Arch::Granite, j)?;
    let f = |k: &str, d: f64| hf_f64(j, k).unwrap_or(d) as f32;
    c.embed_scale = Some(f("embedding_multiplier", 1.0));
    c.attn_scale = f("attention_multiplier", 1.0);
    c.residual_scale = f("residual_multiplier", 1.0);
    c.logit_scale = 1.0 / f("logits_scaling", 1.0);
    c.check("config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::Granite, g, vocab, tied)?;
    // Converted as Llama: Q/K rows permuted for the interleaved rotation.
    c.rope_layout = RopeLayout::Interleaved;
    let f = |k: &str| g.get_f64(&format!("granite.{k}")).map(|v| v as f32);
    c.embed_scale = Some(f("embedding_scale").unwrap_or(1.0));
    c.attn_scale = f("attention.scale").unwrap_or(c.attn_scale);
    c.residual_scale = f("residual_scale").unwrap_or(1.0);
    c.logit_scale = 1.0 / f("logit_scale").unwrap_or(1.0);
    c.check(&g.path.display().to_string())
}
