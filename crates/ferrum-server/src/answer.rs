//! An answer as every chat-shaped API reports it — reasoning, text and tool calls — whole
//! ([`Answer`]) or as it streams ([`AnswerStream`]). Chat Completions, Responses and Messages
//! each turn these into their own shapes; the splitting is done once, here.

use ferrum_generate::{Output, OutputKind};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::reasoning::ReasoningSplitter;
use crate::routes::Choice;
use crate::tools::{CallStreamer, ToolCall, ToolEvent, Tools};

/// A finished answer, split.
pub struct Answer {
    pub reasoning: Option<String>,
    pub text: String,
    pub calls: Vec<ToolCall>,
}

impl Answer {
    /// `thinking`: the model reasons in `<think>` blocks; `tools`: calls may be made.
    pub fn of(thinking: bool, tools: Option<&Tools>, text: &str) -> Answer {
        let (reasoning, text) = if thinking {
            ReasoningSplitter::split(text)
        } else {
            (None, text.to_string())
        };
        let (content, calls) = match tools {
            Some(t) => t.parse_output(&text),
            None => (None, Vec::new()),
        };
        if calls.is_empty() {
            return Answer {
                reasoning,
                text,
                calls,
            };
        }
        Answer {
            reasoning,
            text: content.unwrap_or_default(),
            calls,
        }
    }
}

/// A piece of a streaming answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Text(String),
    /// A call of this function begins; its arguments follow as `CallArgs`, then `CallEnd`.
    CallStart(String),
    CallArgs(String),
    CallEnd,
    /// A call the stream could not follow, whole, from the answer's final parse (sent last).
    Call(ToolCall),
}

/// Splits an answer into [`Piece`]s as it arrives: reasoning from text, and tool calls from
/// text as they are generated ([`CallStreamer`]); at the end, the final parse adds any call the
/// stream missed (and then drops the text held back, which was that call's).
pub struct AnswerStream {
    thinking: bool,
    tools: Option<Tools>,
    splitter: ReasoningSplitter,
    streamer: Option<CallStreamer>,
    text: String,
    calls: usize,
}

impl AnswerStream {
    pub fn new(thinking: bool, tools: Option<&Tools>) -> AnswerStream {
        AnswerStream {
            thinking,
            tools: tools.cloned(),
            splitter: ReasoningSplitter::default(),
            streamer: tools.map(CallStreamer::new),
            text: String::new(),
            calls: 0,
        }
    }

    /// Feeds one request's events through the splitter into `emit` until the answer ends;
    /// the finished choice, or `None` once the engine or the client (`emit` returning false)
    /// is gone.
    pub(crate) async fn drive(
        &mut self,
        rx: &mut UnboundedReceiver<(usize, Output)>,
        mut emit: impl FnMut(Piece) -> bool,
    ) -> Option<Choice> {
        let mut choice = Choice::default();
        loop {
            let (_, o) = rx.recv().await?;
            let last = choice.absorb(&o.kind);
            let delta = match &o.kind {
                OutputKind::Token { text, .. } | OutputKind::Finished { text, .. } => text,
            };
            for piece in self.push(delta, last) {
                if !emit(piece) {
                    return None;
                }
            }
            if last {
                return Some(choice);
            }
        }
    }

    /// Calls begun so far (streamed or whole).
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The next delta of the answer; `last` for the final one.
    pub fn push(&mut self, delta: &str, last: bool) -> Vec<Piece> {
        self.text.push_str(delta);
        let (mut r, mut c) = if self.thinking {
            self.splitter.push(delta)
        } else {
            (String::new(), delta.to_string())
        };
        if last && self.thinking {
            let (r2, c2) = self.splitter.finish();
            r.push_str(&r2);
            c.push_str(&c2);
        }
        let mut out = Vec::new();
        if !r.is_empty() {
            out.push(Piece::Reasoning(r));
        }
        let Some(cs) = self.streamer.as_mut() else {
            if !c.is_empty() {
                out.push(Piece::Text(c));
            }
            return out;
        };
        let mut events = cs.push(&c);
        let mut missed = Vec::new();
        if last {
            let streamed = self.calls
                + events
                    .iter()
                    .filter(|e| matches!(e, ToolEvent::Start(_)))
                    .count();
            missed = Answer::of(self.thinking, self.tools.as_ref(), &self.text).calls;
            missed.drain(..streamed.min(missed.len()));
            if missed.is_empty() {
                events.extend(cs.finish());
            }
        }
        for e in events {
            out.push(match e {
                ToolEvent::Text(x) => Piece::Text(x),
                ToolEvent::Start(name) => {
                    self.calls += 1;
                    Piece::CallStart(name)
                }
                ToolEvent::Args(a) => Piece::CallArgs(a),
                ToolEvent::End => Piece::CallEnd,
            });
        }
        self.calls += missed.len();
        out.extend(missed.into_iter().map(Piece::Call));
        out
    }
}
