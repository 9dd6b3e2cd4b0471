//! DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek V3.x, Kimi K2) and V2 (`DeepseekV2ForCausalLM`:
//! V2-Lite, Moonlight; GGUF `deepseek2` for both).
//!
//! Against Llama: multi-head latent attention ([`crate::mla`]) with RoPE on
//! `qk_rope_head_dim` dimensions of each head, in GPT-J pairs (`rope_interleave`, what
//! llama.cpp does for every `deepseek2` file); scores scaled by `qk_head_dim^-½` times the
//! square of YaRN's `mscale_all_dim` factor; the first `first_k_dense_replace` layers dense,
//! the others MoE with sigmoid scores, the correction bias, group-limited top-k,
//! `routed_scaling_factor` and ungated shared experts (the router GLM-4.5 has too). V2's
//! router is a softmax whose top-k weights are never renormalised (`topk_method` greedy;
//! its group-limited form, which ranks groups by their best expert, is refused).

use ferrum_backend::RopeLayout;
use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{
    hf_f64, hf_opt_usize, hf_usize, Gating, Mla, ModelConfig, MoeConfig, MoeStyle, RopeScaling,
    Routing,
};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Deepseek2,
    name: "deepseek2",
    gguf_aliases: &[],
    hf_classes: &["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"],
    model_types: &["deepseek_v3", "kimi_k2", "deepseek_v2"],
    from_hf: |j| from_hf(Arch::Deepseek2, j),
    from_gguf: |g, vocab, tied| from_gguf(Arch::Deepseek2, g, vocab, tied),
    names: &[],
};

/// Mistral 4 (`Mistral4ForCausalLM`, GGUF `mistral4`): DeepSeek-V3's latent attention and
/// expert layout with a softmax router (no correction bias) and Llama 4's query temperature
/// (see [`super::mistral3`]).
pub const MISTRAL4: ArchInfo = ArchInfo {
    arch: Arch::Mistral4,
    name: "mistral4",
    gguf_aliases: &[],
    hf_classes: &["Mistral4ForCausalLM"],
    model_types: &["mistral4"],
    from_hf: |j| from_hf(Arch::Mistral4, j),
    from_gguf: |g, vocab, tied| from_gguf(Arch::Mistral4, g, vocab, tied),
    names: &[],
};

/// YaRN's `0.1 · m · ln(factor) + 1` (1 without stretching).
fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

pub(crate) fn from_hf(arch: Arch, j: &Json) -> Result<ModelConfig> {
    let j = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
    let mut c = ModelConfig::hf_base(arch, j)?;
    if j.get("attention_bias").and_then(Json::as_bool) == Some(true) {
        return Err(Error::Unsupported(
            "config.json: latent attention with biases".into(),
        ));
    }
    let m = Mla {
        q_rank: hf_opt_usize(j, "q_lora_rank").filter(|&r| r > 0),
        kv_rank: hf_usize(j, "kv_lora_rank")?,
        nope_dim: hf_usize(j, "qk_nope_head_dim")?,
        rope_dim: hf_usize(j, "qk_rope_head_dim")?,
        v_dim: hf_usize(j, "v_head_dim")?,
    };
    let interleave = j
        .get("rope_interleave")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    c.rope_layout = if interleave {
        RopeLayout::Interleaved
    } else {
        RopeLayout::Neox
    };
    // The softmax's scale takes YaRN's all-dimension factor twice (transformers'
    // `yarn_apply_mscale`).
    let scaling = j
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| j.get("rope_parameters"));
    let mut mscale = 1.0;
    if let (Some(s), Some(RopeScaling::Yarn { factor, .. })) = (scaling, &c.rope_scaling) {
        if let Some(all) = hf_f64(s, "mscale_all_dim").filter(|&v| v != 0.0) {
            mscale = yarn_mscale(*factor as f64, all);
        }
    }
    c.attn_scale = ((m.q_head() as f64).powf(-0.5) * mscale * mscale) as f32;
    let dense = hf_opt_usize(j, "first_k_dense_replace").unwrap_or(0);
    if hf_opt_usize(j, "moe_layer_freq").is_some_and(|f| f != 1) {
        return Err(Error::Unsupported(
            "config.json: moe_layer_freq other than 1".into(),
        ));
    }
    let expert_ffn = hf_usize(j, "moe_intermediate_size")?;
    let shared = hf_opt_usize(j, "n_shared_experts").unwrap_or(0);
    let v2 = j.get("model_type").and_then(Json::as_str) == Some("deepseek_v2");
    let groups = hf_opt_usize(j, "n_group").unwrap_or(1);
    let groups_used = hf_opt_usize(j, "topk_group").unwrap_or(groups);
    if v2
        && j.get("topk_method").and_then(Json::as_str) == Some("group_limited_greedy")
        && groups_used < groups
    {
        return Err(Error::Unsupported(
            "config.json: DeepSeek-V2's group-limited greedy routing (groups ranked by their \
             best expert)"
                .into(),
        ));
    }
    c.moe = Some(MoeConfig {
        style: MoeStyle::Qwen,
        n_experts: hf_usize(j, "n_routed_experts")?,
        n_active: hf_usize(j, "num_experts_per_tok")?,
        expert_ffn,
        // transformers' V2 router never renormalises, whatever the key says.
        norm_topk_prob: !v2
            && j.get("norm_topk_prob")
                .and_then(Json::as_bool)
                .unwrap_or(true),
        mlp_only_layers: (0..dense.min(c.n_layers)).collect(),
        sparse_step: 1,
        shared_ffn: (shared > 0).then_some(shared * expert_ffn),
        shared_gate: false,
        routing: match arch {
            Arch::Mistral4 => Routing {
                gating: Gating::Softmax,
                choice_bias: false,
                ..Routing::from_hf(j)?
            },
            _ => Routing::from_hf(j)?,
        },
    });
    if arch == Arch::Mistral4 {
        c.attn_temp = super::mistral3::hf_temperature(j);
    }
    latent(c, m, "config.json")
}

/// What latent attention makes of the Llama-shaped fields: one KV head of the cache row,
/// heads of the absorbed width, RoPE over the rotary part only.
fn latent(mut c: ModelConfig, m: Mla, source: &str) -> Result<ModelConfig> {
    if m.kv_rank == 0 || m.rope_dim == 0 || m.nope_dim == 0 || m.v_dim == 0 {
        return Err(Error::Weights(format!(
            "{source}: latent attention of rank {}, heads of {} + {} and values of {}",
            m.kv_rank, m.nope_dim, m.rope_dim, m.v_dim
        )));
    }
    c.n_kv_heads = 1;
    c.head_dim = m.row();
    c.rotary_dim = m.rope_dim;
    c.qkv_bias = false;
    c.mla = Some(m);
    c.check(source)
}

fn from_gguf(arch: Arch, g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(arch, g, vocab, tied)?;
    let name = arch.name();
    let key = |k: &str| format!("{name}.{k}");
    c.drop_gguf_nextn(g, name)?;
    let rope_dim = g.require_usize(&key("rope.dimension_count"))?;
    let k_len = g
        .get_u64(&key("attention.key_length_mla"))
        .or_else(|| g.get_u64(&key("attention.key_length")))
        .ok_or_else(|| Error::Weights("deepseek2: no attention.key_length".into()))?
        as usize;
    let v_len = g
        .get_u64(&key("attention.value_length_mla"))
        .or_else(|| g.get_u64(&key("attention.value_length")))
        .ok_or_else(|| Error::Weights("deepseek2: no attention.value_length".into()))?
        as usize;
    let m = Mla {
        q_rank: g
            .get_u64(&key("attention.q_lora_rank"))
            .filter(|&r| r > 0)
            .map(|r| r as usize),
        kv_rank: g.require_usize(&key("attention.kv_lora_rank"))?,
        nope_dim: k_len.saturating_sub(rope_dim),
        rope_dim,
        v_dim: v_len,
    };
    c.rope_layout = RopeLayout::Interleaved;
    // llama.cpp keeps YaRN's cos/sin unscaled for this family and puts the
    // `yarn_log_multiplier` factor (0.1 · mscale_all_dim) twice into the softmax's scale.
    let mut mscale = 1.0f64;
    if let Some(RopeScaling::Yarn { factor, .. }) = &c.rope_scaling {
        if let Some(mul) = g.get_f64(&key("rope.scaling.yarn_log_multiplier")) {
            mscale = yarn_mscale(*factor as f64, mul / 0.1);
        }
    }
    c.rope_factor = 1.0;
    c.attn_scale = ((m.q_head() as f64).powf(-0.5) * mscale * mscale) as f32;
    let has_bias = g
        .tensor_infos
        .iter()
        .any(|t| t.name.ends_with(".exp_probs_b.bias"));
    // llama.cpp's default for files without the key is softmax.
    let moe = MoeConfig::deepseek_from_gguf(g, name, c.n_layers, false, has_bias)?;
    c.moe = Some(moe);
    if arch == Arch::Mistral4 {
        c.attn_temp = super::mistral3::gguf_temperature(g, name, &c);
    }
    latent(c, m, &g.path.display().to_string())
}
