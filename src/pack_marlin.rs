//! `pack-marlin`: a GPTQ checkpoint (v1 or v2, ours or anyone's; modules found by their
//! `{p}.qweight`) rewritten in the Marlin tile layout the kernel reads directly.
//!
//! Per quantized Linear `p` (K = in_features, N = out_features, g = group size, G = K / g):
//!
//! | tensor | dtype | shape | content |
//! |---|---|---|---|
//! | `{p}.B` | I32 | `[K/16, 2N]` | codes in Marlin tiles (docs/formats.md, Marlin tile layout) |
//! | `{p}.s` | F16 | `[G, N]` | GPTQ scales in the Marlin scale permutation (docs/formats.md) |
//! | `{p}.g_idx_sort_indices` | I32 | `[K]` | only when `desc_act` is true (extension below) |
//!
//! Every other tensor is copied unchanged (name, dtype, bytes); `config.json`'s
//! `quantization_config` and `quantize_config.json` get `checkpoint_format: "marlin"`
//! (everything else kept, including `desc_act` and `dynamic`); tokenizer, generation and `*.py`
//! files are copied.
//!
//! **Act-order extension (soar-gptq).** The legacy Marlin format has no act-order. For a module
//! with `desc_act: true` the rows are pre-sorted by the stable argsort of `g_idx`
//! ([`marlin_sort_indices`]) before tiling, and the permutation is stored as
//! `{p}.g_idx_sort_indices`: Marlin row `k'` holds original input row `sort[k']` and belongs to
//! group `k' / g` (act-order GPTQ gives every group exactly g rows, which validation checks). A
//! consumer multiplies `x[:, sort]` with the tiles, as vLLM's `gptq_marlin` does after its runtime
//! repack.
//! Trivial `g_idx` (static or no act-order) needs nothing: the sort is the identity and is not
//! stored.
//!
//! Refused, naming the modules and leaving no output folder: what Marlin cannot hold
//! ([`check_marlin_shape`]: asymmetric, bits ≠ 4, group size outside {−1, 32, 64, 128},
//! K % 128, K % g, N % 64), and scales that are not exactly representable in fp16.
//! Before the output is committed, every written `B`/`s` (and sort indices) is read back from the
//! files and unpacked; the codes and the scale bits must equal the GPTQ ones exactly, copied
//! tensors must be byte-identical, and the result must validate as a Marlin checkpoint.

use crate::checkpoint::files::{side_files, write_file};
use crate::checkpoint::guard::model_inputs;
use crate::checkpoint::shards::{write_sharded_parallel, DEFAULT_SHARD_BYTES};
use crate::checkpoint::{Checkpoint, Dtype, OutputDir, TensorSpec};
use crate::engine::{self, Engine, EngineCheck};
use crate::format::marlin::{
    check_marlin_shape, gptq_codes_to_marlin, marlin_sort_indices, marlin_to_gptq_codes,
    permute_scales, unpermute_scales,
};
use crate::format::pack::i32_to_le_bytes;
use crate::format::quantized::{
    at, read_json, read_quant_info, validate_quantized_modules, QuantFormat, QuantInfo,
    QuantModule, CONFIG_FILE, QUANTIZE_CONFIG_FILE, SORT_INDICES_SUFFIX,
};
use anyhow::{anyhow, bail, ensure, Context, Result};
use half::f16;
use rayon::prelude::*;
use serde::Serialize;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// What `pack-marlin` did.
#[derive(Debug, Clone, Serialize)]
pub struct PackMarlinReport {
    pub input: String,
    pub output: String,
    /// GPTQ `checkpoint_format` of the input (`gptq` or `gptq_v2`).
    pub input_format: String,
    pub modules_packed: usize,
    /// Modules stored with `g_idx_sort_indices` (desc_act true).
    pub act_order_modules: usize,
    pub tensors_copied: usize,
    /// Bytes of the written `B`, `s` and sort-index tensors.
    pub quantized_bytes: u64,
    /// Bytes of all tensor data written.
    pub tensor_bytes: u64,
    pub shards: Vec<String>,
    /// Files copied byte for byte from the input (tokenizer, remote code, generation config).
    pub side_files: Vec<String>,
    /// How config.json differs from the input's (besides quantization_config).
    pub config_edits: engine::config::ConfigEdits,
    /// Every module was read back from the files and matched the GPTQ codes and scales bit-exactly.
    pub verified: bool,
    /// The engine's loader emulated on the output (as a release with the legacy marlin method).
    pub engine_check: Option<EngineCheck>,
    /// Why no engine check ran, when one was asked for.
    pub engine_note: Option<String>,
    pub seconds: f64,
    /// Where the time went.
    pub stages: PackStages,
}

/// Seconds per stage of a pack-marlin run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PackStages {
    /// Reading and validating the input (finite values, every module, the fp16 scales).
    pub check: f64,
    /// Re-tiling and writing the shards (hashed as they are written).
    pub write: f64,
    /// Configs, side files and the bit-exact read-back of every module.
    pub verify: f64,
    /// The engine check on the written files.
    pub engine_check: f64,
    /// Model card, manifest and the rename into place.
    pub commit: f64,
}

impl PackMarlinReport {
    pub fn print_text(&self) {
        crate::outln!("input          {} ({})", self.input, self.input_format);
        crate::outln!("output         {} (checkpoint_format marlin)", self.output);
        crate::outln!(
            "modules        {} packed ({} with act-order sort indices); {} tensors copied",
            self.modules_packed,
            self.act_order_modules,
            self.tensors_copied
        );
        crate::outln!(
            "bytes          {:.3} GB of tensors ({:.3} GB Marlin B/s) in {} shard(s)",
            self.tensor_bytes as f64 / 1e9,
            self.quantized_bytes as f64 / 1e9,
            self.shards.len()
        );
        if !self.side_files.is_empty() {
            crate::outln!("copied         {}", self.side_files.join(", "));
        }
        crate::outln!(
            "verification   every B and s read back from disk unpacks bit-exactly to the GPTQ \
             codes and scales"
        );
        crate::outln!(
            "engines        no current SGLang or vLLM release reads checkpoint_format marlin \
             (they serve the GPTQ input through gptq_marlin); legacy-marlin loaders do:"
        );
        if let Some(c) = &self.engine_check {
            c.print_text();
        }
        if let Some(n) = &self.engine_note {
            crate::outln!("               {n}");
        }
        let t = &self.stages;
        crate::outln!(
            "time           {:.1} s (check {:.1}, write {:.1}, verify {:.1}, engine check {:.1}, \
             commit {:.1})",
            self.seconds,
            t.check,
            t.write,
            t.verify,
            t.engine_check,
            t.commit
        );
    }
}

/// Where a written tensor's bytes come from.
enum Source<'a> {
    Copy,
    Tiles(&'a QuantModule),
    SortIndices(&'a QuantModule),
    Scales(&'a QuantModule),
}

/// Scales of a GPTQ module as fp16 bit patterns: F16 tensors verbatim, others converted only when
/// every value is exactly representable.
fn scales_f16_bits(ck: &Checkpoint, name: &str) -> Result<Vec<u16>> {
    let e = ck
        .get(name)
        .ok_or_else(|| anyhow!("{} is missing", at(ck, name)))?;
    if e.dtype == Dtype::F16 {
        return Ok(ck
            .bytes(name)?
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect());
    }
    let values = ck.f32_data(name)?;
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let h = f16::from_f32(v);
            ensure!(
                h.to_f32() == v || (v.is_nan() && h.is_nan()),
                "{} is {} and value {i} ({v}) has no exact fp16 representation; Marlin stores \
                 fp16 scales, so packing would change the weights",
                at(ck, name),
                e.dtype.name()
            );
            Ok(h.to_bits())
        })
        .collect()
}

fn u16_le_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The quantization settings written to the Marlin checkpoint.
fn marlin_quant_config(raw: &Value) -> Value {
    let mut q = raw.clone();
    if let Some(obj) = q.as_object_mut() {
        obj.insert("checkpoint_format".into(), Value::from("marlin"));
        if obj.contains_key("format") {
            obj.insert("format".into(), Value::from("marlin"));
        }
        if !obj.contains_key("quant_method") && !obj.contains_key("method") {
            obj.insert("quant_method".into(), Value::from("gptq"));
        }
    }
    q
}

/// Packs the GPTQ checkpoint in `input` into a Marlin checkpoint at `out` (see the module docs).
pub fn pack_marlin_checkpoint(
    input: &Path,
    out: &Path,
    force: bool,
    engine: Option<Engine>,
) -> Result<PackMarlinReport> {
    let t0 = Instant::now();
    let info = read_gptq_info(input)?;
    // Checked before anything is read: an --out that aliases --in would destroy it.
    crate::checkpoint::guard::check_output("--out", out, &[], &model_inputs("--in", input))?;
    let ck = Checkpoint::open(input)?;
    ck.check_finite()?;
    let expected = crate::model::expected_bf16_tensors(input).ok();
    let modules = packable_modules(input, &ck, &info, expected.as_deref())?;

    let mut stages = PackStages::default();
    let mut mark = Instant::now();
    let mut lap = |slot: &mut f64| {
        *slot = mark.elapsed().as_secs_f64();
        mark = Instant::now();
    };
    stages.check = t0.elapsed().as_secs_f64();
    let mut od = OutputDir::create(out, force, &model_inputs("--in", input))?;
    crate::fault::delay("SOAR_GPTQ_TEST_PACK_DELAY_MS");
    let tensors = MarlinTensors::plan(&ck, &modules);
    let shards = write_tensors(&ck, &mut od, &tensors)?;
    lap(&mut stages.write);

    let config_edits = write_configs(input, &od, &info, engine)?;
    // Tokenizer, generation config, remote code: byte copies (never the input's README.md:
    // it describes the GPTQ folder; the Marlin folder gets its own below).
    let side = side_files(input)?;
    od.copy_from_source(input, &side)?;

    verify_output(
        &ck,
        od.path(),
        &modules,
        &tensors.copied,
        expected.as_deref(),
    )?;
    lap(&mut stages.verify);
    let (engine_check, engine_note) = check_engine(input, out, &od, engine)?;

    lap(&mut stages.engine_check);
    let quantized_bytes = tensors.quantized_bytes();
    let tensor_bytes = tensors.specs.iter().map(TensorSpec::nbytes).sum();
    write_file(
        &od.path().join("README.md"),
        marlin_card(input, &info, modules.len(), engine_check.as_ref()).as_bytes(),
    )?;
    let output = od.commit()?;
    lap(&mut stages.commit);
    Ok(PackMarlinReport {
        input: input.display().to_string(),
        output: output.display().to_string(),
        input_format: info.format.checkpoint_format().to_string(),
        modules_packed: modules.len(),
        act_order_modules: modules.iter().filter(|m| m.desc_act).count(),
        tensors_copied: tensors.copied.len(),
        quantized_bytes,
        tensor_bytes,
        shards,
        side_files: side,
        config_edits,
        verified: true,
        engine_check,
        engine_note,
        seconds: t0.elapsed().as_secs_f64(),
        stages,
    })
}

/// The quantization settings of `input`, refused unless it is a GPTQ (not yet Marlin) checkpoint.
fn read_gptq_info(input: &Path) -> Result<QuantInfo> {
    let info = read_quant_info(input)?.ok_or_else(|| {
        anyhow!(
            "{} has no quantization_config in {CONFIG_FILE} and no {QUANTIZE_CONFIG_FILE}: \
             pack-marlin needs a GPTQ checkpoint (make one with soar-gptq quantize)",
            input.display()
        )
    })?;
    ensure!(
        info.format != QuantFormat::Marlin,
        "{} is already a Marlin checkpoint (see {}): nothing to pack",
        input.display(),
        info.source.display()
    );
    Ok(info)
}

/// The quantized modules of the checkpoint, validated, each of a shape Marlin holds and with
/// scales that fp16 holds exactly; refused (before anything is written) otherwise.
fn packable_modules(
    input: &Path,
    ck: &Checkpoint,
    info: &QuantInfo,
    expected: Option<&[(String, Vec<usize>)]>,
) -> Result<Vec<QuantModule>> {
    let modules = validate_quantized_modules(ck, info, expected)
        .with_context(|| format!("{} is not a valid GPTQ checkpoint", input.display()))?;
    ensure!(
        !modules.is_empty(),
        "{} holds no quantized module (no *.qweight tensors): nothing to pack",
        input.display()
    );
    refuse_unfit_shapes(input, &modules)?;
    // Scales must survive the fp16 Marlin stores; check before anything is written.
    modules
        .par_iter()
        .try_for_each(|m| scales_f16_bits(ck, &format!("{}.scales", m.prefix)).map(drop))?;
    Ok(modules)
}

/// Refuses the checkpoint when any module does not fit the Marlin format, naming the first few.
fn refuse_unfit_shapes(input: &Path, modules: &[QuantModule]) -> Result<()> {
    let refusals: Vec<String> = modules
        .iter()
        .filter_map(|m| {
            check_marlin_shape(m.k, m.n, m.group_size, m.bits, m.sym)
                .err()
                .map(|e| {
                    format!(
                        "{} (K = {}, N = {}, bits {}, group {}, sym {}): {e}",
                        m.prefix, m.k, m.n, m.bits, m.group_size, m.sym
                    )
                })
        })
        .collect();
    if !refusals.is_empty() {
        const SHOWN: usize = 8;
        let more = refusals.len().saturating_sub(SHOWN);
        bail!(
            "cannot pack {} to Marlin: {} of {} quantized modules do not fit the Marlin format:\n  \
             {}{}\nKeep serving the GPTQ checkpoint (SGLang and vLLM repack it at load when they \
             can), or re-quantize with settings Marlin holds (symmetric, 4 bits, group size -1, \
             32, 64 or 128, K % 128 == 0, N % 64 == 0)",
            input.display(),
            refusals.len(),
            modules.len(),
            refusals[..refusals.len().min(SHOWN)].join("\n  "),
            if more > 0 {
                format!("\n  ... and {more} more")
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// The output's tensors in the input's order: per module `B`, the sort indices (act-order only)
/// and `s` in place of its `qweight`, every tensor outside a module copied.
struct MarlinTensors<'a> {
    specs: Vec<TensorSpec>,
    sources: HashMap<String, Source<'a>>,
    /// Names of the tensors copied unchanged.
    copied: Vec<String>,
}

impl<'a> MarlinTensors<'a> {
    /// Lays out the output of `ck` whose quantized modules are `modules`.
    fn plan(ck: &Checkpoint, modules: &'a [QuantModule]) -> Self {
        let mut owner: HashMap<&str, &QuantModule> = HashMap::new();
        for m in modules {
            for t in &m.tensors {
                owner.insert(t.as_str(), m);
            }
        }
        let mut l = MarlinTensors {
            specs: Vec::new(),
            sources: HashMap::new(),
            copied: Vec::new(),
        };
        for (name, e) in ck.entries() {
            match owner.get(name.as_str()) {
                Some(m) if *name == format!("{}.qweight", m.prefix) => l.add_module(m),
                Some(_) => {}
                None => {
                    l.specs
                        .push(TensorSpec::new(name.clone(), e.dtype, e.shape.clone()));
                    l.sources.insert(name.clone(), Source::Copy);
                    l.copied.push(name.clone());
                }
            }
        }
        l
    }

    /// Adds the Marlin tensors of module `m`: `B`, the sort indices when act-order, `s`.
    fn add_module(&mut self, m: &'a QuantModule) {
        let p = &m.prefix;
        self.specs.push(TensorSpec::new(
            format!("{p}.B"),
            Dtype::I32,
            vec![m.k / 16, 2 * m.n],
        ));
        self.sources.insert(format!("{p}.B"), Source::Tiles(m));
        if m.desc_act {
            let si = format!("{p}.{SORT_INDICES_SUFFIX}");
            self.specs
                .push(TensorSpec::new(si.clone(), Dtype::I32, vec![m.k]));
            self.sources.insert(si, Source::SortIndices(m));
        }
        self.specs.push(TensorSpec::new(
            format!("{p}.s"),
            Dtype::F16,
            vec![m.groups, m.n],
        ));
        self.sources.insert(format!("{p}.s"), Source::Scales(m));
    }

    /// Bytes of the written `B`, `s` and sort-index tensors.
    fn quantized_bytes(&self) -> u64 {
        self.specs
            .iter()
            .filter(|s| !matches!(self.sources[&s.name], Source::Copy))
            .map(TensorSpec::nbytes)
            .sum()
    }
}

/// Writes the shards of `tensors` into the output folder (after checking the disk has room) and
/// records their hashes; returns the shard names.
fn write_tensors(
    ck: &Checkpoint,
    od: &mut OutputDir,
    tensors: &MarlinTensors,
) -> Result<Vec<String>> {
    crate::checkpoint::guard::check_disk_space(
        "--out",
        od.path(),
        tensors.specs.iter().map(TensorSpec::nbytes).sum(),
        "the tensors",
    )?;
    // Re-tiled on all cores, shards written at the same time and hashed as they are written.
    let shards = write_sharded_parallel(od.path(), &tensors.specs, DEFAULT_SHARD_BYTES, |spec| {
        tensor_bytes(ck, &tensors.sources[&spec.name], &spec.name)
    })?;
    od.record_hashed(&shards);
    Ok(shards.into_iter().map(|f| f.name).collect())
}

/// The bytes of output tensor `name`: copied from `ck`, or re-tiled from its module's tensors.
fn tensor_bytes<'c>(
    ck: &'c Checkpoint,
    source: &Source,
    name: &str,
) -> Result<std::borrow::Cow<'c, [u8]>> {
    let bytes = match source {
        Source::Copy => return Ok(ck.bytes(name)?.into()),
        Source::Tiles(m) => {
            let qweight = ck.i32_data(&format!("{}.qweight", m.prefix))?;
            let g_idx = ck.i32_data(&format!("{}.g_idx", m.prefix))?;
            let mw = gptq_codes_to_marlin(&qweight, &g_idx, m.k, m.n)
                .with_context(|| format!("re-tiling module {}", m.prefix))?;
            i32_to_le_bytes(&mw.b)
        }
        Source::SortIndices(m) => i32_to_le_bytes(&marlin_sort_indices(
            &ck.i32_data(&format!("{}.g_idx", m.prefix))?,
        )),
        Source::Scales(m) => {
            let bits = scales_f16_bits(ck, &format!("{}.scales", m.prefix))?;
            u16_le_bytes(&permute_scales(&bits, m.groups, m.n)?)
        }
    };
    Ok(bytes.into())
}

/// Writes `config.json` (when the input has one: the engine's config rules applied, the Marlin
/// quantization settings in) and `quantize_config.json`; returns how config.json changed.
fn write_configs(
    input: &Path,
    od: &OutputDir,
    info: &QuantInfo,
    engine: Option<Engine>,
) -> Result<engine::config::ConfigEdits> {
    let qcfg = marlin_quant_config(&info.raw);
    let cfg_in = input.join(CONFIG_FILE);
    let mut config_edits = engine::config::ConfigEdits::default();
    if cfg_in.is_file() {
        let src_cfg = read_json(&cfg_in)?;
        ensure!(
            src_cfg.is_object(),
            "{} is not a JSON object",
            cfg_in.display()
        );
        let (mut cfg, edits) = engine::config::engine_config(&src_cfg, engine, "bfloat16");
        config_edits = edits;
        cfg["quantization_config"] = qcfg.clone();
        write_file(
            &od.path().join(CONFIG_FILE),
            serde_json::to_string_pretty(&cfg)?.as_bytes(),
        )?;
    }
    write_file(
        &od.path().join(QUANTIZE_CONFIG_FILE),
        serde_json::to_string_pretty(&qcfg)?.as_bytes(),
    )?;
    Ok(config_edits)
}

/// The engine's loader on the written files, as a release with the legacy marlin method: its
/// check (refused when it would not load), or the note saying why none ran.
fn check_engine(
    input: &Path,
    out: &Path,
    od: &OutputDir,
    engine: Option<Engine>,
) -> Result<(Option<EngineCheck>, Option<String>)> {
    // Architectures the check does not model (pack-marlin takes anyone's GPTQ checkpoint) are
    // packed without it; the report says so.
    let supported = crate::model::AnyConfig::from_file(&input.join(CONFIG_FILE)).is_ok();
    let engine_note = (engine.is_some() && !supported).then(|| {
        format!(
            "no engine check: {} is not a config of an architecture the check models \
             (MiniCPM-SALA, Llama, Mistral, Qwen2, MiniCPM)",
            input.join(CONFIG_FILE).display()
        )
    });
    let engine_check = match engine.filter(|_| supported) {
        Some(e) => {
            let mut c = engine::check_dir(od.path(), e, true)?;
            c.serve = c.serve_at(&out.display().to_string());
            ensure!(
                c.loads,
                "{}\nNothing was written to {}",
                c.error_text(&od.path().display().to_string()),
                out.display()
            );
            Some(c)
        }
        None => None,
    };
    Ok((engine_check, engine_note))
}

/// The model card of a Marlin folder: where it came from, and plainly who reads it.
fn marlin_card(
    input: &Path,
    info: &crate::format::quantized::QuantInfo,
    modules: usize,
    check: Option<&EngineCheck>,
) -> String {
    let input_name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| input.display().to_string());
    format!(
        "---\ntags:\n- gptq\n- marlin\n- soar-gptq\n---\n\n# {input_name}, Marlin tiles\n\n\
         The GPTQ checkpoint `{input_name}` ({}-bit, group {}, {}) re-tiled by soar-gptq {} into the \
         Marlin layout: per Linear `B` (int32 tiles) and `s` (fp16 scales in the Marlin \
         permutation), `checkpoint_format: \"marlin\"`. {modules} Linears; every tile was read back \
         and unpacks bit-exactly to the GPTQ codes and scales.\n\n## Who reads this format\n\n\
         No current SGLang or vLLM release: both serve GPTQ checkpoints through `gptq_marlin`, \
         which repacks to these tiles at load, and vLLM removed the legacy `marlin` method after \
         0.10.1.1. This folder is for loaders that read `B`/`s` directly: SGLang with vLLM ≤ \
         0.10.1.1 installed (legacy `marlin`, float16 activations), or your own kernels. Serve \
         `{input_name}` with current engines.\n\n{}\n\nEvery file's SHA-256 is in `manifest.json`.\n",
        info.bits,
        info.group_size,
        if info.sym { "symmetric" } else { "asymmetric" },
        env!("CARGO_PKG_VERSION"),
        match check {
            Some(c) => format!(
                "{}'s loader, emulated on this folder as a legacy-marlin release: {}.",
                c.engine.label(),
                if c.loads {
                    format!("loads ({})", c.method_summary())
                } else {
                    "would fail".to_string()
                }
            ),
            None => "No engine's loader was emulated on this folder (--engine none).".to_string(),
        },
    )
}

/// Reads the written files back: codes, sort indices and scale bits must equal the GPTQ input
/// exactly, copied tensors must be byte-identical, and the folder must validate as Marlin.
fn verify_output(
    ck: &Checkpoint,
    dir: &Path,
    modules: &[QuantModule],
    copied: &[String],
    expected: Option<&[(String, Vec<usize>)]>,
) -> Result<()> {
    let outck = Checkpoint::open(dir).context("pack-marlin self-check: re-reading the output")?;
    // Module by module on all cores: every check reads only its own tensors.
    modules
        .par_iter()
        .try_for_each(|m| verify_module(ck, &outck, m))?;
    copied
        .par_iter()
        .try_for_each(|name| verify_copy(ck, &outck, name))?;
    let out_info = read_quant_info(dir)?
        .ok_or_else(|| self_check_failed("the output has no quantization settings".into()))?;
    if out_info.format != QuantFormat::Marlin {
        return Err(self_check_failed(format!(
            "{} does not say checkpoint_format marlin",
            out_info.source.display()
        )));
    }
    let out_modules = validate_quantized_modules(&outck, &out_info, expected)
        .map_err(|e| self_check_failed(format!("the output does not validate as Marlin: {e:#}")))?;
    if out_modules.len() != modules.len() {
        return Err(self_check_failed(format!(
            "the output holds {} Marlin modules, the input {} GPTQ modules",
            out_modules.len(),
            modules.len()
        )));
    }
    Ok(())
}

/// The error of a failed self-check: `what` went wrong, and that nothing was written.
fn self_check_failed(what: String) -> anyhow::Error {
    anyhow!(
        "pack-marlin self-check failed: {what}; nothing was written to the output (this is a \
         bug in soar-gptq, please report it with the input checkpoint)"
    )
}

/// Checks module `m` as written in `outck` against the input `ck`: every Marlin row is read with
/// its own group's scales, `B` unpacks to the GPTQ codes and `s` un-permutes to the GPTQ scales.
fn verify_module(ck: &Checkpoint, outck: &Checkpoint, m: &QuantModule) -> Result<()> {
    let (p, k, n) = (&m.prefix, m.k, m.n);
    let b_name = format!("{p}.B");
    let si_name = format!("{p}.{SORT_INDICES_SUFFIX}");
    let b = outck.i32_data(&b_name)?;
    let sort: Vec<i32> = if outck.contains(&si_name) {
        outck.i32_data(&si_name)?
    } else {
        (0..k as i32).collect()
    };
    let g_idx = ck.i32_data(&format!("{p}.g_idx"))?;
    let g = m.group_len();
    if let Some(kp) = (0..k).find(|&kp| g_idx[sort[kp] as usize] as usize != kp / g) {
        return Err(self_check_failed(format!(
            "Marlin row {kp} of module {p} holds input row {} of group {}, but row {kp} is \
             read with the scales of group {}",
            sort[kp],
            g_idx[sort[kp] as usize],
            kp / g
        )));
    }
    let back = marlin_to_gptq_codes(&b, &sort, k, n)
        .with_context(|| format!("unpacking {}", at(outck, &b_name)))?;
    let qweight = ck.i32_data(&format!("{p}.qweight"))?;
    if let Some(i) = (0..qweight.len()).find(|&i| back[i] != qweight[i]) {
        return Err(self_check_failed(format!(
            "{} does not unpack to the codes of {} (qweight word {i}: 0x{:08x} instead of \
             0x{:08x})",
            at(outck, &b_name),
            at(ck, &format!("{p}.qweight")),
            back[i] as u32,
            qweight[i] as u32
        )));
    }
    verify_scales(ck, outck, m)
}

/// Checks that module `m`'s written `s` un-permutes to the input's scales, bit for bit.
fn verify_scales(ck: &Checkpoint, outck: &Checkpoint, m: &QuantModule) -> Result<()> {
    let p = &m.prefix;
    let s_name = format!("{p}.s");
    let s_bits: Vec<u16> = outck
        .bytes(&s_name)?
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let scales = unpermute_scales(&s_bits, m.groups, m.n)?;
    let want = scales_f16_bits(ck, &format!("{p}.scales"))?;
    if let Some(i) = (0..want.len()).find(|&i| scales[i] != want[i]) {
        return Err(self_check_failed(format!(
            "{} does not un-permute to {} (value {i}: fp16 bits 0x{:04x} instead of 0x{:04x})",
            at(outck, &s_name),
            at(ck, &format!("{p}.scales")),
            scales[i],
            want[i]
        )));
    }
    Ok(())
}

/// Checks that tensor `name` was copied byte for byte (same dtype and shape too).
fn verify_copy(ck: &Checkpoint, outck: &Checkpoint, name: &str) -> Result<()> {
    let (a, b) = (ck.get(name), outck.get(name));
    let same = match (a, b) {
        (Some(a), Some(b)) => {
            a.dtype == b.dtype && a.shape == b.shape && ck.bytes(name)? == outck.bytes(name)?
        }
        _ => false,
    };
    if !same {
        return Err(self_check_failed(format!(
            "{} is not a byte-identical copy of {}",
            at(outck, name),
            at(ck, name)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn marlin_config_keeps_everything_but_the_format() {
        let raw = json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq",
                         "checkpoint_format": "gptq", "dynamic": {"-:x": {}}});
        let q = marlin_quant_config(&raw);
        assert_eq!(q["checkpoint_format"], "marlin");
        assert_eq!(q["format"], "marlin");
        assert_eq!(q["dynamic"], raw["dynamic"]);
        let q = marlin_quant_config(&json!({"bits": 4, "group_size": 128}));
        assert_eq!(q["quant_method"], "gptq");
        assert!(q.get("format").is_none());
    }
}
