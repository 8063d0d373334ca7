//! `quantize`: the layer-by-layer GPTQ pipeline (docs/decisions.md: What is quantized, Hessians
//! follow inputs, Calibration, Safety of results; the algorithm in docs/algorithm.md).
//!
//! Embed the calibration windows; then for each decoder layer, for each true-sequential subset
//! ([q, k, v, gate] → [o] → [gate, up] → [down]) run the layer up to that subset's input while
//! accumulating one Hessian per distinct input, solve each Linear, and put the dequantized
//! weights back so later subsets and the next layer see the quantized model. Each finished layer
//! is written to a journal inside `<out>.partial` (its packed tensors and report rows, with hashes
//! of everything that determines it), so `--resume` can continue after a crash; the sharded GPTQ
//! checkpoint is streamed from the journal while the next layers compute (`stream.rs`), then the
//! config and side files are added and the folder renamed into place.

mod card;
mod hashes;
mod journal;
mod layers;
pub mod plan;
mod report;
pub mod stages;
mod stream;

use crate::calib::{self, CalibSpec, ChatFormat, SeqLen};
use crate::checkpoint::guard::{self, InputPath};
use crate::checkpoint::writer::{self, OutputDir, TensorSpec};
use crate::checkpoint::{Checkpoint, Dtype};
use crate::engine::{self, config::ConfigEdits, Engine};
use crate::format::quantized::GptqConfig;
use crate::gptq::QuantParams;
use crate::model::AnyConfig;
use crate::scheme::{ActOrder, GroupSize, QuantFormat};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use journal::Journal;
pub use report::{ModuleRow, QuantizeReport};
use stages::{Preflight, Stages};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Gptq,
    /// GPTQ on GPTAQ's asymmetric objective: the full-precision model's inputs as the target
    /// (docs/algorithm.md, GPTAQ).
    Gptaq,
    Rtn,
}

impl Method {
    /// Whether the method calibrates (Hessians from the model's inputs).
    pub fn uses_hessians(self) -> bool {
        self != Method::Rtn
    }
}

#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    pub model: String,
    pub revision: Option<String>,
    pub calib: Vec<CalibSpec>,
    pub out: PathBuf,
    pub bits: u8,
    pub group_size: GroupSize,
    pub act_order: ActOrder,
    pub sym: bool,
    pub damp: f64,
    pub nsamples: usize,
    /// Each window's length: one, or a log-uniform mix (`--seqlen MIN..MAX`).
    pub seqlen: SeqLen,
    /// When MiniCPM-SALA's sparse layers run InfLLM-v2 (`--sparse-attention`).
    pub sparse_attention: crate::model::SparseAttention,
    pub seed: u64,
    pub skip: Vec<String>,
    /// Per-module bits and group sizes (`--plan`: a JSON file with GPTQModel `dynamic` rules).
    pub plan: Option<PathBuf>,
    /// Accept `--plan` rules that decide no module (else they are refused).
    pub allow_unmatched_rules: bool,
    pub device: Device,
    pub dtype: DType,
    pub true_sequential: bool,
    pub mse: bool,
    /// Refit the group scales by least squares under the Hessian once the codes are fixed.
    pub refit: bool,
    pub save_hessians: Option<PathBuf>,
    /// Solve with Hessians saved by an earlier `--save-hessians` run instead of calibrating.
    pub load_hessians: Option<PathBuf>,
    pub resume: bool,
    pub force: bool,
    pub method: Method,
    /// GPTAQ's share of the asymmetric correction (`--gptaq-alpha`).
    pub gptaq_alpha: f64,
    /// Calibration windows per forward batch.
    pub batch: usize,
    /// The Hessians' factorization precision (`--factor-precision`; `Auto` is resolved for the
    /// device by [`resolve_factor_precision`] before the run).
    pub factor_precision: crate::scheme::FactorPrecision,
    /// Caps on the GPU memory and the host memory (GB) the activations may use
    /// (`--max-gpu-memory`, `--max-host-memory`; docs/algorithm.md, Streaming the calibration).
    pub max_gpu_memory: Option<f64>,
    pub max_host_memory: Option<f64>,
    pub shard_bytes: u64,
    /// Stop (with an error) after this many layers: for testing `--resume`.
    pub stop_after_layers: Option<usize>,
    /// The serving engine the output is written for and checked against (`None`: no engine's
    /// rules, no check).
    pub engine: Option<Engine>,
    /// Score the source and the output on the embedded evaluation text before committing.
    pub verify: bool,
}

impl QuantizeOptions {
    /// The layout the output is written in: symmetric zeros fit GPTQ v1 (what every engine
    /// reads); asymmetric ones may be 0, which only v2 stores.
    pub fn layout(&self) -> QuantFormat {
        if self.sym {
            QuantFormat::GptqV1
        } else {
            QuantFormat::GptqV2
        }
    }
}

/// Settings that determine the output; hashed into the journal and recorded in the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Settings {
    pub method: Method,
    /// GPTAQ's share of the correction (only with `--method gptaq`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gptaq_alpha: Option<f64>,
    pub bits: u8,
    pub group_size: GroupSize,
    pub act_order: ActOrder,
    pub sym: bool,
    pub damp: f64,
    /// f64 or f32 (`--factor-precision`, resolved for the device).
    pub factor_precision: crate::scheme::FactorPrecision,
    pub mse: bool,
    /// Least-squares scale refit after the solve (`--refit`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub refit: bool,
    pub true_sequential: bool,
    pub nsamples: usize,
    pub seqlen: SeqLen,
    /// `--sparse-attention`, and whether the sparse layers ran InfLLM-v2 on some window.
    pub sparse_attention: crate::model::SparseAttention,
    pub sparse_path: bool,
    pub seed: u64,
    pub skip: Vec<String>,
    /// What `--plan` changes: `module=bits/group` or `module=keep` for every Linear it moves
    /// off the default scheme (empty without `--plan`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub plan: Vec<String>,
    pub calib: Vec<String>,
    pub dtype: String,
    pub device_kind: &'static str,
    /// Calibration windows per forward batch: it sets the order in which XᵀX sums, so the bits
    /// of the output depend on it.
    pub batch: usize,
    /// Hessians loaded from this folder instead of calibrating (`--load-hessians`).
    pub load_hessians: Option<String>,
}

/// Peak resident memory of this process in bytes (VmHWM), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Every path `quantize` reads besides the model: calibration files and folders, saved Hessians.
fn side_inputs(opts: &QuantizeOptions) -> Vec<InputPath> {
    let mut v: Vec<InputPath> = opts
        .calib
        .iter()
        .filter(|c| c.path != "default")
        .map(|c| InputPath::new("--calib", &c.path))
        .collect();
    v.extend(
        opts.load_hessians
            .iter()
            .map(|d| InputPath::new("--load-hessians", d)),
    );
    v.extend(opts.plan.iter().map(|p| InputPath::new("--plan", p)));
    v
}

/// What `--save-hessians` and its files may not be: the inputs, `--out` and its partial folder.
fn hessian_guard(opts: &QuantizeOptions, inputs: &[InputPath]) -> Vec<InputPath> {
    let mut all = inputs.to_vec();
    all.push(InputPath::new("--out", &opts.out));
    all.push(InputPath::new("--out", writer::partial_path(&opts.out)));
    all
}

/// `--save-hessians` is an output too: it may not alias an input or `--out`, and an existing
/// folder that holds files is written into only with `--force` (or `--resume`, which continues
/// the run that filled it).
fn check_hessian_dir(dir: &Path, opts: &QuantizeOptions, inputs: &[InputPath]) -> Result<()> {
    guard::check_output("--save-hessians", dir, &[], &hessian_guard(opts, inputs))?;
    if let Some(m) = std::fs::metadata(dir).ok().filter(|m| !m.is_dir()) {
        bail!(
            "--save-hessians {} is {}, not a folder: give a folder for the Hessian files (it is \
             created if missing)",
            dir.display(),
            if m.is_file() {
                "a file"
            } else {
                "a device, FIFO or socket"
            }
        );
    }
    if dir.exists() && !opts.force && !opts.resume {
        let used = std::fs::read_dir(dir)
            .with_context(|| format!("cannot list --save-hessians {}", dir.display()))?
            .next()
            .is_some();
        if used {
            bail!(
                "--save-hessians {} already holds files: pass --force to write over them, or \
                 choose an empty or new folder",
                dir.display()
            );
        }
    }
    Ok(())
}

pub fn quantize(opts: &QuantizeOptions) -> Result<QuantizeReport> {
    let t0 = Instant::now();
    // The output is checked against the inputs before anything is read or downloaded (for a
    // hub model, against its folder in the cache); again below with the resolved files.
    let mut inputs = side_inputs(opts);
    if let Some(repo_dir) = crate::source::cache_repo_dir(&opts.model) {
        inputs.push(InputPath::new("--model", repo_dir));
    } else {
        inputs.push(InputPath::new("--model", &opts.model));
    }
    guard::check_output(
        "--out",
        &opts.out,
        &[writer::partial_path(&opts.out)],
        &inputs,
    )?;
    if let Some(dir) = &opts.save_hessians {
        check_hessian_dir(dir, opts, &inputs)?;
    }
    let src = crate::source::resolve(&opts.model, opts.revision.as_deref())?;
    inputs.extend(guard::model_inputs("--model", &src.dir));
    if let Some(q) = crate::format::quantized::read_quant_info(&src.dir)? {
        bail!(
            "--model {} is already quantized ({}-bit {}, settings in {}): quantize needs the \
             16-bit source checkpoint; `eval-ppl --compare` scores this one and `pack-marlin` \
             repacks it",
            src.description,
            q.bits,
            q.format.checkpoint_format(),
            q.source.display()
        );
    }
    let mut cfg = AnyConfig::from_file(&src.dir.join("config.json"))?;
    cfg.set_sparse_attention(opts.sparse_attention)?;
    let ck = Checkpoint::open(&src.dir)?;
    ck.validate_exact(&cfg.expected_tensors())?;
    // Every weight finite and the shards' SHA-256, beside the setup and the first layers.
    let mut source_checks = journal::SourceChecks::start(&src.dir);
    let tok_path = src.dir.join("tokenizer.json");
    crate::checkpoint::guard::regular_file(&tok_path, "tokenizer")?;
    let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| anyhow!("cannot load {}: {e}", tok_path.display()))?;

    // Settings are checked before any heavy work.
    let quant = QuantParams {
        bits: opts.bits,
        group_size: opts.group_size,
        sym: opts.sym,
        mse: opts.mse,
    };
    quant.validate().context("invalid quantization settings")?;
    if ![2, 3, 4, 8].contains(&opts.bits) {
        bail!(
            "--bits {} cannot be packed in the GPTQ format this tool writes: use 2, 3, 4 or 8",
            opts.bits
        );
    }
    cfg.check_length(opts.seqlen.max())
        .with_context(|| format!("--seqlen {} is too long for this model", opts.seqlen))?;
    if opts.load_hessians.is_some() && opts.method == Method::Rtn {
        bail!("--load-hessians has no effect with --method rtn, which uses no Hessians");
    }
    let rules = match &opts.plan {
        Some(p) => crate::format::quantized::read_plan_rules(p)?,
        None => vec![],
    };
    let default_scheme = plan::Scheme {
        bits: opts.bits,
        group_size: opts.group_size,
    };
    let unmatched = if opts.allow_unmatched_rules {
        plan::Unmatched::Allow
    } else {
        plan::Unmatched::Refuse
    };
    let plan = plan::Plan::build(&cfg, &opts.skip, &rules, default_scheme, unmatched)?;
    if plan.unused_rules > 0 {
        eprintln!(
            "note: {} --plan rule(s) change nothing (accepted with --allow-unmatched-rules): {}{}",
            plan.unused_rules,
            plan.unused_reasons.join("; "),
            if plan.unused_rules > plan.unused_reasons.len() {
                "; ..."
            } else {
                ""
            }
        );
    }
    let layout = opts.layout();
    let settings = Settings {
        method: opts.method,
        gptaq_alpha: (opts.method == Method::Gptaq).then_some(opts.gptaq_alpha),
        bits: opts.bits,
        group_size: opts.group_size,
        act_order: opts.act_order,
        sym: opts.sym,
        damp: opts.damp,
        factor_precision: opts.factor_precision,
        mse: opts.mse,
        refit: opts.refit,
        true_sequential: opts.true_sequential,
        nsamples: opts.nsamples,
        seqlen: opts.seqlen,
        sparse_attention: opts.sparse_attention,
        sparse_path: cfg.sparse_runs(opts.seqlen.max()),
        batch: opts.batch,
        seed: opts.seed,
        skip: opts.skip.clone(),
        plan: if rules.is_empty() {
            vec![]
        } else {
            plan.overrides()
        },
        calib: opts
            .calib
            .iter()
            .map(|c| format!("{}:{}", c.path, c.weight))
            .collect(),
        dtype: format!("{:?}", opts.dtype).to_lowercase(),
        device_kind: if opts.device.is_cpu() { "cpu" } else { "cuda" },
        load_hessians: opts.load_hessians.as_ref().map(|p| p.display().to_string()),
    };

    // The engine check on the output as it will be written, before any work: a checkpoint the
    // engine cannot load is refused now rather than after the run.
    let src_config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(src.dir.join("config.json"))
            .with_context(|| format!("cannot read {}", src.dir.join("config.json").display()))?,
    )
    .with_context(|| {
        format!(
            "{} is not valid JSON",
            src.dir.join("config.json").display()
        )
    })?;
    let specs = output_specs(&cfg, &ck, &plan)?;
    let side = writer::side_files(&src.dir)?;
    if let Some(target) = opts.engine {
        let qc = quantization_config(opts, &settings, &plan, opts.damp, serde_json::json!([]), "")?;
        let (config, _) = output_config(&src_config, &qc, opts.engine);
        let view = planned_view(&src.dir, &config, &specs, &side);
        let check = engine::check(&view, target, false)?;
        if !check.loads {
            bail!(
                "{}\nNothing was quantized. Change the settings, pick the engine you serve with \
                 (--engine sglang|vllm|transformers), or pass --engine none to write a checkpoint \
                 for evaluation only",
                check.error_text(&format!(
                    "the output of these settings ({})",
                    opts.out.display()
                ))
            );
        }
    }

    // The output folder (and its lock) before the heavy work: an existing --out, resumable work
    // or a concurrent run is refused now.
    let mut out = if opts.resume {
        OutputDir::reopen(&opts.out, opts.force, &inputs)?
    } else {
        OutputDir::create(&opts.out, opts.force, &inputs)?
    };
    // A resumed run never deletes the partial folder it was given, even when it refuses it.
    out.keep_on_failure(opts.resume);

    let preflight = Preflight::estimate(
        &cfg.shape_config(),
        opts.nsamples,
        opts.seqlen,
        opts.batch,
        opts.dtype,
        &opts.device,
        opts.true_sequential,
        opts.method,
        opts.mse,
    );
    eprintln!("{}", preflight.line());
    // Refused now rather than dying midway: less memory than one layer and one batch need, or
    // more disk than the output's filesystem has.
    let memory = memory_plan(&preflight, opts)?;
    eprintln!("{}", memory.line());
    let spill = if memory.residency.states == layers::store::Tier::Disk {
        memory.states_bytes
    } else {
        0
    };
    if !opts.resume || spill > 0 {
        let quantized: u64 = specs
            .iter()
            .filter(|s| s.dtype == Dtype::I32 || s.name.ends_with(".scales"))
            .map(TensorSpec::nbytes)
            .sum();
        let total: u64 = specs.iter().map(TensorSpec::nbytes).sum();
        guard::check_disk_space(
            "--out",
            out.path(),
            total + quantized + spill,
            &format!(
                "{:.2} GB of shards, {:.2} GB of journal until the run ends and {:.2} GB of \
                 hidden states spilled to disk",
                total as f64 / 1e9,
                quantized as f64 / 1e9,
                spill as f64 / 1e9
            ),
        )
        .map_err(|e| {
            if spill == 0 {
                return e;
            }
            e.context(format!(
                "the hidden states of {} calibration tokens do not fit in memory and would \
                 spill to disk: lower --nsamples (now {}) or --seqlen (now {}), or give the run \
                 more memory (--max-host-memory, --max-gpu-memory)",
                preflight.tokens, opts.nsamples, opts.seqlen
            ))
        })?;
    }

    // Calibration.
    let chat = ChatFormat::from_model_dir(&src.dir)?;
    let sources = calib::load_sources(&opts.calib, &chat)?;
    let calib = calib::build_windows(
        &sources,
        &tokenizer,
        cfg.vocab_size(),
        opts.nsamples,
        opts.seqlen,
        opts.seed,
    )?;

    // Hashes that pin down the output, for the journal and the report.
    // The source shards' hashes join them when the checks finish: before a resumed run
    // compares its journal, or before a fresh run first saves one.
    let mut hashes = hashes::Hashes::new(&src.dir, BTreeMap::new(), &settings, &calib.sha256)?;
    if opts.resume {
        if let Some(sums) = source_checks.finish()? {
            hashes.source_sha256 = sums;
        }
    }

    let jdir = out.path().join("journal");
    let journal_exists = jdir.join("journal.json").is_file();
    if opts.resume && !journal_exists {
        // Stopped before the first layer was recorded (or while it was): nothing to replay.
        eprintln!(
            "note: {} holds no finished layer yet; --resume starts from the first layer",
            out.path().display()
        );
    }
    let mut journal = if opts.resume && journal_exists {
        let j = Journal::load(&jdir)?;
        j.check_layers(&jdir, cfg.num_hidden_layers())?;
        j.check_matches(&hashes, &settings)?;
        j
    } else {
        std::fs::create_dir_all(&jdir)
            .with_context(|| format!("cannot create {}", jdir.display()))?;
        Journal::new(hashes.clone(), &settings)?
    };
    if let Some(dir) = &opts.save_hessians {
        check_hessian_dir(dir, opts, &inputs)?;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create --save-hessians folder {}", dir.display()))?;
    }

    #[cfg(feature = "cuda")]
    if opts.device.is_cuda() {
        crate::kernels::cuda::keep_pool_memory(&opts.device)?;
    }
    let mut stages = Stages {
        setup: t0.elapsed().as_secs_f64(),
        ..Stages::default()
    };
    // The layer loop, with the shards streamed beside it (stream.rs).
    let out_dir = out.path().to_path_buf();
    let (result, streamed, t_write) = std::thread::scope(|s| {
        let (feed, rx) = stream::channel();
        let (specs, ck_ref, jdir_ref) = (&specs, &ck, &jdir);
        let writer = s.spawn(move || {
            stream::write_stream(&out_dir, specs, opts.shard_bytes, ck_ref, jdir_ref, rx)
        });
        let result = layers::LayerRun {
            opts,
            cfg: &cfg,
            ck: &ck,
            windows: &calib.windows,
            plan: &plan,
            layout,
            quant,
            jdir: &jdir,
            feed: &feed,
            residency: memory.residency,
            spill: out.path().join("spill"),
            inputs: &hessian_guard(opts, &inputs),
        }
        .run(&mut journal, &mut stages, &mut source_checks);
        drop(feed);
        let t_write = Instant::now();
        let streamed = writer
            .join()
            .map_err(|_| anyhow!("the shard writer thread panicked"))
            .and_then(|r| r);
        (result, streamed, t_write)
    });
    let result = match (result, &streamed) {
        // The loop stopped because the writer had: the writer's error is the one to report.
        (Err(e), Err(w)) if e.root_cause().is::<stream::WriterStopped>() => Err(anyhow!("{w:#}")),
        (r, _) => r,
    };
    let result = result.and_then(|()| {
        if let Some(sums) = source_checks.finish()? {
            journal.hashes.source_sha256 = sums;
            journal.save(&jdir)?;
        }
        Ok(())
    });
    if let Err(e) = result {
        // A damaged source fails with what the checks found, whatever the layers ran into.
        source_checks.finish()?;
        if !journal.layers.is_empty() {
            out.keep_on_failure(true);
            return Err(e.context(format!(
                "{} finished layer(s) are kept in {}: rerun the same command with --resume to continue",
                journal.layers.len(),
                out.path().display()
            )));
        }
        return Err(e);
    }
    stages.source_checks = source_checks.seconds;
    stages.source_checks_wait = source_checks.waited;
    let hashes = journal.hashes.clone();

    // Every layer is in the journal from here on: whatever fails while the output is written
    // (a full disk, say), the partial folder is kept and --resume writes it.
    out.keep_on_failure(true);
    let kept = |e: anyhow::Error, dir: &Path| {
        e.context(format!(
            "all {} layers are finished and kept in {}: rerun the same command with --resume to \
             write the output",
            cfg.num_hidden_layers(),
            dir.display()
        ))
    };
    let finish = (|| -> Result<QuantizeReport> {
        // The shards were streamed during the loop; the rest of the checkpoint now.
        let shards = streamed?;
        let pb = crate::progress::bar(1, "write");
        let damp_max = journal
            .layers
            .iter()
            .flat_map(|l| l.rows.iter().filter(|r| r.quantized).map(|r| r.damp))
            .fold(0.0, f64::max);
        let qc = quantization_config(
            opts,
            &settings,
            &plan,
            damp_max,
            serde_json::to_value(&calib.usage)?,
            &calib.sha256,
        )?;
        let (config, config_edits) = output_config(&src_config, &qc, opts.engine);
        assemble(&mut out, &src.dir, &shards, &config, &side)?;
        // The engine check again, on the files as written.
        let engine_check = match opts.engine {
            Some(target) => {
                let mut c = engine::check_dir(out.path(), target, false)?;
                c.serve = c.serve_at(&opts.out.display().to_string());
                if !c.loads {
                    bail!(
                        "{}\nThe output was not committed (this is a bug in soar-gptq: the check \
                         before the run passed; please report it)",
                        c.error_text(&out.path().display().to_string())
                    );
                }
                Some(c)
            }
            None => None,
        };
        pb.finish_and_clear();
        let verify = if opts.verify {
            let popts = crate::eval::PplOptions {
                seqlen: opts.seqlen.min().min(512),
                max_windows: Some(16),
                bos: false,
                dtype: opts.dtype,
                device: opts.device.clone(),
                batch: opts.batch,
                sparse_attention: opts.sparse_attention,
                text_name: "the built-in evaluation text".to_string(),
            };
            let mut c = crate::eval::compare(
                &src.dir,
                &[out.path().to_path_buf()],
                crate::eval::DEFAULT_EVAL_TEXT,
                &popts,
            )?;
            c.reference_model = src.description.clone();
            c.compared[0].model = opts.out.display().to_string();
            eprintln!(
                "verify: ppl {:.4} (source) → {:.4} (quantized), mean KL {:.5}, top-1 agreement {:.2}%",
                c.reference.ppl,
                c.compared[0].ppl,
                c.compared[0].mean_kl,
                100.0 * c.compared[0].top1_agreement
            );
            Some(c)
        } else {
            None
        };
        let mut report = QuantizeReport {
            tool: format!("soar-gptq {}", env!("CARGO_PKG_VERSION")),
            model: src.description.clone(),
            settings,
            calibration: calib.usage.clone(),
            calibration_sha256: calib.sha256.clone(),
            hashes,
            modules: journal.layers.iter().flat_map(|l| l.rows.clone()).collect(),
            seconds: BTreeMap::new(),
            total_seconds: 0.0,
            peak_rss_bytes: None,
            verify: verify.as_ref().map(serde_json::to_value).transpose()?,
            output: opts.out.display().to_string(),
            engine: opts.engine.map_or("none", Engine::name).to_string(),
            config_edits,
            copied_from_source: side.clone(),
            engine_check,
            stages: None,
            preflight: None,
            gpu_memory: None,
        };
        writer::write_file(
            &out.path().join("README.md"),
            card::model_card(&report, verify.as_ref()).as_bytes(),
        )?;
        report.seconds.insert(
            "layers".into(),
            journal.layers.iter().map(|l| l.seconds).sum(),
        );
        report
            .seconds
            .insert("write".into(), t_write.elapsed().as_secs_f64());
        report.stages = Some(stages);
        report.preflight = Some(preflight);
        report.gpu_memory =
            stages::gpu_memory(&opts.device)?.map(|(used, reserved, now)| report::GpuMemory {
                pool_peak_used_bytes: used,
                pool_peak_reserved_bytes: reserved,
                in_use_at_end_bytes: now,
            });
        report.total_seconds = t0.elapsed().as_secs_f64();
        report.peak_rss_bytes = peak_rss_bytes();
        writer::write_file(
            &out.path().join("quantize_report.json"),
            serde_json::to_string_pretty(&report)?.as_bytes(),
        )?;
        Ok(report)
    })();
    let report = match finish {
        Ok(r) => r,
        Err(e) => return Err(kept(e, out.path())),
    };
    // The journal goes last: until the output is in place, a crash resumes from it.
    let partial_dir = out.path().to_path_buf();
    let final_dir = out.commit().map_err(|e| kept(e, &partial_dir))?;
    crate::fault::point("the output is in place, its journal not yet removed");
    let done_journal = final_dir.join("journal");
    std::fs::remove_dir_all(&done_journal)
        .with_context(|| format!("cannot remove {}", done_journal.display()))?;
    Ok(report)
}

/// `--factor-precision auto` for `device`: f64 on the CPU and on GPUs whose FP64 rate is at
/// least 1/8 of their FP32 rate (A100, H100, H200, B200), f32 on the others (RTX, L40S,
/// workstation Blackwell cards: 1/32 to 1/64), where the f64 factorizations of a 9.5B model
/// would take minutes.
pub fn resolve_factor_precision(
    p: crate::scheme::FactorPrecision,
    device: &Device,
) -> Result<crate::scheme::FactorPrecision> {
    use crate::scheme::FactorPrecision as F;
    if p != F::Auto {
        return Ok(p);
    }
    if device.is_cpu() {
        return Ok(F::F64);
    }
    #[cfg(feature = "cuda")]
    {
        let ratio = crate::kernels::cuda::fp32_to_fp64_ratio(device)?;
        Ok(if ratio > 8 { F::F32 } else { F::F64 })
    }
    #[cfg(not(feature = "cuda"))]
    Ok(F::F64)
}

/// Where the run keeps its activations, from the preflight's estimate and the memory the
/// device (and on a GPU, the host) offers; refused when not even one layer and one batch fit.
fn memory_plan(p: &Preflight, opts: &QuantizeOptions) -> Result<stages::MemoryPlan> {
    let gb = |x: Option<f64>| x.map(|g| (g * 1e9) as u64);
    let cuda = opts.device.is_cuda();
    let device_free = if cuda {
        #[cfg(feature = "cuda")]
        {
            crate::kernels::cuda::memory_free(&opts.device).ok()
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    } else {
        host_available_bytes()
    };
    let (max_device, max_host) = if cuda {
        (gb(opts.max_gpu_memory), gb(opts.max_host_memory))
    } else {
        (gb(opts.max_host_memory), None)
    };
    stages::MemoryPlan::new(
        p,
        cuda,
        device_free,
        max_device,
        host_available_bytes(),
        max_host,
    )
    .with_context(|| {
        format!(
            "{} calibration tokens ({} windows, --seqlen {}, --batch {}) do not fit",
            p.tokens, opts.nsamples, opts.seqlen, opts.batch
        )
    })
}

/// `MemAvailable` of /proc/meminfo, where there is one.
fn host_available_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `quantization_config` of the output. `damp_max` and the calibration fields are the run's;
/// before the run (the engine pre-check) placeholders of the same shape stand in.
fn quantization_config(
    opts: &QuantizeOptions,
    s: &Settings,
    plan: &plan::Plan,
    damp_max: f64,
    calib_usage: serde_json::Value,
    calib_sha256: &str,
) -> Result<serde_json::Value> {
    let mut meta = serde_json::json!({
        "quantizer": [format!("soar-gptq:{}", env!("CARGO_PKG_VERSION"))],
        "method": s.method,
        "act_order": s.act_order,
        "damp_percent": opts.damp,
        "damp_max_used": damp_max,
        "mse": opts.mse,
        "true_sequential": opts.true_sequential,
        "static_groups": opts.act_order.static_groups(),
        "nsamples": opts.nsamples,
        "seqlen": opts.seqlen,
        "seed": opts.seed,
        "engine": opts.engine.map_or("none", Engine::name),
        "calibration": calib_usage,
        "calibration_sha256": calib_sha256,
    });
    if let Some(alpha) = s.gptaq_alpha {
        meta["gptaq_alpha"] = serde_json::json!(alpha);
    }
    // Recorded where it mattered: a mode chosen by hand, or windows long enough for InfLLM-v2.
    if s.sparse_path || s.sparse_attention != crate::model::SparseAttention::Auto {
        meta["sparse_attention"] = serde_json::json!(s.sparse_attention);
        meta["sparse_path"] = serde_json::json!(s.sparse_path);
    }
    if opts.refit {
        meta["refit"] = serde_json::json!(true);
    }
    if s.factor_precision == crate::scheme::FactorPrecision::F32 {
        meta["factor_precision"] = serde_json::json!("f32");
    }
    // transformers ignores `dynamic`: it needs the quantized modules listed.
    let modules_in_block_to_quantize = (opts.engine == Some(Engine::Transformers)
        && plan.any_kept())
    .then(|| plan.quantized().into_iter().map(|(n, _)| n).collect());
    let qc = GptqConfig {
        bits: opts.bits,
        group_size: opts.group_size,
        sym: opts.sym,
        desc_act: opts.act_order.desc_act(),
        static_groups: opts.act_order.static_groups(),
        format: opts.layout(),
        damp_percent: opts.damp,
        true_sequential: opts.true_sequential,
        dynamic: plan.dynamic(&opts.skip)?,
        modules_in_block_to_quantize,
        meta,
    };
    Ok(qc.to_json())
}

/// The output's tensors in the order they are written: the source's, with every quantized
/// Linear replaced by its GPTQ set (`qweight`, `qzeros`, `scales`, `g_idx`).
fn output_specs(cfg: &AnyConfig, ck: &Checkpoint, plan: &plan::Plan) -> Result<Vec<TensorSpec>> {
    let quantized: BTreeMap<String, plan::Scheme> = plan.quantized().into_iter().collect();
    let mut specs = vec![];
    for (name, shape) in cfg.expected_tensors() {
        let prefix = name.strip_suffix(".weight").unwrap_or(&name);
        if let Some(scheme) = quantized.get(prefix) {
            let (vals, words) = crate::format::pack::block_shape(scheme.bits)?;
            let (n, k) = (shape[0], shape[1]);
            let g = scheme.group_size.count(k);
            specs.push(TensorSpec::new(
                format!("{prefix}.qweight"),
                Dtype::I32,
                vec![k / vals * words, n],
            ));
            specs.push(TensorSpec::new(
                format!("{prefix}.qzeros"),
                Dtype::I32,
                vec![g, n / vals * words],
            ));
            specs.push(TensorSpec::new(
                format!("{prefix}.scales"),
                Dtype::F16,
                vec![g, n],
            ));
            specs.push(TensorSpec::new(
                format!("{prefix}.g_idx"),
                Dtype::I32,
                vec![k],
            ));
        } else {
            let e = ck.get(&name).expect("validated");
            specs.push(TensorSpec::new(name.clone(), e.dtype, shape));
        }
    }
    Ok(specs)
}

/// The output's config.json: the source's as the engine needs it (see
/// [`engine::config::engine_config`]) with `quantization_config`.
fn output_config(
    src_config: &serde_json::Value,
    qc: &serde_json::Value,
    engine: Option<Engine>,
) -> (serde_json::Value, ConfigEdits) {
    let (mut config, edits) = engine::config::engine_config(src_config, engine, "bfloat16");
    config["quantization_config"] = qc.clone();
    (config, edits)
}

/// What the engine will read of the output, before a single layer runs: the config and tensor
/// names it will have, and the side files it will carry.
fn planned_view(
    src_dir: &Path,
    config: &serde_json::Value,
    specs: &[TensorSpec],
    side: &[String],
) -> engine::FolderView {
    let mut files: std::collections::BTreeSet<String> = side.iter().cloned().collect();
    for f in [
        "config.json",
        "quantize_config.json",
        crate::checkpoint::reader::INDEX_FILE,
        "README.md",
        writer::MANIFEST_FILE,
    ] {
        files.insert(f.to_string());
    }
    let read_json = |name: &str| -> Option<serde_json::Value> {
        side.iter().any(|s| s == name).then(|| {
            serde_json::from_str(&std::fs::read_to_string(src_dir.join(name)).ok()?).ok()
        })?
    };
    engine::FolderView {
        label: "the output".to_string(),
        config: config.clone(),
        quantize_config: config.get("quantization_config").cloned(),
        tokenizer_config: read_json("tokenizer_config.json"),
        tensors: specs
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    engine::TensorView {
                        dtype: s.dtype,
                        shape: s.shape.clone(),
                    },
                )
            })
            .collect(),
        files,
        texts: side
            .iter()
            .filter(|f| f.ends_with(".py"))
            .filter_map(|f| {
                let b = std::fs::read(src_dir.join(f)).ok()?;
                Some((f.clone(), String::from_utf8_lossy(&b).into_owned()))
            })
            .collect(),
        dynamic_order: vec![],
    }
}

/// Completes the checkpoint in `out` around the shards the stream wrote: their hashes for the
/// manifest, config.json, quantize_config.json, and the source's side files copied byte for
/// byte.
fn assemble(
    out: &mut OutputDir,
    src_dir: &Path,
    shards: &[writer::HashedFile],
    config: &serde_json::Value,
    side: &[String],
) -> Result<()> {
    let dir = out.path().to_path_buf();
    out.record_hashed(shards);
    writer::write_file(
        &dir.join("config.json"),
        serde_json::to_string_pretty(config)?.as_bytes(),
    )?;
    writer::write_file(
        &dir.join("quantize_config.json"),
        serde_json::to_string_pretty(&config["quantization_config"])?.as_bytes(),
    )?;
    out.copy_from_source(src_dir, side)?;
    Ok(())
}
