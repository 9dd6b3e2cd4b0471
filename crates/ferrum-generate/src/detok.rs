//! Incremental detokenisation: text deltas as tokens arrive. Decoding a single token in
//! isolation is wrong for byte-level BPE (a character can span tokens) and for SentencePiece
//! (leading-space handling), so each step decodes a short window — from a prefix offset that
//! trails the already-emitted text — and emits only what is new and complete. Work per token
//! is bounded by the window, not the length of the output.
//!
//! A delta never ends inside a UTF-8 character, and never inside a grapheme cluster that a
//! later token could extend: a trailing non-ASCII grapheme (an emoji that a zero-width joiner
//! or skin-tone modifier may continue, a base letter awaiting a combining mark, a regional
//! indicator awaiting its pair) is held until the next delta or [`Detokenizer::flush`].
//! Plain ASCII is not held, so English streams without delay; an ASCII letter followed by a
//! combining mark in a later token is the one split left.

use ferrum_core::Result;
use ferrum_tokenizer::Tokenizer;
use unicode_segmentation::UnicodeSegmentation;

pub struct Detokenizer {
    /// Control tokens' text is left out (the usual), or kept (a format whose structure is
    /// written in control tokens, as harmony's channels are).
    skip_special: bool,
    tokens: Vec<u32>,
    prefix: usize,
    read: usize,
    /// Complete text held back at a grapheme that may continue.
    held: String,
}

impl Default for Detokenizer {
    fn default() -> Self {
        Detokenizer::new(true)
    }
}

impl Detokenizer {
    pub fn new(skip_special: bool) -> Self {
        Detokenizer {
            skip_special,
            tokens: Vec::new(),
            prefix: 0,
            read: 0,
            held: String::new(),
        }
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.tokens.push(id);
        let before = tok.decode(&self.tokens[self.prefix..self.read], self.skip_special)?;
        let after = tok.decode(&self.tokens[self.prefix..], self.skip_special)?;
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest of it.
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let delta = match after.get(before.len()..) {
                Some(d) if after.starts_with(&before) => d,
                _ => return Ok(String::new()),
            };
            self.held.push_str(delta);
            self.prefix = self.read;
            self.read = self.tokens.len();
            // The window restarts here: keep it short even when text is held a long time.
            Ok(self.release())
        } else {
            Ok(String::new())
        }
    }

    /// Everything not yet returned, complete or not (the sequence has ended).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.tokens[self.prefix..self.read], self.skip_special)?;
        let after = tok.decode(&self.tokens[self.prefix..], self.skip_special)?;
        let mut out = std::mem::take(&mut self.held);
        if let Some(tail) = after.get(before.len()..) {
            if after.starts_with(&before) {
                out.push_str(tail);
            }
        }
        self.prefix = self.tokens.len();
        self.read = self.tokens.len();
        Ok(out)
    }

    /// Returns the held text up to its last grapheme if that one may still grow.
    fn release(&mut self) -> String {
        let Some((at, last)) = self.held.grapheme_indices(true).next_back() else {
            return String::new();
        };
        if last.is_ascii() {
            return std::mem::take(&mut self.held);
        }
        let keep = self.held.split_off(at);
        std::mem::replace(&mut self.held, keep)
    }
}
