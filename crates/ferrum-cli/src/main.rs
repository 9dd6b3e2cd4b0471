//! The `ferrum` command. Each subcommand is a thin caller of the library crates:
//! model file → model + tokenizer → session → streamed text.

mod bench;
mod bench_engine;
mod bench_spec;
mod default_model;
mod device;
mod embed;
mod models;
mod plan;
mod repl;
mod serve_fleet;

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use device::{on_backend, parse_device, BackendOpts, Device, MakeBackend};
use ferrum_backend::{cpu::KvDtype, Backend};
use ferrum_generate::{EngineConfig, GenerateOptions, SamplingExtras, SamplingParams, Session};
use ferrum_loader::ModelFile;
use ferrum_models::{LoadOptions, Logits, Model};
use ferrum_tokenizer::{Message, Tokenizer};

/// Meters the chat template's render thread, so a hostile template cannot take the memory
/// (`ferrum_core::alloc`).
#[global_allocator]
static ALLOC: ferrum_core::alloc::Metered = ferrum_core::alloc::Metered;

#[derive(Parser)]
#[command(
    name = "ferrum",
    version,
    about = "A fast, exact LLM inference engine for the CPU and Vulkan GPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Chat with a model in the terminal, or answer one prompt with --prompt.
    Run(RunArgs),
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// The devices a model can run on (`--device`): the CPU and each Vulkan device, with
    /// memory, driver and features.
    Devices {
        /// Print only the index of the first GPU (what `--device auto` picks), or nothing.
        #[arg(long, hide = true)]
        first_gpu: bool,
    },
    /// Download a model into the Hugging Face cache: org/repo, org/repo:file.gguf,
    /// org/repo:Q4_K_M or an alias (see `ferrum list --aliases`).
    Pull { reference: String },
    /// Models in the cache, with size, architecture, quantisation and whether complete.
    List {
        /// Show the short names `run`, `serve` and `pull` accept instead.
        #[arg(long)]
        aliases: bool,
    },
    /// How much memory a model will take (weights, KV cache, activations) and whether it fits,
    /// before loading it.
    Plan {
        /// A .gguf file, a Hugging Face folder, or a pulled reference.
        model: String,
        /// Longest sequence (as `run --ctx` / `serve --ctx`).
        #[arg(long)]
        ctx: Option<usize>,
        /// Sequences served at once: the KV cache holds ctx × this many tokens.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// KV cache size in tokens, as `serve --kv-tokens` (overrides ctx × concurrency).
        #[arg(long)]
        kv_tokens: Option<usize>,
        /// KV cache element format: f16 (default), f32 or q8_0.
        #[arg(long, value_parser = parse_kv_dtype)]
        kv_dtype: Option<KvDtype>,
        /// A GGUF model's vision tower (llama.cpp's mmproj file; default: the one beside the
        /// model, as run and serve find it).
        #[arg(long)]
        mmproj: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Print the logits of every position for a list of token ids, as JSON.
    Logits {
        #[arg(long)]
        model: PathBuf,
        /// Comma-separated token ids.
        #[arg(long, value_delimiter = ',')]
        tokens: Vec<u32>,
        /// Keep activations in f32 (the reference's math).
        #[arg(long)]
        exact: bool,
        /// auto (a GPU if there is one, else the CPU), cpu, vulkan or vulkan:N.
        #[arg(long, value_parser = parse_device, default_value = "auto")]
        device: Device,
        /// Through this LoRA adapter (a PEFT folder or a llama.cpp GGUF LoRA).
        #[arg(long)]
        lora: Option<PathBuf>,
        /// How strongly --lora applies (its own scale times this).
        #[arg(long, default_value_t = 1.0)]
        lora_scale: f32,
    },
    /// Embeddings of texts from an embedding model, or a reranker's scores of texts against
    /// --query, as JSON lines.
    Embed(embed::EmbedArgs),
    /// Prompt-processing and generation speed (llama-bench's pp and tg), with RSS.
    Bench(bench::BenchArgs),
    /// Quantise a GGUF file or a Hugging Face folder to GGUF (llama-quantize's recipes).
    Quantize {
        /// A .gguf file or a Hugging Face model folder.
        input: PathBuf,
        /// The .gguf file to write.
        output: PathBuf,
        /// Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_S/M/L, Q4_K_S,
        /// Q5_K_S, IQ4_XS, IQ4_NL, MXFP4_MOE, F16, BF16 or F32 (the 1-3 bit i-quants are
        /// read but not made: they need llama.cpp's importance matrix).
        #[arg(long = "type", default_value = "Q4_K_M")]
        ftype: String,
    },
    /// Perplexity of a text file under a model.
    Perplexity {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        file: PathBuf,
        /// Tokens per evaluation window.
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Keep activations in f32 (the reference's math).
        #[arg(long)]
        exact: bool,
        /// auto (a GPU if there is one, else the CPU), cpu, vulkan or vulkan:N.
        #[arg(long, value_parser = parse_device, default_value = "auto")]
        device: Device,
    },
}

#[derive(Args)]
struct RunArgs {
    /// A .gguf file, a Hugging Face folder, org/repo[:file.gguf|:QUANT] or an alias
    /// (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    model: Option<String>,
    /// Answer this prompt and exit instead of starting a chat.
    #[arg(long)]
    prompt: Option<String>,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// A system message for the conversation.
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Longest conversation in tokens (the KV cache holds this many).
    #[arg(long)]
    ctx: Option<usize>,
    /// Keep activations in f32 (the reference's math; slower on quantised models).
    #[arg(long)]
    exact: bool,
    /// KV cache element format: f16 (default), f32 (default with --exact) or q8_0.
    #[arg(long, value_parser = parse_kv_dtype)]
    kv_dtype: Option<KvDtype>,
    /// auto (a GPU if there is one, else the CPU), cpu, vulkan or vulkan:N.
    #[arg(long, value_parser = parse_device, default_value = "auto")]
    device: Device,
    /// Drop tokens less likely than this fraction of the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalise tokens already in the prompt or the answer (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Subtract this from the logit of every token already generated.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Subtract this times its count from the logit of every token already generated.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Stop before this text (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// How hard a reasoning model thinks, where its format has the setting (gpt-oss's
    /// harmony: low, medium or high).
    #[arg(long)]
    reasoning_effort: Option<String>,
    #[command(flatten)]
    spec: SpecArgs,
    /// A LoRA adapter to answer with: a PEFT folder (adapter_config.json +
    /// adapter_model.safetensors) or a llama.cpp GGUF LoRA.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// How strongly --lora applies (its own alpha / rank times this).
    #[arg(long, default_value_t = 1.0)]
    lora_scale: f32,
    /// An image for the prompt (repeatable; PNG, JPEG, WebP or GIF), for a vision-language
    /// model: the images come before the prompt's text, in order.
    #[arg(long)]
    image: Vec<PathBuf>,
    /// A GGUF model's vision tower: llama.cpp's mmproj file (default: the one beside the
    /// model, if there is one).
    #[arg(long)]
    mmproj: Option<PathBuf>,
}

/// Speculative decoding, for `run` and `serve`.
#[derive(Args, Clone)]
pub(crate) struct SpecArgs {
    /// Speculative decoding: `ngram` drafts by prompt lookup (tokens that followed the same
    /// few tokens earlier in the conversation), `draft` with the --draft model; the draft is
    /// checked in one pass and the answer is the same as without it.
    #[arg(long, value_parser = ["off", "ngram", "draft"], default_value = "off")]
    spec: String,
    /// Most tokens drafted a step with --spec (4 is best measured on a 2-core CPU, where a
    /// pass of many tokens costs more than one: see docs/performance.md).
    #[arg(long, default_value_t = 4)]
    spec_tokens: usize,
    /// A smaller model of the same vocabulary that drafts (implies --spec draft): a .gguf
    /// file, a Hugging Face folder or a reference as for the model.
    #[arg(long)]
    draft: Option<String>,
}

impl SpecArgs {
    /// Whether speculation was asked for.
    fn enabled(&self) -> bool {
        self.spec != "off" || self.draft.is_some()
    }

    /// Tokens drafted a step (0: off) and the draft model's path, if drafts come from one.
    fn resolve(&self) -> Result<(usize, Option<PathBuf>)> {
        let max = ferrum_generate::Speculate::MAX_TOKENS;
        if self.enabled() && !(1..=max).contains(&self.spec_tokens) {
            anyhow::bail!("--spec-tokens must be 1..={max}");
        }
        let mode = if self.draft.is_some() && self.spec == "off" {
            "draft"
        } else {
            self.spec.as_str()
        };
        match (mode, &self.draft) {
            ("off", _) => Ok((0, None)),
            ("ngram", None) => Ok((self.spec_tokens, None)),
            ("ngram", Some(_)) => anyhow::bail!("--draft goes with --spec draft, not ngram"),
            (_, None) => anyhow::bail!("--spec draft needs a draft model: --draft MODEL"),
            (_, Some(r)) => Ok((self.spec_tokens, Some(model_path(Some(r))?))),
        }
    }
}

/// Loads the draft model at `path` and drafts with it in `engine`.
fn attach_draft<B: MakeBackend>(
    engine: &mut ferrum_generate::Engine<B>,
    path: &Path,
    be: BackendOpts,
) -> Result<()> {
    // For as many positions as the model: the draft reads every one a sequence reaches.
    let (model, tok) = load(path, Some(engine.model.decoder.context), be)?;
    engine
        .set_draft_model(model, &tok)
        .with_context(|| format!("drafting with {}", path.display()))?;
    if let Some(c) = engine.draft_cost() {
        if !ferrum_generate::spec::DraftLen::can_pay(c) {
            eprintln!(
                "ferrum: warning: the draft model costs {:.0}% of a decode step a token, too much \
                 to pay even with every draft kept ({:.0}% at most): expect slower decoding \
                 (drafting pauses where it loses); a draft a tenth of the model's size pays",
                100.0 * c,
                100.0 * (1.0 - ferrum_generate::spec::DraftLen::BETA)
            );
        }
    }
    Ok(())
}

/// The summary line's note on speculative decoding.
fn spec_note<B: Backend>(e: &ferrum_generate::Engine<B>) -> String {
    match (e.draft_model(), e.config().spec_tokens) {
        (Some(m), k) => format!(
            ", drafting {k} tokens with a {:.0} M-parameter {} draft model",
            m.info.params as f64 / 1e6,
            m.info.main_dtype
        ),
        (None, 0) => String::new(),
        (None, k) => format!(", drafting {k} tokens by prompt lookup"),
    }
}

#[derive(Args, Clone)]
struct ServeArgs {
    /// A .gguf file, a Hugging Face folder, org/repo[:file.gguf|:QUANT] or an alias
    /// (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    model: Option<String>,
    /// Serve several models: NAME=MODEL (repeatable; MODEL as above, a bare MODEL is named
    /// after its file or reference). Each loads when a request names it, within
    /// --max-memory, and unloads when idle past --keep-alive or to make room.
    #[arg(long = "model")]
    models: Vec<String>,
    /// Serve every model in this folder (each .gguf file and each Hugging Face folder),
    /// named after its file or folder.
    #[arg(long)]
    models_dir: Option<PathBuf>,
    /// Serve every complete model in the local cache (`ferrum list`).
    #[arg(long)]
    models_from_cache: bool,
    /// With several models: the memory the loaded ones may take, in `ferrum plan`'s figures
    /// (e.g. 8G, 512M; default: 90% of the memory available at start).
    #[arg(long)]
    max_memory: Option<String>,
    /// With several models: how long a model stays loaded after its last request (5m,
    /// 30s, 0 to unload at once, -1 for ever); a request's `keep_alive` overrides it.
    #[arg(long, default_value = "5m")]
    keep_alive: String,
    /// Address to bind; 127.0.0.1 keeps the server local.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require this key as a Bearer token (or x-api-key) on the API routes, /v1 and Ollama's
    /// /api (or set FERRUM_API_KEY).
    #[arg(long, env = "FERRUM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// A name clients may give in `model` (repeatable: every one is listed in /v1/models,
    /// the first is the model's id; default: the reference, or the file name without .gguf).
    #[arg(long = "served-model-name", alias = "model-name")]
    model_names: Vec<String>,
    /// Answer requests whatever model name they give, as llama-server does (for clients that
    /// send their own names).
    #[arg(long)]
    any_model_name: bool,
    /// Refuse Ollama's /api/pull (by default it downloads into the model store, as
    /// `ferrum pull` does, for whoever may call the API).
    #[arg(long)]
    no_pull: bool,
    /// Longest sequence (prompt + answer) per request.
    #[arg(long)]
    ctx: Option<usize>,
    /// KV cache capacity in tokens, shared by all requests (default: 4 × the context).
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// KV cache element format: f16 (default), f32 or q8_0.
    #[arg(long, value_parser = parse_kv_dtype)]
    kv_dtype: Option<KvDtype>,
    /// Turn the prefix cache off.
    #[arg(long)]
    no_prefix_cache: bool,
    #[command(flatten)]
    spec: SpecArgs,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Requests that may wait for room before new ones get 429.
    #[arg(long, default_value_t = 64)]
    max_waiting: usize,
    /// Seconds running requests get to finish after SIGTERM (new ones get 503 and /ready
    /// says 503 meanwhile); the server exits when they are done or this has passed.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    /// Publish the prefix cache's block events (vLLM's format, for llm-d's KV-cache indexer)
    /// on this ZMQ endpoint, e.g. tcp://*:5557.
    #[arg(long)]
    kv_events: Option<String>,
    /// Answer embedding requests to a chat model with the mean of its hidden states (not a
    /// trained embedding; without this they get a 400 saying so). Embedding models (BERT,
    /// XLM-RoBERTa) need no flag.
    #[arg(long)]
    embeddings_from_chat_model: bool,
    /// The most pixels (width x height) an image in a request may have; larger ones get a
    /// 400 from their header, before decoding.
    #[arg(long, default_value_t = 32 << 20)]
    max_image_pixels: u64,
    /// The most images one request may carry.
    #[arg(long, default_value_t = 16)]
    max_images: usize,
    /// Fetch http(s) image URLs in requests (without this they get a 400): each within
    /// --image-url-timeout and the 20 MB image limit. The server then reaches any address a
    /// client names: allow it only where clients are trusted.
    #[arg(long)]
    allow_image_urls: bool,
    /// Seconds an image URL has, from connecting to its last byte.
    #[arg(long, default_value_t = 10.0, value_parser = positive_secs)]
    image_url_timeout: f64,
    /// A GGUF model's vision tower: llama.cpp's mmproj file (default: the one beside the
    /// model, if there is one).
    #[arg(long)]
    mmproj: Option<PathBuf>,
    /// Keep activations in f32 (the reference's math).
    #[arg(long)]
    exact: bool,
    /// auto (a GPU if there is one, else the CPU), cpu, vulkan or vulkan:N.
    #[arg(long, value_parser = parse_device, default_value = "auto")]
    device: Device,
    /// Accept requests whose Host header is this name (repeatable). When bound to a loopback
    /// address only IP literals and localhost are accepted otherwise (DNS-rebinding guard).
    #[arg(long = "allowed-host")]
    allowed_hosts: Vec<String>,
    /// Let pages from this origin (e.g. http://localhost:3000) call the API, with CORS
    /// headers (repeatable; `*` for any). Only the server's own origin (the chat page) can
    /// by default.
    #[arg(long = "allowed-origin")]
    allowed_origins: Vec<String>,
    /// Let special-token texts written in message content (`<|im_end|>`, ...) become
    /// control tokens, as before. Unsafe: a message can then forge turns of the conversation.
    #[arg(long)]
    allow_control_tokens_in_content: bool,
    /// Most tokens one request may generate, all its choices together (n × max_tokens);
    /// default: the KV cache's size.
    #[arg(long)]
    max_request_tokens: Option<usize>,
    /// A LoRA adapter, NAME=PATH (repeatable; a PEFT folder or a llama.cpp GGUF LoRA; a bare
    /// PATH is named after its file or folder): requests naming it in `model` run through
    /// it, batched with the base model's and other adapters' requests.
    #[arg(long = "lora")]
    loras: Vec<String>,
    /// Most LoRA adapters loaded at once (with POST /v1/load_lora_adapter too).
    #[arg(long, default_value_t = 8)]
    max_loras: usize,
    /// Largest rank a LoRA adapter may have.
    #[arg(long, default_value_t = 64)]
    max_lora_rank: usize,
}

/// `--lora NAME=PATH` (or a bare PATH, named after its last component).
fn parse_lora(spec: &str) -> Result<(String, PathBuf)> {
    let (name, path) = match spec.split_once('=') {
        Some((n, p)) if !n.is_empty() && !Path::new(spec).exists() => {
            (n.to_string(), PathBuf::from(p))
        }
        _ => {
            let p = PathBuf::from(spec);
            let stem = p
                .file_stem()
                .map(|s| s.to_string_lossy().to_string())
                .unwrap_or_default();
            (stem, p)
        }
    };
    if name.is_empty() || !path.exists() {
        anyhow::bail!("--lora {spec:?}: give NAME=PATH with an adapter folder or GGUF at PATH");
    }
    Ok((name, path))
}

/// A reference that must already be on disk (no download).
fn local_model(reference: &str) -> Result<PathBuf> {
    models::local(reference)?
        .ok_or_else(|| anyhow::anyhow!("{reference} is not in the cache: ferrum pull {reference}"))
}

/// The model to run: the default one, or a reference resolved (pulled if need be).
fn model_path(reference: Option<&str>) -> Result<PathBuf> {
    match reference {
        None => default_model::ensure(),
        Some(r) => models::resolve(r),
    }
}

fn list(aliases: bool) -> Result<()> {
    if aliases {
        for (a, target) in models::ALIASES {
            println!("{a:<22} {target}");
        }
        return Ok(());
    }
    let entries = models::list();
    if entries.is_empty() {
        println!("no models yet: ferrum pull REF (see ferrum list --aliases)");
        return Ok(());
    }
    println!(
        "{:<60} {:>9}  {:<10} {:<8} complete",
        "NAME", "SIZE", "ARCH", "QUANT"
    );
    for e in entries {
        println!(
            "{:<60} {:>6.1} MB  {:<10} {:<8} {}",
            e.name,
            e.bytes as f64 / 1e6,
            e.arch,
            e.quant,
            if e.complete { "yes" } else { "no" }
        );
        tracing::debug!(path = %e.path.display(), "listed");
    }
    Ok(())
}

fn serve(a: ServeArgs) -> Result<()> {
    let be = BackendOpts::new(a.exact, a.kv_dtype, a.device);
    on_backend!(be, serve_on(a, be))
}

fn serve_on<B: MakeBackend>(a: ServeArgs, be: BackendOpts) -> Result<()> {
    for l in &a.loras {
        parse_lora(l)?;
    }
    if serve_fleet::wanted(&a) {
        return serve_fleet::run::<B>(a, be);
    }
    let path = model_path(a.model.as_deref())?;
    let file = ModelFile::open(&path)?;
    let tok = file_tokenizer(&file)?;
    let reference = a.model.clone().filter(|r| !Path::new(r).exists());
    let id = a
        .model_names
        .first()
        .cloned()
        .or(reference)
        .unwrap_or_else(|| {
            let name = path
                .file_name()
                .unwrap_or(path.as_os_str())
                .to_string_lossy();
            name.strip_suffix(".gguf").unwrap_or(&name).to_string()
        });
    if ferrum_models::encoder::is_encoder(&file) {
        return serve_encoder::<B>(a, be, path, file, tok, id);
    }
    let load = generator_loader::<B>(&a, be, path, file)?;
    let cfg = server_config(a, id);
    ferrum_server::serve(cfg, tok, load).map_err(|e| anyhow::anyhow!(e))
}

/// What loads a generating model's engine on the server's worker thread: the model, its
/// KV pool (by default room for four sequences of the whole context), speculation.
pub(crate) fn generator_loader<B: MakeBackend>(
    a: &ServeArgs,
    be: BackendOpts,
    path: PathBuf,
    file: ModelFile,
) -> Result<impl FnOnce() -> ferrum_core::Result<ferrum_server::worker::Served<B>> + Send + 'static>
{
    let (ctx, kv_tokens, prefix) = (a.ctx, a.kv_tokens, !a.no_prefix_cache);
    let mmproj = a.mmproj.clone();
    let (spec_tokens, draft) = a.spec.resolve()?;
    Ok(
        move || -> ferrum_core::Result<ferrum_server::worker::Served<B>> {
            let model = load_model_with::<B>(&path, &file, ctx, be, mmproj.as_deref())
                .map_err(|e| ferrum_core::Error::Weights(format!("{e:#}")))?;
            let engine_tok = file_tokenizer(&file)
                .map_err(|e| ferrum_core::Error::Tokenizer(format!("{e:#}")))?;
            let mut config = match kv_tokens {
                Some(t) => EngineConfig::for_model(&model.decoder, t),
                None => {
                    let mut c = EngineConfig::for_model(&model.decoder, model.decoder.context);
                    c.kv_blocks *= 4;
                    c
                }
            };
            config.prefix_caching = prefix;
            config.spec_tokens = spec_tokens;
            let mut engine = ferrum_generate::Engine::new(model, engine_tok, config)?;
            if let Some(d) = &draft {
                attach_draft(&mut engine, d, be)
                    .map_err(|e| ferrum_core::Error::Weights(format!("{e:#}")))?;
            }
            eprintln!(
                "ferrum: KV cache {} tokens ({:.1} MB{}), prefix caching {}{}; ready",
                engine.kv_tokens(),
                engine.kv_bytes() as f64 / 1e6,
                window_note(&engine.model.decoder),
                if prefix { "on" } else { "off" },
                spec_note(&engine)
            );
            Ok(ferrum_server::worker::Served::Generate(Box::new(engine)))
        },
    )
}

/// A model file's tokenizer.
pub(crate) fn file_tokenizer(f: &ModelFile) -> Result<Tokenizer> {
    Ok(match f {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    })
}

/// `serve` for an embedding model or a reranker: no KV pool or scheduler, the worker
/// batches whole inputs.
fn serve_encoder<B: MakeBackend>(
    a: ServeArgs,
    be: BackendOpts,
    path: PathBuf,
    file: ModelFile,
    tok: Tokenizer,
    id: String,
) -> Result<()> {
    let load = encoder_loader::<B>(be, path, file);
    let cfg = server_config(a, id);
    ferrum_server::serve(cfg, tok, load).map_err(|e| anyhow::anyhow!(e))
}

/// What loads an embedding model or a reranker on the server's worker thread.
pub(crate) fn encoder_loader<B: MakeBackend>(
    be: BackendOpts,
    path: PathBuf,
    file: ModelFile,
) -> impl FnOnce() -> ferrum_core::Result<ferrum_server::worker::Served<B>> + Send + 'static {
    move || -> ferrum_core::Result<ferrum_server::worker::Served<B>> {
        let enc = ferrum_models::encoder::Encoder::load(
            &file,
            B::make(&be).map_err(|e| ferrum_core::Error::Device(format!("{e:#}")))?,
        )?;
        eprintln!(
            "ferrum: {}: {} encoder, {:.1}M params, {}, {} pooling{}, reads {} tokens; ready",
            path.display(),
            enc.config.family.name(),
            enc.info.params as f64 / 1e6,
            enc.info.main_dtype,
            enc.pooling.mode.name(),
            if enc.is_classifier() {
                " (a reranker)"
            } else {
                ""
            },
            enc.config.context(),
        );
        Ok(ferrum_server::worker::Served::Encode(Box::new(enc)))
    }
}

pub(crate) fn server_config(a: ServeArgs, id: String) -> ferrum_server::ServeConfig {
    ferrum_server::ServeConfig {
        host: a.host,
        port: a.port,
        api_key: a.api_key.filter(|k| !k.is_empty()),
        model_id: id,
        model_aliases: a.model_names.iter().skip(1).cloned().collect(),
        any_model_name: a.any_model_name,
        pull: (!a.no_pull).then(|| -> ferrum_server::ollama::Pull {
            std::sync::Arc::new(|reference: &str, progress| {
                // A client names models, not the server's files.
                if Path::new(reference).exists() {
                    return Err(format!("{reference:?} is not a model name to pull"));
                }
                models::pull_reporting(reference, Some(progress))
                    .map(|p| p.display().to_string())
                    .map_err(|e| format!("{e:#}"))
            })
        }),
        max_body_bytes: a.max_body,
        max_waiting: a.max_waiting.max(1),
        allowed_hosts: a.allowed_hosts,
        allowed_origins: a.allowed_origins,
        content_special: if a.allow_control_tokens_in_content {
            ferrum_tokenizer::SpecialTokens::Control
        } else {
            ferrum_tokenizer::SpecialTokens::Text
        },
        max_request_tokens: a.max_request_tokens,
        shutdown_grace: std::time::Duration::from_secs(a.shutdown_grace),
        kv_events: a.kv_events,
        embeddings_from_chat: a.embeddings_from_chat_model,
        lora: ferrum_server::worker::LoraOptions {
            // Checked before loading (serve_on).
            initial: a.loras.iter().filter_map(|l| parse_lora(l).ok()).collect(),
            max_loras: a.max_loras,
            max_rank: a.max_lora_rank,
        },
        images: ferrum_server::images::ImageOptions {
            limits: ferrum_image::Limits {
                max_pixels: a.max_image_pixels,
                ..Default::default()
            },
            max_per_request: a.max_images,
            fetch_timeout: a
                .allow_image_urls
                .then(|| std::time::Duration::from_secs_f64(a.image_url_timeout)),
        },
    }
}

/// Logs go to stderr through `tracing`; `RUST_LOG` overrides the default level, which is
/// `info` for `serve` (one line per request) and `warn` elsewhere (no noise in `run`).
fn init_logging(serving: bool) {
    let default = if serving { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

fn main() {
    let cli = Cli::parse();
    init_logging(matches!(cli.cmd, Cmd::Serve(_)));
    let result = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Serve(a) => serve(a),
        Cmd::Devices { first_gpu } => device::list(first_gpu),
        Cmd::Pull { reference } => models::pull(&reference).map(|p| {
            eprintln!("ferrum: {reference} is at {}", p.display());
        }),
        Cmd::List { aliases } => list(aliases),
        Cmd::Plan {
            model,
            ctx,
            concurrency,
            kv_tokens,
            kv_dtype,
            mmproj,
            json,
        } => local_model(&model).and_then(|model| {
            plan::run(plan::PlanArgs {
                model: &model,
                ctx,
                concurrency,
                kv_tokens,
                kv_bytes_per_value: kv_dtype.unwrap_or(KvDtype::F16).row_bytes(32) as f64 / 32.0,
                json,
                mmproj: mmproj.as_deref(),
            })
        }),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Embed(a) => embed::run(a),
        Cmd::Quantize {
            input,
            output,
            ftype,
        } => quantize(&input, &output, &ftype),
        Cmd::Logits {
            model,
            tokens,
            exact,
            device,
            lora,
            lora_scale,
        } => {
            let be = BackendOpts::new(exact, None, device);
            let lora = lora.as_deref().map(|p| (p, lora_scale));
            on_backend!(be, logits(&model, &tokens, lora, be))
        }
        Cmd::Perplexity {
            model,
            file,
            ctx,
            exact,
            device,
        } => {
            let be = BackendOpts::new(exact, None, device);
            on_backend!(be, perplexity(&model, &file, ctx, be))
        }
    };
    if let Err(e) = result {
        eprintln!("ferrum: error: {e:#}");
        std::process::exit(1);
    }
}

pub(crate) fn parse_kv_dtype(s: &str) -> std::result::Result<KvDtype, String> {
    KvDtype::parse(s).ok_or_else(|| format!("unknown KV format {s:?} (f16, f32 or q8_0)"))
}

fn positive_secs(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

fn load<B: MakeBackend>(
    path: &Path,
    ctx: Option<usize>,
    be: BackendOpts,
) -> Result<(Model<B>, Tokenizer)> {
    load_with(path, ctx, be, None)
}

/// [`load`] with a GGUF model's vision tower (`--mmproj`).
fn load_with<B: MakeBackend>(
    path: &Path,
    ctx: Option<usize>,
    be: BackendOpts,
    mmproj: Option<&Path>,
) -> Result<(Model<B>, Tokenizer)> {
    let file = ModelFile::open(path)?;
    let tokenizer = match &file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    };
    Ok((load_model_with(path, &file, ctx, be, mmproj)?, tokenizer))
}

/// Loads only the model (the benchmark needs no tokenizer), printing the summary line.
pub(crate) fn load_model<B: MakeBackend>(
    path: &Path,
    file: &ModelFile,
    ctx: Option<usize>,
    be: BackendOpts,
) -> Result<Model<B>> {
    load_model_with(path, file, ctx, be, None)
}

/// [`load_model`] with a GGUF model's vision tower (`--mmproj`; else one beside it).
pub(crate) fn load_model_with<B: MakeBackend>(
    path: &Path,
    file: &ModelFile,
    ctx: Option<usize>,
    be: BackendOpts,
    mmproj: Option<&Path>,
) -> Result<Model<B>> {
    let backend = B::make(&be)?;
    let backend_name = backend.name();
    let spinner = repl::spinner(&format!(
        "loading {}",
        path.file_name()
            .unwrap_or(path.as_os_str())
            .to_string_lossy()
    ));
    let opts = LoadOptions {
        context: ctx,
        mmproj: mmproj.map(Path::to_path_buf),
    };
    let model = Model::load(file, backend, &opts);
    if let Some(s) = spinner {
        s.finish_and_clear();
    }
    let model = model.with_context(|| format!("loading {}", path.display()))?;
    // Every caller (run, serve, bench) allocates a KV cache next; refuse here, not there.
    let c = &model.decoder.config;
    let odd_head = (0..c.n_layers)
        .map(|i| c.layer_head_dim(i))
        .chain([c.head_dim])
        .find(|d| !d.is_multiple_of(32));
    if let (Some(KvDtype::Q8_0), Some(d)) = (be.kv, odd_head) {
        bail!("--kv-dtype q8_0 needs a head size divisible by 32 (this model has {d})");
    }
    let i = &model.info;
    eprintln!(
        "ferrum: {}: {}, {:.1}M params, {}, {:.0} MB, loaded in {:.2}s, context {}, {}",
        path.file_name()
            .unwrap_or(path.as_os_str())
            .to_string_lossy(),
        i.arch.name(),
        i.params as f64 / 1e6,
        i.main_dtype,
        i.file_bytes as f64 / 1e6,
        i.load_secs,
        model.decoder.context,
        backend_name,
    );
    Ok(model)
}

fn run(a: RunArgs) -> Result<()> {
    if let Some(e) = a.reasoning_effort.as_deref() {
        if !["low", "medium", "high"].contains(&e) {
            anyhow::bail!("--reasoning-effort {e:?}: low, medium or high");
        }
    }
    let be = BackendOpts::new(a.exact, a.kv_dtype, a.device);
    on_backend!(be, run_on(a, be))
}

fn run_on<B: MakeBackend>(a: RunArgs, be: BackendOpts) -> Result<()> {
    let path = model_path(a.model.as_deref())?;
    let (spec_tokens, draft) = a.spec.resolve()?;
    let (model, tokenizer) = load_with::<B>(&path, a.ctx, be, a.mmproj.as_deref())?;
    if let Some(v) = &model.vision {
        eprintln!(
            "ferrum: vision tower: up to {} image tokens an image",
            v.max_rows()
        );
    }
    let mut session = Session::speculative(model, tokenizer, spec_tokens)?;
    if let Some(d) = &draft {
        attach_draft(&mut session.engine, d, be)?;
    }
    let adapter = match &a.lora {
        Some(p) => {
            let src = ferrum_models::lora::AdapterSource {
                path: p,
                scale: a.lora_scale,
            };
            let id = session
                .engine
                .model
                .load_adapter("lora", &src)
                .with_context(|| format!("LoRA adapter {}", p.display()))?;
            if let Some(ad) = session.engine.model.decoder.adapter(id) {
                eprintln!(
                    "ferrum: LoRA adapter {} (rank {}, {:.1} MB), scale {}",
                    p.display(),
                    ad.rank,
                    ad.bytes as f64 / 1e6,
                    a.lora_scale
                );
            }
            id
        }
        None => 0,
    };
    let e = &session.engine;
    eprintln!(
        "ferrum: KV cache {} tokens ({:.1} MB{}), prefix caching {}{}",
        e.kv_tokens(),
        e.kv_bytes() as f64 / 1e6,
        window_note(&e.model.decoder),
        if e.config().prefix_caching {
            "on"
        } else {
            "off"
        },
        spec_note(e)
    );
    let mut opts = GenerateOptions {
        max_tokens: a.max_tokens,
        params: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        extras: SamplingExtras::default()
            .with_min_p(a.min_p)
            .with_repetition_penalty(a.repeat_penalty)
            .with_presence_penalty(a.presence_penalty)
            .with_frequency_penalty(a.frequency_penalty),
        stop: a.stop.clone(),
        // Harmony's channels are control tokens: the answer is split at them below.
        skip_special: !ferrum_tokenizer::harmony::is_harmony(session.tokenizer()),
        adapter,
        images: Vec::new(),
    };
    opts.extras.validate()?;
    let mut kwargs = serde_json::Map::new();
    if let Some(e) = &a.reasoning_effort {
        kwargs.insert("reasoning_effort".into(), e.clone().into());
    }
    let mut messages: Vec<Message> = a
        .system
        .iter()
        .map(|s| Message {
            role: "system".into(),
            content: s.clone(),
        })
        .collect();

    if let Some(prompt) = a.prompt {
        let ids = if !a.image.is_empty() {
            if a.raw {
                anyhow::bail!(
                    "--image needs the chat template to place the images: leave out --raw"
                );
            }
            let (ids, images) = image_prompt(&session, &messages, &prompt, &a.image, &kwargs)?;
            opts.images = images;
            ids
        } else if a.raw {
            session.tokenizer().encode(&prompt, true)?
        } else {
            messages.push(Message {
                role: "user".into(),
                content: prompt,
            });
            render(session.tokenizer(), &messages, &kwargs)?
        };
        answer(
            &mut session,
            &ids,
            &opts,
            &std::sync::atomic::AtomicBool::new(false),
        )?;
        return Ok(());
    }

    if !a.image.is_empty() {
        anyhow::bail!("--image needs a prompt (--prompt TEXT); in the chat, /image FILE");
    }
    repl::chat(&mut session, messages, &opts, &kwargs)
}

/// The prompt ids and processed images of a user turn of `images` then `prompt` after
/// `before` (system messages), for the model's vision tower.
fn image_prompt<B: Backend>(
    session: &Session<B>,
    before: &[Message],
    prompt: &str,
    images: &[PathBuf],
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<(Vec<u32>, Vec<ferrum_image::Processed>)> {
    let processed = images
        .iter()
        .map(|p| load_image(session, p))
        .collect::<Result<Vec<_>>>()?;
    let mut messages = before.to_vec();
    messages.push(Message::new("user", prompt));
    let mut per_user = vec![Vec::new(); messages.iter().filter(|m| m.role == "user").count()];
    if let Some(last) = per_user.last_mut() {
        *last = processed;
    }
    render_with_images(session, &messages, &per_user, kwargs)
}

/// An image file read, decoded and processed for the model's vision tower (`--image`, the
/// chat's `/image`).
pub(crate) fn load_image<B: Backend>(
    session: &Session<B>,
    path: &Path,
) -> Result<ferrum_image::Processed> {
    let Some(vision) = &session.engine.model.vision else {
        anyhow::bail!("this model does not take images (it has no vision encoder)");
    };
    let bytes = std::fs::read(path).with_context(|| format!("image {}", path.display()))?;
    let img = ferrum_image::decode(&bytes, &ferrum_image::Limits::default())
        .with_context(|| format!("image {}", path.display()))?;
    vision
        .processor
        .process(&img)
        .map_err(|e| anyhow::anyhow!("image {}: {e}", path.display()))
}

/// A conversation's prompt ids and its images in order: `images[k]` go at the start of the
/// k-th user message, before its text (as `--image` and `/image` place them).
pub(crate) fn render_with_images<B: Backend>(
    session: &Session<B>,
    messages: &[Message],
    images: &[Vec<ferrum_image::Processed>],
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<(Vec<u32>, Vec<ferrum_image::Processed>)> {
    let Some(vision) = &session.engine.model.vision else {
        anyhow::bail!("this model does not take images (it has no vision encoder)");
    };
    let tok = session.tokenizer();
    let text = vision
        .prompt_texts(|id| tok.inner().id_to_token(id))
        .context("the vocabulary lacks the model's image tokens")?;
    let mut all = Vec::new();
    let mut users = images.iter();
    let json: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| {
            let these = if m.role == "user" { users.next() } else { None };
            match these.filter(|v| !v.is_empty()) {
                Some(v) => {
                    all.extend(v.iter().cloned());
                    let mut parts: Vec<serde_json::Value> = v
                        .iter()
                        .map(|_| serde_json::json!({"type": "image"}))
                        .collect();
                    parts.push(serde_json::json!({"type": "text", "text": m.content}));
                    serde_json::json!({"role": m.role, "content": parts})
                }
                None => serde_json::json!({"role": m.role, "content": m.content}),
            }
        })
        .collect();
    let ids = tok.chat_prompt_with_images(
        &json,
        true,
        kwargs,
        ferrum_tokenizer::SpecialTokens::Text,
        false,
        (&text.marker, &text.expansions(&all)),
    )?;
    Ok((ids, all))
}

/// The conversation as prompt ids (special-token texts in what was typed stay plain text),
/// with the template's variables `kwargs`.
pub(crate) fn render(
    tok: &Tokenizer,
    messages: &[Message],
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<u32>> {
    Ok(tok.chat_prompt(
        messages,
        true,
        kwargs,
        ferrum_tokenizer::SpecialTokens::Text,
    )?)
}

/// Streams one answer to stdout and its figures to stderr; returns the text. Stops early
/// (keeping what was said) when `interrupted` is set, e.g. by Ctrl-C. A harmony answer
/// (kept control tokens: `opts.skip_special` false) is split by channel: the analysis goes to
/// stderr, dimmed, tool calls are shown as such, and the text returned is the final answer.
pub(crate) fn answer<B: Backend>(
    session: &mut Session<B>,
    ids: &[u32],
    opts: &GenerateOptions,
    interrupted: &std::sync::atomic::AtomicBool,
) -> Result<String> {
    use ferrum_tokenizer::harmony::{Event, Parser};
    use std::sync::atomic::Ordering;
    let mut text = String::new();
    let stdout = std::io::stdout();
    let before = session.engine.stats();
    let mut harmony = (!opts.skip_special).then(Parser::new);
    let show = |events: Vec<Event>, text: &mut String| {
        let mut out = stdout.lock();
        for e in events {
            let _ = match e {
                Event::Reasoning(r) => {
                    eprint!("\x1b[2m{r}\x1b[0m");
                    Ok(())
                }
                Event::Content(c) => {
                    text.push_str(&c);
                    out.write_all(c.as_bytes())
                }
                Event::CallStart(name) => write!(out, "[call {name}("),
                Event::CallArgs(a) => out.write_all(a.as_bytes()),
                Event::CallEnd => writeln!(out, ")]"),
            };
        }
        let _ = out.flush();
    };
    let stats = session.generate_with(ids, opts, |delta| {
        match harmony.as_mut() {
            Some(p) => show(p.push(delta), &mut text),
            None => show(vec![Event::Content(delta.to_string())], &mut text),
        }
        !interrupted.load(Ordering::SeqCst)
    })?;
    if let Some(p) = harmony.as_mut() {
        show(p.finish(), &mut text);
    }
    println!();
    if stats.finish == ferrum_generate::FinishReason::Cancelled {
        eprintln!("[interrupted]");
    }
    let after = session.engine.stats();
    let drafted = after.drafted_tokens - before.drafted_tokens;
    let spec = if session.engine.config().spec_tokens > 0 || session.engine.draft_model().is_some()
    {
        format!(
            "; {} of {drafted} drafted tokens kept",
            after.accepted_tokens - before.accepted_tokens
        )
    } else {
        String::new()
    };
    eprintln!(
        "[{} prompt tokens ({} computed) in {:.2}s, {} tokens at {:.1} tok/s{spec}]",
        stats.prompt_tokens,
        stats.prefilled_tokens,
        stats.prefill_secs,
        stats.generated_tokens,
        stats.generated_tokens as f64 / stats.decode_secs.max(1e-9)
    );
    Ok(text)
}

fn quantize(input: &Path, output: &Path, ftype: &str) -> Result<()> {
    let ftype: ferrum_quantize::FileType = ftype.parse()?;
    let t = std::time::Instant::now();
    let r = ferrum_quantize::quantize_file(input, output, ftype)
        .with_context(|| format!("quantising {}", input.display()))?;
    let types: Vec<String> = r.by_type.iter().map(|(d, n)| format!("{n}×{d}")).collect();
    eprintln!(
        "ferrum: wrote {} ({ftype}): {} tensors [{}], {:.1} MB → {:.1} MB in {:.1}s",
        output.display(),
        r.tensors,
        types.join(", "),
        r.in_bytes as f64 / 1e6,
        r.out_bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn logits<B: MakeBackend>(
    model: &Path,
    tokens: &[u32],
    lora: Option<(&Path, f32)>,
    be: BackendOpts,
) -> Result<()> {
    if tokens.is_empty() {
        bail!("--tokens needs at least one token id");
    }
    let (mut model, _) = load::<B>(model, Some(tokens.len()), be)?;
    let adapter = match lora {
        Some((path, scale)) => model
            .load_adapter("lora", &ferrum_models::lora::AdapterSource { path, scale })
            .with_context(|| format!("LoRA adapter {}", path.display()))?,
        None => 0,
    };
    let vocab = model.decoder.config.vocab_size;
    let mut kv = model.decoder.alloc_kv_tokens(tokens.len());
    let all = model
        .decoder
        .forward_adapter(&mut kv, tokens, 0, Logits::All, adapter)?;
    let rows: Vec<&[f32]> = all.chunks(vocab).collect();
    println!("{}", serde_json::json!({ "logits": rows }));
    Ok(())
}

fn perplexity<B: MakeBackend>(
    model: &Path,
    file: &Path,
    window: usize,
    be: BackendOpts,
) -> Result<()> {
    if window < 2 {
        bail!("--ctx must be at least 2");
    }
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let (mut model, tok) = load::<B>(model, Some(window), be)?;
    let ids = tok.encode(&text, true)?;
    if ids.len() < 2 {
        bail!("{} has fewer than two tokens", file.display());
    }
    let vocab = model.decoder.config.vocab_size;
    let (mut nll, mut count) = (0f64, 0usize);
    let mut kv = model.decoder.alloc_kv_tokens(window);
    for chunk in ids.chunks(window) {
        if chunk.len() < 2 {
            continue;
        }
        let logits = model.decoder.forward(&mut kv, chunk, 0, Logits::All)?;
        for (row, &next) in logits.chunks(vocab).zip(&chunk[1..]) {
            nll -= log_softmax_at(row, next as usize);
            count += 1;
        }
    }
    let ppl = (nll / count as f64).exp();
    println!(
        "{}",
        serde_json::json!({ "perplexity": ppl, "tokens": count })
    );
    Ok(())
}

fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    row[i] as f64 - max - z.ln()
}

/// How the KV line describes windowed layers: what they keep per sequence.
fn window_note<B: ferrum_backend::Backend>(d: &ferrum_models::Decoder<B>) -> String {
    let g = &d.kv_groups;
    let windowed = g.groups.iter().filter(|(_, w)| w.is_some()).count();
    match g.groups.iter().find_map(|(_, w)| *w) {
        Some(w) => format!(
            "; {} of {} layers keep only their last {w} positions",
            windowed * g.slots,
            d.config.n_layers
        ),
        None => String::new(),
    }
}
