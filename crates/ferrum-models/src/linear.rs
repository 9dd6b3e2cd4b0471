//! The Gated DeltaNet layer (Qwen3.5's `linear_attention` layers): one matmul for the fused
//! q/k/v projection and the `z`, `b` and `a` projections → depthwise causal convolution +
//! SiLU over q/k/v (its last inputs kept per sequence) → the gated delta rule per value head
//! (its `k_dim × v_dim` state kept per sequence) → RMSNorm per head, times `silu(z)` → out
//! projection. The states live in the caller's [`crate::decoder::KvCache`], one slot per
//! sequence; see [`ferrum_backend::Backend::gated_delta`] for the rule itself.

use ferrum_backend::{Activation, Backend, DeltaParams, MatmulPart, Rows, StateSeq};
use ferrum_core::{Error, Result};

use crate::config::{LinearAttn, ModelConfig};
use crate::layers::WeightSource;

pub struct DeltaNet<B: Backend> {
    qkv: B::Weight,
    z: B::Weight,
    b: B::Weight,
    a: B::Weight,
    /// `kernel × conv_dim`, tap-major.
    conv: B::Buf,
    /// Per value head: `−exp(A_log)`.
    decay: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: B::Weight,
    out: B::Weight,
}

/// The working buffers of a DeltaNet pass, sized for one chunk.
pub struct DeltaBufs<B: Backend> {
    /// Per row: q/k/v (convolved in place), z, b, a.
    pub proj: B::Buf,
    /// Per row: z, then the delta rule's output (normalised in place): a GLU's two halves.
    pub zo: B::Buf,
    /// Per row: the gated output, the out projection's input.
    pub y: B::Buf,
}

impl<B: Backend> DeltaBufs<B> {
    pub fn new(be: &B, l: &LinearAttn, rows: usize) -> Self {
        let vd = l.v_heads * l.v_dim;
        DeltaBufs {
            proj: be.alloc(rows * proj_width(l)),
            zo: be.alloc(rows * 2 * vd),
            y: be.alloc(rows * vd),
        }
    }
}

fn proj_width(l: &LinearAttn) -> usize {
    l.conv_dim() + l.v_heads * l.v_dim + 2 * l.v_heads
}

impl<B: Backend> DeltaNet<B> {
    pub fn load(
        be: &B,
        src: &WeightSource,
        i: usize,
        c: &ModelConfig,
        l: &LinearAttn,
    ) -> Result<Self> {
        let (h, conv, vd, nv) = (c.hidden_size, l.conv_dim(), l.v_heads * l.v_dim, l.v_heads);
        // The delta rule carries every token's q/k/v, gates and output into later tokens
        // through its state, so input rounding here is amplified (docs/accuracy.md): these
        // take f32 activations.
        let w = |name: &str, shape| src.require_precise(be, name, i, shape);
        let taps = src.vector(
            "model.layers.{i}.linear_attn.conv1d.weight",
            i,
            conv * l.conv_kernel,
        )?;
        // Stored channel by channel (`[conv_dim, 1, kernel]`, GGUF `[conv_dim, kernel]`);
        // the kernel reads a tap's channels together.
        let k = l.conv_kernel;
        let mut tap_major = vec![0f32; k * conv];
        for ch in 0..conv {
            for j in 0..k {
                tap_major[j * conv + ch] = taps[ch * k + j];
            }
        }
        let mut conv_buf = be.alloc(k * conv);
        be.write(&mut conv_buf, 0, &tap_major);
        let a = src.vector("model.layers.{i}.linear_attn.A_log", i, nv)?;
        // GGUF files hold −exp(A_log) already.
        let decay = if src.gguf {
            a
        } else {
            a.iter().map(|&v| -(v as f64).exp() as f32).collect()
        };
        if decay.iter().any(|v| !v.is_finite()) {
            return Err(Error::Weights(format!(
                "layer {i}: linear attention's A is not finite"
            )));
        }
        Ok(DeltaNet {
            qkv: w("model.layers.{i}.linear_attn.in_proj_qkv.weight", (conv, h))?,
            z: w("model.layers.{i}.linear_attn.in_proj_z.weight", (vd, h))?,
            b: w("model.layers.{i}.linear_attn.in_proj_b.weight", (nv, h))?,
            a: w("model.layers.{i}.linear_attn.in_proj_a.weight", (nv, h))?,
            conv: conv_buf,
            decay,
            dt_bias: src.vector("model.layers.{i}.linear_attn.dt_bias", i, nv)?,
            // The gated norm multiplies by `w` itself, in either kind of file.
            norm: src.norm(
                be,
                "model.layers.{i}.linear_attn.norm.weight",
                i,
                l.v_dim,
                0.0,
            )?,
            out: w("model.layers.{i}.linear_attn.out_proj.weight", (h, vd))?,
        })
    }

    /// `out = out_proj(norm(delta(conv(qkv(x)))) · silu(z(x)))` over the `n` rows of `x`,
    /// the sequences' states (`conv_state`, `delta_state`, slots per `seqs`) carried on.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &B,
        c: &ModelConfig,
        l: &LinearAttn,
        x: &B::Buf,
        n: usize,
        bufs: &mut DeltaBufs<B>,
        out: &mut B::Buf,
        conv_state: &mut B::Buf,
        delta_state: &mut B::Buf,
        seqs: &[StateSeq],
    ) {
        let (conv, vd, nv) = (l.conv_dim(), l.v_heads * l.v_dim, l.v_heads);
        let kd = l.k_heads * l.k_dim;
        let w = proj_width(l);
        let hidden = Rows::dense(n, c.hidden_size);
        let col = |start, width| Rows::columns(n, w, start, width);
        let (qkv, z, b, a) = (
            col(0, conv),
            col(conv, vd),
            col(conv + vd, nv),
            col(conv + vd + nv, nv),
        );
        let part = |weight, out| MatmulPart {
            weight,
            bias: None,
            out,
        };
        be.matmul_many(
            x,
            hidden,
            &[
                part(&self.qkv, qkv),
                part(&self.z, z),
                part(&self.b, b),
                part(&self.a, a),
            ],
            &mut bufs.proj,
        );
        be.causal_conv1d(
            &mut bufs.proj,
            qkv,
            &self.conv,
            l.conv_kernel,
            conv_state,
            seqs,
        );
        let o = Rows::columns(n, 2 * vd, vd, vd).split_heads(l.v_dim);
        be.copy_rows(&bufs.proj, z, &mut bufs.zo, Rows::columns(n, 2 * vd, 0, vd));
        let p = DeltaParams {
            k_heads: l.k_heads,
            v_heads: nv,
            k_dim: l.k_dim,
            v_dim: l.v_dim,
            tiled: l.tiled,
            a: &self.decay,
            dt_bias: &self.dt_bias,
        };
        be.gated_delta(
            &bufs.proj,
            col(0, kd).split_heads(l.k_dim),
            col(kd, kd).split_heads(l.k_dim),
            col(2 * kd, vd).split_heads(l.v_dim),
            a,
            b,
            p,
            delta_state,
            seqs,
            &mut bufs.zo,
            o,
        );
        be.rms_norm_inplace(&mut bufs.zo, o, &self.norm, c.rms_eps);
        let y = Rows::dense(n, vd);
        be.glu(
            &bufs.zo,
            Rows::dense(n, 2 * vd),
            &mut bufs.y,
            y,
            Activation::Silu,
        );
        be.matmul(&bufs.y, y, &self.out, None, out, hidden);
    }
}
