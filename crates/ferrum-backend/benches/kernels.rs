//! Criterion benches of the hot kernels, per weight format:
//! - `dot/FORMAT`: the best kernel's dot product of one 4096-long weight row with a quantised
//!   activation row (throughput in weight bytes);
//! - `matmul_n1/FORMAT`: a [1024, 4096] weight times one token through the `Backend` trait,
//!   the decode case (throughput in weight bytes: compare with the memory bandwidth);
//! - `matmul_n64/FORMAT`: the same weight times 64 tokens, the prefill case (throughput in
//!   multiply-adds);
//! - `dot_f32`: the f32 dot product (attention, f32 weights).
//!
//! `cargo bench -p ferrum-backend --bench kernels` runs all (about two minutes);
//! `cargo bench -p ferrum-backend --bench kernels -- 'matmul_n1/Q4_K'` one. Short measurement
//! times keep the whole run quick; for a figure to quote, rerun the bench of interest on a
//! quiet machine with `--measurement-time 10`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferrum_backend::cpu::quant::q8::{quantize_q8, quantize_q8k, BlockQ8, BlockQ8K};
use ferrum_backend::cpu::quant::{best_kernel, Kernel};
use ferrum_backend::cpu::simd::dot_f32;
use ferrum_backend::{Backend, CpuBackend, Rows};
use ferrum_loader::RawTensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Row length of every bench (a typical hidden size).
const K: usize = 4096;
/// Output rows of the matmul benches.
const ROWS: usize = 1024;

#[path = "../tests/common/blocks.rs"]
mod blocks;
use blocks::{random_blocks, Aligned, FORMATS};

fn activations(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

fn bench_dot(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let mut g = c.benchmark_group("dot");
    for &dt in FORMATS {
        let w = Aligned::new(&random_blocks(&mut rng, dt, K));
        let w = w.bytes();
        let x = activations(&mut rng, K);
        g.throughput(Throughput::Bytes(w.len() as u64));
        match best_kernel(dt).expect("every block format has a kernel") {
            Kernel::Q8 { dot, .. } => {
                let mut a = vec![BlockQ8::default(); K / 32];
                quantize_q8(&x, &mut a);
                g.bench_function(BenchmarkId::from_parameter(dt), |b| {
                    b.iter(|| dot(black_box(w), black_box(&a)))
                });
            }
            Kernel::Q8K { dot, .. } => {
                let mut a = vec![BlockQ8K::default(); K / 256];
                quantize_q8k(&x, &mut a);
                g.bench_function(BenchmarkId::from_parameter(dt), |b| {
                    b.iter(|| dot(black_box(w), black_box(&a)))
                });
            }
        }
    }
    g.finish();
}

fn bench_dot_f32(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(2);
    let a = activations(&mut rng, K);
    let b = activations(&mut rng, K);
    let mut g = c.benchmark_group("dot_f32");
    g.throughput(Throughput::Bytes((2 * 4 * K) as u64));
    g.bench_function(BenchmarkId::from_parameter(K), |bch| {
        bch.iter(|| dot_f32(black_box(&a), black_box(&b)))
    });
    g.finish();
}

fn bench_matmul(c: &mut Criterion) {
    let be = CpuBackend::new();
    let mut rng = StdRng::seed_from_u64(3);
    // One token (decode), four (a decode batch of four streams), 64 (a prefill chunk).
    for n in [1usize, 4, 64] {
        let mut g = c.benchmark_group(format!("matmul_n{n}"));
        let x_data = activations(&mut rng, n * K);
        let mut x = be.alloc(n * K);
        be.write(&mut x, 0, &x_data);
        let mut out = be.alloc(n * ROWS);
        for &dt in FORMATS {
            let bytes = random_blocks(&mut rng, dt, ROWS * K);
            let n_bytes = bytes.len();
            let raw = RawTensor::from_bytes("w", dt, vec![ROWS, K], bytes).expect("sizes match");
            let w = be.load_weight(&raw).expect("weight loads");
            g.throughput(if n == 1 {
                Throughput::Bytes(n_bytes as u64)
            } else {
                Throughput::Elements((n * ROWS * K) as u64)
            });
            g.bench_function(BenchmarkId::from_parameter(dt), |b| {
                b.iter(|| {
                    be.matmul(
                        black_box(&x),
                        Rows::dense(n, K),
                        &w,
                        None,
                        &mut out,
                        Rows::dense(n, ROWS),
                    )
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = kernels;
    // Command-line options (`--measurement-time`, `--sample-size`) override these.
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);
    targets = bench_dot, bench_dot_f32, bench_matmul
}
criterion_main!(kernels);
