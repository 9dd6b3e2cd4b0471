//! The real Gemma 3 270M's SentencePiece vocabulary (262,144 tokens, from its GGUF) against
//! transformers: a passage tokenized by transformers (`tests/fixtures/gemma3/reference.json`)
//! and Gemma-style chat renders tokenized by it (`chat_template_cases.json`; the 270M base
//! GGUF has no template of its own, so the cases carry the one they used). Both written by
//! `scripts/fixtures/gemma3_reference.py`.

mod common;

use ferrum_loader::GgufFile;
use ferrum_tokenizer::{ChatTemplate, Message, Tokenizer};
use serde::Deserialize;

fn gemma3() -> Tokenizer {
    let p = common::require(ferrum_loader::assets::gemma3_test_model_path());
    Tokenizer::from_gguf(&GgufFile::open(p).unwrap()).unwrap()
}

fn fixture<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let p = common::fixture(&format!("gemma3/{name}"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
}

#[test]
fn passage_matches_transformers() {
    let tk = gemma3();
    assert_eq!(tk.vocab_size(), 262_144);
    assert_eq!(tk.bos_id(), Some(2));
    let r: Reference = fixture("reference.json");
    let passage = std::fs::read_to_string(common::fixture("smollm2/passage.txt")).unwrap();
    // The GGUF adds the BOS, as transformers' Gemma tokenizer does.
    assert_eq!(tk.encode(&passage, true).unwrap(), r.tokens);
    assert_eq!(tk.encode(&passage, false).unwrap(), &r.tokens[1..]);
    assert_eq!(tk.decode(&r.tokens[1..], false).unwrap(), passage);
}

#[derive(Deserialize)]
struct Cases {
    template: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<Message>,
    add_generation_prompt: bool,
    expected: String,
    expected_tokens: Vec<u32>,
}

#[test]
fn chat_renders_tokenize_as_transformers() {
    let tk = gemma3();
    let c: Cases = fixture("chat_template_cases.json");
    let template = ChatTemplate::new(&c.template, "<bos>", "<eos>").unwrap();
    assert!(c.cases.len() >= 6);
    for case in &c.cases {
        let text = template
            .render(&case.messages, case.add_generation_prompt)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(text, case.expected, "case {}", case.name);
        assert_eq!(
            tk.encode(&text, false).unwrap(),
            case.expected_tokens,
            "case {} tokens",
            case.name
        );
    }
}
