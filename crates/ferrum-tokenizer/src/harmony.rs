//! gpt-oss's harmony chat format: what the model's output means, and the prompt for a
//! conversation when the model file has no chat template of its own.
//!
//! A harmony answer is a run of messages, each `<|start|>ROLE HEADER<|message|>BODY` closed
//! by `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the answer is over); the prompt
//! already ends in `<|start|>assistant`, so the first header comes straight away. The header
//! names a channel (`<|channel|>analysis`, `commentary` or `final`), and may name a recipient
//! (`to=functions.NAME`) and a content type (`<|constrain|>json`, or a bare `json`). The
//! markers are control tokens, so the engine must keep their text in its deltas
//! (`skip_special = false`) for [`Parser`] to see them.
//!
//! [`render`] writes the conversation as the `openai-harmony` reference renders it; a model
//! with a Jinja template is rendered with that instead (the two differ in small ways: the
//! template ends developer instructions with a blank line and JSON-quotes tool results).

use serde_json::{Map, Value};

use ferrum_core::{Error, Result};

pub const START: &str = "<|start|>";
pub const END: &str = "<|end|>";
pub const MESSAGE: &str = "<|message|>";
pub const CHANNEL: &str = "<|channel|>";
pub const CONSTRAIN: &str = "<|constrain|>";
pub const CALL: &str = "<|call|>";
pub const RETURN: &str = "<|return|>";

const MARKERS: &[&str] = &[START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN];

/// A header longer than this is not one: the model is writing plain text.
const MAX_HEADER: usize = 512;

/// Whether a vocabulary speaks harmony: it has the format's markers as control tokens.
pub fn is_harmony(tok: &crate::Tokenizer) -> bool {
    [START, END, MESSAGE, CHANNEL, RETURN].iter().all(|m| {
        tok.inner()
            .token_to_id(m)
            .is_some_and(|id| tok.is_special(id))
    })
}

/// One piece of a parsed answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Text of the `analysis` channel (the chain of thought).
    Reasoning(String),
    /// Text for the user: the `final` channel, or `commentary` addressed to no one
    /// (the preambles the format lets a model write before calling tools).
    Content(String),
    /// A message to a recipient begins: a call of this tool (`functions.` taken off).
    CallStart(String),
    /// Its arguments, as they come.
    CallArgs(String),
    CallEnd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    Call,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a header, up to `<|message|>`.
    Header,
    /// Inside a message's body.
    Body(Body),
    /// After a message: only `<|start|>` opens another.
    Between,
    /// Output with no harmony structure: all of it is content.
    Plain,
}

/// Splits a harmony answer, delta by delta, into [`Event`]s; never splits a marker.
#[derive(Debug, Clone)]
pub struct Parser {
    state: State,
    /// Text not yet resolved: a header being read, or a possible marker's beginning.
    held: String,
    /// Nothing has been read yet (the first header follows the prompt's `<|start|>assistant`).
    fresh: bool,
}

impl Default for Parser {
    fn default() -> Self {
        Parser {
            state: State::Header,
            held: String::new(),
            fresh: true,
        }
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of some marker.
fn partial_marker(s: &str) -> usize {
    let Some(lt) = s.rfind('<') else { return 0 };
    let tail = &s[lt..];
    if MARKERS
        .iter()
        .any(|m| m.len() > tail.len() && m.starts_with(tail))
    {
        tail.len()
    } else {
        0
    }
}

/// The first marker in `s`: its position and text.
fn next_marker(s: &str) -> Option<(usize, &'static str)> {
    MARKERS
        .iter()
        .filter_map(|m| s.find(m).map(|at| (at, *m)))
        .min_by_key(|&(at, _)| at)
}

/// What a header says the body is. `header` is everything between `<|start|>` (or the
/// answer's beginning) and `<|message|>`, markers included.
fn classify(header: &str) -> (Body, Option<String>) {
    let text = header
        .replace(CONSTRAIN, " ")
        .replace(CHANNEL, " <channel> ");
    let mut channel = None;
    let mut recipient = None;
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == "<channel>" {
            channel = words.next().map(str::to_string);
        } else if let Some(r) = w.strip_prefix("to=") {
            recipient = Some(r.to_string());
        }
    }
    match recipient.filter(|r| r != "assistant" && !r.is_empty()) {
        Some(r) => {
            let name = r.strip_prefix("functions.").unwrap_or(&r).to_string();
            (Body::Call, Some(name))
        }
        None if channel.as_deref() == Some("analysis") => (Body::Reasoning, None),
        None => (Body::Content, None),
    }
}

impl Parser {
    pub fn new() -> Parser {
        Parser::default()
    }

    /// Feeds a delta; returns the events now certain.
    pub fn push(&mut self, delta: &str) -> Vec<Event> {
        self.held.push_str(delta);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Plain => {
                    if !self.held.is_empty() {
                        out.push(Event::Content(std::mem::take(&mut self.held)));
                    }
                    break;
                }
                State::Header => {
                    if self.fresh && !self.held.is_empty() && !self.looks_like_header() {
                        self.state = State::Plain;
                        continue;
                    }
                    if let Some(at) = self.held.find(MESSAGE) {
                        let header: String = self.held.drain(..at + MESSAGE.len()).collect();
                        let (body, name) = classify(&header[..at]);
                        if let Some(name) = name {
                            out.push(Event::CallStart(name));
                        }
                        self.fresh = false;
                        self.state = State::Body(body);
                    } else if self.held.len() > MAX_HEADER {
                        // Not a header after all: say it as it is.
                        self.state = State::Body(Body::Content);
                        self.fresh = false;
                    } else {
                        break;
                    }
                }
                State::Body(body) => match next_marker(&self.held) {
                    Some((at, marker)) => {
                        let text: String = self.held.drain(..at).collect();
                        self.held.drain(..marker.len());
                        emit(&mut out, body, text);
                        if body == Body::Call {
                            out.push(Event::CallEnd);
                        }
                        self.state = if marker == START {
                            State::Header
                        } else {
                            State::Between
                        };
                    }
                    None => {
                        let keep = partial_marker(&self.held);
                        let text: String = self.held.drain(..self.held.len() - keep).collect();
                        emit(&mut out, body, text);
                        break;
                    }
                },
                State::Between => match self.held.find(START) {
                    Some(at) => {
                        self.held.drain(..at + START.len());
                        self.state = State::Header;
                    }
                    None => {
                        // Stray text between messages (a marker the model skipped): drop it
                        // up to anything that may still become `<|start|>`.
                        let keep = partial_marker(&self.held);
                        self.held.drain(..self.held.len() - keep);
                        break;
                    }
                },
            }
        }
        out
    }

    /// The answer is over: what is held, as what it was going to be.
    pub fn finish(&mut self) -> Vec<Event> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Body(body) => {
                emit(&mut out, body, held);
                if body == Body::Call {
                    out.push(Event::CallEnd);
                }
            }
            // Text that only might have become a header ("assis") is the answer; a header
            // begun with a whole marker and cut short ("<|channel|>analy") is markup.
            State::Header if self.fresh && !starts_with_marker(&held) => {
                emit(&mut out, Body::Content, held)
            }
            State::Plain => emit(&mut out, Body::Content, held),
            // A header the answer stopped in, or text after the last message, says nothing.
            State::Header | State::Between => {}
        }
        self.state = State::Between;
        out
    }

    /// At the start of the answer: whether the text so far can still be a header (a marker,
    /// a role or a recipient) rather than plain text.
    fn looks_like_header(&self) -> bool {
        let t = self.held.trim_start();
        if t.is_empty() {
            return true;
        }
        let starts = |p: &str| t.starts_with(p) || p.starts_with(t);
        MARKERS.iter().any(|m| starts(m)) || starts("assistant") || starts("to=")
    }
}

fn starts_with_marker(s: &str) -> bool {
    let t = s.trim_start();
    MARKERS.iter().any(|m| t.starts_with(m))
}

fn emit(out: &mut Vec<Event>, body: Body, text: String) {
    if text.is_empty() {
        return;
    }
    out.push(match body {
        Body::Reasoning => Event::Reasoning(text),
        Body::Content => Event::Content(text),
        Body::Call => Event::CallArgs(text),
    });
}

// ------------------------------------------------------------------------------ rendering

/// The conversation's prompt as `openai-harmony` renders it for the assistant's next turn
/// (`render_conversation_for_completion`), for models without a template of their own.
///
/// `messages` are in the chat template's shape (role, content, `thinking` for an assistant's
/// analysis, `tool_calls` with object arguments; the first system or developer message is
/// the developer's instructions), `kwargs` the template's variables (`tools`,
/// `reasoning_effort`, `model_identity`); `date` goes on the system message's
/// "Current date" line.
pub fn render(messages: &[Value], kwargs: &Map<String, Value>, date: &str) -> Result<String> {
    let effort = kwargs
        .get("reasoning_effort")
        .and_then(Value::as_str)
        .unwrap_or("medium");
    let identity = kwargs
        .get("model_identity")
        .and_then(Value::as_str)
        .unwrap_or("You are ChatGPT, a large language model trained by OpenAI.");
    let tools: Vec<&Value> = kwargs
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|t| t.get("function").unwrap_or(t))
        .collect();
    let mut out = String::new();
    out.push_str(START);
    out.push_str("system");
    out.push_str(MESSAGE);
    out.push_str(&format!(
        "{identity}\nKnowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: {effort}\n\n\
         # Valid channels: analysis, commentary, final. Channel must be included for every message."
    ));
    if !tools.is_empty() {
        out.push_str("\nCalls to these tools must go to the commentary channel: 'functions'.");
    }
    out.push_str(END);

    let text = |m: &Value, key: &str| m.get(key).and_then(Value::as_str).map(str::to_string);
    let (instructions, rest) = match messages.first() {
        Some(m) if matches!(text(m, "role").as_deref(), Some("system" | "developer")) => {
            (text(m, "content").filter(|c| !c.is_empty()), &messages[1..])
        }
        _ => (None, messages),
    };
    if instructions.is_some() || !tools.is_empty() {
        out.push_str(START);
        out.push_str("developer");
        out.push_str(MESSAGE);
        let mut parts = Vec::new();
        if let Some(i) = instructions {
            parts.push(format!("# Instructions\n\n{i}"));
        }
        if !tools.is_empty() {
            parts.push(format!("# Tools\n\n{}", tool_namespace(&tools)?));
        }
        out.push_str(&parts.join("\n\n"));
        out.push_str(END);
    }

    // Analysis is dropped from turns before the last final answer, as harmony does.
    let last_final = rest.iter().rposition(|m| {
        text(m, "role").as_deref() == Some("assistant") && m.get("tool_calls").is_none()
    });
    let mut last_call: Option<String> = None;
    for (i, m) in rest.iter().enumerate() {
        let role = text(m, "role").unwrap_or_default();
        let content = text(m, "content").unwrap_or_default();
        match role.as_str() {
            "user" => {
                out.push_str(&format!("{START}user{MESSAGE}{content}{END}"));
            }
            "system" | "developer" => {
                out.push_str(&format!("{START}developer{MESSAGE}{content}{END}"));
            }
            "assistant" => {
                let thinking = text(m, "thinking").filter(|t| !t.is_empty());
                let calls = m.get("tool_calls").and_then(Value::as_array);
                // A calling turn's text is its analysis, as the model's template has it.
                let analysis = match calls {
                    Some(_) => thinking.or_else(|| Some(content.clone()).filter(|c| !c.is_empty())),
                    None => thinking,
                };
                if let Some(t) = &analysis {
                    if last_final.is_none_or(|f| i > f) {
                        out.push_str(&format!(
                            "{START}assistant{CHANNEL}analysis{MESSAGE}{t}{END}"
                        ));
                    }
                }
                if let Some(calls) = calls {
                    for c in calls {
                        let f = c.get("function").unwrap_or(c);
                        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
                        let args = match f.get("arguments") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v) => python_json(v),
                            None => "{}".into(),
                        };
                        out.push_str(&format!(
                            "{START}assistant to=functions.{name}{CHANNEL}commentary json{MESSAGE}{args}{CALL}"
                        ));
                        last_call = Some(name.to_string());
                    }
                } else {
                    out.push_str(&format!(
                        "{START}assistant{CHANNEL}final{MESSAGE}{content}{END}"
                    ));
                }
            }
            "tool" => {
                let name = text(m, "name")
                    .or_else(|| last_call.clone())
                    .ok_or_else(|| {
                        Error::Template("a tool message with no tool call before it".into())
                    })?;
                out.push_str(&format!(
                    "{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{content}{END}"
                ));
            }
            other => {
                return Err(Error::Template(format!(
                    "harmony has no role {other:?} (system, developer, user, assistant, tool)"
                )))
            }
        }
    }
    out.push_str(START);
    out.push_str("assistant");
    Ok(out)
}

/// JSON as Python's `json.dumps` writes it (", " and ": " separators), as harmony's
/// renderer does for arguments given as objects.
fn python_json(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let items: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), python_json(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(python_json).collect();
            format!("[{}]", items.join(", "))
        }
        v => v.to_string(),
    }
}

/// The `functions` namespace: each tool as a TypeScript-like type, as harmony declares them.
fn tool_namespace(tools: &[&Value]) -> Result<String> {
    let mut s = String::from("## functions\n\nnamespace functions {\n\n");
    for t in tools {
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Template("a tool without a name".into()))?;
        if let Some(d) = t.get("description").and_then(Value::as_str) {
            s.push_str(&format!("// {d}\n"));
        }
        let params = t.get("parameters");
        let props = params
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        match props {
            None => s.push_str(&format!("type {name} = () => any;\n\n")),
            Some(props) => {
                let required = required(params);
                s.push_str(&format!("type {name} = (_: {{\n"));
                for (k, spec) in props {
                    if let Some(d) = spec.get("description").and_then(Value::as_str) {
                        s.push_str(&format!("// {d}\n"));
                    }
                    let opt = if required.contains(&k.as_str()) {
                        ""
                    } else {
                        "?"
                    };
                    s.push_str(&format!("{k}{opt}: {}", ts_type(spec)));
                    if let Some(d) = spec.get("default") {
                        s.push_str(&format!(", // default: {}", python_json(d)));
                    } else {
                        s.push(',');
                    }
                    s.push('\n');
                }
                s.push_str("}) => any;\n\n");
            }
        }
    }
    s.push_str("} // namespace functions");
    Ok(s)
}

fn required(schema: Option<&Value>) -> Vec<&str> {
    schema
        .and_then(|p| p.get("required"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// A JSON schema as a TypeScript type.
fn ts_type(spec: &Value) -> String {
    let nullable = spec.get("nullable").and_then(Value::as_bool) == Some(true);
    let null = if nullable { " | null" } else { "" };
    if let Some(e) = spec.get("enum").and_then(Value::as_array) {
        let items: Vec<String> = e.iter().map(Value::to_string).collect();
        return format!("{}{null}", items.join(" | "));
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(v) = spec.get(key).and_then(Value::as_array) {
            let items: Vec<String> = v.iter().map(ts_type).collect();
            return format!("{}{null}", items.join(" | "));
        }
    }
    let ty = match spec.get("type") {
        Some(Value::Array(types)) => {
            let items: Vec<String> = types
                .iter()
                .map(|t| ts_type(&serde_json::json!({ "type": t })))
                .collect();
            return items.join(" | ");
        }
        Some(Value::String(t)) => t.as_str(),
        _ => return "any".into(),
    };
    let base = match ty {
        "string" => "string".to_string(),
        "number" | "integer" => "number".to_string(),
        "boolean" => "boolean".to_string(),
        "null" => "null".to_string(),
        "array" => match spec.get("items") {
            Some(items) => format!("{}[]", ts_type(items)),
            None => "Array<any>".to_string(),
        },
        "object" => match spec.get("properties").and_then(Value::as_object) {
            Some(props) if !props.is_empty() => {
                let req = required(Some(spec));
                let fields: Vec<String> = props
                    .iter()
                    .map(|(k, v)| {
                        let opt = if req.contains(&k.as_str()) { "" } else { "?" };
                        format!("{k}{opt}: {}", ts_type(v))
                    })
                    .collect();
                format!("{{\n{},\n}}", fields.join(",\n"))
            }
            _ => "object".to_string(),
        },
        _ => "any".to_string(),
    };
    format!("{base}{null}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events_joined(events: &[Event]) -> Vec<Event> {
        // Adjacent text events of one kind merged, so streams cut differently compare equal.
        let mut out: Vec<Event> = Vec::new();
        for e in events {
            match (out.last_mut(), e) {
                (Some(Event::Reasoning(a)), Event::Reasoning(b))
                | (Some(Event::Content(a)), Event::Content(b))
                | (Some(Event::CallArgs(a)), Event::CallArgs(b)) => a.push_str(b),
                _ => out.push(e.clone()),
            }
        }
        out
    }

    fn run(text: &str, step: usize) -> Vec<Event> {
        let mut p = Parser::new();
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = step.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            out.extend(p.push(&rest[..cut]));
            rest = &rest[cut..];
        }
        out.extend(p.finish());
        events_joined(&out)
    }

    #[test]
    fn channels_split_into_reasoning_content_and_calls_at_any_cut() {
        use Event::*;
        let cases: Vec<(&str, Vec<Event>)> = vec![
            (
                "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
                vec![Reasoning("User says hi.".into()), Content("Hello!".into())],
            ),
            (
                "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}",
                vec![
                    Reasoning("Need weather.".into()),
                    CallStart("get_weather".into()),
                    CallArgs("{\"city\":\"Oslo\"}".into()),
                    CallEnd,
                ],
            ),
            (
                // The recipient before the channel, as the chat template writes calls.
                " to=functions.f<|channel|>commentary json<|message|>{}<|call|>",
                vec![CallStart("f".into()), CallArgs("{}".into()), CallEnd],
            ),
            (
                // A preamble to the user on commentary, then a call.
                "<|channel|>commentary<|message|>Checking…<|end|><|start|>assistant to=functions.f<|channel|>commentary<|message|>{}",
                vec![Content("Checking…".into()), CallStart("f".into()), CallArgs("{}".into()), CallEnd],
            ),
            ("Just text, no markers.", vec![Content("Just text, no markers.".into())]),
            ("<|channel|>final<|message|>a < b <| c", vec![Content("a < b <| c".into())]),
            // Cut off inside the analysis: reasoning only.
            ("<|channel|>analysis<|message|>Hmm", vec![Reasoning("Hmm".into())]),
            // Cut off inside the first header (max_tokens): nothing, not the markup as text.
            ("<|channel|>analysi", vec![]),
            ("<|channel|>commentary to=functions.f <|constrain|>js", vec![]),
            // Text that could only have become a header is the answer.
            ("assis", vec![Content("assis".into())]),
        ];
        for (text, want) in cases {
            for step in [1, 2, 3, 7, 1000] {
                assert_eq!(run(text, step), want, "{text:?} in steps of {step}");
            }
        }
    }

    #[test]
    fn whole_answers_parse() {
        let text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.";
        assert_eq!(
            run(text, text.len()),
            vec![
                Event::Reasoning("Think.".into()),
                Event::Content("Done.".into())
            ]
        );
    }
}
