//! The weight loaders of SGLang, vLLM and transformers, emulated on a folder's tensor names and
//! shapes: which Linears each engine builds for the architecture (fused `qkv_proj` and
//! `gate_up_proj` in SGLang and vLLM, the output gates `o_gate` / `z_proj` built with the quant
//! config), which method each gets once `dynamic` rules are applied to the name the engine uses,
//! the tensor names and shapes that method loads, and the difference with what the shards hold.
//! docs/engines.md states each rule with its source.

use super::rules::Rules;
use super::{Engine, Finding, Findings, FolderView};
use crate::checkpoint::Dtype;
use crate::format::marlin::{marlin_group_ok, MARLIN_K_MULTIPLE, MARLIN_N_MULTIPLE};
use crate::format::quantized::{QuantFormat, QuantInfo, FUSED_GROUPS};
use crate::model::AnyConfig;
use crate::scheme::GroupSize;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// How an engine runs one of its Linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
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

impl Method {
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
    pub method: Method,
    pub bits: Option<u8>,
    pub group_size: Option<GroupSize>,
    /// The `dynamic` rule that decided the method or settings, if any.
    pub rule: Option<String>,
}

impl EngineModule {
    fn new(l: &EngineLinear, d: Decision) -> Self {
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
    n: usize,
    k: usize,
    bias: bool,
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
fn engine_layout(cfg: &AnyConfig, fuses: bool) -> (Vec<EngineLinear>, Vec<(String, Vec<usize>)>) {
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
fn checkpoint_linears(cfg: &AnyConfig) -> (Vec<Member>, Vec<(String, Vec<usize>)>) {
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
    fn new(view: &'a FolderView, info: &'a QuantInfo, legacy_marlin: bool) -> Self {
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
fn listed_modules(q: &QuantInfo) -> Option<Vec<String>> {
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
fn marlin_runs(bits: u8, sym: bool, group_size: GroupSize) -> bool {
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
    pub method: Method,
    pub bits: u8,
    pub group_size: GroupSize,
    pub sym: bool,
    pub desc_act: bool,
    /// The `dynamic` rule that decided the method or settings, if any.
    pub rule: Option<String>,
}

impl Decision {
    /// The checkpoint-wide settings under `method`.
    fn new(method: Method, quant: Option<&QuantInfo>) -> Self {
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
        d.method = Method::Unquantized;
        return;
    }
    let o = r.overrides;
    d.bits = o.bits.unwrap_or(d.bits);
    d.group_size = o.group_size.unwrap_or(d.group_size);
    d.desc_act = o.desc_act.unwrap_or(d.desc_act);
    if !matches!(d.method, Method::GptqMarlin | Method::AutoGptq) {
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

/// Why a Linear is beyond the Marlin kernels' shapes (out_features, fused: the sum, a multiple
/// of 64; in_features of 128 and of the group size), if it is and gets a Marlin method.
fn marlin_shape_limit(l: &EngineLinear, d: &Decision) -> Option<String> {
    if !matches!(d.method, Method::GptqMarlin | Method::AutoGptq) {
        return None;
    }
    let n: usize = l.members.iter().map(|m| m.n).sum();
    let k = l.members[0].k;
    let mut why = vec![];
    if !n.is_multiple_of(MARLIN_N_MULTIPLE) {
        why.push(format!(
            "out_features {n} is not a multiple of {MARLIN_N_MULTIPLE}"
        ));
    }
    if !k.is_multiple_of(MARLIN_K_MULTIPLE) {
        why.push(format!(
            "in_features {k} is not a multiple of {MARLIN_K_MULTIPLE}"
        ));
    }
    if d.group_size
        .columns()
        .is_some_and(|g| g < k && !k.is_multiple_of(g))
    {
        why.push(format!(
            "in_features {k} is not a multiple of the group size"
        ));
    }
    (!why.is_empty()).then(|| format!("{} ({})", l.name, why.join(", ")))
}

/// Beyond the Marlin kernels' shapes the engine raises while building the layer, unless it is
/// told to use plain gptq (SGLang: --quantization gptq, float16 only); whether that is a way
/// out depends on the model, so the caller judges.
fn shape_limit_finding(limits: &[String], rules: &Rules) -> Option<Finding> {
    (!limits.is_empty()).then(|| {
        Finding::new(
            &format!(
                "{} Linear(s) exceed the Marlin kernels' shape limits (out_features a multiple \
                 of 64, in_features of 128 and of the group size), and {} raises while building \
                 them with gptq_marlin: {}",
                limits.len(),
                rules.label,
                summarize(limits)
            ),
            rules.shape_limit_fix,
        )
    })
}

/// What the legacy `marlin` method cannot hold: group sizes other than 128 and -1, act-order.
fn legacy_marlin_limits(l: &EngineLinear, d: &Decision, f: &mut Findings) {
    if d.method != Method::MarlinLegacy {
        return;
    }
    if d.group_size != GroupSize::G128 && d.group_size != GroupSize::PerRow {
        f.problem(
            &format!(
                "{}: group size {}; the legacy marlin method takes 128 or -1",
                l.name, d.group_size
            ),
            "re-quantize with --group-size 128",
        );
    }
    if d.desc_act {
        f.problem(
            &format!(
                "{}: desc_act is true; the legacy marlin method has no act-order (the \
                 g_idx_sort_indices extension is read by no engine)",
                l.name
            ),
            "re-quantize with --act-order static",
        );
    }
}

/// Tensor expectations: name → (allowed dtypes, shape, required).
type Expect = BTreeMap<String, (Vec<Dtype>, Vec<usize>, bool)>;

const FLOATS: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

/// The tensors one checkpoint Linear loads under `d` (docs/engines.md, the table of methods).
fn expect_member(e: &mut Expect, m: &Member, d: &Decision, drops_g_idx: bool) {
    let p = &m.prefix;
    // The engines size `scales`/`qzeros` by floor division (`input_size // group_size`).
    let g = d.group_size.columns().map_or(1, |g| m.k / g);
    let b = d.bits as usize;
    let mut put = |suffix: &str, dtypes: &[Dtype], shape: Vec<usize>, required: bool| {
        e.insert(format!("{p}.{suffix}"), (dtypes.to_vec(), shape, required));
    };
    match d.method {
        Method::Unquantized => put("weight", &FLOATS, vec![m.n, m.k], true),
        Method::MarlinLegacy => {
            put("B", &[Dtype::I32], vec![m.k / 16, 2 * m.n], true);
            put("s", &FLOATS, vec![g, m.n], true);
        }
        _ => {
            put("qweight", &[Dtype::I32], vec![m.k * b / 32, m.n], true);
            put("qzeros", &[Dtype::I32], vec![g, m.n * b / 32], true);
            put("scales", &FLOATS, vec![g, m.n], true);
            // g_idx is used only with desc_act (SGLang and transformers fill the trivial one).
            put(
                "g_idx",
                &[Dtype::I32],
                vec![m.k],
                d.desc_act && !drops_g_idx,
            );
        }
    }
    if m.bias {
        put("bias", &FLOATS, vec![m.n], true);
    }
}

/// The other tensors: 16-bit as the checkpoint lists them, except a quantized head (`head`:
/// its settings, when the engine quantizes it).
fn expect_others(
    e: &mut Expect,
    plain: &[(String, Vec<usize>)],
    head: Option<&Decision>,
    rules: &Rules,
) {
    for (name, shape) in plain {
        match head {
            Some(d) if name == "lm_head.weight" => {
                let m = Member {
                    prefix: "lm_head".into(),
                    n: shape[0],
                    k: shape[1],
                    bias: false,
                };
                expect_member(e, &m, d, rules.drops_g_idx);
            }
            _ => {
                e.insert(name.clone(), (FLOATS.to_vec(), shape.clone(), true));
            }
        }
    }
}

/// The result of emulating one engine's load of the folder's tensors.
pub struct LoadEmulation {
    pub modules: Vec<EngineModule>,
    pub missing: Vec<String>,
    pub unused: Vec<String>,
    pub findings: Findings,
    /// Linears beyond the Marlin kernels' shape limits (fatal or not depends on the model).
    pub shape_limit: Option<Finding>,
}

/// Emulates `engine` loading the tensors of `view` for `cfg`. `quant` is the checkpoint's
/// settings as the engine reads them (config.json's `quantization_config`); `legacy_marlin`
/// assumes a release that still has the legacy `marlin` method.
pub fn emulate(
    view: &FolderView,
    cfg: &AnyConfig,
    quant: Option<&QuantInfo>,
    engine: Engine,
    legacy_marlin: bool,
) -> LoadEmulation {
    let rules = engine.rules();
    let mut f = Findings::default();
    let q = quant.map(|info| Quantized::new(view, info, legacy_marlin));
    // The checkpoint-wide method.
    let global = q
        .as_ref()
        .map_or(Method::Unquantized, |q| (rules.method)(q, &mut f));
    let (linears, plain) = engine_layout(cfg, rules.fuses);
    let mut expect = Expect::new();
    let mut modules = vec![];
    let mut shape_limits = vec![];
    for l in &linears {
        let mut d = Decision::new(global, quant);
        if let Some(q) = &q {
            (rules.module)(q, l, &mut d, &mut f);
        }
        shape_limits.extend(marlin_shape_limit(l, &d));
        legacy_marlin_limits(l, &d, &mut f);
        for m in &l.members {
            expect_member(&mut expect, m, &d, rules.drops_g_idx);
        }
        modules.push(EngineModule::new(l, d));
    }
    if global == Method::MarlinLegacy && modules.iter().any(|m| m.method == Method::Unquantized) {
        f.warning(
            "modules are kept in 16 bits by dynamic rules: vLLM 0.10.1.1's legacy marlin method \
             applies no per-module rules and would build them as Marlin layers; a loader that \
             honours `dynamic` (as SGLang's gptq methods do) loads them",
            "quantize every Linear for a legacy-marlin loader, or serve the GPTQ folder",
        );
    }
    let head = quant
        .filter(|q| rules.quantizes_head && q.lm_head)
        .map(|q| Decision::new(global, Some(q)));
    expect_others(&mut expect, &plain, head.as_ref(), rules);
    let (missing, unused) = compare(view, &expect, rules, &mut f);
    LoadEmulation {
        modules,
        missing,
        unused,
        findings: f,
        shape_limit: shape_limit_finding(&shape_limits, rules),
    }
}

/// The difference between what the engine loads and what the shards hold: the tensors it would
/// load that are missing, and those it builds no parameter for (with the findings).
fn compare(
    view: &FolderView,
    expect: &Expect,
    rules: &Rules,
    f: &mut Findings,
) -> (Vec<String>, Vec<String>) {
    let mut missing = vec![];
    let mut wrong = vec![];
    for (name, (dtypes, shape, required)) in expect {
        match view.tensors.get(name) {
            None if *required => missing.push(name.clone()),
            Some(t) if &t.shape != shape || !dtypes.contains(&t.dtype) => {
                let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
                wrong.push(format!(
                    "{name} is {} {:?}, the engine's parameter is {} {:?}",
                    t.dtype.name(),
                    t.shape,
                    names.join("/"),
                    shape
                ));
            }
            _ => {}
        }
    }
    let unused: Vec<String> = view
        .tensors
        .keys()
        .filter(|n| !expect.contains_key(*n) && !ignored(n, rules))
        .cloned()
        .collect();
    difference_findings(&missing, &wrong, &unused, rules, f);
    (missing, unused)
}

/// Tensors an engine skips without a parameter: rotary buffers, and the stray biases and
/// `g_idx` its rules ignore.
fn ignored(name: &str, rules: &Rules) -> bool {
    name.contains("rotary_emb.inv_freq")
        || name.contains("rotary_emb.cos_cached")
        || name.contains("rotary_emb.sin_cached")
        || (rules.ignores_stray_bias && name.ends_with(".bias"))
        || (rules.drops_g_idx && name.ends_with(".g_idx"))
}

fn difference_findings(
    missing: &[String],
    wrong: &[String],
    unused: &[String],
    rules: &Rules,
    f: &mut Findings,
) {
    if !missing.is_empty() {
        f.problem(
            &format!(
                "{} tensor(s) that {} would load are not in the shards, so those parameters stay \
                 uninitialized (garbage output): {}",
                missing.len(),
                rules.label,
                summarize(missing)
            ),
            "the checkpoint and its quantization settings disagree: re-create it with soar-gptq \
             quantize (and the --engine you serve with)",
        );
    }
    if !wrong.is_empty() {
        f.problem(
            &format!(
                "{} tensor(s) do not fit the parameter the engine builds (its weight loader \
                 asserts the shape): {}",
                wrong.len(),
                summarize(wrong)
            ),
            "the bits or group size in the settings (or a dynamic rule) differ from how the \
             tensors were packed; re-create the checkpoint",
        );
    }
    if !unused.is_empty() {
        let what = format!(
            "{} tensor(s) in the shards match no parameter the engine builds ({}): {}",
            unused.len(),
            rules.unused,
            summarize(unused)
        );
        f.push(
            rules.unused_fatal,
            Finding::new(
                &what,
                "a module the engine quantizes is stored unquantized or the reverse: check that \
                 the dynamic rules match the engine's (fused) module names, e.g. \
                 model.layers.0.self_attn.qkv_proj",
            ),
        );
    }
}

/// The first few entries of a long list, and how many more there are.
pub fn summarize(items: &[String]) -> String {
    const SHOWN: usize = 4;
    let mut s = items[..items.len().min(SHOWN)].join(", ");
    if items.len() > SHOWN {
        s.push_str(&format!(", ... and {} more", items.len() - SHOWN));
    }
    s
}
