//! The accuracy contract (issue 42): on every golden fixture, in every checkpoint dtype people
//! download, ferrum's default path is no further from the exact logits than the reference
//! framework running that checkpoint in its own dtype, on the maximum and the 90th percentile
//! over positions of `max|Δlogit| / max|logit|`, and agrees on the argmax at no fewer positions.
//!
//! - bf16 safetensors (the fixture's f32 weights rounded to bf16 here, as `torch.to(bfloat16)`
//!   does), GGUF BF16 and F16 (`model-f32.gguf` requantised here by `ferrum_quantize`, as
//!   `llama-quantize --type BF16|F16` does): against `reference-bf16.json` /
//!   `reference-gguf-{bf16,f16}.json` (transformers in float64 on those weights), with the bar
//!   set by `transformers-bf16.json` (transformers running the bf16 checkpoint in bf16). All
//!   made by `scripts/fixtures/make_dtype_references.py`.
//! - GGUF Q8_0: against `reference[-gguf]-q8_0.json` (transformers on the dequantised
//!   weights), with the bar set by `llamacpp-q8_0.json` where a fixture has it: llama.cpp's own
//!   default run of the file (8-bit activations, f16 KV cache), the reference framework for a
//!   quantised GGUF (`scripts/fixtures/llamacpp_logits.py`), judged as the same class of
//!   arithmetic ([`Rule::SameClass`]); where that llama.cpp cannot read the file as config.json
//!   means it (Qwen3.5's unequal key/value heads, Phi-3's LongRoPE), reported only.
//!
//! Every instance this CPU runs is checked, each in a process of its own (the instance is
//! fixed per process): the default path on each integer-kernel instance (`FERRUM_ISA`: scalar,
//! AVX2, the VNNI forms), held to the contract; and the opt-in bf16 path (`FERRUM_BF16=1`,
//! bf16 activations on `vdpbf16ps`) where the CPU has AVX512-BF16, and emulated on its scalar
//! twins (`FERRUM_BF16=emulate`, which runs anywhere: the bf16 arithmetic is checked on CPUs
//! without the instruction), held to [`Rule::SameClass`]. Where the CPU has the instruction, the
//! emulation gives its bits.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrum_backend::CpuBackend;
use serde::Deserialize;

mod common;
use common::{distance, logits_all, Distance};

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn fixtures_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every fixture with the contract's references.
fn fixtures() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for group in ["tiny", "arch", "moe"] {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_root().join(group))
            .expect("fixtures folder")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|d| d.join("reference-bf16.json").exists())
            .collect();
        dirs.sort();
        out.extend(dirs);
    }
    out
}

fn reference(path: &Path) -> Option<Reference> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn run(path: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    logits_all(CpuBackend::new(), path, tokens)
}

/// f32 → bf16, round to nearest even (torch's `.to(torch.bfloat16)`; no value here is NaN).
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The fixture as a bf16 safetensors checkpoint: its folder's files, with every F32 tensor of
/// model.safetensors rounded to BF16.
fn bf16_checkpoint(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let keep = name.ends_with(".json") && !name.starts_with("reference")
            || name.ends_with(".jinja")
            || name == "tokenizer.model";
        if keep && !name.starts_with("transformers") && !name.starts_with("llamacpp") {
            std::fs::copy(&p, dst.join(&name)).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let (dtype, data) = match view.dtype() {
            safetensors::Dtype::F32 => (
                safetensors::Dtype::BF16,
                view.data()
                    .chunks_exact(4)
                    .flat_map(|c| {
                        bf16_bits(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
                    })
                    .collect(),
            ),
            other => (other, view.data().to_vec()),
        };
        owned.push((name, dtype, view.shape().to_vec(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}

/// How a run is judged against its bar.
#[derive(Clone, Copy)]
enum Rule {
    /// The contract: no further on the maximum or the 90th percentile, no fewer argmax
    /// positions.
    Contract,
    /// Within [`LOOSE`] times the bar on the maximum and the 90th percentile, and at most one
    /// argmax position fewer: for arithmetic of the bar's own class, whose errors are as large
    /// as the bar's and independent of them (which of two such runs is closer on a given
    /// fixture is chance). The default path on Q8_0 files (8-bit activations, as llama.cpp:
    /// measured, ferrum and llama.cpp are as far from each other as from the reference), and
    /// the opt-in `vdpbf16ps` path on bf16 weights (bf16 activations: on these fixtures about
    /// half as far from the exact logits as transformers' bf16 run, but with near ties it
    /// loses a top-1 token or an expert choice that transformers keeps; docs/accuracy.md).
    SameClass,
}

const LOOSE: f64 = 1.5;

impl Rule {
    fn holds(self, d: Distance, bar: Distance, positions: usize) -> bool {
        match self {
            Rule::Contract => d.max <= bar.max && d.p90 <= bar.p90 && d.argmax >= bar.argmax,
            Rule::SameClass => {
                d.max <= LOOSE * bar.max
                    && d.p90 <= LOOSE * bar.p90
                    && d.argmax + 1.0 / positions as f64 >= bar.argmax - 1e-9
            }
        }
    }
}

/// One process's share: every fixture in every format, against the contract (or, with
/// `record`, writing the logits for the parent to compare bit for bit).
fn check_all(scratch: &Path, record: Option<&Path>, strict: bool) -> Vec<String> {
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for dir in fixtures() {
        let name = format!(
            "{}/{}",
            dir.parent().unwrap().file_name().unwrap().to_string_lossy(),
            dir.file_name().unwrap().to_string_lossy()
        );
        let exact = reference(&dir.join("reference-bf16.json")).unwrap();
        let hf = reference(&dir.join("transformers-bf16.json")).expect("transformers-bf16.json");
        let bar = distance(&hf.logits, &exact.logits);
        let work = scratch.join(name.replace('/', "-"));
        let st = work.join("bf16-safetensors");
        bf16_checkpoint(&dir, &st);
        // The float formats: the contract on the default path, the same class on the opt-in
        // bf16 one.
        let float_rule = if strict {
            Rule::Contract
        } else {
            Rule::SameClass
        };
        let mut cases: Vec<(&str, PathBuf, Reference, Distance, &str, Rule)> = vec![(
            "safetensors BF16",
            st,
            exact,
            bar,
            "transformers bf16",
            float_rule,
        )];
        let f32_gguf = dir.join("model-f32.gguf");
        if f32_gguf.exists() {
            for (tag, ft) in [
                ("bf16", ferrum_quantize::FileType::BF16),
                ("f16", ferrum_quantize::FileType::F16),
            ] {
                let out = work.join(format!("model-{tag}.gguf"));
                ferrum_quantize::quantize_file(&f32_gguf, &out, ft)
                    .unwrap_or_else(|e| panic!("{name}: quantize to {tag}: {e}"));
                let r = reference(&dir.join(format!("reference-gguf-{tag}.json")))
                    .unwrap_or_else(|| panic!("{name}: reference-gguf-{tag}.json"));
                let label = if tag == "bf16" {
                    "GGUF BF16"
                } else {
                    "GGUF F16"
                };
                cases.push((label, out, r, bar, "transformers bf16", float_rule));
            }
        }
        let q8 = dir.join("model-q8_0.gguf");
        if q8.exists() {
            let r = reference(&dir.join("reference-gguf-q8_0.json"))
                .or_else(|| reference(&dir.join("reference-q8_0.json")))
                .expect("a q8_0 reference");
            match reference(&dir.join("llamacpp-q8_0.json")) {
                Some(lc) => {
                    let lbar = distance(&lc.logits, &r.logits);
                    cases.push((
                        "GGUF Q8_0",
                        q8.clone(),
                        r,
                        lbar,
                        "llama.cpp",
                        Rule::SameClass,
                    ));
                }
                // llama.cpp cannot read the file as config.json means it (llamacpp_logits.py)
                // and nothing else runs 8-bit activations: reported, not judged (8-bit
                // activations are a coarser class than transformers' bf16; docs/accuracy.md).
                None => {
                    let d = distance(&run(&q8, &r.tokens), &r.logits);
                    eprintln!(
                        "{name:<28} GGUF Q8_0         ferrum {d}   (no llama.cpp bar; \
                         transformers bf16 {bar}): not judged"
                    );
                }
            }
        }
        for (label, path, want, bar, bar_name, rule) in cases {
            let got = run(&path, &want.tokens);
            if let Some(dir) = record {
                let bits: Vec<u8> = got.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
                let file = format!("{}-{}.bin", name.replace('/', "-"), label.replace(' ', "-"));
                std::fs::write(dir.join(file), bits).unwrap();
            }
            let d = distance(&got, &want.logits);
            let ok = rule.holds(d, bar, got.len());
            rows.push(format!(
                "{name:<28} {label:<17} ferrum {d}   {bar_name} {bar}{}",
                if ok { "" } else { "   <-- FAILS" }
            ));
            if !ok {
                failures.push(format!("{name} {label}: ferrum {d} vs {bar_name} {bar}"));
            }
        }
    }
    eprintln!("{}", rows.join("\n"));
    failures
}

/// The child's entry point (run by [`contract_holds_on_every_instance`] with the instance in
/// its environment; ignored on its own).
#[test]
#[ignore = "run by contract_holds_on_every_instance in a process per instance"]
fn contract_child() {
    let scratch = PathBuf::from(std::env::var("FERRUM_CONTRACT_SCRATCH").expect("scratch dir"));
    let record = std::env::var("FERRUM_CONTRACT_RECORD")
        .ok()
        .map(PathBuf::from);
    eprintln!("instance: {}", ferrum_backend::cpu::simd::simd_name());
    let strict = std::env::var("FERRUM_CONTRACT_STRICT").as_deref() != Ok("0");
    let failures = check_all(&scratch, record.as_deref(), strict);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Variables a child process runs with.
type Env = Vec<(&'static str, String)>;

#[test]
fn contract_holds_on_every_instance() {
    use ferrum_backend::cpu::quant::packed::Isa;
    let root = std::env::temp_dir().join(format!("ferrum-contract-{}", std::process::id()));
    let native_bf16 = ferrum_backend::cpu::simd::bf16_dot_runs();
    // (name, environment, held to the contract): the default path on every integer-kernel
    // instance; the opt-in bf16 path on the instruction and emulated (see `LOOSE`).
    let mut runs: Vec<(String, Env, bool)> = Vec::new();
    for isa in Isa::available() {
        runs.push((
            isa.name().to_string(),
            vec![("FERRUM_ISA", isa.name().into())],
            true,
        ));
    }
    if native_bf16 {
        runs.push(("bf16".into(), vec![("FERRUM_BF16", "1".into())], false));
    } else {
        eprintln!(
            "this CPU lacks AVX512-BF16: the vdpbf16ps kernels were not run; \
             their arithmetic is checked through FERRUM_BF16=emulate"
        );
    }
    runs.push((
        "bf16-emulated".into(),
        vec![("FERRUM_BF16", "emulate".into())],
        false,
    ));
    let exe = std::env::current_exe().unwrap();
    let mut failed = Vec::new();
    for (name, env, strict) in &runs {
        let scratch = root.join(name);
        let record = root.join(format!("{name}-logits"));
        std::fs::create_dir_all(&record).unwrap();
        let out = Command::new(&exe)
            .args(["contract_child", "--exact", "--ignored", "--nocapture"])
            .env("FERRUM_CONTRACT_SCRATCH", &scratch)
            .env("FERRUM_CONTRACT_RECORD", &record)
            .env("FERRUM_CONTRACT_STRICT", if *strict { "1" } else { "0" })
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr);
        eprintln!("==== {name}\n{log}");
        if !out.status.success() {
            failed.push(name.clone());
        }
    }
    // The emulation is the instruction's arithmetic: the same bits, model by model.
    if native_bf16 && failed.is_empty() {
        let (a, b) = (root.join("bf16-logits"), root.join("bf16-emulated-logits"));
        let mut compared = 0;
        for e in std::fs::read_dir(&a).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap();
            assert!(
                std::fs::read(&p).unwrap() == std::fs::read(b.join(name)).unwrap(),
                "{name:?}: the emulated bf16 path differs from vdpbf16ps"
            );
            compared += 1;
        }
        assert!(compared > 20, "only {compared} runs compared");
    }
    std::fs::remove_dir_all(&root).ok();
    assert!(failed.is_empty(), "the contract fails on: {failed:?}");
}

type MakeBackend = fn() -> CpuBackend;

/// The README's accuracy table: every fixture as a bf16 checkpoint on each numeric path of
/// this process's instance (`FERRUM_BF16=1` for the opt-in bf16 path), against
/// reference-bf16.json, beside transformers' bf16 run. Prints; asserts nothing (the contract
/// above does): `cargo test -p ferrum-models --test dtype_contract accuracy_table --
/// --ignored --nocapture`.
#[test]
#[ignore = "prints the README's accuracy table"]
fn accuracy_table() {
    use ferrum_backend::cpu::KvDtype;
    let scratch = std::env::temp_dir().join(format!("ferrum-accuracy-{}", std::process::id()));
    let paths: [(&str, MakeBackend); 4] = [
        (
            "exact (--exact: f32 activations, f32 KV)",
            CpuBackend::exact,
        ),
        ("default (f16 KV)", CpuBackend::new),
        ("default, --kv-dtype f32", || {
            CpuBackend::new().with_kv(KvDtype::F32)
        }),
        ("default, --kv-dtype q8_0", || {
            CpuBackend::new().with_kv(KvDtype::Q8_0)
        }),
    ];
    let mut rows: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); paths.len() + 1];
    for dir in fixtures() {
        let exact = reference(&dir.join("reference-bf16.json")).unwrap();
        let hf = reference(&dir.join("transformers-bf16.json")).unwrap();
        let bar = distance(&hf.logits, &exact.logits);
        rows[paths.len()].push((bar.max, bar.p90, bar.argmax));
        let st = scratch.join(dir.file_name().unwrap());
        bf16_checkpoint(&dir, &st);
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let c = if cfg["text_config"].is_object() {
            &cfg["text_config"]
        } else {
            &cfg
        };
        let head_dim = c["head_dim"].as_u64().unwrap_or_else(|| {
            c["hidden_size"].as_u64().unwrap() / c["num_attention_heads"].as_u64().unwrap()
        });
        for (i, (name, be)) in paths.iter().enumerate() {
            if name.contains("q8_0") && head_dim % 32 != 0 {
                continue; // a Q8_0 cache needs heads of whole 32-value blocks
            }
            let d = distance(&logits_all(be(), &st, &exact.tokens), &exact.logits);
            // Relative to the bar, fixture by fixture.
            rows[i].push((d.max / bar.max, d.p90 / bar.p90, d.argmax));
        }
    }
    std::fs::remove_dir_all(&scratch).ok();
    println!(
        "instance: {}; {} fixtures as bf16 checkpoints",
        ferrum_backend::cpu::simd::simd_name(),
        rows[0].len()
    );
    println!(
        "| path | fixtures | max / bar: median, worst | p90 / bar: median, worst | argmax agreement: lowest |"
    );
    println!("|---|--:|--:|--:|--:|");
    let names = paths.iter().map(|p| p.0);
    for (i, name) in names
        .chain(["transformers bf16 (the bar; absolute)"])
        .enumerate()
    {
        let col = |f: fn(&(f64, f64, f64)) -> f64| -> Vec<f64> {
            let mut v: Vec<f64> = rows[i].iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let (mx, p9, am) = (col(|r| r.0), col(|r| r.1), col(|r| r.2));
        // Median and worst (the last, sorted); the lowest argmax agreement.
        let pair = |v: &[f64]| {
            let (m, w) = (v[v.len() / 2], v[v.len() - 1]);
            if i == paths.len() {
                format!("{m:.1e}, {w:.1e}")
            } else {
                format!("{m:.3}, {w:.3}")
            }
        };
        println!(
            "| {name} | {} | {} | {} | {:.3} |",
            mx.len(),
            pair(&mx),
            pair(&p9),
            am[0]
        );
    }
}
