//! `ferrum embed`: embeddings (or, for a cross-encoder, relevance scores) of texts from the
//! command line or a file, one JSON object a line.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrum_loader::ModelFile;
use ferrum_models::encoder::{Encoder, Input};
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

/// Opens an encoder and its tokenizer.
pub(crate) fn open<B: MakeBackend>(
    path: &Path,
    be: BackendOpts,
) -> Result<(Encoder<B>, Tokenizer)> {
    let file = ModelFile::open(path)?;
    if !ferrum_models::encoder::is_encoder(&file) {
        bail!(
            "{} is not an embedding or reranking model (supported: {})",
            path.display(),
            ferrum_models::encoder::supported()
        );
    }
    let tokenizer = match &file {
        ModelFile::Gguf(g) => Tokenizer::from_gguf(g)?,
        ModelFile::Hf(h) => Tokenizer::from_hf_dir(&h.dir)?,
    };
    let enc = Encoder::load(&file, B::make(&be)?)
        .with_context(|| format!("loading {}", path.display()))?;
    Ok((enc, tokenizer))
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
    let limit = enc.config.context();
    let cut = |mut v: Vec<u32>, i: usize| -> Result<Vec<u32>> {
        if v.len() > limit {
            if !a.truncate {
                bail!(
                    "text {i} is {} tokens; the model reads at most {limit} (--truncate cuts it)",
                    v.len()
                );
            }
            // Keep the closing special token a BERT-style template puts last.
            let last = v[v.len() - 1];
            v.truncate(limit);
            v[limit - 1] = last;
        }
        Ok(v)
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if let Some(q) = &a.query {
        let mut ids = Vec::new();
        for (i, t) in texts.iter().enumerate() {
            let (v, ty) = tok.encode_pair(q, t)?;
            let n = v.len().min(limit);
            ids.push((cut(v, i)?, ty[..n].to_vec()));
        }
        let inputs: Vec<Input> = ids
            .iter()
            .map(|(v, t)| Input {
                ids: v,
                types: Some(t),
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
            ferrum_models::encoder::truncate_dims(&mut v, d, enc.pooling.normalize)
                .map_err(anyhow::Error::msg)?;
        }
        writeln!(out, "{}", json!({"index": i, "text": t, "embedding": v}))?;
    }
    Ok(())
}
