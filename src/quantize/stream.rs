//! The output's shards, written while the layers are solved (issue I, the write stage): a
//! thread beside the layer loop walks the output's tensors in file order, copying the source's
//! tensors (embedding, norms, head, Linears kept in 16 bits) as soon as it reaches them and each
//! quantized Linear's tensors as soon as its layer is in the journal. Shards are hashed while
//! they are written, and their disk writeback is started every [`shards::WRITEBACK_EVERY`]
//! bytes, so when the last layer is done only its tensors and the trailing source tensors are
//! left to write.
//!
//! The shards are byte-identical to what [`shards::write_sharded`] writes from the finished
//! journal (the layout is fixed by the tensor list alone), so a resumed run, which hands the
//! layers it replays to the stream first, writes the same files.

use super::journal::{self, JournalLayer};
use crate::checkpoint::manifest::HashedFile;
use crate::checkpoint::{shards, Checkpoint, TensorSpec};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// A layer whose journal file is complete (its entry in `journal.json`).
pub type LayerReady = JournalLayer;

/// The sending side: the layer loop tells the stream of each layer recorded in the journal.
pub struct StreamFeed {
    tx: Sender<LayerReady>,
    done: Arc<AtomicBool>,
}

impl StreamFeed {
    /// Hands a recorded layer to the stream. Fails when the stream has stopped without
    /// finishing (an error or a panic), so the loop stops early (the stream's own error is what
    /// the run reports, see [`write_stream`]); a stream that has already written everything
    /// (every Linear kept in 16 bits) needs no more layers.
    pub fn layer_done(&self, entry: &JournalLayer) -> Result<()> {
        if self.tx.send(entry.clone()).is_err() && !self.done.load(Ordering::SeqCst) {
            return Err(anyhow::Error::new(WriterStopped));
        }
        Ok(())
    }
}

/// The receiving side, for [`write_stream`].
pub struct StreamInput {
    rx: Receiver<LayerReady>,
    /// Set when every shard is written.
    done: Arc<AtomicBool>,
}

/// The layer loop's error when the shard writer has stopped: the writer's own error says why.
#[derive(Debug)]
pub struct WriterStopped;

impl std::fmt::Display for WriterStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the shard writer stopped")
    }
}

impl std::error::Error for WriterStopped {}

/// A feed and the receiving end for [`write_stream`].
pub fn channel() -> (StreamFeed, StreamInput) {
    let (tx, rx) = std::sync::mpsc::channel();
    let done = Arc::new(AtomicBool::new(false));
    (
        StreamFeed {
            tx,
            done: done.clone(),
        },
        StreamInput { rx, done },
    )
}

/// Writes the shards of `specs` into `dir` (as [`shards::write_sharded`] would, with
/// `max_shard_bytes`), taking each tensor from the source checkpoint `ck` or, for a quantized
/// Linear, from its layer's journal file in `jdir` once `layers` has delivered that layer.
/// Returns the shards, hashed as written. Ends with an error when `layers` closes before a
/// layer it waits for arrives (the layer loop failed).
pub fn write_stream(
    dir: &Path,
    specs: &[TensorSpec],
    max_shard_bytes: u64,
    ck: &Checkpoint,
    jdir: &Path,
    input: StreamInput,
) -> Result<Vec<HashedFile>> {
    let r = write_from(dir, specs, max_shard_bytes, ck, jdir, &input.rx);
    if r.is_ok() {
        input.done.store(true, Ordering::SeqCst);
    }
    r
}

fn write_from(
    dir: &Path,
    specs: &[TensorSpec],
    max_shard_bytes: u64,
    ck: &Checkpoint,
    jdir: &Path,
    layers: &Receiver<LayerReady>,
) -> Result<Vec<HashedFile>> {
    // Layer files delivered and not yet used up, by layer index.
    let mut open: BTreeMap<usize, Checkpoint> = BTreeMap::new();
    let mut last_layer = None;
    shards::write_sharded_synced(
        dir,
        specs,
        max_shard_bytes,
        Some(shards::WRITEBACK_EVERY),
        |spec, w| {
            if ck.contains(&spec.name) {
                w.write_all(ck.bytes(&spec.name)?)?;
                return Ok(());
            }
            let layer = layer_of(&spec.name)?;
            // Layers come in order, so a layer before this one is used up.
            if last_layer != Some(layer) {
                open.retain(|&i, _| i >= layer);
                last_layer = Some(layer);
            }
            while !open.contains_key(&layer) {
                let entry = layers.recv().map_err(|_| {
                    anyhow!("the layer loop ended before layer {layer} was finished")
                })?;
                let file = journal::open_layer_file(jdir, &entry)?;
                open.insert(entry.index, file);
            }
            w.write_all(open[&layer].bytes(&spec.name)?)?;
            Ok(())
        },
    )
}

/// The decoder layer a quantized tensor (`model.layers.{i}.…`) belongs to.
fn layer_of(name: &str) -> Result<usize> {
    let mut parts = name.split('.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("model"), Some("layers"), Some(i)) => i
            .parse()
            .with_context(|| format!("internal: tensor {name} has no layer index")),
        _ => bail!("internal: tensor {name} is neither in the source nor in a layer"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Dtype;
    use crate::quantize::journal::Packed;

    #[test]
    fn layer_index_of_a_tensor_name() {
        assert_eq!(
            layer_of("model.layers.17.mlp.down_proj.qweight").unwrap(),
            17
        );
        assert!(layer_of("lm_head.qweight").is_err());
        assert!(layer_of("model.layers.x.q.qweight").is_err());
    }

    /// The stream, fed layer by layer from another thread, writes the same shards (bytes and
    /// hashes) as the serial writer run on the finished journal; a stream whose feed closes early
    /// fails instead of writing a short shard.
    #[test]
    fn streamed_shards_equal_the_serial_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        // A source with an embedding and a norm, and three layers of one quantized Linear.
        let emb: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let norm: Vec<u8> = (0..64u32).map(|i| (i * 3) as u8).collect();
        let src_specs = vec![
            TensorSpec::new("model.embed_tokens.weight", Dtype::BF16, vec![32, 64]),
            TensorSpec::new("model.norm.weight", Dtype::BF16, vec![32]),
        ];
        shards::write_sharded(&src, &src_specs, u64::MAX, |s, w| {
            w.write_all(if s.name.contains("embed") {
                &emb
            } else {
                &norm
            })?;
            Ok(())
        })
        .unwrap();
        let ck = Checkpoint::open(&src).unwrap();
        let jdir = tmp.path().join("journal");
        std::fs::create_dir_all(&jdir).unwrap();
        let mut entries = vec![];
        let mut specs = vec![src_specs[0].clone()];
        for l in 0..3usize {
            let prefix = format!("model.layers.{l}.mlp.down_proj");
            let p = Packed {
                qweight: (0..64).map(|i| i * 31 + l as i32).collect(),
                qzeros: vec![l as i32; 8],
                scales_f16: vec![l as u8; 32],
                g_idx: (0..16).collect(),
            };
            let (file, sha256) =
                journal::write_layer_file(&jdir, l, &[(prefix.clone(), p)]).unwrap();
            entries.push(JournalLayer {
                index: l,
                file,
                sha256,
                rows: vec![],
                seconds: 0.0,
            });
            for (t, dtype, shape) in [
                ("qweight", Dtype::I32, vec![8, 8]),
                ("qzeros", Dtype::I32, vec![1, 8]),
                ("scales", Dtype::F16, vec![1, 16]),
                ("g_idx", Dtype::I32, vec![16]),
            ] {
                specs.push(TensorSpec::new(format!("{prefix}.{t}"), dtype, shape));
            }
        }
        specs.push(src_specs[1].clone());
        // Small shards, so the stream crosses shard boundaries inside a layer.
        let max = 700;
        let serial_dir = tmp.path().join("serial");
        std::fs::create_dir_all(&serial_dir).unwrap();
        let files: BTreeMap<usize, Checkpoint> = entries
            .iter()
            .map(|e| (e.index, journal::open_layer_file(&jdir, e).unwrap()))
            .collect();
        let want = shards::write_sharded(&serial_dir, &specs, max, |s, w| {
            let bytes = if ck.contains(&s.name) {
                ck.bytes(&s.name)?
            } else {
                files[&layer_of(&s.name)?].bytes(&s.name)?
            };
            w.write_all(bytes)?;
            Ok(())
        })
        .unwrap();
        assert!(want.len() > 2, "the test needs several shards");

        let stream_dir = tmp.path().join("stream");
        std::fs::create_dir_all(&stream_dir).unwrap();
        let (feed, rx) = channel();
        let got = std::thread::scope(|s| {
            let h = s.spawn(|| write_stream(&stream_dir, &specs, max, &ck, &jdir, rx));
            for e in &entries {
                std::thread::sleep(std::time::Duration::from_millis(5));
                feed.layer_done(e).unwrap();
            }
            drop(feed);
            h.join().unwrap()
        })
        .unwrap();
        assert_eq!(got, want);
        for f in &want {
            assert_eq!(
                std::fs::read(serial_dir.join(&f.name)).unwrap(),
                std::fs::read(stream_dir.join(&f.name)).unwrap(),
                "{}",
                f.name
            );
        }
        assert_eq!(
            std::fs::read(serial_dir.join("model.safetensors.index.json")).unwrap(),
            std::fs::read(stream_dir.join("model.safetensors.index.json")).unwrap()
        );

        // The feed closes after layer 0: the stream stops with an error naming layer 1.
        let short_dir = tmp.path().join("short");
        std::fs::create_dir_all(&short_dir).unwrap();
        let (feed, rx) = channel();
        feed.layer_done(&entries[0]).unwrap();
        drop(feed);
        let e = write_stream(&short_dir, &specs, max, &ck, &jdir, rx).unwrap_err();
        assert!(format!("{e:#}").contains("before layer 1"), "{e:#}");

        // A stream with nothing to wait for (every Linear kept in 16 bits) ends on its own; the
        // loop may still hand it layers. A stream that failed stops the loop.
        let (feed, input) = channel();
        let all_src = tmp.path().join("all_src");
        std::fs::create_dir_all(&all_src).unwrap();
        write_stream(&all_src, &src_specs, max, &ck, &jdir, input).unwrap();
        feed.layer_done(&entries[0]).unwrap();
        let (feed, input) = channel();
        assert!(write_stream(&tmp.path().join("missing"), &specs, max, &ck, &jdir, input).is_err());
        let e = feed.layer_done(&entries[0]).unwrap_err();
        assert!(e.is::<WriterStopped>(), "{e:#}");
    }
}
