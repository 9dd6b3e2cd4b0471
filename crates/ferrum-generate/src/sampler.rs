//! Turning logits into the next token: greedy at temperature 0, otherwise temperature,
//! top-k, then top-p (nucleus) filtering and a draw from a seeded generator, in the order
//! llama.cpp and Hugging Face apply them.

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

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// (token, probability) working list, kept to avoid a vocabulary-sized allocation per token.
    cand: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Sampler {
            params,
            rng,
            cand: Vec::new(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let t = self.params.temperature;
        self.cand.clear();
        self.cand
            .extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l / t)));
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
        let total: f32 = self.cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.gen::<f32>() * total;
        for c in &self.cand {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        self.cand.last().map_or(0, |c| c.0)
    }
}

/// Index of the largest logit; the lowest index wins a tie.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 2.0, 2.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_cuts_the_tail() {
        let logits = [1.0, 3.0, 2.9, -5.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: Some(1),
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
        // p(1) ≈ 0.50, p(2) ≈ 0.45: top_p 0.9 keeps only those two.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: Some(2),
        });
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
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: Some(9),
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let mut s = Sampler::new(p);
        let b: Vec<u32> = (0..50).map(|_| s.sample(&logits)).collect();
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "sampling at temperature 1 should vary"
        );
    }
}
