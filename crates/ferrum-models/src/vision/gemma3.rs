//! Gemma 3's vision: a SigLIP tower (patch embedding, learned positions, pre-LayerNorm
//! blocks with biases and tanh-GELU MLPs, a final LayerNorm) and the multimodal projector —
//! the patch grid average-pooled to `mm_tokens_per_image` rows, Gemma's RMSNorm (`1 + w`),
//! and a projection to the language model's width. Each image's rows sit between
//! `<start_of_image>` and `<end_of_image>` and attend to each other both ways.

use ferrum_backend::{Backend, MatmulPart, Rows};
use ferrum_core::{Error, Result};
use ferrum_image::Processed;
use ferrum_loader::{GgufFile, TensorStore};
use serde_json::Value as Json;

use super::{
    attend_spans, find, host_f32, matrix, token_at, usize_at, weight_from, ImageTokens, SpanCache,
};

struct Block<B: Backend> {
    ln1: (Vec<f32>, Vec<f32>),
    ln2: (Vec<f32>, Vec<f32>),
    /// Q, K and V, each with its bias.
    qkv: [(B::Weight, B::Weight); 3],
    out: (B::Weight, B::Weight),
    fc1: (B::Weight, B::Weight),
    fc2: (B::Weight, B::Weight),
}

pub struct Gemma3Vision<B: Backend> {
    hidden: usize,
    heads: usize,
    intermediate: usize,
    eps: f32,
    patch: usize,
    /// Patches along each side of the (square) image.
    side: usize,
    pub(super) tokens_per_image: usize,
    pub(super) text_hidden: usize,
    patch_embed: (B::Weight, B::Weight),
    positions: B::Weight,
    blocks: Vec<Block<B>>,
    post_ln: (Vec<f32>, Vec<f32>),
    /// `1 + w` of `mm_soft_emb_norm`.
    soft_norm: B::Weight,
    /// `mm_input_projection_weight` transposed: `[text_hidden, hidden]`.
    projection: B::Weight,
}

/// A vision tower's sizes, from either kind of file.
pub(super) struct Dims {
    hidden: usize,
    heads: usize,
    intermediate: usize,
    layers: usize,
    image: usize,
    patch: usize,
    eps: f32,
    pub(super) tokens_per_image: usize,
    text_hidden: usize,
}

impl Dims {
    /// From a Hugging Face config.json (its `vision_config` and text width).
    pub(super) fn from_hf(config: &Json) -> Result<Dims> {
        let v = &config["vision_config"];
        match v.get("hidden_act").and_then(Json::as_str) {
            None | Some("gelu_pytorch_tanh") => {}
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "config.json: vision activation {other:?}"
                )))
            }
        }
        let text_hidden = config
            .get("text_config")
            .and_then(|t| t.get("hidden_size"))
            .and_then(Json::as_u64)
            .ok_or_else(|| Error::Weights("config.json: text_config.hidden_size".into()))?
            as usize;
        let image = usize_at(v, "image_size")?;
        let patch = usize_at(v, "patch_size")?;
        Ok(Dims {
            hidden: usize_at(v, "hidden_size")?,
            heads: usize_at(v, "num_attention_heads")?,
            intermediate: usize_at(v, "intermediate_size")?,
            layers: usize_at(v, "num_hidden_layers")?,
            image,
            patch,
            eps: v
                .get("layer_norm_eps")
                .and_then(Json::as_f64)
                .unwrap_or(1e-6) as f32,
            tokens_per_image: config
                .get("mm_tokens_per_image")
                .and_then(Json::as_u64)
                .unwrap_or(256) as usize,
            text_hidden,
        })
    }

    /// From llama.cpp's mmproj keys, for a language model of `text_hidden`.
    pub(super) fn from_gguf(mm: &GgufFile, text_hidden: usize) -> Result<Dims> {
        let key = |k: &str| mm.require_usize(&format!("clip.vision.{k}"));
        let image = key("image_size")?;
        let patch = key("patch_size")?;
        let side = image / patch.max(1);
        let scale = mm
            .get_u64("clip.vision.projector.scale_factor")
            .map_or(4, |v| v as usize)
            .max(1);
        let per_side = side / scale;
        Ok(Dims {
            hidden: key("embedding_length")?,
            heads: key("attention.head_count")?,
            intermediate: key("feed_forward_length")?,
            layers: key("block_count")?,
            image,
            patch,
            eps: mm
                .get_f64("clip.vision.attention.layer_norm_epsilon")
                .unwrap_or(1e-6) as f32,
            tokens_per_image: per_side * per_side,
            text_hidden,
        })
    }

    /// The bytes one image's pass allocates, all f32 (as `encode_one` allocates them): the
    /// pixels three times (processed, as patches, on the backend), the residual stream and
    /// its three companions, QKV, the MLP's rows, the scratch keys and values, the host's copy
    /// of the states; then the pooled rows through the norm and the projection.
    pub(super) fn activation_bytes(&self) -> u64 {
        let side = self.image / self.patch.max(1);
        let n = side * side;
        let (h, f, t) = (self.hidden, self.intermediate, self.tokens_per_image);
        let pixels = 3 * self.patch * self.patch;
        let per_patch = 3 * pixels + 4 * h + 3 * h + f + 2 * h + h;
        let pooled = t * (3 * h + 2 * self.text_hidden);
        4 * (n * per_patch + pooled) as u64
    }
}

/// llama.cpp's mmproj name of a tensor named as in transformers' SigLIP (below
/// `vision_model.`) or Gemma 3's projector.
fn gguf_name(rest: &str) -> String {
    if let Some(r) = rest.strip_prefix("encoder.layers.") {
        let (i, tail) = r.split_once('.').unwrap_or((r, ""));
        let (part, what) = tail.rsplit_once('.').unwrap_or((tail, ""));
        let part = match part {
            "layer_norm1" => "ln1",
            "layer_norm2" => "ln2",
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.out_proj" => "attn_out",
            "mlp.fc1" => "ffn_up",
            "mlp.fc2" => "ffn_down",
            other => other,
        };
        return format!("v.blk.{i}.{part}.{what}");
    }
    match rest {
        "embeddings.patch_embedding.weight" => "v.patch_embd.weight".into(),
        "embeddings.patch_embedding.bias" => "v.patch_embd.bias".into(),
        "embeddings.position_embedding.weight" => "v.position_embd.weight".into(),
        "post_layernorm.weight" => "v.post_ln.weight".into(),
        "post_layernorm.bias" => "v.post_ln.bias".into(),
        "mm_soft_emb_norm.weight" => "mm.soft_emb_norm.weight".into(),
        "mm_input_projection_weight" => "mm.input_projection.weight".into(),
        other => other.into(),
    }
}

impl<B: Backend> Gemma3Vision<B> {
    /// From a Hugging Face checkpoint (its config.json and tensors).
    pub fn load(config: &Json, store: &TensorStore, be: &B) -> Result<(Self, ImageTokens)> {
        let dims = Dims::from_hf(config)?;
        let placeholder = token_at(config, &["image_token_index", "image_token_id"])
            .ok_or_else(|| Error::Weights("config.json: image_token_index".into()))?;
        let tokens = ImageTokens {
            begin: token_at(config, &["boi_token_index", "boi_token_id"]),
            placeholder,
            end: token_at(config, &["eoi_token_index", "eoi_token_id"]),
            bidirectional: true,
            grid: None,
        };
        Ok((Self::build(dims, store, be, false)?, tokens))
    }

    /// From llama.cpp's `mmproj` GGUF (projector type `gemma3`), for a language model of
    /// `text_hidden` whose vocabulary gives the image tokens.
    pub fn load_gguf(
        mm: &GgufFile,
        text_hidden: usize,
        vocab: &[&str],
        be: &B,
    ) -> Result<(Self, ImageTokens)> {
        let dims = Dims::from_gguf(mm, text_hidden)?;
        let id = |t: &str| super::vocab_id(vocab, t);
        let placeholder = id("<image_soft_token>").ok_or_else(|| {
            Error::Weights("the model's vocabulary has no <image_soft_token>".into())
        })?;
        let tokens = ImageTokens {
            begin: id("<start_of_image>"),
            placeholder,
            end: id("<end_of_image>"),
            bidirectional: true,
            grid: None,
        };
        Ok((Self::build(dims, &mm.tensors(), be, true)?, tokens))
    }

    fn build(d: Dims, store: &TensorStore, be: &B, gguf: bool) -> Result<Self> {
        let Dims {
            hidden,
            heads,
            intermediate,
            layers,
            image,
            patch,
            eps,
            tokens_per_image,
            text_hidden,
        } = d;
        let side = image / patch.max(1);
        let per_side = (tokens_per_image as f64).sqrt().round() as usize;
        if hidden % heads.max(1) != 0
            || heads == 0
            || side == 0
            || per_side * per_side != tokens_per_image
            || per_side == 0
            || side % per_side != 0
        {
            return Err(Error::Weights(format!(
                "vision tower: a {side}x{side} patch grid cannot pool to {tokens_per_image} \
                 tokens (or {hidden} is not {heads} heads)"
            )));
        }
        let tower = |rest: &str| -> Vec<String> {
            if gguf {
                return vec![gguf_name(rest)];
            }
            [
                "vision_tower.vision_model.",
                "vision_tower.",
                "model.vision_tower.vision_model.",
                "model.vision_tower.",
            ]
            .iter()
            .map(|p| format!("{p}{rest}"))
            .collect()
        };
        let projector = |rest: &str| -> Vec<String> {
            if gguf {
                return vec![gguf_name(rest)];
            }
            ["multi_modal_projector.", "model.multi_modal_projector."]
                .iter()
                .map(|p| format!("{p}{rest}"))
                .collect()
        };
        let get = |names: Vec<String>, rows: usize, cols: usize| -> Result<B::Weight> {
            matrix(be, find(store, &names)?, rows, cols)
        };
        let vec = |names: Vec<String>, len: usize| -> Result<Vec<f32>> {
            host_f32(find(store, &names)?, len)
        };
        let linear = |pre: &str, rows: usize, cols: usize| -> Result<(B::Weight, B::Weight)> {
            Ok((
                get(tower(&format!("{pre}.weight")), rows, cols)?,
                get(tower(&format!("{pre}.bias")), 1, rows)?,
            ))
        };
        let ln = |pre: &str| -> Result<(Vec<f32>, Vec<f32>)> {
            Ok((
                vec(tower(&format!("{pre}.weight")), hidden)?,
                vec(tower(&format!("{pre}.bias")), hidden)?,
            ))
        };
        let blocks = (0..layers)
            .map(|i| {
                let p = format!("encoder.layers.{i}");
                Ok(Block {
                    ln1: ln(&format!("{p}.layer_norm1"))?,
                    ln2: ln(&format!("{p}.layer_norm2"))?,
                    qkv: [
                        linear(&format!("{p}.self_attn.q_proj"), hidden, hidden)?,
                        linear(&format!("{p}.self_attn.k_proj"), hidden, hidden)?,
                        linear(&format!("{p}.self_attn.v_proj"), hidden, hidden)?,
                    ],
                    out: linear(&format!("{p}.self_attn.out_proj"), hidden, hidden)?,
                    fc1: linear(&format!("{p}.mlp.fc1"), intermediate, hidden)?,
                    fc2: linear(&format!("{p}.mlp.fc2"), hidden, intermediate)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let soft = vec(projector("mm_soft_emb_norm.weight"), hidden)?;
        // Gemma's `1 + w` (llama.cpp's converter stores it added).
        let offset = if gguf { 0.0 } else { 1.0 };
        let soft: Vec<f32> = soft.iter().map(|w| offset + w).collect();
        let proj = vec(
            projector("mm_input_projection_weight"),
            hidden * text_hidden,
        )?;
        // Stored `[hidden, text_hidden]` and applied as `x · W`: its transpose is the
        // `[out, in]` weight a matmul takes.
        let mut proj_t = vec![0f32; proj.len()];
        for i in 0..hidden {
            for o in 0..text_hidden {
                proj_t[o * hidden + i] = proj[i * text_hidden + o];
            }
        }
        Ok(Gemma3Vision {
            hidden,
            heads,
            intermediate,
            eps,
            patch,
            side,
            tokens_per_image,
            text_hidden,
            patch_embed: linear("embeddings.patch_embedding", hidden, 3 * patch * patch)?,
            positions: get(
                tower("embeddings.position_embedding.weight"),
                side * side,
                hidden,
            )?,
            blocks,
            post_ln: ln("post_layernorm")?,
            soft_norm: weight_from(be, "mm_soft_emb_norm", vec![hidden], &soft)?,
            projection: weight_from(
                be,
                "mm_input_projection",
                vec![text_hidden, hidden],
                &proj_t,
            )?,
        })
    }

    /// Each `[3, H, W]` image of `processed` (the whole image, then any pan-and-scan crops)
    /// as `tokens_per_image` rows of the text width, concatenated.
    pub fn encode(&self, be: &B, processed: &Processed) -> Result<Vec<f32>> {
        let (p, side) = (self.patch, self.side);
        let size = side * p;
        if processed.shape.len() != 4 || processed.shape[1..] != [3, size, size] {
            return Err(Error::InvalidRequest(format!(
                "pixel values of shape {:?}, expected [n, 3, {size}, {size}]",
                processed.shape
            )));
        }
        let plane = size * size;
        let mut out =
            Vec::with_capacity(processed.shape[0] * self.tokens_per_image * self.text_hidden);
        for img in processed.values.chunks_exact(3 * plane) {
            // Patches in row-major grid order, each flattened as the convolution's kernel is
            // (channel, row, column).
            let mut patches = Vec::with_capacity(side * side * 3 * p * p);
            for gy in 0..side {
                for gx in 0..side {
                    for c in 0..3 {
                        for y in 0..p {
                            let at = c * plane + (gy * p + y) * size + gx * p;
                            patches.extend_from_slice(&img[at..at + p]);
                        }
                    }
                }
            }
            out.extend(self.encode_one(be, &patches)?);
        }
        Ok(out)
    }

    fn encode_one(&self, be: &B, patches: &[f32]) -> Result<Vec<f32>> {
        let (h, f, n) = (self.hidden, self.intermediate, self.side * self.side);
        let hd = h / self.heads;
        let pd = 3 * self.patch * self.patch;
        let hidden = Rows::dense(n, h);
        let mut input = be.alloc(n * pd);
        be.write(&mut input, 0, patches);
        let mut x = be.alloc(n * h);
        let mut y = be.alloc(n * h);
        let mut tmp = be.alloc(n * h);
        let mut qkv = be.alloc(n * 3 * h);
        let mut attn = be.alloc(n * h);
        let mut mlp = be.alloc(n * f);
        let whole = [(0, n)];
        let mut cache = SpanCache::new();
        be.matmul(
            &input,
            Rows::dense(n, pd),
            &self.patch_embed.0,
            Some(&self.patch_embed.1),
            &mut x,
            hidden,
        );
        let ids: Vec<u32> = (0..n as u32).collect();
        be.embed(&self.positions, &ids, &mut tmp, hidden);
        be.add_inplace(&mut x, hidden, &tmp, hidden);
        for b in &self.blocks {
            be.copy_rows(&x, hidden, &mut y, hidden);
            be.layer_norm(&mut y, hidden, &b.ln1.0, &b.ln1.1, self.eps);
            let parts: Vec<MatmulPart<B::Weight>> = b
                .qkv
                .iter()
                .enumerate()
                .map(|(i, (w, bias))| MatmulPart {
                    weight: w,
                    bias: Some(bias),
                    out: Rows::columns(n, 3 * h, i * h, h),
                })
                .collect();
            be.matmul_many(&y, hidden, &parts, &mut qkv);
            attend_spans(be, &qkv, n, self.heads, hd, &whole, &mut attn, &mut cache);
            be.matmul(&attn, hidden, &b.out.0, Some(&b.out.1), &mut tmp, hidden);
            be.add_inplace(&mut x, hidden, &tmp, hidden);
            be.copy_rows(&x, hidden, &mut y, hidden);
            be.layer_norm(&mut y, hidden, &b.ln2.0, &b.ln2.1, self.eps);
            let mv = Rows::dense(n, f);
            be.matmul(&y, hidden, &b.fc1.0, Some(&b.fc1.1), &mut mlp, mv);
            be.gelu_tanh(&mut mlp, mv);
            be.matmul(&mlp, mv, &b.fc2.0, Some(&b.fc2.1), &mut tmp, hidden);
            be.add_inplace(&mut x, hidden, &tmp, hidden);
        }
        be.layer_norm(&mut x, hidden, &self.post_ln.0, &self.post_ln.1, self.eps);
        be.sync()?;
        // Average pooling of the patch grid, on the host (once an image), in PyTorch's order
        // of additions (window rows, then columns) and its one division.
        let mut states = vec![0f32; n * h];
        be.read(&x, 0, &mut states);
        let per_side = (self.tokens_per_image as f64).sqrt().round() as usize;
        let k = self.side / per_side;
        let t = self.tokens_per_image;
        let mut pooled = vec![0f32; t * h];
        for ty in 0..per_side {
            for tx in 0..per_side {
                let dst = &mut pooled[(ty * per_side + tx) * h..][..h];
                for ky in 0..k {
                    for kx in 0..k {
                        let src = &states[((ty * k + ky) * self.side + tx * k + kx) * h..][..h];
                        dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
                    }
                }
                let div = (k * k) as f32;
                dst.iter_mut().for_each(|d| *d /= div);
            }
        }
        let tv = Rows::dense(t, h);
        let mut pb = be.alloc(t * h);
        be.write(&mut pb, 0, &pooled);
        let mut normed = be.alloc(t * h);
        be.rms_norm(&pb, tv, &self.soft_norm, self.eps, &mut normed, tv);
        let mut rows = be.alloc(t * self.text_hidden);
        let ov = Rows::dense(t, self.text_hidden);
        be.matmul(&normed, tv, &self.projection, None, &mut rows, ov);
        be.sync()?;
        let mut host = vec![0f32; t * self.text_hidden];
        be.read(&rows, 0, &mut host);
        Ok(host)
    }
}
