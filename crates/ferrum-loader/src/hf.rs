//! A Hugging Face model folder: `config.json`, and `model.safetensors` or the shards listed in
//! `model.safetensors.index.json`. Safetensors headers are validated by the `safetensors`
//! crate (offsets inside the buffer, sizes matching dtype × shape) before any tensor is used.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrum_core::{DType, Error, Result};

use safetensors::{Dtype as StDtype, SafeTensors};

use crate::tensor::{RawTensor, Storage, TensorStore};

pub struct HfFolder {
    pub dir: PathBuf,
    pub config: serde_json::Value,
    pub tensors: TensorStore,
    /// Total bytes of the safetensors files (for the load summary).
    pub file_bytes: usize,
}

impl HfFolder {
    pub fn open(dir: impl AsRef<Path>) -> Result<HfFolder> {
        Self::open_with(dir, true)
    }

    /// Opens for reading the configuration and tensor headers only.
    pub fn inspect(dir: impl AsRef<Path>) -> Result<HfFolder> {
        Self::open_with(dir, false)
    }

    fn open_with(dir: impl AsRef<Path>, populate: bool) -> Result<HfFolder> {
        let dir = dir.as_ref().to_path_buf();
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::format(&config_path, format!("invalid JSON: {e}")))?;

        let files = shard_files(&dir)?;
        let mut tensors = TensorStore::default();
        let mut file_bytes = 0;
        for f in files {
            file_bytes += load_safetensors(&f, &mut tensors, populate)?;
        }
        Ok(HfFolder {
            dir,
            config,
            tensors,
            file_bytes,
        })
    }
}

fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Err(Error::format(
            dir,
            "no model.safetensors or model.safetensors.index.json in this folder",
        ));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(&index, format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::format(&index, "no \"weight_map\" object"))?;
    let mut names = BTreeSet::new();
    for v in map.values() {
        let f = v
            .as_str()
            .ok_or_else(|| Error::format(&index, "weight_map values must be file names"))?;
        // A shard name is a plain file in this folder; anything else is refused rather than
        // followed outside the model directory.
        if f.contains('/') || f.contains('\\') || f == ".." {
            return Err(Error::format(
                &index,
                format!("shard name {f:?} is not a plain file name"),
            ));
        }
        names.insert(f.to_string());
    }
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// Maps one safetensors file and adds its tensors; returns its size.
pub fn load_safetensors(path: &Path, store: &mut TensorStore, populate: bool) -> Result<usize> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mmap = Arc::new(crate::tensor::map_file(&file, populate).map_err(|e| Error::io(path, e))?);
    let st = SafeTensors::deserialize(&mmap[..])
        .map_err(|e| Error::format(path, format!("invalid safetensors: {e}")))?;
    let base = mmap.as_ptr() as usize;
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            // MXFP4 checkpoints' blocks and scales, which their loader decodes.
            StDtype::U8 => DType::U8,
            // Integer buffers older transformers saved beside the weights (BERT's
            // `embeddings.position_ids`, `token_type_ids`): the positions they hold are the
            // ones every model computes.
            _ if name.ends_with("position_ids") || name.ends_with("token_type_ids") => continue,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: tensor {name:?} has dtype {other:?} (F32, F16, BF16 and U8 are supported)",
                    path.display()
                )))
            }
        };
        let data = view.data();
        let offset = data.as_ptr() as usize - base;
        let shape = view.shape().to_vec();
        let expect = dtype.bytes_for(shape.iter().product());
        if expect != Some(data.len()) {
            return Err(Error::format(
                path,
                format!("tensor {name:?}: size does not match shape"),
            ));
        }
        if store.contains(&name) {
            return Err(Error::format(
                path,
                format!("tensor {name:?} appears in two shards"),
            ));
        }
        store.insert(RawTensor::new(
            name,
            dtype,
            shape,
            Storage::Mapped(mmap.clone()),
            offset,
            data.len(),
        ));
    }
    Ok(mmap.len())
}
