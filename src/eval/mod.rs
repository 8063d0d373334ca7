//! Perplexity with one documented protocol (docs/algorithm.md, Perplexity protocol): tokenize the
//! whole text once without special tokens, cut non-overlapping windows of `seqlen` tokens, drop the
//! tail, score every next-token prediction inside each window, ppl = exp(mean NLL). With `bos`,
//! each window is BOS followed by the next seqlen−1 text tokens and every text token in it is
//! scored.
//!
//! The model runs layer by layer over all windows (one decoder layer's weights in memory at a
//! time), then the head runs on a few thousand positions at a time (`score.rs`), so logits are
//! never stored for more than that; scores are kept per position, for the position ranges of the
//! report and the plot (`plot.rs`).

pub mod plot;
pub mod score;

use crate::checkpoint::Checkpoint;
use crate::format::quantized::{
    read_module_codes, read_quant_info, validate_quantized_modules, QuantInfo, QuantModule,
};
use crate::model::{AnyConfig, AnyLayer, AnyModel, SparseAttention};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
pub use score::{batch_nll, log_probs, PositionSums, RangeScore};
use std::collections::BTreeMap;
use std::path::Path;

/// Evaluation text compiled into the binary (`--data default`): held out from calibration and
/// from the fixture model's training text.
pub const DEFAULT_EVAL_TEXT: &str = include_str!("../../calibration/eval/sotu-2000-2021.txt");

#[derive(Debug, Clone)]
pub struct PplOptions {
    pub seqlen: usize,
    pub max_windows: Option<usize>,
    pub bos: bool,
    pub dtype: DType,
    pub device: Device,
    /// Windows per forward batch.
    pub batch: usize,
    /// When MiniCPM-SALA's sparse layers run InfLLM-v2 (`--sparse-attention`).
    pub sparse_attention: SparseAttention,
    /// What the text is, for messages: `--data FILE`, or the built-in text.
    pub text_name: String,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PplReport {
    pub ppl: f64,
    pub nll: f64,
    pub tokens: usize,
    pub windows: usize,
    pub seqlen: usize,
    /// `auto`, `always` or `never` (`--sparse-attention`).
    pub sparse_attention: SparseAttention,
    /// Whether the sparse layers ran InfLLM-v2 at this window length.
    pub sparse_path: bool,
    /// The scores per range of positions in the window (docs/eval.md, Position ranges).
    pub by_position: Vec<RangeScore>,
}

/// A model folder opened for evaluation: config, validated checkpoint, tokenizer, and for
/// quantized folders (GPTQ v1/v2 or Marlin) the quantization settings; their weights are
/// dequantized on load.
pub struct LoadedModel {
    pub dir: std::path::PathBuf,
    pub cfg: AnyConfig,
    pub ck: Checkpoint,
    pub tokenizer: tokenizers::Tokenizer,
    /// The settings and every quantized module, validated once at open.
    pub quant: Option<(QuantInfo, BTreeMap<String, QuantModule>)>,
}

impl LoadedModel {
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_with(dir, SparseAttention::Auto)
    }

    /// [`open`](Self::open) with the sparse layers' attention mode (`--sparse-attention`).
    pub fn open_with(dir: &Path, sparse: SparseAttention) -> Result<Self> {
        let mut cfg = AnyConfig::from_file(&dir.join("config.json"))?;
        cfg.set_sparse_attention(sparse)?;
        let ck = Checkpoint::open(dir)?;
        ck.check_finite()?;
        let quant = match read_quant_info(dir)? {
            Some(info) => {
                let modules =
                    validate_quantized_modules(&ck, &info, Some(&cfg.expected_tensors()))?
                        .into_iter()
                        .map(|m| (m.prefix.clone(), m))
                        .collect();
                Some((info, modules))
            }
            None => {
                ck.validate_exact(&cfg.expected_tensors())?;
                None
            }
        };
        let tok_path = dir.join("tokenizer.json");
        crate::checkpoint::guard::regular_file(&tok_path, "tokenizer")?;
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tok_path.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            cfg,
            ck,
            tokenizer,
            quant,
        })
    }

    /// A tensor by its BF16-layout name; a quantized Linear's `.weight` is decoded from its
    /// stored codes and scales, on the GPU when `device` is one (bit-identical to the CPU decode).
    pub fn tensor(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        if let Some((info, modules)) = &self.quant {
            if let Some(m) = name.strip_suffix(".weight").and_then(|p| modules.get(p)) {
                let (prefix, n, k) = (&m.prefix, m.n, m.k);
                return Ok(read_module_codes(&self.ck, info, m)?
                    .dequantize_tensor(n, k, device)
                    .with_context(|| {
                        format!("dequantizing module {prefix} of {}", self.dir.display())
                    })?
                    .to_dtype(dtype)?);
            }
        }
        self.ck.tensor(name, dtype, device)
    }

    pub fn model(&self, dtype: DType, device: &Device) -> Result<AnyModel> {
        AnyModel::from_tensors(&self.cfg, dtype, device, &|n| self.tensor(n, dtype, device))
            .with_context(|| format!("loading embeddings and head of {}", self.dir.display()))
    }

    pub fn layer(&self, i: usize, dtype: DType, device: &Device) -> Result<AnyLayer> {
        AnyLayer::from_tensors(&self.cfg, i, &|n| self.tensor(n, dtype, device))
            .with_context(|| format!("loading decoder layer {i} of {}", self.dir.display()))
    }
}

/// Token windows `[n, seqlen]` per the protocol above.
pub fn make_windows(
    tokenizer: &tokenizers::Tokenizer,
    text: &str,
    cfg: &AnyConfig,
    opts: &PplOptions,
) -> Result<Vec<Vec<u32>>> {
    if opts.seqlen < 2 {
        bail!("--seqlen must be at least 2 (got {})", opts.seqlen);
    }
    let ids = crate::calib::token_cache::encode(tokenizer, text)
        .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
    let ids = ids.as_slice();
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= cfg.vocab_size()) {
        bail!("the tokenizer produced id {bad} but the model's vocab_size is {}: tokenizer and model do not match", cfg.vocab_size());
    }
    let bos = match (opts.bos, cfg.bos_token_id()) {
        (true, None) => bail!("--bos: config.json has no bos_token_id"),
        (_, b) => b.unwrap_or_default(),
    };
    let step = if opts.bos {
        opts.seqlen - 1
    } else {
        opts.seqlen
    };
    let mut n = ids.len() / step;
    if let Some(m) = opts.max_windows {
        n = n.min(m);
    }
    if n == 0 {
        let what = &opts.text_name;
        if text.trim().is_empty() {
            bail!("{what} is empty: give a text to score");
        }
        bail!(
            "{what} has {} token{}, fewer than one window of --seqlen {}: give more text or a \
             smaller --seqlen",
            ids.len(),
            if ids.len() == 1 { "" } else { "s" },
            opts.seqlen
        );
    }
    Ok((0..n)
        .map(|w| {
            let chunk = &ids[w * step..(w + 1) * step];
            if opts.bos {
                std::iter::once(bos).chain(chunk.iter().copied()).collect()
            } else {
                chunk.to_vec()
            }
        })
        .collect())
}

/// Final hidden states (before the head) of every batch of windows (runs of one length, at
/// most `batch` windows: [`crate::calib::batch_ranges`]), computed layer by layer.
pub fn final_hidden_states(
    lm: &LoadedModel,
    model: &AnyModel,
    windows: &[Vec<u32>],
    batch: usize,
    what: &str,
) -> Result<Vec<Tensor>> {
    let mut states = Vec::new();
    for r in crate::calib::batch_ranges(windows, batch) {
        let b = &windows[r];
        let flat: Vec<u32> = b.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (b.len(), b[0].len()), model.device())?;
        states.push(model.embed(&ids)?);
    }
    let pb = crate::progress::bar(model.num_layers() as u64, what);
    for i in 0..model.num_layers() {
        let layer = lm.layer(i, model.dtype(), model.device())?;
        for h in states.iter_mut() {
            *h = layer.forward(h, &mut |_, _| Ok(()))?;
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(states)
}

/// One compared model's scores against the reference, on the same windows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Comparison {
    pub model: String,
    pub ppl: f64,
    pub nll: f64,
    /// ppl − reference ppl.
    pub delta_ppl: f64,
    /// Mean over scored positions of KL(P_reference ‖ P_model), in nats.
    pub mean_kl: f64,
    /// Fraction of positions where both models rank the same token first.
    pub top1_agreement: f64,
    /// The same per range of positions in the window (docs/eval.md, Position ranges).
    pub by_position: Vec<RangeScore>,
    /// Per-position sums, for the plot.
    #[serde(skip)]
    pub sums: PositionSums,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CompareReport {
    pub reference: PplReport,
    pub reference_model: String,
    pub compared: Vec<Comparison>,
}

/// A NaN or infinite mean NLL is a broken model, not a score: its weights are finite (checked on
/// load), so its activations overflow (an extreme `scale_emb`, say) or its config is wrong.
fn finite_nll(nll: f64, dir: &Path) -> Result<()> {
    if !nll.is_finite() {
        bail!(
            "{} gives a mean NLL of {nll} (perplexity {}): its forward pass produces non-finite \
             logits, so there is no perplexity to report; check its config.json (scale_emb, \
             rms_norm_eps, ...) and weights",
            dir.display(),
            nll.exp()
        );
    }
    Ok(())
}

pub fn perplexity(dir: &Path, text: &str, opts: &PplOptions) -> Result<PplReport> {
    Ok(compare(dir, &[], text, opts)?.reference)
}

/// Scores the reference and every compared model on the same windows (tokenized with the
/// reference's tokenizer). Hidden states are computed layer by layer per model; the head runs a
/// few thousand positions at a time (`score.rs`).
pub fn compare(
    reference: &Path,
    others: &[std::path::PathBuf],
    text: &str,
    opts: &PplOptions,
) -> Result<CompareReport> {
    let lm = LoadedModel::open_with(reference, opts.sparse_attention)?;
    let windows = make_windows(&lm.tokenizer, text, &lm.cfg, opts)?;
    let model = lm.model(opts.dtype, &opts.device)?;
    model.check_length(opts.seqlen)?;
    let ref_states = final_hidden_states(&lm, &model, &windows, opts.batch, "reference")?;
    let batches: Vec<&[Vec<u32>]> = crate::calib::batch_ranges(&windows, opts.batch)
        .into_iter()
        .map(|r| &windows[r])
        .collect();
    let mut rsums = PositionSums::default();
    for (h, ws) in ref_states.iter().zip(&batches) {
        score::score_batch(&model, h, None, ws, &mut rsums)?;
    }
    let count = rsums.tokens() as usize;
    let mean = rsums.range(0, usize::MAX).0 / count as f64;
    finite_nll(mean, reference)?;
    let ref_report = PplReport {
        ppl: mean.exp(),
        nll: mean,
        tokens: count,
        windows: windows.len(),
        seqlen: opts.seqlen,
        sparse_attention: opts.sparse_attention,
        sparse_path: lm.cfg.sparse_runs(opts.seqlen),
        by_position: score::ranges(&rsums, false),
    };
    let mut compared = vec![];
    for other in others {
        let om = LoadedModel::open_with(other, opts.sparse_attention)?;
        if om.cfg.vocab_size() != lm.cfg.vocab_size() {
            bail!(
                "--compare {}: vocab_size {} differs from the reference's {}; the models cannot be compared token by token",
                other.display(),
                om.cfg.vocab_size(),
                lm.cfg.vocab_size()
            );
        }
        let omodel = om.model(opts.dtype, &opts.device)?;
        let states = final_hidden_states(&om, &omodel, &windows, opts.batch, "compare")?;
        let mut sums = PositionSums::default();
        for ((h, rh), ws) in states.iter().zip(&ref_states).zip(&batches) {
            score::score_batch(&omodel, h, Some((&model, rh)), ws, &mut sums)?;
        }
        let (nll, kl, agree, _) = sums.range(0, usize::MAX);
        let m = nll / count as f64;
        finite_nll(m, other)?;
        compared.push(Comparison {
            model: other.display().to_string(),
            ppl: m.exp(),
            nll: m,
            delta_ppl: m.exp() - ref_report.ppl,
            mean_kl: kl / count as f64,
            top1_agreement: agree as f64 / count as f64,
            by_position: score::ranges(&sums, true),
            sums,
        });
    }
    Ok(CompareReport {
        reference: ref_report,
        reference_model: reference.display().to_string(),
        compared,
    })
}
