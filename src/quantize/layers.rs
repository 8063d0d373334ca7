//! The layer loop of `quantize`: embed the calibration windows, replay the layers a journal
//! already holds, then for each remaining layer accumulate the Hessians of each true-sequential
//! subset, solve and pack its Linears, put the decoded weights back and run the layer forward so
//! the next one sees the quantized model. Each finished layer's file is written on a background
//! thread while the next layer computes.

use super::journal::{self, Journal, JournalLayer, Packed, SourceChecks};
use super::plan::{ModulePlan, Plan};
use super::stages::{StageClock, Stages};
use super::stream::StreamFeed;
use super::{Method, ModuleRow, QuantizeOptions};
use crate::checkpoint::guard::{InputPath, OutputFile};
use crate::checkpoint::Checkpoint;
use crate::format;
use crate::gptq::{
    self, Factorization, HessianAccumulator, QuantParams, QuantizedLinear, SolveOptions,
};
use crate::model::{sequential, AnyConfig, AnyLayer, AnyModel, LinearGroup};
use crate::scheme::QuantFormat;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use indicatif::ProgressBar;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// What every layer of one run reads: the options, the model and its checkpoint, the
/// calibration windows, the plan (each Linear's scheme, or kept in 16 bits) and the journal
/// folder.
pub(super) struct LayerRun<'a> {
    pub opts: &'a QuantizeOptions,
    pub cfg: &'a AnyConfig,
    pub ck: &'a Checkpoint,
    pub windows: &'a [Vec<u32>],
    pub plan: &'a Plan,
    pub layout: QuantFormat,
    pub quant: QuantParams,
    pub jdir: &'a Path,
    /// The shard stream, told of each layer as it is recorded (replayed layers first).
    pub feed: &'a StreamFeed,
    /// Every input of the run, which no `--save-hessians` file may be.
    pub inputs: &'a [InputPath],
}

impl LayerRun<'_> {
    /// Quantizes the layers the journal does not hold yet, recording each in it. Whatever
    /// happens, a layer that finished is recorded, so `--resume` can continue after it.
    /// The source checks hand the journal their hashes before it is first saved.
    pub fn run(
        &self,
        journal: &mut Journal,
        stages: &mut Stages,
        checks: &mut SourceChecks,
    ) -> Result<()> {
        for entry in &journal.layers {
            self.feed.layer_done(entry)?;
        }
        let mut pending = None;
        let r = self.run_pending(journal, stages, &mut pending, checks);
        let flushed = flush_pending(&mut pending, journal, self.jdir, self.feed, checks);
        r.and(flushed)
    }

    fn run_pending(
        &self,
        journal: &mut Journal,
        stages: &mut Stages,
        pending: &mut Option<PendingLayer>,
        checks: &mut SourceChecks,
    ) -> Result<()> {
        let mut pass = Pass::start(self, stages)?;
        let mut loader = LayerLoader::new(self.opts, self.cfg, self.ck)?;
        for entry in journal.layers.clone() {
            pass.replay(&entry)?;
        }
        for i in journal.layers.len()..self.cfg.num_hidden_layers() {
            if self.opts.stop_after_layers.is_some_and(|n| i >= n) {
                bail!("stopped after {i} layer(s) as requested (--stop-after-layers)");
            }
            crate::fault::point("a layer starts");
            let t_layer = Instant::now();
            // The next layer's weights are made ready beside this layer's work (GPU: copied to
            // page-locked memory; CPU: its pages mapped in), so loading it is a plain copy.
            let next =
                (i + 1 < self.cfg.num_hidden_layers()).then(|| layer_tensor_names(self.cfg, i + 1));
            let (cur, nxt) = loader.split(i);
            let LayerResult { rows, quantized } = std::thread::scope(|s| {
                let ready = next.map(|names| {
                    let ck = self.ck;
                    s.spawn(move || LayerLoader::prepare(nxt, ck, &names))
                });
                let r = pass.quantize_layer(i, cur);
                // A stage that could not be filled only means the next layer loads from the
                // checkpoint.
                let staged = ready.is_some_and(|h| matches!(h.join(), Ok(Ok(true))));
                r.map(|r| (r, staged))
            })
            .map(|(r, staged)| {
                loader.held = if staged { i + 1 } else { usize::MAX };
                r
            })?;
            // The previous layer's file was written while this layer computed.
            flush_pending(pending, journal, self.jdir, self.feed, checks)?;
            pass.stages.journal += pass.clock.lap()?;
            let dir = self.jdir.to_path_buf();
            let layout = self.layout;
            *pending = Some(PendingLayer {
                index: i,
                rows,
                seconds: t_layer.elapsed().as_secs_f64(),
                // Packed and written beside the next layer's computation.
                write: std::thread::spawn(move || {
                    let packed = quantized
                        .iter()
                        .map(|(name, q, bits)| {
                            Ok((
                                name.clone(),
                                pack(q, *bits, layout)
                                    .with_context(|| format!("packing {name}"))?,
                            ))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    journal::write_layer_file(&dir, i, &packed)
                }),
            });
            pass.pb.inc(1);
            crate::fault::delay("SOAR_GPTQ_TEST_LAYER_DELAY_MS");
        }
        pass.pb.finish_and_clear();
        Ok(())
    }
}

/// One pass over the layers: the hidden states of the calibration batches as they leave the
/// last layer done, and the clock and stage table the work is charged to.
struct Pass<'r, 's> {
    run: &'r LayerRun<'r>,
    model: AnyModel,
    /// Hidden states per batch (empty when no forward runs: RTN, or saved Hessians).
    states: Vec<Tensor>,
    /// GPTAQ: the full-precision model's hidden states per batch, on the same windows (empty
    /// otherwise).
    fp_states: Vec<Tensor>,
    calibrate: bool,
    clock: StageClock,
    stages: &'s mut Stages,
    pb: ProgressBar,
}

/// The Linears of one true-sequential subset and the per-group state of its solve.
struct Subset {
    groups: Vec<LinearGroup>,
    /// `(module, group)` in solve order.
    linears: Vec<(&'static str, LinearGroup)>,
    acc: BTreeMap<LinearGroup, HessianAccumulator>,
    hessians: BTreeMap<LinearGroup, Tensor>,
    /// GPTAQ's cross terms, per group.
    cross: BTreeMap<LinearGroup, Tensor>,
    /// One factorization per Hessian, shared by the Linears that read its input.
    factors: BTreeMap<LinearGroup, Factorization>,
}

/// What a quantized layer leaves for the journal: its report rows and each quantized Linear's
/// codes, scales and zeros with its bit width (packed on the journal thread).
#[derive(Default)]
struct LayerResult {
    rows: Vec<ModuleRow>,
    quantized: Vec<(String, QuantizedLinear, u8)>,
}

impl<'r, 's> Pass<'r, 's> {
    /// Loads the embedding and embeds the calibration windows, batch by batch.
    fn start(run: &'r LayerRun<'r>, stages: &'s mut Stages) -> Result<Self> {
        let opts = run.opts;
        let mut clock = StageClock::new(&opts.device);
        let model = AnyModel::load(run.ck, run.cfg, opts.dtype, &opts.device)
            .context("loading the embedding")?;
        // With saved Hessians no forward runs at all: each Linear is solved from its file; RTN
        // reads no activations either.
        let calibrate = opts.load_hessians.is_none() && opts.method.uses_hessians();
        let mut states = vec![];
        if calibrate {
            let seqlen = run.windows[0].len();
            for b in run.windows.chunks(opts.batch.max(1)) {
                let flat: Vec<u32> = b.iter().flatten().copied().collect();
                let ids = Tensor::from_vec(flat, (b.len(), seqlen), &opts.device)?;
                states.push(model.embed(&ids)?);
            }
        }
        stages.embed += clock.lap()?;
        let pb = crate::progress::bar(run.cfg.num_hidden_layers() as u64, "quantize");
        let fp_states = if opts.method == Method::Gptaq {
            states.clone()
        } else {
            vec![]
        };
        Ok(Self {
            run,
            model,
            states,
            fp_states,
            calibrate,
            clock,
            stages,
            pb,
        })
    }

    /// Replays a layer a previous run finished: its stored codes decoded into the layer, then
    /// the forward, exactly as after its solve.
    fn replay(&mut self, entry: &JournalLayer) -> Result<()> {
        let opts = self.run.opts;
        self.pb
            .set_message(format!("layer {} (replaying journal)", entry.index));
        let mut layer = self.model.load_layer(self.run.ck, entry.index)?;
        // GPTAQ's full-precision stream goes through the layer before its codes are decoded.
        for h in self.fp_states.iter_mut() {
            *h = layer.forward(h, &mut |_, _| Ok(()))?;
        }
        let lf = journal::open_layer_file(self.run.jdir, entry)?;
        for p in &self.run.plan.layers[entry.index] {
            let (m, Some(scheme)) = (&p.name, p.plan.scheme()) else {
                continue;
            };
            let prefix = format!("model.layers.{}.{m}", entry.index);
            let p = journal::read_packed(&lf, &prefix)?;
            let lin = layer.linear_mut(m)?;
            let (n, k) = lin.weight.dims2()?;
            lin.weight = decode_stored(
                &p,
                n,
                k,
                scheme.bits,
                self.run.layout,
                opts.dtype,
                &opts.device,
            )?;
        }
        self.stages.load += self.clock.lap()?;
        for h in self.states.iter_mut() {
            *h = layer.forward(h, &mut |_, _| Ok(()))?;
        }
        self.stages.forward += self.clock.lap()?;
        self.pb.inc(1);
        Ok(())
    }

    /// Quantizes layer `i` subset by subset and runs it forward on the calibration states; its
    /// weights come from `staged` where it holds them (made ready while the previous layer
    /// computed), else from the checkpoint.
    fn quantize_layer(&mut self, i: usize, staged: Option<&Stage>) -> Result<LayerResult> {
        let opts = self.run.opts;
        let ck = self.run.ck;
        let get = |name: &str| -> Result<Tensor> {
            if let Some(st) = staged {
                let shape = &ck
                    .get(name)
                    .ok_or_else(|| anyhow!("no tensor {name}"))?
                    .shape;
                if let Some(t) = st.upload(&opts.device, name, ck.stored_dtype(name)?, shape)? {
                    return Ok(t.to_dtype(opts.dtype)?);
                }
            }
            ck.tensor(name, opts.dtype, &opts.device)
        };
        let load = || {
            AnyLayer::from_tensors(self.run.cfg, i, &get)
                .with_context(|| format!("loading decoder layer {i}"))
        };
        // GPTAQ: the layer as the full-precision model has it too, for the target inputs.
        let loaded = load().and_then(|l| {
            let fp = if self.fp_states.is_empty() {
                None
            } else {
                Some(load()?)
            };
            Ok((l, fp))
        });
        // The stage's copies to the device are done before it can be refilled or freed, whether
        // the load worked or not.
        if staged.is_some() {
            opts.device.synchronize()?;
        }
        let (mut layer, fp_layer) = loaded?;
        self.stages.load += self.clock.lap()?;
        let subsets: Vec<Vec<LinearGroup>> = if opts.true_sequential {
            LinearGroup::ALL.iter().map(|g| vec![*g]).collect()
        } else {
            vec![LinearGroup::ALL.to_vec()]
        };
        let mut out = LayerResult::default();
        let mut cache = LayerCache::default();
        let mut fp_cache = LayerCache::default();
        for groups in subsets {
            let mut subset = self.subset(&mut layer, i, groups)?;
            if opts.true_sequential && self.calibrate {
                self.fill_cache(&layer, i, subset.groups[0], &mut cache, Stream::Quantized)?;
                if let Some(fpl) = &fp_layer {
                    self.fill_cache(fpl, i, subset.groups[0], &mut fp_cache, Stream::Full)?;
                }
            }
            if opts.method.uses_hessians() {
                let fp = fp_layer.as_ref().map(|l| (l, &fp_cache));
                self.hessians(&layer, i, &cache, fp, &mut subset)?;
            }
            for (m, g) in subset.linears.clone() {
                let full = format!("model.layers.{i}.{m}");
                let ModulePlan::Quantize(scheme) = self.run.plan.get(i, m) else {
                    out.rows.push(ModuleRow::skipped(&full, g));
                    continue;
                };
                self.pb.set_message(format!("layer {i}: solving {m}"));
                let quant = gptq::QuantParams {
                    bits: scheme.bits,
                    group_size: scheme.group_size,
                    ..self.run.quant
                };
                self.solve_linear(&mut layer, (i, m, g), quant, &mut subset, &mut out)?;
            }
        }
        self.pb.set_message(format!("layer {i}: forward"));
        if let Some(fpl) = &fp_layer {
            match (fp_cache.h1.take(), fp_cache.act.take()) {
                (Some(h1), Some(act)) => {
                    for ((h, h1), act) in self.fp_states.iter_mut().zip(&h1).zip(&act) {
                        *h = fpl.mlp_residual(h1, act)?;
                    }
                }
                _ => bail!("internal: GPTAQ's full-precision layer cache is incomplete"),
            }
        }
        match (cache.h1.take(), cache.act.take()) {
            (Some(h1), Some(act)) => {
                for ((h, h1), act) in self.states.iter_mut().zip(&h1).zip(&act) {
                    *h = layer.mlp_residual(h1, act)?;
                }
            }
            _ => {
                for h in self.states.iter_mut() {
                    *h = layer.forward(h, &mut |_, _| Ok(()))?;
                }
            }
        }
        self.stages.forward += self.clock.lap()?;
        Ok(out)
    }

    /// The Linears of `groups` in layer `i` with an empty accumulator per group.
    fn subset(&self, layer: &mut AnyLayer, i: usize, groups: Vec<LinearGroup>) -> Result<Subset> {
        let linears: Vec<(&'static str, LinearGroup)> = sequential(self.run.cfg.layer_linears(i))
            .into_iter()
            .filter(|l| groups.contains(&l.group))
            .map(|l| (l.name, l.group))
            .collect();
        let mut acc = BTreeMap::new();
        for &g in &groups {
            let m = linears
                .iter()
                .find(|(_, gg)| *gg == g)
                .expect("each group has a Linear")
                .0;
            let k = layer.linear_mut(m)?.weight.dim(1)?;
            let mut a = HessianAccumulator::new(k, &self.run.opts.device)?;
            a.set_module_names(
                linears
                    .iter()
                    .filter(|(_, gg)| *gg == g)
                    .map(|(n, _)| format!("model.layers.{i}.{n}"))
                    .collect(),
            );
            acc.insert(g, a);
        }
        self.pb.set_message(format!(
            "layer {i}: Hessians {}",
            groups
                .iter()
                .map(|g| g.name())
                .collect::<Vec<_>>()
                .join("+")
        ));
        Ok(Subset {
            groups,
            linears,
            acc,
            hessians: BTreeMap::new(),
            cross: BTreeMap::new(),
            factors: BTreeMap::new(),
        })
    }

    /// True-sequential: once the Linears before a subset are quantized, its input is fixed;
    /// compute it once per batch and keep it (the mixer output for o_proj, the post-attention
    /// state for gate/up, the MLP activation for down_proj).
    fn fill_cache(
        &mut self,
        layer: &AnyLayer,
        i: usize,
        g: LinearGroup,
        cache: &mut LayerCache,
        stream: Stream,
    ) -> Result<()> {
        self.stages.forward += self.clock.lap()?;
        let states = match stream {
            Stream::Quantized => &self.states,
            Stream::Full => &self.fp_states,
        };
        match g {
            LinearGroup::Qkv => {}
            LinearGroup::O => {
                self.pb.set_message(format!("layer {i}: attention"));
                cache.mixer = Some(
                    states
                        .iter()
                        .map(|h| layer.mixer_output(h))
                        .collect::<Result<Vec<_>>>()?,
                );
                let t = self.clock.lap()?;
                self.stages.forward += t;
                match layer.mixer_name() {
                    "minicpm4" => self.stages.mixer_sparse += t,
                    "lightning-attn" => self.stages.mixer_lightning += t,
                    _ => self.stages.mixer_attention += t,
                }
            }
            LinearGroup::GateUp => {
                let mixer = cache.mixer.take().expect("computed for o_proj");
                cache.h1 = Some(
                    states
                        .iter()
                        .zip(&mixer)
                        .map(|(h, m)| layer.attn_residual(h, m))
                        .collect::<Result<Vec<_>>>()?,
                );
            }
            LinearGroup::Down => {
                let h1 = cache.h1.as_ref().expect("computed for gate/up");
                cache.act = Some(
                    h1.iter()
                        .map(|h| layer.mlp_act(&layer.mlp_input(h)?))
                        .collect::<Result<Vec<_>>>()?,
                );
            }
        }
        self.stages.forward += self.clock.lap()?;
        Ok(())
    }

    /// The subset's Hessians: loaded from `--load-hessians`, or accumulated from its inputs
    /// (cached ones under true-sequential, otherwise captured in one forward); saved when
    /// `--save-hessians` asks.
    fn hessians(
        &mut self,
        layer: &AnyLayer,
        i: usize,
        cache: &LayerCache,
        fp: Option<(&AnyLayer, &LayerCache)>,
        subset: &mut Subset,
    ) -> Result<()> {
        let opts = self.run.opts;
        match &opts.load_hessians {
            Some(dir) => {
                for (g, a) in subset.acc.iter_mut() {
                    *a = load_saved_hessian(dir, i, *g, a, &opts.device)?;
                }
                self.stages.hessians += self.clock.lap()?;
            }
            None if opts.true_sequential => {
                let g = subset.groups[0];
                let a = subset.acc.get_mut(&g).expect("accumulator per group");
                for bi in 0..self.states.len() {
                    let x = cache.input(layer, g, &self.states, bi)?;
                    let x_fp = match fp {
                        Some((fpl, fpc)) => Some(fpc.input(fpl, g, &self.fp_states, bi)?),
                        None => None,
                    };
                    self.stages.forward += self.clock.lap()?;
                    let (rows, k) = x.dims2()?;
                    let products = match &x_fp {
                        Some(x_fp) => {
                            a.add_pair(&x, x_fp)?;
                            2.0
                        }
                        None => {
                            a.add_batch(&x, None)?;
                            1.0
                        }
                    };
                    self.stages.hessian_flops += products * 2.0 * rows as f64 * (k * k) as f64;
                    self.stages.hessians += self.clock.lap()?;
                }
            }
            None => accumulate(
                layer,
                &self.states,
                &subset.groups,
                &mut subset.acc,
                &mut self.clock,
                self.stages,
            )?,
        }
        for (g, a) in &subset.acc {
            if let Some(dir) = &opts.save_hessians {
                let path = dir.join(format!("layer-{i:05}.{}.safetensors", g.name()));
                // --force or --resume allowed the folder's old files to be replaced.
                a.save(&OutputFile::check(
                    "--save-hessians",
                    &path,
                    true,
                    self.run.inputs,
                )?)?;
            }
            subset.hessians.insert(*g, a.hessian()?);
            if let Some(d) = a.cross_term()? {
                subset.cross.insert(*g, d);
            }
        }
        self.stages.hessians += self.clock.lap()?;
        Ok(())
    }

    /// Solves one Linear (GPTQ on its group's factorization, or RTN), packs it, and puts the
    /// weights a server decodes back into the layer.
    fn solve_linear(
        &mut self,
        layer: &mut AnyLayer,
        (i, m, g): (usize, &str, LinearGroup),
        quant: QuantParams,
        subset: &mut Subset,
        out: &mut LayerResult,
    ) -> Result<()> {
        let opts = self.run.opts;
        let full = format!("model.layers.{i}.{m}");
        let t = Instant::now();
        let lin = layer.linear_mut(m)?;
        let w = lin.weight.clone();
        let sopts = SolveOptions {
            quant,
            act_order: opts.act_order,
            damp: opts.damp,
            block_size: 128,
            module: full.clone(),
        };
        if opts.method.uses_hessians() && !subset.factors.contains_key(&g) {
            let fopts = SolveOptions {
                module: subset.acc[&g].module_names().join(", "),
                ..sopts.clone()
            };
            let mut f = gptq::factorize(&subset.hessians[&g], &fopts)?;
            if opts.method == Method::Gptaq {
                let d = subset
                    .cross
                    .get(&g)
                    .ok_or_else(|| anyhow!("internal: no GPTAQ cross term for {}", fopts.module))?;
                f = f
                    .with_gptaq(d, opts.gptaq_alpha)
                    .with_context(|| format!("GPTAQ for {}", fopts.module))?;
            }
            subset.factors.insert(g, f);
            self.stages.factorization += self.clock.lap()?;
        }
        let mut q = match opts.method {
            Method::Gptq | Method::Gptaq => {
                gptq::gptq_quantize_factored(&w, &subset.factors[&g], &sopts)?
            }
            Method::Rtn => gptq::rtn_quantize(&w, &sopts)?,
        };
        self.stages.column_loop += self.clock.lap()?;
        if opts.refit {
            if let (Some(f), Some(h)) = (subset.factors.get(&g), subset.hessians.get(&g)) {
                gptq::refit_scales(&mut q, &f.target(&w)?, h)
                    .with_context(|| format!("refitting the scales of {full}"))?;
                self.stages.refit += self.clock.lap()?;
            }
        }
        let (n, k) = (q.n, q.k);
        let deq = decode_codes(&q, opts.dtype, &opts.device)?;
        q.device_codes = None;
        self.stages.decode += self.clock.lap()?;
        let rel = match subset.hessians.get(&g) {
            Some(h) => Some(relative_output_error(&w, &deq, h)?),
            None => None,
        };
        self.stages.report += self.clock.lap()?;
        lin.weight = deq;
        let row = ModuleRow {
            module: full.clone(),
            group: g.name().to_string(),
            n,
            k,
            quantized: true,
            bits: quant.bits,
            group_size: quant.group_size.to_i64(),
            loss: q.loss,
            rel_output_error: rel,
            damp: q.damp_used,
            dead_columns: q.dead_columns,
            seconds: t.elapsed().as_secs_f64(),
        };
        crate::progress::println(&self.pb, row.line());
        out.rows.push(row);
        out.quantized.push((full, q, quant.bits));
        Ok(())
    }
}

/// A page-locked copy of a decoder layer's weights (`kernels::cuda::PinnedStage`); without the
/// `cuda` feature a type that is never made.
#[cfg(feature = "cuda")]
type Stage = crate::kernels::cuda::PinnedStage;

#[cfg(not(feature = "cuda"))]
enum Stage {}

#[cfg(not(feature = "cuda"))]
impl Stage {
    fn fill(&mut self, _: &[(String, &[u8])]) -> Result<()> {
        match *self {}
    }
    fn upload(&self, _: &Device, _: &str, _: DType, _: &[usize]) -> Result<Option<Tensor>> {
        match *self {}
    }
}

/// Where each layer's weights come from. On a GPU two page-locked stages take turns: while
/// layer i computes from one, a thread copies layer i + 1 into the other, so its load is one DMA
/// per tensor (the driver's copy of pageable, mapped memory ran at ~8 GB/s). On the CPU the
/// thread maps the next layer's pages in.
struct LayerLoader {
    stages: Option<[Stage; 2]>,
    /// The layer the stage for the next `split` holds (none yet: the first layer loads from the
    /// checkpoint).
    held: usize,
}

impl LayerLoader {
    fn new(opts: &QuantizeOptions, cfg: &AnyConfig, ck: &Checkpoint) -> Result<Self> {
        let stages = if opts.device.is_cuda() {
            let mut bytes = 0usize;
            for i in 0..cfg.num_hidden_layers() {
                let mut sum = 0;
                for name in layer_tensor_names(cfg, i) {
                    sum += ck.bytes(&name)?.len();
                }
                bytes = bytes.max(sum);
            }
            // Without page-locked memory (a memlock limit, say) layers load from the checkpoint.
            Self::pinned(&opts.device, bytes).unwrap_or(None)
        } else {
            None
        };
        Ok(Self {
            stages,
            held: usize::MAX,
        })
    }

    #[cfg(feature = "cuda")]
    fn pinned(device: &Device, bytes: usize) -> Result<Option<[Stage; 2]>> {
        Ok(Some([
            Stage::new(device, bytes)?,
            Stage::new(device, bytes)?,
        ]))
    }

    #[cfg(not(feature = "cuda"))]
    fn pinned(_: &Device, _: usize) -> Result<Option<[Stage; 2]>> {
        Ok(None)
    }

    /// The stage layer `i` reads from (if it holds layer i) and the one to fill with layer i + 1.
    fn split(&mut self, i: usize) -> (Option<&Stage>, Option<&mut Stage>) {
        let held = self.held;
        match &mut self.stages {
            Some([a, b]) => {
                let (cur, next) = if i.is_multiple_of(2) { (a, b) } else { (b, a) };
                ((held == i).then_some(&*cur), Some(next))
            }
            None => (None, None),
        }
    }

    /// Makes the layer whose tensors are `names` ready: copied into `stage`, or (no stage) its
    /// pages mapped in. Runs beside the computation. Returns whether a stage was filled.
    fn prepare(stage: Option<&mut Stage>, ck: &Checkpoint, names: &[String]) -> Result<bool> {
        match stage {
            Some(st) => {
                let tensors = names
                    .iter()
                    .map(|n| Ok((n.clone(), ck.bytes(n)?)))
                    .collect::<Result<Vec<_>>>()?;
                st.fill(&tensors)?;
                Ok(true)
            }
            None => {
                for n in names {
                    ck.prefault(n)?;
                }
                Ok(false)
            }
        }
    }
}

/// The full names (`model.layers.{i}.…`) of decoder layer `i`'s tensors.
fn layer_tensor_names(cfg: &AnyConfig, i: usize) -> Vec<String> {
    cfg.layer_tensors(i)
        .into_iter()
        .map(|(n, _)| format!("model.layers.{i}.{n}"))
        .collect()
}

/// Sentinel error that ends a layer's forward once the wanted subset's input has been seen.
#[derive(Debug)]
struct StopForward;
impl std::fmt::Display for StopForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("forward stopped after capture")
    }
}
impl std::error::Error for StopForward {}

fn pack(q: &QuantizedLinear, bits: u8, layout: QuantFormat) -> Result<Packed> {
    let (n, k) = (q.n, q.k);
    let groups = q.n_groups();
    Ok(Packed {
        qweight: format::pack::pack_qweight_nk(&q.codes, n, k, bits)?,
        qzeros: format::pack_qzeros(&q.zeros, groups, n, bits, layout)?,
        scales_f16: format::f32_to_f16_le_bytes(&q.scales),
        g_idx: q.g_idx.clone(),
    })
}

/// The weights a server computes with, straight from a solve's codes: `scale · (code − zero)`
/// with the scales rounded to fp16 as they are stored, as `[N, K]` in `dtype` on `device` (on the
/// GPU from the codes the solve left there). Bit-identical to [`decode_stored`] of the packed
/// tensors (the packing is lossless and both compute the same f32 product; a test checks it),
/// so the packing can run on the journal thread while the next layer computes.
fn decode_codes(q: &QuantizedLinear, dtype: DType, device: &Device) -> Result<Tensor> {
    let (n, k, groups) = (q.n, q.k, q.n_groups());
    if let Some(pos) = q.g_idx.iter().position(|&g| g < 0 || g as usize >= groups) {
        bail!(
            "internal: g_idx[{pos}] = {} is outside the {groups} scale groups",
            q.g_idx[pos]
        );
    }
    let codes = match &q.device_codes {
        Some(c) if c.device().same_device(device) => c.clone(),
        _ => Tensor::from_slice(&q.codes, (n, k), device)?,
    };
    let g_idx: Vec<u32> = q.g_idx.iter().map(|&g| g as u32).collect();
    let g_idx = Tensor::from_vec(g_idx, k, device)?;
    // `[groups, N]` per-group values as `[N, K]`, column k holding group g_idx[k]'s.
    let per_column = |v: Vec<f32>| -> Result<Tensor> {
        Ok(Tensor::from_vec(v, (groups, n), device)?
            .t()?
            .contiguous()?
            .index_select(&g_idx, 1)?)
    };
    let scales = per_column(
        q.scales
            .iter()
            .map(|&s| half::f16::from_f32(s).to_f32())
            .collect(),
    )?;
    let zeros = per_column(q.zeros.iter().map(|&z| f32::from(z)).collect())?;
    Ok(codes
        .to_dtype(DType::F32)?
        .sub(&zeros)?
        .mul(&scales)?
        .to_dtype(dtype)?)
}

/// The weights a server computes with: decoded from the stored tensors (fp16 scales), as
/// `[N, K]` in `dtype`. Used both after a solve and when a resumed run replays finished layers,
/// so both paths feed the next layer bit-identical weights.
fn decode_stored(
    p: &Packed,
    n: usize,
    k: usize,
    bits: u8,
    layout: QuantFormat,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let scales = format::f16_le_bytes_to_f32(&p.scales_f16)?;
    let t = format::GptqTensors {
        qweight: &p.qweight,
        qzeros: &p.qzeros,
        scales: &scales,
        g_idx: &p.g_idx,
        k,
        n,
        bits,
        format: layout,
    };
    Ok(format::dequantize_gptq_tensor(&t, device)?.to_dtype(dtype)?)
}

/// ||X(W−Q)ᵀ||_F / ||XWᵀ||_F on the calibration tokens, from H ∝ XᵀX: sqrt(tr(D H Dᵀ) / tr(W H Wᵀ)).
/// A report figure, not part of the output: on a GPU the products run in BF16 with f32
/// accumulation (N·K² per module would otherwise cost more than the solve).
fn relative_output_error(w: &Tensor, q: &Tensor, h: &Tensor) -> Result<f64> {
    let w = w.to_dtype(DType::F32)?;
    let d = (&w - q.to_dtype(DType::F32)?)?;
    let gpu = w.device().is_cuda();
    let hb = if gpu {
        h.to_dtype(DType::BF16)?
    } else {
        h.clone()
    };
    let quad = |m: &Tensor| -> Result<f64> {
        if gpu {
            let mh = m.to_dtype(DType::BF16)?.matmul(&hb)?.to_dtype(DType::F32)?;
            // Row sums first: candle reduces a whole tensor in one thread block, which cost
            // more than the products (about 1 s of the 9.5B's report stage).
            return Ok(mh
                .mul(m)?
                .sum(1)?
                .to_dtype(DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?);
        }
        Ok(m.matmul(h)?
            .mul(m)?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?)
    };
    let den = quad(&w)?;
    Ok(if den > 0.0 {
        (quad(&d)? / den).max(0.0).sqrt()
    } else {
        0.0
    })
}

/// Which hidden-state stream a layer cache is filled from.
#[derive(Clone, Copy)]
enum Stream {
    /// The partly quantized model (what GPTQ calibrates on).
    Quantized,
    /// GPTAQ's full-precision model.
    Full,
}

/// Per-batch results of the current layer kept across true-sequential subsets.
#[derive(Default)]
struct LayerCache {
    /// The mixer's gated output (input of o_proj), after q/k/v/gate are quantized.
    mixer: Option<Vec<Tensor>>,
    /// `h + o_proj(mixer)·residual`, after o_proj is quantized.
    h1: Option<Vec<Tensor>>,
    /// The MLP activation (input of down_proj), after gate/up are quantized.
    act: Option<Vec<Tensor>>,
}

impl LayerCache {
    /// The input of group `g` for batch `bi`, flattened to `[B·T, K]`.
    fn input(
        &self,
        layer: &AnyLayer,
        g: LinearGroup,
        states: &[Tensor],
        bi: usize,
    ) -> Result<Tensor> {
        let flat = |x: &Tensor| -> Result<Tensor> {
            let k = x.dim(candle_core::D::Minus1)?;
            Ok(x.reshape(((), k))?)
        };
        match g {
            LinearGroup::Qkv => flat(&layer.input_norm(&states[bi])?),
            LinearGroup::O => flat(&self.mixer.as_ref().expect("mixer computed")[bi]),
            LinearGroup::GateUp => {
                flat(&layer.mlp_input(&self.h1.as_ref().expect("h1 computed")[bi])?)
            }
            LinearGroup::Down => flat(&self.act.as_ref().expect("act computed")[bi]),
        }
    }
}

/// Runs `layer` over all hidden-state batches, feeding the inputs of `groups` to their
/// accumulators and stopping each forward after the last wanted group (all groups at once:
/// `--no-true-sequential`). Time up to each capture is charged to the forward, the accumulation
/// itself to the Hessians.
fn accumulate(
    layer: &AnyLayer,
    states: &[Tensor],
    groups: &[LinearGroup],
    acc: &mut BTreeMap<LinearGroup, HessianAccumulator>,
    clock: &mut StageClock,
    stages: &mut Stages,
) -> Result<()> {
    let last = *groups.iter().max().expect("at least one group");
    for h in states {
        let mut capture = |g: LinearGroup, x: &Tensor| -> Result<()> {
            if groups.contains(&g) {
                stages.forward += clock.lap()?;
                let a = acc.get_mut(&g).expect("accumulator per group");
                a.add_batch(x, None)?;
                let (rows, k) = x.dims2()?;
                stages.hessian_flops += 2.0 * rows as f64 * (k * k) as f64;
                stages.hessians += clock.lap()?;
            }
            if g == last {
                return Err(StopForward.into());
            }
            Ok(())
        };
        match layer.forward(h, &mut capture) {
            Ok(_) => {}
            Err(e) if e.downcast_ref::<StopForward>().is_some() => {}
            Err(e) => return Err(e),
        }
    }
    stages.forward += clock.lap()?;
    Ok(())
}

/// The Hessian of group `g` of layer `i` as saved by `--save-hessians`, checked against the
/// modules and width this run expects.
fn load_saved_hessian(
    dir: &Path,
    i: usize,
    g: LinearGroup,
    want: &HessianAccumulator,
    device: &Device,
) -> Result<HessianAccumulator> {
    let path = dir.join(format!("layer-{i:05}.{}.safetensors", g.name()));
    if !path.is_file() {
        bail!(
            "--load-hessians {}: {} is missing; save Hessians with --save-hessians from a run over the same model",
            dir.display(),
            path.display()
        );
    }
    let a = HessianAccumulator::load(&path, device)?;
    if a.k() != want.k() || a.module_names() != want.module_names() {
        bail!(
            "--load-hessians: {} serves {:?} with K = {}, but this run needs {:?} with K = {}: it was saved from another model",
            path.display(),
            a.module_names(),
            a.k(),
            want.module_names(),
            want.k()
        );
    }
    Ok(a)
}

/// A finished layer whose journal file is being written (and hashed) on a background thread
/// while the next layer computes.
struct PendingLayer {
    index: usize,
    rows: Vec<ModuleRow>,
    seconds: f64,
    write: std::thread::JoinHandle<Result<(String, String)>>,
}

/// Waits for the pending layer's file, records the layer in the journal and hands it to the
/// shard stream.
fn flush_pending(
    pending: &mut Option<PendingLayer>,
    journal: &mut Journal,
    jdir: &Path,
    feed: &StreamFeed,
    checks: &mut SourceChecks,
) -> Result<()> {
    if let Some(p) = pending.take() {
        let (file, sha256) = p
            .write
            .join()
            .map_err(|_| anyhow!("the journal writer thread panicked"))??;
        // A damaged source is not journaled.
        let sums = checks.finish()?;
        journal.layers.push(JournalLayer {
            index: p.index,
            file,
            sha256,
            rows: p.rows,
            seconds: p.seconds,
        });
        if let Some(sums) = sums {
            journal.hashes.source_sha256 = sums;
        }
        journal.save(jdir)?;
        feed.layer_done(journal.layers.last().expect("just pushed"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gptq::SolveTimings;
    use crate::rng::SplitMix64;

    /// A solve's result with random codes, scales and zeros, and an act-order g_idx.
    fn random_linear(
        rng: &mut SplitMix64,
        n: usize,
        k: usize,
        bits: u8,
        g: usize,
    ) -> QuantizedLinear {
        let maxq = (1u64 << bits) - 1;
        let groups = k / g;
        let mut perm: Vec<usize> = (0..k).collect();
        for i in (1..k).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut g_idx = vec![0i32; k];
        for (pos, &col) in perm.iter().enumerate() {
            g_idx[col] = (pos / g) as i32;
        }
        QuantizedLinear {
            n,
            k,
            codes: (0..n * k)
                .map(|_| (rng.next_u64() % (maxq + 1)) as u8)
                .collect(),
            scales: (0..groups * n)
                .map(|_| (rng.normal().abs() as f32 + 0.05) * 1e-2)
                .collect(),
            // 1..=maxq: GPTQ v1 cannot store a zero point of 0.
            zeros: (0..groups * n)
                .map(|_| (1 + rng.next_u64() % maxq) as u8)
                .collect(),
            g_idx,
            loss: 0.0,
            damp_used: 0.0,
            dead_columns: 0,
            timings: SolveTimings::default(),
            device_codes: None,
        }
    }

    /// What the layer loop decodes right after a solve equals, bit for bit, what it decodes
    /// from the packed tensors when a resumed run replays the layer (every width, both GPTQ
    /// layouts, act-order groups).
    #[test]
    fn decoding_the_codes_equals_decoding_the_packed_tensors() {
        let mut rng = SplitMix64::new(41);
        let dev = Device::Cpu;
        for bits in [2u8, 3, 4, 8] {
            for layout in [QuantFormat::GptqV1, QuantFormat::GptqV2] {
                let (n, k) = (64, 256);
                let q = random_linear(&mut rng, n, k, bits, 32);
                let p = pack(&q, bits, layout).unwrap();
                for dtype in [DType::F32, DType::BF16] {
                    let from_codes = decode_codes(&q, dtype, &dev).unwrap();
                    let stored = decode_stored(&p, n, k, bits, layout, dtype, &dev).unwrap();
                    let bits_of = |t: &Tensor| -> Vec<u32> {
                        t.to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect()
                    };
                    assert_eq!(
                        bits_of(&from_codes),
                        bits_of(&stored),
                        "{bits} bits, {layout:?}, {dtype:?}"
                    );
                }
            }
        }
    }
}
