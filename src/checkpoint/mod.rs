//! Safetensors checkpoints on disk: validated memory-mapped reading and atomic sharded writing.
pub mod files;
pub mod guard;
pub mod json;
pub mod manifest;
pub mod output_dir;
pub mod reader;
pub mod shards;

pub use output_dir::OutputDir;
pub use reader::{Checkpoint, Dtype, TensorEntry};
pub use shards::TensorSpec;
