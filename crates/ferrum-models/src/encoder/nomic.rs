//! NomicBERT (nomic-embed-text v1 and v1.5): BERT's post-LayerNorm blocks and token types,
//! with rotary positions (NeoX layout) instead of a learned table, one fused QKV projection,
//! SwiGLU FFNs, and no biases.
//!
//! Three namings: transformers' own (`layers.{i}.self_attn.q_proj`, …), the original
//! checkpoints' that the Hub's nomic-embed-text files use and transformers renames on load
//! (`encoder.layers.{i}.attn.Wqkv`, `mlp.fc11` the up and `mlp.fc12` the gate
//! projection, `norm1`/`norm2`), and llama.cpp's `nomic-bert` GGUF names.

use ferrum_backend::Activation;
use ferrum_core::{Error, Result};
use ferrum_loader::{GgufFile, ModelFile, TensorStore};
use serde_json::Value as Json;

use super::{bert, EncoderConfig, Family, FfnKind, Layout};

pub static LAYOUT: Layout = Layout {
    prefixes: &["", "nomic_bert.", "model."],
    word: &["embeddings.word_embeddings", "token_embd"],
    position: &[],
    types: &["embeddings.token_type_embeddings", "token_types"],
    embed_norm: &["embeddings.LayerNorm", "emb_ln", "token_embd_norm"],
    qkv: &["encoder.layers.{i}.attn.Wqkv", "blk.{i}.attn_qkv"],
    q: &["layers.{i}.self_attn.q_proj"],
    k: &["layers.{i}.self_attn.k_proj"],
    v: &["layers.{i}.self_attn.v_proj"],
    o: &[
        "layers.{i}.self_attn.o_proj",
        "encoder.layers.{i}.attn.out_proj",
        "blk.{i}.attn_output",
    ],
    attn_norm: &[
        "layers.{i}.post_attention_layernorm",
        "encoder.layers.{i}.norm1",
        "blk.{i}.attn_output_norm",
    ],
    up: &[
        "layers.{i}.mlp.up_proj",
        "encoder.layers.{i}.mlp.fc11",
        "blk.{i}.ffn_up",
    ],
    gate: &[
        "layers.{i}.mlp.gate_proj",
        "encoder.layers.{i}.mlp.fc12",
        "blk.{i}.ffn_gate",
    ],
    down: &[
        "layers.{i}.mlp.down_proj",
        "encoder.layers.{i}.mlp.fc2",
        "blk.{i}.ffn_down",
    ],
    ffn_norm: &[
        "layers.{i}.post_mlp_layernorm",
        "encoder.layers.{i}.norm2",
        "blk.{i}.layer_output_norm",
    ],
    final_norm: &[],
    post_attn_norm: &[],
    post_ffn_norm: &[],
    q_norm: &[],
    k_norm: &[],
};

pub const HF_CLASSES: &[&str] = &["NomicBertModel"];

/// The first of `keys` config.json has (transformers' names, then the original ones).
fn first<'a>(c: &'a Json, keys: &[&str]) -> Option<&'a Json> {
    keys.iter().find_map(|k| c.get(*k).filter(|v| !v.is_null()))
}

fn need(c: &Json, keys: &[&str]) -> Result<usize> {
    first(c, keys)
        .and_then(Json::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| Error::Weights(format!("config.json: missing or invalid {:?}", keys[0])))
}

pub fn from_hf(c: &Json) -> Result<EncoderConfig> {
    match first(c, &["hidden_act", "activation_function"]).and_then(Json::as_str) {
        None | Some("silu" | "swiglu") => {}
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "NomicBERT activation {other:?} (SwiGLU is supported; the MoE v2 is not)"
            )))
        }
    }
    // The original configs' switches, each at the one value the released models use.
    let flag = |k: &str| c.get(k).and_then(Json::as_bool);
    if flag("prenorm") == Some(true) || flag("rotary_emb_interleaved") == Some(true) {
        return Err(Error::Unsupported(
            "NomicBERT with prenorm or interleaved rotary dimensions".into(),
        ));
    }
    if c.get("rotary_emb_fraction")
        .and_then(Json::as_f64)
        .is_some_and(|f| f != 1.0)
    {
        return Err(Error::Unsupported(
            "NomicBERT rotating part of each head (rotary_emb_fraction < 1)".into(),
        ));
    }
    if c.get("moe_every_n_layers")
        .and_then(Json::as_u64)
        .is_some_and(|n| n > 0)
    {
        return Err(Error::Unsupported(
            "NomicBERT with experts (nomic-embed-text-v2-moe)".into(),
        ));
    }
    let theta = c
        .get("rope_parameters")
        .and_then(|r| r.get("rope_theta"))
        .or_else(|| first(c, &["rope_theta", "rotary_emb_base"]))
        .and_then(Json::as_f64)
        .unwrap_or(1000.0) as f32;
    Ok(EncoderConfig {
        family: Family::NomicBert,
        hidden: need(c, &["hidden_size", "n_embd"])?,
        heads: need(c, &["num_attention_heads", "n_head"])?,
        layers: need(c, &["num_hidden_layers", "n_layer"])?,
        intermediate: need(c, &["intermediate_size", "n_inner"])?,
        vocab: need(c, &["vocab_size"])?,
        // nomic-embed-text declares 8192 positions but was trained on 2048.
        max_position: need(
            c,
            &[
                "max_trained_positions",
                "max_position_embeddings",
                "n_positions",
            ],
        )?,
        type_vocab: first(c, &["type_vocab_size"])
            .and_then(Json::as_u64)
            .unwrap_or(2) as usize,
        eps: first(c, &["layer_norm_eps", "layer_norm_epsilon"])
            .and_then(Json::as_f64)
            .unwrap_or(1e-12) as f32,
        position_offset: 0,
        labels: None,
        pair_types: true,
        max_tokens: None,
        rope_theta: Some(theta),
        local: None,
        ffn: FfnKind::Glu(Activation::Silu),
        prenorm: false,
        classifier_mean: false,
        rms: false,
        head_dim: 0,
        kv_heads: 0,
        attn_scale: 0.0,
        embed_scale: None,
    })
}

pub fn from_gguf(g: &GgufFile, vocab: usize, store: &TensorStore) -> Result<EncoderConfig> {
    let mut c = bert::from_gguf(g, vocab, store)?;
    let a = g.architecture()?;
    c.family = Family::NomicBert;
    c.max_position = g.require_usize(&format!("{a}.context_length"))?;
    c.rope_theta = Some(g.get_f64(&format!("{a}.rope.freq_base")).unwrap_or(1000.0) as f32);
    c.ffn = FfnKind::Glu(Activation::Silu);
    c.labels = None;
    Ok(c)
}

/// Whether `file` holds a NomicBERT.
pub fn matches(file: &ModelFile) -> bool {
    match file {
        ModelFile::Gguf(g) => g.architecture().is_ok_and(|a| a == "nomic-bert"),
        ModelFile::Hf(h) => {
            let class = h
                .config
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(Json::as_str);
            let ty = h.config.get("model_type").and_then(Json::as_str);
            class.is_some_and(|c| HF_CLASSES.contains(&c))
                || (class.is_none() && ty == Some("nomic_bert"))
        }
    }
}
