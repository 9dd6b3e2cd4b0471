//! Types every other ferrum crate speaks: the error type and the element formats
//! (GGML's type ids, block sizes and byte sizes) that weights can be stored in.

pub mod alloc;
mod dtype;
mod error;
pub mod temp;

pub use dtype::DType;
pub use error::{Error, Result};
