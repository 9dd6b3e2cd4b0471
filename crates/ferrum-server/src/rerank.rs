//! Reranking and scoring with a cross-encoder: `POST /v1/rerank` (and `/rerank`) in the
//! Jina/Cohere shape that llama-server and vLLM accept, and vLLM's `POST /v1/score` (and
//! `/score`). Both become query–document pairs for `routes::score_pairs`; a score is the
//! model's relevance (the sigmoid of a one-label head's logit).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::api;
use crate::error::ApiError;
use crate::routes::{self, AppState, Truncate};

type App = State<Arc<AppState>>;

const RERANK_FIELDS: &[&str] = &[
    "model",
    "query",
    "documents",
    "top_n",
    "return_documents",
    "truncate_prompt_tokens",
    "user",
];

const SCORE_FIELDS: &[&str] = &[
    "model",
    "text_1",
    "text_2",
    "truncate_prompt_tokens",
    "encoding_format",
    "user",
];

fn text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        // Jina's and Cohere's structured documents: `{"text": …}`.
        Value::Object(o) => match o.get("text") {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(ApiError::param(
                param,
                format!("{param}: an object needs a \"text\" string"),
            )),
        },
        _ => Err(ApiError::param(param, format!("{param} must be strings"))),
    }
}

fn texts(v: Option<&Value>, param: &str) -> Result<Vec<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Err(ApiError::param(param, format!("{param} is required"))),
        Some(Value::Array(a)) => a.iter().map(|d| text(d, param)).collect(),
        Some(one) => Ok(vec![text(one, param)?]),
    }
}

fn truncate(o: &Map<String, Value>) -> Result<Truncate, ApiError> {
    match o.get("truncate_prompt_tokens") {
        None | Some(Value::Null) => Ok(Truncate::No),
        Some(v) => match v.as_i64() {
            Some(-1) => Ok(Truncate::To(usize::MAX)),
            Some(n) if n >= 1 => Ok(Truncate::To(n as usize)),
            _ => Err(ApiError::param(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens must be a positive count, or -1 for the model's limit",
            )),
        },
    }
}

fn model(st: &AppState, o: &Map<String, Value>) -> Result<crate::worker::ModelCard, ApiError> {
    match o.get("model") {
        None | Some(Value::Null) => Ok(st.card()?.clone()),
        Some(Value::String(m)) => st.check_model(m),
        Some(_) => Err(ApiError::param("model", "model must be a string")),
    }
}

pub async fn rerank(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = rerank_inner(&st, b).await;
    routes::respond(&st, r)
}

async fn rerank_inner(
    st: &Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let o = api::object(&routes::body(b)?, RERANK_FIELDS, false)?;
    let card = model(st, &o)?;
    let query = match o.get("query") {
        Some(q) => text(q, "query")?,
        None => return Err(ApiError::param("query", "query is required")),
    };
    let documents = texts(o.get("documents"), "documents")?;
    let top_n = match o.get("top_n") {
        None | Some(Value::Null) => documents.len(),
        Some(v) => match v.as_u64() {
            Some(n) => (n as usize).min(documents.len()),
            None => {
                return Err(ApiError::param(
                    "top_n",
                    "top_n must be a non-negative integer",
                ))
            }
        },
    };
    let return_documents = match o.get("return_documents") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::param(
                "return_documents",
                "return_documents must be a boolean",
            ))
        }
    };
    let pairs: Vec<(&str, &str)> = documents
        .iter()
        .map(|d| (query.as_str(), d.as_str()))
        .collect();
    let (scores, tokens) = routes::score_pairs(st, &card, &pairs, truncate(&o)?).await?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Highest first; equal scores keep the documents' order.
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let results: Vec<Value> = order
        .into_iter()
        .take(top_n)
        .map(|i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if return_documents {
                r["document"] = json!({"text": documents[i]});
            }
            r
        })
        .collect();
    Ok(Json(json!({
        "id": st.new_id("rerank"),
        "object": "list",
        "model": card.id,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

pub async fn score(State(st): App, b: Result<Bytes, BytesRejection>) -> Response {
    let r = score_inner(&st, b).await;
    routes::respond(&st, r)
}

/// vLLM's pairing: one `text_1` against each `text_2`, or two lists of one length zipped.
async fn score_inner(
    st: &Arc<AppState>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let o = api::object(&routes::body(b)?, SCORE_FIELDS, false)?;
    let card = model(st, &o)?;
    let a = texts(o.get("text_1"), "text_1")?;
    let b = texts(o.get("text_2"), "text_2")?;
    let pairs: Vec<(&str, &str)> = match (a.len(), b.len()) {
        (1, _) => b.iter().map(|d| (a[0].as_str(), d.as_str())).collect(),
        (n, m) if n == m => a
            .iter()
            .zip(&b)
            .map(|(q, d)| (q.as_str(), d.as_str()))
            .collect(),
        (n, m) => {
            return Err(ApiError::param(
                "text_2",
                format!(
                    "text_1 has {n} texts and text_2 {m}: give one text_1, or lists of one length"
                ),
            ))
        }
    };
    let (scores, tokens) = routes::score_pairs(st, &card, &pairs, truncate(&o)?).await?;
    let created = routes::now();
    let data: Vec<Value> = scores
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"index": i, "object": "score", "score": s}))
        .collect();
    Ok(Json(json!({
        "id": st.new_id("score"),
        "object": "list",
        "created": created,
        "model": card.id,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}
