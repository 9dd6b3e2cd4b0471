//! Weight names. Models look weights up by their Hugging Face name; this table gives the
//! GGUF name for each, so one load function serves both file kinds. `{i}` is the layer.

/// `(Hugging Face name, GGUF name)` for the tensors of a Llama-style decoder.
pub const DECODER: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    (
        "model.layers.{i}.input_layernorm.weight",
        "blk.{i}.attn_norm.weight",
    ),
    (
        "model.layers.{i}.self_attn.q_proj.weight",
        "blk.{i}.attn_q.weight",
    ),
    (
        "model.layers.{i}.self_attn.k_proj.weight",
        "blk.{i}.attn_k.weight",
    ),
    (
        "model.layers.{i}.self_attn.v_proj.weight",
        "blk.{i}.attn_v.weight",
    ),
    (
        "model.layers.{i}.self_attn.q_proj.bias",
        "blk.{i}.attn_q.bias",
    ),
    (
        "model.layers.{i}.self_attn.k_proj.bias",
        "blk.{i}.attn_k.bias",
    ),
    (
        "model.layers.{i}.self_attn.v_proj.bias",
        "blk.{i}.attn_v.bias",
    ),
    (
        "model.layers.{i}.self_attn.q_norm.weight",
        "blk.{i}.attn_q_norm.weight",
    ),
    (
        "model.layers.{i}.self_attn.k_norm.weight",
        "blk.{i}.attn_k_norm.weight",
    ),
    (
        "model.layers.{i}.self_attn.o_proj.weight",
        "blk.{i}.attn_output.weight",
    ),
    (
        "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight",
    ),
    (
        "model.layers.{i}.mlp.gate_proj.weight",
        "blk.{i}.ffn_gate.weight",
    ),
    (
        "model.layers.{i}.mlp.up_proj.weight",
        "blk.{i}.ffn_up.weight",
    ),
    (
        "model.layers.{i}.mlp.down_proj.weight",
        "blk.{i}.ffn_down.weight",
    ),
    ("rope_freqs.weight", "rope_freqs.weight"),
    // Mixture of experts: the router. Expert weights are per expert in Hugging Face files
    // (`mlp.experts.{e}.gate_proj.weight`) and stacked in GGUF (`ffn_gate_exps`, [E, F, H]);
    // `moe.rs` handles both.
    (
        "model.layers.{i}.mlp.gate.weight",
        "blk.{i}.ffn_gate_inp.weight",
    ),
    // Multi-head latent attention (DeepSeek-V3).
    (
        "model.layers.{i}.self_attn.q_a_proj.weight",
        "blk.{i}.attn_q_a.weight",
    ),
    (
        "model.layers.{i}.self_attn.q_a_layernorm.weight",
        "blk.{i}.attn_q_a_norm.weight",
    ),
    (
        "model.layers.{i}.self_attn.q_b_proj.weight",
        "blk.{i}.attn_q_b.weight",
    ),
    (
        "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
        "blk.{i}.attn_kv_a_mqa.weight",
    ),
    (
        "model.layers.{i}.self_attn.kv_a_layernorm.weight",
        "blk.{i}.attn_kv_a_norm.weight",
    ),
    (
        "model.layers.{i}.self_attn.kv_b_proj.weight",
        "blk.{i}.attn_kv_b.weight",
    ),
    // DeepSeek-V3 / GLM-4.5: the router's score correction and the shared experts.
    (
        "model.layers.{i}.mlp.gate.e_score_correction_bias",
        "blk.{i}.exp_probs_b.bias",
    ),
    (
        "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
        "blk.{i}.ffn_gate_shexp.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_experts.up_proj.weight",
        "blk.{i}.ffn_up_shexp.weight",
    ),
    (
        "model.layers.{i}.mlp.shared_experts.down_proj.weight",
        "blk.{i}.ffn_down_shexp.weight",
    ),
];

/// GGUF names of the stacked expert tensors: `(gate, up, down)`.
pub const GGUF_EXPERTS: (&str, &str, &str) = (
    "blk.{i}.ffn_gate_exps.weight",
    "blk.{i}.ffn_up_exps.weight",
    "blk.{i}.ffn_down_exps.weight",
);

/// The GGUF name of a Hugging Face tensor name with the layer index filled in.
pub fn gguf_name(hf_template: &str, layer: usize) -> Option<String> {
    DECODER
        .iter()
        .find(|(hf, _)| *hf == hf_template)
        .map(|(_, g)| g.replace("{i}", &layer.to_string()))
}

/// The GGUF name of a concrete Hugging Face tensor name (`model.layers.3.mlp.up_proj.weight`
/// → `blk.3.ffn_up.weight`), or `None` if the table has no entry for it.
pub fn hf_to_gguf(hf: &str) -> Option<String> {
    for (h, g) in DECODER {
        match h.split_once("{i}") {
            None if hf == *h => return Some(g.to_string()),
            None => {}
            Some((pre, post)) => {
                if let Some(mid) = hf.strip_prefix(pre).and_then(|r| r.strip_suffix(post)) {
                    if !mid.is_empty() && mid.bytes().all(|b| b.is_ascii_digit()) {
                        return Some(g.replace("{i}", mid));
                    }
                }
            }
        }
    }
    None
}

/// A query or key projection's `out` rows (each `row` elements wide: values, or bytes of any
/// format) in llama.cpp's order for the interleaved rotation (`to_gguf`), or back: within each
/// of `heads` heads the two halves' rows alternate, as llama.cpp's converter permutes them.
pub(crate) fn permute_rope_rows<T: Copy + Default>(
    b: &[T],
    row: usize,
    heads: usize,
    out: usize,
    to_gguf: bool,
) -> Vec<T> {
    let d = out / heads;
    let half = d / 2;
    let mut p = vec![T::default(); b.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..half {
                let hf = h * d + j * half + i;
                let gg = h * d + 2 * i + j;
                let (from, to) = if to_gguf { (hf, gg) } else { (gg, hf) };
                p[to * row..(to + 1) * row].copy_from_slice(&b[from * row..(from + 1) * row]);
            }
        }
    }
    p
}
