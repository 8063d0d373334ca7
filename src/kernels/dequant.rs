//! Stored codes back to weights on the GPU (`gptq.cu`): [`dequant_gptq`], [`dequant_marlin`] —
//! CPU twins: `format::dequantize_gptq`, `format::quantized::dequantize_module`.

use anyhow::{bail, ensure, Result};
use candle_core::{Device, Tensor};
use cudarc::driver::CudaSlice;

use super::cuda::{blocks, cuda, launch, launch_cfg, slice_ptr, upload, wrap};

/// GPTQ decode on the GPU: `W` `[N, K]` f32 with `W[n][k] = scale[g][n]·(code − zero)`,
/// `g = g_idx[k]`, from `qweight` `[K·bits/32, N]`, `qzeros` `[groups, N·bits/32]` (v1 stores
/// zero − 1), `scales` `[groups, N]` f32 (the stored fp16 values), for 2, 3, 4 or 8 bits.
#[allow(clippy::too_many_arguments)]
pub fn dequant_gptq(
    device: &Device,
    qweight: &[i32],
    qzeros: &[i32],
    scales: &[f32],
    g_idx: &[i32],
    k: usize,
    n: usize,
    bits: u8,
    v1: bool,
) -> Result<Tensor> {
    let dev = cuda(device)?;
    let stream = dev.cuda_stream();
    ensure!(
        qweight.len() == k * bits as usize / 32 * n && g_idx.len() == k,
        "internal: GPTQ tensors do not match [K={k}, N={n}] at {bits} bits"
    );
    let groups = scales.len() / n;
    if let Some(pos) = g_idx.iter().position(|&g| g < 0 || g as usize >= groups) {
        bail!(
            "g_idx[{pos}] = {} is outside the {groups} scale groups",
            g_idx[pos]
        );
    }
    let (qw, qz, sc, gi) = (
        upload(&stream, qweight)?,
        upload(&stream, qzeros)?,
        upload(&stream, scales)?,
        upload(&stream, g_idx)?,
    );
    let out: CudaSlice<f32> = unsafe { stream.alloc(n * k) }?;
    let (qwp, qzp, scp, gip, outp) = (
        slice_ptr(&qw, &stream),
        slice_ptr(&qz, &stream),
        slice_ptr(&sc, &stream),
        slice_ptr(&gi, &stream),
        slice_ptr(&out, &stream),
    );
    launch(
        dev,
        "dequant_gptq",
        launch_cfg((blocks(k, 256), n as u32, 1), (256, 1, 1)),
        &[
            &qwp,
            &qzp,
            &scp,
            &gip,
            &(k as i32),
            &(n as i32),
            &(bits as i32),
            &i32::from(v1),
            &outp,
        ],
    )?;
    Ok(wrap(out, dev, &[n, k]))
}

/// Marlin decode on the GPU: `W` `[N, K]` f32 from the tiles `B` `[K/16, 2N]`, un-permuted
/// scales `[groups, N]` and the original input row of each tile row (identity without act-order).
pub fn dequant_marlin(
    device: &Device,
    b: &[i32],
    scales: &[f32],
    src_row: &[i32],
    k: usize,
    n: usize,
    group: usize,
) -> Result<Tensor> {
    let dev = cuda(device)?;
    let stream = dev.cuda_stream();
    ensure!(
        b.len() == k / 16 * 2 * n
            && src_row.len() == k
            && k.is_multiple_of(16)
            && n.is_multiple_of(64),
        "internal: Marlin tensors do not match [K={k}, N={n}]"
    );
    let (bd, sd, rd) = (
        upload(&stream, b)?,
        upload(&stream, scales)?,
        upload(&stream, src_row)?,
    );
    let out: CudaSlice<f32> = unsafe { stream.alloc(n * k) }?;
    let (bp, sp, rp, op) = (
        slice_ptr(&bd, &stream),
        slice_ptr(&sd, &stream),
        slice_ptr(&rd, &stream),
        slice_ptr(&out, &stream),
    );
    launch(
        dev,
        "dequant_marlin",
        launch_cfg((blocks(2 * n, 256), (k / 16) as u32, 1), (256, 1, 1)),
        &[
            &bp,
            &sp,
            &rp,
            &(k as i32),
            &(n as i32),
            &(group as i32),
            &op,
        ],
    )?;
    Ok(wrap(out, dev, &[n, k]))
}
