//! Llama (Llama 2/3, SmolLM2, TinyLlama) and Mistral: the baseline every other family is
//! described against — pre-norms, SwiGLU, full RoPE, no biases unless `attention_bias`.

use ferrum_backend::RopeLayout;
use ferrum_core::Result;
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{hf_opt_usize, ModelConfig};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::Llama,
    name: "llama",
    gguf_aliases: &["mistral"],
    hf_classes: &["LlamaForCausalLM", "MistralForCausalLM"],
    model_types: &["llama", "mistral"],
    from_hf,
    from_gguf,
    names: &[],
};

fn from_hf(j: &Json) -> Result<ModelConfig> {
    let mut c = ModelConfig::hf_base(Arch::Llama, j)?;
    // Mistral checkpoints load as Llama and carry the window without `use_sliding_window`.
    if c.sliding_window.is_none() {
        c.set_window_all(hf_opt_usize(j, "sliding_window").filter(|&w| w > 0));
    }
    c.check("config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::Llama, g, vocab, tied)?;
    // convert_hf_to_gguf.py permutes Llama's Q/K rows for the interleaved rotation.
    c.rope_layout = RopeLayout::Interleaved;
    c.check(&g.path.display().to_string())
}
