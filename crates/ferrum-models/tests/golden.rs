//! Golden logits: tiny random-weight Llama, Qwen2 and Qwen3 models built by
//! `scripts/fixtures/make_tiny_models.py` with Hugging Face transformers, saved as
//! safetensors and converted to GGUF by llama.cpp's `convert_hf_to_gguf.py`. Our logits must
//! match the transformers logits recorded beside each model.

use std::path::PathBuf;

use ferrum_backend::CpuBackend;
use ferrum_models::{LoadOptions, Logits, Model};
use serde::Deserialize;

mod common;
use common::{argmax, assert_close};

#[derive(Deserialize)]
struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    argmax: Vec<u32>,
}

const MODELS: &[&str] = &[
    "llama",
    "llama-tied",
    "qwen2",
    "qwen2-tied",
    "qwen3",
    "qwen3-tied",
];

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

fn reference(name: &str) -> Reference {
    reference_file(name, "reference.json")
}

fn reference_file(name: &str, file: &str) -> Reference {
    let p = dir(name).join(file);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// The reference comparisons run the exact backend: f32 activations and an f32 KV cache.
fn run(path: PathBuf, tokens: &[u32]) -> (Vec<Vec<f32>>, usize) {
    run_on(CpuBackend::exact(), path, tokens)
}

fn run_on(be: CpuBackend, path: PathBuf, tokens: &[u32]) -> (Vec<Vec<f32>>, usize) {
    let mut m = Model::open(
        &path,
        be,
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut kv = m.decoder.alloc_kv_tokens(64);
    let v = m.decoder.config.vocab_size;
    let all = m.decoder.forward(&mut kv, tokens, 0, Logits::All).unwrap();
    (all.chunks(v).map(|r| r.to_vec()).collect(), v)
}

#[test]
fn safetensors_match_transformers() {
    for name in MODELS {
        let r = reference(name);
        let (got, _) = run(dir(name), &r.tokens);
        assert_close(&format!("{name}/safetensors"), &got, &r.logits);
    }
}

#[test]
fn f32_gguf_matches_transformers() {
    for name in MODELS {
        let r = reference(name);
        let (got, _) = run(dir(name).join("model-f32.gguf"), &r.tokens);
        assert_close(&format!("{name}/model-f32.gguf"), &got, &r.logits);
    }
}

/// q8_0 files: with f32 activations (the exact backend) the argmax matches transformers at
/// every position, and the logits match transformers run on the same dequantised weights.
#[test]
fn q8_0_gguf_exact_backend_matches_transformers() {
    for name in MODELS {
        let r = reference(name);
        let (got, _) = run_on(
            CpuBackend::exact(),
            dir(name).join("model-q8_0.gguf"),
            &r.tokens,
        );
        let ours: Vec<u32> = got.iter().map(|row| argmax(row)).collect();
        assert_eq!(
            ours, r.argmax,
            "{name}/model-q8_0.gguf: argmax per position"
        );
        let exact = reference_file(name, "reference-q8_0.json");
        assert_eq!(exact.tokens, r.tokens);
        assert_close(
            &format!("{name}/model-q8_0.gguf (exact)"),
            &got,
            &exact.logits,
        );
    }
}

/// The fast backend also quantises activations to 8 bits (as llama.cpp does). On these tiny
/// random models, whose logits swing widely, that moves logits by up to ~5% of the largest;
/// the argmax must still match wherever the reference's top-1 leads top-2 by a clear margin.
#[test]
fn q8_0_gguf_fast_backend_argmax_where_decisive() {
    for name in MODELS {
        let r = reference_file(name, "reference-q8_0.json");
        let (got, _) = run_on(
            CpuBackend::new(),
            dir(name).join("model-q8_0.gguf"),
            &r.tokens,
        );
        let mut checked = 0;
        for (pos, (row, want)) in got.iter().zip(&r.logits).enumerate() {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = row
                .iter()
                .zip(want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= 0.08 * scale,
                "{name}: position {pos}: |Δlogit| {diff} vs max {scale}"
            );
            let mut sorted = want.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] >= 1.0 {
                assert_eq!(argmax(row), r.argmax[pos], "{name}: position {pos}");
                checked += 1;
            }
        }
        assert!(
            checked >= r.tokens.len() / 3,
            "{name}: only {checked} decisive positions"
        );
    }
}

/// The default backend keeps the KV cache in f16: f32 weights then stay within f16
/// rounding of the reference, with the same argmax everywhere.
#[test]
fn default_backend_with_f16_kv_cache_stays_close() {
    for name in MODELS {
        let r = reference(name);
        let (got, _) = run_on(
            CpuBackend::new(),
            dir(name).join("model-f32.gguf"),
            &r.tokens,
        );
        for (pos, (g, w)) in got.iter().zip(&r.logits).enumerate() {
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= 5e-3 * scale,
                "{name}: position {pos}: |Δlogit| {diff} vs {scale}"
            );
            assert_eq!(argmax(g), r.argmax[pos], "{name}: position {pos}");
        }
    }
}

#[test]
fn prefill_in_one_pass_equals_token_by_token_decode() {
    for name in ["llama", "qwen3"] {
        let r = reference(name);
        let path = dir(name).join("model-f32.gguf");
        let (full, v) = run_on(CpuBackend::new(), path.clone(), &r.tokens);
        let mut m = Model::open(
            &path,
            CpuBackend::new(),
            &LoadOptions {
                context: Some(64),
                ..Default::default()
            },
        )
        .unwrap();
        let mut kv = m.decoder.alloc_kv_tokens(64);
        let mut last = Vec::new();
        for (i, &t) in r.tokens.iter().enumerate() {
            last = m.decoder.forward(&mut kv, &[t], i, Logits::Last).unwrap();
        }
        assert_eq!(last.len(), v);
        let want = full.last().unwrap();
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (a, b) in last.iter().zip(want) {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "{name}: decode {a} vs prefill {b}"
            );
        }
    }
}

#[test]
fn context_overflow_and_bad_token_are_errors() {
    let path = dir("qwen3").join("model-f32.gguf");
    let mut m = Model::open(
        &path,
        CpuBackend::new(),
        &LoadOptions {
            context: Some(8),
            ..Default::default()
        },
    )
    .unwrap();
    let mut kv = m.decoder.alloc_kv_tokens(8);
    let e = m
        .decoder
        .forward(&mut kv, &[1; 9], 0, Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("exceeds the context"), "{e}");
    let v = m.decoder.config.vocab_size as u32;
    let e = m
        .decoder
        .forward(&mut kv, &[v], 0, Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
    // The model is still usable afterwards.
    assert!(m.decoder.forward(&mut kv, &[1, 2], 0, Logits::Last).is_ok());
}

#[test]
fn batch_logits_read_in_place_equal_the_copied_ones() {
    use ferrum_models::decoder::SeqChunk;
    let r = reference("qwen3");
    let path = dir("qwen3").join("model-f32.gguf");
    let mut m = Model::open(
        &path,
        CpuBackend::new(),
        &LoadOptions {
            context: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    let v = m.decoder.config.vocab_size;
    let (a, b) = (&r.tokens[..5], &r.tokens[2..9]);
    let (ta, tb) = ([vec![0u32, 1]], [vec![2u32, 3]]);
    let mut copied_kv = m.decoder.alloc_kv(4, 16);
    let mut viewed_kv = m.decoder.alloc_kv(4, 16);
    let mut spare = Vec::new();
    // A prefill pass (one sequence's last row, the other's every row), then a decode pass.
    for (sa, sb, la, lb, start) in [
        (a, b, Logits::Last, Logits::All, (0, 0)),
        (
            &a[..1],
            &b[..1],
            Logits::Last,
            Logits::Last,
            (a.len(), b.len()),
        ),
    ] {
        let seqs = [
            SeqChunk {
                tokens: sa,
                start: start.0,
                tables: &ta,
                logits: la,
                state: 0,
                adapter: 0,
                embeds: &[],
                grids: &[],
            },
            SeqChunk {
                tokens: sb,
                start: start.1,
                tables: &tb,
                logits: lb,
                state: 0,
                adapter: 0,
                embeds: &[],
                grids: &[],
            },
        ];
        let copied = m.decoder.forward_batch(&mut copied_kv, &seqs).unwrap();
        let viewed = m
            .decoder
            .forward_batch_view(&mut viewed_kv, &seqs, &mut spare)
            .unwrap()
            .to_vec();
        assert_eq!(copied.len() % v, 0);
        assert!(!copied.is_empty());
        assert_eq!(
            copied.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            viewed.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

/// `forward_last` (what `ferrum bench` times) gives the bits of `forward`'s last row, for a
/// prompt of several passes, for one that fills its passes exactly, and for decode steps.
#[test]
fn last_logits_in_place_equal_the_copied_ones() {
    let path = dir("qwen3").join("model-f32.gguf");
    let ctx = 3 * ferrum_models::decoder::CHUNK;
    let mut m = Model::open(
        &path,
        CpuBackend::new(),
        &LoadOptions {
            context: Some(ctx),
            ..Default::default()
        },
    )
    .unwrap();
    let vocab = m.decoder.config.vocab_size as u32;
    let tokens: Vec<u32> = (0..ctx as u32).map(|i| (i * 7 + 3) % vocab).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for prompt in [
        ferrum_models::decoder::CHUNK + 5,
        2 * ferrum_models::decoder::CHUNK,
        1,
    ] {
        let mut copied_kv = m.decoder.alloc_kv_tokens(ctx);
        let mut viewed_kv = m.decoder.alloc_kv_tokens(ctx);
        let mut spare = Vec::new();
        for (start, end) in [(0, prompt), (prompt, prompt + 1), (prompt + 1, prompt + 2)] {
            let copied = m
                .decoder
                .forward(&mut copied_kv, &tokens[start..end], start, Logits::Last)
                .unwrap();
            let viewed = m
                .decoder
                .forward_last(&mut viewed_kv, &tokens[start..end], start, &mut spare)
                .unwrap();
            assert_eq!(copied.len(), vocab as usize, "prompt {prompt}, at {start}");
            assert_eq!(bits(&copied), bits(viewed), "prompt {prompt}, at {start}");
        }
    }
}
