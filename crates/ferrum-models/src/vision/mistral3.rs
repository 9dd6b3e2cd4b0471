//! Mistral 3's vision (Mistral Small 3.x, `Mistral3ForConditionalGeneration`): the Pixtral
//! ViT over each image at its own resolution — patches embedded by a matmul, RMSNorm before
//! the first block, RMSNorm blocks with a gated MLP, 2D axial rotary positions (half of each
//! head's pairs rotate by the patch's row, half by its column, on alternate frequencies) and
//! attention over the whole image — then the projector: RMSNorm, a learned merge of every
//! `merge × merge` patches into one row, and an MLP with GELU to the language model's width.
//!
//! The prompt lays an image out as its grid: a row of `[IMG]` per row of merged patches, each
//! row closed by `[IMG_BREAK]` and the last by `[IMG_END]`. Those two tokens keep their own
//! embeddings, so the tower's output for an image is its whole grid — its rows with the two
//! tokens' embedding rows between them — and an image is one span of the prompt, as in the
//! other families. The language model attends causally over it with plain positions.

use ferrum_backend::{Activation, Backend, Rows};
use ferrum_core::{Error, Result};
use ferrum_image::Processed;
use ferrum_loader::{GgufFile, TensorStore};
use serde_json::Value as Json;

use super::qwen25vl::patch_positions;
use super::{
    find, host_f32, matrix, usize_at, weight_from, BlockRun, ImageTokens, RmsBlock, SpanCache,
    TowerActs,
};
use crate::layers::tensor_rows;

pub struct Mistral3Vision<B: Backend> {
    hidden: usize,
    heads: usize,
    head_dim: usize,
    intermediate: usize,
    patch: usize,
    pub(super) merge: usize,
    pub(super) text_hidden: usize,
    act: Activation,
    proj_eps: f32,
    patch_conv: B::Weight,
    ln_pre: B::Weight,
    /// The blocks the features come from (`vision_feature_layer`'s).
    blocks: Vec<RmsBlock<B>>,
    proj_norm: B::Weight,
    /// The merge's weight, its columns reordered so that a unit's patches side by side
    /// (patch-major) are its input: transformers' `unfold` lays them channel-major.
    merging: B::Weight,
    linear_1: (B::Weight, Option<B::Weight>),
    linear_2: (B::Weight, Option<B::Weight>),
    /// The rotary frequency of each rotated pair and its axis (0: row, 1: column).
    inv_freq: Vec<f32>,
    pair_axis: Vec<u8>,
    /// The language model's embeddings of `[IMG_BREAK]` and `[IMG_END]`.
    break_row: Vec<f32>,
    end_row: Vec<f32>,
}

/// The tower's sizes.
pub(super) struct Dims {
    hidden: usize,
    heads: usize,
    head_dim: usize,
    intermediate: usize,
    /// Blocks run: those up to `vision_feature_layer`.
    layers: usize,
    pub(super) patch: usize,
    pub(super) merge: usize,
    theta: f32,
    act: Activation,
    proj_bias: bool,
    proj_eps: f32,
    pub(super) text_hidden: usize,
}

impl Dims {
    pub(super) fn from_hf(config: &Json) -> Result<Dims> {
        let v = &config["vision_config"];
        let t = &config["text_config"];
        let act = |k: Option<&str>, what: &str| match k {
            None | Some("silu") => Ok(Activation::Silu),
            Some("gelu") => Ok(Activation::GeluErf),
            Some(other) => Err(Error::Unsupported(format!(
                "config.json: Mistral 3 {what} activation {other:?}"
            ))),
        };
        if !matches!(
            config.get("projector_hidden_act").and_then(Json::as_str),
            None | Some("gelu")
        ) {
            return Err(Error::Unsupported(
                "config.json: Mistral 3 projector activation other than gelu".into(),
            ));
        }
        let hidden = usize_at(v, "hidden_size")?;
        let heads = usize_at(v, "num_attention_heads")?;
        let total = usize_at(v, "num_hidden_layers")?;
        // transformers' hidden states: the embeddings, then each block's output.
        let layers = match config.get("vision_feature_layer").map(Json::as_i64) {
            None => total,
            Some(Some(k)) if k < 0 && k.unsigned_abs() as usize <= total + 1 => {
                total + 1 - k.unsigned_abs() as usize
            }
            Some(Some(k)) if k >= 0 && k as usize <= total => k as usize,
            Some(_) => {
                return Err(Error::Unsupported(
                    "config.json: Mistral 3 vision_feature_layer other than one layer".into(),
                ))
            }
        };
        let theta = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .and_then(Json::as_f64)
            .unwrap_or(10_000.0) as f32;
        Ok(Dims {
            hidden,
            heads,
            head_dim: v
                .get("head_dim")
                .and_then(Json::as_u64)
                .map_or(hidden / heads.max(1), |x| x as usize),
            intermediate: usize_at(v, "intermediate_size")?,
            layers,
            patch: usize_at(v, "patch_size")?,
            merge: config
                .get("spatial_merge_size")
                .and_then(Json::as_u64)
                .unwrap_or(2) as usize,
            theta,
            act: act(v.get("hidden_act").and_then(Json::as_str), "vision")?,
            proj_bias: config
                .get("multimodal_projector_bias")
                .and_then(Json::as_bool)
                .unwrap_or(false),
            proj_eps: t.get("rms_norm_eps").and_then(Json::as_f64).unwrap_or(1e-5) as f32,
            text_hidden: usize_at(t, "hidden_size")?,
        })
    }

    /// From llama.cpp's mmproj keys (projector `pixtral`, with the patch merger of Mistral
    /// Small 3.x).
    pub(super) fn from_gguf(mm: &GgufFile, text_hidden: usize) -> Result<Dims> {
        let key = |k: &str| mm.require_usize(&format!("clip.vision.{k}"));
        let opt = |k: &str| mm.get_u64(&format!("clip.vision.{k}")).map(|v| v as usize);
        let hidden = key("embedding_length")?;
        let heads = key("attention.head_count")?;
        let eps = mm
            .get_f64("clip.vision.attention.layer_norm_epsilon")
            .unwrap_or(1e-5) as f32;
        Ok(Dims {
            hidden,
            heads,
            head_dim: hidden / heads.max(1),
            intermediate: key("feed_forward_length")?,
            layers: key("block_count")?,
            patch: key("patch_size")?,
            merge: opt("spatial_merge_size").unwrap_or(2),
            theta: mm.get_f64("clip.vision.rope.freq_base").unwrap_or(10_000.0) as f32,
            act: if mm.get_bool("clip.use_gelu") == Some(true) {
                Activation::GeluErf
            } else {
                Activation::Silu
            },
            // What the file has: set from its tensors at load (`load_gguf`).
            proj_bias: false,
            proj_eps: eps,
            text_hidden,
        })
    }

    /// The bytes one image of `patches` patches allocates in the tower (all f32): the
    /// patches twice (host, backend), the residual stream and its companions, QKV, the
    /// MLP's gate and up and product, then the projector's rows.
    pub(super) fn activation_bytes(&self, patches: usize) -> u64 {
        let (h, f) = (self.hidden, self.intermediate);
        let pd = 3 * self.patch * self.patch;
        let per_patch = 2 * pd + 3 * h + 3 * h + h + 3 * f;
        let units = patches / (self.merge * self.merge).max(1);
        4 * (patches * per_patch + units * (h + 3 * self.text_hidden)) as u64
    }
}

/// llama.cpp's mmproj name of a tensor named as in transformers' Mistral 3 (below
/// `vision_tower.` or `multi_modal_projector.`).
fn gguf_name(rest: &str) -> String {
    if let Some(r) = rest.strip_prefix("transformer.layers.") {
        let (i, tail) = r.split_once('.').unwrap_or((r, ""));
        let part = match tail {
            "attention_norm.weight" => "ln1.weight",
            "ffn_norm.weight" => "ln2.weight",
            "attention.q_proj.weight" => "attn_q.weight",
            "attention.k_proj.weight" => "attn_k.weight",
            "attention.v_proj.weight" => "attn_v.weight",
            "attention.o_proj.weight" => "attn_out.weight",
            "feed_forward.gate_proj.weight" => "ffn_gate.weight",
            "feed_forward.up_proj.weight" => "ffn_up.weight",
            "feed_forward.down_proj.weight" => "ffn_down.weight",
            other => other,
        };
        return format!("v.blk.{i}.{part}");
    }
    match rest {
        "patch_conv.weight" => "v.patch_embd.weight".into(),
        "ln_pre.weight" => "v.pre_ln.weight".into(),
        "norm.weight" => "mm.input_norm.weight".into(),
        "patch_merger.merging_layer.weight" => "mm.patch_merger.weight".into(),
        "linear_1.weight" => "mm.1.weight".into(),
        "linear_1.bias" => "mm.1.bias".into(),
        "linear_2.weight" => "mm.2.weight".into(),
        "linear_2.bias" => "mm.2.bias".into(),
        other => other.into(),
    }
}

/// Pixtral's axial RoPE of a head of `head_dim`: the head's frequencies `θ^(−2i/d)`, the
/// even ones for the first half of its pairs (rows), the odd ones for the second (columns).
fn axial_rope(head_dim: usize, theta: f32) -> (Vec<f32>, Vec<u8>) {
    let all: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let even = all.iter().step_by(2).copied();
    let odd = all.iter().skip(1).step_by(2).copied();
    let inv_freq: Vec<f32> = even.chain(odd).collect();
    let half = all.len().div_ceil(2);
    let pair_axis = (0..inv_freq.len()).map(|i| (i >= half) as u8).collect();
    (inv_freq, pair_axis)
}

/// The rows and columns of merged units of a processed image (`[1, 3, h, w]`, its sides in
/// whole units of `unit` pixels); `None` for any other shape.
pub(super) fn grid_units(p: &Processed, unit: usize) -> Option<(usize, usize)> {
    match p.shape[..] {
        [1, 3, h, w] if unit > 0 && h % unit == 0 && w % unit == 0 && h > 0 && w > 0 => {
            Some((h / unit, w / unit))
        }
        _ => None,
    }
}

/// An image of `lh × lw` units laid out in a prompt: a row of `unit` per row of units, each
/// row closed by `brk`, the last by `end`.
pub(super) fn grid_layout<T: Clone>(lh: usize, lw: usize, unit: T, brk: T, end: T) -> Vec<T> {
    let mut out = Vec::with_capacity(lh * (lw + 1));
    for r in 0..lh {
        out.extend(std::iter::repeat_n(unit.clone(), lw));
        out.push(if r + 1 == lh {
            end.clone()
        } else {
            brk.clone()
        });
    }
    out
}

/// Mistral 3's image tokens from a vocabulary's texts.
pub(super) fn tokens_from_vocab(id: impl Fn(&str) -> Option<u32>) -> Result<ImageTokens> {
    let need =
        |t: &str| id(t).ok_or_else(|| Error::Weights(format!("the model's vocabulary has no {t}")));
    Ok(ImageTokens {
        begin: None,
        placeholder: need("[IMG]")?,
        end: None,
        bidirectional: false,
        grid: Some((need("[IMG_BREAK]")?, need("[IMG_END]")?)),
    })
}

impl<B: Backend> Mistral3Vision<B> {
    /// From a Hugging Face checkpoint: its config.json and tensors, the image tokens
    /// `tokens` (from its tokenizer), and the language model's embedding table in `store`.
    pub fn load(config: &Json, store: &TensorStore, tokens: &ImageTokens, be: &B) -> Result<Self> {
        let d = Dims::from_hf(config)?;
        let embed = find(
            store,
            &[
                "language_model.model.embed_tokens.weight".to_string(),
                "model.language_model.embed_tokens.weight".to_string(),
            ],
        )?;
        Self::build(d, store, be, false, (embed, tokens))
    }

    /// From llama.cpp's `mmproj` GGUF (projector `pixtral`), for the language model `lm`
    /// (its width, vocabulary and embedding table).
    pub fn load_gguf(
        mm: &GgufFile,
        lm: &GgufFile,
        text_hidden: usize,
        tokens: &ImageTokens,
        be: &B,
    ) -> Result<Self> {
        let mut d = Dims::from_gguf(mm, text_hidden)?;
        let store = mm.tensors();
        d.proj_bias = store.get("mm.1.bias").is_some();
        let lm_store = lm.tensors();
        let embed = find(&lm_store, &["token_embd.weight".to_string()])?;
        Self::build(d, &store, be, true, (embed, tokens))
    }

    fn build(
        d: Dims,
        store: &TensorStore,
        be: &B,
        gguf: bool,
        (embed, tokens): (&ferrum_loader::RawTensor, &ImageTokens),
    ) -> Result<Self> {
        let Dims {
            hidden,
            heads,
            head_dim,
            intermediate,
            layers,
            patch,
            merge,
            theta,
            act,
            proj_bias,
            proj_eps,
            text_hidden,
        } = d;
        let w = heads * head_dim;
        if heads == 0 || w != hidden || head_dim % 4 != 0 || merge == 0 || patch == 0 {
            return Err(Error::Weights(format!(
                "vision tower: {hidden} is not {heads} heads of a multiple of 4, or no patch"
            )));
        }
        let names = |tower: bool, rest: &str| -> Vec<String> {
            if gguf {
                return vec![gguf_name(rest)];
            }
            let part = if tower {
                "vision_tower."
            } else {
                "multi_modal_projector."
            };
            vec![format!("{part}{rest}"), format!("model.{part}{rest}")]
        };
        let get = |tower: bool, rest: &str, rows: usize, cols: usize| -> Result<B::Weight> {
            matrix(be, find(store, &names(tower, rest))?, rows, cols)
        };
        // llama.cpp's converter permutes the queries' and keys' rows for its interleaved
        // rotation; the rows go back to transformers' order (halves), which this tower rotates.
        let rotated = |rest: &str| -> Result<B::Weight> {
            let t = find(store, &names(true, rest))?;
            if !gguf {
                return matrix(be, t, w, hidden);
            }
            if t.numel() != w * hidden {
                return Err(Error::Weights(format!(
                    "tensor {:?} has shape {:?}, expected [{w}, {hidden}]",
                    t.name, t.shape
                )));
            }
            let row = t.bytes().len() / w;
            let bytes = crate::names::permute_rope_rows(t.bytes(), row, heads, w, false);
            let r = ferrum_loader::RawTensor::from_bytes(&t.name, t.dtype, vec![w, hidden], bytes)
                .ok_or_else(|| Error::Weights(format!("tensor {:?}: bad size", t.name)))?;
            be.load_weight_encoder(&r)
        };
        let vector = |tower: bool, rest: &str, len: usize| -> Result<B::Weight> {
            let v = host_f32(find(store, &names(tower, rest))?, len)?;
            weight_from(be, rest, vec![len], &v)
        };
        let blocks = (0..layers)
            .map(|i| {
                let p = format!("transformer.layers.{i}");
                let m = |x: &str, r: usize, c: usize| get(true, &format!("{p}.{x}.weight"), r, c);
                Ok(RmsBlock {
                    norm1: vector(true, &format!("{p}.attention_norm.weight"), hidden)?,
                    norm2: vector(true, &format!("{p}.ffn_norm.weight"), hidden)?,
                    qkv: [
                        (rotated(&format!("{p}.attention.q_proj.weight"))?, None),
                        (rotated(&format!("{p}.attention.k_proj.weight"))?, None),
                        (m("attention.v_proj", w, hidden)?, None),
                    ],
                    proj: (m("attention.o_proj", hidden, w)?, None),
                    gate: (m("feed_forward.gate_proj", intermediate, hidden)?, None),
                    up: (m("feed_forward.up_proj", intermediate, hidden)?, None),
                    down: (m("feed_forward.down_proj", hidden, intermediate)?, None),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let unit = merge * merge;
        let raw = host_f32(
            find(store, &names(false, "patch_merger.merging_layer.weight"))?,
            hidden * hidden * unit,
        )?;
        let mut merging = vec![0f32; raw.len()];
        for o in 0..hidden {
            for c in 0..hidden {
                for k in 0..unit {
                    merging[o * hidden * unit + k * hidden + c] =
                        raw[o * hidden * unit + c * unit + k];
                }
            }
        }
        let linear = |rest: &str, rows: usize, cols: usize| -> Result<_> {
            let bias = if proj_bias {
                Some(vector(false, &format!("{rest}.bias"), rows)?)
            } else {
                None
            };
            Ok((get(false, &format!("{rest}.weight"), rows, cols)?, bias))
        };
        let (inv_freq, pair_axis) = axial_rope(head_dim, theta);
        let (brk, end) = tokens.grid.ok_or_else(|| {
            Error::Weights("Mistral 3 image tokens without [IMG_BREAK] and [IMG_END]".into())
        })?;
        Ok(Mistral3Vision {
            hidden,
            heads,
            head_dim,
            intermediate,
            patch,
            merge,
            text_hidden,
            act,
            proj_eps,
            patch_conv: get(true, "patch_conv.weight", hidden, 3 * patch * patch)?,
            ln_pre: vector(true, "ln_pre.weight", hidden)?,
            blocks,
            proj_norm: vector(false, "norm.weight", hidden)?,
            merging: weight_from(be, "patch_merger", vec![hidden, hidden * unit], &merging)?,
            linear_1: linear("linear_1", text_hidden, hidden)?,
            linear_2: linear("linear_2", text_hidden, text_hidden)?,
            inv_freq,
            pair_axis,
            break_row: tensor_rows(embed, &[brk as usize], text_hidden)?,
            end_row: tensor_rows(embed, &[end as usize], text_hidden)?,
        })
    }

    /// The pixels the image's patches cover, in rows and columns of merged units; an
    /// error where they do not fill whole units.
    pub(super) fn units(&self, p: &Processed) -> Result<(usize, usize)> {
        grid_units(p, self.unit()).ok_or_else(|| {
            Error::InvalidRequest(format!(
                "pixel values of shape {:?} for a Pixtral tower of {}-pixel units",
                p.shape,
                self.unit()
            ))
        })
    }

    /// The pixels of a merged unit's side: what the processor resizes to multiples of.
    pub fn unit(&self) -> usize {
        self.patch * self.merge
    }

    /// The rows the image takes in the prompt: each row of units and its break.
    pub fn rows(&self, p: &Processed) -> usize {
        self.units(p).map_or(0, |(lh, lw)| lh * (lw + 1))
    }

    /// The image's rows for the language model, `[rows, text width]`: its units row by row,
    /// each row followed by `[IMG_BREAK]`'s embedding, the last by `[IMG_END]`'s.
    pub fn encode(&self, be: &B, processed: &Processed) -> Result<Vec<f32>> {
        let (lh, lw) = self.units(processed)?;
        let (m, p) = (self.merge, self.patch);
        let (ph, pw) = (lh * m, lw * m);
        let (w_px, plane) = (pw * p, ph * p * pw * p);
        if processed.values.len() != 3 * plane {
            return Err(Error::InvalidRequest(format!(
                "{} pixel values for an image of shape {:?}",
                processed.values.len(),
                processed.shape
            )));
        }
        // Patches in unit order (units row-major, a unit's patches row-major inside it), each
        // `[3, p, p]` flattened as the convolution's kernel is.
        let pos = patch_positions(1, lh, lw, m);
        let pd = 3 * p * p;
        let mut patches = vec![0f32; ph * pw * pd];
        for (k, dst) in patches.chunks_exact_mut(pd).enumerate() {
            let (py, px) = (pos[2 * k] as usize, pos[2 * k + 1] as usize);
            for c in 0..3 {
                for y in 0..p {
                    let src = c * plane + (py * p + y) * w_px + px * p;
                    dst[(c * p + y) * p..][..p].copy_from_slice(&processed.values[src..src + p]);
                }
            }
        }
        let rows = self.run(be, &patches, &pos, lh * lw)?;
        let th = self.text_hidden;
        let mut out = Vec::with_capacity(lh * (lw + 1) * th);
        for (r, row) in rows.chunks_exact(lw * th).enumerate() {
            out.extend_from_slice(row);
            out.extend_from_slice(if r + 1 == lh {
                &self.end_row
            } else {
                &self.break_row
            });
        }
        Ok(out)
    }

    fn run(&self, be: &B, patches: &[f32], rope_pos: &[u32], units: usize) -> Result<Vec<f32>> {
        let h = self.hidden;
        let unit = self.merge * self.merge;
        let n = units * unit;
        let pd = 3 * self.patch * self.patch;
        let hidden = Rows::dense(n, h);
        let mut input = be.alloc(n * pd);
        be.write(&mut input, 0, patches);
        let mut a = TowerActs::new(be, n, h, self.intermediate);
        be.matmul(
            &input,
            Rows::dense(n, pd),
            &self.patch_conv,
            None,
            &mut a.x,
            hidden,
        );
        be.rms_norm_inplace(&mut a.x, hidden, &self.ln_pre, 1e-5);
        let mut cache = SpanCache::new();
        let r = BlockRun {
            eps: 1e-5,
            heads: self.heads,
            head_dim: self.head_dim,
            rope_pos,
            inv_freq: &self.inv_freq,
            pair_axis: &self.pair_axis,
            act: self.act,
        };
        for b in &self.blocks {
            b.run(be, &mut a, n, &r, &[(0, n)], &mut cache);
        }
        // The projector: RMSNorm a patch, a unit's patches side by side as one row merged to
        // one patch's width, then the MLP.
        be.rms_norm(
            &a.x,
            hidden,
            &self.proj_norm,
            self.proj_eps,
            &mut a.y,
            hidden,
        );
        let uv = Rows::dense(units, h * unit);
        let mv = Rows::dense(units, h);
        let mut merged = be.alloc(units * h);
        be.matmul(&a.y, uv, &self.merging, None, &mut merged, mv);
        let ov = Rows::dense(units, self.text_hidden);
        let mut mid = be.alloc(units * self.text_hidden);
        be.matmul(
            &merged,
            mv,
            &self.linear_1.0,
            self.linear_1.1.as_ref(),
            &mut mid,
            ov,
        );
        be.gelu(&mut mid, ov);
        let mut rows = be.alloc(units * self.text_hidden);
        be.matmul(
            &mid,
            ov,
            &self.linear_2.0,
            self.linear_2.1.as_ref(),
            &mut rows,
            ov,
        );
        be.sync()?;
        let mut host = vec![0f32; units * self.text_hidden];
        be.read(&rows, 0, &mut host);
        Ok(host)
    }
}
