//! The real default model, shared by the generation tests.

use ferrum_backend::CpuBackend;
use ferrum_loader::ModelFile;
use ferrum_models::{LoadOptions, Model};
use ferrum_tokenizer::Tokenizer;

/// SmolLM2 (fetched by `scripts/fetch-test-assets.sh`) on `be`, for sequences of up to
/// `context` tokens, with its GGUF tokenizer.
pub fn smollm2(be: CpuBackend, context: usize) -> (Model<CpuBackend>, Tokenizer) {
    let p = ferrum_loader::assets::default_model_path();
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-test-assets.sh",
        p.display()
    );
    let file = ModelFile::open(&p).unwrap();
    let ModelFile::Gguf(g) = &file else {
        unreachable!()
    };
    let tok = Tokenizer::from_gguf(g).unwrap();
    let opts = LoadOptions {
        context: Some(context),
    };
    (Model::load(&file, be, &opts).unwrap(), tok)
}
