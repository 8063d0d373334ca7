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
//!
//! What differs between the engines is data: one `Rules` value per engine (`sglang.rs`,
//! `vllm.rs`, `transformers.rs`, each with the table of the findings its rules produce at its
//! end); the procedures here, in `loader` and in `config` read them without naming an engine.
//! Every rule and its source (file and function of the engine) is in docs/engines.md.

pub mod config;
mod linears;
pub mod loader;
mod rules;
mod sglang;
#[cfg(test)]
mod testkit;
mod transformers;
mod vllm;

use crate::checkpoint::{Checkpoint, Dtype};
use crate::format::quantized::{dynamic_key_order, QuantFormat, QuantInfo};
use crate::model::AnyConfig;
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

pub use linears::{EngineModule, LinearMethod};

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
        self.rules().name
    }

    pub fn label(self) -> &'static str {
        self.rules().label
    }

    /// What its loader, config handling and kernels do.
    fn rules(self) -> &'static rules::Rules {
        match self {
            Self::Sglang => &sglang::RULES,
            Self::Vllm => &vllm::RULES,
            Self::Transformers => &transformers::RULES,
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

/// The findings of a check as it collects them, each list in the order found.
#[derive(Debug, Default)]
pub struct Findings {
    /// Each fatal: the engine would not load the folder, or not serve it correctly.
    pub problems: Vec<Finding>,
    pub warnings: Vec<Finding>,
    pub notes: Vec<String>,
}

impl Findings {
    pub fn problem(&mut self, what: &str, fix: &str) {
        self.problems.push(Finding::new(what, fix));
    }

    pub fn warning(&mut self, what: &str, fix: &str) {
        self.warnings.push(Finding::new(what, fix));
    }

    /// A problem when `fatal`, else a warning.
    pub fn push(&mut self, fatal: bool, f: Finding) {
        match fatal {
            true => self.problems.push(f),
            false => self.warnings.push(f),
        }
    }

    pub fn note(&mut self, note: &str) {
        self.notes.push(note.to_string());
    }

    fn extend(&mut self, other: Findings) {
        self.problems.extend(other.problems);
        self.warnings.extend(other.warnings);
        self.notes.extend(other.notes);
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
    /// The verdict before any rule ran: nothing found, nothing built.
    fn new(engine: Engine, architecture: Option<String>, legacy_marlin: bool) -> Self {
        Self {
            engine,
            architecture,
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
        }
    }

    fn is_sala(&self) -> bool {
        self.architecture.as_deref() == Some(config::SALA_ARCHITECTURE)
    }

    /// Takes the findings: the folder loads when none is a problem.
    fn finish(mut self, f: Findings) -> Self {
        self.loads = f.problems.is_empty();
        self.problems = f.problems;
        self.warnings = f.warnings;
        self.notes = f.notes;
        self
    }

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
                self.is_sala(),
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

/// `view` as `engine` would load it (see the module docs): the config rules, the loader's
/// emulation, then what the kernels make of the methods it chose.
pub fn check(view: &FolderView, engine: Engine, legacy_marlin: bool) -> Result<EngineCheck> {
    let rules = engine.rules();
    let arch = config::architecture(&view.config).map(str::to_string);
    let mut out = EngineCheck::new(engine, arch, legacy_marlin);
    if let Some(f) = unbuildable(view, rules) {
        out.problems.push(f);
        return Ok(out);
    }
    let mut f = Findings::default();
    out.remote_code = config::check_config(view, rules, &mut f);
    let cfg = match AnyConfig::from_json(&view.config.to_string()) {
        Ok(c) => c,
        Err(e) => {
            f.problem(
                &format!("config.json cannot be read as a supported architecture: {e:#}"),
                "this check covers MiniCPM-SALA and the Llama family",
            );
            return Ok(out.finish(f));
        }
    };
    let quant = quant_settings(view, &mut f);
    let emu = loader::emulate(view, &cfg, quant.as_ref(), engine, legacy_marlin);
    let sala = out.is_sala();
    config::sala_dtype(&view.config, rules, sala, &mut f);
    let float16_only = plain_gptq_float16_only(view, quant.as_ref(), &emu.modules, sala, &mut f);
    method_notes(&emu.modules, rules, legacy_marlin, quant.is_some(), &mut f);
    if let Some(s) = emu.shape_limit {
        // MiniCPM-SALA must run BF16, which the plain gptq kernels cannot.
        let fallback = rules.plain_gptq_fallback && !sala;
        out.needs_plain_gptq = fallback;
        f.push(!fallback, s);
    }
    f.extend(emu.findings);
    out.needs_float16 = (float16_only || out.needs_plain_gptq) && !sala;
    out.modules = emu.modules;
    out.missing_tensors = emu.missing;
    out.unused_tensors = emu.unused;
    let mut out = out.finish(f);
    out.serve = out.serve_at(&view.label);
    Ok(out)
}

/// Why the engine cannot even start on the folder: no config.json, or an architecture it does
/// not implement.
fn unbuildable(view: &FolderView, rules: &rules::Rules) -> Option<Finding> {
    if view.config.is_null() {
        return Some(Finding::new(
            &format!("{} has no config.json", view.label),
            "every engine starts from config.json: copy the source's",
        ));
    }
    let arch = config::architecture(&view.config)?;
    let (_, what, fix) = rules.unbuilt.iter().find(|(a, ..)| *a == arch)?;
    Some(Finding::new(what, fix))
}

/// The quantization settings the engines read (config.json's `quantization_config`), and what
/// keeps them from reading any.
fn quant_settings(view: &FolderView, f: &mut Findings) -> Option<QuantInfo> {
    let quant = view.quant_info().unwrap_or_else(|e| {
        f.problem(
            &format!("the quantization settings cannot be read: {e:#}"),
            "fix quantization_config in config.json",
        );
        None
    });
    if quant.is_none() && view.tensors.values().any(|t| !t.dtype.is_float()) {
        f.problem(
            "the shards hold quantized (integer) tensors but config.json has no \
             quantization_config: the engines detect the method from config.json only and \
             would build unquantized Linears",
            "put the quantization settings into config.json as quantization_config",
        );
    }
    quant
}

fn uses(modules: &[EngineModule], m: LinearMethod) -> bool {
    modules.iter().any(|x| x.method == m)
}

/// SGLang's plain gptq kernels (the only engine that builds [`LinearMethod::Gptq`]) take float16
/// activations only: a config that says bfloat16 is refused, fatally for MiniCPM-SALA (it must
/// run BF16), with `--dtype float16` as the way out for the others. A Marlin-format folder
/// falls back to plain gptq in current releases; that finding says so.
fn plain_gptq_float16_only(
    view: &FolderView,
    quant: Option<&QuantInfo>,
    modules: &[EngineModule],
    sala: bool,
    f: &mut Findings,
) -> bool {
    let serves_bf16 = config::dtype_key(&view.config).is_some_and(|(_, v)| v == "bfloat16");
    let marlin_format = quant.is_some_and(|q| q.format == QuantFormat::Marlin);
    if !(uses(modules, LinearMethod::Gptq) && serves_bf16 && !marlin_format) {
        return false;
    }
    let fix = if sala {
        "re-quantize with settings gptq_marlin runs (4 or 8 bits, symmetric, group size \
         -1/32/64/128): MiniCPM-SALA must be served in BF16"
    } else {
        "serve with --dtype float16, or re-quantize for gptq_marlin (4 or 8 bits, symmetric, \
         group size -1/32/64/128)"
    };
    let what = "SGLang's plain gptq kernels take float16 activations only, and config.json says \
                bfloat16: the engine refuses (\"torch.bfloat16 is not supported for quantization \
                method gptq\")";
    f.push(sala, Finding::new(what, fix));
    true
}

/// What the methods the engine chose need at serving time.
fn method_notes(
    modules: &[EngineModule],
    rules: &rules::Rules,
    legacy_marlin: bool,
    quantized: bool,
    f: &mut Findings,
) {
    if legacy_marlin && uses(modules, LinearMethod::MarlinLegacy) {
        f.note(
            "the legacy marlin method exists only in vLLM ≤ 0.10.1.1 (and in SGLang with such a \
             vLLM installed), with float16 activations: no current SGLang or vLLM release reads \
             checkpoint_format marlin",
        );
    }
    if uses(modules, LinearMethod::GptqMarlin) {
        f.note(
            "gptq_marlin repacks qweight to Marlin tiles at load (CUDA, compute capability ≥ 8.0)",
        );
    }
    if let Some(note) = rules.quantized_note.filter(|_| quantized) {
        f.note(note);
    }
}

/// A command line that serves `dir` with `engine`.
pub fn serve_command(engine: Engine, sala: bool, remote_code: bool, dir: &str) -> String {
    (engine.rules().serve)(dir, sala, remote_code)
}
