//! ModernBERT: pre-LayerNorm blocks (none before layer 0's attention) and a final norm,
//! rotary positions with one base for the global layers and another for the local ones,
//! local attention (each token sees `local_attention / 2` positions either side) on all but
//! every `global_attn_every_n_layers`-th layer, a fused QKV, GeGLU FFNs (`Wi` gives
//! `[input | gate]`, GELU on the input half), LayerNorms and matrices without biases.
//!
//! Its sequence classifier pools the final states (CLS or mean, `classifier_pooling`), then
//! `head.dense`, GELU, `head.norm`, and `classifier`: Alibaba's gte-reranker-modernbert-base.
//!
//! Hugging Face names (under `model.` in a task model) and llama.cpp's `modern-bert` GGUF.

use ferrum_backend::{Activation, Backend};
use ferrum_core::{Error, Result};
use ferrum_loader::{GgufFile, ModelFile, TensorStore};
use serde_json::Value as Json;

use super::{
    bert, bert::usize_of, Classifier, EncoderConfig, Family, FfnKind, Layout, LocalAttention, Norm,
};
use crate::layers::WeightSource;

pub static LAYOUT: Layout = Layout {
    prefixes: &["", "model."],
    word: &["embeddings.tok_embeddings", "token_embd"],
    position: &[],
    types: &[],
    embed_norm: &["embeddings.norm", "token_embd_norm"],
    qkv: &["layers.{i}.attn.Wqkv", "blk.{i}.attn_qkv"],
    q: &[],
    k: &[],
    v: &[],
    o: &["layers.{i}.attn.Wo", "blk.{i}.attn_output"],
    attn_norm: &["layers.{i}.attn_norm", "blk.{i}.attn_norm"],
    up: &["layers.{i}.mlp.Wi", "blk.{i}.ffn_up"],
    gate: &[],
    down: &["layers.{i}.mlp.Wo", "blk.{i}.ffn_down"],
    ffn_norm: &["layers.{i}.mlp_norm", "blk.{i}.ffn_norm"],
    final_norm: &["final_norm", "output_norm"],
    post_attn_norm: &[],
    post_ffn_norm: &[],
    q_norm: &[],
    k_norm: &[],
};

pub const HF_CLASSES: &[&str] = &[
    "ModernBertModel",
    "ModernBertForMaskedLM",
    "ModernBertForSequenceClassification",
];

fn activation(name: &str) -> Result<Activation> {
    match name {
        "gelu" => Ok(Activation::GeluErf),
        "gelu_pytorch_tanh" | "gelu_new" => Ok(Activation::GeluTanh),
        "silu" | "swish" => Ok(Activation::Silu),
        other => Err(Error::Unsupported(format!(
            "ModernBERT activation {other:?} (gelu, gelu_pytorch_tanh and silu are supported)"
        ))),
    }
}

pub fn from_hf(c: &Json) -> Result<EncoderConfig> {
    let layers = usize_of(c, "num_hidden_layers")?;
    let every = c
        .get("global_attn_every_n_layers")
        .and_then(Json::as_u64)
        .unwrap_or(3)
        .max(1) as usize;
    let local_layers: Vec<bool> = match c.get("layer_types").and_then(Json::as_array) {
        Some(types) => {
            if types.len() != layers {
                return Err(Error::Weights(format!(
                    "config.json: {} layer_types for {layers} layers",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect()
        }
        None => (0..layers).map(|i| i % every != 0).collect(),
    };
    let theta = |kind: &str, old: &str, default: f64| -> f32 {
        c.get("rope_parameters")
            .and_then(|r| r.get(kind))
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| c.get(old))
            .and_then(Json::as_f64)
            .unwrap_or(default) as f32
    };
    let class = c
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Json::as_str)
        .unwrap_or("");
    let labels = class
        .ends_with("ForSequenceClassification")
        .then(|| bert::labels(c));
    if labels.is_some() {
        let act = c
            .get("classifier_activation")
            .and_then(Json::as_str)
            .unwrap_or("gelu");
        if act != "gelu" {
            return Err(Error::Unsupported(format!(
                "ModernBERT classifier activation {act:?} (gelu is supported)"
            )));
        }
    }
    let ffn_act = activation(
        c.get("hidden_activation")
            .and_then(Json::as_str)
            .unwrap_or("gelu"),
    )?;
    Ok(EncoderConfig {
        family: Family::ModernBert,
        hidden: usize_of(c, "hidden_size")?,
        heads: usize_of(c, "num_attention_heads")?,
        layers,
        intermediate: usize_of(c, "intermediate_size")?,
        vocab: usize_of(c, "vocab_size")?,
        max_position: usize_of(c, "max_position_embeddings")?,
        type_vocab: 0,
        eps: c.get("norm_eps").and_then(Json::as_f64).unwrap_or(1e-5) as f32,
        position_offset: 0,
        labels,
        pair_types: false,
        max_tokens: None,
        rope_theta: Some(theta("full_attention", "global_rope_theta", 160_000.0)),
        local: Some(LocalAttention {
            half: c
                .get("local_attention")
                .and_then(Json::as_u64)
                .unwrap_or(128) as usize
                / 2,
            theta: theta("sliding_attention", "local_rope_theta", 10_000.0),
            layers: local_layers,
        }),
        ffn: FfnKind::Glu(ffn_act),
        prenorm: true,
        classifier_mean: c.get("classifier_pooling").and_then(Json::as_str) == Some("mean"),
        rms: false,
        head_dim: 0,
        kv_heads: 0,
        attn_scale: 0.0,
        embed_scale: None,
    })
}

pub fn from_gguf(g: &GgufFile, vocab: usize, store: &TensorStore) -> Result<EncoderConfig> {
    let a = g.architecture()?.to_string();
    let key = |k: &str| format!("{a}.{k}");
    let layers = g.require_usize(&key("block_count"))?;
    let theta = g.get_f64(&key("rope.freq_base")).unwrap_or(160_000.0) as f32;
    // llama.cpp: a bool per layer, or a period whose first layer is global (3 by default).
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
            let every = g.get_u64(&pattern).unwrap_or(3).max(1) as usize;
            (0..layers).map(|i| i % every != 0).collect()
        }
    };
    let local = g
        .get_u64(&key("attention.sliding_window"))
        .filter(|&w| w > 0)
        .map(|w| LocalAttention {
            half: w as usize / 2,
            theta: g
                .get_f64(&key("rope.freq_base_swa"))
                .unwrap_or(theta as f64) as f32,
            layers: local_layers,
        });
    let act = g.get_str(&key("hidden_activation")).unwrap_or("gelu");
    Ok(EncoderConfig {
        family: Family::ModernBert,
        hidden: g.require_usize(&key("embedding_length"))?,
        heads: g.require_usize(&key("attention.head_count"))?,
        layers,
        intermediate: g.require_usize(&key("feed_forward_length"))?,
        vocab,
        max_position: g.require_usize(&key("context_length"))?,
        type_vocab: 0,
        // llama.cpp's converter writes the LayerNorm's epsilon under the RMS key too (only
        // there, in some versions).
        eps: g
            .get_f64(&key("attention.layer_norm_epsilon"))
            .or_else(|| g.get_f64(&key("attention.layer_norm_rms_epsilon")))
            .unwrap_or(1e-5) as f32,
        position_offset: 0,
        labels: store.get("cls.output.weight").map(|t| t.n_rows()),
        pair_types: false,
        max_tokens: None,
        rope_theta: Some(theta),
        local,
        ffn: FfnKind::Glu(activation(act)?),
        prenorm: true,
        // llama.cpp pools a ModernBERT classifier's states by their mean unless the file
        // says CLS (`classifier.pooling_type` 2; gte-reranker-modernbert-base has none).
        classifier_mean: g.get_u64(&key("classifier.pooling_type")) != Some(2),
        rms: false,
        head_dim: 0,
        kv_heads: 0,
        attn_scale: 0.0,
        embed_scale: None,
    })
}

/// The classifier head: `head.dense` (bias if any), GELU, `head.norm`, `classifier`.
pub(super) fn classifier<B: Backend>(
    src: &WeightSource,
    be: &B,
    labels: usize,
    h: usize,
) -> Result<Classifier<B::Weight>> {
    let pick = |names: &[&'static str]| -> Option<&'static str> {
        names.iter().find(|n| src.store.contains(n)).copied()
    };
    let need = |names: &[&'static str]| {
        pick(names).ok_or_else(|| Error::Weights(format!("no classifier tensor {:?}", names[0])))
    };
    let dense = need(&["head.dense.weight", "cls.weight"])?;
    let dense_bias = pick(&["head.dense.bias", "cls.bias"]);
    let norm = need(&["head.norm.weight", "cls.norm.weight"])?;
    let norm_bias = pick(&["head.norm.bias", "cls.norm.bias"]);
    let out = need(&["classifier.weight", "cls.output.weight"])?;
    let out_bias = pick(&["classifier.bias", "cls.output.bias"]);
    Ok(Classifier {
        dense: Some((
            src.require(be, dense, 0, (h, h))?,
            dense_bias
                .map(|b| src.require(be, b, 0, (1, h)))
                .transpose()?,
        )),
        gelu_norm: Some(Norm {
            weight: src.vector(norm, 0, h)?,
            bias: match norm_bias {
                Some(b) => src.vector(b, 0, h)?,
                None => vec![0.0; h],
            },
        }),
        out: src.require(be, out, 0, (labels, h))?,
        out_bias: out_bias
            .map(|b| src.require(be, b, 0, (1, labels)))
            .transpose()?,
    })
}

/// Whether `file` holds a ModernBERT.
pub fn matches(file: &ModelFile) -> bool {
    match file {
        ModelFile::Gguf(g) => g.architecture().is_ok_and(|a| a == "modern-bert"),
        ModelFile::Hf(h) => {
            let class = h
                .config
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(Json::as_str);
            let ty = h.config.get("model_type").and_then(Json::as_str);
            class.is_some_and(|c| HF_CLASSES.contains(&c))
                || (class.is_none() && ty == Some("modernbert"))
        }
    }
}
