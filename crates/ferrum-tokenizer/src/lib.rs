//! Text in, token ids out, and back; plus the chat template that turns a conversation into
//! the prompt text a model was trained on.
//!
//! - [`Tokenizer`]: one type for both model sources. It wraps a `tokenizers::Tokenizer`, built
//!   either from a Hugging Face `tokenizer.json` ([`hf`]) or from the vocabulary stored inside
//!   a GGUF file ([`gguf`], which follows llama.cpp's `llama-vocab.cpp`).
//! - [`ChatTemplate`] ([`chat`]): Jinja chat templates rendered the way transformers'
//!   `apply_chat_template(..., tokenize=False)` renders them.
//!
//! Every problem with the input files is an [`Error::Tokenizer`] or [`Error::Template`]
//! value, never a panic.

pub mod chat;
pub mod gguf;
pub mod hf;
mod pretok;

use std::collections::HashSet;
use std::path::Path;

use ferrum_core::{Error, Result};

pub use chat::{ChatTemplate, Message};

/// Token texts that end a turn in the chat formats we know. llama.cpp keeps the same kind of
/// list (its "end of generation" set) because GGUF files rarely name these tokens in metadata.
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<EOT>",
    "<end_of_utterance>",
];

/// A tokenizer plus what the generation loop needs to know about its special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    special: HashSet<u32>,
    chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(g: &ferrum_loader::GgufFile) -> Result<Tokenizer> {
        gguf::load(g)
    }

    /// `tokenizer.json`, plus `tokenizer_config.json` (chat template, bos/eos tokens,
    /// add_bos_token / add_eos_token), `chat_template.jinja` and `generation_config.json`
    /// (its `eos_token_id`, an int or a list) when they are present.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        hf::load(dir)
    }

    /// With `add_special`, BOS is prepended / EOS appended when the model asks for it.
    /// Special and control tokens written in the text (e.g. `<|im_start|>`) are always
    /// recognised as single tokens.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids`; an id outside the vocabulary is an error rather than silently dropped.
    /// Decoding one token at a time can lose leading spaces (SentencePiece) or split UTF-8
    /// characters (byte-level BPE); stream through `inner().decode_stream(..)` instead.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::Tokenizer(format!(
                "decode: token id {bad} is outside the vocabulary (size {})",
                self.vocab_size
            )));
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Tokenizer(format!("decode: {e}")))
    }

    /// Number of token ids the tokenizer knows (GGUF: the length of `tokenizer.ggml.tokens`;
    /// Hugging Face: model vocabulary plus added tokens). The model's embedding table may be
    /// larger.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Every id the generation loop should stop on: the EOS token first, then end-of-turn
    /// tokens such as `<|im_end|>`, `<|eot_id|>` or `<end_of_turn>`.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Control tokens (BOS, EOS, chat markers, ...): the ones `decode(.., true)` leaves out.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Ids of the known end-of-turn tokens present in `inner`, appended to `ids` without
/// duplicates.
fn add_end_of_turn_ids(inner: &tokenizers::Tokenizer, ids: &mut Vec<u32>) {
    for text in END_OF_TURN_TEXTS {
        if let Some(id) = inner.token_to_id(text) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
}

/// A `TemplateProcessing` post-processor that adds BOS and/or EOS around the text when
/// `encode(.., add_special = true)`; `None` when neither is wanted.
fn bos_eos_processor(
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
) -> Result<Option<tokenizers::processors::template::TemplateProcessing>> {
    use tokenizers::processors::template::{SpecialToken, TemplateProcessing};

    if bos.is_none() && eos.is_none() {
        return Ok(None);
    }
    // Template pieces are names looked up in `special`, so fixed names keep token texts
    // that contain spaces or start with '$' from being misread as template syntax.
    let mut special = Vec::new();
    if let Some((id, text)) = &bos {
        special
            .push(SpecialToken::new("BOS".into(), vec![*id], vec![text.clone()]).map_err(tok_err)?);
    }
    if let Some((id, text)) = &eos {
        special
            .push(SpecialToken::new("EOS".into(), vec![*id], vec![text.clone()]).map_err(tok_err)?);
    }
    let around = |seq: &str| {
        let mut v = Vec::new();
        if bos.is_some() {
            v.push("BOS".to_string());
        }
        v.push(seq.to_string());
        if eos.is_some() {
            v.push("EOS".to_string());
        }
        v
    };
    let single = around("$A");
    let pair = [around("$A"), around("$B:1")].concat();
    let processor = TemplateProcessing::builder()
        .try_single(single)
        .map_err(|e| Error::Tokenizer(format!("BOS/EOS template: {e}")))?
        .try_pair(pair)
        .map_err(|e| Error::Tokenizer(format!("BOS/EOS template: {e}")))?
        .special_tokens(special)
        .build()
        .map_err(|e| Error::Tokenizer(format!("BOS/EOS template: {e}")))?;
    Ok(Some(processor))
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}
