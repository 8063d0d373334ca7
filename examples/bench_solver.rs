//! Benchmark of the GPTQ solver on MiniCPM-SALA Linear shapes (a benchmark, not a test: it prints
//! figures and asserts nothing about time).
//!
//! ```text
//! cargo run --release --example bench_solver -- [--shapes 4096x4096,16384x4096,4096x16384]
//!     [--tokens 2048] [--devices cpu,cuda] [--repeat 5] [--save DIR] [--hessian-tokens 65536]
//! ```
//! Shapes are `N_outxK_in`. For each shape it builds seeded correlated inputs (independent noise
//! plus shared low-rank factors, features of unequal energy), accumulates their Hessian (f32, on
//! the CPU) and solves one seeded random W with the same H on every device listed, printing the
//! median seconds of the whole solve, its factorization and column-loop parts, the loss, and
//! the CPU packing of the resulting codes into GPTQ qweight (`pack_s`, what `quantize` does next).
//! GPU solves are timed after one warm-up solve; each solve ends with the codes copied back to
//! the host, so host timers see finished device work.
//!
//! `--save DIR` writes each shape's W and H (`w`, `h` f32 and the settings as metadata) for
//! `examples/bench/gptq_eager.py`, the eager PyTorch baseline run on the same inputs.
//! `--hessian-tokens T` (CUDA builds) also times the tensor-core XᵀX of T random BF16 tokens
//! per shape's K and prints its TFLOP/s.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use soar_gptq::format::pack::pack_qweight_nk;
use soar_gptq::gptq::{gptq_quantize, HessianAccumulator, QuantParams, SolveOptions};
use soar_gptq::rng::SplitMix64;
use soar_gptq::scheme::{ActOrder, GroupSize};

/// Shared latent factors of the synthetic inputs: they make the features correlated.
const LATENT_RANK: usize = 64;

#[derive(Parser)]
struct Args {
    /// Comma-separated `N_outxK_in` shapes.
    #[arg(long, default_value = "4096x4096,16384x4096,4096x16384")]
    shapes: String,
    /// Calibration tokens fed to the Hessian.
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    #[arg(long, value_enum, default_value_t = ActOrder::Static)]
    act_order: ActOrder,
    #[arg(long, default_value_t = GroupSize::G128, allow_hyphen_values = true)]
    group_size: GroupSize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Devices to solve on: cpu, cuda (CUDA builds), comma-separated.
    #[arg(long, default_value = "cpu")]
    devices: String,
    /// Timed solves per device (median reported); GPU runs add one untimed warm-up.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Write each shape's W and H here for the PyTorch baseline.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Also time the GPU XᵀX over this many BF16 tokens per K (0: skip).
    #[arg(long, default_value_t = 0)]
    hessian_tokens: usize,
}

/// A `[rows, cols]` tensor of normal values with standard deviation `std`.
fn normal_tensor(rng: &mut SplitMix64, rows: usize, cols: usize, std: f32) -> Result<Tensor> {
    let v: Vec<f32> = rng.normals(rows * cols).iter().map(|x| x * std).collect();
    Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (n, k) = s
        .split_once('x')
        .with_context(|| format!("shape `{s}` is not NxK"))?;
    Ok((n.trim().parse()?, k.trim().parse()?))
}

fn device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            if !cfg!(feature = "cuda") {
                bail!("--devices cuda needs a build with --features cuda");
            }
            Ok(Device::new_cuda(0)?)
        }
        other => bail!("unknown device `{other}` (cpu or cuda)"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn save(
    dir: &std::path::Path,
    n: usize,
    k: usize,
    w: &Tensor,
    h: &Tensor,
    args: &Args,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let bytes = |t: &Tensor| -> Result<Vec<u8>> {
        Ok(t.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect())
    };
    let (wb, hb) = (bytes(w)?, bytes(h)?);
    let meta: HashMap<String, String> = [
        ("bits", "4".to_string()),
        ("group_size", args.group_size.to_string()),
        ("act_order", args.act_order.to_string()),
        ("sym", "true".to_string()),
        ("damp", "0.01".to_string()),
        ("block_size", "128".to_string()),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b))
    .collect();
    let views = [
        (
            "w",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, k], &wb)?,
        ),
        (
            "h",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![k, k], &hb)?,
        ),
    ];
    let path = dir.join(format!("{n}x{k}.safetensors"));
    safetensors::serialize_to_file(views, Some(meta), &path)?;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let act_order = args.act_order;
    let shapes: Vec<(usize, usize)> = args
        .shapes
        .split(',')
        .map(parse_shape)
        .collect::<Result<_>>()?;
    let devices: Vec<(String, Device)> = args
        .devices
        .split(',')
        .map(|d| Ok((d.trim().to_string(), device(d.trim())?)))
        .collect::<Result<_>>()?;
    println!(
        "threads {}  tokens {}  act-order {}  group {}  repeat {}",
        rayon::current_num_threads(),
        args.tokens,
        args.act_order,
        args.group_size,
        args.repeat
    );
    println!(
        "{:>12} {:>6} {:>10} {:>10} {:>10} {:>14} {:>8} {:>10}",
        "shape NxK", "device", "solve_s", "factor_s", "loop_s", "loss", "damp", "pack_s"
    );
    for &(n, k) in &shapes {
        let mut rng = SplitMix64::new(args.seed ^ ((n as u64) << 32 | k as u64));
        // X = Z·diag(s) + F·B: per-feature noise of unequal energy plus shared latent factors.
        let col_scale: Vec<f32> = (0..k)
            .map(|_| (0.5 * (rng.normal() as f32)).exp())
            .collect();
        let z = normal_tensor(&mut rng, args.tokens, k, 1.0)?
            .broadcast_mul(&Tensor::new(col_scale.as_slice(), &Device::Cpu)?)?;
        let f = normal_tensor(&mut rng, args.tokens, LATENT_RANK, 1.0)?;
        let b = normal_tensor(&mut rng, LATENT_RANK, k, 0.5)?;
        let x = (z + f.matmul(&b)?)?;
        let mut acc = HessianAccumulator::new(k, &Device::Cpu)?;
        acc.add_batch(&x, None)?;
        let h = acc.hessian()?;
        drop(x);
        let w = normal_tensor(&mut rng, n, k, 0.02)?;
        if let Some(dir) = &args.save {
            save(dir, n, k, &w, &h, &args)?;
        }
        let opts = SolveOptions {
            quant: QuantParams {
                group_size: args.group_size,
                ..QuantParams::default()
            },
            act_order,
            module: format!("bench.{n}x{k}"),
            ..SolveOptions::default()
        };
        for (name, dev) in &devices {
            let (wd, hd) = (w.to_device(dev)?, h.to_device(dev)?);
            if dev.is_cuda() {
                gptq_quantize(&wd, &hd, &opts)?;
            }
            let (mut total, mut factor, mut lp) = (vec![], vec![], vec![]);
            let mut last = None;
            for _ in 0..args.repeat.max(1) {
                let t = Instant::now();
                let q = gptq_quantize(&wd, &hd, &opts)?;
                total.push(t.elapsed().as_secs_f64());
                factor.push(q.timings.factor_s);
                lp.push(q.timings.loop_s);
                last = Some(q);
            }
            let q = last.expect("at least one solve");
            // What `quantize` does next with the codes on the host: GPTQ qweight packing.
            let mut pack = vec![];
            for _ in 0..args.repeat.max(1) {
                let t = Instant::now();
                let words = pack_qweight_nk(&q.codes, n, k, opts.quant.bits)?;
                pack.push(t.elapsed().as_secs_f64());
                drop(words);
            }
            println!(
                "{:>12} {:>6} {:>10.4} {:>10.4} {:>10.4} {:>14.6e} {:>8} {:>10.4}",
                format!("{n}x{k}"),
                name,
                median(total),
                median(factor),
                median(lp),
                q.loss,
                q.damp_used,
                median(pack)
            );
        }
    }
    if args.hessian_tokens > 0 {
        hessian_rates(&args, &shapes, &devices)?;
    }
    Ok(())
}

/// Times `HessianAccumulator::add_batch` over `--hessian-tokens` random BF16 rows per distinct K
/// on each GPU device, after a warm-up, and prints the median TFLOP/s (2·T·K² per product).
fn hessian_rates(
    args: &Args,
    shapes: &[(usize, usize)],
    devices: &[(String, Device)],
) -> Result<()> {
    let mut ks: Vec<usize> = shapes.iter().map(|&(_, k)| k).collect();
    ks.sort_unstable();
    ks.dedup();
    println!(
        "\n{:>8} {:>8} {:>10} {:>10} {:>10}",
        "K", "device", "tokens", "median_s", "TFLOP/s"
    );
    for (name, dev) in devices.iter().filter(|(_, d)| d.is_cuda()) {
        for &k in &ks {
            let t = args.hessian_tokens;
            let x = Tensor::randn(0f32, 1.0, (t, k), dev)?.to_dtype(DType::BF16)?;
            let mut times = vec![];
            for rep in 0..4 {
                let mut acc = HessianAccumulator::new(k, dev)?;
                dev.synchronize()?;
                let s = Instant::now();
                acc.add_batch(&x, None)?;
                dev.synchronize()?;
                if rep > 0 {
                    times.push(s.elapsed().as_secs_f64());
                }
            }
            let m = median(times);
            println!(
                "{:>8} {:>8} {:>10} {:>10.5} {:>10.1}",
                k,
                name,
                t,
                m,
                2.0 * t as f64 * (k * k) as f64 / m / 1e12
            );
        }
    }
    Ok(())
}
