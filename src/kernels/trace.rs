//! `SOAR_GPTQ_TRACE`: phase timings on stderr, the stream synchronized at every lap.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use cudarc::driver::CudaStream;

/// Phase timings of the factorization and the solve on stderr when `SOAR_GPTQ_TRACE=1` (a
/// diagnostic for the benchmark; synchronizes the stream at every lap). `SOAR_GPTQ_TRACE=2`
/// also splits the column loop into its in-block kernels and lazy-update GEMMs, synchronizing
/// around every launch (which slows the loop itself).
pub struct Trace<'a> {
    on: bool,
    split: bool,
    stream: &'a Arc<CudaStream>,
    k: usize,
    t: Instant,
}

impl<'a> Trace<'a> {
    pub fn new(stream: &'a Arc<CudaStream>, k: usize) -> Self {
        let level = std::env::var("SOAR_GPTQ_TRACE").unwrap_or_default();
        Self {
            on: level == "1" || level == "2",
            split: level == "2",
            stream,
            k,
            t: Instant::now(),
        }
    }

    pub fn lap(&mut self, what: &str) -> Result<()> {
        if self.on {
            self.stream.synchronize()?;
            eprintln!(
                "trace K={} {what}: {:.3} ms",
                self.k,
                self.t.elapsed().as_secs_f64() * 1e3
            );
            self.t = Instant::now();
        }
        Ok(())
    }

    /// Start of a split interval (level 2 only): the stream is synchronized first.
    pub fn split_start(&self) -> Result<Option<Instant>> {
        if !self.split {
            return Ok(None);
        }
        self.stream.synchronize()?;
        Ok(Some(Instant::now()))
    }

    /// Seconds since `split_start`, after synchronizing (0 unless level 2).
    pub fn split_end(&self, t: Option<Instant>) -> Result<f64> {
        match t {
            None => Ok(0.0),
            Some(t) => {
                self.stream.synchronize()?;
                Ok(t.elapsed().as_secs_f64())
            }
        }
    }

    pub fn splits(&self, parts: &[(&str, f64)]) {
        if self.split {
            for (what, s) in parts {
                eprintln!("trace K={}   of which {what}: {:.3} ms", self.k, s * 1e3);
            }
        }
    }
}
