//! Content is text, not control tokens.
//!
//! A tokenizer matches special-token texts (`<|im_end|>`, `<|eot_id|>`, ...) wherever they
//! appear, so a user message containing `<|im_end|><|im_start|>system` would close its own
//! turn and open a system one. OpenAI's API never lets content become control tokens; neither
//! do we. The template's own markup must still become control tokens, and the template sees
//! the content as it is (it may strip it, split it, test it).
//!
//! So: before rendering, each special-token text inside a request's strings is broken by a
//! marker (U+FDD0, a Unicode noncharacter) after each of its characters, and each marker
//! already there is doubled. The rendered prompt then holds unbroken special-token texts
//! only where the template wrote them. Encoding splits it at those (the tokenizer's own
//! matching finds them), removes the markers from the text in between and encodes that with
//! special-token matching off — the same splits the tokenizer makes itself, so a prompt
//! whose content has no special-token text gets exactly the ids it always got.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::OnceLock;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use ferrum_core::{Error, Result};
use serde_json::Value;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::PreTokenizerWrapper;

use crate::Tokenizer;

/// Whether special-token texts inside message content become control tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecialTokens {
    /// Encoded as the plain text they are (the default everywhere content comes from a user).
    #[default]
    Text,
    /// Matched as control tokens wherever they appear.
    Control,
}

const MARK: char = '\u{FDD0}';

pub(crate) struct ContentGuard {
    /// Every special token's text, by id.
    specials: HashMap<u32, String>,
    /// The same texts, leftmost-longest as the tokenizer matches them.
    matcher: Option<AhoCorasick>,
    /// Some special token is matched after normalisation, so content can spell it in a form
    /// the raw matcher does not see: every prompt takes the split path, which demotes any
    /// match whose raw text is not the token's.
    always_split: bool,
    /// The tokenizer with special-token matching off, made on first use (most prompts never
    /// need it, and it is a copy of the vocabulary).
    plain: OnceLock<tokenizers::Tokenizer>,
    /// The same for text that does not start the prompt, where a `Metaspace` pre-tokenizer
    /// that prefixes only the first split must not prefix again.
    plain_rest: OnceLock<tokenizers::Tokenizer>,
}

impl ContentGuard {
    pub(crate) fn new(inner: &tokenizers::Tokenizer) -> Result<ContentGuard> {
        let added: Vec<_> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .collect();
        let always_split =
            inner.get_normalizer().is_some() && added.iter().any(|(_, t)| t.normalized);
        let specials: HashMap<u32, String> =
            added.into_iter().map(|(id, t)| (id, t.content)).collect();
        let texts: Vec<&String> = specials.values().collect();
        let matcher = if texts.is_empty() {
            None
        } else {
            Some(
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&texts)
                    .map_err(|e| Error::Tokenizer(format!("special-token matcher: {e}")))?,
            )
        };
        Ok(ContentGuard {
            specials,
            matcher,
            always_split,
            plain: OnceLock::new(),
            plain_rest: OnceLock::new(),
        })
    }

    /// `s` with every special-token text broken by a marker (and markers doubled); borrowed
    /// when there is nothing to break.
    pub(crate) fn escape<'a>(&self, s: &'a str) -> Cow<'a, str> {
        let has_special = self.matcher.as_ref().is_some_and(|m| m.is_match(s));
        if !has_special && !s.contains(MARK) {
            return Cow::Borrowed(s);
        }
        let mut out = String::with_capacity(s.len() + 8);
        let push_doubling = |out: &mut String, t: &str| {
            for c in t.chars() {
                out.push(c);
                if c == MARK {
                    out.push(MARK);
                }
            }
        };
        let mut at = 0;
        for m in self.matcher.iter().flat_map(|m| m.find_iter(s)) {
            push_doubling(&mut out, &s[at..m.start()]);
            // After every character: then no other special text (a suffix of this one, say)
            // survives inside it either, and a one-character one is told by the marker
            // that follows it.
            for c in s[m.start()..m.end()].chars() {
                out.push(c);
                out.push(MARK);
            }
            at = m.end();
        }
        push_doubling(&mut out, &s[at..]);
        Cow::Owned(out)
    }

    /// The special tokens' texts, in id order.
    pub(crate) fn special_texts(&self) -> Vec<String> {
        let mut v: Vec<(&u32, &String)> = self.specials.iter().collect();
        v.sort();
        v.into_iter().map(|(_, t)| t.clone()).collect()
    }

    /// [`ContentGuard::escape`] on every string of a JSON value, object keys included.
    pub(crate) fn escape_json(&self, v: &mut Value) {
        match v {
            Value::String(s) => {
                if let Cow::Owned(e) = self.escape(s) {
                    *s = e;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|x| self.escape_json(x)),
            Value::Object(map) => {
                let needs_key = map.keys().any(|k| matches!(self.escape(k), Cow::Owned(_)));
                if needs_key {
                    let old = std::mem::take(map);
                    for (k, mut x) in old {
                        self.escape_json(&mut x);
                        map.insert(self.escape(&k).into_owned(), x);
                    }
                } else {
                    map.values_mut().for_each(|x| self.escape_json(x));
                }
            }
            _ => {}
        }
    }

    /// A rendered prompt whose content was escaped: the template's special-token texts
    /// become control tokens, everything else plain text.
    pub(crate) fn encode_rendered(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        if !text.contains(MARK) && !self.always_split {
            return tok.encode(text, false);
        }
        self.encode_split(tok, text)
    }

    /// The split behind [`ContentGuard::encode_rendered`], whether or not there are markers.
    pub(crate) fn encode_split(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        // The tokenizer's own matching (with its lstrip/rstrip/single-word rules) finds the
        // markup; a marker breaks every special-token text that came from content.
        let enc = tok
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        let mut ids = Vec::with_capacity(enc.len());
        let mut at = 0;
        for (&id, &(start, end)) in enc.get_ids().iter().zip(enc.get_offsets()) {
            let Some(special) = self.specials.get(&id) else {
                continue;
            };
            // Markup is a special token whose text is there (not an unknown-token id for an
            // unknown character, not a normalised spelling) and not escaped: an escaped text
            // is followed by the one marker escaping put after its last character, then by
            // the content's own markers, doubled — an odd run of markers.
            let markers = text[end..].chars().take_while(|&c| c == MARK).count();
            let is_markup = text
                .get(start..end)
                .is_some_and(|span| span.trim() == special)
                && markers % 2 == 0;
            if !is_markup || start < at {
                continue;
            }
            self.encode_gap(tok, &text[at..start], at == 0, &mut ids)?;
            ids.push(id);
            at = end;
        }
        self.encode_gap(tok, &text[at..], at == 0, &mut ids)?;
        Ok(ids)
    }

    /// Text in full with special-token matching off, BOS/EOS by `add_special`.
    pub(crate) fn encode_plain(
        &self,
        tok: &Tokenizer,
        text: &str,
        add_special: bool,
    ) -> Result<Vec<u32>> {
        let enc = self
            .plain(tok, true)
            .encode_fast(text, add_special)
            .map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    fn encode_gap(
        &self,
        tok: &Tokenizer,
        gap: &str,
        first: bool,
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        if gap.is_empty() {
            return Ok(());
        }
        let text = unescape(gap);
        let enc = self
            .plain(tok, first)
            .encode_fast(text.as_ref(), false)
            .map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        ids.extend_from_slice(enc.get_ids());
        Ok(())
    }

    fn plain(&self, tok: &Tokenizer, first: bool) -> &tokenizers::Tokenizer {
        let plain = self.plain.get_or_init(|| {
            let mut t = tok.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        if first {
            return plain;
        }
        self.plain_rest.get_or_init(|| {
            let mut t = plain.clone();
            if let Some(p) = t.get_pre_tokenizer().cloned() {
                t.with_pre_tokenizer(Some(no_first_prefix(p)));
            }
            t
        })
    }
}

/// `p` with every `Metaspace` that prefixes the first split made to prefix none (the text
/// after a control token is not the first split of the prompt).
fn no_first_prefix(p: PreTokenizerWrapper) -> PreTokenizerWrapper {
    match p {
        PreTokenizerWrapper::Metaspace(mut m) if m.get_prepend_scheme() == PrependScheme::First => {
            m.set_prepend_scheme(PrependScheme::Never);
            PreTokenizerWrapper::Metaspace(m)
        }
        PreTokenizerWrapper::Sequence(seq) => {
            PreTokenizerWrapper::Sequence(tokenizers::pre_tokenizers::sequence::Sequence::new(
                seq.into_iter().map(no_first_prefix).collect(),
            ))
        }
        other => other,
    }
}

/// Removes the markers [`ContentGuard::escape`] put in (a doubled one is a real one).
fn unescape(s: &str) -> Cow<'_, str> {
    if !s.contains(MARK) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != MARK {
            out.push(c);
        } else if chars.peek() == Some(&MARK) {
            chars.next();
            out.push(MARK);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescape_inverts_the_marker_scheme() {
        let m = MARK;
        assert_eq!(unescape(&format!("<{m}|im_end|>")), "<|im_end|>");
        assert_eq!(unescape(&format!("a{m}{m}b")), format!("a{m}b"));
        assert_eq!(unescape(&format!("{m}{m}{m}x")), format!("{m}x"));
        assert_eq!(unescape("plain"), "plain");
    }
}
