//! InfLLM-v2 block-sparse attention, as the official MiniCPM-SALA code computes it in a sparse
//! ("minicpm4") layer at and above `sparse_config.dense_len` (docs/model.md, InfLLM-v2): the
//! keys compressed into overlapping window means (two compressors), query-to-compressed-key
//! scores summed over each kv group's query heads (stage 1), max-pooled into key blocks with the
//! first blocks and the local window forced in, the top blocks selected per query token and kv
//! head, and exact softmax attention over the selected blocks (stage 2).
//!
//! This file is the composed form that runs on the CPU and is the GPU kernels' twin
//! (`kernels::infllm`, feature `cuda`; `tests/cuda/infllm.rs` compares them).
//! `tests/integration/forward_reference.rs` checks it against an f64 oracle written from the
//! same description.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

/// The official kernels' fixed shapes: a compressed key is the mean of 32 keys every 16, the
/// second compressor takes 4× both, and key blocks are 64 tokens (docs/model.md, InfLLM-v2).
pub const KERNEL_SIZE: usize = 32;
pub const KERNEL_STRIDE: usize = 16;
pub const BLOCK_SIZE: usize = 64;
/// Query heads per kv head the kernels compute with: fewer are repeated up to it (a no-op for
/// the result), more are not supported.
pub const GROUP: usize = 16;
/// The head dimension the official kernels are built for.
pub const HEAD_DIM: usize = 128;

/// InfLLM-v2's settings for one model, from `sparse_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfllmV2 {
    pub kernel_size: usize,
    pub kernel_stride: usize,
    pub block_size: usize,
    /// Leading blocks every query attends to (`init_blocks`).
    pub init_blocks: usize,
    /// Blocks before the query's own that it always attends to (`window_size / block_size`).
    pub local_blocks: usize,
    /// Blocks kept per query: `topk + window_size / block_size`.
    pub topk: usize,
}

impl InfllmV2 {
    /// Compressed keys of the first (`kernel_size` every `kernel_stride`) and second (4× both)
    /// compressor for `t` tokens: complete windows only.
    pub fn compressed_len(&self, t: usize, second: bool) -> usize {
        let (size, stride) = self.compressor(second);
        if t < size {
            0
        } else {
            (t - size) / stride + 1
        }
    }

    fn compressor(&self, second: bool) -> (usize, usize) {
        if second {
            (4 * self.kernel_size, 4 * self.kernel_stride)
        } else {
            (self.kernel_size, self.kernel_stride)
        }
    }

    /// Key blocks of a `t`-token sequence.
    pub fn blocks(&self, t: usize) -> usize {
        t.div_ceil(self.block_size)
    }

    /// Blocks selected per query (before future ones are dropped): `min(topk, blocks)`.
    pub fn k(&self, t: usize) -> usize {
        self.topk.min(self.blocks(t))
    }

    /// How many compressed keys of the given compressor query `i` of a `t`-token sequence sees:
    /// columns `0..visible` (a window is visible once it lies at or before `i`). Kernel-exact:
    /// the stage-1 kernel derives the limit with truncating integer division, which drops each
    /// query's newest window when `t ≡ −1 (mod stride)` (docs/model.md, InfLLM-v2).
    pub fn visible(&self, i: usize, t: usize, second: bool) -> usize {
        let (_, stride) = self.compressor(second);
        let n = self.compressed_len(t, second) as i64;
        let s = stride as i64;
        // C division truncates toward zero (t − s + 1 may be negative for short sequences).
        let off = n - (t as i64 - s + 1) / s;
        let l = ((i as i64 + 1) / s - 1 + off).max(0);
        (l.min(n)) as usize
    }

    /// Whether block `b` is forced in for a query in block `qb`: one of the first `init_blocks`,
    /// or the query's own block or one of the `local_blocks` before it.
    pub fn forced(&self, b: usize, qb: usize) -> bool {
        b < self.init_blocks || (qb >= b && qb <= b + self.local_blocks)
    }
}

/// `k` `[B, T, KV, D]` → the means of its complete windows of `size` tokens every `stride`,
/// `[B, N, KV, D]`, computed in f32 and returned in k's dtype. `size` is a multiple of `stride`.
pub fn compress_keys(k: &Tensor, size: usize, stride: usize) -> Result<Tensor> {
    let (b, t, kv, d) = k.dims4()?;
    ensure!(
        stride > 0 && size.is_multiple_of(stride),
        "internal: compressor {size}/{stride}"
    );
    let n = if t < size { 0 } else { (t - size) / stride + 1 };
    if n == 0 {
        return Ok(Tensor::zeros((b, 0, kv, d), k.dtype(), k.device())?);
    }
    // Sums of consecutive stride-long pieces; window j is the sum of pieces j .. j + size/stride.
    let pieces = n - 1 + size / stride;
    let s = k
        .narrow(1, 0, pieces * stride)?
        .to_dtype(DType::F32)?
        .reshape((b, pieces, stride, kv, d))?
        .sum(2)?;
    let mut acc = s.narrow(1, 0, n)?;
    for u in 1..size / stride {
        acc = (acc + s.narrow(1, u, n)?)?;
    }
    Ok((acc / size as f64)?.to_dtype(k.dtype())?)
}

/// Stage 1 and the block scores, on the CPU: for each batch row, kv head and query token, the
/// score of every key block (`[B, KV, T, NB]` row-major): `+inf` for forced blocks, else the
/// maximum over the block's pooling window of P, where
/// `P[i, j] = bf16(Σ_{heads h of the group} exp(s·q_h·K1[j] − LSE_h))` over visible K1 columns
/// (0 elsewhere) and `LSE_h` is the log-sum-exp of `s·q_h·K2[c]` over the visible K2 windows
/// (a row with none is all 0); `−inf` for an empty pooling window. q `[B, T, H, D]`, k1, k2
/// `[B, N, KV, D]`.
pub fn block_scores(cfg: &InfllmV2, q: &Tensor, k1: &Tensor, k2: &Tensor) -> Result<Vec<f32>> {
    use rayon::prelude::*;
    let (b, t, h, d) = q.dims4()?;
    let kv = k1.dim(2)?;
    let g = h / kv;
    let (n1, n2) = (k1.dim(1)?, k2.dim(1)?);
    let nb = cfg.blocks(t);
    let k = cfg.k(t);
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let f32v = |x: &Tensor| -> Result<Vec<f32>> {
        Ok(x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let qv = f32v(q)?;
    let (k1v, k2v) = (f32v(k1)?, f32v(k2)?);
    let r = cfg.block_size / cfg.kernel_stride;
    let dot = |a: &[f32], bb: &[f32]| -> f32 { a.iter().zip(bb).map(|(x, y)| x * y).sum() };
    let mut out = vec![0f32; b * kv * t * nb];
    out.par_chunks_mut(nb).enumerate().for_each(|(row, o)| {
        let (bi, gi, i) = (row / (kv * t), (row / t) % kv, row % t);
        let qb = i / cfg.block_size;
        let (l1, l2) = (cfg.visible(i, t, false), cfg.visible(i, t, true));
        // P over the visible K1 columns (0 elsewhere). A query that sees no more than k blocks
        // keeps all of them whatever the scores (forced blocks are +inf, the others ≥ 0 = the
        // score of every future block, and ties go to the lower index), so its P is not needed.
        let mut p = vec![0f32; n1];
        if l2 > 0 && qb >= k {
            let mut s2 = vec![0f32; l2];
            let mut acc = vec![0f32; l1];
            for hh in gi * g..(gi + 1) * g {
                let qrow = &qv[((bi * t + i) * h + hh) * d..][..d];
                for (c, s) in s2.iter_mut().enumerate() {
                    *s = scale * dot(qrow, &k2v[((bi * n2 + c) * kv + gi) * d..][..d]);
                }
                let m = s2.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = m + s2.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
                for (j, a) in acc.iter_mut().enumerate() {
                    let s1 = scale * dot(qrow, &k1v[((bi * n1 + j) * kv + gi) * d..][..d]);
                    *a += (s1 - lse).exp();
                }
            }
            for (pj, a) in p.iter_mut().zip(&acc) {
                *pj = half::bf16::from_f32(*a).to_f32();
            }
        }
        for (blk, ob) in o.iter_mut().enumerate() {
            *ob = if cfg.forced(blk, qb) {
                f32::INFINITY
            } else {
                let lo = (r * blk).saturating_sub(1);
                let hi = (r * blk + r).min(n1);
                if hi > lo {
                    p[lo..hi].iter().copied().fold(f32::NEG_INFINITY, f32::max)
                } else {
                    f32::NEG_INFINITY
                }
            };
        }
    });
    Ok(out)
}

/// The blocks each query attends to, from its block scores (`[rows, NB]`, one row per batch row,
/// kv head and token, token index `i = row % t`): the `k` best (higher score first, the lower
/// index on ties, as torch.topk on CUDA), those after the query's own block dropped, in
/// ascending order, padded with −1 to `k` entries: `[rows, k]`.
pub fn select_blocks(cfg: &InfllmV2, scores: &[f32], t: usize) -> Vec<i32> {
    let nb = cfg.blocks(t);
    let k = cfg.k(t);
    let rows = scores.len() / nb.max(1);
    let mut out = vec![-1i32; rows * k];
    let mut order: Vec<usize> = Vec::with_capacity(nb);
    for r in 0..rows {
        let row = &scores[r * nb..][..nb];
        let qb = (r % t) / cfg.block_size;
        order.clear();
        order.extend(0..nb);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let mut sel: Vec<i32> = order[..k]
            .iter()
            .filter(|&&b| b <= qb)
            .map(|&b| b as i32)
            .collect();
        sel.sort_unstable();
        out[r * k..r * k + sel.len()].copy_from_slice(&sel);
    }
    out
}

/// Stage 2, composed: softmax attention of each query over the keys of its selected blocks
/// (`sel` `[B, KV, T, k]` as [`select_blocks`] returns it) at or before it. q `[B, T, H, D]`,
/// k, v `[B, T, KV, D]` → `[B, T, H·D]` in q's dtype; scores, softmax and `P·V` in f32 (the
/// kernel rounds P to BF16 before `P·V`, as flash attention does). Query rows run in chunks so
/// the masked scores stay small at long context.
pub fn block_sparse_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sel: &[i32],
    cfg: &InfllmV2,
) -> Result<Tensor> {
    let (b, t, h, d) = q.dims4()?;
    let kv = k.dim(2)?;
    let g = h / kv;
    let kk = cfg.k(t);
    ensure!(
        sel.len() == b * kv * t * kk,
        "internal: selection of {} entries for {b}×{kv}×{t}×{kk}",
        sel.len()
    );
    let dev = q.device();
    let f32t = |x: &Tensor| x.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous();
    let (qf, kf, vf) = (f32t(q)?, f32t(k)?, f32t(v)?); // [B, H|KV, T, D]
                                                       // Each kv head repeated for its query heads (consecutively, as GQA groups them).
    let kt = super::nn::repeat_kv(&kf, g)?.t()?.contiguous()?;
    let vr = super::nn::repeat_kv(&vf, g)?.contiguous()?;
    let scale = 1.0 / (d as f64).sqrt();
    let chunk = query_chunk(b * h, t);
    let mut outs = vec![];
    let mut start = 0;
    while start < t {
        let len = chunk.min(t - start);
        // Additive mask [B, KV, 1, len, T]: 0 on selected keys at or before the query.
        let mut mask = vec![f32::NEG_INFINITY; b * kv * len * t];
        for bi in 0..b {
            for gi in 0..kv {
                for qi in 0..len {
                    let i = start + qi;
                    let row = &mut mask[((bi * kv + gi) * len + qi) * t..][..t];
                    for &blk in &sel[((bi * kv + gi) * t + i) * kk..][..kk] {
                        if blk < 0 {
                            continue;
                        }
                        let lo = blk as usize * cfg.block_size;
                        let hi = (lo + cfg.block_size).min(i + 1);
                        row[lo.min(hi)..hi].iter_mut().for_each(|x| *x = 0.0);
                    }
                }
            }
        }
        let mask = Tensor::from_vec(mask, (b, kv, 1, len, t), dev)?;
        let qc = qf.narrow(2, start, len)?.contiguous()?;
        let scores = (qc.matmul(&kt)? * scale)?.reshape((b, kv, g, len, t))?;
        let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        outs.push(p.reshape((b, h, len, t))?.matmul(&vr)?);
        start += len;
    }
    let o = Tensor::cat(&outs, 2)?;
    Ok(o.transpose(1, 2)?
        .reshape((b, t, h * d))?
        .to_dtype(q.dtype())?)
}

/// Query rows per chunk so that `[rows·heads, chunk, T]` f32 scores stay near 256 MB.
pub fn query_chunk(heads_rows: usize, t: usize) -> usize {
    let budget = 256usize << 20;
    (budget / (4 * heads_rows.max(1) * t.max(1))).clamp(16, t.max(16))
}

/// InfLLM-v2 attention of a sparse layer, composed (the CPU form and the GPU kernels' twin):
/// q `[B, T, H, D]`, k, v `[B, T, KV, D]` (no RoPE: the sparse layers use none) → `[B, T, H·D]`.
pub fn attention(cfg: &InfllmV2, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let t = q.dim(1)?;
    let sel = selection(cfg, q, k)?;
    block_sparse_attention(q, k, v, &sel, cfg).map_err(|e| e.context(format!("T = {t}")))
}

/// The selected blocks `[B, KV, T, k]` of [`attention`] (compressors, stage 1, pooling, top-k).
pub fn selection(cfg: &InfllmV2, q: &Tensor, k: &Tensor) -> Result<Vec<i32>> {
    let t = q.dim(1)?;
    let (s1, st1) = cfg.compressor(false);
    let (s2, st2) = cfg.compressor(true);
    let k1 = compress_keys(k, s1, st1)?;
    let k2 = compress_keys(k, s2, st2)?;
    let scores = block_scores(cfg, q, &k1, &k2)?;
    Ok(select_blocks(cfg, &scores, t))
}

/// An `[B, KV, T, k]` selection as a device tensor (i32), for the GPU kernels.
pub fn selection_tensor(
    sel: Vec<i32>,
    dims: (usize, usize, usize, usize),
    device: &Device,
) -> Result<Tensor> {
    Ok(Tensor::from_vec(sel, dims, device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> InfllmV2 {
        InfllmV2 {
            kernel_size: 32,
            kernel_stride: 16,
            block_size: 64,
            init_blocks: 1,
            local_blocks: 2,
            topk: 4 + 2,
        }
    }

    #[test]
    fn visibility_follows_the_kernel_including_its_off_by_one() {
        let c = cfg();
        // A window is visible once it lies at or before the query.
        let t = 1024;
        assert_eq!(c.visible(30, t, false), 0);
        assert_eq!(c.visible(31, t, false), 1);
        assert_eq!(c.visible(46, t, false), 1);
        assert_eq!(c.visible(47, t, false), 2);
        assert_eq!(c.visible(126, t, true), 0);
        assert_eq!(c.visible(127, t, true), 1);
        assert_eq!(c.visible(t - 1, t, false), c.compressed_len(t, false));
        // T ≡ 15 (mod 16): every query's newest K1 window is dropped; T ≡ 63 (mod 64): K2's.
        let t = 1023 + 16; // 1039 = 64·16 + 15
        assert_eq!(t % 16, 15);
        assert_eq!(c.visible(47, t, false), 1);
        let t = 1087; // 1087 % 64 = 63
        assert_eq!(c.visible(191, t, true), 1);
        assert_eq!(c.visible(127, t, true), 0);
    }

    #[test]
    fn compressed_keys_are_window_means() {
        let dev = Device::Cpu;
        let t = 100;
        let data: Vec<f32> = (0..t * 2 * 3).map(|x| (x as f32 * 0.37).sin()).collect();
        let k = Tensor::from_vec(data.clone(), (1, t, 2, 3), &dev).unwrap();
        let c = compress_keys(&k, 32, 16).unwrap();
        assert_eq!(c.dims(), &[1, 5, 2, 3]);
        let cv: Vec<f32> = c.flatten_all().unwrap().to_vec1().unwrap();
        for j in 0..5 {
            for g in 0..2 {
                for e in 0..3 {
                    let want: f64 = (16 * j..16 * j + 32)
                        .map(|s| data[(s * 2 + g) * 3 + e] as f64)
                        .sum::<f64>()
                        / 32.0;
                    assert!((cv[(j * 2 + g) * 3 + e] as f64 - want).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn selection_keeps_forced_blocks_and_the_best_others_lowest_index_on_ties() {
        let c = cfg(); // k = 6: block 0, the query's block and the 2 before it, 2 more
        let t = 64 * 10;
        let nb = 10;
        // One row, for a query in block 9: forced 0, 7, 8, 9; others scored.
        let i = 64 * 9 + 5;
        let mut scores = vec![0f32; t * nb];
        let row = &mut scores[i * nb..][..nb];
        let vals = [9.0, 0.5, 0.7, 0.7, 0.1, 0.7, 0.2, 9.0, 9.0, 9.0];
        for (b, v) in vals.iter().enumerate() {
            row[b] = if c.forced(b, 9) { f32::INFINITY } else { *v };
        }
        let sel = select_blocks(&c, &scores, t);
        assert_eq!(&sel[i * 6..i * 6 + 6], &[0, 2, 3, 7, 8, 9]);
        // A query in block 1 keeps blocks 0 and 1 and pads with −1.
        let i = 64 + 3;
        assert_eq!(&sel[i * 6..i * 6 + 6], &[0, 1, -1, -1, -1, -1]);
    }
}
