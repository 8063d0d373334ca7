//! GPU kernels against their CPU twins (docs/decisions.md, Device-generic code), as one test
//! binary built only with `--features cuda` (Cargo.toml): run it on a machine with a GPU. Without
//! one every test fails, unless `SOAR_GPTQ_SKIP_GPU_TESTS=1` says to skip them (a CUDA build
//! checked on a GPU-less machine).

mod gla;
mod infllm;
mod transfer;
mod twins;

/// The GPU the tests run on; without one every test fails, unless `SOAR_GPTQ_SKIP_GPU_TESTS=1`
/// says to skip them (`None`).
pub fn gpu() -> Option<candle_core::Device> {
    match candle_core::Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("SOAR_GPTQ_SKIP_GPU_TESTS").is_some() => {
            eprintln!("skipped: no usable GPU ({e})");
            None
        }
        Err(e) => panic!(
            "no usable GPU for the CUDA twin tests ({e}); set SOAR_GPTQ_SKIP_GPU_TESTS=1 to skip"
        ),
    }
}
