//! Device-specific kernels (docs/decisions.md, Device-generic code). Everything else runs through
//! candle's `Device`; these few operations have their own GPU implementation because candle has no
//! equivalent:
//!
//! | kernel | CUDA | CPU twin |
//! |---|---|---|
//! | XᵀX, BF16 in, f32 accumulate (`xtx.rs`) | cuBLAS GemmEx, `beta = 1` per 16 K rows, in place on the blocks on and above the diagonal (`xtx_add_upper`), the rest mirrored when read (`mirror_upper_blocks`) | f32 matmul in `gptq::HessianAccumulator` |
//! | inverse Cholesky factor (f64) with damping escalation | cuSOLVER potrf, then L⁻¹ by recursive blocking (`blas.rs`: cuBLAS trmm, trsm leaves) | faer in `gptq/solver.rs` |
//! | group parameters (min/max, MSE range search; `gptq.cu`) | `find_params_tiled` (groups ≤ 128 columns staged in shared memory, 4 threads per row for the search), `find_params` (whole rows) | `gptq::QuantParams::find_row_params` |
//! | the GPTQ column loop (`gptq.cu`) | fused in-block kernel (a warp per row) + one SGEMM per block | rayon + faer in `gptq/solver.rs` |
//! | GPTQ / Marlin decode (`dequant.rs`) | `dequant_gptq`, `dequant_marlin` | `format::dequantize_gptq`, `format::quantized::dequantize_module` |
//! | causal GQA attention of the sparse layers, BF16 in/out (`flash.rs`) | `flash_attn_causal_d{16,32,64,128}_m{64,128}`: fused flash-style (mma.sync BF16, f32 online softmax, P rounded to BF16 for P·V) | `model::nn::causal_attention_composed` (f32 scores, mask, softmax, P·V) |
//! | Simple-GLA of the lightning layers, BF16 or f32 in, f32 out | `gla_fwd_d{16,32,64,128}_{bf16,f32}` (`gla.rs`, `gla.cu`): chunks of 64 walked in order per (value slice, head, batch), the state slice on chip, f32 FFMA | `model::gla::chunked` (and `chunk_parallel`, the model's form) |
//! | InfLLM-v2 stage 1 and block scores (`infllm.rs`, `infllm.cu`) | `infllm_block_scores_g{1,2,4,8,16}`: per kv group, 16 rows = 16/G tokens × G heads on mma.sync BF16; K2 log-sum-exp and K1 probabilities in f32, head sum rounded to BF16, max-pooled into blocks, forced blocks +inf | `model::infllm::block_scores` |
//! | InfLLM-v2 top-k block selection | `infllm_select`: a warp per row, radix select on order-preserving keys, lower index on ties | `model::infllm::select_blocks` |
//! | InfLLM-v2 block-sparse attention, BF16 in/out | `infllm_attend_g{1,2,4,8,16}_m{64,128}`: the flash kernel's tiles over the union of a tile's tokens' selected blocks, each row masked to its own token's blocks and keys | `model::infllm::block_sparse_attention` |
//!
//! The custom kernels of the first six rows are in `gptq.cu`; those of the factorization, the group
//! parameters and the column loop are launched by the GPU solve itself (`gptq/cuda.rs`). Beside the kernel files: `cuda.rs` (the device of a tensor,
//! raw addresses, the fatbins loaded once per device, launching), `blas.rs` (cuBLAS/cuSOLVER
//! handles and status, `Real`, the precision of a factorization), `transfer.rs` (page-locked
//! staging of the codes, device to host, and of the next decoder layer's weights, `PinnedStage`,
//! host to device; `CopyStream`, the layer caches out and back on a second stream), `memory.rs` (free and used memory, the stream-ordered pool, the FP64 rate),
//! `trace.rs` (`SOAR_GPTQ_TRACE` phase timings).
//!
//! The CPU build (the default, and CI) compiles none of this; `tests/cuda/twins.rs` (and
//! `tests/cuda/gla.rs` for Simple-GLA, `tests/cuda/infllm.rs` for InfLLM-v2) compares every
//! pair on a GPU machine.

#[cfg(feature = "cuda")]
pub mod blas;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod dequant;
#[cfg(feature = "cuda")]
pub mod flash;
#[cfg(feature = "cuda")]
pub mod gla;
#[cfg(feature = "cuda")]
pub mod infllm;
#[cfg(feature = "cuda")]
pub mod memory;
#[cfg(feature = "cuda")]
pub mod trace;
#[cfg(feature = "cuda")]
pub mod transfer;
#[cfg(feature = "cuda")]
pub mod xtx;
