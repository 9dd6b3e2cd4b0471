//! LoRA adapters through the engine (issue 48), on the tiny random Llama with the random PEFT
//! adapters of `tests/fixtures/lora`: requests for the base model and three adapters batched
//! together each get the tokens they get alone; the prefix cache keeps each adapter's keys
//! and values apart (and still serves a prompt again to the same adapter); an adapter that is
//! not attached is refused.

use std::collections::HashMap;
use std::path::PathBuf;

use ferrum_backend::CpuBackend;
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request, RequestId, Usage};
use ferrum_loader::ModelFile;
use ferrum_models::lora::AdapterSource;
use ferrum_models::{LoadOptions, Model};
use ferrum_tokenizer::Tokenizer;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

/// The tiny Llama's engine with the adapters attached; their ids in order.
fn engine(adapters: &[&str]) -> (Engine<CpuBackend>, Vec<usize>) {
    let dir = fixtures().join("tiny/llama");
    let file = ModelFile::open(&dir).unwrap();
    let mut model = Model::load(&file, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let ids = adapters
        .iter()
        .map(|a| {
            let path = fixtures().join("lora").join(a);
            let src = AdapterSource {
                path: &path,
                scale: 1.0,
            };
            model.load_adapter(a, &src).unwrap()
        })
        .collect();
    let config = EngineConfig {
        block_size: 4,
        kv_blocks: 64,
        max_batch_tokens: 64,
        max_running: 8,
        prefix_caching: true,
        spec_tokens: 0,
        state_snapshots: 4,
    };
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    (Engine::new(model, tok, config).unwrap(), ids)
}

fn request(prompt: &[u32], adapter: usize) -> Request {
    let mut r = Request::new(prompt.to_vec(), 12);
    r.ignore_eos = true;
    r.adapter = adapter;
    r
}

/// Runs until every request added is done: each one's tokens and usage.
fn run_all(e: &mut Engine<CpuBackend>) -> HashMap<RequestId, (Vec<u32>, Usage)> {
    let mut out: HashMap<RequestId, (Vec<u32>, Usage)> = HashMap::new();
    while e.has_work() {
        for o in e.step().unwrap() {
            let entry = out.entry(o.id).or_default();
            match o.kind {
                OutputKind::Token { token, .. } => entry.0.push(token),
                OutputKind::Finished { usage, .. } => entry.1 = usage,
            }
        }
    }
    out
}

const PROMPT: &[u32] = &[382, 296, 258, 260, 79, 268, 77, 70, 258, 295, 322, 279, 375];

#[test]
fn mixed_batches_give_each_request_its_tokens_alone() {
    let names = ["llama-attn-r4", "llama-mlp-r16-rslora", "llama-all-r8"];
    let (mut e, ids) = engine(&names);
    let adapters = [0, ids[0], ids[1], ids[2]];
    let prompts: Vec<Vec<u32>> = (0..8).map(|k| PROMPT[k % 3..].to_vec()).collect();
    // Alone: one at a time, a fresh engine each, so nothing is shared.
    let mut alone = Vec::new();
    for (k, p) in prompts.iter().enumerate() {
        let (mut e1, ids1) = engine(&names);
        let a = [0, ids1[0], ids1[1], ids1[2]][k % 4];
        let id = e1.add(request(p, a)).unwrap();
        alone.push(run_all(&mut e1).remove(&id).unwrap().0);
    }
    // Together, the base model and every adapter in the same passes.
    let req_ids: Vec<RequestId> = prompts
        .iter()
        .enumerate()
        .map(|(k, p)| e.add(request(p, adapters[k % 4])).unwrap())
        .collect();
    let mut together = run_all(&mut e);
    for (k, id) in req_ids.iter().enumerate() {
        let got = together.remove(id).unwrap().0;
        assert_eq!(got, alone[k], "request {k} (adapter {})", adapters[k % 4]);
    }
    // The adapters change the answer: otherwise the check above proves nothing.
    let distinct: std::collections::HashSet<&Vec<u32>> = alone[..4].iter().collect();
    assert!(distinct.len() >= 3, "{alone:?}");
}

#[test]
fn the_prefix_cache_keeps_adapters_apart() {
    let (mut e, ids) = engine(&["llama-attn-r4", "llama-all-r8"]);
    let id = e.add(request(PROMPT, ids[0])).unwrap();
    let first = run_all(&mut e).remove(&id).unwrap();
    assert_eq!(first.1.cached_tokens, 0);
    // The same prompt again through the same adapter: served from the cache, same answer.
    let id = e.add(request(PROMPT, ids[0])).unwrap();
    let again = run_all(&mut e).remove(&id).unwrap();
    assert!(again.1.cached_tokens >= 8, "{:?}", again.1);
    assert_eq!(again.0, first.0);
    // Through another adapter and through the base model: nothing cached (the keys and
    // values differ), and their own answers.
    for a in [ids[1], 0] {
        let id = e.add(request(PROMPT, a)).unwrap();
        let other = run_all(&mut e).remove(&id).unwrap();
        assert_eq!(
            other.1.cached_tokens, 0,
            "adapter {a} reused another's blocks"
        );
        let (mut fresh, fresh_ids) = engine(&["llama-attn-r4", "llama-all-r8"]);
        let fa = if a == 0 { 0 } else { fresh_ids[1] };
        let fid = fresh.add(request(PROMPT, fa)).unwrap();
        assert_eq!(other.0, run_all(&mut fresh).remove(&fid).unwrap().0);
    }
}

#[test]
fn an_adapter_not_attached_is_refused() {
    let (mut e, ids) = engine(&["llama-attn-r4"]);
    let err = e.add(request(PROMPT, ids[0] + 1)).unwrap_err().to_string();
    assert!(err.contains("LoRA adapter"), "{err}");
    // Detached: refused from then on.
    assert!(e.model.decoder.remove_adapter(ids[0]).is_some());
    let err = e.add(request(PROMPT, ids[0])).unwrap_err().to_string();
    assert!(err.contains("LoRA adapter"), "{err}");
    assert!(e.add(request(PROMPT, 0)).is_ok());
}
