//! Vision-language models against transformers (issue 45): tests/fixtures/vision/gemma3 is a
//! tiny random-weight Gemma3ForConditionalGeneration with transformers' image features and
//! logits (scripts/fixtures/make_gemma3_vision.py).

use std::path::PathBuf;

use ferrum_backend::cpu::CpuBackend;
use ferrum_image::{decode, Limits};
use ferrum_loader::ModelFile;
use ferrum_models::vision::Vision;
use serde_json::Value as Json;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

fn reference() -> Json {
    serde_json::from_slice(&std::fs::read(fixture("vision/gemma3/reference.json")).unwrap())
        .unwrap()
}

fn floats(v: &Json) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|x| match x {
            Json::Array(_) => floats(x),
            x => vec![x.as_f64().unwrap() as f32],
        })
        .collect()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn gemma3_image_features_match_transformers() {
    let file = ModelFile::open(fixture("vision/gemma3")).unwrap();
    let be = CpuBackend::exact();
    let vision = Vision::load(&file, None, &be)
        .unwrap()
        .expect("a vision tower");
    for case in reference()["cases"].as_array().unwrap() {
        let want = floats(&case["features"]);
        let mut got = Vec::new();
        for name in case["images"].as_array().unwrap() {
            let bytes = std::fs::read(fixture(&format!(
                "vision/processor/{}",
                name.as_str().unwrap()
            )))
            .unwrap();
            let img = decode(&bytes, &Limits::default()).unwrap();
            let p = vision.processor.process(&img).unwrap();
            got.extend(vision.encode(&be, &p).unwrap());
        }
        let d = worst(&got, &want);
        println!("{}: features max |diff| {d:.3e}", case["name"]);
        assert!(d < 1e-5, "{}: {d}", case["name"]);
    }
}

/// The logits of every position of prompts with one and with two images: the exact path
/// within 1e-5 of transformers' f32 run; the default path (8-bit activations on quantised
/// weights, f16 KV; f32 weights here) no further than transformers' own bf16 run is.
#[test]
fn gemma3_logits_with_images_match_transformers() {
    use ferrum_models::{LoadOptions, Logits, Model};
    for (exact, label) in [(true, "exact"), (false, "default")] {
        let be = if exact {
            CpuBackend::exact()
        } else {
            CpuBackend::new()
        };
        let mut model = Model::open(fixture("vision/gemma3"), be, &LoadOptions::default()).unwrap();
        for case in reference()["cases"].as_array().unwrap() {
            let ids: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let vision = model.vision.as_ref().unwrap();
            let be = model.decoder.backend();
            let images: Vec<Vec<f32>> = case["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|name| {
                    let bytes = std::fs::read(fixture(&format!(
                        "vision/processor/{}",
                        name.as_str().unwrap()
                    )))
                    .unwrap();
                    let img = decode(&bytes, &Limits::default()).unwrap();
                    vision
                        .encode(be, &vision.processor.process(&img).unwrap())
                        .unwrap()
                })
                .collect();
            let mut kv = model.decoder.alloc_kv_tokens(ids.len());
            let got = model
                .forward_with_images(&mut kv, &ids, &images, Logits::All)
                .unwrap();
            let f32_ref = floats(&case["logits_f32"]);
            let bf16_ref = floats(&case["logits_bf16"]);
            let d = worst(&got, &f32_ref);
            let bf16 = worst(&bf16_ref, &f32_ref);
            println!(
                "{label} {}: max |diff| {d:.3e} (transformers bf16: {bf16:.3e}; all-causal would be {})",
                case["name"], case["max_diff_if_causal"]
            );
            if exact {
                assert!(d < 1e-5, "{}: {d}", case["name"]);
            } else {
                assert!(d <= bf16, "{}: {d} > {bf16}", case["name"]);
            }
        }
    }
}

/// An image's count and size are checked against its placeholders.
#[test]
fn mismatched_images_are_refused() {
    use ferrum_models::{LoadOptions, Logits, Model};
    let mut model = Model::open(
        fixture("vision/gemma3"),
        CpuBackend::exact(),
        &LoadOptions::default(),
    )
    .unwrap();
    let ids = [2, 297, 299, 299, 299, 299, 298, 5];
    let mut kv = model.decoder.alloc_kv_tokens(ids.len());
    let e = model
        .forward_with_images(&mut kv, &ids, &[], Logits::Last)
        .unwrap_err();
    assert!(e.to_string().contains("0 images for 1"), "{e}");
    let e = model
        .forward_with_images(&mut kv, &ids, &[vec![0.0; 64]], Logits::Last)
        .unwrap_err();
    assert!(e.to_string().contains("1 rows for 4"), "{e}");
}

/// Gemma 3 from GGUF: llama.cpp's conversion of tests/fixtures/vision/gemma3_it, the language
/// model with its mmproj file beside it (scripts/fixtures/make_gemma3_vision_gguf.py). The
/// GGUF's own tokenizer and chat template give transformers' processor's ids, and the last
/// position's logits are transformers' within what the converter's f16 projection costs
/// (the same argmax).
#[test]
fn gemma3_from_gguf_with_mmproj_matches_transformers() {
    use ferrum_models::{LoadOptions, Logits, Model};
    let dir = fixture("vision/gemma3_it_gguf");
    let file = ModelFile::open(dir.join("model-f32.gguf")).unwrap();
    let ModelFile::Gguf(g) = &file else {
        unreachable!()
    };
    let tok = ferrum_tokenizer::Tokenizer::from_gguf(g).unwrap();
    // No --mmproj: the file beside the model is found.
    let mut model = Model::load(&file, CpuBackend::exact(), &LoadOptions::default()).unwrap();
    let v = model.vision.as_ref().expect("the mmproj beside the model");
    let (marker, expansion) = v.prompt_texts(|id| tok.inner().id_to_token(id)).unwrap();
    let reference: Json =
        serde_json::from_slice(&std::fs::read(fixture("vision/gemma3_it/reference.json")).unwrap())
            .unwrap();
    for case in reference["cases"].as_array().unwrap() {
        let mut messages = case["messages"].clone();
        for m in messages.as_array_mut().unwrap() {
            if let Some(parts) = m["content"].as_array_mut() {
                for p in parts.iter_mut().filter(|p| p["type"] == "image") {
                    *p = serde_json::json!({"type": "image"});
                }
            }
        }
        let ids = tok
            .chat_prompt_with_images(
                messages.as_array().unwrap(),
                true,
                &Default::default(),
                ferrum_tokenizer::SpecialTokens::Text,
                false,
                (&marker, &expansion),
            )
            .unwrap();
        let want: Vec<u32> = case["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want, "{}: prompt ids", case["name"]);
        let v = model.vision.as_ref().unwrap();
        let be = model.decoder.backend();
        let images: Vec<Vec<f32>> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                let bytes = std::fs::read(fixture(&format!(
                    "vision/processor/{}",
                    n.as_str().unwrap()
                )))
                .unwrap();
                let img = decode(&bytes, &Limits::default()).unwrap();
                v.encode(be, &v.processor.process(&img).unwrap()).unwrap()
            })
            .collect();
        let mut kv = model.decoder.alloc_kv_tokens(ids.len());
        let got = model
            .forward_with_images(&mut kv, &ids, &images, Logits::Last)
            .unwrap();
        let want = floats(&case["last_logits"]);
        let d = worst(&got, &want);
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                .0
        };
        println!("gguf {}: last logits max |diff| {d:.3e}", case["name"]);
        assert!(d < 2e-3, "{}: {d}", case["name"]);
        assert_eq!(argmax(&got), argmax(&want), "{}", case["name"]);
    }
}
