//! Criterion benches of the hot kernels, per weight format:
//! - `dot/FORMAT`: the best kernel's dot product of one 4096-long weight row with a quantised
//!   activation row (throughput in weight bytes);
//! - `matmul_n1/FORMAT`: a [1024, 4096] weight times one token through the `Backend` trait,
//!   the decode case (throughput in weight bytes: compare with the memory bandwidth);
//! - `matmul_n64/FORMAT`: the same weight times 64 tokens, the prefill case (throughput in
//!   multiply-adds);
//! - `dot_f32`: the f32 dot product (attention, f32 weights).
//! - `peak/…`: the int8 multiply-add peak of each `vpdpbusd` form this CPU runs (register
//!   operands, twelve independent accumulators; and the packed kernels' mix, a broadcast
//!   activation word from memory per instruction), and of AVX2's two mixes (`maddubs` summed
//!   in i16 as the 4-, 5- and 6-bit kernels do; `sign` + `maddubs` + `madd` as Q8_0's does),
//!   in int8 operations (multiply and add counted apart): what prefill's share of the peak is
//!   measured against.
//!
//! `cargo bench -p ferrum-backend --bench kernels` runs all (about two minutes);
//! `cargo bench -p ferrum-backend --bench kernels -- 'matmul_n1/Q4_K'` one. Short measurement
//! times keep the whole run quick; for a figure to quote, rerun the bench of interest on a
//! quiet machine with `--measurement-time 10`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferrum_backend::cpu::quant::q8::{quantize_q8, quantize_q8k, BlockQ8, BlockQ8K};
use ferrum_backend::cpu::quant::{best_kernel, Kernel, Recoded};
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
    // The forms the CPU re-encodes files into at load, as the matmuls below read them.
    for &dt in FORMATS {
        let Some(form) = Recoded::of(dt) else {
            continue;
        };
        let mut w = Aligned::new(&random_blocks(&mut rng, dt, K));
        assert!(form.recode(w.bytes_mut()), "whole blocks");
        let w = w.bytes();
        let x = activations(&mut rng, K);
        g.throughput(Throughput::Bytes(w.len() as u64));
        let Kernel::Q8K { dot, .. } = form.best_kernel() else {
            panic!("{form:?}: the re-encoded forms are all super-block formats");
        };
        let mut a = vec![BlockQ8K::default(); K / 256];
        quantize_q8k(&x, &mut a);
        g.bench_function(BenchmarkId::from_parameter(format!("{dt}-recoded")), |b| {
            b.iter(|| dot(black_box(w), black_box(&a)))
        });
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

/// `vpdpbusd` throughput: `ACC` independent accumulators, `iters` rounds. Returns the
/// accumulators' sum, which [`peak_scalar`] computes too (the check that the loop ran).
#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;

    pub const ACC: usize = 12;

    /// 512-bit, register operands.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn zmm(iters: usize, u: u8, s: i8) -> i64 {
        let (a, b) = (_mm512_set1_epi8(u as i8), _mm512_set1_epi8(s));
        let mut acc = [_mm512_setzero_si512(); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_dpbusd_epi32(*x, a, b);
            }
        }
        let mut t = 0i64;
        for x in acc {
            t += _mm512_reduce_add_epi32(x) as i64;
        }
        t
    }

    /// 512-bit with the packed kernels' operand: one activation word broadcast from memory
    /// per instruction (`words` cycles through a small buffer, as the kernels' do).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn zmm_bcast(iters: usize, u: u8, words: &[i32; ACC]) -> i64 {
        let a = _mm512_set1_epi8(u as i8);
        let mut acc = [_mm512_setzero_si512(); ACC];
        for _ in 0..iters {
            for (i, x) in acc.iter_mut().enumerate() {
                let w = std::ptr::read_volatile(words.as_ptr().add(i));
                *x = _mm512_dpbusd_epi32(*x, a, _mm512_set1_epi32(w));
            }
        }
        let mut t = 0i64;
        for x in acc {
            t += _mm512_reduce_add_epi32(x) as i64;
        }
        t
    }

    /// AVX2's mix in the packed 4- and 5-bit kernels: `maddubs` of the weights with one
    /// activation word broadcast from memory, summed in i16, widened to i32 by `madd` every
    /// eight rounds (as the Q4_K kernel widens each eight-vector sub-block).
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs(iters: usize, u: u8, words: &[i32; ACC]) -> i64 {
        const A: usize = 6;
        let (a, ones) = (_mm256_set1_epi8(u as i8), _mm256_set1_epi16(1));
        let mut s16 = [_mm256_setzero_si256(); A];
        let mut s32 = [_mm256_setzero_si256(); A];
        for round in 0..iters {
            // An opaque pointer each round: the words are loaded again, each load folded into
            // its broadcast as in the kernels (a volatile read would not be).
            let p = std::hint::black_box(words.as_ptr());
            for (i, x) in s16.iter_mut().enumerate() {
                let w = p.add(i).read();
                *x = _mm256_add_epi16(*x, _mm256_maddubs_epi16(a, _mm256_set1_epi32(w)));
            }
            if round % 8 == 7 {
                for (x, y) in s16.iter_mut().zip(s32.iter_mut()) {
                    *y = _mm256_add_epi32(*y, _mm256_madd_epi16(*x, ones));
                    *x = _mm256_setzero_si256();
                }
            }
        }
        lanes_sum(&s32)
    }

    /// AVX2's mix in the packed Q8_0 kernel: the weight's sign moved onto the broadcast
    /// activation word (`sign`), `maddubs` with the weight's magnitude, `madd` to i32 at once
    /// (two pair sums of 8-bit products can overflow i16), then the i32 add.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs_madd(iters: usize, u: u8, words: &[i32; ACC]) -> i64 {
        const A: usize = 8;
        let (x, ones) = (_mm256_set1_epi8(u as i8), _mm256_set1_epi16(1));
        let ax = _mm256_sign_epi8(x, x);
        let mut s32 = [_mm256_setzero_si256(); A];
        for _ in 0..iters {
            let p = std::hint::black_box(words.as_ptr());
            for (i, acc) in s32.iter_mut().enumerate() {
                let w = p.add(i).read();
                let y = _mm256_sign_epi8(_mm256_set1_epi32(w), x);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, y), ones);
                *acc = _mm256_add_epi32(*acc, p);
            }
        }
        lanes_sum(&s32)
    }

    #[target_feature(enable = "avx2")]
    unsafe fn lanes_sum(v: &[__m256i]) -> i64 {
        let mut t = 0i64;
        for &x in v {
            let mut l = [0i32; 8];
            _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, x);
            t += l.iter().map(|&v| v as i64).sum::<i64>();
        }
        t
    }

    /// 256-bit (the EVEX form; the VEX AVX-VNNI one is the same instruction).
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn ymm(iters: usize, u: u8, s: i8) -> i64 {
        let (a, b) = (_mm256_set1_epi8(u as i8), _mm256_set1_epi8(s));
        let mut acc = [_mm256_setzero_si256(); ACC];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_dpbusd_epi32(*x, a, b);
            }
        }
        let mut t = 0i64;
        for x in acc {
            let mut l = [0i32; 8];
            _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, x);
            t += l.iter().map(|&v| v as i64).sum::<i64>();
        }
        t
    }
}

/// The scalar twin of the peak loops: `lanes` i32 lanes, each four u8 × i8 products per round.
fn peak_scalar(iters: usize, lanes: usize, u: u8, s: [i8; 4]) -> i64 {
    let per_round: i64 = s.iter().map(|&b| u as i64 * b as i64).sum();
    // Every lane's i32 sum stays in range for the iteration counts used here.
    per_round * iters as i64 * lanes as i64
}

fn bench_peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    {
        use peak::ACC;
        let vnni512 = std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni");
        let vnni256 = vnni512 && std::is_x86_feature_detected!("avx512vl");
        let iters = 4096;
        let mut g = c.benchmark_group("peak");
        if vnni512 {
            let (u, s) = (3u8, -2i8);
            let words = [i32::from_le_bytes([s as u8; 4]); ACC];
            // SAFETY: the features checked above.
            let (r, rb) = unsafe { (peak::zmm(iters, u, s), peak::zmm_bcast(iters, u, &words)) };
            let want = peak_scalar(iters, 16 * ACC, u, [s; 4]);
            assert_eq!(
                (r, rb),
                (want, want),
                "the peak loops disagree with their scalar twin"
            );
            g.throughput(Throughput::Elements((iters * ACC * 64 * 2) as u64));
            g.bench_function("vpdpbusd_zmm", |b| {
                // SAFETY: as above.
                b.iter(|| unsafe { peak::zmm(black_box(iters), 3, -2) })
            });
            g.bench_function("vpdpbusd_zmm_m32bcst", |b| {
                // SAFETY: as above.
                b.iter(|| unsafe { peak::zmm_bcast(black_box(iters), 3, &words) })
            });
        }
        if vnni256 {
            // SAFETY: the features checked above.
            let r = unsafe { peak::ymm(iters, 3, -2) };
            assert_eq!(r, peak_scalar(iters, 8 * ACC, 3, [-2; 4]));
            g.throughput(Throughput::Elements((iters * ACC * 32 * 2) as u64));
            g.bench_function("vpdpbusd_ymm", |b| {
                // SAFETY: as above.
                b.iter(|| unsafe { peak::ymm(black_box(iters), 3, -2) })
            });
        }
        if !vnni512 {
            eprintln!("peak: this CPU runs no AVX512-VNNI; no VNNI peak measured");
        }
        if std::is_x86_feature_detected!("avx2") {
            // Six and eight accumulators: the most whose sums, operands and constants fit
            // AVX2's sixteen registers.
            let (u, s) = (3u8, -2i8);
            let words = [i32::from_le_bytes([s as u8; 4]); ACC];
            // SAFETY: AVX2 checked just above.
            let (r, rq) = unsafe {
                (
                    peak::maddubs(iters, u, &words),
                    peak::maddubs_madd(iters, u, &words),
                )
            };
            assert_eq!(r, peak_scalar(iters, 8 * 6, u, [s; 4]));
            assert_eq!(rq, peak_scalar(iters, 8 * 8, u, [s; 4]));
            g.throughput(Throughput::Elements((iters * 6 * 32 * 2) as u64));
            g.bench_function("avx2_maddubs_m32bcst", |b| {
                // SAFETY: as above.
                b.iter(|| unsafe { peak::maddubs(black_box(iters), 3, &words) })
            });
            g.throughput(Throughput::Elements((iters * 8 * 32 * 2) as u64));
            g.bench_function("avx2_maddubs_madd_m32bcst", |b| {
                // SAFETY: as above.
                b.iter(|| unsafe { peak::maddubs_madd(black_box(iters), 3, &words) })
            });
        }
        // The AMX tiles' mix in the prefill kernels: two token tiles by two weight tiles
        // (`dot_pairs`, its four tiles loaded from L1 each round), four `tdpbsud` a round.
        if ferrum_backend::cpu::quant::amx::hardware() {
            use ferrum_backend::cpu::quant::amx::{Amx, Config, Tiles};
            let a = vec![3u8; 2 * 1024];
            let w = vec![2u8; 2 * 1024];
            let rounds = |iters: usize| {
                let mut c = vec![0i32; 1024];
                // SAFETY: `hardware` said the tiles run here; every buffer is the size its
                // operation reads or writes.
                unsafe {
                    let t = &mut Amx;
                    t.configure(&Config::full());
                    t.zero_c();
                    for _ in 0..iters {
                        t.dot_pairs(
                            a.as_ptr(),
                            64,
                            a.as_ptr().add(1024),
                            64,
                            w.as_ptr(),
                            w.as_ptr().add(1024),
                        );
                    }
                    t.store_c(c.as_mut_ptr(), 4);
                    t.release();
                }
                c
            };
            // Each round adds 64 products of 3 by 2 to every sum.
            assert!(
                rounds(iters).iter().all(|&x| x as usize == iters * 64 * 6),
                "the tile loop disagrees with its scalar sum"
            );
            g.throughput(Throughput::Elements((iters * 4 * 16 * 16 * 64 * 2) as u64));
            g.bench_function("tdpbsud_2x2", |b| b.iter(|| rounds(black_box(iters))));
        } else {
            eprintln!("peak: this CPU (or OS) runs no AMX-INT8; no tile peak measured");
        }
        g.finish();
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = c;
}

criterion_group! {
    name = kernels;
    // Command-line options (`--measurement-time`, `--sample-size`) override these.
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);
    targets = bench_peak, bench_dot, bench_dot_f32, bench_matmul
}
criterion_main!(kernels);
