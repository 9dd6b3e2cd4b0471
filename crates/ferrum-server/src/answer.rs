//! An answer as every chat-shaped API reports it — reasoning, text and tool calls — whole
//! ([`Answer`]) or as it streams ([`AnswerStream`]). Chat Completions, Responses and Messages
//! each turn these into their own shapes; the splitting is done once, here.

use ferrum_generate::{Output, OutputKind};
use tokio::sync::mpsc::UnboundedReceiver;

use ferrum_tokenizer::{harmony, Tokenizer};

use crate::reasoning::{self, ReasoningSplitter};
use crate::routes::Choice;
use crate::tools::{CallStreamer, ToolCall, ToolEvent, Tools};

/// How a model writes its reasoning and calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnswerFormat {
    /// Text, with Hermes-tagged or Llama 3 JSON calls.
    #[default]
    Plain,
    /// Reasoning in a leading `<think>…</think>` block (its template mentions `<think>`).
    Think,
    /// gpt-oss's harmony channels (its vocabulary has the markers): analysis, final,
    /// commentary to a function.
    Harmony,
    /// Mistral's control tokens (its vocabulary has `[TOOL_CALLS]`), kept in the text:
    /// reasoning in a leading `[THINK]…[/THINK]`, calls after `[TOOL_CALLS]`.
    Mistral,
    /// Gemma 4's markers (its vocabulary has `<|channel>`/`<channel|>` or `<|tool_call>`, or
    /// its template writes them), kept in the text: reasoning in the thought channel
    /// `<|channel>thought\n…<channel|>`, calls as `<|tool_call>call:NAME{…}<tool_call|>` in
    /// Gemma's own argument notation ([`crate::gemma`]). A call's turn ends at
    /// `<|tool_response>`, one of the tokenizer's end-of-turn tokens.
    Gemma4,
    /// DeepSeek V3.1/V3.2's markers (its vocabulary has `<｜tool▁call▁begin｜>`, or its template
    /// writes it or V3.2's `｜DSML｜`), kept in the text: reasoning in `<think>…</think>` (the
    /// generation prompt opens it when thinking), calls as V3.1's
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…` or
    /// V3.2's DSML block ([`crate::dsml`]).
    DeepSeek,
    /// Kimi K2's markers (its vocabulary or template has `<|tool_calls_section_begin|>`), kept
    /// in the text: reasoning in `<think>…</think>` (K2 Thinking), calls as
    /// `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}<|tool_call_end|>`
    /// in a section.
    Kimi,
}

/// How one request's answer is read: the model's format, and whether the prompt ended inside
/// the format's reasoning block (its generation prompt opened it), so that the answer starts
/// as reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reading {
    pub format: AnswerFormat,
    pub opened: bool,
}

impl From<AnswerFormat> for Reading {
    fn from(format: AnswerFormat) -> Reading {
        Reading {
            format,
            opened: false,
        }
    }
}

impl AnswerFormat {
    /// How the model behind `tok` writes its answers: harmony and Mistral's, Gemma 4's,
    /// DeepSeek's and Kimi K2's markers by their tokens (a template may not mention them) or
    /// their template, `<think>` by the template.
    pub fn detect(tok: &Tokenizer) -> AnswerFormat {
        let has = |t: &str| tok.inner().token_to_id(t).is_some();
        let template = tok.chat_template().map(|t| t.source()).unwrap_or("");
        let mistral = tok
            .inner()
            .token_to_id("[TOOL_CALLS]")
            .is_some_and(|id| tok.is_special(id));
        // Not whether they are control tokens: Gemma 4's GGUF vocabularies make them
        // user-defined ones. Their texts are Gemma 4's own.
        let gemma4 = (has(reasoning::GEMMA4.open) && has(reasoning::GEMMA4.close))
            || has(crate::gemma::CALL_OPEN)
            || template.contains(reasoning::GEMMA4.open)
            || template.contains(crate::gemma::CALL_OPEN);
        let deepseek = has(crate::dsml::DEEPSEEK.call)
            || template.contains(crate::dsml::DEEPSEEK.call)
            || template.contains("｜DSML｜");
        let kimi = has(crate::dsml::KIMI.section) || template.contains(crate::dsml::KIMI.section);
        if harmony::is_harmony(tok) {
            AnswerFormat::Harmony
        } else if mistral {
            AnswerFormat::Mistral
        } else if gemma4 {
            AnswerFormat::Gemma4
        } else if deepseek {
            AnswerFormat::DeepSeek
        } else if kimi {
            AnswerFormat::Kimi
        } else if template.contains("<think>") {
            AnswerFormat::Think
        } else {
            AnswerFormat::Plain
        }
    }

    /// The tags of its reasoning block, if it has one.
    fn reasoning(self) -> Option<reasoning::Tags> {
        match self {
            AnswerFormat::Think => Some(reasoning::THINK),
            AnswerFormat::Mistral => Some(reasoning::MISTRAL),
            AnswerFormat::Gemma4 => Some(reasoning::GEMMA4),
            AnswerFormat::DeepSeek => Some(reasoning::DEEPSEEK),
            AnswerFormat::Kimi => Some(reasoning::KIMI),
            AnswerFormat::Plain | AnswerFormat::Harmony => None,
        }
    }

    /// Whether the answer is read with its control tokens' text kept (`Request::skip_special`
    /// off): the markers it is split by are control tokens (harmony's, Mistral's, DeepSeek's,
    /// Kimi K2's; Gemma 4's in a Hugging Face tokenizer).
    pub fn keeps_control_text(self) -> bool {
        matches!(
            self,
            AnswerFormat::Harmony
                | AnswerFormat::Mistral
                | AnswerFormat::Gemma4
                | AnswerFormat::DeepSeek
                | AnswerFormat::Kimi
        )
    }

    /// Whether a prompt whose text ends with `tail` leaves the answer inside a reasoning
    /// block: DeepSeek V3.1/V3.2's generation prompt ends with `<think>` when thinking (and
    /// `<think></think>` when not), as R1's and thinking-only Qwen3 models' do.
    pub fn opens_reasoning(self, tail: &str) -> bool {
        self.reasoning()
            .is_some_and(|t| !t.anywhere && tail.trim_end().ends_with(t.open))
    }
}

/// A finished answer, split.
pub struct Answer {
    pub reasoning: Option<String>,
    pub text: String,
    pub calls: Vec<ToolCall>,
}

impl Answer {
    /// `reading`: how the model writes reasoning and calls; `tools`: calls may be made.
    pub fn of(reading: impl Into<Reading>, tools: Option<&Tools>, text: &str) -> Answer {
        let reading = reading.into();
        let format = reading.format;
        if format == AnswerFormat::Harmony {
            let mut s = AnswerStream::new(format, tools);
            let mut a = Answer {
                reasoning: None,
                text: String::new(),
                calls: Vec::new(),
            };
            for piece in s.push(text, true) {
                match piece {
                    Piece::Reasoning(r) => a.reasoning.get_or_insert_with(String::new).push_str(&r),
                    Piece::Text(t) => a.text.push_str(&t),
                    Piece::CallStart(name) => a.calls.push(ToolCall {
                        name,
                        arguments: String::new(),
                    }),
                    Piece::CallArgs(x) => {
                        if let Some(c) = a.calls.last_mut() {
                            c.arguments.push_str(&x);
                        }
                    }
                    Piece::CallEnd | Piece::Call(_) => {}
                }
            }
            return a;
        }
        let (reasoning, text) = match format.reasoning() {
            Some(tags) => ReasoningSplitter::start(tags, reading.opened).split_all(text),
            None => (None, text.to_string()),
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
    reading: Reading,
    /// Set for harmony answers, which it splits instead of everything below.
    harmony: Option<harmony::Parser>,
    /// Inside a harmony message to a recipient that is no function of the request (a
    /// built-in tool such as `browser.search`): the model talking to a tool the client does not
    /// run, told as reasoning rather than as a call.
    foreign_call: bool,
    tools: Option<Tools>,
    splitter: ReasoningSplitter,
    streamer: Option<CallStreamer>,
    text: String,
    /// Calls streamed so far: name and arguments text.
    streamed: Vec<(String, String)>,
    /// Calls sent whole from the final parse.
    whole: usize,
    /// Calls the final parse found (known at the end).
    confirmed: Option<usize>,
}

impl AnswerStream {
    pub fn new(reading: impl Into<Reading>, tools: Option<&Tools>) -> AnswerStream {
        let reading = reading.into();
        let format = reading.format;
        AnswerStream {
            reading,
            harmony: (format == AnswerFormat::Harmony).then(harmony::Parser::new),
            foreign_call: false,
            tools: tools.cloned(),
            splitter: ReasoningSplitter::start(
                format.reasoning().unwrap_or(reasoning::THINK),
                reading.opened,
            ),
            streamer: tools.map(CallStreamer::new),
            text: String::new(),
            streamed: Vec::new(),
            whole: 0,
            confirmed: None,
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

    /// Calls begun in the stream so far (streamed or whole): the next call's index.
    pub fn begun(&self) -> usize {
        self.streamed.len() + self.whole
    }

    /// The answer's calls: once it has ended, those its final parse found (a streamed call
    /// that turned out malformed or cut short does not count: the stop reason follows the
    /// answer, not the stream); before, those begun.
    pub fn calls(&self) -> usize {
        self.confirmed.unwrap_or_else(|| self.begun())
    }

    /// The next delta of the answer; `last` for the final one.
    pub fn push(&mut self, delta: &str, last: bool) -> Vec<Piece> {
        if let Some(p) = self.harmony.as_mut() {
            let mut events = p.push(delta);
            if last {
                events.extend(p.finish());
            }
            let mut out = Vec::new();
            for e in events {
                out.push(match e {
                    harmony::Event::Reasoning(r) => Piece::Reasoning(r),
                    harmony::Event::Content(c) => Piece::Text(c),
                    harmony::Event::CallStart(name) => {
                        let declared = self
                            .tools
                            .as_ref()
                            .is_some_and(|t| t.specs.iter().any(|s| s.name == name));
                        if !declared {
                            self.foreign_call = true;
                            Piece::Reasoning(format!("[to {name}] "))
                        } else {
                            self.streamed.push((name.clone(), String::new()));
                            Piece::CallStart(name)
                        }
                    }
                    harmony::Event::CallArgs(a) if self.foreign_call => Piece::Reasoning(a),
                    harmony::Event::CallArgs(a) => Piece::CallArgs(a),
                    harmony::Event::CallEnd if self.foreign_call => {
                        self.foreign_call = false;
                        continue;
                    }
                    harmony::Event::CallEnd => Piece::CallEnd,
                });
            }
            if last {
                self.confirmed = Some(self.streamed.len());
            }
            return out;
        }
        self.text.push_str(delta);
        let thinking = self.reading.format.reasoning().is_some();
        let (mut r, mut c) = if thinking {
            self.splitter.push(delta)
        } else {
            (String::new(), delta.to_string())
        };
        if last && thinking {
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
        for e in &events {
            match e {
                ToolEvent::Start(name) => self.streamed.push((name.clone(), String::new())),
                ToolEvent::Args(a) => {
                    if let Some(call) = self.streamed.last_mut() {
                        call.1.push_str(a);
                    }
                }
                _ => {}
            }
        }
        let mut missed = Vec::new();
        if last {
            let fin = Answer::of(self.reading, self.tools.as_ref(), &self.text).calls;
            self.confirmed = Some(fin.len());
            // A final call the stream did not carry (same name, same arguments) goes whole.
            let same = |c: &ToolCall, (name, args): &(String, String)| {
                c.name == *name
                    && serde_json::from_str::<serde_json::Value>(args).ok()
                        == serde_json::from_str::<serde_json::Value>(&c.arguments).ok()
            };
            let mut unmatched: Vec<&(String, String)> = self.streamed.iter().collect();
            for c in fin {
                match unmatched.iter().position(|s| same(&c, s)) {
                    Some(k) => {
                        unmatched.remove(k);
                    }
                    None => missed.push(c),
                }
            }
            if missed.is_empty() {
                events.extend(cs.finish());
            }
        }
        for e in events {
            out.push(match e {
                ToolEvent::Text(x) => Piece::Text(x),
                ToolEvent::Start(name) => Piece::CallStart(name),
                ToolEvent::Args(a) => Piece::CallArgs(a),
                ToolEvent::End => Piece::CallEnd,
            });
        }
        self.whole += missed.len();
        out.extend(missed.into_iter().map(Piece::Call));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Tools {
        let t = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        crate::tools::parse(Some(&t), None).unwrap().unwrap()
    }

    /// The answer `text` streamed `step` bytes at a time: the text pieces joined, the calls
    /// (streamed or whole) and the call count the stream ends with.
    fn stream(text: &str, step: usize) -> (String, Vec<(String, String)>, usize) {
        let (_, out, calls, n) = stream_as(AnswerFormat::Plain, &tools(), text, step);
        (out, calls, n)
    }

    /// [`stream`] for a model's own format: the reasoning pieces joined too.
    fn stream_as(
        format: AnswerFormat,
        t: &Tools,
        text: &str,
        step: usize,
    ) -> (String, String, Vec<(String, String)>, usize) {
        let mut a = AnswerStream::new(format, Some(t));
        let (mut reasoning, mut out, mut calls) = (String::new(), String::new(), Vec::new());
        let mut rest = text;
        loop {
            let mut cut = step.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            let (piece, tail) = rest.split_at(cut);
            rest = tail;
            for p in a.push(piece, rest.is_empty()) {
                match p {
                    Piece::Reasoning(r) => reasoning.push_str(&r),
                    Piece::Text(x) => out.push_str(&x),
                    Piece::CallStart(n) => calls.push((n, String::new())),
                    Piece::CallArgs(x) => calls.last_mut().unwrap().1.push_str(&x),
                    Piece::Call(c) => calls.push((c.name, c.arguments)),
                    Piece::CallEnd => {}
                }
            }
            if rest.is_empty() {
                break;
            }
        }
        (reasoning, out, calls, a.calls())
    }

    #[test]
    fn what_is_not_a_call_stays_text_and_counts_follow_the_final_parse() {
        for step in [1, 3, 1000] {
            // An undeclared function: text, as the whole answer's parse says.
            let text = "Try <tool_call>{\"name\": \"other\", \"arguments\": {}}</tool_call> now.";
            let (out, calls, n) = stream(text, step);
            assert_eq!((out.as_str(), calls.len(), n), (text, 0, 0), "step {step}");
            // A call the answer ends inside: streamed, and the final parse agrees.
            let text =
                "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}";
            let (_, calls, n) = stream(text, step);
            assert_eq!((calls.len(), n), (1, 1), "step {step}");
            // Cut off inside its arguments: streamed as far as it got, but no call.
            let text = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Os";
            let (_, calls, n) = stream(text, step);
            assert_eq!((calls.len(), n), (1, 0), "step {step}");
            // Prose that mentions the tag, then more text: all of it text.
            let text = "Write <tool_call> and then } more words follow here.";
            let (out, _, n) = stream(text, step);
            assert_eq!((out.as_str(), n), (text, 0), "step {step}");
        }
    }

    /// Mistral: `[THINK]` reasoning, then text, then `[TOOL_CALLS]` calls streamed as they
    /// come, in any cut; the whole answer's parse agrees.
    #[test]
    fn mistral_reasoning_and_calls() {
        let t = tools();
        let text = "[THINK]Weather, so call it.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}";
        for step in [1, 4, 1000] {
            let (reasoning, out, calls, n) = stream_as(AnswerFormat::Mistral, &t, text, step);
            assert_eq!(reasoning, "Weather, so call it.", "step {step}");
            assert_eq!(out, "Checking.", "step {step}");
            assert_eq!(
                calls,
                vec![("get_weather".into(), "{\"city\": \"Oslo\"}".into())],
                "step {step}"
            );
            assert_eq!(n, 1);
        }
        let whole = Answer::of(AnswerFormat::Mistral, Some(&t), text);
        assert_eq!(whole.reasoning.as_deref(), Some("Weather, so call it."));
        assert_eq!((whole.text.as_str(), whole.calls.len()), ("Checking.", 1));
    }

    /// Gemma 4: the thought channel is reasoning, then text, then calls in Gemma's notation
    /// streamed as JSON as they come, in any cut; the whole answer's parse agrees. The empty
    /// thought channel Gemma 4 may end an answer with is no content.
    #[test]
    fn gemma4_reasoning_and_calls() {
        let t = tools();
        let text = "<|channel>thought\nWeather, so call it.<channel|>Checking.\
            <|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}<tool_call|>";
        for step in [1, 3, 7, 1000] {
            let (reasoning, out, calls, n) = stream_as(AnswerFormat::Gemma4, &t, text, step);
            assert_eq!(reasoning, "Weather, so call it.", "step {step}");
            assert_eq!(out, "Checking.", "step {step}");
            assert_eq!(
                calls,
                vec![("get_weather".into(), "{\"city\":\"Oslo\"}".into())],
                "step {step}"
            );
            assert_eq!(n, 1);
        }
        let whole = Answer::of(AnswerFormat::Gemma4, Some(&t), text);
        assert_eq!(whole.reasoning.as_deref(), Some("Weather, so call it."));
        assert_eq!(whole.text, "Checking.");
        assert_eq!(
            whole.calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Oslo\"}".into()
            }]
        );
        let plain = Answer::of(
            AnswerFormat::Gemma4,
            None,
            "Paris.<|channel>thought\n<channel|>",
        );
        assert_eq!((plain.reasoning, plain.text.as_str()), (None, "Paris."));
    }

    /// The answer split whole, and streamed at every cut and in small steps: each time the
    /// reasoning, the text and the calls (arguments as JSON values) must be `want`, every call
    /// streamed as it is generated (none left to the final parse); the stream's call count
    /// must be the whole answer's.
    fn splits_alike(
        reading: Reading,
        text: &str,
        want: (Option<&str>, &str, Vec<(&str, serde_json::Value)>),
    ) {
        let t = tools();
        let mut t2 = t.clone();
        t2.specs.push(crate::tools::ToolSpec {
            name: "get_time".into(),
            parameters: json!({"type": "object"}),
        });
        let t = t2;
        let want_calls: Vec<(String, serde_json::Value)> = want
            .2
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect();
        let whole = Answer::of(reading, Some(&t), text);
        let got: Vec<(String, serde_json::Value)> = whole
            .calls
            .iter()
            .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
            .collect();
        assert_eq!(whole.reasoning.as_deref(), want.0, "whole {text:?}");
        assert_eq!(whole.text, want.1, "whole {text:?}");
        assert_eq!(got, want_calls, "whole {text:?}");
        let mut splits: Vec<Vec<&str>> = Vec::new();
        for cut in (1..text.len()).filter(|&c| text.is_char_boundary(c)) {
            splits.push(vec![&text[..cut], &text[cut..]]);
        }
        for step in [1, 3, 7] {
            let mut pieces = Vec::new();
            let mut rest = text;
            while !rest.is_empty() {
                let mut cut = step.min(rest.len());
                while !rest.is_char_boundary(cut) {
                    cut += 1;
                }
                let (p, tail) = rest.split_at(cut);
                pieces.push(p);
                rest = tail;
            }
            splits.push(pieces);
        }
        for pieces in splits {
            let mut a = AnswerStream::new(reading, Some(&t));
            let (mut r, mut out, mut calls) = (String::new(), String::new(), Vec::new());
            for (i, piece) in pieces.iter().enumerate() {
                for p in a.push(piece, i + 1 == pieces.len()) {
                    match p {
                        Piece::Reasoning(x) => r.push_str(&x),
                        Piece::Text(x) => out.push_str(&x),
                        Piece::CallStart(n) => calls.push((n, String::new())),
                        Piece::CallArgs(x) => calls.last_mut().unwrap().1.push_str(&x),
                        Piece::Call(c) => panic!("{c:?} sent whole: the stream missed it"),
                        Piece::CallEnd => {}
                    }
                }
            }
            let got: Vec<(String, serde_json::Value)> = calls
                .into_iter()
                .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
                .collect();
            let cut = pieces[0].len();
            assert_eq!(r, want.0.unwrap_or(""), "{text:?} from cut {cut}");
            assert_eq!(out.trim(), want.1, "{text:?} from cut {cut}");
            assert_eq!(got, want_calls, "{text:?} from cut {cut}");
            assert_eq!(a.calls(), want.2.len(), "{text:?} from cut {cut}");
        }
    }

    /// DeepSeek V3.1: thinking on, the prompt opened `<think>`: the answer is reasoning up to
    /// `</think>`, then text, then calls between its markers (the fullwidth bars and ▁ of its
    /// vocabulary); thinking off, the prompt closed it: all text. Split whole and streamed
    /// at every cut alike, no marker in the text.
    #[test]
    fn deepseek_v3_1_reasoning_and_calls() {
        let opened = Reading {
            format: AnswerFormat::DeepSeek,
            opened: true,
        };
        let calls = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>\
            {\"city\": \"Pa}ris <｜tool▁call▁end｜>\"}<｜tool▁call▁end｜>\
            <｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let want = vec![
            ("get_weather", json!({"city": "Pa}ris <｜tool▁call▁end｜>"})),
            ("get_time", json!({})),
        ];
        splits_alike(
            opened,
            &format!("Weather, so call it.</think>Checking.{calls}"),
            (Some("Weather, so call it."), "Checking.", want.clone()),
        );
        splits_alike(
            AnswerFormat::DeepSeek.into(),
            &format!("Checking.{calls}"),
            (None, "Checking.", want.clone()),
        );
        // Cut off after a call's arguments: still the call.
        splits_alike(
            AnswerFormat::DeepSeek.into(),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}",
            (None, "", vec![("get_time", json!({}))]),
        );
        splits_alike(
            opened,
            "Hm.</think>\n\nParis.",
            (Some("Hm."), "Paris.", vec![]),
        );
        splits_alike(
            AnswerFormat::DeepSeek.into(),
            "Paris.",
            (None, "Paris.", vec![]),
        );
        // An undeclared function, or arguments that are no object: text.
        for text in [
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ] {
            let a = Answer::of(AnswerFormat::DeepSeek, Some(&tools()), text);
            assert_eq!((a.text.as_str(), a.calls.len()), (text, 0));
        }
    }

    /// DeepSeek V3.2: its DSML block (a string parameter as it is, others as JSON), after
    /// reasoning closed by `</think>` or cut short by the block itself; split whole and
    /// streamed alike.
    #[test]
    fn deepseek_v3_2_dsml_calls() {
        let block = "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
            <｜DSML｜parameter name=\"city\" string=\"true\">Oslo, \"NO\" {x}</｜DSML｜parameter>\n\
            <｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
            <｜DSML｜parameter name=\"opts\" string=\"false\">{\"metric\": true, \"tags\": [\"a\"]}</｜DSML｜parameter>\n\
            </｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
        let want = vec![
            (
                "get_weather",
                json!({"city": "Oslo, \"NO\" {x}", "days": 3, "opts": {"metric": true, "tags": ["a"]}}),
            ),
            ("get_time", json!({})),
        ];
        let opened = Reading {
            format: AnswerFormat::DeepSeek,
            opened: true,
        };
        splits_alike(
            opened,
            &format!("Need the weather.</think>Checking.{block}"),
            (Some("Need the weather."), "Checking.", want.clone()),
        );
        splits_alike(
            opened,
            &format!("Need the weather.{block}"),
            (Some("Need the weather.\n\n"), "", want.clone()),
        );
        splits_alike(
            AnswerFormat::DeepSeek.into(),
            &format!("Checking.{block}"),
            (None, "Checking.", want),
        );
        // A parameter that does not read: no call.
        let bad = "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_time\">\n\
            <｜DSML｜parameter name=\"x\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
        let a = Answer::of(AnswerFormat::DeepSeek, Some(&tools()), bad);
        assert_eq!((a.text.as_str(), a.calls.len()), (bad, 0));
    }

    /// Kimi K2 (Instruct, and Thinking's `<think>` reasoning): calls in a section, each
    /// named `functions.NAME:IDX`; the section and end markers may be left out, and a call
    /// may begin before the reasoning is closed (as llama.cpp reads Kimi K2 Thinking).
    #[test]
    fn kimi_k2_reasoning_and_calls() {
        let calls = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
            <|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|>\
            <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>\
            <|tool_calls_section_end|>";
        let want = vec![
            ("get_weather", json!({"city": "Oslo"})),
            ("get_time", json!({})),
        ];
        let kimi: Reading = AnswerFormat::Kimi.into();
        splits_alike(
            kimi,
            &format!("<think>Weather, so call it.</think>Checking.{calls}"),
            (Some("Weather, so call it."), "Checking.", want.clone()),
        );
        splits_alike(
            kimi,
            &format!("Checking.{calls}"),
            (None, "Checking.", want.clone()),
        );
        splits_alike(
            kimi,
            "<think>I need two calls<|tool_call_begin|>functions.get_weather:0\
            <|tool_call_argument_begin|>{\"city\": \"Oslo\"}\
            <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}",
            (Some("I need two calls"), "", want),
        );
        splits_alike(kimi, "Paris.", (None, "Paris.", vec![]));
        let unknown = "<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0\
            <|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
        let a = Answer::of(kimi, Some(&tools()), unknown);
        assert_eq!((a.text.as_str(), a.calls.len()), (unknown, 0));
    }

    /// A prompt that ends by opening the reasoning block leaves the answer inside it;
    /// `<think></think>` (thinking off) does not.
    #[test]
    fn prompts_that_open_reasoning() {
        assert!(AnswerFormat::DeepSeek.opens_reasoning("<｜Assistant｜><think>"));
        assert!(AnswerFormat::DeepSeek.opens_reasoning("</function_results>\n\n<think>"));
        assert!(AnswerFormat::Think.opens_reasoning("<｜Assistant｜><think>\n"));
        assert!(!AnswerFormat::DeepSeek.opens_reasoning("<｜Assistant｜><think></think>"));
        assert!(!AnswerFormat::Kimi.opens_reasoning("<|im_assistant|>assistant<|im_middle|>"));
        assert!(!AnswerFormat::Plain.opens_reasoning("<think>"));
        assert!(!AnswerFormat::Gemma4.opens_reasoning("<|channel>"));
    }

    /// The formats the real templates llama.cpp keeps are read as (from the cache
    /// `scripts/fetch-test-assets.sh` fills), the template alone deciding (the tiny Llama
    /// vocabulary has no family's markers): DeepSeek's and Kimi K2's found, the others'
    /// unchanged.
    #[test]
    fn real_templates_are_detected() {
        let cache = std::env::var_os("FERRUM_CACHE")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferrum")
            });
        let dir = cache.join("llama-templates");
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny/llama");
        let mut tok = Tokenizer::from_hf_dir(&fixture).unwrap();
        for (file, want) in [
            ("deepseek-ai-DeepSeek-V3.1.jinja", AnswerFormat::DeepSeek),
            ("deepseek-ai-DeepSeek-V3.2.jinja", AnswerFormat::DeepSeek),
            (
                "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                AnswerFormat::DeepSeek,
            ),
            ("Kimi-K2-Instruct.jinja", AnswerFormat::Kimi),
            ("Kimi-K2-Thinking.jinja", AnswerFormat::Kimi),
            ("moonshotai-Kimi-K2.jinja", AnswerFormat::Kimi),
            ("GLM-4.6.jinja", AnswerFormat::Think),
            ("Qwen-Qwen3-0.6B.jinja", AnswerFormat::Think),
            (
                "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
                AnswerFormat::Plain,
            ),
            (
                "Mistral-Small-3.2-24B-Instruct-2506.jinja",
                AnswerFormat::Plain,
            ),
            ("google-gemma-4-31B-it.jinja", AnswerFormat::Gemma4),
        ] {
            let path = dir.join(file);
            let src = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                panic!("{}: {e} (run scripts/fetch-test-assets.sh)", path.display())
            });
            let t = ferrum_tokenizer::ChatTemplate::new(&src, "", "").unwrap();
            tok.set_chat_template(Some(t));
            assert_eq!(AnswerFormat::detect(&tok), want, "{file}");
        }
    }

    /// The answer format follows the vocabulary (Gemma 4's tiny fixture, from its Hugging
    /// Face files and its GGUF) or the template.
    #[test]
    fn formats_are_detected() {
        let fixture = |rel: &str| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures")
                .join(rel)
        };
        let hf = Tokenizer::from_hf_dir(&fixture("arch/gemma4")).unwrap();
        assert_eq!(AnswerFormat::detect(&hf), AnswerFormat::Gemma4);
        let g = ferrum_loader::GgufFile::inspect(fixture("arch/gemma4/model-f32.gguf")).unwrap();
        let gguf = Tokenizer::from_gguf(&g).unwrap();
        assert_eq!(AnswerFormat::detect(&gguf), AnswerFormat::Gemma4);
        let mut llama = Tokenizer::from_hf_dir(&fixture("tiny/llama")).unwrap();
        for (template, want) in [
            ("{{ '<|tool_call>call:' }}", AnswerFormat::Gemma4),
            ("{{ '<|channel>thought' }}", AnswerFormat::Gemma4),
            ("{{ '<｜tool▁call▁begin｜>' }}", AnswerFormat::DeepSeek),
            (
                "{%- set dsml_token = '｜DSML｜' -%}",
                AnswerFormat::DeepSeek,
            ),
            ("{{ '<|tool_calls_section_begin|>' }}", AnswerFormat::Kimi),
            ("{{ '<think>' }}", AnswerFormat::Think),
            ("{{ messages }}", AnswerFormat::Plain),
        ] {
            let t = ferrum_tokenizer::ChatTemplate::new(template, "", "").unwrap();
            llama.set_chat_template(Some(t));
            assert_eq!(AnswerFormat::detect(&llama), want, "{template}");
        }
    }

    /// Harmony: a call of a declared function is a call; a message to a tool the request did
    /// not declare (gpt-oss's built-in browser) is reasoning; the channels split at any cut.
    #[test]
    fn harmony_calls_of_declared_functions_only() {
        let t = tools();
        let text = "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant\
            <|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"q\": 1}<|call|>\
            <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
            <|message|>{\"city\": \"Oslo\"}";
        for step in [1, 5, 1000] {
            let mut a = AnswerStream::new(AnswerFormat::Harmony, Some(&t));
            let (mut reasoning, mut calls) = (String::new(), Vec::new());
            let mut rest = text;
            while !rest.is_empty() {
                let (piece, tail) = rest.split_at(step.min(rest.len()));
                rest = tail;
                for p in a.push(piece, rest.is_empty()) {
                    match p {
                        Piece::Reasoning(r) => reasoning.push_str(&r),
                        Piece::CallStart(n) => calls.push((n, String::new())),
                        Piece::CallArgs(x) => calls.last_mut().unwrap().1.push_str(&x),
                        Piece::Text(x) => panic!("no text expected: {x:?}"),
                        Piece::CallEnd | Piece::Call(_) => {}
                    }
                }
            }
            assert_eq!(
                reasoning, "Look it up.[to browser.search] {\"q\": 1}",
                "step {step}"
            );
            assert_eq!(
                calls,
                vec![("get_weather".into(), "{\"city\": \"Oslo\"}".into())]
            );
            assert_eq!(a.calls(), 1);
        }
        let whole = Answer::of(AnswerFormat::Harmony, None, text);
        assert!(whole.calls.is_empty(), "no tools declared: no calls");
    }
}
