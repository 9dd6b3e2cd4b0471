//! `ferrum serve`: an OpenAI-compatible HTTP server over the engine.
//!
//! HTTP (axum, tokio) → `routes` parses and checks a request (`api`), renders the chat
//! template and tokenizes → `worker` hands it to the engine's thread → the engine's events
//! come back per request → JSON body or SSE chunks. Errors take one shape (`error`); counters
//! and latency histograms are served at `/metrics` (`metrics`).

pub mod answer;
pub mod anthropic;
pub mod api;
pub mod dsml;
pub mod error;
pub mod fleet;
pub mod gemma;
pub mod guard;
pub mod images;
pub mod kv_events;
pub mod metrics;
pub mod ollama;
pub mod openai;
pub mod reasoning;
pub mod rerank;
pub mod responses;
pub mod routes;
pub mod tokenize;
pub mod tools;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use ferrum_core::Result;
use ferrum_tokenizer::{SpecialTokens, Tokenizer};

#[derive(Clone)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Required as `Authorization: Bearer …` on the API routes when set.
    pub api_key: Option<String>,
    /// The id clients name in `model`.
    pub model_id: String,
    /// More names the model answers to (`--served-model-name` after the first).
    pub model_aliases: Vec<String>,
    /// Answer whatever name a request gives (`--any-model-name`).
    pub any_model_name: bool,
    /// Ollama's `/api/pull`: downloads a model reference into the local store.
    pub pull: Option<ollama::Pull>,
    pub max_body_bytes: usize,
    /// Requests allowed to wait for KV room before new ones get 429.
    pub max_waiting: usize,
    /// Host names accepted besides IP literals and localhost (checked when bound to a
    /// loopback address).
    pub allowed_hosts: Vec<String>,
    /// Origins that may call the API besides the server's own (`*`: any).
    pub allowed_origins: Vec<String>,
    /// Whether special-token texts in message content become control tokens.
    pub content_special: SpecialTokens,
    /// Most tokens one request may ask to generate, all choices together (`n × max_tokens`);
    /// `None`: the KV pool.
    pub max_request_tokens: Option<usize>,
    /// How long running requests may take to finish after SIGTERM.
    pub shutdown_grace: std::time::Duration,
    /// A ZMQ endpoint to publish the prefix cache's events on (`tcp://*:5557`).
    pub kv_events: Option<String>,
    /// Whether a chat model answers embedding requests with the mean of its hidden states
    /// (`--embeddings-from-chat-model`); otherwise they get a 400 saying why.
    pub embeddings_from_chat: bool,
    /// LoRA adapters at start, and the limits on them.
    pub lora: worker::LoraOptions,
    /// What a request's images may be.
    pub images: images::ImageOptions,
}

pub fn router(state: Arc<routes::AppState>, max_body: usize) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/rerank", post(rerank::rerank))
        .route("/rerank", post(rerank::rerank))
        .route("/v1/score", post(rerank::score))
        .route("/score", post(rerank::score))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{*id}", get(routes::model))
        .route("/v1/load_lora_adapter", post(routes::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(routes::unload_lora_adapter))
        .route("/v1/responses", post(responses::create))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/chat/completions/render", post(tokenize::render_chat))
        .route("/v1/completions/render", post(tokenize::render_completion))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/pull", post(ollama::pull))
        .route("/api/version", get(ollama::version))
        .route("/api/create", post(ollama::unsupported))
        .route("/api/copy", post(ollama::unsupported))
        .route("/api/delete", axum::routing::delete(ollama::unsupported))
        .route("/api/push", post(ollama::unsupported))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::auth,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::admit,
        ));
    Router::new()
        .merge(api)
        .route("/", get(routes::chat_page))
        .route("/health", get(routes::health))
        .route("/ready", get(routes::ready))
        .route("/live", get(routes::live))
        .route("/metrics", get(routes::metrics))
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(state.guard.clone()),
            guard::check,
        ))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// Binds, starts loading the model on the engine thread (`/health` answers 503 until it is
/// ready), and serves until SIGTERM or Ctrl-C; running requests finish first.
pub fn serve<B: ferrum_backend::Backend + 'static>(
    cfg: ServeConfig,
    tokenizer: Tokenizer,
    load: impl FnOnce() -> Result<worker::Served<B>> + Send + 'static,
) -> std::result::Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let served = rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
            .parse()
            .map_err(|e| format!("bad address {}:{}: {e}", cfg.host, cfg.port))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let kv_events = match &cfg.kv_events {
            Some(ep) => {
                let topic = format!("kv@{}:{}@{}", cfg.host, cfg.port, cfg.model_id);
                let tx = kv_events::start(ep, topic).await?;
                tracing::info!("publishing KV events on {ep}");
                Some(tx)
            }
            None => None,
        };
        let state = model_state(&cfg, tokenizer, load, kv_events);
        tracing::info!(
            "serving {:?} on http://{addr} (OpenAI API under /v1; /health, /metrics){}",
            cfg.model_id,
            if cfg.api_key.is_some() {
                ", API key required"
            } else {
                ""
            }
        );
        let engine = state.handle.clone();
        let app = router(state.clone(), cfg.max_body_bytes);
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(drain(state, cfg.shutdown_grace))
            .await
            .map_err(|e| format!("server error: {e}"));
        Ok::<_, String>((engine, served))
    })?;
    let (engine, served) = served;
    // Renders run on threads of their own with a deadline; none is waited for here.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    stop_engine(&engine);
    served
}

/// How long an exiting server waits for its engine's thread to give its model and device
/// back (a step running then finishes first).
const ENGINE_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Stops the engine's worker before the process exits (see [`worker::Handle::stop`]).
pub(crate) fn stop_engine(engine: &worker::Handle) {
    if !engine.stop(ENGINE_STOP_WAIT) {
        tracing::warn!("the engine did not stop within {ENGINE_STOP_WAIT:?}; exiting");
    }
}

/// One model's server state: its engine's worker started on its own thread (loading there;
/// the state answers 503 until it is ready), its tokenizer, names and limits from `cfg`.
pub fn model_state<B: ferrum_backend::Backend + 'static>(
    cfg: &ServeConfig,
    tokenizer: Tokenizer,
    load: impl FnOnce() -> Result<worker::Served<B>> + Send + 'static,
    kv_events: Option<kv_events::Sender>,
) -> Arc<routes::AppState> {
    let handle = worker::spawn(cfg.model_id.clone(), load, kv_events, cfg.lora.clone());
    let format = answer::AnswerFormat::detect(&tokenizer);
    if let Some(t) = tokenizer.chat_template() {
        // A template that cannot render a four-turn chat within its limits is hostile or
        // broken: chat requests get that error at once instead of running it again.
        if let Err(e) = t.dry_run() {
            tracing::warn!("chat requests will be refused: {e}");
        }
    }
    Arc::new(routes::AppState {
        handle,
        names: routes::ModelNames::new(
            std::iter::once(cfg.model_id.clone()).chain(cfg.model_aliases.iter().cloned()),
            cfg.any_model_name,
        ),
        pull: cfg.pull.clone(),
        pulling: Default::default(),
        format,
        tokenizer,
        metrics: Default::default(),
        api_key: cfg.api_key.clone(),
        max_waiting: cfg.max_waiting,
        next_id: AtomicU64::new(0),
        guard: guard::BrowserGuard::new(&cfg.host, &cfg.allowed_hosts, &cfg.allowed_origins),
        content_special: cfg.content_special,
        max_request_tokens: cfg.max_request_tokens,
        draining: AtomicBool::new(false),
        in_handlers: AtomicUsize::new(0),
        embeddings_from_chat: cfg.embeddings_from_chat,
        images: cfg.images,
    })
}

/// Resolves when the server should stop accepting connections: after SIGTERM or Ctrl-C,
/// once the requests then running have finished (or `grace` has passed). Meanwhile it keeps
/// serving: `/ready` says 503 (a balancer takes the replica out), `/health` and `/live` stay
/// 200, new API requests get 503. Then axum finishes the open responses (streams end with
/// their usage and `[DONE]`) and `serve` returns.
async fn drain(st: Arc<routes::AppState>, grace: std::time::Duration) {
    shutdown().await;
    st.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        if !st.busy() {
            tracing::info!("drained; exiting");
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!("shutdown grace of {grace:?} passed with requests running; exiting");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // A response still open once everything is done (a client not reading) does not hold
    // the exit up past a few seconds.
    let engine = st.handle.clone();
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        tracing::warn!("responses still open; exiting");
        let _ = tokio::task::spawn_blocking(move || stop_engine(&engine)).await;
        std::process::exit(0);
    });
}

pub(crate) async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down; finishing running requests (a second signal stops at once)");
    tokio::spawn(async {
        let _ = tokio::signal::ctrl_c().await;
        std::process::exit(130);
    });
    #[cfg(unix)]
    tokio::spawn(async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
            std::process::exit(143);
        }
    });
}

#[cfg(test)]
mod tests {
    //! The router's error paths that the end-to-end suite cannot reach deterministically:
    //! not ready (503), overloaded (429 with Retry-After), wrong key (401).

    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use std::sync::atomic::Ordering;
    use tower::ServiceExt;

    fn app(ready: bool, waiting: usize) -> Router {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny/llama"
        );
        let tokenizer = Tokenizer::from_hf_dir(std::path::Path::new(dir)).unwrap();
        let shared = Arc::new(worker::Shared::default());
        if ready {
            let _ = shared.card.set(worker::ModelCard {
                id: "tiny".into(),
                created: 0,
                context: 64,
                max_sequence: 64,
                kv_tokens: 64,
                kv_bytes: 0,
                vocab_size: tokenizer.vocab_size(),
                arch: "llama".into(),
                dtype: "F32".into(),
                prefix_caching: true,
                kv_dtype: "f16".into(),
                params: 1000,
                file_bytes: 4000,
                embedding_width: 8,
                kind: worker::ModelKind::Generate,
                normalized: true,
                rerank_prompt: None,
                vision: None,
                adapter: 0,
            });
            shared.ready.store(true, Ordering::SeqCst);
        }
        shared.stats.lock().unwrap().waiting = waiting;
        let state = Arc::new(routes::AppState {
            handle: worker::Handle::detached(shared),
            names: routes::ModelNames::new(vec!["tiny".into()], false),
            pull: None,
            pulling: Default::default(),
            tokenizer,
            metrics: Default::default(),
            api_key: Some("k".into()),
            format: Default::default(),
            draining: AtomicBool::new(false),
            in_handlers: AtomicUsize::new(0),
            max_waiting: 4,
            next_id: AtomicU64::new(0),
            guard: guard::BrowserGuard::new("127.0.0.1", &[], &[]),
            content_special: SpecialTokens::Text,
            max_request_tokens: None,
            embeddings_from_chat: false,
            images: Default::default(),
        });
        router(state, 1 << 16)
    }

    async fn post(app: Router, key: &str) -> (StatusCode, Option<String>, serde_json::Value) {
        let body = r#"{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}"#;
        let req = Request::post("/v1/chat/completions")
            .header("Authorization", format!("Bearer {key}"))
            .header("Content-Type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let r = app.oneshot(req).await.unwrap();
        let status = r.status();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = r.into_body().collect().await.unwrap().to_bytes();
        (status, retry, serde_json::from_slice(&bytes).unwrap())
    }

    /// Status, `Access-Control-Allow-Origin`, for a request with these headers.
    async fn send(
        app: Router,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Option<String>) {
        let mut req = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let body = if method == "POST" {
            Body::from(r#"{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}"#)
        } else {
            Body::empty()
        };
        let r = app.oneshot(req.body(body).unwrap()).await.unwrap();
        let acao = r
            .headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_string());
        (r.status(), acao)
    }

    #[tokio::test]
    async fn browser_facing_guards() {
        let key = ("Authorization", "Bearer k");
        let own = [key, ("Host", "127.0.0.1:8080")];
        // A CORS simple request (text/plain, or no type) never reaches the handler.
        for ct in [
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            None,
        ] {
            let mut h = own.to_vec();
            h.extend(ct.map(|c| ("Content-Type", c)));
            h.push(("Origin", "https://evil.example"));
            let (s, acao) = send(app(true, 0), "POST", "/v1/chat/completions", &h).await;
            assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{ct:?}");
            assert_eq!(acao, None);
        }
        // DNS rebinding: a foreign name in Host.
        let (s, _) = send(
            app(true, 0),
            "GET",
            "/v1/models",
            &[key, ("Host", "evil.example:8080")],
        )
        .await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        // A foreign origin: refused, and no CORS header for it; preflight likewise.
        let foreign = [
            key,
            ("Host", "127.0.0.1:8080"),
            ("Origin", "https://evil.example"),
        ];
        let (s, acao) = send(app(true, 0), "GET", "/v1/models", &foreign).await;
        assert_eq!((s, acao), (StatusCode::FORBIDDEN, None));
        let (s, acao) = send(app(true, 0), "OPTIONS", "/v1/chat/completions", &foreign).await;
        assert_eq!((s, acao), (StatusCode::FORBIDDEN, None));
        // The server's own origin (the chat page), and clients that send no Origin.
        let same = [
            key,
            ("Host", "localhost:8080"),
            ("Origin", "http://localhost:8080"),
        ];
        let (s, acao) = send(app(true, 0), "GET", "/v1/models", &same).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(acao.as_deref(), Some("http://localhost:8080"));
        let (s, acao) = send(app(true, 0), "OPTIONS", "/v1/chat/completions", &same).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        assert_eq!(acao.as_deref(), Some("http://localhost:8080"));
        let (s, acao) = send(app(true, 0), "GET", "/v1/models", &own).await;
        assert_eq!((s, acao), (StatusCode::OK, None));
    }

    #[tokio::test]
    async fn not_ready_overloaded_and_unauthorised() {
        let (s, _, e) = post(app(false, 0), "k").await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e["error"]["type"], "service_unavailable_error");
        let (s, retry, e) = post(app(true, 4), "k").await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(retry.as_deref(), Some("1"));
        assert_eq!(e["error"]["type"], "rate_limit_error");
        let (s, _, e) = post(app(true, 0), "wrong").await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        assert_eq!(e["error"]["code"], "invalid_api_key");
        // /health is open and says 503 while loading.
        let r = app(false, 0)
            .oneshot(Request::get("/health").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
