//! `export-calib`: the calibration windows `quantize` would draw, written as token ids so that
//! another quantizer can calibrate on exactly the same tokens (docs/calibration.md, Exporting
//! the windows). The file's `calibration_sha256` equals the one `quantize` records in its
//! report and `quantization_config` for the same model, sources, count, lengths and seed.

use super::{build_windows, load_sources, CalibSet, CalibSpec, ChatFormat, SeqLen};
use anyhow::{anyhow, Result};
use serde::Serialize;
use std::path::Path;

/// What names the windows: the sources, their count and lengths, and the seed.
pub struct Request<'a> {
    pub calib: &'a [CalibSpec],
    pub nsamples: usize,
    pub seqlen: SeqLen,
    pub seed: u64,
}

/// The exported file: the request, each source's share and the windows.
#[derive(Serialize)]
pub struct Exported<'a> {
    pub format: &'static str,
    pub version: u32,
    pub model: &'a str,
    pub calib: Vec<String>,
    pub nsamples: usize,
    pub seqlen: String,
    pub seed: u64,
    pub calibration_sha256: &'a str,
    pub tokens: usize,
    pub sources: &'a [super::SourceUsage],
    pub windows: &'a [Vec<u32>],
}

/// The windows `quantize` draws for `req` from the model folder `dir` (its tokenizer and chat
/// template) whose vocabulary holds `vocab_size` ids. The caller checks the lengths against the
/// model's config, as `quantize` does.
pub fn windows(dir: &Path, vocab_size: usize, req: &Request) -> Result<CalibSet> {
    let tokenizer = super::load_tokenizer(dir)?;
    let chat = ChatFormat::from_model_dir(dir)?;
    let sources = load_sources(req.calib, &chat)?;
    build_windows(
        &sources,
        &tokenizer,
        vocab_size,
        req.nsamples,
        req.seqlen,
        req.seed,
    )
}

/// The JSON document of `set`: one window per line, so that the file diffs and greps well.
pub fn to_json(model: &str, req: &Request, set: &CalibSet) -> Result<String> {
    let doc = Exported {
        format: "soar-gptq calibration windows",
        version: 1,
        model,
        calib: req
            .calib
            .iter()
            .map(|c| format!("{}:{}", c.path, c.weight))
            .collect(),
        nsamples: req.nsamples,
        seqlen: req.seqlen.to_string(),
        seed: req.seed,
        calibration_sha256: &set.sha256,
        tokens: set.windows.iter().map(Vec::len).sum(),
        sources: &set.usage,
        windows: &[],
    };
    let head = serde_json::to_string_pretty(&doc)?;
    // The (empty) windows are the last field: put the windows in one per line.
    let head = head
        .strip_suffix("[]\n}")
        .ok_or_else(|| anyhow!("internal: unexpected JSON layout"))?;
    let mut s = String::with_capacity(head.len() + set.windows.len() * 16);
    s.push_str(head);
    s.push_str("[\n");
    for (i, w) in set.windows.iter().enumerate() {
        s.push_str("    ");
        s.push_str(&serde_json::to_string(w)?);
        s.push_str(if i + 1 < set.windows.len() {
            ",\n"
        } else {
            "\n"
        });
    }
    s.push_str("  ]\n}\n");
    Ok(s)
}
