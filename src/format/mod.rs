//! On-disk formats: GPTQ bit packing, the Marlin tile layout, and quantized checkpoints.
//!
//! Pure, bit-exact transforms between dense code matrices and the words checkpoints store live in
//! [`pack`] (GPTQ `qweight`/`qzeros`, docs/formats.md, GPTQ) and [`marlin`] (Marlin `B` tiles and
//! scale permutations, docs/formats.md, Marlin); they do no I/O. Codes are always `[K, N]`
//! row-major (`K` = in_features, `N` = out_features), the transposed layout both GPTQ and Marlin
//! pack.
//!
//! On top of them, for whole checkpoints (ours or anyone's, any architecture; quantized modules
//! are found by their tensors):
//! * [`quantized`]: reading GPTQ v1/v2 and Marlin checkpoints: settings ([`read_quant_info`],
//!   `dynamic` rules), validation ([`validate_quantized`]) and bit-exact dequantization
//!   ([`dequantize_module`]);
//!
//! The commands built on them live above: `pack-marlin` in `crate::pack_marlin`, `inspect` of a
//! quantized checkpoint in `crate::inspect::quantized`.

pub mod marlin;
pub mod pack;
pub mod quantized;

pub use marlin::{
    check_marlin_shape, gptq_codes_to_marlin, marlin_sort_indices, marlin_to_gptq_codes,
    pack_marlin, permute_scales, unpack_marlin, unpermute_scales, MarlinWeight,
};
pub use pack::{
    dequantize_gptq, f16_le_bytes_to_f32, f32_to_f16_le_bytes, i32_to_le_bytes, le_bytes_to_i32,
    pack_qweight, pack_qzeros, unpack_qweight, unpack_qzeros, GptqTensors,
};

pub use quantized::{
    check_quantized_module, dequantize_gptq_tensor, dequantize_module, quantized_prefixes,
    read_module_codes, read_quant_info, validate_quantized, validate_quantized_modules,
    ModuleCodes, ModuleQuant, QuantFormat, QuantInfo, QuantModule,
};
