//! The tiny fixture models (`tests/fixtures/tiny`): each folder's `tokenizer.json` (through
//! `from_hf_dir`) and its llama.cpp-converted GGUF (through `from_gguf`) must give the token
//! sequence in `reference.json`, which transformers produced.

mod common;

use std::path::PathBuf;

use ferrum_loader::GgufFile;
use ferrum_tokenizer::{Message, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    text: String,
    tokens: Vec<u32>,
}

fn folder(name: &str) -> PathBuf {
    common::fixture(&format!("tiny/{name}"))
}

fn reference(name: &str) -> Reference {
    let path = folder(name).join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Llama's reference starts with BOS `<|begin_of_text|>` (382); the Qwen ones have none.
fn check(name: &str, bos: Option<u32>, eos: u32) {
    let r = reference(name);
    let text_ids = match bos {
        Some(b) => {
            assert_eq!(r.tokens[0], b);
            &r.tokens[1..]
        }
        None => &r.tokens[..],
    };

    let hf = Tokenizer::from_hf_dir(&folder(name)).unwrap();
    assert_eq!(
        hf.encode(&r.text, false).unwrap(),
        text_ids,
        "{name} (tokenizer.json)"
    );
    assert_eq!(hf.bos_id(), bos, "{name} (tokenizer.json)");
    assert_eq!(hf.eos_ids().first(), Some(&eos), "{name} (tokenizer.json)");
    assert_eq!(hf.decode(text_ids, false).unwrap(), r.text);

    let g = GgufFile::open(folder(name).join("model-f32.gguf")).unwrap();
    let gg = Tokenizer::from_gguf(&g).unwrap();
    // llama.cpp adds BOS for llama-bpe vocabularies unless the file says otherwise.
    assert_eq!(gg.encode(&r.text, true).unwrap(), r.tokens, "{name} (GGUF)");
    assert!(
        gg.eos_ids().contains(&eos),
        "{name} (GGUF): {:?}",
        gg.eos_ids()
    );
}

#[test]
fn tiny_llama_tokenizes_like_transformers() {
    check("llama", Some(382), 383);
}

#[test]
fn tiny_qwen2_tokenizes_like_transformers() {
    check("qwen2", None, 383);
}

#[test]
fn tiny_qwen3_tokenizes_like_transformers() {
    check("qwen3", None, 383);
}

#[test]
fn hf_dir_reads_chat_template_jinja() {
    let tk = Tokenizer::from_hf_dir(&folder("qwen2")).unwrap();
    let t = tk
        .chat_template()
        .expect("qwen2 fixture has chat_template.jinja");
    let out = t.render(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tk.encode(&out, false).unwrap();
    assert_eq!(ids[0], 382);
    assert!(tk.is_special(382) && tk.is_special(383));
}

#[test]
fn hf_dir_without_tokenizer_json_is_an_error() {
    let dir = std::env::temp_dir().join(format!("ferrum-tok-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let r = Tokenizer::from_hf_dir(&dir);
    let _ = std::fs::remove_dir(&dir);
    assert!(r.is_err());
}
