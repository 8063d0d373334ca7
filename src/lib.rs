//! soar-gptq: GPTQ W4A16 quantization for MiniCPM-SALA. See ARCHITECTURE.md for the code map.
pub mod checkpoint;
pub mod cli;
pub mod eval;
pub mod format;

pub mod inspect;
pub mod model;
pub mod source;
pub mod synth;
