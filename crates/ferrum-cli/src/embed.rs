//! `ferrum embed`: embeddings (or, for a cross-encoder, relevance scores) of texts from the
//! command line or a file, one JSON object a line.

use std::cell::RefCell;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrum_backend::Backend;
use ferrum_loader::ModelFile;
use ferrum_models::encoder::{Encoder, Input};
use ferrum_models::Model;
use ferrum_tokenizer::Tokenizer;
use serde_json::json;

use crate::device::{parse_device, BackendOpts, Device, MakeBackend};

#[derive(Args)]
pub(crate) struct EmbedArgs {
    /// An embedding or reranking model: a Hugging Face folder (sentence-transformers' files
    /// are read for pooling), a .gguf file, or a pulled reference.
    pub model: String,
    /// A text to embed (repeatable).
    #[arg(long)]
    pub text: Vec<String>,
    /// A file of texts, one a line (empty lines skipped).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Score every text against this query instead (a cross-encoder: a reranker).
    #[arg(long)]
    pub query: Option<String>,
    /// Keep the first N numbers of each embedding and renormalise (Matryoshka models).
    #[arg(long)]
    pub dimensions: Option<usize>,
    /// Cut inputs longer than the model reads instead of refusing them.
    #[arg(long)]
    pub truncate: bool,
    /// Keep activations and KV in f32 (the reference's math).
    #[arg(long)]
    pub exact: bool,
    /// auto (a GPU if there is one, else the CPU), cpu, vulkan or vulkan:N.
    #[arg(long, value_parser = parse_device, default_value = "cpu")]
    pub device: Device,
}

pub(crate) fn run(a: EmbedArgs) -> Result<()> {
    let path = crate::models::resolve(&a.model)?;
    let be = BackendOpts::new(a.exact, None, a.device);
    crate::device::on_backend!(be, embed_on(&path, &a, be))
}

/// What `embed` and `bench --embed` run: an encoder, or a decoder embedder (a decoder whose
/// files give its pooling: Qwen3-Embedding).
pub(crate) enum Embedder<B: Backend> {
    Encoder(Box<Encoder<B>>),
    Decoder(Box<RefCell<Model<B>>>),
}

impl<B: Backend> Embedder<B> {
    /// Longest input.
    pub fn context(&self) -> usize {
        match self {
            Embedder::Encoder(e) => e.config.context(),
            Embedder::Decoder(m) => m.borrow().decoder.context,
        }
    }

    pub fn normalized(&self) -> bool {
        match self {
            Embedder::Encoder(e) => e.pooling.normalize,
            Embedder::Decoder(m) => m.borrow().pooling.as_ref().is_some_and(|p| p.normalize),
        }
    }

    pub fn backend_name(&self) -> String {
        match self {
            Embedder::Encoder(e) => e.backend().name(),
            Embedder::Decoder(m) => m.borrow().decoder.backend().name(),
        }
    }

    pub fn embed(&self, inputs: &[Input]) -> ferrum_core::Result<Vec<Vec<f32>>> {
        match self {
            Embedder::Encoder(e) => e.embed(inputs),
            Embedder::Decoder(m) => {
                let ids: Vec<&[u32]> = inputs.iter().map(|x| x.ids).collect();
                m.borrow_mut().pooled_batch(&ids)?.ok_or_else(|| {
                    ferrum_core::Error::InvalidRequest("this model has no pooling".into())
                })
            }
        }
    }

    pub fn classify(&self, inputs: &[Input]) -> ferrum_core::Result<Vec<Vec<f32>>> {
        match self {
            Embedder::Encoder(e) => e.classify(inputs),
            // A decoder reranker's pooling is its yes/no head.
            Embedder::Decoder(m) if m.borrow().pooling.as_ref().is_some_and(|p| p.scores) => {
                self.embed(inputs)
            }
            Embedder::Decoder(_) => Err(ferrum_core::Error::InvalidRequest(
                "this model embeds; it has no head that scores pairs".into(),
            )),
        }
    }

    /// A decoder reranker's prompt (`{query}`, `{document}`), which a pair is scored as.
    pub fn rerank_prompt(&self) -> Option<String> {
        match self {
            Embedder::Encoder(_) => None,
            Embedder::Decoder(m) => m.borrow().pooling.as_ref().and_then(|p| p.prompt.clone()),
        }
    }
}

/// Opens an embedding model (an encoder, or a decoder with its own pooling) and its
/// tokenizer.
pub(crate) fn open<B: MakeBackend>(
    path: &Path,
    be: BackendOpts,
) -> Result<(Embedder<B>, Tokenizer)> {
    let file = ModelFile::open(path)?;
    let tokenizer = match &file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    };
    if ferrum_models::encoder::is_encoder(&file) {
        let enc = Encoder::load(&file, B::make(&be)?)
            .with_context(|| format!("loading {}", path.display()))?;
        return Ok((Embedder::Encoder(Box::new(enc)), tokenizer));
    }
    let model = crate::load_model::<B>(path, &file, None, be)?;
    if model.pooling.is_none() {
        bail!(
            "{} generates text; it is not an embedding model (its files give no pooling: \
             sentence-transformers' modules.json or a GGUF pooling_type). Embedding models: {}, \
             and decoder embedders such as Qwen3-Embedding",
            path.display(),
            ferrum_models::encoder::supported()
        );
    }
    Ok((Embedder::Decoder(Box::new(RefCell::new(model))), tokenizer))
}

fn embed_on<B: MakeBackend>(path: &Path, a: &EmbedArgs, be: BackendOpts) -> Result<()> {
    let (enc, tok) = open::<B>(path, be)?;
    let mut texts = a.text.clone();
    if let Some(f) = &a.file {
        let r = std::io::BufReader::new(
            std::fs::File::open(f).with_context(|| format!("opening {}", f.display()))?,
        );
        for line in r.lines() {
            let line = line?;
            if !line.trim().is_empty() {
                texts.push(line);
            }
        }
    }
    if texts.is_empty() {
        bail!("nothing to embed: give --text or --file");
    }
    let limit = enc.context();
    let cut = |mut v: Vec<u32>, i: usize| -> Result<Vec<u32>> {
        if v.len() > limit {
            if !a.truncate {
                bail!(
                    "text {i} is {} tokens; the model reads at most {limit} (--truncate cuts it)",
                    v.len()
                );
            }
            ferrum_models::encoder::cut_keeping_last(&mut v, limit);
        }
        Ok(v)
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if let Some(q) = &a.query {
        let mut ids = Vec::new();
        let prompt = enc.rerank_prompt();
        for (i, t) in texts.iter().enumerate() {
            let (v, ty) = match &prompt {
                Some(p) => {
                    let v = tok.encode_rerank(p, q, t)?;
                    let limit = enc.context();
                    if v.len() > limit {
                        bail!(
                            "the prompt of text {i} is {} tokens; the model reads at most {limit}",
                            v.len()
                        );
                    }
                    (v, Vec::new())
                }
                None => {
                    let (v, ty) = tok.encode_pair(q, t)?;
                    (cut(v, i)?, ty)
                }
            };
            let n = v.len();
            ids.push((v, ty[..n.min(ty.len())].to_vec()));
        }
        let inputs: Vec<Input> = ids
            .iter()
            .map(|(v, t)| Input {
                ids: v,
                types: (!t.is_empty()).then_some(t.as_slice()),
            })
            .collect();
        let logits = enc.classify(&inputs)?;
        for (i, (t, l)) in texts.iter().zip(logits).enumerate() {
            let score = ferrum_models::encoder::relevance(&l);
            writeln!(
                out,
                "{}",
                json!({"index": i, "text": t, "score": score, "logits": l})
            )?;
        }
        return Ok(());
    }
    let ids = texts
        .iter()
        .enumerate()
        .map(|(i, t)| cut(tok.encode(t, true)?, i))
        .collect::<Result<Vec<_>>>()?;
    let inputs: Vec<Input> = ids
        .iter()
        .map(|v| Input {
            ids: v,
            types: None,
        })
        .collect();
    let vectors = enc.embed(&inputs)?;
    for (i, (t, mut v)) in texts.iter().zip(vectors).enumerate() {
        if let Some(d) = a.dimensions {
            ferrum_models::encoder::truncate_dims(&mut v, d, enc.normalized())
                .map_err(anyhow::Error::msg)?;
        }
        writeln!(out, "{}", json!({"index": i, "text": t, "embedding": v}))?;
    }
    Ok(())
}
