//! Image input (issue 45): the bytes a request carries, decoded within limits, and the
//! vision models' processors — what transformers' image processors do to an image before
//! the vision tower sees it, with Pillow's resampling reproduced to the bit.
//!
//! - [`decode()`]: PNG, WebP and GIF (its first frame) by the `image` crate and JPEG by
//!   `jpeg-decoder`, after the
//!   header's size is checked against [`Limits`] (a small file claiming 100,000 × 100,000
//!   pixels is refused before anything is allocated); transparent images are laid over white
//!   as transformers' `convert_to_rgb` does (Pillow's integer `alpha_composite`).
//! - [`resize()`](resize::resize): Pillow's two-pass resampling of 8-bit images (its filters, coefficient
//!   windows, 22-bit fixed point and pass order), so a resized image equals `Image.resize`'s.
//! - [`processor`]: Gemma 3's (fixed size, optional pan-and-scan crops), the Qwen VL
//!   line's (dynamic resolution in multiples of the merged patch, flattened patches) and
//!   Pixtral's (Mistral 3: a longest edge, sides in whole merged units, the image kept whole)
//!   from a checkpoint's `preprocessor_config.json`.

pub mod decode;
pub mod processor;
pub mod resize;

pub use decode::{decode, decode_data_url, ImageError, Limits, RgbImage};
pub use processor::{PixtralFit, Processed, Processor};
pub use resize::Filter;
