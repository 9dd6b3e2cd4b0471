//! `--device` and `ferrum devices` from the outside: a device that is not there, or no Vulkan
//! driver at all, is a one-line error and exit status 1, never a panic; `auto` falls back to
//! the CPU where no GPU is listed; and a tiny model's logits on Vulkan are the CPU's exact
//! ones to within the order of additions.

use std::process::Command;

fn ferrum(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferrum"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fixture() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny/qwen3/model-q8_0.gguf"
    )
    .to_string()
}

fn logits(stdout: &str) -> Vec<Vec<f32>> {
    let v: serde_json::Value = serde_json::from_str(stdout).expect("JSON");
    serde_json::from_value(v["logits"].clone()).expect("rows")
}

#[test]
fn missing_devices_and_drivers_are_clear_errors() {
    let m = fixture();
    let (ok, _, err) = ferrum(
        &[
            "logits",
            "--model",
            &m,
            "--tokens",
            "1,2",
            "--device",
            "vulkan:99",
        ],
        &[],
    );
    assert!(!ok);
    assert!(
        err.contains("no Vulkan device 99") || err.contains("no Vulkan"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // A loader that finds no driver.
    let none = [
        ("VK_DRIVER_FILES", "/nonexistent/icd.json"),
        ("VK_ICD_FILENAMES", "/nonexistent/icd.json"),
    ];
    let (ok, _, err) = ferrum(
        &[
            "logits", "--model", &m, "--tokens", "1,2", "--device", "vulkan",
        ],
        &none,
    );
    assert!(!ok && err.contains("no Vulkan device"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (ok, out, _) = ferrum(&["devices"], &none);
    assert!(ok && out.starts_with("cpu"), "{out}");
    // `auto` with no GPU runs on the CPU.
    let (ok, out, err) = ferrum(&["logits", "--model", &m, "--tokens", "1,2"], &none);
    assert!(ok, "{err}");
    assert!(err.contains("cpu ("), "{err}");
    assert_eq!(logits(&out).len(), 2);
    let (ok, _, err) = ferrum(
        &["logits", "--model", &m, "--tokens", "1", "--device", "tpu"],
        &[],
    );
    assert!(!ok && err.contains("unknown device"), "{err}");
}

#[test]
fn logits_on_vulkan_are_the_cpus_exact_ones() {
    let (_, devices, _) = ferrum(&["devices"], &[]);
    if !devices.contains("vulkan:0") {
        assert!(
            std::env::var("FERRUM_REQUIRE_VULKAN").as_deref() != Ok("1"),
            "FERRUM_REQUIRE_VULKAN=1 but no device: {devices}"
        );
        eprintln!("skipped: no Vulkan device");
        return;
    }
    let m = fixture();
    let tokens = "3,17,99,4,250,1,77,42";
    let (ok, gpu, err) = ferrum(
        &[
            "logits", "--model", &m, "--tokens", tokens, "--device", "vulkan",
        ],
        &[],
    );
    assert!(ok, "{err}");
    assert!(
        err.contains("vulkan:0"),
        "the load line names the device: {err}"
    );
    let (ok, cpu, err) = ferrum(
        &[
            "logits", "--model", &m, "--tokens", tokens, "--device", "cpu", "--exact",
        ],
        &[],
    );
    assert!(ok, "{err}");
    let (gpu, cpu) = (logits(&gpu), logits(&cpu));
    assert_eq!(gpu.len(), 8);
    for (g, c) in gpu.iter().zip(&cpu) {
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = g.iter().zip(c).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-5 * scale, "{diff} vs {scale}");
    }
}
