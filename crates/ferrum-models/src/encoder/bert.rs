//! BERT and XLM-RoBERTa (and RoBERTa): absolute learned positions, token types, post-LayerNorm
//! blocks, GELU (erf) FFNs, biases everywhere. XLM-RoBERTa is BERT with its positions counted
//! from `pad_token_id + 1` and one token type; its sequence classifier is a dense + tanh
//! head on the first token, as BERT's pooler + classifier is.
//!
//! Hugging Face names (with or without the `bert.` / `roberta.` prefix a task model adds) and
//! llama.cpp's `bert` GGUF names.

use ferrum_core::{Error, Result};
use ferrum_loader::{GgufFile, ModelFile};
use serde_json::Value as Json;

use super::{EncoderConfig, Family};

/// `(Hugging Face name without its prefix, GGUF name)`.
pub const NAMES: &[(&str, &str)] = &[
    ("embeddings.word_embeddings.weight", "token_embd.weight"),
    (
        "embeddings.position_embeddings.weight",
        "position_embd.weight",
    ),
    (
        "embeddings.token_type_embeddings.weight",
        "token_types.weight",
    ),
    ("embeddings.LayerNorm.weight", "token_embd_norm.weight"),
    ("embeddings.LayerNorm.bias", "token_embd_norm.bias"),
    (
        "encoder.layer.{i}.attention.self.query.weight",
        "blk.{i}.attn_q.weight",
    ),
    (
        "encoder.layer.{i}.attention.self.query.bias",
        "blk.{i}.attn_q.bias",
    ),
    (
        "encoder.layer.{i}.attention.self.key.weight",
        "blk.{i}.attn_k.weight",
    ),
    (
        "encoder.layer.{i}.attention.self.key.bias",
        "blk.{i}.attn_k.bias",
    ),
    (
        "encoder.layer.{i}.attention.self.value.weight",
        "blk.{i}.attn_v.weight",
    ),
    (
        "encoder.layer.{i}.attention.self.value.bias",
        "blk.{i}.attn_v.bias",
    ),
    (
        "encoder.layer.{i}.attention.output.dense.weight",
        "blk.{i}.attn_output.weight",
    ),
    (
        "encoder.layer.{i}.attention.output.dense.bias",
        "blk.{i}.attn_output.bias",
    ),
    (
        "encoder.layer.{i}.attention.output.LayerNorm.weight",
        "blk.{i}.attn_output_norm.weight",
    ),
    (
        "encoder.layer.{i}.attention.output.LayerNorm.bias",
        "blk.{i}.attn_output_norm.bias",
    ),
    (
        "encoder.layer.{i}.intermediate.dense.weight",
        "blk.{i}.ffn_up.weight",
    ),
    (
        "encoder.layer.{i}.intermediate.dense.bias",
        "blk.{i}.ffn_up.bias",
    ),
    (
        "encoder.layer.{i}.output.dense.weight",
        "blk.{i}.ffn_down.weight",
    ),
    (
        "encoder.layer.{i}.output.dense.bias",
        "blk.{i}.ffn_down.bias",
    ),
    (
        "encoder.layer.{i}.output.LayerNorm.weight",
        "blk.{i}.layer_output_norm.weight",
    ),
    (
        "encoder.layer.{i}.output.LayerNorm.bias",
        "blk.{i}.layer_output_norm.bias",
    ),
    // The sequence classifier: BERT's pooler then classifier, RoBERTa's head's dense then
    // out_proj (both dense + tanh, then a linear layer to the labels).
    ("pooler.dense.weight", "cls.weight"),
    ("pooler.dense.bias", "cls.bias"),
    ("classifier.weight", "cls.output.weight"),
    ("classifier.bias", "cls.output.bias"),
    ("classifier.dense.weight", "cls.weight"),
    ("classifier.dense.bias", "cls.bias"),
    ("classifier.out_proj.weight", "cls.output.weight"),
    ("classifier.out_proj.bias", "cls.output.bias"),
];

/// Hugging Face classes and model types this file reads.
pub const HF_CLASSES: &[&str] = &[
    "BertModel",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "RobertaModel",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
];
pub const HF_TYPES: &[&str] = &["bert", "roberta", "xlm-roberta"];

fn usize_of(c: &Json, k: &str) -> Result<usize> {
    c.get(k)
        .and_then(Json::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| Error::Weights(format!("config.json: missing or invalid {k:?}")))
}

pub fn from_hf(c: &Json) -> Result<EncoderConfig> {
    let model_type = c.get("model_type").and_then(Json::as_str).unwrap_or("bert");
    let class = c
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Json::as_str)
        .unwrap_or("");
    let roberta = model_type != "bert" || class.contains("Roberta");
    match c.get("hidden_act").and_then(Json::as_str) {
        None | Some("gelu") => {}
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "encoder activation {other:?} (BERT's exact \"gelu\" is supported)"
            )))
        }
    }
    if let Some(p) = c.get("position_embedding_type").and_then(Json::as_str) {
        if p != "absolute" {
            return Err(Error::Unsupported(format!(
                "position_embedding_type {p:?} (absolute is supported)"
            )));
        }
    }
    let labels = if class.ends_with("ForSequenceClassification") {
        let n = c
            .get("id2label")
            .and_then(Json::as_object)
            .map(|m| m.len())
            .or_else(|| {
                c.get("num_labels")
                    .and_then(Json::as_u64)
                    .map(|n| n as usize)
            })
            .unwrap_or(2);
        Some(n)
    } else {
        None
    };
    let pad = c.get("pad_token_id").and_then(Json::as_u64).unwrap_or(1) as usize;
    Ok(EncoderConfig {
        family: if roberta {
            Family::XlmRoberta
        } else {
            Family::Bert
        },
        hidden: usize_of(c, "hidden_size")?,
        heads: usize_of(c, "num_attention_heads")?,
        layers: usize_of(c, "num_hidden_layers")?,
        intermediate: usize_of(c, "intermediate_size")?,
        vocab: usize_of(c, "vocab_size")?,
        max_position: usize_of(c, "max_position_embeddings")?,
        type_vocab: c.get("type_vocab_size").and_then(Json::as_u64).unwrap_or(2) as usize,
        eps: c
            .get("layer_norm_eps")
            .and_then(Json::as_f64)
            .unwrap_or(1e-12) as f32,
        position_offset: if roberta { pad + 1 } else { 0 },
        labels,
        pair_types: true,
        max_tokens: None,
    })
}

pub fn from_gguf(
    g: &GgufFile,
    vocab: usize,
    store: &ferrum_loader::TensorStore,
) -> Result<EncoderConfig> {
    let a = g.architecture()?.to_string();
    let key = |k: &str| format!("{a}.{k}");
    let hidden = g.require_usize(&key("embedding_length"))?;
    let positions = store
        .get("position_embd.weight")
        .map_or(g.require_usize(&key("context_length"))?, |t| t.n_rows());
    let labels = store.get("cls.output.weight").map(|t| t.n_rows());
    Ok(EncoderConfig {
        family: Family::Bert,
        hidden,
        heads: g.require_usize(&key("attention.head_count"))?,
        layers: g.require_usize(&key("block_count"))?,
        intermediate: g.require_usize(&key("feed_forward_length"))?,
        vocab,
        max_position: positions,
        type_vocab: store.get("token_types.weight").map_or(0, |t| t.n_rows()),
        eps: g
            .get_f64(&key("attention.layer_norm_epsilon"))
            .unwrap_or(1e-12) as f32,
        // llama.cpp's converter drops XLM-RoBERTa's first `pad + 1` position rows, so a GGUF
        // file's positions count from 0 either way.
        position_offset: 0,
        labels,
        pair_types: false,
        max_tokens: None,
    })
}

/// Whether `file` holds a model of this family.
pub fn matches(file: &ModelFile) -> bool {
    match file {
        ModelFile::Gguf(g) => g.architecture().is_ok_and(|a| a == "bert"),
        ModelFile::Hf(h) => {
            let class = h
                .config
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(Json::as_str);
            let ty = h.config.get("model_type").and_then(Json::as_str);
            class.is_some_and(|c| HF_CLASSES.contains(&c))
                || (class.is_none() && ty.is_some_and(|t| HF_TYPES.contains(&t)))
        }
    }
}
