//! How token states become one vector: read from the model's own files —
//! sentence-transformers' `modules.json` (its `Pooling` module's config, `Dense` layers,
//! `Normalize`) or a GGUF file's `{arch}.pooling_type` — and applied on the host (a few
//! vectors a sequence against the encoder's matrices).

use std::path::Path;

use ferrum_core::{Error, Result};
use ferrum_loader::{GgufFile, ModelFile};
use serde_json::Value as Json;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The mean over the sequence's tokens (special tokens included, as sentence-transformers
    /// and llama.cpp take it).
    Mean,
    /// The first token's state (`[CLS]`).
    Cls,
    /// The last token's state (decoder embedders: Qwen3-Embedding).
    Last,
    /// The element-wise maximum.
    Max,
    /// The sum over √n (sentence-transformers' `mean_sqrt_len_tokens`).
    MeanSqrtLen,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Mean => "mean",
            Mode::Cls => "cls",
            Mode::Last => "last",
            Mode::Max => "max",
            Mode::MeanSqrtLen => "mean_sqrt_len",
        }
    }
}

/// A sentence-transformers `Dense` module: `act(W · x + b)`.
#[derive(Debug, Clone)]
pub struct Dense {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub in_features: usize,
    pub out_features: usize,
    pub tanh: bool,
}

impl Dense {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        (0..self.out_features)
            .map(|o| {
                let row = &self.weight[o * self.in_features..(o + 1) * self.in_features];
                let mut s: f32 = row.iter().zip(x).map(|(w, v)| w * v).sum();
                if let Some(b) = &self.bias {
                    s += b[o];
                }
                if self.tanh {
                    s.tanh()
                } else {
                    s
                }
            })
            .collect()
    }
}

#[derive(Debug, Clone)]
pub struct Pooling {
    pub mode: Mode,
    pub dense: Vec<Dense>,
    /// Unit length at the end (a `Normalize` module; GGUF models, as llama.cpp's server does).
    pub normalize: bool,
    /// The vector is a classifier's logits, not an embedding: the model is a reranker (a
    /// decoder's yes/no head, Qwen3-Reranker; a GGUF `pooling_type` of rank).
    pub scores: bool,
    /// A decoder reranker's prompt: `{query}` and `{document}` replaced by the pair's texts,
    /// tokenized with its special tokens (llama.cpp's `tokenizer.chat_template.rerank`).
    pub prompt: Option<String>,
}

impl Pooling {
    /// Length of the vectors this gives for `hidden`-wide states.
    pub fn width(&self, hidden: usize) -> usize {
        self.dense.last().map_or(hidden, |d| d.out_features)
    }

    /// One sequence's vector from its `n × hidden` states (row-major).
    pub fn apply(&self, states: &[f32], hidden: usize) -> Vec<f32> {
        let n = states.len() / hidden;
        let rows = || states.chunks_exact(hidden);
        let mut v = match self.mode {
            Mode::Cls => states[..hidden].to_vec(),
            Mode::Last => states[(n - 1) * hidden..].to_vec(),
            Mode::Mean | Mode::MeanSqrtLen => {
                let mut s = vec![0f32; hidden];
                for r in rows() {
                    s.iter_mut().zip(r).for_each(|(a, b)| *a += b);
                }
                let d = if self.mode == Mode::Mean {
                    n as f32
                } else {
                    (n as f32).sqrt()
                };
                s.iter_mut().for_each(|a| *a /= d);
                s
            }
            Mode::Max => {
                let mut s = vec![f32::NEG_INFINITY; hidden];
                for r in rows() {
                    s.iter_mut().zip(r).for_each(|(a, &b)| *a = a.max(b));
                }
                s
            }
        };
        for d in &self.dense {
            v = d.apply(&v);
        }
        if self.normalize {
            normalize(&mut v);
        }
        v
    }

    /// What the model's files say; `None` for a folder without sentence-transformers' files
    /// (the caller picks the default).
    pub fn read(file: &ModelFile, hidden: usize) -> Result<Option<Pooling>> {
        match file {
            ModelFile::Gguf(g) => from_gguf(g),
            ModelFile::Hf(h) => from_sentence_transformers(&h.dir, hidden),
        }
    }
}

/// Scales `v` to unit length (a zero vector stays zero); sentence-transformers' `Normalize`
/// (`F.normalize`, which divides by max(‖v‖, 1e-12)).
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
}

/// llama.cpp's `pooling_type`: 0 none, 1 mean, 2 CLS, 3 last, 4 rank (a classifier head);
/// and the sentence-transformers Dense projections llama.cpp's converter keeps
/// (`--sentence-transformers-dense-modules`: `dense_2`, `dense_3`, no bias, no activation —
/// EmbeddingGemma's).
fn from_gguf(g: &GgufFile) -> Result<Option<Pooling>> {
    let Ok(arch) = g.architecture() else {
        return Ok(None);
    };
    let Some(kind) = g.get_u64(&format!("{arch}.pooling_type")) else {
        return Ok(None);
    };
    let mode = match kind {
        1 => Mode::Mean,
        2 | 4 => Mode::Cls,
        3 => Mode::Last,
        _ => return Ok(None),
    };
    let scores = kind == 4;
    let store = g.tensors();
    let mut dense = Vec::new();
    for name in ["dense_2.weight", "dense_3.weight"] {
        let Some(t) = store.get(name) else { continue };
        let (rows, cols) = (t.n_rows(), t.row_len());
        let mut weight = vec![0f32; rows * cols];
        if t.numel() != rows * cols
            || !ferrum_backend::cpu::quant::dequantize(t.dtype, t.bytes(), &mut weight)
        {
            return Err(Error::Weights(format!(
                "tensor {name:?}: cannot read as f32"
            )));
        }
        dense.push(Dense {
            weight,
            bias: None,
            in_features: cols,
            out_features: rows,
            tanh: false,
        });
    }
    Ok(Some(Pooling {
        mode,
        dense,
        normalize: !scores,
        scores,
        prompt: g
            .get_str("tokenizer.chat_template.rerank")
            .filter(|_| scores)
            .map(str::to_string),
    }))
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}

fn from_sentence_transformers(dir: &Path, hidden: usize) -> Result<Option<Pooling>> {
    let modules_path = dir.join("modules.json");
    if !modules_path.is_file() {
        return Ok(None);
    }
    let modules = read_json(&modules_path)?;
    let list = modules
        .as_array()
        .ok_or_else(|| Error::format(&modules_path, "not a list of modules"))?;
    let mut pooling = Pooling {
        mode: Mode::Mean,
        dense: Vec::new(),
        normalize: false,
        scores: false,
        prompt: None,
    };
    let mut width = hidden;
    for m in list {
        let ty = m.get("type").and_then(Json::as_str).unwrap_or("");
        let sub = dir.join(m.get("path").and_then(Json::as_str).unwrap_or(""));
        let kind = ty.rsplit('.').next().unwrap_or(ty);
        match kind {
            "Transformer" => {}
            "Pooling" => pooling.mode = pooling_mode(&read_json(&sub.join("config.json"))?, &sub)?,
            "Dense" => {
                let d = dense(&sub, width)?;
                width = d.out_features;
                pooling.dense.push(d);
            }
            "Normalize" => pooling.normalize = true,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: sentence-transformers module {other:?} (Transformer, Pooling, Dense and \
                     Normalize are supported)",
                    modules_path.display()
                )))
            }
        }
    }
    Ok(Some(pooling))
}

fn pooling_mode(c: &Json, dir: &Path) -> Result<Mode> {
    if c.get("include_prompt").and_then(Json::as_bool) == Some(false) {
        return Err(Error::Unsupported(format!(
            "{}: pooling that leaves the prompt's tokens out (include_prompt: false)",
            dir.display()
        )));
    }
    // sentence-transformers 5 and later: one `pooling_mode` string.
    if let Some(m) = c.get("pooling_mode").and_then(Json::as_str) {
        return match m {
            "mean" => Ok(Mode::Mean),
            "cls" => Ok(Mode::Cls),
            "max" => Ok(Mode::Max),
            "lasttoken" | "last" => Ok(Mode::Last),
            "mean_sqrt_len_tokens" => Ok(Mode::MeanSqrtLen),
            other => Err(Error::Unsupported(format!(
                "{}: pooling mode {other:?} (mean, cls, max, lasttoken and \
                 mean_sqrt_len_tokens are supported)",
                dir.display()
            ))),
        };
    }
    // Earlier versions: one boolean a mode.
    let on = |k: &str| c.get(k).and_then(Json::as_bool).unwrap_or(false);
    let modes = [
        ("pooling_mode_cls_token", Mode::Cls),
        ("pooling_mode_mean_tokens", Mode::Mean),
        ("pooling_mode_max_tokens", Mode::Max),
        ("pooling_mode_mean_sqrt_len_tokens", Mode::MeanSqrtLen),
        ("pooling_mode_lasttoken", Mode::Last),
    ];
    let picked: Vec<Mode> = modes.iter().filter(|(k, _)| on(k)).map(|m| m.1).collect();
    if on("pooling_mode_weightedmean_tokens") {
        return Err(Error::Unsupported(format!(
            "{}: weighted-mean pooling",
            dir.display()
        )));
    }
    match picked.as_slice() {
        [m] => Ok(*m),
        [] => Err(Error::format(
            dir.join("config.json"),
            "no pooling mode is on",
        )),
        _ => Err(Error::Unsupported(format!(
            "{}: several pooling modes at once (their concatenation)",
            dir.display()
        ))),
    }
}

fn dense(dir: &Path, width: usize) -> Result<Dense> {
    let cfg_path = dir.join("config.json");
    let c = read_json(&cfg_path)?;
    let get = |k: &str| {
        c.get(k)
            .and_then(Json::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| Error::format(&cfg_path, format!("missing {k}")))
    };
    let (in_features, out_features) = (get("in_features")?, get("out_features")?);
    if in_features != width {
        return Err(Error::format(
            &cfg_path,
            format!("in_features {in_features}, but the vectors before it have {width}"),
        ));
    }
    let act = c
        .get("activation_function")
        .and_then(Json::as_str)
        .unwrap_or("torch.nn.modules.activation.Tanh");
    let tanh = match act.rsplit('.').next().unwrap_or(act) {
        "Tanh" => true,
        "Identity" => false,
        other => {
            return Err(Error::Unsupported(format!(
                "{}: Dense activation {other:?} (Tanh and Identity are supported)",
                cfg_path.display()
            )))
        }
    };
    let mut store = ferrum_loader::TensorStore::default();
    let st = dir.join("model.safetensors");
    if !st.is_file() {
        return Err(Error::Unsupported(format!(
            "{}: a Dense module without model.safetensors",
            dir.display()
        )));
    }
    ferrum_loader::hf::load_safetensors(&st, &mut store, true)?;
    let vec_of = |name: &str, len: usize| -> Result<Option<Vec<f32>>> {
        let Some(t) = store.get(name) else {
            return Ok(None);
        };
        if t.numel() != len {
            return Err(Error::format(&st, format!("{name}: shape {:?}", t.shape)));
        }
        let mut v = vec![0f32; len];
        if !ferrum_backend::cpu::quant::dequantize(t.dtype, t.bytes(), &mut v) {
            return Err(Error::format(
                &st,
                format!("{name}: cannot convert {}", t.dtype),
            ));
        }
        Ok(Some(v))
    };
    let weight = vec_of("linear.weight", in_features * out_features)?
        .ok_or_else(|| Error::format(&st, "no linear.weight"))?;
    let bias = vec_of("linear.bias", out_features)?;
    Ok(Dense {
        weight,
        bias,
        in_features,
        out_features,
        tanh,
    })
}

/// A decoder reranker's head, where the files make the model one: llama.cpp's rank GGUF of a
/// decoder (`pooling_type` rank and a `cls.output` matrix: Qwen3-Reranker's "yes" and "no"
/// rows of the output head), or a Hugging Face Qwen3-Reranker, recognised as llama.cpp's
/// converter recognises it (the folder's name or its README's title), whose head is the output
/// head's rows of the tokens "no" and "yes". Either way the pooling is the last token's state
/// through that head, the logits ordered "no", "yes", so that [`super::relevance`] (the last
/// label's softmax probability) is the probability of "yes" the model card scores with.
pub fn decoder_reranker(
    file: &ModelFile,
    read: Option<Pooling>,
    store: &ferrum_loader::TensorStore,
    hidden: usize,
    qwen3: bool,
) -> Result<Option<Pooling>> {
    let (rows, prompt) = match (file, &read) {
        (ModelFile::Gguf(g), Some(p)) if p.scores => {
            let t = store.get("cls.output.weight").ok_or_else(|| {
                Error::format(&g.path, "a rank pooling without its cls.output.weight head")
            })?;
            let n = t.n_rows();
            if t.row_len() != hidden || n == 0 {
                return Err(Error::format(
                    &g.path,
                    format!("cls.output.weight has shape {:?}", t.shape),
                ));
            }
            // llama.cpp scores Qwen3's two outputs by the softmax of the first ("yes").
            let order: Vec<usize> = (0..n).rev().collect();
            (
                crate::layers::tensor_rows(t, &order, hidden)?,
                p.prompt.clone(),
            )
        }
        (ModelFile::Hf(h), None) if qwen3 && is_qwen3_reranker(&h.dir) => {
            let ids = ["no", "yes"]
                .iter()
                .map(|w| vocab_id(&h.dir, w))
                .collect::<Result<Vec<usize>>>()?;
            let head = store
                .get("lm_head.weight")
                .or_else(|| store.get("model.embed_tokens.weight"))
                .ok_or_else(|| Error::format(&h.dir, "a reranker without an output head"))?;
            (
                crate::layers::tensor_rows(head, &ids, hidden)?,
                Some(QWEN3_RERANK_PROMPT.to_string()),
            )
        }
        _ => return Ok(read),
    };
    Ok(Some(Pooling {
        mode: Mode::Last,
        dense: vec![Dense {
            out_features: rows.len() / hidden,
            weight: rows,
            bias: None,
            in_features: hidden,
            tanh: false,
        }],
        normalize: false,
        scores: true,
        prompt,
    }))
}

/// Qwen3-Reranker's prompt as its model card builds it, with the card's default instruction
/// (the one llama.cpp's converter writes into a GGUF's rerank template).
pub const QWEN3_RERANK_PROMPT: &str = "<|im_start|>system\nJudge whether the Document meets the \
requirements based on the Query and the Instruct provided. Note that the answer can only be \
\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve \
relevant passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n\
<|im_start|>assistant\n<think>\n\n</think>\n\n";

/// llama.cpp's test: "qwen3-reranker" in the folder's name, or a README titled so.
fn is_qwen3_reranker(dir: &Path) -> bool {
    let named = |s: &str| s.to_lowercase().contains("qwen3-reranker");
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    if canonical
        .file_name()
        .is_some_and(|n| named(&n.to_string_lossy()))
    {
        return true;
    }
    std::fs::read_to_string(dir.join("README.md"))
        .is_ok_and(|r| r.to_lowercase().contains("# qwen3-reranker"))
}

/// The id of `word` in a Hugging Face folder's `tokenizer.json` (its vocabulary or its added
/// tokens).
fn vocab_id(dir: &Path, word: &str) -> Result<usize> {
    let path = dir.join("tokenizer.json");
    crate::config::hf_vocab_id(&read_json(&path)?, word)
        .map(|v| v as usize)
        .ok_or_else(|| {
            Error::format(
                &path,
                format!("a Qwen3 reranker needs the token {word:?} in its vocabulary"),
            )
        })
}
