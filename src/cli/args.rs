//! The commands and their flags, as clap parses them: every option value is parsed into its type
//! here, before any download or heavy work. `quantize`'s own flags are `quantize::Settings`;
//! the groups several commands share are `source::ModelArgs`, `device::DeviceArgs` and, below,
//! [`Forward`] and [`Print`].

use crate::checkpoint::shards::DEFAULT_SHARD_BYTES;
use crate::device::DeviceArgs;
use crate::engine::Engine;
use crate::model::SparseAttention;
use crate::quantize::settings::engine_or_none;
use crate::sensitivity::Granularity;
use crate::source::ModelArgs;
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
    /// Writes the calibration windows quantize would draw, as token ids (JSON), so that another
    /// tool can calibrate on exactly the same tokens.
    ExportCalib(ExportCalibArgs),
}

/// `quantize`: its settings, and how the report is printed.
#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    #[command(flatten)]
    pub settings: crate::quantize::Settings,
    #[command(flatten)]
    pub print: Print,
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

/// `export-calib`: the calibration flags of `quantize` that choose the windows, and the file.
#[derive(clap::Args, Debug)]
pub struct ExportCalibArgs {
    #[command(flatten)]
    pub source: ModelArgs,
    /// Calibration source, as quantize takes it: `default`, a .txt or .jsonl file, or a folder;
    /// append `:WEIGHT` to mix several (repeatable).
    #[arg(long, default_values_t = vec!["default".to_string()])]
    pub calib: Vec<String>,
    /// Calibration windows.
    #[arg(long, default_value_t = 128, value_parser = crate::flag::positive)]
    pub nsamples: usize,
    /// Tokens per window, or MIN..MAX for lengths drawn log-uniformly between two.
    #[arg(long, default_value = "2048")]
    pub seqlen: crate::calib::SeqLen,
    /// Seed for drawing the windows.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The JSON file to write (docs/calibration.md, Exporting the windows).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out if it exists (a regular file only: never a folder, device or input).
    #[arg(long)]
    pub force: bool,
}
