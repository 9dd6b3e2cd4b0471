//! The shared decoder: weights of a Llama-style transformer, the activation buffers it runs
//! in (allocated once, sized for one chunk of tokens), its KV cache, and the forward pass
//! written once against the [`Backend`] trait. Variants (QKV bias, QK-norm, RoPE layout,
//! tied output head, the FFN kind) are fixed at load time; the forward pass does not probe
//! for features.
//!
//! Per layer: RMSNorm → Q, K, V projections into one buffer → QK-norm (Qwen3) → RoPE → K and
//! V written into the cache → causal GQA attention → O projection → residual add fused with
//! the FFN's RMSNorm → SwiGLU FFN → residual add.

use ferrum_backend::{
    AttentionParams, AttnSeq, Backend, KvShape, KvTable, MatmulPart, MoeScratch, RopeParams, Rows,
};
use ferrum_core::{Error, Result};
use ferrum_loader::TensorStore;

use crate::config::{ModelConfig, RopeScaling};
use crate::moe::{MoeLayer, Router};
use crate::names;

/// How many tokens one pass through the layers carries; longer inputs go in chunks.
pub const CHUNK: usize = 64;

/// Positions per KV block unless the caller picks another size.
pub const BLOCK_SIZE: usize = 16;

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// Only the last token (generation).
    Last,
    /// Every token (scoring, perplexity, comparison against a reference).
    All,
}

/// Looks tensors up by Hugging Face name in either kind of file.
pub struct WeightSource<'a> {
    pub store: &'a TensorStore,
    pub gguf: bool,
}

impl WeightSource<'_> {
    pub fn name(&self, hf: &str, layer: usize) -> String {
        if self.gguf {
            names::gguf_name(hf, layer).unwrap_or_else(|| hf.to_string())
        } else {
            hf.replace("{i}", &layer.to_string())
        }
    }

    pub fn get<B: Backend>(&self, be: &B, hf: &str, layer: usize) -> Result<Option<B::Weight>> {
        let name = self.name(hf, layer);
        match self.store.get(&name) {
            Some(t) => Ok(Some(be.load_weight(t)?)),
            None => Ok(None),
        }
    }

    /// A tensor that must exist, with its expected `(rows, cols)` checked.
    pub fn require<B: Backend>(
        &self,
        be: &B,
        hf: &str,
        layer: usize,
        shape: (usize, usize),
    ) -> Result<B::Weight> {
        let name = self.name(hf, layer);
        let w = self
            .get(be, hf, layer)?
            .ok_or_else(|| Error::Weights(format!("missing tensor {name:?}")))?;
        let got = be.weight_shape(&w);
        if got != shape {
            return Err(Error::Weights(format!(
                "tensor {name:?} has shape {got:?}, expected {shape:?}"
            )));
        }
        Ok(w)
    }
}

pub enum Ffn<B: Backend> {
    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    Dense {
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
    },
    /// Mixture of experts (Qwen3-MoE).
    Moe(MoeLayer<B>),
}

pub struct Layer<B: Backend> {
    attn_norm: B::Weight,
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    qkv_bias: Option<[B::Weight; 3]>,
    qk_norm: Option<[B::Weight; 2]>,
    o: B::Weight,
    ffn_norm: B::Weight,
    ffn: Ffn<B>,
}

/// Keys and values of every layer, `block_size` rows to a block. Sequences find their rows
/// through block tables; the engine's block pool decides who owns which block.
pub struct KvCache<B: Backend> {
    k: Vec<B::KvBuf>,
    v: Vec<B::KvBuf>,
    pub block_size: usize,
    pub n_blocks: usize,
    /// `0, 1, 2, …`: the table of a single sequence that owns the whole cache.
    identity: Vec<u32>,
}

impl<B: Backend> KvCache<B> {
    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.block_size * self.n_blocks
    }
}

/// One sequence's share of a forward pass: `tokens` at positions `start..`, its cache rows
/// found through `blocks`, and which of its positions need logits.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub blocks: &'a [u32],
    pub logits: Logits,
}

/// Activation buffers for one pass of at most [`CHUNK`] tokens. Allocated once at load.
struct State<B: Backend> {
    x: B::Buf,
    xn: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    tmp: B::Buf,
    gu: B::Buf,
    act: B::Buf,
    logits: B::Buf,
    moe: Option<MoeState<B>>,
}

/// Buffers and host-side routing state of the MoE layers.
struct MoeState<B: Backend> {
    router_logits: B::Buf,
    host_logits: Vec<f32>,
    scratch: MoeScratch<B::Buf>,
    router: Router,
    /// Tokens each expert received, per layer (zero for dense layers).
    counts: Vec<Vec<u64>>,
    /// Wall time spent in the expert FFNs (routing excluded).
    expert_secs: f64,
}

pub struct Decoder<B: Backend> {
    pub config: ModelConfig,
    backend: B,
    embed: B::Weight,
    /// `None` when the output head is tied to the embedding.
    lm_head: Option<B::Weight>,
    final_norm: B::Weight,
    layers: Vec<Layer<B>>,
    inv_freq: Vec<f32>,
    /// The longest sequence this decoder will run (positions), whatever the cache holds.
    pub context: usize,
    state: State<B>,
}

impl<B: Backend> Decoder<B> {
    /// Loads the weights named in [`names::DECODER`]. `context` is the longest sequence the
    /// caller may run.
    pub fn load(
        backend: B,
        mut config: ModelConfig,
        src: &WeightSource,
        context: usize,
    ) -> Result<Self> {
        let c = &config;
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let be = &backend;
        let embed = src.require(be, "model.embed_tokens.weight", 0, (c.vocab_size, h))?;
        let lm_head = if c.tie_embeddings {
            None
        } else {
            match src.get(be, "lm_head.weight", 0)? {
                Some(w) => {
                    if be.weight_shape(&w) != (c.vocab_size, h) {
                        return Err(Error::Weights("output head has the wrong shape".into()));
                    }
                    Some(w)
                }
                // Some exporters drop the head of a tied model without saying so.
                None => None,
            }
        };
        let final_norm = src.require(be, "model.norm.weight", 0, (1, h))?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let l = |name: &str, shape| src.require(be, name, i, shape);
            let qkv_bias = if c.qkv_bias {
                Some([
                    l("model.layers.{i}.self_attn.q_proj.bias", (1, qd))?,
                    l("model.layers.{i}.self_attn.k_proj.bias", (1, kvd))?,
                    l("model.layers.{i}.self_attn.v_proj.bias", (1, kvd))?,
                ])
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                Some([
                    l("model.layers.{i}.self_attn.q_norm.weight", (1, c.head_dim))?,
                    l("model.layers.{i}.self_attn.k_norm.weight", (1, c.head_dim))?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: l("model.layers.{i}.input_layernorm.weight", (1, h))?,
                q: l("model.layers.{i}.self_attn.q_proj.weight", (qd, h))?,
                k: l("model.layers.{i}.self_attn.k_proj.weight", (kvd, h))?,
                v: l("model.layers.{i}.self_attn.v_proj.weight", (kvd, h))?,
                qkv_bias,
                qk_norm,
                o: l("model.layers.{i}.self_attn.o_proj.weight", (h, qd))?,
                ffn_norm: l("model.layers.{i}.post_attention_layernorm.weight", (1, h))?,
                ffn: match &c.moe {
                    Some(m) if m.is_moe_layer(i) => Ffn::Moe(MoeLayer::load(be, src, i, c, m)?),
                    _ => Ffn::Dense {
                        gate: l("model.layers.{i}.mlp.gate_proj.weight", (f, h))?,
                        up: l("model.layers.{i}.mlp.up_proj.weight", (f, h))?,
                        down: l("model.layers.{i}.mlp.down_proj.weight", (h, f))?,
                    },
                },
            });
        }
        if let Some(t) = src.store.get(&src.name("rope_freqs.weight", 0)) {
            let mut v = vec![0f32; t.numel()];
            if t.dtype != ferrum_core::DType::F32
                || t.bytes().len() != 4 * v.len()
                || v.len() != c.head_dim / 2
            {
                return Err(Error::Weights(
                    "rope_freqs.weight must be F32 [head_dim/2]".into(),
                ));
            }
            for (o, b) in v.iter_mut().zip(t.bytes().chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            config.rope_scaling = Some(RopeScaling::Factors(v));
        }
        let c = &config;
        let context = context.max(1);
        let state = State {
            x: be.alloc(CHUNK * h),
            xn: be.alloc(CHUNK * h),
            qkv: be.alloc(CHUNK * (qd + 2 * kvd)),
            attn: be.alloc(CHUNK * qd),
            tmp: be.alloc(CHUNK * h),
            gu: be.alloc(CHUNK * 2 * f),
            act: be.alloc(CHUNK * f),
            // Grown on demand: generation needs one row, scoring a whole chunk.
            logits: be.alloc(c.vocab_size),
            moe: c.moe.as_ref().map(|m| MoeState {
                router_logits: be.alloc(CHUNK * m.n_experts),
                host_logits: vec![0.0; CHUNK * m.n_experts],
                scratch: MoeScratch {
                    x: be.alloc(CHUNK * h),
                    gu: be.alloc(CHUNK * 2 * m.expert_ffn),
                    act: be.alloc(CHUNK * m.expert_ffn),
                    y: be.alloc(CHUNK * h),
                },
                router: Router::new(m),
                counts: vec![vec![0; m.n_experts]; c.n_layers],
                expert_secs: 0.0,
            }),
        };
        Ok(Decoder {
            inv_freq: config.rope_inv_freq(),
            config,
            backend,
            embed,
            lm_head,
            final_norm,
            layers,
            context,
            state,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// For MoE models: how many tokens each expert has received, per layer, since load or
    /// the last [`Decoder::reset_expert_stats`].
    pub fn expert_stats(&self) -> Option<&[Vec<u64>]> {
        self.state.moe.as_ref().map(|m| m.counts.as_slice())
    }

    /// Seconds spent in the expert FFNs since load or the last reset.
    pub fn expert_secs(&self) -> Option<f64> {
        self.state.moe.as_ref().map(|m| m.expert_secs)
    }

    pub fn reset_expert_stats(&mut self) {
        if let Some(m) = self.state.moe.as_mut() {
            m.counts.iter_mut().for_each(|c| c.fill(0));
            m.expert_secs = 0.0;
        }
    }

    /// A KV cache of `n_blocks` blocks of `block_size` positions for every layer.
    pub fn alloc_kv(&self, n_blocks: usize, block_size: usize) -> KvCache<B> {
        let block_size = block_size.max(1);
        let shape = KvShape {
            blocks: n_blocks,
            block_size,
            heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
        };
        let be = &self.backend;
        let layers = self.config.n_layers;
        KvCache {
            k: (0..layers).map(|_| be.alloc_kv(shape)).collect(),
            v: (0..layers).map(|_| be.alloc_kv(shape)).collect(),
            block_size,
            n_blocks,
            identity: (0..n_blocks as u32).collect(),
        }
    }

    /// A cache for one sequence of up to `tokens` positions (see [`Decoder::forward`]).
    pub fn alloc_kv_tokens(&self, tokens: usize) -> KvCache<B> {
        self.alloc_kv(tokens.max(1).div_ceil(BLOCK_SIZE), BLOCK_SIZE)
    }

    /// Bytes of cache one position takes across all layers (keys and values).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.config.n_layers * self.backend.kv_row_bytes(self.config.kv_dim())
    }

    /// Runs one sequence that owns the whole of `kv` (scoring, benchmarks, tests): `tokens`
    /// sit at positions `start..start + tokens.len()`, the first `start` positions already
    /// cached. Returns row-major logits for the positions `want` asks for.
    pub fn forward(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        want: Logits,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.run_alone(kv, tokens, start, want, |_, _, logits| {
            out.extend_from_slice(&logits)
        })?;
        Ok(out)
    }

    /// Runs `tokens` as one sequence owning the whole of `kv`, a chunk per pass, calling
    /// `after(self, chunk, logits)` after each pass (the chunk's hidden states are then in the
    /// residual buffer).
    fn run_alone(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        want: Logits,
        mut after: impl FnMut(&mut Self, &[u32], Vec<f32>),
    ) -> Result<()> {
        // Taken out for the duration, so the table can be borrowed while `kv` is written.
        let blocks = std::mem::take(&mut kv.identity);
        let end = start + tokens.len();
        let mut pos = start;
        let mut result = Ok(());
        for chunk in tokens.chunks(CHUNK) {
            let logits = match want {
                Logits::Last if pos + chunk.len() < end => Logits::None,
                w => w,
            };
            let seq = SeqChunk {
                tokens: chunk,
                start: pos,
                blocks: &blocks,
                logits,
            };
            match self.forward_batch(kv, &[seq]) {
                Ok(l) => after(self, chunk, l),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            pos += chunk.len();
        }
        kv.identity = blocks;
        result
    }

    /// The mean over positions of the final-normalised hidden states of `tokens`, run as one
    /// fresh sequence owning `kv` (sentence embeddings).
    pub fn pooled_hidden(&mut self, kv: &mut KvCache<B>, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.config.hidden_size;
        let mut sum = vec![0f64; h];
        let mut host = Vec::new();
        self.run_alone(kv, tokens, 0, Logits::None, |d, chunk, _| {
            let rows = Rows::dense(chunk.len(), h);
            let s = &mut d.state;
            let be = &d.backend;
            be.rms_norm(&s.x, rows, &d.final_norm, d.config.rms_eps, &mut s.xn, rows);
            host.resize(chunk.len() * h, 0.0);
            be.read(&s.xn, 0, &mut host);
            for row in host.chunks_exact(h) {
                for (a, &b) in sum.iter_mut().zip(row) {
                    *a += b as f64;
                }
            }
        })?;
        let n = tokens.len().max(1) as f64;
        Ok(sum.iter().map(|&v| (v / n) as f32).collect())
    }

    /// Runs one pass over a batch of sequences (prefill chunks and decode tokens alike), at
    /// most [`CHUNK`] tokens in all. Returns, row-major and in batch order, the logits each
    /// sequence asked for. A sequence's numbers do not depend on what else is in the batch:
    /// every op works row by row, and attention sequence by sequence.
    pub fn forward_batch(&mut self, kv: &mut KvCache<B>, seqs: &[SeqChunk]) -> Result<Vec<f32>> {
        let rows = self.forward_rows(kv, seqs)?;
        let mut out = Vec::new();
        self.logits_rows(rows, &mut out);
        Ok(out)
    }

    /// [`forward_batch`](Self::forward_batch)'s logits where they lie: in the backend's own
    /// buffer when it is host memory (no copy of the vocabulary-sized rows, which costs a
    /// decode step about 13 µs per sequence on the CPU), else copied into `spare` (a caller's
    /// buffer kept across steps: the rows are vocabulary-sized).
    pub fn forward_batch_view<'a>(
        &'a mut self,
        kv: &mut KvCache<B>,
        seqs: &[SeqChunk],
        spare: &'a mut Vec<f32>,
    ) -> Result<&'a [f32]> {
        let rows = self.forward_rows(kv, seqs)?;
        let len = rows * self.config.vocab_size;
        if rows > 0 {
            if let Some(v) = self.backend.host_view(&self.state.logits, 0, len) {
                return Ok(v);
            }
        }
        self.logits_rows(rows, spare);
        Ok(&spare[..])
    }

    /// The pass itself: leaves the logits of the rows that asked in `state.logits` and
    /// returns how many rows that is.
    fn forward_rows(&mut self, kv: &mut KvCache<B>, seqs: &[SeqChunk]) -> Result<usize> {
        let vocab = self.config.vocab_size;
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if n > CHUNK {
            return Err(Error::InvalidRequest(format!(
                "a pass carries at most {CHUNK} tokens, got {n}"
            )));
        }
        if kv.k.len() != self.config.n_layers {
            return Err(Error::InvalidRequest("KV cache of another model".into()));
        }
        let mut tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut want_rows = Vec::new();
        for s in seqs {
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::InvalidRequest(format!(
                    "token id {bad} is outside the vocabulary ({vocab} tokens)"
                )));
            }
            let end = s.start + s.tokens.len();
            if end > self.context {
                return Err(Error::InvalidRequest(format!(
                    "sequence of {end} tokens exceeds the context of {} tokens",
                    self.context
                )));
            }
            if end > s.blocks.len() * kv.block_size
                || s.blocks.iter().any(|&b| b as usize >= kv.n_blocks)
            {
                return Err(Error::InvalidRequest(format!(
                    "sequence of {end} tokens does not fit its {} KV blocks",
                    s.blocks.len()
                )));
            }
            let row = tokens.len();
            let m = s.tokens.len();
            match s.logits {
                Logits::None => {}
                Logits::Last if m > 0 => want_rows.push((row + m - 1) as u32),
                Logits::Last => {}
                Logits::All => want_rows.extend((row..row + m).map(|r| r as u32)),
            }
            tokens.extend_from_slice(s.tokens);
            positions.extend((s.start..end).map(|p| p as u32));
        }
        if n == 0 {
            return Ok(0);
        }
        self.run_layers(kv, &tokens, &positions, seqs)?;
        self.head(n, &want_rows);
        Ok(want_rows.len())
    }

    fn run_layers(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        positions: &[u32],
        seqs: &[SeqChunk],
    ) -> Result<()> {
        let c = &self.config;
        let be = &self.backend;
        let s = &mut self.state;
        let n = tokens.len();
        let (h, qd, kvd, f, hd) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.head_dim,
        );
        let qkv_w = qd + 2 * kvd;
        let rope = RopeParams {
            layout: c.rope_layout,
            inv_freq: &self.inv_freq,
        };
        let hidden = Rows::dense(n, h);
        let q_view = Rows::columns(n, qkv_w, 0, qd).split_heads(hd);
        let k_view = Rows::columns(n, qkv_w, qd, kvd).split_heads(hd);
        let v_view = Rows::columns(n, qkv_w, qd + kvd, kvd);

        let attn_seqs: Vec<AttnSeq> = seqs
            .iter()
            .map(|q| AttnSeq {
                rows: q.tokens.len(),
                first_pos: q.start,
                table: KvTable {
                    blocks: q.blocks,
                    block_size: kv.block_size,
                },
            })
            .collect();
        be.embed(&self.embed, tokens, &mut s.x, hidden);
        for (li, layer) in self.layers.iter().enumerate() {
            if li == 0 {
                be.rms_norm(&s.x, hidden, &layer.attn_norm, c.rms_eps, &mut s.xn, hidden);
            }
            let bias = layer.qkv_bias.as_ref();
            be.matmul_many(
                &s.xn,
                hidden,
                &[
                    MatmulPart {
                        weight: &layer.q,
                        bias: bias.map(|b| &b[0]),
                        out: Rows::columns(n, qkv_w, 0, qd),
                    },
                    MatmulPart {
                        weight: &layer.k,
                        bias: bias.map(|b| &b[1]),
                        out: Rows::columns(n, qkv_w, qd, kvd),
                    },
                    MatmulPart {
                        weight: &layer.v,
                        bias: bias.map(|b| &b[2]),
                        out: v_view,
                    },
                ],
                &mut s.qkv,
            );
            if let Some([qn, kn]) = &layer.qk_norm {
                be.rms_norm_inplace(&mut s.qkv, q_view, qn, c.rms_eps);
                be.rms_norm_inplace(&mut s.qkv, k_view, kn, c.rms_eps);
            }
            be.rope(&mut s.qkv, q_view, positions, rope);
            be.rope(&mut s.qkv, k_view, positions, rope);
            let attn_view = Rows::dense(n, qd).split_heads(hd);
            let mut row = 0;
            for a in &attn_seqs {
                let (ks, vs) = (k_view.slice(row, a.rows), v_view.slice(row, a.rows));
                be.write_kv(&s.qkv, ks, &mut kv.k[li], a.table, a.first_pos);
                be.write_kv(&s.qkv, vs, &mut kv.v[li], a.table, a.first_pos);
                row += a.rows;
            }
            be.attention(
                &s.qkv,
                q_view,
                &kv.k[li],
                &kv.v[li],
                &attn_seqs,
                &mut s.attn,
                attn_view,
                AttentionParams {
                    n_kv_heads: c.n_kv_heads,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window: c.sliding_window,
                    softcap: None,
                },
            );
            be.matmul(
                &s.attn,
                Rows::dense(n, qd),
                &layer.o,
                None,
                &mut s.tmp,
                hidden,
            );
            be.add_rms_norm(
                &mut s.x,
                hidden,
                &s.tmp,
                hidden,
                &layer.ffn_norm,
                c.rms_eps,
                &mut s.xn,
                hidden,
            );
            match &layer.ffn {
                Ffn::Dense { gate, up, down } => {
                    be.matmul_many(
                        &s.xn,
                        hidden,
                        &[
                            MatmulPart {
                                weight: gate,
                                bias: None,
                                out: Rows::columns(n, 2 * f, 0, f),
                            },
                            MatmulPart {
                                weight: up,
                                bias: None,
                                out: Rows::columns(n, 2 * f, f, f),
                            },
                        ],
                        &mut s.gu,
                    );
                    be.swiglu_matmul(
                        &s.gu,
                        Rows::dense(n, 2 * f),
                        &mut s.act,
                        Rows::dense(n, f),
                        down,
                        &mut s.tmp,
                        hidden,
                    );
                }
                Ffn::Moe(moe) => {
                    let ms = s
                        .moe
                        .as_mut()
                        .ok_or_else(|| Error::Weights("MoE layer without MoE state".into()))?;
                    let ne = moe.experts.len();
                    be.matmul(
                        &s.xn,
                        hidden,
                        &moe.router,
                        None,
                        &mut ms.router_logits,
                        Rows::dense(n, ne),
                    );
                    be.read(&ms.router_logits, 0, &mut ms.host_logits[..n * ne]);
                    ms.router
                        .route(&ms.host_logits[..n * ne], n, &mut ms.counts[li]);
                    let batches = ms.router.batches();
                    let t0 = std::time::Instant::now();
                    be.moe_ffn(
                        &s.xn,
                        hidden,
                        &moe.experts,
                        &batches,
                        &mut ms.scratch,
                        &mut s.tmp,
                        hidden,
                    );
                    // Backends that run asynchronously will need a sync here to time this.
                    ms.expert_secs += t0.elapsed().as_secs_f64();
                }
            }
            // The next layer's input norm rides on this residual add; after the last layer
            // the residual stream is left unnormalised for the output head.
            match self.layers.get(li + 1) {
                Some(next) => be.add_rms_norm(
                    &mut s.x,
                    hidden,
                    &s.tmp,
                    hidden,
                    &next.attn_norm,
                    c.rms_eps,
                    &mut s.xn,
                    hidden,
                ),
                None => be.add_inplace(&mut s.x, hidden, &s.tmp, hidden),
            }
        }
        Ok(())
    }

    /// Final norm and output head for the residual rows `rows` of an `n`-row pass (gathered
    /// first, so the head's weights are read once for all of them), into `state.logits`.
    fn head(&mut self, n: usize, rows: &[u32]) {
        if rows.is_empty() {
            return;
        }
        let c = &self.config;
        let be = &self.backend;
        let s = &mut self.state;
        let (h, vocab, count) = (c.hidden_size, c.vocab_size, rows.len());
        let dst = Rows::dense(count, h);
        be.gather_rows(&s.x, Rows::dense(n, h), rows, &mut s.tmp, dst);
        be.rms_norm(&s.tmp, dst, &self.final_norm, c.rms_eps, &mut s.xn, dst);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if be.buf_len(&s.logits) < count * vocab {
            s.logits = be.alloc(count * vocab);
        }
        be.matmul(
            &s.xn,
            dst,
            head,
            None,
            &mut s.logits,
            Rows::dense(count, vocab),
        );
    }

    /// Copies the first `rows` rows of `state.logits` into `out` (its contents replaced).
    fn logits_rows(&self, rows: usize, out: &mut Vec<f32>) {
        // Truncate, not clear: only a growth is zero-filled before the copy overwrites it.
        out.truncate(rows * self.config.vocab_size);
        out.resize(rows * self.config.vocab_size, 0.0);
        if rows > 0 {
            self.backend.read(&self.state.logits, 0, out);
        }
    }
}
