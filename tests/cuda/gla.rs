//! The fused Simple-GLA kernel (`kernels::gla`, `src/kernels/gla.cu`) against its CPU twins,
//! `model::gla::chunk_parallel` (the form the model runs) and `model::gla::chunked` (the form
//! with states): the largest difference at most 1e-5 of the largest |o| (the tolerance the CPU
//! forms keep among themselves), for BF16 and f32 inputs. Built only with `--features cuda`; run
//! on a machine with a GPU. Without one every test fails, unless `SOAR_GPTQ_SKIP_GPU_TESTS=1`
//! says to skip them. The timings: `cargo test --release --features cuda --test cuda --
//! --nocapture --test-threads=1`.

use crate::gpu;
use candle_core::{DType, Device, Tensor};
use soar_gptq::kernels::gla;
use soar_gptq::model::gla as cpu;
use soar_gptq::rng::SplitMix64;

/// The largest difference allowed, relative to the largest |o| of the reference.
const TOL: f32 = 1e-5;

/// Whether a relative error is within [`TOL`] (NaN is not).
fn within(e: f32) -> bool {
    e <= TOL
}

/// A `[b, t, heads, d]` tensor of standard normals on the CPU: f32 holding `dtype` values (so
/// the CPU forms see exactly what the kernel reads).
fn operand(
    rng: &mut SplitMix64,
    (b, t, heads, d): (usize, usize, usize, usize),
    dtype: DType,
) -> Tensor {
    Tensor::from_vec(
        rng.normals(b * t * heads * d),
        (b, t, heads, d),
        &Device::Cpu,
    )
    .unwrap()
    .to_dtype(dtype)
    .unwrap()
    .to_dtype(DType::F32)
    .unwrap()
}

/// A model-layout operand `[B, T, KV, D]` in the CPU forms' layout `[B, H, T, D]`, kv head
/// `h / (H / KV)` for head `h` (what `repeat_kv` gives).
fn cpu_layout(x: &Tensor, heads: usize) -> Tensor {
    let kv = x.dim(2).unwrap();
    let x = if kv == heads {
        x.clone()
    } else {
        let idx: Vec<u32> = (0..heads).map(|h| (h / (heads / kv)) as u32).collect();
        let idx = Tensor::new(idx.as_slice(), x.device()).unwrap();
        x.index_select(&idx, 2).unwrap()
    };
    x.transpose(1, 2).unwrap().contiguous().unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// max |got − want| / max |want| (both f32 of one shape, on one device); infinite when `got`
/// holds a NaN or an infinity (which a max may pass over).
fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    let sum = got.sum_all().unwrap().to_scalar::<f32>().unwrap();
    if !sum.is_finite() {
        return f32::INFINITY;
    }
    max_abs(&(got - want).unwrap()) / max_abs(want).max(1e-30)
}

/// The kernel's output `[B, T, H, D]` on the CPU in the CPU forms' layout `[B, H, T, D]`.
fn kernel_out(o: &Tensor) -> Tensor {
    assert_eq!(o.dtype(), DType::F32);
    o.to_device(&Device::Cpu)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
}

fn up(x: &Tensor, dtype: DType, dev: &Device) -> Tensor {
    x.to_dtype(dtype).unwrap().to_device(dev).unwrap()
}

/// The model's shape (H 32 with the released decays, D 128, no grouping): lengths below, at and
/// past one chunk, ragged and many-chunk lengths, one and two sequences, BF16 and f32 inputs;
/// the output against both CPU forms.
#[test]
fn kernel_matches_the_cpu_forms_at_the_model_shape() {
    let Some(dev) = gpu() else { return };
    let (h, d) = (32usize, 128usize);
    let gammas = cpu::decays(h);
    let scale = 1.0 / (d as f64).sqrt();
    let mut rng = SplitMix64::new(41);
    let mut failed = vec![];
    for dtype in [DType::BF16, DType::F32] {
        for b in [1usize, 2] {
            for t in [1usize, 63, 64, 65, 1000, 4097] {
                let q = operand(&mut rng, (b, t, h, d), dtype);
                let k = operand(&mut rng, (b, t, h, d), dtype);
                let v = operand(&mut rng, (b, t, h, d), dtype);
                let (qc, kc, vc) = (cpu_layout(&q, h), cpu_layout(&k, h), cpu_layout(&v, h));
                let parallel = cpu::chunk_parallel(&qc, &kc, &vc, &gammas, scale, 64).unwrap();
                let (chunked, _) = cpu::chunked(&qc, &kc, &vc, &gammas, scale, 64, None).unwrap();
                let o = gla::forward(
                    &up(&q, dtype, &dev),
                    &up(&k, dtype, &dev),
                    &up(&v, dtype, &dev),
                    &gammas,
                    scale,
                )
                .unwrap();
                assert_eq!(o.dims(), [b, t, h, d]);
                let got = kernel_out(&o);
                let (ep, ec) = (rel_err(&got, &parallel), rel_err(&got, &chunked));
                eprintln!(
                    "GLA {dtype:?} B {b} T {t}: max |o| {:.3}, rel err vs chunk_parallel {ep:.2e}, \
                     vs chunked {ec:.2e}",
                    max_abs(&parallel)
                );
                if !(within(ep) && within(ec)) {
                    failed.push((dtype, b, t, ep, ec));
                }
            }
        }
    }
    assert!(failed.is_empty(), "kernel off at {failed:?}");
}

/// Every head dimension the kernel has, grouped kv heads (H / KV of 1, 2 and 4), an incoming
/// state and the final state against `chunked`, and a sequence run in two pieces (the state of
/// the first passed to the second) against one call.
#[test]
fn kernel_carries_states_and_groups_heads_at_every_head_dim() {
    let Some(dev) = gpu() else { return };
    let mut rng = SplitMix64::new(42);
    let mut failed = vec![];
    // (B, T, H, KV, D)
    for (b, t, h, kv, d) in [
        (2usize, 130usize, 8usize, 2usize, 128usize),
        (1, 200, 4, 4, 128),
        (2, 77, 8, 2, 64),
        (1, 129, 4, 1, 32),
        (2, 300, 4, 4, 16),
        (1, 64, 2, 1, 16),
    ] {
        for dtype in [DType::BF16, DType::F32] {
            let gammas = cpu::decays(h);
            let scale = 1.0 / (d as f64).sqrt();
            let q = operand(&mut rng, (b, t, h, d), dtype);
            let k = operand(&mut rng, (b, t, kv, d), dtype);
            let v = operand(&mut rng, (b, t, kv, d), dtype);
            let s0 =
                Tensor::from_vec(rng.normals(b * h * d * d), (b, h, d, d), &Device::Cpu).unwrap();
            let (qc, kc, vc) = (cpu_layout(&q, h), cpu_layout(&k, h), cpu_layout(&v, h));
            let (want, want_s) =
                cpu::chunked(&qc, &kc, &vc, &gammas, scale, 64, Some(&s0)).unwrap();
            let (qg, kg, vg) = (
                up(&q, dtype, &dev),
                up(&k, dtype, &dev),
                up(&v, dtype, &dev),
            );
            let s0g = s0.to_device(&dev).unwrap();
            let (o, s) =
                gla::forward_with_state(&qg, &kg, &vg, &gammas, scale, Some(&s0g)).unwrap();
            let (eo, es) = (
                rel_err(&kernel_out(&o), &want),
                rel_err(&s.to_device(&Device::Cpu).unwrap(), &want_s),
            );
            // Zero state: `forward` and `chunk_parallel`.
            let o0 = gla::forward(&qg, &kg, &vg, &gammas, scale).unwrap();
            let want0 = cpu::chunk_parallel(&qc, &kc, &vc, &gammas, scale, 64).unwrap();
            let e0 = rel_err(&kernel_out(&o0), &want0);
            // Two pieces, split off a chunk boundary.
            let cut = t / 3 + 1;
            let piece = |x: &Tensor, a: usize, n: usize| x.narrow(1, a, n).unwrap();
            let (o1, s1) = gla::forward_with_state(
                &piece(&qg, 0, cut),
                &piece(&kg, 0, cut),
                &piece(&vg, 0, cut),
                &gammas,
                scale,
                Some(&s0g),
            )
            .unwrap();
            let (o2, s2) = gla::forward_with_state(
                &piece(&qg, cut, t - cut),
                &piece(&kg, cut, t - cut),
                &piece(&vg, cut, t - cut),
                &gammas,
                scale,
                Some(&s1),
            )
            .unwrap();
            let joined = Tensor::cat(&[&o1, &o2], 1).unwrap();
            let ej = rel_err(&kernel_out(&joined), &want);
            let ejs = rel_err(&s2.to_device(&Device::Cpu).unwrap(), &want_s);
            eprintln!(
                "GLA {dtype:?} B {b} T {t} H {h} KV {kv} D {d}: rel err with state {eo:.2e}, \
                 final state {es:.2e}, zero state {e0:.2e}, in two pieces {ej:.2e} / {ejs:.2e}"
            );
            if ![eo, es, e0, ej, ejs].into_iter().all(within) {
                failed.push((dtype, b, t, h, kv, d, [eo, es, e0, ej, ejs]));
            }
        }
    }
    assert!(failed.is_empty(), "kernel off at {failed:?}");
}

/// The released decays of `heads` for a subset of them.
fn decays_of(all: &[f64], heads: &[usize]) -> Vec<f64> {
    heads.iter().map(|&h| all[h]).collect()
}

/// Heads `heads` of a model-layout tensor `[B, T, H, D]` on the GPU, as `[B, len, T, D]` f32 on
/// the CPU.
fn heads_on_cpu(x: &Tensor, heads: &[usize]) -> Tensor {
    let idx: Vec<u32> = heads.iter().map(|&h| h as u32).collect();
    let idx = Tensor::new(idx.as_slice(), x.device()).unwrap();
    x.index_select(&idx, 2)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
}

/// A long window (T 50,000, 782 chunks, H 32, D 128, BF16 inputs) against `chunked` on the CPU
/// for three heads: the fastest decay, a middle one and the slowest (γ 0.996, whose state
/// remembers ~250 tokens).
#[test]
fn kernel_matches_the_chunked_form_on_a_long_window() {
    let Some(dev) = gpu() else { return };
    let (b, t, h, d) = (1usize, 50_000usize, 32usize, 128usize);
    let gammas = cpu::decays(h);
    let scale = 1.0 / (d as f64).sqrt();
    let randn = || {
        Tensor::randn(0f32, 1f32, (b, t, h, d), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let (q, k, v) = (randn(), randn(), randn());
    let o = gla::forward(&q, &k, &v, &gammas, scale).unwrap();
    let heads = [0usize, 13, 31];
    let (qc, kc, vc) = (
        heads_on_cpu(&q, &heads),
        heads_on_cpu(&k, &heads),
        heads_on_cpu(&v, &heads),
    );
    let (want, _) =
        cpu::chunked(&qc, &kc, &vc, &decays_of(&gammas, &heads), scale, 64, None).unwrap();
    let got = heads_on_cpu(&o, &heads);
    let e = rel_err(&got, &want);
    eprintln!(
        "GLA long window T {t}, heads {heads:?}: max |o| {:.3}, rel err vs chunked {e:.2e}",
        max_abs(&want)
    );
    assert!(within(e), "long window: rel err {e:.3e}");
}

/// Kernel time per call (device-synchronized, 10 calls after a warm-up) at one long window (B 1,
/// T 49,152) and a batch of windows (B 8, T 2048), H 32, D 128, BF16 inputs, beside the
/// chunk-parallel form on the GPU (f32 `[B, H, T, D]` inputs, as the model prepares them); the
/// kernel's output against that form on every head. Prints the time; asserts only correctness.
#[test]
fn kernel_speed_at_long_and_batched_windows() {
    let Some(dev) = gpu() else { return };
    let (h, d) = (32usize, 128usize);
    let gammas = cpu::decays(h);
    let scale = 1.0 / (d as f64).sqrt();
    for (b, t) in [(1usize, 49_152usize), (8, 2048)] {
        let randn = || {
            Tensor::randn(0f32, 1f32, (b, t, h, d), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let (q, k, v) = (randn(), randn(), randn());
        let time = |f: &dyn Fn() -> Tensor| -> (f64, Tensor) {
            let out = f();
            dev.synchronize().unwrap();
            let start = std::time::Instant::now();
            for _ in 0..10 {
                f();
            }
            dev.synchronize().unwrap();
            (start.elapsed().as_secs_f64() / 10.0, out)
        };
        let (secs, o) = time(&|| gla::forward(&q, &k, &v, &gammas, scale).unwrap());
        let f32t = |x: &Tensor| {
            x.transpose(1, 2)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (qf, kf, vf) = (f32t(&q), f32t(&k), f32t(&v));
        let (base_secs, want) =
            time(&|| cpu::chunk_parallel(&qf, &kf, &vf, &gammas, scale, 64).unwrap());
        // The chunked form's arithmetic per token and head: scores and intra-chunk product over
        // whole chunks (64·D each), the inter-chunk product and the state update (D² each).
        let flop = 2.0 * (b * t * h) as f64 * (2 * 64 * d + 2 * d * d) as f64;
        eprintln!(
            "GLA B {b} T {t} H {h} D {d} BF16: fused kernel {:.3} ms ({:.1} TFLOP/s of the \
             chunked form's {:.1} GFLOP); chunk_parallel on the GPU {:.3} ms ({:.1}×)",
            secs * 1e3,
            flop / secs / 1e12,
            flop / 1e9,
            base_secs * 1e3,
            base_secs / secs
        );
        let e = rel_err(&o.transpose(1, 2).unwrap().contiguous().unwrap(), &want);
        eprintln!("  rel err vs chunk_parallel (GPU, f32) {e:.2e}");
        assert!(within(e), "B {b} T {t}: rel err {e:.3e}");
    }
}

/// Where a 9.5B layer's mixer time goes at one 49,152-token window (random weights of the
/// `minicpm-sala-9b` preset's shapes, BF16): `mixer_output` of a lightning layer (layer 1) and of
/// a sparse layer (layer 0, InfLLM-v2), and beside them the projections alone (the GEMMs of
/// q/k/v/z or q/k/v/o_gate), device-synchronized, mean of 3 calls after a warm-up. Prints the
/// times (docs/benchmarks.md); asserts only that the outputs are finite.
#[test]
fn mixer_times_of_the_9b_layers_at_a_long_window() {
    use soar_gptq::model::config::preset;
    use soar_gptq::model::minicpm_sala::DecoderLayer;
    let Some(dev) = gpu() else { return };
    // As the pipeline runs: freed memory stays in the pool (else every call maps fresh pages).
    soar_gptq::kernels::memory::keep_pool_memory(&dev).unwrap();
    let cfg = preset("minicpm-sala-9b").unwrap();
    let shapes: std::collections::HashMap<String, Vec<usize>> =
        cfg.expected_tensors().into_iter().collect();
    let get = |name: &str| -> anyhow::Result<Tensor> {
        let shape = &shapes[name];
        let std = if shape.len() == 2 { 0.02 } else { 0.0 };
        let t = Tensor::randn(0f32, 1f32, shape.as_slice(), &dev)?;
        let t = if shape.len() == 2 {
            (t * std)?
        } else {
            t.ones_like()?
        };
        Ok(t.to_dtype(DType::BF16)?)
    };
    let t = 49_152usize;
    let h = Tensor::randn(0f32, 1f32, (1, t, cfg.hidden_size), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let time = |f: &dyn Fn() -> Tensor| -> f64 {
        let out = f();
        dev.synchronize().unwrap();
        let start = std::time::Instant::now();
        for _ in 0..3 {
            f();
        }
        dev.synchronize().unwrap();
        assert!(max_abs(&out.to_dtype(DType::F32).unwrap()).is_finite());
        start.elapsed().as_secs_f64() / 3.0 * 1e3
    };
    // The layer's GEMM shapes alone, as `Linear::forward` runs them (x · Wᵀ, BF16).
    for (name, k, n) in [
        ("q/o (4096 → 4096)", 4096, 4096),
        ("gate or up (4096 → 16384)", 4096, 16_384),
        ("down (16384 → 4096)", 16_384, 4096),
    ] {
        let x = Tensor::randn(0f32, 1f32, (t, k), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let w = Tensor::randn(0f32, 0.02f32, (n, k), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let ms = time(&|| x.matmul(&w.t().unwrap()).unwrap());
        eprintln!(
            "GEMM {name}, M {t}: {ms:.2} ms, {:.0} TFLOP/s",
            2.0 * (t * k * n) as f64 / ms / 1e9
        );
    }
    for (i, kind, proj) in [
        (
            1usize,
            "lightning",
            &["q_proj", "k_proj", "v_proj", "z_proj"][..],
        ),
        (0, "sparse", &["q_proj", "k_proj", "v_proj", "o_gate"][..]),
    ] {
        let layer = DecoderLayer::from_tensors(&cfg, i, &get).unwrap();
        let x = layer.input_norm(&h).unwrap().reshape((t, ())).unwrap();
        let ws: Vec<Tensor> = proj
            .iter()
            .map(|p| get(&format!("model.layers.{i}.self_attn.{p}.weight")).unwrap())
            .collect();
        let gemms = time(&|| {
            let mut last = None;
            for w in &ws {
                last = Some(x.matmul(&w.t().unwrap()).unwrap());
            }
            last.unwrap()
        });
        let whole = time(&|| layer.mixer_output(&h).unwrap());
        eprintln!(
            "{kind} mixer, T {t}: {whole:.1} ms, of which the projections {gemms:.1} ms \
             and the rest (norms, RoPE, the kernel, gates) {:.1} ms",
            whole - gemms
        );
    }
}
