//! A tensor as it sits in a model file: format, shape and a window onto mapped bytes.

use std::collections::HashMap;
use std::sync::Arc;

use ferrum_core::DType;
use memmap2::Mmap;

/// Maps a model file read-only, asking the kernel to fault every page in up front
/// (`MADV_POPULATE_READ`): the first decode steps of a MoE model otherwise pay a page fault
/// for every expert page they touch for the first time, which measured as most of their
/// time. Without `populate`, pages are read only when touched: enough to read a header.
pub(crate) fn map_file(file: &std::fs::File, populate: bool) -> std::io::Result<Mmap> {
    // SAFETY: read-only mapping; like every mmap-based loader we assume the file is not
    // truncated or rewritten by another process while it is mapped.
    let map = unsafe { memmap2::MmapOptions::new().map(file)? };
    #[cfg(target_os = "linux")]
    {
        // Page-sized mappings only, set before anything is mapped. Weights that are
        // repacked at load have their pages dropped (`release_pages`); with the page cache
        // in large folios, a 2 MB mapping would be dropped or faulted back whole, neighbours
        // included. Advice is a hint: if refused, memory use is higher, nothing else changes.
        let _ = map.advise(memmap2::Advice::NoHugePage);
        if populate && map.advise(memmap2::Advice::PopulateRead).is_ok() {
            return Ok(map);
        }
    }
    if populate {
        // Kernels without MADV_POPULATE_READ (before 5.14): touch a byte per page.
        let mut sum = 0u8;
        for b in map.iter().step_by(4096) {
            sum = sum.wrapping_add(*b);
        }
        std::hint::black_box(sum);
    }
    Ok(map)
}

/// Where a tensor's bytes live. Loaders map files; a few callers (tests, converters) own
/// their bytes instead.
#[derive(Clone)]
pub enum Storage {
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

#[derive(Clone)]
pub struct RawTensor {
    pub name: String,
    pub dtype: DType,
    /// Outermost dimension first (the PyTorch order): a weight matrix is `[rows, cols]`,
    /// and `cols` is the contiguous one.
    pub shape: Vec<usize>,
    storage: Storage,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for RawTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.dtype, self.shape)
    }
}

impl RawTensor {
    /// The caller guarantees `offset + len` lies inside `storage`; loaders check it against
    /// the file before building one.
    pub(crate) fn new(
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        storage: Storage,
        offset: usize,
        len: usize,
    ) -> Self {
        debug_assert!(offset + len <= storage.bytes().len());
        RawTensor {
            name,
            dtype,
            shape,
            storage,
            offset,
            len,
        }
    }

    /// A tensor over bytes the caller owns; `None` if the byte count does not match.
    pub fn from_bytes(name: &str, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Option<Self> {
        let n: usize = shape.iter().product();
        if dtype.bytes_for(n)? != bytes.len() {
            return None;
        }
        let len = bytes.len();
        Some(RawTensor::new(
            name.to_string(),
            dtype,
            shape,
            Storage::Owned(Arc::new(bytes)),
            0,
            len,
        ))
    }

    /// Rows `[first, first + count)` of the tensor seen as a matrix of `row_len()` columns:
    /// one expert's slab of a stacked expert tensor, without copying. `None` if out of range.
    pub fn rows(&self, first: usize, count: usize) -> Option<RawTensor> {
        let cols = self.row_len();
        let row_bytes = self.dtype.bytes_for(cols)?;
        if first.checked_add(count)? > self.n_rows() {
            return None;
        }
        Some(RawTensor {
            name: format!("{}[rows {first}..{}]", self.name, first + count),
            dtype: self.dtype,
            shape: vec![count, cols],
            storage: self.storage.clone(),
            offset: self.offset + first * row_bytes,
            len: count * row_bytes,
        })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.storage.bytes()[self.offset..self.offset + self.len]
    }

    /// Lets the OS drop the pages of bytes `range` of this tensor from memory, for a caller
    /// that keeps its own copy of them (a repacked weight). Touching them again reads them
    /// back from the file, so [`bytes`](Self::bytes) stays valid; only resident memory
    /// changes. Only pages wholly inside the range are dropped. A no-op for owned bytes.
    pub fn release_pages(&self, range: std::ops::Range<usize>) {
        if let Storage::Mapped(m) = &self.storage {
            let end = range.end.min(self.len);
            release_mapped(m, self.offset + range.start..self.offset + end);
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Contiguous row length (the last dimension).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    pub fn n_rows(&self) -> usize {
        self.numel() / self.row_len().max(1)
    }
}

/// Lets the OS drop the pages wholly inside bytes `range` of a read-only file mapping; they
/// are read back from the file if touched again.
pub(crate) fn release_mapped(m: &Mmap, range: std::ops::Range<usize>) {
    const PAGE: usize = 4096;
    let base = m.as_ptr() as usize;
    let end = range.end.min(m.len());
    // Page-aligned addresses inside the range (the mapping itself starts on a page).
    let first = (base + range.start).next_multiple_of(PAGE) - base;
    let last = (base + end) / PAGE * PAGE - base;
    if first >= last {
        return;
    }
    // SAFETY: the mapping is read-only and file-backed, and nothing ever writes through it:
    // a dropped page is re-read from the file unchanged on next access. Failure (not
    // supported) only means the pages stay resident.
    let _ = unsafe {
        m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, last - first)
    };
}

/// Every tensor of a model, by the name its file gives it.
#[derive(Default)]
pub struct TensorStore {
    pub tensors: HashMap<String, RawTensor>,
}

impl TensorStore {
    pub fn get(&self, name: &str) -> Option<&RawTensor> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn insert(&mut self, t: RawTensor) {
        self.tensors.insert(t.name.clone(), t);
    }

    /// Sum of stored bytes, for the load summary.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.len).sum()
    }

    pub fn total_params(&self) -> usize {
        self.tensors.values().map(|t| t.numel()).sum()
    }
}
