//! Speculative decoding's drafters: what a sequence proposes to check in its next step.
//!
//! The engine verifies a draft by running the sequence's last token and the drafted ones in
//! one pass (logits for each, bit-identical to what decoding them one by one would give: see
//! the batch-invariance decision in ARCHITECTURE.md), then sampling position after position
//! exactly as plain decoding would — same logits, same sampler, same random draws in the same
//! order — and keeping drafted tokens only while each equals the token sampled before it. The
//! answer is therefore the one plain decoding gives, token for token, at any temperature and
//! seed: a drafter can only change how fast it comes. (For a drafter that proposes one token
//! per position this "sample and compare" rule is the standard rejection rule: it accepts `d`
//! with probability p(d) and otherwise yields a sample of p without `d`, renormalised.)

/// Proposes up to `max` tokens to follow `tokens` (the prompt and the output so far).
pub trait Drafter: Send {
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32>;
}

/// Prompt lookup: the tokens that followed the most recent earlier occurrence of the last
/// n tokens (n from [`NgramDrafter::MAX_N`] down to [`NgramDrafter::MIN_N`]), in the prompt or
/// the output. No second model; it pays where an answer copies (code edits, quotes, JSON that
/// repeats keys) and proposes nothing where it does not.
#[derive(Debug, Clone, Default)]
pub struct NgramDrafter;

impl NgramDrafter {
    pub const MAX_N: usize = 4;
    pub const MIN_N: usize = 2;
    /// How far back a match is looked for (positions), to bound the cost per step.
    pub const WINDOW: usize = 8192;
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32> {
        if max == 0 {
            return Vec::new();
        }
        let lo = tokens.len().saturating_sub(Self::WINDOW);
        for n in (Self::MIN_N..=Self::MAX_N).rev() {
            if tokens.len() <= n {
                continue;
            }
            let pat = &tokens[tokens.len() - n..];
            // The most recent earlier occurrence that has something after it.
            for start in (lo..tokens.len() - n).rev() {
                if &tokens[start..start + n] == pat {
                    let from = start + n;
                    let end = (from + max).min(tokens.len());
                    return tokens[from..end].to_vec();
                }
            }
        }
        Vec::new()
    }
}

/// A sequence's draft length, adapted to how much of its drafts is accepted: halved after a
/// draft of which nothing was kept, doubled (up to the configured length) after one kept whole.
#[derive(Debug, Clone, Copy)]
pub struct DraftLen {
    pub current: usize,
    pub max: usize,
}

impl DraftLen {
    pub fn new(max: usize) -> DraftLen {
        DraftLen { current: max, max }
    }

    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.current = (self.current / 2).max(1);
        } else if accepted == drafted {
            self.current = (self.current * 2).min(self.max).max(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_proposes_what_followed_the_latest_match() {
        let mut d = NgramDrafter;
        // "a b c d e ... a b" → "c d e".
        let t = [1, 2, 3, 4, 5, 9, 9, 1, 2];
        assert_eq!(d.propose(&t, 3), vec![3, 4, 5]);
        assert_eq!(d.propose(&t, 1), vec![3]);
        // The longest n-gram wins: "7 1 2" matches later than "1 2" alone would.
        let t = [1, 2, 8, 7, 1, 2, 6, 0, 7, 1, 2];
        assert_eq!(d.propose(&t, 2), vec![6, 0]);
        // Nothing to copy.
        assert!(d.propose(&[1, 2, 3, 4], 4).is_empty());
        assert!(d.propose(&[5, 5], 4).is_empty());
        assert!(d.propose(&t, 0).is_empty());
    }

    #[test]
    fn draft_length_adapts() {
        let mut l = DraftLen::new(8);
        l.update(8, 0);
        assert_eq!(l.current, 4);
        l.update(4, 2);
        assert_eq!(l.current, 4);
        l.update(4, 4);
        assert_eq!(l.current, 8);
        for _ in 0..10 {
            l.update(1, 0);
        }
        assert_eq!(l.current, 1);
    }
}
