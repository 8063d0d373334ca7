//! Perplexity with one documented protocol (docs/algorithm.md, Perplexity protocol): tokenize the
//! whole text once without special tokens, cut non-overlapping windows of `seqlen` tokens, drop the
//! tail, score every next-token prediction inside each window, ppl = exp(mean NLL). With `bos`,
//! each window is BOS followed by the next seqlen−1 text tokens and every text token in it is
//! scored.
//!
//! The model runs layer by layer over all windows (one decoder layer's weights in memory at a
//! time), then the head runs window by window, so logits are never stored for more than one
//! window.

use crate::checkpoint::Checkpoint;
use crate::format::quantized::{
    read_module_codes, read_quant_info, validate_quantized_modules, QuantInfo, QuantModule,
};
use crate::model::{AnyConfig, AnyLayer, AnyModel};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
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
        let cfg = AnyConfig::from_file(&dir.join("config.json"))?;
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
    let enc = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
    let ids = enc.get_ids();
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

/// Final hidden states (before the head) of every window, computed layer by layer.
pub fn final_hidden_states(
    lm: &LoadedModel,
    model: &AnyModel,
    windows: &[Vec<u32>],
    batch: usize,
    what: &str,
) -> Result<Vec<Tensor>> {
    let seqlen = windows[0].len();
    let mut states = Vec::new();
    for b in windows.chunks(batch.max(1)) {
        let flat: Vec<u32> = b.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (b.len(), seqlen), model.device())?;
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

/// Per-position log-probabilities `[B, T, V]` (f32) from final hidden states.
pub fn log_probs(model: &AnyModel, h: &Tensor) -> Result<Tensor> {
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

/// Over the scored positions of a batch (all but each window's last): the sum of
/// KL(P_reference ‖ P_model) in nats, and the count of positions where both rank the same token
/// first. `lp`, `rlp`: log-probabilities `[B, T, V]` of the model and the reference.
pub fn kl_and_agreement(lp: &Tensor, rlp: &Tensor) -> Result<(f64, usize)> {
    let t = lp.dim(1)? - 1;
    let (lp, rlp) = (lp.narrow(1, 0, t)?, rlp.narrow(1, 0, t)?);
    let kl = (rlp.exp()? * (&rlp - &lp)?)?
        .sum_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    let same = lp.argmax(D::Minus1)?.eq(&rlp.argmax(D::Minus1)?)?;
    let agree = same.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize;
    Ok((kl, agree))
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
/// reference's tokenizer). Hidden states are computed layer by layer per model; logits exist
/// for one batch of windows at a time.
pub fn compare(
    reference: &Path,
    others: &[std::path::PathBuf],
    text: &str,
    opts: &PplOptions,
) -> Result<CompareReport> {
    let lm = LoadedModel::open(reference)?;
    let windows = make_windows(&lm.tokenizer, text, &lm.cfg, opts)?;
    let model = lm.model(opts.dtype, &opts.device)?;
    model.check_length(opts.seqlen)?;
    let ref_states = final_hidden_states(&lm, &model, &windows, opts.batch, "reference")?;
    let batches: Vec<&[Vec<u32>]> = windows.chunks(opts.batch.max(1)).collect();
    let (mut nll, mut count) = (0.0, 0usize);
    for (h, ws) in ref_states.iter().zip(&batches) {
        let (s, c) = batch_nll(&log_probs(&model, h)?, ws)?;
        nll += s;
        count += c;
    }
    let mean = nll / count as f64;
    finite_nll(mean, reference)?;
    let ref_report = PplReport {
        ppl: mean.exp(),
        nll: mean,
        tokens: count,
        windows: windows.len(),
        seqlen: opts.seqlen,
    };
    let mut compared = vec![];
    for other in others {
        let om = LoadedModel::open(other)?;
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
        let (mut nll, mut kl, mut agree) = (0.0, 0.0, 0usize);
        for ((h, rh), ws) in states.iter().zip(&ref_states).zip(&batches) {
            let (lp, rlp) = (log_probs(&omodel, h)?, log_probs(&model, rh)?);
            nll += batch_nll(&lp, ws)?.0;
            let (k, a) = kl_and_agreement(&lp, &rlp)?;
            kl += k;
            agree += a;
        }
        let m = nll / count as f64;
        finite_nll(m, other)?;
        compared.push(Comparison {
            model: other.display().to_string(),
            ppl: m.exp(),
            nll: m,
            delta_ppl: m.exp() - ref_report.ppl,
            mean_kl: kl / count as f64,
            top1_agreement: agree as f64 / count as f64,
        });
    }
    Ok(CompareReport {
        reference: ref_report,
        reference_model: reference.display().to_string(),
        compared,
    })
}
