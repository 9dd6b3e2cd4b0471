//! The one request pipeline every API surface runs on, and the routes of no API in
//! particular: the server's state, auth, health, metrics, models, the chat page; a chat
//! request checked, rendered and planned (`prepare_chat`), submitted once per choice
//! (`launch`), its events accumulated (`Choice`, `collect`) and recorded (`record`). The API
//! modules (`openai`, `responses`, `anthropic`, `tokenize`) parse their own shapes into it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrum_generate::{FinishReason, Output, OutputKind, Request, TokenLogprob, Usage};
use ferrum_tokenizer::{SpecialTokens, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::answer::{AnswerFormat, Reading};
use crate::api::{self, Plan};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::tools::Tools;
use crate::worker::{EmbedInput, Handle, ModelCard, ModelKind, VisionCard};
use ferrum_generate::Constraint;

pub struct AppState {
    pub handle: Handle,
    /// The names clients may give in `model`.
    pub names: ModelNames,
    /// How Ollama's `/api/pull` downloads (the CLI's store), when it may.
    pub pull: Option<crate::ollama::Pull>,
    /// Held by the pull running now (one at a time).
    pub pulling: Arc<tokio::sync::Mutex<()>>,
    pub tokenizer: Tokenizer,
    pub metrics: Metrics,
    pub api_key: Option<String>,
    /// How answers are split into reasoning, content and calls (`<think>` blocks where the
    /// chat template has them, harmony channels where the vocabulary has them).
    pub format: crate::answer::AnswerFormat,
    /// Waiting requests beyond which new ones get 429.
    pub max_waiting: usize,
    pub next_id: AtomicU64,
    pub guard: crate::guard::BrowserGuard,
    /// Whether special-token texts in message content become control tokens.
    pub content_special: SpecialTokens,
    /// Most tokens a request may generate, all choices together; `None`: the KV pool.
    pub max_request_tokens: Option<usize>,
    /// SIGTERM has come: no new requests, `/ready` 503, running ones finish.
    pub draining: AtomicBool,
    /// API handlers running now (a request being parsed, rendered or submitted, which the
    /// engine's counts do not see yet).
    pub in_handlers: AtomicUsize,
    /// Whether a chat model answers embedding requests (with the mean of its hidden states).
    pub embeddings_from_chat: bool,
    /// What a request's images may be.
    pub images: crate::images::ImageOptions,
}

type App = State<Arc<AppState>>;

/// A request's images with the model's handling of them.
pub(crate) type RequestImages = (Arc<VisionCard>, Vec<crate::images::ImageInput>);

/// The names the served model answers to: `--served-model-name` (repeatable, vLLM's flag;
/// the first is its id) and, with `--any-model-name`, any name at all (llama-server's way, for
/// clients that send their own model names, as Claude Code does).
#[derive(Debug, Clone)]
pub struct ModelNames {
    names: Vec<String>,
    any: bool,
}

impl ModelNames {
    /// `names` in order, each once.
    pub fn new(names: impl IntoIterator<Item = String>, any: bool) -> ModelNames {
        let mut out: Vec<String> = Vec::new();
        for n in names {
            if !out.contains(&n) {
                out.push(n);
            }
        }
        ModelNames { names: out, any }
    }

    /// Whether a request naming `model` is for the served model.
    pub fn answers(&self, model: &str) -> bool {
        self.any || self.names.iter().any(|n| n == model)
    }

    /// The names `/v1/models` lists.
    pub fn listed(&self) -> &[String] {
        &self.names
    }
}

impl AppState {
    /// The request's images checked (decodable, within the limits), then refused unless the
    /// model takes images; with the model's image handling where there are some.
    /// Decoding (and fetching, where URLs are allowed) runs on a blocking thread. A model
    /// without vision is told so after its data URLs are checked, and before any URL is
    /// fetched.
    pub(crate) async fn check_images(
        &self,
        req: &api::ChatRequest,
    ) -> Result<Option<RequestImages>, ApiError> {
        let parts = req.image_parts(&self.images)?;
        if parts.is_empty() {
            return Ok(None);
        }
        let opts = self.images;
        let Some(vision) = self.card()?.vision.clone() else {
            // Nothing is fetched for it; without fetching, a URL is refused as such.
            let fetches = opts.fetch_timeout.is_some();
            for (at, v) in parts
                .iter()
                .filter(|(_, v)| !(fetches && crate::images::is_url_part(v)))
            {
                crate::images::image_url(v, at, &opts)?;
            }
            return Err(crate::images::no_vision(&req.model));
        };
        let images = tokio::task::spawn_blocking(move || {
            parts
                .iter()
                .map(|(at, v)| crate::images::image_url(v, at, &opts))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| ApiError::internal(format!("decoding the images: {e}")))??;
        Ok(Some((vision, images)))
    }

    /// Whether a request is in a handler, running or waiting.
    pub(crate) fn busy(&self) -> bool {
        self.in_handlers.load(Ordering::SeqCst) > 0
            || self
                .handle
                .shared
                .stats
                .lock()
                .is_ok_and(|s| s.running + s.waiting > 0)
    }

    pub(crate) fn card(&self) -> Result<&ModelCard, ApiError> {
        if let Some(e) = self.handle.shared.load_error.get() {
            return Err(ApiError::not_ready(format!(
                "the model failed to load: {e}"
            )));
        }
        if let Some(e) = self.handle.shared.fault.get() {
            return Err(ApiError::not_ready(format!(
                "the model's device failed: {e}"
            )));
        }
        self.handle
            .shared
            .card
            .get()
            .ok_or_else(|| ApiError::not_ready("the model is still loading"))
    }

    /// The served model when `model` names it (any of its names, or any name at all with
    /// `--any-model-name`), with the name asked for as its id: answers carry the name the
    /// client used, as vLLM's do.
    pub(crate) fn check_model(&self, model: &str) -> Result<ModelCard, ApiError> {
        let card = self.card()?;
        // A LoRA adapter's name picks it: the base model's card, run through the adapter.
        let adapter = self
            .handle
            .shared
            .lora
            .lock()
            .ok()
            .and_then(|t| t.adapters.iter().find(|a| a.name == model).map(|a| a.id));
        if let Some(id) = adapter {
            let mut card = card.clone();
            card.id = model.to_string();
            card.adapter = id;
            return Ok(card);
        }
        if !self.names.answers(model) {
            return Err(ApiError::not_found(
                format!(
                    "model {model:?} is not served here (this server has {})",
                    self.names.listed().join(", ")
                ),
                Some("model"),
            ));
        }
        let mut card = card.clone();
        card.id = model.to_string();
        Ok(card)
    }

    /// [`Self::check_model`] for the routes that generate text: an embedding model or a
    /// reranker gets a 400 saying which routes it serves.
    pub(crate) fn check_generating(&self, model: &str) -> Result<ModelCard, ApiError> {
        let card = self.check_model(model)?;
        let serves = match card.kind {
            ModelKind::Generate => return Ok(card),
            ModelKind::Embed => "an embedding model: it serves /v1/embeddings",
            ModelKind::Rerank => "a reranker: it serves /v1/rerank and /v1/score",
        };
        Err(ApiError::bad_request(
            format!("model {model:?} does not generate text; it is {serves}"),
            Some("model"),
        ))
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
    if !key_given(st.api_key.as_deref(), req.headers()) {
        return error_for(&st, req.uri().path(), ApiError::unauthorized());
    }
    next.run(req).await
}

/// Whether the headers carry `key` (`Authorization: Bearer …` or `x-api-key: …`); true
/// when the server has none.
pub(crate) fn key_given(key: Option<&str>, h: &axum::http::HeaderMap) -> bool {
    let Some(key) = key else {
        return true;
    };
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = h.get("x-api-key").and_then(|v| v.to_str().ok());
    bearer.is_some_and(|k| k == key) || x_api_key.is_some_and(|k| k == key)
}

/// An error in the shape the clients of `path`'s API read.
fn error_for(st: &AppState, path: &str, e: ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        crate::anthropic::error_response(st, e)
    } else if path.starts_with("/api/") {
        crate::ollama::error_response(st, e)
    } else {
        e.into_response()
    }
}

/// Lets API requests in unless the server is draining (503, as for a server not ready), and
/// counts the handlers running, which the drain waits for.
pub async fn admit(State(st): App, req: HttpRequest, next: Next) -> Response {
    if st.draining.load(Ordering::SeqCst) {
        let e = ApiError::not_ready("the server is shutting down");
        return error_for(&st, req.uri().path(), e);
    }
    st.in_handlers.fetch_add(1, Ordering::SeqCst);
    let _done = InHandler(&st.in_handlers);
    next.run(req).await
}

/// Takes a handler off the count when it ends, however it ends.
struct InHandler<'a>(&'a AtomicUsize);

impl Drop for InHandler<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Readiness: 200 once the model is loaded and until SIGTERM; 503 while loading, after a
/// failed load and while draining (a balancer stops sending requests).
pub async fn ready(State(st): App) -> Response {
    if st.draining.load(Ordering::SeqCst) {
        return ApiError::not_ready("the server is shutting down").into_response();
    }
    match st.card() {
        Ok(_) => Json(json!({"status": "ready"})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Liveness: 200 while the process serves, loading and draining included.
pub async fn live() -> Response {
    Json(json!({"status": "alive"})).into_response()
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
        st.metrics.render(
            &s,
            st.handle.shared.card.get(),
            &st.handle
                .shared
                .lora
                .lock()
                .map(|t| t.clone())
                .unwrap_or_default(),
        ),
    )
        .into_response()
}

pub async fn models(State(st): App) -> Result<Response, ApiError> {
    let c = st.card()?;
    let mut data: Vec<Value> = st
        .names
        .listed()
        .iter()
        .map(|n| model_entry(c, n))
        .collect();
    // Adapters as vLLM lists them: their base model as `parent`, their path as `root`.
    let adapters = st
        .handle
        .shared
        .lora
        .lock()
        .map(|t| t.adapters.clone())
        .unwrap_or_default();
    for a in adapters {
        let mut e = model_entry(c, &a.name);
        e["created"] = a.created.into();
        e["created_at"] = rfc3339(a.created).into();
        e["parent"] = c.id.clone().into();
        e["root"] = a.path.clone().into();
        data.push(e);
    }
    // Anthropic's clients list models at the same path, with a page's fields around them.
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "has_more": false,
        "first_id": data.first().map(|e| e["id"].clone()),
        "last_id": data.last().map(|e| e["id"].clone()),
    }))
    .into_response())
}

/// `GET /v1/models/{id}`: one of the names the model answers to.
pub async fn model(
    State(st): App,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    let c = st.check_model(&id)?;
    let mut e = model_entry(&c, &id);
    if c.adapter != 0 {
        if let Some(base) = st.names.listed().first() {
            e["parent"] = base.clone().into();
        }
    }
    Ok(Json(e).into_response())
}

/// vLLM's `POST /v1/load_lora_adapter`: `{"lora_name", "lora_path"}` (a PEFT folder or a
/// llama.cpp GGUF LoRA on the server's disk). The adapter then answers to its name in
/// `model`.
pub async fn load_lora_adapter(
    State(st): App,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    let (name, path) = lora_fields(&body, true)?;
    st.card()?;
    if st.names.listed().contains(&name) {
        return Err(ApiError::bad_request(
            format!("{name:?} is the base model's name"),
            Some("lora_name"),
        ));
    }
    st.handle
        .lora(name.clone(), path.map(std::path::PathBuf::from))
        .await
        .map_err(|e| match e {
            ferrum_core::Error::InvalidRequest(m) => ApiError::bad_request(m, Some("lora_name")),
            // A missing, malformed or mismatched adapter: the request's path is at fault.
            other => ApiError::bad_request(other.to_string(), Some("lora_path")),
        })?;
    Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response())
}

/// vLLM's `POST /v1/unload_lora_adapter`: `{"lora_name"}`. Requests already running with it
/// finish; new ones get 404.
pub async fn unload_lora_adapter(
    State(st): App,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    let (name, _) = lora_fields(&body, false)?;
    st.card()?;
    let known = st
        .handle
        .shared
        .lora
        .lock()
        .is_ok_and(|t| t.adapters.iter().any(|a| a.name == name));
    if !known {
        return Err(ApiError::not_found(
            format!("no LoRA adapter named {name:?} is loaded"),
            Some("lora_name"),
        ));
    }
    st.handle.lora(name.clone(), None).await?;
    Ok(format!("Success: LoRA adapter '{name}' removed successfully.").into_response())
}

/// The adapter's name (which must not be a name the base model answers to) and, to load,
/// its path.
fn lora_fields(body: &Value, load: bool) -> Result<(String, Option<String>), ApiError> {
    let text = |key: &str| -> Result<String, ApiError> {
        match body.get(key) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            _ => Err(ApiError::bad_request(
                format!("{key} must be a non-empty string"),
                Some(key),
            )),
        }
    };
    let name = text("lora_name")?;
    let path = if load { Some(text("lora_path")?) } else { None };
    Ok((name, path))
}

/// A model as OpenAI's clients read it (`id`, `object`, `created`, `owned_by`) and as
/// Anthropic's do (`type`, `display_name`, `created_at`).
fn model_entry(c: &ModelCard, name: &str) -> Value {
    json!({
        "id": name,
        "object": "model",
        "created": c.created,
        "owned_by": "ferrum",
        "max_model_len": c.max_sequence,
        "type": "model",
        "display_name": name,
        "created_at": rfc3339(c.created),
    })
}

/// Seconds since the epoch as an RFC 3339 UTC time (`2026-12-04T08:11:12Z`).
pub(crate) fn rfc3339(secs: u64) -> String {
    let (y, m, d) = ferrum_tokenizer::chat::civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
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

/// [`render_prompt`] of a conversation with images: their processing (resizing) runs off
/// the async threads too, and the template's image markers become the model's placeholders.
pub(crate) async fn render_prompt_images(
    st: &Arc<AppState>,
    messages: Vec<Value>,
    kwargs: serde_json::Map<String, Value>,
    add_generation_prompt: bool,
    images: Option<RequestImages>,
) -> Result<(Vec<u32>, Vec<ferrum_image::Processed>), ApiError> {
    let Some((vision, images)) = images else {
        let ids = render_prompt(st, messages, kwargs, add_generation_prompt).await?;
        return Ok((ids, Vec::new()));
    };
    let st = st.clone();
    let gen = add_generation_prompt;
    tokio::task::spawn_blocking(move || {
        let processed = images
            .iter()
            .enumerate()
            .map(|(i, im)| {
                vision
                    .processor
                    .process(&im.image)
                    .map_err(|e| ApiError::param("messages", format!("image {}: {e}", i + 1)))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let expansions = vision.text.expansions(&processed);
        let expand = (vision.text.marker.as_str(), &expansions[..]);
        let escaped = st.content_special == SpecialTokens::Text;
        let ids = st.tokenizer.chat_prompt_with_images(
            &messages,
            gen,
            &kwargs,
            st.content_special,
            escaped,
            expand,
        )?;
        Ok((ids, processed))
    })
    .await
    .map_err(|e| ApiError::internal(format!("the prompt render failed: {e}")))?
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
    /// How the answer is to be split (plain for a raw prompt, else the model's way, starting
    /// inside its reasoning where the prompt opened it).
    pub reading: Reading,
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
    Ok(chat_prompt(st, req, tools).await?.0)
}

/// [`chat_prompt_ids`] with the request's images processed for the model's vision tower (in
/// order; their placeholders are in the ids).
pub(crate) async fn chat_prompt(
    st: &Arc<AppState>,
    req: &api::ChatRequest,
    tools: Option<&Tools>,
) -> Result<(Vec<u32>, Vec<ferrum_image::Processed>), ApiError> {
    let images = st.check_images(req).await?;
    let (messages, kwargs) = req.template_inputs(&st.tokenizer, tools, st.content_special)?;
    render_prompt_images(st, messages, kwargs, true, images).await
}

pub(crate) async fn prepare_chat(
    st: &Arc<AppState>,
    req: &api::ChatRequest,
) -> Result<Prepared, ApiError> {
    prepare_with(st, req, PromptIds::Render { before: Vec::new() }).await
}

/// Where a chat-shaped request's prompt ids come from.
pub(crate) enum PromptIds {
    /// The conversation through the chat template, after `before` (Ollama's `context`: the
    /// ids of an earlier exchange).
    Render { before: Vec<u32> },
    /// Ids given as they are (Ollama's `raw` prompts): no template, and the answer read as
    /// plain text.
    Raw(Vec<u32>),
}

/// [`prepare_chat`] with the prompt's ids from `ids`.
pub(crate) async fn prepare_with(
    st: &Arc<AppState>,
    req: &api::ChatRequest,
    ids: PromptIds,
) -> Result<Prepared, ApiError> {
    let card = st.check_generating(&req.model)?;
    req.check_supported()?;
    let tools = req.tools()?;
    let raw = matches!(ids, PromptIds::Raw(_));
    let format = if raw { AnswerFormat::Plain } else { st.format };
    let harmony = format == AnswerFormat::Harmony;
    let constraint = req.constraint(tools.as_ref(), harmony)?;
    let logprobs = req.logprobs()?;
    let mut images = Vec::new();
    let prompt = match ids {
        PromptIds::Raw(ids) => ids,
        PromptIds::Render { mut before } => {
            let (ids, processed) = chat_prompt(st, req, tools.as_ref()).await?;
            images = processed;
            // After an earlier exchange's ids the conversation goes on: one BOS, at the start.
            let bos = st.tokenizer.bos_id();
            let skip =
                usize::from(!before.is_empty() && bos.is_some() && ids.first() == bos.as_ref());
            before.extend_from_slice(&ids[skip..]);
            before
        }
    };
    let limits = api::Limits {
        max_sequence: card.max_sequence,
        request_tokens: st.request_tokens(&card),
    };
    let mut plan = req
        .sampling
        .plan(prompt, limits, card.vocab_size, logprobs)?;
    plan.base.adapter = card.adapter;
    plan.base.images = images;
    // The prompt's last tokens as text, control tokens kept: whether it opened a reasoning
    // block the answer starts inside.
    let prompt = &plan.base.prompt;
    let tail = st
        .tokenizer
        .decode(&prompt[prompt.len().saturating_sub(8)..], false)
        .unwrap_or_default();
    let opened = !raw && format.opens_reasoning(&tail);
    plan.base.constraint = match format {
        _ if opened => constraint.map(after_opened_reasoning),
        AnswerFormat::Think => constraint.map(|c| c.after_reasoning()),
        // The analysis may take half the budget: the answer it leads to needs the rest.
        AnswerFormat::Harmony => {
            let max = plan.base.max_tokens / 2;
            constraint.map(|c| c.after_harmony_analysis(max))
        }
        // From the first token, with no reasoning before it; for Mistral, Gemma 4, DeepSeek
        // and Kimi K2 a forced call is written in the Hermes layout, which their answers'
        // parse reads too.
        AnswerFormat::Plain
        | AnswerFormat::Mistral
        | AnswerFormat::Gemma4
        | AnswerFormat::DeepSeek
        | AnswerFormat::Kimi => constraint,
    };
    // The markers the answer is split by are control tokens: it is parsed with their text
    // kept.
    plan.base.skip_special &= !format.keeps_control_text();
    Ok(Prepared {
        card,
        reading: Reading { format, opened },
        plan,
        tools: tools.filter(|t| t.active()),
        logprobs,
    })
}

/// `c` on an answer whose prompt opened a `<think>` block: reasoning up to `</think>` first
/// (held to no format; it may not contain `<`, as [`Constraint::after_reasoning`]'s), then
/// what `c` asks.
fn after_opened_reasoning(c: Constraint) -> Constraint {
    let body = match c {
        Constraint::JsonObject => format!("body: %json {}", serde_json::json!({"type": "object"})),
        Constraint::JsonSchema(s) => {
            format!("body: %json {}", ferrum_generate::grammar::compact(s))
        }
        Constraint::Lark(g) => g.replacen("start:", "body:", 1),
    };
    Constraint::Lark(format!(
        "start: thought body\nthought: /[^<]*/ \"</think>\" /[ \\n]*/\n{body}\n"
    ))
}

/// Each text as token ids, as embeddings read them (with the model's BOS rule).
pub(crate) fn encode_texts(st: &AppState, texts: &[String]) -> Result<Vec<Vec<u32>>, ApiError> {
    texts
        .iter()
        .map(|t| Ok(st.tokenizer.encode(t, true)?))
        .collect()
}

/// How a request may cut an over-long input: vLLM's `truncate_prompt_tokens` (a token
/// count, or -1 for the model's limit), Ollama's `truncate` (the limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Truncate {
    /// An input over the limit is refused, naming both lengths.
    No,
    /// Cut to the first N tokens (at most the limit).
    To(usize),
}

/// Cuts `ids` to `keep` tokens from the start; an encoder's closing special token stays last
/// ([`ferrum_models::encoder::cut_keeping_last`]), a chat model's input is cut plainly.
fn cut(st: &AppState, card: &ModelCard, ids: &mut Vec<u32>, keep: usize) {
    if keep == 0 {
        return;
    }
    if card.kind != ModelKind::Generate && ids.last().is_some_and(|&t| st.tokenizer.is_special(t)) {
        ferrum_models::encoder::cut_keeping_last(ids, keep);
    } else {
        ids.truncate(keep);
    }
}

/// Refuses an embedding request to a model that does not embed: a chat model unless the
/// server was started with `--embeddings-from-chat-model`, or a reranker.
fn check_embeds(st: &AppState, card: &ModelCard) -> Result<(), ApiError> {
    match card.kind {
        ModelKind::Embed => Ok(()),
        ModelKind::Generate if st.embeddings_from_chat => Ok(()),
        ModelKind::Generate => Err(ApiError::bad_request(
            format!(
                "model {:?} generates text; it is not an embedding model, and the mean of its \
                 hidden states is not a trained embedding. Serve an embedding model (BERT, \
                 XLM-RoBERTa families), or start the server with --embeddings-from-chat-model \
                 to get that mean anyway",
                card.id
            ),
            Some("model"),
        )),
        ModelKind::Rerank => Err(ApiError::bad_request(
            format!(
                "model {:?} is a reranker (a cross-encoder): it scores query-document pairs at \
                 /v1/rerank and /v1/score, and makes no embeddings",
                card.id
            ),
            Some("model"),
        )),
    }
}

/// The model's embedding of each input (token ids), and the tokens read: an input longer
/// than the model reads is cut as `truncate` says, else refused (naming `param`). The inputs
/// go to the worker as one command, which batches them with other requests'.
pub(crate) async fn embed_ids(
    st: &AppState,
    card: &ModelCard,
    inputs: Vec<Vec<u32>>,
    truncate: Truncate,
    param: &str,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    check_embeds(st, card)?;
    if inputs.is_empty() {
        return Err(ApiError::param(param, format!("{param} must not be empty")));
    }
    let mut batch = Vec::with_capacity(inputs.len());
    let mut tokens = 0;
    for (i, mut ids) in inputs.into_iter().enumerate() {
        if ids.is_empty() {
            return Err(ApiError::param(param, format!("{param} {i} is empty")));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= card.vocab_size) {
            return Err(ApiError::param(
                param,
                format!("{param} {i}: token {bad} is outside the vocabulary"),
            ));
        }
        match truncate {
            Truncate::To(n) => cut(st, card, &mut ids, n.min(card.context)),
            Truncate::No if ids.len() > card.context => {
                return Err(ApiError::param(
                    param,
                    format!(
                        "{param} {i} is {} tokens; the model reads at most {} (set \
                         truncate_prompt_tokens to cut it)",
                        ids.len(),
                        card.context
                    ),
                ))
            }
            Truncate::No => {}
        }
        tokens += ids.len();
        batch.push(EmbedInput { ids, types: None });
    }
    let out = st.handle.embed(batch, false).await?;
    Ok((out, tokens))
}

/// A reranker's relevance score of each document for `query` (a cross-encoder's: the
/// sigmoid of its logit, as sentence-transformers' `CrossEncoder` gives it; a decoder
/// reranker's: its prompt's yes/no softmax) and the tokens read. A pair over the model's
/// limit is refused naming both lengths, or with `truncate` has its document cut.
pub(crate) async fn score_pairs(
    st: &AppState,
    card: &ModelCard,
    pairs: &[(&str, &str)],
    truncate: Truncate,
) -> Result<(Vec<f32>, usize), ApiError> {
    if card.kind != ModelKind::Rerank {
        return Err(ApiError::bad_request(
            format!(
                "model {:?} is not a reranker: scoring needs a cross-encoder (a \
                 *ForSequenceClassification model such as bge-reranker, or a Qwen3-Reranker)",
                card.id
            ),
            Some("model"),
        ));
    }
    if pairs.is_empty() {
        return Err(ApiError::param("documents", "documents must not be empty"));
    }
    let mut batch = Vec::with_capacity(pairs.len());
    let mut tokens = 0;
    // A decoder reranker's prompt keeps its closing part (after the document) when cut.
    let tail = match &card.rerank_prompt {
        Some(t) => {
            let after = t.rsplit_once("{document}").map_or("", |(_, a)| a);
            st.tokenizer.encode_rerank(after, "", "")?.len()
        }
        None => 1,
    };
    for (i, (query, d)) in pairs.iter().enumerate() {
        let (mut ids, mut types) = match &card.rerank_prompt {
            Some(t) => {
                let ids = st.tokenizer.encode_rerank(t, query, d)?;
                let types = vec![0; ids.len()];
                (ids, types)
            }
            None => st.tokenizer.encode_pair(query, d)?,
        };
        let limit = match truncate {
            Truncate::To(n) => n.min(card.context),
            Truncate::No => card.context,
        };
        if ids.len() > limit {
            if truncate == Truncate::No {
                return Err(ApiError::param(
                    "documents",
                    format!(
                        "the query with document {i} is {} tokens; the model reads at most {} \
                         (set truncate_prompt_tokens to cut the document)",
                        ids.len(),
                        card.context
                    ),
                ));
            }
            // A cut that would leave the prompt's closing part alone is no cut: the pass
            // then refuses the input, naming both lengths.
            if tail < limit {
                ferrum_models::encoder::cut_keeping_tail(&mut ids, limit, tail);
            }
            types.truncate(ids.len());
        }
        tokens += ids.len();
        batch.push(EmbedInput {
            ids,
            types: card.rerank_prompt.is_none().then_some(types),
        });
    }
    let logits = st.handle.embed(batch, true).await?;
    let scores = logits
        .iter()
        .map(|l| ferrum_models::encoder::relevance(l))
        .collect();
    Ok((scores, tokens))
}
