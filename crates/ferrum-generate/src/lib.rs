//! Generation: a model, its tokenizer and a sampler, producing streamed text.
//!
//! The [`Engine`] runs many requests on one model: a paged KV block pool with a prefix
//! cache ([`block_pool`]), a scheduler with chunked prefill and preemption, and per-request
//! sampling, stop matching and incremental detokenisation. A [`Session`] is the single-user
//! caller the REPL uses.

pub mod block_pool;
pub mod detok;
pub mod engine;
pub mod grammar;
pub mod sampler;
pub mod spec;
pub mod states;
pub mod stop;

use std::time::Instant;

use ferrum_backend::Backend;
use ferrum_core::Result;
use ferrum_models::Model;
use ferrum_tokenizer::Tokenizer;

pub use block_pool::{BlockPool, KvEvent, PrefixStats};
pub use detok::Detokenizer;
pub use engine::{
    Engine, EngineConfig, EngineStats, Output, OutputKind, Request, RequestId, Speculate,
    TokenLogprob, Usage,
};
pub use grammar::{Constraint, GrammarCompiler};
pub use sampler::{argmax, Sampler, SamplingExtras, SamplingParams, TokenHistory};
pub use stop::{StopMatcher, StopOutcome};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The caller's callback asked to stop.
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens that had to be computed (the rest were already cached).
    pub prefilled_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    pub finish: FinishReason,
    pub tokens: Vec<u32>,
}

/// Everything a generation request can set.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub extras: SamplingExtras,
    /// Stop strings: generation ends before any of them, which is not emitted.
    pub stop: Vec<String>,
    /// Control tokens' text is left out of the text (see [`Request::skip_special`]).
    pub skip_special: bool,
    /// The LoRA adapter the answer runs through (see [`Request::adapter`]; 0: none).
    pub adapter: usize,
    /// The prompt's images, in order (see [`Request::images`]).
    pub images: Vec<ferrum_image::Processed>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            params: SamplingParams::default(),
            extras: SamplingExtras::default(),
            stop: Vec::new(),
            skip_special: true,
            adapter: 0,
            images: Vec::new(),
        }
    }
}

/// One conversation on one model: a caller of the [`Engine`] that runs one request at a
/// time. Earlier turns stay in the engine's prefix cache, so the next turn of a chat (whose
/// rendered prompt repeats the whole history) prefills only what is new.
pub struct Session<B: Backend> {
    pub engine: Engine<B>,
}

impl<B: Backend> Session<B> {
    /// A session whose KV pool holds one sequence of the model's context.
    pub fn new(model: Model<B>, tokenizer: Tokenizer) -> Result<Self> {
        Self::speculative(model, tokenizer, 0)
    }

    /// [`Session::new`] drafting up to `spec_tokens` tokens a step by prompt lookup (0: off).
    pub fn speculative(model: Model<B>, tokenizer: Tokenizer, spec_tokens: usize) -> Result<Self> {
        let mut config = EngineConfig::for_model(&model.decoder, model.decoder.context);
        config.spec_tokens = spec_tokens;
        Ok(Session {
            engine: Engine::new(model, tokenizer, config)?,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.engine.tokenizer
    }

    pub fn model(&self) -> &Model<B> {
        &self.engine.model
    }

    pub fn context(&self) -> usize {
        self.engine.max_sequence()
    }

    /// Generates a continuation of `prompt`. `on_text` receives each text delta and returns
    /// `false` to stop early.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        params: &SamplingParams,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<GenerationStats> {
        let opts = GenerateOptions {
            max_tokens,
            params: params.clone(),
            ..GenerateOptions::default()
        };
        self.generate_with(prompt, &opts, on_text)
    }

    /// [`Session::generate`] with every option: penalties, min-p, logit bias, stop strings.
    pub fn generate_with(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<GenerationStats> {
        let mut req = Request::new(prompt.to_vec(), opts.max_tokens);
        req.params = opts.params.clone();
        req.extras = opts.extras.clone();
        req.stop = opts.stop.clone();
        req.skip_special = opts.skip_special;
        req.adapter = opts.adapter;
        req.images = opts.images.clone();
        let id = self.engine.add(req)?;
        let t0 = Instant::now();
        let mut first: Option<Instant> = None;
        let mut tokens = Vec::new();
        loop {
            let outs = match self.engine.step() {
                Ok(o) => o,
                Err(e) => {
                    // Leave the engine clean for the next turn.
                    self.engine.cancel(id);
                    let _ = self.engine.step();
                    return Err(e);
                }
            };
            for o in outs {
                match o.kind {
                    OutputKind::Token { token, text, .. } => {
                        first.get_or_insert_with(Instant::now);
                        tokens.push(token);
                        if !text.is_empty() && !on_text(&text) {
                            self.engine.cancel(id);
                        }
                    }
                    OutputKind::Finished {
                        reason,
                        text,
                        usage,
                        ..
                    } => {
                        if !text.is_empty() && reason != FinishReason::Cancelled {
                            on_text(&text);
                        }
                        let t1 = first.unwrap_or_else(Instant::now);
                        return Ok(GenerationStats {
                            prompt_tokens: usage.prompt_tokens,
                            prefilled_tokens: usage.prompt_tokens - usage.cached_tokens,
                            generated_tokens: usage.completion_tokens,
                            prefill_secs: (t1 - t0).as_secs_f64(),
                            decode_secs: t1.elapsed().as_secs_f64(),
                            finish: reason,
                            tokens,
                        });
                    }
                }
            }
        }
    }
}
