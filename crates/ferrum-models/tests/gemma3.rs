//! The real Gemma 3 270M Q4_K_M (sliding-window layers, GeGLU, four norms a layer, a 262k
//! vocabulary), teacher-forced on a fixed passage and compared with the exact reference:
//! transformers in f32 on the same weights dequantised (`scripts/fixtures/gemma3_reference.py`).
//! The file is fetched by `scripts/fetch-test-assets.sh`; without it this test fails.

use std::path::PathBuf;

use ferrum_backend::CpuBackend;
use ferrum_models::{LoadOptions, Logits, Model};
use serde::Deserialize;

mod common;
use common::argmax;

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    argmax: Vec<u32>,
    perplexity: f64,
}

#[derive(Deserialize)]
struct Greedy {
    prompt_tokens: Vec<u32>,
    continuation_tokens: Vec<u32>,
}

fn model_path() -> PathBuf {
    let p = ferrum_loader::assets::gemma3_test_model_path();
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-test-assets.sh",
        p.display()
    );
    p
}

fn fixture<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gemma3")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn check(label: &str, be: CpuBackend, min_top1: f64, max_rel_ppl: f64) {
    let r: Reference = fixture("reference.json");
    assert!(r.tokens.len() >= 200);
    common::check_passage(
        &format!("Gemma 3 270M Q4_K_M {label}"),
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

/// Greedy decoding token by token (through the KV cache) gives transformers' continuation.
#[test]
fn greedy_continuation_matches_transformers() {
    let g: Greedy = fixture("prompt_greedy.json");
    let mut m = Model::open(
        model_path(),
        CpuBackend::exact(),
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    let mut kv = m.decoder.alloc_kv_tokens(64);
    let mut logits = m
        .decoder
        .forward(&mut kv, &g.prompt_tokens, 0, Logits::Last)
        .unwrap();
    let start = g.prompt_tokens.len();
    let mut got = Vec::new();
    for pos in start..start + g.continuation_tokens.len() {
        let t = argmax(&logits);
        got.push(t);
        logits = m.decoder.forward(&mut kv, &[t], pos, Logits::Last).unwrap();
    }
    assert_eq!(got, g.continuation_tokens);
}
