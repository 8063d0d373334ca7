//! Where a quantize run spends its time and memory: a per-stage clock (synchronized with the
//! device so asynchronous GPU work is charged to the stage that queued it), the GPU memory
//! high-water mark, and the preflight estimate printed before the run starts.

use crate::model::Config;
use anyhow::Result;
use candle_core::{DType, Device};
use serde::Serialize;
use std::time::Instant;

/// Seconds per stage, summed over layers.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageSeconds {
    /// From the start of the command to the first layer: resolving and opening the source,
    /// the checks, the engine pre-check, the calibration windows (and, for `--resume`, waiting
    /// for the source checks).
    pub setup: f64,
    /// The source checks (every weight finite, the shards' SHA-256), on a thread beside the rest
    /// of the setup: their own duration.
    pub source_checks: f64,
    /// How long the run waited for the source checks: when a fresh run first saves its journal
    /// (after its first two layers; charged to `journal`), or before a resumed run replays its
    /// journal (charged to `setup`).
    pub source_checks_wait: f64,
    /// Decoder-layer weights from the (memory-mapped) checkpoint to the compute device.
    pub load: f64,
    /// Embedding load and the embedding of the calibration windows.
    pub embed: f64,
    /// Calibration forwards (up to each capture point, the mixers, the final layer pass).
    pub forward: f64,
    /// Of `forward`: the mixers (q/k/v/gate projections and attention) of the sparse layers.
    pub mixer_sparse: f64,
    /// Of `forward`: the mixers (projections and Simple-GLA) of the lightning layers.
    pub mixer_lightning: f64,
    /// Of `forward`: the self-attention of the dense families (Llama, Mistral, Qwen2, MiniCPM).
    pub mixer_attention: f64,
    /// XᵀX accumulation (and saving/loading Hessian files).
    pub hessians: f64,
    /// Damped permuted Hessian, Cholesky and triangular inverse (retries included).
    pub factorization: f64,
    /// The blocked column loop with its lazy updates, and fetching the codes.
    pub column_loop: f64,
    /// The least-squares scale refit (`--refit`).
    pub refit: f64,
    /// Decoding each solved module's weights (from its codes, as a server would from the
    /// stored tensors) back into the layer; the codes are packed on the journal thread.
    pub decode: f64,
    /// The relative output error of each module (report only).
    pub report: f64,
    /// Writing the journal of finished layers.
    pub journal: f64,
    /// Floating-point operations of the XᵀX products (2·tokens·K² each).
    pub hessian_flops: f64,
}

impl StageSeconds {
    /// Achieved rate of the Hessian stage in TFLOP/s.
    pub fn hessian_tflops(&self) -> f64 {
        if self.hessians > 0.0 {
            self.hessian_flops / self.hessians / 1e12
        } else {
            0.0
        }
    }
}

/// A clock whose laps end when the device has finished what was queued.
pub struct StageClock {
    device: Device,
    t: Instant,
}

impl StageClock {
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            t: Instant::now(),
        }
    }

    /// Seconds since the previous lap.
    pub fn lap(&mut self) -> Result<f64> {
        self.device.synchronize()?;
        let now = Instant::now();
        let s = now.duration_since(self.t).as_secs_f64();
        self.t = now;
        Ok(s)
    }
}

/// What the run is expected to need, computed from the config and settings before any work.
#[derive(Debug, Clone, Serialize)]
pub struct Preflight {
    pub device: String,
    /// Calibration tokens (windows × seqlen).
    pub tokens: u64,
    /// Resident hidden states of all windows, bytes.
    pub hidden_states_bytes: u64,
    /// Embedding, final norm and head on the compute device, bytes.
    pub embed_head_bytes: u64,
    /// The largest decoder layer's weights in the compute dtype, bytes.
    pub layer_bytes: u64,
    /// The largest solve's working set (f32 H, f64 factor and inverse, f32 U, f32 W copies), bytes.
    pub solve_bytes: u64,
    /// The largest per-batch forward transient (attention scores, MLP activations), bytes.
    pub forward_bytes: u64,
    /// The true-sequential stage inputs kept for all windows within a layer: the mixer output
    /// (then the post-attention state) and the MLP activation, bytes.
    pub layer_cache_bytes: u64,
    /// Hidden-state streams: 2 for GPTAQ (its full-precision stream), else 1.
    pub streams: u64,
    /// The expected peak on the compute device: hidden states, embeddings and head and one
    /// layer, plus the larger of (mixer cache + forward transient) and (post-attention state +
    /// MLP activation + solve).
    pub peak_bytes: u64,
    /// FLOPs of the calibration forward through every Linear.
    pub forward_flops: f64,
    /// FLOPs of the XᵀX products.
    pub hessian_flops: f64,
    /// FLOPs of the factorizations (K³/3 Cholesky + K³/3 triangular inverse per Hessian).
    pub factor_flops: f64,
    /// Bytes of the quantized output (packed, hashed and written).
    pub output_bytes: u64,
    /// FLOPs of computing every batch's mixer projections again, and its gate/up products
    /// again: what a layer cache kept nowhere costs (`MemoryPlan::recompute_seconds`).
    pub recompute_flops: (f64, f64),
    /// The effective rates of those recomputations, TFLOP/s (the mixer's includes its
    /// attention; gate/up's its activation function).
    pub recompute_rates: (f64, f64),
    /// Estimated wall seconds at the effective rates below, with the recomputation the memory
    /// plan leaves (added by `quantize` once the plan is made).
    pub seconds: f64,
    /// The effective rates the estimate assumes: forward, XᵀX and factorization in TFLOP/s,
    /// and everything else (column loop, decode, report, load, setup, the write's tail) in GB
    /// of output per second. On CUDA these are what an H100 achieved end to end
    /// (docs/benchmarks.md); on the CPU rough per-core figures.
    pub assumed_rates: (f64, f64, f64, f64),
}

impl Preflight {
    /// The mixer outputs of every window, bytes: they have the hidden states' width (heads ×
    /// head_dim = hidden_size in every config we take), one per stream.
    pub fn mixer_cache_bytes(&self) -> u64 {
        self.hidden_states_bytes * self.streams
    }

    #[allow(clippy::too_many_arguments)]
    pub fn estimate(
        cfg: &Config,
        windows: usize,
        seqlen: crate::calib::SeqLen,
        batch: usize,
        dtype: DType,
        device: &Device,
        true_sequential: bool,
        method: super::Method,
        mse: bool,
    ) -> Self {
        // GPTAQ runs a second, full-precision stream: its forward, hidden states and layer
        // cache, one more layer's weights, and a cross product per Hessian.
        let gptq = method != super::Method::Rtn;
        let streams: u64 = if method == super::Method::Gptaq { 2 } else { 1 };
        let e = dtype.size_in_bytes() as u64;
        let h = cfg.hidden_size as u64;
        let tokens = (windows as f64 * seqlen.mean()).round() as u64;
        let hidden_states_bytes = tokens * h * e;
        let vocab = cfg.vocab_size as u64;
        let embed_head_bytes = 2 * vocab * h * e + h * e;
        let layers = LayerTotals::of(cfg);
        let t = seqlen.max() as u64;
        let n = batch_tokens(seqlen, batch.min(windows).max(1) as u64);
        let forward_bytes = forward_transient_bytes(cfg, n, t, dtype, device);
        let flops = Flops::of(&layers, tokens, true_sequential, method, streams);
        // The MSE range search: 80 candidate ranges per weight.
        let mse_evals = if mse {
            80.0 * layers.linear_params
        } else {
            0.0
        };
        let output_bytes = (layers.linear_params / 2.0) as u64 + embed_head_bytes;
        let (rates, mse_rate, corr_rate) = effective_rates(device, dtype);
        let per_pass = |params: f64| 2.0 * params * tokens as f64 * streams as f64;
        let recompute_flops = (
            per_pass(layers.mixer_params),
            per_pass(layers.gate_up_params),
        );
        let recompute_rates = recompute_rates(device, dtype, rates.0);
        let seconds = flops.forward / (rates.0 * 1e12)
            + flops.hessian / (rates.1 * 1e12)
            + flops.factor / (rates.2 * 1e12)
            + output_bytes as f64 / (rates.3 * 1e9)
            + mse_evals / mse_rate
            + flops.correction / corr_rate;
        let solve_bytes = if gptq { layers.max_solve } else { 0 };
        let inter = cfg.intermediate_size as u64;
        let layer_cache_bytes = if true_sequential {
            (tokens * h * e + tokens * inter * e) * streams
        } else {
            0
        };
        let base =
            hidden_states_bytes * streams + embed_head_bytes + layers.layer_params * e * streams;
        let during_mixer = if true_sequential { tokens * h * e } else { 0 } + forward_bytes;
        let during_down = layer_cache_bytes + solve_bytes;
        Self {
            device: crate::device::label(device),
            tokens,
            hidden_states_bytes,
            embed_head_bytes,
            layer_bytes: layers.layer_params * e,
            solve_bytes,
            forward_bytes,
            layer_cache_bytes,
            streams,
            peak_bytes: base + during_mixer.max(during_down),
            forward_flops: flops.forward,
            hessian_flops: flops.hessian,
            factor_flops: flops.factor,
            output_bytes,
            recompute_flops,
            recompute_rates,
            seconds,
            assumed_rates: rates,
        }
    }

    pub fn line(&self) -> String {
        format!(
            "preflight: {} calibration tokens; expected peak memory on {} {:.1} GB (hidden states {:.1}, embeddings+head {:.1}, one layer {:.2}, layer cache {:.1}, solve {:.1}, forward {:.1}); \
             {:.2e} FLOP forward + {:.2e} FLOP Hessians + {:.2e} FLOP factorization ≈ {} s at the rates in the report",
            self.tokens,
            self.device,
            self.peak_bytes as f64 / 1e9,
            self.hidden_states_bytes as f64 / 1e9,
            self.embed_head_bytes as f64 / 1e9,
            self.layer_bytes as f64 / 1e9,
            self.layer_cache_bytes as f64 / 1e9,
            self.solve_bytes as f64 / 1e9,
            self.forward_bytes as f64 / 1e9,
            self.forward_flops,
            self.hessian_flops,
            self.factor_flops,
            if self.seconds < 10.0 {
                format!("{:.1}", self.seconds)
            } else {
                format!("{:.0}", self.seconds)
            }
        )
    }
}

/// Sizes gathered over every decoder layer's tensors for the preflight estimate.
struct LayerTotals {
    /// The largest layer's parameter count.
    layer_params: u64,
    /// Parameters of every Linear (2-D tensor) of every layer.
    linear_params: f64,
    /// The input width K of each Hessian: one per q, o, gate and down projection.
    ks: Vec<f64>,
    /// The largest solve's working set, bytes.
    max_solve: u64,
    /// Parameters of every layer's mixer projections (q, k, v and the output gate's), which a
    /// mixer output kept nowhere computes again.
    mixer_params: f64,
    /// Parameters of every layer's gate_proj and up_proj, which an MLP activation kept nowhere
    /// computes again.
    gate_up_params: f64,
}

impl LayerTotals {
    /// Walks every layer's tensors, summing parameters and noting each Hessian's width.
    fn of(cfg: &Config) -> Self {
        let mut layer_params = 0u64;
        let mut linear_params = 0f64;
        let mut ks = vec![];
        let mut max_solve = 0u64;
        let (mut mixer_params, mut gate_up_params) = (0f64, 0f64);
        for i in 0..cfg.num_hidden_layers {
            let mut p = 0u64;
            let mut lin = 0f64;
            for (name, shape) in cfg.layer_tensors(i) {
                let n: u64 = shape.iter().map(|&d| d as u64).product();
                p += n;
                if shape.len() == 2 {
                    lin += n as f64;
                    let (rows, k) = (shape[0] as u64, shape[1] as u64);
                    max_solve = max_solve.max(k * k * (4 + 8 + 8 + 4) + 3 * rows * k * 4);
                    if name.ends_with("q_proj.weight")
                        || name.ends_with("o_proj.weight")
                        || name.ends_with("gate_proj.weight")
                        || name.ends_with("down_proj.weight")
                    {
                        ks.push(k as f64);
                    }
                    let proj =
                        |p: &[&str]| p.iter().any(|p| name.ends_with(&format!("{p}.weight")));
                    if proj(&["q_proj", "k_proj", "v_proj", "z_proj", "o_gate"]) {
                        mixer_params += n as f64;
                    } else if proj(&["gate_proj", "up_proj"]) {
                        gate_up_params += n as f64;
                    }
                }
            }
            layer_params = layer_params.max(p);
            linear_params += lin;
        }
        Self {
            layer_params,
            linear_params,
            ks,
            max_solve,
            mixer_params,
            gate_up_params,
        }
    }
}

/// The most tokens one forward batch can hold (`calib::batch_ranges`): `batch` windows of one
/// length, at most BATCH_TOKENS tokens unless one window alone is longer. With a length mix, a
/// batch of shorter windows can hold more tokens than one of the longest: BATCH_TOKENS.
fn batch_tokens(seqlen: crate::calib::SeqLen, batch: u64) -> u64 {
    let cap = crate::calib::BATCH_TOKENS as u64;
    let t = seqlen.max() as u64;
    match seqlen {
        crate::calib::SeqLen::Fixed(_) => t * batch.min((cap / t.max(1)).max(1)),
        crate::calib::SeqLen::LogUniform { .. } => (batch * t).min(cap.max(t)),
    }
}

/// The largest per-batch forward transient for a batch of `n` tokens in windows of at most `t`,
/// bytes.
fn forward_transient_bytes(cfg: &Config, n: u64, t: u64, dtype: DType, device: &Device) -> u64 {
    let e = dtype.size_in_bytes() as u64;
    let h = cfg.hidden_size as u64;
    let heads = cfg.num_attention_heads as u64;
    // Sparse layers: f32 scores, masked scores and probabilities for one batch (none with
    // the fused attention kernel, BF16 on a GPU): b·T² per head, at most n·t; MLP: gate, up
    // and their product.
    let attn = if device.is_cuda() && dtype == DType::BF16 {
        0
    } else {
        3 * heads * n * t * 4
    };
    let mlp = 3 * n * cfg.intermediate_size as u64 * e;
    attn.max(mlp) + 4 * n * h * 4
}

/// The FLOPs of a run's compute stages.
struct Flops {
    forward: f64,
    hessian: f64,
    factor: f64,
    correction: f64,
}

impl Flops {
    /// Counts the forward, XᵀX, factorization and GPTAQ-correction FLOPs.
    fn of(
        layers: &LayerTotals,
        tokens: u64,
        true_sequential: bool,
        method: super::Method,
        streams: u64,
    ) -> Self {
        let gptq = method != super::Method::Rtn;
        let ks = &layers.ks;
        // True-sequential: each stage input is computed once (see `run_layers`), so one pass
        // through every Linear; all groups at once: the capturing pass and the final pass.
        let passes = if true_sequential { 1.0 } else { 2.0 };
        let forward = 2.0 * layers.linear_params * tokens as f64 * passes * streams as f64;
        let hessian = if gptq {
            ks.iter()
                .map(|k| 2.0 * tokens as f64 * k * k * streams as f64)
                .sum()
        } else {
            0.0
        };
        let factor = if gptq {
            ks.iter().map(|k| 2.0 / 3.0 * k * k * k).sum()
        } else {
            0.0
        };
        // GPTAQ's correction per Hessian: H_λ⁻¹ = UᵀU and D·H_λ⁻¹, two f32 K³ products.
        let correction: f64 = if method == super::Method::Gptaq {
            ks.iter().map(|k| 4.0 * k * k * k).sum()
        } else {
            0.0
        };
        Self {
            forward,
            hessian,
            factor,
            correction,
        }
    }
}

/// The effective rates the estimate assumes: (forward, XᵀX and factorization TFLOP/s, other
/// work in GB of output per second), MSE candidate evaluations per second, and GPTAQ's
/// correction FLOP/s.
fn effective_rates(device: &Device, dtype: DType) -> ((f64, f64, f64, f64), f64, f64) {
    // Effective rates, end to end on an H100 for CUDA (docs/benchmarks.md): the BF16 forward
    // with the fused attention and the chunk-parallel Simple-GLA (4.65e15 FLOP in 13.9 s),
    // tensor-core XᵀX on the upper blocks (5.35e15 full-matrix FLOP in 4.46 s), the f64
    // factorizations, the MSE search's extra ~2.7 s (~2.6e11
    // candidate evaluations per second), GPTAQ's f32 products at ~24 TFLOP/s, and, per
    // output byte, everything else (the plain column loop, decode, report, load, setup and
    // what is left of the write after the last layer); rough per-core figures on the CPU
    // (~5e7 MSE evaluations/s and ~0.03 TFLOP/s per core).
    if device.is_cuda() {
        let fwd = if dtype == DType::F32 { 30.0 } else { 330.0 };
        // Full-matrix FLOPs per second: only the blocks on and above the diagonal are
        // computed (kernels::xtx::xtx_add_upper).
        let xtx = if dtype == DType::F32 { 40.0 } else { 1200.0 };
        ((fwd, xtx, 25.0, 0.53), 2.6e11, 24e12)
    } else {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        (
            (0.03 * cores, 0.03 * cores, 0.015 * cores, 0.2),
            5e7 * cores,
            0.03e12 * cores,
        )
    }
}

/// The effective rates of recomputing a mixer output and an MLP activation, TFLOP/s of the
/// projections: on an H100, from the 9.5B at 16 × 49,152 tokens with the mixer outputs kept,
/// in host memory or recomputed (docs/benchmarks.md: 12.1 s for 2.7e15 FLOP of projections with
/// their attention, 15.8 s for 6.6e15 FLOP of gate/up with SiLU); the forward's rate `fwd`
/// elsewhere.
fn recompute_rates(device: &Device, dtype: DType, fwd: f64) -> (f64, f64) {
    if device.is_cuda() && dtype != DType::F32 {
        (220.0, 420.0)
    } else {
        (fwd, fwd)
    }
}

/// Where the hidden states of a run live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// On the compute device.
    Device,
    /// In host memory (GPU runs), copied to the device for each pass.
    Host,
    /// In files under the output's partial folder, read back for each pass.
    Disk,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Self::Device => "on the compute device",
            Self::Host => "in host memory",
            Self::Disk => "on disk",
        }
    }
}

/// Where a run keeps its activations: the hidden states' tier, the bytes the per-layer caches
/// may hold on the compute device, and the bytes of host memory the mixer outputs may take
/// beside a GPU (what fits neither is recomputed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Residency {
    pub states: Tier,
    pub cache_bytes: u64,
    pub host_cache_bytes: u64,
}

impl Residency {
    /// Everything on the compute device, caches unbounded: the layer loop as it always ran.
    pub fn resident() -> Self {
        Self {
            states: Tier::Device,
            cache_bytes: u64::MAX,
            host_cache_bytes: 0,
        }
    }
}

/// The memory a run may use for its activations, and where it puts them (docs/algorithm.md,
/// Streaming the calibration): the hidden states on the compute device while they fit, else in
/// host memory (GPU runs), else on disk; the per-layer caches in what is left on the device.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryPlan {
    /// Bytes the compute device offers the run (free memory, or `--max-gpu-memory`; on the
    /// CPU, available memory or `--max-host-memory`).
    pub device_bytes: u64,
    /// What the run needs there whatever the token count: embeddings and head, the layer(s),
    /// one batch's forward and the largest solve.
    pub fixed_bytes: u64,
    /// Hidden states of every window (both streams for GPTAQ).
    pub states_bytes: u64,
    /// The per-layer caches if every batch were kept: mixer outputs and MLP activations.
    pub caches_bytes: u64,
    pub residency: Residency,
    /// Bytes of host memory the states may take (GPU runs), where known.
    pub host_bytes: Option<u64>,
    /// Seconds the batches whose caches are kept nowhere cost in recomputation, at the
    /// preflight's recompute rates.
    pub recompute_seconds: f64,
}

impl MemoryPlan {
    /// Places the activations of the run `p` estimates. `device_free`: the device's free bytes
    /// (None: unknown); `max_device`: the user's cap (`--max-gpu-memory`, or on the CPU
    /// `--max-host-memory`); `host_free` and `max_host`: the same for host memory on a GPU run.
    pub fn new(
        p: &Preflight,
        cuda: bool,
        device_free: Option<u64>,
        max_device: Option<u64>,
        host_free: Option<u64>,
        max_host: Option<u64>,
    ) -> Result<Self> {
        let fixed =
            p.embed_head_bytes + p.layer_bytes * p.streams + p.forward_bytes.max(p.solve_bytes);
        let states = p.hidden_states_bytes * p.streams;
        let caches = p.layer_cache_bytes;
        // On the CPU the cap bounds what the activations take, beside the fixed working set.
        let (device, budget) =
            if cuda {
                let avail = match (device_free, max_device) {
                    (Some(f), Some(m)) => Some(f.min(m)),
                    (f, m) => f.or(m),
                };
                match avail {
                    Some(a) => {
                        // Leave room for the allocator's fragmentation and the libraries' workspaces.
                        let usable = a - a / 20;
                        if usable < fixed {
                            anyhow::bail!(
                            "one layer, one batch and the largest solve need about {:.1} GB on \
                             the GPU and {:.1} GB are available{}: lower --batch, or use \
                             shorter windows (--seqlen)",
                            fixed as f64 / 1e9,
                            usable as f64 / 1e9,
                            if max_device.is_some() { " under --max-gpu-memory" } else { "" }
                        );
                        }
                        (a, usable - fixed)
                    }
                    None => (u64::MAX, u64::MAX),
                }
            } else {
                let avail = match (device_free, max_device) {
                    (_, Some(m)) => Some(m),
                    (Some(f), None) => Some(f.saturating_sub(fixed)),
                    (None, None) => None,
                };
                (avail.unwrap_or(u64::MAX), avail.unwrap_or(u64::MAX))
            };
        // Host memory beside a GPU: the cap, else 90% of what is available.
        let host = match (cuda, max_host) {
            (false, _) => None,
            (true, Some(m)) => Some(m),
            (true, None) => host_free.map(|f| f - f / 10),
        };
        let tier = if states <= budget {
            Tier::Device
        } else if cuda && host.is_none_or(|h| states <= h) {
            Tier::Host
        } else {
            Tier::Disk
        };
        let cache_bytes = if tier == Tier::Device {
            budget - states
        } else {
            budget
        };
        let states_on_host = if tier == Tier::Host { states } else { 0 };
        let host_cache_bytes = host_cache_bytes(p, cuda, states_on_host, host, cache_bytes);
        let recompute_seconds = recompute_seconds(p, cache_bytes, host_cache_bytes);
        Ok(Self {
            device_bytes: device,
            fixed_bytes: fixed,
            states_bytes: states,
            caches_bytes: caches,
            residency: Residency {
                states: tier,
                cache_bytes,
                host_cache_bytes,
            },
            host_bytes: host,
            recompute_seconds,
        })
    }

    pub fn line(&self) -> String {
        let r = &self.residency;
        let pct = |b: u64| 100.0 * b as f64 / self.caches_bytes as f64;
        let kept = if self.caches_bytes == 0 || r.cache_bytes >= self.caches_bytes {
            "kept".to_string()
        } else if r.host_cache_bytes > 0 {
            format!(
                "{:.0}% kept on the GPU and {:.0}% in host memory ({:.1} GB of mixer outputs), \
                 the rest recomputed",
                pct(r.cache_bytes),
                pct(r.host_cache_bytes),
                r.host_cache_bytes as f64 / 1e9
            )
        } else {
            format!("{:.0}% kept, the rest recomputed", pct(r.cache_bytes))
        };
        let kept = if self.recompute_seconds >= 1.0 {
            format!("{kept} (about {:.0} s more)", self.recompute_seconds)
        } else {
            kept
        };
        format!(
            "activations: hidden states {:.1} GB {}; layer caches {:.1} GB {kept}",
            self.states_bytes as f64 / 1e9,
            self.residency.states.name(),
            self.caches_bytes as f64 / 1e9,
        )
    }
}

/// The recomputation a plan leaves: the mixer outputs the device and the host do not keep (the
/// device budget goes to them first), and the MLP activations the device does not keep (the
/// whole budget is theirs once the mixer outputs are used), each share of one full pass of the
/// projections that make it.
fn recompute_seconds(p: &Preflight, cache_bytes: u64, host_cache_bytes: u64) -> f64 {
    let mixers = p.mixer_cache_bytes();
    let acts = p.layer_cache_bytes.saturating_sub(mixers);
    let missed = |total: u64, kept: u64| {
        if total == 0 {
            0.0
        } else {
            1.0 - kept.min(total) as f64 / total as f64
        }
    };
    let mixer = missed(mixers, cache_bytes.saturating_add(host_cache_bytes));
    let act = missed(acts, cache_bytes);
    let (fm, fg) = p.recompute_flops;
    let (rm, rg) = p.recompute_rates;
    mixer * fm / (rm * 1e12) + act * fg / (rg * 1e12)
}

/// Host memory for the mixer outputs the GPU budget cannot keep (`cache_bytes` on the device
/// goes to them first): what they need beyond it, within the host memory the hidden states leave
/// (less 4 GB for the run's own buffers: staged layers, packed codes). Zero on the CPU, where
/// the device is the host, and without true-sequential subsets (no caches).
fn host_cache_bytes(
    p: &Preflight,
    cuda: bool,
    states_on_host: u64,
    host: Option<u64>,
    cache_bytes: u64,
) -> u64 {
    const RUN_OWN: u64 = 4_000_000_000;
    if !cuda || p.layer_cache_bytes == 0 {
        return 0;
    }
    let need = p.mixer_cache_bytes().saturating_sub(cache_bytes);
    let avail = host
        .unwrap_or(0)
        .saturating_sub(states_on_host)
        .saturating_sub(RUN_OWN);
    need.min(avail)
}

/// GPU memory actually used: `(pool high-water mark of live allocations, reserved high-water
/// mark, in use now incl. allocations outside the pool)`, bytes; None on the CPU.
pub fn gpu_memory(device: &Device) -> Result<Option<(u64, u64, u64)>> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let (used, reserved) = crate::kernels::memory::pool_high_water(device)?;
        let now = crate::kernels::memory::memory_in_use(device)?;
        return Ok(Some((used, reserved, now)));
    }
    let _ = device;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calib::SeqLen;

    /// The estimate for MiniCPM-SALA 9B in BF16, true-sequential GPTQ without the MSE search.
    fn sala9b(windows: usize, seqlen: SeqLen, batch: usize) -> Preflight {
        let cfg = crate::model::config::preset("minicpm-sala-9b").unwrap();
        Preflight::estimate(
            &cfg,
            windows,
            seqlen,
            batch,
            DType::BF16,
            &Device::Cpu,
            true,
            crate::quantize::Method::Gptq,
            false,
        )
    }

    /// The memory estimate against what the H200 run measured (docs/benchmarks.md): 22.2 GB and
    /// 35.1 GB of live pool memory at 128 and 256 × 2048 tokens on MiniCPM-SALA 9B.
    #[test]
    fn preflight_memory_matches_the_measured_peaks() {
        for (windows, measured) in [(128, 22.2e9), (256, 35.1e9)] {
            let p = sala9b(windows, SeqLen::Fixed(2048), 8);
            eprintln!("{windows} windows: {}", p.line());
            let rel = (p.peak_bytes as f64 - measured).abs() / measured;
            assert!(
                rel < 0.1,
                "{windows} windows: {} vs {measured}",
                p.peak_bytes
            );
            assert_eq!(p.tokens, windows as u64 * 2048);
        }
    }

    /// A window of BATCH_TOKENS or more is a batch of its own, whatever `--batch` says: the
    /// forward transient of 16 × 49,152 tokens at `--batch 8` is one window's, not eight
    /// windows' (the 9.5B run of docs/benchmarks.md estimated 64 GB and kept a quarter of its
    /// layer caches because of it).
    #[test]
    fn long_windows_count_one_window_per_batch_in_the_forward_transient() {
        let forward = |batch, len| sala9b(16, SeqLen::Fixed(len), batch).forward_bytes;
        assert_eq!(
            forward(8, 49_152),
            forward(1, 49_152),
            "batch 8 of 49,152-token windows is one window a batch"
        );
        // 32,768-token windows: two a batch (65,536 tokens), so twice one window's transient.
        assert_eq!(forward(8, 32_768), 2 * forward(1, 32_768));
        // Short windows are unaffected: 8 × 2048 tokens is within BATCH_TOKENS.
        assert_eq!(forward(8, 2048), 8 * forward(1, 2048));
    }

    /// A length mix up to 49,152 tokens can batch eight 8,192-token windows: 65,536 tokens, more
    /// than one 49,152-token window (the H100 run of 128 × 4096..49152 ran out of memory when the
    /// estimate assumed one longest window a batch).
    #[test]
    fn a_length_mix_counts_a_full_batch_of_shorter_windows() {
        use crate::calib::BATCH_TOKENS;
        let mix = SeqLen::LogUniform {
            min: 4096,
            max: 49_152,
        };
        assert_eq!(batch_tokens(mix, 8), BATCH_TOKENS as u64);
        assert_eq!(batch_tokens(mix, 1), 49_152);
        assert_eq!(batch_tokens(SeqLen::Fixed(49_152), 8), 49_152);
        assert_eq!(batch_tokens(SeqLen::Fixed(2048), 8), 8 * 2048);
        assert_eq!(batch_tokens(SeqLen::Fixed(100_000), 8), 100_000);
        // Every batch that batch_ranges forms fits the bound.
        let windows: Vec<Vec<u32>> = [4096, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 49_152]
            .iter()
            .map(|&n| vec![0; n])
            .collect();
        for r in crate::calib::batch_ranges(&windows, 8) {
            let n: usize = windows[r].iter().map(Vec::len).sum();
            assert!(n as u64 <= batch_tokens(mix, 8), "a batch of {n} tokens");
        }
        assert!(
            sala9b(128, mix, 8).forward_bytes > sala9b(128, SeqLen::Fixed(49_152), 8).forward_bytes
        );
    }

    /// 128 × 49,152 tokens of the 9.5B under a 70 GB GPU cap: the hidden states (51.5 GB) fill
    /// the GPU, so the mixer outputs go to host memory where it has room (not on the CPU, not
    /// beyond what the host offers), and the plan says so.
    #[test]
    fn mixer_outputs_the_gpu_cannot_keep_go_to_host_memory() {
        let gb = |x: f64| (x * 1e9) as u64;
        let mut p = sala9b(128, SeqLen::Fixed(49_152), 8);
        // Estimated for the CPU, whose composed attention keeps T² scores: the GPU's transient
        // has none (8.1 GB, the MLP's).
        p.forward_bytes = gb(8.1);
        let plan =
            |cuda, host| MemoryPlan::new(&p, cuda, Some(gb(80.0)), Some(gb(70.0)), host, None);
        let big = plan(true, Some(gb(120.0))).unwrap();
        let r = big.residency;
        assert_eq!(r.states, Tier::Device);
        assert!(r.cache_bytes < gb(15.0), "{}", big.line());
        assert_eq!(
            r.cache_bytes + r.host_cache_bytes,
            p.hidden_states_bytes,
            "{}",
            big.line()
        );
        assert!(big.line().contains("in host memory"), "{}", big.line());
        // A smaller host: what it offers beyond 10% and the run's own 4 GB.
        let small = plan(true, Some(gb(30.0))).unwrap().residency;
        assert_eq!(small.host_cache_bytes, gb(27.0) - gb(4.0));
        assert_eq!(plan(true, None).unwrap().residency.host_cache_bytes, 0);
        assert_eq!(
            plan(false, Some(gb(120.0)))
                .unwrap()
                .residency
                .host_cache_bytes,
            0
        );
        // What is kept nowhere is recomputed, and the estimate says what it costs: at the H100's
        // rates, the gate/up products of the activations the GPU cannot keep. Measured: the
        // forward of 128 × 49,152 took 430.8 s, 124.4 s more than eight times 16 × 49,152's
        // with every cache kept (38.3 s; docs/benchmarks.md).
        let mut p = p.clone();
        p.recompute_rates = (220.0, 420.0);
        let big = plan(true, Some(gb(120.0))).unwrap();
        let secs = recompute_seconds(
            &p,
            big.residency.cache_bytes,
            big.residency.host_cache_bytes,
        );
        assert!((secs - 124.4).abs() / 124.4 < 0.1, "{secs} s");
        assert!(big.line().contains("s more)"), "{}", big.line());
        // With no host memory the mixers are recomputed too; with everything kept, nothing.
        let none = recompute_seconds(&p, big.residency.cache_bytes, 0);
        assert!(none > secs + 30.0, "{none} vs {secs}");
        assert_eq!(recompute_seconds(&p, u64::MAX, 0), 0.0);
        // 128 × 2,048: the GPU keeps every cache, nothing goes to the host.
        let short = sala9b(128, SeqLen::Fixed(2048), 8);
        let r = MemoryPlan::new(&short, true, Some(gb(80.0)), None, Some(gb(120.0)), None)
            .unwrap()
            .residency;
        assert_eq!(r.host_cache_bytes, 0);
    }
}
