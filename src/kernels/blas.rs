//! cuBLAS and cuSOLVER: one cuSOLVER handle per device (cuBLAS's is candle's), the status checks,
//! the precision of a dense factorization ([`Real`]) with `by_real!` for the routines
//! that come in both, and [`lower_inverse`]: the inverse of a lower-triangular matrix by
//! recursive blocking (cuBLAS `trmm`, `trsm` leaves), used by the GPU factorization — CPU twin:
//! faer's inverse.

use std::sync::{Arc, OnceLock};

use anyhow::{anyhow, Result};
use candle_core::CudaDevice;
use cudarc::cublas::sys as cublas;
use cudarc::cusolver::{sys as cusolver, DnHandle};

use super::cuda::{per_ordinal, PerOrdinal};

/// `$f64(args)` or `$f32(args)` by `$real` (a [`Real`]), with `$t` naming that precision's
/// element type inside `args`: the two precisions of a cuBLAS or cuSOLVER routine take the same
/// arguments. Call it inside `unsafe`, as the routine itself.
macro_rules! by_real {
    ($real:expr, $f64:path, $f32:path, |$t:ident| ($($arg:expr),* $(,)?)) => {
        match $real {
            $crate::kernels::blas::Real::F64 => {
                type $t = f64;
                $f64($($arg),*)
            }
            $crate::kernels::blas::Real::F32 => {
                type $t = f32;
                $f32($($arg),*)
            }
        }
    };
}
pub(crate) use by_real;

/// One cuSOLVER handle per device ordinal, on that device's stream.
pub fn solver_handle(dev: &CudaDevice) -> Result<Arc<DnHandle>> {
    static HANDLES: PerOrdinal<Arc<DnHandle>> = OnceLock::new();
    per_ordinal(&HANDLES, dev, |stream| {
        Ok(Arc::new(DnHandle::new(stream.clone()).map_err(|e| {
            anyhow!("creating a cuSOLVER handle: {e:?}")
        })?))
    })
}

pub fn cublas_ok(s: cublas::cublasStatus_t, what: &str) -> Result<()> {
    s.result()
        .map_err(|e| anyhow!("cuBLAS {what} failed: {e:?}"))
}

pub fn cusolver_ok(s: cusolver::cusolverStatus_t, what: &str) -> Result<()> {
    s.result()
        .map_err(|e| anyhow!("cuSOLVER {what} failed: {e:?}"))
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
    let status = unsafe {
        by_real!(real, cublas::cublasDtrsm_v2, cublas::cublasStrsm_v2, |R| (
            handle,
            side,
            fill,
            op,
            diag,
            m as i32,
            m as i32,
            &(1.0 as R),
            at(l) as *const R,
            k as i32,
            at(x) as *mut R,
            k as i32,
        ))
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
    let status = unsafe {
        by_real!(real, cublas::cublasDtrmm_v2, cublas::cublasStrmm_v2, |R| (
            handle,
            side,
            fill,
            op,
            diag,
            m as i32,
            n as i32,
            &(alpha as R),
            a as *const R,
            ld as i32,
            b as *const R,
            ld as i32,
            c as *mut R,
            ld as i32,
        ))
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
