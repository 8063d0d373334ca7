//! What the two solver backends share (`cpu.rs`, `cuda.rs`): the options of a solve, the
//! factorization of a Hessian, the quantized result, and the checks both make the same way.

use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::quantizer::{dequantize_code, QuantParams};
pub use crate::scheme::{ActOrder, FactorPrecision};

#[derive(Clone, Debug)]
pub struct SolveOptions {
    pub quant: QuantParams,
    pub act_order: ActOrder,
    /// Initial damping λ, as a fraction of mean(diag H); doubled on a failed factorization up to 1.
    pub damp: f64,
    /// Columns per block of the lazy-update loop (`blocksize`, 128 in every reference tool).
    pub block_size: usize,
    /// The module's name, for error messages.
    pub module: String,
    /// The factorization's precision (`F32` or `F64`; `Auto` is f64).
    pub factor: FactorPrecision,
}

impl Default for SolveOptions {
    fn default() -> Self {
        Self {
            quant: QuantParams::default(),
            act_order: ActOrder::Static,
            damp: 0.01,
            block_size: 128,
            module: String::new(),
            factor: FactorPrecision::F64,
        }
    }
}

impl SolveOptions {
    pub(crate) fn validate(&self) -> Result<()> {
        self.quant.validate()?;
        ensure!(self.block_size > 0, "block size must be positive");
        ensure!(
            valid_damp(self.damp),
            "damp must be in (0, 1), got {}",
            self.damp
        );
        Ok(())
    }
}

/// Whether `d` is a valid initial damping fraction: in (0, 1) (escalation may then reach 1).
pub fn valid_damp(d: f64) -> bool {
    d > 0.0 && d < 1.0
}

/// Wall-clock seconds of the two expensive phases of a solve.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SolveTimings {
    /// Permuting and damping H, Cholesky and triangular inverse (all retries included).
    pub factor_s: f64,
    /// The blocked column loop with its lazy updates.
    pub loop_s: f64,
}

/// A quantized Linear `[N, K]` in GPTQ's terms, columns in the original order.
#[derive(Clone, Debug)]
pub struct QuantizedLinear {
    pub n: usize,
    pub k: usize,
    /// `[N, K]` row-major; the code of `W[n][k]`.
    pub codes: Vec<u8>,
    /// `[n_groups, N]`, group-major as GPTQ stores them (f32; the packer rounds to fp16).
    pub scales: Vec<f32>,
    /// `[n_groups, N]`, the integer zero point (8 for symmetric 4-bit; GPTQ v1 stores zero − 1).
    pub zeros: Vec<u8>,
    /// `[K]`: the scale/zero row of each input column.
    pub g_idx: Vec<i32>,
    /// Σ (w − q)² / d² / 2 over all weights (docs/algorithm.md, The column loop; GPTQModel reports
    /// this divided by the sample count). For RTN, d = 1.
    pub loss: f64,
    /// The damping fraction that made H factorizable (0 for RTN).
    pub damp_used: f64,
    /// Input columns whose diag(H) was 0; their weights were quantized as 0.
    pub dead_columns: usize,
    pub timings: SolveTimings,
    /// `codes` as a `[N, K]` U8 tensor still on the device that solved them (the GPU solve), so
    /// the weights can be decoded there without uploading the codes again; `None` otherwise.
    pub device_codes: Option<Tensor>,
}

impl QuantizedLinear {
    pub fn n_groups(&self) -> usize {
        self.scales.len() / self.n
    }

    /// The fake-quantized weights `[N, K]`: `scale[g_idx[k]][n] · (code − zero)`, bit-identical to the
    /// values the solver used for its error feedback.
    pub fn dequantize(&self) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let mut out = vec![0.0f32; n * k];
        out.par_chunks_mut(k)
            .zip(self.codes.par_chunks(k))
            .enumerate()
            .for_each(|(row, (out, codes))| {
                for ((o, &c), &g) in out.iter_mut().zip(codes).zip(&self.g_idx) {
                    let p = g as usize * n + row;
                    *o = dequantize_code(c as f32, self.scales[p], self.zeros[p] as f32);
                }
            });
        out
    }

    /// [`dequantize`](Self::dequantize) as a `[N, K]` tensor, e.g. to put Q back into the model.
    pub fn dequantize_tensor(&self, device: &Device, dtype: DType) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.dequantize(), (self.n, self.k), device)?.to_dtype(dtype)?)
    }
}

/// What the solve needs of one Hessian, computed once and shared by every Linear that reads the
/// same input (q/k/v/gate, gate/up): dead columns, the processing order and the upper Cholesky
/// factor U of the damped, permuted H⁻¹ (docs/algorithm.md, Preprocessing of H).
pub struct Factorization {
    pub k: usize,
    /// Input columns whose diag(H) was 0.
    pub dead: Vec<usize>,
    /// Processing position → original column.
    pub perm: Vec<usize>,
    /// The damping fraction that made H factorizable.
    pub damp_used: f64,
    /// Seconds spent factorizing (retries included).
    pub seconds: f64,
    /// The act-order the processing order was made for.
    pub act_order: ActOrder,
    pub(crate) u: FactorData,
    /// GPTAQ's target correction `M = α·D·H_λ⁻¹` (`[K, K]` f32, natural column order, on the
    /// Hessian's device), set by [`Factorization::with_gptaq`]: the solve quantizes
    /// `W* = W + W·M` instead of `W` (docs/algorithm.md, GPTAQ).
    pub correction: Option<Tensor>,
}

impl Factorization {
    /// What a backend's factorization made: `u` (of H permuted by `perm` and damped by
    /// `damp_used`), the `dead` columns and the processing order `perm` for `act_order`, timed
    /// from `started`; no GPTAQ correction yet ([`Factorization::with_gptaq`] adds it).
    pub(crate) fn new(
        u: FactorData,
        dead: Vec<usize>,
        perm: Vec<usize>,
        damp_used: f64,
        act_order: ActOrder,
        started: Instant,
    ) -> Self {
        Self {
            k: perm.len(),
            dead,
            perm,
            damp_used,
            seconds: started.elapsed().as_secs_f64(),
            act_order,
            u,
            correction: None,
        }
    }

    /// `U` as a row-major `[K, K]` f32 tensor on the factor's device (processing order).
    pub(crate) fn u_tensor(&self) -> Result<Tensor> {
        Ok(match &self.u {
            // Column-major U read row-major is Uᵀ.
            FactorData::Cpu(u) => Tensor::from_vec(u.clone(), (self.k, self.k), &Device::Cpu)?
                .t()?
                .contiguous()?,
            #[cfg(feature = "cuda")]
            FactorData::Cuda(u) => u.clone(),
        })
    }

    /// Turns this GPTQ factorization into GPTAQ's (docs/algorithm.md, GPTAQ): with `d` the cross
    /// term `(2/n)·Σ (x_fp − x)ᵀ x` of the same inputs as the Hessian (natural order, `[K, K]`)
    /// and `alpha` the share of the correction applied, the target of every Linear solved with
    /// it becomes `W* = W + α·W·D·H_λ⁻¹`, where `H_λ⁻¹ = UᵀU` is the damped inverse this
    /// factorization already holds. `alpha = 0` is GPTQ.
    pub fn with_gptaq(mut self, d: &Tensor, alpha: f64) -> Result<Self> {
        let k = self.k;
        ensure!(
            d.dims() == [k, k],
            "internal: GPTAQ cross term is {:?}, the Hessian [{k}, {k}]",
            d.dims()
        );
        ensure!(
            alpha.is_finite() && alpha >= 0.0,
            "GPTAQ alpha must be finite and non-negative, got {alpha}"
        );
        let u = self.u_tensor()?;
        let dev = u.device().clone();
        let d = d.to_device(&dev)?.to_dtype(DType::F32)?;
        // H_λ⁻¹ in processing order, then back in natural order: inv[perm[i]] = i.
        let hinv_p = u.t()?.matmul(&u)?;
        let mut inv = vec![0u32; k];
        for (i, &c) in self.perm.iter().enumerate() {
            inv[c] = i as u32;
        }
        let inv = Tensor::from_vec(inv, k, &dev)?;
        let hinv = hinv_p.index_select(&inv, 0)?.index_select(&inv, 1)?;
        let m = d.matmul(&hinv)?.affine(alpha, 0.0)?;
        check_finite_correction(&m)?;
        self.correction = Some(m);
        Ok(self)
    }

    /// The weights a solve with this factorization quantizes: `w`, or GPTAQ's `W + W·M` (f32).
    pub fn target(&self, w: &Tensor) -> Result<Tensor> {
        match &self.correction {
            None => Ok(w.clone()),
            Some(m) => {
                let w = w.to_dtype(DType::F32)?.to_device(m.device())?;
                Ok((&w + w.matmul(m)?)?)
            }
        }
    }
}

/// Refuses a non-finite GPTAQ correction (an overflow of `D·H⁻¹`): the inputs of the
/// full-precision and quantized models are too far apart for this Hessian.
fn check_finite_correction(m: &Tensor) -> Result<()> {
    let s = m
        .sqr()?
        .sum_all()?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?;
    ensure!(
        s.is_finite(),
        "the GPTAQ correction is not finite: the full-precision and quantized inputs differ too \
         much for this Hessian; use --method gptq, or a smaller --gptaq-alpha"
    );
    Ok(())
}

pub(crate) enum FactorData {
    /// Column-major f32 `[K, K]`: U[r][c] is `u[c·K + r]`.
    Cpu(Vec<f32>),
    /// Row-major f32 `[K, K]` on the GPU.
    #[cfg(feature = "cuda")]
    Cuda(Tensor),
}

impl FactorData {
    /// The CPU factor, if this is one (the only kind in a CPU-only build).
    #[cfg(test)]
    #[allow(irrefutable_let_patterns)]
    pub(crate) fn cpu(&self) -> Option<&[f32]> {
        if let FactorData::Cpu(u) = self {
            Some(u)
        } else {
            None
        }
    }
}

/// Dead columns and processing order from diag(H) (docs/algorithm.md, Preprocessing of H): the dead
/// columns (diagonal 0, which is set to 1 in `diag`) and the processing order (processing position
/// → original column). Act-order sorts by descending diagonal; the sort is stable so equal
/// diagonals keep their index order.
pub(crate) fn dead_columns_and_order(
    diag: &mut [f32],
    act_order: ActOrder,
) -> (Vec<usize>, Vec<usize>) {
    let dead: Vec<usize> = (0..diag.len()).filter(|&i| diag[i] == 0.0).collect();
    for &i in &dead {
        diag[i] = 1.0;
    }
    let mut perm: Vec<usize> = (0..diag.len()).collect();
    if act_order != ActOrder::Off {
        perm.sort_by(|&a, &b| diag[b].total_cmp(&diag[a]));
    }
    (dead, perm)
}

/// The error of a Hessian that no damping up to 1.0 made factorizable.
pub(crate) fn not_positive_definite(module: &str, mean_diag: f64) -> anyhow::Error {
    anyhow::anyhow!(
        "module {module}: the Hessian is not positive definite even with damp 1.0 \
         (mean diag {mean_diag:e}); the calibration inputs of this module are degenerate: \
         use more calibration samples or skip the module"
    )
}

/// Refuses NaN/Inf in `t` with the position of the first one (the message of the CPU solve).
#[cfg(feature = "cuda")]
pub(crate) fn check_finite_one(t: &Tensor, what: &str, module: &str) -> Result<()> {
    finite_f32(t, what, module).map(|_| ())
}

pub(crate) fn matrix_dims(t: &Tensor, what: &str, module: &str) -> Result<(usize, usize)> {
    match t.dims() {
        &[r, c] if r > 0 && c > 0 => Ok((r, c)),
        dims => anyhow::bail!(
            "module {module}: {what} must be a non-empty 2-D matrix, got shape {dims:?}"
        ),
    }
}

/// The tensor as row-major f32 on the CPU, refusing NaN/Inf.
pub(crate) fn finite_f32(t: &Tensor, what: &str, module: &str) -> Result<Vec<f32>> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if !all_finite(&v) {
        let i = v
            .iter()
            .position(|x| !x.is_finite())
            .expect("a non-finite value exists");
        let cols = t.dim(1)?;
        anyhow::bail!(
            "module {module}: {what} contains NaN or Inf (first found at [{}, {}])",
            i / cols,
            i % cols
        );
    }
    Ok(v)
}

/// Whether every value is finite, by chunks with a branch-free fold in each (rayon's
/// per-element `all`/`position_any` spend most of their time on the shared stop flag).
pub(crate) fn all_finite(v: &[f32]) -> bool {
    v.par_chunks(1 << 16)
        .all(|c| !c.iter().fold(false, |bad, x| bad | !x.is_finite()))
}
