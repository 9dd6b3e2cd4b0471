//! GGUF reader (versions 2 and 3, little-endian), following the layout documented in
//! ggml's `docs/gguf.md`: header, metadata key/values, tensor infos, aligned tensor data.
//!
//! Nothing read from the file is trusted before it is checked: every count and length is
//! compared with the bytes that remain, so a corrupt header is an error naming the file and
//! the field, never a panic or a multi-gigabyte allocation.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrum_core::{DType, Error, Result};
use memmap2::Mmap;

use crate::tensor::{RawTensor, Storage, TensorStore};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
/// GGML tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

/// Writes a GGUF string: u64 length, then the bytes.
pub fn encode_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Value {
    /// GGUF's value type id.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// Appends the value's GGUF encoding (without its type id). Arrays must be homogeneous;
    /// an empty one is written as an array of strings (readers do not care which).
    pub fn encode(&self, out: &mut Vec<u8>) -> std::result::Result<(), String> {
        match self {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::String(s) => encode_str(out, s),
            Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Array(items) => {
                let elem = items.first().map_or(8, Value::type_id);
                if items.iter().any(|it| it.type_id() != elem) {
                    return Err("array elements of mixed types".into());
                }
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    it.encode(out)?;
                }
            }
        }
        Ok(())
    }

    /// Any integer type, when it fits in u64 (GGUF writers disagree on integer widths).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor's data sits, as the file describes it.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the contiguous dimension.
    pub dims: Vec<usize>,
    pub dtype: DType,
    /// Relative to the start of the data section.
    pub offset: usize,
    pub n_bytes: usize,
}

/// A metadata entry as kept after parsing. Arrays stay in the mapped file (checked, not
/// copied): a vocabulary's 50k–150k token and merge strings as `Value`s would take several
/// MB of heap for the life of the process, more than the runtime's own buffers.
#[derive(Debug)]
enum Entry {
    Value(Value),
    Array { elem: u32, count: usize, at: usize },
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    metadata: HashMap<String, Entry>,
    /// Keys in file order, for listing.
    pub keys: Vec<String>,
    pub tensor_infos: Vec<TensorInfo>,
    pub data_offset: usize,
    mmap: Arc<Mmap>,
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        Self::open_with(path, true)
    }

    /// Opens for reading the metadata only: the tensor data is not faulted in.
    pub fn inspect(path: impl AsRef<Path>) -> Result<GgufFile> {
        Self::open_with(path, false)
    }

    fn open_with(path: impl AsRef<Path>, populate: bool) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let mmap = crate::tensor::map_file(&file, populate).map_err(|e| Error::io(&path, e))?;
        let g = Self::parse(path, Arc::new(mmap))?;
        // The header (mostly the vocabulary) has been read; whoever needs it again (the
        // tokenizer) faults it back in, and a process that never does keeps ~2 MB less.
        crate::tensor::release_mapped(&g.mmap, 0..g.data_offset);
        Ok(g)
    }

    fn parse(path: PathBuf, mmap: Arc<Mmap>) -> Result<GgufFile> {
        let mut r = Reader {
            buf: &mmap[..],
            pos: 0,
            path: &path,
        };
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(Error::format(
                &path,
                format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"),
            ));
        }
        let version = r.u32("version")?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            return Err(Error::format(
                &path,
                "big-endian GGUF files are not supported",
            ));
        }
        if version != 2 && version != 3 {
            return Err(Error::format(
                &path,
                format!("GGUF version {version} is not supported (2 and 3 are)"),
            ));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // A key/value takes at least 12 bytes (key length + type), a tensor info at least 24.
        r.check_count(n_kv, 12, "metadata count")?;
        r.check_count(n_tensors, 24, "tensor count")?;

        let mut metadata = HashMap::with_capacity(n_kv as usize);
        let mut keys = Vec::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata value type")?;
            let entry = if ty == 9 {
                let (elem, count) = r.array_header(&key)?;
                let at = r.pos;
                for _ in 0..count {
                    r.skip_value(elem, &key)?;
                }
                Entry::Array { elem, count, at }
            } else {
                Entry::Value(r.value(ty, &key)?)
            };
            if metadata.insert(key.clone(), entry).is_some() {
                return Err(Error::format(
                    &path,
                    format!("duplicate metadata key {key:?}"),
                ));
            }
            keys.push(key);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Entry::Array { .. }) => {
                return Err(Error::format(&path, "general.alignment is an array"))
            }
            Some(Entry::Value(v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a as usize,
                _ => {
                    return Err(Error::format(
                        &path,
                        format!("general.alignment {v:?} is not a power of two"),
                    ))
                }
            },
        };

        let mut tensor_infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor dimension count")?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(Error::format(
                    &path,
                    format!("tensor {name:?} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            let mut numel: usize = 1;
            for _ in 0..n_dims {
                let d = r.u64("tensor dimension")?;
                let d = usize::try_from(d).ok().filter(|&d| d > 0).ok_or_else(|| {
                    Error::format(&path, format!("tensor {name:?} has a dimension of {d}"))
                })?;
                numel = numel.checked_mul(d).ok_or_else(|| {
                    Error::format(&path, format!("tensor {name:?}: element count overflows"))
                })?;
                dims.push(d);
            }
            let type_id = r.u32("tensor type")?;
            let dtype = DType::from_ggml_id(type_id).ok_or_else(|| {
                Error::format(
                    &path,
                    format!("tensor {name:?} has unknown or unsupported GGML type {type_id}"),
                )
            })?;
            if dims[0] % dtype.block_len() != 0 {
                return Err(Error::format(
                    &path,
                    format!(
                        "tensor {name:?}: row length {} is not a multiple of the {dtype} block ({})",
                        dims[0],
                        dtype.block_len()
                    ),
                ));
            }
            let n_bytes = dtype.bytes_for(numel).ok_or_else(|| {
                Error::format(&path, format!("tensor {name:?}: byte size overflows"))
            })?;
            let offset = r.u64("tensor offset")?;
            let offset = usize::try_from(offset)
                .map_err(|_| Error::format(&path, format!("tensor {name:?}: offset too large")))?;
            if offset % alignment != 0 {
                return Err(Error::format(
                    &path,
                    format!("tensor {name:?}: offset {offset} is not aligned to {alignment}"),
                ));
            }
            tensor_infos.push(TensorInfo {
                name,
                dims,
                dtype,
                offset,
                n_bytes,
            });
            let _ = i;
        }

        let data_offset = r.pos.div_ceil(alignment) * alignment;
        let file_len = mmap.len();
        let mut seen = std::collections::HashSet::with_capacity(tensor_infos.len());
        for t in &tensor_infos {
            if !seen.insert(t.name.as_str()) {
                return Err(Error::format(
                    &path,
                    format!("duplicate tensor {:?}", t.name),
                ));
            }
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(Error::format(
                        &path,
                        format!(
                            "tensor {:?} ({} bytes at offset {}) extends past the end of the file \
                             ({file_len} bytes): the file is truncated or corrupt",
                            t.name,
                            t.n_bytes,
                            data_offset.saturating_add(t.offset)
                        ),
                    ))
                }
            }
        }

        Ok(GgufFile {
            path,
            version,
            metadata,
            keys,
            tensor_infos,
            data_offset,
            mmap,
        })
    }

    /// Whether the metadata has `key` (of any type; nothing is decoded).
    pub fn contains(&self, key: &str) -> bool {
        self.metadata.contains_key(key)
    }

    /// A metadata value; arrays are decoded from the file on each call.
    pub fn get(&self, key: &str) -> Option<Cow<'_, Value>> {
        match self.metadata.get(key)? {
            Entry::Value(v) => Some(Cow::Borrowed(v)),
            &Entry::Array { elem, count, at } => {
                let items = self.array_items(count, at, |r| r.value(elem, key).ok())?;
                Some(Cow::Owned(Value::Array(items)))
            }
        }
    }

    fn scalar(&self, key: &str) -> Option<&Value> {
        match self.metadata.get(key)? {
            Entry::Value(v) => Some(v),
            Entry::Array { .. } => None,
        }
    }

    /// Decodes the `count` elements of an array checked at parse time, `None` as soon as
    /// `item` gives `None` (an element of another type than asked for, or a file changed
    /// under the mapping since).
    fn array_items<'s, T>(
        &'s self,
        count: usize,
        at: usize,
        mut item: impl FnMut(&mut Reader<'s>) -> Option<T>,
    ) -> Option<Vec<T>> {
        let mut r = Reader {
            buf: &self.mmap[..],
            pos: at,
            path: &self.path,
        };
        (0..count).map(|_| item(&mut r)).collect()
    }

    fn array_entry(&self, key: &str) -> Option<(u32, usize, usize)> {
        match *self.metadata.get(key)? {
            Entry::Array { elem, count, at } => Some((elem, count, at)),
            Entry::Value(_) => None,
        }
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.scalar(key).and_then(Value::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.scalar(key).and_then(Value::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.scalar(key).and_then(Value::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.scalar(key).and_then(Value::as_bool)
    }

    /// A required integer key, as an error naming the file and key when absent.
    pub fn require_usize(&self, key: &str) -> Result<usize> {
        self.get_u64(key)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| {
                Error::format(&self.path, format!("missing or invalid metadata {key:?}"))
            })
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.get_str(key).ok_or_else(|| {
            Error::format(&self.path, format!("missing or invalid metadata {key:?}"))
        })
    }

    /// A string array (e.g. `tokenizer.ggml.tokens`), borrowed from the mapped file; `None`
    /// if absent or of another type.
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        let (elem, count, at) = self.array_entry(key)?;
        if elem != 8 {
            return None;
        }
        self.array_items(count, at, |r| r.str_ref(key).ok())
    }

    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        let (elem, count, at) = self.array_entry(key)?;
        self.array_items(count, at, |r| {
            r.value(elem, key).ok()?.as_f64().map(|x| x as f32)
        })
    }

    pub fn get_bool_array(&self, key: &str) -> Option<Vec<bool>> {
        let (elem, count, at) = self.array_entry(key)?;
        self.array_items(count, at, |r| r.value(elem, key).ok()?.as_bool())
    }

    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        let (elem, count, at) = self.array_entry(key)?;
        self.array_items(count, at, |r| r.value(elem, key).ok()?.as_i64())
    }

    pub fn architecture(&self) -> Result<&str> {
        self.require_str("general.architecture")
    }

    /// All tensors, pointing into the mapping.
    pub fn tensors(&self) -> TensorStore {
        let mut store = TensorStore::default();
        for t in &self.tensor_infos {
            store.insert(RawTensor::new(
                t.name.clone(),
                t.dtype,
                t.dims.iter().rev().copied().collect(),
                Storage::Mapped(self.mmap.clone()),
                self.data_offset + t.offset,
                t.n_bytes,
            ));
        }
        store
    }

    pub fn file_size(&self) -> usize {
        self.mmap.len()
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::format(
                self.path,
                format!(
                    "truncated file: {what} needs {n} bytes at offset {}, only {} remain",
                    self.pos,
                    self.remaining()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Rejects a count of items that could not possibly fit in the rest of the file, before
    /// anything is allocated for them.
    fn check_count(&self, count: u64, min_item_bytes: u64, what: &str) -> Result<()> {
        if count.saturating_mul(min_item_bytes) > self.remaining() as u64 {
            return Err(Error::format(
                self.path,
                format!(
                    "{what} {count} is impossible: the {} bytes left cannot hold that many",
                    self.remaining()
                ),
            ));
        }
        Ok(())
    }

    fn str_ref(&mut self, what: &str) -> Result<&'a str> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(Error::format(
                self.path,
                format!(
                    "{what}: string length {len} at offset {} exceeds the {} bytes left",
                    self.pos - 8,
                    self.remaining()
                ),
            ));
        }
        let bytes = self.take(len as usize, what)?;
        std::str::from_utf8(bytes)
            .map_err(|_| Error::format(self.path, format!("{what}: string is not valid UTF-8")))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        self.str_ref(what).map(str::to_owned)
    }

    /// An array's element type and length, the length checked against the bytes left.
    fn array_header(&mut self, key: &str) -> Result<(u32, usize)> {
        let elem_ty = self.u32(key)?;
        let count = self.u64(key)?;
        let min = match elem_ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            _ => 1,
        };
        self.check_count(count, min, &format!("metadata {key:?}: array length"))?;
        Ok((elem_ty, count as usize))
    }

    /// Checks one array element and steps over it without allocating.
    fn skip_value(&mut self, ty: u32, key: &str) -> Result<()> {
        match ty {
            8 => self.str_ref(key).map(drop),
            _ => self.value(ty, key).map(drop),
        }
    }

    fn value(&mut self, ty: u32, key: &str) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(Error::format(
                        self.path,
                        format!("metadata {key:?}: bool byte {b} is neither 0 nor 1"),
                    ))
                }
            },
            8 => Value::String(self.string(key)?),
            // Top-level arrays are read by `GgufFile::parse`; here only as an element.
            9 => {
                return Err(Error::format(
                    self.path,
                    format!("metadata {key:?}: nested arrays are not supported"),
                ))
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            _ => {
                return Err(Error::format(
                    self.path,
                    format!("metadata {key:?}: unknown value type {ty}"),
                ))
            }
        })
    }
}

/// Builds GGUF files in memory; tests use it to make valid and deliberately broken files.
pub mod writer {
    use super::{encode_str as put_str, Value};

    /// A tensor to write: name, GGML dims (contiguous first), GGML type id, raw bytes.
    pub struct WTensor<'a> {
        pub name: &'a str,
        pub dims: Vec<u64>,
        pub ggml_type: u32,
        pub data: &'a [u8],
    }

    /// Serialises a version-3 GGUF with 32-byte alignment.
    pub fn write(metadata: &[(&str, Value)], tensors: &[WTensor]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            v.encode(&mut out)
                .expect("test metadata arrays are homogeneous");
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in tensors {
            put_str(&mut out, t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset += (t.data.len() as u64).div_ceil(32) * 32;
        }
        while out.len() % 32 != 0 {
            out.push(0);
        }
        let base = out.len();
        for (t, off) in tensors.iter().zip(offsets) {
            out.resize(base + off as usize, 0);
            out.extend_from_slice(t.data);
        }
        out
    }
}
