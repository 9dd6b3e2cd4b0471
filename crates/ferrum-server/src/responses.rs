//! OpenAI's Responses API (`POST /v1/responses`), stateless: `store: true` and
//! `previous_response_id` are refused (no responses are kept). A request is translated into
//! the chat request the rest of the server runs ([`crate::api::ChatRequest`]: `instructions`
//! and input items — messages, `function_call`, `function_call_output` — as messages and tool
//! calls, function tools, `text.format` as `response_format`, `max_output_tokens`), and the
//! engine's events back into output items (reasoning, message, function_call) and the
//! Responses stream events, each with its `sequence_number`.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrum_generate::FinishReason;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::answer::{Answer, AnswerStream, Piece};
use crate::api;
use crate::error::ApiError;
use crate::routes::{self, AppState, Choice};

const FIELDS: &[&str] = &[
    "model",
    // ferrum's extension, as in Chat Completions.
    "speculative",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "user",
    "truncation",
    "include",
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
    "prompt_cache_options",
    "prompt_cache_retention",
    "stream_options",
    "max_tool_calls",
    "top_logprobs",
    "context_management",
    "conversation",
    "background",
    "background_options",
    "prompt",
    "moderation",
    "image",
    "access_programs",
];

/// Fields refused when set: they ask for state, work or checks kept on OpenAI's side.
const REFUSED: &[(&str, &str)] = &[
    (
        "conversation",
        "this server keeps no conversations: send the whole conversation in input",
    ),
    (
        "prompt",
        "stored prompt templates are not supported: send instructions and input",
    ),
    (
        "moderation",
        "moderation is not supported: this server runs no moderation model",
    ),
];

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::param(param, message)
}

/// The text of a message's content: a string, or text parts.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    api::text_parts(v, &["input_text", "output_text", "text"], &["refusal"]).map_err(|e| match e {
        api::PartsError::Part { index, kind } => bad(
            "input",
            format!("{at}.content[{index}]: parts of type {kind:?} are not supported"),
        ),
        api::PartsError::Shape => bad(
            "input",
            format!("{at}.content: a string or a list of parts"),
        ),
    })
}

/// A message's content: its text, or, where it has `input_image` parts, Chat Completions'
/// parts (text and `image_url`, in order).
fn content_of(v: &Value, at: &str) -> Result<Value, ApiError> {
    let parts = match v {
        Value::Array(p) if p.iter().any(|p| p["type"] == "input_image") => p,
        _ => return Ok(Value::String(text_of(v, at)?)),
    };
    let mut out = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        match p.get("type").and_then(Value::as_str) {
            Some("input_image") => {
                if p.get("file_id").is_some_and(|f| !f.is_null()) {
                    return Err(bad(
                        "input",
                        format!("{at}.content[{j}]: file_id images need OpenAI's file store: send image_url"),
                    ));
                }
                let url = p.get("image_url").and_then(Value::as_str).ok_or_else(|| {
                    bad(
                        "input",
                        format!("{at}.content[{j}].image_url: a string is required"),
                    )
                })?;
                let mut image = json!({"url": url});
                if let Some(d) = p.get("detail").filter(|d| !d.is_null()) {
                    image["detail"] = d.clone();
                }
                out.push(json!({"type": "image_url", "image_url": image}));
            }
            _ => {
                let text = text_of(&Value::Array(vec![p.clone()]), &format!("{at}[{j}]"))?;
                out.push(json!({"type": "text", "text": text}));
            }
        }
    }
    Ok(Value::Array(out))
}

/// The Responses request as the chat request the server runs (Chat Completions' shape).
fn to_chat(body: &Map<String, Value>, template: &str) -> Result<Value, ApiError> {
    for (field, why) in REFUSED {
        if body.get(*field).is_some_and(|v| !v.is_null()) {
            return Err(bad(field, *why));
        }
    }
    if body.get("background").and_then(Value::as_bool) == Some(true) {
        return Err(bad(
            "background",
            "background responses are not supported: this server keeps no responses (stream \
             instead)",
        ));
    }
    // Log-probabilities are Chat Completions' here: asking for them is refused, 0 is taken.
    let wants_logprobs = body
        .get("include")
        .and_then(Value::as_array)
        .is_some_and(|i| i.iter().any(|x| x == "message.output_text.logprobs"));
    if wants_logprobs {
        return Err(bad(
            "include",
            "message.output_text.logprobs is not supported in the Responses API here (Chat \
             Completions has log-probabilities)",
        ));
    }
    match body
        .get("top_logprobs")
        .filter(|v| !v.is_null())
        .map(Value::as_u64)
    {
        None | Some(Some(0)) => {}
        Some(Some(_)) => {
            return Err(bad(
                "top_logprobs",
                "log-probabilities are not supported in the Responses API here (Chat \
                 Completions has them)",
            ))
        }
        Some(_) => return Err(bad("top_logprobs", "top_logprobs must be 0..=20")),
    }
    if body.get("store").and_then(Value::as_bool) == Some(true) {
        return Err(bad(
            "store",
            "this server keeps no responses: send store: false (or leave it out)",
        ));
    }
    if body
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(bad(
            "previous_response_id",
            "this server keeps no responses: send the whole conversation in input",
        ));
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(i) = body.get("instructions").filter(|v| !v.is_null()) {
        let text = i
            .as_str()
            .ok_or_else(|| bad("instructions", "instructions must be a string"))?;
        messages.push(json!({"role": "system", "content": text}));
    }
    let mut calls_seen: HashSet<String> = HashSet::new();
    let mut pending_reasoning = String::new();
    match body.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let kind = it.get("type").and_then(Value::as_str).unwrap_or("message");
                match kind {
                    "message" => {
                        let role = match it.get("role").and_then(Value::as_str) {
                            Some("developer") => "system",
                            Some(r @ ("user" | "system" | "assistant")) => r,
                            other => {
                                return Err(bad("input", format!("{at}.role: {other:?}")));
                            }
                        };
                        let content = content_of(it.get("content").unwrap_or(&Value::Null), &at)?;
                        messages.push(json!({"role": role, "content": content}));
                    }
                    "function_call" => {
                        let call_id = it.get("call_id").and_then(Value::as_str).unwrap_or("");
                        let name = it.get("name").and_then(Value::as_str).unwrap_or("");
                        let args = it.get("arguments").and_then(Value::as_str).unwrap_or("{}");
                        if call_id.is_empty() || name.is_empty() {
                            return Err(bad(
                                "input",
                                format!("{at}: a function_call needs call_id and name"),
                            ));
                        }
                        calls_seen.insert(call_id.to_string());
                        let call = json!({"id": call_id, "type": "function",
                            "function": {"name": name, "arguments": args}});
                        // Consecutive calls belong to one assistant turn.
                        match messages.last_mut() {
                            Some(m) if m["role"] == "assistant" => {
                                let list = m
                                    .as_object_mut()
                                    .map(|o| o.entry("tool_calls").or_insert(json!([])));
                                if let Some(Value::Array(a)) = list {
                                    a.push(call);
                                }
                            }
                            _ => messages.push(
                                json!({"role": "assistant", "content": "", "tool_calls": [call]}),
                            ),
                        }
                    }
                    "function_call_output" => {
                        let call_id = it.get("call_id").and_then(Value::as_str).unwrap_or("");
                        if !calls_seen.contains(call_id) {
                            return Err(bad(
                                "input",
                                format!("{at}: function_call_output for call_id {call_id:?}, which no earlier function_call has"),
                            ));
                        }
                        let output = match it.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v @ Value::Array(_)) => text_of(v, &at)?,
                            _ => {
                                return Err(bad(
                                    "input",
                                    format!("{at}.output: a string is required"),
                                ))
                            }
                        };
                        messages.push(
                            json!({"role": "tool", "tool_call_id": call_id, "content": output}),
                        );
                    }
                    // Reasoning goes with the assistant turn it precedes (templates drop it
                    // from turns before the last answer; harmony keeps a call's).
                    "reasoning" => {
                        let parts = it.get("content").and_then(Value::as_array);
                        let text: String = parts
                            .into_iter()
                            .flatten()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect();
                        if !text.is_empty() {
                            pending_reasoning.push_str(&text);
                        }
                    }
                    other => {
                        return Err(bad(
                            "input",
                            format!("{at}: items of type {other:?} are not supported"),
                        ))
                    }
                }
                if kind != "reasoning" && !pending_reasoning.is_empty() {
                    let text = std::mem::take(&mut pending_reasoning);
                    if let Some(Value::Object(m)) = messages.last_mut() {
                        if m.get("role").and_then(Value::as_str) == Some("assistant") {
                            m.entry("reasoning_content").or_insert(text.into());
                        }
                    }
                }
            }
        }
        _ => {
            return Err(bad(
                "input",
                "input: a string or a list of items is required",
            ))
        }
    }
    let mut chat = Map::new();
    chat.insert(
        "model".into(),
        body.get("model").cloned().unwrap_or(Value::Null),
    );
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        let list = tools
            .as_array()
            .ok_or_else(|| bad("tools", "tools must be a list"))?;
        let mut out = Vec::new();
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(
                    "tools",
                    format!(
                        "tools[{i}]: only function tools are supported, not {:?}",
                        t["type"]
                    ),
                ));
            }
            let mut f = json!({"name": t["name"], "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"}))});
            for k in ["description", "strict"] {
                if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                    f[k] = v.clone();
                }
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    if let Some(tc) = body.get("tool_choice").filter(|t| !t.is_null()) {
        let choice = match tc {
            Value::String(_) => tc.clone(),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
                json!({"type": "function", "function": {"name": o.get("name")}})
            }
            _ => {
                return Err(bad(
                    "tool_choice",
                    "tool_choice: auto, none, required or a function",
                ))
            }
        };
        chat.insert("tool_choice".into(), choice);
    }
    if let Some(p) = body.get("parallel_tool_calls").filter(|v| !v.is_null()) {
        chat.insert("parallel_tool_calls".into(), p.clone());
    }
    // At most one call a turn is what parallel_tool_calls: false asks for; none, no tools.
    match body.get("max_tool_calls").and_then(Value::as_u64) {
        Some(0)
            if chat
                .get("tool_choice")
                .is_some_and(|c| c != "none" && c != "auto") =>
        {
            return Err(bad(
                "max_tool_calls",
                "max_tool_calls 0 allows no call, and tool_choice requires one",
            ))
        }
        Some(0) => {
            chat.insert("tool_choice".into(), json!("none"));
        }
        Some(1) => {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
        _ => {}
    }
    if let Some(format) = body
        .get("text")
        .filter(|t| !t.is_null())
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null())
    {
        let rf = match format.get("type").and_then(Value::as_str) {
            Some("text") => json!({"type": "text"}),
            Some("json_object") => json!({"type": "json_object"}),
            Some("json_schema") => {
                let mut js = json!({"name": format.get("name").cloned().unwrap_or(json!("response")),
                    "schema": format.get("schema").cloned().unwrap_or(Value::Null)});
                if let Some(s) = format.get("strict") {
                    js["strict"] = s.clone();
                }
                json!({"type": "json_schema", "json_schema": js})
            }
            other => {
                return Err(bad(
                    "text",
                    format!("text.format.type {other:?} (text, json_object or json_schema)"),
                ))
            }
        };
        chat.insert("response_format".into(), rf);
    }
    // A template with a thinking switch (Qwen3's `enable_thinking`) follows the effort.
    if let Some(effort) = body
        .get("reasoning")
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
    {
        api::set_thinking(&mut chat, template, !matches!(effort, "none" | "minimal"));
        chat.insert("reasoning_effort".into(), effort.into());
    }
    api::copy_fields(
        body,
        &mut chat,
        &[
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("stream", "stream"),
            ("speculative", "speculative"),
        ],
    );
    Ok(Value::Object(chat))
}

/// Parses and translates a body for a model whose chat template is `template`; returns the
/// chat request and the body (whose settings the response echoes).
pub fn parse(
    bytes: &[u8],
    template: &str,
) -> Result<(api::ChatRequest, Map<String, Value>), ApiError> {
    let obj = api::object(bytes, FIELDS, false)?;
    let chat = to_chat(&obj, template)?;
    let req =
        api::parse(chat.to_string().as_bytes(), api::CHAT_FIELDS, true).map_err(|mut e| {
            // Name the Responses field, not the chat one it became.
            e.param = e.param.map(|p| match p.as_str() {
                "max_tokens" => "max_output_tokens".into(),
                "messages" => "input".into(),
                "response_format" => "text".into(),
                _ => p,
            });
            e
        })?;
    Ok((req, obj))
}

pub async fn create(State(st): State<Arc<AppState>>, b: Result<Bytes, BytesRejection>) -> Response {
    let r = create_inner(st.clone(), b).await;
    routes::respond(&st, r)
}

/// The response object around `output` (the request's settings echoed, as OpenAI does).
fn envelope(
    id: &str,
    created: u64,
    body: &Map<String, Value>,
    model: &str,
    status: &str,
    output: Vec<Value>,
    usage: Value,
) -> Value {
    let get = |k: &str, d: Value| body.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(d);
    json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "error": null,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "instructions": get("instructions", Value::Null),
        "max_output_tokens": get("max_output_tokens", Value::Null),
        "model": model, "output": output,
        "parallel_tool_calls": get("parallel_tool_calls", json!(true)),
        "previous_response_id": null,
        "reasoning": get("reasoning", json!({"effort": null, "summary": null})),
        "store": false,
        "temperature": get("temperature", json!(1.0)),
        "text": get("text", json!({"format": {"type": "text"}})),
        "tool_choice": get("tool_choice", json!("auto")),
        "tools": get("tools", json!([])),
        "top_p": get("top_p", json!(1.0)),
        "truncation": get("truncation", json!("disabled")),
        "usage": usage,
        "user": get("user", Value::Null),
        "metadata": get("metadata", json!({})),
    })
}

fn usage(c: &Choice) -> Value {
    let u = c.usage;
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn status(c: &Choice) -> &'static str {
    match c.finish {
        Some(FinishReason::Length) => "incomplete",
        _ => "completed",
    }
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
        "content": [{"type": "reasoning_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, call_id: &str, name: &str, args: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
        "arguments": args, "status": status})
}

async fn create_inner(
    st: Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let bytes = routes::body(b)?;
    let template = st.tokenizer.chat_template().map_or("", |t| t.source());
    let (req, body) = parse(&bytes, template)?;
    let p = routes::prepare_chat(&st, &req).await?;
    st.check_load()?;
    let mut rx = routes::launch(&st, vec![p.plan.base.clone()]).await?;
    let id = st.new_id("resp").replace('-', "_");
    let created = routes::now();
    let model = p.card.id.clone();
    if !p.plan.stream {
        let out = routes::collect(rx, 1).await?;
        routes::record(&st, &id, t0, &out, 1);
        let c = &out[0];
        let it = Answer::of(p.reading, p.tools.as_ref(), &c.text);
        let mut output = Vec::new();
        if let Some(r) = &it.reasoning {
            output.push(reasoning_item(&new_id(&st, "rs"), r, "completed"));
        }
        if !it.text.is_empty() || it.calls.is_empty() {
            output.push(message_item(&new_id(&st, "msg"), &it.text, "completed"));
        }
        for c in &it.calls {
            let (fc, call) = (new_id(&st, "fc"), new_id(&st, "call"));
            output.push(call_item(&fc, &call, &c.name, &c.arguments, "completed"));
        }
        return Ok(Json(envelope(
            &id,
            created,
            &body,
            &model,
            status(c),
            output,
            usage(c),
        ))
        .into_response());
    }
    let (tx, events) = mpsc::unbounded_channel::<Event>();
    tokio::spawn(async move {
        let mut w = Writer {
            tx,
            seq: 0,
            output: Vec::new(),
            open: None,
            call_open: None,
        };
        let shell = envelope(
            &id,
            created,
            &body,
            &model,
            "in_progress",
            Vec::new(),
            Value::Null,
        );
        if !w.send("response.created", json!({"response": shell}))
            || !w.send("response.in_progress", json!({"response": shell}))
        {
            return;
        }
        let mut answer = AnswerStream::new(p.reading, p.tools.as_ref());
        let Some(choice) = answer.drive(&mut rx, |piece| w.piece(&st, piece)).await else {
            return;
        };
        let calls = answer.calls();
        routes::record(&st, &id, t0, std::slice::from_ref(&choice), 1);
        // An empty answer is still a message.
        if calls == 0 && w.output.is_empty() && w.open.is_none() && !w.open_item(&st, Kind::Message)
        {
            return;
        }
        if !w.close() {
            return;
        }
        let done = envelope(
            &id,
            created,
            &body,
            &model,
            status(&choice),
            w.output.clone(),
            usage(&choice),
        );
        let _ = w.send("response.completed", json!({"response": done}));
    });
    let stream = UnboundedReceiverStream::new(events).map(Ok::<_, Infallible>);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response())
}

fn new_id(st: &AppState, prefix: &str) -> String {
    st.new_id(prefix).replace('-', "_")
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
}

/// Writes output items as Responses stream events: a reasoning or message item opened at
/// its first piece (`output_item.added`, `content_part.added`) and closed (`…done`) when the
/// other kind follows or at the end; function calls whole at the end.
struct Writer {
    tx: mpsc::UnboundedSender<Event>,
    seq: u64,
    /// Finished items, for `response.completed`.
    output: Vec<Value>,
    /// The open item: kind, id, text so far.
    open: Option<(Kind, String, String)>,
    /// The open function call: item id, call id, name, arguments so far.
    call_open: Option<(String, String, String, String)>,
}

impl Writer {
    fn send(&mut self, kind: &str, mut v: Value) -> bool {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.tx
            .send(Event::default().event(kind).data(v.to_string()))
            .is_ok()
    }

    /// Closes the open item (a call cut short included).
    fn close(&mut self) -> bool {
        if self.call_open.is_some() {
            // Cut short (max_output_tokens) before its arguments closed.
            return self.end_call("incomplete");
        }
        let Some((kind, id, text)) = self.open.take() else {
            return true;
        };
        let index = self.output.len();
        let ok = match kind {
            Kind::Reasoning => self.send(
                "response.reasoning_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            ),
            Kind::Message => {
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                self.send("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}))
                    && self.send("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}))
            }
        };
        let item = match kind {
            Kind::Reasoning => reasoning_item(&id, &text, "completed"),
            Kind::Message => message_item(&id, &text, "completed"),
        };
        let ok = ok
            && self.send(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
        self.output.push(item);
        ok
    }

    /// A piece of text for an item of `kind` (an empty piece opens nothing).
    fn text(&mut self, st: &AppState, kind: Kind, piece: &str) -> bool {
        if piece.is_empty() {
            return true;
        }
        self.open_item(st, kind) && self.push(kind, piece)
    }

    /// Opens an item of `kind` unless one is open (closing another kind first).
    fn open_item(&mut self, st: &AppState, kind: Kind) -> bool {
        if self.open.as_ref().map(|o| o.0) != Some(kind) {
            if !self.close() {
                return false;
            }
            let index = self.output.len();
            let (id, ok) = match kind {
                Kind::Reasoning => {
                    let id = new_id(st, "rs");
                    let ok = self.send("response.output_item.added", json!({"output_index": index, "item": reasoning_item(&id, "", "in_progress")}));
                    (id, ok)
                }
                Kind::Message => {
                    let id = new_id(st, "msg");
                    let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
                    let ok = self.send("response.output_item.added", json!({"output_index": index, "item": message_item(&id, "", "in_progress")}))
                        && self.send("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}));
                    (id, ok)
                }
            };
            if !ok {
                return false;
            }
            self.open = Some((kind, id, String::new()));
        }
        true
    }

    fn push(&mut self, kind: Kind, piece: &str) -> bool {
        let index = self.output.len();
        let Some((_, id, text)) = self.open.as_mut() else {
            return true;
        };
        text.push_str(piece);
        let id = id.clone();
        match kind {
            Kind::Reasoning => self.send("response.reasoning_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": piece})),
            Kind::Message => self.send("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": piece, "logprobs": []})),
        }
    }

    /// One piece of the answer: reasoning and text into their items, each call a
    /// function_call item whose arguments stream as `function_call_arguments.delta`s.
    fn piece(&mut self, st: &AppState, piece: Piece) -> bool {
        match piece {
            Piece::Reasoning(r) => self.text(st, Kind::Reasoning, &r),
            Piece::Text(x) => self.text(st, Kind::Message, &x),
            Piece::CallStart(name) => {
                let (id, call_id) = (new_id(st, "fc"), new_id(st, "call"));
                let item = call_item(&id, &call_id, &name, "", "in_progress");
                let ok = self.close()
                    && self.send(
                        "response.output_item.added",
                        json!({"output_index": self.output.len(), "item": item}),
                    );
                self.call_open = Some((id, call_id, name, String::new()));
                ok
            }
            Piece::CallArgs(a) => match self.call_open.as_mut() {
                Some((id, _, _, args)) => {
                    args.push_str(&a);
                    let v = json!({"item_id": id, "output_index": self.output.len(), "delta": a});
                    self.send("response.function_call_arguments.delta", v)
                }
                None => true,
            },
            Piece::CallEnd => self.end_call("completed"),
            Piece::Call(c) => self.call(st, &c.name, &c.arguments),
        }
    }

    fn end_call(&mut self, status: &str) -> bool {
        let Some((id, call_id, name, args)) = self.call_open.take() else {
            return true;
        };
        let index = self.output.len();
        let item = call_item(&id, &call_id, &name, &args, status);
        let ok = self.send(
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "name": name, "arguments": args}),
        ) && self.send(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.output.push(item);
        ok
    }

    fn call(&mut self, st: &AppState, name: &str, args: &str) -> bool {
        if !self.close() {
            return false;
        }
        let index = self.output.len();
        let (id, call_id) = (new_id(st, "fc"), new_id(st, "call"));
        let ok = self.send("response.output_item.added", json!({"output_index": index, "item": call_item(&id, &call_id, name, "", "in_progress")}))
            && self.send("response.function_call_arguments.delta", json!({"item_id": id, "output_index": index, "delta": args}))
            && self.send("response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "name": name, "arguments": args}));
        let item = call_item(&id, &call_id, name, args, "completed");
        let ok = ok
            && self.send(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
        self.output.push(item);
        ok
    }
}
