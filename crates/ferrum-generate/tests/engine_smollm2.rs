//! The engine on the real default model (fast backend): batch invariance, the prefix cache,
//! seeded sampling and log-probabilities, and detokenised deltas.

mod common;

use std::collections::HashMap;

use ferrum_backend::CpuBackend;
use ferrum_generate::{
    Detokenizer, Engine, EngineConfig, FinishReason, OutputKind, Request, SamplingParams,
    TokenLogprob, Usage,
};
use ferrum_models::{Logits, Model};
use ferrum_tokenizer::Tokenizer;
use unicode_segmentation::UnicodeSegmentation;

fn load(context: usize) -> (Model<CpuBackend>, Tokenizer) {
    common::smollm2(CpuBackend::new(), context)
}

fn engine(kv_tokens: usize, prefix_caching: bool) -> Engine<CpuBackend> {
    let (m, t) = load(2048);
    let mut c = EngineConfig::with_kv_tokens(kv_tokens);
    c.prefix_caching = prefix_caching;
    Engine::new(m, t, c).unwrap()
}

struct Done {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<TokenLogprob>,
    usage: Usage,
    reason: FinishReason,
}

/// Adds `reqs` (the i-th after `arrive[i]` steps) and runs until all are done.
fn run(e: &mut Engine<CpuBackend>, reqs: Vec<Request>, arrive: &[usize]) -> Vec<Done> {
    let mut ids = vec![None; reqs.len()];
    let mut acc: HashMap<u64, (Vec<u32>, String, Vec<TokenLogprob>)> = HashMap::new();
    let mut done: HashMap<u64, Done> = HashMap::new();
    let mut step = 0;
    while done.len() < reqs.len() {
        for (i, r) in reqs.iter().enumerate() {
            if arrive[i] == step {
                let id = e.add(r.clone()).unwrap();
                ids[i] = Some(id);
                acc.insert(id, Default::default());
            }
        }
        for o in e.step().unwrap() {
            let a = acc.get_mut(&o.id).unwrap();
            match o.kind {
                OutputKind::Token {
                    token,
                    text,
                    logprob,
                } => {
                    a.0.push(token);
                    a.1.push_str(&text);
                    a.2.extend(logprob);
                }
                OutputKind::Finished {
                    reason,
                    text,
                    usage,
                    ..
                } => {
                    let (tokens, mut t, logprobs) = std::mem::take(a);
                    t.push_str(&text);
                    done.insert(
                        o.id,
                        Done {
                            tokens,
                            text: t,
                            logprobs,
                            usage,
                            reason,
                        },
                    );
                }
            }
        }
        step += 1;
    }
    ids.iter()
        .map(|id| done.remove(&id.unwrap()).unwrap())
        .collect()
}

use common::chat;

const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
];

#[test]
fn greedy_output_is_the_same_alone_and_in_any_batch() {
    let mut e = engine(8192, false);
    let reqs: Vec<Request> = QUESTIONS
        .iter()
        .map(|q| Request::new(chat(&e.tokenizer, q), 24))
        .collect();
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| run(&mut e, vec![r.clone()], &[0]).remove(0).tokens)
        .collect();
    // All eight at once, then staggered with a long prompt arriving mid-way (its prefill
    // chunks share steps with everyone's decoding).
    let together = run(&mut e, reqs.clone(), &[0; 8]);
    let mut staggered = reqs.clone();
    let long: Vec<u32> = (0..700u32).map(|i| 1000 + (i * 7919) % 40000).collect();
    staggered.push(Request::new(long, 4));
    let arrive = [0, 0, 1, 2, 3, 5, 8, 13, 4];
    let mixed = run(&mut e, staggered, &arrive);
    for i in 0..8 {
        assert_eq!(together[i].tokens, alone[i], "{:?} batched", QUESTIONS[i]);
        assert_eq!(mixed[i].tokens, alone[i], "{:?} staggered", QUESTIONS[i]);
    }
    assert!(e.kv_all_free());
}

#[test]
fn shared_512_token_prefix_is_computed_once() {
    let prefix: Vec<u32> = (0..512u32).map(|i| 100 + (i * 104_729) % 30000).collect();
    let with = |suffix: &[u32]| {
        let mut p = prefix.clone();
        p.extend_from_slice(suffix);
        Request::new(p, 12)
    };
    let (a, b) = (with(&[11, 12, 13, 14, 15]), with(&[21, 22, 23]));
    let mut e = engine(4096, true);
    let first = run(&mut e, vec![a], &[0]).remove(0);
    assert_eq!(first.usage.cached_tokens, 0);
    let before = e.stats().prefix;
    let second = run(&mut e, vec![b.clone()], &[0]).remove(0);
    let after = e.stats().prefix;
    assert_eq!(
        second.usage.cached_tokens, 512,
        "the prefix's 32 blocks are reused"
    );
    assert_eq!(after.tokens_saved - before.tokens_saved, 512);
    assert_eq!(after.hits - before.hits, 32);
    // Without the cache: the same tokens.
    let mut cold = engine(4096, false);
    let reference = run(&mut cold, vec![b], &[0]).remove(0);
    assert_eq!(reference.usage.cached_tokens, 0);
    assert_eq!(second.tokens, reference.tokens);
}

#[test]
fn seeded_sampling_repeats_alone_or_batched_and_logprobs_are_the_models() {
    let mut e = engine(8192, true);
    let prompt = chat(&e.tokenizer, "Tell me a story about a robot.");
    let sampled = |seed| {
        let mut r = Request::new(prompt.clone(), 20);
        r.params = SamplingParams {
            temperature: 0.9,
            top_k: 50,
            top_p: 0.95,
            seed: Some(seed),
        };
        r.logprobs = Some(3);
        r
    };
    let a = run(&mut e, vec![sampled(7)], &[0]).remove(0);
    let others: Vec<Request> = QUESTIONS[..3]
        .iter()
        .map(|q| Request::new(chat(&e.tokenizer, q), 20))
        .collect();
    let mut batch = vec![sampled(7)];
    batch.extend(others);
    let b = run(&mut e, batch, &[0, 0, 1, 2]).remove(0);
    let c = run(&mut e, vec![sampled(8)], &[0]).remove(0);
    assert_eq!(a.tokens, b.tokens, "same seed, same output, batched or not");
    assert_ne!(a.tokens, c.tokens, "another seed, another story");
    // Log-probabilities are the model's own: recompute the first position directly.
    let (mut m, _) = load(2048);
    let mut kv = m.decoder.alloc_kv_tokens(prompt.len());
    let logits = m
        .decoder
        .forward(&mut kv, &prompt, 0, Logits::Last)
        .unwrap();
    let lse = {
        let mx = logits.iter().copied().fold(f32::MIN, f32::max);
        mx + logits.iter().map(|l| (l - mx).exp()).sum::<f32>().ln()
    };
    let lp = &a.logprobs[0];
    let want = logits[a.tokens[0] as usize] - lse;
    assert!((lp.logprob - want).abs() < 1e-3, "{} vs {want}", lp.logprob);
    assert_eq!(lp.top.len(), 3);
    assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    assert!(lp.top[0].1 >= lp.logprob && lp.top[0].1 <= 0.0);
    assert_eq!(a.logprobs.len(), a.tokens.len());
}

#[test]
fn stop_token_ids_and_strings_end_requests() {
    let mut e = engine(4096, true);
    let prompt = e
        .tokenizer
        .encode("Count from one to ten: one, two,", false)
        .unwrap();
    let free = run(&mut e, vec![Request::new(prompt.clone(), 12)], &[0]).remove(0);
    // Stop at the second generated token's id.
    let mut r = Request::new(prompt.clone(), 12);
    r.stop_token_ids = vec![free.tokens[1]];
    let st = run(&mut e, vec![r], &[0]).remove(0);
    assert_eq!(st.reason, FinishReason::Stop);
    assert_eq!(st.tokens, free.tokens[..1]);
    let mut r = Request::new(prompt, 30);
    r.stop = vec!["four".into()];
    let st = run(&mut e, vec![r], &[0]).remove(0);
    assert_eq!(st.reason, FinishReason::Stop);
    assert!(
        st.text.contains("three") && !st.text.contains("four"),
        "{:?}",
        st.text
    );
}

/// Deltas concatenate to the full decode, and none ends inside a character or inside a
/// multi-token grapheme (an emoji family joined by zero-width joiners, a flag, a skin tone).
#[test]
fn detokenised_deltas_never_split_a_grapheme() {
    let (_, tok) = load(64);
    let text = "Hi 👨‍👩‍👧‍👦 and 🇫🇷, 👍🏽 naïve café 한국어 done.";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() > 10);
    let mut d = Detokenizer::default();
    let mut out = String::new();
    let mut cuts = Vec::new();
    for &id in &ids {
        let delta = d.push(&tok, id).unwrap();
        out.push_str(&delta);
        cuts.push(out.len());
    }
    out.push_str(&d.flush(&tok).unwrap());
    assert_eq!(out, tok.decode(&ids, true).unwrap());
    let bounds: Vec<usize> = out.grapheme_indices(true).map(|(i, _)| i).collect();
    for c in cuts {
        assert!(
            c == out.len() || c == 0 || bounds.contains(&c),
            "a delta ends inside a grapheme at byte {c} of {out:?}"
        );
    }
}

/// A JSON schema constraint holds the model to it token by token: the output parses and has
/// the required keys with the required types, even from a model this small.
#[test]
fn json_schema_constraint_is_enforced() {
    use ferrum_generate::Constraint;
    let mut e = engine(4096, true);
    let prompt = chat(&e.tokenizer, "Describe a cat as JSON.");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "indoor": {"type": "boolean"},
            "colour": {"enum": ["black", "white", "ginger"]}
        },
        "required": ["name", "age", "indoor", "colour"],
        "additionalProperties": false
    });
    let mut r = Request::new(prompt.clone(), 80);
    r.constraint = Some(Constraint::JsonSchema(schema));
    let out = run(&mut e, vec![r], &[0]).remove(0);
    assert_eq!(out.reason, FinishReason::Stop, "{:?}", out.text);
    let v: serde_json::Value = serde_json::from_str(&out.text).unwrap();
    assert!(v["name"].is_string() && v["age"].is_u64() && v["indoor"].is_boolean());
    assert!(["black", "white", "ginger"].contains(&v["colour"].as_str().unwrap()));
    // A schema that cannot compile is refused before generation.
    let mut bad = Request::new(prompt, 8);
    bad.constraint = Some(Constraint::JsonSchema(
        serde_json::json!({"type": "nonsense"}),
    ));
    assert!(e.add(bad).is_err());
    assert!(e.kv_all_free());
}
