//! The forward driver: the weights of a decoder (its layers built from [`crate::layers`]),
//! the activation buffers it runs in (allocated once, sized for one chunk of tokens), and
//! the pass over a batch of sequences, written once against the [`Backend`] trait. What
//! differs between families is fixed at load from the [`ModelConfig`]; the pass does not
//! probe for features.
//!
//! Per layer: \[norm\] → attention (QKV projection → QK-norm → RoPE → K and V written into
//! the cache → causal GQA attention → O projection) → \[post-norm\] → residual add (fused with
//! the next norm) → \[norm\] → FFN → \[post-norm\] → residual add. Bracketed norms are where the
//! family has them: Llama the two pre-norms, Gemma all four, OLMo 2 the two post-norms.

use ferrum_backend::{
    AttentionParams, AttnSeq, Backend, KvShape, KvTable, MoeScratch, RopeParams, Rows, StateSeq,
};
use ferrum_core::{Error, Result};

pub use crate::config::{KvGroups, NO_BLOCK};
use crate::config::{ModelConfig, Rope, RopeScaling};
pub use crate::layers::WeightSource;
use crate::layers::{
    dense_ffn, gated_ffn, qkv_width, Attend, AttnInputs, Ffn, GateUp, Layer, Mixer, PerLayerInput,
};
use crate::linear::DeltaBufs;
use crate::lora::{Adapter, LayerLora, LoraBufs, Run, Target};
use crate::mla::MlaBufs;
use crate::moe::{MoeLayer, Router};

/// How many tokens one pass through the layers carries; longer inputs go in chunks.
pub const CHUNK: usize = 64;

/// The pass of a model whose dense FFN matrices want longer passes
/// ([`Backend::long_prefill`]: the CPU's codebook formats, whose rows a prefill decodes once a
/// matrix product). On an Intel Emerald Rapids, the 1B-shape IQ2_XXS file's pp512 went from
/// 215–218 tok/s at 64 tokens a pass to 248–256 at 256 and 512; the IQ4_XS file's (packed
/// kernels, nothing decoded a pass) went from 230–255 to 197–226, so the others keep
/// [`CHUNK`].
pub const LONG_CHUNK: usize = 256;

/// The tokens a pass carries for a model whose dense FFN matrices do (`long`) or do not want
/// long passes: [`LONG_CHUNK`] or [`CHUNK`]. `ferrum plan` sizes its buffers by the same rule.
pub fn pass_tokens(long: bool) -> usize {
    if long {
        LONG_CHUNK
    } else {
        CHUNK
    }
}

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

/// Keys and values of every layer in blocks of `block_size` positions, each block holding
/// one KV group's layers (see [`KvGroups`]: one group of every layer for models without
/// windows). Sequences find their rows through a block table per group; the engine's block
/// pool decides who owns which block.
pub struct KvCache<B: Backend> {
    /// One buffer per slot of a group: slot `s` of a block belongs to the `s`-th layer of
    /// whichever group the block was handed to.
    k: Vec<B::KvBuf>,
    v: Vec<B::KvBuf>,
    pub block_size: usize,
    pub n_blocks: usize,
    /// The tables of a single sequence that owns the whole cache: the blocks split evenly
    /// between the groups, in order.
    identity: Vec<Vec<u32>>,
    /// Per linear-attention layer: the convolution's and the delta rule's state buffers,
    /// `state_slots` sequences' worth each (a sequence's slot is [`SeqChunk::state`]).
    states: Vec<(B::Buf, B::Buf)>,
    pub state_slots: usize,
}

impl<B: Backend> KvCache<B> {
    /// Positions one sequence owning the whole cache can reach.
    pub fn capacity(&self) -> usize {
        self.block_size * self.identity.first().map_or(0, Vec::len)
    }

    /// Copies recurrent-state slot `from` onto slot `to` in every linear-attention layer (a
    /// prefix's snapshot taken, or a sequence resumed from one). Nothing for models without
    /// such layers.
    pub fn copy_state(&mut self, be: &B, from: usize, to: usize) {
        if from == to || from >= self.state_slots || to >= self.state_slots {
            return;
        }
        for (conv, delta) in &mut self.states {
            for buf in [conv, delta] {
                let per = be.buf_len(buf) / self.state_slots;
                let row = |s: usize| Rows::columns(1, per, s * per, per);
                be.copy_within(buf, row(from), row(to));
            }
        }
    }
}

/// One sequence's share of a forward pass: `tokens` at positions `start..`, its cache rows
/// found through `tables` (one per KV group; a windowed group's entries before its window
/// may be [`NO_BLOCK`]), which of its positions need logits, and — for models with
/// linear-attention layers — its recurrent-state slot (which must hold the state after
/// position `start − 1`; a chunk at `start` 0 starts from zero).
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub tables: &'a [Vec<u32>],
    pub logits: Logits,
    pub state: usize,
    /// The LoRA adapter its rows go through: 0 for the base model, else the id
    /// [`Decoder::add_adapter`] gave.
    pub adapter: usize,
    /// Rows whose input is given instead of their token's embedding (an image's rows from
    /// a vision tower), in order of `row`.
    pub embeds: &'a [Embeds<'a>],
    /// The sequence's images (all of them, at their positions in the sequence) where the
    /// model has M-RoPE: they set the rotary positions of its rows ([`mrope_position`]).
    pub grids: &'a [ImageGrid],
}

/// An image's place in a sequence for M-RoPE (Qwen VL): its rows are positions `start..start
/// + h · w` of the sequence, an `h × w` grid of merged patches in row-major order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageGrid {
    pub start: usize,
    pub h: usize,
    pub w: usize,
}

/// The (time, height, width) rotary positions of position `p` of a sequence whose images sit
/// at `grids` (in order), as transformers' `get_rope_index` gives them: text counts on from
/// the last position used, an image's rows all share its first position in time and count
/// rows and columns from it in height and width, and the text after an image resumes one
/// past its largest position.
pub fn mrope_position(grids: &[ImageGrid], p: usize) -> [u32; 3] {
    let mut delta: i64 = 0;
    for g in grids {
        let n = g.h * g.w;
        if p < g.start {
            break;
        }
        if p < g.start + n {
            let base = g.start as i64 + delta;
            let r = p - g.start;
            let w = g.w.max(1);
            return [
                base as u32,
                (base + (r / w) as i64) as u32,
                (base + (r % w) as i64) as u32,
            ];
        }
        delta += g.h.max(g.w) as i64 - n as i64;
    }
    let q = (p as i64 + delta) as u32;
    [q; 3]
}

/// Rows `row..row + rows()` of a chunk take `values` as their input (after the embedding's
/// scale, which they do not get). `bidirectional`: the rows attend to each other both ways
/// (Gemma 3's image rows; the others attend causally as ever, a window reaching back as far
/// from the last of them as it does from each). `deep`: each row of `values` is followed by
/// that many more of the model's width, added to the row's residual stream after the first
/// `deep` layers (Qwen3-VL's DeepStack features).
#[derive(Debug, Clone, Copy)]
pub struct Embeds<'a> {
    pub row: usize,
    pub values: &'a [f32],
    pub bidirectional: bool,
    pub deep: usize,
}

impl Embeds<'_> {
    /// Values a row takes in `values` (its input and its DeepStack rows).
    pub fn width(&self, hidden: usize) -> usize {
        (1 + self.deep) * hidden
    }

    pub fn rows(&self, hidden: usize) -> usize {
        self.values.len() / self.width(hidden).max(1)
    }
}

/// Activation buffers for one pass (the decoder's `pass`: [`CHUNK`] or [`LONG_CHUNK`] tokens,
/// or an image's rows more). Allocated once at load.
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
    linear: Option<DeltaBufs<B>>,
    mla: Option<MlaBufs<B>>,
    per_layer: Option<PerLayerBufs<B>>,
}

impl<B: Backend> State<B> {
    /// Buffers for passes of up to `cap` tokens.
    fn new(be: &B, c: &ModelConfig, cap: usize) -> State<B> {
        let (qd, _, f) = c.max_layer_dims();
        let h = c.hidden_size;
        let lp = c.per_layer_input * c.n_layers;
        State {
            x: be.alloc(cap * h),
            xn: be.alloc(cap * h),
            qkv: be.alloc(cap * qkv_width(c)),
            attn: be.alloc(cap * qd),
            tmp: be.alloc(cap * h),
            gu: be.alloc(cap * 2 * f),
            act: be.alloc(cap * f),
            // Grown on demand: generation needs one row, scoring a whole chunk.
            logits: be.alloc(c.vocab_size),
            moe: c.moe.as_ref().map(|m| MoeState {
                router_logits: be.alloc(cap * m.n_experts),
                host_logits: vec![0.0; cap * m.n_experts],
                scratch: MoeScratch {
                    x: be.alloc(cap * h),
                    gu: be.alloc(cap * 2 * m.expert_ffn),
                    act: be.alloc(cap * m.expert_ffn),
                    y: be.alloc(cap * h),
                },
                router: Router::new(m),
                counts: vec![vec![0; m.n_experts]; c.n_layers],
                expert_secs: 0.0,
                shared: m.shared_ffn.map(|sf| {
                    [
                        be.alloc(cap * 2 * sf),
                        be.alloc(cap * sf),
                        be.alloc(cap * h),
                        be.alloc(cap),
                    ]
                }),
                beside: (m.style == crate::config::MoeStyle::Gemma4)
                    .then(|| [be.alloc(cap * h), be.alloc(cap * h), be.alloc(cap * h)]),
            }),
            linear: c.linear.as_ref().map(|l| DeltaBufs::new(be, l, cap)),
            mla: c.mla.as_ref().map(|m| MlaBufs::new(be, c, m, cap)),
            per_layer: (lp > 0).then(|| PerLayerBufs {
                inputs: be.alloc(cap * lp),
                tok: be.alloc(cap * lp),
                gate: be.alloc(cap * 2 * c.per_layer_input),
                act: be.alloc(cap * c.per_layer_input),
            }),
        }
    }
}

/// Gemma 4's per-layer inputs of the pass (`[n, layers × width]`, layer `l` at columns
/// `l · width..`), the per-layer embedding rows they are built from, and one layer's gate
/// (its gate projection, then its input: the GLU's two halves) and product.
struct PerLayerBufs<B: Backend> {
    inputs: B::Buf,
    tok: B::Buf,
    gate: B::Buf,
    act: B::Buf,
}

/// Gemma 4's per-layer input tables: a second embedding (`[vocab, layers × width]`), a
/// projection of the scaled first embedding to the same width, and the norm of each layer's
/// slice of that projection.
struct PerLayerModel<W> {
    embed: W,
    proj: W,
    norm: W,
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
    /// The shared expert's buffers: gate/up, activation, output, scalar gate.
    shared: Option<[B::Buf; 4]>,
    /// Experts beside a dense FFN (Gemma 4): the router's input, the experts' input, their
    /// output.
    beside: Option<[B::Buf; 3]>,
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
    /// M-RoPE's axis of each rotated pair.
    pair_axis: Option<Vec<u8>>,
    /// Gemma 3's local layers' RoPE frequencies.
    local_inv_freq: Option<Vec<f32>>,
    per_layer: Option<PerLayerModel<B::Weight>>,
    /// How the layers share KV blocks.
    pub kv_groups: KvGroups,
    /// The longest sequence this decoder will run (positions), whatever the cache holds.
    pub context: usize,
    state: State<B>,
    /// The most tokens a pass carries ([`pass_tokens`] of the model's FFN formats, unless
    /// [`Self::set_pass_capacity`] raised it: a Gemma 3 image's rows must all be in one pass).
    pass: usize,
    /// Attached LoRA adapters; id `k` is slot `k − 1` (`None` once removed; ids are not
    /// reused).
    adapters: Vec<Option<Adapter>>,
    /// Scratch of their updates, sized for the largest attached.
    lora_bufs: Option<LoraBufs<B>>,
}

impl<B: Backend> Decoder<B> {
    /// Loads the weights of `config`'s layers from `src`. `context` is the longest sequence
    /// the caller may run.
    pub fn load(
        backend: B,
        mut config: ModelConfig,
        src: &WeightSource,
        context: usize,
    ) -> Result<Self> {
        let c = &config;
        let h = c.hidden_size;
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
        let final_norm = src.norm(be, "model.norm.weight", 0, h, c.norm_offset)?;
        let lp = c.per_layer_input * c.n_layers;
        let per_layer = if lp > 0 {
            let name = "model.embed_tokens_per_layer.weight";
            Some(PerLayerModel {
                embed: src.require(be, name, 0, (c.vocab_size, lp))?,
                proj: src.require(be, "model.per_layer_model_projection.weight", 0, (lp, h))?,
                norm: src.norm(
                    be,
                    "model.per_layer_projection_norm.weight",
                    0,
                    c.per_layer_input,
                    c.norm_offset,
                )?,
            })
        } else {
            None
        };
        let layers = (0..c.n_layers)
            .map(|i| Layer::load(be, src, i, c))
            .collect::<Result<Vec<_>>>()?;
        let half = c.rotary_dim / 2;
        if let Some(v) = f32_vector(src, "rope_freqs.weight", half)? {
            config.rope_scaling = Some(RopeScaling::Factors(v));
        }
        // Phi-3's LongRoPE factors, as llama.cpp's converter stores them (its config reader
        // leaves the lists empty for these).
        if let (Some(short), Some(long)) = (
            f32_vector(src, "rope_factors_short.weight", half)?,
            f32_vector(src, "rope_factors_long.weight", half)?,
        ) {
            let original_max_position = match &config.rope_scaling {
                Some(RopeScaling::LongRope {
                    original_max_position,
                    ..
                }) => *original_max_position,
                _ => config.max_position,
            };
            config.rope_scaling = Some(RopeScaling::LongRope {
                short,
                long,
                original_max_position,
            });
        }
        if let Some(RopeScaling::LongRope { short, long, .. }) = &config.rope_scaling {
            // The converter writes the original context for every Phi-3; only a file with
            // the factor tensors stretches its RoPE.
            if short.is_empty() && long.is_empty() {
                config.rope_scaling = None;
            } else if short.len() != half || long.len() != half {
                return Err(Error::Weights(format!(
                    "LongRoPE needs {half} short and long factors, found {} and {}",
                    short.len(),
                    long.len()
                )));
            }
        }
        let context = context.max(1);
        config.resolve_context(context);
        let c = &config;
        let pass = pass_tokens(layers.iter().any(|l| l.ffn.long_prefill(be)));
        let state = State::new(be, c, pass);
        Ok(Decoder {
            inv_freq: config.rope_inv_freq(),
            pair_axis: config
                .mrope
                .map(|m| m.pair_axes(config.rope_inv_freq().len())),
            local_inv_freq: config.local_inv_freq(),
            per_layer,
            kv_groups: KvGroups::new(&config.layers),
            config,
            backend,
            embed,
            lm_head,
            final_norm,
            layers,
            context,
            state,
            pass,
            adapters: Vec::new(),
            lora_bufs: None,
        })
    }

    /// Attaches a LoRA adapter and returns its id for [`SeqChunk::adapter`]. Refused where
    /// it updates a projection this model's layers do not have as it expects (a fused one,
    /// experts, a recurrent or latent mixer).
    pub fn add_adapter(&mut self, adapter: Adapter) -> Result<usize> {
        for (i, (l, layer)) in adapter.layers.iter().zip(&self.layers).enumerate() {
            let ok = |t: Target| match t {
                Target::Q | Target::K | Target::V | Target::O | Target::Qkv => {
                    let Mixer::Attention(a) = &layer.mixer else {
                        return false;
                    };
                    a.takes(t)
                }
                Target::Gate | Target::Up | Target::Down | Target::GateUp => match &layer.ffn {
                    Ffn::Dense { gate_up, .. } => matches!(
                        (gate_up, t),
                        (_, Target::Down)
                            | (GateUp::Split { .. }, Target::Gate | Target::Up)
                            | (GateUp::Fused(_), Target::GateUp)
                    ),
                    _ => false,
                },
            };
            for t in l.targets() {
                if !ok(t) {
                    return Err(Error::Unsupported(format!(
                        "adapter {:?} updates layer {i}'s {t:?} projection, which this model's \
                         layer does not have in that form",
                        adapter.name
                    )));
                }
            }
        }
        let rank = self.lora_bufs.as_ref().map_or(0, |b| b.rank);
        if adapter.rank > rank {
            self.lora_bufs = Some(LoraBufs {
                low: self.backend.alloc(self.pass * adapter.rank),
                rank: adapter.rank,
            });
        }
        // Ids are never reused: a request that named an adapter since detached gets an
        // error, not another adapter.
        self.adapters.push(Some(adapter));
        Ok(self.adapters.len())
    }

    /// Detaches adapter `id`; sequences must no longer name it.
    pub fn remove_adapter(&mut self, id: usize) -> Option<Adapter> {
        self.adapters.get_mut(id.checked_sub(1)?)?.take()
    }

    pub fn adapter(&self, id: usize) -> Option<&Adapter> {
        self.adapters.get(id.checked_sub(1)?)?.as_ref()
    }

    /// Lets a pass carry up to `tokens` tokens (never fewer than it carries now): a vision
    /// model's image, whose rows attend both ways, must be in one pass.
    pub fn set_pass_capacity(&mut self, tokens: usize) {
        let tokens = tokens.max(self.pass);
        if tokens == self.pass {
            return;
        }
        self.state = State::new(&self.backend, &self.config, tokens);
        self.pass = tokens;
        if let Some(b) = &mut self.lora_bufs {
            b.low = self.backend.alloc(tokens * b.rank);
        }
    }

    /// The most tokens a pass carries.
    pub fn pass_capacity(&self) -> usize {
        self.pass
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

    /// A KV cache of `n_blocks` blocks of `block_size` positions, each for one KV group's
    /// layers.
    pub fn alloc_kv(&self, n_blocks: usize, block_size: usize) -> KvCache<B> {
        self.alloc_kv_states(n_blocks, block_size, 1)
    }

    /// [`Decoder::alloc_kv`] with `state_slots` recurrent-state slots for models with
    /// linear-attention layers (one per sequence a pass may carry, plus any a caller keeps
    /// as prefix snapshots); none are allocated for other models.
    pub fn alloc_kv_states(
        &self,
        n_blocks: usize,
        block_size: usize,
        state_slots: usize,
    ) -> KvCache<B> {
        let block_size = block_size.max(1);
        let c = &self.config;
        let shapes: Vec<KvShape> = self
            .kv_groups
            .buffer_shapes((c.n_kv_heads, c.head_dim))
            .into_iter()
            .map(|(heads, head_dim)| KvShape {
                blocks: n_blocks,
                block_size,
                heads,
                head_dim,
            })
            .collect();
        let be = &self.backend;
        let groups = self.kv_groups.len();
        let per = n_blocks / groups.max(1);
        KvCache {
            k: shapes.iter().map(|&s| be.alloc_kv(s)).collect(),
            // Latent attention reads its values out of the keys.
            v: if c.mla.is_some() {
                Vec::new()
            } else {
                shapes.iter().map(|&s| be.alloc_kv(s)).collect()
            },
            block_size,
            n_blocks,
            identity: (0..groups)
                .map(|g| ((g * per) as u32..((g + 1) * per) as u32).collect())
                .collect(),
            states: self.alloc_states(state_slots),
            state_slots: if self.is_hybrid() { state_slots } else { 0 },
        }
    }

    /// Whether some layers keep a recurrent state instead of KV.
    pub fn is_hybrid(&self) -> bool {
        self.config.linear_layers() > 0
    }

    fn alloc_states(&self, slots: usize) -> Vec<(B::Buf, B::Buf)> {
        let Some(l) = &self.config.linear else {
            return Vec::new();
        };
        let (conv, delta) = l.state_floats();
        let be = &self.backend;
        (0..self.config.linear_layers())
            .map(|_| (be.alloc(slots * conv), be.alloc(slots * delta)))
            .collect()
    }

    /// A cache for one sequence of up to `tokens` positions (see [`Decoder::forward`]):
    /// every group holds every position (windowed groups give nothing back here).
    pub fn alloc_kv_tokens(&self, tokens: usize) -> KvCache<B> {
        let per = tokens.max(1).div_ceil(BLOCK_SIZE);
        self.alloc_kv(per * self.kv_groups.len(), BLOCK_SIZE)
    }

    /// Bytes of cache one position takes across all attention layers (keys and values),
    /// where every layer holds every position (linear-attention layers keep none).
    pub fn kv_bytes_per_token(&self) -> usize {
        let c = &self.config;
        let layers = (0..c.n_layers).filter(|&i| c.owns_kv(i));
        c.kv_tensors()
            * layers
                .map(|i| self.backend.kv_row_bytes(c.layer_kv_dim(i)))
                .sum::<usize>()
    }

    /// Bytes of one KV block (a group's layers, keys and values, `block_size` positions).
    pub fn kv_block_bytes(&self, block_size: usize) -> usize {
        let c = &self.config;
        let shapes = self.kv_groups.buffer_shapes((c.n_kv_heads, c.head_dim));
        let rows = shapes
            .iter()
            .map(|&(h, d)| self.backend.kv_row_bytes(h * d));
        c.kv_tensors() * block_size * rows.sum::<usize>()
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
        self.forward_adapter(kv, tokens, start, want, 0)
    }

    /// [`forward`](Self::forward) through LoRA adapter `adapter` (0: none).
    pub fn forward_adapter(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        want: Logits,
        adapter: usize,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.run_alone(kv, tokens, (start, adapter), want, false, |d, _, rows| {
            let at = out.len();
            d.logits_rows(rows, &mut out, at)
        })?;
        Ok(out)
    }

    /// [`forward`](Self::forward) of a fresh sequence (from position 0) whose rows `embeds`
    /// name take the given values: passes of up to [`Self::pass_capacity`] tokens, never
    /// cutting a bidirectional span (a causal one may be cut). `grids`: the images' places
    /// for M-RoPE (empty for other models).
    pub fn forward_embedded(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        embeds: &[Embeds],
        grids: &[ImageGrid],
        want: Logits,
    ) -> Result<Vec<f32>> {
        let h = self.config.hidden_size;
        let tables = std::mem::take(&mut kv.identity);
        let mut out = Vec::new();
        let mut pos = 0;
        let mut result = Ok(());
        while pos < tokens.len() {
            let mut end = (pos + self.pass).min(tokens.len());
            // Back off to the start of a bidirectional span the cut would fall inside.
            for e in embeds.iter().filter(|e| e.bidirectional) {
                let rows = e.rows(h);
                if e.row < end && end < e.row + rows {
                    end = e.row;
                }
            }
            if end <= pos {
                result = Err(Error::InvalidRequest(format!(
                    "an image of more rows than a pass carries ({})",
                    self.pass
                )));
                break;
            }
            // The parts of `embeds` inside this chunk, relative to it.
            let chunk_embeds: Vec<Embeds> = embeds
                .iter()
                .filter_map(|e| {
                    let (rows, w) = (e.rows(h), e.width(h));
                    let (a, b) = (e.row.max(pos), (e.row + rows).min(end));
                    (a < b).then(|| Embeds {
                        row: a - pos,
                        values: &e.values[(a - e.row) * w..(b - e.row) * w],
                        bidirectional: e.bidirectional,
                        deep: e.deep,
                    })
                })
                .collect();
            let logits = match want {
                Logits::Last if end < tokens.len() => Logits::None,
                w => w,
            };
            let seq = SeqChunk {
                tokens: &tokens[pos..end],
                start: pos,
                tables: &tables,
                logits,
                state: 0,
                adapter: 0,
                embeds: &chunk_embeds,
                grids,
            };
            match self.forward_rows(kv, &[seq], false) {
                Ok(rows) => {
                    let at = out.len();
                    self.logits_rows(rows, &mut out, at);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            pos = end;
        }
        kv.identity = tables;
        result.map(|()| out)
    }

    /// [`forward`](Self::forward) with [`Logits::Last`], the logits left where the pass put
    /// them (or in `spare`, a buffer the caller keeps across calls) instead of copied into a
    /// new vector: what the engine's decode step does. A vocabulary-sized vector allocated,
    /// filled and freed per token cost SmolLM2's decode about 7% of its time (the freed
    /// pages go back to the system and fault in again at the next token).
    pub fn forward_last<'a>(
        &'a mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        start: usize,
        spare: &'a mut Vec<f32>,
    ) -> Result<&'a [f32]> {
        let mut rows = 0;
        self.run_alone(kv, tokens, (start, 0), Logits::Last, false, |_, _, r| {
            rows = r
        })?;
        Ok(self.logits_view(rows, spare))
    }

    /// Runs `tokens` as one sequence owning the whole of `kv`, a chunk per pass, calling
    /// `after(self, chunk, rows)` after each pass (its `rows` rows of logits in
    /// `state.logits`; with `hidden`, the chunk's hidden states in the residual buffer).
    fn run_alone(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        (start, adapter): (usize, usize),
        want: Logits,
        hidden: bool,
        mut after: impl FnMut(&mut Self, &[u32], usize),
    ) -> Result<()> {
        // Taken out for the duration, so the tables can be borrowed while `kv` is written.
        let tables = std::mem::take(&mut kv.identity);
        let end = start + tokens.len();
        let mut pos = start;
        let mut result = Ok(());
        for chunk in tokens.chunks(self.pass) {
            let logits = match want {
                Logits::Last if pos + chunk.len() < end => Logits::None,
                w => w,
            };
            let seq = SeqChunk {
                tokens: chunk,
                start: pos,
                tables: &tables,
                logits,
                state: 0,
                adapter,
                embeds: &[],
                grids: &[],
            };
            match self.forward_rows(kv, &[seq], hidden) {
                Ok(rows) => after(self, chunk, rows),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            pos += chunk.len();
        }
        kv.identity = tables;
        result
    }

    /// The final-normalised hidden states of `tokens` (row-major, one row a position), run
    /// as one fresh sequence owning `kv`: what a decoder embedder (Qwen3-Embedding) pools.
    pub fn hidden_rows(&mut self, kv: &mut KvCache<B>, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.config.hidden_size;
        let mut all = Vec::with_capacity(tokens.len() * h);
        let mut host = Vec::new();
        self.run_alone(kv, tokens, (0, 0), Logits::None, true, |d, chunk, _| {
            d.normed_rows(chunk.len(), &mut host);
            all.extend_from_slice(&host);
        })?;
        Ok(all)
    }

    /// The last pass's first `n` residual rows through the final norm, read into `host`.
    fn normed_rows(&mut self, n: usize, host: &mut Vec<f32>) {
        let rows = Rows::dense(n, self.config.hidden_size);
        let s = &mut self.state;
        let be = &self.backend;
        be.rms_norm(
            &s.x,
            rows,
            &self.final_norm,
            self.config.rms_eps,
            &mut s.xn,
            rows,
        );
        host.resize(n * self.config.hidden_size, 0.0);
        be.read(&s.xn, 0, host);
    }

    /// [`Decoder::hidden_rows`] of several fresh sequences at once, each in blocks of a cache
    /// of their own: their chunks packed into passes of up to [`CHUNK`] tokens (many short
    /// inputs share each pass's weight reads), each sequence's rows what it gets alone.
    pub fn hidden_rows_batch(&mut self, inputs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let (h, bs, groups) = (self.config.hidden_size, BLOCK_SIZE, self.kv_groups.len());
        let blocks: Vec<usize> = inputs.iter().map(|t| t.len().div_ceil(bs)).collect();
        let total = blocks.iter().sum::<usize>() * groups;
        let mut kv = self.alloc_kv_states(total.max(1), bs, inputs.len().max(1));
        let mut next = 0u32;
        let tables: Vec<Vec<Vec<u32>>> = blocks
            .iter()
            .map(|&b| {
                (0..groups)
                    .map(|_| {
                        let t = (next..next + b as u32).collect();
                        next += b as u32;
                        t
                    })
                    .collect()
            })
            .collect();
        let mut done = vec![0; inputs.len()];
        let mut out: Vec<Vec<f32>> = inputs
            .iter()
            .map(|t| Vec::with_capacity(t.len() * h))
            .collect();
        let mut host = Vec::new();
        loop {
            let mut seqs = Vec::new();
            let mut owners = Vec::new();
            let mut budget = CHUNK;
            for (i, t) in inputs.iter().enumerate() {
                let take = (t.len() - done[i]).min(budget);
                if take == 0 {
                    continue;
                }
                seqs.push(SeqChunk {
                    tokens: &t[done[i]..done[i] + take],
                    start: done[i],
                    tables: &tables[i],
                    logits: Logits::None,
                    state: i,
                    adapter: 0,
                    embeds: &[],
                    grids: &[],
                });
                owners.push((i, take));
                budget -= take;
                if budget == 0 {
                    break;
                }
            }
            if seqs.is_empty() {
                break;
            }
            self.forward_rows(&mut kv, &seqs, true)?;
            self.normed_rows(CHUNK - budget, &mut host);
            let mut at = 0;
            for (i, take) in owners {
                out[i].extend_from_slice(&host[at * h..(at + take) * h]);
                at += take;
                done[i] += take;
            }
        }
        Ok(out)
    }

    /// The mean over positions of the final-normalised hidden states of `tokens`, run as one
    /// fresh sequence owning `kv` (sentence embeddings).
    pub fn pooled_hidden(&mut self, kv: &mut KvCache<B>, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.config.hidden_size;
        let mut sum = vec![0f64; h];
        for row in self.hidden_rows(kv, tokens)?.chunks_exact(h) {
            for (a, &b) in sum.iter_mut().zip(row) {
                *a += b as f64;
            }
        }
        let n = tokens.len().max(1) as f64;
        Ok(sum.iter().map(|&v| (v / n) as f32).collect())
    }

    /// Runs one pass over a batch of sequences (prefill chunks and decode tokens alike), at
    /// most [`CHUNK`] tokens in all. Returns, row-major and in batch order, the logits each
    /// sequence asked for. A sequence's numbers do not depend on what else is in the batch:
    /// every op works row by row, and attention sequence by sequence.
    pub fn forward_batch(&mut self, kv: &mut KvCache<B>, seqs: &[SeqChunk]) -> Result<Vec<f32>> {
        let rows = self.forward_rows(kv, seqs, false)?;
        let mut out = Vec::new();
        self.logits_rows(rows, &mut out, 0);
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
        let rows = self.forward_rows(kv, seqs, false)?;
        Ok(self.logits_view(rows, spare))
    }

    /// The first `rows` rows of `state.logits` where they lie, or copied into `spare`.
    fn logits_view<'a>(&'a self, rows: usize, spare: &'a mut Vec<f32>) -> &'a [f32] {
        let len = rows * self.config.vocab_size;
        if rows > 0 {
            if let Some(v) = self.backend.host_view(&self.state.logits, 0, len) {
                return v;
            }
        }
        self.logits_rows(rows, spare, 0);
        &spare[..]
    }

    /// The pass itself: leaves the logits of the rows that asked in `state.logits` and
    /// returns how many rows that is.
    /// One pass over `seqs`: their logits rows in `state.logits` (returns how many); with
    /// `hidden`, every row's hidden state left in the residual buffer too (without, the last
    /// layer's FFN runs for the logits rows only).
    fn forward_rows(
        &mut self,
        kv: &mut KvCache<B>,
        seqs: &[SeqChunk],
        hidden: bool,
    ) -> Result<usize> {
        let vocab = self.config.vocab_size;
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if n > self.pass {
            return Err(Error::InvalidRequest(format!(
                "a pass carries at most {} tokens, got {n}",
                self.pass
            )));
        }
        let groups = &self.kv_groups;
        if kv.k.len() != groups.slots * groups.shapes.len() {
            return Err(Error::InvalidRequest("KV cache of another model".into()));
        }
        let mut tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        // Three rotary positions a row, kept where some sequence has images under M-RoPE.
        let mut axes: Vec<u32> = Vec::new();
        let mut any_image = false;
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
            if s.tables.len() != groups.len() {
                return Err(Error::InvalidRequest(format!(
                    "{} block tables for {} KV groups",
                    s.tables.len(),
                    groups.len()
                )));
            }
            for (t, (_, window)) in s.tables.iter().zip(&groups.groups) {
                // Every block this pass reads or writes must be there.
                let first = KvGroups::first_needed(*window, s.start, kv.block_size);
                let needed = t.get(first..end.div_ceil(kv.block_size));
                if needed.is_none_or(|b| b.iter().any(|&b| b as usize >= kv.n_blocks)) {
                    return Err(Error::InvalidRequest(format!(
                        "sequence of {end} tokens does not fit its {} KV blocks",
                        t.len()
                    )));
                }
            }
            let h = self.config.hidden_size;
            let mut next = 0;
            for e in s.embeds {
                let rows = e.rows(h);
                if e.values.len() % e.width(h) != 0 || e.row < next || e.row + rows > s.tokens.len()
                {
                    return Err(Error::InvalidRequest(format!(
                        "embedded rows {}..{} (of width {}) do not fit a chunk of {} tokens in order",
                        e.row,
                        e.row + rows,
                        h,
                        s.tokens.len()
                    )));
                }
                next = e.row + rows;
            }
            if s.adapter != 0 && self.adapter(s.adapter).is_none() {
                return Err(Error::InvalidRequest(format!(
                    "no LoRA adapter {} is attached",
                    s.adapter
                )));
            }
            if !kv.states.is_empty() && s.state >= kv.state_slots {
                return Err(Error::InvalidRequest(format!(
                    "recurrent-state slot {} of {}",
                    s.state, kv.state_slots
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
            if self.pair_axis.is_some() && !s.grids.is_empty() {
                for p in s.start..end {
                    let a = mrope_position(s.grids, p);
                    positions.push(a[0]);
                    axes.extend_from_slice(&a);
                }
                any_image = true;
            } else {
                positions.extend((s.start..end).map(|p| p as u32));
                if self.pair_axis.is_some() {
                    axes.extend((s.start..end).flat_map(|p| [p as u32; 3]));
                }
            }
        }
        if n == 0 {
            return Ok(0);
        }
        if !kv.states.is_empty() {
            let mut slots: Vec<usize> = seqs.iter().map(|s| s.state).collect();
            slots.sort_unstable();
            slots.dedup();
            if slots.len() != seqs.len() {
                return Err(Error::InvalidRequest(
                    "two sequences of one pass share a recurrent-state slot".into(),
                ));
            }
        }
        let axes = any_image.then_some(&axes[..]);
        let keep = (!hidden).then_some(&want_rows[..]);
        let left = self.run_layers(kv, &tokens, &positions, axes, seqs, keep)?;
        if left == n {
            self.head(n, &want_rows);
        } else {
            // The residual stream holds the logits rows alone, in order.
            let rows: Vec<u32> = (0..left as u32).collect();
            self.head(left, &rows);
        }
        // A device runs the pass here; its fault (out of memory, lost) fails the pass.
        self.backend.sync()?;
        Ok(want_rows.len())
    }

    /// The layers over a pass's `tokens`; returns the rows left in the residual stream: all
    /// of them, or with `keep` (ascending rows, fewer than all) those alone, gathered to its
    /// front — the last layer's FFN then runs for them only, as nothing reads another row.
    fn run_layers(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        positions: &[u32],
        axes: Option<&[u32]>,
        seqs: &[SeqChunk],
        keep: Option<&[u32]>,
    ) -> Result<usize> {
        let c = &self.config;
        let be = &self.backend;
        let s = &mut self.state;
        let n = tokens.len();
        let hidden = Rows::dense(n, c.hidden_size);
        // Each KV group's view of the batch: its own block tables.
        let attn_seqs: Vec<Vec<AttnSeq>> = (0..self.kv_groups.len())
            .map(|g| {
                seqs.iter()
                    .map(|q| AttnSeq {
                        rows: q.tokens.len(),
                        first_pos: q.start,
                        table: KvTable {
                            blocks: &q.tables[g],
                            block_size: kv.block_size,
                        },
                    })
                    .collect()
            })
            .collect();
        let state_seqs: Vec<StateSeq> = seqs
            .iter()
            .map(|q| StateSeq {
                rows: q.tokens.len(),
                slot: q.state,
                fresh: q.start == 0,
            })
            .collect();
        // Consecutive rows of one adapter: each run's updates are one pair of matmuls.
        let mut runs: Vec<(usize, usize, &Adapter)> = Vec::new();
        let mut row = 0;
        for q in seqs {
            let m = q.tokens.len();
            if let Some(a) = q
                .adapter
                .checked_sub(1)
                .and_then(|k| self.adapters[k].as_ref())
            {
                match runs.last_mut() {
                    Some((first, count, last))
                        if *first + *count == row && std::ptr::eq(*last, a) =>
                    {
                        *count += m
                    }
                    _ => runs.push((row, m, a)),
                }
            }
            row += m;
        }
        // Rows attending both ways (an image's) make their own attention groups.
        let bidirectional = seqs
            .iter()
            .any(|q| q.embeds.iter().any(|e| e.bidirectional));
        let attend: Vec<Option<Vec<Attend>>> = attn_seqs
            .iter()
            .map(|group| bidirectional.then(|| attend_groups(seqs, group, c.hidden_size)))
            .collect();
        let mut linear_index = 0;
        be.embed(&self.embed, tokens, &mut s.x, hidden);
        if let Some(e) = c.embed_scale {
            be.scale_inplace(&mut s.x, hidden, e);
        }
        let mut row = 0;
        for q in seqs {
            for e in q.embeds {
                let h = c.hidden_size;
                if e.deep == 0 {
                    be.write(&mut s.x, (row + e.row) * h, e.values);
                } else {
                    for (r, v) in e.values.chunks_exact(e.width(h)).enumerate() {
                        be.write(&mut s.x, (row + e.row + r) * h, &v[..h]);
                    }
                }
            }
            row += q.tokens.len();
        }
        if let (Some(pl), Some(b)) = (&self.per_layer, s.per_layer.as_mut()) {
            per_layer_inputs(be, c, pl, b, tokens, &s.x);
        }
        if let Some(w) = self.layers.first().and_then(|l| l.norms.attn_in.as_ref()) {
            be.rms_norm(&s.x, hidden, w, c.rms_eps, &mut s.xn, hidden);
        }
        let mut left = n;
        for (li, layer) in self.layers.iter().enumerate() {
            let rope = match layer.spec.rope {
                Rope::Global => Some(RopeParams {
                    layout: c.rope_layout,
                    inv_freq: &self.inv_freq,
                    factor: c.rope_factor,
                }),
                Rope::Local => Some(RopeParams {
                    layout: c.rope_layout,
                    inv_freq: self.local_inv_freq.as_deref().unwrap_or(&self.inv_freq),
                    factor: 1.0,
                }),
                Rope::None => None,
            };
            // A block reads the normalised stream where its family has a norm before it,
            // the residual stream itself where not (OLMo 2).
            let input = if layer.norms.attn_in.is_some() {
                &s.xn
            } else {
                &s.x
            };
            let layer_runs = || -> Vec<Run> {
                runs.iter()
                    .map(|&(first, count, a)| Run {
                        first,
                        count,
                        layer: &a.layers[li],
                    })
                    .filter(|r| !r.layer.is_empty())
                    .collect()
            };
            let mut lora = match self.lora_bufs.as_mut() {
                Some(bufs) if !runs.is_empty() => Some(LayerLora {
                    runs: layer_runs(),
                    bufs,
                }),
                _ => None,
            };
            match &layer.mixer {
                Mixer::Attention(attn) => {
                    let (group, _) = self.kv_groups.slot_of[li];
                    let slot = self.kv_groups.buffer_of(li);
                    let inputs = AttnInputs {
                        positions,
                        seqs: &attn_seqs[group],
                        rope,
                        axes: axes.zip(self.pair_axis.as_deref()),
                        params: AttentionParams {
                            n_kv_heads: attn.kv_heads,
                            scale: c.attn_scale,
                            window: layer.spec.window,
                            softcap: None,
                            sinks: attn.sinks.as_deref(),
                        },
                        temp: c.attn_temp,
                        attend: attend[group].as_deref(),
                    };
                    attn.forward(
                        be,
                        c,
                        input,
                        n,
                        &mut s.qkv,
                        &mut s.attn,
                        &mut s.tmp,
                        &mut kv.k[slot],
                        &mut kv.v[slot],
                        &inputs,
                        lora.as_mut(),
                    );
                }
                Mixer::Latent(mla) => {
                    let (Some(m), Some(bufs)) = (c.mla.as_ref(), s.mla.as_mut()) else {
                        return Err(Error::Weights("latent attention without its shape".into()));
                    };
                    let (group, _) = self.kv_groups.slot_of[li];
                    let slot = self.kv_groups.buffer_of(li);
                    let inputs = AttnInputs {
                        positions,
                        seqs: &attn_seqs[group],
                        rope,
                        axes: None,
                        params: AttentionParams {
                            n_kv_heads: 1,
                            scale: c.attn_scale,
                            window: layer.spec.window,
                            softcap: None,
                            sinks: None,
                        },
                        temp: c.attn_temp,
                        // No latent-attention model takes images.
                        attend: None,
                    };
                    mla.forward(
                        be,
                        c,
                        m,
                        input,
                        n,
                        bufs,
                        &mut s.qkv,
                        &mut s.attn,
                        &mut s.tmp,
                        &mut kv.k[slot],
                        &inputs,
                    );
                }
                Mixer::Linear(net) => {
                    let (Some(l), Some(bufs)) = (c.linear.as_ref(), s.linear.as_mut()) else {
                        return Err(Error::Weights("linear layer without its shape".into()));
                    };
                    let Some((conv, delta)) = kv.states.get_mut(linear_index) else {
                        return Err(Error::InvalidRequest(
                            "KV cache without recurrent states for a hybrid model".into(),
                        ));
                    };
                    linear_index += 1;
                    net.forward(
                        be,
                        c,
                        l,
                        input,
                        n,
                        bufs,
                        &mut s.tmp,
                        conv,
                        delta,
                        &state_seqs,
                    );
                }
            }
            let ffn_in = layer.norms.ffn_in.as_ref();
            residual(be, c, s, n, layer.norms.attn_out.as_ref(), ffn_in);
            // The last layer's FFN for the kept rows only (a prompt chunk's last row, or none
            // short of the prompt's end): its other rows' outputs are never read. Each kept
            // row gets the bits it gets among all (every op here is row by row). Not with
            // adapters (their runs are in the pass's rows), per-layer inputs or DeepStack rows
            // still to add (written at the image rows' places; a tiny model may have more of
            // them than layers).
            let (n, hidden) = match keep {
                Some(rows)
                    if li + 1 == self.layers.len()
                        && rows.len() < n
                        && lora.is_none()
                        && layer.per_layer_input.is_none()
                        && !seqs.iter().any(|q| q.embeds.iter().any(|e| li < e.deep)) =>
                {
                    let m = rows.len();
                    if m == 0 {
                        return Ok(0);
                    }
                    let dst = Rows::dense(m, c.hidden_size);
                    be.gather_rows(&s.x, hidden, rows, &mut s.tmp, dst);
                    be.copy_rows(&s.tmp, dst, &mut s.x, dst);
                    if ffn_in.is_some() {
                        be.gather_rows(&s.xn, hidden, rows, &mut s.tmp, dst);
                        be.copy_rows(&s.tmp, dst, &mut s.xn, dst);
                    }
                    left = m;
                    (m, dst)
                }
                _ => (n, hidden),
            };
            let input = if ffn_in.is_some() { &s.xn } else { &s.x };
            let no_moe = || Error::Weights("MoE layer without MoE state".into());
            match &layer.ffn {
                Ffn::Dense {
                    gate_up,
                    down,
                    width,
                } => dense_ffn(
                    be,
                    c,
                    *width,
                    gate_up,
                    down,
                    input,
                    n,
                    &mut s.gu,
                    &mut s.act,
                    &mut s.tmp,
                    lora.as_mut(),
                ),
                Ffn::Moe(moe) => {
                    let ms = s.moe.as_mut().ok_or_else(no_moe)?;
                    moe_block(be, moe, ms, li, input, input, n, hidden, &mut s.tmp);
                }
                Ffn::DenseAndExperts {
                    gate_up,
                    down,
                    width,
                    moe,
                    post_dense,
                    router_norm,
                    pre_experts,
                    post_experts,
                } => {
                    dense_ffn(
                        be, c, *width, gate_up, down, input, n, &mut s.gu, &mut s.act, &mut s.tmp,
                        None,
                    );
                    be.rms_norm_inplace(&mut s.tmp, hidden, post_dense, c.rms_eps);
                    let ms = s.moe.as_mut().ok_or_else(no_moe)?;
                    let [mut rx, mut ex, mut ey] = ms.beside.take().ok_or_else(no_moe)?;
                    be.rms_norm(&s.x, hidden, router_norm, c.rms_eps, &mut rx, hidden);
                    be.rms_norm(&s.x, hidden, pre_experts, c.rms_eps, &mut ex, hidden);
                    moe_block(be, moe, ms, li, &rx, &ex, n, hidden, &mut ey);
                    be.rms_norm_inplace(&mut ey, hidden, post_experts, c.rms_eps);
                    be.add_inplace(&mut s.tmp, hidden, &ey, hidden);
                    ms.beside = Some([rx, ex, ey]);
                }
            }
            // The next layer's input norm rides on this residual add; after the last layer
            // the residual stream is left unnormalised for the output head. Gemma 4 adds
            // its per-layer input and scales the stream first.
            let next_in = self
                .layers
                .get(li + 1)
                .and_then(|l| l.norms.attn_in.as_ref());
            let deep = seqs.iter().any(|q| q.embeds.iter().any(|e| li < e.deep));
            let more = layer.per_layer_input.is_some() || layer.scalar.is_some() || deep;
            residual(
                be,
                c,
                s,
                n,
                layer.norms.ffn_out.as_ref(),
                next_in.filter(|_| !more),
            );
            if more {
                if let (Some(w), Some(b)) = (&layer.per_layer_input, s.per_layer.as_mut()) {
                    per_layer_input(be, c, w, b, li, &mut s.x, &mut s.tmp, n);
                }
                if let Some(k) = layer.scalar {
                    be.scale_inplace(&mut s.x, hidden, k);
                }
                if deep {
                    deepstack(be, c.hidden_size, seqs, li, &mut s.x, &mut s.tmp);
                }
                if let Some(w) = next_in {
                    be.rms_norm(&s.x, hidden, w, c.rms_eps, &mut s.xn, hidden);
                }
            }
        }
        Ok(left)
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
        if c.logit_scale != 1.0 {
            be.scale_inplace(&mut s.logits, Rows::dense(count, vocab), c.logit_scale);
        }
        if let Some(cap) = c.final_softcap {
            be.softcap(&mut s.logits, Rows::dense(count, vocab), cap);
        }
    }

    /// Copies the first `rows` rows of `state.logits` into `out` from index `at` on (what
    /// was there replaced, `out` cut or grown to end with them).
    fn logits_rows(&self, rows: usize, out: &mut Vec<f32>, at: usize) {
        let end = at + rows * self.config.vocab_size;
        // Truncate, not clear: only a growth is zero-filled before the copy overwrites it.
        out.truncate(end);
        out.resize(end, 0.0);
        if rows > 0 {
            self.backend.read(&self.state.logits, 0, &mut out[at..]);
        }
    }
}

/// A block's output (`state.tmp`) into the residual stream: its post-norm and multiplier
/// where the family has them, then `x += tmp`, fused with the next norm into `xn` when one
/// follows.
/// The attention groups of a pass with bidirectional rows (see [`Attend`]): each
/// sequence's causal runs as they are, each row of a bidirectional span a one-row sequence at
/// the span's last position with its window widened; consecutive groups of one widening
/// merged into one call.
fn attend_groups<'a>(seqs: &[SeqChunk], group: &[AttnSeq<'a>], hidden: usize) -> Vec<Attend<'a>> {
    let mut out: Vec<Attend<'a>> = Vec::new();
    let mut push = |seq: AttnSeq<'a>, widen: usize| match out.last_mut() {
        Some(last) if last.widen == widen => last.seqs.push(seq),
        _ => out.push(Attend {
            seqs: vec![seq],
            widen,
        }),
    };
    for (q, s) in seqs.iter().zip(group) {
        let run = |from: usize, to: usize| AttnSeq {
            rows: to - from,
            first_pos: s.first_pos + from,
            table: s.table,
        };
        let mut at = 0;
        for e in q.embeds.iter().filter(|e| e.bidirectional) {
            let len = e.rows(hidden);
            if e.row > at {
                push(run(at, e.row), 0);
            }
            let last = s.first_pos + e.row + len - 1;
            for i in 0..len {
                let seq = AttnSeq {
                    rows: 1,
                    first_pos: last,
                    table: s.table,
                };
                push(seq, len - 1 - i);
            }
            at = e.row + len;
        }
        if at < s.rows {
            push(run(at, s.rows), 0);
        }
    }
    out
}

/// Adds layer `layer`'s DeepStack rows of every image in the pass to those rows of the
/// residual stream `x` (through `tmp`, at the same rows).
fn deepstack<B: Backend>(
    be: &B,
    h: usize,
    seqs: &[SeqChunk],
    layer: usize,
    x: &mut B::Buf,
    tmp: &mut B::Buf,
) {
    let mut row = 0;
    for q in seqs {
        for e in q.embeds.iter().filter(|e| layer < e.deep) {
            let w = e.width(h);
            let at = (1 + layer) * h;
            let rows: Vec<f32> = e
                .values
                .chunks_exact(w)
                .flat_map(|v| v[at..at + h].iter().copied())
                .collect();
            let n = rows.len() / h;
            be.write(tmp, (row + e.row) * h, &rows);
            let view = Rows::dense(row + e.row + n, h).slice(row + e.row, n);
            be.add_inplace(x, view, tmp, view);
        }
        row += q.tokens.len();
    }
}

fn residual<B: Backend>(
    be: &B,
    c: &ModelConfig,
    s: &mut State<B>,
    n: usize,
    post_norm: Option<&B::Weight>,
    next_norm: Option<&B::Weight>,
) {
    let hidden = Rows::dense(n, c.hidden_size);
    if let Some(w) = post_norm {
        be.rms_norm_inplace(&mut s.tmp, hidden, w, c.rms_eps);
    }
    if c.residual_scale != 1.0 {
        be.scale_inplace(&mut s.tmp, hidden, c.residual_scale);
    }
    match next_norm {
        Some(w) => be.add_rms_norm(
            &mut s.x, hidden, &s.tmp, hidden, w, c.rms_eps, &mut s.xn, hidden,
        ),
        None => be.add_inplace(&mut s.x, hidden, &s.tmp, hidden),
    }
}

/// Routes the `n` rows of `router_x` (router matmul, then top-k on the host) and runs the
/// selected experts over the same rows of `x` into `out`.
#[allow(clippy::too_many_arguments)]
fn moe_block<B: Backend>(
    be: &B,
    moe: &MoeLayer<B>,
    ms: &mut MoeState<B>,
    layer: usize,
    router_x: &B::Buf,
    x: &B::Buf,
    n: usize,
    hidden: Rows,
    out: &mut B::Buf,
) {
    let ne = moe.experts.len();
    be.matmul(
        router_x,
        hidden,
        &moe.router,
        moe.router_bias.as_ref(),
        &mut ms.router_logits,
        Rows::dense(n, ne),
    );
    be.read(&ms.router_logits, 0, &mut ms.host_logits[..n * ne]);
    ms.router.route(
        &ms.host_logits[..n * ne],
        moe.choice_bias.as_deref(),
        n,
        &mut ms.counts[layer],
    );
    if let Some(scale) = &moe.expert_scale {
        ms.router.scale_experts(scale);
    }
    let t0 = std::time::Instant::now();
    if let (Some(sh), Some([gu, act, y, gate])) = (&moe.shared, ms.shared.as_mut()) {
        gated_ffn(
            be,
            hidden.width(),
            sh.ffn,
            moe.activation,
            &sh.gate_up,
            &sh.down,
            x,
            n,
            gu,
            act,
            y,
        );
        if let Some(g) = &sh.gate {
            be.matmul(x, hidden, g, None, gate, Rows::dense(n, 1));
            be.sigmoid_mul(y, hidden, gate, Rows::dense(n, 1));
        }
    }
    let batches = ms.router.batches();
    be.moe_ffn(
        x,
        hidden,
        &moe.experts,
        &batches,
        &mut ms.scratch,
        out,
        hidden,
        moe.activation,
    );
    if let (Some(_), Some([_, _, y, _])) = (&moe.shared, ms.shared.as_ref()) {
        be.add_inplace(out, hidden, y, hidden);
    }
    // Backends that run asynchronously will need a sync here to time this.
    ms.expert_secs += t0.elapsed().as_secs_f64();
}

/// Gemma 4's per-layer inputs of the pass's `tokens` into `b.inputs`:
/// `(norm(proj(x) / √hidden) + embed(tokens) · √width) / √2`, per layer's slice.
fn per_layer_inputs<B: Backend>(
    be: &B,
    c: &ModelConfig,
    pl: &PerLayerModel<B::Weight>,
    b: &mut PerLayerBufs<B>,
    tokens: &[u32],
    x: &B::Buf,
) {
    let (n, p) = (tokens.len(), c.per_layer_input);
    let all = Rows::dense(n, p * c.n_layers);
    be.embed(&pl.embed, tokens, &mut b.tok, all);
    be.scale_inplace(&mut b.tok, all, (p as f32).sqrt());
    let hidden = Rows::dense(n, c.hidden_size);
    be.matmul(x, hidden, &pl.proj, None, &mut b.inputs, all);
    be.scale_inplace(&mut b.inputs, all, (c.hidden_size as f32).powf(-0.5));
    be.rms_norm_inplace(&mut b.inputs, all.split_heads(p), &pl.norm, c.rms_eps);
    be.add_inplace(&mut b.inputs, all, &b.tok, all);
    be.scale_inplace(&mut b.inputs, all, std::f32::consts::FRAC_1_SQRT_2);
}

/// Layer `layer`'s per-layer input into the residual stream `x`:
/// `x += norm(proj(act(gate(x)) · inputs[layer]))`.
#[allow(clippy::too_many_arguments)]
fn per_layer_input<B: Backend>(
    be: &B,
    c: &ModelConfig,
    w: &PerLayerInput<B::Weight>,
    b: &mut PerLayerBufs<B>,
    layer: usize,
    x: &mut B::Buf,
    tmp: &mut B::Buf,
    n: usize,
) {
    let (p, hidden) = (c.per_layer_input, Rows::dense(n, c.hidden_size));
    let gate = Rows::columns(n, 2 * p, 0, p);
    be.matmul(x, hidden, &w.gate, None, &mut b.gate, gate);
    let slice = Rows::columns(n, p * c.n_layers, layer * p, p);
    be.copy_rows(&b.inputs, slice, &mut b.gate, Rows::columns(n, 2 * p, p, p));
    let act = Rows::dense(n, p);
    be.glu(
        &b.gate,
        Rows::dense(n, 2 * p),
        &mut b.act,
        act,
        c.activation,
    );
    be.matmul(&b.act, act, &w.proj, None, tmp, hidden);
    be.rms_norm_inplace(tmp, hidden, &w.norm, c.rms_eps);
    be.add_inplace(x, hidden, tmp, hidden);
}

/// A 1-D f32 tensor of `len` values (RoPE frequency factors), if the file has it.
fn f32_vector(src: &WeightSource, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
    let Some(t) = src.store.get(&src.name(name, 0)) else {
        return Ok(None);
    };
    if t.dtype != ferrum_core::DType::F32 || t.bytes().len() != 4 * len || t.numel() != len {
        return Err(Error::Weights(format!("{name} must be F32 [{len}]")));
    }
    Ok(Some(
        t.bytes()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    ))
}
