//! The resume journal inside `<out>.partial/journal/`: one safetensors file per finished layer
//! (its packed quantized tensors) and `journal.json` with the hashes of everything that
//! determines the result (config, source weights, calibration windows, settings) and the report
//! rows of each finished layer. The hidden states are not stored: a resumed run regenerates them
//! by replaying the finished layers with their stored weights, which reproduces them exactly.

use super::hashes::Hashes;
use super::report::ModuleRow;
use super::settings::{flag_name, Recorded};
use crate::checkpoint::manifest::{self, sha256_file};
use crate::checkpoint::{files, shards, Checkpoint, Dtype, TensorSpec};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

const JOURNAL_FILE: &str = "journal.json";
const JOURNAL_VERSION: u32 = 1;

/// Packed tensors of one quantized Linear, as stored in the journal and the checkpoint.
pub struct Packed {
    pub qweight: Vec<i32>,
    pub qzeros: Vec<i32>,
    pub scales_f16: Vec<u8>,
    pub g_idx: Vec<i32>,
}

/// The shards' SHA-256 by file name, and the seconds the checks took.
type SourceSums = (BTreeMap<String, String>, f64);

/// The source checks of a run on a thread of their own: every weight finite, and the shards'
/// SHA-256 (for the journal and the report), checked against the hub cache's blob names or a
/// manifest. They read all of the source once, beside the setup and the first layer; the journal
/// takes the hashes before it is first saved, and a resumed run waits for them before it compares
/// its journal.
pub struct SourceChecks {
    handle: Option<std::thread::JoinHandle<Result<SourceSums>>>,
    /// What the checks found wrong, once they have finished (kept: every later call fails too).
    failed: Option<String>,
    /// How long the checks took on their thread.
    pub seconds: f64,
    /// How long the run waited for them.
    pub waited: f64,
}

impl SourceChecks {
    pub fn start(dir: &Path) -> Self {
        let dir = dir.to_path_buf();
        let handle = std::thread::spawn(move || {
            let t = std::time::Instant::now();
            let ck = Checkpoint::open(&dir)?;
            let (finite, sums) = rayon::join(|| ck.check_finite(), || manifest::shard_sha256(&ck));
            finite?;
            let sums = sums?;
            crate::source::verify_shards(&dir, &sums)?;
            Ok((sums, t.elapsed().as_secs_f64()))
        });
        Self {
            handle: Some(handle),
            failed: None,
            seconds: 0.0,
            waited: 0.0,
        }
    }

    /// The shards' hashes the first time (waiting for the checks if they are still running),
    /// `None` after that; the checks' error, if they failed, every time.
    pub fn finish(&mut self) -> Result<Option<BTreeMap<String, String>>> {
        if let Some(e) = &self.failed {
            bail!("{e}");
        }
        let Some(h) = self.handle.take() else {
            return Ok(None);
        };
        let t = std::time::Instant::now();
        let r = h
            .join()
            .map_err(|_| anyhow::anyhow!("the source check thread panicked"))
            .and_then(|r| r);
        self.waited = t.elapsed().as_secs_f64();
        match r {
            Ok((sums, seconds)) => {
                self.seconds = seconds;
                Ok(Some(sums))
            }
            Err(e) => {
                let text = format!("{e:#}");
                self.failed = Some(text.clone());
                bail!("{text}")
            }
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JournalLayer {
    pub index: usize,
    pub file: String,
    pub sha256: String,
    pub rows: Vec<ModuleRow>,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Journal {
    pub version: u32,
    pub hashes: Hashes,
    /// The settings `hashes.settings_sha256` was taken of, so that a refused `--resume` can name
    /// the setting that changed (absent from journals of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<serde_json::Value>,
    pub layers: Vec<JournalLayer>,
}

impl Journal {
    pub fn new(hashes: Hashes, settings: &Recorded) -> Result<Self> {
        Ok(Self {
            version: JOURNAL_VERSION,
            hashes,
            settings: Some(serde_json::to_value(settings)?),
            layers: vec![],
        })
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let p = dir.join(JOURNAL_FILE);
        let text = std::fs::read_to_string(&p)
            .with_context(|| format!("cannot resume: {} is missing", p.display()))?;
        let j: Journal = serde_json::from_str(&text)
            .with_context(|| format!("cannot resume: {} is not a valid journal", p.display()))?;
        if j.version != JOURNAL_VERSION {
            bail!(
                "cannot resume: {} has journal version {}, this tool writes {JOURNAL_VERSION}",
                p.display(),
                j.version
            );
        }
        Ok(j)
    }

    /// Written to a temporary file and renamed, so a crash never leaves a torn journal.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        files::write_atomic(&dir.join(JOURNAL_FILE), |tmp| {
            Ok(std::fs::write(tmp, &text)?)
        })
        .with_context(|| format!("cannot update the journal in {}", dir.display()))
    }

    /// The finished layers must be layers 0, 1, 2, ... of this model, in order, each in its own
    /// `layer-NNNNN/` file: anything else is a damaged journal (refused, never indexed blindly).
    pub fn check_layers(&self, dir: &Path, num_layers: usize) -> Result<()> {
        let p = dir.join(JOURNAL_FILE);
        if self.layers.len() > num_layers {
            bail!(
                "cannot resume: {} lists {} finished layers, but the model has {num_layers}; the \
                 journal is damaged: start again without --resume (--force discards it)",
                p.display(),
                self.layers.len()
            );
        }
        for (i, l) in self.layers.iter().enumerate() {
            let prefix = format!("layer-{i:05}/");
            if l.index != i || !l.file.starts_with(&prefix) || l.file[prefix.len()..].contains('/')
            {
                bail!(
                    "cannot resume: entry {i} of {} is layer {} in {:?}, expected layer {i} in \
                     {prefix}; the journal is damaged: start again without --resume (--force \
                     discards it)",
                    p.display(),
                    l.index,
                    l.file
                );
            }
        }
        Ok(())
    }

    /// Refuses to resume when anything that determines the output has changed, naming it (for
    /// the settings, each one that differs, where the journal holds them).
    pub fn check_matches(&self, now: &Hashes, settings: &Recorded) -> Result<()> {
        let h = &self.hashes;
        let what = if h.tool_version != now.tool_version {
            format!(
                "the tool version changed ({} → {})",
                h.tool_version, now.tool_version
            )
        } else if h.config_sha256 != now.config_sha256 {
            "the model's config.json changed".to_string()
        } else if h.source_sha256 != now.source_sha256 {
            "the source weights changed".to_string()
        } else if h.settings_sha256 != now.settings_sha256 {
            let diffs = match &self.settings {
                Some(then) => settings_diff(then, &serde_json::to_value(settings)?),
                None => vec![],
            };
            if diffs.is_empty() {
                "the quantization settings differ from the interrupted run (use the same flags)"
                    .to_string()
            } else {
                format!(
                    "the quantization settings differ from the interrupted run: {} (use the \
                     same flags)",
                    diffs.join("; ")
                )
            }
        } else if h.calibration_sha256 != now.calibration_sha256 {
            "the calibration data changed".to_string()
        } else {
            return Ok(());
        };
        bail!("cannot resume: {what}; start again without --resume (add --force if --out exists)")
    }
}

/// Every setting that differs between `then` (the journal's) and `now`, with both values; for
/// `--plan`, the first modules whose bits, group size or 16 bits differ.
fn settings_diff(then: &serde_json::Value, now: &serde_json::Value) -> Vec<String> {
    let (Some(a), Some(b)) = (then.as_object(), now.as_object()) else {
        return vec![];
    };
    let show = |key: &str, v: Option<&serde_json::Value>| -> String {
        match (key, v) {
            ("refit", None) => "false".into(),
            ("plan", None) => "no plan".into(),
            (_, None) => "not set".into(),
            (_, Some(serde_json::Value::String(s))) => s.clone(),
            (_, Some(v)) => v.to_string(),
        }
    };
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let name = flag_name(k);
            if k == "plan" {
                let entries = |v: Option<&serde_json::Value>| -> BTreeMap<String, String> {
                    v.and_then(|v| v.as_array())
                        .into_iter()
                        .flatten()
                        .filter_map(|e| e.as_str()?.split_once('='))
                        .map(|(m, s)| (m.to_string(), s.to_string()))
                        .collect()
                };
                let (x, y) = (entries(a.get(k)), entries(b.get(k)));
                let modules: std::collections::BTreeSet<&String> =
                    x.keys().chain(y.keys()).collect();
                let changed: Vec<String> = modules
                    .into_iter()
                    .filter(|m| x.get(*m) != y.get(*m))
                    .map(|m| {
                        let s = |v: Option<&String>| v.map_or("default".to_string(), |s| s.clone());
                        format!("{m} {} then, {} now", s(x.get(m)), s(y.get(m)))
                    })
                    .collect();
                let more = changed.len().saturating_sub(3);
                format!(
                    "{name} ({}{})",
                    changed[..changed.len().min(3)].join(", "),
                    if more > 0 {
                        format!(", and {more} more module(s)")
                    } else {
                        String::new()
                    }
                )
            } else {
                format!(
                    "{name} ({} then, {} now)",
                    show(k, a.get(k)),
                    show(k, b.get(k))
                )
            }
        })
        .collect()
}

pub fn write_layer_file(
    dir: &Path,
    layer: usize,
    packed: &[(String, Packed)],
) -> Result<(String, String)> {
    let sub = dir.join(format!("layer-{layer:05}"));
    if sub.exists() {
        std::fs::remove_dir_all(&sub)?;
    }
    std::fs::create_dir_all(&sub)?;
    let mut specs = vec![];
    let mut data: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (prefix, p) in packed {
        for (name, dtype, bytes) in [
            (
                "qweight",
                Dtype::I32,
                crate::format::i32_to_le_bytes(&p.qweight),
            ),
            (
                "qzeros",
                Dtype::I32,
                crate::format::i32_to_le_bytes(&p.qzeros),
            ),
            ("scales", Dtype::F16, p.scales_f16.clone()),
            (
                "g_idx",
                Dtype::I32,
                crate::format::i32_to_le_bytes(&p.g_idx),
            ),
        ] {
            let full = format!("{prefix}.{name}");
            let numel = bytes.len() / dtype.size();
            specs.push(TensorSpec::new(full.clone(), dtype, vec![numel]));
            data.insert(full, bytes);
        }
    }
    let files = shards::write_sharded(&sub, &specs, u64::MAX, |spec, w| {
        w.write_all(&data[&spec.name])?;
        Ok(())
    })?;
    let rel = format!("layer-{layer:05}/{}", files[0].name);
    Ok((rel, files[0].sha256.clone()))
}

/// Opens a finished layer's file, checking it against the hash the journal recorded.
pub fn open_layer_file(dir: &Path, entry: &JournalLayer) -> Result<Checkpoint> {
    let path = dir.join(&entry.file);
    let sha = sha256_file(&path)
        .with_context(|| format!("cannot resume: journal file {} is missing", path.display()))?;
    if sha != entry.sha256 {
        bail!(
            "cannot resume: journal file {} is corrupted (SHA-256 differs from journal.json)",
            path.display()
        );
    }
    let parent = path.parent().unwrap();
    Checkpoint::open_files(
        parent,
        &[path.file_name().unwrap().to_string_lossy().into_owned()],
    )
}

pub fn read_packed(ck: &Checkpoint, prefix: &str) -> Result<Packed> {
    Ok(Packed {
        qweight: ck.i32_data(&format!("{prefix}.qweight"))?,
        qzeros: ck.i32_data(&format!("{prefix}.qzeros"))?,
        scales_f16: ck.bytes(&format!("{prefix}.scales"))?.to_vec(),
        g_idx: ck.i32_data(&format!("{prefix}.g_idx"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_refused_resume_names_each_setting_that_differs() {
        let then = json!({"method": "gptaq", "gptaq_alpha": 1.0, "bits": 4, "seed": 0,
            "plan": ["model.layers.0.mlp.down_proj=8/128", "model.layers.1.mlp.up_proj=keep"]});
        let now = json!({"method": "gptaq", "gptaq_alpha": 0.5, "bits": 4, "seed": 0,
            "plan": ["model.layers.0.mlp.down_proj=4/64", "model.layers.1.mlp.up_proj=keep"]});
        let d = settings_diff(&then, &now);
        assert_eq!(
            d,
            [
                "--gptaq-alpha (1.0 then, 0.5 now)",
                "--plan (model.layers.0.mlp.down_proj 8/128 then, 4/64 now)"
            ]
        );
        let mut no_plan = now.clone();
        no_plan.as_object_mut().unwrap().remove("plan");
        no_plan["refit"] = json!(true);
        let d = settings_diff(&now, &no_plan).join("; ");
        assert!(
            d.contains("--plan (model.layers.0.mlp.down_proj 4/64 then, default now")
                && d.contains("--refit (false then, true now)"),
            "{d}"
        );
    }
}
