//! The call layouts of DeepSeek V3.1 and Kimi K2 (calls between control tokens, JSON
//! arguments) and DeepSeek V3.2's DSML markup (arguments as tagged parameters), as their chat
//! templates write calls and the models answer them. The pieces here read a call from the
//! front of a text, telling a call cut short (more may come) from one that is no call, so that
//! the whole answer's parse and the stream read the same calls.

use serde_json::{Map, Value};

/// A layout of calls between control tokens with JSON arguments:
/// `SECTION (CALL header ARGS {…} CALL_END)… SECTION_END`.
#[derive(Debug)]
pub struct Section {
    /// Opens the calls (optional before a call: Kimi K2 Thinking may leave it out).
    pub section: &'static str,
    pub section_end: &'static str,
    /// Opens one call; its header (the function's name) follows.
    pub call: &'static str,
    /// Between the header and the JSON arguments.
    pub args: &'static str,
    /// Closes one call (optional: the answer may end, or the next call follow, without it).
    pub call_end: &'static str,
    /// The function's name in a header.
    pub name: fn(&str) -> Option<&str>,
}

/// DeepSeek V3.1 (and V3/R1's markers): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME
/// <｜tool▁sep｜>{…}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`.
pub const DEEPSEEK: Section = Section {
    section: "<｜tool▁calls▁begin｜>",
    section_end: "<｜tool▁calls▁end｜>",
    call: "<｜tool▁call▁begin｜>",
    args: "<｜tool▁sep｜>",
    call_end: "<｜tool▁call▁end｜>",
    name: deepseek_name,
};

/// Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
/// <|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`.
pub const KIMI: Section = Section {
    section: "<|tool_calls_section_begin|>",
    section_end: "<|tool_calls_section_end|>",
    call: "<|tool_call_begin|>",
    args: "<|tool_call_argument_begin|>",
    call_end: "<|tool_call_end|>",
    name: kimi_name,
};

pub const SECTIONS: [&Section; 2] = [&DEEPSEEK, &KIMI];

/// The header is the name itself; DeepSeek's R1-era `function` type prefix is not accepted
/// here (its arguments are a fenced block, left to no parse).
fn deepseek_name(h: &str) -> Option<&str> {
    let h = h.trim();
    valid(h).then_some(h)
}

/// `functions.NAME:IDX`, the id Kimi K2's template gives each call; a bare `NAME` or
/// `NAME:IDX` is taken too.
fn kimi_name(h: &str) -> Option<&str> {
    let h = h.trim();
    let h = h.strip_prefix("functions.").unwrap_or(h);
    let h = match h.rsplit_once(':') {
        Some((n, idx)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => h,
    };
    valid(h).then_some(h)
}

fn valid(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// What reading the front of a text found.
#[derive(Debug, Clone, PartialEq)]
pub enum Read<T> {
    /// This, and the bytes it took.
    Done(T, usize),
    /// The text so far could still become it.
    More,
    /// It is not there.
    No,
}

/// `s` with `prefix` taken off its front (after whitespace when `ws`): the bytes taken, or
/// whether `s` could still grow into it.
fn expect(s: &str, prefix: &str, ws: bool) -> Read<()> {
    let t = if ws { s.trim_start() } else { s };
    let skipped = s.len() - t.len();
    if t.starts_with(prefix) {
        Read::Done((), skipped + prefix.len())
    } else if prefix.starts_with(t) {
        Read::More
    } else {
        Read::No
    }
}

impl Section {
    /// Where the next call of this layout may begin in `s` (its section or call marker).
    pub fn find(&self, s: &str) -> Option<usize> {
        [self.section, self.call]
            .iter()
            .filter_map(|m| s.find(m))
            .min()
    }

    /// The markers a call of this layout begins with.
    pub fn openers(&self) -> [&'static str; 2] {
        [self.section, self.call]
    }

    /// A call's opening up to its arguments, from the front of `s` (which starts at its
    /// section or call marker): the function's name and the bytes up to the arguments.
    pub fn header<'a>(&self, s: &'a str) -> Read<&'a str> {
        let mut at = 0;
        if s.starts_with(self.section) {
            at = self.section.len();
        } else if self.section.starts_with(s) && !self.call.starts_with(s) {
            return Read::More;
        }
        match expect(&s[at..], self.call, true) {
            Read::Done((), n) => at += n,
            Read::More => return Read::More,
            Read::No => return Read::No,
        }
        let rest = &s[at..];
        let Some(end) = rest.find(self.args) else {
            // A header longer than any name is no header.
            return if rest.len() > 256 {
                Read::No
            } else {
                Read::More
            };
        };
        match (self.name)(&rest[..end]) {
            Some(name) => Read::Done(name, at + end + self.args.len()),
            None => Read::No,
        }
    }

    /// After a call's arguments: its closing marker and the section's, when there (their
    /// bytes), or whether more may yet close it.
    pub fn closing(&self, s: &str) -> Read<()> {
        let mut at = 0;
        for m in [self.call_end, self.section_end] {
            match expect(&s[at..], m, true) {
                Read::Done((), n) => at += n,
                Read::More => return Read::More,
                Read::No => {}
            }
        }
        Read::Done((), at)
    }

    /// The calls of this layout in `text` that `call_of` takes, and the text around them.
    /// A marker whose call does not read stays in the text.
    pub fn calls(
        &self,
        text: &str,
        call_of: impl Fn(&Value) -> Option<crate::tools::ToolCall>,
    ) -> (String, Vec<crate::tools::ToolCall>) {
        let mut calls = Vec::new();
        let mut content = String::new();
        let mut rest = text;
        while let Some(start) = self.find(rest) {
            let s = &rest[start..];
            let call = match self.header(s) {
                Read::Done(name, at) => {
                    let mut de = serde_json::Deserializer::from_str(&s[at..]).into_iter::<Value>();
                    match de.next() {
                        Some(Ok(args)) => {
                            let at = at + de.byte_offset();
                            let used = match self.closing(&s[at..]) {
                                Read::Done((), n) => at + n,
                                // Whitespace, or the start of a marker, ends the answer.
                                Read::More | Read::No => s.len(),
                            };
                            call_of(&serde_json::json!({"name": name, "arguments": args}))
                                .map(|c| (c, used))
                        }
                        _ => None,
                    }
                }
                _ => None,
            };
            match call {
                Some((c, used)) => {
                    content.push_str(&rest[..start]);
                    calls.push(c);
                    rest = &s[used..];
                }
                None => {
                    let marker = if s.starts_with(self.section) {
                        self.section
                    } else {
                        self.call
                    };
                    content.push_str(&rest[..start + marker.len()]);
                    rest = &s[marker.len()..];
                }
            }
        }
        content.push_str(rest);
        (content, calls)
    }
}

/// DeepSeek V3.2's DSML markup: `<｜DSML｜function_calls>`, then per call
/// `<｜DSML｜invoke name="NAME">` and its parameters, each
/// `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` (a string's text as
/// it is; any other value as JSON), `</｜DSML｜invoke>`, and `</｜DSML｜function_calls>`.
pub const BLOCK: &str = "<｜DSML｜function_calls>";
const BLOCK_END: &str = "</｜DSML｜function_calls>";
const INVOKE: &str = "<｜DSML｜invoke name=\"";
const INVOKE_END: &str = "</｜DSML｜invoke>";
const PARAM: &str = "<｜DSML｜parameter name=\"";
const PARAM_END: &str = "</｜DSML｜parameter>";

/// Between calls in a DSML block: the next call's name and the bytes of its opening tag, or
/// `Done(None, n)` at the block's end.
pub fn invoke(s: &str) -> Read<Option<&str>> {
    match expect(s, BLOCK_END, true) {
        Read::Done((), n) => return Read::Done(None, n),
        Read::More => return Read::More,
        Read::No => {}
    }
    let at = match expect(s, INVOKE, true) {
        Read::Done((), n) => n,
        Read::More => return Read::More,
        Read::No => return Read::No,
    };
    let rest = &s[at..];
    match rest.find("\">") {
        Some(end) if valid(&rest[..end]) => Read::Done(Some(&rest[..end]), at + end + 2),
        Some(_) => Read::No,
        None if rest.len() > 128 || rest.contains('<') => Read::No,
        None => Read::More,
    }
}

/// Inside a DSML call: its next parameter (name and value) and its bytes, or `Done(None, n)`
/// at the call's end.
pub fn parameter(s: &str) -> Read<Option<(String, Value)>> {
    match expect(s, INVOKE_END, true) {
        Read::Done((), n) => return Read::Done(None, n),
        Read::More => return Read::More,
        Read::No => {}
    }
    let at = match expect(s, PARAM, true) {
        Read::Done((), n) => n,
        Read::More => return Read::More,
        Read::No => return Read::No,
    };
    let rest = &s[at..];
    let Some(gt) = rest.find('>') else {
        return if rest.len() > 256 {
            Read::No
        } else {
            Read::More
        };
    };
    // `K" string="true|false"`
    let head = &rest[..gt];
    let Some((key, attrs)) = head.split_once('"') else {
        return Read::No;
    };
    let string = match attrs.trim() {
        "string=\"true\"" => true,
        "string=\"false\"" => false,
        _ => return Read::No,
    };
    let body = &rest[gt + 1..];
    let Some(end) = body.find(PARAM_END) else {
        return Read::More;
    };
    let text = &body[..end];
    let value = if string {
        Value::String(text.to_string())
    } else {
        serde_json::from_str(text.trim()).unwrap_or_else(|_| Value::String(text.to_string()))
    };
    Read::Done(
        Some((key.to_string(), value)),
        at + gt + 1 + end + PARAM_END.len(),
    )
}

/// The DSML calls in `text` that `call_of` takes, and the text around them. A block that does
/// not read, or holds a call `call_of` does not take, stays in the text; a block the answer
/// ends inside keeps the calls it completed.
pub fn calls(
    text: &str,
    call_of: impl Fn(&Value) -> Option<crate::tools::ToolCall>,
) -> (String, Vec<crate::tools::ToolCall>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(BLOCK) {
        let s = &rest[start..];
        match block(&s[BLOCK.len()..], &call_of) {
            Some((found, used)) => {
                content.push_str(&rest[..start]);
                calls.extend(found);
                rest = &s[BLOCK.len() + used..];
            }
            None => {
                content.push_str(&rest[..start + BLOCK.len()]);
                rest = &s[BLOCK.len()..];
            }
        }
    }
    content.push_str(rest);
    (content, calls)
}

/// The calls of one block after its opening tag, and the bytes they take.
fn block(
    s: &str,
    call_of: &impl Fn(&Value) -> Option<crate::tools::ToolCall>,
) -> Option<(Vec<crate::tools::ToolCall>, usize)> {
    let mut found = Vec::new();
    let mut at = 0;
    loop {
        let name = match invoke(&s[at..]) {
            Read::Done(None, n) => return Some((found, at + n)),
            Read::Done(Some(name), n) => {
                at += n;
                name
            }
            // The answer ended between calls.
            Read::More if !found.is_empty() => return Some((found, s.len())),
            Read::More | Read::No => return None,
        };
        let mut args = Map::new();
        loop {
            match parameter(&s[at..]) {
                Read::Done(None, n) => {
                    at += n;
                    break;
                }
                Read::Done(Some((k, v)), n) => {
                    at += n;
                    args.insert(k, v);
                }
                // Cut off after its last parameter: still the call.
                Read::More if s[at..].trim().is_empty() => {
                    at = s.len();
                    break;
                }
                Read::More | Read::No => return None,
            }
        }
        found.push(call_of(
            &serde_json::json!({"name": name, "arguments": args}),
        )?);
        if at == s.len() {
            return Some((found, at));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_headers() {
        assert_eq!(kimi_name("functions.get_weather:0"), Some("get_weather"));
        assert_eq!(kimi_name("get_weather:12"), Some("get_weather"));
        assert_eq!(kimi_name("get_weather"), Some("get_weather"));
        assert_eq!(kimi_name("functions.a b:0"), None);
        assert_eq!(deepseek_name(" get_weather "), Some("get_weather"));
        assert_eq!(deepseek_name(""), None);
    }

    #[test]
    fn dsml_pieces_read_or_wait() {
        assert_eq!(invoke("\n<｜DSML｜inv"), Read::More);
        let open = "\n<｜DSML｜invoke name=\"f\">";
        assert_eq!(
            invoke(&format!("{open}\n")),
            Read::Done(Some("f"), open.len())
        );
        assert_eq!(invoke(BLOCK_END), Read::Done(None, BLOCK_END.len()));
        assert_eq!(invoke("text"), Read::No);
        let p = "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n";
        assert_eq!(
            parameter(p),
            Read::Done(Some(("days".into(), Value::from(3))), p.len() - 1)
        );
        assert_eq!(parameter(&p[..p.len() - 8]), Read::More);
        assert_eq!(
            parameter("<｜DSML｜parameter name=\"x\" strung=\"1\">1</｜DSML｜parameter>"),
            Read::No
        );
    }
}
