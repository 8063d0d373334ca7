//! soar-gptq: GPTQ W4A16 quantization for MiniCPM-SALA and the dense Llama-family decoders. See
//! ARCHITECTURE.md for the code map.

// Numeric kernels index several arrays with one loop variable, as the papers write them;
// iterator chains would hide the math.
#![allow(clippy::needless_range_loop)]

pub mod calib;
pub mod checkpoint;
pub mod cli;
pub mod device;
pub mod engine;
pub mod eval;
pub mod fault;
pub mod flag;
pub mod format;
pub mod gguf;
pub mod gptq;
pub mod inspect;
pub mod interrupt;
pub mod kernels;
pub mod model;
pub mod output;
pub mod pack_marlin;
pub mod progress;
pub mod quantize;
pub mod rng;
pub mod scheme;
pub mod sensitivity;
pub mod source;
pub mod synth;
