//! The CUDA side of the device-specific kernels (feature `cuda`). Everything here has a CPU twin
//! that the tests compare it with (`tests/cuda_twins.rs`, run on a GPU machine):
//!
//! * [`xtx_add`]: `Σ xᵀx` with BF16/F16 inputs on tensor cores and f32 accumulation (one cuBLAS
//!   `GemmEx` per 16 K rows, `beta = 1` across them) — twin: the f32 matmul of
//!   [`HessianAccumulator`](crate::gptq::HessianAccumulator).
//! * [`gptq_solve`]: the whole GPTQ solve on the GPU: the damped, permuted Hessian in f64, its
//!   Cholesky factor and triangular inverse (cuSOLVER `potrf` + `trtri`) with the damping
//!   escalation, group parameters, the fused in-block column loop (one warp per output row) and
//!   one cuBLAS SGEMM per block for the lazy update — twin: `solver.rs`.
//! * [`dequant_gptq`], [`dequant_marlin`]: stored codes back to weights — twins: `format/`.
//!
//! The kernels themselves are in `gptq.cu`, compiled to PTX by `build.rs` and loaded once per
//! device through candle's module cache.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::cublas::sys as cublas;
use cudarc::cusolver::{sys as cusolver, DnHandle};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use rayon::prelude::*;

use crate::gptq::{ActOrder, QuantizedLinear, SolveOptions, SolveTimings};
use crate::gptq::{FactorData, Factorization};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gptq.ptx"));
const MODULE: &str = "soar_gptq_kernels";

/// Rows of X per GemmEx call when accumulating XᵀX; partial sums add in f32 (`beta = 1`).
const XTX_CHUNK_ROWS: usize = 16384;

fn cuda(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        other => bail!("expected a CUDA device, got {other:?}"),
    }
}

/// The raw device address of a contiguous CUDA tensor's first element, valid while the tensor
/// lives. All work runs on the device's one stream, so no cross-stream events are needed.
fn tensor_ptr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        bail!("tensor is not on a CUDA device");
    };
    ensure!(
        layout.is_contiguous(),
        "internal: a CUDA kernel was given a non-contiguous tensor"
    );
    let stream = cs.device.cuda_stream();
    let base = match t.dtype() {
        DType::F32 => slice_ptr(cs.as_cuda_slice::<f32>()?, &stream),
        DType::F64 => slice_ptr(cs.as_cuda_slice::<f64>()?, &stream),
        DType::BF16 => slice_ptr(cs.as_cuda_slice::<half::bf16>()?, &stream),
        DType::F16 => slice_ptr(cs.as_cuda_slice::<half::f16>()?, &stream),
        DType::U8 => slice_ptr(cs.as_cuda_slice::<u8>()?, &stream),
        DType::U32 => slice_ptr(cs.as_cuda_slice::<u32>()?, &stream),
        DType::I32 => slice_ptr(cs.as_cuda_slice::<i32>()?, &stream),
        other => bail!("internal: no CUDA kernel takes {other:?} tensors"),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn slice_ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// A tensor that takes ownership of a device buffer.
fn wrap<T: candle_core::cuda_backend::CudaDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: &[usize],
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// Launches `name` from `gptq.cu` with the arguments pushed by `args`.
fn launch(dev: &CudaDevice, name: &str, cfg: LaunchConfig, args: &[&dyn KernelArg]) -> Result<()> {
    let f = dev
        .get_or_load_custom_func(name, MODULE, PTX)
        .with_context(|| format!("loading CUDA kernel {name}"))?;
    let mut b = f.builder();
    for a in args {
        a.push(&mut b);
    }
    unsafe { b.launch(cfg) }.with_context(|| format!("launching CUDA kernel {name}"))?;
    Ok(())
}

/// A scalar kernel argument (device addresses are passed as `u64`).
trait KernelArg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}
impl<T: DeviceRepr> KernelArg for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

fn cfg(grid: (u32, u32, u32), block: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: block,
        shared_mem_bytes: 0,
    }
}

/// One cuSOLVER handle per device ordinal, on that device's stream.
fn solver_handle(dev: &CudaDevice) -> Result<Arc<DnHandle>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<DnHandle>>>> = OnceLock::new();
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut map = HANDLES
        .get_or_init(Default::default)
        .lock()
        .expect("cusolver handle cache poisoned");
    if let Some(h) = map.get(&ordinal) {
        return Ok(h.clone());
    }
    let h = Arc::new(
        DnHandle::new(dev.cuda_stream())
            .map_err(|e| anyhow!("creating a cuSOLVER handle: {e:?}"))?,
    );
    map.insert(ordinal, h.clone());
    Ok(h)
}

fn cublas_ok(s: cublas::cublasStatus_t, what: &str) -> Result<()> {
    s.result()
        .map_err(|e| anyhow!("cuBLAS {what} failed: {e:?}"))
}

fn cusolver_ok(s: cusolver::cusolverStatus_t, what: &str) -> Result<()> {
    s.result()
        .map_err(|e| anyhow!("cuSOLVER {what} failed: {e:?}"))
}

/// `xtx + xᵀx` for `x` `[rows, K]` in BF16 or F16 on the GPU: tensor-core products with f32
/// accumulation (cuBLAS GemmEx, compute type 32F), `XTX_CHUNK_ROWS` rows per call, each call
/// adding into the f32 result with `beta = 1`. Returns a new `[K, K]` f32 tensor.
pub fn xtx_add(xtx: &Tensor, x: &Tensor) -> Result<Tensor> {
    let dev = cuda(x.device())?;
    let (rows, k) = x.dims2()?;
    ensure!(
        xtx.dims() == [k, k] && xtx.dtype() == DType::F32,
        "internal: XᵀX accumulator must be f32 [{k}, {k}]"
    );
    let in_type = match x.dtype() {
        DType::BF16 => cublas::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType_t::CUDA_R_16F,
        other => bail!("internal: tensor-core XᵀX takes BF16 or F16 inputs, got {other:?}"),
    };
    let x = x.contiguous()?;
    let out = xtx.contiguous()?.copy()?;
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let (xp, op) = (tensor_ptr(&x)?, tensor_ptr(&out)?);
    let elem = x.dtype().size_in_bytes() as u64;
    let (alpha, beta) = (1.0f32, 1.0f32);
    let mut start = 0;
    while start < rows {
        let len = XTX_CHUNK_ROWS.min(rows - start);
        let a = xp + (start * k) as u64 * elem;
        // Row-major X [len, K] is column-major Xᶜ [K, len]; XᵀX = Xᶜ·Xᶜᵀ.
        let status = unsafe {
            cublas::cublasGemmEx(
                *blas.handle(),
                cublas::cublasOperation_t::CUBLAS_OP_N,
                cublas::cublasOperation_t::CUBLAS_OP_T,
                k as i32,
                k as i32,
                len as i32,
                &alpha as *const f32 as *const _,
                a as *const _,
                in_type,
                k as i32,
                a as *const _,
                in_type,
                k as i32,
                &beta as *const f32 as *const _,
                op as *mut _,
                cublas::cudaDataType_t::CUDA_R_32F,
                k as i32,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        cublas_ok(status, "GemmEx (XᵀX)")?;
        start += len;
    }
    drop(stream);
    Ok(out)
}

/// The diagonal of a contiguous `[K, K]` tensor, on the host.
fn diagonal(h: &Tensor) -> Result<Vec<f32>> {
    let k = h.dim(0)?;
    let idx: Vec<u32> = (0..k as u32).map(|i| i * (k as u32 + 1)).collect();
    let idx = Tensor::from_vec(idx, k, h.device())?;
    Ok(h.flatten_all()?.index_select(&idx, 0)?.to_vec1::<f32>()?)
}

fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>> {
    Ok(stream.clone_htod(v)?)
}

/// The factorization of a Hessian on its GPU (the twin of `solver::factorize`): dead columns,
/// the processing order, and U (row-major f32) of the damped, permuted H⁻¹ in f64.
pub fn factorize(h: &Tensor, opts: &SolveOptions) -> Result<Factorization> {
    let module = &opts.module;
    let dev = cuda(h.device())?;
    let stream = dev.cuda_stream();
    let k = h.dim(0)?;
    let t = Instant::now();
    let mut trace = Trace::new(&stream, k);
    let h = h.to_dtype(DType::F32)?.contiguous()?;
    if count_nonfinite(dev, &h)? > 0 {
        // The CPU check names the first bad element.
        crate::gptq::check_finite_one(&h, "Hessian", module)?;
        bail!("module {module}: Hessian contains NaN or Inf");
    }
    trace.lap("finite check")?;
    // Dead columns and the processing order, exactly as on the CPU (docs/algorithm.md,
    // Preprocessing of H).
    let mut diag = diagonal(&h)?;
    let (dead, perm) = crate::gptq::dead_columns_and_order(&mut diag, opts.act_order);
    let mean_diag = diag.iter().map(|&d| d as f64).sum::<f64>() / k as f64;
    trace.lap("diag + order")?;
    let (u, damp_used) = inverse_cholesky_upper(dev, &h, k, &perm, opts.damp, mean_diag, module)?;
    stream.synchronize()?;
    Ok(Factorization {
        k,
        dead,
        perm,
        damp_used,
        seconds: t.elapsed().as_secs_f64(),
        act_order: opts.act_order,
        u: FactorData::Cuda(wrap(u, dev, &[k, k])),
    })
}

/// Elements of a contiguous f32 CUDA tensor that are NaN or ±Inf.
fn count_nonfinite(dev: &CudaDevice, t: &Tensor) -> Result<u32> {
    let stream = dev.cuda_stream();
    let n = t.elem_count();
    let count: CudaSlice<u32> = stream.alloc_zeros(1)?;
    let (tp, cp) = (tensor_ptr(t)?, slice_ptr(&count, &stream));
    launch(
        dev,
        "count_nonfinite",
        cfg((blocks(n, 1024).min(4096), 1, 1), (256, 1, 1)),
        &[&tp, &(n as u64), &cp],
    )?;
    Ok(stream.clone_dtoh(&count)?[0])
}

/// The GPTQ solve of `w` `[N, K]` on its CUDA device with the factorization `f` (U = `u`, on
/// the same device), with the semantics of the CPU solver (`solver.rs`). Codes, scales and zeros
/// come back to the host.
pub fn gptq_solve(
    w: &Tensor,
    f: &Factorization,
    u: &Tensor,
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
        crate::gptq::check_finite_one(&w, "weight", module)?;
        bail!("module {module}: weight contains NaN or Inf");
    }
    trace.lap("weight to f32 + finiteness check")?;
    let g = quant.group_len(k);
    let n_groups = quant.n_groups(k);
    let maxq = quant.maxq();
    let (dead, perm, damp_used) = (&f.dead, &f.perm, f.damp_used);

    let mut scales: CudaSlice<f32> = stream.alloc_zeros(n_groups * n)?;
    let mut zeros: CudaSlice<f32> = stream.alloc_zeros(n_groups * n)?;
    let params = |src: u64,
                  col0: usize,
                  col_end: usize,
                  groups: usize,
                  row0: usize,
                  scales: &mut CudaSlice<f32>,
                  zeros: &mut CudaSlice<f32>|
     -> Result<()> {
        let (sp, zp) = (slice_ptr(scales, &stream), slice_ptr(zeros, &stream));
        launch(
            dev,
            "find_params",
            cfg((blocks(n, 128), groups as u32, 1), (128, 1, 1)),
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
    let whole = quant.group_size < 0;
    if whole {
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
    let find_in_loop = !whole && opts.act_order != ActOrder::Static;
    if !whole && !find_in_loop {
        params(tensor_ptr(&w)?, 0, k, n_groups, 0, &mut scales, &mut zeros)?;
    }
    let param_row: Vec<i32> = match opts.act_order {
        ActOrder::Static => perm.iter().map(|&j| (j / g) as i32).collect(),
        ActOrder::Dynamic | ActOrder::Off => (0..k).map(|c| (c / g) as i32).collect(),
    };
    let perm_u32: Vec<u32> = perm.iter().map(|&j| j as u32).collect();
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
    let perm_i32: Vec<i32> = perm.iter().map(|&j| j as i32).collect();
    let perm_d = upload(&stream, &perm_i32)?;
    // Codes in processing order, reordered once after the loop (`gather`, the default), or
    // scattered to their original columns by the block kernel (`SOAR_GPTQ_CODES=scatter`).
    let scatter = std::env::var("SOAR_GPTQ_CODES").is_ok_and(|v| v == "scatter");
    let wp = tensor_ptr(&w_perm)?;
    let up = tensor_ptr(u)?;
    let (codes_p, err1_p, loss_p) = (
        slice_ptr(&codes, &stream),
        slice_ptr(&err1, &stream),
        slice_ptr(&loss, &stream),
    );
    let (param_p, perm_p) = (
        slice_ptr(&param_row_d, &stream),
        if scatter {
            slice_ptr(&perm_d, &stream)
        } else {
            0u64
        },
    );
    let (mut block_s, mut update_s) = (0.0f64, 0.0f64);
    for i1 in (0..k).step_by(bs) {
        let i2 = (i1 + bs).min(k);
        let width = i2 - i1;
        let t_block = trace.split_start()?;
        if find_in_loop {
            let first = i1.div_ceil(g) * g;
            if first < i2 {
                let starts = (first..i2).step_by(g).count();
                params(wp, first, k, starts, first / g, &mut scales, &mut zeros)?;
            }
        }
        let (sp, zp) = (slice_ptr(&scales, &stream), slice_ptr(&zeros, &stream));
        const WARPS: usize = 8;
        launch(
            dev,
            "gptq_block",
            cfg((blocks(n, WARPS), 1, 1), ((WARPS * 32) as u32, 1, 1)),
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
                &perm_p,
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
    let invperm = {
        let mut inv = vec![0usize; k];
        for (c, &j) in perm.iter().enumerate() {
            inv[j] = c;
        }
        inv
    };
    let codes = if scatter {
        codes
    } else {
        let invperm_i32: Vec<i32> = invperm.iter().map(|&c| c as i32).collect();
        let invperm_d = upload(&stream, &invperm_i32)?;
        let out: CudaSlice<u8> = unsafe { stream.alloc(n * k) }?;
        launch(
            dev,
            "unpermute_codes",
            cfg((blocks(k, 256), n as u32, 1), (256, 1, 1)),
            &[
                &codes_p,
                &slice_ptr(&invperm_d, &stream),
                &(n as i32),
                &(k as i32),
                &slice_ptr(&out, &stream),
            ],
        )?;
        trace.lap("codes to the original column order")?;
        out
    };
    trace.splits(&[
        ("in-block kernels", block_s),
        ("lazy-update GEMMs", update_s),
    ]);
    let codes = codes_to_host(&stream, &codes)?;
    let scales = stream.clone_dtoh(&scales)?;
    let zeros = stream.clone_dtoh(&zeros)?;
    let loss_rows = stream.clone_dtoh(&loss)?;
    trace.lap("codes, scales, zeros, loss to the host")?;
    let loop_s = t_prep.elapsed().as_secs_f64();
    drop(w_perm);
    if loss_rows.iter().any(|l| !l.is_finite()) {
        bail!("module {module}: the GPU solve produced a non-finite loss (damp {damp_used})");
    }
    let g_idx = match opts.act_order {
        ActOrder::Dynamic => invperm.iter().map(|&c| (c / g) as i32).collect(),
        ActOrder::Static | ActOrder::Off => (0..k).map(|j| (j / g) as i32).collect(),
    };
    Ok(QuantizedLinear {
        n,
        k,
        codes,
        scales,
        zeros: zeros.iter().map(|&z| z as u8).collect(),
        g_idx,
        // Row order, as on the CPU.
        loss: loss_rows.iter().sum(),
        damp_used,
        dead_columns: dead.len(),
        timings: SolveTimings { factor_s, loop_s },
    })
}

/// The page-locked staging buffer of `codes_to_host`, kept between solves (allocating and
/// registering page-locked memory costs more than the copy it speeds up).
static PINNED_CODES: Mutex<Option<cudarc::driver::PinnedHostSlice<u8>>> = Mutex::new(None);

/// The codes of a solve on the host: a DMA into a reused page-locked buffer and one parallel
/// copy out of it, or with `SOAR_GPTQ_PINNED=0` the plain (pageable) device-to-host copy.
fn codes_to_host(stream: &Arc<CudaStream>, codes: &CudaSlice<u8>) -> Result<Vec<u8>> {
    if std::env::var("SOAR_GPTQ_PINNED").is_ok_and(|v| v == "0") {
        return Ok(stream.clone_dtoh(codes)?);
    }
    let n = codes.len();
    let ctx = stream.context();
    let mut staging = PINNED_CODES
        .lock()
        .map_err(|_| anyhow!("internal: poisoned lock"))?;
    let fits = staging
        .as_ref()
        .is_some_and(|p| p.len() >= n && Arc::ptr_eq(p.context(), ctx));
    if !fits {
        *staging = None;
        // Flags 0: cached, readable by the CPU at full speed (not write-combined).
        *staging = Some(unsafe { ctx.alloc_pinned_with_flags::<u8>(n, 0) }?);
    }
    let buf = staging.as_mut().expect("just set").as_mut_slice()?;
    let (src, _record) = codes.device_ptr(stream);
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut buf[..n], src, stream.cu_stream()) }?;
    stream.synchronize()?;
    // Out of the staging buffer with all cores: the copy is bound by the first touch of the
    // destination's fresh pages (measured on the H200 host: 67 MB took 45 ms on one thread).
    // `vec![0; n]` maps zero pages lazily, so every page is touched once, by the copy.
    let mut out = vec![0u8; n];
    const CHUNK: usize = 1 << 20;
    out.par_chunks_mut(CHUNK)
        .zip(buf[..n].par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
    Ok(out)
}

/// Phase timings of the factorization and the solve on stderr when `SOAR_GPTQ_TRACE=1` (a
/// diagnostic for the benchmark; synchronizes the stream at every lap). `SOAR_GPTQ_TRACE=2`
/// also splits the column loop into its in-block kernels and lazy-update GEMMs, synchronizing
/// around every launch (which slows the loop itself).
struct Trace<'a> {
    on: bool,
    split: bool,
    stream: &'a Arc<CudaStream>,
    k: usize,
    t: Instant,
}

impl<'a> Trace<'a> {
    fn new(stream: &'a Arc<CudaStream>, k: usize) -> Self {
        let level = std::env::var("SOAR_GPTQ_TRACE").unwrap_or_default();
        Self {
            on: level == "1" || level == "2",
            split: level == "2",
            stream,
            k,
            t: Instant::now(),
        }
    }

    fn lap(&mut self, what: &str) -> Result<()> {
        if self.on {
            self.stream.synchronize()?;
            eprintln!(
                "trace K={} {what}: {:.3} ms",
                self.k,
                self.t.elapsed().as_secs_f64() * 1e3
            );
            self.t = Instant::now();
        }
        Ok(())
    }

    /// Start of a split interval (level 2 only): the stream is synchronized first.
    fn split_start(&self) -> Result<Option<Instant>> {
        if !self.split {
            return Ok(None);
        }
        self.stream.synchronize()?;
        Ok(Some(Instant::now()))
    }

    /// Seconds since `split_start`, after synchronizing (0 unless level 2).
    fn split_end(&self, t: Option<Instant>) -> Result<f64> {
        match t {
            None => Ok(0.0),
            Some(t) => {
                self.stream.synchronize()?;
                Ok(t.elapsed().as_secs_f64())
            }
        }
    }

    fn splits(&self, parts: &[(&str, f64)]) {
        if self.split {
            for (what, s) in parts {
                eprintln!("trace K={}   of which {what}: {:.3} ms", self.k, s * 1e3);
            }
        }
    }
}

/// U with `H⁻¹ = UᵀU`, row-major f32 `[K, K]`, of `H` permuted by `perm` and damped (the same
/// identity as the CPU twin: one Cholesky of `J·H·J` and one triangular inverse, in f64).
fn inverse_cholesky_upper(
    dev: &CudaDevice,
    h: &Tensor,
    k: usize,
    perm: &[usize],
    damp: f64,
    mean_diag: f64,
    module: &str,
) -> Result<(CudaSlice<f32>, f64)> {
    let stream = dev.cuda_stream();
    let solver = solver_handle(dev)?;
    let rev: Vec<i32> = perm.iter().rev().map(|&j| j as i32).collect();
    let rev_d = upload(&stream, &rev)?;
    let rev_p = slice_ptr(&rev_d, &stream);
    let hp = tensor_ptr(h)?;
    let a: CudaSlice<f64> = unsafe { stream.alloc(k * k) }?;
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
            cusolver::cusolverDnDpotrf_bufferSize(
                solver.cu(),
                lower,
                k as i32,
                ap as *mut f64,
                k as i32,
                &mut lwork,
            )
        },
        "potrf_bufferSize",
    )?;
    let work: CudaSlice<f64> = unsafe { stream.alloc(lwork.max(1) as usize) }?;
    let work_p = slice_ptr(&work, &stream);
    let (mut dev_bytes, mut host_bytes) = (0usize, 0usize);
    cusolver_ok(
        unsafe {
            cusolver::cusolverDnXtrtri_bufferSize(
                solver.cu(),
                lower,
                cusolver::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                k as i64,
                cusolver::cudaDataType_t::CUDA_R_64F,
                ap as *mut _,
                k as i64,
                &mut dev_bytes,
                &mut host_bytes,
            )
        },
        "trtri_bufferSize",
    )?;
    let tr_work: CudaSlice<u8> = unsafe { stream.alloc(dev_bytes.max(1)) }?;
    let tr_work_p = slice_ptr(&tr_work, &stream);
    let mut host_work = vec![0u8; host_bytes.max(1)];
    // L⁻¹ by one of three methods (SOAR_GPTQ_INVERSE, for side-by-side measurement):
    // `rec` (default) a recursive blocked inverse whose work is two triangular matrix products
    // per level (K³/3 FLOP in all, against K³ for a full triangular solve against I), `trsm`
    // the cuBLAS triangular solve against I, `trtri` cuSOLVER's trtri.
    let method = inverse_method();
    let use_trsm = method != Inverse::Trtri;
    let inv: Option<CudaSlice<f64>> = if use_trsm {
        Some(unsafe { stream.alloc(k * k) }?)
    } else {
        None
    };
    let inv_p = inv.as_ref().map_or(0, |x| slice_ptr(x, &stream));
    let blas = dev.cublas_handle();
    let mut trace = Trace::new(&stream, k);
    let mut damp = damp;
    loop {
        launch(
            dev,
            "gather_damped_f64",
            cfg((blocks(k, 256), k as u32, 1), (256, 1, 1)),
            &[&hp, &rev_p, &ap, &(k as i32), &(damp * mean_diag)],
        )?;
        trace.lap("gather")?;
        cusolver_ok(
            unsafe {
                cusolver::cusolverDnDpotrf(
                    solver.cu(),
                    lower,
                    k as i32,
                    ap as *mut f64,
                    k as i32,
                    work_p as *mut f64,
                    lwork,
                    info_p as *mut i32,
                )
            },
            "potrf",
        )?;
        let mut ok = stream.clone_dtoh(&info)?[0] == 0;
        trace.lap("potrf")?;
        if ok && use_trsm {
            // L⁻¹ into X (lower triangle; `reverse_upper_f32` reads only that). X starts as I.
            launch(
                dev,
                "set_identity_f64",
                cfg((blocks(k, 256), k as u32, 1), (256, 1, 1)),
                &[&inv_p, &(k as i32)],
            )?;
            let handle = *blas.handle();
            if method == Inverse::Recursive {
                lower_inverse_rec(handle, ap, inv_p, k, 0, k)?;
                trace.lap("recursive inverse")?;
            } else {
                trsm_identity(handle, ap, inv_p, k, 0, k)?;
                trace.lap("trsm")?;
            }
        } else if ok {
            cusolver_ok(
                unsafe {
                    cusolver::cusolverDnXtrtri(
                        solver.cu(),
                        lower,
                        cusolver::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                        k as i64,
                        cusolver::cudaDataType_t::CUDA_R_64F,
                        ap as *mut _,
                        k as i64,
                        tr_work_p as *mut _,
                        dev_bytes,
                        host_work.as_mut_ptr() as *mut _,
                        host_bytes,
                        info_p as *mut i32,
                    )
                },
                "trtri",
            )?;
            ok = stream.clone_dtoh(&info)?[0] == 0;
            trace.lap("trtri")?;
        }
        if ok {
            stream.memset_zeros(&mut bad)?;
            let src = if use_trsm { inv_p } else { ap };
            launch(
                dev,
                "reverse_upper_f32",
                cfg((blocks(k, 32), blocks(k, 32), 1), (32, 8, 1)),
                &[&src, &u_p, &(k as i32), &bad_p],
            )?;
            let good = stream.clone_dtoh(&bad)?[0] == 0;
            trace.lap("reverse")?;
            if good {
                return Ok((u, damp));
            }
        }
        if damp >= 1.0 {
            return Err(crate::gptq::not_positive_definite(module, mean_diag));
        }
        damp = (damp * 2.0).min(1.0);
    }
}

/// How the GPU factorization computes L⁻¹ (`SOAR_GPTQ_INVERSE`: `rec`, the default, `trsm`
/// or `trtri`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Inverse {
    Recursive,
    Trsm,
    Trtri,
}

fn inverse_method() -> Inverse {
    match std::env::var("SOAR_GPTQ_INVERSE").as_deref() {
        Ok("trsm") => Inverse::Trsm,
        Ok("trtri") => Inverse::Trtri,
        _ => Inverse::Recursive,
    }
}

/// Diagonal blocks up to this size are inverted by a triangular solve against I.
const INVERSE_LEAF: usize = 512;

/// X[o..o+m, o..o+m] = L[o..o+m, o..o+m]⁻¹ by solving L·X = I in place (X holds I there).
/// Column-major, leading dimension `k` for both; `l` and `x` are device addresses of f64.
fn trsm_identity(
    handle: cublas::cublasHandle_t,
    l: u64,
    x: u64,
    k: usize,
    o: usize,
    m: usize,
) -> Result<()> {
    let one = 1.0f64;
    let at = |base: u64| base + ((o + o * k) * 8) as u64;
    let status = unsafe {
        cublas::cublasDtrsm_v2(
            handle,
            cublas::cublasSideMode_t::CUBLAS_SIDE_LEFT,
            cublas::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
            cublas::cublasOperation_t::CUBLAS_OP_N,
            cublas::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
            m as i32,
            m as i32,
            &one,
            at(l) as *const f64,
            k as i32,
            at(x) as *mut f64,
            k as i32,
        )
    };
    cublas_ok(status, "Dtrsm (L⁻¹)")
}

/// X[o..o+m, o..o+m] = L[o..o+m, o..o+m]⁻¹ for lower-triangular L, recursively: with
/// L = [L11 0; L21 L22] the inverse is [X11 0; −X22·L21·X11 X22], so each level is two
/// half-size inverses and two triangular products (cuBLAS `trmm`, out of place into X21,
/// then in place). Column-major, leading dimension `k`; X holds I on entry.
fn lower_inverse_rec(
    handle: cublas::cublasHandle_t,
    l: u64,
    x: u64,
    k: usize,
    o: usize,
    m: usize,
) -> Result<()> {
    if m <= INVERSE_LEAF {
        return trsm_identity(handle, l, x, k, o, m);
    }
    let m1 = (m / 2).div_ceil(128) * 128;
    let m2 = m - m1;
    lower_inverse_rec(handle, l, x, k, o, m1)?;
    lower_inverse_rec(handle, l, x, k, o + m1, m2)?;
    let at = |base: u64, r: usize, c: usize| base + ((r + c * k) * 8) as u64;
    let (x11, x22, x21) = (at(x, o, o), at(x, o + m1, o + m1), at(x, o + m1, o));
    let l21 = at(l, o + m1, o);
    let (one, minus) = (1.0f64, -1.0f64);
    use cublas::cublasSideMode_t as S;
    use cublas::{cublasDiagType_t as D, cublasFillMode_t as F, cublasOperation_t as T};
    // X21 = L21 · X11 (X11 lower triangular, on the right).
    let status = unsafe {
        cublas::cublasDtrmm_v2(
            handle,
            S::CUBLAS_SIDE_RIGHT,
            F::CUBLAS_FILL_MODE_LOWER,
            T::CUBLAS_OP_N,
            D::CUBLAS_DIAG_NON_UNIT,
            m2 as i32,
            m1 as i32,
            &one,
            x11 as *const f64,
            k as i32,
            l21 as *const f64,
            k as i32,
            x21 as *mut f64,
            k as i32,
        )
    };
    cublas_ok(status, "Dtrmm (L21·X11)")?;
    // X21 = −X22 · X21 (X22 lower triangular, on the left; in place).
    let status = unsafe {
        cublas::cublasDtrmm_v2(
            handle,
            S::CUBLAS_SIDE_LEFT,
            F::CUBLAS_FILL_MODE_LOWER,
            T::CUBLAS_OP_N,
            D::CUBLAS_DIAG_NON_UNIT,
            m2 as i32,
            m1 as i32,
            &minus,
            x22 as *const f64,
            k as i32,
            x21 as *const f64,
            k as i32,
            x21 as *mut f64,
            k as i32,
        )
    };
    cublas_ok(status, "Dtrmm (−X22·X21)")
}

/// GPTQ decode on the GPU: `W` `[N, K]` f32 with `W[n][k] = scale[g][n]·(code − zero)`,
/// `g = g_idx[k]`, from `qweight` `[K·bits/32, N]`, `qzeros` `[groups, N·bits/32]` (v1 stores
/// zero − 1), `scales` `[groups, N]` f32 (the stored fp16 values), for 2, 3, 4 or 8 bits.
#[allow(clippy::too_many_arguments)]
pub fn dequant_gptq(
    device: &Device,
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[f32],
    g_idx: &[i32],
    k: usize,
    n: usize,
    bits: u8,
    v1: bool,
) -> Result<Tensor> {
    let dev = cuda(device)?;
    let stream = dev.cuda_stream();
    ensure!(
        qweight.len() == k * bits as usize / 32 * n && g_idx.len() == k,
        "internal: GPTQ tensors do not match [K={k}, N={n}] at {bits} bits"
    );
    let groups = scales.len() / n;
    if let Some(pos) = g_idx.iter().position(|&g| g < 0 || g as usize >= groups) {
        bail!(
            "g_idx[{pos}] = {} is outside the {groups} scale groups",
            g_idx[pos]
        );
    }
    let (qw, qz, sc, gi) = (
        upload(&stream, qweight)?,
        upload(&stream, qzeros)?,
        upload(&stream, scales)?,
        upload(&stream, g_idx)?,
    );
    let out: CudaSlice<f32> = unsafe { stream.alloc(n * k) }?;
    let (qwp, qzp, scp, gip, outp) = (
        slice_ptr(&qw, &stream),
        slice_ptr(&qz, &stream),
        slice_ptr(&sc, &stream),
        slice_ptr(&gi, &stream),
        slice_ptr(&out, &stream),
    );
    launch(
        dev,
        "dequant_gptq",
        cfg((blocks(k, 256), n as u32, 1), (256, 1, 1)),
        &[
            &qwp,
            &qzp,
            &scp,
            &gip,
            &(k as i32),
            &(n as i32),
            &(bits as i32),
            &i32::from(v1),
            &outp,
        ],
    )?;
    Ok(wrap(out, dev, &[n, k]))
}

/// Marlin decode on the GPU: `W` `[N, K]` f32 from the tiles `B` `[K/16, 2N]`, un-permuted
/// scales `[groups, N]` and the original input row of each tile row (identity without act-order).
pub fn dequant_marlin(
    device: &Device,
    b: &[i32],
    scales: &[f32],
    src_row: &[i32],
    k: usize,
    n: usize,
    group: usize,
) -> Result<Tensor> {
    let dev = cuda(device)?;
    let stream = dev.cuda_stream();
    ensure!(
        b.len() == k / 16 * 2 * n
            && src_row.len() == k
            && k.is_multiple_of(16)
            && n.is_multiple_of(64),
        "internal: Marlin tensors do not match [K={k}, N={n}]"
    );
    let (bd, sd, rd) = (
        upload(&stream, b)?,
        upload(&stream, scales)?,
        upload(&stream, src_row)?,
    );
    let out: CudaSlice<f32> = unsafe { stream.alloc(n * k) }?;
    let (bp, sp, rp, op) = (
        slice_ptr(&bd, &stream),
        slice_ptr(&sd, &stream),
        slice_ptr(&rd, &stream),
        slice_ptr(&out, &stream),
    );
    launch(
        dev,
        "dequant_marlin",
        cfg((blocks(2 * n, 256), (k / 16) as u32, 1), (256, 1, 1)),
        &[
            &bp,
            &sp,
            &rp,
            &(k as i32),
            &(n as i32),
            &(group as i32),
            &op,
        ],
    )?;
    Ok(wrap(out, dev, &[n, k]))
}

/// GPU memory free on `device` right now, in bytes.
pub fn memory_free(device: &Device) -> Result<u64> {
    let dev = cuda(device)?;
    let (free, _) = dev.cuda_stream().context().mem_get_info()?;
    Ok(free as u64)
}

/// GPU memory in use on `device` right now (total − free), in bytes.
pub fn memory_in_use(device: &Device) -> Result<u64> {
    let dev = cuda(device)?;
    let (free, total) = dev.cuda_stream().context().mem_get_info()?;
    Ok((total - free) as u64)
}

/// Total GPU memory of `device`, in bytes.
pub fn memory_total(device: &Device) -> Result<u64> {
    let dev = cuda(device)?;
    Ok(dev.cuda_stream().context().total_mem()? as u64)
}

fn default_pool(dev: &CudaDevice) -> Result<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    Ok(pool)
}

/// Keeps memory freed to the stream-ordered pool (which candle allocates from) reserved instead
/// of returning it to the driver at every synchronization: the pipeline frees and re-allocates
/// the same large buffers layer after layer. Also resets the pool's high-water marks.
pub fn keep_pool_memory(device: &Device) -> Result<()> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    let pool = default_pool(cuda(device)?)?;
    let mut threshold = u64::MAX;
    let mut zero = 0u64;
    unsafe {
        cudarc::driver::sys::cuMemPoolSetAttribute(
            pool,
            A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut _,
        )
        .result()?;
        for attr in [
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            cudarc::driver::sys::cuMemPoolSetAttribute(pool, attr, &mut zero as *mut u64 as *mut _)
                .result()?;
        }
    }
    Ok(())
}

/// The stream-ordered pool's high-water marks since [`keep_pool_memory`]: `(used, reserved)`
/// bytes. Allocations outside the pool (the context, cuBLAS and cuSOLVER workspaces) are not in
/// these; [`memory_in_use`] sees everything at one instant.
pub fn pool_high_water(device: &Device) -> Result<(u64, u64)> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    let pool = default_pool(cuda(device)?)?;
    let read = |attr| -> Result<u64> {
        let mut v = 0u64;
        unsafe {
            cudarc::driver::sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut _)
        }
        .result()?;
        Ok(v)
    };
    Ok((
        read(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        read(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
    ))
}
