//! The dense decoder families that share MiniCPM-SALA's parts: `LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM` and `MiniCPMForCausalLM`, in one parameterized
//! file. Every layer is pre-norm GQA softmax attention with rotate-half RoPE and a SwiGLU MLP;
//! the families differ only in
//! - biases: Qwen2 has q/k/v biases; Llama and MiniCPM follow `attention_bias` (q/k/v/o) and
//!   Llama `mlp_bias` (gate/up/down);
//! - MiniCPM's muP scalars: embeddings times `scale_emb`, each residual branch times
//!   `scale_depth / sqrt(num_hidden_layers)`, the final hidden state divided by
//!   `hidden_size / dim_model_base` before the head;
//! - Mistral's (and Qwen2's `use_sliding_window`) sliding window, which is exact dense attention
//!   up to its length: longer inputs are refused;
//! - `tie_word_embeddings` (the head reads the embedding matrix).
//!
//! The layer API is the one the quantizer and the evaluator use for MiniCPM-SALA
//! ([`super::minicpm_sala::DecoderLayer`]): a capture hook per Linear group, the attention output
//! ("mixer output", the input of o_proj) computed on its own, and one layer loaded at a time.
//! Precision follows the SALA forward: Linears in the model dtype, RMSNorm variance, RoPE,
//! softmax and logits in f32.

use super::nn::{causal_attention, rms_norm, rope, Linear, LinearGroup};
use crate::checkpoint::Checkpoint;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub use super::llama_config::{Family, LlamaConfig, RopeScaling};

/// A Linear with an optional bias; the weight is what the quantizer replaces.
#[derive(Debug, Clone)]
pub struct Proj {
    pub lin: Linear,
    pub bias: Option<Tensor>,
}

impl Proj {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.lin.forward(x)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

#[derive(Debug, Clone)]
struct LayerConsts {
    eps: f64,
    residual: f64,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inv_freq: Vec<f64>,
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub index: usize,
    pub input_norm: Tensor,
    pub post_norm: Tensor,
    pub q: Proj,
    pub k: Proj,
    pub v: Proj,
    pub o: Proj,
    pub gate_proj: Proj,
    pub up_proj: Proj,
    pub down_proj: Proj,
    c: LayerConsts,
}

impl DecoderLayer {
    pub fn load(
        ck: &Checkpoint,
        cfg: &LlamaConfig,
        i: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::from_tensors(cfg, i, &|name| ck.tensor(name, dtype, device))
    }

    /// Builds layer `i` from tensors fetched by full name (`model.layers.{i}.…`).
    pub fn from_tensors(
        cfg: &LlamaConfig,
        i: usize,
        get: &dyn Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let p = format!("model.layers.{i}.");
        let t = |name: &str| get(&format!("{p}{name}"));
        let proj = |name: &str, bias: bool| -> Result<Proj> {
            Ok(Proj {
                lin: Linear {
                    weight: t(&format!("{name}.weight"))?,
                },
                bias: bias.then(|| t(&format!("{name}.bias"))).transpose()?,
            })
        };
        Ok(Self {
            index: i,
            input_norm: t("input_layernorm.weight")?,
            post_norm: t("post_attention_layernorm.weight")?,
            q: proj("self_attn.q_proj", cfg.qkv_bias)?,
            k: proj("self_attn.k_proj", cfg.qkv_bias)?,
            v: proj("self_attn.v_proj", cfg.qkv_bias)?,
            o: proj("self_attn.o_proj", cfg.o_bias)?,
            gate_proj: proj("mlp.gate_proj", cfg.mlp_bias)?,
            up_proj: proj("mlp.up_proj", cfg.mlp_bias)?,
            down_proj: proj("mlp.down_proj", cfg.mlp_bias)?,
            c: LayerConsts {
                eps: cfg.rms_norm_eps,
                residual: cfg.residual_scale,
                heads: cfg.num_attention_heads,
                kv_heads: cfg.num_key_value_heads,
                head_dim: cfg.head_dim,
                inv_freq: cfg.inv_freq(),
            },
        })
    }

    /// The Linear called `name` (as listed by [`LlamaConfig::layer_linears`]).
    pub fn linear_mut(&mut self, name: &str) -> Result<&mut Linear> {
        let p = match name {
            "self_attn.q_proj" => &mut self.q,
            "self_attn.k_proj" => &mut self.k,
            "self_attn.v_proj" => &mut self.v,
            "self_attn.o_proj" => &mut self.o,
            "mlp.gate_proj" => &mut self.gate_proj,
            "mlp.up_proj" => &mut self.up_proj,
            "mlp.down_proj" => &mut self.down_proj,
            _ => bail!("layer {} has no Linear {name}", self.index),
        };
        Ok(&mut p.lin)
    }

    /// Runs the layer on `h` `[B, T, H]`; `capture` sees each Linear group's input, flattened to
    /// `[B·T, K]`, in true-sequential order.
    pub fn forward(
        &self,
        h: &Tensor,
        capture: &mut dyn FnMut(LinearGroup, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let (b, t, hid) = h.dims3()?;
        let x = rms_norm(h, &self.input_norm, self.c.eps)?;
        capture(LinearGroup::Qkv, &x.reshape((b * t, hid))?)?;
        let attn = self.mixer_output(h)?;
        self.forward_from_mixer(h, &attn, capture)
    }

    /// Self-attention output `[B, T, heads·d]` (the input of o_proj).
    pub fn mixer_output(&self, h: &Tensor) -> Result<Tensor> {
        let c = &self.c;
        let (b, t, _) = h.dims3()?;
        let x = rms_norm(h, &self.input_norm, c.eps)?;
        let heads = |p: &Proj, n: usize| -> candle_core::Result<Tensor> {
            p.forward(&x)?.reshape((b, t, n, c.head_dim))
        };
        let qh = rope(&heads(&self.q, c.heads)?, &c.inv_freq)?;
        let kh = rope(&heads(&self.k, c.kv_heads)?, &c.inv_freq)?;
        let vh = heads(&self.v, c.kv_heads)?;
        causal_attention(&qh, &kh, &vh, false)
    }

    /// o_proj, residual, MLP from the attention output; `capture` sees the inputs of the `o`,
    /// `gate_up` and `down` groups.
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

    /// The branch output scaled by the residual factor (1 outside MiniCPM).
    fn scaled(&self, y: Tensor) -> Result<Tensor> {
        Ok(if self.c.residual == 1.0 {
            y
        } else {
            (y * self.c.residual)?
        })
    }

    /// The input RMSNorm of `h` (the input of q/k/v).
    pub fn input_norm(&self, h: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(h, &self.input_norm, self.c.eps)?)
    }

    /// `h + o_proj(attn)·residual`: the state after attention.
    pub fn attn_residual(&self, h: &Tensor, attn: &Tensor) -> Result<Tensor> {
        Ok((h + self.scaled(self.o.forward(attn)?)?)?)
    }

    /// The post-attention RMSNorm of `h` (the input of gate_proj and up_proj).
    pub fn mlp_input(&self, h: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(h, &self.post_norm, self.c.eps)?)
    }

    /// `silu(gate_proj(m)) · up_proj(m)`: the input of down_proj.
    pub fn mlp_act(&self, m: &Tensor) -> Result<Tensor> {
        Ok((candle_nn::ops::silu(&self.gate_proj.forward(m)?)? * self.up_proj.forward(m)?)?)
    }

    /// `h + down_proj(act)·residual`: the layer's output.
    pub fn mlp_residual(&self, h: &Tensor, act: &Tensor) -> Result<Tensor> {
        Ok((h + self.scaled(self.down_proj.forward(act)?)?)?)
    }
}

/// Embedding, final norm and head (the embedding matrix when tied).
pub struct Model {
    pub cfg: LlamaConfig,
    pub dtype: DType,
    pub device: Device,
    pub embed_tokens: Tensor,
    pub norm: Tensor,
    pub lm_head: Linear,
}

impl Model {
    pub fn from_tensors(
        cfg: &LlamaConfig,
        dtype: DType,
        device: &Device,
        get: &dyn Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let embed_tokens = get("model.embed_tokens.weight")?;
        let lm_head = Linear {
            weight: if cfg.tie_word_embeddings {
                embed_tokens.clone()
            } else {
                get("lm_head.weight")?
            },
        };
        Ok(Self {
            cfg: cfg.clone(),
            dtype,
            device: device.clone(),
            embed_tokens,
            norm: get("model.norm.weight")?,
            lm_head,
        })
    }

    pub fn check_length(&self, t: usize) -> Result<()> {
        self.cfg.check_length(t)
    }

    /// `ids` `[B, T]` u32 → hidden states `[B, T, H]` (times `scale_emb` for MiniCPM).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        self.check_length(t)?;
        let e = self
            .embed_tokens
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, ()))?;
        Ok(if self.cfg.scale_emb == 1.0 {
            e
        } else {
            (e * self.cfg.scale_emb)?
        })
    }

    /// Final norm (divided by hidden_size / dim_model_base for MiniCPM), head; f32 logits.
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        let mut x = rms_norm(h, &self.norm, self.cfg.rms_norm_eps)?;
        if self.cfg.logit_divisor != 1.0 {
            x = (x / self.cfg.logit_divisor)?;
        }
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    /// Logits of a full forward with all layers given.
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
    use crate::model::nn::rope_inv_freq;

    #[test]
    fn rope_matches_the_sala_rope_without_scaling() {
        let c = LlamaConfig::from_value(serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 5000.0
        }))
        .unwrap();
        let data: Vec<f32> = (0..2 * 5 * 3 * 16)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let x = Tensor::from_vec(data, (2, 5, 3, 16), &Device::Cpu).unwrap();
        let a = rope(&x, &c.inv_freq()).unwrap();
        let b = rope(&x, &rope_inv_freq(5000.0, 16)).unwrap();
        let d: f32 = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(d, 0.0);
    }
}
