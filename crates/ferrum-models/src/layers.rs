//! The shared pieces every architecture is built from: attention (separate or fused QKV,
//! biases, QK-norm per head or over the whole projection, RoPE or none, a window or none),
//! the gated FFN (SwiGLU or GeGLU, separate or fused gate/up), the MoE FFN, and the norms
//! around them. What a layer has comes from its [`ModelConfig`]; the order they run in is
//! [`crate::decoder`]'s.

use ferrum_backend::{AttentionParams, AttnSeq, Backend, MatmulPart, RopeParams, Rows};
use ferrum_core::{DType, Error, Result};
use ferrum_loader::{RawTensor, TensorStore};

use crate::config::{LayerSpec, ModelConfig, MoeStyle, QkNorm};
use crate::linear::DeltaNet;
use crate::lora::{LayerLora, Target};
use crate::mla::LatentAttention;
use crate::moe::MoeLayer;
use crate::names;

/// Looks tensors up by Hugging Face name in either kind of file.
pub struct WeightSource<'a> {
    pub store: &'a TensorStore,
    pub gguf: bool,
    /// The family's own Hugging Face → GGUF names, consulted before the shared table.
    pub names: &'static [(&'static str, &'static str)],
}

impl WeightSource<'_> {
    pub fn name(&self, hf: &str, layer: usize) -> String {
        let i = layer.to_string();
        if self.gguf {
            return match self.names.iter().find(|(h, _)| *h == hf) {
                Some((_, g)) => g.replace("{i}", &i),
                None => names::gguf_name(hf, layer).unwrap_or_else(|| hf.to_string()),
            };
        }
        let name = hf.replace("{i}", &i);
        if self.store.contains(&name) {
            return name;
        }
        // Multimodal checkpoints (Gemma 3) keep the language model under a prefix of its own
        // (transformers 5, then 4).
        if let Some(rest) = name.strip_prefix("model.") {
            for prefix in ["model.language_model.", "language_model.model."] {
                let alt = format!("{prefix}{rest}");
                if self.store.contains(&alt) {
                    return alt;
                }
            }
        } else {
            // The head beside it (transformers 4's `language_model.lm_head`): missed, a
            // multimodal Mistral 3 would run with its embeddings as the head.
            let alt = format!("language_model.{name}");
            if self.store.contains(&alt) {
                return alt;
            }
        }
        name
    }

    pub fn tensor(&self, hf: &str, layer: usize) -> Option<&RawTensor> {
        self.store.get(&self.name(hf, layer))
    }

    pub fn get<B: Backend>(&self, be: &B, hf: &str, layer: usize) -> Result<Option<B::Weight>> {
        match self.tensor(hf, layer) {
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
        self.require_with(be, hf, layer, shape, |t| be.load_weight(t))
    }

    /// [`Self::require`] for a matrix whose products decide something discontinuous (a
    /// router's top-k) or feed a recurrence (a Gated DeltaNet's projections): loaded with
    /// [`Backend::load_weight_precise`], so the default backend multiplies it with f32
    /// activations (bf16 and f16 weights) or two-level 8-bit ones (quantised weights) instead
    /// of rounding them once, whatever the file stores. llama.cpp keeps routers in F32 for the
    /// same reason. See docs/accuracy.md for what each choice measured.
    pub fn require_precise<B: Backend>(
        &self,
        be: &B,
        hf: &str,
        layer: usize,
        shape: (usize, usize),
    ) -> Result<B::Weight> {
        self.require_with(be, hf, layer, shape, |t| be.load_weight_precise(t))
    }

    /// [`Self::require_precise`] where the file stores floats (bf16, f16, f32), else
    /// [`Self::require`]: for the query and key projections, whose rounding the attention
    /// scores amplify, where f32 activations cost only `vdpbf16ps`'s prefill speed on a small
    /// share of the weights; quantised files keep llama.cpp's 8-bit activations there.
    pub fn require_precise_float<B: Backend>(
        &self,
        be: &B,
        hf: &str,
        layer: usize,
        shape: (usize, usize),
    ) -> Result<B::Weight> {
        self.require_with(be, hf, layer, shape, |t| load_precise_float(be, t))
    }

    pub fn require_with<B: Backend>(
        &self,
        be: &B,
        hf: &str,
        layer: usize,
        shape: (usize, usize),
        load: impl Fn(&RawTensor) -> Result<B::Weight>,
    ) -> Result<B::Weight> {
        let name = self.name(hf, layer);
        let t = self
            .tensor(hf, layer)
            .ok_or_else(|| Error::Weights(format!("missing tensor {name:?}")))?;
        let w = load(t)?;
        let got = be.weight_shape(&w);
        if got != shape {
            return Err(Error::Weights(format!(
                "tensor {name:?} has shape {got:?}, expected {shape:?}"
            )));
        }
        Ok(w)
    }

    /// A tensor of `len` values read to the host as f32 (attention sinks, biases the host
    /// applies).
    pub fn vector(&self, hf: &str, layer: usize, len: usize) -> Result<Vec<f32>> {
        let name = self.name(hf, layer);
        let t = self
            .tensor(hf, layer)
            .ok_or_else(|| Error::Weights(format!("missing tensor {name:?}")))?;
        if t.numel() != len {
            return Err(Error::Weights(format!(
                "tensor {name:?} has shape {:?}, expected [{len}]",
                t.shape
            )));
        }
        let mut v = vec![0f32; len];
        if !ferrum_backend::cpu::quant::dequantize(t.dtype, t.bytes(), &mut v) {
            return Err(Error::Weights(format!("tensor {name:?}: cannot convert")));
        }
        Ok(v)
    }

    /// A norm's weight of `len` values with `offset` added to each (Hugging Face Gemma's
    /// `1 + w`; a plain load when the offset is 0).
    pub fn norm<B: Backend>(
        &self,
        be: &B,
        hf: &str,
        layer: usize,
        len: usize,
        offset: f32,
    ) -> Result<B::Weight> {
        if offset == 0.0 {
            return self.require(be, hf, layer, (1, len));
        }
        let name = self.name(hf, layer);
        if self.tensor(hf, layer).is_some_and(|t| t.shape.len() != 1) {
            return Err(Error::Weights(format!(
                "tensor {name:?} is not a vector of {len}"
            )));
        }
        let v = self.vector(hf, layer, len)?;
        let bytes = v.iter().flat_map(|x| (x + offset).to_le_bytes()).collect();
        let shifted = RawTensor::from_bytes(&name, DType::F32, vec![len], bytes)
            .ok_or_else(|| Error::Weights(format!("tensor {name:?}: bad size")))?;
        be.load_weight(&shifted)
    }
}

/// `count` weights of `rows` rows each, cut in order from the matrix `t` is seen as
/// (`[count × rows, cols]`: a stack of experts, or a latent attention's per-head
/// projections), each loaded on its own (views of the file's bytes, not copies).
pub fn row_blocks<B: Backend>(
    be: &B,
    t: &RawTensor,
    count: usize,
    rows: usize,
    skip: usize,
) -> Result<Vec<B::Weight>> {
    row_blocks_with(t, count, rows, skip, |v| be.load_weight(v))
}

/// [`row_blocks`] with the loader given (a precise one for a query's projections).
pub fn row_blocks_with<W>(
    t: &RawTensor,
    count: usize,
    rows: usize,
    skip: usize,
    load: impl Fn(&RawTensor) -> Result<W>,
) -> Result<Vec<W>> {
    (0..count)
        .map(|x| {
            let v = t.rows(x * (rows + skip), rows).ok_or_else(|| {
                Error::Weights(format!("{}: rows of block {x} out of range", t.name))
            })?;
            load(&v)
        })
        .collect()
}

/// Q, K and V projections: three matrices, or one whose rows are Q's, then K's, then V's
/// (Phi-3) — the layout of the decoder's QKV buffer, so one matmul fills it.
pub enum Qkv<W> {
    Split {
        q: W,
        k: W,
        v: W,
    },
    Fused(W),
    /// No value projection: the values are the key projection's output, normalised apart
    /// (Gemma 4's `attention_k_eq_v` layers).
    KeysAsValues {
        q: W,
        k: W,
    },
    /// Queries only: the layer attends over another layer's cache (Gemma 4's KV-shared
    /// layers).
    QueryOnly(W),
}

pub struct Attention<B: Backend> {
    qkv: Qkv<B::Weight>,
    /// Gated attention's gate projection (Qwen3.5: the query projection's second half of
    /// each head, split off at load): the output is multiplied by its sigmoid.
    gate: Option<B::Weight>,
    bias: Option<[B::Weight; 3]>,
    q_norm: Option<B::Weight>,
    k_norm: Option<B::Weight>,
    /// A weightless RMSNorm of each value head (Gemma 4), as a weight of ones.
    v_norm: Option<B::Weight>,
    o: B::Weight,
    o_bias: Option<B::Weight>,
    /// One logit per query head that joins each softmax's denominator (gpt-oss).
    pub sinks: Option<Vec<f32>>,
    /// This layer's KV heads and head size (see [`ModelConfig::layer_kv_shape`]).
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Gate and up projections, separate or as one matrix of gate rows then up rows (Phi-3).
pub enum GateUp<W> {
    Split { gate: W, up: W },
    Fused(W),
}

pub enum Ffn<B: Backend> {
    /// `down(act(gate(x)) · up(x))`.
    Dense {
        gate_up: GateUp<B::Weight>,
        down: B::Weight,
        width: usize,
    },
    /// Mixture of experts (Qwen3-MoE).
    Moe(MoeLayer<B>),
    /// Gemma 4's MoE block: the dense FFN and the experts side by side, each output
    /// normalised, then summed. The router reads the residual stream through its own
    /// weightless norm (its scale folded into `router_norm`), the experts another norm of it.
    DenseAndExperts {
        gate_up: GateUp<B::Weight>,
        down: B::Weight,
        width: usize,
        moe: MoeLayer<B>,
        post_dense: B::Weight,
        router_norm: B::Weight,
        pre_experts: B::Weight,
        post_experts: B::Weight,
    },
}

/// Gemma 4's per-layer input of one layer: `x += norm(proj(gelu(gate(x)) · input))`, where
/// `input` is the layer's slice of [`crate::decoder`]'s per-layer inputs.
pub struct PerLayerInput<W> {
    pub gate: W,
    pub proj: W,
    pub norm: W,
}

/// A layer's norms, where its family has them (see [`crate::config::NormPlan`]).
pub struct Norms<W> {
    pub attn_in: Option<W>,
    pub attn_out: Option<W>,
    pub ffn_in: Option<W>,
    pub ffn_out: Option<W>,
}

/// What mixes positions in a layer: attention over the KV cache, or a Gated DeltaNet's
/// recurrent state.
pub enum Mixer<B: Backend> {
    Attention(Attention<B>),
    Linear(DeltaNet<B>),
    /// Multi-head latent attention (DeepSeek-V3).
    Latent(LatentAttention<B>),
}

/// Rows `ids` of the matrix `t` as f32, concatenated (a reranker's head rows, a vision
/// tower's token embeddings).
pub(crate) fn tensor_rows(t: &RawTensor, ids: &[usize], hidden: usize) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(ids.len() * hidden);
    for &id in ids {
        let row = t
            .rows(id, 1)
            .ok_or_else(|| Error::Weights(format!("{}: row {id} out of range", t.name)))?;
        let mut v = vec![0f32; hidden];
        if row.numel() != hidden
            || !ferrum_backend::cpu::quant::dequantize(row.dtype, row.bytes(), &mut v)
        {
            return Err(Error::Weights(format!(
                "{}: cannot read row {id} as {hidden} values",
                t.name
            )));
        }
        out.extend(v);
    }
    Ok(out)
}

/// [`Backend::load_weight_precise`] where `t` holds floats, [`Backend::load_weight`] where it
/// is quantised (see [`WeightSource::require_precise_float`]).
pub(crate) fn load_precise_float<B: Backend>(be: &B, t: &RawTensor) -> Result<B::Weight> {
    if t.dtype.is_quantized() {
        be.load_weight(t)
    } else {
        be.load_weight_precise(t)
    }
}

pub struct Layer<B: Backend> {
    pub norms: Norms<B::Weight>,
    pub mixer: Mixer<B>,
    pub ffn: Ffn<B>,
    pub spec: LayerSpec,
    pub per_layer_input: Option<PerLayerInput<B::Weight>>,
    /// The layer's output multiplier (Gemma 4's `layer_scalar`).
    pub scalar: Option<f32>,
}

impl<B: Backend> Layer<B> {
    pub fn load(be: &B, src: &WeightSource, i: usize, c: &ModelConfig) -> Result<Self> {
        let h = c.hidden_size;
        let norm = |name: Option<&str>| -> Result<Option<B::Weight>> {
            name.map(|n| src.norm(be, n, i, h, c.norm_offset))
                .transpose()
        };
        let norms = Norms {
            attn_in: norm(c.norms.attn_in)?,
            attn_out: norm(c.norms.attn_out)?,
            ffn_in: norm(c.norms.ffn_in)?,
            ffn_out: norm(c.norms.ffn_out)?,
        };
        let mixer = match (&c.linear, &c.mla) {
            (Some(lin), _) if c.layers[i].linear => {
                Mixer::Linear(DeltaNet::load(be, src, i, c, lin)?)
            }
            (_, Some(m)) => Mixer::Latent(LatentAttention::load(be, src, i, c, m)?),
            _ => Mixer::Attention(Attention::load(be, src, i, c)?),
        };
        let ffn = Ffn::load(be, src, i, c)?;
        let (p, l) = (c.per_layer_input, |n: &str, shape| {
            src.require(be, n, i, shape)
        });
        let per_layer_input = if p > 0 {
            Some(PerLayerInput {
                gate: l("model.layers.{i}.per_layer_input_gate.weight", (p, h))?,
                proj: l("model.layers.{i}.per_layer_projection.weight", (h, p))?,
                norm: src.norm(
                    be,
                    "model.layers.{i}.post_per_layer_input_norm.weight",
                    i,
                    h,
                    c.norm_offset,
                )?,
            })
        } else {
            None
        };
        // llama.cpp treats a missing `layer_output_scale` as 1.
        let scalar_name = "model.layers.{i}.layer_scalar";
        let scalar = if c.layer_scalar && src.tensor(scalar_name, i).is_some() {
            Some(src.vector(scalar_name, i, 1)?[0])
        } else {
            None
        };
        Ok(Layer {
            norms,
            mixer,
            ffn,
            spec: c.layers[i],
            per_layer_input,
            scalar,
        })
    }
}

impl<B: Backend> Attention<B> {
    fn load(be: &B, src: &WeightSource, i: usize, c: &ModelConfig) -> Result<Self> {
        let (h, qd, kvd) = (c.hidden_size, c.layer_q_dim(i), c.layer_kv_dim(i));
        let (kv_heads, head_dim) = c.layer_kv_shape(i);
        let shared = c.layers[i].kv_from.is_some();
        let l = |name: &str, shape| src.require(be, name, i, shape);
        // Queries and keys meet in the attention scores, whose softmax amplifies their
        // rounding (docs/accuracy.md): f32 activations where the weights are floats.
        let qk = |name: &str, shape| src.require_precise_float(be, name, i, shape);
        let q_name = "model.layers.{i}.self_attn.q_proj.weight";
        let (k_name, v_name) = (
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        );
        let (qkv_q, gate) = if c.attn_gate {
            let (q, g) = split_gate(src, q_name, i, c)?;
            (Some(load_precise_float(be, &q)?), Some(be.load_weight(&g)?))
        } else {
            (None, None)
        };
        let fused_qkv = "model.layers.{i}.self_attn.qkv_proj.weight";
        let qkv = if shared {
            Qkv::QueryOnly(qk(q_name, (qd, h))?)
        } else if src.tensor(q_name, i).is_none()
            && src.tensor(fused_qkv, i).is_some()
            && gate.is_none()
        {
            Qkv::Fused(qk(fused_qkv, (qd + 2 * kvd, h))?)
        } else if c.v_norm && src.tensor(v_name, i).is_none() {
            Qkv::KeysAsValues {
                q: qk(q_name, (qd, h))?,
                k: qk(k_name, (kvd, h))?,
            }
        } else {
            Qkv::Split {
                q: match qkv_q {
                    Some(q) => q,
                    None => qk(q_name, (qd, h))?,
                },
                k: qk(k_name, (kvd, h))?,
                v: l(v_name, (kvd, h))?,
            }
        };
        let bias = if c.qkv_bias {
            if !matches!(qkv, Qkv::Split { .. }) {
                return Err(Error::Unsupported(
                    "biases on a fused or partial QKV projection".into(),
                ));
            }
            Some([
                l("model.layers.{i}.self_attn.q_proj.bias", (1, qd))?,
                l("model.layers.{i}.self_attn.k_proj.bias", (1, kvd))?,
                l("model.layers.{i}.self_attn.v_proj.bias", (1, kvd))?,
            ])
        } else {
            None
        };
        let qk_len = match c.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead => Some((head_dim, head_dim)),
            QkNorm::Whole => Some((qd, kvd)),
        };
        let qk_norm = |name: &str, len| src.norm(be, name, i, len, c.norm_offset);
        let (q_norm, k_norm) = match qk_len {
            None => (None, None),
            Some((lq, lk)) => (
                Some(qk_norm("model.layers.{i}.self_attn.q_norm.weight", lq)?),
                if shared {
                    None
                } else {
                    Some(qk_norm("model.layers.{i}.self_attn.k_norm.weight", lk)?)
                },
            ),
        };
        let v_norm = if c.v_norm && !shared {
            let ones = RawTensor::from_bytes(
                "v_norm",
                DType::F32,
                vec![head_dim],
                1f32.to_le_bytes().repeat(head_dim),
            )
            .ok_or_else(|| Error::Weights("v_norm: bad size".into()))?;
            Some(be.load_weight(&ones)?)
        } else {
            None
        };
        let sinks = if c.attn_sinks {
            Some(src.vector("model.layers.{i}.self_attn.sinks", i, c.n_heads)?)
        } else {
            None
        };
        Ok(Attention {
            qkv,
            gate,
            bias,
            q_norm,
            k_norm,
            v_norm,
            o: l("model.layers.{i}.self_attn.o_proj.weight", (h, qd))?,
            o_bias: if c.o_bias {
                Some(l("model.layers.{i}.self_attn.o_proj.bias", (1, h))?)
            } else {
                None
            },
            sinks,
            kv_heads,
            head_dim,
        })
    }
}

impl<B: Backend> Ffn<B> {
    /// Whether the dense FFN's down matrix wants long prefill passes
    /// ([`Backend::long_prefill`]); the experts' products keep the usual pass.
    pub fn long_prefill(&self, be: &B) -> bool {
        match self {
            Ffn::Dense { down, .. } | Ffn::DenseAndExperts { down, .. } => be.long_prefill(down),
            Ffn::Moe(_) => false,
        }
    }

    fn load(be: &B, src: &WeightSource, i: usize, c: &ModelConfig) -> Result<Self> {
        let (h, f) = (c.hidden_size, c.layer_ffn(i));
        let l = |name: &str, shape| src.require(be, name, i, shape);
        let dense = || -> Result<(GateUp<B::Weight>, B::Weight)> {
            let fused = "model.layers.{i}.mlp.gate_up_proj.weight";
            let gate_up = if src
                .tensor("model.layers.{i}.mlp.gate_proj.weight", i)
                .is_none()
                && src.tensor(fused, i).is_some()
            {
                GateUp::Fused(l(fused, (2 * f, h))?)
            } else {
                GateUp::Split {
                    gate: l("model.layers.{i}.mlp.gate_proj.weight", (f, h))?,
                    up: l("model.layers.{i}.mlp.up_proj.weight", (f, h))?,
                }
            };
            Ok((gate_up, l("model.layers.{i}.mlp.down_proj.weight", (h, f))?))
        };
        Ok(match &c.moe {
            Some(m) if m.style == MoeStyle::Gemma4 => {
                let (gate_up, down) = dense()?;
                let norm = |name: &str| src.norm(be, name, i, h, c.norm_offset);
                // The router's weightless norm, its per-channel scale and 1/√hidden as one
                // weight.
                let scale = src.vector("model.layers.{i}.router.scale", i, h)?;
                let k = (h as f32).powf(-0.5);
                let bytes = scale.iter().flat_map(|v| (v * k).to_le_bytes()).collect();
                let router_norm = RawTensor::from_bytes("router_norm", DType::F32, vec![h], bytes)
                    .ok_or_else(|| Error::Weights("router scale: bad size".into()))?;
                Ffn::DenseAndExperts {
                    gate_up,
                    down,
                    width: f,
                    moe: MoeLayer::load(be, src, i, c, m)?,
                    post_dense: norm("model.layers.{i}.post_feedforward_layernorm_1.weight")?,
                    router_norm: be.load_weight(&router_norm)?,
                    pre_experts: norm("model.layers.{i}.pre_feedforward_layernorm_2.weight")?,
                    post_experts: norm("model.layers.{i}.post_feedforward_layernorm_2.weight")?,
                }
            }
            Some(m) if m.is_moe_layer(i) => Ffn::Moe(MoeLayer::load(be, src, i, c, m)?),
            _ => {
                let (gate_up, down) = dense()?;
                Ffn::Dense {
                    gate_up,
                    down,
                    width: f,
                }
            }
        })
    }
}

/// Gated attention's query projection (`[heads × 2 · head_dim, hidden]`: each head's query
/// rows, then its gate rows) as two matrices, the queries' and the gates' (rows are copied
/// whole, so any block format splits the same way).
fn split_gate(
    src: &WeightSource,
    name: &str,
    i: usize,
    c: &ModelConfig,
) -> Result<(RawTensor, RawTensor)> {
    let full = src.name(name, i);
    let t = src
        .tensor(name, i)
        .ok_or_else(|| Error::Weights(format!("missing tensor {full:?}")))?;
    let (hd, heads, h) = (c.head_dim, c.n_heads, c.hidden_size);
    if t.shape != [2 * heads * hd, h] {
        return Err(Error::Weights(format!(
            "tensor {full:?} has shape {:?}, expected [{}, {h}] (queries and gates)",
            t.shape,
            2 * heads * hd
        )));
    }
    let row = t.bytes().len() / (2 * heads * hd);
    let (mut q, mut g) = (Vec::new(), Vec::new());
    for (j, head) in t.bytes().chunks_exact(2 * hd * row).enumerate() {
        debug_assert!(j < heads);
        q.extend_from_slice(&head[..hd * row]);
        g.extend_from_slice(&head[hd * row..]);
    }
    let make = |part: &str, bytes| {
        RawTensor::from_bytes(
            &format!("{full}[{part}]"),
            t.dtype,
            vec![heads * hd, h],
            bytes,
        )
        .ok_or_else(|| Error::Weights(format!("tensor {full:?}: bad size")))
    };
    Ok((make("query", q)?, make("gate", g)?))
}

/// What one layer's attention needs besides its weights and buffers.
pub struct AttnInputs<'a> {
    pub positions: &'a [u32],
    pub seqs: &'a [AttnSeq<'a>],
    /// `None`: this layer does not rotate.
    pub rope: Option<RopeParams<'a>>,
    /// M-RoPE where the pass has image rows: three positions a row (time, height, width)
    /// and the axis of each rotated pair; `positions` is then the time axis.
    pub axes: Option<(&'a [u32], &'a [u8])>,
    pub params: AttentionParams<'a>,
    /// The query temperature's `(beta, floor)` (see [`ModelConfig::attn_temp`]).
    pub temp: Option<(f32, usize)>,
    /// Who sees what when it is not the causal rule over `seqs` (rows attending both ways):
    /// consecutive groups of the pass's rows, each one attention call.
    pub attend: Option<&'a [Attend<'a>]>,
}

/// Consecutive rows of a pass attended as `seqs` say, a windowed layer's window `widen`
/// longer. A bidirectional span's row `p` of a span ending at `e` is a one-row sequence at
/// `e − 1`, so it sees the whole span; under a window `w` it sees from `p − w + 1` on, as
/// transformers' mask (the window and the span's block) has it, which is a window `w + (e − 1
/// − p)` from `e − 1`.
#[derive(Debug, Clone)]
pub struct Attend<'a> {
    pub seqs: Vec<AttnSeq<'a>>,
    pub widen: usize,
}

impl AttnInputs<'_> {
    /// The query temperature of each row, where the model has one and some row is past its
    /// first `floor` positions (every factor is 1 before that).
    pub fn temperature(&self) -> Option<Vec<f32>> {
        let (beta, floor) = self.temp?;
        if self.positions.iter().all(|&p| (p as usize) < floor) {
            return None;
        }
        Some(
            self.positions
                .iter()
                .map(|&p| {
                    let k = (p as usize / floor) as f64;
                    (1.0 + beta as f64 * (1.0 + k).ln()) as f32
                })
                .collect(),
        )
    }
}

impl<B: Backend> Attention<B> {
    /// Whether a LoRA update of `t` fits this layer's projections.
    pub fn takes(&self, t: Target) -> bool {
        matches!(
            (&self.qkv, t),
            (_, Target::O)
                | (Qkv::Split { .. }, Target::Q | Target::K | Target::V)
                | (Qkv::Fused(_), Target::Qkv)
                | (Qkv::KeysAsValues { .. }, Target::Q | Target::K)
                | (Qkv::QueryOnly(_), Target::Q)
        )
    }

    /// `out = o(attention(rope(norm(qkv(x)))))` for the `n` rows of `x`, writing each
    /// sequence's keys and values into the caches on the way (a layer reading another's
    /// cache writes none).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        c: &ModelConfig,
        x: &B::Buf,
        n: usize,
        qkv: &mut B::Buf,
        attn: &mut B::Buf,
        out: &mut B::Buf,
        k_cache: &mut B::KvBuf,
        v_cache: &mut B::KvBuf,
        a: &AttnInputs,
        mut lora: Option<&mut LayerLora<B>>,
    ) {
        let hd = self.head_dim;
        let (h, qd, kvd) = (c.hidden_size, c.n_heads * hd, self.kv_heads * hd);
        let w = qkv_width(c);
        let hidden = Rows::dense(n, h);
        let (q_cols, k_cols) = (Rows::columns(n, w, 0, qd), Rows::columns(n, w, qd, kvd));
        let v_view = Rows::columns(n, w, qd + kvd, kvd);
        let gate_cols = Rows::columns(n, w, qd + 2 * kvd, qd);
        let (q_view, k_view) = (q_cols.split_heads(hd), k_cols.split_heads(hd));
        let part = |weight, i: usize, out| MatmulPart {
            weight,
            bias: self.bias.as_ref().map(|b| &b[i]),
            out,
        };
        match &self.qkv {
            Qkv::Split { q, k, v } => {
                let (q, k, v) = (part(q, 0, q_cols), part(k, 1, k_cols), part(v, 2, v_view));
                match &self.gate {
                    Some(g) => {
                        let g = MatmulPart {
                            weight: g,
                            bias: None,
                            out: gate_cols,
                        };
                        be.matmul_many(x, hidden, &[q, k, v, g], qkv)
                    }
                    None => be.matmul_many(x, hidden, &[q, k, v], qkv),
                }
            }
            Qkv::Fused(wqkv) => be.matmul(x, hidden, wqkv, None, qkv, Rows::dense(n, w)),
            Qkv::KeysAsValues { q, k } => {
                be.matmul_many(x, hidden, &[part(q, 0, q_cols), part(k, 1, k_cols)], qkv);
            }
            Qkv::QueryOnly(q) => be.matmul(x, hidden, q, None, qkv, q_cols),
        }
        if let Some(l) = lora.as_deref_mut() {
            l.apply(be, Target::Q, x, hidden, qkv, q_cols);
            l.apply(be, Target::K, x, hidden, qkv, k_cols);
            l.apply(be, Target::V, x, hidden, qkv, v_view);
            l.apply(be, Target::Qkv, x, hidden, qkv, Rows::dense(n, w));
        }
        if let Qkv::KeysAsValues { .. } = &self.qkv {
            be.copy_within(qkv, k_cols, v_view);
        }
        let writes_kv = !matches!(self.qkv, Qkv::QueryOnly(_));
        let whole = c.qk_norm == QkNorm::Whole;
        if let Some(qn) = &self.q_norm {
            be.rms_norm_inplace(qkv, if whole { q_cols } else { q_view }, qn, c.rms_eps);
        }
        if let Some(kn) = self.k_norm.as_ref().filter(|_| writes_kv) {
            be.rms_norm_inplace(qkv, if whole { k_cols } else { k_view }, kn, c.rms_eps);
        }
        if let Some(vn) = self.v_norm.as_ref().filter(|_| writes_kv) {
            be.rms_norm_inplace(qkv, v_view.split_heads(hd), vn, c.rms_eps);
        }
        match (a.rope, a.axes) {
            (Some(rope), Some((axes, pair_axis))) => {
                be.rope_axes(qkv, q_view, axes, 3, pair_axis, rope);
                if writes_kv {
                    be.rope_axes(qkv, k_view, axes, 3, pair_axis, rope);
                }
            }
            (Some(rope), None) => {
                be.rope(qkv, q_view, a.positions, rope);
                if writes_kv {
                    be.rope(qkv, k_view, a.positions, rope);
                }
            }
            (None, _) => {}
        }
        if let Some(f) = a.temperature() {
            be.scale_rows(qkv, q_cols, &f);
        }
        if writes_kv {
            let mut row = 0;
            for s in a.seqs {
                let (ks, vs) = (k_view.slice(row, s.rows), v_view.slice(row, s.rows));
                be.write_kv(qkv, ks, k_cache, s.table, s.first_pos);
                be.write_kv(qkv, vs, v_cache, s.table, s.first_pos);
                row += s.rows;
            }
        }
        let attn_view = Rows::dense(n, qd).split_heads(hd);
        match a.attend {
            None => be.attention(
                qkv, q_view, k_cache, v_cache, a.seqs, attn, attn_view, a.params,
            ),
            // Without a window every group has the same parameters: one call.
            Some(groups) if a.params.window.is_none() => {
                let seqs: Vec<AttnSeq> = groups.iter().flat_map(|g| g.seqs.clone()).collect();
                be.attention(
                    qkv, q_view, k_cache, v_cache, &seqs, attn, attn_view, a.params,
                );
            }
            Some(groups) => {
                let mut row = 0;
                for g in groups {
                    let rows: usize = g.seqs.iter().map(|s| s.rows).sum();
                    let params = AttentionParams {
                        window: a.params.window.map(|w| w + g.widen),
                        ..a.params
                    };
                    be.attention(
                        qkv,
                        q_view.slice(row, rows),
                        k_cache,
                        v_cache,
                        &g.seqs,
                        attn,
                        attn_view.slice(row, rows),
                        params,
                    );
                    row += rows;
                }
            }
        }
        if self.gate.is_some() {
            be.sigmoid_mul(attn, Rows::dense(n, qd), qkv, gate_cols);
        }
        be.matmul(
            attn,
            Rows::dense(n, qd),
            &self.o,
            self.o_bias.as_ref(),
            out,
            hidden,
        );
        if let Some(l) = lora {
            l.apply(be, Target::O, attn, Rows::dense(n, qd), out, hidden);
        }
    }
}

/// Columns of the attention's projection buffer: Q, K, V, and gated attention's gates (under
/// latent attention: the absorbed queries and the new cache rows).
pub fn qkv_width(c: &ModelConfig) -> usize {
    if c.mla.is_some() {
        return c.q_dim() + c.kv_dim();
    }
    let gate = if c.attn_gate { c.q_dim() } else { 0 };
    let widest = (0..c.n_layers)
        .map(|i| c.layer_q_dim(i) + 2 * c.layer_kv_dim(i))
        .max();
    widest.unwrap_or(0).max(c.q_dim() + 2 * c.kv_dim()) + gate
}

/// The dense FFN: `out = down(act(gate(x)) · up(x))` over `n` rows.
#[allow(clippy::too_many_arguments)]
pub fn dense_ffn<B: Backend>(
    be: &B,
    c: &ModelConfig,
    width: usize,
    gate_up: &GateUp<B::Weight>,
    down: &B::Weight,
    x: &B::Buf,
    n: usize,
    gu: &mut B::Buf,
    act: &mut B::Buf,
    out: &mut B::Buf,
    lora: Option<&mut LayerLora<B>>,
) {
    let Some(l) =
        lora.filter(|l| l.touches(&[Target::Gate, Target::Up, Target::GateUp, Target::Down]))
    else {
        return gated_ffn(
            be,
            c.hidden_size,
            width,
            c.activation,
            gate_up,
            down,
            x,
            n,
            gu,
            act,
            out,
        );
    };
    // The updates join the gate and up rows before the activation, and the down
    // projection's after it: the fused tail runs on rows that already hold them.
    let (h, f) = (c.hidden_size, width);
    let hidden = Rows::dense(n, h);
    gate_up_matmul(be, h, f, gate_up, x, n, gu);
    l.apply(
        be,
        Target::Gate,
        x,
        hidden,
        gu,
        Rows::columns(n, 2 * f, 0, f),
    );
    l.apply(be, Target::Up, x, hidden, gu, Rows::columns(n, 2 * f, f, f));
    l.apply(be, Target::GateUp, x, hidden, gu, Rows::dense(n, 2 * f));
    let av = Rows::dense(n, f);
    be.glu_matmul(
        gu,
        Rows::dense(n, 2 * f),
        act,
        av,
        down,
        out,
        hidden,
        c.activation,
    );
    l.apply(be, Target::Down, act, av, out, hidden);
}

/// The gate and up projections of `n` rows into `gu` (`[n, 2f]`: gate columns, then up).
fn gate_up_matmul<B: Backend>(
    be: &B,
    h: usize,
    f: usize,
    gate_up: &GateUp<B::Weight>,
    x: &B::Buf,
    n: usize,
    gu: &mut B::Buf,
) {
    let hidden = Rows::dense(n, h);
    match gate_up {
        GateUp::Split { gate, up } => be.matmul_many(
            x,
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
            gu,
        ),
        GateUp::Fused(w) => be.matmul(x, hidden, w, None, gu, Rows::dense(n, 2 * f)),
    }
}

/// [`dense_ffn`] of width `f` (a shared expert's).
#[allow(clippy::too_many_arguments)]
pub fn gated_ffn<B: Backend>(
    be: &B,
    h: usize,
    f: usize,
    activation: ferrum_backend::Activation,
    gate_up: &GateUp<B::Weight>,
    down: &B::Weight,
    x: &B::Buf,
    n: usize,
    gu: &mut B::Buf,
    act: &mut B::Buf,
    out: &mut B::Buf,
) {
    let hidden = Rows::dense(n, h);
    gate_up_matmul(be, h, f, gate_up, x, n, gu);
    be.glu_matmul(
        gu,
        Rows::dense(n, 2 * f),
        act,
        Rows::dense(n, f),
        down,
        out,
        hidden,
        activation,
    );
}
