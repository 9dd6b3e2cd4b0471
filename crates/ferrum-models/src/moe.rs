//! The mixture-of-experts FFN of Qwen3-MoE: router → softmax → top-k (ties to the lower
//! expert) → optional renormalisation → each selected expert's SwiGLU → weighted sum.
//!
//! Routing runs on the host over the router logits (n × experts, small). Tokens are then
//! grouped by expert so each active expert runs once over all of its tokens — a
//! matrix-matrix product in prefill — through the backend's `moe_ffn`.

use ferrum_backend::{Backend, ExpertBatch, ExpertWeights};
use ferrum_core::{Error, Result};

use crate::config::{ModelConfig, MoeConfig};
use crate::layers::WeightSource;
use crate::names;

pub struct MoeLayer<B: Backend> {
    pub router: B::Weight,
    pub experts: Vec<ExpertWeights<B::Weight>>,
}

impl<B: Backend> MoeLayer<B> {
    /// Loads layer `i`'s router and experts: per-expert tensors from Hugging Face files,
    /// stacked `[E, F, H]` tensors from GGUF (each expert a view of its slab, not a copy).
    pub fn load(
        be: &B,
        src: &WeightSource,
        i: usize,
        c: &ModelConfig,
        m: &MoeConfig,
    ) -> Result<Self> {
        let (h, f, e) = (c.hidden_size, m.expert_ffn, m.n_experts);
        let router = src.require(be, "model.layers.{i}.mlp.gate.weight", i, (e, h))?;
        let experts = if src.gguf {
            let stacked = |template: &str, rows: usize, cols: usize| -> Result<B::Weight> {
                let name = template.replace("{i}", &i.to_string());
                let t = src
                    .store
                    .get(&name)
                    .ok_or_else(|| Error::Weights(format!("missing tensor {name:?}")))?;
                if t.shape != [e, rows, cols] {
                    return Err(Error::Weights(format!(
                        "tensor {name:?} has shape {:?}, expected [{e}, {rows}, {cols}]",
                        t.shape
                    )));
                }
                be.load_weight(t)
            };
            let (g, u, d) = names::GGUF_EXPERTS;
            let (gate, up, down) = (stacked(g, f, h)?, stacked(u, f, h)?, stacked(d, h, f)?);
            (0..e)
                .map(|x| {
                    Ok(ExpertWeights {
                        gate: be.weight_rows(&gate, x * f, f)?,
                        up: be.weight_rows(&up, x * f, f)?,
                        down: be.weight_rows(&down, x * h, h)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..e)
                .map(|x| {
                    let n = |p: &str| format!("model.layers.{{i}}.mlp.experts.{x}.{p}.weight");
                    Ok(ExpertWeights {
                        gate: src.require(be, &n("gate_proj"), i, (f, h))?,
                        up: src.require(be, &n("up_proj"), i, (f, h))?,
                        down: src.require(be, &n("down_proj"), i, (h, f))?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(MoeLayer { router, experts })
    }
}

/// Per-token routing decisions and the per-expert token lists built from them. The vectors
/// are reused from chunk to chunk.
pub struct Router {
    n_experts: usize,
    n_active: usize,
    norm_topk_prob: bool,
    probs: Vec<f32>,
    /// `tokens[e]` / `weights[e]`: the tokens routed to expert `e`, in token order.
    tokens: Vec<Vec<u32>>,
    weights: Vec<Vec<f32>>,
}

impl Router {
    pub fn new(m: &MoeConfig) -> Self {
        Router {
            n_experts: m.n_experts,
            n_active: m.n_active,
            norm_topk_prob: m.norm_topk_prob,
            probs: Vec::new(),
            tokens: vec![Vec::new(); m.n_experts],
            weights: vec![Vec::new(); m.n_experts],
        }
    }

    /// Top-k experts of one token's router logits, highest weight first, as
    /// `(expert, weight)`. Softmax over all experts, then the k largest (a tie goes to the
    /// lower expert index), renormalised to sum to one when `norm_topk_prob`.
    pub fn route_token(&mut self, logits: &[f32]) -> Vec<(usize, f32)> {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        self.probs.clear();
        self.probs.extend(logits.iter().map(|&l| (l - max).exp()));
        let z: f32 = self.probs.iter().sum();
        for p in &mut self.probs {
            *p /= z;
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| self.probs[b].total_cmp(&self.probs[a]).then(a.cmp(&b)));
        order.truncate(self.n_active);
        let mut picked: Vec<(usize, f32)> = order.iter().map(|&e| (e, self.probs[e])).collect();
        if self.norm_topk_prob {
            let s: f32 = picked.iter().map(|p| p.1).sum();
            for p in &mut picked {
                p.1 /= s;
            }
        }
        picked
    }

    /// Routes `n` tokens (row-major router logits) and groups them by expert. `counts[e]` is
    /// increased by the number of tokens expert `e` received.
    pub fn route(&mut self, logits: &[f32], n: usize, counts: &mut [u64]) {
        for e in 0..self.n_experts {
            self.tokens[e].clear();
            self.weights[e].clear();
        }
        for t in 0..n {
            let row = &logits[t * self.n_experts..(t + 1) * self.n_experts];
            for (e, w) in self.route_token(row) {
                self.tokens[e].push(t as u32);
                self.weights[e].push(w);
                counts[e] += 1;
            }
        }
    }

    /// The active experts' batches, in expert order.
    pub fn batches(&self) -> Vec<ExpertBatch<'_>> {
        (0..self.n_experts)
            .filter(|&e| !self.tokens[e].is_empty())
            .map(|e| ExpertBatch {
                expert: e,
                tokens: &self.tokens[e],
                weights: &self.weights[e],
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(k: usize, norm: bool) -> MoeConfig {
        MoeConfig {
            n_experts: 4,
            n_active: k,
            expert_ffn: 8,
            norm_topk_prob: norm,
            mlp_only_layers: vec![],
            sparse_step: 1,
        }
    }

    #[test]
    fn top_k_softmax_and_ties_to_the_lower_index() {
        let mut r = Router::new(&cfg(2, false));
        let picked = r.route_token(&[1.0, 3.0, 3.0, 0.0]);
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
        let z = 1f32.exp() + 2.0 * 3f32.exp() + 1.0;
        assert!((picked[0].1 - 3f32.exp() / z).abs() < 1e-6);
        let mut r = Router::new(&cfg(2, true));
        let picked = r.route_token(&[1.0, 3.0, 3.0, 0.0]);
        assert!((picked[0].1 - 0.5).abs() < 1e-6 && (picked[1].1 - 0.5).abs() < 1e-6);
    }

    #[test]
    fn grouping_keeps_token_order_and_counts() {
        let mut r = Router::new(&cfg(1, true));
        let mut counts = vec![0; 4];
        r.route(
            &[0.0, 5.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0],
            3,
            &mut counts,
        );
        assert_eq!(counts, vec![1, 2, 0, 0]);
        let b = r.batches();
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].expert, b[0].tokens), (0, &[1u32][..]));
        assert_eq!((b[1].expert, b[1].tokens), (1, &[0u32, 2][..]));
    }
}
