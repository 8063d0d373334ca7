//! In-memory folders for the engines' rule tables (test-only): a config, the tensors a GPTQ
//! writer would store for it (names, dtypes, shapes; no data), and a runner that checks one row
//! per finding, each in milliseconds.

use super::{check, Engine, EngineCheck, FolderView, TensorView};
use crate::checkpoint::Dtype;
use crate::format::quantized::{ModuleQuant, QuantInfo};
use crate::model::AnyConfig;
use serde_json::{json, Value};
use std::path::Path;

/// The shipped MiniCPM-SALA fixture's config (4 layers: sparse, lightning, lightning, sparse).
pub fn sala_config() -> Value {
    serde_json::from_str(include_str!("../../examples/tiny-sala/config.json")).unwrap()
}

/// A small Llama.
pub fn llama_config() -> Value {
    json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16", "hidden_act": "silu"})
}

/// `quantization_config` as `quantize` writes it (4-bit, group 128, symmetric, static order),
/// with the keys of `over` replaced (a `null` removes the key).
pub fn settings(over: Value) -> Value {
    let mut qc = json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false,
        "sym": true, "lm_head": false, "checkpoint_format": "gptq", "dynamic": {}});
    for (k, v) in over.as_object().unwrap() {
        match v {
            Value::Null => qc.as_object_mut().unwrap().remove(k),
            _ => qc.as_object_mut().unwrap().insert(k.clone(), v.clone()),
        };
    }
    qc
}

/// The folder a writer makes of `config`: every decoder Linear stored as its
/// `quantization_config` says (GPTQ `qweight`/`qzeros`/`scales`/`g_idx`, Marlin `B`/`s`, or
/// `weight` where a `-:` rule keeps it), everything else BF16.
pub fn folder(config: Value) -> FolderView {
    let cfg = AnyConfig::from_json(&config.to_string()).unwrap();
    let quant = config
        .get("quantization_config")
        .map(|q| QuantInfo::from_json(q.clone(), Path::new("config.json"), true).unwrap());
    let mut v = FolderView {
        label: "the folder".into(),
        config,
        files: ["config.json".to_string()].into(),
        ..Default::default()
    };
    for (name, shape) in cfg.expected_tensors() {
        let linear = name.starts_with("model.layers.") && shape.len() == 2;
        let module = name.strip_suffix(".weight").filter(|_| linear);
        match (&quant, module) {
            (Some(q), Some(p)) => match q.module_settings(p) {
                Some(s) => store(&mut v, p, &shape, s, q.format.checkpoint_format()),
                None => put(&mut v, &name, Dtype::BF16, &shape),
            },
            _ => put(&mut v, &name, Dtype::BF16, &shape),
        }
    }
    v
}

/// Adds one tensor.
pub fn put(v: &mut FolderView, name: &str, dtype: Dtype, shape: &[usize]) {
    let t = TensorView {
        dtype,
        shape: shape.to_vec(),
    };
    v.tensors.insert(name.to_string(), t);
}

/// One Linear `p` with `[N, K]` stored quantized.
fn store(v: &mut FolderView, p: &str, shape: &[usize], s: ModuleQuant, format: &str) {
    let (n, k, b) = (shape[0], shape[1], s.bits as usize);
    let g = s.group_size.columns().map_or(1, |g| k / g);
    if format == "marlin" {
        put(v, &format!("{p}.B"), Dtype::I32, &[k / 16, 2 * n]);
        put(v, &format!("{p}.s"), Dtype::F16, &[g, n]);
        return;
    }
    put(v, &format!("{p}.qweight"), Dtype::I32, &[k * b / 32, n]);
    put(v, &format!("{p}.qzeros"), Dtype::I32, &[g, n * b / 32]);
    put(v, &format!("{p}.scales"), Dtype::F16, &[g, n]);
    put(v, &format!("{p}.g_idx"), Dtype::I32, &[k]);
}

/// `config` with `quantization_config` built from `over` (see [`settings`]), stored.
pub fn quantized(mut config: Value, over: Value) -> FolderView {
    config["quantization_config"] = settings(over);
    folder(config)
}

/// The MiniCPM-SALA fixture quantized for SGLang (4-bit, group 128).
pub fn sala() -> FolderView {
    quantized(sala_config(), json!({}))
}

/// The Llama quantized (4-bit, group 128).
pub fn llama() -> FolderView {
    quantized(llama_config(), json!({}))
}

/// MiniCPM-SALA's remote code as the hub ships it: `auto_map` and the files it names.
pub fn with_remote_code(v: &mut FolderView) {
    v.config["auto_map"] = json!({
        "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
        "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM"
    });
    for f in ["configuration_minicpm_sala.py", "modeling_minicpm_sala.py"] {
        v.files.insert(f.to_string());
        v.texts.insert(f.to_string(), "import torch\n".to_string());
    }
}

/// MiniCPM-SALA after pack-marlin (`B`/`s` tiles, checkpoint_format marlin).
pub fn sala_marlin() -> FolderView {
    quantized(sala_config(), json!({"checkpoint_format": "marlin"}))
}

/// MiniCPM-SALA with `intermediate_size` 704: `down_proj`'s in_features are no multiple of
/// 128 (nor of the group size), beyond gptq_marlin's shapes.
pub fn sala_odd() -> FolderView {
    let mut c = sala_config();
    c["intermediate_size"] = json!(704);
    quantized(c, json!({}))
}

/// A Llama whose `hidden_size` (192) is no multiple of 128: beyond gptq_marlin's shapes.
pub fn llama_odd() -> FolderView {
    let mut c = llama_config();
    c["hidden_size"] = json!(192);
    c["num_attention_heads"] = json!(3);
    c["num_key_value_heads"] = json!(1);
    quantized(c, json!({}))
}

/// The Llama with every `self_attn.o_proj` kept in 16 bits by a `-:` rule.
pub fn llama_skip_o() -> FolderView {
    quantized(
        llama_config(),
        json!({"dynamic": {r"-:.*self_attn\.o_proj": {}}}),
    )
}

/// The Llama with a `-:` rule on layer 0's `k_proj` alone (a member name: the fused group
/// split).
pub fn llama_skip_k() -> FolderView {
    quantized(
        llama_config(),
        json!({"dynamic": {r"-:model\.layers\.0\.self_attn\.k_proj": {}}}),
    )
}

/// The Llama with layer 0's `down_proj` at 3 bits by a `+:` rule.
pub fn llama_plus3() -> FolderView {
    quantized(
        llama_config(),
        json!({"dynamic": {r"+:model\.layers\.0\.mlp\.down_proj": {"bits": 3}}}),
    )
}

/// The `quantization_config` of a view, to edit.
pub fn qc(v: &mut FolderView) -> &mut Value {
    &mut v.config["quantization_config"]
}

/// Where a row's fragment must appear.
#[derive(Debug, Clone, Copy)]
pub enum In {
    Problem,
    Warning,
    Note,
    /// The method summary (`20 gptq_marlin`).
    Linears,
    /// The serve command.
    Serve,
    MissingTensors,
    UnusedTensors,
}

/// One finding: a folder, an edit, the engine, and what the check must say (whether the engine
/// loads the folder, and a fragment of one of its answers).
pub struct Row {
    name: &'static str,
    engine: Engine,
    base: fn() -> FolderView,
    edit: fn(&mut FolderView),
    legacy_marlin: bool,
    loads: bool,
    place: In,
    fragment: &'static str,
}

impl Row {
    /// The folder `base` makes, as `engine` loads it.
    pub fn new(name: &'static str, engine: Engine, base: fn() -> FolderView) -> Self {
        Self {
            name,
            engine,
            base,
            edit: |_| {},
            legacy_marlin: false,
            loads: true,
            place: In::Linears,
            fragment: "",
        }
    }

    /// Changes the folder first.
    pub fn edit(self, edit: fn(&mut FolderView)) -> Self {
        Self { edit, ..self }
    }

    /// Checked as a release with the legacy `marlin` method.
    pub fn legacy(self) -> Self {
        Self {
            legacy_marlin: true,
            ..self
        }
    }

    /// The engine loads the folder, and `fragment` is in `place`.
    pub fn loads(self, place: In, fragment: &'static str) -> Self {
        Self {
            loads: true,
            place,
            fragment,
            ..self
        }
    }

    /// The engine would not load the folder, and `fragment` is in `place`.
    pub fn fails(self, place: In, fragment: &'static str) -> Self {
        Self {
            loads: false,
            place,
            fragment,
            ..self
        }
    }

    fn texts(&self, c: &EngineCheck) -> Vec<String> {
        let what = |f: &[super::Finding]| -> Vec<String> {
            f.iter()
                .map(|f| format!("{} (fix: {})", f.what, f.fix))
                .collect()
        };
        match self.place {
            In::Problem => what(&c.problems),
            In::Warning => what(&c.warnings),
            In::Note => c.notes.clone(),
            In::Linears => vec![c.method_summary()],
            In::Serve => c.serve.clone().into_iter().collect(),
            In::MissingTensors => c.missing_tensors.clone(),
            In::UnusedTensors => c.unused_tensors.clone(),
        }
    }

    /// The check's whole answer for this row.
    fn check(&self) -> EngineCheck {
        let mut v = (self.base)();
        (self.edit)(&mut v);
        check(&v, self.engine, self.legacy_marlin).unwrap()
    }

    /// What is wrong with the check's answer for this row, if anything.
    fn failure(&self) -> Option<String> {
        let c = self.check();
        let found = self.texts(&c).iter().any(|t| t.contains(self.fragment));
        (c.loads != self.loads || !found).then(|| {
            format!(
                "{} ({}): loads {} (expected {}), {:?} {:?} {}\n  problems {:?}\n  warnings \
                 {:?}\n  notes {:?}\n  linears {}",
                self.name,
                self.engine.name(),
                c.loads,
                self.loads,
                self.place,
                self.fragment,
                if found { "found" } else { "NOT found" },
                c.problems,
                c.warnings,
                c.notes,
                c.method_summary()
            )
        })
    }
}

/// Runs every row of the table `table` and fails with all the rows that disagree. With
/// `ENGINE_RULES_SNAPSHOT=DIR` it also writes every row's whole answer (the `inspect --engine
/// --json` object) to `DIR/<table>.json`: the same files before and after a change prove that
/// the change kept every output.
pub fn run(table: &str, rows: &[Row]) {
    if let Some(dir) = std::env::var_os("ENGINE_RULES_SNAPSHOT") {
        let all: Vec<Value> = rows
            .iter()
            .map(|r| json!({"row": r.name, "check": r.check()}))
            .collect();
        let path = Path::new(&dir).join(format!("{table}.json"));
        std::fs::write(path, serde_json::to_string_pretty(&all).unwrap()).unwrap();
    }
    let failures: Vec<String> = rows.iter().filter_map(Row::failure).collect();
    assert!(
        failures.is_empty(),
        "{} of {} rows:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}
