//! Tool calling: the request's `tools` and `tool_choice`, how they reach the prompt, the
//! grammar that enforces a required or named call, and parsing calls out of the answer.
//!
//! The call format is Hermes/Qwen's — `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`
//! — which Qwen2.5/Qwen3 templates produce themselves; a template that does not render
//! tools gets the same instructions as a system message. Answers are also read in the
//! formats other families' templates teach: Llama 3's bare JSON (`{"name": …,
//! "parameters": {…}}`), GLM-4.5's `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>
//! …</tool_call>` (a value is JSON, or else a string), and Mistral's `[TOOL_CALLS]NAME[ARGS]{…}`
//! (with `[CALL_ID]ID` before `[ARGS]` in Mistral Small 3.2, or the older
//! `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`), and Gemma 4's
//! `<|tool_call>call:NAME{key:<|"|>text<|"|>,…}<tool_call|>` (its notation read into JSON by
//! [`crate::gemma`]), DeepSeek V3.1's `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}
//! <｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`, DeepSeek V3.2's DSML block and Kimi K2's
//! `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
//! {…}<|tool_call_end|>…<|tool_calls_section_end|>` ([`crate::dsml`]).

use serde_json::{json, Value};

use crate::dsml::{self, Read, Section};
use crate::error::ApiError;
use crate::gemma;

#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Debug, Clone)]
pub struct Tools {
    pub specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// The tools as the client sent them (what templates expect in `tools`).
    pub raw: Vec<Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON text, as OpenAI returns them.
    pub arguments: String,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Checks `tools` and `tool_choice`; `None` when no tools are in play.
pub fn parse(tools: Option<&Value>, choice: Option<&Value>) -> Result<Option<Tools>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::param("tools", "tools must be an array")),
    };
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::param(
                    "tool_choice",
                    format!("tool_choice {other:?} (none, auto, required or a function)"),
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"));
            match name {
                Some(n) => ToolChoice::Named(n.to_string()),
                None => {
                    return Err(ApiError::param(
                        "tool_choice",
                        "tool_choice must name a function: {\"type\": \"function\", \"function\": {\"name\": …}}",
                    ))
                }
            }
        }
    };
    if list.is_empty() {
        return match choice {
            ToolChoice::Required | ToolChoice::Named(_) => {
                Err(ApiError::param("tool_choice", "tool_choice needs tools"))
            }
            _ => Ok(None),
        };
    }
    let mut specs = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let f = t
            .get("function")
            .filter(|_| t.get("type").and_then(Value::as_str) == Some("function"))
            .ok_or_else(|| {
                ApiError::param(
                    "tools",
                    format!("tools[{i}] must be {{\"type\": \"function\", \"function\": …}}"),
                )
            })?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        if !valid_name(name) {
            return Err(ApiError::param(
                "tools",
                format!("tools[{i}].function.name {name:?} must be 1-64 of a-z, A-Z, 0-9, _ and -"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(ApiError::param(
                    "tools",
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                ))
            }
        };
        specs.push(ToolSpec {
            name: name.to_string(),
            parameters,
        });
    }
    if let ToolChoice::Named(n) = &choice {
        if !specs.iter().any(|s| &s.name == n) {
            return Err(ApiError::param(
                "tool_choice",
                format!("tool_choice names {n:?}, which is not among the tools"),
            ));
        }
    }
    Ok(Some(Tools {
        specs,
        choice,
        raw: list,
    }))
}

impl Tools {
    /// Whether the model may call tools at all.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The instructions given to a model whose template does not render tools; each tool's
    /// JSON (the request's) goes through `escape`.
    pub fn system_prompt(&self, escape: &crate::api::Escape) -> String {
        let tools: Vec<String> = self
            .raw
            .iter()
            .map(|t| escape.json(t.clone()).to_string())
            .collect();
        format!(
            "You may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
             For each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
            tools.join("\n")
        )
    }

    /// The functions `required` or a named choice allows (none: no call is forced).
    fn forced(&self) -> Option<Vec<&ToolSpec>> {
        match &self.choice {
            ToolChoice::Required => Some(self.specs.iter().collect()),
            ToolChoice::Named(n) => Some(self.specs.iter().filter(|s| &s.name == n).collect()),
            _ => None,
        }
    }

    /// For `required` and a named function, in harmony: a grammar for one message to an
    /// allowed function (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
    /// then arguments matching its schema, then `<|call|>`), the way gpt-oss writes calls.
    pub fn harmony_grammar(&self) -> Option<String> {
        let allowed = self.forced()?;
        let mut g = String::from("start: <|channel|> \"commentary to=functions.\" call\ncall: ");
        let alts: Vec<String> = (0..allowed.len()).map(|i| format!("c{i}")).collect();
        g.push_str(&alts.join(" | "));
        g.push('\n');
        for (i, s) in allowed.iter().enumerate() {
            let schema = ferrum_generate::grammar::compact(s.parameters.clone());
            g.push_str(&format!(
                "c{i}: {} \" \" <|constrain|> \"json\" <|message|> a{i} <|call|>\na{i}: %json {schema}\n",
                Value::String(s.name.clone())
            ));
        }
        Some(g)
    }

    /// For `required` and a named function: a grammar (llguidance's Lark) that admits exactly
    /// one call of an allowed function with arguments matching its schema.
    pub fn grammar(&self) -> Option<String> {
        let allowed = self.forced()?;
        let calls: Vec<Value> = allowed
            .iter()
            .map(|s| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": s.name}, "arguments": s.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = ferrum_generate::grammar::compact(if calls.len() == 1 {
            calls[0].clone()
        } else {
            json!({ "anyOf": calls })
        });
        Some(format!(
            "start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}\n"
        ))
    }

    /// Splits an answer into plain content and tool calls (only calls of known functions
    /// with object arguments count; anything else stays content).
    pub fn parse_output(&self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        let known = |n: &str| self.specs.iter().any(|s| s.name == n);
        let call_of = |v: &Value| -> Option<ToolCall> {
            let name = v.get("name")?.as_str()?;
            let args = v.get("arguments").or_else(|| v.get("parameters"))?;
            let args = match args {
                Value::String(s) => serde_json::from_str::<Value>(s).ok()?,
                other => other.clone(),
            };
            (known(name) && args.is_object()).then(|| ToolCall {
                name: name.to_string(),
                arguments: args.to_string(),
            })
        };
        let mut calls = Vec::new();
        let mut content = String::new();
        let mut rest = text;
        const OPEN: &str = "<tool_call>";
        const CLOSE: &str = "</tool_call>";
        while let Some(start) = rest.find(OPEN) {
            let after = &rest[start + OPEN.len()..];
            // Parse the JSON value itself (its strings may contain the closing tag), then
            // expect the tag.
            let mut values = serde_json::Deserializer::from_str(after).into_iter::<Value>();
            let parsed = match values.next() {
                Some(Ok(v)) => {
                    let tail = &after[values.byte_offset()..];
                    let ws = tail.len() - tail.trim_start().len();
                    if tail.trim_start().starts_with(CLOSE) {
                        Some((call_of(&v), values.byte_offset() + ws + CLOSE.len()))
                    } else if tail.trim().is_empty() {
                        // The answer ended before the closing tag (end of sequence).
                        Some((call_of(&v), after.len()))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            let parsed = parsed.or_else(|| {
                glm_call(after).map(|(name, args, used)| {
                    let v = json!({"name": name, "arguments": args});
                    (call_of(&v), used)
                })
            });
            match parsed {
                Some((Some(c), used)) => {
                    content.push_str(&rest[..start]);
                    calls.push(c);
                    rest = &after[used..];
                }
                _ => {
                    // Not a call after all: keep the tag as text and look further on.
                    content.push_str(&rest[..start + OPEN.len()]);
                    rest = after;
                }
            }
        }
        content.push_str(rest);
        if calls.is_empty() {
            let (rest, found) = gemma_calls(&content, call_of);
            if !found.is_empty() {
                let rest = rest.trim();
                return ((!rest.is_empty()).then(|| rest.to_string()), found);
            }
        }
        if calls.is_empty() {
            for section in dsml::SECTIONS {
                let (rest, found) = section.calls(&content, call_of);
                if !found.is_empty() {
                    let rest = rest.trim();
                    return ((!rest.is_empty()).then(|| rest.to_string()), found);
                }
            }
            let (rest, found) = dsml::calls(&content, call_of);
            if !found.is_empty() {
                let rest = rest.trim();
                return ((!rest.is_empty()).then(|| rest.to_string()), found);
            }
        }
        if calls.is_empty() {
            if let Some((before, found)) = mistral_calls(&content) {
                let found: Vec<ToolCall> = found.iter().filter_map(call_of).collect();
                if !found.is_empty() {
                    let before = before.trim();
                    return ((!before.is_empty()).then(|| before.to_string()), found);
                }
            }
        }
        if calls.is_empty() {
            // Llama 3 style: the whole answer is one JSON call.
            if let Some(c) = serde_json::from_str::<Value>(text.trim())
                .ok()
                .as_ref()
                .and_then(call_of)
            {
                return (None, vec![c]);
            }
        }
        let content = content.trim();
        ((!content.is_empty()).then(|| content.to_string()), calls)
    }
}

/// GLM-4.5's call after its `<tool_call>`: the name up to the first `<arg_key>` or line
/// end, then key/value pairs (a value that reads as JSON is that JSON, else the text as a
/// string), then `</tool_call>` (or the end of the answer). Returns the name, the arguments
/// and the bytes used.
fn glm_call(after: &str) -> Option<(String, Value, usize)> {
    const KEY: &str = "<arg_key>";
    const KEY_END: &str = "</arg_key>";
    const VALUE: &str = "<arg_value>";
    const VALUE_END: &str = "</arg_value>";
    const CLOSE: &str = "</tool_call>";
    let body_end = after.find(CLOSE);
    let body = &after[..body_end.unwrap_or(after.len())];
    let name_end = body.find(KEY).unwrap_or(body.len());
    let name = body[..name_end].trim();
    if name.is_empty() || !valid_name(name) {
        return None;
    }
    let mut args = serde_json::Map::new();
    let mut rest = &body[name_end..];
    while let Some(k) = rest.trim_start().strip_prefix(KEY) {
        let (key, after_key) = k.split_once(KEY_END)?;
        let v = after_key.trim_start().strip_prefix(VALUE)?;
        let (value, tail) = v.split_once(VALUE_END)?;
        let parsed = serde_json::from_str::<Value>(value)
            .unwrap_or_else(|_| Value::String(value.to_string()));
        args.insert(key.trim().to_string(), parsed);
        rest = tail;
    }
    if !rest.trim().is_empty() {
        return None;
    }
    let used = body_end.map_or(after.len(), |e| e + CLOSE.len());
    Some((name.to_string(), Value::Object(args), used))
}

/// Gemma 4's calls in `text`, each `<|tool_call>call:NAME{…}<tool_call|>` (or ending the
/// text where the closing marker is missing) that `call_of` takes, and the text around them.
/// A marker whose call does not read stays in the text.
fn gemma_calls(
    text: &str,
    call_of: impl Fn(&Value) -> Option<ToolCall>,
) -> (String, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(gemma::CALL_OPEN) {
        let after = &rest[start + gemma::CALL_OPEN.len()..];
        let parsed = gemma::call_header(after).and_then(|(name, at)| {
            let (args, used) = gemma::arguments(&after[at..])?;
            let args = serde_json::from_str::<Value>(&args).ok()?;
            let tail = &after[at + used..];
            let ws = tail.len() - tail.trim_start().len();
            let used = if tail.trim_start().starts_with(gemma::CALL_CLOSE) {
                at + used + ws + gemma::CALL_CLOSE.len()
            } else if tail.trim().is_empty() {
                after.len()
            } else {
                return None;
            };
            call_of(&json!({"name": name, "arguments": args})).map(|c| (c, used))
        });
        match parsed {
            Some((c, used)) => {
                content.push_str(&rest[..start]);
                calls.push(c);
                rest = &after[used..];
            }
            None => {
                content.push_str(&rest[..start + gemma::CALL_OPEN.len()]);
                rest = after;
            }
        }
    }
    content.push_str(rest);
    (content, calls)
}

/// Mistral's calls: the text before the first `[TOOL_CALLS]`, and each call as `{"name",
/// "arguments"}` — `[TOOL_CALLS]NAME[ARGS]{…}` per call (`[CALL_ID]ID` may come before
/// `[ARGS]`), or one `[TOOL_CALLS]` followed by a JSON list of calls. `None` when there is
/// no marker or what follows it does not read as calls.
fn mistral_calls(text: &str) -> Option<(&str, Vec<Value>)> {
    const MARK: &str = "[TOOL_CALLS]";
    const ARGS: &str = "[ARGS]";
    const ID: &str = "[CALL_ID]";
    let start = text.find(MARK)?;
    let mut rest = &text[start..];
    let mut calls = Vec::new();
    while let Some(r) = rest.strip_prefix(MARK) {
        let r = r.trim_start();
        if r.starts_with('[') {
            // The older layout: a JSON list of calls.
            let mut de = serde_json::Deserializer::from_str(r).into_iter::<Value>();
            let Some(Ok(Value::Array(list))) = de.next() else {
                return None;
            };
            calls.extend(list);
            rest = r[de.byte_offset()..].trim_start();
            continue;
        }
        let (name, after) = r.split_once(ARGS)?;
        let name = name.split(ID).next().unwrap_or(name).trim();
        let mut de = serde_json::Deserializer::from_str(after).into_iter::<Value>();
        let Some(Ok(args)) = de.next() else {
            return None;
        };
        calls.push(json!({"name": name, "arguments": args}));
        rest = after[de.byte_offset()..].trim_start();
    }
    rest.is_empty().then_some((&text[..start], calls))
}

/// What an answer streams as, once its tool calls are picked out as they are generated.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    /// Text outside any call.
    Text(String),
    /// A call of this function begins; its arguments follow.
    Start(String),
    /// More of the open call's arguments (JSON text).
    Args(String),
    /// The open call's arguments are complete.
    End,
}

/// Picks Hermes-tagged calls out of an answer as it streams: text outside calls goes on at
/// once (a possible start of `<tool_call>` held back), and a call's arguments stream as soon
/// as its name is known, up to their closing brace. A call that does not read as
/// `{"name": …, "arguments": {…}}` is not streamed; the answer's final parse
/// ([`Tools::parse_output`]) still finds it, and callers send what the stream missed.
pub struct CallStreamer {
    known: Vec<String>,
    buf: String,
    state: StreamState,
    /// The arguments of the Gemma 4 call being read (`StreamState::GemmaArgs`).
    gemma: gemma::Args,
    /// The text of a call not (yet) followed, from its `<tool_call>`: text again if it turns
    /// out to be no call.
    raw: String,
    /// Whether any text has gone out: an answer that opens with `{` is held whole, since it
    /// may be a bare JSON call (Llama 3's), which only the final parse can tell.
    emitted: bool,
    /// The layout of the call being read, when it is DeepSeek V3.1's or Kimi K2's: what
    /// closes it after its arguments.
    section: Option<&'static Section>,
}

enum StreamState {
    Text,
    /// After `<tool_call>`, before the arguments.
    Header,
    /// Inside the arguments object: nesting depth, inside a string, after a backslash.
    Args {
        depth: usize,
        in_str: bool,
        esc: bool,
    },
    /// After the arguments, until the call's closing tag.
    Tail(&'static str),
    /// After Mistral's `[TOOL_CALLS]`, before `[ARGS]`: the name (and any `[CALL_ID]`).
    MistralHeader,
    /// After Gemma 4's `<|tool_call>`, before the arguments: `call:NAME`.
    GemmaHeader,
    /// Inside a Gemma 4 call's arguments, read into JSON as they come.
    GemmaArgs,
    /// At a DeepSeek V3.1 or Kimi K2 call's marker, before its arguments (the marker held).
    SectionHeader(&'static Section),
    /// After such a call's arguments: its closing markers, if they come.
    After(&'static Section),
    /// In a DSML block, between calls.
    DsmlInvoke,
    /// In a DSML call, between parameters; `first`: none written yet.
    DsmlParams {
        first: bool,
    },
    /// Not a call this streamer can follow: the rest waits for the final parse.
    Lost,
}

const OPEN_TAG: &str = "<tool_call>";
const CLOSE_TAG: &str = "</tool_call>";
/// Mistral's call marker (a control token its answers keep, see `AnswerFormat::Mistral`).
const MISTRAL_TAG: &str = "[TOOL_CALLS]";
/// Where a call may begin, in each layout the stream follows.
const CALL_TAGS: [&str; 8] = [
    OPEN_TAG,
    MISTRAL_TAG,
    gemma::CALL_OPEN,
    dsml::BLOCK,
    dsml::DEEPSEEK.section,
    dsml::DEEPSEEK.call,
    dsml::KIMI.section,
    dsml::KIMI.call,
];

impl CallStreamer {
    pub fn new(tools: &Tools) -> CallStreamer {
        CallStreamer {
            known: tools.specs.iter().map(|s| s.name.clone()).collect(),
            buf: String::new(),
            state: StreamState::Text,
            gemma: gemma::Args::new(),
            raw: String::new(),
            emitted: false,
            section: None,
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<ToolEvent> {
        self.buf.push_str(delta);
        let mut out = Vec::new();
        loop {
            let progressed = match self.state {
                StreamState::Text => self.text(&mut out),
                StreamState::Header => self.header(&mut out),
                StreamState::MistralHeader => self.mistral_header(&mut out),
                StreamState::GemmaHeader => self.gemma_header(&mut out),
                StreamState::Args { .. } => self.args(&mut out),
                StreamState::GemmaArgs => self.gemma_args(&mut out),
                StreamState::SectionHeader(m) => self.section_header(m, &mut out),
                StreamState::After(m) => match m.closing(&self.buf) {
                    Read::Done((), n) => {
                        self.buf.drain(..n);
                        self.state = StreamState::Text;
                        true
                    }
                    Read::More | Read::No => false,
                },
                StreamState::DsmlInvoke => self.dsml_invoke(&mut out),
                StreamState::DsmlParams { first } => self.dsml_params(first, &mut out),
                StreamState::Tail(close) => match self.buf.find(close) {
                    Some(i) => {
                        self.buf.drain(..i + close.len());
                        self.state = StreamState::Text;
                        true
                    }
                    None => false,
                },
                StreamState::Lost => {
                    self.raw.push_str(&self.buf);
                    self.buf.clear();
                    false
                }
            };
            if !progressed {
                return out;
            }
        }
    }

    /// The text still held back at the end of the answer (a caller whose final parse finds
    /// calls the stream did not show drops it: it was their text).
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let text = match self.state {
            StreamState::Text => std::mem::take(&mut self.buf),
            // A call never followed: its text as it came.
            StreamState::Header
            | StreamState::MistralHeader
            | StreamState::GemmaHeader
            | StreamState::SectionHeader(_)
            | StreamState::Lost => {
                let mut t = std::mem::take(&mut self.raw);
                t.push_str(&std::mem::take(&mut self.buf));
                t
            }
            // A block that ended between calls: what it held was its own (a block that never
            // began a call is its text).
            StreamState::DsmlInvoke if self.raw.is_empty() => String::new(),
            StreamState::DsmlInvoke => {
                let mut t = std::mem::take(&mut self.raw);
                t.push_str(&std::mem::take(&mut self.buf));
                t
            }
            StreamState::Args { .. }
            | StreamState::GemmaArgs
            | StreamState::Tail(_)
            | StreamState::After(_)
            | StreamState::DsmlParams { .. } => String::new(),
        };
        if text.is_empty() {
            Vec::new()
        } else {
            vec![ToolEvent::Text(text)]
        }
    }

    fn text(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let head = self.buf.trim_start();
        if !self.emitted && (head.is_empty() || head.starts_with('{')) {
            return false;
        }
        let first = CALL_TAGS
            .iter()
            .filter_map(|t| self.buf.find(t).map(|i| (i, *t)))
            .min();
        if let Some((i, tag)) = first {
            if i > 0 {
                self.emitted = true;
                out.push(ToolEvent::Text(self.buf[..i].to_string()));
            }
            self.section = dsml::SECTIONS
                .into_iter()
                .find(|m| m.openers().contains(&tag));
            if let Some(m) = self.section {
                // The header reads from the marker on.
                self.buf.drain(..i);
                self.raw.clear();
                self.state = StreamState::SectionHeader(m);
                return true;
            }
            self.buf.drain(..i + tag.len());
            self.raw = tag.to_string();
            self.state = match tag {
                OPEN_TAG => StreamState::Header,
                MISTRAL_TAG => StreamState::MistralHeader,
                dsml::BLOCK => StreamState::DsmlInvoke,
                _ => StreamState::GemmaHeader,
            };
            return true;
        }
        // Hold back the longest tail that could begin a tag.
        let keep = (1..self.buf.len() + 1)
            .rev()
            .find(|&n| {
                self.buf.is_char_boundary(self.buf.len() - n)
                    && CALL_TAGS
                        .iter()
                        .any(|t| n < t.len() && t.starts_with(&self.buf[self.buf.len() - n..]))
            })
            .unwrap_or(0);
        let cut = self.buf.len() - keep;
        if cut > 0 {
            self.emitted = true;
            out.push(ToolEvent::Text(self.buf[..cut].to_string()));
            self.buf.drain(..cut);
        }
        false
    }

    fn header(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let h = self.buf.trim_start();
        // `{"name": "…", "arguments": {`, with any spacing.
        let parsed = (|| {
            let rest = h.strip_prefix('{')?.trim_start();
            let rest = rest.strip_prefix("\"name\"")?.trim_start();
            let rest = rest.strip_prefix(':')?.trim_start();
            let rest = rest.strip_prefix('"')?;
            let end = rest.find('"')?;
            let name = &rest[..end];
            let rest = rest[end + 1..].trim_start().strip_prefix(',')?.trim_start();
            let rest = rest.strip_prefix("\"arguments\"")?.trim_start();
            let rest = rest.strip_prefix(':')?.trim_start();
            rest.starts_with('{')
                .then(|| (name.to_string(), h.len() - rest.len()))
        })();
        match parsed {
            Some((name, used)) if self.known.contains(&name) => {
                let skip = self.buf.len() - h.len() + used;
                self.buf.drain(..skip);
                self.raw.clear();
                out.push(ToolEvent::Start(name));
                self.state = StreamState::Args {
                    depth: 0,
                    in_str: false,
                    esc: false,
                };
                true
            }
            Some(_) => {
                self.state = StreamState::Lost;
                true
            }
            // Still arriving; a header this long is not the expected one.
            None if h.len() > 256 || h.contains('}') => {
                self.state = StreamState::Lost;
                true
            }
            None => false,
        }
    }

    /// `NAME[ARGS]` (or `NAME[CALL_ID]ID[ARGS]`) after `[TOOL_CALLS]`: the call starts once
    /// `[ARGS]` has come and the name is a known function. The older JSON-list layout, or an
    /// unknown name, is left to the final parse.
    fn mistral_header(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        const ARGS: &str = "[ARGS]";
        if self.buf.trim_start().starts_with('[') && !self.buf.trim_start().starts_with(ARGS) {
            self.state = StreamState::Lost;
            return true;
        }
        let Some(at) = self.buf.find(ARGS) else {
            if self.buf.len() > 256 {
                self.state = StreamState::Lost;
                return true;
            }
            return false;
        };
        let head = &self.buf[..at];
        let name = head.split("[CALL_ID]").next().unwrap_or(head).trim();
        if !self.known.iter().any(|k| k == name) {
            self.state = StreamState::Lost;
            return true;
        }
        out.push(ToolEvent::Start(name.to_string()));
        self.buf.drain(..at + ARGS.len());
        // `raw` keeps the marker only to say which layout the arguments end.
        self.raw = MISTRAL_TAG.to_string();
        self.state = StreamState::Args {
            depth: 0,
            in_str: false,
            esc: false,
        };
        true
    }

    /// `call:NAME{` after Gemma 4's `<|tool_call>`: the call starts at the arguments' brace
    /// when the name is a known function; otherwise the call is left to the final parse.
    fn gemma_header(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let Some((name, at)) = gemma::call_header(&self.buf) else {
            let head = self.buf.trim_start();
            let prefix = gemma::CALL_PREFIX;
            let may_come = if head.len() < prefix.len() {
                prefix.starts_with(head)
            } else {
                head.starts_with(prefix)
            };
            if !may_come || self.buf.len() > 256 {
                self.state = StreamState::Lost;
                return true;
            }
            return false;
        };
        if !self.known.iter().any(|k| k == name) {
            self.state = StreamState::Lost;
            return true;
        }
        out.push(ToolEvent::Start(name.to_string()));
        self.buf.drain(..at);
        self.raw.clear();
        self.gemma = gemma::Args::new();
        self.state = StreamState::GemmaArgs;
        true
    }

    /// A DeepSeek V3.1 or Kimi K2 call's header: the call starts at its arguments when the
    /// name is a known function; otherwise the call is left to the final parse.
    fn section_header(&mut self, m: &'static Section, out: &mut Vec<ToolEvent>) -> bool {
        match m.header(&self.buf) {
            Read::Done(name, at) if self.known.iter().any(|k| k == name) => {
                out.push(ToolEvent::Start(name.to_string()));
                self.buf.drain(..at);
                self.state = StreamState::Args {
                    depth: 0,
                    in_str: false,
                    esc: false,
                };
                true
            }
            Read::Done(..) | Read::No => {
                self.state = StreamState::Lost;
                true
            }
            Read::More => false,
        }
    }

    /// Between calls in a DSML block: the next call of a known function starts (its
    /// arguments' JSON opens), or the block ends. Anything else is left to the final parse.
    fn dsml_invoke(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        match dsml::invoke(&self.buf) {
            Read::Done(None, n) => {
                self.buf.drain(..n);
                self.raw.clear();
                self.state = StreamState::Text;
                true
            }
            Read::Done(Some(name), n) if self.known.iter().any(|k| k == name) => {
                out.push(ToolEvent::Start(name.to_string()));
                out.push(ToolEvent::Args("{".into()));
                self.buf.drain(..n);
                self.raw.clear();
                self.state = StreamState::DsmlParams { first: true };
                true
            }
            Read::Done(Some(_), _) | Read::No => {
                self.state = StreamState::Lost;
                true
            }
            Read::More => false,
        }
    }

    /// A DSML call's parameters, each written as JSON once it is whole. A parameter that
    /// does not read ends the call there (the final parse does not take it).
    fn dsml_params(&mut self, first: bool, out: &mut Vec<ToolEvent>) -> bool {
        match dsml::parameter(&self.buf) {
            Read::Done(None, n) => {
                self.buf.drain(..n);
                out.push(ToolEvent::Args("}".into()));
                out.push(ToolEvent::End);
                self.state = StreamState::DsmlInvoke;
                true
            }
            Read::Done(Some((key, value)), n) => {
                self.buf.drain(..n);
                let sep = if first { "" } else { "," };
                out.push(ToolEvent::Args(format!(
                    "{sep}{}:{value}",
                    Value::String(key)
                )));
                self.state = StreamState::DsmlParams { first: false };
                true
            }
            Read::No => {
                out.push(ToolEvent::End);
                self.state = StreamState::Lost;
                true
            }
            Read::More => false,
        }
    }

    /// A Gemma 4 call's arguments, as JSON as far as they have come. Arguments that stop
    /// reading as Gemma's notation end the call there (the final parse does not take it) and
    /// the rest of them, up to the call's closing tag, is dropped.
    fn gemma_args(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let mut json = String::new();
        let read = self.gemma.push(&self.buf, &mut json);
        if !json.is_empty() {
            out.push(ToolEvent::Args(json));
        }
        match read {
            Ok(None) => {
                self.buf.clear();
                false
            }
            Ok(Some(used)) => {
                self.buf.drain(..used);
                out.push(ToolEvent::End);
                self.state = StreamState::Tail(gemma::CALL_CLOSE);
                true
            }
            Err(gemma::Malformed) => {
                out.push(ToolEvent::End);
                self.state = StreamState::Tail(gemma::CALL_CLOSE);
                true
            }
        }
    }

    fn args(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let StreamState::Args {
            mut depth,
            mut in_str,
            mut esc,
        } = self.state
        else {
            return false;
        };
        let mut end = None;
        for (i, c) in self.buf.char_indices() {
            if in_str {
                match (esc, c) {
                    (true, _) => esc = false,
                    (false, '\\') => esc = true,
                    (false, '"') => in_str = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => in_str = true,
                '{' | '[' => depth += 1,
                '}' | ']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let upto = end.unwrap_or(self.buf.len());
        if upto > 0 {
            out.push(ToolEvent::Args(self.buf[..upto].to_string()));
            self.buf.drain(..upto);
        }
        if end.is_some() {
            out.push(ToolEvent::End);
            // Hermes closes the call with a tag, DeepSeek and Kimi with markers they may leave
            // out; Mistral's next call, or text, just follows.
            self.state = if let Some(m) = self.section {
                StreamState::After(m)
            } else if self.raw == MISTRAL_TAG {
                StreamState::Text
            } else {
                StreamState::Tail(CLOSE_TAG)
            };
            return true;
        }
        self.state = StreamState::Args { depth, in_str, esc };
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Tools {
        let t = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
        parse(Some(&t), Some(&choice)).unwrap().unwrap()
    }

    #[test]
    fn hermes_and_llama3_calls_are_parsed() {
        let t = tools(json!("auto"));
        let (c, calls) = t.parse_output(
            "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        );
        assert_eq!(c.as_deref(), Some("Sure."));
        assert_eq!(
            calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into()
            }]
        );
        let (c, calls) =
            t.parse_output("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}");
        assert_eq!((c, calls.len()), (None, 1));
        // The closing tag inside an argument string does not end the call.
        let (_, calls) = t.parse_output(
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"</tool_call>\"}}</tool_call>",
        );
        assert_eq!(calls[0].arguments, "{\"city\":\"</tool_call>\"}");
        // Unknown functions and broken JSON stay text.
        let (c, calls) =
            t.parse_output("<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>");
        assert!(calls.is_empty() && c.is_some());
    }

    /// GLM-4.5's and Mistral's layouts, as their chat templates render calls.
    #[test]
    fn glm_and_mistral_calls_are_parsed() {
        let t = tools(json!("auto"));
        let want = |city: &str| ToolCall {
            name: "get_weather".into(),
            arguments: json!({"city": city}).to_string(),
        };
        let (c, calls) = t.parse_output(
            "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        );
        assert_eq!(
            (c.as_deref(), calls),
            (Some("Checking."), vec![want("Paris")])
        );
        // A value that reads as JSON is that JSON.
        let (_, calls) = t.parse_output(
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>{\"a\": [1]}</arg_value></tool_call>",
        );
        assert_eq!(calls[0].arguments, "{\"city\":{\"a\":[1]}}");
        let (c, calls) = t.parse_output(
            "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}",
        );
        assert_eq!((c, calls), (None, vec![want("Rome"), want("Oslo")]));
        let (c, calls) = t.parse_output(
            "Let me see.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": \"Rome\"}",
        );
        assert_eq!(
            (c.as_deref(), calls),
            (Some("Let me see."), vec![want("Rome")])
        );
        let (_, calls) = t.parse_output(
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}]",
        );
        assert_eq!(calls, vec![want("Lima")]);
        // Unknown functions and broken layouts stay text.
        for text in [
            "[TOOL_CALLS]nope[ARGS]{}",
            "[TOOL_CALLS]get_weather[ARGS]{\"city\"",
            "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>",
        ] {
            let (c, calls) = t.parse_output(text);
            assert!(calls.is_empty() && c.is_some(), "{text}");
        }
        // Mistral's calls stream as they are generated, in any split.
        let answer = "Sure. [TOOL_CALLS]get_weather[CALL_ID]x1[ARGS]{\"city\": \"Pa}ris\"}[TOOL_CALLS]get_weather[ARGS]{}";
        for step in [1, 2, 5, answer.len()] {
            let mut s = CallStreamer::new(&t);
            let mut ev = Vec::new();
            let mut rest = answer;
            while !rest.is_empty() {
                let cut = step.min(rest.len());
                ev.extend(s.push(&rest[..cut]));
                rest = &rest[cut..];
            }
            ev.extend(s.finish());
            let (mut text, mut calls) = (String::new(), Vec::<(String, String)>::new());
            for e in ev {
                match e {
                    ToolEvent::Text(x) => text.push_str(&x),
                    ToolEvent::Start(n) => calls.push((n, String::new())),
                    ToolEvent::Args(a) => calls.last_mut().unwrap().1.push_str(&a),
                    ToolEvent::End => {}
                }
            }
            assert_eq!(text, "Sure. ", "step {step}");
            assert_eq!(
                calls,
                vec![
                    (
                        "get_weather".to_string(),
                        "{\"city\": \"Pa}ris\"}".to_string()
                    ),
                    ("get_weather".to_string(), "{}".to_string())
                ],
                "step {step}"
            );
        }
        // The older JSON list is left to the final parse.
        let mut s = CallStreamer::new(&t);
        let ev = s.push("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {}}]");
        assert!(ev.is_empty(), "{ev:?}");
    }

    /// The answer streamed `step` bytes at a time through a [`CallStreamer`]: its text, and
    /// its calls as (name, arguments text).
    fn streamed(t: &Tools, answer: &str, step: usize) -> (String, Vec<(String, String)>) {
        let mut s = CallStreamer::new(t);
        let mut ev = Vec::new();
        let mut rest = answer;
        while !rest.is_empty() {
            let mut cut = step.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            ev.extend(s.push(&rest[..cut]));
            rest = &rest[cut..];
        }
        ev.extend(s.finish());
        let (mut text, mut calls) = (String::new(), Vec::<(String, String)>::new());
        for e in ev {
            match e {
                ToolEvent::Text(x) => text.push_str(&x),
                ToolEvent::Start(n) => calls.push((n, String::new())),
                ToolEvent::Args(a) => calls.last_mut().unwrap().1.push_str(&a),
                ToolEvent::End => {}
            }
        }
        (text, calls)
    }

    /// Gemma 4's calls as its chat template writes them: the arguments' notation read into
    /// JSON (a string holding braces, quotes and commas; nesting; a list with null), the text
    /// before them kept, a call cut off after its arguments still a call; unknown functions
    /// and broken notation stay text; streamed in any split, the same calls.
    #[test]
    fn gemma4_calls_are_parsed_and_streamed() {
        let t = tools(json!("auto"));
        let want = |args: Value| ToolCall {
            name: "get_weather".into(),
            arguments: args.to_string(),
        };
        let first = json!({"city": "Pa}ris, \"FR\" 🦀", "days": 3,
            "opts": {"max": -1.5, "metric": true, "tags": ["a", null]}});
        let answer =
            "Let me check. <|tool_call>call:get_weather{city:<|\"|>Pa}ris, \"FR\" 🦀<|\"|>,\
            days:3,opts:{max:-1.5,metric:true,tags:[<|\"|>a<|\"|>,null]}}<tool_call|>\
            <|tool_call>call:get_weather{}<tool_call|>";
        let (c, calls) = t.parse_output(answer);
        assert_eq!(c.as_deref(), Some("Let me check."));
        assert_eq!(calls, vec![want(first.clone()), want(json!({}))]);
        let (c, calls) = t.parse_output("<|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}");
        assert_eq!((c, calls), (None, vec![want(json!({"city": "Oslo"}))]));
        for text in [
            "<|tool_call>call:nope{}<tool_call|>",
            "<|tool_call>call:get_weather{city:Oslo}<tool_call|>",
            "<|tool_call>call:get_weather{city:None}<tool_call|>",
            "<|tool_call>call:get_weather{city:<|\"|>Os",
            "<|tool_call>get_weather{}<tool_call|>",
            "<|tool_call>call:get_weather{} and more<tool_call|>",
        ] {
            let (c, calls) = t.parse_output(text);
            assert!(calls.is_empty() && c.is_some(), "{text}");
        }
        for step in [1, 2, 3, 5, 8, answer.len()] {
            let (text, calls) = streamed(&t, answer, step);
            assert_eq!(text, "Let me check. ", "step {step}");
            let got: Vec<(String, Value)> = calls
                .into_iter()
                .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
                .collect();
            assert_eq!(
                got,
                vec![
                    ("get_weather".to_string(), first.clone()),
                    ("get_weather".to_string(), json!({}))
                ],
                "step {step}"
            );
        }
        // Arguments that stop reading end the call where they stop; the text after the
        // call goes on. An unknown function is left to the final parse, as text.
        for step in [1, 4, 100] {
            let (text, calls) = streamed(
                &t,
                "A<|tool_call>call:get_weather{city:Oslo}<tool_call|>B",
                step,
            );
            assert_eq!(text, "AB", "step {step}");
            assert_eq!(
                calls,
                vec![("get_weather".into(), "{\"city\":".into())],
                "step {step}"
            );
            let unknown = "<|tool_call>call:nope{}<tool_call|>";
            assert_eq!(streamed(&t, unknown, step), (unknown.to_string(), vec![]));
        }
    }

    #[test]
    fn choices_are_checked() {
        let t = json!([{"type": "function", "function": {"name": "f"}}]);
        assert!(parse(
            Some(&t),
            Some(&json!({"type": "function", "function": {"name": "g"}}))
        )
        .is_err());
        assert!(parse(None, Some(&json!("required"))).is_err());
        assert!(parse(
            Some(&json!([{"type": "function", "function": {"name": "bad name"}}])),
            None
        )
        .is_err());
        assert!(tools(json!("required"))
            .grammar()
            .unwrap()
            .contains("%json"));
        assert!(tools(json!("auto")).grammar().is_none());
    }

    #[test]
    fn calls_stream_as_they_are_generated_in_any_split() {
        let t = tools(json!("auto"));
        let answer = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris\", \"n\": [1, {\"a\": \"\\\"\"}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 2, 3, 7, answer.len()] {
            let (text, calls) = streamed(&t, answer, step);
            // The newline between the calls is text too.
            assert_eq!(text, "Let me look.\n\n", "step {step}");
            let (_, parsed) = t.parse_output(answer);
            assert_eq!(calls.len(), 2, "step {step}");
            for (c, p) in calls.iter().zip(&parsed) {
                assert_eq!(c.0, p.name);
                let a: Value = serde_json::from_str(&c.1).unwrap();
                assert_eq!(a.to_string(), p.arguments, "step {step}");
            }
        }
        // An unknown function, or another layout, is left to the final parse.
        let mut s = CallStreamer::new(&t);
        let ev = s.push("<tool_call>{\"arguments\": {}, \"name\": \"get_weather\"}</tool_call>");
        assert!(
            ev.iter().all(|e| !matches!(e, ToolEvent::Start(_))),
            "{ev:?}"
        );
        let mut s = CallStreamer::new(&t);
        assert_eq!(
            s.push("plain <tool"),
            vec![ToolEvent::Text("plain ".into())]
        );
        assert_eq!(s.finish(), vec![ToolEvent::Text("<tool".into())]);
    }
}
