//! The candle forward against a naive f64 implementation written straight from
//! docs/model.md, Forward pass (per-token loops, recurrent Simple-GLA, explicit softmax).

use candle_core::{DType, Device, Tensor};
use soar_gptq::checkpoint::Checkpoint;
use soar_gptq::model::{Config, MixerKind, Model};

struct Ref<'a> {
    ck: &'a Checkpoint,
    cfg: &'a Config,
}

type Mat = Vec<Vec<f64>>;

impl Ref<'_> {
    fn w(&self, name: &str) -> (Vec<f64>, Vec<usize>) {
        let e = self.ck.get(name).unwrap_or_else(|| panic!("{name}"));
        (
            self.ck
                .f32_data(name)
                .unwrap()
                .into_iter()
                .map(|x| x as f64)
                .collect(),
            e.shape.clone(),
        )
    }
    /// y[t] = W x[t] for W [out, in].
    fn linear(&self, name: &str, x: &Mat) -> Mat {
        let (w, s) = self.w(name);
        let (out, inp) = (s[0], s[1]);
        x.iter()
            .map(|row| {
                (0..out)
                    .map(|o| (0..inp).map(|i| w[o * inp + i] * row[i]).sum())
                    .collect()
            })
            .collect()
    }
    fn rms(&self, x: &[f64], w: &[f64]) -> Vec<f64> {
        let var = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (var + self.cfg.rms_norm_eps).sqrt();
        x.iter().zip(w).map(|(v, g)| v * r * g).collect()
    }
    fn rope(&self, x: &[f64], pos: usize) -> Vec<f64> {
        let d = x.len();
        let half = d / 2;
        let mut out = vec![0.0; d];
        for j in 0..d {
            let ang = pos as f64
                * self
                    .cfg
                    .rope_theta
                    .powf(-2.0 * (j % half) as f64 / d as f64);
            let rot = if j < half { -x[j + half] } else { x[j - half] };
            out[j] = x[j] * ang.cos() + rot * ang.sin();
        }
        out
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// ALiBi slopes for n a power of two, written independently of the crate.
fn slopes(n: usize) -> Vec<f64> {
    let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
    (1..=n).map(|i| start.powi(i as i32)).collect()
}

fn reference_logits(ck: &Checkpoint, cfg: &Config, ids: &[u32]) -> Mat {
    let r = Ref { ck, cfg };
    let t_len = ids.len();
    let hdim = cfg.hidden_size;
    let (emb, _) = r.w("model.embed_tokens.weight");
    let mut h: Mat = ids
        .iter()
        .map(|&i| {
            (0..hdim)
                .map(|j| emb[i as usize * hdim + j] * cfg.scale_emb)
                .collect()
        })
        .collect();
    let res = cfg.scale_depth / (cfg.num_hidden_layers as f64).sqrt();
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        let (win, _) = r.w(&format!("{p}input_layernorm.weight"));
        let x: Mat = h.iter().map(|row| r.rms(row, &win)).collect();
        let q = r.linear(&format!("{p}self_attn.q_proj.weight"), &x);
        let k = r.linear(&format!("{p}self_attn.k_proj.weight"), &x);
        let v = r.linear(&format!("{p}self_attn.v_proj.weight"), &x);
        let o: Mat = match cfg.mixer(l) {
            MixerKind::Sparse => {
                let (nh, nkv, d) = (
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    cfg.head_dim,
                );
                let mut o = vec![vec![0.0; nh * d]; t_len];
                for hh in 0..nh {
                    let g = hh / (nh / nkv);
                    for t in 0..t_len {
                        let scores: Vec<f64> = (0..=t)
                            .map(|s| {
                                (0..d)
                                    .map(|i| q[t][hh * d + i] * k[s][g * d + i])
                                    .sum::<f64>()
                                    / (d as f64).sqrt()
                            })
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
                let gate = r.linear(&format!("{p}self_attn.o_gate.weight"), &x);
                o.iter()
                    .zip(&gate)
                    .map(|(a, b)| a.iter().zip(b).map(|(a, b)| a * sigmoid(*b)).collect())
                    .collect()
            }
            MixerKind::Lightning => {
                let (nh, d) = (cfg.lightning_nh, cfg.lightning_head_dim);
                let (qn, _) = r.w(&format!("{p}self_attn.q_norm.weight"));
                let (kn, _) = r.w(&format!("{p}self_attn.k_norm.weight"));
                let gam: Vec<f64> = slopes(nh).iter().map(|s| (-s).exp()).collect();
                let scale = 1.0 / (d as f64).sqrt();
                let mut o = vec![vec![0.0; nh * d]; t_len];
                for hh in 0..nh {
                    let mut state = vec![vec![0.0; d]; d];
                    for t in 0..t_len {
                        let qh = r.rope(&r.rms(&q[t][hh * d..(hh + 1) * d], &qn), t);
                        let kh = r.rope(&r.rms(&k[t][hh * d..(hh + 1) * d], &kn), t);
                        let vh = &v[t][hh * d..(hh + 1) * d];
                        for a in 0..d {
                            for b in 0..d {
                                state[a][b] = gam[hh] * state[a][b] + kh[a] * vh[b];
                            }
                        }
                        for b in 0..d {
                            o[t][hh * d + b] =
                                scale * (0..d).map(|a| qh[a] * state[a][b]).sum::<f64>();
                        }
                    }
                }
                let (on, _) = r.w(&format!("{p}self_attn.o_norm.weight"));
                let z = r.linear(&format!("{p}self_attn.z_proj.weight"), &x);
                o.iter()
                    .zip(&z)
                    .map(|(a, zz)| {
                        r.rms(a, &on)
                            .iter()
                            .zip(zz)
                            .map(|(a, b)| a * sigmoid(*b))
                            .collect()
                    })
                    .collect()
            }
        };
        let y = r.linear(&format!("{p}self_attn.o_proj.weight"), &o);
        for (hr, yr) in h.iter_mut().zip(&y) {
            for (a, b) in hr.iter_mut().zip(yr) {
                *a += b * res;
            }
        }
        let (wpost, _) = r.w(&format!("{p}post_attention_layernorm.weight"));
        let m: Mat = h.iter().map(|row| r.rms(row, &wpost)).collect();
        let gate = r.linear(&format!("{p}mlp.gate_proj.weight"), &m);
        let up = r.linear(&format!("{p}mlp.up_proj.weight"), &m);
        let act: Mat = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g.iter().zip(u).map(|(g, u)| g * sigmoid(*g) * u).collect())
            .collect();
        let y = r.linear(&format!("{p}mlp.down_proj.weight"), &act);
        for (hr, yr) in h.iter_mut().zip(&y) {
            for (a, b) in hr.iter_mut().zip(yr) {
                *a += b * res;
            }
        }
    }
    let (wn, _) = r.w("model.norm.weight");
    let div = cfg.hidden_size as f64 / cfg.dim_model_base;
    let hn: Mat = h
        .iter()
        .map(|row| r.rms(row, &wn).iter().map(|x| x / div).collect())
        .collect();
    r.linear("lm_head.weight", &hn)
}

fn synth_tiny(dir: &std::path::Path, seed: u64) -> Config {
    let cfg = soar_gptq::model::config::preset("tiny").unwrap();
    soar_gptq::synth::synth(
        &cfg.clone().into(),
        &soar_gptq::synth::SynthOptions {
            out: dir.to_path_buf(),
            seed,
            tokenizer: None,
            config_file: None,
            shard_bytes: 4_000_000,
            force: false,
        },
    )
    .unwrap();
    cfg
}

#[test]
fn candle_forward_matches_the_f64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let cfg = synth_tiny(&dir, 7);
    let ck = Checkpoint::open(&dir).unwrap();
    assert!(ck.shards.len() > 1, "the test model should be sharded");
    ck.validate_exact(&cfg.expected_tensors()).unwrap();
    let model = Model::load(&ck, &cfg, DType::F32, &Device::Cpu).unwrap();
    let layers: Vec<_> = (0..cfg.num_hidden_layers)
        .map(|i| model.load_layer(&ck, i).unwrap())
        .collect();
    // Two sequences in one batch; 70 tokens crosses the 64-token GLA chunk boundary.
    let t = 70;
    let seqs: Vec<Vec<u32>> = (0..2)
        .map(|s| {
            (0..t)
                .map(|i| ((i * 37 + s * 11 + 5) % 4000) as u32)
                .collect()
        })
        .collect();
    let flat: Vec<u32> = seqs.iter().flatten().copied().collect();
    let ids = Tensor::from_vec(flat, (2, t), &Device::Cpu).unwrap();
    let logits = model.forward(&ids, &layers).unwrap();
    for (b, seq) in seqs.iter().enumerate() {
        let want = reference_logits(&ck, &cfg, seq);
        let got: Vec<Vec<f32>> = logits.get(b).unwrap().to_vec2().unwrap();
        let scale = want.iter().flatten().fold(0f64, |m, x| m.max(x.abs()));
        let err = want
            .iter()
            .flatten()
            .zip(got.iter().flatten())
            .fold(0f64, |m, (a, b)| m.max((a - *b as f64).abs()));
        assert!(scale > 1e-3, "degenerate logits");
        assert!(
            err / scale < 1e-4,
            "sequence {b}: max |Δ| / max |logit| = {}",
            err / scale
        );
    }
}

#[test]
fn bf16_forward_stays_close_to_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let cfg = synth_tiny(&dir, 3);
    let ck = Checkpoint::open(&dir).unwrap();
    let ids = Tensor::from_vec(
        (0..40u32).map(|i| (i * 13) % 4000).collect::<Vec<_>>(),
        (1, 40),
        &Device::Cpu,
    )
    .unwrap();
    let run = |dt| {
        let m = Model::load(&ck, &cfg, dt, &Device::Cpu).unwrap();
        let layers: Vec<_> = (0..cfg.num_hidden_layers)
            .map(|i| m.load_layer(&ck, i).unwrap())
            .collect();
        m.forward(&ids, &layers).unwrap()
    };
    let (a, b) = (run(DType::F32), run(DType::BF16));
    let diff = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let scale = a
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff / scale < 0.1, "bf16 drifted: {}", diff / scale);
}
