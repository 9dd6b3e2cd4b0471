//! Ollama's API (`/api/*`), the one Open WebUI's Ollama connection, LangChain's `ChatOllama`
//! and the `ollama` clients speak. `/api/chat` and `/api/generate` are translated into the chat
//! request the rest of the server runs ([`crate::api::ChatRequest`]: `options` as sampling
//! fields, `format` as a JSON constraint, `think` as the template's thinking switch and
//! reasoning effort, tools in OpenAI's shape already), and the engine's events back into
//! Ollama's objects — one JSON object per line (NDJSON) when streaming, which is Ollama's
//! default. Errors come as `{"error": "…"}`, in a stream as its last line.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrum_generate::{FinishReason, OutputKind, TokenLogprob};
use ferrum_tokenizer::SpecialTokens;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use crate::answer::{Answer, AnswerFormat, AnswerStream, Piece};
use crate::api;
use crate::error::ApiError;
use crate::routes::{self, AppState, Choice, Prepared, PromptIds};
use crate::tools::ToolCall;
use crate::worker::ModelCard;

type App = State<Arc<AppState>>;

/// Downloads a model reference into the local store, reporting each file's progress (name,
/// size, bytes so far); the local path, or why not. The CLI's `ferrum pull` behind
/// `/api/pull`.
pub type Pull =
    Arc<dyn Fn(&str, &mut dyn FnMut(&str, u64, u64)) -> Result<String, String> + Send + Sync>;

/// The Ollama API version reported by `/api/version`: the release whose request and response
/// fields this module follows (`think` with levels, `logprobs`, `/api/embed` `dimensions`).
pub const API_VERSION: &str = "0.13.0";

const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    // Open WebUI moves a `system` option here; it leads the conversation.
    "system",
    "tools",
    "format",
    "options",
    "stream",
    "keep_alive",
    "think",
    "logprobs",
    "top_logprobs",
];

const GENERATE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "suffix",
    "system",
    "template",
    "context",
    "stream",
    "raw",
    "format",
    "images",
    "options",
    "keep_alive",
    "think",
    "logprobs",
    "top_logprobs",
    // Image generation's.
    "width",
    "height",
    "steps",
];

/// A JSON object body. Fields other than `known` are left out with a log line, as Ollama
/// does: its clients (Open WebUI's proxy among them) pass on what they are given, and Ollama
/// has never refused a field. What this server cannot do is refused by name where it is read.
fn object(body: &[u8], known: &[&str]) -> Result<Map<String, Value>, ApiError> {
    let mut o = api::json_object(body)?;
    o.retain(|k, _| {
        let keep = known.contains(&k.as_str());
        if !keep {
            tracing::debug!("ignoring the unknown field {k:?} (as Ollama does)");
        }
        keep
    });
    Ok(o)
}

/// An error as Ollama's clients read it: `{"error": message}` with the status.
pub(crate) fn error_response(st: &AppState, e: ApiError) -> Response {
    st.metrics.request_failed();
    tracing::info!(status = e.status.as_u16(), "request refused: {}", e.message);
    shaped(e)
}

/// `e` as Ollama's clients read it, `Retry-After` included (the browser guard's refusals
/// under `/api/` too).
pub(crate) fn shaped(e: ApiError) -> Response {
    let mut r = (e.status, Json(json!({"error": e.message}))).into_response();
    e.retry_header(&mut r);
    r
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message, None)
}

/// Ollama's timestamps: RFC 3339 in UTC.
fn created_at() -> String {
    routes::rfc3339(routes::now())
}

fn nanos(d: std::time::Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// The model a request names: `model`, or `name` as older clients send it.
fn model_name(body: &Map<String, Value>) -> Result<&str, ApiError> {
    body.get("model")
        .or_else(|| body.get("name"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad("model is required"))
}

/// The served model for the name a request gives (`model`, or `name` as older clients
/// send it), with that name as its id, and the name the rest of the pipeline knows it by.
/// Ollama's names carry a tag; `NAME:latest` is `NAME`.
fn served(st: &AppState, body: &Map<String, Value>) -> Result<(ModelCard, String), ApiError> {
    let name = model_name(body)?;
    let other = match name.strip_suffix(":latest") {
        Some(bare) => bare.to_string(),
        None => format!("{name}:latest"),
    };
    let (mut card, known) = match st.check_model(name) {
        Ok(c) => (c, name.to_string()),
        Err(e) if e.status == StatusCode::NOT_FOUND => match st.check_model(&other) {
            Ok(c) => (c, other),
            // The error names what the client asked for.
            Err(_) => return Err(e),
        },
        Err(e) => return Err(e),
    };
    card.id = name.to_string();
    Ok((card, known))
}

/// How a name is listed: with a tag, as Ollama lists models.
fn tagged(name: &str) -> String {
    match name
        .rsplit('/')
        .next()
        .is_some_and(|last| last.contains(':'))
    {
        true => name.to_string(),
        false => format!("{name}:latest"),
    }
}

/// `options` as the chat request's sampling fields. What only sets up a model's load
/// (threads, GPU layers, mmap, the context) has no meaning per request here and is taken and
/// left; a sampler this engine does not have is refused unless it asks for its no-op value.
fn options(opts: &Value, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    if opts.is_null() {
        return Ok(());
    }
    let o = opts
        .as_object()
        .ok_or_else(|| ApiError::param("options", "options must be an object"))?;
    for (k, v) in o {
        if v.is_null() {
            continue;
        }
        let same = |to: &str, chat: &mut Map<String, Value>| {
            chat.insert(to.into(), v.clone());
        };
        match k.as_str() {
            // Ollama's -1 (any negative seed): a random one, as no seed is here.
            "seed" if v.as_i64().is_some_and(|s| s < 0) => {}
            "temperature" | "top_k" | "top_p" | "min_p" | "seed" | "stop" | "presence_penalty"
            | "frequency_penalty" => same(k, chat),
            "repeat_penalty" => same("repetition_penalty", chat),
            // -1: until the model stops; -2: until the context is full. Both are the
            // default here (the context bounds every answer).
            "num_predict" => match v.as_i64() {
                Some(n) if n > 0 => same("max_tokens", chat),
                Some(-1 | -2) => {}
                _ => {
                    return Err(ApiError::param(
                        "options.num_predict",
                        "num_predict must be positive, -1 or -2",
                    ))
                }
            },
            "num_ctx" | "num_keep" | "num_batch" | "num_gpu" | "main_gpu" | "low_vram"
            | "numa" | "vocab_only" | "use_mmap" | "use_mlock" | "embedding_only"
            | "logits_all" | "num_thread" | "f16_kv" | "repeat_last_n" | "penalize_newline"
            | "mirostat_tau" | "mirostat_eta" => {}
            "typical_p" | "tfs_z" if v.as_f64() == Some(1.0) => {}
            "mirostat" if v.as_i64() == Some(0) => {}
            "typical_p" | "tfs_z" | "mirostat" => {
                return Err(ApiError::param(
                    &format!("options.{k}"),
                    format!("options.{k} {v} is not supported (samplers here: temperature, top_k, top_p, min_p, penalties)"),
                ))
            }
            // Open WebUI's settings, which it sends to Ollama as options.
            "reasoning_effort" => same("reasoning_effort", chat),
            "logit_bias" => {
                chat.insert("logit_bias".into(), logit_bias(v)?);
            }
            // Options Ollama does not know either (an app's custom parameters): Ollama
            // leaves them with a warning, and so does this server.
            other => tracing::debug!("ignoring the unknown option {other:?} (as Ollama does)"),
        }
    }
    Ok(())
}

/// A logit bias as an object (`{"id": bias}`) or as Open WebUI writes it (`"id:bias, id:bias"`).
fn logit_bias(v: &Value) -> Result<Value, ApiError> {
    let refuse = || {
        ApiError::param(
            "options.logit_bias",
            "logit_bias must be {\"token id\": bias} or \"id:bias, id:bias\"",
        )
    };
    match v {
        Value::Object(_) => Ok(v.clone()),
        Value::String(s) => {
            let mut out = Map::new();
            for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (id, bias) = pair.split_once(':').ok_or_else(refuse)?;
                let bias: f64 = bias.trim().parse().map_err(|_| refuse())?;
                out.insert(id.trim().to_string(), json!(bias));
            }
            Ok(Value::Object(out))
        }
        _ => Err(refuse()),
    }
}

/// The fields `/api/chat` and `/api/generate` share, onto the chat request.
fn common(
    body: &Map<String, Value>,
    chat: &mut Map<String, Value>,
    template: &str,
) -> Result<(), ApiError> {
    if let Some(o) = body.get("options") {
        options(o, chat)?;
    }
    match body.get("format") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) if s == "json" => {
            chat.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some(schema @ Value::Object(_)) => {
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}),
            );
        }
        Some(other) => {
            return Err(ApiError::param(
                "format",
                format!("format {other} (\"json\" or a JSON schema)"),
            ))
        }
    }
    match body.get("think") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(on)) => api::set_thinking(chat, template, *on),
        Some(Value::String(level)) if ["low", "medium", "high"].contains(&level.as_str()) => {
            api::set_thinking(chat, template, true);
            chat.insert("reasoning_effort".into(), json!(level));
        }
        Some(other) => {
            return Err(ApiError::param(
                "think",
                format!("think {other} (true, false, \"low\", \"medium\" or \"high\")"),
            ))
        }
    }
    api::copy_fields(
        body,
        chat,
        &[("logprobs", "logprobs"), ("top_logprobs", "top_logprobs")],
    );
    // Ollama streams unless told not to.
    chat.insert("stream".into(), json!(api::flag(body, &["stream"], true)?));
    chat.insert(
        "model".into(),
        body.get("model").cloned().unwrap_or(Value::Null),
    );
    Ok(())
}

/// Ollama's `images` (base64 strings) as `image_url` parts after the message's text, which
/// the chat request's check then reads (or refuses, with the reason).
fn with_images(content: &str, v: Option<&Value>, at: &str) -> Result<Value, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(content.into()),
        Some(Value::Array(a)) if a.is_empty() => return Ok(content.into()),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::param(
                at,
                "images must be a list of base64 strings",
            ))
        }
    };
    let mut parts = vec![json!({"type": "text", "text": content})];
    for (k, img) in list.iter().enumerate() {
        let b64 = img
            .as_str()
            .ok_or_else(|| ApiError::param(at, format!("{at}[{k}] must be a base64 string")))?;
        parts.push(
            json!({"type": "image_url", "image_url": {"url": format!("data:;base64,{b64}")}}),
        );
    }
    Ok(Value::Array(parts))
}

/// Ollama's messages as the chat request's: tool calls' arguments (objects) as JSON text
/// with an id each, a tool result's `tool_name` as its name, `thinking` as the turn's
/// reasoning.
fn messages(list: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(list.len());
    let mut calls = 0;
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let o = m
            .as_object()
            .ok_or_else(|| ApiError::param("messages", format!("{at} must be an object")))?;
        let role = o.get("role").and_then(Value::as_str).unwrap_or("");
        let content = match o.get("content") {
            None | Some(Value::Null) => "",
            Some(Value::String(s)) => s,
            Some(_) => {
                return Err(ApiError::param(
                    "messages",
                    format!("{at}.content must be a string"),
                ))
            }
        };
        let mut msg =
            json!({"role": role, "content": with_images(content, o.get("images"), "images")?});
        if let Some(t) = o.get("thinking").and_then(Value::as_str) {
            msg["reasoning_content"] = json!(t);
        }
        if let Some(n) = o.get("tool_name").and_then(Value::as_str) {
            msg["name"] = json!(n);
        }
        if let Some(id) = o.get("tool_call_id").and_then(Value::as_str) {
            msg["tool_call_id"] = json!(id);
        }
        if let Some(list) = o.get("tool_calls").filter(|v| !v.is_null()) {
            let list = list.as_array().ok_or_else(|| {
                ApiError::param("messages", format!("{at}.tool_calls must be a list"))
            })?;
            let mut out_calls = Vec::new();
            for c in list {
                let f = &c["function"];
                let name = f["name"].as_str().unwrap_or("");
                if name.is_empty() {
                    return Err(ApiError::param(
                        "messages",
                        format!("{at}.tool_calls: each call needs function.name"),
                    ));
                }
                let args = match &f["arguments"] {
                    Value::String(s) => s.clone(),
                    Value::Null => "{}".into(),
                    v => v.to_string(),
                };
                calls += 1;
                let id = c["id"]
                    .as_str()
                    .map_or_else(|| format!("call_{calls}"), str::to_string);
                out_calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": args}}));
            }
            msg["tool_calls"] = json!(out_calls);
        }
        out.push(msg);
    }
    Ok(out)
}

fn template(st: &AppState) -> &str {
    st.tokenizer.chat_template().map_or("", |t| t.source())
}

/// What `/api/chat` and `/api/generate` answer a request with nothing to generate: the model
/// is loaded (it always is here), or "unloaded" with `keep_alive: 0` (it stays).
fn load_reply(card: &ModelCard, body: &Map<String, Value>, chat: bool) -> Response {
    let unload = body.get("keep_alive").is_some_and(zero_duration);
    let mut r = json!({
        "model": card.id, "created_at": created_at(), "done": true,
        "done_reason": if unload { "unload" } else { "load" },
    });
    if chat {
        r["message"] = json!({"role": "assistant", "content": ""});
    } else {
        r["response"] = json!("");
    }
    Json(r).into_response()
}

/// Whether a `keep_alive` says zero: `0`, `0.0`, `"0"`, `"0s"`, `"0m"`, ...
fn zero_duration(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s
            .trim()
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse::<f64>()
            .is_ok_and(|x| x == 0.0),
        _ => false,
    }
}

pub async fn chat(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = chat_inner(st.clone(), b).await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

async fn chat_inner(
    st: Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let body = object(&routes::body(b)?, CHAT_FIELDS)?;
    let (card, known) = served(&st, &body)?;
    let Some(mut req) = chat_request(&body, template(&st))? else {
        return Ok(load_reply(&card, &body, true));
    };
    req.model = known;
    let mut p = routes::prepare_chat(&st, &req).await?;
    p.card.id = card.id;
    run(st, p, t0, Shape::Chat).await
}

/// `/api/chat`'s body as the chat request the server runs; `None` for one with no messages
/// (a request to load the model).
fn chat_request(
    body: &Map<String, Value>,
    template: &str,
) -> Result<Option<api::ChatRequest>, ApiError> {
    let list = match body.get("messages") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::param("messages", "messages must be a list")),
    };
    let mut msgs = messages(list)?;
    if let Some(s) = body
        .get("system")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
    {
        msgs.insert(0, json!({"role": "system", "content": s}));
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(msgs));
    if let Some(t) = body.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), t.clone());
    }
    to_request(body, chat, template).map(Some)
}

/// The chat request from `chat` (messages, tools) and the fields chat and generate share.
fn to_request(
    body: &Map<String, Value>,
    mut chat: Map<String, Value>,
    template: &str,
) -> Result<api::ChatRequest, ApiError> {
    common(body, &mut chat, template)?;
    let mut req: api::ChatRequest = api::parse(
        Value::Object(chat).to_string().as_bytes(),
        api::CHAT_FIELDS,
        true,
    )?;
    req.sampling.cap_max_tokens = true;
    Ok(req)
}

/// `/api/generate`'s body, checked: the chat request (the prompt as a user turn after
/// `system`), and what a raw prompt or a `context` needs.
struct Generate {
    req: api::ChatRequest,
    prompt: String,
    raw: bool,
    context: Vec<u32>,
}

/// `None` for a request with nothing to generate (a request to load the model).
fn generate_request(
    body: &Map<String, Value>,
    template: &str,
) -> Result<Option<Generate>, ApiError> {
    for k in ["width", "height", "steps"] {
        if body.get(k).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::param(k, "image generation is not supported"));
        }
    }
    let text = |k: &str| -> Result<String, ApiError> {
        match body.get(k) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(ApiError::param(k, format!("{k} must be a string"))),
        }
    };
    let (prompt, system) = (text("prompt")?, text("system")?);
    if !text("suffix")?.is_empty() {
        return Err(ApiError::param(
            "suffix",
            "suffix (fill-in-the-middle) is not supported",
        ));
    }
    if !text("template")?.is_empty() {
        return Err(ApiError::param(
            "template",
            "Go templates are not supported: the model's own chat template renders prompts \
             (send raw: true with a prompt already formatted)",
        ));
    }
    let raw = api::flag(body, &["raw"], false)?;
    let context: Vec<u32> = match body.get("context") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|_| ApiError::param("context", "context must be a list of token ids"))?,
    };
    if prompt.is_empty() && context.is_empty() {
        return Ok(None);
    }
    let mut msgs = Vec::new();
    if !system.is_empty() {
        msgs.push(json!({"role": "system", "content": system}));
    }
    let raw_images = body
        .get("images")
        .is_some_and(|v| v.as_array().is_some_and(|a| !a.is_empty()));
    if raw && raw_images {
        return Err(ApiError::param(
            "images",
            "images need the chat template to place them: leave raw out",
        ));
    }
    msgs.push(
        json!({"role": "user", "content": with_images(&prompt, body.get("images"), "images")?}),
    );
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(msgs));
    let req = to_request(body, chat, template)?;
    Ok(Some(Generate {
        req,
        prompt,
        raw,
        context,
    }))
}

/// An `/api/chat` body (or an `/api/generate` one, `generate`) as the chat request, for a
/// model whose chat template is `template`: the parsers the handlers run, for the fuzzer.
pub fn parse(
    bytes: &[u8],
    generate: bool,
    template: &str,
) -> Result<Option<api::ChatRequest>, ApiError> {
    if generate {
        let body = object(bytes, GENERATE_FIELDS)?;
        Ok(generate_request(&body, template)?.map(|g| g.req))
    } else {
        let body = object(bytes, CHAT_FIELDS)?;
        chat_request(&body, template)
    }
}

pub async fn generate(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = generate_inner(st.clone(), b).await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

async fn generate_inner(
    st: Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let body = object(&routes::body(b)?, GENERATE_FIELDS)?;
    let (card, known) = served(&st, &body)?;
    let Some(Generate {
        mut req,
        prompt,
        raw,
        context,
    }) = generate_request(&body, template(&st))?
    else {
        return Ok(load_reply(&card, &body, false));
    };
    if context.iter().any(|&t| t as usize >= card.vocab_size) {
        return Err(ApiError::param(
            "context",
            "context has a token outside the vocabulary",
        ));
    }
    req.model = known;
    let ids = if raw {
        // A raw prompt is written for the model: its special-token texts are control tokens.
        let mut ids = context;
        let bos = ids.is_empty();
        ids.extend(
            st.tokenizer
                .encode_with(&prompt, bos, SpecialTokens::Control)?,
        );
        PromptIds::Raw(ids)
    } else {
        PromptIds::Render { before: context }
    };
    let mut p = routes::prepare_with(&st, &req, ids).await?;
    p.card.id = card.id;
    run(st, p, t0, Shape::Generate).await
}

#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Chat,
    Generate,
}

/// A part of an answer as Ollama carries it.
#[derive(Default)]
struct Part {
    text: String,
    thinking: String,
    calls: Vec<Value>,
    logprobs: Vec<Value>,
}

impl Part {
    fn is_empty(&self) -> bool {
        self.text.is_empty()
            && self.thinking.is_empty()
            && self.calls.is_empty()
            && self.logprobs.is_empty()
    }

    /// The part as a response object (not done: [`finish`] adds the end's fields).
    fn json(&self, shape: Shape, model: &str) -> Value {
        let mut r = json!({"model": model, "created_at": created_at(), "done": false});
        match shape {
            Shape::Chat => {
                let mut m = json!({"role": "assistant", "content": self.text});
                if !self.thinking.is_empty() {
                    m["thinking"] = json!(self.thinking);
                }
                if !self.calls.is_empty() {
                    m["tool_calls"] = json!(self.calls);
                }
                r["message"] = m;
            }
            Shape::Generate => {
                r["response"] = json!(self.text);
                if !self.thinking.is_empty() {
                    r["thinking"] = json!(self.thinking);
                }
            }
        }
        if !self.logprobs.is_empty() {
            r["logprobs"] = json!(self.logprobs);
        }
        r
    }
}

/// A tool call as Ollama returns it: arguments as an object. Arguments that are no JSON
/// object (a call cut short) make no call: a client would run the tool without them.
fn call_json(st: &AppState, index: usize, c: &ToolCall) -> Option<Value> {
    let args: Value = serde_json::from_str(&c.arguments)
        .ok()
        .filter(Value::is_object)?;
    Some(json!({"id": st.new_id("call"),
        "function": {"index": index, "name": c.name, "arguments": args}}))
}

fn logprob_json(st: &AppState, id: u32, lp: &TokenLogprob) -> Value {
    let entry = |id: u32, l: f32| {
        let t = routes::token_text(&st.tokenizer, id);
        json!({"token": t, "logprob": l, "bytes": t.as_bytes()})
    };
    let mut e = entry(id, lp.logprob);
    e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
    e
}

/// The last object's `done`, reason and counters (durations in nanoseconds, as Ollama's).
fn finish(r: &mut Value, c: &Choice, t0: Instant) {
    let end = Instant::now();
    let first = c.first_token.unwrap_or(end);
    r["done"] = json!(true);
    r["done_reason"] = json!(match c.finish {
        Some(FinishReason::Length) => "length",
        _ => "stop",
    });
    r["total_duration"] = json!(nanos(end - t0));
    r["load_duration"] = json!(0);
    r["prompt_eval_count"] = json!(c.usage.prompt_tokens);
    r["prompt_eval_duration"] = json!(nanos(first - t0));
    r["eval_count"] = json!(c.usage.completion_tokens);
    r["eval_duration"] = json!(nanos(end - first));
}

/// Submits the prepared request and answers it: one object, or NDJSON lines as the answer
/// is generated (text, thinking and each tool call once it is whole), then the last object
/// with the counters.
async fn run(
    st: Arc<AppState>,
    p: Prepared,
    t0: Instant,
    shape: Shape,
) -> Result<Response, ApiError> {
    let reading = p.reading;
    st.check_load()?;
    let mut rx = routes::launch(&st, vec![p.plan.base.clone()]).await?;
    let id = st.new_id("ollama");
    let model = p.card.id.clone();
    let prompt = p.plan.base.prompt.clone();
    if !p.plan.stream {
        let mut tokens = Vec::new();
        let mut logprobs = Vec::new();
        let mut c = Choice::default();
        loop {
            let Some((_, o)) = rx.recv().await else {
                return Err(ApiError::internal("the engine dropped the request"));
            };
            if let OutputKind::Token { token, logprob, .. } = &o.kind {
                tokens.push(*token);
                if let Some(l) = logprob {
                    logprobs.push(logprob_json(&st, *token, l));
                }
            }
            if c.absorb(&o.kind) {
                break;
            }
        }
        routes::record(&st, &id, t0, std::slice::from_ref(&c), 1);
        let a = Answer::of(reading, p.tools.as_ref(), &c.text);
        let part = Part {
            text: a.text,
            thinking: a.reasoning.unwrap_or_default(),
            calls: a
                .calls
                .iter()
                .filter_map(|call| call_json(&st, 0, call))
                .enumerate()
                .map(|(i, mut c)| {
                    c["function"]["index"] = json!(i);
                    c
                })
                .collect(),
            logprobs,
        };
        let mut r = part.json(shape, &model);
        finish(&mut r, &c, t0);
        if shape == Shape::Generate {
            r["context"] = json!([prompt, tokens].concat());
        }
        return Ok(Json(r).into_response());
    }
    let (tx, lines) = mpsc::unbounded_channel::<Result<Bytes, Infallible>>();
    let send = move |v: Value| tx.send(Ok(Bytes::from(format!("{v}\n")))).is_ok();
    tokio::spawn(async move {
        let mut answer = AnswerStream::new(reading, p.tools.as_ref());
        let mut c = Choice::default();
        let mut tokens = Vec::new();
        let mut call: Option<ToolCall> = None;
        let mut calls = 0;
        loop {
            let Some((_, o)) = rx.recv().await else {
                let _ = send(json!({"error": "the engine dropped the request"}));
                return;
            };
            let last = c.absorb(&o.kind);
            let mut part = Part::default();
            let delta = match &o.kind {
                OutputKind::Token {
                    token,
                    text,
                    logprob,
                } => {
                    tokens.push(*token);
                    if let Some(l) = logprob {
                        part.logprobs.push(logprob_json(&st, *token, l));
                    }
                    text
                }
                OutputKind::Finished { text, .. } => text,
            };
            for piece in answer.push(delta, last) {
                match piece {
                    Piece::Reasoning(r) => part.thinking.push_str(&r),
                    Piece::Text(t) => part.text.push_str(&t),
                    Piece::CallStart(name) => {
                        call = Some(ToolCall {
                            name,
                            arguments: String::new(),
                        })
                    }
                    Piece::CallArgs(a) => {
                        if let Some(c) = call.as_mut() {
                            c.arguments.push_str(&a);
                        }
                    }
                    // Ollama sends a call whole, once its arguments are complete.
                    Piece::CallEnd => {
                        if let Some(c) = call.take().and_then(|c| call_json(&st, calls, &c)) {
                            part.calls.push(c);
                            calls += 1;
                        }
                    }
                    Piece::Call(c) => {
                        if let Some(c) = call_json(&st, calls, &c) {
                            part.calls.push(c);
                            calls += 1;
                        }
                    }
                }
            }
            if !part.is_empty() && !send(part.json(shape, &model)) {
                return;
            }
            if last {
                break;
            }
        }
        routes::record(&st, &id, t0, std::slice::from_ref(&c), 1);
        let mut r = Part::default().json(shape, &model);
        finish(&mut r, &c, t0);
        if shape == Shape::Generate {
            r["context"] = json!([prompt, tokens].concat());
        }
        let _ = send(r);
    });
    Ok(ndjson(lines))
}

fn ndjson(lines: mpsc::UnboundedReceiver<Result<Bytes, Infallible>>) -> Response {
    let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(lines);
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Scales `v` to unit length, as Ollama's `/api/embed` returns embeddings.
fn normalise(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
}

pub async fn embed(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let t0 = Instant::now();
        let body = object(
            &routes::body(b)?,
            &[
                "model",
                "input",
                "truncate",
                "options",
                "keep_alive",
                "dimensions",
            ],
        )?;
        let (card, _) = served(&st, &body)?;
        let inputs: Vec<String> = match body.get("input") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(v @ Value::Array(_)) => serde_json::from_value(v.clone())
                .map_err(|_| ApiError::param("input", "input must be a string or strings"))?,
            _ => {
                return Err(ApiError::param(
                    "input",
                    "input must be a string or strings",
                ))
            }
        };
        let truncate = api::flag(&body, &["truncate"], true)?;
        // Checked before any work; 0 (or none) is the model's width.
        let width = card.embedding_width;
        let dims = match body.get("dimensions") {
            None | Some(Value::Null) => width,
            Some(d) => match d.as_u64() {
                Some(0) => width,
                Some(d) if d as usize <= width => d as usize,
                _ => {
                    return Err(ApiError::param(
                        "dimensions",
                        format!("dimensions must be 0..={width} (this model's width)"),
                    ))
                }
            },
        };
        let ids = routes::encode_texts(&st, &inputs)?;
        let truncate = if truncate {
            routes::Truncate::To(card.context)
        } else {
            routes::Truncate::No
        };
        let (mut vectors, tokens) = routes::embed_ids(&st, &card, ids, truncate, "input").await?;
        vectors.iter_mut().for_each(|v| v.truncate(dims));
        vectors.iter_mut().for_each(|v| normalise(v));
        Ok::<_, ApiError>(
            Json(json!({
                "model": card.id, "embeddings": vectors,
                "total_duration": nanos(t0.elapsed()), "load_duration": 0,
                "prompt_eval_count": tokens,
            }))
            .into_response(),
        )
    }
    .await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

/// The older endpoint: one prompt, its embedding as the model gives it (not normalised).
pub async fn embeddings(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let body = object(
            &routes::body(b)?,
            &["model", "prompt", "options", "keep_alive"],
        )?;
        let (card, _) = served(&st, &body)?;
        let prompt = match body.get("prompt") {
            None | Some(Value::Null) => "",
            Some(Value::String(s)) => s,
            Some(_) => return Err(ApiError::param("prompt", "prompt must be a string")),
        };
        if prompt.is_empty() {
            return Ok(Json(json!({"embedding": []})).into_response());
        }
        let ids = routes::encode_texts(&st, &[prompt.to_string()])?;
        let all = routes::Truncate::To(card.context);
        let (v, _) = routes::embed_ids(&st, &card, ids, all, "prompt").await?;
        Ok::<_, ApiError>(Json(json!({"embedding": v.first()})).into_response())
    }
    .await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

/// A stable identifier for a served name (Ollama shows a manifest's sha256 here; this is no
/// checksum of anything, only the same for the same model file and name).
fn digest(c: &ModelCard, name: &str) -> String {
    use std::hash::{Hash, Hasher};
    (0..4u8)
        .map(|k| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (k, name, c.file_bytes, c.params, &c.arch).hash(&mut h);
            format!("{:016x}", h.finish())
        })
        .collect()
}

/// Parameters in Ollama's words: `135M`, `7.6B`.
fn parameter_size(n: usize) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else {
        format!("{:.0}M", n / 1e6)
    }
}

fn details(c: &ModelCard) -> Value {
    json!({
        "parent_model": "", "format": "gguf", "family": c.arch, "families": [c.arch],
        "parameter_size": parameter_size(c.params), "quantization_level": c.dtype,
    })
}

fn entries(st: &AppState, ps: bool) -> Result<Vec<Value>, ApiError> {
    let c = st.card()?;
    Ok(st
        .names
        .listed()
        .iter()
        .map(|n| {
            let name = tagged(n);
            let mut e = json!({
                "name": name, "model": name, "modified_at": routes::rfc3339(c.created),
                "size": c.file_bytes, "digest": digest(c, n), "details": details(c),
            });
            if ps {
                e["size"] = json!(c.file_bytes + c.kv_bytes);
                e["size_vram"] = json!(0);
                // Loaded for as long as the server runs.
                e["expires_at"] = json!("2318-11-10T00:00:00Z");
                e["context_length"] = json!(c.context);
            }
            e
        })
        .collect())
}

/// `GET /api/tags`: the models this server answers to (the one it serves, under each name).
pub async fn tags(State(st): App) -> Response {
    match entries(&st, false) {
        Ok(m) => Json(json!({"models": m})).into_response(),
        Err(e) => error_response(&st, e),
    }
}

/// `GET /api/ps`: the running models (the served one, always loaded).
pub async fn ps(State(st): App) -> Response {
    match entries(&st, true) {
        Ok(m) => Json(json!({"models": m})).into_response(),
        Err(e) => error_response(&st, e),
    }
}

pub async fn version() -> Response {
    Json(json!({"version": API_VERSION})).into_response()
}

/// `POST /api/show`: what a client asks of a model before using it: its template, details,
/// architecture numbers and capabilities.
pub async fn show(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let body = object(&routes::body(b)?, &["model", "name", "verbose", "system"])?;
        let (c, _) = served(&st, &body)?;
        let template = template(&st).to_string();
        let mut caps = vec!["completion", "tools"];
        if st.format != AnswerFormat::Plain {
            caps.push("thinking");
        }
        let info = json!({
            "general.architecture": c.arch,
            "general.parameter_count": c.params,
            format!("{}.context_length", c.arch): c.context,
        });
        Ok::<_, ApiError>(
            Json(json!({
                "modelfile": format!("# served by ferrum\nFROM {}\n", c.id),
                "parameters": "", "template": template, "details": details(&c),
                "model_info": info, "capabilities": caps,
                "modified_at": routes::rfc3339(c.created),
            }))
            .into_response(),
        )
    }
    .await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

/// `POST /api/pull`: downloads a model into the local store through ferrum's own pull,
/// streaming its progress as Ollama does (`status`, and `digest`/`total`/`completed` per
/// file). A name this server already serves is there: success at once. What is pulled is
/// served by a server started on it (`ferrum serve NAME`); this one keeps its model.
pub async fn pull(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let body = object(&routes::body(b)?, &["model", "name", "insecure", "stream"])?;
        let name = model_name(&body)?.to_string();
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(true);
        let (tx, mut rx) = mpsc::unbounded_channel::<Value>();
        let _ = tx.send(json!({"status": "pulling manifest"}));
        let bare = name.strip_suffix(":latest").unwrap_or(&name).to_string();
        // Only the names listed are here already (`--any-model-name` answers any name, but
        // has not got every model).
        let here = st
            .names
            .listed()
            .iter()
            .any(|n| *n == name || *n == bare || tagged(n) == name);
        let job = if here {
            None
        } else {
            let pull = st.pull.clone().ok_or_else(|| ApiError {
                status: StatusCode::FORBIDDEN,
                ..bad("pulling models is off on this server (--no-pull)")
            })?;
            let tx = tx.clone();
            let one = st.pulling.clone();
            // A task of its own: a pull the client leaves still finishes (the store is left
            // whole) and logs its end.
            Some(tokio::spawn(async move {
                // One pull at a time: hf-hub locks a file while it downloads it, so a second
                // pull of the same model (a client retrying) waits, then finds it in the store.
                let _one = match one.clone().try_lock_owned() {
                    Ok(g) => g,
                    Err(_) => {
                        let _ = tx.send(json!({"status": "waiting for another pull to finish"}));
                        one.lock_owned().await
                    }
                };
                let job = tokio::task::spawn_blocking(move || {
                    let mut last = (String::new(), u64::MAX);
                    let mut report = |file: &str, total: u64, done: u64| {
                        // A line per file per percent, not per chunk.
                        let pct = (done * 100).checked_div(total).unwrap_or(100);
                        if last.0 != file || last.1 != pct {
                            last = (file.to_string(), pct);
                            let _ = tx.send(json!({"status": format!("pulling {file}"),
                                "digest": file, "total": total, "completed": done}));
                        }
                    };
                    let r = pull(&bare, &mut report);
                    match &r {
                        Ok(path) => tracing::info!("pulled {bare} into {path}"),
                        Err(e) => tracing::warn!("pulling {bare} failed: {e}"),
                    }
                    r
                });
                job.await
                    .unwrap_or_else(|e| Err(format!("the pull failed: {e}")))
            }))
        };
        drop(tx);
        let done = async move {
            match job {
                None => Ok(()),
                Some(j) => j
                    .await
                    .unwrap_or_else(|e| Err(format!("the pull failed: {e}")))
                    .map(drop),
            }
        };
        if !stream {
            while rx.recv().await.is_some() {}
            return match done.await {
                Ok(()) => Ok(Json(json!({"status": "success"})).into_response()),
                Err(e) => Err(ApiError::internal(e)),
            };
        }
        let (out, lines) = mpsc::unbounded_channel::<Result<Bytes, Infallible>>();
        tokio::spawn(async move {
            let send = |v: Value| out.send(Ok(Bytes::from(format!("{v}\n")))).is_ok();
            while let Some(v) = rx.recv().await {
                if !send(v) {
                    return;
                }
            }
            match done.await {
                Ok(()) => {
                    let _ = send(json!({"status": "verifying sha256 digest"}))
                        && send(json!({"status": "writing manifest"}))
                        && send(json!({"status": "success"}));
                }
                Err(e) => {
                    let _ = send(json!({"error": e}));
                }
            }
        });
        Ok::<_, ApiError>(ndjson(lines))
    }
    .await;
    r.unwrap_or_else(|e| error_response(&st, e))
}

/// Ollama's model-management routes this server has no store behind.
pub async fn unsupported(State(st): App) -> Response {
    error_response(
        &st,
        ApiError {
            status: StatusCode::NOT_IMPLEMENTED,
            ..bad("not supported by ferrum: it serves the model it was started with")
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `options` map onto the sampling fields; load-time options are taken and left; a
    /// sampler this engine lacks is refused unless at its no-op value.
    #[test]
    fn options_map_and_refuse() {
        let mut chat = Map::new();
        let o = json!({"temperature": 0.2, "num_predict": 12, "repeat_penalty": 1.1,
            "stop": ["\n"], "num_ctx": 4096, "num_thread": 2, "typical_p": 1.0, "mirostat": 0});
        options(&o, &mut chat).unwrap();
        assert_eq!(chat["temperature"], json!(0.2));
        assert_eq!(chat["max_tokens"], json!(12));
        assert_eq!(chat["repetition_penalty"], json!(1.1));
        assert_eq!(chat["stop"], json!(["\n"]));
        assert!(!chat.contains_key("num_ctx"));
        // Open WebUI's: effort and a bias written as text; custom options are left out.
        let mut chat = Map::new();
        let o = json!({"reasoning_effort": "high", "logit_bias": "5432:100, 7: -2",
            "my_custom": 1, "seed": -1, "mirostat": null});
        options(&o, &mut chat).unwrap();
        assert_eq!(chat["reasoning_effort"], json!("high"));
        assert_eq!(chat["logit_bias"], json!({"5432": 100.0, "7": -2.0}));
        assert!(!chat.contains_key("my_custom") && !chat.contains_key("seed"));
        let mut chat = Map::new();
        options(&json!({"num_predict": -1}), &mut chat).unwrap();
        assert!(!chat.contains_key("max_tokens"));
        for bad in [
            json!({"typical_p": 0.5}),
            json!({"mirostat": 2}),
            json!({"num_predict": 0}),
            json!({"logit_bias": "12"}),
        ] {
            let e = options(&bad, &mut Map::new()).unwrap_err();
            assert!(e.param.unwrap().starts_with("options."), "{bad}");
        }
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(routes::rfc3339(0), "1970-01-01T00:00:00Z");
        // datetime.fromtimestamp(1796371872, UTC)
        assert_eq!(routes::rfc3339(1_796_371_872), "2026-12-04T08:11:12Z");
    }

    #[test]
    fn names_are_listed_with_a_tag() {
        assert_eq!(tagged("smollm2"), "smollm2:latest");
        assert_eq!(tagged("smollm2:135m"), "smollm2:135m");
        assert_eq!(tagged("org/repo"), "org/repo:latest");
        assert_eq!(tagged("org/repo:Q4_K_M"), "org/repo:Q4_K_M");
    }

    /// Tool calls come with object arguments and no ids; the chat request gets JSON text and
    /// an id for each, and a tool result's name.
    #[test]
    fn messages_translate_calls_and_results() {
        let list = vec![
            json!({"role": "user", "content": "Weather in Oslo?"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}),
            json!({"role": "tool", "content": "12 C", "tool_name": "get_weather"}),
        ];
        let m = messages(&list).unwrap();
        let call = &m[1]["tool_calls"][0];
        assert_eq!(call["function"]["arguments"], json!("{\"city\":\"Oslo\"}"));
        assert_eq!(call["id"], json!("call_1"));
        assert_eq!(m[2]["name"], json!("get_weather"));
        // Images become image_url parts, which the chat request's check reads.
        let m = messages(&[json!({"role": "user", "content": "x", "images": ["aGk="]})]).unwrap();
        assert_eq!(
            m[0]["content"][1]["image_url"]["url"],
            json!("data:;base64,aGk=")
        );
        // What Ollama does not know either is left out, as Ollama does.
        let m = messages(&[json!({"role": "user", "content": "x", "mood": "happy"})]).unwrap();
        assert_eq!(m[0], json!({"role": "user", "content": "x"}));
    }
}
