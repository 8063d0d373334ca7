//! What the engines require of `config.json` and the files beside it: remote code named by
//! `auto_map`, config keys that the engines' own config classes derive (and refuse to be given),
//! and the dtype key; the rules that check them ([`check_config`], [`sala_dtype`]), each engine's
//! part read from its `Rules`. Also the one place that rewrites a source config for an engine
//! ([`engine_config`]), so that the writer and the check agree by construction.
//!
//! Facts (docs/engines.md has the sources): SGLang registers
//! its own `MiniCPMHybridConfig` for `model_type: minicpm_sala` and defines read-only properties
//! on it, so a config.json that carries one of their names fails in `AutoConfig.from_pretrained`
//! ("can't set attribute"). transformers ≥ 4.56 writes `dtype` and still reads `torch_dtype`.

use super::rules::Rules;
use super::{Engine, Findings, FolderView};
use crate::source::remote_code;
use serde_json::Value;

/// MiniCPM-SALA's architecture name.
pub const SALA_ARCHITECTURE: &str = "MiniCPMSALAForCausalLM";

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

/// The config rules of an engine (`rules`) on `view`: derived keys, then `auto_map` (code in
/// other repos, its own config class, the remote-code files the folder lacks, the model code).
/// Returns the remote-code files the folder needs.
pub(super) fn check_config(view: &FolderView, rules: &Rules, f: &mut Findings) -> Vec<String> {
    let config = &view.config;
    let derived = derived_keys(config);
    if !derived.is_empty() {
        let what = format!(
            "config.json carries {derived:?}, which SGLang's MiniCPMHybridConfig defines as \
             read-only properties: AutoConfig.from_pretrained fails with \"can't set attribute\""
        );
        let fix = "remove those keys from config.json (quantize and pack-marlin never write them)";
        f.push(rules.derived_keys_fatal, super::Finding::new(&what, fix));
    }
    let mut refs = remote_code::auto_map_refs("config.json", config);
    if let Some(t) = &view.tokenizer_config {
        refs.extend(remote_code::auto_map_refs("tokenizer_config.json", t));
    }
    for r in refs.iter().filter(|r| r.module_file.is_none()) {
        f.note(&format!(
            "{} auto_map.{} is {:?}: code from another hub repo, fetched by the engine with \
             trust_remote_code",
            r.file, r.class_key, r.reference
        ));
    }
    let (needed, missing) = remote_code::remote_code_closure(&refs, &view.files, &view.texts);
    let has = |key: &str| {
        refs.iter()
            .any(|r| r.file == "config.json" && r.class_key == key)
    };
    let auto_config = has("AutoConfig");
    own_config_class(config, rules, auto_config, f);
    for (file, why) in &missing {
        missing_code(file, why, rules, auto_config, f);
    }
    if rules.needs_model_code {
        model_code(config, auto_config, has("AutoModelForCausalLM"), f);
    }
    needed
}

/// `auto_map.AutoConfig` makes transformers build the remote config class where the engine
/// needs its own.
fn own_config_class(config: &Value, rules: &Rules, auto_config: bool, f: &mut Findings) {
    let model_type = model_type(config).unwrap_or("");
    if rules.own_config_class && SGLANG_OWN_CONFIG.contains(&model_type) && auto_config {
        f.problem(
            &format!(
                "config.json's auto_map has AutoConfig: with --trust-remote-code transformers \
                 builds the remote config class, while SGLang's hybrid linear-attention and \
                 sparse backends need its own MiniCPMHybridConfig for model_type {model_type}"
            ),
            "remove auto_map.AutoConfig from config.json (quantize --engine sglang writes it so)",
        );
    }
}

/// A remote-code file the folder lacks (`why`: what needs it): fatal where the engine imports
/// it (every file for transformers; the tokenizer's and the config class's for the others).
fn missing_code(file: &str, why: &str, rules: &Rules, auto_config: bool, f: &mut Findings) {
    let tokenizer = why.starts_with("tokenizer_config.json");
    let fatal =
        rules.imports_all_remote_code || tokenizer || (auto_config && why.contains("AutoConfig"));
    let what = format!(
        "{file} is missing (needed by {why}): loading with trust_remote_code fails with \"does \
         not appear to have a file named {file}\""
    );
    let fix = "copy the source's remote-code files into the folder (quantize and pack-marlin \
               copy every *.py of the source)";
    f.push(fatal, super::Finding::new(&what, fix));
}

/// An architecture transformers does not build needs `auto_map`'s AutoConfig and
/// AutoModelForCausalLM.
fn model_code(config: &Value, auto_config: bool, auto_model: bool, f: &mut Findings) {
    let arch = architecture(config);
    if TRANSFORMERS_BUILTIN.contains(&arch.unwrap_or("")) || (auto_config && auto_model) {
        return;
    }
    f.problem(
        &format!(
            "transformers has no built-in {} and config.json's auto_map lacks {}: \
             AutoModelForCausalLM cannot find the model code",
            arch.unwrap_or("architecture"),
            if auto_config {
                "AutoModelForCausalLM"
            } else {
                "AutoConfig"
            }
        ),
        "keep the source's auto_map and remote-code files (quantize --engine transformers keeps \
         them)",
    );
}

/// MiniCPM-SALA runs in BF16 only: where `--dtype auto` makes float16 of a missing or float32
/// dtype (and serves any other as written), config.json must say bfloat16.
pub(super) fn sala_dtype(config: &Value, rules: &Rules, sala: bool, f: &mut Findings) {
    let dtype = dtype_key(config);
    let name = dtype.as_ref().map(|(_, v)| v.as_str());
    if !(sala && rules.dtype_auto_float16) || name == Some("bfloat16") {
        return;
    }
    f.problem(
        &format!(
            "config.json's dtype is {}: SGLang serves {} activations, and MiniCPM-SALA's sparse \
             attention runs BF16 only (float16 crashed with \"query and key must have the same \
             dtype\")",
            name.map_or("absent (torch_dtype/dtype)".to_string(), |v| v.to_string()),
            if name.is_none() || name == Some("float32") {
                "float16 (SGLang's --dtype auto turns a missing or float32 dtype into float16)"
            } else {
                "those"
            }
        ),
        "keep the source's \"dtype\": \"bfloat16\" (or torch_dtype) in config.json",
    );
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
