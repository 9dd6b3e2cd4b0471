//! Speculative decoding never changes the answer: on the real SmolLM2, prompt lookup's drafts
//! (and noise) checked in one pass give exactly the tokens plain decoding gives — greedy and
//! seeded sampling, alone and in a batch of eight, with prefix-cache hits, stop strings and a
//! JSON-schema constraint — and on copy-heavy prompts most drafts are kept. A draft model (the
//! same SmolLM2 re-quantised to Q4_0, drafting for the shipped Q4_1) gives the plain greedy
//! answer in all those cases too, and seeded sampled answers that repeat.

mod common;

use std::collections::HashMap;

use ferrum_backend::CpuBackend;
use ferrum_generate::spec::Drafter;
use ferrum_generate::{Constraint, Engine, EngineConfig, OutputKind, Request, SamplingParams};
use ferrum_tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};

fn engine(spec_tokens: usize) -> Engine<CpuBackend> {
    let (m, t) = common::smollm2(CpuBackend::new(), 2048);
    let mut c = EngineConfig::with_kv_tokens(16384);
    c.spec_tokens = spec_tokens;
    Engine::new(m, t, c).unwrap()
}

/// [`engine`] drafting with SmolLM2 re-quantised to Q4_0 (a different model: about half its
/// greedy drafts are kept). `test` names the file, so tests running at once do not share it.
fn draft_engine(spec_tokens: usize, test: &str) -> Engine<CpuBackend> {
    let mut e = engine(spec_tokens);
    let q4 = ferrum_core::temp::TempPath::new("ferrum-spec", &format!("{test}-q4_0.gguf"));
    ferrum_quantize::quantize_file(
        &ferrum_loader::assets::default_model_path(),
        &q4,
        "Q4_0".parse().unwrap(),
    )
    .unwrap();
    let (m, t) = common::load(&q4, CpuBackend::new(), 2048);
    e.set_draft_model(m, &t).unwrap();
    // As large as the model, it could never pay and would not be used: count it as a
    // tenth, so that it drafts.
    e.set_draft_cost(0.1);
    e
}

use common::chat;

/// Runs `reqs` (all arriving at once) to completion; each request's tokens.
fn run(e: &mut Engine<CpuBackend>, reqs: &[Request]) -> Vec<Vec<u32>> {
    let ids: Vec<u64> = reqs.iter().map(|r| e.add(r.clone()).unwrap()).collect();
    let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut done = 0;
    while done < reqs.len() {
        for o in e.step().unwrap() {
            match o.kind {
                OutputKind::Token { token, .. } => toks.entry(o.id).or_default().push(token),
                OutputKind::Finished { .. } => done += 1,
            }
        }
    }
    assert!(e.kv_all_free());
    ids.iter()
        .map(|id| toks.remove(id).unwrap_or_default())
        .collect()
}

const CODE: &str = "fn area(w: f64, h: f64) -> f64 {\n    let a = w * h;\n    println!(\"area {}\", a);\n    a\n}\n\nfn perimeter(w: f64, h: f64) -> f64 {\n    let p = 2.0 * (w + h);\n    println!(\"perimeter {}\", p);\n    p\n}";

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    [
        format!("Rewrite this code, renaming w to width and changing nothing else:\n\n{CODE}"),
        format!("Repeat this code exactly:\n\n{CODE}"),
        "Quote this sentence back to me: The river runs past the old mill and under the stone bridge before it reaches the sea.".to_string(),
        "Summarise, quoting the text: In the spring the water is high and fast; in the late summer it is slow, shallow and warm.".to_string(),
        "What is the capital of France?".to_string(),
        "Write a haiku about the sea.".to_string(),
        "List the numbers from 1 to 20, separated by commas.".to_string(),
        "Name three primary colours.".to_string(),
    ]
    .iter()
    .map(|q| chat(tok, q))
    .collect()
}

fn requests(tok: &Tokenizer, max_tokens: usize, sampled: bool) -> Vec<Request> {
    prompts(tok)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = Request::new(p, max_tokens);
            if sampled {
                r.params = SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.95,
                    seed: Some(7 + i as u64),
                };
            }
            r
        })
        .collect()
}

#[test]
fn prompt_lookup_gives_the_plain_answer_alone_and_batched() {
    let mut plain = engine(0);
    let mut spec = engine(8);
    for sampled in [false, true] {
        let reqs = requests(&plain.tokenizer, 64, sampled);
        let want: Vec<Vec<u32>> = reqs
            .iter()
            .map(|r| run(&mut plain, std::slice::from_ref(r)).remove(0))
            .collect();
        for (i, r) in reqs.iter().enumerate() {
            let got = run(&mut spec, std::slice::from_ref(r)).remove(0);
            assert_eq!(got, want[i], "prompt {i} alone (sampled: {sampled})");
        }
        // All eight at once: drafting and plain decoding sequences share steps; the second
        // time round every prompt is a prefix-cache hit.
        for round in 0..2 {
            let got = run(&mut spec, &reqs);
            assert_eq!(got, want, "batch, round {round} (sampled: {sampled})");
        }
    }
    let st = spec.stats();
    assert!(st.drafted_tokens > 0 && st.accepted_tokens > 0, "{st:?}");
    eprintln!(
        "drafted {} tokens, accepted {} ({:.0}%)",
        st.drafted_tokens,
        st.accepted_tokens,
        100.0 * st.accepted_tokens as f64 / st.drafted_tokens as f64
    );
}

#[test]
fn copying_prompts_keep_most_drafts() {
    let mut spec = engine(8);
    let reqs = requests(&spec.tokenizer, 96, false);
    run(&mut spec, &reqs[..2]);
    let st = spec.stats();
    assert!(
        st.accepted_tokens * 2 > st.drafted_tokens,
        "code copying accepted {} of {} drafted tokens",
        st.accepted_tokens,
        st.drafted_tokens
    );
}

#[test]
fn stop_strings_and_a_schema_end_speculative_answers_where_plain_ones_end() {
    let mut plain = engine(0);
    let mut spec = engine(8);
    let reqs = stopping_requests(&plain.tokenizer, 64);
    let want = run(&mut plain, &reqs);
    assert_eq!(run(&mut spec, &reqs), want);
}

/// The eight prompts, the first four with stop strings, the rest under a JSON schema.
fn stopping_requests(tok: &Tokenizer, max_tokens: usize) -> Vec<Request> {
    let mut reqs = requests(tok, max_tokens, false);
    for r in &mut reqs[..4] {
        r.stop = vec!["a =".into(), "bridge".into(), "\n\n".into()];
    }
    let schema = serde_json::json!({"type": "object", "properties": {
        "code": {"type": "string", "maxLength": 200}, "lines": {"type": "integer"}},
        "required": ["code", "lines"]});
    for r in &mut reqs[4..] {
        r.constraint = Some(Constraint::JsonSchema(schema.clone()));
    }
    reqs
}

/// Drafts of noise (with now and then a prompt-lookup draft, so some are kept): still the
/// plain answer, token for token.
struct Noise {
    rng: rand::rngs::StdRng,
    vocab: u32,
}

impl Drafter for Noise {
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32> {
        let mut d = ferrum_generate::spec::NgramDrafter.propose(tokens, max);
        if d.is_empty() || self.rng.gen_bool(0.3) {
            let n = self.rng.gen_range(0..=max);
            d = (0..n).map(|_| self.rng.gen_range(0..self.vocab)).collect();
        } else if !d.is_empty() && self.rng.gen_bool(0.3) {
            let i = self.rng.gen_range(0..d.len());
            d[i] = self.rng.gen_range(0..self.vocab);
        }
        d
    }
}

#[test]
fn noise_drafts_give_the_plain_answer() {
    let mut plain = engine(0);
    let mut spec = engine(6);
    let vocab = spec.model.decoder.config.vocab_size as u32;
    spec.set_drafter(Box::new(Noise {
        rng: rand::rngs::StdRng::seed_from_u64(5),
        vocab,
    }));
    for sampled in [false, true] {
        let reqs = requests(&plain.tokenizer, 48, sampled);
        let want = run(&mut plain, &reqs);
        assert_eq!(run(&mut spec, &reqs), want, "sampled: {sampled}");
    }
}

#[test]
fn a_draft_model_gives_the_plain_answer() {
    let mut plain = engine(0);
    let mut spec = draft_engine(4, "greedy");
    let reqs = requests(&plain.tokenizer, 48, false);
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| run(&mut plain, std::slice::from_ref(r)).remove(0))
        .collect();
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(
            run(&mut spec, std::slice::from_ref(r)),
            [want[i].clone()],
            "prompt {i} alone"
        );
    }
    // Batched; the second round finds every prompt's blocks (and their draft rows) cached.
    for round in 0..2 {
        assert_eq!(run(&mut spec, &reqs), want, "batch, round {round}");
    }
    let st = spec.stats();
    assert!(
        st.accepted_tokens > 0 && st.accepted_tokens < st.drafted_tokens,
        "{st:?}"
    );
    eprintln!(
        "draft model: {} of {} drafted tokens kept",
        st.accepted_tokens, st.drafted_tokens
    );

    // Stop strings and a schema end the answer where plain decoding's ends.
    let reqs = stopping_requests(&plain.tokenizer, 48);
    let want = run(&mut plain, &reqs);
    assert_eq!(run(&mut spec, &reqs), want);
}

/// A seeded sampled request drafts greedily, checked by sample and compare: its answer is
/// plain decoding's with that seed, alone or batched. An unseeded one samples its drafts and
/// has them kept or replaced by the rejection rule (whose distribution the sampler's tests
/// check on fixed logits): it keeps more of them than greedy drafts at that temperature.
#[test]
fn a_draft_model_under_sampling() {
    let mut plain = engine(0);
    let mut spec = draft_engine(4, "sampled");
    let reqs = requests(&spec.tokenizer, 48, true);
    let want = run(&mut plain, &reqs);
    assert_eq!(run(&mut spec, &reqs), want, "batched");
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| run(&mut spec, std::slice::from_ref(r)).remove(0))
        .collect();
    assert_eq!(alone, want, "alone");
    let greedy = spec.stats();
    let unseeded: Vec<Request> = reqs
        .iter()
        .cloned()
        .map(|mut r| {
            r.params.seed = None;
            r
        })
        .collect();
    run(&mut spec, &unseeded);
    let all = spec.stats();
    let (drafted, kept) = (
        all.drafted_tokens - greedy.drafted_tokens,
        all.accepted_tokens - greedy.accepted_tokens,
    );
    eprintln!(
        "greedy drafts: {} of {} kept; sampled drafts: {kept} of {drafted}",
        greedy.accepted_tokens, greedy.drafted_tokens
    );
    assert!(
        drafted > 0 && kept * 2 > drafted,
        "kept {kept} of {drafted} sampled drafts"
    );
}
