//! XᵀX on tensor cores (cuBLAS GemmEx, f32 accumulation) and the reads of a Hessian the GPU
//! factorization starts from. [`xtx_add`]: `Σ xᵀx` with BF16/F16 inputs (one GemmEx per 16 K
//! rows, `beta = 1` across them) — CPU twin: the f32 matmul of
//! [`HessianAccumulator`](crate::gptq::HessianAccumulator), compared by `tests/cuda/twins.rs`;
//! [`xtx_add_upper`] the same in place on the blocks on and above the diagonal only,
//! [`mirror_upper_blocks`] (`gptq.cu`) the rest; [`diagonal`] and [`count_nonfinite`] (`gptq.cu`).

use anyhow::{bail, ensure, Result};
use candle_core::{CudaDevice, DType, Tensor};
use cudarc::cublas::sys as cublas;
use cudarc::driver::CudaSlice;

use super::blas::cublas_ok;
use super::cuda::{blocks, cuda, launch, launch_cfg, slice_ptr, tensor_ptr};

/// Rows of X per GemmEx call when accumulating XᵀX; partial sums add in f32 (`beta = 1`).
const XTX_CHUNK_ROWS: usize = 16384;

/// The cuBLAS type of a tensor-core XᵀX operand: BF16 or F16.
fn input_type(dtype: DType) -> Result<cublas::cudaDataType_t> {
    Ok(match dtype {
        DType::BF16 => cublas::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType_t::CUDA_R_16F,
        other => bail!("internal: tensor-core XᵀX takes BF16 or F16 inputs, got {other:?}"),
    })
}

/// `C += A·Bᵀ` (column-major) on tensor cores with f32 accumulation (cuBLAS GemmEx,
/// `alpha = beta = 1`, compute type 32F): `A` `[m, len]` at `a` and `B` `[n, len]` at `b` of
/// `in_type`, `C` `[m, n]` f32 at `c`, leading dimension `ld` for all three. `what` names the
/// product in the error.
fn gemm_accumulate(
    handle: cublas::cublasHandle_t,
    (m, n, len): (usize, usize, usize),
    (a, b, c): (u64, u64, u64),
    ld: usize,
    in_type: cublas::cudaDataType_t,
    what: &str,
) -> Result<()> {
    let (alpha, beta) = (1.0f32, 1.0f32);
    let status = unsafe {
        cublas::cublasGemmEx(
            handle,
            cublas::cublasOperation_t::CUBLAS_OP_N,
            cublas::cublasOperation_t::CUBLAS_OP_T,
            m as i32,
            n as i32,
            len as i32,
            &alpha as *const f32 as *const _,
            a as *const _,
            in_type,
            ld as i32,
            b as *const _,
            in_type,
            ld as i32,
            &beta as *const f32 as *const _,
            c as *mut _,
            cublas::cudaDataType_t::CUDA_R_32F,
            ld as i32,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    cublas_ok(status, what)
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
    let in_type = input_type(a.dtype())?;
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let out = acc.contiguous()?.copy()?;
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let (ap, bp, op) = (tensor_ptr(&a)?, tensor_ptr(&b)?, tensor_ptr(&out)?);
    let elem = a.dtype().size_in_bytes() as u64;
    let mut start = 0;
    while start < rows {
        let len = XTX_CHUNK_ROWS.min(rows - start);
        let offset = (start * k) as u64 * elem;
        // Row-major A, B [len, K] are column-major Aᶜ, Bᶜ [K, len]. The column-major result
        // Cᶜ = Bᶜ·Aᶜᵀ read row-major is its transpose, Aᶜ·Bᶜᵀ = aᵀb.
        gemm_accumulate(
            *blas.handle(),
            (k, k, len),
            (bp + offset, ap + offset, op),
            k,
            in_type,
            "GemmEx (aᵀb)",
        )?;
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
    let in_type = input_type(x.dtype())?;
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
    let mut start = 0;
    while start < rows {
        let len = XTX_CHUNK_ROWS.min(rows - start);
        let base = xp + (start * k) as u64 * elem;
        for (bi, &(i0, ni)) in blocks.iter().enumerate() {
            for &(j0, nj) in &blocks[bi..] {
                // Row-major x [len, K] is column-major Xᶜ [K, len]; the row-major block
                // C[i0.., j0..] (i block ≤ j block) is the column-major block at rows j0..,
                // columns i0.. (ldc = K): Xᶜ[j0.., :] · Xᶜ[i0.., :]ᵀ.
                gemm_accumulate(
                    *blas.handle(),
                    (nj, ni, len),
                    (
                        base + j0 as u64 * elem,
                        base + i0 as u64 * elem,
                        op + ((i0 * k + j0) * 4) as u64,
                    ),
                    k,
                    in_type,
                    "GemmEx (XᵀX block)",
                )?;
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
