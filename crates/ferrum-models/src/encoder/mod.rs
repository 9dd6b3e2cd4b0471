//! Bidirectional encoders: the embedding and reranking models (BERT, XLM-RoBERTa). They run
//! whole inputs in one pass — attention without the causal mask, no KV cache kept between
//! requests — and end in a pooling step ([`pooling`]) or a sequence classifier (a
//! cross-encoder's relevance score), instead of a language-model head.
//!
//! A pass carries many sequences (the server batches short inputs across requests). Keys and
//! values go into a scratch cache for the pass, each sequence in blocks of its own, and the
//! backend's paged attention runs every query row as a one-row sequence at the sequence's
//! last position: a row at position `n − 1` sees all `n` keys, which is what the missing mask
//! means. The matmuls are the backend's (packed kernels for quantised files); LayerNorm and
//! GELU are [`Backend::layer_norm`] and [`Backend::gelu`].

pub mod bert;
pub mod pooling;

use ferrum_backend::{AttentionParams, AttnSeq, Backend, KvShape, KvTable, MatmulPart, Rows};
use ferrum_core::{DType, Error, Result};
use ferrum_loader::ModelFile;

use crate::layers::WeightSource;
pub use pooling::{Mode as PoolingMode, Pooling};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Bert,
    /// XLM-RoBERTa and RoBERTa: BERT's blocks, positions counted from `pad_token_id + 1`.
    XlmRoberta,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Bert => "bert",
            Family::XlmRoberta => "xlm-roberta",
        }
    }
}

#[derive(Debug, Clone)]
pub struct EncoderConfig {
    pub family: Family,
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_position: usize,
    /// Rows of the token-type table (0: none).
    pub type_vocab: usize,
    pub eps: f32,
    /// Position embedding row of a sequence's first token.
    pub position_offset: usize,
    /// A sequence classifier's label count (a cross-encoder has one); `None` for an
    /// embedding model.
    pub labels: Option<usize>,
    /// Whether a pair's second segment reads its own token-type row (Hugging Face's
    /// models); llama.cpp's graph reads row 0 for every token of a GGUF file, and so does
    /// this on one.
    pub pair_types: bool,
    /// The model's own limit below the position table, where its files give one
    /// (sentence-transformers' `max_seq_length`: all-MiniLM-L6-v2 was trained to 256).
    pub max_tokens: Option<usize>,
}

impl EncoderConfig {
    /// Longest input a pass takes: the position table's rows past the offset, or the
    /// model's own limit.
    pub fn context(&self) -> usize {
        let table = self.max_position.saturating_sub(self.position_offset);
        self.max_tokens.map_or(table, |m| m.min(table))
    }
}

/// Whether `file` holds an encoder this module runs (and not a decoder).
pub fn is_encoder(file: &ModelFile) -> bool {
    bert::matches(file)
}

/// Every encoder class and GGUF architecture, for error messages and the README.
pub fn supported() -> String {
    format!("{} (GGUF: bert)", bert::HF_CLASSES.join(", "))
}

/// An encoder's configuration from its files (config.json and sentence-transformers'
/// `max_seq_length`, or the GGUF's keys), without loading its weights.
pub fn read_config(file: &ModelFile) -> Result<EncoderConfig> {
    let store = file.tensors();
    let config = match file {
        ModelFile::Hf(h) => bert::from_hf(&h.config)?,
        ModelFile::Gguf(g) => {
            let vocab = store
                .get("token_embd.weight")
                .map(|t| t.n_rows())
                .ok_or_else(|| {
                    Error::Weights(format!("{}: no token_embd.weight", g.path.display()))
                })?;
            bert::from_gguf(g, vocab, &store)?
        }
    };
    let mut config = config;
    if let ModelFile::Hf(h) = file {
        let p = h.dir.join("sentence_bert_config.json");
        if let Ok(text) = std::fs::read_to_string(&p) {
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::format(&p, format!("invalid JSON: {e}")))?;
            config.max_tokens = v
                .get("max_seq_length")
                .and_then(serde_json::Value::as_u64)
                .map(|m| m as usize);
        }
    }
    Ok(config)
}

/// A cross-encoder's relevance score from its logits: the sigmoid of a single logit (as
/// sentence-transformers' `CrossEncoder`, vLLM and text-embeddings-inference give it), or
/// the softmax probability of the last label of several.
pub fn relevance(logits: &[f32]) -> f32 {
    match logits {
        [l] => 1.0 / (1.0 + (-l).exp()),
        [] => 0.0,
        ls => {
            let m = ls.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = ls.iter().map(|l| (l - m).exp()).sum();
            (ls[ls.len() - 1] - m).exp() / sum
        }
    }
}

/// Cuts `ids` to its first `keep` tokens with its last token put back in the last place: an
/// encoder's closing special token (BERT's `[SEP]`, XLM-R's `</s>`) stays last, as
/// sentence-transformers' and TEI's truncation leave it. Nothing when the ids fit or `keep` is
/// 0 (the encoder then refuses the input, naming both lengths).
pub fn cut_keeping_last(ids: &mut Vec<u32>, keep: usize) {
    cut_keeping_tail(ids, keep, 1)
}

/// Cuts `ids` to `keep` tokens with its last `tail` put back at the end (an encoder's closing
/// token; a decoder reranker's closing prompt). Nothing when the ids fit, or `keep` is 0 or
/// shorter than the tail.
pub fn cut_keeping_tail(ids: &mut Vec<u32>, keep: usize, tail: usize) {
    if keep == 0 || ids.len() <= keep || tail > keep {
        return;
    }
    let end = ids.split_off(ids.len() - tail);
    ids.truncate(keep - tail);
    ids.extend(end);
}

/// Keeps the first `dims` numbers of an embedding (a Matryoshka model's shorter vector) and
/// scales them back to unit length when the model's vectors are unit length.
pub fn truncate_dims(
    v: &mut Vec<f32>,
    dims: usize,
    normalize: bool,
) -> std::result::Result<(), String> {
    if dims == 0 || dims > v.len() {
        return Err(format!(
            "dimensions {dims}: this model's embeddings have {} (ask for 1 to {})",
            v.len(),
            v.len()
        ));
    }
    if dims < v.len() {
        v.truncate(dims);
        if normalize {
            pooling::normalize(v);
        }
    }
    Ok(())
}

struct Norm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

struct Layer<W> {
    q: W,
    k: W,
    v: W,
    qkv_bias: [W; 3],
    o: W,
    o_bias: W,
    attn_norm: Norm,
    up: W,
    up_bias: W,
    down: W,
    down_bias: W,
    out_norm: Norm,
}

/// A sequence classifier: `out(tanh(dense(first token)))`; without `dense` (a GGUF file
/// from llama.cpp's converter, which drops BERT's pooler) `out(first token)`, as llama.cpp
/// scores such a file.
struct Classifier<W> {
    dense: Option<(W, W)>,
    out: W,
    out_bias: W,
}

/// One input: token ids and, for a pair, each token's segment.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    pub ids: &'a [u32],
    pub types: Option<&'a [u32]>,
}

/// What the load summary and the server's model card report.
#[derive(Debug, Clone)]
pub struct EncoderInfo {
    pub params: usize,
    /// The format most of the weight bytes are stored in.
    pub main_dtype: DType,
    pub file_bytes: usize,
    pub load_secs: f64,
}

pub struct Encoder<B: Backend> {
    backend: B,
    pub config: EncoderConfig,
    pub info: EncoderInfo,
    /// How an embedding is made from the states (from the model's files, else mean pooling
    /// and unit length: sentence-transformers' most common recipe).
    pub pooling: Pooling,
    /// Whether `pooling` came from the model's files.
    pub pooling_from_files: bool,
    word: W<B>,
    position: W<B>,
    types: Option<W<B>>,
    embed_norm: Norm,
    layers: Vec<Layer<W<B>>>,
    classifier: Option<Classifier<W<B>>>,
}

type W<B> = <B as Backend>::Weight;

/// One call's working buffers, sized for its largest pass.
struct Scratch<B: Backend> {
    x: B::Buf,
    tmp: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    ffn: B::Buf,
    k: B::KvBuf,
    v: B::KvBuf,
}

/// Most tokens one pass carries (whole sequences; one longer than this runs alone).
pub const PASS_TOKENS: usize = 512;
const BLOCK: usize = 16;

impl<B: Backend> Encoder<B> {
    pub fn load(file: &ModelFile, backend: B) -> Result<Encoder<B>> {
        let t0 = std::time::Instant::now();
        let store = file.tensors();
        let gguf = matches!(file, ModelFile::Gguf(_));
        let config = read_config(file)?;
        let c = &config;
        if c.heads == 0 || c.hidden % c.heads != 0 {
            return Err(Error::Weights(format!(
                "{} heads do not divide the hidden size {}",
                c.heads, c.hidden
            )));
        }
        // A task model keeps the encoder under its own prefix.
        let prefix = ["", "bert.", "roberta.", "model."]
            .into_iter()
            .find(|p| gguf || store.contains(&format!("{p}embeddings.word_embeddings.weight")))
            .ok_or_else(|| Error::Weights("no embeddings.word_embeddings.weight".into()))?;
        let src = WeightSource {
            store: &store,
            gguf,
            names: bert::NAMES,
        };
        let name = |n: &str| {
            if gguf {
                n.to_string()
            } else {
                format!("{prefix}{n}")
            }
        };
        let be = &backend;
        backend.reserve(store.total_bytes() as u64)?;
        let (h, f) = (c.hidden, c.intermediate);
        let mat = |n: &str, i: usize, shape: (usize, usize)| src.require(be, &name(n), i, shape);
        // The blocks' matrices: an encoder's batches are bound by arithmetic, so the fast
        // path may multiply them in 8 bits.
        let layer_mat = |n: &str, i: usize, shape: (usize, usize)| {
            src.require_with(be, &name(n), i, shape, |t| be.load_weight_compute(t))
        };
        let vec = |n: &str, i: usize, len: usize| src.require(be, &name(n), i, (1, len));
        let norm = |n: &str, i: usize| -> Result<Norm> {
            Ok(Norm {
                weight: src.vector(&name(&format!("{n}.weight")), i, h)?,
                bias: src.vector(&name(&format!("{n}.bias")), i, h)?,
            })
        };
        let word = mat("embeddings.word_embeddings.weight", 0, (c.vocab, h))?;
        let position = mat(
            "embeddings.position_embeddings.weight",
            0,
            (c.max_position, h),
        )?;
        let types = if c.type_vocab > 0 {
            Some(mat(
                "embeddings.token_type_embeddings.weight",
                0,
                (c.type_vocab, h),
            )?)
        } else {
            None
        };
        let embed_norm = norm("embeddings.LayerNorm", 0)?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let l = |s: &str| format!("encoder.layer.{{i}}.{s}");
            layers.push(Layer {
                q: layer_mat(&l("attention.self.query.weight"), i, (h, h))?,
                k: layer_mat(&l("attention.self.key.weight"), i, (h, h))?,
                v: layer_mat(&l("attention.self.value.weight"), i, (h, h))?,
                qkv_bias: [
                    vec(&l("attention.self.query.bias"), i, h)?,
                    vec(&l("attention.self.key.bias"), i, h)?,
                    vec(&l("attention.self.value.bias"), i, h)?,
                ],
                o: layer_mat(&l("attention.output.dense.weight"), i, (h, h))?,
                o_bias: vec(&l("attention.output.dense.bias"), i, h)?,
                attn_norm: norm(&l("attention.output.LayerNorm"), i)?,
                up: layer_mat(&l("intermediate.dense.weight"), i, (f, h))?,
                up_bias: vec(&l("intermediate.dense.bias"), i, f)?,
                down: layer_mat(&l("output.dense.weight"), i, (h, f))?,
                down_bias: vec(&l("output.dense.bias"), i, h)?,
                out_norm: norm(&l("output.LayerNorm"), i)?,
            });
        }
        let classifier = match c.labels {
            None => None,
            Some(labels) => {
                // BERT: the pooler and `classifier`; RoBERTa: `classifier.dense` and
                // `classifier.out_proj` (unprefixed in a Hugging Face file).
                let get = |hf: &[&str], shape: (usize, usize)| -> Result<W<B>> {
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
                let dense = if gguf && store.get("cls.weight").is_none() {
                    None
                } else {
                    Some((
                        get(&["pooler.dense.weight", "classifier.dense.weight"], (h, h))?,
                        get(&["pooler.dense.bias", "classifier.dense.bias"], (1, h))?,
                    ))
                };
                Some(Classifier {
                    dense,
                    out: get(
                        &["classifier.weight", "classifier.out_proj.weight"],
                        (labels, h),
                    )?,
                    out_bias: get(
                        &["classifier.bias", "classifier.out_proj.bias"],
                        (1, labels),
                    )?,
                })
            }
        };
        let read = Pooling::read(file, h)?;
        let pooling_from_files = read.is_some();
        let pooling = read.unwrap_or(Pooling {
            mode: PoolingMode::Mean,
            dense: Vec::new(),
            normalize: true,
            scores: false,
            prompt: None,
        });
        let mut by_type: std::collections::HashMap<DType, usize> = Default::default();
        for t in store.tensors.values() {
            *by_type.entry(t.dtype).or_default() += t.bytes().len();
        }
        let info = EncoderInfo {
            params: store.total_params(),
            main_dtype: by_type
                .into_iter()
                .max_by_key(|(_, b)| *b)
                .map_or(DType::F32, |(d, _)| d),
            file_bytes: file.file_bytes(),
            load_secs: t0.elapsed().as_secs_f64(),
        };
        Ok(Encoder {
            backend,
            config,
            info,
            pooling,
            pooling_from_files,
            word,
            position,
            types,
            embed_norm,
            layers,
            classifier,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Whether this model scores pairs (a cross-encoder) rather than embedding texts.
    pub fn is_classifier(&self) -> bool {
        self.classifier.is_some()
    }

    /// Length of an embedding.
    pub fn embedding_width(&self) -> usize {
        self.pooling.width(self.config.hidden)
    }

    fn check(&self, inputs: &[Input]) -> Result<()> {
        let c = &self.config;
        for (i, x) in inputs.iter().enumerate() {
            if x.ids.is_empty() {
                return Err(Error::InvalidRequest(format!("input {i} is empty")));
            }
            if x.ids.len() > c.context() {
                return Err(Error::InvalidRequest(format!(
                    "input {i} is {} tokens; the model reads at most {}",
                    x.ids.len(),
                    c.context()
                )));
            }
            if let Some(bad) = x.ids.iter().find(|&&t| t as usize >= c.vocab) {
                return Err(Error::InvalidRequest(format!(
                    "input {i}: token {bad} is outside the vocabulary ({})",
                    c.vocab
                )));
            }
            if let Some(t) = x.types {
                if t.len() != x.ids.len() {
                    return Err(Error::InvalidRequest(format!(
                        "input {i}: {} token types for {} tokens",
                        t.len(),
                        x.ids.len()
                    )));
                }
                if let Some(bad) = t.iter().find(|&&t| t as usize >= c.type_vocab.max(1)) {
                    return Err(Error::InvalidRequest(format!(
                        "input {i}: token type {bad}; the model has {}",
                        c.type_vocab
                    )));
                }
            }
        }
        Ok(())
    }

    /// The last layer's states of every input, each `len × hidden` row-major.
    pub fn hidden_states(&self, inputs: &[Input]) -> Result<Vec<Vec<f32>>> {
        self.check(inputs)?;
        // The passes first, then buffers for the largest, allocated (and zeroed) once.
        let mut passes = Vec::new();
        let mut start = 0;
        while start < inputs.len() {
            let mut end = start + 1;
            let mut tokens = inputs[start].ids.len();
            while end < inputs.len() && tokens + inputs[end].ids.len() <= PASS_TOKENS {
                tokens += inputs[end].ids.len();
                end += 1;
            }
            passes.push(start..end);
            start = end;
        }
        let size = |r: &std::ops::Range<usize>, f: &dyn Fn(usize) -> usize| -> usize {
            inputs[r.clone()].iter().map(|x| f(x.ids.len())).sum()
        };
        let tokens = passes.iter().map(|r| size(r, &|n| n)).max().unwrap_or(0);
        let blocks = passes
            .iter()
            .map(|r| size(r, &|n| n.div_ceil(BLOCK)))
            .max()
            .unwrap_or(0);
        let mut scratch = self.scratch(tokens, blocks);
        let mut out = Vec::with_capacity(inputs.len());
        for r in passes {
            out.extend(self.pass(&inputs[r], &mut scratch)?);
        }
        Ok(out)
    }

    /// Each input's embedding, pooled as [`Self::pooling`] says.
    pub fn embed(&self, inputs: &[Input]) -> Result<Vec<Vec<f32>>> {
        let h = self.config.hidden;
        Ok(self
            .hidden_states(inputs)?
            .iter()
            .map(|s| self.pooling.apply(s, h))
            .collect())
    }

    /// A classifier's logits for each input (for a cross-encoder, a query–document pair).
    pub fn classify(&self, inputs: &[Input]) -> Result<Vec<Vec<f32>>> {
        let Some(cl) = &self.classifier else {
            return Err(Error::InvalidRequest(
                "this model has no classification head (it embeds; it does not score pairs)".into(),
            ));
        };
        let h = self.config.hidden;
        let states = self.hidden_states(inputs)?;
        let n = states.len();
        let be = &self.backend;
        let mut first = be.alloc(n * h);
        for (i, s) in states.iter().enumerate() {
            be.write(&mut first, i * h, &s[..h]);
        }
        let pooled = match &cl.dense {
            Some((w, b)) => {
                let mut pooled = be.alloc(n * h);
                be.matmul(
                    &first,
                    Rows::dense(n, h),
                    w,
                    Some(b),
                    &mut pooled,
                    Rows::dense(n, h),
                );
                let mut p = vec![0f32; n * h];
                be.read(&pooled, 0, &mut p);
                p.iter_mut().for_each(|v| *v = v.tanh());
                be.write(&mut pooled, 0, &p);
                pooled
            }
            None => first,
        };
        let labels = be.weight_shape(&cl.out).0;
        let mut logits = be.alloc(n * labels);
        be.matmul(
            &pooled,
            Rows::dense(n, h),
            &cl.out,
            Some(&cl.out_bias),
            &mut logits,
            Rows::dense(n, labels),
        );
        be.sync()?;
        let mut l = vec![0f32; n * labels];
        be.read(&logits, 0, &mut l);
        Ok(l.chunks_exact(labels).map(<[f32]>::to_vec).collect())
    }

    /// One pass over whole sequences.
    fn scratch(&self, tokens: usize, blocks: usize) -> Scratch<B> {
        let c = &self.config;
        let be = &self.backend;
        let shape = KvShape {
            blocks,
            block_size: BLOCK,
            heads: c.heads,
            head_dim: c.hidden / c.heads,
        };
        Scratch {
            x: be.alloc(tokens * c.hidden),
            tmp: be.alloc(tokens * c.hidden),
            qkv: be.alloc(tokens * 3 * c.hidden),
            attn: be.alloc(tokens * c.hidden),
            ffn: be.alloc(tokens * c.intermediate),
            k: be.alloc_kv(shape),
            v: be.alloc_kv(shape),
        }
    }

    fn pass(&self, inputs: &[Input], s: &mut Scratch<B>) -> Result<Vec<Vec<f32>>> {
        let Scratch {
            x,
            tmp,
            qkv,
            attn,
            ffn,
            k: k_cache,
            v: v_cache,
        } = s;
        let c = &self.config;
        let be = &self.backend;
        let (h, f, hd) = (c.hidden, c.intermediate, c.hidden / c.heads);
        let n: usize = inputs.iter().map(|x| x.ids.len()).sum();
        let ids: Vec<u32> = inputs.iter().flat_map(|x| x.ids.iter().copied()).collect();
        let positions: Vec<u32> = inputs
            .iter()
            .flat_map(|x| (0..x.ids.len()).map(|p| (p + c.position_offset) as u32))
            .collect();
        let hidden = Rows::dense(n, h);
        be.embed(&self.word, &ids, x, hidden);
        be.embed(&self.position, &positions, tmp, hidden);
        be.add_inplace(x, hidden, tmp, hidden);
        if let Some(types) = &self.types {
            let t: Vec<u32> = inputs
                .iter()
                .flat_map(|x| match x.types {
                    Some(t) if c.pair_types => t.to_vec(),
                    _ => vec![0; x.ids.len()],
                })
                .collect();
            be.embed(types, &t, tmp, hidden);
            be.add_inplace(x, hidden, tmp, hidden);
        }
        be.layer_norm(
            x,
            hidden,
            &self.embed_norm.weight,
            &self.embed_norm.bias,
            c.eps,
        );

        // Each sequence's blocks, consecutive; each query row a one-row sequence at the last
        // position, so it attends to every key of its sequence.
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(inputs.len());
        let mut next = 0u32;
        for x in inputs {
            let blocks = x.ids.len().div_ceil(BLOCK) as u32;
            tables.push((next..next + blocks).collect());
            next += blocks;
        }
        let write_seqs: Vec<AttnSeq> = inputs
            .iter()
            .zip(&tables)
            .map(|(x, t)| AttnSeq {
                rows: x.ids.len(),
                first_pos: 0,
                table: KvTable {
                    blocks: t,
                    block_size: BLOCK,
                },
            })
            .collect();
        let query_seqs: Vec<AttnSeq> = write_seqs
            .iter()
            .flat_map(|s| {
                (0..s.rows).map(move |_| AttnSeq {
                    rows: 1,
                    first_pos: s.rows - 1,
                    table: s.table,
                })
            })
            .collect();
        let params = AttentionParams {
            n_kv_heads: c.heads,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            softcap: None,
            sinks: None,
        };

        let w3 = 3 * h;
        let q_cols = Rows::columns(n, w3, 0, h);
        let k_cols = Rows::columns(n, w3, h, h);
        let v_cols = Rows::columns(n, w3, 2 * h, h);
        let (q_view, k_view) = (q_cols.split_heads(hd), k_cols.split_heads(hd));
        for l in &self.layers {
            let part = |weight, bias, out| MatmulPart {
                weight,
                bias: Some(bias),
                out,
            };
            be.matmul_many(
                x,
                hidden,
                &[
                    part(&l.q, &l.qkv_bias[0], q_cols),
                    part(&l.k, &l.qkv_bias[1], k_cols),
                    part(&l.v, &l.qkv_bias[2], v_cols),
                ],
                qkv,
            );
            let mut row = 0;
            for s in &write_seqs {
                be.write_kv(qkv, k_view.slice(row, s.rows), k_cache, s.table, 0);
                be.write_kv(qkv, v_cols.slice(row, s.rows), v_cache, s.table, 0);
                row += s.rows;
            }
            let attn_view = Rows::dense(n, h).split_heads(hd);
            be.attention(
                qkv,
                q_view,
                k_cache,
                v_cache,
                &query_seqs,
                attn,
                attn_view,
                params,
            );
            be.matmul(attn, hidden, &l.o, Some(&l.o_bias), tmp, hidden);
            be.add_inplace(x, hidden, tmp, hidden);
            be.layer_norm(x, hidden, &l.attn_norm.weight, &l.attn_norm.bias, c.eps);
            let ffn_view = Rows::dense(n, f);
            be.matmul(x, hidden, &l.up, Some(&l.up_bias), ffn, ffn_view);
            be.gelu(ffn, ffn_view);
            be.matmul(ffn, ffn_view, &l.down, Some(&l.down_bias), tmp, hidden);
            be.add_inplace(x, hidden, tmp, hidden);
            be.layer_norm(x, hidden, &l.out_norm.weight, &l.out_norm.bias, c.eps);
        }
        be.sync()?;
        let mut all = vec![0f32; n * h];
        be.read(x, 0, &mut all);
        let mut out = Vec::with_capacity(inputs.len());
        let mut row = 0;
        for s in inputs {
            out.push(all[row * h..(row + s.ids.len()) * h].to_vec());
            row += s.ids.len();
        }
        Ok(out)
    }
}
