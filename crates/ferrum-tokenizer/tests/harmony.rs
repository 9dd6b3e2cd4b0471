//! gpt-oss's harmony format: the model's chat template rendered by our Jinja sandbox against
//! transformers' Jinja, and the built-in renderer (for models without a template) against
//! `openai-harmony`, on the conversations of tests/fixtures/harmony
//! (scripts/fixtures/make_harmony_renders.py).

use std::path::PathBuf;

use ferrum_tokenizer::harmony;
use ferrum_tokenizer::ChatTemplate;
use serde_json::{Map, Value};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn read_json(name: &str) -> Value {
    let p = fixtures().join("harmony").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// An OpenAI-shaped conversation as the template takes it (what the server hands it for a
/// template that serialises arguments itself: see `api::Traits`), and its variables.
fn template_inputs(conv: &Value) -> (Vec<Value>, Map<String, Value>) {
    let mut messages = Vec::new();
    for m in conv["messages"].as_array().unwrap() {
        let mut m = m.as_object().unwrap().clone();
        if m["role"] == "developer" {
            m.insert("role".into(), "system".into());
        }
        if m.get("content").is_none_or(Value::is_null) {
            m.insert("content".into(), "".into());
        }
        if let Some(r) = m.remove("reasoning_content") {
            m.insert("thinking".into(), r);
        }
        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
            for c in calls {
                let args = c["function"]["arguments"].as_str().unwrap().to_string();
                c["function"]["arguments"] = serde_json::from_str(&args).unwrap();
            }
        }
        m.remove("tool_call_id");
        messages.push(Value::Object(m));
    }
    let mut kwargs = Map::new();
    for k in ["tools", "reasoning_effort"] {
        if let Some(v) = conv.get(k) {
            kwargs.insert(k.into(), v.clone());
        }
    }
    (messages, kwargs)
}

#[test]
fn the_template_renders_as_transformers_and_the_builtin_as_openai_harmony() {
    let source = std::fs::read_to_string(fixtures().join("harmony/gpt-oss.jinja")).unwrap();
    let template = ChatTemplate::new(&source, "<|startoftext|>", "<|return|>").unwrap();
    let today = ferrum_tokenizer::chat::today();
    let convs = read_json("conversations.json");
    let renders = read_json("renders.json");
    let mut agree = 0;
    for (conv, want) in convs
        .as_array()
        .unwrap()
        .iter()
        .zip(renders.as_array().unwrap())
    {
        let name = conv["name"].as_str().unwrap();
        let (messages, kwargs) = template_inputs(conv);
        let got = template.render_with(&messages, true, &kwargs).unwrap();
        assert_eq!(
            got.replace(&today, "{DATE}"),
            want["template"].as_str().unwrap(),
            "template, {name}"
        );
        let got = harmony::render(&messages, &kwargs, "{DATE}").unwrap();
        assert_eq!(got, want["harmony"].as_str().unwrap(), "built-in, {name}");
        agree += usize::from(want["same"] == true);
    }
    // The two references agree where neither developer instructions nor tool results appear.
    assert!(agree >= 2, "{agree}");
}
