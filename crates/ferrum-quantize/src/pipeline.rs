//! `quantize_file`: read a GGUF or a Hugging Face folder, choose each tensor's format with
//! the [`recipe`](crate::recipe), and stream the result to a new GGUF, a slab of rows at a
//! time (dequantise to f32 → requantise → write).

use std::path::Path;

use ferrum_backend::cpu::quant::dequantize;
use ferrum_core::{DType, Error, Result};
use ferrum_loader::{GgufFile, HfFolder, RawTensor, Value};

use crate::convert::{self, permuted_source_row};
use crate::recipe::{self, ModelInfo, PlanInput};
use crate::writer::{GgufWriter, TensorDecl};
use crate::{quantize_row, FileType};

/// What [`quantize_file`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizeReport {
    pub tensors: usize,
    /// Tensor bytes read (the sum of the source tensors' stored sizes).
    pub in_bytes: u64,
    /// Size of the written file.
    pub out_bytes: u64,
    /// How many tensors were written in each format, most frequent first.
    pub by_type: Vec<(DType, usize)>,
}

struct Job {
    name: String,
    raw: RawTensor,
    permute_heads: Option<usize>,
}

/// Rows per slab are chosen so one slab of f32 stays near this size.
const SLAB_F32_BYTES: usize = 16 << 20;

/// Quantises `input` (a `.gguf` file, or a Hugging Face folder with config.json, safetensors
/// and a byte-level BPE tokenizer.json) to `output` with llama-quantize's recipe for `ftype`.
/// Prints nothing.
pub fn quantize_file(input: &Path, output: &Path, ftype: FileType) -> Result<QuantizeReport> {
    let (mut metadata, jobs, from_hf) = if input.is_dir() {
        let folder = HfFolder::open(input)?;
        let conv = convert::convert(&folder)?;
        let jobs = conv
            .tensors
            .into_iter()
            .map(|t| Job {
                name: t.name,
                raw: t.raw,
                permute_heads: t.permute_heads,
            })
            .collect::<Vec<_>>();
        (conv.metadata, jobs, true)
    } else {
        let g = GgufFile::open(input)?;
        let mut md = Vec::with_capacity(g.keys.len());
        for k in &g.keys {
            if k.starts_with("split.") {
                continue;
            }
            if let Some(v) = g.get(k) {
                md.push((k.clone(), v.into_owned()));
            }
        }
        let store = g.tensors();
        let jobs = g
            .tensor_infos
            .iter()
            .map(|t| Job {
                name: t.name.clone(),
                raw: store.tensors[&t.name].clone(),
                permute_heads: None,
            })
            .collect::<Vec<_>>();
        (md, jobs, false)
    };
    if input.canonicalize().ok() == output.canonicalize().ok() && output.exists() {
        return Err(Error::InvalidRequest(format!(
            "{}: output would overwrite the input",
            output.display()
        )));
    }
    set(&mut metadata, "general.quantization_version", Value::U32(2));
    set(
        &mut metadata,
        "general.file_type",
        Value::U32(ftype.llama_ftype()),
    );

    let get = |k: &str| metadata.iter().find(|(key, _)| key == k).map(|(_, v)| v);
    let arch = get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let num = |k: &str| get(&format!("{arch}.{k}")).and_then(Value::as_u64);
    let n_head = num("attention.head_count").unwrap_or(1).max(1);
    let n_head_kv = num("attention.head_count_kv").unwrap_or(n_head).max(1);
    let mut jobs = jobs;
    jobs.sort_by(|a, b| recipe::llama_order(&a.name, &b.name));
    let n_layer = match num("block_count") {
        Some(n) => n as usize,
        None => jobs.iter().filter(|j| j.name.contains("ffn_down")).count(),
    };
    let model = ModelInfo {
        arch: &arch,
        n_layer,
        n_gqa: (n_head / n_head_kv) as usize,
    };

    let ggml_dims: Vec<Vec<usize>> = jobs
        .iter()
        .map(|j| j.raw.shape.iter().rev().copied().collect())
        .collect();
    let inputs: Vec<PlanInput> = jobs
        .iter()
        .zip(&ggml_dims)
        .map(|(j, d)| PlanInput {
            name: &j.name,
            dims: d,
        })
        .collect();
    let plan = recipe::plan(ftype, &model, &inputs);

    let targets: Vec<DType> = jobs
        .iter()
        .zip(&plan)
        .map(|(j, p)| match p {
            Some(t) => *t,
            // Not quantised: float tensors keep their format (llama.cpp copies them);
            // Hugging Face 1-D tensors become F32 as the converter writes them.
            None if from_hf => DType::F32,
            None if !j.raw.dtype.is_quantized() => j.raw.dtype,
            None => DType::F32,
        })
        .collect();

    let decls: Vec<TensorDecl> = jobs
        .iter()
        .zip(&ggml_dims)
        .zip(&targets)
        .map(|((j, d), &t)| TensorDecl {
            name: j.name.clone(),
            dims: d.clone(),
            dtype: t,
        })
        .collect();
    let mut w = GgufWriter::create(output, &metadata, decls)?;
    let mut in_bytes = 0u64;
    let mut counts: Vec<(DType, usize)> = Vec::new();
    for (j, &target) in jobs.iter().zip(&targets) {
        in_bytes += j.raw.bytes().len() as u64;
        write_tensor(&mut w, j, target)?;
        match counts.iter_mut().find(|(t, _)| *t == target) {
            Some((_, n)) => *n += 1,
            None => counts.push((target, 1)),
        }
    }
    let out_bytes = w.finish()?;
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.ggml_id().cmp(&b.0.ggml_id())));
    Ok(QuantizeReport {
        tensors: jobs.len(),
        in_bytes,
        out_bytes,
        by_type: counts,
    })
}

/// Replaces a key's value in place, or appends it.
fn set(md: &mut Vec<(String, Value)>, key: &str, v: Value) {
    match md.iter_mut().find(|(k, _)| k == key) {
        Some((_, old)) => *old = v,
        None => md.push((key.to_string(), v)),
    }
}

fn write_tensor(w: &mut GgufWriter, j: &Job, target: DType) -> Result<()> {
    let raw = &j.raw;
    let src = raw.bytes();
    let row_len = raw.row_len();
    let n_rows = raw.n_rows();
    let src_row_bytes = raw.dtype.bytes_for(row_len).ok_or_else(|| {
        Error::Weights(format!(
            "{}: row of {row_len} is not whole {} blocks",
            j.name, raw.dtype
        ))
    })?;
    // 1-D tensors (Llama's q/k biases) permute their elements like rows of length 1.
    let (perm_rows, perm_unit) = if raw.shape.len() == 1 {
        (raw.numel(), raw.dtype.bytes_for(1))
    } else {
        (n_rows, Some(src_row_bytes))
    };
    if target == raw.dtype && j.permute_heads.is_none() {
        // Same format: copy the bytes (llama.cpp does the same, so requantising a Q8_0 tensor
        // to Q8_0 loses nothing).
        for chunk in src.chunks(SLAB_F32_BYTES) {
            w.write(chunk)?;
        }
        return Ok(());
    }
    let src_owned;
    let src: &[u8] = match (j.permute_heads, perm_unit) {
        (Some(h), Some(unit)) => {
            let mut v = Vec::with_capacity(src.len());
            for r in 0..perm_rows {
                let s = permuted_source_row(r, perm_rows, h);
                v.extend_from_slice(&src[s * unit..(s + 1) * unit]);
            }
            src_owned = v;
            &src_owned
        }
        (Some(_), None) => {
            return Err(Error::Unsupported(format!(
                "{}: cannot permute a {} vector",
                j.name, raw.dtype
            )))
        }
        (None, _) => src,
    };
    if target == raw.dtype {
        for chunk in src.chunks(SLAB_F32_BYTES) {
            w.write(chunk)?;
        }
        return Ok(());
    }
    let dst_row_bytes = target.bytes_for(row_len).ok_or_else(|| {
        Error::Weights(format!(
            "{}: row of {row_len} is not whole {target} blocks",
            j.name
        ))
    })?;
    let rows_per_slab = (SLAB_F32_BYTES / (4 * row_len.max(1))).max(1);
    let mut f = vec![0f32; rows_per_slab.min(n_rows) * row_len];
    let mut q = vec![0u8; rows_per_slab.min(n_rows) * dst_row_bytes];
    let mut r0 = 0;
    while r0 < n_rows {
        let rows = rows_per_slab.min(n_rows - r0);
        let f = &mut f[..rows * row_len];
        let q = &mut q[..rows * dst_row_bytes];
        let bytes = &src[r0 * src_row_bytes..(r0 + rows) * src_row_bytes];
        if !dequantize(raw.dtype, bytes, f) {
            return Err(Error::Unsupported(format!(
                "{}: cannot read {} tensors",
                j.name, raw.dtype
            )));
        }
        for (x, o) in f
            .chunks_exact(row_len)
            .zip(q.chunks_exact_mut(dst_row_bytes))
        {
            quantize_row(target, x, o)?;
        }
        w.write(q)?;
        r0 += rows;
    }
    Ok(())
}
