//! GPU kernels against their CPU twins (docs/decisions.md, Device-generic code), as one test
//! binary built only with `--features cuda` (Cargo.toml): run it on a machine with a GPU. Without
//! one every test fails, unless `SOAR_GPTQ_SKIP_GPU_TESTS=1` says to skip them (a CUDA build
//! checked on a GPU-less machine).

mod gla;
mod infllm;
mod transfer;
mod twins;
