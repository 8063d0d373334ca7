//! What the engines require of `config.json` and the files beside it: remote code named by
//! `auto_map`, config keys that the engines' own config classes derive (and refuse to be given),
//! and the dtype key. Also the one place that rewrites a source config for an engine
//! ([`engine_config`]), so that the writer and the check agree by construction.
//!
//! Facts (docs/engines.md has the sources): SGLang registers
//! its own `MiniCPMHybridConfig` for `model_type: minicpm_sala` and defines read-only properties
//! on it, so a config.json that carries one of their names fails in `AutoConfig.from_pretrained`
//! ("can't set attribute"). transformers ≥ 4.56 writes `dtype` and still reads `torch_dtype`.

use super::Engine;
use serde_json::Value;

/// Config keys that the engines' MiniCPM-SALA config classes define as read-only properties
/// (SGLang's `MiniCPMHybridConfig` in its upstream and SOAR-era versions, the vLLM port's
/// config): present in config.json, they make config loading fail.
pub const SALA_DERIVED_KEYS: &[&str] = &[
    "full_attention_layer_ids",
    "has_lightning_layers",
    "has_minicpm_sparse_attention",
    "has_sparse_attention",
    "layers_block_type",
    "lightning_layer_ids",
    "mamba2_cache_params",
    "num_linear_key_value_heads",
    "sparse_layer_ids",
];

/// `model_type`s for which SGLang registers a config class of its own, whose type its model code
/// checks: `auto_map.AutoConfig` would make transformers build the remote class instead.
pub const SGLANG_OWN_CONFIG: &[&str] = &["minicpm_sala"];

/// Architectures transformers implements itself (no remote code needed).
pub const TRANSFORMERS_BUILTIN: &[&str] =
    &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

pub fn model_type(config: &Value) -> Option<&str> {
    config.get("model_type").and_then(Value::as_str)
}

pub fn architecture(config: &Value) -> Option<&str> {
    config
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
}

/// The derived keys a config carries.
pub fn derived_keys(config: &Value) -> Vec<&'static str> {
    if model_type(config) != Some("minicpm_sala") {
        return vec![];
    }
    SALA_DERIVED_KEYS
        .iter()
        .copied()
        .filter(|k| config.get(*k).is_some())
        .collect()
}

/// The dtype key as the config spells it and its value: `dtype` (transformers ≥ 4.56) or
/// `torch_dtype`.
pub fn dtype_key(config: &Value) -> Option<(&'static str, String)> {
    for key in ["dtype", "torch_dtype"] {
        if let Some(v) = config.get(key).and_then(Value::as_str) {
            return Some((key, v.to_string()));
        }
    }
    None
}

/// What writing a source config for `engine` changed, for the report and the model card.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ConfigEdits {
    pub removed: Vec<String>,
    pub added: Vec<String>,
}

/// The source's config.json as `engine` needs it: derived keys removed (no engine may be given
/// them), `auto_map.AutoConfig` removed for SGLang where SGLang brings its own config class, and
/// a dtype key written when the source has none (`torch_dtype`, which every transformers version
/// reads), from the dtype of the source weights. Everything else is kept as the source has it.
/// `engine` `None` (no target engine) keeps `auto_map` whole.
pub fn engine_config(
    source: &Value,
    engine: Option<Engine>,
    weights_dtype: &str,
) -> (Value, ConfigEdits) {
    let mut cfg = source.clone();
    let mut edits = ConfigEdits::default();
    let mt = model_type(source).map(str::to_string);
    if let Some(obj) = cfg.as_object_mut() {
        for k in derived_keys(source) {
            obj.remove(k);
            edits.removed.push(k.to_string());
        }
        if engine == Some(Engine::Sglang)
            && mt
                .as_deref()
                .is_some_and(|m| SGLANG_OWN_CONFIG.contains(&m))
        {
            if let Some(map) = obj.get_mut("auto_map").and_then(Value::as_object_mut) {
                if map.remove("AutoConfig").is_some() {
                    edits.removed.push("auto_map.AutoConfig".into());
                }
            }
        }
        if dtype_key(source).is_none() {
            obj.insert("torch_dtype".into(), Value::from(weights_dtype));
            edits.added.push(format!("torch_dtype: {weights_dtype}"));
        }
    }
    (cfg, edits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn engine_config_strips_what_each_engine_refuses_and_keeps_the_rest() {
        let src = json!({"model_type": "minicpm_sala", "dtype": "bfloat16",
            "has_sparse_attention": true, "sparse_layer_ids": [0],
            "auto_map": {"AutoConfig": "c.C", "AutoModelForCausalLM": "m.M"}, "hidden_size": 8});
        let (s, e) = engine_config(&src, Some(Engine::Sglang), "bfloat16");
        assert!(s.get("has_sparse_attention").is_none() && s.get("sparse_layer_ids").is_none());
        assert!(s["auto_map"].get("AutoConfig").is_none());
        assert_eq!(s["auto_map"]["AutoModelForCausalLM"], "m.M");
        assert_eq!(s["dtype"], "bfloat16");
        assert!(s.get("torch_dtype").is_none());
        assert_eq!(s["hidden_size"], 8);
        assert_eq!(e.removed.len(), 3);
        let (t, _) = engine_config(&src, None, "bfloat16");
        assert_eq!(t["auto_map"]["AutoConfig"], "c.C");
        assert!(t.get("has_sparse_attention").is_none());
        // A Llama config keeps auto_map for SGLang too; a missing dtype key is added.
        let llama = json!({"model_type": "llama", "auto_map": {"AutoConfig": "c.C"}});
        let (l, e) = engine_config(&llama, Some(Engine::Sglang), "bfloat16");
        assert_eq!(l["auto_map"]["AutoConfig"], "c.C");
        assert_eq!(l["torch_dtype"], "bfloat16");
        assert_eq!(e.added, vec!["torch_dtype: bfloat16"]);
    }
}
