//! Plans and sensitivity keep the promises of the rest of the tool: `sensitivity --plan-out` goes
//! through the output guard (never an input, never a folder or device, an existing file only with
//! `--force`, all checked before the scoring pass), a `--quantized` folder made from another model
//! is refused, every key and rule of a plan takes effect or is refused by name before the first
//! layer, and the messages name what is at fault (`--data`, the setting a `--resume` changed, what
//! a mislabelled folder holds).

use crate::common::*;

use serde_json::Value;
use soar_gptq::checkpoint::output_dir::partial_path;
use std::path::{Path, PathBuf};
use std::process::Output;

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// Files in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A quick quantize of `model` into `out` (RTN unless `extra` says otherwise).
fn quantize_run(model: &str, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "quantize",
        "--model",
        model,
        "--out",
        out.to_str().unwrap(),
        "--nsamples",
        "2",
        "--seqlen",
        "64",
        "--device",
        "cpu",
    ];
    if !extra.contains(&"--method") {
        args.extend(["--method", "rtn"]);
    }
    args.extend_from_slice(extra);
    run(&args)
}

/// `sensitivity` of `q` against the fixture, small, with `extra`.
fn sensitivity_run(q: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "sensitivity",
        "--model",
        FIXTURE,
        "--quantized",
        q.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "2",
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    run(&args)
}

/// The fixture quantized (RTN) into `root/q4`.
fn q4(root: &Path) -> PathBuf {
    let q = root.join("q4");
    assert_ok(&quantize_run(FIXTURE, &q, &[]));
    q
}

const BUDGET: [&str; 2] = ["--budget-pct", "10"];

#[test]
fn plan_out_never_replaces_an_input() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let q = q4(root);
    let text = sample_text();
    let data = write_text(root, "d.txt", &text);
    let d = data.to_str().unwrap();

    // --plan-out is the --data file: refused (with --force too), the text intact.
    for force in [&[][..], &["--force"][..]] {
        let o = sensitivity_run(
            &q,
            &[&BUDGET[..], &["--data", d, "--plan-out", d], force].concat(),
        );
        assert_fails(&o, 1, "is the input --data");
        assert_eq!(std::fs::read_to_string(&data).unwrap(), text);
    }
    // An input named like the old temporary file of the output is never touched.
    let t_tmp = write_text(root, "t.json.tmp", &text);
    let t = root.join("t.json");
    let o = sensitivity_run(
        &q,
        &[
            &BUDGET[..],
            &[
                "--data",
                t_tmp.to_str().unwrap(),
                "--plan-out",
                t.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert_ok(&o);
    assert_eq!(std::fs::read_to_string(&t_tmp).unwrap(), text);
    assert_eq!(read_json(&t)["format"], "soar-gptq-plan");
}

#[test]
fn plan_out_refusals_name_the_flag_of_the_input() {
    let tmp = tempfile::tempdir().unwrap();
    let q = q4(tmp.path());
    let inside = q.join("plan.json");
    let o = sensitivity_run(
        &q,
        &[&BUDGET[..], &["--plan-out", inside.to_str().unwrap()]].concat(),
    );
    assert_fails(&o, 1, "is inside the input --quantized");
    assert!(!stderr(&o).contains("an input"), "{}", stderr(&o));
    assert!(!inside.exists());
    let inside = format!("{FIXTURE}/plan.json");
    let o = sensitivity_run(&q, &[&BUDGET[..], &["--plan-out", &inside]].concat());
    assert_fails(&o, 1, "is inside the input --model");
}

#[test]
fn plan_out_replaces_a_file_only_with_force_and_never_a_device() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let q = q4(root);
    let t = root.join("t.json");
    std::fs::write(&t, "keep me").unwrap();
    let before = names_in(root);
    let o = sensitivity_run(
        &q,
        &[&BUDGET[..], &["--plan-out", t.to_str().unwrap()]].concat(),
    );
    assert_fails(&o, 1, "already exists: pass --force");
    assert_eq!(std::fs::read_to_string(&t).unwrap(), "keep me");
    let o = sensitivity_run(
        &q,
        &[&BUDGET[..], &["--plan-out", t.to_str().unwrap(), "--force"]].concat(),
    );
    assert_ok(&o);
    assert_eq!(read_json(&t)["format"], "soar-gptq-plan");
    let o = sensitivity_run(
        &q,
        &[&BUDGET[..], &["--plan-out", "/dev/null", "--force"]].concat(),
    );
    assert_fails(&o, 1, "is not a regular file");
    assert_eq!(names_in(root), before, "no temporary file left behind");
}

#[test]
fn plan_out_problems_are_found_before_anything_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    // --quantized does not even exist: the --plan-out problem is what is reported, so it was
    // checked before anything was read (let alone scored).
    let missing_q = root.join("no-such-q");
    let dir = root.join("dir");
    std::fs::create_dir(&dir).unwrap();
    let o = sensitivity_run(
        &missing_q,
        &[&BUDGET[..], &["--plan-out", dir.to_str().unwrap()]].concat(),
    );
    assert_fails(&o, 1, "is a folder");
    let nope = root.join("nope");
    let o = sensitivity_run(
        &missing_q,
        &[
            &BUDGET[..],
            &["--plan-out", nope.join("plan.json").to_str().unwrap()],
        ]
        .concat(),
    );
    assert_fails(&o, 1, "does not exist");
    assert!(stderr(&o).contains(&nope.display().to_string()));
    assert_eq!(names_in(root), ["dir"], "nothing written, no dir.tmp");
    assert!(names_in(&dir).is_empty());
}

#[test]
fn a_plan_that_chose_no_unit_is_not_written() {
    let tmp = tempfile::tempdir().unwrap();
    let q = q4(tmp.path());
    let none = tmp.path().join("none.json");
    let o = sensitivity_run(
        &q,
        &["--budget-gb", "0", "--plan-out", none.to_str().unwrap()],
    );
    assert_fails(&o, 1, "the plan chose no unit");
    assert!(
        stderr(&o).contains("no unit fits the budget"),
        "{}",
        stderr(&o)
    );
    assert!(stdout(&o).contains("KL gain"), "{}", stdout(&o));
    assert!(!none.exists());
}

#[test]
fn sensitivity_refuses_a_quantized_folder_made_from_another_model() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    // A random model with the fixture's config and shapes, quantized.
    let other = synth_tiny(root, "other", 7);
    let q_other = root.join("q-other");
    assert_ok(&quantize_run(other.to_str().unwrap(), &q_other, &[]));
    let o = sensitivity_run(&q_other, &[]);
    assert_fails(&o, 1, "was not made from --model");
    let err = stderr(&o);
    assert!(
        err.contains(q_other.to_str().unwrap()) && err.contains(FIXTURE),
        "{err}"
    );
    assert!(stdout(&o).is_empty());

    // Without a report (another tool's folder), a note, and the run goes on.
    let q = root.join("q");
    assert_ok(&quantize_run(FIXTURE, &q, &[]));
    let bare = root.join("bare");
    copy_dir(&q, &bare);
    std::fs::remove_file(bare.join("quantize_report.json")).unwrap();
    std::fs::remove_file(bare.join("manifest.json")).unwrap();
    let o = sensitivity_run(&bare, &[]);
    assert_ok(&o);
    assert!(
        stderr(&o).contains("has no quantize_report.json"),
        "{}",
        stderr(&o)
    );
    // Its own source passes without a note.
    let o = sensitivity_run(&q, &[]);
    assert_ok(&o);
    assert!(!stderr(&o).contains("note:"), "{}", stderr(&o));
}

#[test]
fn plans_that_would_change_nothing_are_refused_before_the_first_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = tmp.path().join("plan.json");
    let out = tmp.path().join("out");
    let cases = [
        (
            serde_json::json!({"dynamic": {"+:.*mlp.*": {"bitz": 8}}}),
            "unknown key \"bitz\"",
        ),
        (
            serde_json::json!({"dynamic": {"+:lm_head": {"bits": 8}}}),
            "matches no module",
        ),
        (
            serde_json::json!({"dynamic": {"+:model\\.embed_tokens": {"bits": 8}}}),
            "matches no module",
        ),
        (
            serde_json::json!({"dynamic": {"+:model\\.layers\\.31\\.mlp\\..*": {"bits": 8}}}),
            "matches no module",
        ),
        (
            serde_json::json!({"dynamic": {"-:model\\.layers\\.0\\.mlp\\..*": {"bits": 8}}}),
            "would be dropped",
        ),
    ];
    for (v, needle) in cases {
        write_json(&plan, &v);
        let o = quantize_run(FIXTURE, &out, &["--plan", plan.to_str().unwrap()]);
        assert_fails(&o, 1, needle);
        assert!(
            !out.exists() && !partial_path(&out).exists(),
            "{v}: output written"
        );
    }
}

#[test]
fn a_plan_rule_with_bits_16_points_to_a_keep_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = tmp.path().join("plan.json");
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\..*": {"bits": 16}}}),
    );
    let o = quantize_run(
        FIXTURE,
        &tmp.path().join("out"),
        &["--plan", plan.to_str().unwrap()],
    );
    assert_fails(&o, 1, r#""-:model\\.layers\\.0\\.mlp\\..*": {}"#);
}

#[test]
fn unmatched_rules_are_accepted_only_when_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = tmp.path().join("plan.json");
    let out = tmp.path().join("out");
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {
            "+:model\\.layers\\.0\\.mlp\\..*": {"bits": 8},
            "+:lm_head": {"bits": 8}
        }}),
    );
    let o = quantize_run(
        FIXTURE,
        &out,
        &["--plan", plan.to_str().unwrap(), "--allow-unmatched-rules"],
    );
    assert_ok(&o);
    assert!(
        stderr(&o).contains("note: 1 --plan rule(s) change nothing")
            && stderr(&o).contains("lm_head"),
        "{}",
        stderr(&o)
    );
    let dynamic = read_json(&out.join("config.json"))["quantization_config"]["dynamic"].to_string();
    assert!(
        !dynamic.contains("lm_head") && dynamic.contains("layers\\\\.0\\\\.mlp"),
        "{dynamic}"
    );
}

#[test]
fn a_plan_that_starts_with_a_byte_order_mark_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let bom = tmp.path().join("bom.json");
    let mut bytes = "\u{feff}".as_bytes().to_vec();
    bytes.extend(
        serde_json::to_vec(
            &serde_json::json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\..*": {"bits": 8}}}),
        )
        .unwrap(),
    );
    std::fs::write(&bom, bytes).unwrap();
    let out = tmp.path().join("out");
    assert_ok(&quantize_run(
        FIXTURE,
        &out,
        &["--plan", bom.to_str().unwrap()],
    ));
    let report = read_json(&out.join("quantize_report.json"));
    let down = report["modules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["module"] == "model.layers.0.mlp.down_proj")
        .unwrap()
        .clone();
    assert_eq!(down["bits"], 8);
}

#[test]
fn a_plan_with_too_many_rules_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = tmp.path().join("plan.json");
    let mut dynamic = serde_json::Map::new();
    for i in 0..20_000 {
        dynamic.insert(
            format!("+:model\\.layers\\.{i}\\.mlp\\..*"),
            serde_json::json!({"bits": 8}),
        );
    }
    write_json(&plan, &serde_json::json!({ "dynamic": dynamic }));
    let t = std::time::Instant::now();
    let o = quantize_run(
        FIXTURE,
        &tmp.path().join("out"),
        &["--plan", plan.to_str().unwrap()],
    );
    assert_fails(&o, 1, "20000 rules, more than the 4096");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn resume_names_the_setting_that_differs() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = tmp.path().join("plan.json");
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\..*": {"bits": 8}}}),
    );
    let out = tmp.path().join("q");
    let p = plan.to_str().unwrap();
    let gptaq = ["--method", "gptaq", "--plan", p];
    assert_fails(
        &quantize_run(
            FIXTURE,
            &out,
            &[&gptaq[..], &["--stop-after-layers", "1"]].concat(),
        ),
        1,
        "finished layer(s) are kept",
    );
    let o = quantize_run(
        FIXTURE,
        &out,
        &[&gptaq[..], &["--resume", "--gptaq-alpha", "0.5"]].concat(),
    );
    assert_fails(&o, 1, "the quantization settings differ");
    assert!(
        stderr(&o).contains("--gptaq-alpha (1.0 then, 0.5 now)"),
        "{}",
        stderr(&o)
    );
    write_json(
        &plan,
        &serde_json::json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\.down_proj": {"group_size": 64}}}),
    );
    let o = quantize_run(FIXTURE, &out, &[&gptaq[..], &["--resume"]].concat());
    assert_fails(&o, 1, "the quantization settings differ");
    let err = stderr(&o);
    assert!(
        err.contains("--plan (model.layers.0.mlp.down_proj 8/128 then, 4/64 now")
            && err.contains("model.layers.0.mlp.gate_proj 8/128 then, default now"),
        "{err}"
    );
    assert!(partial_path(&out).exists());
}

#[test]
fn a_window_of_one_token_is_a_usage_error() {
    // --seqlen 1 is a usage error for both commands that score windows.
    let o = run(&["eval-ppl", "--model", FIXTURE, "--seqlen", "1"]);
    assert_fails(&o, 2, "at least 2");
    let o = run(&[
        "sensitivity",
        "--model",
        FIXTURE,
        "--quantized",
        FIXTURE,
        "--seqlen",
        "1",
    ]);
    assert_fails(&o, 2, "at least 2");
    let o = run(&[
        "quantize", "--model", FIXTURE, "--out", "unused", "--seqlen", "1",
    ]);
    assert_fails(&o, 2, "at least 2");
}

#[test]
fn an_empty_or_one_token_data_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, text, needle) in [
        ("empty.txt", "", "is empty"),
        ("one.txt", "the", "has 1 token,"),
    ] {
        let p = write_text(tmp.path(), name, text);
        let o = run(&[
            "eval-ppl",
            "--model",
            FIXTURE,
            "--data",
            p.to_str().unwrap(),
            "--seqlen",
            "64",
            "--device",
            "cpu",
        ]);
        assert_fails(&o, 1, &format!("--data {}", p.display()));
        assert!(stderr(&o).contains(needle), "{}", stderr(&o));
    }
}

#[test]
fn a_gptq_folder_labelled_marlin_is_reported_as_what_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let q = tmp.path().join("q");
    assert_ok(&quantize_run(FIXTURE, &q, &[]));
    let relabelled: PathBuf = tmp.path().join("relabelled");
    copy_dir(&q, &relabelled);
    std::fs::remove_file(relabelled.join("manifest.json")).unwrap();
    let cfg = relabelled.join("config.json");
    let mut c = read_json(&cfg);
    c["quantization_config"]["checkpoint_format"] = serde_json::json!("marlin");
    write_json(&cfg, &c);
    // SGLang (vLLM has no MiniCPM-SALA to get that far; its message is written the same way).
    let o = run(&[
        "inspect",
        relabelled.to_str().unwrap(),
        "--engine",
        "sglang",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let all = format!("{}{}", stdout(&o), stderr(&o));
    assert!(
        all.contains("holds GPTQ tensors") && all.contains("set checkpoint_format to"),
        "{all}"
    );
    assert!(!all.contains("finds B/s"), "{all}");
}
