//! What differs between the engines, as data: one [`Rules`] value per engine (`sglang.rs`,
//! `vllm.rs`, `transformers.rs`), each field a fact of that engine's code with its consequence,
//! read by the engine-blind procedures ([`super::check`], [`super::loader::emulate`]). An engine
//! release that changes a rule changes one field or one function of its file, and the rows of its
//! table of findings at the end of that file.

use super::linears::{Decision, EngineLinear, LinearMethod, Quantized};
use super::Findings;

/// One engine's rules (docs/engines.md states each with its source).
pub struct Rules {
    /// The name `--engine` takes.
    pub name: &'static str,
    /// The name in messages.
    pub label: &'static str,

    // config.json and the files beside it.
    /// Architectures it has no implementation of: `(architecture, what, fix)`.
    pub unbuilt: &'static [(&'static str, &'static str, &'static str)],
    /// Its own MiniCPM-SALA config class defines the derived keys as read-only properties, so a
    /// config.json that carries one fails to load (elsewhere it is worth a warning).
    pub derived_keys_fatal: bool,
    /// It registers its own config class for the `model_type`s of
    /// [`super::config::SGLANG_OWN_CONFIG`], which `auto_map.AutoConfig` would replace.
    pub own_config_class: bool,
    /// It imports every remote-code file `auto_map` names (the others: the config class's and
    /// the tokenizer's).
    pub imports_all_remote_code: bool,
    /// It builds only [`super::config::TRANSFORMERS_BUILTIN`] itself: other architectures need
    /// `auto_map`'s AutoConfig and AutoModelForCausalLM.
    pub needs_model_code: bool,
    /// `--dtype auto` turns a missing or float32 dtype into float16, so MiniCPM-SALA (BF16
    /// only) needs config.json to say bfloat16.
    pub dtype_auto_float16: bool,
    /// A note for every quantized folder.
    pub quantized_note: Option<&'static str>,

    // The loader.
    /// It fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` Linear.
    pub fuses: bool,
    /// The checkpoint-wide method for the settings, with the findings about them.
    pub method: fn(&Quantized, &mut Findings) -> LinearMethod,
    /// How one Linear departs from the checkpoint-wide method (`dynamic` rules, the shards, a
    /// list of quantized modules).
    pub module: fn(&Quantized, &EngineLinear, &mut Decision, &mut Findings),
    /// It drops `g_idx` (never needed, ignored in the shards).
    pub drops_g_idx: bool,
    /// It quantizes `lm_head` when the settings say `lm_head: true`.
    pub quantizes_head: bool,
    /// It ignores `.bias` tensors it builds no parameter for.
    pub ignores_stray_bias: bool,
    /// Loading fails on a tensor it builds no parameter for (else the weight is lost).
    pub unused_fatal: bool,
    /// What it does with such a tensor.
    pub unused: &'static str,

    // The kernels.
    /// Beyond gptq_marlin's shapes it can be told to use plain gptq (`--quantization gptq`,
    /// float16 only), so the shapes are fatal only for a model that must run BF16.
    pub plain_gptq_fallback: bool,
    /// The fix for Linears beyond the Marlin kernels' shapes.
    pub shape_limit_fix: &'static str,

    /// The command that serves a folder: `(dir, MiniCPM-SALA, needs remote code)`.
    pub serve: fn(&str, bool, bool) -> String,
}

/// The flag an SGLang or vLLM command line needs for a folder whose code runs remotely.
pub fn trust_remote_code_flag(remote_code: bool) -> &'static str {
    if remote_code {
        " --trust-remote-code"
    } else {
        ""
    }
}
