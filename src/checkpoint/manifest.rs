//! `manifest.json`: the SHA-256 and size of every file of an output, written when the output is
//! committed and checked by `inspect`; and the SHA-256 of files and of a source's shards.

use super::files::write_file;
use super::reader::Checkpoint;
use anyhow::{Context, Result};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

pub const MANIFEST_FILE: &str = "manifest.json";
/// Files that the manifest lists without a hash because they legitimately differ between two
/// identical runs (timings, peak memory); everything else must be byte-identical.
pub const UNHASHED_FILES: &[&str] = &["quantize_report.json"];

/// A file written with the SHA-256 and size of the bytes as they were written (so the manifest
/// need not read it again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashedFile {
    pub name: String,
    pub sha256: String,
    pub size: u64,
}

/// The SHA-256 of every safetensors file of `ck`, by file name (the files hashed in parallel):
/// what `quantize` records of its source (`quantize_report.json`, `hashes.source_sha256`) and
/// what `sensitivity` compares with it.
pub fn shard_sha256(ck: &Checkpoint) -> Result<BTreeMap<String, String>> {
    let files: Vec<&Path> = ck.shards.iter().map(|s| s.path.as_path()).collect();
    files
        .par_iter()
        .map(|p| {
            Ok((
                p.file_name().unwrap().to_string_lossy().into_owned(),
                sha256_file(p)?,
            ))
        })
        .collect()
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `{"files": {name: {"sha256", "size"}}, "unhashed": [...]}` over every regular file in `dir`
/// except the manifest itself, in name order (so the manifest is byte-identical for identical
/// folders).
pub fn compute_manifest(dir: &Path) -> Result<serde_json::Value> {
    manifest_of(dir, &BTreeMap::new())
}

/// [`compute_manifest`], taking the hash of a file in `known` (written by this process, hashed
/// while written) instead of reading it again, when its size on disk is the size recorded.
pub(super) fn manifest_of(
    dir: &Path,
    known: &BTreeMap<String, HashedFile>,
) -> Result<serde_json::Value> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != MANIFEST_FILE && !UNHASHED_FILES.contains(&n.as_str()))
        .collect();
    names.sort();
    // Files are hashed in parallel (shards are GBs each); the map keeps name order.
    let hashed: Vec<(String, serde_json::Value)> = names
        .into_par_iter()
        .map(|n| -> Result<_> {
            let p = dir.join(&n);
            let size = std::fs::metadata(&p)?.len();
            let sha = match known.get(&n) {
                Some(k) if k.size == size => k.sha256.clone(),
                _ => sha256_file(&p)?,
            };
            let entry = serde_json::json!({"sha256": sha, "size": size});
            Ok((n, entry))
        })
        .collect::<Result<_>>()?;
    let files: serde_json::Map<String, serde_json::Value> = hashed.into_iter().collect();
    let unhashed: Vec<&str> = UNHASHED_FILES
        .iter()
        .copied()
        .filter(|n| dir.join(n).is_file())
        .collect();
    Ok(serde_json::json!({ "files": files, "unhashed": unhashed }))
}

/// Writes `manifest.json`; `copied` names the files that are byte copies of the source's
/// (tokenizer, remote code...), listed as `copied_from_source`.
pub fn write_manifest(dir: &Path, copied: &[String]) -> Result<()> {
    write_manifest_with(dir, copied, &BTreeMap::new())
}

pub(super) fn write_manifest_with(
    dir: &Path,
    copied: &[String],
    known: &BTreeMap<String, HashedFile>,
) -> Result<()> {
    let mut m = manifest_of(dir, known)?;
    if !copied.is_empty() {
        m["copied_from_source"] = serde_json::json!(copied);
    }
    write_file(
        &dir.join(MANIFEST_FILE),
        serde_json::to_string_pretty(&m)?.as_bytes(),
    )
}

/// Compares `dir/manifest.json` with the files on disk; returns one line per mismatch.
pub fn verify_manifest(dir: &Path) -> Result<Vec<String>> {
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let stored: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let actual = compute_manifest(dir)?;
    let mut problems = vec![];
    let (s, a) = (&stored["files"], &actual["files"]);
    if let Some(sm) = s.as_object() {
        for (name, v) in sm {
            match a.get(name) {
                None => problems.push(format!("{name}: listed in manifest.json but missing")),
                Some(av) if av != v => problems.push(format!(
                    "{name}: SHA-256 or size differs from manifest.json (corrupted or modified)"
                )),
                _ => {}
            }
        }
    }
    if let Some(am) = a.as_object() {
        for name in am.keys() {
            if s.get(name).is_none() {
                problems.push(format!("{name}: present but not listed in manifest.json"));
            }
        }
    }
    Ok(problems)
}
