//! `ferrum serve` with several models (`--model NAME=MODEL` repeated, `--models-dir`,
//! `--models-from-cache`): each model's memory planned by `ferrum plan` up front, then the
//! server's front (`ferrum_server::fleet`) loads them on demand within `--max-memory`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ferrum_loader::ModelFile;
use ferrum_server::fleet::{FleetConfig, ModelSpec};

use crate::{BackendOpts, MakeBackend, ServeArgs};

/// Whether the command line asks for several models.
pub(crate) fn wanted(a: &ServeArgs) -> bool {
    !a.models.is_empty() || a.models_dir.is_some() || a.models_from_cache
}

/// `NAME=MODEL`, or a bare MODEL named after its file (without `.gguf`) or reference.
fn named(spec: &str) -> Result<(String, PathBuf)> {
    let (name, reference) = match spec.split_once('=') {
        Some((n, r)) if !n.is_empty() && !Path::new(spec).exists() => (Some(n.to_string()), r),
        _ => (None, spec),
    };
    let path = crate::model_path(Some(reference))?;
    let name = name.unwrap_or_else(|| default_name(reference, &path));
    Ok((name, path))
}

fn default_name(reference: &str, path: &Path) -> String {
    if !Path::new(reference).exists() {
        return reference.to_string();
    }
    let n = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy()
        .to_string();
    n.strip_suffix(".gguf").map(str::to_string).unwrap_or(n)
}

/// The models of a folder: its `.gguf` files (not vision projectors) and Hugging Face
/// folders, by name.
fn folder_models(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    let rd = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    let mut paths: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    paths.sort();
    for p in paths {
        let name = p.file_name().map(|n| n.to_string_lossy().to_string());
        let Some(name) = name else { continue };
        if p.is_dir() && p.join("config.json").exists() {
            out.push((name, p));
        } else if let Some(stem) = name.strip_suffix(".gguf") {
            if !stem.contains("mmproj") {
                out.push((stem.to_string(), p));
            }
        }
    }
    Ok(out)
}

/// `8G`, `512M`, `1.5GB`, `2000000000`.
fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.strip_suffix('B').unwrap_or(&t);
    let (num, k) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('G') => (&t[..t.len() - 1], 1e9),
        Some('T') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok((v * k) as u64),
        _ => bail!("--max-memory {s:?}: give a size such as 8G or 512M"),
    }
}

fn mem_available() -> u64 {
    crate::plan::proc_bytes("/proc/meminfo", "MemAvailable:").unwrap_or(8 << 30)
}

/// `ferrum plan`'s total for a model as this server would load it (its context, KV pool and
/// cache format), from a child process, so the tokenizer's memory is measured as `plan`
/// measures it; the file's size with a margin where that fails.
fn planned_bytes(a: &ServeArgs, path: &Path) -> u64 {
    let fallback = || {
        let bytes = ModelFile::inspect(path).map_or(0, |f| f.file_bytes() as u64);
        bytes + bytes / 5
    };
    let Ok(exe) = std::env::current_exe() else {
        return fallback();
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("plan").arg(path).arg("--json");
    if let Some(c) = a.ctx {
        cmd.arg("--ctx").arg(c.to_string());
    }
    match a.kv_tokens {
        Some(t) => cmd.arg("--kv-tokens").arg(t.to_string()),
        None => cmd.arg("--concurrency").arg("4"),
    };
    if let Some(d) = a.kv_dtype {
        cmd.arg("--kv-dtype").arg(match d {
            ferrum_backend::cpu::KvDtype::F32 => "f32",
            ferrum_backend::cpu::KvDtype::Q8_0 => "q8_0",
            _ => "f16",
        });
    }
    let out = match cmd.output() {
        Ok(o) if o.status.success() => o.stdout,
        _ => return fallback(),
    };
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
    v.get("total_with_grammar_bytes")
        .or_else(|| v.get("total_bytes"))
        .and_then(|b| b.as_f64())
        .map_or_else(fallback, |b| b as u64)
}

pub(crate) fn run<B: MakeBackend>(a: ServeArgs, be: BackendOpts) -> Result<()> {
    if !a.loras.is_empty() {
        bail!("--lora goes with one model (serve MODEL --lora NAME=PATH)");
    }
    let mut found: Vec<(String, PathBuf)> = Vec::new();
    if let Some(m) = &a.model {
        found.push(named(m)?);
    }
    for m in &a.models {
        found.push(named(m)?);
    }
    if let Some(d) = &a.models_dir {
        found.extend(folder_models(d)?);
    }
    if a.models_from_cache {
        for e in crate::models::list().into_iter().filter(|e| e.complete) {
            found.push((e.name, e.path));
        }
    }
    let mut specs: Vec<ModelSpec> = Vec::new();
    for (name, path) in found {
        if specs.iter().any(|s| s.name == name) {
            bail!("two models named {name:?}: give NAME=MODEL");
        }
        let file_bytes = ModelFile::inspect(&path)
            .with_context(|| format!("reading {}", path.display()))?
            .file_bytes() as u64;
        let bytes = planned_bytes(&a, &path);
        eprintln!(
            "ferrum: {name}: {} ({:.0} MB planned)",
            path.display(),
            bytes as f64 / 1e6
        );
        specs.push(ModelSpec {
            name,
            path,
            bytes,
            file_bytes,
        });
    }
    if specs.is_empty() {
        bail!("no models to serve");
    }
    let budget = match &a.max_memory {
        Some(s) => parse_bytes(s)?,
        None => mem_available() / 10 * 9,
    };
    let keep_alive = match ferrum_server::fleet::parse_keep_alive(&serde_json::Value::String(
        a.keep_alive.clone(),
    )) {
        Some(k) => k,
        None => bail!("--keep-alive {:?}: give 5m, 30s, 0 or -1", a.keep_alive),
    };
    let base = crate::server_config(a.clone(), specs[0].name.clone());
    let cfg = FleetConfig {
        budget,
        keep_alive,
        max_body: base.max_body_bytes,
        api_key: base.api_key.clone(),
        guard: ferrum_server::guard::BrowserGuard::new(
            &base.host,
            &base.allowed_hosts,
            &base.allowed_origins,
        ),
        shutdown_grace: base.shutdown_grace,
    };
    let (host, port) = (base.host.clone(), base.port);
    let args = Arc::new(a);
    let start: ferrum_server::fleet::Starter = Arc::new(move |spec: &ModelSpec| {
        let file = ModelFile::open(&spec.path).map_err(|e| e.to_string())?;
        let tok = crate::file_tokenizer(&file).map_err(|e| format!("{e:#}"))?;
        let mut cfg = base.clone();
        cfg.model_id = spec.name.clone();
        cfg.model_aliases.clear();
        cfg.any_model_name = false;
        Ok(if ferrum_models::encoder::is_encoder(&file) {
            let load = crate::encoder_loader::<B>(be, spec.path.clone(), file);
            ferrum_server::model_state::<B>(&cfg, tok, load, None)
        } else {
            let load = crate::generator_loader::<B>(&args, be, spec.path.clone(), file)
                .map_err(|e| format!("{e:#}"))?;
            ferrum_server::model_state::<B>(&cfg, tok, load, None)
        })
    });
    ferrum_server::fleet::serve(&host, port, specs, cfg, start).map_err(|e| anyhow::anyhow!(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("8G").unwrap(), 8_000_000_000);
        assert_eq!(parse_bytes("512M").unwrap(), 512_000_000);
        assert_eq!(parse_bytes("1.5gb").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("2000").unwrap(), 2000);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1G").is_err());
    }
}
