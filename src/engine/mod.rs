//! Will the serving engine load it? A load-time emulation of SGLang, vLLM and transformers for
//! the architectures this tool writes (MiniCPM-SALA and the Llama family), run by `inspect
//! --engine` and by `quantize` / `pack-marlin` on their own output before it is committed.
//!
//! The check reads only what the engines read at load: `config.json` (architecture, config
//! keys, `auto_map` and the remote-code files it names, the dtype key, `quantization_config`
//! with its `dynamic` rules), `tokenizer_config.json`'s `auto_map`, and the names, dtypes and
//! shapes of the tensors in the shards. [`loader`] builds the engine's module set and compares
//! it with the tensors; [`config`] holds the config rules, and also rewrites a source config
//! for an engine ([`config::engine_config`]), so the writer and the check cannot disagree.
//! Every rule and its source (file and function of the engine) is in docs/engines.md.

pub mod config;
pub mod loader;
#[cfg(test)]
mod testkit;

use crate::checkpoint::{Checkpoint, Dtype};
use crate::format::quantized::{dynamic_key_order, QuantInfo};
use crate::model::AnyConfig;
use crate::source::remote_code;
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

pub use loader::{EngineModule, Method};

/// A serving engine whose loader is emulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Sglang,
    Vllm,
    Transformers,
}

impl Engine {
    pub const ALL: [Engine; 3] = [Engine::Sglang, Engine::Vllm, Engine::Transformers];

    /// The name `--engine` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sglang => "sglang",
            Self::Vllm => "vllm",
            Self::Transformers => "transformers",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Sglang => "SGLang",
            Self::Vllm => "vLLM",
            Self::Transformers => "transformers",
        }
    }
}

/// One thing that would go wrong (or is worth knowing), and what to do about it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub what: String,
    pub fix: String,
}

impl Finding {
    pub fn new(what: &str, fix: &str) -> Self {
        Self {
            what: what.to_string(),
            fix: fix.to_string(),
        }
    }
}

/// A tensor as the loader sees it: dtype and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorView {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// What an engine reads of a model folder at load time. Built from a folder on disk
/// ([`FolderView::from_dir`]) or from the plan of one that is about to be written, so a run can be
/// checked before any work is done.
#[derive(Debug, Clone, Default)]
pub struct FolderView {
    /// The folder, for messages.
    pub label: String,
    /// `config.json` (`Null` when absent).
    pub config: Value,
    /// `quantize_config.json` when present.
    pub quantize_config: Option<Value>,
    /// `tokenizer_config.json` when present and valid JSON.
    pub tokenizer_config: Option<Value>,
    pub tensors: BTreeMap<String, TensorView>,
    /// Names of the files at the top of the folder.
    pub files: BTreeSet<String>,
    /// Contents of its `*.py` files (relative imports are followed through them).
    pub texts: BTreeMap<String, String>,
    /// The keys of `quantization_config.dynamic` in the order config.json lists them (the first
    /// matching rule wins); empty means the order of `config`.
    pub dynamic_order: Vec<String>,
}

impl FolderView {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let mut files = BTreeSet::new();
        for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
            let e = e?;
            if e.path().is_file() {
                files.insert(e.file_name().to_string_lossy().into_owned());
            }
        }
        let json = |name: &str| -> Result<Option<Value>> {
            if !files.contains(name) {
                return Ok(None);
            }
            let p = dir.join(name);
            let text = std::fs::read_to_string(&p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            Ok(Some(serde_json::from_str(&text).with_context(|| {
                format!("{} is not valid JSON", p.display())
            })?))
        };
        let config = json("config.json")?.unwrap_or(Value::Null);
        let dynamic_order = match files.contains("config.json") {
            true => dynamic_key_order(&std::fs::read_to_string(dir.join("config.json"))?),
            false => vec![],
        };
        let quantize_config = json("quantize_config.json")?;
        let tokenizer_config = json("tokenizer_config.json")?;
        let mut texts = BTreeMap::new();
        for f in files.iter().filter(|f| f.ends_with(".py")) {
            let p = dir.join(f);
            let bytes =
                std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
            texts.insert(f.clone(), String::from_utf8_lossy(&bytes).into_owned());
        }
        let ck = Checkpoint::open(dir)?;
        let tensors = ck
            .entries()
            .map(|(n, e)| {
                (
                    n.clone(),
                    TensorView {
                        dtype: e.dtype,
                        shape: e.shape.clone(),
                    },
                )
            })
            .collect();
        Ok(Self {
            label: dir.display().to_string(),
            config,
            quantize_config,
            tokenizer_config,
            tensors,
            files,
            texts,
            dynamic_order,
        })
    }

    /// The quantization settings the engines read: `config.json`'s `quantization_config`.
    fn quant_info(&self) -> Result<Option<QuantInfo>> {
        match self.config.get("quantization_config") {
            None | Some(Value::Null) => Ok(None),
            Some(q) => {
                let mut info = QuantInfo::from_json(
                    q.clone(),
                    &Path::new(&self.label).join("config.json"),
                    true,
                )?;
                info.order_rules(&self.dynamic_order);
                Ok(Some(info))
            }
        }
    }
}

/// One engine's verdict on a folder.
#[derive(Debug, Clone, Serialize)]
pub struct EngineCheck {
    pub engine: Engine,
    pub architecture: Option<String>,
    /// Whether the engine would load the folder and serve it correctly.
    pub loads: bool,
    /// Why it would not (each fatal), with the fix.
    pub problems: Vec<Finding>,
    pub warnings: Vec<Finding>,
    pub notes: Vec<String>,
    /// The Linears the engine builds and the method each gets.
    pub modules: Vec<EngineModule>,
    /// Tensors the engine would load that the shards lack.
    pub missing_tensors: Vec<String>,
    /// Tensors in the shards the engine builds no parameter for.
    pub unused_tensors: Vec<String>,
    /// Remote-code files the folder needs (auto_map and their relative imports).
    pub remote_code: Vec<String>,
    /// A command line that serves the folder, when it loads.
    pub serve: Option<String>,
    /// Checked as a release that still has the legacy `marlin` method would load it.
    pub legacy_marlin: bool,
    /// The engine must be told `--dtype float16` (plain gptq kernels with a bfloat16 config).
    pub needs_float16: bool,
    /// SGLang must be told `--quantization gptq` (Linears beyond gptq_marlin's shape limits).
    pub needs_plain_gptq: bool,
}

impl EngineCheck {
    /// Methods and how many Linears get each, e.g. `192 gptq_marlin, 8 unquantized`.
    pub fn method_summary(&self) -> String {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for m in &self.modules {
            *counts.entry(m.method.name()).or_default() += 1;
        }
        counts
            .iter()
            .map(|(m, n)| format!("{n} {m}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn print_text(&self) {
        let verdict = if self.loads { "loads" } else { "would FAIL" };
        crate::outln!(
            "engine         {} {verdict}{}",
            self.engine.label(),
            if self.legacy_marlin {
                " (as a release with the legacy marlin method)"
            } else {
                ""
            }
        );
        if !self.modules.is_empty() {
            crate::outln!("  linears      {}", self.method_summary());
        }
        if !self.remote_code.is_empty() {
            crate::outln!("  remote code  {}", self.remote_code.join(", "));
        }
        for p in &self.problems {
            crate::outln!("  problem      {}", p.what);
            crate::outln!("    fix        {}", p.fix);
        }
        for w in &self.warnings {
            crate::outln!("  warning      {}", w.what);
            crate::outln!("    fix        {}", w.fix);
        }
        for n in &self.notes {
            crate::outln!("  note         {n}");
        }
        if let Some(s) = &self.serve {
            crate::outln!("  serve with   {s}");
        }
    }

    /// The command that serves the folder once it sits at `dir` (`None` when it does not load).
    pub fn serve_at(&self, dir: &str) -> Option<String> {
        let arch = self.architecture.as_deref().unwrap_or("");
        self.loads.then(|| {
            let cmd = serve_command(
                self.engine,
                arch == "MiniCPMSALAForCausalLM",
                !config::TRANSFORMERS_BUILTIN.contains(&arch),
                dir,
            );
            let mut cmd = cmd;
            if self.needs_plain_gptq {
                cmd.push_str(" --quantization gptq");
            }
            if self.needs_float16 {
                cmd.push_str(" --dtype float16");
            }
            cmd
        })
    }

    /// The problems as one error message, for commands that refuse to finish.
    pub fn error_text(&self, dir: &str) -> String {
        let lines: Vec<String> = self
            .problems
            .iter()
            .map(|p| format!("  - {} (fix: {})", p.what, p.fix))
            .collect();
        format!(
            "{} would not load {dir}:\n{}",
            self.engine.label(),
            lines.join("\n")
        )
    }
}

/// One engine's verdict in brief, for `inspect` without `--engine`.
#[derive(Debug, Clone, Serialize)]
pub struct LoadSummary {
    pub engine: Engine,
    pub loads: bool,
    /// What would go wrong (the fixes are in `inspect --engine`).
    pub problems: Vec<String>,
}

/// Every engine's verdict on `dir` in brief.
pub fn summaries(dir: &Path) -> Result<Vec<LoadSummary>> {
    let view = FolderView::from_dir(dir)?;
    Engine::ALL
        .iter()
        .map(|&e| {
            let c = check(&view, e, false)?;
            Ok(LoadSummary {
                engine: e,
                loads: c.loads,
                problems: c.problems.into_iter().map(|p| p.what).collect(),
            })
        })
        .collect()
}

/// Prints the summaries as `inspect` does.
pub fn print_summaries(s: &[LoadSummary], dir: &str) {
    for (i, x) in s.iter().enumerate() {
        let head = if i == 0 { "serving" } else { "" };
        if x.loads {
            crate::outln!("{head:<14} {} loads it", x.engine.label());
        } else {
            let first = x.problems.first().map(String::as_str).unwrap_or("");
            let short: String = first.chars().take(110).collect();
            crate::outln!(
                "{head:<14} {} would fail: {short}{}{}",
                x.engine.label(),
                if short.len() < first.len() { "..." } else { "" },
                if x.problems.len() > 1 {
                    format!(" (+{} more)", x.problems.len() - 1)
                } else {
                    String::new()
                }
            );
        }
    }
    if !s.is_empty() {
        crate::outln!(
            "{:<14} (inspect {dir} --engine sglang|vllm|transformers: the full check, with fixes)",
            ""
        );
    }
}

/// The model folder `dir` as `engine` would load it.
pub fn check_dir(dir: &Path, engine: Engine, legacy_marlin: bool) -> Result<EngineCheck> {
    let view = FolderView::from_dir(dir)?;
    check(&view, engine, legacy_marlin)
}

/// `view` as `engine` would load it (see the module docs).
pub fn check(view: &FolderView, engine: Engine, legacy_marlin: bool) -> Result<EngineCheck> {
    let mut problems = vec![];
    let mut warnings = vec![];
    let mut notes = vec![];
    let cfg_json = &view.config;
    let arch = config::architecture(cfg_json).map(str::to_string);
    let model_type = config::model_type(cfg_json).unwrap_or("");
    let is_sala = arch.as_deref() == Some("MiniCPMSALAForCausalLM");

    let mut out = EngineCheck {
        engine,
        architecture: arch.clone(),
        loads: false,
        problems: vec![],
        warnings: vec![],
        notes: vec![],
        modules: vec![],
        missing_tensors: vec![],
        unused_tensors: vec![],
        remote_code: vec![],
        serve: None,
        legacy_marlin,
        needs_float16: false,
        needs_plain_gptq: false,
    };
    if cfg_json.is_null() {
        problems.push(Finding::new(
            &format!("{} has no config.json", view.label),
            "every engine starts from config.json: copy the source's",
        ));
        out.problems = problems;
        return Ok(out);
    }
    if engine == Engine::Vllm && is_sala {
        problems.push(Finding::new(
            "vLLM has no MiniCPM-SALA implementation in any release (checked up to 0.34.0; \
             the ports in PRs #44095 and #48999 are not merged), so it cannot build \
             MiniCPMSALAForCausalLM",
            "serve MiniCPM-SALA with SGLang (--engine sglang)",
        ));
        out.problems = problems;
        return Ok(out);
    }

    // Config keys the engine's config class derives itself.
    let derived = config::derived_keys(cfg_json);
    if !derived.is_empty() {
        let f = Finding::new(
            &format!(
                "config.json carries {derived:?}, which SGLang's MiniCPMHybridConfig defines as \
                 read-only properties: AutoConfig.from_pretrained fails with \"can't set \
                 attribute\""
            ),
            "remove those keys from config.json (quantize and pack-marlin never write them)",
        );
        match engine {
            Engine::Sglang => problems.push(f),
            _ => warnings.push(f),
        }
    }

    // Remote code.
    let mut refs = remote_code::auto_map_refs("config.json", cfg_json);
    if let Some(t) = &view.tokenizer_config {
        refs.extend(remote_code::auto_map_refs("tokenizer_config.json", t));
    }
    for r in refs.iter().filter(|r| r.module_file.is_none()) {
        notes.push(format!(
            "{} auto_map.{} is {:?}: code from another hub repo, fetched by the engine with \
             trust_remote_code",
            r.file, r.class_key, r.reference
        ));
    }
    let (needed, missing_code) = remote_code::remote_code_closure(&refs, &view.files, &view.texts);
    out.remote_code = needed;
    let sglang_own = config::SGLANG_OWN_CONFIG.contains(&model_type);
    let has_auto_config = refs
        .iter()
        .any(|r| r.file == "config.json" && r.class_key == "AutoConfig");
    if engine == Engine::Sglang && sglang_own && has_auto_config {
        problems.push(Finding::new(
            &format!(
                "config.json's auto_map has AutoConfig: with --trust-remote-code transformers \
                 builds the remote config class, while SGLang's hybrid linear-attention and \
                 sparse backends need its own MiniCPMHybridConfig for model_type {model_type}"
            ),
            "remove auto_map.AutoConfig from config.json (quantize --engine sglang writes it so)",
        ));
    }
    for (file, why) in &missing_code {
        let tokenizer = why.starts_with("tokenizer_config.json");
        let fatal = match engine {
            Engine::Transformers => true,
            _ => tokenizer || (has_auto_config && why.contains("AutoConfig")),
        };
        let f = Finding::new(
            &format!(
                "{file} is missing (needed by {why}): loading with trust_remote_code fails with \
                 \"does not appear to have a file named {file}\""
            ),
            "copy the source's remote-code files into the folder (quantize and pack-marlin copy \
             every *.py of the source)",
        );
        if fatal {
            problems.push(f);
        } else {
            warnings.push(f);
        }
    }
    let builtin = config::TRANSFORMERS_BUILTIN.contains(&arch.as_deref().unwrap_or(""));
    if engine == Engine::Transformers && !builtin {
        let has_model = refs
            .iter()
            .any(|r| r.file == "config.json" && r.class_key == "AutoModelForCausalLM");
        if !(has_auto_config && has_model) {
            problems.push(Finding::new(
                &format!(
                    "transformers has no built-in {} and config.json's auto_map lacks {}: \
                     AutoModelForCausalLM cannot find the model code",
                    arch.as_deref().unwrap_or("architecture"),
                    if has_auto_config {
                        "AutoModelForCausalLM"
                    } else {
                        "AutoConfig"
                    }
                ),
                "keep the source's auto_map and remote-code files (quantize --engine \
                 transformers keeps them)",
            ));
        }
    }

    // The architecture's module set.
    let cfg = match AnyConfig::from_json(&cfg_json.to_string()) {
        Ok(c) => c,
        Err(e) => {
            problems.push(Finding::new(
                &format!("config.json cannot be read as a supported architecture: {e:#}"),
                "this check covers MiniCPM-SALA and the Llama family",
            ));
            out.problems = problems;
            out.warnings = warnings;
            out.notes = notes;
            return Ok(out);
        }
    };
    let quant = match view.quant_info() {
        Ok(q) => q,
        Err(e) => {
            problems.push(Finding::new(
                &format!("the quantization settings cannot be read: {e:#}"),
                "fix quantization_config in config.json",
            ));
            None
        }
    };
    let has_quantized_tensors = view.tensors.values().any(|t| !t.dtype.is_float());
    if quant.is_none() && has_quantized_tensors {
        problems.push(Finding::new(
            "the shards hold quantized (integer) tensors but config.json has no \
             quantization_config: the engines detect the method from config.json only and \
             would build unquantized Linears",
            "put the quantization settings into config.json as quantization_config",
        ));
    }
    let emu = loader::emulate(view, &cfg, quant.as_ref(), engine, legacy_marlin);

    // Activation dtype.
    let dtype = config::dtype_key(cfg_json);
    let dtype_name = dtype.as_ref().map(|(_, v)| v.as_str());
    let uses = |m: Method| emu.modules.iter().any(|x| x.method == m);
    if is_sala && engine == Engine::Sglang {
        match dtype_name {
            Some("bfloat16") => {}
            other => problems.push(Finding::new(
                &format!(
                    "config.json's dtype is {}: SGLang serves {} activations, and MiniCPM-SALA's \
                     sparse attention runs BF16 only (float16 crashed with \"query and key must \
                     have the same dtype\")",
                    other.map_or("absent (torch_dtype/dtype)".to_string(), |v| v.to_string()),
                    if other.is_none() || other == Some("float32") {
                        "float16 (SGLang's --dtype auto turns a missing or float32 dtype into \
                         float16)"
                    } else {
                        "those"
                    }
                ),
                "keep the source's \"dtype\": \"bfloat16\" (or torch_dtype) in config.json",
            )),
        }
    }
    let serves_bf16 = matches!(dtype_name, Some("bfloat16"));
    // (A Marlin-format folder falls back to plain gptq in current releases; that finding says so.)
    let marlin_format = quant
        .as_ref()
        .is_some_and(|q| q.format == crate::format::quantized::QuantFormat::Marlin);
    let fp16_only = engine == Engine::Sglang && uses(Method::Gptq) && serves_bf16 && !marlin_format;
    if fp16_only {
        let f = Finding::new(
            "SGLang's plain gptq kernels take float16 activations only, and config.json says \
             bfloat16: the engine refuses (\"torch.bfloat16 is not supported for quantization \
             method gptq\")",
            if is_sala {
                "re-quantize with settings gptq_marlin runs (4 or 8 bits, symmetric, group size \
                 -1/32/64/128): MiniCPM-SALA must be served in BF16"
            } else {
                "serve with --dtype float16, or re-quantize for gptq_marlin (4 or 8 bits, \
                 symmetric, group size -1/32/64/128)"
            },
        );
        // MiniCPM-SALA must run in BF16; the other families can be served in float16.
        if is_sala {
            problems.push(f);
        } else {
            warnings.push(f);
        }
    }
    if legacy_marlin && uses(Method::MarlinLegacy) {
        notes.push(
            "the legacy marlin method exists only in vLLM ≤ 0.10.1.1 (and in SGLang with such a \
             vLLM installed), with float16 activations: no current SGLang or vLLM release reads \
             checkpoint_format marlin"
                .to_string(),
        );
    }
    if uses(Method::GptqMarlin) {
        notes.push(
            "gptq_marlin repacks qweight to Marlin tiles at load (CUDA, compute capability ≥ 8.0)"
                .to_string(),
        );
    }
    if engine == Engine::Transformers && quant.is_some() {
        notes.push(
            "transformers loads GPTQ through optimum and gptqmodel (pip install optimum \
             gptqmodel)"
                .to_string(),
        );
    }
    if let Some(f) = emu.shape_limit {
        // MiniCPM-SALA must run BF16, which the plain gptq kernels cannot.
        if is_sala || engine != Engine::Sglang {
            problems.push(f);
        } else {
            warnings.push(f);
            out.needs_plain_gptq = true;
        }
    }
    problems.extend(emu.problems);
    warnings.extend(emu.warnings);
    out.loads = problems.is_empty();
    out.needs_float16 = (fp16_only || out.needs_plain_gptq) && !is_sala;
    out.serve = out.serve_at(&view.label);
    out.modules = emu.modules;
    out.missing_tensors = emu.missing;
    out.unused_tensors = emu.unused;
    out.problems = problems;
    out.warnings = warnings;
    out.notes = notes;
    Ok(out)
}

/// A command line that serves `dir` with `engine`.
pub fn serve_command(engine: Engine, sala: bool, remote_code: bool, dir: &str) -> String {
    match engine {
        Engine::Sglang if sala => format!(
            "python3 -m sglang.launch_server --model-path {dir} --trust-remote-code --dtype \
             bfloat16 --disable-radix-cache"
        ),
        Engine::Sglang => format!(
            "python3 -m sglang.launch_server --model-path {dir}{}",
            if remote_code {
                " --trust-remote-code"
            } else {
                ""
            }
        ),
        Engine::Vllm => format!(
            "vllm serve {dir}{}",
            if remote_code {
                " --trust-remote-code"
            } else {
                ""
            }
        ),
        Engine::Transformers => format!(
            "python3 -c \"from transformers import AutoModelForCausalLM; \
             AutoModelForCausalLM.from_pretrained('{dir}', device_map='auto'{})\"",
            if remote_code {
                ", trust_remote_code=True"
            } else {
                ""
            }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::Engine::{Sglang, Transformers, Vllm};
    use crate::checkpoint::Dtype;
    use serde_json::json;

    fn row(
        name: &'static str,
        engine: super::Engine,
        base: fn() -> super::FolderView,
        edit: fn(&mut super::FolderView),
        loads: bool,
        place: In,
        fragment: &'static str,
    ) -> Row {
        Row {
            name,
            engine,
            base,
            edit,
            legacy_marlin: false,
            loads,
            place,
            fragment,
        }
    }

    /// A Llama whose `hidden_size` (192) is no multiple of 128: beyond gptq_marlin's shapes.
    fn llama_odd() -> super::FolderView {
        let mut c = llama_config();
        c["hidden_size"] = json!(192);
        c["num_attention_heads"] = json!(3);
        c["num_key_value_heads"] = json!(1);
        quantized(c, json!({}))
    }

    /// MiniCPM-SALA with `intermediate_size` 704: `down_proj`'s in_features are no multiple of
    /// 128.
    fn sala_odd() -> super::FolderView {
        let mut c = sala_config();
        c["intermediate_size"] = json!(704);
        quantized(c, json!({}))
    }

    /// MiniCPM-SALA after pack-marlin (`B`/`s` tiles, checkpoint_format marlin).
    fn sala_marlin() -> super::FolderView {
        quantized(sala_config(), json!({"checkpoint_format": "marlin"}))
    }

    /// The Llama with `self_attn.o_proj` kept in 16 bits by a `-:` rule.
    fn llama_skip_o() -> super::FolderView {
        quantized(
            llama_config(),
            json!({"dynamic": {r"-:.*self_attn\.o_proj": {}}}),
        )
    }

    /// The Llama with `-:` on layer 0's `k_proj` alone (a fused group split).
    fn llama_skip_k() -> super::FolderView {
        quantized(
            llama_config(),
            json!({"dynamic": {r"-:model\.layers\.0\.self_attn\.k_proj": {}}}),
        )
    }

    /// The Llama with layer 0's `down_proj` at 3 bits by a `+:` rule.
    fn llama_plus3() -> super::FolderView {
        quantized(
            llama_config(),
            json!({"dynamic": {r"+:model\.layers\.0\.mlp\.down_proj": {"bits": 3}}}),
        )
    }

    #[test]
    fn every_finding() {
        let rows = vec![
            row("good SALA", Sglang, sala, keep, true, In::Linears, "20 gptq_marlin"),
            row("good SALA", Sglang, sala, keep, true, In::Note, "gptq_marlin repacks"),
            row(
                "good SALA",
                Sglang,
                sala,
                keep,
                true,
                In::Serve,
                "--trust-remote-code --dtype bfloat16 --disable-radix-cache",
            ),
            row("good Llama", Sglang, llama, keep, true, In::Serve, "sglang.launch_server --model-path the folder"),
            row("good Llama", Vllm, llama, keep, true, In::Serve, "vllm serve the folder"),
            row("good Llama", Transformers, llama, keep, true, In::Serve, "from_pretrained('the folder', device_map='auto')"),
            row("transformers note", Transformers, llama, keep, true, In::Note, "pip install optimum gptqmodel"),
            row("BF16 Llama", Vllm, || folder(llama_config()), keep, true, In::Linears, "8 unquantized"),
            // Before the module set.
            row("no config.json", Sglang, sala, |v| v.config = serde_json::Value::Null, false, In::Problem, "has no config.json"),
            row("vLLM has no MiniCPM-SALA", Vllm, sala, keep, false, In::Problem, "no MiniCPM-SALA implementation"),
            // Config rules.
            row("derived key", Sglang, sala, |v| v.config["has_sparse_attention"] = json!(true), false, In::Problem, "can't set attribute"),
            row(
                "derived key (not SGLang)",
                Transformers,
                sala,
                |v| {
                    with_remote_code(v);
                    v.config["sparse_layer_ids"] = json!([0]);
                },
                true,
                In::Warning,
                "[\"sparse_layer_ids\"], which SGLang's MiniCPMHybridConfig",
            ),
            row("AutoConfig over SGLang's own class", Sglang, sala, with_remote_code, false, In::Problem, "auto_map has AutoConfig"),
            row(
                "code in another repo",
                Sglang,
                llama,
                |v| v.config["auto_map"] = json!({"AutoModelForCausalLM": "org/repo--m.M"}),
                true,
                In::Note,
                "code from another hub repo",
            ),
            row(
                "remote code missing",
                Transformers,
                sala,
                |v| {
                    with_remote_code(v);
                    v.files.remove("modeling_minicpm_sala.py");
                },
                false,
                In::Problem,
                "modeling_minicpm_sala.py is missing (needed by config.json auto_map.AutoModelForCausalLM)",
            ),
            row(
                "relative import missing",
                Transformers,
                sala,
                |v| {
                    with_remote_code(v);
                    v.texts.insert("modeling_minicpm_sala.py".into(), "from .utils import x\n".into());
                },
                false,
                In::Problem,
                "utils.py is missing (needed by a relative import in modeling_minicpm_sala.py)",
            ),
            row(
                "model code missing (not transformers)",
                Sglang,
                llama,
                |v| v.config["auto_map"] = json!({"AutoModelForCausalLM": "m.M"}),
                true,
                In::Warning,
                "m.py is missing",
            ),
            row(
                "config code missing",
                Sglang,
                llama,
                |v| v.config["auto_map"] = json!({"AutoConfig": "c.C"}),
                false,
                In::Problem,
                "c.py is missing (needed by config.json auto_map.AutoConfig)",
            ),
            row(
                "tokenizer code missing",
                Vllm,
                llama,
                |v| v.tokenizer_config = Some(json!({"auto_map": {"AutoTokenizer": ["t.T", null]}})),
                false,
                In::Problem,
                "t.py is missing (needed by tokenizer_config.json auto_map.AutoTokenizer)",
            ),
            row("no model code", Transformers, sala, keep, false, In::Problem, "has no built-in MiniCPMSALAForCausalLM and config.json's auto_map lacks AutoConfig"),
            row(
                "no AutoModelForCausalLM",
                Transformers,
                sala,
                |v| {
                    with_remote_code(v);
                    v.config["auto_map"].as_object_mut().unwrap().remove("AutoModelForCausalLM");
                },
                false,
                In::Problem,
                "auto_map lacks AutoModelForCausalLM",
            ),
            row("SALA with remote code", Transformers, sala, with_remote_code, true, In::Linears, "32 gptqmodel"),
            row(
                "unsupported architecture",
                Sglang,
                llama,
                |v| v.config["architectures"] = json!(["GPT2LMHeadModel"]),
                false,
                In::Problem,
                "cannot be read as a supported architecture",
            ),
            row(
                "unreadable settings",
                Sglang,
                llama,
                |v| qc(v)["bits"] = json!("four"),
                false,
                In::Problem,
                "the quantization settings cannot be read",
            ),
            row(
                "integer tensors, no settings",
                Sglang,
                llama,
                |v| {
                    v.config.as_object_mut().unwrap().remove("quantization_config");
                },
                false,
                In::Problem,
                "config.json has no quantization_config",
            ),
            // dtype.
            row("SALA float16", Sglang, sala, |v| v.config["dtype"] = json!("float16"), false, In::Problem, "dtype is float16: SGLang serves those activations"),
            row("SALA float32", Sglang, sala, |v| v.config["dtype"] = json!("float32"), false, In::Problem, "dtype is float32: SGLang serves float16 (SGLang's --dtype auto"),
            row(
                "SALA without dtype",
                Sglang,
                sala,
                |v| {
                    v.config.as_object_mut().unwrap().remove("dtype");
                },
                false,
                In::Problem,
                "dtype is absent (torch_dtype/dtype)",
            ),
            row("SALA torch_dtype", Sglang, sala, |v| {
                let o = v.config.as_object_mut().unwrap();
                o.remove("dtype");
                o.insert("torch_dtype".into(), json!("bfloat16"));
            }, true, In::Linears, "20 gptq_marlin"),
            row("SALA 3-bit (plain gptq, BF16)", Sglang, || quantized(sala_config(), json!({"bits": 3})), keep, false, In::Problem, "float16 activations only"),
            row("Llama 3-bit (plain gptq, BF16)", Sglang, || quantized(llama_config(), json!({"bits": 3})), keep, true, In::Warning, "serve with --dtype float16"),
            row("Llama 3-bit (plain gptq, BF16)", Sglang, || quantized(llama_config(), json!({"bits": 3})), keep, true, In::Serve, "--model-path the folder --dtype float16"),
            // Shapes.
            row("SALA beyond Marlin shapes", Sglang, sala_odd, keep, false, In::Problem, "exceed the Marlin kernels' shape limits"),
            row("SALA beyond Marlin shapes", Sglang, sala_odd, keep, false, In::Problem, "in_features 704 is not a multiple of 128, in_features 704 is not a multiple of the group size"),
            row("Llama beyond Marlin shapes", Sglang, llama_odd, keep, true, In::Warning, "serve with --quantization gptq --dtype float16"),
            row("Llama beyond Marlin shapes", Sglang, llama_odd, keep, true, In::Serve, "--model-path the folder --quantization gptq --dtype float16"),
            row("Llama beyond Marlin shapes", Vllm, llama_odd, keep, false, In::Problem, "vLLM may find another kernel"),
            // SGLang's method.
            row("no quant_method", Sglang, || quantized(llama_config(), json!({"quant_method": null})), keep, true, In::Warning, "SGLang does not select gptq_marlin: quant_method is \"(missing)\""),
            row("a key missing", Sglang, || quantized(llama_config(), json!({"sym": null, "desc_act": null})), keep, true, In::Warning, "sym, desc_act missing from the quantization settings"),
            row("asymmetric", Sglang, || quantized(llama_config(), json!({"sym": false})), keep, true, In::Warning, "4-bit asymmetric (gptq_marlin takes 4 or 8 bits, symmetric)"),
            row("group 256", Sglang, || quantized(llama_config(), json!({"group_size": 256})), keep, true, In::Warning, "group_size 256 (gptq_marlin takes -1, 32, 64, 128)"),
            row("plain gptq", Sglang, || quantized(llama_config(), json!({"sym": false})), keep, true, In::Linears, "8 gptq"),
            // The Marlin format.
            row("Marlin format", Sglang, sala_marlin, keep, false, In::Problem, "no current SGLang release reads it"),
            Row { legacy_marlin: true, ..row("Marlin format, legacy release", Sglang, sala_marlin, keep, true, In::Linears, "20 marlin") },
            Row { legacy_marlin: true, ..row("Marlin format, legacy release", Sglang, sala_marlin, keep, true, In::Note, "exists only in vLLM ≤ 0.10.1.1") },
            Row { legacy_marlin: true, ..row("legacy marlin, group 64", Sglang, || quantized(sala_config(), json!({"checkpoint_format": "marlin", "group_size": 64})), keep, false, In::Problem, "group size 64; the legacy marlin method takes 128 or -1") },
            Row { legacy_marlin: true, ..row("legacy marlin, desc_act", Sglang, || quantized(sala_config(), json!({"checkpoint_format": "marlin", "desc_act": true})), keep, false, In::Problem, "the legacy marlin method has no act-order") },
            Row { legacy_marlin: true, ..row("legacy marlin, skipped modules", Sglang, || quantized(llama_config(), json!({"checkpoint_format": "marlin", "dynamic": {r"-:.*self_attn\.o_proj": {}}})), keep, true, In::Warning, "applies no per-module rules") },
            row("Marlin label over GPTQ tensors", Sglang, sala, |v| qc(v)["checkpoint_format"] = json!("marlin"), false, In::Problem, "the label is wrong. No current SGLang release"),
            Row { legacy_marlin: true, ..row("Marlin label over GPTQ tensors, legacy release", Sglang, sala, |v| qc(v)["checkpoint_format"] = json!("marlin"), false, In::Linears, "20 marlin") },
            row("Marlin label over GPTQ tensors", Vllm, llama, |v| qc(v)["checkpoint_format"] = json!("marlin"), false, In::Problem, "vLLM ignores checkpoint_format and reads the qweight/scales"),
            row("Marlin format", Vllm, || quantized(llama_config(), json!({"checkpoint_format": "marlin"})), keep, false, In::Problem, "vLLM removed the legacy marlin method"),
            row("Marlin format", Transformers, || quantized(llama_config(), json!({"checkpoint_format": "marlin"})), keep, false, In::Problem, "GPTQModel, which refuses the legacy Marlin format"),
            // vLLM's method.
            row("vLLM 3-bit", Vllm, || quantized(llama_config(), json!({"bits": 3})), keep, false, In::Problem, "auto_gptq) takes 4- or 8-bit symmetric checkpoints with group size -1, 32, 64 or 128 and all of bits, group_size, sym, desc_act present; this one has 3-bit symmetric"),
            row("vLLM desc_act", Vllm, || quantized(llama_config(), json!({"desc_act": true})), keep, false, In::Problem, "vLLM ≥ 0.30 refuses group activation ordering"),
            row("vLLM desc_act, one group", Vllm, || quantized(llama_config(), json!({"desc_act": true, "group_size": -1})), keep, true, In::Linears, "8 auto_gptq"),
            row("vLLM lm_head", Vllm, llama, |v| qc(v)["lm_head"] = json!(true), false, In::MissingTensors, "lm_head.qweight"),
            row(
                "vLLM lm_head",
                Vllm,
                llama,
                |v| {
                    qc(v)["lm_head"] = json!(true);
                    v.tensors.remove("lm_head.weight");
                    put(v, "lm_head.qweight", Dtype::I32, &[32, 4096]);
                    put(v, "lm_head.qzeros", Dtype::I32, &[2, 512]);
                    put(v, "lm_head.scales", Dtype::F16, &[2, 4096]);
                },
                true,
                In::Linears,
                "8 auto_gptq",
            ),
            row("lm_head quantized for SGLang", Sglang, llama, |v| {
                qc(v)["lm_head"] = json!(true);
                put(v, "lm_head.qweight", Dtype::I32, &[32, 4096]);
            }, false, In::UnusedTensors, "lm_head.qweight"),
            // transformers' method.
            row("transformers 5-bit", Transformers, || quantized(llama_config(), json!({"bits": 5})), keep, false, In::Problem, "bits is 5: transformers' GPTQConfig takes 2, 3, 4 or 8"),
            row("transformers 3-bit", Transformers, || quantized(llama_config(), json!({"bits": 3})), keep, true, In::Linears, "14 gptqmodel"),
            row("transformers +: rule", Transformers, llama_plus3, keep, false, In::Problem, "set per-module bits or group sizes, but transformers ignores `dynamic`"),
            row("transformers -: rule without a list", Transformers, llama_skip_o, keep, false, In::Problem, "without modules_in_block_to_quantize"),
            row(
                "transformers -: rule with a list",
                Transformers,
                llama_skip_o,
                |v| qc(v)["modules_in_block_to_quantize"] = json!([["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]]),
                true,
                In::Linears,
                "12 gptqmodel, 2 unquantized",
            ),
            // dynamic rules.
            row("-: rule", Sglang, llama_skip_o, keep, true, In::Linears, "6 gptq_marlin, 2 unquantized"),
            row("-: rule", Vllm, llama_skip_o, keep, true, In::Linears, "6 auto_gptq, 2 unquantized"),
            row("+: rule to 3 bits", Sglang, llama_plus3, keep, false, In::Problem, "gives model.layers.0.mlp.down_proj 3-bit sym group 128, which gptq_marlin cannot run"),
            row("+: rule to 3 bits", Vllm, llama_plus3, keep, false, In::Problem, "which auto_gptq cannot run"),
            row("+: rule to group 64", Sglang, || quantized(llama_config(), json!({"dynamic": {r"+:model\.layers\.0\.mlp\.down_proj": {"group_size": 64}}})), keep, true, In::Linears, "8 gptq_marlin"),
            row("a rule on a member name", Sglang, llama_skip_k, keep, false, In::MissingTensors, "model.layers.0.self_attn.k_proj.qweight"),
            row("a rule on a member name", Sglang, llama_skip_k, keep, false, In::Problem, "KeyError on the first one it does not build): model.layers.0.self_attn.k_proj.weight"),
            row("a fused group split", Vllm, llama_skip_k, keep, false, In::Problem, "model.layers.0.self_attn.qkv_proj: some but not all of model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj are quantized"),
            row(
                "o_gate kept BF16 without a rule",
                Sglang,
                || quantized(sala_config(), json!({"dynamic": {r"-:.*self_attn\.o_gate": {}}})),
                |v| qc(v)["dynamic"] = json!({}),
                false,
                In::Problem,
                "model.layers.0.self_attn.o_gate.qweight",
            ),
            row(
                "o_gate kept BF16 without a rule",
                Sglang,
                || quantized(sala_config(), json!({"dynamic": {r"-:.*self_attn\.o_gate": {}}})),
                |v| qc(v)["dynamic"] = json!({}),
                false,
                In::Problem,
                "KeyError",
            ),
            row(
                "a layer kept BF16 without a rule (vLLM scans the shards)",
                Vllm,
                || quantized(llama_config(), json!({"dynamic": {r"-:model\.layers\.0\.self_attn\.o_proj": {}}})),
                |v| qc(v)["dynamic"] = json!({}),
                true,
                In::Linears,
                "7 auto_gptq, 1 unquantized",
            ),
            row(
                "the first rule in file order wins",
                Sglang,
                llama_skip_o,
                |v| {
                    qc(v)["dynamic"][r"+:.*"] = json!({"bits": 4});
                    v.dynamic_order = vec![r"-:.*self_attn\.o_proj".into(), r"+:.*".into()];
                },
                true,
                In::Linears,
                "6 gptq_marlin, 2 unquantized",
            ),
            // The tensors.
            row("a tensor missing", Sglang, llama, |v| {
                v.tensors.remove("model.layers.1.mlp.up_proj.scales");
            }, false, In::Problem, "1 tensor(s) that SGLang would load are not in the shards, so those parameters stay uninitialized (garbage output): model.layers.1.mlp.up_proj.scales"),
            row("g_idx with desc_act", Transformers, || quantized(llama_config(), json!({"desc_act": true})), |v| {
                v.tensors.remove("model.layers.0.mlp.up_proj.g_idx");
            }, false, In::MissingTensors, "model.layers.0.mlp.up_proj.g_idx"),
            row("g_idx without desc_act", Sglang, llama, |v| {
                v.tensors.remove("model.layers.0.mlp.up_proj.g_idx");
            }, true, In::Linears, "8 gptq_marlin"),
            row("a shape that does not fit", Sglang, llama, |v| {
                put(v, "model.layers.0.mlp.up_proj.scales", Dtype::F16, &[4, 512]);
            }, false, In::Problem, "model.layers.0.mlp.up_proj.scales is F16 [4, 512], the engine's parameter is BF16/F16/F32 [2, 512]"),
            row("a dtype that does not fit", Vllm, llama, |v| {
                put(v, "model.layers.0.mlp.up_proj.qweight", Dtype::F16, &[32, 512]);
            }, false, In::Problem, "do not fit the parameter the engine builds"),
            row("an extra tensor", Sglang, llama, |v| put(v, "model.extra", Dtype::BF16, &[4]), false, In::Problem, "1 tensor(s) in the shards match no parameter the engine builds (SGLang's load_weights"),
            row("an extra tensor", Vllm, llama, |v| put(v, "model.extra", Dtype::BF16, &[4]), false, In::Problem, "There is no module or parameter named"),
            row("an extra tensor", Transformers, llama, |v| put(v, "model.extra", Dtype::BF16, &[4]), true, In::Warning, "\"unexpected keys\" warning"),
            row("rotary buffers", Transformers, llama, |v| put(v, "model.layers.0.self_attn.rotary_emb.inv_freq", Dtype::F32, &[32]), true, In::Linears, "14 gptqmodel"),
            row("a stray bias", Sglang, llama, |v| put(v, "model.layers.0.self_attn.o_proj.bias", Dtype::BF16, &[256]), true, In::Linears, "8 gptq_marlin"),
            row("a stray bias", Transformers, llama, |v| put(v, "model.layers.0.self_attn.o_proj.bias", Dtype::BF16, &[256]), true, In::UnusedTensors, "model.layers.0.self_attn.o_proj.bias"),
            row("a stray g_idx", Vllm, llama, |v| put(v, "model.layers.0.self_attn.rot.g_idx", Dtype::I32, &[256]), true, In::Linears, "8 auto_gptq"),
            row(
                "a Linear's bias",
                Vllm,
                || {
                    let mut c = llama_config();
                    c["attention_bias"] = json!(true);
                    quantized(c, json!({}))
                },
                |v| {
                    v.tensors.remove("model.layers.1.self_attn.o_proj.bias");
                },
                false,
                In::MissingTensors,
                "model.layers.1.self_attn.o_proj.bias",
            ),
        ];
        run(&rows);
    }
}
