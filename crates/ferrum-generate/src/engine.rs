//! The engine: many requests on one model. Each [`Engine::step`] schedules a batch (decode
//! tokens of running sequences first, then prefill chunks of new ones, within a token
//! budget), runs it as one forward pass, samples where a sequence's input is used up, and
//! returns what happened as [`Output`]s.
//!
//! KV memory belongs to the [`BlockPool`]; a sequence holds a block table and nothing else.
//! When a running sequence needs a block and none is left, the newest running sequence is
//! preempted: its blocks go back (cached blocks stay findable) and it waits to be recomputed
//! from its tokens, which it keeps. A prompt that could never fit is refused when it arrives.
//!
//! A model with windowed layers keeps a block table per KV group ([`KvGroups`]); a windowed
//! group's blocks that fall behind its window go back to the pool as the sequence grows
//! (still findable by the prefix cache until reclaimed), so a long sequence holds its full
//! layers' blocks plus a window per windowed group.

use std::collections::VecDeque;

use ferrum_backend::Backend;
use ferrum_core::{Error, Result};
use ferrum_models::{
    Decoder, Embeds, ImageGrid, KvCache, KvGroups, Logits, Model, SeqChunk, NO_BLOCK,
};
use ferrum_tokenizer::Tokenizer;

use crate::block_pool::{BlockPool, PrefixStats};
use crate::detok::Detokenizer;
use crate::grammar::{Constraint, GrammarCompiler, TokenMask};
use crate::sampler::{Sampler, SamplingExtras, SamplingParams};
use crate::spec::{DraftLen, DraftModel, DraftSeq, Drafter, NgramDrafter};
use crate::states::{StatePool, StateStats};
use crate::stop::StopMatcher;
use crate::FinishReason;

/// One sequence's share of a step: `n` tokens from its first uncomputed one, of which the
/// last `draft.len()` are drafted (speculation) rather than its own.
struct Work {
    seq: usize,
    n: usize,
    draft: Vec<u32>,
}

/// How the engine sizes and schedules.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// KV capacity in blocks (each holds one KV group's layers: every layer for a model
    /// without windows).
    pub kv_blocks: usize,
    /// Tokens one step may carry (decode tokens plus prefill chunks); at most the decoder's
    /// pass ([`ferrum_models::decoder::Decoder::pass_capacity`]: `CHUNK`, `LONG_CHUNK` for a
    /// model in the CPU's codebook formats, or more for an image).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    pub prefix_caching: bool,
    /// Speculative decoding: the most tokens a decoding sequence drafts (by prompt lookup,
    /// [`crate::spec::NgramDrafter`], or with a draft model once one is set) and checks in one
    /// step; 0 leaves it off unless a request asks. The answer is the same either way (see
    /// [`crate::spec`]).
    pub spec_tokens: usize,
    /// Hybrid models (linear-attention layers): recurrent-state snapshots kept for the
    /// prefix cache, beside one live state per running sequence (see [`crate::states`]).
    pub state_snapshots: usize,
}

impl EngineConfig {
    /// A pool of `kv_tokens` positions in blocks of [`ferrum_models::decoder::BLOCK_SIZE`],
    /// prefix caching on.
    pub fn with_kv_tokens(kv_tokens: usize) -> EngineConfig {
        EngineConfig {
            block_size: ferrum_models::decoder::BLOCK_SIZE,
            kv_blocks: kv_tokens
                .div_ceil(ferrum_models::decoder::BLOCK_SIZE)
                .max(1),
            max_batch_tokens: ferrum_models::decoder::CHUNK,
            max_running: 64,
            prefix_caching: true,
            spec_tokens: 0,
            state_snapshots: 16,
        }
    }

    /// A pool in which one sequence of `kv_tokens` positions fits, for this decoder's KV
    /// groups (a windowed group holds a window, not the whole sequence).
    pub fn for_model<B: Backend>(decoder: &Decoder<B>, kv_tokens: usize) -> EngineConfig {
        let mut c = EngineConfig::with_kv_tokens(kv_tokens);
        // A vision model's passes carry a whole image besides the usual chunk.
        c.max_batch_tokens = decoder.pass_capacity();
        c.kv_blocks = decoder
            .kv_groups
            .blocks_for(kv_tokens.max(1), c.block_size, c.max_batch_tokens)
            .max(1);
        if decoder.is_hybrid() {
            // Each running sequence holds a whole recurrent state (Qwen3.5-9B: about 50 MB).
            c.max_running = c.max_running.min(HYBRID_MAX_RUNNING);
        }
        c
    }
}

/// Running sequences of a hybrid model unless the caller says otherwise.
pub const HYBRID_MAX_RUNNING: usize = 16;

/// A hybrid model's prompts keep a state snapshot every this many blocks (and at their last
/// block boundary), so a request sharing part of a long prompt resumes near its end.
pub const SNAPSHOT_EVERY_BLOCKS: usize = 16;

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub extras: SamplingExtras,
    /// Generation ends before any of these strings, which are not emitted.
    pub stop: Vec<String>,
    /// Tokens that end generation like end-of-sequence (not emitted).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Report log-probabilities: `Some(n)` gives the chosen token's and the top `n`.
    pub logprobs: Option<usize>,
    /// Output must match this (JSON schema, grammar), enforced token by token.
    pub constraint: Option<Constraint>,
    /// Whether and how far this request drafts (the answer is the same either way).
    pub speculate: Speculate,
    /// Control tokens' text is left out of the output text (vLLM's `skip_special_tokens`);
    /// harmony answers keep it, their channels being written in control tokens.
    pub skip_special: bool,
    /// The LoRA adapter it runs through ([`ferrum_models::decoder::SeqChunk::adapter`]; 0:
    /// the base model).
    pub adapter: usize,
    /// The images whose placeholders the prompt holds, in order (processed for the model's
    /// vision tower, which the engine runs when the request arrives).
    pub images: Vec<ferrum_image::Processed>,
}

impl Request {
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            max_tokens,
            params: SamplingParams::greedy(),
            extras: SamplingExtras::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
            speculate: Speculate::Default,
            skip_special: true,
            adapter: 0,
            images: Vec::new(),
        }
    }
}

/// A request's choice about speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Speculate {
    /// The engine's [`EngineConfig::spec_tokens`].
    #[default]
    Default,
    Off,
    /// The engine's length, or [`Speculate::DEFAULT_TOKENS`] where the engine's default is off.
    On,
    /// Up to this many tokens a step (0: off), at most [`Speculate::MAX_TOKENS`].
    Tokens(usize),
}

impl Speculate {
    /// The draft length `On` means when the engine does not speculate by default.
    pub const DEFAULT_TOKENS: usize = 4;
    /// The most tokens one step can check for a sequence, besides its own.
    pub const MAX_TOKENS: usize = ferrum_models::decoder::CHUNK - 1;

    /// The most tokens drafted a step, given the engine's default.
    pub fn tokens(self, engine: usize) -> usize {
        let k = match self {
            Speculate::Default => engine,
            Speculate::Off => 0,
            Speculate::On if engine > 0 => engine,
            Speculate::On => Self::DEFAULT_TOKENS,
            Speculate::Tokens(k) => k,
        };
        k.min(Self::MAX_TOKENS)
    }
}

pub type RequestId = u64;

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The most likely tokens with theirs, highest first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum OutputKind {
    /// A generated token and the text it completes (possibly empty: text is held back until
    /// a character, grapheme or possible stop string is complete).
    Token {
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The last event of a request; `text` is any held-back text released at the end.
    Finished {
        reason: FinishReason,
        text: String,
        usage: Usage,
        /// The stop string that ended the text, if one did (Anthropic's `stop_sequence`).
        stop_string: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub id: RequestId,
    pub kind: OutputKind,
}

/// What the engine is doing, for `/metrics` and the benchmark.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks: usize,
    pub kv_blocks_used: usize,
    /// Positions a KV block holds.
    pub block_size: usize,
    /// Distinct blocks the prefix cache can serve (what the KV events announce).
    pub cached_blocks: usize,
    pub prefix: PrefixStats,
    /// Hybrid models: the recurrent-state snapshots behind their prefix cache.
    pub states: StateStats,
    pub preemptions: u64,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Speculation: drafts checked (one per sequence and step), tokens drafted, and of
    /// them accepted.
    pub drafts: u64,
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// Images run through the vision tower (one whose rows the prefix cache held is not).
    pub images_encoded: u64,
}

struct Seq {
    id: RequestId,
    prompt_len: usize,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    /// Leading tokens whose keys and values are in the cache.
    computed: usize,
    /// A block table per KV group.
    blocks: Vec<Vec<u32>>,
    /// Chain hash of each full block registered so far.
    hashes: Vec<u64>,
    cached_tokens: usize,
    max_tokens: usize,
    sampler: Sampler,
    detok: Detokenizer,
    stops: StopMatcher,
    stop_ids: Vec<u32>,
    logprobs: Option<usize>,
    mask: Option<TokenMask>,
    cancelled: bool,
    /// How many tokens this sequence drafts next (0: it does not speculate).
    draft: DraftLen,
    /// With a draft model: leading positions whose draft rows are written, and this step's
    /// draft (taken by the scheduler).
    draft_computed: usize,
    proposal: Vec<u32>,
    /// For a sampled request drafting with a draft model: what samples its drafts, and the
    /// distribution each token of `proposal` was drawn from.
    draft_sampler: Option<Sampler>,
    proposal_q: Vec<Vec<(u32, f32)>>,
    /// Hybrid models: the recurrent-state slot it holds while running ([`NO_SLOT`] else).
    slot: usize,
    /// Its LoRA adapter (0: none), and where its blocks' hash chain starts: 0 for the base
    /// model, the adapter's salt else, so the prefix cache keeps each adapter's keys and
    /// values apart.
    adapter: usize,
    root: u64,
    /// Its images' rows (from the vision tower) and where they sit.
    images: Vec<ImageSpan>,
    /// Its images' grids where the model has M-RoPE (their rows' rotary positions).
    grids: Vec<ImageGrid>,
    /// What the prefix cache hashes instead of `tokens` when there are images: each image's
    /// placeholders carry its content hash (halves in turn), so an image's keys and values
    /// are found again only for the same image.
    keys: Option<Vec<u32>>,
}

/// An image's rows in a sequence: positions `start..start + len`. Its pixels wait until a
/// pass first needs its rows: a later turn whose prefix cache holds the image's keys and
/// values never runs it through the tower again.
struct ImageSpan {
    start: usize,
    len: usize,
    /// Empty until encoded.
    rows: Vec<f32>,
    pixels: Option<ferrum_image::Processed>,
    bidirectional: bool,
    /// DeepStack rows after each row (see [`Embeds::deep`]).
    deep: usize,
}

impl Seq {
    /// The tokens as the prefix cache hashes them.
    fn keys(&self) -> &[u32] {
        self.keys.as_deref().unwrap_or(&self.tokens)
    }

    /// The image rows inside positions `from..to`, relative to `from`.
    fn embeds(&self, from: usize, to: usize, hidden: usize) -> Vec<Embeds<'_>> {
        self.images
            .iter()
            .filter_map(|im| {
                let (a, b) = (im.start.max(from), (im.start + im.len).min(to));
                let w = (1 + im.deep) * hidden;
                (a < b).then(|| Embeds {
                    row: a - from,
                    values: &im.rows[(a - im.start) * w..(b - im.start) * w],
                    bidirectional: im.bidirectional,
                    deep: im.deep,
                })
            })
            .collect()
    }

    /// `n` tokens from `computed` cut or grown so that no image attending both ways is
    /// split between passes: cut before one it would enter, or, starting inside one (its
    /// first rows cached), the rest of it whole; 0 when that does not fit in `budget`.
    fn whole_images(&self, n: usize, budget: usize) -> usize {
        let end = self.computed + n;
        for im in self.images.iter().filter(|im| im.bidirectional) {
            let (a, b) = (im.start, im.start + im.len);
            if self.computed <= a && a < end && end < b {
                return a - self.computed;
            }
            if a < self.computed && self.computed < b && end < b {
                let need = b - self.computed;
                return if need <= budget { need } else { 0 };
            }
        }
        n
    }
}

const NO_SLOT: usize = usize::MAX;

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

pub struct Engine<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    kv: KvCache<B>,
    pool: BlockPool,
    /// Each KV group's window.
    windows: Vec<Option<usize>>,
    config: EngineConfig,
    /// Oldest first: the scheduling priority.
    running: Vec<Seq>,
    waiting: VecDeque<Seq>,
    next_id: RequestId,
    eos: Vec<u32>,
    stats: EngineStats,
    /// Built on the first constrained request (the token trie takes a moment).
    grammar: Option<GrammarCompiler>,
    /// Masked logits of the sequence being sampled.
    scratch: Vec<f32>,
    /// Where a step's logits rows are copied when the backend's buffers are not host
    /// memory; kept across steps (vocabulary-sized rows, faulted in once).
    logits: Vec<f32>,
    drafter: Box<dyn Drafter>,
    /// Drafts come from this model rather than `drafter` when set.
    draft_model: Option<DraftModel<B>>,
    /// Hybrid models: who holds which recurrent-state slot.
    states: Option<StatePool>,
}

impl<B: Backend> Engine<B> {
    pub fn new(model: Model<B>, tokenizer: Tokenizer, config: EngineConfig) -> Result<Engine<B>> {
        if config.block_size == 0 || config.kv_blocks == 0 {
            return Err(Error::InvalidRequest(
                "the KV cache needs at least one block of one position".into(),
            ));
        }
        let pass = model.decoder.pass_capacity();
        if config.max_batch_tokens == 0 || config.max_batch_tokens > pass {
            return Err(Error::InvalidRequest(format!(
                "max_batch_tokens must be 1..={pass}"
            )));
        }
        let (kv, states) = if model.decoder.is_hybrid() {
            let slots = config.max_running + config.state_snapshots;
            (
                model
                    .decoder
                    .alloc_kv_states(config.kv_blocks, config.block_size, slots),
                Some(StatePool::new(config.max_running, config.state_snapshots)),
            )
        } else {
            (
                model.decoder.alloc_kv(config.kv_blocks, config.block_size),
                None,
            )
        };
        let pool = BlockPool::new(config.kv_blocks, config.block_size, config.prefix_caching);
        let windows = model.decoder.kv_groups.groups.iter().map(|g| g.1).collect();
        let eos = tokenizer.eos_ids().to_vec();
        Ok(Engine {
            model,
            tokenizer,
            kv,
            pool,
            windows,
            config,
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 0,
            eos,
            stats: EngineStats::default(),
            grammar: None,
            scratch: Vec::new(),
            logits: Vec::new(),
            drafter: Box::new(NgramDrafter),
            draft_model: None,
            states,
        })
    }

    /// Drafts with a second, smaller model of the same vocabulary from now on (see
    /// [`DraftModel`]); its KV rows go in this engine's blocks. Refused while requests run,
    /// or when the model cannot draft for this one.
    pub fn set_draft_model(&mut self, model: Model<B>, tokenizer: &Tokenizer) -> Result<()> {
        if self.has_work() {
            return Err(Error::InvalidRequest(
                "a draft model can only be set while no request runs".into(),
            ));
        }
        if self.states.is_some() || model.decoder.is_hybrid() {
            // A rejected draft cannot be taken back out of a recurrent state.
            return Err(Error::Unsupported(
                "speculative decoding with a hybrid (linear-attention) model".into(),
            ));
        }
        self.draft_model = Some(DraftModel::new(
            model,
            tokenizer,
            &self.model.decoder,
            &self.tokenizer,
            (
                self.model.info.params,
                self.model.info.decode_bytes_per_token,
            ),
            self.config.kv_blocks,
            self.config.block_size,
        )?);
        Ok(())
    }

    /// The draft model, if drafts come from one.
    pub fn draft_model(&self) -> Option<&Model<B>> {
        self.draft_model.as_ref().map(|d| &d.model)
    }

    /// What drafting a token costs relative to a decode step (see
    /// [`DraftModel::relative_cost`]); `None` without a draft model.
    pub fn draft_cost(&self) -> Option<f32> {
        self.draft_model.as_ref().map(DraftModel::relative_cost)
    }

    /// Overrides the draft model's relative cost, for requests added from now on: for a
    /// draft whose parameter and byte ratios misjudge it, and for tests that must draft with
    /// a draft as large as the model.
    pub fn set_draft_cost(&mut self, cost: f32) {
        if let Some(d) = self.draft_model.as_mut() {
            d.set_relative_cost(cost);
        }
    }

    /// Replaces the prompt-lookup drafter (tests use one that proposes noise: the answers
    /// must not change).
    pub fn set_drafter(&mut self, d: Box<dyn Drafter>) {
        self.drafter = d;
    }

    /// Gives back the model and tokenizer (running requests are dropped).
    pub fn into_parts(self) -> (Model<B>, Tokenizer) {
        (self.model, self.tokenizer)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The longest sequence (prompt and output) one request can reach.
    pub fn max_sequence(&self) -> usize {
        self.model.decoder.context.min(self.kv_tokens())
    }

    /// The longest sequence the KV pool holds on its own.
    pub fn kv_tokens(&self) -> usize {
        let c = &self.config;
        self.model
            .decoder
            .kv_groups
            .tokens_for(c.kv_blocks, c.block_size, c.max_batch_tokens)
    }

    /// Bytes of KV memory the pool holds (with a draft model, its rows too).
    pub fn kv_bytes(&self) -> usize {
        let draft = self.draft_model.as_ref().map_or(0, DraftModel::block_bytes);
        self.config.kv_blocks * (self.model.decoder.kv_block_bytes(self.config.block_size) + draft)
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks: self.pool.n_blocks(),
            kv_blocks_used: self.pool.in_use(),
            block_size: self.config().block_size,
            cached_blocks: self.pool.cached_hashes(),
            prefix: self.pool.stats(),
            states: self
                .states
                .as_ref()
                .map(StatePool::stats)
                .unwrap_or_default(),
            ..self.stats
        }
    }

    /// The LoRA adapters of running and of waiting requests (ids, each once, in order):
    /// what `vllm:lora_requests_info` reports, and whether an adapter can be detached.
    pub fn adapters_in_use(&self) -> (Vec<usize>, Vec<usize>) {
        let ids = |seqs: &mut dyn Iterator<Item = &Seq>| {
            let mut v: Vec<usize> = seqs.map(|s| s.adapter).filter(|&a| a != 0).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        (ids(&mut self.running.iter()), ids(&mut self.waiting.iter()))
    }

    /// Starts recording the prefix cache's [`KvEvent`](crate::block_pool::KvEvent)s (for a
    /// router's cache index).
    pub fn enable_kv_events(&mut self) {
        self.pool.enable_events();
    }

    /// The prefix cache's events since the last call.
    pub fn take_kv_events(&mut self) -> Vec<crate::KvEvent> {
        self.pool.take_events()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Every block back in the pool (nothing running or waiting holds one).
    pub fn kv_all_free(&self) -> bool {
        self.pool.all_released()
    }

    /// Queues a request. Refused (with the reason) when it is malformed or could never fit.
    pub fn add(&mut self, req: Request) -> Result<RequestId> {
        req.extras.validate()?;
        if req.prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        let vocab = self.model.decoder.config.vocab_size;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary ({vocab} tokens)"
            )));
        }
        let max = self.max_sequence();
        if req.prompt.len() >= max {
            return Err(Error::InvalidRequest(format!(
                "the prompt is {} tokens; at most {} fit (context {}, KV cache {} tokens)",
                req.prompt.len(),
                max - 1,
                self.model.decoder.context,
                self.kv_tokens()
            )));
        }
        let root = match req.adapter {
            0 => 0,
            k => match self.model.decoder.adapter(k) {
                Some(a) => a.salt,
                None => {
                    return Err(Error::InvalidRequest(format!(
                        "no LoRA adapter {k} is loaded"
                    )))
                }
            },
        };
        let (images, grids, keys) = self.image_spans(&req.prompt, &req.images)?;
        let mask = match &req.constraint {
            None => None,
            Some(c) => {
                if self.grammar.is_none() {
                    let vocab = self.model.decoder.config.vocab_size;
                    self.grammar = Some(GrammarCompiler::new(&self.tokenizer, vocab)?);
                }
                match &self.grammar {
                    Some(g) => Some(g.compile(c)?),
                    None => None,
                }
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        // A sampled request without a seed drafts by sampling the draft model (checked by the
        // rejection rule: more drafts kept); a seeded one drafts greedily, checked by sample and
        // compare, so that its answer is plain decoding's, whatever else the engine runs (how
        // far a sequence drafts depends on the batch, and with sampled drafts so would the
        // random draws).
        let draft_sampler =
            (req.params.temperature > 0.0 && req.params.seed.is_none()).then(|| {
                Sampler::with_extras(
                    req.params.clone(),
                    SamplingExtras::default().with_min_p(req.extras.min_p),
                )
            });
        let mut sampler = Sampler::with_extras(req.params, req.extras);
        sampler.observe_prompt(&req.prompt);
        let mut stop_ids = req.stop_token_ids;
        if !req.ignore_eos {
            stop_ids.extend_from_slice(&self.eos);
        }
        self.stats.prompt_tokens += req.prompt.len() as u64;
        self.waiting.push_back(Seq {
            id,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            computed: 0,
            blocks: vec![Vec::new(); self.windows.len()],
            hashes: Vec::new(),
            cached_tokens: 0,
            max_tokens: req.max_tokens,
            sampler,
            detok: Detokenizer::new(req.skip_special),
            stops: StopMatcher::new(req.stop),
            stop_ids,
            logprobs: req.logprobs,
            mask,
            cancelled: false,
            draft: DraftLen::new(
                req.speculate.tokens(self.config.spec_tokens),
                self.draft_model.as_ref().map_or(0.0, |d| d.relative_cost()),
            ),
            draft_computed: 0,
            proposal: Vec::new(),
            draft_sampler,
            proposal_q: Vec::new(),
            slot: NO_SLOT,
            adapter: req.adapter,
            root,
            images,
            grids,
            keys,
        });
        Ok(id)
    }

    /// A request's images placed at their placeholders (each checked to fill its span; the
    /// tower runs when a pass first needs it: [`Self::encode_images`]), their grids for
    /// M-RoPE (none for other models), and the tokens the prefix cache hashes for them.
    #[allow(clippy::type_complexity)]
    fn image_spans(
        &self,
        prompt: &[u32],
        images: &[ferrum_image::Processed],
    ) -> Result<(Vec<ImageSpan>, Vec<ImageGrid>, Option<Vec<u32>>)> {
        if images.is_empty() {
            return Ok((Vec::new(), Vec::new(), None));
        }
        let Some(v) = &self.model.vision else {
            return Err(Error::InvalidRequest(
                "this model does not take images: it has no vision encoder".into(),
            ));
        };
        let spans = v.place(prompt, images.len())?;
        let step = self.config.max_batch_tokens;
        if let Some(&(_, len)) = spans.iter().find(|s| v.tokens.bidirectional && s.1 > step) {
            // It could never be scheduled: its rows go in one step.
            return Err(Error::InvalidRequest(format!(
                "an image of {len} tokens does not fit in a step of {step} tokens (max_batch_tokens)"
            )));
        }
        let mut keys = prompt.to_vec();
        let mut out = Vec::with_capacity(images.len());
        let mut grids = Vec::new();
        for (&(start, len), img) in spans.iter().zip(images) {
            if let Some((h, w)) = v.grid(img) {
                grids.push(ImageGrid { start, h, w });
            }
            if v.rows(img) != len {
                return Err(Error::InvalidRequest(format!(
                    "an image of {} rows for {len} placeholders",
                    v.rows(img)
                )));
            }
            let hash = content_hash(img);
            for (i, k) in keys[start..start + len].iter_mut().enumerate() {
                *k = if i % 2 == 0 {
                    hash as u32
                } else {
                    (hash >> 32) as u32
                };
            }
            out.push(ImageSpan {
                start,
                len,
                rows: Vec::new(),
                pixels: Some(img.clone()),
                bidirectional: v.tokens.bidirectional,
                deep: v.deep_layers(),
            });
        }
        Ok((out, grids, Some(keys)))
    }

    /// Runs through the vision tower each image a planned pass reaches whose rows are not
    /// there yet (the prefix cache held none of it, or not all).
    fn encode_images(&mut self, plan: &[Work]) -> Result<()> {
        let Some(v) = &self.model.vision else {
            return Ok(());
        };
        let h = self.model.decoder.config.hidden_size;
        for w in plan {
            let s = &mut self.running[w.seq];
            let (from, to) = (s.computed, s.computed + w.n - w.draft.len());
            for im in &mut s.images {
                if !im.rows.is_empty() || im.start >= to || im.start + im.len <= from {
                    continue;
                }
                let Some(px) = im.pixels.take() else {
                    continue;
                };
                let rows = v.encode(self.model.decoder.backend(), &px)?;
                let width = (1 + im.deep) * h;
                ferrum_models::vision::Vision::<B>::check_rows(&rows, im.len, width)?;
                im.rows = rows;
                self.stats.images_encoded += 1;
            }
        }
        Ok(())
    }

    /// [`Engine::embed`] of several inputs: a decoder embedder's run together, their chunks
    /// packed into shared passes (each input's vector what it gets alone); a chat model's
    /// (`--embeddings-from-chat-model`) one at a time.
    pub fn embed_batch(&mut self, inputs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        if self.model.pooling.is_none() {
            return inputs.iter().map(|t| self.embed(t)).collect();
        }
        for t in inputs {
            self.check_embed_input(t)?;
        }
        self.model
            .pooled_batch(inputs)?
            .ok_or_else(|| Error::InvalidRequest("this model has no pooling".into()))
    }

    /// A sentence embedding of `tokens`: a decoder embedder's pooling of the model's
    /// final-normalised hidden states (`Model::pooling`), else their mean scaled to unit
    /// length. Runs outside the batch, in a cache of its own.
    pub fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_embed_input(tokens)?;
        if let Some(v) = self.model.pooled(tokens)? {
            return Ok(v);
        }
        let mut kv = self.model.decoder.alloc_kv_tokens(tokens.len());
        let mut v = self.model.decoder.pooled_hidden(&mut kv, tokens)?;
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        if norm > 0.0 {
            v.iter_mut().for_each(|x| *x /= norm);
        }
        Ok(v)
    }

    /// An input to embed must have a token and fit the context.
    fn check_embed_input(&self, tokens: &[u32]) -> Result<()> {
        let context = self.model.decoder.context;
        if tokens.is_empty() {
            return Err(Error::InvalidRequest("the input is empty".into()));
        }
        if tokens.len() > context {
            return Err(Error::InvalidRequest(format!(
                "the input is {} tokens; the context holds {context}",
                tokens.len()
            )));
        }
        Ok(())
    }

    /// Marks a request cancelled; its blocks are freed at the start of the next step, which
    /// reports it finished with [`FinishReason::Cancelled`]. Unknown ids are ignored.
    pub fn cancel(&mut self, id: RequestId) {
        for s in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            if s.id == id {
                s.cancelled = true;
            }
        }
    }

    /// One scheduling step and forward pass. Returns the events of this step.
    pub fn step(&mut self) -> Result<Vec<Output>> {
        let mut out = Vec::new();
        self.reap_cancelled(&mut out);
        if self.draft_model.is_some() {
            self.draft_round()?;
        }
        let plan = self.schedule();
        if plan.is_empty() {
            return Ok(out);
        }
        self.encode_images(&plan)?;
        self.stats.steps += 1;
        let max_seq = self.max_sequence();
        let vocab = self.model.decoder.config.vocab_size;
        // Logits come back in batch order for the sequences that asked: read where the
        // backend left them (no copy on the CPU), so they borrow the model until sampled.
        // A drafting sequence's input is its last token and the draft, with logits for each.
        let inputs: Vec<Vec<u32>> = plan
            .iter()
            .map(|w| {
                let s = &self.running[w.seq];
                let own = w.n - w.draft.len();
                let mut v = s.tokens[s.computed..s.computed + own].to_vec();
                v.extend_from_slice(&w.draft);
                v
            })
            .collect();
        let hidden = self.model.decoder.config.hidden_size;
        let embeds: Vec<Vec<Embeds>> = plan
            .iter()
            .map(|w| {
                let s = &self.running[w.seq];
                let own = w.n - w.draft.len();
                s.embeds(s.computed, s.computed + own, hidden)
            })
            .collect();
        let logits = {
            let seqs: Vec<SeqChunk> = plan
                .iter()
                .zip(&inputs)
                .zip(&embeds)
                .map(|((w, input), embeds)| {
                    let s = &self.running[w.seq];
                    SeqChunk {
                        tokens: input,
                        start: s.computed,
                        tables: &s.blocks,
                        logits: if !w.draft.is_empty() {
                            Logits::All
                        } else if s.computed + w.n == s.tokens.len() {
                            Logits::Last
                        } else {
                            Logits::None
                        },
                        state: s.slot,
                        adapter: s.adapter,
                        embeds,
                        grids: &s.grids,
                    }
                })
                .collect();
            self.model
                .decoder
                .forward_batch_view(&mut self.kv, &seqs, &mut self.logits)?
        };
        let mut rows = logits.chunks_exact(vocab);
        let mut finished = Vec::new();
        // Recurrent-state snapshots to take once the logits are read: (from, to) slots.
        let mut snapshots = Vec::new();
        for w in &plan {
            let (i, n) = (w.seq, w.n);
            let s = &mut self.running[i];
            if !w.draft.is_empty() {
                let mut ctx = EmitCtx {
                    scratch: &mut self.scratch,
                    tokenizer: &self.tokenizer,
                    stats: &mut self.stats,
                    max_seq,
                };
                let seq_rows: Option<Vec<&[f32]>> = (0..n).map(|_| rows.next()).collect();
                let Some(seq_rows) = seq_rows else {
                    return Err(Error::InvalidRequest(
                        "forward returned too few logits".into(),
                    ));
                };
                // Sample position after position as plain decoding would; a drafted token is
                // kept only while it is the one sampled before it.
                let mut accepted = 0;
                let mut reason = None;
                let q = std::mem::take(&mut s.proposal_q);
                for (j, row) in seq_rows.iter().enumerate() {
                    let against = match (w.draft.get(j), q.get(j)) {
                        (Some(&d), Some(q)) => Some((d, &q[..])),
                        _ => None,
                    };
                    reason = emit_token(s, row, against, &mut ctx, &mut out)?;
                    if reason.is_some() {
                        break;
                    }
                    if j < w.draft.len() && s.tokens.last() == Some(&w.draft[j]) {
                        accepted += 1;
                    } else {
                        break;
                    }
                }
                // The last token and the accepted drafts have their keys and values; the
                // rejected drafts' rows lie past `computed` and are written over later. The
                // draft model holds rows for the last token and all its drafts but the last.
                if s.draft_computed == s.computed + 1 {
                    s.draft_computed += accepted.min(w.draft.len() - 1);
                }
                s.computed += accepted + 1;
                ctx.stats.drafts += 1;
                ctx.stats.drafted_tokens += w.draft.len() as u64;
                ctx.stats.accepted_tokens += accepted as u64;
                s.draft.update(w.draft.len(), accepted);
                register_full_blocks(&mut self.pool, s);
                trim_windows(&mut self.pool, s, &self.windows);
                if let Some(r) = reason {
                    finished.push((i, r));
                }
                continue;
            }
            s.computed += n;
            register_full_blocks(&mut self.pool, s);
            trim_windows(&mut self.pool, s, &self.windows);
            if let Some(st) = self.states.as_mut() {
                let bs = self.pool.block_size();
                if is_snapshot_point(s, bs) {
                    let hash = s.hashes[s.computed / bs - 1];
                    let pool = &self.pool;
                    if let Some(to) = st.store(hash, |h| pool.holds(h)) {
                        snapshots.push((s.slot, to));
                    }
                }
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let Some(row) = rows.next() else {
                return Err(Error::InvalidRequest(
                    "forward returned too few logits".into(),
                ));
            };
            let mut ctx = EmitCtx {
                scratch: &mut self.scratch,
                tokenizer: &self.tokenizer,
                stats: &mut self.stats,
                max_seq,
            };
            if let Some(reason) = emit_token(s, row, None, &mut ctx, &mut out)? {
                finished.push((i, reason));
            }
        }
        for (from, to) in snapshots {
            self.kv.copy_state(self.model.decoder.backend(), from, to);
        }
        // Remove from the back so the indices stay valid.
        finished.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, reason) in finished {
            let s = self.running.remove(i);
            self.finish(s, reason, &mut out);
        }
        Ok(out)
    }

    fn finish(&mut self, mut s: Seq, reason: FinishReason, out: &mut Vec<Output>) {
        release_all(&mut self.pool, &mut s.blocks);
        self.give_slot(&mut s);
        // Whatever is held back is released, unless a stop string already ended the text.
        let mut text = String::new();
        if s.stops.matched().is_none() {
            let rest = s.detok.flush(&self.tokenizer).unwrap_or_default();
            let o = s.stops.push(&rest);
            text = o.emit;
            if !o.stopped {
                text.push_str(&s.stops.flush());
            }
        }
        let stop_string = s.stops.matched().map(str::to_string);
        out.push(Output {
            id: s.id,
            kind: OutputKind::Finished {
                reason,
                text,
                stop_string,
                usage: Usage {
                    prompt_tokens: s.prompt_len,
                    completion_tokens: s.generated(),
                    cached_tokens: s.cached_tokens,
                },
            },
        });
    }

    fn reap_cancelled(&mut self, out: &mut Vec<Output>) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled {
                let s = self.running.remove(i);
                self.finish(s, FinishReason::Cancelled, out);
            } else {
                i += 1;
            }
        }
        let mut keep = VecDeque::with_capacity(self.waiting.len());
        while let Some(s) = self.waiting.pop_front() {
            if s.cancelled {
                self.finish(s, FinishReason::Cancelled, out);
            } else {
                keep.push_back(s);
            }
        }
        self.waiting = keep;
    }

    /// Chooses this step's work. Running sequences go first, oldest first (each decode step —
    /// with a draft when speculating — or the next prefill chunk); then waiting ones are
    /// admitted while the budget and the pool allow.
    fn schedule(&mut self) -> Vec<Work> {
        let mut budget = self.config.max_batch_tokens;
        let mut plan = Vec::new();
        let mut preempted = false;
        let max_seq = self.max_sequence();
        let mut i = 0;
        let hybrid = self.states.is_some();
        let bs = self.config.block_size;
        while i < self.running.len() && budget > 0 {
            let s = &mut self.running[i];
            let mut n = chunk_len(s, budget, bs, hybrid);
            if n == 0 && s.computed < s.tokens.len() {
                // An image that does not fit in what is left of this step waits for the next
                // (a sequence with nothing pending goes on: its step may be all draft).
                i += 1;
                continue;
            }
            // A decoding sequence may draft: within the budget, its max_tokens and the context.
            // Not a hybrid model's: a rejected draft would stay in its recurrent state.
            let mut draft = std::mem::take(&mut s.proposal);
            if n == 1 && s.computed + 1 == s.tokens.len() && !hybrid {
                let room = (budget - 1).min(draft_room(s, max_seq));
                if self.draft_model.is_none() {
                    let k = s.draft.this_step().min(room);
                    if k > 0 {
                        draft = self.drafter.propose(&s.tokens, k);
                    }
                }
                draft.truncate(room);
                n += draft.len();
            } else {
                draft.clear();
            }
            loop {
                let upto = self.running[i].computed + n;
                if grow(&mut self.pool, &mut self.running[i], upto) {
                    plan.push(Work { seq: i, n, draft });
                    budget -= n;
                    i += 1;
                    break;
                }
                // A draft is the first thing to give up when blocks run short.
                if !draft.is_empty() {
                    n -= draft.len();
                    draft.clear();
                    continue;
                }
                // Out of blocks: give up the newest running sequence (this one if it is the
                // newest; older ones always make progress).
                preempted = true;
                let victim = self.running.len() - 1;
                let s = self.running.remove(victim);
                self.preempt(s);
                if victim == i {
                    break;
                }
            }
        }
        // Admitting while preempting would only thrash.
        while !preempted && budget > 0 && self.running.len() < self.config.max_running {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if let Some(st) = self.states.as_mut() {
                match st.take_live() {
                    Some(slot) => s.slot = slot,
                    None => {
                        self.waiting.push_front(s);
                        break;
                    }
                }
            }
            if s.blocks.iter().all(Vec::is_empty) {
                // At least the last token is computed: its logits start the generation.
                let mut max_blocks = (s.tokens.len() - 1) / bs;
                if let Some(st) = &self.states {
                    // A hybrid model resumes only where a state snapshot is kept.
                    max_blocks = snapshot_prefix(st, s.root, s.keys(), bs, max_blocks);
                }
                let (mut blocks, mut hashes) =
                    self.pool
                        .lookup_groups(s.root, s.keys(), max_blocks, &self.windows);
                if let Some(st) = self.states.as_mut() {
                    // The cache may hold less than the snapshot covers: the longest prefix
                    // with both its blocks and a snapshot.
                    let keep = (1..=hashes.len())
                        .rev()
                        .find(|&k| st.has(hashes[k - 1]))
                        .unwrap_or(0);
                    release_from(&mut self.pool, &mut blocks, keep);
                    self.pool.unhit(hashes.len() - keep);
                    hashes.truncate(keep);
                    if let Some(from) = keep.checked_sub(1).and_then(|k| st.find(hashes[k])) {
                        self.kv
                            .copy_state(self.model.decoder.backend(), from, s.slot);
                        st.record_hit(keep * bs);
                    }
                }
                s.computed = hashes.len() * bs;
                if s.generated() == 0 {
                    s.cached_tokens = s.computed;
                }
                s.blocks = blocks;
                s.hashes = hashes;
            }
            let n = chunk_len(&s, budget, bs, hybrid);
            let upto = s.computed + n;
            if (n == 0 && s.computed < s.tokens.len()) || !grow(&mut self.pool, &mut s, upto) {
                // Not enough room: hand back what it took and wait for running ones to end.
                release_all(&mut self.pool, &mut s.blocks);
                self.give_slot(&mut s);
                s.hashes.clear();
                s.computed = 0;
                self.waiting.push_front(s);
                break;
            }
            self.running.push(s);
            plan.push(Work {
                seq: self.running.len() - 1,
                n,
                draft: Vec::new(),
            });
            budget -= n;
        }
        plan
    }

    /// With a draft model: drafts for every decoding sequence that speculates this step, in
    /// batched passes of the draft model, left in each one's `proposal`. The draft lengths are
    /// the ones [`Engine::schedule`] will let through (the step's token budget taken in the
    /// same order), and a draft's blocks come only from what is left once every running
    /// sequence has room for its own next token, so a draft never costs another sequence its
    /// place. A sequence holding a token the draft model cannot read (past its vocabulary:
    /// a bias may favour such ids) does not draft; nor does anyone in a step where the draft
    /// model fails (the step goes on without drafts).
    fn draft_round(&mut self) -> Result<()> {
        let Some(width) = self.draft_model.as_ref().map(DraftModel::width) else {
            return Ok(());
        };
        let max_seq = self.max_sequence();
        let bs = self.pool.block_size();
        // Blocks every running sequence needs for what it computes next, drafts aside.
        let reserved: usize = self
            .running
            .iter()
            .map(|s| {
                let want = (s.tokens.len() + 1).div_ceil(bs);
                s.blocks
                    .iter()
                    .map(|t| want.saturating_sub(t.len()))
                    .sum::<usize>()
            })
            .sum();
        let mut spare = self.pool.available().saturating_sub(reserved);
        let mut budget = self.config.max_batch_tokens;
        for s in &mut self.running {
            s.proposal.clear();
            s.proposal_q.clear();
        }
        let mut ks = Vec::new();
        for (i, s) in self.running.iter_mut().enumerate() {
            let pending = s.tokens.len() - s.computed;
            if budget == 0 {
                break;
            }
            if pending != 1 {
                budget -= pending.min(budget);
                continue;
            }
            budget -= 1;
            let mut k = s.draft.this_step().min(draft_room(s, max_seq)).min(budget);
            let readable = s.tokens[s.draft_computed.min(s.tokens.len())..]
                .iter()
                .all(|&t| (t as usize) < width);
            if !readable {
                k = 0;
            }
            if k == 0 {
                continue;
            }
            let want = (s.tokens.len() + k).div_ceil(bs);
            let more: usize = s.blocks.iter().map(|t| want.saturating_sub(t.len())).sum();
            let own = {
                let next = (s.tokens.len() + 1).div_ceil(bs);
                s.blocks
                    .iter()
                    .map(|t| next.saturating_sub(t.len()))
                    .sum::<usize>()
            };
            if more - own > spare || !grow(&mut self.pool, s, s.tokens.len() + k) {
                continue;
            }
            spare -= more - own;
            budget -= k;
            ks.push((i, k));
        }
        let Some(dm) = self.draft_model.as_mut() else {
            return Ok(());
        };
        if ks.is_empty() {
            return Ok(());
        }
        let mut seqs: Vec<DraftSeq> = Vec::with_capacity(ks.len());
        let mut picked = ks.iter().peekable();
        for (i, s) in self.running.iter_mut().enumerate() {
            if picked.peek().is_some_and(|&&(j, _)| j == i) {
                let k = picked.next().map_or(0, |&(_, k)| k);
                seqs.push(DraftSeq {
                    tokens: &s.tokens,
                    tables: &s.blocks,
                    computed: &mut s.draft_computed,
                    k,
                    sampler: s.draft_sampler.as_mut(),
                });
            }
        }
        let drafts = match dm.draft(&mut seqs, &self.pool) {
            Ok(d) => d,
            Err(e) => {
                // Rows it wrote are for the sequences' own tokens; any it did not are
                // rewritten by the next round's catch-up.
                eprintln!("ferrum: the draft model failed, drafting nothing this step: {e}");
                return Ok(());
            }
        };
        drop(seqs);
        for (&(i, _), d) in ks.iter().zip(drafts) {
            self.running[i].proposal = d.tokens;
            self.running[i].proposal_q = d.q;
        }
        Ok(())
    }

    /// A hybrid sequence's recurrent-state slot back to the pool.
    fn give_slot(&mut self, s: &mut Seq) {
        if let (Some(st), true) = (self.states.as_mut(), s.slot != NO_SLOT) {
            st.give_live(s.slot);
        }
        s.slot = NO_SLOT;
    }

    fn preempt(&mut self, mut s: Seq) {
        release_all(&mut self.pool, &mut s.blocks);
        self.give_slot(&mut s);
        s.hashes.clear();
        s.computed = 0;
        s.draft_computed = 0;
        s.proposal.clear();
        s.proposal_q.clear();
        self.stats.preemptions += 1;
        self.waiting.push_front(s);
    }
}

/// Whether a hybrid sequence that has just computed `s.computed` tokens keeps a state
/// snapshot there: a block boundary inside its prompt (the last one, or every
/// [`SNAPSHOT_EVERY_BLOCKS`]-th).
fn is_snapshot_point(s: &Seq, bs: usize) -> bool {
    let (c, last) = (s.computed, last_prompt_boundary(s, bs));
    c > 0
        && c <= last
        && c.is_multiple_of(bs)
        && (c == last || (c / bs).is_multiple_of(SNAPSHOT_EVERY_BLOCKS))
}

/// The last block boundary a later request sharing `s`'s prompt can resume from (its last
/// token is always computed again: its logits start the generation).
fn last_prompt_boundary(s: &Seq, bs: usize) -> usize {
    (s.prompt_len - 1) / bs * bs
}

/// How many of `s`'s tokens its next chunk takes within `budget`: for a hybrid model, never
/// past the next snapshot point, so the state there can be copied.
fn chunk_len(s: &Seq, budget: usize, bs: usize, hybrid: bool) -> usize {
    let n = (s.tokens.len() - s.computed).min(budget);
    let last = last_prompt_boundary(s, bs);
    if !hybrid || s.computed >= last {
        return s.whole_images(n, budget);
    }
    let every = SNAPSHOT_EVERY_BLOCKS * bs;
    let next = ((s.computed / every + 1) * every).min(last);
    s.whole_images(n.min(next - s.computed), budget)
}

/// Blocks of `tokens`' prefix (at most `max_blocks`) up to the last one after which a
/// snapshot is kept.
fn snapshot_prefix(
    st: &StatePool,
    root: u64,
    tokens: &[u32],
    bs: usize,
    max_blocks: usize,
) -> usize {
    let mut parent = root;
    let mut best = 0;
    for (k, chunk) in tokens.chunks_exact(bs).take(max_blocks).enumerate() {
        parent = crate::block_pool::chain_hash(parent, chunk);
        if st.has(parent) {
            best = k + 1;
        }
    }
    best
}

/// How many tokens `s` may draft beyond its next one: drafts and the token after them
/// within its max_tokens and the context.
fn draft_room(s: &Seq, max_seq: usize) -> usize {
    s.max_tokens
        .saturating_sub(s.generated() + 1)
        .min(max_seq.saturating_sub(s.tokens.len() + 1))
}

/// Gives `s` blocks for positions `0..upto` in every KV group; false (taking nothing) when
/// the pool lacks them.
fn grow(pool: &mut BlockPool, s: &mut Seq, upto: usize) -> bool {
    let want = upto.div_ceil(pool.block_size());
    let need: usize = s.blocks.iter().map(|t| want.saturating_sub(t.len())).sum();
    if need > pool.available() {
        return false;
    }
    for t in &mut s.blocks {
        while t.len() < want {
            match pool.allocate() {
                Some(b) => t.push(b),
                None => return false,
            }
        }
    }
    true
}

/// A processed image's content hash (its shape and values' bits).
fn content_hash(p: &ferrum_image::Processed) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    p.shape.hash(&mut h);
    for v in &p.values {
        v.to_bits().hash(&mut h);
    }
    h.finish()
}

/// Makes `s`'s newly completed blocks findable by later requests, in every group that still
/// holds them.
fn register_full_blocks(pool: &mut BlockPool, s: &mut Seq) {
    let bs = pool.block_size();
    while s.hashes.len() < s.computed / bs {
        let k = s.hashes.len();
        let parent = if k == 0 { s.root } else { s.hashes[k - 1] };
        let tokens = &s.keys()[k * bs..(k + 1) * bs];
        let mut hash = crate::block_pool::chain_hash(parent, tokens);
        for (g, t) in s.blocks.iter().enumerate() {
            if t[k] != NO_BLOCK {
                hash = pool.register_in(g, t[k], parent, s.root, tokens);
            }
        }
        s.hashes.push(hash);
    }
}

/// Gives back the blocks each windowed group of `s` no longer sees (they stay findable in
/// the prefix cache until reclaimed).
fn trim_windows(pool: &mut BlockPool, s: &mut Seq, windows: &[Option<usize>]) {
    for (t, w) in s.blocks.iter_mut().zip(windows) {
        let first = KvGroups::first_needed(*w, s.computed, pool.block_size());
        for b in t.iter_mut().take(first) {
            if *b != NO_BLOCK {
                pool.release(*b);
                *b = NO_BLOCK;
            }
        }
    }
}

/// Gives back every block of every table.
fn release_all(pool: &mut BlockPool, tables: &mut [Vec<u32>]) {
    release_from(pool, tables, 0)
}

/// Gives back every table's blocks from entry `keep` on (the tables are cut to `keep`).
fn release_from(pool: &mut BlockPool, tables: &mut [Vec<u32>], keep: usize) {
    for t in tables {
        for &b in t.iter().skip(keep) {
            if b != NO_BLOCK {
                pool.release(b);
            }
        }
        t.truncate(keep);
    }
}

/// What sampling a token needs of the engine besides the sequence: disjoint from the model,
/// whose buffer the logits may still be.
struct EmitCtx<'a> {
    /// Masked logits of the sequence being sampled.
    scratch: &'a mut Vec<f32>,
    tokenizer: &'a Tokenizer,
    stats: &'a mut EngineStats,
    max_seq: usize,
}

/// Samples the next token of `s` and reports it; returns why the sequence ends, if it does.
/// `against` is a sampled draft token and the distribution it was drawn from, to be kept or
/// replaced by the rejection rule.
fn emit_token(
    s: &mut Seq,
    logits: &[f32],
    against: Option<(u32, &[(u32, f32)])>,
    cx: &mut EmitCtx,
    out: &mut Vec<Output>,
) -> Result<Option<FinishReason>> {
    let max_seq = cx.max_seq;
    // A constraint masks what may be sampled; log-probabilities stay the model's own.
    let sample_from = match &mut s.mask {
        Some(m) => {
            cx.scratch.clear();
            cx.scratch.extend_from_slice(logits);
            // A constraint that fails (or allows nothing) ends this request only.
            if m.apply(cx.scratch).is_err() || cx.scratch.iter().all(|l| *l == f32::NEG_INFINITY) {
                return Ok(Some(FinishReason::Stop));
            }
            &cx.scratch[..]
        }
        None => logits,
    };
    let token = match against {
        Some((d, q)) => s.sampler.sample_against_draft(sample_from, d, q),
        None => s.sampler.sample(sample_from),
    };
    let logprob = s.logprobs.map(|n| {
        let (lp, top) = crate::sampler::logprobs(logits, token, n);
        TokenLogprob { logprob: lp, top }
    });
    if s.stop_ids.contains(&token) {
        return Ok(Some(FinishReason::Stop));
    }
    if let Some(m) = &mut s.mask {
        if m.commit(token).is_err() {
            return Ok(Some(FinishReason::Stop));
        }
    }
    s.tokens.push(token);
    if let Some(k) = &mut s.keys {
        k.push(token);
    }
    s.sampler.observe(token);
    cx.stats.generated_tokens += 1;
    let text = s.detok.push(cx.tokenizer, token)?;
    let outcome = s.stops.push(&text);
    out.push(Output {
        id: s.id,
        kind: OutputKind::Token {
            token,
            text: outcome.emit,
            logprob,
        },
    });
    let complete = s.mask.as_ref().is_some_and(|m| m.is_stopped());
    Ok(if outcome.stopped || complete {
        Some(FinishReason::Stop)
    } else if s.generated() >= s.max_tokens || s.tokens.len() >= max_seq {
        Some(FinishReason::Length)
    } else {
        None
    })
}
