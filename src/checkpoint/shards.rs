//! Sharded safetensors: the tensor list cut into `model-0000i-of-0000n.safetensors` shards plus
//! `model.safetensors.index.json`, each shard streamed tensor by tensor (a 9.5B model never has
//! to be in memory) and hashed as it is written; serially, beside the computation that produces
//! the tensors (with early disk writeback), or on all cores.

use super::files::write_file;
use super::manifest::{hex, HashedFile};
use super::reader::{Dtype, INDEX_FILE};
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::Path;

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

#[cfg(test)]
mod tests {
    use super::super::manifest::{compute_manifest, manifest_of, sha256_file};
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
}
