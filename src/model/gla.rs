//! Simple-GLA (fla `simple_gla` with a fixed per-head log decay), the lightning layers' mixer.
//!
//! Per head h with decay γ_h: S_t = γ_h·S_{t−1} + k_tᵀ v_t and o_t = scale · q_t S_t.
//! Four equal forms: the chunk-parallel one the model runs (all chunks at once, a handful of
//! batched matmuls; output only, from a zero state), the chunked one (chunk after chunk, with
//! states in and out), and the recurrent and O(T²) ones kept as test oracles. All take
//! `[B, H, T, D]` f32 tensors; all but the first take an optional incoming state `[B, H, Dk, Dv]`
//! and return the output and the final state.

use candle_core::{DType, Device, Result, Tensor};

/// ALiBi slopes (`_build_slope_tensor`): for a power of two n, slope_i = start^(i+1) with
/// start = 2^(−2^(−(log2 n − 3))); other n interleave the slopes of 2·closest power of two.
pub fn alibi_slopes(n: usize) -> Vec<f64> {
    fn pow2(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
        (0..n).map(|i| start.powi(i as i32 + 1)).collect()
    }
    if n.is_power_of_two() {
        return pow2(n);
    }
    let closest = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let mut s = pow2(closest);
    s.extend(pow2(2 * closest).into_iter().step_by(2).take(n - closest));
    s
}

/// Per-head multiplicative decays γ_h = exp(−slope_h).
pub fn decays(n_heads: usize) -> Vec<f64> {
    alibi_slopes(n_heads)
        .into_iter()
        .map(|s| (-s).exp())
        .collect()
}

fn per_head(
    values: impl Fn(usize) -> Vec<f64>,
    heads: usize,
    inner: &[usize],
    dev: &Device,
) -> Result<Tensor> {
    let mut data = Vec::new();
    for h in 0..heads {
        data.extend(values(h).into_iter().map(|x| x as f32));
    }
    let mut shape = vec![1, heads];
    shape.extend_from_slice(inner);
    Tensor::from_vec(data, shape, dev)
}

fn zero_state(q: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, h, _, dk) = q.dims4()?;
    Tensor::zeros((b, h, dk, v.dim(3)?), DType::F32, q.device())
}

/// Chunked form (fla `chunk_simple_gla`): within a chunk, ((Q Kᵀ) ⊙ D) V plus the carried state
/// (γ^{i+1} Q) S; then S ← γ^m S + (γ^{m−1−j} K)ᵀ V with m the chunk's real length, so a
/// last chunk shorter than `chunk` needs no padding.
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
    scale: f64,
    chunk: usize,
    state: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (_, heads, t, _) = q.dims4()?;
    let dev = q.device();
    let mut s = match state {
        Some(s) => s.clone(),
        None => zero_state(q, v)?,
    };
    let mut outs = Vec::with_capacity(t.div_ceil(chunk));
    let mut start = 0;
    while start < t {
        let m = chunk.min(t - start);
        let (d, q_decay, k_decay, chunk_decay) = chunk_decays(gammas, heads, m, dev)?;
        let qc = q.narrow(2, start, m)?.contiguous()?;
        let kc = k.narrow(2, start, m)?.contiguous()?;
        let vc = v.narrow(2, start, m)?.contiguous()?;
        let scores = qc.matmul(&kc.t()?.contiguous()?)?.broadcast_mul(&d)?;
        let intra = scores.matmul(&vc)?;
        let inter = qc.broadcast_mul(&q_decay)?.matmul(&s)?;
        outs.push(((intra + inter)? * scale)?);
        let kv = kc.broadcast_mul(&k_decay)?.t()?.contiguous()?.matmul(&vc)?;
        s = (s.broadcast_mul(&chunk_decay)? + kv)?;
        start += m;
    }
    Ok((Tensor::cat(&outs, 2)?, s))
}

/// Chunk-parallel form of [`chunked`] for whole sequences from a zero state (the chunk form of
/// fla's `chunk_simple_gla`, with the inter-chunk recurrence written as one matmul): with the
/// sequence padded to `NC` chunks of `chunk`,
/// * intra-chunk: `((Q_c K_cᵀ) ⊙ D) V_c` for every chunk at once;
/// * chunk summaries: `KV_c = (γ^{C−1−j} K_c)ᵀ V_c`;
/// * carried states: `S_c = Σ_{j<c} γ^{C·(c−1−j)} KV_j`, one `[NC, NC]` × `[NC, Dk·Dv]` product per
///   head (the closed form of `S_c = γ^C S_{c−1} + KV_{c−1}`);
/// * inter-chunk: `(γ^{i+1} Q_c) S_c`.
///
/// About ten kernels per call instead of a dozen per chunk: on a GPU the chunked loop was bound
/// by kernel launches, not arithmetic. Padding is exact: padded keys and values are zero and come
/// after every real position, and their outputs are cut off. Returns the output `[B, H, T, Dv]`.
pub fn chunk_parallel(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
    scale: f64,
    chunk: usize,
) -> Result<Tensor> {
    let (b, heads, t, dk) = q.dims4()?;
    let dv = v.dim(3)?;
    let dev = q.device();
    let nc = t.div_ceil(chunk);
    let padded = nc * chunk;
    let split = |x: &Tensor, d: usize| -> Result<Tensor> {
        let x = if padded == t {
            x.clone()
        } else {
            x.pad_with_zeros(2, 0, padded - t)?
        };
        x.reshape((b, heads, nc, chunk, d))
    };
    let (qc, kc, vc) = (split(q, dk)?, split(k, dk)?, split(v, dv)?);
    let (d, q_decay, k_decay, _) = chunk_decays(gammas, heads, chunk, dev)?;
    // [1, H, C, ·] → [1, H, 1, C, ·]: one set of decays for every chunk. The products run on
    // [B·H, NC, ·, ·] views (candle's matmul takes at most two batch dimensions), the decays
    // broadcast on [B, H, NC, ·, ·] ones; both are the same contiguous memory.
    let (d, q_decay, k_decay) = (
        d.unsqueeze(2)?,
        q_decay.unsqueeze(2)?,
        k_decay.unsqueeze(2)?,
    );
    let bh = |x: &Tensor| -> Result<Tensor> {
        let dims = x.dims();
        x.reshape((b * heads, nc, dims[3], dims[4]))
    };
    let five = |x: &Tensor| -> Result<Tensor> {
        let dims = x.dims();
        x.reshape((b, heads, nc, dims[2], dims[3]))
    };
    let scores = five(&bh(&qc)?.matmul(&bh(&kc)?.t()?.contiguous()?)?)?.broadcast_mul(&d)?;
    let intra = bh(&scores)?.matmul(&bh(&vc)?)?;
    let kv = bh(&kc.broadcast_mul(&k_decay)?)?
        .t()?
        .contiguous()?
        .matmul(&bh(&vc)?)?
        .reshape((b * heads, nc, dk * dv))?;
    // The carry weights copied per sequence (B·H·NC² values): a strided batch dimension is not
    // something every backend's matmul takes.
    let carry = carry_matrix(gammas, heads, chunk, nc, dev)?
        .broadcast_as((b, heads, nc, nc))?
        .contiguous()?
        .reshape((b * heads, nc, nc))?;
    let states = carry.matmul(&kv)?.reshape((b * heads, nc, dk, dv))?;
    let inter = bh(&qc.broadcast_mul(&q_decay)?)?.matmul(&states)?;
    let o = ((intra + inter)? * scale)?.reshape((b, heads, padded, dv))?;
    if padded == t {
        Ok(o)
    } else {
        o.narrow(2, 0, t)?.contiguous()
    }
}

/// `A[h][c][j] = γ_h^{chunk·(c−1−j)}` for `j < c`, else 0 (`[1, H, NC, NC]`): the weights of the
/// chunk summaries in the state carried into chunk `c`; built once per (decays, sizes, device).
fn carry_matrix(
    gammas: &[f64],
    heads: usize,
    chunk: usize,
    nc: usize,
    dev: &Device,
) -> Result<Tensor> {
    let id = decays_key(gammas);
    super::cached_constant(format!("gla-carry-{chunk}-{nc}-{id}"), dev, || {
        per_head(
            |h| {
                let gc = gammas[h].powi(chunk as i32);
                (0..nc * nc)
                    .map(|x| {
                        let (c, j) = (x / nc, x % nc);
                        if j < c {
                            gc.powi((c - 1 - j) as i32)
                        } else {
                            0.0
                        }
                    })
                    .collect()
            },
            heads,
            &[nc, nc],
            dev,
        )
    })
}

/// The decays as exact bits, for the cache keys of the tensors built from them.
fn decays_key(gammas: &[f64]) -> String {
    gammas
        .iter()
        .map(|g| format!("{:x}", g.to_bits()))
        .collect::<Vec<_>>()
        .join(",")
}

/// The decay tensors of one chunk of length `m`: the intra-chunk mask `D[i][j] = γ^{i−j}`
/// (`j ≤ i`), the query decays `γ^{i+1}`, the key decays `γ^{m−1−j}` and `γ^m`; built once
/// per (decays, m, device).
fn chunk_decays(
    gammas: &[f64],
    heads: usize,
    m: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let id = decays_key(gammas);
    let key = |what: &str| format!("gla-{what}-{m}-{id}");
    let d = super::cached_constant(key("d"), dev, || {
        per_head(
            |h| {
                let g = gammas[h];
                (0..m * m)
                    .map(|x| {
                        let (i, j) = (x / m, x % m);
                        if j <= i {
                            g.powi((i - j) as i32)
                        } else {
                            0.0
                        }
                    })
                    .collect()
            },
            heads,
            &[m, m],
            dev,
        )
    })?;
    let q_decay = super::cached_constant(key("q"), dev, || {
        per_head(
            |h| (0..m).map(|i| gammas[h].powi(i as i32 + 1)).collect(),
            heads,
            &[m, 1],
            dev,
        )
    })?;
    let k_decay = super::cached_constant(key("k"), dev, || {
        per_head(
            |h| (0..m).map(|j| gammas[h].powi((m - 1 - j) as i32)).collect(),
            heads,
            &[m, 1],
            dev,
        )
    })?;
    let chunk_decay = super::cached_constant(key("chunk"), dev, || {
        per_head(|h| vec![gammas[h].powi(m as i32)], heads, &[1, 1], dev)
    })?;
    Ok((d, q_decay, k_decay, chunk_decay))
}

/// Recurrent form, one token at a time (the decode kernel); a test oracle here.
pub fn recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
    scale: f64,
    state: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (_, heads, t, _) = q.dims4()?;
    let g = per_head(|h| vec![gammas[h]], heads, &[1, 1], q.device())?;
    let mut s = match state {
        Some(s) => s.clone(),
        None => zero_state(q, v)?,
    };
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let qt = q.narrow(2, i, 1)?.contiguous()?;
        let kt = k.narrow(2, i, 1)?.contiguous()?;
        let vt = v.narrow(2, i, 1)?.contiguous()?;
        s = (s.broadcast_mul(&g)? + kt.t()?.contiguous()?.matmul(&vt)?)?;
        outs.push((qt.matmul(&s)? * scale)?);
    }
    Ok((Tensor::cat(&outs, 2)?, s))
}

/// Parallel O(T²) form, straight from the definition: O = scale·(((Q Kᵀ) ⊙ D) V + (γ^{t+1} Q) S_prev)
/// with D[t, s] = γ^{t−s} for s ≤ t; the final state is γ^T S_prev + Σ_s γ^{T−1−s} k_sᵀ v_s.
pub fn parallel(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
    scale: f64,
    state: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (_, heads, t, _) = q.dims4()?;
    let dev = q.device();
    let s_prev = match state {
        Some(s) => s.clone(),
        None => zero_state(q, v)?,
    };
    let mut d = vec![0f32; heads * t * t];
    let mut q_decay = vec![0f32; heads * t];
    let mut k_decay = vec![0f32; heads * t];
    for h in 0..heads {
        for i in 0..t {
            for j in 0..=i {
                d[(h * t + i) * t + j] = gammas[h].powi((i - j) as i32) as f32;
            }
            q_decay[h * t + i] = gammas[h].powi(i as i32 + 1) as f32;
            k_decay[h * t + i] = gammas[h].powi((t - 1 - i) as i32) as f32;
        }
    }
    let d = Tensor::from_vec(d, (1, heads, t, t), dev)?;
    let q_decay = Tensor::from_vec(q_decay, (1, heads, t, 1), dev)?;
    let k_decay = Tensor::from_vec(k_decay, (1, heads, t, 1), dev)?;
    let total = per_head(|h| vec![gammas[h].powi(t as i32)], heads, &[1, 1], dev)?;
    let kt = k.t()?.contiguous()?;
    let o = (q.matmul(&kt)?.broadcast_mul(&d)?.matmul(v)?
        + q.broadcast_mul(&q_decay)?.matmul(&s_prev)?)?;
    let s = (s_prev.broadcast_mul(&total)?
        + k.broadcast_mul(&k_decay)?.t()?.contiguous()?.matmul(v)?)?;
    Ok(((o * scale)?, s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(SplitMix64::new(seed).normals(n), shape, &Device::Cpu).unwrap()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let m = b.abs().unwrap().max_all().unwrap();
        (d.to_scalar::<f32>().unwrap()) / m.to_scalar::<f32>().unwrap().max(1e-30)
    }

    #[test]
    fn chunk_parallel_equals_the_recurrent_form() {
        // Lengths below, at and between chunk multiples (padding), several chunks, decays from
        // fast (γ ≈ 0.43, whose carried weights underflow) to slow.
        for (heads, t, chunk) in [
            (4, 1, 64),
            (4, 7, 4),
            (4, 64, 64),
            (8, 100, 16),
            (32, 130, 16),
        ] {
            let gammas = decays(heads);
            let (q, k, v) = (
                randn(&[2, heads, t, 8], 11),
                randn(&[2, heads, t, 8], 12),
                randn(&[2, heads, t, 6], 13),
            );
            let (or, _) = recurrent(&q, &k, &v, &gammas, 0.3, None).unwrap();
            let op = chunk_parallel(&q, &k, &v, &gammas, 0.3, chunk).unwrap();
            let (oc, _) = chunked(&q, &k, &v, &gammas, 0.3, chunk, None).unwrap();
            assert_eq!(op.dims(), or.dims());
            assert!(
                max_rel(&op, &or) < 1e-5,
                "heads {heads} t {t} chunk {chunk}"
            );
            assert!(max_rel(&op, &oc) < 1e-5, "vs chunked: heads {heads} t {t}");
        }
    }

    #[test]
    fn slopes_match_the_published_table() {
        let s = alibi_slopes(32);
        let g = decays(32);
        for (h, (slope, gamma)) in [
            (0, (0.840896, 0.431324)),
            (3, (0.5, 0.606531)),
            (31, (0.003906, 0.996101)),
        ] {
            assert!((s[h] - slope).abs() < 1e-6, "slope {h}");
            assert!((g[h] - gamma).abs() < 1e-6, "gamma {h}");
        }
        for (h, slope) in s.iter().enumerate() {
            assert!((slope - 2f64.powf(-((h + 1) as f64) / 4.0)).abs() < 1e-12);
        }
        // Non power of two: ALiBi interleave (first 4 of n=4, then odd-indexed of n=8).
        let s6 = alibi_slopes(6);
        let (p4, p8) = (alibi_slopes(4), alibi_slopes(8));
        assert_eq!(&s6[..4], &p4[..]);
        assert_eq!(s6[4], p8[0]);
        assert_eq!(s6[5], p8[2]);
    }
}
