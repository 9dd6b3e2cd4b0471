//! The real models (fetched by scripts/fetch-test-assets.sh), shared by the generation tests.

use ferrum_backend::CpuBackend;
use ferrum_loader::ModelFile;
use ferrum_models::{LoadOptions, Model};
use ferrum_tokenizer::Tokenizer;

/// SmolLM2 (fetched by `scripts/fetch-test-assets.sh`) on `be`, for sequences of up to
/// `context` tokens, with its GGUF tokenizer.
#[allow(dead_code)] // not every test binary runs SmolLM2
pub fn smollm2(be: CpuBackend, context: usize) -> (Model<CpuBackend>, Tokenizer) {
    load(&ferrum_loader::assets::default_model_path(), be, context)
}

/// A GGUF model (fetched by `scripts/fetch-test-assets.sh`) on `be`, for sequences of up to
/// `context` tokens, with its own tokenizer.
pub fn load<B: ferrum_backend::Backend>(
    p: &std::path::Path,
    be: B,
    context: usize,
) -> (Model<B>, Tokenizer) {
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-test-assets.sh",
        p.display()
    );
    let file = ModelFile::open(p).unwrap();
    let ModelFile::Gguf(g) = &file else {
        unreachable!()
    };
    let tok = Tokenizer::from_gguf(g).unwrap();
    let opts = LoadOptions {
        context: Some(context),
        ..Default::default()
    };
    (Model::load(&file, be, &opts).unwrap(), tok)
}

/// A one-message conversation through the model's chat template, as prompt ids.
#[allow(dead_code)] // not every test binary chats
pub fn chat(tok: &Tokenizer, q: &str) -> Vec<u32> {
    let m = [ferrum_tokenizer::Message {
        role: "user".into(),
        content: q.into(),
    }];
    let text = tok.chat_template().unwrap().render(&m, true).unwrap();
    tok.encode(&text, false).unwrap()
}
