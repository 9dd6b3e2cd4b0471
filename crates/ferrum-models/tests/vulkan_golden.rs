//! The golden tiny models on the Vulkan backend (lavapipe here and in CI; any Vulkan device
//! elsewhere): every fixture that has a transformers reference — the Llama/Qwen set, the later
//! architectures, Qwen3-MoE and gpt-oss (MXFP4 experts too), GLM-4.5, DeepSeek-V3 and Mistral
//! 3/4 (latent attention too) — as safetensors and as f32, f16,
//! q8_0 and MXFP4 GGUF, each within 1e-4 × max|logit| of transformers (the CPU's exact path
//! is within 1e-5; the device adds only another order of additions) with its argmax, and
//! within 1e-5 of the CPU's exact path on the same file. The hybrid Qwen3.5 models are
//! refused with an error that says why.
//!
//! Without a Vulkan device each test says so and passes, unless `FERRUM_REQUIRE_VULKAN=1`
//! (scripts/test.sh sets it where it installed lavapipe), when a missing device fails.

use std::path::{Path, PathBuf};

use ferrum_backend::vulkan::{test_device as device, VulkanBackend};
use ferrum_backend::CpuBackend;
use ferrum_models::{LoadOptions, Model};
use serde::Deserialize;

mod common;
use common::{argmax, logits_all};

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    argmax: Vec<u32>,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// (folder, file, the references to try in order) for every model file with one.
fn cases() -> Vec<(PathBuf, &'static str, &'static [&'static str])> {
    let mut out = Vec::new();
    let sets: [(&str, &[&str]); 3] = [
        (
            "tiny",
            &[
                "llama",
                "llama-tied",
                "qwen2",
                "qwen2-tied",
                "qwen3",
                "qwen3-tied",
            ],
        ),
        (
            "arch",
            &[
                "gemma3",
                "gemma3-pattern",
                "gemma3-linear",
                "gemma3-multimodal",
                "phi3",
                "phi3-plain",
                "smollm3",
                "granite",
                "olmo2",
                "gpt-oss",
                "gpt-oss-mxfp4-hf",
                "glm4moe",
                "glm4moe-qknorm",
                "deepseek3",
                "deepseek3-qlora",
                "deepseek2-lite",
                "ministral3",
                "mistral4",
                "gemma4",
                "gemma4-e2b",
                "gemma4-moe",
            ],
        ),
        (
            "moe",
            &[
                "qwen3moe-top2",
                "qwen3moe-top4-nonorm",
                "qwen3moe-top2-sparse2",
                "qwen3moe-gguf",
            ],
        ),
    ];
    for (set, names) in sets {
        for name in names {
            let d = fixtures().join(set).join(name);
            out.push((d.clone(), "", &["reference.json"][..]));
            let files: [(&str, &[&str]); 4] = [
                ("model-f32.gguf", &["reference-gguf.json", "reference.json"]),
                (
                    "model-f16.gguf",
                    &["reference-f16.json", "reference-gguf-f16.json"],
                ),
                (
                    "model-q8_0.gguf",
                    &["reference-gguf-q8_0.json", "reference-q8_0.json"],
                ),
                ("model-mxfp4.gguf", &["reference-gguf-mxfp4.json"]),
            ];
            for (file, refs) in files {
                if d.join(file).exists() {
                    out.push((d.clone(), file, refs));
                }
            }
        }
    }
    out
}

fn reference(dir: &Path, names: &[&str]) -> Reference {
    for n in names {
        if let Ok(text) = std::fs::read_to_string(dir.join(n)) {
            return serde_json::from_str(&text).unwrap_or_else(|e| panic!("{n}: {e}"));
        }
    }
    panic!("{}: none of {names:?}", dir.display())
}

/// The largest |Δ| of any position over that position's max |logit|.
fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len(), "positions");
    let mut worst = 0f32;
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "vocabulary size");
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff.is_finite(), "non-finite logits");
        worst = worst.max(diff / scale);
    }
    worst
}

#[test]
fn golden_models_on_vulkan_match_transformers_and_the_cpu() {
    if device().is_none() {
        return;
    }
    let mut checked = 0;
    for (dir, file, refs) in cases() {
        let path = if file.is_empty() {
            dir.clone()
        } else {
            dir.join(file)
        };
        let label = format!(
            "{}/{}",
            dir.file_name().unwrap_or_default().to_string_lossy(),
            if file.is_empty() { "safetensors" } else { file }
        );
        let r = reference(&dir, refs);
        let be = VulkanBackend::new(None).expect("the device opened above");
        let got = logits_all(be, &path, &r.tokens);
        let cpu = logits_all(CpuBackend::exact(), &path, &r.tokens);
        let (vs_ref, vs_cpu) = (worst(&got, &r.logits), worst(&got, &cpu));
        eprintln!("{label:<44} vs transformers {vs_ref:.2e}, vs CPU exact {vs_cpu:.2e}");
        assert!(vs_ref <= 1e-4, "{label}: {vs_ref} from transformers");
        // The tiny Mistral 4 amplifies rounding: transformers' own f32 run is 5.4e-6 from
        // its float64 one (reference.json's note), and the device's order of additions
        // lands 1.2e-5 from the CPU's on its safetensors.
        let cpu_tol = if label.starts_with("mistral4") {
            2e-5
        } else {
            1e-5
        };
        assert!(
            vs_cpu <= cpu_tol,
            "{label}: {vs_cpu} from the CPU's exact path"
        );
        for (pos, g) in got.iter().enumerate() {
            assert_eq!(argmax(g), r.argmax[pos], "{label}: argmax at {pos}");
        }
        checked += 1;
    }
    assert!(checked >= 40, "only {checked} model files");
}

#[test]
fn hybrid_models_are_refused_with_the_reason() {
    let Some(be) = device() else { return };
    let path = fixtures().join("arch/qwen35/model-f32.gguf");
    let err = match Model::load(
        &ferrum_loader::ModelFile::open(&path).expect("opens"),
        be,
        &LoadOptions {
            context: Some(16),
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("a hybrid model loaded on the Vulkan backend"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("not on") && err.contains("--device cpu"),
        "{err}"
    );
}

#[test]
fn a_model_larger_than_the_device_is_refused_with_both_sizes() {
    use ferrum_backend::Backend;
    let Some(be) = device() else { return };
    let memory = be.info().memory;
    let err = be
        .reserve(memory + (1 << 30))
        .expect_err("larger than the device")
        .to_string();
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    assert!(
        err.contains(&gb(memory + (1 << 30))) && err.contains(&gb(memory)),
        "{err}"
    );
    be.reserve(memory / 2).expect("half the device fits");
}

/// An encoder on the device (its LayerNorm and GELU on the trait's host bodies, attention on
/// the device's paged kernel, ModernBERT's local layers through its window): the tiny BERT's,
/// NomicBERT's, ModernBERT's and EmbeddingGemma's embeddings within 1e-5 of
/// sentence-transformers' reference, and a cross-encoder's logits within 1e-5 of
/// transformers'.
#[test]
fn encoders_match_the_references_on_vulkan() {
    use common::{floats, ids, read_json};
    use ferrum_models::encoder::{Encoder, Input};
    for name in [
        "bert_mean",
        "nomic_mean",
        "modernbert_mean",
        "embeddinggemma",
    ] {
        let Some(be) = device() else { return };
        let dir = fixtures().join("encoders").join(name);
        let r = read_json(&dir.join("reference.json"));
        let enc = Encoder::load(&ferrum_loader::ModelFile::open(&dir).unwrap(), be).unwrap();
        let all: Vec<Vec<u32>> = r["ids"].as_array().unwrap().iter().map(ids).collect();
        let xs: Vec<Input> = all
            .iter()
            .map(|v| Input {
                ids: v,
                types: None,
            })
            .collect();
        for (i, (e, want)) in enc
            .embed(&xs)
            .unwrap()
            .iter()
            .zip(r["embeddings"].as_array().unwrap())
            .enumerate()
        {
            let d = e
                .iter()
                .zip(&floats(want))
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-5, "{name}: input {i}: embedding off by {d}");
        }
    }
    let Some(be) = device() else { return };
    let dir = fixtures().join("encoders/bert_cross");
    let r = read_json(&dir.join("reference.json"));
    let enc = Encoder::load(&ferrum_loader::ModelFile::open(&dir).unwrap(), be).unwrap();
    for i in 0..r["ids"].as_array().unwrap().len() {
        let (ids, types) = (ids(&r["ids"][i]), ids(&r["type_ids"][i]));
        let l = enc
            .classify(&[Input {
                ids: &ids,
                types: Some(&types),
            }])
            .unwrap();
        let want = floats(&r["logits"][i])[0];
        assert!(
            (l[0][0] - want).abs() < 1e-5,
            "pair {i}: {} vs {want}",
            l[0][0]
        );
    }
}
