//! With the `cuda` feature, compiles each `src/kernels/*.cu` of `KERNELS` to a fatbin with nvcc (a
//! CUDA 12.8+/13 toolchain on PATH or under CUDA_HOME): SASS for the compute capabilities in
//! CUDA_COMPUTE_CAP (one or a comma-separated list), else the local GPU's, else every
//! architecture from sm_80 to sm_120, plus the PTX of the lowest; no GPU is needed at build time
//! (docs/gpu.md, Architectures). The default build needs no CUDA at all and does nothing here.

use std::path::PathBuf;
use std::process::Command;

/// The kernel sources, each compiled to `<name>.fatbin` in OUT_DIR (`kernels::cuda` embeds them).
const KERNELS: &[&str] = &["gptq", "infllm", "gla"];

/// Every architecture the binary carries machine code for when the build machine has no GPU
/// (docs/gpu.md, Architectures): Ampere (A100; A10/RTX 30), Ada (L40S, RTX 4090), Hopper, and
/// Blackwell (B200; RTX 50 / RTX PRO 6000). PTX of the lowest goes beside them, for any later GPU.
const ALL_ARCHS: &[u32] = &[80, 86, 89, 90, 100, 120];

/// The architectures to build: `CUDA_COMPUTE_CAP` (one, or a comma-separated list), else the
/// local GPU's (nvidia-smi), else [`ALL_ARCHS`].
fn target_archs() -> Vec<u32> {
    if let Ok(s) = std::env::var("CUDA_COMPUTE_CAP") {
        let archs: Vec<u32> = s
            .split(',')
            .map(|a| {
                a.trim()
                    .trim_end_matches(['a', 'f'])
                    .replace('.', "")
                    .parse::<u32>()
                    .unwrap_or_else(|_| panic!("CUDA_COMPUTE_CAP={s} is not a list of compute capabilities such as 90 or 80,90"))
            })
            .collect();
        return archs;
    }
    let smi = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output();
    if let Ok(o) = smi {
        if o.status.success() {
            let text = String::from_utf8_lossy(&o.stdout);
            let mut archs: Vec<u32> = text
                .lines()
                .filter_map(|l| l.trim().replace('.', "").parse().ok())
                .collect();
            archs.sort();
            archs.dedup();
            if !archs.is_empty() {
                return archs;
            }
        }
    }
    ALL_ARCHS.to_vec()
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=src/kernels/{k}.cu");
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = match std::env::var_os("CUDA_HOME") {
        Some(home) => PathBuf::from(home).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    };
    let archs = target_archs();
    let lowest = *archs.iter().min().expect("at least one architecture");
    // Machine code for every architecture (loaded with no JIT, docs/gpu.md) and the PTX of the
    // lowest beside it, which the driver compiles only on a GPU none of the SASS fits.
    let mut gencodes: Vec<String> = archs
        .iter()
        .map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}"))
        .collect();
    gencodes.push(format!(
        "-gencode=arch=compute_{lowest},code=compute_{lowest}"
    ));
    std::thread::scope(|s| {
        let jobs: Vec<_> = KERNELS
            .iter()
            .map(|k| {
                let (nvcc, gencodes, out_dir) = (&nvcc, &gencodes, &out_dir);
                s.spawn(move || {
                    let src = format!("src/kernels/{k}.cu");
                    let status = Command::new(nvcc)
                        .args(["-fatbin", "-O3", "-std=c++17"])
                        .args(gencodes)
                        .arg("-o")
                        .arg(out_dir.join(format!("{k}.fatbin")))
                        .arg(&src)
                        .status()
                        .unwrap_or_else(|e| {
                            panic!(
                                "the cuda feature needs nvcc ({}): {e}; put a CUDA 12.8+ or 13 nvcc on PATH or set CUDA_HOME",
                                nvcc.display()
                            )
                        });
                    assert!(status.success(), "nvcc failed on {src}");
                })
            })
            .collect();
        for j in jobs {
            j.join().expect("nvcc thread");
        }
    });
}
