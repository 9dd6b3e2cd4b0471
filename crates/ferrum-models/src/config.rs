//! The hyper-parameters of a decoder, read from either a Hugging Face `config.json` or a
//! GGUF's `{arch}.*` metadata, into one typed struct. [`ModelConfig::hf_base`] and
//! [`ModelConfig::gguf_base`] read the keys every Llama-style model shares; the architecture
//! files (`arch/`) start from them and set what their family does differently (norm
//! placement, QK-norm, RoPE per layer, multipliers).

use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use ferrum_backend::{Activation, RopeLayout};

pub use crate::arch::Arch;

/// How RoPE frequencies are stretched for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Divide every frequency by `factor`.
    Linear { factor: f32 },
    /// Llama 3.1's band-wise scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// Per-frequency divisors stored in the file (GGUF `rope_freqs.weight`).
    Factors(Vec<f32>),
    /// Phi-3's LongRoPE: per-frequency divisors, `long` for contexts past
    /// `original_max_position`, `short` within it (chosen once for the context the model is
    /// loaded with, as llama.cpp does).
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original_max_position: usize,
    },
    /// YaRN (gpt-oss): frequencies blended between interpolated (÷ `factor`) and kept, by a
    /// linear ramp over the dimensions whose rotations in `original_max_position` lie between
    /// `beta_slow` and `beta_fast`; cos and sin are multiplied by [`RopeScaling::attention_factor`].
    Yarn {
        factor: f32,
        beta_fast: f32,
        beta_slow: f32,
        original_max_position: f32,
        /// Round the ramp's ends outwards to whole dimensions.
        truncate: bool,
        attention_factor: f32,
    },
}

impl RopeScaling {
    /// What cos and sin are multiplied by (YaRN's attention temperature); 1 for the others.
    pub fn attention_factor(&self) -> f32 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }
}

/// How a family's experts are laid out and computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MoeStyle {
    /// Qwen3-MoE: SwiGLU experts without biases, a router without one.
    Qwen,
    /// gpt-oss: a router with a bias, experts with biases and the clamped SwiGLU; Hugging
    /// Face files stack every expert in one tensor per projection.
    GptOss { alpha: f32, limit: f32 },
    /// Gemma 4: GeGLU experts beside the layer's dense MLP (each output normalised, then
    /// summed), routed from the normalised residual stream, weights scaled per expert.
    Gemma4,
}

/// The mixture-of-experts settings of a Qwen3-MoE-style model.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub style: MoeStyle,
    pub n_experts: usize,
    /// Experts per token (top-k).
    pub n_active: usize,
    /// Hidden width of each expert's SwiGLU.
    pub expert_ffn: usize,
    /// Divide the top-k routing weights by their sum.
    pub norm_topk_prob: bool,
    /// Layers that use the dense MLP instead.
    pub mlp_only_layers: Vec<usize>,
    /// Every `sparse_step`-th layer is sparse (`(i + 1) % sparse_step == 0`).
    pub sparse_step: usize,
    /// A shared expert of this width beside the routed ones: its output scaled by
    /// `sigmoid(gate · x)` (Qwen3.5-MoE, Qwen3-Next) when [`MoeConfig::shared_gate`], added as
    /// it is (GLM-4.5, DeepSeek-V3) otherwise.
    pub shared_ffn: Option<usize>,
    pub shared_gate: bool,
    pub routing: Routing,
}

/// What turns router logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// A softmax over every expert (Qwen3-MoE, gpt-oss).
    Softmax,
    /// Each expert's own sigmoid (GLM-4.5, DeepSeek-V3).
    Sigmoid,
}

/// How a router chooses and weighs experts beyond the top-k of its scores: DeepSeek-V3's
/// and GLM-4.5's sigmoid scores, a per-layer bias that steers the choice without entering
/// the weights, choice limited to the best groups of experts, and a scale on the weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routing {
    pub gating: Gating,
    /// The layer has a score-correction bias (`e_score_correction_bias`, GGUF
    /// `exp_probs_b`), added to the scores that choose.
    pub choice_bias: bool,
    /// Experts form `groups` equal groups in index order; a token chooses only among the
    /// `groups_used` groups whose two best (biased) scores sum highest. 1 and 1: no groups.
    pub groups: usize,
    pub groups_used: usize,
    /// The chosen weights (after any renormalisation) are multiplied by this
    /// (`routed_scaling_factor`).
    pub scale: f32,
}

impl Routing {
    /// Softmax scores, no bias, no groups, no scale.
    pub const SOFTMAX: Routing = Routing {
        gating: Gating::Softmax,
        choice_bias: false,
        groups: 1,
        groups_used: 1,
        scale: 1.0,
    };

    /// The routing keys llama.cpp writes under `{arch}.` (`expert_gating_func`: 1 softmax,
    /// 2 sigmoid; `expert_weights_scale`; `expert_group_count` / `expert_group_used_count`),
    /// `sigmoid` and `choice_bias` being the family's own defaults where a key is absent.
    pub fn from_gguf(g: &GgufFile, arch: &str, sigmoid: bool, choice_bias: bool) -> Routing {
        let key = |k: &str| format!("{arch}.{k}");
        let gating = match g.get_u64(&key("expert_gating_func")) {
            Some(1) => Gating::Softmax,
            Some(2) => Gating::Sigmoid,
            _ if sigmoid => Gating::Sigmoid,
            _ => Gating::Softmax,
        };
        let groups = g
            .get_u64(&key("expert_group_count"))
            .map_or(1, |v| v.max(1) as usize);
        Routing {
            gating,
            choice_bias,
            groups,
            groups_used: g
                .get_u64(&key("expert_group_used_count"))
                .map_or(groups, |v| v.max(1) as usize),
            scale: g
                .get_f64(&key("expert_weights_scale"))
                .filter(|&s| s > 0.0)
                .unwrap_or(1.0) as f32,
        }
    }

    /// The keys DeepSeek-V3-style `config.json`s share (`n_group`, `topk_group`,
    /// `routed_scaling_factor`, `scoring_func`), sigmoid scores with a correction bias unless
    /// `scoring_func` says softmax.
    pub fn from_hf(j: &Json) -> Result<Routing> {
        let gating = match j.get("scoring_func").and_then(Json::as_str) {
            None | Some("sigmoid") => Gating::Sigmoid,
            Some("softmax") => Gating::Softmax,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "config.json: scoring_func {other:?}"
                )))
            }
        };
        let groups = hf_opt_usize(j, "n_group").unwrap_or(1).max(1);
        Ok(Routing {
            gating,
            choice_bias: gating == Gating::Sigmoid
                && j.get("topk_method").and_then(Json::as_str) != Some("greedy"),
            groups,
            groups_used: hf_opt_usize(j, "topk_group").unwrap_or(groups).max(1),
            scale: hf_f64(j, "routed_scaling_factor").unwrap_or(1.0) as f32,
        })
    }
}

impl MoeConfig {
    /// The expert counts a MoE GGUF carries under `{arch}.`. llama.cpp's graphs route every
    /// layer and renormalise the top-k weights (a softmax over the top-k logits is the same),
    /// and the files carry no key saying otherwise.
    pub fn from_gguf(g: &GgufFile, arch: &str, style: MoeStyle) -> Result<MoeConfig> {
        let key = |k: &str| format!("{arch}.{k}");
        Ok(MoeConfig {
            style,
            n_experts: g.require_usize(&key("expert_count"))?,
            n_active: g.require_usize(&key("expert_used_count"))?,
            expert_ffn: g.require_usize(&key("expert_feed_forward_length"))?,
            norm_topk_prob: true,
            mlp_only_layers: Vec::new(),
            sparse_step: 1,
            shared_ffn: g
                .get_u64(&key("expert_shared_feed_forward_length"))
                .filter(|&v| v > 0)
                .map(|v| v as usize),
            shared_gate: true,
            routing: Routing::SOFTMAX,
        })
    }

    /// The DeepSeek-style experts llama.cpp writes under `{arch}.` (GLM-4.5, DeepSeek-V2/V3,
    /// Mistral 4): the first `leading_dense_block_count` of `n_layers` dense, weights
    /// renormalised only where `expert_weights_norm` says so, `expert_shared_count` ungated
    /// shared experts of the routed width, and [`Routing::from_gguf`]'s routing with the
    /// family's defaults.
    pub fn deepseek_from_gguf(
        g: &GgufFile,
        arch: &str,
        n_layers: usize,
        sigmoid: bool,
        choice_bias: bool,
    ) -> Result<MoeConfig> {
        let key = |k: &str| format!("{arch}.{k}");
        let mut m = MoeConfig::from_gguf(g, arch, MoeStyle::Qwen)?;
        let dense = g.get_u64(&key("leading_dense_block_count")).unwrap_or(0) as usize;
        m.mlp_only_layers = (0..dense.min(n_layers)).collect();
        m.norm_topk_prob = g.get_bool(&key("expert_weights_norm")).unwrap_or(false);
        let shared = g.get_u64(&key("expert_shared_count")).unwrap_or(0) as usize;
        m.shared_ffn = (shared > 0).then_some(shared * m.expert_ffn);
        m.shared_gate = false;
        m.routing = Routing::from_gguf(g, arch, sigmoid, choice_bias);
        Ok(m)
    }

    /// Whether layer `i` routes to experts (the rule of transformers' `Qwen3MoeDecoderLayer`).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.sparse_step > 0
            && (i + 1).is_multiple_of(self.sparse_step)
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rope_layout: RopeLayout,
    pub max_position: usize,
    pub tie_embeddings: bool,
    pub qkv_bias: bool,
    /// The output projection has a bias (gpt-oss).
    pub o_bias: bool,
    /// Each layer has one attention-sink logit per query head (gpt-oss).
    pub attn_sinks: bool,
    pub qk_norm: QkNorm,
    /// The window of every windowed layer (Mistral's, Gemma 3's local layers'), for reports;
    /// [`LayerSpec::window`] says which layers use it.
    pub sliding_window: Option<usize>,
    pub moe: Option<MoeConfig>,
    /// The Gated DeltaNet layers' shape, where [`LayerSpec::linear`] marks some.
    pub linear: Option<LinearAttn>,
    /// Multi-head latent attention (DeepSeek-V3, Mistral 4) in every attention layer. The
    /// attention op then sees [`Mla::row`]-wide heads over one KV head (so `head_dim`,
    /// `n_kv_heads` and `q_dim` are the absorbed ones), and the cache holds keys only.
    pub mla: Option<Mla>,
    /// Llama 4's and Mistral's query temperature: queries at position `p` are multiplied by
    /// `1 + beta · ln(1 + floor(p / floor))` (`(beta, floor)`).
    pub attn_temp: Option<(f32, usize)>,
    /// Gated attention (Qwen3.5): the query projection gives each head its queries and as
    /// many gate values, and the attention output is multiplied by their sigmoid.
    pub attn_gate: bool,
    /// One per layer: its attention window and which RoPE it uses.
    pub layers: Vec<LayerSpec>,
    /// Leading dimensions of a head that rotate (Phi-3/4's partial rotary); `head_dim` else.
    pub rotary_dim: usize,
    /// Multiplies RoPE's cos and sin (LongRoPE's attention factor); 1 elsewhere.
    pub rope_factor: f32,
    /// Gemma 3's local layers: their own RoPE base, unscaled.
    pub local_rope_theta: Option<f32>,
    /// Which norms a layer has, by the Hugging Face name of their weight.
    pub norms: NormPlan,
    /// Added to every RMSNorm weight at load: Hugging Face Gemma stores `w` and computes
    /// `x·(1 + w)`; its GGUFs already hold `1 + w`.
    pub norm_offset: f32,
    pub activation: Activation,
    /// Embeddings are multiplied by this (Gemma: √hidden; Granite: its multiplier).
    pub embed_scale: Option<f32>,
    /// Attention scores are multiplied by this: 1/√head_dim unless the family says otherwise
    /// (Gemma's `query_pre_attn_scalar`, Granite's `attention_multiplier`).
    pub attn_scale: f32,
    /// Each block's output is multiplied by this before the residual add (Granite).
    pub residual_scale: f32,
    /// Logits are multiplied by this (Granite divides by `logits_scaling`).
    pub logit_scale: f32,
    /// Logits pass through `cap · tanh(x / cap)` (Gemma 4's `final_logit_softcapping`).
    pub final_softcap: Option<f32>,
    /// Gemma 4's per-layer inputs: layer `l` also reads its `per_layer_input`-wide slice of
    /// a second embedding table mixed with a projection of the first (0: none).
    pub per_layer_input: usize,
    /// Each layer's output is multiplied by a learned scalar (Gemma 4's `layer_scalar`).
    pub layer_scalar: bool,
    /// Values are RMS-normalised per head without a weight, and a layer without a value
    /// projection uses its key projection's output as values (Gemma 4).
    pub v_norm: bool,
    /// How many dimensions the local layers rotate where it differs from `rotary_dim`
    /// (Gemma 4: its local heads are smaller than the global ones).
    pub local_rotary_dim: Option<usize>,
    /// Multimodal RoPE (Qwen VL): image rows rotate by time, height and width positions,
    /// pairs split between them as [`MRope`] says. Text rows, their three positions equal,
    /// rotate as plain RoPE.
    pub mrope: Option<MRope>,
}

/// How M-RoPE gives each rotated pair one of the three position axes (time, height, width).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MRope {
    /// `mrope_section`: pairs per axis.
    pub sections: [usize; 3],
    /// Qwen3-VL's layout: pairs take the axes in turn (t, h, w, t, …) while each axis has
    /// pairs left, the rest time. Qwen2-VL and Qwen2.5-VL: the sections in order.
    pub interleaved: bool,
}

impl MRope {
    /// The axis of each of `pairs` rotated pairs (pairs past the sections: time).
    pub fn pair_axes(&self, pairs: usize) -> Vec<u8> {
        let [t, h, _] = self.sections;
        (0..pairs)
            .map(|i| {
                if self.interleaved {
                    match i % 3 {
                        1 if i < 3 * self.sections[1] => 1,
                        2 if i < 3 * self.sections[2] => 2,
                        _ => 0,
                    }
                } else if i < t {
                    0
                } else if i < t + h {
                    1
                } else {
                    2
                }
            })
            .collect()
    }

    /// From a config's `mrope_section` (in `rope_parameters` or the older `rope_scaling`).
    pub fn from_hf(j: &Json, interleaved: bool) -> Option<MRope> {
        let s = ["rope_parameters", "rope_scaling"]
            .iter()
            .find_map(|k| j.get(*k)?.get("mrope_section")?.as_array().cloned())?;
        let v: Vec<usize> = s
            .iter()
            .filter_map(Json::as_u64)
            .map(|v| v as usize)
            .collect();
        match v[..] {
            [t, h, w] => Some(MRope {
                sections: [t, h, w],
                interleaved,
            }),
            _ => None,
        }
    }
}

/// How the query and key projections are normalised before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Per head, a `head_dim` weight (Qwen3, Gemma 3).
    PerHead,
    /// Over the whole projection, a `q_dim` / `kv_dim` weight (OLMo 2).
    Whole,
}

/// Which RoPE a layer applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    /// The model's RoPE (`rope_theta`, with any scaling).
    Global,
    /// Gemma 3's local layers: `local_rope_theta`, unscaled.
    Local,
    /// No rotation (SmolLM3's every fourth layer).
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// A query at position `p` sees keys at positions `> p - window`; `None` is full causal
    /// attention.
    pub window: Option<usize>,
    pub rope: Rope,
    /// A Gated DeltaNet (linear-attention) layer: a recurrent state per sequence instead of
    /// attention and KV (Qwen3.5's `linear_attention` layers); `window` and `rope` unused.
    pub linear: bool,
    /// This layer's KV heads and head size where they differ from the model's
    /// `n_kv_heads` × `head_dim` (Gemma 4's full-attention layers).
    pub shape: Option<(usize, usize)>,
    /// A layer that computes only queries and attends over layer `kv_from`'s cache, which
    /// it keeps none of its own (Gemma 4's KV-shared layers).
    pub kv_from: Option<usize>,
    /// The dense FFN's width where it differs from `intermediate_size` (Gemma 4's
    /// double-wide KV-shared layers).
    pub ffn: Option<usize>,
}

impl LayerSpec {
    /// Full attention with the model's RoPE and shapes.
    pub const GLOBAL: LayerSpec = LayerSpec {
        window: None,
        rope: Rope::Global,
        linear: false,
        shape: None,
        kv_from: None,
        ffn: None,
    };
}

/// The shape of multi-head latent attention: each position caches one latent of
/// `kv_rank` values (normalised) and one rotary key of `rope_dim`, shared by every head; a
/// head's key is `[W_uk · latent, rotary key]` and its value `W_uv · latent`. Queries are
/// `nope_dim + rope_dim` per head, from the hidden state directly or through a `q_rank`-wide
/// bottleneck.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mla {
    pub q_rank: Option<usize>,
    pub kv_rank: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
}

impl Mla {
    /// One query head as the projection gives it (no-position part, then rotary part).
    pub fn q_head(&self) -> usize {
        self.nope_dim + self.rope_dim
    }

    /// One cache row: the rotary key, then the latent. A head's absorbed query is laid out
    /// the same way (its rotary part, then `W_ukᵀ` times its no-position part), so the
    /// attention op scores it against the row as it is, and the latent part of the row is
    /// what the op averages as the value.
    pub fn row(&self) -> usize {
        self.rope_dim + self.kv_rank
    }
}

/// The Gated DeltaNet layers' shape (Qwen3.5, Qwen3.5-MoE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearAttn {
    /// Taps of the depthwise causal convolution over the fused q/k/v projection.
    pub conv_kernel: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// Value heads in llama.cpp's tiled order (its converter reorders them; see
    /// `ferrum_backend::DeltaParams::tiled`).
    pub tiled: bool,
}

impl LinearAttn {
    /// Width of the fused q/k/v projection, which the convolution runs over.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Floats of one sequence's recurrent state in one layer: the convolution's last
    /// `conv_kernel − 1` inputs and every value head's `k_dim × v_dim` delta-rule state.
    pub fn state_floats(&self) -> (usize, usize) {
        (
            self.conv_kernel.saturating_sub(1) * self.conv_dim(),
            self.v_heads * self.k_dim * self.v_dim,
        )
    }
}

/// The norms of a layer, each the Hugging Face name template of its weight (`{i}` the layer)
/// or `None` where the family has no such norm. A Llama layer has the two pre-norms; Gemma
/// has all four; OLMo 2 only the two post-norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormPlan {
    /// Before attention.
    pub attn_in: Option<&'static str>,
    /// On the attention block's output, before the residual add.
    pub attn_out: Option<&'static str>,
    /// Before the FFN.
    pub ffn_in: Option<&'static str>,
    /// On the FFN's output, before the residual add.
    pub ffn_out: Option<&'static str>,
}

impl NormPlan {
    /// Llama's: RMSNorm before attention and before the FFN.
    pub const PRE: NormPlan = NormPlan {
        attn_in: Some("model.layers.{i}.input_layernorm.weight"),
        attn_out: None,
        ffn_in: Some("model.layers.{i}.post_attention_layernorm.weight"),
        ffn_out: None,
    };
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Layer `i`'s KV heads and head size.
    pub fn layer_kv_shape(&self, i: usize) -> (usize, usize) {
        self.layers
            .get(i)
            .and_then(|l| l.shape)
            .unwrap_or((self.n_kv_heads, self.head_dim))
    }

    pub fn layer_head_dim(&self, i: usize) -> usize {
        self.layer_kv_shape(i).1
    }

    pub fn layer_q_dim(&self, i: usize) -> usize {
        self.n_heads * self.layer_head_dim(i)
    }

    pub fn layer_kv_dim(&self, i: usize) -> usize {
        let (heads, dim) = self.layer_kv_shape(i);
        heads * dim
    }

    /// Layer `i`'s dense FFN width.
    pub fn layer_ffn(&self, i: usize) -> usize {
        self.layers
            .get(i)
            .and_then(|l| l.ffn)
            .unwrap_or(self.intermediate_size)
    }

    /// Whether layer `i` keeps keys and values of its own (not a linear-attention layer, nor
    /// one reading another layer's cache).
    pub fn owns_kv(&self, i: usize) -> bool {
        self.layers
            .get(i)
            .is_some_and(|l| !l.linear && l.kv_from.is_none())
    }

    /// Cache values one position takes over every layer that keeps its own (keys and values).
    pub fn kv_values_per_token(&self) -> usize {
        let layers = 0..self.n_layers;
        self.kv_tensors()
            * layers
                .filter(|&i| self.owns_kv(i))
                .map(|i| self.layer_kv_dim(i))
                .sum::<usize>()
    }

    /// The widest of any layer's queries, cached rows and dense FFN (for buffers).
    pub fn max_layer_dims(&self) -> (usize, usize, usize) {
        (0..self.n_layers).fold(
            (self.q_dim(), self.kv_dim(), self.intermediate_size),
            |(q, kv, f), i| {
                (
                    q.max(self.layer_q_dim(i)),
                    kv.max(self.layer_kv_dim(i)),
                    f.max(self.layer_ffn(i)),
                )
            },
        )
    }

    /// Cache tensors per attention layer: keys and values, or keys alone under latent
    /// attention (the values are the keys' latent part).
    pub fn kv_tensors(&self) -> usize {
        if self.mla.is_some() {
            1
        } else {
            2
        }
    }

    /// Layers that keep a recurrent state instead of KV (Gated DeltaNet).
    pub fn linear_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.linear).count()
    }

    /// Bytes of one sequence's recurrent state (f32) over every linear-attention layer; 0
    /// for models without such layers.
    pub fn state_bytes(&self) -> usize {
        self.linear.as_ref().map_or(0, |l| {
            let (conv, delta) = l.state_floats();
            4 * self.linear_layers() * (conv + delta)
        })
    }

    /// Inverse RoPE frequencies of the model's (global) RoPE, one per rotated pair, with any
    /// scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        inv_freq(self.rope_theta, self.rotary_dim, self.rope_scaling.as_ref())
    }

    /// Gemma 3's local layers' frequencies (unscaled), if the model has such layers.
    pub fn local_inv_freq(&self) -> Option<Vec<f32>> {
        let dims = self.local_rotary_dim.unwrap_or(self.rotary_dim);
        self.local_rope_theta
            .map(|theta| inv_freq(theta, dims, None))
    }

    fn validate(self, source: &str) -> Result<Self> {
        let bad = |m: String| Err(Error::Weights(format!("{source}: {m}")));
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return bad(format!(
                "{} attention heads cannot be grouped over {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dimension {} must be even", self.head_dim));
        }
        if self.hidden_size == 0 || self.n_layers == 0 || self.vocab_size == 0 {
            return bad("hidden size, layer count and vocabulary must be non-zero".into());
        }
        if let Some(m) = &self.moe {
            if m.n_experts == 0 || m.n_active == 0 || m.n_active > m.n_experts || m.expert_ffn == 0
            {
                return bad(format!(
                    "{} experts with {} active per token and width {} is not a valid MoE",
                    m.n_experts, m.n_active, m.expert_ffn
                ));
            }
        }
        Ok(self)
    }

    /// Llama's choices for what the shared keys do not say (pre-norms, SwiGLU, full RoPE in
    /// every layer, no multipliers), around placeholder sizes the readers fill in.
    fn llama_layers(
        n_layers: usize,
        head_dim: usize,
        rotary_dim: usize,
        sliding_window: Option<usize>,
    ) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 0,
            hidden_size: 0,
            n_layers,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim,
            intermediate_size: 0,
            rms_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            rope_layout: RopeLayout::Neox,
            max_position: 4096,
            tie_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            attn_sinks: false,
            qk_norm: QkNorm::None,
            sliding_window,
            moe: None,
            linear: None,
            mla: None,
            attn_temp: None,
            attn_gate: false,
            layers: vec![
                LayerSpec {
                    window: sliding_window,
                    ..LayerSpec::GLOBAL
                };
                n_layers
            ],
            rotary_dim,
            rope_factor: 1.0,
            local_rope_theta: None,
            norms: NormPlan::PRE,
            norm_offset: 0.0,
            activation: Activation::Silu,
            embed_scale: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            residual_scale: 1.0,
            logit_scale: 1.0,
            final_softcap: None,
            per_layer_input: 0,
            layer_scalar: false,
            v_norm: false,
            local_rotary_dim: None,
            mrope: None,
        }
    }

    /// The keys every Llama-style `config.json` shares, with Llama's choices for the rest
    /// (pre-norms, SwiGLU, full RoPE in every layer, no bias unless `attention_bias`).
    pub fn hf_base(arch: Arch, j: &Json) -> Result<ModelConfig> {
        let hidden = hf_usize(j, "hidden_size")?;
        let n_heads = hf_usize(j, "num_attention_heads")?;
        let n_kv = hf_opt_usize(j, "num_key_value_heads").unwrap_or(n_heads);
        let head_dim = hf_opt_usize(j, "head_dim").unwrap_or(hidden / n_heads.max(1));
        let n_layers = hf_usize(j, "num_hidden_layers")?;
        // transformers 5 moves rope settings into `rope_parameters`; older files use
        // `rope_theta` and `rope_scaling`.
        let rope_params = j.get("rope_parameters");
        let rope_theta = hf_f64(j, "rope_theta")
            .or_else(|| rope_params.and_then(|p| hf_f64(p, "rope_theta")))
            .unwrap_or(10000.0) as f32;
        let scaling_obj = j
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or(rope_params);
        let rope_scaling = match scaling_obj {
            Some(s) => parse_hf_scaling(s)?,
            None => None,
        };
        let partial = hf_f64(j, "partial_rotary_factor")
            .or_else(|| rope_params.and_then(|p| hf_f64(p, "partial_rotary_factor")))
            .unwrap_or(1.0);
        let rotary_dim = ((head_dim as f64 * partial) as usize) & !1;
        let sliding_window = if j.get("use_sliding_window").and_then(Json::as_bool) == Some(true) {
            hf_opt_usize(j, "sliding_window").filter(|&w| w > 0)
        } else {
            None
        };
        // YaRN's attention temperature rides on cos and sin, for every family that uses it.
        let rope_factor = rope_scaling
            .as_ref()
            .map_or(1.0, RopeScaling::attention_factor);
        ModelConfig {
            arch,
            rope_factor,
            vocab_size: hf_usize(j, "vocab_size")?,
            hidden_size: hidden,
            n_layers,
            n_heads,
            n_kv_heads: n_kv,
            head_dim,
            intermediate_size: hf_opt_usize(j, "intermediate_size").unwrap_or(0),
            rms_eps: hf_f64(j, "rms_norm_eps").unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            rope_layout: RopeLayout::Neox,
            max_position: hf_opt_usize(j, "max_position_embeddings").unwrap_or(4096),
            tie_embeddings: j
                .get("tie_word_embeddings")
                .and_then(Json::as_bool)
                .unwrap_or(false),
            qkv_bias: j
                .get("attention_bias")
                .and_then(Json::as_bool)
                .unwrap_or(false),
            ..ModelConfig::llama_layers(n_layers, head_dim, rotary_dim, sliding_window)
        }
        .validate("config.json")
    }

    /// The `{arch}.*` keys every Llama-style GGUF shares. Vocabulary size and whether the
    /// output head is tied come from the tensors, which the caller passes in.
    pub fn gguf_base(
        arch: Arch,
        g: &GgufFile,
        vocab_size: usize,
        tie_embeddings: bool,
    ) -> Result<ModelConfig> {
        let a = g.architecture()?.to_string();
        let key = |k: &str| format!("{a}.{k}");
        let hidden = g.require_usize(&key("embedding_length"))?;
        let n_heads = g.require_usize(&key("attention.head_count"))?;
        let n_kv = g
            .get_u64(&key("attention.head_count_kv"))
            .map_or(n_heads, |v| v as usize);
        let head_dim = g
            .get_u64(&key("attention.key_length"))
            .map_or(hidden / n_heads.max(1), |v| v as usize);
        let n_layers = g.require_usize(&key("block_count"))?;
        let rope_scaling = match g.get_str(&key("rope.scaling.type")) {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: g.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0) as f32,
            }),
            Some("yarn") => {
                let f = |k: &str, d: f64| g.get_f64(&key(k)).unwrap_or(d) as f32;
                let factor = f("rope.scaling.factor", 1.0);
                // llama.cpp always rounds the ramp's ends outwards (`ggml_rope_yarn_corr_dims`),
                // and scales cos/sin by YaRN's 0.1 · m · ln(factor) + 1 times
                // `rope.scaling.attn_factor`: m = 1, divided by the same with
                // m = `yarn_log_multiplier` where the file has one (transformers' `mscale` /
                // `mscale_all_dim` with `mscale` 1: Ministral 3, DeepSeek-V3).
                let mscale = |m: f32| {
                    if factor > 1.0 {
                        1.0 + 0.1 * m * factor.ln()
                    } else {
                        1.0
                    }
                };
                let mscale = match g
                    .get_f64(&key("rope.scaling.yarn_log_multiplier"))
                    .filter(|&m| m != 0.0)
                {
                    Some(all) => mscale(1.0) / mscale(all as f32),
                    None => mscale(1.0),
                };
                Some(RopeScaling::Yarn {
                    factor,
                    beta_fast: f("rope.scaling.yarn_beta_fast", 32.0),
                    beta_slow: f("rope.scaling.yarn_beta_slow", 1.0),
                    original_max_position: g
                        .get_u64(&key("rope.scaling.original_context_length"))
                        .or_else(|| g.get_u64(&key("context_length")))
                        .map_or(4096.0, |v| v as f32),
                    truncate: true,
                    attention_factor: mscale * f("rope.scaling.attn_factor", 1.0),
                })
            }
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: RoPE scaling {other:?}",
                    g.path.display()
                )))
            }
        };
        let rotary_dim = g
            .get_u64(&key("rope.dimension_count"))
            .map_or(head_dim, |v| v as usize);
        // Converters write 0 for "no window".
        let sliding_window = g
            .get_u64(&key("attention.sliding_window"))
            .filter(|&v| v > 0)
            .map(|v| v as usize);
        let rope_factor = rope_scaling
            .as_ref()
            .map_or(1.0, RopeScaling::attention_factor);
        ModelConfig {
            arch,
            rope_factor,
            vocab_size,
            hidden_size: hidden,
            n_layers,
            n_heads,
            n_kv_heads: n_kv,
            head_dim,
            intermediate_size: g
                .get_u64(&key("feed_forward_length"))
                .map_or(0, |v| v as usize),
            rms_eps: g
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6) as f32,
            rope_theta: g.get_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32,
            rope_scaling,
            rope_layout: RopeLayout::Neox,
            max_position: g
                .get_u64(&key("context_length"))
                .map_or(4096, |v| v as usize),
            tie_embeddings,
            qkv_bias: false,
            ..ModelConfig::llama_layers(n_layers, head_dim, rotary_dim, sliding_window)
        }
        .validate(&g.path.display().to_string())
    }

    /// Drops the multi-token-prediction layers llama.cpp counts in `block_count` and names in
    /// `{arch}.nextn_predict_layers` (GLM-4.5, DeepSeek-V3): they sit after the model's own
    /// and are not run.
    pub fn drop_gguf_nextn(&mut self, g: &GgufFile, arch: &str) -> Result<()> {
        let nextn = g
            .get_u64(&format!("{arch}.nextn_predict_layers"))
            .unwrap_or(0) as usize;
        if nextn >= self.n_layers {
            return Err(Error::Weights(format!(
                "{}: {nextn} prediction layers of {} blocks leave no model",
                g.path.display(),
                self.n_layers
            )));
        }
        self.n_layers -= nextn;
        self.layers.truncate(self.n_layers);
        Ok(())
    }

    /// Sets the same window on every layer (Mistral, Qwen2 with `use_sliding_window`).
    pub fn set_window_all(&mut self, window: Option<usize>) {
        self.sliding_window = window;
        for l in &mut self.layers {
            l.window = window;
        }
    }

    /// Fixes what depends on the context the model is loaded for: LongRoPE's long factors
    /// past its original context, its short ones within it.
    pub fn resolve_context(&mut self, context: usize) {
        if let Some(RopeScaling::LongRope {
            short,
            long,
            original_max_position,
        }) = &self.rope_scaling
        {
            let f = if *original_max_position > 0 && context > *original_max_position {
                long.clone()
            } else {
                short.clone()
            };
            self.rope_scaling = Some(RopeScaling::Factors(f));
        }
    }

    /// Checks the finished configuration (an architecture file calls it last).
    pub fn check(self, source: &str) -> Result<Self> {
        let c = self.validate(source)?;
        let bad = |m: String| Err(Error::Weights(format!("{source}: {m}")));
        if c.intermediate_size == 0 && c.moe.is_none() {
            return bad("no feed-forward width (intermediate_size / feed_forward_length)".into());
        }
        let widest = (0..c.n_layers).map(|i| c.layer_head_dim(i)).max();
        let head = widest.unwrap_or(0).max(c.head_dim);
        if c.rotary_dim == 0 || c.rotary_dim > head || !c.rotary_dim.is_multiple_of(2) {
            return bad(format!(
                "{} rotary dimensions do not fit a head of {head}",
                c.rotary_dim
            ));
        }
        for (i, l) in c.layers.iter().enumerate() {
            if let Some(p) = l.kv_from {
                let ok = p < i && c.owns_kv(p) && c.layers[p].window == l.window;
                if !ok || c.layer_kv_shape(p) != c.layer_kv_shape(i) {
                    return bad(format!(
                        "layer {i} cannot read layer {p}'s cache (not an earlier layer of \
                         its own kind that keeps one)"
                    ));
                }
            }
            if let Some((heads, dim)) = l.shape {
                if heads == 0 || dim == 0 || !c.n_heads.is_multiple_of(heads) || dim % 2 != 0 {
                    return bad(format!(
                        "layer {i}: {} heads over {heads} KV heads of {dim}",
                        c.n_heads
                    ));
                }
            }
        }
        if c.layers.len() != c.n_layers {
            return bad(format!(
                "{} layer kinds for {} layers",
                c.layers.len(),
                c.n_layers
            ));
        }
        if c.layers.iter().any(|l| l.linear) && c.linear.is_none() {
            return bad("linear-attention layers without their shape".into());
        }
        if c.layers.iter().all(|l| l.linear) {
            return bad("no attention layer: every layer is linear attention".into());
        }
        if let Some(l) = &c.linear {
            if l.k_heads == 0
                || l.v_heads == 0
                || !l.v_heads.is_multiple_of(l.k_heads)
                || l.k_dim == 0
                || l.v_dim == 0
                || l.conv_kernel == 0
                || l.conv_kernel > 64
            {
                return bad(format!(
                    "linear attention of {} key heads of {}, {} value heads of {}, \
                     {} convolution taps is not a valid shape",
                    l.k_heads, l.k_dim, l.v_heads, l.v_dim, l.conv_kernel
                ));
            }
        }
        if let Some(m) = &c.moe {
            let r = m.routing;
            if r.groups == 0
                || !m.n_experts.is_multiple_of(r.groups)
                || r.groups_used == 0
                || r.groups_used > r.groups
                || r.groups_used * (m.n_experts / r.groups) < m.n_active
                || !r.scale.is_finite()
            {
                return bad(format!(
                    "{} experts in {} groups, {} of them used, {} experts a token, scale {}: \
                     not a valid routing",
                    m.n_experts, r.groups, r.groups_used, m.n_active, r.scale
                ));
            }
        }
        if c.attn_temp.is_some_and(|(b, f)| f == 0 || !b.is_finite()) {
            return bad("an attention temperature without its length".into());
        }
        if c.layers.iter().any(|l| l.window == Some(0)) {
            return bad("a sliding window of 0 positions".into());
        }
        if !(c.attn_scale.is_finite() && c.residual_scale.is_finite() && c.logit_scale.is_finite())
        {
            return bad("a non-finite multiplier".into());
        }
        Ok(c)
    }
}

/// A required unsigned key of a `config.json`.
pub(crate) fn hf_usize(j: &Json, k: &str) -> Result<usize> {
    hf_opt_usize(j, k)
        .ok_or_else(|| Error::Weights(format!("config.json: missing or invalid {k:?}")))
}

pub(crate) fn hf_opt_usize(j: &Json, k: &str) -> Option<usize> {
    j.get(k).and_then(Json::as_u64).map(|v| v as usize)
}

/// The id of `word` in a Hugging Face `tokenizer.json` (its vocabulary, then its added
/// tokens).
pub(crate) fn hf_vocab_id(tokenizer: &Json, word: &str) -> Option<u32> {
    let added = tokenizer.get("added_tokens").and_then(Json::as_array);
    tokenizer
        .get("model")
        .and_then(|m| m.get("vocab"))
        .and_then(|v| v.get(word))
        .and_then(Json::as_u64)
        .or_else(|| {
            added?
                .iter()
                .find(|t| t.get("content").and_then(Json::as_str) == Some(word))?
                .get("id")?
                .as_u64()
        })
        .map(|v| v as u32)
}

pub(crate) fn hf_f64(j: &Json, k: &str) -> Option<f64> {
    j.get(k).and_then(Json::as_f64)
}

/// Inverse RoPE frequencies for `dims` rotated dimensions, computed as Hugging Face does
/// (`1 / theta^(2i/dims)`), in f64 then rounded once, with any scaling applied.
pub fn inv_freq(theta: f32, dims: usize, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let base: Vec<f64> = (0..dims / 2)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / dims as f64))
        .collect();
    let scaled: Vec<f64> = match scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / *factor as f64).collect(),
        Some(RopeScaling::Factors(div) | RopeScaling::LongRope { short: div, .. }) => base
            .iter()
            .zip(div.iter().chain(std::iter::repeat(&1.0)))
            .map(|(f, d)| f / *d as f64)
            .collect(),
        Some(RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position,
            truncate,
            ..
        }) => {
            // transformers' `_compute_yarn_parameters`.
            let (d, b) = (dims as f64, theta as f64);
            let corr = |rotations: f64| {
                d * (*original_max_position as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * b.ln())
            };
            let (mut lo, mut hi) = (corr(*beta_fast as f64), corr(*beta_slow as f64));
            if *truncate {
                lo = lo.floor();
                hi = hi.ceil();
            }
            let (lo, mut hi) = (lo.max(0.0), hi.min(d - 1.0));
            if lo == hi {
                hi += 0.001;
            }
            base.iter()
                .enumerate()
                .map(|(i, &f)| {
                    let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    // Kept where the ramp is 0 (fast rotations), interpolated where it is 1.
                    f / *factor as f64 * ramp + f * (1.0 - ramp)
                })
                .collect()
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        }) => {
            let (factor, lo, hi, old) = (
                *factor as f64,
                *low_freq_factor as f64,
                *high_freq_factor as f64,
                *original_max_position as f64,
            );
            let low_wavelen = old / lo;
            let high_wavelen = old / hi;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

pub(crate) fn parse_hf_scaling(s: &Json) -> Result<Option<RopeScaling>> {
    let ty = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Json::as_str)
        .unwrap_or("default");
    let f = |k: &str, d: f64| s.get(k).and_then(Json::as_f64).unwrap_or(d) as f32;
    Ok(match ty {
        // Qwen2-VL's `{"type": "mrope", "mrope_section": ...}`: sections, not a scaling.
        "default" | "mrope" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: f("factor", 1.0),
        }),
        "longrope" | "su" => {
            let list = |k: &str| -> Result<Vec<f32>> {
                s.get(k)
                    .and_then(Json::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(Json::as_f64)
                            .map(|v| v as f32)
                            .collect()
                    })
                    .ok_or_else(|| Error::Weights(format!("config.json: longrope without {k}")))
            };
            Some(RopeScaling::LongRope {
                short: list("short_factor")?,
                long: list("long_factor")?,
                original_max_position: s
                    .get("original_max_position_embeddings")
                    .and_then(Json::as_u64)
                    .unwrap_or(0) as usize,
            })
        }
        "yarn" => {
            let factor = f("factor", 1.0);
            let mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match (
                s.get("attention_factor").and_then(Json::as_f64),
                s.get("mscale").and_then(Json::as_f64).filter(|&m| m != 0.0),
                s.get("mscale_all_dim")
                    .and_then(Json::as_f64)
                    .filter(|&m| m != 0.0),
            ) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) => mscale(factor as f64, m) / mscale(factor as f64, all),
                _ => mscale(factor as f64, 1.0),
            } as f32;
            Some(RopeScaling::Yarn {
                factor,
                beta_fast: s
                    .get("beta_fast")
                    .and_then(Json::as_f64)
                    .filter(|&b| b != 0.0)
                    .unwrap_or(32.0) as f32,
                beta_slow: s
                    .get("beta_slow")
                    .and_then(Json::as_f64)
                    .filter(|&b| b != 0.0)
                    .unwrap_or(1.0) as f32,
                original_max_position: s
                    .get("original_max_position_embeddings")
                    .and_then(Json::as_f64)
                    .ok_or_else(|| {
                        Error::Weights(
                            "config.json: yarn without original_max_position_embeddings".into(),
                        )
                    })? as f32,
                truncate: s.get("truncate").and_then(Json::as_bool).unwrap_or(true),
                attention_factor,
            })
        }
        "llama3" => Some(RopeScaling::Llama3 {
            factor: f("factor", 8.0),
            low_freq_factor: f("low_freq_factor", 1.0),
            high_freq_factor: f("high_freq_factor", 4.0),
            original_max_position: f("original_max_position_embeddings", 8192.0),
        }),
        other => {
            return Err(Error::Unsupported(format!("RoPE scaling type {other:?}")));
        }
    })
}

/// How a model's layers share KV blocks. Layers with the same attention window form groups
/// of equal size (the greatest common divisor of the counts), and a block holds the keys and
/// values of one group's layers for `block_size` positions: every group draws from one pool
/// of equal blocks, and each sequence has a block table per group. A windowed group needs
/// only its last `window` positions, so its older blocks go back to the pool as a sequence
/// grows (Gemma 3 270M: one group of its 3 global layers, five of its 15 local ones). A model
/// without windows is one group of every layer: one table, as before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// Each group's layers, and their window.
    pub groups: Vec<(Vec<usize>, Option<usize>)>,
    /// `(group, slot within the group)` of each layer (a KV-shared layer: its source's).
    pub slot_of: Vec<(usize, usize)>,
    /// Layers per group: the KV storage holds this many layers' worth of every block.
    pub slots: usize,
    /// Which row shape each group's layers have: an index into `shapes`.
    pub class_of: Vec<usize>,
    /// The distinct `LayerSpec::shape`s of the groups (`None`: the model's own). Each keeps
    /// its own `slots` buffers, every block in each, so a model with two shapes (Gemma 4)
    /// holds both widths for every block.
    pub shapes: Vec<Option<(usize, usize)>>,
}

/// The table entry of a block a windowed group has given back (positions it no longer sees).
pub const NO_BLOCK: u32 = u32::MAX;

impl KvGroups {
    pub fn new(layers: &[LayerSpec]) -> KvGroups {
        type Kind = (Option<usize>, Option<(usize, usize)>);
        let mut by_kind: Vec<(Kind, Vec<usize>)> = Vec::new();
        // Linear-attention layers keep no KV, nor do layers reading another's cache: they
        // are in no group.
        for (i, l) in layers.iter().enumerate() {
            if l.linear || l.kv_from.is_some() {
                continue;
            }
            let kind = (l.window, l.shape);
            match by_kind.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, v)) => v.push(i),
                None => by_kind.push((kind, vec![i])),
            }
        }
        let gcd = |mut a: usize, mut b: usize| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let slots = by_kind.iter().fold(0, |g, (_, v)| gcd(g, v.len())).max(1);
        let mut groups = Vec::new();
        let mut class_of = Vec::new();
        let mut shapes: Vec<Option<(usize, usize)>> = Vec::new();
        let mut slot_of = vec![(0, 0); layers.len()];
        for ((w, shape), v) in by_kind {
            let class = match shapes.iter().position(|s| *s == shape) {
                Some(c) => c,
                None => {
                    shapes.push(shape);
                    shapes.len() - 1
                }
            };
            for chunk in v.chunks(slots) {
                for (s, &li) in chunk.iter().enumerate() {
                    slot_of[li] = (groups.len(), s);
                }
                groups.push((chunk.to_vec(), w));
                class_of.push(class);
            }
        }
        for (i, l) in layers.iter().enumerate() {
            if let Some(p) = l.kv_from.filter(|&p| p < i) {
                slot_of[i] = slot_of[p];
            }
        }
        if shapes.is_empty() {
            shapes.push(None);
        }
        KvGroups {
            groups,
            slot_of,
            slots,
            class_of,
            shapes,
        }
    }

    /// Which of the cache's buffers holds layer `li`'s rows.
    pub fn buffer_of(&self, li: usize) -> usize {
        let (group, slot) = self.slot_of[li];
        self.class_of.get(group).copied().unwrap_or(0) * self.slots + slot
    }

    /// The buffers' `(heads, head_dim)`, one per buffer, given the model's own shape.
    pub fn buffer_shapes(&self, model: (usize, usize)) -> Vec<(usize, usize)> {
        self.shapes
            .iter()
            .flat_map(|s| std::iter::repeat_n(s.unwrap_or(model), self.slots))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Whether some group gives blocks back as sequences grow.
    pub fn windowed(&self) -> bool {
        self.groups.iter().any(|(_, w)| w.is_some())
    }

    /// The first block a group must still hold once a sequence's first `computed`
    /// positions are cached: the next query (at `computed` or later) sees keys past
    /// `computed - window`.
    pub fn first_needed(window: Option<usize>, computed: usize, block_size: usize) -> usize {
        window.map_or(0, |w| (computed + 1).saturating_sub(w) / block_size)
    }

    /// Blocks one sequence of `tokens` positions holds at most, over all groups, when it
    /// is computed in passes of up to `chunk` tokens.
    pub fn blocks_for(&self, tokens: usize, block_size: usize, chunk: usize) -> usize {
        let full = tokens.div_ceil(block_size);
        self.groups
            .iter()
            .map(|(_, w)| match w {
                // The window behind a pass's first query, the pass itself, and a block of
                // slack on either side for positions that do not start a block.
                Some(w) => full.min((w + chunk).div_ceil(block_size) + 2),
                None => full,
            })
            .sum()
    }

    /// The longest sequence `blocks` blocks hold (the inverse of [`Self::blocks_for`]).
    pub fn tokens_for(&self, blocks: usize, block_size: usize, chunk: usize) -> usize {
        let (mut lo, mut hi) = (0usize, blocks.saturating_mul(block_size));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.blocks_for(mid, block_size, chunk) <= blocks {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(window: Option<usize>) -> LayerSpec {
        LayerSpec {
            window,
            ..LayerSpec::GLOBAL
        }
    }

    #[test]
    fn kv_groups_of_equal_size() {
        // Gemma 3 270M: 18 layers, every sixth global.
        let layers: Vec<_> = (0..18)
            .map(|i| spec((!(i + 1usize).is_multiple_of(6)).then_some(512)))
            .collect();
        let g = KvGroups::new(&layers);
        assert_eq!(g.slots, 3);
        assert_eq!(g.len(), 6);
        assert_eq!(g.groups[0], (vec![0, 1, 2], Some(512)));
        assert_eq!(g.groups[5], (vec![5, 11, 17], None));
        assert_eq!(g.slot_of[11], (5, 1));
        // Full attention everywhere: one group, one table.
        let g = KvGroups::new(&vec![spec(None); 30]);
        assert_eq!((g.len(), g.slots, g.windowed()), (1, 30, false));
        // 32k positions: the global group's 2048 blocks, five windows of 38.
        let g = KvGroups::new(&layers);
        assert_eq!(g.blocks_for(32768, 16, 64), 2048 + 5 * 38);
        assert_eq!(g.blocks_for(100, 16, 64), 6 * 7);
        for blocks in [1, 7, 42, 100, 2238, 5000] {
            let t = g.tokens_for(blocks, 16, 64);
            assert!(g.blocks_for(t, 16, 64) <= blocks);
            assert!(g.blocks_for(t + 1, 16, 64) > blocks);
        }
        assert_eq!(KvGroups::first_needed(Some(512), 600, 16), 5);
        assert_eq!(KvGroups::first_needed(Some(512), 400, 16), 0);
        assert_eq!(KvGroups::first_needed(None, 600, 16), 0);
    }
}
