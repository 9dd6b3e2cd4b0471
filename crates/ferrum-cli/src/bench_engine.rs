//! `ferrum bench --concurrency 1,2,4,8`: many streams through the engine at once. Reports,
//! per concurrency level, the aggregate decode rate (tokens generated once every stream is
//! decoding, over that time: each step reads the weights once for all streams), time to
//! first token and inter-token latency percentiles.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request};
use ferrum_loader::ModelFile;
use ferrum_tokenizer::Tokenizer;

use crate::BackendOpts;

struct Level {
    streams: usize,
    decode_tok_s: f64,
    total_tok_s: f64,
    ttft_ms: [f64; 3],
    itl_ms: [f64; 3],
    preemptions: u64,
}

/// The 50th, 90th and 99th percentiles (nearest rank).
fn percentiles(mut v: Vec<f64>) -> [f64; 3] {
    if v.is_empty() {
        return [0.0; 3];
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    [at(0.5), at(0.9), at(0.99)]
}

pub fn run(
    path: &Path,
    file: &ModelFile,
    be: BackendOpts,
    levels: &[usize],
    prompt_len: usize,
    gen: usize,
    json: bool,
) -> Result<()> {
    if levels.contains(&0) || prompt_len == 0 || gen == 0 {
        bail!("--concurrency, --pp and --tg must be positive");
    }
    let max_c = levels.iter().copied().max().unwrap_or(1);
    let per_seq = prompt_len + gen + 1;
    let mut model = Some(crate::load_model(path, file, Some(per_seq), be)?);
    let mut tokenizer = Some(match file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    });
    let vocab = model.as_ref().map_or(1, |m| m.decoder.config.vocab_size) as u64;
    let mut results = Vec::new();
    for &c in levels {
        // Room for every stream at once: the benchmark measures batching, not preemption.
        let mut config = EngineConfig::with_kv_tokens(
            max_c * per_seq.next_multiple_of(ferrum_models::decoder::BLOCK_SIZE),
        );
        config.prefix_caching = false;
        let (Some(m), Some(t)) = (model.take(), tokenizer.take()) else {
            bail!("model lost between levels");
        };
        let mut engine = Engine::new(m, t, config)?;
        // A short request first, not timed, so no level runs cold (the first one did, by 2–9%:
        // fresh scratch buffers, caches, clocks), as llama-bench warms up before it measures.
        let warm: Vec<u32> = (0..prompt_len.min(32) as u64)
            .map(|i| ((i * 7_919 + 1) % vocab) as u32)
            .collect();
        let mut warm_req = Request::new(warm, gen.min(8));
        warm_req.ignore_eos = true;
        engine.add(warm_req)?;
        while engine.has_work() {
            engine.step()?;
        }
        // Distinct deterministic prompts, so no stream shares a prefix with another.
        let mut ids = Vec::new();
        for s in 0..c as u64 {
            let prompt = (0..prompt_len as u64)
                .map(|i| ((i * 2_654_435_761 + s * 97_531 + 12_345) % vocab) as u32)
                .collect();
            let mut req = Request::new(prompt, gen);
            req.ignore_eos = true;
            ids.push(engine.add(req)?);
        }
        let t0 = Instant::now();
        let mut first = vec![None::<Instant>; c];
        let mut last = vec![None::<Instant>; c];
        let mut itl = Vec::new();
        let mut produced = vec![0usize; c];
        let mut arrivals = Vec::new();
        let mut done = 0;
        while done < c {
            for o in engine.step()? {
                let i = o.id as usize - ids[0] as usize;
                let now = Instant::now();
                match o.kind {
                    OutputKind::Token { .. } => {
                        if let Some(prev) = last[i] {
                            itl.push((now - prev).as_secs_f64() * 1e3);
                        }
                        first[i].get_or_insert(now);
                        last[i] = Some(now);
                        produced[i] += 1;
                        arrivals.push(now);
                    }
                    OutputKind::Finished { .. } => done += 1,
                }
            }
        }
        let end = Instant::now();
        let all_decoding = first.iter().flatten().max().copied().unwrap_or(t0);
        // Tokens that arrived after every stream had its first one: pure decode steps.
        let late = arrivals.iter().filter(|&&t| t > all_decoding).count();
        let decode_secs = (end - all_decoding).as_secs_f64().max(1e-9);
        let ttft: Vec<f64> = first
            .iter()
            .flatten()
            .map(|f| (*f - t0).as_secs_f64() * 1e3)
            .collect();
        let total: usize = produced.iter().sum();
        results.push(Level {
            streams: c,
            decode_tok_s: late as f64 / decode_secs,
            total_tok_s: total as f64 / (end - t0).as_secs_f64(),
            ttft_ms: percentiles(ttft),
            itl_ms: percentiles(itl),
            preemptions: engine.stats().preemptions,
        });
        let (m, t) = engine.into_parts();
        model = Some(m);
        tokenizer = Some(t);
    }
    let base = results.first().map_or(1.0, |r| r.decode_tok_s);
    if json {
        let rows: Vec<_> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "streams": r.streams,
                    "decode_tok_s": r.decode_tok_s,
                    "total_tok_s": r.total_tok_s,
                    "ttft_ms_p50_p90_p99": r.ttft_ms,
                    "itl_ms_p50_p90_p99": r.itl_ms,
                    "preemptions": r.preemptions,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "model": path.display().to_string(),
                "prompt_tokens": prompt_len,
                "gen_tokens": gen,
                "levels": rows,
            })
        );
        return Ok(());
    }
    println!(
        "{c:>7} {:>12} {:>8} {:>10} {:>26} {:>26}",
        "decode t/s",
        "× one",
        "total t/s",
        "TTFT ms p50/p90/p99",
        "ITL ms p50/p90/p99",
        c = "streams"
    );
    for r in &results {
        println!(
            "{:>7} {:>12.1} {:>8.2} {:>10.1} {:>26} {:>26}",
            r.streams,
            r.decode_tok_s,
            r.decode_tok_s / base,
            r.total_tok_s,
            format!(
                "{:.0}/{:.0}/{:.0}",
                r.ttft_ms[0], r.ttft_ms[1], r.ttft_ms[2]
            ),
            format!("{:.1}/{:.1}/{:.1}", r.itl_ms[0], r.itl_ms[1], r.itl_ms[2]),
        );
    }
    Ok(())
}
