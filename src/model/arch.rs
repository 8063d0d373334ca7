//! One interface over the architectures the tool runs, chosen by `config.json`'s
//! `architectures`: MiniCPM-SALA ([`super::minicpm_sala`]) and the dense Llama-family decoders
//! ([`super::llama`]). The quantizer, the evaluator, `inspect` and `synth` go through these three
//! enums; each variant keeps its own types, so the MiniCPM-SALA path is unchanged.
//!
//! What the pipeline needs from an architecture: the tensor list a config implies (validation,
//! planning, assembling), the embedding and head, decoder layers loaded one at a time with their
//! Linears by name and group, a forward with a capture hook per Linear group, and the mixer
//! (attention) output on its own so later true-sequential subsets can reuse it.

use super::config::Config;
use super::llama::{self, LlamaConfig};
use super::minicpm_sala;
use super::nn::{Linear, LinearGroup, LinearSpec};
use crate::checkpoint::Checkpoint;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// `architectures` entries the tool runs.
pub const SUPPORTED_ARCHITECTURES: [&str; 5] = [
    "MiniCPMSALAForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MiniCPMForCausalLM",
];

/// A validated `config.json` of a supported architecture.
// One or two exist per command: the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum AnyConfig {
    Sala(Config),
    Dense(LlamaConfig),
}

impl From<Config> for AnyConfig {
    fn from(c: Config) -> Self {
        Self::Sala(c)
    }
}

impl From<LlamaConfig> for AnyConfig {
    fn from(c: LlamaConfig) -> Self {
        Self::Dense(c)
    }
}

impl AnyConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        crate::checkpoint::guard::regular_file(path, "config")?;
        let len = std::fs::metadata(path)?.len();
        if len > 16 << 20 {
            bail!(
                "{} is {len} bytes: a model config is a few kilobytes; the file is not a config",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_json(&text).with_context(|| format!("invalid model config {}", path.display()))
    }

    /// Dispatches on `architectures`; an unsupported one is an error listing the supported ones.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        if let Some(k) = crate::checkpoint::json::duplicate_key(text.as_bytes()) {
            bail!("key {k} appears twice: which value is meant is ambiguous; keep one");
        }
        let archs: Vec<&str> = match v.get("architectures") {
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_str()).collect(),
            _ => bail!(
                "config.json has no \"architectures\" list: supported are {}",
                SUPPORTED_ARCHITECTURES.join(", ")
            ),
        };
        if archs.contains(&"MiniCPMSALAForCausalLM") {
            return Ok(Self::Sala(Config::from_json(text)?));
        }
        if archs
            .iter()
            .any(|a| llama::Family::from_architecture(a).is_some())
        {
            return Ok(Self::Dense(LlamaConfig::from_value(v)?));
        }
        bail!(
            "architectures is {archs:?}: unsupported; this tool runs {}",
            SUPPORTED_ARCHITECTURES.join(", ")
        )
    }

    /// The MiniCPM-SALA config, when it is one.
    pub fn sala(&self) -> Option<&Config> {
        match self {
            Self::Sala(c) => Some(c),
            Self::Dense(_) => None,
        }
    }

    pub fn architecture(&self) -> &'static str {
        match self {
            Self::Sala(_) => "MiniCPMSALAForCausalLM",
            Self::Dense(c) => c.family.architecture(),
        }
    }

    /// The family as people write it: MiniCPM-SALA, Llama, Mistral, Qwen2 or MiniCPM.
    pub fn display_name(&self) -> &'static str {
        match self {
            Self::Sala(_) => "MiniCPM-SALA",
            Self::Dense(c) => match c.family {
                llama::Family::Llama => "Llama",
                llama::Family::Mistral => "Mistral",
                llama::Family::Qwen2 => "Qwen2",
                llama::Family::MiniCpm => "MiniCPM",
            },
        }
    }

    /// A short family name: `minicpm-sala`, `llama`, `mistral`, `qwen2` or `minicpm`.
    pub fn family(&self) -> &'static str {
        match self {
            Self::Sala(_) => "minicpm-sala",
            Self::Dense(c) => c.family.name(),
        }
    }

    pub fn num_hidden_layers(&self) -> usize {
        match self {
            Self::Sala(c) => c.num_hidden_layers,
            Self::Dense(c) => c.num_hidden_layers,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            Self::Sala(c) => c.hidden_size,
            Self::Dense(c) => c.hidden_size,
        }
    }

    pub fn intermediate_size(&self) -> usize {
        match self {
            Self::Sala(c) => c.intermediate_size,
            Self::Dense(c) => c.intermediate_size,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Sala(c) => c.vocab_size,
            Self::Dense(c) => c.vocab_size,
        }
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        match self {
            Self::Sala(c) => Some(c.bos_token_id),
            Self::Dense(c) => c.bos_token_id,
        }
    }

    /// `scale_emb` (1 for the families without muP).
    pub fn scale_emb(&self) -> f64 {
        match self {
            Self::Sala(c) => c.scale_emb,
            Self::Dense(c) => c.scale_emb,
        }
    }

    /// Sets when MiniCPM-SALA's sparse layers run InfLLM-v2 (`--sparse-attention`); the dense
    /// families have no sparse layers and take only `auto`.
    pub fn set_sparse_attention(&mut self, mode: super::SparseAttention) -> Result<()> {
        match self {
            Self::Sala(c) => c.sparse_attention = mode,
            Self::Dense(_) if mode == super::SparseAttention::Auto => {}
            Self::Dense(c) => anyhow::bail!(
                "--sparse-attention {} applies to MiniCPM-SALA's sparse layers; {} has none: \
                 leave it at auto",
                mode.name(),
                c.family.architecture()
            ),
        }
        Ok(())
    }

    /// The sparse-attention mode (always `auto` for the dense families).
    pub fn sparse_attention(&self) -> super::SparseAttention {
        match self {
            Self::Sala(c) => c.sparse_attention,
            Self::Dense(_) => super::SparseAttention::Auto,
        }
    }

    /// Whether MiniCPM-SALA's sparse layers run InfLLM-v2 on a `t`-token sequence.
    pub fn sparse_runs(&self, t: usize) -> bool {
        match self {
            Self::Sala(c) => c.sparse_runs(t) && c.mixer_types.iter().any(|m| m == "minicpm4"),
            Self::Dense(_) => false,
        }
    }

    /// Refuses sequence lengths the forward pass cannot compute exactly: above
    /// `max_position_embeddings` (or, for MiniCPM-SALA, a `sparse_config` InfLLM-v2's kernels
    /// cannot take at a length where it runs; for the dense families a sliding window in force).
    pub fn check_length(&self, t: usize) -> Result<()> {
        match self {
            Self::Sala(c) => c.check_length(t),
            Self::Dense(c) => c.check_length(t),
        }
    }

    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            Self::Sala(c) => c.expected_tensors(),
            Self::Dense(c) => c.expected_tensors(),
        }
    }

    /// The Linears of decoder layer `i` in checkpoint order; [`super::nn::sequential`] gives
    /// the true-sequential order.
    pub fn layer_linears(&self, i: usize) -> Vec<LinearSpec> {
        match self {
            Self::Sala(c) => c.layer_linears(i),
            Self::Dense(c) => c.layer_linears(i),
        }
    }

    pub fn layer_tensors(&self, i: usize) -> Vec<(String, Vec<usize>)> {
        match self {
            Self::Sala(c) => c.layer_tensors(i),
            Self::Dense(c) => c.layer_tensors(i),
        }
    }

    pub fn param_count(&self) -> u64 {
        self.expected_tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }

    /// The config as JSON (MiniCPM-SALA: re-serialized; dense: the file as read).
    pub fn to_json_pretty(&self) -> String {
        match self {
            Self::Sala(c) => c.to_json_pretty(),
            Self::Dense(c) => serde_json::to_string_pretty(&c.raw).expect("config serializes"),
        }
    }

    /// bos / eos / pad ids for `generation_config.json`.
    pub fn generation_ids(&self) -> serde_json::Value {
        match self {
            Self::Sala(c) => serde_json::json!({
                "bos_token_id": c.bos_token_id,
                "eos_token_id": c.eos_token_id,
                "pad_token_id": c.pad_token_id,
            }),
            Self::Dense(c) => serde_json::json!({
                "bos_token_id": c.bos_token_id,
                "eos_token_id": c.eos_token_id,
                "pad_token_id": c.pad_token_id,
            }),
        }
    }

    /// A MiniCPM-SALA config with the same tensor shapes, for code written against the SALA
    /// config that only reads dimensions (the quantize preflight estimate): every layer is a
    /// `minicpm4` softmax-attention layer without output gate. Biases are not represented
    /// (they are a rounding error of an estimate), nor a head_dim that differs from
    /// hidden_size / heads (the attention widths are then approximate).
    pub fn shape_config(&self) -> Config {
        let c = match self {
            Self::Sala(c) => return c.clone(),
            Self::Dense(c) => c,
        };
        let mut j: serde_json::Value =
            serde_json::from_str(super::config::TINY_CONFIG).expect("preset parses");
        let n = c.num_hidden_layers;
        j["architectures"] = serde_json::json!(["MiniCPMSALAForCausalLM"]);
        j["hidden_size"] = c.hidden_size.into();
        j["intermediate_size"] = c.intermediate_size.into();
        j["num_hidden_layers"] = n.into();
        j["mixer_types"] = serde_json::json!(vec!["minicpm4"; n]);
        j["num_attention_heads"] = c.num_attention_heads.into();
        j["num_key_value_heads"] = c.num_key_value_heads.into();
        j["head_dim"] = (c.hidden_size / c.num_attention_heads).into();
        j["vocab_size"] = c.vocab_size.into();
        j["attn_use_output_gate"] = false.into();
        j["tie_word_embeddings"] = false.into();
        serde_json::from_value(j).expect("shape config deserializes")
    }
}

/// Embedding and head of a supported architecture.
#[allow(clippy::large_enum_variant)]
pub enum AnyModel {
    Sala(minicpm_sala::Model),
    Dense(llama::Model),
}

impl AnyModel {
    pub fn load(ck: &Checkpoint, cfg: &AnyConfig, dtype: DType, device: &Device) -> Result<Self> {
        Self::from_tensors(cfg, dtype, device, &|name| ck.tensor(name, dtype, device))
    }

    pub fn from_tensors(
        cfg: &AnyConfig,
        dtype: DType,
        device: &Device,
        get: &dyn Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(match cfg {
            AnyConfig::Sala(c) => {
                Self::Sala(minicpm_sala::Model::from_tensors(c, dtype, device, get)?)
            }
            AnyConfig::Dense(c) => Self::Dense(llama::Model::from_tensors(c, dtype, device, get)?),
        })
    }

    pub fn config(&self) -> AnyConfig {
        match self {
            Self::Sala(m) => AnyConfig::Sala(m.cfg.clone()),
            Self::Dense(m) => AnyConfig::Dense(m.cfg.clone()),
        }
    }

    pub fn num_layers(&self) -> usize {
        match self {
            Self::Sala(m) => m.cfg.num_hidden_layers,
            Self::Dense(m) => m.cfg.num_hidden_layers,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Sala(m) => m.cfg.vocab_size,
            Self::Dense(m) => m.cfg.vocab_size,
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Self::Sala(m) => m.dtype,
            Self::Dense(m) => m.dtype,
        }
    }

    pub fn device(&self) -> &Device {
        match self {
            Self::Sala(m) => &m.device,
            Self::Dense(m) => &m.device,
        }
    }

    /// Decoder layer `i` from the checkpoint, in this model's dtype and device.
    pub fn load_layer(&self, ck: &Checkpoint, i: usize) -> Result<AnyLayer> {
        Ok(match self {
            Self::Sala(m) => AnyLayer::Sala(m.load_layer(ck, i)?),
            Self::Dense(m) => AnyLayer::Dense(
                llama::DecoderLayer::load(ck, &m.cfg, i, m.dtype, &m.device)
                    .with_context(|| format!("loading decoder layer {i}"))?,
            ),
        })
    }

    pub fn check_length(&self, t: usize) -> Result<()> {
        match self {
            Self::Sala(m) => m.check_length(t),
            Self::Dense(m) => m.check_length(t),
        }
    }

    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(m) => m.embed(ids),
            Self::Dense(m) => m.embed(ids),
        }
    }

    /// f32 logits `[B, T, V]` from final hidden states.
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(m) => m.head(h),
            Self::Dense(m) => m.head(h),
        }
    }

    /// Logits of a full forward with all layers given (tests, short evaluations).
    pub fn forward(&self, ids: &Tensor, layers: &[AnyLayer]) -> Result<Tensor> {
        let mut h = self.embed(ids)?;
        for layer in layers {
            h = layer.forward(&h, &mut |_, _| Ok(()))?;
        }
        self.head(&h)
    }
}

/// One decoder layer of a supported architecture.
#[derive(Debug, Clone)]
pub enum AnyLayer {
    Sala(minicpm_sala::DecoderLayer),
    Dense(llama::DecoderLayer),
}

impl AnyLayer {
    pub fn load(
        ck: &Checkpoint,
        cfg: &AnyConfig,
        i: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::from_tensors(cfg, i, &|name| ck.tensor(name, dtype, device))
    }

    pub fn from_tensors(
        cfg: &AnyConfig,
        i: usize,
        get: &dyn Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(match cfg {
            AnyConfig::Sala(c) => Self::Sala(minicpm_sala::DecoderLayer::from_tensors(c, i, get)?),
            AnyConfig::Dense(c) => Self::Dense(llama::DecoderLayer::from_tensors(c, i, get)?),
        })
    }

    pub fn linear_mut(&mut self, name: &str) -> Result<&mut Linear> {
        match self {
            Self::Sala(l) => l.linear_mut(name),
            Self::Dense(l) => l.linear_mut(name),
        }
    }

    pub fn forward(
        &self,
        h: &Tensor,
        capture: &mut dyn FnMut(LinearGroup, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.forward(h, capture),
            Self::Dense(l) => l.forward(h, capture),
        }
    }

    /// The input of o_proj: the gated mixer output (SALA) or the self-attention output.
    pub fn mixer_output(&self, h: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.mixer_output(h),
            Self::Dense(l) => l.mixer_output(h),
        }
    }

    pub fn forward_from_mixer(
        &self,
        h: &Tensor,
        attn: &Tensor,
        capture: &mut dyn FnMut(LinearGroup, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.forward_from_mixer(h, attn, capture),
            Self::Dense(l) => l.forward_from_mixer(h, attn, capture),
        }
    }

    /// What kind of mixer the layer has: `minicpm4` and `lightning-attn` (SALA) or `attention`.
    pub fn mixer_name(&self) -> &'static str {
        match self {
            Self::Sala(l) => match l.kind {
                super::MixerKind::Sparse => "minicpm4",
                super::MixerKind::Lightning => "lightning-attn",
            },
            Self::Dense(_) => "attention",
        }
    }

    /// The input RMSNorm of `h`: the input of the q/k/v group.
    pub fn input_norm(&self, h: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.input_norm(h),
            Self::Dense(l) => l.input_norm(h),
        }
    }

    /// `h + o_proj(attn)·residual` (the pieces of [`forward_from_mixer`](Self::forward_from_mixer),
    /// for the quantizer's per-stage caches).
    pub fn attn_residual(&self, h: &Tensor, attn: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.attn_residual(h, attn),
            Self::Dense(l) => l.attn_residual(h, attn),
        }
    }

    /// The post-attention RMSNorm of `h`: the input of the gate/up group.
    pub fn mlp_input(&self, h: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.mlp_input(h),
            Self::Dense(l) => l.mlp_input(h),
        }
    }

    /// `silu(gate_proj(m)) · up_proj(m)`: the input of down_proj.
    pub fn mlp_act(&self, m: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.mlp_act(m),
            Self::Dense(l) => l.mlp_act(m),
        }
    }

    /// `h + down_proj(act)·residual`: the layer's output.
    pub fn mlp_residual(&self, h: &Tensor, act: &Tensor) -> Result<Tensor> {
        match self {
            Self::Sala(l) => l.mlp_residual(h, act),
            Self::Dense(l) => l.mlp_residual(h, act),
        }
    }
}

/// The BF16 layout `dir/config.json` implies when it is a valid config of a supported
/// architecture (MiniCPM-SALA or a dense Llama-family decoder); otherwise the reason it is not
/// (other architectures are validated by their quantized sets alone).
pub fn expected_bf16_tensors(dir: &Path) -> std::result::Result<Vec<(String, Vec<usize>)>, String> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(format!("{} does not exist", path.display()));
    }
    AnyConfig::from_file(&path)
        .map(|c| c.expected_tensors())
        .map_err(|e| format!("{e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_architectures_are_refused_with_the_supported_list() {
        let e = AnyConfig::from_json(r#"{"architectures": ["GPTNeoXForCausalLM"]}"#).unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains("GPTNeoXForCausalLM"), "{e}");
        for a in SUPPORTED_ARCHITECTURES {
            assert!(e.contains(a), "{e}");
        }
        let e = format!("{:#}", AnyConfig::from_json("{}").unwrap_err());
        assert!(e.contains("no \"architectures\""), "{e}");
        let sala = AnyConfig::from_json(super::super::config::TINY_CONFIG).unwrap();
        assert_eq!(sala.family(), "minicpm-sala");
    }

    #[test]
    fn the_shape_config_has_the_dense_shapes() {
        let c = AnyConfig::from_json(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}"#,
        )
        .unwrap();
        let s = AnyConfig::Sala(c.shape_config());
        assert_eq!(s.layer_tensors(1), c.layer_tensors(1));
        assert_eq!(s.param_count(), c.param_count());
    }

    /// `layer_linears` is the one table of Linears: the layer built from the checkpoint reads
    /// exactly `layer_tensors`, and resolves every listed Linear with its listed shape.
    #[test]
    fn layer_linears_match_what_the_layers_load() {
        let qwen = r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6}"#;
        for json in [super::super::config::TINY_CONFIG, qwen] {
            let cfg = AnyConfig::from_json(json).unwrap();
            for i in 0..cfg.num_hidden_layers() {
                let tensors = cfg.layer_tensors(i);
                let read = std::cell::RefCell::new(vec![]);
                let prefix = format!("model.layers.{i}.");
                let get = |name: &str| -> Result<Tensor> {
                    let rel = name.strip_prefix(&prefix).expect("a name of this layer");
                    read.borrow_mut().push(rel.to_string());
                    let (_, shape) = tensors
                        .iter()
                        .find(|(n, _)| n == rel)
                        .unwrap_or_else(|| panic!("{rel} is not in layer_tensors"));
                    Ok(Tensor::zeros(shape.as_slice(), DType::F32, &Device::Cpu)?)
                };
                let mut layer = AnyLayer::from_tensors(&cfg, i, &get).unwrap();
                let mut read = read.into_inner();
                let mut listed: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
                read.sort();
                listed.sort();
                assert_eq!(read, listed, "layer {i} of {}", cfg.family());
                let linears = cfg.layer_linears(i);
                assert!(linears.iter().any(|l| l.bias) == (json == qwen));
                for l in &linears {
                    let w = &layer.linear_mut(l.name).unwrap().weight;
                    assert_eq!(w.dims(), [l.n, l.k], "{}", l.name);
                }
                // True-sequential order: groups ascending, members in checkpoint order.
                let seq = super::super::nn::sequential(linears.clone());
                assert!(seq.windows(2).all(|w| w[0].group <= w[1].group));
                assert_eq!(seq.len(), linears.len());
            }
        }
    }
}
