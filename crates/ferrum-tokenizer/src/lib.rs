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

mod charsmap;
pub mod chat;
mod content;
pub mod gguf;
pub mod harmony;
pub mod hf;
mod pretok;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use ferrum_core::{Error, Result};

pub use chat::{ChatTemplate, Message, RenderLimits};
pub use content::SpecialTokens;

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
    "<|return|>",
    "<|call|>",
    // Gemma 4: the end of a turn, and a tool call's end, where the caller's result follows.
    "<turn|>",
    "<|tool_response>",
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
    /// Keeps special-token texts in message content from becoming control tokens.
    guard: Arc<content::ContentGuard>,
    /// A GGUF Unigram vocabulary's normalisation, applied before `inner` sees the text.
    charsmap: Option<Arc<charsmap::Charsmap>>,
}

impl Tokenizer {
    fn assemble(
        inner: tokenizers::Tokenizer,
        vocab_size: usize,
        bos_id: Option<u32>,
        eos_ids: Vec<u32>,
        special: HashSet<u32>,
        chat_template: Option<ChatTemplate>,
    ) -> Result<Tokenizer> {
        let guard = Arc::new(content::ContentGuard::new(&inner)?);
        Ok(Tokenizer {
            inner,
            vocab_size,
            bos_id,
            eos_ids,
            special,
            chat_template,
            guard,
            charsmap: None,
        })
    }

    /// The text as `inner` reads it: normalised first where the vocabulary brings its own map.
    fn prepared<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        match &self.charsmap {
            Some(m) => std::borrow::Cow::Owned(m.normalize(text)),
            None => std::borrow::Cow::Borrowed(text),
        }
    }

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
        let text = self.prepared(text);
        let enc = self
            .inner
            .encode_fast(text.as_ref(), add_special)
            .map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// A pair of texts as a cross-encoder reads them (the tokenizer's pair template, e.g.
    /// BERT's `[CLS] a [SEP] b [SEP]`): the ids and each id's segment (token type).
    pub fn encode_pair(&self, a: &str, b: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let (a, b) = (self.prepared(a), self.prepared(b));
        let enc = self
            .inner
            .encode_fast((a.as_ref(), b.as_ref()), true)
            .map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok((enc.get_ids().to_vec(), enc.get_type_ids().to_vec()))
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

    /// Replaces the model's chat template (or removes it).
    pub fn set_chat_template(&mut self, template: Option<ChatTemplate>) {
        self.chat_template = template;
    }

    /// The texts of the special (control) tokens, which content can no longer produce.
    pub fn special_texts(&self) -> Vec<String> {
        self.guard.special_texts()
    }

    /// The conversation as prompt token ids: rendered with the model's chat template (in its
    /// sandbox) or, without one, the contents joined by newlines with the model's BOS rule.
    ///
    /// With [`SpecialTokens::Text`] (what the server and `run` use) a special-token text
    /// written in any string of `messages` or `kwargs` — content, tool calls and results,
    /// tool schemas — is encoded as the plain text it is, so a message cannot close its own
    /// turn or open another; only the template's own markup becomes control tokens.
    /// [`SpecialTokens::Control`] matches them wherever they are (the old behaviour).
    pub fn chat_prompt<M: serde::Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        special: SpecialTokens,
    ) -> Result<Vec<u32>> {
        self.chat_prompt_inner(
            messages,
            add_generation_prompt,
            kwargs,
            special,
            false,
            None,
        )
    }

    /// [`Tokenizer::chat_prompt`] with [`SpecialTokens::Text`] for inputs whose request strings
    /// the caller has already escaped with [`Tokenizer::escape_str`] / [`Tokenizer::escape_json`]
    /// — a caller that wraps them in markup of its own (the server's tool-call tags for
    /// templates without tools), which must stay control tokens where the vocabulary has them.
    pub fn chat_prompt_escaped<M: serde::Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>> {
        self.chat_prompt_inner(
            messages,
            add_generation_prompt,
            kwargs,
            SpecialTokens::Text,
            true,
            None,
        )
    }

    /// [`Tokenizer::chat_prompt`] (`escaped`: [`Tokenizer::chat_prompt_escaped`]) of a
    /// conversation with images: the k-th `marker` the template writes (an image's place)
    /// is replaced by `expansions[k]` in the rendered text before it is tokenized, as a
    /// vision model's Hugging Face processor expands it (markers past the last expansion stay
    /// as written). Markers in the request's own strings were escaped with them
    /// ([`SpecialTokens::Text`]) and stay text.
    pub fn chat_prompt_with_images<M: serde::Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        special: SpecialTokens,
        escaped: bool,
        (marker, expansions): (&str, &[String]),
    ) -> Result<Vec<u32>> {
        self.chat_prompt_inner(
            messages,
            add_generation_prompt,
            kwargs,
            special,
            escaped,
            Some((marker, expansions)),
        )
    }

    /// A request string with its special-token texts broken, for
    /// [`Tokenizer::chat_prompt_escaped`].
    pub fn escape_str<'a>(&self, s: &'a str) -> std::borrow::Cow<'a, str> {
        self.guard.escape(s)
    }

    /// A decoder reranker's prompt: `template` (llama.cpp's `rerank` chat template) with
    /// `{query}` and `{document}` replaced by the pair's texts, encoded as one text whose
    /// markup is the template's alone (special-token texts inside the pair stay text).
    pub fn encode_rerank(&self, template: &str, query: &str, document: &str) -> Result<Vec<u32>> {
        let (query, document) = (self.guard.escape(query), self.guard.escape(document));
        let mut text = String::with_capacity(template.len() + query.len() + document.len());
        let mut rest = template;
        // One pass, so a query that spells `{document}` stays as written.
        while let Some(at) = rest.find('{') {
            text.push_str(&rest[..at]);
            let tail = &rest[at..];
            if let Some(r) = tail.strip_prefix("{query}") {
                text.push_str(&query);
                rest = r;
            } else if let Some(r) = tail.strip_prefix("{document}") {
                text.push_str(&document);
                rest = r;
            } else {
                text.push('{');
                rest = &tail[1..];
            }
        }
        text.push_str(rest);
        self.guard.encode_rendered(self, &text)
    }

    /// [`Tokenizer::escape_str`] on every string of a JSON value, object keys included.
    pub fn escape_json(&self, v: &mut serde_json::Value) {
        self.guard.escape_json(v)
    }

    fn chat_prompt_inner<M: serde::Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        special: SpecialTokens,
        escaped: bool,
        expand: Option<(&str, &[String])>,
    ) -> Result<Vec<u32>> {
        let as_text = special == SpecialTokens::Text;
        let to_json = |v| {
            serde_json::to_value(v)
                .map_err(|e| Error::Template(format!("the conversation is not JSON: {e}")))
        };
        let mut messages: serde_json::Value = to_json(messages)?;
        let harmony = self.chat_template.is_none() && harmony::is_harmony(self);
        let template = match &self.chat_template {
            Some(t) => Some(t),
            None if harmony => None,
            None => {
                let text = messages
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|m| m["content"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n");
                if !escaped {
                    return self.encode_with(&text, true, special);
                }
                // The caller's markup is in the text: split at it, and add BOS/EOS as `encode`
                // would (what it puts around any text).
                let bare = self.encode("x", false)?;
                let wrapped = self.encode("x", true)?;
                let at = wrapped
                    .windows(bare.len().max(1))
                    .position(|w| w == bare.as_slice())
                    .unwrap_or(0);
                let mut ids = wrapped[..at].to_vec();
                ids.extend(self.guard.encode_split(self, &text)?);
                ids.extend_from_slice(&wrapped[(at + bare.len()).min(wrapped.len())..]);
                return Ok(ids);
            }
        };
        let mut kwargs = serde_json::Value::Object(kwargs.clone());
        if as_text && !escaped {
            self.guard.escape_json(&mut messages);
            self.guard.escape_json(&mut kwargs);
        }
        let (Some(messages), serde_json::Value::Object(kwargs)) = (messages.as_array(), kwargs)
        else {
            return Err(Error::Template("messages must be a list".into()));
        };
        // Templates write the BOS token themselves where the model wants one.
        let text = match template {
            Some(t) => t.render_with(messages, add_generation_prompt, &kwargs)?,
            // A harmony model without a template: the format's own rendering (always for
            // the assistant's next turn).
            None => harmony::render(messages, &kwargs, &chat::today())?,
        };
        let text = match expand {
            Some((marker, expansions)) if !marker.is_empty() => {
                let mut out = String::with_capacity(text.len());
                let mut rest = text.as_str();
                let mut each = expansions.iter();
                while let Some(at) = rest.find(marker) {
                    out.push_str(&rest[..at]);
                    out.push_str(each.next().map_or(marker, String::as_str));
                    rest = &rest[at + marker.len()..];
                }
                out.push_str(rest);
                out
            }
            _ => text,
        };
        if as_text {
            self.guard.encode_rendered(self, &text)
        } else {
            self.encode(&text, false)
        }
    }

    /// [`Tokenizer::encode`], or with [`SpecialTokens::Text`] every special-token text in
    /// `text` encoded as plain text (BOS/EOS are still added by `add_special`).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        special: SpecialTokens,
    ) -> Result<Vec<u32>> {
        match special {
            SpecialTokens::Control => self.encode(text, add_special),
            SpecialTokens::Text => self.guard.encode_plain(self, text, add_special),
        }
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Ids of the known end-of-turn tokens present in `inner`, appended to `ids` without
/// duplicates.
///
/// Harmony (gpt-oss) ends a turn with `<|return|>` or `<|call|>`; its `<|end|>` closes one
/// message of a turn (the analysis before the answer), so it is no end there, as in llama.cpp.
fn add_end_of_turn_ids(inner: &tokenizers::Tokenizer, ids: &mut Vec<u32>) {
    for text in END_OF_TURN_TEXTS {
        if let Some(id) = inner.token_to_id(text) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    let has = |t: &str| inner.token_to_id(t).is_some();
    if has(harmony::RETURN) && has(harmony::CALL) {
        if let Some(end) = inner.token_to_id(harmony::END) {
            ids.retain(|&id| id != end);
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
