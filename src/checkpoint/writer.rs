//! Writing checkpoints: sharded safetensors streamed tensor by tensor (a 9.5B model never has to
//! be in memory), an output folder that only appears when complete (`<out>.partial` renamed into
//! place), and `manifest.json` with the SHA-256 and size of every file.

use super::guard;
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

/// A file written with the SHA-256 and size of the bytes as they were written (so the manifest
/// need not read it again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashedFile {
    pub name: String,
    pub sha256: String,
    pub size: u64,
}

/// Counts and hashes what passes through to `inner`.
struct HashingWriter<'a, W: Write> {
    inner: &'a mut W,
    hash: Sha256,
    written: u64,
}

impl<W: Write> Write for HashingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `specs` cut into shards of at most `max_shard_bytes` (a larger tensor gets a shard of its
/// own); one empty shard when there are no tensors (a layer whose every Linear is kept in 16
/// bits still gets a valid file).
fn shard_groups(specs: &[TensorSpec], max_shard_bytes: u64) -> Vec<Vec<&TensorSpec>> {
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
    if groups.is_empty() {
        groups.push(vec![]);
    }
    groups
}

fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Writes one shard: the header, then each tensor's bytes as `next` hands them over in `group`
/// order (`next(ti, w)` writes tensor `ti` into `w`), hashing as it goes; synced before it
/// returns. With `writeback_every`, the disk writeback of the data written so far is started
/// whenever that many bytes have been added since the last start ([`start_writeback`]), so the
/// disk works while the shard's later tensors are produced and the final sync has little left.
fn write_shard(
    path: &Path,
    group: &[&TensorSpec],
    writeback_every: Option<u64>,
    mut next: impl FnMut(usize, &mut dyn Write) -> Result<()>,
) -> Result<HashedFile> {
    let f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut buf = BufWriter::with_capacity(8 << 20, f);
    let mut w = HashingWriter {
        inner: &mut buf,
        hash: Sha256::new(),
        written: 0,
    };
    w.write_all(&header_bytes(group))
        .with_context(|| format!("cannot write {}", path.display()))?;
    crate::fault::write_point("a shard's header written")
        .with_context(|| format!("cannot write {} (disk full?)", path.display()))?;
    let mut synced = 0u64;
    for (ti, spec) in group.iter().enumerate() {
        let before = w.written;
        next(ti, &mut w)
            .with_context(|| format!("writing tensor {} to {}", spec.name, path.display()))?;
        if w.written - before != spec.nbytes() {
            bail!(
                "internal error: tensor {} wrote {} bytes, expected {}",
                spec.name,
                w.written - before,
                spec.nbytes()
            );
        }
        if ti == group.len() / 2 {
            crate::fault::write_point("half a shard written")
                .with_context(|| format!("cannot write {} (disk full?)", path.display()))?;
        }
        if let Some(every) = writeback_every {
            if w.written - synced >= every {
                w.inner
                    .flush()
                    .and_then(|()| start_writeback(w.inner.get_ref(), synced, w.written - synced))
                    .with_context(|| format!("cannot write {} (disk full?)", path.display()))?;
                synced = w.written;
            }
        }
    }
    let (hash, size) = (w.hash, w.written);
    buf.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot finish writing {} (disk full?)", path.display()))?;
    Ok(HashedFile {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        sha256: hex(&hash.finalize()),
        size,
    })
}

/// How often the writers start the disk writeback of what they wrote (see [`write_shard`]).
pub const WRITEBACK_EVERY: u64 = 256 << 20;

/// Starts writing `len` bytes of `file` from `offset` to the disk without waiting for it
/// (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`; elsewhere nothing: the final sync does it
/// all). Only a hint: a filesystem that refuses it is not an error, since the data is still
/// synced before the file counts as written (and that sync reports real write errors).
fn start_writeback(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let _ = unsafe {
            libc::sync_file_range(
                file.as_raw_fd(),
                offset as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
    Ok(())
}

/// `model.safetensors.index.json` for shards `groups` (named by [`shard_name`]).
fn write_index(dir: &Path, groups: &[Vec<&TensorSpec>]) -> Result<()> {
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (i, group) in groups.iter().enumerate() {
        for spec in group {
            weight_map.insert(spec.name.clone(), shard_name(i, groups.len()));
            total += spec.nbytes();
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_file(
        &dir.join(INDEX_FILE),
        serde_json::to_string_pretty(&index)?.as_bytes(),
    )
}

/// Writes `specs` (in this order) into `model-0000i-of-0000n.safetensors` shards of at most
/// `max_shard_bytes` (a single larger tensor gets a shard of its own) plus
/// `model.safetensors.index.json`, one tensor after another. `fill` must write exactly the bytes
/// of the tensor it is given, little-endian. Returns the shards, hashed as they were written.
pub fn write_sharded(
    dir: &Path,
    specs: &[TensorSpec],
    max_shard_bytes: u64,
    fill: impl FnMut(&TensorSpec, &mut dyn Write) -> Result<()>,
) -> Result<Vec<HashedFile>> {
    write_sharded_synced(dir, specs, max_shard_bytes, None, fill)
}

/// [`write_sharded`], starting each shard's disk writeback whenever `writeback_every` more bytes
/// were written (see [`write_shard`]): for a writer that runs beside the computation that
/// produces its tensors (quantize streams its shards while the layers are solved), so that the
/// data reaches the disk during the run and the final sync is short.
pub fn write_sharded_synced(
    dir: &Path,
    specs: &[TensorSpec],
    max_shard_bytes: u64,
    writeback_every: Option<u64>,
    mut fill: impl FnMut(&TensorSpec, &mut dyn Write) -> Result<()>,
) -> Result<Vec<HashedFile>> {
    let groups = shard_groups(specs, max_shard_bytes);
    let mut files = vec![];
    for (i, group) in groups.iter().enumerate() {
        let path = dir.join(shard_name(i, groups.len()));
        files.push(write_shard(&path, group, writeback_every, |ti, w| {
            fill(group[ti], w)
        })?);
    }
    write_index(dir, &groups)?;
    Ok(files)
}

/// The most tensor bytes one shard of [`write_sharded_parallel`] holds in memory at once.
const PARALLEL_WINDOW_BYTES: u64 = 512 << 20;

/// [`write_sharded`] on all cores: shards are written at the same time, and within a shard the
/// tensors of a window (up to [`PARALLEL_WINDOW_BYTES`], at least one tensor) are produced in
/// parallel, then written in order; each shard's disk writeback is started every
/// [`WRITEBACK_EVERY`] bytes, so the disk works while later tensors are produced. `produce`
/// returns a tensor's bytes (borrowed from a mapped file, or computed). The files are
/// byte-identical to [`write_sharded`]'s.
pub fn write_sharded_parallel<'a>(
    dir: &Path,
    specs: &'a [TensorSpec],
    max_shard_bytes: u64,
    produce: impl Fn(&TensorSpec) -> Result<std::borrow::Cow<'a, [u8]>> + Sync,
) -> Result<Vec<HashedFile>> {
    let groups = shard_groups(specs, max_shard_bytes);
    let n = groups.len();
    let files = groups
        .par_iter()
        .enumerate()
        .map(|(i, group)| -> Result<HashedFile> {
            let path = dir.join(shard_name(i, n));
            let mut ready: std::collections::VecDeque<std::borrow::Cow<'a, [u8]>> =
                Default::default();
            let mut next_window = 0usize;
            write_shard(&path, group, Some(WRITEBACK_EVERY), |ti, w| {
                if ti == next_window {
                    let mut end = ti;
                    let mut bytes = 0u64;
                    while end < group.len()
                        && (end == ti || bytes + group[end].nbytes() <= PARALLEL_WINDOW_BYTES)
                    {
                        bytes += group[end].nbytes();
                        end += 1;
                    }
                    let produced: Vec<_> = group[ti..end]
                        .par_iter()
                        .map(|spec| {
                            produce(spec).with_context(|| format!("producing tensor {}", spec.name))
                        })
                        .collect::<Result<_>>()?;
                    ready.extend(produced);
                    next_window = end;
                }
                let bytes = ready.pop_front().expect("produced in this window");
                w.write_all(&bytes)?;
                Ok(())
            })
        })
        .collect::<Result<Vec<_>>>()?;
    write_index(dir, &groups)?;
    Ok(files)
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
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out
}

/// Replaces `path` atomically: `write` fills `<path>.tmp`, which is synced and renamed over
/// `path`, so a crash or a full disk leaves the old file or the new one, never a torn one. For
/// files inside a folder the tool made itself (the journal in `<out>.partial`); a file at a path
/// the user names goes through [`guard::OutputFile`] instead.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write(&tmp)
        .and_then(|()| -> Result<()> {
            std::fs::File::open(&tmp)?.sync_all()?;
            Ok(crate::fault::write_point("a temporary file written")?)
        })
        .with_context(|| format!("cannot write {} (disk full?)", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
}

pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::fault::write_point("before writing a file")
        .and_then(|()| std::fs::write(path, bytes))
        .with_context(|| format!("cannot write {} (disk full?)", path.display()))
}

/// Copies `names` from `src` into `dst` byte for byte (the tokenizer is never re-serialized:
/// a re-written tokenizer.json served garbage under another transformers version).
pub fn copy_files(src: &Path, dst: &Path, names: &[String]) -> Result<()> {
    for name in names {
        let from = src.join(name);
        crate::fault::write_point("before copying a side file")
            .and_then(|()| std::fs::copy(&from, dst.join(name)))
            .with_context(|| {
                format!(
                    "cannot copy {} into {} (disk full?)",
                    from.display(),
                    dst.display()
                )
            })?;
    }
    Ok(())
}

/// Files that travel with a model besides config and weights: tokenizer and processor files,
/// chat template, generation settings, licence. Every `*.py` (the remote code `auto_map` names,
/// and the modules it imports) and `*.tiktoken` travels too ([`is_side_file`]).
pub const SIDE_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "preprocessor_config.json",
    "processor_config.json",
    "LICENSE",
    "LICENSE.txt",
    "LICENSE.md",
    "NOTICE",
];

/// Whether a file of a model folder (or hub repo, top level) travels into every output.
pub fn is_side_file(name: &str) -> bool {
    !name.contains('/')
        && (SIDE_FILES.contains(&name) || name.ends_with(".py") || name.ends_with(".tiktoken"))
}

/// The side files present in `dir`, in name order.
pub fn side_files(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| is_side_file(n))
        .collect();
    names.sort();
    Ok(names)
}

/// An output folder under construction: everything is written to `<out>.partial`, and only
/// [`OutputDir::commit`] moves it to `<out>`. Dropped without commit, the partial folder is
/// removed, so a failed run never leaves a half-written checkpoint behind.
///
/// Opening one checks the output against the command's inputs ([`guard::check_output`]) and
/// takes the advisory lock on `<out>.lock` for as long as it lives. An existing `<out>` is
/// replaced only with `force`, only when it is a model folder (or empty), and only once the new
/// output is complete: [`OutputDir::commit`] moves the old folder aside, renames the new one into
/// place and then deletes the old one.
pub struct OutputDir {
    pub out: PathBuf,
    pub partial: PathBuf,
    done: bool,
    keep_partial: bool,
    /// Files copied byte for byte from the source, listed in the manifest.
    copied: Vec<String>,
    /// Files written with their hashes (the shards), which the manifest does not re-read.
    hashed: BTreeMap<String, HashedFile>,
    _interrupt: crate::interrupt::Registration,
    _lock: guard::OutputLock,
}

/// Files whose presence marks a folder as a model folder that `--force` may replace.
const MODEL_FOLDER_MARKERS: &[&str] = &["config.json", MANIFEST_FILE, INDEX_FILE];

/// `<out>.replaced`: where [`OutputDir::commit`] parks the old output while the new one moves in.
fn replaced_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_os_string();
    s.push(".replaced");
    PathBuf::from(s)
}

/// A commit stopped between its two renames leaves the old output in `<out>.replaced` and no
/// `<out>`: put the old output back, so it is never hidden from the user.
fn restore_interrupted_commit(out: &Path) -> Result<()> {
    let replaced = replaced_path(out);
    if out.symlink_metadata().is_err() && replaced.symlink_metadata().is_ok() {
        std::fs::rename(&replaced, out).with_context(|| {
            format!(
                "an earlier run stopped while replacing {}; cannot move {} back",
                out.display(),
                replaced.display()
            )
        })?;
        eprintln!(
            "note: an earlier run stopped while replacing {}; the previous output was put back",
            out.display()
        );
    }
    Ok(())
}

/// Refuses to replace `out` unless `force` is given and `out` is a folder that holds a model (or
/// nothing): `--force` on a folder of other files would delete them.
fn check_replaceable(out: &Path, force: bool) -> Result<()> {
    if out.symlink_metadata().is_err() {
        return Ok(());
    }
    if !force {
        bail!(
            "output {} already exists: pass --force to replace it, or choose another --out",
            out.display()
        );
    }
    if !out.is_dir() {
        bail!(
            "output {} exists and is not a folder: remove it yourself or choose another --out              (--force replaces model folders only)",
            out.display()
        );
    }
    let empty = std::fs::read_dir(out)
        .with_context(|| format!("cannot list {}", out.display()))?
        .next()
        .is_none();
    if !empty && !MODEL_FOLDER_MARKERS.iter().any(|m| out.join(m).is_file()) {
        bail!(
            "output {} exists and does not look like a model folder (no {}): --force replaces              model folders only, so nothing else is ever deleted; remove it yourself or choose              another --out",
            out.display(),
            MODEL_FOLDER_MARKERS.join(", ")
        );
    }
    Ok(())
}

impl OutputDir {
    /// Starts a new output at `out` (see the type's docs); `inputs` are every path the command
    /// reads, which the output may not alias.
    pub fn create(out: &Path, force: bool, inputs: &[guard::InputPath]) -> Result<Self> {
        let partial = partial_path(out);
        guard::check_output("--out", out, &[partial.clone(), replaced_path(out)], inputs)?;
        let lock = guard::OutputLock::acquire("--out", out)?;
        restore_interrupted_commit(out)?;
        check_replaceable(out, force)?;
        if partial.symlink_metadata().is_ok() {
            if partial.join(RESUMABLE_MARKER).is_file() && !force {
                bail!(
                    "{} holds the finished layers of an interrupted run: rerun the same command                      with --resume to continue it, or add --force to discard it and start over",
                    partial.display()
                );
            }
            remove_path(&partial)
                .with_context(|| format!("cannot remove stale {}", partial.display()))?;
        }
        std::fs::create_dir_all(&partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        Ok(Self {
            out: out.to_path_buf(),
            _interrupt: crate::interrupt::register(&partial, lock.path()),
            partial,
            done: false,
            keep_partial: false,
            copied: vec![],
            hashed: BTreeMap::new(),
            _lock: lock,
        })
    }

    /// Reopens an existing partial folder (for `--resume`).
    pub fn reopen(out: &Path, force: bool, inputs: &[guard::InputPath]) -> Result<Self> {
        let partial = partial_path(out);
        guard::check_output("--out", out, &[partial.clone(), replaced_path(out)], inputs)?;
        let lock = guard::OutputLock::acquire("--out", out)?;
        restore_interrupted_commit(out)?;
        check_replaceable(out, force)?;
        if !partial.is_dir() {
            bail!("nothing to resume: {} does not exist", partial.display());
        }
        Ok(Self {
            out: out.to_path_buf(),
            _interrupt: crate::interrupt::register(&partial, lock.path()),
            partial,
            done: false,
            keep_partial: false,
            copied: vec![],
            hashed: BTreeMap::new(),
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.partial
    }

    /// Copies side files from `src` byte for byte and records them for the manifest's
    /// `copied_from_source` list.
    pub fn copy_from_source(&mut self, src: &Path, names: &[String]) -> Result<()> {
        copy_files(src, &self.partial, names)?;
        for n in names {
            if !self.copied.contains(n) {
                self.copied.push(n.clone());
            }
        }
        self.copied.sort();
        Ok(())
    }

    /// Records files of the folder hashed while they were written (see [`write_sharded`]): the
    /// manifest takes their hashes instead of reading them again.
    pub fn record_hashed(&mut self, files: &[HashedFile]) {
        for f in files {
            self.hashed.insert(f.name.clone(), f.clone());
        }
    }

    /// Keep `<out>.partial` when dropped without commit (a resumable run).
    pub fn keep_on_failure(&mut self, keep: bool) {
        self.keep_partial = keep;
    }

    /// Writes `manifest.json` and renames the partial folder into place. An old output is moved
    /// aside first and deleted only after the new one is in place; if the rename fails, the old
    /// output is put back.
    /// Subfolders (quantize's journal) are not part of the manifest, which lists files only.
    pub fn commit(mut self) -> Result<PathBuf> {
        write_manifest_with(&self.partial, &self.copied, &self.hashed)?;
        // Ctrl-C waits for the renames: the output is either the old one or the new one.
        let _renaming = crate::interrupt::critical();
        let replaced = replaced_path(&self.out);
        let had_old = self.out.symlink_metadata().is_ok();
        if had_old {
            if replaced.symlink_metadata().is_ok() {
                remove_path(&replaced)
                    .with_context(|| format!("cannot remove {}", replaced.display()))?;
            }
            crate::fault::point("before moving the old output aside");
            std::fs::rename(&self.out, &replaced).with_context(|| {
                format!(
                    "cannot move the old {} aside to {}",
                    self.out.display(),
                    replaced.display()
                )
            })?;
        }
        crate::fault::point("before renaming the new output into place");
        if let Err(e) = std::fs::rename(&self.partial, &self.out) {
            if had_old {
                let _ = std::fs::rename(&replaced, &self.out);
            }
            return Err(e).with_context(|| {
                format!(
                    "cannot rename {} to {}",
                    self.partial.display(),
                    self.out.display()
                )
            });
        }
        self.done = true;
        crate::fault::point("after renaming the new output into place");
        if had_old {
            remove_path(&replaced).with_context(|| {
                format!(
                    "the new {} is in place, but the old output could not be removed from {}",
                    self.out.display(),
                    replaced.display()
                )
            })?;
        }
        Ok(self.out.clone())
    }
}

pub use crate::interrupt::RESUMABLE_MARKER;

/// Removes a folder tree, or a file or symlink (never following it).
fn remove_path(p: &Path) -> std::io::Result<()> {
    match p.symlink_metadata() {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
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

/// The SHA-256 of every safetensors file of `ck`, by file name (the files hashed in parallel):
/// what `quantize` records of its source (`quantize_report.json`, `hashes.source_sha256`) and
/// what `sensitivity` compares with it.
pub fn shard_sha256(ck: &super::Checkpoint) -> Result<BTreeMap<String, String>> {
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
fn manifest_of(dir: &Path, known: &BTreeMap<String, HashedFile>) -> Result<serde_json::Value> {
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

fn write_manifest_with(
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
        let files: Vec<String> = files.into_iter().map(|f| f.name).collect();
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

    /// The parallel writer gives the serial writer's bytes, and the hashes it computed while
    /// writing are the files' (the manifest trusts them instead of reading the shards again).
    #[test]
    fn parallel_shards_equal_serial_ones_and_their_hashes_are_the_files() {
        let specs: Vec<TensorSpec> = (0..23)
            .map(|i| TensorSpec::new(format!("t{i}"), Dtype::BF16, vec![1 + (i * 7) % 13, 9]))
            .collect();
        let data = |s: &TensorSpec| -> Vec<u8> {
            let seed = s.name.len() * 31 + s.nbytes() as usize;
            (0..s.nbytes() as usize)
                .map(|i| ((i * 131 + seed) % 253) as u8)
                .collect()
        };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let serial = write_sharded(a.path(), &specs, 700, |s, w| {
            w.write_all(&data(s))?;
            Ok(())
        })
        .unwrap();
        let parallel =
            write_sharded_parallel(b.path(), &specs, 700, |s| Ok(data(s).into())).unwrap();
        assert!(serial.len() > 3, "several shards: {}", serial.len());
        assert_eq!(serial, parallel);
        for f in &parallel {
            let (x, y) = (a.path().join(&f.name), b.path().join(&f.name));
            assert_eq!(std::fs::read(&x).unwrap(), std::fs::read(&y).unwrap());
            assert_eq!(f.sha256, sha256_file(&y).unwrap());
            assert_eq!(f.size, std::fs::metadata(&y).unwrap().len());
        }
        assert_eq!(
            std::fs::read(a.path().join(INDEX_FILE)).unwrap(),
            std::fs::read(b.path().join(INDEX_FILE)).unwrap()
        );
        let known: BTreeMap<String, HashedFile> = parallel
            .iter()
            .map(|f| (f.name.clone(), f.clone()))
            .collect();
        assert_eq!(
            manifest_of(b.path(), &known).unwrap(),
            compute_manifest(b.path()).unwrap()
        );
        // A recorded size that no longer matches the file: the file is hashed again.
        let mut stale = known.clone();
        let first = stale.values_mut().next().unwrap();
        first.size += 1;
        first.sha256 = "0".repeat(64);
        assert_eq!(
            manifest_of(b.path(), &stale).unwrap(),
            compute_manifest(b.path()).unwrap()
        );
        // A producer that hands over the wrong length is refused.
        let e = write_sharded_parallel(b.path(), &specs, 700, |s| {
            Ok(vec![0u8; s.nbytes() as usize + usize::from(s.name == "t5")].into())
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("tensor t5 wrote"), "{e:#}");
    }

    #[test]
    fn output_dir_is_atomic_and_refuses_existing() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("q");
        {
            let od = OutputDir::create(&out, false, &[]).unwrap();
            write_file(&od.path().join("x.txt"), b"x").unwrap();
            // dropped without commit
        }
        assert!(!out.exists() && !partial_path(&out).exists());
        let od = OutputDir::create(&out, false, &[]).unwrap();
        write_file(&od.path().join("x.txt"), b"x").unwrap();
        od.commit().unwrap();
        assert!(out.join(MANIFEST_FILE).is_file());
        assert!(verify_manifest(&out).unwrap().is_empty());
        let err = OutputDir::create(&out, false, &[])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--force"), "{err}");
        std::fs::write(out.join("x.txt"), b"y").unwrap();
        let problems = verify_manifest(&out).unwrap();
        assert!(problems[0].starts_with("x.txt"), "{problems:?}");
    }
}
