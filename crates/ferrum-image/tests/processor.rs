//! Our processors against transformers' PIL image processors on the images and configs of
//! tests/fixtures/vision/processor (scripts/fixtures/make_image_processor_refs.py).

use std::path::PathBuf;

use ferrum_image::{decode, Limits, Processor};
use serde_json::Value as Json;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision/processor")
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn pixel_values_equal_transformers() {
    let index: Json =
        serde_json::from_slice(&std::fs::read(dir().join("cases.json")).unwrap()).unwrap();
    let cases = index["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for case in cases {
        let name = case["case"].as_str().unwrap();
        let proc = Processor::from_json(&index["processors"][case["processor"].as_str().unwrap()])
            .unwrap();
        let bytes = std::fs::read(dir().join(case["image"].as_str().unwrap())).unwrap();
        let img = decode(&bytes, &Limits::default()).unwrap();
        let got = proc.process(&img).unwrap();
        let shape: Vec<usize> = case["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(got.shape, shape, "{name}: shape");
        if let Some(g) = case.get("grid") {
            let g: Vec<usize> = g
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(got.grid.map(|g| g.to_vec()), Some(g), "{name}: grid");
        }
        let want = f32s(&std::fs::read(dir().join(format!("{name}.f32"))).unwrap());
        assert_eq!(got.values.len(), want.len(), "{name}");
        let worst = got
            .values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let off = got
            .values
            .iter()
            .zip(&want)
            .filter(|(a, b)| (*a - *b).abs() > 1e-6)
            .count();
        println!(
            "{name}: max |diff| {worst:.3e}, {off} of {} off",
            want.len()
        );
        // JPEG: Pillow decodes with libjpeg-turbo, we with jpeg-decoder, whose IDCT and
        // chroma upsampling round differently: up to 3 levels of 255 apart before any
        // processing. Every other format decodes to the same bytes and must match exactly.
        let tol = if name.contains("jpeg") {
            let std = proc_min_std(&index["processors"][case["processor"].as_str().unwrap()]);
            3.0 / 255.0 / std + 1e-6
        } else {
            1e-6
        };
        if worst > tol {
            failures.push(format!("{name}: {worst:.3e} ({off} values)"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn proc_min_std(p: &Json) -> f32 {
    p.get("image_std")
        .and_then(Json::as_array)
        .map(|a| {
            a.iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .fold(1.0, f32::min)
        })
        .unwrap_or(0.5)
}
