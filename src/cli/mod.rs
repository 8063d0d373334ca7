//! The `soar-gptq` command line: argument parsing, dispatch, and the exit-code contract
//! (0 success, 2 usage error, 1 any other failure with one clear message on stderr).

pub mod progress;

use crate::checkpoint::writer::DEFAULT_SHARD_BYTES;
use crate::eval::{PplOptions, DEFAULT_EVAL_TEXT};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "soar-gptq",
    version,
    about = "GPTQ W4A16 quantization for MiniCPM-SALA, with perplexity verification"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Perplexity of a model on a text, with the protocol in docs/eval.md.
    EvalPpl(EvalPplArgs),
    /// What a checkpoint holds; validates it (non-zero exit when validation fails).
    Inspect(InspectArgs),
    /// Writes a random-weight checkpoint for a config or preset.
    Synth(SynthArgs),
}

#[derive(clap::Args, Debug)]
pub struct EvalPplArgs {
    /// Model folder or hub repo id (org/name).
    #[arg(long)]
    pub model: String,
    /// Hub revision (branch, tag or commit) when --model is a repo id.
    #[arg(long)]
    pub revision: Option<String>,
    /// Text file to score, or `default` for the evaluation text compiled into the binary.
    #[arg(long, default_value = "default")]
    pub data: String,
    /// Window length in tokens.
    #[arg(long, default_value_t = 2048)]
    pub seqlen: usize,
    /// Score at most this many windows.
    #[arg(long)]
    pub max_windows: Option<usize>,
    /// Start every window with the BOS token.
    #[arg(long)]
    pub bos: bool,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Compute dtype (default: f32 on the CPU, bf16 on a GPU).
    #[arg(long, value_enum)]
    pub dtype: Option<ComputeDtype>,
    /// Windows per forward batch.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Checkpoint folder.
    pub dir: PathBuf,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// A config.json to instantiate.
    #[arg(long, conflicts_with = "preset", required_unless_present = "preset")]
    pub config: Option<PathBuf>,
    /// A built-in config: `tiny` or `minicpm-sala-9b`.
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
    #[arg(long, default_value_t = DEFAULT_SHARD_BYTES)]
    pub shard_size: u64,
    /// Replace --out if it exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeDtype {
    F32,
    Bf16,
}

/// `auto` picks the first GPU when the binary has CUDA and one is present, else the CPU.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec = spec.trim();
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" => {
            if cfg!(feature = "cuda") {
                if let Ok(d) = Device::new_cuda(0) {
                    return Ok(d);
                }
            }
            Ok(Device::Cpu)
        }
        s if s == "cuda" || s.starts_with("cuda:") => {
            let n: usize = match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .with_context(|| format!("--device {s}: expected cuda:N with N a GPU index"))?,
                None => 0,
            };
            if !cfg!(feature = "cuda") {
                bail!("--device {s}: this binary was built without CUDA; rebuild with `cargo build --release --features cuda` or use --device cpu");
            }
            Device::new_cuda(n).with_context(|| format!("--device {s}: no usable CUDA GPU {n}"))
        }
        other => bail!("--device {other}: expected auto, cpu, cuda or cuda:N"),
    }
}

fn compute_dtype(choice: Option<ComputeDtype>, device: &Device) -> DType {
    match choice {
        Some(ComputeDtype::F32) => DType::F32,
        Some(ComputeDtype::Bf16) => DType::BF16,
        None if device.is_cpu() => DType::F32,
        None => DType::BF16,
    }
}

fn read_eval_text(data: &str) -> Result<String> {
    if data == "default" {
        return Ok(DEFAULT_EVAL_TEXT.to_string());
    }
    std::fs::read_to_string(data).with_context(|| format!("cannot read --data {data}"))
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Synth(a) => {
            let cfg = match (&a.config, &a.preset) {
                (Some(p), _) => crate::model::Config::from_file(p)?,
                (None, Some(name)) => crate::model::config::preset(name)?,
                (None, None) => unreachable!("clap requires one of --config / --preset"),
            };
            let opts = crate::synth::SynthOptions {
                out: a.out,
                seed: a.seed,
                tokenizer: a.tokenizer,
                shard_bytes: a.shard_size,
                force: a.force,
            };
            let out = crate::synth::synth(&cfg, &opts)?;
            eprintln!("wrote {} ({} parameters)", out.display(), cfg.param_count());
        }
        Command::Inspect(a) => {
            let report = crate::inspect::inspect(&a.dir)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                report.print_text();
            }
        }
        Command::EvalPpl(a) => {
            let src = crate::source::resolve(&a.model, a.revision.as_deref())?;
            let device = parse_device(&a.device)?;
            let opts = PplOptions {
                seqlen: a.seqlen,
                max_windows: a.max_windows,
                bos: a.bos,
                dtype: compute_dtype(a.dtype, &device),
                batch: a.batch,
                device,
            };
            let text = read_eval_text(&a.data)?;
            let r = crate::eval::perplexity(&src.dir, &text, &opts)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("model     {}", src.description);
                println!("ppl       {:.4}", r.ppl);
                println!("nll       {:.6} (mean per token)", r.nll);
                println!(
                    "scored    {} tokens in {} windows of {}",
                    r.tokens, r.windows, r.seqlen
                );
            }
        }
    }
    Ok(())
}

/// Entry point of the binary; returns the process exit code.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // --help and --version are successes; everything else clap rejects is a usage error.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}
