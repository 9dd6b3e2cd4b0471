//! The OpenAI request bodies, and their translation into engine requests. Every field is
//! either honoured or refused with a 400 that names it: unknown fields are refused by serde
//! (`deny_unknown_fields`), and features this server does not have yet are refused here.

use std::collections::{BTreeMap, HashMap};

use ferrum_generate::{Constraint, Request, SamplingExtras, SamplingParams, Speculate};
use ferrum_tokenizer::{SpecialTokens, Tokenizer};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::tools::{self, Tools};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub continuous_usage_stats: bool,
    /// Random padding OpenAI adds to chunks against length side channels; there is no such
    /// channel to a local server's clients worth the bytes: taken, and left.
    #[serde(default)]
    pub include_obfuscation: bool,
}

/// Sampling fields shared by chat and text completions.
#[derive(Debug, Deserialize, Default)]
pub struct Sampling {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    /// vLLM's: whether control tokens' text is left out of the answer (default true).
    pub skip_special_tokens: Option<bool>,
    pub user: Option<String>,
    /// Speculative decoding for this request: `true`, `false`, or `{"n_max": K}` (the most
    /// tokens drafted a step; 0 is off). The answer is the same either way.
    pub speculative: Option<Value>,
    /// llama.cpp server's spelling of `speculative.n_max`.
    #[serde(rename = "speculative.n_max")]
    pub speculative_n_max: Option<i64>,
    /// A `max_tokens` past the context is cut to it instead of refused: Ollama's way with
    /// `num_predict` (set by its module, never by a request).
    #[serde(skip)]
    pub cap_max_tokens: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    /// OpenAI's explicit prompt-cache marker: the prefix cache here is automatic.
    pub prompt_cache_breakpoint: Option<Value>,
    // Parts of other kinds, named so that they are refused by kind (not as unknown fields).
    pub image_url: Option<Value>,
    pub input_audio: Option<Value>,
    pub file: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning, as this server returns it (vLLM also reads `reasoning`).
    pub reasoning_content: Option<String>,
    pub reasoning: Option<String>,
    /// An assistant turn's refusal text (OpenAI's models'), taken as its content.
    pub refusal: Option<String>,
    /// Audio and the deprecated function call of an assistant turn: refused.
    pub audio: Option<Value>,
    pub function_call: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: Sampling,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    pub response_format: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// How hard a reasoning model thinks (gpt-oss's "Reasoning: low|medium|high").
    pub reasoning_effort: Option<String>,
    // Asked of OpenAI's service and refused when set (`check_supported`): audio out, web
    // search, moderation, the deprecated functions.
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
    pub web_search_options: Option<Value>,
    pub moderation: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u32>),
    ManyTokens(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: PromptField,
    #[serde(flatten)]
    pub sampling: Sampling,
    /// The legacy API's field: how many top alternatives to report per token.
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    /// Whether special-token texts in the prompt become control tokens (default true, as
    /// a raw prompt is written for the model; false encodes them as plain text).
    pub parse_special: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u32>),
    ManyTokens(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: String,
    pub input: EmbeddingInput,
    pub encoding_format: Option<String>,
    pub dimensions: Option<i64>,
    pub user: Option<String>,
    /// vLLM's: cut each input to this many tokens (-1: the model's limit) instead of
    /// refusing one that is longer.
    pub truncate_prompt_tokens: Option<i64>,
}

const SAMPLING_FIELDS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "skip_special_tokens",
    "user",
    "speculative",
    "speculative.n_max",
];

pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    // Taken and left (docs/api.md): settings of OpenAI's service with no part in a local
    // server's answer.
    "verbosity",
    "store",
    "metadata",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "prediction",
    // Refused when set to what this server cannot do (`ChatRequest::check_supported`).
    "modalities",
    "audio",
    "web_search_options",
    "moderation",
    "functions",
    "function_call",
];

pub const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "logprobs",
    "echo",
    "suffix",
    "best_of",
    "parse_special",
];

pub const EMBEDDING_FIELDS: &[&str] = &[
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
];

/// Fields that routers (vllm-router, sglang-router) add to every request they forward, each
/// with the value that asks for what this server does anyway. They are taken at that value
/// and dropped; any other value asks for something this server does not do, and is refused.
const ROUTER_DEFAULTS: &[(&str, bool)] = &[
    ("no_stop_trim", false),
    ("continue_final_message", false),
    ("return_hidden_states", false),
    // Reasoning is split from the answer, streamed, and returned.
    ("separate_reasoning", true),
    ("stream_reasoning", true),
    ("include_reasoning", true),
];

fn strip_router_defaults(obj: &mut serde_json::Map<String, Value>) -> Result<(), ApiError> {
    for &(name, default) in ROUTER_DEFAULTS {
        match obj.get(name) {
            None => {}
            Some(Value::Bool(b)) if *b == default => {
                obj.remove(name);
            }
            Some(other) => {
                return Err(ApiError::param(
                    name,
                    format!("{name} {other} is not supported (only {default})"),
                ))
            }
        }
    }
    Ok(())
}

/// A JSON object body whose fields must be among `fields` (plus the sampling fields when
/// `sampling`), naming the offending field in the error. Every API's body starts here.
pub fn object(
    body: &[u8],
    fields: &[&str],
    sampling: bool,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut obj = json_object(body)?;
    if sampling {
        strip_router_defaults(&mut obj)?;
    }
    for k in obj.keys() {
        let known =
            fields.contains(&k.as_str()) || (sampling && SAMPLING_FIELDS.contains(&k.as_str()));
        if !known {
            return Err(ApiError::param(k, format!("unsupported parameter {k:?}")));
        }
    }
    Ok(obj)
}

/// A body that must be a JSON object, its fields unchecked.
pub fn json_object(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}"), None))?;
    match v {
        Value::Object(obj) => Ok(obj),
        _ => Err(ApiError::bad_request(
            "the body must be a JSON object",
            None,
        )),
    }
}

/// The first of `keys` set (not null) as a bool, else `default`; anything but a bool is
/// refused, naming it.
pub fn flag(
    o: &serde_json::Map<String, Value>,
    keys: &[&str],
    default: bool,
) -> Result<bool, ApiError> {
    for k in keys {
        match o.get(*k) {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => return Ok(*b),
            Some(_) => return Err(ApiError::param(k, format!("{k} must be true or false"))),
        }
    }
    Ok(default)
}

/// Why [`text_parts`] refused a content value.
pub enum PartsError<'a> {
    /// Neither a string nor a list.
    Shape,
    /// Part `index`, of type `kind`, is neither text nor a part to leave out.
    Part { index: usize, kind: Option<&'a str> },
}

/// The text of content given as a string or as a list of typed parts (the Messages and
/// Responses APIs): each part whose `type` is one of `text` gives its `text`, which must be a
/// string; parts of a type in `skip` are left out.
pub fn text_parts<'a>(
    v: &'a Value,
    text: &[&str],
    skip: &[&str],
) -> Result<String, PartsError<'a>> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (index, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text")) {
                    (Some(k), Some(Value::String(t))) if text.contains(&k) => out.push_str(t),
                    (Some(k), _) if skip.contains(&k) => {}
                    _ => return Err(PartsError::Part { index, kind }),
                }
            }
            Ok(out)
        }
        _ => Err(PartsError::Shape),
    }
}

/// Copies `body[from]` to `out[to]` for each pair where it is set (not null): the fields an
/// API shares with the chat request under its own names.
pub fn copy_fields(
    body: &serde_json::Map<String, Value>,
    out: &mut serde_json::Map<String, Value>,
    pairs: &[(&str, &str)],
) {
    for (from, to) in pairs {
        if let Some(v) = body.get(*from).filter(|v| !v.is_null()) {
            out.insert((*to).into(), v.clone());
        }
    }
}

/// Turns the model's thinking on or off where its chat template has a switch for it
/// (Qwen3's `enable_thinking`); elsewhere the request's wish has nothing to act on.
pub fn set_thinking(chat: &mut serde_json::Map<String, Value>, template: &str, on: bool) {
    if template.contains("enable_thinking") {
        chat.insert(
            "chat_template_kwargs".into(),
            serde_json::json!({ "enable_thinking": on }),
        );
    }
}

/// Parses a JSON object body whose fields must be among `fields` (plus the sampling fields
/// when `sampling`), naming the offending field in the error.
pub fn parse<T: serde::de::DeserializeOwned>(
    body: &[u8],
    fields: &[&str],
    sampling: bool,
) -> Result<T, ApiError> {
    let obj = object(body, fields, sampling)?;
    let keys: Vec<String> = obj.keys().cloned().collect();
    serde_json::from_value(Value::Object(obj)).map_err(|e| {
        let msg = e.to_string();
        // Name the field serde complains about when it says which.
        let param = msg
            .split('`')
            .nth(1)
            .filter(|_| msg.starts_with("missing field") || msg.starts_with("unknown field"))
            .map(str::to_string)
            .or_else(|| keys.iter().find(|k| msg.contains(k.as_str())).cloned());
        ApiError::bad_request(format!("invalid request: {msg}"), param.as_deref())
    })
}

impl Sampling {
    fn speculate(&self) -> Result<Speculate, ApiError> {
        let n_max = |v: i64, name: &str| {
            usize::try_from(v)
                .ok()
                .filter(|&k| k <= Speculate::MAX_TOKENS)
                .map(Speculate::Tokens)
                .ok_or_else(|| {
                    ApiError::param(
                        name,
                        format!(
                            "{name} must be 0..={} (tokens drafted a step)",
                            Speculate::MAX_TOKENS
                        ),
                    )
                })
        };
        if let Some(v) = self.speculative_n_max {
            if self.speculative.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::param(
                    "speculative.n_max",
                    "give speculative or speculative.n_max, not both",
                ));
            }
            return n_max(v, "speculative.n_max");
        }
        match &self.speculative {
            None | Some(Value::Null) => Ok(Speculate::Default),
            Some(Value::Bool(true)) => Ok(Speculate::On),
            Some(Value::Bool(false)) => Ok(Speculate::Off),
            Some(Value::Object(o)) => {
                if let Some(k) = o.keys().find(|k| k.as_str() != "n_max") {
                    return Err(ApiError::param(
                        "speculative",
                        format!("unsupported field {k:?} in speculative (it takes n_max)"),
                    ));
                }
                match o.get("n_max") {
                    None => Ok(Speculate::On),
                    Some(v) => match v.as_i64() {
                        Some(v) => n_max(v, "speculative.n_max"),
                        None => Err(ApiError::param(
                            "speculative.n_max",
                            "speculative.n_max must be an integer",
                        )),
                    },
                }
            }
            Some(_) => Err(ApiError::param(
                "speculative",
                "speculative must be true, false or {\"n_max\": K}",
            )),
        }
    }
}

/// The parts of a request the handler needs besides the engine request.
pub struct Plan {
    pub base: Request,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
}

/// What one request may ask for.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest sequence, prompt and answer.
    pub max_sequence: usize,
    /// Most tokens generated by all of a prompt's choices together (`n × max_tokens`).
    pub request_tokens: usize,
}

impl Sampling {
    /// Checks every field and builds the engine request for `prompt`.
    ///
    /// A `max_tokens` that does not fit the context after the prompt is refused with both
    /// numbers (as vLLM does), never silently cut; without one, an answer may run to the end
    /// of the context or to its share of `limits.request_tokens`, whichever is less.
    pub fn plan(
        &self,
        prompt: Vec<u32>,
        limits: Limits,
        vocab: usize,
        logprobs: Option<usize>,
    ) -> Result<Plan, ApiError> {
        let max_sequence = limits.max_sequence;
        let room = max_sequence.saturating_sub(prompt.len());
        if prompt.len() >= max_sequence {
            return Err(ApiError::param(
                "messages",
                format!(
                    "the prompt is {} tokens; this model's context holds {} (prompt and answer)",
                    prompt.len(),
                    max_sequence
                ),
            ));
        }
        let n = match self.n {
            None => 1,
            Some(n) if (1..=16).contains(&n) => n as usize,
            Some(_) => return Err(ApiError::param("n", "n must be between 1 and 16")),
        };
        let asked = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some((
                "max_completion_tokens",
                positive("max_completion_tokens", v)?,
            )),
            (None, Some(v)) => Some(("max_tokens", positive("max_tokens", v)?)),
            (None, None) => None,
        };
        let asked = match asked {
            Some((_, m)) if self.cap_max_tokens => Some((
                "max_tokens",
                m.min(room).min(limits.request_tokens / n).max(1),
            )),
            a => a,
        };
        let max_tokens = match asked {
            Some((name, m)) => {
                if m > room {
                    return Err(ApiError::param(
                        name,
                        format!(
                            "the prompt is {} tokens and {name} is {m}: {} in all, over this \
                             model's context of {max_sequence} tokens; ask for at most {room}",
                            prompt.len(),
                            prompt.len() + m,
                        ),
                    ));
                }
                if m.saturating_mul(n) > limits.request_tokens {
                    return Err(ApiError::param(
                        name,
                        format!(
                            "n × {name} is {n} × {m} = {}; this server generates at most {} \
                             tokens for one prompt of a request (--max-request-tokens, shared \
                             by a request's prompts)",
                            n * m,
                            limits.request_tokens
                        ),
                    ));
                }
                m
            }
            None => room.min(limits.request_tokens / n).max(1),
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::param(
                "temperature",
                "temperature must be in [0, 2]",
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::param("top_p", "top_p must be in (0, 1]"));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(_) => return Err(ApiError::param("top_k", "top_k must be -1, 0 or positive")),
        };
        let seed = self.seed.map(|s| s as u64);
        let mut logit_bias = BTreeMap::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            let id: u32 = k.parse().map_err(|_| {
                ApiError::param(
                    "logit_bias",
                    format!("logit_bias key {k:?} is not a token id"),
                )
            })?;
            if id as usize >= vocab {
                return Err(ApiError::param(
                    "logit_bias",
                    format!("logit_bias token {id} is outside the vocabulary ({vocab})"),
                ));
            }
            logit_bias.insert(id, v);
        }
        let extras = SamplingExtras {
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias,
        };
        extras.validate()?;
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) if v.len() <= 16 => v.clone(),
            Some(_) => return Err(ApiError::param("stop", "at most 16 stop strings")),
        };
        if let Some(bad) = self
            .stop_token_ids
            .iter()
            .flatten()
            .find(|&&t| t as usize >= vocab)
        {
            return Err(ApiError::param(
                "stop_token_ids",
                format!("stop token {bad} is outside the vocabulary"),
            ));
        }
        let include_usage = self
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::param(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ));
        }
        let base = Request {
            prompt,
            max_tokens,
            params: SamplingParams {
                temperature,
                top_k,
                top_p,
                seed,
            },
            extras,
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            constraint: None,
            speculate: self.speculate()?,
            skip_special: self.skip_special_tokens.unwrap_or(true),
            // The route sets it from the model the request names.
            adapter: 0,
            // The route sets them from the request's image parts.
            images: Vec::new(),
        };
        Ok(Plan {
            base,
            n,
            stream,
            include_usage,
        })
    }
}

fn positive(name: &str, v: i64) -> Result<usize, ApiError> {
    if v < 1 {
        return Err(ApiError::param(
            name,
            format!("{name} must be at least 1, got {v}"),
        ));
    }
    Ok(v as usize)
}

impl ChatRequest {
    /// Refuses what asks for something this server does not do, where taking it would
    /// silently change the answer.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        if let Some(m) = self.modalities.as_ref().and_then(Value::as_array) {
            if m.iter().any(|x| x != "text") {
                return Err(ApiError::param(
                    "modalities",
                    "only text output is supported (modalities: [\"text\"])",
                ));
            }
        }
        let refused = [
            (&self.audio, "audio", "audio output is not supported"),
            (
                &self.web_search_options,
                "web_search_options",
                "web search is not supported: give the model a search tool in `tools`",
            ),
            (
                &self.moderation,
                "moderation",
                "moderation is not supported: this server runs no moderation model",
            ),
            (
                &self.functions,
                "functions",
                "functions (deprecated) is not supported: send them as `tools`",
            ),
            (
                &self.function_call,
                "function_call",
                "function_call (deprecated) is not supported: use `tool_choice`",
            ),
        ];
        for (v, name, why) in refused {
            if set(v) {
                return Err(ApiError::param(name, why));
            }
        }
        for (i, m) in self.messages.iter().enumerate() {
            if set(&m.audio) || set(&m.function_call) {
                return Err(ApiError::param(
                    "messages",
                    format!("messages[{i}]: audio and function_call (deprecated) are not supported in messages"),
                ));
            }
        }
        Ok(())
    }

    /// The tools in play (checked), if any.
    pub fn tools(&self) -> Result<Option<Tools>, ApiError> {
        tools::parse(self.tools.as_ref(), self.tool_choice.as_ref())
    }

    /// What the output must match: `response_format`'s JSON, or a required / named tool call
    /// written the way the model writes calls (`harmony`: gpt-oss's channels; else Hermes
    /// tags).
    pub fn constraint(
        &self,
        tools: Option<&Tools>,
        harmony: bool,
    ) -> Result<Option<Constraint>, ApiError> {
        let format = match &self.response_format {
            None => None,
            Some(rf) => match rf.get("type").and_then(Value::as_str) {
                Some("text") => None,
                Some("json_object") => Some(Constraint::JsonObject),
                Some("json_schema") => {
                    let schema = rf
                        .get("json_schema")
                        .and_then(|j| j.get("schema"))
                        .filter(|s| s.is_object())
                        .ok_or_else(|| {
                            ApiError::param(
                                "response_format",
                                "response_format json_schema needs json_schema.schema (an object)",
                            )
                        })?;
                    Some(Constraint::JsonSchema(schema.clone()))
                }
                other => {
                    return Err(ApiError::param(
                        "response_format",
                        format!(
                            "response_format type {other:?} (text, json_object or json_schema)"
                        ),
                    ))
                }
            },
        };
        let call = match harmony {
            true => tools.and_then(Tools::harmony_grammar),
            false => tools.and_then(Tools::grammar),
        }
        .map(Constraint::Lark);
        match (format, call) {
            (Some(_), Some(_)) => Err(ApiError::param(
                "response_format",
                "response_format cannot be combined with a required tool call",
            )),
            (f, c) => Ok(f.or(c)),
        }
    }

    /// The conversation as the template sees it: text parts joined, `developer` as
    /// `system`; for templates that do not know tools, calls and results become text in the
    /// Hermes format and the tool instructions a system message. Every string from the
    /// request goes through `esc` before the Hermes tags go around it, so the tags stay
    /// markup where the vocabulary makes them control tokens.
    pub fn messages(
        &self,
        tools: Option<&Tools>,
        template: &Traits,
        esc: &Escape,
    ) -> Result<Vec<Value>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::param("messages", "messages must not be empty"));
        }
        let Traits {
            native,
            objects,
            reasoning_key,
            ..
        } = *template;
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        for (i, m) in self.messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "developer" => "system",
                r @ ("system" | "user" | "assistant" | "tool") => r,
                other => {
                    return Err(ApiError::param(
                        "messages",
                        format!("messages[{i}]: unknown role {other:?}"),
                    ))
                }
            };
            // A message with images is given to the template as parts (`{"type": "image"}`
            // where each was, which the template marks); the images themselves were read by
            // `ChatRequest::images`.
            let mut image_parts: Option<Vec<Value>> = None;
            if let Some(Content::Parts(parts)) = &m.content {
                if parts.iter().any(|p| p.kind == "image_url") {
                    let mut list = Vec::with_capacity(parts.len());
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => list.push(
                                serde_json::json!({"type": "text", "text": esc.str(t)}),
                            ),
                            ("image_url", _) => list.push(serde_json::json!({"type": "image"})),
                            (kind, _) => {
                                return Err(ApiError::param(
                                    "messages",
                                    format!("messages[{i}]: content parts of type {kind:?} are not supported"),
                                ))
                            }
                        }
                    }
                    image_parts = Some(list);
                }
            }
            let content = match &m.content {
                _ if image_parts.is_some() => String::new(),
                None => m.refusal.clone().unwrap_or_default(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::param(
                                    "messages",
                                    format!("messages[{i}]: content parts of type {kind:?} are not supported"),
                                ))
                            }
                        }
                    }
                    s
                }
            };
            let mut content = esc.str(&content);
            let mut msg = serde_json::Map::new();
            if let Some(calls) = &m.tool_calls {
                if role != "assistant" {
                    return Err(ApiError::param(
                        "messages",
                        format!("messages[{i}]: only assistant messages carry tool_calls"),
                    ));
                }
                if native {
                    let mut calls = calls.clone();
                    if objects {
                        for c in calls.as_array_mut().into_iter().flatten() {
                            let args = &mut c["function"]["arguments"];
                            if let Some(Ok(v)) = args.as_str().map(serde_json::from_str::<Value>) {
                                *args = v;
                            }
                        }
                    }
                    msg.insert("tool_calls".into(), esc.json(calls));
                } else {
                    for c in calls.as_array().into_iter().flatten() {
                        let f = &c["function"];
                        let args: Value = match &f["arguments"] {
                            Value::String(s) => {
                                serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                            }
                            v => v.clone(),
                        };
                        let call =
                            esc.json(serde_json::json!({"name": f["name"], "arguments": args}));
                        content.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                    }
                }
            }
            if role == "tool" && !native {
                content = format!("<tool_response>\n{content}\n</tool_response>");
            }
            msg.insert("role".into(), role.into());
            match image_parts {
                Some(parts) => msg.insert("content".into(), Value::Array(parts)),
                None => msg.insert("content".into(), content.into()),
            };
            let reasoning = m.reasoning_content.as_ref().or(m.reasoning.as_ref());
            if let Some(r) = reasoning.filter(|r| role == "assistant" && !r.is_empty()) {
                msg.insert(reasoning_key.into(), esc.str(r).into());
            }
            if let Some(id) = &m.tool_call_id {
                msg.insert("tool_call_id".into(), esc.str(id).into());
            }
            if let Some(n) = &m.name {
                msg.insert("name".into(), esc.str(n).into());
            }
            out.push(Value::Object(msg));
        }
        if let Some(t) = tools.filter(|t| t.active() && !native) {
            let instructions = t.system_prompt(esc);
            match out.first_mut() {
                Some(Value::Object(first)) if first["role"] == "system" => {
                    let c = first["content"].as_str().unwrap_or("").to_string();
                    first.insert("content".into(), format!("{c}\n\n{instructions}").into());
                }
                _ => out.insert(
                    0,
                    serde_json::json!({"role": "system", "content": instructions}),
                ),
            }
        }
        Ok(out)
    }

    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, Some(_)) => Err(ApiError::param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            )),
            (false, None) => Ok(None),
            (true, None) => Ok(Some(0)),
            (true, Some(k)) if (0..=20).contains(&k) => Ok(Some(k as usize)),
            (true, Some(_)) => Err(ApiError::param(
                "top_logprobs",
                "top_logprobs must be 0..=20",
            )),
        }
    }

    /// What the chat template is rendered with: the messages (see [`ChatRequest::messages`])
    /// and its variables (`chat_template_kwargs`, plus `tools` when they are in play).
    ///
    /// With [`SpecialTokens::Text`] every string from the request comes escaped (see
    /// `Tokenizer::escape_str`), for `Tokenizer::chat_prompt_escaped`.
    pub fn template_inputs(
        &self,
        tok: &Tokenizer,
        tools: Option<&Tools>,
        special: SpecialTokens,
    ) -> Result<(Vec<Value>, serde_json::Map<String, Value>), ApiError> {
        let esc = Escape((special == SpecialTokens::Text).then_some(tok));
        let traits = Traits::of(tok);
        let messages = self.messages(tools, &traits, &esc)?;
        let mut kwargs = self.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(t) = tools.filter(|t| t.active()) {
            kwargs.insert("tools".into(), Value::Array(t.raw.clone()));
        }
        if let Some(e) = &self.reasoning_effort {
            let effort = match e.as_str() {
                "none" | "minimal" | "low" => "low",
                "medium" => "medium",
                "high" | "xhigh" | "max" => "high",
                other => {
                    return Err(ApiError::param(
                        "reasoning_effort",
                        format!("reasoning_effort {other:?} (none, minimal, low, medium, high, xhigh or max)"),
                    ))
                }
            };
            if traits.effort {
                kwargs.insert("reasoning_effort".into(), effort.into());
            }
        }
        let kwargs = match esc.json(Value::Object(kwargs)) {
            Value::Object(m) => m,
            _ => serde_json::Map::new(),
        };
        Ok((messages, kwargs))
    }
}

/// What a conversation's renderer (the chat template, or harmony's own rendering for a
/// harmony model without one) expects of the messages.
#[derive(Debug, Clone, Copy)]
pub struct Traits {
    /// It renders tool calls and results itself (else they become Hermes-tagged text).
    pub native: bool,
    /// It serialises tool-call arguments itself (`arguments | tojson`, as gpt-oss's and
    /// Llama 3.1's templates do) and takes no string as it is: OpenAI sends arguments as a
    /// JSON string, which it would quote, so it gets the object.
    pub objects: bool,
    /// The message field an assistant turn's reasoning goes in: Qwen3's templates read
    /// `reasoning_content`, gpt-oss's `thinking`.
    pub reasoning_key: &'static str,
    /// It has a reasoning-effort setting (`reasoning_effort`).
    pub effort: bool,
}

/// Whether a template (its source without whitespace) needs tool-call arguments as an object
/// rather than OpenAI's JSON string: it serialises them itself (`arguments | tojson`, gpt-oss,
/// Llama 3.1) without a branch for strings, or walks their keys (GLM-4.5's `<arg_key>` pairs:
/// `is mapping` tests, `.items()`), refusing a string or, as Gemma 4's does, writing it inside
/// its own braces (`call:NAME{{"city": …}}`, which is no call in its notation), or parses a
/// string itself with `from_json` (DeepSeek V3.2's), a filter this renderer does not have.
/// Subscripts are read as attributes (`tool['function']['arguments']`, DeepSeek V3.1's and
/// Kimi K2's spelling).
fn wants_object_arguments(bare: &str) -> bool {
    let bare = bare
        .replace("['", ".")
        .replace("[\"", ".")
        .replace("']", "")
        .replace("\"]", "");
    let serialises = bare.contains("arguments|tojson") && !bare.contains("argumentsisstring");
    let parses = bare.contains("|from_json");
    let walks = bare.contains("arguments.items()")
        || bare.contains("arguments|items")
        || (bare.contains("arguments")
            && (bare.contains("isnotmapping") || bare.contains("ismapping")));
    serialises || walks || parses
}

impl Traits {
    pub fn of(tok: &Tokenizer) -> Traits {
        let Some(t) = tok.chat_template() else {
            let harmony = ferrum_tokenizer::harmony::is_harmony(tok);
            return Traits {
                native: harmony,
                objects: harmony,
                reasoning_key: "thinking",
                effort: harmony,
            };
        };
        let src = t.source();
        let bare: String = src.chars().filter(|c| !c.is_whitespace()).collect();
        Traits {
            native: src.contains("tool_calls") || src.contains("tools"),
            objects: wants_object_arguments(&bare),
            reasoning_key: if src.contains("reasoning_content") {
                "reasoning_content"
            } else {
                "thinking"
            },
            effort: src.contains("reasoning_effort"),
        }
    }
}

/// Escapes request strings for the chat template (`Tokenizer::escape_str`), or leaves them
/// as they are (`None`: special-token texts in content become control tokens).
pub struct Escape<'a>(pub Option<&'a Tokenizer>);

impl Escape<'_> {
    pub fn str(&self, s: &str) -> String {
        match self.0 {
            Some(t) => t.escape_str(s).into_owned(),
            None => s.to_string(),
        }
    }

    pub fn json(&self, mut v: Value) -> Value {
        if let Some(t) = self.0 {
            t.escape_json(&mut v);
        }
        v
    }
}

impl CompletionRequest {
    pub fn check_supported(&self) -> Result<(), ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::param("echo", "echo is not supported"));
        }
        if self.suffix.is_some() {
            return Err(ApiError::param("suffix", "suffix is not supported"));
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::param(
                "best_of",
                "best_of other than 1 is not supported",
            ));
        }
        Ok(())
    }

    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match self.logprobs {
            None => Ok(None),
            Some(k) if (0..=20).contains(&k) => Ok(Some(k as usize)),
            Some(_) => Err(ApiError::param("logprobs", "logprobs must be 0..=20")),
        }
    }

    /// Each prompt as token ids (text is encoded with the model's BOS rule; special-token
    /// texts are control tokens unless `parse_special: false`).
    pub fn prompts(&self, tok: &Tokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
        let special = if self.parse_special.unwrap_or(true) {
            SpecialTokens::Control
        } else {
            SpecialTokens::Text
        };
        let v = match &self.prompt {
            PromptField::One(s) => vec![tok.encode_with(s, true, special)?],
            PromptField::Many(v) => v
                .iter()
                .map(|s| tok.encode_with(s, true, special))
                .collect::<ferrum_core::Result<_>>()?,
            PromptField::Tokens(t) => vec![t.clone()],
            PromptField::ManyTokens(v) => v.clone(),
        };
        if v.is_empty() || v.iter().any(|p| p.is_empty()) {
            return Err(ApiError::param("prompt", "the prompt is empty"));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GLM-4.5's template walks the arguments' keys and refuses a string; Gemma 4's walks
    /// them and writes a string inside its own braces; Llama 3.1's and DeepSeek V3.1's
    /// serialise them; DeepSeek V3.2's parses a string with a filter ferrum lacks; Kimi K2's
    /// and Ministral 3's take either; a template that writes them as they come wants the
    /// string.
    #[test]
    fn object_arguments_where_the_template_needs_them() {
        let bare = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
        for (src, want) in [
            (
                "{% set _args = tc.arguments or {} %}{% if _args is not mapping %}{{ raise_exception('x') }}{% endif %}{% for k, v in _args.items() %}",
                true,
            ),
            (
                "{%- if function['arguments'] is mapping -%}{%- for key, value in function['arguments'] | dictsort -%}{{- key -}}:{{- format_argument(value, escape_keys=False) -}}{%- endfor -%}{%- elif function['arguments'] is string -%}{{- function['arguments'] -}}{%- endif -%}",
                true,
            ),
            ("{{ tool_call.arguments | tojson }}", true),
            (
                "{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}",
                false,
            ),
            ("{{ tool_call.function.arguments }}", false),
            // DeepSeek V3.1's.
            (
                "{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] | tojson + '<｜tool▁call▁end｜>'}}",
                true,
            ),
            // DeepSeek V3.2's.
            (
                "{%- set args = func['arguments'] -%}{%- if args is string -%}{%- set args = args | from_json -%}{%- endif -%}{%- for key, val in args.items() -%}",
                true,
            ),
        ] {
            assert_eq!(wants_object_arguments(&bare(src)), want, "{src}");
        }
    }

    /// What vllm-router adds to a forwarded request is taken at its no-op values and dropped;
    /// another value is refused, naming the field; unknown fields stay refused.
    #[test]
    fn router_fields_at_their_defaults_pass() {
        let body = br#"{"model": "m", "messages": [], "no_stop_trim": false,
            "continue_final_message": false, "return_hidden_states": false,
            "separate_reasoning": true, "stream_reasoning": true, "include_reasoning": true}"#;
        let obj = object(body, CHAT_FIELDS, true).unwrap();
        let mut keys: Vec<&String> = obj.keys().collect();
        keys.sort();
        assert_eq!(keys, ["messages", "model"]);
        let e = object(
            br#"{"model": "m", "no_stop_trim": true}"#,
            CHAT_FIELDS,
            true,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("no_stop_trim"));
        let e = object(
            br#"{"model": "m", "include_reasoning": "yes"}"#,
            CHAT_FIELDS,
            true,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("include_reasoning"));
        let e = object(br#"{"model": "m", "mystery": 1}"#, CHAT_FIELDS, true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("mystery"));
    }
}
