//! The Vulkan backend (issue 41; docs/gpu.md): the [`Backend`] ops as compute shaders over
//! raw Vulkan (`ash`, the loader opened at run time), weights in device memory in their file
//! formats and dequantised inside the kernels, activations and the KV cache in f32. Shaders
//! are GLSL in `shaders/`, compiled to SPIR-V by `scripts/vulkan/build-shaders.sh` into
//! `shaders/spv/` (committed; CI checks it is current) and embedded here.
//!
//! Every op records a dispatch into the forward step's one command buffer (`device.rs`);
//! [`Backend::sync`] and reads submit it. The recurrent ops of the hybrid models are not on
//! this device yet: [`Backend::recurrent_ops`] says so and the model loader refuses them.

mod device;

pub use device::{list as list_devices, DeviceInfo};

use crate::{
    Activation, AttentionParams, Backend, DeltaParams, KvShape, KvTable, RopeLayout, RopeParams,
    Rows, StateSeq,
};
use device::{bytes_of, Bind, Context, RawBuf};
use ferrum_core::{DType, Error, Result};
use ferrum_loader::RawTensor;
use std::sync::Arc;

macro_rules! spv {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_bytes!(concat!("shaders/spv/", $name, ".spv")))),*]
    };
}

/// Shaders by index: each weight format's one-token matmul, matmul of several tokens and row
/// gather (format `i` at `3i`, `3i + 1`, `3i + 2`, in the order of [`FORMATS`]), then the
/// rest (`Op`).
static SHADERS: &[(&str, &[u8])] = spv![
    "matvec_f32",
    "matmul_f32",
    "get_rows_f32",
    "matvec_f16",
    "matmul_f16",
    "get_rows_f16",
    "matvec_bf16",
    "matmul_bf16",
    "get_rows_bf16",
    "matvec_q4_0",
    "matmul_q4_0",
    "get_rows_q4_0",
    "matvec_q4_1",
    "matmul_q4_1",
    "get_rows_q4_1",
    "matvec_q5_0",
    "matmul_q5_0",
    "get_rows_q5_0",
    "matvec_q5_1",
    "matmul_q5_1",
    "get_rows_q5_1",
    "matvec_q8_0",
    "matmul_q8_0",
    "get_rows_q8_0",
    "matvec_q2_k",
    "matmul_q2_k",
    "get_rows_q2_k",
    "matvec_q3_k",
    "matmul_q3_k",
    "get_rows_q3_k",
    "matvec_q4_k",
    "matmul_q4_k",
    "get_rows_q4_k",
    "matvec_q5_k",
    "matmul_q5_k",
    "get_rows_q5_k",
    "matvec_q6_k",
    "matmul_q6_k",
    "get_rows_q6_k",
    "matvec_mxfp4",
    "matmul_mxfp4",
    "get_rows_mxfp4",
    "rms_norm",
    "rope",
    "copy",
    "rows_index",
    "scatter_add",
    "eltwise",
    "glu",
    "attention",
];

/// The weight formats the kernels read, in `FMT` order (shaders/dequant.glsl).
const FORMATS: [DType; 14] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Mxfp4,
];

#[derive(Clone, Copy)]
enum Op {
    RmsNorm = 42,
    Rope,
    Copy,
    RowsIndex,
    ScatterAdd,
    Eltwise,
    Glu,
    Attention,
}

/// The largest head the attention shader holds (its query in shared memory).
const MAX_HEAD_DIM: usize = 512;

/// f32 activations in device memory. `raw` is `None` only after a failed allocation, whose
/// error the context keeps (ops on it are skipped and `sync` reports it).
pub struct VkBuf {
    raw: Option<Arc<RawBuf>>,
    len: usize,
}

/// A tensor in device memory in its file format, `rows × cols`, in one or more parts: a
/// matrix larger than the device's largest storage binding is split by rows (whole expert
/// matrices for stacked experts), each part a buffer of its own, and an op runs once per
/// part. Expert views share their stacked tensor's buffers. Vectors (norms, biases) are f32.
pub struct VkWeight {
    parts: Vec<Part>,
    rows: usize,
    cols: usize,
    format: usize,
    row_bytes: usize,
}

/// Rows `first .. first + rows` of a weight, from byte `offset` of `raw`.
#[derive(Clone)]
struct Part {
    raw: Arc<RawBuf>,
    offset: u64,
    first: usize,
    rows: usize,
}

impl VkWeight {
    /// A vector's one buffer and its offset in floats.
    fn vector(&self) -> (&Arc<RawBuf>, u32) {
        (&self.parts[0].raw, (self.parts[0].offset / 4) as u32)
    }
}

/// One layer's keys or values: f32 rows, one per cache slot.
pub struct VkKv {
    raw: Option<Arc<RawBuf>>,
    shape: KvShape,
}

pub struct VulkanBackend {
    ctx: Context,
    /// The most bytes one part of a weight takes: the device's largest storage binding, or
    /// less in tests (`with_weight_parts_of`).
    part_bytes: usize,
}

/// The first Vulkan device, for tests: `None` with the reason printed where there is none,
/// unless `FERRUM_REQUIRE_VULKAN=1` (scripts/test.sh sets it where it installed lavapipe),
/// when a missing device panics, so a broken driver fails the tests instead of skipping them.
pub fn test_device() -> Option<VulkanBackend> {
    match VulkanBackend::new(None) {
        Ok(be) => {
            eprintln!("Vulkan device: {}", be.name());
            Some(be)
        }
        Err(e) if std::env::var("FERRUM_REQUIRE_VULKAN").as_deref() == Ok("1") => {
            panic!("FERRUM_REQUIRE_VULKAN=1 but {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Splits `n` workgroups over x and y (x is at most 65535, every device's minimum limit).
fn grid(n: usize) -> ([u32; 3], u32) {
    let x = n.clamp(1, 65535);
    ([x as u32, n.div_ceil(x) as u32, 1], x as u32)
}

fn u(v: usize) -> u32 {
    v as u32
}

impl VulkanBackend {
    /// Opens Vulkan device `index` (`None`: the first GPU, else the first device).
    pub fn new(index: Option<usize>) -> Result<VulkanBackend> {
        let ctx = Context::new(index, SHADERS)?;
        Ok(VulkanBackend {
            part_bytes: ctx.info().max_binding as usize,
            ctx,
        })
    }

    /// Splits weights into parts of at most `bytes` (tests: the multi-part paths on a device
    /// whose bindings are large).
    pub fn with_weight_parts_of(mut self, bytes: usize) -> VulkanBackend {
        self.part_bytes = bytes.min(self.ctx.info().max_binding as usize);
        self
    }

    pub fn info(&self) -> &DeviceInfo {
        self.ctx.info()
    }

    fn buf<'a>(&self, b: &'a VkBuf) -> Option<&'a Arc<RawBuf>> {
        if b.raw.is_none() {
            self.ctx.fail("a buffer whose allocation failed was used");
        }
        b.raw.as_ref()
    }

    fn zeroed(&self, bytes: u64) -> Option<Arc<RawBuf>> {
        match self.ctx.alloc(bytes) {
            Ok(b) => {
                self.ctx.zero(&b);
                Some(b)
            }
            Err(e) => {
                self.ctx.fail(e);
                None
            }
        }
    }

    /// `bytes` (`rows` rows of `row_bytes`) in parts of at most the device's largest binding,
    /// each a whole number of `unit` rows.
    fn upload_weight(
        &self,
        t: &RawTensor,
        bytes: &[u8],
        rows: usize,
        row_bytes: usize,
        unit: usize,
    ) -> Result<Vec<Part>> {
        let max = self.part_bytes;
        let per = (max / row_bytes.max(1)) / unit * unit;
        if per == 0 {
            return Err(Error::Device(format!(
                "tensor {}: {} bytes of rows in one piece, more than {} binds ({max})",
                t.name,
                unit * row_bytes,
                self.ctx.info().name
            )));
        }
        let mut parts = Vec::new();
        let mut first = 0;
        while first < rows.max(1) {
            let n = per.min(rows - first).max(usize::from(rows == 0));
            let chunk = &bytes[first * row_bytes..(first + n) * row_bytes];
            let raw = self.ctx.alloc(chunk.len() as u64).map_err(|e| {
                Error::Device(format!("tensor {} ({} bytes): {e}", t.name, bytes.len()))
            })?;
            self.ctx.upload(&raw, 0, chunk);
            parts.push(Part {
                raw,
                offset: 0,
                first,
                rows: n,
            });
            first += n.max(1);
        }
        Ok(parts)
    }

    /// One dispatch over two strided views of one op's usual shape (`count` rows of
    /// `width`): element-wise ops, copies, the GLU.
    #[allow(clippy::too_many_arguments)]
    fn rows_op(
        &self,
        op: Op,
        a: &Arc<RawBuf>,
        av: Rows,
        b: &Arc<RawBuf>,
        bv: Rows,
        width: usize,
        extra: &[u32],
        more: &[Bind],
    ) {
        let (g, gx) = grid((av.count * width).div_ceil(64));
        let mut push = vec![
            u(av.offset),
            u(av.stride),
            u(bv.offset),
            u(bv.stride),
            u(width),
            u(av.count),
            gx,
        ];
        push.extend_from_slice(extra);
        let mut binds = vec![Bind::Buf(a), Bind::Buf(b)];
        binds.extend_from_slice(more);
        self.ctx.dispatch(op as usize, &binds, &push, g);
    }

    fn eltwise(&self, x: &VkBuf, xv: Rows, y: Option<(&VkBuf, Rows)>, op: u32, value: f32) {
        let Some(xb) = self.buf(x) else { return };
        let (yb, yv) = match y {
            Some((y, yv)) => match self.buf(y) {
                Some(b) => (b, yv),
                None => return,
            },
            None => (xb, xv),
        };
        if xv.count == 0 {
            return;
        }
        // Push order: x view, y view, width, count, grid, op, value, y's width.
        let (g, gx) = grid((xv.count * xv.width()).div_ceil(64));
        let push = [
            u(xv.offset),
            u(xv.stride),
            u(yv.offset),
            u(yv.stride),
            u(xv.width()),
            u(xv.count),
            gx,
            op,
            value.to_bits(),
            u(yv.width()),
        ];
        self.ctx.dispatch(
            Op::Eltwise as usize,
            &[Bind::Buf(xb), Bind::Buf(yb)],
            &push,
            g,
        );
    }

    /// RMSNorm of `xv` into `ov`, after `x += y` where `add` names y's view.
    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        x: &Arc<RawBuf>,
        xv: Rows,
        w: &VkWeight,
        eps: f32,
        o: &Arc<RawBuf>,
        ov: Rows,
        add: Option<(&Arc<RawBuf>, Rows)>,
    ) {
        assert_eq!(w.cols, xv.head_dim, "rms_norm: weight length");
        let n = xv.count * xv.heads;
        if n == 0 {
            return;
        }
        let (g, gx) = grid(n);
        let push = [
            u(xv.offset),
            u(xv.stride),
            u(ov.offset),
            u(ov.stride),
            u(xv.heads),
            u(xv.head_dim),
            w.vector().1,
            eps.to_bits(),
            gx,
            u(xv.count),
            u32::from(add.is_some()),
            add.map_or(0, |(_, yv)| u(yv.offset)),
            add.map_or(0, |(_, yv)| u(yv.stride)),
        ];
        let y = add.map_or(x, |(y, _)| y);
        self.ctx.dispatch(
            Op::RmsNorm as usize,
            &[
                Bind::Buf(x),
                Bind::Buf(w.vector().0),
                Bind::Buf(o),
                Bind::Buf(y),
            ],
            &push,
            g,
        );
    }
}

impl Backend for VulkanBackend {
    type Buf = VkBuf;
    type Weight = VkWeight;
    type KvBuf = VkKv;

    fn name(&self) -> String {
        let i = self.ctx.info();
        format!("vulkan:{} ({}, {})", i.index, i.name, i.driver)
    }

    fn alloc(&self, len: usize) -> VkBuf {
        VkBuf {
            raw: self.zeroed(4 * len as u64),
            len,
        }
    }

    fn buf_len(&self, buf: &VkBuf) -> usize {
        buf.len
    }

    fn write(&self, buf: &mut VkBuf, offset: usize, data: &[f32]) {
        assert!(offset + data.len() <= buf.len, "write past the buffer");
        if let Some(b) = self.buf(buf) {
            self.ctx.upload(b, 4 * offset as u64, bytes_of(data));
        }
    }

    fn read(&self, buf: &VkBuf, offset: usize, out: &mut [f32]) {
        assert!(offset + out.len() <= buf.len, "read past the buffer");
        if let Some(b) = self.buf(buf) {
            // SAFETY: f32 has no invalid bit patterns; the slice is reinterpreted in place.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, 4 * out.len())
            };
            self.ctx.download(b, 4 * offset as u64, bytes);
        }
    }

    fn sync(&self) -> Result<()> {
        self.ctx.check()
    }

    fn recurrent_ops(&self) -> bool {
        false
    }

    fn reserve(&self, weight_bytes: u64) -> Result<()> {
        let i = self.ctx.info();
        if weight_bytes > i.memory {
            return Err(Error::Device(format!(
                "the model's weights take {:.2} GB, more than {}'s {:.2} GB of memory; run it \
                 on the CPU (--device cpu) or pick a smaller quantisation",
                weight_bytes as f64 / 1e9,
                i.name,
                i.memory as f64 / 1e9
            )));
        }
        Ok(())
    }

    fn load_weight(&self, t: &RawTensor) -> Result<VkWeight> {
        let cols = t.row_len();
        let rows = t.n_rows();
        if t.shape.len() == 1 {
            let mut v = vec![0f32; t.numel()];
            if !crate::cpu::quant::dequantize(t.dtype, t.bytes(), &mut v) {
                return Err(Error::Weights(format!("tensor {}: cannot convert", t.name)));
            }
            return Ok(VkWeight {
                parts: self.upload_weight(t, bytes_of(&v), 1, 4 * v.len(), 1)?,
                rows: 1,
                cols: v.len(),
                format: 0,
                row_bytes: 4 * v.len(),
            });
        }
        let format = FORMATS.iter().position(|&f| f == t.dtype).ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor {}: no Vulkan kernel for {} (run on the CPU: --device cpu)",
                t.name, t.dtype
            ))
        })?;
        let row_bytes = t.dtype.bytes_for(cols).ok_or_else(|| {
            Error::Weights(format!(
                "tensor {}: row length {cols} is not a whole number of {} blocks",
                t.name, t.dtype
            ))
        })?;
        // A stacked expert tensor `[E, F, H]` splits only between experts.
        let unit = match t.shape.len() {
            0..=2 => 1,
            n => t.shape[n - 2],
        };
        Ok(VkWeight {
            parts: self.upload_weight(t, t.bytes(), rows, row_bytes, unit)?,
            rows,
            cols,
            format,
            row_bytes,
        })
    }

    fn weight_shape(&self, w: &VkWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn embed(&self, table: &VkWeight, tokens: &[u32], out: &mut VkBuf, ov: Rows) {
        assert_eq!(ov.width(), table.cols);
        assert_eq!(ov.count, tokens.len());
        assert!(
            tokens.iter().all(|&t| (t as usize) < table.rows),
            "token id past the table"
        );
        let Some(o) = self.buf(out) else { return };
        for part in &table.parts {
            // (output row, row in this part) of each token the part holds.
            let ids: Vec<u32> = tokens
                .iter()
                .enumerate()
                .filter(|(_, &id)| (part.first..part.first + part.rows).contains(&(id as usize)))
                .flat_map(|(t, &id)| [u(t), id - u(part.first)])
                .collect();
            if ids.is_empty() {
                continue;
            }
            let push = [
                part.offset as u32,
                u(table.row_bytes),
                u(table.cols),
                u(ov.offset),
                u(ov.stride),
            ];
            self.ctx.dispatch(
                3 * table.format + 2,
                &[
                    Bind::Buf(&part.raw),
                    Bind::Bytes(bytes_of(&ids)),
                    Bind::Buf(o),
                ],
                &push,
                [u(ids.len() / 2), 1, 1],
            );
        }
    }

    fn matmul(
        &self,
        x: &VkBuf,
        xv: Rows,
        w: &VkWeight,
        bias: Option<&VkWeight>,
        out: &mut VkBuf,
        ov: Rows,
    ) {
        assert_eq!(xv.width(), w.cols, "matmul: input width");
        assert_eq!(ov.width(), w.rows, "matmul: output width");
        assert_eq!(xv.count, ov.count);
        assert!(xv.end() <= x.len && ov.end() <= out.len);
        let (Some(xb), Some(ob)) = (self.buf(x), self.buf(out)) else {
            return;
        };
        let shader = 3 * w.format + usize::from(xv.count > 1);
        let (bias_buf, bias_off) = bias.map_or((xb, 0), |b| b.vector());
        for part in &w.parts {
            // 64 / tpr rows a workgroup; one token, or eight at a time.
            let (g, gx) = grid(part.rows.div_ceil(64 / self.ctx.tpr as usize));
            let g = [g[0], g[1], u(xv.count.div_ceil(8))];
            let push = [
                part.offset as u32,
                u(w.row_bytes),
                u(part.rows),
                u(w.cols),
                u(xv.count),
                u(xv.offset),
                u(xv.stride),
                u(ov.offset + part.first),
                u(ov.stride),
                u32::from(bias.is_some()),
                bias_off + u(part.first),
                gx,
            ];
            self.ctx.dispatch(
                shader,
                &[
                    Bind::Buf(&part.raw),
                    Bind::Buf(xb),
                    Bind::Buf(ob),
                    Bind::Buf(bias_buf),
                ],
                &push,
                g,
            );
        }
    }

    fn rms_norm(
        &self,
        x: &VkBuf,
        xv: Rows,
        weight: &VkWeight,
        eps: f32,
        out: &mut VkBuf,
        ov: Rows,
    ) {
        if let (Some(xb), Some(ob)) = (self.buf(x), self.buf(out)) {
            self.norm(xb, xv, weight, eps, ob, ov, None);
        }
    }

    fn rms_norm_inplace(&self, x: &mut VkBuf, xv: Rows, weight: &VkWeight, eps: f32) {
        if let Some(xb) = self.buf(x) {
            self.norm(xb, xv, weight, eps, xb, xv, None);
        }
    }

    fn rope(&self, x: &mut VkBuf, xv: Rows, positions: &[u32], p: RopeParams) {
        assert_eq!(positions.len(), xv.count);
        let half = p.inv_freq.len();
        assert!(2 * half <= xv.head_dim);
        let Some(xb) = self.buf(x) else { return };
        if xv.count == 0 || half == 0 {
            return;
        }
        let (cos, sin) = crate::cpu::rope_tables(positions, &p);
        let mut cs = cos;
        cs.extend_from_slice(&sin);
        let (g, gx) = grid((xv.count * xv.heads * half).div_ceil(64));
        let push = [
            u(xv.offset),
            u(xv.stride),
            u(xv.heads),
            u(xv.head_dim),
            u(half),
            u32::from(p.layout == RopeLayout::Interleaved),
            u(xv.count),
            gx,
        ];
        self.ctx.dispatch(
            Op::Rope as usize,
            &[Bind::Buf(xb), Bind::Bytes(bytes_of(&cs))],
            &push,
            g,
        );
    }

    fn copy_rows(&self, src: &VkBuf, sv: Rows, dst: &mut VkBuf, dv: Rows) {
        assert_eq!(sv.width(), dv.width());
        assert_eq!(sv.count, dv.count);
        if let (Some(s), Some(d)) = (self.buf(src), self.buf(dst)) {
            self.rows_op(Op::Copy, s, sv, d, dv, sv.width(), &[], &[]);
        }
    }

    fn alloc_kv(&self, shape: KvShape) -> VkKv {
        VkKv {
            raw: self.zeroed(4 * (shape.rows() * shape.width()) as u64),
            shape,
        }
    }

    fn kv_row_bytes(&self, width: usize) -> usize {
        4 * width
    }

    fn write_kv(&self, src: &VkBuf, sv: Rows, dst: &mut VkKv, table: KvTable, first_pos: usize) {
        assert_eq!(sv.width(), dst.shape.width());
        assert_eq!(table.block_size, dst.shape.block_size);
        let slots: Vec<u32> = (0..sv.count)
            .map(|t| match table.slot(first_pos + t) {
                Some(s) if s < dst.shape.rows() => s as u32,
                _ => panic!("write_kv: position {} has no cache slot", first_pos + t),
            })
            .collect();
        let (Some(s), Some(d)) = (self.buf(src), dst.raw.as_ref()) else {
            return;
        };
        let dv = Rows::dense(sv.count, sv.width());
        self.rows_op(
            Op::RowsIndex,
            s,
            sv,
            d,
            dv,
            sv.width(),
            &[0],
            &[Bind::Bytes(bytes_of(&slots))],
        );
    }

    fn attention(
        &self,
        q: &VkBuf,
        qv: Rows,
        k_cache: &VkKv,
        v_cache: &VkKv,
        seqs: &[crate::AttnSeq],
        out: &mut VkBuf,
        ov: Rows,
        p: AttentionParams,
    ) {
        let hd = qv.head_dim;
        assert!(
            hd <= MAX_HEAD_DIM,
            "attention: head size {hd} over {MAX_HEAD_DIM}"
        );
        assert_eq!(k_cache.shape.head_dim, hd);
        assert_eq!(k_cache.shape.heads, p.n_kv_heads);
        assert!(qv.heads.is_multiple_of(p.n_kv_heads));
        assert_eq!(seqs.iter().map(|s| s.rows).sum::<usize>(), qv.count);
        assert!(p.sinks.is_none_or(|s| s.len() == qv.heads));
        let bs = k_cache.shape.block_size;
        let mut rows = Vec::with_capacity(2 * qv.count);
        let mut tables = Vec::new();
        for s in seqs {
            assert_eq!(s.table.block_size, bs);
            assert!(
                s.first_pos + s.rows <= s.table.capacity(),
                "attention past the table"
            );
            let at = u(tables.len());
            tables.extend_from_slice(s.table.blocks);
            for t in 0..s.rows {
                rows.extend_from_slice(&[u(s.first_pos + t), at]);
            }
        }
        let (Some(qb), Some(ob), Some(kb), Some(vb)) = (
            self.buf(q),
            self.buf(out),
            k_cache.raw.as_ref(),
            v_cache.raw.as_ref(),
        ) else {
            return;
        };
        if qv.count == 0 {
            return;
        }
        let (g, gx) = grid(qv.count * qv.heads);
        let push = [
            u(qv.offset),
            u(qv.stride),
            u(ov.offset),
            u(ov.stride),
            u(qv.heads),
            u(p.n_kv_heads),
            u(hd),
            u(bs),
            p.scale.to_bits(),
            u(p.window.unwrap_or(0)),
            p.softcap.unwrap_or(0.0).to_bits(),
            u32::from(p.sinks.is_some()),
            u(qv.count),
            gx,
        ];
        let sinks = p.sinks.unwrap_or(&[0.0]);
        self.ctx.dispatch(
            Op::Attention as usize,
            &[
                Bind::Buf(qb),
                Bind::Buf(kb),
                Bind::Buf(vb),
                Bind::Buf(ob),
                Bind::Bytes(bytes_of(&rows)),
                Bind::Bytes(bytes_of(&tables)),
                Bind::Bytes(bytes_of(sinks)),
            ],
            &push,
            g,
        );
    }

    fn glu(&self, x: &VkBuf, xv: Rows, out: &mut VkBuf, ov: Rows, act: Activation) {
        let f = ov.width();
        assert_eq!(xv.width(), 2 * f);
        assert_eq!(xv.count, ov.count);
        let (code, alpha, limit) = match act {
            Activation::Silu => (0, 0.0, 0.0),
            Activation::GeluTanh => (1, 0.0, 0.0),
            Activation::ClampedSwiglu { alpha, limit } => (2, alpha, limit),
            Activation::GeluErf => (3, 0.0, 0.0),
        };
        if let (Some(s), Some(d)) = (self.buf(x), self.buf(out)) {
            let extra = [code, f32::to_bits(alpha), f32::to_bits(limit)];
            self.rows_op(Op::Glu, s, xv, d, ov, f, &extra, &[]);
        }
    }

    fn add_inplace(&self, x: &mut VkBuf, xv: Rows, y: &VkBuf, yv: Rows) {
        assert_eq!(xv.width(), yv.width());
        self.eltwise(x, xv, Some((y, yv)), 2, 0.0);
    }

    fn scale_inplace(&self, x: &mut VkBuf, xv: Rows, s: f32) {
        self.eltwise(x, xv, None, 1, s);
    }

    fn fill(&self, x: &mut VkBuf, xv: Rows, value: f32) {
        self.eltwise(x, xv, None, 0, value);
    }

    fn gather_rows(&self, src: &VkBuf, sv: Rows, rows: &[u32], dst: &mut VkBuf, dv: Rows) {
        assert_eq!(rows.len(), dv.count);
        assert!(rows.iter().all(|&r| (r as usize) < sv.count));
        if let (Some(s), Some(d), false) = (self.buf(src), self.buf(dst), rows.is_empty()) {
            // rows_op walks the first view's rows: one per index (mode 1 reads src row idx[t]).
            let sv = Rows {
                count: rows.len(),
                ..sv
            };
            let idx = [Bind::Bytes(bytes_of(rows))];
            self.rows_op(Op::RowsIndex, s, sv, d, dv, dv.width(), &[1], &idx);
        }
    }

    fn scatter_add_rows(
        &self,
        src: &VkBuf,
        sv: Rows,
        rows: &[u32],
        scales: &[f32],
        dst: &mut VkBuf,
        dv: Rows,
    ) {
        assert_eq!(rows.len(), sv.count);
        assert_eq!(scales.len(), sv.count);
        assert!(rows.iter().all(|&r| (r as usize) < dv.count));
        if let (Some(s), Some(d), false) = (self.buf(src), self.buf(dst), rows.is_empty()) {
            let push = [
                u(sv.offset),
                u(sv.stride),
                u(dv.offset),
                u(dv.stride),
                u(sv.width()),
                u(sv.count),
            ];
            self.ctx.dispatch(
                Op::ScatterAdd as usize,
                &[
                    Bind::Buf(s),
                    Bind::Buf(d),
                    Bind::Bytes(bytes_of(rows)),
                    Bind::Bytes(bytes_of(scales)),
                ],
                &push,
                [u(sv.width().div_ceil(64)), 1, 1],
            );
        }
    }

    fn weight_rows(&self, w: &VkWeight, first: usize, count: usize) -> Result<VkWeight> {
        if first + count > w.rows {
            return Err(Error::Weights(format!(
                "rows {first}..{} of a {}-row tensor",
                first + count,
                w.rows
            )));
        }
        let end = first + count;
        let parts = w
            .parts
            .iter()
            .filter(|p| p.first < end && first < p.first + p.rows)
            .map(|p| {
                let lo = first.max(p.first);
                Part {
                    raw: p.raw.clone(),
                    offset: p.offset + ((lo - p.first) * w.row_bytes) as u64,
                    first: lo - first,
                    rows: end.min(p.first + p.rows) - lo,
                }
            })
            .collect();
        Ok(VkWeight {
            parts,
            rows: count,
            cols: w.cols,
            format: w.format,
            row_bytes: w.row_bytes,
        })
    }

    fn sigmoid_mul(&self, x: &mut VkBuf, xv: Rows, g: &VkBuf, gv: Rows) {
        assert!(gv.width() == 1 || gv.width() == xv.width());
        self.eltwise(x, xv, Some((g, gv)), 3, 0.0);
    }

    /// One dispatch: each row's residual add and its norm in one workgroup.
    fn add_rms_norm(
        &self,
        x: &mut VkBuf,
        xv: Rows,
        y: &VkBuf,
        yv: Rows,
        weight: &VkWeight,
        eps: f32,
        out: &mut VkBuf,
        ov: Rows,
    ) {
        assert_eq!(xv.width(), yv.width());
        assert_eq!(xv.count, yv.count);
        if let (Some(xb), Some(yb), Some(ob)) = (self.buf(x), self.buf(y), self.buf(out)) {
            self.norm(xb, xv, weight, eps, ob, ov, Some((yb, yv)));
        }
    }

    fn copy_within(&self, x: &mut VkBuf, src: Rows, dst: Rows) {
        assert_eq!(src.width(), dst.width());
        if let Some(b) = self.buf(x) {
            self.rows_op(Op::Copy, b, src, b, dst, src.width(), &[], &[]);
        }
    }

    fn causal_conv1d(
        &self,
        _x: &mut VkBuf,
        _xv: Rows,
        _w: &VkBuf,
        _kernel: usize,
        _state: &mut VkBuf,
        _seqs: &[StateSeq],
    ) {
        self.ctx
            .fail("the causal convolution (hybrid models) is not on the Vulkan device yet");
    }

    fn gated_delta(
        &self,
        _x: &VkBuf,
        _q: Rows,
        _k: Rows,
        _v: Rows,
        _a: Rows,
        _b: Rows,
        _p: DeltaParams,
        _state: &mut VkBuf,
        _seqs: &[StateSeq],
        _out: &mut VkBuf,
        _ov: Rows,
    ) {
        self.ctx
            .fail("the gated delta rule (hybrid models) is not on the Vulkan device yet");
    }
}
