//! Helpers for tests that run the binary as a user would.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_soar-gptq"));
    for v in ["HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN"] {
        c.env_remove(v);
    }
    // Tests run two at a time: one candle CPU thread per process keeps two processes from
    // spinning against each other in candle's thread pool, which waits by spinning (1.6-1.8x
    // faster on two cores; docs/benchmarks.md, The test loop). An explicit setting wins.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        c.env("CANDLE_NUM_THREADS", "1");
    }
    // Tokenizing the default calibration text is most of a small quantize; the runs share the
    // tokenized text through the token cache (docs/calibration.md, Token cache), next to the
    // binary. An explicit setting wins (an empty one turns it off).
    if std::env::var_os("SOAR_GPTQ_TOKEN_CACHE").is_none() {
        c.env("SOAR_GPTQ_TOKEN_CACHE", test_cache("tokens"));
    }
    c
}

/// `<target>/test-cache/NAME`, next to the binary the tests run: what the tests keep between
/// runs (the token cache, the SmolLM2 download).
pub fn test_cache(name: &str) -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_soar-gptq"));
    let target = bin.parent().and_then(Path::parent).expect("target folder");
    target.join("test-cache").join(name)
}

pub fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("binary runs")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts a clean failure: exit code `code` and `needle` in stderr.
pub fn assert_fails(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "expected exit {code}, stderr: {err}"
    );
    assert!(err.contains(needle), "expected {needle:?} in stderr: {err}");
}

pub fn assert_ok(o: &Output) {
    assert!(
        o.status.success(),
        "command failed: {}\n{}",
        stderr(o),
        stdout(o)
    );
}

/// A tiny synthetic model (both mixer kinds) in `root/name`, sharded into several files.
pub fn synth_tiny(root: &Path, name: &str, seed: u64) -> PathBuf {
    let out = root.join(name);
    let o = run(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        out.to_str().unwrap(),
        "--seed",
        &seed.to_string(),
        "--shard-size",
        "4000000",
    ]);
    assert_ok(&o);
    out
}

pub fn shard_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    v.sort();
    v
}

/// Rewrites the JSON header of a safetensors file in place with `f` (which must keep its length).
pub fn edit_header(path: &Path, f: impl FnOnce(&str) -> String) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let new = f(&header);
    assert_eq!(new.len(), header.len(), "header edits must keep the length");
    bytes[8..8 + n].copy_from_slice(new.as_bytes());
    std::fs::write(path, bytes).unwrap();
}

pub fn write_text(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

pub fn sample_text() -> String {
    soar_gptq::eval::DEFAULT_EVAL_TEXT[..40_000].to_string()
}

/// The shipped fixture model (a trained tiny MiniCPM-SALA).
pub const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiny-sala");

pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
}

/// Rewrites the shards of `dir` into `dst` (other files copied): `f` maps each tensor to the
/// tensors written in its place (name, dtype, shape, bytes).
#[allow(clippy::type_complexity)]
pub fn rewrite_tensors(
    dir: &Path,
    dst: &Path,
    f: impl Fn(
        &str,
        &soar_gptq::checkpoint::Checkpoint,
    ) -> Vec<(String, soar_gptq::checkpoint::Dtype, Vec<usize>, Vec<u8>)>,
) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_file() && !name.ends_with(".safetensors") && name != "model.safetensors.index.json"
        {
            std::fs::copy(&p, dst.join(&name)).unwrap();
        }
    }
    let ck = soar_gptq::checkpoint::Checkpoint::open(dir).unwrap();
    let mut out = vec![];
    for n in ck.names() {
        out.extend(f(n, &ck));
    }
    let specs: Vec<soar_gptq::checkpoint::shards::TensorSpec> = out
        .iter()
        .map(|(n, d, s, _)| {
            soar_gptq::checkpoint::shards::TensorSpec::new(n.clone(), *d, s.clone())
        })
        .collect();
    soar_gptq::checkpoint::shards::write_sharded(dst, &specs, u64::MAX, |spec, w| {
        let t = out.iter().find(|t| t.0 == spec.name).unwrap();
        std::io::Write::write_all(w, &t.3)?;
        Ok(())
    })
    .unwrap();
    let _ = std::fs::remove_file(dst.join("manifest.json"));
}
