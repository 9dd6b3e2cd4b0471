//! Decoding a request's image bytes within limits.

use std::io::Cursor;

use base64::Engine as _;
use image::{DynamicImage, ImageFormat, ImageReader};

/// Why an image was refused. Every variant is the sender's fault: a 400.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    #[error("the image is {bytes} bytes, over the limit of {max} bytes")]
    TooManyBytes { bytes: usize, max: usize },
    #[error("the image is {width} x {height} pixels, over the limit of {max} pixels")]
    TooManyPixels { width: u64, height: u64, max: u64 },
    #[error("the image has no pixels ({width} x {height})")]
    Empty { width: u32, height: u32 },
    #[error("the image's format is not one of PNG, JPEG, WebP and GIF")]
    UnknownFormat,
    #[error("the image could not be decoded: {0}")]
    Undecodable(String),
    #[error("not a base64 data URL of an image: {0}")]
    BadDataUrl(String),
}

/// What one image may cost.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The most encoded bytes (after base64 decoding).
    pub max_bytes: usize,
    /// The most pixels (width × height) the header may claim.
    pub max_pixels: u64,
}

impl Default for Limits {
    fn default() -> Self {
        // 20 MB is OpenAI's limit per image; 32 Mpx (a 96 MB RGB buffer) is past any camera
        // a chat UI sends and far below a bomb.
        Limits {
            max_bytes: 20 << 20,
            max_pixels: 32 << 20,
        }
    }
}

/// 8-bit RGB pixels, row-major, three bytes a pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl RgbImage {
    /// The pixels of the rectangle at (`x`, `y`) of `w` × `h` (clipped to the image).
    pub fn crop(&self, x: usize, y: usize, w: usize, h: usize) -> RgbImage {
        let w = w.min(self.width.saturating_sub(x));
        let h = h.min(self.height.saturating_sub(y));
        let mut data = Vec::with_capacity(w * h * 3);
        for row in y..y + h {
            let start = (row * self.width + x) * 3;
            data.extend_from_slice(&self.data[start..start + w * 3]);
        }
        RgbImage {
            width: w,
            height: h,
            data,
        }
    }
}

const FORMATS: [ImageFormat; 4] = [
    ImageFormat::Png,
    ImageFormat::Jpeg,
    ImageFormat::WebP,
    ImageFormat::Gif,
];

/// Decodes `bytes` (PNG, JPEG, WebP or GIF's first frame) to RGB, checking the claimed size
/// against `limits` before decoding.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<RgbImage, ImageError> {
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes {
            bytes: bytes.len(),
            max: limits.max_bytes,
        });
    }
    let reader = || -> Result<ImageReader<Cursor<&[u8]>>, ImageError> {
        let r = ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| ImageError::Undecodable(e.to_string()))?;
        match r.format() {
            Some(f) if FORMATS.contains(&f) => Ok(r),
            _ => Err(ImageError::UnknownFormat),
        }
    };
    let (width, height) = reader()?
        .into_dimensions()
        .map_err(|e| ImageError::Undecodable(e.to_string()))?;
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    let pixels = u64::from(width) * u64::from(height);
    if pixels > limits.max_pixels {
        return Err(ImageError::TooManyPixels {
            width: width.into(),
            height: height.into(),
            max: limits.max_pixels,
        });
    }
    let mut r = reader()?;
    if r.format() == Some(ImageFormat::Jpeg) {
        return decode_jpeg(bytes, pixels);
    }
    // The decoder may allocate its own buffers besides the output (a frame, a palette
    // expansion): bound them as well, at a few times the RGBA output.
    let mut l = image::Limits::default();
    l.max_image_width = Some(width);
    l.max_image_height = Some(height);
    l.max_alloc = Some(pixels.saturating_mul(16).max(1 << 20));
    r.limits(l);
    let img = r
        .decode()
        .map_err(|e| ImageError::Undecodable(e.to_string()))?;
    Ok(to_rgb(img))
}

/// A JPEG by jpeg-decoder (after its header's size was checked), to RGB as Pillow converts:
/// gray replicated, CMYK (Adobe's inverted form, as Photoshop writes it) multiplied out.
fn decode_jpeg(bytes: &[u8], pixels: u64) -> Result<RgbImage, ImageError> {
    use jpeg_decoder::{Decoder, PixelFormat};
    let mut d = Decoder::new(Cursor::new(bytes));
    d.set_max_decoding_buffer_size(pixels.saturating_mul(8).min(usize::MAX as u64) as usize);
    let data = d
        .decode()
        .map_err(|e| ImageError::Undecodable(e.to_string()))?;
    let info = d
        .info()
        .ok_or_else(|| ImageError::Undecodable("no JPEG frame".into()))?;
    let (width, height) = (usize::from(info.width), usize::from(info.height));
    let n = width * height;
    let data = match info.pixel_format {
        PixelFormat::RGB24 => data,
        PixelFormat::L8 => data.iter().flat_map(|&v| [v, v, v]).collect(),
        PixelFormat::L16 => data
            .chunks_exact(2)
            .flat_map(|v| [v[0], v[0], v[0]])
            .collect(),
        PixelFormat::CMYK32 => data
            .chunks_exact(4)
            .flat_map(|p| {
                let k = u32::from(p[3]);
                let ch = |c: u8| ((u32::from(c) * k + 127) / 255) as u8;
                [ch(p[0]), ch(p[1]), ch(p[2])]
            })
            .collect(),
    };
    if data.len() != n * 3 {
        return Err(ImageError::Undecodable(format!(
            "the JPEG decoded to {} bytes for {width} x {height} pixels",
            data.len()
        )));
    }
    Ok(RgbImage {
        width,
        height,
        data,
    })
}

/// The image over an opaque white background, as transformers' `convert_to_rgb` makes it
/// (`Image.alpha_composite` of the RGBA image over white, then RGB): Pillow's integer
/// arithmetic, so the same bytes.
fn to_rgb(img: DynamicImage) -> RgbImage {
    let (width, height) = (img.width() as usize, img.height() as usize);
    if !img.color().has_alpha() {
        return RgbImage {
            width,
            height,
            data: img.into_rgb8().into_raw(),
        };
    }
    let rgba = img.into_rgba8().into_raw();
    let mut data = Vec::with_capacity(width * height * 3);
    for px in rgba.chunks_exact(4) {
        let a = u32::from(px[3]);
        for &c in &px[..3] {
            data.push(over_white(u32::from(c), a));
        }
    }
    RgbImage {
        width,
        height,
        data,
    }
}

/// One channel of Pillow's `alpha_composite` (AlphaComposite.c, 7 bits of precision) with
/// an opaque white destination.
fn over_white(c: u32, a: u32) -> u8 {
    const BITS: u32 = 7;
    if a == 0 {
        return 255;
    }
    let outa255 = a * 255 + 255 * (255 - a);
    let coef1 = a * 255 * 255 * (1 << BITS) / outa255;
    let coef2 = 255 * (1 << BITS) - coef1;
    let t = c * coef1 + 255 * coef2 + (0x80 << BITS);
    (((((t >> 8) + t) >> 8) >> BITS) & 0xff) as u8
}

/// The bytes of a `data:image/...;base64,...` URL.
pub fn decode_data_url(url: &str) -> Result<Vec<u8>, ImageError> {
    let rest = url
        .strip_prefix("data:")
        .ok_or_else(|| ImageError::BadDataUrl("it does not start with data:".into()))?;
    let (meta, payload) = rest
        .split_once(',')
        .ok_or_else(|| ImageError::BadDataUrl("no comma after the media type".into()))?;
    if !meta.ends_with(";base64") {
        return Err(ImageError::BadDataUrl(
            "only base64 data URLs are read".into(),
        ));
    }
    let media = &meta[..meta.len() - ";base64".len()];
    if !(media.is_empty() || media.starts_with("image/")) {
        return Err(ImageError::BadDataUrl(format!(
            "media type {media:?} is not an image"
        )));
    }
    decode_base64(payload)
}

/// Standard base64 (padding optional, whitespace ignored), as images are sent.
pub fn decode_base64(payload: &str) -> Result<Vec<u8>, ImageError> {
    let clean: String = payload.chars().filter(|c| !c.is_whitespace()).collect();
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    engine
        .decode(clean.as_bytes())
        .map_err(|e| ImageError::BadDataUrl(format!("bad base64: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pillow's formula with a white destination reduces to the plain blend, rounded.
    #[test]
    fn over_white_is_the_rounded_blend() {
        for a in 0..=255u32 {
            for c in [0u32, 1, 17, 128, 200, 254, 255] {
                let exact = (c * a + 255 * (255 - a)) as f64 / 255.0;
                let got = f64::from(over_white(c, a));
                assert!((got - exact).abs() <= 0.51, "c {c} a {a}: {got} vs {exact}");
            }
        }
        assert_eq!(over_white(37, 255), 37);
        assert_eq!(over_white(37, 0), 255);
    }

    #[test]
    fn data_urls() {
        assert_eq!(
            decode_data_url("data:image/png;base64,aGk=").unwrap(),
            b"hi"
        );
        assert_eq!(decode_data_url("data:image/png;base64,aGk").unwrap(), b"hi");
        assert!(decode_data_url("data:text/plain;base64,aGk=").is_err());
        assert!(decode_data_url("http://x/y.png").is_err());
        assert!(decode_data_url("data:image/png;base64,%%%").is_err());
    }

    #[test]
    fn garbage_is_refused() {
        let l = Limits::default();
        assert_eq!(decode(b"", &l), Err(ImageError::UnknownFormat));
        assert_eq!(decode(b"not an image", &l), Err(ImageError::UnknownFormat));
        // A PNG signature and nothing after it.
        let e = decode(b"\x89PNG\r\n\x1a\n", &l).unwrap_err();
        assert!(matches!(e, ImageError::Undecodable(_)), "{e:?}");
    }

    /// A PNG header claiming 100,000 x 100,000 pixels is refused from its header.
    #[test]
    fn bombs_are_refused_from_the_header() {
        let png = png_header(100_000, 100_000);
        let e = decode(&png, &Limits::default()).unwrap_err();
        assert!(matches!(e, ImageError::TooManyPixels { .. }), "{e:?}");
    }

    /// The signature and an IHDR chunk (8-bit RGB) of the given size, with its CRC.
    pub(crate) fn png_header(w: u32, h: u32) -> Vec<u8> {
        let mut ihdr = b"IHDR".to_vec();
        ihdr.extend_from_slice(&w.to_be_bytes());
        ihdr.extend_from_slice(&h.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        out.extend_from_slice(&13u32.to_be_bytes());
        out.extend_from_slice(&ihdr);
        out.extend_from_slice(&crc32(&ihdr).to_be_bytes());
        // A few compressed bytes, as a real bomb's first IDAT, then the end.
        for (name, body) in [
            (
                &b"IDAT"[..],
                &[0x78, 0x9c, 0x63, 0x00, 0x00, 0x00, 0x01, 0x00, 0x01][..],
            ),
            (b"IEND", &[]),
        ] {
            let mut chunk = name.to_vec();
            chunk.extend_from_slice(body);
            out.extend_from_slice(&(body.len() as u32).to_be_bytes());
            out.extend_from_slice(&chunk);
            out.extend_from_slice(&crc32(&chunk).to_be_bytes());
        }
        out
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
}
