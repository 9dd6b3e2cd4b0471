//! Runs the Python end-to-end suites against this build's `ferrum` on the default model:
//! `tests/openai` (the server through the official `openai` package, and the chat page in
//! headless Chromium) and `tests/cli` (the terminal chat in tmux, pull/list/plan). The
//! Python side, Chromium and tmux are installed by `scripts/fetch-test-assets.sh`.

use std::process::Command;

#[test]
fn python_end_to_end_suites() {
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
    // Two runs: each folder has its own conftest.py (and fixtures of the same names).
    for suite in ["tests/openai", "tests/cli"] {
        let out = Command::new(&python)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", suite])
            .current_dir(root)
            .env("FERRUM_BIN", env!("CARGO_BIN_EXE_ferrum"))
            .env("FERRUM_MODEL", &model)
            .output()
            .expect("running pytest");
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "the {suite} suite failed:\n{text}");
    }
}
