//! Reading quantized checkpoints: GPTQ v1 (`checkpoint_format: "gptq"`, zeros stored minus one),
//! GPTQ v2 (`"gptq_v2"`, real zeros) and Marlin (`"marlin"`, `is_marlin_format: true` or
//! `quant_method: "marlin"`), whoever wrote them and whatever the architecture: quantized modules
//! are found by their tensors (`{p}.qweight`, or `{p}.B` for Marlin), not by a model definition.
//!
//! * [`read_quant_info`] parses the settings (`config.json` `quantization_config`, else
//!   `quantize_config.json`), including GPTQModel `dynamic` rules (`-:REGEX` keeps a module
//!   unquantized, `+:REGEX` / `REGEX` override its bits, group size, sym or desc_act). Patterns
//!   are matched from the start of the module name, as Python's `re.match` in the engines does.
//! * [`validate_quantized`] checks a checkpoint against the BF16 layout a config implies (or, with
//!   [`validate_quantized_modules`] and no layout, the quantized sets alone): shapes, dtypes,
//!   `g_idx` against `desc_act`, the `qzeros` convention of symmetric checkpoints, Marlin shapes
//!   and sort indices. Every message names the tensor and the file.
//! * [`dequantize_module`] rebuilds one Linear's weight `[N, K]` (HF layout) bit-exactly:
//!   `f32(scale_f16) · (code − zero)`, one rounding per value.
//!
//! Marlin act-order (soar-gptq extension, see [`pack_marlin`](mod@crate::pack_marlin)): a
//! module whose `desc_act` is true stores `{p}.g_idx_sort_indices` I32 `[K]`; Marlin row `k'`
//! holds original row `sort[k']` and belongs to group `k' / g`.

use crate::checkpoint::{Checkpoint, Dtype};
use crate::format::marlin::{check_marlin_shape, unpack_marlin, unpermute_scales};
use crate::format::pack::{dequantize_gptq, GptqTensors};
use crate::model::AnyConfig;
use anyhow::{anyhow, bail, ensure, Context, Result};
use rayon::prelude::*;
use regex::Regex;
use serde::Serialize;
use serde_json::Value;
use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

pub const CONFIG_FILE: &str = "config.json";
pub const QUANTIZE_CONFIG_FILE: &str = "quantize_config.json";
/// Tensor suffixes of one GPTQ-quantized Linear.
pub const GPTQ_SUFFIXES: [&str; 4] = ["qweight", "qzeros", "scales", "g_idx"];
/// Marlin act-order sort indices (our extension to the legacy Marlin format).
pub const SORT_INDICES_SUFFIX: &str = "g_idx_sort_indices";

/// On-disk layout of the quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantFormat {
    /// `checkpoint_format: "gptq"` (the default): `qzeros` store `zero − 1`.
    GptqV1,
    /// `checkpoint_format: "gptq_v2"`: `qzeros` store the zero itself.
    GptqV2,
    /// Legacy Marlin tiles `B` and permuted scales `s`.
    Marlin,
}

impl QuantFormat {
    /// The `checkpoint_format` value of this layout.
    pub fn checkpoint_format(self) -> &'static str {
        match self {
            Self::GptqV1 => "gptq",
            Self::GptqV2 => "gptq_v2",
            Self::Marlin => "marlin",
        }
    }
}

/// Per-module overrides of a positive `dynamic` rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QuantOverride {
    pub bits: Option<u8>,
    pub group_size: Option<i32>,
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
    pub group_size: i32,
    pub sym: bool,
    pub desc_act: bool,
}

/// The quantization settings of a checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct QuantInfo {
    pub bits: u8,
    /// `-1` means one group over all of K.
    pub group_size: i32,
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

fn parse_group(v: &Value) -> Option<i32> {
    v.as_i64()
        .filter(|&g| g == -1 || (g > 0 && g <= i32::MAX as i64))
        .map(|g| g as i32)
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

/// The BF16 layout `dir/config.json` implies when it is a valid config of a supported
/// architecture (MiniCPM-SALA or a dense Llama-family decoder); otherwise the reason it is not
/// (other architectures are validated by their quantized sets alone).
pub fn expected_bf16_tensors(dir: &Path) -> std::result::Result<Vec<(String, Vec<usize>)>, String> {
    let path = dir.join(CONFIG_FILE);
    if !path.is_file() {
        return Err(format!("{} does not exist", path.display()));
    }
    AnyConfig::from_file(&path)
        .map(|c| c.expected_tensors())
        .map_err(|e| format!("{e:#}"))
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

/// Prefixes of the quantized modules (those with `{p}.qweight`, or `{p}.B` for Marlin), in
/// natural order.
pub fn quantized_prefixes(ck: &Checkpoint, info: &QuantInfo) -> Vec<String> {
    let suffix = match info.format {
        QuantFormat::Marlin => ".B",
        _ => ".qweight",
    };
    let mut out: Vec<String> = ck
        .names()
        .filter_map(|n| n.strip_suffix(suffix).map(str::to_string))
        .collect();
    out.sort_by(|a, b| natural_cmp(a, b));
    out
}

/// `tensor NAME in FILE`, for messages.
pub(crate) fn at(ck: &Checkpoint, name: &str) -> String {
    match ck.get(name) {
        Some(e) => format!("tensor {name} in {}", ck.shard_path(e).display()),
        None => format!("tensor {name} (absent from {})", ck.dir.display()),
    }
}

/// One validated quantized Linear.
#[derive(Debug, Clone, Serialize)]
pub struct QuantModule {
    pub prefix: String,
    /// out_features
    pub n: usize,
    /// in_features
    pub k: usize,
    pub bits: u8,
    pub group_size: i32,
    /// Rows of `scales` / `s`.
    pub groups: usize,
    pub sym: bool,
    pub desc_act: bool,
    /// The rows are permuted (act-order `g_idx`, or non-identity Marlin sort indices).
    pub act_order: bool,
    /// Bytes of the module's quantized tensors.
    pub bytes: u64,
    /// The tensors that make up the module.
    pub tensors: Vec<String>,
}

impl QuantModule {
    /// Rows of one group (`K` for group size −1).
    pub fn group_len(&self) -> usize {
        if self.group_size < 0 {
            self.k
        } else {
            self.group_size as usize
        }
    }
}

fn need<'a>(
    ck: &'a Checkpoint,
    prefix: &str,
    suffix: &str,
    have: &str,
    what: &str,
) -> Result<&'a crate::checkpoint::TensorEntry> {
    let name = format!("{prefix}.{suffix}");
    ck.get(&name).ok_or_else(|| {
        anyhow!(
            "quantized module {prefix} is incomplete: {name} is missing, although {} exists \
             ({what})",
            at(ck, &format!("{prefix}.{have}"))
        )
    })
}

fn check_dtype(ck: &Checkpoint, name: &str, ok: &[Dtype], want: &str) -> Result<()> {
    let e = ck.get(name).expect("checked present");
    ensure!(
        ok.contains(&e.dtype),
        "{} has dtype {}, expected {want}",
        at(ck, name),
        e.dtype.name()
    );
    Ok(())
}

fn check_shape(ck: &Checkpoint, name: &str, want: &[usize], why: &str) -> Result<()> {
    let e = ck.get(name).expect("checked present");
    ensure!(
        e.shape == want,
        "{} has shape {:?}, expected {want:?} ({why})",
        at(ck, name),
        e.shape
    );
    Ok(())
}

const FLOATS: [Dtype; 3] = [Dtype::F16, Dtype::BF16, Dtype::F32];

/// Validates one quantized module (found by `{prefix}.qweight` or `{prefix}.B`) and returns its
/// shape and settings. `expect` is `(N, K)` of the `.weight` it replaces, when known.
pub fn check_quantized_module(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
    expect: Option<(usize, usize)>,
) -> Result<QuantModule> {
    let main = match info.format {
        QuantFormat::Marlin => format!("{prefix}.B"),
        _ => format!("{prefix}.qweight"),
    };
    ensure!(
        ck.contains(&main),
        "quantized module {prefix}: {main} is missing from {}",
        ck.dir.display()
    );
    let Some(m) = info.module_settings(prefix) else {
        let rule = info.skip_rule(prefix).expect("skipped by a rule");
        bail!(
            "{} is quantized, but dynamic rule {:?} in {} keeps module {prefix} unquantized, so \
             engines would look for {prefix}.weight: remove the rule or the quantized tensors",
            at(ck, &main),
            rule.key,
            info.source.display()
        );
    };
    if prefix == "lm_head" || prefix.ends_with(".lm_head") {
        ensure!(
            info.lm_head,
            "{} is quantized, but lm_head is not true in {}: engines would load lm_head as an \
             unquantized layer; set \"lm_head\": true",
            at(ck, &main),
            info.source.display()
        );
    }
    match info.format {
        QuantFormat::Marlin => check_marlin_module(ck, info, prefix, m, expect),
        _ => check_gptq_module(ck, info, prefix, m, expect),
    }
}

fn expected_weight_note(prefix: &str, expect: Option<(usize, usize)>) -> String {
    match expect {
        Some((n, k)) => format!("{prefix}.weight it replaces is [N, K] = [{n}, {k}]"),
        None => String::new(),
    }
}

fn check_gptq_module(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
    m: ModuleQuant,
    expect: Option<(usize, usize)>,
) -> Result<QuantModule> {
    let what = "a GPTQ Linear stores qweight, qzeros, scales and g_idx";
    let names: Vec<String> = GPTQ_SUFFIXES
        .iter()
        .map(|s| format!("{prefix}.{s}"))
        .collect();
    for s in &GPTQ_SUFFIXES[1..] {
        need(ck, prefix, s, "qweight", what)?;
    }
    let [qw, qz, sc, gi] = [&names[0], &names[1], &names[2], &names[3]];
    check_dtype(ck, qw, &[Dtype::I32], "I32 (packed codes)")?;
    check_dtype(ck, qz, &[Dtype::I32], "I32 (packed zero points)")?;
    check_dtype(ck, gi, &[Dtype::I32], "I32 (group of each input row)")?;
    check_dtype(ck, sc, &FLOATS, "F16 (or BF16/F32) scales")?;
    let bits = m.bits;
    let (vals, words) = match super::pack::block_shape(bits) {
        Ok(shape) => shape,
        Err(_) => bail!(
            "{} belongs to a {bits}-bit module: GPTQ packs 2, 3, 4 and 8 bits only",
            at(ck, qw)
        ),
    };
    let qshape = &ck.get(qw).unwrap().shape;
    ensure!(
        qshape.len() == 2,
        "{} has shape {qshape:?}, expected 2 dimensions [K*{bits}/32, N]",
        at(ck, qw)
    );
    ensure!(
        qshape[0].is_multiple_of(words),
        "{} has {} rows, not a whole number of {bits}-bit packing blocks ({words} rows hold \
         {vals} input rows)",
        at(ck, qw),
        qshape[0]
    );
    let (k, n) = (qshape[0] / words * vals, qshape[1]);
    if let Some((en, ek)) = expect {
        ensure!(
            n == en && k == ek,
            "{} has shape {qshape:?}, which holds K = {k}, N = {n} at {bits} bits, but the {}; \
             expected qweight [{}, {en}]",
            at(ck, qw),
            expected_weight_note(prefix, expect),
            ek as f64 * bits as f64 / 32.0
        );
    }
    ensure!(k > 0 && n > 0, "{} is empty (shape {qshape:?})", at(ck, qw));
    let g = if m.group_size < 0 {
        k
    } else {
        m.group_size as usize
    };
    let groups = k.div_ceil(g);
    ensure!(
        n % vals == 0,
        "{}: N = {n} is not a multiple of {vals}, so qzeros cannot pack {bits}-bit zeros along N",
        at(ck, qw)
    );
    check_shape(
        ck,
        qz,
        &[groups, n / vals * words],
        &format!("ceil(K={k} / group {g}) groups x N={n}*{bits}/32"),
    )?;
    check_shape(
        ck,
        sc,
        &[groups, n],
        &format!("ceil(K={k} / group {g}) groups x N={n}"),
    )?;
    check_shape(ck, gi, &[k], &format!("one group per input row, K={k}"))?;
    let g_idx = ck.i32_data(gi)?;
    let act_order = check_g_idx(ck, gi, &g_idx, k, g, groups, m.desc_act, &info.source)?;
    if m.sym {
        let zero = 1u32 << (bits - 1);
        let v1 = info.format == QuantFormat::GptqV1;
        // The words of one packing block of `vals` identical zeros; the stream repeats them.
        let pattern = super::pack::pack_qzeros(&vec![zero as u8; vals], 1, vals, bits, v1)?;
        let qzeros = ck.i32_data(qz)?;
        if let Some(pos) = (0..qzeros.len()).position(|p| qzeros[p] != pattern[p % words]) {
            let word = pattern[pos % words] as u32;
            bail!(
                "{}: word {pos} is 0x{:08x}, but a symmetric {bits}-bit checkpoint with \
                 checkpoint_format {:?} stores 0x{word:08x} there (every zero point is {zero}{}); \
                 the checkpoint_format or sym setting in {} is probably wrong (\"gptq\" stores \
                 zero - 1, \"gptq_v2\" the zero itself)",
                at(ck, qz),
                qzeros[pos] as u32,
                info.format.checkpoint_format(),
                if v1 { ", stored minus one" } else { "" },
                info.source.display()
            );
        }
    }
    let bytes = names
        .iter()
        .map(|nm| ck.get(nm).unwrap().nbytes() as u64)
        .sum();
    Ok(QuantModule {
        prefix: prefix.to_string(),
        n,
        k,
        bits,
        group_size: m.group_size,
        groups,
        sym: m.sym,
        desc_act: m.desc_act,
        act_order,
        bytes,
        tensors: names,
    })
}

/// Checks `g_idx` against `desc_act`; returns whether it is permuted (act-order).
#[allow(clippy::too_many_arguments)]
fn check_g_idx(
    ck: &Checkpoint,
    name: &str,
    g_idx: &[i32],
    k: usize,
    g: usize,
    groups: usize,
    desc_act: bool,
    source: &Path,
) -> Result<bool> {
    if let Some(pos) = g_idx.iter().position(|&v| v < 0 || v as usize >= groups) {
        bail!(
            "{}: g_idx[{pos}] = {} is outside the {groups} groups of scales",
            at(ck, name),
            g_idx[pos]
        );
    }
    let trivial_mismatch = (0..k).find(|&i| g_idx[i] as usize != i / g);
    if !desc_act {
        if let Some(i) = trivial_mismatch {
            bail!(
                "{}: g_idx[{i}] = {}, but desc_act is false in {}, which means g_idx[k] = k / {g} \
                 (= {}); set desc_act true if the checkpoint uses act-order",
                at(ck, name),
                g_idx[i],
                source.display(),
                i / g
            );
        }
        return Ok(false);
    }
    let mut counts = vec![0usize; groups];
    for &v in g_idx {
        counts[v as usize] += 1;
    }
    for (grp, &c) in counts.iter().enumerate() {
        let want = if grp + 1 == groups { k - grp * g } else { g };
        ensure!(
            c == want,
            "{}: group {grp} is used by {c} rows, expected {want} (act-order GPTQ assigns exactly \
             group_size = {g} rows to every group)",
            at(ck, name)
        );
    }
    Ok(trivial_mismatch.is_some())
}

fn check_marlin_module(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
    m: ModuleQuant,
    expect: Option<(usize, usize)>,
) -> Result<QuantModule> {
    let b = format!("{prefix}.B");
    let s = format!("{prefix}.s");
    let si = format!("{prefix}.{SORT_INDICES_SUFFIX}");
    need(ck, prefix, "s", "B", "a Marlin Linear stores B and s")?;
    check_dtype(ck, &b, &[Dtype::I32], "I32 (Marlin tiles)")?;
    check_dtype(ck, &s, &FLOATS, "F16 scales")?;
    ensure!(
        m.bits == 4 && m.sym,
        "{}: Marlin holds symmetric 4-bit codes only, but the settings in {} give module {prefix} \
         bits = {}, sym = {}",
        at(ck, &b),
        info.source.display(),
        m.bits,
        m.sym
    );
    let bshape = &ck.get(&b).unwrap().shape;
    ensure!(
        bshape.len() == 2 && bshape[1].is_multiple_of(2),
        "{} has shape {bshape:?}, expected [K/16, 2N]",
        at(ck, &b)
    );
    let (k, n) = (bshape[0] * 16, bshape[1] / 2);
    if let Some((en, ek)) = expect {
        ensure!(
            n == en && k == ek,
            "{} has shape {bshape:?}, which holds K = {k}, N = {n}, but the {}; expected B \
             [{}, {}]",
            at(ck, &b),
            expected_weight_note(prefix, expect),
            ek / 16,
            2 * en
        );
    }
    check_marlin_shape(k, n, m.group_size, m.bits, m.sym)
        .with_context(|| format!("{} (K = {k}, N = {n})", at(ck, &b)))?;
    let groups = if m.group_size < 0 {
        1
    } else {
        k / m.group_size as usize
    };
    check_shape(
        ck,
        &s,
        &[groups, n],
        &format!("K={k} / group {} groups x N={n}", m.group_size),
    )?;
    let mut tensors = vec![b.clone(), s.clone()];
    let mut act_order = false;
    if ck.contains(&si) {
        check_dtype(ck, &si, &[Dtype::I32], "I32 (row permutation)")?;
        check_shape(ck, &si, &[k], &format!("one entry per input row, K={k}"))?;
        let sort = ck.i32_data(&si)?;
        check_permutation(&sort, k).map_err(|e| anyhow!("{}: {e}", at(ck, &si)))?;
        act_order = sort.iter().enumerate().any(|(i, &r)| r as usize != i);
        ensure!(
            m.desc_act || !act_order,
            "{} permutes the rows, but desc_act is false in {}: set desc_act true, or the rows \
             are misplaced",
            at(ck, &si),
            info.source.display()
        );
        tensors.push(si);
    } else {
        ensure!(
            !m.desc_act,
            "Marlin module {prefix} has desc_act true but no {si} ({} holds rows pre-sorted by \
             group; without the sort indices the input columns cannot be matched)",
            at(ck, &b)
        );
    }
    let bytes = tensors
        .iter()
        .map(|nm| ck.get(nm).unwrap().nbytes() as u64)
        .sum();
    Ok(QuantModule {
        prefix: prefix.to_string(),
        n,
        k,
        bits: 4,
        group_size: m.group_size,
        groups,
        sym: true,
        desc_act: m.desc_act,
        act_order,
        bytes,
        tensors,
    })
}

fn check_permutation(sort: &[i32], k: usize) -> std::result::Result<(), String> {
    let mut seen = vec![false; k];
    for (pos, &r) in sort.iter().enumerate() {
        if r < 0 || r as usize >= k || seen[r as usize] {
            return Err(format!(
                "entry {pos} is {r}: the sort indices are not a permutation of 0..{k}"
            ));
        }
        seen[r as usize] = true;
    }
    Ok(())
}

fn quant_suffixes(format: QuantFormat) -> &'static [&'static str] {
    match format {
        QuantFormat::Marlin => &["B", "s", SORT_INDICES_SUFFIX],
        _ => &GPTQ_SUFFIXES,
    }
}

/// Validates a quantized checkpoint and returns its modules. With `expected` (the BF16 layout,
/// `(name, shape)`), every expected tensor must be present as a float tensor of that shape or,
/// for a 2-D `*.weight`, replaced by a complete quantized set of the same N, K; nothing else may
/// be present. Without it, every quantized set is checked and no stray quantization tensor may
/// be present.
pub fn validate_quantized_modules(
    ck: &Checkpoint,
    info: &QuantInfo,
    expected: Option<&[(String, Vec<usize>)]>,
) -> Result<Vec<QuantModule>> {
    let prefixes = quantized_prefixes(ck, info);
    let mut claimed: HashSet<String> = HashSet::new();
    let mut modules = Vec::new();
    match expected {
        Some(expected) => {
            let qset: HashSet<&str> = prefixes.iter().map(String::as_str).collect();
            for (name, shape) in expected {
                let quant_prefix = name
                    .strip_suffix(".weight")
                    .filter(|p| shape.len() == 2 && qset.contains(p));
                if let Some(e) = ck.get(name) {
                    ensure!(
                        e.dtype.is_float(),
                        "{} has dtype {}, expected a float tensor (BF16, F16 or F32)",
                        at(ck, name),
                        e.dtype.name()
                    );
                    ensure!(
                        &e.shape == shape,
                        "{} has shape {:?}, but config.json implies {shape:?}",
                        at(ck, name),
                        e.shape
                    );
                    if let Some(p) = quant_prefix {
                        bail!(
                            "module {p} is stored twice: as {} and as quantized {}",
                            at(ck, name),
                            at(ck, &format!("{p}.{}", quant_suffixes(info.format)[0]))
                        );
                    }
                    claimed.insert(name.clone());
                } else if let Some(p) = quant_prefix {
                    let m = check_quantized_module(ck, info, p, Some((shape[0], shape[1])))?;
                    claimed.extend(m.tensors.iter().cloned());
                    modules.push(m);
                } else {
                    bail!(
                        "tensor {name} (shape {shape:?}) is missing from {}: config.json implies \
                         it and no quantized set replaces it",
                        ck.dir.display()
                    );
                }
            }
        }
        None => {
            for p in &prefixes {
                let m = check_quantized_module(ck, info, p, None)?;
                claimed.extend(m.tensors.iter().cloned());
                modules.push(m);
            }
        }
    }
    let suffixes = quant_suffixes(info.format);
    let mut unclaimed: Vec<&String> = ck.names().filter(|n| !claimed.contains(*n)).collect();
    unclaimed.sort_by(|a, b| natural_cmp(a, b));
    for name in unclaimed {
        let stray = name
            .rsplit_once('.')
            .is_some_and(|(_, s)| suffixes.contains(&s));
        if expected.is_some() {
            bail!(
                "unexpected {}: config.json does not imply it and it is not part of a quantized \
                 module{} (wrong config, another architecture, or a partial quantized set?)",
                at(ck, name),
                if stray {
                    " whose .weight config.json lists"
                } else {
                    ""
                }
            );
        } else if stray {
            bail!(
                "stray {}: it looks like part of a quantized set, but its module has no {}",
                at(ck, name),
                suffixes[0]
            );
        }
    }
    Ok(modules)
}

/// [`validate_quantized_modules`] against the BF16 layout `expected_bf16` (`(name, shape)`).
pub fn validate_quantized(
    ck: &Checkpoint,
    info: &QuantInfo,
    expected_bf16: &[(String, Vec<usize>)],
) -> Result<()> {
    validate_quantized_modules(ck, info, Some(expected_bf16)).map(|_| ())
}

/// The stored tensors of one quantized module, read and checked, ready to decode.
pub enum ModuleCodes {
    Gptq {
        qweight: Vec<i32>,
        qzeros: Vec<i32>,
        /// `[groups, N]`, the stored (fp16) values widened to f32.
        scales: Vec<f32>,
        g_idx: Vec<i32>,
        bits: u8,
        v1: bool,
    },
    Marlin {
        /// `B` `[K/16, 2N]`.
        b: Vec<i32>,
        /// `[groups, N]`, un-permuted.
        scales: Vec<f32>,
        /// The original input row of each tile row (`g_idx_sort_indices`, identity without it).
        src_row: Vec<i32>,
        group: usize,
    },
}

/// Reads and checks the stored tensors of module `prefix`; returns them with `(N, K)`.
pub fn read_module_codes(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
) -> Result<(ModuleCodes, usize, usize)> {
    let m = check_quantized_module(ck, info, prefix, None)
        .with_context(|| format!("cannot dequantize module {prefix}"))?;
    let (n, k) = (m.n, m.k);
    let codes = match info.format {
        QuantFormat::Marlin => {
            let s_name = format!("{prefix}.s");
            let scales = unpermute_scales(&ck.f32_data(&s_name)?, m.groups, n)
                .with_context(|| format!("un-permuting {}", at(ck, &s_name)))?;
            let si = format!("{prefix}.{SORT_INDICES_SUFFIX}");
            let src_row: Vec<i32> = if ck.contains(&si) {
                ck.i32_data(&si)?
            } else {
                (0..k as i32).collect()
            };
            ModuleCodes::Marlin {
                b: ck.i32_data(&format!("{prefix}.B"))?,
                scales,
                src_row,
                group: m.group_len(),
            }
        }
        _ => {
            let get = |s: &str| ck.i32_data(&format!("{prefix}.{s}"));
            ModuleCodes::Gptq {
                qweight: get("qweight")?,
                qzeros: get("qzeros")?,
                scales: ck.f32_data(&format!("{prefix}.scales"))?,
                g_idx: get("g_idx")?,
                bits: m.bits,
                v1: info.format == QuantFormat::GptqV1,
            }
        }
    };
    Ok((codes, n, k))
}

impl ModuleCodes {
    /// `W` `[N, K]` row-major f32 (HF layout, `y = x·Wᵀ`), bit-exactly `f32(scale) · (code − zero)`
    /// (Marlin: zero 8, rows un-sorted), on the CPU.
    pub fn dequantize(&self, n: usize, k: usize) -> Result<Vec<f32>> {
        match self {
            ModuleCodes::Marlin {
                b,
                scales,
                src_row,
                group,
            } => {
                let codes = unpack_marlin(b, k, n)?;
                let mut w = vec![0f32; n * k];
                // Row k' of the tiles is original input row src_row[k'], in group k' / g.
                let mut src_of = vec![0usize; k];
                for (kp, &row) in src_row.iter().enumerate() {
                    src_of[row as usize] = kp;
                }
                w.par_chunks_mut(k).enumerate().for_each(|(col, out)| {
                    for (row, v) in out.iter_mut().enumerate() {
                        let kp = src_of[row];
                        let code = i32::from(codes[kp * n + col]);
                        *v = scales[(kp / group) * n + col] * (code - 8) as f32;
                    }
                });
                Ok(w)
            }
            ModuleCodes::Gptq {
                qweight,
                qzeros,
                scales,
                g_idx,
                bits,
                v1,
            } => dequantize_gptq_nk(&GptqTensors {
                qweight,
                qzeros,
                scales,
                g_idx,
                k,
                n,
                bits: *bits,
                v1: *v1,
            }),
        }
    }

    /// [`dequantize`](Self::dequantize) as an f32 `[N, K]` tensor on `device`: decoded by the
    /// GPU kernels on a CUDA device (bit-identical, `tests/cuda_twins.rs`), else on the CPU.
    pub fn dequantize_tensor(
        &self,
        n: usize,
        k: usize,
        device: &candle_core::Device,
    ) -> Result<candle_core::Tensor> {
        #[cfg(feature = "cuda")]
        if let (
            true,
            ModuleCodes::Marlin {
                b,
                scales,
                src_row,
                group,
            },
        ) = (device.is_cuda(), self)
        {
            return crate::kernels::cuda::dequant_marlin(device, b, scales, src_row, k, n, *group);
        }
        match self {
            ModuleCodes::Gptq {
                qweight,
                qzeros,
                scales,
                g_idx,
                bits,
                v1,
            } => dequantize_gptq_tensor(
                &GptqTensors {
                    qweight,
                    qzeros,
                    scales,
                    g_idx,
                    k,
                    n,
                    bits: *bits,
                    v1: *v1,
                },
                device,
            ),
            ModuleCodes::Marlin { .. } => Ok(candle_core::Tensor::from_vec(
                self.dequantize(n, k)?,
                (n, k),
                device,
            )?),
        }
    }
}

/// GPTQ tensors decoded to `W` `[N, K]` row-major f32 (the HF layout), on the CPU.
fn dequantize_gptq_nk(t: &GptqTensors) -> Result<Vec<f32>> {
    let (n, k) = (t.n, t.k);
    let wt = dequantize_gptq(t)?;
    let mut w = vec![0f32; n * k];
    w.par_chunks_mut(k).enumerate().for_each(|(col, out)| {
        for (row, v) in out.iter_mut().enumerate() {
            *v = wt[row * n + col];
        }
    });
    Ok(w)
}

/// GPTQ tensors decoded to an f32 `[N, K]` tensor on `device` (the GPU kernel on a CUDA device,
/// bit-identical to the CPU decode), from borrowed slices: [`ModuleCodes::dequantize_tensor`]
/// and the quantize pipeline, which decodes every module it has just packed without copying
/// its 4.4 GB of qweight (9.5B model) into fresh buffers first.
pub fn dequantize_gptq_tensor(
    t: &GptqTensors,
    device: &candle_core::Device,
) -> Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return crate::kernels::cuda::dequant_gptq(
            device, t.qweight, t.qzeros, t.scales, t.g_idx, t.k, t.n, t.bits, t.v1,
        );
    }
    Ok(candle_core::Tensor::from_vec(
        dequantize_gptq_nk(t)?,
        (t.n, t.k),
        device,
    )?)
}

/// Dequantizes one module to `W` `[N, K]` row-major f32 (HF layout, `y = x·Wᵀ`), bit-exactly
/// `f32(scale) · (code − zero)` (Marlin: zero 8, rows un-sorted). Returns `(W, N, K)`.
pub fn dequantize_module(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
) -> Result<(Vec<f32>, usize, usize)> {
    let (codes, n, k) = read_module_codes(ck, info, prefix)?;
    let w = codes
        .dequantize(n, k)
        .with_context(|| format!("dequantizing module {prefix} of {}", ck.dir.display()))?;
    Ok((w, n, k))
}

/// Groups of modules the engines fuse into one layer (SGLang/vLLM `qkv_proj`, `gate_up_proj`):
/// `(fused name, member suffixes)`.
pub const FUSED_GROUPS: [(&str, &[&str]); 2] = [
    ("qkv_proj", &["q_proj", "k_proj", "v_proj"]),
    ("gate_up_proj", &["gate_proj", "up_proj"]),
];

/// For every parent module that holds members of a fused group: `(parent.fused, members that
/// exist)`, where a member exists when either `{p}.weight` or a quantized set is present.
pub fn fused_groups(ck: &Checkpoint, quantized: &[String]) -> Vec<(String, Vec<String>)> {
    let mut found: HashMap<String, Vec<String>> = HashMap::new();
    let candidates = ck
        .names()
        .filter_map(|n| n.strip_suffix(".weight"))
        .chain(quantized.iter().map(String::as_str));
    for p in candidates {
        let Some((parent, leaf)) = p.rsplit_once('.') else {
            continue;
        };
        for (fused, members) in FUSED_GROUPS {
            if members.contains(&leaf) {
                let list = found.entry(format!("{parent}.{fused}")).or_default();
                if !list.iter().any(|x| x == p) {
                    list.push(p.to_string());
                }
            }
        }
    }
    let mut out: Vec<(String, Vec<String>)> = found.into_iter().collect();
    for (_, members) in &mut out {
        members.sort_by(|a, b| natural_cmp(a, b));
    }
    out.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::writer::{write_sharded, TensorSpec};
    use crate::format::pack::{i32_to_le_bytes, pack_qweight};
    use serde_json::json;
    use std::io::Write;

    fn info(v: Value) -> Result<QuantInfo> {
        QuantInfo::from_json(v, Path::new("quantize_config.json"), false)
    }

    #[test]
    fn formats_and_defaults_are_recognised() {
        let base = json!({"bits": 4, "group_size": 128});
        let i = info(base.clone()).unwrap();
        assert_eq!(i.format, QuantFormat::GptqV1);
        assert!(i.sym && !i.desc_act);
        assert_eq!(i.missing_keys, vec!["sym", "desc_act"]);
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            info(b)
        };
        assert_eq!(
            with("checkpoint_format", json!("gptq_v2")).unwrap().format,
            QuantFormat::GptqV2
        );
        assert_eq!(
            with("format", json!("marlin")).unwrap().format,
            QuantFormat::Marlin
        );
        assert_eq!(
            with("is_marlin_format", json!(true)).unwrap().format,
            QuantFormat::Marlin
        );
        assert_eq!(
            with("quant_method", json!("marlin")).unwrap().format,
            QuantFormat::Marlin
        );
        let e = with("quant_method", json!("awq")).unwrap_err().to_string();
        assert!(e.contains("quant_method is \"awq\""), "{e}");
        let e = with("checkpoint_format", json!("bitblas"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bitblas"), "{e}");
        let e = with("group_size", json!(0)).unwrap_err().to_string();
        assert!(e.contains("group_size is 0"), "{e}");
        let e = info(json!({"group_size": 128})).unwrap_err().to_string();
        assert!(e.contains("no bits"), "{e}");
    }

    #[test]
    fn dynamic_rules_skip_and_override_from_the_start_of_the_name() {
        let i = info(json!({
            "bits": 4, "group_size": 128, "sym": true, "desc_act": false,
            "dynamic": {
                "-:.*\\.mlp\\.down_proj": {},
                "+:model\\.layers\\.1\\..*": {"bits": 8, "group_size": 64},
            }
        }))
        .unwrap();
        assert!(i.module_settings("model.layers.0.mlp.down_proj").is_none());
        assert_eq!(
            i.skip_rule("model.layers.3.mlp.down_proj").unwrap().key,
            "-:.*\\.mlp\\.down_proj"
        );
        let m = i
            .module_settings("model.layers.1.self_attn.q_proj")
            .unwrap();
        assert_eq!((m.bits, m.group_size), (8, 64));
        let m = i
            .module_settings("model.layers.0.self_attn.q_proj")
            .unwrap();
        assert_eq!((m.bits, m.group_size), (4, 128));
        // Anchored at the start: "layers\.1" does not match in the middle of the name.
        let j =
            info(json!({"bits": 4, "group_size": 128, "dynamic": {"-:layers\\.1": {}}})).unwrap();
        assert!(j.module_settings("model.layers.1.mlp.up_proj").is_some());
        let e = info(json!({"bits": 4, "group_size": 128, "dynamic": {"-:(?<=x)a": {}}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("dynamic rule"), "{e}");
    }

    #[test]
    fn natural_order_sorts_layer_numbers() {
        let mut v = vec!["l.10.a", "l.2.b", "l.2.a", "l.1"];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(v, vec!["l.1", "l.2.a", "l.2.b", "l.10.a"]);
    }

    /// One 4-bit GPTQ module `p` with K = 256, N = 64, group 128, written by our writer.
    fn write_module(dir: &Path, g_idx: &[i32], qzero_word: u32) -> Checkpoint {
        let (k, n, g) = (256usize, 64usize, 2usize);
        let codes: Vec<u8> = (0..k * n).map(|i| (i * 7 % 16) as u8).collect();
        let qweight = pack_qweight(&codes, k, n, 4).unwrap();
        let qzeros = vec![qzero_word as i32; g * n / 8];
        let scales: Vec<u8> = (0..g * n)
            .flat_map(|i| half::f16::from_f32(0.01 * (1 + i % 5) as f32).to_le_bytes())
            .collect();
        let specs = vec![
            TensorSpec::new("p.g_idx", Dtype::I32, vec![k]),
            TensorSpec::new("p.qweight", Dtype::I32, vec![k / 8, n]),
            TensorSpec::new("p.qzeros", Dtype::I32, vec![g, n / 8]),
            TensorSpec::new("p.scales", Dtype::F16, vec![g, n]),
        ];
        write_sharded(dir, &specs, u64::MAX, |s, w: &mut dyn Write| {
            let bytes = match s.name.as_str() {
                "p.g_idx" => i32_to_le_bytes(g_idx),
                "p.qweight" => i32_to_le_bytes(&qweight),
                "p.qzeros" => i32_to_le_bytes(&qzeros),
                _ => scales.clone(),
            };
            w.write_all(&bytes)?;
            Ok(())
        })
        .unwrap();
        Checkpoint::open(dir).unwrap()
    }

    #[test]
    fn g_idx_and_qzeros_conventions_are_enforced() {
        let trivial: Vec<i32> = (0..256).map(|k| k / 128).collect();
        let v1 =
            info(json!({"bits": 4, "group_size": 128, "sym": true, "desc_act": false})).unwrap();
        let d = tempfile::tempdir().unwrap();
        let ck = write_module(d.path(), &trivial, 0x7777_7777);
        let m = validate_quantized_modules(&ck, &v1, None).unwrap();
        assert_eq!(
            (m[0].n, m[0].k, m[0].groups, m[0].act_order),
            (64, 256, 2, false)
        );
        let expected = vec![("p.weight".to_string(), vec![64, 256])];
        validate_quantized(&ck, &v1, &expected).unwrap();
        let e = validate_quantized(&ck, &v1, &[("p.weight".to_string(), vec![64, 128])])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("p.qweight in") && e.contains("[N, K] = [64, 128]"),
            "{e}"
        );

        // v2 reading the same file: wrong convention.
        let mut v2j = v1.raw.clone();
        v2j["checkpoint_format"] = json!("gptq_v2");
        let v2 = info(v2j).unwrap();
        let e = validate_quantized(&ck, &v2, &expected)
            .unwrap_err()
            .to_string();
        assert!(e.contains("p.qzeros in") && e.contains("0x88888888"), "{e}");

        // A permuted g_idx needs desc_act.
        let mut perm = trivial.clone();
        perm.swap(0, 200);
        let d2 = tempfile::tempdir().unwrap();
        let ck2 = write_module(d2.path(), &perm, 0x7777_7777);
        let e = validate_quantized(&ck2, &v1, &expected)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("g_idx[0] = 1") && e.contains("desc_act is false"),
            "{e}"
        );
        let mut actj = v1.raw.clone();
        actj["desc_act"] = json!(true);
        let act = info(actj).unwrap();
        let m = validate_quantized_modules(&ck2, &act, Some(&expected)).unwrap();
        assert!(m[0].act_order);
        // Unequal groups are refused under act-order.
        let mut bad = trivial.clone();
        bad[0] = 1;
        let d3 = tempfile::tempdir().unwrap();
        let ck3 = write_module(d3.path(), &bad, 0x7777_7777);
        let e = validate_quantized(&ck3, &act, &expected)
            .unwrap_err()
            .to_string();
        assert!(e.contains("group 0 is used by 127 rows"), "{e}");

        // Unexpected and missing tensors.
        let e = validate_quantized(&ck, &v1, &[]).unwrap_err().to_string();
        assert!(e.contains("unexpected tensor p.g_idx"), "{e}");
        let mut more = expected.clone();
        more.push(("norm.weight".into(), vec![64]));
        let e = validate_quantized(&ck, &v1, &more).unwrap_err().to_string();
        assert!(e.contains("norm.weight") && e.contains("missing"), "{e}");
        // A skip rule that covers a quantized module.
        let mut skipj = v1.raw.clone();
        skipj["dynamic"] = json!({"-:p$": {}});
        let e = validate_quantized(&ck, &info(skipj).unwrap(), &expected)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("-:p$") && e.contains("keeps module p unquantized"),
            "{e}"
        );
    }

    #[test]
    fn gptq_dequant_is_transposed_scale_times_code_minus_zero() {
        let trivial: Vec<i32> = (0..256).map(|k| k / 128).collect();
        let d = tempfile::tempdir().unwrap();
        let ck = write_module(d.path(), &trivial, 0x7777_7777);
        let i =
            info(json!({"bits": 4, "group_size": 128, "sym": true, "desc_act": false})).unwrap();
        let (w, n, k) = dequantize_module(&ck, &i, "p").unwrap();
        assert_eq!((n, k), (64, 256));
        for (row, col) in [(0usize, 0usize), (5, 130), (63, 255), (17, 127)] {
            let code = ((col * n + row) * 7 % 16) as i32;
            let grp = col / 128;
            let s = half::f16::from_f32(0.01 * (1 + (grp * n + row) % 5) as f32).to_f32();
            assert_eq!(w[row * k + col], s * (code - 8) as f32, "W[{row}][{col}]");
        }
    }
}
