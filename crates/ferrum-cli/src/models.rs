//! Model references and the local model store: a path (GGUF file or Hugging Face folder),
//! a Hugging Face repo id (`org/repo`, `org/repo:file.gguf`, `org/repo:Q4_K_M`) or a short
//! alias from [`ALIASES`]. Downloads go into the standard Hugging Face cache (`HF_HOME`,
//! `HF_ENDPOINT` and `HF_TOKEN` honoured) through the `hf-hub` crate: resumable (a partial
//! `.part` blob — `.incomplete` in the Python client's cache — is continued with a range
//! request) and checked against the Hub's checksum (the LFS sha256, or the git blob sha1 of
//! small files).

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{Api, ApiBuilder};
use hf_hub::{Cache, Repo};

/// Short names for models users ask for by name.
pub const ALIASES: &[(&str, &str)] = &[
    ("smollm2:135m", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("smollm2:360m", "HuggingFaceTB/SmolLM2-360M-Instruct"),
    ("smollm2:1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct"),
    ("qwen3:0.6b", "Qwen/Qwen3-0.6B"),
    ("qwen3:1.7b", "Qwen/Qwen3-1.7B"),
    ("qwen3:4b", "Qwen/Qwen3-4B"),
    ("qwen3:8b", "Qwen/Qwen3-8B"),
    ("qwen3:30b-a3b", "Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M"),
    (
        "qwen3-coder:30b-a3b",
        "unsloth/Qwen3-Coder-30B-A3B-Instruct-GGUF:Q4_K_M",
    ),
    ("qwen2.5:0.5b", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("qwen2.5:1.5b", "Qwen/Qwen2.5-1.5B-Instruct"),
    ("llama3.2:1b", "meta-llama/Llama-3.2-1B-Instruct"),
    ("llama3.2:3b", "meta-llama/Llama-3.2-3B-Instruct"),
    ("tinyllama", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
    ("mistral:7b", "mistralai/Mistral-7B-Instruct-v0.3"),
];

/// What a reference names.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Local(PathBuf),
    /// A Hub repo: one GGUF file of it (by name or by quantisation), or — neither given —
    /// its safetensors folder (or, for a GGUF-only repo, a Q4_K_M file).
    Hub {
        repo: String,
        file: Option<String>,
        quant: Option<String>,
    },
}

pub fn parse(reference: &str) -> Result<Source> {
    if Path::new(reference).exists() {
        return Ok(Source::Local(PathBuf::from(reference)));
    }
    let r = ALIASES
        .iter()
        .find(|(a, _)| a.eq_ignore_ascii_case(reference))
        .map_or(reference, |(_, target)| target);
    let (repo, sel) = match r.split_once(':') {
        Some((repo, sel)) => (repo, Some(sel)),
        None => (r, None),
    };
    let valid = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    match repo.split_once('/') {
        Some((org, name)) if valid(org) && valid(name) => Ok(Source::Hub {
            repo: repo.to_string(),
            file: sel.filter(|s| s.ends_with(".gguf")).map(str::to_string),
            quant: sel.filter(|s| !s.ends_with(".gguf")).map(str::to_string),
        }),
        _ => bail!(
            "{reference:?} is not a file or folder, an alias (ferrum list --aliases), or a \
             Hugging Face repo id (org/repo, org/repo:file.gguf, org/repo:Q4_K_M)"
        ),
    }
}

fn api() -> Result<Api> {
    let mut b = ApiBuilder::from_env().with_progress(true).with_retries(2);
    if let Ok(t) = std::env::var("HF_TOKEN") {
        if !t.is_empty() {
            b = b.with_token(Some(t));
        }
    }
    b.build().context("setting up the Hugging Face client")
}

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into())
}

/// A Hub error in words a user can act on.
fn explain(repo: &str, e: hf_hub::api::sync::ApiError) -> anyhow::Error {
    let text = e.to_string();
    let has = |s: &str| text.contains(s);
    if has("401") || has("403") {
        anyhow!(
            "{repo}: access denied — the repo is gated or private. Accept its terms on the \
             Hub and set HF_TOKEN (or log in with huggingface-cli). ({text})"
        )
    } else if has("404") {
        anyhow!("{repo}: not found on {} ({text})", endpoint())
    } else if matches!(e, hf_hub::api::sync::ApiError::RequestError(_)) {
        anyhow!(
            "{repo}: cannot reach {} — offline, or behind a proxy? Models already pulled \
             still run. ({text})",
            endpoint()
        )
    } else {
        anyhow!("{repo}: {text}")
    }
}

/// Feeds the rest of `f` to `h`; the hex digest.
fn digest<D: sha2::Digest>(mut h: D, f: &mut std::fs::File) -> Result<String> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks a downloaded file against the Hub's etag: sha256 for LFS files, the git blob sha1
/// otherwise. A mismatch removes the file.
fn verify(path: &Path, etag: &str) -> Result<()> {
    let etag = etag.trim_matches('"');
    let is_hex = |n| etag.len() == n && etag.chars().all(|c| c.is_ascii_hexdigit());
    let mut f = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let size = f.metadata()?.len();
    let got = if is_hex(64) {
        digest(sha2::Sha256::default(), &mut f)?
    } else if is_hex(40) {
        let mut h = sha1::Sha1::default();
        sha1::Digest::update(&mut h, format!("blob {size}\0").as_bytes());
        digest(h, &mut f)?
    } else {
        return Ok(()); // an etag that is no checksum: nothing to check against
    };
    if !got.eq_ignore_ascii_case(etag) {
        // The snapshot entry is a link to the blob: remove both.
        let blob = std::fs::canonicalize(path).ok();
        let _ = std::fs::remove_file(path);
        if let Some(b) = blob {
            let _ = std::fs::remove_file(b);
        }
        bail!(
            "{}: checksum mismatch (expected {etag}, got {got}); the download was removed",
            path.display()
        );
    }
    Ok(())
}

/// Where a download reports its progress: the file, its size and the bytes so far (the
/// server's `/api/pull` streams these; the CLI draws its progress bar instead).
pub type Progress<'a> = &'a mut dyn FnMut(&str, u64, u64);

/// hf-hub's progress calls, forwarded to a [`Progress`].
struct Report<'a> {
    to: &'a mut dyn FnMut(&str, u64, u64),
    file: String,
    total: u64,
    done: u64,
}

impl hf_hub::api::Progress for Report<'_> {
    fn init(&mut self, size: usize, _filename: &str) {
        // A retry starts over: hf-hub then reports the bytes already there as one update.
        self.total = size as u64;
        self.done = 0;
        (self.to)(&self.file, self.total, self.done);
    }

    fn update(&mut self, size: usize) {
        self.done += size as u64;
        (self.to)(&self.file, self.total, self.done);
    }

    fn finish(&mut self) {
        (self.to)(&self.file, self.total, self.total);
    }
}

/// One file of a repo: from the cache if it is there, else downloaded (resuming a partial
/// download) and verified.
fn fetch(api: &Api, repo_id: &str, file: &str, progress: &mut Option<Progress>) -> Result<PathBuf> {
    if let Some(p) = Cache::from_env()
        .repo(Repo::model(repo_id.to_string()))
        .get(file)
    {
        if let Some(report) = progress.as_mut() {
            let size = std::fs::metadata(&p).map_or(0, |m| m.len());
            report(file, size, size);
        }
        return Ok(p);
    }
    let repo = api.repo(Repo::model(repo_id.to_string()));
    let meta = api
        .metadata(&repo.url(file))
        .map_err(|e| explain(repo_id, e))?;
    let path = match progress.as_mut() {
        Some(to) => {
            let report = Report {
                to: &mut **to,
                file: file.to_string(),
                total: meta.size() as u64,
                done: 0,
            };
            repo.download_with_progress(file, report)
        }
        None => repo.download(file),
    }
    .map_err(|e| explain(repo_id, e))?;
    verify(&path, meta.etag())?;
    Ok(path)
}

/// The GGUF file of `files` for `quant` (case-insensitive, e.g. `Q4_K_M`), or Q4_K_M, or the
/// first one.
fn pick_gguf(files: &[String], quant: Option<&str>) -> Option<String> {
    let ggufs: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
    let by = |q: &str| {
        let q = q.to_ascii_lowercase();
        ggufs
            .iter()
            .find(|f| f.to_ascii_lowercase().contains(&q))
            .map(|f| f.to_string())
    };
    match quant {
        Some(q) => by(q),
        None => by("q4_k_m").or_else(|| ggufs.first().map(|f| f.to_string())),
    }
}

/// Files a model folder needs.
fn folder_files(files: &[String]) -> Vec<String> {
    files
        .iter()
        .filter(|f| {
            !f.contains('/')
                && (f.ends_with(".safetensors")
                    || matches!(
                        f.as_str(),
                        "config.json"
                            | "generation_config.json"
                            | "tokenizer.json"
                            | "tokenizer_config.json"
                            | "special_tokens_map.json"
                            | "chat_template.jinja"
                            | "model.safetensors.index.json"
                    ))
        })
        .cloned()
        .collect()
}

/// `ferrum pull`: downloads what `reference` names; returns the local path.
pub fn pull(reference: &str) -> Result<PathBuf> {
    pull_reporting(reference, None)
}

/// [`pull`], reporting each file's progress to `progress` instead of drawing a bar.
pub fn pull_reporting(reference: &str, mut progress: Option<Progress>) -> Result<PathBuf> {
    let (repo_id, file, quant) = match parse(reference)? {
        Source::Local(p) => return Ok(p),
        Source::Hub { repo, file, quant } => (repo, file, quant),
    };
    let api = api()?;
    if let Some(f) = file {
        return fetch(&api, &repo_id, &f, &mut progress);
    }
    let repo = api.repo(Repo::model(repo_id.clone()));
    let info = repo.info().map_err(|e| explain(&repo_id, e))?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let has_weights = files.iter().any(|f| f.ends_with(".safetensors"));
    if quant.is_some() || !has_weights {
        let Some(f) = pick_gguf(&files, quant.as_deref()) else {
            bail!(
                "{repo_id}: no GGUF file{} (files: {})",
                quant.map(|q| format!(" for {q}")).unwrap_or_default(),
                files.join(", ")
            );
        };
        return fetch(&api, &repo_id, &f, &mut progress);
    }
    let wanted = folder_files(&files);
    if !wanted.iter().any(|f| f == "config.json") {
        bail!("{repo_id}: no config.json — not a model folder this engine reads");
    }
    let mut dir = None;
    for f in &wanted {
        let p = fetch(&api, &repo_id, f, &mut progress)?;
        dir = p.parent().map(Path::to_path_buf);
    }
    dir.ok_or_else(|| anyhow!("{repo_id}: nothing downloaded"))
}

/// The snapshot folder of a cached repo (its `main` ref), if any.
fn snapshot(repo_id: &str) -> Option<PathBuf> {
    let cache = Cache::from_env();
    let dir = cache
        .path()
        .join(format!("models--{}", repo_id.replace('/', "--")));
    let commit = std::fs::read_to_string(dir.join("refs/main")).ok()?;
    let snap = dir.join("snapshots").join(commit.trim());
    snap.is_dir().then_some(snap)
}

fn files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The local path of `reference`, from the cache only (no network).
pub fn local(reference: &str) -> Result<Option<PathBuf>> {
    match parse(reference)? {
        Source::Local(p) => Ok(Some(p)),
        Source::Hub { repo, file, quant } => {
            let Some(snap) = snapshot(&repo) else {
                return Ok(None);
            };
            let files = files_in(&snap);
            let pick = match (&file, &quant) {
                (Some(f), _) => files.iter().find(|x| *x == f).cloned(),
                (None, Some(q)) => pick_gguf(&files, Some(q)),
                (None, None) if files.iter().any(|f| f == "config.json") => {
                    return Ok(Some(snap));
                }
                (None, None) => pick_gguf(&files, None),
            };
            Ok(pick.map(|f| snap.join(f)))
        }
    }
}

/// The path to run: local or cached, else pulled now.
pub fn resolve(reference: &str) -> Result<PathBuf> {
    match local(reference)? {
        Some(p) => Ok(p),
        None => {
            eprintln!("ferrum: {reference} is not here yet; pulling it");
            pull(reference)
        }
    }
}

/// One row of `ferrum list`.
pub struct Entry {
    pub name: String,
    pub path: PathBuf,
    pub bytes: u64,
    pub arch: String,
    pub quant: String,
    pub complete: bool,
}

fn dir_bytes(p: &Path) -> u64 {
    if p.is_file() {
        return std::fs::metadata(p).map_or(0, |m| m.len());
    }
    std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten()
                .map(|e| std::fs::metadata(e.path()).map_or(0, |m| m.len()))
                .sum()
        })
        .unwrap_or(0)
}

/// GGUF `general.file_type` names, as llama.cpp prints them.
fn ftype_name(t: u64) -> &'static str {
    match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        _ => "?",
    }
}

fn describe(name: String, path: &Path, partial: bool) -> Entry {
    let bytes = dir_bytes(path);
    let (arch, quant, ok) = match ferrum_loader::ModelFile::inspect(path) {
        Ok(f) => {
            let arch = ferrum_models::detect_arch(&f).map_or("?".into(), |a| a.name().to_string());
            let quant = match &f {
                ferrum_loader::ModelFile::Gguf(g) => g
                    .get_u64("general.file_type")
                    .map_or("?", ftype_name)
                    .to_string(),
                ferrum_loader::ModelFile::Hf(h) => h
                    .config
                    .get("torch_dtype")
                    .or_else(|| h.config.get("dtype"))
                    .and_then(|d| d.as_str())
                    .unwrap_or("?")
                    .to_string(),
            };
            (arch, quant, true)
        }
        Err(_) => ("?".into(), "?".into(), false),
    };
    Entry {
        name,
        path: path.to_path_buf(),
        bytes,
        arch,
        quant,
        complete: ok && !partial,
    }
}

/// Models in the Hugging Face cache and ferrum's own cache.
pub fn list() -> Vec<Entry> {
    let mut out = Vec::new();
    let cache = Cache::from_env();
    let mut repos: Vec<PathBuf> = std::fs::read_dir(cache.path())
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    repos.sort();
    for dir in repos {
        let Some(folder) = dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(id) = folder.strip_prefix("models--") else {
            continue;
        };
        let repo_id = id.replacen("--", "/", 1);
        let partial = files_in(&dir.join("blobs"))
            .iter()
            .any(|f| f.ends_with(".part") || f.ends_with(".incomplete"));
        let Some(snap) = snapshot(&repo_id) else {
            out.push(Entry {
                name: repo_id,
                path: dir.clone(),
                bytes: dir_bytes(&dir.join("blobs")),
                arch: "?".into(),
                quant: "?".into(),
                complete: false,
            });
            continue;
        };
        let mut files = files_in(&snap);
        files.sort();
        if files.iter().any(|f| f == "config.json") {
            out.push(describe(repo_id.clone(), &snap, partial));
        }
        for f in files.iter().filter(|f| f.ends_with(".gguf")) {
            out.push(describe(format!("{repo_id}:{f}"), &snap.join(f), partial));
        }
    }
    let default = ferrum_loader::assets::default_model_path();
    if default.exists() {
        out.push(describe(
            "(default) SmolLM2-135M-Instruct Q4_1".into(),
            &default,
            false,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse() {
        assert_eq!(
            parse("Qwen/Qwen3-0.6B").unwrap(),
            Source::Hub {
                repo: "Qwen/Qwen3-0.6B".into(),
                file: None,
                quant: None
            }
        );
        assert_eq!(
            parse("org/repo:model-Q8_0.gguf").unwrap(),
            Source::Hub {
                repo: "org/repo".into(),
                file: Some("model-Q8_0.gguf".into()),
                quant: None
            }
        );
        assert_eq!(
            parse("qwen3:30b-a3b").unwrap(),
            Source::Hub {
                repo: "Qwen/Qwen3-30B-A3B-GGUF".into(),
                file: None,
                quant: Some("Q4_K_M".into())
            }
        );
        assert!(parse("not a model").is_err());
        assert!(parse("/no/such/file.gguf").is_err());
    }

    #[test]
    fn gguf_choice_by_quant() {
        let files: Vec<String> = ["a-Q8_0.gguf", "a-Q4_K_M.gguf", "README.md"]
            .map(String::from)
            .to_vec();
        assert_eq!(
            pick_gguf(&files, Some("q8_0")).as_deref(),
            Some("a-Q8_0.gguf")
        );
        assert_eq!(pick_gguf(&files, None).as_deref(), Some("a-Q4_K_M.gguf"));
        assert_eq!(pick_gguf(&files, Some("Q2_K")), None);
    }
}
