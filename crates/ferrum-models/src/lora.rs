//! LoRA adapters, kept apart from the base weights: each adapted projection `W` of a layer
//! gets `y += s · B (A x)` on the rows of the sequences that asked for the adapter, so one
//! batch mixes the base model and any number of adapters (punica's and S-LoRA's segmented
//! product: one pair of small matmuls per run of consecutive rows with the same adapter).
//!
//! Read from a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`: `lora_A`
//! `[r, in]`, `lora_B` `[out, r]`, scaled by `lora_alpha / r`, or `/ √r` with `use_rslora`,
//! per-module `rank_pattern`/`alpha_pattern` included) or from llama.cpp's GGUF LoRA
//! (`convert_lora_to_gguf.py`: `blk.N.<tensor>.weight.lora_a`/`.lora_b`, scaled by
//! `adapter.lora.alpha / r`, as llama.cpp applies it). Both factors are kept in f32 with
//! the scale folded into `B`, so the default and the exact backends compute the update alike.

use std::path::Path;

use ferrum_backend::{Backend, Rows};
use ferrum_core::{Error, Result};
use ferrum_loader::{GgufFile, RawTensor, TensorStore};

use crate::arch::Arch;
use crate::config::ModelConfig;
use crate::layers::WeightSource;

/// The projections an adapter may change, by the Hugging Face module name under
/// `model.layers.{i}.` (fused ones as Phi-3 has them).
const MODULES: [(&str, Target); 9] = [
    ("self_attn.q_proj", Target::Q),
    ("self_attn.k_proj", Target::K),
    ("self_attn.v_proj", Target::V),
    ("self_attn.o_proj", Target::O),
    ("self_attn.qkv_proj", Target::Qkv),
    ("mlp.gate_proj", Target::Gate),
    ("mlp.up_proj", Target::Up),
    ("mlp.down_proj", Target::Down),
    ("mlp.gate_up_proj", Target::GateUp),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Qkv,
    Gate,
    Up,
    Down,
    GateUp,
}

/// One projection's update, on the host: `A` (`[rank, in]`, for [`Backend::low_rank_shrink`])
/// and `(s · B)ᵀ` (`[rank, out]` in column stretches: [`Backend::add_low_rank`] adds its rows
/// to the output scaled by `A x`, where a matmul by `B` would make each output a dot product
/// of only `rank` terms). Small enough (a rank-16 update of a 2048-wide projection is 256 KB)
/// that the backends' own copies would buy nothing on the CPU.
pub struct Delta {
    pub a: Vec<f32>,
    pub bt: Vec<f32>,
    pub rank: usize,
    pub out: usize,
}

/// A layer's updates, where the adapter has them.
pub struct LoraLayer {
    deltas: Vec<(Target, Delta)>,
}

impl LoraLayer {
    pub fn get(&self, t: Target) -> Option<&Delta> {
        self.deltas.iter().find(|(x, _)| *x == t).map(|(_, d)| d)
    }

    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty()
    }

    pub fn targets(&self) -> impl Iterator<Item = Target> + '_ {
        self.deltas.iter().map(|(t, _)| *t)
    }

    pub fn has_any(&self, ts: &[Target]) -> bool {
        ts.iter().any(|&t| self.get(t).is_some())
    }
}

/// A loaded adapter: its updates per layer, ready for the decoder.
pub struct Adapter {
    pub name: String,
    /// The largest rank of its updates.
    pub rank: usize,
    pub layers: Vec<LoraLayer>,
    /// f32 bytes of its factors.
    pub bytes: usize,
    /// Where its sequences' prefix-cache chains start: distinct for every adapter loaded,
    /// so an adapter's keys and values are never served to another or to the base model.
    pub salt: u64,
}

/// Counts adapters loaded in this process (the salts' source).
static LOADED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Where an adapter comes from and how strongly it applies.
#[derive(Debug, Clone)]
pub struct AdapterSource<'a> {
    pub path: &'a Path,
    /// Multiplies the file's own scale (llama.cpp's `--lora-scaled`); 1 by default.
    pub scale: f32,
}

/// The factors as read from the file, before they meet a backend.
struct Factors {
    layer: usize,
    target: Target,
    a: Vec<f32>,
    b: Vec<f32>,
    rank: usize,
    input: usize,
    out: usize,
    scale: f32,
}

impl Factors {
    /// `A` (`[rank, in]`) and `B` (`[out, rank]`) of one update, scaled by what `scale`
    /// makes of the rank.
    fn read(
        layer: usize,
        target: Target,
        a: &RawTensor,
        b: &RawTensor,
        scale: impl FnOnce(usize) -> Result<f64>,
    ) -> Result<Factors> {
        let ((rank, input), (out, rank_b)) = (matrix(a)?, matrix(b)?);
        if rank_b != rank || rank == 0 {
            return Err(Error::Weights(format!(
                "{:?} has rank {rank}, {:?} {rank_b}",
                a.name, b.name
            )));
        }
        Ok(Factors {
            layer,
            target,
            scale: scale(rank)? as f32,
            a: f32_of(a)?,
            b: f32_of(b)?,
            rank,
            input,
            out,
        })
    }
}

impl Adapter {
    /// Reads the adapter at `src.path` (a PEFT folder, its `adapter_model.safetensors`, or a
    /// GGUF LoRA) for a base model of configuration `c` (`base_gguf`: whether the base is a
    /// GGUF, whose Llama query and key rows are permuted for the interleaved rotation).
    pub fn load(
        name: &str,
        src: &AdapterSource,
        c: &ModelConfig,
        base_gguf: bool,
    ) -> Result<Adapter> {
        let path = src.path;
        let is_gguf = path.is_file()
            && path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let (mut factors, adapter_gguf) = if is_gguf {
            (read_gguf(path, c)?, true)
        } else {
            (read_peft(path, c)?, false)
        };
        if factors.is_empty() {
            return Err(Error::Weights(format!(
                "{}: no LoRA tensors for this model's layers",
                path.display()
            )));
        }
        // Llama-family GGUFs hold their query and key rows permuted for the interleaved
        // rotation (llama.cpp's converter does it to the adapter's `B` as well): an adapter
        // from the other kind of file is permuted to match the base.
        let permuted = matches!(
            c.arch,
            Arch::Llama | Arch::Mistral3 | Arch::SmolLm3 | Arch::Granite
        );
        if adapter_gguf != base_gguf && permuted {
            for f in &mut factors {
                let heads = match f.target {
                    Target::Q => c.n_heads,
                    Target::K => c.n_kv_heads,
                    _ => continue,
                };
                f.b = crate::names::permute_rope_rows(&f.b, f.rank, heads, f.out, base_gguf);
            }
        }
        let mut layers: Vec<LoraLayer> = (0..c.n_layers)
            .map(|_| LoraLayer { deltas: Vec::new() })
            .collect();
        let (mut rank, mut bytes) = (0, 0);
        for f in factors {
            let (out, input) = expected_shape(c, f.layer, f.target);
            if (f.out, f.input) != (out, input) {
                return Err(Error::Weights(format!(
                    "{}: the update of layer {} {:?} is {}×{}, the model's projection {out}×{input}",
                    path.display(),
                    f.layer,
                    f.target,
                    f.out,
                    f.input
                )));
            }
            let s = f.scale * src.scale;
            let mut bt = vec![0f32; f.b.len()];
            for (o, row) in f.b.chunks_exact(f.rank).enumerate() {
                for (j, v) in row.iter().enumerate() {
                    bt[j * out + o] = v * s;
                }
            }
            let bt = ferrum_backend::host_ops::low_rank_stretches(&bt, f.rank, out);
            let delta = Delta {
                a: f.a,
                bt,
                rank: f.rank,
                out,
            };
            rank = rank.max(f.rank);
            bytes += 4 * f.rank * (input + out);
            let l = &mut layers[f.layer];
            if l.get(f.target).is_some() {
                return Err(Error::Weights(format!(
                    "{}: two updates for layer {} {:?}",
                    path.display(),
                    f.layer,
                    f.target
                )));
            }
            l.deltas.push((f.target, delta));
        }
        Ok(Adapter {
            name: name.to_string(),
            rank,
            layers,
            bytes,
            salt: {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                (
                    "lora",
                    name,
                    LOADED.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                )
                    .hash(&mut h);
                h.finish().max(1)
            },
        })
    }
}

/// `(out, in)` of a layer's projection.
fn expected_shape(c: &ModelConfig, i: usize, t: Target) -> (usize, usize) {
    let (h, q, kv, f) = (
        c.hidden_size,
        c.layer_q_dim(i),
        c.layer_kv_dim(i),
        c.layer_ffn(i),
    );
    match t {
        Target::Q => (q, h),
        Target::K | Target::V => (kv, h),
        Target::O => (h, q),
        Target::Qkv => (q + 2 * kv, h),
        Target::Gate | Target::Up => (f, h),
        Target::Down => (h, f),
        Target::GateUp => (2 * f, h),
    }
}

fn f32_of(t: &RawTensor) -> Result<Vec<f32>> {
    let mut v = vec![0f32; t.numel()];
    if !ferrum_backend::cpu::quant::dequantize(t.dtype, t.bytes(), &mut v) {
        return Err(Error::Weights(format!(
            "LoRA tensor {:?}: {:?} is not a float format",
            t.name, t.dtype
        )));
    }
    Ok(v)
}

fn matrix(t: &RawTensor) -> Result<(usize, usize)> {
    match t.shape.as_slice() {
        [r, c] => Ok((*r, *c)),
        s => Err(Error::Weights(format!(
            "LoRA tensor {:?} has shape {s:?}, expected a matrix",
            t.name
        ))),
    }
}

/// The PEFT folder's (or file's) factors with their scales.
fn read_peft(path: &Path, c: &ModelConfig) -> Result<Vec<Factors>> {
    let (dir, weights) = if path.is_dir() {
        (path.to_path_buf(), path.join("adapter_model.safetensors"))
    } else {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        (dir, path.to_path_buf())
    };
    let cfg_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let cfg: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(&cfg_path, format!("invalid JSON: {e}")))?;
    let bad = |what: String| Error::Unsupported(format!("{}: {what}", cfg_path.display()));
    if let Some(t) = cfg.get("peft_type").and_then(|v| v.as_str()) {
        if t != "LORA" {
            return Err(bad(format!(
                "peft_type {t:?} (only LORA adapters are served)"
            )));
        }
    }
    for (key, what) in [
        ("use_dora", "DoRA"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"),
        ("lora_bias", "LoRA biases"),
    ] {
        if cfg.get(key).and_then(|v| v.as_bool()) == Some(true) {
            return Err(bad(format!("{what} is not supported")));
        }
    }
    if let Some(b) = cfg.get("bias").and_then(|v| v.as_str()) {
        if b != "none" {
            return Err(bad(format!("bias {b:?}: trained biases are not supported")));
        }
    }
    if cfg
        .get("modules_to_save")
        .and_then(|v| v.as_array())
        .is_some_and(|a| !a.is_empty())
    {
        return Err(bad(
            "modules_to_save (whole replaced modules) is not supported".into(),
        ));
    }
    let r = cfg.get("r").and_then(|v| v.as_f64()).unwrap_or(8.0);
    let alpha = cfg
        .get("lora_alpha")
        .and_then(|v| v.as_f64())
        .unwrap_or(8.0);
    let rslora = cfg.get("use_rslora").and_then(|v| v.as_bool()) == Some(true);
    let pattern = |key: &str, module: &str| -> Option<f64> {
        let map = cfg.get(key)?.as_object()?;
        map.iter()
            .find(|(k, _)| module == k.as_str() || module.ends_with(&format!(".{k}")))
            .and_then(|(_, v)| v.as_f64())
    };
    let mut store = TensorStore::default();
    ferrum_loader::hf::load_safetensors(&weights, &mut store, true)?;
    let mut out = Vec::new();
    let mut names: Vec<&String> = store.tensors.keys().collect();
    names.sort();
    for name in names {
        let Some(module) = name.strip_suffix(".lora_A.weight") else {
            if !name.ends_with(".lora_B.weight") {
                return Err(bad(format!("tensor {name:?} is not a LoRA factor")));
            }
            continue;
        };
        let Some((layer, target)) = peft_module(module) else {
            return Err(bad(format!(
                "module {module:?}: only the attention and dense MLP projections of the \
                 decoder layers can be adapted"
            )));
        };
        if layer >= c.n_layers {
            return Err(bad(format!(
                "module {module:?}: the model has {} layers",
                c.n_layers
            )));
        }
        let a_t = store
            .get(name)
            .ok_or_else(|| bad(format!("{name:?} missing")))?;
        let b_name = format!("{module}.lora_B.weight");
        let b_t = store
            .get(&b_name)
            .ok_or_else(|| bad(format!("{b_name:?} missing")))?;
        let short = module.split_once(".model.").map_or(module, |(_, m)| m);
        out.push(Factors::read(layer, target, a_t, b_t, |rank| {
            let rank_f = pattern("rank_pattern", short).unwrap_or(r);
            if rank_f as usize != rank {
                return Err(bad(format!(
                    "{module}: rank {rank} in the file, {rank_f} in the config"
                )));
            }
            let alpha = pattern("alpha_pattern", short).unwrap_or(alpha);
            Ok(if rslora {
                alpha / rank_f.sqrt()
            } else {
                alpha / rank_f
            })
        })?);
    }
    Ok(out)
}

/// `(layer, target)` of a PEFT module name (`base_model.model.model.layers.3.mlp.up_proj`;
/// multimodal checkpoints keep the language model under a prefix of its own).
fn peft_module(module: &str) -> Option<(usize, Target)> {
    let (_, rest) = module.rsplit_once("layers.")?;
    let (i, tail) = rest.split_once('.')?;
    let layer = i.parse().ok()?;
    MODULES
        .iter()
        .find(|(m, _)| *m == tail)
        .map(|&(_, t)| (layer, t))
}

/// A llama.cpp LoRA GGUF's factors with llama.cpp's scale.
fn read_gguf(path: &Path, c: &ModelConfig) -> Result<Vec<Factors>> {
    let g = GgufFile::open(path)?;
    let bad = |what: String| Error::Unsupported(format!("{}: {what}", path.display()));
    if g.get_str("general.type").is_some_and(|t| t != "adapter")
        || g.get_str("adapter.type").is_some_and(|t| t != "lora")
    {
        return Err(bad(
            "not a LoRA adapter (general.type / adapter.type)".into()
        ));
    }
    let arch = g.architecture()?;
    let info = c.arch.info();
    if arch != info.name && !info.gguf_aliases.contains(&arch) {
        return Err(bad(format!(
            "an adapter for {arch:?}, the model is {}",
            c.arch.name()
        )));
    }
    let alpha = g.get_f64("adapter.lora.alpha").unwrap_or(0.0);
    let store = g.tensors();
    let src = WeightSource {
        store: &store,
        gguf: true,
        names: c.arch.info().names,
    };
    let mut out = Vec::new();
    let mut used = 0;
    for i in 0..c.n_layers {
        for (module, target) in MODULES {
            let base = src.name(&format!("model.layers.{{i}}.{module}.weight"), i);
            let (Some(a_t), Some(b_t)) = (
                store.get(&format!("{base}.lora_a")),
                store.get(&format!("{base}.lora_b")),
            ) else {
                continue;
            };
            used += 2;
            // llama.cpp: a zero alpha means the factors apply as they are.
            out.push(Factors::read(i, target, a_t, b_t, |rank| {
                Ok(if alpha == 0.0 {
                    1.0
                } else {
                    alpha / rank as f64
                })
            })?);
        }
    }
    if used != store.tensors.len() {
        let mut other: Vec<&String> = store
            .tensors
            .keys()
            .filter(|n| !is_used(n, c, &src))
            .collect();
        other.sort();
        return Err(bad(format!(
            "tensors this model cannot take: {}",
            other
                .iter()
                .take(4)
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(out)
}

fn is_used(name: &str, c: &ModelConfig, src: &WeightSource) -> bool {
    (0..c.n_layers).any(|i| {
        MODULES.iter().any(|(m, _)| {
            let base = src.name(&format!("model.layers.{{i}}.{m}.weight"), i);
            name == format!("{base}.lora_a") || name == format!("{base}.lora_b")
        })
    })
}

/// Scratch for the updates of one pass: `A x` (`[rows, rank]`).
pub struct LoraBufs<B: Backend> {
    pub low: B::Buf,
    pub rank: usize,
}

/// Rows `first..first + count` of a pass that use one adapter's layer.
pub struct Run<'a> {
    pub first: usize,
    pub count: usize,
    pub layer: &'a LoraLayer,
}

/// A layer's runs of the pass, with the scratch they share.
pub struct LayerLora<'a, B: Backend> {
    pub runs: Vec<Run<'a>>,
    pub bufs: &'a mut LoraBufs<B>,
}

impl<B: Backend> LayerLora<'_, B> {
    /// `out[ov] += s · B (A x[xv])` for each run whose adapter updates `t` (`xv` and `ov`
    /// are the pass's whole views; each run takes its rows).
    pub fn apply(&mut self, be: &B, t: Target, x: &B::Buf, xv: Rows, out: &mut B::Buf, ov: Rows) {
        for r in &self.runs {
            let Some(d) = r.layer.get(t) else {
                continue;
            };
            let low = Rows::dense(r.count, d.rank);
            be.low_rank_shrink(x, xv.slice(r.first, r.count), &d.a, &mut self.bufs.low, low);
            be.add_low_rank(&self.bufs.low, low, &d.bt, out, ov.slice(r.first, r.count));
        }
    }

    pub fn touches(&self, ts: &[Target]) -> bool {
        self.runs.iter().any(|r| r.layer.has_any(ts))
    }
}
