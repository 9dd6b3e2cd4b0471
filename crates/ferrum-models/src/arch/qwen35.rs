//! Qwen3.5 and Qwen3.5-MoE (the Qwen3-Next layer design): hybrid stacks where most layers
//! are Gated DeltaNet linear attention (a recurrent state per sequence, no KV) and every few
//! — as `layer_types` lists them — full attention with
//! - an output gate: the query projection gives each head its queries and as many gate
//!   values, and the attention output is multiplied by their sigmoid;
//! - QK-norm per head, partial rotary (`partial_rotary_factor`, 0.25), head_dim as set;
//! - zero-centred `(1 + w)` RMSNorms (the GGUF converter stores `1 + w`), except the
//!   DeltaNet's gated output norm, which multiplies by `w`.
//!
//! Qwen3.5's multimodal RoPE (`mrope_section`, interleaved) gives text — every position id
//! the same in its three sections — the plain rotation, and image rows (Qwen3-VL's tower,
//! without DeepStack) their time, height and width positions. The MoE layers route like Qwen3-MoE (softmax,
//! top-k, renormalised) and add a shared expert scaled by `sigmoid(gate · x)`.

use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{
    hf_opt_usize, hf_usize, LinearAttn, MRope, ModelConfig, MoeConfig, MoeStyle, QkNorm, Routing,
};

const NAMES: &[(&str, &str)] = &[
    (
        "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.post_attention_norm.weight",
    ),
    (
        "model.layers.{i}.linear_attn.in_proj_qkv.weight",
        "blk.{i}.attn_qkv.weight",
    ),
    (
        "model.layers.{i}.linear_attn.in_proj_z.weight",
        "blk.{i}.attn_gate.weight",
    ),
    (
        "model.layers.{i}.linear_attn.in_proj_a.weight",
        "blk.{i}.ssm_alpha.weight",
    ),
    (
        "model.layers.{i}.linear_attn.in_proj_b.weight",
        "blk.{i}.ssm_beta.weight",
    ),
    // The converter stores −exp(A_log) under this name (see `DeltaNet::load`).
    ("model.layers.{i}.linear_attn.A_log", "blk.{i}.ssm_a"),
    (
        "model.layers.{i}.linear_attn.dt_bias",
        "blk.{i}.ssm_dt.bias",
    ),
    (
        "model.layers.{i}.linear_attn.conv1d.weight",
        "blk.{i}.ssm_conv1d.weight",
    ),
    (
        "model.layers.{i}.linear_attn.norm.weight",
        "blk.{i}.ssm_norm.weight",
    ),
    (
        "model.layers.{i}.linear_attn.out_proj.weight",
        "blk.{i}.ssm_out.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "blk.{i}.ffn_gate_shexp.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        "blk.{i}.ffn_up_shexp.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        "blk.{i}.ffn_down_shexp.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_expert_gate.weight",
        "blk.{i}.ffn_gate_inp_shexp.weight",
    ),
];

pub const QWEN35: ArchInfo = ArchInfo {
    arch: Arch::Qwen35,
    name: "qwen35",
    gguf_aliases: &[],
    hf_classes: &["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"],
    model_types: &["qwen3_5_text", "qwen3_5"],
    from_hf: |j| from_hf(Arch::Qwen35, j),
    from_gguf: |g, vocab, tied| from_gguf(Arch::Qwen35, g, vocab, tied),
    names: NAMES,
};

pub const QWEN35_MOE: ArchInfo = ArchInfo {
    arch: Arch::Qwen35Moe,
    name: "qwen35moe",
    gguf_aliases: &[],
    hf_classes: &[
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    ],
    model_types: &["qwen3_5_moe_text", "qwen3_5_moe"],
    from_hf: |j| from_hf(Arch::Qwen35Moe, j),
    from_gguf: |g, vocab, tied| from_gguf(Arch::Qwen35Moe, g, vocab, tied),
    names: NAMES,
};

/// The layer kinds, one per layer: `layer_types` where given, else every `interval`-th layer
/// full attention (transformers' default, 4).
fn layer_kinds(types: Option<Vec<bool>>, interval: usize, n: usize) -> Result<Vec<bool>> {
    match types {
        Some(t) if t.len() == n => Ok(t),
        Some(t) => Err(Error::Weights(format!(
            "{} layer types for {n} layers",
            t.len()
        ))),
        None if interval == 0 => Err(Error::Weights("full_attention_interval of 0".into())),
        None => Ok((0..n).map(|i| !(i + 1).is_multiple_of(interval)).collect()),
    }
}

fn finish(
    mut c: ModelConfig,
    linear: LinearAttn,
    kinds: Vec<bool>,
    src: &str,
) -> Result<ModelConfig> {
    c.qk_norm = QkNorm::PerHead;
    c.attn_gate = true;
    c.linear = Some(linear);
    for (l, lin) in c.layers.iter_mut().zip(kinds) {
        l.linear = lin;
    }
    if let Some(m) = &c.moe {
        if c.intermediate_size == 0 {
            c.intermediate_size = m.expert_ffn;
        }
    }
    c.check(src)
}

fn from_hf(arch: Arch, j: &Json) -> Result<ModelConfig> {
    // Published checkpoints are the multimodal class, the language model's settings nested.
    let j = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
    let mut c = ModelConfig::hf_base(arch, j)?;
    // transformers' Qwen3.5 default when the config leaves it out.
    if hf_opt(j, "partial_rotary_factor").is_none() {
        c.rotary_dim = (c.head_dim / 4) & !1;
    }
    c.norm_offset = 1.0;
    // Image rows' positions (text rotates as plain RoPE): interleaved sections over the
    // rotated pairs, transformers' [11, 11, 10] when the config leaves them out.
    c.mrope = Some(MRope::from_hf(j, true).unwrap_or(MRope {
        sections: [11, 11, 10],
        interleaved: true,
    }));
    let n = c.n_layers;
    let types = match j.get("layer_types").and_then(Json::as_array) {
        Some(a) => Some(
            a.iter()
                .map(|v| match v.as_str() {
                    Some("linear_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(Error::Unsupported(format!(
                        "config.json: layer type {other:?}"
                    ))),
                })
                .collect::<Result<Vec<_>>>()?,
        ),
        None => None,
    };
    let interval = hf_opt_usize(j, "full_attention_interval").unwrap_or(4);
    let kinds = layer_kinds(types, interval, n)?;
    let linear = LinearAttn {
        conv_kernel: hf_opt_usize(j, "linear_conv_kernel_dim").unwrap_or(4),
        k_heads: hf_usize(j, "linear_num_key_heads")?,
        v_heads: hf_usize(j, "linear_num_value_heads")?,
        k_dim: hf_usize(j, "linear_key_head_dim")?,
        v_dim: hf_usize(j, "linear_value_head_dim")?,
        tiled: false,
    };
    if arch == Arch::Qwen35Moe {
        c.moe = Some(MoeConfig {
            style: MoeStyle::Qwen,
            n_experts: hf_opt_usize(j, "num_experts")
                .ok_or_else(|| Error::Weights("config.json: no num_experts".into()))?,
            n_active: hf_usize(j, "num_experts_per_tok")?,
            expert_ffn: hf_usize(j, "moe_intermediate_size")?,
            // Qwen3.5-MoE's router always renormalises the top-k.
            norm_topk_prob: true,
            mlp_only_layers: Vec::new(),
            sparse_step: 1,
            shared_ffn: hf_opt_usize(j, "shared_expert_intermediate_size").filter(|&v| v > 0),
            shared_gate: true,
            routing: Routing::SOFTMAX,
        });
    }
    finish(c, linear, kinds, "config.json")
}

fn hf_opt<'a>(j: &'a Json, k: &str) -> Option<&'a Json> {
    j.get(k)
        .or_else(|| j.get("rope_parameters").and_then(|p| p.get(k)))
        .filter(|v| !v.is_null())
}

fn from_gguf(arch: Arch, g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let name = arch.name();
    let key = |k: &str| format!("{name}.{k}");
    let source = g.path.display().to_string();
    let mut c = ModelConfig::gguf_base(arch, g, vocab, tied)?;
    c.mrope = super::qwen::gguf_sections(g, true)?;
    let n = c.n_layers;
    let interval = g
        .get_u64(&key("full_attention_interval"))
        .map_or(4, |v| v as usize);
    let kinds = layer_kinds(
        g.get_bool_array(&key("attention.recurrent_layers")),
        interval,
        n,
    )?;
    let v_heads = g.require_usize(&key("ssm.time_step_rank"))?;
    let inner = g.require_usize(&key("ssm.inner_size"))?;
    if v_heads == 0 || !inner.is_multiple_of(v_heads) {
        return Err(Error::Weights(format!(
            "{source}: ssm.inner_size {inner} is not a multiple of {v_heads} value heads"
        )));
    }
    let linear = LinearAttn {
        conv_kernel: g.require_usize(&key("ssm.conv_kernel"))?,
        k_heads: g.require_usize(&key("ssm.group_count"))?,
        v_heads,
        k_dim: g.require_usize(&key("ssm.state_size"))?,
        v_dim: inner / v_heads,
        tiled: true,
    };
    if arch == Arch::Qwen35Moe {
        c.moe = Some(MoeConfig::from_gguf(g, name, MoeStyle::Qwen)?);
    }
    finish(c, linear, kinds, &source)
}
