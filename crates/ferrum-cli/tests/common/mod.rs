//! What the end-to-end test binaries share.

use std::process::Command;

/// Runs pytest with `args` against this build's `ferrum` and the default model, `serve_args`
/// added to the suite's server (tests/openai/conftest.py).
pub fn pytest(args: &[&str], serve_args: &str) {
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
