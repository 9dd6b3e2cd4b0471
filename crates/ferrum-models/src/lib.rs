//! Model architectures over the backend trait.
//!
//! One forward driver ([`decoder`]) runs layers built from shared pieces ([`layers`]:
//! attention, dense and MoE FFNs, norms); each family has a file in [`arch`] that says what
//! its configuration keys mean and how its layers differ from Llama's, and a row in
//! [`arch::ARCHS`]. [`config`] holds the typed configuration they produce.

pub mod arch;
pub mod config;
pub mod decoder;
pub mod encoder;
pub mod layers;
pub mod linear;
pub mod lora;
pub mod mla;
pub mod moe;
pub mod names;
pub mod vision;

use std::path::Path;
use std::time::Instant;

use ferrum_backend::Backend;
use ferrum_core::{DType, Error, Result};
use ferrum_loader::ModelFile;

pub use config::{Arch, ModelConfig, MoeConfig};
pub use decoder::{
    mrope_position, Decoder, Embeds, ImageGrid, KvCache, KvGroups, Logits, SeqChunk, WeightSource,
    NO_BLOCK,
};

/// Which architecture a file holds: GGUF `general.architecture`, or a Hugging Face
/// `architectures` class / `model_type`.
pub fn detect_arch(file: &ModelFile) -> Result<Arch> {
    if encoder::is_encoder(file) {
        return Err(Error::Unsupported(
            "this is an embedding or reranking model (a bidirectional encoder), which does not \
             generate text: run it with `ferrum embed` or `ferrum serve`"
                .into(),
        ));
    }
    match file {
        ModelFile::Gguf(g) => {
            let name = g.architecture()?;
            Arch::from_gguf_name(name).ok_or_else(|| {
                Error::Unsupported(format!(
                    "{}: architecture {name:?} (supported: {}; embedding models: {})",
                    g.path.display(),
                    Arch::supported_gguf(),
                    encoder::supported()
                ))
            })
        }
        ModelFile::Hf(h) => {
            let class = h
                .config
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(|a| a.as_str());
            let model_type = h.config.get("model_type").and_then(|a| a.as_str());
            Arch::from_hf(class, model_type).ok_or_else(|| {
                Error::Unsupported(format!(
                    "{}: architecture {:?} / model_type {:?} (supported: {}; embedding models: \
                     {})",
                    h.dir.display(),
                    class,
                    model_type,
                    Arch::supported_hf(),
                    encoder::supported()
                ))
            })
        }
    }
}

/// The model's configuration, from config.json or the GGUF metadata (and, for GGUF, the
/// embedding's row count and whether an output head exists). Reads no weights.
pub fn read_config(file: &ModelFile) -> Result<ModelConfig> {
    let arch = detect_arch(file)?;
    match file {
        ModelFile::Hf(h) => (arch.info().from_hf)(&h.config),
        ModelFile::Gguf(g) => {
            let store = file.tensors();
            let embd = store.get("token_embd.weight").ok_or_else(|| {
                Error::Weights(format!("{}: no token_embd.weight", g.path.display()))
            })?;
            let vocab = embd.n_rows();
            let tied = !store.contains("output.weight");
            (arch.info().from_gguf)(g, vocab, tied)
        }
    }
}

/// What the load summary line reports.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub arch: Arch,
    pub params: usize,
    /// The format most of the weight bytes are stored in.
    pub main_dtype: DType,
    pub file_bytes: usize,
    pub load_secs: f64,
    /// Weight bytes one decode step reads: every matrix once (the output head included),
    /// one embedding row, and for MoE layers only the active share of the experts.
    pub decode_bytes_per_token: usize,
    /// Of which the routed experts' share (the MoE block's weight traffic per token).
    pub expert_bytes_per_token: usize,
    /// Whether it came from a GGUF (a LoRA adapter from the other kind of file is permuted
    /// to match a Llama GGUF's query and key rows).
    pub gguf: bool,
}

pub struct Model<B: Backend> {
    pub decoder: Decoder<B>,
    pub info: ModelInfo,
    /// A decoder embedder's pooling (Qwen3-Embedding's last token), where the model's files
    /// give one (sentence-transformers' `modules.json`, a GGUF `pooling_type`): the model is
    /// then served as an embedding model.
    pub pooling: Option<encoder::Pooling>,
    /// The vision tower of a vision-language checkpoint.
    pub vision: Option<vision::Vision<B>>,
}

#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// KV capacity in tokens; defaults to the model's context, at most [`DEFAULT_MAX_CONTEXT`].
    pub context: Option<usize>,
    /// A GGUF model's vision tower: llama.cpp's `mmproj` file. Without it, one beside the
    /// model (a `*mmproj*.gguf` in its folder) is used where its projector is supported.
    pub mmproj: Option<std::path::PathBuf>,
}

/// Context used when the caller does not ask for one: long enough for chat, small enough that
/// the f32 KV cache of a small model stays in the hundreds of megabytes.
pub const DEFAULT_MAX_CONTEXT: usize = 4096;

impl<B: Backend> Model<B> {
    pub fn load(file: &ModelFile, backend: B, opts: &LoadOptions) -> Result<Model<B>> {
        let t0 = Instant::now();
        let arch = detect_arch(file)?;
        let store = file.tensors();
        let config = read_config(file)?;
        let gguf = matches!(file, ModelFile::Gguf(_));
        let context = opts
            .context
            .unwrap_or_else(|| config.max_position.min(DEFAULT_MAX_CONTEXT));
        // The configuration's family, which a checkpoint class shared by two families
        // (Mistral 3's multimodal one) leaves to its text config.
        let src = WeightSource {
            store: &store,
            gguf,
            names: config.arch.info().names,
        };
        if config.linear_layers() > 0 && !backend.recurrent_ops() {
            return Err(Error::Unsupported(format!(
                "{}'s linear-attention (Gated DeltaNet) layers are not on {} yet; run it on \
                 the CPU (--device cpu)",
                arch.name(),
                backend.name()
            )));
        }
        backend.reserve(store.total_bytes() as u64)?;
        let mut decoder = Decoder::load(backend, config, &src, context)?;
        let vision = vision::Vision::load(file, opts.mmproj.as_deref(), decoder.backend())?;
        if let Some(v) = vision.as_ref().filter(|v| v.tokens.bidirectional) {
            // An image's rows attend to each other: all of them go in one pass, which also
            // carries the usual chunk's worth of other tokens (decode steps of other
            // sequences before it).
            decoder.set_pass_capacity(v.max_rows() + decoder::CHUNK);
        }
        let mut by_type: std::collections::HashMap<DType, usize> = Default::default();
        for t in store.tensors.values() {
            *by_type.entry(t.dtype).or_default() += t.bytes().len();
        }
        let (decode_bytes_per_token, expert_bytes_per_token) =
            decode_bytes(&store, &decoder.config);
        let main_dtype = by_type
            .into_iter()
            .max_by_key(|(_, b)| *b)
            .map_or(DType::F32, |(d, _)| d);
        let read = encoder::Pooling::read(file, decoder.config.hidden_size)?;
        let qwen3 = decoder.config.arch == Arch::Qwen3;
        let pooling = encoder::pooling::decoder_reranker(
            file,
            read,
            &store,
            decoder.config.hidden_size,
            qwen3,
        )?;
        Ok(Model {
            decoder,
            pooling,
            vision,
            info: ModelInfo {
                arch,
                params: store.total_params(),
                main_dtype,
                file_bytes: file.file_bytes(),
                load_secs: t0.elapsed().as_secs_f64(),
                decode_bytes_per_token,
                expert_bytes_per_token,
                gguf,
            },
        })
    }

    /// A decoder embedder's embedding of `tokens` ([`Model::pooling`] over
    /// [`Decoder::hidden_rows`], run as one fresh sequence in a cache of its own); `None` for
    /// a model whose files give no pooling.
    pub fn pooled(&mut self, tokens: &[u32]) -> Result<Option<Vec<f32>>> {
        let Some(p) = &self.pooling else {
            return Ok(None);
        };
        let mut kv = self.decoder.alloc_kv_tokens(tokens.len());
        let rows = self.decoder.hidden_rows(&mut kv, tokens)?;
        Ok(Some(p.apply(&rows, self.decoder.config.hidden_size)))
    }

    /// [`Model::pooled`] of several inputs, run together ([`Decoder::hidden_rows_batch`]).
    pub fn pooled_batch(&mut self, inputs: &[&[u32]]) -> Result<Option<Vec<Vec<f32>>>> {
        let Some(p) = &self.pooling else {
            return Ok(None);
        };
        if inputs.iter().any(|t| t.is_empty()) {
            return Err(Error::InvalidRequest("an input is empty".into()));
        }
        let h = self.decoder.config.hidden_size;
        let rows = self.decoder.hidden_rows_batch(inputs)?;
        Ok(Some(rows.iter().map(|r| p.apply(r, h)).collect()))
    }

    /// Reads a LoRA adapter for this model and attaches it; returns its id for
    /// [`decoder::SeqChunk::adapter`].
    pub fn load_adapter(&mut self, name: &str, src: &lora::AdapterSource) -> Result<usize> {
        let a = lora::Adapter::load(name, src, &self.decoder.config, self.info.gguf)?;
        self.decoder.add_adapter(a)
    }

    /// Logits of `tokens` (from position 0 of `kv`) whose image placeholders take `images`'
    /// rows, in order ([`vision::Vision::encode`]'s output and [`vision::Vision::grid`]'s,
    /// one entry an image): scoring and tests; the engine splices them itself.
    pub fn forward_with_images(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        images: &[vision::EncodedImage],
        want: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_with_images_after(kv, tokens, tokens.len(), images, want)
    }

    /// [`forward_with_images`](Self::forward_with_images) where only the first `prompt` tokens
    /// hold the images' placeholders: a placeholder the model generated after them is text, as
    /// in the engine.
    pub fn forward_with_images_after(
        &mut self,
        kv: &mut KvCache<B>,
        tokens: &[u32],
        prompt: usize,
        images: &[vision::EncodedImage],
        want: Logits,
    ) -> Result<Vec<f32>> {
        let Some(v) = &self.vision else {
            if images.is_empty() {
                return self.decoder.forward(kv, tokens, 0, want);
            }
            return Err(Error::InvalidRequest(
                "this model has no vision tower".into(),
            ));
        };
        let spans = v.place(&tokens[..prompt.min(tokens.len())], images.len())?;
        let h = self.decoder.config.hidden_size;
        let mut embeds = Vec::with_capacity(spans.len());
        let mut grids = Vec::new();
        for (&(row, len), (rows, grid)) in spans.iter().zip(images) {
            vision::Vision::<B>::check_rows(rows, len, (1 + v.deep_layers()) * h)?;
            embeds.push(decoder::Embeds {
                row,
                values: rows,
                bidirectional: v.tokens.bidirectional,
                deep: v.deep_layers(),
            });
            if let Some((gh, gw)) = *grid {
                grids.push(decoder::ImageGrid {
                    start: row,
                    h: gh,
                    w: gw,
                });
            }
        }
        self.decoder
            .forward_embedded(kv, tokens, &embeds, &grids, want)
    }

    pub fn open(path: impl AsRef<Path>, backend: B, opts: &LoadOptions) -> Result<Model<B>> {
        Self::load(&ModelFile::open(path)?, backend, opts)
    }
}

/// `(all weight bytes a decode step reads, of which routed experts)`.
fn decode_bytes(store: &ferrum_loader::TensorStore, c: &ModelConfig) -> (usize, usize) {
    let active = c
        .moe
        .as_ref()
        .map_or(1.0, |m| m.n_active as f64 / m.n_experts as f64);
    let mut total = 0f64;
    let mut experts = 0f64;
    for (name, t) in &store.tensors {
        let bytes = t.bytes().len() as f64;
        let is_embed = name == "token_embd.weight" || name == "model.embed_tokens.weight";
        total += if is_embed {
            if c.tie_embeddings {
                bytes // read whole as the output head
            } else {
                bytes / t.n_rows().max(1) as f64
            }
        } else if name.contains("_exps.") || name.contains(".experts.") {
            experts += bytes * active;
            bytes * active
        } else {
            bytes
        };
    }
    (total as usize, experts as usize)
}
