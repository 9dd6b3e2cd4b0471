//! Images in requests (issue 45): every API's image parts become OpenAI `image_url` parts of
//! the chat request (Anthropic's `image` blocks and Responses' `input_image` parts in their
//! modules, Ollama's `images` in its), and this checks them once for all: each is a base64
//! `data:` URL of a PNG, JPEG, WebP or GIF within the size limits, there are no more than the
//! limit, and the model takes images. Every refusal is a 400 naming the part and the reason,
//! decided from the header before any pixel is decoded where the size is the problem.

use ferrum_image::{Limits, RgbImage};
use serde_json::Value;

use crate::api::{ChatRequest, Content};
use crate::error::ApiError;

/// What a request's images may be (`serve --max-image-pixels`, `--max-images`).
#[derive(Debug, Clone, Copy)]
pub struct ImageOptions {
    pub limits: Limits,
    /// The most images one request may carry.
    pub max_per_request: usize,
}

impl Default for ImageOptions {
    fn default() -> Self {
        ImageOptions {
            limits: Limits::default(),
            max_per_request: 16,
        }
    }
}

/// OpenAI's `detail`: how finely the image is looked at. Models here look at every image
/// the way their processor says; `low` and `high` are accepted and change nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detail {
    Auto,
    Low,
    High,
}

/// One decoded image of a request, in the order of the conversation.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub image: RgbImage,
    pub detail: Detail,
}

fn bad(at: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::param("messages", format!("{at}: {message}"))
}

/// An `image_url` part's value: `{"url": …, "detail": …}` or, as some clients send it, the
/// URL alone.
pub fn image_url(v: &Value, at: &str, opts: &ImageOptions) -> Result<ImageInput, ApiError> {
    let (url, detail) = match v {
        Value::String(s) => (s.as_str(), None),
        Value::Object(o) => {
            if let Some(k) = o.keys().find(|k| *k != "url" && *k != "detail") {
                return Err(bad(at, format!("image_url.{k}: unknown field")));
            }
            let url = o
                .get("url")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(at, "image_url.url: a string is required"))?;
            (url, o.get("detail"))
        }
        _ => return Err(bad(at, "image_url must be an object with a url")),
    };
    let detail = match detail {
        None | Some(Value::Null) => Detail::Auto,
        Some(Value::String(d)) => match d.as_str() {
            "auto" => Detail::Auto,
            "low" => Detail::Low,
            "high" => Detail::High,
            other => {
                return Err(bad(
                    at,
                    format!("image_url.detail {other:?} (auto, low or high)"),
                ))
            }
        },
        Some(_) => return Err(bad(at, "image_url.detail must be a string")),
    };
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https:/") {
        return Err(bad(
            at,
            "image URLs are not fetched by this server: send the image as a base64 data: URL",
        ));
    }
    let bytes = ferrum_image::decode_data_url(url).map_err(|e| bad(at, e))?;
    let image = ferrum_image::decode(&bytes, &opts.limits).map_err(|e| bad(at, e))?;
    Ok(ImageInput { image, detail })
}

impl ChatRequest {
    /// The request's images, decoded and checked, in order.
    pub fn images(&self, opts: &ImageOptions) -> Result<Vec<ImageInput>, ApiError> {
        let mut out = Vec::new();
        for (i, m) in self.messages.iter().enumerate() {
            let Some(Content::Parts(parts)) = &m.content else {
                continue;
            };
            for (j, p) in parts.iter().enumerate() {
                if p.kind != "image_url" {
                    continue;
                }
                let at = format!("messages[{i}].content[{j}]");
                if m.role != "user" {
                    return Err(bad(&at, "images go in user messages"));
                }
                if out.len() == opts.max_per_request {
                    return Err(bad(
                        &at,
                        format!(
                            "more than {} images in one request (serve --max-images)",
                            opts.max_per_request
                        ),
                    ));
                }
                let v = p
                    .image_url
                    .as_ref()
                    .ok_or_else(|| bad(&at, "an image_url part needs image_url"))?;
                out.push(image_url(v, &at, opts)?);
            }
        }
        Ok(out)
    }
}

/// The refusal of images for a model without a vision encoder.
pub fn no_vision(model: &str) -> ApiError {
    ApiError::param(
        "messages",
        format!("model {model:?} does not take images: it has no vision encoder"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn png_1x1() -> String {
        // A 1x1 RGB PNG.
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC".into()
    }

    #[test]
    fn image_url_forms() {
        let o = ImageOptions::default();
        let a = image_url(&json!({"url": png_1x1(), "detail": "low"}), "x", &o).unwrap();
        assert_eq!(
            (a.image.width, a.image.height, a.detail),
            (1, 1, Detail::Low)
        );
        assert!(image_url(&json!(png_1x1()), "x", &o).is_ok());
        for (v, needle) in [
            (json!({"url": "https://example.com/a.png"}), "not fetched"),
            (json!({"url": png_1x1(), "detail": "max"}), "detail"),
            (json!({"url": png_1x1(), "size": 3}), "unknown field"),
            (json!({"url": "data:image/png;base64,AAAA"}), "format"),
            (
                json!({"url": "data:text/plain;base64,AAAA"}),
                "not an image",
            ),
            (json!(5), "object"),
        ] {
            let e = image_url(&v, "x", &o).unwrap_err();
            assert!(e.message.contains(needle), "{v}: {}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
    }
}
