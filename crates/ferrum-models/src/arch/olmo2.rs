//! OLMo 2: no norm before attention or the FFN; instead an RMSNorm on each block's output
//! before the residual add (`post_attention_layernorm`, `post_feedforward_layernorm`), and
//! QK-norm over the whole projection (a `q_dim` / `kv_dim` weight) rather than per head.

use ferrum_core::Result;
use ferrum_loader::GgufFile;

use super::{Arch, ArchInfo};
use crate::config::{ModelConfig, NormPlan, QkNorm};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Olmo2,
    name: "olmo2",
    gguf_aliases: &[],
    hf_classes: &["Olmo2ForCausalLM"],
    model_types: &["olmo2"],
    from_hf: |j| common(ModelConfig::hf_base(Arch::Olmo2, j)?, "config.json"),
    from_gguf,
    names: &[
        (
            "model.layers.{i}.post_attention_layernorm.weight",
            "blk.{i}.post_attention_norm.weight",
        ),
        (
            "model.layers.{i}.post_feedforward_layernorm.weight",
            "blk.{i}.post_ffw_norm.weight",
        ),
    ],
};

const NORMS: NormPlan = NormPlan {
    attn_in: None,
    attn_out: Some("model.layers.{i}.post_attention_layernorm.weight"),
    ffn_in: None,
    ffn_out: Some("model.layers.{i}.post_feedforward_layernorm.weight"),
};

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let c = ModelConfig::gguf_base(Arch::Olmo2, g, vocab, tied)?;
    common(c, &g.path.display().to_string())
}

fn common(mut c: ModelConfig, source: &str) -> Result<ModelConfig> {
    c.norms = NORMS;
    c.qk_norm = QkNorm::Whole;
    c.check(source)
}
