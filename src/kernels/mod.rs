//! Device-specific kernels (docs/decisions.md, Device-generic code). Everything else runs through
//! candle's `Device`; these few operations have their own GPU implementation because candle has no
//! equivalent:
//!
//! | kernel | CUDA (`cuda.rs`, `gptq.cu`) | CPU twin |
//! |---|---|---|
//! | XᵀX, BF16 in, f32 accumulate | cuBLAS GemmEx, `beta = 1` per 16 K rows | f32 matmul in `gptq::HessianAccumulator` |
//! | inverse Cholesky factor (f64) with damping escalation | cuSOLVER potrf + trtri | faer in `gptq/solver.rs` |
//! | the GPTQ column loop | fused in-block kernel (a warp per row) + one SGEMM per block | rayon + faer in `gptq/solver.rs` |
//! | GPTQ / Marlin decode | `dequant_gptq`, `dequant_marlin` | `format::dequantize_gptq`, `format::quantized::dequantize_module` |
//!
//! The CPU build (the default, and CI) compiles none of this; `tests/cuda_twins.rs` compares
//! every pair on a GPU machine.

#[cfg(feature = "cuda")]
pub mod cuda;
