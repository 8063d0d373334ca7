//! Perplexity with one documented protocol (design.md decision 10): tokenize the whole text once
//! without special tokens, cut non-overlapping windows of `seqlen` tokens, drop the tail, score
//! every next-token prediction inside each window, ppl = exp(mean NLL). With `bos`, each window
//! is BOS followed by the next seqlen−1 text tokens and every text token in it is scored.
//!
//! The model runs layer by layer over all windows (one decoder layer's weights in memory at a
//! time), then the head runs window by window, so logits are never stored for more than one
//! window.

use crate::checkpoint::Checkpoint;
use crate::model::{Config, Model};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
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
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct PplReport {
    pub ppl: f64,
    pub nll: f64,
    pub tokens: usize,
    pub windows: usize,
    pub seqlen: usize,
}

/// A model folder opened for evaluation: config, validated checkpoint, tokenizer.
pub struct LoadedModel {
    pub cfg: Config,
    pub ck: Checkpoint,
    pub tokenizer: tokenizers::Tokenizer,
}

impl LoadedModel {
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg = Config::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open(dir)?;
        ck.validate_exact(&cfg.expected_tensors())?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tok_path.display()))?;
        Ok(Self { cfg, ck, tokenizer })
    }
}

/// Token windows `[n, seqlen]` per the protocol above.
pub fn make_windows(
    tokenizer: &tokenizers::Tokenizer,
    text: &str,
    cfg: &Config,
    opts: &PplOptions,
) -> Result<Vec<Vec<u32>>> {
    if opts.seqlen < 2 {
        bail!("--seqlen must be at least 2 (got {})", opts.seqlen);
    }
    let enc = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
    let ids = enc.get_ids();
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
        bail!("the tokenizer produced id {bad} but the model's vocab_size is {}: tokenizer and model do not match", cfg.vocab_size);
    }
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
        bail!(
            "the evaluation text has {} tokens, fewer than one window of --seqlen {}: give more text or a smaller --seqlen",
            ids.len(),
            opts.seqlen
        );
    }
    Ok((0..n)
        .map(|w| {
            let chunk = &ids[w * step..(w + 1) * step];
            if opts.bos {
                std::iter::once(cfg.bos_token_id)
                    .chain(chunk.iter().copied())
                    .collect()
            } else {
                chunk.to_vec()
            }
        })
        .collect())
}

/// Final hidden states (before the head) of every window, computed layer by layer.
pub fn final_hidden_states(
    model: &Model,
    ck: &Checkpoint,
    windows: &[Vec<u32>],
    batch: usize,
    what: &str,
) -> Result<Vec<Tensor>> {
    let seqlen = windows[0].len();
    let mut states = Vec::new();
    for b in windows.chunks(batch.max(1)) {
        let flat: Vec<u32> = b.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (b.len(), seqlen), &model.device)?;
        states.push(model.embed(&ids)?);
    }
    let pb = crate::cli::progress::bar(model.cfg.num_hidden_layers as u64, what);
    for i in 0..model.cfg.num_hidden_layers {
        let layer = model.load_layer(ck, i)?;
        for h in states.iter_mut() {
            *h = layer.forward(h, &mut |_, _| Ok(()))?;
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(states)
}

/// Per-position log-probabilities `[B, T, V]` (f32) from final hidden states.
pub fn log_probs(model: &Model, h: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(&model.head(h)?, D::Minus1)?)
}

/// Sum of NLL over scored positions of a batch of windows, and the number of predictions.
pub fn batch_nll(logp: &Tensor, windows: &[Vec<u32>]) -> Result<(f64, usize)> {
    let (b, t, _) = logp.dims3()?;
    let targets: Vec<u32> = windows
        .iter()
        .flat_map(|w| w[1..].iter().copied())
        .collect();
    let targets = Tensor::from_vec(targets, (b, t - 1, 1), logp.device())?;
    let picked = logp
        .narrow(1, 0, t - 1)?
        .contiguous()?
        .gather(&targets, D::Minus1)?;
    let sum = picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    Ok((-sum, b * (t - 1)))
}

pub fn perplexity(dir: &Path, text: &str, opts: &PplOptions) -> Result<PplReport> {
    let lm = LoadedModel::open(dir)?;
    let windows = make_windows(&lm.tokenizer, text, &lm.cfg, opts)?;
    let model = Model::load(&lm.ck, &lm.cfg, opts.dtype, &opts.device)
        .context("loading embeddings and head")?;
    model.check_length(opts.seqlen)?;
    let states = final_hidden_states(&model, &lm.ck, &windows, opts.batch, "eval")?;
    let (mut nll, mut count) = (0.0, 0usize);
    for (h, ws) in states.iter().zip(windows.chunks(opts.batch.max(1))) {
        let (s, c) = batch_nll(&log_probs(&model, h)?, ws)?;
        nll += s;
        count += c;
    }
    let mean = nll / count as f64;
    Ok(PplReport {
        ppl: mean.exp(),
        nll: mean,
        tokens: count,
        windows: windows.len(),
        seqlen: opts.seqlen,
    })
}
