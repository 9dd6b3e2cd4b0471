//! Images in requests (issue 45): every API's image parts become OpenAI `image_url` parts of
//! the chat request (Anthropic's `image` blocks and Responses' `input_image` parts in their
//! modules, Ollama's `images` in its), and this checks them once for all: each is a base64
//! `data:` URL of a PNG, JPEG, WebP or GIF within the size limits, there are no more than the
//! limit, and the model takes images. Every refusal is a 400 naming the part and the reason,
//! decided from the header before any pixel is decoded where the size is the problem.
//! `http(s)` URLs are fetched only when the server allows it (`serve --allow-image-urls`),
//! within the byte limit and a time limit.

use std::io::Read;
use std::time::Duration;

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
    /// `http(s)` image URLs are fetched, each within this time (and `limits.max_bytes`);
    /// `None` refuses them (`serve --allow-image-urls`).
    pub fetch_timeout: Option<Duration>,
}

impl Default for ImageOptions {
    fn default() -> Self {
        ImageOptions {
            limits: Limits::default(),
            max_per_request: 16,
            fetch_timeout: None,
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
/// URL alone. An allowed `http(s)` URL is fetched here: blocking, so off the async workers.
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
    let bytes = if is_web_url(url) {
        let Some(timeout) = opts.fetch_timeout else {
            return Err(bad(
                at,
                "image URLs are not fetched by this server (serve --allow-image-urls): send \
                 the image as a base64 data: URL",
            ));
        };
        fetch(url, opts.limits.max_bytes, timeout).map_err(|e| bad(at, e))?
    } else {
        ferrum_image::decode_data_url(url).map_err(|e| bad(at, e))?
    };
    let image = ferrum_image::decode(&bytes, &opts.limits).map_err(|e| bad(at, e))?;
    Ok(ImageInput { image, detail })
}

fn is_web_url(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// The body at `url`: at most `max_bytes` (a larger declared length is refused before the
/// body is read), all within `timeout` from the connection to the last byte, following up to
/// three redirects.
fn fetch(url: &str, max_bytes: usize, timeout: Duration) -> Result<Vec<u8>, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .max_redirects(3)
        .build()
        .into();
    let secs = timeout.as_secs_f64();
    let fail = |e: ureq::Error| match e {
        ureq::Error::StatusCode(code) => format!("fetching the image URL: HTTP {code}"),
        ureq::Error::Timeout(_) => format!("fetching the image URL took over {secs} s"),
        e => format!("fetching the image URL: {e}"),
    };
    let resp = agent.get(url).call().map_err(fail)?;
    let limit = max_bytes as u64;
    let too_big = || format!("the image at the URL is over {max_bytes} bytes");
    if resp
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .is_some_and(|n| n > limit)
    {
        return Err(too_big());
    }
    // One byte past the limit tells a body that is too long from one that is exactly full.
    let mut body = Vec::new();
    resp.into_body()
        .into_with_config()
        .limit(limit + 1)
        .reader()
        .take(limit + 1)
        .read_to_end(&mut body)
        .map_err(|e| fail(ureq::Error::from(e)))?;
    if body.len() as u64 > limit {
        return Err(too_big());
    }
    Ok(body)
}

impl ChatRequest {
    /// The request's `image_url` parts, in order, with where each is (`messages[i].content[j]`),
    /// checked for place and count; their values are read by [`image_url`].
    pub fn image_parts(&self, opts: &ImageOptions) -> Result<Vec<(String, Value)>, ApiError> {
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
                    .clone()
                    .ok_or_else(|| bad(&at, "an image_url part needs image_url"))?;
                out.push((at, v));
            }
        }
        Ok(out)
    }
}

/// Whether an `image_url` value names a web address (which is fetched, or refused).
pub fn is_url_part(v: &Value) -> bool {
    let url = match v {
        Value::String(s) => Some(s.as_str()),
        Value::Object(o) => o.get("url").and_then(Value::as_str),
        _ => None,
    };
    url.is_some_and(is_web_url)
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
            (
                json!({"url": "https://example.com/a.png"}),
                "--allow-image-urls",
            ),
            (json!("HTTP://example.com/a.png"), "--allow-image-urls"),
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

    /// Serves each accepted connection the bytes `answer` gives for its request line, slowly
    /// where `delay` says, on a local port; the URL of `path` there.
    fn serve(answer: fn(&str) -> (Vec<u8>, u64)) -> String {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap();
                    loop {
                        let mut h = String::new();
                        if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                            break;
                        }
                    }
                    let (bytes, delay_ms) = answer(&line);
                    for piece in bytes.chunks(bytes.len().div_ceil(4).max(1)) {
                        std::thread::sleep(Duration::from_millis(delay_ms));
                        if conn.write_all(piece).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        format!("http://127.0.0.1:{port}")
    }

    fn png_bytes() -> Vec<u8> {
        ferrum_image::decode_data_url(&png_1x1()).unwrap()
    }

    fn reply(status: &str, headers: &str, body: &[u8]) -> Vec<u8> {
        let mut v = format!("HTTP/1.1 {status}\r\nConnection: close\r\n{headers}\r\n").into_bytes();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn urls_are_fetched_within_the_limits_when_allowed() {
        let base = serve(|line| {
            let png = png_bytes();
            let len = format!("Content-Length: {}\r\n", png.len());
            match line.split(' ').nth(1).unwrap_or("") {
                "/a.png" => (reply("200 OK", &len, &png), 0),
                "/moved" => (
                    reply(
                        "302 Found",
                        "Location: /a.png\r\nContent-Length: 0\r\n",
                        b"",
                    ),
                    0,
                ),
                "/huge" => (reply("200 OK", "Content-Length: 999999999\r\n", &png), 0),
                // No length: the body runs past the limit.
                "/endless" => (reply("200 OK", "", &vec![7u8; 5000]), 0),
                "/slow" => (reply("200 OK", &len, &png), 400),
                "/junk" => (reply("200 OK", "", b"<html>not an image</html>"), 0),
                _ => (reply("404 Not Found", "Content-Length: 0\r\n", b""), 0),
            }
        });
        let o = ImageOptions {
            limits: Limits {
                max_bytes: 1000,
                ..Limits::default()
            },
            fetch_timeout: Some(Duration::from_millis(800)),
            ..ImageOptions::default()
        };
        for path in ["/a.png", "/moved"] {
            let a = image_url(&json!({"url": format!("{base}{path}")}), "x", &o).unwrap();
            assert_eq!((a.image.width, a.image.height), (1, 1), "{path}");
        }
        assert!(is_url_part(&json!(format!("{base}/a.png"))));
        for (path, needle) in [
            ("/missing", "HTTP 404"),
            ("/huge", "over 1000 bytes"),
            ("/endless", "over 1000 bytes"),
            ("/slow", "took over 0.8 s"),
            ("/junk", "format"),
        ] {
            let t = std::time::Instant::now();
            let e = image_url(&json!({"url": format!("{base}{path}")}), "x", &o).unwrap_err();
            assert!(e.message.contains(needle), "{path}: {}", e.message);
            assert_eq!(e.status.as_u16(), 400);
            assert!(t.elapsed() < Duration::from_secs(3), "{path}");
        }
        // Nothing listens there.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/a.png", closed.local_addr().unwrap());
        drop(closed);
        let e = image_url(&json!(url), "x", &o).unwrap_err();
        assert!(
            e.message.contains("fetching the image URL"),
            "{}",
            e.message
        );
    }
}
