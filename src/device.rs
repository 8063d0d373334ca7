//! `--device`: the one parsed form of the option ([`DeviceSpec`], checked when the command line is
//! parsed, before any download), the `--device`/`--dtype` flags every computing command takes
//! ([`DeviceArgs`]), and how devices are named to users ([`label`]).
use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

/// A `--device` value: `auto`, `cpu`, `cuda` (GPU 0) or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The first GPU when the binary has CUDA and one is present, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        let bad = || format!("{s} is not a device: use auto, cpu, cuda or cuda:N");
        match t {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => {
                let n = t.strip_prefix("cuda:").ok_or_else(bad)?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Opens the device; a GPU that is absent, or a binary built without CUDA, is an error naming
    /// `--device` and the fix.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Auto => {
                if cfg!(feature = "cuda") {
                    if let Ok(d) = Device::new_cuda(0) {
                        return Ok(d);
                    }
                }
                Ok(Device::Cpu)
            }
            Self::Cuda(n) => {
                if !cfg!(feature = "cuda") {
                    bail!("--device {self}: this binary was built without CUDA; rebuild with `cargo build --release --features cuda` or use --device cpu");
                }
                Device::new_cuda(n)
                    .with_context(|| format!("--device {self}: no usable CUDA GPU {n}"))
            }
        }
    }
}

/// `--device` and `--dtype`, as every command that computes takes them.
#[derive(clap::Args, Clone, Debug)]
pub struct DeviceArgs {
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: DeviceSpec,
    /// Compute dtype (default: f32 on the CPU, bf16 on a GPU).
    #[arg(long, value_parser = dtype_parser())]
    pub dtype: Option<DType>,
}

impl DeviceArgs {
    /// Opens the device, and the dtype to compute in: `--dtype`, else f32 on the CPU and bf16 on
    /// a GPU.
    pub fn open(&self) -> Result<(Device, DType)> {
        let device = self.device.open()?;
        let dtype = match self.dtype {
            Some(d) => d,
            None if device.is_cpu() => DType::F32,
            None => DType::BF16,
        };
        Ok((device, dtype))
    }
}

/// `--dtype`: f32 or bf16.
fn dtype_parser() -> impl clap::builder::TypedValueParser<Value = DType> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(["f32", "bf16"]).map(|s| match s.as_str() {
        "f32" => DType::F32,
        _ => DType::BF16,
    })
}

/// How a device is named to users: `cpu`, `cuda:N` (N the GPU ordinal, as `--device` takes it).
pub fn label(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_as_the_option_takes_them() {
        for (s, spec) in [
            ("auto", DeviceSpec::Auto),
            ("cpu", DeviceSpec::Cpu),
            ("cuda:0", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap(), spec);
            assert_eq!(spec.to_string(), s);
        }
        assert_eq!(" cuda ".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        for bad in ["gpu", "tpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1:2", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains("use auto, cpu, cuda or cuda:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn devices_are_named_as_the_option_takes_them() {
        let cpu = DeviceSpec::Cpu.open().unwrap();
        assert_eq!(label(&cpu), "cpu");
        if !cfg!(feature = "cuda") {
            // Without CUDA `auto` is the CPU and `cuda:N` is refused, naming the option.
            assert_eq!(label(&DeviceSpec::Auto.open().unwrap()), "cpu");
            let e = DeviceSpec::Cuda(1).open().unwrap_err().to_string();
            assert!(e.contains("--device cuda:1"), "{e}");
        }
    }
}
