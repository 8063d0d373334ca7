//! The weight loaders of SGLang, vLLM and transformers, emulated on a folder's tensor names and
//! shapes: which Linears each engine builds for the architecture (fused `qkv_proj` and
//! `gate_up_proj` in SGLang and vLLM, the output gates `o_gate` / `z_proj` built with the quant
//! config), which method each gets once `dynamic` rules are applied to the name the engine uses,
//! the tensor names and shapes that method loads, and the difference with what the shards hold.
//! docs/engines.md states each rule with its source.

use super::{Engine, Finding, FolderView};
use crate::checkpoint::Dtype;
use crate::format::marlin::{marlin_group_ok, MARLIN_K_MULTIPLE, MARLIN_N_MULTIPLE};
use crate::format::quantized::{DynamicRule, QuantFormat, QuantInfo, FUSED_GROUPS};
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
    fn quantized(self) -> bool {
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

/// A checkpoint Linear: its prefix, `[N, K]`, and whether it has a bias.
#[derive(Debug, Clone)]
struct Member {
    prefix: String,
    n: usize,
    k: usize,
    bias: bool,
}

/// An engine Linear: its name and the checkpoint modules it loads.
type EngineLinear = (String, Vec<Member>);

/// The Linears of `cfg` as `engine` builds them, and the other tensors it loads.
fn engine_layout(
    cfg: &AnyConfig,
    engine: Engine,
) -> (Vec<EngineLinear>, Vec<(String, Vec<usize>)>) {
    let mut plain = vec![];
    let mut linears: BTreeMap<String, Member> = BTreeMap::new();
    let mut order = vec![];
    for (name, shape) in cfg.expected_tensors() {
        let in_layer = name.starts_with("model.layers.");
        match name.strip_suffix(".weight") {
            Some(p) if in_layer && shape.len() == 2 => {
                order.push(p.to_string());
                linears.insert(
                    p.to_string(),
                    Member {
                        prefix: p.to_string(),
                        n: shape[0],
                        k: shape[1],
                        bias: false,
                    },
                );
            }
            _ => plain.push((name, shape)),
        }
    }
    // Biases belong to their Linear.
    plain.retain(|(name, _)| match name.strip_suffix(".bias") {
        Some(p) if linears.contains_key(p) => {
            linears.get_mut(p).unwrap().bias = true;
            false
        }
        _ => true,
    });
    let mut out: Vec<EngineLinear> = vec![];
    let mut done = BTreeSet::new();
    for p in &order {
        if done.contains(p) {
            continue;
        }
        let (parent, leaf) = p.rsplit_once('.').unwrap_or(("", p));
        let fused = (engine != Engine::Transformers)
            .then(|| FUSED_GROUPS.iter().find(|(_, m)| m.contains(&leaf)))
            .flatten();
        match fused {
            Some((fname, members)) => {
                let ms: Vec<Member> = members
                    .iter()
                    .filter_map(|m| linears.get(&format!("{parent}.{m}")).cloned())
                    .collect();
                for m in &ms {
                    done.insert(m.prefix.clone());
                }
                out.push((format!("{parent}.{fname}"), ms));
            }
            None => {
                done.insert(p.clone());
                out.push((p.clone(), vec![linears[p].clone()]));
            }
        }
    }
    (out, plain)
}

/// The first `dynamic` rule matching `name`, in the order the file lists them (the engines'
/// `get_dynamic_override`).
fn first_rule<'a>(q: &'a QuantInfo, name: &str) -> Option<&'a DynamicRule> {
    q.dynamic.iter().find(|r| r.matches(name))
}

/// SGLang's `is_gptq_marlin_compatible` on the checkpoint-wide settings.
fn sglang_marlin_compatible(q: &QuantInfo) -> Option<String> {
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
struct Decision {
    method: Method,
    bits: u8,
    group_size: GroupSize,
    sym: bool,
    desc_act: bool,
    rule: Option<String>,
}

/// Tensor expectations: name → (allowed dtypes, shape, required).
type Expect = BTreeMap<String, (Vec<Dtype>, Vec<usize>, bool)>;

const FLOATS: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

fn expect_member(e: &mut Expect, m: &Member, d: &Decision, engine: Engine) {
    let p = &m.prefix;
    // The engines size `scales`/`qzeros` by floor division (`input_size // group_size`).
    let g = d.group_size.columns().map_or(1, |g| m.k / g);
    let b = d.bits as usize;
    match d.method {
        Method::Unquantized => {
            e.insert(
                format!("{p}.weight"),
                (FLOATS.to_vec(), vec![m.n, m.k], true),
            );
        }
        Method::MarlinLegacy => {
            e.insert(
                format!("{p}.B"),
                (vec![Dtype::I32], vec![m.k / 16, 2 * m.n], true),
            );
            e.insert(format!("{p}.s"), (FLOATS.to_vec(), vec![g, m.n], true));
        }
        _ => {
            e.insert(
                format!("{p}.qweight"),
                (vec![Dtype::I32], vec![m.k * b / 32, m.n], true),
            );
            e.insert(
                format!("{p}.qzeros"),
                (vec![Dtype::I32], vec![g, m.n * b / 32], true),
            );
            e.insert(format!("{p}.scales"), (FLOATS.to_vec(), vec![g, m.n], true));
            // g_idx is used only with desc_act (SGLang and transformers fill the trivial one;
            // vLLM ≥ 0.30 drops the tensor).
            let need = d.desc_act && engine != Engine::Vllm;
            e.insert(format!("{p}.g_idx"), (vec![Dtype::I32], vec![m.k], need));
        }
    }
    if m.bias {
        e.insert(format!("{p}.bias"), (FLOATS.to_vec(), vec![m.n], true));
    }
}

/// The result of emulating one engine's load of the folder's tensors.
pub struct LoadEmulation {
    pub modules: Vec<EngineModule>,
    pub missing: Vec<String>,
    pub unused: Vec<String>,
    pub problems: Vec<Finding>,
    pub warnings: Vec<Finding>,
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
    let mut problems = vec![];
    let mut warnings = vec![];
    let (layout, plain) = engine_layout(cfg, engine);
    // Which modules hold quantized tensors (vLLM's safetensors scan).
    let quantized_in_shards: BTreeSet<&str> = view
        .tensors
        .iter()
        .filter(|(_, t)| !t.dtype.is_float())
        .filter_map(|(n, _)| n.rsplit_once('.').map(|(p, _)| p))
        .collect();

    // A config that says "marlin" over GPTQ tensors (qweight, no B) is mislabelled: the messages
    // below say what the folder holds rather than what the label promises.
    let relabelled_gptq = quant.is_some_and(|q| q.format == QuantFormat::Marlin)
        && view.tensors.keys().any(|n| n.ends_with(".qweight"))
        && !view.tensors.keys().any(|n| n.ends_with(".B"));
    const RELABELLED_FIX: &str = "the tensors are GPTQ (qweight, qzeros, scales), not Marlin \
        tiles: set checkpoint_format to \"gptq\" in config.json's quantization_config (and in \
        quantize_config.json), or serve the folder this one was copied from";
    // The checkpoint-wide method.
    let global = match quant {
        None => Method::Unquantized,
        Some(q) => match engine {
            Engine::Sglang => {
                if q.format == QuantFormat::Marlin {
                    if relabelled_gptq {
                        problems.push(Finding::new(
                            "checkpoint_format is \"marlin\", but the folder holds GPTQ tensors \
                             (qweight, qzeros, scales) and no Marlin tiles (B, s): the label is \
                             wrong. No current SGLang release reads checkpoint_format \"marlin\" \
                             (gptq_marlin refuses it), so SGLang does not select gptq_marlin and \
                             falls back to the plain gptq method; readers that trust the label \
                             (a legacy marlin release, GPTQModel) look for B/s and find qweight",
                            RELABELLED_FIX,
                        ));
                        if legacy_marlin {
                            Method::MarlinLegacy
                        } else {
                            Method::Gptq
                        }
                    } else if legacy_marlin {
                        Method::MarlinLegacy
                    } else {
                        problems.push(Finding::new(
                            "checkpoint_format is \"marlin\": no current SGLang release reads it \
                             (gptq_marlin refuses Marlin-format checkpoints, and the legacy \
                             `marlin` method is imported from vLLM, which removed it after \
                             0.10.1.1; it also ran fp16 activations only), so SGLang falls back \
                             to plain gptq and finds B/s where it expects qweight/scales",
                            "serve the GPTQ folder that pack-marlin read: SGLang repacks it to \
                             Marlin at load (gptq_marlin)",
                        ));
                        Method::Gptq
                    }
                } else {
                    match sglang_marlin_compatible(q) {
                        None => Method::GptqMarlin,
                        Some(why) => {
                            warnings.push(Finding::new(
                                &format!("SGLang does not select gptq_marlin: {why}"),
                                "quantize with --bits 4 (or 8), symmetric, group size -1, 32, 64 \
                                 or 128 for the Marlin kernels",
                            ));
                            Method::Gptq
                        }
                    }
                }
            }
            Engine::Vllm => {
                if relabelled_gptq {
                    problems.push(Finding::new(
                        "checkpoint_format is \"marlin\", but the folder holds GPTQ tensors \
                         (qweight, qzeros, scales) and no Marlin tiles (B, s): the label is \
                         wrong. vLLM ignores checkpoint_format and reads the qweight/scales, but \
                         readers that trust the label (GPTQModel, this tool) look for B/s",
                        RELABELLED_FIX,
                    ));
                } else if q.format == QuantFormat::Marlin {
                    problems.push(Finding::new(
                        "checkpoint_format is \"marlin\": vLLM removed the legacy marlin method \
                         in PR #23204 (0.10.1.1 was the last release with it) and ignores \
                         checkpoint_format, so it expects qweight/scales where the folder has B/s",
                        "serve the GPTQ folder that pack-marlin read",
                    ));
                }
                if let Some(why) = sglang_marlin_compatible(q) {
                    problems.push(Finding::new(
                        &format!(
                            "vLLM's GPTQ method (auto_gptq) takes 4- or 8-bit symmetric \
                             checkpoints with group size -1, 32, 64 or 128 and all of bits, \
                             group_size, sym, desc_act present; this one has {why}"
                        ),
                        "re-quantize with --bits 4 (or 8), symmetric, --group-size 128",
                    ));
                }
                if q.desc_act && q.group_size != GroupSize::PerRow {
                    problems.push(Finding::new(
                        "desc_act is true: vLLM ≥ 0.30 refuses group activation ordering \
                         (\"desc_act=True is no longer supported\", PR #54809)",
                        "re-quantize with --act-order static (the default): same accuracy, \
                         trivial g_idx",
                    ));
                }
                Method::AutoGptq
            }
            Engine::Transformers => {
                if q.format == QuantFormat::Marlin {
                    problems.push(Finding::new(
                        "checkpoint_format is \"marlin\": transformers loads GPTQ through \
                         GPTQModel, which refuses the legacy Marlin format",
                        "load the GPTQ folder that pack-marlin read",
                    ));
                }
                if ![2, 3, 4, 8].contains(&q.bits) {
                    problems.push(Finding::new(
                        &format!(
                            "bits is {}: transformers' GPTQConfig takes 2, 3, 4 or 8",
                            q.bits
                        ),
                        "re-quantize with --bits 4",
                    ));
                }
                let positive: Vec<&str> = q
                    .dynamic
                    .iter()
                    .filter(|r| !r.skip)
                    .map(|r| r.key.as_str())
                    .collect();
                if !positive.is_empty() {
                    problems.push(Finding::new(
                        &format!(
                            "dynamic rules {positive:?} set per-module bits or group sizes, but \
                             transformers ignores `dynamic` and quantizes every module with the \
                             global settings"
                        ),
                        "serve mixed-precision checkpoints with SGLang or vLLM",
                    ));
                }
                Method::GptqModel
            }
        },
    };
    let mibtq: Option<Vec<String>> = quant.and_then(|q| {
        q.raw
            .get("modules_in_block_to_quantize")
            .and_then(serde_json::Value::as_array)
            .map(|outer| {
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
                v
            })
    });
    if engine == Engine::Transformers
        && quant.is_some_and(|q| q.dynamic.iter().any(|r| r.skip))
        && mibtq.is_none()
    {
        problems.push(Finding::new(
            "dynamic \"-:\" rules keep modules unquantized, but transformers ignores `dynamic`: \
             without modules_in_block_to_quantize it builds every Linear of the decoder layers \
             as a GPTQ layer and finds .weight where it expects .qweight",
            "quantize with --engine transformers, which writes modules_in_block_to_quantize",
        ));
    }

    let mut expect: Expect = BTreeMap::new();
    let mut modules = vec![];
    let mut shape_limits = vec![];
    for (name, members) in &layout {
        let mut d = Decision {
            method: global,
            bits: quant.map_or(16, |q| q.bits),
            group_size: quant.map_or(GroupSize::PerRow, |q| q.group_size),
            sym: quant.is_none_or(|q| q.sym),
            desc_act: quant.is_some_and(|q| q.desc_act),
            rule: None,
        };
        if let Some(q) = quant {
            match engine {
                Engine::Sglang | Engine::Vllm => {
                    if let Some(r) = first_rule(q, name) {
                        d.rule = Some(r.key.clone());
                        if r.skip {
                            d.method = Method::Unquantized;
                        } else {
                            let o = r.overrides;
                            d.bits = o.bits.unwrap_or(d.bits);
                            d.group_size = o.group_size.unwrap_or(d.group_size);
                            d.desc_act = o.desc_act.unwrap_or(d.desc_act);
                            if matches!(d.method, Method::GptqMarlin | Method::AutoGptq) {
                                d.sym = o.sym.unwrap_or(d.sym);
                                if !(d.sym && (d.bits == 4 || d.bits == 8))
                                    || !marlin_group_ok(d.group_size)
                                {
                                    problems.push(Finding::new(
                                        &format!(
                                            "dynamic rule {:?} gives {name} {}-bit {} group {}, \
                                             which {} cannot run (4 or 8 bits, symmetric, group \
                                             -1/32/64/128): the engine raises while building it",
                                            r.key,
                                            d.bits,
                                            if d.sym { "sym" } else { "asym" },
                                            d.group_size,
                                            d.method.name()
                                        ),
                                        "change the rule's bits or group_size",
                                    ));
                                }
                            }
                        }
                    }
                    if engine == Engine::Vllm && d.method.quantized() {
                        // vLLM builds a Linear quantized only if its tensors are quantized
                        // (modules_in_block_to_quantize, else a scan of the shards).
                        let flags: Vec<bool> = members
                            .iter()
                            .map(|m| match &mibtq {
                                Some(list) => list.iter().any(|x| m.prefix.contains(x.as_str())),
                                None => quantized_in_shards.contains(m.prefix.as_str()),
                            })
                            .collect();
                        if flags.iter().any(|&f| f) && !flags.iter().all(|&f| f) {
                            problems.push(Finding::new(
                                &format!(
                                    "{name}: some but not all of {} are quantized; vLLM loads \
                                     them as one layer and raises \"Detected some but not all \
                                     shards ... are quantized\"",
                                    members
                                        .iter()
                                        .map(|m| m.prefix.as_str())
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                ),
                                "quantize all members of a fused group or none",
                            ));
                        } else if !flags.iter().any(|&f| f) {
                            d.method = Method::Unquantized;
                        }
                    }
                }
                Engine::Transformers => {
                    if let Some(list) = &mibtq {
                        let m = &members[0];
                        if !list.iter().any(|x| m.prefix.ends_with(x.as_str())) {
                            d.method = Method::Unquantized;
                        }
                    }
                }
            }
        }
        if matches!(d.method, Method::GptqMarlin | Method::AutoGptq) {
            let n: usize = members.iter().map(|m| m.n).sum();
            let k = members[0].k;
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
            if d.group_size.columns().is_some_and(|g| g < k && k % g != 0) {
                why.push(format!(
                    "in_features {k} is not a multiple of the group size"
                ));
            }
            if !why.is_empty() {
                shape_limits.push(format!("{name} ({})", why.join(", ")));
            }
        }
        if d.method == Method::MarlinLegacy {
            if d.group_size != GroupSize::G128 && d.group_size != GroupSize::PerRow {
                problems.push(Finding::new(
                    &format!(
                        "{name}: group size {}; the legacy marlin method takes 128 or -1",
                        d.group_size
                    ),
                    "re-quantize with --group-size 128",
                ));
            }
            if d.desc_act {
                problems.push(Finding::new(
                    &format!(
                        "{name}: desc_act is true; the legacy marlin method has no act-order \
                         (the g_idx_sort_indices extension is read by no engine)"
                    ),
                    "re-quantize with --act-order static",
                ));
            }
        }
        for m in members {
            expect_member(&mut expect, m, &d, engine);
        }
        modules.push(EngineModule {
            name: name.clone(),
            members: members.iter().map(|m| m.prefix.clone()).collect(),
            method: d.method,
            bits: d.method.quantized().then_some(d.bits),
            group_size: d.method.quantized().then_some(d.group_size),
            rule: d.rule,
        });
    }
    // Beyond the Marlin kernels' shapes the engine raises while building the layer, unless it is
    // told to use plain gptq (SGLang: --quantization gptq, float16 only); whether that is a way
    // out depends on the model, so the caller judges.
    let shape_limit = (!shape_limits.is_empty()).then(|| {
        Finding::new(
            &format!(
                "{} Linear(s) exceed the Marlin kernels' shape limits (out_features a multiple \
                 of 64, in_features of 128 and of the group size), and {} raises while building \
                 them with gptq_marlin: {}",
                shape_limits.len(),
                engine.label(),
                summarize(&shape_limits)
            ),
            match engine {
                Engine::Sglang => {
                    "serve with --quantization gptq --dtype float16 (the plain gptq kernels), or \
                     keep those modules in 16 bits (--skip)"
                }
                _ => {
                    "keep those modules in 16 bits (--skip); vLLM may find another kernel for \
                     them, which this check does not model"
                }
            },
        )
    });
    if global == Method::MarlinLegacy && modules.iter().any(|m| m.method == Method::Unquantized) {
        warnings.push(Finding::new(
            "modules are kept in 16 bits by dynamic rules: vLLM 0.10.1.1's legacy marlin method \
             applies no per-module rules and would build them as Marlin layers; a loader that \
             honours `dynamic` (as SGLang's gptq methods do) loads them",
            "quantize every Linear for a legacy-marlin loader, or serve the GPTQ folder",
        ));
    }
    // The head: SGLang builds it unquantized whatever lm_head says; vLLM quantizes it when
    // lm_head is true.
    let head_quantized = engine == Engine::Vllm && quant.is_some_and(|q| q.lm_head);
    for (name, shape) in &plain {
        if head_quantized && name == "lm_head.weight" {
            let m = Member {
                prefix: "lm_head".into(),
                n: shape[0],
                k: shape[1],
                bias: false,
            };
            let q = quant.unwrap();
            let d = Decision {
                method: global,
                bits: q.bits,
                group_size: q.group_size,
                sym: q.sym,
                desc_act: q.desc_act,
                rule: None,
            };
            expect_member(&mut expect, &m, &d, engine);
            continue;
        }
        expect.insert(name.clone(), (FLOATS.to_vec(), shape.clone(), true));
    }

    // The difference.
    let mut missing = vec![];
    let mut wrong = vec![];
    for (name, (dtypes, shape, required)) in &expect {
        match view.tensors.get(name) {
            None if *required => missing.push(name.clone()),
            Some(t) if &t.shape != shape || !dtypes.contains(&t.dtype) => {
                wrong.push(format!(
                    "{name} is {} {:?}, the engine's parameter is {} {:?}",
                    t.dtype.name(),
                    t.shape,
                    dtypes
                        .iter()
                        .map(|d| d.name())
                        .collect::<Vec<_>>()
                        .join("/"),
                    shape
                ));
            }
            _ => {}
        }
    }
    let ignored = |name: &str| -> bool {
        name.contains("rotary_emb.inv_freq")
            || name.contains("rotary_emb.cos_cached")
            || name.contains("rotary_emb.sin_cached")
            || (engine != Engine::Transformers && name.ends_with(".bias"))
            || (engine == Engine::Vllm && name.ends_with(".g_idx"))
    };
    let unused: Vec<String> = view
        .tensors
        .keys()
        .filter(|n| !expect.contains_key(*n) && !ignored(n))
        .cloned()
        .collect();
    if !missing.is_empty() {
        problems.push(Finding::new(
            &format!(
                "{} tensor(s) that {} would load are not in the shards, so those parameters stay \
                 uninitialized (garbage output): {}",
                missing.len(),
                engine.label(),
                summarize(&missing)
            ),
            "the checkpoint and its quantization settings disagree: re-create it with soar-gptq \
             quantize (and the --engine you serve with)",
        ));
    }
    if !wrong.is_empty() {
        problems.push(Finding::new(
            &format!(
                "{} tensor(s) do not fit the parameter the engine builds (its weight loader \
                 asserts the shape): {}",
                wrong.len(),
                summarize(&wrong)
            ),
            "the bits or group size in the settings (or a dynamic rule) differ from how the \
             tensors were packed; re-create the checkpoint",
        ));
    }
    if !unused.is_empty() {
        let what = match engine {
            Engine::Sglang => {
                "SGLang's load_weights looks every name up in the model's parameters and raises \
                 KeyError on the first one it does not build"
            }
            Engine::Vllm => {
                "vLLM's weight loader raises \"There is no module or parameter named ...\" on \
                 the first one"
            }
            Engine::Transformers => {
                "transformers ignores them with an \"unexpected keys\" warning, so those weights \
                 are lost"
            }
        };
        let f = Finding::new(
            &format!(
                "{} tensor(s) in the shards match no parameter the engine builds ({what}): {}",
                unused.len(),
                summarize(&unused)
            ),
            "a module the engine quantizes is stored unquantized or the reverse: check that the \
             dynamic rules match the engine's (fused) module names, e.g. \
             model.layers.0.self_attn.qkv_proj",
        );
        if engine == Engine::Transformers {
            warnings.push(f);
        } else {
            problems.push(f);
        }
    }
    LoadEmulation {
        modules,
        missing,
        unused,
        problems,
        warnings,
        shape_limit,
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
