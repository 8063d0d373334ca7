//! Which Linears `quantize` quantizes, and with which bits and group size (docs/usage.md, Mixed
//! precision): `--skip` keeps matching modules in 16 bits; `--plan` (a JSON file with a
//! GPTQModel `dynamic` object, as `sensitivity` writes it) overrides bits and group size per
//! module, or keeps modules in 16 bits with `-:` rules.
//!
//! The serving engines match `dynamic` rules against their own module names: the fused
//! `qkv_proj` and `gate_up_proj` for q/k/v and gate/up (`FUSED_GROUPS`), the Linear's name
//! otherwise. A rule that would treat a Linear and its fused module differently is refused, and
//! so are different settings inside one fused group: the engine loads it as one Linear.

use crate::format::quantized::{engine_name, exact_pattern, skip_rules, DynamicRule};
use crate::model::AnyConfig;
use crate::scheme::{Bits, GroupSize};
use anyhow::{anyhow, bail, Result};
use serde::Serialize;
use serde_json::{Map, Value};

/// Bits and group size of a quantized Linear.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Scheme {
    pub bits: Bits,
    pub group_size: GroupSize,
}

impl std::fmt::Display for Scheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-bit group {}", self.bits, self.group_size)
    }
}

/// What happens to one Linear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModulePlan {
    /// Kept in 16 bits (`--skip`, or a `-:` rule).
    Keep,
    Quantize(Scheme),
}

impl ModulePlan {
    pub fn scheme(self) -> Option<Scheme> {
        match self {
            ModulePlan::Keep => None,
            ModulePlan::Quantize(s) => Some(s),
        }
    }
}

/// One Linear of a layer and its plan.
#[derive(Clone, Debug)]
pub struct PlannedLinear {
    /// Relative name (`self_attn.q_proj`).
    pub name: String,
    pub plan: ModulePlan,
}

/// The plan of a whole run.
#[derive(Clone, Debug)]
pub struct Plan {
    pub layers: Vec<Vec<PlannedLinear>>,
    /// `--bits` / `--group-size`.
    pub default: Scheme,
    /// Whether `--plan` rules took part (else only `--skip` did).
    pub from_rules: bool,
    /// How many `--plan` rules decide no module (accepted with `--allow-unmatched-rules`), and
    /// why, for the first few.
    pub unused_rules: usize,
    pub unused_reasons: Vec<String>,
}

/// How many rules that change nothing a message names.
const UNUSED_LISTED: usize = 5;

/// Why rule `r` decides no module: it matches none (with the names rules are matched against),
/// or only modules `--skip` keeps, or only modules an earlier rule decides.
fn unused_reason(
    cfg: &AnyConfig,
    skips: &[regex::Regex],
    rules: &[DynamicRule],
    r: usize,
) -> String {
    let key = &rules[r].key;
    let mut skipped = None;
    for i in 0..cfg.num_hidden_layers() {
        for l in cfg.layer_linears(i) {
            let full = format!("model.layers.{i}.{}", l.name);
            let eng = engine_name(&full);
            for name in [&full, &eng] {
                if !rules[r].matches(name) {
                    continue;
                }
                if skips.iter().any(|s| s.is_match(&full)) {
                    skipped.get_or_insert(full.clone());
                    continue;
                }
                if let Some(first) = rules[..r].iter().find(|e| e.matches(name)) {
                    return format!(
                        "rule {key:?} comes too late: an earlier rule decides every module it \
                         matches (the first rule that matches a module decides; {:?} decides \
                         {name})",
                        first.key
                    );
                }
            }
        }
    }
    if let Some(full) = skipped {
        return format!(
            "rule {key:?} matches only modules that --skip keeps in 16 bits (such as {full}; \
             --skip wins over the plan)"
        );
    }
    let last = cfg.num_hidden_layers().saturating_sub(1);
    let first = cfg.layer_linears(0).first().map(|l| l.name.to_string());
    let final_ = cfg.layer_linears(last).last().map(|l| l.name.to_string());
    format!(
        "rule {key:?} matches no module of this model (rules are matched from the start of the \
         names of the decoder layers' Linears, model.layers.0.{} … model.layers.{last}.{}, and \
         of the fused qkv_proj and gate_up_proj; lm_head and the embeddings are never quantized)",
        first.unwrap_or_default(),
        final_.unwrap_or_default()
    )
}

/// The plan a rule list gives a module: the first matching rule (file order) and its index, or
/// the default.
fn by_rules(
    rules: &[DynamicRule],
    name: &str,
    default: Scheme,
) -> Result<(ModulePlan, Option<usize>)> {
    let Some(i) = rules.iter().position(|r| r.matches(name)) else {
        return Ok((ModulePlan::Quantize(default), None));
    };
    let r = &rules[i];
    if r.skip {
        return Ok((ModulePlan::Keep, Some(i)));
    }
    let o = r.overrides;
    if o.sym.is_some() || o.desc_act.is_some() {
        bail!(
            "--plan rule {:?} sets sym or desc_act: this tool sets them for the whole model \
             (--asym, --act-order); keep only bits and group_size in the rule",
            r.key
        );
    }
    let bits = match o.bits {
        None => default.bits,
        Some(b) => Bits::new(b).ok_or_else(|| {
            anyhow!(
                "--plan rule {:?} asks for {b} bits: GPTQ packing takes 2, 3, 4 or 8",
                r.key
            )
        })?,
    };
    Ok((
        ModulePlan::Quantize(Scheme {
            bits,
            group_size: o.group_size.unwrap_or(default.group_size),
        }),
        Some(i),
    ))
}

/// How a decision is named in messages.
fn why(rules: &[DynamicRule], i: Option<usize>) -> String {
    match i {
        Some(i) => format!("rule {:?}", rules[i].key),
        None => "no rule".into(),
    }
}

/// What to do with `--plan` rules that decide no module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmatched {
    /// Refuse the plan, naming them (the default).
    Refuse,
    /// Accept them (`--allow-unmatched-rules`); [`Plan::unused_rules`] lists them.
    Allow,
}

impl Plan {
    /// The plan for `cfg`: `skip` patterns (searched anywhere in the full name) keep modules in
    /// 16 bits and win over `rules` (a `--plan` file's, in file order), which override the
    /// default scheme. Checks every quantized Linear's shape against its scheme, and that every
    /// rule decides some module (is the first rule to match it, by its own or its engine name):
    /// a rule that matches nothing, or only modules that `--skip` or earlier rules decide,
    /// changes nothing and is refused unless `unmatched` allows it.
    pub fn build(
        cfg: &AnyConfig,
        skip: &[String],
        rules: &[DynamicRule],
        default: Scheme,
        unmatched: Unmatched,
    ) -> Result<Self> {
        let skips = skip
            .iter()
            .map(|s| {
                regex::Regex::new(s)
                    .map_err(|e| anyhow!("--skip {s:?} is not a valid regular expression: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut decides = vec![false; rules.len()];
        let mut layers = vec![];
        for i in 0..cfg.num_hidden_layers() {
            let mut mods: Vec<PlannedLinear> = vec![];
            for l in cfg.layer_linears(i) {
                let full = format!("model.layers.{i}.{}", l.name);
                let plan = if skips.iter().any(|r| r.is_match(&full)) {
                    ModulePlan::Keep
                } else {
                    by_rules_agreeing(rules, &full, default, &mut decides)?
                };
                if let ModulePlan::Quantize(s) = plan {
                    check_shape(&full, l.n, l.k, s, s == default)?;
                }
                mods.push(PlannedLinear {
                    name: l.name.to_string(),
                    plan,
                });
            }
            check_fused_groups(i, &mods, skip, rules)?;
            layers.push(mods);
        }
        let (unused, unused_rules) = check_unused_rules(cfg, &skips, rules, &decides, unmatched)?;
        Ok(Self {
            layers,
            default,
            from_rules: !rules.is_empty(),
            unused_rules: unused,
            unused_reasons: unused_rules,
        })
    }

    /// The plan of Linear `m` (relative name) of layer `i`.
    pub fn get(&self, i: usize, m: &str) -> ModulePlan {
        self.layers[i]
            .iter()
            .find(|p| p.name == m)
            .map_or(ModulePlan::Keep, |p| p.plan)
    }

    /// Whether some quantized Linear has other bits or another group size than the default.
    pub fn is_mixed(&self) -> bool {
        self.layers
            .iter()
            .flatten()
            .any(|p| matches!(p.plan, ModulePlan::Quantize(s) if s != self.default))
    }

    /// Whether some Linear is kept in 16 bits.
    pub fn any_kept(&self) -> bool {
        self.layers
            .iter()
            .flatten()
            .any(|p| p.plan == ModulePlan::Keep)
    }

    /// Full names of the quantized Linears, with their schemes, in layer order.
    pub fn quantized(&self) -> Vec<(String, Scheme)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, mods)| {
                mods.iter().filter_map(move |p| {
                    p.plan
                        .scheme()
                        .map(|s| (format!("model.layers.{i}.{}", p.name), s))
                })
            })
            .collect()
    }

    /// Every Linear whose plan is not the default scheme, as `name=bits/group` or `name=keep`:
    /// what the plan changes, for the settings hash and the report.
    pub fn overrides(&self) -> Vec<String> {
        let mut out = vec![];
        for (i, mods) in self.layers.iter().enumerate() {
            for p in mods {
                let full = format!("model.layers.{i}.{}", p.name);
                match p.plan {
                    ModulePlan::Keep => out.push(format!("{full}=keep")),
                    ModulePlan::Quantize(s) if s != self.default => {
                        out.push(format!("{full}={}/{}", s.bits, s.group_size))
                    }
                    _ => {}
                }
            }
        }
        out
    }

    /// The fused modules (`model.layers.i.self_attn.qkv_proj`) whose members are all kept in 16
    /// bits: the names the engines look up in `dynamic`.
    pub fn kept_fused(&self) -> Vec<String> {
        let mut out = vec![];
        for (i, mods) in self.layers.iter().enumerate() {
            for (fused, members) in fused_members(i, mods) {
                if members.iter().all(|m| m.plan == ModulePlan::Keep) {
                    out.push(format!("model.layers.{i}.{fused}"));
                }
            }
        }
        out
    }

    /// The output's `dynamic` rules. Without `--plan`, the `--skip` rules as before
    /// ([`skip_rules`]). With it, one exact rule per engine module whose plan is not the
    /// default (`+:` with its bits and group size, or `-:`), matching the engine's (fused) name
    /// and its members' names alike: the rules are disjoint, so their order (which JSON objects
    /// do not keep) cannot matter.
    pub fn dynamic(&self, skip: &[String]) -> Result<Map<String, Value>> {
        if !self.from_rules && !self.is_mixed() {
            return skip_rules(skip, &self.kept_fused());
        }
        let mut out = Map::new();
        for (i, mods) in self.layers.iter().enumerate() {
            let mut done: Vec<String> = vec![];
            for p in mods {
                let full = format!("model.layers.{i}.{}", p.name);
                let eng = engine_name(&full);
                if done.contains(&eng) {
                    continue;
                }
                done.push(eng.clone());
                let members: Vec<String> = mods
                    .iter()
                    .map(|q| format!("model.layers.{i}.{}", q.name))
                    .filter(|n| engine_name(n) == eng)
                    .collect();
                let refs: Vec<&str> = members.iter().map(String::as_str).collect();
                let pattern = exact_pattern(&eng, &refs);
                match p.plan {
                    ModulePlan::Keep => {
                        out.insert(format!("-:{pattern}"), serde_json::json!({}));
                    }
                    ModulePlan::Quantize(s) if s != self.default => {
                        out.insert(
                            format!("+:{pattern}"),
                            serde_json::json!({"bits": s.bits, "group_size": s.group_size}),
                        );
                    }
                    ModulePlan::Quantize(_) => {}
                }
            }
        }
        Ok(out)
    }
}

/// The plan `rules` give the module `full`, which must be the same by its own name and by its
/// engine name; marks the deciding rules in `decides`.
fn by_rules_agreeing(
    rules: &[DynamicRule],
    full: &str,
    default: Scheme,
    decides: &mut [bool],
) -> Result<ModulePlan> {
    let eng = engine_name(full);
    let (own, by_own) = by_rules(rules, full, default)?;
    let (engine, by_eng) = by_rules(rules, &eng, default)?;
    if own != engine {
        bail!(
            "--plan: {full} gets {} by its own name ({}) but {} by the \
             name SGLang and vLLM match rules against, {eng} ({}); write \
             the rule so that it matches both, e.g. \"+:{}\"",
            describe(own),
            why(rules, by_own),
            describe(engine),
            why(rules, by_eng),
            exact_pattern(&eng, &[full])
        );
    }
    for r in [by_own, by_eng].into_iter().flatten() {
        decides[r] = true;
    }
    Ok(own)
}

/// Refuses a fused group of layer `i` (loaded by the engines as one Linear) whose members have
/// different plans.
fn check_fused_groups(
    i: usize,
    mods: &[PlannedLinear],
    skip: &[String],
    rules: &[DynamicRule],
) -> Result<()> {
    for (fused, members) in fused_members(i, mods) {
        let plans: Vec<ModulePlan> = members.iter().map(|m| m.plan).collect();
        if plans.iter().any(|p| *p != plans[0]) {
            let names: Vec<&str> = members.iter().map(|m| m.name.as_str()).collect();
            let kept = plans.iter().filter(|p| **p == ModulePlan::Keep).count();
            if kept > 0 && kept < plans.len() && rules.is_empty() {
                bail!(
                    "--skip {skip:?} splits the fused group {} of layer {i}: SGLang loads {} \
                     as one Linear ({fused}), so skip all of them or none",
                    names.join("/"),
                    names.join(", ")
                );
            }
            bail!(
                "the plan gives the fused group {} of layer {i} different settings ({}): \
                 SGLang loads them as one Linear ({fused}), so give all of them the same",
                names.join("/"),
                plans
                    .iter()
                    .zip(&names)
                    .map(|(p, n)| format!("{n} {}", describe(*p)))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    Ok(())
}

/// The rules that decide no module: their count and the reasons of the first
/// [`UNUSED_LISTED`]; refused unless `unmatched` allows them.
fn check_unused_rules(
    cfg: &AnyConfig,
    skips: &[regex::Regex],
    rules: &[DynamicRule],
    decides: &[bool],
    unmatched: Unmatched,
) -> Result<(usize, Vec<String>)> {
    let unused: Vec<usize> = (0..rules.len()).filter(|&r| !decides[r]).collect();
    let unused_rules: Vec<String> = unused
        .iter()
        .take(UNUSED_LISTED)
        .map(|&r| unused_reason(cfg, skips, rules, r))
        .collect();
    if !unused.is_empty() && unmatched == Unmatched::Refuse {
        let more = unused.len().saturating_sub(UNUSED_LISTED);
        bail!(
            "--plan: {} rule(s) would change nothing: {}{}; fix or drop them, or pass \
             --allow-unmatched-rules to accept rules that change nothing",
            unused.len(),
            unused_rules.join("; "),
            if more > 0 {
                format!("; and {more} more")
            } else {
                String::new()
            }
        );
    }
    Ok((unused.len(), unused_rules))
}

fn describe(p: ModulePlan) -> String {
    match p {
        ModulePlan::Keep => "16 bits".into(),
        ModulePlan::Quantize(s) => s.to_string(),
    }
}

/// The members of layer `i`'s fused groups: `(parent.fused, members)`.
fn fused_members(i: usize, mods: &[PlannedLinear]) -> Vec<(String, Vec<&PlannedLinear>)> {
    let mut out: Vec<(String, Vec<&PlannedLinear>)> = vec![];
    for p in mods {
        let full = format!("model.layers.{i}.{}", p.name);
        let eng = engine_name(&full);
        if eng == full {
            continue;
        }
        let rel = eng
            .strip_prefix(&format!("model.layers.{i}."))
            .unwrap_or(&eng)
            .to_string();
        match out.iter_mut().find(|(n, _)| *n == rel) {
            Some((_, list)) => list.push(p),
            None => out.push((rel, vec![p])),
        }
    }
    out
}

/// GPTQ packs whole blocks of codes along K (qweight) and of zeros along N (qzeros); the group
/// size must divide K.
/// `default`: the scheme comes from `--bits`/`--group-size` (else from a `--plan` rule).
fn check_shape(full: &str, n: usize, k: usize, s: Scheme, default: bool) -> Result<()> {
    let (group, bits) = if default {
        ("--group-size", "--bits")
    } else {
        ("the --plan group size", "--plan bits")
    };
    if !s.group_size.divides(k) {
        bail!(
            "{group} {} does not divide in_features {k} of {full}: use a group size that \
             divides it, or -1",
            s.group_size
        );
    }
    let (block, _) = crate::format::pack::block_shape(s.bits.get())?;
    if !n.is_multiple_of(block) || !k.is_multiple_of(block) {
        bail!(
            "{full} is [{n}, {k}]: {}-bit GPTQ packing needs both dimensions to be multiples of \
             {block}; use other {bits} or --skip it",
            s.bits
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::quantized::read_plan_rules;
    use serde_json::json;

    fn tiny() -> AnyConfig {
        crate::model::config::preset("tiny").unwrap().into()
    }

    fn rules(v: Value) -> Vec<DynamicRule> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("plan.json");
        std::fs::write(&p, v.to_string()).unwrap();
        read_plan_rules(&p).unwrap()
    }

    const DEFAULT: Scheme = Scheme {
        bits: Bits::B4,
        group_size: GroupSize::G128,
    };

    fn build(skip: &[&str], v: Value, unmatched: Unmatched) -> Result<Plan> {
        let skip: Vec<String> = skip.iter().map(|s| s.to_string()).collect();
        Plan::build(&tiny(), &skip, &rules(v), DEFAULT, unmatched)
    }

    #[test]
    fn rules_that_match_no_module_are_refused_unless_allowed() {
        for (rule, needle) in [
            ("+:lm_head", "matches no module"),
            ("+:model\\.embed_tokens", "matches no module"),
            ("+:model\\.layers\\.31\\.mlp\\..*", "matches no module"),
        ] {
            let v = json!({"dynamic": {rule: {"bits": 8}}});
            let e = build(&[], v.clone(), Unmatched::Refuse)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(needle)
                    && e.contains(&format!("{rule:?}"))
                    && e.contains("--allow-unmatched-rules"),
                "{rule}: {e}"
            );
            assert!(e.contains("model.layers.3.mlp.down_proj"), "{e}");
            let p = build(&[], v, Unmatched::Allow).unwrap();
            assert_eq!(p.unused_rules, 1);
            assert!(!p.is_mixed() && p.overrides().is_empty());
        }
    }

    #[test]
    fn rules_decided_by_earlier_rules_or_skip_are_refused() {
        let v = json!({"dynamic": {
            "+:model\\.layers\\.0\\.mlp\\..*": {"bits": 8},
            "+:model\\.layers\\.0\\.mlp\\.down_proj": {"group_size": 64}
        }});
        let e = build(&[], v, Unmatched::Refuse).unwrap_err().to_string();
        assert!(
            e.contains("comes too late") && e.contains("down_proj"),
            "{e}"
        );
        let v = json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\.down_proj": {"bits": 8}}});
        let e = build(&["layers\\.0\\.mlp\\.down"], v.clone(), Unmatched::Refuse)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--skip keeps"), "{e}");
        // Every rule that decides a module is fine; a rule decided through the fused name too.
        build(&[], v, Unmatched::Refuse).unwrap();
        let v = json!({"dynamic": {
            "+:model\\.layers\\.1\\.self_attn\\.(?:q_proj|k_proj|v_proj|qkv_proj)$": {"bits": 8},
            "-:model\\.layers\\.2\\..*": {}
        }});
        let p = build(&[], v, Unmatched::Refuse).unwrap();
        assert_eq!(p.unused_rules, 0);
        assert_eq!(p.get(2, "mlp.up_proj"), ModulePlan::Keep);
    }

    #[test]
    fn many_rules_are_matched_in_linear_time() {
        let mut dynamic = Map::new();
        for i in 0..crate::format::quantized::MAX_PLAN_RULES {
            dynamic.insert(format!("+:model\\.nothing\\.{i}$"), json!({"bits": 8}));
        }
        let t = std::time::Instant::now();
        let p = build(&[], json!({"dynamic": dynamic}), Unmatched::Allow).unwrap();
        assert_eq!(p.unused_rules, crate::format::quantized::MAX_PLAN_RULES);
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "{:?}",
            t.elapsed()
        );
    }
}
