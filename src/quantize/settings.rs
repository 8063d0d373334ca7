//! `quantize`'s options, declared once. [`Settings`] is the clap group the CLI flattens into the
//! `quantize` command and the one value the pipeline reads; [`Compute`] is what its device flags
//! resolve to on this machine; [`Recorded`] is the part that determines the output's bits, as
//! the journal hashes it and the report records it, and as `quantization_config` states it.
//!
//! A new option that changes the output is a field of [`Settings`] (its flag and help), a line in
//! [`Recorded`]'s serialization and in [`flag_name`] (and in [`Recorded::quantization_config`]
//! when the config should say so), and the code that acts on it.

use super::plan::Plan;
use crate::calib::{CalibSpec, SeqLen};
use crate::checkpoint::shards::DEFAULT_SHARD_BYTES;
use crate::device::DeviceArgs;
use crate::engine::Engine;
use crate::format::quantized::GptqConfig;
use crate::gptq::QuantParams;
use crate::model::SparseAttention;
use crate::scheme::{ActOrder, Bits, FactorPrecision, GroupSize, QuantFormat};
use crate::source::ModelArgs;
use anyhow::Result;
use candle_core::{DType, Device};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::ArgAction;
use serde::ser::{SerializeStruct, Serializer};
use std::path::PathBuf;

/// How the weights are solved (`--method`): GPTQ; GPTAQ, GPTQ on GPTAQ's asymmetric objective
/// with the full-precision model's inputs as the target (docs/algorithm.md, GPTAQ); or
/// round-to-nearest. (The variants carry no doc comments: `--method`'s help describes them.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Gptq,
    Gptaq,
    Rtn,
}

impl Method {
    /// Whether the method calibrates (Hessians from the model's inputs).
    pub fn uses_hessians(self) -> bool {
        self != Method::Rtn
    }
}

/// Every option of `quantize` (docs/usage.md, quantize), as clap parses it.
#[derive(clap::Args, Debug, Clone)]
pub struct Settings {
    #[command(flatten)]
    pub source: ModelArgs,
    /// Calibration source: `default`, a .txt or .jsonl file, or a folder; append `:WEIGHT` to mix
    /// several (repeatable).
    #[arg(long, default_values_t = vec!["default".to_string()])]
    pub calib: Vec<String>,
    /// Output folder (written as <out>.partial, renamed when complete).
    #[arg(long)]
    pub out: PathBuf,
    /// Bits per weight: 2, 3, 4 or 8 (Marlin serves 4 and 8; 2 and 3 use the engines' gptq kernel).
    #[arg(long, default_value_t = Bits::B4)]
    pub bits: Bits,
    /// Columns per quantization group (-1: one group per row).
    #[arg(long, default_value_t = GroupSize::G128, allow_hyphen_values = true)]
    pub group_size: GroupSize,
    /// Column order of the solve: static (act-order with fixed groups, trivial g_idx),
    /// dynamic (desc_act with permuted g_idx) or off.
    #[arg(long, value_enum, default_value_t = ActOrder::Static)]
    pub act_order: ActOrder,
    /// Asymmetric quantization (zero points); not servable by gptq_marlin.
    #[arg(long = "asym", action = ArgAction::SetFalse)]
    pub sym: bool,
    /// Initial damping as a fraction of mean(diag H), in (0, 1); doubled on a failed factorization.
    #[arg(long, default_value_t = 0.01, value_parser = parse_damp)]
    pub damp: f64,
    /// Precision of each Hessian's Cholesky factorization and inverse: auto (f64 on the CPU and
    /// on GPUs with a useful FP64 rate, f32 on RTX, L40S and workstation cards), f64 or f32.
    #[arg(long, value_enum, default_value_t = FactorPrecision::Auto)]
    pub factor_precision: FactorPrecision,
    /// Calibration windows.
    #[arg(long, default_value_t = 128, value_parser = crate::flag::positive)]
    pub nsamples: usize,
    /// Tokens per calibration window, or MIN..MAX for lengths drawn log-uniformly between two
    /// (long-context calibration, docs/calibration.md); at most max_position_embeddings.
    #[arg(long, default_value = "2048")]
    pub seqlen: SeqLen,
    /// When MiniCPM-SALA's sparse layers run InfLLM-v2: auto (as the official code: from
    /// sparse_config.dense_len on), always (as SGLang serves with dense-as-sparse) or never
    /// (dense attention, as the vLLM ports compute them).
    #[arg(long, value_enum, default_value_t = SparseAttention::Auto)]
    pub sparse_attention: SparseAttention,

    /// Seed for drawing calibration windows.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep modules whose full name matches this regex in BF16 (repeatable).
    #[arg(long)]
    pub skip: Vec<String>,
    /// Per-module bits and group sizes: a JSON file with a GPTQModel `dynamic` object
    /// (`"+:REGEX": {"bits": 8}`, `"-:REGEX": {}` for 16 bits), e.g. from `sensitivity
    /// --plan-out` (docs/usage.md, Mixed precision).
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Accept --plan rules that change nothing (that match no module, or only modules --skip or
    /// earlier rules decide); without it such a plan is refused, naming them.
    #[arg(long, requires = "plan")]
    pub allow_unmatched_rules: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Take all Hessians of a layer from the unquantized layer.
    #[arg(long = "no-true-sequential", action = ArgAction::SetFalse)]
    pub true_sequential: bool,
    /// Search each group's clipping range by MSE (grid 100, shrink to 0.8): the default.
    #[arg(long = "mse", id = "mse_flag", overrides_with = "mse")]
    pub mse_flag: bool,
    /// Plain min/max ranges instead of the MSE search (vanilla GPTQ's quantizer).
    #[arg(long = "no-mse", action = ArgAction::SetFalse, overrides_with = "mse_flag")]
    pub mse: bool,
    /// After the solve, refit each row's group scales by least squares under the Hessian
    /// (codes unchanged; docs/algorithm.md, Scale refit).
    #[arg(long)]
    pub refit: bool,
    /// Save every Hessian (safetensors) into this folder.
    #[arg(long)]
    pub save_hessians: Option<PathBuf>,
    /// Re-solve from Hessians saved by an earlier --save-hessians run (no calibration forward).
    #[arg(long, conflicts_with = "save_hessians")]
    pub load_hessians: Option<PathBuf>,
    /// Continue an interrupted run from its last finished layer.
    #[arg(long)]
    pub resume: bool,
    /// Replace --out if it exists.
    #[arg(long)]
    pub force: bool,
    /// Compare perplexity against the source model at the end (on the embedded evaluation text).
    #[arg(long)]
    pub verify: bool,
    /// gptq; gptaq (GPTQ on the asymmetric objective: the full-precision model's inputs as the
    /// target, a second forward stream; docs/algorithm.md, GPTAQ); or rtn (round-to-nearest
    /// baseline through the same writer).
    #[arg(long, value_enum, default_value_t = Method::Gptq)]
    pub method: Method,
    /// GPTAQ: the share of the asymmetric correction applied, in [0, 1] (0 is GPTQ).
    #[arg(long, default_value_t = 1.0, value_parser = parse_alpha)]
    pub gptaq_alpha: f64,
    /// Calibration windows per forward batch (at most 65,536 tokens a batch; a longer window
    /// is a batch of its own).
    #[arg(long, default_value_t = 8, value_parser = crate::flag::positive)]
    pub batch: usize,
    /// Use at most this many GB of GPU memory: the hidden states move to host memory and the
    /// layer caches are recomputed as needed (docs/usage.md, Memory).
    #[arg(long, value_parser = parse_gb)]
    pub max_gpu_memory: Option<f64>,
    /// Keep at most this many GB of activations in host memory (hidden states, and beside a GPU
    /// the mixer outputs it cannot keep); states beyond it spill to disk under the output's
    /// partial folder, mixer outputs are recomputed.
    #[arg(long, value_parser = parse_gb)]
    pub max_host_memory: Option<f64>,
    /// Largest output shard in bytes.
    #[arg(long, default_value_t = DEFAULT_SHARD_BYTES, value_parser = crate::flag::bytes)]
    pub shard_size: u64,
    /// The serving engine the output is written for and checked against before the run and
    /// before it is committed (docs/engines.md); `none` applies no engine's rules and checks
    /// nothing (for checkpoints made to be evaluated, e.g. 3-bit MiniCPM-SALA).
    #[arg(long, value_parser = engine_or_none(), default_value = "sglang")]
    pub engine: std::option::Option<Engine>,
    /// Testing aid: fail after this many layers (leaves a resumable <out>.partial).
    #[arg(long, hide = true)]
    pub stop_after_layers: Option<usize>,
}

impl Settings {
    /// A combination of flags that is a usage error (exit 2, before any work), as its message.
    pub fn usage_error(&self) -> Option<&'static str> {
        if self.method == Method::Gptaq {
            if !self.true_sequential {
                return Some(
                    "--method gptaq needs true-sequential calibration (each group's \
                     quantized-model input after the groups before it): drop \
                     --no-true-sequential",
                );
            }
            if self.load_hessians.is_some() {
                return Some(
                    "--method gptaq cannot --load-hessians: saved files hold the Hessian only, \
                     not GPTAQ's cross term; calibrate instead",
                );
            }
        } else if self.gptaq_alpha != 1.0 {
            return Some("--gptaq-alpha applies to --method gptaq only");
        }
        if self.refit && self.method == Method::Rtn {
            return Some(
                "--refit fits scales under the Hessian, which --method rtn does not compute: use \
                 it with --method gptq or gptaq",
            );
        }
        None
    }

    /// `--calib`, each source with its weight.
    pub fn calib_specs(&self) -> Result<Vec<CalibSpec>> {
        self.calib.iter().map(|c| CalibSpec::parse(c)).collect()
    }

    /// The format the output is written in: symmetric zeros fit GPTQ v1 (what every engine
    /// reads); asymmetric ones may be 0, which only v2 stores.
    pub fn format(&self) -> QuantFormat {
        if self.sym {
            QuantFormat::GptqV1
        } else {
            QuantFormat::GptqV2
        }
    }

    /// The quantizer of the default scheme.
    pub fn quant_params(&self) -> QuantParams {
        QuantParams {
            bits: self.bits.get(),
            group_size: self.group_size,
            sym: self.sym,
            mse: self.mse,
        }
    }
}

/// `--engine` of the commands that write a checkpoint: an engine, or `none` (no engine's rules
/// applied, no load check: for checkpoints made to be evaluated, not served). A field of this
/// parser is spelled `std::option::Option` so that clap takes `none` as a value instead of
/// making the flag optional.
pub fn engine_or_none() -> impl TypedValueParser<Value = Option<Engine>> {
    let names = Engine::ALL.map(Engine::name).into_iter().chain(["none"]);
    PossibleValuesParser::new(names).map(|s| Engine::ALL.into_iter().find(|e| e.name() == s))
}

fn parse_damp(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(d) if crate::gptq::valid_damp(d) => Ok(d),
        _ => Err(format!(
            "{s} is not a damping fraction: use a number in (0, 1), e.g. 0.01"
        )),
    }
}

fn parse_alpha(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(a) if (0.0..=1.0).contains(&a) => Ok(a),
        _ => Err(format!(
            "{s} is not a GPTAQ share: use a number in [0, 1], e.g. 1 or 0.25"
        )),
    }
}

fn parse_gb(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "{s} is not a number of gigabytes (10⁹ bytes), e.g. 24"
        )),
    }
}

/// What `--device`, `--dtype` and `--factor-precision` resolve to on this machine.
#[derive(Debug, Clone)]
pub struct Compute {
    pub device: Device,
    pub dtype: DType,
    pub factor_precision: FactorPrecision,
}

impl Compute {
    pub fn open(s: &Settings) -> Result<Self> {
        let (device, dtype) = s.device.open()?;
        let factor_precision = resolve_factor_precision(s.factor_precision, &device)?;
        Ok(Self {
            device,
            dtype,
            factor_precision,
        })
    }
}

/// `--factor-precision auto` for `device`: f64 on the CPU and on GPUs whose FP64 rate is at
/// least 1/8 of their FP32 rate (A100, H100, H200, B200), f32 on the others (RTX, L40S,
/// workstation Blackwell cards: 1/32 to 1/64), where the f64 factorizations of a 9.5B model
/// would take minutes.
pub fn resolve_factor_precision(p: FactorPrecision, device: &Device) -> Result<FactorPrecision> {
    if p != FactorPrecision::Auto {
        return Ok(p);
    }
    if device.is_cpu() {
        return Ok(FactorPrecision::F64);
    }
    #[cfg(feature = "cuda")]
    {
        let ratio = crate::kernels::memory::fp32_to_fp64_ratio(device)?;
        Ok(if ratio > 8 {
            FactorPrecision::F32
        } else {
            FactorPrecision::F64
        })
    }
    #[cfg(not(feature = "cuda"))]
    Ok(FactorPrecision::F64)
}

/// The settings that determine the output's bits, as the journal hashes them (a resumed run must
/// match them) and the report records them (`settings`): the flags of [`Settings`] that do, and
/// what they resolved to in this run.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub flags: Settings,
    /// `--factor-precision`, resolved for the device.
    pub factor_precision: FactorPrecision,
    pub dtype: DType,
    pub device_kind: &'static str,
    /// `--calib`, each source with its weight.
    pub calib: Vec<CalibSpec>,
    /// What `--plan` changes: `module=bits/group` or `module=keep` for every Linear it moves
    /// off the default scheme (empty without `--plan`).
    pub plan: Vec<String>,
    /// Whether the sparse layers run InfLLM-v2 on some calibration window.
    pub sparse_path: bool,
}

impl Recorded {
    pub fn new(
        flags: &Settings,
        compute: &Compute,
        calib: Vec<CalibSpec>,
        plan: &Plan,
        sparse_path: bool,
    ) -> Self {
        Self {
            flags: flags.clone(),
            factor_precision: compute.factor_precision,
            dtype: compute.dtype,
            device_kind: if compute.device.is_cpu() {
                "cpu"
            } else {
                "cuda"
            },
            calib,
            plan: if plan.from_rules {
                plan.overrides()
            } else {
                vec![]
            },
            sparse_path,
        }
    }

    /// GPTAQ's share of the correction, with `--method gptaq` only.
    pub fn gptaq_alpha(&self) -> Option<f64> {
        (self.flags.method == Method::Gptaq).then_some(self.flags.gptaq_alpha)
    }
}

/// The JSON of the journal hash and the report: the keys in this order (the hash covers it),
/// `gptaq_alpha`, `refit` and `plan` only where they apply.
impl serde::Serialize for Recorded {
    fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        let f = &self.flags;
        let mut m = ser.serialize_struct("Settings", 23)?;
        m.serialize_field("method", &f.method)?;
        if let Some(alpha) = self.gptaq_alpha() {
            m.serialize_field("gptaq_alpha", &alpha)?;
        }
        m.serialize_field("bits", &f.bits)?;
        m.serialize_field("group_size", &f.group_size)?;
        m.serialize_field("act_order", &f.act_order)?;
        m.serialize_field("sym", &f.sym)?;
        m.serialize_field("damp", &f.damp)?;
        m.serialize_field("factor_precision", &self.factor_precision)?;
        m.serialize_field("mse", &f.mse)?;
        if f.refit {
            m.serialize_field("refit", &f.refit)?;
        }
        m.serialize_field("true_sequential", &f.true_sequential)?;
        m.serialize_field("nsamples", &f.nsamples)?;
        m.serialize_field("seqlen", &f.seqlen)?;
        m.serialize_field("sparse_attention", &f.sparse_attention)?;
        m.serialize_field("sparse_path", &self.sparse_path)?;
        m.serialize_field("seed", &f.seed)?;
        m.serialize_field("skip", &f.skip)?;
        if !self.plan.is_empty() {
            m.serialize_field("plan", &self.plan)?;
        }
        let calib: Vec<String> = self
            .calib
            .iter()
            .map(|c| format!("{}:{}", c.path, c.weight))
            .collect();
        m.serialize_field("calib", &calib)?;
        m.serialize_field("dtype", &format!("{:?}", self.dtype).to_lowercase())?;
        m.serialize_field("device_kind", self.device_kind)?;
        m.serialize_field("batch", &f.batch)?;
        let load_hessians = f.load_hessians.as_ref().map(|p| p.display().to_string());
        m.serialize_field("load_hessians", &load_hessians)?;
        m.end()
    }
}

/// How a recorded setting (a key of [`Recorded`]'s JSON) is named in messages: by its flag.
pub fn flag_name(key: &str) -> &str {
    match key {
        "method" => "--method",
        "gptaq_alpha" => "--gptaq-alpha",
        "bits" => "--bits",
        "group_size" => "--group-size",
        "act_order" => "--act-order",
        "sym" => "symmetric (--asym)",
        "damp" => "--damp",
        "mse" => "the MSE search (--no-mse)",
        "refit" => "--refit",
        "true_sequential" => "true-sequential (--no-true-sequential)",
        "nsamples" => "--nsamples",
        "seqlen" => "--seqlen",
        "seed" => "--seed",
        "skip" => "--skip",
        "plan" => "--plan",
        "calib" => "--calib",
        "dtype" => "--dtype",
        "device_kind" => "the device (--device)",
        "batch" => "--batch",
        "load_hessians" => "--load-hessians",
        other => other,
    }
}

impl Recorded {
    /// `quantization_config` of the output. `damp_max` and the calibration fields are the run's;
    /// before the run (the engine pre-check) placeholders of the same shape stand in.
    pub fn quantization_config(
        &self,
        plan: &Plan,
        damp_max: f64,
        calib_usage: serde_json::Value,
        calib_sha256: &str,
    ) -> Result<serde_json::Value> {
        let f = &self.flags;
        let meta = self.quantizer_meta(damp_max, calib_usage, calib_sha256);
        // transformers ignores `dynamic`: it needs the quantized modules listed.
        let modules_in_block_to_quantize = (f.engine == Some(Engine::Transformers)
            && plan.any_kept())
        .then(|| plan.quantized().into_iter().map(|(n, _)| n).collect());
        let qc = GptqConfig {
            bits: f.bits.get(),
            group_size: f.group_size,
            sym: f.sym,
            desc_act: f.act_order.desc_act(),
            static_groups: f.act_order.static_groups(),
            format: f.format(),
            damp_percent: f.damp,
            true_sequential: f.true_sequential,
            dynamic: plan.dynamic(&f.skip)?,
            modules_in_block_to_quantize,
            meta,
        };
        Ok(qc.to_json())
    }

    /// `quantization_config.meta`: the tool and the settings that made the output.
    fn quantizer_meta(
        &self,
        damp_max: f64,
        calib_usage: serde_json::Value,
        calib_sha256: &str,
    ) -> serde_json::Value {
        let f = &self.flags;
        let mut meta = serde_json::json!({
            "quantizer": [format!("soar-gptq:{}", env!("CARGO_PKG_VERSION"))],
            "method": f.method,
            "act_order": f.act_order,
            "damp_percent": f.damp,
            "damp_max_used": damp_max,
            "mse": f.mse,
            "true_sequential": f.true_sequential,
            "static_groups": f.act_order.static_groups(),
            "nsamples": f.nsamples,
            "seqlen": f.seqlen,
            "seed": f.seed,
            "engine": f.engine.map_or("none", Engine::name),
            "calibration": calib_usage,
            "calibration_sha256": calib_sha256,
        });
        if let Some(alpha) = self.gptaq_alpha() {
            meta["gptaq_alpha"] = serde_json::json!(alpha);
        }
        // Recorded where it mattered: a mode chosen by hand, or windows long enough for InfLLM-v2.
        if self.sparse_path || f.sparse_attention != SparseAttention::Auto {
            meta["sparse_attention"] = serde_json::json!(f.sparse_attention);
            meta["sparse_path"] = serde_json::json!(self.sparse_path);
        }
        if f.refit {
            meta["refit"] = serde_json::json!(true);
        }
        if self.factor_precision == FactorPrecision::F32 {
            meta["factor_precision"] = serde_json::json!("f32");
        }
        meta
    }
}
