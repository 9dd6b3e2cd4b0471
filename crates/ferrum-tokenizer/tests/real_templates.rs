//! Published models' real chat templates rendered by ferrum against transformers.
//!
//! The templates are the ones llama.cpp keeps for its own tests (SmolLM3-3B, Granite 3.3,
//! Phi-3.5-mini, Gemma 2, GLM-4.6, Ministral 3 14B Reasoning, Mistral Small 3.2, DeepSeek-V3.1,
//! DeepSeek-V3.2, Kimi K2 Instruct, Kimi K2 Thinking, Gemma 4 31B and its earlier interleaved
//! template;
//! `vendor/llama.cpp/models/templates/*.jinja` of the
//! llama-cpp-python==0.3.36 sdist), read from the cache that `scripts/fetch-test-assets.sh`
//! fills: they are other projects' files and are not committed here. The expected renders
//! (`tests/fixtures/templates/cases.json`, by `scripts/fixtures/real_templates_reference.py`)
//! come from transformers' `render_jinja_template`, the code behind
//! `apply_chat_template(..., tokenize=False)`; the fixture holds their sha256 and length only,
//! since a render carries the template's own prose (system prompts, instructions). DeepSeek-V3.2's
//! template (llama.cpp's own) uses a `from_json` filter that jinja2 lacks: the script gives
//! jinja2 one (`extra_filters` in the fixture) so that it compiles, and no case calls it.
//!
//! Each case is rendered the way the server renders a request: OpenAI-shaped messages (tool
//! calls and tool results included) through `ChatTemplate::render_with`, with the entry's
//! `chat_template_kwargs` and `tools` as template variables. Cases made only of role/content
//! messages and no variables are also rendered through `ChatTemplate::render`. Conversations
//! the template refuses in transformers (`raise_exception`) must be refused by ferrum too.
//!
//! Cases that transformers' sandbox stops (`sandbox_errors` in the fixture: Kimi K2 Instruct's
//! and Thinking's tool calls append to a list) are not checked.
//!
//! Templates that call `strftime_now` (Granite without a system message; Mistral Small 3.2 on
//! every render, its default system prompt carrying the date) were rendered with
//! the clock pinned; the fixture lists each format's pinned text, which replaces here what
//! ferrum's own `strftime_now` gives now before the render is hashed.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use ferrum_core::Error;
use ferrum_tokenizer::{ChatTemplate, Message};
use serde::Deserialize;
use serde_json::{Map, Value};

#[derive(Deserialize)]
struct Entry {
    template_file: String,
    sha256: String,
    model: String,
    bos_token: String,
    eos_token: String,
    kwargs: Map<String, Value>,
    strftime_now: Option<PinnedClock>,
    cases: Vec<Case>,
    errors: Vec<RefusedCase>,
}

#[derive(Deserialize)]
struct PinnedClock {
    fixed: String,
    /// `strftime` format -> its text at `fixed`.
    outputs: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    expected_sha256: String,
    expected_len: usize,
}

#[derive(Deserialize)]
struct RefusedCase {
    name: String,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    /// transformers' message (the template's `raise_exception` text).
    error: String,
}

fn entries() -> Vec<Entry> {
    let p = common::fixture("templates/cases.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The template variables a request with these tools would bring (as the server's
/// `template_inputs`): the entry's kwargs, plus `tools` when there are some.
fn template_kwargs(entry: &Entry, tools: &Option<Vec<Value>>) -> Map<String, Value> {
    let mut kwargs = entry.kwargs.clone();
    if let Some(tools) = tools {
        kwargs.insert("tools".into(), Value::Array(tools.clone()));
    }
    kwargs
}

/// What ferrum's `strftime_now(format)` gives now.
fn ferrum_strftime_now(format: &str) -> String {
    let t = ChatTemplate::new("{{ strftime_now(fmt) }}", "", "").unwrap();
    let mut kwargs = Map::new();
    kwargs.insert("fmt".into(), Value::String(format.to_string()));
    let no_messages: [Value; 0] = [];
    t.render_with(&no_messages, false, &kwargs)
        .unwrap_or_else(|e| panic!("strftime_now({format:?}): {e}"))
}

/// `text` with ferrum's current `strftime_now` texts replaced by the fixture's pinned ones.
fn pinned(entry: &Entry, text: &str) -> String {
    let mut text = text.to_string();
    if let Some(clock) = &entry.strftime_now {
        for (format, pinned) in &clock.outputs {
            text = text.replace(&ferrum_strftime_now(format), pinned);
        }
    }
    text
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether ferrum's render is transformers' (by hash), else what to report.
fn compare(entry: &Entry, case: &Case, text: &str) -> Option<String> {
    let text = pinned(entry, text);
    if sha256(text.as_bytes()) == case.expected_sha256 {
        return None;
    }
    let shown: String = text.chars().take(1200).collect();
    Some(format!(
        "render differs from transformers ({} bytes, transformers' {}); ferrum's:\n{shown:?}",
        text.len(),
        case.expected_len
    ))
}

/// The messages as plain role/content [`Message`]s, when that is all they hold.
fn plain_messages(messages: &[Value]) -> Option<Vec<Message>> {
    messages
        .iter()
        .map(|m| {
            let obj = m.as_object()?;
            let only_role_content = obj.len() == 2
                && obj.get("role").is_some_and(Value::is_string)
                && obj.get("content").is_some_and(Value::is_string);
            only_role_content
                .then(|| serde_json::from_value::<Message>(m.clone()).ok())
                .flatten()
        })
        .collect()
}

#[test]
fn real_templates_render_as_transformers() {
    let entries = entries();
    let templates: BTreeSet<&str> = entries.iter().map(|e| e.template_file.as_str()).collect();
    assert!(
        templates.len() >= 13,
        "cases.json covers too few templates: {templates:?}"
    );

    let mut failures = Vec::new();
    let mut renders = 0;
    let mut refusals = 0;
    for entry in &entries {
        let path = common::llama_template(&entry.template_file);
        let source =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            sha256(source.as_bytes()),
            entry.sha256,
            "{}: not the template the cases were made from (re-run scripts/fetch-test-assets.sh)",
            path.display()
        );
        let label = format!(
            "{} [{}; kwargs {}; generated from sha256 {}]",
            entry.template_file,
            entry.model,
            Value::Object(entry.kwargs.clone()),
            entry.sha256
        );
        let template = ChatTemplate::new(&source, &entry.bos_token, &entry.eos_token)
            .unwrap_or_else(|e| panic!("{label}: ferrum cannot compile the template: {e}"));
        assert!(!entry.cases.is_empty(), "{label}: no cases");
        if let Some(clock) = &entry.strftime_now {
            eprintln!(
                "{}: strftime_now pinned at {} in the fixture; ferrum's clock used instead",
                entry.template_file, clock.fixed
            );
        }

        for case in &entry.cases {
            renders += 1;
            let kwargs = template_kwargs(entry, &case.tools);
            let got = template.render_with(&case.messages, case.add_generation_prompt, &kwargs);
            match got {
                Ok(text) => {
                    if let Some(why) = compare(entry, case, &text) {
                        failures.push(format!("{label}, case {}: {why}", case.name));
                    }
                }
                Err(e) => failures.push(format!(
                    "{label}, case {}: ferrum failed to render: {e}",
                    case.name
                )),
            }

            // The same conversation through the plain-message API.
            if entry.kwargs.is_empty() && case.tools.is_none() {
                if let Some(plain) = plain_messages(&case.messages) {
                    match template.render(&plain, case.add_generation_prompt) {
                        Ok(text) => {
                            if let Some(why) = compare(entry, case, &text) {
                                failures.push(format!(
                                    "{label}, case {} (ChatTemplate::render): {why}",
                                    case.name
                                ));
                            }
                        }
                        Err(e) => failures.push(format!(
                            "{label}, case {} (ChatTemplate::render): ferrum failed to render: {e}",
                            case.name
                        )),
                    }
                }
            }
        }

        for case in &entry.errors {
            refusals += 1;
            let kwargs = template_kwargs(entry, &case.tools);
            match template.render_with(&case.messages, case.add_generation_prompt, &kwargs) {
                Err(Error::Template(m)) if m.contains(&case.error) => {}
                Err(e) => failures.push(format!(
                    "{label}, case {}: transformers refuses it with {:?}; ferrum's error differs: {e}",
                    case.name, case.error
                )),
                Ok(text) => failures.push(format!(
                    "{label}, case {}: transformers refuses it with {:?}, ferrum rendered {text:?}",
                    case.name, case.error
                )),
            }
        }
    }
    eprintln!(
        "{renders} renders and {refusals} refusals over {} templates",
        templates.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from transformers:\n\n{}",
        failures.len(),
        renders + refusals,
        failures.join("\n\n")
    );
}
