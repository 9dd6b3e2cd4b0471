//! Qwen3-VL's vision: Qwen2.5-VL's ViT without windows (every block attends over the whole
//! image) and with LayerNorms, tanh-GELU MLPs, a biased patch embedding, and learned positions
//! — a square table resampled bilinearly (corners aligned) to each image's patch grid — added
//! to the patches before the 2D rotary blocks. The merger takes each 2×2 patches as one row
//! after a LayerNorm; DeepStack mergers (LayerNorm over the merged row) take the hidden states
//! after the `deepstack_visual_indexes` blocks, and the language model adds their rows to its
//! image rows after its first layers. Rows sit between `<|vision_start|>` and
//! `<|vision_end|>`, attend causally and take interleaved M-RoPE positions.

use ferrum_backend::{Backend, MatmulPart, RopeLayout, RopeParams, Rows};
use ferrum_core::{Error, Result};
use ferrum_image::Processed;
use ferrum_loader::{GgufFile, TensorStore};
use serde_json::Value as Json;

use super::qwen25vl::{axial_rope, patch_kernel_from_gguf, patch_positions, Span};
use super::{
    attend_spans, find, host_f32, matrix, qwen_tokens, qwen_tokens_gguf, usize_at, ImageTokens,
    SpanCache,
};

struct Block<B: Backend> {
    norm1: (Vec<f32>, Vec<f32>),
    norm2: (Vec<f32>, Vec<f32>),
    qkv: [(B::Weight, B::Weight); 3],
    proj: (B::Weight, B::Weight),
    fc1: (B::Weight, B::Weight),
    fc2: (B::Weight, B::Weight),
}

/// A patch merger: a LayerNorm (over a patch, or over the merged row for DeepStack's), then
/// `fc2(gelu(fc1(·)))` on each merged row.
struct Merger<B: Backend> {
    norm: (Vec<f32>, Vec<f32>),
    post_shuffle: bool,
    fc1: (B::Weight, B::Weight),
    fc2: (B::Weight, B::Weight),
}

pub struct Qwen3Vision<B: Backend> {
    hidden: usize,
    heads: usize,
    intermediate: usize,
    merge: usize,
    patch_dim: usize,
    pub(super) text_hidden: usize,
    patch_embed: (B::Weight, B::Weight),
    /// The learned positions, `[side², hidden]` on the host (resampled per image).
    positions: Vec<f32>,
    side: usize,
    blocks: Vec<Block<B>>,
    merger: Merger<B>,
    /// `(block, merger)`: a DeepStack merger over the states after that block.
    deep: Vec<(usize, Merger<B>)>,
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
    positions: usize,
    deep: Vec<usize>,
    theta: f32,
    pub(super) text_hidden: usize,
}

impl Dims {
    pub(super) fn from_hf(config: &Json) -> Result<Dims> {
        let v = &config["vision_config"];
        match v.get("hidden_act").and_then(Json::as_str) {
            None | Some("gelu_pytorch_tanh") => {}
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "config.json: Qwen3-VL vision activation {other:?}"
                )))
            }
        }
        let opt = |k: &str, d: usize| v.get(k).and_then(Json::as_u64).map_or(d, |x| x as usize);
        Ok(Dims {
            hidden: usize_at(v, "hidden_size")?,
            heads: usize_at(v, "num_heads")?,
            intermediate: usize_at(v, "intermediate_size")?,
            layers: usize_at(v, "depth")?,
            patch: usize_at(v, "patch_size")?,
            temporal: opt("temporal_patch_size", 2),
            merge: opt("spatial_merge_size", 2),
            positions: usize_at(v, "num_position_embeddings")?,
            deep: v
                .get("deepstack_visual_indexes")
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
            text_hidden: usize_at(v, "out_hidden_size")?,
        })
    }

    /// From llama.cpp's mmproj keys (projector `qwen3vl_merger`): the learned positions'
    /// square from `image_size / patch_size`, DeepStack blocks from `is_deepstack_layers`.
    pub(super) fn from_gguf(mm: &GgufFile, text_hidden: usize) -> Result<Dims> {
        let key = |k: &str| mm.require_usize(&format!("clip.vision.{k}"));
        let patch = key("patch_size")?;
        let side = key("image_size")? / patch.max(1);
        Ok(Dims {
            hidden: key("embedding_length")?,
            heads: key("attention.head_count")?,
            intermediate: key("feed_forward_length")?,
            layers: key("block_count")?,
            patch,
            temporal: 2,
            merge: mm
                .get_u64("clip.vision.spatial_merge_size")
                .map_or(2, |v| v as usize),
            positions: side * side,
            deep: mm
                .get_bool_array("clip.vision.is_deepstack_layers")
                .unwrap_or_default()
                .iter()
                .enumerate()
                .filter_map(|(i, &d)| d.then_some(i))
                .collect(),
            theta: 10_000.0,
            text_hidden,
        })
    }

    /// The bytes one image of `patches` patches allocates in the tower (all f32): the
    /// patches twice, the residual stream and its companions, QKV, the MLP's rows, the
    /// scratch keys and values; then each merger's rows and the output with its DeepStack rows.
    pub(super) fn activation_bytes(&self, patches: usize) -> u64 {
        let (h, f) = (self.hidden, self.intermediate);
        let pd = 3 * self.temporal * self.patch * self.patch;
        let per_patch = 2 * pd + 4 * h + 3 * h + h + f + 2 * h;
        let units = patches / (self.merge * self.merge).max(1);
        let m = h * self.merge * self.merge;
        let out = (1 + self.deep.len()) * self.text_hidden;
        4 * (patches * per_patch + units * (2 * m + self.text_hidden + out)) as u64
    }
}

/// llama.cpp's mmproj name of a tensor named as in transformers' Qwen3-VL (below `visual.`);
/// `deep`: the DeepStack mergers' blocks (llama.cpp names a merger by its block).
fn gguf_name(rest: &str, deep: &[usize]) -> String {
    if let Some(r) = rest.strip_prefix("blocks.") {
        let (i, tail) = r.split_once('.').unwrap_or((r, ""));
        let (part, what) = tail.rsplit_once('.').unwrap_or((tail, ""));
        let part = match part {
            "norm1" => "ln1",
            "norm2" => "ln2",
            "attn.qkv" => "attn_qkv",
            "attn.proj" => "attn_out",
            "mlp.linear_fc1" => "ffn_up",
            "mlp.linear_fc2" => "ffn_down",
            other => other,
        };
        return format!("v.blk.{i}.{part}.{what}");
    }
    if let Some(r) = rest.strip_prefix("deepstack_merger_list.") {
        let (k, tail) = r.split_once('.').unwrap_or((r, ""));
        let block = k.parse::<usize>().ok().and_then(|k| deep.get(k)).copied();
        let tail = tail
            .replace("linear_fc1", "fc1")
            .replace("linear_fc2", "fc2");
        return format!("v.deepstack.{}.{tail}", block.unwrap_or(usize::MAX));
    }
    match rest {
        "merger.norm.weight" => "v.post_ln.weight".into(),
        "merger.norm.bias" => "v.post_ln.bias".into(),
        "merger.linear_fc1.weight" => "mm.0.weight".into(),
        "merger.linear_fc1.bias" => "mm.0.bias".into(),
        "merger.linear_fc2.weight" => "mm.2.weight".into(),
        "merger.linear_fc2.bias" => "mm.2.bias".into(),
        "patch_embed.proj.bias" => "v.patch_embd.bias".into(),
        "pos_embed.weight" => "v.position_embd.weight".into(),
        other => other.into(),
    }
}

impl<B: Backend> Qwen3Vision<B> {
    /// From a Hugging Face checkpoint (its config.json and tensors).
    pub fn load(config: &Json, store: &TensorStore, be: &B) -> Result<(Self, ImageTokens)> {
        let d = Dims::from_hf(config)?;
        let tokens = qwen_tokens(config)?;
        Ok((Self::build(d, store, be, false)?, tokens))
    }

    /// From llama.cpp's `mmproj` GGUF (projector `qwen3vl_merger`), for a language model of
    /// `text_hidden` whose vocabulary gives the image tokens.
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

    fn build(d: Dims, store: &TensorStore, be: &B, gguf: bool) -> Result<Self> {
        let Dims {
            hidden,
            heads,
            intermediate,
            layers,
            patch,
            temporal,
            merge,
            positions,
            deep,
            theta,
            text_hidden,
        } = d;
        let hd = hidden / heads.max(1);
        let side = (positions as f64).sqrt().round() as usize;
        if heads == 0
            || hidden % heads != 0
            || hd % 4 != 0
            || merge == 0
            || side * side != positions
        {
            return Err(Error::Weights(format!(
                "vision tower: {hidden} is not {heads} heads of a multiple of 4, or \
                 {positions} positions are not a square"
            )));
        }
        if let Some(&bad) = deep.iter().find(|&&i| i >= layers) {
            return Err(Error::Weights(format!(
                "config.json: DeepStack block {bad} of {layers}"
            )));
        }
        let names = |rest: &str| -> Vec<String> {
            if gguf {
                return vec![gguf_name(rest, &deep)];
            }
            ["model.visual.", "visual."]
                .iter()
                .map(|p| format!("{p}{rest}"))
                .collect()
        };
        let get = |rest: &str, rows: usize, cols: usize| -> Result<B::Weight> {
            matrix(be, find(store, &names(rest))?, rows, cols)
        };
        let host = |rest: &str, len: usize| -> Result<Vec<f32>> {
            host_f32(find(store, &names(rest))?, len)
        };
        let linear = |pre: &str, rows: usize, cols: usize| -> Result<(B::Weight, B::Weight)> {
            Ok((
                get(&format!("{pre}.weight"), rows, cols)?,
                get(&format!("{pre}.bias"), 1, rows)?,
            ))
        };
        let ln = |pre: &str, len: usize| -> Result<(Vec<f32>, Vec<f32>)> {
            Ok((
                host(&format!("{pre}.weight"), len)?,
                host(&format!("{pre}.bias"), len)?,
            ))
        };
        let m = hidden * merge * merge;
        let merger = |pre: &str, post_shuffle: bool| -> Result<Merger<B>> {
            Ok(Merger {
                norm: ln(
                    &format!("{pre}.norm"),
                    if post_shuffle { m } else { hidden },
                )?,
                post_shuffle,
                fc1: linear(&format!("{pre}.linear_fc1"), m, m)?,
                fc2: linear(&format!("{pre}.linear_fc2"), text_hidden, m)?,
            })
        };
        let blocks = (0..layers)
            .map(|i| {
                let p = format!("blocks.{i}");
                Ok(Block {
                    norm1: ln(&format!("{p}.norm1"), hidden)?,
                    norm2: ln(&format!("{p}.norm2"), hidden)?,
                    qkv: super::qwen25vl::split_qkv(
                        be,
                        find(store, &names(&format!("{p}.attn.qkv.weight")))?,
                        &host(&format!("{p}.attn.qkv.bias"), 3 * hidden)?,
                        hidden,
                    )?,
                    proj: linear(&format!("{p}.attn.proj"), hidden, hidden)?,
                    fc1: linear(&format!("{p}.mlp.linear_fc1"), intermediate, hidden)?,
                    fc2: linear(&format!("{p}.mlp.linear_fc2"), hidden, intermediate)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let patch_dim = 3 * temporal * patch * patch;
        let (inv_freq, pair_axis) = axial_rope(hd, theta);
        let deep = deep
            .iter()
            .enumerate()
            .map(|(k, &b)| Ok((b, merger(&format!("deepstack_merger_list.{k}"), true)?)))
            .collect::<Result<Vec<_>>>()?;
        let patch_embed = if gguf {
            (
                patch_kernel_from_gguf(be, store, hidden, temporal, patch)?,
                get("patch_embed.proj.bias", 1, hidden)?,
            )
        } else {
            linear("patch_embed.proj", hidden, patch_dim)?
        };
        let tower = Qwen3Vision {
            hidden,
            heads,
            intermediate,
            merge,
            patch_dim,
            text_hidden,
            patch_embed,
            positions: host("pos_embed.weight", positions * hidden)?,
            side,
            blocks,
            merger: merger("merger", false)?,
            deep,
            inv_freq,
            pair_axis,
        };
        Ok(tower)
    }

    /// `(t, h, w)` patches as the language model's grid of merged units.
    pub fn grid(&self, processed: &Processed) -> Option<(usize, usize)> {
        let [t, h, w] = processed.grid?;
        Some((t * h / self.merge, w / self.merge))
    }

    /// DeepStack rows after each image row.
    pub fn deep_layers(&self) -> usize {
        self.deep.len()
    }

    /// The learned positions resampled to a `gh × gw` patch grid (bilinear, corners
    /// aligned, as transformers' `F.interpolate` equivalent computes it), one row a patch in
    /// the processor's order.
    fn resampled_positions(&self, pos: &[u32], gh: usize, gw: usize) -> Vec<f32> {
        let (side, h) = (self.side, self.hidden);
        let taps = |i: u32, size: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            let tap = |o: f32| {
                let raw = floor + o;
                let w = (1.0 - (src - raw).abs()).max(0.0);
                ((raw as usize).min(side - 1), w)
            };
            [tap(0.0), tap(1.0)]
        };
        let mut out = vec![0f32; pos.len() / 2 * h];
        for (p, rc) in pos.chunks_exact(2).enumerate() {
            let dst = &mut out[p * h..(p + 1) * h];
            let (hs, ws) = (taps(rc[0], gh), taps(rc[1], gw));
            let mut first = true;
            for &(hi, hw) in &hs {
                for &(wi, ww) in &ws {
                    let wgt = hw * ww;
                    let row = &self.positions[(hi * side + wi) * h..][..h];
                    for (d, &v) in dst.iter_mut().zip(row) {
                        if first {
                            *d = v * wgt;
                        } else {
                            *d += v * wgt;
                        }
                    }
                    first = false;
                }
            }
        }
        out
    }

    /// The image's rows for the language model, each followed by its DeepStack rows:
    /// `[units, (1 + deep) · text width]`, units in row-major order of the merged grid.
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
        let rope_pos = patch_positions(t, lh, lw, m);
        let frames: Vec<Span> = (0..t).map(|f| (f * gh * gw, gh * gw)).collect();
        let (h, f) = (self.hidden, self.intermediate);
        let hd = h / self.heads;
        let hidden = Rows::dense(n, h);
        let mut input = be.alloc(n * self.patch_dim);
        be.write(&mut input, 0, &processed.values);
        let mut x = be.alloc(n * h);
        let mut y = be.alloc(n * h);
        let mut tmp = be.alloc(n * h);
        let mut qkv = be.alloc(n * 3 * h);
        let mut attn = be.alloc(n * h);
        let mut mlp = be.alloc(n * f);
        be.matmul(
            &input,
            Rows::dense(n, self.patch_dim),
            &self.patch_embed.0,
            Some(&self.patch_embed.1),
            &mut x,
            hidden,
        );
        be.write(&mut tmp, 0, &self.resampled_positions(&rope_pos, gh, gw));
        be.add_inplace(&mut x, hidden, &tmp, hidden);
        let mut cache = SpanCache::new();
        let rope = RopeParams {
            layout: RopeLayout::Neox,
            inv_freq: &self.inv_freq,
            factor: 1.0,
        };
        let q_view = Rows::columns(n, 3 * h, 0, h).split_heads(hd);
        let k_view = Rows::columns(n, 3 * h, h, h).split_heads(hd);
        let units = n / (m * m);
        let mut deep_rows: Vec<Vec<f32>> = Vec::with_capacity(self.deep.len());
        for (i, b) in self.blocks.iter().enumerate() {
            be.copy_rows(&x, hidden, &mut y, hidden);
            be.layer_norm(&mut y, hidden, &b.norm1.0, &b.norm1.1, 1e-6);
            let parts: Vec<MatmulPart<B::Weight>> = b
                .qkv
                .iter()
                .enumerate()
                .map(|(k, (w, bias))| MatmulPart {
                    weight: w,
                    bias: Some(bias),
                    out: Rows::columns(n, 3 * h, k * h, h),
                })
                .collect();
            be.matmul_many(&y, hidden, &parts, &mut qkv);
            be.rope_axes(&mut qkv, q_view, &rope_pos, 2, &self.pair_axis, rope);
            be.rope_axes(&mut qkv, k_view, &rope_pos, 2, &self.pair_axis, rope);
            attend_spans(be, &qkv, n, self.heads, hd, &frames, &mut attn, &mut cache);
            be.matmul(&attn, hidden, &b.proj.0, Some(&b.proj.1), &mut tmp, hidden);
            be.add_inplace(&mut x, hidden, &tmp, hidden);
            be.copy_rows(&x, hidden, &mut y, hidden);
            be.layer_norm(&mut y, hidden, &b.norm2.0, &b.norm2.1, 1e-6);
            let mv = Rows::dense(n, f);
            be.matmul(&y, hidden, &b.fc1.0, Some(&b.fc1.1), &mut mlp, mv);
            be.gelu_tanh(&mut mlp, mv);
            be.matmul(&mlp, mv, &b.fc2.0, Some(&b.fc2.1), &mut tmp, hidden);
            be.add_inplace(&mut x, hidden, &tmp, hidden);
            for (_, merger) in self.deep.iter().filter(|(at, _)| *at == i) {
                deep_rows.push(self.merge_rows(be, merger, &x, n, units)?);
            }
        }
        let main = self.merge_rows(be, &self.merger, &x, n, units)?;
        // Each unit's row, then its DeepStack rows, in the order of the DeepStack mergers.
        let th = self.text_hidden;
        let mut out = Vec::with_capacity(units * th * (1 + deep_rows.len()));
        for u in 0..units {
            out.extend_from_slice(&main[u * th..(u + 1) * th]);
            for d in &deep_rows {
                out.extend_from_slice(&d[u * th..(u + 1) * th]);
            }
        }
        Ok(out)
    }

    /// A merger over the `n` patch rows of `x`: `[units, text width]` on the host.
    fn merge_rows(
        &self,
        be: &B,
        merger: &Merger<B>,
        x: &B::Buf,
        n: usize,
        units: usize,
    ) -> Result<Vec<f32>> {
        let h = self.hidden;
        let mw = h * self.merge * self.merge;
        let uv = Rows::dense(units, mw);
        let mut y = be.alloc(n * h);
        be.copy_rows(x, Rows::dense(n, h), &mut y, Rows::dense(n, h));
        if merger.post_shuffle {
            be.layer_norm(&mut y, uv, &merger.norm.0, &merger.norm.1, 1e-6);
        } else {
            be.layer_norm(
                &mut y,
                Rows::dense(n, h),
                &merger.norm.0,
                &merger.norm.1,
                1e-6,
            );
        }
        let mut mid = be.alloc(units * mw);
        be.matmul(&y, uv, &merger.fc1.0, Some(&merger.fc1.1), &mut mid, uv);
        be.gelu(&mut mid, uv);
        let ov = Rows::dense(units, self.text_hidden);
        let mut rows = be.alloc(units * self.text_hidden);
        be.matmul(&mid, uv, &merger.fc2.0, Some(&merger.fc2.1), &mut rows, ov);
        be.sync()?;
        let mut host = vec![0f32; units * self.text_hidden];
        be.read(&rows, 0, &mut host);
        Ok(host)
    }
}
