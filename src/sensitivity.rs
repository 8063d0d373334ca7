//! `sensitivity`: which quantized units of a checkpoint hurt, and what restoring each buys per
//! byte (docs/usage.md, Sensitivity). For every unit (per layer the attention Linears and the
//! MLP Linears, or per engine module) the end-to-end mean KL and perplexity change when that
//! unit alone goes back to 16 bits (and, with `--alone`, when it alone is quantized), measured
//! with the `eval-ppl` protocol on the same windows; then a plan for a size budget or a KL
//! target, as GPTQModel `dynamic` rules that `quantize --plan` takes.
//!
//! All variants run layer by layer in one pass, one layer's weights resident: a variant's hidden
//! states are the quantized model's (or the reference's) until the layer of its unit, where it
//! branches off and runs on from there. The cost is about (layers / 2) evaluations.

use crate::checkpoint::guard::OutputFile;
use crate::checkpoint::Checkpoint;
use crate::eval::score::{score_batch, PositionSums};
use crate::eval::{make_windows, LoadedModel, PplOptions};
use crate::format::quantized::{engine_name, exact_pattern};
use crate::model::{AnyLayer, AnyModel, LinearGroup};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Instant;

/// The report `quantize` writes into its output, with the hashes of the source it read.
pub const QUANTIZE_REPORT: &str = "quantize_report.json";

/// How finely the checkpoint is cut into units (`--granularity`): per layer the attention
/// Linears and the MLP Linears (`Block`), or per module the engines load: `qkv_proj`, `o_proj`,
/// the attention gate, `gate_up_proj`, `down_proj` (`Module`). (The variants carry no doc
/// comments: `--granularity`'s help describes them.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Granularity {
    Block,
    Module,
}

/// A size budget for the plan.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Budget {
    /// Extra bytes.
    Bytes(u64),
    /// Extra size as a percentage of the quantized checkpoint's tensors.
    Percent(f64),
}

#[derive(Clone, Debug)]
pub struct SensitivityOptions {
    pub eval: PplOptions,
    pub granularity: Granularity,
    /// Also score each unit quantized alone (the rest in 16 bits).
    pub alone: bool,
    /// What a planned unit becomes: 8 (bits) or 16 (kept unquantized).
    pub upgrade_bits: u8,
    pub budget: Option<Budget>,
    pub kl_target: Option<f64>,
}

/// Scores of one variant against the reference.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Score {
    pub mean_kl: f64,
    pub ppl: f64,
    pub delta_ppl: f64,
    pub top1_agreement: f64,
}

/// One unit and what it costs.
#[derive(Clone, Debug, Serialize)]
pub struct Unit {
    /// `model.layers.3.mlp`, or the engine module (`model.layers.3.self_attn.qkv_proj`).
    pub name: String,
    pub layer: usize,
    /// Its quantized Linears.
    pub modules: Vec<String>,
    pub params: u64,
    /// Bytes as stored in the quantized checkpoint.
    pub bytes: u64,
    /// Bytes at 8 bits (same group size) and in 16 bits.
    pub bytes_8bit: u64,
    pub bytes_16bit: u64,
    /// The scores with this unit restored to 16 bits (the rest quantized).
    pub restored: Score,
    /// The mean-KL reduction that restoring buys: the quantized model's mean KL minus
    /// `restored.mean_kl`.
    pub kl_gain: f64,
    /// With `--alone`: the scores with only this unit quantized.
    pub alone: Option<Score>,
}

/// The suggested plan.
#[derive(Clone, Debug, Serialize)]
pub struct PlanSuggestion {
    /// What the planned units become: 8 (bits) or 16 (unquantized).
    pub upgrade_bits: u8,
    pub budget_bytes: Option<u64>,
    pub kl_target: Option<f64>,
    /// Unit names, in the order they were chosen.
    pub units: Vec<String>,
    pub extra_bytes: u64,
    /// `extra_bytes` against the quantized checkpoint's tensors and against its quantized
    /// Linears alone, in percent.
    pub extra_percent_of_checkpoint: f64,
    pub extra_percent_of_quantized_linears: f64,
    /// The quantized model's mean KL minus the chosen units' gains (the gains measured one unit
    /// at a time in 16 bits: an estimate, to be checked with `eval-ppl --compare`).
    pub predicted_mean_kl: f64,
    /// The rules for `quantize --plan`.
    pub dynamic: Map<String, Value>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SensitivityReport {
    pub reference: String,
    pub quantized: String,
    pub granularity: Granularity,
    pub windows: usize,
    pub seqlen: usize,
    pub tokens: usize,
    pub reference_ppl: f64,
    /// The quantized checkpoint as it is.
    pub quantized_score: Score,
    /// Bytes of all tensors of the quantized checkpoint, and of its quantized Linears.
    pub checkpoint_bytes: u64,
    pub quantized_linear_bytes: u64,
    /// Ranked: largest `kl_gain` first (ties in model order).
    pub units: Vec<Unit>,
    pub plan: Option<PlanSuggestion>,
    pub seconds: f64,
}

/// A hidden-state stream: the reference, the quantized model, or a unit's variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    Reference,
    Quantized,
    /// Unit `u` in 16 bits, the rest quantized.
    Restored(usize),
    /// Unit `u` quantized, the rest in 16 bits.
    Alone(usize),
}

/// Every variant's hidden states, per batch of windows.
type Streams = BTreeMap<Variant, Vec<Tensor>>;

pub fn sensitivity(
    reference: &Path,
    quantized: &Path,
    text: &str,
    opts: &SensitivityOptions,
) -> Result<SensitivityReport> {
    let t0 = Instant::now();
    let (dtype, device) = (opts.eval.dtype, &opts.eval.device);
    let rlm = open_reference(reference, opts)?;
    let qlm = LoadedModel::open_with(quantized, opts.eval.sparse_attention)?;
    let qmods = quantized_modules(&qlm, quantized)?;
    check_same_model(reference, &rlm, quantized, &qlm)?;
    let cfg = &rlm.cfg;
    let units = build_units(&rlm, qmods, opts.granularity);
    if units.is_empty() {
        bail!(
            "--quantized {} has no quantized Linears in its decoder layers",
            quantized.display()
        );
    }
    let windows = make_windows(&rlm.tokenizer, text, cfg, &opts.eval)?;
    let model = rlm.model(dtype, device)?;
    model.check_length(opts.eval.seqlen)?;

    let streams = run_variants(&rlm, &qlm, &model, &units, &windows, opts)?;
    let (rsums, sums) = score_variants(&model, &streams, &windows, opts.eval.batch)?;
    let (ref_nll, _, _, count) = rsums.range(0, usize::MAX);
    let count = count as usize;
    let ref_ppl = (ref_nll / count as f64).exp();
    if !ref_ppl.is_finite() {
        bail!(
            "--model {} gives a non-finite perplexity on this text",
            reference.display()
        );
    }
    let base = variant_score(&sums, Variant::Quantized, count, ref_ppl);
    let ranked = rank_units(units, &sums, &base, count, ref_ppl, opts.alone);
    let checkpoint_bytes: u64 = qlm
        .ck
        .names()
        .filter_map(|n| qlm.ck.get(n))
        .map(|e| e.nbytes() as u64)
        .sum();
    let quantized_linear_bytes: u64 = qmods.values().map(|m| m.bytes).sum();
    let plan = suggest_plan(
        &ranked,
        base.mean_kl,
        checkpoint_bytes,
        quantized_linear_bytes,
        opts,
    );
    Ok(SensitivityReport {
        reference: reference.display().to_string(),
        quantized: quantized.display().to_string(),
        granularity: opts.granularity,
        windows: windows.len(),
        seqlen: opts.eval.seqlen,
        tokens: count,
        reference_ppl: ref_ppl,
        quantized_score: base,
        checkpoint_bytes,
        quantized_linear_bytes,
        units: ranked,
        plan,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Opens `--model`, refused when it is itself quantized.
fn open_reference(reference: &Path, opts: &SensitivityOptions) -> Result<LoadedModel> {
    let rlm = LoadedModel::open_with(reference, opts.eval.sparse_attention)?;
    if rlm.quant.is_some() {
        bail!(
            "--model {} is quantized: sensitivity compares a quantized checkpoint (--quantized) \
             against its 16-bit source (--model)",
            reference.display()
        );
    }
    Ok(rlm)
}

/// The quantized modules of `--quantized`, refused when it holds no quantization settings.
fn quantized_modules<'a>(
    qlm: &'a LoadedModel,
    quantized: &Path,
) -> Result<&'a BTreeMap<String, crate::format::quantized::QuantModule>> {
    let Some((_, qmods)) = &qlm.quant else {
        bail!(
            "--quantized {} holds no quantization settings: give the GPTQ or Marlin checkpoint \
             that quantize wrote",
            quantized.display()
        );
    };
    Ok(qmods)
}

/// Refuses a `--quantized` whose config gives other tensors than `--model`'s, or whose report
/// says it was made from another model.
fn check_same_model(
    reference: &Path,
    rlm: &LoadedModel,
    quantized: &Path,
    qlm: &LoadedModel,
) -> Result<()> {
    if qlm.cfg.expected_tensors() != rlm.cfg.expected_tensors() {
        bail!(
            "--quantized {} is not a quantization of --model {}: their configs give different \
             tensors",
            quantized.display(),
            reference.display()
        );
    }
    check_made_from(reference, &rlm.ck, quantized)
}

/// Runs every variant through the decoder layers, layer by layer (one progress bar), and returns
/// their states as they leave the last layer.
fn run_variants(
    rlm: &LoadedModel,
    qlm: &LoadedModel,
    model: &AnyModel,
    units: &[Unit],
    windows: &[Vec<u32>],
    opts: &SensitivityOptions,
) -> Result<Streams> {
    let (dtype, device) = (opts.eval.dtype, &opts.eval.device);
    let cfg = &rlm.cfg;
    // Every variant's states, per batch of windows, as they leave the last layer done.
    let mut streams: Streams = BTreeMap::new();
    let embedded = embed_windows(model, windows, opts)?;
    streams.insert(Variant::Reference, embedded.clone());
    streams.insert(Variant::Quantized, embedded);
    let pb = crate::progress::bar(cfg.num_hidden_layers() as u64, "sensitivity");
    for i in 0..cfg.num_hidden_layers() {
        let full = rlm.layer(i, dtype, device)?;
        let quant = qlm.layer(i, dtype, device)?;
        // Variants of this layer's units branch off before the layer runs.
        for u in (0..units.len()).filter(|&u| units[u].layer == i) {
            streams.insert(Variant::Restored(u), streams[&Variant::Quantized].clone());
            if opts.alone {
                streams.insert(Variant::Alone(u), streams[&Variant::Reference].clone());
            }
        }
        for (v, states) in streams.iter_mut() {
            let hybrid;
            let layer: &AnyLayer = match *v {
                Variant::Reference => &full,
                Variant::Quantized => &quant,
                Variant::Restored(u) if units[u].layer == i => {
                    hybrid = mixed_layer(rlm, qlm, i, &units[u].modules, true, dtype, device)?;
                    &hybrid
                }
                Variant::Alone(u) if units[u].layer == i => {
                    hybrid = mixed_layer(rlm, qlm, i, &units[u].modules, false, dtype, device)?;
                    &hybrid
                }
                Variant::Restored(_) => &quant,
                Variant::Alone(_) => &full,
            };
            for h in states.iter_mut() {
                *h = layer.forward(h, &mut |_, _| Ok(()))?;
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(streams)
}

/// The embedded windows, one tensor per batch of `--batch` windows.
fn embed_windows(
    model: &AnyModel,
    windows: &[Vec<u32>],
    opts: &SensitivityOptions,
) -> Result<Vec<Tensor>> {
    let mut embedded = vec![];
    for r in crate::calib::batch_ranges(windows, opts.eval.batch) {
        let b = &windows[r];
        let flat: Vec<u32> = b.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (b.len(), b[0].len()), &opts.eval.device)?;
        embedded.push(model.embed(&ids)?);
    }
    Ok(embedded)
}

/// Scores every stream: the reference's position sums, and every other variant's against it.
fn score_variants(
    model: &AnyModel,
    streams: &Streams,
    windows: &[Vec<u32>],
    batch: usize,
) -> Result<(PositionSums, BTreeMap<Variant, PositionSums>)> {
    // Scores: per batch the reference's, then every variant's against it; the head runs a few
    // thousand positions at a time (eval's protocol).
    let batches: Vec<&[Vec<u32>]> = crate::calib::batch_ranges(windows, batch)
        .into_iter()
        .map(|r| &windows[r])
        .collect();
    let mut sums: BTreeMap<Variant, PositionSums> = BTreeMap::new();
    let mut rsums = PositionSums::default();
    for (bi, ws) in batches.iter().enumerate() {
        let rh = &streams[&Variant::Reference][bi];
        score_batch(model, rh, None, ws, &mut rsums)?;
        for (v, states) in streams {
            if *v == Variant::Reference {
                continue;
            }
            score_batch(
                model,
                &states[bi],
                Some((model, rh)),
                ws,
                sums.entry(*v).or_default(),
            )?;
        }
    }
    Ok((rsums, sums))
}

/// The score of variant `v` over `count` positions, against the reference's perplexity.
fn variant_score(
    sums: &BTreeMap<Variant, PositionSums>,
    v: Variant,
    count: usize,
    ref_ppl: f64,
) -> Score {
    let (nll, kl, agree, _) = sums[&v].range(0, usize::MAX);
    let ppl = (nll / count as f64).exp();
    Score {
        mean_kl: kl / count as f64,
        ppl,
        delta_ppl: ppl - ref_ppl,
        top1_agreement: agree as f64 / count as f64,
    }
}

/// The units with their scores, ranked by how much restoring each lowers the mean KL from
/// `base` (stable: equal gains keep model order).
fn rank_units(
    units: Vec<Unit>,
    sums: &BTreeMap<Variant, PositionSums>,
    base: &Score,
    count: usize,
    ref_ppl: f64,
    alone: bool,
) -> Vec<Unit> {
    let score = |v: Variant| variant_score(sums, v, count, ref_ppl);
    let mut ranked: Vec<Unit> = units
        .into_iter()
        .enumerate()
        .map(|(u, spec)| {
            let restored = score(Variant::Restored(u));
            Unit {
                kl_gain: base.mean_kl - restored.mean_kl,
                restored,
                alone: alone.then(|| score(Variant::Alone(u))),
                ..spec
            }
        })
        .collect();
    // Stable: equal gains keep model order.
    ranked.sort_by(|a, b| b.kl_gain.total_cmp(&a.kl_gain));
    ranked
}

/// Layer `i` with the Linears of `modules` taken from the reference (`restore`) or from the
/// quantized checkpoint (`!restore`), everything else from the other one.
fn mixed_layer(
    rlm: &LoadedModel,
    qlm: &LoadedModel,
    i: usize,
    modules: &[String],
    restore: bool,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<AnyLayer> {
    AnyLayer::from_tensors(&rlm.cfg, i, &|name| {
        let prefix = name
            .strip_suffix(".weight")
            .or_else(|| name.strip_suffix(".bias"))
            .unwrap_or(name);
        let in_unit = modules.iter().any(|m| m == prefix);
        if in_unit == restore {
            rlm.tensor(name, dtype, device)
        } else {
            qlm.tensor(name, dtype, device)
        }
    })
    .with_context(|| format!("building the mixed layer {i}"))
}

/// The units of the quantized checkpoint, in model order, without their scores yet.
fn build_units(
    rlm: &LoadedModel,
    qmods: &BTreeMap<String, crate::format::quantized::QuantModule>,
    granularity: Granularity,
) -> Vec<Unit> {
    let cfg = &rlm.cfg;
    let mut units: Vec<Unit> = vec![];
    for i in 0..cfg.num_hidden_layers() {
        let mut layer_units: Vec<(String, Vec<String>)> = vec![];
        for l in cfg.layer_linears(i) {
            let full = format!("model.layers.{i}.{}", l.name);
            if !qmods.contains_key(&full) {
                continue;
            }
            let name = match granularity {
                Granularity::Block => {
                    let block = match l.group {
                        LinearGroup::Qkv | LinearGroup::O => "attention",
                        LinearGroup::GateUp | LinearGroup::Down => "mlp",
                    };
                    let parent = l.name.split('.').next().unwrap_or(block);
                    format!("model.layers.{i}.{parent}")
                }
                Granularity::Module => engine_name(&full),
            };
            match layer_units.iter_mut().find(|(n, _)| *n == name) {
                Some((_, m)) => m.push(full),
                None => layer_units.push((name, vec![full])),
            }
        }
        for (name, modules) in layer_units {
            let (mut params, mut bytes, mut b8, mut b16) = (0u64, 0u64, 0u64, 0u64);
            for m in &modules {
                let q = &qmods[m];
                let (n, k) = (q.n as u64, q.k as u64);
                let groups = q.groups as u64;
                params += n * k;
                bytes += q.bytes;
                // 8-bit GPTQ: qweight N·K bytes, qzeros groups·N bytes, fp16 scales, g_idx.
                b8 += n * k + groups * n + 2 * groups * n + 4 * k;
                b16 += 2 * n * k;
            }
            units.push(Unit {
                name,
                layer: i,
                modules,
                params,
                bytes,
                bytes_8bit: b8,
                bytes_16bit: b16,
                restored: Score {
                    mean_kl: 0.0,
                    ppl: 0.0,
                    delta_ppl: 0.0,
                    top1_agreement: 0.0,
                },
                kl_gain: 0.0,
                alone: None,
            });
        }
    }
    units
}

/// Greedy by KL gain per extra byte: units that lower the mean KL when restored, cheapest gain
/// first, while the budget holds (a unit that does not fit is passed over for cheaper ones)
/// and until the predicted mean KL reaches the target.
fn suggest_plan(
    ranked: &[Unit],
    base_kl: f64,
    checkpoint_bytes: u64,
    linear_bytes: u64,
    opts: &SensitivityOptions,
) -> Option<PlanSuggestion> {
    if opts.budget.is_none() && opts.kl_target.is_none() {
        return None;
    }
    let budget = opts.budget.map(|b| match b {
        Budget::Bytes(x) => x,
        Budget::Percent(p) => (checkpoint_bytes as f64 * p / 100.0) as u64,
    });
    let extra = |u: &Unit| -> u64 {
        let to = if opts.upgrade_bits >= 16 {
            u.bytes_16bit
        } else {
            u.bytes_8bit
        };
        to.saturating_sub(u.bytes)
    };
    let mut candidates: Vec<&Unit> = ranked
        .iter()
        .filter(|u| u.kl_gain > 0.0 && extra(u) > 0)
        .collect();
    candidates.sort_by(|a, b| {
        let (ra, rb) = (a.kl_gain / extra(a) as f64, b.kl_gain / extra(b) as f64);
        rb.total_cmp(&ra)
    });
    let (mut used, mut predicted) = (0u64, base_kl);
    let mut chosen: Vec<&Unit> = vec![];
    for u in candidates {
        if opts.kl_target.is_some_and(|t| predicted <= t) {
            break;
        }
        if budget.is_some_and(|b| used + extra(u) > b) {
            continue;
        }
        used += extra(u);
        predicted -= u.kl_gain;
        chosen.push(u);
    }
    let mut dynamic = Map::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for u in &chosen {
        for m in &u.modules {
            let eng = engine_name(m);
            if !seen.insert(eng.clone()) {
                continue;
            }
            let members: Vec<&str> = u
                .modules
                .iter()
                .filter(|x| engine_name(x) == eng)
                .map(String::as_str)
                .collect();
            let pattern = exact_pattern(&eng, &members);
            if opts.upgrade_bits >= 16 {
                dynamic.insert(format!("-:{pattern}"), serde_json::json!({}));
            } else {
                dynamic.insert(
                    format!("+:{pattern}"),
                    serde_json::json!({"bits": opts.upgrade_bits}),
                );
            }
        }
    }
    Some(PlanSuggestion {
        upgrade_bits: opts.upgrade_bits,
        budget_bytes: budget,
        kl_target: opts.kl_target,
        units: chosen.iter().map(|u| u.name.clone()).collect(),
        extra_bytes: used,
        extra_percent_of_checkpoint: 100.0 * used as f64 / checkpoint_bytes.max(1) as f64,
        extra_percent_of_quantized_linears: 100.0 * used as f64 / linear_bytes.max(1) as f64,
        predicted_mean_kl: predicted.max(0.0),
        dynamic,
    })
}

/// The plan file `quantize --plan` reads: the `dynamic` rules, with what they were made from.
pub fn plan_file(r: &SensitivityReport) -> Option<Value> {
    let p = r.plan.as_ref()?;
    Some(serde_json::json!({
        "format": "soar-gptq-plan",
        "version": 1,
        "made_by": format!("soar-gptq {} sensitivity", env!("CARGO_PKG_VERSION")),
        "reference": r.reference,
        "quantized": r.quantized,
        "note": "quantize with the settings of the quantized checkpoint plus --plan this file",
        "upgrade_bits": p.upgrade_bits,
        "units": p.units,
        "extra_bytes": p.extra_bytes,
        "quantized_mean_kl": r.quantized_score.mean_kl,
        "predicted_mean_kl": p.predicted_mean_kl,
        "dynamic": p.dynamic,
    }))
}

impl SensitivityReport {
    pub fn print_text(&self) {
        crate::outln!(
            "scored {} tokens in {} windows of {} (protocol: docs/eval.md); reference ppl {:.4}",
            self.tokens,
            self.windows,
            self.seqlen,
            self.reference_ppl
        );
        let s = &self.quantized_score;
        crate::outln!(
            "quantized as it is: mean KL {:.5}, ppl {:.4} ({:+.4}), top-1 {:.2}%; {:.2} MB \
             ({:.2} MB of quantized Linears)",
            s.mean_kl,
            s.ppl,
            s.delta_ppl,
            100.0 * s.top1_agreement,
            self.checkpoint_bytes as f64 / 1e6,
            self.quantized_linear_bytes as f64 / 1e6
        );
        crate::outln!(
            "\n{:>4}  {:<44} {:>10} {:>9} {:>9} {:>9} {:>10} {:>10}",
            "rank",
            "unit (restored to 16 bits)",
            "KL gain",
            "KL",
            "Δppl",
            "top-1",
            "MB now",
            "+MB @8bit"
        );
        for (r, u) in self.units.iter().enumerate() {
            crate::outln!(
                "{:>4}  {:<44} {:>10.5} {:>9.5} {:>+9.4} {:>8.2}% {:>10.3} {:>10.3}",
                r + 1,
                u.name,
                u.kl_gain,
                u.restored.mean_kl,
                u.restored.delta_ppl,
                100.0 * u.restored.top1_agreement,
                u.bytes as f64 / 1e6,
                u.bytes_8bit.saturating_sub(u.bytes) as f64 / 1e6
            );
            if let Some(a) = &u.alone {
                crate::outln!(
                    "{:>4}  {:<44} {:>10} {:>9.5} {:>+9.4} {:>8.2}%",
                    "",
                    "  quantized alone",
                    "",
                    a.mean_kl,
                    a.delta_ppl,
                    100.0 * a.top1_agreement
                );
            }
        }
        if let Some(p) = &self.plan {
            crate::outln!(
                "\nplan: {} unit(s) to {}, +{:.3} MB ({:.1}% of the checkpoint, {:.1}% of its \
                 quantized Linears); predicted mean KL {:.5} (from {:.5})",
                p.units.len(),
                if p.upgrade_bits >= 16 {
                    "16 bits".to_string()
                } else {
                    format!("{} bits", p.upgrade_bits)
                },
                p.extra_bytes as f64 / 1e6,
                p.extra_percent_of_checkpoint,
                p.extra_percent_of_quantized_linears,
                p.predicted_mean_kl,
                self.quantized_score.mean_kl
            );
            for u in &p.units {
                crate::outln!("  {u}");
            }
        }
        crate::outln!("time {:.1} s", self.seconds);
    }
}

/// Writes the plan file through the output guard (`out` was checked before the scoring pass).
pub fn write_plan(out: &OutputFile, r: &SensitivityReport) -> Result<()> {
    let Some(v) = plan_file(r) else {
        bail!("--plan-out needs a plan: give --budget-gb, --budget-pct or --kl-target");
    };
    let text = serde_json::to_string_pretty(&v)? + "\n";
    out.write(|tmp| Ok(std::fs::write(tmp, &text)?))
        .with_context(|| format!("writing --plan-out {}", out.path().display()))
}

/// Why a plan chose no unit, for the message that refuses to write it.
pub fn empty_plan_reason(r: &SensitivityReport, opts: &SensitivityOptions) -> String {
    let base = r.quantized_score.mean_kl;
    if let Some(t) = opts.kl_target.filter(|&t| base <= t) {
        return format!(
            "the quantized checkpoint's mean KL {base:.5} already meets --kl-target {t}"
        );
    }
    let extra = |u: &Unit| {
        let to = if opts.upgrade_bits >= 16 {
            u.bytes_16bit
        } else {
            u.bytes_8bit
        };
        to.saturating_sub(u.bytes)
    };
    let cheapest = r
        .units
        .iter()
        .filter(|u| u.kl_gain > 0.0 && extra(u) > 0)
        .map(extra)
        .min();
    match (cheapest, r.plan.as_ref().and_then(|p| p.budget_bytes)) {
        (None, _) => "no unit lowers the mean KL when restored".to_string(),
        (Some(c), Some(b)) => format!(
            "no unit fits the budget of {b} extra bytes (the cheapest that helps needs {c}); \
             raise --budget-gb or --budget-pct"
        ),
        (Some(_), None) => "no unit was chosen".to_string(),
    }
}

/// Whether `quantized` was made from `reference`, as far as its `quantize_report.json` tells:
/// the report records the SHA-256 of every source shard (`hashes.source_sha256`) and of the
/// source's config.json. Other weights are refused, naming both folders; a config.json that
/// differs while the weights match is a note. A folder without that record (made by another
/// tool, or repacked by `pack-marlin`, which keeps no report) cannot be checked: a note says so.
pub fn check_made_from(reference: &Path, ck: &Checkpoint, quantized: &Path) -> Result<()> {
    let report = quantized.join(QUANTIZE_REPORT);
    let unchecked = |why: &str| {
        eprintln!(
            "note: --quantized {} {why}, so whether it was made from --model {} cannot be \
             checked; make sure it was",
            quantized.display(),
            reference.display()
        );
    };
    if std::fs::symlink_metadata(&report).is_err() {
        unchecked(&format!(
            "has no {QUANTIZE_REPORT} (it was not written by soar-gptq quantize, or was repacked)"
        ));
        return Ok(());
    }
    crate::checkpoint::guard::regular_file(&report, "--quantized's report")?;
    let text = std::fs::read_to_string(&report)
        .with_context(|| format!("cannot read {}", report.display()))?;
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let recorded: Option<BTreeMap<String, String>> = v["hashes"]["source_sha256"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, h)| Some((k.clone(), h.as_str()?.to_string())))
                .collect()
        })
        .filter(|m: &BTreeMap<String, String>| !m.is_empty());
    let Some(recorded) = recorded else {
        unchecked(&format!(
            "has a {QUANTIZE_REPORT} without the source's hashes"
        ));
        return Ok(());
    };
    let source = v["model"].as_str().unwrap_or("its source");
    let now = crate::checkpoint::manifest::shard_sha256(ck)?;
    if now != recorded {
        let short = |h: &str| h.chars().take(12).collect::<String>();
        let diff = recorded
            .iter()
            .find_map(|(f, h)| match now.get(f) {
                None => Some(format!("{f} is recorded but --model has no such file")),
                Some(n) if n != h => Some(format!(
                    "{f} is recorded as {}… but --model's is {}…",
                    short(h),
                    short(n)
                )),
                Some(_) => None,
            })
            .or_else(|| {
                now.keys()
                    .find(|f| !recorded.contains_key(*f))
                    .map(|f| format!("--model has {f}, which the record does not list"))
            })
            .unwrap_or_default();
        bail!(
            "--quantized {} was not made from --model {}: its {QUANTIZE_REPORT} records the \
             weights of its source ({source}), and --model's differ ({diff}); give the \
             checkpoint quantized from --model, or the --model it was quantized from",
            quantized.display(),
            reference.display()
        );
    }
    if let Some(c) = v["hashes"]["config_sha256"].as_str() {
        let cfg = reference.join("config.json");
        if crate::checkpoint::manifest::sha256_file(&cfg).is_ok_and(|h| h != c) {
            eprintln!(
                "note: --model {}'s config.json differs from the one --quantized {} was made \
                 from (the weights are the same)",
                reference.display(),
                quantized.display()
            );
        }
    }
    Ok(())
}
