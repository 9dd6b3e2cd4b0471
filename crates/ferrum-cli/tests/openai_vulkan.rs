//! The OpenAI suite against `serve --device vulkan`, in a test binary of its own: cargo runs
//! test binaries one after another, so lavapipe's load on the cores never overlaps the CPU
//! suite's timed tests (openai_client.rs).

mod common;
use common::pytest;

/// The OpenAI suite's API tests and the agent APIs' (Responses, Messages, tokenize) against
/// `serve --device vulkan` (lavapipe here and in CI).
/// Lavapipe decodes SmolLM2 at a few tokens a second, so the four tests that generate
/// hundreds of answers (twenty schema-constrained ones, ten forced tool calls, sixteen
/// concurrent streams) and the memory plan's (a CPU figure) run only on the CPU
/// (openai_client.rs).
#[test]
fn openai_suite_on_vulkan() {
    if ferrum_backend::vulkan::test_device().is_none() {
        return;
    }
    let skip = "not json_schema_output and not forced_tool_calls and not 16_concurrent \
                and not plan_predicts";
    pytest(
        &[
            "tests/openai/test_openai.py",
            "tests/openai/test_agent_apis.py",
            "-k",
            skip,
        ],
        "--device vulkan",
    );
}
