//! Gemma 3 (text; also the language model of `Gemma3ForConditionalGeneration` checkpoints).
//!
//! Against Llama: embeddings scaled by √hidden; four RMSNorms a layer (before and after
//! attention, before and after the FFN), computed as `x·(1 + w)` on the Hugging Face weights
//! (GGUF files store `1 + w`); QK-norm per head; GeGLU with tanh GELU; a tied head; scores
//! scaled by `query_pre_attn_scalar^-½`; local layers (a sliding window, RoPE base
//! `rope_local_base_freq`, unscaled) and global layers (full attention, `rope_theta` with any
//! scaling) in the pattern `layer_types` gives — llama.cpp's GGUFs carry no pattern, and
//! its graph uses five local layers, then one global.

use ferrum_backend::Activation;
use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{
    hf_f64, hf_opt_usize, parse_hf_scaling, LayerSpec, ModelConfig, NormPlan, QkNorm, Rope,
};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Gemma3,
    name: "gemma3",
    gguf_aliases: &[],
    hf_classes: &["Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"],
    model_types: &["gemma3_text", "gemma3"],
    from_hf,
    from_gguf,
    names: &[
        (
            "model.layers.{i}.post_attention_layernorm.weight",
            "blk.{i}.post_attention_norm.weight",
        ),
        (
            "model.layers.{i}.pre_feedforward_layernorm.weight",
            "blk.{i}.ffn_norm.weight",
        ),
        (
            "model.layers.{i}.post_feedforward_layernorm.weight",
            "blk.{i}.post_ffw_norm.weight",
        ),
    ],
};

/// Gemma's four norms a layer (Gemma 4's too).
pub(super) const NORMS: NormPlan = NormPlan {
    attn_in: Some("model.layers.{i}.input_layernorm.weight"),
    attn_out: Some("model.layers.{i}.post_attention_layernorm.weight"),
    ffn_in: Some("model.layers.{i}.pre_feedforward_layernorm.weight"),
    ffn_out: Some("model.layers.{i}.post_feedforward_layernorm.weight"),
};

/// llama.cpp's Gemma 3 pattern: layer `i` is local unless `(i + 1) % 6 == 0`.
const GGUF_PATTERN: usize = 6;
/// The local layers' RoPE base where a file does not give one.
const LOCAL_BASE: f32 = 10_000.0;

fn from_hf(j: &Json) -> Result<ModelConfig> {
    // A multimodal checkpoint nests the language model's settings.
    let j = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
    let mut c = ModelConfig::hf_base(Arch::Gemma3, j)?;
    c.tie_embeddings = j
        .get("tie_word_embeddings")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if j.get(k).is_some_and(|v| !v.is_null()) {
            return Err(Error::Unsupported(format!("config.json: Gemma {k}")));
        }
    }
    match j
        .get("hidden_activation")
        .or_else(|| j.get("hidden_act"))
        .and_then(Json::as_str)
    {
        None | Some("gelu_pytorch_tanh" | "gelu_tanh" | "gelu") => {}
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "config.json: Gemma activation {other:?}"
            )))
        }
    }
    // transformers 5 writes one RoPE entry per layer type; older files `rope_theta`,
    // `rope_scaling` and `rope_local_base_freq`.
    let per_type = j
        .get("rope_parameters")
        .filter(|p| p.get("full_attention").is_some());
    let (global, local) = match per_type {
        Some(p) => (
            p.get("full_attention"),
            p.get("sliding_attention")
                .and_then(|s| hf_f64(s, "rope_theta")),
        ),
        None => (None, hf_f64(j, "rope_local_base_freq")),
    };
    if let Some(g) = global {
        c.rope_theta = hf_f64(g, "rope_theta").unwrap_or(1_000_000.0) as f32;
        c.rope_scaling = parse_hf_scaling(g)?;
    } else if hf_f64(j, "rope_theta").is_none() {
        c.rope_theta = 1_000_000.0;
    }
    c.local_rope_theta = Some(local.map_or(LOCAL_BASE, |v| v as f32));
    let window = hf_opt_usize(j, "sliding_window").unwrap_or(4096);
    let layer_types: Option<Vec<&str>> = j
        .get("layer_types")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_str).collect());
    let pattern = hf_opt_usize(j, "sliding_window_pattern").unwrap_or(GGUF_PATTERN);
    c.layers = (0..c.n_layers)
        .map(|i| {
            let local = match &layer_types {
                Some(t) => t.get(i).copied() == Some("sliding_attention"),
                None => pattern > 0 && !(i + 1).is_multiple_of(pattern),
            };
            layer(local, window)
        })
        .collect();
    if layer_types.as_ref().is_some_and(|t| t.len() != c.n_layers) {
        return Err(Error::Weights(
            "config.json: layer_types does not list every layer".into(),
        ));
    }
    c.sliding_window = Some(window);
    c.attn_scale = (hf_f64(j, "query_pre_attn_scalar").unwrap_or(256.0) as f32).powf(-0.5);
    c.norm_offset = 1.0;
    common(c, "config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::Gemma3, g, vocab, tied)?;
    let key = |k: &str| format!("gemma3.{k}");
    let window = g
        .get_u64(&key("attention.sliding_window"))
        .map_or(4096, |v| v as usize);
    let pattern = g
        .get_u64(&key("attention.sliding_window_pattern"))
        .map_or(GGUF_PATTERN, |v| v as usize);
    c.layers = (0..c.n_layers)
        .map(|i| layer(pattern > 0 && !(i + 1).is_multiple_of(pattern), window))
        .collect();
    c.sliding_window = Some(window);
    c.local_rope_theta = Some(
        g.get_f64(&key("rope.freq_base_swa"))
            .map_or(LOCAL_BASE, |v| v as f32),
    );
    // Files carry no query scalar; llama.cpp uses head_dim, except for the 27B model
    // (62 layers), whose scalar is hidden / heads.
    c.attn_scale = match g.get_f64(&key("attention.scale")) {
        Some(s) => s as f32,
        None if c.n_layers == 62 => ((c.hidden_size / c.n_heads) as f32).powf(-0.5),
        None => (c.head_dim as f32).powf(-0.5),
    };
    common(c, &g.path.display().to_string())
}

fn layer(local: bool, window: usize) -> LayerSpec {
    if local {
        LayerSpec {
            window: Some(window),
            rope: Rope::Local,
            ..LayerSpec::GLOBAL
        }
    } else {
        LayerSpec::GLOBAL
    }
}

fn common(mut c: ModelConfig, source: &str) -> Result<ModelConfig> {
    c.norms = NORMS;
    c.qk_norm = QkNorm::PerHead;
    c.activation = Activation::GeluTanh;
    // transformers rounds √hidden to the activations' dtype (f32 here), as llama.cpp does.
    c.embed_scale = Some((c.hidden_size as f32).sqrt());
    c.check(source)
}
