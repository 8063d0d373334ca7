//! Inputs are never destroyed: every spelling of an output that aliases an input (the same
//! folder, a parent, a child, a symlink, `.`/`..`) is refused before anything is written or
//! deleted; `--force` replaces model folders only, and only once the new output is complete; a
//! second run on one `--out` is refused while the first holds it; resumable work is not
//! discarded without `--force`.

use crate::common::*;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

/// Every file under `dir` (relative path → SHA-256), to prove a folder was left untouched.
fn tree(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(
                    rel,
                    soar_gptq::checkpoint::manifest::sha256_file(&p).unwrap(),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// `soar-gptq quantize` (RTN, tiny calibration) run in `cwd`.
fn quantize_in(cwd: &Path, model: &str, out: &str, extra: &[&str]) -> Output {
    let mut args = vec!["quantize", "--model", model, "--out", out];
    for (flag, value) in [
        ("--method", "rtn"),
        ("--nsamples", "2"),
        ("--seqlen", "64"),
        ("--device", "cpu"),
    ] {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    bin().current_dir(cwd).args(&args).output().unwrap()
}

#[test]
fn quantize_refuses_every_output_that_aliases_its_model() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let models = root.join("models");
    std::fs::create_dir(&models).unwrap();
    let m = synth_tiny(&models, "m", 1);
    let link = root.join("link-to-m");
    std::os::unix::fs::symlink(&m, &link).unwrap();
    let before = tree(root);
    let ms = m.to_str().unwrap();
    let cases: Vec<(PathBuf, &str, String, &str)> = vec![
        // (cwd, --model, --out, what the message says)
        (root.into(), ms, ms.to_string(), "is the input"),
        (root.into(), ms, format!("{ms}/"), "is the input"),
        (root.into(), ms, format!("{ms}/../m"), "is the input"),
        (root.into(), "models/m", "models/m".into(), "is the input"),
        (
            root.into(),
            "models/m",
            "./models/../models/m".into(),
            "is the input",
        ),
        (
            root.into(),
            link.to_str().unwrap(),
            ms.into(),
            "is the input",
        ),
        (
            root.into(),
            ms,
            link.to_str().unwrap().into(),
            "is the input",
        ),
        (
            root.into(),
            ms,
            models.to_str().unwrap().into(),
            "contains the input",
        ),
        (root.into(), ms, format!("{ms}/gptq"), "is inside the input"),
        (models.clone(), "m", ".".into(), "current or parent"),
        (m.clone(), ".", "..".into(), "current or parent"),
        (
            m.clone(),
            ".",
            root.to_str().unwrap().into(),
            "folder above it",
        ),
    ];
    for (cwd, model, out, needle) in &cases {
        let o = quantize_in(cwd, model, out, &["--force"]);
        assert_fails(&o, 1, needle);
        assert_eq!(
            tree(root),
            before,
            "--model {model} --out {out} changed files"
        );
    }
    // `.partial` of an output next to the model may not be the model either.
    let o = quantize_in(root, &format!("{ms}.partial"), ms, &["--force"]);
    assert!(o.status.code() == Some(1), "{}", stderr(&o));
    assert_eq!(tree(root), before);

    // --save-hessians is an output too: never into the model, never over files without --force.
    let out = root.join("q");
    let o = quantize_in(
        root,
        ms,
        out.to_str().unwrap(),
        &["--method", "gptq", "--save-hessians", &format!("{ms}/h")],
    );
    assert_fails(&o, 1, "--save-hessians");
    assert!(!out.exists());
    let used = root.join("used");
    std::fs::create_dir(&used).unwrap();
    std::fs::write(used.join("notes.txt"), "keep me").unwrap();
    let o = quantize_in(
        root,
        ms,
        out.to_str().unwrap(),
        &[
            "--method",
            "gptq",
            "--save-hessians",
            used.to_str().unwrap(),
        ],
    );
    assert_fails(&o, 1, "already holds files");
    assert_eq!(
        std::fs::read_to_string(used.join("notes.txt")).unwrap(),
        "keep me"
    );
    assert!(!out.exists());
    // A calibration folder is an input as well.
    let calib = root.join("calib");
    std::fs::create_dir(&calib).unwrap();
    write_text(&calib, "a.txt", &sample_text());
    let o = quantize_in(
        root,
        ms,
        calib.join("q").to_str().unwrap(),
        &["--calib", calib.to_str().unwrap()],
    );
    assert_fails(&o, 1, "is inside the input --calib");
}

#[test]
fn force_replaces_model_folders_only_and_only_when_the_new_one_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 2);
    let ms = m.to_str().unwrap();
    // A folder of other files is never deleted, --force or not.
    let docs = root.join("docs");
    std::fs::create_dir(&docs).unwrap();
    std::fs::write(docs.join("thesis.tex"), "years of work").unwrap();
    let o = quantize_in(root, ms, docs.to_str().unwrap(), &["--force"]);
    assert_fails(&o, 1, "does not look like a model folder");
    assert_eq!(tree(&docs).len(), 1);
    // A file is not a folder.
    let file = root.join("file");
    std::fs::write(&file, "x").unwrap();
    assert_fails(
        &quantize_in(root, ms, file.to_str().unwrap(), &["--force"]),
        1,
        "is not a folder",
    );
    // An old output survives a --force run that fails midway (after writing layers), and is
    // replaced by one that succeeds.
    let out = root.join("q");
    assert_ok(&quantize_in(root, ms, out.to_str().unwrap(), &[]));
    let old = tree(&out);
    let o = quantize_in(
        root,
        ms,
        out.to_str().unwrap(),
        &["--force", "--stop-after-layers", "1"],
    );
    assert_fails(&o, 1, "stopped after 1 layer");
    assert!(root.join("q.partial").is_dir());
    assert_eq!(
        tree(&out),
        old,
        "a failed --force run touched the old output"
    );
    assert_ok(&quantize_in(
        root,
        ms,
        out.to_str().unwrap(),
        &["--force", "--bits", "8"],
    ));
    assert_ne!(tree(&out), old);
    for leftover in ["q.partial", "q.replaced", "q.lock"] {
        assert!(!root.join(leftover).exists(), "{leftover} left behind");
    }
}

#[test]
fn a_second_run_on_one_output_is_refused_while_the_first_holds_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 3);
    let out = root.join("q");
    // Hold the lock as a running quantize would.
    let lock = soar_gptq::checkpoint::guard::OutputLock::acquire("--out", &out).unwrap();
    let o = quantize_in(root, m.to_str().unwrap(), out.to_str().unwrap(), &[]);
    assert_fails(&o, 1, &format!("pid {}", std::process::id()));
    assert!(!out.exists());
    drop(lock);
    assert_ok(&quantize_in(
        root,
        m.to_str().unwrap(),
        out.to_str().unwrap(),
        &[],
    ));
}

#[test]
fn resumable_work_is_not_discarded_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 4);
    let out = root.join("q");
    let (ms, os) = (m.to_str().unwrap(), out.to_str().unwrap());
    let o = quantize_in(root, ms, os, &["--stop-after-layers", "2"]);
    assert_fails(&o, 1, "--resume");
    let partial = root.join("q.partial");
    let kept = tree(&partial);
    assert_fails(&quantize_in(root, ms, os, &[]), 1, "--resume to continue");
    assert_eq!(tree(&partial), kept);
    // --force discards it and starts over.
    assert_ok(&quantize_in(root, ms, os, &["--force"]));
    assert!(!partial.exists());
}

#[test]
fn pack_marlin_and_synth_refuse_outputs_that_alias_their_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let models = root.join("models");
    std::fs::create_dir(&models).unwrap();
    let m = synth_tiny(&models, "m", 5);
    let q = models.join("q");
    assert_ok(&quantize_in(
        root,
        m.to_str().unwrap(),
        q.to_str().unwrap(),
        &[],
    ));
    let before = tree(root);
    for out in [
        q.clone(),
        models.clone(),
        q.join("marlin"),
        root.to_path_buf(),
    ] {
        let o = run(&[
            "pack-marlin",
            "--in",
            q.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--force",
        ]);
        assert_fails(&o, 1, "the input --in");
        assert_eq!(tree(root), before, "pack-marlin --out {}", out.display());
    }
    // synth --config / --tokenizer are inputs.
    let cfg_dir = root.join("cfg");
    std::fs::create_dir(&cfg_dir).unwrap();
    let cfg = cfg_dir.join("config.json");
    std::fs::copy(m.join("config.json"), &cfg).unwrap();
    let o = run(&[
        "synth",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        cfg_dir.to_str().unwrap(),
        "--force",
    ]);
    assert_fails(&o, 1, "the input --config");
    assert!(cfg.is_file());
}

#[test]
fn hessian_files_never_write_through_a_name_already_in_their_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 6);
    let calib = write_text(root, "calib.txt", &sample_text());
    let text = std::fs::read_to_string(&calib).unwrap();
    // A --save-hessians folder (written into with --force) that holds, under the names a
    // temporary Hessian file once had, a link to an input and a FIFO.
    let h = root.join("h");
    std::fs::create_dir(&h).unwrap();
    std::os::unix::fs::symlink(&calib, h.join("layer-00000.qkv.safetensors.tmp")).unwrap();
    let fifo =
        std::ffi::CString::new(h.join("layer-00000.o.safetensors.tmp").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let out = root.join("q");
    let o = quantize_in(
        root,
        m.to_str().unwrap(),
        out.to_str().unwrap(),
        &[
            "--method",
            "gptq",
            "--calib",
            calib.to_str().unwrap(),
            "--save-hessians",
            h.to_str().unwrap(),
            "--force",
        ],
    );
    assert_ok(&o);
    assert_eq!(
        std::fs::read_to_string(&calib).unwrap(),
        text,
        "input overwritten"
    );
    assert!(h.join("layer-00000.qkv.safetensors").is_file());
    // No temporary file of this run is left.
    let left: Vec<String> = std::fs::read_dir(&h)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // A file where the folder should be is refused before any work, naming it.
    let file = write_text(root, "h-file", "notes");
    let o = quantize_in(
        root,
        m.to_str().unwrap(),
        root.join("q2").to_str().unwrap(),
        &[
            "--method",
            "gptq",
            "--save-hessians",
            file.to_str().unwrap(),
            "--force",
        ],
    );
    assert_fails(&o, 1, "is a file, not a folder");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "notes");
    assert!(!root.join("q2").exists());
}

#[test]
fn skips_that_cover_whole_layers_write_resume_and_load() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 6);
    let ms = m.to_str().unwrap();
    // Layer 0 kept whole: its journal entry holds no tensors; a resume replays past it.
    let out = root.join("q0");
    let os = out.to_str().unwrap();
    let skip0 = ["--skip", r"layers\.0\."];
    let o = quantize_in(
        root,
        ms,
        os,
        &[skip0[0], skip0[1], "--stop-after-layers", "2"],
    );
    assert_fails(&o, 1, "--resume");
    assert_ok(&quantize_in(
        root,
        ms,
        os,
        &[skip0[0], skip0[1], "--resume"],
    ));
    let uninterrupted = root.join("q0b");
    assert_ok(&quantize_in(
        root,
        ms,
        uninterrupted.to_str().unwrap(),
        &skip0,
    ));
    assert_eq!(
        std::fs::read(out.join("manifest.json")).unwrap(),
        std::fs::read(uninterrupted.join("manifest.json")).unwrap()
    );
    assert_ok(&run(&["inspect", os, "--engine", "sglang"]));
    // Everything kept (".*", and the empty pattern that matches every name).
    for (name, pattern) in [("all", ".*"), ("empty", "")] {
        let out = root.join(name);
        assert_ok(&quantize_in(
            root,
            ms,
            out.to_str().unwrap(),
            &["--skip", pattern],
        ));
        assert_ok(&run(&[
            "inspect",
            out.to_str().unwrap(),
            "--engine",
            "sglang",
        ]));
        let ck = soar_gptq::checkpoint::Checkpoint::open(&out).unwrap();
        assert!(!ck.names().any(|n| n.ends_with(".qweight")));
    }
}

#[test]
fn a_damaged_journal_is_refused_not_indexed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 7);
    let out = root.join("q");
    let (ms, os) = (m.to_str().unwrap(), out.to_str().unwrap());
    assert_fails(
        &quantize_in(root, ms, os, &["--stop-after-layers", "2"]),
        1,
        "--resume",
    );
    let jpath = root.join("q.partial").join("journal").join("journal.json");
    let good = std::fs::read_to_string(&jpath).unwrap();
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut j: serde_json::Value = serde_json::from_str(&good).unwrap();
        f(&mut j);
        std::fs::write(&jpath, serde_json::to_string(&j).unwrap()).unwrap();
    };
    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let cases: [(Edit, &str); 4] = [
        (
            &|j| j["layers"][1]["index"] = serde_json::json!(1_000_000_000_000_000_000u64),
            "journal is damaged",
        ),
        (
            &|j| j["layers"][0]["file"] = serde_json::json!("../../../etc/passwd"),
            "journal is damaged",
        ),
        (
            &|j| {
                let l = j["layers"][0].clone();
                let v = j["layers"].as_array_mut().unwrap();
                for _ in 0..10 {
                    v.push(l.clone());
                }
            },
            "the model has 4",
        ),
        (
            &|j| j["layers"][1]["index"] = serde_json::json!(1e18),
            "not a valid journal",
        ),
    ];
    for (f, needle) in cases {
        edit(f);
        let o = quantize_in(root, ms, os, &["--resume"]);
        assert_fails(&o, 1, needle);
        assert!(jpath.is_file(), "the refused resume removed the journal");
    }
    std::fs::write(&jpath, &good).unwrap();
    assert_ok(&quantize_in(root, ms, os, &["--resume"]));
}

/// Sends `sig` to the child once `ready` holds (polled), and returns its output.
fn signal_when(
    mut child: std::process::Child,
    sig: &str,
    ready: impl Fn() -> bool,
) -> std::process::Output {
    let t0 = std::time::Instant::now();
    while !ready() {
        assert!(
            t0.elapsed().as_secs() < 120,
            "the run never reached the point to signal"
        );
        if child.try_wait().unwrap().is_some() {
            panic!("the run ended before it could be signalled");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let ok = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    child.stdout.take();
    child.wait_with_output().unwrap()
}

#[test]
fn ctrl_c_and_sigterm_end_cleanly_and_say_what_was_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 8);
    let out = root.join("q");
    let partial = root.join("q.partial");
    let args = [
        "quantize",
        "--model",
        m.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--nsamples",
        "2",
        "--seqlen",
        "64",
        "--device",
        "cpu",
    ];
    let spawn = || {
        bin()
            .args(args)
            .env("SOAR_GPTQ_TEST_LAYER_DELAY_MS", "1500")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // SIGTERM before any layer is recorded: nothing is left, exit 143.
    let o = signal_when(spawn(), "-TERM", || {
        partial.join("journal").join("layer-00000").is_dir()
    });
    assert_eq!(o.status.code(), Some(143), "{}", stderr(&o));
    assert!(stderr(&o).contains("interrupted (SIGTERM): nothing was written"));
    assert!(!partial.exists() && !out.exists() && !root.join("q.lock").exists());
    // Ctrl-C after a finished layer: the layer is kept for --resume, exit 130.
    let journal = partial.join("journal").join("journal.json");
    let o = signal_when(spawn(), "-INT", || journal.is_file());
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("finished layer(s) are kept in") && stderr(&o).contains("--resume"),
        "{}",
        stderr(&o)
    );
    assert!(journal.is_file() && !out.exists() && !root.join("q.lock").exists());
    let mut resume = args.to_vec();
    resume.push("--resume");
    assert_ok(&run(&resume));
    let full = root.join("full");
    let mut again = args.to_vec();
    again[4] = full.to_str().unwrap();
    assert_ok(&run(&again));
    assert_eq!(
        std::fs::read(out.join("manifest.json")).unwrap(),
        std::fs::read(full.join("manifest.json")).unwrap()
    );
}

#[test]
fn a_corrupted_cache_blob_is_caught_before_the_first_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 9);
    // The hub cache layout: snapshot files are symlinks to blobs named by their SHA-256.
    let cache = root.join("hub");
    let repo = cache.join("models--org--tiny");
    let sha = "0123456789abcdef0123456789abcdef01234567";
    let snap = repo.join("snapshots").join(sha);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), sha).unwrap();
    let mut shard_blob = None;
    for e in std::fs::read_dir(&m).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let h = soar_gptq::checkpoint::manifest::sha256_file(&p).unwrap();
        std::fs::copy(&p, repo.join("blobs").join(&h)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{h}"), snap.join(&name)).unwrap();
        if name.ends_with(".safetensors") {
            shard_blob = Some(repo.join("blobs").join(&h));
        }
    }
    let q = |out: &Path| {
        bin()
            .args(["quantize", "--model", "org/tiny", "--out"])
            .arg(out)
            .args(["--nsamples", "2", "--seqlen", "64", "--method", "rtn"])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    assert_ok(&q(&root.join("ok")));
    // One flipped byte in the tensor data of a shard (the header still parses).
    let blob = shard_blob.unwrap();
    let mut b = std::fs::read(&blob).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0x40;
    std::fs::write(&blob, b).unwrap();
    let out = root.join("bad");
    let o = q(&out);
    assert_fails(&o, 1, "is corrupted or incomplete");
    assert!(stderr(&o).contains("delete"), "{}", stderr(&o));
    assert!(!out.exists() && !root.join("bad.partial").exists());
}

/// Kills a run (abort, as `kill -9` would) at every fault point in turn, then runs it again
/// as a user would: with `--resume` where the message says so, else the same command. The
/// output must equal an uninterrupted run's, byte for byte, and no leftovers may remain.
#[test]
#[ignore = "slow: the kill-point sweep (a quantize and its recovery per fault point)"]
fn a_run_killed_at_any_point_resumes_or_restarts_to_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 10);
    let base = |out: &Path| -> Vec<String> {
        [
            "quantize",
            "--model",
            m.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--nsamples",
            "2",
            "--seqlen",
            "64",
            "--device",
            "cpu",
            // The sweep is about the writes: the MSE scale search (most of a CPU run's time on
            // this model) changes none of them.
            "--no-mse",
            "--force",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let reference = root.join("reference");
    assert_ok(&bin().args(base(&reference)).output().unwrap());
    let want = std::fs::read(reference.join("manifest.json")).unwrap();
    let out = root.join("q");
    // An old output that a --force run replaces: it must survive every crash until the new one
    // is in place. A copy of it is put back before each point.
    let saved = root.join("old");
    assert_ok(
        &bin()
            .args(base(&saved))
            .args(["--method", "rtn"])
            .output()
            .unwrap(),
    );
    let old = std::fs::read(saved.join("manifest.json")).unwrap();
    let put_back_old = || {
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir(&out).unwrap();
        for e in std::fs::read_dir(&saved).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, out.join(p.file_name().unwrap())).unwrap();
        }
    };
    put_back_old();
    let mut points = 0;
    for n in 1.. {
        let o = bin()
            .args(base(&out))
            .env("SOAR_GPTQ_FAULT_AT", n.to_string())
            .output()
            .unwrap();
        if o.status.success() {
            // Past the last fault point: the sweep is complete.
            break;
        }
        assert_eq!(
            o.status.code(),
            None,
            "point {n}: not an abort: {}",
            stderr(&o)
        );
        points += 1;
        // Until the new output is in place, the old one is intact (or set aside, and put back
        // by the next run).
        if out.join("manifest.json").is_file() {
            let now = std::fs::read(out.join("manifest.json")).unwrap();
            assert!(
                now == old || now == want,
                "point {n}: --out holds neither output"
            );
        }
        let mut again = base(&out);
        if root.join("q.partial/journal/journal.json").is_file() {
            again.push("--resume".into());
        }
        let o = bin().args(&again).output().unwrap();
        assert_ok(&o);
        assert_eq!(
            std::fs::read(out.join("manifest.json")).unwrap(),
            want,
            "point {n}: the recovered output differs from an uninterrupted run"
        );
        for leftover in ["q.partial", "q.replaced", "q.lock", "q/journal"] {
            assert!(
                !root.join(leftover).exists(),
                "point {n}: {leftover} left behind"
            );
        }
        put_back_old();
    }
    assert!(points > 20, "only {points} fault points were reached");
}

/// A disk that fills up during the journal, the shards or the final files: one clear error
/// naming the file, nothing at --out, finished layers kept for --resume, and the resumed output
/// equal to an uninterrupted run's.
#[test]
#[ignore = "slow: the full-disk sweep (a quantize and its resume per write point)"]
fn a_full_disk_mid_run_is_one_clear_error_and_resumable() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 11);
    let args = |out: &Path| -> Vec<String> {
        [
            "quantize",
            "--model",
            m.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--nsamples",
            "2",
            "--seqlen",
            "64",
            "--device",
            "cpu",
            // As in the kill-point sweep: the writes do not depend on the MSE scale search.
            "--no-mse",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let reference = root.join("reference");
    assert_ok(&bin().args(args(&reference)).output().unwrap());
    let want = std::fs::read(reference.join("manifest.json")).unwrap();
    let mut failures = 0;
    for n in [1, 2, 4, 6, 9, 12, 15, 18, 22, 26, 30, 34, 40, 60] {
        let out = root.join(format!("q{n}"));
        let o = bin()
            .args(args(&out))
            .env("SOAR_GPTQ_FAULT_AT", n.to_string())
            .env("SOAR_GPTQ_FAULT_KIND", "enospc")
            .output()
            .unwrap();
        if o.status.success() {
            continue;
        }
        failures += 1;
        assert_fails(&o, 1, "No space left on device");
        assert!(
            stderr(&o).contains("disk full?"),
            "write point {n}: {}",
            stderr(&o)
        );
        assert!(
            !out.exists(),
            "write point {n}: something was left at --out"
        );
        let partial = root.join(format!("q{n}.partial"));
        let mut again = args(&out);
        if partial.join("journal/journal.json").is_file() {
            assert!(stderr(&o).contains("--resume"), "{}", stderr(&o));
            again.push("--resume".into());
        }
        assert_ok(&bin().args(&again).output().unwrap());
        assert_eq!(
            std::fs::read(out.join("manifest.json")).unwrap(),
            want,
            "write point {n}"
        );
    }
    assert!(failures >= 8, "only {failures} write points failed");
}

#[test]
fn ctrl_c_during_eval_ppl_and_pack_marlin_exits_130() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = synth_tiny(root, "m", 12);
    // eval-ppl over every window of the evaluation text: long enough to be interrupted.
    let child = bin()
        .args([
            "eval-ppl",
            "--model",
            m.to_str().unwrap(),
            "--seqlen",
            "64",
            "--batch",
            "1",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    let o = signal_when(child, "-INT", || t0.elapsed().as_millis() > 800);
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(stderr(&o).contains("interrupted (SIGINT): nothing was written"));
    // pack-marlin: its partial folder and lock go with it.
    let q = root.join("q");
    assert_ok(&quantize_in(
        root,
        m.to_str().unwrap(),
        q.to_str().unwrap(),
        &[],
    ));
    let out = root.join("marlin");
    let partial = root.join("marlin.partial");
    let child = bin()
        .args([
            "pack-marlin",
            "--in",
            q.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .env("SOAR_GPTQ_TEST_PACK_DELAY_MS", "3000")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let o = signal_when(child, "-TERM", || partial.is_dir());
    assert_eq!(o.status.code(), Some(143), "{}", stderr(&o));
    assert!(!partial.exists() && !out.exists() && !root.join("marlin.lock").exists());
}
