//! Model definitions: the MiniCPM-SALA config, its forward pass, and the Simple-GLA mixer.
pub mod config;
pub mod gla;
pub mod minicpm_sala;

pub use config::{Config, MixerKind};
pub use minicpm_sala::{DecoderLayer, LinearGroup, Model};
