//! What keeps a web page the user visits from driving the local server.
//!
//! A browser sends a POST with `Content-Type: text/plain` (or a body of no type) to any
//! address without asking first — a CORS "simple request" — and DNS rebinding lets a page on
//! `evil.example` reach `127.0.0.1` under its own name and read the answers. So, in order:
//! - **Host** (when bound to a loopback address): the `Host` header must name this machine —
//!   an IP literal, `localhost` or `*.localhost` — or a name given with `--allowed-host`. A
//!   rebinding page's requests carry its own domain name and get 403.
//! - **Content type**: bodies of the JSON endpoints must be `application/json`, which a page
//!   can only send cross-origin after a preflight (415 otherwise).
//! - **Origin**: a request that carries an `Origin` (browsers do, on every cross-origin
//!   request and on same-origin POSTs) must come from this server's own origin (the chat
//!   page) or one given with `--allowed-origin` (`*` for any); others get 403. Clients that
//!   are not browsers send no `Origin` and pass.
//! - **CORS**: allowed origins get `Access-Control-Allow-Origin` on answers and preflights;
//!   nobody else does, so a browser keeps the answer from a foreign page.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

#[derive(Clone, Debug, Default)]
pub struct BrowserGuard {
    /// Check `Host` (the server is bound to a loopback address).
    pub check_host: bool,
    /// Host names accepted besides IP literals and `localhost` (lower case, no port).
    pub allowed_hosts: Vec<String>,
    /// Origins accepted besides the server's own (`scheme://host[:port]`, lower case);
    /// `*` accepts any.
    pub allowed_origins: Vec<String>,
}

impl BrowserGuard {
    /// The guard for a server bound to `bind` (an address or a name).
    pub fn new(bind: &str, allowed_hosts: &[String], allowed_origins: &[String]) -> BrowserGuard {
        let bind = bind.trim_start_matches('[').trim_end_matches(']');
        let loopback = bind.eq_ignore_ascii_case("localhost")
            || bind.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        BrowserGuard {
            check_host: loopback,
            allowed_hosts: allowed_hosts
                .iter()
                .map(|h| host_name(h).to_ascii_lowercase())
                .collect(),
            allowed_origins: allowed_origins
                .iter()
                .map(|o| o.trim_end_matches('/').to_ascii_lowercase())
                .collect(),
        }
    }

    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        let bare = name.trim_start_matches('[').trim_end_matches(']');
        bare.parse::<IpAddr>().is_ok()
            || name == "localhost"
            || name.ends_with(".localhost")
            || self.allowed_hosts.contains(&name)
    }

    /// Whether `origin` may use the API: this server's own origin (same host and port as the
    /// request's `Host`, when that is a name of this machine — else a rebinding page's own
    /// name would pass, whatever address the server is bound to), or one on the list.
    fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        let origin = origin.trim_end_matches('/').to_ascii_lowercase();
        if self
            .allowed_origins
            .iter()
            .any(|o| o == "*" || *o == origin)
        {
            return true;
        }
        let Some(host) = host.filter(|h| self.host_allowed(h)) else {
            return false;
        };
        let own = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        own.is_some_and(|rest| rest == host.to_ascii_lowercase())
    }
}

/// `host[:port]` → `host` (IPv6 literals keep their brackets).
fn host_name(host: &str) -> &str {
    if let Some(end) = host.find(']') {
        return &host[..=end];
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => host,
    }
}

/// A header's text; `Err` when it is there but not visible ASCII (refused, not ignored).
fn header_str(h: &HeaderMap, name: header::HeaderName) -> Result<Option<&str>, ApiError> {
    match h.get(&name) {
        None => Ok(None),
        Some(v) => v.to_str().map(Some).map_err(|_| {
            ApiError::bad_request(format!("the {name} header is not ASCII text"), None)
        }),
    }
}

fn forbidden(message: String) -> ApiError {
    ApiError {
        status: StatusCode::FORBIDDEN,
        message,
        param: None,
        code: Some("forbidden"),
        retry_after: None,
    }
}

/// A refusal in the shape the path's clients read: Ollama's `{"error": "…"}` under `/api/`,
/// OpenAI's elsewhere (Anthropic's clients read the message from either).
fn reject(path: &str, e: ApiError) -> Response {
    if path.starts_with("/api/") {
        return crate::ollama::shaped(e);
    }
    e.into_response()
}

fn is_json(content_type: Option<&str>) -> bool {
    content_type
        .and_then(|c| c.split(';').next())
        .is_some_and(|c| c.trim().eq_ignore_ascii_case("application/json"))
}

/// The middleware; see the module's documentation for the order of the checks.
pub async fn check(State(g): State<Arc<BrowserGuard>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let headers = req.headers();
    // HTTP/2 carries the host in the request's authority instead of a Host header.
    let host = match header_str(headers, header::HOST) {
        Ok(h) => h.or_else(|| req.uri().authority().map(|a| a.as_str())),
        Err(e) => return reject(&path, e),
    };
    if g.check_host {
        if let Some(h) = host.filter(|h| !g.host_allowed(h)) {
            return reject(
                &path,
                forbidden(format!(
                    "Host {h:?} is not this server's name (add it with --allowed-host)"
                )),
            );
        }
    }
    let origin = match header_str(headers, header::ORIGIN) {
        Ok(o) => o.map(str::to_string),
        Err(e) => return reject(&path, e),
    };
    let content_type = match header_str(headers, header::CONTENT_TYPE) {
        Ok(c) => c,
        Err(e) => return reject(&path, e),
    };
    if req.method() == Method::OPTIONS {
        return preflight(&g, origin.as_deref(), host, headers);
    }
    if req.method() == Method::POST && !is_json(content_type) {
        let e = ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: "the body must be sent as Content-Type: application/json".into(),
            param: None,
            code: Some("unsupported_media_type"),
            retry_after: None,
        };
        return reject(&path, e);
    }
    if let Some(o) = &origin {
        if !g.origin_allowed(o, host) {
            return reject(
                &path,
                forbidden(format!(
                    "Origin {o:?} may not use this server (add it with --allowed-origin)"
                )),
            );
        }
    }
    let mut resp = next.run(req).await;
    if let Some(o) = origin.and_then(|o| HeaderValue::from_str(&o).ok()) {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
        h.append(header::VARY, HeaderValue::from_static("Origin"));
    }
    resp
}

/// A CORS preflight: allowed origins learn what they may send; others get no CORS headers.
fn preflight(
    g: &BrowserGuard,
    origin: Option<&str>,
    host: Option<&str>,
    h: &HeaderMap,
) -> Response {
    let Some(o) = origin.filter(|o| g.origin_allowed(o, host)) else {
        return reject(
            "",
            forbidden(match origin {
                Some(o) => {
                    format!("Origin {o:?} may not use this server (add it with --allowed-origin)")
                }
                None => "a preflight needs an Origin".into(),
            }),
        );
    };
    let mut resp = StatusCode::NO_CONTENT.into_response();
    let out = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(o) {
        out.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    out.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    let asked = h
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
    out.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    out.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    // Chromium asks before a public page may call a local address (Private Network Access).
    if h.contains_key("access-control-request-private-network") {
        out.insert(
            "access-control-allow-private-network",
            HeaderValue::from_static("true"),
        );
    }
    out.append(header::VARY, HeaderValue::from_static("Origin"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_origins() {
        let g = BrowserGuard::new("127.0.0.1", &["myhost.lan".into()], &[]);
        assert!(g.check_host);
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "localhost",
            "app.localhost:1",
            "[::1]:8080",
            "10.0.0.5",
            "MyHost.lan:80",
        ] {
            assert!(g.host_allowed(ok), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "evil.example",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
        ] {
            assert!(!g.host_allowed(bad), "{bad}");
        }
        let host = Some("127.0.0.1:8080");
        assert!(g.origin_allowed("http://127.0.0.1:8080", host));
        assert!(!g.origin_allowed("http://127.0.0.1:9999", host));
        assert!(!g.origin_allowed("https://evil.example", host));
        assert!(!g.origin_allowed("null", host));
        let g = BrowserGuard::new("0.0.0.0", &[], &["https://App.example/".into()]);
        assert!(!g.check_host);
        assert!(g.origin_allowed("https://app.example", host));
        // Bound to every address, a rebinding page's origin matches its Host, but that Host
        // is no name of this machine.
        assert!(!g.origin_allowed("http://evil.example:8080", Some("evil.example:8080")));
        assert!(g.origin_allowed("http://192.168.1.5:8080", Some("192.168.1.5:8080")));
        let any = BrowserGuard::new("::1", &[], &["*".into()]);
        assert!(any.check_host && any.origin_allowed("https://anything.example", None));
        assert!(BrowserGuard::new("[::1]", &[], &[]).check_host);
        assert!(BrowserGuard::new("localhost", &[], &[]).check_host);
    }
}
