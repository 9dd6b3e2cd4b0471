//! Qwen3-MoE against transformers: tiny random `Qwen3MoeForCausalLM` models (top-2 and top-4,
//! renormalised or not, a dense layer among sparse ones, a sparse step of 2) made by
//! `scripts/fixtures/make_moe_models.py`, as safetensors and — where GGUF can express the
//! model — f32, f16 and q8_0 GGUF from llama.cpp's converter.

use std::path::PathBuf;

use ferrum_backend::CpuBackend;
use ferrum_models::moe::Router;
use ferrum_models::{LoadOptions, Logits, Model, ModelConfig};
use serde::Deserialize;

mod common;
use common::{argmax, assert_close};

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    argmax: Vec<u32>,
    /// layer → token → [(expert, weight)], highest first.
    routing: std::collections::BTreeMap<String, Vec<Vec<(usize, f32)>>>,
    router_logits: std::collections::BTreeMap<String, Vec<Vec<f32>>>,
}

const SAFETENSORS: &[&str] = &[
    "qwen3moe-top2",
    "qwen3moe-top4-nonorm",
    "qwen3moe-top2-sparse2",
    "qwen3moe-gguf",
];

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/moe")
        .join(name)
}

fn reference(name: &str, file: &str) -> Reference {
    let p = dir(name).join(file);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

fn load(be: CpuBackend, path: PathBuf) -> Model<CpuBackend> {
    Model::open(
        &path,
        be,
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn logits(m: &mut Model<CpuBackend>, tokens: &[u32]) -> Vec<Vec<f32>> {
    let v = m.decoder.config.vocab_size;
    let mut kv = m.decoder.alloc_kv_tokens(64);
    let all = m.decoder.forward(&mut kv, tokens, 0, Logits::All).unwrap();
    all.chunks(v).map(|r| r.to_vec()).collect()
}

#[test]
fn safetensors_match_transformers() {
    for name in SAFETENSORS {
        let r = reference(name, "reference.json");
        let mut m = load(CpuBackend::exact(), dir(name));
        assert!(m.decoder.config.moe.is_some(), "{name}: loaded without MoE");
        assert_close(
            &format!("{name}/safetensors"),
            &logits(&mut m, &r.tokens),
            &r.logits,
        );
    }
}

#[test]
fn gguf_f32_matches_and_quantised_files_agree() {
    let name = "qwen3moe-gguf";
    let r = reference(name, "reference.json");
    let mut m = load(CpuBackend::exact(), dir(name).join("model-f32.gguf"));
    assert_close("qwen3moe-gguf/f32", &logits(&mut m, &r.tokens), &r.logits);
    for (file, refname) in [
        ("model-f16.gguf", "reference-f16.json"),
        ("model-q8_0.gguf", "reference-q8_0.json"),
    ] {
        // Exact backend: the logits of transformers on the same dequantised weights, and the
        // f32 model's argmax at every position.
        let exact = reference(name, refname);
        let got = logits(
            &mut load(CpuBackend::exact(), dir(name).join(file)),
            &r.tokens,
        );
        assert_close(&format!("{name}/{file} (exact)"), &got, &exact.logits);
        let ours: Vec<u32> = got.iter().map(|row| argmax(row)).collect();
        assert_eq!(ours, r.argmax, "{name}/{file}: argmax");
        // Fast backend (8-bit activations for q8_0): argmax at every position too.
        let fast = logits(
            &mut load(CpuBackend::new(), dir(name).join(file)),
            &r.tokens,
        );
        let ours: Vec<u32> = fast.iter().map(|row| argmax(row)).collect();
        assert_eq!(ours, r.argmax, "{name}/{file}: fast argmax");
    }
}

#[test]
fn router_reproduces_transformers_routing() {
    for name in SAFETENSORS {
        let r = reference(name, "reference.json");
        let cfg: ModelConfig = load(CpuBackend::new(), dir(name)).decoder.config.clone();
        let moe = cfg.moe.as_ref().unwrap();
        let mut router = Router::new(moe);
        let mut layers_seen = 0;
        for layer in 0..cfg.n_layers {
            let key = layer.to_string();
            assert_eq!(
                moe.is_moe_layer(layer),
                r.routing.contains_key(&key),
                "{name}: layer {layer} kind"
            );
            let (Some(routes), Some(logits)) = (r.routing.get(&key), r.router_logits.get(&key))
            else {
                continue;
            };
            layers_seen += 1;
            for (t, (want, l)) in routes.iter().zip(logits).enumerate() {
                let got = router.route_token(l, None);
                assert_eq!(got.len(), want.len());
                for ((ge, gw), (we, ww)) in got.iter().zip(want) {
                    assert_eq!(ge, we, "{name}: layer {layer} token {t}");
                    assert!(
                        (gw - ww).abs() < 1e-6,
                        "{name}: layer {layer} token {t}: {gw} vs {ww}"
                    );
                }
            }
        }
        assert!(layers_seen > 0);
    }
}

/// Prefill in one batch (experts grouped over all tokens), in chunks, and token by token
/// (the decode path) give the same last-position logits.
#[test]
fn prefill_chunked_and_decode_agree() {
    for file in ["model-f32.gguf", "model-q8_0.gguf"] {
        let path = dir("qwen3moe-gguf").join(file);
        let r = reference("qwen3moe-gguf", "reference.json");
        let n = r.tokens.len();
        let mut m = load(CpuBackend::new(), path.clone());
        let mut kv = m.decoder.alloc_kv_tokens(64);
        let whole = m
            .decoder
            .forward(&mut kv, &r.tokens, 0, Logits::Last)
            .unwrap();
        let mut m = load(CpuBackend::new(), path.clone());
        let mut kv = m.decoder.alloc_kv_tokens(64);
        m.decoder
            .forward(&mut kv, &r.tokens[..5], 0, Logits::Last)
            .unwrap();
        m.decoder
            .forward(&mut kv, &r.tokens[5..11], 5, Logits::Last)
            .unwrap();
        let chunked = m
            .decoder
            .forward(&mut kv, &r.tokens[11..], 11, Logits::Last)
            .unwrap();
        let mut m = load(CpuBackend::new(), path);
        let mut kv = m.decoder.alloc_kv_tokens(64);
        let mut decoded = Vec::new();
        for (i, &t) in r.tokens.iter().enumerate() {
            decoded = m.decoder.forward(&mut kv, &[t], i, Logits::Last).unwrap();
        }
        let stats = m.decoder.expert_stats().unwrap();
        let routed: u64 = stats.iter().flatten().sum();
        assert_eq!(
            routed as usize,
            n * 2 * 3,
            "every token routed to 2 experts in 3 layers"
        );
        let scale = whole.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (label, other) in [("chunked", &chunked), ("decode", &decoded)] {
            for (a, b) in whole.iter().zip(other.iter()) {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "{file}: {label} {b} vs one batch {a}"
                );
            }
        }
    }
}
