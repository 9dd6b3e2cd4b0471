//! Fuzz targets: every parser that takes input from outside, driven with arbitrary bytes.
//! A target returns normally on any input — an error is the right answer to bad input — and
//! a panic, a crash, a hang or an allocation of what a lying header asks for is a bug.
//!
//! [`TARGETS`] names them; `fuzz/` runs each under AFL++ (`scripts/fuzz.sh`), and
//! `tests/smoke.rs` runs each over its seeds and a few thousand mutations of them in the test
//! suite. Binaries that run them install `ferrum_core::alloc::Metered` as their allocator, as
//! `ferrum` does, so the chat-template sandbox's memory budget holds.
//!
//! Inputs of several parts (a template and its messages, a config and its weights) are split
//! at the first NUL byte.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use ferrum_generate::grammar::{Constraint, GrammarCompiler};
use ferrum_loader::gguf::writer::{write, WTensor};
use ferrum_loader::{GgufFile, HfFolder, ModelFile, Value};
use ferrum_server::api::{self, ChatRequest, CompletionRequest, Limits};
use ferrum_tokenizer::{ChatTemplate, RenderLimits, SpecialTokens, Tokenizer};

/// Set by a harness that runs many inputs in one process (AFL++'s persistent mode): a render
/// stopped at its memory or stack budget leaves its thread asleep for good, holding that
/// memory, so the process exits after one and the fuzzer starts a fresh one.
pub static EXIT_AFTER_STOPPED_RENDER: AtomicBool = AtomicBool::new(false);

/// A fuzz target: name, function, and the seed inputs it starts from.
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]),
    pub seeds: fn() -> Vec<Vec<u8>>,
}

pub const TARGETS: &[Target] = &[
    Target {
        name: "gguf",
        run: gguf,
        seeds: seeds::gguf,
    },
    Target {
        name: "gguf_vocab",
        run: gguf_vocab,
        seeds: seeds::gguf_vocab,
    },
    Target {
        name: "hf_folder",
        run: hf_folder,
        seeds: seeds::hf_folder,
    },
    Target {
        name: "chat_template",
        run: chat_template,
        seeds: seeds::chat_template,
    },
    Target {
        name: "openai_request",
        run: openai_request,
        seeds: seeds::openai_request,
    },
    Target {
        name: "json_schema",
        run: json_schema,
        seeds: seeds::json_schema,
    },
    Target {
        name: "image",
        run: image,
        seeds: seeds::image,
    },
];

pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

/// A path of this process's own in the temporary folder (the loaders read files).
fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ferrum-fuzz-{}-{name}", std::process::id()))
}

fn split(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

/// The tiny Qwen3 fixture's tokenizer (byte-level BPE, ChatML specials, a template).
fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_hf_dir(&fixture("tiny/qwen3")).expect("the tiny Qwen3 tokenizer loads")
    })
}

/// Limits small enough that a hostile input costs milliseconds, not seconds.
fn fuzz_limits() -> RenderLimits {
    RenderLimits {
        fuel: 200_000,
        max_output: 1 << 16,
        max_memory: 32 << 20,
        timeout: Duration::from_millis(500),
    }
}

/// An image as a request sends it: decoded within limits small enough that a lying header
/// costs nothing, then through every kind of processor.
pub fn image(data: &[u8]) {
    let limits = ferrum_image::Limits {
        max_bytes: 1 << 20,
        max_pixels: 1 << 16,
    };
    let Ok(img) = ferrum_image::decode(data, &limits) else {
        return;
    };
    for cfg in [
        r#"{"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 16, "width": 16}, "do_pan_and_scan": true, "pan_and_scan_min_crop_size": 4}"#,
        r#"{"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 64, "max_pixels": 4096, "patch_size": 4, "merge_size": 2}"#,
        r#"{"image_processor_type": "PixtralImageProcessor", "patch_size": {"height": 4, "width": 4}, "size": {"longest_edge": 64}}"#,
    ] {
        let j: serde_json::Value = serde_json::from_str(cfg).expect("a fixed config");
        let p = ferrum_image::Processor::from_json(&j).expect("a fixed config");
        let _ = p.process(&img);
    }
}

/// A GGUF file as it comes: header, metadata, tensor table; then what loading reads of it
/// (model config, tokenizer).
pub fn gguf(data: &[u8]) {
    let path = scratch("in.gguf");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(g) = GgufFile::open(&path) {
        let _ = g.architecture();
        let _ = g.get_str_array("tokenizer.ggml.tokens");
        let _ = g.get_f32_array("tokenizer.ggml.scores");
        let _ = g.tensors();
        let _ = Tokenizer::from_gguf(&g);
        let file = ModelFile::Gguf(g);
        let _ = ferrum_models::detect_arch(&file);
        let _ = ferrum_models::read_config(&file);
    }
    let _ = std::fs::remove_file(&path);
}

/// Reads structure from fuzz bytes: each call takes what it needs, zeros when they run out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn str(&mut self, max: usize) -> String {
        let n = (self.u8() as usize).min(max);
        let n = n.min(self.0.len());
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8_lossy(s).into_owned()
    }
}

/// A GGUF vocabulary built from the bytes (tokens, types, scores, merges, model, pre-tokenizer,
/// special ids, a chat template), then the tokenizer built from it, encoding and decoding.
pub fn gguf_vocab(data: &[u8]) {
    let mut b = Bytes(data);
    let model = if b.u8() % 2 == 0 { "gpt2" } else { "llama" };
    let pres = [
        "default",
        "llama-bpe",
        "qwen2",
        "gpt-2",
        "smollm",
        "unknown-pre",
        "",
    ];
    let pre = pres[b.u8() as usize % pres.len()];
    let n = 1 + b.u8() as usize % 48;
    let mut tokens = Vec::new();
    let mut types = Vec::new();
    let mut scores = Vec::new();
    for i in 0..n {
        let t = match b.u8() % 4 {
            0 => format!("<0x{:02X}>", i),
            1 => format!("<|special{i}|>"),
            _ => b.str(12),
        };
        tokens.push(Value::String(t));
        types.push(Value::I32(b.u8() as i32 % 7));
        scores.push(Value::F32(b.u8() as f32 - 128.0));
    }
    let merges: Vec<Value> = (0..b.u8() % 16).map(|_| Value::String(b.str(10))).collect();
    let mut meta = vec![
        ("general.architecture", Value::String("llama".into())),
        ("tokenizer.ggml.model", Value::String(model.into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.scores", Value::Array(scores)),
        ("tokenizer.ggml.bos_token_id", Value::U32(b.u8() as u32)),
        ("tokenizer.ggml.eos_token_id", Value::U32(b.u8() as u32)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(b.u8() % 2 == 0)),
    ];
    if !merges.is_empty() {
        meta.push(("tokenizer.ggml.merges", Value::Array(merges)));
    }
    if b.u8() % 2 == 0 {
        let t = b.str(80);
        meta.push(("tokenizer.chat_template", Value::String(t)));
    }
    let text = String::from_utf8_lossy(b.0).into_owned();
    let data: Vec<u8> = vec![0; 32];
    let file = write(
        &meta,
        &[WTensor {
            name: "w",
            dims: vec![8],
            ggml_type: 0,
            data: &data,
        }],
    );
    let path = scratch("vocab.gguf");
    if std::fs::write(&path, &file).is_err() {
        return;
    }
    if let Ok(g) = GgufFile::open(&path) {
        if let Ok(tok) = Tokenizer::from_gguf(&g) {
            for special in [SpecialTokens::Text, SpecialTokens::Control] {
                if let Ok(ids) = tok.encode_with(&text, true, special) {
                    let _ = tok.decode(&ids, false);
                    let _ = tok.decode(&ids, true);
                }
            }
            let msgs = [ferrum_tokenizer::Message::new("user", text.as_str())];
            let _ = tok.chat_prompt(&msgs, true, &Default::default(), SpecialTokens::Text);
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// A Hugging Face folder: `config.json`, then after a NUL the `model.safetensors` bytes.
pub fn hf_folder(data: &[u8]) {
    let (config, weights) = split(data);
    let dir = scratch("hf");
    if std::fs::create_dir_all(&dir).is_err()
        || std::fs::write(dir.join("config.json"), config).is_err()
        || std::fs::write(dir.join("model.safetensors"), weights).is_err()
    {
        return;
    }
    if let Ok(h) = HfFolder::open(&dir) {
        let file = ModelFile::Hf(h);
        let _ = ferrum_models::detect_arch(&file);
        let _ = ferrum_models::read_config(&file);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chat template, then after a NUL the messages (JSON; a list of messages, or an object
/// with `messages` and template variables) rendered in the sandbox, and through the
/// tokenizer with content kept as text.
pub fn chat_template(data: &[u8]) {
    let (src, rest) = split(data);
    let Ok(src) = std::str::from_utf8(src) else {
        return;
    };
    let Ok(t) = ChatTemplate::with_limits(src, "<s>", "</s>", fuzz_limits()) else {
        return;
    };
    let json: serde_json::Value = serde_json::from_slice(rest).unwrap_or_default();
    let (messages, kwargs) = match json {
        serde_json::Value::Array(m) => (m, serde_json::Map::new()),
        serde_json::Value::Object(mut o) => {
            let m = match o.remove("messages") {
                Some(serde_json::Value::Array(m)) => m,
                _ => Vec::new(),
            };
            (m, o)
        }
        _ => (Vec::new(), serde_json::Map::new()),
    };
    let _ = t.render_with(&messages, true, &kwargs);
    if t.disabled_reason().is_some() {
        if EXIT_AFTER_STOPPED_RENDER.load(Ordering::Relaxed) {
            std::process::exit(0);
        }
        return;
    }
    let mut tok = tokenizer().clone();
    tok.set_chat_template(Some(t));
    let _ = tok.chat_prompt(&messages, true, &kwargs, SpecialTokens::Text);
}

/// An OpenAI request body (chat completion, or text completion when the first byte is `c`),
/// through the server's parser and checks into an engine request.
pub fn openai_request(data: &[u8]) {
    let tok = tokenizer();
    let limits = Limits {
        max_sequence: 256,
        request_tokens: 1024,
    };
    if let Some(body) = data.strip_prefix(b"c") {
        let Ok(req) = api::parse::<CompletionRequest>(body, api::COMPLETION_FIELDS, true) else {
            return;
        };
        let _ = req.check_supported();
        let logprobs = req.logprobs().ok().flatten();
        if let Ok(prompts) = req.prompts(tok) {
            for p in prompts {
                let _ = req.sampling.plan(p, limits, tok.vocab_size(), logprobs);
            }
        }
        return;
    }
    // Anthropic's Messages (`a`), OpenAI's Responses (`r`) and Ollama's chat (`o`) and
    // generate (`g`) bodies become chat requests.
    let template = tok.chat_template().map_or("", |t| t.source());
    let parsed = match data.first() {
        Some(b'o' | b'g') => {
            match ferrum_server::ollama::parse(&data[1..], data[0] == b'g', template) {
                Ok(Some(r)) => Ok(r),
                _ => return,
            }
        }
        Some(b'a') => ferrum_server::anthropic::parse(
            &data[1..],
            ferrum_server::anthropic::FIELDS,
            false,
            template,
        ),
        Some(b'r') => ferrum_server::responses::parse(&data[1..], template).map(|(r, _)| r),
        _ => api::parse::<ChatRequest>(data, api::CHAT_FIELDS, true),
    };
    let Ok(req) = parsed else {
        return;
    };
    let Ok(tools) = req.tools() else { return };
    let _ = req.constraint(tools.as_ref(), false);
    let _ = req.constraint(tools.as_ref(), true);
    let logprobs = req.logprobs().ok().flatten();
    let Ok((messages, kwargs)) = req.template_inputs(tok, tools.as_ref(), SpecialTokens::Text)
    else {
        return;
    };
    if let Ok(prompt) = tok.chat_prompt_escaped(&messages, true, &kwargs) {
        let _ = req
            .sampling
            .plan(prompt, limits, tok.vocab_size(), logprobs);
    }
    if let Some(t) = &tools {
        let _ = t.parse_output(&String::from_utf8_lossy(data));
    }
}

/// A JSON schema (or, after a leading `L`, a Lark grammar) compiled for the tiny vocabulary,
/// then a few tokens (the bytes after a NUL) masked and committed.
pub fn json_schema(data: &[u8]) {
    static COMPILER: OnceLock<Option<GrammarCompiler>> = OnceLock::new();
    let tok = tokenizer();
    let Some(compiler) = COMPILER
        .get_or_init(|| GrammarCompiler::new(tok, tok.vocab_size()).ok())
        .as_ref()
    else {
        return;
    };
    let (grammar, steps) = split(data);
    let constraint = match grammar.strip_prefix(b"L") {
        Some(lark) => Constraint::Lark(String::from_utf8_lossy(lark).into_owned()),
        None => match serde_json::from_slice::<serde_json::Value>(grammar) {
            Ok(s) if s.is_object() => Constraint::JsonSchema(s),
            _ => return,
        },
    };
    let Ok(mut mask) = compiler.compile(&constraint) else {
        return;
    };
    let mut logits = vec![0.0f32; tok.vocab_size()];
    for &s in steps.iter().take(16) {
        logits.iter_mut().for_each(|l| *l = 0.0);
        if mask.apply(&mut logits).is_err() || mask.is_stopped() {
            break;
        }
        // Commit the s-th allowed token, as sampling would pick one of them.
        let allowed: Vec<u32> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, _)| i as u32)
            .collect();
        if allowed.is_empty() {
            break;
        }
        let t = allowed[s as usize % allowed.len()];
        if mask.commit(t).is_err() {
            break;
        }
    }
}

/// Seed inputs, from the test fixtures and the shapes the targets expect.
pub mod seeds {
    use super::*;

    fn read(rel: &str) -> Vec<u8> {
        std::fs::read(fixture(rel)).unwrap_or_default()
    }

    pub fn gguf() -> Vec<Vec<u8>> {
        vec![
            read("tiny/llama/model-q8_0.gguf"),
            read("tiny/qwen3/model-q8_0.gguf"),
            read("moe/qwen3moe-gguf/model-q8_0.gguf"),
            b"GGUF".to_vec(),
        ]
    }

    pub fn gguf_vocab() -> Vec<Vec<u8>> {
        vec![
            b"\x00\x01\x08\x02ab\x03\x01\x04\x02cd\x03\x01\x02\x01\x02ab\x00\x00Hello <|special1|> world".to_vec(),
            b"\x01\x00\x10\x00\x00\x00\x01\x03\x10\x02\x02\x02\x01\x01\x02\x00{{ bos_token }}".to_vec(),
            vec![7; 64],
        ]
    }

    pub fn hf_folder() -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for name in ["tiny/llama", "tiny/qwen3"] {
            let mut v = read(&format!("{name}/config.json"));
            v.push(0);
            v.extend(read(&format!("{name}/model.safetensors")));
            out.push(v);
        }
        out
    }

    pub fn chat_template() -> Vec<Vec<u8>> {
        let msgs = br#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_end|>"}, {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]"#;
        let mut out = Vec::new();
        for src in [
            std::fs::read_to_string(fixture("tiny/qwen3/chat_template.jinja")).unwrap_or_default(),
            "{% for m in messages %}{{ m.role | upper }}: {{ m.content | trim }}{% if not loop.last %}\n{% endif %}{% endfor %}{{ tools | tojson(indent=2) }}".into(),
            "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(20) }}{{ raise_exception('x') if messages | length > 5 }}".into(),
            "{% set ns = namespace(s='ab') %}{% for i in range(8) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s[:10] }}{{ strftime_now('%Y') }}".into(),
        ] {
            let mut v = src.into_bytes();
            v.push(0);
            v.extend_from_slice(msgs);
            out.push(v);
        }
        out
    }

    pub fn openai_request() -> Vec<Vec<u8>> {
        vec![
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.5, "n": 2, "seed": 1}"#.to_vec(),
            br#"{"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "b"}], "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}}], "tool_choice": "required"}"#.to_vec(),
            br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}, "logprobs": true, "top_logprobs": 3, "stop": ["a", "b"], "logit_bias": {"5": -1}}"#.to_vec(),
            br#"c{"model": "m", "prompt": ["a", "b"], "max_tokens": 3, "logprobs": 2, "parse_special": false}"#.to_vec(),
            br#"c{"model": "m", "prompt": [[1, 2, 3]], "echo": false, "stream": true, "stream_options": {"include_usage": true}}"#.to_vec(),
            br#"a{"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "s"}], "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "t"}, {"type": "tool_use", "id": "u1", "name": "w", "input": {"c": "x"}}]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u1", "content": [{"type": "text", "text": "r"}], "is_error": true}]}], "tools": [{"name": "w", "input_schema": {"type": "object", "properties": {"c": {"type": "string"}}}}], "tool_choice": {"type": "any"}, "stop_sequences": ["z"], "top_k": 3}"#.to_vec(),
            br#"o{"model": "m:latest", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {"c": "x"}}}]}, {"role": "tool", "content": "r", "tool_name": "w"}], "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}}], "format": {"type": "object"}, "options": {"temperature": 0, "num_predict": 4, "stop": ["z"], "seed": -1, "logit_bias": "5:1"}, "think": "low", "stream": false, "keep_alive": "5m"}"#.to_vec(),
            br#"g{"model": "m", "prompt": "p", "system": "s", "format": "json", "raw": false, "context": [1, 2], "options": {"num_predict": -1, "top_k": 3}, "logprobs": true, "top_logprobs": 2}"#.to_vec(),
            br#"r{"model": "m", "instructions": "i", "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}, {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1", "output": "o"}], "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}], "tool_choice": {"type": "function", "name": "w"}, "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": true}}, "max_output_tokens": 4, "store": false}"#.to_vec(),
        ]
    }

    pub fn image() -> Vec<Vec<u8>> {
        [
            "rgb_9x7.png",
            "rgba_40x90.png",
            "palette_80x20.png",
            "rgb_120x90.jpg",
            "rgb_64x48.webp",
            "rgb_30x50.gif",
        ]
        .iter()
        .map(|f| read(&format!("vision/processor/{f}")))
        .collect()
    }

    pub fn json_schema() -> Vec<Vec<u8>> {
        vec![
            b"{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}, \"b\": {\"type\": \"string\", \"maxLength\": 4}}, \"required\": [\"a\"]}\x00\x01\x02\x03\x04\x05".to_vec(),
            b"{\"type\": \"array\", \"items\": {\"enum\": [\"x\", 1, null]}, \"minItems\": 1}\x00\x09\x08".to_vec(),
            b"{\"anyOf\": [{\"type\": \"number\", \"minimum\": 2}, {\"$ref\": \"#/$defs/s\"}], \"$defs\": {\"s\": {\"type\": \"string\", \"pattern\": \"^a+$\"}}}\x00\x00\x00".to_vec(),
            b"Lstart: \"yes\" | \"no\"\x00\x01".to_vec(),
        ]
    }
}

/// Deterministic mutations of the seeds, for runs without a fuzzer (the test suite's smoke):
/// bit flips, byte sets, inserts, deletes, interesting values, splices of two seeds.
pub fn mutations(seeds: &[Vec<u8>], count: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut state = seed | 1;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let mut v = seeds[next() as usize % seeds.len()].clone();
        for _ in 0..1 + next() % 8 {
            let len = v.len().max(1);
            let at = next() as usize % len;
            match next() % 7 {
                0 if !v.is_empty() => v[at] ^= 1 << (next() % 8),
                1 if !v.is_empty() => v[at] = next() as u8,
                2 => v.insert(at.min(v.len()), next() as u8),
                3 if !v.is_empty() => {
                    let n = (next() as usize % 16).min(v.len() - at);
                    v.drain(at..at + n);
                }
                4 if v.len() >= at + 4 => {
                    let vals = [0u32, 1, 0x7fff_ffff, 0xffff_ffff, 0x8000_0000, 0xffff];
                    let x = vals[next() as usize % vals.len()].to_le_bytes();
                    v[at..at + 4].copy_from_slice(&x);
                }
                5 => {
                    let other = &seeds[next() as usize % seeds.len()];
                    let from = next() as usize % other.len().max(1);
                    let n = (next() as usize % 64).min(other.len().saturating_sub(from));
                    let at = at.min(v.len());
                    v.splice(at..at, other[from..from + n].iter().copied());
                }
                _ => v.truncate(at),
            }
        }
        out.push(v);
    }
    out
}
