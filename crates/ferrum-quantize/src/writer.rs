//! A streaming GGUF v3 writer (layout per ggml's `docs/gguf.md`): header, metadata, tensor
//! infos and padding are written up front from the declared tensor list, then the data of
//! each tensor is appended in declaration order, in as many pieces as the caller likes, and
//! padded to the alignment when it is complete. Nothing but the current piece is held in
//! memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ferrum_core::{DType, Error, Result};
use ferrum_loader::gguf::encode_str as put_str;
use ferrum_loader::Value;

pub const DEFAULT_ALIGNMENT: usize = 32;

/// A tensor as declared in the header.
#[derive(Debug, Clone)]
pub struct TensorDecl {
    pub name: String,
    /// GGML order: `dims[0]` is the row length.
    pub dims: Vec<usize>,
    pub dtype: DType,
}

impl TensorDecl {
    pub fn n_bytes(&self) -> Option<usize> {
        let n = self
            .dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))?;
        if self
            .dims
            .first()
            .is_some_and(|&d| d % self.dtype.block_len() != 0)
        {
            return None;
        }
        self.dtype.bytes_for(n)
    }
}

pub struct GgufWriter {
    path: PathBuf,
    out: BufWriter<File>,
    alignment: usize,
    tensors: Vec<(TensorDecl, usize)>,
    /// Index of the tensor being written and bytes of it written so far.
    current: usize,
    written_in_current: usize,
    total: u64,
}

fn put_value(buf: &mut Vec<u8>, key: &str, v: &Value) -> Result<()> {
    v.encode(buf)
        .map_err(|e| Error::InvalidRequest(format!("metadata {key:?}: {e}")))
}

impl GgufWriter {
    /// Creates `path` and writes everything before the tensor data. The alignment is
    /// `general.alignment` when the metadata sets it, else 32.
    pub fn create(
        path: impl AsRef<Path>,
        metadata: &[(String, Value)],
        tensors: Vec<TensorDecl>,
    ) -> Result<GgufWriter> {
        let path = path.as_ref().to_path_buf();
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a as usize,
                _ => {
                    return Err(Error::InvalidRequest(format!(
                        "general.alignment {v:?} is not a power of two"
                    )))
                }
            },
        };
        let mut seen = std::collections::HashSet::new();
        for (k, _) in metadata {
            if !seen.insert(k.as_str()) {
                return Err(Error::InvalidRequest(format!(
                    "duplicate metadata key {k:?}"
                )));
            }
        }

        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut head, k, v)?;
        }
        let mut offset = 0usize;
        let mut placed = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.dims.is_empty() || t.dims.len() > 4 {
                return Err(Error::InvalidRequest(format!(
                    "tensor {:?} has {} dimensions (1 to 4 allowed)",
                    t.name,
                    t.dims.len()
                )));
            }
            let n_bytes = t.n_bytes().ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "tensor {:?}: shape {:?} is not whole {} blocks",
                    t.name, t.dims, t.dtype
                ))
            })?;
            let id = t.dtype.ggml_id().ok_or_else(|| {
                Error::Unsupported(format!("tensor {:?}: GGUF has no {} type", t.name, t.dtype))
            })?;
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for &d in &t.dims {
                head.extend_from_slice(&(d as u64).to_le_bytes());
            }
            head.extend_from_slice(&id.to_le_bytes());
            head.extend_from_slice(&(offset as u64).to_le_bytes());
            placed.push((t, n_bytes));
            offset += n_bytes.div_ceil(alignment) * alignment;
        }
        head.resize(head.len().div_ceil(alignment) * alignment, 0);

        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&head).map_err(|e| Error::io(&path, e))?;
        let mut w = GgufWriter {
            path,
            out,
            alignment,
            tensors: placed,
            current: 0,
            written_in_current: 0,
            total: head.len() as u64,
        };
        w.skip_empty()?;
        Ok(w)
    }

    /// The tensor whose data is expected next, if any.
    pub fn next_tensor(&self) -> Option<&TensorDecl> {
        self.tensors.get(self.current).map(|(t, _)| t)
    }

    /// Appends data of the current tensor; moves on to the next tensor (after padding) once
    /// its declared size is reached. A piece may not span two tensors.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let Some((t, n_bytes)) = self.tensors.get(self.current) else {
            return Err(Error::InvalidRequest(
                "GGUF writer: data written after the last tensor".into(),
            ));
        };
        if self.written_in_current + bytes.len() > *n_bytes {
            return Err(Error::InvalidRequest(format!(
                "GGUF writer: tensor {:?} is {n_bytes} bytes, {} written",
                t.name,
                self.written_in_current + bytes.len()
            )));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        self.written_in_current += bytes.len();
        self.total += bytes.len() as u64;
        if self.written_in_current == *n_bytes {
            let pad = n_bytes.div_ceil(self.alignment) * self.alignment - n_bytes;
            self.out
                .write_all(&vec![0u8; pad])
                .map_err(|e| Error::io(&self.path, e))?;
            self.total += pad as u64;
            self.current += 1;
            self.written_in_current = 0;
            self.skip_empty()?;
        }
        Ok(())
    }

    fn skip_empty(&mut self) -> Result<()> {
        while self.tensors.get(self.current).is_some_and(|(_, n)| *n == 0) {
            self.current += 1;
        }
        Ok(())
    }

    /// Flushes and closes the file; an error if some tensor's data is missing. Returns the
    /// file size.
    pub fn finish(mut self) -> Result<u64> {
        if let Some((t, n)) = self.tensors.get(self.current) {
            return Err(Error::InvalidRequest(format!(
                "GGUF writer: tensor {:?} incomplete ({} of {n} bytes written)",
                t.name, self.written_in_current
            )));
        }
        self.out.flush().map_err(|e| Error::io(&self.path, e))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(self.total)
    }
}
