//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), the one
//! Claude Code and the `anthropic` SDKs speak. A request is translated into the chat request
//! the rest of the server runs ([`crate::api::ChatRequest`]: system text, text / tool_use /
//! tool_result blocks as messages and tool calls, `input_schema` tools, `tool_choice`,
//! `stop_sequences`), and the engine's events back into Anthropic's message and stream
//! events. Errors come in Anthropic's shape: `{"type": "error", "error": {type, message}}`.

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
use crate::tools::ToolCall;

pub const FIELDS: &[&str] = &[
    "model",
    // ferrum's extension, as in Chat Completions.
    "speculative",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
    "service_tier",
    "output_config",
    "cache_control",
    "speed",
    "inference_geo",
    "diagnostics",
    "container",
    // The beta endpoint's (same path, `anthropic-beta` header).
    "context_management",
    "compaction",
    "mcp_servers",
    "fallbacks",
    "billing_policy",
    "fallback_credit_token",
    "thread",
];

pub const COUNT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "cache_control",
    "speed",
    "context_management",
    "mcp_servers",
];

/// Fields that ask for something a local server has no part in, refused when set: a
/// container for Anthropic's code execution, remote MCP servers Anthropic's side would call,
/// and threads kept on Anthropic's side.
const REFUSED: &[(&str, &str)] = &[
    (
        "container",
        "code-execution containers are not supported (no server tools here)",
    ),
    (
        "mcp_servers",
        "remote MCP servers are not supported: run the MCP client on your side and send its \
         tools in `tools`",
    ),
    (
        "thread",
        "this server keeps no threads: send the whole conversation in `messages`",
    ),
];

/// An error in Anthropic's shape, with the status the server would give it.
pub(crate) fn error_response(st: &AppState, e: ApiError) -> Response {
    st.metrics.request_failed();
    tracing::info!(status = e.status.as_u16(), "request refused: {}", e.message);
    let kind = match e.status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    let mut r = (e.status, Json(body)).into_response();
    e.retry_header(&mut r);
    r
}

fn template(st: &AppState) -> &str {
    st.tokenizer.chat_template().map_or("", |t| t.source())
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message, None)
}

/// The text of a `system` field or a tool result's `content`: a string, or text blocks.
fn text_of(v: &Value, what: &str) -> Result<String, ApiError> {
    if v.is_null() {
        return Ok(String::new());
    }
    api::text_parts(v, &["text"], &[]).map_err(|e| match e {
        api::PartsError::Part { kind, .. } => bad(format!(
            "{what}: blocks of type {kind:?} are not supported here (text only)"
        )),
        api::PartsError::Shape => bad(format!("{what} must be a string or a list of blocks")),
    })
}

/// An `image` block's source as the URL of an OpenAI `image_url` part: base64 data as a
/// `data:` URL, a `url` source as it is (the chat request's check refuses what it cannot
/// read, with the reason).
fn image_source(b: &Value, at: &str) -> Result<String, ApiError> {
    let src = b
        .get("source")
        .ok_or_else(|| bad(format!("{at}.source: an image block needs a source")))?;
    match src.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let media = src.get("media_type").and_then(Value::as_str).unwrap_or("");
            if !matches!(
                media,
                "image/png" | "image/jpeg" | "image/webp" | "image/gif"
            ) {
                return Err(bad(format!(
                    "{at}.source.media_type {media:?} (image/png, image/jpeg, image/webp or image/gif)"
                )));
            }
            let data = src
                .get("data")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("{at}.source.data: a base64 string is required")))?;
            Ok(format!("data:{media};base64,{data}"))
        }
        Some("url") => src
            .get("url")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| bad(format!("{at}.source.url: a string is required"))),
        other => Err(bad(format!(
            "{at}.source.type {other:?} is not supported (base64 or url)"
        ))),
    }
}

/// The Messages request as the chat request the server runs (OpenAI's shape).
fn to_chat(body: &Map<String, Value>, count_only: bool, template: &str) -> Result<Value, ApiError> {
    let mut messages = Vec::new();
    if let Some(system) = body.get("system") {
        let text = text_of(system, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    let list = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("messages: a list of messages is required"))?;
    if list.is_empty() {
        return Err(bad("messages: at least one message is required"));
    }
    let mut tool_uses: HashSet<String> = HashSet::new();
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if !["user", "assistant", "system"].contains(&role) {
            return Err(bad(format!(
                "messages.{i}.role: {role:?} (user, assistant or system)"
            )));
        }
        if let Some(k) = m
            .as_object()
            .and_then(|o| o.keys().find(|k| *k != "role" && *k != "content"))
        {
            return Err(bad(format!("messages.{i}.{k}: unknown field")));
        }
        if role == "system" {
            let text = text_of(
                m.get("content").unwrap_or(&Value::Null),
                &format!("messages.{i}"),
            )?;
            messages.push(json!({"role": "system", "content": text}));
            continue;
        }
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                messages.push(json!({"role": role, "content": s}));
                continue;
            }
            Some(Value::Array(b)) => b,
            _ => {
                return Err(bad(format!(
                    "messages.{i}.content: a string or a list of blocks"
                )))
            }
        };
        let mut text = String::new();
        // A user turn with images becomes OpenAI content parts (text and image_url, in
        // order); without, its text.
        let mut parts = Vec::new();
        let mut images = false;
        let mut thinking = String::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages.{i}.content.{j}");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => match b.get("text") {
                    Some(Value::String(t)) => {
                        text.push_str(t);
                        parts.push(json!({"type": "text", "text": t}));
                    }
                    _ => return Err(bad(format!("{at}.text: a string is required"))),
                },
                Some("image") if role == "user" => {
                    images = true;
                    parts.push(
                        json!({"type": "image_url", "image_url": {"url": image_source(b, &at)?}}),
                    );
                }
                // Reasoning goes with its turn (templates drop it from turns before the
                // last answer; harmony keeps a call's); redacted reasoning has no text.
                Some("thinking") if role == "assistant" => {
                    if let Some(t) = b.get("thinking").and_then(Value::as_str) {
                        thinking.push_str(t);
                    }
                }
                Some("redacted_thinking") if role == "assistant" => {}
                Some("tool_use") if role == "assistant" => {
                    let id = b.get("id").and_then(Value::as_str).unwrap_or("");
                    let name = b.get("name").and_then(Value::as_str).unwrap_or("");
                    if id.is_empty() || name.is_empty() {
                        return Err(bad(format!("{at}: tool_use needs an id and a name")));
                    }
                    let input = b.get("input").cloned().unwrap_or(json!({}));
                    if !input.is_object() {
                        return Err(bad(format!("{at}.input: an object is required")));
                    }
                    tool_uses.insert(id.to_string());
                    calls.push(json!({
                        "id": id, "type": "function",
                        "function": {"name": name, "arguments": input.to_string()},
                    }));
                }
                Some("tool_result") if role == "user" => {
                    let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
                    if !tool_uses.contains(id) {
                        return Err(bad(format!(
                            "{at}: tool_result for tool_use_id {id:?}, which no earlier \
                             assistant tool_use has"
                        )));
                    }
                    let mut content = text_of(b.get("content").unwrap_or(&Value::Null), &at)?;
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        content = format!("Error: {content}");
                    }
                    messages.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                other => {
                    return Err(bad(format!(
                        "{at}: blocks of type {other:?} are not supported in {role} messages"
                    )))
                }
            }
        }
        if role == "assistant" {
            let mut msg = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                msg["tool_calls"] = json!(calls);
            }
            if !thinking.is_empty() {
                msg["reasoning_content"] = json!(thinking);
            }
            messages.push(msg);
        } else if images {
            messages.push(json!({"role": "user", "content": parts}));
        } else if !text.is_empty() {
            messages.push(json!({"role": "user", "content": text}));
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
            .ok_or_else(|| bad("tools: a list is required"))?;
        let mut out = Vec::new();
        for (i, t) in list.iter().enumerate() {
            if t.get("type")
                .and_then(Value::as_str)
                .is_some_and(|ty| ty != "custom")
            {
                return Err(bad(format!(
                    "tools.{i}: server tools ({:?}) are not supported; give name, description \
                     and input_schema",
                    t["type"]
                )));
            }
            let name = t.get("name").cloned().unwrap_or(Value::Null);
            let schema = t
                .get("input_schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| bad(format!("tools.{i}.input_schema: an object is required")))?;
            let mut f = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description") {
                f["description"] = d.clone();
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    if let Some(tc) = body.get("tool_choice").filter(|t| !t.is_null()) {
        let choice = match tc.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": tc["name"]}}),
            other => {
                return Err(bad(format!(
                    "tool_choice.type {other:?} (auto, any, tool or none)"
                )))
            }
        };
        chat.insert("tool_choice".into(), choice);
        if tc.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    for (field, why) in REFUSED {
        if body
            .get(*field)
            .is_some_and(|v| !v.is_null() && v != &json!([]))
        {
            return Err(bad(format!("{field}: {why}")));
        }
    }
    // A template with a thinking switch (Qwen3's `enable_thinking`) follows `thinking`, and a
    // reasoning-effort setting (harmony's) follows it too: off is the least effort, a budget
    // of 16k tokens or more the most.
    let mut effort = None;
    if let Some(t) = body.get("thinking").filter(|t| !t.is_null()) {
        let on = match t.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive" | "between_tools") => true,
            Some("disabled") => false,
            other => {
                return Err(bad(format!(
                    "thinking.type {other:?} (enabled, adaptive, between_tools or disabled)"
                )))
            }
        };
        api::set_thinking(&mut chat, template, on);
        let budget = t.get("budget_tokens").and_then(Value::as_u64).unwrap_or(0);
        effort = Some(match (on, budget) {
            (false, _) => "low",
            (true, b) if b >= 16_000 => "high",
            _ => "medium",
        });
    }
    if let Some(oc) = body.get("output_config").filter(|v| !v.is_null()) {
        let oc = oc
            .as_object()
            .ok_or_else(|| bad("output_config: an object is required"))?;
        for (k, v) in oc {
            match k.as_str() {
                // An explicit effort wins over the one `thinking` implies.
                "effort" if !v.is_null() => {
                    effort = Some(match v.as_str() {
                        Some("low") => "low",
                        Some("medium") => "medium",
                        Some("high" | "xhigh" | "max") => "high",
                        _ => {
                            return Err(bad(format!(
                                "output_config.effort {v} (low, medium, high, xhigh or max)"
                            )))
                        }
                    })
                }
                // Structured output: the same constraint as Chat Completions' json_schema.
                "format" if !v.is_null() => {
                    let schema = match v.get("type").and_then(Value::as_str) {
                        Some("json_schema") => v.get("schema").filter(|s| s.is_object()),
                        _ => None,
                    }
                    .ok_or_else(|| {
                        bad("output_config.format: {\"type\": \"json_schema\", \"schema\": {…}} is required")
                    })?;
                    chat.insert(
                        "response_format".into(),
                        json!({"type": "json_schema",
                            "json_schema": {"name": "output", "schema": schema}}),
                    );
                }
                // A budget the model is told of (a beta): it has no such prompt here.
                "effort" | "format" | "task_budget" => {}
                other => return Err(bad(format!("output_config.{other}: unknown field"))),
            }
        }
    }
    if let Some(e) = effort {
        chat.insert("reasoning_effort".into(), e.into());
    }
    if count_only {
        return Ok(Value::Object(chat));
    }
    match body.get("max_tokens").and_then(Value::as_u64) {
        // Zero only warms the prompt cache: the prompt is read (one token is generated
        // and dropped), and the answer is empty.
        Some(0) => {
            chat.insert("max_tokens".into(), json!(1));
        }
        Some(n) => {
            chat.insert("max_tokens".into(), json!(n));
        }
        None => return Err(bad("max_tokens: a non-negative integer is required")),
    }
    api::copy_fields(
        body,
        &mut chat,
        &[
            ("stop_sequences", "stop"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("stream", "stream"),
            ("speculative", "speculative"),
        ],
    );
    Ok(Value::Object(chat))
}

/// Parses the body (fields from `fields` only: [`FIELDS`] for a message, [`COUNT_FIELDS`]
/// for counting) and translates it for a model whose chat template is `template`.
pub fn parse(
    bytes: &[u8],
    fields: &[&str],
    count_only: bool,
    template: &str,
) -> Result<api::ChatRequest, ApiError> {
    translate(&api::object(bytes, fields, false)?, count_only, template)
}

/// A checked body as the chat request.
fn translate(
    obj: &Map<String, Value>,
    count_only: bool,
    template: &str,
) -> Result<api::ChatRequest, ApiError> {
    let chat = to_chat(obj, count_only, template)?;
    api::parse(chat.to_string().as_bytes(), api::CHAT_FIELDS, true)
}

pub async fn count_tokens(
    State(st): State<Arc<AppState>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let bytes = routes::body(b)?;
        let req = parse(&bytes, COUNT_FIELDS, true, template(&st))?;
        st.check_model(&req.model)?;
        let tools = req.tools()?;
        let ids = routes::chat_prompt_ids(&st, &req, tools.as_ref().filter(|t| t.active())).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": ids.len()})).into_response())
    }
    .await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

pub async fn messages(
    State(st): State<Arc<AppState>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let r = messages_inner(st.clone(), b).await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

/// A tool_use block's id and input for a call.
fn tool_use(st: &AppState, c: &ToolCall) -> (String, Value) {
    let input = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
    (st.new_id("toolu").replace('-', "_"), input)
}

fn stop_reason(c: &Choice, tool_use: bool) -> (&'static str, Value) {
    // `max_tokens` wins over a tool call: a call cut short may have unfinished input.
    match (c.finish, &c.stop_string) {
        (Some(FinishReason::Length), _) => ("max_tokens", Value::Null),
        _ if tool_use => ("tool_use", Value::Null),
        (_, Some(s)) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

fn usage(c: &Choice) -> Value {
    json!({
        "input_tokens": c.usage.prompt_tokens,
        "output_tokens": c.usage.completion_tokens,
        "cache_read_input_tokens": c.usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

async fn messages_inner(
    st: Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let bytes = routes::body(b)?;
    let obj = api::object(&bytes, FIELDS, false)?;
    let req = translate(&obj, false, template(&st))?;
    let warm_only = obj.get("max_tokens").and_then(Value::as_u64) == Some(0);
    let p = routes::prepare_chat(&st, &req).await?;
    st.check_load()?;
    let input_tokens = p.plan.base.prompt.len();
    let mut rx = routes::launch(&st, vec![p.plan.base.clone()]).await?;
    let id = st.new_id("msg").replace('-', "_");
    if !p.plan.stream {
        let mut out = routes::collect(rx, 1).await?;
        if warm_only {
            // A cache warm-up's one token is not the answer's.
            out[0].usage.completion_tokens = 0;
        }
        routes::record(&st, &id, t0, &out, 1);
        let c = &out[0];
        if warm_only {
            let u = json!({"input_tokens": c.usage.prompt_tokens, "output_tokens": 0,
                "cache_read_input_tokens": c.usage.cached_tokens,
                "cache_creation_input_tokens": 0});
            return Ok(Json(json!({
                "id": id, "type": "message", "role": "assistant", "model": p.card.id,
                "content": [], "stop_reason": "max_tokens", "stop_sequence": null, "usage": u,
            }))
            .into_response());
        }
        let b = Answer::of(p.reading, p.tools.as_ref(), &c.text);
        let mut content = Vec::new();
        if let Some(t) = &b.reasoning {
            content.push(json!({"type": "thinking", "thinking": t, "signature": ""}));
        }
        if !b.text.is_empty() || (b.calls.is_empty() && b.reasoning.is_none()) {
            content.push(json!({"type": "text", "text": b.text}));
        }
        for call in &b.calls {
            let (cid, input) = tool_use(&st, call);
            content.push(json!({"type": "tool_use", "id": cid, "name": call.name, "input": input}));
        }
        let (reason, seq) = stop_reason(c, !b.calls.is_empty());
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": p.card.id,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(c),
        }))
        .into_response());
    }
    let (tx, events) = mpsc::unbounded_channel::<Event>();
    let model = p.card.id.clone();
    tokio::spawn(async move {
        let mut w = Writer {
            tx,
            open: None,
            index: 0,
        };
        let start = json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }});
        if !w.send("message_start", start) || !w.send("ping", json!({"type": "ping"})) {
            return;
        }
        let mut answer = AnswerStream::new(p.reading, p.tools.as_ref());
        // A cache warm-up's one token is not the answer's.
        let Some(mut choice) = answer
            .drive(&mut rx, |piece| warm_only || w.piece(&st, piece))
            .await
        else {
            return;
        };
        if warm_only {
            choice.usage.completion_tokens = 0;
            choice.finish = Some(FinishReason::Length);
        }
        routes::record(&st, &id, t0, std::slice::from_ref(&choice), 1);
        if !w.close() {
            return;
        }
        let calls = if warm_only { 0 } else { answer.calls() };
        let (reason, seq) = stop_reason(&choice, calls > 0);
        let delta = json!({"type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": {"output_tokens": choice.usage.completion_tokens}});
        if w.send("message_delta", delta) {
            let _ = w.send("message_stop", json!({"type": "message_stop"}));
        }
    });
    let stream = UnboundedReceiverStream::new(events).map(Ok::<_, Infallible>);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response())
}

/// Writes a message's content blocks as Anthropic stream events: a text or thinking block
/// opened at its first piece and closed when another kind follows or at the end.
struct Writer {
    tx: mpsc::UnboundedSender<Event>,
    /// The open block's kind ("thinking" or "text").
    open: Option<&'static str>,
    /// The open block's index, or the next one's.
    index: usize,
}

impl Writer {
    /// False once the client is gone.
    fn send(&self, name: &str, v: Value) -> bool {
        self.tx
            .send(Event::default().event(name).data(v.to_string()))
            .is_ok()
    }

    fn close(&mut self) -> bool {
        if self.open.take().is_none() {
            return true;
        }
        let ok = self.send(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": self.index}),
        );
        self.index += 1;
        ok
    }

    fn start(&mut self, block: Value) -> bool {
        self.send(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        )
    }

    fn delta(&self, delta: Value) -> bool {
        self.send(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        )
    }

    fn text(&mut self, kind: &'static str, piece: &str) -> bool {
        if piece.is_empty() {
            return true;
        }
        if self.open != Some(kind) {
            if !self.close() {
                return false;
            }
            let block = match kind {
                "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            if !self.start(block) {
                return false;
            }
            self.open = Some(kind);
        }
        self.delta(match kind {
            "thinking" => json!({"type": "thinking_delta", "thinking": piece}),
            _ => json!({"type": "text_delta", "text": piece}),
        })
    }

    /// One piece of the answer: reasoning into a thinking block, text into a text block, each
    /// call a tool_use block whose input streams as `input_json_delta`s.
    fn piece(&mut self, st: &AppState, piece: Piece) -> bool {
        match piece {
            Piece::Reasoning(r) => self.text("thinking", &r),
            Piece::Text(x) => self.text("text", &x),
            Piece::CallStart(name) => {
                let id = st.new_id("toolu").replace('-', "_");
                let ok = self.close()
                    && self.start(json!({"type": "tool_use", "id": id, "name": name, "input": {}}));
                self.open = Some("tool_use");
                ok
            }
            Piece::CallArgs(a) => {
                self.delta(json!({"type": "input_json_delta", "partial_json": a}))
            }
            Piece::CallEnd => self.close(),
            Piece::Call(c) => {
                let (id, input) = tool_use(st, &c);
                let ok = self.close()
                    && self
                        .start(json!({"type": "tool_use", "id": id, "name": c.name, "input": {}}))
                    && self.delta(
                        json!({"type": "input_json_delta", "partial_json": input.to_string()}),
                    );
                self.open = Some("tool_use");
                ok && self.close()
            }
        }
    }
}
