//! A short run of every fuzz target in the test suite: its seeds, then a few thousand
//! deterministic mutations of them. The long runs are AFL++'s (`scripts/fuzz.sh`); crashes
//! they find become cases in `tests/regressions/` here, which this runs too.

use ferrum_core::alloc::Metered;

#[global_allocator]
static ALLOC: Metered = Metered;

const MUTATIONS: usize = 1500;

fn run(name: &str) {
    let t = ferrum_fuzz::target(name).expect("a target of that name");
    let seeds = (t.seeds)();
    assert!(
        seeds.iter().any(|s| s.len() > 8),
        "{name}: the seeds are missing"
    );
    for s in &seeds {
        (t.run)(s);
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/regressions")
        .join(name);
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            (t.run)(&std::fs::read(e.path()).unwrap());
        }
    }
    for (i, m) in ferrum_fuzz::mutations(&seeds, MUTATIONS, 0x5eed ^ name.len() as u64)
        .iter()
        .enumerate()
    {
        let r = std::panic::catch_unwind(|| (t.run)(m));
        assert!(r.is_ok(), "{name}: mutation {i} panicked on input {m:?}");
    }
}

#[test]
fn gguf() {
    run("gguf");
}

#[test]
fn gguf_vocab() {
    run("gguf_vocab");
}

#[test]
fn hf_folder() {
    run("hf_folder");
}

#[test]
fn chat_template() {
    run("chat_template");
}

#[test]
fn openai_request() {
    run("openai_request");
}

#[test]
fn json_schema() {
    run("json_schema");
}

#[test]
fn every_target_is_smoked() {
    let names: Vec<&str> = ferrum_fuzz::TARGETS.iter().map(|t| t.name).collect();
    assert_eq!(
        names,
        [
            "gguf",
            "gguf_vocab",
            "hf_folder",
            "chat_template",
            "openai_request",
            "json_schema",
            "image"
        ]
    );
}

#[test]
fn image() {
    run("image");
}
