//! Benchmark of the CPU GPTQ solver on MiniCPM-SALA Linear shapes (a benchmark, not a test: it prints
//! figures and asserts nothing about time).
//!
//! ```text
//! cargo run --release --example bench_solver -- [--shapes 4096x4096,16384x4096,4096x16384] [--tokens 2048]
//! ```
//! Shapes are `N_outxK_in`. For each shape it builds seeded correlated inputs (independent noise plus
//! shared low-rank factors, features of unequal energy), accumulates their Hessian and solves a
//! random W, printing seconds for the Hessian, the factorization and the column loop, and the loss.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::Parser;
use soar_gptq::gptq::{gptq_quantize, ActOrder, HessianAccumulator, QuantParams, SolveOptions};

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
    /// static | dynamic | off
    #[arg(long, default_value = "static")]
    act_order: String,
    #[arg(long, default_value_t = 128)]
    group_size: i64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// splitmix64 + Box–Muller: reproducible inputs without an extra dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn gaussian(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    fn tensor(&mut self, rows: usize, cols: usize, std: f32) -> Result<Tensor> {
        let v: Vec<f32> = (0..rows * cols).map(|_| self.gaussian() * std).collect();
        Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
    }
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (n, k) = s
        .split_once('x')
        .with_context(|| format!("shape `{s}` is not NxK"))?;
    Ok((n.trim().parse()?, k.trim().parse()?))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let act_order = match args.act_order.as_str() {
        "static" => ActOrder::Static,
        "dynamic" => ActOrder::Dynamic,
        "off" => ActOrder::Off,
        other => bail!("--act-order must be static, dynamic or off, got `{other}`"),
    };
    let shapes: Vec<(usize, usize)> = args
        .shapes
        .split(',')
        .map(parse_shape)
        .collect::<Result<_>>()?;
    println!(
        "threads {}  tokens {}  act-order {}  group {}",
        rayon::current_num_threads(),
        args.tokens,
        args.act_order,
        args.group_size
    );
    println!(
        "{:>14} {:>10} {:>10} {:>10} {:>12} {:>8}",
        "shape NxK", "hessian_s", "factor_s", "loop_s", "loss", "damp"
    );
    for (n, k) in shapes {
        let mut rng = Rng(args.seed ^ ((n as u64) << 32 | k as u64));
        // X = Z·diag(s) + F·B: per-feature noise of unequal energy plus shared latent factors.
        let col_scale: Vec<f32> = (0..k).map(|_| (0.5 * rng.gaussian()).exp()).collect();
        let z = rng
            .tensor(args.tokens, k, 1.0)?
            .broadcast_mul(&Tensor::new(col_scale.as_slice(), &Device::Cpu)?)?;
        let f = rng.tensor(args.tokens, LATENT_RANK, 1.0)?;
        let b = rng.tensor(LATENT_RANK, k, 0.5)?;
        let x = (z + f.matmul(&b)?)?;

        let t = Instant::now();
        let mut acc = HessianAccumulator::new(k, &Device::Cpu)?;
        acc.add_batch(&x, None)?;
        let h = acc.hessian()?;
        let hessian_s = t.elapsed().as_secs_f64();
        drop(x);

        let w = rng.tensor(n, k, 0.02)?;
        let opts = SolveOptions {
            quant: QuantParams {
                group_size: args.group_size,
                ..QuantParams::default()
            },
            act_order,
            module: format!("bench.{n}x{k}"),
            ..SolveOptions::default()
        };
        let q = gptq_quantize(&w, &h, &opts)?;
        println!(
            "{:>14} {:>10.3} {:>10.3} {:>10.3} {:>12.4e} {:>8}",
            format!("{n}x{k}"),
            hessian_s,
            q.timings.factor_s,
            q.timings.loop_s,
            q.loss,
            q.damp_used
        );
    }
    Ok(())
}
