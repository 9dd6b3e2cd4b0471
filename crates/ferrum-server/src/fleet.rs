//! `ferrum serve` with several models (issue 48), as Ollama and llama-server's router mode
//! serve them: every model is listed whether loaded or not; a request naming one that is not
//! loaded loads it (the request waits; requests to loaded models go on meanwhile); a memory
//! budget, in `ferrum plan`'s figures, decides what fits, and the least recently used idle
//! model is unloaded to make room; a model idle past its keep-alive is unloaded.
//!
//! Each loaded model is a whole single-model server state ([`AppState`]: its own worker
//! thread, engine and KV pool, tokenizer, metrics) with its own [`crate::router`]; this front
//! reads a request's `model`, makes sure that model is loaded, and hands the request to its
//! router unchanged. The routes that concern every model (`/v1/models`, Ollama's `/api/tags`
//! and `/api/ps`, `/health`, `/metrics`) are answered here.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::error::ApiError;
use crate::routes::{rfc3339, AppState};

/// A model the server can load.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// The name requests give in `model`.
    pub name: String,
    pub path: PathBuf,
    /// Its memory when loaded, as `ferrum plan` computes it (weights, KV pool, activations,
    /// tokenizers, the grammar trie).
    pub bytes: u64,
    /// Its weights' size on disk (Ollama's `size`).
    pub file_bytes: u64,
}

/// Starts a model: its state with the worker loading it (on a blocking thread: tokenizers
/// load here).
pub type Starter =
    Arc<dyn Fn(&ModelSpec) -> std::result::Result<Arc<AppState>, String> + Send + Sync>;

#[derive(Clone)]
pub struct FleetConfig {
    /// Most bytes (in `ferrum plan`'s figures) of the models loaded at once.
    pub budget: u64,
    /// How long a model stays loaded after its last request (`None`: for ever).
    pub keep_alive: Option<Duration>,
    pub max_body: usize,
    pub api_key: Option<String>,
    pub guard: crate::guard::BrowserGuard,
    pub shutdown_grace: Duration,
}

struct Loaded {
    state: Arc<AppState>,
    router: Router,
}

struct Entry {
    spec: ModelSpec,
    slot: Mutex<Option<Arc<Loaded>>>,
    /// Milliseconds since the server started, at its last request.
    last_used: AtomicU64,
    /// When it is unloaded if idle (`None`: never).
    expires: Mutex<Option<Instant>>,
}

impl Entry {
    fn loaded(&self) -> Option<Arc<Loaded>> {
        self.slot.lock().ok().and_then(|s| s.clone())
    }
}

#[derive(Default)]
struct FleetMetrics {
    loads: AtomicU64,
    /// Microseconds spent loading, and requests spent waiting for a load.
    load_us: AtomicU64,
    unloads: AtomicU64,
    failed_loads: AtomicU64,
}

pub struct Fleet {
    entries: Vec<Entry>,
    cfg: FleetConfig,
    start: Starter,
    /// One load (and the unloads that make room for it) at a time.
    load_lock: tokio::sync::Mutex<()>,
    born: Instant,
    created: u64,
    metrics: FleetMetrics,
    draining: AtomicBool,
}

impl Fleet {
    pub fn new(specs: Vec<ModelSpec>, cfg: FleetConfig, start: Starter) -> Arc<Fleet> {
        Arc::new(Fleet {
            entries: specs
                .into_iter()
                .map(|spec| Entry {
                    spec,
                    slot: Mutex::new(None),
                    last_used: AtomicU64::new(0),
                    expires: Mutex::new(None),
                })
                .collect(),
            cfg,
            start,
            load_lock: tokio::sync::Mutex::new(()),
            born: Instant::now(),
            created: crate::routes::now(),
            metrics: FleetMetrics::default(),
            draining: AtomicBool::new(false),
        })
    }

    /// The model a request's `model` names: its name, or Ollama's `NAME:latest`.
    fn find(&self, name: &str) -> Option<&Entry> {
        let bare = name.strip_suffix(":latest").unwrap_or(name);
        self.entries
            .iter()
            .find(|e| e.spec.name == name || e.spec.name == bare)
    }

    /// The model for a request that names none: the one used last, else the first.
    fn default_entry(&self) -> Option<&Entry> {
        self.entries
            .iter()
            .filter(|e| e.loaded().is_some())
            .max_by_key(|e| e.last_used.load(Ordering::Relaxed))
            .or(self.entries.first())
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// Whether a loaded model has nothing to do: no request in a handler, running or
    /// waiting, and none dispatched in the last half second (whose engine request may not
    /// be counted yet).
    fn idle(&self, e: &Entry, l: &Loaded) -> bool {
        let quiet = self
            .now_ms()
            .saturating_sub(e.last_used.load(Ordering::Relaxed))
            > 500;
        quiet && !l.state.busy()
    }

    fn used_bytes(&self) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.loaded().is_some())
            .map(|e| e.spec.bytes)
            .sum()
    }

    /// The model loaded, loading it first if need be (making room within the budget).
    async fn ensure(&self, e: &Entry) -> Result<Arc<Loaded>, ApiError> {
        if let Some(l) = e.loaded() {
            return Ok(l);
        }
        let waited = Instant::now();
        let _one = self.load_lock.lock().await;
        if let Some(l) = e.loaded() {
            return Ok(l);
        }
        let mb = |b: u64| b as f64 / 1e6;
        if e.spec.bytes > self.cfg.budget {
            return Err(ApiError::bad_request(
                format!(
                    "model {:?} needs {:.0} MB (ferrum plan), more than this server's memory \
                     budget of {:.0} MB (--max-memory)",
                    e.spec.name,
                    mb(e.spec.bytes),
                    mb(self.cfg.budget)
                ),
                Some("model"),
            ));
        }
        // Room: unload idle models, least recently used first; wait while the ones in the
        // way are busy.
        let deadline = Instant::now() + Duration::from_secs(600);
        while self.used_bytes() + e.spec.bytes > self.cfg.budget {
            let victim = self
                .entries
                .iter()
                .filter_map(|v| v.loaded().map(|l| (v, l)))
                .filter(|(v, l)| self.idle(v, l))
                .min_by_key(|(v, _)| v.last_used.load(Ordering::Relaxed))
                .map(|(v, _)| v);
            match victim {
                Some(v) => self.unload(v).await,
                None if Instant::now() > deadline => {
                    return Err(ApiError::not_ready(format!(
                        "model {:?} needs {:.0} MB and the models loaded ({:.0} MB of the {:.0} MB \
                         budget) stayed busy",
                        e.spec.name,
                        mb(e.spec.bytes),
                        mb(self.used_bytes()),
                        mb(self.cfg.budget)
                    )))
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        tracing::info!(
            "loading {:?} ({:.0} MB planned; {:.0} of {:.0} MB in use)",
            e.spec.name,
            mb(e.spec.bytes),
            mb(self.used_bytes()),
            mb(self.cfg.budget)
        );
        let (start, spec) = (self.start.clone(), e.spec.clone());
        let state = tokio::task::spawn_blocking(move || start(&spec))
            .await
            .map_err(|e| ApiError::internal(format!("loading: {e}")))?
            .map_err(|m| {
                self.metrics.failed_loads.fetch_add(1, Ordering::Relaxed);
                ApiError::internal(format!("model {:?} cannot load: {m}", e.spec.name))
            })?;
        loop {
            let shared = &state.handle.shared;
            if let Some(err) = shared.load_error.get() {
                self.metrics.failed_loads.fetch_add(1, Ordering::Relaxed);
                return Err(ApiError::internal(format!(
                    "model {:?} failed to load: {err}",
                    e.spec.name
                )));
            }
            if shared.ready.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let loaded = Arc::new(Loaded {
            router: crate::router(state.clone(), self.cfg.max_body),
            state,
        });
        if let Ok(mut s) = e.slot.lock() {
            *s = Some(loaded.clone());
        }
        self.metrics.loads.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .load_us
            .fetch_add(waited.elapsed().as_micros() as u64, Ordering::Relaxed);
        tracing::info!(
            "loaded {:?} in {:.2}s",
            e.spec.name,
            waited.elapsed().as_secs_f64()
        );
        Ok(loaded)
    }

    /// Before the process exits: every loaded model's worker stopped, its device given back.
    fn stop_engines(&self) {
        for e in &self.entries {
            if let Some(l) = e.loaded() {
                crate::stop_engine(&l.state.handle);
            }
        }
    }

    /// Drops a model's state and waits for its worker to end (its memory given back).
    async fn unload(&self, e: &Entry) {
        let Some(l) = e.slot.lock().ok().and_then(|mut s| s.take()) else {
            return;
        };
        let shared = l.state.handle.shared.clone();
        drop(l);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !shared.stopped.load(Ordering::SeqCst) {
            if Instant::now() > deadline {
                tracing::warn!("{:?} is still held after 30 s", e.spec.name);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.metrics.unloads.fetch_add(1, Ordering::Relaxed);
        tracing::info!("unloaded {:?}", e.spec.name);
    }

    /// Unloads the models idle past their keep-alive (checked twice a second).
    async fn reap(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = Instant::now();
            for e in &self.entries {
                let due = e
                    .expires
                    .lock()
                    .ok()
                    .and_then(|x| *x)
                    .is_some_and(|t| now >= t);
                let idle = e.loaded().is_some_and(|l| self.idle(e, &l));
                if due && idle {
                    if let Ok(_one) = self.load_lock.try_lock() {
                        self.unload(e).await;
                        if let Ok(mut x) = e.expires.lock() {
                            *x = None;
                        }
                    }
                }
            }
        }
    }

    /// The keep-alive a request asks for (Ollama's `keep_alive`: seconds, or a duration
    /// such as `"5m"`; negative: for ever), else the server's.
    fn keep_alive(&self, body: Option<&Value>) -> Option<Duration> {
        match body.and_then(|b| b.get("keep_alive")) {
            Some(v) => parse_keep_alive(v).unwrap_or(self.cfg.keep_alive),
            None => self.cfg.keep_alive,
        }
    }

    fn entry_json(&self, e: &Entry) -> Value {
        json!({
            "id": e.spec.name,
            "object": "model",
            "created": self.created,
            "owned_by": "ferrum",
            "type": "model",
            "display_name": e.spec.name,
            "created_at": rfc3339(self.created),
            "loaded": e.loaded().is_some(),
            "memory_bytes": e.spec.bytes,
        })
    }
}

/// A keep-alive value: `None` when it is not one (the server's applies), `Some(None)` for
/// ever.
pub fn parse_keep_alive(v: &Value) -> Option<Option<Duration>> {
    let secs = match v {
        Value::Number(n) => n.as_f64()?,
        Value::String(s) => {
            let s = s.trim();
            let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
                Some(i) => (&s[..i], &s[i..]),
                None => (s, "s"),
            };
            let n: f64 = num.trim().parse().ok()?;
            let k = match unit {
                "ms" => 1e-3,
                "s" => 1.0,
                "m" => 60.0,
                "h" => 3600.0,
                _ => return None,
            };
            n * k
        }
        _ => return None,
    };
    if !secs.is_finite() {
        return None;
    }
    Some((secs >= 0.0).then(|| Duration::from_secs_f64(secs)))
}

type FleetState = State<Arc<Fleet>>;

/// The front's router: its own routes, and every other path handed to the model the request
/// names.
pub fn router(fleet: Arc<Fleet>) -> Router {
    tokio::spawn(fleet.clone().reap());
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/api/tags", get(tags))
        .route("/api/ps", get(ps))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/live", get(|| async { Json(json!({"status": "alive"})) }))
        .route("/metrics", get(metrics))
        .fallback(dispatch)
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(fleet.cfg.guard.clone()),
            crate::guard::check,
        ))
        .with_state(fleet)
}

/// The API key check of the front's own model lists (the models' routers check their own).
fn authorised(f: &Fleet, h: &axum::http::HeaderMap) -> bool {
    crate::routes::key_given(f.cfg.api_key.as_deref(), h)
}

fn refuse(path: &str, e: ApiError) -> Response {
    if path.starts_with("/api/") {
        // Ollama's shape.
        return (e.status, Json(json!({"error": e.message}))).into_response();
    }
    e.into_response()
}

async fn dispatch(State(f): FleetState, req: HttpRequest) -> Response {
    let path = req.uri().path().to_string();
    if f.draining.load(Ordering::SeqCst) {
        return refuse(&path, ApiError::not_ready("the server is shutting down"));
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, f.cfg.max_body).await {
        Ok(b) => b,
        Err(_) => {
            return refuse(&path, ApiError::too_large("the request body is too large"));
        }
    };
    let json: Option<Value> = (parts.method == Method::POST)
        .then(|| serde_json::from_slice(&bytes).ok())
        .flatten();
    let named = json
        .as_ref()
        .and_then(|v| v.get("model").or_else(|| v.get("name")))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    let entry = match named {
        Some(m) => match f.find(m) {
            Some(e) => e,
            None => {
                if !authorised(&f, &parts.headers) {
                    return refuse(&path, ApiError::unauthorized());
                }
                let names: Vec<&str> = f.entries.iter().map(|e| e.spec.name.as_str()).collect();
                return refuse(
                    &path,
                    ApiError::not_found(
                        format!(
                            "model {m:?} is not served here (this server has {})",
                            names.join(", ")
                        ),
                        Some("model"),
                    ),
                );
            }
        },
        None => match f.default_entry() {
            Some(e) => e,
            None => return refuse(&path, ApiError::not_ready("no models")),
        },
    };
    // Loading is for callers with the key.
    if entry.loaded().is_none() && !authorised(&f, &parts.headers) && path != "/" {
        return refuse(&path, ApiError::unauthorized());
    }
    let keep = f.keep_alive(json.as_ref());
    entry.last_used.store(f.now_ms(), Ordering::Relaxed);
    let loaded = match f.ensure(entry).await {
        Ok(l) => l,
        Err(e) => return refuse(&path, e),
    };
    entry.last_used.store(f.now_ms(), Ordering::Relaxed);
    if let Ok(mut x) = entry.expires.lock() {
        *x = keep.map(|d| Instant::now() + d);
    }
    let req = HttpRequest::from_parts(parts, Body::from(bytes));
    let Ok(resp) = loaded.router.clone().oneshot(req).await;
    entry.last_used.store(f.now_ms(), Ordering::Relaxed);
    resp
}

async fn models(State(f): FleetState, req: HttpRequest) -> Response {
    if !authorised(&f, req.headers()) {
        return ApiError::unauthorized().into_response();
    }
    let data: Vec<Value> = f.entries.iter().map(|e| f.entry_json(e)).collect();
    Json(json!({
        "object": "list",
        "data": data,
        "has_more": false,
        "first_id": f.entries.first().map(|e| e.spec.name.clone()),
        "last_id": f.entries.last().map(|e| e.spec.name.clone()),
    }))
    .into_response()
}

async fn model(
    State(f): FleetState,
    axum::extract::Path(id): axum::extract::Path<String>,
    req: HttpRequest,
) -> Response {
    if !authorised(&f, req.headers()) {
        return ApiError::unauthorized().into_response();
    }
    match f.find(&id) {
        Some(e) => Json(f.entry_json(e)).into_response(),
        None => ApiError::not_found(format!("model {id:?} is not served here"), Some("model"))
            .into_response(),
    }
}

fn ollama_entry(f: &Fleet, e: &Entry, loaded: bool) -> Value {
    let name = format!("{}:latest", e.spec.name);
    let mut v = json!({
        "name": name,
        "model": name,
        "modified_at": rfc3339(f.created),
        "size": e.spec.file_bytes,
        "digest": "",
        "details": {"format": if e.spec.path.is_dir() { "safetensors" } else { "gguf" }},
    });
    if loaded {
        let expires = e
            .expires
            .lock()
            .ok()
            .and_then(|x| *x)
            .map(|t| t.saturating_duration_since(Instant::now()).as_secs());
        v["size"] = e.spec.bytes.into();
        v["size_vram"] = 0.into();
        v["expires_at"] = rfc3339(crate::routes::now() + expires.unwrap_or(u32::MAX as u64)).into();
    }
    v
}

async fn tags(State(f): FleetState, req: HttpRequest) -> Response {
    if !authorised(&f, req.headers()) {
        return refuse("/api/", ApiError::unauthorized());
    }
    let m: Vec<Value> = f
        .entries
        .iter()
        .map(|e| ollama_entry(&f, e, false))
        .collect();
    Json(json!({"models": m})).into_response()
}

async fn ps(State(f): FleetState, req: HttpRequest) -> Response {
    if !authorised(&f, req.headers()) {
        return refuse("/api/", ApiError::unauthorized());
    }
    let m: Vec<Value> = f
        .entries
        .iter()
        .filter(|e| e.loaded().is_some())
        .map(|e| ollama_entry(&f, e, true))
        .collect();
    Json(json!({"models": m})).into_response()
}

async fn health(State(f): FleetState) -> Response {
    let models: Vec<Value> = f
        .entries
        .iter()
        .map(|e| json!({"name": e.spec.name, "loaded": e.loaded().is_some()}))
        .collect();
    Json(json!({
        "status": "ok",
        "model": f.entries.first().map(|e| e.spec.name.clone()),
        "models": models,
        "memory_budget_bytes": f.cfg.budget,
        "memory_planned_bytes": f.used_bytes(),
    }))
    .into_response()
}

async fn ready(State(f): FleetState) -> Response {
    if f.draining.load(Ordering::SeqCst) {
        return ApiError::not_ready("the server is shutting down").into_response();
    }
    Json(json!({"status": "ready"})).into_response()
}

/// The front's counters, then the metrics of the model used last (vLLM's names, once each).
async fn metrics(State(f): FleetState) -> Response {
    use std::fmt::Write;
    let mut out = String::new();
    let m = &f.metrics;
    let loaded = f.entries.iter().filter(|e| e.loaded().is_some()).count();
    for (name, help, kind, v) in [
        (
            "ferrum:models_loaded",
            "Models loaded now.",
            "gauge",
            loaded as f64,
        ),
        (
            "ferrum:model_loads_total",
            "Models loaded on demand.",
            "counter",
            m.loads.load(Ordering::Relaxed) as f64,
        ),
        (
            "ferrum:model_load_seconds_total",
            "Seconds requests waited for their model to load (room made, weights read).",
            "counter",
            m.load_us.load(Ordering::Relaxed) as f64 / 1e6,
        ),
        (
            "ferrum:model_unloads_total",
            "Models unloaded (to make room, or idle past their keep-alive).",
            "counter",
            m.unloads.load(Ordering::Relaxed) as f64,
        ),
        (
            "ferrum:model_load_failures_total",
            "Loads that failed.",
            "counter",
            m.failed_loads.load(Ordering::Relaxed) as f64,
        ),
        (
            "ferrum:memory_budget_bytes",
            "The memory budget for loaded models (--max-memory).",
            "gauge",
            f.cfg.budget as f64,
        ),
        (
            "ferrum:memory_planned_bytes",
            "The planned memory of the models loaded now (ferrum plan).",
            "gauge",
            f.used_bytes() as f64,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
    let last = f
        .entries
        .iter()
        .filter_map(|e| e.loaded().map(|l| (e, l)))
        .max_by_key(|(e, _)| e.last_used.load(Ordering::Relaxed));
    if let Some((_, l)) = last {
        let req = HttpRequest::builder()
            .uri("/metrics")
            .body(Body::empty())
            .unwrap_or_default();
        let Ok(r) = l.router.clone().oneshot(req).await;
        if r.status() == StatusCode::OK {
            if let Ok(b) = axum::body::to_bytes(r.into_body(), 1 << 24).await {
                out.push_str(&String::from_utf8_lossy(&b));
            }
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// Serves the fleet until SIGTERM or Ctrl-C; running requests finish first.
pub fn serve(
    host: &str,
    port: u16,
    fleet_specs: Vec<ModelSpec>,
    cfg: FleetConfig,
    start: Starter,
) -> std::result::Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let addr = format!("{host}:{port}");
    let served = rt.block_on(async move {
        let addr: std::net::SocketAddr = addr
            .parse()
            .map_err(|e| format!("bad address {addr}: {e}"))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let grace = cfg.shutdown_grace;
        let fleet = Fleet::new(fleet_specs, cfg, start);
        tracing::info!(
            "serving {} models on http://{addr} within {:.0} MB: {}",
            fleet.entries.len(),
            fleet.cfg.budget as f64 / 1e6,
            fleet
                .entries
                .iter()
                .map(|e| e.spec.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        let app = router(fleet.clone());
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(drain(fleet.clone(), grace))
            .await
            .map_err(|e| format!("server error: {e}"));
        Ok::<_, String>((fleet, served))
    })?;
    let (fleet, served) = served;
    rt.shutdown_timeout(Duration::from_secs(1));
    fleet.stop_engines();
    served
}

/// After SIGTERM: no new requests, the running ones finish (or `grace` passes).
async fn drain(f: Arc<Fleet>, grace: Duration) {
    crate::shutdown().await;
    f.draining.store(true, Ordering::SeqCst);
    for e in &f.entries {
        if let Some(l) = e.loaded() {
            l.state.draining.store(true, Ordering::SeqCst);
        }
    }
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        let busy = f
            .entries
            .iter()
            .any(|e| e.loaded().is_some_and(|l| l.state.busy()));
        if !busy || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let _ = tokio::task::spawn_blocking(move || f.stop_engines()).await;
        std::process::exit(0);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_values() {
        let d = |v: Value| parse_keep_alive(&v);
        assert_eq!(d(json!("5m")), Some(Some(Duration::from_secs(300))));
        assert_eq!(d(json!("10s")), Some(Some(Duration::from_secs(10))));
        assert_eq!(d(json!(30)), Some(Some(Duration::from_secs(30))));
        assert_eq!(d(json!(0)), Some(Some(Duration::ZERO)));
        assert_eq!(d(json!("0")), Some(Some(Duration::ZERO)));
        assert_eq!(d(json!(-1)), Some(None));
        assert_eq!(d(json!("-1m")), Some(None));
        assert_eq!(d(json!("1h")), Some(Some(Duration::from_secs(3600))));
        assert_eq!(d(json!("soon")), None);
        assert_eq!(d(json!([1])), None);
    }
}
