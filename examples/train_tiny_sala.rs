//! Trains the test-fixture model in `examples/tiny-sala/`: the `tiny` preset (MiniCPM-SALA's exact
//! structure: both mixer kinds, muP scalars, head_dim 128) trained on public-domain text, so that
//! perplexity means something when the quantizer is tested on it.
//!
//! ```text
//! cargo run --release --example train_tiny_sala -- --out /tmp/tiny-sala-train \
//!     --steps 2000 --seqlen 256 --batch 8 --lr 3e-3 --warmup 20 --seed 0 --workers 1 \
//!     --eval-every 25 --eval-windows 32 --time-budget-secs 1500
//! ```
//!
//! (the command that made the fixture; see `examples/tiny-sala/README.md`). The output folder
//! holds the model files and `train_report.json` (the loss curve, and the `--steps` /
//! `--decay-steps` that reproduce a run that the time budget shortened).
//!
//! The forward pass is the crate's own ([`Model`] and [`DecoderLayer`] built from `Var`s, with the
//! composed softmax so that it has a backward), so the fixture is trained with exactly the
//! computation that the quantizer and `eval-ppl` run. Training data: the State of the Union
//! addresses of 1790-1999 (`examples/tiny-sala/corpus/`); held-out perplexity: the addresses of
//! 2000-2021 (the text `eval-ppl --data default` scores), with the `soar_gptq::eval` protocol
//! (non-overlapping windows, no BOS, exp(mean NLL) over every next-token prediction).
//!
//! Initialisation (deterministic per `--seed`, SplitMix64 + Box-Muller, one stream per tensor):
//! RMSNorm weights 1; embedding N(0, (1/scale_emb)²) so that the scaled embedding has unit
//! scale; every Linear N(0, 1/fan_in), with o_proj and down_proj further divided by
//! sqrt(2·num_layers) (the residual branches); lm_head N(0, 1/fan_in), which with the
//! hidden_size/dim_model_base logit divisor gives initial logits of std ≈ 0.25.
//!
//! Optimisation: AdamW (β 0.9/0.95) with MiniCPM's warmup-stable-decay schedule (linear warmup,
//! constant peak, cosine decay to `--min-lr-ratio`·lr over the last `--decay-steps`), decoupled
//! weight decay on matrices only, global gradient-norm clipping. Batches are random
//! windows of `--seqlen` tokens drawn from the seeded generator, so a run is reproducible.

use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use clap::Parser;
use soar_gptq::checkpoint::guard::InputPath;
use soar_gptq::checkpoint::Dtype;
use soar_gptq::checkpoint::{files, shards, OutputDir, TensorSpec};
use soar_gptq::eval::{self, PplOptions};
use soar_gptq::model::config::{self, Config};
use soar_gptq::model::{DecoderLayer, Model};
use soar_gptq::rng::SplitMix64;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Trains the tiny MiniCPM-SALA test fixture")]
struct Args {
    /// Output folder (written as <out>.partial, renamed when complete).
    #[arg(long)]
    out: PathBuf,
    /// Optimizer steps (the length of the learning-rate schedule).
    #[arg(long, default_value_t = 600)]
    steps: usize,
    /// Tokens per training and evaluation window.
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Windows per training batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Steps of the final decay (default: 25% of --steps). With --time-budget-secs, the decay
    /// starts early enough to end inside the budget; the report gives --steps and --decay-steps
    /// that reproduce the run without a budget.
    #[arg(long)]
    decay_steps: Option<usize>,
    /// Final learning rate as a fraction of the peak.
    #[arg(long, default_value_t = 0.1)]
    min_lr_ratio: f64,
    /// Warmup steps (default: 5% of --steps, at least 10).
    #[arg(long)]
    warmup: Option<usize>,
    /// Decoupled weight decay on matrices (norm weights are not decayed).
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Global gradient-norm clipping threshold (0: off).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Seed of the initialisation and of the batch sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Threads that split each batch (data parallel on the CPU; default: the number of cores).
    #[arg(long)]
    workers: Option<usize>,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Held-out evaluation every this many steps (0: only at the end).
    #[arg(long, default_value_t = 50)]
    eval_every: usize,
    /// Windows of the periodic held-out evaluation (spread evenly over the held-out text); the
    /// final evaluation scores every window.
    #[arg(long, default_value_t = 48)]
    eval_windows: usize,
    /// Start the final decay after this many periodic evaluations in a row without a relative
    /// improvement of at least --min-improvement (0: never).
    #[arg(long, default_value_t = 3)]
    patience: usize,
    #[arg(long, default_value_t = 0.002)]
    min_improvement: f64,
    /// Wall-clock budget of the training loop (periodic evaluations included): the decay phase
    /// is started so that it ends within it, and training stops at it regardless.
    #[arg(long)]
    time_budget_secs: Option<u64>,
    /// Print the training loss every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Training text.
    #[arg(long, default_value = "examples/tiny-sala/corpus/sotu-1790-1999.txt")]
    train: PathBuf,
    /// Held-out text (default: the evaluation text compiled into soar-gptq, 2000-2021).
    #[arg(long)]
    eval: Option<PathBuf>,
    /// Tokenizer (copied into the output).
    #[arg(long, default_value = "examples/tiny-sala/tokenizer.json")]
    tokenizer: PathBuf,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// Standard deviation of the initial values of a matrix (see the module documentation).
fn init_std(name: &str, shape: &[usize], cfg: &Config) -> f64 {
    if name == "model.embed_tokens.weight" {
        return 1.0 / cfg.scale_emb;
    }
    let base = 1.0 / (shape[1] as f64).sqrt();
    if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        base / (2.0 * cfg.num_hidden_layers as f64).sqrt()
    } else {
        base
    }
}

fn init_var(name: &str, shape: &[usize], cfg: &Config, seed: u64, dev: &Device) -> Result<Var> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = if shape.len() == 1 {
        vec![1.0; n]
    } else {
        let std = init_std(name, shape, cfg);
        let mut rng = SplitMix64::new(seed ^ fnv1a(name));
        (0..n).map(|_| (rng.normal() * std) as f32).collect()
    };
    Ok(Var::from_tensor(&Tensor::from_vec(data, shape, dev)?)?)
}

/// The embedding/head and the decoder layers built from one set of tensors.
struct Net {
    model: Model,
    layers: Vec<DecoderLayer>,
}

impl Net {
    /// `differentiable`: the composed softmax (training); otherwise the production fused one.
    fn build(
        cfg: &Config,
        dev: &Device,
        get: &dyn Fn(&str) -> Result<Tensor>,
        differentiable: bool,
    ) -> Result<Self> {
        let model = Model::from_tensors(cfg, DType::F32, dev, get)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let mut l = DecoderLayer::from_tensors(cfg, i, get)?;
                l.differentiable = differentiable;
                Ok(l)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { model, layers })
    }

    fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        let mut h = self.model.embed(ids)?;
        for layer in &self.layers {
            h = layer.forward(&h, &mut |_, _| Ok(()))?;
        }
        Ok(h)
    }

    /// Mean next-token cross-entropy over the windows `ids` `[B, T]`.
    fn loss(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let logits = self.model.head(&self.hidden(ids)?)?;
        let v = logits.dim(2)?;
        let inputs = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
        let targets = ids.narrow(1, 1, t - 1)?.contiguous()?.flatten_all()?;
        Ok(candle_nn::loss::cross_entropy(&inputs, &targets)?)
    }

    /// Held-out perplexity with the `soar_gptq::eval` protocol: exp(mean NLL) over every
    /// next-token prediction inside each window.
    fn perplexity(&self, windows: &[&Vec<u32>], batch: usize) -> Result<f64> {
        let (mut nll, mut count) = (0.0, 0usize);
        for ws in windows.chunks(batch.max(1)) {
            let t = ws[0].len();
            let flat: Vec<u32> = ws.iter().flat_map(|w| w.iter().copied()).collect();
            let ids = Tensor::from_vec(flat, (ws.len(), t), &self.model.device)?;
            let logp =
                candle_nn::ops::log_softmax(&self.model.head(&self.hidden(&ids)?)?, D::Minus1)?;
            let owned: Vec<Vec<u32>> = ws.iter().map(|w| w.to_vec()).collect();
            let (s, c) = eval::batch_nll(&logp, &owned)?;
            nll += s;
            count += c;
        }
        Ok((nll / count as f64).exp())
    }
}

/// Mean loss of the batch `ids` and its gradients. The batch is split into `workers` row blocks
/// that run forward and backward on their own threads (candle's CPU element-wise kernels are
/// single-threaded, so this is what uses the cores); the block gradients are combined with
/// weights rows/batch in a fixed order, so the result does not depend on thread timing.
fn loss_and_grads(
    net: &Net,
    ids: &Tensor,
    workers: usize,
    vars: &[&Var],
) -> Result<(f64, GradStore)> {
    let b = ids.dim(0)?;
    let workers = workers.clamp(1, b);
    let mut blocks = vec![];
    let mut start = 0;
    for w in 0..workers {
        let rows = b / workers + usize::from(w < b % workers);
        blocks.push(ids.narrow(0, start, rows)?);
        start += rows;
    }
    let run = |ids: &Tensor| -> Result<(f64, GradStore)> {
        let loss = net.loss(ids)?;
        Ok((loss.to_scalar::<f32>()? as f64, loss.backward()?))
    };
    if workers == 1 {
        return run(ids);
    }
    let results: Vec<Result<(f64, GradStore)>> = std::thread::scope(|s| {
        let handles: Vec<_> = blocks.iter().map(|blk| s.spawn(|| run(blk))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("training worker panicked"))
            .collect()
    });
    let mut parts = vec![];
    for (r, blk) in results.into_iter().zip(&blocks) {
        let (l, g) = r?;
        parts.push((l, g, blk.dim(0)? as f64 / b as f64));
    }
    let loss = parts.iter().map(|(l, _, w)| l * w).sum();
    let (first, rest) = parts.split_first_mut().expect("at least one worker");
    for v in vars {
        let mut acc = match first.1.remove(v.as_tensor()) {
            Some(g) => (g * first.2)?,
            None => continue,
        };
        for (_, g, w) in rest.iter() {
            if let Some(g) = g.get(v.as_tensor()) {
                acc = (acc + (g * *w)?)?;
            }
        }
        first.1.insert(v.as_tensor(), acc);
    }
    let (_, grads, _) = parts.swap_remove(0);
    Ok((loss, grads))
}

/// Warmup-stable-decay (the schedule MiniCPM was trained with): linear warmup to the peak, the
/// peak until `steps - decay`, then cosine down to `min_lr_ratio`·peak at `steps`.
fn lr_at(step: usize, args: &Args, warmup: usize, steps: usize, decay: usize) -> f64 {
    if step < warmup {
        return args.lr * (step + 1) as f64 / warmup as f64;
    }
    let decay_start = steps.saturating_sub(decay).max(warmup);
    if step < decay_start {
        return args.lr;
    }
    let span = (steps - decay_start).max(1) as f64;
    let progress = ((step + 1 - decay_start) as f64 / span).min(1.0);
    let min = args.lr * args.min_lr_ratio;
    min + (args.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

fn tokenize(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?
        .get_ids()
        .to_vec())
}

/// ChatML as MiniCPM writes it: BOS, then `<|im_start|>{role}\n{content}<|im_end|>\n` per turn.
const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

fn write_side_files(dir: &std::path::Path, cfg: &Config, tokenizer: &[u8]) -> Result<()> {
    files::write_file(&dir.join("config.json"), cfg.to_json_pretty().as_bytes())?;
    let gen = serde_json::json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    });
    files::write_file(
        &dir.join("generation_config.json"),
        serde_json::to_string_pretty(&gen)?.as_bytes(),
    )?;
    let tc = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": cfg.sparse_config.dense_len,
        "chat_template": CHAT_TEMPLATE,
    });
    files::write_file(
        &dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc)?.as_bytes(),
    )?;
    files::write_file(&dir.join("tokenizer.json"), tokenizer)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let t0 = Instant::now();
    let dev = args
        .device
        .parse::<soar_gptq::device::DeviceSpec>()
        .map_err(anyhow::Error::msg)?
        .open()?;
    let cfg = config::preset("tiny")?;
    if args.seqlen < 2 || args.batch == 0 || args.steps == 0 {
        bail!("--seqlen must be at least 2, --batch and --steps at least 1");
    }
    let workers = args.workers.unwrap_or_else(|| {
        if dev.is_cpu() {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            1
        }
    });
    let warmup = args
        .warmup
        .unwrap_or((args.steps / 20).max(10))
        .min(args.steps);

    let tok_bytes = std::fs::read(&args.tokenizer)
        .with_context(|| format!("cannot read {}", args.tokenizer.display()))?;
    let tok = tokenizers::Tokenizer::from_bytes(&tok_bytes)
        .map_err(|e| anyhow::anyhow!("invalid tokenizer: {e}"))?;
    let train_text = std::fs::read_to_string(&args.train)
        .with_context(|| format!("cannot read {}", args.train.display()))?;
    let train = tokenize(&tok, &train_text)?;
    if let Some(bad) = train.iter().find(|&&i| i as usize >= cfg.vocab_size) {
        bail!("token id {bad} is outside the vocabulary");
    }
    if train.len() <= args.seqlen {
        bail!("the training text is shorter than one window");
    }
    let eval_text = match &args.eval {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?
        }
        None => eval::DEFAULT_EVAL_TEXT.to_string(),
    };
    let ppl_opts = PplOptions {
        seqlen: args.seqlen,
        max_windows: None,
        bos: false,
        dtype: DType::F32,
        device: dev.clone(),
        batch: 8,
        sparse_attention: soar_gptq::model::SparseAttention::Auto,
        text_name: "the evaluation text".to_string(),
    };
    let all_windows = eval::make_windows(&tok, &eval_text, &cfg.clone().into(), &ppl_opts)?;
    let all_refs: Vec<&Vec<u32>> = all_windows.iter().collect();
    let n_periodic = args.eval_windows.clamp(1, all_windows.len());
    let periodic: Vec<&Vec<u32>> = (0..n_periodic)
        .map(|i| &all_windows[i * all_windows.len() / n_periodic])
        .collect();
    eprintln!(
        "train: {} tokens ({}); held-out: {} windows of {} ({} in the periodic check); tokenized in {:.1}s",
        train.len(),
        args.train.display(),
        all_windows.len(),
        args.seqlen,
        n_periodic,
        t0.elapsed().as_secs_f64()
    );

    // Parameters, in checkpoint order.
    let specs = cfg.expected_tensors();
    let mut vars: HashMap<String, Var> = HashMap::new();
    let (mut decayed, mut plain) = (vec![], vec![]);
    for (name, shape) in &specs {
        let v = init_var(name, shape, &cfg, args.seed, &dev)?;
        if shape.len() >= 2 {
            decayed.push(v.clone());
        } else {
            plain.push(v.clone());
        }
        vars.insert(name.clone(), v);
    }
    eprintln!(
        "tiny preset: {} parameters, {} layers {:?}; {} steps x {} x {} tokens, warmup {warmup}, seed {}",
        cfg.param_count(),
        cfg.num_hidden_layers,
        cfg.mixer_types,
        args.steps,
        args.batch,
        args.seqlen,
        args.seed
    );
    let get_var = |name: &str| -> Result<Tensor> {
        Ok(vars
            .get(name)
            .with_context(|| format!("no parameter {name}"))?
            .as_tensor()
            .clone())
    };
    let get_detached = |name: &str| -> Result<Tensor> { Ok(get_var(name)?.detach()) };
    let train_net = Net::build(&cfg, &dev, &get_var, true)?;
    let eval_net = Net::build(&cfg, &dev, &get_detached, false)?;

    let adam = |wd: f64| ParamsAdamW {
        lr: args.lr,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: wd,
    };
    let mut opt_decay = AdamW::new(decayed, adam(args.weight_decay))?;
    let mut opt_plain = AdamW::new(plain, adam(0.0))?;
    let all_vars: Vec<&Var> = specs.iter().map(|(n, _)| &vars[n]).collect();

    let mut rng = SplitMix64::new(args.seed ^ 0xDA7A_5EED);
    let mut log = vec![];
    let (mut best, mut stale) = (f64::INFINITY, 0usize);
    let decay_frac = 0.25;
    let mut steps = args.steps;
    let mut decay = args
        .decay_steps
        .unwrap_or((steps as f64 * decay_frac).round() as usize)
        .min(steps);
    let mut decaying = false;
    let (mut loss_sum, mut loss_n) = (0.0, 0usize);
    let mut last_loss = f64::NAN;
    let mut train_secs = 0.0;
    let mut tokens_seen = 0usize;
    let mut stop_reason = "steps";
    let mut steps_done = 0;
    let budget = args.time_budget_secs.map(|s| s as f64);
    let t_train = Instant::now();
    let mut step = 0;
    while step < steps {
        let elapsed = t_train.elapsed().as_secs_f64();
        if let Some(b) = budget {
            if elapsed >= b {
                stop_reason = "time budget";
                break;
            }
            // Projected steps within the budget at the pace so far; shorten the run (and start
            // its decay) when it would not fit.
            if step >= warmup && !decaying {
                let projected = (step as f64 * b / elapsed) as usize;
                if projected < steps {
                    let d = ((projected as f64 * decay_frac) as usize).max(1);
                    if step + d >= projected {
                        steps = step + d;
                        decay = d;
                        stop_reason = "steps (shortened to fit the time budget)";
                    }
                }
            }
        }
        decaying = decaying || step >= steps.saturating_sub(decay);
        let ts = Instant::now();
        let lr = lr_at(step, &args, warmup, steps, decay);
        opt_decay.set_learning_rate(lr);
        opt_plain.set_learning_rate(lr);
        let mut batch = Vec::with_capacity(args.batch * args.seqlen);
        for _ in 0..args.batch {
            let s = rng.below(train.len() - args.seqlen);
            batch.extend_from_slice(&train[s..s + args.seqlen]);
        }
        let ids = Tensor::from_vec(batch, (args.batch, args.seqlen), &dev)?;
        let (l, mut grads) = loss_and_grads(&train_net, &ids, workers, &all_vars)?;
        let t_bwd = ts.elapsed().as_secs_f64();
        let mut sq = 0f64;
        for v in &all_vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let gnorm = sq.sqrt();
        if args.clip > 0.0 && gnorm > args.clip {
            let s = args.clip / gnorm;
            for v in &all_vars {
                if let Some(g) = grads.remove(v.as_tensor()) {
                    grads.insert(v.as_tensor(), (g * s)?);
                }
            }
        }
        opt_decay.step(&grads)?;
        opt_plain.step(&grads)?;
        drop(grads);
        if !l.is_finite() {
            bail!("training diverged at step {step} (loss {l})");
        }
        let t_step = ts.elapsed().as_secs_f64();
        train_secs += t_step;
        tokens_seen += args.batch * args.seqlen;
        loss_sum += l;
        loss_n += 1;
        last_loss = l;
        steps_done = step + 1;
        step += 1;
        if steps_done % args.log_every.max(1) == 0 || steps_done == 1 {
            eprintln!(
                "step {steps_done:>5}  loss {:.4}  lr {lr:.2e}  |g| {gnorm:.3}  {:.0} tok/s  \
                 (fwd+bwd {:.2}s, opt {:.2}s)  {:.0}s",
                loss_sum / loss_n as f64,
                tokens_seen as f64 / train_secs,
                t_bwd,
                t_step - t_bwd,
                t0.elapsed().as_secs_f64()
            );
            loss_sum = 0.0;
            loss_n = 0;
        }
        if args.eval_every > 0 && steps_done % args.eval_every == 0 && steps_done < steps {
            let ppl = eval_net.perplexity(&periodic, 8)?;
            eprintln!("step {steps_done:>5}  held-out ppl {ppl:.2} ({n_periodic} windows)");
            log.push(
                serde_json::json!({"step": steps_done, "train_loss": l, "heldout_ppl": ppl,
                "tokens_seen": tokens_seen, "elapsed_s": t0.elapsed().as_secs_f64()}),
            );
            if ppl < best * (1.0 - args.min_improvement) {
                best = ppl;
                stale = 0;
            } else {
                stale += 1;
                if args.patience > 0 && stale >= args.patience && !decaying {
                    let d = ((steps_done as f64 * decay_frac) as usize).max(1);
                    if steps_done + d < steps {
                        steps = steps_done + d;
                        decay = d;
                        stop_reason =
                            "steps (decay started when held-out perplexity stopped improving)";
                    }
                    decaying = true;
                    eprintln!(
                        "held-out perplexity stopped improving: decaying over {d} more steps"
                    );
                }
            }
        }
    }
    let wall_train = t_train.elapsed().as_secs_f64();
    eprintln!(
        "stopped after {steps_done} steps ({stop_reason}): {tokens_seen} tokens in {wall_train:.0}s, {:.0} tok/s",
        tokens_seen as f64 / train_secs
    );

    // The F32 weights on the periodic windows (comparable with the curve above); the shipped
    // BF16 weights on every window (the number `eval-ppl --data default` reproduces).
    let ppl_f32 = eval_net.perplexity(&periodic, 8)?;
    eprintln!("held-out ppl (F32 weights, {n_periodic} windows): {ppl_f32:.3}");
    let bf16: HashMap<String, Tensor> = specs
        .iter()
        .map(|(n, _)| Ok((n.clone(), vars[n].as_tensor().to_dtype(DType::BF16)?)))
        .collect::<Result<_>>()?;
    let bf16_net = Net::build(
        &cfg,
        &dev,
        &|name: &str| -> Result<Tensor> { Ok(bf16[name].to_dtype(DType::F32)?) },
        false,
    )?;
    let ppl_bf16_periodic = bf16_net.perplexity(&periodic, 8)?;
    let ppl_bf16 = bf16_net.perplexity(&all_refs, 8)?;
    eprintln!(
        "held-out ppl (BF16 weights): {ppl_bf16_periodic:.3} on {n_periodic} windows, {ppl_bf16:.3} on all {}",
        all_refs.len()
    );

    let mut inputs = vec![
        InputPath::new("--train", &args.train),
        InputPath::new("--tokenizer", &args.tokenizer),
    ];
    inputs.extend(args.eval.iter().map(|e| InputPath::new("--eval", e)));
    let out = OutputDir::create(&args.out, args.force, &inputs)?;
    let dir = out.path().to_path_buf();
    write_side_files(&dir, &cfg, &tok_bytes)?;
    let tspecs: Vec<TensorSpec> = specs
        .iter()
        .map(|(n, s)| TensorSpec::new(n.clone(), Dtype::BF16, s.clone()))
        .collect();
    shards::write_sharded(&dir, &tspecs, u64::MAX, |spec, w| {
        let v: Vec<half::bf16> = bf16[&spec.name].flatten_all()?.to_vec1()?;
        let mut bytes = Vec::with_capacity(v.len() * 2);
        for x in v {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        w.write_all(&bytes)?;
        Ok(())
    })?;
    let report = serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "seed": args.seed,
        "steps": steps_done,
        "stop_reason": stop_reason,
        "seqlen": args.seqlen,
        "batch": args.batch,
        "peak_lr": args.lr,
        "warmup": warmup,
        "decay_steps": decay,
        "reproduce_with": format!("--steps {steps_done} --decay-steps {decay} --warmup {warmup} (no time budget)"),
        "tokens_seen": tokens_seen,
        "train_tokens": train.len(),
        "wall_train_s": wall_train,
        "tokens_per_s": tokens_seen as f64 / train_secs,
        "final_train_loss": last_loss,
        "heldout_windows": all_refs.len(),
        "heldout_periodic_windows": n_periodic,
        "heldout_ppl_periodic_f32": ppl_f32,
        "heldout_ppl_periodic_bf16": ppl_bf16_periodic,
        "heldout_ppl_bf16": ppl_bf16,
        "evals": log,
    });
    files::write_file(
        &dir.join("train_report.json"),
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;
    let path = out.commit()?;
    eprintln!(
        "wrote {} in {:.0}s total",
        path.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
