//! Writing checkpoints: sharded safetensors streamed tensor by tensor (a 9.5B model never has to
//! be in memory), an output folder that only appears when complete (`<out>.partial` renamed into
//! place), and `manifest.json` with the SHA-256 and size of every file.

use super::reader::{Dtype, INDEX_FILE};
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

pub const MANIFEST_FILE: &str = "manifest.json";
/// Files that the manifest lists without a hash because they legitimately differ between two
/// identical runs (timings, peak memory); everything else must be byte-identical.
pub const UNHASHED_FILES: &[&str] = &["quantize_report.json"];
pub const DEFAULT_SHARD_BYTES: u64 = 4_000_000_000;

#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
        }
    }
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

struct CountingWriter<'a, W: Write> {
    inner: &'a mut W,
    written: u64,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `specs` (in this order) into `model-0000i-of-0000n.safetensors` shards of at most
/// `max_shard_bytes` (a single larger tensor gets a shard of its own) plus
/// `model.safetensors.index.json`. `fill` must write exactly the bytes of the tensor it is given,
/// little-endian. Returns the shard file names.
pub fn write_sharded(
    dir: &Path,
    specs: &[TensorSpec],
    max_shard_bytes: u64,
    mut fill: impl FnMut(&TensorSpec, &mut dyn Write) -> Result<()>,
) -> Result<Vec<String>> {
    let mut groups: Vec<Vec<&TensorSpec>> = vec![];
    let mut size = 0u64;
    for s in specs {
        if groups.is_empty() || (size > 0 && size + s.nbytes() > max_shard_bytes) {
            groups.push(vec![]);
            size = 0;
        }
        groups.last_mut().unwrap().push(s);
        size += s.nbytes();
    }
    let n = groups.len();
    let mut names = vec![];
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (i, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let path = dir.join(&file);
        let f = std::fs::File::create(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = BufWriter::with_capacity(8 << 20, f);
        w.write_all(&header_bytes(group))
            .with_context(|| format!("cannot write {}", path.display()))?;
        for spec in group {
            let mut cw = CountingWriter {
                inner: &mut w,
                written: 0,
            };
            fill(spec, &mut cw)
                .with_context(|| format!("writing tensor {} to {}", spec.name, path.display()))?;
            if cw.written != spec.nbytes() {
                bail!(
                    "internal error: tensor {} wrote {} bytes, expected {}",
                    spec.name,
                    cw.written,
                    spec.nbytes()
                );
            }
            weight_map.insert(spec.name.clone(), file.clone());
            total += spec.nbytes();
        }
        w.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .with_context(|| format!("cannot finish writing {} (disk full?)", path.display()))?;
        names.push(file);
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_file(
        &dir.join(INDEX_FILE),
        serde_json::to_string_pretty(&index)?.as_bytes(),
    )?;
    Ok(names)
}

/// A safetensors header for tensors laid out back to back in `group` order, padded with spaces
/// to a multiple of 8 bytes as the reference implementation does.
fn header_bytes(group: &[&TensorSpec]) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut off = 0u64;
    for s in group {
        map.insert(
            s.name.clone(),
            serde_json::json!({"dtype": s.dtype.name(), "shape": s.shape, "data_offsets": [off, off + s.nbytes()]}),
        );
        off += s.nbytes();
    }
    let mut json = serde_json::to_vec(&map).expect("header serializes");
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out
}

pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes)
        .with_context(|| format!("cannot write {} (disk full?)", path.display()))
}

/// Copies the files of `names` that exist in `src` into `dst` (tokenizer, generation config...).
pub fn copy_if_present(src: &Path, dst: &Path, names: &[&str]) -> Result<Vec<String>> {
    let mut copied = vec![];
    for name in names {
        let from = src.join(name);
        if from.is_file() {
            std::fs::copy(&from, dst.join(name)).with_context(|| {
                format!("cannot copy {} into {}", from.display(), dst.display())
            })?;
            copied.push(name.to_string());
        }
    }
    Ok(copied)
}

/// Files that travel with a model: tokenizer, chat template and generation settings.
pub const SIDE_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
];

/// An output folder under construction: everything is written to `<out>.partial`, and only
/// [`OutputDir::commit`] moves it to `<out>`. Dropped without commit, the partial folder is
/// removed, so a failed run never leaves a half-written checkpoint behind.
pub struct OutputDir {
    pub out: PathBuf,
    pub partial: PathBuf,
    done: bool,
    keep_partial: bool,
}

impl OutputDir {
    pub fn create(out: &Path, force: bool) -> Result<Self> {
        let partial = partial_path(out);
        if out.exists() && !force {
            bail!(
                "output {} already exists: pass --force to replace it, or choose another --out",
                out.display()
            );
        }
        if partial.exists() {
            std::fs::remove_dir_all(&partial)
                .with_context(|| format!("cannot remove stale {}", partial.display()))?;
        }
        std::fs::create_dir_all(&partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        Ok(Self {
            out: out.to_path_buf(),
            partial,
            done: false,
            keep_partial: false,
        })
    }

    /// Reopens an existing partial folder (for `--resume`).
    pub fn reopen(out: &Path, force: bool) -> Result<Self> {
        let partial = partial_path(out);
        if out.exists() && !force {
            bail!(
                "output {} already exists: pass --force to replace it, or choose another --out",
                out.display()
            );
        }
        if !partial.is_dir() {
            bail!("nothing to resume: {} does not exist", partial.display());
        }
        Ok(Self {
            out: out.to_path_buf(),
            partial,
            done: false,
            keep_partial: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.partial
    }

    /// Keep `<out>.partial` when dropped without commit (a resumable run).
    pub fn keep_on_failure(&mut self, keep: bool) {
        self.keep_partial = keep;
    }

    /// Writes `manifest.json` and renames the partial folder into place.
    pub fn commit(mut self) -> Result<PathBuf> {
        write_manifest(&self.partial)?;
        if self.out.exists() {
            std::fs::remove_dir_all(&self.out)
                .with_context(|| format!("cannot remove old {}", self.out.display()))?;
        }
        std::fs::rename(&self.partial, &self.out).with_context(|| {
            format!(
                "cannot rename {} to {}",
                self.partial.display(),
                self.out.display()
            )
        })?;
        self.done = true;
        Ok(self.out.clone())
    }
}

impl Drop for OutputDir {
    fn drop(&mut self) {
        if !self.done && !self.keep_partial {
            let _ = std::fs::remove_dir_all(&self.partial);
        }
    }
}

pub fn partial_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_os_string();
    s.push(".partial");
    PathBuf::from(s)
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

/// `{"files": {name: {"sha256", "size"}}}` over every regular file in `dir` except the
/// manifest itself, in name order (so the manifest is byte-identical for identical folders).
pub fn compute_manifest(dir: &Path) -> Result<serde_json::Value> {
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
            let entry = serde_json::json!({"sha256": sha256_file(&p)?, "size": size});
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

pub fn write_manifest(dir: &Path) -> Result<()> {
    let m = compute_manifest(dir)?;
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

#[cfg(test)]
mod tests {
    use super::super::reader::Checkpoint;
    use super::*;

    #[test]
    fn sharded_write_reads_back_and_splits_by_size() {
        let dir = tempfile::tempdir().unwrap();
        let specs = vec![
            TensorSpec::new("a", Dtype::F32, vec![4, 8]),
            TensorSpec::new("b", Dtype::BF16, vec![16]),
            TensorSpec::new("c", Dtype::I32, vec![3, 5]),
        ];
        let files = write_sharded(dir.path(), &specs, 140, |s, w| {
            let n = s.nbytes() as usize;
            w.write_all(&(0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>())?;
            Ok(())
        })
        .unwrap();
        assert_eq!(
            files,
            vec![
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        for s in &specs {
            let e = ck.get(&s.name).unwrap();
            assert_eq!(e.shape, s.shape);
            assert_eq!(e.dtype, s.dtype);
            let b = ck.bytes(&s.name).unwrap();
            assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        }
        // The reference safetensors parser accepts our files too.
        for f in files {
            let bytes = std::fs::read(dir.path().join(f)).unwrap();
            safetensors::SafeTensors::deserialize(&bytes).unwrap();
        }
    }

    #[test]
    fn output_dir_is_atomic_and_refuses_existing() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("q");
        {
            let od = OutputDir::create(&out, false).unwrap();
            write_file(&od.path().join("x.txt"), b"x").unwrap();
            // dropped without commit
        }
        assert!(!out.exists() && !partial_path(&out).exists());
        let od = OutputDir::create(&out, false).unwrap();
        write_file(&od.path().join("x.txt"), b"x").unwrap();
        od.commit().unwrap();
        assert!(out.join(MANIFEST_FILE).is_file());
        assert!(verify_manifest(&out).unwrap().is_empty());
        let err = OutputDir::create(&out, false).err().unwrap().to_string();
        assert!(err.contains("--force"), "{err}");
        std::fs::write(out.join("x.txt"), b"y").unwrap();
        let problems = verify_manifest(&out).unwrap();
        assert!(problems[0].starts_with("x.txt"), "{problems:?}");
    }
}
