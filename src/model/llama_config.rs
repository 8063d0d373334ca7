//! `config.json` of the dense decoder families (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`, `MiniCPMForCausalLM`): parsed from the values in the file with each
//! family's Transformers defaults where a key is absent, validated before anything is sized
//! from it, and the per-layer tables (Linears, tensors, RoPE frequencies) the forward pass in
//! [`super::llama`] and the quantizer read.

use super::nn::{rope_inv_freq, LinearGroup, LinearSpec};
use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// The dense families and the `architectures` entry that selects each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    MiniCpm,
}

impl Family {
    pub const ALL: [Family; 4] = [Self::Llama, Self::Mistral, Self::Qwen2, Self::MiniCpm];

    pub fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::MiniCpm => "MiniCPMForCausalLM",
        }
    }

    pub fn from_architecture(a: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.architecture() == a)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::MiniCpm => "minicpm",
        }
    }

    /// `tie_word_embeddings` when config.json omits it: the Transformers config classes of
    /// Llama, Mistral and Qwen2 default to false; MiniCPM keeps PretrainedConfig's true.
    fn default_tied(self) -> bool {
        self == Self::MiniCpm
    }
}

/// The keys of `config.json` that the forward pass reads. Keys that change the computation and
/// have no common default are required; others take the Transformers defaults of the family
/// (documented per field). Unknown keys are ignored.
#[derive(Debug, Clone, Deserialize)]
struct RawConfig {
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    /// Default: num_attention_heads (multi-head attention).
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    /// Default: hidden_size / num_attention_heads.
    #[serde(default)]
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    /// Default 10000 (every family's default; old Llama configs omit it).
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    partial_rotary_factor: Option<f64>,
    #[serde(default)]
    hidden_act: Option<String>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pad_token_id: Option<serde_json::Value>,
    #[serde(default)]
    scale_emb: Option<f64>,
    #[serde(default)]
    scale_depth: Option<f64>,
    #[serde(default)]
    dim_model_base: Option<f64>,
}

/// A validated dense-decoder config.
#[derive(Debug, Clone)]
pub struct LlamaConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v, on o, and on gate/up/down.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// The sliding window in force (None: full causal attention).
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<serde_json::Value>,
    pub pad_token_id: Option<serde_json::Value>,
    /// MiniCPM's muP scalars (1.0 for the other families).
    pub scale_emb: f64,
    pub residual_scale: f64,
    pub logit_divisor: f64,
    /// config.json as read, written back unchanged by `synth`.
    pub raw: serde_json::Value,
}

/// `rope_scaling` kinds the forward pass implements.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

impl RopeScaling {
    fn parse(v: Option<&serde_json::Value>) -> Result<Self> {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            return Ok(Self::None);
        };
        let kind = v
            .get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(|k| k.as_str())
            .unwrap_or("");
        let num = |k: &str| -> Result<f64> {
            v.get(k)
                .and_then(|x| x.as_f64())
                .with_context(|| format!("rope_scaling ({kind}) needs a number {k:?}; got {v}"))
        };
        Ok(match kind {
            "default" => Self::None,
            "linear" => Self::Linear {
                factor: num("factor")?,
            },
            "llama3" => Self::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            },
            other => bail!(
                "rope_scaling type {other:?} is not supported: use null, \"default\", \"linear\" or \"llama3\""
            ),
        })
    }

    /// Applies the scaling to the unscaled inverse frequencies.
    fn apply(&self, inv_freq: &mut [f64]) {
        match *self {
            Self::None => {}
            Self::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen < high_wavelen {
                        continue;
                    }
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
    }
}

impl LlamaConfig {
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: serde_json::Value = serde_json::from_str(text)?;
        Self::from_value(raw)
    }

    pub fn from_value(mut raw: serde_json::Value) -> Result<Self> {
        super::rope_parameters::lift(&mut raw)?;
        let r: RawConfig = serde_json::from_value(raw.clone())?;
        let family = family_of(&r)?;
        check_sizes(&r)?;
        let heads = r.num_attention_heads;
        let (kv_heads, head_dim) = head_layout(&r)?;
        let (rope_theta, rope_scaling) = rope(&r)?;
        let (qkv_bias, o_bias, mlp_bias) = biases(family, &r);
        let sliding_window = sliding_window_of(family, &r);
        let (scale_emb, residual_scale, logit_divisor) = minicpm_scales(family, &r)?;
        Ok(Self {
            family,
            hidden_size: r.hidden_size,
            intermediate_size: r.intermediate_size,
            num_hidden_layers: r.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            vocab_size: r.vocab_size,
            max_position_embeddings: r.max_position_embeddings,
            rms_norm_eps: r.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: r
                .tie_word_embeddings
                .unwrap_or_else(|| family.default_tied()),
            qkv_bias,
            o_bias,
            mlp_bias,
            sliding_window,
            bos_token_id: r.bos_token_id,
            eos_token_id: r.eos_token_id,
            pad_token_id: r.pad_token_id,
            scale_emb,
            residual_scale,
            logit_divisor,
            raw,
        })
    }

    /// Refuses inputs this forward pass cannot compute exactly.
    pub fn check_length(&self, t: usize) -> Result<()> {
        if t > self.max_position_embeddings {
            bail!(
                "sequence length {t} is above max_position_embeddings = {} of config.json; use --seqlen {} or less",
                self.max_position_embeddings,
                self.max_position_embeddings
            );
        }
        if let Some(w) = self.sliding_window.filter(|&w| t > w) {
            bail!(
                "sequence length {t} is above sliding_window = {w}: sliding-window attention is not implemented \
                 (below its length it is exact dense attention); use --seqlen {w} or less"
            );
        }
        Ok(())
    }

    /// RoPE inverse frequencies θ^(−2j/d) for j < d/2, with `rope_scaling` applied.
    pub fn inv_freq(&self) -> Vec<f64> {
        let mut f = rope_inv_freq(self.rope_theta, self.head_dim);
        self.rope_scaling.apply(&mut f);
        f
    }

    /// Every tensor the checkpoint must hold, with its shape, in a fixed order.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for i in 0..self.num_hidden_layers {
            for (name, shape) in self.layer_tensors(i) {
                out.push((format!("model.layers.{i}.{name}"), shape));
            }
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        out
    }

    /// The Linears of a decoder layer in checkpoint order (the one table of them; see
    /// [`LinearSpec`]). Every layer has the same.
    pub fn layer_linears(&self, _i: usize) -> Vec<LinearSpec> {
        let (h, m) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        use LinearGroup::*;
        vec![
            LinearSpec::new("self_attn.q_proj", Qkv, q, h, self.qkv_bias),
            LinearSpec::new("self_attn.k_proj", Qkv, kv, h, self.qkv_bias),
            LinearSpec::new("self_attn.v_proj", Qkv, kv, h, self.qkv_bias),
            LinearSpec::new("self_attn.o_proj", O, h, q, self.o_bias),
            LinearSpec::new("mlp.gate_proj", GateUp, m, h, self.mlp_bias),
            LinearSpec::new("mlp.up_proj", GateUp, m, h, self.mlp_bias),
            LinearSpec::new("mlp.down_proj", Down, h, m, self.mlp_bias),
        ]
    }

    /// Tensors of decoder layer `i`, relative to `model.layers.{i}.`, with shapes.
    pub fn layer_tensors(&self, i: usize) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let mut t: Vec<(String, Vec<usize>)> = vec![
            ("input_layernorm.weight".into(), vec![h]),
            ("post_attention_layernorm.weight".into(), vec![h]),
        ];
        t.extend(self.layer_linears(i).iter().flat_map(LinearSpec::tensors));
        t
    }
}

/// The dense family named in `architectures`.
fn family_of(r: &RawConfig) -> Result<Family> {
    r.architectures
        .iter()
        .find_map(|a| Family::from_architecture(a))
        .with_context(|| {
            format!(
                "architectures is {:?}: not one of the dense families {}",
                r.architectures,
                Family::ALL.map(|f| f.architecture()).join(", ")
            )
        })
}

/// Every size is nonzero and a dimension the tool can take; the activation is SiLU.
fn check_sizes(r: &RawConfig) -> Result<()> {
    let nonzero = [
        ("hidden_size", r.hidden_size),
        ("intermediate_size", r.intermediate_size),
        ("num_hidden_layers", r.num_hidden_layers),
        ("num_attention_heads", r.num_attention_heads),
        ("vocab_size", r.vocab_size),
        ("max_position_embeddings", r.max_position_embeddings),
    ];
    for (name, v) in nonzero {
        if v == 0 {
            bail!("{name} is 0");
        }
        crate::model::check_dimension(name, v)?;
    }
    let act = r.hidden_act.as_deref().unwrap_or("silu");
    if act != "silu" {
        bail!("hidden_act is {act:?}: only \"silu\" is supported");
    }
    Ok(())
}

/// The key/value head count and the head width, checked for grouped-query attention and RoPE.
fn head_layout(r: &RawConfig) -> Result<(usize, usize)> {
    let heads = r.num_attention_heads;
    let kv_heads = r.num_key_value_heads.unwrap_or(heads);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}");
    }
    let head_dim = match r.head_dim {
        Some(d) => d,
        None => {
            if !r.hidden_size.is_multiple_of(heads) {
                bail!(
                        "hidden_size {} is not divisible by num_attention_heads {heads} (and config.json has no head_dim)",
                        r.hidden_size
                    );
            }
            r.hidden_size / heads
        }
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        bail!("head_dim {head_dim} must be even and positive for RoPE");
    }
    if r.partial_rotary_factor.is_some_and(|f| f != 1.0) {
        bail!("partial_rotary_factor is set: only RoPE over the whole head is supported");
    }
    Ok((kv_heads, head_dim))
}

/// The RoPE base (10000 when absent) and scaling, with the norm epsilon checked beside the base.
fn rope(r: &RawConfig) -> Result<(f64, RopeScaling)> {
    let rope_theta = r.rope_theta.unwrap_or(10000.0);
    if !(r.rms_norm_eps > 0.0 && rope_theta > 0.0) {
        bail!("rms_norm_eps and rope_theta must be positive");
    }
    Ok((rope_theta, RopeScaling::parse(r.rope_scaling.as_ref())?))
}

/// The (q/k/v, o, MLP) biases of the family.
fn biases(family: Family, r: &RawConfig) -> (bool, bool, bool) {
    match family {
        Family::Qwen2 => (true, false, false),
        Family::Mistral => (false, false, false),
        Family::Llama => (r.attention_bias, r.attention_bias, r.mlp_bias),
        Family::MiniCpm => (r.attention_bias, r.attention_bias, false),
    }
}

/// The sliding-window length, for the families that honour one.
fn sliding_window_of(family: Family, r: &RawConfig) -> Option<usize> {
    match family {
        Family::Mistral => r.sliding_window,
        Family::Qwen2 if r.use_sliding_window == Some(true) => r.sliding_window,
        _ => None,
    }
}

/// MiniCPM's embedding scale, residual scale and logit divisor (all 1 for the other families).
fn minicpm_scales(family: Family, r: &RawConfig) -> Result<(f64, f64, f64)> {
    Ok(if family == Family::MiniCpm {
        let need = |k: &str, v: Option<f64>| {
            v.with_context(|| format!("MiniCPMForCausalLM needs {k} in config.json"))
        };
        let se = need("scale_emb", r.scale_emb)?;
        let sd = need("scale_depth", r.scale_depth)?;
        let dmb = need("dim_model_base", r.dim_model_base)?;
        if !(dmb > 0.0 && se.is_finite() && sd.is_finite()) {
            bail!("dim_model_base must be positive and scale_emb / scale_depth finite");
        }
        (
            se,
            sd / (r.num_hidden_layers as f64).sqrt(),
            r.hidden_size as f64 / dmb,
        )
    } else {
        (1.0, 1.0, 1.0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: serde_json::Value) -> Result<LlamaConfig> {
        let mut v = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        LlamaConfig::from_value(v)
    }

    #[test]
    fn families_differ_in_biases_scalars_and_ties() {
        let l = cfg(serde_json::json!({})).unwrap();
        assert_eq!(l.family, Family::Llama);
        assert_eq!(l.head_dim, 16);
        assert!(!l.tie_word_embeddings && !l.qkv_bias);
        assert_eq!(l.expected_tensors().len(), 1 + 2 * 9 + 2);
        let q = cfg(
            serde_json::json!({"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": true}),
        )
        .unwrap();
        assert!(q.qkv_bias && !q.o_bias);
        let names: Vec<String> = q.expected_tensors().into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"model.layers.1.self_attn.k_proj.bias".to_string()));
        assert!(!names.contains(&"lm_head.weight".to_string()));
        let m = cfg(serde_json::json!({"architectures": ["MiniCPMForCausalLM"],
            "scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 16.0}))
        .unwrap();
        assert!(m.tie_word_embeddings, "MiniCPM ties by default");
        assert_eq!(m.logit_divisor, 4.0);
        assert!((m.residual_scale - 1.4 / 2f64.sqrt()).abs() < 1e-12);
        let e = cfg(serde_json::json!({"architectures": ["MiniCPMForCausalLM"]})).unwrap_err();
        assert!(format!("{e:#}").contains("scale_emb"), "{e:#}");
    }

    #[test]
    fn lengths_beyond_the_window_or_the_positions_are_refused() {
        let m = cfg(
            serde_json::json!({"architectures": ["MistralForCausalLM"], "sliding_window": 128}),
        )
        .unwrap();
        m.check_length(128).unwrap();
        let e = format!("{:#}", m.check_length(129).unwrap_err());
        assert!(e.contains("sliding_window = 128"), "{e}");
        let e = format!("{:#}", m.check_length(257).unwrap_err());
        assert!(e.contains("max_position_embeddings = 256"), "{e}");
        // Qwen2 ignores sliding_window unless use_sliding_window is true.
        let q =
            cfg(serde_json::json!({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 16}))
                .unwrap();
        q.check_length(256).unwrap();
    }

    /// transformers 5's `rope_parameters` gives the same frequencies as the old keys.
    #[test]
    fn rope_parameters_read_as_the_old_keys() {
        let l3 = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let mut new = l3.clone();
        new["rope_theta"] = 5e5.into();
        let old = cfg(serde_json::json!({"rope_theta": 5e5, "rope_scaling": l3})).unwrap();
        let new = cfg(serde_json::json!({ "rope_parameters": new })).unwrap();
        assert_eq!(new.rope_theta, 5e5);
        assert_eq!(old.inv_freq(), new.inv_freq());
        assert_ne!(
            new.inv_freq(),
            cfg(serde_json::json!({})).unwrap().inv_freq()
        );
    }

    #[test]
    fn rope_scaling_kinds() {
        let base = cfg(serde_json::json!({})).unwrap().inv_freq();
        let lin = cfg(serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}))
            .unwrap()
            .inv_freq();
        for (a, b) in base.iter().zip(&lin) {
            assert!((a / 2.0 - b).abs() < 1e-15);
        }
        let l3 = cfg(serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}))
        .unwrap()
        .inv_freq();
        // The highest frequency (wavelength 2π < 16) is kept, the lowest divided by 8.
        assert_eq!(l3[0], base[0]);
        assert!(
            (l3[7] - base[7] / 8.0).abs() < 1e-15,
            "{} {}",
            l3[7],
            base[7]
        );
        let e =
            cfg(serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0}})).unwrap_err();
        assert!(format!("{e:#}").contains("\"yarn\" is not supported"));
        let e = cfg(serde_json::json!({"num_key_value_heads": 3})).unwrap_err();
        assert!(format!("{e:#}").contains("num_key_value_heads 3"));
    }
}
