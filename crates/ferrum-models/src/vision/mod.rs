//! Vision towers (issue 45): what turns a processed image ([`ferrum_image::Processed`]) into
//! rows of the language model's embedding width, and how those rows sit in the prompt. One
//! file a family: `gemma3.rs` (SigLIP, average pooling, Gemma 3's projector), `qwen25vl.rs`
//! (Qwen2.5-VL's windowed ViT with 2D rotary positions and its patch merger), `qwen3vl.rs`
//! (Qwen3-VL and Qwen3.5, DeepStack), `mistral3.rs` (Mistral 3's Pixtral and its projector).
//!
//! A tower runs on the language model's backend, whole images a pass: patch embedding as a
//! matmul over the flattened patches, pre-LayerNorm blocks with attention over every patch
//! (the encoders' trick: each query row a one-row sequence at the last position of a scratch
//! KV cache), then the family's projector. The decoder splices the rows in place of the
//! image's placeholder tokens ([`crate::decoder::Embeds`]).

pub mod gemma3;
pub mod mistral3;
pub mod qwen25vl;
pub mod qwen3vl;

use ferrum_backend::{
    Activation, AttentionParams, AttnSeq, Backend, KvShape, KvTable, MatmulPart, RopeLayout,
    RopeParams, Rows,
};
use ferrum_core::{DType, Error, Result};
use ferrum_image::{Processed, Processor};
use std::path::Path;

use ferrum_loader::{GgufFile, ModelFile, RawTensor, TensorStore};
use serde_json::Value as Json;

/// How an image's rows sit in the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageTokens {
    /// Opens each image (Gemma 3's `<start_of_image>`).
    pub begin: Option<u32>,
    /// The placeholder each image row replaces (`<image_soft_token>`).
    pub placeholder: u32,
    /// Closes each image (`<end_of_image>`).
    pub end: Option<u32>,
    /// Whether an image's rows attend to each other both ways (Gemma 3).
    pub bidirectional: bool,
    /// `(row break, image end)` where the placeholders lie as the image's grid, each row
    /// closed by the break and the last by the end, both part of the image's span (Mistral
    /// 3's `[IMG_BREAK]` and `[IMG_END]`: the tower gives their rows too).
    pub grid: Option<(u32, u32)>,
}

/// An image's rows from [`Vision::encode`] and its grid from [`Vision::grid`].
pub type EncodedImage = (Vec<f32>, Option<(usize, usize)>);

/// A vision tower with its processor and prompt layout.
pub struct Vision<B: Backend> {
    pub processor: Processor,
    pub tokens: ImageTokens,
    tower: Tower<B>,
}

enum Tower<B: Backend> {
    Gemma3(gemma3::Gemma3Vision<B>),
    Qwen25(qwen25vl::Qwen25Vision<B>),
    Qwen3(qwen3vl::Qwen3Vision<B>),
    Mistral3(mistral3::Mistral3Vision<B>),
}

/// What a chat template writes for an image (`marker`) and what each image's marker becomes
/// before the prompt is tokenized, as the model's Hugging Face processor expands it: Gemma 3's
/// `<start_of_image>` its fixed block of soft tokens between blank lines, Qwen VL's
/// `<|image_pad|>` one placeholder per merged patch of that image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageText {
    pub marker: String,
    before: String,
    placeholder: String,
    after: String,
    /// Every image's rows (Gemma 3); `None`: its grid's merged units (`merge²` patches each).
    fixed: Option<usize>,
    merge: usize,
    /// Mistral 3: the row break's and the end's text, and the pixels of a unit's side; the
    /// image is a row of placeholders per row of units, each closed by the break, the last
    /// by the end.
    rows_of: Option<(String, String, usize)>,
}

impl ImageText {
    /// The rows (placeholders) the processed image `p` takes.
    pub fn rows(&self, p: &Processed) -> usize {
        if let Some((lh, lw)) = self.units(p) {
            return lh * (lw + 1);
        }
        match (self.fixed, p.grid) {
            (Some(n), _) => n,
            (None, Some([t, h, w])) => t * h * w / (self.merge * self.merge).max(1),
            (None, None) => 0,
        }
    }

    /// Mistral 3: the image's rows and columns of units.
    fn units(&self, p: &Processed) -> Option<(usize, usize)> {
        let (_, _, unit) = self.rows_of.as_ref()?;
        mistral3::grid_units(p, *unit)
    }

    /// The text `p`'s marker becomes.
    pub fn expansion(&self, p: &Processed) -> String {
        if let (Some((lh, lw)), Some((brk, end, _))) = (self.units(p), &self.rows_of) {
            return mistral3::grid_layout(lh, lw, self.placeholder.as_str(), brk, end).concat();
        }
        format!(
            "{}{}{}",
            self.before,
            self.placeholder.repeat(self.rows(p)),
            self.after
        )
    }

    /// [`Self::expansion`] of each image, in order.
    pub fn expansions(&self, images: &[Processed]) -> Vec<String> {
        images.iter().map(|p| self.expansion(p)).collect()
    }
}

impl<B: Backend> Vision<B> {
    /// The vision tower of a Hugging Face checkpoint that has one (`vision_config` in its
    /// config.json and a `preprocessor_config.json` beside it), or of a GGUF model with
    /// llama.cpp's `mmproj` file (`mmproj`, or the one beside it); `None` for a text model.
    pub fn load(file: &ModelFile, mmproj: Option<&Path>, be: &B) -> Result<Option<Vision<B>>> {
        let h = match file {
            ModelFile::Hf(h) => h,
            ModelFile::Gguf(g) => return Self::load_gguf(g, mmproj, be),
        };
        if h.config.get("vision_config").is_none_or(Json::is_null) {
            return Ok(None);
        }
        let model_type = h.config.get("model_type").and_then(Json::as_str);
        if !matches!(model_type, Some("gemma3" | "qwen2_5_vl" | "mistral3"))
            && !model_type.is_some_and(qwen3_tower)
        {
            // A tower of a family not built here (Gemma 4's): the checkpoint runs as the text
            // model it also is, and images to it are refused.
            return Ok(None);
        }
        let mut processor = read_processor(&h.dir)?;
        let store = file.tensors();
        let (tower, tokens) = if model_type == Some("mistral3") {
            let tokens = mistral3_tokens(&h.config, &h.dir)?;
            let t = mistral3::Mistral3Vision::load(&h.config, &store, &tokens, be)?;
            // PixtralProcessor resizes to whole merged units, whatever the image
            // processor's own patch size.
            processor = processor.with_unit(t.unit());
            (Tower::Mistral3(t), tokens)
        } else if model_type == Some("qwen2_5_vl") {
            let (t, tokens) = qwen25vl::Qwen25Vision::load(&h.config, &store, be)?;
            (Tower::Qwen25(t), tokens)
        } else if model_type.is_some_and(qwen3_tower) {
            let (t, tokens) = qwen3vl::Qwen3Vision::load(&h.config, &store, be)?;
            (Tower::Qwen3(t), tokens)
        } else {
            let (t, tokens) = gemma3::Gemma3Vision::load(&h.config, &store, be)?;
            (Tower::Gemma3(t), tokens)
        };
        Ok(Some(Vision {
            processor,
            tokens,
            tower,
        }))
    }

    fn load_gguf(lm: &GgufFile, mmproj: Option<&Path>, be: &B) -> Result<Option<Vision<B>>> {
        let Some((path, explicit)) = mmproj_of(lm, mmproj) else {
            return Ok(None);
        };
        if !explicit {
            // One that is not this model's after all (one its vocabulary cannot place) is
            // left: the model runs as the text model it also is.
            return Ok(Self::load_mmproj(lm, &path, false, be).ok().flatten());
        }
        Self::load_mmproj(lm, &path, true, be)
    }

    fn load_mmproj(
        lm: &GgufFile,
        path: &Path,
        explicit: bool,
        be: &B,
    ) -> Result<Option<Vision<B>>> {
        let Some(mm) = open_mmproj(path, explicit)? else {
            return Ok(None);
        };
        let text_hidden = text_width(lm)?;
        let vocab = lm
            .get_str_array("tokenizer.ggml.tokens")
            .unwrap_or_default();
        let triple = |k: &str| -> Result<[f32; 3]> {
            match mm.get_f32_array(k).as_deref() {
                Some(&[a, b, c]) => Ok([a, b, c]),
                None => Ok([0.5; 3]),
                Some(_) => Err(Error::Weights(format!(
                    "{}: {k} is not 3 values",
                    path.display()
                ))),
            }
        };
        let norm = ferrum_image::processor::Normalize {
            rescale: Some(1.0 / 255.0),
            mean_std: Some((
                triple("clip.vision.image_mean")?,
                triple("clip.vision.image_std")?,
            )),
        };
        let kind = projector_kind(&mm);
        if kind == PIXTRAL_PROJECTOR {
            let tokens = mistral3::tokens_from_vocab(|t| vocab_id(&vocab, t))?;
            let tower = mistral3::Mistral3Vision::load_gguf(&mm, lm, text_hidden, &tokens, be)?;
            let unit = tower.unit();
            let processor = Processor::Pixtral {
                unit,
                fit: pixtral_gguf_fit(unit),
                filter: ferrum_image::Filter::Bicubic,
                norm,
            };
            return Ok(Some(Vision {
                processor,
                tokens,
                tower: Tower::Mistral3(tower),
            }));
        }
        if kind == QWEN25_PROJECTOR || kind == QWEN3_PROJECTOR {
            let (tower, tokens) = if kind == QWEN3_PROJECTOR {
                let (t, tokens) = qwen3vl::Qwen3Vision::load_gguf(&mm, text_hidden, &vocab, be)?;
                (Tower::Qwen3(t), tokens)
            } else {
                let (t, tokens) = qwen25vl::Qwen25Vision::load_gguf(&mm, text_hidden, &vocab, be)?;
                (Tower::Qwen25(t), tokens)
            };
            let patch = mm.require_usize("clip.vision.patch_size")?;
            let merge = mm
                .get_u64("clip.vision.spatial_merge_size")
                .map_or(2, |v| v as usize);
            let unit = (patch * merge).pow(2);
            // llama.cpp's limits for the Qwen VL line: 8 to 4096 image tokens.
            let processor = Processor::QwenVl {
                patch,
                temporal: 2,
                merge,
                min_pixels: 8 * unit,
                max_pixels: 4096 * unit,
                filter: ferrum_image::Filter::Bicubic,
                norm,
            };
            return Ok(Some(Vision {
                processor,
                tokens,
                tower,
            }));
        }
        let (tower, tokens) = gemma3::Gemma3Vision::load_gguf(&mm, text_hidden, &vocab, be)?;
        let size = mm.require_usize("clip.vision.image_size")?;
        let processor = Processor::Gemma3 {
            height: size,
            width: size,
            filter: ferrum_image::Filter::Bilinear,
            norm: ferrum_image::processor::Normalize {
                rescale: Some(1.0 / 255.0),
                mean_std: Some((
                    triple("clip.vision.image_mean")?,
                    triple("clip.vision.image_std")?,
                )),
            },
            pan_and_scan: None,
        };
        Ok(Some(Vision {
            processor,
            tokens,
            tower: Tower::Gemma3(tower),
        }))
    }

    /// The most rows one image takes.
    pub fn max_rows(&self) -> usize {
        match (&self.tower, &self.processor) {
            (Tower::Gemma3(t), _) => t.tokens_per_image,
            (
                Tower::Qwen25(_) | Tower::Qwen3(_),
                Processor::QwenVl {
                    patch,
                    merge,
                    max_pixels,
                    ..
                },
            ) => max_pixels / (patch * merge).pow(2).max(1),
            (Tower::Qwen25(_) | Tower::Qwen3(_), _) => 0,
            (Tower::Mistral3(_), Processor::Pixtral { unit, fit, .. }) => fit.max_units(*unit).1,
            (Tower::Mistral3(_), _) => 0,
        }
    }

    /// The language model's grid of the image's rows where its rows take M-RoPE positions
    /// (Qwen VL: merged units, rows and columns); `None` for other families.
    pub fn grid(&self, p: &Processed) -> Option<(usize, usize)> {
        match &self.tower {
            Tower::Gemma3(_) | Tower::Mistral3(_) => None,
            Tower::Qwen25(t) => t.grid(p),
            Tower::Qwen3(t) => t.grid(p),
        }
    }

    /// The rows (placeholders) the processed image `p` takes: Gemma 3's fixed count for the
    /// image and each pan-and-scan crop, Qwen VL's merged units.
    pub fn rows(&self, p: &Processed) -> usize {
        match &self.tower {
            Tower::Gemma3(t) => t.tokens_per_image * p.shape.first().copied().unwrap_or(1),
            Tower::Qwen25(t) => t.grid(p).map_or(0, |(h, w)| h * w),
            Tower::Qwen3(t) => t.grid(p).map_or(0, |(h, w)| h * w),
            Tower::Mistral3(t) => t.rows(p),
        }
    }

    /// The ids an image `p` takes in a prompt: its opening token, its rows' placeholders
    /// (Mistral 3's as its grid: rows closed by the break, the last by the end) and its
    /// closing token, where the family has them.
    pub fn image_ids(&self, p: &Processed) -> Vec<u32> {
        let t = &self.tokens;
        let mut ids: Vec<u32> = t.begin.into_iter().collect();
        match (&self.tower, t.grid) {
            (Tower::Mistral3(m), Some((brk, end))) => {
                if let Ok((lh, lw)) = m.units(p) {
                    ids.extend(mistral3::grid_layout(lh, lw, t.placeholder, brk, end));
                }
            }
            _ => ids.extend(std::iter::repeat_n(t.placeholder, self.rows(p))),
        }
        ids.extend(t.end);
        ids
    }

    /// Runs of placeholder tokens in `ids`: each image's `(first row, rows)`.
    pub fn spans(&self, ids: &[u32]) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        if let Some((brk, end)) = self.tokens.grid {
            // An image from its first placeholder through its end token. A run that other text
            // or the sequence's end cuts short is not one: the tokens stay text (a placeholder
            // the model itself generated, say).
            let mut open: Option<usize> = None;
            for (i, &t) in ids.iter().enumerate() {
                if t == self.tokens.placeholder || t == brk {
                    if open.is_none() && t == self.tokens.placeholder {
                        open = Some(i);
                    }
                } else if let Some(s) = open.take() {
                    if t == end {
                        out.push((s, i + 1 - s));
                    }
                }
            }
            return out;
        }
        let per = self.max_rows();
        for (i, &t) in ids.iter().enumerate() {
            if t != self.tokens.placeholder {
                continue;
            }
            match out.last_mut() {
                // Consecutive placeholders belong to one image until it has its rows (two
                // images with no token between them are two runs of `per`).
                Some((start, len)) if *start + *len == i && *len < per => *len += 1,
                _ => out.push((i, 1)),
            }
        }
        out
    }

    /// [`Self::spans`], one for each of `images` images: an error naming both counts when
    /// they differ.
    pub fn place(&self, prompt: &[u32], images: usize) -> Result<Vec<(usize, usize)>> {
        let spans = self.spans(prompt);
        if spans.len() != images {
            return Err(Error::InvalidRequest(format!(
                "{images} images for {} image placeholders in the prompt",
                spans.len()
            )));
        }
        Ok(spans)
    }

    /// Checks that an image's `rows` (of `width` values each: the model's width, times one
    /// plus [`Self::deep_layers`]) fill its `len` placeholders.
    pub fn check_rows(rows: &[f32], len: usize, width: usize) -> Result<()> {
        if rows.len() != len * width {
            return Err(Error::InvalidRequest(format!(
                "an image of {} rows for {len} placeholders",
                rows.len() / width.max(1)
            )));
        }
        Ok(())
    }

    /// How many DeepStack rows follow each image row in [`Self::encode`]'s output, each added
    /// to the row's residual stream after one of the language model's first layers
    /// (Qwen3-VL); 0 for other families.
    pub fn deep_layers(&self) -> usize {
        match &self.tower {
            Tower::Gemma3(_) | Tower::Qwen25(_) | Tower::Mistral3(_) => 0,
            Tower::Qwen3(t) => t.deep_layers(),
        }
    }

    /// The text a chat template writes for an image and what it becomes before the prompt
    /// is tokenized, given each token's text: Gemma 3's processor turns `<start_of_image>`
    /// into the image's whole sequence with a blank line either side; Qwen VL's turns the
    /// `<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>` into one a row.
    /// `None` where a token has no text.
    pub fn prompt_texts(&self, text: impl Fn(u32) -> Option<String>) -> Option<ImageText> {
        let t = &self.tokens;
        let placeholder = text(t.placeholder)?;
        match &self.tower {
            Tower::Gemma3(g) => {
                let begin = text(t.begin?)?;
                let end = t.end.map_or(Some(String::new()), &text)?;
                Some(ImageText {
                    marker: begin.clone(),
                    before: format!("\n\n{begin}"),
                    placeholder,
                    after: format!("{end}\n\n"),
                    fixed: Some(g.tokens_per_image),
                    merge: 1,
                    rows_of: None,
                })
            }
            Tower::Qwen25(_) | Tower::Qwen3(_) => Some(ImageText {
                marker: placeholder.clone(),
                before: String::new(),
                placeholder,
                after: String::new(),
                fixed: None,
                merge: match self.processor {
                    Processor::QwenVl { merge, .. } => merge,
                    Processor::Gemma3 { .. } | Processor::Pixtral { .. } => 1,
                },
                rows_of: None,
            }),
            Tower::Mistral3(m) => {
                let (brk, end) = t.grid?;
                Some(ImageText {
                    marker: placeholder.clone(),
                    before: String::new(),
                    placeholder,
                    after: String::new(),
                    fixed: None,
                    merge: 1,
                    rows_of: Some((text(brk)?, text(end)?, m.unit())),
                })
            }
        }
    }

    /// The image's rows for the language model, `[rows, text width]` row-major.
    pub fn encode(&self, be: &B, processed: &Processed) -> Result<Vec<f32>> {
        match &self.tower {
            Tower::Gemma3(t) => t.encode(be, processed),
            Tower::Qwen25(t) => t.encode(be, processed),
            Tower::Qwen3(t) => t.encode(be, processed),
            Tower::Mistral3(t) => t.encode(be, processed),
        }
    }
}

/// A vision config's size `k`.
fn usize_at(j: &Json, k: &str) -> Result<usize> {
    j.get(k)
        .and_then(Json::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| Error::Weights(format!("config.json: vision {k} is missing")))
}

/// The first of the config's keys `keys` that gives a token id.
fn token_at(j: &Json, keys: &[&str]) -> Option<u32> {
    keys.iter()
        .find_map(|k| j.get(*k).and_then(Json::as_u64))
        .map(|v| v as u32)
}

/// The Qwen VL line's image tokens from a checkpoint's config.json: causal rows between
/// `vision_start` and `vision_end`.
fn qwen_tokens(config: &Json) -> Result<ImageTokens> {
    let placeholder = token_at(config, &["image_token_id"])
        .ok_or_else(|| Error::Weights("config.json: image_token_id".into()))?;
    Ok(ImageTokens {
        begin: token_at(config, &["vision_start_token_id"]),
        placeholder,
        end: token_at(config, &["vision_end_token_id"]),
        bidirectional: false,
        grid: None,
    })
}

/// Mistral 3's image tokens: `[IMG]`, `[IMG_BREAK]` and `[IMG_END]` from the checkpoint's
/// tokenizer.json (its vocabulary, then its added tokens); where it has none, the config's
/// `image_token_index` and the ids Mistral's tekken vocabulary gives the other two (12, 13).
fn mistral3_tokens(config: &Json, dir: &Path) -> Result<ImageTokens> {
    let tok: Option<Json> = std::fs::read(dir.join("tokenizer.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if let Some(tok) = tok {
        return mistral3::tokens_from_vocab(|t| crate::config::hf_vocab_id(&tok, t));
    }
    let placeholder = token_at(config, &["image_token_index", "image_token_id"]).unwrap_or(10);
    Ok(ImageTokens {
        begin: None,
        placeholder,
        end: None,
        bidirectional: false,
        grid: Some((12, 13)),
    })
}

/// Whether a checkpoint of this `model_type` has Qwen3-VL's tower: Qwen3-VL and its MoE,
/// and Qwen3.5 and its MoE (Qwen3-VL's tower without DeepStack).
fn qwen3_tower(model_type: &str) -> bool {
    matches!(
        model_type,
        "qwen3_vl" | "qwen3_vl_moe" | "qwen3_5" | "qwen3_5_moe"
    )
}

/// The id of the token `t` in a GGUF model's vocabulary.
fn vocab_id(vocab: &[&str], t: &str) -> Option<u32> {
    vocab.iter().position(|v| *v == t).map(|i| i as u32)
}

/// The Qwen VL line's image tokens from a GGUF model's vocabulary, by the tokens' text.
fn qwen_tokens_gguf(vocab: &[&str]) -> Result<ImageTokens> {
    let id = |t: &str| vocab_id(vocab, t);
    let placeholder = id("<|image_pad|>")
        .ok_or_else(|| Error::Weights("the model's vocabulary has no <|image_pad|>".into()))?;
    Ok(ImageTokens {
        begin: id("<|vision_start|>"),
        placeholder,
        end: id("<|vision_end|>"),
        bidirectional: false,
        grid: None,
    })
}

/// A Qwen VL tower's plan for images of up to `patches` patches: its images are cut like
/// text, so a pass holds none whole.
fn qwen_plan(file_bytes: u64, patches: usize, merge: usize, activation_bytes: u64) -> VisionPlan {
    VisionPlan {
        file_bytes,
        activation_bytes,
        max_rows: patches / (merge * merge).max(1),
        pass_rows: 0,
    }
}

/// llama.cpp's sizing of images for a `pixtral` mmproj whose merged units are `unit` pixels
/// a side: 8 to 1024 image tokens.
fn pixtral_gguf_fit(unit: usize) -> ferrum_image::PixtralFit {
    ferrum_image::PixtralFit::Pixels {
        min: 8 * unit * unit,
        max: 1024 * unit * unit,
    }
}

/// A Mistral 3 tower's plan for images of up to `(units, rows)` (`PixtralFit::max_units`):
/// like the Qwen VL line's, its images are cut like text.
fn mistral3_plan(file_bytes: u64, (units, rows): (usize, usize), d: &mistral3::Dims) -> VisionPlan {
    let patches = units * d.merge * d.merge;
    VisionPlan {
        file_bytes,
        activation_bytes: d.activation_bytes(patches),
        max_rows: rows,
        pass_rows: 0,
    }
}

/// The image processor of a Hugging Face checkpoint with a vision tower.
fn read_processor(dir: &Path) -> Result<Processor> {
    let pre = dir.join("preprocessor_config.json");
    let pj: Json = match std::fs::read(&pre) {
        Ok(b) => serde_json::from_slice(&b)
            .map_err(|e| Error::Weights(format!("{}: {e}", pre.display())))?,
        Err(_) => {
            return Err(Error::Weights(format!(
                "{}: the checkpoint has a vision tower but no preprocessor_config.json",
                dir.display()
            )))
        }
    };
    Processor::from_json(&pj).map_err(Error::Weights)
}

/// The mmproj file a GGUF language model goes with, and whether it was named: `mmproj`,
/// or the one beside the model where the model is of a family that takes one (a file found
/// beside another family's model is not its).
fn mmproj_of(lm: &GgufFile, mmproj: Option<&Path>) -> Option<(std::path::PathBuf, bool)> {
    if let Some(p) = mmproj {
        return Some((p.to_path_buf(), true));
    }
    matches!(
        lm.architecture().unwrap_or(""),
        "gemma3"
            | "qwen2vl"
            | "qwen3vl"
            | "qwen3vlmoe"
            | "qwen35"
            | "qwen35moe"
            | "mistral3"
            | "llama"
    )
    .then(|| beside(&lm.path))
    .flatten()
    .map(|p| (p, false))
}

/// The mmproj file at `path` where its projector is one built here; another family's is
/// `None` when the file was found beside the model (which then runs as the text model it also
/// is) and an error when it was named.
fn open_mmproj(path: &Path, explicit: bool) -> Result<Option<GgufFile>> {
    let mm = GgufFile::open(path)?;
    let kind = projector_kind(&mm).to_string();
    if kind == "gemma3"
        || kind == QWEN25_PROJECTOR
        || kind == QWEN3_PROJECTOR
        || kind == PIXTRAL_PROJECTOR
    {
        return Ok(Some(mm));
    }
    if !explicit {
        return Ok(None);
    }
    Err(Error::Unsupported(format!(
        "{}: vision projector {kind:?} (supported: gemma3, {QWEN25_PROJECTOR}, {QWEN3_PROJECTOR}, \
         {PIXTRAL_PROJECTOR})",
        path.display()
    )))
}

/// llama.cpp's names of Qwen2.5-VL's and Qwen3-VL's projectors.
const QWEN25_PROJECTOR: &str = "qwen2.5vl_merger";
const QWEN3_PROJECTOR: &str = "qwen3vl_merger";
/// llama.cpp's name of Mistral 3's (Pixtral with the patch merger).
const PIXTRAL_PROJECTOR: &str = "pixtral";

fn projector_kind(mm: &GgufFile) -> &str {
    mm.get_str("clip.projector_type")
        .or_else(|| mm.get_str("clip.vision.projector_type"))
        .unwrap_or("")
}

/// The language model's width, which the projector's rows must have.
fn text_width(lm: &GgufFile) -> Result<usize> {
    let arch = lm.architecture()?;
    lm.require_usize(&format!("{arch}.embedding_length"))
}

/// What a model's vision tower adds to its memory, read from the headers (`ferrum plan`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionPlan {
    /// The mmproj file's bytes (0 where the tower is in the model's own files, which
    /// already count it).
    pub file_bytes: u64,
    /// One image's pass through the tower.
    pub activation_bytes: u64,
    /// The most rows one image takes in the language model's pass.
    pub max_rows: usize,
    /// Rows a pass holds besides a chunk: a whole image where its rows attend both ways
    /// (Gemma 3, `Decoder::set_pass_capacity`); 0 where the image is cut like text (Qwen VL).
    pub pass_rows: usize,
}

/// The vision tower [`Vision::load`] would load for `file` (and `mmproj`), sized from the
/// headers alone; `None` for a text model.
pub fn plan(file: &ModelFile, mmproj: Option<&Path>) -> Result<Option<VisionPlan>> {
    let (dims, file_bytes) = match file {
        ModelFile::Hf(h) => {
            if h.config.get("vision_config").is_none_or(Json::is_null) {
                return Ok(None);
            }
            match h.config.get("model_type").and_then(Json::as_str) {
                Some("gemma3") => {}
                Some("mistral3") => {
                    let Processor::Pixtral { fit, .. } = read_processor(&h.dir)? else {
                        return Err(Error::Weights(
                            "a Mistral 3 checkpoint with another family's processor".into(),
                        ));
                    };
                    let d = mistral3::Dims::from_hf(&h.config)?;
                    return Ok(Some(mistral3_plan(0, fit.max_units(d.patch * d.merge), &d)));
                }
                Some(t) if t == "qwen2_5_vl" || qwen3_tower(t) => {
                    let Processor::QwenVl {
                        patch, max_pixels, ..
                    } = read_processor(&h.dir)?
                    else {
                        return Err(Error::Weights(
                            "a Qwen VL checkpoint with another family's processor".into(),
                        ));
                    };
                    let patches = max_pixels / (patch * patch).max(1);
                    return Ok(Some(if t == "qwen2_5_vl" {
                        let d = qwen25vl::Dims::from_hf(&h.config)?;
                        qwen_plan(0, patches, d.merge, d.activation_bytes(patches))
                    } else {
                        let d = qwen3vl::Dims::from_hf(&h.config)?;
                        qwen_plan(0, patches, d.merge, d.activation_bytes(patches))
                    }));
                }
                // Loaded as a text model (see `Vision::load`).
                _ => return Ok(None),
            }
            (gemma3::Dims::from_hf(&h.config)?, 0)
        }
        ModelFile::Gguf(lm) => {
            let Some((path, explicit)) = mmproj_of(lm, mmproj) else {
                return Ok(None);
            };
            let Some(mm) = open_mmproj(&path, explicit)? else {
                return Ok(None);
            };
            let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
            // llama.cpp's limit for the Qwen VL line: 4096 image tokens.
            let kind = projector_kind(&mm);
            if kind == QWEN25_PROJECTOR {
                let d = qwen25vl::Dims::from_gguf(&mm, text_width(lm)?)?;
                let patches = 4096 * d.merge * d.merge;
                return Ok(Some(qwen_plan(
                    bytes,
                    patches,
                    d.merge,
                    d.activation_bytes(patches),
                )));
            }
            if kind == PIXTRAL_PROJECTOR {
                let d = mistral3::Dims::from_gguf(&mm, text_width(lm)?)?;
                let u = d.patch * d.merge;
                let units = pixtral_gguf_fit(u).max_units(u);
                return Ok(Some(mistral3_plan(bytes, units, &d)));
            }
            if kind == QWEN3_PROJECTOR {
                let d = qwen3vl::Dims::from_gguf(&mm, text_width(lm)?)?;
                let patches = 4096 * d.merge * d.merge;
                return Ok(Some(qwen_plan(
                    bytes,
                    patches,
                    d.merge,
                    d.activation_bytes(patches),
                )));
            }
            (gemma3::Dims::from_gguf(&mm, text_width(lm)?)?, bytes)
        }
    };
    Ok(Some(VisionPlan {
        file_bytes,
        activation_bytes: dims.activation_bytes(),
        max_rows: dims.tokens_per_image,
        pass_rows: dims.tokens_per_image,
    }))
}

/// The one `*mmproj*.gguf` in the folder of the model at `model` (llama.cpp's and Ollama's
/// downloads keep it there); `None` when there is none or several.
fn beside(model: &Path) -> Option<std::path::PathBuf> {
    // A bare file name's folder is the current one (its parent is the empty path).
    let dir = model
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut found = std::fs::read_dir(dir).ok()?.flatten().filter_map(|e| {
        let name = e.file_name().to_string_lossy().to_lowercase();
        (name.contains("mmproj") && name.ends_with(".gguf")).then(|| e.path())
    });
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// The first of `candidates` (full tensor names) the store has.
fn find<'a>(store: &'a TensorStore, candidates: &[String]) -> Result<&'a RawTensor> {
    candidates
        .iter()
        .find_map(|n| store.get(n))
        .ok_or_else(|| Error::Weights(format!("missing tensor {:?}", candidates[0])))
}

/// A tensor as f32 host values, checked to hold `len`.
fn host_f32(t: &RawTensor, len: usize) -> Result<Vec<f32>> {
    if t.numel() != len {
        return Err(Error::Weights(format!(
            "tensor {:?} has shape {:?}, expected {len} values",
            t.name, t.shape
        )));
    }
    let mut v = vec![0f32; len];
    if !ferrum_backend::cpu::quant::dequantize(t.dtype, t.bytes(), &mut v) {
        return Err(Error::Weights(format!(
            "tensor {:?}: cannot convert",
            t.name
        )));
    }
    Ok(v)
}

/// Host values as an f32 weight of `shape` on the backend (`[len]` for a vector: a bias or
/// a norm's weight). A tower's matrices are multiplied over whole images only, so they load
/// as an encoder's ([`Backend::load_weight_encoder`]), here and in [`matrix`].
fn weight_from<B: Backend>(be: &B, name: &str, shape: Vec<usize>, v: &[f32]) -> Result<B::Weight> {
    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let t = RawTensor::from_bytes(name, DType::F32, shape, bytes)
        .ok_or_else(|| Error::Weights(format!("tensor {name:?}: bad size")))?;
    be.load_weight_encoder(&t)
}

/// A tensor of `rows × cols` values (whatever its dimensions: a convolution's kernel seen as
/// one row per output channel) as a `[rows, cols]` weight in its own format.
fn matrix<B: Backend>(be: &B, t: &RawTensor, rows: usize, cols: usize) -> Result<B::Weight> {
    if rows == 1 {
        // A vector (bias): kept as one, as the backends keep biases.
        return weight_from(be, &t.name, vec![cols], &host_f32(t, cols)?);
    }
    if t.numel() != rows * cols {
        return Err(Error::Weights(format!(
            "tensor {:?} has shape {:?}, expected [{rows}, {cols}]",
            t.name, t.shape
        )));
    }
    if t.shape == [rows, cols] {
        return be.load_weight_encoder(t);
    }
    let r = RawTensor::from_bytes(&t.name, t.dtype, vec![rows, cols], t.bytes().to_vec())
        .ok_or_else(|| Error::Weights(format!("tensor {:?}: bad size", t.name)))?;
    be.load_weight_encoder(&r)
}

/// A weight and its bias, where it has one.
pub(super) type Linear<B> = (<B as Backend>::Weight, Option<<B as Backend>::Weight>);

/// A ViT block of RMSNorms, attention with 2D rotary positions and a gated MLP: Qwen2.5-VL's
/// (every weight with a bias) and Pixtral's (none).
pub(super) struct RmsBlock<B: Backend> {
    pub norm1: B::Weight,
    pub norm2: B::Weight,
    /// Queries, keys and values, each `[hidden, hidden]`.
    pub qkv: [Linear<B>; 3],
    pub proj: Linear<B>,
    pub gate: Linear<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

/// A tower's activations over `n` patches of `h` values, `f` in the MLP: the residual stream
/// `x`, and what a block's steps write.
pub(super) struct TowerActs<B: Backend> {
    pub x: B::Buf,
    pub y: B::Buf,
    tmp: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    gu: B::Buf,
    act: B::Buf,
}

impl<B: Backend> TowerActs<B> {
    pub(super) fn new(be: &B, n: usize, h: usize, f: usize) -> Self {
        TowerActs {
            x: be.alloc(n * h),
            y: be.alloc(n * h),
            tmp: be.alloc(n * h),
            qkv: be.alloc(n * 3 * h),
            attn: be.alloc(n * h),
            gu: be.alloc(n * 2 * f),
            act: be.alloc(n * f),
        }
    }
}

/// How an [`RmsBlock`] runs: its norms' epsilon, heads, rotary positions (two a row: row and
/// column) with each rotated pair's frequency and axis, and its MLP's activation.
pub(super) struct BlockRun<'a> {
    pub eps: f32,
    pub heads: usize,
    pub head_dim: usize,
    pub rope_pos: &'a [u32],
    pub inv_freq: &'a [f32],
    pub pair_axis: &'a [u8],
    pub act: Activation,
}

impl<B: Backend> RmsBlock<B> {
    /// `x += attn(norm1(x))` within `spans`, then `x += mlp(norm2(x))`, over `n` rows.
    pub(super) fn run(
        &self,
        be: &B,
        a: &mut TowerActs<B>,
        n: usize,
        r: &BlockRun,
        spans: &[(usize, usize)],
        cache: &mut SpanCache<B>,
    ) {
        let h = r.heads * r.head_dim;
        let f = be.weight_shape(&self.gate.0).0;
        let hidden = Rows::dense(n, h);
        let rope = RopeParams {
            layout: RopeLayout::Neox,
            inv_freq: r.inv_freq,
            factor: 1.0,
        };
        be.rms_norm(&a.x, hidden, &self.norm1, r.eps, &mut a.y, hidden);
        let parts: Vec<MatmulPart<B::Weight>> = self
            .qkv
            .iter()
            .enumerate()
            .map(|(i, (w, bias))| MatmulPart {
                weight: w,
                bias: bias.as_ref(),
                out: Rows::columns(n, 3 * h, i * h, h),
            })
            .collect();
        be.matmul_many(&a.y, hidden, &parts, &mut a.qkv);
        for part in 0..2 {
            let view = Rows::columns(n, 3 * h, part * h, h).split_heads(r.head_dim);
            be.rope_axes(&mut a.qkv, view, r.rope_pos, 2, r.pair_axis, rope);
        }
        attend_spans(
            be,
            &a.qkv,
            n,
            r.heads,
            r.head_dim,
            spans,
            &mut a.attn,
            cache,
        );
        let (w, bias) = &self.proj;
        be.matmul(&a.attn, hidden, w, bias.as_ref(), &mut a.tmp, hidden);
        be.add_inplace(&mut a.x, hidden, &a.tmp, hidden);
        be.rms_norm(&a.x, hidden, &self.norm2, r.eps, &mut a.y, hidden);
        let gv = Rows::dense(n, 2 * f);
        let parts = [(&self.gate, 0), (&self.up, f)].map(|((w, bias), at)| MatmulPart {
            weight: w,
            bias: bias.as_ref(),
            out: Rows::columns(n, 2 * f, at, f),
        });
        be.matmul_many(&a.y, hidden, &parts, &mut a.gu);
        let av = Rows::dense(n, f);
        be.glu(&a.gu, gv, &mut a.act, av, r.act);
        let (w, bias) = &self.down;
        be.matmul(&a.act, av, w, bias.as_ref(), &mut a.tmp, hidden);
        be.add_inplace(&mut a.x, hidden, &a.tmp, hidden);
    }
}

/// Query rows attended together as the query heads of one KV head: the backend's kernels
/// read each key and value once for the group (as for grouped-query attention), and each
/// row's arithmetic is what it gets alone.
const ROW_GROUP: usize = 3;

/// Attention within each span of rows — every row of a span sees the whole span and nothing
/// else: an image's patches, or a window of them — by the backend's own kernel where it has
/// one ([`Backend::span_attention`]), else through its paged attention.
/// There, each span's keys and values go in blocks of their own in the scratch `cache` (at
/// least [`span_blocks`] of them, made at the first such call); each `ROW_GROUP` rows of a
/// span are one one-row sequence at the span's last position whose query heads are those
/// rows' heads, laid out head by head (`h · ROW_GROUP + g`) so that each KV head serves its
/// own heads of every row of the group.
#[allow(clippy::too_many_arguments)]
fn attend_spans<B: Backend>(
    be: &B,
    qkv: &B::Buf,
    n: usize,
    heads: usize,
    head_dim: usize,
    spans: &[(usize, usize)],
    out: &mut B::Buf,
    cache: &mut SpanCache<B>,
) {
    if be.span_attention(qkv, n, heads, head_dim, spans, out) {
        return;
    }
    let cache = cache.get(be, span_blocks(spans), heads, head_dim);
    const BLOCK: usize = SCRATCH_BLOCK;
    let w = heads * head_dim;
    let mut tables: Vec<Vec<u32>> = Vec::with_capacity(spans.len());
    let mut next = 0u32;
    for &(_, len) in spans {
        let count = len.div_ceil(BLOCK) as u32;
        tables.push((next..next + count).collect());
        next += count;
    }
    for (&(first, len), blocks) in spans.iter().zip(&tables) {
        let table = KvTable {
            blocks,
            block_size: BLOCK,
        };
        let k = Rows::columns(n, 3 * w, w, w).slice(first, len);
        let v = Rows::columns(n, 3 * w, 2 * w, w).slice(first, len);
        be.write_kv(qkv, k.split_heads(head_dim), &mut cache.0, table, 0);
        be.write_kv(qkv, v, &mut cache.1, table, 0);
    }
    // Each group's rows (the last group of a span filled out with its last row).
    let mut groups: Vec<([usize; ROW_GROUP], usize)> = Vec::new();
    for (si, &(first, len)) in spans.iter().enumerate() {
        for g in (0..len).step_by(ROW_GROUP) {
            let rows = std::array::from_fn(|i| first + (g + i).min(len - 1));
            groups.push((rows, si));
        }
    }
    let vn = groups.len();
    let gw = ROW_GROUP * w;
    let mut host = vec![0f32; n * 3 * w];
    be.read(qkv, 0, &mut host);
    let mut grouped = vec![0f32; vn * gw];
    for ((rows, _), dst) in groups.iter().zip(grouped.chunks_exact_mut(gw)) {
        for h in 0..heads {
            for (g, &r) in rows.iter().enumerate() {
                let src = &host[r * 3 * w + h * head_dim..][..head_dim];
                dst[(h * ROW_GROUP + g) * head_dim..][..head_dim].copy_from_slice(src);
            }
        }
    }
    let mut q = be.alloc(vn * gw);
    be.write(&mut q, 0, &grouped);
    let mut o = be.alloc(vn * gw);
    let seqs: Vec<AttnSeq> = groups
        .iter()
        .map(|&(_, si)| AttnSeq {
            rows: 1,
            first_pos: spans[si].1 - 1,
            table: KvTable {
                blocks: &tables[si],
                block_size: BLOCK,
            },
        })
        .collect();
    let params = AttentionParams {
        n_kv_heads: heads,
        scale: (head_dim as f32).powf(-0.5),
        window: None,
        softcap: None,
        sinks: None,
    };
    let view = Rows::dense(vn, gw).split_heads(head_dim);
    be.attention(&q, view, &cache.0, &cache.1, &seqs, &mut o, view, params);
    be.read(&o, 0, &mut grouped);
    let mut rows_out = vec![0f32; n * w];
    for ((rows, _), src) in groups.iter().zip(grouped.chunks_exact(gw)) {
        for h in 0..heads {
            for (g, &r) in rows.iter().enumerate() {
                let at = (h * ROW_GROUP + g) * head_dim;
                rows_out[r * w + h * head_dim..][..head_dim]
                    .copy_from_slice(&src[at..at + head_dim]);
            }
        }
    }
    be.write(out, 0, &rows_out);
}

/// The scratch cache's block size.
const SCRATCH_BLOCK: usize = 16;

/// Blocks the scratch cache needs for `spans` (each in blocks of its own).
fn span_blocks(spans: &[(usize, usize)]) -> usize {
    spans.iter().map(|s| s.1.div_ceil(SCRATCH_BLOCK)).sum()
}

/// [`attend_spans`]' scratch KV cache, for a backend without a `span_attention` of its own:
/// made at the first call that needs it, and again, larger, when a call's spans need more
/// blocks. A backend with the kernel (the CPU) never makes it.
pub(super) struct SpanCache<B: Backend>(Option<(usize, KvPair<B>)>);

/// A scratch cache's keys and values.
type KvPair<B> = (<B as Backend>::KvBuf, <B as Backend>::KvBuf);

impl<B: Backend> SpanCache<B> {
    pub(super) fn new() -> Self {
        SpanCache(None)
    }

    /// The cache, of at least `blocks` blocks of `heads` heads of `head_dim`.
    fn get(&mut self, be: &B, blocks: usize, heads: usize, head_dim: usize) -> &mut KvPair<B> {
        let kv = self
            .0
            .take()
            .filter(|(b, _)| *b >= blocks)
            .unwrap_or_else(|| {
                let shape = KvShape {
                    blocks,
                    block_size: SCRATCH_BLOCK,
                    heads,
                    head_dim,
                };
                (blocks, (be.alloc_kv(shape), be.alloc_kv(shape)))
            });
        &mut self.0.insert(kv).1
    }
}
