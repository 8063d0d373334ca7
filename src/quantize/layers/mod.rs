//! The layer loop of `quantize`: embed the calibration windows, replay the layers a journal
//! already holds, then for each remaining layer accumulate the Hessians of each true-sequential
//! subset, solve and pack its Linears, put the decoded weights back and run the layer forward so
//! the next one sees the quantized model (`pass.rs`). The activations live where the residency
//! plan puts them (`store.rs`); the next layer's weights are made ready beside the current one
//! (`loader.rs`); each finished layer's file is packed (`decode.rs`) and written on a background
//! thread while the next layer computes.

mod decode;
mod loader;
mod pass;
pub mod store;

use super::journal::{self, Journal, JournalLayer, SourceChecks};
use super::plan::Plan;
use super::stages::StageSeconds;
use super::stream::StreamFeed;
use super::{Compute, ModuleRow, Settings};
use crate::checkpoint::guard::InputPath;
use crate::checkpoint::Checkpoint;
use crate::gptq::QuantParams;
use crate::model::AnyConfig;
use crate::scheme::QuantFormat;
use anyhow::{anyhow, bail, Context, Result};
use loader::{layer_tensor_names, LayerLoader};
use pass::{LayerResult, Pass};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What every layer of one run reads: the options, the model and its checkpoint, the
/// calibration windows, the plan (each Linear's scheme, or kept in 16 bits) and the journal
/// folder.
pub(super) struct LayerRun<'a> {
    pub opts: &'a Settings,
    /// The device and precisions the flags resolved to.
    pub compute: &'a Compute,
    pub cfg: &'a AnyConfig,
    pub ck: &'a Checkpoint,
    pub windows: &'a [Vec<u32>],
    pub plan: &'a Plan,
    pub format: QuantFormat,
    pub quant: QuantParams,
    pub jdir: &'a Path,
    /// The shard stream, told of each layer as it is recorded (replayed layers first).
    pub feed: &'a StreamFeed,
    /// Where the activations live (docs/algorithm.md, Streaming the calibration).
    pub residency: store::Residency,
    /// The folder for hidden states spilled to disk.
    pub spill: PathBuf,
    /// Every input of the run, which no `--save-hessians` file may be.
    pub inputs: &'a [InputPath],
}

impl LayerRun<'_> {
    /// Quantizes the layers the journal does not hold yet, recording each in it. Whatever
    /// happens, a layer that finished is recorded, so `--resume` can continue after it.
    /// The source checks hand the journal their hashes before it is first saved.
    pub fn run(
        &self,
        journal: &mut Journal,
        stages: &mut StageSeconds,
        checks: &mut SourceChecks,
    ) -> Result<()> {
        for entry in &journal.layers {
            self.feed.layer_done(entry)?;
        }
        let mut pending = None;
        let r = self.run_pending(journal, stages, &mut pending, checks);
        let flushed = flush_pending(&mut pending, journal, self.jdir, self.feed, checks);
        r.and(flushed)
    }

    fn run_pending(
        &self,
        journal: &mut Journal,
        stages: &mut StageSeconds,
        pending: &mut Option<PendingLayer>,
        checks: &mut SourceChecks,
    ) -> Result<()> {
        let mut pass = Pass::start(self, stages)?;
        let mut loader = LayerLoader::new(&self.compute.device, self.cfg, self.ck)?;
        for entry in journal.layers.clone() {
            pass.replay(&entry)?;
        }
        for i in journal.layers.len()..self.cfg.num_hidden_layers() {
            if self.opts.stop_after_layers.is_some_and(|n| i >= n) {
                bail!("stopped after {i} layer(s) as requested (--stop-after-layers)");
            }
            crate::fault::point("a layer starts");
            let t_layer = Instant::now();
            // The next layer's weights are made ready beside this layer's work (GPU: copied to
            // page-locked memory; CPU: its pages mapped in), so loading it is a plain copy.
            let next =
                (i + 1 < self.cfg.num_hidden_layers()).then(|| layer_tensor_names(self.cfg, i + 1));
            let (cur, nxt) = loader.split(i);
            let LayerResult { rows, quantized } = std::thread::scope(|s| {
                let ready = next.map(|names| {
                    let ck = self.ck;
                    s.spawn(move || LayerLoader::prepare(nxt, ck, &names))
                });
                let r = pass.quantize_layer(i, cur);
                // A stage that could not be filled only means the next layer loads from the
                // checkpoint.
                let staged = ready.is_some_and(|h| matches!(h.join(), Ok(Ok(true))));
                r.map(|r| (r, staged))
            })
            .map(|(r, staged)| {
                loader.held = if staged { i + 1 } else { usize::MAX };
                r
            })?;
            // The previous layer's file was written while this layer computed.
            flush_pending(pending, journal, self.jdir, self.feed, checks)?;
            pass.stages.journal += pass.clock.lap()?;
            let dir = self.jdir.to_path_buf();
            let format = self.format;
            *pending = Some(PendingLayer {
                index: i,
                rows,
                seconds: t_layer.elapsed().as_secs_f64(),
                // Packed and written beside the next layer's computation.
                write: std::thread::spawn(move || {
                    let packed = quantized
                        .iter()
                        .map(|(name, q, bits)| {
                            Ok((
                                name.clone(),
                                decode::pack(q, *bits, format)
                                    .with_context(|| format!("packing {name}"))?,
                            ))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    journal::write_layer_file(&dir, i, &packed)
                }),
            });
            pass.pb.inc(1);
            crate::fault::delay("SOAR_GPTQ_TEST_LAYER_DELAY_MS");
        }
        pass.pb.finish_and_clear();
        Ok(())
    }
}

/// A finished layer whose journal file is being written (and hashed) on a background thread
/// while the next layer computes.
struct PendingLayer {
    index: usize,
    rows: Vec<ModuleRow>,
    seconds: f64,
    write: std::thread::JoinHandle<Result<(String, String)>>,
}

/// Waits for the pending layer's file, records the layer in the journal and hands it to the
/// shard stream.
fn flush_pending(
    pending: &mut Option<PendingLayer>,
    journal: &mut Journal,
    jdir: &Path,
    feed: &StreamFeed,
    checks: &mut SourceChecks,
) -> Result<()> {
    if let Some(p) = pending.take() {
        let (file, sha256) = p
            .write
            .join()
            .map_err(|_| anyhow!("the journal writer thread panicked"))??;
        // A damaged source is not journaled.
        let sums = checks.finish()?;
        journal.layers.push(JournalLayer {
            index: p.index,
            file,
            sha256,
            rows: p.rows,
            seconds: p.seconds,
        });
        if let Some(sums) = sums {
            journal.hashes.source_sha256 = sums;
        }
        journal.save(jdir)?;
        feed.layer_done(journal.layers.last().expect("just pushed"))?;
    }
    Ok(())
}
