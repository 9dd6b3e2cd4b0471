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
            });
            shared.ready.store(true, Ordering::SeqCst);
        }
        shared.stats.lock().unwrap().waiting = waiting;
        let state = Arc::new(routes::AppState {
            handle: worker::Handle::detached(shared),
            tokenizer,
            metrics: Default::default(),
            api_key: Some("k".into()),
            thinking: false,
            max_waiting: 4,
            next_id: AtomicU64::new(0),
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
