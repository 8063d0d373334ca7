//! `import-gguf`: a Llama-architecture GGUF file (llama.cpp's format) as a Hugging Face-layout
//! folder that every other command reads: dequantized BF16 safetensors, `config.json`,
//! `generation_config.json`, and `tokenizer.json` / `tokenizer_config.json` rebuilt from the
//! tokenizer in the GGUF metadata.
//!
//! candle reads the file and dequantizes each tensor (F32, F16, Q4_0 … Q8_0, the K-quants) to
//! f32. llama.cpp's converter permutes the rows of Q and K so that its interleaved RoPE (pairs
//! `2i, 2i+1`) computes what rotate-half RoPE computes on the original rows (pairs `i, i+d/2`);
//! [`unpermute_rows`] undoes it, per head of Q (`head_count`) and of K (`head_count_kv`).

pub mod tokenizer;

use crate::checkpoint::guard::InputPath;
use crate::checkpoint::{files, manifest, shards, Dtype, OutputDir, TensorSpec};
use crate::model::llama::LlamaConfig;
use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::Device;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tokenizer::GgufVocab;

pub struct ImportOptions {
    pub gguf: PathBuf,
    pub out: PathBuf,
    pub force: bool,
    pub shard_bytes: u64,
}

/// What was imported; also written to `gguf_import.json` in the output.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ImportReport {
    pub source: String,
    pub source_sha256: String,
    pub source_bytes: u64,
    /// `general.name`, `general.license`, … (string metadata of the file).
    pub general: BTreeMap<String, String>,
    pub architecture: String,
    pub parameters: u64,
    pub tensors: usize,
    /// GGUF tensor types and how many tensors of each the file holds.
    pub tensor_types: BTreeMap<String, usize>,
    pub tie_word_embeddings: bool,
    pub vocab_size: usize,
    pub tokenizer_pre: Option<String>,
    /// Q and K weights un-permuted from llama.cpp's RoPE row order.
    pub unpermuted: usize,
    pub output: String,
}

impl ImportReport {
    pub fn print_text(&self) {
        crate::outln!(
            "imported       {} ({} bytes, sha256 {})",
            self.source,
            self.source_bytes,
            self.source_sha256
        );
        if let Some(n) = self.general.get("general.name") {
            crate::outln!("model          {n}");
        }
        let types: Vec<String> = self
            .tensor_types
            .iter()
            .map(|(k, v)| format!("{k} x{v}"))
            .collect();
        crate::outln!(
            "tensors        {} ({}), {} parameters, dequantized to BF16; {} Q/K weights un-permuted",
            self.tensors,
            types.join(", "),
            self.parameters,
            self.unpermuted
        );
        crate::outln!(
            "config         {}, vocab {}, tied embeddings {}",
            self.architecture,
            self.vocab_size,
            self.tie_word_embeddings
        );
        crate::outln!(
            "tokenizer      byte-level BPE (pre-tokenizer {}), round trip checked",
            self.tokenizer_pre.as_deref().unwrap_or("default")
        );
        crate::outln!("written        {}", self.output);
    }
}

/// llama.cpp's Q/K row order back to the Hugging Face order, for a `[rows, cols]` row-major
/// matrix of `heads` heads: GGUF row `h·d + 2j + s` is HF row `h·d + s·d/2 + j`.
pub fn unpermute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Result<Vec<f32>> {
    if heads == 0
        || !rows.is_multiple_of(heads)
        || !(rows / heads).is_multiple_of(2)
        || w.len() != rows * cols
    {
        bail!("cannot un-permute a [{rows}, {cols}] matrix into {heads} heads of even size");
    }
    let d = rows / heads;
    let half = d / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for j in 0..half {
            for s in 0..2 {
                let src = (h * d + 2 * j + s) * cols;
                let dst = (h * d + s * half + j) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    Ok(out)
}

/// Typed access to the metadata, with the key named in every error.
struct Meta<'a>(&'a Content);

impl Meta<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.metadata.get(k)
    }

    fn int(&self, k: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        let n: i128 = match v {
            Value::U8(x) => *x as i128,
            Value::I8(x) => *x as i128,
            Value::U16(x) => *x as i128,
            Value::I16(x) => *x as i128,
            Value::U32(x) => *x as i128,
            Value::I32(x) => *x as i128,
            Value::U64(x) => *x as i128,
            Value::I64(x) => *x as i128,
            other => bail!("GGUF metadata {k} is {other:?}, expected an integer"),
        };
        u64::try_from(n)
            .map(Some)
            .map_err(|_| anyhow!("GGUF metadata {k} is {n}, expected a non-negative integer"))
    }

    fn need(&self, k: &str) -> Result<usize> {
        self.int(k)?
            .map(|v| v as usize)
            .with_context(|| format!("GGUF metadata {k} is missing"))
    }

    /// A float; f32 values are read as their shortest decimal (1e-5, not 9.99999974e-6).
    fn float(&self, k: &str) -> Result<Option<f64>> {
        let v = match self.get(k) {
            None => None,
            Some(Value::F32(x)) => Some(x.to_string().parse().expect("f32 prints as a number")),
            Some(Value::F64(x)) => Some(*x),
            Some(_) => self.int(k)?.map(|v| v as f64),
        };
        if let Some(x) = v {
            ensure!(
                x.is_finite() && x > 0.0,
                "GGUF metadata {k} is {x}: expected a positive finite number"
            );
        }
        Ok(v)
    }

    fn string(&self, k: &str) -> Result<Option<String>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => bail!("GGUF metadata {k} is {other:?}, expected a string"),
        }
    }

    fn flag(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => bail!("GGUF metadata {k} is {other:?}, expected a bool"),
        }
    }

    fn array(&self, k: &str) -> Result<Option<&Vec<Value>>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(other) => bail!(
                "GGUF metadata {k} is a {:?}, expected an array",
                other.value_type()
            ),
        }
    }

    fn strings(&self, k: &str) -> Result<Option<Vec<String>>> {
        let Some(a) = self.array(k)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => bail!("GGUF metadata {k}[{i}] is {other:?}, expected a string"),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn ints(&self, k: &str) -> Result<Option<Vec<i32>>> {
        let Some(a) = self.array(k)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::I32(x) => Ok(*x),
                Value::U32(x) => Ok(*x as i32),
                Value::I8(x) => Ok(*x as i32),
                Value::U8(x) => Ok(*x as i32),
                other => bail!("GGUF metadata {k}[{i}] is {other:?}, expected an integer"),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn id(&self, k: &str) -> Result<Option<u32>> {
        Ok(self.int(k)?.map(|v| v as u32))
    }
}

/// The tokenizer metadata of the file.
fn read_vocab(m: &Meta) -> Result<GgufVocab> {
    let tokens = m
        .strings("tokenizer.ggml.tokens")?
        .context("GGUF metadata tokenizer.ggml.tokens is missing: the file carries no tokenizer")?;
    let n = tokens.len();
    let check = |what: &str, id: Option<u32>| -> Result<Option<u32>> {
        match id {
            Some(i) if i as usize >= n => {
                bail!(
                    "GGUF metadata tokenizer.ggml.{what}_token_id is {i}, but there are {n} tokens"
                )
            }
            x => Ok(x),
        }
    };
    Ok(GgufVocab {
        model: m
            .string("tokenizer.ggml.model")?
            .context("GGUF metadata tokenizer.ggml.model is missing")?,
        pre: m.string("tokenizer.ggml.pre")?,
        types: m
            .ints("tokenizer.ggml.token_type")?
            .unwrap_or_else(|| vec![tokenizer::TOKEN_NORMAL; n]),
        merges: m.strings("tokenizer.ggml.merges")?.unwrap_or_default(),
        bos: check("bos", m.id("tokenizer.ggml.bos_token_id")?)?,
        eos: check("eos", m.id("tokenizer.ggml.eos_token_id")?)?,
        unk: check("unknown", m.id("tokenizer.ggml.unknown_token_id")?)?,
        pad: check("padding", m.id("tokenizer.ggml.padding_token_id")?)?,
        add_bos: m.flag("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
        add_eos: m.flag("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        chat_template: m.string("tokenizer.chat_template")?,
        tokens,
    })
}

/// The Hugging Face `config.json` the metadata implies.
fn hf_config(m: &Meta, vocab: &GgufVocab, tied: bool) -> Result<serde_json::Value> {
    check_llama(m)?;
    let (hidden, heads, kv_heads, head_dim) = attention_shape(m)?;
    check_rope(m, head_dim)?;
    let vocab_size = m
        .int("llama.vocab_size")?
        .map_or(vocab.tokens.len(), |v| v as usize);
    if vocab_size != vocab.tokens.len() {
        bail!(
            "llama.vocab_size is {vocab_size} but tokenizer.ggml.tokens has {} tokens",
            vocab.tokens.len()
        );
    }
    let eps = m
        .float("llama.attention.layer_norm_rms_epsilon")?
        .context("GGUF metadata llama.attention.layer_norm_rms_epsilon is missing")?;
    let mut cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": false,
        "mlp_bias": false,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": m.need("llama.feed_forward_length")?,
        "num_hidden_layers": m.need("llama.block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": m.need("llama.context_length")?,
        "rms_norm_eps": eps,
        "rope_theta": m.float("llama.rope.freq_base")?.unwrap_or(10000.0),
        "rope_scaling": null,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "use_cache": true,
    });
    set_special_ids(&mut cfg, vocab);
    Ok(cfg)
}

/// Refuses metadata of another architecture than a dense Llama.
fn check_llama(m: &Meta) -> Result<()> {
    let arch = m
        .string("general.architecture")?
        .context("GGUF metadata general.architecture is missing")?;
    if arch != "llama" {
        bail!("general.architecture is {arch:?}: import-gguf converts \"llama\" GGUF files only");
    }
    if m.int("llama.expert_count")?.is_some_and(|n| n > 0) {
        bail!(
            "llama.expert_count is set: mixture-of-experts GGUF files (Mixtral) are not supported"
        );
    }
    Ok(())
}

/// The attention's shape: hidden size, query heads, key/value heads and head dimension (one for
/// keys and values).
fn attention_shape(m: &Meta) -> Result<(usize, usize, usize, usize)> {
    let hidden = m.need("llama.embedding_length")?;
    let heads = m.need("llama.attention.head_count")?;
    let kv_heads = m
        .int("llama.attention.head_count_kv")?
        .map_or(heads, |v| v as usize);
    if heads == 0 || hidden % heads != 0 {
        bail!("llama.embedding_length {hidden} is not a multiple of llama.attention.head_count {heads}");
    }
    let head_dim = m
        .int("llama.attention.key_length")?
        .map_or(hidden / heads, |v| v as usize);
    if let Some(v) = m.int("llama.attention.value_length")? {
        if v as usize != head_dim {
            bail!("llama.attention.value_length {v} differs from the key length {head_dim}: not a Llama attention");
        }
    }
    Ok((hidden, heads, kv_heads, head_dim))
}

/// Refuses partial or scaled RoPE.
fn check_rope(m: &Meta, head_dim: usize) -> Result<()> {
    if let Some(r) = m.int("llama.rope.dimension_count")? {
        if r as usize != head_dim {
            bail!("llama.rope.dimension_count is {r} but the head dimension is {head_dim}: partial RoPE is not supported");
        }
    }
    if let Some(t) = m.string("llama.rope.scaling.type")? {
        if t != "none" {
            bail!(
                "llama.rope.scaling.type is {t:?}: only unscaled RoPE is supported by import-gguf"
            );
        }
    }
    Ok(())
}

/// Sets `bos_token_id`, `eos_token_id` and `pad_token_id` in `v` for those the vocabulary names.
fn set_special_ids(v: &mut serde_json::Value, vocab: &GgufVocab) {
    for (key, id) in [
        ("bos_token_id", vocab.bos),
        ("eos_token_id", vocab.eos),
        ("pad_token_id", vocab.pad),
    ] {
        if let Some(id) = id {
            v[key] = id.into();
        }
    }
}

/// The GGUF tensor holding HF tensor `name`, and the heads to un-permute its rows by.
fn gguf_source(name: &str, cfg: &LlamaConfig) -> Result<(String, Option<usize>)> {
    let top = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Ok((t.to_string(), None));
    }
    let rest = name
        .strip_prefix("model.layers.")
        .with_context(|| format!("no GGUF name for {name}"))?;
    let (i, local) = rest.split_once('.').context("layer tensor")?;
    let (g, heads) = match local {
        "input_layernorm.weight" => ("attn_norm.weight", None),
        "post_attention_layernorm.weight" => ("ffn_norm.weight", None),
        "self_attn.q_proj.weight" => ("attn_q.weight", Some(cfg.num_attention_heads)),
        "self_attn.k_proj.weight" => ("attn_k.weight", Some(cfg.num_key_value_heads)),
        "self_attn.v_proj.weight" => ("attn_v.weight", None),
        "self_attn.o_proj.weight" => ("attn_output.weight", None),
        "mlp.gate_proj.weight" => ("ffn_gate.weight", None),
        "mlp.up_proj.weight" => ("ffn_up.weight", None),
        "mlp.down_proj.weight" => ("ffn_down.weight", None),
        other => bail!("no GGUF name for {other}"),
    };
    Ok((format!("blk.{i}.{g}"), heads))
}

/// Reads a GGUF header with candle's reader and checks what that reader takes on trust: the
/// alignment (a multiple of 8; candle divides by it, so 0 panicked), a tensor name given twice
/// (candle keeps the last), and tensor data that lies on aligned, non-overlapping ranges inside
/// the file (all-zero offsets imported every tensor from the same bytes).
fn read_content(file: &mut std::fs::File, path: &std::path::Path) -> Result<Content> {
    let shown = path.display();
    let declared = declared_tensor_count(file)?;
    let content = read_with_candle(file, path)?;
    let alignment = alignment(&content, path)?;
    if let Some(n) = declared {
        ensure!(
            n as usize == content.tensor_infos.len(),
            "{shown} declares {n} tensors but names only {} distinct ones: a tensor name is \
             given twice, and which one is meant is ambiguous",
            content.tensor_infos.len()
        );
    }
    let file_len = file.metadata()?.len();
    check_tensor_spans(&content, alignment, file_len, path)?;
    Ok(content)
}

/// The tensor count the header declares (None when the file does not start like GGUF); leaves
/// the file at its start.
fn declared_tensor_count(file: &mut std::fs::File) -> Result<Option<u64>> {
    use std::io::{Read, Seek, SeekFrom};
    // Header: magic, version, tensor count (u32 in v1, u64 since v2).
    let mut head = [0u8; 24];
    let got = file.read(&mut head).unwrap_or(0);
    file.seek(SeekFrom::Start(0))?;
    Ok(if got >= 24 && &head[..4] == b"GGUF" {
        let version = u32::from_le_bytes(head[4..8].try_into().unwrap());
        Some(if version == 1 {
            u32::from_le_bytes(head[8..12].try_into().unwrap()) as u64
        } else {
            u64::from_le_bytes(head[8..16].try_into().unwrap())
        })
    } else {
        None
    })
}

/// The header as candle's reader reads it, its panics turned into errors.
fn read_with_candle(file: &mut std::fs::File, path: &std::path::Path) -> Result<Content> {
    let shown = path.display();
    // candle's reader divides by general.alignment; a zero there is a panic, not an error.
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(file)));
    std::panic::set_hook(prev);
    Ok(match read {
        Ok(r) => r.map_err(|e| anyhow!("{shown} is not a readable GGUF file: {e}"))?,
        Err(_) => bail!(
            "{shown} is not a readable GGUF file: its header made the GGUF reader fail \
             (general.alignment 0?); the file is damaged"
        ),
    })
}

/// `general.alignment` (32 when absent), refused unless a positive multiple of 8.
fn alignment(content: &Content, path: &std::path::Path) -> Result<u64> {
    let shown = path.display();
    Ok(match content.metadata.get("general.alignment") {
        None => 32,
        Some(v) => {
            let a = v
                .to_u64()
                .or_else(|_| v.to_u32().map(u64::from))
                .map_err(|_| anyhow!("{shown}: general.alignment is {v:?}, expected an integer"))?;
            ensure!(
                a > 0 && a % 8 == 0,
                "{shown}: general.alignment is {a}; the GGUF format requires a positive multiple \
                 of 8, so the tensor offsets cannot be trusted"
            );
            a
        }
    })
}

/// Checks that every tensor's data starts aligned, ends inside the `file_len`-byte file, and
/// overlaps no other tensor's.
fn check_tensor_spans(
    content: &Content,
    alignment: u64,
    file_len: u64,
    path: &std::path::Path,
) -> Result<()> {
    let shown = path.display();
    let mut spans: Vec<(u64, u64, &str)> = vec![];
    for (name, info) in &content.tensor_infos {
        let elems = info
            .shape
            .dims()
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .filter(|&e| e <= file_len.saturating_mul(64))
            .ok_or_else(|| {
                anyhow!(
                    "{shown}: tensor {name} has dimensions {:?}, more elements than the file \
                     could hold: the header is damaged",
                    info.shape.dims()
                )
            })?;
        let block = info.ggml_dtype.block_size() as u64;
        let size = elems / block.max(1) * info.ggml_dtype.type_size() as u64;
        ensure!(
            info.offset % alignment == 0,
            "{shown}: tensor {name} starts at offset {}, which is not a multiple of the \
             alignment {alignment}",
            info.offset
        );
        let start = content.tensor_data_offset.saturating_add(info.offset);
        ensure!(
            start.saturating_add(size) <= file_len,
            "{shown}: tensor {name} needs {size} bytes at offset {start}, past the end of the \
             {file_len}-byte file (truncated?)"
        );
        spans.push((info.offset, info.offset + size, name));
    }
    spans.sort();
    for w in spans.windows(2) {
        ensure!(
            w[0].1 <= w[1].0,
            "{shown}: the data of tensors {} and {} overlap (offsets {} and {}): the file is \
             damaged",
            w[0].2,
            w[1].2,
            w[0].0,
            w[1].0
        );
    }
    Ok(())
}

/// One HF tensor to write: its name and shape, the GGUF tensor it comes from, and the heads to
/// un-permute its rows by.
type Planned = (String, Vec<usize>, String, Option<usize>);

pub fn import_gguf(opts: &ImportOptions) -> Result<ImportReport> {
    let path = &opts.gguf;
    crate::checkpoint::guard::regular_file(path, "--gguf")?;
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("cannot open --gguf {}", path.display()))?;
    let content = read_content(&mut file, path)?;
    let m = Meta(&content);
    let ctx = |e: anyhow::Error| e.context(format!("importing {}", path.display()));
    let vocab = read_vocab(&m).map_err(ctx)?;
    let tied = !content.tensor_infos.contains_key("output.weight");
    let cfg_json = hf_config(&m, &vocab, tied).map_err(ctx)?;
    let cfg = LlamaConfig::from_value(cfg_json.clone())
        .with_context(|| format!("the config {} implies is not valid", path.display()))?;
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        bail!(
            "{} holds rope_freqs.weight (Llama 3.1 RoPE scaling factors): not supported by import-gguf",
            path.display()
        );
    }
    let plan = plan_tensors(&content, &cfg, path)?;
    let mut tensor_types = BTreeMap::new();
    for info in content.tensor_infos.values() {
        *tensor_types
            .entry(format!("{:?}", info.ggml_dtype))
            .or_insert(0usize) += 1;
    }

    let tok = vocab.build().map_err(ctx)?;
    tokenizer::check_round_trip(&tok, tokenizer::ROUND_TRIP_SAMPLE).map_err(ctx)?;

    let out = OutputDir::create(
        &opts.out,
        opts.force,
        &[InputPath::new("--gguf", &opts.gguf)],
    )?;
    let dir = out.path().to_path_buf();
    let specs = write_tensors(&content, &mut file, path, &plan, &dir, opts.shard_bytes)?;
    write_configs(&dir, &cfg_json, &vocab, &tok, &cfg)?;

    let meta = std::fs::metadata(path)?;
    let mut general = BTreeMap::new();
    for (k, v) in &content.metadata {
        if let (true, Value::String(s)) = (k.starts_with("general."), v) {
            general.insert(k.clone(), s.clone());
        }
    }
    let report = ImportReport {
        source: path.display().to_string(),
        source_sha256: manifest::sha256_file(path)?,
        source_bytes: meta.len(),
        general,
        architecture: cfg.family.architecture().to_string(),
        parameters: cfg
            .expected_tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum(),
        tensors: specs.len(),
        tensor_types,
        tie_word_embeddings: tied,
        vocab_size: cfg.vocab_size,
        tokenizer_pre: vocab.pre.clone(),
        unpermuted: plan.iter().filter(|p| p.3.is_some()).count(),
        output: opts.out.display().to_string(),
    };
    let mut rec = serde_json::to_value(&report)?;
    rec["tool"] = format!("soar-gptq {}", env!("CARGO_PKG_VERSION")).into();
    files::write_file(&dir.join("gguf_import.json"), to_json(&rec).as_bytes())?;
    out.commit()?;
    Ok(report)
}

/// Every HF tensor from one GGUF tensor of the right shape; nothing left over.
fn plan_tensors(content: &Content, cfg: &LlamaConfig, path: &Path) -> Result<Vec<Planned>> {
    let mut plan = vec![];
    let mut used = BTreeSet::new();
    for (name, shape) in cfg.expected_tensors() {
        let (src, heads) = gguf_source(&name, cfg)?;
        let info = content.tensor_infos.get(&src).with_context(|| {
            format!(
                "{} has no tensor {src} (for {name}): not a complete Llama GGUF",
                path.display()
            )
        })?;
        if info.shape.dims() != shape.as_slice() {
            bail!(
                "tensor {src} in {} has shape {:?} (outer dimension first), but the metadata implies {:?}",
                path.display(),
                info.shape.dims(),
                shape
            );
        }
        used.insert(src.clone());
        plan.push((name, shape, src, heads));
    }
    let mut extra: Vec<&String> = content
        .tensor_infos
        .keys()
        .filter(|k| !used.contains(*k))
        .collect();
    extra.sort();
    if let Some(k) = extra.first() {
        bail!(
            "{} holds tensor {k}, which a Llama checkpoint has no place for ({} unmapped in all)",
            path.display(),
            extra.len()
        );
    }
    Ok(plan)
}

/// Writes the planned tensors as BF16 shards into `dir` (after checking the disk has room), one
/// progress step per tensor; returns their specs.
fn write_tensors(
    content: &Content,
    file: &mut std::fs::File,
    path: &Path,
    plan: &[Planned],
    dir: &Path,
    shard_bytes: u64,
) -> Result<Vec<TensorSpec>> {
    let specs: Vec<TensorSpec> = plan
        .iter()
        .map(|(n, s, _, _)| TensorSpec::new(n.clone(), Dtype::BF16, s.clone()))
        .collect();
    crate::checkpoint::guard::check_disk_space(
        "--out",
        dir,
        specs.iter().map(TensorSpec::nbytes).sum(),
        "the tensors",
    )?;
    let pb = crate::progress::bar(specs.len() as u64, "import");
    shards::write_sharded(dir, &specs, shard_bytes, |spec, w| {
        let planned = plan
            .iter()
            .find(|p| p.0 == spec.name)
            .expect("planned tensor");
        w.write_all(&bf16_tensor(content, file, path, planned)?)?;
        pb.inc(1);
        Ok(())
    })?;
    pb.finish_and_clear();
    Ok(specs)
}

/// The BF16 bytes of a planned tensor: its GGUF tensor read, dequantized, its rows un-permuted
/// (Q and K), refused when a value is not finite.
fn bf16_tensor(
    content: &Content,
    file: &mut std::fs::File,
    path: &Path,
    (_, shape, src, heads): &Planned,
) -> Result<Vec<u8>> {
    let q = content
        .tensor(file, src, &Device::Cpu)
        .map_err(|e| anyhow!("cannot read tensor {src} of {}: {e}", path.display()))?;
    let t = q
        .dequantize(&Device::Cpu)
        .map_err(|e| anyhow!("cannot dequantize tensor {src} ({:?}): {e}", q.dtype()))?;
    let mut v: Vec<f32> = t.flatten_all()?.to_vec1()?;
    if let Some(h) = heads {
        v = unpermute_rows(&v, shape[0], shape[1], *h)
            .with_context(|| format!("un-permuting {src}"))?;
    }
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        bail!(
            "tensor {src} of {} holds a non-finite value at element {i}",
            path.display()
        );
    }
    let mut bytes = Vec::with_capacity(v.len() * 2);
    for x in v {
        bytes.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    }
    Ok(bytes)
}

/// Pretty-printed JSON.
fn to_json(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).expect("json")
}

/// Writes `config.json`, `generation_config.json`, `tokenizer.json` and `tokenizer_config.json`.
fn write_configs(
    dir: &Path,
    cfg_json: &serde_json::Value,
    vocab: &GgufVocab,
    tok: &tokenizers::Tokenizer,
    cfg: &LlamaConfig,
) -> Result<()> {
    files::write_file(&dir.join("config.json"), to_json(cfg_json).as_bytes())?;
    let mut gen = serde_json::json!({});
    set_special_ids(&mut gen, vocab);
    files::write_file(
        &dir.join("generation_config.json"),
        to_json(&gen).as_bytes(),
    )?;
    let tok_json = tok
        .to_string(true)
        .map_err(|e| anyhow!("cannot serialize the tokenizer: {e}"))?;
    files::write_file(&dir.join("tokenizer.json"), tok_json.as_bytes())?;
    files::write_file(
        &dir.join("tokenizer_config.json"),
        to_json(&vocab.tokenizer_config(cfg.max_position_embeddings)).as_bytes(),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `permute` (convert_hf_to_gguf.py), written from its definition: reshape
    /// `[heads, 2, d/2, cols]`, swap axes 1 and 2, reshape back.
    fn permute(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
        let d = rows / heads;
        let half = d / 2;
        let mut out = vec![0f32; w.len()];
        for h in 0..heads {
            for s in 0..2 {
                for j in 0..half {
                    let src = (h * d + s * half + j) * cols;
                    let dst = (h * d + j * 2 + s) * cols;
                    out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
                }
            }
        }
        out
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..n).map(|_| r.uniform()).collect()
    }

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() {
        for (rows, cols, heads) in [(12, 5, 3), (64, 7, 4), (8, 1, 1)] {
            let w = random(rows * cols, rows as u64);
            let p = permute(&w, rows, cols, heads);
            assert_ne!(p, w);
            assert_eq!(unpermute_rows(&p, rows, cols, heads).unwrap(), w);
        }
        assert!(unpermute_rows(&[0.0; 6], 6, 1, 4).is_err());
    }

    /// Why the permutation exists: interleaved RoPE (llama.cpp's "normal" mode, pairs 2i, 2i+1)
    /// on the permuted projection equals rotate-half RoPE on the original one, permuted.
    #[test]
    fn interleaved_rope_on_permuted_rows_is_rotate_half_rope() {
        let (heads, d, cols) = (2, 8, 3);
        let rows = heads * d;
        let w = random(rows * cols, 7);
        let x = random(cols, 8);
        let proj = |w: &[f32]| -> Vec<f64> {
            (0..rows)
                .map(|r| (0..cols).map(|c| (w[r * cols + c] * x[c]) as f64).sum())
                .collect()
        };
        let (q_hf, q_gguf) = (proj(&w), proj(&permute(&w, rows, cols, heads)));
        let pos = 5.0;
        let ang = |i: usize| pos * 10000f64.powf(-2.0 * i as f64 / d as f64);
        let mut rot_half = q_hf.clone();
        let mut inter = q_gguf.clone();
        for h in 0..heads {
            for i in 0..d / 2 {
                let (a, b) = (h * d + i, h * d + i + d / 2);
                let (c, s) = (ang(i).cos(), ang(i).sin());
                rot_half[a] = q_hf[a] * c - q_hf[b] * s;
                rot_half[b] = q_hf[b] * c + q_hf[a] * s;
                let (a, b) = (h * d + 2 * i, h * d + 2 * i + 1);
                inter[a] = q_gguf[a] * c - q_gguf[b] * s;
                inter[b] = q_gguf[b] * c + q_gguf[a] * s;
            }
        }
        let back: Vec<f32> = inter.iter().map(|&v| v as f32).collect();
        let back = unpermute_rows(&back, rows, 1, heads).unwrap();
        for (a, b) in back.iter().zip(&rot_half) {
            assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
