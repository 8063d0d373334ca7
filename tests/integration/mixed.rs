//! Mixed precision and sensitivity, run as a user runs them: `sensitivity` ranks the units of a
//! quantized checkpoint by what restoring each buys (a deliberately damaged module comes first,
//! the same ranking every run) and writes a plan; `quantize --plan` honours per-module bits and
//! group sizes and writes `dynamic` rules the engines apply as it did; the folders round-trip
//! through `eval-ppl`, `inspect` and `pack-marlin` (which refuses 8-bit modules clearly); bad
//! plans are refused before any work.

use crate::common::*;

use serde_json::Value;
use soar_gptq::checkpoint::output_dir::partial_path;
use soar_gptq::checkpoint::Dtype;
use std::path::{Path, PathBuf};

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// `quantize` of the fixture into `out` with a small calibration of its own text, then `extra`.
fn quantize_run(out: &Path, extra: &[&str]) -> std::process::Output {
    let corpus = format!("{FIXTURE}/corpus/sotu-1790-1999.txt");
    let mut args = vec![
        "quantize",
        "--model",
        FIXTURE,
        "--out",
        out.to_str().unwrap(),
        "--calib",
        &corpus,
        "--nsamples",
        "8",
        "--seqlen",
        "128",
        "--device",
        "cpu",
    ];
    args.extend(extra);
    run(&args)
}

/// [`quantize_run`] into `dir/name`, which must succeed.
fn quantize(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    assert_ok(&quantize_run(&out, extra));
    out
}

fn sensitivity(q: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "sensitivity",
        "--model",
        FIXTURE,
        "--quantized",
        q.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "6",
        "--device",
        "cpu",
        "--json",
    ];
    args.extend(extra);
    let o = run(&args);
    assert_ok(&o);
    serde_json::from_str(&stdout(&o)).unwrap()
}

fn unit_names(r: &Value) -> Vec<String> {
    r["units"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["name"].as_str().unwrap().to_string())
        .collect()
}

fn eval(reference: &str, compare: &Path) -> Value {
    let o = run(&[
        "eval-ppl",
        "--model",
        reference,
        "--compare",
        compare.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "4",
        "--json",
    ]);
    assert_ok(&o);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    v["compared"][0].clone()
}

#[test]
fn sensitivity_puts_a_damaged_module_first_and_its_plan_quantizes() {
    let tmp = tempfile::tempdir().unwrap();
    let q = quantize(tmp.path(), "q", &[]);
    // Damage one module: its fp16 scales tripled.
    let damaged = tmp.path().join("damaged");
    let target = "model.layers.2.mlp.down_proj.scales";
    rewrite_tensors(&q, &damaged, |name, ck| {
        let e = ck.get(name).unwrap();
        let mut bytes = ck.bytes(name).unwrap().to_vec();
        if name == target {
            assert_eq!(e.dtype, Dtype::F16);
            for b in bytes.chunks_exact_mut(2) {
                let v = half::f16::from_le_bytes([b[0], b[1]]).to_f32() * 3.0;
                b.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        vec![(name.to_string(), e.dtype, e.shape.clone(), bytes)]
    });

    let by_module = sensitivity(&damaged, &["--granularity", "module"]);
    let names = unit_names(&by_module);
    assert_eq!(names[0], "model.layers.2.mlp.down_proj", "{names:?}");
    // Fused groups are one unit, as the engines load them.
    assert!(names.contains(&"model.layers.0.self_attn.qkv_proj".to_string()));
    assert!(!names.iter().any(|n| n.ends_with("q_proj")));
    let gains: Vec<f64> = by_module["units"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["kl_gain"].as_f64().unwrap())
        .collect();
    assert!(gains.windows(2).all(|w| w[0] >= w[1]), "ranked: {gains:?}");
    assert!(gains[0] > 2.0 * gains[1], "the damage dominates: {gains:?}");

    let by_block = sensitivity(&damaged, &["--alone"]);
    assert_eq!(unit_names(&by_block)[0], "model.layers.2.mlp");
    assert_eq!(unit_names(&by_block).len(), 8);
    let first = &by_block["units"][0];
    assert!(first["alone"]["mean_kl"].as_f64().unwrap() > 0.0);
    // Deterministic: the same ranking and figures on a second run.
    let mut again = sensitivity(&damaged, &["--alone"]);
    let mut by_block = by_block;
    by_block["seconds"] = Value::Null;
    again["seconds"] = Value::Null;
    assert_eq!(by_block, again);

    // A plan within 4% of the checkpoint: the damaged unit, upgraded to 8 bits.
    let plan = tmp.path().join("plan.json");
    let r = sensitivity(
        &damaged,
        &[
            "--granularity",
            "module",
            "--budget-pct",
            "4",
            "--plan-out",
            plan.to_str().unwrap(),
        ],
    );
    let p = &r["plan"];
    assert_eq!(p["units"][0], "model.layers.2.mlp.down_proj");
    let budget = p["budget_bytes"].as_u64().unwrap();
    assert!(p["extra_bytes"].as_u64().unwrap() <= budget);
    let file = read_json(&plan);
    assert_eq!(file["format"], "soar-gptq-plan");
    assert_eq!(
        file["dynamic"]["+:model\\.layers\\.2\\.mlp\\.down_proj$"]["bits"],
        8
    );

    // Quantized with the plan: that module in 8 bits, the engine check passes, it scores.
    let mixed = quantize(tmp.path(), "mixed", &["--plan", plan.to_str().unwrap()]);
    let report = read_json(&mixed.join("quantize_report.json"));
    let row = |m: &str| {
        report["modules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["module"] == m)
            .unwrap()
            .clone()
    };
    assert_eq!(row("model.layers.2.mlp.down_proj")["bits"], 8);
    assert_eq!(row("model.layers.2.mlp.up_proj")["bits"], 4);
    let qc = &read_json(&mixed.join("config.json"))["quantization_config"];
    assert_eq!(
        qc["dynamic"]["+:model\\.layers\\.2\\.mlp\\.down_proj$"],
        serde_json::json!({"bits": 8, "group_size": 128})
    );
    assert_ok(&run(&[
        "inspect",
        mixed.to_str().unwrap(),
        "--engine",
        "sglang",
    ]));
    let (plain, with_plan) = (eval(FIXTURE, &q), eval(FIXTURE, &mixed));
    assert!(with_plan["mean_kl"].as_f64().unwrap() < 1.5 * plain["mean_kl"].as_f64().unwrap());

    // --plan-out without a budget or target, and a bad upgrade: usage errors.
    let o = run(&[
        "sensitivity",
        "--model",
        FIXTURE,
        "--quantized",
        q.to_str().unwrap(),
        "--plan-out",
        tmp.path().join("p2.json").to_str().unwrap(),
    ]);
    assert_fails(&o, 2, "--plan-out needs a plan");
    let o = run(&[
        "sensitivity",
        "--model",
        FIXTURE,
        "--quantized",
        q.to_str().unwrap(),
        "--upgrade",
        "6",
    ]);
    assert_fails(&o, 2, "use 8 (bits) or 16");
    // The source as --quantized is refused with what to give instead.
    let o = run(&["sensitivity", "--model", FIXTURE, "--quantized", FIXTURE]);
    assert_fails(&o, 1, "holds no quantization settings");
}

#[test]
fn mixed_precision_round_trips_and_bad_plans_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = tmp.path().join("plan.json");
    // 4-bit only: layer 1's attention per row (group -1), layer 3's down_proj kept in 16 bits.
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {
            "+:model\\.layers\\.1\\.self_attn\\..*": {"group_size": -1},
            "-:model\\.layers\\.3\\.mlp\\.down_proj": {}
        }}),
    );
    let mixed = quantize(tmp.path(), "mixed", &["--plan", plan.to_str().unwrap()]);
    let ins = run(&["inspect", mixed.to_str().unwrap(), "--json"]);
    assert_ok(&ins);
    let qc = &read_json(&mixed.join("config.json"))["quantization_config"];
    let dynamic = qc["dynamic"].as_object().unwrap();
    assert_eq!(
        dynamic["+:model\\.layers\\.1\\.self_attn\\.(?:q_proj|k_proj|v_proj|qkv_proj)$"],
        serde_json::json!({"bits": 4, "group_size": -1})
    );
    assert!(dynamic.contains_key("-:model\\.layers\\.3\\.mlp\\.down_proj$"));
    let ck = soar_gptq::checkpoint::Checkpoint::open(&mixed).unwrap();
    assert_eq!(
        ck.get("model.layers.1.self_attn.o_proj.scales")
            .unwrap()
            .shape[0],
        1,
        "one group per row"
    );
    assert_eq!(
        ck.get("model.layers.2.self_attn.o_proj.scales")
            .unwrap()
            .shape[0],
        2
    );
    assert!(ck.get("model.layers.3.mlp.down_proj.weight").is_some());
    let sglang = run(&["inspect", mixed.to_str().unwrap(), "--engine", "sglang"]);
    assert_ok(&sglang);
    // transformers ignores `dynamic`: refused with the reason.
    assert_fails(
        &run(&[
            "inspect",
            mixed.to_str().unwrap(),
            "--engine",
            "transformers",
        ]),
        1,
        "dynamic",
    );

    // Through pack-marlin: bit-exact tiles, the same scores.
    let marlin = tmp.path().join("marlin");
    assert_ok(&run(&[
        "pack-marlin",
        "--in",
        mixed.to_str().unwrap(),
        "--out",
        marlin.to_str().unwrap(),
    ]));
    assert_ok(&run(&[
        "inspect",
        marlin.to_str().unwrap(),
        "--engine",
        "sglang",
        "--legacy-marlin",
    ]));
    let (a, b) = (eval(FIXTURE, &mixed), eval(FIXTURE, &marlin));
    assert_eq!(a["ppl"], b["ppl"]);
    assert_eq!(a["mean_kl"], b["mean_kl"]);

    // 8 bits: evaluated and inspected, and pack-marlin says why it cannot hold it.
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\..*": {"bits": 8}}}),
    );
    let eight = quantize(tmp.path(), "eight", &["--plan", plan.to_str().unwrap()]);
    assert_ok(&run(&[
        "inspect",
        eight.to_str().unwrap(),
        "--engine",
        "sglang",
    ]));
    eval(FIXTURE, &eight);
    let o = run(&[
        "pack-marlin",
        "--in",
        eight.to_str().unwrap(),
        "--out",
        tmp.path().join("m8").to_str().unwrap(),
    ]);
    assert_fails(&o, 1, "Marlin packing holds 4-bit codes only");
    assert!(!tmp.path().join("m8").exists());

    // A plan of 16-bit units only (what `sensitivity --upgrade 16` writes): every kept Linear,
    // fused or not, gets its rule, so SGLang builds it unquantized.
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {"-:model\\.layers\\.1\\.self_attn\\..*": {}}}),
    );
    let kept = quantize(tmp.path(), "kept", &["--plan", plan.to_str().unwrap()]);
    let dynamic = read_json(&kept.join("config.json"))["quantization_config"]["dynamic"].clone();
    for m in ["(?:q_proj|k_proj|v_proj|qkv_proj)", "o_proj", "z_proj"] {
        let key = format!("-:model\\.layers\\.1\\.self_attn\\.{m}$");
        assert!(dynamic.get(&key).is_some(), "{key} in {dynamic}");
    }
    assert_ok(&run(&[
        "inspect",
        kept.to_str().unwrap(),
        "--engine",
        "sglang",
    ]));

    // A resume with another plan is refused (the plan is part of the settings).
    let out = tmp.path().join("resumed");
    let with_plan = ["--plan", plan.to_str().unwrap()];
    assert_fails(
        &quantize_run(
            &out,
            &[&with_plan[..], &["--stop-after-layers", "1"]].concat(),
        ),
        1,
        "finished layer(s) are kept",
    );
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\..*": {"bits": 4, "group_size": 64}}}),
    );
    let o = quantize_run(&out, &[&with_plan[..], &["--resume"]].concat());
    assert_fails(&o, 1, "the quantization settings differ");
    assert!(partial_path(&out).exists());

    // Bad plans: refused before any work, nothing written.
    let bad = tmp.path().join("bad");
    for (rules, needle) in [
        (
            serde_json::json!({"dynamic": {"+:.*\\.q_proj": {"bits": 8}}}),
            "matches both",
        ),
        (
            serde_json::json!({"dynamic": {"+:model\\.layers\\.0\\.self_attn\\.(q|k|v)_proj": {"bits": 8}}}),
            "matches both",
        ),
        (
            serde_json::json!({"dynamic": {"+:.*down_proj": {"bits": 5}}}),
            "2, 3, 4 or 8",
        ),
        (
            serde_json::json!({"dynamic": {"+:.*down_proj": {"sym": false}}}),
            "sym or desc_act",
        ),
        (
            serde_json::json!({"dynamic": {"+:.*down_proj": {"group_size": 100}}}),
            "does not divide",
        ),
        (serde_json::json!({"rules": {}}), "a plan is a JSON object"),
    ] {
        write_json(&plan, &rules);
        let o = run(&[
            "quantize",
            "--model",
            FIXTURE,
            "--out",
            bad.to_str().unwrap(),
            "--plan",
            plan.to_str().unwrap(),
            "--device",
            "cpu",
        ]);
        assert_fails(&o, 1, needle);
        assert!(!bad.exists() && !partial_path(&bad).exists(), "{needle}");
    }
}
