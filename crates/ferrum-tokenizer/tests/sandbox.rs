//! Hostile chat templates: each must end in an `Error::TemplateLimit` naming the limit, not
//! hang or take the memory, and ordinary templates must render as before. This binary
//! installs the metering allocator, as `ferrum` does, so the memory budget is enforced.

mod common;

use std::time::{Duration, Instant};

use ferrum_core::alloc::Metered;
use ferrum_core::Error;
use ferrum_tokenizer::{ChatTemplate, Message, RenderLimits};

#[global_allocator]
static ALLOC: Metered = Metered;

fn chat() -> Vec<Message> {
    vec![
        Message::new("system", "Be brief."),
        Message::new("user", "Hello"),
    ]
}

/// Renders and returns the limit error's message (panics on success or another error).
fn limit_error(t: &ChatTemplate, messages: &[Message]) -> String {
    let t0 = Instant::now();
    let r = t.render(messages, true);
    eprintln!("render ended after {:?}", t0.elapsed());
    match r {
        Err(Error::TemplateLimit(m)) => m,
        other => panic!("expected a limit error, got {other:?}"),
    }
}

#[test]
fn the_allocator_is_metered_here() {
    assert!(Metered::installed());
}

#[test]
fn a_loop_of_loops_runs_out_of_fuel() {
    let t = ChatTemplate::new(
        "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let m = limit_error(&t, &chat());
    assert!(m.contains("instructions"), "{m}");
    // Fuel is deterministic: nothing was left running, the template stays usable.
    assert!(t.disabled_reason().is_none());
}

#[test]
fn a_recursive_macro_is_stopped() {
    for src in [
        // Deep: the recursion limit (on a stack big enough for it).
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        // Wide: two calls per level, 2^500 in all: fuel.
        "{% macro f(n) %}{% if n < 500 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
    ] {
        let t = ChatTemplate::new(src, "", "").unwrap();
        let m = limit_error(&t, &chat());
        assert!(
            m.contains("recursion") || m.contains("instructions"),
            "{m}"
        );
    }
}

/// Found by AFL++ (crates/ferrum-fuzz): a namespace attribute set to a tuple holding the
/// namespace itself; printing it recursed until the stack overflowed, which aborts the whole
/// process. The meter stops the render thread at its stack budget.
#[test]
fn a_value_that_contains_itself_is_stopped_before_the_stack_overflows() {
    let t = ChatTemplate::new(
        "{% set ns = namespace(s='ab') %}{% for i in range(8) %}{% set ns.s = ns, z ~ ns.s %}\
         {% endfor %}{{ ns.s[:10] }}",
        "",
        "",
    )
    .unwrap();
    let m = limit_error(&t, &chat());
    assert!(m.contains("recursed"), "{m}");
    assert!(t.disabled_reason().is_some());
}

/// Found in review: a list nested two million deep fits the memory budget, and dropping it
/// at the end of the render recurses once per level without allocating, so the meter cannot
/// see it; the render thread's stack is made big enough for the deepest value a budget allows.
#[test]
fn dropping_a_deeply_nested_value_does_not_overflow_the_stack() {
    let limits = RenderLimits {
        fuel: 1 << 40,
        timeout: Duration::from_secs(60),
        ..RenderLimits::default()
    };
    let t = ChatTemplate::with_limits(
        "{% set ns = namespace(x=0) %}{% for i in range(2000) %}{% for j in range(1000) %}\
         {% set ns.x = [ns.x] %}{% endfor %}{% endfor %}ok",
        "",
        "",
        limits,
    )
    .unwrap();
    assert_eq!(t.render(&chat(), false).unwrap(), "ok");
}

#[test]
fn a_huge_output_is_refused() {
    let t = ChatTemplate::new("{{ 'x' * 10000000 }}", "", "").unwrap();
    let m = limit_error(&t, &chat());
    assert!(m.contains("longer than"), "{m}");
    // Output grown one piece at a time stops at the cap too.
    let t = ChatTemplate::new(
        "{% for i in range(10000) %}{% for j in range(10000) %}xxxxxxxx{% endfor %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let m = limit_error(&t, &chat());
    assert!(m.contains("longer than"), "{m}");
    // The cap grows with the input: a long conversation is not a hostile template.
    let t =
        ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}", "", "").unwrap();
    let long = vec![Message::new("user", "y".repeat(6 << 20))];
    assert_eq!(t.render(&long, false).unwrap().len(), 6 << 20);
}

#[test]
fn doubling_a_string_trips_the_memory_budget_and_disables_the_template() {
    let src = "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(60) %}\
               {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
    let limits = RenderLimits {
        max_memory: 64 << 20,
        ..RenderLimits::default()
    };
    let t = ChatTemplate::with_limits(src, "", "", limits).unwrap();
    let clone = t.clone();
    let m = limit_error(&t, &chat());
    assert!(m.contains("memory"), "{m}");
    // The abandoned render is never started again, from any clone.
    let m = limit_error(&clone, &chat());
    assert!(m.contains("disabled") && m.contains("memory"), "{m}");
}

#[test]
fn a_render_past_its_deadline_is_abandoned() {
    let limits = RenderLimits {
        fuel: 1 << 40,
        timeout: Duration::from_millis(1),
        ..RenderLimits::default()
    };
    let t = ChatTemplate::with_limits(
        "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}",
        "",
        "",
        limits,
    )
    .unwrap();
    let m = limit_error(&t, &chat());
    assert!(m.contains("longer than"), "{m}");
    // Only that request fails: slowness on a busy machine does not disable a template.
    assert!(t.disabled_reason().is_none());
}

#[test]
fn concurrent_hostile_renders_are_bounded_and_all_refused() {
    let src = "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(60) %}\
               {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
    let limits = RenderLimits {
        max_memory: 16 << 20,
        ..RenderLimits::default()
    };
    let t = ChatTemplate::with_limits(src, "", "", limits).unwrap();
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..12)
            .map(|_| s.spawn(|| limit_error(&t, &chat())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(errors.iter().all(|m| m.contains("memory")), "{errors:?}");
    assert!(t.disabled_reason().is_some());
    // The slots of the stopped renders were given back: another template still renders.
    let ok = ChatTemplate::new("{{ messages[1].content }}", "", "").unwrap();
    assert_eq!(ok.render(&chat(), false).unwrap(), "Hello");
}

#[test]
fn a_template_hostile_only_to_long_inputs_fails_per_request() {
    // Quadratic in the content's length: fine for the load check's sample, not for 5000
    // characters (25 million iterations).
    let t = ChatTemplate::new(
        "{% for m in messages %}{% for i in range(m.content | length) %}\
         {% for j in range(m.content | length) %}{% endfor %}{% endfor %}{{ m.content }}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    t.dry_run().unwrap();
    let m = limit_error(&t, &[Message::new("user", "z".repeat(5000))]);
    assert!(m.contains("instructions"), "{m}");
    assert_eq!(t.render(&chat(), false).unwrap(), "Be brief.Hello");
}

#[test]
fn the_load_check_disables_a_hostile_template_and_passes_real_ones() {
    let hostile = ChatTemplate::new("{{ 'x' * 10000000 }}", "", "").unwrap();
    assert!(matches!(hostile.dry_run(), Err(Error::TemplateLimit(_))));
    assert!(hostile.disabled_reason().is_some());
    // A template that refuses a system turn on purpose is not hostile.
    let strict = ChatTemplate::new(
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}",
        "",
        "",
    )
    .unwrap();
    strict.dry_run().unwrap();
    assert!(strict.disabled_reason().is_none());
}

/// Real templates stay far inside the limits on long conversations with tools: SmolLM2's
/// (from its GGUF) and a Qwen3-style template with tool calls.
#[test]
fn real_templates_render_long_conversations_within_the_limits() {
    let g = ferrum_loader::GgufFile::open(common::smollm2_gguf()).unwrap();
    let tok = ferrum_tokenizer::Tokenizer::from_gguf(&g).unwrap();
    let t = tok.chat_template().unwrap();
    let mut long = vec![Message::new("system", "You are terse.")];
    for i in 0..400 {
        long.push(Message::new(
            "user",
            format!("question {i}: {}", "words ".repeat(20)),
        ));
        long.push(Message::new("assistant", format!("answer {i}")));
    }
    let text = t.render(&long, true).unwrap();
    assert!(text.contains("question 399"));

    let qwen_like = r#"{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}{{- "\n</tools><|im_end|>\n" }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}{%- if ns.multi_step_tool and message.role == "user" %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}{%- if message.role == "user" or message.role == "system" %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- elif message.role == "assistant" %}{{- '<|im_start|>' + message.role + '\n' + message.content }}{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}{{- '<tool_call>\n{"name": "' }}{{- tool_call.function.name }}{{- '", "arguments": ' }}{{- tool_call.function.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\n' }}{%- elif message.role == "tool" %}{{- '<|im_start|>user\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response><|im_end|>\n' }}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;
    let t = ChatTemplate::new(qwen_like, "", "").unwrap();
    let mut msgs = Vec::new();
    for i in 0..300 {
        msgs.push(serde_json::json!({"role": "user", "content": format!("question {i}")}));
        msgs.push(
            serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"q": i}}}]}),
        );
        msgs.push(serde_json::json!({"role": "tool", "content": format!("result {i}")}));
    }
    let tools: Vec<serde_json::Value> = (0..50)
        .map(|i| {
            serde_json::json!({"type": "function", "function": {"name": format!("tool{i}"),
            "parameters": {"type": "object", "properties": {"q": {"type": "integer"}}}}})
        })
        .collect();
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("tools".into(), serde_json::Value::Array(tools));
    let text = t.render_with(&msgs, true, &kwargs).unwrap();
    assert!(text.contains("result 299") && text.contains("tool49"));
}
