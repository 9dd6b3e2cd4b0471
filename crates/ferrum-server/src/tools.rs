//! Tool calling: the request's `tools` and `tool_choice`, how they reach the prompt, the
//! grammar that enforces a required or named call, and parsing calls out of the answer.
//!
//! The call format is Hermes/Qwen's — `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`
//! — which Qwen2.5/Qwen3 templates produce themselves; a template that does not render
//! tools gets the same instructions as a system message. Llama 3's bare JSON
//! (`{"name": …, "parameters": {…}}`) is recognised in answers too.

use serde_json::{json, Value};

use crate::error::ApiError;

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

    /// For `required` and a named function: a grammar (llguidance's Lark) that admits exactly
    /// one call of an allowed function with arguments matching its schema.
    pub fn grammar(&self) -> Option<String> {
        let allowed: Vec<&ToolSpec> = match &self.choice {
            ToolChoice::Required => self.specs.iter().collect(),
            ToolChoice::Named(n) => self.specs.iter().filter(|s| &s.name == n).collect(),
            _ => return None,
        };
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
                    tail.trim_start()
                        .starts_with(CLOSE)
                        .then(|| (call_of(&v), values.byte_offset() + ws + CLOSE.len()))
                }
                _ => None,
            };
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
}
