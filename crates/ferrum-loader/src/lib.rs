//! Model files in, named tensors out. Both loaders memory-map their files and hand out
//! [`RawTensor`]s that point into the mapping, so weights are never copied at load.
//!
//! - [`gguf`]: the GGUF container (v2, v3), parsed by our own code with every length checked
//!   against the file before it is trusted.
//! - [`hf`]: a Hugging Face model folder: `config.json` plus one or more safetensors files.

pub mod assets;
pub mod gguf;
pub mod hf;
mod tensor;

pub use gguf::{GgufFile, Value};
pub use hf::HfFolder;
pub use tensor::{RawTensor, TensorStore};

use std::path::Path;

/// A model as the user names it: a `.gguf` file, or a Hugging Face folder.
pub enum ModelFile {
    Gguf(GgufFile),
    Hf(HfFolder),
}

impl ModelFile {
    pub fn open(path: impl AsRef<Path>) -> ferrum_core::Result<ModelFile> {
        Self::open_with(path.as_ref(), true)
    }

    /// Reads headers and configuration without faulting in the weights (`ferrum plan`,
    /// `ferrum list`).
    pub fn inspect(path: impl AsRef<Path>) -> ferrum_core::Result<ModelFile> {
        Self::open_with(path.as_ref(), false)
    }

    fn open_with(path: &Path, populate: bool) -> ferrum_core::Result<ModelFile> {
        if path.is_dir() {
            Ok(ModelFile::Hf(if populate {
                HfFolder::open(path)?
            } else {
                HfFolder::inspect(path)?
            }))
        } else if path.exists() {
            Ok(ModelFile::Gguf(if populate {
                GgufFile::open(path)?
            } else {
                GgufFile::inspect(path)?
            }))
        } else {
            Err(ferrum_core::Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
            ))
        }
    }

    pub fn tensors(&self) -> TensorStore {
        match self {
            ModelFile::Gguf(g) => g.tensors(),
            ModelFile::Hf(h) => TensorStore {
                tensors: h.tensors.tensors.clone(),
            },
        }
    }

    pub fn file_bytes(&self) -> usize {
        match self {
            ModelFile::Gguf(g) => g.file_size(),
            ModelFile::Hf(h) => h.file_bytes,
        }
    }
}
