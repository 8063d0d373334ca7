//! `inspect DIR` for quantized checkpoints (GPTQ v1/v2 or Marlin, any architecture): the
//! settings and `dynamic` rules, which modules are quantized and which are kept in 16 bits, sizes,
//! and a full check: the tensors (against the layout `config.json` implies when it is a supported architecture, else
//! the quantized sets alone), fused groups (q/k/v, gate/up) that must share their settings, the
//! manifest hashes, and the Marlin unpack. It also says whether SGLang and vLLM would select
//! `gptq_marlin` for the checkpoint (docs/engines.md, What each engine builds) and, if not, why.
//! Any failed check is an error (exit 1); not being eligible for `gptq_marlin` is not.

use crate::checkpoint::manifest::{verify_manifest, MANIFEST_FILE};
use crate::checkpoint::Checkpoint;
use crate::format::marlin::{
    check_marlin_shape, gptq_codes_to_marlin, marlin_group_ok, marlin_to_gptq_codes, pack_marlin,
    unpack_marlin, unpermute_scales, MARLIN_K_MULTIPLE, MARLIN_N_MULTIPLE,
};
use crate::format::quantized::{
    at, fused_groups, read_json, read_quant_info, validate_quantized_modules, DynamicRule,
    QuantFormat, QuantInfo, QuantModule, QuantOverride, CONFIG_FILE, QUANTIZE_CONFIG_FILE,
    SORT_INDICES_SUFFIX,
};
use crate::scheme::GroupSize;
use anyhow::{anyhow, bail, ensure, Context, Result};
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;

/// The checkpoint-wide settings.
#[derive(Debug, Clone, Serialize)]
pub struct QuantSettings {
    pub quant_method: Option<String>,
    pub checkpoint_format: String,
    pub bits: u8,
    pub group_size: GroupSize,
    pub sym: bool,
    pub desc_act: bool,
    pub lm_head: bool,
    /// File the settings were read from.
    pub source: String,
    /// Keys the engines need that the file does not spell out.
    pub missing_keys: Vec<String>,
}

/// One `dynamic` rule and how many modules it covers.
#[derive(Debug, Clone, Serialize)]
pub struct RuleReport {
    pub key: String,
    pub skip: bool,
    pub overrides: QuantOverride,
    /// Quantized modules (positive rule) or kept modules (skip rule) it matches.
    pub matches: usize,
}

/// A quantized Linear.
#[derive(Debug, Clone, Serialize)]
pub struct ModuleReport {
    pub prefix: String,
    pub n: usize,
    pub k: usize,
    pub bits: u8,
    pub group_size: GroupSize,
    pub sym: bool,
    pub desc_act: bool,
    pub act_order: bool,
    pub bytes: u64,
}

/// A 2-D `*.weight` kept in its float dtype.
#[derive(Debug, Clone, Serialize)]
pub struct KeptTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// The `-:` rule that keeps it unquantized, if any.
    pub skip_rule: Option<String>,
}

/// Modules the engines load as one fused layer.
#[derive(Debug, Clone, Serialize)]
pub struct FusedGroupReport {
    pub fused: String,
    pub members: Vec<String>,
    /// `"quantized: 4-bit, group 128, sym, trivial g_idx"` or `"kept BF16"`.
    pub state: String,
}

/// Whether one engine would run the checkpoint with `gptq_marlin`.
#[derive(Debug, Clone, Serialize)]
pub struct EngineVerdict {
    pub engine: String,
    pub gptq_marlin: bool,
    /// Why not (empty when it would).
    pub reasons: Vec<String>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QuantInspectReport {
    pub dir: String,
    pub architecture: Option<String>,
    pub settings: QuantSettings,
    pub dynamic_rules: Vec<RuleReport>,
    /// What the tensors were validated against.
    pub validated_against: String,
    pub quantized_modules: Vec<ModuleReport>,
    pub kept_modules: Vec<KeptTensor>,
    pub tensors: usize,
    pub shards: Vec<String>,
    pub quantized_bytes: u64,
    pub other_bytes: u64,
    pub total_bytes: u64,
    /// What the quantized modules would take in BF16.
    pub quantized_bf16_bytes: u64,
    pub fused_groups: Vec<FusedGroupReport>,
    pub manifest: Option<String>,
    pub marlin_check: String,
    pub engines: Vec<EngineVerdict>,
    /// Whether SGLang, vLLM and transformers would load the folder (emulated).
    pub loads: Vec<crate::engine::LoadSummary>,
    pub warnings: Vec<String>,
    pub valid: bool,
}

/// Inspects and validates the quantized checkpoint in `dir`; a failed check is an error.
pub fn inspect_quantized(dir: &Path) -> Result<QuantInspectReport> {
    let info = read_quant_info(dir)?.ok_or_else(|| {
        anyhow!(
            "{} has no quantization_config in {CONFIG_FILE} and no {QUANTIZE_CONFIG_FILE}: it is \
             not a GPTQ or Marlin checkpoint",
            dir.display()
        )
    })?;
    // The manifest first: a corrupted shard is then reported as such, not as a parse error.
    let manifest = check_manifest(dir)?;
    let ck = Checkpoint::open(dir)?;
    ck.check_finite()?;
    let expected = crate::model::expected_bf16_tensors(dir);
    let validated_against = validated_against(dir, &expected);
    let modules = validate_quantized_modules(&ck, &info, expected.as_ref().ok().map(Vec::as_slice))
        .with_context(|| format!("validation of {} failed", dir.display()))?;
    let architecture = architecture(dir);

    let mut warnings = Vec::new();
    let by_prefix: HashMap<&str, &QuantModule> =
        modules.iter().map(|m| (m.prefix.as_str(), m)).collect();
    let kept = kept_tensors(&ck, &info, &modules, &mut warnings);

    let dynamic_rules = info
        .dynamic
        .iter()
        .map(|r| rule_report(r, &modules, &kept))
        .collect();
    let fused = check_fused_groups(&ck, &info, &modules, &by_prefix, &mut warnings)?;
    let marlin_check = marlin_consistency(&ck, &info, &modules)?;
    let engines = gptq_marlin_verdicts(&info, &modules);
    let loads = crate::engine::summaries(dir)?;
    warnings.extend(super::derived_key_warnings(dir));

    let total_bytes: u64 = ck.entries().map(|(_, e)| e.nbytes() as u64).sum();
    let quantized_bytes: u64 = modules.iter().map(|m| m.bytes).sum();
    Ok(QuantInspectReport {
        dir: dir.display().to_string(),
        architecture,
        settings: settings_report(&info),
        dynamic_rules,
        validated_against,
        quantized_modules: modules.iter().map(module_report).collect(),
        kept_modules: kept,
        tensors: ck.names().count(),
        shards: ck.shard_file_names(),
        quantized_bytes,
        other_bytes: total_bytes - quantized_bytes,
        total_bytes,
        quantized_bf16_bytes: modules.iter().map(|m| 2 * (m.n * m.k) as u64).sum(),
        fused_groups: fused,
        manifest,
        marlin_check,
        engines,
        loads,
        warnings,
        valid: true,
    })
}

/// Checks the files against `manifest.json` when there is one (an error when any differs); what
/// the report says of it.
fn check_manifest(dir: &Path) -> Result<Option<String>> {
    Ok(if dir.join(MANIFEST_FILE).is_file() {
        let problems = verify_manifest(dir)?;
        ensure!(
            problems.is_empty(),
            "{} does not match the files in {} (corrupted or modified after writing; re-create \
             or re-download the checkpoint):\n  {}",
            MANIFEST_FILE,
            dir.display(),
            problems.join("\n  ")
        );
        Some("all files match their SHA-256".to_string())
    } else {
        None
    })
}

/// What the tensors are validated against: the layout config.json implies, or (when it is not a
/// config of a supported architecture) the quantized tensor sets alone.
fn validated_against(
    dir: &Path,
    expected: &std::result::Result<Vec<(String, Vec<usize>)>, String>,
) -> String {
    match expected {
        Ok(e) => format!(
            "{} layout from config.json ({} tensors)",
            crate::model::AnyConfig::from_file(&dir.join(CONFIG_FILE))
                .map_or("config.json", |c| c.display_name()),
            e.len()
        ),
        Err(why) => format!(
            "quantized tensor sets only (config.json is not a config of a supported architecture: {})",
            why.lines().next().unwrap_or_default()
        ),
    }
}

/// config.json's `architectures`, comma-separated, when it has them.
fn architecture(dir: &Path) -> Option<String> {
    dir.join(CONFIG_FILE)
        .is_file()
        .then(|| read_json(&dir.join(CONFIG_FILE)).ok())
        .flatten()
        .and_then(|c| {
            c.get("architectures")?.as_array().map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            })
        })
}

/// The 2-D float `.weight` tensors kept in 16 bits, in natural order, with the skip rule that
/// keeps each; warns of decoder-layer ones no rule keeps (the engines would expect them
/// quantized).
fn kept_tensors(
    ck: &Checkpoint,
    info: &QuantInfo,
    modules: &[QuantModule],
    warnings: &mut Vec<String>,
) -> Vec<KeptTensor> {
    let mut kept = Vec::new();
    for (name, e) in ck.entries() {
        let Some(p) = name.strip_suffix(".weight") else {
            continue;
        };
        if e.shape.len() != 2 || !e.dtype.is_float() {
            continue;
        }
        let rule = info.skip_rule(p).map(|r| r.key.clone());
        if rule.is_none() && !modules.is_empty() && p.contains(".layers.") {
            warnings.push(format!(
                "{} is kept {} but no dynamic \"-:\" rule in {} matches {p}: SGLang and vLLM \
                 would expect {p}.qweight and fail to load it; add a rule such as \"-:{}\": {{}}",
                at(ck, name),
                e.dtype.name(),
                info.source.display(),
                regex::escape(p)
            ));
        }
        kept.push(KeptTensor {
            name: name.clone(),
            dtype: e.dtype.name().to_string(),
            shape: e.shape.clone(),
            skip_rule: rule,
        });
    }
    kept.sort_by(|a, b| crate::format::quantized::natural_cmp(&a.name, &b.name));
    kept
}

/// The checkpoint-wide settings as reported.
fn settings_report(info: &QuantInfo) -> QuantSettings {
    QuantSettings {
        quant_method: info.quant_method().map(str::to_string),
        checkpoint_format: info.format.checkpoint_format().to_string(),
        bits: info.bits,
        group_size: info.group_size,
        sym: info.sym,
        desc_act: info.desc_act,
        lm_head: info.lm_head,
        source: info.source.display().to_string(),
        missing_keys: info.missing_keys.clone(),
    }
}

/// One quantized module as reported.
fn module_report(m: &QuantModule) -> ModuleReport {
    ModuleReport {
        prefix: m.prefix.clone(),
        n: m.n,
        k: m.k,
        bits: m.bits,
        group_size: m.group_size,
        sym: m.sym,
        desc_act: m.desc_act,
        act_order: m.act_order,
        bytes: m.bytes,
    }
}

fn rule_report(r: &DynamicRule, modules: &[QuantModule], kept: &[KeptTensor]) -> RuleReport {
    let matches = if r.skip {
        kept.iter()
            .filter(|t| r.matches(t.name.strip_suffix(".weight").unwrap_or(&t.name)))
            .count()
    } else {
        modules.iter().filter(|m| r.matches(&m.prefix)).count()
    };
    RuleReport {
        key: r.key.clone(),
        skip: r.skip,
        overrides: r.overrides,
        matches,
    }
}

fn describe(m: &QuantModule) -> String {
    format!(
        "quantized: {}-bit, group {}, {}, {}",
        m.bits,
        m.group_size,
        if m.sym { "sym" } else { "asym" },
        if m.act_order {
            "act-order g_idx"
        } else if m.desc_act {
            "desc_act with trivial g_idx"
        } else {
            "trivial g_idx"
        }
    )
}

/// Members of a fused layer must all be quantized with the same settings, or all be kept.
fn check_fused_groups(
    ck: &Checkpoint,
    info: &QuantInfo,
    modules: &[QuantModule],
    by_prefix: &HashMap<&str, &QuantModule>,
    warnings: &mut Vec<String>,
) -> Result<Vec<FusedGroupReport>> {
    let prefixes: Vec<String> = modules.iter().map(|m| m.prefix.clone()).collect();
    let mut out = Vec::new();
    let mut g_idx_differs = Vec::new();
    for (fused, members) in fused_groups(ck, &prefixes) {
        let states: Vec<(String, Option<&QuantModule>)> = members
            .iter()
            .map(|p| (p.clone(), by_prefix.get(p.as_str()).copied()))
            .collect();
        check_all_or_none(info, &fused, &states)?;
        let state = match states.first().and_then(|s| s.1) {
            None => {
                if info.skip_rule(&fused).is_none() && !modules.is_empty() {
                    warnings.push(format!(
                        "fused group {fused} is kept unquantized, but no dynamic \"-:\" rule in {} \
                         matches the fused name {fused}; SGLang and vLLM match rules against \
                         fused names, so they would expect it quantized; add a rule such as \
                         \"-:{}\": {{}}",
                        info.source.display(),
                        regex::escape(&fused)
                    ));
                }
                "kept unquantized".to_string()
            }
            Some(first) => {
                check_same_settings(&fused, first, &states)?;
                if first.act_order && !same_act_order(ck, info, first, &states)? {
                    g_idx_differs.push(fused.clone());
                }
                if let Some(rule) = info.skip_rule(&fused) {
                    warnings.push(format!(
                        "dynamic rule {:?} in {} matches the fused name {fused}, which SGLang and \
                         vLLM match rules against, so they would load its quantized members as \
                         unquantized; narrow the rule",
                        rule.key,
                        info.source.display()
                    ));
                }
                describe(first)
            }
        };
        out.push(FusedGroupReport {
            fused,
            members,
            state,
        });
    }
    warnings.extend(g_idx_warning(&g_idx_differs));
    Ok(out)
}

/// Refuses a fused group that mixes quantized and unquantized members.
fn check_all_or_none(
    info: &QuantInfo,
    fused: &str,
    states: &[(String, Option<&QuantModule>)],
) -> Result<()> {
    let quantized: Vec<&str> = states
        .iter()
        .filter(|s| s.1.is_some())
        .map(|s| s.0.as_str())
        .collect();
    if !quantized.is_empty() && quantized.len() != states.len() {
        let kept: Vec<&str> = states
            .iter()
            .filter(|s| s.1.is_none())
            .map(|s| s.0.as_str())
            .collect();
        bail!(
            "fused group {fused} mixes quantized and unquantized modules (SGLang and vLLM \
             load them as one layer): quantized {}, kept {}; quantize all of them or none \
             (check the dynamic rules in {})",
            quantized.join(", "),
            kept.join(", "),
            info.source.display()
        );
    }
    Ok(())
}

/// Refuses a quantized fused group whose members differ from `first` in their settings.
fn check_same_settings(
    fused: &str,
    first: &QuantModule,
    states: &[(String, Option<&QuantModule>)],
) -> Result<()> {
    let key = |m: &QuantModule| (m.bits, m.group_size, m.sym, m.desc_act, m.act_order);
    if let Some((p, m)) = states
        .iter()
        .map(|(p, m)| (p, m.unwrap()))
        .find(|(_, m)| key(m) != key(first))
    {
        bail!(
            "fused group {fused} mixes settings (SGLang and vLLM load it as one \
             layer with one set): {} is {} but {p} is {}",
            first.prefix,
            describe(first),
            describe(m)
        );
    }
    Ok(())
}

/// Whether every member of an act-order fused group has `first`'s input order (Marlin sort
/// indices, or GPTQ `g_idx`).
fn same_act_order(
    ck: &Checkpoint,
    info: &QuantInfo,
    first: &QuantModule,
    states: &[(String, Option<&QuantModule>)],
) -> Result<bool> {
    let order = |m: &QuantModule| -> Result<Vec<i32>> {
        match info.format {
            QuantFormat::Marlin => ck.i32_data(&format!("{}.{SORT_INDICES_SUFFIX}", m.prefix)),
            _ => ck.i32_data(&format!("{}.g_idx", m.prefix)),
        }
    };
    let reference = order(first)?;
    for (_, m) in states {
        if order(m.unwrap())? != reference {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The warning about fused groups whose members have different act-order `g_idx`, if any.
fn g_idx_warning(g_idx_differs: &[String]) -> Option<String> {
    if g_idx_differs.is_empty() {
        return None;
    }
    const SHOWN: usize = 3;
    Some(format!(
        "{} fused group(s) have members with different act-order g_idx ({}{}); vLLM is \
         believed to keep one g_idx per fused layer, so serving them fused may misplace input \
         columns (members that share an input should share one act-order permutation)",
        g_idx_differs.len(),
        g_idx_differs[..g_idx_differs.len().min(SHOWN)].join(", "),
        if g_idx_differs.len() > SHOWN {
            ", ..."
        } else {
            ""
        }
    ))
}

/// Finite scales everywhere, and the Marlin tiles round-trip: Marlin checkpoints unpack and repack
/// to the same words; GPTQ modules Marlin can hold re-tile and unpack back to their `qweight`
/// (the engines' load-time repack).
fn marlin_consistency(
    ck: &Checkpoint,
    info: &QuantInfo,
    modules: &[QuantModule],
) -> Result<String> {
    let (mut checked, mut not_marlin) = (0usize, 0usize);
    for m in modules {
        let (k, n) = (m.k, m.n);
        let s_name = match info.format {
            QuantFormat::Marlin => format!("{}.s", m.prefix),
            _ => format!("{}.scales", m.prefix),
        };
        let scales = ck.f32_data(&s_name)?;
        if let Some(i) = scales.iter().position(|v| !v.is_finite()) {
            bail!(
                "{}: value {i} is {}; scales must be finite",
                at(ck, &s_name),
                scales[i]
            );
        }
        match info.format {
            QuantFormat::Marlin => {
                let b_name = format!("{}.B", m.prefix);
                let b = ck.i32_data(&b_name)?;
                let codes = unpack_marlin(&b, k, n).with_context(|| at(ck, &b_name))?;
                ensure!(
                    pack_marlin(&codes, k, n)? == b,
                    "{} does not repack to itself after unpacking",
                    at(ck, &b_name)
                );
                unpermute_scales(&scales, m.groups, n).with_context(|| at(ck, &s_name))?;
                checked += 1;
            }
            _ => {
                if check_marlin_shape(k, n, m.group_size, m.bits, m.sym).is_err() {
                    not_marlin += 1;
                    continue;
                }
                let q_name = format!("{}.qweight", m.prefix);
                let qweight = ck.i32_data(&q_name)?;
                let g_idx = ck.i32_data(&format!("{}.g_idx", m.prefix))?;
                let mw = gptq_codes_to_marlin(&qweight, &g_idx, k, n)
                    .with_context(|| format!("re-tiling {}", at(ck, &q_name)))?;
                ensure!(
                    marlin_to_gptq_codes(&mw.b, &mw.sort_indices, k, n)? == qweight,
                    "{} does not survive the Marlin repack bit-exactly",
                    at(ck, &q_name)
                );
                checked += 1;
            }
        }
    }
    Ok(match info.format {
        QuantFormat::Marlin => format!(
            "{checked} module(s): Marlin tiles unpack and repack bit-exactly, scales finite"
        ),
        _ if not_marlin > 0 => format!(
            "{checked} module(s) re-tile to Marlin and back bit-exactly; {not_marlin} cannot be \
             held by Marlin (see engines); scales finite"
        ),
        _ => format!("{checked} module(s) re-tile to Marlin and back bit-exactly; scales finite"),
    })
}

/// SGLang's and vLLM's choice of `gptq_marlin` (docs/engines.md, What each engine builds), at
/// tensor-parallel size 1.
pub fn gptq_marlin_verdicts(info: &QuantInfo, modules: &[QuantModule]) -> Vec<EngineVerdict> {
    let mut common = config_reasons(info);
    common.extend(module_limits_reason(info, modules));
    let mut vllm = common.clone();
    let mut sglang = common;
    if info.format == QuantFormat::Marlin {
        vllm.push(
            "the checkpoint is in the legacy Marlin format (B/s tensors), which gptq_marlin does \
             not read; vLLM removed its `marlin` method in PR #23204 (Aug 2025): serve the GPTQ \
             checkpoint instead"
                .to_string(),
        );
        sglang.push(
            "checkpoint_format is \"marlin\": SGLang never selects gptq_marlin for Marlin-format \
             checkpoints (it needs the legacy `marlin` method, which requires vLLM installed)"
                .to_string(),
        );
    }
    let act_note = (info.desc_act && info.group_size == GroupSize::PerRow)
        .then(|| "desc_act with group_size -1 is treated as desc_act false".to_string());
    let verdict = |engine: &str, reasons: Vec<String>, mut notes: Vec<String>| {
        notes.extend(act_note.clone());
        EngineVerdict {
            engine: engine.to_string(),
            gptq_marlin: reasons.is_empty(),
            reasons,
            notes,
        }
    };
    vec![
        verdict(
            "SGLang",
            sglang,
            vec!["CUDA only, compute capability >= 8.0".to_string()],
        ),
        verdict(
            "vLLM",
            vllm,
            vec![
                "on Hopper (H100/H200) vLLM may run gptq_marlin layers with the Machete kernel; \
                 the checkpoint is the same"
                    .to_string(),
            ],
        ),
    ]
}

/// Why the checkpoint's settings keep both engines from `gptq_marlin`: where they are, the
/// method, missing keys, and what the kernel does not take.
fn config_reasons(info: &QuantInfo) -> Vec<String> {
    let src = info.source.display();
    let mut common = Vec::new();
    if !info.in_config_json {
        common.push(format!(
            "config.json has no quantization_config (the engines detect the method from \
             config.json only; with {src} alone pass --quantization gptq_marlin)"
        ));
    }
    match info.raw.get("quant_method").and_then(|v| v.as_str()) {
        Some(m) if m.eq_ignore_ascii_case("gptq") => {}
        Some(m) => common.push(format!(
            "quant_method is {m:?} in {src}; gptq_marlin requires \"gptq\""
        )),
        None => common.push(format!(
            "quant_method is missing from {src}; gptq_marlin requires quant_method \"gptq\""
        )),
    }
    for key in ["bits", "group_size", "sym", "desc_act"] {
        if info.raw.get(key).is_none_or(|v| v.is_null()) {
            common.push(format!(
                "{key} is missing from {src}; gptq_marlin needs bits, group_size, sym and \
                 desc_act all present"
            ));
        }
    }
    common.extend(settings_reasons(
        info.bits,
        info.sym,
        info.group_size,
        "the checkpoint",
    ));
    common
}

/// The modules that fail gptq_marlin's per-layer limits (their dynamic overrides, the kernel's
/// shape limits), as one reason naming the first few; None when every module fits.
fn module_limits_reason(info: &QuantInfo, modules: &[QuantModule]) -> Option<String> {
    // Per module: dynamic overrides and the kernel's shape limits.
    let mut layer = Vec::new();
    for m in modules {
        let mut why = Vec::new();
        if (m.bits, m.sym, m.group_size) != (info.bits, info.sym, info.group_size) {
            why.extend(settings_reasons(m.bits, m.sym, m.group_size, "this module"));
        }
        if !m.n.is_multiple_of(MARLIN_N_MULTIPLE) {
            why.push(format!(
                "N = {} is not a multiple of {MARLIN_N_MULTIPLE}",
                m.n
            ));
        }
        if !m.k.is_multiple_of(MARLIN_K_MULTIPLE) {
            why.push(format!(
                "K = {} is not a multiple of {MARLIN_K_MULTIPLE}",
                m.k
            ));
        }
        if m.k % m.group_len() != 0 {
            why.push(format!(
                "K = {} is not a multiple of the group size {}",
                m.k, m.group_size
            ));
        }
        if !why.is_empty() {
            layer.push(format!("{}: {}", m.prefix, why.join(", ")));
        }
    }
    if layer.is_empty() {
        return None;
    }
    const SHOWN: usize = 5;
    let more = layer.len().saturating_sub(SHOWN);
    Some(format!(
        "{} module(s) fail gptq_marlin's per-layer limits (N % 64, K % 128, K % group; the \
         engine errors or uses another kernel for them): {}{}",
        layer.len(),
        layer[..layer.len().min(SHOWN)].join("; "),
        if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        }
    ))
}

fn settings_reasons(bits: u8, sym: bool, group_size: GroupSize, what: &str) -> Vec<String> {
    let mut out = Vec::new();
    if !sym {
        out.push(format!(
            "{what} is asymmetric (sym false): gptq_marlin takes symmetric 4- or 8-bit \
             (uint4b8/uint8b128) only, so the engines fall back to the gptq (exllama) kernels"
        ));
    }
    if bits != 4 && bits != 8 {
        out.push(format!(
            "{what} has bits = {bits}: gptq_marlin takes 4 or 8 bits"
        ));
    }
    if !marlin_group_ok(group_size) {
        out.push(format!(
            "{what} has group_size {group_size}: gptq_marlin supports -1, 32, 64 and 128"
        ));
    }
    out
}

impl QuantInspectReport {
    pub fn print_text(&self) {
        self.print_settings();
        self.print_contents();
        self.print_checks();
        crate::engine::print_summaries(&self.loads, &self.dir);
        for w in &self.warnings {
            crate::outln!("warning        {w}");
        }
    }

    /// The folder, architecture, quantization settings and `dynamic` rules.
    fn print_settings(&self) {
        let s = &self.settings;
        crate::outln!("model          {}", self.dir);
        if let Some(a) = &self.architecture {
            crate::outln!("architecture   {a}");
        }
        crate::outln!(
            "quantization   quant_method {}, checkpoint_format {} ({}); {}-bit, group {}, {}, \
             desc_act {}, lm_head {}",
            s.quant_method.as_deref().unwrap_or("(none)"),
            s.checkpoint_format,
            s.source,
            s.bits,
            s.group_size,
            if s.sym { "sym" } else { "asym" },
            s.desc_act,
            s.lm_head
        );
        if !s.missing_keys.is_empty() {
            crate::outln!("missing keys   {}", s.missing_keys.join(", "));
        }
        for r in &self.dynamic_rules {
            let what = if r.skip {
                "keeps matching modules unquantized".to_string()
            } else {
                format!("overrides {:?}", r.overrides)
            };
            crate::outln!("dynamic        {:?}: {what} ({} match)", r.key, r.matches);
        }
    }

    /// The quantized and kept modules, and the sizes.
    fn print_contents(&self) {
        let act = self
            .quantized_modules
            .iter()
            .filter(|m| m.act_order)
            .count();
        crate::outln!(
            "quantized      {} module(s){}",
            self.quantized_modules.len(),
            if act > 0 {
                format!(", {act} with act-order g_idx")
            } else {
                String::new()
            }
        );
        let kept: Vec<String> = self
            .kept_modules
            .iter()
            .map(|t| match &t.skip_rule {
                Some(r) => format!("{} ({}, rule {r:?})", t.name, t.dtype),
                None => format!("{} ({})", t.name, t.dtype),
            })
            .collect();
        crate::outln!(
            "kept           {}",
            if kept.is_empty() {
                "none".into()
            } else {
                kept.join(", ")
            }
        );
        crate::outln!(
            "bytes          {:.3} GB quantized (vs {:.3} GB in BF16), {:.3} GB other, {:.3} GB \
             total in {} tensors, {} shard(s)",
            self.quantized_bytes as f64 / 1e9,
            self.quantized_bf16_bytes as f64 / 1e9,
            self.other_bytes as f64 / 1e9,
            self.total_bytes as f64 / 1e9,
            self.tensors,
            self.shards.len()
        );
    }

    /// What the checks found: fused groups, manifest, Marlin round trip, validation, and each
    /// engine's choice of `gptq_marlin`.
    fn print_checks(&self) {
        let fused_q = self
            .fused_groups
            .iter()
            .filter(|f| f.state.starts_with("quantized"))
            .count();
        crate::outln!(
            "fused groups   {} consistent ({} quantized, {} kept)",
            self.fused_groups.len(),
            fused_q,
            self.fused_groups.len() - fused_q
        );
        if let Some(m) = &self.manifest {
            crate::outln!("manifest       {m}");
        }
        crate::outln!("marlin         {}", self.marlin_check);
        crate::outln!("validation     ok against {}", self.validated_against);
        for e in &self.engines {
            if e.gptq_marlin {
                crate::outln!("{:<14} selects gptq_marlin", e.engine);
            } else {
                crate::outln!("{:<14} does NOT select gptq_marlin:", e.engine);
                for r in &e.reasons {
                    crate::outln!("                 - {r}");
                }
            }
            for n in &e.notes {
                crate::outln!("                 note: {n}");
            }
        }
    }
}
