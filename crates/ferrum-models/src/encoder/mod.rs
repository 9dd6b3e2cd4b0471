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
pub mod gemma;
pub mod modernbert;
pub mod nomic;
pub mod pooling;

use ferrum_backend::{
    Activation, AttentionParams, AttnSeq, Backend, KvShape, KvTable, MatmulPart, RopeLayout,
    RopeParams, Rows,
};
use ferrum_core::{DType, Error, Result};
use ferrum_loader::ModelFile;

use crate::layers::WeightSource;
pub use pooling::{Mode as PoolingMode, Pooling};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Bert,
    /// XLM-RoBERTa and RoBERTa: BERT's blocks, positions counted from `pad_token_id + 1`.
    XlmRoberta,
    /// NomicBERT (nomic-embed-text): BERT's post-norm blocks with rotary positions, a fused
    /// QKV and SwiGLU, no biases.
    NomicBert,
    /// ModernBERT: pre-norm blocks, rotary positions, local (windowed) attention on all but
    /// every `n`-th layer, GeGLU, no biases.
    ModernBert,
    /// EmbeddingGemma: Gemma 3's blocks (RMSNorms before and after each sublayer, QK-norm,
    /// grouped-query attention, GeGLU) with attention both ways, local layers windowed
    /// either side.
    GemmaEmbedding,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Bert => "bert",
            Family::XlmRoberta => "xlm-roberta",
            Family::NomicBert => "nomic-bert",
            Family::ModernBert => "modernbert",
            Family::GemmaEmbedding => "gemma-embedding",
        }
    }

    fn layout(self) -> &'static Layout {
        match self {
            Family::Bert | Family::XlmRoberta => &bert::LAYOUT,
            Family::NomicBert => &nomic::LAYOUT,
            Family::ModernBert => &modernbert::LAYOUT,
            Family::GemmaEmbedding => &gemma::LAYOUT,
        }
    }
}

/// A block's feed-forward network.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FfnKind {
    /// `down(gelu(up(x)))` with exact GELU (BERT).
    Gelu,
    /// `down(act(gate(x)) · up(x))`: NomicBERT's SwiGLU, ModernBERT's GeGLU.
    Glu(Activation),
}

/// ModernBERT's local layers: each token sees the keys within `half` positions either side.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalAttention {
    pub half: usize,
    /// The local layers' rotary base.
    pub theta: f32,
    /// Which layers are local (the rest attend globally).
    pub layers: Vec<bool>,
}

#[derive(Debug, Clone)]
pub struct EncoderConfig {
    pub family: Family,
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// Rows of the learned position table, or the longest input a rotary model was trained
    /// on.
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
    /// Rotary positions' base (of the global layers) instead of a learned table.
    pub rope_theta: Option<f32>,
    pub local: Option<LocalAttention>,
    pub ffn: FfnKind,
    /// Norms before each sublayer and once at the end (ModernBERT), not after each (BERT).
    pub prenorm: bool,
    /// Gemma's norms: RMSNorms (`1 + w` in a Hugging Face file) before and after each
    /// sublayer and once at the end, and on each query and key head; `prenorm` is set too.
    pub rms: bool,
    /// Each attention head's size (0: `hidden / heads`).
    pub head_dim: usize,
    /// Key and value heads (0: as many as query heads).
    pub kv_heads: usize,
    /// The attention scores' scale (0: `head_dim^-½`).
    pub attn_scale: f32,
    /// What the token embeddings are multiplied by (Gemma's `√hidden`).
    pub embed_scale: Option<f32>,
    /// How a classifier reads the sequence: its first token (BERT), or the mean of its
    /// states (ModernBERT's `classifier_pooling: "mean"`).
    pub classifier_mean: bool,
}

impl EncoderConfig {
    /// Longest input a pass takes: the position table's rows past the offset, or the
    /// model's own limit.
    pub fn context(&self) -> usize {
        let table = self.max_position.saturating_sub(self.position_offset);
        self.max_tokens.map_or(table, |m| m.min(table))
    }

    /// Fills the sizes left at 0 with their defaults: `hidden / heads` per head, as many KV
    /// heads as query heads, `head_dim^-½`.
    fn with_defaults(mut self) -> Self {
        if self.head_dim == 0 && self.heads > 0 {
            self.head_dim = self.hidden / self.heads;
        }
        if self.kv_heads == 0 {
            self.kv_heads = self.heads;
        }
        if self.attn_scale == 0.0 && self.head_dim > 0 {
            self.attn_scale = 1.0 / (self.head_dim as f32).sqrt();
        }
        self
    }

    /// Query columns (`heads × head_dim`) and key or value columns of the fused projection.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The half window of layer `i`, when it is a local layer.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        self.local
            .as_ref()
            .filter(|l| l.layers.get(i).copied().unwrap_or(false))
            .map(|l| l.half)
    }
}

/// Where a family keeps each weight: candidate names per role, Hugging Face's (after a task
/// model's prefix) and llama.cpp's GGUF names, `{i}` the layer. Each is a stem: `.weight`
/// follows, and `.bias` where the file has one (absent biases are zero).
pub struct Layout {
    /// What a task model puts before the encoder's names (`bert.`, `model.`).
    pub prefixes: &'static [&'static str],
    pub word: &'static [&'static str],
    pub position: &'static [&'static str],
    pub types: &'static [&'static str],
    pub embed_norm: &'static [&'static str],
    /// A fused `[q; k; v]` projection, tried before the three apart.
    pub qkv: &'static [&'static str],
    pub q: &'static [&'static str],
    pub k: &'static [&'static str],
    pub v: &'static [&'static str],
    pub o: &'static [&'static str],
    /// After attention (post-norm), or before it (pre-norm; none on ModernBERT's layer 0).
    pub attn_norm: &'static [&'static str],
    /// The FFN's input matrix: `2f` rows (`[gate; up]`) in a gated FFN without `gate`.
    pub up: &'static [&'static str],
    pub gate: &'static [&'static str],
    pub down: &'static [&'static str],
    /// After the FFN (post-norm), or before it (pre-norm).
    pub ffn_norm: &'static [&'static str],
    pub final_norm: &'static [&'static str],
    /// Gemma's norms after attention and after the FFN, and per query and key head.
    pub post_attn_norm: &'static [&'static str],
    pub post_ffn_norm: &'static [&'static str],
    pub q_norm: &'static [&'static str],
    pub k_norm: &'static [&'static str],
}

/// Whether `file` holds an encoder this module runs (and not a decoder).
pub fn is_encoder(file: &ModelFile) -> bool {
    bert::matches(file) || nomic::matches(file) || modernbert::matches(file) || gemma::matches(file)
}

/// Every encoder class and GGUF architecture, for error messages and the README.
pub fn supported() -> String {
    format!(
        "{}, {}, {}, Gemma3TextModel with use_bidirectional_attention (EmbeddingGemma) (GGUF: \
         bert, nomic-bert, modern-bert, gemma-embedding)",
        bert::HF_CLASSES.join(", "),
        nomic::HF_CLASSES.join(", "),
        modernbert::HF_CLASSES.join(", ")
    )
}

/// An encoder's configuration from its files (config.json and sentence-transformers'
/// `max_seq_length`, or the GGUF's keys), without loading its weights.
pub fn read_config(file: &ModelFile) -> Result<EncoderConfig> {
    let store = file.tensors();
    let config = match file {
        ModelFile::Hf(h) if nomic::matches(file) => nomic::from_hf(&h.config)?,
        ModelFile::Hf(h) if modernbert::matches(file) => modernbert::from_hf(&h.config)?,
        ModelFile::Hf(h) if gemma::matches(file) => gemma::from_hf(&h.config)?,
        ModelFile::Hf(h) => bert::from_hf(&h.config)?,
        ModelFile::Gguf(g) => {
            let vocab = store
                .get("token_embd.weight")
                .map(|t| t.n_rows())
                .ok_or_else(|| {
                    Error::Weights(format!("{}: no token_embd.weight", g.path.display()))
                })?;
            match g.architecture()? {
                "nomic-bert" => nomic::from_gguf(g, vocab, &store)?,
                "modern-bert" => modernbert::from_gguf(g, vocab, &store)?,
                "gemma-embedding" => gemma::from_gguf(g, vocab)?,
                _ => bert::from_gguf(g, vocab, &store)?,
            }
        }
    };
    let mut config = config.with_defaults();
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

/// A block's norm: a LayerNorm (on the host's parameters) or an RMSNorm (Gemma).
enum BlockNorm<W> {
    Layer(Norm),
    Rms(W),
}

impl<W> BlockNorm<W> {
    fn apply<B: Backend<Weight = W>>(&self, be: &B, x: &mut B::Buf, xv: Rows, eps: f32) {
        match self {
            BlockNorm::Layer(n) => be.layer_norm(x, xv, &n.weight, &n.bias, eps),
            BlockNorm::Rms(w) => be.rms_norm_inplace(x, xv, w, eps),
        }
    }

    /// The normed copy of `x` in `y`.
    fn apply_into<B: Backend<Weight = W>>(
        &self,
        be: &B,
        x: &B::Buf,
        xv: Rows,
        y: &mut B::Buf,
        eps: f32,
    ) {
        match self {
            BlockNorm::Layer(n) => {
                be.copy_rows(x, xv, y, xv);
                be.layer_norm(y, xv, &n.weight, &n.bias, eps);
            }
            BlockNorm::Rms(w) => be.rms_norm(x, xv, w, eps, y, xv),
        }
    }
}

/// Gemma's extra norms: after attention and after the FFN, and per query and key head.
struct GemmaNorms<W> {
    post_attn: W,
    post_ffn: W,
    q: W,
    k: W,
}

/// A matrix, its bias where the file has one, and the columns of the output it fills.
struct Part<W> {
    w: W,
    bias: Option<W>,
    col: usize,
    width: usize,
}

struct Layer<W> {
    /// Into `[q | k | v]`: one fused part or three.
    qkv: Vec<Part<W>>,
    o: W,
    o_bias: Option<W>,
    attn_norm: Option<BlockNorm<W>>,
    /// Into the FFN buffer: `[up]` (GELU) or `[gate | up]` (gated).
    up: Vec<Part<W>>,
    down: W,
    down_bias: Option<W>,
    ffn_norm: BlockNorm<W>,
    gemma: Option<GemmaNorms<W>>,
    /// Half window of a local layer.
    window: Option<usize>,
    /// Rotary inverse frequencies (rotary models).
    inv_freq: Option<Vec<f32>>,
}

/// A sequence classifier on the pooled states: `out(tanh(dense(x)))` (BERT's pooler and
/// classifier, RoBERTa's head) or `out(norm(gelu(dense(x))))` (ModernBERT's head); without
/// `dense` (a BERT GGUF file from llama.cpp's converter, which drops the pooler)
/// `out(first token)`, as llama.cpp scores such a file.
struct Classifier<W> {
    dense: Option<(W, Option<W>)>,
    /// ModernBERT's head: GELU then this norm; else tanh.
    gelu_norm: Option<Norm>,
    out: W,
    out_bias: Option<W>,
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
    position: Option<W<B>>,
    types: Option<W<B>>,
    embed_norm: Option<Norm>,
    layers: Vec<Layer<W<B>>>,
    final_norm: Option<BlockNorm<W<B>>>,
    classifier: Option<Classifier<W<B>>>,
}

type W<B> = <B as Backend>::Weight;

/// One call's working buffers, sized for its largest pass.
struct Scratch<B: Backend> {
    x: B::Buf,
    /// A pre-norm block's normed input.
    y: B::Buf,
    tmp: B::Buf,
    qkv: B::Buf,
    /// Long sequences' `[q | k | v]` rows in reverse order (local attention).
    rev: B::Buf,
    attn: B::Buf,
    ffn: B::Buf,
    act: B::Buf,
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
        let lay = c.family.layout();
        // A task model keeps the encoder under its own prefix.
        let prefix = if gguf {
            ""
        } else {
            lay.prefixes
                .iter()
                .copied()
                .find(|p| {
                    lay.word
                        .iter()
                        .any(|w| store.contains(&format!("{p}{w}.weight")))
                })
                .ok_or_else(|| {
                    Error::Weights(format!("no word embeddings ({}.weight)", lay.word[0]))
                })?
        };
        let find = |stems: &[&str], i: usize, suffix: &str| -> Option<String> {
            stems.iter().find_map(|s| {
                let n = format!("{prefix}{}{suffix}", s.replace("{i}", &i.to_string()));
                store.contains(&n).then_some(n)
            })
        };
        let missing = |stems: &[&str], i: usize| {
            Error::Weights(format!(
                "missing tensor {:?} (layer {i})",
                stems.first().unwrap_or(&"?")
            ))
        };
        let src = WeightSource {
            store: &store,
            gguf: false,
            names: &[],
        };
        let be = &backend;
        backend.reserve(store.total_bytes() as u64)?;
        let (h, f) = (c.hidden, c.intermediate);
        let mat = |stems: &[&str], i: usize, shape: (usize, usize)| -> Result<W<B>> {
            let n = find(stems, i, ".weight").ok_or_else(|| missing(stems, i))?;
            src.require(be, &n, 0, shape)
        };
        // The blocks' matrices: an encoder's batches are bound by arithmetic, so the fast
        // path may multiply them in 8 bits.
        let layer_mat = |stems: &[&str], i: usize, shape: (usize, usize)| -> Result<W<B>> {
            let n = find(stems, i, ".weight").ok_or_else(|| missing(stems, i))?;
            src.require_with(be, &n, 0, shape, |t| be.load_weight_compute(t))
        };
        let bias = |stems: &[&str], i: usize, len: usize| -> Result<Option<W<B>>> {
            match find(stems, i, ".bias") {
                Some(n) => Ok(Some(src.require(be, &n, 0, (1, len))?)),
                None => Ok(None),
            }
        };
        let norm = |stems: &[&str], i: usize| -> Result<Option<Norm>> {
            let Some(w) = find(stems, i, ".weight") else {
                return Ok(None);
            };
            Ok(Some(Norm {
                weight: src.vector(&w, 0, h)?,
                bias: match find(stems, i, ".bias") {
                    Some(b) => src.vector(&b, 0, h)?,
                    None => vec![0.0; h],
                },
            }))
        };
        // Gemma's RMSNorm weights are `1 + w` in a Hugging Face file, as stored in a GGUF.
        let rms_offset = if gguf { 0.0 } else { 1.0 };
        let rms = |stems: &[&str], i: usize, len: usize| -> Result<W<B>> {
            let n = find(stems, i, ".weight").ok_or_else(|| missing(stems, i))?;
            src.norm(be, &n, 0, len, rms_offset)
        };
        let block_norm = |stems: &[&str], i: usize| -> Result<Option<BlockNorm<W<B>>>> {
            if c.rms {
                return match find(stems, i, ".weight") {
                    Some(_) => Ok(Some(BlockNorm::Rms(rms(stems, i, h)?))),
                    None => Ok(None),
                };
            }
            Ok(norm(stems, i)?.map(BlockNorm::Layer))
        };
        let need_block_norm =
            |stems: &[&str], i: usize| block_norm(stems, i)?.ok_or_else(|| missing(stems, i));
        let word = mat(lay.word, 0, (c.vocab, h))?;
        let position = if c.rope_theta.is_some() {
            None
        } else {
            Some(mat(lay.position, 0, (c.max_position, h))?)
        };
        let types = if c.type_vocab > 0 && find(lay.types, 0, ".weight").is_some() {
            Some(mat(lay.types, 0, (c.type_vocab, h))?)
        } else {
            None
        };
        let embed_norm = if lay.embed_norm.is_empty() {
            None
        } else {
            Some(norm(lay.embed_norm, 0)?.ok_or_else(|| missing(lay.embed_norm, 0))?)
        };
        let (hd, qw, kw) = (c.head_dim, c.q_width(), c.kv_width());
        let inv = |theta: f32| crate::config::inv_freq(theta, hd, None);
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let part = |stems: &[&str], rows: usize, col: usize| -> Result<Part<W<B>>> {
                Ok(Part {
                    w: layer_mat(stems, i, (rows, h))?,
                    bias: bias(stems, i, rows)?,
                    col,
                    width: rows,
                })
            };
            let qkv = if find(lay.qkv, i, ".weight").is_some() {
                vec![part(lay.qkv, qw + 2 * kw, 0)?]
            } else {
                vec![
                    part(lay.q, qw, 0)?,
                    part(lay.k, kw, qw)?,
                    part(lay.v, kw, qw + kw)?,
                ]
            };
            let up = match c.ffn {
                FfnKind::Gelu => vec![part(lay.up, f, 0)?],
                FfnKind::Glu(_) if find(lay.gate, i, ".weight").is_some() => {
                    vec![part(lay.gate, f, 0)?, part(lay.up, f, f)?]
                }
                FfnKind::Glu(_) => vec![part(lay.up, 2 * f, 0)?],
            };
            let window = c.window_of(i);
            layers.push(Layer {
                qkv,
                o: layer_mat(lay.o, i, (h, qw))?,
                o_bias: bias(lay.o, i, h)?,
                attn_norm: if c.prenorm {
                    block_norm(lay.attn_norm, i)?
                } else {
                    Some(need_block_norm(lay.attn_norm, i)?)
                },
                up,
                down: layer_mat(lay.down, i, (h, f))?,
                down_bias: bias(lay.down, i, h)?,
                ffn_norm: need_block_norm(lay.ffn_norm, i)?,
                gemma: if c.rms {
                    Some(GemmaNorms {
                        post_attn: rms(lay.post_attn_norm, i, h)?,
                        post_ffn: rms(lay.post_ffn_norm, i, h)?,
                        q: rms(lay.q_norm, i, hd)?,
                        k: rms(lay.k_norm, i, hd)?,
                    })
                } else {
                    None
                },
                window,
                inv_freq: c.rope_theta.map(|t| match (window, &c.local) {
                    (Some(_), Some(l)) => inv(l.theta),
                    _ => inv(t),
                }),
            });
        }
        let final_norm = if c.prenorm {
            Some(need_block_norm(lay.final_norm, 0)?)
        } else {
            None
        };
        let classifier = match c.labels {
            None => None,
            Some(labels) if c.family == Family::ModernBert => {
                Some(modernbert::classifier(&src, be, labels, h)?)
            }
            Some(labels) => Some(bert::classifier(&src, be, gguf, prefix, labels, h)?),
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
            final_norm,
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
            // A model without a token-type table (ModernBERT, Gemma) ignores the segments.
            if let Some(t) = x.types.filter(|_| self.types.is_some()) {
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
            if self.config.classifier_mean {
                let rows = (s.len() / h).max(1);
                let mut mean = vec![0f32; h];
                for r in s.chunks_exact(h) {
                    mean.iter_mut().zip(r).for_each(|(m, v)| *m += v);
                }
                mean.iter_mut().for_each(|m| *m /= rows as f32);
                be.write(&mut first, i * h, &mean);
            } else {
                be.write(&mut first, i * h, &s[..h]);
            }
        }
        let pooled = match &cl.dense {
            Some((w, b)) => {
                let mut pooled = be.alloc(n * h);
                be.matmul(
                    &first,
                    Rows::dense(n, h),
                    w,
                    b.as_ref(),
                    &mut pooled,
                    Rows::dense(n, h),
                );
                be.sync()?;
                let mut p = vec![0f32; n * h];
                be.read(&pooled, 0, &mut p);
                match &cl.gelu_norm {
                    Some(norm) => {
                        for row in p.chunks_exact_mut(h) {
                            ferrum_backend::host_ops::gelu_erf(row);
                            ferrum_backend::host_ops::layer_norm_row(
                                row,
                                &norm.weight,
                                &norm.bias,
                                self.config.eps,
                            );
                        }
                    }
                    None => p.iter_mut().for_each(|v| *v = v.tanh()),
                }
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
            cl.out_bias.as_ref(),
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
        // Local layers keep long sequences' keys twice: in order, and reversed.
        let copies = if c.local.is_some() { 2 } else { 1 };
        let shape = KvShape {
            blocks: blocks * copies,
            block_size: BLOCK,
            heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        let qkv = c.q_width() + 2 * c.kv_width();
        let gated = matches!(c.ffn, FfnKind::Glu(_));
        Scratch {
            x: be.alloc(tokens * c.hidden),
            y: be.alloc(if c.prenorm { tokens * c.hidden } else { 1 }),
            tmp: be.alloc(tokens * c.hidden),
            qkv: be.alloc(tokens * qkv),
            rev: be.alloc(if c.local.is_some() { tokens * qkv } else { 1 }),
            attn: be.alloc(tokens * c.q_width()),
            ffn: be.alloc(tokens * c.intermediate * if gated { 2 } else { 1 }),
            act: be.alloc(if gated { tokens * c.intermediate } else { 1 }),
            k: be.alloc_kv(shape),
            v: be.alloc_kv(shape),
        }
    }

    fn pass(&self, inputs: &[Input], s: &mut Scratch<B>) -> Result<Vec<Vec<f32>>> {
        let Scratch {
            x,
            y,
            tmp,
            qkv,
            rev,
            attn,
            ffn,
            act,
            k: k_cache,
            v: v_cache,
        } = s;
        let c = &self.config;
        let be = &self.backend;
        let (h, f, hd) = (c.hidden, c.intermediate, c.head_dim);
        let (qw, kw) = (c.q_width(), c.kv_width());
        let n: usize = inputs.iter().map(|x| x.ids.len()).sum();
        let ids: Vec<u32> = inputs.iter().flat_map(|x| x.ids.iter().copied()).collect();
        let positions: Vec<u32> = inputs
            .iter()
            .flat_map(|x| (0..x.ids.len()).map(|p| (p + c.position_offset) as u32))
            .collect();
        let hidden = Rows::dense(n, h);
        be.embed(&self.word, &ids, x, hidden);
        if let Some(e) = c.embed_scale {
            be.scale_inplace(x, hidden, e);
        }
        if let Some(position) = &self.position {
            be.embed(position, &positions, tmp, hidden);
            be.add_inplace(x, hidden, tmp, hidden);
        }
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
        if let Some(norm) = &self.embed_norm {
            be.layer_norm(x, hidden, &norm.weight, &norm.bias, c.eps);
        }

        // Each sequence's blocks, consecutive (then, for local layers, as many again for
        // its keys in reverse order).
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(inputs.len());
        let mut next = 0u32;
        for x in inputs {
            let blocks = x.ids.len().div_ceil(BLOCK) as u32;
            tables.push((next..next + blocks).collect());
            next += blocks;
        }
        let rev_tables: Vec<Vec<u32>> = tables
            .iter()
            .map(|t| t.iter().map(|b| b + next).collect())
            .collect();
        let write_seqs: Vec<AttnSeq> = inputs
            .iter()
            .zip(&tables)
            .map(|(x, t)| AttnSeq {
                rows: x.ids.len(),
                first_pos: 0,
                table: kv_table(t),
            })
            .collect();
        // Global layers: each query row a one-row sequence at the last position, so it
        // attends to every key of its sequence.
        let global_seqs: Vec<AttnSeq> = write_seqs
            .iter()
            .flat_map(|s| {
                (0..s.rows).map(move |_| AttnSeq {
                    rows: 1,
                    first_pos: s.rows - 1,
                    table: s.table,
                })
            })
            .collect();
        // Local layers (keys within `w` either side) through the causal window `2w + 1`:
        // row `p` of `n` sits at `p + w` when that is a key; else, when `p ≥ w`, at `n-1-p+w`
        // over the keys reversed (it sees reversed `0..`, which are `p - w ..= n - 1`); else
        // (both edges past the ends) at `n - 1`, seeing all.
        let half = c.local.as_ref().map_or(0, |l| l.half);
        let local_seqs: Vec<AttnSeq> = write_seqs
            .iter()
            .zip(&rev_tables)
            .flat_map(|(s, rt)| {
                let n = s.rows;
                (0..n).map(move |p| {
                    let (first_pos, t) = if p + half < n {
                        (p + half, s.table)
                    } else if p >= half {
                        (n - 1 - p + half, kv_table(rt))
                    } else {
                        (n - 1, s.table)
                    };
                    AttnSeq {
                        rows: 1,
                        first_pos,
                        table: t,
                    }
                })
            })
            .collect();
        // Rows of the sequences some row of which reads the reversed keys (`n > w`).
        let mut rev_rows: Vec<u32> = Vec::new();
        let mut rev_seqs = Vec::new();
        if c.local.is_some() {
            let mut row = 0usize;
            for (s, rt) in write_seqs.iter().zip(&rev_tables) {
                if s.rows > half {
                    rev_seqs.push((rev_rows.len(), s.rows, kv_table(rt)));
                    rev_rows.extend((row..row + s.rows).rev().map(|r| r as u32));
                }
                row += s.rows;
            }
        }
        let params = |window: Option<usize>| AttentionParams {
            n_kv_heads: c.kv_heads,
            scale: c.attn_scale,
            window: window.map(|w| 2 * w + 1),
            softcap: None,
            sinks: None,
        };

        let w3 = qw + 2 * kw;
        let q_cols = Rows::columns(n, w3, 0, qw);
        let k_cols = Rows::columns(n, w3, qw, kw);
        let v_cols = Rows::columns(n, w3, qw + kw, kw);
        let (q_view, k_view) = (q_cols.split_heads(hd), k_cols.split_heads(hd));
        let gated = match c.ffn {
            FfnKind::Glu(a) => Some(a),
            FfnKind::Gelu => None,
        };
        let ffn_view = Rows::dense(n, if gated.is_some() { 2 * f } else { f });
        let act_view = Rows::dense(n, f);
        let attn_view = Rows::dense(n, qw).split_heads(hd);
        for l in &self.layers {
            // Pre-norm: the sublayer reads a normed copy; post-norm: `x` itself.
            let input: &B::Buf = match (&l.attn_norm, c.prenorm) {
                (Some(norm), true) => {
                    norm.apply_into(be, x, hidden, y, c.eps);
                    y
                }
                _ => x,
            };
            be.matmul_many(input, hidden, &parts(&l.qkv, n, w3), qkv);
            if let Some(g) = &l.gemma {
                be.rms_norm_inplace(qkv, q_view, &g.q, c.eps);
                be.rms_norm_inplace(qkv, k_view, &g.k, c.eps);
            }
            if let Some(inv_freq) = &l.inv_freq {
                let rope = RopeParams {
                    layout: RopeLayout::Neox,
                    inv_freq,
                    factor: 1.0,
                };
                be.rope(qkv, q_view, &positions, rope);
                be.rope(qkv, k_view, &positions, rope);
            }
            let mut row = 0;
            for s in &write_seqs {
                be.write_kv(qkv, k_view.slice(row, s.rows), k_cache, s.table, 0);
                be.write_kv(qkv, v_cols.slice(row, s.rows), v_cache, s.table, 0);
                row += s.rows;
            }
            if l.window.is_some() && !rev_rows.is_empty() {
                let m = rev_rows.len();
                be.gather_rows(qkv, Rows::dense(n, w3), &rev_rows, rev, Rows::dense(m, w3));
                let rk = Rows::columns(m, w3, qw, kw).split_heads(hd);
                let rv = Rows::columns(m, w3, qw + kw, kw);
                for &(start, len, t) in &rev_seqs {
                    be.write_kv(rev, rk.slice(start, len), k_cache, t, 0);
                    be.write_kv(rev, rv.slice(start, len), v_cache, t, 0);
                }
            }
            let seqs = if l.window.is_some() {
                &local_seqs
            } else {
                &global_seqs
            };
            be.attention(
                qkv,
                q_view,
                k_cache,
                v_cache,
                seqs,
                attn,
                attn_view,
                params(l.window),
            );
            be.matmul(
                attn,
                Rows::dense(n, qw),
                &l.o,
                l.o_bias.as_ref(),
                tmp,
                hidden,
            );
            if let Some(g) = &l.gemma {
                be.rms_norm_inplace(tmp, hidden, &g.post_attn, c.eps);
            }
            be.add_inplace(x, hidden, tmp, hidden);
            if let (Some(norm), false) = (&l.attn_norm, c.prenorm) {
                norm.apply(be, x, hidden, c.eps);
            }
            let input: &B::Buf = if c.prenorm {
                l.ffn_norm.apply_into(be, x, hidden, y, c.eps);
                y
            } else {
                x
            };
            be.matmul_many(input, hidden, &parts(&l.up, n, ffn_view.width()), ffn);
            match gated {
                Some(a) => {
                    be.glu(ffn, ffn_view, act, act_view, a);
                    be.matmul(act, act_view, &l.down, l.down_bias.as_ref(), tmp, hidden);
                }
                None => {
                    be.gelu(ffn, ffn_view);
                    be.matmul(ffn, ffn_view, &l.down, l.down_bias.as_ref(), tmp, hidden);
                }
            }
            if let Some(g) = &l.gemma {
                be.rms_norm_inplace(tmp, hidden, &g.post_ffn, c.eps);
            }
            be.add_inplace(x, hidden, tmp, hidden);
            if !c.prenorm {
                l.ffn_norm.apply(be, x, hidden, c.eps);
            }
        }
        if let Some(norm) = &self.final_norm {
            norm.apply(be, x, hidden, c.eps);
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

fn kv_table(blocks: &[u32]) -> KvTable<'_> {
    KvTable {
        blocks,
        block_size: BLOCK,
    }
}

/// A block's matrices as one `matmul_many` into a `width`-wide output of `n` rows.
fn parts<W>(ps: &[Part<W>], n: usize, width: usize) -> Vec<MatmulPart<'_, W>> {
    ps.iter()
        .map(|p| MatmulPart {
            weight: &p.w,
            bias: p.bias.as_ref(),
            out: Rows::columns(n, width, p.col, p.width),
        })
        .collect()
}
