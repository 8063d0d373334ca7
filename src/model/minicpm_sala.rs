//! The MiniCPM-SALA forward pass (docs/model.md, Forward pass), batched `[B, T]`, in the model
//! dtype (BF16, or F32 for tests) with the reference's f32 islands: RMSNorm variance, RoPE,
//! softmax, the whole Simple-GLA computation, and the logits.
//!
//! Layer-wise API for the quantizer: [`Model::embed`], [`DecoderLayer::forward`] with a capture
//! hook that sees the input of each Linear group, and [`Model::head`]. Decoder layers are loaded
//! one at a time ([`DecoderLayer::load`]) so only one layer's weights need to be in compute memory.

use super::config::{Config, MixerKind, SparseAttention};
use super::gla;
use super::infllm::{self, InfllmV2};
use super::nn::{causal_attention, repeat_kv, rms_norm, rope, rope_inv_freq, Linear, LinearGroup};
use crate::checkpoint::Checkpoint;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

/// Chunk length of the chunked Simple-GLA (fla uses 64).
pub const GLA_CHUNK: usize = 64;

#[derive(Debug, Clone)]
pub enum Mixer {
    Sparse {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        gate: Option<Linear>,
    },
    Lightning {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        z: Option<Linear>,
        q_norm: Option<Tensor>,
        k_norm: Option<Tensor>,
        o_norm: Option<Tensor>,
    },
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub index: usize,
    pub kind: MixerKind,
    pub input_norm: Tensor,
    pub post_norm: Tensor,
    pub mixer: Mixer,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    /// Use the composed (differentiable) softmax instead of the fused one; for training.
    pub differentiable: bool,
    cfg: LayerConsts,
}

#[derive(Debug, Clone)]
struct LayerConsts {
    eps: f64,
    residual: f64,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    use_rope: bool,
    rope_theta: f64,
    gla_scale: f64,
    gammas: Vec<f64>,
    /// Sparse layers: when InfLLM-v2 runs, and its settings (None where `sparse_config` is
    /// not one its kernels take; `Config::check_length` refuses the lengths that would need it).
    sparse_attention: SparseAttention,
    dense_len: usize,
    infllm: Option<InfllmV2>,
}

impl LayerConsts {
    /// InfLLM-v2's settings when it runs on a `t`-token sequence (docs/model.md, InfLLM-v2).
    fn infllm_at(&self, t: usize) -> Result<Option<InfllmV2>> {
        let runs = match self.sparse_attention {
            SparseAttention::Auto => t >= self.dense_len,
            SparseAttention::Always => true,
            SparseAttention::Never => false,
        };
        if !runs {
            return Ok(None);
        }
        match self.infllm {
            Some(c) => Ok(Some(c)),
            None => bail!(
                "a {t}-token sequence needs InfLLM-v2 sparse attention, and this config's \
                 sparse_config is not one its kernels take"
            ),
        }
    }
}

impl DecoderLayer {
    /// Loads layer `i` from the checkpoint, converting weights to `dtype` on `device`.
    pub fn load(
        ck: &Checkpoint,
        cfg: &Config,
        i: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::from_tensors(cfg, i, &|name| ck.tensor(name, dtype, device))
    }

    /// Builds layer `i` from tensors fetched by full name (`model.layers.{i}.…`); the trainer
    /// passes `Var`s here so the same forward pass is differentiated.
    pub fn from_tensors(
        cfg: &Config,
        i: usize,
        get: &dyn Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let lt = LayerTensors {
            prefix: format!("model.layers.{i}."),
            get,
        };
        let kind = cfg.mixer(i);
        let (mixer, consts) = match kind {
            MixerKind::Sparse => (sparse_mixer(cfg, &lt)?, sparse_consts(cfg)),
            MixerKind::Lightning => (lightning_mixer(cfg, &lt)?, lightning_consts(cfg)?),
        };
        Ok(Self {
            index: i,
            kind,
            input_norm: lt.t("input_layernorm.weight")?,
            post_norm: lt.t("post_attention_layernorm.weight")?,
            mixer,
            gate_proj: lt.lin("mlp.gate_proj")?,
            up_proj: lt.lin("mlp.up_proj")?,
            down_proj: lt.lin("mlp.down_proj")?,
            differentiable: false,
            cfg: consts,
        })
    }

    /// The Linear called `name` (as listed by [`Config::layer_linears`]).
    pub fn linear_mut(&mut self, name: &str) -> Result<&mut Linear> {
        let l = match (&mut self.mixer, name) {
            (Mixer::Sparse { q, .. } | Mixer::Lightning { q, .. }, "self_attn.q_proj") => q,
            (Mixer::Sparse { k, .. } | Mixer::Lightning { k, .. }, "self_attn.k_proj") => k,
            (Mixer::Sparse { v, .. } | Mixer::Lightning { v, .. }, "self_attn.v_proj") => v,
            (Mixer::Sparse { o, .. } | Mixer::Lightning { o, .. }, "self_attn.o_proj") => o,
            (Mixer::Sparse { gate: Some(g), .. }, "self_attn.o_gate") => g,
            (Mixer::Lightning { z: Some(z), .. }, "self_attn.z_proj") => z,
            (_, "mlp.gate_proj") => &mut self.gate_proj,
            (_, "mlp.up_proj") => &mut self.up_proj,
            (_, "mlp.down_proj") => &mut self.down_proj,
            _ => bail!("layer {} has no Linear {name}", self.index),
        };
        Ok(l)
    }

    /// Runs the layer on `h` `[B, T, H]`. `capture` is called with each Linear group's input,
    /// flattened to `[B·T, K]`, in true-sequential order.
    pub fn forward(
        &self,
        h: &Tensor,
        capture: &mut dyn FnMut(LinearGroup, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let (b, t, hid) = h.dims3()?;
        let x = rms_norm(h, &self.input_norm, self.cfg.eps)?;
        capture(LinearGroup::Qkv, &x.reshape((b * t, hid))?)?;
        let attn = self.mixer_output(h)?;
        self.forward_from_mixer(h, &attn, capture)
    }

    /// The mixer's gated output `[B, T, heads·d]` (the input of o_proj). It depends only on
    /// the q/k/v/gate weights, so the quantizer computes it once per layer, after those are
    /// quantized, instead of once per later subset.
    pub fn mixer_output(&self, h: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, t, _) = h.dims3()?;
        let x = rms_norm(h, &self.input_norm, c.eps)?;
        let attn = match &self.mixer {
            Mixer::Sparse { q, k, v, gate, .. } => {
                let heads = |lin: &Linear, n: usize| -> candle_core::Result<Tensor> {
                    lin.forward(&x)?.reshape((b, t, n, c.head_dim))
                };
                let (mut qh, mut kh) = (heads(q, c.heads)?, heads(k, c.kv_heads)?);
                let vh = heads(v, c.kv_heads)?;
                if c.use_rope {
                    let inv_freq = rope_inv_freq(c.rope_theta, qh.dim(3)?);
                    qh = rope(&qh, &inv_freq)?;
                    kh = rope(&kh, &inv_freq)?;
                }
                let o = match c.infllm_at(t)? {
                    Some(sc) => infllm_attention(&sc, &qh, &kh, &vh)?,
                    None => causal_attention(&qh, &kh, &vh, self.differentiable)?,
                };
                match gate {
                    Some(g) => (o * candle_nn::ops::sigmoid(&g.forward(&x)?)?)?,
                    None => o,
                }
            }
            Mixer::Lightning {
                q,
                k,
                v,
                z,
                q_norm,
                k_norm,
                o_norm,
                ..
            } => {
                let heads = |lin: &Linear, n: usize| -> candle_core::Result<Tensor> {
                    lin.forward(&x)?.reshape((b, t, n, c.head_dim))
                };
                let (mut qh, mut kh) = (heads(q, c.heads)?, heads(k, c.kv_heads)?);
                let vh = heads(v, c.kv_heads)?;
                if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
                    qh = rms_norm(&qh, qn, c.eps)?;
                    kh = rms_norm(&kh, kn, c.eps)?;
                }
                if c.use_rope {
                    let inv_freq = rope_inv_freq(c.rope_theta, qh.dim(3)?);
                    qh = rope(&qh, &inv_freq)?;
                    kh = rope(&kh, &inv_freq)?;
                }
                let o = simple_gla(&qh, &kh, &vh, &c.gammas, c.gla_scale, self.differentiable)?;
                let mut o = o
                    .reshape((b, t, c.heads * c.head_dim))?
                    .to_dtype(h.dtype())?;
                if let Some(on) = o_norm {
                    o = rms_norm(&o, on, c.eps)?;
                }
                match z {
                    Some(z) => (o * candle_nn::ops::sigmoid(&z.forward(&x)?)?)?,
                    None => o,
                }
            }
        };
        Ok(attn)
    }

    /// The rest of the layer from the mixer output: o_proj, residual, MLP. `capture` sees the
    /// inputs of the `o`, `gate_up` and `down` groups.
    pub fn forward_from_mixer(
        &self,
        h: &Tensor,
        attn: &Tensor,
        capture: &mut dyn FnMut(LinearGroup, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let (b, t, hid) = h.dims3()?;
        capture(LinearGroup::O, &attn.reshape((b * t, ()))?)?;
        let h = self.attn_residual(h, attn)?;
        let m = self.mlp_input(&h)?;
        capture(LinearGroup::GateUp, &m.reshape((b * t, hid))?)?;
        let act = self.mlp_act(&m)?;
        capture(LinearGroup::Down, &act.reshape((b * t, ()))?)?;
        self.mlp_residual(&h, &act)
    }

    /// `h + o_proj(attn)·residual`: the state after the mixer branch. The pieces of
    /// [`forward_from_mixer`](Self::forward_from_mixer), for the quantizer, which keeps each
    /// stage's result once the Linears before it are quantized instead of recomputing them.
    pub fn attn_residual(&self, h: &Tensor, attn: &Tensor) -> Result<Tensor> {
        let o_proj = match &self.mixer {
            Mixer::Sparse { o, .. } | Mixer::Lightning { o, .. } => o,
        };
        Ok((h + (o_proj.forward(attn)? * self.cfg.residual)?)?)
    }

    /// The mixer input: the input RMSNorm of `h` (the input of q/k/v and the attention gate).
    pub fn input_norm(&self, h: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(h, &self.input_norm, self.cfg.eps)?)
    }

    /// The MLP input: the post-attention RMSNorm of `h` (the input of gate_proj and up_proj).
    pub fn mlp_input(&self, h: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(h, &self.post_norm, self.cfg.eps)?)
    }

    /// `silu(gate_proj(m)) · up_proj(m)`: the input of down_proj.
    pub fn mlp_act(&self, m: &Tensor) -> Result<Tensor> {
        Ok((candle_nn::ops::silu(&self.gate_proj.forward(m)?)? * self.up_proj.forward(m)?)?)
    }

    /// `h + down_proj(act)·residual`: the layer's output.
    pub fn mlp_residual(&self, h: &Tensor, act: &Tensor) -> Result<Tensor> {
        Ok((h + (self.down_proj.forward(act)? * self.cfg.residual)?)?)
    }
}

/// One layer's tensors, fetched by their names relative to the layer (`prefix` is
/// `model.layers.{i}.`).
struct LayerTensors<'a> {
    prefix: String,
    get: &'a dyn Fn(&str) -> Result<Tensor>,
}

impl LayerTensors<'_> {
    /// The tensor `name` of the layer.
    fn t(&self, name: &str) -> Result<Tensor> {
        (self.get)(&format!("{}{name}", self.prefix))
    }

    /// The Linear `name` of the layer (its `{name}.weight`).
    fn lin(&self, name: &str) -> Result<Linear> {
        Ok(Linear {
            weight: self.t(&format!("{name}.weight"))?,
        })
    }
}

/// The mixer of a sparse (InfLLM-v2 attention) layer.
fn sparse_mixer(cfg: &Config, lt: &LayerTensors) -> Result<Mixer> {
    Ok(Mixer::Sparse {
        q: lt.lin("self_attn.q_proj")?,
        k: lt.lin("self_attn.k_proj")?,
        v: lt.lin("self_attn.v_proj")?,
        o: lt.lin("self_attn.o_proj")?,
        gate: cfg
            .attn_use_output_gate
            .then(|| lt.lin("self_attn.o_gate"))
            .transpose()?,
    })
}

/// The constants of a sparse layer.
fn sparse_consts(cfg: &Config) -> LayerConsts {
    LayerConsts {
        eps: cfg.rms_norm_eps,
        residual: cfg.residual_scale(),
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.sparse_head_dim(),
        use_rope: cfg.attn_use_rope,
        rope_theta: cfg.rope_theta,
        gla_scale: 0.0,
        gammas: vec![],
        sparse_attention: cfg.sparse_attention,
        dense_len: cfg.sparse_config.dense_len,
        infllm: cfg.infllm().ok(),
    }
}

/// The mixer of a lightning (Simple-GLA) layer.
fn lightning_mixer(cfg: &Config, lt: &LayerTensors) -> Result<Mixer> {
    Ok(Mixer::Lightning {
        q: lt.lin("self_attn.q_proj")?,
        k: lt.lin("self_attn.k_proj")?,
        v: lt.lin("self_attn.v_proj")?,
        o: lt.lin("self_attn.o_proj")?,
        z: cfg
            .use_output_gate
            .then(|| lt.lin("self_attn.z_proj"))
            .transpose()?,
        q_norm: cfg
            .qk_norm
            .then(|| lt.t("self_attn.q_norm.weight"))
            .transpose()?,
        k_norm: cfg
            .qk_norm
            .then(|| lt.t("self_attn.k_norm.weight"))
            .transpose()?,
        o_norm: cfg
            .use_output_norm
            .then(|| lt.t("self_attn.o_norm.weight"))
            .transpose()?,
    })
}

/// The constants of a lightning layer.
fn lightning_consts(cfg: &Config) -> Result<LayerConsts> {
    Ok(LayerConsts {
        eps: cfg.rms_norm_eps,
        residual: cfg.residual_scale(),
        heads: cfg.lightning_nh,
        kv_heads: cfg.lightning_nkv,
        head_dim: cfg.lightning_head_dim,
        use_rope: cfg.lightning_use_rope,
        rope_theta: cfg.rope_theta,
        gla_scale: cfg.lightning_scale_value()?,
        gammas: gla::decays(cfg.lightning_nh),
        sparse_attention: cfg.sparse_attention,
        dense_len: cfg.sparse_config.dense_len,
        infllm: None,
    })
}

/// Simple-GLA of a lightning layer (docs/model.md, Simple GLA): q, k `[B, T, H|KV, Dk]`, v
/// `[B, T, KV, Dv]` in the model dtype → f32 `[B, T, H, Dv]`. On a GPU, untracked by autograd,
/// the fused chunked kernel (`kernels::gla::forward`: each (batch, head) walks its chunks with
/// the state on chip, f32 arithmetic); elsewhere the chunk-parallel form, its CPU twin.
pub fn simple_gla(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gammas: &[f64],
    scale: f64,
    differentiable: bool,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let untracked = !(q.track_op() || k.track_op() || v.track_op());
        let d = q.dim(3)?;
        let dtypes = [DType::BF16, DType::F32];
        if !differentiable
            && untracked
            && q.device().is_cuda()
            && dtypes.contains(&q.dtype())
            && q.dtype() == k.dtype()
            && q.dtype() == v.dtype()
            && d == v.dim(3)?
            && crate::kernels::gla::supports(d)
        {
            return crate::kernels::gla::forward(q, k, v, gammas, scale);
        }
    }
    let _ = differentiable;
    let f32t = |x: &Tensor| x.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous();
    let n_rep = q.dim(2)? / k.dim(2)?;
    let (qf, kf, vf) = (
        f32t(q)?,
        repeat_kv(&f32t(k)?, n_rep)?,
        repeat_kv(&f32t(v)?, n_rep)?,
    );
    Ok(gla::chunk_parallel(&qf, &kf, &vf, gammas, scale, GLA_CHUNK)?.transpose(1, 2)?)
}

/// InfLLM-v2 attention of a sparse layer (docs/model.md, InfLLM-v2): q `[B, T, H, D]`, k, v
/// `[B, T, KV, D]` → `[B, T, H·D]` in q's dtype. On a GPU, for BF16 tensors, the fused kernels
/// (block selection, then block-sparse flash attention; `kernels::infllm`, feature
/// `cuda`); elsewhere the composed form [`infllm::attention`], their CPU twin.
pub fn infllm_attention(cfg: &InfllmV2, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let untracked = !(q.track_op() || k.track_op() || v.track_op());
        let bf16 = [q.dtype(), k.dtype(), v.dtype()] == [DType::BF16; 3];
        if q.device().is_cuda() && bf16 && untracked && q.dim(1)? > 0 {
            use crate::kernels::infllm as kern;
            let k1 = infllm::compress_keys(k, cfg.kernel_size, cfg.kernel_stride)?;
            let k2 = infllm::compress_keys(k, 4 * cfg.kernel_size, 4 * cfg.kernel_stride)?;
            let p = kern::InfllmParams {
                kernel_size: cfg.kernel_size,
                kernel_stride: cfg.kernel_stride,
                block_size: cfg.block_size,
                init_blocks: cfg.init_blocks,
                local_blocks: cfg.local_blocks,
                topk: cfg.topk,
            };
            return kern::attention(q, k, v, &k1, &k2, &p);
        }
    }
    infllm::attention(cfg, q, k, v)
}

/// Embedding, final norm and head; decoder layers are loaded separately (one at a time when
/// streaming, all at once for short evaluations).
pub struct Model {
    pub cfg: Config,
    pub dtype: DType,
    pub device: Device,
    pub embed_tokens: Tensor,
    pub norm: Tensor,
    pub lm_head: Linear,
}

impl Model {
    pub fn load(ck: &Checkpoint, cfg: &Config, dtype: DType, device: &Device) -> Result<Self> {
        Self::from_tensors(cfg, dtype, device, &|name| ck.tensor(name, dtype, device))
    }

    /// Embedding, final norm and head from tensors fetched by name (see [`DecoderLayer::from_tensors`]).
    pub fn from_tensors(
        cfg: &Config,
        dtype: DType,
        device: &Device,
        get: &dyn Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            cfg: cfg.clone(),
            dtype,
            device: device.clone(),
            embed_tokens: get("model.embed_tokens.weight")?,
            norm: get("model.norm.weight")?,
            lm_head: Linear {
                weight: get("lm_head.weight")?,
            },
        })
    }

    pub fn load_layer(&self, ck: &Checkpoint, i: usize) -> Result<DecoderLayer> {
        DecoderLayer::load(ck, &self.cfg, i, self.dtype, &self.device)
            .with_context(|| format!("loading decoder layer {i}"))
    }

    /// Refuses inputs the dense path cannot compute exactly.
    pub fn check_length(&self, t: usize) -> Result<()> {
        self.cfg.check_length(t)
    }

    /// `ids` `[B, T]` u32 → hidden states `[B, T, H]` scaled by `scale_emb`.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        self.check_length(t)?;
        let flat = ids.flatten_all()?;
        let e = self
            .embed_tokens
            .index_select(&flat, 0)?
            .reshape((b, t, ()))?;
        Ok((e * self.cfg.scale_emb)?)
    }

    /// Final norm, division by hidden_size / dim_model_base, lm_head; f32 logits `[B, T, V]`.
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        let x = (rms_norm(h, &self.norm, self.cfg.rms_norm_eps)? / self.cfg.logit_divisor())?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    /// Full forward with all layers given (for tests and short evaluations).
    pub fn forward(&self, ids: &Tensor, layers: &[DecoderLayer]) -> Result<Tensor> {
        let mut h = self.embed(ids)?;
        for layer in layers {
            h = layer.forward(&h, &mut |_, _| Ok(()))?;
        }
        self.head(&h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| rng.uniform()).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let diff = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let scale = b
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        diff / scale
    }

    #[test]
    fn the_three_gla_forms_agree_including_ragged_lengths_and_carried_state() {
        let gammas = gla::decays(4);
        for (t, chunk) in [(1, 64), (7, 4), (64, 64), (100, 64), (130, 16)] {
            let (q, k, v) = (
                randn(&[2, 4, t, 8], 1),
                randn(&[2, 4, t, 8], 2),
                randn(&[2, 4, t, 6], 3),
            );
            let s0 = randn(&[2, 4, 8, 6], 4);
            for state in [None, Some(&s0)] {
                let (oc, sc) = gla::chunked(&q, &k, &v, &gammas, 0.3, chunk, state).unwrap();
                let (or, sr) = gla::recurrent(&q, &k, &v, &gammas, 0.3, state).unwrap();
                let (op, sp) = gla::parallel(&q, &k, &v, &gammas, 0.3, state).unwrap();
                assert!(max_rel(&oc, &or) < 1e-5, "chunked vs recurrent, t={t}");
                assert!(max_rel(&op, &or) < 1e-5, "parallel vs recurrent, t={t}");
                assert!(max_rel(&sc, &sr) < 1e-5, "chunked state, t={t}");
                assert!(max_rel(&sp, &sr) < 1e-5, "parallel state, t={t}");
            }
        }
    }

    #[test]
    fn chunked_gla_continues_across_calls_like_one_call() {
        let gammas = gla::decays(2);
        let (q, k, v) = (
            randn(&[1, 2, 50, 8], 5),
            randn(&[1, 2, 50, 8], 6),
            randn(&[1, 2, 50, 8], 7),
        );
        let (full, _) = gla::chunked(&q, &k, &v, &gammas, 1.0, 16, None).unwrap();
        let (a, s) = gla::chunked(
            &q.narrow(2, 0, 20).unwrap(),
            &k.narrow(2, 0, 20).unwrap(),
            &v.narrow(2, 0, 20).unwrap(),
            &gammas,
            1.0,
            16,
            None,
        )
        .unwrap();
        let (b, _) = gla::chunked(
            &q.narrow(2, 20, 30).unwrap(),
            &k.narrow(2, 20, 30).unwrap(),
            &v.narrow(2, 20, 30).unwrap(),
            &gammas,
            1.0,
            16,
            Some(&s),
        )
        .unwrap();
        assert!(max_rel(&Tensor::cat(&[a, b], 2).unwrap(), &full) < 1e-5);
    }

    #[test]
    fn rope_rotates_pairs_half_a_head_apart() {
        // Position 0 is the identity; position p rotates (x_j, x_{j+d/2}) by p·θ^(−2j/d).
        let x = randn(&[1, 3, 1, 4], 9);
        let r = rope(&x, &rope_inv_freq(10000.0, 4)).unwrap();
        let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let rv: Vec<f32> = r.flatten_all().unwrap().to_vec1().unwrap();
        for p in 0..3 {
            for j in 0..2 {
                let a = p as f64 * 10000f64.powf(-2.0 * j as f64 / 4.0);
                let (x1, x2) = (xv[p * 4 + j] as f64, xv[p * 4 + j + 2] as f64);
                assert!((rv[p * 4 + j] as f64 - (x1 * a.cos() - x2 * a.sin())).abs() < 1e-6);
                assert!((rv[p * 4 + j + 2] as f64 - (x2 * a.cos() + x1 * a.sin())).abs() < 1e-6);
            }
        }
    }
}
