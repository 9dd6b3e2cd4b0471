//! Corrupt model files must give an error naming the problem — never a panic, and never an
//! attempt to allocate what a lying header asks for.

use ferrum_loader::gguf::writer::{write, WTensor};
use ferrum_loader::{GgufFile, HfFolder, ModelFile, Value};
use rand::{Rng, SeedableRng};

use ferrum_core::temp::TempPath as Tmp;

fn tmp(name: &str, bytes: &[u8]) -> Tmp {
    let p = Tmp::new("ferrum-loader", name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn valid_gguf() -> Vec<u8> {
    let data: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    write(
        &[
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", Value::U32(1)),
            (
                "tokenizer.ggml.tokens",
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            ),
        ],
        &[
            WTensor {
                name: "w",
                dims: vec![16, 4],
                ggml_type: 0,
                data: &data,
            },
            WTensor {
                name: "v",
                dims: vec![16],
                ggml_type: 0,
                data: &data[..64],
            },
        ],
    )
}

fn open_err(name: &str, bytes: &[u8]) -> String {
    match GgufFile::open(tmp(name, bytes)) {
        Ok(_) => panic!("{name}: corrupt file was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn valid_file_round_trips() {
    let p = tmp("valid.gguf", &valid_gguf());
    let g = GgufFile::open(&p).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_u64("llama.block_count"), Some(1));
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap(),
        vec!["a", "b"]
    );
    let t = g.tensors();
    let w = t.get("w").unwrap();
    assert_eq!(w.shape, vec![4, 16]);
    assert_eq!(&w.bytes()[4..8], &1f32.to_le_bytes());
    assert_eq!(t.get("v").unwrap().shape, vec![16]);
}

#[test]
fn arrays_are_checked_at_open_and_read_from_the_file() {
    let g = GgufFile::open(tmp("arrays.gguf", &valid_gguf())).unwrap();
    assert_eq!(
        g.get("tokenizer.ggml.tokens").unwrap().into_owned(),
        Value::Array(vec![Value::String("a".into()), Value::String("b".into())])
    );
    assert_eq!(g.get_str("tokenizer.ggml.tokens"), None);
    assert_eq!(g.get_i64_array("tokenizer.ggml.tokens"), None);
    // Arrays are kept in the file, not copied, but still checked whole when it is opened.
    let mut b = valid_gguf();
    let a = b
        .windows(9)
        .position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b'a'])
        .unwrap();
    b[a + 8] = 0xff;
    let e = open_err("array-utf8.gguf", &b);
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("UTF-8"),
        "{e}"
    );
}

#[test]
fn wrong_magic() {
    let mut b = valid_gguf();
    b[0] = b'X';
    let e = open_err("magic.gguf", &b);
    assert!(
        e.contains("not a GGUF file") && e.contains("magic.gguf"),
        "{e}"
    );
}

#[test]
fn unsupported_version() {
    let mut b = valid_gguf();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(open_err("v1.gguf", &b).contains("version 1"));
}

#[test]
fn truncated_everywhere() {
    let b = valid_gguf();
    // Every prefix of the file is either fully rejected or (never) accepted.
    for len in 0..b.len() {
        let e = open_err("trunc.gguf", &b[..len]);
        assert!(e.contains("trunc.gguf"), "{e}");
    }
}

#[test]
fn tensor_data_past_end() {
    let mut b = valid_gguf();
    b.truncate(b.len() - 10);
    let e = open_err("short.gguf", &b);
    assert!(e.contains("past the end"), "{e}");
}

#[test]
fn absurd_counts_and_lengths_do_not_allocate() {
    let b = valid_gguf();
    // Tensor count (bytes 8..16) and metadata count (16..24).
    for (at, what) in [(8, "tensor count"), (16, "metadata count")] {
        let mut x = b.clone();
        x[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = open_err("count.gguf", &x);
        assert!(e.contains(what), "{e}");
    }
    // The first key's string length.
    let mut x = b.clone();
    x[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(open_err("strlen.gguf", &x).contains("string length"));
}

#[test]
fn unknown_tensor_type_names_the_tensor() {
    let data = vec![0u8; 64];
    let b = write(
        &[],
        &[WTensor {
            name: "mystery",
            dims: vec![16],
            ggml_type: 99,
            data: &data,
        }],
    );
    let e = open_err("type.gguf", &b);
    assert!(e.contains("mystery") && e.contains("99"), "{e}");
}

#[test]
fn fuzzed_headers_never_panic() {
    let base = valid_gguf();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1234);
    let header_len = base.len() - 64 * 4;
    for i in 0..3000 {
        let mut b = base.clone();
        for _ in 0..rng.gen_range(1..6) {
            let at = rng.gen_range(4..header_len);
            b[at] = rng.gen();
        }
        // Either outcome is fine; what matters is no panic and a bounded allocation.
        let p = tmp(&format!("fuzz{}.gguf", i % 4), &b);
        if let Ok(g) = GgufFile::open(&p) {
            for t in g.tensors().tensors.values() {
                let _ = t.bytes().len();
            }
        }
    }
}

#[test]
fn safetensors_with_lying_header() {
    let dir = Tmp::new("ferrum-loader", "st");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures":["LlamaForCausalLM"]}"#,
    )
    .unwrap();
    // The header claims 4096 bytes of data; the file carries 16.
    let header = br#"{"w":{"dtype":"F32","shape":[32,32],"data_offsets":[0,4096]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0u8; 16]);
    std::fs::write(dir.join("model.safetensors"), &b).unwrap();
    let e = HfFolder::open(&dir)
        .err()
        .expect("lying header accepted")
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("invalid safetensors"),
        "{e}"
    );

    // A header length larger than the file.
    let mut b = (1u64 << 40).to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    std::fs::write(dir.join("model.safetensors"), &b).unwrap();
    assert!(HfFolder::open(&dir).is_err());

    // config.json that is not JSON.
    std::fs::write(dir.join("config.json"), "{nope").unwrap();
    let e = HfFolder::open(&dir).err().unwrap().to_string();
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn missing_path_is_an_error() {
    assert!(ModelFile::open("/nonexistent/model.gguf").is_err());
}

/// MXFP4 (type 39): a row that is not whole blocks of 32 values, and a tensor whose blocks
/// run past the end of the file, are errors naming the tensor.
#[test]
fn bad_mxfp4_tensors_are_named() {
    let data = vec![0x7fu8; 17 * 4];
    let file = |dims: Vec<u64>, bytes: &[u8]| {
        write(
            &[],
            &[WTensor {
                name: "blk.0.ffn_down_exps.weight",
                dims,
                ggml_type: 39,
                data: bytes,
            }],
        )
    };
    // 48 values a row: one and a half blocks.
    let e = open_err("mxfp4-row.gguf", &file(vec![48, 1], &data[..34]));
    assert!(e.contains("blk.0.ffn_down_exps.weight"), "{e}");
    // Four blocks declared, then the file cut inside the third.
    let mut b = file(vec![64, 2], &data);
    b.truncate(b.len() - 30);
    let e = open_err("mxfp4-short.gguf", &b);
    assert!(
        e.contains("blk.0.ffn_down_exps.weight") && e.contains("past the end"),
        "{e}"
    );
    // Whole, it opens, and reads as MXFP4.
    let ok = tmp("mxfp4-ok.gguf", &file(vec![64, 2], &data));
    let g = GgufFile::open(&ok).unwrap();
    let store = g.tensors();
    let t = store.get("blk.0.ffn_down_exps.weight").expect("the tensor");
    assert_eq!(t.dtype, ferrum_core::DType::Mxfp4);
}
