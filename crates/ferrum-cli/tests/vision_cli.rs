//! `ferrum run --image` from the outside (issue 45): the tiny Gemma 3 of
//! tests/fixtures/vision/gemma3_it answers an image and a question with transformers' greedy
//! tokens, from its Hugging Face folder and from llama.cpp's GGUF with the mmproj file (given,
//! and found beside the model); images to a text model, and undecodable images, are errors
//! naming them.

use std::process::Command;

fn fixtures(p: &str) -> String {
    format!("{}/../../tests/fixtures/{p}", env!("CARGO_MANIFEST_DIR"))
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args([
            "run",
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--max-tokens",
            "6",
        ])
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn run_with_an_image_answers_as_transformers() {
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures("vision/gemma3_it/reference.json")).unwrap(),
    )
    .unwrap();
    let case = &reference["cases"][0];
    assert_eq!(case["name"], "one_image");
    let want = case["generated_text"].as_str().unwrap();
    let image = fixtures("vision/processor/rgb_300x200.png");
    let gguf = fixtures("vision/gemma3_it_gguf/model-f32.gguf");
    let mmproj = fixtures("vision/gemma3_it_gguf/mmproj-model-f32.gguf");
    for model in [fixtures("vision/gemma3_it"), gguf.clone()] {
        let (ok, out, err) = run(&[
            &model,
            "--exact",
            "--image",
            &image,
            "--prompt",
            "What is in this picture?",
        ]);
        assert!(ok, "{model}: {err}");
        assert_eq!(out.trim_end_matches('\n'), want, "{model}: {err}");
        assert!(err.contains("31 prompt tokens"), "{err}");
    }
    let (ok, out, err) = run(&[
        &gguf,
        "--exact",
        "--mmproj",
        &mmproj,
        "--image",
        &image,
        "--prompt",
        "What is in this picture?",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim_end_matches('\n'), want);
}

#[test]
fn images_the_model_cannot_take_are_errors() {
    let image = fixtures("vision/processor/rgb_300x200.png");
    let (ok, _, err) = run(&[
        &fixtures("tiny/qwen3"),
        "--image",
        &image,
        "--prompt",
        "What is in this picture?",
    ]);
    assert!(!ok);
    assert!(err.contains("does not take images"), "{err}");
    let (ok, _, err) = run(&[
        &fixtures("vision/gemma3_it"),
        "--image",
        &fixtures("vision/gemma3_it/config.json"),
        "--prompt",
        "?",
    ]);
    assert!(!ok);
    assert!(err.contains("config.json"), "{err}");
}
