//! The GPTQ solver's entry points (docs/algorithm.md: Preprocessing of H, The column loop,
//! Post-processing): [`factorize`] once per Hessian, [`gptq_quantize_factored`] per Linear, each
//! on the device the Hessian or the factorization is on — the CPU backend (`cpu.rs`) or the CUDA
//! one (`cuda.rs`), which share their types (`types.rs`) and follow the same steps.
//!
//! Names follow IST-DASLab's `gptq.py`: `H` the Hessian, `U` the upper Cholesky factor of `H⁻¹`
//! (`Hinv` there), `W` the weights being updated, `Q` their quantized values, `Err1` the scaled
//! errors of one block, `blocksize` columns per block.

use anyhow::{ensure, Result};
use candle_core::Tensor;

use super::cpu;
use super::plan::SolvePlan;
use super::types::{matrix_dims, FactorData, Factorization, QuantizedLinear, SolveOptions};

/// Factorizes `h` (`[K, K]`) for the act-order and damping of `opts`: on the GPU when `h` is
/// there, else on the CPU (f64, or f32 with `--factor-precision f32`).
pub fn factorize(h: &Tensor, opts: &SolveOptions) -> Result<Factorization> {
    opts.validate()?;
    let (hk, hk2) = matrix_dims(h, "Hessian", &opts.module)?;
    ensure!(
        hk == hk2,
        "module {}: Hessian is [{hk}, {hk2}], not square",
        opts.module
    );
    #[cfg(feature = "cuda")]
    if h.device().is_cuda() {
        return super::cuda::factorize(h, opts);
    }
    cpu::factorize(h, hk, opts)
}

/// GPTQ-quantizes `w` (`[N, K]`, any float dtype) with the Hessian `h` (`[K, K]`) of its inputs.
/// On a CUDA device the whole solve runs there (`gptq/cuda.rs`); elsewhere on the CPU. Both
/// follow the same steps; see the module docs.
pub fn gptq_quantize(w: &Tensor, h: &Tensor, opts: &SolveOptions) -> Result<QuantizedLinear> {
    gptq_quantize_factored(w, &factorize(h, opts)?, opts)
}

/// [`gptq_quantize`] with a [`Factorization`] made by [`factorize`] (once per Hessian). The
/// reported `timings.factor_s` is the factorization's own time.
pub fn gptq_quantize_factored(
    w: &Tensor,
    f: &Factorization,
    opts: &SolveOptions,
) -> Result<QuantizedLinear> {
    opts.validate()?;
    let (_, k) = matrix_dims(w, "weight", &opts.module)?;
    ensure!(
        k == f.k,
        "module {}: the Hessian has K = {} but the weight has K = {k} input columns",
        opts.module,
        f.k
    );
    ensure!(
        f.act_order == opts.act_order,
        "internal: factorization made for act-order {:?}, solve asks for {:?}",
        f.act_order,
        opts.act_order
    );
    let plan = SolvePlan::new(&f.perm, opts.quant.group_size, opts.act_order);
    let w = &f.target(w)?;
    match &f.u {
        FactorData::Cpu(u) => Ok(cpu::solve_factored(w, f, u, plan, opts)?.0),
        #[cfg(feature = "cuda")]
        FactorData::Cuda(u) => super::cuda::solve(w, f, u, &plan, opts),
    }
}
