//! The quality gate on the trained fixture (`examples/tiny-sala`): with the default settings
//! (GPTQ, group 128, static act-order, MSE range search), quantization beats round-to-nearest at
//! 4 bits and at 3 bits on held-out text: a smaller perplexity increase over the BF16 model, and
//! a mean KL divergence from the BF16 model's next-token distribution at most 75% (4 bits) and
//! 65% (3 bits) of RTN's; vanilla GPTQ (`--no-mse`) at most 85%; GPTAQ (`--method gptaq`) at
//! most 75% at 4 bits. Also printed by the CI artifacts job (`.ci/artifacts.sh`, 4 bits).
//!
//! Measured on 400 held-out windows (docs/benchmarks.md, Quality on the fixture): default 0.67
//! and 0.55 of RTN's mean KL at 4 and 3 bits, vanilla GPTQ 0.79 and 0.78, GPTAQ 0.62 and 0.51.
//! On this 5.6M-parameter model GPTQ's per-module output error is 10-45% below RTN's, not the
//! 2-3x of large models, whose inputs have outlier features that this small, isotropic model
//! lacks. The thresholds are what the fixture supports with margin on the 96 windows scored here.
//!
//! Run as a user runs it: `quantize` (GPTQ and RTN) then `eval-ppl --compare`, end to end. The
//! calibration is the fixture's own training text (1790-1999), the evaluation the held-out
//! 2000-2021 text compiled into the binary (no overlap).

use crate::common::bin;
use serde_json::Value;
use std::path::{Path, PathBuf};

const FIXTURE: &str = "examples/tiny-sala";

fn quantize(out: &Path, extra: &[&str]) {
    let o = bin()
        .args(["quantize", "--model", FIXTURE, "--out"])
        .arg(out)
        .args([
            "--calib",
            "examples/tiny-sala/corpus/sotu-1790-1999.txt",
            "--nsamples",
            "64",
            "--seqlen",
            "512",
            "--device",
            "cpu",
        ])
        .args(extra)
        .output()
        .expect("run soar-gptq");
    assert!(
        o.status.success(),
        "quantize {extra:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `(Δppl, mean KL)` of each compared folder against the fixture, in order.
fn compare(dirs: &[PathBuf]) -> Vec<(f64, f64)> {
    let mut cmd = bin();
    cmd.args(["eval-ppl", "--model", FIXTURE, "--data", "default"]);
    cmd.args([
        "--seqlen",
        "256",
        "--max-windows",
        "96",
        "--device",
        "cpu",
        "--json",
    ]);
    for d in dirs {
        cmd.arg("--compare").arg(d);
    }
    let o = cmd.output().expect("run soar-gptq");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let reference = v["reference"]["ppl"].as_f64().unwrap();
    eprintln!("BF16 ppl {reference:.4}");
    v["compared"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let (d, kl) = (
                m["delta_ppl"].as_f64().unwrap(),
                m["mean_kl"].as_f64().unwrap(),
            );
            eprintln!(
                "{:<12} ppl {:.4} Δppl {:+.4} mean KL {:.5}",
                Path::new(m["model"].as_str().unwrap())
                    .file_name()
                    .unwrap()
                    .to_string_lossy(),
                m["ppl"].as_f64().unwrap(),
                d,
                kl
            );
            (d, kl)
        })
        .collect()
}

#[test]
#[ignore = "slow: seven quantizations and eight evaluations of the fixture"]
fn gptq_beats_rtn_at_4_and_3_bits_on_held_out_text() {
    let tmp = tempfile::tempdir().unwrap();
    let mut runs: Vec<(PathBuf, Vec<&str>)> = vec![];
    let variants: [(&str, &[&str]); 3] = [
        ("default", &[]),
        // Plain round-to-nearest (min/max ranges), the baseline every ratio is taken against.
        ("rtn", &["--method", "rtn", "--no-mse"]),
        ("vanilla", &["--no-mse"]),
    ];
    for bits in ["4", "3"] {
        for (name, args) in variants {
            let out = tmp.path().join(format!("{name}{bits}"));
            // 3-bit MiniCPM-SALA is for evaluation only: SGLang's 3-bit kernels are float16-only.
            let engine = if bits == "3" { "none" } else { "sglang" };
            runs.push((out, [&["--bits", bits, "--engine", engine], args].concat()));
        }
    }
    runs.push((tmp.path().join("gptaq4"), vec!["--method", "gptaq"]));
    // Two quantizations at a time (each process runs one candle thread: common::bin).
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((out, args)) = runs.get(i) else {
                    break;
                };
                quantize(out, args);
            });
        }
    });
    let dirs: Vec<PathBuf> = runs.into_iter().map(|(d, _)| d).collect();
    let r = compare(&dirs);
    let rtn4 = r[1];
    eprintln!("4 bits: GPTAQ/RTN mean KL {:.3}", r[6].1 / rtn4.1);
    assert!(
        r[6].1 <= 0.75 * rtn4.1,
        "4-bit GPTAQ's mean KL {:.5} is more than 75% of RTN's {:.5}",
        r[6].1,
        rtn4.1
    );
    for (i, (bits, bound)) in [(4, 0.75), (3, 0.65)].into_iter().enumerate() {
        let (gptq, rtn, vanilla) = (r[3 * i], r[3 * i + 1], r[3 * i + 2]);
        eprintln!(
            "{bits} bits: vanilla GPTQ/RTN mean KL {:.3}",
            vanilla.1 / rtn.1
        );
        assert!(
            vanilla.1 <= 0.85 * rtn.1,
            "{bits}-bit vanilla GPTQ's mean KL {:.5} is more than 85% of RTN's {:.5}",
            vanilla.1,
            rtn.1
        );
        eprintln!(
            "{bits} bits: GPTQ/RTN perplexity increase {:.3}, mean KL {:.3}",
            gptq.0 / rtn.0,
            gptq.1 / rtn.1
        );
        // The gate is meaningful only if RTN visibly hurts.
        assert!(
            rtn.0 > 0.0,
            "{bits}-bit RTN did not raise perplexity: {rtn:?}"
        );
        assert!(
            gptq.0 < rtn.0,
            "{bits}-bit GPTQ raised perplexity by {:.4}, not less than RTN's {:.4}",
            gptq.0,
            rtn.0
        );
        assert!(
            gptq.1 <= bound * rtn.1,
            "{bits}-bit default quantization's mean KL {:.5} is more than {bound} of RTN's {:.5}",
            gptq.1,
            rtn.1
        );
    }
}
