//! The vocabulary of a quantization scheme, one type per concept, shared from the command line to
//! the solver, the formats, the config writer and the readers:
//!
//! * [`Bits`]: bits per weight of a GPTQ code (`--bits`, `bits` in the config and plan rules);
//! * [`GroupSize`]: columns sharing one scale/zero (`--group-size`, `group_size` in the config);
//! * [`ActOrder`]: the column order of the solve (`--act-order`, `desc_act`/`static_groups`);
//! * [`QuantFormat`]: the on-disk layout (`checkpoint_format`: GPTQ v1, v2 or Marlin).
//!
//! Each is parsed once where it enters (a flag or a config key) and carried in this form.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use serde::{Serialize, Serializer};

/// Bits per weight of a GPTQ code: 2, 3, 4 or 8, what the GPTQ format this tool writes packs
/// (whole codes in 32-bit words, or 3-bit codes across word pairs); Marlin serves 4 and 8.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bits(u8);

impl Bits {
    /// Every width the writer packs.
    pub const ALL: [Bits; 4] = [Bits(2), Bits(3), Bits(4), Bits(8)];
    /// The project default (W4A16).
    pub const B4: Self = Self(4);
    /// The 8-bit width (`sensitivity`'s upgrade, what `gptq_marlin` serves besides 4).
    pub const B8: Self = Self(8);

    /// `bits` when the writer packs it.
    pub fn new(bits: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.0 == bits)
    }

    pub fn get(self) -> u8 {
        self.0
    }
}

impl fmt::Display for Bits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for Bits {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.parse::<u8>().ok().and_then(Self::new).ok_or_else(|| {
            format!("{s} cannot be packed in the GPTQ format this tool writes: use 2, 3, 4 or 8")
        })
    }
}

impl Serialize for Bits {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.0)
    }
}

/// Columns (input features) that share one scale/zero per output row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupSize {
    /// One group over all of K (`-1` in flags and configs): per output row.
    PerRow,
    /// Groups of this many columns; a last partial group counts as one.
    Columns(NonZeroU32),
}

impl GroupSize {
    /// The project default: 128 columns (what `gptq_marlin` serves).
    pub const G128: Self = Self::Columns(NonZeroU32::new(128).unwrap());

    /// From the integer spelling of flags and configs: `-1` or a positive count that fits the
    /// engines' 32-bit field.
    pub fn from_i64(v: i64) -> Option<Self> {
        match v {
            -1 => Some(Self::PerRow),
            v if v > 0 && v <= i64::from(i32::MAX) => NonZeroU32::new(v as u32).map(Self::Columns),
            _ => None,
        }
    }

    /// The integer spelling: `-1` or the column count.
    pub fn to_i64(self) -> i64 {
        match self {
            Self::PerRow => -1,
            Self::Columns(n) => i64::from(n.get()),
        }
    }

    /// The column count of a fixed size, `None` for one group per row.
    pub fn columns(self) -> Option<usize> {
        match self {
            Self::PerRow => None,
            Self::Columns(n) => Some(n.get() as usize),
        }
    }

    /// Columns per group in a matrix with `k` input columns (`k` itself for one group per row).
    pub fn len(self, k: usize) -> usize {
        self.columns().unwrap_or(k)
    }

    /// Groups over `k` columns; a last partial group counts as one (the reference tools' ceil).
    pub fn count(self, k: usize) -> usize {
        k.div_ceil(self.len(k).max(1))
    }

    /// Whether `k` columns split into whole groups (always true for one group per row).
    pub fn divides(self, k: usize) -> bool {
        k.is_multiple_of(self.len(k).max(1))
    }
}

impl fmt::Display for GroupSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_i64())
    }
}

impl FromStr for GroupSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.trim()
            .parse::<i64>()
            .ok()
            .and_then(Self::from_i64)
            .ok_or_else(|| format!("{s} is not a group size: use -1 (one group per row) or a positive number of columns"))
    }
}

impl Serialize for GroupSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i64(self.to_i64())
    }
}

/// The precision of the Cholesky factorization and triangular inverse of each Hessian
/// (`--factor-precision`; docs/algorithm.md, Preprocessing of H): f64 where the device runs it
/// at a useful rate, f32 on cards whose FP64 rate is a small fraction of their FP32 rate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FactorPrecision {
    /// f64 on the CPU and on GPUs with at least 1/8 of their FP32 rate in FP64 (A100, H100,
    /// H200, B200), f32 on the others (RTX and workstation cards, L40S).
    #[default]
    Auto,
    F64,
    F32,
}

impl FactorPrecision {
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::F64 => "f64",
            Self::F32 => "f32",
        }
    }
}

/// Column order of the solve (docs/decisions.md, Static act-order by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum ActOrder {
    /// Descending diag(H) order, group parameters fixed per original group before the loop
    /// (`desc_act` + `static_groups`): `g_idx[k] = k / g`, nothing extra on disk.
    #[default]
    Static,
    /// Classic `desc_act`: descending diag(H) order, parameters found when a group of processing
    /// positions starts: `g_idx[j] = invperm[j] / g`.
    Dynamic,
    /// Natural column order.
    Off,
}

impl ActOrder {
    /// The name `--act-order` takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Dynamic => "dynamic",
            Self::Off => "off",
        }
    }

    /// Whether columns are processed in descending diag(H) order.
    pub fn sorts(self) -> bool {
        self != Self::Off
    }

    /// The config's `desc_act`: whether `g_idx` is permuted (only dynamic act-order stores one).
    pub fn desc_act(self) -> bool {
        self == Self::Dynamic
    }

    /// The config's `static_groups`.
    pub fn static_groups(self) -> bool {
        self == Self::Static
    }
}

impl fmt::Display for ActOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for ActOrder {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// The on-disk layout of the quantized tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantFormat {
    /// `checkpoint_format: "gptq"` (the default): `qzeros` store `zero − 1`.
    GptqV1,
    /// `checkpoint_format: "gptq_v2"`: `qzeros` store the zero itself.
    GptqV2,
    /// Legacy Marlin tiles `B` and permuted scales `s`.
    Marlin,
}

impl QuantFormat {
    /// The `checkpoint_format` value of this layout.
    pub fn checkpoint_format(self) -> &'static str {
        match self {
            Self::GptqV1 => "gptq",
            Self::GptqV2 => "gptq_v2",
            Self::Marlin => "marlin",
        }
    }

    /// Whether `qzeros` store `zero − 1` (GPTQ v1's convention).
    pub fn zeros_minus_one(self) -> bool {
        self == Self::GptqV1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_sizes_round_trip_their_integer_spelling() {
        for v in [-1i64, 1, 32, 128, 4096] {
            let g = GroupSize::from_i64(v).unwrap();
            assert_eq!(g.to_i64(), v);
            assert_eq!(g.to_string().parse::<GroupSize>().unwrap(), g);
            assert_eq!(serde_json::to_value(g).unwrap(), serde_json::json!(v));
        }
        for v in [0i64, -2, i64::MIN, 1 << 40] {
            assert_eq!(GroupSize::from_i64(v), None, "{v}");
        }
        for s in ["0", "-2", "x", "", "1.5"] {
            let e = s.parse::<GroupSize>().unwrap_err();
            assert!(e.contains("use -1 (one group per row)"), "{s}: {e}");
        }
    }

    #[test]
    fn bits_are_the_packed_widths() {
        for b in [2u8, 3, 4, 8] {
            let bits = Bits::new(b).unwrap();
            assert_eq!(bits.get(), b);
            assert_eq!(bits.to_string().parse::<Bits>().unwrap(), bits);
            assert_eq!(serde_json::to_value(bits).unwrap(), serde_json::json!(b));
        }
        for b in [0u8, 1, 5, 6, 7, 16] {
            assert_eq!(Bits::new(b), None, "{b}");
        }
        for s in ["5", "four", "", "-4", "4.0"] {
            let e = s.parse::<Bits>().unwrap_err();
            assert!(e.contains("use 2, 3, 4 or 8"), "{s}: {e}");
        }
    }

    #[test]
    fn group_count_is_the_ceiling_and_per_row_is_one_group() {
        assert_eq!(GroupSize::G128.len(4096), 128);
        assert_eq!(GroupSize::G128.count(4096), 32);
        assert_eq!(GroupSize::G128.count(4097), 33);
        assert_eq!(GroupSize::G128.count(100), 1);
        assert!(GroupSize::G128.divides(256) && !GroupSize::G128.divides(200));
        assert_eq!(GroupSize::PerRow.len(576), 576);
        assert_eq!(GroupSize::PerRow.count(576), 1);
        assert!(GroupSize::PerRow.divides(577));
    }

    #[test]
    fn act_order_names_and_config_flags() {
        let all = [ActOrder::Static, ActOrder::Dynamic, ActOrder::Off];
        let names: Vec<_> = all.iter().map(|a| a.to_string()).collect();
        assert_eq!(names, ["static", "dynamic", "off"]);
        let flags: Vec<_> = all
            .iter()
            .map(|a| (a.desc_act(), a.static_groups()))
            .collect();
        assert_eq!(flags, [(false, true), (true, false), (false, false)]);
        assert_eq!(QuantFormat::GptqV1.checkpoint_format(), "gptq");
        assert!(QuantFormat::GptqV1.zeros_minus_one() && !QuantFormat::GptqV2.zeros_minus_one());
    }
}
