//! The quantization settings of a checkpoint: `config.json` `quantization_config`, else
//! `quantize_config.json`, with GPTQModel `dynamic` rules (`-:REGEX` keeps a module unquantized,
//! `+:REGEX` / `REGEX` override its bits, group size, sym or desc_act; matched from the start of
//! the module name, as Python's `re.match` in the engines does, first match wins).

use super::{CONFIG_FILE, FUSED_GROUPS, QUANTIZE_CONFIG_FILE};
use crate::scheme::{GroupSize, QuantFormat};
use anyhow::{anyhow, bail, ensure, Context, Result};
use regex::Regex;
use serde::Serialize;
use serde_json::Value;
use std::cmp::Ordering;
use std::path::{Path, PathBuf};

/// Per-module overrides of a positive `dynamic` rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QuantOverride {
    pub bits: Option<u8>,
    pub group_size: Option<GroupSize>,
    pub sym: Option<bool>,
    pub desc_act: Option<bool>,
}

/// One GPTQModel `dynamic` rule: `-:REGEX` (skip: keep the module unquantized) or `+:REGEX` /
/// `REGEX` (override settings of matching modules).
#[derive(Debug, Clone, Serialize)]
pub struct DynamicRule {
    /// The key as written in the config.
    pub key: String,
    /// The regular expression, prefix removed.
    pub pattern: String,
    pub skip: bool,
    pub overrides: QuantOverride,
    #[serde(skip)]
    regex: Regex,
}

impl DynamicRule {
    /// Whether the rule applies to a module (`re.match` semantics: anchored at the start).
    pub fn matches(&self, module: &str) -> bool {
        self.regex.is_match(module)
    }
}

/// Effective settings of one module (global settings with any `dynamic` override applied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModuleQuant {
    pub bits: u8,
    pub group_size: GroupSize,
    pub sym: bool,
    pub desc_act: bool,
}

/// The quantization settings of a checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct QuantInfo {
    pub bits: u8,
    pub group_size: GroupSize,
    pub sym: bool,
    pub desc_act: bool,
    pub format: QuantFormat,
    pub lm_head: bool,
    pub dynamic: Vec<DynamicRule>,
    /// The file the settings came from.
    pub source: PathBuf,
    /// True when they came from `config.json` (what the engines auto-detect), false for
    /// `quantize_config.json`.
    pub in_config_json: bool,
    /// Keys among `bits`, `group_size`, `sym`, `desc_act` that the config does not spell out
    /// (defaults: sym true, desc_act false); the engines need all four to pick gptq_marlin.
    pub missing_keys: Vec<String>,
    /// The settings object exactly as read.
    pub raw: Value,
}

impl QuantInfo {
    /// Parses a `quantization_config` / `quantize_config.json` object; `source` names the file in
    /// errors.
    pub fn from_json(raw: Value, source: &Path, in_config_json: bool) -> Result<Self> {
        let src = source.display();
        let obj = raw
            .as_object()
            .ok_or_else(|| anyhow!("quantization settings in {src} are not a JSON object"))?;
        let method = str_key(obj, "quant_method", source)?
            .or(str_key(obj, "method", source)?)
            .map(|m| m.to_ascii_lowercase());
        if let Some(m) = method.as_deref() {
            ensure!(
                m == "gptq" || m == "marlin",
                "{src}: quant_method is {m:?}; this tool reads GPTQ (gptq, gptq_v2) and Marlin \
                 checkpoints only"
            );
        }
        let mut missing_keys = Vec::new();
        let bits = match obj.get("bits") {
            Some(v) => parse_bits(v).ok_or_else(|| {
                anyhow!("{src}: bits is {v}, expected an integer from 1 to 8 (GPTQ uses 2, 4 or 8)")
            })?,
            None => bail!("{src}: the quantization settings have no bits key"),
        };
        let group_size = match obj.get("group_size") {
            Some(v) => parse_group(v).ok_or_else(|| {
                anyhow!("{src}: group_size is {v}, expected -1 (one group) or a positive integer")
            })?,
            None => bail!("{src}: the quantization settings have no group_size key"),
        };
        let mut flag = |key: &str, default: bool| -> Result<bool> {
            match obj.get(key) {
                Some(Value::Bool(b)) => Ok(*b),
                Some(Value::Null) | None => {
                    missing_keys.push(key.to_string());
                    Ok(default)
                }
                Some(v) => bail!("{src}: {key} is {v}, expected true or false"),
            }
        };
        let sym = flag("sym", true)?;
        let desc_act = flag("desc_act", false)?;
        let lm_head = matches!(obj.get("lm_head"), Some(Value::Bool(true)));
        let written =
            str_key(obj, "checkpoint_format", source)?.or(str_key(obj, "format", source)?);
        let format = if method.as_deref() == Some("marlin")
            || matches!(obj.get("is_marlin_format"), Some(Value::Bool(true)))
        {
            QuantFormat::Marlin
        } else {
            match written.as_deref().map(str::to_ascii_lowercase).as_deref() {
                None | Some("gptq") => QuantFormat::GptqV1,
                Some("gptq_v2") => QuantFormat::GptqV2,
                Some("marlin") => QuantFormat::Marlin,
                Some(other) => bail!(
                    "{src}: checkpoint_format is {other:?}; this tool reads \"gptq\", \"gptq_v2\" \
                     and \"marlin\" checkpoints"
                ),
            }
        };
        let dynamic = match obj.get("dynamic") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Object(rules)) => rules
                .iter()
                .map(|(key, v)| parse_rule(key, v, source))
                .collect::<Result<_>>()?,
            Some(v) => bail!("{src}: dynamic is {v}, expected an object of \"-:REGEX\" rules"),
        };
        Ok(Self {
            bits,
            group_size,
            sym,
            desc_act,
            format,
            lm_head,
            dynamic,
            source: source.to_path_buf(),
            in_config_json,
            missing_keys,
            raw,
        })
    }

    /// The rule that decides `module`: the first one that matches it, in the order the file
    /// lists them, as the engines' `get_dynamic_override` takes it.
    pub fn rule_for(&self, module: &str) -> Option<&DynamicRule> {
        self.dynamic.iter().find(|r| r.matches(module))
    }

    /// The `-:` rule that keeps `module` unquantized, if the first rule that matches it is one.
    pub fn skip_rule(&self, module: &str) -> Option<&DynamicRule> {
        self.rule_for(module).filter(|r| r.skip)
    }

    /// Settings of `module`, or `None` when a `-:` rule keeps it unquantized. The first matching
    /// rule decides: a skip, or overrides of the global settings.
    pub fn module_settings(&self, module: &str) -> Option<ModuleQuant> {
        let rule = self.rule_for(module);
        if rule.is_some_and(|r| r.skip) {
            return None;
        }
        let mut m = ModuleQuant {
            bits: self.bits,
            group_size: self.group_size,
            sym: self.sym,
            desc_act: self.desc_act,
        };
        if let Some(r) = rule {
            let o = r.overrides;
            m.bits = o.bits.unwrap_or(m.bits);
            m.group_size = o.group_size.unwrap_or(m.group_size);
            m.sym = o.sym.unwrap_or(m.sym);
            m.desc_act = o.desc_act.unwrap_or(m.desc_act);
        }
        Some(m)
    }

    /// Puts the `dynamic` rules in the order their keys appear in the file (`order`, from
    /// [`dynamic_key_order`]): parsed JSON objects do not keep it, and the first matching rule
    /// wins.
    pub fn order_rules(&mut self, order: &[String]) {
        let position: std::collections::HashMap<&str, usize> = order
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), i))
            .collect();
        self.dynamic
            .sort_by_key(|r| position.get(r.key.as_str()).copied().unwrap_or(usize::MAX));
    }

    /// The `quant_method` as written (`method` for GPTQModel ≥ 7), if any.
    pub fn quant_method(&self) -> Option<&str> {
        self.raw
            .get("quant_method")
            .or_else(|| self.raw.get("method"))
            .and_then(Value::as_str)
    }
}

/// The `quantization_config` a GPTQ writer records: the settings [`QuantInfo::from_json`] reads
/// back (and the engines load by), plus the writer's provenance. The writer of the keys lives
/// here, next to their reader, so the two cannot drift apart.
#[derive(Debug, Clone)]
pub struct GptqConfig {
    pub bits: u8,
    pub group_size: GroupSize,
    pub sym: bool,
    pub desc_act: bool,
    pub static_groups: bool,
    pub format: QuantFormat,
    pub damp_percent: f64,
    pub true_sequential: bool,
    /// `dynamic` rules, from [`skip_rules`].
    pub dynamic: serde_json::Map<String, Value>,
    /// For transformers (which ignores `dynamic`): the quantized Linears, listed when some are
    /// kept in 16 bits (optimum keeps the Linears whose names end with an entry).
    pub modules_in_block_to_quantize: Option<Vec<String>>,
    /// Who wrote the checkpoint and how (`meta`, GPTQModel's provenance object).
    pub meta: Value,
}

impl GptqConfig {
    /// The `quantization_config` object (keys in serde_json's sorted order).
    pub fn to_json(&self) -> Value {
        let mut qc = serde_json::json!({
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "lm_head": false,
            "checkpoint_format": self.format.checkpoint_format(),
            "pack_dtype": "int32",
            "damp_percent": self.damp_percent,
            "true_sequential": self.true_sequential,
            "static_groups": self.static_groups,
            "dynamic": self.dynamic,
            "meta": self.meta,
        });
        if let Some(names) = &self.modules_in_block_to_quantize {
            qc["modules_in_block_to_quantize"] = serde_json::json!([names]);
        }
        qc
    }
}

/// `dynamic` rules that keep modules in 16 bits: `"-:.*(?:REGEX)": {}` per search pattern in
/// `skip` (the engines apply rules with Python's `re.match`, anchored at the start, while a skip
/// pattern searches anywhere in the name), plus an exact `-:NAME` rule for every fused module in
/// `kept_fused` (`model.layers.i.self_attn.qkv_proj`, what SGLang and vLLM match rules against)
/// that none of those rules matches.
pub fn skip_rules(
    skip: &[String],
    kept_fused: &[String],
) -> Result<serde_json::Map<String, Value>> {
    let mut dynamic = serde_json::Map::new();
    let mut searches = vec![];
    for r in skip {
        searches.push(
            Regex::new(&format!("^(?:.*(?:{r}))")).map_err(|e| {
                anyhow!("skip pattern {r:?} is not a valid regular expression: {e}")
            })?,
        );
        dynamic.insert(format!("-:.*(?:{r})"), serde_json::json!({}));
    }
    for fused in kept_fused {
        if !searches.iter().any(|r| r.is_match(fused)) {
            dynamic.insert(format!("-:{}", regex::escape(fused)), serde_json::json!({}));
        }
    }
    Ok(dynamic)
}

fn str_key(
    obj: &serde_json::Map<String, Value>,
    key: &str,
    source: &Path,
) -> Result<Option<String>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => bail!("{}: {key} is {v}, expected a string", source.display()),
    }
}

fn parse_bits(v: &Value) -> Option<u8> {
    v.as_u64().filter(|b| (1..=8).contains(b)).map(|b| b as u8)
}

fn parse_group(v: &Value) -> Option<GroupSize> {
    v.as_i64().and_then(GroupSize::from_i64)
}

/// `-:REGEX` (skip), `+:REGEX` or `REGEX`: whether the rule skips, and its pattern.
fn split_rule_key(key: &str) -> (bool, &str) {
    if let Some(p) = key.strip_prefix("-:") {
        (true, p)
    } else if let Some(p) = key.strip_prefix("+:") {
        (false, p)
    } else {
        (false, key)
    }
}

/// A rule's pattern anchored at the start, as the engines' `re.match`.
fn rule_regex(key: &str, pattern: &str, source: &Path) -> Result<Regex> {
    Regex::new(&format!("^(?:{pattern})")).with_context(|| {
        format!(
            "{}: dynamic rule {key:?} is not a regular expression this tool understands \
             (Rust regex syntax: no look-around or back-references)",
            source.display()
        )
    })
}

fn parse_rule(key: &str, v: &Value, source: &Path) -> Result<DynamicRule> {
    let src = source.display();
    let (skip, pattern) = split_rule_key(key);
    let regex = rule_regex(key, pattern, source)?;
    let obj = v
        .as_object()
        .ok_or_else(|| anyhow!("{src}: dynamic rule {key:?} maps to {v}, expected an object"))?;
    let mut overrides = QuantOverride::default();
    if !skip {
        if let Some(b) = obj.get("bits") {
            overrides.bits = Some(parse_bits(b).ok_or_else(|| {
                anyhow!("{src}: dynamic rule {key:?} has bits {b}, expected 1 to 8")
            })?);
        }
        if let Some(g) = obj.get("group_size") {
            overrides.group_size = Some(parse_group(g).ok_or_else(|| {
                anyhow!("{src}: dynamic rule {key:?} has group_size {g}, expected -1 or > 0")
            })?);
        }
        for (name, slot) in [
            ("sym", &mut overrides.sym),
            ("desc_act", &mut overrides.desc_act),
        ] {
            if let Some(x) = obj.get(name) {
                *slot = Some(x.as_bool().ok_or_else(|| {
                    anyhow!("{src}: dynamic rule {key:?} has {name} {x}, expected true or false")
                })?);
            }
        }
    }
    Ok(DynamicRule {
        key: key.to_string(),
        pattern: pattern.to_string(),
        skip,
        overrides,
        regex,
    })
}

/// Quantization settings of the checkpoint in `dir`: `config.json`'s `quantization_config`, else
/// `quantize_config.json`; `None` when neither exists (an unquantized checkpoint).
pub fn read_quant_info(dir: &Path) -> Result<Option<QuantInfo>> {
    let cfg_path = dir.join(CONFIG_FILE);
    if cfg_path.is_file() {
        let text = read_text(&cfg_path)?;
        let cfg = parse_json(&cfg_path, &text)?;
        match cfg.get("quantization_config") {
            None | Some(Value::Null) => {}
            Some(q) => {
                let mut info = QuantInfo::from_json(q.clone(), &cfg_path, true)?;
                info.order_rules(&dynamic_key_order(&text));
                return Ok(Some(info));
            }
        }
    }
    let qpath = dir.join(QUANTIZE_CONFIG_FILE);
    if qpath.is_file() {
        let text = read_text(&qpath)?;
        let mut info = QuantInfo::from_json(parse_json(&qpath, &text)?, &qpath, false)?;
        info.order_rules(&dynamic_key_order(&text));
        return Ok(Some(info));
    }
    Ok(None)
}

/// The name the engines match rules against: `model.layers.i.self_attn.qkv_proj` for a member of
/// a fused group, the Linear's own name otherwise.
pub fn engine_name(full: &str) -> String {
    if let Some((parent, leaf)) = full.rsplit_once('.') {
        for (fused, members) in FUSED_GROUPS {
            if members.contains(&leaf) {
                return format!("{parent}.{fused}");
            }
        }
    }
    full.to_string()
}

/// A `dynamic` pattern that matches exactly the engine module `eng` and its `members`' full
/// names (anchored at both ends, as the engines' `re.match` anchors only the start).
pub fn exact_pattern(eng: &str, members: &[&str]) -> String {
    let (parent, leaf) = eng.rsplit_once('.').unwrap_or(("", eng));
    let mut leaves: Vec<String> = members
        .iter()
        .filter_map(|m| m.rsplit_once('.').map(|(_, l)| l.to_string()))
        .filter(|l| l != leaf)
        .collect();
    leaves.push(leaf.to_string());
    leaves.dedup();
    if leaves.len() == 1 {
        format!("{}$", regex::escape(eng))
    } else {
        format!(
            "{}\\.(?:{})$",
            regex::escape(parent),
            leaves
                .iter()
                .map(|l| regex::escape(l))
                .collect::<Vec<_>>()
                .join("|")
        )
    }
}

/// The most rules a plan file may hold: far more than one rule per engine module of the largest
/// models (a 9.5B MiniCPM-SALA has 160), and few enough that reading and matching them stays
/// instant.
pub const MAX_PLAN_RULES: usize = 4096;

/// Top-level keys of a plan file besides `dynamic`: the notes `sensitivity --plan-out` writes
/// about what the plan was measured from. They change nothing.
pub const PLAN_NOTES: &[&str] = &[
    "format",
    "version",
    "made_by",
    "reference",
    "quantized",
    "note",
    "upgrade_bits",
    "units",
    "extra_bytes",
    "quantized_mean_kl",
    "predicted_mean_kl",
];

/// The rules of a plan file (`quantize --plan`, written by `sensitivity`): a JSON object whose
/// `dynamic` object holds GPTQModel rules (`"+:REGEX": {"bits": 8}`, `"-:REGEX": {}`), in the
/// order the file lists them (the first matching rule decides).
///
/// Unlike the `dynamic` of a checkpoint's config (read leniently, as the engines read it), a plan
/// is strict: every key and value must take effect, so an unknown key, a `-:` rule with values
/// (which would be dropped), a `+:` rule without any, bits 16 (a `-:` rule) and more than
/// [`MAX_PLAN_RULES`] rules are refused by name. A leading UTF-8 byte-order mark is skipped.
pub fn read_plan_rules(path: &Path) -> Result<Vec<DynamicRule>> {
    crate::checkpoint::guard::regular_file(path, "--plan")?;
    let text = read_text(path)?;
    // Some editors start a UTF-8 file with a byte-order mark, which is not JSON.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let v = parse_json(path, text)?;
    let src = path.display();
    let shape = || {
        anyhow!(
            "{src}: a plan is a JSON object with a \"dynamic\" object of rules, e.g. \
             {{\"dynamic\": {{\"+:model\\\\.layers\\\\.3\\\\.mlp\\\\..*\": {{\"bits\": 8}}}}}} \
             (`soar-gptq sensitivity --plan-out` writes one)"
        )
    };
    let obj = v.as_object().ok_or_else(shape)?;
    let Some(Value::Object(rules)) = obj.get("dynamic") else {
        return Err(shape());
    };
    if let Some(k) = obj
        .keys()
        .find(|k| *k != "dynamic" && !PLAN_NOTES.contains(&k.as_str()))
    {
        bail!(
            "{src}: the plan has an unknown key {k:?}: a plan holds its rules under \"dynamic\" \
             (besides the notes sensitivity writes: {}); the global settings are quantize's \
             flags (--bits, --group-size, --asym, --act-order)",
            PLAN_NOTES.join(", ")
        );
    }
    if let Some(f) = obj
        .get("format")
        .filter(|f| f.as_str() != Some("soar-gptq-plan"))
    {
        bail!("{src}: format is {f}, not \"soar-gptq-plan\": this is not a plan file");
    }
    if let Some(ver) = obj.get("version").filter(|v| v.as_u64() != Some(1)) {
        bail!("{src}: plan version {ver}: this soar-gptq reads version 1 plans");
    }
    if rules.is_empty() {
        bail!(
            "{src}: \"dynamic\" holds no rules, so the plan would change nothing: add rules, or \
             quantize without --plan"
        );
    }
    if rules.len() > MAX_PLAN_RULES {
        bail!(
            "{src}: {} rules, more than the {MAX_PLAN_RULES} a plan may hold: one rule per module \
             needs far fewer; merge rules with regular expressions (e.g. \
             \"+:model\\\\.layers\\\\.(?:1|2|3)\\\\.mlp\\\\..*\")",
            rules.len()
        );
    }
    // In file order (a parsed object does not keep it; the first matching rule decides).
    let order = dynamic_key_order(text);
    let keys: Vec<&String> = if order.len() == rules.len() {
        order.iter().collect()
    } else {
        rules.keys().collect()
    };
    keys.into_iter()
        .map(|k| parse_plan_rule(k, &rules[k.as_str()], path))
        .collect()
}

/// The keys a plan rule may set.
const PLAN_RULE_KEYS: &[&str] = &["bits", "group_size"];

/// One rule of a plan file, strictly (see [`read_plan_rules`]).
fn parse_plan_rule(key: &str, v: &Value, source: &Path) -> Result<DynamicRule> {
    let src = source.display();
    let (skip, pattern) = split_rule_key(key);
    let obj = v
        .as_object()
        .ok_or_else(|| anyhow!("{src}: rule {key:?} maps to {v}, expected an object"))?;
    // Suggested keys as they are written in the file (a JSON string).
    let as_json = |k: String| Value::String(k).to_string();
    if skip && !obj.is_empty() {
        let values: Vec<String> = obj.iter().map(|(k, v)| format!("{k} {v}")).collect();
        bail!(
            "{src}: rule {key:?} sets {}, but a \"-:\" rule keeps the modules it matches in 16 \
             bits, so these values would be dropped: write {} to quantize them with these \
             values, or give {key:?} an empty object {{}} to keep them in 16 bits",
            values.join(", "),
            as_json(format!("+:{pattern}"))
        );
    }
    for k in obj.keys() {
        match k.as_str() {
            "bits" | "group_size" => {}
            "sym" | "desc_act" => bail!(
                "{src}: rule {key:?} sets {k}: this tool sets sym or desc_act for the whole model \
                 (--asym, --act-order); keep only bits and group_size in the rule"
            ),
            other => bail!(
                "{src}: rule {key:?} has an unknown key {other:?}{}: a plan rule sets bits (2, 3, \
                 4 or 8) and group_size (-1 or a positive number of columns), nothing else",
                did_you_mean(other, PLAN_RULE_KEYS)
            ),
        }
    }
    if !skip && obj.is_empty() {
        bail!(
            "{src}: rule {key:?} sets nothing: give it bits and/or group_size, or write {}: {{}} \
             to keep the modules it matches in 16 bits",
            as_json(format!("-:{pattern}"))
        );
    }
    let mut overrides = QuantOverride::default();
    if let Some(b) = obj.get("bits") {
        overrides.bits = Some(match b.as_u64() {
            Some(16) => bail!(
                "{src}: rule {key:?} has bits 16: 16 bits means not quantized, which a plan writes \
                 as a \"-:\" rule: {}: {{}} keeps the modules it matches in 16 bits",
                as_json(format!("-:{pattern}"))
            ),
            Some(b @ (2 | 3 | 4 | 8)) => b as u8,
            _ => bail!(
                "{src}: rule {key:?} asks for bits {b}: GPTQ packing takes 2, 3, 4 or 8 (and \
                 \"-:\" rules keep modules in 16 bits)"
            ),
        });
    }
    if let Some(g) = obj.get("group_size") {
        overrides.group_size = Some(parse_group(g).ok_or_else(|| {
            anyhow!("{src}: rule {key:?} has group_size {g}, expected -1 or > 0")
        })?);
    }
    Ok(DynamicRule {
        key: key.to_string(),
        pattern: pattern.to_string(),
        skip,
        overrides,
        regex: rule_regex(key, pattern, source)?,
    })
}

/// ` (did you mean "bits"?)` when `word` is a likely misspelling of one of `known`.
fn did_you_mean(word: &str, known: &[&str]) -> String {
    fn distance(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut prev: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut cur = vec![i + 1];
            for (j, cb) in b.iter().enumerate() {
                let sub = prev[j] + usize::from(ca != *cb);
                cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
            }
            prev = cur;
        }
        prev[b.len()]
    }
    known
        .iter()
        .map(|k| (distance(&word.to_ascii_lowercase(), k), k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| format!(" (did you mean {k:?}?)"))
        .unwrap_or_default()
}

/// The keys of the `dynamic` object (of `quantization_config` in a config.json, or at the top
/// of a quantize_config.json) in the order the text lists them; empty when there is none.
pub fn dynamic_key_order(text: &str) -> Vec<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct Keys(Vec<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("an object")
                }
                fn visit_map<A: MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> std::result::Result<Keys, A::Error> {
                    let mut keys = vec![];
                    while let Some(k) = map.next_key::<String>()? {
                        map.next_value::<IgnoredAny>()?;
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(V)
        }
    }
    #[derive(serde::Deserialize)]
    struct Settings {
        #[serde(default)]
        dynamic: Option<Keys>,
    }
    #[derive(serde::Deserialize)]
    struct Config {
        #[serde(default)]
        quantization_config: Option<Settings>,
        #[serde(default)]
        dynamic: Option<Keys>,
    }
    match serde_json::from_str::<Config>(text) {
        Ok(c) => c
            .quantization_config
            .and_then(|q| q.dynamic)
            .or(c.dynamic)
            .map(|k| k.0)
            .unwrap_or_default(),
        Err(_) => vec![],
    }
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

fn parse_json(path: &Path, text: &str) -> Result<Value> {
    let v = serde_json::from_str(text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    if let Some(k) = crate::checkpoint::json::duplicate_key(text.as_bytes()) {
        bail!(
            "{}: key {k} appears twice, so which value is meant is ambiguous; keep one",
            path.display()
        );
    }
    Ok(v)
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// Compares names with embedded numbers numerically (`layers.2` before `layers.10`).
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (a.as_bytes(), b.as_bytes());
    loop {
        match (x.first(), y.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(c), Some(d)) if c.is_ascii_digit() && d.is_ascii_digit() => {
                let lx = x.iter().take_while(|c| c.is_ascii_digit()).count();
                let ly = y.iter().take_while(|c| c.is_ascii_digit()).count();
                let trim = |s: &[u8]| -> usize { s.iter().take_while(|&&c| c == b'0').count() };
                let (nx, ny) = (&x[trim(&x[..lx])..lx], &y[trim(&y[..ly])..ly]);
                let ord = nx.len().cmp(&ny.len()).then_with(|| nx.cmp(ny));
                if ord != Ordering::Equal {
                    return ord;
                }
                x = &x[lx..];
                y = &y[ly..];
            }
            (Some(c), Some(d)) => {
                if c != d {
                    return c.cmp(d);
                }
                x = &x[1..];
                y = &y[1..];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::{Duration, Instant};

    /// `read_plan_rules` of `text` written to a file.
    fn plan_text(text: &str) -> Result<Vec<DynamicRule>> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("plan.json");
        std::fs::write(&p, text).unwrap();
        read_plan_rules(&p)
    }

    fn plan(v: Value) -> Result<Vec<DynamicRule>> {
        plan_text(&serde_json::to_string(&v).unwrap())
    }

    fn refused(v: Value, needles: &[&str]) {
        let e = format!("{:#}", plan(v.clone()).unwrap_err());
        for n in needles {
            assert!(e.contains(n), "{v}: expected {n:?} in {e}");
        }
    }

    #[test]
    fn a_plan_rule_that_would_do_nothing_is_refused_by_name() {
        refused(
            json!({"dynamic": {"+:.*mlp.*": {"bitz": 8}}}),
            &["unknown key \"bitz\"", "did you mean \"bits\"", "+:.*mlp.*"],
        );
        refused(
            json!({"dynamic": {"-:.*down_proj": {"bits": 8}}}),
            &[
                "-:.*down_proj",
                "bits 8",
                "would be dropped",
                "\"+:.*down_proj\"",
            ],
        );
        refused(
            json!({"dynamic": {"+:.*down_proj": {}}}),
            &["sets nothing", "\"-:.*down_proj\": {}"],
        );
        refused(json!({"dynamic": {}}), &["holds no rules"]);
        refused(
            json!({"dynamic": {"+:.*down_proj": {"bits": 8}}, "bits": 8}),
            &["unknown key \"bits\"", "--bits"],
        );
        refused(
            json!({"dynamic": {"+:.*down_proj": {"bits": 8}}, "version": 2}),
            &["version 2"],
        );
        refused(
            json!({"dynamic": {"+:.*down_proj": {"sym": false}}}),
            &["sym or desc_act"],
        );
        refused(
            json!({"dynamic": {"+:.*down_proj": {"bits": 5}}}),
            &["2, 3, 4 or 8"],
        );
        // The lenient reader of a checkpoint's config keeps accepting what the engines accept.
        let q = QuantInfo::from_json(
            json!({"bits": 4, "group_size": 128,
                   "dynamic": {"+:.*mlp.*": {"bitz": 8}, "-:.*down_proj": {"bits": 8}}}),
            Path::new("config.json"),
            true,
        )
        .unwrap();
        assert_eq!(q.dynamic.len(), 2);
    }

    #[test]
    fn bits_16_points_to_a_keep_rule() {
        refused(
            json!({"dynamic": {"+:model\\.layers\\.0\\.mlp\\..*": {"bits": 16}}}),
            &[
                "bits 16",
                r#""-:model\\.layers\\.0\\.mlp\\..*": {}"#,
                "16 bits",
            ],
        );
    }

    #[test]
    fn a_plan_with_a_byte_order_mark_is_read() {
        let rules = plan_text(
            "\u{feff}{\"dynamic\": {\"+:model\\\\.layers\\\\.0\\\\.mlp\\\\..*\": {\"bits\": 8}, \
             \"-:model\\\\.layers\\\\.1\\\\.mlp\\\\.down_proj\": {}}}",
        )
        .unwrap();
        assert_eq!(rules.len(), 2);
        assert_eq!(rules[0].overrides.bits, Some(8));
        assert!(rules[1].skip);
    }

    #[test]
    fn plan_rules_keep_file_order() {
        let text =
            r#"{"dynamic": {"+:z.*": {"bits": 8}, "-:a.*": {}, "+:m.*": {"group_size": 64}}}"#;
        let keys: Vec<String> = plan_text(text)
            .unwrap()
            .into_iter()
            .map(|r| r.key)
            .collect();
        assert_eq!(keys, ["+:z.*", "-:a.*", "+:m.*"]);
    }

    /// `n` distinct rules, none of which matches a real module.
    fn many_rules(n: usize) -> String {
        let rules: Vec<String> = (0..n)
            .rev()
            .map(|i| format!("\"+:model\\\\.nothing\\\\.{i}$\": {{\"bits\": 8}}"))
            .collect();
        format!("{{\"dynamic\": {{{}}}}}", rules.join(", "))
    }

    #[test]
    fn too_many_plan_rules_are_refused_at_once() {
        let text = many_rules(100_000);
        let t = Instant::now();
        let e = plan_text(&text).unwrap_err().to_string();
        assert!(
            e.contains("100000 rules") && e.contains(&MAX_PLAN_RULES.to_string()),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn rule_order_takes_linear_time() {
        // As many rules as a plan may hold, read in file order (the key order differs from the
        // sorted order a parsed object has).
        let t = Instant::now();
        let rules = plan_text(&many_rules(MAX_PLAN_RULES)).unwrap();
        assert_eq!(
            rules[0].key,
            format!("+:model\\.nothing\\.{}$", MAX_PLAN_RULES - 1)
        );
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        // A checkpoint config's rules (no bound there): ordering 30,000 is instant.
        let mut q = QuantInfo::from_json(
            json!({"bits": 4, "group_size": 128}),
            Path::new("config.json"),
            true,
        )
        .unwrap();
        let rule = plan_text(&many_rules(1)).unwrap().remove(0);
        let n = 30_000;
        q.dynamic = (0..n)
            .map(|i| DynamicRule {
                key: format!("+:r{i}"),
                ..rule.clone()
            })
            .collect();
        let order: Vec<String> = (0..n).rev().map(|i| format!("+:r{i}")).collect();
        let t = Instant::now();
        q.order_rules(&order);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert_eq!(q.dynamic[0].key, format!("+:r{}", n - 1));
    }
}
