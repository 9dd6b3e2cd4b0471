//! `ferrum logits --lora` from the outside (issue 48): the tiny Llama's logits through a
//! random PEFT adapter (the folder, on the Hugging Face model) equal peft's, and through its
//! llama.cpp GGUF conversion (on the f32 GGUF) the exact logits of llama.cpp's scaling; a bad
//! adapter is an error naming it, not a crash. Fixtures: scripts/fixtures/make_lora_adapters.py.

use std::process::Command;

fn fixtures(p: &str) -> String {
    format!("{}/../../tests/fixtures/{p}", env!("CARGO_MANIFEST_DIR"))
}

fn json(path: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn rows(v: &serde_json::Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

fn logits(model: &str, tokens: &[u64], lora: &str) -> Result<Vec<Vec<f64>>, String> {
    let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args([
            "logits", "--model", model, "--exact", "--device", "cpu", "--lora", lora,
        ])
        .arg("--tokens")
        .arg(ids.join(","))
        .output()
        .expect("runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).to_string());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    Ok(rows(&v["logits"]))
}

fn worst(got: &[Vec<f64>], want: &[Vec<f64>]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
            g.iter().zip(w).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale
        })
        .fold(0f64, f64::max)
}

#[test]
fn logits_through_an_adapter_match_the_references() {
    let dir = fixtures("lora/llama-all-r8");
    let r = json(&format!("{dir}/reference.json"));
    let tokens: Vec<u64> = r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let got = logits(&fixtures("tiny/llama"), &tokens, &dir).unwrap();
    let d = worst(&got, &rows(&r["unmerged"]));
    assert!(d < 1e-5, "PEFT folder: {d:.2e} from peft");
    let l = json(&format!("{dir}/llamacpp.json"));
    let gguf = format!("{dir}/adapter-f32.gguf");
    let got = logits(&fixtures("tiny/llama/model-f32.gguf"), &tokens, &gguf).unwrap();
    let d = worst(&got, &rows(&l["exact"]));
    assert!(d < 1e-5, "GGUF LoRA: {d:.2e} from the exact logits");
    let e = logits(&fixtures("tiny/llama"), &tokens, "/nonexistent/adapter").unwrap_err();
    assert!(
        e.contains("LoRA adapter") && e.contains("nonexistent"),
        "{e}"
    );
}
