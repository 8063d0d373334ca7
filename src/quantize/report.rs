//! What `quantize` reports: one row per module and `quantize_report.json`.

use super::hashes::Hashes;
use super::Recorded;
use crate::calib::SourceUsage;
use crate::model::LinearGroup;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModuleRow {
    pub module: String,
    pub group: String,
    pub n: usize,
    pub k: usize,
    pub quantized: bool,
    /// Bits of the codes (0 for skipped modules).
    #[serde(default)]
    pub bits: u8,
    /// Columns per group (-1: one group per row; 0 for skipped modules).
    #[serde(default)]
    pub group_size: i64,
    /// GPTQ loss: Σ (w − q)² / d² / 2 over the module (0 for skipped modules).
    pub loss: f64,
    /// ||X(W−Q)ᵀ|| / ||XWᵀ|| on the calibration tokens (GPTQ runs only).
    pub rel_output_error: Option<f64>,
    /// Damping actually used (escalated from --damp when a factorization failed).
    pub damp: f64,
    pub dead_columns: usize,
    pub seconds: f64,
}

impl ModuleRow {
    pub fn skipped(module: &str, g: LinearGroup) -> Self {
        Self {
            module: module.to_string(),
            group: g.name().to_string(),
            n: 0,
            k: 0,
            quantized: false,
            bits: 0,
            group_size: 0,
            loss: 0.0,
            rel_output_error: None,
            damp: 0.0,
            dead_columns: 0,
            seconds: 0.0,
        }
    }

    pub fn line(&self) -> String {
        if !self.quantized {
            return format!("{:<44} kept BF16 (--skip)", self.module);
        }
        let rel = self
            .rel_output_error
            .map(|r| format!("{:>9.5}", r))
            .unwrap_or_else(|| format!("{:>9}", "-"));
        format!(
            "{:<44} {:>6}x{:<6} {}b/{:<4} loss {:>11.4e}  rel.err {rel}  damp {:<7} {:>7.3}s",
            self.module,
            self.n,
            self.k,
            self.bits,
            self.group_size,
            self.loss,
            self.damp,
            self.seconds
        )
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct QuantizeReport {
    pub tool: String,
    pub model: String,
    pub output: String,
    pub settings: Recorded,
    pub calibration: Vec<SourceUsage>,
    pub calibration_sha256: String,
    pub hashes: Hashes,
    pub modules: Vec<ModuleRow>,
    pub seconds: BTreeMap<String, f64>,
    pub total_seconds: f64,
    pub peak_rss_bytes: Option<u64>,
    pub verify: Option<serde_json::Value>,
    /// The engine the output was written for (`--engine`).
    pub engine: String,
    /// How config.json differs from the source's (besides quantization_config).
    pub config_edits: crate::engine::config::ConfigEdits,
    /// Files copied byte for byte from the source (tokenizer, remote code, generation config).
    pub copied_from_source: Vec<String>,
    /// The engine's load emulated on the written files.
    pub engine_check: Option<crate::engine::EngineCheck>,
    /// Seconds per stage and the Hessian FLOPs (all layers).
    pub stages: Option<super::stages::StageSeconds>,
    /// The estimate printed before the run.
    pub preflight: Option<super::stages::Preflight>,
    /// GPU memory actually used (CUDA runs).
    pub gpu_memory: Option<GpuMemory>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuMemory {
    /// High-water mark of live allocations in the stream-ordered pool candle allocates from.
    pub pool_peak_used_bytes: u64,
    /// High-water mark of memory the pool held (live + cached for reuse).
    pub pool_peak_reserved_bytes: u64,
    /// Everything in use on the device at the end (context, cuBLAS/cuSOLVER workspaces, pool).
    pub in_use_at_end_bytes: u64,
}

impl QuantizeReport {
    pub fn print_text(&self) {
        crate::outln!(
            "{:<44} {:>13} {:>15} {:>17} {:>12} {:>8}",
            "module",
            "shape",
            "loss",
            "rel.output.err",
            "damp",
            "seconds"
        );
        for r in &self.modules {
            crate::outln!("{}", r.line());
        }
        let q = self.modules.iter().filter(|r| r.quantized).count();
        crate::outln!(
            "\n{} of {} modules quantized ({} {}-bit, group {}, act-order {}); {:.1} s in all, peak memory {}",
            q,
            self.modules.len(),
            match self.settings.flags.method {
                super::Method::Gptq => "GPTQ",
                super::Method::Gptaq => "GPTAQ",
                super::Method::Rtn => "RTN",
            },
            self.settings.flags.bits,
            self.settings.flags.group_size,
            self.settings.flags.act_order,
            self.total_seconds,
            self.peak_rss_bytes.map(|b| format!("{:.2} GB", b as f64 / 1e9)).unwrap_or_else(|| "unknown".into())
        );
        let used: Vec<String> = self
            .calibration
            .iter()
            .map(|u| format!("{} {} tokens", u.name, u.tokens_used))
            .collect();
        crate::outln!("calibration: {}", used.join(", "));
        if let Some(st) = &self.stages {
            crate::outln!(
                "stages (s): setup {:.2} (source checks {:.2} beside the run, {:.2} waited for), load {:.2}, embed {:.2}, forward {:.2} (sparse mixers {:.2}, lightning mixers {:.2}), Hessians {:.2} ({}), factorization {:.2}, column loop {:.2}, refit {:.2}, decode {:.2}, report {:.2}, journal {:.2}, write {:.2}",
                st.setup,
                st.source_checks,
                st.source_checks_wait,
                st.load,
                st.embed,
                st.forward,
                st.mixer_sparse,
                st.mixer_lightning,
                st.hessians,
                rate(st.hessian_tflops()),
                st.factorization,
                st.column_loop,
                st.refit,
                st.decode,
                st.report,
                st.journal,
                self.seconds.get("write").copied().unwrap_or(0.0)
            );
        }
        if let (Some(p), Some(m)) = (&self.preflight, &self.gpu_memory) {
            crate::outln!(
                "GPU memory: peak {:.1} GB used, {:.1} GB reserved (preflight expected {:.1} GB); time {:.1} s (preflight expected {:.1} s)",
                m.pool_peak_used_bytes as f64 / 1e9,
                m.pool_peak_reserved_bytes as f64 / 1e9,
                p.peak_bytes as f64 / 1e9,
                self.total_seconds,
                p.seconds
            );
        }
        crate::outln!("wrote {}", self.output);
    }
}

/// A FLOP rate for people: TFLOP/s on a GPU, GFLOP/s where it is below one TFLOP/s (a CPU).
fn rate(tflops: f64) -> String {
    if tflops >= 1.0 {
        format!("{tflops:.0} TFLOP/s")
    } else {
        format!("{:.1} GFLOP/s", tflops * 1e3)
    }
}
