//! Vector kernels with a scalar twin each. The AVX2+FMA versions are picked once at start-up
//! by runtime feature detection, so one binary runs (correctly) on any x86-64 or other CPU.
//! The scalar twins use the same eight-lane, four-accumulator summation order as the SIMD
//! code, so the two agree to the last bits and tests can hold them nearly equal.

use std::sync::OnceLock;

pub type DotFn = fn(&[f32], &[f32]) -> f32;

fn pick_dot() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return |a, b| {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                unsafe { avx2::dot_f32(a, b) }
            };
        }
    }
    dot_f32_scalar
}

/// The dot kernel this CPU uses, resolved once (hot loops call it without the lookup).
pub fn dot_fn() -> DotFn {
    static DOT: OnceLock<DotFn> = OnceLock::new();
    *DOT.get_or_init(pick_dot)
}

/// The axpy kernel this CPU uses.
pub fn axpy_fn() -> AxpyFn {
    static AXPY: OnceLock<AxpyFn> = OnceLock::new();
    *AXPY.get_or_init(pick_axpy)
}

/// `Σ a[i]·b[i]` over the shorter of the two slices' common length (callers pass equal
/// lengths).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_fn()(a, b)
}

pub type AxpyFn = fn(f32, &[f32], &mut [f32]);

fn pick_axpy() -> AxpyFn {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return |a, x, y| {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                unsafe { avx2::axpy(a, x, y) }
            };
        }
    }
    axpy_scalar
}

/// `y += a · x` (attention's weighted sum of values).
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    axpy_fn()(a, x, y)
}

pub fn axpy_scalar(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

pub type DotF16Fn = fn(&[f32], &[half::f16]) -> f32;
pub type AxpyF16Fn = fn(f32, &[half::f16], &mut [f32]);

/// `Σ a[i]·b[i]` with `b` in f16 (keys in an f16 KV cache).
pub fn dot_f16_fn() -> DotF16Fn {
    static F: OnceLock<DotF16Fn> = OnceLock::new();
    *F.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if super::quant::has_avx2() {
                // SAFETY: AVX2, FMA and F16C detected.
                return |a, b| unsafe { avx2::dot_f16(a, b) };
            }
        }
        dot_f16_scalar
    })
}

/// `y += a · x` with `x` in f16 (values in an f16 KV cache).
pub fn axpy_f16_fn() -> AxpyF16Fn {
    static F: OnceLock<AxpyF16Fn> = OnceLock::new();
    *F.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if super::quant::has_avx2() {
                // SAFETY: AVX2, FMA and F16C detected.
                return |a, x, y| unsafe { avx2::axpy_f16(a, x, y) };
            }
        }
        axpy_f16_scalar
    })
}

pub fn dot_f16_scalar(a: &[f32], b: &[half::f16]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum()
}

pub fn axpy_f16_scalar(a: f32, x: &[half::f16], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi.to_f32();
    }
}

/// Whether the SIMD path is in use (for the load summary).
pub fn simd_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return "avx2+fma";
        }
    }
    "scalar"
}

pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let main = n - n % 32;
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i < main {
        for (r, accr) in acc.iter_mut().enumerate() {
            for (l, accl) in accr.iter_mut().enumerate() {
                let k = i + r * 8 + l;
                *accl = a[k].mul_add(b[k], *accl);
            }
        }
        i += 32;
    }
    let mut lanes = [0f32; 8];
    for l in 0..8 {
        lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    let mut sum = hsum8(&lanes);
    for k in main..n {
        sum = a[k].mul_add(b[k], sum);
    }
    sum
}

/// Horizontal sum in the order the AVX2 reduction uses.
fn hsum8(l: &[f32; 8]) -> f32 {
    let q = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let h = [q[0] + q[2], q[1] + q[3]];
    h[0] + h[1]
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let main = n - n % 32;
        let pa = a.as_ptr();
        let pb = b.as_ptr();
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut acc2 = _mm256_setzero_ps();
        let mut acc3 = _mm256_setzero_ps();
        let mut i = 0;
        while i < main {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
            acc2 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 16)),
                _mm256_loadu_ps(pb.add(i + 16)),
                acc2,
            );
            acc3 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 24)),
                _mm256_loadu_ps(pb.add(i + 24)),
                acc3,
            );
            i += 32;
        }
        let acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
        let q = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        // [q0+q2, q1+q3, ..] then lane0 + lane1.
        let h = _mm_add_ps(q, _mm_movehl_ps(q, q));
        let s = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        let mut sum = _mm_cvtss_f32(s);
        for k in main..n {
            sum = (*pa.add(k)).mul_add(*pb.add(k), sum);
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(a: &[f32], b: &[half::f16]) -> f32 {
        let n = a.len().min(b.len());
        let main = n - n % 8;
        let (pa, pb) = (a.as_ptr(), b.as_ptr() as *const u16);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < main {
            let kb = _mm256_cvtph_ps(_mm_loadu_si128(pb.add(i) as *const __m128i));
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), kb, acc);
            i += 8;
        }
        let q = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let h = _mm_add_ps(q, _mm_movehl_ps(q, q));
        let mut sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
        for (x, y) in a[main..n].iter().zip(&b[main..n]) {
            sum += x * y.to_f32();
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16(a: f32, x: &[half::f16], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let main = n - n % 8;
        let av = _mm256_set1_ps(a);
        let (px, py) = (x.as_ptr() as *const u16, y.as_mut_ptr());
        let mut i = 0;
        while i < main {
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(px.add(i) as *const __m128i));
            _mm256_storeu_ps(
                py.add(i),
                _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(py.add(i))),
            );
            i += 8;
        }
        for (yi, xi) in y[main..n].iter_mut().zip(&x[main..n]) {
            *yi += a * xi.to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let main = n - n % 8;
        let av = _mm256_set1_ps(a);
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let mut i = 0;
        while i < main {
            let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), r);
            i += 8;
        }
        for k in main..n {
            *py.add(k) += a * *px.add(k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn f16_kernels_equal_scalar_twins() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for n in [0, 5, 8, 64, 131] {
            let a: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let b: Vec<half::f16> = (0..n)
                .map(|_| half::f16::from_f32(rng.gen_range(-1.0..1.0)))
                .collect();
            let (fast, slow) = (dot_f16_fn()(&a, &b), dot_f16_scalar(&a, &b));
            assert!((fast - slow).abs() <= 1e-5 * (n as f32).max(1.0), "n={n}");
            let (mut y1, mut y2) = (a.clone(), a.clone());
            axpy_f16_fn()(0.3, &b, &mut y1);
            axpy_f16_scalar(0.3, &b, &mut y2);
            for (p, q) in y1.iter().zip(&y2) {
                assert!((p - q).abs() <= 1e-6);
            }
        }
    }

    #[test]
    fn simd_axpy_equals_scalar_twin() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for n in [0, 3, 8, 64, 77] {
            let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let y0: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (mut a, mut b) = (y0.clone(), y0.clone());
            axpy(0.37, &x, &mut a);
            axpy_scalar(0.37, &x, &mut b);
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= 1e-6, "n={n}");
            }
        }
    }

    #[test]
    fn simd_dot_equals_scalar_twin_and_f64_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for n in [0, 1, 7, 31, 32, 33, 64, 100, 576, 1536, 4099] {
            let a: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let scalar = dot_f32_scalar(&a, &b);
            let fast = dot_f32(&a, &b);
            assert_eq!(
                scalar.to_bits(),
                fast.to_bits(),
                "n={n}: {scalar} vs {fast}"
            );
            assert!(
                (scalar as f64 - exact).abs() <= 1e-5 * (n as f64).sqrt().max(1.0),
                "n={n}"
            );
        }
    }
}
