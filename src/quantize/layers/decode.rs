//! From a solve's codes to the weights the next pass computes with, and to the packed tensors
//! the journal stores: both decode to bit-identical weights, so a resumed run that replays a
//! layer from its journal file feeds the next layer exactly what the uninterrupted run did.

use super::super::journal::Packed;
use crate::format;
use crate::gptq::QuantizedLinear;
use crate::scheme::QuantFormat;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub(super) fn pack(q: &QuantizedLinear, bits: u8, format: QuantFormat) -> Result<Packed> {
    let (n, k) = (q.n, q.k);
    let groups = q.n_groups();
    Ok(Packed {
        qweight: format::pack::pack_qweight_nk(&q.codes, n, k, bits)?,
        qzeros: format::pack_qzeros(&q.zeros, groups, n, bits, format)?,
        scales_f16: format::f32_to_f16_le_bytes(&q.scales),
        g_idx: q.g_idx.clone(),
    })
}

/// The weights a server computes with, straight from a solve's codes: `scale · (code − zero)`
/// with the scales rounded to fp16 as they are stored, as `[N, K]` in `dtype` on `device` (on the
/// GPU from the codes the solve left there). Bit-identical to [`decode_stored`] of the packed
/// tensors (the packing is lossless and both compute the same f32 product; a test checks it),
/// so the packing can run on the journal thread while the next layer computes.
pub(super) fn decode_codes(q: &QuantizedLinear, dtype: DType, device: &Device) -> Result<Tensor> {
    let (n, k, groups) = (q.n, q.k, q.n_groups());
    if let Some(pos) = q.g_idx.iter().position(|&g| g < 0 || g as usize >= groups) {
        bail!(
            "internal: g_idx[{pos}] = {} is outside the {groups} scale groups",
            q.g_idx[pos]
        );
    }
    let codes = match &q.device_codes {
        Some(c) if c.device().same_device(device) => c.clone(),
        _ => Tensor::from_slice(&q.codes, (n, k), device)?,
    };
    let g_idx: Vec<u32> = q.g_idx.iter().map(|&g| g as u32).collect();
    let g_idx = Tensor::from_vec(g_idx, k, device)?;
    // `[groups, N]` per-group values as `[N, K]`, column k holding group g_idx[k]'s.
    let per_column = |v: Vec<f32>| -> Result<Tensor> {
        Ok(Tensor::from_vec(v, (groups, n), device)?
            .t()?
            .contiguous()?
            .index_select(&g_idx, 1)?)
    };
    let scales = per_column(
        q.scales
            .iter()
            .map(|&s| half::f16::from_f32(s).to_f32())
            .collect(),
    )?;
    let zeros = per_column(q.zeros.iter().map(|&z| f32::from(z)).collect())?;
    Ok(codes
        .to_dtype(DType::F32)?
        .sub(&zeros)?
        .mul(&scales)?
        .to_dtype(dtype)?)
}

/// The weights a server computes with: decoded from the stored tensors (fp16 scales), as
/// `[N, K]` in `dtype`. Used both after a solve and when a resumed run replays finished layers,
/// so both paths feed the next layer bit-identical weights.
pub(super) fn decode_stored(
    p: &Packed,
    n: usize,
    k: usize,
    bits: u8,
    format: QuantFormat,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let scales = format::f16_le_bytes_to_f32(&p.scales_f16)?;
    let t = format::GptqTensors {
        qweight: &p.qweight,
        qzeros: &p.qzeros,
        scales: &scales,
        g_idx: &p.g_idx,
        k,
        n,
        bits,
        format,
    };
    Ok(format::dequantize_gptq_tensor(&t, device)?.to_dtype(dtype)?)
}

/// ||X(W−Q)ᵀ||_F / ||XWᵀ||_F on the calibration tokens, from H ∝ XᵀX: sqrt(tr(D H Dᵀ) / tr(W H Wᵀ)).
/// A report figure, not part of the output: on a GPU the products run in BF16 with f32
/// accumulation (N·K² per module would otherwise cost more than the solve).
pub(super) fn relative_output_error(w: &Tensor, q: &Tensor, h: &Tensor) -> Result<f64> {
    let w = w.to_dtype(DType::F32)?;
    let d = (&w - q.to_dtype(DType::F32)?)?;
    let gpu = w.device().is_cuda();
    let hb = if gpu {
        h.to_dtype(DType::BF16)?
    } else {
        h.clone()
    };
    let quad = |m: &Tensor| -> Result<f64> {
        if gpu {
            let mh = m.to_dtype(DType::BF16)?.matmul(&hb)?.to_dtype(DType::F32)?;
            // Row sums first: candle reduces a whole tensor in one thread block, which cost
            // more than the products (about 1 s of the 9.5B's report stage).
            return Ok(mh
                .mul(m)?
                .sum(1)?
                .to_dtype(DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?);
        }
        Ok(m.matmul(h)?
            .mul(m)?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?)
    };
    let den = quad(&w)?;
    Ok(if den > 0.0 {
        (quad(&d)? / den).max(0.0).sqrt()
    } else {
        0.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gptq::SolveTimings;
    use crate::rng::SplitMix64;

    /// A solve's result with random codes, scales and zeros, and an act-order g_idx.
    fn random_linear(
        rng: &mut SplitMix64,
        n: usize,
        k: usize,
        bits: u8,
        g: usize,
    ) -> QuantizedLinear {
        let maxq = (1u64 << bits) - 1;
        let groups = k / g;
        let mut perm: Vec<usize> = (0..k).collect();
        for i in (1..k).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut g_idx = vec![0i32; k];
        for (pos, &col) in perm.iter().enumerate() {
            g_idx[col] = (pos / g) as i32;
        }
        QuantizedLinear {
            n,
            k,
            codes: (0..n * k)
                .map(|_| (rng.next_u64() % (maxq + 1)) as u8)
                .collect(),
            scales: (0..groups * n)
                .map(|_| (rng.normal().abs() as f32 + 0.05) * 1e-2)
                .collect(),
            // 1..=maxq: GPTQ v1 cannot store a zero point of 0.
            zeros: (0..groups * n)
                .map(|_| (1 + rng.next_u64() % maxq) as u8)
                .collect(),
            g_idx,
            loss: 0.0,
            damp_used: 0.0,
            dead_columns: 0,
            timings: SolveTimings::default(),
            device_codes: None,
        }
    }

    /// What the layer loop decodes right after a solve equals, bit for bit, what it decodes
    /// from the packed tensors when a resumed run replays the layer (every width, both GPTQ
    /// formats, act-order groups).
    #[test]
    fn decoding_the_codes_equals_decoding_the_packed_tensors() {
        let mut rng = SplitMix64::new(41);
        let dev = Device::Cpu;
        for bits in [2u8, 3, 4, 8] {
            for format in [QuantFormat::GptqV1, QuantFormat::GptqV2] {
                let (n, k) = (64, 256);
                let q = random_linear(&mut rng, n, k, bits, 32);
                let p = pack(&q, bits, format).unwrap();
                for dtype in [DType::F32, DType::BF16] {
                    let from_codes = decode_codes(&q, dtype, &dev).unwrap();
                    let stored = decode_stored(&p, n, k, bits, format, dtype, &dev).unwrap();
                    let bits_of = |t: &Tensor| -> Vec<u32> {
                        t.to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect()
                    };
                    assert_eq!(
                        bits_of(&from_codes),
                        bits_of(&stored),
                        "{bits} bits, {format:?}, {dtype:?}"
                    );
                }
            }
        }
    }
}
