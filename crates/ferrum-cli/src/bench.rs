//! `ferrum bench`: the figures llama-bench reports, measured the same way — `pp N`: one
//! prompt of N tokens processed from an empty cache; `tg N`: N tokens decoded one at a time
//! from an empty cache — as the median of several runs, plus the process's peak RSS.

use std::path::PathBuf;
use std::time::Instant;

use crate::device::MakeBackend;
use anyhow::{bail, Result};
use clap::Args;

#[derive(Args)]
pub struct BenchArgs {
    /// A .gguf file or a Hugging Face model folder.
    model: PathBuf,
    /// Prompt length for the prefill test (0 skips it).
    #[arg(long, default_value_t = 512)]
    pp: usize,
    /// Tokens for the generation test (0 skips it).
    #[arg(long, default_value_t = 128)]
    tg: usize,
    /// Runs of each test (with `--concurrency`: rounds over all the levels); the median is
    /// reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Keep activations in f32.
    #[arg(long)]
    exact: bool,
    /// KV cache element format: f16 (default), f32 or q8_0.
    #[arg(long, value_parser = crate::parse_kv_dtype)]
    kv_dtype: Option<ferrum_backend::cpu::KvDtype>,
    /// auto (a GPU if there is one, else the CPU), cpu, vulkan or vulkan:N.
    #[arg(long, value_parser = crate::device::parse_device, default_value = "auto")]
    device: crate::device::Device,
    /// Instead of pp/tg: serve this many concurrent streams through the engine, for each
    /// value in the list (e.g. 1,2,4,8), each stream a `--pp`-token prompt and `--tg` tokens.
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// LoRA adapters (repeatable; a PEFT folder or a llama.cpp GGUF LoRA): the streams run
    /// through the engine (`--concurrency`, one stream without it), stream `s` through
    /// adapter `s mod count`.
    #[arg(long)]
    lora: Vec<PathBuf>,
    /// With --spec ngram|draft: instead of pp/tg, answer prompts (`--spec-prompt`, or three
    /// built in: a code edit, a quoting summary, free text) greedily with speculation off and
    /// on, `--tg` tokens each, and compare the decode rates.
    #[command(flatten)]
    spec: crate::SpecArgs,
    /// A prompt for the speculative benchmark (repeatable).
    #[arg(long)]
    spec_prompt: Vec<String>,
    /// Instead of pp/tg: an embedding model's throughput, in sentences per second, over the
    /// texts of this file (one a line), all given at once as a server batches them; `-`
    /// for 1,000 built-in sentences of 8-64 tokens.
    #[arg(long)]
    embed: Option<String>,
    /// Instead of pp/tg: a vision model's image prefill of this image (PNG, JPEG, WebP,
    /// GIF): preprocessing, the vision tower, and the language model's pass over the image's
    /// rows (with its begin and end tokens), each timed; `--reps` runs, medians.
    #[arg(long)]
    image: Option<PathBuf>,
    /// A GGUF model's vision tower for `--image` (default: the mmproj file beside it).
    #[arg(long)]
    mmproj: Option<PathBuf>,
}

/// The middle of the finite values (the upper of the two middle ones for an even count); NaN
/// for none (a `--concurrency` level that had no step with all its streams decoding).
pub(crate) fn median(v: Vec<f64>) -> f64 {
    let mut v: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Read bandwidth in GB/s, measured here and now: the best of five passes of each of two
/// ways of summing a buffer of `bytes`, split over `threads` threads — a plain sequential sum,
/// and four streams in lockstep with software prefetches ahead, as decode reads four weight
/// rows at a time (on AMD Zen 5 decode ran past a "bound" measured by the plain sum alone).
/// 512 MiB is far larger than most caches (main memory); a buffer the size of the weights read
/// per token gives the rate at which decode could re-read them, caches included, on a machine
/// whose last-level cache holds a share.
fn memory_bandwidth(threads: usize, bytes: usize) -> f64 {
    // On huge pages like the packed weights (the backend's arena): on 4 KiB pages the sum
    // pays a TLB miss per page, and decode, which does not, ran past the "bound".
    let arena = ferrum_backend::cpu::arena::Arena::default();
    let buf = ferrum_backend::cpu::arena::ArenaVec::filled(&arena, bytes / 8, 1u64);
    let mut best = 0f64;
    for pass in 0..10 {
        let streams = pass % 2 == 1;
        let t = Instant::now();
        let chunk = buf.len().div_ceil(threads.max(1));
        let sum: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(chunk)
                .map(|c| {
                    s.spawn(move || {
                        if streams {
                            sum_streams(c)
                        } else {
                            c.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                        }
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.max((buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// The sum of `c`'s words, read as four equal streams side by side, each stream's lines
/// prefetched as far ahead as the decode kernels prefetch theirs.
fn sum_streams(c: &[u64]) -> u64 {
    const LINE: usize = 8; // words per 64-byte line
    const AHEAD: usize = ferrum_backend::cpu::quant::q8::PREFETCH_BYTES / 8;
    let n = c.len() / (4 * LINE) * LINE;
    let s: [&[u64]; 4] = std::array::from_fn(|i| &c[i * n..(i + 1) * n]);
    let mut acc = [0u64; 4];
    for at in (0..n).step_by(LINE) {
        for (a, st) in acc.iter_mut().zip(&s) {
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                let p = st.as_ptr().wrapping_add(at + AHEAD) as *const i8;
                // SAFETY: a prefetch has no architectural effect and never faults, whatever
                // the address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
            }
            *a = st[at..at + LINE].iter().fold(*a, |x, &y| x.wrapping_add(y));
        }
    }
    let rest = c[4 * n..].iter().fold(0u64, |x, &y| x.wrapping_add(y));
    acc.iter().fold(rest, |x, &y| x.wrapping_add(y))
}

/// Peak resident set size in bytes (Linux), from `/proc/self/status`.
fn peak_rss() -> Option<u64> {
    crate::plan::proc_bytes("/proc/self/status", "VmHWM:")
}

pub fn run(a: BenchArgs) -> Result<()> {
    let be = crate::BackendOpts::new(a.exact, a.kv_dtype, a.device);
    crate::device::on_backend!(be, run_on(a, be))
}

fn run_on<B: MakeBackend>(a: BenchArgs, be: crate::BackendOpts) -> Result<()> {
    if a.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let ctx = a.pp.max(a.tg).max(1);
    let file = ferrum_loader::ModelFile::open(&a.model)?;
    if let Some(texts) = &a.embed {
        return embed_bench::<B>(&a, be, texts);
    }
    if let Some(image) = &a.image {
        return image_bench::<B>(&a, &file, be, image);
    }
    if a.spec.enabled() {
        return crate::bench_spec::run::<B>(crate::bench_spec::SpecBench {
            model: &a.model,
            be,
            spec: &a.spec,
            prompts: &a.spec_prompt,
            tg: a.tg,
            reps: a.reps,
            json: a.json,
        });
    }
    // Adapters run through the engine: without --concurrency, as one stream.
    let one = [1];
    let levels: &[usize] = if a.concurrency.is_empty() && !a.lora.is_empty() {
        &one
    } else {
        &a.concurrency
    };
    if !levels.is_empty() {
        return crate::bench_engine::run::<B>(
            &a.model, &file, be, levels, &a.lora, a.pp, a.tg, a.reps, a.json,
        );
    }
    let mut model = crate::load_model::<B>(&a.model, &file, Some(ctx), be)?;
    let vocab = model.decoder.config.vocab_size as u32;
    // Deterministic, varied token ids (a constant prompt would route every MoE token alike).
    let tokens: Vec<u32> = (0..ctx as u64)
        .map(|i| ((i * 2_654_435_761 + 12_345) % vocab as u64) as u32)
        .collect();
    let backend_name = model.decoder.backend().name();
    let mut kv = model.decoder.alloc_kv_tokens(ctx);

    // One untimed warm-up of each test: first touches of the mapped weights are page faults.
    // Logits stay where the pass leaves them, as in the engine's decode step (no per-token
    // vocabulary-sized copy: see `Decoder::forward_last`).
    let mut spare = Vec::new();
    let mut pp = Vec::new();
    if a.pp > 0 {
        model
            .decoder
            .forward_last(&mut kv, &tokens[..a.pp], 0, &mut spare)?;
        for _ in 0..a.reps {
            let t = Instant::now();
            model
                .decoder
                .forward_last(&mut kv, &tokens[..a.pp], 0, &mut spare)?;
            pp.push(a.pp as f64 / t.elapsed().as_secs_f64());
        }
    }
    let mut tg = Vec::new();
    if a.tg > 0 {
        for rep in 0..=a.reps {
            if rep == 1 {
                // Expert counts and timings cover the timed runs only, not the warm-up.
                model.decoder.reset_expert_stats();
            }
            let t = Instant::now();
            for (i, &tok) in tokens[..a.tg].iter().enumerate() {
                model.decoder.forward_last(&mut kv, &[tok], i, &mut spare)?;
            }
            if rep > 0 {
                tg.push(a.tg as f64 / t.elapsed().as_secs_f64());
            }
        }
    }
    // Peak RSS before the bandwidth probe allocates its buffer.
    let rss = peak_rss();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The host's memory bounds the CPU's decode, not a GPU's (the device script works out
    // the GPU's share of its own bandwidth).
    let bandwidth = if a.tg > 0 && !be.on_vulkan() {
        Some(memory_bandwidth(threads, 512 << 20))
    } else {
        None
    };
    let pp_med = (!pp.is_empty()).then(|| median(pp.clone()));
    let tg_med = (!tg.is_empty()).then(|| median(tg.clone()));
    let info = &model.info;
    let bytes_per_token = info.decode_bytes_per_token as f64;
    // Decode cannot beat reading every weight once per token at the measured bandwidth.
    let bound = bandwidth.map(|bw| bw * 1e9 / bytes_per_token);
    // The same at the bandwidth of a weight-sized buffer: the tighter bound when the caches
    // hold part of the weights (then `bound` above is no bound at all).
    let ws_bandwidth = bandwidth.map(|_| {
        let ws = (info.decode_bytes_per_token as usize).clamp(16 << 20, 512 << 20);
        memory_bandwidth(threads, ws)
    });
    let ws_bound = ws_bandwidth.map(|bw| bw * 1e9 / bytes_per_token);
    let experts = model.decoder.expert_stats().map(|s| s.to_vec());
    // The MoE block during tg: its time per token against reading the active experts' bytes.
    let tg_tokens = (a.tg * a.reps) as f64;
    let moe_ms = model
        .decoder
        .expert_secs()
        .filter(|_| a.tg > 0)
        .map(|s| 1e3 * s / tg_tokens);
    let moe_bound_ms = bandwidth
        .filter(|_| info.expert_bytes_per_token > 0)
        .map(|bw| 1e3 * info.expert_bytes_per_token as f64 / (bw * 1e9));
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model.display().to_string(),
                "arch": info.arch.name(),
                "dtype": info.main_dtype.name(),
                "file_bytes": info.file_bytes,
                "backend": backend_name,
                "pp": a.pp, "pp_tok_s": pp_med, "pp_runs": pp,
                "tg": a.tg, "tg_tok_s": tg_med, "tg_runs": tg,
                "peak_rss_bytes": rss,
                "bandwidth_gb_s": bandwidth,
                "weight_bytes_per_token": info.decode_bytes_per_token,
                "tg_bound_tok_s": bound,
                "bandwidth_weight_sized_gb_s": ws_bandwidth,
                "tg_bound_weight_sized_tok_s": ws_bound,
                "moe_block_ms_per_token": moe_ms,
                "moe_block_bound_ms_per_token": moe_bound_ms,
                "expert_bytes_per_token": info.expert_bytes_per_token,
                "expert_tokens_per_layer": experts,
            })
        );
        return Ok(());
    }
    println!(
        "model: {} ({}, {}, {:.0} MB)",
        a.model.display(),
        info.arch.name(),
        info.main_dtype,
        info.file_bytes as f64 / 1e6
    );
    println!("backend: {backend_name}");
    if let Some(v) = pp_med {
        println!("pp{:<5} {:>9.1} tok/s  (median of {})", a.pp, v, a.reps);
    }
    if let Some(v) = tg_med {
        println!("tg{:<5} {:>9.1} tok/s  (median of {})", a.tg, v, a.reps);
    }
    if let (Some(bw), Some(b)) = (bandwidth, bound) {
        println!(
            "bandwidth bound: {:.1} MB per token at {bw:.1} GB/s measured = {b:.1} tok/s; tg is {:.0}% of it",
            bytes_per_token / 1e6,
            100.0 * tg_med.unwrap_or(0.0) / b
        );
    }
    if let (Some(bw), Some(b)) = (ws_bandwidth, ws_bound) {
        println!(
            "  with a buffer the size of the weights: {bw:.1} GB/s = {b:.1} tok/s; tg is {:.0}% of it",
            100.0 * tg_med.unwrap_or(0.0) / b
        );
    }
    if let Some(r) = rss {
        println!("peak RSS: {:.0} MB", r as f64 / 1e6);
    }
    if let (Some(t), Some(b)) = (moe_ms, moe_bound_ms) {
        println!(
            "MoE block (decode): {t:.3} ms per token; reading the active experts' {:.1} MB takes {b:.3} ms ({:.2}×)",
            info.expert_bytes_per_token as f64 / 1e6,
            t / b
        );
    }
    if let Some(stats) = experts {
        println!("expert load during tg (tokens per expert, per MoE layer):");
        for (l, c) in stats.iter().enumerate() {
            let total: u64 = c.iter().sum();
            if total == 0 {
                continue;
            }
            let max = c.iter().max().copied().unwrap_or(0);
            let active = c.iter().filter(|&&x| x > 0).count();
            println!(
                "  layer {l:>3}: {active}/{} experts used, busiest {max} of {total} ({:.1}× the even share)",
                c.len(),
                max as f64 * c.len() as f64 / total as f64
            );
        }
    }
    Ok(())
}

/// Texts for `--embed -`: 1,000 sentences of 6 to 50 words from a fixed vocabulary (8 to 64
/// tokens with BERT's WordPiece and its two special tokens), the same every run.
fn builtin_sentences() -> Vec<String> {
    const WORDS: &[&str] = &[
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "model",
        "reads",
        "text",
        "and",
        "writes",
        "answers",
        "for",
        "people",
        "who",
        "ask",
        "questions",
        "about",
        "science",
        "history",
        "music",
        "art",
        "cities",
        "rivers",
        "mountains",
        "computers",
        "networks",
        "memory",
        "speed",
        "search",
        "engine",
        "finds",
        "documents",
        "quickly",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..1000)
        .map(|_| {
            let n = 6 + (next() % 45) as usize;
            let words: Vec<&str> = (0..n)
                .map(|_| WORDS[(next() % WORDS.len() as u64) as usize])
                .collect();
            format!("{}.", words.join(" "))
        })
        .collect()
}

/// `--embed`: every text embedded in one call (as the server batches waiting requests),
/// `--reps` times; the median rate.
fn embed_bench<B: MakeBackend>(a: &BenchArgs, be: crate::BackendOpts, texts: &str) -> Result<()> {
    let sentences = if texts == "-" {
        builtin_sentences()
    } else {
        std::fs::read_to_string(texts)?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect()
    };
    let (enc, tok) = crate::embed::open::<B>(&a.model, be)?;
    let limit = enc.context();
    let ids: Vec<Vec<u32>> = sentences
        .iter()
        .map(|t| {
            let mut v = tok.encode(t, true)?;
            v.truncate(limit);
            Ok(v)
        })
        .collect::<Result<_>>()?;
    let tokens: usize = ids.iter().map(Vec::len).sum();
    let inputs: Vec<ferrum_models::encoder::Input> = ids
        .iter()
        .map(|v| ferrum_models::encoder::Input {
            ids: v,
            types: None,
        })
        .collect();
    let mut rates = Vec::new();
    for _ in 0..a.reps {
        let t = Instant::now();
        enc.embed(&inputs)?;
        rates.push(sentences.len() as f64 / t.elapsed().as_secs_f64());
    }
    let rate = median(rates);
    let name = enc.backend_name();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"model": a.model, "backend": name, "sentences": sentences.len(),
                "tokens": tokens, "sentences_per_s": rate, "tokens_per_s": rate * tokens as f64 / sentences.len() as f64})
        );
    } else {
        println!(
            "embed: {} sentences ({} tokens) on {name}: {rate:.1} sentences/s ({:.0} tokens/s), median of {}",
            sentences.len(),
            tokens,
            rate * tokens as f64 / sentences.len() as f64,
            a.reps
        );
    }
    Ok(())
}

/// `--image`: one image through a vision model as a prompt's image prefill, each stage timed
/// (llama.cpp's `mtmd` reports the same two model stages: the image encoded, then decoded
/// into the language model's cache).
fn image_bench<B: MakeBackend>(
    a: &BenchArgs,
    file: &ferrum_loader::ModelFile,
    be: crate::BackendOpts,
    path: &std::path::Path,
) -> Result<()> {
    let mut model = crate::load_model_with::<B>(&a.model, file, None, be, a.mmproj.as_deref())?;
    let Some(vision) = &model.vision else {
        bail!("--image: this model has no vision tower (a GGUF model needs its mmproj file)");
    };
    let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let process = |vision: &ferrum_models::vision::Vision<B>| -> Result<_> {
        let img = ferrum_image::decode(&bytes, &ferrum_image::Limits::default())
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let px = vision
            .processor
            .process(&img)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(((img.width, img.height), px))
    };
    // The image's tokens: a fixed count (Gemma 3) or from its size (Qwen VL, Mistral 3).
    let px = process(vision)?.1;
    let tokens = vision.image_ids(&px);
    let rows = vision.rows(&px);
    let mut kv = model.decoder.alloc_kv_tokens(tokens.len());
    let (mut prep, mut tower, mut prefill) = (Vec::new(), Vec::new(), Vec::new());
    let mut size = (0, 0);
    // The first run is a warm-up (page faults of the mapped weights).
    for rep in 0..=a.reps {
        let t0 = Instant::now();
        let vision = model.vision.as_ref().expect("checked above");
        let (wh, px) = process(vision)?;
        size = wh;
        let t1 = Instant::now();
        let embeds = vision.encode(model.decoder.backend(), &px)?;
        let grid = vision.grid(&px);
        let t2 = Instant::now();
        model.forward_with_images(
            &mut kv,
            &tokens,
            &[(embeds, grid)],
            ferrum_models::decoder::Logits::Last,
        )?;
        let t3 = Instant::now();
        if rep > 0 {
            prep.push(1e3 * (t1 - t0).as_secs_f64());
            tower.push(1e3 * (t2 - t1).as_secs_f64());
            prefill.push(1e3 * (t3 - t2).as_secs_f64());
        }
    }
    let (prep_ms, tower_ms, prefill_ms) = (median(prep), median(tower), median(prefill));
    let total = prep_ms + tower_ms + prefill_ms;
    let backend_name = model.decoder.backend().name();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model.display().to_string(),
                "arch": model.info.arch.name(),
                "backend": backend_name,
                "image": path.display().to_string(),
                "image_size": [size.0, size.1],
                "image_rows": rows,
                "prompt_tokens": tokens.len(),
                "preprocess_ms": prep_ms,
                "encode_ms": tower_ms,
                "prefill_ms": prefill_ms,
                "total_ms": total,
                "runs": a.reps,
            })
        );
        return Ok(());
    }
    println!("model: {} ({})", a.model.display(), model.info.arch.name());
    println!("backend: {backend_name}");
    println!(
        "image {} ({}x{}): {rows} rows, a prompt of {} tokens; medians of {}",
        path.display(),
        size.0,
        size.1,
        tokens.len(),
        a.reps
    );
    println!("  preprocess        {prep_ms:>9.1} ms");
    println!("  vision tower      {tower_ms:>9.1} ms");
    println!(
        "  image prefill     {prefill_ms:>9.1} ms  ({:.1} tok/s)",
        tokens.len() as f64 * 1e3 / prefill_ms
    );
    println!("  total             {total:>9.1} ms");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_sum_reads_every_word_once() {
        // Lengths around the four-stream split (whole lines per stream, then a tail).
        for len in [0usize, 1, 31, 32, 33, 100, 4096, 4096 * 4 + 37] {
            let v: Vec<u64> = (0..len as u64).map(|i| i * i + 1).collect();
            let want = v.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            assert_eq!(sum_streams(&v), want, "length {len}");
        }
    }

    #[test]
    fn the_bandwidth_probe_measures_something() {
        let bw = memory_bandwidth(2, 8 << 20);
        assert!(bw.is_finite() && bw > 0.0, "{bw}");
    }
}
