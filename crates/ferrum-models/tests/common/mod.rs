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
