//! Constrained decoding with llguidance: a request's JSON schema (or Lark grammar) becomes a
//! token mask applied before sampling, so the output matches it token by token.
//!
//! llguidance works on token *bytes*; [`GrammarCompiler::new`] recovers each token's bytes
//! from the vocabulary (GPT-2 byte-level or SentencePiece with byte fallback) and builds the
//! token trie once per model.

use std::sync::Arc;

use ferrum_core::{Error, Result};
use ferrum_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// What a request's output must match.
#[derive(Debug, Clone)]
pub enum Constraint {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// JSON matching this schema.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect (tool calls wrap JSON in tags this way).
    Lark(String),
}

impl Constraint {
    /// The same constraint on the answer after an optional `<think>…</think>` block:
    /// reasoning models think first, and the thinking is not held to the answer's format.
    /// (The thinking may not contain `<`.)
    pub fn after_reasoning(&self) -> Constraint {
        let body = self.body("");
        Constraint::Lark(format!(
            "start: think? body\nthink: \"<think>\" /[^<]*/ \"</think>\" /[ \\n]*/\n{body}\n"
        ))
    }

    /// The same constraint on a harmony answer after an optional analysis message of at
    /// most `max_analysis` tokens (so that what is constrained keeps room in the request's
    /// budget): JSON goes in the `final` channel; a grammar (a tool call's) says its own
    /// header.
    pub fn after_harmony_analysis(&self, max_analysis: usize) -> Constraint {
        let body = self.body("<|channel|> \"final\" <|message|> ");
        let n = max_analysis.max(1);
        Constraint::Lark(format!(
            "start: analysis? body\n\
             analysis: <|channel|> \"analysis\" <|message|> thought <|end|> <|start|> \"assistant\"\n\
             thought[max_tokens={n}]: /(.|\\n)*/\n{body}\n"
        ))
    }

    /// The constraint as a Lark rule `body`; JSON after `json_prefix` (Lark items).
    fn body(&self, json_prefix: &str) -> String {
        match self {
            Constraint::JsonObject => {
                format!("body: {json_prefix}json\njson: %json {}", any_object())
            }
            Constraint::JsonSchema(s) => {
                format!(
                    "body: {json_prefix}json\njson: %json {}",
                    compact(s.clone())
                )
            }
            Constraint::Lark(g) => g.replacen("start:", "body:", 1),
        }
    }
}

struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// GPT-2's byte ↔ printable-character table: bytes that are printable map to themselves,
/// the rest to U+0100 upwards in byte order.
fn gpt2_char_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut map = std::collections::HashMap::new();
    let mut next = 256u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
        map.insert(c, b);
    }
    map
}

/// The bytes each token stands for.
fn token_bytes(tok: &Tokenizer, vocab: usize) -> Vec<Vec<u8>> {
    let inner = tok.inner();
    let pieces: Vec<Option<String>> = (0..vocab as u32).map(|i| inner.id_to_token(i)).collect();
    let byte_level = pieces
        .iter()
        .flatten()
        .any(|p| p.contains('Ġ') || p.contains('Ċ'));
    let table = gpt2_char_to_byte();
    pieces
        .iter()
        .enumerate()
        .map(|(id, p)| {
            let Some(p) = p else {
                return Vec::new();
            };
            if tok.is_special(id as u32) {
                // toktrie's marker for tokens that never come from text.
                let mut v = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                v.extend_from_slice(p.as_bytes());
                return v;
            }
            if byte_level {
                if let Some(bytes) = p.chars().map(|c| table.get(&c).copied()).collect() {
                    return bytes;
                }
                return p.as_bytes().to_vec();
            }
            // SentencePiece: <0xHH> byte-fallback pieces, ▁ for space.
            if p.len() == 6 && p.starts_with("<0x") && p.ends_with('>') {
                if let Ok(b) = u8::from_str_radix(&p[3..5], 16) {
                    return vec![b];
                }
            }
            p.replace('▁', " ").into_bytes()
        })
        .collect()
}

/// JSON without free whitespace (one space after `:` and `,`), unless the schema sets its
/// own `x-guidance` options: a small model given room for whitespace can fill `max_tokens`
/// with newlines and never close the object. The schema is [`tighten`]ed first.
pub fn compact(schema: serde_json::Value) -> serde_json::Value {
    no_free_whitespace(tighten(schema))
}

/// Any JSON object (`json_object`), without free whitespace: not tightened, since it has no
/// properties of its own to close it over.
fn any_object() -> serde_json::Value {
    no_free_whitespace(serde_json::json!({"type": "object"}))
}

fn no_free_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "key_separator": ": ",
                "item_separator": ", ",
            })
        });
    }
    schema
}

/// The largest integer part a bound-less `integer` or `number` may have: 15 digits (as
/// llama.cpp's schema converter bounds integers to 16), exactly representable as an f64.
const MAX_INT_PART: f64 = 999_999_999_999_999.0;

/// The schema a small model can satisfy, as OpenAI's strict mode and llama.cpp's converter
/// read it: every object closed unless the schema opens it (no `additionalProperties`,
/// `patternProperties` or `unevaluatedProperties` of its own — left alone inside `allOf`,
/// whose branches are merged), and every `integer` / `number` without a bound given one of
/// ±`MAX_INT_PART`. Without these a model may add keys until `max_tokens`, or run an
/// integer to a hundred digits, and never finish the JSON.
pub fn tighten(mut schema: serde_json::Value) -> serde_json::Value {
    tighten_in(&mut schema, false);
    schema
}

fn tighten_in(v: &mut serde_json::Value, in_all_of: bool) {
    use serde_json::Value;
    let Value::Object(o) = v else {
        if let Value::Array(a) = v {
            a.iter_mut().for_each(|x| tighten_in(x, in_all_of));
        }
        return;
    };
    let types: Vec<&str> = match o.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let is_object = types.contains(&"object") || o.contains_key("properties");
    let opened = [
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    ]
    .iter()
    .any(|k| o.contains_key(*k));
    let numeric = types.iter().any(|t| *t == "integer" || *t == "number");
    if is_object && !opened && !in_all_of {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    if numeric {
        if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
            o.insert("minimum".into(), serde_json::json!(-MAX_INT_PART));
        }
        if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
            o.insert("maximum".into(), serde_json::json!(MAX_INT_PART));
        }
    }
    for (k, child) in o.iter_mut() {
        match k.as_str() {
            "properties" | "$defs" | "definitions" | "patternProperties" | "dependentSchemas" => {
                if let Value::Object(m) = child {
                    m.values_mut().for_each(|x| tighten_in(x, false));
                }
            }
            "allOf" => tighten_in(child, true),
            "items"
            | "prefixItems"
            | "anyOf"
            | "oneOf"
            | "additionalProperties"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains"
            | "additionalItems" => tighten_in(child, false),
            _ => {}
        }
    }
}

/// Compiles constraints for one model's vocabulary.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl GrammarCompiler {
    /// `vocab` is the model's output size (it may exceed the tokenizer's).
    pub fn new(tok: &Tokenizer, vocab: usize) -> Result<GrammarCompiler> {
        let eos = tok.eos_ids().first().copied().unwrap_or(0);
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tok.bos_id();
        let trie = TokTrie::from(&info, &token_bytes(tok, vocab));
        let env: toktrie::TokEnv = Arc::new(Env {
            trie,
            tokenizer: tok.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::InvalidRequest(format!("grammar engine: {e}")))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            vocab,
        })
    }

    /// A fresh matcher for `c`; a schema or grammar that does not compile is an error here,
    /// before any generation.
    pub fn compile(&self, c: &Constraint) -> Result<TokenMask> {
        let grammar = match c {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(any_object()),
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self.factory.create_parser(grammar);
        let matcher = Matcher::new(parser);
        if let Some(e) = matcher.get_error() {
            return Err(Error::InvalidRequest(format!(
                "cannot compile the constraint: {e}"
            )));
        }
        Ok(TokenMask {
            matcher,
            vocab: self.vocab,
        })
    }
}

/// One request's constraint state.
pub struct TokenMask {
    matcher: Matcher,
    vocab: usize,
}

impl TokenMask {
    /// Sets the logits of tokens the constraint forbids next to −∞ (once the constraint is
    /// complete, only end-of-sequence stays allowed).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| Error::InvalidRequest(format!("constraint: {e}")))?;
        for (i, l) in logits.iter_mut().enumerate().take(self.vocab) {
            if !mask.is_allowed(i as TokenId) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past a sampled token.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::InvalidRequest(format!("constraint: {e}")))
    }

    /// The constraint is satisfied and allows nothing more.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_tokenizer() -> Tokenizer {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny/qwen3"
        );
        Tokenizer::from_hf_dir(std::path::Path::new(dir)).unwrap()
    }

    fn accepts(c: &Constraint, text: &str) -> bool {
        let tok = tiny_tokenizer();
        let g = GrammarCompiler::new(&tok, tok.vocab_size()).unwrap();
        let mut m = g.compile(c).unwrap();
        for t in tok.encode(text, false).unwrap() {
            let mut logits = vec![0f32; tok.vocab_size()];
            m.apply(&mut logits).unwrap();
            if logits[t as usize] == f32::NEG_INFINITY || m.commit(t).is_err() {
                return false;
            }
        }
        m.matcher.is_accepting().unwrap_or(false)
    }

    #[test]
    fn schemas_admit_matching_json_and_nothing_else() {
        let c = Constraint::JsonSchema(serde_json::json!({
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "additionalProperties": false
        }));
        assert!(accepts(&c, "{\"a\": 12}"));
        assert!(!accepts(&c, "{\"a\": \"x\"}"));
        assert!(!accepts(&c, "{\"b\": 1}"));
        // After a think block, or without one.
        let r = c.after_reasoning();
        assert!(accepts(&r, "<think>hmm, a number</think>\n\n{\"a\": 3}"));
        assert!(accepts(&r, "{\"a\": 3}"));
        assert!(!accepts(&r, "<think>x</think>nope"));
    }
}

#[cfg(test)]
mod tighten_tests {
    use super::tighten;
    use serde_json::json;

    #[test]
    fn objects_close_unless_opened_and_numbers_get_bounds() {
        let got = tighten(json!({
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "x": {"type": "number", "minimum": 0},
                "open": {"type": "object", "additionalProperties": {"type": "string"}},
                "list": {"type": "array", "items": {"properties": {"a": {"type": "string"}}}},
                "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
            },
            "$defs": {"d": {"type": "object"}},
        }));
        assert_eq!(got["additionalProperties"], false);
        let p = &got["properties"];
        assert_eq!(p["n"]["minimum"], json!(-999_999_999_999_999.0));
        assert_eq!(p["n"]["maximum"], json!(999_999_999_999_999.0));
        assert_eq!(p["x"]["minimum"], 0);
        assert_eq!(p["open"]["additionalProperties"], json!({"type": "string"}));
        assert_eq!(p["list"]["items"]["additionalProperties"], false);
        // allOf branches are merged: closing one would forbid the other's keys.
        assert!(p["both"]["allOf"][0].get("additionalProperties").is_none());
        assert_eq!(got["$defs"]["d"]["additionalProperties"], false);
    }
}
