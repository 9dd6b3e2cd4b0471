//! LoRA adapters (issue 48) against peft and llama.cpp: random PEFT adapters on the tiny
//! Llama and Qwen3 (`scripts/fixtures/make_lora_adapters.py`: attention only, MLP only, all
//! seven projections, rank and alpha patterns, rsLoRA, ranks 4 to 16), from the PEFT folder
//! and from llama.cpp's GGUF conversion, on the Hugging Face base and on its f32 GGUF (whose
//! Llama query and key rows are permuted: the adapter's are permuted to match).

use std::path::{Path, PathBuf};

use ferrum_backend::CpuBackend;
use ferrum_models::decoder::SeqChunk;
use ferrum_models::lora::AdapterSource;
use ferrum_models::{LoadOptions, Logits, Model};

mod common;
use common::{floats, read_json};

const ADAPTERS: &[&str] = &[
    "llama-attn-r4",
    "llama-mlp-r16-rslora",
    "llama-all-r8",
    "llama-patterns",
    "qwen3-all-r16",
    "qwen3-qv-r16-rslora",
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

struct Fixture {
    dir: PathBuf,
    base: PathBuf,
    tokens: Vec<u32>,
    unmerged: Vec<Vec<f32>>,
    merged: Vec<Vec<f32>>,
    base_logits: Vec<Vec<f32>>,
    llamacpp: Vec<Vec<f32>>,
    /// The exact logits of the scaling llama.cpp applies (global alpha over each update's
    /// rank: peft's, but for rsLoRA and alpha patterns).
    exact_llamacpp: Vec<Vec<f32>>,
}

fn rows(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array().unwrap().iter().map(floats).collect()
}

fn fixture(name: &str) -> Fixture {
    let dir = fixtures().join("lora").join(name);
    let r = read_json(&dir.join("reference.json"));
    let l = read_json(&dir.join("llamacpp.json"));
    Fixture {
        base: fixtures().join("../..").join(r["base"].as_str().unwrap()),
        tokens: common::ids(&r["tokens"]),
        unmerged: rows(&r["unmerged"]),
        merged: rows(&r["merged"]),
        base_logits: rows(&r["base_logits"]),
        llamacpp: rows(&l["logits"]),
        exact_llamacpp: rows(&l["exact"]),
        dir,
    }
}

/// Every position's logits with the adapter at `adapter` (a folder or a GGUF) on the base
/// model at `base`, one pass.
fn run(be: CpuBackend, base: &Path, adapter: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut m = Model::open(
        base,
        be,
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", base.display()));
    let id = m
        .load_adapter(
            "a",
            &AdapterSource {
                path: adapter,
                scale: 1.0,
            },
        )
        .unwrap_or_else(|e| panic!("{}: {e}", adapter.display()));
    let mut kv = m.decoder.alloc_kv(4, 16);
    let tables = [vec![0u32, 1, 2, 3]];
    let chunk = SeqChunk {
        tokens,
        start: 0,
        tables: &tables,
        logits: Logits::All,
        state: 0,
        adapter: id,
        embeds: &[],
        grids: &[],
    };
    let v = m.decoder.config.vocab_size;
    let all = m.decoder.forward_batch(&mut kv, &[chunk]).unwrap();
    all.chunks(v).map(|r| r.to_vec()).collect()
}

/// The largest `|Δlogit| / max|logit|` over positions.
fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
        })
        .fold(0f32, f32::max)
}

#[test]
fn peft_adapters_match_peft_on_the_exact_path() {
    for name in ADAPTERS {
        let f = fixture(name);
        // The adapter must matter, or the comparison proves nothing.
        assert!(
            worst(&f.base_logits, &f.unmerged) > 0.05,
            "{name}: adapter too weak"
        );
        assert!(
            worst(&f.merged, &f.unmerged) < 1e-5,
            "{name}: peft merged vs unmerged"
        );
        for base in [f.base.clone(), f.base.join("model-f32.gguf")] {
            let got = run(CpuBackend::exact(), &base, &f.dir, &f.tokens);
            let (u, m) = (worst(&got, &f.unmerged), worst(&got, &f.merged));
            eprintln!(
                "{name} on {}: vs unmerged {u:.2e}, vs merged {m:.2e}",
                base.display()
            );
            assert!(
                u < 1e-5 && m < 1e-5,
                "{name} on {}: {u:.2e} / {m:.2e}",
                base.display()
            );
        }
    }
}

#[test]
fn gguf_adapters_match_llamacpp_and_peft() {
    for name in ADAPTERS {
        let f = fixture(name);
        let gguf = f.dir.join("adapter-f32.gguf");
        let base_gguf = f.base.join("model-f32.gguf");
        // The GGUF adapter means what llama.cpp makes of it (alpha over each update's rank),
        // exactly, on the GGUF base and on the Hugging Face one (which unpermutes it).
        for base in [base_gguf.clone(), f.base.clone()] {
            let got = run(CpuBackend::exact(), &base, &gguf, &f.tokens);
            let e = worst(&got, &f.exact_llamacpp);
            assert!(e < 1e-5, "{name} GGUF on {}: {e:.2e}", base.display());
        }
        // And llama.cpp's own run is no further from us than from those exact logits (its
        // f16 KV cache).
        let got = run(CpuBackend::exact(), &base_gguf, &gguf, &f.tokens);
        let d = worst(&got, &f.llamacpp);
        let bar = worst(&f.exact_llamacpp, &f.llamacpp);
        eprintln!(
            "{name}: GGUF adapter vs llama.cpp {d:.2e} (the exact logits vs llama.cpp {bar:.2e})"
        );
        assert!(d <= bar + 1e-4, "{name}: {d:.2e} from llama.cpp");
        // Where llama.cpp's scaling is peft's, that is peft's answer.
        let peft_like = worst(&f.exact_llamacpp, &f.unmerged) < 1e-6;
        let rslora = name.contains("rslora") || name.contains("patterns");
        assert_eq!(
            peft_like, !rslora,
            "{name}: which scaling the fixture holds"
        );
    }
}

#[test]
fn default_path_stays_near_peft() {
    for name in ADAPTERS {
        let f = fixture(name);
        let got = run(CpuBackend::new(), &f.base, &f.dir, &f.tokens);
        let d = worst(&got, &f.unmerged);
        eprintln!("{name}: default path vs peft {d:.2e}");
        assert!(d < 5e-3, "{name}: default path {d:.2e} from peft");
    }
}

/// One pass holding the base model and three adapters, each sequence's logits bit-equal to
/// the same sequence alone (prefill, then a decode step).
#[test]
fn a_batch_of_adapters_gives_each_row_its_own_logits() {
    let base = fixtures().join("tiny/llama");
    let mut m = Model::open(
        &base,
        CpuBackend::new(),
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    let mut ids = vec![0];
    for name in ["llama-attn-r4", "llama-mlp-r16-rslora", "llama-all-r8"] {
        let dir = fixtures().join("lora").join(name);
        let src = AdapterSource {
            path: &dir,
            scale: 1.0,
        };
        ids.push(m.load_adapter(name, &src).unwrap());
    }
    let tokens = fixture("llama-attn-r4").tokens;
    let v = m.decoder.config.vocab_size;
    let prompts: Vec<&[u32]> = vec![&tokens[..9], &tokens[2..11], &tokens[..9], &tokens[5..12]];
    let tables: Vec<[Vec<u32>; 1]> = (0..4u32).map(|k| [vec![k]]).collect();
    let mut kv = m.decoder.alloc_kv(4, 16);
    let mut alone = Vec::new();
    for (k, p) in prompts.iter().enumerate() {
        let mut rows = Vec::new();
        for (toks, start, want) in [(*p, 0, Logits::All), (&p[..1], p.len(), Logits::Last)] {
            let c = SeqChunk {
                tokens: toks,
                start,
                tables: &tables[k],
                logits: want,
                state: 0,
                adapter: ids[k],
                embeds: &[],
                grids: &[],
            };
            rows.push(m.decoder.forward_batch(&mut kv, &[c]).unwrap());
        }
        alone.push(rows);
    }
    let mut kv = m.decoder.alloc_kv(4, 16);
    for step in 0..2 {
        let chunks: Vec<SeqChunk> = prompts
            .iter()
            .enumerate()
            .map(|(k, p)| SeqChunk {
                tokens: if step == 0 { p } else { &p[..1] },
                start: if step == 0 { 0 } else { p.len() },
                tables: &tables[k],
                logits: if step == 0 { Logits::All } else { Logits::Last },
                state: 0,
                adapter: ids[k],
                embeds: &[],
                grids: &[],
            })
            .collect();
        let out = m.decoder.forward_batch(&mut kv, &chunks).unwrap();
        let mut at = 0;
        for (k, want) in alone.iter().enumerate() {
            let len = want[step].len();
            assert_eq!(
                &out[at..at + len],
                &want[step][..],
                "sequence {k} (adapter {}), step {step}",
                ids[k]
            );
            at += len;
        }
        assert_eq!(at, out.len());
        // The adapters do differ from each other and from the base.
        let first: Vec<&[f32]> = alone.iter().map(|a| &a[step][..v]).collect();
        assert_ne!(
            first[0], first[2],
            "the base and an adapter on the same prompt"
        );
    }
}

#[test]
fn bad_adapters_are_refused_with_a_reason() {
    let llama = fixtures().join("tiny/llama");
    let mut m = Model::open(
        &llama,
        CpuBackend::exact(),
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    let load = |m: &mut Model<CpuBackend>, p: &Path| {
        m.load_adapter(
            "x",
            &AdapterSource {
                path: p,
                scale: 1.0,
            },
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    // Qwen3's adapter on Llama: the shapes differ (Qwen3's tiny model is wider).
    let qwen = fixtures().join("lora/qwen3-all-r16");
    let e = load(&mut m, &qwen.join("adapter-f32.gguf"));
    assert!(e.contains("adapter for") || e.contains("projection"), "{e}");
    let e = load(&mut m, Path::new("/nonexistent/adapter"));
    assert!(e.contains("adapter_config.json"), "{e}");
    // A DoRA config, a config without its weights, and a GGUF that is a model, not an adapter.
    let tmp = std::env::temp_dir().join(format!("ferrum-lora-bad-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let good = fixtures().join("lora/llama-attn-r4");
    let cfg = std::fs::read_to_string(good.join("adapter_config.json")).unwrap();
    let mut j: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    j["use_dora"] = true.into();
    std::fs::write(tmp.join("adapter_config.json"), j.to_string()).unwrap();
    std::fs::copy(
        good.join("adapter_model.safetensors"),
        tmp.join("adapter_model.safetensors"),
    )
    .unwrap();
    let e = load(&mut m, &tmp);
    assert!(e.contains("DoRA"), "{e}");
    std::fs::remove_file(tmp.join("adapter_model.safetensors")).unwrap();
    j["use_dora"] = false.into();
    std::fs::write(tmp.join("adapter_config.json"), j.to_string()).unwrap();
    let e = load(&mut m, &tmp);
    assert!(e.contains("adapter_model.safetensors"), "{e}");
    let e = load(&mut m, &llama.join("model-f32.gguf"));
    assert!(e.contains("not a LoRA adapter"), "{e}");
    std::fs::remove_dir_all(&tmp).ok();
    // The model still runs, with a good adapter too.
    let src = AdapterSource {
        path: &good,
        scale: 1.0,
    };
    assert_eq!(m.load_adapter("ok", &src).unwrap(), 1);
}
