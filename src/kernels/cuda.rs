//! The raw CUDA layer (feature `cuda`): kernel launching, device pointers, cuBLAS/cuSOLVER
//! handles and calls, transfers, and the device-memory pool. It knows nothing of GPTQ; the GPU
//! solve that uses it lives in `crate::gptq` (`gptq/cuda.rs`). Its kernels with a CPU twin that
//! `tests/cuda/twins.rs` compares on a GPU machine:
//!
//! * [`xtx_add`]: `Σ xᵀx` with BF16/F16 inputs on tensor cores and f32 accumulation (one cuBLAS
//!   `GemmEx` per 16 K rows, `beta = 1` across them) — twin: the f32 matmul of
//!   [`HessianAccumulator`](crate::gptq::HessianAccumulator); [`xtx_add_upper`] the same in
//!   place on the blocks on and above the diagonal only, [`mirror_upper_blocks`] the rest.
//! * [`lower_inverse`]: the inverse of a lower-triangular f64 matrix by recursive blocking
//!   (cuBLAS `trmm`, `trsm` leaves) — used by the GPU factorization, twin: faer's inverse.
//! * [`dequant_gptq`], [`dequant_marlin`]: stored codes back to weights — twins: `format/`.
//! * [`flash_attention_causal`]: dense causal GQA attention of the sparse layers, fused
//!   (flash-style, BF16 tensor cores, f32 softmax) — twin: the composed f32 attention,
//!   `model::minicpm_sala::sparse_attention_composed`.
//!
//! The kernels themselves are in `gptq.cu`, compiled by `build.rs` to a fatbin (sm SASS plus PTX)
//! and loaded once per device ordinal, with no JIT (docs/gpu.md, No JIT on first use).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::cublas::sys as cublas;
use cudarc::cusolver::{sys as cusolver, DnHandle};
use cudarc::driver::{
    CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use rayon::prelude::*;

/// The kernel files as fatbins (SASS for the build's compute capability plus its PTX), by the
/// name [`launch_in`] takes: the driver loads the machine code as is, with no JIT on first use
/// (docs/gpu.md, No JIT on first use).
static FATBINS: &[(&str, &[u8])] = &[
    (
        "gptq",
        include_bytes!(concat!(env!("OUT_DIR"), "/gptq.fatbin")),
    ),
    (
        "infllm",
        include_bytes!(concat!(env!("OUT_DIR"), "/infllm.fatbin")),
    ),
    (
        "gla",
        include_bytes!(concat!(env!("OUT_DIR"), "/gla.fatbin")),
    ),
];

/// Rows of X per GemmEx call when accumulating XᵀX; partial sums add in f32 (`beta = 1`).
const XTX_CHUNK_ROWS: usize = 16384;

pub fn cuda(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        other => bail!("expected a CUDA device, got {other:?}"),
    }
}

/// The raw device address of a contiguous CUDA tensor's first element, valid while the tensor
/// lives. All work runs on the device's one stream, so no cross-stream events are needed.
pub fn tensor_ptr(t: &Tensor) -> Result<u64> {
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

pub fn slice_ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// A tensor that takes ownership of a device buffer.
pub fn wrap<T: candle_core::cuda_backend::CudaDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: &[usize],
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// Launches `name` from `gptq.cu` with the arguments pushed by `args`.
pub fn launch(
    dev: &CudaDevice,
    name: &str,
    cfg: LaunchConfig,
    args: &[&dyn KernelArg],
) -> Result<()> {
    launch_in(dev, "gptq", name, cfg, args)
}

/// Launches `name` from the kernel file `file` (`gptq`, `infllm`, `gla`: `src/kernels/{file}.cu`)
/// with the arguments pushed by `args`. Dynamic shared memory past the default 48 KiB
/// (`cfg.shared_mem_bytes`) is allowed on the function first.
pub fn launch_in(
    dev: &CudaDevice,
    file: &str,
    name: &str,
    cfg: LaunchConfig,
    args: &[&dyn KernelArg],
) -> Result<()> {
    let f = kernel_module(dev, file)?
        .load_function(name)
        .with_context(|| format!("loading CUDA kernel {name}"))?;
    if cfg.shared_mem_bytes > 48 * 1024 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            cfg.shared_mem_bytes as i32,
        )
        .with_context(|| {
            format!(
                "allowing {} bytes of shared memory to CUDA kernel {name}",
                cfg.shared_mem_bytes
            )
        })?;
    }
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for a in args {
        a.push(&mut b);
    }
    unsafe { b.launch(cfg) }.with_context(|| format!("launching CUDA kernel {name}"))?;
    Ok(())
}

/// A scalar kernel argument (device addresses are passed as `u64`).
pub trait KernelArg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}
impl<T: DeviceRepr> KernelArg for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }
}

pub fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

pub fn launch_cfg(grid: (u32, u32, u32), block: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: block,
        shared_mem_bytes: 0,
    }
}

/// The module of `src/kernels/{file}.cu`, loaded once per device ordinal (candle's devices
/// share the primary context of their ordinal).
fn kernel_module(dev: &CudaDevice, file: &str) -> Result<Arc<CudaModule>> {
    type Modules = Mutex<HashMap<(usize, String), Arc<CudaModule>>>;
    static MODULES: OnceLock<Modules> = OnceLock::new();
    let Some((_, bytes)) = FATBINS.iter().find(|(n, _)| *n == file) else {
        bail!("internal: no CUDA kernel file {file}");
    };
    let key = (dev.cuda_stream().context().ordinal(), file.to_string());
    let cache = MODULES.get_or_init(Default::default);
    if let Some(m) = cache.lock().expect("module cache poisoned").get(&key) {
        return Ok(m.clone());
    }
    let m = dev
        .cuda_stream()
        .context()
        .load_module(Ptx::from_binary(bytes.to_vec()))
        .with_context(|| format!("loading the soar-gptq CUDA kernels ({file}.fatbin)"))?;
    cache
        .lock()
        .expect("module cache poisoned")
        .insert(key, m.clone());
    Ok(m)
}

/// One cuSOLVER handle per device ordinal, on that device's stream.
pub fn solver_handle(dev: &CudaDevice) -> Result<Arc<DnHandle>> {
    static HANDLES: PerOrdinal<Arc<DnHandle>> = OnceLock::new();
    per_ordinal(&HANDLES, dev, |stream| {
        Ok(Arc::new(DnHandle::new(stream.clone()).map_err(|e| {
            anyhow!("creating a cuSOLVER handle: {e:?}")
        })?))
    })
}

/// A cache of one value per device ordinal.
type PerOrdinal<T> = OnceLock<Mutex<HashMap<usize, T>>>;

/// The value `cache` holds for `dev`'s ordinal, made by `make` (with the device's stream) on
/// first use.
fn per_ordinal<T: Clone>(
    cache: &PerOrdinal<T>,
    dev: &CudaDevice,
    make: impl FnOnce(&Arc<CudaStream>) -> Result<T>,
) -> Result<T> {
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let mut map = cache
        .get_or_init(Default::default)
        .lock()
        .expect("per-device cache poisoned");
    if let Some(v) = map.get(&ordinal) {
        return Ok(v.clone());
    }
    let v = make(&stream)?;
    map.insert(ordinal, v.clone());
    Ok(v)
}

pub fn cublas_ok(s: cublas::cublasStatus_t, what: &str) -> Result<()> {
    s.result()
        .map_err(|e| anyhow!("cuBLAS {what} failed: {e:?}"))
}

pub fn cusolver_ok(s: cusolver::cusolverStatus_t, what: &str) -> Result<()> {
    s.result()
        .map_err(|e| anyhow!("cuSOLVER {what} failed: {e:?}"))
}

/// `xtx + xᵀx` for `x` `[rows, K]` in BF16 or F16 on the GPU: tensor-core products with f32
/// accumulation (cuBLAS GemmEx, compute type 32F), `XTX_CHUNK_ROWS` rows per call, each call
/// adding into the f32 result with `beta = 1`. Returns a new `[K, K]` f32 tensor.
pub fn xtx_add(xtx: &Tensor, x: &Tensor) -> Result<Tensor> {
    atb_add(xtx, x, x)
}

/// `acc + aᵀb` for `a`, `b` `[rows, K]` of one dtype (BF16 or F16) on the GPU, as
/// [`xtx_add`] (which is the case `a = b`): `acc[i][j] += Σ_t a[t][i]·b[t][j]`, f32 `[K, K]`.
pub fn atb_add(acc: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dev = cuda(a.device())?;
    let (rows, k) = a.dims2()?;
    ensure!(
        b.dims() == [rows, k] && b.dtype() == a.dtype(),
        "internal: aᵀb operands differ: {:?} {:?} and {:?} {:?}",
        a.dims(),
        a.dtype(),
        b.dims(),
        b.dtype()
    );
    ensure!(
        acc.dims() == [k, k] && acc.dtype() == DType::F32,
        "internal: XᵀX accumulator must be f32 [{k}, {k}]"
    );
    let in_type = match a.dtype() {
        DType::BF16 => cublas::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType_t::CUDA_R_16F,
        other => bail!("internal: tensor-core XᵀX takes BF16 or F16 inputs, got {other:?}"),
    };
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let out = acc.contiguous()?.copy()?;
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let (ap, bp, op) = (tensor_ptr(&a)?, tensor_ptr(&b)?, tensor_ptr(&out)?);
    let elem = a.dtype().size_in_bytes() as u64;
    let (alpha, beta) = (1.0f32, 1.0f32);
    let mut start = 0;
    while start < rows {
        let len = XTX_CHUNK_ROWS.min(rows - start);
        let offset = (start * k) as u64 * elem;
        // Row-major A, B [len, K] are column-major Aᶜ, Bᶜ [K, len]. The column-major result
        // Cᶜ = Bᶜ·Aᶜᵀ read row-major is its transpose, Aᶜ·Bᶜᵀ = aᵀb.
        let status = unsafe {
            cublas::cublasGemmEx(
                *blas.handle(),
                cublas::cublasOperation_t::CUBLAS_OP_N,
                cublas::cublasOperation_t::CUBLAS_OP_T,
                k as i32,
                k as i32,
                len as i32,
                &alpha as *const f32 as *const _,
                (bp + offset) as *const _,
                in_type,
                k as i32,
                (ap + offset) as *const _,
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
        cublas_ok(status, "GemmEx (aᵀb)")?;
        start += len;
    }
    drop(stream);
    Ok(out)
}

/// Column blocks of [`xtx_add_upper`]: products of 2048 × 2048 outputs still fill the GPU (256
/// tiles), and K = 4096 then takes 3 of 4 block products, K = 16384 36 of 64.
pub const XTX_UPPER_BLOCK: usize = 2048;

/// `xtx += xᵀx` in place for `x` `[rows, K]` in BF16 or F16, computing only the blocks on and
/// above the diagonal (blocks of [`XTX_UPPER_BLOCK`] columns; one GemmEx per block pair and
/// `XTX_CHUNK_ROWS` rows, f32 accumulation, `beta = 1`): XᵀX is symmetric, so the blocks below
/// are copies, made once by [`mirror_upper_blocks`] when the Hessian is read. Writes into
/// `xtx`'s storage: the caller must hold the tensor's only reference (the accumulator does).
pub fn xtx_add_upper(xtx: &Tensor, x: &Tensor) -> Result<()> {
    let dev = cuda(x.device())?;
    let (rows, k) = x.dims2()?;
    ensure!(
        xtx.dims() == [k, k] && xtx.dtype() == DType::F32 && xtx.is_contiguous(),
        "internal: XᵀX accumulator must be contiguous f32 [{k}, {k}]"
    );
    let in_type = match x.dtype() {
        DType::BF16 => cublas::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType_t::CUDA_R_16F,
        other => bail!("internal: tensor-core XᵀX takes BF16 or F16 inputs, got {other:?}"),
    };
    let x = x.contiguous()?;
    let blas = dev.cublas_handle();
    let (xp, op) = (tensor_ptr(&x)?, tensor_ptr(xtx)?);
    let elem = x.dtype().size_in_bytes() as u64;
    let bs = if k >= 2 * XTX_UPPER_BLOCK {
        XTX_UPPER_BLOCK
    } else {
        k
    };
    let blocks: Vec<(usize, usize)> = (0..k).step_by(bs).map(|s| (s, bs.min(k - s))).collect();
    let (alpha, beta) = (1.0f32, 1.0f32);
    let mut start = 0;
    while start < rows {
        let len = XTX_CHUNK_ROWS.min(rows - start);
        let base = xp + (start * k) as u64 * elem;
        for (bi, &(i0, ni)) in blocks.iter().enumerate() {
            for &(j0, nj) in &blocks[bi..] {
                // Row-major x [len, K] is column-major Xᶜ [K, len]; the row-major block
                // C[i0.., j0..] (i block ≤ j block) is the column-major block at rows j0..,
                // columns i0.. (ldc = K): Xᶜ[j0.., :] · Xᶜ[i0.., :]ᵀ.
                let status = unsafe {
                    cublas::cublasGemmEx(
                        *blas.handle(),
                        cublas::cublasOperation_t::CUBLAS_OP_N,
                        cublas::cublasOperation_t::CUBLAS_OP_T,
                        nj as i32,
                        ni as i32,
                        len as i32,
                        &alpha as *const f32 as *const _,
                        (base + j0 as u64 * elem) as *const _,
                        in_type,
                        k as i32,
                        (base + i0 as u64 * elem) as *const _,
                        in_type,
                        k as i32,
                        &beta as *const f32 as *const _,
                        (op + ((i0 * k + j0) * 4) as u64) as *mut _,
                        cublas::cudaDataType_t::CUDA_R_32F,
                        k as i32,
                        cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                };
                cublas_ok(status, "GemmEx (XᵀX block)")?;
            }
        }
        start += len;
    }
    Ok(())
}

/// A copy of `[K, K]` f32 `h` (accumulated by [`xtx_add_upper`]) with each block below the
/// diagonal set from its mirror above it: the full symmetric matrix.
pub fn mirror_upper_blocks(h: &Tensor) -> Result<Tensor> {
    let dev = cuda(h.device())?;
    let k = h.dim(0)?;
    let out = h.contiguous()?.copy()?;
    if k < 2 * XTX_UPPER_BLOCK {
        return Ok(out);
    }
    launch(
        dev,
        "mirror_upper_blocks",
        launch_cfg((blocks(k, 256), k as u32, 1), (256, 1, 1)),
        &[&tensor_ptr(&out)?, &(k as i32), &(XTX_UPPER_BLOCK as i32)],
    )?;
    Ok(out)
}

/// The diagonal of a contiguous `[K, K]` tensor, on the host.
pub fn diagonal(h: &Tensor) -> Result<Vec<f32>> {
    let k = h.dim(0)?;
    let idx: Vec<u32> = (0..k as u32).map(|i| i * (k as u32 + 1)).collect();
    let idx = Tensor::from_vec(idx, k, h.device())?;
    Ok(h.flatten_all()?.index_select(&idx, 0)?.to_vec1::<f32>()?)
}

pub fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>> {
    Ok(stream.clone_htod(v)?)
}

/// Elements of a contiguous f32 CUDA tensor that are NaN or ±Inf.
pub fn count_nonfinite(dev: &CudaDevice, t: &Tensor) -> Result<u32> {
    let stream = dev.cuda_stream();
    let n = t.elem_count();
    let count: CudaSlice<u32> = stream.alloc_zeros(1)?;
    let (tp, cp) = (tensor_ptr(t)?, slice_ptr(&count, &stream));
    launch(
        dev,
        "count_nonfinite",
        launch_cfg((blocks(n, 1024).min(4096), 1, 1), (256, 1, 1)),
        &[&tp, &(n as u64), &cp],
    )?;
    Ok(stream.clone_dtoh(&count)?[0])
}

/// The page-locked staging buffer of `codes_to_host`, kept between solves (allocating and
/// registering page-locked memory costs more than the copy it speeds up).
static PINNED_CODES: Mutex<Option<cudarc::driver::PinnedHostSlice<u8>>> = Mutex::new(None);

/// The codes of a solve on the host: a DMA into a reused page-locked buffer and one parallel
/// copy out of it (docs/decisions.md, Codes leave the GPU through a page-locked staging buffer: a plain pageable copy was up to 2× slower).
pub fn codes_to_host(stream: &Arc<CudaStream>, codes: &CudaSlice<u8>) -> Result<Vec<u8>> {
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

/// Page-locked host memory for a decoder layer's weights on their way to the GPU: filled from
/// the mapped checkpoint on a thread beside the computation ([`PinnedStage::fill`], plain host
/// copies, no CUDA call), then copied to the device one DMA per tensor ([`PinnedStage::upload`]),
/// at the link's speed instead of the driver's staged copy of pageable memory.
pub struct PinnedStage {
    buf: cudarc::driver::PinnedHostSlice<u8>,
    /// Tensor name → byte range in `buf`, of what the last fill holds.
    held: HashMap<String, std::ops::Range<usize>>,
}

impl PinnedStage {
    /// A stage of `bytes` bytes on `device`'s context (allocate on the thread that computes).
    pub fn new(device: &Device, bytes: usize) -> Result<Self> {
        let dev = cuda(device)?;
        let ctx = dev.cuda_stream().context().clone();
        // Flags 0: cached, so the filling thread writes at full speed (not write-combined).
        let buf = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }?;
        Ok(Self {
            buf,
            held: HashMap::new(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Copies `tensors` (name and bytes) in, back to back, replacing what the stage held (host
    /// copies; `as_mut_slice` only binds the context). The caller makes sure no upload from the
    /// stage is still in flight: the layer loop synchronizes the device after each load.
    pub fn fill(&mut self, tensors: &[(String, &[u8])]) -> Result<()> {
        let total: usize = tensors.iter().map(|(_, b)| b.len()).sum();
        ensure!(
            total <= self.buf.len(),
            "internal: {total} bytes do not fit a {}-byte stage",
            self.buf.len()
        );
        self.held.clear();
        let host = self.buf.as_mut_slice()?;
        let mut off = 0;
        let mut dests = vec![];
        let mut rest = &mut host[..total];
        for (name, bytes) in tensors {
            let (d, r) = rest.split_at_mut(bytes.len());
            dests.push((d, *bytes));
            rest = r;
            self.held.insert(name.clone(), off..off + bytes.len());
            off += bytes.len();
        }
        const CHUNK: usize = 4 << 20;
        dests.into_par_iter().for_each(|(d, b)| {
            d.par_chunks_mut(CHUNK)
                .zip(b.par_chunks(CHUNK))
                .for_each(|(d, b)| d.copy_from_slice(b));
        });
        Ok(())
    }

    /// Tensor `name` from the stage as `dtype` (stored as `stored`) with `shape`, on `device`;
    /// `None` when the stage does not hold it.
    pub fn upload(
        &self,
        device: &Device,
        name: &str,
        stored: DType,
        shape: &[usize],
    ) -> Result<Option<Tensor>> {
        let Some(range) = self.held.get(name).cloned() else {
            return Ok(None);
        };
        let dev = cuda(device)?;
        let stream = dev.cuda_stream();
        let n: usize = shape.iter().product();
        ensure!(
            n * stored.size_in_bytes() == range.len(),
            "internal: staged tensor {name} has {} bytes, its shape {shape:?} needs {}",
            range.len(),
            n * stored.size_in_bytes()
        );
        let host = &self.buf.as_slice()?[range];
        macro_rules! copy {
            ($t:ty) => {{
                let dst: CudaSlice<$t> = unsafe { stream.alloc(n) }?;
                let (ptr, _record) = dst.device_ptr(&stream);
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(ptr, host, stream.cu_stream())
                }?;
                drop(_record);
                wrap(dst, dev, shape)
            }};
        }
        let t = match stored {
            DType::BF16 => copy!(half::bf16),
            DType::F16 => copy!(half::f16),
            DType::F32 => copy!(f32),
            // Anything else loads from the checkpoint.
            _ => return Ok(None),
        };
        Ok(Some(t))
    }
}

/// Phase timings of the factorization and the solve on stderr when `SOAR_GPTQ_TRACE=1` (a
/// diagnostic for the benchmark; synchronizes the stream at every lap). `SOAR_GPTQ_TRACE=2`
/// also splits the column loop into its in-block kernels and lazy-update GEMMs, synchronizing
/// around every launch (which slows the loop itself).
pub struct Trace<'a> {
    on: bool,
    split: bool,
    stream: &'a Arc<CudaStream>,
    k: usize,
    t: Instant,
}

impl<'a> Trace<'a> {
    pub fn new(stream: &'a Arc<CudaStream>, k: usize) -> Self {
        let level = std::env::var("SOAR_GPTQ_TRACE").unwrap_or_default();
        Self {
            on: level == "1" || level == "2",
            split: level == "2",
            stream,
            k,
            t: Instant::now(),
        }
    }

    pub fn lap(&mut self, what: &str) -> Result<()> {
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
    pub fn split_start(&self) -> Result<Option<Instant>> {
        if !self.split {
            return Ok(None);
        }
        self.stream.synchronize()?;
        Ok(Some(Instant::now()))
    }

    /// Seconds since `split_start`, after synchronizing (0 unless level 2).
    pub fn split_end(&self, t: Option<Instant>) -> Result<f64> {
        match t {
            None => Ok(0.0),
            Some(t) => {
                self.stream.synchronize()?;
                Ok(t.elapsed().as_secs_f64())
            }
        }
    }

    pub fn splits(&self, parts: &[(&str, f64)]) {
        if self.split {
            for (what, s) in parts {
                eprintln!("trace K={}   of which {what}: {:.3} ms", self.k, s * 1e3);
            }
        }
    }
}

/// The precision of a dense factorization on the GPU: f64, or f32 on cards whose FP64 rate is a
/// small fraction of their FP32 rate (`--factor-precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Real {
    F64,
    F32,
}

impl Real {
    pub fn bytes(self) -> usize {
        match self {
            Self::F64 => 8,
            Self::F32 => 4,
        }
    }

    /// The kernel-name suffix (`gather_damped_f64`, `set_identity_f32`).
    pub fn suffix(self) -> &'static str {
        match self {
            Self::F64 => "f64",
            Self::F32 => "f32",
        }
    }
}

/// L⁻¹ of the lower-triangular `[k, k]` matrix at `l` (column-major, `real`) into `x`, which
/// holds I on entry, on the device's cuBLAS handle: a recursive blocked inverse whose work is two
/// triangular matrix products per level (K³/3 FLOP in all, against K³ for a triangular solve
/// against I; docs/decisions.md, L⁻¹ on the GPU by a recursive blocked inverse).
pub fn lower_inverse(dev: &CudaDevice, l: u64, x: u64, k: usize, real: Real) -> Result<()> {
    let blas = dev.cublas_handle();
    lower_inverse_rec(*blas.handle(), l, x, k, 0, k, real)
}

/// Diagonal blocks up to this size are inverted by a triangular solve against I.
const INVERSE_LEAF: usize = 512;

/// X[o..o+m, o..o+m] = L[o..o+m, o..o+m]⁻¹ by solving L·X = I in place (X holds I there).
/// Column-major, leading dimension `k` for both; `l` and `x` are device addresses of `real`.
fn trsm_identity(
    handle: cublas::cublasHandle_t,
    l: u64,
    x: u64,
    k: usize,
    o: usize,
    m: usize,
    real: Real,
) -> Result<()> {
    use cublas::{
        cublasDiagType_t as D, cublasFillMode_t as F, cublasOperation_t as T, cublasSideMode_t as S,
    };
    let at = |base: u64| base + ((o + o * k) * real.bytes()) as u64;
    let (side, fill, op, diag) = (
        S::CUBLAS_SIDE_LEFT,
        F::CUBLAS_FILL_MODE_LOWER,
        T::CUBLAS_OP_N,
        D::CUBLAS_DIAG_NON_UNIT,
    );
    let status = match real {
        Real::F64 => unsafe {
            cublas::cublasDtrsm_v2(
                handle,
                side,
                fill,
                op,
                diag,
                m as i32,
                m as i32,
                &1.0f64,
                at(l) as *const f64,
                k as i32,
                at(x) as *mut f64,
                k as i32,
            )
        },
        Real::F32 => unsafe {
            cublas::cublasStrsm_v2(
                handle,
                side,
                fill,
                op,
                diag,
                m as i32,
                m as i32,
                &1.0f32,
                at(l) as *const f32,
                k as i32,
                at(x) as *mut f32,
                k as i32,
            )
        },
    };
    cublas_ok(status, "trsm (L⁻¹)")
}

/// `C = alpha · op(A) · B` or `B · op(A)` with A lower triangular (cuBLAS `trmm`, out of place).
#[allow(clippy::too_many_arguments)]
fn trmm(
    handle: cublas::cublasHandle_t,
    side: cublas::cublasSideMode_t,
    (m, n): (usize, usize),
    alpha: f64,
    a: u64,
    b: u64,
    c: u64,
    ld: usize,
    real: Real,
) -> Result<()> {
    use cublas::{cublasDiagType_t as D, cublasFillMode_t as F, cublasOperation_t as T};
    let (fill, op, diag) = (
        F::CUBLAS_FILL_MODE_LOWER,
        T::CUBLAS_OP_N,
        D::CUBLAS_DIAG_NON_UNIT,
    );
    let status = match real {
        Real::F64 => unsafe {
            cublas::cublasDtrmm_v2(
                handle,
                side,
                fill,
                op,
                diag,
                m as i32,
                n as i32,
                &alpha,
                a as *const f64,
                ld as i32,
                b as *const f64,
                ld as i32,
                c as *mut f64,
                ld as i32,
            )
        },
        Real::F32 => unsafe {
            cublas::cublasStrmm_v2(
                handle,
                side,
                fill,
                op,
                diag,
                m as i32,
                n as i32,
                &(alpha as f32),
                a as *const f32,
                ld as i32,
                b as *const f32,
                ld as i32,
                c as *mut f32,
                ld as i32,
            )
        },
    };
    cublas_ok(status, "trmm")
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
    real: Real,
) -> Result<()> {
    if m <= INVERSE_LEAF {
        return trsm_identity(handle, l, x, k, o, m, real);
    }
    let m1 = (m / 2).div_ceil(128) * 128;
    let m2 = m - m1;
    lower_inverse_rec(handle, l, x, k, o, m1, real)?;
    lower_inverse_rec(handle, l, x, k, o + m1, m2, real)?;
    let at = |base: u64, r: usize, c: usize| base + ((r + c * k) * real.bytes()) as u64;
    let (x11, x22, x21) = (at(x, o, o), at(x, o + m1, o + m1), at(x, o + m1, o));
    let l21 = at(l, o + m1, o);
    use cublas::cublasSideMode_t as S;
    // X21 = L21 · X11 (X11 lower triangular, on the right).
    trmm(
        handle,
        S::CUBLAS_SIDE_RIGHT,
        (m2, m1),
        1.0,
        x11,
        l21,
        x21,
        k,
        real,
    )?;
    // X21 = −X22 · X21 (X22 lower triangular, on the left; in place).
    trmm(
        handle,
        S::CUBLAS_SIDE_LEFT,
        (m2, m1),
        -1.0,
        x22,
        x21,
        x21,
        k,
        real,
    )
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
        launch_cfg((blocks(k, 256), n as u32, 1), (256, 1, 1)),
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
        launch_cfg((blocks(2 * n, 256), (k / 16) as u32, 1), (256, 1, 1)),
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

/// Whether [`flash_attention_causal`] has a kernel for head dimension `d`.
pub fn flash_attention_supports(d: usize) -> bool {
    matches!(d, 16 | 32 | 64 | 128)
}

/// Query rows per block of [`flash_attention_causal`] (docs/gpu.md, Fused attention).
pub const FLASH_BLOCK_M: usize = 64;

/// Dense causal GQA attention in one kernel (`flash_attn_causal_d{D}_m{BM}` in `gptq.cu`): `q`
/// `[B, T, H, D]`, `k` and `v` `[B, T, KV, D]`, all BF16 on one GPU, query head `h` reading kv
/// head `h / (H / KV)`; returns `o` `[B, T, H·D]` in BF16 with
/// `o[t] = Σ_{s ≤ t} softmax_s(q_t·k_s·scale)·v_s`. The scores, the running max and sum, the
/// rescaling and the P·V accumulator are f32; P is rounded to BF16 as the operand of P·V; the
/// T×T scores are never stored. CPU twin: `model::minicpm_sala::sparse_attention_composed`.
/// `D` must be one of [`flash_attention_supports`].
pub fn flash_attention_causal(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    flash_attention_causal_tiled(q, k, v, scale, FLASH_BLOCK_M)
}

/// [`flash_attention_causal`] with `block_m` (64 or 128) query rows per block, `block_m / 16`
/// warps (the twin test and the benchmark run both).
pub fn flash_attention_causal_tiled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    block_m: usize,
) -> Result<Tensor> {
    let dev = cuda(q.device())?;
    let (b, t, h, d) = q.dims4()?;
    let (_, _, kv, _) = k.dims4()?;
    ensure!(
        k.dims() == [b, t, kv, d] && v.dims() == k.dims(),
        "internal: attention operands differ: q {:?}, k {:?}, v {:?}",
        q.dims(),
        k.dims(),
        v.dims()
    );
    ensure!(
        [q.dtype(), k.dtype(), v.dtype()] == [DType::BF16; 3],
        "internal: fused attention takes BF16 q, k, v"
    );
    ensure!(
        kv > 0 && h.is_multiple_of(kv) && flash_attention_supports(d),
        "internal: fused attention has no kernel for {h} heads over {kv} kv heads of dim {d}"
    );
    ensure!(
        matches!(block_m, 64 | 128),
        "internal: fused attention blocks are 64 or 128 rows, not {block_m}"
    );
    ensure!(b * t > 0, "internal: fused attention of an empty batch");
    // cp.async moves 16-byte chunks: each operand must start 16-byte aligned (rows are D·2 bytes).
    let aligned = |x: &Tensor| -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(if tensor_ptr(&x)? % 16 == 0 {
            x
        } else {
            x.copy()?
        })
    };
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    let stream = dev.cuda_stream();
    let out: CudaSlice<half::bf16> = unsafe { stream.alloc(b * t * h * d) }?;
    let (qp, kp, vp, op) = (
        tensor_ptr(&q)?,
        tensor_ptr(&k)?,
        tensor_ptr(&v)?,
        slice_ptr(&out, &stream),
    );
    // Grid (query tiles, heads, batch), one warp per 16 rows of a tile.
    launch(
        dev,
        &format!("flash_attn_causal_d{d}_m{block_m}"),
        launch_cfg(
            (blocks(t, block_m), h as u32, b as u32),
            (2 * block_m as u32, 1, 1),
        ),
        &[
            &qp,
            &kp,
            &vp,
            &op,
            &(t as i32),
            &(h as i32),
            &(kv as i32),
            &scale,
        ],
    )?;
    Ok(wrap(out, dev, &[b, t, h * d]))
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

/// How many times the GPU's FP32 rate its FP64 rate is (2 on an H100, 64 on RTX and
/// workstation Blackwell cards): the driver's `SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO`.
pub fn fp32_to_fp64_ratio(device: &Device) -> Result<i32> {
    let dev = cuda(device)?;
    Ok(dev.cuda_stream().context().attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO,
    )?)
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
