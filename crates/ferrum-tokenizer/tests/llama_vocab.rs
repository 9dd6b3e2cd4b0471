//! llama.cpp's tokenizer test vectors: for each `ggml-vocab-<name>.gguf`, every case of
//! `.gguf.inp` must encode to the ids on the matching line of `.gguf.out`, and decode back
//! to the same text.
//!
//! Format, as llama.cpp's `tests/test-tokenizer-0.cpp` reads it: the inputs are separated
//! by "\n__ggml_vocab_test__\n"; output line i (whitespace-trimmed) holds the ids of input i
//! separated by single spaces; tokenization runs with add_special = false and
//! parse_special = false. The expected ids come from Hugging Face tokenizers
//! (llama.cpp's `convert_hf_to_gguf_update.py` writes them).

mod common;

use ferrum_loader::GgufFile;
use ferrum_tokenizer::Tokenizer;

use common::Case;

fn read_cases(name: &str) -> (Tokenizer, Vec<Case>) {
    let gguf = common::llama_vocab(name);
    let inp_path = common::require(gguf.with_extension("gguf.inp"));
    let out_path = common::require(gguf.with_extension("gguf.out"));
    let cases = common::read_cases(&inp_path, &out_path);
    let g = GgufFile::open(&gguf).unwrap();
    let tk = Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
    (tk, cases)
}

/// Encodes every case; `known` lists the case indices that cannot match, each with the
/// reason (they must still mismatch, so the list cannot go stale).
fn check(name: &str, known: &[(usize, &str)]) {
    let (tk, cases) = read_cases(name);
    let mut failures = Vec::new();
    for case in &cases {
        let got = tk.encode(&case.text, false).unwrap();
        let is_known = known.iter().any(|(i, _)| *i == case.index);
        if got != case.ids && !is_known {
            failures.push(format!(
                "case {} {:?}\n  expected {:?}\n  got      {:?}",
                case.index, case.text, case.ids, got
            ));
        }
        if got == case.ids && is_known {
            failures.push(format!(
                "case {} {:?} is listed as a known mismatch but now passes; remove it",
                case.index, case.text
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases wrong:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// decode(encode(x)) == x; all these tokenizers are lossless on valid UTF-8.
fn round_trip(name: &str) {
    let (tk, cases) = read_cases(name);
    let mut failures = Vec::new();
    for case in &cases {
        let ids = tk.encode(&case.text, false).unwrap();
        let back = tk.decode(&ids, false).unwrap();
        if back != case.text {
            failures.push(format!(
                "case {}: {:?} -> {:?}",
                case.index, case.text, back
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: round trip failed:\n{}",
        failures.join("\n")
    );
}

macro_rules! vocab_tests {
    ($($test:ident, $round:ident: $name:literal, $known:expr;)*) => {$(
        #[test]
        fn $test() {
            check($name, $known);
        }
        #[test]
        fn $round() {
            round_trip($name);
        }
    )*};
}

vocab_tests! {
    qwen2_matches_llama_cpp, qwen2_round_trips: "qwen2", &[];
    llama_bpe_matches_llama_cpp, llama_bpe_round_trips: "llama-bpe", &[];
    llama_spm_matches_llama_cpp, llama_spm_round_trips: "llama-spm", &[];
    gpt2_matches_llama_cpp, gpt2_round_trips: "gpt-2", &[];
    phi3_matches_llama_cpp, phi3_round_trips: "phi-3", &[];
    starcoder_matches_llama_cpp, starcoder_round_trips: "starcoder", &[];
    refact_matches_llama_cpp, refact_round_trips: "refact", &[];
    command_r_matches_llama_cpp, command_r_round_trips: "command-r", &[];
    mpt_matches_llama_cpp, mpt_round_trips: "mpt", &[];
    falcon_matches_llama_cpp, falcon_round_trips: "falcon", &[];
    deepseek_coder_matches_llama_cpp, deepseek_coder_round_trips: "deepseek-coder", &[];
    qwen35_matches_llama_cpp, qwen35_round_trips: "qwen35", &[];
    gemma4_matches_llama_cpp, gemma4_round_trips: "gemma-4", &[];
}

/// BERT's WordPiece (bge-small's vocabulary): lower-cased and accent-stripped, so no round
/// trip, only the ids.
#[test]
fn bert_bge_matches_llama_cpp() {
    check("bert-bge", &[]);
}
