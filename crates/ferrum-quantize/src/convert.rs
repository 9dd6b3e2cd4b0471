//! A Hugging Face folder (Llama, Qwen2, Qwen3 with a byte-level BPE `tokenizer.json`) as the
//! tensors and metadata llama.cpp's `convert_hf_to_gguf.py` would write: GGUF tensor names,
//! `{arch}.*` hyper-parameters from `config.json`, Llama's Q/K rows permuted for the
//! interleaved rotation, and the vocabulary as `tokenizer.ggml.*` keys.

use std::collections::HashMap;
use std::path::Path;

use ferrum_core::{Error, Result};
use ferrum_loader::{HfFolder, RawTensor, Value};
use serde_json::Value as Json;

/// Checkpoint entries the converter drops.
fn ignored(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// One tensor of the converted model.
pub struct ConvertedTensor {
    pub name: String,
    pub raw: RawTensor,
    /// For Llama's Q and K projections: the number of heads whose rows are regrouped from
    /// halves `[x0..x_{d/2}, y0..]` to pairs `[x0, y0, x1, y1, ...]`.
    pub permute_heads: Option<usize>,
}

pub struct Converted {
    pub arch: &'static str,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<ConvertedTensor>,
}

/// Maps a Hugging Face tensor name to its GGUF name (the table of `ferrum_models::names`).
pub fn gguf_name(hf: &str) -> Option<String> {
    ferrum_models::names::hf_to_gguf(hf)
}

/// Row `r` of a permuted Q/K matrix comes from row `source_row(r)` of the checkpoint.
pub fn permuted_source_row(r: usize, n_rows: usize, n_heads: usize) -> usize {
    let hd = n_rows / n_heads;
    let (h, within) = (r / hd, r % hd);
    let (i, j) = (within / 2, within % 2);
    h * hd + j * (hd / 2) + i
}

fn cfg_usize(cfg: &Json, key: &str) -> Option<usize> {
    cfg.get(key)?.as_u64().map(|v| v as usize)
}

fn require(cfg: &Json, key: &str, path: &Path) -> Result<usize> {
    cfg_usize(cfg, key)
        .ok_or_else(|| Error::format(path, format!("config.json: missing integer {key:?}")))
}

fn u32v(v: usize) -> Value {
    Value::U32(v as u32)
}

pub fn convert(folder: &HfFolder) -> Result<Converted> {
    let cfg = &folder.config;
    let cfg_path = folder.dir.join("config.json");
    let class = cfg
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Json::as_str)
        .unwrap_or("");
    let arch: &'static str = match class {
        "LlamaForCausalLM" => "llama",
        "Qwen2ForCausalLM" => "qwen2",
        "Qwen3ForCausalLM" => "qwen3",
        other => {
            return Err(Error::Unsupported(format!(
                "{}: architecture {other:?} (Llama, Qwen2 and Qwen3 can be converted)",
                cfg_path.display()
            )))
        }
    };
    let rope = cfg
        .get("rope_scaling")
        .or_else(|| cfg.get("rope_parameters"));
    if let Some(kind) = rope
        .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
        .and_then(Json::as_str)
    {
        if kind != "default" {
            return Err(Error::Unsupported(format!(
                "{}: RoPE scaling {kind:?} is not converted",
                cfg_path.display()
            )));
        }
    }
    let n_layer = require(cfg, "num_hidden_layers", &cfg_path)?;
    let n_embd = require(cfg, "hidden_size", &cfg_path)?;
    let n_ff = require(cfg, "intermediate_size", &cfg_path)?;
    let n_head = require(cfg, "num_attention_heads", &cfg_path)?;
    let n_head_kv = cfg_usize(cfg, "num_key_value_heads").unwrap_or(n_head);
    let ctx = require(cfg, "max_position_embeddings", &cfg_path)?;
    let theta = cfg
        .get("rope_theta")
        .or_else(|| rope.and_then(|r| r.get("rope_theta")))
        .and_then(Json::as_f64)
        .unwrap_or(10000.0);
    let eps = cfg
        .get("rms_norm_eps")
        .and_then(Json::as_f64)
        .ok_or_else(|| Error::format(&cfg_path, "config.json: missing \"rms_norm_eps\""))?;
    let head_dim = cfg_usize(cfg, "head_dim");

    let k = |s: &str| format!("{arch}.{s}");
    let name = folder
        .dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| arch.to_string());
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name)),
        (k("block_count"), u32v(n_layer)),
        (k("context_length"), u32v(ctx)),
        (k("embedding_length"), u32v(n_embd)),
        (k("feed_forward_length"), u32v(n_ff)),
        (k("attention.head_count"), u32v(n_head)),
        (k("attention.head_count_kv"), u32v(n_head_kv)),
        (k("rope.freq_base"), Value::F32(theta as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(eps as f32),
        ),
    ];
    if let Some(hd) = head_dim {
        md.push((k("attention.key_length"), u32v(hd)));
        md.push((k("attention.value_length"), u32v(hd)));
    }
    md.push(("general.file_type".into(), Value::U32(0)));
    if arch == "llama" {
        if let Some(v) = cfg_usize(cfg, "vocab_size") {
            md.push((k("vocab_size"), u32v(v)));
        }
        md.push((
            k("rope.dimension_count"),
            u32v(head_dim.unwrap_or(n_embd / n_head)),
        ));
    }
    md.push(("general.quantization_version".into(), Value::U32(2)));
    md.extend(tokenizer_metadata(&folder.dir, cfg, arch)?);

    let mut tensors = Vec::new();
    let mut names: Vec<&String> = folder.tensors.tensors.keys().collect();
    names.sort();
    for hf in names {
        if ignored(hf) {
            continue;
        }
        let gname = gguf_name(hf).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: tensor {hf:?} has no GGUF name",
                folder.dir.display()
            ))
        })?;
        let raw = folder.tensors.tensors[hf].clone();
        let permute_heads = if arch == "llama" {
            if gname.ends_with("attn_q.weight") || gname.ends_with("attn_q.bias") {
                Some(n_head)
            } else if gname.ends_with("attn_k.weight") || gname.ends_with("attn_k.bias") {
                Some(n_head_kv)
            } else {
                None
            }
        } else {
            None
        };
        if let Some(h) = permute_heads {
            let rows = raw.shape.first().copied().unwrap_or(0);
            if h == 0 || rows % (2 * h) != 0 {
                return Err(Error::Weights(format!(
                    "{hf}: {rows} rows do not split into {h} heads of even size"
                )));
            }
        }
        tensors.push(ConvertedTensor {
            name: gname,
            raw,
            permute_heads,
        });
    }
    Ok(Converted {
        arch,
        metadata: md,
        tensors,
    })
}

fn read_json(path: &Path) -> Result<Option<Json>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}

/// The two pre-tokenizer regexes llama.cpp knows by name, as they appear in tokenizer.json.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's name for the pre-tokenizer (`tokenizer.ggml.pre`). The converter identifies it
/// by hashing the tokenisation of a test text; we recognise the tokenizer.json shapes instead.
fn pre_tokenizer_name(pre: &Json) -> Option<&'static str> {
    let ty = pre.get("type").and_then(Json::as_str)?;
    let parts: Vec<&Json> = match ty {
        "Sequence" => pre.get("pretokenizers")?.as_array()?.iter().collect(),
        _ => vec![pre],
    };
    let kinds: Vec<&str> = parts
        .iter()
        .filter_map(|p| p.get("type").and_then(Json::as_str))
        .collect();
    let regex = parts.iter().find_map(|p| {
        p.get("pattern")
            .and_then(|pat| pat.get("Regex"))
            .and_then(Json::as_str)
    });
    match (kinds.as_slice(), regex) {
        (["Split", "ByteLevel"], Some(LLAMA3_REGEX)) => Some("llama-bpe"),
        (["Split", "ByteLevel"], Some(QWEN2_REGEX)) => Some("qwen2"),
        (["Digits", "ByteLevel"], None) => Some("smollm"),
        (["ByteLevel"], None) => Some("gpt-2"),
        _ => None,
    }
}

fn is_byte_level(tok: &Json) -> bool {
    let mentions = |v: Option<&Json>| v.is_some_and(|v| v.to_string().contains("\"ByteLevel\""));
    tok.pointer("/model/type").and_then(Json::as_str) == Some("BPE")
        && (mentions(tok.get("pre_tokenizer")) || mentions(tok.get("decoder")))
}

/// `tokenizer.ggml.*` (and `tokenizer.chat_template`) from tokenizer.json,
/// tokenizer_config.json and config.json, as the converter's `_set_vocab_gpt2` and
/// `SpecialVocab` write them.
fn tokenizer_metadata(dir: &Path, cfg: &Json, arch: &str) -> Result<Vec<(String, Value)>> {
    let tok_path = dir.join("tokenizer.json");
    let tok = read_json(&tok_path)?.ok_or_else(|| {
        Error::Unsupported(format!(
            "{}: no tokenizer.json (only byte-level BPE tokenizers are converted)",
            dir.display()
        ))
    })?;
    if !is_byte_level(&tok) {
        return Err(Error::Unsupported(format!(
            "{}: the tokenizer is not byte-level BPE (SentencePiece and other tokenizers are not converted)",
            tok_path.display()
        )));
    }
    let pre = tok
        .get("pre_tokenizer")
        .and_then(pre_tokenizer_name)
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: pre-tokenizer not recognised (known: llama-bpe, qwen2, smollm, gpt-2)",
                tok_path.display()
            ))
        })?;
    let bad = |msg: &str| Error::format(&tok_path, msg.to_string());
    let vocab = tok
        .pointer("/model/vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| bad("no model.vocab object"))?;
    let mut by_id: HashMap<usize, String> = HashMap::new();
    for (t, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad("vocab ids must be integers"))? as usize;
        by_id.insert(id, t.clone());
    }
    // id -> is special
    let mut added: HashMap<usize, bool> = HashMap::new();
    for a in tok
        .get("added_tokens")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        let (Some(id), Some(content)) = (
            a.get("id").and_then(Json::as_u64),
            a.get("content").and_then(Json::as_str),
        ) else {
            return Err(bad("added_tokens entries need an id and content"));
        };
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
        by_id.insert(id as usize, content.to_string());
        added.insert(id as usize, special);
    }
    let max_id = by_id.keys().max().map_or(0, |m| m + 1);
    let n_vocab = cfg_usize(cfg, "vocab_size").unwrap_or(max_id).max(max_id);
    let mut tokens = Vec::with_capacity(n_vocab);
    let mut types = Vec::with_capacity(n_vocab);
    for id in 0..n_vocab {
        match (by_id.get(&id), added.get(&id)) {
            (None, _) => {
                tokens.push(Value::String(format!("[PAD{id}]")));
                types.push(Value::I32(5)); // UNUSED
            }
            (Some(t), Some(&special)) => {
                let looks_special = (t.starts_with("<|") && t.ends_with("|>"))
                    || (t.starts_with("<") && t.ends_with(">") && t.len() > 2);
                tokens.push(Value::String(t.clone()));
                // CONTROL, or USER_DEFINED for added non-special tokens.
                types.push(Value::I32(if special || looks_special { 3 } else { 4 }));
            }
            (Some(t), None) => {
                tokens.push(Value::String(t.clone()));
                types.push(Value::I32(1)); // NORMAL
            }
        }
    }
    let merges: Vec<Value> = tok
        .pointer("/model/merges")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .map(|m| match m {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => Ok(Value::String(format!("{a} {b}"))),
                _ => Err(bad("merge pairs must be strings")),
            },
            _ => Err(bad("merges must be strings or pairs")),
        })
        .collect::<Result<_>>()?;

    let mut md: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ];

    // Special tokens: tokenizer_config.json names them by content, config.json by id.
    let tcfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let id_of = |content: &str| {
        by_id
            .iter()
            .find(|(_, t)| t.as_str() == content)
            .map(|(id, _)| *id)
    };
    for (kind, key) in [
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("sep", "seperator_token_id"),
        ("pad", "padding_token_id"),
    ] {
        let from_tokenizer = tcfg.get(format!("{kind}_token")).and_then(|v| match v {
            Json::String(s) => id_of(s),
            Json::Object(o) => o.get("content").and_then(Json::as_str).and_then(id_of),
            _ => None,
        });
        let from_config = || cfg_usize(cfg, &format!("{kind}_token_id"));
        if let Some(id) = from_tokenizer.or_else(from_config) {
            md.push((format!("tokenizer.ggml.{key}"), u32v(id)));
        }
    }
    for flag in ["add_bos_token", "add_eos_token"] {
        if let Some(b) = tcfg.get(flag).and_then(Json::as_bool) {
            md.push((format!("tokenizer.ggml.{flag}"), Value::Bool(b)));
        }
    }
    let jinja = dir.join("chat_template.jinja");
    let template = match tcfg.get("chat_template").and_then(Json::as_str) {
        Some(t) => Some(t.to_string()),
        None if jinja.exists() => {
            Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?)
        }
        None => None,
    };
    if let Some(t) = template {
        md.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    let _ = arch;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_with_layer_numbers() {
        assert_eq!(
            gguf_name("model.layers.12.mlp.down_proj.weight").as_deref(),
            Some("blk.12.ffn_down.weight")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.x.mlp.down_proj.weight"), None);
    }

    #[test]
    fn permutation_interleaves_halves_per_head() {
        // Two heads of dim 4: rows [a0 a1 b0 b1 | c0 c1 d0 d1] -> [a0 b0 a1 b1 | c0 d0 c1 d1].
        let src: Vec<usize> = (0..8).map(|r| permuted_source_row(r, 8, 2)).collect();
        assert_eq!(src, [0, 2, 1, 3, 4, 6, 5, 7]);
    }
}
