use cudaforge::{KernelBuilder, Result};
use std::env;
use std::path::PathBuf;

const CUTILE_FEATURE: &str = "CARGO_FEATURE_CUTILE";

/// Replaces `ptx.rs` (`pub const X: &str = include_str!(".../x.ptx");`) by one that embeds
/// `x.fatbin`, made by `nvcc -fatbin` from `x.ptx` for the detected compute capability
/// (ptxas runs here, at build time, instead of in the driver at run time). The fatbins are built
/// on threads: ptxas of the largest modules takes seconds each.
fn fatbins(out_dir: &std::path::Path, ptx_rs: &std::path::Path, archs: &[u32]) -> Result<()> {
    let nvcc = cudaforge::CudaToolkit::detect()?.nvcc_path;
    // soar-gptq: SASS for every target architecture from the PTX, and the PTX itself for GPUs
    // none of them fits. One architecture: its own (cudaforge's arch-specific `sm_90a` for
    // Hopper, as before); several: the PTX is built for the lowest without an arch-specific
    // suffix (see `main`), and ptxas makes each SASS from it.
    let gencode = if archs.len() == 1 {
        let sm = cudaforge::detect_compute_cap()?.to_nvcc_arch(); // e.g. sm_90a
        let compute = sm.replacen("sm_", "compute_", 1);
        format!("-gencode=arch={compute},code=[{sm},{compute}]")
    } else {
        let ptx = ptx_arch(archs);
        let mut codes: Vec<String> = archs.iter().map(|a| format!("sm_{a}")).collect();
        codes.push(format!("compute_{ptx}"));
        format!("-gencode=arch=compute_{ptx},code=[{}]", codes.join(","))
    };
    let text = std::fs::read_to_string(ptx_rs)?;
    let mut names = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("pub const ") else {
            continue;
        };
        let name = rest
            .split(':')
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        let file = line
            .rsplit_once("\"/")
            .and_then(|(_, f)| f.strip_suffix(".ptx\"));"))
            .unwrap_or_else(|| panic!("unexpected line in ptx.rs: {line}"))
            .to_string();
        names.push((name, file));
    }
    std::thread::scope(|s| {
        let jobs: Vec<_> = names
            .iter()
            .map(|(_, file)| {
                let (nvcc, gencode) = (&nvcc, &gencode);
                s.spawn(move || {
                    let status = std::process::Command::new(nvcc)
                        .arg("-fatbin")
                        .arg(gencode)
                        .arg("-o")
                        .arg(out_dir.join(format!("{file}.fatbin")))
                        .arg(out_dir.join(format!("{file}.ptx")))
                        .status()
                        .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
                    assert!(status.success(), "nvcc -fatbin failed on {file}.ptx");
                })
            })
            .collect();
        for j in jobs {
            j.join().expect("fatbin thread");
        }
    });
    let mut rs = String::new();
    for (name, file) in &names {
        rs.push_str(&format!(
            "pub const {name}: &[u8] = include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{file}.fatbin\"));\n"
        ));
    }
    std::fs::write(ptx_rs, rs)?;
    Ok(())
}

/// soar-gptq: every architecture the binary carries machine code for when the build machine has
/// no GPU (the root crate's build.rs has the same list and rule).
const ALL_ARCHS: &[u32] = &[80, 86, 89, 90, 100, 120];

/// soar-gptq: the PTX architecture of a build for several: the lowest, at most 89 (the last
/// without an arch-specific suffix in cudaforge).
fn ptx_arch(archs: &[u32]) -> u32 {
    archs.iter().copied().min().expect("at least one architecture").min(89)
}

/// soar-gptq: `CUDA_COMPUTE_CAP` (one, or a comma-separated list), else the local GPU's
/// (nvidia-smi), else [`ALL_ARCHS`].
fn target_archs() -> Vec<u32> {
    if let Ok(s) = env::var("CUDA_COMPUTE_CAP") {
        return s
            .split(',')
            .map(|a| {
                a.trim()
                    .trim_end_matches(['a', 'f'])
                    .replace('.', "")
                    .parse::<u32>()
                    .unwrap_or_else(|_| panic!("CUDA_COMPUTE_CAP={s} is not a list of compute capabilities"))
            })
            .collect();
    }
    if let Ok(o) = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output()
    {
        if o.status.success() {
            let mut archs: Vec<u32> = String::from_utf8_lossy(&o.stdout)
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

fn main() -> Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    // soar-gptq: the PTX (and cudaforge's other steps) for the target architecture, or for
    // several the lowest one without an arch-specific suffix (cudaforge gives 90 and later an
    // `a` suffix, whose PTX compiles for that one architecture only).
    let archs = target_archs();
    if archs.len() > 1 {
        env::set_var("CUDA_COMPUTE_CAP", ptx_arch(&archs).to_string());
    } else {
        env::set_var("CUDA_COMPUTE_CAP", archs[0].to_string());
    }
    println!("cargo::rerun-if-changed=src");
    println!("cargo::rerun-if-changed=src/compatibility.cuh");
    println!("cargo::rerun-if-changed=src/cuda_utils.cuh");
    println!("cargo::rerun-if-changed=src/binary_op_macros.cuh");

    // Build for PTX
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let ptx_path = out_dir.join("ptx.rs");
    let bindings = KernelBuilder::new()
        .source_dir("src") // Scan src/ for .cu files
        .exclude(&["moe_*.cu", "mmvq_gguf.cu", "mmq_*.cu"]) // Exclude statically compiled kernels from ptx build
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()?;

    bindings.write(&ptx_path)?;
    // soar-gptq: assemble every PTX into a fatbin (SASS for the build's GPU plus the PTX) and
    // embed that instead, so the driver loads machine code with no JIT on first use.
    fatbins(&out_dir, &ptx_path, &archs)?;

    let mut moe_sources = vec![
        "src/moe/moe_gguf.cu",
        "src/moe/moe_wmma.cu",
        "src/moe/moe_wmma_gguf.cu",
        "src/mmvq_gguf.cu",
        "src/mmq_gguf/mmq_quantize.cu",
        "src/mmq_gguf/mmq_instance_q4_0.cu",
        "src/mmq_gguf/mmq_instance_q4_1.cu",
        "src/mmq_gguf/mmq_instance_q5_0.cu",
        "src/mmq_gguf/mmq_instance_q5_1.cu",
        "src/mmq_gguf/mmq_instance_q8_0.cu",
        "src/mmq_gguf/mmq_instance_q2_k.cu",
        "src/mmq_gguf/mmq_instance_q3_k.cu",
        "src/mmq_gguf/mmq_instance_q4_k.cu",
        "src/mmq_gguf/mmq_instance_q5_k.cu",
        "src/mmq_gguf/mmq_instance_q6_k.cu",
    ];
    if env::var_os(CUTILE_FEATURE).is_some() {
        moe_sources.push("src/moe/moe_align.cu");
    }

    let mut moe_builder = KernelBuilder::default()
        .source_files(moe_sources)
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3");

    // Disable bf16 WMMA kernels on GPUs older than sm_80 (Ampere).
    // bf16 WMMA fragments require compute capability >= 8.0.
    let compute_cap = cudaforge::detect_compute_cap()
        .map(|arch| arch.base())
        .unwrap_or(80);
    if compute_cap < 80 {
        moe_builder = moe_builder.arg("-DNO_BF16_KERNEL");
    }

    let mut is_target_msvc = false;
    if let Ok(target) = std::env::var("TARGET") {
        if target.contains("msvc") {
            is_target_msvc = true;
            moe_builder = moe_builder.arg("-D_USE_MATH_DEFINES");
        }
    }

    if !is_target_msvc {
        moe_builder = moe_builder.arg("-Xcompiler").arg("-fPIC");
    }

    moe_builder.build_lib(out_dir.join("libmoe.a"))?;
    println!("cargo:rustc-link-search={}", out_dir.display());
    println!("cargo:rustc-link-lib=moe");
    println!("cargo:rustc-link-lib=dylib=cudart");
    if !is_target_msvc {
        println!("cargo:rustc-link-lib=stdc++");
    }
    Ok(())
}
