//! Where each decoder layer's weights come from: the checkpoint, or (on a GPU) a page-locked
//! stage a thread filled with the layer while the previous one computed.

use crate::checkpoint::Checkpoint;
use crate::model::AnyConfig;
use anyhow::Result;
use candle_core::Device;

/// A page-locked copy of a decoder layer's weights (`kernels::transfer::PinnedStage`); without
/// the `cuda` feature a type that is never made.
#[cfg(feature = "cuda")]
pub(super) type PinnedStage = crate::kernels::transfer::PinnedStage;

#[cfg(not(feature = "cuda"))]
pub(super) enum PinnedStage {}

#[cfg(not(feature = "cuda"))]
impl PinnedStage {
    fn fill(&mut self, _: &[(String, &[u8])]) -> Result<()> {
        match *self {}
    }
    pub(super) fn upload(
        &self,
        _: &Device,
        _: &str,
        _: candle_core::DType,
        _: &[usize],
    ) -> Result<Option<candle_core::Tensor>> {
        match *self {}
    }
}

/// Where each layer's weights come from. On a GPU two page-locked stages take turns: while
/// layer i computes from one, a thread copies layer i + 1 into the other, so its load is one DMA
/// per tensor (the driver's copy of pageable, mapped memory ran at ~8 GB/s). On the CPU the
/// thread maps the next layer's pages in.
pub(super) struct LayerLoader {
    pinned_stages: Option<[PinnedStage; 2]>,
    /// The layer the stage for the next `split` holds (none yet: the first layer loads from the
    /// checkpoint).
    pub(super) held: usize,
}

impl LayerLoader {
    pub(super) fn new(device: &Device, cfg: &AnyConfig, ck: &Checkpoint) -> Result<Self> {
        let pinned_stages = if device.is_cuda() {
            let mut bytes = 0usize;
            for i in 0..cfg.num_hidden_layers() {
                let mut sum = 0;
                for name in layer_tensor_names(cfg, i) {
                    sum += ck.bytes(&name)?.len();
                }
                bytes = bytes.max(sum);
            }
            // Without page-locked memory (a memlock limit, say) layers load from the checkpoint.
            Self::pinned(device, bytes).unwrap_or(None)
        } else {
            None
        };
        Ok(Self {
            pinned_stages,
            held: usize::MAX,
        })
    }

    #[cfg(feature = "cuda")]
    fn pinned(device: &Device, bytes: usize) -> Result<Option<[PinnedStage; 2]>> {
        Ok(Some([
            PinnedStage::new(device, bytes)?,
            PinnedStage::new(device, bytes)?,
        ]))
    }

    #[cfg(not(feature = "cuda"))]
    fn pinned(_: &Device, _: usize) -> Result<Option<[PinnedStage; 2]>> {
        Ok(None)
    }

    /// The stage layer `i` reads from (if it holds layer i) and the one to fill with layer i + 1.
    pub(super) fn split(&mut self, i: usize) -> (Option<&PinnedStage>, Option<&mut PinnedStage>) {
        let held = self.held;
        match &mut self.pinned_stages {
            Some([a, b]) => {
                let (cur, next) = if i.is_multiple_of(2) { (a, b) } else { (b, a) };
                ((held == i).then_some(&*cur), Some(next))
            }
            None => (None, None),
        }
    }

    /// Makes the layer whose tensors are `names` ready: copied into `stage`, or (no stage) its
    /// pages mapped in. Runs beside the computation. Returns whether a stage was filled.
    pub(super) fn prepare(
        stage: Option<&mut PinnedStage>,
        ck: &Checkpoint,
        names: &[String],
    ) -> Result<bool> {
        match stage {
            Some(st) => {
                let tensors = names
                    .iter()
                    .map(|n| Ok((n.clone(), ck.bytes(n)?)))
                    .collect::<Result<Vec<_>>>()?;
                st.fill(&tensors)?;
                Ok(true)
            }
            None => {
                for n in names {
                    ck.prefault(n)?;
                }
                Ok(false)
            }
        }
    }
}

/// The full names (`model.layers.{i}.…`) of decoder layer `i`'s tensors.
pub(super) fn layer_tensor_names(cfg: &AnyConfig, i: usize) -> Vec<String> {
    cfg.layer_tensors(i)
        .into_iter()
        .map(|(n, _)| format!("model.layers.{i}.{n}"))
        .collect()
}
