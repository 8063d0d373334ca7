//! The `soar-gptq` command line: the entry point, the exit-code contract (0 success, 2 usage
//! error, 1 any other failure with one clear message on stderr), and one function per command
//! that hands its parsed flags (`args.rs`) to the library and prints what it returns.

mod args;

use crate::checkpoint::guard::{self, InputPath, OutputFile};
use crate::eval::{PplOptions, DEFAULT_EVAL_TEXT};
use anyhow::{bail, Context, Result};
pub use args::*;
use clap::Parser;
use std::path::PathBuf;

/// Entry point of the binary; returns the process exit code.
pub fn main() -> i32 {
    crate::interrupt::install();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // --help and --version are successes; everything else clap rejects is a usage error.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    let code = match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    // A reader that closed the pipe early (`| head`) wanted no more: not an error. A full or
    // failing stdout is, though the work itself (a written checkpoint) is complete.
    match crate::output::finish() {
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => code,
        Some(e) => {
            eprintln!("error: cannot write to standard output: {e}");
            code.max(1)
        }
        None => code,
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Quantize(a) => quantize(*a),
        Command::PackMarlin(a) => pack_marlin(a),
        Command::EvalPpl(a) => eval_ppl(a),
        Command::Inspect(a) => inspect(a),
        Command::Synth(a) => synth(a),
        Command::ImportGguf(a) => import_gguf(a),
        Command::Sensitivity(a) => sensitivity(a),
        Command::ExportCalib(a) => export_calib(a),
    }
}

impl Print {
    /// Prints `report` as one JSON document with `--json`, else as `text` prints it.
    fn report<T: serde::Serialize>(&self, report: &T, text: impl FnOnce(&T)) -> Result<()> {
        if self.json {
            crate::outln!("{}", serde_json::to_string_pretty(report)?);
        } else {
            text(report);
        }
        Ok(())
    }
}

fn quantize(a: QuantizeArgs) -> Result<()> {
    if let Some(msg) = a.settings.usage_error() {
        usage_error(msg);
    }
    let report = crate::quantize::quantize(&a.settings)?;
    a.print.report(&report, |r| r.print_text())
}

fn pack_marlin(a: PackMarlinArgs) -> Result<()> {
    let report = crate::pack_marlin::pack_marlin_checkpoint(&a.input, &a.out, a.force, a.engine)?;
    a.print.report(&report, |r| r.print_text())
}

fn eval_ppl(a: EvalPplArgs) -> Result<()> {
    let src = a.source.resolve()?;
    let (device, dtype) = a.forward.device.open()?;
    let opts = PplOptions {
        seqlen: a.seqlen,
        max_windows: a.max_windows,
        bos: a.bos,
        dtype,
        batch: a.forward.batch,
        device,
        sparse_attention: a.sparse_attention,
        text_name: text_name(&a.data),
    };
    let text = read_eval_text(&a.data)?;
    let plot = a
        .plot
        .as_ref()
        .map(|p| plot_output(p, a.force, &src.dir, &a.compare, &a.data))
        .transpose()?;
    let c = crate::eval::compare(&src.dir, &a.compare, &text, &opts)?;
    if let Some(p) = &plot {
        let models: Vec<(String, &crate::eval::PositionSums)> = c
            .compared
            .iter()
            .map(|m| (m.model.clone(), &m.sums))
            .collect();
        let svg = crate::eval::plot::kl_by_position_svg(&models, opts.seqlen)?;
        p.write(|tmp| Ok(std::fs::write(tmp, svg.as_bytes())?))?;
    }
    if a.print.json && a.compare.is_empty() {
        crate::outln!("{}", serde_json::to_string_pretty(&c.reference)?);
    } else if a.print.json {
        crate::outln!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        print_comparison(&src.description, &c);
        if let Some(p) = &a.plot {
            crate::outln!("wrote {}", p.display());
        }
    }
    Ok(())
}

/// `--plot`'s file, checked before any work as every output is (docs/safety.md): not an input,
/// not a folder or device, an existing file replaced only with `--force`.
fn plot_output(
    path: &std::path::Path,
    force: bool,
    model: &std::path::Path,
    compare: &[PathBuf],
    data: &str,
) -> Result<crate::checkpoint::guard::OutputFile> {
    use crate::checkpoint::guard::{model_inputs, InputPath, OutputFile};
    let mut inputs = model_inputs("--model", model);
    for c in compare {
        inputs.extend(model_inputs("--compare", c));
    }
    if data != "default" {
        inputs.push(InputPath::new("--data", data));
    }
    OutputFile::check("--plot", path, force, &inputs)
}

fn print_comparison(reference: &str, c: &crate::eval::CompareReport) {
    let r = &c.reference;
    crate::outln!(
        "scored {} tokens in {} windows of {} (protocol: docs/eval.md; sparse layers: {})",
        r.tokens,
        r.windows,
        r.seqlen,
        if r.sparse_path {
            "InfLLM-v2"
        } else {
            "dense attention"
        }
    );
    crate::outln!(
        "{:<40} {:>10} {:>10} {:>10} {:>8}",
        "model",
        "ppl",
        "Δppl",
        "mean KL",
        "top-1"
    );
    crate::outln!(
        "{:<40} {:>10.4} {:>10} {:>10} {:>8}",
        reference,
        r.ppl,
        "-",
        "-",
        "-"
    );
    for m in &c.compared {
        crate::outln!(
            "{:<40} {:>10.4} {:>+10.4} {:>10.5} {:>7.2}%",
            m.model,
            m.ppl,
            m.delta_ppl,
            m.mean_kl,
            100.0 * m.top1_agreement
        );
    }
    if r.by_position.len() > 1 {
        crate::outln!("by position in the window:");
        crate::outln!(
            "{:<40} {:>13} {:>10} {:>10} {:>10} {:>8}",
            "model",
            "positions",
            "ppl",
            "Δppl",
            "mean KL",
            "top-1"
        );
        let span = |x: &crate::eval::RangeScore| format!("{}-{}", x.from, x.to);
        for x in &r.by_position {
            crate::outln!(
                "{:<40} {:>13} {:>10.4} {:>10} {:>10} {:>8}",
                reference,
                span(x),
                x.ppl,
                "-",
                "-",
                "-"
            );
        }
        for m in &c.compared {
            for (x, rx) in m.by_position.iter().zip(&r.by_position) {
                crate::outln!(
                    "{:<40} {:>13} {:>10.4} {:>+10.4} {:>10.5} {:>7.2}%",
                    m.model,
                    span(x),
                    x.ppl,
                    x.ppl - rx.ppl,
                    x.mean_kl.unwrap_or(0.0),
                    100.0 * x.top1_agreement.unwrap_or(0.0)
                );
            }
        }
    }
}

fn inspect(a: InspectArgs) -> Result<()> {
    let quantized = crate::format::quantized::read_quant_info(&a.dir)?.is_some();
    let inspect = || -> Result<Inspected> {
        Ok(if quantized {
            Inspected::Quantized(crate::inspect::quantized::inspect_quantized(&a.dir)?)
        } else {
            Inspected::Plain(crate::inspect::inspect(&a.dir)?)
        })
    };
    let Some(engine) = a.engine else {
        let r = inspect()?;
        if a.print.json {
            crate::outln!("{}", serde_json::to_string_pretty(&r.to_json()?)?);
        } else {
            r.print_text();
        }
        return Ok(());
    };
    // The engine's view first: it explains a failure better than validation, and the full
    // validation (which reads every tensor) runs only when it passes.
    let check = crate::engine::check_dir(&a.dir, engine, a.legacy_marlin)?;
    let validated = if check.loads {
        inspect()
    } else {
        Err(anyhow::anyhow!("not validated: the engine check failed"))
    };
    print_engine_inspection(&a, &check, &validated)?;
    if !check.loads {
        bail!("{}", check.error_text(&a.dir.display().to_string()));
    }
    validated.map(|_| ())
}

/// `inspect --engine`: the engine's check, and the validation where it ran.
fn print_engine_inspection(
    a: &InspectArgs,
    check: &crate::engine::EngineCheck,
    validated: &Result<Inspected>,
) -> Result<()> {
    if a.print.json {
        let doc = serde_json::json!({
            "inspect": match validated {
                Ok(r) => r.to_json()?,
                Err(_) => serde_json::Value::Null,
            },
            "validation_error": validated.as_ref().err().map(|e| format!("{e:#}")),
            "engine": check,
        });
        crate::outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    if let Ok(r) = validated {
        r.print_text();
    }
    check.print_text();
    if let Err(e) = validated {
        if check.loads {
            crate::outln!("validation     FAILED: {e:#}");
        }
    }
    Ok(())
}

/// An `inspect` report of either kind of folder.
enum Inspected {
    Quantized(crate::inspect::quantized::QuantInspectReport),
    Plain(crate::inspect::InspectReport),
}

impl Inspected {
    fn to_json(&self) -> Result<serde_json::Value> {
        Ok(match self {
            Self::Quantized(r) => serde_json::to_value(r)?,
            Self::Plain(r) => serde_json::to_value(r)?,
        })
    }
    fn print_text(&self) {
        match self {
            Self::Quantized(r) => r.print_text(),
            Self::Plain(r) => r.print_text(),
        }
    }
}

fn synth(a: SynthArgs) -> Result<()> {
    let cfg = match (&a.config, &a.preset) {
        (Some(p), _) => crate::model::AnyConfig::from_file(p)?,
        (None, Some(name)) => crate::model::config::preset(name)?.into(),
        (None, None) => unreachable!("clap requires one of --config / --preset"),
    };
    let opts = crate::synth::SynthOptions {
        out: a.out,
        seed: a.seed,
        tokenizer: a.tokenizer,
        config_file: a.config.clone(),
        shard_bytes: a.shard_size,
        force: a.force,
    };
    let out = crate::synth::synth(&cfg, &opts)?;
    eprintln!("wrote {} ({} parameters)", out.display(), cfg.param_count());
    Ok(())
}

fn import_gguf(a: ImportGgufArgs) -> Result<()> {
    let report = crate::gguf::import_gguf(&crate::gguf::ImportOptions {
        gguf: a.gguf,
        out: a.out,
        force: a.force,
        shard_bytes: a.shard_size,
    })?;
    a.print.report(&report, |r| r.print_text())
}

fn export_calib(a: ExportCalibArgs) -> Result<()> {
    use crate::calib::{export, CalibSpec};
    let calib = a
        .calib
        .iter()
        .map(|c| CalibSpec::parse(c))
        .collect::<Result<Vec<_>>>()?;
    // --out is checked against every input before anything is read or downloaded, and again
    // with the resolved model's files.
    let mut inputs = crate::calib::input_paths(&calib);
    inputs.push(InputPath::new("--model", a.source.local_path()));
    OutputFile::check("--out", &a.out, a.force, &inputs)?;
    let src = a.source.resolve()?;
    inputs.extend(guard::model_inputs("--model", &src.dir));
    let out = OutputFile::check("--out", &a.out, a.force, &inputs)?;
    let req = export::Request {
        calib: &calib,
        nsamples: a.nsamples,
        seqlen: a.seqlen,
        seed: a.seed,
    };
    let cfg = crate::model::AnyConfig::from_file(&src.dir.join("config.json"))?;
    cfg.check_length(a.seqlen.max())
        .with_context(|| format!("--seqlen {} is too long for this model", a.seqlen))?;
    let set = export::windows(&src.dir, cfg.vocab_size(), &req)?;
    let json = export::to_json(&src.description, &req, &set)?;
    out.write(|tmp| Ok(std::fs::write(tmp, json.as_bytes())?))?;
    let tokens: usize = set.windows.iter().map(Vec::len).sum();
    crate::outln!(
        "wrote {}: {} windows, {tokens} tokens, calibration_sha256 {}",
        a.out.display(),
        set.windows.len(),
        set.sha256
    );
    Ok(())
}

fn sensitivity(a: SensitivityArgs) -> Result<()> {
    if a.plan_out.is_some()
        && a.budget_gb.is_none()
        && a.budget_pct.is_none()
        && a.kl_target.is_none()
    {
        usage_error(
            "--plan-out needs a plan to write: give --budget-gb, --budget-pct or --kl-target",
        );
    }
    // --plan-out is checked against every input before anything is read or downloaded, and
    // again with the resolved model's files.
    let mut inputs = vec![InputPath::new("--quantized", &a.quantized)];
    if a.data != "default" {
        inputs.push(InputPath::new("--data", &a.data));
    }
    inputs.push(InputPath::new("--model", a.source.local_path()));
    let check_plan_out = |inputs: &[InputPath]| {
        a.plan_out
            .as_ref()
            .map(|p| OutputFile::check("--plan-out", p, a.force, inputs))
            .transpose()
    };
    check_plan_out(&inputs)?;
    let text = read_eval_text(&a.data)?;
    let src = a.source.resolve()?;
    inputs.extend(guard::model_inputs("--model", &src.dir));
    inputs.extend(guard::model_inputs("--quantized", &a.quantized));
    let plan_out = check_plan_out(&inputs)?;
    let opts = sensitivity_options(&a)?;
    let r = crate::sensitivity::sensitivity(&src.dir, &a.quantized, &text, &opts)?;
    write_sensitivity(&a, &r, &opts, plan_out.as_ref())
}

fn sensitivity_options(a: &SensitivityArgs) -> Result<crate::sensitivity::SensitivityOptions> {
    let (device, dtype) = a.forward.device.open()?;
    Ok(crate::sensitivity::SensitivityOptions {
        eval: PplOptions {
            seqlen: a.seqlen,
            max_windows: Some(a.max_windows),
            bos: false,
            dtype,
            batch: a.forward.batch,
            device,
            sparse_attention: a.sparse_attention,
            text_name: text_name(&a.data),
        },
        granularity: a.granularity,
        alone: a.alone,
        upgrade_bits: a.upgrade,
        budget: match (a.budget_gb, a.budget_pct) {
            (Some(gb), _) => Some(crate::sensitivity::Budget::Bytes((gb * 1e9) as u64)),
            (None, Some(p)) => Some(crate::sensitivity::Budget::Percent(p)),
            (None, None) => None,
        },
        kl_target: a.kl_target,
    })
}

/// The sensitivity report, and the plan file where a plan has rules. A plan without rules would
/// change nothing: it is not written (quantize refuses one), and the run fails after the table,
/// saying why.
fn write_sensitivity(
    a: &SensitivityArgs,
    r: &crate::sensitivity::SensitivityReport,
    opts: &crate::sensitivity::SensitivityOptions,
    plan_out: Option<&OutputFile>,
) -> Result<()> {
    let empty = r.plan.as_ref().is_some_and(|p| p.units.is_empty());
    if let Some(out) = plan_out.filter(|_| !empty) {
        crate::sensitivity::write_plan(out, r)?;
    }
    if a.print.json {
        crate::outln!("{}", serde_json::to_string_pretty(r)?);
    } else {
        r.print_text();
        if let Some(p) = a.plan_out.as_ref().filter(|_| !empty) {
            crate::outln!("wrote {}", p.display());
        }
    }
    if let Some(p) = a.plan_out.as_ref().filter(|_| empty) {
        bail!(
            "the plan chose no unit: {}; nothing was written to --plan-out {} (a plan without \
             rules would change nothing)",
            crate::sensitivity::empty_plan_reason(r, opts),
            p.display()
        );
    }
    Ok(())
}

/// A usage error found after parsing (a combination of options): the message, exit code 2, as
/// clap's own, before any work.
fn usage_error(msg: impl std::fmt::Display) -> ! {
    use clap::CommandFactory;
    Cli::command()
        .error(clap::error::ErrorKind::ArgumentConflict, msg)
        .exit()
}

fn read_eval_text(data: &str) -> Result<String> {
    if data == "default" {
        return Ok(DEFAULT_EVAL_TEXT.to_string());
    }
    crate::checkpoint::guard::regular_file(std::path::Path::new(data), "--data")?;
    std::fs::read_to_string(data).with_context(|| format!("cannot read --data {data}"))
}

/// `--data` as messages name it.
fn text_name(data: &str) -> String {
    if data == "default" {
        "the built-in evaluation text (--data default)".to_string()
    } else {
        format!("--data {data}")
    }
}
