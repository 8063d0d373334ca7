//! Safetensors checkpoints on disk: validated memory-mapped reading and atomic sharded writing.
pub mod guard;
pub mod json;
pub mod reader;
pub mod writer;

pub use reader::{Checkpoint, Dtype, TensorEntry};
pub use writer::{OutputDir, TensorSpec};
