//! A GGUF file's own vocabulary (`tokenizer.ggml.*`) turned into a `tokenizers::Tokenizer`.
//!
//! Reference: llama.cpp `src/llama-vocab.cpp` (how each key is read and defaulted, which
//! token types are matched in text, the SentencePiece merge loop) and `gguf-py`'s
//! `constants.py` for the token type numbers.
//!
//! - `gpt2`: byte-level BPE from `tokenizer.ggml.tokens` + `tokenizer.ggml.merges`, with the
//!   regex split of the file's `tokenizer.ggml.pre` (see `pretok`).
//! - `llama` (SentencePiece BPE): llama.cpp repeatedly merges the adjacent pair whose
//!   concatenation is a vocabulary entry with the highest score. That is BPE whose merges
//!   are every (left, right) split of each vocabulary entry, ranked by the entry's score;
//!   text is normalised to SentencePiece form ("▁" for spaces, one "▁" prepended when
//!   `add_space_prefix`), and characters without a token fall back to `<0xXX>` byte tokens.
//! - `gemma4`: BPE from `tokenizer.ggml.merges` over raw UTF-8 in SentencePiece form (spaces
//!   become "▁", no prefix space), split only between newline runs and the rest, with
//!   `<0xXX>` byte fallback. BOS is added whatever `add_bos_token` says, as llama.cpp does.
//!
//! Control, unknown and user-defined tokens become added tokens, so their text is matched
//! as one token wherever it appears.

use std::collections::{HashMap, HashSet};

use ferrum_core::{Error, Result};
use ferrum_loader::GgufFile;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::chat::ChatTemplate;
use crate::pretok;
use crate::Tokenizer;

/// `tokenizer.ggml.token_type` values (gguf-py `TokenType`; 6, byte, needs no constant:
/// `<0xXX>` tokens are found by text for byte fallback).
mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
}

const SPM_SPACE: &str = "\u{2581}";

/// The vocabulary keys common to both tokenizer models, checked.
struct Vocab {
    tokens: Vec<String>,
    types: Vec<i64>,
    /// Text -> id. When a text occurs twice the later id wins, as in llama.cpp.
    ids: HashMap<String, u32>,
}

impl Vocab {
    fn read(g: &GgufFile) -> Result<Vocab> {
        let raw = g.get_str_array("tokenizer.ggml.tokens").ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: tokenizer.ggml.tokens is missing or not a string array",
                g.path.display()
            ))
        })?;
        if raw.is_empty() {
            return Err(Error::Tokenizer(format!(
                "{}: tokenizer.ggml.tokens is empty",
                g.path.display()
            )));
        }
        if u32::try_from(raw.len()).is_err() {
            return Err(Error::Tokenizer(format!(
                "{}: {} tokens do not fit u32 ids",
                g.path.display(),
                raw.len()
            )));
        }
        // llama.cpp renames empty entries the same way, so ids keep their meaning.
        let tokens: Vec<String> = raw
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.to_string()
                }
            })
            .collect();
        // Present but not an integer array is an error; absent means every token is normal.
        let types = if !g.contains("tokenizer.ggml.token_type") {
            vec![token_type::NORMAL; tokens.len()]
        } else {
            let t = g
                .get_i64_array("tokenizer.ggml.token_type")
                .ok_or_else(|| {
                    Error::Tokenizer(format!(
                        "{}: tokenizer.ggml.token_type is not an integer array",
                        g.path.display()
                    ))
                })?;
            if t.len() < tokens.len() {
                return Err(Error::Tokenizer(format!(
                    "{}: tokenizer.ggml.token_type has {} entries for {} tokens",
                    g.path.display(),
                    t.len(),
                    tokens.len()
                )));
            }
            t
        };
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        Ok(Vocab { tokens, types, ids })
    }

    /// A token id from metadata, if present and inside the vocabulary (llama.cpp ignores
    /// out-of-range ids with a warning; so do we, minus the warning).
    fn special_id(&self, g: &GgufFile, key: &str) -> Option<u32> {
        g.get_u64(key)
            .filter(|&id| (id as usize) < self.tokens.len())
            .map(|id| id as u32)
    }

    /// Ids of the control and unknown tokens (what decoding may skip).
    fn special_ids(&self) -> HashSet<u32> {
        self.types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == token_type::CONTROL || t == token_type::UNKNOWN)
            .map(|(i, _)| i as u32)
            .collect()
    }

    fn bpe_vocab(&self) -> tokenizers::models::bpe::Vocab {
        self.ids.iter().map(|(t, &id)| (t.clone(), id)).collect()
    }

    fn added_tokens(&self) -> Vec<AddedToken> {
        self.types
            .iter()
            .zip(&self.tokens)
            .filter_map(|(&ty, text)| {
                let special = match ty {
                    token_type::CONTROL | token_type::UNKNOWN => true,
                    token_type::USER_DEFINED => false,
                    _ => return None,
                };
                // GGUF stores these texts raw (not normalised, not byte-level encoded), so
                // they are matched against the raw input.
                Some(
                    AddedToken::from(text.clone(), special)
                        .normalized(false)
                        .special(special),
                )
            })
            .collect()
    }
}

/// Builds the [`Tokenizer`] for a GGUF file.
pub(crate) fn load(g: &GgufFile) -> Result<Tokenizer> {
    let model = g.get_str("tokenizer.ggml.model").ok_or_else(|| {
        Error::Tokenizer(format!(
            "{}: tokenizer.ggml.model is missing",
            g.path.display()
        ))
    })?;
    // Check the model name before reading the (possibly large) vocabulary.
    if !matches!(model, "gpt2" | "llama" | "bert" | "gemma4" | "t5") {
        return Err(Error::Tokenizer(format!(
            "{}: unsupported tokenizer.ggml.model = {model:?} (supported: \"gpt2\" byte-level \
             BPE, \"llama\" SentencePiece, \"bert\" WordPiece, \"gemma4\" SentencePiece-style \
             BPE, \"t5\" SentencePiece Unigram)",
            g.path.display()
        )));
    }
    let vocab = Vocab::read(g)?;
    if model == "bert" {
        return wordpiece(g, &vocab);
    }
    if model == "t5" {
        return unigram(g, &vocab);
    }
    let (mut inner, add_bos_default) = match model {
        "gpt2" => (byte_level_bpe(g, &vocab)?, None),
        "gemma4" => (gemma4_bpe(g, &vocab)?, Some(true)),
        _ => (sentencepiece_bpe(g, &vocab)?, Some(true)),
    };

    inner.add_special_tokens(&vocab.added_tokens());

    let bos_id = vocab.special_id(g, "tokenizer.ggml.bos_token_id");
    let eos_id = vocab.special_id(g, "tokenizer.ggml.eos_token_id");
    let add_bos_default = match add_bos_default {
        Some(v) => v,
        None => pretok::spec_for(g.get_str("tokenizer.ggml.pre"))?.add_bos_default,
    };
    // Early converted Gemma 4 files say add_bos_token = false, yet without BOS the model's
    // output degrades badly (llama.cpp PR 21500), so llama.cpp adds it regardless; so do we.
    let add_bos = g
        .get_bool("tokenizer.ggml.add_bos_token")
        .unwrap_or(add_bos_default)
        || model == "gemma4";
    let add_eos = g.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false);
    let text_of = |id: u32| vocab.tokens[id as usize].clone();
    let bos = match (add_bos, bos_id) {
        (false, _) => None,
        (true, Some(id)) => Some((id, text_of(id))),
        // llama.cpp's converter marks BOS for tokenizers that have none (SmolLM3's): there
        // is nothing to add.
        (true, None) => None,
    };
    let eos = match (add_eos, eos_id) {
        (false, _) => None,
        (true, Some(id)) => Some((id, text_of(id))),
        (true, None) => {
            return Err(Error::Tokenizer(format!(
                "{}: tokenizer.ggml.add_eos_token is set but there is no valid eos_token_id",
                g.path.display()
            )))
        }
    };
    if let Some(p) = crate::bos_eos_processor(bos, eos)? {
        inner.with_post_processor(Some(p));
    }

    let mut eos_ids = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = vocab.special_id(g, key) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
    }
    crate::add_end_of_turn_ids(&inner, &mut eos_ids);

    let special = vocab.special_ids();

    let chat_template = match g.get_str("tokenizer.chat_template") {
        Some(src) => Some(ChatTemplate::new(
            src,
            &bos_id.map(text_of).unwrap_or_default(),
            &eos_id.map(text_of).unwrap_or_default(),
        )?),
        None => None,
    };

    Tokenizer::assemble(
        inner,
        vocab.tokens.len(),
        bos_id,
        eos_ids,
        special,
        chat_template,
    )
}

/// `tokenizer.ggml.model = "bert"`: BERT's WordPiece as llama.cpp's converter stores it —
/// a word's first piece with a leading `▁`, a continuing piece bare (Hugging Face's `##`
/// dropped), special tokens as they are. The pieces are turned back into Hugging Face's
/// spelling and run by its WordPiece model behind BERT's normaliser (lower case, accents
/// stripped, CJK characters split) and pre-tokeniser, with `[CLS] A [SEP]` (pairs:
/// `[CLS] A [SEP] B [SEP]`, B's segment 1) around the input.
fn wordpiece(g: &GgufFile, vocab: &Vocab) -> Result<Tokenizer> {
    use tokenizers::models::wordpiece::WordPiece;
    use tokenizers::normalizers::bert::BertNormalizer;
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    use tokenizers::processors::template::{SpecialToken, TemplateProcessing};

    let mut pieces: HashMap<String, u32> = HashMap::new();
    for (i, (t, &ty)) in vocab.tokens.iter().zip(&vocab.types).enumerate() {
        let text = match ty {
            token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED => t.clone(),
            _ => match t.strip_prefix('\u{2581}') {
                Some(word) => word.to_string(),
                None => format!("##{t}"),
            },
        };
        pieces.insert(text, i as u32);
    }
    let text_of = |id: u32| vocab.tokens[id as usize].clone();
    let unk = vocab
        .special_id(g, "tokenizer.ggml.unknown_token_id")
        .map(text_of)
        .unwrap_or_else(|| "[UNK]".to_string());
    let model = WordPiece::builder()
        .vocab(
            pieces
                .into_iter()
                .collect::<tokenizers::models::bpe::Vocab>(),
        )
        .unk_token(unk)
        .continuing_subword_prefix("##".into())
        .build()
        .map_err(|e| Error::Tokenizer(format!("{}: WordPiece: {e}", g.path.display())))?;
    let mut inner = tokenizers::Tokenizer::new(model);
    inner.with_normalizer(Some(BertNormalizer::new(true, true, None, true)));
    inner.with_pre_tokenizer(Some(BertPreTokenizer));
    inner.with_decoder(Some(tokenizers::decoders::wordpiece::WordPiece::default()));
    inner.add_special_tokens(&vocab.added_tokens());

    let cls = vocab
        .special_id(g, "tokenizer.ggml.cls_token_id")
        .or_else(|| vocab.special_id(g, "tokenizer.ggml.bos_token_id"));
    let sep = vocab
        .special_id(g, "tokenizer.ggml.seperator_token_id")
        .or_else(|| vocab.special_id(g, "tokenizer.ggml.eos_token_id"));
    let (Some(cls), Some(sep)) = (cls, sep) else {
        return Err(Error::Tokenizer(format!(
            "{}: a WordPiece vocabulary without its [CLS] and [SEP] ids",
            g.path.display()
        )));
    };
    let err = |e: tokenizers::Error| Error::Tokenizer(format!("BERT template: {e}"));
    let processor = TemplateProcessing::builder()
        .try_single(vec!["CLS", "$A", "SEP"])
        .map_err(|e| Error::Tokenizer(format!("BERT template: {e}")))?
        .try_pair(vec!["CLS", "$A", "SEP", "$B:1", "SEP:1"])
        .map_err(|e| Error::Tokenizer(format!("BERT template: {e}")))?
        .special_tokens(vec![
            SpecialToken::new("CLS".into(), vec![cls], vec![text_of(cls)]).map_err(err)?,
            SpecialToken::new("SEP".into(), vec![sep], vec![text_of(sep)]).map_err(err)?,
        ])
        .build()
        .map_err(|e| Error::Tokenizer(format!("BERT template: {e}")))?;
    inner.with_post_processor(Some(processor));
    let special = vocab.special_ids();
    Tokenizer::assemble(
        inner,
        vocab.tokens.len(),
        Some(cls),
        vec![sep],
        special,
        None,
    )
}

/// `tokenizer.ggml.model = "t5"`: a SentencePiece Unigram model (XLM-RoBERTa and the
/// embedders and rerankers built on it: multilingual-e5, bge-m3, bge-reranker-v2-m3) as
/// llama.cpp's converter stores it: pieces and their scores, the model's own normalisation
/// (`tokenizer.ggml.precompiled_charsmap`, SentencePiece's compiled NFKC-style map), and
/// llama.cpp's `add_space_prefix` / `remove_extra_whitespaces` switches. llama.cpp's reading:
/// the input mapped through the charsmap, every run of spaces one `▁` before the next word
/// (none at the end), then the best-scoring segmentation (an unknown character scoring the
/// lowest piece's score less 10, consecutive unknowns one token). Single inputs are
/// `BOS A EOS` as the file asks; pairs `BOS A EOS SEP B EOS` (XLM-R's `<s> A </s></s> B
/// </s>`, llama.cpp's rerank layout).
fn unigram(g: &GgufFile, vocab: &Vocab) -> Result<Tokenizer> {
    use tokenizers::decoders::metaspace::Metaspace as MetaspaceDecoder;
    use tokenizers::models::unigram::Unigram;
    use tokenizers::normalizers::strip::Strip as StripNormalizer;
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
    use tokenizers::processors::template::{SpecialToken, TemplateProcessing};

    let path = g.path.display();
    let scores = g.get_f32_array("tokenizer.ggml.scores").ok_or_else(|| {
        Error::Tokenizer(format!(
            "{path}: tokenizer.ggml.scores is missing (a Unigram model needs its scores)"
        ))
    })?;
    if scores.len() < vocab.tokens.len() {
        return Err(Error::Tokenizer(format!(
            "{path}: tokenizer.ggml.scores has {} entries for {} tokens",
            scores.len(),
            vocab.tokens.len()
        )));
    }
    let unk = vocab.special_id(g, "tokenizer.ggml.unknown_token_id");
    let pieces: Vec<(String, f64)> = vocab
        .tokens
        .iter()
        .zip(&scores)
        .map(|(t, &s)| (t.clone(), s as f64))
        .collect();
    let model = Unigram::from(pieces, unk.map(|u| u as usize), false)
        .map_err(|e| Error::Tokenizer(format!("{path}: Unigram vocabulary: {e}")))?;

    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    let charsmap = match g.get_i64_array("tokenizer.ggml.precompiled_charsmap") {
        Some(map) if !map.is_empty() => {
            let bytes: Vec<u8> = map.iter().map(|&b| b as u8).collect();
            Some(crate::charsmap::Charsmap::parse(&bytes).map_err(|e| {
                Error::Tokenizer(format!("{path}: tokenizer.ggml.precompiled_charsmap: {e}"))
            })?)
        }
        _ => None,
    };
    let merge = g
        .get_bool("tokenizer.ggml.remove_extra_whitespaces")
        .unwrap_or(true);
    let replace_err = |e| Error::Tokenizer(format!("Unigram normalizer: {e}"));
    if merge {
        normalizers.push(StripNormalizer::new(true, true).into());
        normalizers.push(
            Replace::new(
                tokenizers::normalizers::replace::ReplacePattern::Regex(" {2,}".into()),
                " ",
            )
            .map_err(replace_err)?
            .into(),
        );
    }
    let prefix = g
        .get_bool("tokenizer.ggml.add_space_prefix")
        .unwrap_or(true);
    let scheme = if prefix {
        PrependScheme::Always
    } else {
        PrependScheme::Never
    };
    let mut inner = tokenizers::Tokenizer::new(model);
    inner.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    inner.with_pre_tokenizer(Some(Metaspace::new('\u{2581}', scheme, true)));
    inner.with_decoder(Some(MetaspaceDecoder::new('\u{2581}', scheme, true)));
    inner.add_special_tokens(&vocab.added_tokens());

    let bos = vocab.special_id(g, "tokenizer.ggml.bos_token_id");
    let eos = vocab.special_id(g, "tokenizer.ggml.eos_token_id");
    let sep = vocab
        .special_id(g, "tokenizer.ggml.seperator_token_id")
        .or(eos);
    let add_bos = g.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(true);
    let add_eos = g.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(true);
    let text_of = |id: u32| vocab.tokens[id as usize].clone();
    let err = |e: tokenizers::Error| Error::Tokenizer(format!("Unigram template: {e}"));
    let mut special = Vec::new();
    let (mut single, mut pair): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    if let (true, Some(b)) = (add_bos, bos) {
        special.push(SpecialToken::new("BOS".into(), vec![b], vec![text_of(b)]).map_err(err)?);
        single.push("BOS".into());
        pair.push("BOS".into());
    }
    single.push("$A".into());
    pair.push("$A".into());
    if let (true, Some(e)) = (add_eos, eos) {
        special.push(SpecialToken::new("EOS".into(), vec![e], vec![text_of(e)]).map_err(err)?);
        single.push("EOS".into());
        pair.push("EOS".into());
        if let Some(s) = sep {
            special.push(SpecialToken::new("SEP".into(), vec![s], vec![text_of(s)]).map_err(err)?);
            pair.push("SEP:1".into());
        }
        pair.extend(["$B:1".to_string(), "EOS:1".to_string()]);
    } else {
        pair.push("$B:1".into());
    }
    let processor = TemplateProcessing::builder()
        .try_single(single)
        .map_err(|e| Error::Tokenizer(format!("Unigram template: {e}")))?
        .try_pair(pair)
        .map_err(|e| Error::Tokenizer(format!("Unigram template: {e}")))?
        .special_tokens(special)
        .build()
        .map_err(|e| Error::Tokenizer(format!("Unigram template: {e}")))?;
    inner.with_post_processor(Some(processor));
    let eos_ids: Vec<u32> = eos.into_iter().collect();
    let mut tok = Tokenizer::assemble(
        inner,
        vocab.tokens.len(),
        bos,
        eos_ids,
        vocab.special_ids(),
        None,
    )?;
    tok.charsmap = charsmap.map(std::sync::Arc::new);
    Ok(tok)
}

/// `tokenizer.ggml.merges` as (left, right) pairs, highest priority first. The separator is
/// the first space after the first character, so a left piece that is itself a space (a
/// vocabulary without byte-level encoding may have one) still parses.
fn read_merges(g: &GgufFile, model: &str) -> Result<Vec<(String, String)>> {
    let raw_merges = g.get_str_array("tokenizer.ggml.merges").ok_or_else(|| {
        Error::Tokenizer(format!(
            "{}: tokenizer.ggml.merges is missing or not a string array (needed by a {model} \
             tokenizer)",
            g.path.display()
        ))
    })?;
    raw_merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let first = m.chars().next().map_or(0, char::len_utf8);
            m[first..]
                .find(' ')
                .map(|at| {
                    let (a, b) = m.split_at(first + at);
                    (a.to_string(), b[1..].to_string())
                })
                .ok_or_else(|| {
                    Error::Tokenizer(format!(
                        "{}: tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by \
                         a space",
                        g.path.display()
                    ))
                })
        })
        .collect()
}

/// `tokenizer.ggml.model = "gpt2"`.
fn byte_level_bpe(g: &GgufFile, vocab: &Vocab) -> Result<tokenizers::Tokenizer> {
    let spec = pretok::spec_for(g.get_str("tokenizer.ggml.pre"))?;
    let merges = read_merges(g, "gpt2")?;

    let model = BPE::builder()
        .vocab_and_merges(vocab.bpe_vocab(), merges)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("{}: BPE vocabulary: {e}", g.path.display())))?;

    let mut steps = Vec::with_capacity(spec.regexes.len() + 1);
    for re in &spec.regexes {
        let split = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex {re:?}: {e}")))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    // The regexes above did the splitting; ByteLevel only maps bytes to its printable
    // alphabet.
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));

    let mut tk = tokenizers::Tokenizer::new(model);
    tk.with_pre_tokenizer(Some(PreTokenizerSequence::new(steps)));
    tk.with_decoder(Some(ByteLevel::default()));
    Ok(tk)
}

/// `tokenizer.ggml.model = "gemma4"`: ranked merges like `gpt2`, but over the text's own
/// UTF-8 in SentencePiece form rather than GPT-2's byte alphabet.
fn gemma4_bpe(g: &GgufFile, vocab: &Vocab) -> Result<tokenizers::Tokenizer> {
    let merges = read_merges(g, "gemma4")?;
    // No unknown token: a character without a token and without its byte tokens is dropped,
    // as llama.cpp drops it (Gemma 4's vocabulary has all 256 byte tokens).
    let model = BPE::builder()
        .vocab_and_merges(vocab.bpe_vocab(), merges)
        .byte_fallback(true)
        .build()
        .map_err(|e| Error::Tokenizer(format!("{}: BPE vocabulary: {e}", g.path.display())))?;

    let replace_err = |e| Error::Tokenizer(format!("gemma4 normalizer: {e}"));
    // Transformers' tokenizer.json for Gemma 4 merges over the whole text; no merge and no
    // token mixes a newline with anything else, so cutting at newline runs (as llama.cpp
    // does) changes no ids and keeps each BPE word, and its cache entry, to one line.
    let lines = Split::new(
        SplitPattern::Regex("[^\n]+|\n+".into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| Error::Tokenizer(format!("gemma4 pre-tokenizer: {e}")))?;
    let decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPM_SPACE, " ").map_err(replace_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];

    let mut tk = tokenizers::Tokenizer::new(model);
    tk.with_normalizer(Some(Replace::new(" ", SPM_SPACE).map_err(replace_err)?));
    tk.with_pre_tokenizer(Some(lines));
    tk.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tk)
}

/// `tokenizer.ggml.model = "llama"` (SentencePiece BPE with scores).
fn sentencepiece_bpe(g: &GgufFile, vocab: &Vocab) -> Result<tokenizers::Tokenizer> {
    let scores = g.get_f32_array("tokenizer.ggml.scores").ok_or_else(|| {
        Error::Tokenizer(format!(
            "{}: tokenizer.ggml.scores is missing or not a number array (needed by a llama \
             tokenizer)",
            g.path.display()
        ))
    })?;
    if scores.len() < vocab.tokens.len() {
        return Err(Error::Tokenizer(format!(
            "{}: tokenizer.ggml.scores has {} entries for {} tokens",
            g.path.display(),
            scores.len(),
            vocab.tokens.len()
        )));
    }
    let merges = spm_merges(vocab, &scores);

    let unk = g
        .get_u64("tokenizer.ggml.unknown_token_id")
        .and_then(|id| vocab.tokens.get(id as usize))
        .cloned()
        .or_else(|| vocab.ids.contains_key("<unk>").then(|| "<unk>".to_string()));
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab.bpe_vocab(), merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let model = builder
        .build()
        .map_err(|e| Error::Tokenizer(format!("{}: SPM vocabulary: {e}", g.path.display())))?;

    let add_space_prefix = g
        .get_bool("tokenizer.ggml.add_space_prefix")
        .unwrap_or(true);
    let replace_err = |e| Error::Tokenizer(format!("SPM normalizer: {e}"));
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new(SPM_SPACE.into()).into());
    }
    normalizers.push(Replace::new(" ", SPM_SPACE).map_err(replace_err)?.into());

    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPM_SPACE, " ").map_err(replace_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        // After Fuse there is one string, so this removes only the prefix space that
        // encoding added.
        decoders.push(Strip::new(' ', 1, 0).into());
    }

    let mut tk = tokenizers::Tokenizer::new(model);
    tk.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    tk.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tk)
}

/// Every way to write a mergeable vocabulary entry as two vocabulary entries, best score
/// first. llama.cpp forms a pair when the concatenation is in the vocabulary and takes the
/// highest score; ties go to the leftmost pair, which BPE's lowest-rank-then-leftmost rule
/// reproduces when the tied pieces are ranked by id.
fn spm_merges(vocab: &Vocab, scores: &[f32]) -> Vec<(String, String)> {
    let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (id, piece) in vocab.tokens.iter().enumerate() {
        // Only these can be produced by merging; control, byte and unknown entries are
        // matched as added tokens or are byte fallbacks.
        let mergeable = matches!(
            vocab.types[id],
            token_type::NORMAL | token_type::USER_DEFINED | token_type::UNUSED | 0
        );
        if !mergeable || vocab.ids.get(piece) != Some(&(id as u32)) {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (vocab.ids.get(left), vocab.ids.get(right)) {
                ranked.push((scores[id], id as u32, l, r));
            }
        }
    }
    // Higher score first; NaN scores (a broken file) sort last instead of panicking.
    ranked.sort_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or_else(|| a.0.is_nan().cmp(&b.0.is_nan()))
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
    });
    ranked
        .into_iter()
        .map(|(_, _, l, r)| {
            (
                vocab.tokens[l as usize].clone(),
                vocab.tokens[r as usize].clone(),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrum_loader::gguf::writer;
    use ferrum_loader::Value;

    fn strs(v: &[&str]) -> Value {
        Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect())
    }

    /// Writes `meta` as a tensor-less GGUF to a fresh temporary file and opens it.
    fn gguf(name: &str, meta: &[(&str, Value)]) -> GgufFile {
        let path = std::env::temp_dir().join(format!(
            "ferrum-tokenizer-{}-{name}.gguf",
            std::process::id()
        ));
        std::fs::write(&path, writer::write(meta, &[])).unwrap();
        let g = GgufFile::open(&path).unwrap();
        // The file is mapped: removing its name leaves the mapping readable.
        let _ = std::fs::remove_file(&path);
        g
    }

    fn tiny_bpe(merges: &[&str]) -> Vec<(&'static str, Value)> {
        vec![
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("gpt-2".into())),
            (
                "tokenizer.ggml.tokens",
                strs(&["a", "b", "ab", "Ġ", "Ġab", "<|end|>"]),
            ),
            (
                "tokenizer.ggml.token_type",
                Value::Array([1, 1, 1, 1, 1, 3].into_iter().map(Value::I32).collect()),
            ),
            ("tokenizer.ggml.merges", strs(merges)),
            ("tokenizer.ggml.eos_token_id", Value::U32(5)),
        ]
    }

    fn load_err(name: &str, meta: &[(&str, Value)]) -> String {
        match load(&gguf(name, meta)) {
            Ok(_) => panic!("{name}: expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn tiny_bpe_encodes_and_matches_control_tokens() {
        let tk = load(&gguf("ok", &tiny_bpe(&["a b", "Ġ ab"]))).unwrap();
        assert_eq!(tk.encode("ab ab<|end|>", false).unwrap(), vec![2, 4, 5]);
        assert_eq!(tk.eos_ids(), &[5]);
        assert!(tk.is_special(5) && !tk.is_special(2));
        assert_eq!(tk.decode(&[2, 4, 5], true).unwrap(), "ab ab");
        assert!(tk.decode(&[6], false).is_err());
    }

    #[test]
    fn missing_tokens_is_an_error() {
        let mut meta = tiny_bpe(&["a b"]);
        meta.retain(|(k, _)| *k != "tokenizer.ggml.tokens");
        assert!(load_err("no-tokens", &meta).contains("tokenizer.ggml.tokens"));
    }

    #[test]
    fn tokens_of_the_wrong_type_is_an_error() {
        let mut meta = tiny_bpe(&["a b"]);
        meta.retain(|(k, _)| *k != "tokenizer.ggml.tokens");
        meta.push(("tokenizer.ggml.tokens", Value::U32(3)));
        assert!(load_err("bad-tokens", &meta).contains("tokenizer.ggml.tokens"));
    }

    #[test]
    fn merge_with_unknown_token_is_an_error() {
        let err = load_err("bad-merge", &tiny_bpe(&["a b", "Ġ zz"]));
        assert!(err.contains("zz"), "{err}");
    }

    #[test]
    fn malformed_merge_is_an_error() {
        let err = load_err("merge-no-space", &tiny_bpe(&["ab"]));
        assert!(err.contains("merges[0]"), "{err}");
    }

    #[test]
    fn missing_merges_is_an_error() {
        let mut meta = tiny_bpe(&[]);
        meta.retain(|(k, _)| *k != "tokenizer.ggml.merges");
        assert!(load_err("no-merges", &meta).contains("merges"));
    }

    #[test]
    fn short_token_types_is_an_error() {
        let mut meta = tiny_bpe(&["a b"]);
        meta.retain(|(k, _)| *k != "tokenizer.ggml.token_type");
        meta.push((
            "tokenizer.ggml.token_type",
            Value::Array(vec![Value::I32(1)]),
        ));
        assert!(load_err("short-types", &meta).contains("token_type"));
    }

    #[test]
    fn unknown_model_is_an_error_naming_it() {
        let mut meta = tiny_bpe(&["a b"]);
        meta[0].1 = Value::String("rwkv".into());
        assert!(load_err("unknown-model", &meta).contains("\"rwkv\""));
    }

    #[test]
    fn missing_model_is_an_error() {
        let mut meta = tiny_bpe(&["a b"]);
        meta.remove(0);
        assert!(load_err("no-model", &meta).contains("tokenizer.ggml.model"));
    }

    #[test]
    fn unknown_pre_is_an_error_naming_it() {
        let mut meta = tiny_bpe(&["a b"]);
        meta[1].1 = Value::String("mystery".into());
        assert!(load_err("unknown-pre", &meta).contains("\"mystery\""));
    }

    #[test]
    fn add_bos_without_bos_id_adds_nothing() {
        // llama.cpp's converter writes this for SmolLM3, whose tokenizer has no BOS.
        let mut meta = tiny_bpe(&["a b"]);
        meta.push(("tokenizer.ggml.add_bos_token", Value::Bool(true)));
        let tk = load(&gguf("bos-missing", &meta)).unwrap();
        assert_eq!(tk.bos_id(), None);
        assert_eq!(
            tk.encode("ab", true).unwrap(),
            tk.encode("ab", false).unwrap()
        );
    }

    #[test]
    fn spm_without_scores_is_an_error() {
        let meta = vec![
            ("tokenizer.ggml.model", Value::String("llama".into())),
            ("tokenizer.ggml.tokens", strs(&["<unk>", "▁a"])),
        ];
        assert!(load_err("spm-no-scores", &meta).contains("scores"));
    }

    #[test]
    fn tiny_spm_merges_by_score_and_falls_back_to_bytes() {
        let mut tokens = vec!["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"];
        let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 1];
        let bytes: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.extend(bytes.iter().map(String::as_str));
        types.extend([6; 256]);
        // "ab" outscores "▁a", so "▁ab" is "▁" + "ab" -> "▁ab".
        let mut scores = vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -5.0, -4.0, -6.0];
        scores.extend([0.0; 256]);
        let meta = vec![
            ("tokenizer.ggml.model", Value::String("llama".into())),
            ("tokenizer.ggml.tokens", strs(&tokens)),
            (
                "tokenizer.ggml.token_type",
                Value::Array(types.into_iter().map(Value::I32).collect()),
            ),
            (
                "tokenizer.ggml.scores",
                Value::Array(scores.into_iter().map(Value::F32).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ];
        let tk = load(&gguf("spm", &meta)).unwrap();
        assert_eq!(tk.encode("ab", false).unwrap(), vec![8]);
        assert_eq!(tk.encode("ab", true).unwrap(), vec![1, 8]);
        // 'z' is not in the vocabulary: byte fallback <0x7A>.
        assert_eq!(tk.encode("z", false).unwrap(), vec![3, 9 + 0x7A]);
        assert_eq!(tk.decode(&[1, 8, 3, 9 + 0x7A], true).unwrap(), "ab z");
    }

    /// A Gemma 4 style vocabulary: ids 0-2 control, then normal pieces, then the 256 bytes.
    /// Token 9 is a bare space, which only a merge line starting with a space can name.
    fn tiny_gemma4(add_bos: Option<bool>) -> Vec<(&'static str, Value)> {
        let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "▁", "a", "b", "ab", "▁ab"]
            .into_iter()
            .chain(["<|turn>", " ", " a"])
            .map(String::from)
            .collect();
        let mut types = vec![3, 3, 3, 1, 1, 1, 1, 1, 3, 1, 1];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        types.extend([6; 256]);
        let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
        let mut meta = vec![
            ("tokenizer.ggml.model", Value::String("gemma4".into())),
            ("tokenizer.ggml.tokens", strs(&tokens)),
            (
                "tokenizer.ggml.token_type",
                Value::Array(types.into_iter().map(Value::I32).collect()),
            ),
            ("tokenizer.ggml.merges", strs(&["a b", "▁ ab", "  a"])),
            ("tokenizer.ggml.bos_token_id", Value::U32(2)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
            ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
        ];
        if let Some(b) = add_bos {
            meta.push(("tokenizer.ggml.add_bos_token", Value::Bool(b)));
        }
        meta
    }

    const BYTE0: u32 = 11;

    #[test]
    fn tiny_gemma4_merges_in_spm_form_and_falls_back_to_bytes() {
        let tk = load(&gguf("gemma4", &tiny_gemma4(Some(true)))).unwrap();
        // No prefix space; the space before the second "ab" is "▁", which merges with it.
        assert_eq!(tk.encode("ab ab", false).unwrap(), vec![6, 7]);
        // 'z' and the newline have no token: their bytes; control tokens match in the text.
        assert_eq!(
            tk.encode("z<|turn>\nab", false).unwrap(),
            vec![BYTE0 + 0x7A, 8, BYTE0 + 0x0A, 6]
        );
        assert_eq!(
            tk.decode(&[2, 6, 7, BYTE0 + 0x0A, BYTE0 + 0xC3, BYTE0 + 0xA9], true)
                .unwrap(),
            "ab ab\né"
        );
        assert_eq!(tk.eos_ids(), &[1]);
    }

    #[test]
    fn gemma4_always_adds_bos() {
        for add_bos in [Some(false), Some(true), None] {
            let tk = load(&gguf("gemma4-bos", &tiny_gemma4(add_bos))).unwrap();
            assert_eq!(tk.bos_id(), Some(2));
            assert_eq!(tk.encode("ab", true).unwrap(), vec![2, 6], "{add_bos:?}");
        }
    }

    #[test]
    fn gemma4_without_merges_is_an_error() {
        let mut meta = tiny_gemma4(None);
        meta.retain(|(k, _)| *k != "tokenizer.ggml.merges");
        let err = load_err("gemma4-no-merges", &meta);
        assert!(err.contains("merges") && err.contains("gemma4"), "{err}");
    }

    #[test]
    fn merge_whose_left_piece_is_a_space_parses() {
        // "  a" is " " + "a"; the vocabulary has " a", so a bad split would fail to build.
        let g = gguf("merge-space", &tiny_gemma4(None));
        let merges = read_merges(&g, "gemma4").unwrap();
        assert_eq!(merges[2], (" ".to_string(), "a".to_string()));
    }
}
