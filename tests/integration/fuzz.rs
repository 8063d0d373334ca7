//! Property tests over the parsers of untrusted files: the safetensors header reader, the GGUF
//! reader, `quantization_config` parsing and calibration `.jsonl`. For any input they return a
//! value or an error, never panic, and never allocate beyond what the file holds (the readers
//! bound every length by the file's size; a run that tried would abort the test process).
//! Bounded: a few hundred cases each, seeded, so `cargo test` stays fast and repeatable; cases
//! that once failed are kept in `tests/fuzz.proptest-regressions` and replayed first.

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, RngSeed};
use soar_gptq::checkpoint::shards::{write_sharded, TensorSpec};
use soar_gptq::checkpoint::{Checkpoint, Dtype};
use std::path::Path;

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        // The same cases on every run (CI included); regressions are replayed first.
        rng_seed: RngSeed::Fixed(0x50a2),
        ..Config::default()
    }
}

/// A valid two-tensor safetensors file written by our writer.
fn valid_safetensors() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let specs = vec![
        TensorSpec::new("a.weight", Dtype::BF16, vec![4, 8]),
        TensorSpec::new("b.qweight", Dtype::I32, vec![2, 3]),
    ];
    let files = write_sharded(dir.path(), &specs, u64::MAX, |s, w| {
        std::io::Write::write_all(w, &vec![7u8; s.nbytes() as usize])?;
        Ok(())
    })
    .unwrap();
    std::fs::read(dir.path().join(&files[0].name)).unwrap()
}

/// Applies `edits` (position, byte) and a truncation to `base`.
fn mutate(base: &[u8], edits: &[(usize, u8)], keep: usize) -> Vec<u8> {
    let mut b = base.to_vec();
    for &(i, v) in edits {
        if !b.is_empty() {
            let n = b.len();
            b[i % n] = v;
        }
    }
    b.truncate(keep.max(1).min(b.len()));
    b
}

fn open_bytes(bytes: &[u8]) -> anyhow::Result<Checkpoint> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    Checkpoint::open_files(dir.path(), &["model.safetensors".to_string()])
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn safetensors_reader_never_panics_on_mutations(
        edits in prop::collection::vec((0usize..4096, any::<u8>()), 0..8),
        keep in 0usize..4096,
    ) {
        let base = valid_safetensors();
        let bytes = mutate(&base, &edits, keep);
        if let Ok(ck) = open_bytes(&bytes) {
            // Whatever opens must read back within the file.
            for (name, e) in ck.entries() {
                let b = ck.bytes(name).unwrap();
                prop_assert_eq!(b.len(), e.nbytes());
            }
        }
    }

    #[test]
    fn safetensors_reader_never_panics_on_arbitrary_headers(
        len in any::<u64>(),
        header in ".{0,200}",
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&tail);
        let _ = open_bytes(&bytes);
        // And with the length field telling the truth.
        let mut honest = (header.len() as u64).to_le_bytes().to_vec();
        honest.extend_from_slice(header.as_bytes());
        honest.extend_from_slice(&tail);
        let _ = open_bytes(&honest);
    }
}

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
        "[-+:.a-z_()*\\\\]{0,12}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map("[-+:.a-z_()*]{0,10}", inner, 0..5)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn quantization_settings_parsing_never_panics(
        v in json_value(),
        bits in prop::option::of(json_value()),
        dynamic in prop::option::of(json_value()),
    ) {
        // The parser sees whatever object the file holds, with keys it knows given any value.
        let mut obj = match v {
            serde_json::Value::Object(m) => serde_json::Value::Object(m),
            other => serde_json::json!({ "quant_method": other }),
        };
        obj["group_size"] = serde_json::json!(128);
        if let Some(b) = bits {
            obj["bits"] = b;
        } else {
            obj["bits"] = serde_json::json!(4);
        }
        if let Some(d) = dynamic {
            obj["dynamic"] = d;
        }
        if let Ok(info) = soar_gptq::format::quantized::QuantInfo::from_json(
            obj,
            Path::new("config.json"),
            true,
        ) {
            for m in ["model.layers.0.self_attn.q_proj", "", "x"] {
                let _ = info.module_settings(m);
            }
        }
    }

    #[test]
    fn calibration_jsonl_never_panics(lines in prop::collection::vec(json_value(), 0..6), junk in ".{0,40}") {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.jsonl");
        let mut text = String::new();
        for l in &lines {
            text.push_str(&l.to_string());
            text.push('\n');
        }
        text.push_str(&junk);
        std::fs::write(&p, text).unwrap();
        let chat = soar_gptq::calib::ChatFormat {
            template: Some("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}".into()),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        };
        let spec = soar_gptq::calib::CalibSpec::parse(p.to_str().unwrap()).unwrap();
        let _ = soar_gptq::calib::load_sources(&[spec], &chat);
    }
}

/// A small valid GGUF file (a few metadata entries and tensors), written with candle.
fn valid_gguf() -> Vec<u8> {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let meta = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(1)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        (
            "tokenizer.ggml.tokens",
            Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
        ),
    ];
    let t = Tensor::arange(0f32, 64.0, &Device::Cpu)
        .unwrap()
        .reshape((2, 32))
        .unwrap();
    let tensors = [
        (
            "token_embd.weight",
            QTensor::quantize(&t, GgmlDType::F32).unwrap(),
        ),
        (
            "output_norm.weight",
            QTensor::quantize(&t, GgmlDType::Q8_0).unwrap(),
        ),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta_refs, &tensor_refs).unwrap();
    out.into_inner()
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn gguf_import_never_panics_on_mutations(
        edits in prop::collection::vec((0usize..2048, any::<u8>()), 0..6),
        keep in 0usize..2048,
    ) {
        let base = valid_gguf();
        let bytes = mutate(&base, &edits, keep.max(base.len() / 2));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, &bytes).unwrap();
        let r = soar_gptq::gguf::import_gguf(&soar_gptq::gguf::ImportOptions {
            gguf: p,
            out: dir.path().join("out"),
            force: false,
            shard_bytes: 1 << 30,
        });
        // Not a complete Llama: it must fail, cleanly.
        prop_assert!(r.is_err());
        prop_assert!(!dir.path().join("out").exists());
    }
}
