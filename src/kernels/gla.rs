//! The fused chunked Simple-GLA forward of the lightning layers on the GPU (`gla.cu`,
//! `gla_fwd_d{D}_{bf16,f32}`): one kernel walks each sequence's chunks of 64 tokens in order,
//! keeping the state on chip, so its time and memory are O(T) (the chunk-parallel form's
//! inter-chunk product is O(T²/64) and its state tensor `[NC, H, D, D]` reaches gigabytes at
//! long windows). All f32 arithmetic, as the CPU forms. CPU twin: `model::gla::chunked` (and
//! `chunk_parallel`, the same output); `tests/cuda/gla.rs` compares them.
//!
//! The decay tables are computed in f64 and stored as f32 exactly as `model::gla` builds its
//! chunk decays, and uploaded once per (decays, device).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use anyhow::{bail, ensure, Result};
use candle_core::{CudaDevice, DType, Device, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::cuda::{cuda, launch_in, qkv_dims, slice_ptr, tensor_ptr, wrap};

/// Tokens per chunk (the model's `GLA_CHUNK`); fixed in the kernel.
pub const CHUNK: usize = 64;

/// Threads per CTA of the kernel (`GLA_THREADS`).
const THREADS: u32 = 256;

/// Whether the kernel has a variant for head dimension `d` (Dk = Dv = d).
pub fn supports(d: usize) -> bool {
    matches!(d, 16 | 32 | 64 | 128)
}

/// Value columns per CTA (`GlaShape<D>::W`): the grid has `d / slice_width(d)` CTAs per head.
pub fn slice_width(d: usize) -> usize {
    d.min(32)
}

/// Dynamic shared memory of the kernel for head dimension `d`, in bytes (`GlaShape<D>::FLOATS`
/// floats: Q and K `[64][d + 4]`, V and the decayed V `[64][W]`, the scores `[64][72]`, the
/// state slice `[d][W]`): 118,784 bytes for d = 128.
pub fn smem_bytes(d: usize) -> usize {
    let w = slice_width(d);
    4 * (2 * CHUNK * (d + 4) + 2 * CHUNK * w + CHUNK * 72 + d * w)
}

/// The kernel's decay table for decays `gammas`, per head `64·64 + 64` f32 values:
/// `D[i][j] = γ^{i−j}` for `j ≤ i` (else 0), then `γ^{i+1}`; each power in f64 (`powi`), then
/// rounded to f32, the values `model::gla`'s chunk decays hold (its key decays `γ^{m−1−j}` are
/// `D[m−1][j]`, its chunk decay `γ^m` is the `γ^{i+1}` of `i = m − 1`).
pub fn decay_table(gammas: &[f64]) -> Vec<f32> {
    let mut tab = Vec::with_capacity(gammas.len() * (CHUNK * CHUNK + CHUNK));
    for &g in gammas {
        for i in 0..CHUNK {
            for j in 0..CHUNK {
                tab.push(if j <= i {
                    g.powi((i - j) as i32) as f32
                } else {
                    0.0
                });
            }
        }
        tab.extend((0..CHUNK).map(|i| g.powi(i as i32 + 1) as f32));
    }
    tab
}

/// Decay tables on the GPU by (the decays' bits, device ordinal).
type TableCache = OnceLock<Mutex<HashMap<(Vec<u64>, usize), Tensor>>>;

/// [`decay_table`] on `device`, uploaded once per (decays, device ordinal).
fn cached_table(gammas: &[f64], device: &Device) -> Result<Tensor> {
    static CACHE: TableCache = OnceLock::new();
    let ordinal = cuda(device)?.cuda_stream().context().ordinal();
    let key = (gammas.iter().map(|g| g.to_bits()).collect(), ordinal);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(t) = cache.lock().expect("GLA table cache poisoned").get(&key) {
        return Ok(t.clone());
    }
    let tab = decay_table(gammas);
    let n = tab.len();
    let t = Tensor::from_vec(tab, n, device)?;
    cache
        .lock()
        .expect("GLA table cache poisoned")
        .insert(key, t.clone());
    Ok(t)
}

/// Simple-GLA from a zero state: `q` `[B, T, H, D]`, `k` and `v` `[B, T, KV, D]` in their model
/// layout, BF16 or f32 (one dtype), on one GPU; head `h` reads kv head `h / (H / KV)`, so kv
/// heads need no repeating. `gammas` are the H per-head decays. Returns `o` `[B, T, H, D]` f32
/// with `o_t = scale · q_t S_t`, `S_t = γ_h S_{t−1} + k_tᵀ v_t` (per head), computed in chunks
/// of 64 as `model::gla::chunked` does.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, gammas: &[f64], scale: f64) -> Result<Tensor> {
    Ok(run(q, k, v, gammas, scale, None, false)?.0)
}

/// [`forward`] from the state `state` `[B, H, D, D]` f32 (zero when `None`), also returning
/// the state after the last token, `[B, H, D, D]` f32: `model::gla::chunked`'s pair, so a long
/// sequence can run in pieces.
pub fn forward_with_state(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
    scale: f64,
    state: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (o, s) = run(q, k, v, gammas, scale, state, true)?;
    Ok((o, s.expect("the final state was asked for")))
}

/// The shape of one Simple-GLA call: batch, tokens, query heads, kv heads and head dimension.
#[derive(Clone, Copy)]
struct Shape {
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
}

/// [`forward`] and [`forward_with_state`]: the operands checked, the empty batch answered on
/// the host side, then one kernel launch into a new output (and final state when `want_state`).
fn run(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
    scale: f64,
    state: Option<&Tensor>,
    want_state: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let device = q.device();
    let dev = cuda(device)?;
    let (shape, dtype) = check_operands(q, k, v, gammas)?;
    let Shape { b, t, h, d, .. } = shape;
    let state = match state {
        Some(s) => Some(checked_state(s, shape, device)?),
        None => None,
    };
    if b == 0 || t == 0 {
        return empty_result(shape, state, want_state, device);
    }
    let (q, k, v) = (
        aligned(q, device)?,
        aligned(k, device)?,
        aligned(v, device)?,
    );
    let tab = cached_table(gammas, device)?;
    let stream = dev.cuda_stream();
    let out: CudaSlice<f32> = unsafe { stream.alloc(b * t * h * d) }?;
    let state_out: Option<CudaSlice<f32>> = if want_state {
        Some(unsafe { stream.alloc(b * h * d * d) }?)
    } else {
        None
    };
    let (qp, kp, vp, op, tp) = (
        tensor_ptr(&q)?,
        tensor_ptr(&k)?,
        tensor_ptr(&v)?,
        slice_ptr(&out, &stream),
        tensor_ptr(&tab)?,
    );
    let sin = match &state {
        Some(s) => tensor_ptr(s)?,
        None => 0u64,
    };
    let sout = match &state_out {
        Some(s) => slice_ptr(s, &stream),
        None => 0u64,
    };
    launch_forward(dev, shape, dtype, [qp, kp, vp, op, tp, sin, sout], scale)?;
    let o = wrap(out, dev, &[b, t, h, d]);
    let s = state_out.map(|s| wrap(s, dev, &[b, h, d, d]));
    Ok((o, s))
}

/// The shape of the operands `q` `[B, T, H, D]`, `k` and `v` `[B, T, KV, D]` and the kernel's
/// dtype suffix, after checking that they agree with each other, with the H decays `gammas`
/// and with a variant and the grid of the kernel.
fn check_operands(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
) -> Result<(Shape, &'static str)> {
    let (b, t, h, d, kv) = qkv_dims(q, k, v, "Simple-GLA")?;
    ensure!(
        k.dtype() == q.dtype() && v.dtype() == q.dtype(),
        "internal: Simple-GLA operands of different dtypes: {:?}, {:?}, {:?}",
        q.dtype(),
        k.dtype(),
        v.dtype()
    );
    let dtype = match q.dtype() {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        other => bail!("internal: the Simple-GLA kernel takes BF16 or f32 inputs, not {other:?}"),
    };
    ensure!(
        supports(d),
        "internal: the Simple-GLA kernel has no variant for head dimension {d}"
    );
    ensure!(
        kv > 0 && h.is_multiple_of(kv),
        "internal: {h} Simple-GLA heads over {kv} kv heads"
    );
    ensure!(
        gammas.len() == h,
        "internal: {} Simple-GLA decays for {h} heads",
        gammas.len()
    );
    ensure!(
        h <= 65535 && b <= 65535 && t <= i32::MAX as usize - CHUNK,
        "internal: Simple-GLA shape [{b}, {t}, {h}, {d}] is past the kernel's grid"
    );
    Ok((Shape { b, t, h, kv, d }, dtype))
}

/// The starting state `s`, contiguous, after checking that it is f32 `[B, H, D, D]` on
/// `device`.
fn checked_state(s: &Tensor, shape: Shape, device: &Device) -> Result<Tensor> {
    let Shape { b, h, d, .. } = shape;
    ensure!(
        s.dims() == [b, h, d, d] && s.dtype() == DType::F32,
        "internal: Simple-GLA state must be f32 [{b}, {h}, {d}, {d}], got {:?} {:?}",
        s.dtype(),
        s.dims()
    );
    ensure!(
        s.device().same_device(device),
        "internal: Simple-GLA state on another device"
    );
    Ok(s.contiguous()?)
}

/// The result of an empty batch (B = 0 or T = 0) without a launch: a zero output, and when
/// `want_state` the starting state (zero when there is none).
fn empty_result(
    shape: Shape,
    state: Option<Tensor>,
    want_state: bool,
    device: &Device,
) -> Result<(Tensor, Option<Tensor>)> {
    let Shape { b, t, h, d, .. } = shape;
    let o = Tensor::zeros((b, t, h, d), DType::F32, device)?;
    let s = match (want_state, state) {
        (false, _) => None,
        (true, Some(s)) => Some(s),
        (true, None) => Some(Tensor::zeros((b, h, d, d), DType::F32, device)?),
    };
    Ok((o, s))
}

/// `x` contiguous on `device`, copied when it does not start 16-byte aligned. The kernel reads
/// 16-byte vectors: each operand must start 16-byte aligned (its rows are multiples of 16 bytes
/// for every supported d).
fn aligned(x: &Tensor, device: &Device) -> Result<Tensor> {
    ensure!(
        x.device().same_device(device),
        "internal: Simple-GLA operands on different devices"
    );
    let x = x.contiguous()?;
    Ok(if tensor_ptr(&x)? % 16 == 0 {
        x
    } else {
        x.copy()?
    })
}

/// Launches `gla_fwd_d{D}_{dtype}` on the device addresses `[q, k, v, o, decay table, state in,
/// state out]` (a null state in starts from zero; a null state out keeps none).
fn launch_forward(
    dev: &CudaDevice,
    shape: Shape,
    dtype: &str,
    [qp, kp, vp, op, tp, sin, sout]: [u64; 7],
    scale: f64,
) -> Result<()> {
    let Shape { b, t, h, kv, d } = shape;
    // Grid (value slices, heads, batch); the slices of one head are neighbours, so they run
    // side by side and share the head's q and k through L2.
    let cfg = LaunchConfig {
        grid_dim: ((d / slice_width(d)) as u32, h as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem_bytes(d) as u32,
    };
    launch_in(
        dev,
        "gla",
        &format!("gla_fwd_d{d}_{dtype}"),
        cfg,
        &[
            &qp,
            &kp,
            &vp,
            &op,
            &tp,
            &sin,
            &sout,
            &(t as i32),
            &(h as i32),
            &(kv as i32),
            &(scale as f32),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decay_table_holds_the_chunk_decays() {
        let gammas = [0.431324f64, 0.996101];
        let tab = decay_table(&gammas);
        assert_eq!(tab.len(), 2 * (CHUNK * CHUNK + CHUNK));
        let head = &tab[CHUNK * CHUNK + CHUNK..];
        let g = gammas[1];
        assert_eq!(head[0], 1.0);
        assert_eq!(head[5 * CHUNK + 2], g.powi(3) as f32);
        assert_eq!(head[2 * CHUNK + 5], 0.0);
        assert_eq!(head[CHUNK * CHUNK + 63], g.powi(64) as f32);
        assert_eq!(smem_bytes(128), 118_784);
    }
}
