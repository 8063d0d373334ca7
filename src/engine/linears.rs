//! The Linears as an engine builds them and the types its rules are written in: the method of
//! each (`LinearMethod`), the engine's modules and the checkpoint members they load
//! (`EngineLinear`, `Member`), the settings as the engine reads them (`Quantized`), a Linear's decision
//! (`Decision`), and the rules every engine shares (`dynamic` rules, the Marlin conditions).
//! docs/engines.md states each rule with its source.

use super::{Findings, FolderView};
use crate::format::marlin::marlin_group_ok;
use crate::format::quantized::{QuantFormat, QuantInfo, FUSED_GROUPS};
use crate::model::AnyConfig;
use crate::scheme::GroupSize;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// How an engine runs one of its Linears: its linear method, in the engines' own term (vLLM's
/// and SGLang's `*LinearMethod` classes). Not the quantization method (`quantize::Method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinearMethod {
    Unquantized,
    /// SGLang's and vLLM's Marlin path for GPTQ checkpoints (repacked at load).
    GptqMarlin,
    /// SGLang's plain `gptq` (exllama) kernels: fp16 activations only.
    Gptq,
    /// vLLM ≥ 0.22's `auto_gptq` (Marlin-family kernels; 4/8-bit symmetric only).
    AutoGptq,
    /// transformers through optimum and GPTQModel's QuantLinear.
    GptqModel,
    /// The legacy `marlin` method (`B`/`s` tensors; vLLM ≤ 0.10.1.1, or SGLang with it).
    MarlinLegacy,
}

impl LinearMethod {
    pub fn name(self) -> &'static str {
        match self {
            Self::Unquantized => "unquantized",
            Self::GptqMarlin => "gptq_marlin",
            Self::Gptq => "gptq",
            Self::AutoGptq => "auto_gptq",
            Self::GptqModel => "gptqmodel",
            Self::MarlinLegacy => "marlin",
        }
    }
    pub(crate) fn quantized(self) -> bool {
        self != Self::Unquantized
    }
}

/// One Linear as the engine builds it.
#[derive(Debug, Clone, Serialize)]
pub struct EngineModule {
    /// The engine's module name, the one `dynamic` rules are matched against
    /// (`model.layers.0.self_attn.qkv_proj`).
    pub name: String,
    /// The checkpoint modules it loads (`...q_proj`, `...k_proj`, `...v_proj`).
    pub members: Vec<String>,
    pub method: LinearMethod,
    pub bits: Option<u8>,
    pub group_size: Option<GroupSize>,
    /// The `dynamic` rule that decided the method or settings, if any.
    pub rule: Option<String>,
}

impl EngineModule {
    pub(super) fn new(l: &EngineLinear, d: Decision) -> Self {
        Self {
            name: l.name.clone(),
            members: l.member_names(),
            method: d.method,
            bits: d.method.quantized().then_some(d.bits),
            group_size: d.method.quantized().then_some(d.group_size),
            rule: d.rule,
        }
    }
}

/// A checkpoint Linear: its prefix, `[N, K]`, and whether it has a bias.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub prefix: String,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) bias: bool,
}

/// A Linear as the engine builds it: its name and the checkpoint modules it loads.
pub(crate) struct EngineLinear {
    pub name: String,
    pub members: Vec<Member>,
}

impl EngineLinear {
    pub fn member_names(&self) -> Vec<String> {
        self.members.iter().map(|m| m.prefix.clone()).collect()
    }
}

/// The Linears of `cfg` as an engine builds them (`fuses`: q/k/v and gate/up as one Linear
/// each), and the other tensors it loads.
pub(super) fn engine_layout(
    cfg: &AnyConfig,
    fuses: bool,
) -> (Vec<EngineLinear>, Vec<(String, Vec<usize>)>) {
    let (linears, plain) = checkpoint_linears(cfg);
    let by_prefix: BTreeMap<&str, &Member> =
        linears.iter().map(|m| (m.prefix.as_str(), m)).collect();
    let mut out = vec![];
    let mut done = BTreeSet::new();
    for m in &linears {
        if done.contains(&m.prefix) {
            continue;
        }
        let (parent, leaf) = m.prefix.rsplit_once('.').unwrap_or(("", &m.prefix));
        let fused = fuses
            .then(|| FUSED_GROUPS.iter().find(|(_, names)| names.contains(&leaf)))
            .flatten();
        let (name, members): (String, Vec<Member>) = match fused {
            Some((fname, names)) => (
                format!("{parent}.{fname}"),
                names
                    .iter()
                    .filter_map(|x| by_prefix.get(format!("{parent}.{x}").as_str()))
                    .map(|m| (*m).clone())
                    .collect(),
            ),
            None => (m.prefix.clone(), vec![m.clone()]),
        };
        done.extend(members.iter().map(|m| m.prefix.clone()));
        out.push(EngineLinear { name, members });
    }
    (out, plain)
}

/// The decoder-layer Linears of `cfg` in checkpoint order (their biases attached), and the
/// other tensors.
pub(super) fn checkpoint_linears(cfg: &AnyConfig) -> (Vec<Member>, Vec<(String, Vec<usize>)>) {
    let mut plain = vec![];
    let mut linears = vec![];
    for (name, shape) in cfg.expected_tensors() {
        let in_layer = name.starts_with("model.layers.");
        match name.strip_suffix(".weight") {
            Some(p) if in_layer && shape.len() == 2 => linears.push(Member {
                prefix: p.to_string(),
                n: shape[0],
                k: shape[1],
                bias: false,
            }),
            _ => plain.push((name, shape)),
        }
    }
    let index: BTreeMap<String, usize> = linears
        .iter()
        .enumerate()
        .map(|(i, m)| (m.prefix.clone(), i))
        .collect();
    // Biases belong to their Linear.
    plain.retain(
        |(name, _)| match name.strip_suffix(".bias").and_then(|p| index.get(p)) {
            Some(&i) => {
                linears[i].bias = true;
                false
            }
            None => true,
        },
    );
    (linears, plain)
}

/// The settings as the engine reads them, and what its rules read of the folder with them.
pub(crate) struct Quantized<'a> {
    pub info: &'a QuantInfo,
    /// Checked as a release that still has the legacy `marlin` method.
    pub legacy_marlin: bool,
    /// The config says "marlin" over GPTQ tensors (qweight, no B): the label is wrong, and the
    /// messages say what the folder holds rather than what the label promises.
    pub relabelled_gptq: bool,
    /// `modules_in_block_to_quantize`, flattened.
    pub listed: Option<Vec<String>>,
    /// The modules that hold quantized (integer) tensors (vLLM's safetensors scan).
    pub in_shards: BTreeSet<&'a str>,
}

impl<'a> Quantized<'a> {
    pub(super) fn new(view: &'a FolderView, info: &'a QuantInfo, legacy_marlin: bool) -> Self {
        let relabelled_gptq = info.format == QuantFormat::Marlin
            && view.tensors.keys().any(|n| n.ends_with(".qweight"))
            && !view.tensors.keys().any(|n| n.ends_with(".B"));
        let in_shards = view
            .tensors
            .iter()
            .filter(|(_, t)| !t.dtype.is_float())
            .filter_map(|(n, _)| n.rsplit_once('.').map(|(p, _)| p))
            .collect();
        Self {
            info,
            legacy_marlin,
            relabelled_gptq,
            listed: listed_modules(info),
            in_shards,
        }
    }
}

/// `modules_in_block_to_quantize` (a list of lists, or of names) as one list.
pub(super) fn listed_modules(q: &QuantInfo) -> Option<Vec<String>> {
    let outer = q.raw.get("modules_in_block_to_quantize")?.as_array()?;
    let mut v = vec![];
    for x in outer {
        match x {
            serde_json::Value::Array(inner) => {
                v.extend(inner.iter().filter_map(|s| s.as_str()).map(str::to_string))
            }
            serde_json::Value::String(s) => v.push(s.clone()),
            _ => {}
        }
    }
    Some(v)
}

/// The fix for a checkpoint whose config says "marlin" over GPTQ tensors.
pub(crate) const RELABELLED_FIX: &str = "the tensors are GPTQ (qweight, qzeros, scales), not \
    Marlin tiles: set checkpoint_format to \"gptq\" in config.json's quantization_config (and \
    in quantize_config.json), or serve the folder this one was copied from";

/// Whether the Marlin kernels run these settings (4 or 8 bits, symmetric, group -1/32/64/128).
pub(super) fn marlin_runs(bits: u8, sym: bool, group_size: GroupSize) -> bool {
    sym && (bits == 4 || bits == 8) && marlin_group_ok(group_size)
}

/// SGLang's `is_gptq_marlin_compatible` on the checkpoint-wide settings (vLLM's `auto_gptq`
/// takes the same): why the Marlin kernels cannot run them, if they cannot.
pub(crate) fn marlin_incompatibility(q: &QuantInfo) -> Option<String> {
    let method = q.quant_method().map(str::to_ascii_lowercase);
    if method.as_deref() != Some("gptq") {
        return Some(format!(
            "quant_method is {:?}, not \"gptq\"",
            q.quant_method().unwrap_or("(missing)")
        ));
    }
    if !q.missing_keys.is_empty() {
        return Some(format!(
            "{} missing from the quantization settings",
            q.missing_keys.join(", ")
        ));
    }
    if !(q.sym && (q.bits == 4 || q.bits == 8)) {
        return Some(format!(
            "{}-bit {} (gptq_marlin takes 4 or 8 bits, symmetric)",
            q.bits,
            if q.sym { "symmetric" } else { "asymmetric" }
        ));
    }
    if !marlin_group_ok(q.group_size) {
        return Some(format!(
            "group_size {} (gptq_marlin takes -1, 32, 64, 128)",
            q.group_size
        ));
    }
    None
}

/// The settings one engine Linear gets.
pub(crate) struct Decision {
    pub method: LinearMethod,
    pub bits: u8,
    pub group_size: GroupSize,
    pub sym: bool,
    pub desc_act: bool,
    /// The `dynamic` rule that decided the method or settings, if any.
    pub rule: Option<String>,
}

impl Decision {
    /// The checkpoint-wide settings under `method`.
    pub(super) fn new(method: LinearMethod, quant: Option<&QuantInfo>) -> Self {
        Self {
            method,
            bits: quant.map_or(16, |q| q.bits),
            group_size: quant.map_or(GroupSize::PerRow, |q| q.group_size),
            sym: quant.is_none_or(|q| q.sym),
            desc_act: quant.is_some_and(|q| q.desc_act),
            rule: None,
        }
    }
}

/// `dynamic` rules as SGLang and vLLM apply them (`get_dynamic_override`): the first rule in
/// file order that matches the engine's (fused) name decides; `-:` keeps the Linear
/// unquantized, `+:` overrides bits, group_size and desc_act (and sym for the Marlin methods,
/// which raise while building a Linear they cannot run).
pub(crate) fn apply_dynamic(q: &Quantized, l: &EngineLinear, d: &mut Decision, f: &mut Findings) {
    let Some(r) = q.info.rule_for(&l.name) else {
        return;
    };
    d.rule = Some(r.key.clone());
    if r.skip {
        d.method = LinearMethod::Unquantized;
        return;
    }
    let o = r.overrides;
    d.bits = o.bits.unwrap_or(d.bits);
    d.group_size = o.group_size.unwrap_or(d.group_size);
    d.desc_act = o.desc_act.unwrap_or(d.desc_act);
    if !matches!(d.method, LinearMethod::GptqMarlin | LinearMethod::AutoGptq) {
        return;
    }
    d.sym = o.sym.unwrap_or(d.sym);
    if !marlin_runs(d.bits, d.sym, d.group_size) {
        f.problem(
            &format!(
                "dynamic rule {:?} gives {} {}-bit {} group {}, which {} cannot run (4 or 8 \
                 bits, symmetric, group -1/32/64/128): the engine raises while building it",
                r.key,
                l.name,
                d.bits,
                if d.sym { "sym" } else { "asym" },
                d.group_size,
                d.method.name()
            ),
            "change the rule's bits or group_size",
        );
    }
}
