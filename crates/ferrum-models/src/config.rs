//! The hyper-parameters of a decoder, read from either a Hugging Face `config.json` or a
//! GGUF's `{arch}.*` metadata, into one typed struct. Architecture files decide the variant
//! flags (QKV bias, QK-norm, RoPE layout); this module only reads numbers.

use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use serde_json::Value as Json;

use ferrum_backend::RopeLayout;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    /// Qwen3 attention with a mixture-of-experts FFN.
    Qwen3Moe,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }
}

/// How RoPE frequencies are stretched for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Divide every frequency by `factor`.
    Linear { factor: f32 },
    /// Llama 3.1's band-wise scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// Per-frequency divisors stored in the file (GGUF `rope_freqs.weight`).
    Factors(Vec<f32>),
}

/// The mixture-of-experts settings of a Qwen3-MoE-style model.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub n_experts: usize,
    /// Experts per token (top-k).
    pub n_active: usize,
    /// Hidden width of each expert's SwiGLU.
    pub expert_ffn: usize,
    /// Divide the top-k routing weights by their sum.
    pub norm_topk_prob: bool,
    /// Layers that use the dense MLP instead.
    pub mlp_only_layers: Vec<usize>,
    /// Every `sparse_step`-th layer is sparse (`(i + 1) % sparse_step == 0`).
    pub sparse_step: usize,
}

impl MoeConfig {
    /// Whether layer `i` routes to experts (the rule of transformers' `Qwen3MoeDecoderLayer`).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.sparse_step > 0
            && (i + 1).is_multiple_of(self.sparse_step)
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rope_layout: RopeLayout,
    pub max_position: usize,
    pub tie_embeddings: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub sliding_window: Option<usize>,
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Inverse RoPE frequencies, one per rotated pair, with any scaling applied. Computed
    /// as Hugging Face does (`1 / theta^(2i/d)`), in f64 then rounded once.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / d as f64))
            .collect();
        let scaled: Vec<f64> = match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => {
                base.iter().map(|f| f / *factor as f64).collect()
            }
            Some(RopeScaling::Factors(div)) => base
                .iter()
                .zip(div.iter().chain(std::iter::repeat(&1.0)))
                .map(|(f, d)| f / *d as f64)
                .collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            }) => {
                let (factor, lo, hi, old) = (
                    *factor as f64,
                    *low_freq_factor as f64,
                    *high_freq_factor as f64,
                    *original_max_position as f64,
                );
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }

    fn validate(self, source: &str) -> Result<Self> {
        let bad = |m: String| Err(Error::Weights(format!("{source}: {m}")));
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return bad(format!(
                "{} attention heads cannot be grouped over {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dimension {} must be even", self.head_dim));
        }
        if self.hidden_size == 0 || self.n_layers == 0 || self.vocab_size == 0 {
            return bad("hidden size, layer count and vocabulary must be non-zero".into());
        }
        if let Some(m) = &self.moe {
            if m.n_experts == 0 || m.n_active == 0 || m.n_active > m.n_experts || m.expert_ffn == 0
            {
                return bad(format!(
                    "{} experts with {} active per token and width {} is not a valid MoE",
                    m.n_experts, m.n_active, m.expert_ffn
                ));
            }
        }
        Ok(self)
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf(arch: Arch, j: &Json) -> Result<ModelConfig> {
        let req = |k: &str| -> Result<usize> {
            j.get(k)
                .and_then(Json::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| Error::Weights(format!("config.json: missing or invalid {k:?}")))
        };
        let opt_f = |k: &str| j.get(k).and_then(Json::as_f64);
        let hidden = req("hidden_size")?;
        let n_heads = req("num_attention_heads")?;
        let n_kv = j
            .get("num_key_value_heads")
            .and_then(Json::as_u64)
            .map_or(n_heads, |v| v as usize);
        let head_dim = j
            .get("head_dim")
            .and_then(Json::as_u64)
            .map_or(hidden / n_heads.max(1), |v| v as usize);
        // transformers 5 moves rope settings into `rope_parameters`; older files use
        // `rope_theta` and `rope_scaling`.
        let rope_params = j.get("rope_parameters");
        let rope_theta = opt_f("rope_theta")
            .or_else(|| {
                rope_params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Json::as_f64)
            })
            .unwrap_or(10000.0) as f32;
        let scaling_obj = j
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or(rope_params);
        let rope_scaling = match scaling_obj {
            Some(s) => parse_hf_scaling(s)?,
            None => None,
        };
        let sliding_window = if j.get("use_sliding_window").and_then(Json::as_bool) == Some(true) {
            j.get("sliding_window")
                .and_then(Json::as_u64)
                .map(|v| v as usize)
        } else if arch == Arch::Llama {
            // Mistral checkpoints load as Llama and carry the window without the flag.
            j.get("sliding_window")
                .and_then(Json::as_u64)
                .map(|v| v as usize)
        } else {
            None
        };
        let (qkv_bias, qk_norm) = match arch {
            Arch::Llama => (
                j.get("attention_bias")
                    .and_then(Json::as_bool)
                    .unwrap_or(false),
                false,
            ),
            Arch::Qwen2 => (true, false),
            Arch::Qwen3 | Arch::Qwen3Moe => (
                j.get("attention_bias")
                    .and_then(Json::as_bool)
                    .unwrap_or(false),
                true,
            ),
        };
        let moe = if arch == Arch::Qwen3Moe {
            // Published checkpoints say `num_experts`; transformers 5 writes `num_local_experts`.
            let n_experts = j
                .get("num_experts")
                .or_else(|| j.get("num_local_experts"))
                .and_then(Json::as_u64)
                .ok_or_else(|| Error::Weights("config.json: no num_experts".into()))?;
            Some(MoeConfig {
                n_experts: n_experts as usize,
                n_active: req("num_experts_per_tok")?,
                expert_ffn: req("moe_intermediate_size")?,
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
                sparse_step: j
                    .get("decoder_sparse_step")
                    .and_then(Json::as_u64)
                    .map_or(1, |v| v as usize),
            })
        } else {
            None
        };
        ModelConfig {
            arch,
            vocab_size: req("vocab_size")?,
            hidden_size: hidden,
            n_layers: req("num_hidden_layers")?,
            n_heads,
            n_kv_heads: n_kv,
            head_dim,
            intermediate_size: j
                .get("intermediate_size")
                .and_then(Json::as_u64)
                .map(|v| v as usize)
                .or(moe.as_ref().map(|m| m.expert_ffn))
                .ok_or_else(|| {
                    Error::Weights("config.json: missing \"intermediate_size\"".into())
                })?,
            rms_eps: opt_f("rms_norm_eps").unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            rope_layout: RopeLayout::Neox,
            max_position: j
                .get("max_position_embeddings")
                .and_then(Json::as_u64)
                .map_or(4096, |v| v as usize),
            tie_embeddings: j
                .get("tie_word_embeddings")
                .and_then(Json::as_bool)
                .unwrap_or(false),
            qkv_bias,
            qk_norm,
            sliding_window,
            moe,
        }
        .validate("config.json")
    }

    /// From GGUF metadata (`{arch}.embedding_length` etc.). Vocabulary size and whether the
    /// output head is tied come from the tensors, which the caller passes in.
    pub fn from_gguf(
        arch: Arch,
        g: &GgufFile,
        vocab_size: usize,
        tie_embeddings: bool,
    ) -> Result<ModelConfig> {
        let a = g.architecture()?.to_string();
        let key = |k: &str| format!("{a}.{k}");
        let hidden = g.require_usize(&key("embedding_length"))?;
        let n_heads = g.require_usize(&key("attention.head_count"))?;
        let n_kv = g
            .get_u64(&key("attention.head_count_kv"))
            .map_or(n_heads, |v| v as usize);
        let head_dim = g
            .get_u64(&key("attention.key_length"))
            .map_or(hidden / n_heads.max(1), |v| v as usize);
        let rope_scaling = match g.get_str(&key("rope.scaling.type")) {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: g.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0) as f32,
            }),
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: RoPE scaling {other:?}",
                    g.path.display()
                )))
            }
        };
        let (qkv_bias, qk_norm, layout) = match arch {
            // Llama GGUFs store Q/K rows permuted for the interleaved rotation.
            Arch::Llama => (false, false, RopeLayout::Interleaved),
            Arch::Qwen2 => (true, false, RopeLayout::Neox),
            Arch::Qwen3 | Arch::Qwen3Moe => (false, true, RopeLayout::Neox),
        };
        // llama.cpp's qwen3moe graph routes every layer and always renormalises the top-k
        // weights, and its GGUFs carry no key saying otherwise.
        let moe = if arch == Arch::Qwen3Moe {
            Some(MoeConfig {
                n_experts: g.require_usize(&key("expert_count"))?,
                n_active: g.require_usize(&key("expert_used_count"))?,
                expert_ffn: g.require_usize(&key("expert_feed_forward_length"))?,
                norm_topk_prob: true,
                mlp_only_layers: Vec::new(),
                sparse_step: 1,
            })
        } else {
            None
        };
        ModelConfig {
            arch,
            vocab_size,
            hidden_size: hidden,
            n_layers: g.require_usize(&key("block_count"))?,
            n_heads,
            n_kv_heads: n_kv,
            head_dim,
            intermediate_size: match &moe {
                Some(m) => g
                    .get_u64(&key("feed_forward_length"))
                    .map_or(m.expert_ffn, |v| v as usize),
                None => g.require_usize(&key("feed_forward_length"))?,
            },
            rms_eps: g
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6) as f32,
            rope_theta: g.get_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32,
            rope_scaling,
            rope_layout: layout,
            max_position: g
                .get_u64(&key("context_length"))
                .map_or(4096, |v| v as usize),
            tie_embeddings,
            qkv_bias,
            qk_norm,
            sliding_window: g
                .get_u64(&key("attention.sliding_window"))
                .map(|v| v as usize),
            moe,
        }
        .validate(&g.path.display().to_string())
    }
}

fn parse_hf_scaling(s: &Json) -> Result<Option<RopeScaling>> {
    let ty = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Json::as_str)
        .unwrap_or("default");
    let f = |k: &str, d: f64| s.get(k).and_then(Json::as_f64).unwrap_or(d) as f32;
    Ok(match ty {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: f("factor", 1.0),
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: f("factor", 8.0),
            low_freq_factor: f("low_freq_factor", 1.0),
            high_freq_factor: f("high_freq_factor", 4.0),
            original_max_position: f("original_max_position_embeddings", 8192.0),
        }),
        other => {
            return Err(Error::Unsupported(format!("RoPE scaling type {other:?}")));
        }
    })
}
