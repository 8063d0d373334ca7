//! `inspect DIR`: what a checkpoint holds (architecture, layer kinds, parameters, bytes, dtypes)
//! and whether it is consistent (every tensor the config implies, with the right shape, and the
//! manifest hashes when a manifest is present). A failed check is an error (exit 1).

pub mod quantized;

use crate::checkpoint::manifest::{verify_manifest, MANIFEST_FILE};
use crate::checkpoint::Checkpoint;
use crate::model::{AnyConfig, MixerKind};
use anyhow::{bail, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Serialize)]
pub struct InspectReport {
    pub dir: String,
    pub architecture: String,
    /// `minicpm-sala`, `llama`, `mistral`, `qwen2` or `minicpm`.
    pub family: String,
    pub layers: usize,
    /// Per layer: `minicpm4` / `lightning-attn` (MiniCPM-SALA) or `attention` (dense families).
    pub mixer_types: Vec<String>,
    pub sparse_layers: Vec<usize>,
    pub lightning_layers: Vec<usize>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub parameters: u64,
    pub tensor_bytes: u64,
    pub tensors: usize,
    pub shards: Vec<String>,
    pub dtypes: BTreeMap<String, usize>,
    pub manifest: Option<String>,
    /// Whether SGLang, vLLM and transformers would load the folder (emulated).
    pub engines: Vec<crate::engine::LoadSummary>,
    pub warnings: Vec<String>,
    pub valid: bool,
}

pub fn inspect(dir: &Path) -> Result<InspectReport> {
    let cfg = AnyConfig::from_file(&dir.join("config.json"))?;
    let ck = Checkpoint::open(dir)?;
    ck.validate_exact(&cfg.expected_tensors())?;
    ck.check_finite()?;
    let mut dtypes = BTreeMap::new();
    let (mut params, mut bytes) = (0u64, 0u64);
    for (_, e) in ck.entries() {
        *dtypes.entry(e.dtype.name().to_string()).or_insert(0) += 1;
        params += e.numel() as u64;
        bytes += e.nbytes() as u64;
    }
    let manifest = if dir.join(MANIFEST_FILE).is_file() {
        let problems = verify_manifest(dir)?;
        if !problems.is_empty() {
            bail!(
                "{} does not match the files in {}:\n  {}",
                MANIFEST_FILE,
                dir.display(),
                problems.join("\n  ")
            );
        }
        Some("all files match".to_string())
    } else {
        None
    };
    let n = cfg.num_hidden_layers();
    let (architecture, mixer_types, sparse_layers, lightning_layers) = match &cfg {
        AnyConfig::Sala(c) => {
            let kinds: Vec<_> = (0..n).map(|i| c.mixer(i)).collect();
            let with = |k: MixerKind| (0..n).filter(|&i| kinds[i] == k).collect::<Vec<_>>();
            (
                c.architectures.join(","),
                kinds.iter().map(|k| k.name().to_string()).collect(),
                with(MixerKind::Sparse),
                with(MixerKind::Lightning),
            )
        }
        AnyConfig::Dense(_) => (
            cfg.architecture().to_string(),
            vec!["attention".to_string(); n],
            vec![],
            vec![],
        ),
    };
    Ok(InspectReport {
        dir: dir.display().to_string(),
        architecture,
        family: cfg.family().to_string(),
        layers: n,
        mixer_types,
        sparse_layers,
        lightning_layers,
        hidden_size: cfg.hidden_size(),
        intermediate_size: cfg.intermediate_size(),
        vocab_size: cfg.vocab_size(),
        parameters: params,
        tensor_bytes: bytes,
        tensors: ck.names().count(),
        shards: ck.shard_file_names(),
        dtypes,
        manifest,
        engines: crate::engine::summaries(dir)?,
        warnings: derived_key_warnings(dir),
        valid: true,
    })
}

/// A config.json that carries keys the engines' config classes derive (SGLang's
/// `has_sparse_attention`, `sparse_layer_ids`, ...) fails to load there: flagged for any folder.
pub fn derived_key_warnings(dir: &Path) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return vec![];
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return vec![];
    };
    let keys = crate::engine::config::derived_keys(&v);
    if keys.is_empty() {
        return vec![];
    }
    vec![format!(
        "{} carries {keys:?}, which SGLang's MiniCPMHybridConfig defines as read-only properties: \
         loading fails there with \"can't set attribute\"; soar-gptq leaves them out of every \
         output it writes",
        dir.join("config.json").display()
    )]
}

impl InspectReport {
    pub fn print_text(&self) {
        crate::outln!("model          {}", self.dir);
        crate::outln!("architecture   {}", self.architecture);
        if self.family == "minicpm-sala" {
            crate::outln!(
                "layers         {} ({} sparse: {:?}; {} lightning)",
                self.layers,
                self.sparse_layers.len(),
                self.sparse_layers,
                self.lightning_layers.len()
            );
        } else {
            crate::outln!(
                "layers         {} (dense softmax attention, {} family)",
                self.layers,
                self.family
            );
        }
        crate::outln!(
            "dims           hidden {}, intermediate {}, vocab {}",
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size
        );
        crate::outln!(
            "parameters     {} ({:.2} GB of tensor data)",
            self.parameters,
            self.tensor_bytes as f64 / 1e9
        );
        let d: Vec<String> = self
            .dtypes
            .iter()
            .map(|(k, v)| format!("{k} x{v}"))
            .collect();
        crate::outln!(
            "tensors        {} in {} shard(s); dtypes {}",
            self.tensors,
            self.shards.len(),
            d.join(", ")
        );
        if let Some(m) = &self.manifest {
            crate::outln!("manifest       {m}");
        }
        crate::outln!(
            "validation     ok: every tensor the config implies is present with the right shape"
        );
        crate::engine::print_summaries(&self.engines, &self.dir);
        for w in &self.warnings {
            crate::outln!("warning        {w}");
        }
    }
}
