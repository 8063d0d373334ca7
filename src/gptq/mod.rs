//! The GPTQ solver: turns a Linear's weights `W [N, K]` and the Hessian of its inputs into 2–8-bit
//! codes, per-group scales/zeros and `g_idx`, following the reference tools exactly (see
//! `docs/algorithm.md`).
//!
//! * [`HessianAccumulator`] sums `XᵀX` of a Linear's inputs in f32 on any candle device, merges
//!   partial sums and saves/loads them.
//! * [`QuantParams`] is the min/max (optionally MSE) quantizer of one group.
//! * [`gptq_quantize`] runs damping, the inverse Cholesky factor (f64) and the blocked column loop with
//!   lazy updates (f32) in static, dynamic or no act-order; [`rtn_quantize`] is the no-feedback
//!   baseline with the same quantizer.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod hessian;
mod plan;
mod quantizer;
mod refit;
mod solver;
mod types;

pub use cpu::rtn_quantize;
pub use hessian::HessianAccumulator;
pub use plan::{ParamsAt, SolvePlan};
pub use quantizer::{dequantize_code, quantize_code, QuantParams};
pub use refit::{refit_scales, RefitStats};
pub use solver::{factorize, gptq_quantize, gptq_quantize_factored};
pub use types::{
    valid_damp, ActOrder, FactorPrecision, Factorization, QuantizedLinear, SolveOptions,
    SolveTimings,
};
