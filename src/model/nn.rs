//! Building blocks both decoder families share: the Linear and its Hessian groups, RMSNorm, the
//! one RoPE, grouped-query head repetition and the causal mask (docs/model.md, Forward pass).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};

/// Linears that read the same input share one Hessian (docs/decisions.md, Hessians follow inputs).
/// The order is the true-sequential order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum LinearGroup {
    /// q, k, v and the attention gate (o_gate or z_proj): the normalized layer input.
    Qkv,
    /// o_proj: the gated attention output.
    O,
    /// gate_proj and up_proj: the normalized MLP input.
    GateUp,
    /// down_proj: silu(gate) * up.
    Down,
}

impl LinearGroup {
    pub const ALL: [LinearGroup; 4] = [Self::Qkv, Self::O, Self::GateUp, Self::Down];
    pub fn name(self) -> &'static str {
        match self {
            Self::Qkv => "qkv",
            Self::O => "o",
            Self::GateUp => "gate_up",
            Self::Down => "down",
        }
    }
}

/// One Linear of a decoder layer as the checkpoint holds it: the name relative to
/// `model.layers.{i}.` (e.g. `self_attn.q_proj`), the Hessian group that reads its input,
/// `[N, K]` (out, in) and whether a `.bias` tensor goes with it. Each config's `layer_linears`
/// is the one table of these per architecture; the checkpoint's tensor list, the quantize plan
/// and the solve order are derived from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearSpec {
    pub name: &'static str,
    pub group: LinearGroup,
    pub n: usize,
    pub k: usize,
    pub bias: bool,
}

impl LinearSpec {
    pub fn new(name: &'static str, group: LinearGroup, n: usize, k: usize, bias: bool) -> Self {
        Self {
            name,
            group,
            n,
            k,
            bias,
        }
    }

    /// `(name, shape)` of the weight, then of the bias when it has one.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut t = vec![(format!("{}.weight", self.name), vec![self.n, self.k])];
        if self.bias {
            t.push((format!("{}.bias", self.name), vec![self.n]));
        }
        t
    }
}

/// `linears` (checkpoint order) in true-sequential order: stable by group, so the members of a
/// group keep their checkpoint order.
pub fn sequential(mut linears: Vec<LinearSpec>) -> Vec<LinearSpec> {
    linears.sort_by_key(|l| l.group);
    linears
}

/// A bias-free Linear with HF layout `[out, in]`: y = x·Wᵀ.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Tensor,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dims = x.dims().to_vec();
        let k = *dims.last().unwrap();
        let x2 = x.reshape(((), k))?;
        let y = x2.matmul(&self.weight.t()?)?;
        let mut out = dims;
        *out.last_mut().unwrap() = self.weight.dim(0)?;
        y.reshape(out)
    }
}

/// RMSNorm. On a GPU, for tensors no gradient flows through, candle's fused kernel
/// ([`candle_nn::ops::rms_norm`]: one pass, f32 inside, one rounding at the end); elsewhere
/// [`rms_norm_composed`], the reference's own sequence of operations, which is the CPU twin that
/// `tests/cuda/twins.rs` compares the kernel with.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    if fused(x) && w.dtype() == x.dtype() && w.rank() == 1 {
        let x = x.contiguous()?;
        return candle_nn::ops::rms_norm(&x, w, eps as f32);
    }
    rms_norm_composed(x, w, eps)
}

/// Whether `x` takes the fused GPU kernels: on a CUDA device and not tracked by autograd (the
/// fused kernels have no backward pass; the fixture's training keeps the composed forms).
fn fused(x: &Tensor) -> bool {
    x.device().is_cuda() && !x.track_op()
}

/// RMSNorm as the reference computes it: variance in f32, cast back to the input dtype, then
/// multiplied by the weight in the input dtype (no "+1", no mean subtraction).
pub fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xf.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(dtype)?;
    y.broadcast_mul(w)
}

/// Repeats each kv head `n_rep` times consecutively: `[B, Hkv, T, D]` → `[B, Hkv·n_rep, T, D]`.
pub(crate) fn repeat_kv(x: &Tensor, n_rep: usize) -> candle_core::Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, h, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, h, n_rep, t, d))?
        .reshape((b, h * n_rep, t, d))
}

/// The RoPE inverse frequencies of a head dimension `d` (`d/2` of them): `θ^(−2j/d)`.
pub fn rope_inv_freq(theta: f64, d: usize) -> Vec<f64> {
    (0..d / 2)
        .map(|j| theta.powf(-2.0 * j as f64 / d as f64))
        .collect()
}

/// Rotate-half RoPE on `[B, T, H, D]` for positions 0..T with the given inverse frequencies
/// (`d/2` of them), computed in f32 and cast back. On a GPU, for tensors no gradient flows
/// through, the rotation is candle's fused kernel ([`candle_nn::rotary_emb::rope_thd`] in f32);
/// elsewhere [`rope_composed`], its CPU twin.
pub fn rope(x: &Tensor, inv_freq: &[f64]) -> candle_core::Result<Tensor> {
    let (_, t, _, d) = x.dims4()?;
    if fused(x) && d % 2 == 0 && d / 2 == inv_freq.len() {
        let half = d / 2;
        let table = |f: fn(f64) -> f64| {
            move || {
                let mut v = Vec::with_capacity(t * half);
                for p in 0..t {
                    for &fr in inv_freq {
                        v.push(f(p as f64 * fr) as f32);
                    }
                }
                Tensor::from_vec(v, (t, half), x.device())
            }
        };
        let key = |name: &str| format!("rope-half-{name}-{t}-{d}-{:016x}", freq_tag(inv_freq));
        let cos = super::cached_constant(key("cos"), x.device(), table(f64::cos))?;
        let sin = super::cached_constant(key("sin"), x.device(), table(f64::sin))?;
        let xf = x.to_dtype(DType::F32)?.contiguous()?;
        return candle_nn::rotary_emb::rope_thd(&xf, &cos, &sin)?.to_dtype(x.dtype());
    }
    rope_composed(x, inv_freq)
}

/// A hash of RoPE frequencies, for the cache keys of their tables.
fn freq_tag(inv_freq: &[f64]) -> u64 {
    inv_freq.iter().fold(0xcbf29ce484222325u64, |h, f| {
        (h ^ f.to_bits()).wrapping_mul(0x100000001b3)
    })
}

/// Rotate-half RoPE on `[B, T, H, D]` as [`rope`], computed in f32 and cast back.
pub fn rope_composed(x: &Tensor, inv_freq: &[f64]) -> candle_core::Result<Tensor> {
    let (_, t, _, d) = x.dims4()?;
    let half = d / 2;
    let tag = freq_tag(inv_freq);
    let table = |f: fn(f64) -> f64| {
        move || {
            let mut v = Vec::with_capacity(t * d);
            for p in 0..t {
                for j in 0..d {
                    v.push(f(p as f64 * inv_freq[j % half]) as f32);
                }
            }
            Tensor::from_vec(v, (1, t, 1, d), x.device())
        }
    };
    let key = |name: &str| format!("rope-{name}-{t}-{d}-{tag:016x}");
    let cos = super::cached_constant(key("cos"), x.device(), table(f64::cos))?;
    let sin = super::cached_constant(key("sin"), x.device(), table(f64::sin))?;
    let xf = x.to_dtype(DType::F32)?;
    let x1 = xf.narrow(3, 0, half)?;
    let x2 = xf.narrow(3, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    (xf.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.to_dtype(x.dtype())
}

/// Additive causal mask `[T, T]`: 0 on and below the diagonal, −inf above.
pub(crate) fn causal_mask(t: usize, dev: &Device) -> candle_core::Result<Tensor> {
    super::cached_constant(format!("causal-mask-{t}"), dev, || {
        let data: Vec<f32> = (0..t * t)
            .map(|x| {
                if x % t > x / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Tensor::from_vec(data, (t, t), dev)
    })
}

/// Dense causal GQA attention (MiniCPM-SALA's sparse layers below `dense_len`, every Llama layer): `q` `[B, T, H, D]`, `k`, `v` `[B, T, KV, D]`
/// (after RoPE) → `[B, T, H·D]` in q's dtype. On a GPU, for BF16 tensors no gradient flows
/// through (and not `differentiable`), the fused kernel (`kernels::flash::flash_attention_causal`,
/// feature `cuda`: f32 softmax and accumulation, P rounded to BF16 for P·V); elsewhere
/// [`causal_attention_composed`], its CPU twin (docs/gpu.md, Fused attention).
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    differentiable: bool,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        use crate::kernels::flash;
        let (b, t, _, d) = q.dims4()?;
        let untracked = !(q.track_op() || k.track_op() || v.track_op());
        let bf16 = [q.dtype(), k.dtype(), v.dtype()] == [DType::BF16; 3];
        if !differentiable
            && q.device().is_cuda()
            && untracked
            && bf16
            && b * t > 0
            && flash::flash_attention_supports(d)
        {
            return flash::flash_attention_causal(q, k, v, (1.0 / (d as f64).sqrt()) as f32);
        }
    }
    causal_attention_composed(q, k, v, differentiable)
}

/// [`causal_attention`] as the reference computes it, differentiable: q, k, v cast to f32,
/// kv heads repeated, scores `q·kᵀ / sqrt(D)` plus the additive causal mask, softmax and `P·V`
/// in f32, then cast back to q's dtype.
pub fn causal_attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    differentiable: bool,
) -> Result<Tensor> {
    let (b, t, heads, head_dim) = q.dims4()?;
    let f32t = |x: &Tensor| x.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous();
    let n_rep = heads / k.dim(2)?;
    let (qf, kf, vf) = (
        f32t(q)?,
        repeat_kv(&f32t(k)?, n_rep)?,
        repeat_kv(&f32t(v)?, n_rep)?,
    );
    let scores = (qf.matmul(&kf.t()?.contiguous()?)? / (head_dim as f64).sqrt())?;
    let mask = causal_mask(t, q.device())?;
    let masked = scores.broadcast_add(&mask)?;
    let p = if differentiable {
        candle_nn::ops::softmax(&masked, D::Minus1)?
    } else {
        candle_nn::ops::softmax_last_dim(&masked)?
    };
    Ok(p.matmul(&vf)?
        .transpose(1, 2)?
        .reshape((b, t, heads * head_dim))?
        .to_dtype(q.dtype())?)
}
