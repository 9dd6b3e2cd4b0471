//! A prefill's matmul through the tile path of the packed kernels (`FERRUM_AMX=emulate`: the
//! AMX kernels on emulated tiles, so a CPU without AMX runs the whole pass): every token of
//! a many-token matmul gets the bits it gets alone (one token never takes the tiles), for each
//! format with a tile kernel, over row counts that leave a group without a partner, with a
//! bias, into a window of wider rows. Its own test binary: the mode is fixed per process.

use ferrum_backend::{Backend, CpuBackend, Rows};
use ferrum_core::DType;
use ferrum_loader::RawTensor;
use rand::{Rng, SeedableRng};

#[allow(dead_code)] // the helpers other test binaries use
mod common;
use common::blocks::random_blocks;

#[test]
fn tile_pass_gives_each_token_its_bits_alone() {
    // Before anything reads the mode.
    std::env::set_var("FERRUM_AMX", "emulate");
    if !ferrum_backend::cpu::quant::amx::vectors_run() {
        eprintln!("this CPU lacks AVX-512 F/BW/VL: the tile pass was not checked");
        return;
    }
    let be = CpuBackend::with_threads(2);
    assert!(
        be.name().contains("+amx"),
        "the tile path is in use: {}",
        be.name()
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let (k, width, at) = (512, 130, 5);
    for dt in [
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        // The 32-value formats take the tiles only in passes of `amx::MIN_TOKENS_32` (an
        // encoder's): below it the VNNI kernels, at 130 tokens the tiles, and either way
        // each token's bits are its own pass's.
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ] {
        // 120 rows: 15 groups, so some task holds a group whose partner is in another task.
        let m = 120;
        let w = be
            .load_weight(
                &RawTensor::from_bytes("w", dt, vec![m, k], random_blocks(&mut rng, dt, m * k))
                    .expect("sizes match"),
            )
            .expect("weight loads");
        let bias: Vec<u8> = (0..m)
            .flat_map(|_| rng.gen_range(-1.0f32..1.0).to_le_bytes())
            .collect();
        let bias = be
            .load_weight(&RawTensor::from_bytes("b", DType::F32, vec![m], bias).expect("f32"))
            .expect("bias loads");
        for n in [16, 37, 130] {
            let x: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let mut out = vec![0f32; n * width];
            let ov = Rows::columns(n, width, at, m);
            be.matmul(&x, Rows::dense(n, k), &w, Some(&bias), &mut out, ov);
            for t in 0..n {
                let xt = x[t * k..(t + 1) * k].to_vec();
                let mut alone = vec![0f32; width];
                let ov1 = Rows::columns(1, width, at, m);
                be.matmul(&xt, Rows::dense(1, k), &w, Some(&bias), &mut alone, ov1);
                for j in 0..m {
                    let (got, one) = (out[t * width + at + j], alone[at + j]);
                    assert_eq!(got.to_bits(), one.to_bits(), "{dt} n={n} token {t} row {j}");
                }
            }
        }
    }
}
