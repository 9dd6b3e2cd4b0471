//! Turning logits into the next token.
//!
//! The steps, in the order they are applied (vLLM's and OpenAI's definitions of each knob):
//!
//! 1. **logit_bias**: an additive bias per token id (−100 effectively bans a token).
//! 2. **penalties**, over the history the sampler keeps ([`Sampler::observe_prompt`],
//!    [`Sampler::observe`]):
//!    - repetition penalty (Hugging Face / llama.cpp / vLLM): every token seen in the prompt
//!      *or* the output has its logit divided by the penalty if positive, multiplied by it
//!      otherwise; applied once per token, however often it was seen;
//!    - frequency penalty: `logit -= frequency × count`, count of the token in the *output*;
//!    - presence penalty: `logit -= presence` once for each token present in the *output*.
//!
//!    As in vLLM, presence and frequency look at generated tokens only (OpenAI's definition:
//!    "so far in the text"), the repetition penalty at prompt and output.
//! 3. **temperature**; at temperature 0 the result is the argmax of the biased, penalised
//!    logits, and steps 4–7 are skipped.
//! 4. **top-k**, 5. **top-p** (nucleus, on the renormalised top-k distribution),
//! 6. **min-p**: drop tokens whose probability is below `min_p ×` the largest probability.
//!    That ratio does not change when the distribution is renormalised after top-k or top-p,
//!    so it equals the ratio under the full post-temperature distribution.
//! 7. a draw from a seeded generator.
//!
//! Log-probabilities ([`Sampler::sample_with_logprobs`]) follow vLLM's default
//! (`logprobs_mode = raw_logprobs`): the log-softmax of the logits as the model produced
//! them, before bias, penalties, temperature or any filter. They describe the model, not
//! the sampling settings, and are the same whatever the temperature.

use std::collections::{BTreeMap, HashMap, HashSet};

use ferrum_core::{Error, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.95,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
        }
    }
}

/// The sampling settings beyond [`SamplingParams`]. Kept apart so that existing
/// `SamplingParams { temperature, top_k, top_p, seed }` literals keep compiling. The
/// defaults change nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingExtras {
    /// 0 means no min-p cut.
    pub min_p: f32,
    /// 1.0 means none; must be > 0.
    pub repetition_penalty: f32,
    /// 0 means none; OpenAI allows −2..=2.
    pub presence_penalty: f32,
    /// 0 means none; OpenAI allows −2..=2.
    pub frequency_penalty: f32,
    /// Token id → additive bias. Ids outside the vocabulary are ignored.
    pub logit_bias: BTreeMap<u32, f32>,
}

impl Default for SamplingExtras {
    fn default() -> Self {
        SamplingExtras {
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
        }
    }
}

impl SamplingExtras {
    /// Whether no bias or penalty changes the logits (min-p only cuts the candidates).
    pub fn leaves_logits(&self) -> bool {
        self.logit_bias.is_empty()
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
    }

    pub fn with_min_p(mut self, min_p: f32) -> Self {
        self.min_p = min_p;
        self
    }

    pub fn with_repetition_penalty(mut self, penalty: f32) -> Self {
        self.repetition_penalty = penalty;
        self
    }

    pub fn with_presence_penalty(mut self, penalty: f32) -> Self {
        self.presence_penalty = penalty;
        self
    }

    pub fn with_frequency_penalty(mut self, penalty: f32) -> Self {
        self.frequency_penalty = penalty;
        self
    }

    pub fn with_logit_bias(mut self, token: u32, bias: f32) -> Self {
        self.logit_bias.insert(token, bias);
        self
    }

    /// Checks the ranges vLLM and OpenAI accept, so a bad request is refused with a clear
    /// message rather than producing NaN logits.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidRequest(what));
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(*b))
        {
            return bad(format!(
                "logit_bias for token {t} must be in [-100, 100], got {b}"
            ));
        }
        Ok(())
    }
}

/// The tokens the penalties look at: the prompt's (as a set) and the output's (with counts).
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    prompt: HashSet<u32>,
    output: HashMap<u32, u32>,
}

impl TokenHistory {
    pub fn observe_prompt(&mut self, tokens: &[u32]) {
        self.prompt.extend(tokens.iter().copied());
    }

    /// Records one generated token.
    pub fn observe(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
    }

    /// How many times `token` was generated (prompt occurrences not counted).
    pub fn output_count(&self, token: u32) -> u32 {
        self.output.get(&token).copied().unwrap_or(0)
    }

    pub fn clear(&mut self) {
        self.prompt.clear();
        self.output.clear();
    }
}

/// Adds each token's bias to its logit. Ids outside `logits` are ignored.
pub fn apply_logit_bias(logits: &mut [f32], bias: &BTreeMap<u32, f32>) {
    for (&t, &b) in bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// Applies the repetition, frequency and presence penalties (see the module docs for the
/// formulas). Ids outside `logits` are ignored.
pub fn apply_penalties(logits: &mut [f32], history: &TokenHistory, extras: &SamplingExtras) {
    let rep = extras.repetition_penalty;
    if rep != 1.0 {
        let penalise = |l: &mut f32| *l = if *l > 0.0 { *l / rep } else { *l * rep };
        for &t in &history.prompt {
            if let Some(l) = logits.get_mut(t as usize) {
                penalise(l);
            }
        }
        // Once per token: skip output tokens the prompt already covered.
        for &t in history.output.keys() {
            if history.prompt.contains(&t) {
                continue;
            }
            if let Some(l) = logits.get_mut(t as usize) {
                penalise(l);
            }
        }
    }
    let (freq, pres) = (extras.frequency_penalty, extras.presence_penalty);
    if freq != 0.0 || pres != 0.0 {
        for (&t, &n) in &history.output {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= freq * n as f32 + pres;
            }
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    extras: SamplingExtras,
    history: TokenHistory,
    rng: StdRng,
    /// Biased and penalised logits, kept to avoid a vocabulary-sized allocation per token.
    work: Vec<f32>,
    /// (token, probability) working list, likewise reused.
    cand: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self::with_extras(params, SamplingExtras::default())
    }

    /// `extras` should have passed [`SamplingExtras::validate`].
    pub fn with_extras(params: SamplingParams, extras: SamplingExtras) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Sampler {
            params,
            extras,
            history: TokenHistory::default(),
            rng,
            work: Vec::new(),
            cand: Vec::new(),
        }
    }

    /// Records prompt tokens for the repetition penalty.
    pub fn observe_prompt(&mut self, tokens: &[u32]) {
        self.history.observe_prompt(tokens);
    }

    /// Records a generated token for all three penalties. [`Sampler::sample`] does not do
    /// this itself: the caller decides which tokens join the output (not an end-of-sequence
    /// token, say).
    pub fn observe(&mut self, token: u32) {
        self.history.observe(token);
    }

    pub fn history(&self) -> &TokenHistory {
        &self.history
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        // Greedy on the logits as they are: no vocabulary-sized working copy (per stream and
        // step, it cost about as much as the argmax).
        if self.params.temperature <= 0.0 && self.extras.leaves_logits() {
            return argmax(logits);
        }
        if let Some(t) = self.distribution(logits) {
            return t;
        }
        let total: f32 = self.cand.iter().map(|c| c.1).sum();
        let r = self.rng.gen::<f32>() * total;
        draw(&self.cand, r)
    }

    /// Whether this sampler draws at random (temperature above 0).
    pub fn is_random(&self) -> bool {
        self.params.temperature > 0.0
    }

    /// The distribution [`Sampler::sample`] draws from, left in `self.cand` as (token,
    /// weight) pairs, highest first (the filters' survivors, not renormalised after the
    /// nucleus and min-p cuts); or, when greedy, the token itself.
    fn distribution(&mut self, logits: &[f32]) -> Option<u32> {
        self.work.clear();
        self.work.extend_from_slice(logits);
        apply_logit_bias(&mut self.work, &self.extras.logit_bias);
        apply_penalties(&mut self.work, &self.history, &self.extras);
        if self.params.temperature <= 0.0 {
            return Some(argmax(&self.work));
        }
        let t = self.params.temperature;
        self.cand.clear();
        self.cand.extend(
            self.work
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l / t)),
        );
        // Highest first; ties to the lower id so results do not depend on the sort.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = self.params.top_k;
        if k > 0 && k < self.cand.len() {
            self.cand.select_nth_unstable_by(k - 1, by_logit);
            self.cand.truncate(k);
        }
        self.cand.sort_unstable_by(by_logit);
        let max = self.cand[0].1;
        let mut sum = 0.0;
        for c in self.cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            sum += c.1;
        }
        for c in self.cand.iter_mut() {
            c.1 /= sum;
        }
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                acc += c.1;
                if acc >= self.params.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
        }
        if self.extras.min_p > 0.0 {
            // Sorted, so the cut is a prefix; the most likely token always stays.
            let floor = self.extras.min_p * self.cand[0].1;
            let keep = self.cand.iter().take_while(|c| c.1 >= floor).count();
            self.cand.truncate(keep.max(1));
        }
        None
    }

    /// [`Sampler::distribution`]'s weights scaled to sum to one.
    fn normalise(&mut self) {
        let total: f32 = self.cand.iter().map(|c| c.1).sum();
        self.cand.iter_mut().for_each(|c| c.1 /= total);
    }

    /// Samples a draft token from `logits` (a draft model's) as [`Sampler::sample`] would and
    /// returns it with the distribution it was drawn from, sorted by token id — what
    /// [`Sampler::sample_against_draft`] needs. `None` when this sampler is greedy.
    pub fn draft(&mut self, logits: &[f32]) -> Option<(u32, Vec<(u32, f32)>)> {
        if !self.is_random() || self.distribution(logits).is_some() {
            return None;
        }
        self.normalise();
        let r = self.rng.gen::<f32>();
        let token = draw(&self.cand, r);
        let mut q = self.cand.clone();
        q.sort_unstable_by_key(|c| c.0);
        Some((token, q))
    }

    /// Speculative sampling's rejection rule (Leviathan et al. 2023; Chen et al. 2023): with
    /// `draft` drawn from `q` (sorted by token id) and p this sampler's distribution over
    /// `logits`, keeps `draft` with probability min(1, p/q), and otherwise draws from the
    /// normalised (p − q)+ — which never gives `draft` back. Whatever q is, the token returned
    /// follows p, as [`Sampler::sample`]'s would. Greedy samplers keep `draft` only if it is
    /// the argmax.
    pub fn sample_against_draft(&mut self, logits: &[f32], draft: u32, q: &[(u32, f32)]) -> u32 {
        if !self.is_random() {
            return self.sample(logits);
        }
        if let Some(t) = self.distribution(logits) {
            return t;
        }
        self.normalise();
        let q_of = |t: u32| q.binary_search_by_key(&t, |c| c.0).map_or(0.0, |i| q[i].1);
        let p_d = self.cand.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1);
        let q_d = q_of(draft);
        let u = self.rng.gen::<f32>();
        if q_d > 0.0 && u * q_d < p_d {
            return draft;
        }
        // The residual keeps p's order (highest p first), so draws are reproducible.
        let mut residual: Vec<(u32, f32)> = self
            .cand
            .iter()
            .map(|&(t, p)| (t, (p - q_of(t)).max(0.0)))
            .filter(|c| c.1 > 0.0 && c.0 != draft)
            .collect();
        let total: f32 = residual.iter().map(|c| c.1).sum();
        let r = self.rng.gen::<f32>();
        if total <= 0.0 {
            // Only rounding leaves nothing: p and q agree, so p itself is the residual.
            return draw(&self.cand, r);
        }
        residual.iter_mut().for_each(|c| c.1 /= total);
        draw(&residual, r)
    }

    /// Samples as [`Sampler::sample`] does and also returns the chosen token's log-probability
    /// and the `top_n` most likely tokens with theirs (highest first, ties to the lower id).
    /// All log-probabilities are the raw model's — the log-softmax of `logits` before bias,
    /// penalties, temperature and filters (vLLM's default), so the chosen token's need not be
    /// among the top `top_n`, and the sampling settings do not change them.
    pub fn sample_with_logprobs(
        &mut self,
        logits: &[f32],
        top_n: usize,
    ) -> (u32, f32, Vec<(u32, f32)>) {
        let token = self.sample(logits);
        let (chosen, top) = logprobs(logits, token, top_n);
        (token, chosen, top)
    }
}

/// The token at which the running sum of `cand`'s weights passes `r` (in [0, their sum)).
fn draw(cand: &[(u32, f32)], r: f32) -> u32 {
    let mut r = r;
    for c in cand {
        r -= c.1;
        if r <= 0.0 {
            return c.0;
        }
    }
    cand.last().map_or(0, |c| c.0)
}

/// The log-probability of `token` under `logits` (their log-softmax) and the `top_n` most
/// likely tokens with theirs, highest first, ties to the lower id.
pub fn logprobs(logits: &[f32], token: u32, top_n: usize) -> (f32, Vec<(u32, f32)>) {
    let lse = log_sum_exp(logits);
    let chosen = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| l - lse);
    (chosen, top_n_logprobs(logits, top_n, lse))
}

/// `ln Σ exp(l)`, computed stably.
fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    max + sum.ln()
}

fn top_n_logprobs(logits: &[f32], n: usize, lse: f32) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut all: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    if n < all.len() {
        all.select_nth_unstable_by(n - 1, by_logit);
        all.truncate(n);
    }
    all.sort_unstable_by(by_logit);
    for c in all.iter_mut() {
        c.1 -= lse;
    }
    all
}

/// Index of the largest logit; the lowest index wins a tie.
pub fn argmax(logits: &[f32]) -> u32 {
    // The answer of the plain scan (`best` moves only to a strictly greater value, so NaNs
    // never win and ties go to the lower id) in two passes that vectorise: the greatest value
    // under that rule, eight lanes at a time, then its first position.
    let Some(&first) = logits.first() else {
        return 0;
    };
    if first.is_nan() {
        // Nothing compares greater than the starting NaN: the scan stays at 0.
        return 0;
    }
    let chunks = logits.chunks_exact(8);
    let rest = chunks.remainder();
    let mut lanes = [first; 8];
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = first;
    for &x in lanes.iter().chain(rest) {
        if x > max {
            max = x;
        }
    }
    // `==` also matches -0.0 for 0.0, as the scan (never moving between them) does. Whole
    // chunks are tested without an early exit (so the test vectorises), then the one found.
    let chunk = logits
        .chunks(64)
        .position(|c| c.iter().fold(false, |hit, &x| hit | (x == max)))
        .unwrap_or(0);
    let at = logits[chunk * 64..]
        .iter()
        .position(|&x| x == max)
        .unwrap_or(0);
    (chunk * 64 + at) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised argmax gives the plain scan's answer: ties to the lower id, NaNs never
    /// chosen (unless first), signed zeros, every length around the eight-lane chunks.
    #[test]
    fn argmax_equals_the_plain_scan() {
        fn scan(l: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &v) in l.iter().enumerate() {
                if v > l[best] {
                    best = i;
                }
            }
            best as u32
        }
        let mut rng = StdRng::seed_from_u64(3);
        for len in [0, 1, 2, 7, 8, 9, 15, 16, 17, 100, 49_152] {
            for trial in 0..20 {
                let mut l: Vec<f32> = (0..len)
                    .map(|_| (rng.gen_range(-4i32..4) as f32) * 0.5)
                    .collect();
                if len > 0 {
                    match trial % 5 {
                        1 => l[rng.gen_range(0..len)] = f32::NAN,
                        2 => l[0] = f32::NAN,
                        3 => {
                            for v in l.iter_mut() {
                                *v = if rng.gen_bool(0.5) { 0.0 } else { -0.0 };
                            }
                        }
                        4 => l[len - 1] = 9.0,
                        _ => {}
                    }
                }
                assert_eq!(argmax(&l), scan(&l), "len {len}, trial {trial}");
            }
        }
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
        }
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    /// Draw frequencies over `n` samples.
    fn frequencies(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<f32> {
        let mut seen = vec![0usize; logits.len()];
        for _ in 0..n {
            seen[s.sample(logits) as usize] += 1;
        }
        seen.iter().map(|&c| c as f32 / n as f32).collect()
    }

    /// `got` is within `tol` of `want` everywhere, and exactly 0 where `want` is 0.
    fn assert_close(got: &[f32], want: &[f32], tol: f32) {
        for (g, w) in got.iter().zip(want) {
            if *w == 0.0 {
                assert_eq!(*g, 0.0, "excluded token drawn: {got:?} vs {want:?}");
            } else {
                assert!((g - w).abs() < tol, "{got:?} vs {want:?}");
            }
        }
    }

    const PROBS: [f32; 4] = [0.5, 0.3, 0.15, 0.05];

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 2.0, 2.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_cuts_the_tail() {
        let logits = [1.0, 3.0, 2.9, -5.0];
        let mut s = Sampler::new(params(1.0, 1, 1.0, 1));
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
        // p(1) ≈ 0.50, p(2) ≈ 0.45: top_p 0.9 keeps only those two.
        let mut s = Sampler::new(params(1.0, 0, 0.9, 2));
        let mut seen = [0; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[3], 0, "{seen:?}");
        assert!(seen[1] > 800 && seen[2] > 700, "{seen:?}");
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(1.0, 0, 1.0, 9);
        let extras = SamplingExtras::default()
            .with_min_p(0.1)
            .with_frequency_penalty(0.5)
            .with_logit_bias(3, 2.0);
        let run = || {
            let mut s = Sampler::with_extras(p.clone(), extras.clone());
            (0..50)
                .map(|_| {
                    let t = s.sample(&logits);
                    s.observe(t);
                    t
                })
                .collect::<Vec<u32>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(
            a.iter().any(|&t| t != a[0]),
            "sampling at temperature 1 should vary"
        );
    }

    #[test]
    fn plain_sampling_follows_the_softmax() {
        let mut s = Sampler::new(params(1.0, 0, 1.0, 3));
        let f = frequencies(&mut s, &logits_of(&PROBS), 20_000);
        assert_close(&f, &PROBS, 0.015);
    }

    #[test]
    fn top_k_keeps_k_and_renormalises() {
        let mut s = Sampler::new(params(1.0, 2, 1.0, 4));
        let f = frequencies(&mut s, &logits_of(&PROBS), 20_000);
        assert_close(&f, &[0.625, 0.375, 0.0, 0.0], 0.015);
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_renormalises() {
        // Cumulative 0.5, 0.8, 0.95: top_p 0.85 keeps three tokens.
        let mut s = Sampler::new(params(1.0, 0, 0.85, 5));
        let f = frequencies(&mut s, &logits_of(&PROBS), 20_000);
        assert_close(&f, &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], 0.015);
    }

    #[test]
    fn min_p_drops_tokens_below_the_fraction_of_the_top() {
        // 0.2 × 0.5 = 0.1: only the 0.05 token goes.
        let extras = SamplingExtras::default().with_min_p(0.2);
        let mut s = Sampler::with_extras(params(1.0, 0, 1.0, 6), extras);
        let f = frequencies(&mut s, &logits_of(&PROBS), 20_000);
        assert_close(&f, &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], 0.015);

        // 0.4 × 0.5 = 0.2: keeps 0.5 and 0.3.
        let extras = SamplingExtras::default().with_min_p(0.4);
        let mut s = Sampler::with_extras(params(1.0, 0, 1.0, 7), extras);
        let f = frequencies(&mut s, &logits_of(&PROBS), 20_000);
        assert_close(&f, &[0.625, 0.375, 0.0, 0.0], 0.015);
    }

    #[test]
    fn min_p_is_measured_after_temperature() {
        // At temperature 1 token 3 has 0.1 of the top's probability and survives min_p 0.05;
        // at temperature 0.5 the ratios square (0.09 and 0.01), so it is cut.
        let logits = logits_of(&PROBS);
        let extras = SamplingExtras::default().with_min_p(0.05);
        let mut s = Sampler::with_extras(params(1.0, 0, 1.0, 8), extras.clone());
        assert!(frequencies(&mut s, &logits, 20_000)[3] > 0.03);

        let mut s = Sampler::with_extras(params(0.5, 0, 1.0, 8), extras);
        let f = frequencies(&mut s, &logits, 20_000);
        let z = 0.25 + 0.09 + 0.0225;
        assert_close(&f, &[0.25 / z, 0.09 / z, 0.0225 / z, 0.0], 0.015);
    }

    #[test]
    fn filters_compose_and_never_leak() {
        let logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.61).cos() * 3.0).collect();
        let extras = SamplingExtras::default().with_min_p(0.3);
        let mut s = Sampler::with_extras(params(0.8, 10, 0.9, 11), extras);
        let mut order: Vec<u32> = (0..64).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let top10 = &order[..10];
        let top_logit = logits[order[0] as usize];
        for _ in 0..5000 {
            let t = s.sample(&logits);
            assert!(top10.contains(&t), "{t} is outside the top 10");
            // min_p 0.3 after temperature 0.8: p/p_max = exp((l - l_max) / 0.8) ≥ 0.3.
            let ratio = ((logits[t as usize] - top_logit) / 0.8).exp();
            assert!(ratio >= 0.3 - 1e-6, "{t} has ratio {ratio}");
        }
    }

    #[test]
    fn penalties_follow_the_formulas() {
        let extras = SamplingExtras::default()
            .with_repetition_penalty(2.0)
            .with_presence_penalty(0.5)
            .with_frequency_penalty(0.25);
        let mut h = TokenHistory::default();
        h.observe_prompt(&[0, 1, 0, 999]);
        for t in [2, 2, 1, 1000] {
            h.observe(t);
        }
        let mut logits = vec![2.0, -1.0, 0.5, 3.0, 0.0];
        apply_penalties(&mut logits, &h, &extras);
        let want = [
            2.0 / 2.0,             // prompt only: repetition, positive logit divided
            -2.0 - 0.25 - 0.5,     // prompt and output once: -1 multiplied by 2, once
            0.5 / 2.0 - 0.5 - 0.5, // output twice: divided once, frequency × 2, presence
            3.0,                   // never seen
            0.0,                   // never seen
        ];
        assert_eq!(logits, want);
        assert_eq!(h.output_count(2), 2);
        assert_eq!(h.output_count(0), 0);

        // The defaults change nothing.
        let mut l2 = vec![2.0, -1.0, 0.5, 3.0, 0.0];
        apply_penalties(&mut l2, &h, &SamplingExtras::default());
        assert_eq!(l2, [2.0, -1.0, 0.5, 3.0, 0.0]);
    }

    #[test]
    fn logit_bias_adds_and_ignores_unknown_ids() {
        let extras = SamplingExtras::default()
            .with_logit_bias(1, -100.0)
            .with_logit_bias(2, 0.5)
            .with_logit_bias(77, 5.0);
        let mut logits = vec![1.0, 2.0, 3.0];
        apply_logit_bias(&mut logits, &extras.logit_bias);
        assert_eq!(logits, [1.0, -98.0, 3.5]);
    }

    #[test]
    fn greedy_honours_bias_and_penalties() {
        let logits = [1.0, 5.0, 4.8, 0.0];
        let extras = SamplingExtras::default().with_logit_bias(1, -100.0);
        let mut s = Sampler::with_extras(SamplingParams::greedy(), extras);
        assert_eq!(s.sample(&logits), 2);

        // 5.0 / 1.1 < 4.8 once token 1 has been seen.
        let extras = SamplingExtras::default().with_repetition_penalty(1.1);
        let mut s = Sampler::with_extras(SamplingParams::greedy(), extras);
        assert_eq!(s.sample(&logits), 1);
        s.observe(1);
        assert_eq!(s.sample(&logits), 2);

        // Presence penalties are for the output only; the prompt does not trigger them.
        let extras = SamplingExtras::default().with_presence_penalty(0.5);
        let mut s = Sampler::with_extras(SamplingParams::greedy(), extras);
        s.observe_prompt(&[1]);
        assert_eq!(s.sample(&logits), 1);
        s.observe(1);
        assert_eq!(s.sample(&logits), 2);
    }

    #[test]
    fn a_banned_token_is_never_sampled() {
        let extras = SamplingExtras::default().with_logit_bias(0, -100.0);
        let mut s = Sampler::with_extras(params(1.0, 0, 1.0, 12), extras);
        let f = frequencies(&mut s, &logits_of(&PROBS), 5000);
        assert_eq!(f[0], 0.0);
    }

    #[test]
    fn logprobs_are_the_raw_model_log_softmax() {
        let logits = logits_of(&PROBS);
        // Bias, penalties and temperature must not change the reported logprobs.
        let extras = SamplingExtras::default()
            .with_logit_bias(3, 100.0)
            .with_repetition_penalty(1.3);
        let mut s = Sampler::with_extras(SamplingParams::greedy(), extras);
        s.observe_prompt(&[0]);
        let (t, lp, top) = s.sample_with_logprobs(&logits, 2);
        assert_eq!(t, 3);
        assert!((lp - 0.05f32.ln()).abs() < 1e-5, "{lp}");
        assert_eq!(top.len(), 2);
        assert_eq!((top[0].0, top[1].0), (0, 1));
        assert!((top[0].1 - 0.5f32.ln()).abs() < 1e-5);
        assert!((top[1].1 - 0.3f32.ln()).abs() < 1e-5);

        // top_n beyond the vocabulary returns all of it, summing to probability 1.
        let shifted: Vec<f32> = logits.iter().map(|l| l + 7.0).collect();
        let mut s = Sampler::new(params(0.3, 0, 1.0, 13));
        let (t, lp, top) = s.sample_with_logprobs(&shifted, 10);
        assert_eq!(top.len(), 4);
        let total: f32 = top.iter().map(|c| c.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(lp, top.iter().find(|c| c.0 == t).unwrap().1);
        assert!(s.sample_with_logprobs(&shifted, 0).2.is_empty());
    }

    #[test]
    fn validate_refuses_out_of_range_settings() {
        assert!(SamplingExtras::default().validate().is_ok());
        for bad in [
            SamplingExtras::default().with_min_p(1.5),
            SamplingExtras::default().with_repetition_penalty(0.0),
            SamplingExtras::default().with_presence_penalty(3.0),
            SamplingExtras::default().with_frequency_penalty(f32::NAN),
            SamplingExtras::default().with_logit_bias(1, -101.0),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    /// Pearson's chi-square statistic of `counts` against the probabilities `want` (cells
    /// with probability 0 must be empty).
    fn chi_square(counts: &[usize], want: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(want)
            .map(|(&c, &p)| {
                if p == 0.0 {
                    assert_eq!(c, 0, "drawn where the target has no mass");
                    0.0
                } else {
                    let e = p * n as f64;
                    (c as f64 - e).powi(2) / e
                }
            })
            .sum()
    }

    /// Softmax of `logits / t` over the `k` highest (all when 0), as f64.
    fn target_probs(logits: &[f32], t: f32, k: usize) -> Vec<f64> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let keep = if k == 0 { logits.len() } else { k };
        let mut p = vec![0.0f64; logits.len()];
        for &i in &order[..keep] {
            p[i] = ((logits[i] - logits[order[0]]) as f64 / t as f64).exp();
        }
        let sum: f64 = p.iter().sum();
        p.iter().map(|x| x / sum).collect()
    }

    /// Drafts drawn from a draft model's distribution q and kept or replaced by the
    /// rejection rule give tokens distributed as the target's p, whatever q is — including a
    /// q with mass where p has none (the target's top-k cuts it) and a q that misses p's
    /// favourite; and they are kept at the rate Σ min(p, q).
    #[test]
    fn rejection_sampling_reproduces_the_target_distribution() {
        let target = [2.0f32, 1.2, 0.9, 0.0, -0.5, -1.0, 0.4, -3.0];
        let drafts: [[f32; 8]; 3] = [
            [1.8, 1.0, 1.1, 0.2, -0.4, -1.2, 0.3, -2.5],
            [-1.0, 0.5, 2.5, 0.0, 1.5, -2.0, 0.0, 1.0],
            [0.0; 8],
        ];
        for (case, draft_logits) in drafts.iter().enumerate() {
            for (t, k) in [(1.0f32, 0usize), (0.7, 5)] {
                let p = target_probs(&target, t, k);
                let q = target_probs(draft_logits, t, 0);
                let mut d = Sampler::new(params(t, 0, 1.0, 100 + case as u64));
                let mut s = Sampler::new(params(t, k, 1.0, 200 + case as u64));
                let n = 60_000;
                let (mut counts, mut kept) = (vec![0usize; 8], 0usize);
                for _ in 0..n {
                    let (tok, dist) = d.draft(draft_logits).unwrap();
                    let got = s.sample_against_draft(&target, tok, &dist);
                    kept += usize::from(got == tok);
                    counts[got as usize] += 1;
                }
                // 8 cells, at most 7 degrees of freedom: 24.3 is the 0.1% tail.
                let x2 = chi_square(&counts, &p);
                assert!(
                    x2 < 24.3,
                    "case {case}, t {t}, k {k}: χ² {x2:.1}, {counts:?} vs {p:?}"
                );
                let overlap: f64 = p.iter().zip(&q).map(|(a, b)| a.min(*b)).sum();
                let rate = kept as f64 / n as f64;
                assert!(
                    (rate - overlap).abs() < 0.01,
                    "case {case}: kept {rate:.3}, Σ min(p, q) = {overlap:.3}"
                );
            }
        }
        // A point-mass draft (what prompt lookup proposes) is kept with probability p(d).
        let p = target_probs(&target, 1.0, 0);
        let mut s = Sampler::new(params(1.0, 0, 1.0, 7));
        let mut counts = vec![0usize; 8];
        for _ in 0..60_000 {
            counts[s.sample_against_draft(&target, 1, &[(1, 1.0)]) as usize] += 1;
        }
        assert!(chi_square(&counts, &p) < 24.3, "{counts:?} vs {p:?}");
        // Greedy keeps only the argmax, and seeded runs repeat.
        let mut g = Sampler::new(SamplingParams::greedy());
        assert_eq!(g.sample_against_draft(&target, 2, &[(2, 1.0)]), 0);
        let run = || {
            let mut d = Sampler::new(params(0.9, 0, 0.95, 5));
            let mut s = Sampler::new(params(0.9, 0, 0.95, 6));
            (0..200)
                .map(|_| {
                    let (t, q) = d.draft(&drafts[1]).unwrap();
                    s.sample_against_draft(&target, t, &q)
                })
                .collect::<Vec<u32>>()
        };
        assert_eq!(run(), run());
    }
}
