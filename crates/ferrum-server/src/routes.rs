//! The HTTP handlers: parse and check a request, submit it to the engine (once per choice),
//! and turn the engine's events into an OpenAI response body or an SSE stream.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrum_generate::{FinishReason, Output, OutputKind, Request, TokenLogprob, Usage};
use ferrum_tokenizer::{SpecialTokens, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::api::{self, Plan};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::reasoning::ReasoningSplitter;
use crate::tools::{CallStreamer, ToolEvent, Tools};
use crate::worker::{Handle, ModelCard};

pub struct AppState {
    pub handle: Handle,
    pub tokenizer: Tokenizer,
    pub metrics: Metrics,
    pub api_key: Option<String>,
    /// The chat template has `<think>` blocks: answers are split into reasoning and content.
    pub thinking: bool,
    /// Waiting requests beyond which new ones get 429.
    pub max_waiting: usize,
    pub next_id: AtomicU64,
    pub guard: crate::guard::BrowserGuard,
    /// Whether special-token texts in message content become control tokens.
    pub content_special: SpecialTokens,
    /// Most tokens a request may generate, all choices together; `None`: the KV pool.
    pub max_request_tokens: Option<usize>,
}

type App = State<Arc<AppState>>;

impl AppState {
    pub(crate) fn card(&self) -> Result<&ModelCard, ApiError> {
        if let Some(e) = self.handle.shared.load_error.get() {
            return Err(ApiError::not_ready(format!(
                "the model failed to load: {e}"
            )));
        }
        self.handle
            .shared
            .card
            .get()
            .ok_or_else(|| ApiError::not_ready("the model is still loading"))
    }

    pub(crate) fn check_model(&self, model: &str) -> Result<&ModelCard, ApiError> {
        let card = self.card()?;
        if model != card.id {
            return Err(ApiError::not_found(
                format!(
                    "model {model:?} is not served here (this server has {:?})",
                    card.id
                ),
                Some("model"),
            ));
        }
        Ok(card)
    }

    pub(crate) fn check_load(&self) -> Result<(), ApiError> {
        let waiting = self.handle.shared.stats.lock().map_or(0, |s| s.waiting);
        if waiting >= self.max_waiting {
            return Err(ApiError::overloaded(1));
        }
        Ok(())
    }

    /// The bound on `n × max_tokens`.
    pub(crate) fn request_tokens(&self, card: &ModelCard) -> usize {
        self.max_request_tokens.unwrap_or(card.kv_tokens).max(1)
    }

    pub(crate) fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", now())
    }
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The response, or the error's; failures are counted.
pub(crate) fn respond(st: &AppState, r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| {
        st.metrics.request_failed();
        tracing::info!(
            status = e.status.as_u16(),
            param = e.param.as_deref().unwrap_or(""),
            "request refused: {}",
            e.message
        );
        e.into_response()
    })
}

/// API-key check for the API routes when the server has a key: `Authorization: Bearer …`,
/// or `x-api-key: …` as Anthropic's clients send it.
pub async fn auth(State(st): App, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let h = req.headers();
        let bearer = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let x_api_key = h.get("x-api-key").and_then(|v| v.to_str().ok());
        let ok = bearer.is_some_and(|k| k == key) || x_api_key.is_some_and(|k| k == key);
        if !ok {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

pub(crate) fn body(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large("the request body is too large")
        } else {
            ApiError::bad_request(format!("cannot read the body: {e}"), None)
        }
    })
}

/// The chat page: plain HTML and JavaScript built into the binary, talking to
/// `/v1/chat/completions` with streaming; the conversation stays in the browser.
pub async fn chat_page() -> Response {
    axum::response::Html(include_str!("../static/chat.html")).into_response()
}

pub async fn health(State(st): App) -> Response {
    match st.card() {
        Ok(c) => {
            let s = st
                .handle
                .shared
                .stats
                .lock()
                .map(|s| *s)
                .unwrap_or_default();
            Json(json!({
                "status": "ok",
                "model": c.id,
                "arch": c.arch,
                "dtype": c.dtype,
                "context": c.context,
                "kv_cache_tokens": c.kv_tokens,
                "kv_cache_bytes": c.kv_bytes,
                "kv_blocks": s.kv_blocks,
                "kv_blocks_used": s.kv_blocks_used,
                "running": s.running,
                "waiting": s.waiting,
            }))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}

pub async fn metrics(State(st): App) -> Response {
    let s = st
        .handle
        .shared
        .stats
        .lock()
        .map(|s| *s)
        .unwrap_or_default();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(&s),
    )
        .into_response()
}

pub async fn models(State(st): App) -> Result<Response, ApiError> {
    let c = st.card()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": c.id,
            "object": "model",
            "created": c.created,
            "owned_by": "ferrum",
            "max_model_len": c.max_sequence,
        }]
    }))
    .into_response())
}

/// One generated choice, accumulated.
#[derive(Default)]
pub(crate) struct Choice {
    pub text: String,
    pub logprobs: Vec<(u32, TokenLogprob)>,
    pub finish: Option<FinishReason>,
    pub usage: Usage,
    pub first_token: Option<Instant>,
    /// The stop string that ended the text, if one did.
    pub stop_string: Option<String>,
}

impl Choice {
    /// Takes in one event of this choice; true when it was the last.
    pub(crate) fn absorb(&mut self, kind: &OutputKind) -> bool {
        match kind {
            OutputKind::Token {
                token,
                text,
                logprob,
            } => {
                self.first_token.get_or_insert_with(Instant::now);
                self.text.push_str(text);
                if let Some(lp) = logprob {
                    self.logprobs.push((*token, lp.clone()));
                }
                false
            }
            OutputKind::Finished {
                reason,
                text,
                usage,
                stop_string,
            } => {
                self.stop_string = stop_string.clone();
                self.text.push_str(text);
                self.finish = Some(*reason);
                self.usage = *usage;
                true
            }
        }
    }
}

pub(crate) fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// Submits one engine request per choice; returns a channel of `(choice, event)`.
pub(crate) async fn launch(
    st: &AppState,
    plans: Vec<Request>,
) -> Result<mpsc::UnboundedReceiver<(usize, Output)>, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    for (i, req) in plans.into_iter().enumerate() {
        let (_, mut events) = st.handle.submit(req).await?;
        let tx = tx.clone();
        // Forward until the engine finishes or the consumer is gone; either way `events` is
        // dropped and the worker cancels whatever is still running.
        tokio::spawn(async move {
            while let Some(o) = events.recv().await {
                if tx.send((i, o)).is_err() {
                    break;
                }
            }
        });
    }
    Ok(rx)
}

/// `n` engine requests from one plan; with a seed, choice `i` uses `seed + i`.
pub(crate) fn choices(plan: &Plan) -> Vec<Request> {
    (0..plan.n)
        .map(|i| {
            let mut r = plan.base.clone();
            r.params.seed = plan.base.params.seed.map(|s| s.wrapping_add(i as u64));
            r
        })
        .collect()
}

pub(crate) fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

fn chat_logprobs(tok: &Tokenizer, lps: &[(u32, TokenLogprob)]) -> Value {
    let entry = |id: u32, lp: f32| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|(id, lp)| {
            let mut e = entry(*id, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

fn completion_logprobs(tok: &Tokenizer, lps: &[(u32, TokenLogprob)], offset0: usize) -> Value {
    let mut offset = offset0;
    let (mut tokens, mut lp, mut top, mut offs) = (vec![], vec![], vec![], vec![]);
    for (id, l) in lps {
        let t = token_text(tok, *id);
        offs.push(offset);
        offset += t.len();
        tokens.push(t);
        lp.push(l.logprob);
        let m: serde_json::Map<String, Value> = l
            .top
            .iter()
            .map(|&(id, v)| (token_text(tok, id), json!(v)))
            .collect();
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": top, "text_offset": offs})
}

/// Usage of `u` (choices in prompt-major order, `n` per prompt): each prompt counts once.
pub(crate) fn usage_json(u: &[Usage], n: usize) -> Value {
    let per_prompt = u.iter().step_by(n.max(1));
    let prompt: usize = per_prompt.clone().map(|x| x.prompt_tokens).sum();
    let cached: usize = per_prompt.map(|x| x.cached_tokens).sum();
    let completion: usize = u.iter().map(|x| x.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// The assistant message for an answer, and its finish reason: with tools, calls are parsed
/// out (`finish_reason: "tool_calls"`) and content is null when there is none.
pub(crate) fn assistant_message(
    st: &AppState,
    tools: Option<&Tools>,
    text: &str,
    finish: Option<FinishReason>,
) -> (Value, Option<&'static str>) {
    let reason = finish.map(finish_name);
    let (reasoning, text) = if st.thinking {
        ReasoningSplitter::split(text)
    } else {
        (None, text.to_string())
    };
    let plain = |content: Value| {
        let mut m = json!({"role": "assistant", "content": content});
        if let Some(r) = &reasoning {
            m["reasoning_content"] = json!(r);
        }
        m
    };
    let Some(t) = tools else {
        return (plain(json!(text)), reason);
    };
    let (content, calls) = t.parse_output(&text);
    if calls.is_empty() {
        return (plain(json!(text)), reason);
    }
    let calls: Vec<Value> = calls
        .into_iter()
        .map(|c| {
            json!({
                "id": st.new_id("call"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect();
    let mut m = plain(json!(content));
    m["tool_calls"] = json!(calls);
    (m, Some("tool_calls"))
}

/// The conversation as prompt ids, rendered off the async threads: the render has its own
/// thread and deadline (the template's sandbox), and this waits for it without holding up
/// other requests.
pub(crate) async fn render_prompt(
    st: &Arc<AppState>,
    messages: Vec<Value>,
    kwargs: serde_json::Map<String, Value>,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let st = st.clone();
    let gen = add_generation_prompt;
    let ids = tokio::task::spawn_blocking(move || match st.content_special {
        // `template_inputs` escaped the request's strings already.
        SpecialTokens::Text => st.tokenizer.chat_prompt_escaped(&messages, gen, &kwargs),
        SpecialTokens::Control => {
            st.tokenizer
                .chat_prompt(&messages, gen, &kwargs, SpecialTokens::Control)
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("the prompt render failed: {e}")))??;
    Ok(ids)
}

/// Waits for every choice to finish.
pub(crate) async fn collect(
    mut rx: mpsc::UnboundedReceiver<(usize, Output)>,
    n: usize,
) -> Result<Vec<Choice>, ApiError> {
    let mut out: Vec<Choice> = (0..n).map(|_| Choice::default()).collect();
    let mut done = 0;
    while done < n {
        let Some((i, o)) = rx.recv().await else {
            return Err(ApiError::internal("the engine dropped the request"));
        };
        if out[i].absorb(&o.kind) {
            done += 1;
        }
    }
    Ok(out)
}

/// Metrics and the one log line of a finished request.
/// `choices` come `per_prompt` to a prompt; each prompt counts once.
pub(crate) fn record(st: &AppState, id: &str, t0: Instant, choices: &[Choice], per_prompt: usize) {
    let prompt: usize = choices
        .iter()
        .step_by(per_prompt.max(1))
        .map(|c| c.usage.prompt_tokens)
        .sum();
    let completion: usize = choices.iter().map(|c| c.usage.completion_tokens).sum();
    let ttft = choices
        .iter()
        .filter_map(|c| c.first_token)
        .min()
        .map(|t| (t - t0).as_secs_f64());
    let secs = t0.elapsed().as_secs_f64();
    st.metrics.request_done(prompt, completion, ttft, secs);
    let finish: Vec<&str> = choices
        .iter()
        .filter_map(|c| c.finish.map(finish_name))
        .collect();
    tracing::info!(
        id,
        prompt_tokens = prompt,
        completion_tokens = completion,
        ttft_ms = ttft.map_or(0, |t| (t * 1e3) as u64),
        latency_ms = (secs * 1e3) as u64,
        finish = finish.join(",").as_str(),
        "request done"
    );
}

/// A chat-shaped request checked, rendered and planned: what Chat Completions, Responses and
/// Messages each submit once they have parsed their own shapes into an [`api::ChatRequest`].
pub(crate) struct Prepared {
    pub card: ModelCard,
    pub plan: Plan,
    /// The tools in play, when a call may be made.
    pub tools: Option<Tools>,
    pub logprobs: Option<usize>,
}

/// The prompt ids `req` renders to: chat template, tools, special-token rules.
pub(crate) async fn chat_prompt_ids(
    st: &Arc<AppState>,
    req: &api::ChatRequest,
    tools: Option<&Tools>,
) -> Result<Vec<u32>, ApiError> {
    let (messages, kwargs) = req.template_inputs(&st.tokenizer, tools, st.content_special)?;
    render_prompt(st, messages, kwargs, true).await
}

pub(crate) async fn prepare_chat(
    st: &Arc<AppState>,
    req: &api::ChatRequest,
) -> Result<Prepared, ApiError> {
    let card = st.check_model(&req.model)?.clone();
    let tools = req.tools()?;
    let constraint = req.constraint(tools.as_ref())?;
    let logprobs = req.logprobs()?;
    let prompt = chat_prompt_ids(st, req, tools.as_ref()).await?;
    let limits = api::Limits {
        max_sequence: card.max_sequence,
        request_tokens: st.request_tokens(&card),
    };
    let mut plan = req
        .sampling
        .plan(prompt, limits, card.vocab_size, logprobs)?;
    plan.base.constraint = if st.thinking {
        constraint.map(|c| c.after_reasoning())
    } else {
        constraint
    };
    Ok(Prepared {
        card,
        plan,
        tools: tools.filter(|t| t.active()),
        logprobs,
    })
}

pub async fn chat(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = chat_inner(st.clone(), b).await;
    respond(&st, r)
}

async fn chat_inner(
    st: Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let bytes = body(b)?;
    let req: api::ChatRequest = api::parse(&bytes, api::CHAT_FIELDS, true)?;
    let Prepared {
        card,
        plan,
        tools,
        logprobs,
    } = prepare_chat(&st, &req).await?;
    st.check_load()?;
    let rx = launch(&st, choices(&plan)).await?;
    let id = st.new_id("chatcmpl");
    let created = now();
    if !plan.stream {
        let out = collect(rx, plan.n).await?;
        record(&st, &id, t0, &out, plan.n);
        let usages: Vec<Usage> = out.iter().map(|c| c.usage).collect();
        let choices: Vec<Value> = out
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (message, finish) = assistant_message(&st, tools.as_ref(), &c.text, c.finish);
                json!({
                    "index": i,
                    "message": message,
                    "logprobs": logprobs.map(|_| chat_logprobs(&st.tokenizer, &c.logprobs)),
                    "finish_reason": finish,
                })
            })
            .collect();
        return Ok(Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": card.id,
            "choices": choices,
            "usage": usage_json(&usages, plan.n),
        }))
        .into_response());
    }
    let chunk = {
        let (id, model) = (id.clone(), card.id.clone());
        move |choices: Value| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": choices,
            })
        }
    };
    let first: Vec<Value> = (0..plan.n)
        .map(|i| {
            chunk(json!([{
                "index": i, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null,
            }]))
        })
        .collect();
    let tok_st = st.clone();
    // With tools in play, calls are picked out as they are generated (`CallStreamer`); the
    // whole answer is kept for the final parse, which sends any call the stream missed.
    let mut held: Vec<String> = vec![String::new(); plan.n];
    let mut streamers: Vec<Option<CallStreamer>> = (0..plan.n)
        .map(|_| tools.as_ref().map(CallStreamer::new))
        .collect();
    let mut streamed_calls = vec![0usize; plan.n];
    let thinking = st.thinking;
    let mut splitters = vec![ReasoningSplitter::default(); plan.n];
    // Reasoning and answer text as delta fields (one chunk may carry both).
    let text_delta = move |r: String, c: String| {
        let mut d = serde_json::Map::new();
        if !r.is_empty() {
            d.insert("reasoning_content".into(), json!(r));
        }
        if !c.is_empty() || r.is_empty() {
            d.insert("content".into(), json!(c));
        }
        Value::Object(d)
    };
    let delta_chunk = {
        let chunk = chunk.clone();
        move |i: usize, delta: Value| {
            chunk(json!([{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}]))
        }
    };
    let piece = move |i: usize, o: &Output| -> Vec<Value> {
        let mut out = Vec::new();
        let (text, last) = match &o.kind {
            OutputKind::Token { text, .. } => (text, false),
            OutputKind::Finished { text, .. } => (text, true),
        };
        held[i].push_str(text);
        let (mut r, mut c) = if thinking {
            splitters[i].push(text)
        } else {
            (String::new(), text.clone())
        };
        if last && thinking {
            let (r2, c2) = splitters[i].finish();
            r.push_str(&r2);
            c.push_str(&c2);
        }
        if let Some(cs) = streamers[i].as_mut() {
            if !r.is_empty() {
                out.push(delta_chunk(i, text_delta(r, String::new())));
            }
            let mut events = cs.push(&c);
            let mut tail = Vec::new();
            if last {
                tail = cs.finish();
            }
            // The final parse: calls the stream could not follow are sent whole.
            let mut missed = Vec::new();
            if last {
                let (message, _) = assistant_message(&tok_st, tools.as_ref(), &held[i], None);
                let calls = message["tool_calls"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let streamed_here = events
                    .iter()
                    .filter(|e| matches!(e, ToolEvent::Start(_)))
                    .count();
                missed = calls
                    .into_iter()
                    .skip(streamed_calls[i] + streamed_here)
                    .collect();
            }
            if missed.is_empty() {
                events.extend(tail);
            }
            for e in events {
                match e {
                    ToolEvent::Text(x) => out.push(delta_chunk(i, json!({"content": x}))),
                    ToolEvent::Start(name) => {
                        let call = json!({"index": streamed_calls[i], "id": tok_st.new_id("call"),
                            "type": "function", "function": {"name": name, "arguments": ""}});
                        streamed_calls[i] += 1;
                        out.push(delta_chunk(i, json!({"tool_calls": [call]})));
                    }
                    ToolEvent::Args(a) => {
                        let call =
                            json!({"index": streamed_calls[i] - 1, "function": {"arguments": a}});
                        out.push(delta_chunk(i, json!({"tool_calls": [call]})));
                    }
                    ToolEvent::End => {}
                }
            }
            for mut c in missed {
                c["index"] = json!(streamed_calls[i]);
                streamed_calls[i] += 1;
                out.push(delta_chunk(i, json!({"tool_calls": [c]})));
            }
            if let OutputKind::Finished { reason, .. } = &o.kind {
                let finish = if streamed_calls[i] > 0 {
                    "tool_calls"
                } else {
                    finish_name(*reason)
                };
                out.push(chunk(
                    json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": finish}]),
                ));
            }
            return out;
        }
        match &o.kind {
            OutputKind::Token { token, logprob, .. } => {
                if r.is_empty() && c.is_empty() && logprob.is_none() {
                    return Vec::new();
                }
                let lp = logprob
                    .as_ref()
                    .map(|l| chat_logprobs(&tok_st.tokenizer, &[(*token, l.clone())]));
                vec![chunk(json!([{
                    "index": i, "delta": text_delta(r, c), "logprobs": lp, "finish_reason": null,
                }]))]
            }
            OutputKind::Finished { reason, .. } => {
                let delta = if r.is_empty() && c.is_empty() {
                    json!({})
                } else {
                    text_delta(r, c)
                };
                vec![chunk(json!([{
                    "index": i,
                    "delta": delta,
                    "logprobs": null,
                    "finish_reason": finish_name(*reason),
                }]))]
            }
        }
    };
    let final_usage = {
        let (id, model) = (id.clone(), card.id.clone());
        move |u: Value| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [], "usage": u,
            })
        }
    };
    Ok(sse(
        st,
        id,
        t0,
        rx,
        plan.n,
        first,
        piece,
        plan.include_usage,
        plan.n,
        final_usage,
    ))
}

/// Streams `first`, then each event through `piece`, then the usage chunk if asked (choices
/// come `per_prompt` to a prompt), then `[DONE]`. A client that goes away drops the stream,
/// which cancels the requests.
#[allow(clippy::too_many_arguments)]
fn sse(
    st: Arc<AppState>,
    id: String,
    t0: Instant,
    mut rx: mpsc::UnboundedReceiver<(usize, Output)>,
    n: usize,
    first: Vec<Value>,
    mut piece: impl FnMut(usize, &Output) -> Vec<Value> + Send + 'static,
    include_usage: bool,
    per_prompt: usize,
    usage_chunk: impl Fn(Value) -> Value + Send + 'static,
) -> Response {
    let (tx, out) = mpsc::unbounded_channel::<Event>();
    tokio::spawn(async move {
        let send = |v: Value| tx.send(Event::default().data(v.to_string())).is_ok();
        for v in first {
            if !send(v) {
                return;
            }
        }
        let mut choices: Vec<Choice> = (0..n).map(|_| Choice::default()).collect();
        let mut done = 0;
        while done < n {
            let Some((i, o)) = rx.recv().await else {
                return;
            };
            if choices[i].absorb(&o.kind) {
                done += 1;
            }
            for v in piece(i, &o) {
                if !send(v) {
                    return;
                }
            }
        }
        record(&st, &id, t0, &choices, per_prompt);
        if include_usage {
            let usages: Vec<Usage> = choices.iter().map(|c| c.usage).collect();
            if !send(usage_chunk(usage_json(&usages, per_prompt))) {
                return;
            }
        }
        let _ = tx.send(Event::default().data("[DONE]"));
    });
    let stream = UnboundedReceiverStream::new(out).map(Ok::<_, Infallible>);
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response()
}

pub async fn completions(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = completions_inner(st.clone(), b).await;
    respond(&st, r)
}

async fn completions_inner(
    st: Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let bytes = body(b)?;
    let req: api::CompletionRequest = api::parse(&bytes, api::COMPLETION_FIELDS, true)?;
    let card = st.check_model(&req.model)?.clone();
    req.check_supported()?;
    let logprobs = req.logprobs()?;
    let prompts = req.prompts(&st.tokenizer)?;
    let mut reqs = Vec::new();
    let mut plan0 = None;
    let limits = api::Limits {
        max_sequence: card.max_sequence,
        request_tokens: st.request_tokens(&card) / prompts.len().max(1),
    };
    for p in prompts {
        let plan = req
            .sampling
            .plan(p, limits, card.vocab_size, logprobs)
            .map_err(|mut e| {
                if e.param.as_deref() == Some("messages") {
                    e.param = Some("prompt".into());
                }
                e
            })?;
        reqs.extend(choices(&plan));
        plan0.get_or_insert(plan);
    }
    let Some(plan) = plan0 else {
        return Err(ApiError::param("prompt", "the prompt is empty"));
    };
    st.check_load()?;
    let total = reqs.len();
    let rx = launch(&st, reqs).await?;
    let id = st.new_id("cmpl");
    let created = now();
    if !plan.stream {
        let out = collect(rx, total).await?;
        record(&st, &id, t0, &out, plan.n);
        let choices: Vec<Value> = out
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "index": i,
                    "text": c.text,
                    "logprobs": logprobs.map(|_| completion_logprobs(&st.tokenizer, &c.logprobs, 0)),
                    "finish_reason": c.finish.map(finish_name),
                })
            })
            .collect();
        let usages: Vec<Usage> = out.iter().map(|c| c.usage).collect();
        return Ok(Json(json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": card.id,
            "choices": choices,
            "usage": usage_json(&usages, plan.n),
        }))
        .into_response());
    }
    let chunk = {
        let (id, model) = (id.clone(), card.id.clone());
        move |choices: Value, usage: Option<Value>| {
            let mut v = json!({
                "id": id, "object": "text_completion", "created": created,
                "model": model, "choices": choices,
            });
            if let Some(u) = usage {
                v["usage"] = u;
            }
            v
        }
    };
    let c2 = chunk.clone();
    let tok_st = st.clone();
    let piece = move |i: usize, o: &Output| -> Vec<Value> {
        match &o.kind {
            OutputKind::Token {
                token,
                text,
                logprob,
            } => {
                if text.is_empty() && logprob.is_none() {
                    return Vec::new();
                }
                let lp = logprob
                    .as_ref()
                    .map(|l| completion_logprobs(&tok_st.tokenizer, &[(*token, l.clone())], 0));
                vec![chunk(
                    json!([{"index": i, "text": text, "logprobs": lp, "finish_reason": null}]),
                    None,
                )]
            }
            OutputKind::Finished { reason, text, .. } => vec![chunk(
                json!([{"index": i, "text": text, "logprobs": null, "finish_reason": finish_name(*reason)}]),
                None,
            )],
        }
    };
    let usage_chunk = move |u: Value| c2(json!([]), Some(u));
    Ok(sse(
        st,
        id,
        t0,
        rx,
        total,
        Vec::new(),
        piece,
        plan.include_usage,
        plan.n,
        usage_chunk,
    ))
}

/// Standard base64 of little-endian f32s (what the OpenAI clients ask for by default).
fn base64_f32(v: &[f32]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for k in 0..4 {
            if k <= c.len() {
                out.push(T[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub async fn embeddings(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = embeddings_inner(st.clone(), b).await;
    respond(&st, r)
}

async fn embeddings_inner(
    st: Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body(b)?;
    let req: api::EmbeddingRequest = api::parse(&bytes, api::EMBEDDING_FIELDS, false)?;
    let card = st.check_model(&req.model)?.clone();
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::param(
                "encoding_format",
                format!("encoding_format {other:?} (float or base64)"),
            ))
        }
    };
    let inputs = match &req.input {
        api::EmbeddingInput::One(s) => vec![s.clone()],
        api::EmbeddingInput::Many(v) => v.clone(),
    };
    if inputs.is_empty() {
        return Err(ApiError::param("input", "input must not be empty"));
    }
    let mut data = Vec::new();
    let mut tokens = 0;
    for (i, text) in inputs.iter().enumerate() {
        let ids = st.tokenizer.encode(text, true)?;
        if ids.is_empty() {
            return Err(ApiError::param("input", format!("input {i} is empty")));
        }
        if ids.len() > card.context {
            return Err(ApiError::param(
                "input",
                format!(
                    "input {i} is {} tokens; the context holds {}",
                    ids.len(),
                    card.context
                ),
            ));
        }
        tokens += ids.len();
        let v = st.handle.embed(ids).await?;
        if let Some(d) = req.dimensions {
            if d != v.len() as i64 {
                return Err(ApiError::param(
                    "dimensions",
                    format!("this model's embeddings have {} dimensions", v.len()),
                ));
            }
        }
        let embedding = if base64 {
            json!(base64_f32(&v))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": card.id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::base64_f32;

    #[test]
    fn base64_matches_the_rfc_alphabet_and_padding() {
        // 1.0f32 = 00 00 80 3f → "AACAPw=="
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[0.0, 1.0]), "AAAAAAAAgD8=");
    }
}
