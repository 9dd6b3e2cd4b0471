//! SmolLM2-135M-Instruct's GGUF vocabulary against transformers: special-token matching,
//! a passage tokenized by transformers (`tests/fixtures/smollm2/reference.json`) and chat
//! templates rendered by `apply_chat_template` (`chat_template_cases.json`), both written by
//! `scripts/fixtures/smollm2_reference.py`.

mod common;

use ferrum_loader::GgufFile;
use ferrum_tokenizer::{Message, Tokenizer};
use serde::Deserialize;

fn smollm2() -> Tokenizer {
    let g = GgufFile::open(common::smollm2_gguf()).unwrap();
    Tokenizer::from_gguf(&g).unwrap()
}

fn read_fixture<T: for<'de> Deserialize<'de>>(rel: &str) -> T {
    let path = common::fixture(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (committed fixture; regenerate with scripts/fixtures/smollm2_reference.py)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn chat_markers_are_single_special_tokens() {
    let tk = smollm2();
    let ids = tk
        .encode("<|im_start|>user\nHello<|im_end|>\n", false)
        .unwrap();
    let im_start = tk.inner().token_to_id("<|im_start|>").unwrap();
    let im_end = tk.inner().token_to_id("<|im_end|>").unwrap();
    assert_eq!((im_start, im_end), (1, 2));
    assert_eq!(ids.first(), Some(&im_start), "{ids:?}");
    assert_eq!(&ids[ids.len() - 2..], &[im_end, 198], "{ids:?}");
    assert_eq!(
        ids.iter().filter(|&&id| tk.is_special(id)).count(),
        2,
        "{ids:?}"
    );
    assert_eq!(
        tk.decode(&ids, false).unwrap(),
        "<|im_start|>user\nHello<|im_end|>\n"
    );
    assert_eq!(tk.decode(&ids, true).unwrap(), "user\nHello\n");
}

#[test]
fn special_token_metadata() {
    let tk = smollm2();
    assert_eq!(tk.vocab_size(), 49152);
    assert_eq!(tk.bos_id(), Some(1));
    // <|im_end|> (eos) first, then <|endoftext|>, which also ends generation.
    assert_eq!(tk.eos_ids(), &[2, 0]);
    // add_bos_token is false in this GGUF.
    assert_eq!(
        tk.encode("Hi", true).unwrap(),
        tk.encode("Hi", false).unwrap()
    );
}

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
}

#[test]
fn passage_matches_transformers() {
    let tk = smollm2();
    let reference: Reference = read_fixture("smollm2/reference.json");
    let passage = std::fs::read_to_string(common::fixture("smollm2/passage.txt")).unwrap();
    let ids = tk.encode(&passage, false).unwrap();
    assert_eq!(ids, reference.tokens);
    assert_eq!(tk.decode(&ids, false).unwrap(), passage);
}

#[derive(Deserialize)]
struct TemplateCases {
    cases: Vec<TemplateCase>,
}

#[derive(Deserialize)]
struct TemplateCase {
    name: String,
    messages: Vec<Message>,
    add_generation_prompt: bool,
    expected: String,
    expected_tokens: Option<Vec<u32>>,
}

#[test]
fn chat_template_matches_transformers() {
    let tk = smollm2();
    let template = tk.chat_template().expect("SmolLM2 has a chat template");
    let cases: TemplateCases = read_fixture("smollm2/chat_template_cases.json");
    assert!(!cases.cases.is_empty());
    for case in &cases.cases {
        let text = template
            .render(&case.messages, case.add_generation_prompt)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(text, case.expected, "case {}", case.name);
        if let Some(expected) = &case.expected_tokens {
            assert_eq!(
                &tk.encode(&text, false).unwrap(),
                expected,
                "case {} tokens",
                case.name
            );
        }
    }
}
