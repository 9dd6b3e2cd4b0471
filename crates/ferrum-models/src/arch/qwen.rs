//! Qwen2 (QKV bias), Qwen3 (QK-norm per head) and Qwen3-MoE (Qwen3 attention, routed
//! SwiGLU experts).

use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{
    hf_opt_usize, hf_usize, MRope, ModelConfig, MoeConfig, MoeStyle, QkNorm, Routing,
};

pub const QWEN2: ArchInfo = ArchInfo {
    arch: Arch::Qwen2,
    name: "qwen2",
    gguf_aliases: &[],
    hf_classes: &["Qwen2ForCausalLM"],
    model_types: &["qwen2"],
    from_hf: |j| {
        let mut c = ModelConfig::hf_base(Arch::Qwen2, j)?;
        c.qkv_bias = true;
        c.check("config.json")
    },
    from_gguf: |g, vocab, tied| {
        let mut c = ModelConfig::gguf_base(Arch::Qwen2, g, vocab, tied)?;
        c.qkv_bias = true;
        c.check(&g.path.display().to_string())
    },
    names: &[],
};

/// Qwen2-VL and Qwen2.5-VL's language model: Qwen2 with M-RoPE (`mrope_section`, in the
/// checkpoint's `text_config` or, in older files, beside it; llama.cpp's
/// `qwen2vl.rope.dimension_sections`).
pub const QWEN2_VL: ArchInfo = ArchInfo {
    arch: Arch::Qwen2Vl,
    name: "qwen2vl",
    gguf_aliases: &[],
    hf_classes: &[
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2VLForConditionalGeneration",
    ],
    model_types: &["qwen2_5_vl", "qwen2_vl"],
    from_hf: |j| {
        let t = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
        let mut c = ModelConfig::hf_base(Arch::Qwen2Vl, t)?;
        c.qkv_bias = true;
        c.mrope = MRope::from_hf(t, false).or_else(|| MRope::from_hf(j, false));
        c.check("config.json")
    },
    from_gguf: |g, vocab, tied| {
        let mut c = ModelConfig::gguf_base(Arch::Qwen2Vl, g, vocab, tied)?;
        c.qkv_bias = true;
        c.mrope = gguf_sections(g, false)?;
        c.check(&g.path.display().to_string())
    },
    names: &[],
};

/// llama.cpp's `{arch}.rope.dimension_sections` (four values, the fourth unused here).
pub(crate) fn gguf_sections(g: &GgufFile, interleaved: bool) -> Result<Option<MRope>> {
    let key = format!("{}.rope.dimension_sections", g.architecture()?);
    let Some(v) = g.get_i64_array(&key) else {
        return Ok(None);
    };
    match v[..] {
        [t, h, w, ..] if t >= 0 && h >= 0 && w >= 0 => Ok(Some(MRope {
            sections: [t as usize, h as usize, w as usize],
            interleaved,
        })),
        _ => Err(Error::Weights(format!(
            "{}: {key} has {} values",
            g.path.display(),
            v.len()
        ))),
    }
}

/// Qwen3-VL's language model: Qwen3 with interleaved M-RoPE (`mrope_section` in its
/// `text_config`; llama.cpp's `qwen3vl.rope.dimension_sections`). Its first layers also take
/// the vision tower's DeepStack rows ([`crate::decoder::Embeds::deep`]).
pub const QWEN3_VL: ArchInfo = ArchInfo {
    arch: Arch::Qwen3Vl,
    name: "qwen3vl",
    gguf_aliases: &[],
    hf_classes: &["Qwen3VLForConditionalGeneration"],
    model_types: &["qwen3_vl"],
    from_hf: |j| {
        let t = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
        let mut c = ModelConfig::hf_base(Arch::Qwen3Vl, t)?;
        c.qk_norm = QkNorm::PerHead;
        c.mrope = qwen3_vl_mrope(t);
        c.check("config.json")
    },
    from_gguf: |g, vocab, tied| {
        let mut c = ModelConfig::gguf_base(Arch::Qwen3Vl, g, vocab, tied)?;
        c.qk_norm = QkNorm::PerHead;
        c.mrope = gguf_sections(g, true)?;
        c.check(&g.path.display().to_string())
    },
    names: &[],
};

/// Qwen3-VL's interleaved M-RoPE from its text config (Qwen3-VL's own sections where the
/// config has none), for the dense and the MoE language model.
fn qwen3_vl_mrope(t: &Json) -> Option<MRope> {
    Some(MRope::from_hf(t, true).unwrap_or(MRope {
        sections: [24, 20, 20],
        interleaved: true,
    }))
}

pub const QWEN3: ArchInfo = ArchInfo {
    arch: Arch::Qwen3,
    name: "qwen3",
    gguf_aliases: &[],
    hf_classes: &["Qwen3ForCausalLM"],
    model_types: &["qwen3"],
    from_hf: |j| {
        let mut c = ModelConfig::hf_base(Arch::Qwen3, j)?;
        c.qk_norm = QkNorm::PerHead;
        c.check("config.json")
    },
    from_gguf: |g, vocab, tied| {
        let mut c = ModelConfig::gguf_base(Arch::Qwen3, g, vocab, tied)?;
        c.qk_norm = QkNorm::PerHead;
        c.check(&g.path.display().to_string())
    },
    names: &[],
};

pub const QWEN3_MOE: ArchInfo = ArchInfo {
    arch: Arch::Qwen3Moe,
    name: "qwen3moe",
    gguf_aliases: &[],
    hf_classes: &["Qwen3MoeForCausalLM"],
    model_types: &["qwen3_moe"],
    from_hf: moe_from_hf,
    from_gguf: moe_from_gguf,
    names: &[],
};

/// Qwen3-VL-MoE's language model (Qwen3-VL-30B-A3B, 235B-A22B): Qwen3-MoE with Qwen3-VL's
/// interleaved M-RoPE and DeepStack rows (llama.cpp's `qwen3vlmoe`).
pub const QWEN3_VL_MOE: ArchInfo = ArchInfo {
    arch: Arch::Qwen3VlMoe,
    name: "qwen3vlmoe",
    gguf_aliases: &[],
    hf_classes: &["Qwen3VLMoeForConditionalGeneration"],
    model_types: &["qwen3_vl_moe"],
    from_hf: |j| {
        let t = j.get("text_config").filter(|t| t.is_object()).unwrap_or(j);
        let mut c = moe_config_hf(Arch::Qwen3VlMoe, t)?;
        // Its router always renormalises the chosen experts' weights; the config has no
        // `norm_topk_prob` (transformers' Qwen3VLMoeTextTopKRouter).
        if let Some(m) = c.moe.as_mut() {
            m.norm_topk_prob = true;
        }
        c.mrope = qwen3_vl_mrope(t);
        c.check("config.json")
    },
    from_gguf: |g, vocab, tied| {
        let mut c = moe_config_gguf(Arch::Qwen3VlMoe, "qwen3vlmoe", g, vocab, tied)?;
        c.mrope = gguf_sections(g, true)?;
        c.check(&g.path.display().to_string())
    },
    names: &[],
};

fn moe_from_hf(j: &Json) -> Result<ModelConfig> {
    moe_config_hf(Arch::Qwen3Moe, j)?.check("config.json")
}

/// Qwen3-MoE's configuration from a (text) config, for `arch`; not yet checked.
fn moe_config_hf(arch: Arch, j: &Json) -> Result<ModelConfig> {
    let mut c = ModelConfig::hf_base(arch, j)?;
    c.qk_norm = QkNorm::PerHead;
    // Published checkpoints say `num_experts`; transformers 5 writes `num_local_experts`.
    let n_experts = hf_opt_usize(j, "num_experts")
        .or_else(|| hf_opt_usize(j, "num_local_experts"))
        .ok_or_else(|| Error::Weights("config.json: no num_experts".into()))?;
    let m = MoeConfig {
        style: MoeStyle::Qwen,
        n_experts,
        n_active: hf_usize(j, "num_experts_per_tok")?,
        expert_ffn: hf_usize(j, "moe_intermediate_size")?,
        norm_topk_prob: j
            .get("norm_topk_prob")
            .and_then(Json::as_bool)
            .unwrap_or(false),
        mlp_only_layers: j
            .get("mlp_only_layers")
            .and_then(Json::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Json::as_u64)
                    .map(|v| v as usize)
                    .collect()
            })
            .unwrap_or_default(),
        sparse_step: hf_opt_usize(j, "decoder_sparse_step").unwrap_or(1),
        shared_ffn: None,
        shared_gate: false,
        routing: Routing::SOFTMAX,
    };
    if c.intermediate_size == 0 {
        c.intermediate_size = m.expert_ffn;
    }
    c.moe = Some(m);
    Ok(c)
}

fn moe_from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    moe_config_gguf(Arch::Qwen3Moe, "qwen3moe", g, vocab, tied)?
        .check(&g.path.display().to_string())
}

/// Qwen3-MoE's configuration from GGUF keys under `prefix`, for `arch`; not yet checked.
fn moe_config_gguf(
    arch: Arch,
    prefix: &str,
    g: &GgufFile,
    vocab: usize,
    tied: bool,
) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(arch, g, vocab, tied)?;
    c.qk_norm = QkNorm::PerHead;
    let m = MoeConfig::from_gguf(g, prefix, MoeStyle::Qwen)?;
    if c.intermediate_size == 0 {
        c.intermediate_size = m.expert_ffn;
    }
    c.moe = Some(m);
    Ok(c)
}
