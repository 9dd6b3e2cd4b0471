//! The real default model, SmolLM2-135M-Instruct Q4_1, teacher-forced on a fixed passage and
//! compared with the exact reference: transformers in f32 on the same weights dequantised
//! (`scripts/fixtures/smollm2_reference.py`). The model file is fetched by
//! `scripts/fetch-test-assets.sh`; without it this test fails, it does not skip.

use std::path::PathBuf;

use ferrum_backend::CpuBackend;

use serde::Deserialize;

mod common;

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    argmax: Vec<u32>,
    perplexity: f64,
}

fn model_path() -> PathBuf {
    let p = ferrum_loader::assets::default_model_path();
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-test-assets.sh",
        p.display()
    );
    p
}

fn reference() -> Reference {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/smollm2/reference.json");
    let r: Reference = serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    assert!(r.tokens.len() >= 200);
    r
}

fn check(label: &str, be: CpuBackend, min_top1: f64, max_rel_ppl: f64) {
    let r = reference();
    common::check_passage(
        &format!("SmolLM2 Q4_1 {label}"),
        &model_path(),
        be,
        &r.tokens,
        &r.argmax,
        r.perplexity,
        min_top1,
        max_rel_ppl,
    );
}

/// The fast path quantises activations to 8 bits, as llama.cpp does: the bounds.
#[test]
fn fast_backend_agrees_with_exact_reference() {
    check("fast", CpuBackend::new(), 0.94, 0.02);
}

/// With f32 activations the math is the reference's, up to summation order.
#[test]
fn exact_backend_reproduces_reference() {
    check("exact", CpuBackend::exact(), 0.99, 0.001);
}
