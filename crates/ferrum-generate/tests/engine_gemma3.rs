//! The engine on the real Gemma 3 270M (15 of its 18 layers see a window of 512 positions):
//! a long sequence holds the global layers' KV plus a window per local layer, and a 2k-token
//! prefix shared with an earlier request is computed once, with the same tokens as without
//! the prefix cache (llama.cpp drops its cache for such models).

use ferrum_backend::CpuBackend;
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request, Usage};

mod common;

fn engine(prefix_caching: bool) -> Engine<CpuBackend> {
    let p = ferrum_loader::assets::gemma3_test_model_path();
    let (model, tok) = common::load(&p, CpuBackend::new(), 4096);
    let mut c = EngineConfig::for_model(&model.decoder, 4096);
    c.prefix_caching = prefix_caching;
    Engine::new(model, tok, c).unwrap()
}

/// Runs one request; returns its tokens, its usage and the most KV blocks in use at once.
fn run(e: &mut Engine<CpuBackend>, prompt: Vec<u32>) -> (Vec<u32>, Usage, usize) {
    let mut r = Request::new(prompt, 16);
    r.ignore_eos = true;
    e.add(r).unwrap();
    let (mut tokens, mut usage, mut peak) = (Vec::new(), None, 0);
    while e.has_work() {
        for o in e.step().unwrap() {
            match o.kind {
                OutputKind::Token { token, .. } => tokens.push(token),
                OutputKind::Finished { usage: u, .. } => usage = Some(u),
            }
        }
        peak = peak.max(e.stats().kv_blocks_used);
    }
    (tokens, usage.expect("finished"), peak)
}

#[test]
fn shared_2k_prefix_is_computed_once_and_local_layers_hold_a_window() {
    let passage = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/smollm2/passage.txt"
    ))
    .unwrap();
    let mut e = engine(true);
    let ids = e.tokenizer.encode(&passage, false).unwrap();
    let mut prefix = vec![2u32];
    while prefix.len() < 2048 {
        prefix.extend_from_slice(&ids);
    }
    prefix.truncate(2048);
    let with = |tail: &[u32]| [prefix.clone(), tail.to_vec()].concat();
    let (a, b) = (with(&[818, 5279, 529]), with(&[7001, 563]));

    let (_, first, peak) = run(&mut e, a);
    assert_eq!(first.cached_tokens, 0);
    // 3 global layers in one group, 15 local ones in five; blocks of 16 positions. The
    // global group holds all 2067 positions (130 blocks); a local group only what its window
    // and a 64-token pass reach (38 blocks): 320 at most, where every layer holding every
    // position would take 6 × 130 = 780.
    let groups = &e.model.decoder.kv_groups;
    assert_eq!((groups.len(), groups.slots), (6, 3));
    assert!(peak <= 130 + 5 * 38, "{peak} KV blocks at the peak");

    let (tokens, second, _) = run(&mut e, b.clone());
    assert_eq!(
        second.cached_tokens, 2048,
        "the whole prefix came from the cache"
    );
    let mut cold = engine(false);
    let (want, usage, _) = run(&mut cold, b);
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(tokens, want);
    assert!(e.kv_all_free() && cold.kv_all_free());
}
