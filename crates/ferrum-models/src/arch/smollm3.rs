//! SmolLM3: Llama with RoPE skipped in some layers (`no_rope_layers`, 0 = no rotation; by
//! default every fourth layer, `no_rope_layer_interval`). llama.cpp's GGUFs carry no list:
//! its graph skips every fourth layer.

use ferrum_backend::RopeLayout;
use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use super::{Arch, ArchInfo};
use crate::config::{hf_opt_usize, ModelConfig, Rope};

pub const INFO: ArchInfo = ArchInfo {
    arch: Arch::SmolLm3,
    name: "smollm3",
    gguf_aliases: &[],
    hf_classes: &["SmolLM3ForCausalLM"],
    model_types: &["smollm3"],
    from_hf,
    from_gguf,
    names: &[],
};

const INTERVAL: usize = 4;

fn from_hf(j: &Json) -> Result<ModelConfig> {
    let mut c = ModelConfig::hf_base(Arch::SmolLm3, j)?;
    let interval = hf_opt_usize(j, "no_rope_layer_interval").unwrap_or(INTERVAL);
    let list: Option<Vec<u64>> = j
        .get("no_rope_layers")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_u64).collect());
    if list.as_ref().is_some_and(|l| l.len() != c.n_layers) {
        return Err(Error::Weights(
            "config.json: no_rope_layers does not list every layer".into(),
        ));
    }
    for (i, l) in c.layers.iter_mut().enumerate() {
        let rotate = match &list {
            Some(v) => v[i] != 0,
            None => interval == 0 || !(i + 1).is_multiple_of(interval),
        };
        if !rotate {
            l.rope = Rope::None;
        }
    }
    c.check("config.json")
}

fn from_gguf(g: &GgufFile, vocab: usize, tied: bool) -> Result<ModelConfig> {
    let mut c = ModelConfig::gguf_base(Arch::SmolLm3, g, vocab, tied)?;
    // Converted as Llama: Q/K rows permuted for the interleaved rotation.
    c.rope_layout = RopeLayout::Interleaved;
    for (i, l) in c.layers.iter_mut().enumerate() {
        if (i + 1).is_multiple_of(INTERVAL) {
            l.rope = Rope::None;
        }
    }
    c.check(&g.path.display().to_string())
}
