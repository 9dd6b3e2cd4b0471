//! Gemma 4's call syntax, as its chat template writes calls and the model answers them:
//! `<|tool_call>call:NAME{key:value,…}<tool_call|>`, whose arguments are Gemma's own notation —
//! strings between `<|"|>` markers (taken as they are: no escapes inside), numbers, `true`,
//! `false` and `null` bare, objects `{k:v}` with bare keys, lists `[…]` — read here into the
//! JSON text OpenAI's `arguments` carry. [`Args`] reads them as they arrive, so that the
//! streamed arguments and the whole answer's parse are the same text.

/// Opens a call; `call:NAME` and the arguments follow.
pub const CALL_OPEN: &str = "<|tool_call>";
/// Closes a call.
pub const CALL_CLOSE: &str = "<tool_call|>";
/// What comes between the call marker and the function's name.
pub const CALL_PREFIX: &str = "call:";
/// Opens and closes a string.
const QUOTE: &str = "<|\"|>";

/// Arguments that do not read as Gemma's notation (or nest deeper than a JSON reader takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

/// Below serde_json's nesting limit (128), so that what is read here always reads back.
const MAX_DEPTH: usize = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    Object,
    List,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the opening `{`.
    Start,
    /// Where a key goes; `close_ok`: the object is still empty, so `}` may end it.
    Key { close_ok: bool },
    /// Inside a bare key, up to its `:` (held in `pending`).
    BareKey,
    /// After a `<|"|>`-quoted key, before its `:`.
    Colon,
    /// Where a value goes; `close_ok`: a list still empty, so `]` may end it.
    Value { close_ok: bool },
    /// Part of a `<|"|>` marker read (in `pending`), opening a key or a value string.
    Marker { key: bool },
    /// Inside a string; `pending` holds what may be the start of its closing marker (and, for
    /// a key, the key so far).
    Str { key: bool },
    /// A bare number, `true`, `false` or `null` (held in `pending` until it ends).
    Bare,
    /// After a value: a comma, or the end of its object or list.
    After,
    /// The outermost object has closed.
    Done,
}

/// Gemma's argument notation read into JSON text, a piece at a time.
#[derive(Debug, Clone)]
pub struct Args {
    stack: Vec<Frame>,
    state: State,
    pending: String,
}

impl Default for Args {
    fn default() -> Self {
        Args::new()
    }
}

/// `s` as the inside of a JSON string.
fn escape_into(out: &mut String, s: &str) {
    let quoted = serde_json::Value::String(s.to_string()).to_string();
    out.push_str(&quoted[1..quoted.len() - 1]);
}

impl Args {
    pub fn new() -> Args {
        Args {
            stack: Vec::new(),
            state: State::Start,
            pending: String::new(),
        }
    }

    /// Whether the outermost object has closed.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Reads `input` on from where the last piece ended, appending the JSON text it makes to
    /// `out`; once the outermost object closes, the bytes of `input` it took (the rest is not
    /// the arguments'), else `None`. Text that may still change meaning (a bare value, a key,
    /// a possible end of a string) is held until it cannot.
    pub fn push(&mut self, input: &str, out: &mut String) -> Result<Option<usize>, Malformed> {
        for (i, c) in input.char_indices() {
            if self.state == State::Done {
                return Ok(Some(i));
            }
            self.step(c, out)?;
        }
        if let State::Str { key: false } = self.state {
            // What cannot be the start of the closing marker is the string's text.
            let keep = held_marker_prefix(&self.pending);
            let cut = self.pending.len() - keep;
            if cut > 0 {
                escape_into(out, &self.pending[..cut]);
                self.pending.drain(..cut);
            }
        }
        Ok(self.done().then_some(input.len()))
    }

    fn step(&mut self, c: char, out: &mut String) -> Result<(), Malformed> {
        match self.state {
            State::Start => match c {
                '{' => self.open(Frame::Object, out)?,
                c if c.is_whitespace() => {}
                _ => return Err(Malformed),
            },
            State::Key { close_ok } => match c {
                '}' if close_ok => self.close(Frame::Object, out)?,
                '<' => {
                    self.pending.push(c);
                    self.state = State::Marker { key: true };
                }
                c if c.is_whitespace() => {}
                ':' | ',' | '{' | '}' | '[' | ']' => return Err(Malformed),
                c => {
                    self.pending.push(c);
                    self.state = State::BareKey;
                }
            },
            State::BareKey => match c {
                ':' => {
                    let key = self.pending.trim();
                    if key.is_empty() {
                        return Err(Malformed);
                    }
                    out.push('"');
                    escape_into(out, key);
                    out.push_str("\":");
                    self.pending.clear();
                    self.state = State::Value { close_ok: false };
                }
                ',' | '{' | '}' | '[' | ']' => return Err(Malformed),
                c => self.pending.push(c),
            },
            State::Colon => match c {
                ':' => {
                    out.push('"');
                    escape_into(out, &self.pending);
                    out.push_str("\":");
                    self.pending.clear();
                    self.state = State::Value { close_ok: false };
                }
                c if c.is_whitespace() => {}
                _ => return Err(Malformed),
            },
            State::Value { close_ok } => match c {
                '{' => self.open(Frame::Object, out)?,
                '[' => self.open(Frame::List, out)?,
                ']' if close_ok => self.close(Frame::List, out)?,
                '<' => {
                    self.pending.push(c);
                    self.state = State::Marker { key: false };
                }
                c if c.is_whitespace() => {}
                ',' | ':' | '}' | ']' => return Err(Malformed),
                c => {
                    self.pending.push(c);
                    self.state = State::Bare;
                }
            },
            State::Marker { key } => {
                self.pending.push(c);
                if self.pending == QUOTE {
                    self.pending.clear();
                    if !key {
                        out.push('"');
                    }
                    self.state = State::Str { key };
                } else if !QUOTE.starts_with(self.pending.as_str()) {
                    return Err(Malformed);
                }
            }
            State::Str { key } => {
                self.pending.push(c);
                if let Some(text) = self.pending.strip_suffix(QUOTE) {
                    if key {
                        let key = text.to_string();
                        self.pending = key;
                        self.state = State::Colon;
                    } else {
                        escape_into(out, text);
                        out.push('"');
                        self.pending.clear();
                        self.state = State::After;
                    }
                }
            }
            State::Bare => {
                if c == ',' || c == '}' || c == ']' || c.is_whitespace() {
                    match serde_json::from_str::<serde_json::Value>(&self.pending) {
                        Ok(
                            serde_json::Value::Number(_)
                            | serde_json::Value::Bool(_)
                            | serde_json::Value::Null,
                        ) => out.push_str(&self.pending),
                        _ => return Err(Malformed),
                    }
                    self.pending.clear();
                    self.state = State::After;
                    self.step(c, out)?;
                } else {
                    self.pending.push(c);
                }
            }
            State::After => match c {
                ',' => {
                    out.push(',');
                    self.state = match self.stack.last() {
                        Some(Frame::Object) => State::Key { close_ok: false },
                        _ => State::Value { close_ok: false },
                    };
                }
                '}' => self.close(Frame::Object, out)?,
                ']' => self.close(Frame::List, out)?,
                c if c.is_whitespace() => {}
                _ => return Err(Malformed),
            },
            State::Done => {}
        }
        Ok(())
    }

    fn open(&mut self, frame: Frame, out: &mut String) -> Result<(), Malformed> {
        if self.stack.len() >= MAX_DEPTH {
            return Err(Malformed);
        }
        self.stack.push(frame);
        match frame {
            Frame::Object => {
                out.push('{');
                self.state = State::Key { close_ok: true };
            }
            Frame::List => {
                out.push('[');
                self.state = State::Value { close_ok: true };
            }
        }
        Ok(())
    }

    fn close(&mut self, frame: Frame, out: &mut String) -> Result<(), Malformed> {
        if self.stack.pop() != Some(frame) {
            return Err(Malformed);
        }
        out.push(if frame == Frame::Object { '}' } else { ']' });
        self.state = if self.stack.is_empty() {
            State::Done
        } else {
            State::After
        };
        Ok(())
    }
}

/// The longest end of `s` that may begin the string marker.
fn held_marker_prefix(s: &str) -> usize {
    (1..QUOTE.len())
        .rev()
        .find(|&k| {
            s.len() >= k && s.is_char_boundary(s.len() - k) && QUOTE.starts_with(&s[s.len() - k..])
        })
        .unwrap_or(0)
}

/// Whole arguments at the start of `s` (after optional whitespace): their JSON text and the
/// bytes they took. `None` when they do not read, or end unclosed.
pub fn arguments(s: &str) -> Option<(String, usize)> {
    let mut a = Args::new();
    let mut out = String::new();
    let used = a.push(s, &mut out).ok()??;
    Some((out, used))
}

/// What follows a call marker: `call:NAME{`, as the function's name and the bytes before
/// its arguments' `{`. `None` when it is not that (or not yet all there).
pub fn call_header(s: &str) -> Option<(&str, usize)> {
    let rest = s.trim_start().strip_prefix(CALL_PREFIX)?;
    let brace = rest.find('{')?;
    let name = rest[..brace].trim();
    Some((name, s.len() - rest.len() + brace))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// Gemma's notation, as its chat template writes arguments, read back into the JSON
    /// values that made it: nesting, lists, numbers, booleans, null, and strings with
    /// quotes, backslashes, newlines, braces, colons, commas and non-ASCII text.
    #[test]
    fn arguments_read_as_json() {
        let text = "{cabins:null,dates:[<|\"|>2026-05-01<|\"|>,<|\"|>2026-05-08<|\"|>],\
                    direct:true,max_price:450.5,Note:<|\"|>say \"hi\" \\ then\nleave, {a:b}<|\"|>,\
                    passengers:2,route:{from:<|\"|>CDG<|\"|>,to:<|\"|>Zürich 🦀<|\"|>},e:-1.5e3,\
                    empty:{},none:[]}<tool_call|>";
        let (json_text, used) = arguments(text).unwrap();
        assert_eq!(&text[used..], "<tool_call|>");
        let v: Value = serde_json::from_str(&json_text).unwrap();
        assert_eq!(
            v,
            json!({"cabins": null, "dates": ["2026-05-01", "2026-05-08"], "direct": true,
                "max_price": 450.5, "Note": "say \"hi\" \\ then\nleave, {a:b}", "passengers": 2,
                "route": {"from": "CDG", "to": "Zürich 🦀"}, "e": -1.5e3, "empty": {}, "none": []})
        );
        // Spacing, and a quoted key (the template's `escape_keys`).
        let (j, _) = arguments(" { a : 1 , <|\"|>b c<|\"|> : [ 1 , false ] } ").unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&j).unwrap(),
            json!({"a": 1, "b c": [1, false]})
        );
    }

    /// What is not Gemma's notation is refused: a bare word, Python's `None`, a trailing
    /// comma, unbalanced brackets, JSON's quoted strings, and arguments cut short.
    #[test]
    fn malformed_arguments_are_refused() {
        for text in [
            "{city:Paris}",
            "{a:None}",
            "{a:1,}",
            "{a:[1,]}",
            "{a:1]",
            "{a:[1}",
            "{\"a\":\"b\"}",
            "{a:<|\"|>open",
            "{a:1",
            "[1]",
            "{:1}",
            "{a:01}",
        ] {
            assert!(arguments(text).is_none(), "{text}");
        }
        let deep = format!("{}{}", "{a:".repeat(200), "}".repeat(200));
        assert!(arguments(&deep).is_none());
    }

    /// Read a piece at a time, in any cut, the JSON text is the same as read whole: nothing
    /// let out early (the start of a marker in a string) turns out wrong.
    #[test]
    fn pieces_make_the_whole() {
        let text = "{q:<|\"|>a<|\"b <|\"|>,n:[1,2.5,{x:<|\"|><|\"|>}],t:true}rest";
        let (whole, used) = arguments(text).unwrap();
        assert_eq!(&text[used..], "rest");
        for step in 1..text.len() {
            let mut a = Args::new();
            let mut out = String::new();
            let mut at = 0;
            let mut end = None;
            while at < text.len() && end.is_none() {
                let mut cut = (at + step).min(text.len());
                while !text.is_char_boundary(cut) {
                    cut += 1;
                }
                end = a.push(&text[at..cut], &mut out).unwrap().map(|n| at + n);
                assert!(whole.starts_with(&out), "step {step}: {out}");
                at = cut;
            }
            assert_eq!(
                (out.as_str(), end),
                (whole.as_str(), Some(used)),
                "step {step}"
            );
        }
        assert_eq!(
            serde_json::from_str::<Value>(&whole).unwrap(),
            json!({"q": "a<|\"b ", "n": [1, 2.5, {"x": ""}], "t": true})
        );
    }

    #[test]
    fn headers() {
        assert_eq!(
            call_header("call:get_weather{city"),
            Some(("get_weather", 16))
        );
        assert_eq!(call_header("call:get_wea"), None);
        assert_eq!(call_header("{city:1}"), None);
    }
}
