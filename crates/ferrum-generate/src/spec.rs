//! Speculative decoding's drafters: what a sequence proposes to check in its next step.
//!
//! The engine verifies a draft by running the sequence's last token and the drafted ones in
//! one pass (logits for each, bit-identical to what decoding them one by one would give: see
//! the batch-invariance decision in ARCHITECTURE.md), then sampling position after position
//! exactly as plain decoding would — same logits, same sampler, same random draws in the same
//! order — and keeping drafted tokens only while each equals the token sampled before it. The
//! answer is therefore the one plain decoding gives, token for token, at any temperature and
//! seed: a drafter can only change how fast it comes. (For a drafter that proposes one token
//! per position this "sample and compare" rule is the standard rejection rule: it accepts `d`
//! with probability p(d) and otherwise yields a sample of p without `d`, renormalised.)

use ferrum_backend::Backend;
use ferrum_core::{Error, Result};
use ferrum_models::decoder::CHUNK;
use ferrum_models::{Decoder, KvCache, Logits, Model, SeqChunk};
use ferrum_tokenizer::Tokenizer;

use crate::block_pool::BlockPool;
use crate::sampler::{argmax, Sampler};

/// Proposes up to `max` tokens to follow `tokens` (the prompt and the output so far).
pub trait Drafter: Send {
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32>;
}

/// Prompt lookup: the tokens that followed the most recent earlier occurrence of the last
/// n tokens (n from [`NgramDrafter::MAX_N`] down to [`NgramDrafter::MIN_N`]), in the prompt or
/// the output. No second model; it pays where an answer copies (code edits, quotes, JSON that
/// repeats keys) and proposes nothing where it does not.
#[derive(Debug, Clone, Default)]
pub struct NgramDrafter;

impl NgramDrafter {
    pub const MAX_N: usize = 4;
    pub const MIN_N: usize = 2;
    /// How far back a match is looked for (positions), to bound the cost per step.
    pub const WINDOW: usize = 8192;
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, tokens: &[u32], max: usize) -> Vec<u32> {
        if max == 0 {
            return Vec::new();
        }
        let lo = tokens.len().saturating_sub(Self::WINDOW);
        for n in (Self::MIN_N..=Self::MAX_N).rev() {
            if tokens.len() <= n {
                continue;
            }
            let pat = &tokens[tokens.len() - n..];
            // The most recent earlier occurrence that has something after it.
            for start in (lo..tokens.len() - n).rev() {
                if &tokens[start..start + n] == pat {
                    let from = start + n;
                    let end = (from + max).min(tokens.len());
                    return tokens[from..end].to_vec();
                }
            }
        }
        Vec::new()
    }
}

/// A second, smaller model of the same vocabulary that drafts (`--draft MODEL`): greedily
/// (checked by sample and compare: the answer is plain decoding's), or for a sampled request
/// without a seed by sampling its own distribution q with the request's settings, the target
/// then keeping or replacing each drafted token by the rejection rule
/// ([`crate::Sampler::sample_against_draft`]: the answer follows the target's distribution). Its keys and values live in the target's KV blocks: the same block ids,
/// through the target sequence's table of a KV group without a window (which holds every
/// position), in buffers of its own. A block of the pool thus holds both models' rows for its
/// positions and the pool's accounting covers both; [`DraftModel::block_bytes`] is what a
/// block costs on top.
///
/// The draft's rows of a full block are valid for whoever shares the block once some sequence
/// has run the draft over all of it (recorded per block id and allocation, so a reused block
/// is never taken for valid); otherwise a sequence runs the draft over its prompt itself
/// before its first draft. Both models are batch-invariant, so rows written twice for the
/// same tokens are the same bits.
pub struct DraftModel<B: Backend> {
    pub model: Model<B>,
    kv: KvCache<B>,
    /// The target's KV group whose tables the draft shares.
    group: usize,
    /// The target's vocabulary: the draft never proposes an id past it.
    vocab: usize,
    /// Per block id: 1 + the allocation count at which the draft's rows of the whole block
    /// were written (0: never).
    valid: Vec<u64>,
    logits: Vec<f32>,
    /// See [`DraftModel::relative_cost`].
    cost: f32,
}

/// One sequence's part of a drafting round.
pub struct DraftSeq<'a> {
    /// The prompt and the output so far.
    pub tokens: &'a [u32],
    /// The target's block tables (one per KV group), grown to hold the drafted positions.
    pub tables: &'a [Vec<u32>],
    /// Leading positions whose draft rows are written; the round brings it to `tokens.len()`.
    pub computed: &'a mut usize,
    /// How many tokens to draft (at least 1).
    pub k: usize,
    /// Samples the drafts of a sampled request; `None` drafts greedily.
    pub sampler: Option<&'a mut Sampler>,
}

/// One sequence's draft: the tokens, and for sampled drafts the distribution each was drawn
/// from (sorted by token id; empty for greedy drafts).
#[derive(Debug, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub q: Vec<Vec<(u32, f32)>>,
}

impl Draft {
    fn push(&mut self, row: &[f32], sampler: Option<&mut Sampler>) {
        match sampler.and_then(|s| s.draft(row)) {
            Some((t, q)) => {
                self.tokens.push(t);
                self.q.push(q);
            }
            None => self.tokens.push(argmax(row)),
        }
    }
}

impl<B: Backend> DraftModel<B> {
    /// Checks that `model` can draft for the target model (same vocabulary, layers without
    /// windows, a target group holding every position) and sizes its cache for the target's
    /// pool; `target` is the target's parameters and weight bytes read per token.
    pub fn new(
        model: Model<B>,
        draft_tok: &Tokenizer,
        target_decoder: &Decoder<B>,
        target_tok: &Tokenizer,
        target: (usize, usize),
        kv_blocks: usize,
        block_size: usize,
    ) -> Result<DraftModel<B>> {
        same_vocabulary(draft_tok, target_tok)?;
        let d = &model.decoder;
        if d.context < target_decoder.context {
            return Err(Error::InvalidRequest(format!(
                "the draft model was loaded for {} positions, the model for {}: load it for as many",
                d.context, target_decoder.context
            )));
        }
        if d.kv_groups.windowed() || d.kv_groups.len() != 1 {
            return Err(Error::InvalidRequest(
                "a draft model with sliding-window layers is not supported: pick one whose \
                 layers all attend to the whole sequence"
                    .into(),
            ));
        }
        let group = target_decoder
            .kv_groups
            .groups
            .iter()
            .position(|(_, w)| w.is_none())
            .ok_or_else(|| {
                Error::InvalidRequest(
                    "drafting needs a target model with some layers that see the whole sequence"
                        .into(),
                )
            })?;
        let kv = d.alloc_kv(kv_blocks, block_size);
        let bytes = model.info.decode_bytes_per_token as f32 / target.1.max(1) as f32;
        let params = model.info.params as f32 / target.0.max(1) as f32;
        let cost = bytes.max(params);
        Ok(DraftModel {
            cost,
            vocab: target_decoder.config.vocab_size.min(d.config.vocab_size),
            kv,
            group,
            valid: vec![0; kv_blocks],
            logits: Vec::new(),
            model,
        })
    }

    /// The target's KV group whose tables the draft uses.
    pub fn group(&self) -> usize {
        self.group
    }

    /// Token ids the draft model reads (its embedding rows).
    pub fn width(&self) -> usize {
        self.model.decoder.config.vocab_size
    }

    /// What drafting a token costs relative to a decode step of the model, taken as the
    /// larger of the ratios of their parameters and of the weight bytes each reads per token
    /// (a re-quantised copy of the model reads fewer bytes but does the same arithmetic,
    /// and on a model that fits in cache the arithmetic is the cost).
    pub fn relative_cost(&self) -> f32 {
        self.cost
    }

    pub fn set_relative_cost(&mut self, cost: f32) {
        self.cost = cost.max(0.0);
    }

    /// Bytes the draft's rows add to each block of the pool.
    pub fn block_bytes(&self) -> usize {
        self.model.decoder.kv_block_bytes(self.kv.block_size)
    }

    /// Drafts for every sequence of `seqs` at once: first the tokens each has not yet run
    /// through the draft (in passes of at most [`CHUNK`] tokens; whole blocks another sequence
    /// already ran are skipped), then one pass per drafted position. Returns each sequence's
    /// draft; its rows are written for `tokens` and all but the last drafted token.
    pub fn draft(&mut self, seqs: &mut [DraftSeq], pool: &BlockPool) -> Result<Vec<Draft>> {
        let bs = self.kv.block_size;
        let g = self.group;
        let (width, vocab) = (self.model.decoder.config.vocab_size, self.vocab);
        for s in seqs.iter_mut() {
            // At least the last token goes in: its logits start the draft (a sequence whose
            // previous draft the step then left out has all its tokens in already).
            *s.computed = (*s.computed).min(s.tokens.len() - 1);
            let table = &s.tables[g];
            // Only whole blocks before the last token: its logits start the draft.
            while (*s.computed).is_multiple_of(bs) && *s.computed + bs < s.tokens.len() {
                let b = table[*s.computed / bs] as usize;
                if self.valid[b] != pool.allocations(b as u32) + 1 {
                    break;
                }
                *s.computed += bs;
            }
        }
        let mut drafts: Vec<Draft> = (0..seqs.len()).map(|_| Draft::default()).collect();
        // Catching up: every sequence's pending tokens, the last one's logits starting its draft.
        loop {
            let mut budget = CHUNK;
            let mut pass: Vec<(usize, usize)> = Vec::new();
            for (i, s) in seqs.iter().enumerate() {
                let pending = s.tokens.len() - *s.computed;
                if pending > 0 && budget > 0 {
                    let n = pending.min(budget);
                    budget -= n;
                    pass.push((i, n));
                }
            }
            if pass.is_empty() {
                break;
            }
            let chunks: Vec<SeqChunk> = pass
                .iter()
                .map(|&(i, n)| {
                    let s = &seqs[i];
                    SeqChunk {
                        tokens: &s.tokens[*s.computed..*s.computed + n],
                        start: *s.computed,
                        tables: std::slice::from_ref(&s.tables[g]),
                        logits: if *s.computed + n == s.tokens.len() {
                            Logits::Last
                        } else {
                            Logits::None
                        },
                        // Draft models have no recurrent state (hybrid ones are refused) and
                        // no adapters: a drafted token is only ever kept when the target
                        // model, adapter and all, samples it.
                        state: 0,
                        adapter: 0,
                        embeds: &[],
                        grids: &[],
                    }
                })
                .collect();
            let rows =
                self.model
                    .decoder
                    .forward_batch_view(&mut self.kv, &chunks, &mut self.logits)?;
            let mut rows = rows.chunks_exact(width);
            for &(i, n) in &pass {
                let s = &mut seqs[i];
                let before = *s.computed;
                *s.computed += n;
                if *s.computed == s.tokens.len() {
                    let row = rows.next().ok_or_else(too_few)?;
                    drafts[i].push(&row[..vocab], s.sampler.as_deref_mut());
                }
                // Blocks this pass completed hold draft rows of final tokens.
                for b in before / bs..*s.computed / bs {
                    let id = s.tables[g][b];
                    self.valid[id as usize] = pool.allocations(id) + 1;
                }
            }
        }
        // Extending: one pass per position, each sequence feeding its latest drafted token.
        let longest = seqs.iter().map(|s| s.k).max().unwrap_or(0);
        for j in 1..longest {
            let live: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].k > j && drafts[i].tokens.len() == j)
                .collect();
            for group in live.chunks(CHUNK) {
                let chunks: Vec<SeqChunk> = group
                    .iter()
                    .map(|&i| SeqChunk {
                        tokens: &drafts[i].tokens[j - 1..j],
                        start: seqs[i].tokens.len() + j - 1,
                        tables: std::slice::from_ref(&seqs[i].tables[g]),
                        logits: Logits::Last,
                        state: 0,
                        adapter: 0,
                        embeds: &[],
                        grids: &[],
                    })
                    .collect();
                let rows = self.model.decoder.forward_batch_view(
                    &mut self.kv,
                    &chunks,
                    &mut self.logits,
                )?;
                let rows: Vec<&[f32]> = rows.chunks_exact(width).collect();
                if rows.len() != group.len() {
                    return Err(too_few());
                }
                for (&i, row) in group.iter().zip(rows) {
                    drafts[i].push(&row[..vocab], seqs[i].sampler.as_deref_mut());
                }
            }
        }
        Ok(drafts)
    }
}

fn too_few() -> Error {
    Error::InvalidRequest("the draft model's forward returned too few logits".into())
}

/// Drafting needs every id to mean the same text for both models.
fn same_vocabulary(draft: &Tokenizer, target: &Tokenizer) -> Result<()> {
    let (a, b) = (draft.inner(), target.inner());
    let (na, nb) = (a.get_vocab_size(true), b.get_vocab_size(true));
    if na != nb {
        return Err(Error::InvalidRequest(format!(
            "the draft model's vocabulary has {na} tokens, the model's {nb}: drafting needs the same vocabulary"
        )));
    }
    for id in 0..na as u32 {
        if a.id_to_token(id) != b.id_to_token(id) {
            return Err(Error::InvalidRequest(format!(
                "the draft model's token {id} is {:?}, the model's {:?}: drafting needs the same vocabulary",
                a.id_to_token(id).unwrap_or_default(),
                b.id_to_token(id).unwrap_or_default()
            )));
        }
    }
    Ok(())
}

/// A sequence's draft length, chosen each step from the running estimate `alpha` of the
/// chance that a drafted token is kept (given the ones before it were): drafting `k` tokens
/// yields 1 + α + … + α^k tokens for a pass of k + 1 tokens, which costs 1 + βk passes of one
/// (β: what a verified token adds to a pass; measured on SmolLM2 here, a pass of 5 tokens
/// took 1.8× one) plus γk for drafting them (γ: a draft model's cost per token relative to
/// the model's, 0 for prompt lookup). The length with the most tokens per unit of cost wins;
/// where no length beats plain decoding, drafting pauses (8 steps, then twice as long after
/// each further pause, up to 128) and then tries again with a fresh estimate. A fresh
/// estimate is first tried on a few drafted tokens, whatever it predicts, so that the
/// verdict rests on this sequence's own drafts.
#[derive(Debug, Clone, Copy)]
pub struct DraftLen {
    pub max: usize,
    alpha: f32,
    beta: f32,
    gamma: f32,
    paused: u32,
    pause: u32,
    /// Drafted tokens whose outcome the estimate has seen since it was (re)started.
    seen: u32,
}

impl DraftLen {
    /// Drafted tokens a fresh estimate is tried on before it may pause drafting.
    const TRIAL: u32 = 6;
    /// What a verified token adds to a pass, relative to a pass of one token.
    pub const BETA: f32 = 0.25;
    const FIRST_PAUSE: u32 = 8;
    const LONGEST_PAUSE: u32 = 128;
    /// The estimate a sequence starts (and restarts after a pause) with.
    const PRIOR: f32 = 0.6;
    /// Weight of each drafted token's outcome in the running estimate.
    const RATE: f32 = 0.15;

    /// Up to `max` tokens a step, drafted at `gamma` (see above) the cost of a decode step each.
    pub fn new(max: usize, gamma: f32) -> DraftLen {
        DraftLen {
            max,
            alpha: Self::PRIOR,
            beta: Self::BETA,
            gamma: gamma.max(0.0),
            paused: 0,
            pause: Self::FIRST_PAUSE,
            seen: 0,
        }
    }

    /// Whether a drafter of relative cost `gamma` beats plain decoding when every draft is kept
    /// (k + 1 tokens for 1 + (β + γ)k: only if β + γ < 1).
    pub fn can_pay(gamma: f32) -> bool {
        Self::BETA + gamma.max(0.0) < 1.0
    }

    /// Tokens per unit of cost when drafting `k`.
    fn gain(&self, k: usize) -> f32 {
        let a = self.alpha;
        let tokens: f32 = (0..=k).map(|i| a.powi(i as i32)).sum();
        tokens / (1.0 + (self.beta + self.gamma) * k as f32)
    }

    /// How many tokens to draft this step (0: none); call once per decoding step.
    pub fn this_step(&mut self) -> usize {
        if self.max == 0 {
            return 0;
        }
        if self.paused > 0 {
            self.paused -= 1;
            return 0;
        }
        let best = (1..=self.max)
            .max_by(|&a, &b| self.gain(a).total_cmp(&self.gain(b)).then(b.cmp(&a)))
            .unwrap_or(0);
        if self.seen >= Self::TRIAL {
            if self.gain(best) <= 1.0 {
                // This step is the pause's first; the estimate starts afresh after it.
                self.paused = self.pause - 1;
                self.alpha = Self::PRIOR;
                self.seen = 0;
                self.pause = (self.pause * 2).min(Self::LONGEST_PAUSE);
                return 0;
            }
            // Drafting pays: a later pause starts short again.
            self.pause = Self::FIRST_PAUSE;
        }
        best
    }

    /// Records a checked draft: `accepted` of its `drafted` tokens kept (the first rejected
    /// one ends it, so it is `accepted` successes and, if short, one failure).
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        let mut see = |kept: bool| {
            self.alpha += Self::RATE * (f32::from(u8::from(kept)) - self.alpha);
            self.seen += 1;
        };
        for _ in 0..accepted {
            see(true);
        }
        if accepted < drafted {
            see(false);
        }
    }

    /// The current estimate of a drafted token's chance to be kept.
    pub fn alpha(&self) -> f32 {
        self.alpha
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_proposes_what_followed_the_latest_match() {
        let mut d = NgramDrafter;
        // "a b c d e ... a b" → "c d e".
        let t = [1, 2, 3, 4, 5, 9, 9, 1, 2];
        assert_eq!(d.propose(&t, 3), vec![3, 4, 5]);
        assert_eq!(d.propose(&t, 1), vec![3]);
        // The longest n-gram wins: "7 1 2" matches later than "1 2" alone would.
        let t = [1, 2, 8, 7, 1, 2, 6, 0, 7, 1, 2];
        assert_eq!(d.propose(&t, 2), vec![6, 0]);
        // Nothing to copy.
        assert!(d.propose(&[1, 2, 3, 4], 4).is_empty());
        assert!(d.propose(&[5, 5], 4).is_empty());
        assert!(d.propose(&t, 0).is_empty());
    }

    #[test]
    fn draft_length_follows_the_acceptance_rate() {
        let mut l = DraftLen::new(8, 0.0);
        // The prior drafts a little.
        let k0 = l.this_step();
        assert!((1..=3).contains(&k0), "{k0}");
        // Drafts kept whole push the estimate up and the length to the most allowed.
        for _ in 0..20 {
            let k = l.this_step();
            l.update(k, k);
        }
        assert!(l.alpha() > 0.95);
        assert_eq!(l.this_step(), 8);
        // Drafts rejected at once bring it down until drafting pauses: 8 steps, then 16.
        let mut steps = 0;
        while l.this_step() > 0 {
            l.update(1, 0);
            steps += 1;
            assert!(steps < 40, "never paused");
        }
        assert_eq!((0..7).map(|_| l.this_step()).sum::<usize>(), 0);
        let probe = l.this_step();
        assert!(probe > 0, "drafting resumes after the pause");
        l.update(probe, 0);
        while l.this_step() > 0 {
            l.update(1, 0);
        }
        assert_eq!((0..15).filter(|_| l.this_step() == 0).count(), 15);
        assert!(l.this_step() > 0);
        // A costly drafter (a draft model half the size) needs a higher rate to pay at all.
        let mut cheap = DraftLen::new(8, 0.0);
        let mut dear = DraftLen::new(8, 0.5);
        for l in [&mut cheap, &mut dear] {
            for _ in 0..30 {
                l.update(4, 2);
            }
        }
        assert!(cheap.this_step() > 0);
        assert_eq!(dear.this_step(), 0);
        assert_eq!(DraftLen::new(0, 0.0).this_step(), 0);
    }
}
