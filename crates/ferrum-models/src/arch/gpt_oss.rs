//! gpt-oss (OpenAI's open-weight MoE): Llama-shaped layers with
//! - biases on the q/k/v and output projections, and an attention sink per query head (a
//!   logit that joins each softmax's denominator);
//! - layers alternating a sliding window (`sliding_window`, 128) and full attention, as
//!   `layer_types` lists them (sliding first; llama.cpp: even layers);
//! - YaRN RoPE on split halves, its attention factor on cos and sin;
//! - every FFN a mixture of experts: a router with a bias, the top-k logits softmaxed,
//!   experts with biases and the clamped SwiGLU `(clamp(up, ±limit) + 1) · g · σ(α g)`,
//!   `g = min(gate, limit)`, α = 1.702 (see [`crate::moe`]).

use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{
    hf_f64, hf_opt_usize, hf_usize, LayerSpec, ModelConfig, MoeConfig, MoeStyle, RopeScaling,
    Routing,
};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::GptOss,
    name: "gpt-oss",
    gguf_aliases: &[],
    hf_classes: &["GptOssForCausalLM"],
    model_types: &["gpt_oss"],
    from_hf,
    from_gguf,
    names: &[
        (
            "model.layers.{i}.self_attn.o_proj.bias",
            "blk.{i}.attn_output.bias",
        ),
        (
            "model.layers.{i}.self_attn.sinks",
            "blk.{i}.attn_sinks.weight",
        ),
        (
            "model.layers.{i}.post_attention_layernorm.weight",
            "blk.{i}.post_attention_norm.weight",
        ),
        (
            "model.layers.{i}.mlp.router.weight",
            "blk.{i}.ffn_gate_inp.weight",
        ),
        (
            "model.layers.{i}.mlp.router.bias",
            "blk.{i}.ffn_gate_inp.bias",
        ),
    ],
};

const ALPHA: f32 = 1.702;

/// What gpt-oss adds to the shared configuration.
fn finish(mut c: ModelConfig, moe: MoeConfig, window: usize, sliding: &[bool]) -> ModelConfig {
    c.qkv_bias = true;
    c.o_bias = true;
    c.attn_sinks = true;
    c.intermediate_size = moe.expert_ffn;
    c.moe = Some(moe);
    c.layers = sliding
        .iter()
        .map(|&s| LayerSpec {
            window: s.then_some(window),
            ..LayerSpec::GLOBAL
        })
        .collect();
    c.sliding_window = Some(window);
    c.rope_factor = c
        .rope_scaling
        .as_ref()
        .map_or(1.0, RopeScaling::attention_factor);
    c
}

fn from_hf(j: &Json) -> Result<ModelConfig> {
    let mut c = ModelConfig::hf_base(Arch::GptOss, j)?;
    // transformers' GptOssConfig defaults, where a config leaves them out.
    let rope = j.get("rope_parameters");
    if hf_f64(j, "rope_theta")
        .or_else(|| rope.and_then(|p| hf_f64(p, "rope_theta")))
        .is_none()
    {
        c.rope_theta = 150_000.0;
    }
    if c.rope_scaling.is_none() {
        let s = RopeScaling::Yarn {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position: 4096.0,
            truncate: false,
            attention_factor: 1.0 + 0.1 * 32f32.ln(),
        };
        c.rope_factor = s.attention_factor();
        c.rope_scaling = Some(s);
    }
    if hf_f64(j, "rms_norm_eps").is_none() {
        c.rms_eps = 1e-5;
    }
    let moe = MoeConfig {
        style: MoeStyle::GptOss {
            alpha: hf_f64(j, "swiglu_alpha").unwrap_or(ALPHA as f64) as f32,
            limit: hf_f64(j, "swiglu_limit").unwrap_or(7.0) as f32,
        },
        n_experts: hf_opt_usize(j, "num_local_experts")
            .or_else(|| hf_opt_usize(j, "num_experts"))
            .ok_or_else(|| Error::Weights("config.json: no num_local_experts".into()))?,
        n_active: hf_opt_usize(j, "num_experts_per_tok")
            .or_else(|| hf_opt_usize(j, "experts_per_token"))
            .unwrap_or(4),
        expert_ffn: hf_usize(j, "intermediate_size")?,
        // A softmax over the top-k logits is a softmax over all, cut and renormalised.
        norm_topk_prob: true,
        mlp_only_layers: Vec::new(),
        sparse_step: 1,
        shared_ffn: None,
        shared_gate: false,
        routing: Routing::SOFTMAX,
    };
    let window = hf_opt_usize(j, "sliding_window").unwrap_or(128);
    let sliding: Vec<bool> = match j.get("layer_types").and_then(Json::as_array) {
        Some(t) => {
            if t.len() != c.n_layers {
                return Err(Error::Weights(
                    "config.json: layer_types does not list every layer".into(),
                ));
            }
            t.iter()
                .map(|v| v.as_str() == Some("sliding_attention"))
                .collect()
        }
        None => (0..c.n_layers).map(|i| i % 2 == 0).collect(),
    };
    finish(c, moe, window, &sliding).check("config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let c = ModelConfig::gguf_base(Arch::GptOss, g, vocab, tied)?;
    let key = |k: &str| format!("gpt-oss.{k}");
    let style = MoeStyle::GptOss {
        alpha: ALPHA,
        limit: g.get_f64(&key("swiglu_limit")).map_or(7.0, |v| v as f32),
    };
    let moe = MoeConfig::from_gguf(g, "gpt-oss", style)?;
    let window = g
        .get_u64(&key("attention.sliding_window"))
        .map_or(128, |v| v as usize);
    // llama.cpp's pattern for gpt-oss: even layers slide.
    let sliding: Vec<bool> = (0..c.n_layers).map(|i| i % 2 == 0).collect();
    finish(c, moe, window, &sliding).check(&g.path.display().to_string())
}
