//! The pre-tokenizer of each `tokenizer.ggml.pre` value: which regexes split the text before
//! byte-level BPE, and the few per-model switches that go with them.
//!
//! Reference: llama.cpp `src/llama-vocab.cpp` (`llm_tokenizer_bpe` for the regex lists, the
//! `tokenizer_pre == ...` chain in `llama_vocab::impl::load` for which names share a type and
//! for `ignore_merges` / `add_bos`). llama.cpp applies the regexes one after another, each
//! splitting the pieces left by the previous one and keeping unmatched text as pieces of
//! its own; a sequence of `Split(.., Isolated)` pre-tokenizers does exactly that.
//!
//! Where llama.cpp notes the original `tokenizer.json` pattern next to its std::regex
//! adaptation (llama3, qwen2, qwen35) we use the original: llama.cpp's test vectors are made
//! with Hugging Face tokenizers, and Oniguruma (which `tokenizers` uses) accepts it as is.

use ferrum_core::{Error, Result};

/// GPT-2's pattern (also the one `ByteLevel(use_regex = true)` applies).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3: numbers in groups of up to three digits, letters may take one leading
/// non-letter (so " hello" and "(hello" are single pieces), newlines grouped.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2: like Llama 3 but every digit is its own piece.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5: Qwen2 with combining marks (`\p{M}`) kept inside words.
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's o200k (gpt-oss, MiniMax-M2): words split at case changes (an upper-case run
/// then lower-case letters, or an upper-case run alone), contractions kept on, numbers in
/// threes, punctuation runs taking trailing newlines and slashes.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's tekken (Mistral Nemo, Small 3.x, Ministral 3, Mistral 4): GPT-4o's word
/// classes without the contractions, every digit its own piece. tokenizer.json's pattern;
/// llama.cpp spells the same classes out with look-aheads.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek-V3 (and R1, Kimi-free V3.x): digits in threes, runs of CJK ideographs and kana,
/// then words, punctuation and spaces — applied in that order, as llama.cpp does.
const DEEPSEEK3: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// How a byte-level BPE vocabulary splits text before merging.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PreTokenizerSpec {
    /// Applied in order, each on the pieces the previous one produced.
    pub regexes: Vec<&'static str>,
    /// A piece that is itself a vocabulary entry becomes that token without running merges
    /// (Llama 3's tokenizer.json sets `ignore_merges`; llama.cpp does the same).
    pub ignore_merges: bool,
    /// Whether BOS is added when the GGUF has no `tokenizer.ggml.add_bos_token`.
    pub add_bos_default: bool,
}

impl PreTokenizerSpec {
    fn new(regexes: &[&'static str]) -> Self {
        PreTokenizerSpec {
            regexes: regexes.to_vec(),
            ignore_merges: false,
            add_bos_default: false,
        }
    }
}

/// The spec for a `tokenizer.ggml.pre` value. A missing value means "default", as in
/// llama.cpp (which warns that such files tokenize poorly). Names we have not checked
/// against llama.cpp are an error rather than a guess.
pub(crate) fn spec_for(pre: Option<&str>) -> Result<PreTokenizerSpec> {
    let spec = match pre.unwrap_or("default") {
        "default" => {
            PreTokenizerSpec::new(&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
        }
        "gpt-2" | "phi-2" | "mpt" | "olmo" | "modern-bert" => PreTokenizerSpec::new(&[GPT2]),
        // Digits one by one, then GPT-2's pattern.
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" => {
            PreTokenizerSpec::new(&[r"\p{N}", GPT2])
        }
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => PreTokenizerSpec::new(&[QWEN2]),
        "qwen35" => PreTokenizerSpec::new(&[QWEN35]),
        // Llama 3's pattern, but merges are not skipped and no BOS is added.
        "glm4" | "glm5" | "chatglm-bpe" => PreTokenizerSpec::new(&[LLAMA3]),
        "tekken" => PreTokenizerSpec::new(&[TEKKEN]),
        "deepseek-v3" => PreTokenizerSpec::new(&DEEPSEEK3),
        "gpt-4o" | "minimax-m2" => PreTokenizerSpec::new(&[GPT4O]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => PreTokenizerSpec {
            regexes: vec![LLAMA3],
            ignore_merges: true,
            add_bos_default: true,
        },
        // Punctuation runs, GPT-2's pattern, then groups of three ASCII digits (llama.cpp's
        // list; it matches all of llama.cpp's falcon test vectors).
        "falcon" => PreTokenizerSpec::new(&[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"]),
        "deepseek-coder" => PreTokenizerSpec::new(&[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            r"[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        ]),
        other => {
            return Err(Error::Tokenizer(format!(
                "unsupported pre-tokenizer tokenizer.ggml.pre = {other:?} (supported: default, \
                 gpt-2, phi-2, mpt, olmo, starcoder, refact, command-r, smollm, codeshell, \
                 qwen2, deepseek-r1-qwen, stablelm2, megrez, qwen35, glm4, glm5, chatglm-bpe, tekken, \
                 deepseek-v3, gpt-4o, minimax-m2, \
                 llama3, llama-v3, llama-bpe, falcon3, pixtral, falcon, deepseek-coder)"
            )))
        }
    };
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_pre_is_an_error_naming_it() {
        let err = spec_for(Some("no-such-pre")).unwrap_err().to_string();
        assert!(err.contains("no-such-pre"), "{err}");
    }

    #[test]
    fn missing_pre_is_default() {
        assert_eq!(spec_for(None).unwrap(), spec_for(Some("default")).unwrap());
    }

    /// The splits Python's `regex` module gives with o200k's pattern (the one tiktoken and
    /// tokenizer.json use).
    #[test]
    fn gpt_4o_splits_at_case_changes_and_numbers_in_threes() {
        use tokenizers::{PreTokenizedString, PreTokenizer};
        let split = tokenizers::pre_tokenizers::split::Split::new(
            tokenizers::pre_tokenizers::split::SplitPattern::Regex(GPT4O.into()),
            tokenizers::SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap();
        for (text, want) in [
            (
                "Hello world's 12345 HTTPServer",
                &["Hello", " world's", " ", "123", "45", " HTTPServer"][..],
            ),
            (
                "  x\n\n  y!!/\n",
                &[" ", " x", "\n\n", " ", " y", "!!/\n"][..],
            ),
            ("ÉCOLE naïve CAFÉs", &["ÉCOLE", " naïve", " CAFÉs"][..]),
        ] {
            let mut p = PreTokenizedString::from(text);
            split.pre_tokenize(&mut p).unwrap();
            let got: Vec<String> = p
                .get_splits(
                    tokenizers::OffsetReferential::Original,
                    tokenizers::OffsetType::Byte,
                )
                .into_iter()
                .map(|(s, _, _)| s.to_string())
                .collect();
            assert_eq!(got, want, "{text:?}");
        }
    }

    /// What Python's `regex` module gives for these patterns (each regex splitting the
    /// previous one's pieces, matches and gaps alike, as llama.cpp and tokenizers'
    /// `Split::Isolated` do), computed with `regex.finditer` on the patterns above.
    #[test]
    fn tekken_and_deepseek_v3_split_as_python_regex_does() {
        use tokenizers::{PreTokenizedString, PreTokenizer};
        let split = |pre: &str, text: &str| -> Vec<String> {
            let mut p = PreTokenizedString::from(text);
            for re in spec_for(Some(pre)).unwrap().regexes {
                tokenizers::pre_tokenizers::split::Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex(re.into()),
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap()
                .pre_tokenize(&mut p)
                .unwrap();
            }
            p.get_splits(
                tokenizers::OffsetReferential::Original,
                tokenizers::OffsetType::Byte,
            )
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect()
        };
        let cases: [(&str, &[&str], &[&str]); 3] = [
            (
                "Hello world's 12345 HTTPServer",
                &[
                    "Hello",
                    " world",
                    "'s",
                    " ",
                    "1",
                    "2",
                    "3",
                    "4",
                    "5",
                    " HTTPServer",
                ],
                &["Hello", " world", "'s", " ", "123", "45", " HTTPServer"],
            ),
            (
                "ÉCOLE naïve CAFÉs 日本語テキスト",
                &["ÉCOLE", " naïve", " CAFÉs", " 日本語テキスト"],
                &["ÉCOLE", " naïve", " CAFÉs", " ", "日本語テキスト"],
            ),
            (
                "a.b_c;d (e) 1234567 ☃x",
                &[
                    "a", ".b", "_c", ";d", " (", "e", ")", " ", "1", "2", "3", "4", "5", "6", "7",
                    " ☃", "x",
                ],
                &[
                    "a", ".b", "_c", ";d", " (", "e", ")", " ", "123", "456", "7", " ☃", "x",
                ],
            ),
        ];
        for (text, tekken, deepseek) in cases {
            assert_eq!(split("tekken", text), tekken, "tekken: {text:?}");
            assert_eq!(
                split("deepseek-v3", text),
                deepseek,
                "deepseek-v3: {text:?}"
            );
        }
    }

    #[test]
    fn every_regex_compiles() {
        for pre in [
            "default",
            "gpt-2",
            "smollm",
            "qwen2",
            "qwen35",
            "gpt-4o",
            "llama-bpe",
            "falcon",
            "deepseek-coder",
            "glm4",
            "tekken",
            "deepseek-v3",
        ] {
            for re in spec_for(Some(pre)).unwrap().regexes {
                tokenizers::pre_tokenizers::split::Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex(re.into()),
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{pre}: {re}: {e}"));
            }
        }
    }
}
