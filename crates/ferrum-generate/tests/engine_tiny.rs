//! The engine's bookkeeping under stress, on a tiny random Llama (fast): random arrivals,
//! lengths and cancellations against a deliberately small KV pool. Every request finishes or
//! is refused with a reason, no block leaks, nothing panics — and greedy outputs equal the
//! same requests run alone, so preemption and recomputation, prefix reuse and batching
//! change nothing. The same on a tiny random Gemma 3 (a window of 6 positions in five of its
//! six layers), whose windowed KV groups give blocks back as sequences grow.

use std::collections::HashMap;
use std::path::PathBuf;

use ferrum_backend::CpuBackend;
use ferrum_generate::{Engine, EngineConfig, FinishReason, OutputKind, Request};
use ferrum_loader::ModelFile;
use ferrum_models::{LoadOptions, Logits, Model};
use ferrum_tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};

fn engine(config: EngineConfig) -> Engine<CpuBackend> {
    engine_of("tiny/llama", config)
}

fn engine_of(fixture: &str, config: EngineConfig) -> Engine<CpuBackend> {
    let (model, tok) = fixture_model(fixture);
    Engine::new(model, tok, config).unwrap()
}

fn small(blocks: usize, bs: usize, budget: usize) -> EngineConfig {
    EngineConfig {
        block_size: bs,
        kv_blocks: blocks,
        max_batch_tokens: budget,
        max_running: 8,
        prefix_caching: true,
        spec_tokens: 0,
        state_snapshots: 4,
    }
}

struct Spec {
    prompt: Vec<u32>,
    max_tokens: usize,
    arrive: usize,
    cancel: Option<usize>,
}

#[derive(Default, Debug)]
struct Outcome {
    tokens: Vec<u32>,
    finish: Option<(FinishReason, usize)>,
    /// Prompt tokens that came from the prefix cache.
    cached: usize,
}

/// Runs `specs` (arrival and cancellation by step number) to completion; returns the outcome
/// of each accepted request and the refusals.
fn drive(e: &mut Engine<CpuBackend>, specs: &[Spec]) -> (Vec<Option<Outcome>>, Vec<String>) {
    let mut ids: Vec<Option<u64>> = vec![None; specs.len()];
    let mut outcomes: HashMap<u64, Outcome> = HashMap::new();
    let mut refused = Vec::new();
    let last_arrival = specs.iter().map(|s| s.arrive).max().unwrap_or(0);
    let mut step = 0;
    while step <= last_arrival || e.has_work() {
        for (i, s) in specs.iter().enumerate() {
            if s.arrive == step {
                let mut r = Request::new(s.prompt.clone(), s.max_tokens);
                r.ignore_eos = true;
                match e.add(r) {
                    Ok(id) => {
                        ids[i] = Some(id);
                        outcomes.insert(id, Outcome::default());
                    }
                    Err(err) => refused.push(err.to_string()),
                }
            }
            if s.cancel == Some(step) {
                if let Some(id) = ids[i] {
                    e.cancel(id);
                }
            }
        }
        for o in e.step().expect("a step never fails on valid requests") {
            let out = outcomes.get_mut(&o.id).expect("events only for known ids");
            assert!(
                out.finish.is_none(),
                "event after the end of request {}",
                o.id
            );
            match o.kind {
                OutputKind::Token { token, .. } => out.tokens.push(token),
                OutputKind::Finished { reason, usage, .. } => {
                    assert_eq!(usage.completion_tokens, out.tokens.len());
                    out.finish = Some((reason, usage.prompt_tokens));
                    out.cached = usage.cached_tokens;
                }
            }
        }
        step += 1;
        assert!(step < 10_000, "the engine stopped making progress");
    }
    let res = ids
        .iter()
        .map(|id| id.map(|id| outcomes.remove(&id).unwrap()))
        .collect();
    (res, refused)
}

#[test]
fn random_traffic_on_a_tiny_pool_finishes_everything_and_leaks_nothing() {
    // 12 blocks of 4: 48 positions shared by up to 8 sequences.
    random_traffic("tiny/llama", 12, 64, Drafts::None);
}

/// The same traffic with speculative decoding fed noise drafts (now and then a prompt-lookup
/// one): the same tokens as each request run alone without speculation, through preemption
/// mid-draft, eviction and cancellation.
#[test]
fn random_traffic_with_noise_drafts_gives_the_plain_answers() {
    random_traffic("tiny/llama", 12, 64, Drafts::Noise);
    random_traffic("arch/gemma3", 60, 400, Drafts::Noise);
}

/// A draft model of the same vocabulary under the same traffic: its rows share the target's
/// blocks, survive preemption and come back with prefix-cache hits — and the answers are
/// still the plain ones. The model drafting for itself has every draft kept (so a wrong row
/// would show); other random weights have most rejected.
#[test]
fn random_traffic_with_a_draft_model_gives_the_plain_answers() {
    random_traffic("tiny/llama", 12, 64, Drafts::Model("tiny/llama"));
    random_traffic("tiny/qwen3", 12, 64, Drafts::Model("tiny/qwen2"));
    // A windowed target: the draft uses its full-attention group's tables. (Every tiny Gemma
    // has windows, which a draft may not; the tiny Llama's random weights, of the same 384
    // ids, draft under the Gemma tokenizer.)
    random_traffic("arch/gemma3", 60, 400, Drafts::Model("tiny/llama"));
}

#[derive(Clone, Copy)]
enum Drafts {
    None,
    Noise,
    Model(&'static str),
}

fn fixture_model(fixture: &str) -> (Model<CpuBackend>, Tokenizer) {
    let dir =
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(fixture);
    let file = ModelFile::open(&dir).unwrap();
    let model = Model::load(&file, CpuBackend::new(), &LoadOptions::default()).unwrap();
    (model, Tokenizer::from_hf_dir(&dir).unwrap())
}

struct Noise {
    rng: rand::rngs::StdRng,
    vocab: u32,
}

impl ferrum_generate::spec::Drafter for Noise {
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32> {
        let mut d = ferrum_generate::spec::NgramDrafter.propose(tokens, max);
        if d.is_empty() || self.rng.gen_bool(0.3) {
            let n = self.rng.gen_range(0..=max);
            d = (0..n).map(|_| self.rng.gen_range(0..self.vocab)).collect();
        }
        d
    }
}

/// Gemma 3's six layers are six KV groups of one layer, five of them windowed: 60 blocks
/// hold one sequence of 80 positions.
#[test]
fn random_traffic_with_windowed_layers_finishes_everything_and_leaks_nothing() {
    random_traffic("arch/gemma3", 60, 400, Drafts::None);
    // gpt-oss: two KV groups (sliding and full layers alternate), sinks, routed experts.
    random_traffic("arch/gpt-oss", 24, 140, Drafts::None);
}

/// Hybrid models (Qwen3.5: Gated DeltaNet layers with a recurrent state per sequence, and
/// gated full attention): under the same traffic — preemption, cancellation, prefix-cache
/// hits that resume from state snapshots, a few snapshot slots reused — every request gives
/// the tokens it gives alone, and no block or state slot leaks.
#[test]
fn random_traffic_on_hybrid_models_finishes_everything_and_leaks_nothing() {
    random_traffic("arch/qwen35", 12, 64, Drafts::None);
    random_traffic("arch/qwen35-moe", 12, 64, Drafts::None);
}

/// A hybrid model's second request extending the first one's prompt resumes from the state
/// snapshot at that prompt's last block boundary: it computes only the rest, reports the
/// cached tokens, and answers as a cold engine does. Over many requests the snapshots stay
/// within their slots.
#[test]
fn hybrid_prefix_cache_resumes_from_a_state_snapshot() {
    let config = EngineConfig {
        state_snapshots: 3,
        ..small(400, 16, 64)
    };
    let mut e = engine_of("arch/qwen35", config.clone());
    let vocab = e.model.decoder.config.vocab_size as u32;
    let mut r = rand::rngs::StdRng::seed_from_u64(7);
    let first: Vec<u32> = (0..150).map(|_| r.gen_range(0..vocab)).collect();
    let mut second = first.clone();
    second.extend((0..40).map(|_| r.gen_range(0..vocab)));
    let run = |e: &mut Engine<CpuBackend>, prompt: &[u32]| {
        let spec = [Spec {
            prompt: prompt.to_vec(),
            max_tokens: 8,
            arrive: 0,
            cancel: None,
        }];
        drive(e, &spec).0.remove(0).unwrap()
    };
    let a = run(&mut e, &first);
    let b = run(&mut e, &second);
    // The first prompt's last block boundary: 144 of its 150 tokens.
    assert_eq!(b.cached, 144);
    let st = e.stats().states;
    assert_eq!((st.hits, st.tokens_saved), (1, 144), "{st:?}");
    let mut cold = engine_of("arch/qwen35", config.clone());
    assert_eq!(run(&mut cold, &second).tokens, b.tokens);
    assert_eq!(run(&mut cold, &first).tokens, a.tokens);
    // Many distinct prompts: the snapshots never outgrow their slots.
    for i in 0..60 {
        let p: Vec<u32> = (0..20 + i % 7).map(|_| r.gen_range(0..vocab)).collect();
        run(&mut e, &p);
        assert!(e.stats().states.held <= 3);
    }
    assert!(e.stats().states.evictions > 0);
    assert!(e.kv_all_free());
}

fn random_traffic(fixture: &str, tight: usize, roomy: usize, drafts: Drafts) {
    let spec = !matches!(drafts, Drafts::None);
    let (mut drafted, mut accepted) = (0, 0);
    let mut preemptions = 0;
    let mut evictions = 0;
    let mut state_hits = 0;
    let mut checked = 0;
    for seed in 0..12u64 {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        let mut e = engine_of(
            fixture,
            EngineConfig {
                spec_tokens: if spec { 4 } else { 0 },
                ..small(tight, 4, 16)
            },
        );
        match drafts {
            Drafts::None => {}
            Drafts::Noise => {
                let vocab = e.model.decoder.config.vocab_size as u32;
                e.set_drafter(Box::new(Noise {
                    rng: rand::rngs::StdRng::seed_from_u64(seed + 99),
                    vocab,
                }));
            }
            Drafts::Model(d) => {
                let (m, t) = fixture_model(d);
                let t = if fixture.starts_with("arch/gemma3") {
                    fixture_model(fixture).1
                } else {
                    t
                };
                e.set_draft_model(m, &t).unwrap();
                // As large as the model, it would not be used: count it as a tenth.
                e.set_draft_cost(0.1);
            }
        }
        let vocab = e.model.decoder.config.vocab_size as u32;
        // A few prompts share a prefix, so the prefix cache is exercised too.
        let shared: Vec<u32> = (0..9).map(|_| r.gen_range(0..vocab)).collect();
        let specs: Vec<Spec> = (0..10)
            .map(|_| {
                let len = r.gen_range(1..56);
                let mut prompt: Vec<u32> = (0..len).map(|_| r.gen_range(0..vocab)).collect();
                if r.gen_bool(0.3) {
                    prompt.splice(0..0, shared.iter().copied());
                }
                let arrive = r.gen_range(0..30);
                Spec {
                    prompt,
                    max_tokens: r.gen_range(1..24),
                    arrive,
                    cancel: r.gen_bool(0.2).then(|| arrive + r.gen_range(0..10)),
                }
            })
            .collect();
        let (outcomes, refused) = drive(&mut e, &specs);
        for msg in &refused {
            assert!(msg.contains("fit"), "refusal without a reason: {msg}");
        }
        for (s, o) in specs.iter().zip(&outcomes) {
            match o {
                None => assert!(s.prompt.len() >= e.max_sequence(), "refused needlessly"),
                Some(o) => {
                    let (reason, _) = o.finish.expect("every request finishes");
                    match reason {
                        FinishReason::Length => assert!(
                            o.tokens.len() == s.max_tokens
                                || s.prompt.len() + o.tokens.len() >= e.max_sequence()
                        ),
                        FinishReason::Cancelled => assert!(s.cancel.is_some()),
                        FinishReason::Stop => panic!("nothing should stop: EOS is ignored"),
                    }
                }
            }
        }
        assert!(!e.has_work());
        assert!(e.kv_all_free(), "seed {seed}: blocks leaked");
        let st = e.stats();
        preemptions += st.preemptions;
        evictions += st.prefix.evictions;
        state_hits += st.states.hits;
        drafted += st.drafted_tokens;
        accepted += st.accepted_tokens;

        // Alone, with a roomy pool, each finished request produces the same tokens.
        let mut alone = engine_of(fixture, small(roomy, 4, 16));
        for (s, o) in specs.iter().zip(&outcomes) {
            let Some(Outcome {
                tokens,
                finish: Some((FinishReason::Length, _)),
                ..
            }) = o
            else {
                continue;
            };
            let solo = [Spec {
                prompt: s.prompt.clone(),
                max_tokens: tokens.len(),
                arrive: 0,
                cancel: None,
            }];
            let (solo_out, _) = drive(&mut alone, &solo);
            let solo_tokens = &solo_out[0].as_ref().unwrap().tokens;
            assert_eq!(solo_tokens, tokens, "seed {seed}: batched output differs");
            checked += 1;
        }
    }
    assert!(
        preemptions > 0,
        "the pool was never tight enough to preempt"
    );
    assert!(evictions > 0, "cached blocks were never reclaimed");
    if fixture.starts_with("arch/qwen35") {
        // Preempted sequences come back through their own prompt's snapshot.
        assert!(state_hits > 0, "no request resumed from a state snapshot");
    }
    assert!(checked > 50, "too few requests compared ({checked})");
    match drafts {
        Drafts::None => {}
        // Noise is mostly rejected, so drafting soon pauses; the draft model drafting for
        // itself is where kept drafts are exercised.
        Drafts::Noise => assert!(
            drafted > 0 && accepted < drafted,
            "{accepted} of {drafted} drafts kept"
        ),
        Drafts::Model(d) if d == fixture => {
            assert!(
                drafted > 0 && accepted == drafted,
                "{accepted} of {drafted} drafts kept"
            )
        }
        Drafts::Model(_) => assert!(drafted > 0, "nothing drafted"),
    }
}

#[test]
fn prompts_that_can_never_fit_are_refused_and_bad_requests_named() {
    let mut e = engine(small(4, 4, 16));
    let err = e.add(Request::new(vec![1; 16], 4)).unwrap_err().to_string();
    assert!(err.contains("at most 15 fit"), "{err}");
    let err = e.add(Request::new(vec![], 4)).unwrap_err().to_string();
    assert!(err.contains("empty"), "{err}");
    let err = e
        .add(Request::new(vec![u32::MAX], 4))
        .unwrap_err()
        .to_string();
    assert!(err.contains("vocabulary"), "{err}");
    // The engine still serves after refusing.
    let (out, _) = drive(
        &mut e,
        &[Spec {
            prompt: vec![1, 2, 3],
            max_tokens: 3,
            arrive: 0,
            cancel: None,
        }],
    );
    assert_eq!(out[0].as_ref().unwrap().tokens.len(), 3);
    assert!(e.kv_all_free());
}

#[test]
fn cancelling_frees_blocks_at_the_next_step() {
    let mut e = engine(small(16, 4, 16));
    let id = e.add(Request::new((1..30).collect(), 100)).unwrap();
    e.step().unwrap();
    assert!(e.stats().kv_blocks_used > 0);
    e.cancel(id);
    let out = e.step().unwrap();
    assert!(matches!(
        out.last().map(|o| &o.kind),
        Some(OutputKind::Finished {
            reason: FinishReason::Cancelled,
            ..
        })
    ));
    assert!(e.kv_all_free() && !e.has_work());
}

/// A long Gemma 3 sequence holds its global layer's blocks plus a window per local layer
/// (counted every step), and its greedy tokens are those of the decoder run alone over a
/// cache that keeps every position.
#[test]
fn windowed_layers_hold_a_window_and_change_no_token() {
    let mut e = engine_of("arch/gemma3", small(400, 4, 16));
    let prompt: Vec<u32> = (0..30).map(|i| (i * 37 % 300) as u32 + 3).collect();
    let mut r = Request::new(prompt.clone(), 90);
    r.ignore_eos = true;
    e.add(r).unwrap();
    let (mut tokens, mut peak) = (Vec::new(), 0);
    while e.has_work() {
        for o in e.step().unwrap() {
            if let OutputKind::Token { token, .. } = o.kind {
                tokens.push(token);
            }
        }
        peak = peak.max(e.stats().kv_blocks_used);
    }
    assert_eq!(tokens.len(), 90);
    // 120 positions: 30 blocks in the global group; a local group needs the blocks its
    // window and a 16-token pass reach, at most (6 + 16) / 4 + 2 = 8 (6 × 30 = 180 without).
    assert!(peak <= 30 + 5 * 8, "{peak} blocks in use at the peak");
    assert!(e.kv_all_free());

    let m = &mut e.model.decoder;
    let mut kv = m.alloc_kv_tokens(prompt.len() + tokens.len());
    let mut want = Vec::new();
    let mut seq = prompt.clone();
    let mut logits = m.forward(&mut kv, &seq, 0, Logits::Last).unwrap();
    for _ in 0..tokens.len() {
        let next = argmax(&logits);
        want.push(next);
        seq.push(next);
        logits = m
            .forward(&mut kv, &[next], seq.len() - 1, Logits::Last)
            .unwrap();
    }
    assert_eq!(tokens, want);
}

/// A second request sharing a long prefix with a finished one reuses it, though the
/// windowed layers gave most of its blocks back, and gives the tokens it gives without the
/// prefix cache.
#[test]
fn windowed_layers_keep_the_prefix_cache() {
    let prefix: Vec<u32> = (0..64).map(|i| (i * 53 % 300) as u32 + 3).collect();
    let first = [prefix.clone(), vec![7, 8, 9]].concat();
    let second = [prefix.clone(), vec![11, 12]].concat();
    let run = |e: &mut Engine<CpuBackend>, p: &[u32]| {
        let spec = [Spec {
            prompt: p.to_vec(),
            max_tokens: 20,
            arrive: 0,
            cancel: None,
        }];
        drive(e, &spec).0.remove(0).unwrap().tokens
    };
    let mut e = engine_of("arch/gemma3", small(400, 4, 16));
    run(&mut e, &first);
    let before = e.stats().prefix.tokens_saved;
    let got = run(&mut e, &second);
    let saved = e.stats().prefix.tokens_saved - before;
    assert_eq!(saved, 64, "the shared 64 positions come from the cache");
    let mut cold = engine_of(
        "arch/gemma3",
        EngineConfig {
            prefix_caching: false,
            ..small(400, 4, 16)
        },
    );
    assert_eq!(got, run(&mut cold, &second));
    assert!(e.kv_all_free());
}

fn argmax(r: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in r.iter().enumerate() {
        if x > r[best] {
            best = i;
        }
    }
    best as u32
}
