//! `<think>…</think>` blocks of reasoning models (Qwen3, DeepSeek-R1 style, DeepSeek V3.1/V3.2,
//! Kimi K2 Thinking), Mistral's `[THINK]…[/THINK]`, or Gemma 4's thought channel
//! `<|channel>thought\n…<channel|>`: returned as `reasoning_content`, apart from the answer.
//! Only used when the model's chat template mentions `<think>`, or its vocabulary (or
//! template) has Mistral's, Gemma 4's, DeepSeek's or Kimi K2's markers. A prompt that ends by
//! opening the block (DeepSeek V3.1's and R1's generation prompts when thinking) leaves the
//! answer inside it: [`ReasoningSplitter::opened`].

/// How a model marks its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tags {
    pub open: &'static str,
    pub close: &'static str,
    /// A channel name the block opens with, which is no reasoning (Gemma 4's `thought`); the
    /// whitespace after it is not either.
    pub label: Option<&'static str>,
    /// Blocks anywhere in the answer, and a close tag without its open tag dropped: Gemma 4
    /// may end an answer with an empty thought channel, or a lone `<channel|>` (as llama.cpp
    /// reads it). Otherwise only a block that opens the answer is reasoning.
    pub anywhere: bool,
    /// A turn header the model may write first, which is no content: Gemma 4's template
    /// leaves the turn to the model after tool results that follow an assistant's text (as
    /// llama.cpp's and transformers' readers of its answers allow).
    pub lead: Option<&'static str>,
    /// Markers that end a block without its close tag and stay in the answer: a call the
    /// model begins before closing its reasoning (DeepSeek V3.2's and Kimi K2 Thinking's
    /// readers in llama.cpp allow it).
    pub ends: &'static [&'static str],
}

pub const THINK: Tags = Tags {
    open: "<think>",
    close: "</think>",
    label: None,
    anywhere: false,
    lead: None,
    ends: &[],
};
pub const MISTRAL: Tags = Tags {
    open: "[THINK]",
    close: "[/THINK]",
    label: None,
    anywhere: false,
    lead: None,
    ends: &[],
};
pub const GEMMA4: Tags = Tags {
    open: "<|channel>",
    close: "<channel|>",
    label: Some("thought"),
    anywhere: true,
    lead: Some("<|turn>model\n"),
    ends: &[],
};
/// DeepSeek V3.1/V3.2 (and R1): `<think>` blocks, which a call's markers may also end.
pub const DEEPSEEK: Tags = Tags {
    ends: &[
        crate::dsml::BLOCK,
        crate::dsml::DEEPSEEK.section,
        crate::dsml::DEEPSEEK.call,
    ],
    ..THINK
};
/// Kimi K2 Thinking: `<think>` blocks, which a call's markers may also end.
pub const KIMI: Tags = Tags {
    ends: &[crate::dsml::KIMI.section, crate::dsml::KIMI.call],
    ..THINK
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not yet known whether the answer opens with the tags' lead.
    Lead,
    /// Not yet known whether the answer opens with a think block.
    Start,
    /// Just inside a block whose tags have a label: not yet known whether it is there.
    Label,
    Thinking,
    Answer,
}

/// Splits a stream of text deltas into (reasoning, content) deltas, never splitting a tag.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    held: String,
    tags: Tags,
    /// Whitespace is dropped until something else comes: after a block (the answer
    /// conventionally starts after blank lines), and after a label.
    skip_ws: bool,
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
            state: if tags.lead.is_some() {
                State::Lead
            } else {
                Self::first(tags)
            },
            held: String::new(),
            tags,
            skip_ws: false,
        }
    }

    /// For an answer whose prompt ended by opening the block: it starts as reasoning.
    pub fn opened(tags: Tags) -> Self {
        ReasoningSplitter {
            state: State::Thinking,
            held: String::new(),
            tags,
            skip_ws: false,
        }
    }

    /// Where an answer starts (after any lead).
    fn first(tags: Tags) -> State {
        if tags.anywhere {
            State::Answer
        } else {
            State::Start
        }
    }

    /// Drops leading whitespace while `skip_ws` is set; false when nothing else is held yet.
    fn skip_whitespace(&mut self) -> bool {
        if self.skip_ws {
            let ws = self.held.len() - self.held.trim_start().len();
            self.held.drain(..ws);
            if self.held.is_empty() {
                return false;
            }
            self.skip_ws = false;
        }
        true
    }

    /// Inside a block, after its open tag.
    fn enter_block(&mut self) {
        self.state = if self.tags.label.is_some() {
            State::Label
        } else {
            State::Thinking
        };
    }

    /// Feeds a delta; returns the reasoning and content text now safe to emit.
    pub fn push(&mut self, delta: &str) -> (String, String) {
        let Tags { open, close, .. } = self.tags;
        self.held.push_str(delta);
        let (mut reasoning, mut content) = (String::new(), String::new());
        loop {
            match self.state {
                State::Lead => {
                    let lead = self.tags.lead.unwrap_or("");
                    if self.held.starts_with(lead) {
                        self.held.drain(..lead.len());
                    } else if lead.starts_with(self.held.as_str()) {
                        break; // maybe the lead, still arriving
                    }
                    self.state = Self::first(self.tags);
                }
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if trimmed.starts_with(open) {
                        let at = self.held.len() - trimmed.len() + open.len();
                        self.held.drain(..at);
                        self.enter_block();
                    } else if open.starts_with(trimmed) {
                        break; // maybe the tag, still arriving
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Label => {
                    let label = self.tags.label.unwrap_or("");
                    if self.held.starts_with(label) {
                        self.held.drain(..label.len());
                    } else if label.starts_with(self.held.as_str()) {
                        break; // maybe the label, still arriving
                    }
                    self.skip_ws = true;
                    self.state = State::Thinking;
                }
                State::Thinking => {
                    if !self.skip_whitespace() {
                        break;
                    }
                    let first = std::iter::once(close)
                        .chain(self.tags.ends.iter().copied())
                        .filter_map(|t| self.held.find(t).map(|i| (i, t)))
                        .min();
                    if let Some((end, tag)) = first {
                        reasoning.push_str(&self.held[..end]);
                        // A call's marker ends the block but is the answer's.
                        let used = if tag == close { end + close.len() } else { end };
                        self.held.drain(..used);
                        self.skip_ws = true;
                        self.state = State::Answer;
                    } else {
                        let keep = std::iter::once(close)
                            .chain(self.tags.ends.iter().copied())
                            .map(|t| partial_tag(&self.held, t))
                            .max()
                            .unwrap_or(0);
                        let cut = self.held.len() - keep;
                        reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        break;
                    }
                }
                State::Answer if !self.tags.anywhere => {
                    if self.skip_whitespace() {
                        content.push_str(&self.held);
                        self.held.clear();
                    }
                    break;
                }
                State::Answer => {
                    if !self.skip_whitespace() {
                        break;
                    }
                    let first = [open, close]
                        .into_iter()
                        .filter_map(|t| self.held.find(t).map(|i| (i, t)))
                        .min();
                    match first {
                        Some((i, tag)) => {
                            content.push_str(&self.held[..i]);
                            self.held.drain(..i + tag.len());
                            if tag == open {
                                self.enter_block();
                            }
                            // A close tag with no block open is dropped.
                        }
                        None => {
                            let keep =
                                partial_tag(&self.held, open).max(partial_tag(&self.held, close));
                            let cut = self.held.len() - keep;
                            content.push_str(&self.held[..cut]);
                            self.held.drain(..cut);
                            break;
                        }
                    }
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
            // A block that ended at its open tag (or inside its label) said nothing.
            State::Label => (String::new(), String::new()),
            _ => (String::new(), held),
        }
    }

    /// [`ReasoningSplitter::opened`] when `opened`, else [`ReasoningSplitter::new`].
    pub fn start(tags: Tags, opened: bool) -> Self {
        if opened {
            Self::opened(tags)
        } else {
            Self::new(tags)
        }
    }

    /// Splits a whole answer at once.
    pub fn split(text: &str, tags: Tags) -> (Option<String>, String) {
        ReasoningSplitter::new(tags).split_all(text)
    }

    /// Splits a whole answer at once, from this splitter's start.
    pub fn split_all(mut self, text: &str) -> (Option<String>, String) {
        let s = &mut self;
        let (mut r, mut c) = s.push(text);
        let (r2, c2) = s.finish();
        r.push_str(&r2);
        c.push_str(&c2);
        ((!r.is_empty()).then_some(r), c)
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

    /// Gemma 4: the thought channel's label and the whitespace after it are not reasoning;
    /// an empty channel (thinking off) says nothing, one at the end of the answer and a lone
    /// `<channel|>` are not content, nor is a `<|turn>model` header the model opens its answer
    /// with; split whole or at any cut, the same.
    #[test]
    fn gemma4_thought_channels() {
        let cases = [
            (
                "<|channel>thought\nThe user asks for Paris.\n<channel|>Paris.",
                Some("The user asks for Paris.\n"),
                "Paris.",
            ),
            ("<|channel>thought\n<channel|>Paris.", None, "Paris."),
            ("Paris.<|channel>thought\n<channel|>", None, "Paris."),
            ("Paris.<channel|>", None, "Paris."),
            ("<|channel>thought\nHm", Some("Hm"), ""),
            ("<|channel>thou", None, ""),
            ("a <b> <|chan", None, "a <b> <|chan"),
            (
                "<|turn>model\n<|channel>thought\nHm.<channel|>Paris.",
                Some("Hm."),
                "Paris.",
            ),
            ("<|turn>model\nParis.", None, "Paris."),
            ("<|turn>user", None, "<|turn>user"),
        ];
        for (text, reasoning, content) in cases {
            assert_eq!(
                ReasoningSplitter::split(text, GEMMA4),
                (reasoning.map(str::to_string), content.to_string()),
                "{text:?}"
            );
            for cut in 1..text.len() {
                let mut s = ReasoningSplitter::new(GEMMA4);
                let (mut r, mut c) = s.push(&text[..cut]);
                let (r2, c2) = s.push(&text[cut..]);
                let (r3, c3) = s.finish();
                r += &(r2 + &r3);
                c += &(c2 + &c3);
                assert_eq!(
                    (r.as_str(), c.as_str()),
                    (reasoning.unwrap_or(""), content),
                    "{text:?} cut at {cut}"
                );
            }
        }
    }
}
