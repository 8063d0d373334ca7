//! InfLLM-v2 block-sparse attention on the GPU (feature `cuda`; kernels in `infllm.cu`): the
//! stage-1 block scores, the top-k block selection and the block-sparse flash attention of a
//! sparse layer (docs/model.md, InfLLM-v2). Their CPU twin is the composed form in
//! `model::infllm` (`block_scores`, `select_blocks`, `block_sparse_attention`), which
//! `tests/cuda/infllm.rs` compares them with. The caller computes the compressed keys (with
//! `model::infllm::compress_keys`, which runs on any device) and passes plain settings: this layer
//! knows nothing of the model's config.
//!
//! Fixed shapes, as the official kernels: head dimension 128, key blocks of 64 tokens, compressed
//! keys every 16 tokens (so 4 per block), `H / KV` dividing 16. BF16 operands, f32 scores, i32
//! selections.

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::cuda::{blocks, cuda, launch_in, qkv_dims, slice_ptr, tensor_ptr, wrap};

/// The head dimension the kernels take.
pub const HEAD_DIM: usize = 128;
/// Tokens per key block the kernels take.
pub const BLOCK_SIZE: usize = 64;
/// Compressed-key stride (tokens) the kernels take.
pub const KERNEL_STRIDE: usize = 16;
/// Query rows per block of [`attend`] (4 warps).
pub const ATTEND_BLOCK_M: usize = 64;

/// InfLLM-v2's settings as the kernels take them (the model's `InfllmV2`, without the model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfllmParams {
    /// Tokens per compressed key of the first compressor (the second takes 4×).
    pub kernel_size: usize,
    /// Tokens between compressed keys of the first compressor (the second takes 4×): 16.
    pub kernel_stride: usize,
    /// Tokens per key block: 64.
    pub block_size: usize,
    /// Leading blocks every query keeps.
    pub init_blocks: usize,
    /// Blocks before the query's own that it always keeps (at least 1).
    pub local_blocks: usize,
    /// Blocks kept per query (`topk + window_size / block_size`).
    pub topk: usize,
}

impl InfllmParams {
    /// Key blocks of a `t`-token sequence.
    pub fn blocks(&self, t: usize) -> usize {
        t.div_ceil(self.block_size)
    }

    /// Blocks selected per query: `min(topk, blocks)`.
    pub fn k(&self, t: usize) -> usize {
        self.topk.min(self.blocks(t))
    }

    /// Compressed keys of the first (`second` false) or second compressor for `t` tokens.
    pub fn compressed_len(&self, t: usize, second: bool) -> usize {
        let m = if second { 4 } else { 1 };
        let (size, stride) = (m * self.kernel_size, m * self.kernel_stride);
        if t < size {
            0
        } else {
            (t - size) / stride + 1
        }
    }

    fn check(&self) -> Result<()> {
        ensure!(
            self.block_size == BLOCK_SIZE && self.kernel_stride == KERNEL_STRIDE,
            "internal: InfLLM-v2 kernels take blocks of {BLOCK_SIZE} and a stride of \
             {KERNEL_STRIDE}, not {} and {}",
            self.block_size,
            self.kernel_stride
        );
        ensure!(
            self.kernel_size >= self.kernel_stride && self.local_blocks >= 1 && self.topk >= 1,
            "internal: InfLLM-v2 settings {self:?}"
        );
        Ok(())
    }
}

/// `x` contiguous with its first element 16-byte aligned (cp.async copies 16-byte chunks).
fn aligned(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    Ok(if x.elem_count() == 0 || tensor_ptr(&x)? % 16 == 0 {
        x
    } else {
        x.copy()?
    })
}

/// Query heads per kv head, checked to divide 16.
fn group(h: usize, kv: usize) -> Result<usize> {
    ensure!(
        kv > 0 && h >= kv && h.is_multiple_of(kv) && 16 % (h / kv) == 0,
        "internal: InfLLM-v2 kernels group 16 query heads per kv head at most, in ratios that \
         divide 16; got {h} heads over {kv} kv heads"
    );
    Ok(h / kv)
}

/// Stage 1 and the block scores (`infllm_block_scores_g{G}`): q `[B, T, H, D]`, the compressed
/// keys k1 `[B, N1, KV, D]` and k2 `[B, N2, KV, D]` (all BF16) → `[B, KV, T, NB]` f32, exactly as
/// `model::infllm::block_scores` defines them (up to one BF16 step where the head sum's rounding
/// differs): `+inf` for forced blocks, the max-pooled P of the block's compressed keys for the
/// others (0 past the visible ones, `−inf` for an empty window). Rows whose query block is below
/// `k(T)` keep every past block whatever the scores, so their products are skipped (P = 0).
pub fn block_scores(q: &Tensor, k1: &Tensor, k2: &Tensor, p: &InfllmParams) -> Result<Tensor> {
    p.check()?;
    let dev = cuda(q.device())?;
    let (b, t, h, d) = q.dims4()?;
    let (b1, n1, kv, d1) = k1.dims4()?;
    let (b2, n2, kv2, d2) = k2.dims4()?;
    ensure!(
        d == HEAD_DIM && (b1, d1) == (b, d) && (b2, kv2, d2) == (b, kv, d),
        "internal: InfLLM-v2 stage 1 operands differ: q {:?}, k1 {:?}, k2 {:?}",
        q.dims(),
        k1.dims(),
        k2.dims()
    );
    ensure!(
        [q.dtype(), k1.dtype(), k2.dtype()] == [DType::BF16; 3],
        "internal: InfLLM-v2 stage 1 takes BF16 q and compressed keys"
    );
    ensure!(
        n1 == p.compressed_len(t, false) && n2 == p.compressed_len(t, true),
        "internal: {n1} and {n2} compressed keys for {t} tokens (want {} and {})",
        p.compressed_len(t, false),
        p.compressed_len(t, true)
    );
    let g = group(h, kv)?;
    ensure!(b * t > 0, "internal: InfLLM-v2 stage 1 of an empty batch");
    ensure!(
        t < i32::MAX as usize / 2,
        "internal: InfLLM-v2 sequence of {t} tokens"
    );
    let nb = p.blocks(t);
    let (q, k1, k2) = (aligned(q)?, aligned(k1)?, aligned(k2)?);
    let ptr = |x: &Tensor| -> Result<u64> {
        // An empty operand is never read (no token sees a compressed key then).
        Ok(if x.elem_count() == 0 {
            0
        } else {
            tensor_ptr(x)?
        })
    };
    let stream = dev.cuda_stream();
    let out: CudaSlice<f32> = unsafe { stream.alloc(b * kv * t * nb) }?;
    let (qp, k1p, k2p, op) = (
        tensor_ptr(&q)?,
        ptr(&k1)?,
        ptr(&k2)?,
        slice_ptr(&out, &stream),
    );
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    // Grid (token tiles of 4 warps × 16/G tokens, kv heads, batch), 128 threads.
    let tokens_per_block = 4 * (16 / g);
    launch_in(
        dev,
        "infllm",
        &format!("infllm_block_scores_g{g}"),
        LaunchConfig {
            grid_dim: (blocks(t, tokens_per_block), kv as u32, b as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        },
        &[
            &qp,
            &k1p,
            &k2p,
            &op,
            &(t as i32),
            &(h as i32),
            &(kv as i32),
            &(n1 as i32),
            &(n2 as i32),
            &(nb as i32),
            &(p.k(t) as i32),
            &(p.init_blocks as i32),
            &(p.local_blocks as i32),
            &scale,
        ],
    )?;
    Ok(wrap(out, dev, &[b, kv, t, nb]))
}

/// The top-k selection (`infllm_select`): block scores `[B, KV, T, NB]` f32 of a `t`-token
/// sequence → `[B, KV, T, K]` i32, `K = k(t)`: per row the K best blocks (the lower index on
/// equal scores, as torch.topk on CUDA), those after the query's block dropped, ascending, padded
/// with −1; identical to `model::infllm::select_blocks` on the same scores. Rows whose query block
/// is below K get `0..=qb` directly (what any scores from [`block_scores`] select).
pub fn select(scores: &Tensor, t: usize, p: &InfllmParams) -> Result<Tensor> {
    p.check()?;
    let dev = cuda(scores.device())?;
    let (b, kv, ts, nb) = scores.dims4()?;
    ensure!(
        ts == t && nb == p.blocks(t) && scores.dtype() == DType::F32,
        "internal: InfLLM-v2 scores {:?} {:?} for {t} tokens",
        scores.dims(),
        scores.dtype()
    );
    let rows = b * kv * t;
    ensure!(
        rows > 0 && rows < i32::MAX as usize,
        "internal: InfLLM-v2 selection of {rows} rows"
    );
    let kk = p.k(t);
    // One warp per row; each warp stages its row's keys and a 256-bin histogram in shared memory.
    let per_warp = (nb + 256) * 4;
    let warps = (48 * 1024 / per_warp).min(4);
    ensure!(
        warps >= 1,
        "internal: InfLLM-v2 selection over {nb} blocks (at most 12032)"
    );
    let scores = scores.contiguous()?;
    let stream = dev.cuda_stream();
    let out: CudaSlice<i32> = unsafe { stream.alloc(rows * kk) }?;
    let (sp, op) = (tensor_ptr(&scores)?, slice_ptr(&out, &stream));
    launch_in(
        dev,
        "infllm",
        "infllm_select",
        LaunchConfig {
            grid_dim: (blocks(rows, warps), 1, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: (warps * per_warp) as u32,
        },
        &[
            &sp,
            &op,
            &(rows as i32),
            &(t as i32),
            &(nb as i32),
            &(kk as i32),
            &(p.block_size as i32),
        ],
    )?;
    Ok(wrap(out, dev, &[b, kv, t, kk]))
}

/// Block-sparse causal attention (`infllm_attend_g{G}_m64`): q `[B, T, H, D]`, k, v
/// `[B, T, KV, D]` BF16 and the selection `sel` `[B, KV, T, K]` i32 → `[B, T, H·D]` BF16: query
/// head `h` of token `i` attends to the keys `s ≤ i` of its kv head `h / (H / KV)` whose block
/// `s / block_size` is in `sel[b, g, i]` (−1 entries ignored), scale `1/sqrt(D)`, f32 softmax, P
/// rounded to BF16 for P·V. CPU twin: `model::infllm::block_sparse_attention`.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sel: &Tensor,
    block_size: usize,
) -> Result<Tensor> {
    attend_tiled(q, k, v, sel, block_size, ATTEND_BLOCK_M)
}

/// [`attend`] with `block_m` (64 or 128) query rows per thread block, `block_m / 16` warps of
/// `16 / G` tokens each (the twin test and the timing test run both).
pub fn attend_tiled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sel: &Tensor,
    block_size: usize,
    block_m: usize,
) -> Result<Tensor> {
    let dev = cuda(q.device())?;
    let (b, t, h, d, kv) = qkv_dims(q, k, v, "InfLLM-v2 attention")?;
    ensure!(
        [q.dtype(), k.dtype(), v.dtype()] == [DType::BF16; 3] && sel.dtype() == DType::I32,
        "internal: InfLLM-v2 attention takes BF16 q, k, v and an i32 selection"
    );
    ensure!(
        d == HEAD_DIM && block_size == BLOCK_SIZE,
        "internal: InfLLM-v2 attention takes D = {HEAD_DIM} and blocks of {BLOCK_SIZE}, not {d} \
         and {block_size}"
    );
    ensure!(
        matches!(block_m, 64 | 128),
        "internal: InfLLM-v2 attention blocks are 64 or 128 rows, not {block_m}"
    );
    let g = group(h, kv)?;
    ensure!(b * t > 0, "internal: InfLLM-v2 attention of an empty batch");
    let (sb, skv, st, kk) = sel.dims4()?;
    ensure!(
        (sb, skv, st) == (b, kv, t) && kk > 0,
        "internal: InfLLM-v2 selection {:?} for q {:?}",
        sel.dims(),
        q.dims()
    );
    let nb = t.div_ceil(block_size);
    let (q, k, v, sel) = (aligned(q)?, aligned(k)?, aligned(v)?, sel.contiguous()?);
    let stream = dev.cuda_stream();
    let out: CudaSlice<half::bf16> = unsafe { stream.alloc(b * t * h * d) }?;
    let (qp, kp, vp, selp, op) = (
        tensor_ptr(&q)?,
        tensor_ptr(&k)?,
        tensor_ptr(&v)?,
        tensor_ptr(&sel)?,
        slice_ptr(&out, &stream),
    );
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    launch_in(
        dev,
        "infllm",
        &format!("infllm_attend_g{g}_m{block_m}"),
        attend_config((b, t, kv), g, block_m, nb),
        &[
            &qp,
            &kp,
            &vp,
            &selp,
            &op,
            &(t as i32),
            &(h as i32),
            &(kv as i32),
            &(nb as i32),
            &(kk as i32),
            &scale,
        ],
    )?;
    Ok(wrap(out, dev, &[b, t, h * d]))
}

/// The launch shape of `infllm_attend_g{g}_m{block_m}` for a batch of `b` sequences of `t`
/// tokens over `kv` kv heads, `g` query heads per kv head and `nb` key blocks: tiles of
/// `block_m / 16` warps of `16 / g` tokens each.
fn attend_config(
    (b, t, kv): (usize, usize, usize),
    g: usize,
    block_m: usize,
    nb: usize,
) -> LaunchConfig {
    // Grid (token tiles, kv heads, batch); K and V tiles (32 KB, the Q tile first) plus one
    // selection bit mask per token of the tile and their union.
    let tokens_per_block = block_m / 16 * (16 / g);
    let smem = 2 * BLOCK_SIZE * HEAD_DIM * 2 + (tokens_per_block + 1) * nb.div_ceil(32) * 4;
    LaunchConfig {
        grid_dim: (blocks(t, tokens_per_block), kv as u32, b as u32),
        block_dim: (2 * block_m as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// The whole InfLLM-v2 attention of a sparse layer from its projections and compressed keys:
/// [`block_scores`], [`select`], [`attend`]. q `[B, T, H, D]`, k, v `[B, T, KV, D]`, k1, k2 the
/// compressed keys → `[B, T, H·D]` BF16.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k1: &Tensor,
    k2: &Tensor,
    p: &InfllmParams,
) -> Result<Tensor> {
    let t = q.dim(1)?;
    let scores = block_scores(q, k1, k2, p)?;
    let sel = select(&scores, t, p)?;
    drop(scores);
    attend(q, k, v, &sel, p.block_size)
}
