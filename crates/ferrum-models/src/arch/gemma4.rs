//! Gemma 4 (text; also the language model of `Gemma4ForConditionalGeneration` checkpoints).
//!
//! Gemma 3's four norms a layer, GeGLU, QK-norm, √hidden embedding scale and local/global
//! layer pattern, and then:
//! - norms multiply by `w` itself (no `1 + w`), and values are RMS-normalised per head
//!   without a weight; attention scores are not scaled (scale 1);
//! - global layers have their own head size (`global_head_dim`) and, with
//!   `attention_k_eq_v`, their own KV head count and no value projection (the key
//!   projection's output, before its norm, is the value);
//! - global layers rotate "proportionally": pairs `(i, i + d/2)` over the whole head with
//!   `theta^(-2i/d)`, only the first `partial_rotary_factor · d/2` pairs turning;
//! - the last `num_kv_shared_layers` layers keep no KV: each attends over the cache of the
//!   last earlier layer of its own kind, and may have a double-wide FFN;
//! - per-layer inputs: a second embedding table and a projection of the first give every
//!   layer a small input of its own, gated into the residual stream after the FFN;
//! - every layer's output is multiplied by a learned scalar, and logits are soft-capped;
//! - the 26B-A4B's MoE block runs experts beside the dense FFN (see `MoeStyle::Gemma4`).
//!
//! llama.cpp's GGUFs carry the per-layer kinds in `attention.sliding_window_pattern`, the
//! global head size in `attention.key_length` (`_swa` for the local one), and the
//! proportional RoPE as `rope_freqs` factors of 1e30 on the pairs that do not turn.

use ferrum_backend::Activation;
use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{
    hf_f64, hf_opt_usize, LayerSpec, ModelConfig, MoeConfig, MoeStyle, QkNorm, Rope, RopeScaling,
    Routing,
};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Gemma4,
    name: "gemma4",
    gguf_aliases: &[],
    hf_classes: &["Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"],
    model_types: &["gemma4_text", "gemma4"],
    from_hf,
    from_gguf,
    names: &[
        (
            "model.layers.{i}.post_attention_layernorm.weight",
            "blk.{i}.post_attention_norm.weight",
        ),
        (
            "model.layers.{i}.pre_feedforward_layernorm.weight",
            "blk.{i}.ffn_norm.weight",
        ),
        (
            "model.layers.{i}.post_feedforward_layernorm.weight",
            "blk.{i}.post_ffw_norm.weight",
        ),
        (
            "model.layers.{i}.layer_scalar",
            "blk.{i}.layer_output_scale.weight",
        ),
        (
            "model.layers.{i}.per_layer_input_gate.weight",
            "blk.{i}.inp_gate.weight",
        ),
        (
            "model.layers.{i}.per_layer_projection.weight",
            "blk.{i}.proj.weight",
        ),
        (
            "model.layers.{i}.post_per_layer_input_norm.weight",
            "blk.{i}.post_norm.weight",
        ),
        (
            "model.embed_tokens_per_layer.weight",
            "per_layer_token_embd.weight",
        ),
        (
            "model.per_layer_model_projection.weight",
            "per_layer_model_proj.weight",
        ),
        (
            "model.per_layer_projection_norm.weight",
            "per_layer_proj_norm.weight",
        ),
        (
            "model.layers.{i}.router.scale",
            "blk.{i}.ffn_gate_inp.scale",
        ),
        (
            "model.layers.{i}.router.per_expert_scale",
            "blk.{i}.ffn_down_exps.scale",
        ),
        (
            "model.layers.{i}.router.proj.weight",
            "blk.{i}.ffn_gate_inp.weight",
        ),
        (
            "model.layers.{i}.post_feedforward_layernorm_1.weight",
            "blk.{i}.post_ffw_norm_1.weight",
        ),
        (
            "model.layers.{i}.post_feedforward_layernorm_2.weight",
            "blk.{i}.post_ffw_norm_2.weight",
        ),
        (
            "model.layers.{i}.pre_feedforward_layernorm_2.weight",
            "blk.{i}.pre_ffw_norm_2.weight",
        ),
    ],
};

/// What every layer's kind and shape comes from, whichever file it is read from.
struct Layout {
    /// Per layer: a local (sliding-window) layer.
    local: Vec<bool>,
    window: usize,
    /// `(kv heads, head size)` of local and of global layers.
    local_shape: (usize, usize),
    global_shape: (usize, usize),
    /// Layers from this index on read an earlier layer's cache.
    first_shared: usize,
    /// FFN width per layer.
    ffn: Vec<usize>,
}

impl Layout {
    /// The layers: local ones keep the model's own shape, global ones theirs; a KV-shared
    /// layer reads the last layer of its kind before the first shared one (transformers'
    /// rule; llama.cpp assumes those are the last two, which every released config has).
    fn apply(&self, c: &mut ModelConfig) -> Result<()> {
        let n = c.n_layers;
        if self.local.len() != n || self.ffn.len() != n {
            return Err(Error::Weights(format!(
                "Gemma 4: {} layer kinds and {} FFN widths for {n} layers",
                self.local.len(),
                self.ffn.len()
            )));
        }
        (c.n_kv_heads, c.head_dim) = self.local_shape;
        c.layers = (0..n)
            .map(|i| {
                let local = self.local[i];
                let kv_from = if i >= self.first_shared {
                    (0..self.first_shared)
                        .rev()
                        .find(|&p| self.local[p] == local)
                } else {
                    None
                };
                if i >= self.first_shared && kv_from.is_none() {
                    return Err(Error::Weights(format!(
                        "Gemma 4: KV-shared layer {i} has no earlier layer of its kind"
                    )));
                }
                Ok(LayerSpec {
                    window: local.then_some(self.window),
                    rope: if local { Rope::Local } else { Rope::Global },
                    shape: (!local && self.global_shape != self.local_shape)
                        .then_some(self.global_shape),
                    kv_from,
                    ffn: (self.ffn[i] != c.intermediate_size).then_some(self.ffn[i]),
                    linear: false,
                })
            })
            .collect::<Result<_>>()?;
        c.sliding_window = Some(self.window);
        c.local_rotary_dim = Some(self.local_shape.1);
        c.rotary_dim = self.global_shape.1;
        Ok(())
    }
}

/// transformers' default pattern: local layers but every sixth, the last always global.
fn default_pattern(n: usize) -> Vec<bool> {
    (0..n)
        .map(|i| !(i + 1).is_multiple_of(6) && i + 1 != n)
        .collect()
}

fn from_hf(j: &Json) -> Result<ModelConfig> {
    // A multimodal checkpoint nests the language model's settings.
    let j = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
    let mut c = ModelConfig::hf_base(Arch::Gemma4, j)?;
    c.tie_embeddings = j
        .get("tie_word_embeddings")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    if j.get("attn_logit_softcapping")
        .is_some_and(|v| !v.is_null())
    {
        return Err(Error::Unsupported(
            "config.json: Gemma attn_logit_softcapping".into(),
        ));
    }
    match j
        .get("hidden_activation")
        .or_else(|| j.get("hidden_act"))
        .and_then(Json::as_str)
    {
        None | Some("gelu_pytorch_tanh" | "gelu_tanh") => {}
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "config.json: Gemma 4 activation {other:?}"
            )))
        }
    }
    c.final_softcap = hf_f64(j, "final_logit_softcapping").map(|v| v as f32);
    let n = c.n_layers;
    let local = match j.get("layer_types").and_then(Json::as_array) {
        Some(t) => t
            .iter()
            .map(|v| v.as_str() == Some("sliding_attention"))
            .collect(),
        None => default_pattern(n),
    };
    let flag = |k: &str| j.get(k).and_then(Json::as_bool).unwrap_or(false);
    let k_eq_v = flag("attention_k_eq_v");
    let local_shape = (c.n_kv_heads, c.head_dim);
    let global_kv = hf_opt_usize(j, "num_global_key_value_heads")
        .filter(|_| k_eq_v)
        .unwrap_or(c.n_kv_heads);
    let mut global_shape = (global_kv, hf_opt_usize(j, "global_head_dim").unwrap_or(512));
    // transformers 5.25 saves the global layers' shape per layer instead.
    if let Some(per) = j.get("per_layer_config").and_then(Json::as_object) {
        if let Some(first) = per.values().next() {
            global_shape = (
                hf_opt_usize(first, "num_key_value_heads").unwrap_or(global_shape.0),
                hf_opt_usize(first, "head_dim").unwrap_or(global_shape.1),
            );
        }
    }
    let shared = hf_opt_usize(j, "num_kv_shared_layers").unwrap_or(0);
    let first_shared = n.saturating_sub(shared);
    let double = flag("use_double_wide_mlp");
    // One width, or (as Gemma 3n wrote it) one per layer.
    let widths: Option<Vec<usize>> = j
        .get("intermediate_size")
        .and_then(Json::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Json::as_u64)
                .map(|v| v as usize)
                .collect()
        });
    if let Some(w) = &widths {
        if w.len() != n {
            return Err(Error::Weights(format!(
                "config.json: {} intermediate sizes for {n} layers",
                w.len()
            )));
        }
        c.intermediate_size = w.iter().copied().min().unwrap_or(0);
    }
    let f = c.intermediate_size;
    let width = |i: usize| widths.as_ref().map_or(f, |w| w[i]);
    let layout = Layout {
        local,
        window: hf_opt_usize(j, "sliding_window").unwrap_or(512),
        local_shape,
        global_shape,
        first_shared,
        ffn: (0..n)
            .map(|i| {
                if double && i >= first_shared {
                    2 * width(i)
                } else {
                    width(i)
                }
            })
            .collect(),
    };
    layout.apply(&mut c)?;
    // One RoPE entry per layer kind.
    let params = j.get("rope_parameters");
    let kind = |k: &str| params.and_then(|p| p.get(k)).filter(|v| v.is_object());
    let local_theta = kind("sliding_attention").and_then(|s| hf_f64(s, "rope_theta"));
    c.local_rope_theta = Some(local_theta.unwrap_or(10_000.0) as f32);
    c.rope_scaling = None;
    match kind("full_attention") {
        Some(g) => {
            c.rope_theta = hf_f64(g, "rope_theta").unwrap_or(1_000_000.0) as f32;
            match g.get("rope_type").and_then(Json::as_str) {
                None | Some("default") => {}
                Some("proportional") => {
                    let partial = hf_f64(g, "partial_rotary_factor").unwrap_or(1.0);
                    let factor = hf_f64(g, "factor").unwrap_or(1.0) as f32;
                    c.rope_scaling = Some(proportional(c.rotary_dim, partial, factor));
                }
                Some(other) => {
                    return Err(Error::Unsupported(format!(
                        "config.json: Gemma 4 global RoPE type {other:?}"
                    )))
                }
            }
        }
        None => c.rope_theta = 1_000_000.0,
    }
    let p = hf_opt_usize(j, "hidden_size_per_layer_input").unwrap_or(0);
    if p > 0 {
        let rows = hf_opt_usize(j, "vocab_size_per_layer_input").unwrap_or(c.vocab_size);
        if rows != c.vocab_size {
            return Err(Error::Unsupported(format!(
                "config.json: a per-layer input vocabulary of {rows} beside {} tokens",
                c.vocab_size
            )));
        }
    }
    c.per_layer_input = p;
    if flag("enable_moe_block") {
        let need = |k: &str| {
            hf_opt_usize(j, k)
                .filter(|&v| v > 0)
                .ok_or_else(|| Error::Weights(format!("config.json: MoE block without {k}")))
        };
        c.moe = Some(moe(
            need("num_experts")?,
            need("top_k_experts")?,
            need("moe_intermediate_size")?,
        ));
    }
    common(c, "config.json")
}

/// The proportional RoPE as per-pair divisors of `theta^(-2i/d)`: `factor` on the first
/// `⌊partial · d / 2⌋` pairs, infinity (no rotation) on the rest.
fn proportional(d: usize, partial: f64, factor: f32) -> RopeScaling {
    let turning = (partial * d as f64 / 2.0) as usize;
    RopeScaling::Factors(
        (0..d / 2)
            .map(|i| if i < turning { factor } else { f32::INFINITY })
            .collect(),
    )
}

fn moe(n_experts: usize, n_active: usize, expert_ffn: usize) -> MoeConfig {
    MoeConfig {
        style: MoeStyle::Gemma4,
        n_experts,
        n_active,
        expert_ffn,
        // The experts' output norm would hide a common factor anyway; transformers
        // renormalises.
        norm_topk_prob: true,
        mlp_only_layers: Vec::new(),
        sparse_step: 1,
        shared_ffn: None,
        shared_gate: false,
        routing: Routing::SOFTMAX,
    }
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::Gemma4, g, vocab, tied)?;
    let key = |k: &str| format!("gemma4.{k}");
    let n = c.n_layers;
    let bad = |m: String| Error::Weights(format!("{}: {m}", g.path.display()));
    // A number, or one per layer.
    let per_layer = |k: &str| -> Result<Option<Vec<usize>>> {
        if let Some(v) = g.get_u64(&key(k)) {
            return Ok(Some(vec![v as usize; n]));
        }
        match g.get_i64_array(&key(k)) {
            None => Ok(None),
            Some(a) if a.len() == n && a.iter().all(|&v| v >= 0) => {
                Ok(Some(a.into_iter().map(|v| v as usize).collect()))
            }
            Some(a) => Err(bad(format!("{k} has {} entries for {n} layers", a.len()))),
        }
    };
    let local = match g.get_bool_array(&key("attention.sliding_window_pattern")) {
        Some(p) if p.len() == n => p,
        Some(p) => {
            return Err(bad(format!(
                "sliding_window_pattern has {} entries for {n} layers",
                p.len()
            )))
        }
        None => default_pattern(n),
    };
    let global_dim = c.head_dim;
    let local_dim = g
        .get_u64(&key("attention.key_length_swa"))
        .map_or(global_dim, |v| v as usize);
    let kv = per_layer("attention.head_count_kv")?.unwrap_or(vec![c.n_heads; n]);
    let kv_of = |want_local: bool| {
        (0..n)
            .find(|&i| local[i] == want_local)
            .map_or(kv[0], |i| kv[i])
    };
    let ffn =
        per_layer("feed_forward_length")?.ok_or_else(|| bad("no feed_forward_length".into()))?;
    c.intermediate_size = ffn.iter().copied().min().unwrap_or(0);
    let shared = g
        .get_u64(&key("attention.shared_kv_layers"))
        .map_or(0, |v| v as usize);
    let (local_shape, global_shape) = ((kv_of(true), local_dim), (kv_of(false), global_dim));
    let layout = Layout {
        local,
        window: g
            .get_u64(&key("attention.sliding_window"))
            .map_or(512, |v| v as usize),
        local_shape,
        global_shape,
        first_shared: n.saturating_sub(shared),
        ffn,
    };
    layout.apply(&mut c)?;
    c.local_rope_theta = Some(
        g.get_f64(&key("rope.freq_base_swa"))
            .map_or(10_000.0, |v| v as f32),
    );
    // llama.cpp caps at 30 where the file has no key.
    c.final_softcap = Some(
        g.get_f64(&key("final_logit_softcapping"))
            .map_or(30.0, |v| v as f32),
    );
    c.per_layer_input = g
        .get_u64(&key("embedding_length_per_layer_input"))
        .map_or(0, |v| v as usize);
    if let Some(e) = g.get_u64(&key("expert_count")).filter(|&e| e > 0) {
        let used = g
            .get_u64(&key("expert_used_count"))
            .ok_or_else(|| bad("expert_count without expert_used_count".into()))?;
        let width = g
            .get_u64(&key("expert_feed_forward_length"))
            .ok_or_else(|| bad("expert_count without expert_feed_forward_length".into()))?;
        c.moe = Some(moe(e as usize, used as usize, width as usize));
    }
    common(c, &g.path.display().to_string())
}

fn common(mut c: ModelConfig, source: &str) -> Result<ModelConfig> {
    c.norms = super::gemma3::NORMS;
    c.norm_offset = 0.0;
    c.qk_norm = QkNorm::PerHead;
    c.v_norm = true;
    c.layer_scalar = true;
    c.activation = Activation::GeluTanh;
    c.attn_scale = 1.0;
    // transformers rounds √hidden to the weights' dtype (f32 here), as llama.cpp does.
    c.embed_scale = Some((c.hidden_size as f32).sqrt());
    c.check(source)
}
