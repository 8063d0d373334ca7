//! Dense causal GQA attention of the sparse layers in one fused kernel (flash-style, BF16 tensor
//! cores, f32 softmax; `flash_attn_causal_d{D}_m{BM}` in `gptq.cu`) — CPU twin: the composed f32
//! attention, `model::nn::causal_attention_composed`, compared by `tests/cuda/twins.rs`.

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use cudarc::driver::CudaSlice;

use super::cuda::{blocks, cuda, launch, launch_cfg, qkv_dims, slice_ptr, tensor_ptr, wrap};

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
/// T×T scores are never stored. CPU twin: `model::nn::causal_attention_composed`.
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
    let (b, t, h, d, kv) = qkv_dims(q, k, v, "attention")?;
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
