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

/// Bytes left for the optional per-batch caches.
#[derive(Debug)]
pub struct Budget {
    left: u64,
}

impl Budget {
    pub fn new(bytes: u64) -> Self {
        Self { left: bytes }
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

/// A per-batch cache of a layer's intermediate (mixer outputs or MLP activations): kept while
/// the budget lasts, else left for the pass that needs it to recompute.
#[derive(Default)]
pub struct Cache {
    slots: Vec<Option<Tensor>>,
}

impl Cache {
    /// Keeps batch `bi`'s tensor if `budget` allows.
    pub fn put(&mut self, bi: usize, t: Tensor, budget: &mut Budget) {
        let n = nbytes(&t);
        if self.slots.len() <= bi {
            self.slots.resize(bi + 1, None);
        }
        if n <= budget.left {
            budget.left -= n;
            self.slots[bi] = Some(t);
        }
    }

    /// Batch `bi`'s tensor if it was kept (its bytes go back to `budget`).
    pub fn take(&mut self, bi: usize, budget: &mut Budget) -> Option<Tensor> {
        let t = self.slots.get_mut(bi)?.take()?;
        budget.left += nbytes(&t);
        Some(t)
    }

    /// How many batches are kept.
    #[cfg(test)]
    pub fn kept(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
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
        let mut b = Budget::new(100);
        let mut c = Cache::default();
        c.put(0, t.clone(), &mut b);
        c.put(1, t.clone(), &mut b);
        assert_eq!(c.kept(), 1);
        assert!(c.take(1, &mut b).is_none());
        assert!(c.take(0, &mut b).is_some());
        c.put(2, t, &mut b);
        assert_eq!(c.kept(), 1);
    }
}
