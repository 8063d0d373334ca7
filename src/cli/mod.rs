//! The `soar-gptq` command line: argument parsing, dispatch, and the exit-code contract
//! (0 success, 2 usage error, 1 any other failure with one clear message on stderr).

use crate::checkpoint::guard::{self, InputPath, OutputFile};
use crate::checkpoint::writer::DEFAULT_SHARD_BYTES;
use crate::device::DeviceArgs;
use crate::engine::Engine;
use crate::eval::{PplOptions, DEFAULT_EVAL_TEXT};
use crate::model::SparseAttention;
use crate::quantize::settings::engine_or_none;
use crate::sensitivity::Granularity;
use crate::source::ModelArgs;
use anyhow::{bail, Context, Result};
use clap::builder::PossibleValue;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "soar-gptq",
    version,
    about = "GPTQ W4A16 quantization for MiniCPM-SALA and Llama-family decoders, with perplexity verification"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Quantizes a BF16 checkpoint (MiniCPM-SALA, Llama, Mistral, Qwen2, MiniCPM) to a GPTQ
    /// (W4A16 by default) checkpoint.
    Quantize(Box<QuantizeArgs>),
    /// Rewrites a GPTQ checkpoint with Marlin-tiled weights (B, s), verified bit-exact.
    PackMarlin(PackMarlinArgs),
    /// Perplexity of a model on a text (protocol in docs/eval.md), optionally compared with
    /// other models on the same windows.
    EvalPpl(EvalPplArgs),
    /// What a checkpoint holds; validates it (non-zero exit when validation fails).
    Inspect(InspectArgs),
    /// Writes a random-weight checkpoint for a config or preset.
    Synth(SynthArgs),
    /// Converts a Llama-architecture GGUF file into a Hugging Face-layout BF16 folder.
    ImportGguf(ImportGgufArgs),
    /// Which quantized units hurt: the mean KL and perplexity change when each (per layer the
    /// attention or the MLP, or per module) alone goes back to 16 bits, ranked with its size;
    /// and a plan for a size budget or KL target that `quantize --plan` takes.
    Sensitivity(SensitivityArgs),
}

#[derive(clap::Args, Debug)]
pub struct SensitivityArgs {
    #[command(flatten)]
    pub source: ModelArgs,
    /// The quantized checkpoint (GPTQ or Marlin folder) made from --model.
    #[arg(long)]
    pub quantized: PathBuf,
    /// Text file to score, or `default` for the evaluation text compiled into the binary.
    #[arg(long, default_value = "default")]
    pub data: String,
    /// Window length in tokens (at least 2: a window scores its next-token predictions).
    #[arg(long, default_value_t = 512, value_parser = parse_window)]
    pub seqlen: usize,
    /// Score at most this many windows.
    #[arg(long, default_value_t = 64, value_parser = crate::flag::positive)]
    pub max_windows: usize,
    /// When MiniCPM-SALA's sparse layers run InfLLM-v2: auto (as the official code: from
    /// sparse_config.dense_len on), always (as SGLang serves with dense-as-sparse) or never
    /// (dense attention, as the vLLM ports compute them).
    #[arg(long, value_enum, default_value_t = SparseAttention::Auto)]
    pub sparse_attention: SparseAttention,

    /// Units: block (per layer the attention Linears and the MLP Linears) or module (per
    /// module the engines load: qkv_proj, o_proj, the attention gate, gate_up_proj, down_proj).
    #[arg(long, value_enum, default_value_t = Granularity::Block)]
    pub granularity: Granularity,
    /// Also score each unit quantized alone, the rest in 16 bits.
    #[arg(long)]
    pub alone: bool,
    /// What the plan makes of a chosen unit: 8 (bits, what gptq_marlin serves) or 16 (kept
    /// unquantized).
    #[arg(long, default_value_t = 8, value_parser = parse_upgrade)]
    pub upgrade: u8,
    /// Plan: at most this many extra gigabytes (10⁹ bytes).
    #[arg(long, value_parser = parse_nonneg, conflicts_with = "budget_pct")]
    pub budget_gb: Option<f64>,
    /// Plan: at most this many extra percent of the quantized checkpoint's size.
    #[arg(long, value_parser = parse_nonneg)]
    pub budget_pct: Option<f64>,
    /// Plan: stop once the predicted mean KL is at most this.
    #[arg(long, value_parser = parse_nonneg)]
    pub kl_target: Option<f64>,
    /// Write the plan (GPTQModel `dynamic` rules) to this JSON file for `quantize --plan`.
    #[arg(long)]
    pub plan_out: Option<PathBuf>,
    /// Replace --plan-out if it exists (a regular file only: never a folder, device or input).
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub forward: Forward,
    #[command(flatten)]
    pub print: Print,
}

fn parse_upgrade(s: &str) -> std::result::Result<u8, String> {
    match s {
        "8" => Ok(8),
        "16" => Ok(16),
        _ => Err(format!(
            "{s} is not an upgrade: use 8 (bits) or 16 (unquantized)"
        )),
    }
}

fn parse_nonneg(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s} is not a non-negative number")),
    }
}

#[derive(clap::Args, Debug)]
pub struct ImportGgufArgs {
    /// The .gguf file (llama.cpp format, general.architecture = llama).
    #[arg(long)]
    pub gguf: PathBuf,
    /// Output folder (written as <out>.partial, renamed when complete).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out if it exists.
    #[arg(long)]
    pub force: bool,
    /// Largest output shard in bytes.
    #[arg(long, default_value_t = DEFAULT_SHARD_BYTES, value_parser = crate::flag::bytes)]
    pub shard_size: u64,
    #[command(flatten)]
    pub print: Print,
}

#[derive(clap::Args, Debug)]
pub struct EvalPplArgs {
    #[command(flatten)]
    pub source: ModelArgs,
    /// Also score these models (BF16, GPTQ or Marlin folders) on the same windows and report
    /// their perplexity difference, mean KL divergence and top-1 agreement (repeatable).
    #[arg(long)]
    pub compare: Vec<PathBuf>,
    /// Text file to score, or `default` for the evaluation text compiled into the binary.
    #[arg(long, default_value = "default")]
    pub data: String,
    /// Window length in tokens (at least 2: a window scores its next-token predictions).
    #[arg(long, default_value_t = 2048, value_parser = parse_window)]
    pub seqlen: usize,
    /// Score at most this many windows.
    #[arg(long, value_parser = crate::flag::positive)]
    pub max_windows: Option<usize>,
    /// Start every window with the BOS token.
    #[arg(long)]
    pub bos: bool,
    /// When MiniCPM-SALA's sparse layers run InfLLM-v2: auto (as the official code: from
    /// sparse_config.dense_len on), always (as SGLang serves with dense-as-sparse) or never
    /// (dense attention, as the vLLM ports compute them).
    #[arg(long, value_enum, default_value_t = SparseAttention::Auto)]
    pub sparse_attention: SparseAttention,
    /// Draw the mean KL divergence of every --compare model against the position in the
    /// window as an SVG picture into this file.
    #[arg(long, requires = "compare")]
    pub plot: Option<PathBuf>,
    /// Replace an existing --plot file.
    #[arg(long)]
    pub force: bool,

    #[command(flatten)]
    pub forward: Forward,
    #[command(flatten)]
    pub print: Print,
}

/// `quantize`: its settings, and how the report is printed.
#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    #[command(flatten)]
    pub settings: crate::quantize::Settings,
    #[command(flatten)]
    pub print: Print,
}

/// `--engine` of `inspect`: the serving engine whose load is emulated. (Implemented here
/// rather than derived on [`Engine`] while src/engine/ is being rewritten.)
impl ValueEnum for Engine {
    fn value_variants<'a>() -> &'a [Self] {
        &Engine::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.name()))
    }
}

/// A usage error found after parsing (a combination of options): the message, exit code 2, as
/// clap's own, before any work.
fn usage_error(msg: impl std::fmt::Display) -> ! {
    use clap::CommandFactory;
    Cli::command()
        .error(clap::error::ErrorKind::ArgumentConflict, msg)
        .exit()
}

/// A window of tokens (calibration or evaluation): one token has no next-token prediction.
fn parse_window(s: &str) -> std::result::Result<usize, String> {
    match crate::flag::positive(s)? {
        1 => Err(
            "1 token is not a window: use at least 2 tokens (a window predicts each token from \
             the ones before it)"
                .to_string(),
        ),
        n => Ok(n),
    }
}

#[derive(clap::Args, Debug)]
pub struct PackMarlinArgs {
    /// GPTQ checkpoint folder.
    #[arg(long = "in")]
    pub input: PathBuf,
    /// Output folder.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out if it exists.
    #[arg(long)]
    pub force: bool,
    /// The engine whose config rules the output follows and whose loader is emulated on it (as a
    /// release with the legacy marlin method: no current release reads Marlin checkpoints);
    /// `none` checks nothing.
    #[arg(long, value_parser = engine_or_none(), default_value = "sglang")]
    pub engine: std::option::Option<Engine>,
    #[command(flatten)]
    pub print: Print,
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Checkpoint folder.
    pub dir: PathBuf,
    /// Emulate this engine's load of the folder (module set, tensors, config, remote code) and
    /// exit 1 when it would fail.
    #[arg(long, value_enum)]
    pub engine: Option<Engine>,
    /// With --engine on a Marlin checkpoint: check it as a release that still has the legacy
    /// marlin method would load it (what pack-marlin checks).
    #[arg(long, requires = "engine")]
    pub legacy_marlin: bool,
    #[command(flatten)]
    pub print: Print,
}

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// A config.json to instantiate.
    #[arg(long, conflicts_with = "preset", required_unless_present = "preset")]
    pub config: Option<PathBuf>,
    /// A built-in config: `tiny`, `tiny-sparse` (InfLLM-v2 from 512 tokens) or `minicpm-sala-9b`.
    #[arg(long)]
    pub preset: Option<String>,
    /// Output folder.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// tokenizer.json to ship with the model (default: the small one the repo ships).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Largest shard size in bytes.
    #[arg(long, default_value_t = DEFAULT_SHARD_BYTES, value_parser = crate::flag::bytes)]
    pub shard_size: u64,
    /// Replace --out if it exists.
    #[arg(long)]
    pub force: bool,
}

/// The device flags of the commands that score text, with their batch size.
#[derive(clap::Args, Debug)]
pub struct Forward {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Windows per forward batch.
    #[arg(long, default_value_t = 4, value_parser = crate::flag::positive)]
    pub batch: usize,
}

/// `--json`, of every command that prints a report.
#[derive(clap::Args, Debug)]
pub struct Print {
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
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

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Quantize(a) => {
            if let Some(msg) = a.settings.usage_error() {
                usage_error(msg);
            }
            let report = crate::quantize::quantize(&a.settings)?;
            if a.print.json {
                crate::outln!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                report.print_text();
            }
        }
        Command::Synth(a) => {
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
        }
        Command::Inspect(a) => {
            let quantized = crate::format::quantized::read_quant_info(&a.dir)?.is_some();
            let inspect = || -> Result<Inspected> {
                Ok(if quantized {
                    Inspected::Quantized(crate::inspect::quantized::inspect_quantized(&a.dir)?)
                } else {
                    Inspected::Plain(crate::inspect::inspect(&a.dir)?)
                })
            };
            match a.engine {
                None => {
                    let r = inspect()?;
                    if a.print.json {
                        crate::outln!("{}", serde_json::to_string_pretty(&r.to_json()?)?);
                    } else {
                        r.print_text();
                    }
                }
                Some(engine) => {
                    // The engine's view first: it explains a failure better than validation,
                    // and the full validation (which reads every tensor) runs only when it passes.
                    let check = crate::engine::check_dir(&a.dir, engine, a.legacy_marlin)?;
                    let validated = if check.loads {
                        inspect()
                    } else {
                        Err(anyhow::anyhow!("not validated: the engine check failed"))
                    };
                    if a.print.json {
                        let doc = serde_json::json!({
                            "inspect": match &validated {
                                Ok(r) => r.to_json()?,
                                Err(_) => serde_json::Value::Null,
                            },
                            "validation_error": validated.as_ref().err().map(|e| format!("{e:#}")),
                            "engine": check,
                        });
                        crate::outln!("{}", serde_json::to_string_pretty(&doc)?);
                    } else {
                        if let Ok(r) = &validated {
                            r.print_text();
                        }
                        check.print_text();
                        if let Err(e) = &validated {
                            if check.loads {
                                crate::outln!("validation     FAILED: {e:#}");
                            }
                        }
                    }
                    if !check.loads {
                        bail!("{}", check.error_text(&a.dir.display().to_string()));
                    }
                    validated?;
                }
            }
        }
        Command::ImportGguf(a) => {
            let report = crate::gguf::import_gguf(&crate::gguf::ImportOptions {
                gguf: a.gguf,
                out: a.out,
                force: a.force,
                shard_bytes: a.shard_size,
            })?;
            if a.print.json {
                crate::outln!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                report.print_text();
            }
        }
        Command::PackMarlin(a) => {
            let report =
                crate::pack_marlin::pack_marlin_checkpoint(&a.input, &a.out, a.force, a.engine)?;
            if a.print.json {
                crate::outln!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                report.print_text();
            }
        }
        Command::Sensitivity(a) => {
            if a.plan_out.is_some()
                && a.budget_gb.is_none()
                && a.budget_pct.is_none()
                && a.kl_target.is_none()
            {
                usage_error(
                    "--plan-out needs a plan to write: give --budget-gb, --budget-pct or \
                     --kl-target",
                );
            }
            // --plan-out is checked against every input before anything is read or
            // downloaded, and again with the resolved model's files.
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
            let (device, dtype) = a.forward.device.open()?;
            let opts = crate::sensitivity::SensitivityOptions {
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
            };
            let r = crate::sensitivity::sensitivity(&src.dir, &a.quantized, &text, &opts)?;
            // A plan without rules would change nothing: it is not written (quantize refuses
            // one), and the run fails after the table, saying why.
            let empty = r.plan.as_ref().is_some_and(|p| p.units.is_empty());
            if let Some(out) = plan_out.as_ref().filter(|_| !empty) {
                crate::sensitivity::write_plan(out, &r)?;
            }
            if a.print.json {
                crate::outln!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                r.print_text();
                if let Some(p) = a.plan_out.as_ref().filter(|_| !empty) {
                    crate::outln!("wrote {}", p.display());
                }
            }
            if let Some(p) = a.plan_out.as_ref().filter(|_| empty) {
                bail!(
                    "the plan chose no unit: {}; nothing was written to --plan-out {} (a plan \
                     without rules would change nothing)",
                    crate::sensitivity::empty_plan_reason(&r, &opts),
                    p.display()
                );
            }
        }
        Command::EvalPpl(a) => {
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
