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
pub mod settings;
pub mod stages;
mod stream;

use crate::calib::{self, CalibSet, CalibSpec, ChatFormat};
use crate::checkpoint::guard::{self, InputPath};
use crate::checkpoint::{files, manifest, output_dir, Checkpoint, Dtype, OutputDir, TensorSpec};
use crate::engine::{self, config::ConfigEdits, Engine};
use crate::model::AnyConfig;
use crate::source::ModelSource;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use hashes::Hashes;
use journal::{Journal, SourceChecks};
use layers::store::Residency;
use plan::Plan;
pub use report::{ModuleRow, QuantizeReport};
pub use settings::{Compute, Method, Recorded, Settings};
use stages::{MemoryPlan, Preflight, StageSeconds};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenizers::Tokenizer;

/// Peak resident memory of this process in bytes (VmHWM), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Every path `quantize` reads besides the model: calibration files and folders, saved Hessians.
fn side_inputs(s: &Settings, calib: &[CalibSpec]) -> Vec<InputPath> {
    let mut v = calib::input_paths(calib);
    v.extend(
        s.load_hessians
            .iter()
            .map(|d| InputPath::new("--load-hessians", d)),
    );
    v.extend(s.plan.iter().map(|p| InputPath::new("--plan", p)));
    v
}

/// What `--save-hessians` and its files may not be: the inputs, `--out` and its partial folder.
fn hessian_guard(s: &Settings, inputs: &[InputPath]) -> Vec<InputPath> {
    let mut all = inputs.to_vec();
    all.push(InputPath::new("--out", &s.out));
    all.push(InputPath::new("--out", output_dir::partial_path(&s.out)));
    all
}

/// `--save-hessians` is an output too: it may not alias an input or `--out`, and an existing
/// folder that holds files is written into only with `--force` (or `--resume`, which continues
/// the run that filled it).
fn check_hessian_dir(dir: &Path, s: &Settings, inputs: &[InputPath]) -> Result<()> {
    guard::check_output("--save-hessians", dir, &[], &hessian_guard(s, inputs))?;
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
    if dir.exists() && !s.force && !s.resume {
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

/// One run of `quantize`: the settings, what they resolve to, and what the first two phases find
/// (the source and its checkpoint, the plan, the output's planned files). The later phases are its
/// methods, called by [`quantize`] in order.
struct Run<'a> {
    s: &'a Settings,
    compute: Compute,
    /// What no output may be: the source's files, the calibration files, saved Hessians, the
    /// plan.
    inputs: Vec<InputPath>,
    src: ModelSource,
    cfg: AnyConfig,
    ck: Checkpoint,
    tokenizer: Tokenizer,
    plan: Plan,
    /// The settings as the journal hashes them and the report records them.
    settings: Recorded,
    /// The source's config.json, the output's tensors in the order they are written, and the
    /// side files it copies.
    src_config: serde_json::Value,
    specs: Vec<TensorSpec>,
    side: Vec<String>,
}

/// The shard stream's result once the layer loop has ended, and when the loop ended.
struct Streamed {
    shards: Result<Vec<manifest::HashedFile>>,
    t_write: Instant,
}

/// Quantizes `s.source` into `s.out`: resolve and check the inputs, then the settings and the
/// plan, the engine's pre-check, the output folder and the memory plan, the calibration windows
/// and the journal, the layer loop with the shard stream, and the assembled, checked and verified
/// output committed in place.
pub fn quantize(s: &Settings) -> Result<QuantizeReport> {
    let t0 = Instant::now();
    let (run, mut checks) = Run::start(s)?;
    run.check_engine()?;
    let mut out = run.open_output()?;
    let (preflight, memory) = run.plan_memory(&out)?;
    let calib = run.calibrate()?;
    let mut journal = run.open_journal(&out, &calib, &mut checks)?;
    #[cfg(feature = "cuda")]
    if run.compute.device.is_cuda() {
        crate::kernels::memory::keep_pool_memory(&run.compute.device)?;
    }
    let mut stages = StageSeconds {
        setup: t0.elapsed().as_secs_f64(),
        ..StageSeconds::default()
    };
    let streamed = run.quantize_layers(
        &mut out,
        &calib,
        memory.residency,
        &mut journal,
        &mut stages,
        &mut checks,
    )?;
    // Every layer is in the journal from here on: whatever fails while the output is written
    // (a full disk, say), the partial folder is kept and --resume writes it.
    out.keep_on_failure(true);
    let timing = Timing {
        t0,
        t_write: streamed.t_write,
        stages,
        preflight,
    };
    let report = run
        .finish(&mut out, &journal, &calib, streamed.shards, timing)
        .map_err(|e| run.kept(e, out.path()))?;
    run.commit(out)?;
    Ok(report)
}

impl<'a> Run<'a> {
    /// The first two phases: the inputs resolved and checked (the outputs against them, the
    /// source validated), then the settings checked against the model and the plan made; the
    /// source checks start on their own thread.
    fn start(s: &'a Settings) -> Result<(Self, SourceChecks)> {
        let compute = Compute::open(s)?;
        let calib = s.calib_specs()?;
        // The output is checked against the inputs before anything is read or downloaded (for a
        // hub model, against its folder in the cache); again below with the resolved files.
        let mut inputs = side_inputs(s, &calib);
        inputs.push(InputPath::new("--model", s.source.local_path()));
        guard::check_output(
            "--out",
            &s.out,
            &[output_dir::partial_path(&s.out)],
            &inputs,
        )?;
        if let Some(dir) = &s.save_hessians {
            check_hessian_dir(dir, s, &inputs)?;
        }
        let src = s.source.resolve()?;
        inputs.extend(guard::model_inputs("--model", &src.dir));
        let (cfg, ck) = open_source(s, &src)?;
        // Every weight finite and the shards' SHA-256, beside the setup and the first layers.
        let checks = SourceChecks::start(&src.dir);
        let tokenizer = calib::load_tokenizer(&src.dir)?;
        let plan = plan_linears(s, &cfg)?;
        let sparse_path = cfg.sparse_runs(s.seqlen.max());
        let settings = Recorded::new(s, &compute, calib, &plan, sparse_path);
        let src_config = read_config(&src.dir)?;
        let specs = output_specs(&cfg, &ck, &plan)?;
        let side = files::side_files(&src.dir)?;
        let run = Self {
            s,
            compute,
            inputs,
            src,
            cfg,
            ck,
            tokenizer,
            plan,
            settings,
            src_config,
            specs,
            side,
        };
        Ok((run, checks))
    }

    /// The engine check on the output as it will be written, before any work: a checkpoint the
    /// engine cannot load is refused now rather than after the run.
    fn check_engine(&self) -> Result<()> {
        let Some(target) = self.s.engine else {
            return Ok(());
        };
        let qc = self.settings.quantization_config(
            &self.plan,
            self.s.damp,
            serde_json::json!([]),
            "",
        )?;
        let (config, _) = output_config(&self.src_config, &qc, self.s.engine);
        let view = planned_view(&self.src.dir, &config, &self.specs, &self.side);
        let check = engine::check(&view, target, false)?;
        if !check.loads {
            bail!(
                "{}\nNothing was quantized. Change the settings, pick the engine you serve with \
                 (--engine sglang|vllm|transformers), or pass --engine none to write a checkpoint \
                 for evaluation only",
                check.error_text(&format!(
                    "the output of these settings ({})",
                    self.s.out.display()
                ))
            );
        }
        Ok(())
    }

    /// The output folder (and its lock) before the heavy work: an existing --out, resumable
    /// work or a concurrent run is refused now.
    fn open_output(&self) -> Result<OutputDir> {
        let s = self.s;
        let mut out = if s.resume {
            OutputDir::reopen(&s.out, s.force, &self.inputs)?
        } else {
            OutputDir::create(&s.out, s.force, &self.inputs)?
        };
        // A resumed run never deletes the partial folder it was given, even when it refuses it.
        out.keep_on_failure(s.resume);
        Ok(out)
    }

    /// What the run will need and where its activations live. Refused now rather than dying
    /// midway: less memory than one layer and one batch need, or more disk than the output's
    /// filesystem has.
    fn plan_memory(&self, out: &OutputDir) -> Result<(Preflight, MemoryPlan)> {
        let s = self.s;
        let mut preflight = Preflight::estimate(
            &self.cfg.shape_config(),
            s.nsamples,
            s.seqlen,
            s.batch,
            self.compute.dtype,
            &self.compute.device,
            s.true_sequential,
            s.method,
            s.mse,
        );
        let memory = memory_plan(&preflight, s, &self.compute.device);
        if let Ok(m) = &memory {
            preflight.seconds += m.recompute_seconds;
        }
        eprintln!("{}", preflight.line());
        let memory = memory?;
        eprintln!("{}", memory.line());
        self.check_disk(out, &preflight, &memory)?;
        Ok((preflight, memory))
    }

    /// Room on the output's filesystem for the shards, the journal beside them until the run
    /// ends, and the hidden states that spill to disk.
    fn check_disk(
        &self,
        out: &OutputDir,
        preflight: &Preflight,
        memory: &MemoryPlan,
    ) -> Result<()> {
        let spill = if memory.residency.states == layers::store::Tier::Disk {
            memory.states_bytes
        } else {
            0
        };
        if self.s.resume && spill == 0 {
            return Ok(());
        }
        let quantized: u64 = self
            .specs
            .iter()
            .filter(|s| s.dtype == Dtype::I32 || s.name.ends_with(".scales"))
            .map(TensorSpec::nbytes)
            .sum();
        let total: u64 = self.specs.iter().map(TensorSpec::nbytes).sum();
        let what = format!(
            "{:.2} GB of shards, {:.2} GB of journal until the run ends and {:.2} GB of hidden \
             states spilled to disk",
            total as f64 / 1e9,
            quantized as f64 / 1e9,
            spill as f64 / 1e9
        );
        guard::check_disk_space("--out", out.path(), total + quantized + spill, &what).map_err(
            |e| {
                if spill == 0 {
                    return e;
                }
                e.context(format!(
                    "the hidden states of {} calibration tokens do not fit in memory and would \
                     spill to disk: lower --nsamples (now {}) or --seqlen (now {}), or give the \
                     run more memory (--max-host-memory, --max-gpu-memory)",
                    preflight.tokens, self.s.nsamples, self.s.seqlen
                ))
            },
        )
    }

    /// The calibration windows, drawn from the sources by weight.
    fn calibrate(&self) -> Result<CalibSet> {
        let chat = ChatFormat::from_model_dir(&self.src.dir)?;
        let sources = calib::load_sources(&self.settings.calib, &chat)?;
        calib::build_windows(
            &sources,
            &self.tokenizer,
            self.cfg.vocab_size(),
            self.s.nsamples,
            self.s.seqlen,
            self.s.seed,
        )
    }

    /// The journal: a resumed run's, checked against the hashes of everything that determines
    /// the output, or a new one; and the `--save-hessians` folder.
    fn open_journal(
        &self,
        out: &OutputDir,
        calib: &CalibSet,
        checks: &mut SourceChecks,
    ) -> Result<Journal> {
        let s = self.s;
        // The source shards' hashes join the others when the checks finish: before a resumed
        // run compares its journal, or before a fresh run first saves one.
        let mut hashes = Hashes::new(
            &self.src.dir,
            BTreeMap::new(),
            &self.settings,
            &calib.sha256,
        )?;
        if s.resume {
            if let Some(sums) = checks.finish()? {
                hashes.source_sha256 = sums;
            }
        }
        let jdir = journal_dir(out);
        let journal_exists = jdir.join("journal.json").is_file();
        if s.resume && !journal_exists {
            // Stopped before the first layer was recorded (or while it was): nothing to replay.
            eprintln!(
                "note: {} holds no finished layer yet; --resume starts from the first layer",
                out.path().display()
            );
        }
        let journal = if s.resume && journal_exists {
            let j = Journal::load(&jdir)?;
            j.check_layers(&jdir, self.cfg.num_hidden_layers())?;
            j.check_matches(&hashes, &self.settings)?;
            j
        } else {
            std::fs::create_dir_all(&jdir)
                .with_context(|| format!("cannot create {}", jdir.display()))?;
            Journal::new(hashes, &self.settings)?
        };
        if let Some(dir) = &s.save_hessians {
            check_hessian_dir(dir, s, &self.inputs)?;
            std::fs::create_dir_all(dir).with_context(|| {
                format!("cannot create --save-hessians folder {}", dir.display())
            })?;
        }
        Ok(journal)
    }

    /// The layer loop with the shards streamed beside it (stream.rs). A failure keeps the
    /// finished layers for `--resume`; a damaged source fails with what the source checks found,
    /// whatever the layers ran into.
    fn quantize_layers(
        &self,
        out: &mut OutputDir,
        calib: &CalibSet,
        residency: Residency,
        journal: &mut Journal,
        stages: &mut StageSeconds,
        checks: &mut SourceChecks,
    ) -> Result<Streamed> {
        let (result, streamed) = self.layer_loop(out, calib, residency, journal, stages, checks);
        let result = match (result, &streamed.shards) {
            // The loop stopped because the writer had: the writer's error is the one to report.
            (Err(e), Err(w)) if e.root_cause().is::<stream::WriterStopped>() => {
                Err(anyhow!("{w:#}"))
            }
            (r, _) => r,
        };
        let result = result.and_then(|()| {
            if let Some(sums) = checks.finish()? {
                journal.hashes.source_sha256 = sums;
                journal.save(&journal_dir(out))?;
            }
            Ok(())
        });
        if let Err(e) = result {
            checks.finish()?;
            if !journal.layers.is_empty() {
                out.keep_on_failure(true);
                let hint = out_of_memory_hint(&e, self.s.max_gpu_memory);
                return Err(e.context(format!(
                    "{} finished layer(s) are kept in {}: rerun the same command with --resume \
                     to continue{}",
                    journal.layers.len(),
                    out.path().display(),
                    hint
                )));
            }
            return Err(e);
        }
        stages.source_checks = checks.seconds;
        stages.source_checks_wait = checks.waited;
        Ok(streamed)
    }

    /// The layers (`layers::LayerRun`) on this thread, the shard writer on another.
    fn layer_loop(
        &self,
        out: &OutputDir,
        calib: &CalibSet,
        residency: Residency,
        journal: &mut Journal,
        stages: &mut StageSeconds,
        checks: &mut SourceChecks,
    ) -> (Result<()>, Streamed) {
        let out_dir = out.path().to_path_buf();
        let jdir = journal_dir(out);
        std::thread::scope(|scope| {
            let (feed, rx) = stream::channel();
            let (specs, ck, jdir_ref) = (&self.specs, &self.ck, &jdir);
            let shard_size = self.s.shard_size;
            let writer = scope
                .spawn(move || stream::write_stream(&out_dir, specs, shard_size, ck, jdir_ref, rx));
            let result = layers::LayerRun {
                opts: self.s,
                compute: &self.compute,
                cfg: &self.cfg,
                ck: &self.ck,
                windows: &calib.windows,
                plan: &self.plan,
                format: self.s.format(),
                quant: self.s.quant_params(),
                jdir: &jdir,
                feed: &feed,
                residency,
                spill: out.path().join("spill"),
                inputs: &hessian_guard(self.s, &self.inputs),
            }
            .run(journal, stages, checks);
            drop(feed);
            let t_write = Instant::now();
            let shards = writer
                .join()
                .map_err(|_| anyhow!("the shard writer thread panicked"))
                .and_then(|r| r);
            (result, Streamed { shards, t_write })
        })
    }

    /// The last phase before the commit: the rest of the checkpoint around the streamed shards,
    /// the engine's check of the files as written, `--verify`, the model card and the report.
    fn finish(
        &self,
        out: &mut OutputDir,
        journal: &Journal,
        calib: &CalibSet,
        shards: Result<Vec<manifest::HashedFile>>,
        timing: Timing,
    ) -> Result<QuantizeReport> {
        let shards = shards?;
        let pb = crate::progress::bar(1, "write");
        let (config_edits, engine_check) = self.assemble(out, journal, calib, &shards)?;
        pb.finish_and_clear();
        let verify = self.verify(out)?;
        let mut report = QuantizeReport {
            tool: format!("soar-gptq {}", env!("CARGO_PKG_VERSION")),
            model: self.src.description.clone(),
            settings: self.settings.clone(),
            calibration: calib.usage.clone(),
            calibration_sha256: calib.sha256.clone(),
            hashes: journal.hashes.clone(),
            modules: journal.layers.iter().flat_map(|l| l.rows.clone()).collect(),
            seconds: BTreeMap::new(),
            total_seconds: 0.0,
            peak_rss_bytes: None,
            verify: verify.as_ref().map(serde_json::to_value).transpose()?,
            output: self.s.out.display().to_string(),
            engine: self.s.engine.map_or("none", Engine::name).to_string(),
            config_edits,
            copied_from_source: self.side.clone(),
            engine_check,
            stages: None,
            preflight: None,
            gpu_memory: None,
        };
        let card = card::model_card(&report, verify.as_ref());
        files::write_file(&out.path().join("README.md"), card.as_bytes())?;
        timing.record(&mut report, journal, &self.compute.device)?;
        let json = serde_json::to_string_pretty(&report)?;
        files::write_file(&out.path().join("quantize_report.json"), json.as_bytes())?;
        Ok(report)
    }

    /// Completes the checkpoint in `out` around the shards the stream wrote (their hashes for
    /// the manifest, config.json, quantize_config.json, the source's side files copied byte for
    /// byte), then emulates the engine's load of the files as written.
    fn assemble(
        &self,
        out: &mut OutputDir,
        journal: &Journal,
        calib: &CalibSet,
        shards: &[manifest::HashedFile],
    ) -> Result<(ConfigEdits, Option<engine::EngineCheck>)> {
        let damp_max = journal
            .layers
            .iter()
            .flat_map(|l| l.rows.iter().filter(|r| r.quantized).map(|r| r.damp))
            .fold(0.0, f64::max);
        let qc = self.settings.quantization_config(
            &self.plan,
            damp_max,
            serde_json::to_value(&calib.usage)?,
            &calib.sha256,
        )?;
        let (config, config_edits) = output_config(&self.src_config, &qc, self.s.engine);
        write_files(out, &self.src.dir, shards, &config, &self.side)?;
        let Some(target) = self.s.engine else {
            return Ok((config_edits, None));
        };
        let mut c = engine::check_dir(out.path(), target, false)?;
        c.serve = c.serve_at(&self.s.out.display().to_string());
        if !c.loads {
            bail!(
                "{}\nThe output was not committed (this is a bug in soar-gptq: the check before \
                 the run passed; please report it)",
                c.error_text(&out.path().display().to_string())
            );
        }
        Ok((config_edits, Some(c)))
    }

    /// `--verify`: the source and the output scored on the embedded evaluation text.
    fn verify(&self, out: &OutputDir) -> Result<Option<crate::eval::CompareReport>> {
        let s = self.s;
        if !s.verify {
            return Ok(None);
        }
        let popts = crate::eval::PplOptions {
            seqlen: s.seqlen.min().min(512),
            max_windows: Some(16),
            bos: false,
            dtype: self.compute.dtype,
            device: self.compute.device.clone(),
            batch: s.batch,
            sparse_attention: s.sparse_attention,
            text_name: "the built-in evaluation text".to_string(),
        };
        let mut c = crate::eval::compare(
            &self.src.dir,
            &[out.path().to_path_buf()],
            crate::eval::DEFAULT_EVAL_TEXT,
            &popts,
        )?;
        c.reference_model = self.src.description.clone();
        c.compared[0].model = s.out.display().to_string();
        eprintln!(
            "verify: ppl {:.4} (source) → {:.4} (quantized), mean KL {:.5}, top-1 agreement {:.2}%",
            c.reference.ppl,
            c.compared[0].ppl,
            c.compared[0].mean_kl,
            100.0 * c.compared[0].top1_agreement
        );
        Ok(Some(c))
    }

    /// The output in place; the journal goes last: until the output is in place, a crash resumes
    /// from it.
    fn commit(&self, out: OutputDir) -> Result<()> {
        let partial_dir = out.path().to_path_buf();
        let final_dir = out.commit().map_err(|e| self.kept(e, &partial_dir))?;
        crate::fault::point("the output is in place, its journal not yet removed");
        let done_journal = final_dir.join("journal");
        std::fs::remove_dir_all(&done_journal)
            .with_context(|| format!("cannot remove {}", done_journal.display()))
    }

    /// A failure once every layer is in the journal, saying that `--resume` writes the output.
    fn kept(&self, e: anyhow::Error, dir: &Path) -> anyhow::Error {
        e.context(format!(
            "all {} layers are finished and kept in {}: rerun the same command with --resume to \
             write the output",
            self.cfg.num_hidden_layers(),
            dir.display()
        ))
    }
}

/// The run's clock, recorded in the report (which the card does not read: identical runs write
/// identical cards).
struct Timing {
    t0: Instant,
    t_write: Instant,
    stages: StageSeconds,
    preflight: Preflight,
}

impl Timing {
    fn record(self, report: &mut QuantizeReport, journal: &Journal, device: &Device) -> Result<()> {
        let layers = journal.layers.iter().map(|l| l.seconds).sum();
        report.seconds.insert("layers".into(), layers);
        let write = self.t_write.elapsed().as_secs_f64();
        report.seconds.insert("write".into(), write);
        report.stages = Some(self.stages);
        report.preflight = Some(self.preflight);
        report.gpu_memory =
            stages::gpu_memory(device)?.map(|(used, reserved, now)| report::GpuMemory {
                pool_peak_used_bytes: used,
                pool_peak_reserved_bytes: reserved,
                in_use_at_end_bytes: now,
            });
        report.total_seconds = self.t0.elapsed().as_secs_f64();
        report.peak_rss_bytes = peak_rss_bytes();
        Ok(())
    }
}

/// The journal's folder inside the partial output.
fn journal_dir(out: &OutputDir) -> PathBuf {
    out.path().join("journal")
}

/// The source's config and checkpoint, validated: every tensor the config implies, with its
/// shape. A checkpoint that is already quantized is refused.
fn open_source(s: &Settings, src: &ModelSource) -> Result<(AnyConfig, Checkpoint)> {
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
    cfg.set_sparse_attention(s.sparse_attention)?;
    let ck = Checkpoint::open(&src.dir)?;
    ck.validate_exact(&cfg.expected_tensors())?;
    Ok((cfg, ck))
}

/// The source's config.json as JSON, the base of the output's.
fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// The settings checked against the model, then each Linear's scheme from `--skip` and
/// `--plan`, all before any heavy work.
fn plan_linears(s: &Settings, cfg: &AnyConfig) -> Result<Plan> {
    s.quant_params()
        .validate()
        .context("invalid quantization settings")?;
    cfg.check_length(s.seqlen.max())
        .with_context(|| format!("--seqlen {} is too long for this model", s.seqlen))?;
    if s.load_hessians.is_some() && s.method == Method::Rtn {
        bail!("--load-hessians has no effect with --method rtn, which uses no Hessians");
    }
    let rules = match &s.plan {
        Some(p) => crate::format::quantized::read_plan_rules(p)?,
        None => vec![],
    };
    let default_scheme = plan::Scheme {
        bits: s.bits,
        group_size: s.group_size,
    };
    let unmatched = if s.allow_unmatched_rules {
        plan::Unmatched::Allow
    } else {
        plan::Unmatched::Refuse
    };
    let plan = Plan::build(cfg, &s.skip, &rules, default_scheme, unmatched)?;
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
    Ok(plan)
}

/// What to add to the message of a run the GPU's memory stopped: a lower `--max-gpu-memory`
/// (it changes no output byte, so `--resume` accepts it), or nothing for other errors.
fn out_of_memory_hint(e: &anyhow::Error, max_gpu_memory: Option<f64>) -> String {
    if !e
        .chain()
        .any(|c| c.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"))
    {
        return String::new();
    }
    let now = match max_gpu_memory {
        Some(gb) => format!("below this run's {gb}"),
        None => "a few GB below the card's free memory".to_string(),
    };
    format!(
        " (the GPU ran out of memory: other processes, or the allocator's fragmentation beyond \
         the plan's margin; add --max-gpu-memory with a value {now}: it changes no output byte)"
    )
}

/// Where the run keeps its activations, from the preflight's estimate and the memory the
/// device (and on a GPU, the host) offers; refused when not even one layer and one batch fit.
fn memory_plan(p: &Preflight, opts: &Settings, device: &Device) -> Result<stages::MemoryPlan> {
    let gb = |x: Option<f64>| x.map(|g| (g * 1e9) as u64);
    let cuda = device.is_cuda();
    let device_free = if cuda {
        #[cfg(feature = "cuda")]
        {
            crate::kernels::memory::memory_free(device).ok()
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

/// The output's tensors in the order they are written: the source's, with every quantized
/// Linear replaced by its GPTQ set (`qweight`, `qzeros`, `scales`, `g_idx`).
fn output_specs(cfg: &AnyConfig, ck: &Checkpoint, plan: &plan::Plan) -> Result<Vec<TensorSpec>> {
    let quantized: BTreeMap<String, plan::Scheme> = plan.quantized().into_iter().collect();
    let mut specs = vec![];
    for (name, shape) in cfg.expected_tensors() {
        let prefix = name.strip_suffix(".weight").unwrap_or(&name);
        if let Some(scheme) = quantized.get(prefix) {
            let (vals, words) = crate::format::pack::block_shape(scheme.bits.get())?;
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
        manifest::MANIFEST_FILE,
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
fn write_files(
    out: &mut OutputDir,
    src_dir: &Path,
    shards: &[manifest::HashedFile],
    config: &serde_json::Value,
    side: &[String],
) -> Result<()> {
    let dir = out.path().to_path_buf();
    out.record_hashed(shards);
    files::write_file(
        &dir.join("config.json"),
        serde_json::to_string_pretty(config)?.as_bytes(),
    )?;
    files::write_file(
        &dir.join("quantize_config.json"),
        serde_json::to_string_pretty(&config["quantization_config"])?.as_bytes(),
    )?;
    out.copy_from_source(src_dir, side)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::out_of_memory_hint;
    use anyhow::anyhow;

    /// A CUDA out-of-memory error anywhere in the chain gets the `--max-gpu-memory` advice,
    /// naming the run's own cap when it had one; any other error gets nothing.
    #[test]
    fn out_of_memory_errors_point_at_max_gpu_memory() {
        let oom = anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
            .context("layer 1: attention");
        let free = out_of_memory_hint(&oom, None);
        assert!(
            free.contains("--max-gpu-memory") && free.contains("free memory"),
            "{free}"
        );
        let capped = out_of_memory_hint(&oom, Some(70.0));
        assert!(capped.contains("below this run's 70"), "{capped}");
        assert_eq!(out_of_memory_hint(&anyhow!("disk full"), None), "");
    }
}
