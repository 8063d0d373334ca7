//! `synth`: a random-weight checkpoint for any config of a supported architecture (MiniCPM-SALA
//! or a dense Llama-family decoder), laid out like a real release
//! (sharded BF16 safetensors with index, config, generation config, tokenizer). Deterministic per
//! seed, and streamed: each tensor is generated in chunks while it is written, so the 9.5B preset
//! never holds more than one chunk per core in memory.

use crate::checkpoint::guard::InputPath;
use crate::checkpoint::{files, shards, Dtype, OutputDir, TensorSpec};
use crate::model::AnyConfig;
use crate::rng::SplitMix64;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// The tokenizer the repo ships (a 4,096-token byte-level BPE trained on public-domain text;
/// see examples/tiny-sala/README.md).
pub const DEFAULT_TOKENIZER: &[u8] = include_bytes!("../examples/tiny-sala/tokenizer.json");

pub struct SynthOptions {
    pub out: PathBuf,
    pub seed: u64,
    pub tokenizer: Option<PathBuf>,
    /// The config file the checkpoint was made from (an input the output may not alias).
    pub config_file: Option<PathBuf>,
    pub shard_bytes: u64,
    pub force: bool,
}

const CHUNK: usize = 1 << 20;

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// How a tensor is initialised: norms near 1, biases near 0, matrices with std 1/sqrt(fan_in)
/// (so activations keep unit scale through the random network), embeddings with std
/// 1/scale_emb.
fn init_for(name: &str, shape: &[usize], cfg: &AnyConfig) -> (f32, f32) {
    let sqrt3 = 3f32.sqrt();
    if name.ends_with(".bias") {
        (0.0, 0.1)
    } else if shape.len() == 1 {
        (1.0, 0.2)
    } else if name == "model.embed_tokens.weight" {
        (0.0, sqrt3 / cfg.scale_emb() as f32)
    } else {
        (0.0, sqrt3 / (shape[1] as f32).sqrt())
    }
}

pub fn synth(cfg: &AnyConfig, opts: &SynthOptions) -> Result<PathBuf> {
    let tokenizer = match &opts.tokenizer {
        Some(p) => {
            std::fs::read(p).with_context(|| format!("cannot read tokenizer {}", p.display()))?
        }
        None => DEFAULT_TOKENIZER.to_vec(),
    };
    let tok = tokenizers::Tokenizer::from_bytes(&tokenizer)
        .map_err(|e| anyhow::anyhow!("invalid tokenizer.json: {e}"))?;
    let vocab = tok.get_vocab_size(true);
    if vocab > cfg.vocab_size() {
        bail!(
            "the tokenizer has {vocab} tokens but the config's vocab_size is {}: token ids would overflow the embedding",
            cfg.vocab_size()
        );
    }
    let inputs: Vec<InputPath> = [
        ("--config", &opts.config_file),
        ("--tokenizer", &opts.tokenizer),
    ]
    .into_iter()
    .filter_map(|(flag, p)| p.as_ref().map(|p| InputPath::new(flag, p)))
    .collect();
    let out = OutputDir::create(&opts.out, opts.force, &inputs)?;
    let dir = out.path().to_path_buf();
    write_model_files(&dir, cfg, &tokenizer)?;
    let specs: Vec<TensorSpec> = cfg
        .expected_tensors()
        .into_iter()
        .map(|(name, shape)| TensorSpec::new(name, Dtype::BF16, shape))
        .collect();
    crate::checkpoint::guard::check_disk_space(
        "--out",
        &dir,
        specs.iter().map(TensorSpec::nbytes).sum(),
        "the tensors",
    )?;
    let progress = crate::progress::bar(specs.len() as u64, "synth");
    shards::write_sharded(&dir, &specs, opts.shard_bytes, |spec, w| {
        let (center, half_width) = init_for(&spec.name, &spec.shape, cfg);
        let n = spec.shape.iter().product::<usize>();
        let base = opts.seed ^ fnv1a(&spec.name);
        let chunks: Vec<usize> = (0..n.div_ceil(CHUNK)).collect();
        // A bounded number of chunks in flight keeps memory flat while all cores generate.
        for window in chunks.chunks(rayon::current_num_threads().max(1) * 2) {
            let bufs: Vec<Vec<u8>> = window
                .par_iter()
                .map(|&c| {
                    let mut rng = SplitMix64::new(
                        base.wrapping_add((c as u64).wrapping_mul(0xD1B54A32D192ED03)),
                    );
                    let len = CHUNK.min(n - c * CHUNK);
                    let mut b = Vec::with_capacity(len * 2);
                    for _ in 0..len {
                        let x = center + half_width * rng.uniform();
                        b.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
                    }
                    b
                })
                .collect();
            for b in bufs {
                w.write_all(&b)?;
            }
        }
        progress.inc(1);
        Ok(())
    })?;
    progress.finish_and_clear();
    out.commit()
}

/// config.json, generation_config.json and tokenizer.json of a synthetic model.
fn write_model_files(dir: &Path, cfg: &AnyConfig, tokenizer: &[u8]) -> Result<()> {
    files::write_file(&dir.join("config.json"), cfg.to_json_pretty().as_bytes())?;
    let gen = cfg.generation_ids();
    files::write_file(
        &dir.join("generation_config.json"),
        serde_json::to_string_pretty(&gen)?.as_bytes(),
    )?;
    files::write_file(&dir.join("tokenizer.json"), tokenizer)
}
