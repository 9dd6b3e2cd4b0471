//! `ferrum plan MODEL`: before loading the weights, how much memory a run or a server will
//! take — the mapped weights, the KV cache, the activation buffers, the tokenizer and the
//! structured-output grammar — whether it fits in this machine's available memory, and how
//! many tokens of KV cache the rest of memory would hold.
//!
//! Weights, KV and activations are computed from the file's header and configuration; the
//! process's own footprint, the tokenizer's and the grammar's are measured here by building
//! them (they are small), so the figure tracks the real RSS of `ferrum serve`.

use std::path::Path;

use anyhow::{Context, Result};
use ferrum_loader::ModelFile;
use ferrum_tokenizer::Tokenizer;

/// A `Key: N kB` field of a /proc file (`/proc/self/status`, `/proc/meminfo`), in bytes.
pub(crate) fn proc_bytes(file: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(file).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident set size of this process, in bytes.
fn rss() -> u64 {
    proc_bytes("/proc/self/status", "VmRSS:").unwrap_or(0)
}

fn meminfo(key: &str) -> u64 {
    proc_bytes("/proc/meminfo", key).unwrap_or(0)
}

pub struct PlanArgs<'a> {
    pub model: &'a Path,
    pub ctx: Option<usize>,
    pub concurrency: usize,
    pub kv_tokens: Option<usize>,
    pub kv_bytes_per_value: f64,
    pub json: bool,
    /// A GGUF model's mmproj file (else the one beside it, as `run` and `serve` find it).
    pub mmproj: Option<&'a Path>,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let base = rss();
    let file =
        ModelFile::inspect(a.model).with_context(|| format!("reading {}", a.model.display()))?;
    if ferrum_models::encoder::is_encoder(&file) {
        return plan_encoder(&a, &file, base);
    }
    let c = ferrum_models::read_config(&file)?;
    let vision = ferrum_models::vision::plan(&file, a.mmproj)?;
    let header = rss().saturating_sub(base);
    let tok_before = rss();
    let tok = match &file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    };
    let tokenizer = rss().saturating_sub(tok_before);
    let g_before = rss();
    let grammar = ferrum_generate::GrammarCompiler::new(&tok, c.vocab_size)?;
    let grammar_bytes = rss().saturating_sub(g_before);
    drop(grammar);

    let ctx = a
        .ctx
        .unwrap_or_else(|| c.max_position.min(ferrum_models::DEFAULT_MAX_CONTEXT));
    let kv_tokens = a.kv_tokens.unwrap_or(ctx * a.concurrency.max(1));
    let attn_layers = c.n_layers - c.linear_layers();
    // Only layers that keep their own cache count: Gemma 4's KV-shared layers read an
    // earlier layer's.
    let kv_per_token = c.kv_values_per_token() as f64 * a.kv_bytes_per_value;
    let shared_kv_layers = c.layers.iter().filter(|l| l.kv_from.is_some()).count();
    // Latent attention caches one shared row a position; expanded, every head would keep a
    // key and a value.
    let expanded_per_token = c
        .mla
        .map(|m| (attn_layers * c.n_heads * (m.q_head() + m.v_dim)) as f64 * a.kv_bytes_per_value);
    // As the engine sizes its pool: blocks of one KV group's layers, windowed groups holding
    // only their window of each sequence (see `KvGroups`).
    let groups = ferrum_models::KvGroups::new(&c.layers);
    // A vision model whose image rows attend both ways holds a whole image besides a chunk in
    // a pass (`set_pass_capacity`); the Qwen VL line's images are cut like text. The chunk is
    // the decoder's: longer where the dense FFN's matrices are in a format the CPU decodes
    // once a product (`Backend::long_prefill`).
    let long = file.tensors().tensors.values().any(|t| {
        (t.name.ends_with("ffn_down.weight") || t.name.ends_with("mlp.down_proj.weight"))
            && ferrum_backend::cpu::quant::iq_tile::takes(t.dtype)
    });
    let chunk_len = ferrum_models::decoder::pass_tokens(long);
    let pass = chunk_len.max(
        vision
            .as_ref()
            .map_or(0, |v| v.pass_rows + ferrum_models::decoder::CHUNK),
    );
    let (bs, chunk_tokens) = (ferrum_models::decoder::BLOCK_SIZE, pass);
    let block_values: usize = groups
        .buffer_shapes((c.n_kv_heads, c.head_dim))
        .iter()
        .map(|(heads, dim)| heads * dim)
        .sum();
    let block_bytes = (c.kv_tensors() * bs * block_values) as f64 * a.kv_bytes_per_value;
    let kv_blocks = match a.kv_tokens {
        Some(t) => groups.blocks_for(t, bs, chunk_tokens),
        None => a.concurrency.max(1) * groups.blocks_for(ctx, bs, chunk_tokens),
    };
    let mut kv = block_bytes * kv_blocks as f64;
    // Hybrid models: the engine's recurrent-state slots (one per running sequence, plus the
    // prefix cache's snapshots), in f32, beside the KV blocks.
    let state_slots = if c.linear_layers() > 0 {
        ferrum_generate::engine::HYBRID_MAX_RUNNING
            + ferrum_generate::EngineConfig::with_kv_tokens(1).state_snapshots
    } else {
        0
    };
    let state_bytes = c.state_bytes() as f64;
    let states = state_bytes * state_slots as f64;
    kv += states;
    // An mmproj file is mapped beside the model; a Hugging Face folder's files hold both.
    let vision_file = vision.as_ref().map_or(0, |v| v.file_bytes) as f64;
    let vision_act = vision.as_ref().map_or(0, |v| v.activation_bytes) as f64;
    let weights = file.file_bytes() as f64 + vision_file;
    // The decoder's buffers for one pass (`pass`: CHUNK or LONG_CHUNK tokens, or an image's
    // rows and a CHUNK for a vision model), the logits of up to CHUNK rows (and the engine's
    // copy of them), the MoE scratch; one image's pass through the vision tower.
    let chunk = pass as f64;
    let (qd, kvd, f) = c.max_layer_dims();
    let (h, qd, kvd, f, v) = (
        c.hidden_size as f64,
        qd as f64,
        kvd as f64,
        f as f64,
        c.vocab_size as f64,
    );
    let mut act = chunk * (3.0 * h + qd + 2.0 * kvd + qd + 3.0 * f) * 4.0;
    // Gemma 4's per-layer inputs: every layer's slice for the pass, twice, and one gate.
    let lp = (c.per_layer_input * c.n_layers) as f64;
    act += chunk * (2.0 * lp + 3.0 * c.per_layer_input as f64) * 4.0;
    act += vision_act;
    let rows = (ferrum_models::decoder::CHUNK as f64)
        .min(a.concurrency.max(1) as f64)
        .max(1.0);
    act += 2.0 * rows * v * 4.0;
    if let Some(m) = &c.moe {
        act += chunk * (2.0 * m.n_experts as f64 + 2.0 * h + 3.0 * m.expert_ffn as f64) * 4.0;
        if m.style == ferrum_models::config::MoeStyle::Gemma4 {
            act += chunk * 3.0 * h * 4.0;
        }
    }
    if let Some(m) = &c.mla {
        let heads = c.n_heads as f64;
        let a_width = (m.q_rank.unwrap_or(0) + m.kv_rank + m.rope_dim) as f64;
        act += chunk * (heads * (m.q_head() + m.v_dim) as f64 + a_width) * 4.0;
    }
    // The server holds two tokenizers (its own for prompts, the engine's for text).
    let copies = if a.concurrency > 1 || a.kv_tokens.is_some() {
        2.0
    } else {
        1.0
    };
    let runtime = (base + header) as f64 + copies * tokenizer as f64;
    let total = weights + kv + act + runtime;
    let with_grammar = total + grammar_bytes as f64;
    let available = meminfo("MemAvailable:") as f64;
    let mem_total = meminfo("MemTotal:") as f64;
    let fits = with_grammar <= available;
    let spare_blocks = ((available - (with_grammar - kv)) / block_bytes).max(0.0) as usize;
    let spare_kv_tokens = groups.tokens_for(spare_blocks, bs, chunk_tokens) as u64;
    let windowed: Vec<(usize, usize)> = groups
        .groups
        .iter()
        .filter_map(|(l, w)| w.map(|w| (l.len(), w)))
        .collect();
    let mb = |b: f64| b / 1e6;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model.display().to_string(),
                "arch": c.arch.name(),
                "context": ctx,
                "concurrency": a.concurrency,
                "kv_tokens": kv_tokens,
                "kv_bytes_per_token": kv_per_token,
                "kv_expanded_bytes_per_token": expanded_per_token,
                "kv_blocks": kv_blocks,
                "kv_block_bytes": block_bytes,
                "windowed_layers": windowed.iter().map(|(n, _)| n).sum::<usize>(),
                "kv_shared_layers": shared_kv_layers,
                "weights_bytes": weights,
                "vision_file_bytes": vision_file,
                "vision_activation_bytes": vision_act,
                "image_rows": vision.as_ref().map(|v| v.max_rows),
                "kv_bytes": kv,
                "state_slots": state_slots,
                "state_bytes_per_slot": state_bytes,
                "state_bytes": states,
                "activation_bytes": act,
                "runtime_bytes": runtime,
                "grammar_bytes": grammar_bytes,
                "total_bytes": total,
                "total_with_grammar_bytes": with_grammar,
                "mem_available_bytes": available,
                "mem_total_bytes": mem_total,
                "fits": fits,
                "kv_tokens_memory_holds": spare_kv_tokens,
            })
        );
        return Ok(());
    }
    println!(
        "{} ({}, {} layers, vocab {})",
        a.model.display(),
        c.arch.name(),
        c.n_layers,
        c.vocab_size
    );
    println!("  weights (mapped)        {:>10.1} MB", mb(weights));
    if let Some(v) = &vision {
        let file = if v.file_bytes > 0 {
            format!(
                "the mmproj file's {:.1} MB is in the weights; ",
                mb(vision_file)
            )
        } else {
            String::new()
        };
        println!(
            "                                         (vision tower: {file}one image's pass {:.1} MB, in the activations; an image is up to {} rows{})",
            mb(vision_act),
            v.max_rows,
            if v.pass_rows > 0 {
                format!(", in one pass of {pass}")
            } else {
                String::new()
            }
        );
    }
    let why = match a.kv_tokens {
        Some(_) => "as asked".to_string(),
        None => format!("context {ctx} × {} sequence(s)", a.concurrency),
    };
    println!(
        "  KV cache                {:>10.1} MB  ({kv_tokens} tokens × {:.1} KB: {why})",
        mb(kv),
        (kv - states) / kv_tokens.max(1) as f64 / 1e3
    );
    if let Some(&(_, w)) = windowed.first() {
        println!(
            "                                         ({} of {} layers keep only their last {w} positions of a sequence; {:.1} KB a token without)",
            windowed.iter().map(|(n, _)| n).sum::<usize>(),
            c.n_layers,
            kv_per_token / 1e3
        );
    }
    if shared_kv_layers > 0 {
        println!(
            "                                         ({shared_kv_layers} of {} layers keep no cache: they read an earlier layer's)",
            c.n_layers
        );
    }
    if let (Some(m), Some(full)) = (&c.mla, expanded_per_token) {
        println!(
            "                                         (latent attention: {} values a position and layer, {:.1} KB a token, where expanded heads would take {:.1} KB: 1/{:.0})",
            m.row(),
            kv_per_token / 1e3,
            full / 1e3,
            full / kv_per_token.max(1.0)
        );
    }
    if state_slots > 0 {
        println!(
            "                                         (of which {:.1} MB recurrent state: {state_slots} slots × {:.1} MB, for running sequences and prefix snapshots)",
            mb(states),
            mb(state_bytes)
        );
    }
    println!("  activations             {:>10.1} MB", mb(act));
    println!("  runtime + tokenizer     {:>10.1} MB", mb(runtime));
    println!("  total                   {:>10.1} MB", mb(total));
    println!(
        "  + structured output     {:>10.1} MB  (token trie, built on first use)",
        mb(grammar_bytes as f64)
    );
    println!(
        "  this machine: {:.1} GB available of {:.1} GB — {}",
        available / 1e9,
        mem_total / 1e9,
        if fits { "fits" } else { "does NOT fit" }
    );
    println!("  the rest of available memory holds {spare_kv_tokens} tokens of KV cache");
    Ok(())
}

/// An embedding or reranking encoder: no KV cache is kept between requests, so its memory is
/// the mapped weights, the 8-bit copies the CPU's fast path makes of the blocks' float
/// matrices, and one pass's buffers (`PASS_TOKENS` tokens: activations and one layer's
/// scratch keys and values, reused by every layer).
fn plan_encoder(a: &PlanArgs, file: &ModelFile, base: u64) -> Result<()> {
    use ferrum_core::DType;
    let c = ferrum_models::encoder::read_config(file)?;
    let header = rss().saturating_sub(base);
    let tok_before = rss();
    let tok = match file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    };
    let tokenizer = rss().saturating_sub(tok_before);
    drop(tok);
    let weights = file.file_bytes() as f64;
    let store = file.tensors();
    // The blocks' float matrices, as `Backend::load_weight_compute` stores them: Q8_0, 34
    // bytes a block of 32 values.
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let copies: f64 = store
        .tensors
        .iter()
        .filter(|(n, t)| {
            float(t.dtype)
                && t.shape.len() == 2
                && (n.contains("layer") || n.contains("blk."))
                && t.row_len().is_multiple_of(32)
        })
        .map(|(_, t)| t.numel() as f64 * 34.0 / 32.0)
        .sum();
    let tokens = ferrum_models::encoder::PASS_TOKENS as f64;
    let (h, f) = (c.hidden as f64, c.intermediate as f64);
    // x, tmp, qkv (3 h), attn and the FFN in f32 (a pre-norm block's normed copy, a gated
    // FFN's `[gate | up]` and product, local attention's reversed `[q | k | v]` besides); one
    // layer's keys and values in f16 (twice with local attention).
    let local = c.local.is_some();
    let gated = matches!(c.ffn, ferrum_models::encoder::FfnKind::Glu(_));
    let widths = 6.0 * h
        + if c.prenorm { h } else { 0.0 }
        + if local { 3.0 * h } else { 0.0 }
        + if gated { 3.0 * f } else { f };
    let kv_copies = if local { 2.0 } else { 1.0 };
    let act = tokens * widths * 4.0 + kv_copies * 2.0 * tokens * h * 2.0;
    let runtime = (base + header) as f64 + tokenizer as f64;
    let total = weights + copies + act + runtime;
    let available = meminfo("MemAvailable:") as f64;
    let mem_total = meminfo("MemTotal:") as f64;
    let fits = total <= available;
    let kind = if c.labels.is_some() {
        "reranker"
    } else {
        "embedding model"
    };
    let mb = |b: f64| b / 1e6;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model.display().to_string(),
                "arch": c.family.name(),
                "kind": kind,
                "context": c.context(),
                "weights_bytes": weights,
                "compute_copy_bytes": copies,
                "kv_bytes": 0,
                "activation_bytes": act,
                "runtime_bytes": runtime,
                "total_bytes": total,
                "mem_available_bytes": available,
                "mem_total_bytes": mem_total,
                "fits": fits,
            })
        );
        return Ok(());
    }
    println!(
        "{} ({}, an {kind}: {} layers, {} wide, reads {} tokens)",
        a.model.display(),
        c.family.name(),
        c.layers,
        c.hidden,
        c.context()
    );
    println!("  weights (mapped)        {:>10.1} MB", mb(weights));
    if copies > 0.0 {
        println!(
            "  8-bit copies            {:>10.1} MB  (the blocks' float matrices, as the CPU's fast path multiplies them; none with --exact)",
            mb(copies)
        );
    }
    println!("  KV cache                       0.0 MB  (none kept between requests)");
    println!(
        "  activations             {:>10.1} MB  (one pass of {} tokens)",
        mb(act),
        ferrum_models::encoder::PASS_TOKENS
    );
    println!("  runtime + tokenizer     {:>10.1} MB", mb(runtime));
    println!("  total                   {:>10.1} MB", mb(total));
    println!(
        "  this machine: {:.1} GB available of {:.1} GB — {}",
        available / 1e9,
        mem_total / 1e9,
        if fits { "fits" } else { "does NOT fit" }
    );
    Ok(())
}
