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
        self.dynamic
            .sort_by_key(|r| order.iter().position(|k| k == &r.key).unwrap_or(usize::MAX));
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

fn parse_rule(key: &str, v: &Value, source: &Path) -> Result<DynamicRule> {
    let src = source.display();
    let (skip, pattern) = if let Some(p) = key.strip_prefix("-:") {
        (true, p)
    } else if let Some(p) = key.strip_prefix("+:") {
        (false, p)
    } else {
        (false, key)
    };
    let regex = Regex::new(&format!("^(?:{pattern})")).with_context(|| {
        format!(
            "{src}: dynamic rule {key:?} is not a regular expression this tool understands \
             (Rust regex syntax: no look-around or back-references)"
        )
    })?;
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

/// The rules of a plan file (`quantize --plan`, written by `sensitivity`): a JSON object whose
/// `dynamic` object holds GPTQModel rules (`"+:REGEX": {"bits": 8}`, `"-:REGEX": {}`), in the
/// order the file lists them (the first matching rule decides).
pub fn read_plan_rules(path: &Path) -> Result<Vec<DynamicRule>> {
    crate::checkpoint::guard::regular_file(path, "--plan")?;
    let text = read_text(path)?;
    let v = parse_json(path, &text)?;
    let rules = match v.get("dynamic") {
        Some(Value::Object(rules)) => rules
            .iter()
            .map(|(key, v)| parse_rule(key, v, path))
            .collect::<Result<Vec<_>>>()?,
        _ => bail!(
            "{}: a plan is a JSON object with a \"dynamic\" object of rules, e.g. \
             {{\"dynamic\": {{\"+:model\\\\.layers\\\\.3\\\\.mlp\\\\..*\": {{\"bits\": 8}}}}}} \
             (`soar-gptq sensitivity --plan-out` writes one)",
            path.display()
        ),
    };
    let order = dynamic_key_order(&text);
    let mut rules = rules;
    rules.sort_by_key(|r| order.iter().position(|k| k == &r.key).unwrap_or(usize::MAX));
    Ok(rules)
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
