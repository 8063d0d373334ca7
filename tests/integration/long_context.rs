//! Long context on a small MiniCPM-SALA whose sparse layers run InfLLM-v2 from 512 tokens on
//! (`synth --preset tiny-sparse`): quantize with a log-uniform mix of window lengths above
//! `dense_len`, byte-identical when repeated, when every hidden state is spilled to disk and
//! nothing is cached, and when stopped and resumed; eval-ppl per position range with the
//! plot; `--sparse-attention`; and the bad inputs of this regime.

use crate::common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn synth_sparse(root: &Path) -> PathBuf {
    let out = root.join("ts");
    assert_ok(&run(&[
        "synth",
        "--preset",
        "tiny-sparse",
        "--out",
        out.to_str().unwrap(),
        "--seed",
        "3",
    ]));
    out
}

fn manifest_files(dir: &Path) -> Vec<(String, Value)> {
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    m["files"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.ends_with(".safetensors") || *k == "config.json")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn quantize(model: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let seqlen = match extra.iter().position(|a| *a == "--seqlen") {
        Some(i) => extra[i + 1],
        None => "520..1100",
    };
    let extra: Vec<&str> = match extra.iter().position(|a| *a == "--seqlen") {
        Some(i) => [&extra[..i], &extra[i + 2..]].concat(),
        None => extra.to_vec(),
    };
    let mut args = vec![
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--nsamples",
        "4",
        "--seqlen",
        seqlen,
        "--engine",
        "none",
        "--device",
        "cpu",
        "--json",
    ];
    args.extend_from_slice(&extra);
    run(&args)
}

#[test]
fn quantize_above_dense_len_is_deterministic_wherever_the_states_live_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synth_sparse(tmp.path());
    let a = tmp.path().join("a");
    let o = quantize(&m, &a, &[]);
    assert_ok(&o);
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["settings"]["seqlen"], "520..1100");
    assert_eq!(report["settings"]["sparse_path"], true);
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(a.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        cfg["quantization_config"]["meta"]["sparse_attention"],
        "auto"
    );
    let card = std::fs::read_to_string(a.join("README.md")).unwrap();
    assert!(card.contains("InfLLM-v2 ran in calibration"), "{card}");
    assert!(card.contains("4 windows of 520 to 1100 tokens"), "{card}");
    // Every state on disk and nothing cached: the same bytes.
    let b = tmp.path().join("b");
    let o = quantize(&m, &b, &["--max-host-memory", "0"]);
    assert_ok(&o);
    assert!(stderr(&o).contains("hidden states"), "{}", stderr(&o));
    assert!(stderr(&o).contains("on disk"), "{}", stderr(&o));
    assert_eq!(manifest_files(&a), manifest_files(&b));
    assert!(!tmp.path().join("b.partial").exists());
    // Stopped after two layers, then resumed: the same bytes.
    let c = tmp.path().join("c");
    let o = quantize(&m, &c, &["--stop-after-layers", "2"]);
    assert_fails(&o, 1, "--resume");
    assert_ok(&quantize(&m, &c, &["--resume"]));
    assert_eq!(manifest_files(&a), manifest_files(&c));
    // Dense attention at every length computes another model: other bytes.
    let d = tmp.path().join("d");
    assert_ok(&quantize(&m, &d, &["--sparse-attention", "never"]));
    assert_ne!(manifest_files(&a), manifest_files(&d));
}

#[test]
fn eval_ppl_reports_position_ranges_and_draws_the_kl_plot() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synth_sparse(tmp.path());
    let q = tmp.path().join("q");
    assert_ok(&quantize(&m, &q, &[]));
    let plot = tmp.path().join("kl.svg");
    let args = |json: bool| -> Vec<String> {
        let mut v: Vec<String> = [
            "eval-ppl",
            "--model",
            m.to_str().unwrap(),
            "--compare",
            q.to_str().unwrap(),
            "--seqlen",
            "2100",
            "--max-windows",
            "2",
            "--batch",
            "1",
            "--device",
            "cpu",
            "--plot",
            plot.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if json {
            v.push("--json".into());
            v.push("--force".into());
        }
        v
    };
    let o = bin().args(args(false)).output().unwrap();
    assert_ok(&o);
    let text = stdout(&o);
    assert!(text.contains("sparse layers: InfLLM-v2"), "{text}");
    assert!(text.contains("by position in the window"), "{text}");
    assert!(text.contains("2048-2099"), "{text}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    // An existing plot is replaced only with --force.
    let o = bin().args(args(false)).output().unwrap();
    assert_fails(&o, 1, "already exists");
    let o = bin().args(args(true)).output().unwrap();
    assert_ok(&o);
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["reference"]["sparse_path"], true);
    let ranges = r["compared"][0]["by_position"].as_array().unwrap();
    assert_eq!(ranges.len(), 2);
    let tokens: u64 = ranges.iter().map(|x| x["tokens"].as_u64().unwrap()).sum();
    assert_eq!(tokens, r["reference"]["tokens"].as_u64().unwrap());
    assert_eq!(ranges[0]["to"], 2048);
    assert!(ranges[1]["mean_kl"].as_f64().unwrap() > 0.0);
    // The overall mean KL is the token-weighted mean of the ranges'.
    let weighted: f64 = ranges
        .iter()
        .map(|x| x["mean_kl"].as_f64().unwrap() * x["tokens"].as_f64().unwrap())
        .sum::<f64>()
        / tokens as f64;
    let overall = r["compared"][0]["mean_kl"].as_f64().unwrap();
    assert!(
        (weighted - overall).abs() <= 1e-9 * overall.max(1.0),
        "{weighted} {overall}"
    );
    // The plot may not replace an input.
    let o = run(&[
        "eval-ppl",
        "--model",
        m.to_str().unwrap(),
        "--compare",
        q.to_str().unwrap(),
        "--plot",
        m.join("config.json").to_str().unwrap(),
        "--force",
    ]);
    assert_fails(&o, 1, "--plot");
    assert!(m.join("config.json").is_file());
}

#[test]
fn long_context_bad_inputs_fail_clearly_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synth_sparse(tmp.path());
    let out = tmp.path().join("o");
    // Usage errors: exit 2.
    for (seqlen, needle) in [
        ("9..3", "the shortest length 9 is above the longest 3"),
        ("1", "is not a window length"),
        ("0..100", "is not a window length"),
    ] {
        let o = run(&[
            "quantize",
            "--model",
            m.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--seqlen",
            seqlen,
        ]);
        assert_fails(&o, 2, needle);
    }
    let o = run(&[
        "eval-ppl",
        "--model",
        m.to_str().unwrap(),
        "--sparse-attention",
        "sometimes",
    ]);
    assert_fails(&o, 2, "sometimes");
    // Above max_position_embeddings (65536 in this preset): exit 1 naming the key.
    let o = quantize(&m, &out, &["--seqlen", "70000"]);
    assert_fails(&o, 1, "above max_position_embeddings = 65536");
    assert!(!out.exists() && !tmp.path().join("o.partial").exists());
    // A sparse_config InfLLM-v2's kernels cannot take, at a length where it runs.
    let bad = tmp.path().join("bad");
    copy_dir(&m, &bad);
    let cfgp = bad.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfgp).unwrap()).unwrap();
    c["sparse_config"]["kernel_size"] = 64.into();
    std::fs::write(&cfgp, c.to_string()).unwrap();
    let o = quantize(&bad, &out, &[]);
    assert_fails(&o, 1, "sparse_config.kernel_size is 64");
    // ... but below dense_len the config is fine.
    assert_ok(&quantize(&bad, &out, &["--seqlen", "256"]));
    // Keys the official code ignores or reads differently are refused by name.
    for (key, value, needle) in [
        (
            "lightning_nh",
            Value::from(4),
            "lightning_nh is 4 but num_attention_heads is 2",
        ),
        (
            "lightning_scale",
            Value::from("0.5"),
            "lightning_scale is \"0.5\"",
        ),
    ] {
        let d = tmp.path().join(format!("bad-{key}"));
        copy_dir(&m, &d);
        let p = d.join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        c[key] = value;
        std::fs::write(&p, c.to_string()).unwrap();
        let o = run(&["inspect", d.to_str().unwrap()]);
        assert_fails(&o, 1, needle);
    }
}
