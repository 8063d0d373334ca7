//! Scoring final hidden states position by position (docs/eval.md): the head runs on a few
//! thousand positions at a time, so the logits of a long window (32K positions × a 73K
//! vocabulary is 9.6 GB in f32) never exist whole; each position's NLL, and against a reference
//! its KL divergence and top-1 agreement, are summed per position over the windows, so the report
//! can give them per position range and the plot per position.

use crate::model::AnyModel;
use anyhow::Result;
use candle_core::{DType, Tensor, D};

/// Per-position sums over windows: index p is the prediction made at position p of a window
/// (of the token at p + 1).
#[derive(Debug, Clone, Default)]
pub struct PositionSums {
    pub nll: Vec<f64>,
    /// KL(P_reference ‖ P_model), nats (zero when scored without a reference).
    pub kl: Vec<f64>,
    /// Positions where the model and the reference rank the same token first.
    pub agree: Vec<u64>,
    /// Windows scored at each position.
    pub count: Vec<u64>,
}

impl PositionSums {
    fn grow(&mut self, n: usize) {
        if self.nll.len() < n {
            self.nll.resize(n, 0.0);
            self.kl.resize(n, 0.0);
            self.agree.resize(n, 0);
            self.count.resize(n, 0);
        }
    }

    /// Scored predictions in all.
    pub fn tokens(&self) -> u64 {
        self.count.iter().sum()
    }

    /// Sums over positions `from..to`: (NLL, KL, agreements, predictions).
    pub fn range(&self, from: usize, to: usize) -> (f64, f64, u64, u64) {
        let to = to.min(self.nll.len());
        let from = from.min(to);
        (
            self.nll[from..to].iter().sum(),
            self.kl[from..to].iter().sum(),
            self.agree[from..to].iter().sum(),
            self.count[from..to].iter().sum(),
        )
    }
}

/// Positions per head call for a batch of `b` windows over a `vocab`-wide head: the f32
/// log-probabilities of the model and the reference and their temporaries stay near 1 GB.
fn rows_per_call(b: usize, vocab: usize) -> usize {
    let budget = 1usize << 30;
    (budget / (6 * 4 * vocab.max(1) * b.max(1))).max(1)
}

/// Scores one batch: `h` the model's final hidden states `[B, T, H]` of `windows`, and with
/// `reference` the reference model's of the same windows. Adds each window's per-position NLL
/// (and KL and top-1 agreement against the reference) to `sums`.
pub fn score_batch(
    model: &AnyModel,
    h: &Tensor,
    reference: Option<(&AnyModel, &Tensor)>,
    windows: &[Vec<u32>],
    sums: &mut PositionSums,
) -> Result<()> {
    let (b, t, _) = h.dims3()?;
    let scored = t - 1;
    sums.grow(scored);
    let targets: Vec<u32> = windows
        .iter()
        .flat_map(|w| w[1..].iter().copied())
        .collect();
    let targets = Tensor::from_vec(targets, (b, scored), h.device())?;
    let step = rows_per_call(b, model.vocab_size());
    let mut start = 0;
    while start < scored {
        let len = step.min(scored - start);
        let lp = log_probs(model, &h.narrow(1, start, len)?)?;
        let tg = targets.narrow(1, start, len)?.unsqueeze(2)?;
        let nll = lp.gather(&tg.contiguous()?, D::Minus1)?.squeeze(2)?;
        let nll: Vec<Vec<f64>> = nll.to_dtype(DType::F64)?.to_vec2()?;
        for row in &nll {
            for (p, v) in row.iter().enumerate() {
                sums.nll[start + p] -= v;
                sums.count[start + p] += 1;
            }
        }
        if let Some((rmodel, rh)) = reference {
            let rlp = log_probs(rmodel, &rh.narrow(1, start, len)?)?;
            let kl = (rlp.exp()? * (&rlp - &lp)?)?.sum(D::Minus1)?;
            let kl: Vec<Vec<f64>> = kl.to_dtype(DType::F64)?.to_vec2()?;
            let same = lp.argmax(D::Minus1)?.eq(&rlp.argmax(D::Minus1)?)?;
            let same: Vec<Vec<u8>> = same.to_dtype(DType::U8)?.to_vec2()?;
            for (krow, srow) in kl.iter().zip(&same) {
                for (p, (k, s)) in krow.iter().zip(srow).enumerate() {
                    sums.kl[start + p] += k;
                    sums.agree[start + p] += u64::from(*s);
                }
            }
        }
        start += len;
    }
    Ok(())
}

/// Sum of NLL over the scored positions of a batch of windows from their log-probabilities
/// `[B, T, V]`, and the number of predictions (for callers that hold whole logits, e.g. the
/// fixture's trainer).
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

/// Log-probabilities `[B, T, V]` (f32) from final hidden states.
pub fn log_probs(model: &AnyModel, h: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(&model.head(h)?, D::Minus1)?)
}

/// The position ranges reported (docs/eval.md, Position ranges): 0–2K, 2K–8K, 8K–32K, 32K–128K
/// and beyond, as far as the windows reach.
pub const RANGE_BOUNDS: &[usize] = &[0, 2048, 8192, 32768, 131072];

/// Scores over one range of prediction positions.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RangeScore {
    /// First and one-past-last position of the predicting token in its window.
    pub from: usize,
    pub to: usize,
    pub tokens: u64,
    pub ppl: f64,
    pub nll: f64,
    /// Against the reference (compared models only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_kl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top1_agreement: Option<f64>,
}

/// `sums` per range of [`RANGE_BOUNDS`] (and one past the last bound), for ranges that hold
/// predictions; `compared` adds KL and agreement.
pub fn ranges(sums: &PositionSums, compared: bool) -> Vec<RangeScore> {
    let n = sums.nll.len();
    let mut bounds: Vec<usize> = RANGE_BOUNDS.iter().copied().filter(|&b| b < n).collect();
    bounds.push(n);
    bounds
        .windows(2)
        .map(|w| {
            let (nll, kl, agree, count) = sums.range(w[0], w[1]);
            let c = count.max(1) as f64;
            RangeScore {
                from: w[0],
                to: w[1],
                tokens: count,
                ppl: (nll / c).exp(),
                nll: nll / c,
                mean_kl: compared.then(|| kl / c),
                top1_agreement: compared.then(|| agree as f64 / c),
            }
        })
        .collect()
}

/// Mean KL per bin of positions: `bins` equal bins over the scored positions (fewer when the
/// windows are short), as `(first position of the bin, mean KL)`.
pub fn kl_bins(sums: &PositionSums, bins: usize) -> Vec<(usize, f64)> {
    let n = sums.kl.len();
    let per = n.div_ceil(bins.max(1)).max(1);
    (0..n)
        .step_by(per)
        .map(|from| {
            let (_, kl, _, count) = sums.range(from, from + per);
            (from, kl / count.max(1) as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums(n: usize) -> PositionSums {
        let mut s = PositionSums::default();
        s.grow(n);
        for p in 0..n {
            s.nll[p] = 2.0 * (p as f64 + 1.0);
            s.kl[p] = p as f64;
            s.agree[p] = (p % 2) as u64;
            s.count[p] = 2;
        }
        s
    }

    #[test]
    fn ranges_split_at_the_bounds_the_windows_reach() {
        let r = ranges(&sums(10_000), true);
        assert_eq!(
            r.iter().map(|x| (x.from, x.to)).collect::<Vec<_>>(),
            vec![(0, 2048), (2048, 8192), (8192, 10_000)]
        );
        let total: u64 = r.iter().map(|x| x.tokens).sum();
        assert_eq!(total, 20_000);
        // Mean NLL over 0..2048: Σ 2(p+1) / (2·2048) = (2048 + 1) / 2.
        assert!((r[0].nll - 1024.5).abs() < 1e-9);
        assert!((r[0].mean_kl.unwrap() - 1023.5 / 2.0).abs() < 1e-9);
        assert!((r[0].top1_agreement.unwrap() - 0.25).abs() < 1e-12);
        let one = ranges(&sums(511), false);
        assert_eq!(one.len(), 1);
        assert!(one[0].mean_kl.is_none());
    }

    #[test]
    fn kl_bins_average_within_each_bin() {
        let b = kl_bins(&sums(100), 10);
        assert_eq!(b.len(), 10);
        assert_eq!(b[3].0, 30);
        // Bin 30..40: mean of p/2 over those positions (each counted twice).
        assert!((b[3].1 - 34.5 / 2.0).abs() < 1e-12);
    }
}
