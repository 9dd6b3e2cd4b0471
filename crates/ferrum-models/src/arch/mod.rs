//! The architecture table: which file names a family answers to and how its configuration
//! keys map onto [`ModelConfig`]. One file per family says what its config keys mean and how
//! its layers differ from Llama's; the layers themselves are the shared ones of
//! [`crate::layers`], run by [`crate::decoder`]. A new family is a new file and a row here.

pub mod deepseek2;
pub mod gemma3;
pub mod gemma4;
pub mod glm4moe;
pub mod gpt_oss;
pub mod granite;
pub mod llama;
pub mod mistral3;
pub mod olmo2;
pub mod phi3;
pub mod qwen;
pub mod qwen35;
pub mod smollm3;

use ferrum_core::Result;
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use crate::config::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    /// Qwen2-VL / Qwen2.5-VL's language model: Qwen2 with M-RoPE.
    Qwen2Vl,
    Qwen3,
    /// Qwen3-VL's language model: Qwen3 with interleaved M-RoPE and DeepStack rows.
    Qwen3Vl,
    /// Qwen3 attention with a mixture-of-experts FFN.
    Qwen3Moe,
    /// Qwen3-VL-MoE's language model: Qwen3-MoE with Qwen3-VL's M-RoPE and DeepStack rows.
    Qwen3VlMoe,
    Gemma3,
    Phi3,
    SmolLm3,
    Granite,
    Olmo2,
    GptOss,
    /// Hybrid Gated DeltaNet + gated attention (Qwen3.5).
    Qwen35,
    /// Qwen3.5 with Qwen3-MoE experts and a gated shared expert.
    Qwen35Moe,
    /// GLM-4.5 / 4.6: partial rotary, dense leading layers, DeepSeek-V3's router.
    Glm4Moe,
    /// DeepSeek-V3: multi-head latent attention, DeepSeek-V3's router.
    Deepseek2,
    /// Ministral 3 / Mistral Small 3.x: Llama with YaRN and a query temperature.
    Mistral3,
    /// Mistral 4: DeepSeek-V3's latent attention and experts, a softmax router.
    Mistral4,
    /// Gemma 4: per-layer inputs, KV-shared layers, two head sizes, experts beside the MLP.
    Gemma4,
}

/// How one family is recognised and read.
pub struct ArchInfo {
    pub arch: Arch,
    /// Our name for it, which is also its GGUF `general.architecture`.
    pub name: &'static str,
    /// Other GGUF `general.architecture` values read the same way.
    pub gguf_aliases: &'static [&'static str],
    /// Hugging Face `architectures` classes.
    pub hf_classes: &'static [&'static str],
    /// Hugging Face `model_type`s (used when `architectures` is absent).
    pub model_types: &'static [&'static str],
    pub from_hf: fn(&Json) -> Result<ModelConfig>,
    /// `(file, vocabulary size, tied head)`.
    pub from_gguf: fn(&GgufFile, usize, bool) -> Result<ModelConfig>,
    /// Hugging Face → GGUF tensor names where this family differs from
    /// [`crate::names::DECODER`] (looked up first).
    pub names: &'static [(&'static str, &'static str)],
}

pub const ARCHS: &[ArchInfo] = &[
    llama::INFO,
    qwen::QWEN2,
    qwen::QWEN2_VL,
    qwen::QWEN3_VL,
    qwen::QWEN3,
    qwen::QWEN3_MOE,
    qwen::QWEN3_VL_MOE,
    gemma3::INFO,
    phi3::INFO,
    smollm3::INFO,
    granite::INFO,
    olmo2::INFO,
    gpt_oss::INFO,
    qwen35::QWEN35,
    qwen35::QWEN35_MOE,
    glm4moe::INFO,
    deepseek2::INFO,
    mistral3::INFO,
    deepseek2::MISTRAL4,
    gemma4::INFO,
];

impl Arch {
    pub fn info(self) -> &'static ArchInfo {
        // Every variant has a row (a test holds the table to it).
        ARCHS.iter().find(|a| a.arch == self).unwrap_or(&ARCHS[0])
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    pub fn from_gguf_name(name: &str) -> Option<Arch> {
        ARCHS
            .iter()
            .find(|a| a.name == name || a.gguf_aliases.contains(&name))
            .map(|a| a.arch)
    }

    pub fn from_hf(class: Option<&str>, model_type: Option<&str>) -> Option<Arch> {
        match class {
            Some(c) => ARCHS.iter().find(|a| a.hf_classes.contains(&c)),
            None => model_type.and_then(|t| ARCHS.iter().find(|a| a.model_types.contains(&t))),
        }
        .map(|a| a.arch)
    }

    /// Every supported GGUF architecture name, for error messages.
    pub fn supported_gguf() -> String {
        ARCHS.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
    }

    /// Every supported Hugging Face class, for error messages.
    pub fn supported_hf() -> String {
        ARCHS
            .iter()
            .flat_map(|a| a.hf_classes.iter().copied())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arch_has_one_row() {
        for a in [
            Arch::Llama,
            Arch::Qwen2,
            Arch::Qwen2Vl,
            Arch::Qwen3,
            Arch::Qwen3Vl,
            Arch::Qwen3Moe,
            Arch::Qwen3VlMoe,
            Arch::Gemma3,
            Arch::Phi3,
            Arch::SmolLm3,
            Arch::Granite,
            Arch::Olmo2,
            Arch::GptOss,
            Arch::Qwen35,
            Arch::Qwen35Moe,
            Arch::Glm4Moe,
            Arch::Deepseek2,
            Arch::Mistral3,
            Arch::Mistral4,
            Arch::Gemma4,
        ] {
            assert_eq!(ARCHS.iter().filter(|i| i.arch == a).count(), 1, "{a:?}");
            assert_eq!(a.info().arch, a);
            assert_eq!(Arch::from_gguf_name(a.name()), Some(a));
        }
    }
}
