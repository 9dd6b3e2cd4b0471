//! End to end on the real default model: text → tokenizer → model → greedy sampler →
//! detokenizer, compared with transformers' greedy `generate` on the same weights
//! (`tests/fixtures/smollm2/prompt_greedy.json`, made by `scripts/fixtures/smollm2_reference.py`).

mod common;

use ferrum_backend::CpuBackend;
use ferrum_generate::{FinishReason, SamplingParams, Session};
use ferrum_tokenizer::Message;

fn session(context: usize) -> Session<CpuBackend> {
    session_on(CpuBackend::exact(), context)
}

fn session_on(be: CpuBackend, context: usize) -> Session<CpuBackend> {
    let (model, tok) = common::smollm2(be, context);
    Session::new(model, tok).unwrap()
}

fn fixture() -> serde_json::Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/smollm2/prompt_greedy.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn capital_of_france_is_paris_token_for_token() {
    let f = fixture();
    let mut s = session(256);
    let prompt = s
        .tokenizer()
        .encode("The capital of France is", false)
        .unwrap();
    assert_eq!(prompt, ids(&f["prompt_tokens"]));
    let want = ids(&f["continuation_tokens"]);
    let mut text = String::new();
    let stats = s
        .generate(&prompt, want.len(), &SamplingParams::greedy(), |d| {
            text.push_str(d);
            true
        })
        .unwrap();
    assert_eq!(stats.tokens, want, "greedy tokens vs transformers");
    assert!(text.starts_with(" Paris"), "{text:?}");
    assert_eq!(stats.finish, FinishReason::Length);
}

#[test]
fn chat_turns_reuse_the_cached_prefix_and_stop_at_end_of_turn() {
    let mut s = session(1024);
    let mut messages = vec![Message {
        role: "user".into(),
        content: "What is the capital of France?".into(),
    }];
    let render = |s: &Session<CpuBackend>, m: &[Message]| {
        let text = s
            .tokenizer()
            .chat_template()
            .unwrap()
            .render(m, true)
            .unwrap();
        s.tokenizer().encode(&text, false).unwrap()
    };
    let p1 = render(&s, &messages);
    let mut answer = String::new();
    let st = s
        .generate(&p1, 64, &SamplingParams::greedy(), |d| {
            answer.push_str(d);
            true
        })
        .unwrap();
    assert!(answer.contains("Paris"), "{answer:?}");
    assert_eq!(
        st.finish,
        FinishReason::Stop,
        "the model ends its turn with <|im_end|>"
    );
    messages.push(Message {
        role: "assistant".into(),
        content: answer.clone(),
    });
    messages.push(Message {
        role: "user".into(),
        content: "And of Italy?".into(),
    });
    let p2 = render(&s, &messages);
    let st2 = s
        .generate(&p2, 16, &SamplingParams::greedy(), |_| true)
        .unwrap();
    // Only the new turn is computed (give or take a partial 16-token block); the first
    // turn's tokens come from the prefix cache.
    assert!(
        st2.prefilled_tokens < p2.len() - p1.len() + 16,
        "{} of {}",
        st2.prefilled_tokens,
        p2.len()
    );
    // A prompt longer than the context is an error, and the session still works after it.
    let long = vec![1u32; 2000];
    assert!(s
        .generate(&long, 4, &SamplingParams::greedy(), |_| true)
        .is_err());
    assert!(s
        .generate(&p1, 2, &SamplingParams::greedy(), |_| true)
        .is_ok());
}

/// The fast backend (8-bit activations) drifts from the reference like llama.cpp does, but
/// not on a decisive answer.
#[test]
fn fast_backend_also_says_paris() {
    let mut s = session_on(CpuBackend::new(), 256);
    let prompt = s
        .tokenizer()
        .encode("The capital of France is", false)
        .unwrap();
    let mut text = String::new();
    s.generate(&prompt, 3, &SamplingParams::greedy(), |d| {
        text.push_str(d);
        true
    })
    .unwrap();
    assert!(text.starts_with(" Paris"), "{text:?}");
}

/// Stop strings end generation before the match, which is never emitted, even when the
/// stop text spans several tokens.
#[test]
fn stop_string_ends_generation_unemitted() {
    use ferrum_generate::GenerateOptions;
    let mut s = session(256);
    let prompt = s
        .tokenizer()
        .encode("Count from one to ten: one, two,", false)
        .unwrap();
    let opts = GenerateOptions {
        max_tokens: 30,
        params: SamplingParams::greedy(),
        stop: vec!["five,".into()],
        ..GenerateOptions::default()
    };
    let mut text = String::new();
    let st = s
        .generate_with(&prompt, &opts, |d| {
            text.push_str(d);
            true
        })
        .unwrap();
    assert_eq!(st.finish, FinishReason::Stop);
    assert!(text.contains("four") && !text.contains("five"), "{text:?}");
}
