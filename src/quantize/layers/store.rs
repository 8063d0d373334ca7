//! Where the calibration activations live between the passes over a layer (docs/algorithm.md,
//! Streaming the calibration).
//!
//! The hidden states of every batch must be kept from one layer to the next: on the compute
//! device while they fit its budget, else in host memory, else in files on disk. Within a layer,
//! the mixer outputs (the input of o_proj) and the MLP activations (the input of down_proj) are
//! kept only while a byte budget lasts; a batch that does not fit is recomputed from its hidden
//! state when it is needed again, with the same operations, so the output does not depend on
//! where anything was kept.

pub use crate::quantize::stages::{Residency, Tier};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

/// Bytes left for the optional per-batch caches: on the compute device, and for the caches
/// that may go there (the mixer outputs), in page-locked host memory beside a GPU.
pub struct Budget {
    left: u64,
    host: HostTier,
}

impl Budget {
    /// `bytes` on the compute device and `host_bytes` in host memory (0 on the CPU: the device
    /// is the host).
    pub fn new(bytes: u64, host_bytes: u64, device: &Device) -> Result<Self> {
        Ok(Self {
            left: bytes,
            host: HostTier::new(host_bytes, device)?,
        })
    }
}

/// Host memory for the caches the device budget cannot keep: page-locked buffers, reused from
/// layer to layer, filled and emptied by copies on a second stream that overlap the
/// computation (`kernels::transfer::CopyStream`); without a GPU (the unit tests), plain copies.
struct HostTier {
    /// Where the tensors come back to.
    device: Device,
    /// Bytes not yet given to a buffer.
    left: u64,
    free: Vec<HostBuf>,
    /// The last copy to the host, whose source the device's stream frees only after it.
    #[cfg(feature = "cuda")]
    pending: Option<crate::kernels::transfer::InFlight>,
    #[cfg(feature = "cuda")]
    copies: Option<crate::kernels::transfer::CopyStream>,
}

/// One host buffer of the tier and what it holds.
enum HostBuf {
    #[cfg(feature = "cuda")]
    Pinned(crate::kernels::transfer::PinnedTensor),
    Plain {
        cap: usize,
        t: Option<Tensor>,
    },
}

impl HostBuf {
    fn capacity(&self) -> usize {
        match self {
            #[cfg(feature = "cuda")]
            Self::Pinned(p) => p.capacity(),
            Self::Plain { cap, .. } => *cap,
        }
    }
}

impl HostTier {
    fn new(bytes: u64, device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let copies = if device.is_cuda() && bytes > 0 {
            Some(crate::kernels::transfer::CopyStream::new(device)?)
        } else {
            None
        };
        Ok(Self {
            device: device.clone(),
            left: bytes,
            free: vec![],
            #[cfg(feature = "cuda")]
            pending: None,
            #[cfg(feature = "cuda")]
            copies,
        })
    }

    /// A free buffer of at least `n` bytes: one kept from an earlier layer, or a new one while
    /// the budget lasts (smaller free buffers are given up for it: a length mix's windows
    /// differ in size).
    fn buffer(&mut self, n: usize) -> Result<Option<HostBuf>> {
        if let Some(i) = self.free.iter().position(|b| b.capacity() >= n) {
            return Ok(Some(self.free.swap_remove(i)));
        }
        while self.left < n as u64 {
            let Some(b) = self.free.pop() else {
                return Ok(None);
            };
            self.left += b.capacity() as u64;
        }
        self.left -= n as u64;
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.copies {
            return Ok(Some(HostBuf::Pinned(c.alloc(n)?)));
        }
        Ok(Some(HostBuf::Plain { cap: n, t: None }))
    }

    #[cfg(feature = "cuda")]
    fn copies(&self) -> Result<&crate::kernels::transfer::CopyStream> {
        self.copies
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("internal: page-locked buffers without a copy stream"))
    }

    /// Copies `t` into a host buffer, or gives it back when none is left.
    fn store(&mut self, t: Tensor) -> Result<Option<HostBuf>> {
        let Some(mut buf) = self.buffer(nbytes(&t) as usize)? else {
            return Ok(None);
        };
        match &mut buf {
            #[cfg(feature = "cuda")]
            HostBuf::Pinned(p) => {
                // The previous copy's source may be freed now: this one was queued after it.
                self.pending = Some(self.copies()?.store(&t, p)?);
            }
            HostBuf::Plain { t: slot, .. } => *slot = Some(t.to_device(&Device::Cpu)?),
        }
        Ok(Some(buf))
    }

    /// Lets the device's stream free the source of the last copy to the host once that copy
    /// is done (the stream waits for it).
    fn settle(&mut self) {
        #[cfg(feature = "cuda")]
        {
            self.pending = None;
        }
    }

    /// Starts bringing `buf`'s tensor back to the device; the buffer is free again (a later
    /// copy into it is queued after this one).
    fn load(&mut self, mut buf: HostBuf) -> Result<Loaded> {
        let loaded = match &mut buf {
            #[cfg(feature = "cuda")]
            HostBuf::Pinned(p) => Loaded::InFlight(self.copies()?.load(p)?),
            HostBuf::Plain { t, .. } => Loaded::Ready(
                t.take()
                    .expect("a stored buffer holds its tensor")
                    .to_device(&self.device)?,
            ),
        };
        self.free.push(buf);
        Ok(loaded)
    }
}

/// A cached tensor on its way back to the device.
enum Loaded {
    Ready(Tensor),
    #[cfg(feature = "cuda")]
    InFlight(crate::kernels::transfer::InFlight),
}

impl Loaded {
    fn finish(self) -> Result<Tensor> {
        match self {
            Self::Ready(t) => Ok(t),
            #[cfg(feature = "cuda")]
            Self::InFlight(f) => f.finish(),
        }
    }
}

fn nbytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

enum Slot {
    Empty,
    Held(Tensor),
    Disk {
        path: PathBuf,
        dtype: DType,
        shape: Vec<usize>,
    },
}

/// The hidden states of every calibration batch, in one tier.
pub struct States {
    slots: Vec<Slot>,
    tier: Tier,
    device: Device,
    /// The folder of spilled states (tier `Disk`), removed when the states are dropped.
    spill: Option<PathBuf>,
    /// Distinguishes the files of two streams in one folder.
    tag: &'static str,
}

impl States {
    /// Empty states for `device`, kept in `tier`; `spill` is the folder for tier `Disk`.
    pub fn new(
        tier: Tier,
        device: &Device,
        spill: Option<&Path>,
        tag: &'static str,
    ) -> Result<Self> {
        let spill = match (tier, spill) {
            (Tier::Disk, Some(dir)) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create the spill folder {}", dir.display()))?;
                Some(dir.to_path_buf())
            }
            (Tier::Disk, None) => bail!("internal: hidden states on disk need a spill folder"),
            _ => None,
        };
        Ok(Self {
            slots: vec![],
            tier,
            device: device.clone(),
            spill,
            tag,
        })
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Appends a batch's state.
    pub fn push(&mut self, t: Tensor) -> Result<()> {
        self.slots.push(Slot::Empty);
        self.set(self.slots.len() - 1, t)
    }

    /// Batch `bi`'s state on the compute device.
    pub fn get(&self, bi: usize) -> Result<Tensor> {
        match &self.slots[bi] {
            Slot::Empty => bail!("internal: hidden state {bi} was never stored"),
            Slot::Held(t) => Ok(t.to_device(&self.device)?),
            Slot::Disk { path, dtype, shape } => {
                let bytes = std::fs::read(path).with_context(|| {
                    format!("cannot read the spilled hidden state {}", path.display())
                })?;
                Ok(Tensor::from_raw_buffer(
                    &bytes,
                    *dtype,
                    shape,
                    &self.device,
                )?)
            }
        }
    }

    /// Replaces batch `bi`'s state.
    pub fn set(&mut self, bi: usize, t: Tensor) -> Result<()> {
        self.slots[bi] = match self.tier {
            Tier::Device => Slot::Held(t),
            Tier::Host => Slot::Held(t.to_device(&Device::Cpu)?),
            Tier::Disk => {
                let dir = self.spill.as_ref().expect("a spill folder for tier Disk");
                let path = dir.join(format!("{}-{bi:06}.bin", self.tag));
                let bytes = raw_bytes(&t)?;
                crate::checkpoint::files::write_file(&path, &bytes)?;
                Slot::Disk {
                    path,
                    dtype: t.dtype(),
                    shape: t.dims().to_vec(),
                }
            }
        };
        Ok(())
    }

    /// The states as one more stream starting from the same values (GPTAQ's full-precision
    /// stream), in the same tier.
    pub fn duplicate(&self, tag: &'static str) -> Result<Self> {
        let mut d = Self::new(self.tier, &self.device, self.spill.as_deref(), tag)?;
        for bi in 0..self.len() {
            d.push(self.get(bi)?)?;
        }
        Ok(d)
    }
}

impl Drop for States {
    fn drop(&mut self) {
        for s in &self.slots {
            if let Slot::Disk { path, .. } = s {
                let _ = std::fs::remove_file(path);
            }
        }
        if let Some(dir) = &self.spill {
            // Only once empty: the other stream's files may share it.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// The little-endian bytes of a tensor (its dtype's layout), for a spill file.
fn raw_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        other => bail!("internal: hidden states of dtype {other:?} cannot be spilled"),
    })
}

/// A per-batch cache of a layer's intermediate (mixer outputs or MLP activations): kept on the
/// device while the budget lasts, then (for a cache that allows it) in host memory, else left
/// for the pass that needs it to recompute.
#[derive(Default)]
pub struct Cache {
    slots: Vec<Option<Kept>>,
    /// Whether batches the device budget cannot keep go to host memory: worth it where the
    /// copy there and back costs less than recomputing (the mixer outputs; an MLP activation is
    /// 4× larger and its recomputation is one GEMM).
    host_ok: bool,
}

enum Kept {
    Device(Tensor),
    Host(HostBuf),
    Loading(Loaded),
}

impl Cache {
    /// A cache whose overflow goes to the budget's host memory.
    pub fn with_host() -> Self {
        Self {
            host_ok: true,
            ..Self::default()
        }
    }

    /// Keeps batch `bi`'s tensor if `budget` allows.
    pub fn put(&mut self, bi: usize, t: Tensor, budget: &mut Budget) -> Result<()> {
        let n = nbytes(&t);
        if self.slots.len() <= bi {
            self.slots.resize_with(bi + 1, || None);
        }
        if n <= budget.left {
            budget.left -= n;
            self.slots[bi] = Some(Kept::Device(t));
        } else if self.host_ok {
            self.slots[bi] = budget.host.store(t)?.map(Kept::Host);
        }
        Ok(())
    }

    /// Batch `bi`'s tensor if it was kept (its bytes go back to `budget`). Taking a batch from
    /// host memory also starts bringing back the next batch kept there, so that its copy
    /// overlaps this batch's computation.
    pub fn take(&mut self, bi: usize, budget: &mut Budget) -> Result<Option<Tensor>> {
        budget.host.settle();
        let Some(kept) = self.slots.get_mut(bi).and_then(Option::take) else {
            return Ok(None);
        };
        let t = match kept {
            Kept::Device(t) => {
                budget.left += nbytes(&t);
                return Ok(Some(t));
            }
            Kept::Host(buf) => budget.host.load(buf)?,
            Kept::Loading(l) => l,
        };
        if let Some(next) =
            (bi + 1..self.slots.len()).find(|&j| matches!(self.slots[j], Some(Kept::Host(_))))
        {
            let Some(Kept::Host(buf)) = self.slots[next].take() else {
                unreachable!("just matched")
            };
            self.slots[next] = Some(Kept::Loading(budget.host.load(buf)?));
        }
        Ok(Some(t.finish()?))
    }

    /// How many batches are kept (on the device, in host memory).
    #[cfg(test)]
    pub fn kept(&self) -> (usize, usize) {
        let on_device = self
            .slots
            .iter()
            .filter(|s| matches!(s, Some(Kept::Device(_))))
            .count();
        let on_host = self
            .slots
            .iter()
            .filter(|s| matches!(s, Some(Kept::Host(_) | Kept::Loading(_))))
            .count();
        (on_device, on_host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_come_back_the_same_from_every_tier() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tensor::arange(0f32, 24.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        for dtype in [DType::F32, DType::BF16] {
            for tier in [Tier::Device, Tier::Host, Tier::Disk] {
                let mut s =
                    States::new(tier, &Device::Cpu, Some(&dir.path().join("s")), "h").unwrap();
                s.push(t.to_dtype(dtype).unwrap()).unwrap();
                s.push(t.to_dtype(dtype).unwrap()).unwrap();
                s.set(1, (t.to_dtype(dtype).unwrap() * 2.0).unwrap())
                    .unwrap();
                let back = s.get(1).unwrap();
                assert_eq!(back.dtype(), dtype);
                assert_eq!(
                    back.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap(),
                    (0..24).map(|x| 2.0 * x as f32).collect::<Vec<_>>()
                );
                drop(s);
                assert!(
                    !dir.path().join("s").exists(),
                    "the spill folder is removed"
                );
            }
        }
    }

    #[test]
    fn the_cache_keeps_what_the_budget_allows_and_returns_it() {
        let t = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap(); // 64 bytes
        let mut b = Budget::new(100, 0, &Device::Cpu).unwrap();
        let mut c = Cache::default();
        c.put(0, t.clone(), &mut b).unwrap();
        c.put(1, t.clone(), &mut b).unwrap();
        assert_eq!(c.kept(), (1, 0));
        assert!(c.take(1, &mut b).unwrap().is_none());
        assert!(c.take(0, &mut b).unwrap().is_some());
        c.put(2, t, &mut b).unwrap();
        assert_eq!(c.kept(), (1, 0));
    }

    fn batch(v: f32, rows: usize) -> Tensor {
        (Tensor::arange(0f32, (rows * 4) as f32, &Device::Cpu)
            .unwrap()
            .reshape((rows, 4))
            .unwrap()
            + v as f64)
            .unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn what_the_device_cannot_keep_goes_to_host_memory_and_comes_back_in_order() {
        // 64-byte batches: one fits the device budget, two the host's, the fourth neither.
        let mut b = Budget::new(64, 128, &Device::Cpu).unwrap();
        let mut c = Cache::with_host();
        for bi in 0..4 {
            c.put(bi, batch(bi as f32, 4), &mut b).unwrap();
        }
        assert_eq!(c.kept(), (1, 2));
        for bi in 0..3 {
            let t = c.take(bi, &mut b).unwrap().expect("kept");
            assert_eq!(values(&t), values(&batch(bi as f32, 4)), "batch {bi}");
        }
        assert!(c.take(3, &mut b).unwrap().is_none(), "recomputed");
        // The next layer reuses the host buffers: the same two batches fit again.
        let mut c = Cache::with_host();
        for bi in 0..4 {
            c.put(bi, batch(10.0 + bi as f32, 4), &mut b).unwrap();
        }
        assert_eq!(c.kept(), (1, 2));
        for bi in 1..3 {
            let t = c.take(bi, &mut b).unwrap().expect("kept");
            assert_eq!(values(&t), values(&batch(10.0 + bi as f32, 4)));
        }
    }

    #[test]
    fn a_cache_without_host_memory_and_a_larger_batch_give_smaller_buffers_up() {
        let mut b = Budget::new(0, 128, &Device::Cpu).unwrap();
        let mut c = Cache::default();
        c.put(0, batch(0.0, 4), &mut b).unwrap();
        assert_eq!(c.kept(), (0, 0), "the MLP activations never go to the host");
        let mut c = Cache::with_host();
        c.put(0, batch(0.0, 4), &mut b).unwrap();
        c.put(1, batch(1.0, 4), &mut b).unwrap();
        assert_eq!(c.kept(), (0, 2));
        c.take(0, &mut b).unwrap();
        c.take(1, &mut b).unwrap();
        // A length mix: a 128-byte window takes the place of both 64-byte buffers.
        let mut c = Cache::with_host();
        c.put(0, batch(5.0, 8), &mut b).unwrap();
        assert_eq!(c.kept(), (0, 1));
        let t = c.take(0, &mut b).unwrap().expect("kept");
        assert_eq!(values(&t), values(&batch(5.0, 8)));
    }
}
