//! GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`, GGUF `glm4moe`).
//!
//! Against Llama: Q/K/V biases; optional QK-norm per head; RoPE over the first half of each
//! head only (`partial_rotary_factor`, NeoX halves); the first `first_k_dense_replace`
//! layers keep a dense SwiGLU, the rest route to experts with DeepSeek-V3's router (each
//! expert's sigmoid, a per-layer correction bias that steers the choice but not the
//! weights, group-limited top-k, renormalised weights times `routed_scaling_factor`) beside
//! an ungated shared expert. Checkpoints carry a multi-token-prediction layer after the
//! last one: transformers never loads it, and llama.cpp's GGUFs count it in `block_count`
//! and say so in `nextn_predict_layers`; it is not run here either.

use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{hf_opt_usize, hf_usize, ModelConfig, MoeConfig, MoeStyle, QkNorm, Routing};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Glm4Moe,
    name: "glm4moe",
    gguf_aliases: &[],
    hf_classes: &["Glm4MoeForCausalLM"],
    model_types: &["glm4_moe"],
    from_hf,
    from_gguf,
    names: &[(
        // llama.cpp calls GLM's pre-FFN norm the attention's post-norm.
        "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.post_attention_norm.weight",
    )],
};

fn from_hf(j: &Json) -> Result<ModelConfig> {
    let mut c = ModelConfig::hf_base(Arch::Glm4Moe, j)?;
    if j.get("partial_rotary_factor").is_none()
        && j.get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor"))
            .is_none()
    {
        // transformers' default for this family.
        c.rotary_dim = (c.head_dim / 2) & !1;
    }
    if j.get("use_qk_norm").and_then(Json::as_bool) == Some(true) {
        c.qk_norm = QkNorm::PerHead;
    }
    let dense = hf_opt_usize(j, "first_k_dense_replace").unwrap_or(1);
    let shared = hf_opt_usize(j, "n_shared_experts").unwrap_or(1);
    let expert_ffn = hf_usize(j, "moe_intermediate_size")?;
    let m = MoeConfig {
        style: MoeStyle::Qwen,
        n_experts: hf_opt_usize(j, "n_routed_experts")
            .or_else(|| hf_opt_usize(j, "num_local_experts"))
            .ok_or_else(|| Error::Weights("config.json: no n_routed_experts".into()))?,
        n_active: hf_usize(j, "num_experts_per_tok")?,
        expert_ffn,
        norm_topk_prob: j
            .get("norm_topk_prob")
            .and_then(Json::as_bool)
            .unwrap_or(true),
        mlp_only_layers: (0..dense.min(c.n_layers)).collect(),
        sparse_step: 1,
        shared_ffn: (shared > 0).then_some(shared * expert_ffn),
        shared_gate: false,
        routing: Routing {
            // GLM's router has no `scoring_func` key: always sigmoid with the bias.
            choice_bias: true,
            ..Routing::from_hf(j)?
        },
    };
    c.moe = Some(m);
    c.check("config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::Glm4Moe, g, vocab, tied)?;
    c.drop_gguf_nextn(g, "glm4moe")?;
    let m = MoeConfig::deepseek_from_gguf(g, "glm4moe", c.n_layers, true, true)?;
    c.moe = Some(m);
    // llama.cpp loads the QK-norms and the Q/K/V biases where the file has them (the
    // norms: GLM-4.5's 355B model).
    let has = |name: &str| g.tensor_infos.iter().any(|t| t.name == name);
    if has("blk.0.attn_q_norm.weight") {
        c.qk_norm = QkNorm::PerHead;
    }
    c.qkv_bias = has("blk.0.attn_q.bias");
    c.check(&g.path.display().to_string())
}
