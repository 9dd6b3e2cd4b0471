//! EmbeddingGemma: a Gemma 3 text model run with attention both ways
//! (`use_bidirectional_attention`). Gemma 3's blocks — RMSNorms (`1 + w`) before and after
//! attention and the FFN, RMSNorm on each query and key head, grouped-query attention
//! scaled by `query_pre_attn_scalar^-½`, GeGLU with tanh-GELU, the embedding times
//! `√hidden` — with its local layers seeing the keys within `sliding_window / 2` positions
//! either side (transformers' bidirectional window: distance `< sliding_window // 2 + 1`),
//! and its global layers every key. Its sentence-transformers modules (mean pooling, two
//! Dense projections, Normalize) make the embedding, as for any encoder.
//!
//! Hugging Face names (`1 + w` norms) and llama.cpp's `gemma-embedding` GGUF (norms stored
//! as `1 + w`; the Dense projections as `dense_2`/`dense_3`, read by the pooling). llama.cpp
//! scales a GGUF's attention by `head_dim^-½`, not by `query_pre_attn_scalar`; EmbeddingGemma
//! has the two equal, and a GGUF file is read as llama.cpp reads it.

use ferrum_backend::Activation;
use ferrum_core::{Error, Result};
use ferrum_loader::{GgufFile, ModelFile};
use serde_json::Value as Json;

use super::{bert::usize_of, EncoderConfig, Family, FfnKind, Layout, LocalAttention};

pub static LAYOUT: Layout = Layout {
    prefixes: &["", "model.", "model.language_model."],
    word: &["embed_tokens", "token_embd"],
    position: &[],
    types: &[],
    embed_norm: &[],
    qkv: &[],
    q: &["layers.{i}.self_attn.q_proj", "blk.{i}.attn_q"],
    k: &["layers.{i}.self_attn.k_proj", "blk.{i}.attn_k"],
    v: &["layers.{i}.self_attn.v_proj", "blk.{i}.attn_v"],
    o: &["layers.{i}.self_attn.o_proj", "blk.{i}.attn_output"],
    attn_norm: &["layers.{i}.input_layernorm", "blk.{i}.attn_norm"],
    up: &["layers.{i}.mlp.up_proj", "blk.{i}.ffn_up"],
    gate: &["layers.{i}.mlp.gate_proj", "blk.{i}.ffn_gate"],
    down: &["layers.{i}.mlp.down_proj", "blk.{i}.ffn_down"],
    ffn_norm: &["layers.{i}.pre_feedforward_layernorm", "blk.{i}.ffn_norm"],
    final_norm: &["norm", "output_norm"],
    post_attn_norm: &[
        "layers.{i}.post_attention_layernorm",
        "blk.{i}.post_attention_norm",
    ],
    post_ffn_norm: &[
        "layers.{i}.post_feedforward_layernorm",
        "blk.{i}.post_ffw_norm",
    ],
    q_norm: &["layers.{i}.self_attn.q_norm", "blk.{i}.attn_q_norm"],
    k_norm: &["layers.{i}.self_attn.k_norm", "blk.{i}.attn_k_norm"],
};

pub fn from_hf(c: &Json) -> Result<EncoderConfig> {
    let layers = usize_of(c, "num_hidden_layers")?;
    let heads = usize_of(c, "num_attention_heads")?;
    let head_dim = c
        .get("head_dim")
        .and_then(Json::as_u64)
        .map_or(256, |v| v as usize);
    let hidden = usize_of(c, "hidden_size")?;
    // transformers' rule: layer `i` is local unless `(i + 1) % pattern == 0`.
    let local_layers: Vec<bool> = match c.get("layer_types").and_then(Json::as_array) {
        Some(types) if types.len() == layers => types
            .iter()
            .map(|t| t.as_str() == Some("sliding_attention"))
            .collect(),
        Some(types) => {
            return Err(Error::Weights(format!(
                "config.json: {} layer_types for {layers} layers",
                types.len()
            )))
        }
        None => {
            let pattern = c
                .get("sliding_window_pattern")
                .and_then(Json::as_u64)
                .unwrap_or(6)
                .max(1) as usize;
            (0..layers).map(|i| (i + 1) % pattern != 0).collect()
        }
    };
    let rope = |kind: &str| c.get("rope_parameters").and_then(|r| r.get(kind));
    for kind in ["full_attention", "sliding_attention"] {
        if let Some(t) = rope(kind)
            .and_then(|r| r.get("rope_type"))
            .and_then(Json::as_str)
            .filter(|t| *t != "default")
        {
            return Err(Error::Unsupported(format!(
                "EmbeddingGemma with {t:?} RoPE scaling on its {kind} layers"
            )));
        }
    }
    if c.get("rope_scaling").is_some_and(|r| !r.is_null()) {
        return Err(Error::Unsupported(
            "EmbeddingGemma with RoPE scaling".into(),
        ));
    }
    let theta = |kind: &str, old: &str, default: f64| -> f32 {
        rope(kind)
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| c.get(old))
            .and_then(Json::as_f64)
            .unwrap_or(default) as f32
    };
    let act = match c
        .get("hidden_activation")
        .and_then(Json::as_str)
        .unwrap_or("gelu_pytorch_tanh")
    {
        "gelu_pytorch_tanh" | "gelu_new" => Activation::GeluTanh,
        "gelu" => Activation::GeluErf,
        other => {
            return Err(Error::Unsupported(format!(
                "EmbeddingGemma activation {other:?}"
            )))
        }
    };
    let scalar = c
        .get("query_pre_attn_scalar")
        .and_then(Json::as_f64)
        .unwrap_or(head_dim as f64);
    Ok(EncoderConfig {
        family: Family::GemmaEmbedding,
        hidden,
        heads,
        layers,
        intermediate: usize_of(c, "intermediate_size")?,
        vocab: usize_of(c, "vocab_size")?,
        max_position: usize_of(c, "max_position_embeddings")?,
        type_vocab: 0,
        eps: c.get("rms_norm_eps").and_then(Json::as_f64).unwrap_or(1e-6) as f32,
        position_offset: 0,
        labels: None,
        pair_types: false,
        max_tokens: None,
        rope_theta: Some(theta("full_attention", "rope_theta", 1_000_000.0)),
        local: Some(LocalAttention {
            half: c
                .get("sliding_window")
                .and_then(Json::as_u64)
                .unwrap_or(512) as usize
                / 2,
            theta: theta("sliding_attention", "rope_local_base_freq", 10_000.0),
            layers: local_layers,
        }),
        ffn: FfnKind::Glu(act),
        prenorm: true,
        classifier_mean: false,
        rms: true,
        head_dim,
        kv_heads: c
            .get("num_key_value_heads")
            .and_then(Json::as_u64)
            .map_or(heads, |v| v as usize),
        attn_scale: (scalar as f32).powf(-0.5),
        // transformers multiplies by √hidden rounded to the weights' dtype; in f32 that is
        // the f32 square root.
        embed_scale: Some((hidden as f32).sqrt()),
    })
}

pub fn from_gguf(g: &GgufFile, vocab: usize) -> Result<EncoderConfig> {
    let a = g.architecture()?.to_string();
    let key = |k: &str| format!("{a}.{k}");
    let layers = g.require_usize(&key("block_count"))?;
    let heads = g.require_usize(&key("attention.head_count"))?;
    let hidden = g.require_usize(&key("embedding_length"))?;
    let head_dim = g
        .get_u64(&key("attention.key_length"))
        .map_or(256, |v| v as usize);
    // llama.cpp: a bool per layer, or a period whose last layer is global (6 by default).
    let pattern = key("attention.sliding_window_pattern");
    let local_layers: Vec<bool> = match g.get_bool_array(&pattern) {
        Some(v) if v.len() == layers => v,
        Some(v) => {
            return Err(Error::Weights(format!(
                "{pattern} has {} entries for {layers} layers",
                v.len()
            )))
        }
        None => {
            let every = g.get_u64(&pattern).unwrap_or(6).max(1) as usize;
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    let theta = g.get_f64(&key("rope.freq_base")).unwrap_or(1_000_000.0) as f32;
    Ok(EncoderConfig {
        family: Family::GemmaEmbedding,
        hidden,
        heads,
        layers,
        intermediate: g.require_usize(&key("feed_forward_length"))?,
        vocab,
        max_position: g.require_usize(&key("context_length"))?,
        type_vocab: 0,
        eps: g
            .get_f64(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-6) as f32,
        position_offset: 0,
        labels: None,
        pair_types: false,
        max_tokens: None,
        rope_theta: Some(theta),
        local: Some(LocalAttention {
            half: g.require_usize(&key("attention.sliding_window"))? / 2,
            theta: g.get_f64(&key("rope.freq_base_swa")).unwrap_or(10_000.0) as f32,
            layers: local_layers,
        }),
        ffn: FfnKind::Glu(Activation::GeluTanh),
        prenorm: true,
        classifier_mean: false,
        rms: true,
        head_dim,
        kv_heads: g
            .get_u64(&key("attention.head_count_kv"))
            .map_or(heads, |v| v as usize),
        attn_scale: (head_dim as f32).powf(-0.5),
        embed_scale: Some((hidden as f32).sqrt()),
    })
}

/// Whether `file` holds a Gemma 3 text model made bidirectional (EmbeddingGemma).
pub fn matches(file: &ModelFile) -> bool {
    let h = match file {
        ModelFile::Gguf(g) => return g.architecture().is_ok_and(|a| a == "gemma-embedding"),
        ModelFile::Hf(h) => h,
    };
    let c = &h.config;
    let ty = c.get("model_type").and_then(Json::as_str);
    c.get("use_bidirectional_attention").and_then(Json::as_bool) == Some(true)
        && matches!(ty, Some("gemma3_text" | "gemma3"))
}
