//! Gemma 4's tokenizer (`tokenizer.ggml.model = "gemma4"`): the GGUF vocabulary against
//! llama.cpp's own ids, and the Hugging Face `tokenizer.json` of the same vocabulary against
//! transformers', on `tests/fixtures/gemma4/cases.inp` — spaces and space runs, newline runs
//! longer than the longest newline token, `\r\n`, tabs, code, digits, scripts other than
//! Latin, emoji sequences, characters with no token (byte fallback), control and user-defined
//! tokens written in the text. `make_cases.sh` beside the cases says how each `.out` was made.
//!
//! llama.cpp's own `ggml-vocab-gemma-4` test vectors run in `llama_vocab.rs`.

mod common;

use std::path::PathBuf;

use common::Case;
use ferrum_loader::GgufFile;
use ferrum_tokenizer::Tokenizer;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gemma4")
        .join(name)
}

fn cases(out: &str) -> Vec<Case> {
    common::read_cases(&fixture("cases.inp"), &fixture(out))
}

fn tiny_dir() -> PathBuf {
    common::fixture("arch/gemma4")
}

fn real_gguf() -> Tokenizer {
    let g = GgufFile::open(common::llama_vocab("gemma-4")).unwrap();
    Tokenizer::from_gguf(&g).unwrap()
}

fn tiny_gguf() -> Tokenizer {
    let g = GgufFile::open(tiny_dir().join("model-f32.gguf")).unwrap();
    Tokenizer::from_gguf(&g).unwrap()
}

/// Every case encodes (add_special = false) to its expected ids and decodes back to its
/// text, except where the text holds a literal "▁", which decodes to the space it stands for.
fn check(label: &str, tk: &Tokenizer, cases: &[Case]) {
    let mut failures = Vec::new();
    for case in cases {
        let got = tk.encode(&case.text, false).unwrap();
        if got != case.ids {
            failures.push(format!(
                "case {} {:?}\n  expected {:?}\n  got      {:?}",
                case.index, case.text, case.ids, got
            ));
        }
        let back = tk.decode(&got, false).unwrap();
        let want = case.text.replace('\u{2581}', " ");
        if back != want {
            failures.push(format!(
                "case {} {:?} decodes to {:?}",
                case.index, case.text, back
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{label}: {} failures in {} cases:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn real_vocab_gguf_matches_llama_cpp() {
    check("ggml-vocab-gemma-4", &real_gguf(), &cases("gemma-4.out"));
}

#[test]
fn tiny_gguf_matches_llama_cpp() {
    check("gemma4 model-f32.gguf", &tiny_gguf(), &cases("tiny.out"));
}

#[test]
fn tiny_tokenizer_json_matches_transformers() {
    let tk = Tokenizer::from_hf_dir(&tiny_dir()).unwrap();
    check("gemma4 tokenizer.json", &tk, &cases("tiny-hf.out"));
}

/// The fixture's two tokenizers agree with each other, so the GGUF path and the
/// tokenizer.json path give one model the same ids.
#[test]
fn llama_cpp_and_transformers_agree_on_the_tiny_vocabulary() {
    let gguf = cases("tiny.out");
    let hf = cases("tiny-hf.out");
    for (a, b) in gguf.iter().zip(&hf) {
        assert_eq!(a.ids, b.ids, "case {} {:?}", a.index, a.text);
    }
}

#[test]
fn reference_text_with_bos() {
    let path = tiny_dir().join("reference.json");
    let json = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let r: serde_json::Value = serde_json::from_str(&json).unwrap();
    let text = r["text"].as_str().unwrap();
    let tokens: Vec<u32> = r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(tokens[0], 2, "reference.json starts with <bos>");
    let hf = Tokenizer::from_hf_dir(&tiny_dir()).unwrap();
    for (label, tk) in [("GGUF", tiny_gguf()), ("tokenizer.json", hf)] {
        assert_eq!(tk.bos_id(), Some(2), "{label}");
        assert_eq!(tk.encode(text, true).unwrap(), tokens, "{label}");
        assert_eq!(tk.encode(text, false).unwrap(), &tokens[1..], "{label}");
        assert_eq!(tk.decode(&tokens, true).unwrap(), text, "{label}");
    }
}

#[test]
fn real_vocab_special_tokens() {
    let tk = real_gguf();
    let id = |t: &str| {
        let ids = tk.encode(t, false).unwrap();
        assert_eq!(ids.len(), 1, "{t:?} is one token");
        ids[0]
    };
    assert_eq!(tk.bos_id(), Some(2));
    assert_eq!(tk.encode("Hello", true).unwrap(), vec![2, 9259]);
    // The end of generation, as llama.cpp's list for Gemma 4: <eos>, <turn|>, <|tool_response>.
    assert_eq!(tk.eos_ids()[0], 1);
    for t in ["<eos>", "<turn|>", "<|tool_response>"] {
        assert!(tk.eos_ids().contains(&id(t)), "{t}: {:?}", tk.eos_ids());
    }
    assert!(!tk.eos_ids().contains(&id("<|turn>")));
    // Control tokens are skipped when decoding; user-defined ones (<|channel>) are text.
    assert!(tk.is_special(id("<|turn>")) && tk.is_special(id("<bos>")));
    assert!(!tk.is_special(id("<|channel>")));
    let ids = tk.encode("<|turn>model\n<|channel>x", false).unwrap();
    assert_eq!(tk.decode(&ids, true).unwrap(), "model\n<|channel>x");
}
