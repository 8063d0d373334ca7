//! GPTQ bit packing (docs/formats.md, GPTQ): `qweight` packed along K, `qzeros` packed
//! along N, both LSB-first in 32-bit words stored as the int32 bit pattern, plus the reference
//! dequantization and the byte conversions safetensors needs.
//!
//! Codes and dequantized weights use the transposed layout GPTQ stores: `[K, N]` row-major, element
//! `[k][n]` belongs to `W[n][k]` of the PyTorch `nn.Linear.weight` `[N, K]`.

use anyhow::{bail, ensure, Context, Result};
use half::f16;
use rayon::prelude::*;

use crate::scheme::QuantFormat;

/// GPTQ packs `bits`-wide fields LSB-first into a little-endian bit stream of 32-bit words, one
/// stream per block of `vals` values taking `words` words: 2/4/8 bits fill one word exactly
/// (`vals = 32/bits`); 3 bits fill three words with 32 values, fields 10 and 21 straddling a word
/// boundary (AutoGPTQ's "10|1|10|1|10" layout, which is exactly this bit stream).
#[derive(Clone, Copy, Debug)]
struct BitLayout {
    bits: usize,
    /// Values per block.
    vals: usize,
    /// Words per block.
    words: usize,
}

impl BitLayout {
    /// The layout of `bits`-wide codes: 2, 3, 4 or 8 bits.
    fn of(bits: u8) -> Result<Self> {
        match bits {
            2 | 4 | 8 => Ok(Self {
                bits: bits as usize,
                vals: 32 / bits as usize,
                words: 1,
            }),
            3 => Ok(Self {
                bits: 3,
                vals: 32,
                words: 3,
            }),
            _ => bail!("GPTQ packing supports 2, 3, 4 or 8 bits, got {bits}"),
        }
    }

    /// ORs field `i` of a block (value `v`, already masked) into the block's words.
    fn put(&self, block: &mut [u32], i: usize, v: u32) {
        let bit = self.bits * i;
        let (w, shift) = (bit / 32, bit % 32);
        block[w] |= v << shift;
        if shift + self.bits > 32 {
            block[w + 1] |= v >> (32 - shift);
        }
    }

    /// Field `i` of a block.
    fn get(&self, block: &[u32], i: usize) -> u32 {
        let bit = self.bits * i;
        let (w, shift) = (bit / 32, bit % 32);
        let mut v = block[w] >> shift;
        if shift + self.bits > 32 {
            v |= block[w + 1] << (32 - shift);
        }
        v & max_code(self.bits as u8)
    }

    /// Words for `len` values (a whole number of blocks).
    fn packed_len(&self, len: usize) -> usize {
        len / self.vals * self.words
    }
}

/// `(values, words)` of one packing block: how many `bits`-wide fields fill how many 32-bit words
/// (`(8, 1)` for 4 bits, `(32, 3)` for 3 bits). `qweight` has `K / values · words` rows.
pub fn block_shape(bits: u8) -> Result<(usize, usize)> {
    let lay = BitLayout::of(bits)?;
    Ok((lay.vals, lay.words))
}

fn max_code(bits: u8) -> u32 {
    (1u32 << bits) - 1
}

/// The checks both qweight packers make: K a whole number of packing blocks, one code per
/// weight, every code within `bits`. `at` maps a flat index to `(k, n)` for the message.
fn check_codes(
    codes: &[u8],
    k: usize,
    n: usize,
    bits: u8,
    at: impl Fn(usize) -> (usize, usize),
) -> Result<BitLayout> {
    let lay = BitLayout::of(bits)?;
    ensure!(
        k.is_multiple_of(lay.vals),
        "qweight packing needs K to be a multiple of {} for {bits}-bit codes, got K = {k}",
        lay.vals
    );
    ensure!(
        codes.len() == k * n,
        "qweight packing got {} codes for a [K={k}, N={n}] matrix (expected {})",
        codes.len(),
        k * n
    );
    let maxq = max_code(bits);
    // The largest code by chunks (a vectorized max per chunk), and only on failure the first
    // offender: rayon's per-element `position_first` took 0.4 s for 67 M codes.
    let largest = codes
        .par_chunks(1 << 16)
        .map(|c| c.iter().copied().max().unwrap_or(0))
        .max()
        .unwrap_or(0);
    if u32::from(largest) > maxq {
        let pos = codes
            .iter()
            .position(|&c| u32::from(c) > maxq)
            .expect("a code above the maximum exists");
        let (kk, nn) = at(pos);
        bail!(
            "code {} at [k={kk}, n={nn}] does not fit {bits} bits (max {maxq})",
            codes[pos]
        );
    }
    Ok(lay)
}

/// Packs codes `[K, N]` into `qweight` `[K·bits/32, N]`, along K: for 2/4/8 bits
/// `word[r][n] = Σ_i code[r·per + i][n] << (bits·i)` with `per = 32/bits`; 3 bits use three word
/// rows per 32 code rows (see [`BitLayout`]).
pub fn pack_qweight(codes: &[u8], k: usize, n: usize, bits: u8) -> Result<Vec<i32>> {
    let lay = check_codes(codes, k, n, bits, |pos| (pos / n, pos % n))?;
    Ok(match bits {
        2 => pack_kn_one_word::<2>(codes, n),
        4 => pack_kn_one_word::<4>(codes, n),
        8 => pack_kn_one_word::<8>(codes, n),
        _ => pack_kn_stream(&lay, codes, k, n),
    })
}

/// [`pack_qweight`] through the general bit stream (fields may straddle words): the 3-bit path,
/// and the reference the one-word paths are tested against.
fn pack_kn_stream(lay: &BitLayout, codes: &[u8], k: usize, n: usize) -> Vec<i32> {
    let mut words = vec![0i32; lay.packed_len(k) * n];
    words
        .par_chunks_mut((lay.words * n).max(1))
        .enumerate()
        .for_each(|(b, word_rows)| {
            let mut block = vec![0u32; lay.words];
            for col in 0..n {
                block.fill(0);
                for i in 0..lay.vals {
                    lay.put(
                        &mut block,
                        i,
                        u32::from(codes[(b * lay.vals + i) * n + col]),
                    );
                }
                for (w, &v) in block.iter().enumerate() {
                    word_rows[w * n + col] = v as i32;
                }
            }
        });
    words
}

/// [`pack_qweight`] for the widths whose block is one word: each word row ORs `32 / BITS` code
/// rows in, shifted, row by row (a loop over N that vectorizes).
fn pack_kn_one_word<const BITS: usize>(codes: &[u8], n: usize) -> Vec<i32> {
    let vals = 32 / BITS;
    let mut words = vec![0i32; codes.len() / vals];
    if n == 0 {
        return words;
    }
    words
        .par_chunks_mut(n)
        .zip(codes.par_chunks(vals * n))
        .for_each(|(out, rows)| {
            let mut acc = vec![0u32; n];
            for (i, row) in rows.chunks_exact(n).enumerate() {
                for (a, &c) in acc.iter_mut().zip(row) {
                    *a |= u32::from(c) << (BITS * i);
                }
            }
            for (o, a) in out.iter_mut().zip(acc) {
                *o = a as i32;
            }
        });
    words
}

/// [`pack_qweight`] from codes in the solver's layout, `[N, K]` row-major (`codes[n][k]` is the
/// code of `W[n][k]`), without transposing first. Each task packs a run of blocks that spans
/// one 64-byte line of every row, so every code byte is read from memory once.
pub fn pack_qweight_nk(codes: &[u8], n: usize, k: usize, bits: u8) -> Result<Vec<i32>> {
    let lay = check_codes(codes, k, n, bits, |pos| (pos % k, pos / k))?;
    let blocks_per_task = (64 / lay.vals).max(1);
    match bits {
        2 => return Ok(pack_nk_one_word::<2>(codes, n, k, blocks_per_task)),
        4 => return Ok(pack_nk_one_word::<4>(codes, n, k, blocks_per_task)),
        8 => return Ok(pack_nk_one_word::<8>(codes, n, k, blocks_per_task)),
        _ => {}
    }
    // 3 bits: blocks of three words with straddling fields, through the general bit stream.
    let mut words = vec![0i32; lay.packed_len(k) * n];
    words
        .par_chunks_mut((blocks_per_task * lay.words * n).max(1))
        .enumerate()
        .for_each(|(t, out)| {
            let b0 = t * blocks_per_task;
            let nb = out.len() / (lay.words * n);
            let mut block = vec![0u32; lay.words];
            for (col, row) in codes.chunks_exact(k).enumerate() {
                for bi in 0..nb {
                    let src = &row[(b0 + bi) * lay.vals..(b0 + bi + 1) * lay.vals];
                    block.fill(0);
                    for (i, &c) in src.iter().enumerate() {
                        lay.put(&mut block, i, u32::from(c));
                    }
                    for (w, &v) in block.iter().enumerate() {
                        out[(bi * lay.words + w) * n + col] = v as i32;
                    }
                }
            }
        });
    Ok(words)
}

/// [`pack_qweight_nk`] for the widths whose block is one word (2, 4, 8 bits), with the width
/// known at compile time so the field loop unrolls: about 8× faster than the general bit stream
/// on the development machine; the tests check it against [`pack_qweight`] on every width.
fn pack_nk_one_word<const BITS: usize>(
    codes: &[u8],
    n: usize,
    k: usize,
    blocks_per_task: usize,
) -> Vec<i32> {
    let vals = 32 / BITS;
    let mut words = vec![0i32; k / vals * n];
    words
        .par_chunks_mut((blocks_per_task * n).max(1))
        .enumerate()
        .for_each(|(t, out)| {
            let c0 = t * blocks_per_task * vals;
            let nb = out.len() / n;
            for (col, row) in codes.chunks_exact(k).enumerate() {
                for (bi, blk) in row[c0..c0 + nb * vals].chunks_exact(vals).enumerate() {
                    let mut w = 0u32;
                    for (i, &c) in blk.iter().enumerate() {
                        w |= u32::from(c) << (BITS * i);
                    }
                    out[bi * n + col] = w as i32;
                }
            }
        });
    words
}

/// Inverse of [`pack_qweight`]: `qweight` `[K·bits/32, N]` back to codes `[K, N]`.
pub fn unpack_qweight(words: &[i32], k: usize, n: usize, bits: u8) -> Result<Vec<u8>> {
    let lay = BitLayout::of(bits)?;
    ensure!(
        k.is_multiple_of(lay.vals),
        "qweight unpacking needs K to be a multiple of {} for {bits}-bit codes, got K = {k}",
        lay.vals
    );
    ensure!(
        words.len() == lay.packed_len(k) * n,
        "qweight of a [K={k}, N={n}] {bits}-bit matrix must hold {} words, got {}",
        lay.packed_len(k) * n,
        words.len()
    );
    Ok(match bits {
        2 => unpack_kn_one_word::<2>(words, n),
        4 => unpack_kn_one_word::<4>(words, n),
        8 => unpack_kn_one_word::<8>(words, n),
        _ => unpack_kn_stream(&lay, words, k, n),
    })
}

/// [`unpack_qweight`] through the general bit stream: the 3-bit path, and the reference of the
/// one-word paths.
fn unpack_kn_stream(lay: &BitLayout, words: &[i32], k: usize, n: usize) -> Vec<u8> {
    let mut codes = vec![0u8; k * n];
    codes
        .par_chunks_mut((lay.vals * n).max(1))
        .zip(words.par_chunks((lay.words * n).max(1)))
        .for_each(|(code_rows, word_rows)| {
            let mut block = vec![0u32; lay.words];
            for col in 0..n {
                for (w, v) in block.iter_mut().enumerate() {
                    *v = word_rows[w * n + col] as u32;
                }
                for i in 0..lay.vals {
                    code_rows[i * n + col] = lay.get(&block, i) as u8;
                }
            }
        });
    codes
}

/// [`unpack_qweight`] for the widths whose block is one word: code row `i` of a block is every
/// word of the row shifted right by `i · BITS`.
fn unpack_kn_one_word<const BITS: usize>(words: &[i32], n: usize) -> Vec<u8> {
    let vals = 32 / BITS;
    let mask = (1u32 << BITS) - 1;
    let mut codes = vec![0u8; words.len() * vals];
    if n == 0 {
        return codes;
    }
    codes
        .par_chunks_mut(vals * n)
        .zip(words.par_chunks(n))
        .for_each(|(rows, word_row)| {
            for (i, row) in rows.chunks_exact_mut(n).enumerate() {
                for (c, &w) in row.iter_mut().zip(word_row) {
                    *c = ((w as u32 >> (BITS * i)) & mask) as u8;
                }
            }
        });
    codes
}

/// Packs real zero points `[groups, N]` into `qzeros` `[groups, N·bits/32]` (packed along N).
///
/// GPTQ v1 (`checkpoint_format: "gptq"`) stores `zero − 1`, so sym 4-bit gives `0x77777777` in every
/// word. A zero of 0 has no v1 encoding: it is refused rather than borrowed from the neighbouring
/// code as GPTQModel's v2→v1 word subtraction does, because readers would then load different
/// zeros than the quantizer used. Asymmetric checkpoints with such zeros need `gptq_v2`.
pub fn pack_qzeros(
    zeros: &[u8],
    groups: usize,
    n: usize,
    bits: u8,
    format: QuantFormat,
) -> Result<Vec<i32>> {
    let v1 = format.zeros_minus_one();
    let lay = BitLayout::of(bits)?;
    ensure!(
        n.is_multiple_of(lay.vals),
        "qzeros packing needs N to be a multiple of {} for {bits}-bit zeros, got N = {n}",
        lay.vals
    );
    ensure!(
        zeros.len() == groups * n,
        "qzeros packing got {} zeros for [groups={groups}, N={n}] (expected {})",
        zeros.len(),
        groups * n
    );
    let maxq = max_code(bits);
    for (pos, &zero) in zeros.iter().enumerate() {
        let (group, col) = (pos / n, pos % n);
        ensure!(
            u32::from(zero) <= maxq,
            "zero point {zero} at [group={group}, n={col}] does not fit {bits} bits (max {maxq})"
        );
        ensure!(
            !(v1 && zero == 0),
            "zero point 0 at [group={group}, n={col}] cannot be stored in GPTQ v1 qzeros (v1 \
             stores zero - 1, which would be -1); this happens with asymmetric quantization: \
             write checkpoint_format \"gptq_v2\" instead"
        );
    }
    let stored_offset = u32::from(v1);
    let words = zeros
        .chunks(lay.vals)
        .flat_map(|chunk| {
            let mut block = vec![0u32; lay.words];
            for (i, &zero) in chunk.iter().enumerate() {
                lay.put(&mut block, i, u32::from(zero) - stored_offset);
            }
            block.into_iter().map(|w| w as i32)
        })
        .collect();
    Ok(words)
}

/// Inverse of [`pack_qzeros`]: real zero points `[groups, N]`.
///
/// For GPTQ v1 it adds 1 after masking each field, as the engines' readers do, so an all-ones field
/// reads as `2^bits` (GPTQModel's borrow artefact); hence `u16`, which holds 256 for 8 bits.
pub fn unpack_qzeros(
    words: &[i32],
    groups: usize,
    n: usize,
    bits: u8,
    format: QuantFormat,
) -> Result<Vec<u16>> {
    let v1 = format.zeros_minus_one();
    let lay = BitLayout::of(bits)?;
    ensure!(
        n.is_multiple_of(lay.vals),
        "qzeros unpacking needs N to be a multiple of {} for {bits}-bit zeros, got N = {n}",
        lay.vals
    );
    ensure!(
        words.len() == lay.packed_len(groups * n),
        "qzeros of [groups={groups}, N={n}] {bits}-bit zeros must hold {} words, got {}",
        lay.packed_len(groups * n),
        words.len()
    );
    let stored_offset = u16::from(v1);
    Ok(words
        .chunks(lay.words)
        .flat_map(|chunk| {
            let block: Vec<u32> = chunk.iter().map(|&w| w as u32).collect();
            (0..lay.vals).map(move |i| lay.get(&block, i) as u16 + stored_offset)
        })
        .collect())
}

/// The tensors of one GPTQ-quantized Linear, as read from a checkpoint (scales already in f32).
#[derive(Clone, Copy, Debug)]
pub struct GptqTensors<'a> {
    /// `[K·bits/32, N]`
    pub qweight: &'a [i32],
    /// `[groups, N·bits/32]`
    pub qzeros: &'a [i32],
    /// `[groups, N]`
    pub scales: &'a [f32],
    /// `[K]`, the group of every input row
    pub g_idx: &'a [i32],
    pub k: usize,
    pub n: usize,
    pub bits: u8,
    /// GPTQ v1 (zeros stored minus one) or v2.
    pub format: QuantFormat,
}

/// Dequantizes to `Wᵀ` `[K, N]` row-major (the layout GPTQ and Marlin store codes in, so rows
/// compare directly with a Marlin dequant): `Wᵀ[k][n] = scales[g][n] · (code[k][n] − zero[g][n])`,
/// `g = g_idx[k]`. The integer difference is exact in f32, so each value is rounded once.
pub fn dequantize_gptq(t: &GptqTensors) -> Result<Vec<f32>> {
    let GptqTensors {
        qweight,
        qzeros,
        scales,
        g_idx,
        k,
        n,
        bits,
        format,
    } = *t;
    ensure!(n > 0, "cannot dequantize a GPTQ tensor with N = 0");
    ensure!(
        scales.len() % n == 0,
        "scales hold {} values, not a whole number of rows of N = {n}",
        scales.len()
    );
    let groups = scales.len() / n;
    ensure!(
        g_idx.len() == k,
        "g_idx has {} entries, expected K = {k}",
        g_idx.len()
    );
    if let Some(pos) = g_idx.iter().position(|&g| g < 0 || g as usize >= groups) {
        bail!(
            "g_idx[{pos}] = {} is outside the {groups} scale groups",
            g_idx[pos]
        );
    }
    let codes = unpack_qweight(qweight, k, n, bits).context("dequantizing qweight")?;
    let zeros = unpack_qzeros(qzeros, groups, n, bits, format).context("dequantizing qzeros")?;
    let mut weights = vec![0f32; k * n];
    weights
        .par_chunks_mut(n)
        .zip(codes.par_chunks(n))
        .zip(g_idx.par_iter())
        .for_each(|((weight_row, code_row), &group)| {
            let group = group as usize;
            let scale_row = &scales[group * n..(group + 1) * n];
            let zero_row = &zeros[group * n..(group + 1) * n];
            for (((w, &code), &scale), &zero) in weight_row
                .iter_mut()
                .zip(code_row)
                .zip(scale_row)
                .zip(zero_row)
            {
                *w = scale * (i32::from(code) - i32::from(zero)) as f32;
            }
        });
    Ok(weights)
}

/// int32 words as the little-endian bytes of a safetensors `I32` tensor.
pub fn i32_to_le_bytes(words: &[i32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The little-endian bytes of a safetensors `I32` tensor as words.
pub fn le_bytes_to_i32(bytes: &[u8]) -> Result<Vec<i32>> {
    ensure!(
        bytes.len().is_multiple_of(4),
        "int32 tensor data has {} bytes, not a multiple of 4",
        bytes.len()
    );
    Ok(bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Scales rounded to fp16 (round-to-nearest-even) as the little-endian bytes of an `F16` tensor.
pub fn f32_to_f16_le_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect()
}

/// The little-endian bytes of an `F16` tensor widened (exactly) to f32.
pub fn f16_le_bytes_to_f32(bytes: &[u8]) -> Result<Vec<f32>> {
    ensure!(
        bytes.len().is_multiple_of(2),
        "fp16 tensor data has {} bytes, not a multiple of 2",
        bytes.len()
    );
    Ok(bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: QuantFormat = QuantFormat::GptqV1;
    const V2: QuantFormat = QuantFormat::GptqV2;

    fn fmt(v1: bool) -> QuantFormat {
        if v1 {
            V1
        } else {
            V2
        }
    }
    use crate::rng::SplitMix64;

    #[test]
    fn qweight_known_words_for_each_width() {
        // 4 bit: codes 0..7 down column 0 of rows 0..7.
        let (k, n) = (8, 2);
        let mut codes = vec![0u8; k * n];
        for row in 0..8 {
            codes[row * n] = row as u8;
        }
        codes[7 * n + 1] = 15;
        let words = pack_qweight(&codes, k, n, 4).unwrap();
        assert_eq!(words, vec![0x76543210, 0xF000_0000u32 as i32]);

        // 8 bit: four codes per word.
        let words = pack_qweight(&[1, 2, 3, 0xAB], 4, 1, 8).unwrap();
        assert_eq!(words, vec![0xAB03_0201u32 as i32]);

        // 2 bit: sixteen codes per word, code i%4 in row i.
        let codes: Vec<u8> = (0..16).map(|i| i % 4).collect();
        let words = pack_qweight(&codes, 16, 1, 2).unwrap();
        assert_eq!(words, vec![0xE4E4_E4E4u32 as i32]);
    }

    /// AutoGPTQ's 3-bit layout written out word by word ("10|1|10|1|10"), independently of the
    /// bit-stream formulation the packer uses.
    fn reference_3bit_words(c: &[u32]) -> [u32; 3] {
        let ten = |first: usize, shift: usize| {
            (0..10).fold(0u32, |acc, j| acc | (c[first + j] << (3 * j + shift)))
        };
        [
            ten(0, 0) | (c[10] << 30),
            ((c[10] >> 2) & 1) | ten(11, 1) | (c[21] << 31),
            ((c[21] >> 1) & 3) | ten(22, 2),
        ]
    }

    #[test]
    fn three_bit_fields_straddle_words_as_autogptq_packs_them() {
        let mut rng = SplitMix64::new(3);
        let (k, n) = (64, 5);
        let codes: Vec<u8> = (0..k * n).map(|_| rng.below(8) as u8).collect();
        let words = pack_qweight(&codes, k, n, 3).unwrap();
        assert_eq!(words.len(), 6 * n);
        for block in 0..2 {
            for col in 0..n {
                let c: Vec<u32> = (0..32)
                    .map(|i| u32::from(codes[(block * 32 + i) * n + col]))
                    .collect();
                let expected = reference_3bit_words(&c);
                for (w, &e) in expected.iter().enumerate() {
                    assert_eq!(
                        words[(block * 3 + w) * n + col] as u32,
                        e,
                        "{block} {col} {w}"
                    );
                }
            }
        }
        // A known answer: all fields 7 set every bit; field 10 alone = 0b101 splits 01|1.
        assert_eq!(pack_qweight(&[7; 32], 32, 1, 3).unwrap(), vec![-1; 3]);
        let mut one = [0u8; 32];
        one[10] = 0b101;
        assert_eq!(
            pack_qweight(&one, 32, 1, 3).unwrap(),
            vec![0x4000_0000, 1, 0]
        );
        // qzeros use the same stream along N; sym 3-bit v1 stores 3 in every field.
        let z = pack_qzeros(&[4; 32], 1, 32, 3, V1).unwrap();
        assert_eq!(
            z.iter().map(|&w| w as u32).collect::<Vec<_>>(),
            reference_3bit_words(&[3; 32]).to_vec()
        );
        assert_eq!(unpack_qzeros(&z, 1, 32, 3, V1).unwrap(), vec![4; 32]);
    }

    #[test]
    fn packing_from_rows_equals_packing_the_transpose() {
        let mut rng = SplitMix64::new(11);
        for bits in [2u8, 3, 4, 8] {
            let maxq = (1u32 << bits) - 1;
            for (n, k) in [(5, 32), (64, 256), (96, 1024), (3, 96)] {
                if k % block_shape(bits).unwrap().0 != 0 {
                    continue;
                }
                let nk: Vec<u8> = (0..n * k)
                    .map(|_| rng.below(maxq as usize + 1) as u8)
                    .collect();
                let mut kn = vec![0u8; k * n];
                for r in 0..n {
                    for c in 0..k {
                        kn[c * n + r] = nk[r * k + c];
                    }
                }
                assert_eq!(
                    pack_qweight_nk(&nk, n, k, bits).unwrap(),
                    pack_qweight(&kn, k, n, bits).unwrap(),
                    "{bits} bits, [{n}, {k}]"
                );
            }
        }
        let err = pack_qweight_nk(&[16; 8], 1, 8, 4).unwrap_err().to_string();
        assert!(err.contains("does not fit 4 bits"), "{err}");
        // An offender past the first chunks of the range check is found and placed exactly.
        let (n, k) = (80, 4096);
        let mut nk = vec![7u8; n * k];
        nk[70 * k + 1234] = 9;
        let err = pack_qweight_nk(&nk, n, k, 3).unwrap_err().to_string();
        assert!(err.contains("code 9 at [k=1234, n=70]"), "{err}");
    }

    #[test]
    fn qweight_rows_beyond_the_first_word_go_to_the_next_word_row() {
        let (k, n) = (16, 3);
        let mut codes = vec![0u8; k * n];
        codes[9 * n + 2] = 5; // row 9 = word row 1, field 1, column 2
        let words = pack_qweight(&codes, k, n, 4).unwrap();
        let mut expected = vec![0i32; 2 * n];
        expected[n + 2] = 0x50;
        assert_eq!(words, expected);
    }

    #[test]
    fn sym_4bit_qzeros_are_0x77777777_in_v1_and_0x88888888_in_v2() {
        let (groups, n) = (3, 16);
        let zeros = vec![8u8; groups * n];
        let v1 = pack_qzeros(&zeros, groups, n, 4, V1).unwrap();
        assert_eq!(v1, vec![2004318071; groups * n / 8]);
        assert_eq!(0x77777777, 2004318071);
        let v2 = pack_qzeros(&zeros, groups, n, 4, V2).unwrap();
        assert_eq!(v2, vec![0x8888_8888u32 as i32; groups * n / 8]);
        let back: Vec<u16> = unpack_qzeros(&v1, groups, n, 4, V1).unwrap();
        assert!(back.iter().all(|&z| z == 8));
    }

    #[test]
    fn qzeros_pack_along_n() {
        let zeros: Vec<u8> = (1..=16).map(|z| (z % 15 + 1) as u8).collect();
        let words = pack_qzeros(&zeros, 2, 8, 4, V2).unwrap();
        assert_eq!(words, vec![0x98765432u32 as i32, 0x21FEDCBA]);
    }

    #[test]
    fn v1_refuses_a_zero_point_of_zero() {
        let mut zeros = vec![8u8; 16];
        zeros[11] = 0;
        let err = pack_qzeros(&zeros, 2, 8, 4, V1).unwrap_err().to_string();
        assert!(err.contains("[group=1, n=3]"), "{err}");
        assert!(err.contains("gptq_v2"), "{err}");
        assert!(pack_qzeros(&zeros, 2, 8, 4, V2).is_ok());
    }

    #[test]
    fn v1_reader_turns_an_all_ones_field_into_two_to_the_bits() {
        let zeros = unpack_qzeros(&[-1], 1, 8, 4, V1).unwrap();
        assert_eq!(zeros, vec![16; 8]);
        let zeros = unpack_qzeros(&[-1], 1, 4, 8, V1).unwrap();
        assert_eq!(zeros, vec![256; 4]);
    }

    #[test]
    fn refusals_name_the_problem() {
        let err = pack_qweight(&[0; 32], 32, 1, 5).unwrap_err().to_string();
        assert!(err.contains("supports 2, 3, 4 or 8 bits, got 5"), "{err}");
        let err = pack_qweight(&[0; 16], 16, 1, 3).unwrap_err().to_string();
        assert!(
            err.contains("multiple of 32") && err.contains("K = 16"),
            "{err}"
        );
        let err = pack_qweight(&[0; 12], 12, 1, 4).unwrap_err().to_string();
        assert!(
            err.contains("multiple of 8") && err.contains("K = 12"),
            "{err}"
        );
        let err = pack_qweight(&[0, 0, 16, 0, 0, 0, 0, 0], 8, 1, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("code 16 at [k=2, n=0]"), "{err}");
        let err = pack_qzeros(&[8; 12], 1, 12, 4, V1).unwrap_err().to_string();
        assert!(err.contains("N = 12"), "{err}");
        let err = unpack_qweight(&[0; 3], 16, 2, 4).unwrap_err().to_string();
        assert!(err.contains("must hold 4 words, got 3"), "{err}");
        let err = unpack_qweight(&[0; 4], 16, 2, 6).unwrap_err().to_string();
        assert!(err.contains("got 6"), "{err}");
    }

    /// The one-word paths (2, 4, 8 bits) give the general bit stream's words, and back.
    #[test]
    fn one_word_paths_equal_the_bit_stream() {
        let mut rng = SplitMix64::new(0x0b17);
        for bits in [2u8, 4, 8] {
            let lay = BitLayout::of(bits).unwrap();
            for (k, n) in [(32, 1), (64, 96), (256, 130)] {
                let codes: Vec<u8> = (0..k * n).map(|_| rng.below(1 << bits) as u8).collect();
                let stream = pack_kn_stream(&lay, &codes, k, n);
                assert_eq!(pack_qweight(&codes, k, n, bits).unwrap(), stream);
                assert_eq!(unpack_kn_stream(&lay, &stream, k, n), codes);
                assert_eq!(unpack_qweight(&stream, k, n, bits).unwrap(), codes);
            }
        }
    }

    #[test]
    fn qweight_and_qzeros_round_trip_random_values() {
        let mut rng = SplitMix64::new(0x5eed);
        for bits in [2u8, 3, 4, 8] {
            let maxq = (1u32 << bits) - 1;
            for (k, n) in [(32, 32), (64, 96), (256, 128), (128, 16)] {
                let codes: Vec<u8> = (0..k * n)
                    .map(|_| rng.below(maxq as usize + 1) as u8)
                    .collect();
                let words = pack_qweight(&codes, k, n, bits).unwrap();
                assert_eq!(words.len(), k * bits as usize / 32 * n);
                assert_eq!(unpack_qweight(&words, k, n, bits).unwrap(), codes);

                if n % block_shape(bits).unwrap().0 != 0 {
                    let err = pack_qzeros(&vec![1; n], 1, n, bits, V2).unwrap_err();
                    assert!(err.to_string().contains(&format!("N = {n}")), "{err}");
                    continue;
                }
                let groups = k / 16;
                for v1 in [true, false] {
                    let lowest = u32::from(v1);
                    let zeros: Vec<u8> = (0..groups * n)
                        .map(|_| (lowest as usize + rng.below((maxq + 1 - lowest) as usize)) as u8)
                        .collect();
                    let packed = pack_qzeros(&zeros, groups, n, bits, fmt(v1)).unwrap();
                    assert_eq!(packed.len(), groups * n * bits as usize / 32);
                    let back = unpack_qzeros(&packed, groups, n, bits, fmt(v1)).unwrap();
                    assert!(back.iter().zip(&zeros).all(|(&b, &z)| b == u16::from(z)));
                }
            }
        }
    }

    #[test]
    fn dequantize_follows_g_idx_scales_and_zeros() {
        let (k, n, bits) = (16, 8, 4);
        let mut rng = SplitMix64::new(7);
        let codes: Vec<u8> = (0..k * n).map(|_| rng.below(16) as u8).collect();
        let zeros: Vec<u8> = (0..2 * n).map(|_| 1 + rng.below(15) as u8).collect();
        let scales: Vec<f32> = (0..2 * n).map(|i| 0.01 * (i + 1) as f32).collect();
        // A dynamic act-order style g_idx: not monotone in k.
        let g_idx: Vec<i32> = (0..k).map(|row| ((row * 5) % k / 8) as i32).collect();
        let qweight = pack_qweight(&codes, k, n, bits).unwrap();
        for v1 in [true, false] {
            let qzeros = pack_qzeros(&zeros, 2, n, bits, fmt(v1)).unwrap();
            let tensors = GptqTensors {
                qweight: &qweight,
                qzeros: &qzeros,
                scales: &scales,
                g_idx: &g_idx,
                k,
                n,
                bits,
                format: fmt(v1),
            };
            let weights = dequantize_gptq(&tensors).unwrap();
            for row in 0..k {
                let group = g_idx[row] as usize;
                for col in 0..n {
                    let expected = scales[group * n + col]
                        * (f32::from(codes[row * n + col]) - f32::from(zeros[group * n + col]));
                    assert_eq!(weights[row * n + col].to_bits(), expected.to_bits());
                }
            }
        }
    }

    #[test]
    fn dequantize_known_value_and_bad_g_idx() {
        // One row group, sym 4-bit: code 3 with zero 8 and scale 0.5 is -2.5.
        let qweight = pack_qweight(&[3, 0, 0, 0, 0, 0, 0, 0], 8, 1, 4).unwrap();
        let qzeros = pack_qzeros(&[8; 8], 1, 8, 4, V1).unwrap();
        let qweight = [qweight[0]; 8];
        let scales = [0.5f32; 8];
        let mut tensors = GptqTensors {
            qweight: &qweight,
            qzeros: &qzeros,
            scales: &scales,
            g_idx: &[0; 8],
            k: 8,
            n: 8,
            bits: 4,
            format: V1,
        };
        let weights = dequantize_gptq(&tensors).unwrap();
        assert_eq!(weights[0], -2.5);
        assert_eq!(weights[8], -4.0);

        let bad_g_idx = [0, 0, 0, 1, 0, 0, 0, 0];
        tensors.g_idx = &bad_g_idx;
        let err = dequantize_gptq(&tensors).unwrap_err().to_string();
        assert!(err.contains("g_idx[3] = 1"), "{err}");
    }

    #[test]
    fn byte_conversions_are_little_endian_and_invert() {
        let words = [0x76543210, -1, i32::MIN];
        let bytes = i32_to_le_bytes(&words);
        assert_eq!(&bytes[..4], &[0x10, 0x32, 0x54, 0x76]);
        assert_eq!(le_bytes_to_i32(&bytes).unwrap(), words);
        assert!(le_bytes_to_i32(&bytes[..5]).is_err());

        let scales = [1.0f32, -0.5, 0.000_123, 65504.0];
        let bytes = f32_to_f16_le_bytes(&scales);
        assert_eq!(&bytes[..4], &[0x00, 0x3C, 0x00, 0xB8]);
        let back = f16_le_bytes_to_f32(&bytes).unwrap();
        for (b, s) in back.iter().zip(scales) {
            assert_eq!(*b, f16::from_f32(s).to_f32());
        }
        assert!(f16_le_bytes_to_f32(&bytes[..3]).is_err());
    }
}
