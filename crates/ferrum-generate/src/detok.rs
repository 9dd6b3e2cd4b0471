//! Incremental detokenisation: text deltas as tokens arrive. Decoding a single token in
//! isolation is wrong for byte-level BPE (a character can span tokens) and for SentencePiece
//! (leading-space handling), so each step decodes a short window — from a prefix offset that
//! trails the already-emitted text — and emits only what is new and complete. Work per token
//! is bounded by the window, not the length of the output.

use ferrum_core::Result;
use ferrum_tokenizer::Tokenizer;

#[derive(Default)]
pub struct Detokenizer {
    tokens: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.tokens.push(id);
        let before = tok.decode(&self.tokens[self.prefix..self.read], true)?;
        let after = tok.decode(&self.tokens[self.prefix..], true)?;
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest of it.
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let delta = match after.get(before.len()..) {
                Some(d) if after.starts_with(&before) => d.to_string(),
                _ => return Ok(String::new()),
            };
            self.prefix = self.read;
            self.read = self.tokens.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }
}
