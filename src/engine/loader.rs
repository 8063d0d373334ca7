//! The weight loaders of SGLang, vLLM and transformers, emulated on a folder's tensor names and
//! shapes: which Linears each engine builds for the architecture (fused `qkv_proj` and
//! `gate_up_proj` in SGLang and vLLM, the output gates `o_gate` / `z_proj` built with the quant
//! config), which method each gets once `dynamic` rules are applied to the name the engine uses,
//! the tensor names and shapes that method loads, and the difference with what the shards hold.
//! docs/engines.md states each rule with its source.

use super::linears::{
    engine_layout, Decision, EngineLinear, EngineModule, LinearMethod, Member, Quantized,
};
use super::rules::Rules;
use super::{Engine, Finding, Findings, FolderView};
use crate::checkpoint::Dtype;
use crate::format::marlin::{MARLIN_K_MULTIPLE, MARLIN_N_MULTIPLE};
use crate::format::quantized::QuantInfo;
use crate::model::AnyConfig;
use crate::scheme::GroupSize;
use std::collections::BTreeMap;

/// Why a Linear is beyond the Marlin kernels' shapes (out_features, fused: the sum, a multiple
/// of 64; in_features of 128 and of the group size), if it is and gets a Marlin method.
fn marlin_shape_limit(l: &EngineLinear, d: &Decision) -> Option<String> {
    if !matches!(d.method, LinearMethod::GptqMarlin | LinearMethod::AutoGptq) {
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
    if d.method != LinearMethod::MarlinLegacy {
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
        LinearMethod::Unquantized => put("weight", &FLOATS, vec![m.n, m.k], true),
        LinearMethod::MarlinLegacy => {
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
        .map_or(LinearMethod::Unquantized, |q| (rules.method)(q, &mut f));
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
    if global == LinearMethod::MarlinLegacy
        && modules
            .iter()
            .any(|m| m.method == LinearMethod::Unquantized)
    {
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
