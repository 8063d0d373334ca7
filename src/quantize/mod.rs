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
mod journal;
mod layers;
pub mod plan;
mod report;
pub mod settings;
pub mod stages;
mod stream;

use crate::calib::{self, CalibSpec, ChatFormat};
use crate::checkpoint::guard::{self, InputPath};
use crate::checkpoint::writer::{self, OutputDir, TensorSpec};
use crate::checkpoint::{Checkpoint, Dtype};
use crate::engine::{self, config::ConfigEdits, Engine};
use crate::model::AnyConfig;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use journal::Journal;
pub use report::{ModuleRow, QuantizeReport};
pub use settings::{Compute, Method, Recorded, Settings};
use stages::{Preflight, Stages};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// Peak resident memory of this process in bytes (VmHWM), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Every path `quantize` reads besides the model: calibration files and folders, saved Hessians.
fn side_inputs(s: &Settings, calib: &[CalibSpec]) -> Vec<InputPath> {
    let mut v: Vec<InputPath> = calib
        .iter()
        .filter(|c| c.path != "default")
        .map(|c| InputPath::new("--calib", &c.path))
        .collect();
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
    all.push(InputPath::new("--out", writer::partial_path(&s.out)));
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

pub fn quantize(opts: &Settings) -> Result<QuantizeReport> {
    let t0 = Instant::now();
    let compute = Compute::open(opts)?;
    let calib_specs = opts.calib_specs()?;
    // The output is checked against the inputs before anything is read or downloaded (for a
    // hub model, against its folder in the cache); again below with the resolved files.
    let mut inputs = side_inputs(opts, &calib_specs);
    inputs.push(InputPath::new("--model", opts.source.local_path()));
    guard::check_output(
        "--out",
        &opts.out,
        &[writer::partial_path(&opts.out)],
        &inputs,
    )?;
    if let Some(dir) = &opts.save_hessians {
        check_hessian_dir(dir, opts, &inputs)?;
    }
    let src = opts.source.resolve()?;
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
    let quant = opts.quant_params();
    quant.validate().context("invalid quantization settings")?;
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
    let settings = Recorded::new(
        opts,
        &compute,
        calib_specs,
        &plan,
        cfg.sparse_runs(opts.seqlen.max()),
    );

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
        let qc = settings.quantization_config(&plan, opts.damp, serde_json::json!([]), "")?;
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
        compute.dtype,
        &compute.device,
        opts.true_sequential,
        opts.method,
        opts.mse,
    );
    eprintln!("{}", preflight.line());
    // Refused now rather than dying midway: less memory than one layer and one batch need, or
    // more disk than the output's filesystem has.
    let memory = memory_plan(&preflight, opts, &compute.device)?;
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
    let sources = calib::load_sources(&settings.calib, &chat)?;
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
    let mut hashes = journal::Hashes::new(&src.dir, BTreeMap::new(), &settings, &calib.sha256)?;
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
    if compute.device.is_cuda() {
        crate::kernels::cuda::keep_pool_memory(&compute.device)?;
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
            stream::write_stream(&out_dir, specs, opts.shard_size, ck_ref, jdir_ref, rx)
        });
        let result = layers::LayerRun {
            opts,
            compute: &compute,
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
        let qc = settings.quantization_config(
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
                dtype: compute.dtype,
                device: compute.device.clone(),
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
            stages::gpu_memory(&compute.device)?.map(|(used, reserved, now)| report::GpuMemory {
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

/// Where the run keeps its activations, from the preflight's estimate and the memory the
/// device (and on a GPU, the host) offers; refused when not even one layer and one batch fit.
fn memory_plan(p: &Preflight, opts: &Settings, device: &Device) -> Result<stages::MemoryPlan> {
    let gb = |x: Option<f64>| x.map(|g| (g * 1e9) as u64);
    let cuda = device.is_cuda();
    let device_free = if cuda {
        #[cfg(feature = "cuda")]
        {
            crate::kernels::cuda::memory_free(device).ok()
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
