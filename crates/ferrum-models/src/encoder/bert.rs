//! BERT and XLM-RoBERTa (and RoBERTa): absolute learned positions, token types, post-LayerNorm
//! blocks, GELU (erf) FFNs, biases everywhere. XLM-RoBERTa is BERT with its positions counted
//! from `pad_token_id + 1` and one token type; its sequence classifier is a dense + tanh
//! head on the first token, as BERT's pooler + classifier is.
//!
//! Hugging Face names (with or without the `bert.` / `roberta.` prefix a task model adds) and
//! llama.cpp's `bert` GGUF names.

use ferrum_backend::Backend;
use ferrum_core::{Error, Result};
use ferrum_loader::{GgufFile, ModelFile};
use serde_json::Value as Json;

use super::{Classifier, EncoderConfig, Family, FfnKind, Layout};
use crate::layers::WeightSource;

pub static LAYOUT: Layout = Layout {
    prefixes: &["", "bert.", "roberta.", "model."],
    word: &["embeddings.word_embeddings", "token_embd"],
    position: &["embeddings.position_embeddings", "position_embd"],
    types: &["embeddings.token_type_embeddings", "token_types"],
    embed_norm: &["embeddings.LayerNorm", "token_embd_norm"],
    qkv: &[],
    q: &["encoder.layer.{i}.attention.self.query", "blk.{i}.attn_q"],
    k: &["encoder.layer.{i}.attention.self.key", "blk.{i}.attn_k"],
    v: &["encoder.layer.{i}.attention.self.value", "blk.{i}.attn_v"],
    o: &[
        "encoder.layer.{i}.attention.output.dense",
        "blk.{i}.attn_output",
    ],
    attn_norm: &[
        "encoder.layer.{i}.attention.output.LayerNorm",
        "blk.{i}.attn_output_norm",
    ],
    up: &["encoder.layer.{i}.intermediate.dense", "blk.{i}.ffn_up"],
    gate: &[],
    down: &["encoder.layer.{i}.output.dense", "blk.{i}.ffn_down"],
    ffn_norm: &[
        "encoder.layer.{i}.output.LayerNorm",
        "blk.{i}.layer_output_norm",
    ],
    final_norm: &[],
    post_attn_norm: &[],
    post_ffn_norm: &[],
    q_norm: &[],
    k_norm: &[],
};

/// The sequence classifier's `(Hugging Face name, GGUF name)`: BERT's pooler then
/// classifier, RoBERTa's head's dense then out_proj (both dense + tanh, then a linear layer
/// to the labels).
const CLASSIFIER_NAMES: &[(&str, &str)] = &[
    ("pooler.dense.weight", "cls.weight"),
    ("pooler.dense.bias", "cls.bias"),
    ("classifier.weight", "cls.output.weight"),
    ("classifier.bias", "cls.output.bias"),
    ("classifier.dense.weight", "cls.weight"),
    ("classifier.dense.bias", "cls.bias"),
    ("classifier.out_proj.weight", "cls.output.weight"),
    ("classifier.out_proj.bias", "cls.output.bias"),
];

/// BERT's and RoBERTa's classifier (the pooler's names carry the encoder's prefix in a
/// Hugging Face file; `classifier.*` does not).
pub(super) fn classifier<B: Backend>(
    src: &WeightSource,
    be: &B,
    gguf: bool,
    prefix: &str,
    labels: usize,
    h: usize,
) -> Result<Classifier<B::Weight>> {
    let src = WeightSource {
        store: src.store,
        gguf,
        names: CLASSIFIER_NAMES,
    };
    let get = |hf: &[&str], shape: (usize, usize)| -> Result<B::Weight> {
        for n in hf {
            let full = if gguf || n.starts_with("classifier") {
                n.to_string()
            } else {
                format!("{prefix}{n}")
            };
            if src.tensor(&full, 0).is_some() {
                return src.require(be, &full, 0, shape);
            }
        }
        Err(Error::Weights(format!("no classifier tensor {:?}", hf[0])))
    };
    let dense = if gguf && src.store.get("cls.weight").is_none() {
        None
    } else {
        Some((
            get(&["pooler.dense.weight", "classifier.dense.weight"], (h, h))?,
            Some(get(
                &["pooler.dense.bias", "classifier.dense.bias"],
                (1, h),
            )?),
        ))
    };
    Ok(Classifier {
        dense,
        gelu_norm: None,
        out: get(
            &["classifier.weight", "classifier.out_proj.weight"],
            (labels, h),
        )?,
        out_bias: Some(get(
            &["classifier.bias", "classifier.out_proj.bias"],
            (1, labels),
        )?),
    })
}

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

pub(super) fn usize_of(c: &Json, k: &str) -> Result<usize> {
    c.get(k)
        .and_then(Json::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| Error::Weights(format!("config.json: missing or invalid {k:?}")))
}

/// A sequence classifier's label count (`id2label`'s entries, else `num_labels`, else 2).
pub(super) fn labels(c: &Json) -> usize {
    c.get("id2label")
        .and_then(Json::as_object)
        .map(|m| m.len())
        .or_else(|| {
            c.get("num_labels")
                .and_then(Json::as_u64)
                .map(|n| n as usize)
        })
        .unwrap_or(2)
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
    let labels = class
        .ends_with("ForSequenceClassification")
        .then(|| labels(c));
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
        rope_theta: None,
        local: None,
        ffn: FfnKind::Gelu,
        prenorm: false,
        classifier_mean: false,
        rms: false,
        head_dim: 0,
        kv_heads: 0,
        attn_scale: 0.0,
        embed_scale: None,
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
        rope_theta: None,
        local: None,
        ffn: FfnKind::Gelu,
        prenorm: false,
        classifier_mean: false,
        rms: false,
        head_dim: 0,
        kv_heads: 0,
        attn_scale: 0.0,
        embed_scale: None,
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
