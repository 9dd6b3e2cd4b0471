//! `ferrum plan` from the outside on the models that are not chat models: an encoder (an
//! embedding model, a cross-encoder) keeps no KV cache, so its plan is its weights, the 8-bit
//! copies of its float matrices and one pass; a Gemma 4 with KV-shared layers counts only the
//! layers that keep a cache.

use std::process::Command;

fn plan(model: &str) -> serde_json::Value {
    let path = format!(
        "{}/../../tests/fixtures/{model}",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(["plan", &path, "--json"])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "plan {model}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("plan {model}: {e}: {stdout}"))
}

#[test]
fn encoders_are_planned_without_a_kv_cache() {
    let e = plan("encoders/bert_mean");
    assert_eq!(e["kind"], "embedding model");
    assert_eq!(e["kv_bytes"], 0);
    let st = std::fs::metadata(format!(
        "{}/../../tests/fixtures/encoders/bert_mean/model.safetensors",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
    .len() as f64;
    let w = e["weights_bytes"].as_f64().unwrap();
    assert!(w >= st, "weights {w} below the safetensors' {st}");
    assert!(e["activation_bytes"].as_f64().unwrap() > 0.0);
    let total = e["total_bytes"].as_f64().unwrap();
    assert!(total > w, "{e}");
    let r = plan("encoders/bert_cross.gguf");
    assert_eq!(r["kind"], "reranker");
}

#[test]
fn kv_shared_layers_keep_no_cache() {
    let g = plan("arch/gemma4/model-f32.gguf");
    assert_eq!(g["kv_shared_layers"], 2);
    // Layers 0 (local: 2 KV heads of 8) and 1 (global: 1 of 16) keep keys and values, in f16:
    // (16 + 16) values × 2 × 2 bytes; layers 2 and 3 read theirs.
    assert_eq!(g["kv_bytes_per_token"].as_f64().unwrap(), 128.0);
    let moe = plan("arch/gemma4-moe/model-f32.gguf");
    assert_eq!(moe["kv_shared_layers"], 0);
    assert_eq!(moe["kv_bytes_per_token"].as_f64().unwrap(), 256.0);
}
