//! A synthetic MoE GGUF for speed comparisons with llama.cpp: the shapes of a real
//! checkpoint, random weights. `--arch qwen3moe` (the default) has Qwen3-30B-A3B's layers
//! (2048 wide, 128 experts, 8 active, expert width 768, 32 query heads, 4 KV heads of 128), a
//! few of them; `--arch gpt-oss` has gpt-oss-20b's (24 layers 2880 wide, 32 experts, 4 active,
//! expert width 2880, 64 query heads, 8 KV heads of 64, every projection and expert biased,
//! attention sinks, a 128-token window on every other layer, YaRN ×32 over 4096), for
//! `--type MXFP4_MOE` as its checkpoints ship. `--arch llama` and `--arch qwen3` are dense
//! counterparts: Llama-3.2-1B's shapes (16 layers 2048 wide, 32/8 heads of 64, FFN 8192, the
//! Llama 3 vocabulary) and Qwen3-4B's (36 layers 2560 wide, 32/8 heads of 128 with QK-norm, FFN
//! 9728), both with tied embeddings. `--arch qwen35` is the hybrid Qwen3.5-9B (32 layers 4096
//! wide, every 4th gated attention with 16/4 heads of 256, the others Gated DeltaNet with 16
//! key and 32 value heads of 128, FFN 12288, the Qwen3.5 vocabulary, untied) and `--arch
//! qwen35moe` Qwen3.5-35B-A3B's layers (40 layers 2048 wide, 16/2 heads of 256, 256 experts of
//! 512, 8 active, a shared expert of 512). `--arch deepseek2` is DeepSeek-V2-Lite's latent
//! attention and experts (27 layers 2048 wide, 16 heads: queries of 128 + 64 rotary, a latent
//! of 512, values of 128, no query bottleneck; the first layer a dense FFN of 10944, the others
//! 64 experts of 1408, 6 active under a softmax router, two shared experts), in llama.cpp's
//! split `attn_k_b`/`attn_v_b` form. `--arch gemma4` is Gemma 4 26B-A4B's layers (30 layers
//! 2816 wide, 16 query heads; five local layers of 8 KV heads of 256 with a 1024 window, then
//! a global one of 2 KV heads of 512 without a value projection; a dense GeGLU of 2112 beside
//! 128 experts of 704, 8 active; tied embeddings, the Gemma 4 vocabulary), and `--arch glm4moe`
//! GLM-4.5-Air's (46 layers 4096 wide, 96/8 heads of 128 with Q/K/V biases and half-rotary,
//! the first layer a dense FFN of 10944, then 128 experts of 1408, 8 active under a sigmoid
//! router with a correction bias, one shared expert).
//!
//! ```text
//! cargo run --release -p ferrum-quantize --example synth_moe -- OUT.gguf --type Q4_K_M \
//!     [--arch qwen3moe|gpt-oss|llama|qwen3|qwen35|qwen35moe] [--layers 4] [--hidden 2048] [--experts 128] \
//!     [--active 8] [--expert-ffn 768] [--ffn N] [--heads 32] [--kv-heads 4] [--head-dim 128] \
//!     [--vocab-from ggml-vocab-qwen2.gguf] [--seed 1]
//! ```
//!
//! - Weights are normal with standard deviation 0.02, norms 1 ± 0.02, the router is f32.
//!   Every tensor's values depend only on the seed, its name and its row, so the Q8_0 and
//!   Q4_K_M files hold the same underlying model.
//! - Each tensor's format is what `ferrum quantize` (llama-quantize's recipe) would give it
//!   for the chosen type: for Q4_K_M, Q4_K everywhere except `output` (Q6_K) and `attn_v` /
//!   `ffn_down_exps` on the `use_more_bits` layers (Q6_K); norms and `ffn_gate_inp` stay f32.
//! - llama.cpp needs a vocabulary: every `tokenizer.*` key is copied from a vocab GGUF
//!   (llama.cpp's `ggml-vocab-qwen2.gguf` by default) and the embedding has one row per token.
//! - The file is streamed a slab of rows at a time, quantised on all cores; nothing close to
//!   the whole file is ever in memory. It is written to `OUT.partial` and renamed when
//!   complete.

use std::path::PathBuf;
use std::time::Instant;

use ferrum_core::DType;
use ferrum_loader::{GgufFile, Value};
use ferrum_quantize::recipe::{self, ModelInfo, PlanInput};
use ferrum_quantize::writer::{GgufWriter, TensorDecl};
use ferrum_quantize::{quantize_row, FileType};
use rand::{Rng, SeedableRng};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, PartialEq)]
enum Arch {
    Qwen3Moe,
    GptOss,
    /// Dense: Llama-3.2-1B's shapes by default (tied embeddings).
    Llama,
    /// Dense: Qwen3-4B's shapes by default (QK-norm, tied embeddings).
    Qwen3,
    /// Hybrid: Qwen3.5-9B's shapes (three Gated DeltaNet layers to each gated-attention
    /// one; untied).
    Qwen35,
    /// Hybrid MoE: Qwen3.5-35B-A3B's shapes (256 experts of 512, 8 active, a shared expert).
    Qwen35Moe,
    /// Latent attention and DeepSeek MoE: DeepSeek-V2-Lite's shapes.
    Deepseek2,
    /// Gemma 4 26B-A4B: two head shapes, experts beside a dense GeGLU.
    Gemma4,
    /// GLM-4.5-Air: biased attention, a dense first layer, sigmoid-routed experts.
    Glm4Moe,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::GptOss => "gpt-oss",
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen35 => "qwen35",
            Arch::Qwen35Moe => "qwen35moe",
            Arch::Deepseek2 => "deepseek2",
            Arch::Gemma4 => "gemma4",
            Arch::Glm4Moe => "glm4moe",
        }
    }

    fn dense(self) -> bool {
        matches!(self, Arch::Llama | Arch::Qwen3)
    }

    fn hybrid(self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Qwen35Moe)
    }
}

struct Opts {
    arch: Arch,
    out: PathBuf,
    ftype: FileType,
    layers: usize,
    hidden: usize,
    experts: usize,
    active: usize,
    expert_ffn: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// The dense FFN's width (`--arch llama|qwen3`).
    ffn: usize,
    vocab_from: PathBuf,
    seed: u64,
}

const USAGE: &str =
    "usage: synth_moe OUT.gguf --type Q8_0|Q4_K_M|MXFP4_MOE|... [--arch qwen3moe|gpt-oss|llama|qwen3|qwen35|qwen35moe|deepseek2|gemma4|glm4moe] \
[--layers 4] [--hidden 2048] [--experts 128] [--active 8] [--expert-ffn 768] [--ffn N] [--heads 32] \
[--kv-heads 4] [--head-dim 128] [--vocab-from PATH] [--seed 1]";

fn parse_args() -> AnyResult<Opts> {
    let cache = std::env::var_os("FERRUM_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ferrum")))
        .unwrap_or_else(|| PathBuf::from(".cache/ferrum"));
    // `--arch` first: it sets the other options' defaults.
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let arch = match argv
        .iter()
        .position(|a| a == "--arch")
        .map(|i| argv.get(i + 1))
    {
        None => Arch::Qwen3Moe,
        Some(Some(a)) if a == "qwen3moe" => Arch::Qwen3Moe,
        Some(Some(a)) if a == "gpt-oss" => Arch::GptOss,
        Some(Some(a)) if a == "llama" => Arch::Llama,
        Some(Some(a)) if a == "qwen3" => Arch::Qwen3,
        Some(Some(a)) if a == "qwen35" => Arch::Qwen35,
        Some(Some(a)) if a == "qwen35moe" => Arch::Qwen35Moe,
        Some(Some(a)) if a == "deepseek2" => Arch::Deepseek2,
        Some(Some(a)) if a == "gemma4" => Arch::Gemma4,
        Some(Some(a)) if a == "glm4moe" => Arch::Glm4Moe,
        Some(other) => {
            return Err(format!(
                "--arch {other:?}: qwen3moe, gpt-oss, llama, qwen3, qwen35, qwen35moe, deepseek2, \
                 gemma4 or glm4moe"
            )
            .into())
        }
    };
    let mut o = Opts {
        arch,
        out: PathBuf::new(),
        ftype: FileType::Q8_0,
        layers: 4,
        hidden: 2048,
        experts: 128,
        active: 8,
        expert_ffn: 768,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        ffn: 0,
        vocab_from: cache.join("llama-vocab/ggml-vocab-qwen2.gguf"),
        seed: 1,
    };
    match arch {
        Arch::Llama => {
            (o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim, o.ffn) =
                (16, 2048, 32, 8, 64, 8192);
            o.vocab_from = cache.join("llama-vocab/ggml-vocab-llama-bpe.gguf");
        }
        Arch::Qwen3 => {
            (o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim, o.ffn) =
                (36, 2560, 32, 8, 128, 9728);
        }
        Arch::Qwen35 => {
            (o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim, o.ffn) =
                (32, 4096, 16, 4, 256, 12288);
            o.vocab_from = cache.join("llama-vocab/ggml-vocab-qwen35.gguf");
        }
        Arch::Deepseek2 => {
            // head_dim: the latent (512); the rest of the attention's shape is fixed below.
            (o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim) = (27, 2048, 16, 1, 512);
            (o.experts, o.active, o.expert_ffn, o.ffn) = (64, 6, 1408, 10944);
        }
        Arch::Gemma4 => {
            // head_dim and kv_heads: the local layers'; the global ones' are fixed below.
            (o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim) = (30, 2816, 16, 8, 256);
            (o.experts, o.active, o.expert_ffn, o.ffn) = (128, 8, 704, 2112);
            o.vocab_from = cache.join("llama-vocab/ggml-vocab-gemma-4.gguf");
        }
        Arch::Glm4Moe => {
            (o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim) = (46, 4096, 96, 8, 128);
            (o.experts, o.active, o.expert_ffn, o.ffn) = (128, 8, 1408, 10944);
        }
        Arch::Qwen35Moe => {
            (o.layers, o.hidden, o.heads, o.kv_heads, o.head_dim) = (40, 2048, 16, 2, 256);
            (o.experts, o.active, o.expert_ffn, o.ffn) = (256, 8, 512, 512);
            o.vocab_from = cache.join("llama-vocab/ggml-vocab-qwen35.gguf");
        }
        _ => {}
    }
    if arch == Arch::GptOss {
        (o.layers, o.hidden, o.experts, o.active, o.expert_ffn) = (24, 2880, 32, 4, 2880);
        (o.heads, o.kv_heads, o.head_dim) = (64, 8, 64);
    }
    let mut out = None;
    let mut ftype = None;
    let mut args = argv.into_iter();
    while let Some(a) = args.next() {
        if a == "-h" || a == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if !a.starts_with("--") {
            if out.replace(PathBuf::from(&a)).is_some() {
                return Err(format!("more than one output path\n{USAGE}").into());
            }
            continue;
        }
        let v = args
            .next()
            .ok_or_else(|| format!("{a} needs a value\n{USAGE}"))?;
        let num = || -> AnyResult<usize> {
            v.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{a}: {v:?} is not a positive integer").into())
        };
        match a.as_str() {
            "--type" => ftype = Some(v.parse::<FileType>()?),
            "--arch" => {}
            "--layers" => o.layers = num()?,
            "--hidden" => o.hidden = num()?,
            "--experts" => o.experts = num()?,
            "--active" => o.active = num()?,
            "--expert-ffn" => o.expert_ffn = num()?,
            "--heads" => o.heads = num()?,
            "--kv-heads" => o.kv_heads = num()?,
            "--head-dim" => o.head_dim = num()?,
            "--ffn" => o.ffn = num()?,
            "--vocab-from" => o.vocab_from = PathBuf::from(&v),
            "--seed" => o.seed = num()? as u64,
            _ => return Err(format!("unknown option {a}\n{USAGE}").into()),
        }
    }
    o.out = out.ok_or(USAGE)?;
    o.ftype = ftype.ok_or(USAGE)?;
    if o.active > o.experts || !o.heads.is_multiple_of(o.kv_heads) {
        return Err("need --active ≤ --experts and --heads a multiple of --kv-heads".into());
    }
    Ok(o)
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy)]
enum Init {
    /// Normal, mean 0, standard deviation 0.02.
    Weight,
    /// Normal, mean 1, standard deviation 0.02.
    Norm,
    /// A DeltaNet's `−exp(A_log)`: normal, mean −1, standard deviation 0.02 (decaying).
    Decay,
}

struct Spec {
    name: String,
    /// GGML order: `dims[0]` is the row length.
    dims: Vec<usize>,
    init: Init,
}

fn specs(o: &Opts, vocab: usize) -> Vec<Spec> {
    let (h, q, kv) = (o.hidden, o.heads * o.head_dim, o.kv_heads * o.head_dim);
    let t = |name: String, dims: Vec<usize>, init| Spec { name, dims, init };
    let mut v = vec![
        t("token_embd.weight".into(), vec![h, vocab], Init::Weight),
        t("output_norm.weight".into(), vec![h], Init::Norm),
        t("output.weight".into(), vec![h, vocab], Init::Weight),
    ];
    if o.arch.dense() {
        // Tied embeddings, as both originals: no output.weight.
        v.retain(|s| s.name != "output.weight");
        for i in 0..o.layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let f = o.ffn;
            v.extend([
                t(n("attn_norm"), vec![h], Init::Norm),
                t(n("attn_q"), vec![h, q], Init::Weight),
                t(n("attn_k"), vec![h, kv], Init::Weight),
                t(n("attn_v"), vec![h, kv], Init::Weight),
                t(n("attn_output"), vec![q, h], Init::Weight),
            ]);
            if o.arch == Arch::Qwen3 {
                v.extend([
                    t(n("attn_q_norm"), vec![o.head_dim], Init::Norm),
                    t(n("attn_k_norm"), vec![o.head_dim], Init::Norm),
                ]);
            }
            v.extend([
                t(n("ffn_norm"), vec![h], Init::Norm),
                t(n("ffn_gate"), vec![h, f], Init::Weight),
                t(n("ffn_up"), vec![h, f], Init::Weight),
                t(n("ffn_down"), vec![f, h], Init::Weight),
            ]);
        }
        return v;
    }
    if o.arch.hybrid() {
        // Qwen3.5's Gated DeltaNet: 16 key heads and 32 value heads of 128, 4 taps.
        let (kh, vh, d) = (16, 32, 128);
        let (conv, vd) = (2 * kh * d + vh * d, vh * d);
        for i in 0..o.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            v.extend([
                t(n("attn_norm.weight"), vec![h], Init::Norm),
                t(n("post_attention_norm.weight"), vec![h], Init::Norm),
            ]);
            if (i + 1) % 4 == 0 {
                v.extend([
                    t(n("attn_q.weight"), vec![h, 2 * q], Init::Weight),
                    t(n("attn_k.weight"), vec![h, kv], Init::Weight),
                    t(n("attn_v.weight"), vec![h, kv], Init::Weight),
                    t(n("attn_output.weight"), vec![q, h], Init::Weight),
                    t(n("attn_q_norm.weight"), vec![o.head_dim], Init::Norm),
                    t(n("attn_k_norm.weight"), vec![o.head_dim], Init::Norm),
                ]);
            } else {
                v.extend([
                    t(n("attn_qkv.weight"), vec![h, conv], Init::Weight),
                    t(n("attn_gate.weight"), vec![h, vd], Init::Weight),
                    t(n("ssm_conv1d.weight"), vec![4, conv], Init::Weight),
                    t(n("ssm_dt.bias"), vec![vh], Init::Weight),
                    t(n("ssm_a"), vec![vh], Init::Decay),
                    t(n("ssm_beta.weight"), vec![h, vh], Init::Weight),
                    t(n("ssm_alpha.weight"), vec![h, vh], Init::Weight),
                    t(n("ssm_norm.weight"), vec![d], Init::Norm),
                    t(n("ssm_out.weight"), vec![vd, h], Init::Weight),
                ]);
            }
            if o.arch == Arch::Qwen35 {
                v.extend([
                    t(n("ffn_gate.weight"), vec![h, o.ffn], Init::Weight),
                    t(n("ffn_up.weight"), vec![h, o.ffn], Init::Weight),
                    t(n("ffn_down.weight"), vec![o.ffn, h], Init::Weight),
                ]);
            } else {
                let (f, e, sf) = (o.expert_ffn, o.experts, o.ffn);
                v.extend([
                    t(n("ffn_gate_inp.weight"), vec![h, e], Init::Weight),
                    t(n("ffn_gate_exps.weight"), vec![h, f, e], Init::Weight),
                    t(n("ffn_up_exps.weight"), vec![h, f, e], Init::Weight),
                    t(n("ffn_down_exps.weight"), vec![f, h, e], Init::Weight),
                    t(n("ffn_gate_inp_shexp.weight"), vec![h, 1], Init::Weight),
                    t(n("ffn_gate_shexp.weight"), vec![h, sf], Init::Weight),
                    t(n("ffn_up_shexp.weight"), vec![h, sf], Init::Weight),
                    t(n("ffn_down_shexp.weight"), vec![sf, h], Init::Weight),
                ]);
            }
        }
        return v;
    }
    if o.arch == Arch::Deepseek2 {
        // Queries of 128 + 64 rotary, the latent `head_dim` (512), values of 128.
        let (nope, rope, r, vd) = (128, 64, o.head_dim, 128);
        for i in 0..o.layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let (f, e) = (o.expert_ffn, o.experts);
            v.extend([
                t(n("attn_norm"), vec![h], Init::Norm),
                t(n("attn_q"), vec![h, o.heads * (nope + rope)], Init::Weight),
                t(n("attn_kv_a_mqa"), vec![h, r + rope], Init::Weight),
                t(n("attn_kv_a_norm"), vec![r], Init::Norm),
                t(n("attn_k_b"), vec![nope, r, o.heads], Init::Weight),
                t(n("attn_v_b"), vec![r, vd, o.heads], Init::Weight),
                t(n("attn_output"), vec![o.heads * vd, h], Init::Weight),
                t(n("ffn_norm"), vec![h], Init::Norm),
            ]);
            if i == 0 {
                v.extend([
                    t(n("ffn_gate"), vec![h, o.ffn], Init::Weight),
                    t(n("ffn_up"), vec![h, o.ffn], Init::Weight),
                    t(n("ffn_down"), vec![o.ffn, h], Init::Weight),
                ]);
            } else {
                v.extend([
                    t(n("ffn_gate_inp"), vec![h, e], Init::Weight),
                    t(n("ffn_gate_exps"), vec![h, f, e], Init::Weight),
                    t(n("ffn_up_exps"), vec![h, f, e], Init::Weight),
                    t(n("ffn_down_exps"), vec![f, h, e], Init::Weight),
                    t(n("ffn_gate_shexp"), vec![h, 2 * f], Init::Weight),
                    t(n("ffn_up_shexp"), vec![h, 2 * f], Init::Weight),
                    t(n("ffn_down_shexp"), vec![2 * f, h], Init::Weight),
                ]);
            }
        }
        return v;
    }
    if o.arch == Arch::Gemma4 {
        // Tied embeddings; every sixth layer global.
        v.retain(|s| s.name != "output.weight");
        v.push(t(
            "rope_freqs.weight".into(),
            vec![GEMMA4_GLOBAL_DIM / 2],
            Init::Norm,
        ));
        for i in 0..o.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let (d, kvh) = gemma4_shape(o, i);
            let (f, e, ef) = (o.ffn, o.experts, o.expert_ffn);
            v.extend([
                t(n("attn_norm.weight"), vec![h], Init::Norm),
                t(n("attn_q.weight"), vec![h, o.heads * d], Init::Weight),
                t(n("attn_k.weight"), vec![h, kvh * d], Init::Weight),
                t(n("attn_output.weight"), vec![o.heads * d, h], Init::Weight),
                t(n("attn_q_norm.weight"), vec![d], Init::Norm),
                t(n("attn_k_norm.weight"), vec![d], Init::Norm),
                t(n("post_attention_norm.weight"), vec![h], Init::Norm),
                t(n("layer_output_scale.weight"), vec![1], Init::Norm),
                t(n("ffn_norm.weight"), vec![h], Init::Norm),
                t(n("ffn_gate.weight"), vec![h, f], Init::Weight),
                t(n("ffn_up.weight"), vec![h, f], Init::Weight),
                t(n("ffn_down.weight"), vec![f, h], Init::Weight),
                t(n("post_ffw_norm.weight"), vec![h], Init::Norm),
                t(n("ffn_gate_inp.weight"), vec![h, e], Init::Weight),
                t(n("ffn_gate_inp.scale"), vec![h], Init::Norm),
                t(n("pre_ffw_norm_2.weight"), vec![h], Init::Norm),
                t(n("post_ffw_norm_1.weight"), vec![h], Init::Norm),
                t(n("post_ffw_norm_2.weight"), vec![h], Init::Norm),
                t(
                    n("ffn_gate_up_exps.weight"),
                    vec![h, 2 * ef, e],
                    Init::Weight,
                ),
                t(n("ffn_down_exps.weight"), vec![ef, h, e], Init::Weight),
                t(n("ffn_down_exps.scale"), vec![e], Init::Norm),
            ]);
            if gemma4_local(i) {
                v.push(t(n("attn_v.weight"), vec![h, kvh * d], Init::Weight));
            }
        }
        return v;
    }
    if o.arch == Arch::Glm4Moe {
        for i in 0..o.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let (f, e) = (o.expert_ffn, o.experts);
            v.extend([
                t(n("attn_norm.weight"), vec![h], Init::Norm),
                t(n("attn_q.weight"), vec![h, q], Init::Weight),
                t(n("attn_q.bias"), vec![q], Init::Weight),
                t(n("attn_k.weight"), vec![h, kv], Init::Weight),
                t(n("attn_k.bias"), vec![kv], Init::Weight),
                t(n("attn_v.weight"), vec![h, kv], Init::Weight),
                t(n("attn_v.bias"), vec![kv], Init::Weight),
                t(n("attn_output.weight"), vec![q, h], Init::Weight),
                t(n("post_attention_norm.weight"), vec![h], Init::Norm),
            ]);
            if i == 0 {
                v.extend([
                    t(n("ffn_gate.weight"), vec![h, o.ffn], Init::Weight),
                    t(n("ffn_up.weight"), vec![h, o.ffn], Init::Weight),
                    t(n("ffn_down.weight"), vec![o.ffn, h], Init::Weight),
                ]);
            } else {
                v.extend([
                    t(n("ffn_gate_inp.weight"), vec![h, e], Init::Weight),
                    t(n("exp_probs_b.bias"), vec![e], Init::Weight),
                    t(n("ffn_gate_exps.weight"), vec![h, f, e], Init::Weight),
                    t(n("ffn_up_exps.weight"), vec![h, f, e], Init::Weight),
                    t(n("ffn_down_exps.weight"), vec![f, h, e], Init::Weight),
                    t(n("ffn_gate_shexp.weight"), vec![h, f], Init::Weight),
                    t(n("ffn_up_shexp.weight"), vec![h, f], Init::Weight),
                    t(n("ffn_down_shexp.weight"), vec![f, h], Init::Weight),
                ]);
            }
        }
        return v;
    }
    if o.arch == Arch::GptOss {
        for i in 0..o.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let (f, e) = (o.expert_ffn, o.experts);
            v.extend([
                t(n("attn_norm.weight"), vec![h], Init::Norm),
                t(n("attn_q.weight"), vec![h, q], Init::Weight),
                t(n("attn_q.bias"), vec![q], Init::Weight),
                t(n("attn_k.weight"), vec![h, kv], Init::Weight),
                t(n("attn_k.bias"), vec![kv], Init::Weight),
                t(n("attn_v.weight"), vec![h, kv], Init::Weight),
                t(n("attn_v.bias"), vec![kv], Init::Weight),
                t(n("attn_output.weight"), vec![q, h], Init::Weight),
                t(n("attn_output.bias"), vec![h], Init::Weight),
                t(n("attn_sinks.weight"), vec![o.heads], Init::Weight),
                t(n("post_attention_norm.weight"), vec![h], Init::Norm),
                t(n("ffn_gate_inp.weight"), vec![h, e], Init::Weight),
                t(n("ffn_gate_inp.bias"), vec![e], Init::Weight),
                t(n("ffn_gate_exps.weight"), vec![h, f, e], Init::Weight),
                t(n("ffn_gate_exps.bias"), vec![f, e], Init::Weight),
                t(n("ffn_up_exps.weight"), vec![h, f, e], Init::Weight),
                t(n("ffn_up_exps.bias"), vec![f, e], Init::Weight),
                t(n("ffn_down_exps.weight"), vec![f, h, e], Init::Weight),
                t(n("ffn_down_exps.bias"), vec![h, e], Init::Weight),
            ]);
        }
        return v;
    }
    for i in 0..o.layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let (f, e) = (o.expert_ffn, o.experts);
        v.extend([
            t(n("attn_norm"), vec![h], Init::Norm),
            t(n("attn_q"), vec![h, q], Init::Weight),
            t(n("attn_k"), vec![h, kv], Init::Weight),
            t(n("attn_v"), vec![h, kv], Init::Weight),
            t(n("attn_output"), vec![q, h], Init::Weight),
            t(n("attn_q_norm"), vec![o.head_dim], Init::Norm),
            t(n("attn_k_norm"), vec![o.head_dim], Init::Norm),
            t(n("ffn_norm"), vec![h], Init::Norm),
            t(n("ffn_gate_inp"), vec![h, e], Init::Weight),
            t(n("ffn_gate_exps"), vec![h, f, e], Init::Weight),
            t(n("ffn_up_exps"), vec![h, f, e], Init::Weight),
            t(n("ffn_down_exps"), vec![f, h, e], Init::Weight),
        ]);
    }
    v
}

/// Gemma 4 26B-A4B's global layers: 2 KV heads of 512.
const GEMMA4_GLOBAL_DIM: usize = 512;
const GEMMA4_GLOBAL_KV: usize = 2;

/// Gemma 4's pattern: five local layers, then a global one.
fn gemma4_local(i: usize) -> bool {
    !(i + 1).is_multiple_of(6)
}

/// `(head size, KV heads)` of Gemma 4 layer `i`.
fn gemma4_shape(o: &Opts, i: usize) -> (usize, usize) {
    if gemma4_local(i) {
        (o.head_dim, o.kv_heads)
    } else {
        (GEMMA4_GLOBAL_DIM, GEMMA4_GLOBAL_KV)
    }
}

fn metadata(o: &Opts, vocab_file: &GgufFile) -> AnyResult<(Vec<(String, Value)>, usize)> {
    let arch = o.arch.name();
    let u = |n: usize| Value::U32(n as u32);
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(format!("synthetic-{arch}-{}L", o.layers)),
        ),
        (
            "general.file_type".into(),
            u(o.ftype.llama_ftype() as usize),
        ),
        ("general.quantization_version".into(), u(2)),
    ];
    // Context, dense FFN width, RoPE θ and norm ε of the original each shape comes from:
    // Qwen3-30B-A3B's layers (its dense FFN key unused), gpt-oss-20b (131072 by YaRN ×32 over
    // 4096), Llama-3.2-1B, Qwen3-4B.
    let (ctx, ffn, theta, eps) = match o.arch {
        Arch::Qwen3Moe => (4096, 6144, 1e6, 1e-6),
        Arch::GptOss => (131072, o.expert_ffn, 150000.0, 1e-5),
        Arch::Llama => (131072, o.ffn, 500000.0, 1e-5),
        Arch::Qwen3 => (40960, o.ffn, 1e6, 1e-6),
        Arch::Qwen35 => (262144, o.ffn, 1e7, 1e-6),
        Arch::Qwen35Moe => (262144, o.expert_ffn, 1e7, 1e-6),
        Arch::Deepseek2 => (163840, o.ffn, 10000.0, 1e-6),
        Arch::Gemma4 => (262144, o.ffn, 1e6, 1e-6),
        Arch::Glm4Moe => (131072, o.ffn, 1e6, 1e-5),
    };
    let mut hp = vec![
        ("block_count", u(o.layers)),
        ("context_length", u(ctx)),
        ("embedding_length", u(o.hidden)),
        ("feed_forward_length", u(ffn)),
        ("attention.head_count", u(o.heads)),
        ("attention.head_count_kv", u(o.kv_heads)),
        ("attention.key_length", u(o.head_dim)),
        ("attention.value_length", u(o.head_dim)),
        ("rope.freq_base", Value::F32(theta)),
        ("attention.layer_norm_rms_epsilon", Value::F32(eps)),
    ];
    if o.arch == Arch::Gemma4 {
        hp.retain(|(k, _)| {
            !k.starts_with("attention.key_length")
                && !k.starts_with("attention.value_length")
                && *k != "attention.head_count_kv"
        });
        let g = GEMMA4_GLOBAL_DIM;
        let per_layer = |f: &dyn Fn(usize) -> Value| Value::Array((0..o.layers).map(f).collect());
        hp.extend([
            (
                "attention.head_count_kv",
                per_layer(&|i| Value::I32(gemma4_shape(o, i).1 as i32)),
            ),
            (
                "attention.sliding_window_pattern",
                per_layer(&|i| Value::Bool(gemma4_local(i))),
            ),
            ("attention.key_length", u(g)),
            ("attention.value_length", u(g)),
            ("attention.key_length_swa", u(o.head_dim)),
            ("attention.value_length_swa", u(o.head_dim)),
            ("attention.sliding_window", u(1024)),
            ("attention.shared_kv_layers", u(0)),
            ("embedding_length_per_layer_input", u(0)),
            ("rope.dimension_count", u(g)),
            ("rope.dimension_count_swa", u(o.head_dim)),
            ("rope.freq_base_swa", Value::F32(10000.0)),
            ("final_logit_softcapping", Value::F32(30.0)),
            ("expert_count", u(o.experts)),
            ("expert_used_count", u(o.active)),
            ("expert_feed_forward_length", u(o.expert_ffn)),
        ]);
    } else if o.arch == Arch::Glm4Moe {
        hp.extend([
            ("rope.dimension_count", u(o.head_dim / 2)),
            ("expert_count", u(o.experts)),
            ("expert_used_count", u(o.active)),
            ("expert_feed_forward_length", u(o.expert_ffn)),
            ("expert_shared_count", u(1)),
            ("leading_dense_block_count", u(1)),
            ("expert_weights_scale", Value::F32(1.0)),
            ("expert_gating_func", u(2)),
            ("nextn_predict_layers", u(0)),
        ]);
        hp.push(("expert_weights_norm", Value::Bool(true)));
    } else if o.arch == Arch::Deepseek2 {
        // llama.cpp's MLA form: the cache row (latent + rotary key) as the key length, the
        // latent as the value length, the heads' own sizes as the `_mla` lengths.
        hp.retain(|(k, _)| {
            !k.starts_with("attention.key_length") && !k.starts_with("attention.value_length")
        });
        hp.extend([
            ("attention.key_length", u(o.head_dim + 64)),
            ("attention.value_length", u(o.head_dim)),
            ("attention.key_length_mla", u(128 + 64)),
            ("attention.value_length_mla", u(128)),
            ("attention.kv_lora_rank", u(o.head_dim)),
            ("attention.q_lora_rank", u(0)),
            ("rope.dimension_count", u(64)),
            ("expert_count", u(o.experts)),
            ("expert_used_count", u(o.active)),
            ("expert_feed_forward_length", u(o.expert_ffn)),
            ("expert_shared_count", u(2)),
            ("leading_dense_block_count", u(1)),
            ("expert_weights_scale", Value::F32(1.0)),
            ("expert_gating_func", u(1)),
        ]);
        hp.push(("expert_weights_norm", Value::Bool(false)));
    } else if o.arch.hybrid() {
        hp.extend([
            ("rope.dimension_count", u(o.head_dim / 4)),
            (
                "rope.dimension_sections",
                Value::Array(vec![
                    Value::I32(11),
                    Value::I32(11),
                    Value::I32(10),
                    Value::I32(0),
                ]),
            ),
            ("ssm.conv_kernel", u(4)),
            ("ssm.state_size", u(128)),
            ("ssm.group_count", u(16)),
            ("ssm.time_step_rank", u(32)),
            ("ssm.inner_size", u(32 * 128)),
            ("full_attention_interval", u(4)),
        ]);
        if o.arch == Arch::Qwen35Moe {
            hp.extend([
                ("expert_count", u(o.experts)),
                ("expert_used_count", u(o.active)),
                ("expert_feed_forward_length", u(o.expert_ffn)),
                ("expert_shared_feed_forward_length", u(o.ffn)),
            ]);
        }
    } else if o.arch.dense() {
        hp.push(("rope.dimension_count", u(o.head_dim)));
    } else {
        hp.extend([
            ("expert_count", u(o.experts)),
            ("expert_used_count", u(o.active)),
            ("expert_feed_forward_length", u(o.expert_ffn)),
        ]);
    }
    if o.arch == Arch::GptOss {
        // A 128-token window on the even layers.
        hp.extend([
            ("attention.sliding_window", u(128)),
            ("rope.scaling.type", Value::String("yarn".into())),
            ("rope.scaling.factor", Value::F32(32.0)),
            ("rope.scaling.original_context_length", u(4096)),
        ]);
    }
    md.extend(hp.into_iter().map(|(k, v)| (format!("{arch}.{k}"), v)));
    for k in vocab_file
        .keys
        .iter()
        .filter(|k| k.starts_with("tokenizer."))
    {
        if let Some(v) = vocab_file.get(k) {
            md.push((k.clone(), v.into_owned()));
        }
    }
    let vocab = vocab_file
        .get_str_array("tokenizer.ggml.tokens")
        .map(|t| t.len())
        .ok_or_else(|| {
            format!(
                "{}: no tokenizer.ggml.tokens array",
                vocab_file.path.display()
            )
        })?;
    Ok((md, vocab))
}

/// The generator of one group of rows: seeded from the seed, the tensor name and the group.
fn group_rng(seed: u64, name: &str, group: usize) -> rand::rngs::StdRng {
    // FNV-1a of the name and group index, started from the seed.
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes().chain((group as u64).to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    rand::rngs::StdRng::seed_from_u64(h)
}

/// Fills `x` with normal values (Box–Muller) of the given mean and standard deviation.
fn fill_normal(rng: &mut impl Rng, x: &mut [f32], mean: f32, std: f32) {
    for pair in x.chunks_mut(2) {
        let u1: f32 = rng.gen_range(f32::MIN_POSITIVE..1.0);
        let u2: f32 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        pair[0] = mean + r * c;
        if let Some(p) = pair.get_mut(1) {
            *p = mean + r * s;
        }
    }
}

/// Rows per slab: about 8 Mi values (32 MiB of f32) per slab.
const SLAB_VALUES: usize = 8 << 20;
/// Rows drawn from one generator.
const GROUP: usize = 64;

fn write_tensor(
    w: &mut GgufWriter,
    spec: &Spec,
    dtype: DType,
    seed: u64,
    threads: usize,
) -> AnyResult<()> {
    let row_len = spec.dims[0];
    let n_rows: usize = spec.dims[1..].iter().product();
    let row_bytes = dtype.bytes_for(row_len).ok_or_else(|| {
        format!(
            "{}: rows of {row_len} are not whole {dtype} blocks",
            spec.name
        )
    })?;
    // Values are drawn in groups of 64 rows (one generator per group), and slabs and worker
    // parts start on group boundaries, so neither the slab size nor the thread count changes
    // the weights.
    let rows_per_slab = (SLAB_VALUES / row_len / GROUP * GROUP)
        .max(GROUP)
        .min(n_rows);
    let (mean, std) = match spec.init {
        Init::Weight => (0.0, 0.02),
        Init::Norm => (1.0, 0.02),
        Init::Decay => (-1.0, 0.02),
    };
    let mut f = vec![0f32; rows_per_slab * row_len];
    let mut q = vec![0u8; rows_per_slab * row_bytes];
    for r0 in (0..n_rows).step_by(rows_per_slab) {
        let rows = rows_per_slab.min(n_rows - r0);
        let f = &mut f[..rows * row_len];
        let q = &mut q[..rows * row_bytes];
        let per = rows.div_ceil(threads.max(1)).next_multiple_of(GROUP);
        let results: Vec<ferrum_core::Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = f
                .chunks_mut(per * row_len)
                .zip(q.chunks_mut(per * row_bytes))
                .enumerate()
                .map(|(part, (fp, qp))| {
                    s.spawn(move || {
                        for (g, fg) in fp.chunks_mut(GROUP * row_len).enumerate() {
                            let group = (r0 + part * per) / GROUP + g;
                            let mut rng = group_rng(seed, &spec.name, group);
                            fill_normal(&mut rng, fg, mean, std);
                        }
                        for (x, o) in fp.chunks_exact(row_len).zip(qp.chunks_exact_mut(row_bytes)) {
                            quantize_row(dtype, x, o)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            r?;
        }
        w.write(q)?;
    }
    Ok(())
}

fn main() -> AnyResult<()> {
    let o = parse_args()?;
    let started = Instant::now();
    let vocab_file = GgufFile::open(&o.vocab_from)
        .map_err(|e| format!("vocabulary {}: {e}", o.vocab_from.display()))?;
    let (md, vocab) = metadata(&o, &vocab_file)?;
    let specs = specs(&o, vocab);

    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| recipe::llama_order(names[a], names[b]));
    let inputs: Vec<PlanInput> = order
        .iter()
        .map(|&i| PlanInput {
            name: &specs[i].name,
            dims: &specs[i].dims,
        })
        .collect();
    let model = ModelInfo {
        arch: o.arch.name(),
        n_layer: o.layers,
        n_gqa: o.heads / o.kv_heads,
    };
    let planned = recipe::plan(o.ftype, &model, &inputs);
    let mut dtypes = vec![DType::F32; specs.len()];
    for (&i, p) in order.iter().zip(planned) {
        dtypes[i] = p.unwrap_or(DType::F32);
    }

    let decls: Vec<TensorDecl> = specs
        .iter()
        .zip(&dtypes)
        .map(|(s, &dtype)| TensorDecl {
            name: s.name.clone(),
            dims: s.dims.clone(),
            dtype,
        })
        .collect();
    let partial = o.out.with_extension("gguf.partial");
    let mut w = GgufWriter::create(&partial, &md, decls)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (s, &dtype) in specs.iter().zip(&dtypes) {
        let t = Instant::now();
        write_tensor(&mut w, s, dtype, o.seed, threads)?;
        if s.dims.len() > 1 {
            eprintln!(
                "{:<28} {:>16} {:<6} {:6.1} s",
                s.name,
                format!("{:?}", s.dims),
                dtype.to_string(),
                t.elapsed().as_secs_f64()
            );
        }
    }
    let size = w.finish()?;
    std::fs::rename(&partial, &o.out)?;
    let params: usize = specs.iter().map(|s| s.dims.iter().product::<usize>()).sum();
    eprintln!(
        "wrote {}: {} ({} tensors, {:.2} G parameters, {:.2} GB, vocab {vocab}) in {:.0} s",
        o.out.display(),
        o.ftype,
        specs.len(),
        params as f64 / 1e9,
        size as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
