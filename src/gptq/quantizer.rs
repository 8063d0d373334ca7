//! The uniform quantizer GPTQ uses (docs/algorithm.md, The quantizer): per output row, over one
//! group of columns, a min/max range that always contains 0, optionally shrunk by an MSE grid
//! search. Everything is f32 and rounds half to even, like `torch.round`, so codes match the Python
//! tools bit for bit.

use std::ops::Range;

use anyhow::{bail, Result};
use rayon::prelude::*;

use crate::scheme::GroupSize;

/// Grid search of the MSE option (IST `quant.py` defaults): shrink factors `1 - i/GRID` for
/// `i < MAX_SHRINK·GRID`, error measured as `Σ|q - x|^NORM`.
const MSE_GRID: usize = 100;
const MSE_MAX_SHRINK: f64 = 0.8;
const MSE_NORM: f32 = 2.4;

/// How weights are quantized: bit width, columns per group, symmetric or not, MSE range search or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantParams {
    /// Bits per weight, 2..=8.
    pub bits: u8,
    /// Columns (input features) sharing one scale/zero per output row.
    pub group_size: GroupSize,
    /// Symmetric: zero fixed at (maxq+1)/2 and the range centred on 0.
    pub sym: bool,
    /// Shrink the min/max range by the MSE grid search (docs/algorithm.md, The quantizer;
    /// unweighted by H).
    pub mse: bool,
}

impl Default for QuantParams {
    /// The project default: 4-bit symmetric, group 128 (what `gptq_marlin` serves).
    fn default() -> Self {
        Self {
            bits: 4,
            group_size: GroupSize::G128,
            sym: true,
            mse: false,
        }
    }
}

impl QuantParams {
    pub fn validate(&self) -> Result<()> {
        if !(2..=8).contains(&self.bits) {
            bail!("bits must be in 2..=8, got {}", self.bits);
        }
        Ok(())
    }

    /// Largest code, `2^bits - 1`, as f32 because the quantizer computes in f32.
    pub fn maxq(&self) -> f32 {
        ((1u32 << self.bits) - 1) as f32
    }

    /// Scale and zero of every row of `w` (row-major, `row_len` columns per row) over the columns
    /// `cols`, as `(scale, zero)` with one entry per row. Zeros are integral f32 values.
    pub fn find_params(
        &self,
        w: &[f32],
        row_len: usize,
        cols: Range<usize>,
    ) -> (Vec<f32>, Vec<f32>) {
        w.par_chunks(row_len)
            .map(|row| self.find_row_params(&row[cols.clone()]))
            .unzip()
    }

    /// Scale and zero of one row over one group of values `x` (docs/algorithm.md, The quantizer,
    /// incl. the sym quirks).
    pub fn find_row_params(&self, x: &[f32]) -> (f32, f32) {
        let maxq = self.maxq();
        let mut xmin = x.iter().copied().fold(0.0f32, f32::min);
        let mut xmax = x.iter().copied().fold(0.0f32, f32::max);
        if self.sym {
            xmax = xmax.max(xmin.abs());
            // Only a negative minimum is mirrored: an all-nonnegative row keeps xmin = 0, so its
            // scale is xmax/maxq and the top half of its range is clipped (reference behaviour).
            if xmin < 0.0 {
                xmin = -xmax;
            }
        }
        if xmin == 0.0 && xmax == 0.0 {
            xmin = -1.0;
            xmax = 1.0;
        }
        let sym_zero = (maxq + 1.0) / 2.0;
        let range_params = |lo: f32, hi: f32| {
            let scale = (hi - lo) / maxq;
            let zero = if self.sym {
                sym_zero
            } else {
                (-lo / scale).round_ties_even()
            };
            (scale, zero)
        };
        let mut best = range_params(xmin, xmax);
        if self.mse {
            let mut best_err = f32::INFINITY;
            for i in 0..(MSE_MAX_SHRINK * MSE_GRID as f64) as usize {
                let p = (1.0 - i as f64 / MSE_GRID as f64) as f32;
                let (scale, zero) = range_params(p * xmin, p * xmax);
                if let Some(err) = group_error_below(x, scale, zero, maxq, best_err) {
                    best_err = err;
                    best = (scale, zero);
                }
            }
        }
        best
    }
}

/// The MSE search's error of one group at `(scale, zero)`, the sum of
/// `|dequant(quant(v)) - v|^MSE_NORM` in order, if it is below `bound`. The sum stops as soon as it reaches `bound`: its terms are
/// never negative and rounding is monotone, so a partial sum at or above `bound` means the whole
/// sum is too, and the answer is the one the full sum gives.
fn group_error_below(x: &[f32], scale: f32, zero: f32, maxq: f32, bound: f32) -> Option<f32> {
    let mut err = 0.0f32;
    for &v in x {
        let q = dequantize_code(quantize_code(v, scale, zero, maxq), scale, zero);
        err += (q - v).abs().powf(MSE_NORM);
        if err >= bound {
            return None;
        }
    }
    // NaN never counts as below.
    (err < bound).then_some(err)
}

/// The stored integer code of `w`: `clamp(round(w / scale) + zero, 0, maxq)`, returned as f32.
#[inline]
pub fn quantize_code(w: f32, scale: f32, zero: f32, maxq: f32) -> f32 {
    ((w / scale).round_ties_even() + zero).clamp(0.0, maxq)
}

/// The value a code stands for: `scale · (code − zero)`.
#[inline]
pub fn dequantize_code(code: f32, scale: f32, zero: f32) -> f32 {
    scale * (code - zero)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sym4() -> QuantParams {
        QuantParams::default()
    }

    #[test]
    fn sym_range_is_mirrored_and_zero_is_eight() {
        // amax 7.5 makes the scale exactly 1, so the expected codes are exact.
        let (s, z) = sym4().find_row_params(&[-7.5, 3.0, 0.25]);
        assert_eq!((s, z), (1.0, 8.0));
        // -7.5 rounds to -8 (half to even): the negative end is representable; +7.5 clips at 7.
        assert_eq!(quantize_code(-7.5, s, z, 15.0), 0.0);
        assert_eq!(quantize_code(7.5, s, z, 15.0), 15.0);
        assert_eq!(dequantize_code(15.0, s, z), 7.0);
        let (s, _) = sym4().find_row_params(&[-1.0, 0.5]);
        assert_eq!(s, 2.0 / 15.0);
    }

    #[test]
    fn sym_all_nonnegative_row_keeps_xmin_zero_and_clips() {
        let (s, z) = sym4().find_row_params(&[0.5, 1.0]);
        assert_eq!(s, 1.0 / 15.0);
        assert_eq!(z, 8.0);
        let code = quantize_code(1.0, s, z, 15.0);
        assert_eq!(code, 15.0);
        assert_eq!(dequantize_code(code, s, z), 7.0 * s);
    }

    #[test]
    fn all_zero_row_uses_unit_range() {
        let (s, z) = sym4().find_row_params(&[0.0; 4]);
        assert_eq!((s, z), (2.0 / 15.0, 8.0));
        let asym = QuantParams {
            sym: false,
            ..sym4()
        };
        let (s, z) = asym.find_row_params(&[0.0; 4]);
        assert_eq!(s, 2.0 / 15.0);
        assert_eq!(z, (1.0f32 / (2.0 / 15.0)).round_ties_even());
    }

    #[test]
    fn asym_zero_is_rounded_offset() {
        let asym = QuantParams {
            sym: false,
            ..sym4()
        };
        let (s, z) = asym.find_row_params(&[-1.0, 3.0]);
        assert_eq!(s, 4.0 / 15.0);
        assert_eq!(z, 4.0); // round(3.75)
                            // Positive-only row: xmin is pinned at 0, so the zero is 0.
        let (s, z) = asym.find_row_params(&[1.0, 3.0]);
        assert_eq!((s, z), (3.0 / 15.0, 0.0));
    }

    #[test]
    fn rounding_is_half_to_even() {
        // amax 7.5 gives scale exactly 1.0, so w/scale is exact.
        let (s, z) = sym4().find_row_params(&[-7.5, 2.5]);
        assert_eq!(s, 1.0);
        assert_eq!(quantize_code(2.5, s, z, 15.0), 10.0); // 2.5 -> 2, +8
        assert_eq!(quantize_code(3.5, s, z, 15.0), 12.0); // 3.5 -> 4, +8
        assert_eq!(quantize_code(-0.5, s, z, 15.0), 8.0); // -0.5 -> -0, +8
    }

    #[test]
    fn codes_stay_in_range_for_all_widths() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 20.0) * 0.13)
            .collect();
        for bits in 2..=8u8 {
            for sym in [true, false] {
                for mse in [false, true] {
                    let q = QuantParams {
                        bits,
                        group_size: GroupSize::from_i64(64).unwrap(),
                        sym,
                        mse,
                    };
                    let maxq = q.maxq();
                    assert_eq!(maxq, ((1u32 << bits) - 1) as f32);
                    let (s, z) = q.find_row_params(&x);
                    assert!(s > 0.0 && (0.0..=maxq).contains(&z) && z.fract() == 0.0);
                    for &v in &x {
                        let c = quantize_code(v, s, z, maxq);
                        assert!((0.0..=maxq).contains(&c) && c.fract() == 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn mse_search_clips_bell_shaped_rows() {
        // Bell-shaped values (sum of uniforms): clipping the rare tails lowers Σ|q-x|^2.4, so the
        // search must pick a smaller scale than min/max and a lower error.
        let mut rng = crate::rng::SplitMix64::new(7);
        let mut uniform = || rng.uniform() / 2.0;
        let x: Vec<f32> = (0..128)
            .map(|_| (0..4).map(|_| uniform()).sum::<f32>())
            .collect();
        let err = |q: &QuantParams| {
            let (s, z) = q.find_row_params(&x);
            let e: f32 = x
                .iter()
                .map(|&v| {
                    (dequantize_code(quantize_code(v, s, z, q.maxq()), s, z) - v)
                        .abs()
                        .powf(MSE_NORM)
                })
                .sum();
            (s, e)
        };
        for sym in [true, false] {
            let plain = QuantParams { sym, ..sym4() };
            let mse = QuantParams { mse: true, ..plain };
            let (s0, e0) = err(&plain);
            let (s1, e1) = err(&mse);
            assert!(s1 < s0, "sym={sym}: mse should shrink the scale");
            assert!(e1 < e0, "sym={sym}: {e1} !< {e0}");
        }
    }

    #[test]
    fn find_params_works_per_row_over_a_column_range() {
        // Column 2 is outside the range; row 1 is all nonnegative there, so its xmin stays 0.
        let w = [1.0, -2.0, 100.0, 4.0, 0.5, -100.0];
        let q = sym4();
        let (s, z) = q.find_params(&w, 3, 0..2);
        assert_eq!(s, vec![4.0 / 15.0, 4.0 / 15.0]);
        assert_eq!(z, vec![8.0, 8.0]);
    }

    #[test]
    fn validation_rejects_bad_settings() {
        assert!(QuantParams { bits: 1, ..sym4() }.validate().is_err());
        assert!(QuantParams { bits: 9, ..sym4() }.validate().is_err());
        assert!(QuantParams {
            group_size: GroupSize::PerRow,
            ..sym4()
        }
        .validate()
        .is_ok());
    }
}
