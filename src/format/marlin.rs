//! Marlin INT4 (`uint4b8`, value `(q − 8)·s`) layout (docs/formats.md, Marlin tile layout and
//! Marlin scale permutation): the
//! weight tiles `B [K/16, 2N]`, the scale permutations and the act-order row sort.
//!
//! Codes are the GPTQ codes re-tiled, so a Marlin tensor holds exactly a symmetric 4-bit GPTQ
//! layer. `B` is a grid of 16×64 tiles of 128 words each; every word is the mma.m16n8k16
//! B-fragment of one lane of one warp, with its nibbles interleaved so the kernel's dequant
//! extracts rows (r, r+1) into one half2 register.

use anyhow::{bail, ensure, Context, Result};
use rayon::prelude::*;

use super::pack::{pack_qweight, unpack_qweight};
use crate::scheme::GroupSize;

/// Rows of a Marlin tile: the k extent of one mma B fragment.
const TILE_ROWS: usize = 16;
/// Columns of a Marlin tile: four warps of 16 columns.
const TILE_COLS: usize = 64;
/// 16·64 codes at 8 per word.
const WORDS_PER_TILE: usize = 128;
/// Row offset (within the tile) and column offset (within the lane's 16-column sub-tile) of
/// nibble p: the fragment values `(r,c) (r+1,c) (r+8,c) (r+9,c) (r,c+8) …` in interleave order
/// `[0,2,4,6,1,3,5,7]`.
const NIBBLE_ROW: [usize; 8] = [0, 8, 0, 8, 1, 9, 1, 9];
const NIBBLE_COL: [usize; 8] = [0, 0, 8, 8, 0, 0, 8, 8];

/// The reference tools' permutation of each 1024-code chunk (four consecutive 16×16 sub-tiles,
/// tiled row-major) before packing 8 codes per word (`_get_perms` of IST-DASLab marlin, AutoGPTQ,
/// vLLM). [`pack_marlin`] computes the same layout from the kernel's index formula instead; the
/// tests check that both agree.
pub const MARLIN_WEIGHT_PERM: [usize; 1024] = build_marlin_weight_perm();

/// Scale permutation for grouped scales (`g < K`), applied per 64 consecutive values.
pub const MARLIN_SCALE_PERM: [usize; 64] = build_scale_perm();

/// Scale permutation for per-channel scales (one group, `g = K`) and the bias, applied per 32
/// consecutive values.
pub const MARLIN_SCALE_PERM_SINGLE: [usize; 32] = build_scale_perm_single();

const fn build_marlin_weight_perm() -> [usize; 1024] {
    const INTERLEAVE: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
    let mut perm = [0usize; 1024];
    let mut lane = 0;
    while lane < 32 {
        let col = lane / 4;
        let rows = [
            2 * (lane % 4),
            2 * (lane % 4) + 1,
            2 * (lane % 4 + 4),
            2 * (lane % 4 + 4) + 1,
        ];
        // Column block (c, c+8) outer, row inner, as `_get_perms` builds `perm1`.
        let mut lane_values = [0usize; 8];
        let mut v = 0;
        while v < 8 {
            lane_values[v] = 16 * rows[v % 4] + col + 8 * (v / 4);
            v += 1;
        }
        let mut sub_tile = 0;
        while sub_tile < 4 {
            let base = (lane * 4 + sub_tile) * 8;
            let mut p = 0;
            while p < 8 {
                perm[base + p] = lane_values[INTERLEAVE[p]] + 256 * sub_tile;
                p += 1;
            }
            sub_tile += 1;
        }
        lane += 1;
    }
    perm
}

const fn build_scale_perm() -> [usize; 64] {
    let mut perm = [0usize; 64];
    let mut i = 0;
    while i < 8 {
        let mut j = 0;
        while j < 8 {
            perm[i * 8 + j] = i + 8 * j;
            j += 1;
        }
        i += 1;
    }
    perm
}

const fn build_scale_perm_single() -> [usize; 32] {
    const OFFSETS: [usize; 8] = [0, 1, 8, 9, 16, 17, 24, 25];
    let mut perm = [0usize; 32];
    let mut i = 0;
    while i < 4 {
        let mut o = 0;
        while o < 8 {
            perm[i * 8 + o] = 2 * i + OFFSETS[o];
            o += 1;
        }
        i += 1;
    }
    perm
}

/// Where nibble `nibble` of word `word` of a `B` row comes from: (row within the 16-row tile,
/// column of the code matrix). The kernel's lane/warp decomposition (docs/formats.md, Marlin tile
/// layout).
fn marlin_nibble_source(word: usize, nibble: usize) -> (usize, usize) {
    let tile = word / WORDS_PER_TILE;
    let word_in_tile = word % WORDS_PER_TILE;
    let lane = word_in_tile / 4;
    let warp = word_in_tile % 4;
    let fragment_col = lane / 4;
    let fragment_row = 2 * (lane % 4);
    (
        fragment_row + NIBBLE_ROW[nibble],
        tile * TILE_COLS + warp * 16 + fragment_col + NIBBLE_COL[nibble],
    )
}

fn check_tile_shape(k: usize, n: usize) -> Result<()> {
    ensure!(
        k > 0 && k.is_multiple_of(TILE_ROWS),
        "Marlin tiles need K to be a positive multiple of {TILE_ROWS}, got K = {k}"
    );
    ensure!(
        n > 0 && n.is_multiple_of(TILE_COLS),
        "Marlin tiles need N to be a positive multiple of {TILE_COLS}, got N = {n}"
    );
    Ok(())
}

/// Packs 4-bit codes `[K, N]` (rows already in act-order-sorted order) into Marlin `B`
/// `[K/16, 2N]`.
pub fn pack_marlin(codes_kn: &[u8], k: usize, n: usize) -> Result<Vec<i32>> {
    check_tile_shape(k, n)?;
    ensure!(
        codes_kn.len() == k * n,
        "Marlin packing got {} codes for a [K={k}, N={n}] matrix (expected {})",
        codes_kn.len(),
        k * n
    );
    if let Some(pos) = codes_kn.iter().position(|&c| c > 15) {
        bail!(
            "code {} at [k={}, n={}] does not fit 4 bits",
            codes_kn[pos],
            pos / n,
            pos % n
        );
    }
    let words_per_row = 2 * n;
    let mut b = vec![0i32; k / TILE_ROWS * words_per_row];
    b.par_chunks_mut(words_per_row)
        .zip(codes_kn.par_chunks(TILE_ROWS * n))
        .for_each(|(b_row, tile_rows)| {
            for (w, word) in b_row.iter_mut().enumerate() {
                let packed = (0..8).fold(0u32, |acc, p| {
                    let (row, col) = marlin_nibble_source(w, p);
                    acc | (u32::from(tile_rows[row * n + col]) << (4 * p))
                });
                *word = packed as i32;
            }
        });
    Ok(b)
}

/// Inverse of [`pack_marlin`]: Marlin `B` `[K/16, 2N]` back to codes `[K, N]` (sorted row order).
pub fn unpack_marlin(b: &[i32], k: usize, n: usize) -> Result<Vec<u8>> {
    check_tile_shape(k, n)?;
    ensure!(
        b.len() == k / TILE_ROWS * 2 * n,
        "Marlin B of a [K={k}, N={n}] matrix must hold {} words ([{}, {}]), got {}",
        k / TILE_ROWS * 2 * n,
        k / TILE_ROWS,
        2 * n,
        b.len()
    );
    let mut codes = vec![0u8; k * n];
    codes
        .par_chunks_mut(TILE_ROWS * n)
        .zip(b.par_chunks(2 * n))
        .for_each(|(tile_rows, b_row)| {
            for (w, &word) in b_row.iter().enumerate() {
                for p in 0..8 {
                    let (row, col) = marlin_nibble_source(w, p);
                    tile_rows[row * n + col] = ((word as u32 >> (4 * p)) & 0xF) as u8;
                }
            }
        });
    Ok(codes)
}

/// The permutation and chunk length for scales of `groups` rows: a single group (per-channel)
/// uses the 32-entry permutation, grouped scales the 64-entry one.
fn scale_perm_for(groups: usize) -> &'static [usize] {
    if groups > 1 {
        &MARLIN_SCALE_PERM
    } else {
        &MARLIN_SCALE_PERM_SINGLE
    }
}

fn check_scale_shape(len: usize, groups: usize, n: usize, chunk: usize) -> Result<()> {
    ensure!(groups > 0, "Marlin scales need at least one group row");
    ensure!(
        n.is_multiple_of(chunk),
        "Marlin scale permutation works on chunks of {chunk} per row, N = {n} is not a multiple"
    );
    ensure!(
        len == groups * n,
        "scales hold {len} values, expected [groups={groups}, N={n}] = {}",
        groups * n
    );
    Ok(())
}

/// Permutes GPTQ scales `[groups, N]` (row-major) into Marlin order:
/// `out[c·L + x] = in[c·L + P[x]]` per chunk `c`. `groups > 1` (g < K) selects
/// [`MARLIN_SCALE_PERM`] (L = 64), one group [`MARLIN_SCALE_PERM_SINGLE`] (L = 32), as the
/// reference tools decide by `group_size < K`.
pub fn permute_scales<T: Copy>(scales: &[T], groups: usize, n: usize) -> Result<Vec<T>> {
    let perm = scale_perm_for(groups);
    check_scale_shape(scales.len(), groups, n, perm.len())?;
    Ok(scales
        .chunks_exact(perm.len())
        .flat_map(|chunk| perm.iter().map(move |&src| chunk[src]))
        .collect())
}

/// Inverse of [`permute_scales`]: Marlin-ordered scales back to GPTQ `[groups, N]`.
pub fn unpermute_scales<T: Copy>(permuted: &[T], groups: usize, n: usize) -> Result<Vec<T>> {
    let perm = scale_perm_for(groups);
    check_scale_shape(permuted.len(), groups, n, perm.len())?;
    let mut scales = permuted.to_vec();
    for (out, chunk) in scales
        .chunks_exact_mut(perm.len())
        .zip(permuted.chunks_exact(perm.len()))
    {
        for (&dst, &value) in perm.iter().zip(chunk) {
            out[dst] = value;
        }
    }
    Ok(scales)
}

/// Stable argsort of `g_idx`: Marlin logical row `k'` holds GPTQ row `sort[k']`, so the groups
/// become contiguous. Stable keeps a trivial `g_idx` (`k / g`) at the identity and makes the
/// order reproducible.
pub fn marlin_sort_indices(g_idx: &[i32]) -> Vec<i32> {
    let mut rows: Vec<usize> = (0..g_idx.len()).collect();
    rows.sort_by_key(|&row| g_idx[row]);
    rows.into_iter().map(|row| row as i32).collect()
}

/// A GPTQ layer's weights in Marlin layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarlinWeight {
    /// `[K/16, 2N]` tiles of the rows in sorted order.
    pub b: Vec<i32>,
    /// `[K]`: Marlin row `k'` is GPTQ row `sort_indices[k']` (identity without act-order).
    pub sort_indices: Vec<i32>,
}

/// Re-tiles a 4-bit GPTQ `qweight` `[K/8, N]` with its `g_idx` `[K]` into Marlin: rows sorted by
/// group ([`marlin_sort_indices`]), then packed with [`pack_marlin`].
pub fn gptq_codes_to_marlin(
    qweight: &[i32],
    g_idx: &[i32],
    k: usize,
    n: usize,
) -> Result<MarlinWeight> {
    ensure!(
        g_idx.len() == k,
        "g_idx has {} entries, expected K = {k}",
        g_idx.len()
    );
    let codes = unpack_qweight(qweight, k, n, 4).context("unpacking the GPTQ qweight")?;
    let sort_indices = marlin_sort_indices(g_idx);
    let mut sorted_codes: Vec<u8> = Vec::with_capacity(k * n);
    for &row in &sort_indices {
        sorted_codes.extend_from_slice(&codes[row as usize * n..(row as usize + 1) * n]);
    }
    let b = pack_marlin(&sorted_codes, k, n)?;
    Ok(MarlinWeight { b, sort_indices })
}

/// Inverse of [`gptq_codes_to_marlin`]: Marlin `B` and its sort indices back to the GPTQ `qweight`
/// words `[K/8, N]` (the check that a Marlin file holds exactly the GPTQ codes).
pub fn marlin_to_gptq_codes(
    b: &[i32],
    sort_indices: &[i32],
    k: usize,
    n: usize,
) -> Result<Vec<i32>> {
    ensure!(
        sort_indices.len() == k,
        "sort indices have {} entries, expected K = {k}",
        sort_indices.len()
    );
    let mut seen = vec![false; k];
    for (pos, &row) in sort_indices.iter().enumerate() {
        ensure!(
            row >= 0 && (row as usize) < k && !seen[row as usize],
            "sort indices are not a permutation of 0..{k}: entry {pos} is {row}"
        );
        seen[row as usize] = true;
    }
    let sorted_codes = unpack_marlin(b, k, n)?;
    let mut codes = vec![0u8; k * n];
    for (sorted_row, &row) in sorted_codes.chunks_exact(n).zip(sort_indices) {
        let row = row as usize;
        codes[row * n..(row + 1) * n].copy_from_slice(sorted_row);
    }
    pack_qweight(&codes, k, n, 4)
}

/// The group sizes the gptq_marlin kernels accept (vLLM `MARLIN_SUPPORTED_GROUP_SIZES`): the one
/// list the packer, `inspect` and the engine emulation check.
pub const MARLIN_GROUP_SIZES: [i64; 4] = [-1, 32, 64, 128];

/// The kernels' shape limits (vLLM's `GPTQ_MARLIN_MIN_THREAD_K` and `_N`): in_features a multiple
/// of `MARLIN_K_MULTIPLE`, out_features of `MARLIN_N_MULTIPLE`. The packer and the engine
/// emulation check these two.
pub const MARLIN_K_MULTIPLE: usize = 128;
/// See `MARLIN_K_MULTIPLE`.
pub const MARLIN_N_MULTIPLE: usize = 64;

/// Whether the Marlin kernels take this group size.
pub fn marlin_group_ok(g: GroupSize) -> bool {
    MARLIN_GROUP_SIZES.contains(&g.to_i64())
}

/// Refuses a layer the Marlin format cannot hold, naming every reason with its values.
pub fn check_marlin_shape(
    k: usize,
    n: usize,
    group_size: GroupSize,
    bits: u8,
    sym: bool,
) -> Result<()> {
    let mut problems = Vec::new();
    if !sym {
        problems.push(
            "it is asymmetric, and Marlin (uint4b8) has no zero points, only the implicit 8 of \
             symmetric quantization (keep the GPTQ checkpoint or re-quantize without --asym)"
                .to_string(),
        );
    }
    if bits != 4 {
        problems.push(format!(
            "bits = {bits}, Marlin packing holds 4-bit codes only"
        ));
    }
    if !marlin_group_ok(group_size) {
        problems.push(format!(
            "group size {group_size} is not one Marlin supports (-1, 32, 64 or 128)"
        ));
    }
    if k == 0 || !k.is_multiple_of(MARLIN_K_MULTIPLE) {
        problems.push(format!(
            "K (in_features) = {k} is not a positive multiple of {MARLIN_K_MULTIPLE}"
        ));
    }
    if k > 0 && !group_size.divides(k) {
        problems.push(format!(
            "K (in_features) = {k} is not a multiple of the group size {group_size}"
        ));
    }
    if n == 0 || !n.is_multiple_of(MARLIN_N_MULTIPLE) {
        problems.push(format!(
            "N (out_features) = {n} is not a positive multiple of {MARLIN_N_MULTIPLE}"
        ));
    }
    ensure!(
        problems.is_empty(),
        "Marlin cannot hold this layer: {}",
        problems.join("; ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::pack::{dequantize_gptq, pack_qzeros, GptqTensors};
    use crate::rng::SplitMix64;
    use half::f16;

    const SHAPES: [(usize, usize); 4] = [(16, 64), (32, 128), (64, 256), (256, 192)];

    fn random_codes(rng: &mut SplitMix64, len: usize) -> Vec<u8> {
        (0..len).map(|_| rng.below(16) as u8).collect()
    }

    /// The reference tools' method: tile 16×16, permute each 1024-chunk by the table, pack.
    fn pack_marlin_with_perm_table(codes: &[u8], k: usize, n: usize) -> Vec<i32> {
        let mut tiled = vec![0u8; k * n];
        for kt in 0..k / 16 {
            for sub_tile in 0..n / 16 {
                for r in 0..16 {
                    for c in 0..16 {
                        tiled[kt * 16 * n + sub_tile * 256 + r * 16 + c] =
                            codes[(kt * 16 + r) * n + sub_tile * 16 + c];
                    }
                }
            }
        }
        let permuted: Vec<u8> = tiled
            .chunks_exact(1024)
            .flat_map(|chunk| MARLIN_WEIGHT_PERM.iter().map(move |&src| chunk[src]))
            .collect();
        permuted
            .chunks_exact(8)
            .map(|eight| {
                eight
                    .iter()
                    .enumerate()
                    .fold(0u32, |acc, (i, &c)| acc | (u32::from(c) << (4 * i)))
                    as i32
            })
            .collect()
    }

    fn one_hot(k: usize, n: usize, row: usize, col: usize, value: u8) -> Vec<u8> {
        let mut codes = vec![0u8; k * n];
        codes[row * n + col] = value;
        codes
    }

    fn random_permutation(rng: &mut SplitMix64, len: usize) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..len).collect();
        for i in (1..len).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        perm
    }

    /// Dynamic act-order g_idx: column j's group is its position in a random processing order / g.
    fn act_order_g_idx(rng: &mut SplitMix64, k: usize, group_size: usize) -> Vec<i32> {
        let order = random_permutation(rng, k);
        let mut g_idx = vec![0i32; k];
        for (position, &col) in order.iter().enumerate() {
            g_idx[col] = (position / group_size) as i32;
        }
        g_idx
    }

    #[test]
    fn weight_perm_table_matches_the_spec_and_is_a_permutation() {
        assert_eq!(
            MARLIN_WEIGHT_PERM[..16],
            [0, 128, 8, 136, 16, 144, 24, 152, 256, 384, 264, 392, 272, 400, 280, 408]
        );
        let mut sorted = MARLIN_WEIGHT_PERM;
        sorted.sort_unstable();
        assert!(sorted.iter().enumerate().all(|(i, &v)| i == v));
    }

    #[test]
    fn scale_perms_match_the_spec() {
        assert_eq!(
            MARLIN_SCALE_PERM[..10],
            [0, 8, 16, 24, 32, 40, 48, 56, 1, 9]
        );
        assert_eq!(MARLIN_SCALE_PERM[63], 63);
        assert_eq!(
            MARLIN_SCALE_PERM_SINGLE,
            [
                0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27, 4, 5, 12, 13, 20, 21, 28,
                29, 6, 7, 14, 15, 22, 23, 30, 31
            ]
        );
    }

    #[test]
    fn known_answer_code_k_plus_n() {
        let (k, n) = (16, 64);
        let codes: Vec<u8> = (0..k * n).map(|i| ((i / n + i % n) & 15) as u8).collect();
        let b = pack_marlin(&codes, k, n).unwrap();
        assert_eq!(b.len(), 128);
        assert_eq!(b[0] as u32, 0x19910880);
    }

    #[test]
    fn known_answer_one_hot_row_9_col_8() {
        let b = pack_marlin(&one_hot(16, 64, 9, 8, 15), 16, 64).unwrap();
        assert_eq!(b[0] as u32, 0xF000_0000);
        assert!(b[1..].iter().all(|&w| w == 0));
    }

    #[test]
    fn known_answer_word_table() {
        let table: [(usize, [(usize, usize); 8]); 7] = [
            (
                0,
                [
                    (0, 0),
                    (8, 0),
                    (0, 8),
                    (8, 8),
                    (1, 0),
                    (9, 0),
                    (1, 8),
                    (9, 8),
                ],
            ),
            (
                1,
                [
                    (0, 16),
                    (8, 16),
                    (0, 24),
                    (8, 24),
                    (1, 16),
                    (9, 16),
                    (1, 24),
                    (9, 24),
                ],
            ),
            (
                2,
                [
                    (0, 32),
                    (8, 32),
                    (0, 40),
                    (8, 40),
                    (1, 32),
                    (9, 32),
                    (1, 40),
                    (9, 40),
                ],
            ),
            (
                3,
                [
                    (0, 48),
                    (8, 48),
                    (0, 56),
                    (8, 56),
                    (1, 48),
                    (9, 48),
                    (1, 56),
                    (9, 56),
                ],
            ),
            (
                4,
                [
                    (2, 0),
                    (10, 0),
                    (2, 8),
                    (10, 8),
                    (3, 0),
                    (11, 0),
                    (3, 8),
                    (11, 8),
                ],
            ),
            (
                5,
                [
                    (2, 16),
                    (10, 16),
                    (2, 24),
                    (10, 24),
                    (3, 16),
                    (11, 16),
                    (3, 24),
                    (11, 24),
                ],
            ),
            (
                127,
                [
                    (6, 55),
                    (14, 55),
                    (6, 63),
                    (14, 63),
                    (7, 55),
                    (15, 55),
                    (7, 63),
                    (15, 63),
                ],
            ),
        ];
        for (word, positions) in table {
            for (nibble, (row, col)) in positions.into_iter().enumerate() {
                let b = pack_marlin(&one_hot(16, 64, row, col, 0xA), 16, 64).unwrap();
                for (w, &value) in b.iter().enumerate() {
                    let expected = if w == word { 0xA << (4 * nibble) } else { 0 };
                    assert_eq!(value as u32, expected, "code ({row},{col}), word {w}");
                }
            }
        }
    }

    #[test]
    fn known_answer_second_tile_row_and_column() {
        let mut rng = SplitMix64::new(3);
        // K = 32: rows 16..31 are the second B row, laid out as a K = 16 matrix would be.
        let codes = random_codes(&mut rng, 32 * 64);
        let b = pack_marlin(&codes, 32, 64).unwrap();
        assert_eq!(b[..128], pack_marlin(&codes[..16 * 64], 16, 64).unwrap());
        assert_eq!(b[128..], pack_marlin(&codes[16 * 64..], 16, 64).unwrap());
        // N = 128: columns 64..127 are words 128..255 of the row.
        let codes = random_codes(&mut rng, 16 * 128);
        let b = pack_marlin(&codes, 16, 128).unwrap();
        let left: Vec<u8> = codes.chunks(128).flat_map(|r| &r[..64]).copied().collect();
        let right: Vec<u8> = codes.chunks(128).flat_map(|r| &r[64..]).copied().collect();
        assert_eq!(b[..128], pack_marlin(&left, 16, 64).unwrap());
        assert_eq!(b[128..], pack_marlin(&right, 16, 64).unwrap());
    }

    #[test]
    fn index_formula_matches_perm_table_method() {
        let mut rng = SplitMix64::new(11);
        for (k, n) in SHAPES {
            let codes = random_codes(&mut rng, k * n);
            assert_eq!(
                pack_marlin(&codes, k, n).unwrap(),
                pack_marlin_with_perm_table(&codes, k, n),
                "K={k} N={n}"
            );
        }
    }

    #[test]
    fn pack_unpack_round_trip() {
        let mut rng = SplitMix64::new(12);
        for (k, n) in SHAPES.into_iter().chain([(128, 64), (512, 320)]) {
            let codes = random_codes(&mut rng, k * n);
            let b = pack_marlin(&codes, k, n).unwrap();
            assert_eq!(b.len(), k / 16 * 2 * n);
            assert_eq!(unpack_marlin(&b, k, n).unwrap(), codes, "K={k} N={n}");
        }
    }

    #[test]
    fn pack_refuses_bad_shapes_and_codes() {
        let err = pack_marlin(&[0; 8 * 64], 8, 64).unwrap_err().to_string();
        assert!(err.contains("K = 8"), "{err}");
        let err = pack_marlin(&[0; 16 * 32], 16, 32).unwrap_err().to_string();
        assert!(err.contains("N = 32"), "{err}");
        let err = pack_marlin(&one_hot(16, 64, 2, 3, 16), 16, 64)
            .unwrap_err()
            .to_string();
        assert!(err.contains("code 16 at [k=2, n=3]"), "{err}");
        let err = unpack_marlin(&[0; 127], 16, 64).unwrap_err().to_string();
        assert!(err.contains("got 127"), "{err}");
    }

    #[test]
    fn scale_permutation_round_trips_grouped_and_single() {
        let mut rng = SplitMix64::new(21);
        for (groups, n) in [(4, 128), (2, 64), (1, 192), (1, 64)] {
            let scales: Vec<f16> = (0..groups * n)
                .map(|_| f16::from_f32(rng.below(1000) as f32 / 997.0))
                .collect();
            let permuted = permute_scales(&scales, groups, n).unwrap();
            assert_ne!(permuted, scales);
            assert_eq!(unpermute_scales(&permuted, groups, n).unwrap(), scales);
        }
    }

    #[test]
    fn scale_permutation_known_order() {
        let ramp: Vec<usize> = (0..128).collect();
        let grouped = permute_scales(&ramp, 2, 64).unwrap();
        assert_eq!(grouped[..64], MARLIN_SCALE_PERM);
        assert!(grouped[64..]
            .iter()
            .zip(MARLIN_SCALE_PERM)
            .all(|(&v, p)| v == 64 + p));
        let single = permute_scales(&ramp[..64], 1, 64).unwrap();
        assert_eq!(single[..32], MARLIN_SCALE_PERM_SINGLE);
        assert_eq!(single[32..36], [32, 33, 40, 41]);
        let err = permute_scales(&ramp[..96], 2, 48).unwrap_err().to_string();
        assert!(err.contains("N = 48"), "{err}");
    }

    #[test]
    fn sort_indices_are_a_stable_argsort() {
        assert_eq!(marlin_sort_indices(&[0, 0, 1, 1]), [0, 1, 2, 3]);
        assert_eq!(marlin_sort_indices(&[1, 0, 1, 0, 2]), [1, 3, 0, 2, 4]);
    }

    #[test]
    fn trivial_act_order_keeps_rows_in_place() {
        let mut rng = SplitMix64::new(31);
        let (k, n) = (256, 128);
        let codes = random_codes(&mut rng, k * n);
        let qweight = pack_qweight(&codes, k, n, 4).unwrap();
        let g_idx: Vec<i32> = (0..k).map(|row| (row / 128) as i32).collect();
        let marlin = gptq_codes_to_marlin(&qweight, &g_idx, k, n).unwrap();
        assert!(marlin
            .sort_indices
            .iter()
            .enumerate()
            .all(|(i, &row)| row as usize == i));
        assert_eq!(marlin.b, pack_marlin(&codes, k, n).unwrap());
        let back = marlin_to_gptq_codes(&marlin.b, &marlin.sort_indices, k, n).unwrap();
        assert_eq!(back, qweight);
    }

    #[test]
    fn dynamic_act_order_sorts_rows_and_round_trips() {
        let mut rng = SplitMix64::new(32);
        for (k, n, group_size) in [(256, 128, 128), (384, 64, 32), (128, 192, 64)] {
            let codes = random_codes(&mut rng, k * n);
            let qweight = pack_qweight(&codes, k, n, 4).unwrap();
            let g_idx = act_order_g_idx(&mut rng, k, group_size);
            let marlin = gptq_codes_to_marlin(&qweight, &g_idx, k, n).unwrap();

            let sorted_g_idx: Vec<i32> = marlin
                .sort_indices
                .iter()
                .map(|&row| g_idx[row as usize])
                .collect();
            assert!(sorted_g_idx.windows(2).all(|pair| pair[0] <= pair[1]));
            let sorted_codes = unpack_marlin(&marlin.b, k, n).unwrap();
            for (sorted_row, &row) in sorted_codes.chunks(n).zip(&marlin.sort_indices) {
                let row = row as usize;
                assert_eq!(sorted_row, &codes[row * n..(row + 1) * n]);
            }
            let back = marlin_to_gptq_codes(&marlin.b, &marlin.sort_indices, k, n).unwrap();
            assert_eq!(back, qweight, "K={k} N={n} g={group_size}");
        }
    }

    #[test]
    fn marlin_to_gptq_refuses_sort_indices_that_are_not_a_permutation() {
        let b = pack_marlin(&[0; 16 * 64], 16, 64).unwrap();
        let mut sort_indices: Vec<i32> = (0..16).collect();
        sort_indices[5] = 4;
        let err = marlin_to_gptq_codes(&b, &sort_indices, 16, 64)
            .unwrap_err()
            .to_string();
        assert!(err.contains("entry 5 is 4"), "{err}");
        sort_indices[5] = 16;
        assert!(marlin_to_gptq_codes(&b, &sort_indices, 16, 64).is_err());
    }

    /// A Marlin reader's dequant: unpermute scales, unpack, `(q − 8)·s[g_idx[sort[k']]]`.
    fn dequantize_marlin(
        marlin: &MarlinWeight,
        permuted_scales: &[f16],
        g_idx: &[i32],
        k: usize,
        n: usize,
    ) -> Vec<f32> {
        let groups = permuted_scales.len() / n;
        let scales = unpermute_scales(permuted_scales, groups, n).unwrap();
        let codes = unpack_marlin(&marlin.b, k, n).unwrap();
        let mut weights = vec![0f32; k * n];
        for (sorted_row, &row) in marlin.sort_indices.iter().enumerate() {
            let group = g_idx[row as usize] as usize;
            for col in 0..n {
                let q = i32::from(codes[sorted_row * n + col]);
                weights[sorted_row * n + col] = scales[group * n + col].to_f32() * (q - 8) as f32;
            }
        }
        weights
    }

    #[test]
    fn marlin_dequant_equals_gptq_dequant_of_sorted_rows() {
        let mut rng = SplitMix64::new(41);
        // (K, N, group size, dynamic act-order); group size K is per-channel (single scale perm).
        for (k, n, group_size, dynamic) in [
            (256, 128, 64, true),
            (256, 64, 128, false),
            (128, 192, 128, false),
        ] {
            let groups = k / group_size;
            let codes = random_codes(&mut rng, k * n);
            let qweight = pack_qweight(&codes, k, n, 4).unwrap();
            let qzeros = pack_qzeros(
                &vec![8u8; groups * n],
                groups,
                n,
                4,
                crate::scheme::QuantFormat::GptqV1,
            )
            .unwrap();
            let scales: Vec<f16> = (0..groups * n)
                .map(|_| f16::from_f32(1e-3 * (1 + rng.below(5000)) as f32))
                .collect();
            let scales_f32: Vec<f32> = scales.iter().map(|s| s.to_f32()).collect();
            let g_idx: Vec<i32> = if dynamic {
                act_order_g_idx(&mut rng, k, group_size)
            } else {
                (0..k).map(|row| (row / group_size) as i32).collect()
            };
            let gptq = dequantize_gptq(&GptqTensors {
                qweight: &qweight,
                qzeros: &qzeros,
                scales: &scales_f32,
                g_idx: &g_idx,
                k,
                n,
                bits: 4,
                format: crate::scheme::QuantFormat::GptqV1,
            })
            .unwrap();

            let marlin = gptq_codes_to_marlin(&qweight, &g_idx, k, n).unwrap();
            let permuted_scales = permute_scales(&scales, groups, n).unwrap();
            let dequantized = dequantize_marlin(&marlin, &permuted_scales, &g_idx, k, n);
            for (sorted_row, &row) in marlin.sort_indices.iter().enumerate() {
                let row = row as usize;
                let marlin_row = &dequantized[sorted_row * n..(sorted_row + 1) * n];
                let gptq_row = &gptq[row * n..(row + 1) * n];
                assert!(
                    marlin_row
                        .iter()
                        .zip(gptq_row)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "K={k} N={n} g={group_size}: Marlin row {sorted_row} != GPTQ row {row}"
                );
            }
        }
    }

    #[test]
    fn check_marlin_shape_accepts_what_marlin_holds() {
        for g in MARLIN_GROUP_SIZES {
            let group_size = GroupSize::from_i64(g).unwrap();
            check_marlin_shape(4096, 4096, group_size, 4, true).unwrap();
        }
        check_marlin_shape(128, 64, GroupSize::G128, 4, true).unwrap();
    }

    #[test]
    fn check_marlin_shape_refusals() {
        let refusal = |k, n, g: i64, bits, sym| {
            check_marlin_shape(k, n, GroupSize::from_i64(g).unwrap(), bits, sym)
                .unwrap_err()
                .to_string()
        };
        let err = refusal(4096, 4096, 128, 4, false);
        assert!(err.contains("asymmetric"), "{err}");
        let err = refusal(4096, 4096, 128, 8, true);
        assert!(err.contains("bits = 8"), "{err}");
        let err = refusal(4096, 4096, 256, 4, true);
        assert!(err.contains("group size 256"), "{err}");
        let err = refusal(4160, 4096, 64, 4, true);
        assert!(
            err.contains("K (in_features) = 4160 is not a positive multiple of 128"),
            "{err}"
        );
        let err = refusal(4128, 4096, 64, 4, true);
        assert!(
            err.contains("K (in_features) = 4128 is not a multiple of the group size 64"),
            "{err}"
        );
        let err = refusal(4096, 4000, 128, 4, true);
        assert!(
            err.contains("N (out_features) = 4000 is not a positive multiple of 64"),
            "{err}"
        );
        // Every reason at once, so the user fixes them in one go.
        let err = refusal(100, 10, 7, 3, false);
        assert_eq!(err.matches("; ").count(), 5, "{err}");
    }
}
