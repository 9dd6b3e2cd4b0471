//! Runs the Python end-to-end suites against this build's `ferrum` on the default model:
//! `tests/openai` (the server through the official `openai` package, and the chat page in
//! headless Chromium) and `tests/cli` (the terminal chat in tmux, pull/list/plan). The
//! Python side, Chromium and tmux are installed by `scripts/fetch-test-assets.sh`.

mod common;
use common::pytest;

#[test]
fn python_end_to_end_suites() {
    // Two runs: each folder has its own conftest.py (and fixtures of the same names).
    for suite in ["tests/openai", "tests/cli"] {
        pytest(&[suite], "");
    }
}
