//! `config.json` of MiniCPM-SALA, parsed from the values in the file (never from another
//! implementation's defaults), and checked for consistency before anything is computed.

use super::infllm::InfllmV2;
use super::nn::{LinearGroup, LinearSpec};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The two mixer kinds of MiniCPM-SALA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MixerKind {
    /// `minicpm4`: GQA softmax attention (dense below `dense_len`), sigmoid `o_gate`.
    Sparse,
    /// `lightning-attn`: Simple-GLA linear attention with fixed ALiBi-slope decays.
    Lightning,
}

impl MixerKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "minicpm4" => Some(Self::Sparse),
            "lightning" | "lightning_attn" | "lightning-attn" => Some(Self::Lightning),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Sparse => "minicpm4",
            Self::Lightning => "lightning-attn",
        }
    }
}

/// When the sparse layers run InfLLM-v2 (`--sparse-attention`; docs/model.md, InfLLM-v2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SparseAttention {
    /// As the official code: dense below `sparse_config.dense_len`, InfLLM-v2 from it on.
    #[default]
    Auto,
    /// InfLLM-v2 at every length, as SGLang serves with dense-as-sparse.
    Always,
    /// Dense attention at every length, as the vLLM ports compute the sparse layers.
    Never,
}

impl SparseAttention {
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Always => "always",
            Self::Never => "never",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SparseConfig {
    pub block_size: usize,
    pub dense_len: usize,
    pub init_blocks: usize,
    pub kernel_size: usize,
    pub kernel_stride: usize,
    pub topk: usize,
    pub use_nope: bool,
    pub window_size: usize,
}

/// Every key of the released `config.json` (docs/model.md, Config keys). Keys that change the
/// computation are required; keys with no effect on inference are optional.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Config {
    pub architectures: Vec<String>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub attention_dropout: f64,
    pub attn_use_output_gate: bool,
    pub attn_use_rope: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_map: Option<serde_json::Value>,
    pub bos_token_id: u32,
    pub dim_model_base: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    pub eos_token_id: serde_json::Value,
    pub head_dim: usize,
    pub hidden_act: String,
    pub hidden_size: usize,
    #[serde(default)]
    pub initializer_range: f64,
    pub intermediate_size: usize,
    pub lightning_head_dim: usize,
    pub lightning_nh: usize,
    pub lightning_nkv: usize,
    pub lightning_scale: String,
    pub lightning_use_rope: bool,
    pub max_position_embeddings: usize,
    pub mixer_types: Vec<String>,
    pub model_type: String,
    #[serde(default)]
    pub mup_denominator: f64,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub num_key_value_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    #[serde(default = "one")]
    pub pretraining_tp: usize,
    pub qk_norm: bool,
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_theta: f64,
    pub scale_depth: f64,
    pub scale_emb: f64,
    #[serde(default)]
    pub shift_labels: bool,
    pub sparse_config: SparseConfig,
    pub tie_word_embeddings: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformers_version: Option<String>,
    #[serde(default)]
    pub use_cache: bool,
    pub use_output_gate: bool,
    pub use_output_norm: bool,
    pub vocab_size: usize,
    /// Present in quantized checkpoints; carried through untouched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization_config: Option<serde_json::Value>,
    /// Not a config key: when the sparse layers run InfLLM-v2, chosen by `--sparse-attention`.
    #[serde(skip)]
    pub sparse_attention: SparseAttention,
}

fn one() -> usize {
    1
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_json(&text).with_context(|| format!("invalid model config {}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let mut raw: serde_json::Value = serde_json::from_str(text)?;
        super::rope_parameters::lift(&mut raw)?;
        let cfg: Config = serde_json::from_value(raw)?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serializes")
    }

    /// Rejects configs that the forward pass cannot honour, with the key at fault in the message.
    pub fn validate(&self) -> Result<()> {
        self.validate_supported()?;
        self.validate_dimensions()?;
        self.validate_head_layout()?;
        self.validate_lightning_matches_official()?;
        self.validate_scalars()
    }

    /// The architecture, the mixer types and the switches this tool supports.
    fn validate_supported(&self) -> Result<()> {
        if !self
            .architectures
            .iter()
            .any(|a| a == "MiniCPMSALAForCausalLM")
        {
            bail!(
                "architectures is {:?}: this tool runs MiniCPMSALAForCausalLM checkpoints",
                self.architectures
            );
        }
        if self.mixer_types.len() != self.num_hidden_layers {
            bail!(
                "mixer_types has {} entries but num_hidden_layers is {}: they must match",
                self.mixer_types.len(),
                self.num_hidden_layers
            );
        }
        for (i, m) in self.mixer_types.iter().enumerate() {
            if MixerKind::parse(m).is_none() {
                bail!("mixer_types[{i}] is {m:?}: expected \"minicpm4\" or \"lightning-attn\"");
            }
        }
        if self.hidden_act != "silu" {
            bail!(
                "hidden_act is {:?}: only \"silu\" is supported",
                self.hidden_act
            );
        }
        if self.attention_bias {
            bail!("attention_bias is true: MiniCPM-SALA has no biases and none are supported");
        }
        if self.tie_word_embeddings {
            bail!("tie_word_embeddings is true: MiniCPM-SALA has an untied lm_head");
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            bail!("rope_scaling is set: only rope_scaling = null is supported");
        }
        Ok(())
    }

    /// Every size is nonzero and a dimension the tool can take.
    fn validate_dimensions(&self) -> Result<()> {
        let nonzero = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("lightning_nh", self.lightning_nh),
            ("lightning_nkv", self.lightning_nkv),
            ("lightning_head_dim", self.lightning_head_dim),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("sparse_config.dense_len", self.sparse_config.dense_len),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                bail!("{name} is 0");
            }
            crate::model::check_dimension(name, v)?;
        }
        Ok(())
    }

    /// The head counts and widths divide as attention and RoPE need.
    fn validate_head_layout(&self) -> Result<()> {
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            bail!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size,
                self.num_attention_heads
            );
        }
        if self.hidden_size / self.num_attention_heads != self.head_dim {
            bail!(
                "head_dim is {} but hidden_size / num_attention_heads = {} / {} = {}",
                self.head_dim,
                self.hidden_size,
                self.num_attention_heads,
                self.hidden_size / self.num_attention_heads
            );
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.lightning_nh.is_multiple_of(self.lightning_nkv) {
            bail!(
                "lightning_nh {} is not a multiple of lightning_nkv {}",
                self.lightning_nh,
                self.lightning_nkv
            );
        }
        if !self.head_dim.is_multiple_of(2) || !self.lightning_head_dim.is_multiple_of(2) {
            bail!(
                "head dimensions must be even for RoPE (head_dim {}, lightning_head_dim {})",
                self.head_dim,
                self.lightning_head_dim
            );
        }
        Ok(())
    }

    /// The lightning keys agree with the keys the official code builds the lightning layers from.
    fn validate_lightning_matches_official(&self) -> Result<()> {
        // The official code builds the lightning layers from num_attention_heads and head_dim
        // and never reads lightning_nh / lightning_head_dim: a config where they differ is a
        // model it computes differently from what the keys say.
        for (key, v, official, okey) in [
            (
                "lightning_nh",
                self.lightning_nh,
                self.num_attention_heads,
                "num_attention_heads",
            ),
            (
                "lightning_head_dim",
                self.lightning_head_dim,
                self.head_dim,
                "head_dim",
            ),
        ] {
            if v != official {
                bail!(
                    "{key} is {v} but {okey} is {official}: the official MiniCPM-SALA code builds \
                     the lightning layers from {okey} and ignores {key}, so this config describes \
                     a model it does not compute; make them equal"
                );
            }
        }
        Ok(())
    }

    /// The lightning scale, the scaling factors, the norm epsilon and the RoPE base.
    fn validate_scalars(&self) -> Result<()> {
        self.lightning_scale_value()?;
        if !(self.dim_model_base > 0.0
            && self.scale_emb.is_finite()
            && self.scale_depth.is_finite())
        {
            bail!("dim_model_base must be positive and scale_emb / scale_depth finite");
        }
        if self.rms_norm_eps <= 0.0 || self.rope_theta <= 0.0 {
            bail!("rms_norm_eps and rope_theta must be positive");
        }
        Ok(())
    }

    /// Refuses a sequence length the model cannot take: above `max_position_embeddings`, or one
    /// at which the sparse layers run InfLLM-v2 with a `sparse_config` its kernels cannot take.
    pub fn check_length(&self, t: usize) -> Result<()> {
        if t > self.max_position_embeddings {
            bail!(
                "sequence length {t} is above max_position_embeddings = {}: use --seqlen at most {}",
                self.max_position_embeddings,
                self.max_position_embeddings
            );
        }
        if self.sparse_runs(t) && self.mixer_types.iter().any(|m| m == "minicpm4") {
            self.infllm().with_context(|| {
                format!(
                    "sequences of {t} tokens run the sparse layers' InfLLM-v2 attention \
                     (--sparse-attention {})",
                    self.sparse_attention.name()
                )
            })?;
        }
        Ok(())
    }

    /// Whether the sparse layers run InfLLM-v2 on a `t`-token sequence: at and above
    /// `sparse_config.dense_len` as the official code does (`auto`), always (SGLang's
    /// dense-as-sparse) or never (dense attention, as the vLLM ports compute it).
    pub fn sparse_runs(&self, t: usize) -> bool {
        match self.sparse_attention {
            SparseAttention::Auto => t >= self.sparse_config.dense_len,
            SparseAttention::Always => true,
            SparseAttention::Never => false,
        }
    }

    /// InfLLM-v2's settings from `sparse_config`, refused (naming the key) where its kernels
    /// could not run them: other window or block shapes, a query-to-kv head ratio that does not divide 16, or
    /// a head dimension other than 128.
    pub fn infllm(&self) -> Result<InfllmV2> {
        use super::infllm::{BLOCK_SIZE, GROUP, HEAD_DIM, KERNEL_SIZE, KERNEL_STRIDE};
        let sc = &self.sparse_config;
        let (heads, kv_heads, head_dim) = (
            self.num_attention_heads,
            self.num_key_value_heads,
            self.sparse_head_dim(),
        );
        for (key, v, want) in [
            ("sparse_config.kernel_size", sc.kernel_size, KERNEL_SIZE),
            (
                "sparse_config.kernel_stride",
                sc.kernel_stride,
                KERNEL_STRIDE,
            ),
            ("sparse_config.block_size", sc.block_size, BLOCK_SIZE),
        ] {
            if v != want {
                bail!(
                    "{key} is {v}: InfLLM-v2's kernels (and so the model as served) take only \
                     {want}; fix the config, or keep every sequence below \
                     sparse_config.dense_len = {} with --sparse-attention auto",
                    sc.dense_len
                );
            }
        }
        if sc.window_size < sc.block_size {
            bail!(
                "sparse_config.window_size is {}: the local window must hold at least one block \
                 of sparse_config.block_size = {} tokens",
                sc.window_size,
                sc.block_size
            );
        }
        let ratio = heads / kv_heads.max(1);
        if ratio == 0 || !GROUP.is_multiple_of(ratio) || !heads.is_multiple_of(kv_heads.max(1)) {
            bail!(
                "num_attention_heads / num_key_value_heads is {heads} / {kv_heads}: InfLLM-v2's \
                 kernels group 16 query heads per kv head and take ratios that divide 16"
            );
        }
        if head_dim != HEAD_DIM {
            bail!(
                "the sparse layers' head dimension is {head_dim} (hidden_size / \
                 num_attention_heads): InfLLM-v2's kernels are built for {HEAD_DIM} only"
            );
        }
        let local_blocks = sc.window_size / sc.block_size;
        Ok(InfllmV2 {
            kernel_size: sc.kernel_size,
            kernel_stride: sc.kernel_stride,
            block_size: sc.block_size,
            init_blocks: sc.init_blocks,
            local_blocks,
            topk: sc.topk + local_blocks,
        })
    }

    pub fn mixer(&self, layer: usize) -> MixerKind {
        MixerKind::parse(&self.mixer_types[layer]).expect("validated")
    }

    /// Softmax-attention head dimension (hidden_size / num_attention_heads).
    pub fn sparse_head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// `lightning_scale`: `"1/sqrt(d)"` or `"1/d"` of the head dimension. The official code
    /// turns any other value (a number included) into 1.0 without a word; such configs are
    /// refused rather than computed differently (docs/model.md, Config keys).
    pub fn lightning_scale_value(&self) -> Result<f64> {
        let d = self.lightning_head_dim as f64;
        match self.lightning_scale.as_str() {
            "1/sqrt(d)" => Ok(1.0 / d.sqrt()),
            "1/d" => Ok(1.0 / d),
            s => bail!(
                "lightning_scale is {s:?}: the official MiniCPM-SALA code reads only \"1/sqrt(d)\" \
                 and \"1/d\" and silently computes any other value (numbers included) as 1.0; \
                 write one of the two, or \"1/sqrt(d)\" as the released model has"
            ),
        }
    }

    /// Residual branch multiplier r = scale_depth / sqrt(num_hidden_layers).
    pub fn residual_scale(&self) -> f64 {
        self.scale_depth / (self.num_hidden_layers as f64).sqrt()
    }

    /// Divisor of the final hidden state before lm_head: hidden_size / dim_model_base.
    pub fn logit_divisor(&self) -> f64 {
        self.hidden_size as f64 / self.dim_model_base
    }

    /// Every tensor the checkpoint must hold, with its shape, in a fixed order.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
        )];
        for i in 0..self.num_hidden_layers {
            for (name, shape) in self.layer_tensors(i) {
                out.push((format!("model.layers.{i}.{name}"), shape));
            }
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        out.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        out
    }

    /// The Linears of decoder layer `i` in checkpoint order (the one table of them; see
    /// [`LinearSpec`]).
    pub fn layer_linears(&self, i: usize) -> Vec<LinearSpec> {
        let h = self.hidden_size;
        let (q, kv, gate) = match self.mixer(i) {
            MixerKind::Sparse => {
                let d = self.sparse_head_dim();
                let gate = self.attn_use_output_gate.then_some("self_attn.o_gate");
                (
                    self.num_attention_heads * d,
                    self.num_key_value_heads * d,
                    gate,
                )
            }
            MixerKind::Lightning => {
                let d = self.lightning_head_dim;
                let gate = self.use_output_gate.then_some("self_attn.z_proj");
                (self.lightning_nh * d, self.lightning_nkv * d, gate)
            }
        };
        let m = self.intermediate_size;
        let mut v = vec![
            LinearSpec::new("self_attn.q_proj", LinearGroup::Qkv, q, h, false),
            LinearSpec::new("self_attn.k_proj", LinearGroup::Qkv, kv, h, false),
            LinearSpec::new("self_attn.v_proj", LinearGroup::Qkv, kv, h, false),
            LinearSpec::new("self_attn.o_proj", LinearGroup::O, h, q, false),
        ];
        if let Some(name) = gate {
            v.push(LinearSpec::new(name, LinearGroup::Qkv, q, h, false));
        }
        v.push(LinearSpec::new(
            "mlp.gate_proj",
            LinearGroup::GateUp,
            m,
            h,
            false,
        ));
        v.push(LinearSpec::new(
            "mlp.up_proj",
            LinearGroup::GateUp,
            m,
            h,
            false,
        ));
        v.push(LinearSpec::new(
            "mlp.down_proj",
            LinearGroup::Down,
            h,
            m,
            false,
        ));
        v
    }

    /// Tensors of decoder layer `i`, relative to `model.layers.{i}.`, with shapes: the two
    /// norms, the mixer's Linears, the lightning mixer's norms, the MLP's Linears.
    pub fn layer_tensors(&self, i: usize) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let mut t: Vec<(String, Vec<usize>)> = vec![
            ("input_layernorm.weight".into(), vec![h]),
            ("post_attention_layernorm.weight".into(), vec![h]),
        ];
        let (mixer, mlp): (Vec<LinearSpec>, Vec<LinearSpec>) = self
            .layer_linears(i)
            .into_iter()
            .partition(|l| l.name.starts_with("self_attn."));
        t.extend(mixer.iter().flat_map(LinearSpec::tensors));
        if self.mixer(i) == MixerKind::Lightning {
            let d = self.lightning_head_dim;
            if self.qk_norm {
                t.push(("self_attn.q_norm.weight".into(), vec![d]));
                t.push(("self_attn.k_norm.weight".into(), vec![d]));
            }
            if self.use_output_norm {
                t.push((
                    "self_attn.o_norm.weight".into(),
                    vec![self.lightning_nh * d],
                ));
            }
        }
        t.extend(mlp.iter().flat_map(LinearSpec::tensors));
        t
    }

    pub fn param_count(&self) -> u64 {
        self.expected_tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }
}

/// The released MiniCPM-SALA config (docs/model.md, Config keys; without quantization_config).
pub const MINICPM_SALA_9B_CONFIG: &str = include_str!("presets/minicpm-sala-9b.json");
/// A tiny model of the same structure: both mixer kinds, head_dim 128, dimensions multiples of 128.
pub const TINY_CONFIG: &str = include_str!("presets/tiny.json");
/// `tiny` with a `sparse_config` whose InfLLM-v2 path runs from 512 tokens on (local window of
/// 2 blocks, 4 more selected): long-context runs small enough for a CPU.
pub const TINY_SPARSE_CONFIG: &str = include_str!("presets/tiny-sparse.json");

pub fn preset(name: &str) -> Result<Config> {
    let text = match name {
        "minicpm-sala-9b" => MINICPM_SALA_9B_CONFIG,
        "tiny" => TINY_CONFIG,
        "tiny-sparse" => TINY_SPARSE_CONFIG,
        other => bail!(
            "unknown preset {other:?}: expected \"minicpm-sala-9b\", \"tiny\" or \"tiny-sparse\""
        ),
    };
    Config::from_json(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_config_has_the_published_parameter_count() {
        let cfg = preset("minicpm-sala-9b").unwrap();
        assert_eq!(cfg.param_count(), 9_477_203_968);
        let sparse: Vec<usize> = (0..32)
            .filter(|&i| cfg.mixer(i) == MixerKind::Sparse)
            .collect();
        assert_eq!(sparse, vec![0, 9, 16, 17, 22, 29, 30, 31]);
        assert!((cfg.residual_scale() - 0.24748737).abs() < 1e-8);
        assert_eq!(cfg.logit_divisor(), 16.0);
    }

    #[test]
    fn tiny_preset_has_both_mixers_and_marlin_friendly_dims() {
        let cfg = preset("tiny").unwrap();
        let kinds: Vec<_> = (0..cfg.num_hidden_layers).map(|i| cfg.mixer(i)).collect();
        assert!(kinds.contains(&MixerKind::Sparse) && kinds.contains(&MixerKind::Lightning));
        assert_eq!(cfg.head_dim, 128);
        assert_eq!(cfg.lightning_head_dim, 128);
        for (name, shape) in cfg.expected_tensors() {
            if name.ends_with("proj.weight") || name.ends_with("o_gate.weight") {
                assert_eq!(shape[0] % 128, 0, "{name}");
                assert_eq!(shape[1] % 128, 0, "{name}");
            }
        }
    }

    fn mutate(f: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut v: serde_json::Value = serde_json::from_str(TINY_CONFIG).unwrap();
        f(&mut v);
        v.to_string()
    }

    #[test]
    fn inconsistent_configs_are_rejected_with_the_key_named() {
        let cases: Vec<(String, &str)> = vec![
            (
                mutate(|v| v["num_hidden_layers"] = 5.into()),
                "mixer_types has 4 entries",
            ),
            (
                mutate(|v| v["mixer_types"][1] = "mamba".into()),
                "mixer_types[1]",
            ),
            (
                mutate(|v| v["num_key_value_heads"] = 3.into()),
                "num_key_value_heads",
            ),
            (mutate(|v| v["head_dim"] = 64.into()), "head_dim is 64"),
            (mutate(|v| v["hidden_size"] = 301.into()), "not divisible"),
            (
                mutate(|v| v["lightning_scale"] = "sqrt".into()),
                "lightning_scale",
            ),
            (mutate(|v| v["hidden_act"] = "gelu".into()), "hidden_act"),
            (
                mutate(|v| {
                    v.as_object_mut()
                        .unwrap()
                        .remove("rope_theta")
                        .map(|_| ())
                        .unwrap()
                }),
                "rope_theta",
            ),
        ];
        for (json, needle) in cases {
            let err = format!("{:#}", Config::from_json(&json).unwrap_err());
            assert!(err.contains(needle), "expected {needle:?} in {err:?}");
        }
    }

    #[test]
    fn lightning_synonyms_are_accepted() {
        for s in ["lightning", "lightning_attn", "lightning-attn"] {
            assert_eq!(MixerKind::parse(s), Some(MixerKind::Lightning));
        }
    }
}
