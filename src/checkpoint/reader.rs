//! Memory-mapped safetensors checkpoints, single file or sharded through
//! `model.safetensors.index.json`. Every header is parsed and checked once, up front: offsets
//! inside the file, sizes that match dtype x shape, index entries that point at the right shard.
//! Nothing downstream re-checks.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// Element types a checkpoint may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    BF16,
    F16,
    F32,
    I32,
    U8,
}

impl Dtype {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "BF16" => Self::BF16,
            "F16" => Self::F16,
            "F32" => Self::F32,
            "I32" => Self::I32,
            "U8" => Self::U8,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::BF16 => "BF16",
            Self::F16 => "F16",
            Self::F32 => "F32",
            Self::I32 => "I32",
            Self::U8 => "U8",
        }
    }
    pub fn size(self) -> usize {
        match self {
            Self::BF16 | Self::F16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::U8 => 1,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, Self::BF16 | Self::F16 | Self::F32)
    }
}

#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    /// Byte range inside the shard's mmap (absolute, header included).
    start: usize,
    end: usize,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> usize {
        self.end - self.start
    }
}

pub struct Shard {
    pub path: PathBuf,
    mmap: Mmap,
    pub metadata: BTreeMap<String, String>,
}

/// An opened, validated safetensors checkpoint folder.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
}

#[derive(serde::Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let index: IndexFile = serde_json::from_str(&text).with_context(|| {
                format!(
                    "{} is not a valid safetensors index (needs a weight_map)",
                    index_path.display()
                )
            })?;
            let mut files: Vec<String> = index.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            let mut ck = Self::open_files(dir, &files)?;
            for (name, file) in &index.weight_map {
                let Some(entry) = ck.tensors.get(name) else {
                    bail!(
                        "{} lists tensor {name} in {file}, but {file} does not contain it",
                        index_path.display()
                    );
                };
                let actual = ck.shards[entry.shard]
                    .path
                    .file_name()
                    .unwrap()
                    .to_string_lossy();
                if actual != file.as_str() {
                    bail!(
                        "{} lists tensor {name} in {file}, but it is in {actual}",
                        index_path.display()
                    );
                }
            }
            if let Some(extra) = ck
                .tensors
                .keys()
                .find(|n| !index.weight_map.contains_key(*n))
            {
                let e = &ck.tensors[extra];
                bail!(
                    "tensor {extra} in {} is not listed in {}",
                    ck.shards[e.shard].path.display(),
                    index_path.display()
                );
            }
            ck.dir = dir.to_path_buf();
            Ok(ck)
        } else if single.is_file() {
            Self::open_files(dir, &[SINGLE_FILE.to_string()])
        } else {
            bail!(
                "{} holds neither {INDEX_FILE} nor {SINGLE_FILE}: not a safetensors checkpoint folder",
                dir.display()
            )
        }
    }

    /// Opens the given safetensors files of `dir` as one checkpoint, without an index.
    pub fn open_files(dir: &Path, files: &[String]) -> Result<Self> {
        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (si, file) in files.iter().enumerate() {
            let path = dir.join(file);
            super::guard::regular_file(&path, "shard")?;
            let f = std::fs::File::open(&path)
                .with_context(|| format!("cannot open shard {}", path.display()))?;
            // SAFETY: the file is opened read-only; the tool never writes to its inputs. A file
            // changed by another process while mapped is outside what any mmap reader can defend.
            let mmap = unsafe { Mmap::map(&f) }
                .with_context(|| format!("cannot memory-map {}", path.display()))?;
            let (entries, metadata) = parse_header(&mmap, &path)?;
            for (name, mut e) in entries {
                e.shard = si;
                if tensors.contains_key(&name) {
                    bail!(
                        "tensor {name} appears in more than one shard (again in {})",
                        path.display()
                    );
                }
                tensors.insert(name, e);
            }
            shards.push(Shard {
                path,
                mmap,
                metadata,
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            tensors,
        })
    }

    /// The file names of the shards, in the order they were opened.
    pub fn shard_file_names(&self) -> Vec<String> {
        self.shards
            .iter()
            .map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }
    pub fn entries(&self) -> impl Iterator<Item = (&String, &TensorEntry)> {
        self.tensors.iter()
    }
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    pub fn shard_path(&self, e: &TensorEntry) -> &Path {
        &self.shards[e.shard].path
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors.get(name).ok_or_else(|| {
            anyhow!(
                "tensor {name} is missing from the checkpoint in {}",
                self.dir.display()
            )
        })
    }

    /// Raw little-endian bytes of a tensor, straight from the mmap.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let e = self.entry(name)?;
        Ok(&self.shards[e.shard].mmap[e.start..e.end])
    }

    /// Maps the pages of tensor `name` in (one read per page), so that copying it later, to a
    /// GPU say, runs at memory speed instead of taking a page fault every 4 KiB. For a thread
    /// beside the computation: quantize prefaults the next layer while one layer computes.
    pub fn prefault(&self, name: &str) -> Result<()> {
        let mut sum = 0u8;
        for page in self.bytes(name)?.chunks(4096) {
            sum = sum.wrapping_add(page[0]);
        }
        std::hint::black_box(sum);
        Ok(())
    }

    /// The dtype tensor `name` is stored in, as candle names it (not for I32 tensors).
    pub fn stored_dtype(&self, name: &str) -> Result<DType> {
        Ok(match self.entry(name)?.dtype {
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            Dtype::F32 => DType::F32,
            Dtype::I32 => bail!("tensor {name} is I32, expected a float tensor"),
            Dtype::U8 => DType::U8,
        })
    }

    /// Loads a float tensor converted to `dtype` on `device`.
    pub fn tensor(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let e = self.entry(name)?;
        let bytes = self.bytes(name)?;
        let src = self.stored_dtype(name)?;
        // Straight from the mapped bytes to the device in the stored dtype, converted there.
        let t = Tensor::from_raw_buffer(bytes, src, &e.shape, device)
            .with_context(|| format!("cannot load tensor {name}"))?;
        Ok(t.to_dtype(dtype)?)
    }

    /// Int32 tensor data (GPTQ qweight, qzeros, g_idx).
    pub fn i32_data(&self, name: &str) -> Result<Vec<i32>> {
        let e = self.entry(name)?;
        if e.dtype != Dtype::I32 {
            bail!("tensor {name} is {}, expected I32", e.dtype.name());
        }
        Ok(self
            .bytes(name)?
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }

    /// Float tensor data widened to f32.
    pub fn f32_data(&self, name: &str) -> Result<Vec<f32>> {
        let e = self.entry(name)?;
        let b = self.bytes(name)?;
        Ok(match e.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => bail!("tensor {name} is {}, expected a float tensor", other.name()),
        })
    }

    /// Checks that the checkpoint holds exactly `expected` (name, shape), every one a float tensor.
    /// The first float tensor (in name order) holding a NaN or ±Inf, with the element's index:
    /// such a checkpoint gives NaN perplexities and passes NaN through quantization. Integer
    /// tensors are skipped. Tensors are scanned in parallel, in chunks.
    pub fn first_non_finite(&self) -> Option<(String, usize)> {
        use rayon::prelude::*;
        let found: Vec<(String, usize)> = self
            .tensors
            .par_iter()
            .filter(|(_, e)| e.dtype.is_float())
            .filter_map(|(name, e)| {
                let b = &self.shards[e.shard].mmap[e.start..e.end];
                let size = e.dtype.size();
                // Exponent bits all ones: Inf or NaN.
                let bad = |c: &[u8]| -> bool {
                    match e.dtype {
                        Dtype::BF16 => u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80,
                        Dtype::F16 => u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00,
                        _ => {
                            u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000
                                == 0x7f80_0000
                        }
                    }
                };
                b.par_chunks(size << 16)
                    .enumerate()
                    .find_map_first(|(ci, chunk)| {
                        chunk
                            .chunks_exact(size)
                            .position(bad)
                            .map(|i| (ci << 16) + i)
                    })
                    .map(|i| (name.clone(), i))
            })
            .collect();
        found.into_iter().min()
    }

    /// Refuses a checkpoint with a non-finite float, naming the tensor, its file and the element.
    pub fn check_finite(&self) -> Result<()> {
        if let Some((name, i)) = self.first_non_finite() {
            let e = &self.tensors[&name];
            bail!(
                "tensor {name} in {} holds a non-finite value (NaN or Inf) at element {i} {:?}: the \
                 checkpoint is damaged (a bad download or a diverged training run); re-create or \
                 re-download it",
                self.shard_path(e).display(),
                unravel(i, &e.shape)
            );
        }
        Ok(())
    }

    pub fn validate_exact(&self, expected: &[(String, Vec<usize>)]) -> Result<()> {
        for (name, shape) in expected {
            let e = self.entry(name)?;
            if &e.shape != shape {
                bail!(
                    "tensor {name} in {} has shape {:?}, but config.json implies {:?}",
                    self.shard_path(e).display(),
                    e.shape,
                    shape
                );
            }
            if !e.dtype.is_float() {
                bail!(
                    "tensor {name} in {} has dtype {}: expected BF16, F16 or F32",
                    self.shard_path(e).display(),
                    e.dtype.name()
                );
            }
        }
        let expected_names: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some((name, e)) = self
            .tensors
            .iter()
            .find(|(n, _)| !expected_names.contains(n.as_str()))
        {
            bail!(
                "unexpected tensor {name} in {}: config.json does not imply it (wrong config, or another architecture?)",
                self.shard_path(e).display()
            );
        }
        Ok(())
    }
}

type Header = (Vec<(String, TensorEntry)>, BTreeMap<String, String>);

/// Parses and validates a safetensors header: sane length, JSON, known dtypes, data offsets that
/// tile the data section exactly and agree with dtype x shape, and a file long enough to hold it.
fn parse_header(buf: &[u8], path: &Path) -> Result<Header> {
    let (n, header) = header_object(buf, path)?;
    let data_len = buf.len() - 8 - n;
    let mut metadata = BTreeMap::new();
    let mut entries = Vec::new();
    for (name, v) in header {
        if name == "__metadata__" {
            if let Some(m) = v.as_object() {
                for (k, v) in m {
                    metadata.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                }
            }
            continue;
        }
        let entry = parse_entry(&name, &v, path, n, data_len)?;
        entries.push((name, entry));
    }
    check_tiling(&entries, buf.len(), n, path)?;
    Ok((entries, metadata))
}

/// The error for a corrupt safetensors file at `path`.
fn corrupt(path: &Path, what: String) -> anyhow::Error {
    anyhow!("corrupt safetensors file {}: {what}", path.display())
}

/// The header's length `n` (its JSON is bytes `8..8 + n`) and its JSON object, with no key
/// given twice.
fn header_object(
    buf: &[u8],
    path: &Path,
) -> Result<(usize, serde_json::Map<String, serde_json::Value>)> {
    let bad = |what: String| corrupt(path, what);
    if buf.len() < 8 {
        return Err(bad(format!(
            "only {} bytes, shorter than the 8-byte header length",
            buf.len()
        )));
    }
    let n = u64::from_le_bytes(buf[..8].try_into().unwrap());
    if n > 100_000_000 || 8 + n as usize > buf.len() {
        return Err(bad(format!(
            "header length {n} does not fit in the file of {} bytes (truncated or not safetensors)",
            buf.len()
        )));
    }
    let n = n as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&buf[8..8 + n])
        .map_err(|e| bad(format!("header is not a JSON object ({e})")))?;
    if let Some(k) = super::json::duplicate_key(&buf[8..8 + n]) {
        return Err(bad(format!(
            "the header names {k} twice (a tensor or __metadata__ key given twice is ambiguous)"
        )));
    }
    Ok((n, header))
}

/// One tensor's header entry `v`: its dtype, shape and data offsets, which must agree with each
/// other and lie inside the data section of `data_len` bytes after the `n`-byte header.
fn parse_entry(
    name: &str,
    v: &serde_json::Value,
    path: &Path,
    n: usize,
    data_len: usize,
) -> Result<TensorEntry> {
    let bad = |what: String| corrupt(path, what);
    let dtype_s = v["dtype"]
        .as_str()
        .ok_or_else(|| bad(format!("tensor {name} has no dtype")))?;
    let dtype = Dtype::parse(dtype_s).ok_or_else(|| {
        anyhow!(
            "tensor {name} in {} has unsupported dtype {dtype_s}: expected BF16, F16 or F32 (I32/U8 for quantized data)",
            path.display()
        )
    })?;
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
        .ok_or_else(|| bad(format!("tensor {name} has no valid shape")))?;
    let offs: Vec<usize> = v["data_offsets"]
        .as_array()
        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
        .filter(|o: &Vec<usize>| o.len() == 2)
        .ok_or_else(|| bad(format!("tensor {name} has no valid data_offsets")))?;
    let (s, e) = (offs[0], offs[1]);
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let want = numel.and_then(|x| x.checked_mul(dtype.size()));
    if s > e || Some(e - s) != want {
        return Err(bad(format!(
            "tensor {name}: data_offsets [{s}, {e}] do not match {dtype_s} x {shape:?}"
        )));
    }
    if e > data_len {
        return Err(anyhow!(
            "truncated safetensors file {}: tensor {name} ends at byte {e} of the data section, which holds only {data_len} bytes",
            path.display()
        ));
    }
    Ok(TensorEntry {
        dtype,
        shape,
        shard: 0,
        start: 8 + n + s,
        end: 8 + n + e,
    })
}

/// The tensors of a file of `file_len` bytes with an `n`-byte header tile its data section
/// exactly.
fn check_tiling(
    entries: &[(String, TensorEntry)],
    file_len: usize,
    n: usize,
    path: &Path,
) -> Result<()> {
    let bad = |what: String| corrupt(path, what);
    let data_len = file_len - 8 - n;
    // The data section must be tiled without overlap (what the safetensors crate also enforces).
    let mut spans: Vec<(usize, usize, &str)> = entries
        .iter()
        .map(|(n, e)| (e.start, e.end, n.as_str()))
        .collect();
    spans.sort();
    let mut pos = 8 + n;
    for (s, e, name) in spans {
        if s != pos {
            return Err(bad(format!(
                "tensor {name} starts at {} but the previous tensor ends at {}",
                s - 8 - n,
                pos - 8 - n
            )));
        }
        pos = e;
    }
    if pos != file_len {
        return Err(bad(format!(
            "bytes {} to {} of the data section belong to no tensor (the format forbids \
             unindexed data; truncated header or appended bytes)",
            pos - 8 - n,
            data_len
        )));
    }
    Ok(())
}

/// The multi-index of flat element `i` in a row-major tensor of `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &s) in shape.iter().enumerate().rev() {
        if s > 0 {
            idx[d] = i % s;
            i /= s;
        }
    }
    idx
}
