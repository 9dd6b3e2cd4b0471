//! A harmony (gpt-oss) answer's token stream through the engine's detokenizer with control
//! tokens' text kept, parsed by channel; and the turn-ending tokens of its vocabulary.

use std::path::PathBuf;

use ferrum_generate::Detokenizer;
use ferrum_tokenizer::harmony::{self, Event, Parser};
use ferrum_tokenizer::Tokenizer;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[test]
fn an_answer_streamed_token_by_token_parses_by_channel() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("arch/gpt-oss")).unwrap();
    assert!(harmony::is_harmony(&tok));
    // `<|return|>` and `<|call|>` end a turn; `<|end|>` (after the analysis) does not.
    let id = |t: &str| tok.inner().token_to_id(t).unwrap();
    assert!(tok.eos_ids().contains(&id("<|return|>")));
    assert!(tok.eos_ids().contains(&id("<|call|>")));
    assert!(!tok.eos_ids().contains(&id("<|end|>")));

    let answer = "<|channel|>analysis<|message|>Need the weather: call it.<|end|>\
        <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
        <|message|>{\"city\": \"Zürich\"}";
    let ids = tok
        .encode_with(answer, false, ferrum_tokenizer::SpecialTokens::Control)
        .unwrap();
    assert!(
        ids.contains(&id("<|channel|>")),
        "markers are control tokens"
    );
    let mut d = Detokenizer::new(false);
    let mut p = Parser::new();
    let mut events = Vec::new();
    for &t in &ids {
        events.extend(p.push(&d.push(&tok, t).unwrap()));
    }
    events.extend(p.push(&d.flush(&tok).unwrap()));
    events.extend(p.finish());
    let mut reasoning = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for e in events {
        match e {
            Event::Reasoning(r) => reasoning.push_str(&r),
            Event::CallStart(n) => calls.push((n, String::new())),
            Event::CallArgs(a) => calls.last_mut().unwrap().1.push_str(&a),
            Event::CallEnd => {}
            Event::Content(c) => panic!("no content expected, got {c:?}"),
        }
    }
    assert_eq!(reasoning, "Need the weather: call it.");
    assert_eq!(
        calls,
        vec![(
            "get_weather".to_string(),
            "{\"city\": \"Zürich\"}".to_string()
        )]
    );
}
