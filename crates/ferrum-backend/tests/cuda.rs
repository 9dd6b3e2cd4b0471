//! The CUDA kernels against the CPU backend (`--features cuda`). Without a device each test
//! says so and passes; with one (or with `FERRUM_REQUIRE_CUDA=1`, as the device script sets,
//! so that a missing or broken driver fails instead of skipping) a wrong kernel fails.

use ferrum_backend::cuda::Device;
use ferrum_backend::{Backend, CpuBackend, Rows};
use ferrum_core::DType;
use ferrum_loader::RawTensor;
use rand::{Rng, SeedableRng};

#[allow(dead_code)] // the helpers other test binaries use
mod common;
use common::blocks::random_blocks;

/// The device, or `None` with the reason printed where none is required.
fn device() -> Option<Device> {
    match Device::open(0) {
        Ok(d) => {
            eprintln!("CUDA device: {}", d.describe());
            Some(d)
        }
        Err(e) if std::env::var("FERRUM_REQUIRE_CUDA").as_deref() == Ok("1") => {
            panic!("FERRUM_REQUIRE_CUDA=1 but {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn nmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    if num.is_finite() {
        num / den.max(f64::MIN_POSITIVE)
    } else {
        f64::INFINITY
    }
}

/// Without a device the probe's error says there is none (and never panics).
#[test]
fn the_probe_names_the_device_or_says_there_is_none() {
    if let Err(e) = Device::open(0) {
        let msg = e.to_string();
        assert!(msg.contains("CUDA"), "{msg}");
    }
    assert!(
        Device::open(1 << 20).is_err(),
        "no machine has that many devices"
    );
}

#[test]
fn rms_norm_matches_the_cpu_backend() {
    let Some(dev) = device() else { return };
    let cpu = CpuBackend::exact();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for (rows, width) in [(1usize, 64usize), (7, 576), (3, 4096), (2, 100)] {
        let x: Vec<f32> = (0..rows * width)
            .map(|_| rng.gen_range(-3.0..3.0))
            .collect();
        let w: Vec<f32> = (0..width).map(|_| rng.gen_range(0.5..1.5)).collect();
        let got = dev.rms_norm(&x, &w, 1e-6).expect("runs");
        let wb: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let wt = cpu
            .load_weight(&RawTensor::from_bytes("w", DType::F32, vec![width], wb).expect("f32"))
            .expect("loads");
        let mut want = vec![0f32; rows * width];
        let v = Rows::dense(rows, width);
        cpu.rms_norm(&x, v, &wt, 1e-6, &mut want, v);
        let e = nmse(&got, &want);
        assert!(e < 1e-11, "{rows}×{width}: nmse {e:e}");
    }
}

#[test]
fn q8_0_matvec_matches_the_cpu_backend() {
    let Some(dev) = device() else { return };
    let (fast, exact) = (CpuBackend::with_threads(2), CpuBackend::exact());
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    for (rows, k) in [(1usize, 32usize), (77, 512), (300, 2048), (8, 4096)] {
        let bytes = random_blocks(&mut rng, DType::Q8_0, rows * k);
        let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let got = dev.matvec_q8_0(&bytes, rows, &x).expect("runs");
        let t = RawTensor::from_bytes("w", DType::Q8_0, vec![rows, k], bytes).expect("sizes");
        for (be, tol, what) in [(&fast, 1e-10, "8-bit path"), (&exact, 5e-4, "exact")] {
            let w = be.load_weight(&t).expect("loads");
            let mut want = vec![0f32; rows];
            be.matmul(
                &x,
                Rows::dense(1, k),
                &w,
                None,
                &mut want,
                Rows::dense(1, rows),
            );
            let e = nmse(&got, &want);
            assert!(e <= tol, "{rows}×{k} against the CPU's {what}: nmse {e:e}");
        }
    }
}
