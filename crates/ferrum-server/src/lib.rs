//! `ferrum serve`: an OpenAI-compatible HTTP server over the engine.
//!
//! HTTP (axum, tokio) → `routes` parses and checks a request (`api`), renders the chat
//! template and tokenizes → `worker` hands it to the engine's thread → the engine's events
//! come back per request → JSON body or SSE chunks. Errors take one shape (`error`); counters
//! and latency histograms are served at `/metrics` (`metrics`).

pub mod api;
pub mod error;
pub mod metrics;
pub mod reasoning;
pub mod routes;
pub mod tools;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use ferrum_backend::CpuBackend;
use ferrum_core::Result;
use ferrum_generate::Engine;
use ferrum_tokenizer::Tokenizer;

pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Required as `Authorization: Bearer …` on the API routes when set.
    pub api_key: Option<String>,
    /// The id clients name in `model`.
    pub model_id: String,
    pub max_body_bytes: usize,
    /// Requests allowed to wait for KV room before new ones get 429.
    pub max_waiting: usize,
}

pub fn router(state: Arc<routes::AppState>, max_body: usize) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/embeddings", post(routes::embeddings))
        .route("/v1/models", get(routes::models))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::auth,
        ));
    Router::new()
        .merge(api)
        .route("/", get(routes::chat_page))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// Binds, starts loading the model on the engine thread (`/health` answers 503 until it is
/// ready), and serves until SIGTERM or Ctrl-C; running requests finish first.
pub fn serve(
    cfg: ServeConfig,
    tokenizer: Tokenizer,
    load: impl FnOnce() -> Result<Engine<CpuBackend>> + Send + 'static,
) -> std::result::Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
            .parse()
            .map_err(|e| format!("bad address {}:{}: {e}", cfg.host, cfg.port))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let handle = worker::spawn(cfg.model_id.clone(), load);
        let thinking = tokenizer
            .chat_template()
            .is_some_and(|t| t.source().contains("<think>"));
        let state = Arc::new(routes::AppState {
            handle,
            thinking,
            tokenizer,
            metrics: Default::default(),
            api_key: cfg.api_key.clone(),
            max_waiting: cfg.max_waiting,
            next_id: AtomicU64::new(0),
        });
        tracing::info!(
            "serving {:?} on http://{addr} (OpenAI API under /v1; /health, /metrics){}",
            cfg.model_id,
            if cfg.api_key.is_some() {
                ", API key required"
            } else {
                ""
            }
        );
        axum::serve(listener, router(state, cfg.max_body_bytes))
            .with_graceful_shutdown(shutdown())
            .await
            .map_err(|e| format!("server error: {e}"))
    })
}

async fn shutdown() {
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
    tracing::info!("shutting down; finishing running requests");
}
