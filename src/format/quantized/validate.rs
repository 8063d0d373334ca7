//! Validation of quantized modules against the settings and, when known, the BF16 layout a
//! config implies: shapes, dtypes, `g_idx` against `desc_act`, the `qzeros` convention of
//! symmetric checkpoints, Marlin shapes and sort indices. Every message names the tensor and
//! the file. The result, [`QuantModule`], is what decoding takes.

use super::settings::{natural_cmp, ModuleQuant, QuantInfo};
use super::{GPTQ_SUFFIXES, SORT_INDICES_SUFFIX};
use crate::checkpoint::{Checkpoint, Dtype};
use crate::format::marlin::check_marlin_shape;
use crate::scheme::{GroupSize, QuantFormat};
use anyhow::{anyhow, bail, ensure, Context, Result};
use serde::Serialize;
use std::collections::HashSet;
use std::path::Path;

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
    pub group_size: GroupSize,
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
    /// Rows of one group (`K` for one group per row).
    pub fn group_len(&self) -> usize {
        self.group_size.len(self.k)
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
    let [qw, qz, sc, gi] = [&names[0], &names[1], &names[2], &names[3]].map(String::as_str);
    check_gptq_dtypes(ck, prefix, what, [qw, qz, sc, gi])?;
    let bits = m.bits;
    let (k, n, vals, words) = gptq_dims(ck, qw, prefix, bits, expect)?;
    let g = m.group_size.len(k);
    let groups = m.group_size.count(k);
    check_gptq_shapes(ck, [qw, qz, sc, gi], k, n, g, groups, bits, (vals, words))?;
    let g_idx = ck.i32_data(gi)?;
    let act_order = check_g_idx(ck, gi, &g_idx, k, g, groups, m.desc_act, &info.source)?;
    if m.sym {
        check_symmetric_qzeros(ck, info, qz, bits, vals, words)?;
    }
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
        bytes: total_bytes(ck, &names),
        tensors: names,
    })
}

/// Every GPTQ tensor is present and `qweight`, `qzeros`, `scales` and `g_idx` have their dtypes.
fn check_gptq_dtypes(ck: &Checkpoint, prefix: &str, what: &str, names: [&str; 4]) -> Result<()> {
    for s in &GPTQ_SUFFIXES[1..] {
        need(ck, prefix, s, "qweight", what)?;
    }
    let [qw, qz, sc, gi] = names;
    check_dtype(ck, qw, &[Dtype::I32], "I32 (packed codes)")?;
    check_dtype(ck, qz, &[Dtype::I32], "I32 (packed zero points)")?;
    check_dtype(ck, gi, &[Dtype::I32], "I32 (group of each input row)")?;
    check_dtype(ck, sc, &FLOATS, "F16 (or BF16/F32) scales")?;
    Ok(())
}

/// `(K, N, vals, words)` from `qweight`'s shape (`words` I32 rows pack `vals` input rows), checked
/// against the BF16 shape `expect` when known.
fn gptq_dims(
    ck: &Checkpoint,
    qw: &str,
    prefix: &str,
    bits: u8,
    expect: Option<(usize, usize)>,
) -> Result<(usize, usize, usize, usize)> {
    let (vals, words) = match crate::format::pack::block_shape(bits) {
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
    Ok((k, n, vals, words))
}

/// The shapes of `qzeros`, `scales` and `g_idx` for K inputs, N outputs and `groups` groups of
/// `g` columns.
#[allow(clippy::too_many_arguments)]
fn check_gptq_shapes(
    ck: &Checkpoint,
    names: [&str; 4],
    k: usize,
    n: usize,
    g: usize,
    groups: usize,
    bits: u8,
    (vals, words): (usize, usize),
) -> Result<()> {
    let [qw, qz, sc, gi] = names;
    ensure!(
        n.is_multiple_of(vals),
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
    Ok(())
}

/// A symmetric checkpoint's `qzeros` hold the midpoint zero everywhere, in the convention of its
/// `checkpoint_format`.
fn check_symmetric_qzeros(
    ck: &Checkpoint,
    info: &QuantInfo,
    qz: &str,
    bits: u8,
    vals: usize,
    words: usize,
) -> Result<()> {
    let zero = 1u32 << (bits - 1);
    let v1 = info.format.zeros_minus_one();
    // The words of one packing block of `vals` identical zeros; the stream repeats them.
    let pattern =
        crate::format::pack::pack_qzeros(&vec![zero as u8; vals], 1, vals, bits, info.format)?;
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
    Ok(())
}

/// The bytes of the tensors `names` in the checkpoint.
fn total_bytes(ck: &Checkpoint, names: &[String]) -> u64 {
    names
        .iter()
        .map(|nm| ck.get(nm).unwrap().nbytes() as u64)
        .sum()
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
    let (k, n) = marlin_dims(ck, info, prefix, &b, &m, expect)?;
    let groups = m.group_size.count(k);
    check_shape(
        ck,
        &s,
        &[groups, n],
        &format!("K={k} / group {} groups x N={n}", m.group_size),
    )?;
    let mut tensors = vec![b.clone(), s.clone()];
    let sorted = check_sort_indices(ck, info, prefix, &b, &si, &m, k)?;
    if sorted.is_some() {
        tensors.push(si);
    }
    let act_order = sorted.unwrap_or(false);
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
        bytes: total_bytes(ck, &tensors),
        tensors,
    })
}

/// `(K, N)` from the shape of Marlin's `B` (`[K/16, 2N]`), after checking that the settings are
/// symmetric 4-bit, against the BF16 shape `expect` when known and against Marlin's tiling.
fn marlin_dims(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
    b: &str,
    m: &ModuleQuant,
    expect: Option<(usize, usize)>,
) -> Result<(usize, usize)> {
    ensure!(
        m.bits == 4 && m.sym,
        "{}: Marlin holds symmetric 4-bit codes only, but the settings in {} give module {prefix} \
         bits = {}, sym = {}",
        at(ck, b),
        info.source.display(),
        m.bits,
        m.sym
    );
    let bshape = &ck.get(b).unwrap().shape;
    ensure!(
        bshape.len() == 2 && bshape[1].is_multiple_of(2),
        "{} has shape {bshape:?}, expected [K/16, 2N]",
        at(ck, b)
    );
    let (k, n) = (bshape[0] * 16, bshape[1] / 2);
    if let Some((en, ek)) = expect {
        ensure!(
            n == en && k == ek,
            "{} has shape {bshape:?}, which holds K = {k}, N = {n}, but the {}; expected B \
             [{}, {}]",
            at(ck, b),
            expected_weight_note(prefix, expect),
            ek / 16,
            2 * en
        );
    }
    check_marlin_shape(k, n, m.group_size, m.bits, m.sym)
        .with_context(|| format!("{} (K = {k}, N = {n})", at(ck, b)))?;
    Ok((k, n))
}

/// Checks the sort indices `si` when present: a permutation of K rows, permuted only under
/// `desc_act`; returns whether they permute the rows, `None` when absent (refused under
/// `desc_act`).
#[allow(clippy::too_many_arguments)]
fn check_sort_indices(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
    b: &str,
    si: &str,
    m: &ModuleQuant,
    k: usize,
) -> Result<Option<bool>> {
    if ck.contains(si) {
        check_dtype(ck, si, &[Dtype::I32], "I32 (row permutation)")?;
        check_shape(ck, si, &[k], &format!("one entry per input row, K={k}"))?;
        let sort = ck.i32_data(si)?;
        check_permutation(&sort, k).map_err(|e| anyhow!("{}: {e}", at(ck, si)))?;
        let act_order = sort.iter().enumerate().any(|(i, &r)| r as usize != i);
        ensure!(
            m.desc_act || !act_order,
            "{} permutes the rows, but desc_act is false in {}: set desc_act true, or the rows \
             are misplaced",
            at(ck, si),
            info.source.display()
        );
        Ok(Some(act_order))
    } else {
        ensure!(
            !m.desc_act,
            "Marlin module {prefix} has desc_act true but no {si} ({} holds rows pre-sorted by \
             group; without the sort indices the input columns cannot be matched)",
            at(ck, b)
        );
        Ok(None)
    }
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
            check_expected_tensors(ck, info, expected, &prefixes, &mut claimed, &mut modules)?
        }
        None => {
            for p in &prefixes {
                let m = check_quantized_module(ck, info, p, None)?;
                claimed.extend(m.tensors.iter().cloned());
                modules.push(m);
            }
        }
    }
    check_unclaimed(ck, info, &claimed, expected.is_some())?;
    Ok(modules)
}

/// Checks every tensor of the BF16 layout `expected`: present as a float tensor of its shape, or
/// a 2-D `*.weight` replaced by a quantized set (pushed to `modules`); the tensors it accounts
/// for go to `claimed`.
fn check_expected_tensors(
    ck: &Checkpoint,
    info: &QuantInfo,
    expected: &[(String, Vec<usize>)],
    prefixes: &[String],
    claimed: &mut HashSet<String>,
    modules: &mut Vec<QuantModule>,
) -> Result<()> {
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
    Ok(())
}

/// Refuses the tensors no module or expected tensor accounts for: any at all when the layout
/// was `expected`, else those that look like part of a quantized set.
fn check_unclaimed(
    ck: &Checkpoint,
    info: &QuantInfo,
    claimed: &HashSet<String>,
    expected: bool,
) -> Result<()> {
    let suffixes = quant_suffixes(info.format);
    let mut unclaimed: Vec<&String> = ck.names().filter(|n| !claimed.contains(*n)).collect();
    unclaimed.sort_by(|a, b| natural_cmp(a, b));
    for name in unclaimed {
        let stray = name
            .rsplit_once('.')
            .is_some_and(|(_, s)| suffixes.contains(&s));
        if expected {
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
    Ok(())
}

/// [`validate_quantized_modules`] against the BF16 layout `expected_bf16` (`(name, shape)`).
pub fn validate_quantized(
    ck: &Checkpoint,
    info: &QuantInfo,
    expected_bf16: &[(String, Vec<usize>)],
) -> Result<()> {
    validate_quantized_modules(ck, info, Some(expected_bf16)).map(|_| ())
}
