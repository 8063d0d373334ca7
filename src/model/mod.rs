//! Model definitions: the MiniCPM-SALA config, its forward pass, and the Simple-GLA mixer; the
//! dense Llama-family decoders; and the enums that dispatch between them by `architectures`.
pub mod arch;
pub mod config;
pub mod gla;
pub mod infllm;
pub mod llama;
pub mod llama_config;
pub mod minicpm_sala;
pub mod nn;
pub mod rope_parameters;

pub use arch::{expected_bf16_tensors, AnyConfig, AnyLayer, AnyModel, SUPPORTED_ARCHITECTURES};
pub use config::{Config, MixerKind, SparseAttention};
pub use minicpm_sala::{DecoderLayer, Model};
pub use nn::{sequential, LinearGroup, LinearSpec};

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Constant tensors of the forward pass (RoPE tables, the causal mask, Simple-GLA decay masks),
/// built once per shape and device instead of on the host at every call: on a GPU, rebuilding
/// and uploading them per batch and layer cost seconds per quantize run.
pub(crate) fn cached_constant(
    key: String,
    device: &Device,
    build: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    static CACHE: OnceLock<Mutex<HashMap<String, Tensor>>> = OnceLock::new();
    let key = format!("{key}@{:?}", device.location());
    let cache = CACHE.get_or_init(Default::default);
    if let Some(t) = cache.lock().expect("constant cache poisoned").get(&key) {
        return Ok(t.clone());
    }
    let t = build()?;
    cache
        .lock()
        .expect("constant cache poisoned")
        .insert(key, t.clone());
    Ok(t)
}

/// The most decoder layers a config may declare (released models have up to a few hundred).
pub const MAX_LAYERS: usize = 4096;
/// The largest size of any other dimension (hidden, vocabulary, positions...).
pub const MAX_DIMENSION: usize = 1 << 24;

/// Refuses a config dimension no real model has, before anything is sized from it: a damaged
/// or hostile config with `num_hidden_layers: 10000000` used to allocate gigabytes of per-layer
/// bookkeeping before the checkpoint was even looked at.
pub fn check_dimension(name: &str, v: usize) -> anyhow::Result<()> {
    let max = if name == "num_hidden_layers" {
        MAX_LAYERS
    } else {
        MAX_DIMENSION
    };
    if v > max {
        anyhow::bail!(
            "{name} is {v}, beyond any released model (at most {max} here): the config is damaged"
        );
    }
    Ok(())
}
