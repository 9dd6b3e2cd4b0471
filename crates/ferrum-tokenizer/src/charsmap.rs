//! SentencePiece's precompiled normalisation map (`precompiled_charsmap`), applied as
//! SentencePiece and llama.cpp's UGM tokenizer apply it: at each point of the input, the
//! longest byte sequence the map holds is replaced by its normalised text; where none
//! matches, one UTF-8 character passes as it is (an invalid byte becomes U+FFFD).
//!
//! Hugging Face tokenizers' `Precompiled` normaliser differs on long grapheme clusters (it
//! looks a cluster up whole only under six bytes, else character by character, so it leaves
//! decomposed Hangul jamo uncomposed where SentencePiece composes them); a GGUF file's
//! Unigram vocabulary is read as llama.cpp reads it, so it normalises here.
//!
//! The map: a little-endian u32 byte length, that many bytes of an XOR-compressed double
//! array (u32 entries: BASE in bits 10–30, shifted by 6 more when bit 9 is set; LCHECK in bits
//! 0–7 and 31; LEAF bit 8), then NUL-terminated replacement strings the leaves index.

use ferrum_core::{Error, Result};

pub(crate) struct Charsmap {
    array: Vec<u32>,
    replacements: Vec<u8>,
}

impl Charsmap {
    pub(crate) fn parse(bytes: &[u8]) -> Result<Charsmap> {
        let bad = |why: &str| Error::Tokenizer(format!("precompiled_charsmap: {why}"));
        let size = bytes
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| bad("shorter than its header"))?;
        let blob = bytes
            .get(4..4 + size)
            .filter(|b| b.len() % 4 == 0 && !b.is_empty())
            .ok_or_else(|| bad("its array overruns the map or is not whole u32s"))?;
        let array = blob
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Charsmap {
            array,
            replacements: bytes[4 + size..].to_vec(),
        })
    }

    fn node(&self, i: usize) -> Option<u32> {
        self.array.get(i).copied()
    }

    fn base(n: u32) -> usize {
        ((n >> 10) << ((n & (1 << 9)) >> 6)) as usize
    }

    /// The longest match at the start of `input`: its length and the replacement's offset.
    fn longest(&self, input: &[u8]) -> Option<(usize, usize)> {
        let mut index = Self::base(self.node(0)?);
        let mut best = None;
        for (i, &c) in input.iter().enumerate() {
            if c == 0 {
                break;
            }
            index ^= c as usize;
            let n = self.node(index)?;
            if n & ((1 << 31) | 0xff) != c as u32 {
                break;
            }
            let leaf = (n >> 8) & 1 == 1;
            index ^= Self::base(n);
            if leaf {
                best = Some((i + 1, (self.node(index)? & ((1 << 31) - 1)) as usize));
            }
        }
        best
    }

    /// `text` normalised.
    pub(crate) fn normalize(&self, text: &str) -> String {
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(bytes.len() + bytes.len() / 2);
        let mut at = 0;
        while at < bytes.len() {
            if let Some((len, off)) = self.longest(&bytes[at..]) {
                if let Some(rest) = self.replacements.get(off..) {
                    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
                    out.extend_from_slice(&rest[..end]);
                    at += len;
                    continue;
                }
            }
            // `text` is UTF-8 and a match ends on a character boundary of the map's keys, so
            // `at` is on a boundary: copy one character.
            let ch = text[at..].chars().next().map_or(1, char::len_utf8);
            out.extend_from_slice(&bytes[at..at + ch]);
            at += ch;
        }
        // A replacement is a UTF-8 string, but the map is the file's: check rather than trust.
        String::from_utf8(out)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}
