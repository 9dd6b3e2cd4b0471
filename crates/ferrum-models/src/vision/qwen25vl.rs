//! Qwen2.5-VL's vision: a ViT over the image's patches at their own resolution (the
//! processor's grid), each patch a `temporal × patch × patch` cube embedded by a matmul, with
//! 2D rotary positions (half of each head's pairs rotate by the patch's row, half by its
//! column), RMSNorm blocks with SwiGLU MLPs, attention within windows of
//! `window_size / patch / merge` merged units a side except in the `fullatt_block_indexes`
//! blocks, and the merger: RMSNorm, every 2×2 patches as one row, an MLP with GELU to the
//! language model's width. Each image's rows sit between `<|vision_start|>` and
//! `<|vision_end|>`, attend causally, and take M-RoPE positions in the language model.

use ferrum_backend::{Activation, Backend, Rows};
use ferrum_core::{Error, Result};
use ferrum_image::Processed;
use ferrum_loader::{GgufFile, RawTensor, TensorStore};
use serde_json::Value as Json;

use super::{
    find, host_f32, matrix, qwen_tokens, qwen_tokens_gguf, usize_at, weight_from, BlockRun,
    ImageTokens, RmsBlock, SpanCache, TowerActs,
};

/// llama.cpp's window when its mmproj records none (Qwen2.5-VL's `window_size`).
const GGUF_WINDOW: usize = 112;

struct Block<B: Backend> {
    /// Every weight with its bias.
    rms: RmsBlock<B>,
    /// Attends over the whole image rather than its windows.
    full: bool,
}

pub struct Qwen25Vision<B: Backend> {
    hidden: usize,
    heads: usize,
    intermediate: usize,
    /// Merged units a window's side.
    window: usize,
    merge: usize,
    /// Values a patch: `3 · temporal · patch²`.
    patch_dim: usize,
    pub(super) text_hidden: usize,
    patch_embed: B::Weight,
    blocks: Vec<Block<B>>,
    ln_q: B::Weight,
    fc1: (B::Weight, B::Weight),
    fc2: (B::Weight, B::Weight),
    /// The axial rotary frequencies, twice over (rows, then columns): one per rotated pair.
    inv_freq: Vec<f32>,
    pair_axis: Vec<u8>,
}

/// The tower's sizes.
pub(super) struct Dims {
    hidden: usize,
    heads: usize,
    intermediate: usize,
    layers: usize,
    patch: usize,
    temporal: usize,
    pub(super) merge: usize,
    window_size: usize,
    full: Vec<usize>,
    theta: f32,
    pub(super) text_hidden: usize,
}

impl Dims {
    pub(super) fn from_hf(config: &Json) -> Result<Dims> {
        let v = &config["vision_config"];
        match v.get("hidden_act").and_then(Json::as_str) {
            None | Some("silu") => {}
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "config.json: Qwen2.5-VL vision activation {other:?}"
                )))
            }
        }
        let text_hidden = v
            .get("out_hidden_size")
            .and_then(Json::as_u64)
            .ok_or_else(|| Error::Weights("config.json: vision out_hidden_size".into()))?
            as usize;
        Ok(Dims {
            hidden: usize_at(v, "hidden_size")?,
            heads: usize_at(v, "num_heads")?,
            intermediate: usize_at(v, "intermediate_size")?,
            layers: usize_at(v, "depth")?,
            patch: usize_at(v, "patch_size")?,
            temporal: v
                .get("temporal_patch_size")
                .and_then(Json::as_u64)
                .unwrap_or(2) as usize,
            merge: v
                .get("spatial_merge_size")
                .and_then(Json::as_u64)
                .unwrap_or(2) as usize,
            window_size: usize_at(v, "window_size")?,
            full: v
                .get("fullatt_block_indexes")
                .and_then(Json::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Json::as_u64)
                        .map(|x| x as usize)
                        .collect()
                })
                .unwrap_or_default(),
            theta: v
                .get("rope_parameters")
                .and_then(|r| r.get("rope_theta"))
                .and_then(Json::as_f64)
                .unwrap_or(10_000.0) as f32,
            text_hidden,
        })
    }

    /// The bytes one image of `patches` patches allocates in the tower (all f32): the
    /// patches twice (host, backend), the residual stream and its companions, QKV, the MLP's
    /// gate and up and product, the scratch keys and values, then the merger's rows.
    pub(super) fn activation_bytes(&self, patches: usize) -> u64 {
        let (h, f) = (self.hidden, self.intermediate);
        let pd = 3 * self.temporal * self.patch * self.patch;
        let per_patch = 2 * pd + 3 * h + 3 * h + h + 3 * f + 2 * h;
        let units = patches / (self.merge * self.merge).max(1);
        let m = h * self.merge * self.merge;
        4 * (patches * per_patch + units * (2 * m + self.text_hidden)) as u64
    }
}

impl Dims {
    /// From llama.cpp's mmproj keys (projector `qwen2.5vl_merger`): full attention in every
    /// `n_wa_pattern`-th block, windows of `window_size` pixels (112 when not recorded).
    pub(super) fn from_gguf(mm: &GgufFile, text_hidden: usize) -> Result<Dims> {
        let key = |k: &str| mm.require_usize(&format!("clip.vision.{k}"));
        let opt = |k: &str| mm.get_u64(&format!("clip.vision.{k}")).map(|v| v as usize);
        let layers = key("block_count")?;
        let pattern = opt("n_wa_pattern").unwrap_or(0);
        Ok(Dims {
            hidden: key("embedding_length")?,
            heads: key("attention.head_count")?,
            intermediate: key("feed_forward_length")?,
            layers,
            patch: key("patch_size")?,
            temporal: 2,
            merge: opt("spatial_merge_size").unwrap_or(2),
            window_size: opt("window_size").unwrap_or(GGUF_WINDOW),
            full: (0..layers)
                .filter(|i| pattern == 0 || (i + 1) % pattern == 0)
                .collect(),
            theta: 10_000.0,
            text_hidden,
        })
    }
}

/// llama.cpp's mmproj name of a tensor named as in transformers' Qwen2.5-VL (below
/// `visual.`); the fused QKV and the 3D patch kernel are read in parts (see `build`).
fn gguf_name(rest: &str) -> String {
    if let Some(r) = rest.strip_prefix("blocks.") {
        let (i, tail) = r.split_once('.').unwrap_or((r, ""));
        let (part, what) = tail.rsplit_once('.').unwrap_or((tail, ""));
        let part = match part {
            "norm1" => "ln1",
            "norm2" => "ln2",
            "attn.proj" => "attn_out",
            "mlp.gate_proj" => "ffn_gate",
            "mlp.up_proj" => "ffn_up",
            "mlp.down_proj" => "ffn_down",
            other => other,
        };
        return format!("v.blk.{i}.{part}.{what}");
    }
    match rest {
        "merger.ln_q.weight" => "v.post_ln.weight".into(),
        "merger.mlp.0.weight" => "mm.0.weight".into(),
        "merger.mlp.0.bias" => "mm.0.bias".into(),
        "merger.mlp.2.weight" => "mm.2.weight".into(),
        "merger.mlp.2.bias" => "mm.2.bias".into(),
        other => other.into(),
    }
}

impl<B: Backend> Qwen25Vision<B> {
    /// From llama.cpp's `mmproj` GGUF (projector `qwen2.5vl_merger`), for a language model
    /// of `text_hidden` whose vocabulary gives the image tokens.
    pub fn load_gguf(
        mm: &GgufFile,
        text_hidden: usize,
        vocab: &[&str],
        be: &B,
    ) -> Result<(Self, ImageTokens)> {
        let dims = Dims::from_gguf(mm, text_hidden)?;
        let tokens = qwen_tokens_gguf(vocab)?;
        Ok((Self::build(dims, &mm.tensors(), be, true)?, tokens))
    }

    /// From a Hugging Face checkpoint (its config.json and tensors).
    pub fn load(config: &Json, store: &TensorStore, be: &B) -> Result<(Self, ImageTokens)> {
        let dims = Dims::from_hf(config)?;
        let tokens = qwen_tokens(config)?;
        Ok((Self::build(dims, store, be, false)?, tokens))
    }

    fn build(d: Dims, store: &TensorStore, be: &B, gguf: bool) -> Result<Self> {
        let Dims {
            hidden,
            heads,
            intermediate,
            layers,
            patch,
            temporal,
            merge,
            window_size,
            full,
            theta,
            text_hidden,
        } = d;
        let hd = hidden / heads.max(1);
        let window = window_size / patch.max(1) / merge.max(1);
        if heads == 0 || hidden % heads != 0 || hd % 4 != 0 || merge == 0 || window == 0 {
            return Err(Error::Weights(format!(
                "vision tower: {hidden} is not {heads} heads of a multiple of 4, or a window \
                 of {window_size} pixels holds no {merge}x{merge} unit of {patch}-pixel patches"
            )));
        }
        let names = |rest: &str| -> Vec<String> {
            if gguf {
                return vec![gguf_name(rest)];
            }
            ["visual.", "model.visual."]
                .iter()
                .map(|p| format!("{p}{rest}"))
                .collect()
        };
        let get = |rest: &str, rows: usize, cols: usize| -> Result<B::Weight> {
            matrix(be, find(store, &names(rest))?, rows, cols)
        };
        let vector = |rest: &str, len: usize| -> Result<B::Weight> {
            let v = host_f32(find(store, &names(rest))?, len)?;
            weight_from(be, rest, vec![len], &v)
        };
        let linear = |pre: &str, rows: usize, cols: usize| -> Result<(B::Weight, B::Weight)> {
            Ok((
                get(&format!("{pre}.weight"), rows, cols)?,
                get(&format!("{pre}.bias"), 1, rows)?,
            ))
        };
        let qkv = |i: usize| -> Result<[(B::Weight, B::Weight); 3]> {
            if gguf {
                let part = |x: &str| {
                    let w = matrix(
                        be,
                        find(store, &[format!("v.blk.{i}.attn_{x}.weight")])?,
                        hidden,
                        hidden,
                    )?;
                    let b = matrix(
                        be,
                        find(store, &[format!("v.blk.{i}.attn_{x}.bias")])?,
                        1,
                        hidden,
                    )?;
                    Ok((w, b))
                };
                return Ok([part("q")?, part("k")?, part("v")?]);
            }
            split_qkv(
                be,
                find(store, &names(&format!("blocks.{i}.attn.qkv.weight")))?,
                &host_f32(
                    find(store, &names(&format!("blocks.{i}.attn.qkv.bias")))?,
                    3 * hidden,
                )?,
                hidden,
            )
        };
        let blocks = (0..layers)
            .map(|i| {
                let p = format!("blocks.{i}");
                let biased = |(w, b)| (w, Some(b));
                let biased_linear = |pre: &str, rows: usize, cols: usize| {
                    linear(&format!("{p}.{pre}"), rows, cols).map(biased)
                };
                Ok(Block {
                    rms: RmsBlock {
                        norm1: vector(&format!("{p}.norm1.weight"), hidden)?,
                        norm2: vector(&format!("{p}.norm2.weight"), hidden)?,
                        qkv: qkv(i)?.map(biased),
                        proj: biased_linear("attn.proj", hidden, hidden)?,
                        gate: biased_linear("mlp.gate_proj", intermediate, hidden)?,
                        up: biased_linear("mlp.up_proj", intermediate, hidden)?,
                        down: biased_linear("mlp.down_proj", hidden, intermediate)?,
                    },
                    full: full.contains(&i),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let patch_dim = 3 * temporal * patch * patch;
        let m = hidden * merge * merge;
        let (inv_freq, pair_axis) = axial_rope(hd, theta);
        Ok(Qwen25Vision {
            hidden,
            heads,
            intermediate,
            window,
            merge,
            patch_dim,
            text_hidden,
            patch_embed: if gguf {
                patch_kernel_from_gguf(be, store, hidden, temporal, patch)?
            } else {
                get("patch_embed.proj.weight", hidden, patch_dim)?
            },
            blocks,
            ln_q: vector("merger.ln_q.weight", hidden)?,
            fc1: linear("merger.mlp.0", m, m)?,
            fc2: linear("merger.mlp.2", text_hidden, m)?,
            inv_freq,
            pair_axis,
        })
    }

    /// The image's rows for the language model: `[units, text width]`, one a merged 2×2
    /// patch, in row-major order of the merged grid.
    pub fn encode(&self, be: &B, processed: &Processed) -> Result<Vec<f32>> {
        let Some([t, gh, gw]) = processed.grid else {
            return Err(Error::InvalidRequest(
                "pixel values without a patch grid for a Qwen VL tower".into(),
            ));
        };
        let n = t * gh * gw;
        let m = self.merge;
        if processed.values.len() != n * self.patch_dim || gh % m != 0 || gw % m != 0 || n == 0 {
            return Err(Error::InvalidRequest(format!(
                "pixel values of shape {:?} for a grid of {t}x{gh}x{gw} patches of {}",
                processed.shape, self.patch_dim
            )));
        }
        let (lh, lw) = (gh / m, gw / m);
        let unit = m * m;
        let units = n / unit;
        let pos = patch_positions(t, lh, lw, m);
        // Units in window order (windows row-major, units row-major inside each), and each
        // window's first unit and size.
        let (order, windows) = window_order(t, lh, lw, self.window);
        let mut patches = vec![0f32; n * self.patch_dim];
        let mut rope_pos = vec![0u32; 2 * n];
        for (new, &old) in order.iter().enumerate() {
            let (a, b) = (new * unit, old * unit);
            patches[a * self.patch_dim..(a + unit) * self.patch_dim].copy_from_slice(
                &processed.values[b * self.patch_dim..(b + unit) * self.patch_dim],
            );
            rope_pos[2 * a..2 * (a + unit)].copy_from_slice(&pos[2 * b..2 * (b + unit)]);
        }
        // A frame's patches attend to each other in the blocks without windows.
        let frames: Vec<(usize, usize)> = (0..t).map(|f| (f * lh * lw, lh * lw)).collect();
        let rows = self.run(be, &patches, &rope_pos, (&windows, &frames), units)?;
        // Back to the processor's order of units.
        let th = self.text_hidden;
        let mut out = vec![0f32; units * th];
        for (new, &old) in order.iter().enumerate() {
            out[old * th..(old + 1) * th].copy_from_slice(&rows[new * th..(new + 1) * th]);
        }
        Ok(out)
    }

    fn run(
        &self,
        be: &B,
        patches: &[f32],
        rope_pos: &[u32],
        (windows, frames): (&[Span], &[Span]),
        units: usize,
    ) -> Result<Vec<f32>> {
        let h = self.hidden;
        let unit = self.merge * self.merge;
        let n = units * unit;
        let hidden = Rows::dense(n, h);
        let mut input = be.alloc(n * self.patch_dim);
        be.write(&mut input, 0, patches);
        let mut a = TowerActs::new(be, n, h, self.intermediate);
        be.matmul(
            &input,
            Rows::dense(n, self.patch_dim),
            &self.patch_embed,
            None,
            &mut a.x,
            hidden,
        );
        // A window's patches as `(first patch, patches)`.
        let spans = |w: &[(usize, usize)]| -> Vec<(usize, usize)> {
            w.iter().map(|&(a, len)| (a * unit, len * unit)).collect()
        };
        let (window_spans, full_spans) = (spans(windows), spans(frames));
        let mut cache = SpanCache::new();
        let r = BlockRun {
            eps: 1e-6,
            heads: self.heads,
            head_dim: h / self.heads,
            rope_pos,
            inv_freq: &self.inv_freq,
            pair_axis: &self.pair_axis,
            act: Activation::Silu,
        };
        for b in &self.blocks {
            let spans = if b.full { &full_spans } else { &window_spans };
            b.rms.run(be, &mut a, n, &r, spans, &mut cache);
        }
        // The merger: RMSNorm a patch, then a unit's patches side by side as one row.
        be.rms_norm(&a.x, hidden, &self.ln_q, 1e-6, &mut a.y, hidden);
        let mw = h * unit;
        let uv = Rows::dense(units, mw);
        let mut mid = be.alloc(units * mw);
        be.matmul(&a.y, uv, &self.fc1.0, Some(&self.fc1.1), &mut mid, uv);
        be.gelu(&mut mid, uv);
        let ov = Rows::dense(units, self.text_hidden);
        let mut rows = be.alloc(units * self.text_hidden);
        be.matmul(&mid, uv, &self.fc2.0, Some(&self.fc2.1), &mut rows, ov);
        be.sync()?;
        let mut host = vec![0f32; units * self.text_hidden];
        be.read(&rows, 0, &mut host);
        Ok(host)
    }

    /// `(t, h, w)` patches as the language model's grid of merged units: `(t · h / merge,
    /// w / merge)` rows and columns (an image is one frame).
    pub fn grid(&self, processed: &Processed) -> Option<(usize, usize)> {
        let [t, h, w] = processed.grid?;
        Some((t * h / self.merge, w / self.merge))
    }
}

/// transformers' one `[3 · hidden, hidden]` attention projection and its bias, cut into the
/// query, key and value weights (each in the tensor's own format).
pub(super) fn split_qkv<B: Backend>(
    be: &B,
    w: &RawTensor,
    bias: &[f32],
    hidden: usize,
) -> Result<[(B::Weight, B::Weight); 3]> {
    if w.numel() != 3 * hidden * hidden || bias.len() != 3 * hidden {
        return Err(Error::Weights(format!(
            "tensor {:?} has shape {:?}, expected [{}, {hidden}]",
            w.name,
            w.shape,
            3 * hidden
        )));
    }
    let row = w.bytes().len() / (3 * hidden);
    let part = |k: usize| -> Result<(B::Weight, B::Weight)> {
        let bytes = w.bytes()[k * hidden * row..(k + 1) * hidden * row].to_vec();
        let t = RawTensor::from_bytes(&w.name, w.dtype, vec![hidden, hidden], bytes)
            .ok_or_else(|| Error::Weights(format!("tensor {:?}: bad size", w.name)))?;
        Ok((
            be.load_weight_encoder(&t)?,
            weight_from(
                be,
                "qkv bias",
                vec![hidden],
                &bias[k * hidden..(k + 1) * hidden],
            )?,
        ))
    };
    Ok([part(0)?, part(1)?, part(2)?])
}

/// Each patch's (row, column), two values a patch, in the processor's order: merged units
/// row-major over the `lh × lw` grid of units, the `merge × merge` patches of a unit row-major
/// inside it; frames repeat the grid.
pub(super) fn patch_positions(t: usize, lh: usize, lw: usize, merge: usize) -> Vec<u32> {
    let unit = merge * merge;
    let mut pos = Vec::with_capacity(2 * t * lh * lw * unit);
    for _ in 0..t {
        for u in 0..lh * lw {
            for k in 0..unit {
                pos.push(((u / lw) * merge + k / merge) as u32);
                pos.push(((u % lw) * merge + k % merge) as u32);
            }
        }
    }
    pos
}

/// The axial RoPE of a head of `head_dim`: a quarter of its dimensions' frequencies, once for
/// rows and once for columns, and each rotated pair's axis (0: row, 1: column).
pub(super) fn axial_rope(head_dim: usize, theta: f32) -> (Vec<f32>, Vec<u8>) {
    let quarter = head_dim / 4;
    let base: Vec<f32> = (0..quarter)
        .map(|j| 1.0 / theta.powf((2 * j) as f32 / (head_dim / 2) as f32))
        .collect();
    let pair_axis = (0..2 * quarter).map(|i| (i >= quarter) as u8).collect();
    ([base.clone(), base].concat(), pair_axis)
}

/// Consecutive rows (or units) `(first, count)`.
pub(super) type Span = (usize, usize);

/// llama.cpp stores the 3D patch kernel as one 2D kernel a frame (`v.patch_embd.weight`,
/// `v.patch_embd.weight.1`); the matmul takes them as transformers' `[hidden, 3, temporal,
/// patch, patch]` flattened.
pub(super) fn patch_kernel_from_gguf<B: Backend>(
    be: &B,
    store: &TensorStore,
    hidden: usize,
    temporal: usize,
    patch: usize,
) -> Result<B::Weight> {
    let plane = patch * patch;
    let frames = (0..temporal)
        .map(|t| {
            let name = match t {
                0 => "v.patch_embd.weight".to_string(),
                t => format!("v.patch_embd.weight.{t}"),
            };
            host_f32(find(store, &[name])?, hidden * 3 * plane)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut w = vec![0f32; hidden * 3 * temporal * plane];
    for o in 0..hidden {
        for c in 0..3 {
            for (t, k) in frames.iter().enumerate() {
                let src = &k[(o * 3 + c) * plane..][..plane];
                w[((o * 3 + c) * temporal + t) * plane..][..plane].copy_from_slice(src);
            }
        }
    }
    weight_from(be, "v.patch_embd", vec![hidden, 3 * temporal * plane], &w)
}

/// The units of a `t × lh × lw` grid of merged units in window order — windows of `side ×
/// side` units row-major over each frame (the last row and column of windows cut short),
/// units row-major inside a window — and each window's `(first unit, units)` in that order.
fn window_order(t: usize, lh: usize, lw: usize, side: usize) -> (Vec<usize>, Vec<(usize, usize)>) {
    let mut order = Vec::with_capacity(t * lh * lw);
    let mut windows = Vec::new();
    for f in 0..t {
        for wy in (0..lh).step_by(side) {
            for wx in (0..lw).step_by(side) {
                let first = order.len();
                for y in wy..(wy + side).min(lh) {
                    for x in wx..(wx + side).min(lw) {
                        order.push(f * lh * lw + y * lw + x);
                    }
                }
                windows.push((first, order.len() - first));
            }
        }
    }
    (order, windows)
}
