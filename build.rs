//! With the `cuda` feature, compiles each `src/kernels/*.cu` of `KERNELS` to a fatbin (SASS plus PTX) with nvcc: a CUDA 12/13
//! toolchain (nvcc) on PATH or under CUDA_HOME, for the compute capability in CUDA_COMPUTE_CAP
//! (default 90), so no GPU is needed at build time (docs/gpu.md). The default build needs no CUDA
//! at all and does nothing here.

use std::path::PathBuf;
use std::process::Command;

/// The kernel sources, each compiled to `<name>.fatbin` in OUT_DIR (`kernels::cuda` embeds them).
const KERNELS: &[&str] = &["gptq", "infllm", "gla"];

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
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".to_string());
    for k in KERNELS {
        let src = format!("src/kernels/{k}.cu");
        // Machine code for `cap` (loaded with no JIT, docs/gpu.md) and the PTX beside it, which
        // the driver compiles only on a GPU the SASS does not fit.
        let status = Command::new(&nvcc)
            .args(["-fatbin", "-O3", "-std=c++17"])
            .arg(format!(
                "-gencode=arch=compute_{cap},code=[sm_{cap},compute_{cap}]"
            ))
            .arg("-o")
            .arg(out_dir.join(format!("{k}.fatbin")))
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "the cuda feature needs nvcc ({}): {e}; put a CUDA 12/13 nvcc on PATH or set CUDA_HOME",
                    nvcc.display()
                )
            });
        assert!(status.success(), "nvcc failed on {src}");
    }
}
