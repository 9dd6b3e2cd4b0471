//! Token ids without generation: `POST /tokenize` and `POST /detokenize` (llama-server's and
//! vLLM's shapes both), and the render endpoints a router calls to see the exact prompt the
//! server would compute — `POST /v1/chat/completions/render` (chat template, tools, special
//! tokens: the same path as a chat request, checks included) and
//! `POST /v1/completions/render`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrum_tokenizer::SpecialTokens;
use serde_json::{json, Value};

use crate::api;
use crate::error::ApiError;
use crate::routes::{self, AppState};

type App = State<Arc<AppState>>;

const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "content",
    "prompt",
    "messages",
    "add_special",
    "add_special_tokens",
    "parse_special",
    "with_pieces",
    "return_token_strs",
    "add_generation_prompt",
    "tools",
    "chat_template_kwargs",
];

pub async fn tokenize(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = tokenize_inner(&st, b).await;
    routes::respond(&st, r)
}

async fn tokenize_inner(
    st: &Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let o = api::object(&routes::body(b)?, TOKENIZE_FIELDS, false)?;
    let card = st.card()?.clone();
    if let Some(m) = o.get("model").and_then(Value::as_str) {
        st.check_model(m)?;
    }
    let ids = if let Some(messages) = o.get("messages") {
        // A conversation: rendered as a chat request with these messages would be.
        let mut chat = json!({"model": card.id, "messages": messages});
        for k in ["tools", "chat_template_kwargs"] {
            if let Some(v) = o.get(k) {
                chat[k] = v.clone();
            }
        }
        let req: api::ChatRequest =
            api::parse(chat.to_string().as_bytes(), api::CHAT_FIELDS, true)?;
        let tools = req.tools()?;
        let tools = tools.as_ref().filter(|t| t.active());
        let gen = api::flag(&o, &["add_generation_prompt"], true)?;
        let images = st.check_images(&req).await?;
        let (messages, kwargs) = req.template_inputs(&st.tokenizer, tools, st.content_special)?;
        routes::render_prompt_images(st, messages, kwargs, gen, images)
            .await?
            .0
    } else {
        let text = match o.get("content").or_else(|| o.get("prompt")) {
            Some(Value::String(s)) => s.as_str(),
            _ => {
                return Err(ApiError::param(
                    "content",
                    "content (or prompt) must be a string, or give messages",
                ))
            }
        };
        let add = api::flag(&o, &["add_special", "add_special_tokens"], true)?;
        let special = if api::flag(&o, &["parse_special"], true)? {
            SpecialTokens::Control
        } else {
            SpecialTokens::Text
        };
        st.tokenizer.encode_with(text, add, special)?
    };
    let pieces = |ids: &[u32]| -> Vec<String> {
        ids.iter()
            .map(|&id| routes::token_text(&st.tokenizer, id))
            .collect()
    };
    let mut out = json!({
        "count": ids.len(),
        "max_model_len": card.max_sequence,
    });
    if api::flag(&o, &["with_pieces"], false)? {
        let p = pieces(&ids);
        out["tokens"] = ids
            .iter()
            .zip(p)
            .map(|(id, piece)| json!({"id": id, "piece": piece}))
            .collect();
    } else {
        out["tokens"] = json!(ids);
    }
    if api::flag(&o, &["return_token_strs"], false)? {
        out["token_strs"] = json!(pieces(&ids));
    }
    Ok(Json(out).into_response())
}

pub async fn detokenize(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        let o = api::object(&routes::body(b)?, &["tokens", "model"], false)?;
        let card = st.card()?;
        if let Some(m) = o.get("model").and_then(Value::as_str) {
            st.check_model(m)?;
        }
        let ids: Vec<u32> = o
            .get("tokens")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect()
            })
            .ok_or_else(|| ApiError::param("tokens", "tokens must be a list of token ids"))?;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= card.vocab_size) {
            return Err(ApiError::param(
                "tokens",
                format!(
                    "token id {bad} is outside the vocabulary ({})",
                    card.vocab_size
                ),
            ));
        }
        let text = st.tokenizer.decode(&ids, false)?;
        Ok(Json(json!({"content": text, "prompt": text})).into_response())
    })();
    routes::respond(&st, r)
}

/// The prompt a chat request would run, without running it (every check the chat endpoint
/// makes, made).
pub async fn render_chat(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let bytes = routes::body(b)?;
        let req: api::ChatRequest = api::parse(&bytes, api::CHAT_FIELDS, true)?;
        let p = routes::prepare_chat(&st, &req).await?;
        Ok::<_, ApiError>(rendered(&st, vec![p.plan.base.prompt]))
    }
    .await;
    routes::respond(&st, r)
}

/// The prompts a completion request would run.
pub async fn render_completion(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        let bytes = routes::body(b)?;
        let req: api::CompletionRequest = api::parse(&bytes, api::COMPLETION_FIELDS, true)?;
        st.check_model(&req.model)?;
        let prompts = req.prompts(&st.tokenizer)?;
        Ok(rendered(&st, prompts))
    })();
    routes::respond(&st, r)
}

fn rendered(st: &AppState, prompts: Vec<Vec<u32>>) -> Response {
    let text = |ids: &[u32]| st.tokenizer.decode(ids, false).unwrap_or_default();
    let body = match prompts.as_slice() {
        [one] => json!({"prompt_token_ids": one, "count": one.len(), "prompt": text(one)}),
        many => json!({
            "prompt_token_ids": many,
            "count": many.iter().map(Vec::len).collect::<Vec<_>>(),
            "prompt": many.iter().map(|p| text(p)).collect::<Vec<_>>(),
        }),
    };
    Json(body).into_response()
}
