//! Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Mistral 4), computed absorbed.
//!
//! Each position caches one row shared by every head: its rotary key `k_r` (`rope_dim`)
//! and its normalised latent `c` (`kv_rank`). A head's key would be `[W_uk,h · c, k_r]` and
//! its value `W_uv,h · c`; instead of expanding them, the query is carried into the latent
//! space: `q_nope,h · (W_uk,h · c) = (W_uk,hᵀ · q_nope,h) · c`. So each head's absorbed query
//! `[rope(q_r,h), W_uk,hᵀ · q_nope,h]` is scored against the cache rows as they are — one KV
//! head of `rope_dim + kv_rank` — by the backend's ordinary attention, with the same buffer
//! passed as keys and values: the latent part of the averaged row is `Σ p · c`, and
//! `W_uv,h` times it is the head's output. The cache is `rope_dim + kv_rank` values a
//! position and layer (DeepSeek-V3: 576, against 128 heads × (192 + 128) expanded), for
//! prefill as for decode.

use ferrum_backend::{Backend, MatmulPart, Rows};
use ferrum_core::{DType, Error, Result};
use ferrum_loader::RawTensor;

use crate::config::{Mla, ModelConfig};
use crate::layers::{load_precise_float, row_blocks, row_blocks_with, AttnInputs, WeightSource};

/// How the queries are projected.
enum QueryProj<W> {
    /// `q = W_q · x`.
    Direct(W),
    /// `q = W_qb · norm(W_qa · x)`.
    Lora { a: W, norm: W, b: W },
}

pub struct LatentAttention<B: Backend> {
    q: QueryProj<B::Weight>,
    /// `[kv_rank + rope_dim, hidden]`: the latent, then the rotary key.
    kv_a: B::Weight,
    kv_norm: B::Weight,
    /// Per head, `W_uk,hᵀ` `[kv_rank, nope_dim]`.
    k_up_t: Vec<B::Weight>,
    /// Per head, `W_uv,h` `[v_dim, kv_rank]`.
    v_up: Vec<B::Weight>,
    o: B::Weight,
}

/// Working buffers of a latent-attention pass, sized for one chunk.
pub struct MlaBufs<B: Backend> {
    /// Per row: the queries as projected, `heads × q_head`.
    q: B::Buf,
    /// Per row: the query bottleneck (if any), then the latent and the rotary key.
    a: B::Buf,
    /// Per row: every head's value, `heads × v_dim`: the output projection's input.
    v: B::Buf,
}

impl<B: Backend> MlaBufs<B> {
    pub fn new(be: &B, c: &ModelConfig, m: &Mla, rows: usize) -> Self {
        MlaBufs {
            q: be.alloc(rows * c.n_heads * m.q_head()),
            a: be.alloc(rows * a_width(m)),
            v: be.alloc(rows * c.n_heads * m.v_dim),
        }
    }
}

fn a_width(m: &Mla) -> usize {
    m.q_rank.unwrap_or(0) + m.kv_rank + m.rope_dim
}

impl<B: Backend> LatentAttention<B> {
    pub fn load(be: &B, src: &WeightSource, i: usize, c: &ModelConfig, m: &Mla) -> Result<Self> {
        let (h, heads) = (c.hidden_size, c.n_heads);
        let qd = heads * m.q_head();
        // Queries and keys meet in the scores: f32 activations where the weights are
        // floats, as for ordinary attention.
        let qk = |name: &str, shape| src.require_precise_float(be, name, i, shape);
        let norm = |name: &str, len| src.norm(be, name, i, len, c.norm_offset);
        let p = "model.layers.{i}.self_attn.";
        let q = match m.q_rank {
            None => QueryProj::Direct(qk(&format!("{p}q_proj.weight"), (qd, h))?),
            Some(r) => QueryProj::Lora {
                a: qk(&format!("{p}q_a_proj.weight"), (r, h))?,
                norm: norm(&format!("{p}q_a_layernorm.weight"), r)?,
                b: qk(&format!("{p}q_b_proj.weight"), (qd, r))?,
            },
        };
        let kv_a = qk(
            &format!("{p}kv_a_proj_with_mqa.weight"),
            (m.kv_rank + m.rope_dim, h),
        )?;
        let kv_norm = norm(&format!("{p}kv_a_layernorm.weight"), m.kv_rank)?;
        let (k_up_t, v_up) = up_projections(be, src, i, heads, m)?;
        Ok(LatentAttention {
            q,
            kv_a,
            kv_norm,
            k_up_t,
            v_up,
            o: src.require(be, &format!("{p}o_proj.weight"), i, (h, heads * m.v_dim))?,
        })
    }

    /// `out = o(attention(...))` for the `n` rows of `x`, writing each sequence's cache rows
    /// on the way. `qkv` holds the absorbed queries (`heads × row`) and then the new cache
    /// rows (`row`); `attn` the attention's output (`heads × row`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        c: &ModelConfig,
        m: &Mla,
        x: &B::Buf,
        n: usize,
        bufs: &mut MlaBufs<B>,
        qkv: &mut B::Buf,
        attn: &mut B::Buf,
        out: &mut B::Buf,
        cache: &mut B::KvBuf,
        a: &AttnInputs,
    ) {
        let (heads, row, qh) = (c.n_heads, m.row(), m.q_head());
        let hidden = Rows::dense(n, c.hidden_size);
        let aw = a_width(m);
        let qr = m.q_rank.unwrap_or(0);
        let q_cols = Rows::dense(n, heads * qh);
        let latent_cols = Rows::columns(n, aw, qr, m.kv_rank);
        let rot_cols = Rows::columns(n, aw, qr + m.kv_rank, m.rope_dim);
        // Projections: the queries (through the bottleneck where there is one), the latent
        // and the rotary key.
        match &self.q {
            QueryProj::Direct(w) => {
                be.matmul(x, hidden, w, None, &mut bufs.q, q_cols);
                be.matmul(
                    x,
                    hidden,
                    &self.kv_a,
                    None,
                    &mut bufs.a,
                    Rows::columns(n, aw, 0, m.kv_rank + m.rope_dim),
                );
            }
            QueryProj::Lora { a: wa, norm, b } => {
                let parts = [
                    MatmulPart {
                        weight: wa,
                        bias: None,
                        out: Rows::columns(n, aw, 0, qr),
                    },
                    MatmulPart {
                        weight: &self.kv_a,
                        bias: None,
                        out: Rows::columns(n, aw, qr, m.kv_rank + m.rope_dim),
                    },
                ];
                be.matmul_many(x, hidden, &parts, &mut bufs.a);
                let bottleneck = Rows::columns(n, aw, 0, qr);
                be.rms_norm_inplace(&mut bufs.a, bottleneck, norm, c.rms_eps);
                be.matmul(&bufs.a, bottleneck, b, None, &mut bufs.q, q_cols);
            }
        }
        // The new cache rows: the rotary key, rotated, then the normalised latent.
        let q_width = heads * row;
        let w = q_width + row;
        let cache_rows = Rows::columns(n, w, q_width, row);
        be.copy_rows(
            &bufs.a,
            rot_cols,
            qkv,
            Rows::columns(n, w, q_width, m.rope_dim),
        );
        be.rms_norm(
            &bufs.a,
            latent_cols,
            &self.kv_norm,
            c.rms_eps,
            qkv,
            Rows::columns(n, w, q_width + m.rope_dim, m.kv_rank),
        );
        // Each head's absorbed query: its rotary part as projected, then W_ukᵀ times the
        // rest.
        for (hd, k_up_t) in self.k_up_t.iter().enumerate() {
            be.copy_rows(
                &bufs.q,
                Rows::columns(n, heads * qh, hd * qh + m.nope_dim, m.rope_dim),
                qkv,
                Rows::columns(n, w, hd * row, m.rope_dim),
            );
            be.matmul(
                &bufs.q,
                Rows::columns(n, heads * qh, hd * qh, m.nope_dim),
                k_up_t,
                None,
                qkv,
                Rows::columns(n, w, hd * row + m.rope_dim, m.kv_rank),
            );
        }
        let q_view = Rows::columns(n, w, 0, q_width).split_heads(row);
        if let Some(rope) = a.rope {
            // The rotary dimensions lead each head and each cache row.
            be.rope(qkv, q_view, a.positions, rope);
            be.rope(qkv, cache_rows, a.positions, rope);
        }
        if let Some(f) = a.temperature() {
            be.scale_rows(qkv, Rows::columns(n, w, 0, q_width), &f);
        }
        let mut r = 0;
        for s in a.seqs {
            be.write_kv(
                qkv,
                cache_rows.slice(r, s.rows),
                cache,
                s.table,
                s.first_pos,
            );
            r += s.rows;
        }
        let attn_view = Rows::dense(n, q_width).split_heads(row);
        be.attention(qkv, q_view, cache, cache, a.seqs, attn, attn_view, a.params);
        // Each head's averaged latent through its value projection.
        for (hd, v_up) in self.v_up.iter().enumerate() {
            be.matmul(
                attn,
                Rows::columns(n, q_width, hd * row + m.rope_dim, m.kv_rank),
                v_up,
                None,
                &mut bufs.v,
                Rows::columns(n, heads * m.v_dim, hd * m.v_dim, m.v_dim),
            );
        }
        be.matmul(
            &bufs.v,
            Rows::dense(n, heads * m.v_dim),
            &self.o,
            None,
            out,
            hidden,
        );
    }
}

/// Per head, `W_uk,hᵀ` and `W_uv,h`.
type UpProjections<B> = (Vec<<B as Backend>::Weight>, Vec<<B as Backend>::Weight>);

/// Per head, `W_uk,hᵀ` and `W_uv,h`: from llama.cpp's split `attn_k_b` (`[heads, kv_rank,
/// nope]`, already transposed) and `attn_v_b` (`[heads, v_dim, kv_rank]`) where the file has
/// them, else from `kv_b_proj` (`[heads × (nope + v_dim), kv_rank]`: each head's key rows,
/// then its value rows), the key part transposed on the host in f32.
fn up_projections<B: Backend>(
    be: &B,
    src: &WeightSource,
    i: usize,
    heads: usize,
    m: &Mla,
) -> Result<UpProjections<B>> {
    let (r, nope, v) = (m.kv_rank, m.nope_dim, m.v_dim);
    let k_b = format!("blk.{i}.attn_k_b.weight");
    let v_b = format!("blk.{i}.attn_v_b.weight");
    if src.gguf && src.store.contains(&k_b) && src.store.contains(&v_b) {
        let stacked = |name: &str, shape: [usize; 3]| -> Result<&RawTensor> {
            let t = src
                .store
                .get(name)
                .ok_or_else(|| Error::Weights(format!("missing tensor {name:?}")))?;
            if t.shape != shape {
                return Err(Error::Weights(format!(
                    "tensor {name:?} has shape {:?}, expected {shape:?}",
                    t.shape
                )));
            }
            Ok(t)
        };
        // W_ukᵀ turns each head's query into its latent-space query, which the scores
        // amplify: f32 activations where the file stores floats, as for any query projection.
        let k = row_blocks_with(stacked(&k_b, [heads, r, nope])?, heads, r, 0, |v| {
            load_precise_float(be, v)
        })?;
        let vv = row_blocks(be, stacked(&v_b, [heads, v, r])?, heads, v, 0)?;
        return Ok((k, vv));
    }
    let name = "model.layers.{i}.self_attn.kv_b_proj.weight";
    let full = src.name(name, i);
    let t = src
        .tensor(name, i)
        .ok_or_else(|| Error::Weights(format!("missing tensor {full:?}")))?;
    if t.shape != [heads * (nope + v), r] {
        return Err(Error::Weights(format!(
            "tensor {full:?} has shape {:?}, expected [{}, {r}]",
            t.shape,
            heads * (nope + v)
        )));
    }
    // Each head's value rows follow its key rows.
    let vv = row_blocks(
        be,
        &t.rows(nope, heads * (nope + v) - nope)
            .ok_or_else(|| Error::Weights(format!("{full:?}: too few rows")))?,
        heads,
        v,
        nope,
    )?;
    let all = src.vector(name, i, heads * (nope + v) * r)?;
    let k = (0..heads)
        .map(|h| {
            let rows = &all[h * (nope + v) * r..];
            // Row j of the transpose is column j of the head's `nope` key rows.
            let bytes = (0..r)
                .flat_map(|j| (0..nope).map(move |d| rows[d * r + j]))
                .flat_map(f32::to_le_bytes)
                .collect();
            let t =
                RawTensor::from_bytes(&format!("{full}[k{h}ᵀ]"), DType::F32, vec![r, nope], bytes)
                    .ok_or_else(|| Error::Weights(format!("tensor {full:?}: bad size")))?;
            be.load_weight_precise(&t)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((k, vv))
}
