//! The GPTQ solve on a CUDA device (feature `cuda`), the twin of `solver.rs`: the same
//! [`SolvePlan`], the same steps, on the raw kernels and cuBLAS/cuSOLVER calls of
//! `crate::kernels`:
//!
//! * [`factorize`]: the damped, permuted Hessian in f64, its Cholesky factor (`potrf`) and the
//!   inverse of that factor by a recursive blocked triangular inverse, with the damping
//!   escalation;
//! * [`solve`]: group parameters, the fused in-block column loop (one warp per output row) and
//!   one cuBLAS SGEMM per block for the lazy update; codes, scales and zeros come back to the host.
//!
//! `tests/cuda/twins.rs` compares both with the CPU solver on a GPU machine.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Result};
use candle_core::{CudaDevice, DType, Device, Tensor};
use cudarc::cublas::sys as cublas;
use cudarc::cublas::CudaBlas;
use cudarc::cusolver::{sys as cusolver, DnHandle};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};

use super::plan::{ParamsAt, SolvePlan};
use super::quantizer::QuantParams;
use super::types::{
    check_finite_one, dead_columns_and_order, not_positive_definite, FactorData, Factorization,
    QuantizedLinear, SolveOptions, SolveTimings,
};
use crate::kernels::blas::{by_real, cublas_ok, cusolver_ok, lower_inverse, solver_handle, Real};
use crate::kernels::cuda::{blocks, cuda, launch, launch_cfg, slice_ptr, tensor_ptr, upload, wrap};
use crate::kernels::trace::Trace;
use crate::kernels::transfer::codes_to_host;
use crate::kernels::xtx::{count_nonfinite, diagonal};
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
    Ok(Factorization::new(
        FactorData::Cuda(wrap(u, dev, &[k, k])),
        dead,
        perm,
        damp_used,
        opts.act_order,
        t,
    ))
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
    let chol = Cholesky {
        dev,
        stream: &stream,
        solver: &solver,
        real,
        k,
        grid: launch_cfg((blocks(k, 256), k as u32, 1), (256, 1, 1)),
    };
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
    let lwork = chol.potrf_buffer_size(ap)?;
    let work: CudaSlice<u8> = unsafe { stream.alloc(lwork.max(1) as usize * real.bytes()) }?;
    let work_p = slice_ptr(&work, &stream);
    let inv: CudaSlice<u8> = unsafe { stream.alloc(k * k * real.bytes()) }?;
    let inv_p = slice_ptr(&inv, &stream);
    let mut trace = Trace::new(&stream, k);
    let mut damp = damp;
    loop {
        chol.gather_damped(hp, rev_p, ap, damp * mean_diag)?;
        trace.lap("gather")?;
        chol.potrf(ap, work_p, lwork, info_p)?;
        let ok = stream.clone_dtoh(&info)?[0] == 0;
        trace.lap("potrf")?;
        if ok && chol.inverse_upper(ap, inv_p, u_p, &mut bad, bad_p, &mut trace)? {
            return Ok((u, damp));
        }
        if damp >= 1.0 {
            return Err(not_positive_definite(module, mean_diag));
        }
        damp = (damp * 2.0).min(1.0);
    }
}

/// The steps of [`inverse_cholesky_upper`] on one device in one precision: the device, its
/// stream and cuSOLVER handle, the precision, K and the launch shape of the element-wise
/// kernels. The buffers stay with the caller, which frees them where it always did.
struct Cholesky<'a> {
    dev: &'a CudaDevice,
    stream: &'a Arc<CudaStream>,
    solver: &'a DnHandle,
    real: Real,
    k: usize,
    grid: LaunchConfig,
}

impl Cholesky<'_> {
    /// The workspace `potrf` needs for the `[K, K]` matrix at `ap`, in elements.
    fn potrf_buffer_size(&self, ap: u64) -> Result<i32> {
        let (k, lower) = (self.k, cusolver::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER);
        let mut lwork = 0i32;
        cusolver_ok(
            unsafe {
                by_real!(
                    self.real,
                    cusolver::cusolverDnDpotrf_bufferSize,
                    cusolver::cusolverDnSpotrf_bufferSize,
                    |R| (
                        self.solver.cu(),
                        lower,
                        k as i32,
                        ap as *mut R,
                        k as i32,
                        &mut lwork
                    )
                )
            },
            "potrf_bufferSize",
        )?;
        Ok(lwork)
    }

    /// A = J·H[perm][:, perm]·J at `ap` (column-major, in the factor's precision) from H at
    /// `hp`, gathered through the reversed order at `rev_p`, with `damp_add` added to the
    /// diagonal (a zero diagonal, a dead column, becomes 1 first).
    fn gather_damped(&self, hp: u64, rev_p: u64, ap: u64, damp_add: f64) -> Result<()> {
        launch(
            self.dev,
            &format!("gather_damped_{}", self.real.suffix()),
            self.grid,
            &[&hp, &rev_p, &ap, &(self.k as i32), &damp_add],
        )
    }

    /// The Cholesky factor L of A in place at `ap` (lower triangle), with the workspace at
    /// `work_p` and the status at `info_p` (0 when A is positive definite).
    fn potrf(&self, ap: u64, work_p: u64, lwork: i32, info_p: u64) -> Result<()> {
        let (k, lower) = (self.k, cusolver::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER);
        cusolver_ok(
            unsafe {
                by_real!(
                    self.real,
                    cusolver::cusolverDnDpotrf,
                    cusolver::cusolverDnSpotrf,
                    |R| (
                        self.solver.cu(),
                        lower,
                        k as i32,
                        ap as *mut R,
                        k as i32,
                        work_p as *mut R,
                        lwork,
                        info_p as *mut i32
                    )
                )
            },
            "potrf",
        )
    }

    /// U = J·L⁻¹·J (row-major f32 at `u_p`) from the factor L at `ap`: L⁻¹ into X at `inv_p`
    /// by the recursive blocked inverse, then reversed into U. Returns whether U is good: the
    /// reversal sets the flag `bad` (at `bad_p`) when a kept value is not finite or a diagonal
    /// is not positive.
    fn inverse_upper(
        &self,
        ap: u64,
        inv_p: u64,
        u_p: u64,
        bad: &mut CudaSlice<i32>,
        bad_p: u64,
        trace: &mut Trace,
    ) -> Result<bool> {
        let (dev, k, real) = (self.dev, self.k, self.real);
        // L⁻¹ into X (lower triangle; the reversal reads only that). X starts as I.
        launch(
            dev,
            &format!("set_identity_{}", real.suffix()),
            self.grid,
            &[&inv_p, &(k as i32)],
        )?;
        lower_inverse(dev, ap, inv_p, k, real)?;
        trace.lap("recursive inverse")?;
        self.stream.memset_zeros(bad)?;
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
        let good = self.stream.clone_dtoh(bad)?[0] == 0;
        trace.lap("reverse")?;
        Ok(good)
    }
}

/// `find_params_tiled`'s block: rows per block, the most columns a group may have, and the
/// threads that share a row's MSE candidates (gptq.cu `FP_TILE_ROWS`, `FP_TILE_COLS`, at most
/// `FP_MAX_PARTS`).
const FIND_PARAMS_TILE_ROWS: usize = 64;
const FIND_PARAMS_TILE_COLS: usize = 128;
const FIND_PARAMS_PARTS: usize = 4;

/// The GPTQ solve of `w` `[N, K]` on its CUDA device with the factorization `f` (U = `u`, on
/// the same device) and the plan both backends follow. Codes, scales and zeros come back to the
/// host.
///
/// The phases run in order on the device's one stream: the weight in f32 and its finiteness
/// check, group parameters taken before the loop where the plan says so, dead columns zeroed and
/// W permuted, the [`ColumnLoop`], the codes back in the original column order, and the results
/// to the host. Every buffer lives in this function, so each is freed where it always was.
pub(super) fn solve(
    w: &Tensor,
    f: &Factorization,
    u: &Tensor,
    plan: &SolvePlan,
    opts: &SolveOptions,
) -> Result<QuantizedLinear> {
    let module = &opts.module;
    let dev = cuda(w.device())?;
    ensure!(
        u.device().same_device(w.device()),
        "internal: module {module}: the weight and its factorization are on different devices"
    );
    let stream = dev.cuda_stream();
    let (n, k) = w.dims2()?;
    let t_prep = Instant::now();
    let mut trace = Trace::new(&stream, k);
    let w = finite_f32_weight(dev, w, module)?;
    trace.lap("weight to f32 + finiteness check")?;
    let (n_groups, dead, damp_used) = (plan.n_groups, &f.dead, f.damp_used);
    let mut scales: CudaSlice<f32> = stream.alloc_zeros(n_groups * n)?;
    let mut zeros: CudaSlice<f32> = stream.alloc_zeros(n_groups * n)?;
    let params = GroupParams::new(dev, &stream, &opts.quant, (n, k), plan.group_len);
    // One group takes its parameters from the whole matrix, before dead columns are zeroed
    // (docs/algorithm.md, Post-processing).
    if plan.params_at == ParamsAt::Whole {
        params.find(tensor_ptr(&w)?, 0..k, 1, 0, &mut scales, &mut zeros)?;
    }
    let w = if dead.is_empty() {
        w
    } else {
        w.broadcast_mul(&live_columns(dead, k, w.device())?)?
    };
    if plan.params_at == ParamsAt::BeforeLoop {
        params.find(tensor_ptr(&w)?, 0..k, n_groups, 0, &mut scales, &mut zeros)?;
    }
    let param_row: Vec<i32> = plan.param_row.iter().map(|&r| r as i32).collect();
    let w_perm = permute_columns(&w, &plan.perm, k)?;
    drop(w);
    trace.lap("params + permute W")?;

    // The column loop on the GPU (docs/algorithm.md, The column loop).
    let bs = opts.block_size;
    let blas = dev.cublas_handle();
    let bufs = LoopBuffers::alloc(&stream, n, k, bs, &param_row)?;
    let columns = ColumnLoop::new(&params, &blas, &bufs, &w_perm, u, bs)?;
    let splits = columns.run(plan, &trace, &mut scales, &mut zeros)?;
    trace.lap("column loop")?;
    let (ordered, _invperm_d) = unpermute_codes(dev, &stream, plan, columns.codes_p, n, k)?;
    trace.lap("codes to the original column order")?;
    trace.splits(&splits);
    let codes = codes_to_host(&stream, &ordered)?;
    let device_codes = wrap(ordered, dev, &[n, k]);
    let scales = stream.clone_dtoh(&scales)?;
    let zeros = stream.clone_dtoh(&zeros)?;
    let loss_rows = stream.clone_dtoh(&bufs.loss)?;
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
        timings: SolveTimings {
            factor_s: f.seconds,
            loop_s,
        },
        device_codes: Some(device_codes),
    })
}

/// `w` in f32 and contiguous, after counting its non-finite elements on the device; when there
/// are any, the CPU check names the first bad element.
fn finite_f32_weight(dev: &CudaDevice, w: &Tensor, module: &str) -> Result<Tensor> {
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    if count_nonfinite(dev, &w)? > 0 {
        check_finite_one(&w, "weight", module)?;
        bail!("module {module}: weight contains NaN or Inf");
    }
    Ok(w)
}

/// The `[1, K]` mask that zeroes the dead columns of W: 0 at each dead column, 1 elsewhere.
fn live_columns(dead: &[usize], k: usize, device: &Device) -> Result<Tensor> {
    let mut keep = vec![1f32; k];
    for &i in dead {
        keep[i] = 0.0;
    }
    Ok(Tensor::from_vec(keep, (1, k), device)?)
}

/// W `[N, K]` with its columns in processing order (`perm`), contiguous.
fn permute_columns(w: &Tensor, perm: &[usize], k: usize) -> Result<Tensor> {
    let perm_u32: Vec<u32> = perm.iter().map(|&j| j as u32).collect();
    Ok(
        w.index_select(&Tensor::from_vec(perm_u32, k, w.device())?, 1)?
            .contiguous()?,
    )
}

/// The launches of `find_params` and `find_params_tiled` on one weight: the device and its
/// stream, the weight's shape `[N, K]`, the group length and the quantizer.
struct GroupParams<'a> {
    dev: &'a CudaDevice,
    stream: &'a Arc<CudaStream>,
    quant: &'a QuantParams,
    n: usize,
    k: usize,
    g: usize,
}

impl<'a> GroupParams<'a> {
    fn new(
        dev: &'a CudaDevice,
        stream: &'a Arc<CudaStream>,
        quant: &'a QuantParams,
        (n, k): (usize, usize),
        g: usize,
    ) -> Self {
        Self {
            dev,
            stream,
            quant,
            n,
            k,
            g,
        }
    }

    /// Parameters of `groups` groups from column `cols.start` on (group rows from `row0`), read
    /// from the `[N, K]` matrix at `src` up to column `cols.end`, into `scales` and `zeros`.
    fn find(
        &self,
        src: u64,
        cols: Range<usize>,
        groups: usize,
        row0: usize,
        scales: &mut CudaSlice<f32>,
        zeros: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (n, k, g, quant) = (self.n, self.k, self.g, self.quant);
        let (col0, col_end) = (cols.start, cols.end);
        let (sp, zp) = (
            slice_ptr(scales, self.stream),
            slice_ptr(zeros, self.stream),
        );
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
            self.dev,
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
    }
}

/// The column loop's device buffers: the codes in processing order, the block's errors Err1,
/// each row's loss and each column's parameter row. The fields are declared in the reverse of
/// their allocation order, so that they are freed in the order of the locals they replace.
struct LoopBuffers {
    param_row: CudaSlice<i32>,
    loss: CudaSlice<f64>,
    err1: CudaSlice<f32>,
    codes: CudaSlice<u8>,
}

impl LoopBuffers {
    /// Allocates the buffers for `[N, K]` and blocks of `bs` columns (at most 128, the most the
    /// in-block kernel holds) and uploads `param_row`.
    fn alloc(
        stream: &Arc<CudaStream>,
        n: usize,
        k: usize,
        bs: usize,
        param_row: &[i32],
    ) -> Result<Self> {
        ensure!(
            bs <= 128,
            "internal: the CUDA column loop holds at most 128 columns per block, got {bs}"
        );
        let codes: CudaSlice<u8> = stream.alloc_zeros(n * k)?;
        let err1: CudaSlice<f32> = stream.alloc_zeros(n * bs)?;
        let loss: CudaSlice<f64> = stream.alloc_zeros(n)?;
        let param_row = upload(stream, param_row)?;
        Ok(Self {
            param_row,
            loss,
            err1,
            codes,
        })
    }
}

/// The blocked column loop with lazy updates on the device: the permuted W (updated in place)
/// and U it reads, the [`LoopBuffers`] it writes, and the handles of its launches and GEMMs.
struct ColumnLoop<'a> {
    params: &'a GroupParams<'a>,
    blas: &'a CudaBlas,
    bs: usize,
    wp: u64,
    up: u64,
    codes_p: u64,
    err1_p: u64,
    loss_p: u64,
    param_p: u64,
}

impl<'a> ColumnLoop<'a> {
    /// The loop over `w_perm` (W in processing order) and `u` (U) in blocks of `bs` columns.
    fn new(
        params: &'a GroupParams<'a>,
        blas: &'a CudaBlas,
        bufs: &LoopBuffers,
        w_perm: &Tensor,
        u: &Tensor,
        bs: usize,
    ) -> Result<Self> {
        let stream = params.stream;
        let wp = tensor_ptr(w_perm)?;
        let up = tensor_ptr(u)?;
        let (codes_p, err1_p, loss_p) = (
            slice_ptr(&bufs.codes, stream),
            slice_ptr(&bufs.err1, stream),
            slice_ptr(&bufs.loss, stream),
        );
        let param_p = slice_ptr(&bufs.param_row, stream);
        Ok(Self {
            params,
            blas,
            bs,
            wp,
            up,
            codes_p,
            err1_p,
            loss_p,
            param_p,
        })
    }

    /// Runs the blocks i1..i2 in order, each the in-block kernels and then the lazy update of
    /// the columns after it. Returns the seconds of the in-block kernels and of the lazy-update
    /// GEMMs (0 unless the trace splits them), named for [`Trace::splits`].
    fn run(
        &self,
        plan: &SolvePlan,
        trace: &Trace,
        scales: &mut CudaSlice<f32>,
        zeros: &mut CudaSlice<f32>,
    ) -> Result<[(&'static str, f64); 2]> {
        let k = self.params.k;
        let (mut block_s, mut update_s) = (0.0f64, 0.0f64);
        for i1 in (0..k).step_by(self.bs) {
            let i2 = (i1 + self.bs).min(k);
            let t_block = trace.split_start()?;
            self.block(plan, i1, i2, scales, zeros)?;
            block_s += trace.split_end(t_block)?;
            let t_update = trace.split_start()?;
            if i2 < k {
                self.lazy_update(i1, i2)?;
            }
            update_s += trace.split_end(t_update)?;
        }
        Ok([
            ("in-block kernels", block_s),
            ("lazy-update GEMMs", update_s),
        ])
    }

    /// Block i1..i2: the parameters of the groups that start in it (from the updated W), then
    /// the fused in-block column loop, one warp per output row, writing codes, Err1 and loss.
    fn block(
        &self,
        plan: &SolvePlan,
        i1: usize,
        i2: usize,
        scales: &mut CudaSlice<f32>,
        zeros: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (n, k, stream) = (self.params.n, self.params.k, self.params.stream);
        let width = i2 - i1;
        let starting = plan.groups_starting_in(i1..i2);
        if !starting.is_empty() {
            let first = plan.group_cols(starting.start).start;
            self.params.find(
                self.wp,
                first..k,
                starting.len(),
                starting.start,
                scales,
                zeros,
            )?;
        }
        let (sp, zp) = (slice_ptr(scales, stream), slice_ptr(zeros, stream));
        // Codes are written in processing order (a null perm) and reordered once after the loop.
        let no_perm = 0u64;
        let maxq = self.params.quant.maxq();
        const WARPS: usize = 8;
        launch(
            self.params.dev,
            "gptq_block",
            launch_cfg((blocks(n, WARPS), 1, 1), ((WARPS * 32) as u32, 1, 1)),
            &[
                &self.wp,
                &self.up,
                &(n as i32),
                &(k as i32),
                &(i1 as i32),
                &(width as i32),
                &sp,
                &zp,
                &self.param_p,
                &no_perm,
                &maxq,
                &self.codes_p,
                &self.err1_p,
                &self.loss_p,
            ],
        )
    }

    /// The lazy update of the columns after block i1..i2 by one cuBLAS SGEMM.
    fn lazy_update(&self, i1: usize, i2: usize) -> Result<()> {
        let (n, k, width) = (self.params.n, self.params.k, i2 - i1);
        let (up, wp) = (self.up, self.wp);
        // Row-major W[:, i2:] -= Err1 · U[i1:i2, i2:], i.e. column-major
        // Wᵀ[i2:, :] -= U[i1:i2, i2:]ᵀ · Err1ᵀ.
        let (alpha, beta) = (-1.0f32, 1.0f32);
        let status = unsafe {
            cublas::cublasSgemm_v2(
                *self.blas.handle(),
                cublas::cublasOperation_t::CUBLAS_OP_N,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                (k - i2) as i32,
                n as i32,
                width as i32,
                &alpha,
                (up + ((i1 * k + i2) * 4) as u64) as *const f32,
                k as i32,
                self.err1_p as *const f32,
                width as i32,
                &beta,
                (wp + (i2 * 4) as u64) as *mut f32,
                k as i32,
            )
        };
        cublas_ok(status, "Sgemm (lazy update)")
    }
}

/// The codes back in the original column order (`plan.invperm`): a new `[N, K]` buffer, and the
/// uploaded inverse permutation, which the caller keeps to its end (where it was always freed).
fn unpermute_codes(
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    plan: &SolvePlan,
    codes_p: u64,
    n: usize,
    k: usize,
) -> Result<(CudaSlice<u8>, CudaSlice<i32>)> {
    let invperm_i32: Vec<i32> = plan.invperm.iter().map(|&c| c as i32).collect();
    let invperm_d = upload(stream, &invperm_i32)?;
    let ordered: CudaSlice<u8> = unsafe { stream.alloc(n * k) }?;
    launch(
        dev,
        "unpermute_codes",
        launch_cfg((blocks(k, 256), n as u32, 1), (256, 1, 1)),
        &[
            &codes_p,
            &slice_ptr(&invperm_d, stream),
            &(n as i32),
            &(k as i32),
            &slice_ptr(&ordered, stream),
        ],
    )?;
    Ok((ordered, invperm_d))
}
