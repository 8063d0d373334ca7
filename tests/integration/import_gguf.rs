//! `import-gguf` on GGUF files built here (no network): a small Llama written the way
//! llama.cpp's converter writes one (Q/K rows permuted for its RoPE, the tokenizer in the
//! metadata) must come back as the Hugging Face checkpoint it was made from.

use crate::common::*;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use serde_json::{json, Value as Json};
use soar_gptq::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};

/// llama.cpp's `permute` (convert_hf_to_gguf.py): reshape `[heads, 2, d/2, cols]`, swap axes 1
/// and 2, reshape back.
fn permute(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let d = rows / heads;
    let half = d / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for s in 0..2 {
            for j in 0..half {
                let src = (h * d + s * half + j) * cols;
                let dst = (h * d + j * 2 + s) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

type Metadata = Vec<(String, Value)>;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
/// The one tensor stored quantized (Q8_0) rather than as exact F32.
const Q8_TENSOR: &str = "model.layers.1.mlp.up_proj.weight";

fn llama_config() -> Json {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": 4096,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false
    })
}

fn gguf_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (i, local) = rest.split_once('.').unwrap();
    let g = match local {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("{other}"),
    };
    format!("blk.{i}.{g}")
}

/// The GGUF metadata of the repo's byte-level BPE tokenizer (as llama.cpp's converter writes a
/// GPT-2 style vocabulary: added special tokens are CONTROL, the others NORMAL).
fn tokenizer_metadata(tok: &Json) -> Metadata {
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    assert!(tokens.iter().all(|t| !t.is_empty()), "ids are contiguous");
    let special: Vec<u64> = tok["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["special"] == true)
        .map(|a| a["id"].as_u64().unwrap())
        .collect();
    let types: Vec<Value> = (0..tokens.len() as u64)
        .map(|i| Value::I32(if special.contains(&i) { 3 } else { 1 }))
        .collect();
    let merges: Vec<Value> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Json::String(s) => Value::String(s.clone()),
            Json::Array(p) => Value::String(format!(
                "{} {}",
                p[0].as_str().unwrap(),
                p[1].as_str().unwrap()
            )),
            other => panic!("{other}"),
        })
        .collect();
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String("{% for m in messages %}{{ m['content'] }}{% endfor %}".into()),
        ),
    ]
}

/// Writes `src` (a BF16 HF folder of `llama_config()`) as a GGUF file, with `edit` applied to
/// the metadata list before writing.
fn write_gguf(src: &Path, path: &Path, edit: impl FnOnce(&mut Metadata)) {
    let ck = Checkpoint::open(src).unwrap();
    let tok: Json =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let mut meta: Metadata = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("general.name".into(), Value::String("test llama".into())),
        ("llama.block_count".into(), Value::U32(2)),
        ("llama.context_length".into(), Value::U32(512)),
        ("llama.embedding_length".into(), Value::U32(128)),
        ("llama.feed_forward_length".into(), Value::U32(256)),
        (
            "llama.attention.head_count".into(),
            Value::U32(HEADS as u32),
        ),
        (
            "llama.attention.head_count_kv".into(),
            Value::U32(KV_HEADS as u32),
        ),
        ("llama.rope.freq_base".into(), Value::F32(50000.0)),
        ("llama.rope.dimension_count".into(), Value::U32(32)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("llama.vocab_size".into(), Value::U32(4096)),
    ];
    meta.extend(tokenizer_metadata(&tok));
    edit(&mut meta);
    let mut tensors = vec![];
    for (name, e) in ck.entries() {
        let mut data = ck.f32_data(name).unwrap();
        let (rows, cols) = (e.shape[0], e.shape.get(1).copied().unwrap_or(1));
        if name.ends_with("q_proj.weight") {
            data = permute(&data, rows, cols, HEADS);
        } else if name.ends_with("k_proj.weight") {
            data = permute(&data, rows, cols, KV_HEADS);
        }
        let t = Tensor::from_vec(data, e.shape.as_slice(), &Device::Cpu).unwrap();
        let dt = if name == Q8_TENSOR {
            GgmlDType::Q8_0
        } else {
            GgmlDType::F32
        };
        tensors.push((gguf_name(name), QTensor::quantize(&t, dt).unwrap()));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}

fn fixture(root: &Path) -> (PathBuf, PathBuf) {
    let cfg = root.join("llama.json");
    std::fs::write(&cfg, llama_config().to_string()).unwrap();
    let src = root.join("src");
    assert_ok(&run(&[
        "synth",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        src.to_str().unwrap(),
        "--seed",
        "3",
    ]));
    let gguf = root.join("model.gguf");
    write_gguf(&src, &gguf, |_| {});
    (src, gguf)
}

fn import(gguf: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "import-gguf",
        "--gguf",
        gguf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(&args)
}

#[test]
fn a_llama_gguf_comes_back_as_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, gguf) = fixture(tmp.path());
    let out = tmp.path().join("imported");
    let o = import(&gguf, &out, &["--json"]);
    assert_ok(&o);
    let rep: Json = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(rep["unpermuted"], 4, "q and k of two layers");
    assert_eq!(rep["tensor_types"]["Q8_0"], 1);
    assert_eq!(rep["general"]["general.name"], "test llama");

    // Every tensor is the source's, bit for bit (F32 holds BF16 exactly), except the Q8_0 one.
    let (a, b) = (
        Checkpoint::open(&src).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    assert_eq!(a.names().count(), b.names().count());
    for (name, e) in a.entries() {
        let f = b.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(e.shape, f.shape, "{name}");
        assert_eq!(f.dtype.name(), "BF16");
        if name == Q8_TENSOR {
            let (x, y) = (a.f32_data(name).unwrap(), b.f32_data(name).unwrap());
            let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = x
                .iter()
                .zip(&y)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(d > 0.0 && d < 0.02 * m, "{name}: {d} vs {m}");
        } else {
            assert!(
                a.bytes(name).unwrap() == b.bytes(name).unwrap(),
                "{name} differs"
            );
        }
    }

    // The config: same model.
    let read = |d: &Path, f: &str| -> Json {
        serde_json::from_str(&std::fs::read_to_string(d.join(f)).unwrap()).unwrap()
    };
    let (c0, c1) = (read(&src, "config.json"), read(&out, "config.json"));
    for k in [
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ] {
        assert_eq!(c0[k], c1[k], "{k}");
    }
    let tc = read(&out, "tokenizer_config.json");
    assert_eq!(tc["bos_token"], "<s>");
    assert!(tc["chat_template"].as_str().unwrap().contains("messages"));
    assert_eq!(read(&out, "generation_config.json")["eos_token_id"], 2);

    // The tokenizer: the same ids as the original on real text, and lossless.
    let t0 = tokenizers::Tokenizer::from_file(src.join("tokenizer.json")).unwrap();
    let t1 = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let text: String = soar_gptq::eval::DEFAULT_EVAL_TEXT
        .chars()
        .take(40_000)
        .collect();
    let text = format!("{text}\n<|im_start|>user\n2024 + 17 = ?</s>");
    let (e0, e1) = (
        t0.encode(text.as_str(), false).unwrap(),
        t1.encode(text.as_str(), false).unwrap(),
    );
    assert_eq!(e0.get_ids(), e1.get_ids());
    assert_eq!(t1.decode(e1.get_ids(), false).unwrap(), text);

    // Same model, same scores: the comparison sees only the Q8_0 tensor's rounding.
    let o = run(&[
        "eval-ppl",
        "--model",
        src.to_str().unwrap(),
        "--compare",
        out.to_str().unwrap(),
        "--seqlen",
        "128",
        "--max-windows",
        "4",
        "--device",
        "cpu",
        "--json",
    ]);
    assert_ok(&o);
    let c: Json = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(c["compared"][0]["mean_kl"].as_f64().unwrap() < 1e-3, "{c}");
    assert!(
        c["compared"][0]["top1_agreement"].as_f64().unwrap() > 0.95,
        "{c}"
    );
    assert_ok(&run(&["inspect", out.to_str().unwrap()]));

    // An existing --out is refused without --force, and kept.
    assert_fails(&import(&gguf, &out, &[]), 1, "already exists");
    assert_ok(&import(&gguf, &out, &["--force"]));
    // The folder that holds the .gguf is never an output, --force or not.
    let sha = soar_gptq::checkpoint::manifest::sha256_file(&gguf).unwrap();
    assert_fails(
        &import(&gguf, tmp.path(), &["--force"]),
        1,
        "contains the input --gguf",
    );
    assert_eq!(
        soar_gptq::checkpoint::manifest::sha256_file(&gguf).unwrap(),
        sha
    );
}

#[test]
fn tied_embeddings_and_bad_files_fail_or_pass_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let (src, gguf) = fixture(root);
    let bad = |name: &str, edit: &dyn Fn(&mut Metadata), needle: &str| {
        let p = root.join(format!("{name}.gguf"));
        write_gguf(&src, &p, edit);
        let out = root.join(name);
        assert_fails(&import(&p, &out, &[]), 1, needle);
        assert!(!out.exists(), "{name}: output left behind");
        assert!(!soar_gptq::checkpoint::output_dir::partial_path(&out).exists());
    };
    let set = |k: &'static str, v: Value| {
        move |m: &mut Metadata| {
            m.retain(|(n, _)| n != k);
            m.push((k.to_string(), v.clone()));
        }
    };
    bad(
        "gpt2arch",
        &set("general.architecture", Value::String("gpt2".into())),
        "general.architecture is \"gpt2\"",
    );
    bad(
        "spm",
        &set("tokenizer.ggml.model", Value::String("llama".into())),
        "tokenizer.ggml.model is \"llama\"",
    );
    bad(
        "pre",
        &set("tokenizer.ggml.pre", Value::String("qwen2".into())),
        "tokenizer.ggml.pre is \"qwen2\"",
    );
    bad(
        "heads",
        &set("llama.attention.head_count_kv", Value::U32(4)),
        "blk.0.attn_k.weight",
    );
    bad(
        "moe",
        &set("llama.expert_count", Value::U32(8)),
        "mixture-of-experts",
    );
    // Header fields the GGUF reader takes on trust.
    bad(
        "align0",
        &set("general.alignment", Value::U32(0)),
        "general.alignment 0?",
    );
    bad(
        "align7",
        &set("general.alignment", Value::U32(7)),
        "general.alignment is 7",
    );
    bad(
        "nanrope",
        &set("llama.rope.freq_base", Value::F32(f32::NAN)),
        "llama.rope.freq_base is NaN",
    );
    bad(
        "nanrms",
        &set(
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(f32::NAN),
        ),
        "llama.attention.layer_norm_rms_epsilon is NaN",
    );
    bad(
        "layers",
        &set("llama.block_count", Value::U32(10_000_000)),
        "num_hidden_layers is 10000000",
    );
    // Raw edits of a good file: a tensor name given twice; every tensor at offset 0.
    let raw = std::fs::read(&gguf).unwrap();
    let find = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).position(|w| w == needle);
    let name = |n: &str| {
        let mut v = (n.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(n.as_bytes());
        v
    };
    let mut dup = raw.clone();
    let k = find(&dup, &name("blk.0.attn_k.weight")).unwrap();
    dup[k + 8..k + 8 + 19].copy_from_slice(b"blk.0.attn_q.weight");
    let p = root.join("dup.gguf");
    std::fs::write(&p, dup).unwrap();
    assert_fails(
        &import(&p, &root.join("dup"), &[]),
        1,
        "a tensor name is given twice",
    );
    let content = {
        let mut f = std::fs::File::open(&gguf).unwrap();
        gguf_file::Content::read(&mut f).unwrap()
    };
    let mut zero = raw.clone();
    for (n, info) in &content.tensor_infos {
        let at = find(&zero, &name(n)).unwrap() + 8 + n.len();
        let off = at + 4 + 8 * info.shape.rank() + 4;
        zero[off..off + 8].copy_from_slice(&0u64.to_le_bytes());
    }
    let p = root.join("zero.gguf");
    std::fs::write(&p, zero).unwrap();
    assert_fails(&import(&p, &root.join("zero"), &[]), 1, "overlap");

    let not_gguf = write_text(root, "x.gguf", "not a gguf file");
    assert_fails(
        &import(&not_gguf, &root.join("x"), &[]),
        1,
        "not a readable GGUF file",
    );
    assert_fails(
        &import(&root.join("missing.gguf"), &root.join("y"), &[]),
        1,
        "missing.gguf",
    );
    let o = run(&["import-gguf", "--gguf", gguf.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "missing --out is a usage error");

    // Without output.weight the embeddings are tied, as llama.cpp writes tied models.
    let tied_src = root.join("tied-src");
    let cfg = root.join("tied.json");
    let mut c = llama_config();
    c["tie_word_embeddings"] = json!(true);
    std::fs::write(&cfg, c.to_string()).unwrap();
    assert_ok(&run(&[
        "synth",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        tied_src.to_str().unwrap(),
    ]));
    let p = root.join("tied.gguf");
    write_gguf(&tied_src, &p, |_| {});
    let out = root.join("tied");
    assert_ok(&import(&p, &out, &[]));
    let cfg: Json =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert!(!Checkpoint::open(&out).unwrap().contains("lm_head.weight"));
}
