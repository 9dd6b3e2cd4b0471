//! The engine's thread. The engine is synchronous and owns the model; HTTP handlers talk to
//! it through a command channel and get each request's events back on a channel of their
//! own. A handler that goes away (client disconnected) drops its receiver; the next event
//! sent to it fails and the worker cancels the request, which frees its KV blocks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use ferrum_backend::Backend;
use ferrum_core::{Error, Result};
use ferrum_generate::{Engine, EngineStats, Output, OutputKind, Request, RequestId};
use ferrum_models::encoder::{Encoder, Input};
use tokio::sync::{mpsc as tmpsc, oneshot};

pub enum Command {
    Submit {
        req: Box<Request>,
        events: tmpsc::UnboundedSender<Output>,
        reply: oneshot::Sender<Result<RequestId>>,
    },
    /// Embeddings of the inputs (or, with `score`, a cross-encoder's logits of each pair),
    /// in order. The worker runs every such command waiting at once as one batch.
    Embed {
        inputs: Vec<EmbedInput>,
        score: bool,
        reply: oneshot::Sender<Result<Vec<Vec<f32>>>>,
    },
    /// Attaches a LoRA adapter under `name` (vLLM's `/v1/load_lora_adapter`).
    LoadLora {
        name: String,
        path: std::path::PathBuf,
        reply: oneshot::Sender<Result<()>>,
    },
    /// Detaches an adapter: new requests cannot name it at once; it is freed when the
    /// requests already running with it are done.
    UnloadLora {
        name: String,
        reply: oneshot::Sender<Result<()>>,
    },
    /// Ends the worker: it drops its model (and gives its device back) and its thread ends.
    Stop,
}

/// The server's LoRA settings (`--lora`, `--max-loras`, `--max-lora-rank`).
#[derive(Debug, Clone)]
pub struct LoraOptions {
    /// Adapters attached at start: `(name, path)`.
    pub initial: Vec<(String, std::path::PathBuf)>,
    /// Most adapters attached at once.
    pub max_loras: usize,
    /// Largest rank an adapter may have.
    pub max_rank: usize,
}

impl Default for LoraOptions {
    fn default() -> Self {
        LoraOptions {
            initial: Vec::new(),
            max_loras: 8,
            max_rank: 64,
        }
    }
}

/// An attached adapter, as the handlers see it.
#[derive(Debug, Clone)]
pub struct LoraEntry {
    pub name: String,
    /// Its id in the engine ([`ferrum_generate::Request::adapter`]).
    pub id: usize,
    pub path: String,
    pub rank: usize,
    pub created: u64,
}

/// The adapters attached, and those of running and waiting requests (by name).
#[derive(Debug, Clone, Default)]
pub struct LoraTable {
    pub adapters: Vec<LoraEntry>,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
    pub max_loras: usize,
}

/// One input of an embedding or scoring command: token ids, and for a pair each token's
/// segment.
#[derive(Debug, Clone)]
pub struct EmbedInput {
    pub ids: Vec<u32>,
    pub types: Option<Vec<u32>>,
}

/// What the worker serves: a generating model's engine, or an encoder (embeddings and
/// reranking), which needs no scheduler or KV pool: it runs whole inputs, batched.
pub enum Served<B: Backend> {
    Generate(Box<Engine<B>>),
    Encode(Box<Encoder<B>>),
}

/// What a model does for clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// Generates text (chat, completions); embeddings only with
    /// `--embeddings-from-chat-model`.
    Generate,
    /// An embedding model.
    Embed,
    /// A cross-encoder: scores query–document pairs (`/v1/rerank`, `/v1/score`).
    Rerank,
}

/// What the server knows about the loaded model.
#[derive(Debug, Clone)]
pub struct ModelCard {
    pub id: String,
    pub created: u64,
    pub context: usize,
    pub max_sequence: usize,
    pub kv_tokens: usize,
    pub kv_bytes: usize,
    pub vocab_size: usize,
    pub arch: String,
    pub dtype: String,
    pub prefix_caching: bool,
    /// The KV cache's element format.
    pub kv_dtype: String,
    /// Parameters, for Ollama's model details.
    pub params: usize,
    /// The weights file's (or folder's) size on disk.
    pub file_bytes: usize,
    /// How many numbers an embedding has.
    pub embedding_width: usize,
    pub kind: ModelKind,
    /// Whether an embedding is unit length (its dimensions can then be cut and renormalised).
    pub normalized: bool,
    /// A decoder reranker's prompt (`{query}`, `{document}`): a pair is scored as this text,
    /// not as a cross-encoder's two segments.
    pub rerank_prompt: Option<String>,
    /// The LoRA adapter a request naming this card runs through (0: the base model).
    pub adapter: usize,
    /// A vision-language model's image handling; `None`: it takes no images.
    pub vision: Option<std::sync::Arc<VisionCard>>,
}

/// How a vision model's images enter a chat: the processor that prepares them, and the
/// text the chat template writes for each with what it becomes before the prompt is
/// tokenized (the model's placeholder tokens, as its Hugging Face processor expands them).
#[derive(Debug, Clone)]
pub struct VisionCard {
    pub processor: ferrum_image::Processor,
    pub text: ferrum_models::vision::ImageText,
}

/// State the handlers read without asking the worker.
#[derive(Default)]
pub struct Shared {
    pub ready: AtomicBool,
    pub card: OnceLock<ModelCard>,
    pub stats: Mutex<EngineStats>,
    /// Set when loading failed; /health reports it.
    pub load_error: OnceLock<String>,
    /// Set when the device under the engine failed (out of memory, lost): requests get 503
    /// with it and /health and /ready report it; the process stays up.
    pub fault: OnceLock<String>,
    /// LoRA adapters: read by the handlers to resolve a request's `model`.
    pub lora: Mutex<LoraTable>,
    /// Set when the worker thread has ended and dropped its model (every [`Handle`] gone):
    /// a server of several models waits for it before loading another in its place.
    pub stopped: AtomicBool,
}

/// Sets [`Shared::stopped`] when the worker's thread ends, after what it held is dropped.
struct StopFlag(Arc<Shared>);

impl Drop for StopFlag {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::SeqCst);
    }
}

#[derive(Clone)]
pub struct Handle {
    tx: mpsc::Sender<Command>,
    pub shared: Arc<Shared>,
}

impl Handle {
    /// A handle with no engine behind it (the router's own tests).
    #[cfg(test)]
    pub(crate) fn detached(shared: Arc<Shared>) -> Handle {
        let (tx, _) = mpsc::channel();
        Handle { tx, shared }
    }

    /// Queues a request; returns its id and the channel its events arrive on.
    pub async fn submit(
        &self,
        req: Request,
    ) -> Result<(RequestId, tmpsc::UnboundedReceiver<Output>)> {
        let (events, rx) = tmpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Submit {
                req: Box::new(req),
                events,
                reply,
            })
            .map_err(|_| Error::InvalidRequest("the engine has stopped".into()))?;
        let id = answer
            .await
            .map_err(|_| Error::InvalidRequest("the engine has stopped".into()))??;
        Ok((id, rx))
    }

    /// Attaches (`Some(path)`) or detaches (`None`) the LoRA adapter `name`.
    pub async fn lora(&self, name: String, path: Option<std::path::PathBuf>) -> Result<()> {
        let (reply, answer) = oneshot::channel();
        let cmd = match path {
            Some(path) => Command::LoadLora { name, path, reply },
            None => Command::UnloadLora { name, reply },
        };
        self.tx
            .send(cmd)
            .map_err(|_| Error::InvalidRequest("the engine has stopped".into()))?;
        answer
            .await
            .map_err(|_| Error::InvalidRequest("the engine has stopped".into()))?
    }

    /// The model's vectors for `inputs` (embeddings, or with `score` a classifier's logits).
    pub async fn embed(&self, inputs: Vec<EmbedInput>, score: bool) -> Result<Vec<Vec<f32>>> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Embed {
                inputs,
                score,
                reply,
            })
            .map_err(|_| Error::InvalidRequest("the engine has stopped".into()))?;
        answer
            .await
            .map_err(|_| Error::InvalidRequest("the engine has stopped".into()))?
    }

    /// Ends the worker and waits up to `wait` for its thread to have dropped the model;
    /// false if it had not by then. The process must not exit while a device is being torn
    /// down on the worker's thread: a driver's own exit handlers (Mesa's, LLVM's) would run
    /// beside that teardown and crash.
    pub fn stop(&self, wait: std::time::Duration) -> bool {
        let _ = self.tx.send(Command::Stop);
        let deadline = std::time::Instant::now() + wait;
        while !self.shared.stopped.load(Ordering::SeqCst) {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        true
    }
}

/// Starts the worker thread; `load` builds the engine on that thread (the server answers
/// /health with 503 meanwhile).
pub fn spawn<B: Backend + 'static>(
    id: String,
    load: impl FnOnce() -> Result<Served<B>> + Send + 'static,
    kv_events: Option<crate::kv_events::Sender>,
    lora: LoraOptions,
) -> Handle {
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(Shared::default());
    let sh = shared.clone();
    let started = std::thread::Builder::new()
        .name("ferrum-engine".into())
        .spawn(move || {
            // Declared first, so dropped last: after the model.
            let _stop = StopFlag(sh.clone());
            // Before the backend's threads exist, so they inherit it.
            yield_to_http_threads();
            let served = match load() {
                Ok(e) => e,
                Err(e) => {
                    let _ = sh.load_error.set(e.to_string());
                    return;
                }
            };
            let created = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let mut engine = match served {
                Served::Generate(e) => e,
                Served::Encode(enc) => {
                    let c = &enc.config;
                    let _ = sh.card.set(ModelCard {
                        id,
                        created,
                        context: c.context(),
                        max_sequence: c.context(),
                        kv_tokens: 0,
                        kv_bytes: 0,
                        vocab_size: c.vocab,
                        arch: c.family.name().to_string(),
                        dtype: enc.info.main_dtype.name().to_string(),
                        prefix_caching: false,
                        kv_dtype: enc.backend().kv_dtype().to_string(),
                        params: enc.info.params,
                        file_bytes: enc.info.file_bytes,
                        embedding_width: enc.embedding_width(),
                        kind: if enc.is_classifier() {
                            ModelKind::Rerank
                        } else {
                            ModelKind::Embed
                        },
                        normalized: enc.pooling.normalize,
                        rerank_prompt: None,
                        vision: None,
                        adapter: 0,
                    });
                    sh.ready.store(true, Ordering::SeqCst);
                    run_encoder(&enc, &rx, &sh);
                    return;
                }
            };
            let _ = sh.card.set(ModelCard {
                id,
                created,
                context: engine.model.decoder.context,
                max_sequence: engine.max_sequence(),
                kv_tokens: engine.kv_tokens(),
                kv_bytes: engine.kv_bytes(),
                vocab_size: engine.model.decoder.config.vocab_size,
                arch: engine.model.info.arch.name().to_string(),
                dtype: engine.model.info.main_dtype.name().to_string(),
                prefix_caching: engine.config().prefix_caching,
                kv_dtype: engine.model.decoder.backend().kv_dtype().to_string(),
                params: engine.model.info.params,
                file_bytes: engine.model.info.file_bytes,
                embedding_width: engine
                    .model
                    .pooling
                    .as_ref()
                    .map_or(engine.model.decoder.config.hidden_size, |p| {
                        p.width(engine.model.decoder.config.hidden_size)
                    }),
                // A decoder with its own pooling (Qwen3-Embedding) is an embedding model; one
                // whose pooling is a yes/no head (Qwen3-Reranker), a reranker.
                kind: match &engine.model.pooling {
                    Some(p) if p.scores => ModelKind::Rerank,
                    Some(_) => ModelKind::Embed,
                    None => ModelKind::Generate,
                },
                normalized: engine.model.pooling.as_ref().is_none_or(|p| p.normalize),
                rerank_prompt: engine.model.pooling.as_ref().and_then(|p| p.prompt.clone()),
                adapter: 0,
                vision: engine.model.vision.as_ref().and_then(|v| {
                    let text = |id| engine.tokenizer.inner().id_to_token(id);
                    Some(std::sync::Arc::new(VisionCard {
                        processor: v.processor.clone(),
                        text: v.prompt_texts(text)?,
                    }))
                }),
            });
            let mut adapters = Adapters {
                opts: lora.clone(),
                unloading: Vec::new(),
            };
            if let Ok(mut t) = sh.lora.lock() {
                t.max_loras = lora.max_loras;
            }
            for (name, path) in &lora.initial {
                if let Err(e) = adapters.load(&mut engine, &sh, name, path) {
                    let _ = sh.load_error.set(e.to_string());
                    return;
                }
            }
            publish(&sh, &engine);
            if kv_events.is_some() {
                engine.enable_kv_events();
            }
            sh.ready.store(true, Ordering::SeqCst);
            run(&mut engine, &rx, &sh, kv_events.as_ref(), &mut adapters);
        });
    if let Err(e) = started {
        let _ = shared
            .load_error
            .set(format!("cannot start the engine thread: {e}"));
    }
    Handle { tx, shared }
}

/// How much lower the compute threads' priority is than the HTTP runtime's (a nice value).
/// They keep every core busy while requests run; a router reads a replica's `/metrics` every
/// 50 ms and takes a late answer for a saturated replica, so the HTTP threads should get a
/// core as soon as they wake. Lower, the compute threads still get every cycle the HTTP
/// threads do not want. (Measured on 2 cores, 3 clients prefilling long prompts and 3
/// streaming: `/metrics` p50 1.6 ms, p99 4.6–6.1 ms, against 2.1–2.7 and 6.8 at equal
/// priority; the pool's yielding waits do most of it.)
const COMPUTE_NICE: i32 = 5;

/// Lowers the calling thread's priority by [`COMPUTE_NICE`] (on Linux a nice value is per
/// thread, and new threads inherit their creator's). Failure leaves it as it was.
fn yield_to_http_threads() {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn getpriority(which: i32, who: u32) -> i32;
            fn setpriority(which: i32, who: u32, prio: i32) -> i32;
        }
        const PRIO_PROCESS: i32 = 0;
        // SAFETY: plain system calls on the calling thread (`who` 0), no memory passed.
        unsafe {
            let now = getpriority(PRIO_PROCESS, 0);
            if setpriority(PRIO_PROCESS, 0, (now + COMPUTE_NICE).min(19)) != 0 {
                tracing::debug!("could not lower the compute threads' priority");
            }
        }
    }
}

fn publish<B: Backend>(sh: &Shared, engine: &Engine<B>) {
    if let Ok(mut s) = sh.stats.lock() {
        *s = engine.stats();
    }
    let (running, waiting) = engine.adapters_in_use();
    if let Ok(mut t) = sh.lora.lock() {
        let names = |ids: &[usize]| -> Vec<String> {
            ids.iter()
                .filter_map(|&id| engine.model.decoder.adapter(id).map(|a| a.name.clone()))
                .collect()
        };
        if t.running.len() + t.waiting.len() + running.len() + waiting.len() > 0 {
            t.running = names(&running);
            t.waiting = names(&waiting);
        }
    }
}

/// The engine thread's side of the LoRA adapters: the limits, and adapters detached from
/// the table but still in use.
struct Adapters {
    opts: LoraOptions,
    unloading: Vec<usize>,
}

impl Adapters {
    fn load<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        sh: &Shared,
        name: &str,
        path: &std::path::Path,
    ) -> Result<()> {
        let taken = sh
            .lora
            .lock()
            .map_or(0, |t| t.adapters.iter().filter(|a| a.name == name).count());
        if taken > 0 {
            return Err(Error::InvalidRequest(format!(
                "the LoRA adapter {name:?} has already been loaded"
            )));
        }
        let attached = sh.lora.lock().map_or(0, |t| t.adapters.len()) + self.unloading.len();
        if attached >= self.opts.max_loras {
            return Err(Error::InvalidRequest(format!(
                "{attached} LoRA adapters are loaded, the most this server takes \
                 (--max-loras {}); unload one first",
                self.opts.max_loras
            )));
        }
        let m = &engine.model;
        let adapter = ferrum_models::lora::Adapter::load(
            name,
            &ferrum_models::lora::AdapterSource { path, scale: 1.0 },
            &m.decoder.config,
            m.info.gguf,
        )?;
        if adapter.rank > self.opts.max_rank {
            return Err(Error::InvalidRequest(format!(
                "the LoRA adapter {name:?} has rank {}, above this server's --max-lora-rank {}",
                adapter.rank, self.opts.max_rank
            )));
        }
        let rank = adapter.rank;
        let id = engine.model.decoder.add_adapter(adapter)?;
        tracing::info!(
            "LoRA adapter {name:?} (rank {rank}) from {}",
            path.display()
        );
        if let Ok(mut t) = sh.lora.lock() {
            t.adapters.push(LoraEntry {
                name: name.to_string(),
                id,
                path: path.display().to_string(),
                rank,
                created: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            });
        }
        Ok(())
    }

    fn unload(&mut self, sh: &Shared, name: &str) -> Result<()> {
        let entry = sh.lora.lock().ok().and_then(|mut t| {
            let k = t.adapters.iter().position(|a| a.name == name)?;
            Some(t.adapters.remove(k))
        });
        match entry {
            Some(e) => {
                self.unloading.push(e.id);
                Ok(())
            }
            None => Err(Error::InvalidRequest(format!(
                "no LoRA adapter named {name:?} is loaded"
            ))),
        }
    }

    /// Frees the detached adapters no request uses any more.
    fn reap<B: Backend>(&mut self, engine: &mut Engine<B>) {
        if self.unloading.is_empty() {
            return;
        }
        let (running, waiting) = engine.adapters_in_use();
        self.unloading.retain(|id| {
            let busy = running.contains(id) || waiting.contains(id);
            if !busy {
                engine.model.decoder.remove_adapter(*id);
            }
            busy
        });
    }
}

fn run<B: Backend>(
    engine: &mut Engine<B>,
    rx: &mpsc::Receiver<Command>,
    sh: &Shared,
    kv_events: Option<&crate::kv_events::Sender>,
    adapters: &mut Adapters,
) {
    let mut senders: HashMap<RequestId, tmpsc::UnboundedSender<Output>> = HashMap::new();
    loop {
        // Idle: sleep until a command comes (or every handle is gone: shut down).
        if !engine.has_work() {
            match rx.recv() {
                Ok(Command::Stop) | Err(_) => return,
                Ok(cmd) => handle(engine, cmd, &mut senders, sh, adapters),
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            if let Command::Stop = cmd {
                return;
            }
            handle(engine, cmd, &mut senders, sh, adapters);
        }
        adapters.reap(engine);
        if engine.has_work() {
            match engine.step() {
                Ok(outs) => {
                    for o in outs {
                        let id = o.id;
                        let last = matches!(o.kind, OutputKind::Finished { .. });
                        let gone = senders.get(&id).is_none_or(|tx| tx.send(o).is_err());
                        if last {
                            senders.remove(&id);
                        } else if gone {
                            engine.cancel(id);
                        }
                    }
                }
                Err(e) => {
                    // Not expected (requests are validated) but for a device's fault: end
                    // every request rather than spin on the error; their handlers see the
                    // channel close. A device fault stays: the server reports it from now on.
                    tracing::error!("engine step failed: {e}");
                    if matches!(e, ferrum_core::Error::Device(_)) {
                        let _ = sh.fault.set(e.to_string());
                    }
                    for id in senders.keys() {
                        engine.cancel(*id);
                    }
                    senders.clear();
                    let _ = engine.step();
                }
            }
        }
        publish(sh, engine);
        if let Some(tx) = kv_events {
            let events = engine.take_kv_events();
            if !events.is_empty() {
                let _ = tx.send((engine.config().block_size, events));
            }
        }
    }
}

fn handle<B: Backend>(
    engine: &mut Engine<B>,
    cmd: Command,
    senders: &mut HashMap<RequestId, tmpsc::UnboundedSender<Output>>,
    sh: &Shared,
    adapters: &mut Adapters,
) {
    match cmd {
        Command::LoadLora { name, path, reply } => {
            let _ = reply.send(adapters.load(engine, sh, &name, &path));
        }
        Command::UnloadLora { name, reply } => {
            let _ = reply.send(adapters.unload(sh, &name));
            adapters.reap(engine);
        }
        // The loop ends on it before it comes here.
        Command::Stop => {}
        Command::Submit { req, events, reply } => {
            let r = engine.add(*req);
            if let Ok(id) = r {
                senders.insert(id, events);
            }
            let _ = reply.send(r);
        }
        Command::Embed {
            inputs,
            score,
            reply,
        } => {
            let scorer = engine.model.pooling.as_ref().is_some_and(|p| p.scores);
            let r = if score && !scorer {
                Err(Error::InvalidRequest(
                    "this model generates text; it has no head that scores pairs".into(),
                ))
            } else {
                // A decoder reranker's "embedding" is its head's logits.
                let ids: Vec<&[u32]> = inputs.iter().map(|x| x.ids.as_slice()).collect();
                engine.embed_batch(&ids)
            };
            let _ = reply.send(r);
        }
    }
}

/// An embedding command's inputs and where its vectors go.
type Waiting = (Vec<EmbedInput>, oneshot::Sender<Result<Vec<Vec<f32>>>>);

/// The encoder's loop: every embedding (and every scoring) command waiting when the worker
/// wakes runs as one batch (the encoder packs the inputs into passes), so many short
/// requests share their matmuls.
fn run_encoder<B: Backend>(enc: &Encoder<B>, rx: &mpsc::Receiver<Command>, sh: &Shared) {
    while let Ok(first) = rx.recv() {
        let mut cmds = vec![first];
        while let Ok(c) = rx.try_recv() {
            cmds.push(c);
        }
        if cmds.iter().any(|c| matches!(c, Command::Stop)) {
            return;
        }
        let mut batches: [Vec<Waiting>; 2] = Default::default();
        for c in cmds {
            match c {
                Command::Submit { reply, .. } => {
                    let _ = reply.send(Err(Error::InvalidRequest(
                        "this model embeds or scores texts; it does not generate them".into(),
                    )));
                }
                Command::LoadLora { reply, .. } | Command::UnloadLora { reply, .. } => {
                    let _ = reply.send(Err(Error::Unsupported(
                        "LoRA adapters are for generating models, not encoders".into(),
                    )));
                }
                Command::Embed {
                    inputs,
                    score,
                    reply,
                } => batches[score as usize].push((inputs, reply)),
                Command::Stop => {}
            }
        }
        for (score, batch) in batches.into_iter().enumerate() {
            if !batch.is_empty() {
                encode_batch(enc, batch, score == 1, sh);
            }
        }
    }
}

fn encode_batch<B: Backend>(enc: &Encoder<B>, batch: Vec<Waiting>, score: bool, sh: &Shared) {
    let run = |inputs: &mut dyn Iterator<Item = &EmbedInput>| {
        let xs: Vec<Input> = inputs
            .map(|x| Input {
                ids: &x.ids,
                types: x.types.as_deref(),
            })
            .collect();
        if score {
            enc.classify(&xs)
        } else {
            enc.embed(&xs)
        }
    };
    match run(&mut batch.iter().flat_map(|(i, _)| i.iter())) {
        Ok(mut vectors) => {
            for (inputs, reply) in batch.into_iter().rev() {
                let mine = vectors.split_off(vectors.len() - inputs.len());
                let _ = reply.send(Ok(mine));
            }
        }
        Err(e) => {
            if let Error::Device(_) = e {
                let _ = sh.fault.set(e.to_string());
            }
            // One request's input failed the batch (the routes check inputs first, so this
            // is rare): each request again on its own, so only that one gets the error.
            for (inputs, reply) in batch {
                let _ = reply.send(run(&mut inputs.iter()));
            }
        }
    }
}
