//! Helpers shared by the golden-logit tests.

#![allow(dead_code)] // each test binary uses its own subset

/// Index of the largest logit; the lowest index wins a tie.
pub fn argmax(r: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in r.iter().enumerate() {
        if x > r[best] {
            best = i;
        }
    }
    best as u32
}

/// The logits of every position of `tokens`, one pass with a 64-token context, one row per
/// position.
pub fn logits_all<B: ferrum_backend::Backend>(
    be: B,
    path: &std::path::Path,
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    use ferrum_models::{LoadOptions, Logits, Model};
    let mut m = Model::open(
        path,
        be,
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut kv = m.decoder.alloc_kv_tokens(64);
    let v = m.decoder.config.vocab_size;
    let all = m
        .decoder
        .forward(&mut kv, tokens, 0, Logits::All)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    all.chunks(v).map(|r| r.to_vec()).collect()
}

/// Every position within `1e-4 × max|logit|` of the reference; prints the worst ratio.
pub fn assert_close(label: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{label}: positions");
    let mut worst = 0f32;
    for (pos, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{label}: vocabulary size");
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff / scale);
        assert!(
            diff <= 1e-4 * scale,
            "{label}: position {pos}: max |Δlogit| {diff} > 1e-4 × {scale}"
        );
    }
    eprintln!("{label}: worst relative |Δlogit| {worst:.2e}");
}

/// Teacher-forced over `tokens` on the model at `path`: the share of positions whose argmax is
/// the reference's (`argmax[i]` predicts token `i + 1`), and the perplexity of the passage.
pub fn score_passage(
    path: &std::path::Path,
    be: ferrum_backend::CpuBackend,
    tokens: &[u32],
    reference_argmax: &[u32],
) -> (f64, f64) {
    use ferrum_models::{LoadOptions, Logits, Model};
    let mut m = Model::open(
        path,
        be,
        &LoadOptions {
            context: Some(512),
            ..Default::default()
        },
    )
    .unwrap();
    let v = m.decoder.config.vocab_size;
    let mut kv = m.decoder.alloc_kv_tokens(512);
    let logits = m.decoder.forward(&mut kv, tokens, 0, Logits::All).unwrap();
    let (mut agree, mut nll) = (0, 0f64);
    let n = tokens.len() - 1;
    for (pos, row) in logits.chunks(v).take(n).enumerate() {
        let best = argmax(row);
        agree += (best == reference_argmax[pos]) as usize;
        let max = row[best as usize] as f64;
        let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
        nll -= row[tokens[pos + 1] as usize] as f64 - max - z.ln();
    }
    (agree as f64 / n as f64, (nll / n as f64).exp())
}

/// Checks a teacher-forced run against its reference: top-1 agreement of at least `min_top1`
/// and a perplexity within `max_rel_ppl` of the reference's (printed either way).
#[allow(clippy::too_many_arguments)]
pub fn check_passage(
    label: &str,
    path: &std::path::Path,
    be: ferrum_backend::CpuBackend,
    tokens: &[u32],
    reference_argmax: &[u32],
    reference_ppl: f64,
    min_top1: f64,
    max_rel_ppl: f64,
) {
    let (top1, ppl) = score_passage(path, be, tokens, reference_argmax);
    let rel = (ppl - reference_ppl) / reference_ppl;
    eprintln!(
        "{label}, {} positions: top-1 agreement {:.1}%, perplexity {ppl:.4} vs reference {reference_ppl:.4} ({:+.3}%)",
        tokens.len() - 1,
        100.0 * top1,
        100.0 * rel
    );
    assert!(top1 >= min_top1, "{label}: top-1 agreement {top1}");
    assert!(
        rel.abs() <= max_rel_ppl,
        "{label}: perplexity {ppl} vs {reference_ppl}"
    );
}

/// Distance of one run from the exact logits.
#[derive(Clone, Copy, Debug)]
pub struct Distance {
    pub max: f64,
    pub p90: f64,
    pub argmax: f64,
}

impl std::fmt::Display for Distance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max {:.2e} p90 {:.2e} argmax {:.3}",
            self.max, self.p90, self.argmax
        )
    }
}

/// Per position `max|Δ| / max|want|`; the maximum, numpy's default (linear) 90th percentile, and
/// the share of positions whose argmax is `want`'s.
pub fn distance(got: &[Vec<f32>], want: &[Vec<f32>]) -> Distance {
    assert_eq!(got.len(), want.len(), "positions");
    let mut per: Vec<f64> = got
        .iter()
        .zip(want)
        .map(|(g, w)| {
            assert_eq!(g.len(), w.len(), "vocabulary size");
            let scale = w.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            let diff = g
                .iter()
                .zip(w)
                .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
            diff / scale
        })
        .collect();
    let agree = got
        .iter()
        .zip(want)
        .filter(|(g, w)| argmax(g) == argmax(w))
        .count();
    per.sort_by(f64::total_cmp);
    let rank = 0.9 * (per.len() - 1) as f64;
    let (lo, frac) = (rank.floor() as usize, rank.fract());
    let p90 = per[lo] + frac * (per[(lo + 1).min(per.len() - 1)] - per[lo]);
    Distance {
        max: per[per.len() - 1],
        p90,
        argmax: agree as f64 / got.len() as f64,
    }
}

/// A JSON reference file, parsed.
pub fn read_json(p: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// A JSON array of numbers as f32.
pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// A JSON array of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON array of strings.
pub fn texts(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect()
}
