//! OpenAI's Chat Completions, Completions and Embeddings APIs: each request parsed and
//! checked (`api`), run through the shared pipeline (`routes`), and the engine's events turned
//! into an OpenAI response body or an SSE stream.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrum_generate::{FinishReason, Output, OutputKind, TokenLogprob, Usage};
use ferrum_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::answer::{Answer, AnswerStream, Piece, Reading};
use crate::api::{self};
use crate::error::ApiError;
use crate::routes;
use crate::tools::Tools;

use crate::routes::{
    body, choices, collect, finish_name, launch, now, prepare_chat, record, respond, token_text,
    AppState, Choice, Prepared,
};

type App = State<Arc<AppState>>;

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
        "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
    })
}

/// The assistant message for an answer, and its finish reason: with tools, calls are parsed
/// out (`finish_reason: "tool_calls"`) and content is null when there is none.
pub(crate) fn assistant_message(
    st: &AppState,
    reading: Reading,
    tools: Option<&Tools>,
    text: &str,
    finish: Option<FinishReason>,
) -> (Value, Option<&'static str>) {
    let a = Answer::of(reading, tools, text);
    let content = if a.text.is_empty() && !a.calls.is_empty() {
        Value::Null
    } else {
        json!(a.text)
    };
    let mut m = json!({"role": "assistant", "content": content});
    if let Some(r) = &a.reasoning {
        m["reasoning_content"] = json!(r);
    }
    if a.calls.is_empty() {
        return (m, finish.map(finish_name));
    }
    let calls: Vec<Value> = a
        .calls
        .into_iter()
        .map(|c| {
            json!({
                "id": st.new_id("call"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect();
    m["tool_calls"] = json!(calls);
    (m, Some(call_finish(finish)))
}

/// The finish reason of an answer with tool calls: `tool_calls`, unless `max_tokens` cut it
/// short (perhaps inside a call's arguments), which says `length` as OpenAI's API does, so
/// that a client does not run a call whose arguments never closed.
pub(crate) fn call_finish(finish: Option<FinishReason>) -> &'static str {
    match finish {
        Some(FinishReason::Length) => "length",
        _ => "tool_calls",
    }
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
        reading,
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
                let (message, finish) =
                    assistant_message(&st, reading, tools.as_ref(), &c.text, c.finish);
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
    // Each choice's answer split as it streams (reasoning, text, tool calls as they are
    // generated), the same way for every API.
    let mut answers: Vec<AnswerStream> = (0..plan.n)
        .map(|_| AnswerStream::new(reading, tools.as_ref()))
        .collect();
    let piece = move |i: usize, o: &Output| -> Vec<Value> {
        let (text, last, mut lp) = match &o.kind {
            OutputKind::Token {
                token,
                text,
                logprob,
            } => (
                text,
                false,
                logprob
                    .as_ref()
                    .map(|l| chat_logprobs(&tok_st.tokenizer, &[(*token, l.clone())])),
            ),
            OutputKind::Finished { text, .. } => (text, true, None),
        };
        let mut call = answers[i].begun();
        let mut out = Vec::new();
        for p in answers[i].push(text, last) {
            let delta = match p {
                Piece::Reasoning(r) => json!({"reasoning_content": r}),
                Piece::Text(x) => json!({"content": x}),
                Piece::CallStart(name) => {
                    call += 1;
                    json!({"tool_calls": [{"index": call - 1, "id": tok_st.new_id("call"),
                        "type": "function", "function": {"name": name, "arguments": ""}}]})
                }
                Piece::CallArgs(a) => {
                    json!({"tool_calls": [{"index": call.saturating_sub(1), "function": {"arguments": a}}]})
                }
                Piece::CallEnd => continue,
                Piece::Call(c) => {
                    call += 1;
                    json!({"tool_calls": [{"index": call - 1, "id": tok_st.new_id("call"),
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}}]})
                }
            };
            out.push(chunk(json!([{
                "index": i, "delta": delta, "logprobs": lp.take(), "finish_reason": null,
            }])));
        }
        // A token whose text is still held back reports its log-probability all the same.
        if let Some(lp) = lp {
            out.push(chunk(json!([{
                "index": i, "delta": {"content": ""}, "logprobs": lp, "finish_reason": null,
            }])));
        }
        if let OutputKind::Finished { reason, .. } = &o.kind {
            let finish = if answers[i].calls() > 0 {
                call_finish(Some(*reason))
            } else {
                finish_name(*reason)
            };
            out.push(chunk(json!([{
                "index": i, "delta": {}, "logprobs": null, "finish_reason": finish,
            }])));
        }
        out
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
    let card = st.check_generating(&req.model)?;
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
        let mut plan = req
            .sampling
            .plan(p, limits, card.vocab_size, logprobs)
            .map_err(|mut e| {
                if e.param.as_deref() == Some("messages") {
                    e.param = Some("prompt".into());
                }
                e
            })?;
        plan.base.adapter = card.adapter;
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
    let card = st.check_model(&req.model)?;
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
    let inputs = match req.input {
        api::EmbeddingInput::One(s) => routes::encode_texts(&st, &[s])?,
        api::EmbeddingInput::Many(v) => routes::encode_texts(&st, &v)?,
        api::EmbeddingInput::Tokens(t) => vec![t],
        api::EmbeddingInput::ManyTokens(v) => v,
    };
    // Matryoshka: the first `dimensions` numbers, renormalised where the model's vectors
    // are unit length (as sentence-transformers' `truncate_dim` and vLLM do).
    let width = card.embedding_width;
    let dims = match req.dimensions {
        None => width,
        Some(d) if d >= 1 && d as usize <= width => d as usize,
        Some(d) => {
            return Err(ApiError::param(
                "dimensions",
                format!(
                    "dimensions {d}: this model's embeddings have {width} (ask for 1 to {width})"
                ),
            ))
        }
    };
    let truncate = match req.truncate_prompt_tokens {
        None => routes::Truncate::No,
        Some(-1) => routes::Truncate::To(card.context),
        Some(n) if n >= 1 => routes::Truncate::To(n as usize),
        Some(n) => {
            return Err(ApiError::param(
                "truncate_prompt_tokens",
                format!(
                    "truncate_prompt_tokens {n} (a positive count, or -1 for the model's limit)"
                ),
            ))
        }
    };
    let (vectors, tokens) = routes::embed_ids(&st, &card, inputs, truncate, "input").await?;
    let mut data = Vec::new();
    for (i, mut v) in vectors.into_iter().enumerate() {
        ferrum_models::encoder::truncate_dims(&mut v, dims, card.normalized)
            .map_err(|m| ApiError::param("dimensions", m))?;
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
