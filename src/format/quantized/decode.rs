//! Decoding a validated quantized module back to its weight `[N, K]` (HF layout), bit-exactly
//! `f32(scale_f16) · (code − zero)`, one rounding per value, on the CPU or the GPU.

use super::settings::QuantInfo;
use super::validate::{at, check_quantized_module, QuantModule};
use super::SORT_INDICES_SUFFIX;
use crate::checkpoint::Checkpoint;
use crate::format::marlin::{unpack_marlin, unpermute_scales};
use crate::format::pack::{dequantize_gptq, GptqTensors};
use crate::scheme::QuantFormat;
use anyhow::{Context, Result};
use rayon::prelude::*;

/// The stored tensors of one quantized module, read and checked, ready to decode.
pub enum ModuleCodes {
    Gptq {
        qweight: Vec<i32>,
        qzeros: Vec<i32>,
        /// `[groups, N]`, the stored (fp16) values widened to f32.
        scales: Vec<f32>,
        g_idx: Vec<i32>,
        bits: u8,
        /// GPTQ v1 or v2 (how `qzeros` store the zero).
        format: QuantFormat,
    },
    Marlin {
        /// `B` `[K/16, 2N]`.
        b: Vec<i32>,
        /// `[groups, N]`, un-permuted.
        scales: Vec<f32>,
        /// The original input row of each tile row (`g_idx_sort_indices`, identity without it).
        src_row: Vec<i32>,
        group: usize,
    },
}

/// Reads the stored tensors of `m`, a module that [`check_quantized_module`] (or
/// `validate_quantized_modules`) has validated: nothing is checked again here.
pub fn read_module_codes(
    ck: &Checkpoint,
    info: &QuantInfo,
    m: &QuantModule,
) -> Result<ModuleCodes> {
    let (prefix, k) = (m.prefix.as_str(), m.k);
    let codes = match info.format {
        QuantFormat::Marlin => {
            let s_name = format!("{prefix}.s");
            let scales = unpermute_scales(&ck.f32_data(&s_name)?, m.groups, m.n)
                .with_context(|| format!("un-permuting {}", at(ck, &s_name)))?;
            let si = format!("{prefix}.{SORT_INDICES_SUFFIX}");
            let src_row: Vec<i32> = if ck.contains(&si) {
                ck.i32_data(&si)?
            } else {
                (0..k as i32).collect()
            };
            ModuleCodes::Marlin {
                b: ck.i32_data(&format!("{prefix}.B"))?,
                scales,
                src_row,
                group: m.group_len(),
            }
        }
        _ => {
            let get = |s: &str| ck.i32_data(&format!("{prefix}.{s}"));
            ModuleCodes::Gptq {
                qweight: get("qweight")?,
                qzeros: get("qzeros")?,
                scales: ck.f32_data(&format!("{prefix}.scales"))?,
                g_idx: get("g_idx")?,
                bits: m.bits,
                format: info.format,
            }
        }
    };
    Ok(codes)
}

impl ModuleCodes {
    /// The borrowed GPTQ tensors of a GPTQ module (`None` for Marlin), for both decoders.
    fn gptq_tensors(&self, n: usize, k: usize) -> Option<GptqTensors<'_>> {
        match self {
            ModuleCodes::Gptq {
                qweight,
                qzeros,
                scales,
                g_idx,
                bits,
                format,
            } => Some(GptqTensors {
                qweight,
                qzeros,
                scales,
                g_idx,
                k,
                n,
                bits: *bits,
                format: *format,
            }),
            ModuleCodes::Marlin { .. } => None,
        }
    }

    /// `W` `[N, K]` row-major f32 (HF layout, `y = x·Wᵀ`), bit-exactly `f32(scale) · (code − zero)`
    /// (Marlin: zero 8, rows un-sorted), on the CPU.
    pub fn dequantize(&self, n: usize, k: usize) -> Result<Vec<f32>> {
        match self {
            ModuleCodes::Marlin {
                b,
                scales,
                src_row,
                group,
            } => {
                let codes = unpack_marlin(b, k, n)?;
                let mut w = vec![0f32; n * k];
                // Row k' of the tiles is original input row src_row[k'], in group k' / g.
                let mut src_of = vec![0usize; k];
                for (kp, &row) in src_row.iter().enumerate() {
                    src_of[row as usize] = kp;
                }
                w.par_chunks_mut(k).enumerate().for_each(|(col, out)| {
                    for (row, v) in out.iter_mut().enumerate() {
                        let kp = src_of[row];
                        let code = i32::from(codes[kp * n + col]);
                        *v = scales[(kp / group) * n + col] * (code - 8) as f32;
                    }
                });
                Ok(w)
            }
            ModuleCodes::Gptq { .. } => {
                dequantize_gptq_nk(&self.gptq_tensors(n, k).expect("a GPTQ module"))
            }
        }
    }

    /// [`dequantize`](Self::dequantize) as an f32 `[N, K]` tensor on `device`: decoded by the
    /// GPU kernels on a CUDA device (bit-identical, `tests/cuda/twins.rs`), else on the CPU.
    pub fn dequantize_tensor(
        &self,
        n: usize,
        k: usize,
        device: &candle_core::Device,
    ) -> Result<candle_core::Tensor> {
        #[cfg(feature = "cuda")]
        if let (
            true,
            ModuleCodes::Marlin {
                b,
                scales,
                src_row,
                group,
            },
        ) = (device.is_cuda(), self)
        {
            return crate::kernels::dequant::dequant_marlin(
                device, b, scales, src_row, k, n, *group,
            );
        }
        match self {
            ModuleCodes::Gptq { .. } => {
                dequantize_gptq_tensor(&self.gptq_tensors(n, k).expect("a GPTQ module"), device)
            }
            ModuleCodes::Marlin { .. } => Ok(candle_core::Tensor::from_vec(
                self.dequantize(n, k)?,
                (n, k),
                device,
            )?),
        }
    }
}

/// GPTQ tensors decoded to `W` `[N, K]` row-major f32 (the HF layout), on the CPU.
fn dequantize_gptq_nk(t: &GptqTensors) -> Result<Vec<f32>> {
    let (n, k) = (t.n, t.k);
    let wt = dequantize_gptq(t)?;
    let mut w = vec![0f32; n * k];
    w.par_chunks_mut(k).enumerate().for_each(|(col, out)| {
        for (row, v) in out.iter_mut().enumerate() {
            *v = wt[row * n + col];
        }
    });
    Ok(w)
}

/// GPTQ tensors decoded to an f32 `[N, K]` tensor on `device` (the GPU kernel on a CUDA device,
/// bit-identical to the CPU decode), from borrowed slices: [`ModuleCodes::dequantize_tensor`]
/// and the quantize pipeline, which decodes every module it has just packed without copying
/// its 4.4 GB of qweight (9.5B model) into fresh buffers first.
pub fn dequantize_gptq_tensor(
    t: &GptqTensors,
    device: &candle_core::Device,
) -> Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return crate::kernels::dequant::dequant_gptq(
            device,
            t.qweight,
            t.qzeros,
            t.scales,
            t.g_idx,
            t.k,
            t.n,
            t.bits,
            t.format.zeros_minus_one(),
        );
    }
    Ok(candle_core::Tensor::from_vec(
        dequantize_gptq_nk(t)?,
        (t.n, t.k),
        device,
    )?)
}

/// Dequantizes one module to `W` `[N, K]` row-major f32 (HF layout, `y = x·Wᵀ`), bit-exactly
/// `f32(scale) · (code − zero)` (Marlin: zero 8, rows un-sorted). Returns `(W, N, K)`.
pub fn dequantize_module(
    ck: &Checkpoint,
    info: &QuantInfo,
    prefix: &str,
) -> Result<(Vec<f32>, usize, usize)> {
    let m = check_quantized_module(ck, info, prefix, None)
        .with_context(|| format!("cannot dequantize module {prefix}"))?;
    let (n, k) = (m.n, m.k);
    let w = read_module_codes(ck, info, &m)?
        .dequantize(n, k)
        .with_context(|| format!("dequantizing module {prefix} of {}", ck.dir.display()))?;
    Ok((w, n, k))
}
