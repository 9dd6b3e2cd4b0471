//! Every error response comes from here, shaped as OpenAI shapes them:
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for 429.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// A request parameter that is out of range or of the wrong kind.
    pub fn param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::bad_request(message, Some(param))
    }

    pub fn not_found(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            ..ApiError::bad_request(message, param)
        }
    }

    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            ..ApiError::bad_request(message, None)
        }
    }

    pub fn overloaded(retry_after: u64) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            retry_after: Some(retry_after),
            ..ApiError::bad_request("the server is busy; try again shortly", None)
        }
    }

    pub fn not_ready(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            ..ApiError::bad_request(message, None)
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            code: Some("invalid_api_key"),
            ..ApiError::bad_request("invalid or missing API key", None)
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            ..ApiError::bad_request(message, None)
        }
    }

    /// `Retry-After` on a 429, whatever shape the body takes.
    pub fn retry_header(&self, r: &mut Response) {
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }
}

/// Engine and library errors: whatever a request could cause is a 400; the first word of
/// the engine's message names the parameter when it is one.
impl From<ferrum_core::Error> for ApiError {
    fn from(e: ferrum_core::Error) -> ApiError {
        use ferrum_core::Error as E;
        match e {
            E::InvalidRequest(m) => {
                let first = m.split_whitespace().next().unwrap_or("");
                let param = [
                    "min_p",
                    "repetition_penalty",
                    "presence_penalty",
                    "frequency_penalty",
                    "logit_bias",
                ]
                .into_iter()
                .find(|p| *p == first);
                let param = param.or_else(|| m.contains("prompt").then_some("messages"));
                ApiError::bad_request(m, param)
            }
            E::Template(m) => {
                ApiError::bad_request(format!("chat template: {m}"), Some("messages"))
            }
            // The model's template is at fault, not the request.
            E::TemplateLimit(m) => ApiError {
                code: Some("chat_template_limit"),
                ..ApiError::internal(format!("chat template: {m}"))
            },
            E::Tokenizer(m) => ApiError::bad_request(format!("tokenizer: {m}"), None),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        });
        let mut r = (self.status, Json(body)).into_response();
        self.retry_header(&mut r);
        r
    }
}
