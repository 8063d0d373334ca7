//! The page-locked copies of the per-batch layer caches (`kernels::transfer::CopyStream`):
//! tensors sent to host memory on the copy stream while the device's stream goes on computing
//! come back bit for bit, in any order, through reused buffers, with their sources freed right
//! after the store.

use crate::gpu;
use candle_core::{DType, Tensor};
use soar_gptq::kernels::transfer::CopyStream;

fn bits(t: &Tensor) -> Vec<u16> {
    t.to_dtype(DType::BF16)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<half::bf16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn tensors_come_back_bit_for_bit_through_reused_page_locked_buffers() {
    let Some(dev) = gpu() else { return };
    let copies = CopyStream::new(&dev).unwrap();
    // 8 batches of 4096 × 4096 BF16 (32 MiB each), computed on the device's stream.
    let make = |layer: usize, bi: usize| {
        let base = Tensor::arange(0f32, (4096 * 4096) as f32, &dev)
            .unwrap()
            .reshape((4096, 4096))
            .unwrap();
        ((base * (1e-3 * (bi + 1) as f64)).unwrap().sin().unwrap() + layer as f64)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let n = 4096 * 4096 * 2;
    let mut bufs: Vec<_> = (0..8).map(|_| copies.alloc(n).unwrap()).collect();
    for layer in 0..3 {
        let mut stores = vec![];
        let mut want = vec![];
        for (bi, buf) in bufs.iter_mut().enumerate() {
            let t = make(layer, bi);
            want.push(bits(&t));
            // The source is dropped with the copy: its memory is reused by the next batch.
            stores.push(copies.store(&t, buf).unwrap());
            drop(t);
            let _noise = make(layer + 10, bi);
        }
        drop(stores);
        // Back in a different order than stored, two in flight at a time.
        let order: Vec<usize> = (0..8).rev().collect();
        let mut loading = copies.load(&bufs[order[0]]).unwrap();
        for (j, &bi) in order.iter().enumerate() {
            let next = order.get(j + 1).map(|&b| copies.load(&bufs[b]).unwrap());
            let got = loading.finish().unwrap();
            assert_eq!(got.dims(), &[4096, 4096]);
            assert_eq!(bits(&got), want[bi], "layer {layer}, batch {bi}");
            match next {
                Some(l) => loading = l,
                None => break,
            }
        }
    }
}

/// The link's rate for the copies of a 49,152-token window's mixer output (403 MB), out and
/// back, each direction alone and both at once (printed for docs/benchmarks.md).
#[test]
fn copy_rates_of_a_long_windows_mixer_output() {
    let Some(dev) = gpu() else { return };
    let copies = CopyStream::new(&dev).unwrap();
    let t = Tensor::ones((49_152, 4096), DType::BF16, &dev).unwrap();
    let n = 49_152 * 4096 * 2;
    let mut bufs: Vec<_> = (0..4).map(|_| copies.alloc(n).unwrap()).collect();
    let sync = || dev.synchronize().unwrap();
    let rate = |what: &str, bytes: usize, secs: f64| {
        eprintln!("{what}: {:.1} GB/s", bytes as f64 / secs / 1e9);
    };
    for round in 0..2 {
        sync();
        let t0 = std::time::Instant::now();
        let stores: Vec<_> = bufs
            .iter_mut()
            .map(|b| copies.store(&t, b).unwrap())
            .collect();
        drop(stores);
        sync();
        let out = t0.elapsed().as_secs_f64();
        let t0 = std::time::Instant::now();
        let loads: Vec<_> = bufs.iter().map(|b| copies.load(b).unwrap()).collect();
        let back: Vec<Tensor> = loads.into_iter().map(|l| l.finish().unwrap()).collect();
        sync();
        let inn = t0.elapsed().as_secs_f64();
        if round == 1 {
            rate("device to host", 4 * n, out);
            rate("host to device", 4 * n, inn);
        }
        drop(back);
    }
}
