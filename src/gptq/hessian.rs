//! Hessian accumulation (docs/algorithm.md, Hessian accumulation): the raw sum `Σ x xᵀ` of a
//! Linear's inputs in f32, plus the number of tokens it covers. The GPTQ Hessian is
//! `H = (2/n)·Σ x xᵀ`; only the raw sum and `n` are stored, so partial accumulators (per device,
//! per calibration shard, or saved to disk for `--save-hessians`/`--resume`) add up exactly.

use std::collections::HashMap;
use std::path::Path;

use crate::checkpoint::{Checkpoint, Dtype};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

/// Rows converted to f32 at a time: bounds the f32 copy of a bf16 batch (4096 × 16384 × 4 B = 256 MiB)
/// while keeping each `XᵀX` a large GEMM.
const CHUNK_ROWS: usize = 4096;

/// Name of the raw-sum tensor and metadata keys in a saved Hessian file.
const XTX_NAME: &str = "xtx";
const META_FORMAT: &str = "format";
const FORMAT_NAME: &str = "soar-gptq-hessian";
const META_TOKENS: &str = "tokens";
const META_MODULES: &str = "modules";

/// Accumulates `Σ xᵀx` (f32, `[K, K]`, on one device) over batches of a Linear's inputs; for
/// GPTAQ also the cross sum `Σ (x_fp − x)ᵀ x` of the full-precision model's inputs against them
/// (docs/algorithm.md, GPTAQ).
#[derive(Debug)]
pub struct HessianAccumulator {
    xtx: Tensor,
    /// Whether `xtx` holds only the blocks on and above the diagonal (the GPU's in-place
    /// accumulation; [`full_xtx`](Self::full_xtx) mirrors the rest).
    upper_blocks: bool,
    /// `Σ_t (x_fp − x)[t, a] · x[t, b]` at `[a, b]`, once [`add_pair`](Self::add_pair) fed it.
    cross: Option<Tensor>,
    tokens: u64,
    modules: Vec<String>,
}

/// A deep copy: the GPU accumulates into `xtx`'s storage in place, so two accumulators never
/// share it.
impl Clone for HessianAccumulator {
    fn clone(&self) -> Self {
        Self {
            xtx: self.xtx.copy().expect("copying a [K, K] accumulator"),
            upper_blocks: self.upper_blocks,
            cross: self.cross.clone(),
            tokens: self.tokens,
            modules: self.modules.clone(),
        }
    }
}

impl HessianAccumulator {
    /// An empty accumulator for inputs with `k` features, kept on `device`.
    pub fn new(k: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            xtx: Tensor::zeros((k, k), DType::F32, device)?,
            upper_blocks: false,
            cross: None,
            tokens: 0,
            modules: Vec::new(),
        })
    }

    /// Input features K.
    pub fn k(&self) -> usize {
        self.xtx.dim(0).expect("xtx is [K, K]")
    }

    /// Tokens accumulated so far (masked rows excluded).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    pub fn device(&self) -> &Device {
        self.xtx.device()
    }

    /// The modules whose input this Hessian describes (e.g. q/k/v/o_gate share one).
    pub fn module_names(&self) -> &[String] {
        &self.modules
    }

    pub fn set_module_names(&mut self, names: Vec<String>) {
        self.modules = names;
    }

    /// Adds the rows of `x` (`[tokens, K]`, or `[.., tokens, K]` which is flattened; any float dtype).
    /// `mask` (`[tokens]`, any dtype, nonzero = keep) drops padded tokens: they neither enter the sum
    /// nor the token count.
    pub fn add_batch(&mut self, x: &Tensor, mask: Option<&Tensor>) -> Result<()> {
        let k = self.k();
        if x.rank() < 2 || x.dims()[x.rank() - 1] != k {
            bail!(
                "Hessian input must be [tokens, {k}], got shape {:?}",
                x.dims()
            );
        }
        let x = x.flatten_to(x.rank() - 2)?;
        let rows = x.dim(0)?;
        let x = match mask {
            None => x,
            Some(mask) => {
                let keep = mask.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                if keep.len() != rows {
                    bail!(
                        "Hessian mask has {} entries for {rows} input rows",
                        keep.len()
                    );
                }
                let kept: Vec<u32> = (0..rows as u32)
                    .filter(|&i| keep[i as usize] != 0.0)
                    .collect();
                if kept.len() == rows {
                    x
                } else {
                    let idx = Tensor::new(kept.as_slice(), x.device())?;
                    x.index_select(&idx, 0)?
                }
            }
        };
        let rows = x.dim(0)?;
        let x = x.to_device(self.xtx.device())?;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16) {
            // Tensor cores with f32 accumulation (docs/decisions.md, Precision).
            // Only the blocks on and above the diagonal, in place (`full_xtx` mirrors them).
            crate::kernels::xtx::xtx_add_upper(&self.xtx, &x)?;
            self.upper_blocks = true;
            self.tokens += rows as u64;
            return Ok(());
        }
        let mut start = 0;
        while start < rows {
            let len = CHUNK_ROWS.min(rows - start);
            // Cast before the product: bf16/f16 products would lose the f32 precision the
            // Hessian needs (docs/algorithm.md, Hessian accumulation).
            let chunk = x.narrow(0, start, len)?.to_dtype(DType::F32)?;
            self.xtx = (&self.xtx + chunk.t()?.matmul(&chunk)?)?;
            start += len;
        }
        self.tokens += rows as u64;
        Ok(())
    }

    /// GPTAQ's pair of inputs for the same tokens: `x` as the partly quantized model feeds the
    /// Linear (its Hessian, as [`add_batch`](Self::add_batch)) and `x_fp` as the full-precision
    /// model does (`[tokens, K]` each, or `[.., tokens, K]`). Adds `Σ (x_fp − x)ᵀ x` to the cross
    /// sum; the difference is taken in f32, before the product.
    pub fn add_pair(&mut self, x: &Tensor, x_fp: &Tensor) -> Result<()> {
        let k = self.k();
        if x.dims() != x_fp.dims() {
            bail!(
                "GPTAQ input pair differs in shape: quantized-model input {:?}, full-precision \
                 input {:?}",
                x.dims(),
                x_fp.dims()
            );
        }
        self.add_batch(x, None)?;
        let x = x.flatten_to(x.rank() - 2)?.to_device(self.xtx.device())?;
        let x_fp = x_fp
            .flatten_to(x_fp.rank() - 2)?
            .to_device(self.xtx.device())?;
        let rows = x.dim(0)?;
        let mut cross = match self.cross.take() {
            Some(c) => c,
            None => Tensor::zeros((k, k), DType::F32, self.xtx.device())?,
        };
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16) {
            // The difference in f32, then both operands in the input dtype on tensor cores with
            // f32 accumulation, like XᵀX.
            let d = (x_fp.to_dtype(DType::F32)? - x.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
            self.cross = Some(crate::kernels::xtx::atb_add(&cross, &d, &x)?);
            return Ok(());
        }
        let mut start = 0;
        while start < rows {
            let len = CHUNK_ROWS.min(rows - start);
            let a = x.narrow(0, start, len)?.to_dtype(DType::F32)?;
            let d = (x_fp.narrow(0, start, len)?.to_dtype(DType::F32)? - &a)?;
            cross = (&cross + d.t()?.matmul(&a)?)?;
            start += len;
        }
        self.cross = Some(cross);
        Ok(())
    }

    /// GPTAQ's `D = (2/n)·Σ (x_fp − x)ᵀ x`, scaled like [`hessian`](Self::hessian), or `None`
    /// when no pair was fed.
    pub fn cross_term(&self) -> Result<Option<Tensor>> {
        match &self.cross {
            None => Ok(None),
            Some(_) if self.tokens == 0 => bail!(
                "GPTAQ cross term of {} has no tokens",
                self.describe_modules()
            ),
            Some(c) => Ok(Some(c.affine(2.0 / self.tokens as f64, 0.0)?)),
        }
    }

    /// Adds another partial accumulator of the same K; module names are united, keeping order.
    pub fn merge(&mut self, other: &HessianAccumulator) -> Result<()> {
        if other.k() != self.k() {
            bail!(
                "cannot merge Hessians of different widths ({} and {})",
                self.k(),
                other.k()
            );
        }
        if self.cross.is_some() != other.cross.is_some() {
            bail!("cannot merge a GPTAQ accumulator (with a cross term) with a GPTQ one");
        }
        self.xtx = (self.full_xtx()? + other.full_xtx()?.to_device(self.xtx.device())?)?;
        self.upper_blocks = false;
        if let (Some(a), Some(b)) = (&self.cross, &other.cross) {
            self.cross = Some((a + b.to_device(self.xtx.device())?)?);
        }
        self.tokens += other.tokens;
        for name in &other.modules {
            if !self.modules.contains(name) {
                self.modules.push(name.clone());
            }
        }
        Ok(())
    }

    /// `H = (2/n)·Σ x xᵀ` as f32 `[K, K]` on the accumulator's device. The factor 2/n follows the
    /// GPTQ papers; GPTQ's result does not depend on it (damping is relative to mean(diag H)).
    pub fn hessian(&self) -> Result<Tensor> {
        if self.tokens == 0 {
            bail!(
                "Hessian of {} has no tokens (every calibration row was masked or none was fed)",
                self.describe_modules()
            );
        }
        Ok(self.full_xtx()?.affine(2.0 / self.tokens as f64, 0.0)?)
    }

    /// `Σ x xᵀ` in full: on a GPU the accumulation fills only the blocks on and above the
    /// diagonal, and the ones below are mirrored here.
    fn full_xtx(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.upper_blocks {
            return crate::kernels::xtx::mirror_upper_blocks(&self.xtx);
        }
        Ok(self.xtx.clone())
    }

    /// Writes the raw sum as safetensors (`xtx` f32 `[K, K]`; metadata `tokens` and `modules` as a
    /// JSON array), through the output guard: written to a fresh temporary file beside it and
    /// renamed, so an interrupted run leaves no torn file.
    pub fn save(&self, out: &crate::checkpoint::guard::OutputFile) -> Result<()> {
        let k = self.k();
        let values = self.full_xtx()?.flatten_all()?.to_vec1::<f32>()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![k, k], &bytes)?;
        let metadata = HashMap::from([
            (META_FORMAT.to_string(), FORMAT_NAME.to_string()),
            (META_TOKENS.to_string(), self.tokens.to_string()),
            (
                META_MODULES.to_string(),
                serde_json::to_string(&self.modules)?,
            ),
        ]);
        out.write(|tmp| {
            Ok(safetensors::serialize_to_file(
                [(XTX_NAME, view)],
                Some(metadata),
                tmp,
            )?)
        })
        .with_context(|| format!("writing Hessian file {}", out.path().display()))
    }

    /// Reads a file written by [`save`](Self::save) onto `device`, validating it.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        Self::load_inner(path, device)
            .with_context(|| format!("invalid Hessian file {}", path.display()))
    }

    /// Read through the checkpoint reader, the one safetensors parser of the tool (header,
    /// offsets and sizes checked as for model shards).
    fn load_inner(path: &Path, device: &Device) -> Result<Self> {
        let (dir, file) = match (path.parent(), path.file_name().and_then(|f| f.to_str())) {
            (Some(d), Some(f)) => (d, f.to_string()),
            _ => bail!("not a file path"),
        };
        let ck = Checkpoint::open_files(dir, &[file])?;
        let meta = &ck.shards[0].metadata;
        if meta.get(META_FORMAT).map(String::as_str) != Some(FORMAT_NAME) {
            bail!("metadata `{META_FORMAT}` is not `{FORMAT_NAME}`");
        }
        let tokens: u64 = meta
            .get(META_TOKENS)
            .context("metadata `tokens` missing")?
            .parse()
            .context("metadata `tokens` is not an unsigned integer")?;
        let modules: Vec<String> = serde_json::from_str(
            meta.get(META_MODULES)
                .context("metadata `modules` missing")?,
        )
        .context("metadata `modules` is not a JSON array of strings")?;
        let entry = ck.get(XTX_NAME).context("tensor `xtx` missing")?;
        if entry.dtype != Dtype::F32 {
            bail!("tensor `xtx` is {}, expected F32", entry.dtype.name());
        }
        let &[k, k2] = entry.shape.as_slice() else {
            bail!("tensor `xtx` has shape {:?}, expected [K, K]", entry.shape);
        };
        if k != k2 || k == 0 {
            bail!("tensor `xtx` has shape [{k}, {k2}], expected a square [K, K]");
        }
        let data = ck.bytes(XTX_NAME)?;
        if data
            .chunks_exact(4)
            .any(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
        {
            bail!("tensor `xtx` contains NaN or Inf");
        }
        let xtx =
            Tensor::from_raw_buffer(data, DType::F32, &[k, k], &Device::Cpu)?.to_device(device)?;
        Ok(Self {
            xtx,
            upper_blocks: false,
            cross: None,
            tokens,
            modules,
        })
    }

    fn describe_modules(&self) -> String {
        if self.modules.is_empty() {
            "an unnamed module".to_string()
        } else {
            self.modules.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-1, 1) for inputs.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::SplitMix64::new(seed);
        (0..n).map(|_| rng.uniform()).collect()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Σ x xᵀ computed naively in f64 from row-major values.
    fn naive_xtx(x: &[f32], k: usize) -> Vec<f64> {
        let mut out = vec![0.0; k * k];
        for row in x.chunks(k) {
            for i in 0..k {
                for j in 0..k {
                    out[i * k + j] += row[i] as f64 * row[j] as f64;
                }
            }
        }
        out
    }

    #[test]
    fn hessian_matches_naive_sum_scaled_by_two_over_n() {
        let (t, k) = (50, 12);
        let x = values(t * k, 1);
        let mut acc = HessianAccumulator::new(k, &Device::Cpu).unwrap();
        acc.add_batch(
            &Tensor::from_vec(x.clone(), (t, k), &Device::Cpu).unwrap(),
            None,
        )
        .unwrap();
        assert_eq!(acc.tokens(), t as u64);
        let h = acc
            .hessian()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (got, want) in h.iter().zip(naive_xtx(&x, k)) {
            assert!((*got as f64 - want * 2.0 / t as f64).abs() < 1e-5);
        }
    }

    #[test]
    fn merge_of_halves_equals_whole_and_masked_rows_are_skipped() {
        let (t, k) = (64, 16);
        let dev = Device::Cpu;
        let x = Tensor::from_vec(values(t * k, 2), (t, k), &dev).unwrap();
        let mut whole = HessianAccumulator::new(k, &dev).unwrap();
        whole.add_batch(&x, None).unwrap();
        let mut a = HessianAccumulator::new(k, &dev).unwrap();
        a.set_module_names(vec!["q_proj".into(), "k_proj".into()]);
        a.add_batch(&x.narrow(0, 0, 40).unwrap(), None).unwrap();
        let mut b = HessianAccumulator::new(k, &dev).unwrap();
        b.set_module_names(vec!["k_proj".into(), "v_proj".into()]);
        b.add_batch(&x.narrow(0, 40, 24).unwrap(), None).unwrap();
        a.merge(&b).unwrap();
        assert_eq!(a.tokens(), 64);
        assert_eq!(a.module_names(), ["q_proj", "k_proj", "v_proj"]);
        assert!(max_abs_diff(&a.hessian().unwrap(), &whole.hessian().unwrap()) < 1e-5);

        // A mask keeping only the first 40 rows (u8, then f32) gives the first half alone; the
        // masked rows hold huge values so including them would show.
        let junk = Tensor::full(1e3f32, (24, k), &dev).unwrap();
        let padded = Tensor::cat(&[&x.narrow(0, 0, 40).unwrap(), &junk], 0).unwrap();
        let keep: Vec<u8> = (0..64).map(|i| (i < 40) as u8).collect();
        let mut first = HessianAccumulator::new(k, &dev).unwrap();
        first.add_batch(&x.narrow(0, 0, 40).unwrap(), None).unwrap();
        for mask in [
            Tensor::new(keep.as_slice(), &dev).unwrap(),
            Tensor::new(keep.as_slice(), &dev)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        ] {
            let mut masked = HessianAccumulator::new(k, &dev).unwrap();
            masked.add_batch(&padded, Some(&mask)).unwrap();
            assert_eq!(masked.tokens(), 40);
            assert!(max_abs_diff(&masked.hessian().unwrap(), &first.hessian().unwrap()) < 1e-6);
        }
        let mut none = HessianAccumulator::new(k, &dev).unwrap();
        none.add_batch(&padded, Some(&Tensor::zeros(64, DType::U32, &dev).unwrap()))
            .unwrap();
        assert_eq!(none.tokens(), 0);
        assert!(none.hessian().is_err());
    }

    #[test]
    fn bf16_and_batched_inputs_work() {
        let (t, k) = (32, 8);
        let dev = Device::Cpu;
        let x = Tensor::from_vec(values(t * k, 3), (t, k), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let mut acc = HessianAccumulator::new(k, &dev).unwrap();
        acc.add_batch(&x, None).unwrap();
        // The same bf16 values seen as f32, fed as [2, 16, K]: identical sum.
        let x32 = x.to_dtype(DType::F32).unwrap().reshape((2, 16, k)).unwrap();
        let mut acc32 = HessianAccumulator::new(k, &dev).unwrap();
        acc32.add_batch(&x32, None).unwrap();
        assert_eq!(acc.tokens(), 32);
        assert!(max_abs_diff(&acc.hessian().unwrap(), &acc32.hessian().unwrap()) < 1e-6);
        assert!(acc
            .add_batch(&Tensor::zeros((4, k + 1), DType::F32, &dev).unwrap(), None)
            .is_err());
    }

    #[test]
    fn save_load_round_trip_and_validation() {
        let (t, k) = (20, 6);
        let dev = Device::Cpu;
        let mut acc = HessianAccumulator::new(k, &dev).unwrap();
        acc.set_module_names(vec![
            "model.layers.0.mlp.gate_proj".into(),
            "up,proj".into(),
        ]);
        acc.add_batch(
            &Tensor::from_vec(values(t * k, 4), (t, k), &dev).unwrap(),
            None,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.safetensors");
        let out = crate::checkpoint::guard::OutputFile::check("--save-hessians", &path, true, &[])
            .unwrap();
        acc.save(&out).unwrap();
        let back = HessianAccumulator::load(&path, &dev).unwrap();
        assert_eq!(back.tokens(), 20);
        assert_eq!(back.k(), k);
        assert_eq!(back.module_names(), acc.module_names());
        assert_eq!(
            max_abs_diff(&back.hessian().unwrap(), &acc.hessian().unwrap()),
            0.0
        );

        // A safetensors file without our metadata is refused with the file named.
        let other = dir.path().join("other.safetensors");
        candle_core::safetensors::save(
            &HashMap::from([(
                "xtx".to_string(),
                Tensor::zeros((k, k), DType::F32, &dev).unwrap(),
            )]),
            &other,
        )
        .unwrap();
        let err = format!("{:#}", HessianAccumulator::load(&other, &dev).unwrap_err());
        assert!(
            err.contains("other.safetensors") && err.contains("format"),
            "{err}"
        );
        let err = format!(
            "{:#}",
            HessianAccumulator::load(&dir.path().join("missing"), &dev).unwrap_err()
        );
        assert!(err.contains("missing"), "{err}");
    }

    /// GPTAQ's cross term is `(2/n)·Σ (x_fp − x)ᵀ x` at `[a, b] = Σ_t (x_fp − x)[t, a]·x[t, b]`
    /// (not its transpose), summed over batches like the Hessian; the Hessian of a pair is the
    /// quantized-model input's alone; shapes must agree; merging adds both.
    #[test]
    fn gptaq_cross_term_matches_naive_sum() {
        let (t, k) = (40, 7);
        let dev = Device::Cpu;
        let xq = values(t * k, 11);
        let xf: Vec<f32> = values(t * k, 12)
            .iter()
            .zip(&xq)
            .map(|(n, q)| q + 0.3 * n)
            .collect();
        let (a, b) = (
            Tensor::from_vec(xq.clone(), (t, k), &dev).unwrap(),
            Tensor::from_vec(xf.clone(), (t, k), &dev).unwrap(),
        );
        let mut acc = HessianAccumulator::new(k, &dev).unwrap();
        assert!(acc.cross_term().unwrap().is_none());
        acc.add_pair(&a.narrow(0, 0, 25).unwrap(), &b.narrow(0, 0, 25).unwrap())
            .unwrap();
        let mut rest = HessianAccumulator::new(k, &dev).unwrap();
        rest.add_pair(&a.narrow(0, 25, 15).unwrap(), &b.narrow(0, 25, 15).unwrap())
            .unwrap();
        acc.merge(&rest).unwrap();
        assert_eq!(acc.tokens(), t as u64);
        let d = acc
            .cross_term()
            .unwrap()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for i in 0..k {
            for j in 0..k {
                let want: f64 = (0..t)
                    .map(|r| (xf[r * k + i] - xq[r * k + i]) as f64 * xq[r * k + j] as f64)
                    .sum::<f64>()
                    * 2.0
                    / t as f64;
                assert!((d[i * k + j] as f64 - want).abs() < 1e-5, "[{i}, {j}]");
            }
        }
        let mut plain = HessianAccumulator::new(k, &dev).unwrap();
        plain.add_batch(&a, None).unwrap();
        assert!(max_abs_diff(&plain.hessian().unwrap(), &acc.hessian().unwrap()) < 1e-6);
        assert!(acc.merge(&plain).is_err(), "GPTAQ and GPTQ sums do not mix");
        assert!(acc
            .add_pair(&a, &b.narrow(0, 0, 39).unwrap())
            .unwrap_err()
            .to_string()
            .contains("differs in shape"));
    }
}
