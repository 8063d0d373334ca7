//! One pass over the decoder layers: per layer, the true-sequential subsets
//! ([q, k, v, gate] → [o] → [gate, up] → [down]), each with a pass over the calibration
//! batches that feeds its Hessian, its solve, and the decoded weights put back; then the pass
//! that moves every batch's hidden state through the quantized layer (docs/algorithm.md,
//! True-sequential subsets and Streaming the calibration).
//!
//! Every pass reads a batch's hidden state from where [`States`] keeps it and computes from it
//! what it needs. The mixer outputs (o_proj's input) and the MLP activations (down_proj's) are
//! kept for the next pass while the cache budget lasts, and recomputed from the hidden state
//! otherwise: the same operations on the same inputs, so the output is the same either way.

use super::decode::{decode_codes, relative_output_error};
use super::loader::PinnedStage;
use super::store::{Budget, Cache, States};
use super::LayerRun;
use crate::checkpoint::guard::OutputFile;
use crate::gptq::{
    self, Factorization, HessianAccumulator, QuantParams, QuantizedLinear, SolveOptions,
};
use crate::model::{sequential, AnyLayer, AnyModel, LinearGroup};
use crate::quantize::journal::{self, JournalLayer};
use crate::quantize::plan::ModulePlan;
use crate::quantize::stages::{StageClock, StageSeconds};
use crate::quantize::{Method, ModuleRow};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use indicatif::ProgressBar;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// One pass over the layers: the hidden states of the calibration batches as they leave the
/// last layer done, and the clock and stage table the work is charged to.
pub(super) struct Pass<'r, 's> {
    run: &'r LayerRun<'r>,
    model: AnyModel,
    /// Hidden states per batch (empty when no forward runs: RTN, or saved Hessians).
    states: States,
    /// GPTAQ: the full-precision model's hidden states per batch, on the same windows.
    fp_states: Option<States>,
    calibrate: bool,
    /// Bytes the per-layer caches may hold on the compute device.
    budget: Budget,
    pub(super) clock: StageClock,
    pub(super) stages: &'s mut StageSeconds,
    pub(super) pb: ProgressBar,
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
pub(super) struct LayerResult {
    pub rows: Vec<ModuleRow>,
    pub quantized: Vec<(String, QuantizedLinear, u8)>,
}

/// A layer and the state of its pass for one stream: the layer's weights, the hidden states
/// and the caches of the intermediates later subsets read.
struct Stream<'a> {
    layer: &'a AnyLayer,
    states: &'a mut States,
    mixer: Cache,
    act: Cache,
}

impl Stream<'_> {
    /// The mixer output of batch `bi`: kept from the o_proj pass, or recomputed.
    fn mixer(&mut self, bi: usize, h: &Tensor, budget: &mut Budget) -> Result<Tensor> {
        match self.mixer.take(bi, budget)? {
            Some(m) => Ok(m),
            None => self.layer.mixer_output(h),
        }
    }

    /// The MLP activation of batch `bi` from its post-attention state `h1`: kept from the
    /// down_proj pass, or recomputed.
    fn act(&mut self, bi: usize, h1: &Tensor, budget: &mut Budget) -> Result<Tensor> {
        match self.act.take(bi, budget)? {
            Some(a) => Ok(a),
            None => self.layer.mlp_act(&self.layer.mlp_input(h1)?),
        }
    }
}

fn flat(x: &Tensor) -> Result<Tensor> {
    let k = x.dim(candle_core::D::Minus1)?;
    Ok(x.reshape(((), k))?)
}

impl<'r, 's> Pass<'r, 's> {
    /// Loads the embedding and embeds the calibration windows, batch by batch, into states kept
    /// where `run.residency` says.
    pub(super) fn start(run: &'r LayerRun<'r>, stages: &'s mut StageSeconds) -> Result<Self> {
        let opts = run.opts;
        let compute = run.compute;
        let mut clock = StageClock::new(&compute.device);
        let model = AnyModel::load(run.ck, run.cfg, compute.dtype, &compute.device)
            .context("loading the embedding")?;
        // With saved Hessians no forward runs at all: each Linear is solved from its file; RTN
        // reads no activations either.
        let calibrate = opts.load_hessians.is_none() && opts.method.uses_hessians();
        let r = &run.residency;
        let mut states = States::new(r.states, &compute.device, Some(&run.spill), "h")?;
        if calibrate {
            for range in crate::calib::batch_ranges(run.windows, opts.batch) {
                let b = &run.windows[range];
                let flat: Vec<u32> = b.iter().flatten().copied().collect();
                let ids = Tensor::from_vec(flat, (b.len(), b[0].len()), &compute.device)?;
                states.push(model.embed(&ids)?)?;
            }
        }
        stages.embed += clock.lap()?;
        let pb = crate::progress::bar(run.cfg.num_hidden_layers() as u64, "quantize");
        let fp_states = if opts.method == Method::Gptaq {
            Some(states.duplicate("fp")?)
        } else {
            None
        };
        Ok(Self {
            run,
            model,
            states,
            fp_states,
            calibrate,
            budget: Budget::new(r.cache_bytes, r.host_cache_bytes, &compute.device)?,
            clock,
            stages,
            pb,
        })
    }

    /// Replays a layer a previous run finished: its stored codes decoded into the layer, then
    /// the forward, exactly as after its solve.
    pub(super) fn replay(&mut self, entry: &JournalLayer) -> Result<()> {
        let compute = self.run.compute;
        self.pb
            .set_message(format!("layer {} (replaying journal)", entry.index));
        let mut layer = self.model.load_layer(self.run.ck, entry.index)?;
        // GPTAQ's full-precision stream goes through the layer before its codes are decoded.
        if let Some(fp) = self.fp_states.as_mut() {
            forward_all(&layer, fp)?;
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
            lin.weight = super::decode::decode_stored(
                &p,
                n,
                k,
                scheme.bits.get(),
                self.run.format,
                compute.dtype,
                &compute.device,
            )?;
        }
        self.stages.load += self.clock.lap()?;
        forward_all(&layer, &mut self.states)?;
        self.stages.forward += self.clock.lap()?;
        self.pb.inc(1);
        Ok(())
    }

    /// Quantizes layer `i` subset by subset and runs it forward on the calibration states; its
    /// weights come from `staged` where it holds them (made ready while the previous layer
    /// computed), else from the checkpoint.
    pub(super) fn quantize_layer(
        &mut self,
        i: usize,
        staged: Option<&PinnedStage>,
    ) -> Result<LayerResult> {
        let opts = self.run.opts;
        let (mut layer, fp_layer) = self.load_layer(i, staged)?;
        let subsets: Vec<Vec<LinearGroup>> = if opts.true_sequential {
            LinearGroup::ALL.iter().map(|g| vec![*g]).collect()
        } else {
            vec![LinearGroup::ALL.to_vec()]
        };
        let mut out = LayerResult::default();
        let (mut caches, mut fp_caches) = (
            (Cache::with_host(), Cache::default()),
            (Cache::with_host(), Cache::default()),
        );
        for groups in subsets {
            let mut subset = self.subset(&mut layer, i, groups)?;
            if opts.method.uses_hessians() {
                self.hessians(
                    &layer,
                    fp_layer.as_ref(),
                    i,
                    &mut subset,
                    &mut caches,
                    &mut fp_caches,
                )?;
            }
            for (m, g) in subset.linears.clone() {
                let full = format!("model.layers.{i}.{m}");
                let ModulePlan::Quantize(scheme) = self.run.plan.get(i, m) else {
                    out.rows.push(ModuleRow::skipped(&full, g));
                    continue;
                };
                self.pb.set_message(format!("layer {i}: solving {m}"));
                let quant = gptq::QuantParams {
                    bits: scheme.bits.get(),
                    group_size: scheme.group_size,
                    ..self.run.quant
                };
                self.solve_linear(&mut layer, (i, m, g), quant, &mut subset, &mut out)?;
            }
        }
        self.pb.set_message(format!("layer {i}: forward"));
        if let (Some(fpl), Some(fps)) = (&fp_layer, self.fp_states.as_mut()) {
            let mut s = Stream {
                layer: fpl,
                states: fps,
                mixer: fp_caches.0,
                act: fp_caches.1,
            };
            finish_layer(&mut s, opts.true_sequential, &mut self.budget)?;
        }
        let mut s = Stream {
            layer: &layer,
            states: &mut self.states,
            mixer: caches.0,
            act: caches.1,
        };
        if self.calibrate {
            finish_layer(&mut s, opts.true_sequential, &mut self.budget)?;
        }
        self.stages.forward += self.clock.lap()?;
        Ok(out)
    }

    /// Layer `i` (and for GPTAQ the same layer as the full-precision model keeps it).
    fn load_layer(
        &mut self,
        i: usize,
        staged: Option<&PinnedStage>,
    ) -> Result<(AnyLayer, Option<AnyLayer>)> {
        let compute = self.run.compute;
        let ck = self.run.ck;
        let get = |name: &str| -> Result<Tensor> {
            if let Some(st) = staged {
                let shape = &ck
                    .get(name)
                    .ok_or_else(|| anyhow!("no tensor {name}"))?
                    .shape;
                if let Some(t) = st.upload(&compute.device, name, ck.stored_dtype(name)?, shape)? {
                    return Ok(t.to_dtype(compute.dtype)?);
                }
            }
            ck.tensor(name, compute.dtype, &compute.device)
        };
        let load = || {
            AnyLayer::from_tensors(self.run.cfg, i, &get)
                .with_context(|| format!("loading decoder layer {i}"))
        };
        let loaded = load().and_then(|l| {
            let fp = if self.fp_states.is_some() {
                Some(load()?)
            } else {
                None
            };
            Ok((l, fp))
        });
        // The stage's copies to the device are done before it can be refilled or freed, whether
        // the load worked or not.
        if staged.is_some() {
            compute.device.synchronize()?;
        }
        let r = loaded?;
        self.stages.load += self.clock.lap()?;
        Ok(r)
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
            let mut a = HessianAccumulator::new(k, &self.run.compute.device)?;
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

    /// The subset's Hessians: loaded from `--load-hessians`, or accumulated from its inputs (a
    /// pass over the batches per true-sequential subset, or one capturing forward for all
    /// groups); saved when `--save-hessians` asks.
    fn hessians(
        &mut self,
        layer: &AnyLayer,
        fp_layer: Option<&AnyLayer>,
        i: usize,
        subset: &mut Subset,
        caches: &mut (Cache, Cache),
        fp_caches: &mut (Cache, Cache),
    ) -> Result<()> {
        let opts = self.run.opts;
        let compute = self.run.compute;
        match &opts.load_hessians {
            Some(dir) => {
                for (g, a) in subset.acc.iter_mut() {
                    *a = load_saved_hessian(dir, i, *g, a, &compute.device)?;
                }
                self.stages.hessians += self.clock.lap()?;
            }
            None if opts.true_sequential => {
                let g = subset.groups[0];
                self.sequential_pass(i, layer, fp_layer, g, subset, caches, fp_caches)?;
            }
            None => self.accumulate(layer, &subset.groups, &mut subset.acc)?,
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

    /// The pass over the batches for true-sequential group `g`: each batch's input of `g`
    /// (computed from its hidden state and what the earlier subsets left), fed to the
    /// accumulator, with GPTAQ's full-precision input beside it. The o_proj pass keeps the
    /// mixer outputs for the gate/up pass, which replaces each hidden state by the
    /// post-attention state; the down_proj pass keeps the MLP activations for the final pass.
    #[allow(clippy::too_many_arguments)]
    fn sequential_pass(
        &mut self,
        i: usize,
        layer: &AnyLayer,
        fp_layer: Option<&AnyLayer>,
        g: LinearGroup,
        subset: &mut Subset,
        caches: &mut (Cache, Cache),
        fp_caches: &mut (Cache, Cache),
    ) -> Result<()> {
        let a = subset.acc.get_mut(&g).expect("accumulator per group");
        if g == LinearGroup::O {
            self.pb.set_message(format!("layer {i}: attention"));
        }
        self.stages.forward += self.clock.lap()?;
        for bi in 0..self.states.len() {
            let x = {
                let mut s = Stream {
                    layer,
                    states: &mut self.states,
                    mixer: std::mem::take(&mut caches.0),
                    act: std::mem::take(&mut caches.1),
                };
                let x = group_input(
                    &mut s,
                    g,
                    bi,
                    &mut self.budget,
                    &mut self.clock,
                    self.stages,
                );
                (caches.0, caches.1) = (s.mixer, s.act);
                x?
            };
            let x_fp = match (fp_layer, self.fp_states.as_mut()) {
                (Some(fpl), Some(fps)) => {
                    let mut s = Stream {
                        layer: fpl,
                        states: fps,
                        mixer: std::mem::take(&mut fp_caches.0),
                        act: std::mem::take(&mut fp_caches.1),
                    };
                    let x = group_input(
                        &mut s,
                        g,
                        bi,
                        &mut self.budget,
                        &mut self.clock,
                        self.stages,
                    );
                    (fp_caches.0, fp_caches.1) = (s.mixer, s.act);
                    Some(x?)
                }
                _ => None,
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
        Ok(())
    }

    /// `--no-true-sequential`: runs the layer over every batch, feeding the inputs of `groups`
    /// to their accumulators and stopping each forward after the last wanted group. Time up to
    /// each capture is charged to the forward, the accumulation itself to the Hessians.
    fn accumulate(
        &mut self,
        layer: &AnyLayer,
        groups: &[LinearGroup],
        acc: &mut BTreeMap<LinearGroup, HessianAccumulator>,
    ) -> Result<()> {
        let last = *groups.iter().max().expect("at least one group");
        let (clock, stages) = (&mut self.clock, &mut *self.stages);
        for bi in 0..self.states.len() {
            let h = self.states.get(bi)?;
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
            match layer.forward(&h, &mut capture) {
                Ok(_) => {}
                Err(e) if e.downcast_ref::<StopForward>().is_some() => {}
                Err(e) => return Err(e),
            }
        }
        stages.forward += clock.lap()?;
        Ok(())
    }

    /// Factorizes group `g`'s Hessian for the first of its Linears to be solved (with GPTAQ's
    /// correction under `--method gptaq`) and keeps the factorization in `subset.factors` for
    /// the others. The options are the Linear's, named after all the modules of the group.
    fn factorize_group(
        &mut self,
        subset: &mut Subset,
        g: LinearGroup,
        sopts: &SolveOptions,
    ) -> Result<()> {
        let opts = self.run.opts;
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
        let compute = self.run.compute;
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
            factor: self.run.compute.factor_precision,
        };
        if opts.method.uses_hessians() && !subset.factors.contains_key(&g) {
            self.factorize_group(subset, g, &sopts)?;
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
        let deq = decode_codes(&q, compute.dtype, &compute.device)?;
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

/// Batch `bi`'s input of group `g` in one stream, flattened to `[B·T, K]`: the normalized layer
/// input (q/k/v/gate); the mixer output, kept for the gate/up pass (o_proj); the normalized
/// post-attention state, which replaces the hidden state (gate/up); the MLP activation, kept
/// for the final pass (down_proj).
fn group_input(
    s: &mut Stream,
    g: LinearGroup,
    bi: usize,
    budget: &mut Budget,
    clock: &mut StageClock,
    stages: &mut StageSeconds,
) -> Result<Tensor> {
    let h = s.states.get(bi)?;
    match g {
        LinearGroup::Qkv => flat(&s.layer.input_norm(&h)?),
        LinearGroup::O => {
            stages.forward += clock.lap()?;
            let m = s.layer.mixer_output(&h)?;
            let t = clock.lap()?;
            stages.forward += t;
            match s.layer.mixer_name() {
                "minicpm4" => stages.mixer_sparse += t,
                "lightning-attn" => stages.mixer_lightning += t,
                _ => stages.mixer_attention += t,
            }
            let x = flat(&m)?;
            s.mixer.put(bi, m, budget)?;
            Ok(x)
        }
        LinearGroup::GateUp => {
            let m = s.mixer(bi, &h, budget)?;
            let h1 = s.layer.attn_residual(&h, &m)?;
            let x = flat(&s.layer.mlp_input(&h1)?)?;
            s.states.set(bi, h1)?;
            Ok(x)
        }
        LinearGroup::Down => {
            let act = s.layer.mlp_act(&s.layer.mlp_input(&h)?)?;
            let x = flat(&act)?;
            s.act.put(bi, act, budget)?;
            Ok(x)
        }
    }
}

/// Moves every batch's state through the rest of the quantized layer: from the post-attention
/// state (true-sequential: the MLP, with the activations kept or recomputed), or the whole layer.
fn finish_layer(s: &mut Stream, true_sequential: bool, budget: &mut Budget) -> Result<()> {
    if !true_sequential {
        return forward_all(s.layer, s.states);
    }
    for bi in 0..s.states.len() {
        let h1 = s.states.get(bi)?;
        let act = s.act(bi, &h1, budget)?;
        s.states.set(bi, s.layer.mlp_residual(&h1, &act)?)?;
    }
    Ok(())
}

/// Every batch's state through the whole of `layer`.
fn forward_all(layer: &AnyLayer, states: &mut States) -> Result<()> {
    for bi in 0..states.len() {
        let h = layer.forward(&states.get(bi)?, &mut |_, _| Ok(()))?;
        states.set(bi, h)?;
    }
    Ok(())
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
