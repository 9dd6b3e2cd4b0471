//! The vision models' image processors, read from a checkpoint's `preprocessor_config.json`:
//! what transformers' PIL image processors compute, value for value.

use serde_json::Value as Json;

use crate::decode::RgbImage;
use crate::resize::{resize, Filter};

/// Rescaling and normalisation as transformers does them: `f32(f64(v) · factor)`, then
/// `(x − mean) / std` in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalize {
    pub rescale: Option<f64>,
    pub mean_std: Option<([f32; 3], [f32; 3])>,
}

impl Normalize {
    fn value(&self, v: u8, c: usize) -> f32 {
        let x = match self.rescale {
            Some(f) => (f64::from(v) * f) as f32,
            None => f32::from(v),
        };
        match &self.mean_std {
            Some((m, s)) => (x - m[c]) / s[c],
            None => x,
        }
    }

    /// The image as `[3, h, w]` floats.
    fn chw(&self, img: &RgbImage) -> Vec<f32> {
        let plane = img.width * img.height;
        let mut out = vec![0f32; 3 * plane];
        for (i, px) in img.data.chunks_exact(3).enumerate() {
            for c in 0..3 {
                out[c * plane + i] = self.value(px[c], c);
            }
        }
        out
    }
}

/// Gemma 3's pan-and-scan: extra crops of a long image, each processed like the whole.
#[derive(Debug, Clone, PartialEq)]
pub struct PanAndScan {
    pub min_crop_size: usize,
    pub max_num_crops: usize,
    pub min_ratio_to_activate: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Processor {
    /// Gemma 3 (SigLIP): every image (and crop) resized to one size.
    Gemma3 {
        height: usize,
        width: usize,
        filter: Filter,
        norm: Normalize,
        pan_and_scan: Option<PanAndScan>,
    },
    /// Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5: resized to multiples of `patch · merge`
    /// with a pixel count between `min_pixels` and `max_pixels`, then cut into patches,
    /// each repeated `temporal` times (an image is a video of one frame).
    QwenVl {
        patch: usize,
        temporal: usize,
        merge: usize,
        min_pixels: usize,
        max_pixels: usize,
        filter: Filter,
        norm: Normalize,
    },
    /// Pixtral (Mistral 3): sized by `fit` to multiples of `unit` (the tower's patch times
    /// its merge, as `PixtralProcessor` passes it), kept whole as `[1, 3, h, w]`.
    Pixtral {
        unit: usize,
        fit: PixtralFit,
        filter: Filter,
        norm: Normalize,
    },
}

/// How a Pixtral processor sizes an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PixtralFit {
    /// transformers': scaled down to fit `longest_edge` (never up), each side then rounded
    /// up to a multiple of the unit.
    LongestEdge(usize),
    /// llama.cpp's for an mmproj file: Qwen's [`smart_resize`] between these pixel counts.
    Pixels { min: usize, max: usize },
}

impl PixtralFit {
    /// The processed `(height, width)` of an image, in multiples of `unit`.
    pub fn size(&self, height: usize, width: usize, unit: usize) -> Result<(usize, usize), String> {
        match *self {
            PixtralFit::LongestEdge(edge) => Ok(pixtral_size(height, width, edge, unit)),
            PixtralFit::Pixels { min, max } => smart_resize(height, width, unit, min, max),
        }
    }

    /// `(units, rows)`: the most units an image takes, and the most rows it takes in a
    /// prompt (its units and a break or end a row of them).
    pub fn max_units(&self, unit: usize) -> (usize, usize) {
        let u = unit.max(1);
        match *self {
            PixtralFit::LongestEdge(edge) => {
                let side = edge.div_ceil(u);
                (side * side, side * (side + 1))
            }
            // A row can be a single unit: at most as many breaks as units.
            PixtralFit::Pixels { max, .. } => (max / u / u, 2 * (max / u / u)),
        }
    }
}

/// A processed image: what the vision tower takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Processed {
    /// Row-major values of `shape`: Gemma 3 `[1 + crops, 3, h, w]`; Qwen VL
    /// `[grid_h · grid_w, 3 · temporal · patch²]`.
    pub values: Vec<f32>,
    pub shape: Vec<usize>,
    /// Qwen VL: the patch grid (frames, rows, columns).
    pub grid: Option<[usize; 3]>,
}

/// CLIP's normalisation, the default of the Qwen VL and Pixtral processors.
const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

fn bad(msg: impl Into<String>) -> String {
    format!("preprocessor_config.json: {}", msg.into())
}

fn usize_of(j: &Json, k: &str) -> Option<usize> {
    j.get(k).and_then(Json::as_u64).map(|v| v as usize)
}

fn triple(j: &Json, k: &str) -> Result<Option<[f32; 3]>, String> {
    match j.get(k) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Array(a)) if a.len() == 3 => {
            let mut out = [0f32; 3];
            for (o, v) in out.iter_mut().zip(a) {
                *o = v
                    .as_f64()
                    .ok_or_else(|| bad(format!("{k} is not numbers")))? as f32;
            }
            Ok(Some(out))
        }
        Some(v) => match v.as_f64() {
            Some(x) => Ok(Some([x as f32; 3])),
            None => Err(bad(format!("{k} is not three numbers"))),
        },
    }
}

fn flag(j: &Json, k: &str, default: bool) -> bool {
    j.get(k).and_then(Json::as_bool).unwrap_or(default)
}

impl Processor {
    /// From `preprocessor_config.json` (its `image_processor_type`, fast or not).
    pub fn from_json(j: &Json) -> Result<Processor, String> {
        let kind = j
            .get("image_processor_type")
            .and_then(Json::as_str)
            .unwrap_or("");
        let kind = kind
            .strip_suffix("Fast")
            .or_else(|| kind.strip_suffix("Pil"))
            .unwrap_or(kind);
        let filter_code = j.get("resample").and_then(Json::as_i64);
        let filter = |default: Filter| -> Result<Filter, String> {
            match filter_code {
                None => Ok(default),
                Some(c) => {
                    Filter::from_pil(c).ok_or_else(|| bad(format!("resample {c} is not supported")))
                }
            }
        };
        let norm = |mean: [f32; 3], std: [f32; 3]| -> Result<Normalize, String> {
            let rescale = flag(j, "do_rescale", true).then(|| {
                j.get("rescale_factor")
                    .and_then(Json::as_f64)
                    .unwrap_or(1.0 / 255.0)
            });
            let mean_std = if flag(j, "do_normalize", true) {
                Some((
                    triple(j, "image_mean")?.unwrap_or(mean),
                    triple(j, "image_std")?.unwrap_or(std),
                ))
            } else {
                None
            };
            Ok(Normalize { rescale, mean_std })
        };
        if !flag(j, "do_resize", true) {
            return Err(bad("do_resize false is not supported"));
        }
        match kind {
            "Gemma3ImageProcessor" | "SiglipImageProcessor" => {
                let size = j.get("size");
                let side = |k: &str| size.and_then(|s| usize_of(s, k));
                let (height, width) = (side("height").unwrap_or(224), side("width").unwrap_or(224));
                let pan_and_scan = flag(j, "do_pan_and_scan", false).then(|| PanAndScan {
                    min_crop_size: usize_of(j, "pan_and_scan_min_crop_size").unwrap_or(256),
                    max_num_crops: usize_of(j, "pan_and_scan_max_num_crops").unwrap_or(4),
                    min_ratio_to_activate: j
                        .get("pan_and_scan_min_ratio_to_activate")
                        .and_then(Json::as_f64)
                        .unwrap_or(1.2),
                });
                Ok(Processor::Gemma3 {
                    height,
                    width,
                    filter: filter(Filter::Bilinear)?,
                    norm: norm([0.5; 3], [0.5; 3])?,
                    pan_and_scan,
                })
            }
            "Qwen2VLImageProcessor" => {
                let size = j.get("size");
                let min_pixels = usize_of(j, "min_pixels")
                    .or_else(|| size.and_then(|s| usize_of(s, "shortest_edge")))
                    .unwrap_or(56 * 56);
                let max_pixels = usize_of(j, "max_pixels")
                    .or_else(|| size.and_then(|s| usize_of(s, "longest_edge")))
                    .unwrap_or(28 * 28 * 1280);
                Ok(Processor::QwenVl {
                    patch: usize_of(j, "patch_size").unwrap_or(14),
                    temporal: usize_of(j, "temporal_patch_size").unwrap_or(2),
                    merge: usize_of(j, "merge_size").unwrap_or(2),
                    min_pixels,
                    max_pixels,
                    filter: filter(Filter::Bicubic)?,
                    norm: norm(CLIP_MEAN, CLIP_STD)?,
                })
            }
            "PixtralImageProcessor" => {
                // `patch_size` is `{"height", "width"}` or one number; the model's loader
                // sets the unit it resizes to (`Processor::with_unit`).
                let patch = j.get("patch_size");
                let unit = patch
                    .and_then(|p| usize_of(p, "height"))
                    .or_else(|| patch.and_then(Json::as_u64).map(|v| v as usize))
                    .unwrap_or(16);
                let longest_edge = j
                    .get("size")
                    .and_then(|s| usize_of(s, "longest_edge"))
                    .unwrap_or(1024);
                if unit == 0 || longest_edge < unit {
                    return Err(bad(format!(
                        "longest_edge {longest_edge} holds no patch of {unit}"
                    )));
                }
                Ok(Processor::Pixtral {
                    unit,
                    fit: PixtralFit::LongestEdge(longest_edge),
                    filter: filter(Filter::Bicubic)?,
                    norm: norm(CLIP_MEAN, CLIP_STD)?,
                })
            }
            other => Err(bad(format!("image processor {other:?} is not supported"))),
        }
    }

    /// The processed image, or why it cannot be (Qwen's aspect-ratio bound).
    pub fn process(&self, img: &RgbImage) -> Result<Processed, String> {
        match self {
            Processor::Gemma3 {
                height,
                width,
                filter,
                norm,
                pan_and_scan,
            } => {
                let mut parts = vec![img.clone()];
                if let Some(p) = pan_and_scan {
                    parts.extend(pan_and_scan_crops(img, p));
                }
                let mut values = Vec::with_capacity(parts.len() * 3 * height * width);
                for part in &parts {
                    values.extend(norm.chw(&resize(part, *width, *height, *filter)));
                }
                Ok(Processed {
                    values,
                    shape: vec![parts.len(), 3, *height, *width],
                    grid: None,
                })
            }
            Processor::QwenVl {
                patch,
                temporal,
                merge,
                min_pixels,
                max_pixels,
                filter,
                norm,
            } => {
                let (h, w) = smart_resize(
                    img.height,
                    img.width,
                    patch * merge,
                    *min_pixels,
                    *max_pixels,
                )?;
                let chw = norm.chw(&resize(img, w, h, *filter));
                let (gh, gw) = (h / patch, w / patch);
                let (p, m, t) = (*patch, *merge, *temporal);
                let dim = 3 * t * p * p;
                let mut values = Vec::with_capacity(gh * gw * dim);
                for bh in 0..gh / m {
                    for bw in 0..gw / m {
                        for mh in 0..m {
                            for mw in 0..m {
                                let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                                for c in 0..3 {
                                    for _ in 0..t {
                                        for py in 0..p {
                                            let row = c * h * w + (y0 + py) * w + x0;
                                            values.extend_from_slice(&chw[row..row + p]);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                Ok(Processed {
                    values,
                    shape: vec![gh * gw, dim],
                    grid: Some([1, gh, gw]),
                })
            }
            Processor::Pixtral {
                unit,
                fit,
                filter,
                norm,
            } => {
                let (h, w) = fit.size(img.height, img.width, *unit)?;
                let values = if (h, w) == (img.height, img.width) {
                    norm.chw(img)
                } else {
                    norm.chw(&resize(img, w, h, *filter))
                };
                Ok(Processed {
                    values,
                    shape: vec![1, 3, h, w],
                    grid: None,
                })
            }
        }
    }

    /// Pixtral's processor resizing to multiples of `unit` pixels: `PixtralProcessor` passes
    /// the tower's patch times its merge, not the image processor's own `patch_size`.
    pub fn with_unit(self, unit: usize) -> Processor {
        match self {
            Processor::Pixtral {
                fit, filter, norm, ..
            } => Processor::Pixtral {
                unit: unit.max(1),
                fit,
                filter,
                norm,
            },
            other => other,
        }
    }

    /// The image tokens an image of `width` × `height` takes in the language model for a
    /// model whose projector gives `per_image` tokens per fixed-size image (Gemma 3's
    /// `mm_tokens_per_image`; unused by Qwen VL, whose count follows the grid).
    pub fn tokens(&self, width: usize, height: usize, per_image: usize) -> Result<usize, String> {
        match self {
            Processor::Gemma3 { .. } => Ok(per_image),
            Processor::QwenVl {
                patch,
                merge,
                min_pixels,
                max_pixels,
                ..
            } => {
                let (h, w) = smart_resize(height, width, patch * merge, *min_pixels, *max_pixels)?;
                Ok((h / patch) * (w / patch) / (merge * merge))
            }
            Processor::Pixtral { unit, fit, .. } => {
                // A row of units, then its break (the last row's the image's end).
                let (h, w) = fit.size(height, width, *unit)?;
                Ok((h / unit) * (w / unit + 1))
            }
        }
    }
}

/// transformers' Pixtral `get_resize_output_image_size`: scaled down (flooring each side)
/// when a side is over `longest_edge`, then each side rounded up to a multiple of `unit`.
pub fn pixtral_size(
    height: usize,
    width: usize,
    longest_edge: usize,
    unit: usize,
) -> (usize, usize) {
    let (mut h, mut w) = (height, width);
    let ratio = (height as f64 / longest_edge as f64).max(width as f64 / longest_edge as f64);
    if ratio > 1.0 {
        h = (height as f64 / ratio).floor() as usize;
        w = (width as f64 / ratio).floor() as usize;
    }
    let up = |x: usize| (x.max(1) - 1) / unit.max(1) * unit.max(1) + unit.max(1);
    (up(h), up(w))
}

/// Python's `round` (half to even) of `x`.
fn round_even(x: f64) -> f64 {
    x.round_ties_even()
}

/// transformers' Qwen2-VL `smart_resize`: the nearest multiples of `factor` keeping the
/// aspect ratio, scaled into `[min_pixels, max_pixels]`.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), String> {
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    if h.max(w) / h.min(w) > 200.0 {
        return Err(format!(
            "the image's aspect ratio {:.0}:1 is over 200:1",
            h.max(w) / h.min(w)
        ));
    }
    let mut h_bar = round_even(h / f) * f;
    let mut w_bar = round_even(w / f) * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Gemma 3's pan-and-scan crops (none when the image is not long enough or a crop would be
/// under the minimum size).
fn pan_and_scan_crops(img: &RgbImage, p: &PanAndScan) -> Vec<RgbImage> {
    let (h, w) = (img.height, img.width);
    let (long, short) = if w >= h { (w, h) } else { (h, w) };
    if (long as f64 / short as f64) < p.min_ratio_to_activate {
        return Vec::new();
    }
    let n = ((long as f64 / short as f64 + 0.5).floor() as usize)
        .min((long as f64 / p.min_crop_size as f64).floor() as usize)
        .max(2)
        .min(p.max_num_crops);
    let (nw, nh) = if w >= h { (n, 1) } else { (1, n) };
    let cw = w.div_ceil(nw);
    let ch = h.div_ceil(nh);
    if cw.min(ch) < p.min_crop_size {
        return Vec::new();
    }
    let mut out = Vec::new();
    for i in 0..nh {
        for j in 0..nw {
            out.push(img.crop(j * cw, i * ch, cw, ch));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_transformers() {
        // Values printed by transformers' smart_resize (factor 28, default limits).
        assert_eq!(smart_resize(50, 70, 28, 3136, 1003520).unwrap(), (56, 56));
        assert_eq!(
            smart_resize(300, 200, 28, 3136, 1003520).unwrap(),
            (308, 196)
        );
        assert_eq!(
            smart_resize(1000, 37, 28, 3136, 1003520).unwrap(),
            (1008, 28)
        );
        assert!(smart_resize(1, 300, 28, 3136, 1003520).is_err());
    }
}
