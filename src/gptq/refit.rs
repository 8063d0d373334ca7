//! Scale refit (docs/algorithm.md, Scale refit): once GPTQ has fixed every code, the group scales
//! that minimise the layer-output error `(w − q)·H·(w − q)ᵀ` of each output row, with
//! `q = s[g_idx[k]]·(code[k] − zero[g_idx[k]])`, are the solution of one small least-squares
//! system per row: `q` is linear in the row's `G` scales. GPTQ's scales come from a min/max (or
//! MSE) rule on the weights alone and never see `H`; the refit does, with all of `H`'s
//! correlations, and keeps a row's old scales unless the new ones lower its error.
//!
//! The products (`N·K²` per module, like one forward GEMM per column group) run on the device of
//! the Hessian through candle; the `G × G` solves (G = K / group size) on the CPU in f64.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, D};
use half::f16;
use rayon::prelude::*;

use super::types::QuantizedLinear;

/// Relative ridge on the normal equations: pulls a scale whose group carries no signal (all
/// codes at the zero point, or inputs that are always zero) to its old value.
const RIDGE: f64 = 1e-6;

/// What a refit changed, for the report.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RefitStats {
    /// Σ over rows of the error `(w − q)·H·(w − q)ᵀ` with GPTQ's scales.
    pub before: f64,
    /// The same with the scales kept (new where they lowered a row's error).
    pub after: f64,
    /// Rows whose scales were replaced.
    pub rows_changed: usize,
}

/// Replaces the scales of `q` by the least-squares ones for the target weights `w` (`[N, K]`, the
/// weights the solve quantized: GPTAQ's `W*` for GPTAQ) under the Hessian `h` (`[K, K]`), row by
/// row where that lowers the row's error with the scales rounded to fp16 as they are stored.
/// Codes, zeros and `g_idx` are unchanged.
pub fn refit_scales(q: &mut QuantizedLinear, w: &Tensor, h: &Tensor) -> Result<RefitStats> {
    let (n, k) = (q.n, q.k);
    let groups = q.n_groups();
    ensure!(
        w.dims() == [n, k] && h.dims() == [k, k],
        "internal: refit of [{n}, {k}] given weights {:?} and Hessian {:?}",
        w.dims(),
        h.dims()
    );
    let dev = h.device().clone();
    let (order, bounds) = group_order(q, groups);
    let (a, b) = normal_equations(q, w, h, &order, &bounds, &dev)?;
    let whw = row_constants(w, h, &dev)?;
    let old: Vec<Vec<f64>> = (0..n)
        .map(|r| {
            (0..groups)
                .map(|g| f16::from_f32(q.scales[g * n + r]).to_f64())
                .collect()
        })
        .collect();
    let results: Vec<(Option<Vec<f32>>, f64, f64)> = (0..n)
        .into_par_iter()
        .map(|r| {
            let ar = &a[r * groups * groups..(r + 1) * groups * groups];
            let br = &b[r * groups..(r + 1) * groups];
            refit_row(ar, br, &old[r], groups)
        })
        .collect();
    let mut stats = RefitStats::default();
    for (r, (new, before, after)) in results.into_iter().enumerate() {
        stats.before += before + whw[r];
        stats.after += after + whw[r];
        if let Some(s) = new {
            stats.rows_changed += 1;
            for (g, v) in s.into_iter().enumerate() {
                q.scales[g * n + r] = v;
            }
        }
    }
    Ok(stats)
}

/// The columns sorted by group (stable), so that every group is a contiguous run, and the
/// runs' bounds: group `g` is sorted positions `[bounds[g], bounds[g + 1])`.
fn group_order(q: &QuantizedLinear, groups: usize) -> (Vec<usize>, Vec<usize>) {
    // Columns sorted by group (stable), so that every group is a contiguous run.
    let mut order: Vec<usize> = (0..q.k).collect();
    order.sort_by_key(|&c| q.g_idx[c]);
    let mut bounds = vec![0usize; groups + 1];
    for &c in &order {
        bounds[q.g_idx[c] as usize + 1] += 1;
    }
    for g in 0..groups {
        bounds[g + 1] += bounds[g];
    }
    (order, bounds)
}

/// The normal equations of every row, on the CPU in f64: `A` (`[N, G, G]`) and `b` (`[N, G]`),
/// computed on the Hessian's device from the codes, weights and Hessian in sorted column order.
fn normal_equations(
    q: &QuantizedLinear,
    w: &Tensor,
    h: &Tensor,
    order: &[usize],
    bounds: &[usize],
    dev: &Device,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (n, k) = (q.n, q.k);
    let groups = bounds.len() - 1;
    // Codes minus zero points, `[N, K]` in sorted column order: q = scale · c.
    let mut c = vec![0f32; n * k];
    c.par_chunks_mut(k).enumerate().for_each(|(r, row)| {
        for (j, v) in row.iter_mut().enumerate() {
            let col = order[j];
            let g = q.g_idx[col] as usize;
            *v = q.codes[r * k + col] as f32 - q.zeros[g * n + r] as f32;
        }
    });
    let idx = Tensor::from_vec(order.iter().map(|&c| c as u32).collect(), k, dev)?;
    let cs = Tensor::from_vec(c, (n, k), &Device::Cpu)?.to_device(dev)?;
    let ws = w
        .to_dtype(DType::F32)?
        .to_device(dev)?
        .index_select(&idx, 1)?;
    let hs = h
        .to_dtype(DType::F32)?
        .index_select(&idx, 0)?
        .index_select(&idx, 1)?;
    // b[r][g] = Σ_{i∈g} c[r][i]·(w·H)[r][i]; A[r][g][h] = Σ_{i∈g} c[r][i]·(c_h·H_h)[r][i].
    let b = group_sums(&(&cs * ws.matmul(&hs)?)?, bounds)?;
    let mut a_cols = Vec::with_capacity(groups);
    for g in 0..groups {
        let (lo, len) = (bounds[g], bounds[g + 1] - bounds[g]);
        // The GPU's matmul takes contiguous operands only: the column block is copied out.
        let t = cs
            .narrow(1, lo, len)?
            .contiguous()?
            .matmul(&hs.narrow(0, lo, len)?.contiguous()?)?;
        a_cols.push(group_sums(&(&cs * t)?, bounds)?);
    }
    let a = Tensor::stack(&a_cols, 2)?; // [N, G(row), G(col)]
    let a = a.to_dtype(DType::F64)?.to_device(&Device::Cpu)?;
    let b = b.to_dtype(DType::F64)?.to_device(&Device::Cpu)?;
    let a = a.flatten_all()?.to_vec1::<f64>()?;
    let b = b.flatten_all()?.to_vec1::<f64>()?;
    Ok((a, b))
}

/// Σ over the columns of each group of `m` (`[N, K]` sorted) → `[N, G]`.
fn group_sums(m: &Tensor, bounds: &[usize]) -> Result<Tensor> {
    let groups = bounds.len() - 1;
    let cols: Vec<Tensor> = (0..groups)
        .map(|g| {
            m.narrow(1, bounds[g], bounds[g + 1] - bounds[g])?
                .sum_keepdim(1)
        })
        .collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&cols, 1)?)
}

/// Each row's constant `w·H·wᵀ`, in f64 on the CPU.
fn row_constants(w: &Tensor, h: &Tensor, dev: &Device) -> Result<Vec<f64>> {
    let wh = w
        .to_dtype(DType::F32)?
        .to_device(dev)?
        .matmul(&h.to_dtype(DType::F32)?)?;
    Ok((wh * w.to_dtype(DType::F32)?.to_device(dev)?)?
        .sum(D::Minus1)?
        .to_dtype(DType::F64)?
        .to_device(&Device::Cpu)?
        .to_vec1::<f64>()?)
}

/// The error of a row up to its constant `w·H·wᵀ`: sᵀAs − 2bᵀs.
fn row_error(a: &[f64], b: &[f64], s: &[f64], groups: usize) -> f64 {
    let mut e = 0.0;
    for i in 0..groups {
        let mut row = 0.0;
        for j in 0..groups {
            row += a[i * groups + j] * s[j];
        }
        e += s[i] * row - 2.0 * b[i] * s[i];
    }
    e
}

/// One row's refit: the new scales as stored (fp16-rounded) when they lower the row's error,
/// and the error before and after (both the old error when the row keeps its scales).
fn refit_row(ar: &[f64], br: &[f64], old: &[f64], groups: usize) -> (Option<Vec<f32>>, f64, f64) {
    let before = row_error(ar, br, old, groups);
    let Some(s) = solve_ridge(ar, br, old, groups) else {
        return (None, before, before);
    };
    let stored: Vec<f64> = s.iter().map(|&v| f16::from_f64(v).to_f64()).collect();
    let ok = stored.iter().all(|v| v.is_finite() && *v > 0.0);
    let after = if ok {
        row_error(ar, br, &stored, groups)
    } else {
        f64::INFINITY
    };
    if after < before {
        (
            Some(stored.iter().map(|&v| v as f32).collect()),
            before,
            after,
        )
    } else {
        (None, before, before)
    }
}

/// Solves `(A + λ·D)·s = b + λ·D·s_old` (`D` the diagonal of `A`, floored) by Cholesky in f64;
/// `None` when the system is not positive definite.
fn solve_ridge(a: &[f64], b: &[f64], old: &[f64], g: usize) -> Option<Vec<f64>> {
    let mean = (0..g).map(|i| a[i * g + i]).sum::<f64>() / g as f64;
    let floor = mean.max(f64::MIN_POSITIVE) * 1e-9;
    let mut m = a.to_vec();
    let mut rhs = b.to_vec();
    for i in 0..g {
        let d = RIDGE * a[i * g + i].max(floor);
        m[i * g + i] += d;
        rhs[i] += d * old[i];
    }
    // In-place Cholesky m = L·Lᵀ (lower).
    for j in 0..g {
        let mut d = m[j * g + j];
        for t in 0..j {
            d -= m[j * g + t] * m[j * g + t];
        }
        if d.is_nan() || d <= 0.0 {
            return None;
        }
        let d = d.sqrt();
        m[j * g + j] = d;
        for i in j + 1..g {
            let mut v = m[i * g + j];
            for t in 0..j {
                v -= m[i * g + t] * m[j * g + t];
            }
            m[i * g + j] = v / d;
        }
    }
    for i in 0..g {
        let mut v = rhs[i];
        for t in 0..i {
            v -= m[i * g + t] * rhs[t];
        }
        rhs[i] = v / m[i * g + i];
    }
    for i in (0..g).rev() {
        let mut v = rhs[i];
        for t in i + 1..g {
            v -= m[t * g + i] * rhs[t];
        }
        rhs[i] = v / m[i * g + i];
    }
    rhs.iter().all(|v| v.is_finite()).then_some(rhs)
}
