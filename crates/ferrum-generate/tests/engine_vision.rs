//! Images through the engine (issue 45), on the tiny random Gemma3ForConditionalGeneration of
//! `tests/fixtures/vision/gemma3` (scripts/fixtures/make_gemma3_vision.py): the first token
//! after a prompt with images is transformers' argmax and the rest are the model's own greedy
//! tokens; a long text before an image is cut before it, never inside; a request with an
//! image batched with others gets the tokens it gets alone; the prefix cache serves an image
//! again only to the same image; images without placeholders, or to a text model, are
//! refused.

use std::collections::HashMap;
use std::path::PathBuf;

use ferrum_backend::CpuBackend;
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request, RequestId, Usage};
use ferrum_image::{decode, Limits, Processed};
use ferrum_loader::ModelFile;
use ferrum_models::{LoadOptions, Logits, Model};
use ferrum_tokenizer::Tokenizer;
use serde_json::Value as Json;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

fn model(exact: bool) -> Model<CpuBackend> {
    let file = ModelFile::open(fixtures().join("vision/gemma3")).unwrap();
    let be = if exact {
        CpuBackend::exact()
    } else {
        CpuBackend::new()
    };
    Model::load(&file, be, &LoadOptions::default()).unwrap()
}

/// The engine of the tiny vision model. Its checkpoint has no tokenizer: the tiny Qwen3's
/// detokenizes (the text is not looked at; the tokens are).
fn engine(exact: bool, block_size: usize) -> Engine<CpuBackend> {
    let m = model(exact);
    let config = EngineConfig {
        block_size,
        kv_blocks: 256,
        max_batch_tokens: m.decoder.pass_capacity(),
        max_running: 8,
        prefix_caching: true,
        spec_tokens: 0,
        state_snapshots: 4,
    };
    let tok = Tokenizer::from_hf_dir(&fixtures().join("tiny/qwen3")).unwrap();
    Engine::new(m, tok, config).unwrap()
}

fn image(m: &Model<CpuBackend>, name: &str) -> Processed {
    let bytes = std::fs::read(fixtures().join("vision/processor").join(name)).unwrap();
    let img = decode(&bytes, &Limits::default()).unwrap();
    m.vision.as_ref().unwrap().processor.process(&img).unwrap()
}

const BOI: u32 = 297;
const EOI: u32 = 298;
const IMG: u32 = 299;

fn block() -> Vec<u32> {
    vec![BOI, IMG, IMG, IMG, IMG, EOI]
}

fn request(prompt: Vec<u32>, images: Vec<Processed>, max_tokens: usize) -> Request {
    let mut r = Request::new(prompt, max_tokens);
    r.ignore_eos = true;
    r.images = images;
    r
}

fn run_all(e: &mut Engine<CpuBackend>) -> HashMap<RequestId, (Vec<u32>, Usage)> {
    let mut out: HashMap<RequestId, (Vec<u32>, Usage)> = HashMap::new();
    while e.has_work() {
        for o in e.step().unwrap() {
            let entry = out.entry(o.id).or_default();
            match o.kind {
                OutputKind::Token { token, .. } => entry.0.push(token),
                OutputKind::Finished { usage, .. } => entry.1 = usage,
            }
        }
    }
    out
}

fn alone(exact: bool, r: Request) -> (Vec<u32>, Usage) {
    let mut e = engine(exact, 4);
    let id = e.add(r).unwrap();
    run_all(&mut e).remove(&id).unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as u32
}

/// The greedy tokens of `prompt` with `images` by `Model::forward_with_images`, one whole
/// forward per token.
fn greedy(m: &mut Model<CpuBackend>, prompt: &[u32], images: &[Processed], n: usize) -> Vec<u32> {
    let v = m.vision.as_ref().unwrap();
    let be = m.decoder.backend();
    let rows: Vec<ferrum_models::vision::EncodedImage> = images
        .iter()
        .map(|p| (v.encode(be, p).unwrap(), v.grid(p)))
        .collect();
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let mut kv = m.decoder.alloc_kv_tokens(ids.len());
        let l = m
            .forward_with_images(&mut kv, &ids, &rows, Logits::Last)
            .unwrap();
        let t = argmax(&l);
        out.push(t);
        ids.push(t);
    }
    out
}

#[test]
fn generation_with_images_follows_transformers_and_the_model() {
    let reference: Json = serde_json::from_slice(
        &std::fs::read(fixtures().join("vision/gemma3/reference.json")).unwrap(),
    )
    .unwrap();
    let mut m = model(true);
    for case in reference["cases"].as_array().unwrap() {
        let prompt: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let images: Vec<Processed> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| image(&m, n.as_str().unwrap()))
            .collect();
        let logits = case["logits_f32"].as_array().unwrap();
        let last: Vec<f32> = logits[logits.len() - 1]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let (tokens, usage) = alone(true, request(prompt.clone(), images.clone(), 6));
        assert_eq!(
            tokens[0],
            argmax(&last),
            "{}: transformers' first token",
            case["name"]
        );
        assert_eq!(
            tokens,
            greedy(&mut m, &prompt, &images, 6),
            "{}",
            case["name"]
        );
        assert_eq!(usage.prompt_tokens, prompt.len());
    }
}

/// Text longer than a pass before an image: the pass is cut before the image, and the
/// tokens are what one forward over the whole prompt gives.
#[test]
fn a_long_prompt_is_never_cut_inside_an_image() {
    let mut m = model(true);
    let img = image(&m, "rgb_300x200.png");
    let mut prompt: Vec<u32> = (0..66).map(|i| 5 + (i * 7) % 250).collect();
    prompt.extend(block());
    prompt.extend([20, 21, 22]);
    let want = greedy(&mut m, &prompt, std::slice::from_ref(&img), 4);
    let (got, _) = alone(true, request(prompt, vec![img], 4));
    assert_eq!(got, want);
}

#[test]
fn batched_image_requests_get_their_tokens_alone() {
    let m = model(false);
    let (a, b) = (image(&m, "rgb_300x200.png"), image(&m, "rgba_40x90.png"));
    let mut p1 = vec![2, 10, 11];
    p1.extend(block());
    p1.extend([12, 13]);
    let mut p2 = vec![2, 40];
    p2.extend(block());
    p2.extend([41]);
    p2.extend(block());
    let p3 = vec![2, 60, 61, 62, 63];
    let reqs = || {
        vec![
            request(p1.clone(), vec![a.clone()], 8),
            request(p2.clone(), vec![b.clone(), a.clone()], 8),
            request(p3.clone(), vec![], 8),
        ]
    };
    let want: Vec<Vec<u32>> = reqs().into_iter().map(|r| alone(false, r).0).collect();
    let mut e = engine(false, 4);
    let ids: Vec<RequestId> = reqs().into_iter().map(|r| e.add(r).unwrap()).collect();
    let mut got = run_all(&mut e);
    for (id, w) in ids.iter().zip(&want) {
        assert_eq!(&got.remove(id).unwrap().0, w);
    }
}

#[test]
fn the_prefix_cache_serves_an_image_only_to_the_same_image() {
    let m = model(false);
    let (a, b) = (image(&m, "rgb_300x200.png"), image(&m, "rgba_40x90.png"));
    let mut prompt = vec![2, 10, 11, 12];
    prompt.extend(block());
    prompt.extend([20, 21, 22, 23, 24, 25, 26, 27]);
    let mut e = engine(false, 4);
    let first = e.add(request(prompt.clone(), vec![a.clone()], 4)).unwrap();
    let (tokens_a, _) = run_all(&mut e).remove(&first).unwrap();
    // The same image again: everything but the last block is found.
    let again = e.add(request(prompt.clone(), vec![a.clone()], 4)).unwrap();
    let (tokens, usage) = run_all(&mut e).remove(&again).unwrap();
    assert_eq!(tokens, tokens_a);
    assert!(usage.cached_tokens >= 12, "{usage:?}");
    // Another image at the same place: only the text before it (one block) is found.
    let other = e.add(request(prompt.clone(), vec![b.clone()], 4)).unwrap();
    let (tokens_b, usage) = run_all(&mut e).remove(&other).unwrap();
    assert_eq!(usage.cached_tokens, 4, "{usage:?}");
    assert_eq!(tokens_b, alone(false, request(prompt, vec![b], 4)).0);
}

#[test]
fn images_must_match_their_placeholders() {
    let m = model(false);
    let a = image(&m, "rgb_300x200.png");
    let mut e = engine(false, 4);
    let e1 = e
        .add(request(vec![2, 10, 11], vec![a.clone()], 4))
        .unwrap_err();
    assert!(e1.to_string().contains("1 images for 0"), "{e1}");
    let mut p = vec![2];
    p.extend(block());
    let e2 = e.add(request(p, vec![], 4));
    // Placeholders without an image run as text tokens (no rows to put there): allowed,
    // as transformers runs them when no pixels come.
    assert!(e2.is_ok());
    // Steps too small for an image: refused when it arrives, not left waiting for ever.
    let small = EngineConfig {
        block_size: 4,
        kv_blocks: 64,
        max_batch_tokens: 3,
        max_running: 2,
        prefix_caching: true,
        spec_tokens: 0,
        state_snapshots: 4,
    };
    let tok = Tokenizer::from_hf_dir(&fixtures().join("tiny/qwen3")).unwrap();
    let mut e = Engine::new(model(false), tok, small).unwrap();
    let mut p = vec![2];
    p.extend(block());
    let e3 = e.add(request(p, vec![a], 4)).unwrap_err();
    assert!(
        e3.to_string().contains("does not fit in a step of 3"),
        "{e3}"
    );
}

/// The chat path on tests/fixtures/vision/gemma3_it (scripts/fixtures/make_gemma3_vision_it.py:
/// a tokenizer and Gemma 3's chat template): the conversation rendered with image parts and
/// its image markers expanded gives transformers' processor's ids, and the engine's greedy
/// tokens are `model.generate`'s.
#[test]
fn chats_with_images_match_transformers_processor_and_generate() {
    chat_matches("vision/gemma3_it");
}

/// The same on tests/fixtures/vision/qwen25vl_it (scripts/fixtures/make_qwen_vl_it.py qwen25vl:
/// Qwen2.5-VL's chat template, each image's `<|image_pad|>` expanded by its own size).
#[test]
fn qwen25_vl_chats_match_transformers_processor_and_generate() {
    chat_matches("vision/qwen25vl_it");
}

/// And on tests/fixtures/vision/qwen3vl_it (the same script, `qwen3vl`).
#[test]
fn qwen3_vl_chats_match_transformers_processor_and_generate() {
    chat_matches("vision/qwen3vl_it");
}

/// And on Qwen3-VL-MoE (the same script, `qwen3vlmoe`): the experts stacked as transformers 5
/// saves them, and as the published checkpoints have them (`qwen3vlmoe_it_published`: x · W,
/// turned around at load), against the same reference.
#[test]
fn qwen3_vl_moe_chats_match_transformers_processor_and_generate() {
    chat_matches("vision/qwen3vlmoe_it");
    chat_matches("vision/qwen3vlmoe_it_published");
}

/// And on tests/fixtures/vision/qwen35vl_it (the same script, `qwen35vl`): Qwen3.5's hybrid
/// language model, whose linear-attention state runs over the image rows too.
#[test]
fn qwen35_vl_chats_match_transformers_processor_and_generate() {
    chat_matches("vision/qwen35vl_it");
}

/// And tests/fixtures/vision/qwen35moevl_it (`qwen35moevl`): Qwen3.5's experts.
#[test]
fn qwen35_moe_vl_chats_match_transformers_processor_and_generate() {
    chat_matches("vision/qwen35moevl_it");
}

/// And on tests/fixtures/vision/mistral3_it (scripts/fixtures/make_mistral3_it.py): a Mistral
/// Small 3.1-style template's `[IMG]` expanded to the image's rows of `[IMG]`, each closed by
/// `[IMG_BREAK]` and the last by `[IMG_END]`.
#[test]
fn mistral3_chats_match_transformers_processor_and_generate() {
    chat_matches("vision/mistral3_it");
}

fn chat_matches(fixture: &str) {
    let dir = fixtures().join(fixture);
    let reference: Json =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let file = ModelFile::open(&dir).unwrap();
    let m = Model::load(&file, CpuBackend::exact(), &LoadOptions::default()).unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    let v = m.vision.as_ref().unwrap();
    let text = v.prompt_texts(|id| tok.inner().id_to_token(id)).unwrap();
    let config = EngineConfig {
        block_size: 4,
        kv_blocks: 256,
        max_batch_tokens: m.decoder.pass_capacity(),
        max_running: 4,
        prefix_caching: true,
        spec_tokens: 0,
        state_snapshots: 4,
    };
    let processor = v.processor.clone();
    let mut e = Engine::new(m, tok, config).unwrap();
    for case in reference["cases"].as_array().unwrap() {
        // The messages as the server gives them to the template: image parts as
        // `{"type": "image"}`.
        let mut messages = case["messages"].clone();
        for m in messages.as_array_mut().unwrap() {
            if let Some(parts) = m["content"].as_array_mut() {
                for p in parts {
                    if p["type"] == "image" {
                        *p = serde_json::json!({"type": "image"});
                    }
                }
            }
        }
        let images: Vec<Processed> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                let bytes = std::fs::read(
                    fixtures()
                        .join("vision/processor")
                        .join(n.as_str().unwrap()),
                )
                .unwrap();
                processor
                    .process(&decode(&bytes, &Limits::default()).unwrap())
                    .unwrap()
            })
            .collect();
        let ids = e
            .tokenizer
            .chat_prompt_with_images(
                messages.as_array().unwrap(),
                true,
                &Default::default(),
                ferrum_tokenizer::SpecialTokens::Text,
                false,
                (&text.marker, &text.expansions(&images)),
            )
            .unwrap();
        let want: Vec<u32> = case["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want, "{}: prompt ids", case["name"]);
        let mut r = Request::new(ids, 6);
        r.ignore_eos = true;
        r.images = images;
        let id = e.add(r).unwrap();
        let (tokens, _) = run_all(&mut e).remove(&id).unwrap();
        let generated: Vec<u32> = case["generated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tokens, generated, "{}: greedy tokens", case["name"]);
    }
}

/// Qwen2.5-VL through the engine (tests/fixtures/vision/qwen25vl,
/// scripts/fixtures/make_qwen25_vl.py): its image rows attend causally, so a small step cuts
/// the prompt inside an image; whatever the cuts, and after the prefix cache served the image
/// again, the tokens are transformers' first and then the model's own greedy ones, decoded at
/// the M-RoPE positions past the images.
#[test]
fn qwen25_vl_generates_through_the_engine_at_any_cut() {
    generates_at_any_cut("vision/qwen25vl");
}

/// The same for Qwen3-VL (tests/fixtures/vision/qwen3vl, scripts/fixtures/make_qwen3_vl.py),
/// whose image rows carry DeepStack rows a cut must split with them.
#[test]
fn qwen3_vl_generates_through_the_engine_at_any_cut() {
    generates_at_any_cut("vision/qwen3vl");
}

/// And Qwen3.5 (tests/fixtures/vision/qwen35vl, scripts/fixtures/make_qwen35_vl.py): the
/// hybrid model's recurrent state runs through image rows cut anywhere, and its prefix cache
/// (state snapshots) serves the image again.
#[test]
fn qwen35_generates_with_images_through_the_engine_at_any_cut() {
    generates_at_any_cut("vision/qwen35vl");
}

/// And Mistral 3 (tests/fixtures/vision/mistral3, scripts/fixtures/make_mistral3_vl.py): a cut
/// can fall between an image's rows and its break tokens, which are part of its span.
#[test]
fn mistral3_generates_with_images_through_the_engine_at_any_cut() {
    generates_at_any_cut("vision/mistral3");
}

fn generates_at_any_cut(dir: &str) {
    let reference: Json = serde_json::from_slice(
        &std::fs::read(fixtures().join(dir).join("reference.json")).unwrap(),
    )
    .unwrap();
    let load = || {
        let file = ModelFile::open(fixtures().join(dir)).unwrap();
        Model::load(&file, CpuBackend::exact(), &LoadOptions::default()).unwrap()
    };
    let mut m = load();
    for case in reference["cases"].as_array().unwrap() {
        let prompt: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let images: Vec<Processed> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| image(&m, n.as_str().unwrap()))
            .collect();
        let logits = case["logits_f32"].as_array().unwrap();
        let last: Vec<f32> = logits[logits.len() - 1]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let want = greedy(&mut m, &prompt, &images, 6);
        assert_eq!(
            want[0],
            argmax(&last),
            "{}: transformers' first token",
            case["name"]
        );
        for step in [7, 64] {
            let config = EngineConfig {
                block_size: 4,
                kv_blocks: 256,
                max_batch_tokens: step,
                max_running: 4,
                prefix_caching: true,
                spec_tokens: 0,
                state_snapshots: 4,
            };
            let tok = Tokenizer::from_hf_dir(&fixtures().join("tiny/qwen3")).unwrap();
            let mut e = Engine::new(load(), tok, config).unwrap();
            let first = e.add(request(prompt.clone(), images.clone(), 6)).unwrap();
            let (tokens, _) = run_all(&mut e).remove(&first).unwrap();
            assert_eq!(tokens, want, "{} in steps of {step}", case["name"]);
            // Again: the image's blocks come from the prefix cache.
            let again = e.add(request(prompt.clone(), images.clone(), 6)).unwrap();
            let (tokens, usage) = run_all(&mut e).remove(&again).unwrap();
            assert_eq!(tokens, want, "{} cached, steps of {step}", case["name"]);
            assert!(usage.cached_tokens >= prompt.len() - 4, "{usage:?}");
            // The images whose keys and values were all found were not encoded again; one
            // that ends past the cached blocks was.
            let spans = m
                .vision
                .as_ref()
                .unwrap()
                .place(&prompt, images.len())
                .unwrap();
            let again = spans
                .iter()
                .filter(|&&(start, len)| start + len > usage.cached_tokens)
                .count();
            let encoded = (images.len() + again) as u64;
            assert_eq!(e.stats().images_encoded, encoded, "{}", case["name"]);
        }
    }
}
