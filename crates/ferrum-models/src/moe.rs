//! The mixture-of-experts FFN of Qwen3-MoE: router → softmax → top-k (ties to the lower
//! expert) → optional renormalisation → each selected expert's SwiGLU → weighted sum.
//!
//! Routing runs on the host over the router logits (n × experts, small). Tokens are then
//! grouped by expert so each active expert runs once over all of its tokens — a
//! matrix-matrix product in prefill — through the backend's `moe_ffn`.

use ferrum_backend::{Activation, Backend, ExpertBatch, ExpertWeights};
use ferrum_core::{Error, Result};

use crate::config::{Gating, ModelConfig, MoeConfig, MoeStyle, Routing};
use crate::layers::{row_blocks, GateUp, WeightSource};
use crate::names;
use ferrum_core::DType;
use ferrum_loader::RawTensor;

/// A shared expert beside the routed ones: every token's output gets
/// `down(silu(gate_proj(x)) · up(x))`, scaled by `sigmoid(gate · x)` where there is a gate
/// (Qwen3.5-MoE; GLM-4.5's and DeepSeek-V3's are added as they are).
pub struct SharedExpert<B: Backend> {
    pub gate_up: GateUp<B::Weight>,
    pub down: B::Weight,
    /// `[1, hidden]`: the scalar gate's weights.
    pub gate: Option<B::Weight>,
    pub ffn: usize,
}

pub struct MoeLayer<B: Backend> {
    pub router: B::Weight,
    /// The score correction added to the scores that choose (DeepSeek-V3, GLM-4.5).
    pub choice_bias: Option<Vec<f32>>,
    pub shared: Option<SharedExpert<B>>,
    /// gpt-oss's router has a bias.
    pub router_bias: Option<B::Weight>,
    pub experts: Vec<ExpertWeights<B::Weight>>,
    pub activation: Activation,
    /// Each expert's routing weight is multiplied by its entry (Gemma 4's
    /// `per_expert_scale`).
    pub expert_scale: Option<Vec<f32>>,
}

impl<B: Backend> MoeLayer<B> {
    /// Loads layer `i`'s router and experts: per-expert tensors from Hugging Face files,
    /// stacked `[E, F, H]` tensors from GGUF (each expert a view of its slab, not a copy).
    pub fn load(
        be: &B,
        src: &WeightSource,
        i: usize,
        c: &ModelConfig,
        m: &MoeConfig,
    ) -> Result<Self> {
        let (h, f, e) = (c.hidden_size, m.expert_ffn, m.n_experts);
        if let MoeStyle::GptOss { alpha, limit } = m.style {
            return Self::load_gpt_oss(
                be,
                src,
                i,
                c,
                m,
                Activation::ClampedSwiglu { alpha, limit },
            );
        }
        let gemma = m.style == MoeStyle::Gemma4;
        let router_name = if gemma {
            "model.layers.{i}.router.proj.weight"
        } else {
            "model.layers.{i}.mlp.gate.weight"
        };
        let router = src.require_precise(be, router_name, i, (e, h))?;
        let stacks = if gemma {
            "model.layers.{i}.experts."
        } else {
            "model.layers.{i}.mlp.experts."
        };
        let merged = format!("blk.{i}.ffn_gate_up_exps.weight");
        let experts = if src.gguf && src.store.contains(&merged) {
            // Mistral 4's converter keeps transformers' stack: each expert's gate rows, then
            // its up rows.
            let t = src.store.get(&merged).filter(|t| t.shape == [e, 2 * f, h]);
            let t = t.ok_or_else(|| {
                Error::Weights(format!("tensor {merged:?} is not [{e}, {}, {h}]", 2 * f))
            })?;
            let gu = be.load_weight(t)?;
            let down = gguf_stack(be, src, i, names::GGUF_EXPERTS.2, [e, h, f])?;
            (0..e)
                .map(|x| {
                    Ok(ExpertWeights {
                        gate: be.weight_rows(&gu, 2 * x * f, f)?,
                        up: be.weight_rows(&gu, (2 * x + 1) * f, f)?,
                        down: be.weight_rows(&down, x * h, h)?,
                        biases: None,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else if src.gguf {
            let [gate, up, down] = gguf_stacks(be, src, i, e, f, h)?;
            (0..e)
                .map(|x| {
                    Ok(ExpertWeights {
                        gate: be.weight_rows(&gate, x * f, f)?,
                        up: be.weight_rows(&up, x * f, f)?,
                        down: be.weight_rows(&down, x * h, h)?,
                        biases: None,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else if let Some(stacked) = hf_stacks(be, src, stacks, i, e, f, h)? {
            stacked
        } else {
            (0..e)
                .map(|x| {
                    let n = |p: &str| format!("model.layers.{{i}}.mlp.experts.{x}.{p}.weight");
                    Ok(ExpertWeights {
                        gate: src.require(be, &n("gate_proj"), i, (f, h))?,
                        up: src.require(be, &n("up_proj"), i, (f, h))?,
                        down: src.require(be, &n("down_proj"), i, (h, f))?,
                        biases: None,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        let shared = match m.shared_ffn {
            Some(sf) => {
                // Qwen names its one expert in the singular, GLM and DeepSeek in the plural
                // (their `n_shared_experts` fused into one of `sf` rows).
                let p = if src
                    .tensor("model.layers.{i}.mlp.shared_experts.up_proj.weight", i)
                    .is_some()
                {
                    "model.layers.{i}.mlp.shared_experts"
                } else {
                    "model.layers.{i}.mlp.shared_expert"
                };
                let w = |name: &str, shape| src.require(be, &format!("{p}.{name}"), i, shape);
                Some(SharedExpert {
                    gate_up: GateUp::Split {
                        gate: w("gate_proj.weight", (sf, h))?,
                        up: w("up_proj.weight", (sf, h))?,
                    },
                    down: w("down_proj.weight", (h, sf))?,
                    gate: if m.shared_gate {
                        Some(src.require_precise(
                            be,
                            "model.layers.{i}.mlp.shared_expert_gate.weight",
                            i,
                            (1, h),
                        )?)
                    } else {
                        None
                    },
                    ffn: sf,
                })
            }
            None => None,
        };
        let choice_bias = if m.routing.choice_bias {
            Some(src.vector("model.layers.{i}.mlp.gate.e_score_correction_bias", i, e)?)
        } else {
            None
        };
        let (activation, expert_scale) = if gemma {
            let scale = src.vector("model.layers.{i}.router.per_expert_scale", i, e)?;
            (Activation::GeluTanh, Some(scale))
        } else {
            (Activation::Silu, None)
        };
        Ok(MoeLayer {
            router,
            choice_bias,
            shared,
            router_bias: None,
            experts,
            activation,
            expert_scale,
        })
    }
}

impl<B: Backend> MoeLayer<B> {
    /// gpt-oss's router (with a bias) and experts (with biases). GGUF stacks each projection
    /// as `[E, rows, cols]` with its biases `[E, rows]`; Hugging Face files stack them as
    /// `x · W`: `gate_up_proj` `[E, H, 2F]` with gate and up columns interleaved (gate even,
    /// up odd, the bias likewise) and `down_proj` `[E, F, H]`, transposed here into the rows
    /// the matmul reads (on the host, in f32).
    fn load_gpt_oss(
        be: &B,
        src: &WeightSource,
        i: usize,
        c: &ModelConfig,
        m: &MoeConfig,
        activation: Activation,
    ) -> Result<Self> {
        let (h, f, e) = (c.hidden_size, m.expert_ffn, m.n_experts);
        let router = src.require_precise(be, "model.layers.{i}.mlp.router.weight", i, (e, h))?;
        let router_bias = Some(src.require(be, "model.layers.{i}.mlp.router.bias", i, (1, e))?);
        let experts = if src.gguf {
            let [gate, up, down] = gguf_stacks(be, src, i, e, f, h)?;
            let (g, u, d) = names::GGUF_EXPERTS;
            let bias = |base: &str, rows: usize| -> Result<Vec<f32>> {
                let name = base
                    .replace(".weight", ".bias")
                    .replace("{i}", &i.to_string());
                src.vector(&name, i, e * rows)
            };
            let (gb, ub, db) = (bias(g, f)?, bias(u, f)?, bias(d, h)?);
            (0..e)
                .map(|x| {
                    let b = |v: &[f32], rows: usize, p: &str| {
                        f32_weight(
                            be,
                            format!("blk.{i}.{p}.bias[{x}]"),
                            vec![rows],
                            &v[x * rows..(x + 1) * rows],
                        )
                    };
                    Ok(ExpertWeights {
                        gate: be.weight_rows(&gate, x * f, f)?,
                        up: be.weight_rows(&up, x * f, f)?,
                        down: be.weight_rows(&down, x * h, h)?,
                        biases: Some([b(&gb, f, "gate")?, b(&ub, f, "up")?, b(&db, h, "down")?]),
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            let p = "model.layers.{i}.mlp.experts.";
            for (name, shape) in [("gate_up_proj", [e, h, 2 * f]), ("down_proj", [e, f, h])] {
                let n = format!("{p}{name}");
                match src.tensor(&n, i) {
                    Some(t) if t.shape != shape => {
                        return Err(Error::Weights(format!(
                            "{}: shape {:?}, expected {shape:?} (gpt-oss stacks experts as x · W)",
                            src.name(&n, i),
                            t.shape
                        )))
                    }
                    _ => {}
                }
            }
            if src.tensor(&format!("{p}gate_up_proj_blocks"), i).is_some() {
                return Ok(MoeLayer {
                    router,
                    choice_bias: None,
                    shared: None,
                    router_bias,
                    experts: hf_mxfp4_experts(be, src, i, e, f, h)?,
                    activation,
                    expert_scale: None,
                });
            }
            let gate_up = src.vector(&format!("{p}gate_up_proj"), i, e * h * 2 * f)?;
            let gate_up_b = src.vector(&format!("{p}gate_up_proj_bias"), i, e * 2 * f)?;
            let down = src.vector(&format!("{p}down_proj"), i, e * f * h)?;
            let down_b = src.vector(&format!("{p}down_proj_bias"), i, e * h)?;
            (0..e)
                .map(|x| {
                    let gu = &gate_up[x * h * 2 * f..(x + 1) * h * 2 * f];
                    // Row j of the gate is column 2j of `gu` (up: 2j + 1).
                    let take = |odd: usize| -> Vec<f32> {
                        (0..f)
                            .flat_map(|j| (0..h).map(move |k| gu[k * 2 * f + 2 * j + odd]))
                            .collect()
                    };
                    let dn = &down[x * f * h..(x + 1) * f * h];
                    let down_rows: Vec<f32> = (0..h)
                        .flat_map(|r| (0..f).map(move |j| dn[j * h + r]))
                        .collect();
                    let name = |s: &str| format!("model.layers.{i}.mlp.experts.{x}.{s}");
                    Ok(ExpertWeights {
                        gate: f32_weight(be, name("gate"), vec![f, h], &take(0))?,
                        up: f32_weight(be, name("up"), vec![f, h], &take(1))?,
                        down: f32_weight(be, name("down"), vec![h, f], &down_rows)?,
                        biases: Some(hf_expert_biases(be, (i, x), (f, h), &gate_up_b, &down_b)?),
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(MoeLayer {
            router,
            choice_bias: None,
            shared: None,
            router_bias,
            experts,
            activation,
            expert_scale: None,
        })
    }
}

/// An MXFP4 checkpoint's experts (`openai/gpt-oss-*` as published): per projection a
/// `_blocks` tensor `[E, rows, cols / 32, 16]` of packed E2M1 codes (value `2k` in the low
/// nibble of byte `k`, `2k + 1` in its high nibble), a `_scales` tensor `[E, rows, cols / 32]`
/// of E8M0 exponents, and a bias `[E, rows]`; `gate_up` interleaves gate and up rows (gate
/// row `j` is row `2j`). Rows are in the output dimension, as GGUF's. Each expert's matrices
/// are rewritten into GGML's MXFP4 blocks (exponent, then values `k` and `k + 16` in byte
/// `k`'s low and high nibbles): the same values, so the same matrix as the GGUF's.
fn hf_mxfp4_experts<B: Backend>(
    be: &B,
    src: &WeightSource,
    i: usize,
    e: usize,
    f: usize,
    h: usize,
) -> Result<Vec<ExpertWeights<B::Weight>>> {
    let p = "model.layers.{i}.mlp.experts.";
    let pair = |name: &str, rows: usize, cols: usize| -> Result<(&RawTensor, &RawTensor)> {
        let get = |suffix: &str, shape: &[usize]| -> Result<&RawTensor> {
            let n = format!("{p}{name}_{suffix}");
            let t = src
                .tensor(&n, i)
                .ok_or_else(|| Error::Weights(format!("missing tensor {:?}", src.name(&n, i))))?;
            if t.dtype != DType::U8 || t.shape != shape {
                return Err(Error::Weights(format!(
                    "{}: {} {:?}, expected U8 {shape:?}",
                    src.name(&n, i),
                    t.dtype,
                    t.shape
                )));
            }
            Ok(t)
        };
        if !cols.is_multiple_of(32) {
            return Err(Error::Weights(format!(
                "{}: MXFP4 rows of {cols} values are not whole blocks of 32",
                src.name(&format!("{p}{name}_blocks"), i)
            )));
        }
        Ok((
            get("blocks", &[e, rows, cols / 32, 16])?,
            get("scales", &[e, rows, cols / 32])?,
        ))
    };
    let (gu_blocks, gu_scales) = pair("gate_up_proj", 2 * f, h)?;
    let (dn_blocks, dn_scales) = pair("down_proj", h, f)?;
    let gate_up_b = src.vector(&format!("{p}gate_up_proj_bias"), i, e * 2 * f)?;
    let down_b = src.vector(&format!("{p}down_proj_bias"), i, e * h)?;
    let load = |name: String, rows: usize, cols: usize, bytes: Vec<u8>| {
        owned_weight(be, name, DType::Mxfp4, vec![rows, cols], bytes)
    };
    (0..e)
        .map(|x| {
            let name = |s: &str| format!("model.layers.{i}.mlp.experts.{x}.{s}");
            let gate_rows: Vec<usize> = (0..f).map(|j| 2 * j).collect();
            let up_rows: Vec<usize> = (0..f).map(|j| 2 * j + 1).collect();
            let down_rows: Vec<usize> = (0..h).collect();
            Ok(ExpertWeights {
                gate: load(
                    name("gate"),
                    f,
                    h,
                    mxfp4_rows(gu_blocks, gu_scales, x, 2 * f, h, &gate_rows),
                )?,
                up: load(
                    name("up"),
                    f,
                    h,
                    mxfp4_rows(gu_blocks, gu_scales, x, 2 * f, h, &up_rows),
                )?,
                down: load(
                    name("down"),
                    h,
                    f,
                    mxfp4_rows(dn_blocks, dn_scales, x, h, f, &down_rows),
                )?,
                biases: Some(hf_expert_biases(be, (i, x), (f, h), &gate_up_b, &down_b)?),
            })
        })
        .collect()
}

/// A weight the loader made (rewritten or transposed from the file), handed to the backend
/// like one read from the file.
fn owned_weight<B: Backend>(
    be: &B,
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
) -> Result<B::Weight> {
    let t = RawTensor::from_bytes(&name, dtype, shape, bytes)
        .ok_or_else(|| Error::Weights(format!("{name}: bad size")))?;
    be.load_weight(&t)
}

/// [`owned_weight`] of f32 values: a matrix `[rows, cols]`, or a vector `[n]` (a bias, which
/// the backend keeps as it is).
fn f32_weight<B: Backend>(be: &B, name: String, shape: Vec<usize>, v: &[f32]) -> Result<B::Weight> {
    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    owned_weight(be, name, DType::F32, shape, bytes)
}

/// Expert `x`'s gate, up and down biases from a Hugging Face gpt-oss layer's stacked
/// `gate_up_proj_bias` `[E, 2F]` (gate even, up odd) and `down_proj_bias` `[E, H]`.
fn hf_expert_biases<B: Backend>(
    be: &B,
    (i, x): (usize, usize),
    (f, h): (usize, usize),
    gate_up_b: &[f32],
    down_b: &[f32],
) -> Result<[B::Weight; 3]> {
    let gub = &gate_up_b[x * 2 * f..(x + 1) * 2 * f];
    let (gate, up): (Vec<f32>, Vec<f32>) = gub.chunks_exact(2).map(|p| (p[0], p[1])).unzip();
    let name = |s: &str| format!("model.layers.{i}.mlp.experts.{x}.{s}");
    Ok([
        f32_weight(be, name("gate_bias"), vec![f], &gate)?,
        f32_weight(be, name("up_bias"), vec![f], &up)?,
        f32_weight(be, name("down_bias"), vec![h], &down_b[x * h..(x + 1) * h])?,
    ])
}

/// Rows `rows` of expert `x` (of `n_rows` rows of `cols` values) from Hugging Face MXFP4
/// blocks and scales, as GGML MXFP4 bytes.
fn mxfp4_rows(
    blocks: &RawTensor,
    scales: &RawTensor,
    x: usize,
    n_rows: usize,
    cols: usize,
    rows: &[usize],
) -> Vec<u8> {
    let per_row = cols / 32;
    let (b, s) = (blocks.bytes(), scales.bytes());
    let mut out = Vec::with_capacity(rows.len() * per_row * 17);
    for &r in rows {
        for k in 0..per_row {
            let at = (x * n_rows + r) * per_row + k;
            out.push(s[at]);
            let hf = &b[16 * at..16 * at + 16];
            // HF value v sits in byte v / 2, low nibble for even v; GGML's byte j holds values
            // j (low) and j + 16 (high).
            let code = |v: usize| (hf[v / 2] >> (4 * (v % 2))) & 0x0f;
            out.extend((0..16).map(|j| code(j) | code(j + 16) << 4));
        }
    }
    out
}

/// Layer `i`'s experts where a Hugging Face file stacks them as transformers 5 holds them
/// (Mistral 4; Gemma 4 without the `mlp.`), under the prefix `p`: `gate_up_proj` `[E, 2F, H]` (each expert's gate rows, then its
/// up rows) and `mlp.experts.down_proj` `[E, H, F]`, each expert a view of the stack. Or as
/// the published Qwen3-VL-MoE checkpoints stack them, as `x · W`: `gate_up_proj` `[E, H, 2F]`
/// (gate columns, then up columns) and `down_proj` `[E, F, H]`, transposed here in their own
/// float format (the two layouts differ in `down_proj`'s shape whenever H ≠ F, and in
/// `gate_up_proj`'s otherwise). `None` where the file keeps one tensor per expert.
fn hf_stacks<B: Backend>(
    be: &B,
    src: &WeightSource,
    p: &str,
    i: usize,
    e: usize,
    f: usize,
    h: usize,
) -> Result<Option<Vec<ExpertWeights<B::Weight>>>> {
    let (gu_name, down_name) = (format!("{p}gate_up_proj"), format!("{p}down_proj"));
    let (Some(gu), Some(down)) = (src.tensor(&gu_name, i), src.tensor(&down_name, i)) else {
        return Ok(None);
    };
    if (gu.shape == [e, h, 2 * f] && down.shape == [e, f, h])
        && (gu.shape != [e, 2 * f, h] || down.shape != [e, h, f])
    {
        return (0..e)
            .map(|x| {
                let name = |s: &str| format!("{}[{x}].{s}", gu.name);
                Ok(ExpertWeights {
                    gate: be.load_weight(&transposed(gu, x, (0, f), name("gate"))?)?,
                    up: be.load_weight(&transposed(gu, x, (f, f), name("up"))?)?,
                    down: be.load_weight(&transposed(down, x, (0, h), name("down"))?)?,
                    biases: None,
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some);
    }
    for (t, want) in [(gu, [e, 2 * f, h]), (down, [e, h, f])] {
        if t.shape != want {
            return Err(Error::Weights(format!(
                "tensor {:?} has shape {:?}, expected {want:?}",
                t.name, t.shape
            )));
        }
    }
    let gates = row_blocks(be, gu, e, f, f)?;
    let ups = match gu.rows(f, 2 * e * f - f) {
        Some(t) => row_blocks(be, &t, e, f, f)?,
        None => return Err(Error::Weights(format!("{}: too few rows", gu.name))),
    };
    let downs = row_blocks(be, down, e, h, 0)?;
    Ok(Some(
        gates
            .into_iter()
            .zip(ups)
            .zip(downs)
            .map(|((gate, up), down)| ExpertWeights {
                gate,
                up,
                down,
                biases: None,
            })
            .collect(),
    ))
}

/// Columns `first..first + count` of matrix `x` of the unquantised stack `t` (`[E, rows,
/// cols]`) as a `[count, rows]` matrix of the same format: the rows a matmul reads of an
/// `x · W` weight.
fn transposed(
    t: &ferrum_loader::RawTensor,
    x: usize,
    (first, count): (usize, usize),
    name: String,
) -> Result<ferrum_loader::RawTensor> {
    let bad = || Error::Weights(format!("{}: cannot take expert {x}'s columns", t.name));
    let [_, rows, cols] = <[usize; 3]>::try_from(t.shape.as_slice()).map_err(|_| bad())?;
    if t.dtype.is_quantized() || t.dtype.block_len() != 1 || first + count > cols {
        return Err(bad());
    }
    let size = t.dtype.block_bytes();
    let m = t
        .bytes()
        .get(x * rows * cols * size..(x + 1) * rows * cols * size)
        .ok_or_else(bad)?;
    let mut out = Vec::with_capacity(count * rows * size);
    for c in first..first + count {
        for r in 0..rows {
            let at = (r * cols + c) * size;
            out.extend_from_slice(&m[at..at + size]);
        }
    }
    ferrum_loader::RawTensor::from_bytes(&name, t.dtype, vec![count, rows], out).ok_or_else(bad)
}

/// Layer `i`'s stacked gate, up and down expert tensors of a GGUF file (`[E, F, H]`,
/// `[E, F, H]`, `[E, H, F]`), shapes checked.
fn gguf_stacks<B: Backend>(
    be: &B,
    src: &WeightSource,
    i: usize,
    e: usize,
    f: usize,
    h: usize,
) -> Result<[B::Weight; 3]> {
    let (g, u, d) = names::GGUF_EXPERTS;
    Ok([
        gguf_stack(be, src, i, g, [e, f, h])?,
        gguf_stack(be, src, i, u, [e, f, h])?,
        gguf_stack(be, src, i, d, [e, h, f])?,
    ])
}

/// Layer `i`'s stacked expert tensor named by `template`, its shape checked.
fn gguf_stack<B: Backend>(
    be: &B,
    src: &WeightSource,
    i: usize,
    template: &str,
    shape: [usize; 3],
) -> Result<B::Weight> {
    let name = template.replace("{i}", &i.to_string());
    let t = src
        .store
        .get(&name)
        .ok_or_else(|| Error::Weights(format!("missing tensor {name:?}")))?;
    if t.shape != shape {
        return Err(Error::Weights(format!(
            "tensor {name:?} has shape {:?}, expected {shape:?}",
            t.shape
        )));
    }
    be.load_weight(t)
}

/// Per-token routing decisions and the per-expert token lists built from them. The vectors
/// are reused from chunk to chunk.
pub struct Router {
    n_experts: usize,
    n_active: usize,
    norm_topk_prob: bool,
    routing: Routing,
    /// One token's scores (softmax or sigmoid), which weigh the chosen experts.
    probs: Vec<f32>,
    /// The scores that choose: `probs` plus any correction bias, `-inf` outside the chosen
    /// groups.
    choice: Vec<f32>,
    /// `tokens[e]` / `weights[e]`: the tokens routed to expert `e`, in token order.
    tokens: Vec<Vec<u32>>,
    weights: Vec<Vec<f32>>,
}

impl Router {
    pub fn new(m: &MoeConfig) -> Self {
        Router {
            n_experts: m.n_experts,
            n_active: m.n_active,
            norm_topk_prob: m.norm_topk_prob,
            routing: m.routing,
            probs: Vec::new(),
            choice: Vec::new(),
            tokens: vec![Vec::new(); m.n_experts],
            weights: vec![Vec::new(); m.n_experts],
        }
    }

    /// Top-k experts of one token's router logits, highest choice score first, as
    /// `(expert, weight)`. Scores are a softmax over all experts or each one's sigmoid; the
    /// choice adds `bias` (a layer's score correction) and, with groups, keeps only the
    /// groups whose two best choice scores sum highest; the k largest are taken (a tie goes
    /// to the lower index, for groups too); their unbiased scores are renormalised to sum to
    /// one when `norm_topk_prob` (transformers' sigmoid routers add 1e-20 to the sum), then
    /// multiplied by the routing scale.
    pub fn route_token(&mut self, logits: &[f32], bias: Option<&[f32]>) -> Vec<(usize, f32)> {
        let r = self.routing;
        self.probs.clear();
        match r.gating {
            Gating::Softmax => {
                let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                self.probs.extend(logits.iter().map(|&l| (l - max).exp()));
                let z: f32 = self.probs.iter().sum();
                for p in &mut self.probs {
                    *p /= z;
                }
            }
            Gating::Sigmoid => self
                .probs
                .extend(logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp()))),
        }
        self.choice.clear();
        match bias {
            Some(b) => self
                .choice
                .extend(self.probs.iter().zip(b).map(|(p, b)| p + b)),
            None => self.choice.extend_from_slice(&self.probs),
        }
        if r.groups > 1 && r.groups_used < r.groups {
            let per = self.choice.len() / r.groups;
            let best_two = |g: &[f32]| {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in g {
                    if v > a {
                        (a, b) = (v, a);
                    } else if v > b {
                        b = v;
                    }
                }
                if per < 2 {
                    a
                } else {
                    a + b
                }
            };
            let sums: Vec<f32> = self.choice.chunks(per).map(best_two).collect();
            let mut order: Vec<usize> = (0..r.groups).collect();
            order.sort_by(|&a, &b| sums[b].total_cmp(&sums[a]).then(a.cmp(&b)));
            for &g in &order[r.groups_used..] {
                self.choice[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| self.choice[b].total_cmp(&self.choice[a]).then(a.cmp(&b)));
        order.truncate(self.n_active);
        let mut picked: Vec<(usize, f32)> = order.iter().map(|&e| (e, self.probs[e])).collect();
        if self.norm_topk_prob {
            let mut s: f32 = picked.iter().map(|p| p.1).sum();
            if r.gating == Gating::Sigmoid {
                s += 1e-20;
            }
            for p in &mut picked {
                p.1 /= s;
            }
        }
        if r.scale != 1.0 {
            for p in &mut picked {
                p.1 *= r.scale;
            }
        }
        picked
    }

    /// Routes `n` tokens (row-major router logits; `bias` the layer's score correction) and
    /// groups them by expert. `counts[e]` is increased by the number of tokens expert `e`
    /// received.
    pub fn route(&mut self, logits: &[f32], bias: Option<&[f32]>, n: usize, counts: &mut [u64]) {
        for e in 0..self.n_experts {
            self.tokens[e].clear();
            self.weights[e].clear();
        }
        for t in 0..n {
            let row = &logits[t * self.n_experts..(t + 1) * self.n_experts];
            for (e, w) in self.route_token(row, bias) {
                self.tokens[e].push(t as u32);
                self.weights[e].push(w);
                counts[e] += 1;
            }
        }
    }

    /// Multiplies every routing weight by its expert's `scale` (Gemma 4).
    pub fn scale_experts(&mut self, scale: &[f32]) {
        for (w, s) in self.weights.iter_mut().zip(scale) {
            w.iter_mut().for_each(|w| *w *= s);
        }
    }

    /// The active experts' batches, in expert order.
    pub fn batches(&self) -> Vec<ExpertBatch<'_>> {
        (0..self.n_experts)
            .filter(|&e| !self.tokens[e].is_empty())
            .map(|e| ExpertBatch {
                expert: e,
                tokens: &self.tokens[e],
                weights: &self.weights[e],
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(k: usize, norm: bool) -> MoeConfig {
        MoeConfig {
            style: MoeStyle::Qwen,
            n_experts: 4,
            n_active: k,
            expert_ffn: 8,
            norm_topk_prob: norm,
            mlp_only_layers: vec![],
            sparse_step: 1,
            shared_ffn: None,
            shared_gate: false,
            routing: Routing::SOFTMAX,
        }
    }

    #[test]
    fn top_k_softmax_and_ties_to_the_lower_index() {
        let mut r = Router::new(&cfg(2, false));
        let picked = r.route_token(&[1.0, 3.0, 3.0, 0.0], None);
        assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
        let z = 1f32.exp() + 2.0 * 3f32.exp() + 1.0;
        assert!((picked[0].1 - 3f32.exp() / z).abs() < 1e-6);
        let mut r = Router::new(&cfg(2, true));
        let picked = r.route_token(&[1.0, 3.0, 3.0, 0.0], None);
        assert!((picked[0].1 - 0.5).abs() < 1e-6 && (picked[1].1 - 0.5).abs() < 1e-6);
    }

    #[test]
    fn grouping_keeps_token_order_and_counts() {
        let mut r = Router::new(&cfg(1, true));
        let mut counts = vec![0; 4];
        r.route(
            &[0.0, 5.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0],
            None,
            3,
            &mut counts,
        );
        assert_eq!(counts, vec![1, 2, 0, 0]);
        let b = r.batches();
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].expert, b[0].tokens), (0, &[1u32][..]));
        assert_eq!((b[1].expert, b[1].tokens), (1, &[0u32, 2][..]));
    }

    /// Hugging Face's nibble order (value 2k low, 2k + 1 high in byte k) becomes GGML's
    /// (value j low, j + 16 high in byte j), with the exponent in front, row by row.
    #[test]
    fn hf_mxfp4_blocks_become_ggml_blocks() {
        let codes: Vec<u8> = (0..64u32).map(|v| ((v * 7 + 3) % 16) as u8).collect(); // two rows
        let hf: Vec<u8> = codes.chunks(2).map(|p| p[0] | p[1] << 4).collect();
        let blocks = RawTensor::from_bytes("b", DType::U8, vec![1, 2, 1, 16], hf).unwrap();
        let scales = RawTensor::from_bytes("s", DType::U8, vec![1, 2, 1], vec![120, 130]).unwrap();
        let got = mxfp4_rows(&blocks, &scales, 0, 2, 32, &[1, 0]);
        let ggml = |row: &[u8], e: u8| {
            let mut b = vec![e];
            b.extend((0..16).map(|j| row[j] | row[j + 16] << 4));
            b
        };
        let mut want = ggml(&codes[32..], 130);
        want.extend(ggml(&codes[..32], 120));
        assert_eq!(got, want);
    }
}
