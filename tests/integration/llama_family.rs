//! The dense decoder families (docs/llama.md): the candle forward of Llama, Mistral, Qwen2 and
//! MiniCPM against a naive f64 implementation written from the Transformers modeling files'
//! math; MiniCPM against the MiniCPM-SALA forward on the same weights; and synth, inspect,
//! quantize, pack-marlin and eval-ppl run as a user runs them on small random models.

use crate::common::*;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use soar_gptq::checkpoint::Checkpoint;
use soar_gptq::model::{AnyConfig, AnyModel};
use std::path::{Path, PathBuf};

type Mat = Vec<Vec<f64>>;

/// A small config of `arch` with `extra` keys merged in.
fn config(arch: &str, extra: Value) -> Value {
    let mut v = json!({
        "architectures": [arch],
        "model_type": arch.trim_end_matches("ForCausalLM").to_lowercase(),
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

/// The four families, with their distinguishing features switched on.
fn family_configs() -> Vec<(&'static str, Value)> {
    vec![
        (
            "llama",
            config(
                "LlamaForCausalLM",
                json!({"attention_bias": true, "mlp_bias": true,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
            ),
        ),
        (
            "mistral",
            config(
                "MistralForCausalLM",
                json!({"sliding_window": 256, "num_key_value_heads": 1}),
            ),
        ),
        (
            "qwen2",
            config(
                "Qwen2ForCausalLM",
                json!({"tie_word_embeddings": true, "rope_theta": 1000000.0}),
            ),
        ),
        (
            "minicpm",
            config(
                "MiniCPMForCausalLM",
                json!({"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 32.0,
                   "tie_word_embeddings": true, "num_key_value_heads": 4}),
            ),
        ),
    ]
}

fn synth(dir: &Path, cfg: &Value, seed: u64) -> AnyConfig {
    let c = AnyConfig::from_json(&cfg.to_string()).unwrap();
    soar_gptq::synth::synth(
        &c,
        &soar_gptq::synth::SynthOptions {
            out: dir.to_path_buf(),
            seed,
            tokenizer: None,
            config_file: None,
            shard_bytes: 1_000_000,
            force: false,
        },
    )
    .unwrap();
    c
}

struct Ref<'a> {
    ck: &'a Checkpoint,
}

impl Ref<'_> {
    fn w(&self, name: &str) -> Vec<f64> {
        self.ck
            .f32_data(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .into_iter()
            .map(|x| x as f64)
            .collect()
    }
    fn has(&self, name: &str) -> bool {
        self.ck.contains(name)
    }
    /// y = W x (+ b) for every row of x.
    fn linear(&self, prefix: &str, x: &Mat) -> Mat {
        let name = format!("{prefix}.weight");
        let w = self.w(&name);
        let shape = &self.ck.get(&name).unwrap().shape;
        let (out, inp) = (shape[0], shape[1]);
        let b = self
            .has(&format!("{prefix}.bias"))
            .then(|| self.w(&format!("{prefix}.bias")));
        x.iter()
            .map(|row| {
                (0..out)
                    .map(|o| {
                        let y: f64 = (0..inp).map(|i| w[o * inp + i] * row[i]).sum();
                        y + b.as_ref().map_or(0.0, |b| b[o])
                    })
                    .collect()
            })
            .collect()
    }
}

fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let var = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (var + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

/// RoPE frequencies as the Transformers `_compute_llama3_parameters` defines them (or plain).
fn inv_freq(cfg: &Value, d: usize) -> Vec<f64> {
    let theta = cfg["rope_theta"].as_f64().unwrap();
    let base: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / d as f64))
        .collect();
    let s = &cfg["rope_scaling"];
    if s.is_null() {
        return base;
    }
    let (factor, lo, hi, old) = (
        s["factor"].as_f64().unwrap(),
        s["low_freq_factor"].as_f64().unwrap(),
        s["high_freq_factor"].as_f64().unwrap(),
        s["original_max_position_embeddings"].as_f64().unwrap(),
    );
    base.iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < old / hi {
                f
            } else if wavelen > old / lo {
                f / factor
            } else {
                let smooth = (old / wavelen - lo) / (hi - lo);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// rotate_half RoPE of one head at position `pos`.
fn rope(x: &[f64], pos: usize, freqs: &[f64]) -> Vec<f64> {
    let half = x.len() / 2;
    let mut out = x.to_vec();
    for i in 0..half {
        let (c, s) = ((pos as f64 * freqs[i]).cos(), (pos as f64 * freqs[i]).sin());
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
    }
    out
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Logits `[T, V]` of one sequence, straight from the config keys and the weights.
fn reference_logits(ck: &Checkpoint, cfg: &Value, ids: &[u32]) -> Mat {
    let r = Ref { ck };
    let get = |k: &str| cfg[k].as_f64();
    let hid = cfg["hidden_size"].as_u64().unwrap() as usize;
    let nh = cfg["num_attention_heads"].as_u64().unwrap() as usize;
    let nkv = cfg["num_key_value_heads"].as_u64().unwrap() as usize;
    let layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    let d = hid / nh;
    let eps = get("rms_norm_eps").unwrap();
    let minicpm = cfg["architectures"][0] == "MiniCPMForCausalLM";
    let (scale_emb, res, div) = if minicpm {
        (
            get("scale_emb").unwrap(),
            get("scale_depth").unwrap() / (layers as f64).sqrt(),
            hid as f64 / get("dim_model_base").unwrap(),
        )
    } else {
        (1.0, 1.0, 1.0)
    };
    let freqs = inv_freq(cfg, d);
    let emb = r.w("model.embed_tokens.weight");
    let mut h: Mat = ids
        .iter()
        .map(|&i| {
            (0..hid)
                .map(|j| emb[i as usize * hid + j] * scale_emb)
                .collect()
        })
        .collect();
    let t_len = ids.len();
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        let win = r.w(&format!("{p}input_layernorm.weight"));
        let x: Mat = h.iter().map(|row| rms(row, &win, eps)).collect();
        let q = r.linear(&format!("{p}self_attn.q_proj"), &x);
        let k = r.linear(&format!("{p}self_attn.k_proj"), &x);
        let v = r.linear(&format!("{p}self_attn.v_proj"), &x);
        let mut o = vec![vec![0.0; nh * d]; t_len];
        for hh in 0..nh {
            let g = hh / (nh / nkv);
            let qs: Mat = (0..t_len)
                .map(|t| rope(&q[t][hh * d..(hh + 1) * d], t, &freqs))
                .collect();
            let ks: Mat = (0..t_len)
                .map(|t| rope(&k[t][g * d..(g + 1) * d], t, &freqs))
                .collect();
            for t in 0..t_len {
                let scores: Vec<f64> = (0..=t)
                    .map(|s| (0..d).map(|i| qs[t][i] * ks[s][i]).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (s, sc) in scores.iter().enumerate() {
                    let pr = (sc - m).exp() / z;
                    for i in 0..d {
                        o[t][hh * d + i] += pr * v[s][g * d + i];
                    }
                }
            }
        }
        let y = r.linear(&format!("{p}self_attn.o_proj"), &o);
        for (hr, yr) in h.iter_mut().zip(&y) {
            hr.iter_mut().zip(yr).for_each(|(a, b)| *a += b * res);
        }
        let wpost = r.w(&format!("{p}post_attention_layernorm.weight"));
        let m: Mat = h.iter().map(|row| rms(row, &wpost, eps)).collect();
        let gate = r.linear(&format!("{p}mlp.gate_proj"), &m);
        let up = r.linear(&format!("{p}mlp.up_proj"), &m);
        let act: Mat = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g.iter().zip(u).map(|(g, u)| silu(*g) * u).collect())
            .collect();
        let y = r.linear(&format!("{p}mlp.down_proj"), &act);
        for (hr, yr) in h.iter_mut().zip(&y) {
            hr.iter_mut().zip(yr).for_each(|(a, b)| *a += b * res);
        }
    }
    let wn = r.w("model.norm.weight");
    let hn: Mat = h
        .iter()
        .map(|row| rms(row, &wn, eps).iter().map(|x| x / div).collect())
        .collect();
    let head = if cfg["tie_word_embeddings"] == true {
        "model.embed_tokens"
    } else {
        "lm_head"
    };
    r.linear(head, &hn)
}

fn candle_logits(dir: &Path, cfg: &AnyConfig, seqs: &[Vec<u32>]) -> Vec<Vec<Vec<f32>>> {
    let ck = Checkpoint::open(dir).unwrap();
    ck.validate_exact(&cfg.expected_tensors()).unwrap();
    let model = AnyModel::load(&ck, cfg, DType::F32, &Device::Cpu).unwrap();
    let layers: Vec<_> = (0..cfg.num_hidden_layers())
        .map(|i| model.load_layer(&ck, i).unwrap())
        .collect();
    let t = seqs[0].len();
    let flat: Vec<u32> = seqs.iter().flatten().copied().collect();
    let ids = Tensor::from_vec(flat, (seqs.len(), t), &Device::Cpu).unwrap();
    let logits = model.forward(&ids, &layers).unwrap();
    (0..seqs.len())
        .map(|b| logits.get(b).unwrap().to_vec2().unwrap())
        .collect()
}

fn seqs(t: usize) -> Vec<Vec<u32>> {
    (0..2)
        .map(|s| {
            (0..t)
                .map(|i| ((i * 37 + s * 11 + 5) % 4000) as u32)
                .collect()
        })
        .collect()
}

#[test]
fn every_family_matches_the_f64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, cfg) in family_configs() {
        let dir = tmp.path().join(name);
        let c = synth(&dir, &cfg, 5);
        assert_eq!(c.family(), name);
        let ck = Checkpoint::open(&dir).unwrap();
        if name == "llama" {
            assert!(ck.contains("model.layers.1.self_attn.o_proj.bias"));
            assert!(ck.contains("model.layers.1.mlp.down_proj.bias"));
        }
        if name == "qwen2" {
            assert!(ck.contains("model.layers.0.self_attn.q_proj.bias"));
            assert!(!ck.contains("model.layers.0.self_attn.o_proj.bias"));
            assert!(!ck.contains("lm_head.weight"));
        }
        // 40 positions: past the llama3 scaling's original context (64 / 4 = 16 tokens of the
        // shortest kept wavelength) so the ramp matters.
        let seqs = seqs(40);
        let got = candle_logits(&dir, &c, &seqs);
        for (b, seq) in seqs.iter().enumerate() {
            let want = reference_logits(&ck, &cfg, seq);
            let scale = want.iter().flatten().fold(0f64, |m, x| m.max(x.abs()));
            let err = want
                .iter()
                .flatten()
                .zip(got[b].iter().flatten())
                .fold(0f64, |m, (a, b)| m.max((a - *b as f64).abs()));
            assert!(scale > 1e-3, "{name}: degenerate logits");
            assert!(
                err / scale < 1e-4,
                "{name} sequence {b}: rel err {}",
                err / scale
            );
        }
    }
}

/// MiniCPM is MiniCPM-SALA with every layer a softmax-attention layer and no output gate: the
/// two forwards agree on the same weights.
#[test]
fn minicpm_agrees_with_the_sala_forward() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sala: Value = serde_json::from_str(soar_gptq::model::config::TINY_CONFIG).unwrap();
    let n = sala["num_hidden_layers"].as_u64().unwrap() as usize;
    sala["mixer_types"] = json!(vec!["minicpm4"; n]);
    sala["attn_use_output_gate"] = json!(false);
    sala["attn_use_rope"] = json!(true);
    let dir = tmp.path().join("sala");
    let sala_cfg = synth(&dir, &sala, 9);
    let mut minicpm = sala.clone();
    minicpm["architectures"] = json!(["MiniCPMForCausalLM"]);
    minicpm["model_type"] = json!("minicpm");
    let dense = AnyConfig::from_json(&minicpm.to_string()).unwrap();
    assert_eq!(dense.expected_tensors(), sala_cfg.expected_tensors());
    let seqs = seqs(33);
    let a = candle_logits(&dir, &sala_cfg, &seqs);
    let b = candle_logits(&dir, &dense, &seqs);
    let scale = a
        .iter()
        .flatten()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()));
    let err = a
        .iter()
        .flatten()
        .flatten()
        .zip(b.iter().flatten().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(err / scale < 1e-6, "rel err {}", err / scale);
}

fn write_config(root: &Path, name: &str, cfg: &Value) -> PathBuf {
    let p = root.join(name);
    std::fs::write(&p, serde_json::to_string_pretty(cfg).unwrap()).unwrap();
    p
}

fn cli_synth(root: &Path, name: &str, cfg: &Value) -> PathBuf {
    let c = write_config(root, &format!("{name}.json"), cfg);
    let out = root.join(name);
    assert_ok(&run(&[
        "synth",
        "--config",
        c.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]));
    out
}

fn quantize(model: &Path, out: &Path, calib: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "quantize",
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--calib",
        calib.to_str().unwrap(),
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    run(&args)
}

fn json_of(o: &std::process::Output) -> Value {
    assert_ok(o);
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// synth → inspect → quantize → inspect → pack-marlin → eval-ppl on a Llama with dimensions
/// Marlin can hold, and on a Qwen2 with q/k/v biases (kept in 16 bits and applied on load).
#[test]
fn the_commands_serve_the_dense_families() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let calib = write_text(root, "calib.txt", &sample_text());
    let llama = cli_synth(
        root,
        "llama",
        &config(
            "LlamaForCausalLM",
            json!({"hidden_size": 256, "intermediate_size": 512}),
        ),
    );
    let r = json_of(&run(&["inspect", llama.to_str().unwrap(), "--json"]));
    assert_eq!(r["architecture"], "LlamaForCausalLM");
    assert_eq!(r["family"], "llama");
    assert_eq!(r["mixer_types"], json!(["attention", "attention"]));
    let o = run(&["inspect", llama.to_str().unwrap()]);
    assert!(
        stdout(&o).contains("dense softmax attention"),
        "{}",
        stdout(&o)
    );

    let gptq = root.join("llama-gptq");
    let rep = json_of(&quantize(&llama, &gptq, &calib, &["--json"]));
    let modules = rep["modules"].as_array().unwrap();
    assert_eq!(modules.len(), 2 * 7, "q, k, v, o, gate, up, down per layer");
    assert!(modules.iter().all(|m| m["quantized"] == true));
    let groups: Vec<&str> = modules[..7]
        .iter()
        .map(|m| m["group"].as_str().unwrap())
        .collect();
    assert_eq!(
        groups,
        ["qkv", "qkv", "qkv", "o", "gate_up", "gate_up", "down"]
    );
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(gptq.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["quantization_config"]["bits"], 4);
    let q = json_of(&run(&["inspect", gptq.to_str().unwrap(), "--json"]));
    assert!(
        q["validated_against"]
            .as_str()
            .unwrap()
            .starts_with("Llama layout"),
        "{}",
        q["validated_against"]
    );
    // Same inputs, same bytes.
    let again = root.join("llama-gptq-2");
    assert_ok(&quantize(&llama, &again, &calib, &[]));
    let manifest = |d: &Path| std::fs::read_to_string(d.join("manifest.json")).unwrap();
    assert_eq!(manifest(&gptq), manifest(&again));

    let marlin = root.join("llama-marlin");
    assert_ok(&run(&[
        "pack-marlin",
        "--in",
        gptq.to_str().unwrap(),
        "--out",
        marlin.to_str().unwrap(),
    ]));
    let c = json_of(&run(&[
        "eval-ppl",
        "--model",
        llama.to_str().unwrap(),
        "--compare",
        gptq.to_str().unwrap(),
        "--compare",
        marlin.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "4",
        "--device",
        "cpu",
        "--json",
    ]));
    let (g, m) = (&c["compared"][0], &c["compared"][1]);
    assert_eq!(g["ppl"], m["ppl"], "Marlin decodes to the GPTQ weights");
    assert!(g["mean_kl"].as_f64().unwrap() > 0.0);
    assert!(g["top1_agreement"].as_f64().unwrap() > 0.5);

    // Qwen2: the biases stay BF16 next to the quantized weights, and are used.
    let qwen = cli_synth(
        root,
        "qwen2",
        &config("Qwen2ForCausalLM", json!({"tie_word_embeddings": true})),
    );
    let qq = root.join("qwen2-gptq");
    assert_ok(&quantize(&qwen, &qq, &calib, &["--group-size", "64"]));
    let ck = Checkpoint::open(&qq).unwrap();
    assert!(ck.contains("model.layers.0.self_attn.q_proj.bias"));
    assert!(ck.contains("model.layers.0.self_attn.q_proj.qweight"));
    assert!(!ck.contains("lm_head.weight"));
    let c = json_of(&run(&[
        "eval-ppl",
        "--model",
        qwen.to_str().unwrap(),
        "--compare",
        qq.to_str().unwrap(),
        "--seqlen",
        "64",
        "--max-windows",
        "2",
        "--bos",
        "--device",
        "cpu",
        "--json",
    ]));
    assert!(c["compared"][0]["top1_agreement"].as_f64().unwrap() > 0.5);
    // 128 = 2 heads of 64 rows: Marlin needs K % 128 == 0, which 128 is, and N % 64 == 0.
    // Group size 64 is beyond the legacy marlin method (128 or -1): refused for an engine,
    // written for other B/s readers with --engine none.
    let qm = root.join("qwen2-marlin");
    let pack = |extra: &[&str]| {
        let mut args = vec![
            "pack-marlin",
            "--in",
            qq.to_str().unwrap(),
            "--out",
            qm.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        run(&args)
    };
    assert_fails(&pack(&[]), 1, "the legacy marlin method takes 128 or -1");
    assert!(!qm.exists());
    assert_ok(&pack(&["--engine", "none"]));
}

#[test]
fn unsupported_architectures_and_lengths_fail_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let calib = write_text(root, "calib.txt", &sample_text());
    let model = cli_synth(
        root,
        "mistral",
        &config("MistralForCausalLM", json!({"sliding_window": 32})),
    );
    // A window above the sliding window is refused before any work.
    let out = root.join("q");
    let o = quantize(&model, &out, &calib, &[]);
    assert_fails(&o, 1, "sliding_window = 32");
    assert!(!out.exists() && !soar_gptq::checkpoint::output_dir::partial_path(&out).exists());
    let o = run(&[
        "eval-ppl",
        "--model",
        model.to_str().unwrap(),
        "--seqlen",
        "600",
        "--device",
        "cpu",
    ]);
    assert_fails(&o, 1, "max_position_embeddings = 512");

    // An architecture the tool does not run: every command names it and lists the supported.
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = json!(["GPTNeoXForCausalLM"]);
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    for args in [
        vec!["inspect", model.to_str().unwrap()],
        vec![
            "eval-ppl",
            "--model",
            model.to_str().unwrap(),
            "--device",
            "cpu",
        ],
    ] {
        let o = run(&args);
        assert_fails(&o, 1, "GPTNeoXForCausalLM");
        assert!(
            stderr(&o).contains(
                "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MiniCPMForCausalLM"
            ),
            "{}",
            stderr(&o)
        );
    }
    let o = quantize(&model, &out, &calib, &[]);
    assert_fails(&o, 1, "unsupported; this tool runs MiniCPMSALAForCausalLM");
}
