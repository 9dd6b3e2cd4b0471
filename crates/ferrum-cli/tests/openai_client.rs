//! Runs the Python end-to-end suites against this build's `ferrum` on the default model:
//! `tests/openai` (the server through the official `openai` package, and the chat page in
//! headless Chromium) and `tests/cli` (the terminal chat in tmux, pull/list/plan). The
//! Python side, Chromium and tmux are installed by `scripts/fetch-test-assets.sh`.

use std::process::Command;

/// Runs pytest with `args` against this build's `ferrum` and the default model, `serve_args`
/// added to the suite's server (tests/openai/conftest.py).
fn pytest(args: &[&str], serve_args: &str) {
    let cache = ferrum_loader::assets::cache_dir();
    let python = cache.join("venv-openai/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/fetch-test-assets.sh",
        python.display()
    );
    let model = ferrum_loader::assets::default_model_path();
    assert!(model.exists(), "{} is missing", model.display());
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .args(args)
        .current_dir(root)
        .env("FERRUM_BIN", env!("CARGO_BIN_EXE_ferrum"))
        .env("FERRUM_MODEL", &model)
        .env("FERRUM_SERVE_ARGS", serve_args)
        .output()
        .expect("running pytest");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "pytest {args:?} failed:\n{text}");
}

#[test]
fn python_end_to_end_suites() {
    // Two runs: each folder has its own conftest.py (and fixtures of the same names).
    for suite in ["tests/openai", "tests/cli"] {
        pytest(&[suite], "");
    }
}

/// The OpenAI suite's API tests against `serve --device vulkan` (lavapipe here and in CI).
/// Lavapipe decodes SmolLM2 at a few tokens a second, so the four tests that generate
/// hundreds of answers (twenty schema-constrained ones, ten forced tool calls, sixteen
/// concurrent streams) and the memory plan's (a CPU figure) run only on the CPU above.
#[test]
fn openai_suite_on_vulkan() {
    if ferrum_backend::vulkan::test_device().is_none() {
        return;
    }
    let skip = "not json_schema_output and not forced_tool_calls and not 16_concurrent \
                and not plan_predicts";
    pytest(
        &["tests/openai/test_openai.py", "-k", skip],
        "--device vulkan",
    );
}
