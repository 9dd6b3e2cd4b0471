//! Generation: a model, its tokenizer and a sampler, producing streamed text.
//!
//! A [`Session`] is one conversation on one model. It remembers which tokens sit in the KV
//! cache, so the next turn of a chat (whose rendered prompt repeats the whole history)
//! prefills only the tokens that are new.

pub mod detok;
pub mod sampler;
pub mod stop;

use std::time::Instant;

use ferrum_backend::Backend;
use ferrum_core::{Error, Result};
use ferrum_models::{Logits, Model};
use ferrum_tokenizer::Tokenizer;

pub use detok::Detokenizer;
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
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            params: SamplingParams::default(),
            extras: SamplingExtras::default(),
            stop: Vec::new(),
        }
    }
}

pub struct Session<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    /// Tokens whose keys and values are in the cache, in order.
    cached: Vec<u32>,
}

impl<B: Backend> Session<B> {
    pub fn new(model: Model<B>, tokenizer: Tokenizer) -> Self {
        Session {
            model,
            tokenizer,
            cached: Vec::new(),
        }
    }

    /// Forgets the cached conversation.
    pub fn reset(&mut self) {
        self.cached.clear();
    }

    pub fn context(&self) -> usize {
        self.model.decoder.context
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
        opts.extras.validate()?;
        let max_tokens = opts.max_tokens;
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        let ctx = self.context();
        if prompt.len() >= ctx {
            return Err(Error::InvalidRequest(format!(
                "the prompt is {} tokens; the context holds {ctx}",
                prompt.len()
            )));
        }
        // Reuse the cached prefix, but always recompute at least the last prompt token: its
        // logits are what the first sampled token comes from.
        let mut keep = self
            .cached
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        keep = keep.min(prompt.len() - 1);
        self.cached.truncate(keep);

        let t0 = Instant::now();
        let mut logits = self
            .model
            .decoder
            .forward(&prompt[keep..], keep, Logits::Last)?;
        self.cached.extend_from_slice(&prompt[keep..]);
        let prefill_secs = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let mut sampler = Sampler::with_extras(opts.params.clone(), opts.extras.clone());
        sampler.observe_prompt(prompt);
        let mut detok = Detokenizer::new();
        let mut stops = StopMatcher::new(opts.stop.clone());
        let mut out = Vec::new();
        let finish = loop {
            if out.len() >= max_tokens {
                break FinishReason::Length;
            }
            let next = sampler.sample(&logits);
            if self.tokenizer.eos_ids().contains(&next) {
                break FinishReason::Stop;
            }
            out.push(next);
            sampler.observe(next);
            let text = detok.push(&self.tokenizer, next)?;
            // Stop strings are matched across deltas and never emitted.
            let outcome = stops.push(&text);
            if !outcome.emit.is_empty() && !on_text(&outcome.emit) {
                break FinishReason::Cancelled;
            }
            if outcome.stopped {
                break FinishReason::Stop;
            }
            if self.cached.len() + 1 > ctx {
                break FinishReason::Length;
            }
            let pos = self.cached.len();
            logits = self.model.decoder.forward(&[next], pos, Logits::Last)?;
            self.cached.push(next);
        };
        if finish != FinishReason::Stop {
            let held = stops.flush();
            if !held.is_empty() {
                on_text(&held);
            }
        }
        Ok(GenerationStats {
            prompt_tokens: prompt.len(),
            prefilled_tokens: prompt.len() - keep,
            generated_tokens: out.len(),
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
            finish,
            tokens: out,
        })
    }
}
