//! Serving-ready output: `inspect --engine` emulates how SGLang, vLLM and transformers load a
//! folder and catches each failure a real deployment hit (a gate left BF16 without a rule, a
//! derived config key, auto_map without its files, a fused group split between quantized and
//! not, a float16 dtype, the Marlin format); `quantize` and `pack-marlin` write what the engine
//! needs, copy the source's tokenizer and remote code byte for byte, refuse before any work
//! when the engine could not load the result, and write a model card.

use crate::common::*;

use serde_json::{json, Value};
use soar_gptq::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};
use std::process::Output;

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v = read_json(&p);
    f(&mut v);
    write_json(&p, &v);
}

/// `quantize` with a small calibration on the CPU.
fn quantize(model: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    run(&args)
}

fn inspect_engine(dir: &Path, engine: &str, extra: &[&str]) -> Output {
    let mut args = vec!["inspect", dir.to_str().unwrap(), "--engine", engine];
    args.extend_from_slice(extra);
    run(&args)
}

/// Copies a folder (files only).
#[test]
fn real_outputs_load_where_they_should_and_other_engines_are_refused_early() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = Path::new(FIXTURE);
    // The shipped MiniCPM-SALA fixture, default engine (SGLang).
    let q = tmp.path().join("q");
    assert_ok(&quantize(fixture, &q, &["--verify"]));
    let o = inspect_engine(&q, "sglang", &["--json"]);
    assert_ok(&o);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["engine"]["loads"], true, "{v}");
    let modules = v["engine"]["modules"].as_array().unwrap();
    // 4 layers: qkv_proj, o_proj, o_gate|z_proj, gate_up_proj, down_proj.
    assert_eq!(modules.len(), 20);
    assert!(modules.iter().all(|m| m["method"] == "gptq_marlin"), "{v}");
    assert_eq!(
        modules[0]["members"],
        json!([
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj"
        ])
    );
    assert!(v["engine"]["serve"]
        .as_str()
        .unwrap()
        .contains("sglang.launch_server"));
    // vLLM has no MiniCPM-SALA; transformers needs remote code the fixture does not have.
    assert_fails(
        &inspect_engine(&q, "vllm", &[]),
        1,
        "no MiniCPM-SALA implementation",
    );
    assert_fails(
        &inspect_engine(&q, "transformers", &[]),
        1,
        "has no built-in MiniCPMSALAForCausalLM",
    );
    // The model card: settings, calibration, modules, the --verify table, the serve command.
    let card = std::fs::read_to_string(q.join("README.md")).unwrap();
    for needle in [
        "## Serving",
        "python3 -m sglang.launch_server --model-path \"$MODEL_DIR\"",
        "## Verification",
        "| source |",
        "## Settings",
        "## Calibration data",
        "32 of 32 Linears quantized",
    ] {
        assert!(card.contains(needle), "{needle:?} not in the card:\n{card}");
    }
    let report = read_json(&q.join("quantize_report.json"));
    assert!(report["verify"]["compared"][0]["ppl"].as_f64().unwrap() > 1.0);
    assert_eq!(report["engine"], "sglang");

    // Asking for an engine that cannot serve the result is refused before any work.
    let out = tmp.path().join("v");
    let o = quantize(fixture, &out, &["--engine", "vllm"]);
    assert_fails(&o, 1, "no MiniCPM-SALA implementation");
    assert!(
        stderr(&o).contains("Nothing was quantized"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
    // 3-bit MiniCPM-SALA runs SGLang's fp16-only gptq kernels, and SALA must run BF16.
    let o = quantize(fixture, &out, &["--bits", "3"]);
    assert_fails(&o, 1, "float16 activations only");
    assert!(!out.exists());
    // ... unless written for evaluation only.
    assert_ok(&quantize(
        fixture,
        &out,
        &["--bits", "3", "--engine", "none"],
    ));

    // A Llama: every engine loads the default output.
    let cfg = tmp.path().join("llama.json");
    write_json(
        &cfg,
        &json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "hidden_act": "silu"}),
    );
    let llama = tmp.path().join("llama");
    assert_ok(&run(&[
        "synth",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        llama.to_str().unwrap(),
    ]));
    let lq = tmp.path().join("lq");
    assert_ok(&quantize(&llama, &lq, &[]));
    for e in ["sglang", "vllm", "transformers"] {
        assert_ok(&inspect_engine(&lq, e, &[]));
    }
    // Skipped modules: the dynamic rules SGLang and vLLM need are not enough for transformers,
    // which ignores `dynamic`; --engine transformers lists the quantized modules instead.
    let skip = ["--skip", r"self_attn\.o_proj"];
    let ls = tmp.path().join("ls");
    assert_ok(&quantize(&llama, &ls, &skip));
    assert_ok(&inspect_engine(&ls, "sglang", &[]));
    assert_ok(&inspect_engine(&ls, "vllm", &[]));
    assert_fails(
        &inspect_engine(&ls, "transformers", &[]),
        1,
        "transformers ignores `dynamic`",
    );
    let lt = tmp.path().join("lt");
    assert_ok(&quantize(
        &llama,
        &lt,
        &[skip[0], skip[1], "--engine", "transformers"],
    ));
    for e in ["sglang", "vllm", "transformers"] {
        assert_ok(&inspect_engine(&lt, e, &[]));
    }
    let qc = &read_json(&lt.join("config.json"))["quantization_config"];
    let listed = qc["modules_in_block_to_quantize"][0].as_array().unwrap();
    assert_eq!(listed.len(), 2 * 6, "{qc}");
    assert!(!listed
        .iter()
        .any(|m| m.as_str().unwrap().contains("o_proj")));
}

#[test]
fn hand_made_bad_folders_fail_the_emulation_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = Path::new(FIXTURE);
    let good = tmp.path().join("good");
    assert_ok(&quantize(fixture, &good, &[]));
    let case = |name: &str| -> PathBuf {
        let d = tmp.path().join(name);
        copy_dir(&good, &d);
        std::fs::remove_file(d.join("manifest.json")).unwrap();
        d
    };

    // o_gate kept BF16 without a rule: SGLang builds it quantized and finds o_gate.weight.
    let gates = tmp.path().join("gates");
    assert_ok(&quantize(
        fixture,
        &gates,
        &["--skip", r"self_attn\.o_gate"],
    ));
    assert_ok(&inspect_engine(&gates, "sglang", &[]));
    std::fs::remove_file(gates.join("manifest.json")).unwrap();
    edit_config(&gates, |c| {
        c["quantization_config"]["dynamic"] = json!({});
    });
    let o = inspect_engine(&gates, "sglang", &[]);
    assert_fails(&o, 1, "model.layers.0.self_attn.o_gate.qweight");
    assert!(stderr(&o).contains("KeyError"), "{}", stderr(&o));

    // A derived key in config.json.
    let d = case("derived");
    edit_config(&d, |c| c["has_sparse_attention"] = json!(true));
    assert_fails(&inspect_engine(&d, "sglang", &[]), 1, "can't set attribute");
    let o = run(&["inspect", d.to_str().unwrap()]);
    assert_ok(&o);
    assert!(stdout(&o).contains("warning") && stdout(&o).contains("has_sparse_attention"));

    // auto_map without its files.
    let d = case("automap");
    edit_config(&d, |c| {
        c["auto_map"] = json!({
            "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
            "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM"
        })
    });
    assert_fails(
        &inspect_engine(&d, "transformers", &[]),
        1,
        "configuration_minicpm_sala.py is missing",
    );
    let o = inspect_engine(&d, "sglang", &[]);
    assert_fails(&o, 1, "auto_map has AutoConfig");

    // q quantized but k not (layer 0): the fused qkv_proj cannot be built.
    let src = Checkpoint::open(fixture).unwrap();
    let d = tmp.path().join("split");
    rewrite_tensors(&good, &d, |n, ck| {
        let k = "model.layers.0.self_attn.k_proj";
        if n.starts_with(&format!("{k}.")) {
            if n.ends_with(".qweight") {
                let w = format!("{k}.weight");
                let e = src.get(&w).unwrap();
                return vec![(
                    w.clone(),
                    e.dtype,
                    e.shape.clone(),
                    src.bytes(&w).unwrap().to_vec(),
                )];
            }
            return vec![];
        }
        let e = ck.get(n).unwrap();
        vec![(
            n.to_string(),
            e.dtype,
            e.shape.clone(),
            ck.bytes(n).unwrap().to_vec(),
        )]
    });
    let o = inspect_engine(&d, "sglang", &[]);
    assert_fails(&o, 1, "model.layers.0.self_attn.k_proj.qweight");
    assert!(
        stderr(&o).contains("model.layers.0.self_attn.k_proj.weight"),
        "{}",
        stderr(&o)
    );

    // float16 dtype: MiniCPM-SALA's sparse attention runs BF16 only.
    let d = case("fp16");
    edit_config(&d, |c| c["dtype"] = json!("float16"));
    assert_fails(&inspect_engine(&d, "sglang", &[]), 1, "dtype is float16");
    let d = case("nodtype");
    edit_config(&d, |c| {
        c.as_object_mut().unwrap().remove("dtype");
    });
    assert_fails(&inspect_engine(&d, "sglang", &[]), 1, "absent");

    // The Marlin format: no current release reads it; a legacy-marlin release would.
    let marlin = tmp.path().join("marlin");
    assert_ok(&run(&[
        "pack-marlin",
        "--in",
        good.to_str().unwrap(),
        "--out",
        marlin.to_str().unwrap(),
    ]));
    assert_fails(
        &inspect_engine(&marlin, "sglang", &[]),
        1,
        "checkpoint_format is \"marlin\"",
    );
    assert_ok(&inspect_engine(&marlin, "sglang", &["--legacy-marlin"]));
    assert_fails(&inspect_engine(&marlin, "vllm", &[]), 1, "no MiniCPM-SALA");
    let card = std::fs::read_to_string(marlin.join("README.md")).unwrap();
    assert!(card.contains("No current SGLang or vLLM release"), "{card}");
}

/// A MiniCPM-SALA source as the hub ships it: remote code (with a relative import), the whole
/// tokenizer file set, a licence, its own model card, and derived keys that must not travel.
fn hub_like_source(root: &Path) -> PathBuf {
    let src = root.join("src");
    copy_dir(Path::new(FIXTURE), &src);
    edit_config(&src, |c| {
        c["auto_map"] = json!({
            "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
            "AutoModel": "modeling_minicpm_sala.MiniCPMSALAModel",
            "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM"
        });
        c["sparse_layer_ids"] = json!([0, 3]);
    });
    let files: [(&str, &[u8]); 9] = [
        (
            "configuration_minicpm_sala.py",
            b"from transformers import PretrainedConfig\nclass MiniCPMSALAConfig(PretrainedConfig):\n    model_type = 'minicpm_sala'\n",
        ),
        (
            "modeling_minicpm_sala.py",
            b"from .configuration_minicpm_sala import MiniCPMSALAConfig\nfrom .sala_utils import helper\n",
        ),
        ("sala_utils.py", b"def helper():\n    return 1\n"),
        ("special_tokens_map.json", b"{\"eos_token\": \"</s>\"}\n"),
        ("added_tokens.json", b"{\"<|im_end|>\": 4095}\n"),
        (
            "chat_template.jinja",
            b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        ),
        ("tokenizer.model", &[0u8, 1, 2, 3, 255, 254]),
        ("LICENSE", b"Apache-2.0 (test text)\n"),
        ("README.md", b"# the source's own card\n"),
    ];
    for (n, b) in files {
        std::fs::write(src.join(n), b).unwrap();
    }
    src
}

#[test]
fn remote_code_and_tokenizer_files_travel_byte_for_byte_and_configs_are_clean() {
    let tmp = tempfile::tempdir().unwrap();
    let src = hub_like_source(tmp.path());
    // The BF16 source itself is flagged.
    let o = run(&["inspect", src.to_str().unwrap()]);
    assert_ok(&o);
    assert!(stdout(&o).contains("sparse_layer_ids"), "{}", stdout(&o));
    let travelling = [
        "configuration_minicpm_sala.py",
        "modeling_minicpm_sala.py",
        "sala_utils.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "tokenizer.model",
        "generation_config.json",
        "LICENSE",
    ];
    let same_bytes = |out: &Path| {
        for f in travelling {
            assert_eq!(
                std::fs::read(src.join(f)).unwrap(),
                std::fs::read(out.join(f)).unwrap_or_else(|e| panic!("{f}: {e}")),
                "{f} differs from the source's"
            );
        }
        let m = read_json(&out.join("manifest.json"));
        let copied: Vec<&str> = m["copied_from_source"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        for f in travelling {
            assert!(
                copied.contains(&f),
                "{f} not in copied_from_source: {copied:?}"
            );
        }
        let card = std::fs::read_to_string(out.join("README.md")).unwrap();
        assert!(!card.contains("the source's own card"));
    };

    // SGLang: no auto_map.AutoConfig, no derived keys, the rest (dtype spelling too) kept.
    let sg = tmp.path().join("sg");
    assert_ok(&quantize(&src, &sg, &[]));
    same_bytes(&sg);
    let c = read_json(&sg.join("config.json"));
    assert!(c["auto_map"].get("AutoConfig").is_none(), "{c}");
    assert_eq!(
        c["auto_map"]["AutoModelForCausalLM"],
        "modeling_minicpm_sala.MiniCPMSALAForCausalLM"
    );
    assert!(c.get("sparse_layer_ids").is_none());
    assert_eq!(c["dtype"], "bfloat16");
    assert!(c.get("torch_dtype").is_none());
    assert_ok(&inspect_engine(&sg, "sglang", &[]));
    let r = read_json(&sg.join("quantize_report.json"));
    assert_eq!(
        r["config_edits"]["removed"],
        json!(["sparse_layer_ids", "auto_map.AutoConfig"])
    );

    // transformers: auto_map whole, and every file it names (and imports) present.
    let tf = tmp.path().join("tf");
    assert_ok(&quantize(&src, &tf, &["--engine", "transformers"]));
    same_bytes(&tf);
    let c = read_json(&tf.join("config.json"));
    assert_eq!(
        c["auto_map"]["AutoConfig"],
        "configuration_minicpm_sala.MiniCPMSALAConfig"
    );
    assert!(c.get("sparse_layer_ids").is_none());
    let o = inspect_engine(&tf, "transformers", &["--json"]);
    assert_ok(&o);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        v["engine"]["remote_code"],
        json!([
            "configuration_minicpm_sala.py",
            "modeling_minicpm_sala.py",
            "sala_utils.py"
        ])
    );

    // pack-marlin carries the same files and the same hygiene.
    let pm = tmp.path().join("pm");
    assert_ok(&run(&[
        "pack-marlin",
        "--in",
        sg.to_str().unwrap(),
        "--out",
        pm.to_str().unwrap(),
    ]));
    same_bytes(&pm);
    let c = read_json(&pm.join("config.json"));
    assert!(c["auto_map"].get("AutoConfig").is_none() && c.get("sparse_layer_ids").is_none());
    assert_eq!(c["quantization_config"]["checkpoint_format"], "marlin");

    // A relative import the source lacks: transformers could not load the result, so
    // --engine transformers refuses before any work.
    std::fs::remove_file(src.join("sala_utils.py")).unwrap();
    let out = tmp.path().join("broken");
    let o = quantize(&src, &out, &["--engine", "transformers"]);
    assert_fails(&o, 1, "sala_utils.py is missing");
    assert!(!out.exists());
}

#[test]
fn an_offline_cache_must_hold_the_remote_code_auto_map_names() {
    let tmp = tempfile::tempdir().unwrap();
    let src = hub_like_source(tmp.path());
    let cache = tmp.path().join("hub");
    let sha = "89abcdef0123456789abcdef0123456789abcdef";
    let repo = cache.join("models--openbmb--Tiny-SALA");
    let snap = repo.join("snapshots").join(sha);
    copy_dir(&src, &snap);
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), sha).unwrap();
    let out = tmp.path().join("q");
    let q = |out: &Path| {
        bin()
            .args([
                "quantize",
                "--model",
                "openbmb/Tiny-SALA",
                "--out",
                out.to_str().unwrap(),
                "--nsamples",
                "2",
                "--seqlen",
                "64",
                "--method",
                "rtn",
            ])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    assert_ok(&q(&out));
    assert_eq!(
        std::fs::read(out.join("sala_utils.py")).unwrap(),
        std::fs::read(snap.join("sala_utils.py")).unwrap()
    );
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("base_model: openbmb/Tiny-SALA"), "{card}");
    std::fs::remove_file(snap.join("modeling_minicpm_sala.py")).unwrap();
    assert_fails(&q(&tmp.path().join("q2")), 1, "modeling_minicpm_sala.py");
}
