//! Inputs that used to pass silently or hang: non-finite weights and scales, a forward pass that
//! overflows, safetensors files with duplicate header keys or unindexed bytes, configs with a
//! key given twice, FIFOs where files are expected. Each fails with exit 1 and a message that
//! names the file and what is wrong.

use crate::common::*;

use std::path::Path;
use std::time::{Duration, Instant};

/// Byte offset of `tensor` in the safetensors file `path` (data section start + its offset).
fn tensor_offset(path: &Path, tensor: &str) -> usize {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    8 + n + h[tensor]["data_offsets"][0].as_u64().unwrap() as usize
}

/// Overwrites bytes of the shard that holds `tensor`, `at` bytes into the tensor.
fn poke(dir: &Path, tensor: &str, at: usize, value: &[u8]) {
    for shard in shard_files(dir) {
        let text = std::fs::read(&shard).unwrap();
        let n = u64::from_le_bytes(text[..8].try_into().unwrap()) as usize;
        let h: serde_json::Value = serde_json::from_slice(&text[8..8 + n]).unwrap();
        if h.get(tensor).is_some() {
            let off = tensor_offset(&shard, tensor) + at;
            let mut b = text;
            b[off..off + value.len()].copy_from_slice(value);
            std::fs::write(&shard, b).unwrap();
            return;
        }
    }
    panic!("{tensor} not found in {}", dir.display());
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
}

fn q(model: &Path, out: &Path) -> std::process::Output {
    run(&[
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--nsamples",
        "2",
        "--seqlen",
        "64",
        "--method",
        "rtn",
    ])
}

fn eval(model: &Path) -> std::process::Output {
    run(&[
        "eval-ppl",
        "--model",
        model.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "2",
    ])
}

#[test]
fn non_finite_weights_scales_and_logits_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let good = synth_tiny(tmp.path(), "good", 1);
    // A NaN weight (BF16 0x7fc0) in a Linear, and -Inf (0xff80) in lm_head.
    for (name, tensor, bits) in [
        ("nan", "model.layers.1.mlp.up_proj.weight", [0xc0u8, 0x7f]),
        ("inf", "lm_head.weight", [0x80, 0xff]),
    ] {
        let m = tmp.path().join(name);
        copy_dir(&good, &m);
        poke(&m, tensor, 2 * 37, &bits);
        let out = tmp.path().join(format!("{name}-q"));
        let o = q(&m, &out);
        assert_fails(&o, 1, &format!("tensor {tensor} in "));
        assert!(stderr(&o).contains("non-finite value"), "{}", stderr(&o));
        assert!(stderr(&o).contains("element 37"), "{}", stderr(&o));
        assert!(!out.exists());
        assert_fails(&eval(&m), 1, "non-finite value");
        assert_fails(
            &run(&["inspect", m.to_str().unwrap()]),
            1,
            "non-finite value",
        );
    }
    // A NaN scale in a GPTQ checkpoint (fp16 0x7e00): inspect and pack-marlin refuse it.
    let gq = tmp.path().join("gq");
    assert_ok(&q(&good, &gq));
    std::fs::remove_file(gq.join("manifest.json")).unwrap();
    poke(
        &gq,
        "model.layers.0.self_attn.o_proj.scales",
        0,
        &[0x00, 0x7e],
    );
    assert_fails(&run(&["inspect", gq.to_str().unwrap()]), 1, "o_proj.scales");
    let o = run(&[
        "pack-marlin",
        "--in",
        gq.to_str().unwrap(),
        "--out",
        tmp.path().join("m").to_str().unwrap(),
    ]);
    assert_fails(&o, 1, "non-finite value");
    assert!(!tmp.path().join("m").exists());
    // Finite weights whose forward overflows (an absurd scale_emb): no NaN perplexity.
    let big = tmp.path().join("big");
    copy_dir(&good, &big);
    let cfg = big.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["scale_emb"] = serde_json::json!(1e300);
    std::fs::write(&cfg, c.to_string()).unwrap();
    std::fs::remove_file(big.join("manifest.json")).ok();
    assert_fails(&eval(&big), 1, "non-finite logits");
}

#[test]
fn ambiguous_json_and_unindexed_bytes_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let good = synth_tiny(tmp.path(), "good", 2);
    // A key given twice in config.json.
    let m = tmp.path().join("dupcfg");
    copy_dir(&good, &m);
    let cfg = m.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text.replacen("{", "{\n  \"hidden_size\": 4096,", 1);
    std::fs::write(&cfg, text).unwrap();
    assert_fails(
        &run(&["inspect", m.to_str().unwrap()]),
        1,
        "key hidden_size appears twice",
    );
    // A layer count no model has is refused before anything is sized from it.
    let many: Vec<&str> = vec!["lightning-attn"; 1_200_000];
    for (key, v, needle) in [
        (
            "num_hidden_layers",
            serde_json::json!(10_000_000),
            "num_hidden_layers is 10000000",
        ),
        (
            "vocab_size",
            serde_json::json!(1u64 << 40),
            "beyond any released model",
        ),
        // A 20 MB config is no config.
        (
            "mixer_types",
            serde_json::json!(many),
            "a model config is a few kilobytes",
        ),
    ] {
        let m = tmp.path().join(format!("huge-{key}"));
        copy_dir(&good, &m);
        let cfg = m.join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        c[key] = v;
        std::fs::write(&cfg, c.to_string()).unwrap();
        assert_fails(&run(&["inspect", m.to_str().unwrap()]), 1, needle);
    }
    // Bytes after the last tensor that no tensor indexes.
    let m = tmp.path().join("gap");
    copy_dir(&good, &m);
    std::fs::remove_file(m.join("manifest.json")).ok();
    let shard = shard_files(&m).pop().unwrap();
    let mut b = std::fs::read(&shard).unwrap();
    b.extend_from_slice(&[0u8; 16]);
    std::fs::write(&shard, b).unwrap();
    assert_fails(
        &run(&["inspect", m.to_str().unwrap()]),
        1,
        "belong to no tensor",
    );
    // A __metadata__ key given twice in a safetensors header (same length, so offsets hold).
    let m = tmp.path().join("dupmeta");
    copy_dir(&good, &m);
    std::fs::remove_file(m.join("manifest.json")).ok();
    let shard = shard_files(&m).pop().unwrap();
    // The data offsets are relative to the data section, so a longer header keeps them valid.
    let b = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
    let mut new = header.trim_end().replacen(
        "\"__metadata__\":{\"format\":\"pt\"}",
        "\"__metadata__\":{\"format\":\"pt\",\"format\":\"np\"}",
        1,
    );
    assert_ne!(new, header.trim_end(), "{header}");
    while !new.len().is_multiple_of(8) {
        new.push(' ');
    }
    let mut out = (new.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(new.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(&shard, out).unwrap();
    let o = run(&["inspect", m.to_str().unwrap()]);
    assert_fails(&o, 1, "__metadata__.format twice");
}

/// Runs `args` and fails the test if the binary is still running after `limit`.
fn run_within(args: &[&str], limit: Duration) -> std::process::Output {
    let mut child = bin()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > limit {
            child.kill().unwrap();
            panic!("{args:?} hung (killed after {limit:?})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn fifos_where_files_are_expected_fail_instead_of_hanging() {
    let tmp = tempfile::tempdir().unwrap();
    let good = synth_tiny(tmp.path(), "good", 3);
    let fifo = tmp.path().join("fifo");
    let ok = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(ok.success());
    let limit = Duration::from_secs(60);
    let f = fifo.to_str().unwrap();
    let o = run_within(
        &["eval-ppl", "--model", good.to_str().unwrap(), "--data", f],
        limit,
    );
    assert_fails(&o, 1, "is not a regular file");
    let o = run_within(
        &[
            "import-gguf",
            "--gguf",
            f,
            "--out",
            tmp.path().join("g").to_str().unwrap(),
        ],
        limit,
    );
    assert_fails(&o, 1, "is not a regular file");
    let fifo_calib = tmp.path().join("calib.txt");
    std::process::Command::new("mkfifo")
        .arg(&fifo_calib)
        .status()
        .unwrap();
    let o = run_within(
        &[
            "quantize",
            "--model",
            good.to_str().unwrap(),
            "--out",
            tmp.path().join("q").to_str().unwrap(),
            "--calib",
            fifo_calib.to_str().unwrap(),
        ],
        limit,
    );
    assert_fails(&o, 1, "is not a regular file");
    // A shard that is a FIFO.
    let m = tmp.path().join("m");
    copy_dir(&good, &m);
    let shard = shard_files(&m).pop().unwrap();
    std::fs::remove_file(&shard).unwrap();
    std::process::Command::new("mkfifo")
        .arg(&shard)
        .status()
        .unwrap();
    let o = run_within(&["inspect", m.to_str().unwrap()], limit);
    assert_fails(&o, 1, "is not a regular file");
}

#[test]
fn a_closed_or_full_stdout_is_not_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let good = synth_tiny(tmp.path(), "good", 4);
    let out = tmp.path().join("q");
    let args = [
        "quantize",
        "--model",
        good.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--nsamples",
        "2",
        "--seqlen",
        "64",
        "--method",
        "rtn",
    ];
    // A full stdout: the checkpoint is complete, and the failure to print is a clear error.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let o = bin().args(args).stdout(full).output().unwrap();
    assert_fails(&o, 1, "cannot write to standard output");
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert!(out.join("manifest.json").is_file());
    // A reader that went away: no panic, success (the work is done).
    let mut child = bin()
        .args(["inspect", good.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}

#[test]
fn a_run_beyond_the_memory_it_has_is_refused_before_it_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let good = synth_tiny(tmp.path(), "good", 5);
    let out = tmp.path().join("q");
    let t0 = Instant::now();
    let o = run(&[
        "quantize",
        "--model",
        good.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--nsamples",
        "100000000",
        "--seqlen",
        "2048",
        "--device",
        "cpu",
    ]);
    assert_fails(&o, 1, "lower --nsamples (now 100000000)");
    assert!(stderr(&o).contains("GB free"), "{}", stderr(&o));
    assert!(!out.exists() && !tmp.path().join("q.partial").exists());
    assert!(t0.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_quantized_source_and_an_unreadable_tokenizer_config_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let good = synth_tiny(tmp.path(), "good", 6);
    let gq = tmp.path().join("gq");
    assert_ok(&q(&good, &gq));
    assert_fails(
        &q(&gq, &tmp.path().join("again")),
        1,
        "is already quantized",
    );
    let m = tmp.path().join("badutf8");
    copy_dir(&good, &m);
    std::fs::write(m.join("tokenizer_config.json"), [b'{', 0xff, 0xfe, b'}']).unwrap();
    let o = q(&m, &tmp.path().join("x"));
    assert_fails(&o, 1, "tokenizer_config.json");
    assert!(stderr(&o).contains("UTF-8"), "{}", stderr(&o));
}
