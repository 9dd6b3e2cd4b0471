//! `<think>…</think>` blocks of reasoning models (Qwen3, DeepSeek-R1 style), or Mistral's
//! `[THINK]…[/THINK]`: returned as `reasoning_content`, apart from the answer. Only used when
//! the model's chat template mentions `<think>`, or its vocabulary has Mistral's markers.

/// The tags of a reasoning block: `(open, close)`.
pub type Tags = (&'static str, &'static str);
pub const THINK: Tags = ("<think>", "</think>");
pub const MISTRAL: Tags = ("[THINK]", "[/THINK]");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not yet known whether the answer opens with a think block.
    Start,
    Thinking,
    Answer,
}

/// Splits a stream of text deltas into (reasoning, content) deltas, never splitting a tag.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    held: String,
    tags: Tags,
}

impl Default for ReasoningSplitter {
    fn default() -> Self {
        ReasoningSplitter::new(THINK)
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| {
            s.len() >= k && s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..])
        })
        .unwrap_or(0)
}

impl ReasoningSplitter {
    pub fn new(tags: Tags) -> Self {
        ReasoningSplitter {
            state: State::Start,
            held: String::new(),
            tags,
        }
    }

    /// Feeds a delta; returns the reasoning and content text now safe to emit.
    pub fn push(&mut self, delta: &str) -> (String, String) {
        let (open, close) = self.tags;
        self.held.push_str(delta);
        let (mut reasoning, mut content) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if trimmed.starts_with(open) {
                        let at = self.held.len() - trimmed.len() + open.len();
                        self.held.drain(..at);
                        self.state = State::Thinking;
                    } else if open.starts_with(trimmed) {
                        break; // maybe the tag, still arriving
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if let Some(end) = self.held.find(close) {
                        reasoning.push_str(&self.held[..end]);
                        self.held.drain(..end + close.len());
                        // The answer conventionally starts after blank lines.
                        let rest = self.held.trim_start().to_string();
                        self.held = rest;
                        self.state = State::Answer;
                    } else {
                        let keep = partial_tag(&self.held, close);
                        let cut = self.held.len() - keep;
                        reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        break;
                    }
                }
                State::Answer => {
                    content.push_str(&self.held);
                    self.held.clear();
                    break;
                }
            }
        }
        (reasoning, content)
    }

    /// The end of the answer: whatever is held.
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => (held, String::new()),
            _ => (String::new(), held),
        }
    }

    /// Splits a whole answer at once.
    pub fn split(text: &str, tags: Tags) -> (Option<String>, String) {
        let mut s = ReasoningSplitter::new(tags);
        let (mut r, mut c) = s.push(text);
        let (r2, c2) = s.finish();
        r.push_str(&r2);
        c.push_str(&c2);
        let thought = s.state != State::Start || !r.is_empty();
        ((thought && !r.is_empty()).then_some(r), c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_answers_split_at_the_block() {
        assert_eq!(
            ReasoningSplitter::split("<think>\nLet me see.\n</think>\n\nParis.", THINK),
            (Some("\nLet me see.\n".into()), "Paris.".into())
        );
        assert_eq!(
            ReasoningSplitter::split("Paris.", THINK),
            (None, "Paris.".into())
        );
        assert_eq!(
            ReasoningSplitter::split("<thin", THINK),
            (None, "<thin".into())
        );
        assert_eq!(
            ReasoningSplitter::split("[THINK]Hm.[/THINK]Paris.", MISTRAL),
            (Some("Hm.".into()), "Paris.".into())
        );
    }

    #[test]
    fn deltas_never_split_a_tag() {
        let text = "<think>a<b </think>answer";
        for cut in 1..text.len() {
            let mut s = ReasoningSplitter::default();
            let (mut r, mut c) = s.push(&text[..cut]);
            let (r2, c2) = s.push(&text[cut..]);
            let (r3, c3) = s.finish();
            r += &(r2 + &r3);
            c += &(c2 + &c3);
            assert_eq!((r.as_str(), c.as_str()), ("a<b ", "answer"), "cut at {cut}");
        }
    }
}
