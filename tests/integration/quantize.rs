//! `quantize` run as a user runs it: the GPTQ checkpoint it writes, determinism,
//! resume, its options, and every bad input failing cleanly without leaving an output behind.

use crate::common::*;

use serde_json::Value;
use soar_gptq::checkpoint::manifest::sha256_file;
use soar_gptq::checkpoint::output_dir::partial_path;
use soar_gptq::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};
use std::process::Output;

/// The 8 Linears of each of the 4 layers of the tiny preset.
const SPARSE_LINEARS: [&str; 8] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.o_gate",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];
const LIGHTNING_LINEARS: [&str; 8] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.z_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// 4-bit symmetric zero point 8, stored minus one (GPTQ v1) in every nibble.
const SYM4_QZEROS: i32 = 0x7777_7777;

fn all_linears() -> Vec<String> {
    (0..4)
        .flat_map(|i| {
            let mods = if i == 0 || i == 3 {
                SPARSE_LINEARS
            } else {
                LIGHTNING_LINEARS
            };
            mods.into_iter()
                .map(move |m| format!("model.layers.{i}.{m}"))
        })
        .collect()
}

/// A tiny model and a small calibration text in one temporary folder.
struct Fixture {
    tmp: tempfile::TempDir,
    model: PathBuf,
    calib: PathBuf,
}

impl Fixture {
    fn new(seed: u64) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let model = synth_tiny(tmp.path(), "m", seed);
        let calib = write_text(tmp.path(), "calib.txt", &sample_text());
        Self { tmp, model, calib }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// `quantize --model M --out OUT` with a small calibration (4 windows of 64 tokens from
    /// calib.txt), on the CPU, then `extra` (which replaces any of those defaults it names).
    fn quantize_model(&self, model: &str, out: &Path, extra: &[&str]) -> Output {
        let mut args = vec!["quantize", "--model", model, "--out", out.to_str().unwrap()];
        let calib = self.calib.to_str().unwrap();
        for (flag, value) in [
            ("--nsamples", "4"),
            ("--seqlen", "64"),
            ("--device", "cpu"),
            ("--calib", calib),
        ] {
            if !extra.contains(&flag) {
                args.extend([flag, value]);
            }
        }
        args.extend(extra);
        run(&args)
    }

    fn quantize(&self, out: &Path, extra: &[&str]) -> Output {
        self.quantize_model(self.model.to_str().unwrap(), out, extra)
    }

    /// Quantizes into `self.path(name)` and asserts success.
    fn quantized(&self, name: &str, extra: &[&str]) -> PathBuf {
        let out = self.path(name);
        assert_ok(&self.quantize(&out, extra));
        out
    }
}

fn read_json(p: &Path) -> Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// `text` cut into pieces of `n` characters.
fn pieces(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(n).map(|c| c.iter().collect()).collect()
}

fn manifest(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("manifest.json")).unwrap()
}

fn inspect_json(dir: &Path) -> Value {
    let o = run(&["inspect", dir.to_str().unwrap(), "--json"]);
    assert_ok(&o);
    serde_json::from_str(&stdout(&o)).unwrap()
}

fn engine<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["engine"] == name)
        .unwrap_or_else(|| panic!("no verdict for {name}: {report}"))
}

fn i32s(dir: &Path, name: &str) -> Vec<i32> {
    Checkpoint::open(dir).unwrap().i32_data(name).unwrap()
}

/// A failure that exits 1 with `needle` on stderr and leaves neither `out` nor `out.partial`.
fn assert_fails_clean(o: &Output, out: &Path, needle: &str) {
    assert_fails(o, 1, needle);
    assert!(!out.exists(), "{} was left behind", out.display());
    assert!(
        !partial_path(out).exists(),
        "{} was left behind",
        partial_path(out).display()
    );
}

#[test]
fn quantize_writes_a_gptq_checkpoint_that_inspects_and_packs() {
    let fx = Fixture::new(0);
    // The embedded default calibration mix, several output shards.
    let out = fx.path("q");
    let o = fx.quantize(
        &out,
        &["--calib", "default", "--shard-size", "2000000", "--json"],
    );
    assert_ok(&o);
    let printed: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(!partial_path(&out).exists());
    for f in [
        "config.json",
        "quantize_config.json",
        "quantize_report.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "generation_config.json",
        "manifest.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    assert!(!out.join("journal").exists(), "the journal is removed");
    let shards = shard_files(&out);
    assert!(
        shards.len() > 1,
        "--shard-size 2000000 gives several shards"
    );

    // config.json carries the quantization_config the engines read.
    let cfg = read_json(&out.join("config.json"));
    let qc = &cfg["quantization_config"];
    assert_eq!(qc["quant_method"], "gptq");
    assert_eq!(qc["bits"], 4);
    assert_eq!(qc["group_size"], 128);
    assert_eq!(qc["desc_act"], false);
    assert_eq!(qc["sym"], true);
    assert_eq!(qc["checkpoint_format"], "gptq");
    assert_eq!(qc["dynamic"], serde_json::json!({}));
    assert_eq!(cfg["architectures"][0], "MiniCPMSALAForCausalLM");
    assert_eq!(&read_json(&out.join("quantize_config.json")), qc);

    // The report: one row per Linear, calibration usage, hashes.
    let report = read_json(&out.join("quantize_report.json"));
    assert_eq!(report["modules"], printed["modules"]);
    let rows = report["modules"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["module"].as_str().unwrap()).collect();
    let mut want = all_linears();
    let mut got: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    for r in rows {
        assert_eq!(r["quantized"], true, "{r}");
        let loss = r["loss"].as_f64().unwrap();
        let rel = r["rel_output_error"].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{r}");
        assert!(rel.is_finite() && rel > 0.0 && rel < 0.5, "{r}");
        assert_eq!(r["damp"].as_f64().unwrap(), 0.01, "{r}");
    }
    let usage = report["calibration"].as_array().unwrap();
    assert_eq!(usage.len(), 7, "the default mix has 7 sources");
    assert!(usage
        .iter()
        .all(|u| u["name"].as_str().unwrap().starts_with("default/")));
    let used: u64 = usage
        .iter()
        .map(|u| u["tokens_used"].as_u64().unwrap())
        .sum();
    let windows: u64 = usage.iter().map(|u| u["windows"].as_u64().unwrap()).sum();
    assert_eq!((used, windows), (4 * 64, 4));
    let h = &report["hashes"];
    assert_eq!(
        h["config_sha256"].as_str().unwrap(),
        sha256_file(&fx.model.join("config.json")).unwrap()
    );
    let src = h["source_sha256"].as_object().unwrap();
    assert_eq!(src.len(), shard_files(&fx.model).len());
    for shard in shard_files(&fx.model) {
        let name = shard.file_name().unwrap().to_str().unwrap();
        assert_eq!(src[name].as_str().unwrap(), sha256_file(&shard).unwrap());
    }
    for k in ["calibration_sha256", "settings_sha256"] {
        assert_eq!(h[k].as_str().unwrap().len(), 64, "{k}");
    }
    assert_eq!(report["calibration_sha256"], h["calibration_sha256"]);
    assert_eq!(report["settings"]["nsamples"], 4);
    assert_eq!(report["settings"]["seqlen"], 64);
    assert_eq!(report["settings"]["act_order"], "static");

    // The index maps every packed tensor of every Linear, and no BF16 weight of one.
    let index = read_json(&out.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    for m in all_linears() {
        for t in ["qweight", "qzeros", "scales", "g_idx"] {
            assert!(map.contains_key(&format!("{m}.{t}")), "{m}.{t}");
        }
        assert!(!map.contains_key(&format!("{m}.weight")), "{m}.weight");
    }
    for t in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    ] {
        assert!(map.contains_key(t), "{t}");
    }

    // Symmetric 4-bit: every zero point is 8, stored as 7 in each nibble; g_idx is k / 128.
    let qzeros = i32s(&out, "model.layers.0.mlp.down_proj.qzeros");
    assert_eq!(qzeros.len(), (768 / 128) * (256 / 8));
    assert!(qzeros.iter().all(|&z| z == SYM4_QZEROS));
    let g_idx = i32s(&out, "model.layers.0.mlp.down_proj.g_idx");
    assert_eq!(g_idx, (0..768).map(|k| k / 128).collect::<Vec<i32>>());
    let g_idx = i32s(&out, "model.layers.1.self_attn.z_proj.g_idx");
    assert_eq!(g_idx, (0..256).map(|k| k / 128).collect::<Vec<i32>>());

    // inspect validates it and says both engines select gptq_marlin.
    let o = run(&["inspect", out.to_str().unwrap()]);
    assert_ok(&o);
    assert!(stdout(&o).contains("selects gptq_marlin"), "{}", stdout(&o));
    let j = inspect_json(&out);
    assert_eq!(j["valid"], true);
    assert_eq!(j["settings"]["checkpoint_format"], "gptq");
    assert_eq!(j["quantized_modules"].as_array().unwrap().len(), 32);
    assert_eq!(j["warnings"], serde_json::json!([]));
    for e in ["SGLang", "vLLM"] {
        let v = engine(&j, e);
        assert_eq!(v["gptq_marlin"], true, "{v}");
        assert_eq!(v["reasons"], serde_json::json!([]), "{v}");
    }

    // pack-marlin rewrites it, and the Marlin checkpoint inspects clean too.
    let marlin = fx.path("marlin");
    let o = run(&[
        "pack-marlin",
        "--in",
        out.to_str().unwrap(),
        "--out",
        marlin.to_str().unwrap(),
        "--json",
    ]);
    assert_ok(&o);
    let p: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(p["modules_packed"], 32);
    assert_ok(&run(&["inspect", marlin.to_str().unwrap()]));
    let j = inspect_json(&marlin);
    assert_eq!(j["valid"], true);
    assert_eq!(j["quantized_modules"].as_array().unwrap().len(), 32);
}

#[test]
fn quantize_is_deterministic_per_seed() {
    let fx = Fixture::new(1);
    let a = fx.quantized("a", &[]);
    let b = fx.quantized("b", &[]);
    let c = fx.quantized("c", &["--seed", "1"]);
    assert_eq!(manifest(&a), manifest(&b));
    assert_ne!(manifest(&a), manifest(&c));
    let calib_sha =
        |d: &Path| read_json(&d.join("quantize_report.json"))["calibration_sha256"].clone();
    assert_eq!(calib_sha(&a), calib_sha(&b));
    assert_ne!(calib_sha(&a), calib_sha(&c));
}

#[test]
fn an_interrupted_run_resumes_to_the_same_checkpoint() {
    let fx = Fixture::new(2);
    let full = fx.quantized("full", &[]);

    let out = fx.path("r");
    let o = fx.quantize(&out, &["--stop-after-layers", "1"]);
    assert_fails(&o, 1, "1 finished layer(s) are kept in");
    assert!(stderr(&o).contains("rerun the same command with --resume"));
    assert!(!out.exists());
    let partial = partial_path(&out);
    assert!(partial.join("journal").join("journal.json").is_file());
    assert!(stderr(&o).contains(partial.to_str().unwrap()));

    // Resumed, interrupted again further on, and resumed to the end.
    let o = fx.quantize(&out, &["--resume", "--stop-after-layers", "3"]);
    assert_fails(&o, 1, "3 finished layer(s) are kept in");
    let journal = read_json(&partial.join("journal").join("journal.json"));
    assert_eq!(journal["layers"].as_array().unwrap().len(), 3);
    let o = fx.quantize(&out, &["--resume"]);
    assert_ok(&o);
    assert!(!partial.exists());
    assert_eq!(manifest(&out), manifest(&full));
    let rows = |d: &Path| {
        let r = read_json(&d.join("quantize_report.json"));
        r["modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["module"].clone(), m["loss"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(rows(&out), rows(&full));
    assert_ok(&run(&["inspect", out.to_str().unwrap()]));

    // Nothing to resume once it is done.
    let o = fx.quantize(&fx.path("none"), &["--resume"]);
    assert_fails(&o, 1, "nothing to resume");

    // A resume with other settings or other calibration is refused, with the reason.
    let out = fx.path("s");
    assert_fails(
        &fx.quantize(&out, &["--stop-after-layers", "1"]),
        1,
        "--resume",
    );
    let o = fx.quantize(&out, &["--resume", "--damp", "0.02"]);
    assert_fails(&o, 1, "cannot resume: the quantization settings differ");
    assert!(!out.exists());

    let out = fx.path("t");
    let text = sample_text();
    let c = write_text(fx.tmp.path(), "c.txt", &text[..20_000]);
    let calib = ["--calib", c.to_str().unwrap()];
    assert_fails(
        &fx.quantize(&out, &[&calib[..], &["--stop-after-layers", "1"]].concat()),
        1,
        "--resume",
    );
    write_text(fx.tmp.path(), "c.txt", &text[20_000..]);
    let o = fx.quantize(&out, &[&calib[..], &["--resume"]].concat());
    assert_fails(&o, 1, "cannot resume: the calibration data changed");
}

/// A refused `--resume` (for example a mistyped flag) must not throw away the finished layers.
#[test]
fn a_refused_resume_keeps_the_finished_layers() {
    let fx = Fixture::new(2);
    let out = fx.path("r");
    assert_fails(
        &fx.quantize(&out, &["--stop-after-layers", "2"]),
        1,
        "--resume",
    );
    let o = fx.quantize(&out, &["--resume", "--damp", "0.02"]);
    assert_fails(&o, 1, "cannot resume");
    // The batch size sets the order of the Hessian sums, so it must match too.
    let o = fx.quantize(&out, &["--resume", "--batch", "3"]);
    assert_fails(&o, 1, "quantization settings differ");
    assert!(
        partial_path(&out).join("journal").is_dir(),
        "the refused resume removed {}",
        partial_path(&out).display()
    );
    assert_ok(&fx.quantize(&out, &["--resume"]));
}

#[test]
fn rtn_dynamic_act_order_and_asym_write_what_they_say() {
    let fx = Fixture::new(3);
    let gptq = fx.quantized("gptq", &[]);
    const QW: &str = "model.layers.2.mlp.up_proj.qweight";

    // RTN: same format, other codes, no output-error estimate.
    let rtn = fx.quantized("rtn", &["--method", "rtn"]);
    assert_ne!(manifest(&rtn), manifest(&gptq));
    assert_ne!(i32s(&rtn, QW), i32s(&gptq, QW));
    assert_eq!(i32s(&rtn, QW).len(), i32s(&gptq, QW).len());
    let r = read_json(&rtn.join("quantize_report.json"));
    assert_eq!(r["settings"]["method"], "rtn");
    assert_eq!(r["modules"].as_array().unwrap().len(), 32);
    assert!(r["modules"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["rel_output_error"].is_null() && m["quantized"] == true));
    let cfg = read_json(&rtn.join("config.json"));
    assert_eq!(cfg["quantization_config"]["meta"]["method"], "rtn");
    assert_eq!(cfg["quantization_config"]["quant_method"], "gptq");
    assert_ok(&run(&["inspect", rtn.to_str().unwrap()]));

    // Dynamic act-order: desc_act true and a permuted g_idx with full groups.
    let dynamic = fx.quantized("dyn", &["--act-order", "dynamic"]);
    let qc = &read_json(&dynamic.join("config.json"))["quantization_config"];
    assert_eq!(qc["desc_act"], true);
    assert_eq!(qc["static_groups"], false);
    let g_idx = i32s(&dynamic, "model.layers.0.mlp.down_proj.g_idx");
    assert_eq!(g_idx.len(), 768);
    assert!(
        g_idx.iter().enumerate().any(|(k, &g)| g != k as i32 / 128),
        "g_idx is trivial"
    );
    for g in 0..6 {
        assert_eq!(g_idx.iter().filter(|&&x| x == g).count(), 128, "group {g}");
    }
    let j = inspect_json(&dynamic);
    assert_eq!(j["valid"], true);
    assert_eq!(j["settings"]["desc_act"], true);

    // Asymmetric: checkpoint_format gptq_v2, which gptq_marlin does not serve.
    // Asymmetric MiniCPM-SALA runs SGLang's float16-only gptq kernels, and SALA must run BF16:
    // refused for SGLang before any work, written with --engine none.
    let o = fx.quantize(&fx.path("asym"), &["--asym"]);
    assert_fails_clean(&o, &fx.path("asym"), "float16 activations only");
    let asym = fx.quantized("asym", &["--asym", "--engine", "none"]);
    let qc = &read_json(&asym.join("config.json"))["quantization_config"];
    assert_eq!(qc["checkpoint_format"], "gptq_v2");
    assert_eq!(qc["sym"], false);
    let qzeros = i32s(&asym, "model.layers.0.mlp.down_proj.qzeros");
    assert!(qzeros.iter().any(|&z| z != SYM4_QZEROS));
    let j = inspect_json(&asym);
    assert_eq!(j["valid"], true);
    assert_eq!(j["settings"]["checkpoint_format"], "gptq_v2");
    for e in ["SGLang", "vLLM"] {
        let v = engine(&j, e);
        assert_eq!(v["gptq_marlin"], false, "{v}");
        assert!(v["reasons"].to_string().contains("asymmetric"), "{v}");
    }
}

const GATES: &str = r"self_attn\.o_gate|self_attn\.z_proj";

#[test]
fn skip_keeps_modules_bf16_and_refuses_to_split_fused_groups() {
    let fx = Fixture::new(4);
    let out = fx.quantized("skip", &["--skip", GATES]);
    let ck = Checkpoint::open(&out).unwrap();
    let skipped = [
        "model.layers.0.self_attn.o_gate",
        "model.layers.1.self_attn.z_proj",
        "model.layers.2.self_attn.z_proj",
        "model.layers.3.self_attn.o_gate",
    ];
    for m in skipped {
        assert!(ck.contains(&format!("{m}.weight")), "{m}.weight");
        assert!(!ck.contains(&format!("{m}.qweight")), "{m}.qweight");
    }
    for m in all_linears() {
        if !skipped.contains(&m.as_str()) {
            assert!(ck.contains(&format!("{m}.qweight")), "{m}.qweight");
            assert!(!ck.contains(&format!("{m}.weight")), "{m}.weight");
        }
    }
    // The kept weights are the source's, bit for bit.
    let src = Checkpoint::open(&fx.model).unwrap();
    let name = "model.layers.1.self_attn.z_proj.weight";
    assert_eq!(ck.bytes(name).unwrap(), src.bytes(name).unwrap());

    let qc = &read_json(&out.join("config.json"))["quantization_config"];
    let rules = qc["dynamic"].as_object().unwrap();
    assert_eq!(rules.len(), 1, "{rules:?}");
    let (key, val) = rules.iter().next().unwrap();
    assert!(key.starts_with("-:") && key.contains(GATES), "{key}");
    assert_eq!(val, &serde_json::json!({}));

    let report = read_json(&out.join("quantize_report.json"));
    let rows = report["modules"].as_array().unwrap();
    assert_eq!(rows.len(), 32);
    let kept: Vec<&str> = rows
        .iter()
        .filter(|r| r["quantized"] == false)
        .map(|r| r["module"].as_str().unwrap())
        .collect();
    assert_eq!(kept.len(), 4);
    for m in skipped {
        assert!(kept.contains(&m), "{m} not reported as kept");
    }
    assert_ok(&run(&["inspect", out.to_str().unwrap()]));

    // Skipping part of q/k/v or gate/up is refused, naming the fused group.
    let bad = fx.path("split");
    let o = fx.quantize(&bad, &["--skip", r"self_attn\.k_proj"]);
    assert_fails_clean(&o, &bad, "splits the fused group");
    assert!(stderr(&o).contains("self_attn.q_proj/self_attn.k_proj/self_attn.v_proj"));
    let o = fx.quantize(&bad, &["--skip", r"layers\.2\.mlp\.up_proj"]);
    assert_fails_clean(&o, &bad, "mlp.gate_proj/mlp.up_proj");
    let o = fx.quantize(&bad, &["--skip", "self_attn.(o_gate"]);
    assert_fails_clean(&o, &bad, "is not a valid regular expression");
}

/// The `-:` rules must match the kept modules the way SGLang and vLLM apply them (`re.match`,
/// anchored at the start of the module name), or the engines cannot load the checkpoint.
#[test]
fn skip_rules_match_the_kept_modules_as_the_engines_apply_them() {
    let fx = Fixture::new(4);
    let out = fx.quantized("skip", &["--skip", GATES]);
    let j = inspect_json(&out);
    assert_eq!(j["warnings"], serde_json::json!([]), "{}", j["warnings"]);
    let rules = j["dynamic_rules"].as_array().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0]["matches"], 4, "{}", rules[0]);
}

#[test]
fn hessians_and_calibration_files_are_used_and_reported() {
    let fx = Fixture::new(5);
    let text = sample_text();
    let a = write_text(fx.tmp.path(), "a.txt", &text[..20_000]);
    let mut jsonl = String::new();
    for t in pieces(&text[20_000..], 2_000) {
        jsonl.push_str(&serde_json::json!({ "text": t }).to_string());
        jsonl.push('\n');
        let chat = serde_json::json!({ "messages": [
            {"role": "user", "content": "Summarize this."},
            {"role": "assistant", "content": t},
        ]});
        jsonl.push_str(&chat.to_string());
        jsonl.push_str("\n\n");
    }
    let b = write_text(fx.tmp.path(), "b.jsonl", &jsonl);
    let hdir = fx.path("hessians");
    let a_arg = format!("{}:0.5", a.display());
    let b_arg = format!("{}:0.5", b.display());
    let out = fx.quantized(
        "q",
        &[
            "--calib",
            &a_arg,
            "--calib",
            &b_arg,
            "--save-hessians",
            hdir.to_str().unwrap(),
        ],
    );
    let report = read_json(&out.join("quantize_report.json"));
    let usage = report["calibration"].as_array().unwrap();
    assert_eq!(usage.len(), 2, "{usage:?}");
    assert_eq!(usage[0]["name"], a.display().to_string());
    assert_eq!(usage[1]["name"], b.display().to_string());
    for u in usage {
        assert_eq!(u["weight"], 0.5, "{u}");
        assert_eq!(u["windows"], 2, "{u}");
        assert_eq!(u["tokens_used"], 2 * 64, "{u}");
        assert!(u["tokens_available"].as_u64().unwrap() >= 64, "{u}");
    }
    let settings_calib = report["settings"]["calib"].to_string();
    assert!(settings_calib.contains("a.txt") && settings_calib.contains("b.jsonl"));

    // One Hessian file per layer and distinct input (4 true-sequential groups per layer).
    let mut files: Vec<String> = std::fs::read_dir(&hdir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert!(
        files.iter().all(|f| f.ends_with(".safetensors")),
        "{files:?}"
    );
    assert_eq!(files.len(), 4 * 4, "{files:?}");
    assert!(files.iter().any(|f| f.starts_with("layer-00003.")));
    let one = hdir.join(&files[0]);
    let bytes = std::fs::read(&one).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert!(header
        .as_object()
        .unwrap()
        .keys()
        .any(|k| k != "__metadata__"));

    // A folder holding a chat-only .jsonl is a source too.
    let dir = fx.path("chat");
    std::fs::create_dir(&dir).unwrap();
    let chats: String = pieces(&text, 1_000)
        .into_iter()
        .map(|c| {
            let msgs = serde_json::json!({ "messages": [
                {"role": "user", "content": c},
                {"role": "assistant", "content": "Noted."},
            ]});
            format!("{msgs}\n")
        })
        .collect();
    let chat = write_text(&dir, "chat.jsonl", &chats);
    let out = fx.quantized("chat-q", &["--calib", dir.to_str().unwrap()]);
    let report = read_json(&out.join("quantize_report.json"));
    let usage = report["calibration"].as_array().unwrap();
    assert_eq!(usage.len(), 1);
    assert_eq!(usage[0]["name"], chat.display().to_string());
    assert_eq!(usage[0]["tokens_used"], 4 * 64);
}

#[test]
fn bad_inputs_fail_cleanly_without_leaving_an_output() {
    let fx = Fixture::new(6);
    let out = fx.path("out");
    let q = |extra: &[&str]| fx.quantize(&out, extra);

    // Models that cannot be read.
    let o = fx.quantize_model("/no/such/dir", &out, &[]);
    assert_fails_clean(&o, &out, "not a hub repo id");
    let cache = fx.path("empty-cache");
    std::fs::create_dir(&cache).unwrap();
    let o = bin()
        .args([
            "quantize",
            "--model",
            "openbmb/Not-Cached",
            "--out",
            out.to_str().unwrap(),
        ])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HUB_CACHE", &cache)
        .output()
        .unwrap();
    assert_fails_clean(
        &o,
        &out,
        "openbmb/Not-Cached@main is not in the Hugging Face cache",
    );
    let copy = |name: &str| {
        let d = fx.path(name);
        std::fs::create_dir(&d).unwrap();
        for e in std::fs::read_dir(&fx.model).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap() != "manifest.json" {
                std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
            }
        }
        d
    };
    let d = copy("truncated");
    let shard = shard_files(&d).pop().unwrap();
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    let o = fx.quantize_model(d.to_str().unwrap(), &out, &[]);
    assert_fails_clean(&o, &out, "truncated");
    assert!(stderr(&o).contains(shard.file_name().unwrap().to_str().unwrap()));
    let d = copy("shape");
    let cfgp = d.join("config.json");
    let mut c = read_json(&cfgp);
    c["intermediate_size"] = 1024.into();
    std::fs::write(&cfgp, c.to_string()).unwrap();
    let o = fx.quantize_model(d.to_str().unwrap(), &out, &[]);
    assert_fails_clean(
        &o,
        &out,
        "has shape [768, 256], but config.json implies [1024, 256]",
    );

    // Calibration that cannot give one window.
    let empty = write_text(fx.tmp.path(), "empty.txt", "");
    let o = q(&["--calib", empty.to_str().unwrap()]);
    assert_fails_clean(&o, &out, "has only 0 tokens, fewer than one window");
    assert!(stderr(&o).contains("empty.txt"));
    let short = write_text(fx.tmp.path(), "short.txt", "just a few words");
    let o = q(&["--calib", short.to_str().unwrap()]);
    assert_fails_clean(&o, &out, "fewer than one window of --seqlen 64");
    let o = q(&["--calib", "/no/such/calib.txt"]);
    assert_fails_clean(&o, &out, "no such file or folder");
    let bad = write_text(fx.tmp.path(), "bad.jsonl", "{\"text\": \"ok\"}\n{oops\n");
    let o = q(&["--calib", bad.to_str().unwrap()]);
    assert_fails_clean(&o, &out, "line 2: not valid JSON");
    let o = q(&["--calib", &format!("{}:0", fx.calib.display())]);
    assert_fails_clean(&o, &out, "the weight must be a positive number");

    // Settings the tool cannot honour.
    let o = q(&["--seqlen", "8193"]);
    assert_fails_clean(&o, &out, "above max_position_embeddings = 8192");
    let o = q(&["--group-size", "96"]);
    assert_fails_clean(
        &o,
        &out,
        "--group-size 96 does not divide in_features 256 of model.layers.0.",
    );
    // Bad option values are usage errors (exit 2), checked before the model is read.
    for (args, needle) in [
        (&["--bits", "5"][..], "5 cannot be packed"),
        (&["--damp", "0"], "is not a damping fraction"),
        (&["--damp", "2"], "is not a damping fraction"),
        (&["--nsamples", "0"], "is not a positive whole number"),
        (&["--seqlen", "0"], "is not a window length"),
        (&["--batch", "0"], "is not a positive whole number"),
        (&["--group-size", "0"], "is not a group size"),
        (&["--group-size", "-2"], "is not a group size"),
    ] {
        let o = q(args);
        assert_fails(&o, 2, needle);
        assert!(!out.exists() && !partial_path(&out).exists());
    }
    let o = q(&["--bits", "5"]);
    assert!(stderr(&o).contains("2, 3, 4 or 8"), "{}", stderr(&o));
    let o = q(&["--skip", "("]);
    assert_fails_clean(&o, &out, "--skip \"(\" is not a valid regular expression");

    // Usage errors exit 2.
    for args in [
        &["--act-order", "bogus"][..],
        &["--method", "awq"],
        &["--bits", "four"],
        &["--no-such-flag"],
    ] {
        let o = q(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(!out.exists() && !partial_path(&out).exists());
    }
    assert_eq!(run(&["quantize", "--model", "x"]).status.code(), Some(2));

    // An existing --out is kept unless --force replaces it, and --force replaces model
    // folders only.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let o = q(&[]);
    assert_fails(&o, 1, "--force");
    assert_fails(&q(&["--force"]), 1, "does not look like a model folder");
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "mine"
    );
    assert!(!partial_path(&out).exists());
    std::fs::write(out.join("config.json"), "{}").unwrap();
    let o = q(&["--force"]);
    assert_ok(&o);
    assert!(!out.join("keep.txt").exists());
    assert!(out.join("quantize_report.json").is_file());
    assert!(!partial_path(&out).exists());
}

/// `--load-hessians` re-solves without calibrating: with the same settings the weight shards are
/// byte-identical to the calibrated run that saved the Hessians; other settings work too; a
/// missing or foreign Hessian is a clear error.
#[test]
fn saved_hessians_re_solve_without_calibration() {
    let fx = Fixture::new(3);
    let hess = fx.tmp.path().join("hessians");
    let a = fx.quantized("a", &["--save-hessians", hess.to_str().unwrap()]);
    let b = fx.quantized("b", &["--load-hessians", hess.to_str().unwrap()]);
    let shards = |d: &Path| -> Vec<(String, String)> {
        let m = read_json(&d.join("manifest.json"));
        m["files"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(n, _)| n.ends_with(".safetensors"))
            .map(|(n, v)| (n.clone(), v["sha256"].as_str().unwrap().to_string()))
            .collect()
    };
    assert!(!shards(&a).is_empty());
    assert_eq!(shards(&a), shards(&b));
    let r = read_json(&b.join("quantize_report.json"));
    assert_eq!(r["settings"]["load_hessians"], hess.to_str().unwrap());
    // Other settings from the same Hessians.
    let c = fx.quantized(
        "c",
        &[
            "--load-hessians",
            hess.to_str().unwrap(),
            "--group-size",
            "64",
            "--act-order",
            "dynamic",
        ],
    );
    assert_ne!(shards(&a), shards(&c));
    assert_eq!(
        read_json(&c.join("config.json"))["quantization_config"]["group_size"],
        64
    );
    // A missing file.
    std::fs::remove_file(hess.join("layer-00000.qkv.safetensors")).unwrap();
    let out = fx.tmp.path().join("d");
    let o = run(&[
        "quantize",
        "--model",
        fx.model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--load-hessians",
        hess.to_str().unwrap(),
    ]);
    assert_fails_clean(&o, &out, "layer-00000.qkv.safetensors is missing");
}

/// `--method gptaq` (a second, full-precision stream) and `--refit`: outputs that load and
/// differ from GPTQ's, reproducible, resumable to the same bytes (the replay advances both
/// streams), recorded in the settings; bad combinations are usage errors before any work.
#[test]
fn gptaq_and_refit_run_resume_and_refuse_bad_combinations() {
    let fx = Fixture::new(5);
    let gptq = fx.quantized("gptq", &[]);
    let gptaq = fx.quantized("gptaq", &["--method", "gptaq", "--refit"]);
    assert_ne!(manifest(&gptq), manifest(&gptaq));
    let again = fx.quantized("again", &["--method", "gptaq", "--refit"]);
    assert_eq!(manifest(&gptaq), manifest(&again));
    let qc = &read_json(&gptaq.join("config.json"))["quantization_config"];
    assert_eq!(qc["meta"]["method"], "gptaq");
    assert_eq!(qc["meta"]["gptaq_alpha"], 1.0);
    assert_eq!(qc["meta"]["refit"], true);
    let report = read_json(&gptaq.join("quantize_report.json"));
    assert_eq!(report["settings"]["method"], "gptaq");
    assert!(report["stages"]["refit"].as_f64().unwrap() > 0.0);
    // GPTAQ with alpha 0 is GPTQ's solve, with GPTQ's codes.
    let zero = fx.quantized("zero", &["--method", "gptaq", "--gptaq-alpha", "0"]);
    for m in [
        "model.layers.2.mlp.down_proj",
        "model.layers.3.self_attn.q_proj",
    ] {
        let w = format!("{m}.qweight");
        assert_eq!(i32s(&zero, &w), i32s(&gptq, &w), "{w}");
    }

    let out = fx.path("resumed");
    let args = ["--method", "gptaq", "--refit"];
    let o = fx.quantize(&out, &[&args[..], &["--stop-after-layers", "2"]].concat());
    assert_fails(&o, 1, "2 finished layer(s) are kept in");
    assert_ok(&fx.quantize(&out, &[&args[..], &["--resume"]].concat()));
    assert_eq!(manifest(&out), manifest(&gptaq));
    assert_ok(&run(&[
        "eval-ppl",
        "--model",
        fx.model.to_str().unwrap(),
        "--compare",
        out.to_str().unwrap(),
        "--data",
        fx.calib.to_str().unwrap(),
        "--seqlen",
        "32",
        "--max-windows",
        "2",
    ]));

    for (extra, needle) in [
        (
            &["--method", "gptaq", "--no-true-sequential"][..],
            "--method gptaq needs true-sequential",
        ),
        (
            &["--method", "gptq", "--gptaq-alpha", "0.5"],
            "--gptaq-alpha applies",
        ),
        (
            &["--method", "gptaq", "--gptaq-alpha", "2"],
            "is not a GPTAQ share",
        ),
        (&["--method", "rtn", "--refit"], "--refit fits scales"),
        (
            &["--method", "gptaq", "--load-hessians", "/nonexistent"],
            "cannot --load-hessians",
        ),
    ] {
        let bad = fx.path("bad");
        let o = fx.quantize(&bad, extra);
        assert_fails(&o, 2, needle);
        assert!(!bad.exists() && !partial_path(&bad).exists());
    }
}

/// `export-calib` writes the windows `quantize` calibrates on: the same SHA-256 as the run's
/// report (over the ids it wrote), the lengths asked for, ids that are the calibration text's
/// own tokens; and the same bytes twice. Its --out is guarded like every output.
#[test]
fn export_calib_writes_the_windows_quantize_uses() {
    use sha2::{Digest, Sha256};
    let fx = Fixture::new(5);
    let calib = fx.calib.to_str().unwrap();
    let model = fx.model.to_str().unwrap();
    let q = fx.quantized("q", &["--seqlen", "40..64", "--seed", "3"]);
    let export = |name: &str| {
        let out = fx.path(name);
        let o = run(&[
            "export-calib",
            "--model",
            model,
            "--calib",
            calib,
            "--nsamples",
            "4",
            "--seqlen",
            "40..64",
            "--seed",
            "3",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_ok(&o);
        assert!(stdout(&o).contains("4 windows"), "{}", stdout(&o));
        out
    };
    let (a, b) = (export("a.json"), export("b.json"));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let doc = read_json(&a);
    let windows: Vec<Vec<u32>> = serde_json::from_value(doc["windows"].clone()).unwrap();
    assert_eq!(windows.len(), 4);
    assert!(windows.iter().all(|w| (40..=64).contains(&w.len())));
    assert!(
        windows.iter().any(|w| w.len() != windows[0].len()),
        "a mix of lengths"
    );
    let mut h = Sha256::new();
    windows
        .iter()
        .flatten()
        .for_each(|id| h.update(id.to_le_bytes()));
    let sha: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(doc["calibration_sha256"], sha.as_str());
    let report = read_json(&q.join("quantize_report.json"));
    assert_eq!(report["calibration_sha256"], sha.as_str());
    // Every window is a run of the calibration text's tokens.
    let tok = tokenizers::Tokenizer::from_file(fx.model.join("tokenizer.json")).unwrap();
    let ids = tok.encode(sample_text(), false).unwrap().get_ids().to_vec();
    for w in &windows {
        assert!(
            ids.windows(w.len()).any(|s| s == &w[..]),
            "window not in the text"
        );
    }
    // The output is never an input, and an existing file needs --force.
    let o = run(&[
        "export-calib",
        "--model",
        model,
        "--out",
        a.to_str().unwrap(),
    ]);
    assert_fails(&o, 1, "pass --force");
    let cfg = fx.model.join("config.json");
    let o = run(&[
        "export-calib",
        "--model",
        model,
        "--out",
        cfg.to_str().unwrap(),
        "--force",
    ]);
    assert_fails(&o, 1, "inputs are never modified");
    let o = run(&[
        "export-calib",
        "--model",
        model,
        "--out",
        "x.json",
        "--seqlen",
        "0",
    ]);
    assert_fails(&o, 2, "--seqlen");
}
