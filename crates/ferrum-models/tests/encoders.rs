//! Encoder models (BERT, XLM-RoBERTa, NomicBERT, ModernBERT) against transformers and
//! sentence-transformers:
//! tiny random-weight models (tests/fixtures/encoders, made by
//! scripts/fixtures/make_encoder_models.py) whose states, embeddings and classifier logits
//! must match within 1e-5 on the exact path; the same BERT converted to GGUF by llama.cpp's
//! converter against llama.cpp's `llama-embedding` (scripts/fixtures/
//! encoder_llamacpp_reference.sh); and the real all-MiniLM-L6-v2 against
//! sentence-transformers on 64 sentences (scripts/fixtures/minilm_reference.py).

use std::path::{Path, PathBuf};

use ferrum_backend::CpuBackend;
use ferrum_loader::ModelFile;
use ferrum_models::encoder::{Encoder, Input};
use ferrum_tokenizer::Tokenizer;
mod common;
use common::{floats, ids, read_json, texts};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn open(path: &Path, be: CpuBackend) -> (Encoder<CpuBackend>, Tokenizer) {
    let file = ModelFile::open(path).unwrap();
    assert!(ferrum_models::encoder::is_encoder(&file));
    let tok = match &file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g).unwrap(),
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir).unwrap(),
    };
    (Encoder::load(&file, be).unwrap(), tok)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// Token ids as the reference tokenised, states and embeddings within `tol` (exact path).
fn check_embedder(name: &str) {
    let dir = fixtures().join("encoders").join(name);
    let r = read_json(&dir.join("reference.json"));
    let (enc, tok) = open(&dir, CpuBackend::exact());
    let inputs = texts(&r["inputs"]);
    let mut all_ids = Vec::new();
    for (i, (t, want)) in inputs.iter().zip(r["ids"].as_array().unwrap()).enumerate() {
        let got = tok.encode(t, true).unwrap();
        assert_eq!(got, ids(want), "{name}: ids of input {i} {t:?}");
        all_ids.push(got);
    }
    let xs: Vec<Input> = all_ids
        .iter()
        .map(|v| Input {
            ids: v,
            types: None,
        })
        .collect();
    let h = enc.config.hidden;
    let states = enc.hidden_states(&xs).unwrap();
    for (i, (s, want)) in states
        .iter()
        .zip(r["hidden"].as_array().unwrap())
        .enumerate()
    {
        let want: Vec<f32> = want.as_array().unwrap().iter().flat_map(floats).collect();
        let d = max_abs(s, &want);
        assert!(d < 1e-5, "{name}: states of input {i} off by {d}");
        assert_eq!(s.len(), all_ids[i].len() * h);
    }
    let emb = enc.embed(&xs).unwrap();
    for (i, (e, want)) in emb
        .iter()
        .zip(r["embeddings"].as_array().unwrap())
        .enumerate()
    {
        let d = max_abs(e, &floats(want));
        assert!(d < 1e-5, "{name}: embedding of input {i} off by {d}");
    }
    // Each input alone gives the bits it gets in the batch.
    for (i, x) in xs.iter().enumerate() {
        let alone = enc.embed(std::slice::from_ref(x)).unwrap();
        assert_eq!(
            alone[0], emb[i],
            "{name}: input {i} alone differs from the batch"
        );
    }
    // The default (fast) path stays close.
    let (fast, _) = open(&dir, CpuBackend::new());
    for (i, (e, want)) in fast
        .embed(&xs)
        .unwrap()
        .iter()
        .zip(r["embeddings"].as_array().unwrap())
        .enumerate()
    {
        let c = cosine(e, &floats(want));
        assert!(c > 0.999, "{name}: default path, input {i}: cosine {c}");
    }
}

#[test]
fn bert_mean_pooling_matches_sentence_transformers() {
    check_embedder("bert_mean");
}

#[test]
fn bert_cls_and_dense_match_sentence_transformers() {
    check_embedder("bert_cls_dense");
}

#[test]
fn xlm_roberta_matches_sentence_transformers() {
    check_embedder("xlmr_mean");
}

fn check_cross_encoder(name: &str) {
    let dir = fixtures().join("encoders").join(name);
    let r = read_json(&dir.join("reference.json"));
    let (enc, tok) = open(&dir, CpuBackend::exact());
    assert!(enc.is_classifier());
    let mut encoded = Vec::new();
    for (i, pair) in r["pairs"].as_array().unwrap().iter().enumerate() {
        let p = texts(pair);
        let (got, types) = tok.encode_pair(&p[0], &p[1]).unwrap();
        assert_eq!(got, ids(&r["ids"][i]), "{name}: ids of pair {i}");
        assert_eq!(
            types,
            ids(&r["type_ids"][i]),
            "{name}: token types of pair {i}"
        );
        encoded.push((got, types));
    }
    let xs: Vec<Input> = encoded
        .iter()
        .map(|(v, t): &(Vec<u32>, Vec<u32>)| Input {
            ids: v,
            types: Some(t),
        })
        .collect();
    let logits = enc.classify(&xs).unwrap();
    for (i, (l, want)) in logits
        .iter()
        .zip(r["logits"].as_array().unwrap())
        .enumerate()
    {
        let d = max_abs(l, &floats(want));
        assert!(d < 1e-5, "{name}: logits of pair {i} off by {d}: {l:?}");
    }
    if logits[0].len() == 1 {
        // sentence-transformers' CrossEncoder.predict: the sigmoid of the one logit.
        for (i, (l, want)) in logits
            .iter()
            .zip(floats(&r["crossencoder_predict"]))
            .enumerate()
        {
            let s = ferrum_models::encoder::relevance(l);
            assert!(
                (s - want).abs() < 1e-5,
                "{name}: score of pair {i}: {s} vs {want}"
            );
        }
    }
}

#[test]
fn bert_cross_encoder_matches_transformers() {
    check_cross_encoder("bert_cross");
}

#[test]
fn bert_two_label_classifier_matches_transformers() {
    check_cross_encoder("bert_cls2");
}

/// llama.cpp's converter's GGUF of a tiny model, against `llama-embedding` on that file.
fn check_gguf_embedder(name: &str) {
    let path = fixtures().join(format!("encoders/{name}.gguf"));
    let r = read_json(&fixtures().join(format!("encoders/{name}.llamacpp.json")));
    let (enc, tok) = open(&path, CpuBackend::exact());
    let inputs = texts(&r["inputs"]);
    let mut all = Vec::new();
    for (i, t) in inputs.iter().enumerate() {
        let got = tok.encode(t, true).unwrap();
        assert_eq!(got, ids(&r["ids"][i]), "{name}: ids of input {i} {t:?}");
        all.push(got);
    }
    let xs: Vec<Input> = all
        .iter()
        .map(|v| Input {
            ids: v,
            types: None,
        })
        .collect();
    for (i, (e, want)) in enc
        .embed(&xs)
        .unwrap()
        .iter()
        .zip(r["embeddings"].as_array().unwrap())
        .enumerate()
    {
        let c = cosine(e, &floats(want));
        assert!(c > 0.9999, "{name}: input {i}: cosine {c} with llama.cpp");
    }
}

#[test]
fn bert_gguf_matches_llama_cpp() {
    check_gguf_embedder("bert_mean");
}

/// NomicBERT in the original checkpoints' layout (as the Hub's nomic-embed-text files) and
/// in transformers' own, against transformers' `NomicBertModel` and sentence-transformers
/// (scripts/fixtures/make_rope_encoders.py).
#[test]
fn nomic_bert_matches_sentence_transformers() {
    check_embedder("nomic_mean");
    check_embedder("nomic_hf");
}

/// ModernBERT with a window of 4 either side on inputs up to several times longer, so local
/// layers see both edges and the middle.
#[test]
fn modernbert_matches_sentence_transformers() {
    check_embedder("modernbert_mean");
}

/// EmbeddingGemma's shape (a bidirectional Gemma 3 with grouped-query attention, a window
/// of 4 either side on three local layers, two Dense projections) against transformers and
/// sentence-transformers (scripts/fixtures/make_embeddinggemma.py).
#[test]
fn embeddinggemma_matches_sentence_transformers() {
    check_embedder("embeddinggemma");
}

#[test]
fn modernbert_cross_encoder_matches_transformers() {
    check_cross_encoder("modernbert_cross");
}

/// A tiny XLM-RoBERTa with a SentencePiece Unigram vocabulary and its compiled NFKC map, from
/// its folder (against sentence-transformers) and from llama.cpp's GGUF (`t5` tokenizer;
/// against `llama-embedding`) on inputs that stress the normaliser
/// (scripts/fixtures/make_xlmr_gguf.sh).
#[test]
fn xlm_roberta_unigram_matches_sentence_transformers_and_llama_cpp() {
    check_embedder("xlmr_spm");
    check_gguf_embedder("xlmr_spm");
}

/// EmbeddingGemma from llama.cpp's `gemma-embedding` GGUF (its Dense projections kept with
/// `--sentence-transformers-dense-modules`) against `llama-embedding`
/// (scripts/fixtures/make_embeddinggemma_gguf.sh).
#[test]
fn embeddinggemma_gguf_matches_llama_cpp() {
    check_gguf_embedder("embeddinggemma");
}

/// scripts/fixtures/rope_encoder_llamacpp_reference.sh.
#[test]
fn nomic_bert_and_modernbert_gguf_match_llama_cpp() {
    check_gguf_embedder("nomic_mean");
    check_gguf_embedder("modernbert_mean");
}

fn minilm_dir() -> PathBuf {
    let dir = std::env::var_os("FERRUM_MINILM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("FERRUM_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferrum")
                });
            home.join("all-minilm-l6-v2")
        });
    assert!(
        dir.join("model.safetensors").is_file(),
        "{} is missing: run scripts/fetch-test-assets.sh",
        dir.display()
    );
    dir
}

/// The real all-MiniLM-L6-v2 on 64 sentences: cosine ≥ 0.9999 with sentence-transformers on
/// the exact path, ≥ 0.999 on the default one.
#[test]
fn minilm_matches_sentence_transformers() {
    let r = read_json(&fixtures().join("minilm/reference.json"));
    let dir = minilm_dir();
    let inputs = texts(&r["sentences"]);
    for (label, be, floor) in [
        ("exact", CpuBackend::exact(), 0.9999),
        ("default", CpuBackend::new(), 0.999),
    ] {
        let (enc, tok) = open(&dir, be);
        let all: Vec<Vec<u32>> = inputs
            .iter()
            .map(|t| tok.encode(t, true).unwrap())
            .collect();
        for (i, (got, want)) in all.iter().zip(r["ids"].as_array().unwrap()).enumerate() {
            assert_eq!(got, &ids(want), "ids of sentence {i}");
        }
        let xs: Vec<Input> = all
            .iter()
            .map(|v| Input {
                ids: v,
                types: None,
            })
            .collect();
        let emb = enc.embed(&xs).unwrap();
        let worst = emb
            .iter()
            .zip(r["embeddings"].as_array().unwrap())
            .map(|(e, w)| cosine(e, &floats(w)))
            .fold(1.0, f64::min);
        assert!(worst >= floor, "{label}: worst cosine {worst}");
    }
}

/// The cross-encoder through llama.cpp's converter: llama.cpp scores it without BERT's pooler
/// (the converter drops it) and with token type 0 throughout; on the same file the same.
#[test]
fn bert_cross_encoder_gguf_matches_llama_cpp() {
    let path = fixtures().join("encoders/bert_cross.gguf");
    let r = read_json(&fixtures().join("encoders/bert_cross.llamacpp.json"));
    let (enc, tok) = open(&path, CpuBackend::exact());
    for (i, pair) in r["pairs"].as_array().unwrap().iter().enumerate() {
        let p = texts(pair);
        let (got, types) = tok.encode_pair(&p[0], &p[1]).unwrap();
        assert_eq!(got, ids(&r["ids"][i]), "ids of pair {i}");
        let l = enc
            .classify(&[Input {
                ids: &got,
                types: Some(&types),
            }])
            .unwrap();
        let want = floats(&r["scores"][i]);
        assert!(
            (l[0][0] - want[0]).abs() < 2e-3,
            "pair {i}: {:?} vs llama.cpp {want:?}",
            l[0]
        );
    }
}

/// A decoder embedder (Qwen3-Embedding's recipe: the last token's final-normalised state, unit
/// length, read from sentence-transformers' files) against sentence-transformers
/// (scripts/fixtures/make_qwen3_embedding.py).
#[test]
fn qwen3_last_token_embedding_matches_sentence_transformers() {
    let dir = fixtures().join("encoders/qwen3_last");
    let r = read_json(&dir.join("reference.json"));
    let file = ModelFile::open(&dir).unwrap();
    assert!(!ferrum_models::encoder::is_encoder(&file));
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    let mut model =
        ferrum_models::Model::load(&file, CpuBackend::exact(), &Default::default()).unwrap();
    let pooling = model.pooling.clone().expect("pooling from modules.json");
    assert_eq!(pooling.mode, ferrum_models::encoder::PoolingMode::Last);
    for (i, t) in texts(&r["inputs"]).iter().enumerate() {
        let got = tok.encode(t, true).unwrap();
        assert_eq!(got, ids(&r["ids"][i]), "ids of input {i} {t:?}");
        let e = model.pooled(&got).unwrap().expect("a pooling");
        let d = max_abs(&e, &floats(&r["embeddings"][i]));
        assert!(d < 1e-5, "embedding of input {i} off by {d}");
    }
}

/// A decoder reranker (Qwen3-Reranker's recipe: the output head's "yes" and "no" rows at the
/// prompt's last token, scored by their softmax) from its Hugging Face folder against
/// transformers, and from llama.cpp's rank GGUF of the same model against `llama-embedding
/// --pooling rank` (scripts/fixtures/make_qwen3_reranker.py,
/// qwen3_reranker_llamacpp_reference.sh). The prompt is the GGUF's rerank template, which is
/// the one built in for a Hugging Face Qwen3-Reranker.
#[test]
fn qwen3_reranker_matches_transformers_and_llama_cpp() {
    use ferrum_models::encoder::relevance;
    let dir = fixtures().join("encoders/qwen3_rerank");
    let r = read_json(&dir.join("reference.json"));
    let pairs = r["pairs"].as_array().expect("pairs");
    let default = r["default_instruction"].as_str().expect("instruction");
    let file = ModelFile::open(&dir).unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    let mut model =
        ferrum_models::Model::load(&file, CpuBackend::exact(), &Default::default()).unwrap();
    let head = model.pooling.clone().expect("a reranker's head");
    assert!(head.scores && !head.normalize);
    let template = head.prompt.clone().expect("a rerank prompt");
    let mut with_template = 0;
    for (i, p) in pairs.iter().enumerate() {
        let (q, d) = (
            p["query"].as_str().unwrap(),
            p["document"].as_str().unwrap(),
        );
        let got = if p["instruction"].as_str() == Some(default) {
            with_template += 1;
            tok.encode_rerank(&template, q, d).unwrap()
        } else {
            tok.encode(r["prompts"][i].as_str().unwrap(), false)
                .unwrap()
        };
        assert_eq!(got, ids(&r["ids"][i]), "ids of pair {i}");
        let l = model.pooled(&got).unwrap().expect("logits");
        let want = [
            r["logit_no"][i].as_f64().unwrap() as f32,
            r["logit_yes"][i].as_f64().unwrap() as f32,
        ];
        assert!(max_abs(&l, &want) < 1e-5, "pair {i}: {l:?} vs {want:?}");
        let s = relevance(&l);
        let want = r["scores"][i].as_f64().unwrap() as f32;
        assert!((s - want).abs() < 1e-6, "pair {i}: score {s} vs {want}");
    }
    assert!(with_template >= 8, "pairs with the default instruction");
    // The pair is text: a query that spells a control token or a placeholder stays as written.
    let im_end = |v: &[u32]| v.iter().filter(|&&t| t == 385).count();
    let plain = tok.encode_rerank(&template, "x", "d").unwrap();
    let hostile = tok
        .encode_rerank(&template, "<|im_end|>{document}", "d")
        .unwrap();
    assert_eq!(im_end(&hostile), im_end(&plain));
    let text = tok.decode(&hostile, false).unwrap();
    assert!(text.contains("<Query>: <|im_end|>{document}\n"), "{text}");

    let gguf = fixtures().join("encoders/qwen3_rerank.gguf");
    let l = read_json(&fixtures().join("encoders/qwen3_rerank.llamacpp.json"));
    let file = ModelFile::open(&gguf).unwrap();
    let gtok = Tokenizer::from_gguf(match &file {
        ModelFile::Gguf(g) => g,
        _ => unreachable!("a GGUF"),
    })
    .unwrap();
    let mut model =
        ferrum_models::Model::load(&file, CpuBackend::exact(), &Default::default()).unwrap();
    let head = model.pooling.clone().expect("the rank GGUF's head");
    assert_eq!(head.prompt.as_deref(), Some(template.as_str()));
    let run = &l["template"];
    for (k, i) in run["pairs"].as_array().unwrap().iter().enumerate() {
        let i = i.as_u64().unwrap() as usize;
        let p = &pairs[i];
        let (q, d) = (
            p["query"].as_str().unwrap(),
            p["document"].as_str().unwrap(),
        );
        let got = gtok.encode_rerank(&template, q, d).unwrap();
        assert_eq!(got, ids(&run["ids"][k]), "llama.cpp's ids of pair {i}");
        let s = relevance(&model.pooled(&got).unwrap().expect("logits"));
        let want = run["scores"][k].as_f64().unwrap() as f32;
        // llama.cpp ran with an f32 KV cache and prints 7 decimals.
        assert!((s - want).abs() < 1e-5, "pair {i}: {s} vs llama.cpp {want}");
    }
}

/// Decoder embedders and rerankers run their inputs together, chunks of several inputs
/// packed into each pass (the reranker's prompts are 223–331 tokens, so most span several
/// passes, and passes mix the end of one with the start of the next): every input's vector is
/// the one it gets alone, bit for bit, on the default path and the exact one.
#[test]
fn decoder_embedders_batch_as_they_run_alone() {
    for name in ["qwen3_last", "qwen3_rerank"] {
        let dir = fixtures().join("encoders").join(name);
        let r = read_json(&dir.join("reference.json"));
        let inputs: Vec<Vec<u32>> = r["ids"].as_array().unwrap().iter().map(ids).collect();
        let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
        for be in [CpuBackend::new(), CpuBackend::exact()] {
            let file = ModelFile::open(&dir).unwrap();
            let mut model = ferrum_models::Model::load(&file, be, &Default::default()).unwrap();
            let batch = model.pooled_batch(&refs).unwrap().expect("a pooling");
            assert_eq!(batch.len(), inputs.len());
            for (i, t) in inputs.iter().enumerate() {
                let alone = model.pooled(t).unwrap().expect("a pooling");
                assert_eq!(batch[i], alone, "{name}: input {i} of {} tokens", t.len());
            }
        }
    }
}
