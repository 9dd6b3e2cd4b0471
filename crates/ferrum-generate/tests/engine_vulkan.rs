//! The engine on the Vulkan backend (lavapipe here and in CI) with the real default model,
//! SmolLM2: eight chat prompts answered greedily together give, token for token, what the
//! CPU's exact path gives (both compute in f32 from the same dequantised weights); a request
//! answers the same alone as beside three others; prompt-lookup speculation and the prefix
//! cache change nothing. Skipped without a device unless `FERRUM_REQUIRE_VULKAN=1`.

mod common;

use std::collections::HashMap;

use ferrum_backend::vulkan::test_device as device;
use ferrum_backend::{Backend, CpuBackend};
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request};

const PROMPTS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What colour is the sky on a clear day?",
    "Give me a tip for learning to cook.",
    "Name a famous painting.",
];
const TOKENS: usize = 64;

fn engine<B: Backend>(be: B, spec_tokens: usize) -> Engine<B> {
    let (m, t) = common::load(&ferrum_loader::assets::default_model_path(), be, 512);
    let mut c = EngineConfig::with_kv_tokens(8 * 256);
    c.spec_tokens = spec_tokens;
    Engine::new(m, t, c).expect("engine")
}

/// Greedy answers of `tokens` tokens to `prompts`, all added before the first step.
fn answer<B: Backend>(e: &mut Engine<B>, prompts: &[Vec<u32>], tokens: usize) -> Vec<Vec<u32>> {
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| {
            // Past the end of turn too: every answer is TOKENS long.
            let mut r = Request::new(p.clone(), tokens);
            r.ignore_eos = true;
            e.add(r).expect("added")
        })
        .collect();
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut done = 0;
    while done < ids.len() {
        for o in e.step().expect("step") {
            match o.kind {
                OutputKind::Token { token, .. } => out.entry(o.id).or_default().push(token),
                OutputKind::Finished { .. } => done += 1,
            }
        }
    }
    ids.iter()
        .map(|id| out.remove(id).unwrap_or_default())
        .collect()
}

#[test]
fn greedy_answers_equal_the_cpus_alone_beside_others_and_speculating() {
    let Some(be) = device() else { return };
    let mut gpu = engine(be, 0);
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|q| common::chat(&gpu.tokenizer, q))
        .collect();
    let on_gpu = answer(&mut gpu, &prompts, TOKENS);
    let mut cpu = engine(CpuBackend::exact(), 0);
    let on_cpu = answer(&mut cpu, &prompts, TOKENS);
    for (i, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
        assert_eq!(g.len(), TOKENS, "prompt {i}");
        assert_eq!(g, c, "prompt {i}: Vulkan and the CPU's exact path differ");
    }
    // Alone: the first prompt again (its prefix now cached), then beside three others.
    let alone = answer(&mut gpu, &prompts[..1], TOKENS);
    assert_eq!(alone[0], on_gpu[0], "alone vs in the batch of eight");
    // Lavapipe is slow: the batch of four and the speculating run check the answers' starts.
    let four = answer(&mut gpu, &prompts[4..8], 16);
    for (i, f) in four.iter().enumerate() {
        assert_eq!(
            f[..],
            on_gpu[4 + i][..16],
            "beside three others vs beside seven"
        );
    }
    drop(gpu);
    let mut spec = engine(device().expect("the device opened above"), 4);
    let drafted = answer(&mut spec, &prompts[..1], 32);
    assert_eq!(
        drafted[0][..],
        on_gpu[0][..32],
        "prompt-lookup speculation changed it"
    );
}
