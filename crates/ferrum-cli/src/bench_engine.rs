//! `ferrum bench --concurrency 1,2,4,8`: many streams through the engine at once. Reports,
//! per concurrency level, the aggregate decode rate while all the level's streams decode
//! together (each step reads the weights once for all of them; llama-batched-bench's S_TG
//! is this rate), the same rate carried on to the last token (the streams that got their
//! first token earlier finish earlier, so the end decodes fewer streams at a time), time to
//! first token and inter-token latency percentiles. With `--reps R` the levels run R times
//! in turn and the medians are reported, `× one` being the median of the per-round ratios
//! (a level with no step in which all its streams decode reports NaN, `null` in JSON).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use ferrum_generate::{Engine, EngineConfig, OutputKind, Request};
use ferrum_loader::ModelFile;
use ferrum_models::Model;
use ferrum_tokenizer::Tokenizer;

use crate::bench::median;
use crate::device::MakeBackend;
use crate::BackendOpts;

/// One level run once.
struct Sample {
    decode_tok_s: f64,
    to_end_tok_s: f64,
    total_tok_s: f64,
    ttft_ms: Vec<f64>,
    itl_ms: Vec<f64>,
    preemptions: u64,
}

/// One level over every round.
struct Level {
    streams: usize,
    decode_tok_s: f64,
    x_one: f64,
    to_end_tok_s: f64,
    total_tok_s: f64,
    ttft_ms: [f64; 3],
    itl_ms: [f64; 3],
    preemptions: u64,
    per_round: Vec<f64>,
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

#[allow(clippy::too_many_arguments)]
pub fn run<B: MakeBackend>(
    path: &Path,
    file: &ModelFile,
    be: BackendOpts,
    levels: &[usize],
    loras: &[std::path::PathBuf],
    prompt_len: usize,
    gen: usize,
    reps: usize,
    json: bool,
) -> Result<()> {
    if levels.contains(&0) || prompt_len == 0 || gen == 0 || reps == 0 {
        bail!("--concurrency, --pp, --tg and --reps must be positive");
    }
    let budget = ferrum_models::decoder::CHUNK;
    if let Some(&c) = levels.iter().find(|&&c| c > budget) {
        bail!("--concurrency {c}: a step carries at most {budget} tokens, so more streams never decode together");
    }
    let max_c = levels.iter().copied().max().unwrap_or(1);
    let per_seq = prompt_len + gen + 1;
    let mut model = Some(crate::load_model::<B>(path, file, Some(per_seq), be)?);
    let mut adapters = Vec::new();
    if let Some(m) = model.as_mut() {
        for (k, p) in loras.iter().enumerate() {
            let src = ferrum_models::lora::AdapterSource {
                path: p,
                scale: 1.0,
            };
            adapters.push(m.load_adapter(&format!("lora{k}"), &src)?);
        }
    }
    let mut tokenizer = Some(match file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    });
    let vocab = model.as_ref().map_or(1, |m| m.decoder.config.vocab_size) as u64;
    // Room for every stream at once: the benchmark measures batching, not preemption.
    let room = (per_seq, max_c);
    // Each round runs every level once, so a slow spell of a noisy machine falls on all the
    // levels alike, and `× one` is taken within a round.
    let mut rounds: Vec<Vec<Sample>> = Vec::new();
    for _ in 0..reps {
        let mut round = Vec::new();
        for &c in levels {
            let (Some(m), Some(t)) = (model.take(), tokenizer.take()) else {
                bail!("model lost between levels");
            };
            let (sample, m, t) = measure(m, t, room, vocab, c, &adapters, prompt_len, gen)?;
            round.push(sample);
            model = Some(m);
            tokenizer = Some(t);
        }
        rounds.push(round);
    }
    let results: Vec<Level> = (0..levels.len())
        .map(|l| {
            let at = |f: fn(&Sample) -> f64| median(rounds.iter().map(|r| f(&r[l])).collect());
            let pooled = |f: fn(&Sample) -> &[f64]| {
                percentiles(rounds.iter().flat_map(|r| f(&r[l]).to_vec()).collect())
            };
            Level {
                streams: levels[l],
                decode_tok_s: at(|s| s.decode_tok_s),
                x_one: median(
                    rounds
                        .iter()
                        .map(|r| r[l].decode_tok_s / r[0].decode_tok_s)
                        .collect(),
                ),
                to_end_tok_s: at(|s| s.to_end_tok_s),
                total_tok_s: at(|s| s.total_tok_s),
                ttft_ms: pooled(|s| &s.ttft_ms),
                itl_ms: pooled(|s| &s.itl_ms),
                preemptions: rounds.iter().map(|r| r[l].preemptions).sum(),
                per_round: rounds.iter().map(|r| r[l].decode_tok_s).collect(),
            }
        })
        .collect();
    if json {
        let rows: Vec<_> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "streams": r.streams,
                    "decode_tok_s": r.decode_tok_s,
                    "x_one": r.x_one,
                    "decode_to_end_tok_s": r.to_end_tok_s,
                    "total_tok_s": r.total_tok_s,
                    "ttft_ms_p50_p90_p99": r.ttft_ms,
                    "itl_ms_p50_p90_p99": r.itl_ms,
                    "preemptions_all_rounds": r.preemptions,
                    "decode_tok_s_per_round": r.per_round,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "model": path.display().to_string(),
                "prompt_tokens": prompt_len,
                "gen_tokens": gen,
                "rounds": reps,
                "levels": rows,
            })
        );
        return Ok(());
    }
    if reps > 1 {
        println!("medians of {reps} rounds; × one is the median of the rounds' ratios");
    }
    println!(
        "{c:>7} {:>12} {:>8} {:>10} {:>10} {:>22} {:>20}",
        "decode t/s",
        "× one",
        "to end t/s",
        "total t/s",
        "TTFT ms p50/p90/p99",
        "ITL ms p50/p90/p99",
        c = "streams"
    );
    for r in &results {
        println!(
            "{:>7} {:>12.1} {:>8.2} {:>10.1} {:>10.1} {:>22} {:>20}",
            r.streams,
            r.decode_tok_s,
            r.x_one,
            r.to_end_tok_s,
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

/// Runs `c` streams of a `prompt_len`-token prompt and `gen` tokens each through a fresh
/// engine over the model, and hands the model and tokenizer back.
#[allow(clippy::too_many_arguments)]
fn measure<B: MakeBackend>(
    model: Model<B>,
    tokenizer: Tokenizer,
    (per_seq, streams): (usize, usize),
    vocab: u64,
    c: usize,
    adapters: &[usize],
    prompt_len: usize,
    gen: usize,
) -> Result<(Sample, Model<B>, Tokenizer)> {
    let mut config = EngineConfig::for_model(&model.decoder, per_seq);
    config.kv_blocks *= streams;
    config.prefix_caching = false;
    let mut engine = Engine::new(model, tokenizer, config)?;
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
        if !adapters.is_empty() {
            req.adapter = adapters[s as usize % adapters.len()];
        }
        ids.push(engine.add(req)?);
    }
    let t0 = Instant::now();
    let mut first = vec![None::<Instant>; c];
    let mut last = vec![None::<Instant>; c];
    let mut itl = Vec::new();
    let mut produced = vec![0usize; c];
    // Steps once every stream has its first token are decode only. `steady` is the leading
    // run of them in which all `c` streams still produced a token; after it the streams that
    // started first finish one by one.
    let mut all_decoding = None::<Instant>;
    let (mut steady_tokens, mut steady_end, mut in_steady) = (0usize, None::<Instant>, true);
    let (mut late, mut done) = (0usize, 0);
    while done < c {
        let outputs = engine.step()?;
        let now = Instant::now();
        let mut tokens = 0;
        for o in outputs {
            let i = o.id as usize - ids[0] as usize;
            match o.kind {
                OutputKind::Token { .. } => {
                    if let Some(prev) = last[i] {
                        itl.push((now - prev).as_secs_f64() * 1e3);
                    }
                    first[i].get_or_insert(now);
                    last[i] = Some(now);
                    produced[i] += 1;
                    tokens += 1;
                }
                OutputKind::Finished { .. } => done += 1,
            }
        }
        if all_decoding.is_some() {
            late += tokens;
            in_steady &= tokens == c;
            if in_steady {
                steady_tokens += tokens;
                steady_end = Some(now);
            }
        } else if first.iter().all(Option::is_some) {
            all_decoding = Some(now);
        }
    }
    let end = Instant::now();
    let all_decoding = all_decoding.unwrap_or(t0);
    let secs = |to: Instant| (to - all_decoding).as_secs_f64().max(1e-9);
    let ttft = first
        .iter()
        .flatten()
        .map(|f| (*f - t0).as_secs_f64() * 1e3)
        .collect();
    let total: usize = produced.iter().sum();
    // No step with every stream decoding: the first streams finished before the last one
    // started (prefill staggered over more steps than the generation lasts).
    let decode_tok_s = match steady_end {
        Some(e) if steady_tokens > 0 => steady_tokens as f64 / secs(e),
        _ => {
            eprintln!(
                "{c} streams: no step had all of them decoding (a longer --tg is needed); \
                 see the to-end rate"
            );
            f64::NAN
        }
    };
    let sample = Sample {
        decode_tok_s,
        to_end_tok_s: late as f64 / secs(end),
        total_tok_s: total as f64 / (end - t0).as_secs_f64(),
        ttft_ms: ttft,
        itl_ms: itl,
        preemptions: engine.stats().preemptions,
    };
    let (m, t) = engine.into_parts();
    Ok((sample, m, t))
}
