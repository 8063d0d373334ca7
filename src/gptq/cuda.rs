//! The GPTQ solve on a CUDA device (feature `cuda`), the twin of `solver.rs`: the same
//! [`SolvePlan`], the same steps, on the raw kernels and cuBLAS/cuSOLVER calls of
//! `crate::kernels::cuda`:
//!
//! * [`factorize`]: the damped, permuted Hessian in f64, its Cholesky factor (`potrf`) and the
//!   inverse of that factor by a recursive blocked triangular inverse, with the damping
//!   escalation;
//! * [`solve`]: group parameters, the fused in-block column loop (one warp per output row) and
//!   one cuBLAS SGEMM per block for the lazy update; codes, scales and zeros come back to the host.
//!
//! `tests/cuda/twins.rs` compares both with the CPU solver on a GPU machine.

use std::time::Instant;

use anyhow::{bail, ensure, Result};
use candle_core::{CudaDevice, DType, Tensor};
use cudarc::cublas::sys as cublas;
use cudarc::cusolver::sys as cusolver;
use cudarc::driver::CudaSlice;

use super::plan::{ParamsAt, SolvePlan};
use super::types::{
    check_finite_one, dead_columns_and_order, not_positive_definite, FactorData, Factorization,
    QuantizedLinear, SolveOptions, SolveTimings,
};
use crate::kernels::cuda::{
    blocks, codes_to_host, count_nonfinite, cublas_ok, cuda, cusolver_ok, diagonal, launch,
    launch_cfg, lower_inverse, slice_ptr, solver_handle, tensor_ptr, upload, wrap, Real, Trace,
};
use crate::scheme::FactorPrecision;

/// The factorization of a Hessian on its GPU (the twin of `solver::factorize`): dead columns,
/// the processing order, and U (row-major f32) of the damped, permuted H⁻¹ in f64.
pub(super) fn factorize(h: &Tensor, opts: &SolveOptions) -> Result<Factorization> {
    let module = &opts.module;
    let dev = cuda(h.device())?;
    let stream = dev.cuda_stream();
    let k = h.dim(0)?;
    let t = Instant::now();
    let mut trace = Trace::new(&stream, k);
    let h = h.to_dtype(DType::F32)?.contiguous()?;
    if count_nonfinite(dev, &h)? > 0 {
        // The CPU check names the first bad element.
        check_finite_one(&h, "Hessian", module)?;
        bail!("module {module}: Hessian contains NaN or Inf");
    }
    trace.lap("finite check")?;
    // Dead columns and the processing order, exactly as on the CPU (docs/algorithm.md,
    // Preprocessing of H).
    let mut diag = diagonal(&h)?;
    let (dead, perm) = dead_columns_and_order(&mut diag, opts.act_order);
    let mean_diag = diag.iter().map(|&d| d as f64).sum::<f64>() / k as f64;
    trace.lap("diag + order")?;
    let (u, damp_used) =
        inverse_cholesky_upper(dev, &h, k, &perm, opts.damp, mean_diag, opts.factor, module)?;
    stream.synchronize()?;
    Ok(Factorization {
        k,
        dead,
        perm,
        damp_used,
        seconds: t.elapsed().as_secs_f64(),
        act_order: opts.act_order,
        u: FactorData::Cuda(wrap(u, dev, &[k, k])),
        correction: None,
    })
}

/// U with `H⁻¹ = UᵀU`, row-major f32 `[K, K]`, of `H` permuted by `perm` and damped (the same
/// identity as the CPU twin: one Cholesky of `J·H·J` and one triangular inverse, in f64, or in
/// f32 with `--factor-precision f32`). L⁻¹ is a recursive blocked inverse whose work is two
/// triangular matrix products per level (K³/3 FLOP in all, against K³ for a triangular solve
/// against I; docs/decisions.md, L⁻¹ on the GPU by a recursive blocked inverse).
#[allow(clippy::too_many_arguments)]
fn inverse_cholesky_upper(
    dev: &CudaDevice,
    h: &Tensor,
    k: usize,
    perm: &[usize],
    damp: f64,
    mean_diag: f64,
    precision: FactorPrecision,
    module: &str,
) -> Result<(CudaSlice<f32>, f64)> {
    let real = match precision {
        FactorPrecision::F32 => Real::F32,
        FactorPrecision::F64 | FactorPrecision::Auto => Real::F64,
    };
    let stream = dev.cuda_stream();
    let solver = solver_handle(dev)?;
    let rev: Vec<i32> = perm.iter().rev().map(|&j| j as i32).collect();
    let rev_d = upload(&stream, &rev)?;
    let rev_p = slice_ptr(&rev_d, &stream);
    let hp = tensor_ptr(h)?;
    let a: CudaSlice<u8> = unsafe { stream.alloc(k * k * real.bytes()) }?;
    let ap = slice_ptr(&a, &stream);
    let info: CudaSlice<i32> = stream.alloc_zeros(1)?;
    let info_p = slice_ptr(&info, &stream);
    let u: CudaSlice<f32> = unsafe { stream.alloc(k * k) }?;
    let u_p = slice_ptr(&u, &stream);
    let mut bad: CudaSlice<i32> = stream.alloc_zeros(1)?;
    let bad_p = slice_ptr(&bad, &stream);
    let lower = cusolver::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;
    let mut lwork = 0i32;
    cusolver_ok(
        unsafe {
            match real {
                Real::F64 => cusolver::cusolverDnDpotrf_bufferSize(
                    solver.cu(),
                    lower,
                    k as i32,
                    ap as *mut f64,
                    k as i32,
                    &mut lwork,
                ),
                Real::F32 => cusolver::cusolverDnSpotrf_bufferSize(
                    solver.cu(),
                    lower,
                    k as i32,
                    ap as *mut f32,
                    k as i32,
                    &mut lwork,
                ),
            }
        },
        "potrf_bufferSize",
    )?;
    let work: CudaSlice<u8> = unsafe { stream.alloc(lwork.max(1) as usize * real.bytes()) }?;
    let work_p = slice_ptr(&work, &stream);
    let inv: CudaSlice<u8> = unsafe { stream.alloc(k * k * real.bytes()) }?;
    let inv_p = slice_ptr(&inv, &stream);
    let mut trace = Trace::new(&stream, k);
    let mut damp = damp;
    let grid = launch_cfg((blocks(k, 256), k as u32, 1), (256, 1, 1));
    loop {
        launch(
            dev,
            &format!("gather_damped_{}", real.suffix()),
            grid,
            &[&hp, &rev_p, &ap, &(k as i32), &(damp * mean_diag)],
        )?;
        trace.lap("gather")?;
        cusolver_ok(
            unsafe {
                match real {
                    Real::F64 => cusolver::cusolverDnDpotrf(
                        solver.cu(),
                        lower,
                        k as i32,
                        ap as *mut f64,
                        k as i32,
                        work_p as *mut f64,
                        lwork,
                        info_p as *mut i32,
                    ),
                    Real::F32 => cusolver::cusolverDnSpotrf(
                        solver.cu(),
                        lower,
                        k as i32,
                        ap as *mut f32,
                        k as i32,
                        work_p as *mut f32,
                        lwork,
                        info_p as *mut i32,
                    ),
                }
            },
            "potrf",
        )?;
        let ok = stream.clone_dtoh(&info)?[0] == 0;
        trace.lap("potrf")?;
        if ok {
            // L⁻¹ into X (lower triangle; the reversal reads only that). X starts as I.
            launch(
                dev,
                &format!("set_identity_{}", real.suffix()),
                grid,
                &[&inv_p, &(k as i32)],
            )?;
            lower_inverse(dev, ap, inv_p, k, real)?;
            trace.lap("recursive inverse")?;
            stream.memset_zeros(&mut bad)?;
            let reverse = match real {
                Real::F64 => "reverse_upper_f32",
                Real::F32 => "reverse_upper_from_f32",
            };
            launch(
                dev,
                reverse,
                launch_cfg((blocks(k, 32), blocks(k, 32), 1), (32, 8, 1)),
                &[&inv_p, &u_p, &(k as i32), &bad_p],
            )?;
            let good = stream.clone_dtoh(&bad)?[0] == 0;
            trace.lap("reverse")?;
            if good {
                return Ok((u, damp));
            }
        }
        if damp >= 1.0 {
            return Err(not_positive_definite(module, mean_diag));
        }
        damp = (damp * 2.0).min(1.0);
    }
}

/// The GPTQ solve of `w` `[N, K]` on its CUDA device with the factorization `f` (U = `u`, on
/// the same device) and the plan both backends follow. Codes, scales and zeros come back to the
/// host.
/// `find_params_tiled`'s block: rows per block, the most columns a group may have, and the
/// threads that share a row's MSE candidates (gptq.cu `FP_TILE_ROWS`, `FP_TILE_COLS`, at most
/// `FP_MAX_PARTS`).
const FIND_PARAMS_TILE_ROWS: usize = 64;
const FIND_PARAMS_TILE_COLS: usize = 128;
const FIND_PARAMS_PARTS: usize = 4;

pub(super) fn solve(
    w: &Tensor,
    f: &Factorization,
    u: &Tensor,
    plan: &SolvePlan,
    opts: &SolveOptions,
) -> Result<QuantizedLinear> {
    let module = &opts.module;
    let quant = &opts.quant;
    let dev = cuda(w.device())?;
    ensure!(
        u.device().same_device(w.device()),
        "internal: module {module}: the weight and its factorization are on different devices"
    );
    let stream = dev.cuda_stream();
    let (n, k) = w.dims2()?;
    let t_prep = Instant::now();
    let mut trace = Trace::new(&stream, k);
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    if count_nonfinite(dev, &w)? > 0 {
        check_finite_one(&w, "weight", module)?;
        bail!("module {module}: weight contains NaN or Inf");
    }
    trace.lap("weight to f32 + finiteness check")?;
    let (g, n_groups) = (plan.group_len, plan.n_groups);
    let maxq = quant.maxq();
    let (dead, damp_used) = (&f.dead, f.damp_used);

    let mut scales: CudaSlice<f32> = stream.alloc_zeros(n_groups * n)?;
    let mut zeros: CudaSlice<f32> = stream.alloc_zeros(n_groups * n)?;
    // Parameters of `groups` groups from column `col0` on (group rows from `row0`).
    let params = |src: u64,
                  col0: usize,
                  col_end: usize,
                  groups: usize,
                  row0: usize,
                  scales: &mut CudaSlice<f32>,
                  zeros: &mut CudaSlice<f32>|
     -> Result<()> {
        let (sp, zp) = (slice_ptr(scales, &stream), slice_ptr(zeros, &stream));
        // Groups of up to 128 columns go through the shared-memory kernel (same arithmetic in
        // the same order, so the same bits; the MSE search's 80 passes over each group were
        // bound by uncoalesced loads); a whole-row group through the plain one.
        // With the search on, FIND_PARAMS_PARTS threads share each row's candidates.
        let tiled = g <= FIND_PARAMS_TILE_COLS;
        let (name, rows_per_block, threads) = if tiled {
            let parts = if quant.mse { FIND_PARAMS_PARTS } else { 1 };
            (
                "find_params_tiled",
                FIND_PARAMS_TILE_ROWS,
                FIND_PARAMS_TILE_ROWS * parts,
            )
        } else {
            ("find_params", 128, 128)
        };
        launch(
            dev,
            name,
            launch_cfg(
                (blocks(n, rows_per_block), groups as u32, 1),
                (threads as u32, 1, 1),
            ),
            &[
                &src,
                &(k as i32),
                &(n as i32),
                &(col0 as i32),
                &(col_end as i32),
                &(g as i32),
                &(groups as i32),
                &(row0 as i32),
                &(quant.bits as i32),
                &(quant.sym as i32),
                &(quant.mse as i32),
                &sp,
                &zp,
            ],
        )
    };
    // One group takes its parameters from the whole matrix, before dead columns are zeroed
    // (docs/algorithm.md, Post-processing).
    if plan.params_at == ParamsAt::Whole {
        params(tensor_ptr(&w)?, 0, k, 1, 0, &mut scales, &mut zeros)?;
    }
    let w = if dead.is_empty() {
        w
    } else {
        let mut keep = vec![1f32; k];
        for &i in dead {
            keep[i] = 0.0;
        }
        w.broadcast_mul(&Tensor::from_vec(keep, (1, k), w.device())?)?
    };
    if plan.params_at == ParamsAt::BeforeLoop {
        params(tensor_ptr(&w)?, 0, k, n_groups, 0, &mut scales, &mut zeros)?;
    }
    let param_row: Vec<i32> = plan.param_row.iter().map(|&r| r as i32).collect();
    let perm_u32: Vec<u32> = plan.perm.iter().map(|&j| j as u32).collect();
    let w_perm = w
        .index_select(&Tensor::from_vec(perm_u32, k, w.device())?, 1)?
        .contiguous()?;
    drop(w);
    trace.lap("params + permute W")?;
    let factor_s = f.seconds;

    // The column loop on the GPU (docs/algorithm.md, The column loop).
    let bs = opts.block_size;
    let blas = dev.cublas_handle();
    ensure!(
        bs <= 128,
        "internal: the CUDA column loop holds at most 128 columns per block, got {bs}"
    );
    let codes: CudaSlice<u8> = stream.alloc_zeros(n * k)?;
    let err1: CudaSlice<f32> = stream.alloc_zeros(n * bs)?;
    let loss: CudaSlice<f64> = stream.alloc_zeros(n)?;
    let param_row_d = upload(&stream, &param_row)?;
    let wp = tensor_ptr(&w_perm)?;
    let up = tensor_ptr(u)?;
    let (codes_p, err1_p, loss_p) = (
        slice_ptr(&codes, &stream),
        slice_ptr(&err1, &stream),
        slice_ptr(&loss, &stream),
    );
    let param_p = slice_ptr(&param_row_d, &stream);
    // Codes are written in processing order (a null perm) and reordered once after the loop.
    let no_perm = 0u64;
    let (mut block_s, mut update_s) = (0.0f64, 0.0f64);
    for i1 in (0..k).step_by(bs) {
        let i2 = (i1 + bs).min(k);
        let width = i2 - i1;
        let t_block = trace.split_start()?;
        let starting = plan.groups_starting_in(i1..i2);
        if !starting.is_empty() {
            let first = plan.group_cols(starting.start).start;
            params(
                wp,
                first,
                k,
                starting.len(),
                starting.start,
                &mut scales,
                &mut zeros,
            )?;
        }
        let (sp, zp) = (slice_ptr(&scales, &stream), slice_ptr(&zeros, &stream));
        const WARPS: usize = 8;
        launch(
            dev,
            "gptq_block",
            launch_cfg((blocks(n, WARPS), 1, 1), ((WARPS * 32) as u32, 1, 1)),
            &[
                &wp,
                &up,
                &(n as i32),
                &(k as i32),
                &(i1 as i32),
                &(width as i32),
                &sp,
                &zp,
                &param_p,
                &no_perm,
                &maxq,
                &codes_p,
                &err1_p,
                &loss_p,
            ],
        )?;
        block_s += trace.split_end(t_block)?;
        let t_update = trace.split_start()?;
        if i2 < k {
            // Row-major W[:, i2:] -= Err1 · U[i1:i2, i2:], i.e. column-major
            // Wᵀ[i2:, :] -= U[i1:i2, i2:]ᵀ · Err1ᵀ.
            let (alpha, beta) = (-1.0f32, 1.0f32);
            let status = unsafe {
                cublas::cublasSgemm_v2(
                    *blas.handle(),
                    cublas::cublasOperation_t::CUBLAS_OP_N,
                    cublas::cublasOperation_t::CUBLAS_OP_N,
                    (k - i2) as i32,
                    n as i32,
                    width as i32,
                    &alpha,
                    (up + ((i1 * k + i2) * 4) as u64) as *const f32,
                    k as i32,
                    err1_p as *const f32,
                    width as i32,
                    &beta,
                    (wp + (i2 * 4) as u64) as *mut f32,
                    k as i32,
                )
            };
            cublas_ok(status, "Sgemm (lazy update)")?;
        }
        update_s += trace.split_end(t_update)?;
    }
    trace.lap("column loop")?;
    let invperm_i32: Vec<i32> = plan.invperm.iter().map(|&c| c as i32).collect();
    let invperm_d = upload(&stream, &invperm_i32)?;
    let ordered: CudaSlice<u8> = unsafe { stream.alloc(n * k) }?;
    launch(
        dev,
        "unpermute_codes",
        launch_cfg((blocks(k, 256), n as u32, 1), (256, 1, 1)),
        &[
            &codes_p,
            &slice_ptr(&invperm_d, &stream),
            &(n as i32),
            &(k as i32),
            &slice_ptr(&ordered, &stream),
        ],
    )?;
    trace.lap("codes to the original column order")?;
    trace.splits(&[
        ("in-block kernels", block_s),
        ("lazy-update GEMMs", update_s),
    ]);
    let codes = codes_to_host(&stream, &ordered)?;
    let device_codes = wrap(ordered, dev, &[n, k]);
    let scales = stream.clone_dtoh(&scales)?;
    let zeros = stream.clone_dtoh(&zeros)?;
    let loss_rows = stream.clone_dtoh(&loss)?;
    trace.lap("codes, scales, zeros, loss to the host")?;
    let loop_s = t_prep.elapsed().as_secs_f64();
    drop(w_perm);
    if loss_rows.iter().any(|l| !l.is_finite()) {
        bail!("module {module}: the GPU solve produced a non-finite loss (damp {damp_used})");
    }
    Ok(QuantizedLinear {
        n,
        k,
        codes,
        scales,
        zeros: zeros.iter().map(|&z| z as u8).collect(),
        g_idx: plan.g_idx.clone(),
        // Row order, as on the CPU.
        loss: loss_rows.iter().sum(),
        damp_used,
        dead_columns: dead.len(),
        timings: SolveTimings { factor_s, loop_s },
        device_codes: Some(device_codes),
    })
}
