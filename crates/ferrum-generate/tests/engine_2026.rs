//! The 2026 families through the engine (tiny random-weight GGUFs of
//! `tests/fixtures/arch/`, made by scripts/fixtures/make_2026_models.py): a continuation
//! whose prefix an earlier request left in the prefix cache gives the tokens a cold engine
//! gives, and requests batched together give the tokens each gets alone. For the latent
//! attention models (DeepSeek-V3, Mistral 4) that is the latent cache, shared blocks and all;
//! for Gemma 4, caches of two row shapes, windowed blocks given back, and layers that read
//! another layer's cache.

use ferrum_backend::CpuBackend;
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request};

mod common;

const MODELS: &[&str] = &[
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
];

fn engine(name: &str, prefix_caching: bool) -> Engine<CpuBackend> {
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/arch")
        .join(name)
        .join("model-q8_0.gguf");
    let (model, tok) = common::load(&p, CpuBackend::new(), 128);
    let mut c = EngineConfig::for_model(&model.decoder, 512);
    c.prefix_caching = prefix_caching;
    Engine::new(model, tok, c).unwrap()
}

/// Runs `prompts` together; returns each one's tokens and cached prompt tokens.
fn run(e: &mut Engine<CpuBackend>, prompts: &[Vec<u32>]) -> Vec<(Vec<u32>, usize)> {
    let mut ids = Vec::new();
    for p in prompts {
        let mut r = Request::new(p.clone(), 12);
        r.ignore_eos = true;
        ids.push(e.add(r).unwrap());
    }
    let mut out = vec![(Vec::new(), 0); prompts.len()];
    while e.has_work() {
        for o in e.step().unwrap() {
            let i = ids.iter().position(|&id| id == o.id).unwrap();
            match o.kind {
                OutputKind::Token { token, .. } => out[i].0.push(token),
                OutputKind::Finished { usage, .. } => out[i].1 = usage.cached_tokens,
            }
        }
    }
    out
}

#[test]
fn prefix_cached_and_batched_equal_cold_and_alone() {
    // 40 shared tokens (two whole blocks of 16 cached), then two different tails.
    let prefix: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 300 + 20).collect();
    let with = |tail: &[u32]| [prefix.clone(), tail.to_vec()].concat();
    let (a, b) = (with(&[101, 202, 33]), with(&[7, 8]));
    for name in MODELS {
        let mut cold = engine(name, false);
        let alone_a = run(&mut cold, std::slice::from_ref(&a)).remove(0).0;
        let alone_b = run(&mut cold, std::slice::from_ref(&b)).remove(0).0;

        let mut warm = engine(name, true);
        run(&mut warm, std::slice::from_ref(&a));
        let (tokens, cached) = run(&mut warm, std::slice::from_ref(&b)).remove(0);
        assert_eq!(
            cached, 32,
            "{name}: the prefix's whole blocks came from the cache"
        );
        assert_eq!(tokens, alone_b, "{name}: prefix-cached continuation");

        let mut batch = engine(name, false);
        let both = run(&mut batch, &[a.clone(), b.clone()]);
        assert_eq!(both[0].0, alone_a, "{name}: first request batched");
        assert_eq!(both[1].0, alone_b, "{name}: second request batched");
        assert!(cold.kv_all_free() && warm.kv_all_free() && batch.kv_all_free());
    }
}
