//! Three-way kernel tests per weight format: the SIMD kernel equals its scalar twin, and both
//! are within the bound set by 8-bit activation rounding of the f32 reference (the
//! dequantised weights times the unquantised activations).

use ferrum_backend::cpu::quant::q8::{quantize_q8, quantize_q8k, BlockQ8, BlockQ8K};
use ferrum_backend::cpu::quant::{
    best_kernel, dequantize, iq_tile, scalar_kernel, Dot2x4, Kernel, Recoded,
};
use rand::{Rng, SeedableRng};

mod common;
use common::blocks::{random_blocks, Aligned, FORMATS, IQUANTS};

/// An activation block format, as these tests quantise and bound it.
trait ActFormat: Clone + Default + 'static {
    /// Values per block.
    const BLOCK: usize;
    fn quantize(x: &[f32], out: &mut [Self]);
    /// The block's scale: each value's rounding error is at most half of it.
    fn scale(&self) -> f32;

    /// `x` quantised, in blocks of [`Self::BLOCK`] values.
    fn blocks(x: &[f32]) -> Vec<Self> {
        let mut a = vec![Self::default(); x.len() / Self::BLOCK];
        Self::quantize(x, &mut a);
        a
    }
}

impl ActFormat for BlockQ8 {
    const BLOCK: usize = 32;
    fn quantize(x: &[f32], out: &mut [Self]) {
        quantize_q8(x, out)
    }
    fn scale(&self) -> f32 {
        self.d
    }
}

impl ActFormat for BlockQ8K {
    const BLOCK: usize = 256;
    fn quantize(x: &[f32], out: &mut [Self]) {
        quantize_q8k(x, out)
    }
    fn scale(&self) -> f32 {
        self.d
    }
}

/// A SIMD kernel's four shapes over one activation format.
struct Shapes<A: 'static> {
    dot: fn(&[u8], &[A]) -> f32,
    dot4: fn(&[u8], [&[A]; 4]) -> [f32; 4],
    rows4: fn([&[u8]; 4], &[A]) -> [f32; 4],
    dot2x4: Dot2x4<A>,
}

/// A kernel's shapes, if its activations are the format of `Kernel::$variant`.
macro_rules! shapes {
    ($k:expr, $variant:ident) => {
        match $k {
            Kernel::$variant {
                dot,
                dot4,
                rows4,
                dot2x4,
            } => Some(Shapes {
                dot,
                dot4,
                rows4,
                dot2x4,
            }),
            _ => None,
        }
    };
}

impl<A: ActFormat> Shapes<A> {
    /// Quantises `x`, checks that the four-token, four-row and two-by-four kernels give each
    /// (row, token) exactly the one-token result, and returns the scalar twin's and this
    /// kernel's dot with the bound of the activations' rounding.
    fn run(
        &self,
        dt: impl std::fmt::Display,
        w: &[u8],
        wf: &[f32],
        x: &[f32],
        scalar: fn(&[u8], &[A]) -> f32,
    ) -> (f32, f32, f64) {
        let a = &A::blocks(x)[..];
        let one = (self.dot)(w, a).to_bits();
        let x4 = (self.dot4)(w, [a, a, a, a]);
        assert!(x4.iter().all(|v| v.to_bits() == one), "{dt}: dot4");
        let r4 = (self.rows4)([w, w, w, w], a);
        assert!(r4.iter().all(|v| v.to_bits() == one), "{dt}: rows4");
        let t = (self.dot2x4)([w, w], [a, a, a, a]);
        assert!(
            t.iter().flatten().all(|v| v.to_bits() == one),
            "{dt}: dot2x4"
        );
        let bound = rounding_bound(wf, A::BLOCK, a.iter().map(A::scale));
        (scalar(w, a), (self.dot)(w, a), bound)
    }
}

impl<A: ActFormat> Shapes<A> {
    /// The four-row and two-by-four kernels on four different rows (and four different
    /// tokens): each (row, token) gets the one-token kernel's bits for that row and token.
    fn check_distinct_rows(&self, dt: impl std::fmt::Display, w: [&[u8]; 4], x: [&[f32]; 4]) {
        let a = x.map(A::blocks);
        let a: [&[A]; 4] = std::array::from_fn(|t| &a[t][..]);
        let r4 = (self.rows4)(w, a[1]);
        for r in 0..4 {
            assert_eq!(
                r4[r].to_bits(),
                (self.dot)(w[r], a[1]).to_bits(),
                "{dt}: rows4 row {r}"
            );
        }
        let t = (self.dot2x4)([w[2], w[0]], a);
        for (r, row) in [w[2], w[0]].iter().enumerate() {
            for tok in 0..4 {
                let one = (self.dot)(row, a[tok]).to_bits();
                assert_eq!(t[r][tok].to_bits(), one, "{dt}: dot2x4 row {r} token {tok}");
            }
        }
    }
}

/// Every format's best kernel on four different weight rows: the multi-row shapes keep each
/// row's own scales and sums (the test above gives them one row four times).
#[test]
fn multi_row_kernels_keep_each_rows_bits() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    for &dt in FORMATS {
        for trial in 0..6 {
            let n = 512 * (1 + trial % 3);
            let w: Vec<Aligned> = (0..4)
                .map(|_| Aligned::new(&random_blocks(&mut rng, dt, n)))
                .collect();
            let w: [&[u8]; 4] = std::array::from_fn(|r| w[r].bytes());
            let x: Vec<Vec<f32>> = (0..4)
                .map(|_| (0..n).map(|_| rng.gen_range(-4.0..4.0)).collect())
                .collect();
            let x: [&[f32]; 4] = std::array::from_fn(|t| &x[t][..]);
            let best = best_kernel(dt).unwrap();
            if let Some(f) = shapes!(best, Q8) {
                f.check_distinct_rows(dt, w, x);
            } else if let Some(f) = shapes!(best, Q8K) {
                f.check_distinct_rows(dt, w, x);
            }
        }
    }
}

/// |Σ w (x - x̂)| ≤ Σ_blocks Σ|w| · d/2, for activation blocks of `block` values and scales `d`.
fn rounding_bound(wf: &[f32], block: usize, d: impl Iterator<Item = f32>) -> f64 {
    wf.chunks(block)
        .zip(d)
        .map(|(wb, d)| wb.iter().map(|v| v.abs() as f64).sum::<f64>() * d as f64 * 0.5)
        .sum()
}

#[test]
fn simd_equals_scalar_and_both_approximate_f32() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    for &dt in FORMATS {
        for trial in 0..20 {
            let n = 512 * (1 + trial % 3);
            let wa = Aligned::new(&random_blocks(&mut rng, dt, n));
            let w = wa.bytes();
            let scale = if trial % 2 == 0 { 1.0 } else { 30.0 };
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
            let mut wf = vec![0f32; n];
            assert!(dequantize(dt, w, &mut wf));
            let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let (scalar, best) = (scalar_kernel(dt).unwrap(), best_kernel(dt).unwrap());
            let (scalar, fast, bound) =
                if let (Some(s), Some(f)) = (shapes!(scalar, Q8), shapes!(best, Q8)) {
                    f.run(dt, w, &wf, &x, s.dot)
                } else if let (Some(s), Some(f)) = (shapes!(scalar, Q8K), shapes!(best, Q8K)) {
                    f.run(dt, w, &wf, &x, s.dot)
                } else {
                    panic!("{dt}: scalar and SIMD kernels disagree on the activation format")
                };
            let mag: f64 = wf
                .iter()
                .zip(&x)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            assert!(
                ((scalar - fast) as f64).abs() <= 1e-5 * mag.max(1e-3),
                "{dt} trial {trial}: simd {fast} vs scalar {scalar}"
            );
            let slack = 1e-5 * mag + 1e-6;
            assert!(
                (scalar as f64 - exact).abs() <= bound + slack,
                "{dt} trial {trial}: scalar {scalar} vs f32 {exact}, bound {bound}"
            );
        }
    }
}

/// `count` tokens of `n` values quantised to Q8_K, token t's values within ±0.01, ±1 or ±100
/// by `(trial + t) % 3`: magnitudes small and large.
fn q8k_tokens(rng: &mut impl Rng, count: usize, n: usize, trial: usize) -> Vec<Vec<BlockQ8K>> {
    (0..count)
        .map(|t| {
            let scale = [0.01, 1.0, 100.0][(trial + t) % 3];
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
            let mut a = vec![BlockQ8K::default(); n / 256];
            quantize_q8k(&x, &mut a);
            a
        })
        .collect()
}

/// A codebook format's prefill tile (rows decoded once into bytes, sixteen tokens a pass)
/// gives every (row, token) the scalar row kernel's bits, in the instance the process picked,
/// the scalar twin and every SIMD instance this CPU runs; its SIMD decoding equals the twin's.
/// Ragged tiles: 1 to 8 rows, 1 to 16 tokens (the rest zero, in a reused buffer), activations
/// small and large.
#[test]
fn codebook_tile_gives_the_row_kernel_bits() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    let mut toks = iq_tile::Tokens::default();
    for &dt in FORMATS.iter().filter(|&&dt| iq_tile::takes(dt)) {
        let Some(Kernel::Q8K { dot: s, .. }) = scalar_kernel(dt) else {
            panic!("{dt}: Q8_K kernel")
        };
        for trial in 0..12 {
            let n = 256 * (1 + trial % 4);
            let rows = [8, 1, 3, 8, 5, 7][trial % 6];
            let tokens = [16, 1, 9, 16, 15, 2][(trial + 1) % 6];
            let w: Vec<Aligned> = (0..rows)
                .map(|_| Aligned::new(&random_blocks(&mut rng, dt, n)))
                .collect();
            let wr: Vec<&[u8]> = w.iter().map(|w| w.bytes()).collect();
            let acts = q8k_tokens(&mut rng, tokens, n, trial);
            let mut decoded = iq_tile::Rows::default();
            assert!(
                iq_tile::decode_rows(dt, &wr, &mut decoded),
                "{dt}: decode_rows"
            );
            let mut twin = iq_tile::Rows::default();
            assert!(iq_tile::decode_rows_scalar(dt, &wr, &mut twin));
            assert!(
                decoded == twin,
                "{dt} trial {trial}: decoding differs from its twin"
            );
            // One buffer for every trial, as a thread's is reused: what an earlier trial
            // left in it must not reach the padding tokens.
            toks.reset(tokens, n / 256);
            for (t, a) in acts.iter().enumerate() {
                toks.put(t, a);
            }
            assert_eq!(toks.count(), 1);
            let block = toks.block(0);
            let mut runs = vec![("picked", iq_tile::dot(&decoded, block))];
            runs.push(("scalar", iq_tile::dot_scalar(&decoded, block)));
            #[cfg(target_arch = "x86_64")]
            {
                use ferrum_backend::cpu::quant::packed::Isa;
                if Isa::Avx2.runs() {
                    // SAFETY: AVX2, FMA and F16C run here.
                    runs.push(("avx2", unsafe { iq_tile::avx2::dot(&decoded, block) }));
                }
                if Isa::Avx512Vnni.runs() {
                    // SAFETY: AVX512-F/BW/VNNI run here.
                    runs.push(("avx512", unsafe { iq_tile::avx512::dot(&decoded, block) }));
                } else {
                    eprintln!("{dt}: the AVX-512 tile is not checked on this CPU");
                }
            }
            for (name, got) in &runs {
                for r in 0..iq_tile::ROWS {
                    for t in 0..iq_tile::TOKENS {
                        let want = if r < rows && t < tokens {
                            s(wr[r], &acts[t])
                        } else {
                            0.0
                        };
                        assert_eq!(
                            got[r][t].to_bits(),
                            want.to_bits(),
                            "{dt} trial {trial} {name} row {r} token {t}: {} vs {want}",
                            got[r][t]
                        );
                    }
                }
            }
        }
    }
}

/// Q2_K and Q3_K, which the prefill tile takes as codebooks: the generic codebook kernel over
/// their `Codebook` side (groups, scales, Q2_K's minimums) gives `k_quants`' own kernels' bits.
#[test]
fn k_quants_as_codebooks_give_their_kernels_bits() {
    use ferrum_backend::cpu::quant::iq_grid::{self, BlockQ2K, BlockQ3K, Codebook};
    use ferrum_backend::cpu::quant::{cast_blocks, k_quants};
    use ferrum_core::DType;
    fn check<B: Codebook>(
        rng: &mut rand::rngs::StdRng,
        dt: DType,
        own: fn(&[B], &[BlockQ8K]) -> f32,
    ) {
        for trial in 0..16 {
            let n = 256 * (1 + trial % 3);
            let w = Aligned::new(&random_blocks(rng, dt, n));
            let w: &[B] = cast_blocks(w.bytes()).expect("whole, aligned blocks");
            for a in q8k_tokens(rng, 2, n, trial) {
                let (got, want) = (iq_grid::vec_dot(w, &a), own(w, &a));
                assert_eq!(got.to_bits(), want.to_bits(), "{dt} trial {trial}");
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    check::<BlockQ2K>(&mut rng, DType::Q2K, k_quants::vec_dot_q2k);
    check::<BlockQ3K>(&mut rng, DType::Q3K, k_quants::vec_dot_q3k);
}

/// Each form the CPU re-encodes a file format into at load gives the file form's bits
/// everywhere it is read: dequantisation, the scalar kernel and the best kernel this CPU runs
/// (one token and four), and the prefill tile's decoding (SIMD and twin). Rows of one to six
/// super-blocks of random blocks, which cover every sign field and scale.
#[test]
fn recoded_forms_give_the_file_forms_bits() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    for &form in Recoded::ALL {
        let dt = form.dtype();
        let Some(Kernel::Q8K { dot: file_dot, .. }) = scalar_kernel(dt) else {
            panic!("{dt}: Q8_K kernel")
        };
        let kernels = [
            ("scalar", form.scalar_kernel()),
            ("best", form.best_kernel()),
        ];
        for trial in 0..24 {
            let n = 256 * (1 + trial % 6);
            let file = Aligned::new(&random_blocks(&mut rng, dt, n));
            let mut recoded = Aligned::new(file.bytes());
            assert!(form.recode(recoded.bytes_mut()), "{form:?}: whole blocks");
            assert_ne!(
                file.bytes(),
                recoded.bytes(),
                "{form:?}: nothing re-encoded"
            );
            let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
            assert!(dequantize(dt, file.bytes(), &mut want));
            assert!(form.dequantize(recoded.bytes(), &mut got));
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{form:?} trial {trial}: dequantisation differs"
            );
            let acts = q8k_tokens(&mut rng, 4, n, trial);
            let a4 = [&acts[0][..], &acts[1], &acts[2], &acts[3]];
            for (name, k) in &kernels {
                let Kernel::Q8K { dot, dot4, .. } = k else {
                    panic!("{form:?} {name}: Q8_K kernel")
                };
                let four = dot4(recoded.bytes(), a4);
                for (t, a) in acts.iter().enumerate() {
                    let want = file_dot(file.bytes(), a);
                    let one = dot(recoded.bytes(), a);
                    assert_eq!(
                        (one.to_bits(), four[t].to_bits()),
                        (want.to_bits(), want.to_bits()),
                        "{form:?} trial {trial} {name} token {t}: {one} / {} vs {want}",
                        four[t]
                    );
                }
            }
            let rows = 1 + trial % iq_tile::ROWS;
            let w: Vec<Aligned> = (0..rows)
                .map(|_| Aligned::new(&random_blocks(&mut rng, dt, n)))
                .collect();
            let mut r: Vec<Aligned> = w.iter().map(|w| Aligned::new(w.bytes())).collect();
            for r in &mut r {
                assert!(form.recode(r.bytes_mut()));
            }
            let wr: Vec<&[u8]> = w.iter().map(|w| w.bytes()).collect();
            let rr: Vec<&[u8]> = r.iter().map(|r| r.bytes()).collect();
            let (mut want, mut got, mut twin) = Default::default();
            assert!(iq_tile::decode_rows(dt, &wr, &mut want));
            assert!(iq_tile::decode_recoded_rows(form, &rr, &mut got));
            assert!(iq_tile::decode_recoded_rows_scalar(form, &rr, &mut twin));
            assert!(
                got == want && twin == want,
                "{form:?} trial {trial}: the tile's decoding differs"
            );
        }
    }
}

/// Every K-quant's four-token kernel gives each of four different tokens the one-token
/// kernel's bits. Q2_K and Q3_K's AVX2 kernels keep exact integer sums and the scalar kernel's
/// per-block float arithmetic, so they also give its very bits (a stronger check than the
/// shared tolerance above), over activations large and small.
#[test]
fn k_quant_four_token_kernels_give_each_token_the_one_token_bits() {
    use ferrum_core::DType;
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    // Every format on 8-bit super-block activations (the K-quants, IQ4_XS, the codebooks).
    let q8k = FORMATS
        .iter()
        .filter(|&&dt| matches!(scalar_kernel(dt), Some(Kernel::Q8K { .. })));
    for &dt in q8k {
        // Kernels that keep exact integer sums and the scalar kernel's float steps.
        let exact = !matches!(dt, DType::Q4K | DType::Q5K | DType::Q6K);
        let (
            Some(Kernel::Q8K { dot: s, .. }),
            Some(Kernel::Q8K {
                dot: f, dot4: f4, ..
            }),
        ) = (scalar_kernel(dt), best_kernel(dt))
        else {
            panic!("{dt}: Q8_K kernels")
        };
        for trial in 0..50 {
            let n = 256 * (1 + trial % 6);
            let wa = Aligned::new(&random_blocks(&mut rng, dt, n));
            // Four different tokens, of magnitudes small and large.
            let acts = q8k_tokens(&mut rng, 4, n, trial);
            let w = wa.bytes();
            let four = f4(w, [&acts[0], &acts[1], &acts[2], &acts[3]]);
            for (t, a) in acts.iter().enumerate() {
                let got = f(w, a);
                if exact {
                    let want = s(w, a);
                    assert_eq!(
                        want.to_bits(),
                        got.to_bits(),
                        "{dt} trial {trial}: {got} vs {want}"
                    );
                }
                assert_eq!(
                    got.to_bits(),
                    four[t].to_bits(),
                    "{dt} trial {trial} dot4 token {t}"
                );
            }
        }
    }
}

/// Every f16 and bf16 bit pattern, aligned (F16C / the vectorised loop) and one byte off
/// (the byte-at-a-time path), converts to the bits the `half` crate gives.
#[test]
fn f16_and_bf16_rows_convert_like_the_half_crate() {
    let bytes: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
    let aligned = Aligned::new(&bytes);
    let mut shifted = vec![0u8];
    shifted.extend_from_slice(&bytes);
    type Widen = fn(u16) -> f32;
    let f16: Widen = |b| half::f16::from_bits(b).to_f32();
    let bf16: Widen = |b| half::bf16::from_bits(b).to_f32();
    for (dt, want) in [
        (ferrum_core::DType::F16, f16),
        (ferrum_core::DType::BF16, bf16),
    ] {
        for src in [aligned.bytes(), &shifted[1..]] {
            let mut out = vec![0f32; 1 << 16];
            assert!(dequantize(dt, src, &mut out));
            for (b, o) in (0..=u16::MAX).zip(&out) {
                assert_eq!(o.to_bits(), want(b).to_bits(), "{dt} {b:#06x}");
            }
        }
    }
}

#[test]
fn activation_quantisation_round_trips_within_half_a_step() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let x: Vec<f32> = (0..512).map(|_| rng.gen_range(-3.0..3.0)).collect();
    let mut a = vec![BlockQ8::default(); 16];
    quantize_q8(&x, &mut a);
    for (blk, q) in x.chunks(32).zip(&a) {
        let mut s = 0i32;
        for (v, &qi) in blk.iter().zip(&q.qs) {
            assert!((v - qi as f32 * q.d).abs() <= q.d * 0.5 + 1e-6);
            s += qi as i32;
        }
        assert!((q.s - q.d * s as f32).abs() < 1e-5);
    }
    let mut k = vec![BlockQ8K::default(); 2];
    quantize_q8k(&x, &mut k);
    for (blk, q) in x.chunks(256).zip(&k) {
        for (v, &qi) in blk.iter().zip(&q.qs) {
            assert!((v - qi as f32 * q.d).abs() <= q.d * 0.5 + 1e-6);
        }
        for g in 0..16 {
            let s: i16 = q.qs[16 * g..16 * g + 16].iter().map(|&v| v as i16).sum();
            assert_eq!(q.bsums[g], s);
        }
        for j in 0..8 {
            let s: i16 = q.qs[32 * j..32 * j + 32].iter().map(|&v| v as i16).sum();
            assert_eq!(q.sums32[j], s);
        }
    }
}

#[test]
fn simd_activation_quantisation_equals_scalar_twin() {
    use ferrum_backend::cpu::quant::q8::{quantize_q8_scalar, quantize_q8k_scalar};
    let mut rng = rand::rngs::StdRng::seed_from_u64(77);
    for scale in [0.01f32, 1.0, 300.0] {
        let mut x: Vec<f32> = (0..1024).map(|_| rng.gen_range(-scale..scale)).collect();
        x[..32].fill(0.0); // an all-zero block
        x[40] = 0.5 * scale; // exact halves exercise ties
        let (mut a, mut b) = (vec![BlockQ8::default(); 32], vec![BlockQ8::default(); 32]);
        quantize_q8(&x, &mut a);
        quantize_q8_scalar(&x, &mut b);
        for (p, q) in a.iter().zip(&b) {
            assert_eq!((p.d, p.s, p.offset, p.qs), (q.d, q.s, q.offset, q.qs));
            assert_eq!(p.offset, -128 * p.qs.iter().map(|&v| v as i32).sum::<i32>());
        }
        let (mut a, mut b) = (vec![BlockQ8K::default(); 4], vec![BlockQ8K::default(); 4]);
        quantize_q8k(&x, &mut a);
        quantize_q8k_scalar(&x, &mut b);
        for (p, q) in a.iter().zip(&b) {
            assert_eq!((p.d, p.qs, p.bsums), (q.d, q.qs, q.bsums));
            assert_eq!(p.sums32, q.sums32);
        }
    }
}

/// The packed (eight-row interleaved) layouts: the AVX2 kernel equals its scalar twin bit
/// for bit at every token count; a token's result does not depend on how many tokens share
/// the pass; rows dequantise exactly as the file's; and each (row, token) agrees with the
/// file-layout kernel to float rounding (both compute the same integer sums and scales,
/// summed in another order).
#[test]
fn packed_kernels_equal_scalar_twin_and_file_layout_kernel() {
    use ferrum_backend::cpu::quant::packed::Packed;
    use ferrum_core::DType;
    for dt in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Mxfp4,
        DType::Iq4Nl,
    ] {
        let Some(Kernel::Q8 { dot, .. }) = scalar_kernel(dt) else {
            panic!("{dt}: a Q8 kernel")
        };
        check_packed(dt, 256, dot, Packed::gemm_on, Packed::gemm_scalar);
    }
    for dt in [DType::Q4K, DType::Q5K, DType::Q6K, DType::Iq4Xs] {
        let Some(Kernel::Q8K { dot, .. }) = scalar_kernel(dt) else {
            panic!("{dt}: a Q8_K kernel")
        };
        check_packed(dt, 512, dot, Packed::gemm_k_on, Packed::gemm_k_scalar);
    }
}

/// The packed Q5_K kernels at the top of their range: every quant 31 against activations of
/// 127, where sums of eight vectors would overflow the AVX2 kernel's 16-bit lanes. Each
/// instruction set gives the scalar twin's bits.
#[test]
fn packed_q5k_at_full_scale_equals_scalar_twin() {
    use ferrum_backend::cpu::quant::packed::{Isa, Packed, ROWS};
    use ferrum_core::DType;
    let (rows, k) = (ROWS, 512);
    let mut block = Vec::with_capacity(176);
    block.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes()); // d
    block.extend_from_slice(&0u16.to_le_bytes()); // dmin
    block.extend_from_slice(&[0x3f; 12]); // scales and minimums, 63 where 6 bits are stored
    block.extend_from_slice(&[0xff; 32]); // fifth bits
    block.extend_from_slice(&[0xff; 128]); // low nibbles
    let bytes: Vec<u8> = (0..rows * k / 256).flat_map(|_| block.clone()).collect();
    let wa = Aligned::new(&bytes);
    let pool = ferrum_backend::cpu::pool::ThreadPool::new(2);
    let arena = ferrum_backend::cpu::arena::Arena::default();
    let p = Packed::new(DType::Q5K, wa.bytes(), rows, k, &pool, &arena, &|_| {}).expect("packs");
    let x = vec![1.0f32; k];
    let mut a = vec![BlockQ8K::default(); k / 256];
    quantize_q8k(&x, &mut a);
    let acts: Vec<&[BlockQ8K]> = vec![&a; 4];
    let mut want = vec![[0f32; ROWS]; 4];
    p.gemm_k_scalar(0, &acts, &mut want);
    assert!(want[0][0] > 0.0);
    for isa in Isa::available() {
        let mut got = vec![[0f32; ROWS]; 4];
        p.gemm_k_on(isa, 0, &acts, &mut got);
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert_eq!(g.to_bits(), w.to_bits(), "{isa:?}: {g} vs scalar {w}");
        }
    }
}

/// The kernels over two packed groups at once (the 512-bit Q4_K and Q6_K ones; AVX2's Q4_K
/// pair, which takes four tokens and leaves other counts and formats to single groups): the
/// scalar twin's bits for both groups at every token count (and, for Q4_K, the top of the
/// range: every quant 15, every scale and minimum 63, activations ±127). A CPU without an
/// instance's features says it could not check it.
#[test]
fn k_quant_pairs_equal_scalar_twin() {
    each_pair_instance(check_k_quant_pairs);
}

/// `Packed::gemm2_*_on`: two packed groups against the same tokens of activation format `A`.
type PairKernel<A> = fn(
    &ferrum_backend::cpu::quant::packed::Packed,
    usize,
    &[&[A]],
    &mut [[f32; ferrum_backend::cpu::quant::packed::ROWS]],
    &mut [[f32; ferrum_backend::cpu::quant::packed::ROWS]],
);

/// `check(name, kernel)` for each two-group instance this CPU runs (the 512-bit kernels,
/// AVX2's pairs); the others said not checked.
fn each_pair_instance<A: ferrum_backend::cpu::quant::packed::PackedAct>(
    check: fn(&str, PairKernel<A>),
) {
    use ferrum_backend::cpu::quant::packed::{Isa, Packed};
    #[cfg(target_arch = "x86_64")]
    let wide = ferrum_backend::cpu::quant::packed::has_wide();
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    let instances: [(&str, bool, PairKernel<A>); 2] = [
        ("512-bit", wide, Packed::gemm2_wide_on),
        ("AVX2", Isa::Avx2.runs(), Packed::gemm2_avx2_on),
    ];
    for (name, runs, pair) in instances {
        if runs {
            check(name, pair);
        } else {
            eprintln!("this CPU does not run the {name} pair kernels: not checked");
        }
    }
}

fn check_k_quant_pairs(name: &str, pair: PairKernel<BlockQ8K>) {
    use ferrum_backend::cpu::quant::packed::{Packed, ROWS};
    use ferrum_core::DType;
    let (rows, k) = (4 * ROWS, 768);
    let pool = ferrum_backend::cpu::pool::ThreadPool::new(2);
    let arena = ferrum_backend::cpu::arena::Arena::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    let mut full = Vec::with_capacity(144);
    full.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
    full.extend_from_slice(&half::f16::from_f32(0.02).to_bits().to_le_bytes());
    full.extend_from_slice(&[0xff; 12]);
    full.extend_from_slice(&[0xff; 128]);
    let full: Vec<u8> = (0..rows * k / 256).flat_map(|_| full.clone()).collect();
    // IQ4_XS at the top of its range: every level −127 and every scale −32.
    let mut iq4xs_full = Vec::with_capacity(136);
    iq4xs_full.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
    iq4xs_full.extend_from_slice(&[0; 6]);
    iq4xs_full.extend_from_slice(&[0; 128]);
    let iq4xs_full: Vec<u8> = (0..rows * k / 256)
        .flat_map(|_| iq4xs_full.clone())
        .collect();
    let cases = [
        (DType::Q4K, random_blocks(&mut rng, DType::Q4K, rows * k)),
        (DType::Q4K, full),
        (DType::Q6K, random_blocks(&mut rng, DType::Q6K, rows * k)),
        (
            DType::Iq4Xs,
            random_blocks(&mut rng, DType::Iq4Xs, rows * k),
        ),
        (DType::Iq4Xs, iq4xs_full),
    ];
    for (dt, bytes) in cases {
        let wa = Aligned::new(&bytes);
        let p = Packed::new(dt, wa.bytes(), rows, k, &pool, &arena, &|_| {}).expect("packs");
        let xs: Vec<Vec<BlockQ8K>> = (0..9)
            .map(|t| {
                let x: Vec<f32> = match t {
                    0 => vec![127.0; k],
                    1 => vec![-127.0; k],
                    _ => (0..k).map(|_| rng.gen_range(-20.0..20.0)).collect(),
                };
                let mut a = vec![BlockQ8K::default(); k / 256];
                quantize_q8k(&x, &mut a);
                a
            })
            .collect();
        for n in 1..=xs.len() {
            let acts: Vec<&[BlockQ8K]> = xs[..n].iter().map(|a| &a[..]).collect();
            for g in [0, 2] {
                let (mut a, mut b) = (vec![[0f32; ROWS]; n], vec![[0f32; ROWS]; n]);
                pair(&p, g, &acts, &mut a, &mut b);
                for (grp, got) in [(g, &a), (g + 1, &b)] {
                    let mut want = vec![[0f32; ROWS]; n];
                    p.gemm_k_scalar(grp, &acts, &mut want);
                    for (x, y) in got.iter().flatten().zip(want.iter().flatten()) {
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "{name} {dt} group {grp} n={n}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

/// The Q8_0 pairs (two packed groups: AVX2's for four tokens, the 512-bit kernel for any
/// count) give each group the scalar twin's bits: random blocks, and blocks of −128 and 127
/// against activations of ±127 (AVX2: the sign moved onto the activation, the pair sums at
/// their largest). A CPU without an instance's features says it could not check it.
#[test]
fn q8_0_pair_equals_scalar_twin() {
    each_pair_instance(check_q8_0_pairs);
}

fn check_q8_0_pairs(name: &str, pair: PairKernel<BlockQ8>) {
    use ferrum_backend::cpu::quant::packed::{Packed, ROWS};
    use ferrum_core::DType;
    let (rows, k) = (4 * ROWS, 512);
    let pool = ferrum_backend::cpu::pool::ThreadPool::new(2);
    let arena = ferrum_backend::cpu::arena::Arena::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let extreme = |q: u8| -> Vec<u8> {
        let mut block = half::f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
        block.extend_from_slice(&[q; 32]);
        (0..rows * k / 32).flat_map(|_| block.clone()).collect()
    };
    let cases = [
        random_blocks(&mut rng, DType::Q8_0, rows * k),
        extreme(0x80),
        extreme(0x7f),
    ];
    for bytes in cases {
        let wa = Aligned::new(&bytes);
        let p =
            Packed::new(DType::Q8_0, wa.bytes(), rows, k, &pool, &arena, &|_| {}).expect("packs");
        let xs: Vec<Vec<BlockQ8>> = (0..6)
            .map(|t| {
                let x: Vec<f32> = match t {
                    0 => vec![127.0; k],
                    1 => vec![-127.0; k],
                    _ => (0..k).map(|_| rng.gen_range(-20.0..20.0)).collect(),
                };
                BlockQ8::blocks(&x)
            })
            .collect();
        for n in 1..=xs.len() {
            let acts: Vec<&[BlockQ8]> = xs[..n].iter().map(|a| &a[..]).collect();
            for g in [0, 2] {
                let (mut a, mut b) = (vec![[0f32; ROWS]; n], vec![[0f32; ROWS]; n]);
                pair(&p, g, &acts, &mut a, &mut b);
                for (grp, got) in [(g, &a), (g + 1, &b)] {
                    let mut want = vec![[0f32; ROWS]; n];
                    p.gemm_scalar(grp, &acts, &mut want);
                    for (x, y) in got.iter().flatten().zip(want.iter().flatten()) {
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "{name} group {grp} n={n}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

/// The packed MXFP4 kernels at the top of their range: every weight ±6 (doubled, ±12: 24
/// after the kernels' +12) against activations of ±127, where the AVX2 kernel's 16-bit partial
/// sums come closest to overflowing. Each instruction set gives the scalar twin's bits.
#[test]
fn packed_mxfp4_at_full_scale_equals_scalar_twin() {
    use ferrum_backend::cpu::quant::packed::{Isa, Packed, ROWS};
    use ferrum_core::DType;
    let (rows, k) = (ROWS, 256);
    for (code, x) in [(0x77u8, 1.0f32), (0x77, -1.0), (0xff, 1.0), (0x7f, -1.0)] {
        let mut block = vec![127u8]; // scale 1 (2^0)
        block.extend_from_slice(&[code; 16]);
        let bytes: Vec<u8> = (0..rows * k / 32).flat_map(|_| block.clone()).collect();
        let wa = Aligned::new(&bytes);
        let pool = ferrum_backend::cpu::pool::ThreadPool::new(2);
        let arena = ferrum_backend::cpu::arena::Arena::default();
        let p =
            Packed::new(DType::Mxfp4, wa.bytes(), rows, k, &pool, &arena, &|_| {}).expect("packs");
        let mut a = vec![BlockQ8::default(); k / 32];
        quantize_q8(&vec![x; k], &mut a);
        let acts: Vec<&[BlockQ8]> = vec![&a; 4];
        let mut want = vec![[0f32; ROWS]; 4];
        p.gemm_scalar(0, &acts, &mut want);
        assert!(want[0][0] != 0.0 || code == 0x7f);
        for isa in Isa::available() {
            let mut got = vec![[0f32; ROWS]; 4];
            p.gemm_on(isa, 0, &acts, &mut got);
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{isa:?} {code:#x}: {g} vs scalar {w}"
                );
            }
        }
    }
}

type Gemm<A> = fn(&ferrum_backend::cpu::quant::packed::Packed, usize, &[&[A]], &mut [[f32; 8]]);
type GemmOn<A> = fn(
    &ferrum_backend::cpu::quant::packed::Packed,
    ferrum_backend::cpu::quant::packed::Isa,
    usize,
    &[&[A]],
    &mut [[f32; 8]],
);

fn check_packed<A: ActFormat>(
    dt: ferrum_core::DType,
    k: usize,
    dot: fn(&[u8], &[A]) -> f32,
    gemm: GemmOn<A>,
    gemm_scalar: Gemm<A>,
) {
    use ferrum_backend::cpu::quant::packed::{Isa, Packed, ROWS};
    let mut rng = rand::rngs::StdRng::seed_from_u64(2024);
    let rows = 3 * ROWS;
    let wa = Aligned::new(&random_blocks(&mut rng, dt, rows * k));
    let w = wa.bytes();
    let pool = ferrum_backend::cpu::pool::ThreadPool::new(2);
    let arena = ferrum_backend::cpu::arena::Arena::default();
    let p = Packed::new(dt, w, rows, k, &pool, &arena, &|_| {}).expect("packs");
    assert_eq!(p.rows(), rows);
    let row_bytes = w.len() / rows;
    let mut wf = vec![0f32; rows * k];
    assert!(dequantize(dt, w, &mut wf));
    let mut row = vec![0f32; k];
    for j in 0..rows {
        p.dequantize_row(j, &mut row);
        assert!(
            row.iter()
                .zip(&wf[j * k..(j + 1) * k])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{dt}: packed row {j} dequantises differently"
        );
    }
    let xs: Vec<(Vec<f32>, Vec<A>)> = (0..9)
        .map(|t| {
            let scale = [0.5f32, 4.0, 30.0][t % 3];
            let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-scale..scale)).collect();
            let a = A::blocks(&x);
            (x, a)
        })
        .collect();
    // Every instruction set this CPU runs (AVX-VNNI, AVX512-VNNI, AVX2, scalar where
    // present); the ones it does not are named, so a run says what it could not check.
    let isas = Isa::available();
    let missing: Vec<Isa> = [Isa::Avx2, Isa::Avx512Vnni, Isa::AvxVnni]
        .into_iter()
        .filter(|i| !isas.contains(i))
        .collect();
    eprintln!("{dt}: packed kernels checked on {isas:?}; this CPU does not run {missing:?}");
    for (isa, n) in isas
        .iter()
        .flat_map(|&i| (1..=xs.len()).map(move |n| (i, n)))
    {
        let acts: Vec<&[A]> = xs[..n].iter().map(|(_, a)| &a[..]).collect();
        for g in 0..rows / ROWS {
            let (mut fast, mut slow) = (vec![[0f32; ROWS]; n], vec![[0f32; ROWS]; n]);
            gemm(&p, isa, g, &acts, &mut fast);
            gemm_scalar(&p, g, &acts, &mut slow);
            for t in 0..n {
                let mut alone = [[0f32; ROWS]];
                gemm(&p, isa, g, &acts[t..t + 1], &mut alone);
                for r in 0..ROWS {
                    let (f, s, a) = (fast[t][r], slow[t][r], alone[0][r]);
                    assert_eq!(
                        f.to_bits(),
                        s.to_bits(),
                        "{dt} {isa:?} n={n} t={t}: simd {f} scalar {s}"
                    );
                    assert_eq!(
                        f.to_bits(),
                        a.to_bits(),
                        "{dt} {isa:?} n={n} t={t}: batch {f} alone {a}"
                    );
                    let j = g * ROWS + r;
                    let e = dot(&w[j * row_bytes..(j + 1) * row_bytes], acts[t]);
                    // Magnitude of the sum's terms: rounding is relative to it.
                    let mag: f32 = wf[j * k..(j + 1) * k]
                        .iter()
                        .zip(&xs[t].0)
                        .map(|(a, b)| (a * b).abs())
                        .sum();
                    assert!(
                        (f - e).abs() <= 1e-5 * mag + 1e-6,
                        "{dt} row {j} token {t}: packed {f} vs file layout {e}"
                    );
                }
            }
        }
    }
}

/// `matmul_many` over parts of both activation formats (Q4_0 and Q8_0 with 8-bit activations,
/// Q4_K with Q8_K ones), packed and tail rows, with and without a bias, writing side by side
/// into one buffer: the same bits as one `matmul` per part, whatever the token count.
/// f16 and bf16 weights (the f32 path, or for bf16 `vdpbf16ps` where the CPU has it): every
/// token of an n-token matmul gets the bits it gets alone (one and two tokens dot each row as
/// it converts, more go three at a time, or four rows by three, the rest one by one), with a
/// bias, into a window of wider rows, over a width with a tail past the last multiple of 32;
/// and the value is the product (to bf16 rounding of the activations on `vdpbf16ps`).
#[test]
fn half_weight_matmul_gives_each_token_its_bits_alone() {
    use ferrum_backend::cpu::simd::bf16_dot;
    use ferrum_backend::{Backend, CpuBackend, Rows};
    use ferrum_core::DType;
    use ferrum_loader::RawTensor;
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    let be = CpuBackend::with_threads(2);
    // 77 rows over two threads: tasks of nine rows, so each task runs row blocks of four,
    // four and one; 70 rows: tasks of eight. Rows of 4133 values: the bf16 kernels take rows
    // past 2048 in stretches.
    for (m, k, width, at) in [(77, 100, 85, 3), (70, 4133, 75, 3)] {
        let bias: Vec<f32> = (0..m).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let bias_bytes: Vec<u8> = bias.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bias_w = be
            .load_weight(&RawTensor::from_bytes("b", DType::F32, vec![m], bias_bytes).expect("f32"))
            .expect("bias loads");
        for dt in [DType::F16, DType::BF16] {
            let (vals, bytes): (Vec<f32>, Vec<u8>) = (0..m * k)
                .map(|_| {
                    let v: f32 = rng.gen_range(-1.0..1.0);
                    match dt {
                        DType::F16 => {
                            let h = half::f16::from_f32(v);
                            (h.to_f32(), h.to_le_bytes())
                        }
                        _ => {
                            let h = half::bf16::from_f32(v);
                            (h.to_f32(), h.to_le_bytes())
                        }
                    }
                })
                .fold((Vec::new(), Vec::new()), |(mut v, mut b), (x, h)| {
                    v.push(x);
                    b.extend_from_slice(&h);
                    (v, b)
                });
            let w = be
                .load_weight(
                    &RawTensor::from_bytes("w", dt, vec![m, k], bytes).expect("sizes match"),
                )
                .expect("weight loads");
            for n in [1, 2, 3, 5, 7] {
                let x: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let mut out = vec![0f32; n * width];
                let ov = Rows::columns(n, width, at, m);
                be.matmul(&x, Rows::dense(n, k), &w, Some(&bias_w), &mut out, ov);
                // The same rows inside a wider buffer, from an odd offset (a prefill copies such
                // rows to aligned memory first): the same bits.
                let (pad, wide) = (3, k + 5);
                let mut xw = vec![f32::NAN; pad + n * wide];
                for t in 0..n {
                    xw[pad + t * wide..][..k].copy_from_slice(&x[t * k..(t + 1) * k]);
                }
                let mut out_w = vec![0f32; n * width];
                let xwv = Rows::columns(n, wide, pad, k);
                be.matmul(&xw, xwv, &w, Some(&bias_w), &mut out_w, ov);
                for (i, (a, b)) in out.iter().zip(&out_w).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{dt} n={n} strided input, element {i}"
                    );
                }
                for t in 0..n {
                    let xt = x[t * k..(t + 1) * k].to_vec();
                    let mut alone = vec![0f32; width];
                    let ov1 = Rows::columns(1, width, at, m);
                    be.matmul(&xt, Rows::dense(1, k), &w, Some(&bias_w), &mut alone, ov1);
                    for j in 0..m {
                        let (got, one) = (out[t * width + at + j], alone[at + j]);
                        assert_eq!(got.to_bits(), one.to_bits(), "{dt} n={n} token {t} row {j}");
                        let exact: f64 = (0..k)
                            .map(|i| vals[j * k + i] as f64 * xt[i] as f64)
                            .sum::<f64>()
                            + bias[j] as f64;
                        // bf16 weights on `vdpbf16ps` meet activations rounded to bf16: each
                        // product off by at most 2^-9 of itself.
                        let rounding: f64 = if dt == DType::BF16 && bf16_dot() {
                            (0..k)
                                .map(|i| (vals[j * k + i] as f64 * xt[i] as f64).abs())
                                .sum::<f64>()
                                / 512.0
                        } else {
                            0.0
                        };
                        assert!(
                            (got as f64 - exact).abs() < 1e-4 + rounding,
                            "{dt} row {j}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_many_equals_one_matmul_per_part() {
    use ferrum_backend::{Backend, CpuBackend, MatmulPart, Rows};
    use ferrum_core::DType;
    use ferrum_loader::RawTensor;
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let k = 512;
    let shapes = [(DType::Q4_0, 40), (DType::Q4K, 24), (DType::Q8_0, 13)];
    for threads in [1, 2] {
        let be = CpuBackend::with_threads(threads);
        let ws: Vec<_> = shapes
            .iter()
            .map(|&(dt, m)| {
                let bytes = random_blocks(&mut rng, dt, m * k);
                let t = RawTensor::from_bytes("w", dt, vec![m, k], bytes).expect("sizes match");
                be.load_weight(&t).expect("weight loads")
            })
            .collect();
        let bias: Vec<f32> = (0..13).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let bias_bytes: Vec<u8> = bias.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bias = be
            .load_weight(
                &RawTensor::from_bytes("b", DType::F32, vec![13], bias_bytes).expect("f32"),
            )
            .expect("bias loads");
        let width: usize = shapes.iter().map(|s| s.1).sum();
        for n in [1, 3, 4, 6] {
            let x: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let xv = Rows::dense(n, k);
            let mut starts = Vec::new();
            let mut at = 0;
            for &(_, m) in &shapes {
                starts.push(at);
                at += m;
            }
            let parts: Vec<MatmulPart<_>> = ws
                .iter()
                .zip(&shapes)
                .zip(&starts)
                .map(|((w, &(dt, m)), &s)| MatmulPart {
                    weight: w,
                    bias: (dt == DType::Q8_0).then_some(&bias),
                    out: Rows::columns(n, width, s, m),
                })
                .collect();
            let mut fused = vec![0f32; n * width];
            be.matmul_many(&x, xv, &parts, &mut fused);
            let mut one_by_one = vec![0f32; n * width];
            for p in &parts {
                be.matmul(&x, xv, p.weight, p.bias, &mut one_by_one, p.out);
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused), bits(&one_by_one), "threads {threads}, n {n}");
            assert!(fused.iter().all(|v| v.is_finite() && *v != 0.0));
            // Views the one-pass path must refuse (they would race): the first two parts on
            // overlapping columns, and rows narrower than the parts' span. Then the parts run
            // one after another, so the later part's values win where they overlap.
            let overlapping: Vec<MatmulPart<_>> = parts
                .iter()
                .enumerate()
                .map(|(i, p)| MatmulPart {
                    out: Rows::columns(
                        n,
                        width,
                        if i == 1 { 2 } else { p.out.offset },
                        p.out.head_dim,
                    ),
                    ..*p
                })
                .collect();
            let narrow: Vec<MatmulPart<_>> = parts
                .iter()
                .map(|p| MatmulPart {
                    out: Rows::columns(n, width - 10, p.out.offset, p.out.head_dim),
                    ..*p
                })
                .collect();
            for refused in [&overlapping, &narrow] {
                let len = n * width + 16;
                let (mut a, mut b) = (vec![0f32; len], vec![0f32; len]);
                be.matmul_many(&x, xv, refused, &mut a);
                for p in refused.iter() {
                    be.matmul(&x, xv, p.weight, p.bias, &mut b, p.out);
                }
                assert_eq!(bits(&a), bits(&b), "threads {threads}, n {n}");
            }
        }
    }
}

/// `glu_matmul` (each token's gate row computed in the matmul's hand-off on the integer
/// path) against its default body, `glu` then `matmul`: the same bits in `out` and in
/// `act`, for SiLU and GELU, 8-bit and Q8_K activations, an f32 weight, one to six tokens,
/// one and two threads.
#[test]
fn glu_matmul_equals_glu_then_matmul() {
    use ferrum_backend::{Activation, Backend, CpuBackend, Rows};
    use ferrum_core::DType;
    use ferrum_loader::RawTensor;
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let (f, m) = (512, 40);
    for threads in [1, 2] {
        let be = CpuBackend::with_threads(threads);
        for dt in [DType::Q4_1, DType::Q4K, DType::Q8_0, DType::F32] {
            let bytes = if dt == DType::F32 {
                (0..m * f)
                    .flat_map(|_| rng.gen_range(-0.5f32..0.5).to_le_bytes())
                    .collect()
            } else {
                random_blocks(&mut rng, dt, m * f)
            };
            let t = RawTensor::from_bytes("w", dt, vec![m, f], bytes).expect("sizes match");
            let w = be.load_weight(&t).expect("weight loads");
            for (n, act_fn) in [
                (1, Activation::Silu),
                (3, Activation::GeluTanh),
                (4, Activation::Silu),
                (6, Activation::GeluTanh),
                (1, Activation::GeluTanh),
            ] {
                let gu: Vec<f32> = (0..n * 2 * f).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let (gv, av, ov) = (Rows::dense(n, 2 * f), Rows::dense(n, f), Rows::dense(n, m));
                let (mut act, mut out) = (vec![0f32; n * f], vec![0f32; n * m]);
                be.glu_matmul(&gu, gv, &mut act, av, &w, &mut out, ov, act_fn);
                let (mut act2, mut out2) = (vec![0f32; n * f], vec![0f32; n * m]);
                be.glu(&gu, gv, &mut act2, av, act_fn);
                be.matmul(&act2, av, &w, None, &mut out2, ov);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{dt}, threads {threads}, n {n}");
                assert_eq!(bits(&act), bits(&act2), "act: {what}");
                assert_eq!(bits(&out), bits(&out2), "out: {what}");
                assert!(out.iter().all(|v| v.is_finite() && *v != 0.0), "{what}");
            }
        }
    }
}

/// The AMX tile kernels (two packed groups against sixteen tokens a tile) give the scalar
/// twins' bits for every format they serve, at token counts below, at and over a tile, with
/// the tokens' rows equally spaced (read in place) and not (copied), and at the top of the
/// range. They run on the emulated tiles wherever the CPU has the kernels' AVX-512, and on
/// the tile instructions where it has AMX; a CPU without either says what it could not run.
#[test]
fn amx_tile_kernels_equal_scalar_twin() {
    use ferrum_backend::cpu::quant::amx::{self, Emulated, Tiles};
    use ferrum_backend::cpu::quant::packed::{Packed, ROWS};
    use ferrum_core::DType;
    if !amx::vectors_run() {
        eprintln!("this CPU lacks AVX-512 F/BW/VL: the AMX kernels were not checked");
        return;
    }
    let hw = amx::hardware();
    if !hw {
        eprintln!("this CPU (or OS) has no AMX-INT8: the tile kernels ran on emulated tiles only");
    }
    let (rows, k) = (4 * ROWS, 512);
    let pool = ferrum_backend::cpu::pool::ThreadPool::new(2);
    let arena = ferrum_backend::cpu::arena::Arena::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let counts = [1usize, 5, 16, 17, 35];
    let xs: Vec<Vec<f32>> = (0..35)
        .map(|t| match t {
            0 => vec![127.0; k],
            1 => vec![-127.0; k],
            _ => (0..k).map(|_| rng.gen_range(-20.0..20.0)).collect(),
        })
        .collect();
    // Every quant at its top and every scale and minimum 63, for Q4_K and Q5_K.
    let full = |dt: DType| -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        b.extend_from_slice(&half::f16::from_f32(0.02).to_bits().to_le_bytes());
        b.extend_from_slice(&[0xff; 12]);
        if dt == DType::Q5K {
            b.extend_from_slice(&[0xff; 32]);
        }
        b.extend_from_slice(&[0xff; 128]);
        (0..rows * k / 256).flat_map(|_| b.clone()).collect()
    };
    let mut cases: Vec<(DType, Vec<u8>)> = [
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ]
    .into_iter()
    .map(|dt| (dt, random_blocks(&mut rng, dt, rows * k)))
    .collect();
    cases.push((DType::Q4K, full(DType::Q4K)));
    cases.push((DType::Q5K, full(DType::Q5K)));
    // Q6_K at its corners: quants all 0 or all 63 (offset −32 and 31) under scales −128
    // and 127, the ends of the digit split the tile kernel makes of each scale.
    let corners: Vec<u8> = (0..rows * k / 256)
        .flat_map(|i| {
            let q = if i % 2 == 0 { 0x00 } else { 0xff };
            let mut b = vec![q; 128 + 64];
            b.extend((0..16).map(|j| if (i + j) % 2 == 0 { 0x80u8 } else { 0x7f }));
            b.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
            b
        })
        .collect();
    cases.push((DType::Q6K, corners));
    for (dt, bytes) in cases {
        let wa = Aligned::new(&bytes);
        let p = Packed::new(dt, wa.bytes(), rows, k, &pool, &arena, &|_| {}).expect("packs");
        type Twin<'a, A> = &'a dyn Fn(usize, &[&[A]], &mut [[f32; ROWS]]);
        // One matrix of activation rows (equally spaced) and the same rows reversed (not).
        fn check<A: amx::Act, T: Tiles>(
            tiles: &mut T,
            p: &Packed,
            rows: &[A],
            per_row: usize,
            n: usize,
            twin: Twin<A>,
            what: &str,
        ) {
            let mut acts: Vec<&[A]> = rows.chunks(per_row).take(n).collect();
            for order in 0..2 {
                if order == 1 {
                    acts.reverse();
                }
                for g in [0, 2] {
                    let mut got = vec![[0f32; 2 * ROWS]; n];
                    // SAFETY: `vectors_run` (and, for the hardware, `hardware`) checked by
                    // the caller.
                    assert!(unsafe { amx::gemm_pair(tiles, p, g, &acts, &mut got) });
                    for h in 0..2 {
                        let mut want = vec![[0f32; ROWS]; n];
                        twin(g + h, &acts, &mut want);
                        for (t, (x, y)) in got.iter().zip(&want).enumerate() {
                            for r in 0..ROWS {
                                let v = x[h * ROWS + r];
                                assert_eq!(
                                    v.to_bits(),
                                    y[r].to_bits(),
                                    "{what} group {} row {r} token {t} of {n} (order {order}): {v} vs {}",
                                    g + h,
                                    y[r]
                                );
                            }
                        }
                    }
                }
            }
        }
        // Both instances: the emulated tiles, and the tiles themselves where they run.
        #[allow(clippy::too_many_arguments)]
        fn on_both<A: amx::Act>(
            hw: bool,
            p: &Packed,
            rows: &[A],
            per_row: usize,
            n: usize,
            twin: Twin<A>,
            dt: DType,
        ) {
            let what = |t: &str| format!("{dt} on {t}");
            check(
                &mut Emulated::default(),
                p,
                rows,
                per_row,
                n,
                twin,
                &what("emulated tiles"),
            );
            if hw {
                check(&mut amx::Amx, p, rows, per_row, n, twin, &what("AMX"));
            }
        }
        // The activations quantised once for every token count.
        if p.is_k_quant() {
            let mut a = vec![BlockQ8K::default(); 35 * k / 256];
            for (x, a) in xs.iter().zip(a.chunks_mut(k / 256)) {
                quantize_q8k(x, a);
            }
            let twin = |g: usize, acts: &[&[BlockQ8K]], out: &mut [[f32; ROWS]]| {
                p.gemm_k_scalar(g, acts, out)
            };
            for &n in &counts {
                on_both(hw, &p, &a, k / 256, n, &twin, dt);
            }
        } else {
            let mut a = vec![BlockQ8::default(); 35 * k / 32];
            for (x, a) in xs.iter().zip(a.chunks_mut(k / 32)) {
                quantize_q8(x, a);
            }
            let twin = |g: usize, acts: &[&[BlockQ8]], out: &mut [[f32; ROWS]]| {
                p.gemm_scalar(g, acts, out)
            };
            for &n in &counts {
                on_both(hw, &p, &a, k / 32, n, &twin, dt);
            }
        }
    }
}

/// The CPU's LoRA expansion (column stretches on the pool) gives its scalar twin's bits
/// (`host_ops::add_low_rank_row`, which the trait's default body runs), row by row, at widths
/// of one, several and a partial stretch and at strided rows, and a row's bits do not depend
/// on the other rows of the call.
#[test]
fn add_low_rank_equals_its_scalar_twin() {
    use ferrum_backend::host_ops::{add_low_rank_row, low_rank_stretches};
    use ferrum_backend::{Backend, CpuBackend, Rows};
    let be = CpuBackend::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(48);
    for (n, r, w) in [(1, 16, 2048), (4, 16, 300), (7, 4, 96), (3, 64, 513)] {
        let stride = w + 3;
        let low: Vec<f32> = (0..n * r).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let m: Vec<f32> = (0..r * w).map(|_| rng.gen_range(-0.5..0.5)).collect();
        let bt = low_rank_stretches(&m, r, w);
        let base: Vec<f32> = (0..n * stride).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let ov = Rows::columns(n, stride, 3, w);
        let mut got = base.clone();
        be.add_low_rank(&low, Rows::dense(n, r), &bt, &mut got, ov);
        let mut want = base.clone();
        for t in 0..n {
            add_low_rank_row(
                &mut want[t * stride + 3..t * stride + 3 + w],
                &low[t * r..(t + 1) * r],
                &bt,
            );
        }
        assert_eq!(got, want, "{n}×{r} → {w}");
        // And the stretches hold the plain product: within rounding of f64.
        for t in 0..n {
            for c in 0..w {
                let exact: f64 = base[t * stride + 3 + c] as f64
                    + (0..r)
                        .map(|j| low[t * r + j] as f64 * m[j * w + c] as f64)
                        .sum::<f64>();
                let g = got[t * stride + 3 + c] as f64;
                assert!(
                    (g - exact).abs() < 1e-4,
                    "{n}×{r} → {w}: row {t} column {c}"
                );
            }
        }
        // The last row alone: the same bits.
        let mut one = base[(n - 1) * stride..].to_vec();
        be.add_low_rank(
            &low[(n - 1) * r..].to_vec(),
            Rows::dense(1, r),
            &bt,
            &mut one,
            Rows::columns(1, stride, 3, w),
        );
        assert_eq!(
            &one[..],
            &got[(n - 1) * stride..],
            "{n}×{r} → {w}: last row alone"
        );
    }
}

/// The CPU's `A x` of a LoRA update (factor rows split among the threads) gives each
/// element the f32 dot's bits, at strided rows, whatever the other rows of the call.
#[test]
fn low_rank_shrink_equals_the_dot_per_element() {
    use ferrum_backend::cpu::simd::dot_f32;
    use ferrum_backend::{Backend, CpuBackend, Rows};
    let be = CpuBackend::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(49);
    for (n, r, k) in [(1, 16, 2048), (4, 16, 300), (7, 3, 96), (3, 64, 513)] {
        let stride = k + 5;
        let x: Vec<f32> = (0..n * stride).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let a: Vec<f32> = (0..r * k).map(|_| rng.gen_range(-0.5..0.5)).collect();
        let xv = Rows::columns(n, stride, 5, k);
        let mut got = vec![0f32; n * r];
        be.low_rank_shrink(&x, xv, &a, &mut got, Rows::dense(n, r));
        for t in 0..n {
            let xt = &x[t * stride + 5..t * stride + 5 + k];
            for j in 0..r {
                let want = dot_f32(xt, &a[j * k..(j + 1) * k]);
                assert_eq!(
                    got[t * r + j].to_bits(),
                    want.to_bits(),
                    "{n}×{k} → {r}: ({t}, {j})"
                );
                let exact: f64 = xt
                    .iter()
                    .zip(&a[j * k..])
                    .map(|(&p, &q)| p as f64 * q as f64)
                    .sum();
                assert!(
                    (want as f64 - exact).abs() < 1e-3,
                    "{n}×{k} → {r}: ({t}, {j})"
                );
            }
        }
    }
}

/// Every instance of the codebook row kernels this CPU runs (AVX2's `madd` and add, the VNNI
/// forms' `vpdpwssd`), not only the one in use, gives the scalar kernel's bits, one token and
/// four, on the file forms and the forms re-encoded at load. On a CPU without VNNI only the
/// AVX2 instance runs here.
#[cfg(target_arch = "x86_64")]
#[test]
fn every_codebook_row_kernel_instance_gives_the_scalar_bits() {
    use ferrum_backend::cpu::quant::codebook_kernel_on;
    use ferrum_backend::cpu::quant::iq_grid::is_codebook;
    use ferrum_backend::cpu::quant::packed::Isa;
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .collect();
    // Kernel `k` over `w` against the file form's scalar kernel over `file` (the same bytes,
    // or the file form of a re-encoded `w`), every token one at a time and four at once.
    let check = |name: &str, k: Kernel, dt, w: &[u8], file: &[u8], acts: &[Vec<BlockQ8K>]| {
        let (
            Kernel::Q8K {
                dot: f, dot4: f4, ..
            },
            Some(Kernel::Q8K { dot: s, .. }),
        ) = (k, scalar_kernel(dt))
        else {
            panic!("{name}: Q8_K kernels")
        };
        let four = f4(w, [&acts[0], &acts[1], &acts[2], &acts[3]]);
        for (t, a) in acts.iter().enumerate() {
            let want = s(file, a).to_bits();
            assert_eq!(f(w, a).to_bits(), want, "{name}, token {t}: one token");
            assert_eq!(four[t].to_bits(), want, "{name}, token {t}: four tokens");
        }
    };
    for &isa in &isas {
        for &dt in IQUANTS {
            // Every codebook format has every instance; IQ4_NL and IQ4_XS have none here.
            let Some(k) = codebook_kernel_on(dt, isa) else {
                assert!(!is_codebook(dt), "{dt} on {isa:?}: no row kernel");
                continue;
            };
            assert!(is_codebook(dt), "{dt}: not a codebook format");
            for trial in 0..12 {
                let n = 256 * (1 + trial % 4);
                let w = Aligned::new(&random_blocks(&mut rng, dt, n));
                let acts = q8k_tokens(&mut rng, 4, n, trial);
                let name = format!("{dt} on {isa:?}");
                check(&name, k, dt, w.bytes(), w.bytes(), &acts);
            }
        }
        for &form in Recoded::ALL {
            let dt = form.dtype();
            let k = form.kernel_on(isa).expect("every SIMD instance");
            for trial in 0..12 {
                let n = 256 * (1 + trial % 4);
                let file = Aligned::new(&random_blocks(&mut rng, dt, n));
                let mut recoded = Aligned::new(file.bytes());
                assert!(form.recode(recoded.bytes_mut()), "{form:?}: whole blocks");
                let acts = q8k_tokens(&mut rng, 4, n, trial);
                let name = format!("{form:?} on {isa:?}");
                check(&name, k, dt, recoded.bytes(), file.bytes(), &acts);
            }
        }
    }
}
