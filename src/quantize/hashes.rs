//! The hashes that pin down a quantize run's output: the source's config and shards, the
//! settings and the calibration windows, and the tool's version. The journal compares them on
//! `--resume`; the report records them.

use super::Recorded;
use crate::checkpoint::manifest::{self, sha256_file};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Hashes {
    pub config_sha256: String,
    /// SHA-256 of every safetensors file of the source model.
    pub source_sha256: BTreeMap<String, String>,
    pub calibration_sha256: String,
    pub settings_sha256: String,
    pub tool_version: String,
}

impl Hashes {
    /// The hashes of a run: the source shards' (from [`source_sha256`]), its config's, the
    /// settings' and the calibration's.
    pub fn new(
        src_dir: &Path,
        source_sha256: BTreeMap<String, String>,
        settings: &Recorded,
        calibration_sha256: &str,
    ) -> Result<Self> {
        let settings_json = serde_json::to_vec(settings)?;
        Ok(Self {
            config_sha256: sha256_file(&src_dir.join("config.json"))?,
            source_sha256,
            calibration_sha256: calibration_sha256.to_string(),
            settings_sha256: manifest::hex(&Sha256::digest(&settings_json)),
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
        })
    }
}
