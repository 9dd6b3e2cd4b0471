//! `ferrum run --image` from the outside (issue 45): the tiny Gemma 3 of
//! tests/fixtures/vision/gemma3_it answers an image and a question with transformers' greedy
//! tokens, from its Hugging Face folder and from llama.cpp's GGUF with the mmproj file (given,
//! and found beside the model); images to a text model, and undecodable images, are errors
//! naming them.

use std::process::Command;

fn fixtures(p: &str) -> String {
    format!("{}/../../tests/fixtures/{p}", env!("CARGO_MANIFEST_DIR"))
}

/// `ferrum run` greedy on the CPU for the fixtures' six tokens.
const RUN: [&str; 7] = [
    "run",
    "--device",
    "cpu",
    "--temperature",
    "0",
    "--max-tokens",
    "6",
];

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(RUN)
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

#[test]
fn the_chat_takes_images_with_slash_image() {
    use std::io::Write;
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures("vision/gemma3_it/reference.json")).unwrap(),
    )
    .unwrap();
    let want = reference["cases"][0]["generated_text"].as_str().unwrap();
    let image = fixtures("vision/processor/rgb_300x200.png");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(RUN)
        .args([&fixtures("vision/gemma3_it"), "--exact"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("runs");
    // The first turn is the reference's one_image chat; a file that is not there is
    // reported and the chat goes on; the second turn carries the first turn's image.
    let script = format!(
        "/image '{image}'\nWhat is in this picture?\n/image /no/such.png\nAnd now?\n/exit\n"
    );
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with(want), "{stdout:?} {stderr}");
    assert!(stderr.contains("attached"), "{stderr}");
    assert!(stderr.contains("/no/such.png"), "{stderr}");
    // Two answers; the second's prompt (the first image again) is partly found cached.
    let turns: Vec<(usize, usize)> = stderr
        .lines()
        .filter_map(|l| {
            let (_, l) = l.split_once('[')?;
            let (n, rest) = l.split_once(" prompt tokens (")?;
            let (computed, _) = rest.split_once(" computed")?;
            Some((n.parse().ok()?, computed.parse().ok()?))
        })
        .collect();
    assert_eq!(turns.len(), 2, "{stderr}");
    assert_eq!(turns[0], (31, 31), "{stderr}");
    assert!(turns[1].1 < turns[1].0, "{stderr}");
}

fn json_of(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(args)
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn plan_counts_the_vision_tower_and_bench_times_an_image() {
    let folder = fixtures("vision/gemma3_it");
    let gguf = fixtures("vision/gemma3_it_gguf/model-f32.gguf");
    let mmproj = fixtures("vision/gemma3_it_gguf/mmproj-model-f32.gguf");
    let text = json_of(&["plan", &fixtures("tiny/qwen3"), "--json"]);
    assert!(text["image_rows"].is_null(), "{text}");
    let hf = json_of(&["plan", &folder, "--json"]);
    assert_eq!(hf["image_rows"], 4, "{hf}");
    assert_eq!(hf["vision_file_bytes"], 0.0, "{hf}");
    assert!(
        hf["vision_activation_bytes"].as_f64().unwrap() > 0.0,
        "{hf}"
    );
    // The mmproj beside the GGUF is mapped too: its bytes join the weights.
    let g = json_of(&["plan", &gguf, "--json"]);
    let mm_bytes = std::fs::metadata(&mmproj).unwrap().len() as f64;
    let lm_bytes = std::fs::metadata(&gguf).unwrap().len() as f64;
    assert_eq!(g["vision_file_bytes"].as_f64(), Some(mm_bytes), "{g}");
    assert_eq!(
        g["weights_bytes"].as_f64(),
        Some(mm_bytes + lm_bytes),
        "{g}"
    );
    assert_eq!(g["vision_activation_bytes"], hf["vision_activation_bytes"]);
    let named = json_of(&["plan", &gguf, "--mmproj", &mmproj, "--json"]);
    assert_eq!(named["vision_file_bytes"], g["vision_file_bytes"]);
    // Named by a bare file name from its own folder: the mmproj beside it is still found.
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(["plan", "model-f32.gguf", "--json"])
        .current_dir(fixtures("vision/gemma3_it_gguf"))
        .output()
        .unwrap();
    let bare: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(bare["vision_file_bytes"], g["vision_file_bytes"], "{bare}");

    let image = fixtures("vision/processor/rgb_300x200.png");
    let b = json_of(&[
        "bench", &folder, "--device", "cpu", "--image", &image, "--reps", "2", "--json",
    ]);
    assert_eq!(b["image_rows"], 4, "{b}");
    assert_eq!(b["image_size"], serde_json::json!([300, 200]), "{b}");
    // <start_of_image>, four rows, <end_of_image>.
    assert_eq!(b["prompt_tokens"], 6, "{b}");
    for k in ["preprocess_ms", "encode_ms", "prefill_ms"] {
        assert!(b[k].as_f64().unwrap() > 0.0, "{k}: {b}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(["bench", &fixtures("tiny/qwen3"), "--image", &image])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no vision tower"));
}

/// `ferrum run` on llama.cpp's Qwen2.5-VL and Qwen3-VL GGUF pairs (the mmproj found beside
/// the model) answers an image and a question as `llama-mtmd-cli` did on the same files
/// (tests/fixtures/vision/*_it_gguf/llamacpp.json, scripts/fixtures/qwen_vl_llamacpp_reference.py),
/// invalid UTF-8 replaced alike.
#[test]
fn qwen_vl_gguf_answers_as_llama_cpp_mtmd() {
    for family in ["qwen25vl", "qwen3vl"] {
        let dir = fixtures(&format!("vision/{family}_it_gguf"));
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/llamacpp.json")).unwrap())
                .unwrap();
        for case in reference["cases"].as_array().unwrap() {
            let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
                .args(["run", "--device", "cpu", "--temperature", "0", "--exact"])
                .args(["--max-tokens", &case["tokens"].to_string()])
                .arg(format!("{dir}/model-f32.gguf"))
                .args([
                    "--image",
                    &format!("{dir}/{}", case["image"].as_str().unwrap()),
                ])
                .args(["--prompt", case["prompt"].as_str().unwrap()])
                .output()
                .expect("runs");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{stderr}");
            let hex = case["answer_hex"].as_str().unwrap();
            let want: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let got = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                got.strip_suffix('\n').unwrap_or(&got),
                String::from_utf8_lossy(&want),
                "{family} {}",
                case["image"]
            );
        }
    }
}
