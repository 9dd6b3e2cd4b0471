//! The backend boundary. Model code is written once against [`Backend`]; a backend supplies
//! buffers, weights in their stored format, and a small set of primitive ops (the list a
//! decoder-only transformer needs: embedding, matmul, RMSNorm, RoPE, attention, SiLU·mul,
//! add, strided copy). Fused ops are provided methods whose default body composes the
//! primitives; a backend overrides one only to make it faster, and a test holds the
//! override equal to the default.
//!
//! Activations are f32. Tensors inside a buffer are addressed with [`Rows`]: `count` rows of
//! `heads × head_dim` values, `stride` apart, starting at `offset` — enough to view the Q, K
//! and V parts of a fused QKV output, or one row of a KV cache, without copying.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host_ops;
pub mod vulkan;

use ferrum_core::Result;
use ferrum_loader::RawTensor;

pub use cpu::CpuBackend;

/// A strided view of `count` rows inside a buffer. Row `t`, head `h`, element `d` sits at
/// `offset + t * stride + h * head_dim + d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub offset: usize,
    pub stride: usize,
    pub count: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl Rows {
    /// `count` dense rows of `width` values.
    pub fn dense(count: usize, width: usize) -> Rows {
        Rows {
            offset: 0,
            stride: width,
            count,
            heads: 1,
            head_dim: width,
        }
    }

    /// Columns `[start, start + width)` of dense rows `stride` wide.
    pub fn columns(count: usize, stride: usize, start: usize, width: usize) -> Rows {
        Rows {
            offset: start,
            stride,
            count,
            heads: 1,
            head_dim: width,
        }
    }

    /// The same memory seen as `heads` heads of `head_dim` each.
    pub fn split_heads(self, head_dim: usize) -> Rows {
        let width = self.width();
        debug_assert_eq!(width % head_dim, 0);
        Rows {
            heads: width / head_dim,
            head_dim,
            ..self
        }
    }

    /// Rows `[first, first + count)` of this view.
    pub fn slice(self, first: usize, count: usize) -> Rows {
        Rows {
            offset: self.offset + first * self.stride,
            count,
            ..self
        }
    }

    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// One past the last element touched; a backend checks it against the buffer length.
    pub fn end(&self) -> usize {
        if self.count == 0 {
            self.offset
        } else {
            self.offset + (self.count - 1) * self.stride + self.width()
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// GPT-NeoX / Hugging Face order: dimension `i` pairs with `i + rot_dim / 2`.
    Neox,
    /// GPT-J / original Llama order: dimension `2i` pairs with `2i + 1`. Llama-architecture
    /// GGUF files store Q and K rows permuted for this layout.
    Interleaved,
}

#[derive(Debug, Clone, Copy)]
pub struct RopeParams<'a> {
    pub layout: RopeLayout,
    /// One inverse frequency per rotated pair; `2 * inv_freq.len()` leading dimensions of each
    /// head rotate, the rest pass through.
    pub inv_freq: &'a [f32],
    /// Multiplies cos and sin (LongRoPE's attention factor: the rotated dimensions scaled,
    /// the ones passed through not). 1 elsewhere.
    pub factor: f32,
}

/// The nonlinearity of a gated FFN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// SwiGLU: `x · sigmoid(x)`.
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// GeGLU with GELU's exact (erf) form: ModernBERT's `"gelu"`.
    GeluErf,
    /// gpt-oss's clamped SwiGLU: with `g = min(gate, limit)` and `u = clamp(up, ±limit)`,
    /// `(u + 1) · g · sigmoid(alpha · g)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// One weight of a [`Backend::matmul_many`]: `out[t, j] = Σ_k x[t, k] · weight[j, k] (+ bias[j])`
/// into the view `out`.
#[derive(Debug)]
pub struct MatmulPart<'a, W> {
    pub weight: &'a W,
    pub bias: Option<&'a W>,
    pub out: Rows,
}

/// The geometry of a paged KV cache (see [`Backend::alloc_kv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub blocks: usize,
    pub block_size: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// Elements per position (all heads).
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Positions the cache holds.
    pub fn rows(&self) -> usize {
        self.blocks * self.block_size
    }
}

/// Where one sequence's keys and values sit in a paged KV cache: position `p` is cache row
/// `blocks[p / block_size] * block_size + p % block_size`. The engine's block pool owns the
/// cache and hands each forward pass the tables of the sequences it carries. With a sliding
/// window, entries of blocks wholly behind every query's window are never read (they may name
/// no block at all).
#[derive(Debug, Clone, Copy)]
pub struct KvTable<'a> {
    pub blocks: &'a [u32],
    pub block_size: usize,
}

impl KvTable<'_> {
    /// The cache row of position `pos`; `None` past the end of the table.
    pub fn slot(&self, pos: usize) -> Option<usize> {
        let b = *self.blocks.get(pos / self.block_size)? as usize;
        Some(b * self.block_size + pos % self.block_size)
    }

    /// Positions the table covers.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.block_size
    }
}

/// One sequence's rows in a batched attention call: the next `rows` query rows, at positions
/// `first_pos..first_pos + rows`, attend to positions `0..=their own` of this sequence's cache.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    pub rows: usize,
    pub first_pos: usize,
    pub table: KvTable<'a>,
}

#[derive(Debug, Clone, Copy)]
pub struct AttentionParams<'a> {
    pub n_kv_heads: usize,
    pub scale: f32,
    /// Sliding window: a query at position `p` sees keys at positions `> p - window`.
    pub window: Option<usize>,
    /// Gemma-2-style logit soft-capping: `cap * tanh(score / cap)`.
    pub softcap: Option<f32>,
    /// Attention sinks (gpt-oss): one learned logit per query head that joins the softmax's
    /// denominator and nothing else — `p_j = e^{s_j} / (Σ_i e^{s_i} + e^{sink})` — so a head
    /// may attend to less than a whole token's worth of values.
    pub sinks: Option<&'a [f32]>,
}

/// One sequence's rows in a recurrent op ([`Backend::causal_conv1d`],
/// [`Backend::gated_delta`]): the next `rows` rows of the batch, its state in slot `slot` of
/// the state buffer, zeroed first when `fresh` (the sequence's first chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateSeq {
    pub rows: usize,
    pub slot: usize,
    pub fresh: bool,
}

/// A Gated DeltaNet layer's shape and per-head decay parameters (Qwen3.5, Qwen3-Next).
#[derive(Debug, Clone, Copy)]
pub struct DeltaParams<'a> {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// Which key head a value head reads: value head `h` of `v_heads = r · k_heads` uses key
    /// head `h / r` (grouped, Hugging Face's order) or `h % k_heads` (tiled, the order
    /// llama.cpp's converter rewrites the value heads into).
    pub tiled: bool,
    /// Per value head: `−exp(A_log)`, the decay rate the `a` projection's softplus scales.
    pub a: &'a [f32],
    /// Per value head: added to the `a` projection before the softplus.
    pub dt_bias: &'a [f32],
}

impl DeltaParams<'_> {
    /// Floats one sequence's delta-rule state takes (every value head's `k_dim × v_dim`).
    pub fn state_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }

    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        if self.tiled {
            h % self.k_heads
        } else {
            h / (self.v_heads / self.k_heads)
        }
    }
}

/// One expert's gated FFN weights: `down(act(gate(x)) · up(x))`, each projection with its
/// bias where the family has them (gpt-oss).
pub struct ExpertWeights<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
    pub biases: Option<[W; 3]>,
}

/// The tokens routed to one expert, with their routing weights. Token indices are rows of the
/// MoE input view.
pub struct ExpertBatch<'a> {
    pub expert: usize,
    pub tokens: &'a [u32],
    pub weights: &'a [f32],
}

/// Working buffers of the MoE layer, each sized for every token of a chunk.
pub struct MoeScratch<B> {
    pub x: B,
    pub gu: B,
    pub act: B,
    pub y: B,
}

/// The primitive ops of a decoder. `Buf` holds f32 activations; `Weight` holds a tensor in
/// its stored format (quantised weights stay quantised).
pub trait Backend: Send + Sync {
    type Buf: Send;
    type Weight: Send + Sync;
    /// KV-cache storage, in the element format the backend was configured with (f16 by
    /// default on the CPU: half the memory and bandwidth of f32).
    type KvBuf: Send;

    fn name(&self) -> String;

    /// The KV cache's element format, as `f16`, `f32` or `q8_0`.
    fn kv_dtype(&self) -> &'static str {
        "f32"
    }

    fn alloc(&self, len: usize) -> Self::Buf;
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    fn write(&self, buf: &mut Self::Buf, offset: usize, data: &[f32]);
    fn read(&self, buf: &Self::Buf, offset: usize, out: &mut [f32]);
    /// `len` values of the buffer from `offset`, in place, where the backend keeps its
    /// buffers in host memory (the CPU): a caller reads results without [`read`](Self::read)'s
    /// copy. `None` where they must be copied out (a device's memory).
    fn host_view<'a>(&self, buf: &'a Self::Buf, offset: usize, len: usize) -> Option<&'a [f32]> {
        let _ = (buf, offset, len);
        None
    }

    /// Waits for the ops issued so far and reports a fault of the device under them (out of
    /// memory, lost). The ops themselves cannot fail: a device backend keeps its first error,
    /// skips the ops after it, and returns it here; the model code calls this once per pass.
    fn sync(&self) -> Result<()> {
        Ok(())
    }

    /// Whether `causal_conv1d` and `gated_delta` (the hybrid models' recurrent layers) run
    /// here; the model loader refuses a hybrid model on a backend without them.
    fn recurrent_ops(&self) -> bool {
        true
    }

    /// Whether a prefill of this matrix pays for passes longer than the usual chunk (the
    /// decoder's `LONG_CHUNK` against its `CHUNK`): where the backend prepares the matrix
    /// anew for every product, so that more tokens a pass share that work.
    fn long_prefill(&self, w: &Self::Weight) -> bool {
        let _ = w;
        false
    }

    /// Refuses a model whose weights (`weight_bytes` in the file's formats) cannot fit the
    /// backend's memory, before any is loaded, with both sizes in the error.
    fn reserve(&self, weight_bytes: u64) -> Result<()> {
        let _ = weight_bytes;
        Ok(())
    }

    /// Takes a tensor from a model file; matrices keep their format.
    fn load_weight(&self, t: &RawTensor) -> Result<Self::Weight>;
    /// [`Self::load_weight`] for a matrix whose products must keep the activations' full
    /// precision on every path: the backend may store it as the file does, but multiplies it
    /// with f32 activations (no bf16 or 8-bit rounding of the input). The models use it for
    /// the few matrices that feed a discontinuity or a recurrence (routers, a Gated
    /// DeltaNet's projections), where input rounding is amplified; see docs/accuracy.md.
    fn load_weight_precise(&self, t: &RawTensor) -> Result<Self::Weight> {
        self.load_weight(t)
    }
    /// [`Self::load_weight`] for a float matrix of a model whose work is many tokens at once
    /// (an encoder's batches of short inputs, bound by arithmetic, not by reading the
    /// weights): the backend may store it in 8 bits (Q8_0) on its fast path, where its
    /// integer kernels are several times faster than float ones. An exact backend, and one
    /// without such kernels, keeps the file's format.
    fn load_weight_compute(&self, t: &RawTensor) -> Result<Self::Weight> {
        self.load_weight(t)
    }
    /// [`Self::load_weight`] for a float matrix only ever multiplied over an encoder's whole
    /// pass (a vision tower's patches): its products need not have a decoder's one-token bits,
    /// so the backend may sum them in another order (the CPU's tiled GEMM, in f32). A backend
    /// without such a kernel loads it as usual.
    fn load_weight_encoder(&self, t: &RawTensor) -> Result<Self::Weight> {
        self.load_weight(t)
    }
    /// `(rows, cols)` of a loaded weight (a vector is one row).
    fn weight_shape(&self, w: &Self::Weight) -> (usize, usize);

    /// `out[t] = table[tokens[t]]`; token ids must be below the table's row count.
    fn embed(&self, table: &Self::Weight, tokens: &[u32], out: &mut Self::Buf, ov: Rows);

    /// `out[t, j] = Σ_k x[t, k] · w[j, k] (+ bias[j])` for every row `t` of `xv`.
    fn matmul(
        &self,
        x: &Self::Buf,
        xv: Rows,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        out: &mut Self::Buf,
        ov: Rows,
    );

    /// Several weights applied to the same input rows, each into its own columns of `out` (a
    /// layer's Q, K and V projections; gate and up): a backend may prepare the input once for
    /// all of them and hand out the work in one go. Same results as one `matmul` per part.
    fn matmul_many(
        &self,
        x: &Self::Buf,
        xv: Rows,
        parts: &[MatmulPart<'_, Self::Weight>],
        out: &mut Self::Buf,
    ) {
        for p in parts {
            self.matmul(x, xv, p.weight, p.bias, out, p.out);
        }
    }

    /// RMSNorm of each head of `xv` (the whole row when `heads == 1`) into `ov`,
    /// multiplied by `weight` (length `head_dim`).
    fn rms_norm(
        &self,
        x: &Self::Buf,
        xv: Rows,
        weight: &Self::Weight,
        eps: f32,
        out: &mut Self::Buf,
        ov: Rows,
    );

    /// RMSNorm in place, per head (QK-norm).
    fn rms_norm_inplace(&self, x: &mut Self::Buf, xv: Rows, weight: &Self::Weight, eps: f32);

    /// Rotates every head of `xv` in place; row `t` is at position `positions[t]`.
    fn rope(&self, x: &mut Self::Buf, xv: Rows, positions: &[u32], p: RopeParams);

    /// [`Self::rope`] where each row has `axes` positions (`positions[t * axes + a]`) and
    /// rotated pair `i` takes its angle from axis `pair_axis[i]`: multimodal RoPE (Qwen VL's
    /// time, height and width positions of image rows; a vision tower's rows and columns).
    /// Image rows only, a small share of a pass, so the default body runs on the host
    /// ([`host_ops::rope_axes_row`]).
    fn rope_axes(
        &self,
        x: &mut Self::Buf,
        xv: Rows,
        positions: &[u32],
        axes: usize,
        pair_axis: &[u8],
        p: RopeParams,
    ) {
        assert_eq!(positions.len(), xv.count * axes, "rope_axes: positions");
        assert_eq!(pair_axis.len(), p.inv_freq.len(), "rope_axes: pair axes");
        assert!(pair_axis.iter().all(|&a| (a as usize) < axes));
        assert!(
            2 * p.inv_freq.len() <= xv.head_dim,
            "rope_axes: head too small"
        );
        let (heads, head_dim) = (xv.heads, xv.head_dim);
        let mut t = 0;
        on_host(self, x, xv, |row| {
            let pos = &positions[t * axes..(t + 1) * axes];
            host_ops::rope_axes_row(row, heads, head_dim, pos, pair_axis, &p);
            t += 1;
        });
    }

    /// Copies rows between views of equal width.
    fn copy_rows(&self, src: &Self::Buf, sv: Rows, dst: &mut Self::Buf, dv: Rows);

    /// A KV cache of one layer's keys or values: `shape.blocks` blocks of `shape.block_size`
    /// positions, each position `shape.heads` heads of `shape.head_dim` elements. Block tables
    /// handed to `write_kv` and `attention` must use the same block size.
    fn alloc_kv(&self, shape: KvShape) -> Self::KvBuf;

    /// Bytes one cache row of `width` elements takes (for sizing the cache to a budget).
    fn kv_row_bytes(&self, width: usize) -> usize;

    /// Stores rows of keys or values into the cache (converting to its element format): row
    /// `t` of `sv` is position `first_pos + t` of the sequence `table` describes.
    fn write_kv(
        &self,
        src: &Self::Buf,
        sv: Rows,
        dst: &mut Self::KvBuf,
        table: KvTable,
        first_pos: usize,
    );

    /// Causal grouped-query attention for a batch of sequences in one call: the rows of `qv`
    /// (`heads` query heads) belong to `seqs` in order, and each sequence's queries attend to
    /// its own cached keys and values (`n_kv_heads` heads per row), found through its table.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf,
        qv: Rows,
        k_cache: &Self::KvBuf,
        v_cache: &Self::KvBuf,
        seqs: &[AttnSeq],
        out: &mut Self::Buf,
        ov: Rows,
        p: AttentionParams,
    );

    /// Attention within spans of rows, with no mask and no cache (an encoder's layer): `qkv`
    /// holds `n` rows of `3 · heads · head_dim` (each row's queries, keys and values, head by
    /// head), and each row of a span `(first, len)` attends to every row of that span and to
    /// nothing else, scaled by `1/√head_dim`, into its row of `out` (`[n, heads · head_dim]`).
    /// Returns `false`, having written nothing, where the backend has no kernel of its own:
    /// the caller then goes through [`Self::attention`] over a scratch cache.
    #[allow(clippy::too_many_arguments)]
    fn span_attention(
        &self,
        qkv: &Self::Buf,
        n: usize,
        heads: usize,
        head_dim: usize,
        spans: &[(usize, usize)],
        out: &mut Self::Buf,
    ) -> bool {
        let _ = (qkv, n, heads, head_dim, spans, out);
        false
    }

    /// A gated linear unit's gate: `out[t, i] = act(x[t, i]) · x[t, i + width]` where `xv` is
    /// `2 · width` wide (gate columns, then up columns).
    fn glu(&self, x: &Self::Buf, xv: Rows, out: &mut Self::Buf, ov: Rows, act: Activation);

    /// A dense FFN's tail: `act = glu(gu)`, then `out = act · wᵀ`. A fused op: the default
    /// body is those two ops; a backend may compute each token's `act` row inside the
    /// matmul's own hand-off to its threads (`act` is then written, with the same values).
    #[allow(clippy::too_many_arguments)]
    fn glu_matmul(
        &self,
        gu: &Self::Buf,
        gv: Rows,
        act: &mut Self::Buf,
        av: Rows,
        w: &Self::Weight,
        out: &mut Self::Buf,
        ov: Rows,
        f: Activation,
    ) {
        self.glu(gu, gv, act, av, f);
        self.matmul(act, av, w, None, out, ov);
    }

    /// `x[v] += y[yv]`.
    fn add_inplace(&self, x: &mut Self::Buf, xv: Rows, y: &Self::Buf, yv: Rows);

    /// `low[t, j] = x[t] · a[j]` for every row `t` of `xv`, where `a` (on the host) holds
    /// `lv.width()` rows of `xv.width()` values: a LoRA update's `A x`, each product the
    /// CPU's f32 dot ([`cpu::simd::dot_f32`]) whatever the rows. The default body runs on the
    /// host over the rows read out and written back.
    fn low_rank_shrink(&self, x: &Self::Buf, xv: Rows, a: &[f32], low: &mut Self::Buf, lv: Rows) {
        assert_eq!(xv.count, lv.count);
        let (k, r) = (xv.width(), lv.width());
        assert_eq!(a.len(), r * k, "low_rank_shrink: factor size");
        let mut row = vec![0f32; k];
        let mut out = vec![0f32; r];
        for t in 0..xv.count {
            self.read(x, xv.offset + t * xv.stride, &mut row);
            for (o, aj) in out.iter_mut().zip(a.chunks_exact(k)) {
                *o = cpu::simd::dot_f32(&row, aj);
            }
            self.write(low, lv.offset + t * lv.stride, &out);
        }
    }

    /// `out[t] += Σ_j low[t, j] · bt[j]` for every row `t` of `lv`, where `bt` (on the host,
    /// in [`host_ops::low_rank_stretches`]' layout) holds `lv.width()` rows of `ov.width()`
    /// values: a LoRA update's expansion by its transposed, scaled `B`, added to the
    /// projection's output. Each element's terms are fused-multiply-added in `j` order onto
    /// its value, whatever the rows, so a batch keeps each row's bits. The default body runs
    /// on the host over the rows read out and written back.
    fn add_low_rank(&self, low: &Self::Buf, lv: Rows, bt: &[f32], out: &mut Self::Buf, ov: Rows) {
        assert_eq!(lv.count, ov.count);
        let (r, w) = (lv.width(), ov.width());
        assert_eq!(bt.len(), r * w, "add_low_rank: factor size");
        if ov.count == 0 {
            return;
        }
        let mut l = vec![0f32; r];
        let mut row = vec![0f32; w];
        for t in 0..ov.count {
            self.read(low, lv.offset + t * lv.stride, &mut l);
            self.read(out, ov.offset + t * ov.stride, &mut row);
            host_ops::add_low_rank_row(&mut row, &l, bt);
            self.write(out, ov.offset + t * ov.stride, &row);
        }
    }

    /// Multiplies every element of the view by `s` (embedding scaling).
    fn scale_inplace(&self, x: &mut Self::Buf, xv: Rows, s: f32);

    /// Sets every element of the view to `value`.
    fn fill(&self, x: &mut Self::Buf, xv: Rows, value: f32);

    /// `dst[t] = src[rows[t]]`: collects the tokens routed to one expert.
    fn gather_rows(&self, src: &Self::Buf, sv: Rows, rows: &[u32], dst: &mut Self::Buf, dv: Rows);

    /// `dst[rows[t]] += scales[t] · src[t]`, in order of `t`: adds an expert's weighted output
    /// back into its tokens.
    fn scatter_add_rows(
        &self,
        src: &Self::Buf,
        sv: Rows,
        rows: &[u32],
        scales: &[f32],
        dst: &mut Self::Buf,
        dv: Rows,
    );

    /// Rows `[first, first + count)` of a loaded stacked expert tensor, as a weight of its own
    /// (one expert). A backend may read them from the tensor's storage or copy them (the CPU
    /// copies them onto its arena, packed; it refuses matrices it has already copied).
    fn weight_rows(&self, w: &Self::Weight, first: usize, count: usize) -> Result<Self::Weight>;

    /// Mixture-of-experts SwiGLU: `out[t] = Σ_e w_{t,e} · expert_e(x[t])` over the batches,
    /// each expert run once over all of its tokens (a matrix-matrix product), contributions
    /// added in batch order. The default composes the primitives; a backend may override it
    /// (e.g. a single-token decode path that visits all selected experts in one pass).
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn(
        &self,
        x: &Self::Buf,
        xv: Rows,
        experts: &[ExpertWeights<Self::Weight>],
        batches: &[ExpertBatch],
        scratch: &mut MoeScratch<Self::Buf>,
        out: &mut Self::Buf,
        ov: Rows,
        act: Activation,
    ) {
        moe_ffn_default(self, x, xv, experts, batches, scratch, out, ov, act)
    }

    /// `x[t, i] *= sigmoid(g[t, i])`, or `sigmoid(g[t, 0])` for every `i` when `gv` is one
    /// value wide (a per-row gate: the shared expert's). Gated attention's output gate.
    fn sigmoid_mul(&self, x: &mut Self::Buf, xv: Rows, g: &Self::Buf, gv: Rows);

    /// Copies the rows of `src` onto those of `dst` within one buffer (the views must not
    /// overlap): a recurrent state's snapshot taken or restored.
    fn copy_within(&self, x: &mut Self::Buf, src: Rows, dst: Rows);

    /// Depthwise causal convolution followed by SiLU, in place over each sequence's rows of
    /// `xv` (`channels` wide): `y[t, c] = silu(Σ_j w[j, c] · x[t − (kernel − 1) + j, c])`,
    /// where inputs before a sequence's first row come from its state (the last
    /// `kernel − 1` inputs it has seen, oldest first: `(kernel − 1) × channels` floats from
    /// `slot · (kernel − 1) · channels`), and the state is left holding the last inputs
    /// again. `w` is `kernel × channels`, tap-major.
    fn causal_conv1d(
        &self,
        x: &mut Self::Buf,
        xv: Rows,
        w: &Self::Buf,
        kernel: usize,
        state: &mut Self::Buf,
        seqs: &[StateSeq],
    );

    /// The gated delta rule, token by token, per value head `h` with state `S` (`k_dim ×
    /// v_dim`, at `(slot · v_heads + h) · k_dim · v_dim`): with `q̂ = l2norm(q)/√k_dim`,
    /// `k̂ = l2norm(k)`, `β = sigmoid(b)` and `g = a_h · softplus(a + dt_bias_h)`:
    /// `S ← e^g · S`, `S ← S + k̂ ⊗ β (v − Sᵀk̂)`, `out = Sᵀq̂`. `q`, `k` are split into key
    /// heads, `v` and `out` into value heads; `a` and `b` are one value per value head.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta(
        &self,
        x: &Self::Buf,
        q: Rows,
        k: Rows,
        v: Rows,
        a: Rows,
        b: Rows,
        p: DeltaParams,
        state: &mut Self::Buf,
        seqs: &[StateSeq],
        out: &mut Self::Buf,
        ov: Rows,
    );

    /// Residual add followed by the next norm: `x += y; out = rms_norm(x)`. The default
    /// composes the primitives.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        x: &mut Self::Buf,
        xv: Rows,
        y: &Self::Buf,
        yv: Rows,
        weight: &Self::Weight,
        eps: f32,
        out: &mut Self::Buf,
        ov: Rows,
    ) {
        self.add_inplace(x, xv, y, yv);
        self.rms_norm(x, xv, weight, eps, out, ov);
    }

    /// An encoder's LayerNorm in place over each row of `xv` (its whole width): `x = (x −
    /// mean) / sqrt(var + eps) · weight + bias`. The parameters are host vectors: they are
    /// read once a row, and the default body runs on the host ([`host_ops`]) over the
    /// buffer read out and written back, on every backend.
    fn layer_norm(&self, x: &mut Self::Buf, xv: Rows, weight: &[f32], bias: &[f32], eps: f32) {
        let w = xv.width();
        assert!(
            weight.len() == w && bias.len() == w,
            "layer_norm: parameter length"
        );
        on_host(self, x, xv, |row| {
            host_ops::layer_norm_row(row, weight, bias, eps)
        });
    }

    /// GELU in its exact (erf) form, in place over `xv`: an encoder's FFN activation. The
    /// default body runs on the host, as [`Self::layer_norm`]'s does.
    fn gelu(&self, x: &mut Self::Buf, xv: Rows) {
        on_host(self, x, xv, host_ops::gelu_erf);
    }

    /// GELU in its tanh approximation (PyTorch's `gelu(approximate="tanh")`), in place over
    /// `xv`: a vision tower's MLP activation (SigLIP's `gelu_pytorch_tanh`). The default body
    /// runs on the host, as [`Self::gelu`]'s does.
    fn gelu_tanh(&self, x: &mut Self::Buf, xv: Rows) {
        on_host(self, x, xv, host_ops::gelu_tanh);
    }

    /// `cap · tanh(x / cap)` over the view, in place: Gemma's final logit soft-capping. Once
    /// per generated token over the logits, so the default body runs on the host.
    fn softcap(&self, x: &mut Self::Buf, xv: Rows, cap: f32) {
        on_host(self, x, xv, |row| {
            row.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        });
    }

    /// Row `t` of `xv` multiplied by `factors[t]`, in place: Llama 4's and Mistral's
    /// position-dependent query temperature. Rare (past a model's original context only),
    /// so the default body runs on the host.
    fn scale_rows(&self, x: &mut Self::Buf, xv: Rows, factors: &[f32]) {
        assert_eq!(factors.len(), xv.count, "scale_rows: one factor a row");
        let mut t = 0;
        on_host(self, x, xv, |row| {
            let f = factors[t];
            row.iter_mut().for_each(|v| *v *= f);
            t += 1;
        });
    }
}

/// Runs `f` on every row of `xv` (its full width) over a host copy of the span the view
/// covers, then writes the span back: the default body of the host-side ops.
fn on_host<B: Backend + ?Sized>(be: &B, x: &mut B::Buf, xv: Rows, mut f: impl FnMut(&mut [f32])) {
    if xv.count == 0 {
        return;
    }
    let len = xv.end() - xv.offset;
    let mut span = vec![0f32; len];
    be.read(x, xv.offset, &mut span);
    let w = xv.width();
    for t in 0..xv.count {
        f(&mut span[t * xv.stride..t * xv.stride + w]);
    }
    be.write(x, xv.offset, &span);
}

/// The default [`Backend::moe_ffn`]: for each active expert, gather its tokens, SwiGLU as
/// matrix-matrix products, and scatter-add the weighted result. A backend's override can fall
/// back to it.
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn_default<B: Backend + ?Sized>(
    be: &B,
    x: &B::Buf,
    xv: Rows,
    experts: &[ExpertWeights<B::Weight>],
    batches: &[ExpertBatch],
    scratch: &mut MoeScratch<B::Buf>,
    out: &mut B::Buf,
    ov: Rows,
    act: Activation,
) {
    be.fill(out, ov, 0.0);
    for b in batches {
        let e = &experts[b.expert];
        let bias = |i: usize| e.biases.as_ref().map(|b| &b[i]);
        let (f, h) = be.weight_shape(&e.gate);
        let m = b.tokens.len();
        let xe = Rows::dense(m, h);
        be.gather_rows(x, xv, b.tokens, &mut scratch.x, xe);
        // Gate and up in one call (the input prepared once, one hand-off), and the GLU inside
        // the down projection's: the same values as the four ops one by one.
        let gu = Rows::dense(m, 2 * f);
        let parts = [
            MatmulPart {
                weight: &e.gate,
                bias: bias(0),
                out: Rows::columns(m, 2 * f, 0, f),
            },
            MatmulPart {
                weight: &e.up,
                bias: bias(1),
                out: Rows::columns(m, 2 * f, f, f),
            },
        ];
        be.matmul_many(&scratch.x, xe, &parts, &mut scratch.gu);
        let av = Rows::dense(m, f);
        match bias(2) {
            None => be.glu_matmul(
                &scratch.gu,
                gu,
                &mut scratch.act,
                av,
                &e.down,
                &mut scratch.y,
                xe,
                act,
            ),
            Some(down_bias) => {
                be.glu(&scratch.gu, gu, &mut scratch.act, av, act);
                be.matmul(
                    &scratch.act,
                    av,
                    &e.down,
                    Some(down_bias),
                    &mut scratch.y,
                    xe,
                );
            }
        }
        be.scatter_add_rows(&scratch.y, xe, b.tokens, b.weights, out, ov);
    }
}
