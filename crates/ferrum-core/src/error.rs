//! One error type for the library crates. Bad input from files or requests is always
//! reported through it, never by a panic.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file that does not follow its format (GGUF, safetensors, config.json).
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    /// Well-formed input that this build cannot handle (an unknown architecture, a tensor type
    /// without a kernel).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A tensor the model needs is missing or has the wrong shape.
    #[error("weights: {0}")]
    Weights(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// A chat template that ran past a limit of its sandbox (instructions, output size,
    /// memory, time): the model's template is at fault, not the request.
    #[error("chat template: {0}")]
    TemplateLimit(String),
    /// A request the engine refuses (prompt longer than the context, bad parameter).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A compute device that is missing, out of memory or lost (the Vulkan backend).
    #[error("device: {0}")]
    Device(String),
}

impl Error {
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
