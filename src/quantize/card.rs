//! The model card (`README.md`) of a `quantize` output: where it came from, how it was made,
//! what it holds, how close it is to the source when `--verify` ran, and how to serve it. Built
//! from the report only (no timings), so identical runs write identical cards.

use super::{Method, ModuleRow, QuantizeReport, Settings};
use crate::calib::SeqLen;
use crate::eval::CompareReport;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

/// The module kind of a full name: `model.layers.3.self_attn.q_proj` → `self_attn.q_proj`.
fn kind(module: &str) -> String {
    let parts: Vec<&str> = module.split('.').collect();
    parts[parts.len().saturating_sub(2)..].join(".")
}

/// The card names neither the output folder nor the machine, so that the same inputs and flags
/// give the same card wherever the output is written.
pub fn model_card(r: &QuantizeReport, verify: Option<&CompareReport>) -> String {
    let mut c = String::new();
    heading(&mut c, r);
    serving(&mut c, r);
    if let Some(v) = verify {
        verification(&mut c, v);
    }
    settings(&mut c, r);
    calibration(&mut c, r);
    modules(&mut c, r);
    files(&mut c, r);
    c
}

/// How the card names the method.
fn method_label(m: Method) -> &'static str {
    match m {
        Method::Gptq => "GPTQ",
        Method::Gptaq => "GPTAQ (GPTQ on the asymmetric objective)",
        Method::Rtn => "round-to-nearest",
    }
}

/// The front matter (the hub's metadata), the title and what the checkpoint is.
fn heading(c: &mut String, r: &QuantizeReport) {
    let s = &r.settings.flags;
    let source_id = r
        .model
        .split_once('@')
        .map_or(r.model.as_str(), |(id, _)| id);
    let base = source_id
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|b| !b.is_empty())
        .unwrap_or("model");
    let hub_id = r
        .model
        .split_once('@')
        .map(|(id, _)| id.to_string())
        .filter(|id| !Path::new(id).exists());
    c.push_str("---\n");
    if let Some(id) = &hub_id {
        let _ = writeln!(c, "base_model: {id}");
    }
    let _ = writeln!(
        c,
        "tags:\n- gptq\n- {}-bit\n- w{}a16\n- soar-gptq\nquantized_by: {}\n---\n",
        s.bits, s.bits, r.tool
    );
    let _ = writeln!(
        c,
        "# {base} GPTQ W{}A16 (group size {})\n",
        s.bits, s.group_size
    );
    let _ = writeln!(
        c,
        "{} {}-bit weights (group size {}, {}, act-order {}) with 16-bit activations, \
         quantized from `{}` by {} for {}. Stored as GPTQ safetensors \
         (`qweight`/`qzeros`/`scales`/`g_idx`, `checkpoint_format: {}`), which the engines \
         repack to Marlin kernels at load.\n",
        method_label(s.method),
        s.bits,
        s.group_size,
        if s.sym { "symmetric" } else { "asymmetric" },
        s.act_order,
        r.model,
        r.tool,
        r.engine_check
            .as_ref()
            .map_or("no particular engine (--engine none)", |c| c.engine.label()),
        if s.sym { "gptq" } else { "gptq_v2" }
    );
}

/// `## Serving`: the engine's command, what its check noted, how the config was edited.
fn serving(c: &mut String, r: &QuantizeReport) {
    c.push_str("## Serving\n\n");
    if let Some(chk) = &r.engine_check {
        match chk.serve_at("\"$MODEL_DIR\"") {
            Some(cmd) => {
                let _ = writeln!(
                    c,
                    "{} loads this folder (its weight loader was emulated on the written \
                     files: {}):\n\n```sh\nMODEL_DIR=path/to/this/folder\n{cmd}\n```\n",
                    chk.engine.label(),
                    chk.method_summary()
                );
            }
            None => {
                let _ = writeln!(c, "{} would not load this folder.\n", chk.engine.label());
            }
        }
        for w in &chk.warnings {
            let _ = writeln!(c, "- warning: {} (fix: {})", w.what, w.fix);
        }
        for n in &chk.notes {
            let _ = writeln!(c, "- {n}");
        }
        if !chk.notes.is_empty() || !chk.warnings.is_empty() {
            c.push('\n');
        }
    }
    c.push_str(
        "Check it for an engine before renting a GPU: `soar-gptq inspect \"$MODEL_DIR\" --engine \
         sglang|vllm|transformers`.\n\n",
    );
    let edits = &r.config_edits;
    if !edits.removed.is_empty() || !edits.added.is_empty() {
        let _ = writeln!(
            c,
            "config.json is the source's with `quantization_config` added{}{}.\n",
            if edits.removed.is_empty() {
                String::new()
            } else {
                format!(", and without {}", edits.removed.join(", "))
            },
            if edits.added.is_empty() {
                String::new()
            } else {
                format!(", with {}", edits.added.join(", "))
            }
        );
    }
}

/// `## Verification`: the `--verify` table.
fn verification(c: &mut String, v: &CompareReport) {
    c.push_str("## Verification\n\n");
    let _ = writeln!(
        c,
        "Perplexity on {} tokens ({} windows of {}) of held-out text, both models scored on \
         the same windows:\n",
        v.reference.tokens, v.reference.windows, v.reference.seqlen
    );
    c.push_str("| model | ppl | Δppl | mean KL | top-1 agreement |\n|---|---:|---:|---:|---:|\n");
    let _ = writeln!(c, "| source | {:.4} | | | |", v.reference.ppl);
    for m in &v.compared {
        let _ = writeln!(
            c,
            "| this checkpoint | {:.4} | {:+.4} | {:.5} | {:.2}% |",
            m.ppl,
            m.delta_ppl,
            m.mean_kl,
            100.0 * m.top1_agreement
        );
    }
    c.push('\n');
}

/// `## Settings`: one row per setting a reader compares checkpoints by.
fn settings(c: &mut String, r: &QuantizeReport) {
    let s = &r.settings.flags;
    c.push_str("## Settings\n\n| setting | value |\n|---|---|\n");
    let rows: Vec<(&str, String)> = vec![
        ("method", method_label(s.method).to_string()),
        ("bits", s.bits.to_string()),
        ("group size", s.group_size.to_string()),
        ("symmetric", s.sym.to_string()),
        ("act-order", s.act_order.to_string()),
        ("damping", format!("{} of mean diag(H)", s.damp)),
        ("MSE clipping", s.mse.to_string()),
        ("true-sequential", s.true_sequential.to_string()),
        ("calibration", calibration_windows(s)),
        ("sparse layers' attention", sparse_attention(r)),
        ("kept in 16 bits", kept(&s.skip)),
    ];
    for (k, v) in rows {
        let _ = writeln!(c, "| {k} | {v} |");
    }
    c.push('\n');
}

fn calibration_windows(s: &Settings) -> String {
    match s.seqlen {
        SeqLen::Fixed(n) => format!("{} windows of {n} tokens, seed {}", s.nsamples, s.seed),
        SeqLen::LogUniform { min, max } => format!(
            "{} windows of {min} to {max} tokens (log-uniform lengths), seed {}",
            s.nsamples, s.seed
        ),
    }
}

fn sparse_attention(r: &QuantizeReport) -> String {
    format!(
        "`--sparse-attention {}`: {}",
        r.settings.flags.sparse_attention.name(),
        if r.settings.sparse_path {
            "InfLLM-v2 ran in calibration"
        } else {
            "dense attention in calibration (every window below sparse_config.dense_len)"
        }
    )
}

fn kept(skip: &[String]) -> String {
    if skip.is_empty() {
        return "embeddings, norms, lm_head".to_string();
    }
    format!(
        "embeddings, norms, lm_head, and modules matching {}",
        skip.iter()
            .map(|x| format!("`{x}`"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// `## Calibration data`: each source's share, and the windows' hash.
fn calibration(c: &mut String, r: &QuantizeReport) {
    c.push_str(
        "## Calibration data\n\n| source | weight | windows | tokens |\n|---|---:|---:|---:|\n",
    );
    for u in &r.calibration {
        let _ = writeln!(
            c,
            "| {} | {} | {} | {} |",
            u.name, u.weight, u.windows, u.tokens_used
        );
    }
    let _ = writeln!(
        c,
        "\nSHA-256 of the calibration windows: `{}`.\n",
        r.calibration_sha256
    );
}

/// `## Modules`: how many Linears were quantized, their output error per kind, the worst, and
/// the ones that needed more damping.
fn modules(c: &mut String, r: &QuantizeReport) {
    c.push_str("## Modules\n\n");
    let quantized: Vec<_> = r.modules.iter().filter(|m| m.quantized).collect();
    let _ = writeln!(
        c,
        "{} of {} Linears quantized.",
        quantized.len(),
        r.modules.len()
    );
    output_errors(c, &quantized);
    let damp = r.settings.flags.damp;
    let escalated = quantized.iter().filter(|m| m.damp > damp).count();
    if escalated > 0 {
        let _ = writeln!(
            c,
            "\n{escalated} module(s) needed more damping than {damp} (see quantize_report.json)."
        );
    }
    c.push('\n');
}

/// The relative output error per module kind (mean, max) and the five largest.
fn output_errors(c: &mut String, quantized: &[&ModuleRow]) {
    let mut by_kind: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for m in quantized {
        if let Some(e) = m.rel_output_error {
            by_kind.entry(kind(&m.module)).or_default().push(e);
        }
    }
    if by_kind.is_empty() {
        return;
    }
    c.push_str(
        "Relative output error ‖X(W−Q)ᵀ‖ / ‖XWᵀ‖ on the calibration tokens, per kind:\n\n\
         | module | count | mean | max |\n|---|---:|---:|---:|\n",
    );
    for (k, errs) in &by_kind {
        let mean = errs.iter().sum::<f64>() / errs.len() as f64;
        let max = errs.iter().cloned().fold(0.0, f64::max);
        let _ = writeln!(c, "| {k} | {} | {mean:.5} | {max:.5} |", errs.len());
    }
    let mut worst: Vec<_> = quantized
        .iter()
        .filter_map(|m| m.rel_output_error.map(|e| (e, &m.module)))
        .collect();
    worst.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    let list: Vec<String> = worst
        .iter()
        .take(5)
        .map(|(e, m)| format!("`{m}` ({e:.5})"))
        .collect();
    let _ = writeln!(c, "\nLargest: {}.", list.join(", "));
}

/// `## Files`: the manifest, the byte copies of the source's files, the report.
fn files(c: &mut String, r: &QuantizeReport) {
    c.push_str("## Files\n\n`manifest.json` lists the SHA-256 and size of every file. ");
    if !r.copied_from_source.is_empty() {
        let _ = write!(
            c,
            "Byte copies of the source's files (`copied_from_source` there): {}. ",
            r.copied_from_source
                .iter()
                .map(|f| format!("`{f}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    c.push_str("`quantize_report.json` has the per-module figures and timings.\n");
}
