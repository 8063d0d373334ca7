//! synth, inspect and eval-ppl run as a user runs them, and their bad inputs failing cleanly:
//! usage errors, existing outputs, damaged or inconsistent checkpoints and configs, inputs eval-ppl
//! cannot score, and hub repo ids resolved from an offline cache.

use crate::common::*;

#[test]
fn synth_inspect_eval_ppl_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synth_tiny(tmp.path(), "m", 0);
    assert!(shard_files(&m).len() > 1);
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
        "manifest.json",
    ] {
        assert!(m.join(f).is_file(), "{f}");
    }
    let o = run(&["inspect", m.to_str().unwrap()]);
    assert_ok(&o);
    assert!(stdout(&o).contains("MiniCPMSALAForCausalLM"));
    let o = run(&["inspect", m.to_str().unwrap(), "--json"]);
    assert_ok(&o);
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let cfg = soar_gptq::model::config::preset("tiny").unwrap();
    assert_eq!(j["parameters"].as_u64().unwrap(), cfg.param_count());
    assert_eq!(j["sparse_layers"], serde_json::json!([0, 3]));
    assert_eq!(
        j["dtypes"]["BF16"].as_u64().unwrap() as usize,
        cfg.expected_tensors().len()
    );

    let data = write_text(tmp.path(), "eval.txt", &sample_text());
    let o = run(&[
        "eval-ppl",
        "--model",
        m.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--seqlen",
        "96",
        "--max-windows",
        "3",
        "--json",
    ]);
    assert_ok(&o);
    let r: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(r["windows"], 3);
    assert_eq!(r["seqlen"], 96);
    assert_eq!(r["tokens"], 3 * 95);
    let (ppl, nll) = (r["ppl"].as_f64().unwrap(), r["nll"].as_f64().unwrap());
    assert!((ppl - nll.exp()).abs() < 1e-6 * ppl);
    // A random model predicts roughly uniformly over its vocabulary.
    assert!(ppl > 500.0 && ppl < 50_000.0, "ppl {ppl}");

    // --bos: BOS + 95 text tokens per window, all 95 text tokens scored.
    let o = run(&[
        "eval-ppl",
        "--model",
        m.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--seqlen",
        "96",
        "--max-windows",
        "2",
        "--bos",
        "--json",
    ]);
    assert_ok(&o);
    let r: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(r["tokens"], 2 * 95);
}

#[test]
fn synth_is_deterministic_per_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let a = synth_tiny(tmp.path(), "a", 5);
    let b = synth_tiny(tmp.path(), "b", 5);
    let c = synth_tiny(tmp.path(), "c", 6);
    let read = |p: &std::path::Path| std::fs::read_to_string(p.join("manifest.json")).unwrap();
    assert_eq!(read(&a), read(&b));
    assert_ne!(read(&a), read(&c));
}

#[test]
fn existing_output_is_refused_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synth_tiny(tmp.path(), "m", 0);
    let o = run(&["synth", "--preset", "tiny", "--out", m.to_str().unwrap()]);
    assert_fails(&o, 1, "--force");
    let o = run(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        m.to_str().unwrap(),
        "--force",
        "--seed",
        "9",
    ]);
    assert_ok(&o);
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(run(&["synth", "--out", "x"]).status.code(), Some(2));
    assert_eq!(run(&["eval-ppl"]).status.code(), Some(2));
    assert_eq!(run(&["no-such-command"]).status.code(), Some(2));
    assert_eq!(run(&["--help"]).status.code(), Some(0));
    // Bad option values of every command are usage errors too, found before anything is read
    // (the model below does not exist: a usage error wins).
    let m = ["--model", "no/such-model"];
    for args in [
        &["eval-ppl", m[0], m[1], "--seqlen", "0"][..],
        &["eval-ppl", m[0], m[1], "--batch", "0"],
        &["eval-ppl", m[0], m[1], "--max-windows", "0"],
        &["eval-ppl", m[0], m[1], "--device", "gpu"],
        &["quantize", m[0], m[1], "--out", "o", "--device", "cuda:x"],
        &["quantize", m[0], m[1], "--out", "o", "--shard-size", "0"],
        &["quantize", m[0], m[1], "--out", "o", "--engine", "tgi"],
        &[
            "synth",
            "--preset",
            "tiny",
            "--out",
            "o",
            "--shard-size",
            "0",
        ],
        &[
            "import-gguf",
            "--gguf",
            "x.gguf",
            "--out",
            "o",
            "--shard-size",
            "-1",
        ],
        &["inspect", ".", "--engine", "sglang-old"],
        &["inspect", ".", "--legacy-marlin"],
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn bad_checkpoints_fail_cleanly_naming_the_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let base = synth_tiny(tmp.path(), "base", 1);
    let fresh = |name: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir(&d).unwrap();
        for e in std::fs::read_dir(&base).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap() != "manifest.json" {
                std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
            }
        }
        d
    };
    let inspect = |d: &std::path::Path| run(&["inspect", d.to_str().unwrap()]);

    // Truncated shard.
    let d = fresh("truncated");
    let shard = shard_files(&d).pop().unwrap();
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    let o = inspect(&d);
    assert_fails(&o, 1, "truncated");
    assert!(stderr(&o).contains(shard.file_name().unwrap().to_str().unwrap()));

    // Corrupt header length.
    let d = fresh("corrupt");
    let shard = shard_files(&d)[0].clone();
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
    assert_fails(&inspect(&d), 1, "corrupt safetensors file");

    // Corrupt header JSON.
    let d = fresh("badjson");
    let shard = shard_files(&d)[0].clone();
    edit_header(&shard, |h| h.replacen('{', "[", 1));
    assert_fails(&inspect(&d), 1, "not a JSON object");

    // Unsupported dtype.
    let d = fresh("dtype");
    let shard = shard_files(&d)[0].clone();
    edit_header(&shard, |h| h.replacen("\"BF16\"", "\"F64\" ", 1));
    assert_fails(&inspect(&d), 1, "unsupported dtype F64");

    // Missing tensor (renamed in shard and index).
    let d = fresh("missing");
    for shard in shard_files(&d) {
        edit_header(&shard, |h| {
            h.replace("model.norm.weight", "model.norm.weighx")
        });
    }
    let idx = d.join("model.safetensors.index.json");
    let t = std::fs::read_to_string(&idx)
        .unwrap()
        .replace("model.norm.weight", "model.norm.weighx");
    std::fs::write(&idx, t).unwrap();
    assert_fails(&inspect(&d), 1, "tensor model.norm.weight is missing");

    // Index that points at the wrong shard.
    let d = fresh("index");
    let idx = d.join("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    let files: Vec<String> = shard_files(&d)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    v["weight_map"]["lm_head.weight"] = serde_json::json!(files[0]);
    std::fs::write(&idx, v.to_string()).unwrap();
    assert_fails(&inspect(&d), 1, "lm_head.weight");

    // Config that does not match the weights: wrong shape.
    let d = fresh("shape");
    let cfgp = d.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfgp).unwrap()).unwrap();
    c["intermediate_size"] = 1024.into();
    std::fs::write(&cfgp, c.to_string()).unwrap();
    let o = inspect(&d);
    assert_fails(
        &o,
        1,
        "has shape [768, 256], but config.json implies [1024, 256]",
    );

    // Unexpected tensor: the config says there is no o_norm.
    let d = fresh("unexpected");
    let cfgp = d.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfgp).unwrap()).unwrap();
    c["use_output_norm"] = false.into();
    std::fs::write(&cfgp, c.to_string()).unwrap();
    assert_fails(
        &inspect(&d),
        1,
        "unexpected tensor model.layers.1.self_attn.o_norm.weight",
    );

    // Inconsistent config.
    let d = fresh("config");
    let cfgp = d.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfgp).unwrap()).unwrap();
    c["num_hidden_layers"] = 3.into();
    std::fs::write(&cfgp, c.to_string()).unwrap();
    assert_fails(
        &inspect(&d),
        1,
        "mixer_types has 4 entries but num_hidden_layers is 3",
    );

    // Not a checkpoint folder at all.
    let d = tmp.path().join("empty");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(
        d.join("config.json"),
        std::fs::read(base.join("config.json")).unwrap(),
    )
    .unwrap();
    assert_fails(
        &inspect(&d),
        1,
        "neither model.safetensors.index.json nor model.safetensors",
    );

    // A modified file is caught by the manifest.
    let d = tmp.path().join("tampered");
    std::fs::create_dir(&d).unwrap();
    for e in std::fs::read_dir(&base).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
    }
    let gen = d.join("generation_config.json");
    std::fs::write(&gen, "{}").unwrap();
    assert_fails(
        &inspect(&d),
        1,
        "generation_config.json: SHA-256 or size differs",
    );
}

#[test]
fn eval_ppl_refuses_what_it_cannot_compute() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synth_tiny(tmp.path(), "m", 2);
    let ms = m.to_str().unwrap();
    let data = write_text(tmp.path(), "eval.txt", &sample_text());
    let ds = data.to_str().unwrap();
    assert_fails(
        &run(&["eval-ppl", "--model", ms, "--data", ds, "--seqlen", "8193"]),
        1,
        "above max_position_embeddings = 8192",
    );
    let short = write_text(tmp.path(), "short.txt", "just a few words");
    assert_fails(
        &run(&[
            "eval-ppl",
            "--model",
            ms,
            "--data",
            short.to_str().unwrap(),
            "--seqlen",
            "64",
        ]),
        1,
        "fewer than one window",
    );
    assert_fails(
        &run(&["eval-ppl", "--model", ms, "--data", "/nonexistent.txt"]),
        1,
        "cannot read --data /nonexistent.txt",
    );
    assert_fails(
        &run(&["eval-ppl", "--model", "/no/such/dir", "--data", ds]),
        1,
        "not a hub repo id",
    );
    if !cfg!(feature = "cuda") {
        assert_fails(
            &run(&["eval-ppl", "--model", ms, "--data", ds, "--device", "cuda"]),
            1,
            "built without CUDA",
        );
    }
    // A device that is no device name is a usage error (exit 2).
    assert_fails(
        &run(&["eval-ppl", "--model", ms, "--data", ds, "--device", "tpu"]),
        2,
        "use auto, cpu, cuda or cuda:N",
    );
}

/// The hub path, offline, from a cache laid out exactly as huggingface_hub lays it out.
#[test]
fn hub_repo_ids_resolve_from_an_offline_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let m = synth_tiny(tmp.path(), "m", 4);
    let cache = tmp.path().join("hf").join("hub");
    let sha = "0123456789abcdef0123456789abcdef01234567";
    let repo = cache.join("models--openbmb--Tiny-SALA");
    let snap = repo.join("snapshots").join(sha);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), sha).unwrap();
    for e in std::fs::read_dir(&m).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, snap.join(p.file_name().unwrap())).unwrap();
    }
    let data = write_text(tmp.path(), "eval.txt", &sample_text());
    let args = [
        "eval-ppl",
        "--model",
        "openbmb/Tiny-SALA",
        "--data",
        data.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "1",
        "--json",
    ];
    let local = run(&[
        "eval-ppl",
        "--model",
        m.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "1",
        "--json",
    ]);
    assert_ok(&local);

    // HF_HUB_CACHE, offline.
    let o = bin()
        .args(args)
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_ok(&o);
    assert_eq!(stdout(&o), stdout(&local));
    // HF_HOME (cache under $HF_HOME/hub), pinned to the commit.
    let mut pinned = args.to_vec();
    pinned.extend(["--revision", sha]);
    let o = bin()
        .args(&pinned)
        .env("HF_HOME", tmp.path().join("hf"))
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_ok(&o);
    // A repo or revision that is not cached is a clear error, without any network access.
    let o = bin()
        .args(["eval-ppl", "--model", "openbmb/Other", "--data", "x"])
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_fails(&o, 1, "openbmb/Other@main is not in the Hugging Face cache");
    let mut other_rev = args.to_vec();
    other_rev.extend(["--revision", "v2"]);
    let o = bin()
        .args(&other_rev)
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_fails(
        &o,
        1,
        "openbmb/Tiny-SALA@v2 is not in the Hugging Face cache",
    );
    // Revisions and refs that would lead outside the cache are refused.
    for rev in ["../../../x", "main/../../x", "/etc", "a//b", "."] {
        let mut bad = args.to_vec();
        bad.extend(["--revision", rev]);
        let o = bin()
            .args(&bad)
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert_fails(&o, 1, "is not a branch, tag or commit name");
    }
    std::fs::write(repo.join("refs").join("evil"), "../../../../m").unwrap();
    let mut evil = args.to_vec();
    evil.extend(["--revision", "evil"]);
    let o = bin()
        .args(&evil)
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_fails(&o, 1, "which is not a commit hash");
    // A quantize output inside (or around) the cache's copy of the repo is refused before the
    // model is read.
    for out in [snap.join("q"), repo.clone(), cache.clone()] {
        let o = bin()
            .args(["quantize", "--model", "openbmb/Tiny-SALA", "--out"])
            .arg(&out)
            .arg("--force")
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert_fails(&o, 1, "the input --model");
        assert!(snap.join("config.json").is_file());
    }
    // A shard missing from the cache.
    std::fs::remove_file(shard_files(&snap).pop().unwrap()).unwrap();
    let o = bin()
        .args(args)
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_fails(&o, 1, "only partly in the cache");
}

/// The shipped fixture is a trained model: valid, and far better than a uniform guess over its
/// 4,096-token vocabulary on held-out text.
#[test]
fn the_shipped_fixture_is_trained() {
    let m = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiny-sala");
    assert_ok(&run(&["inspect", m]));
    let o = run(&[
        "eval-ppl",
        "--model",
        m,
        "--seqlen",
        "256",
        "--max-windows",
        "8",
        "--json",
    ]);
    assert_ok(&o);
    let r: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let ppl = r["ppl"].as_f64().unwrap();
    assert!(ppl > 20.0 && ppl < 120.0, "fixture held-out ppl {ppl}");
}
