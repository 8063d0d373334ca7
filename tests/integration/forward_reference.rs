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

/// InfLLM-v2 as docs/model.md (InfLLM-v2) describes the official code, for one sequence, in
/// f64 with per-token loops, written without the crate's code: the blocks each token of kv head
/// `g` attends to. `q` rows hold all query heads (`nh·d`), `k` rows all kv heads (`nkv·d`). The
/// stage-1 head sums are rounded to BF16, as the official kernel stores them.
fn infllm_selection_ref(q: &Mat, k: &Mat, cfg: &Config, g: usize) -> Vec<Vec<usize>> {
    let sc = &cfg.sparse_config;
    let (nh, nkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let per = nh / nkv;
    let t_len = q.len();
    let scale = 1.0 / (d as f64).sqrt();
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    // Compressed keys: means of complete windows of `w` keys every `st`.
    let compress = |w: usize, st: usize| -> Mat {
        let n = if t_len < w { 0 } else { (t_len - w) / st + 1 };
        (0..n)
            .map(|j| {
                (0..d)
                    .map(|e| (st * j..st * j + w).map(|s| k[s][g * d + e]).sum::<f64>() / w as f64)
                    .collect()
            })
            .collect()
    };
    let (w1, s1) = (sc.kernel_size, sc.kernel_stride);
    let (k1, k2) = (compress(w1, s1), compress(4 * w1, 4 * s1));
    // Visible windows of query i: the kernel's integer formula (C division truncates).
    let visible = |i: usize, st: usize, n: usize| -> usize {
        let (n, st, t) = (n as i64, st as i64, t_len as i64);
        let off = n - (t - st + 1) / st;
        (((i as i64 + 1) / st - 1 + off).max(0)).min(n) as usize
    };
    let bs = sc.block_size;
    let nb = t_len.div_ceil(bs);
    let local = sc.window_size / bs;
    let kk = (sc.topk + local).min(nb);
    let r = bs / s1;
    (0..t_len)
        .map(|i| {
            let (l1, l2) = (visible(i, s1, k1.len()), visible(i, 4 * s1, k2.len()));
            let mut p = vec![0.0f64; k1.len()];
            if l2 > 0 {
                for h in g * per..(g + 1) * per {
                    let qh = &q[i][h * d..(h + 1) * d];
                    let s2: Vec<f64> = (0..l2).map(|c| scale * dot(qh, &k2[c])).collect();
                    let m = s2.iter().cloned().fold(f64::MIN, f64::max);
                    let lse = m + s2.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                    for (j, pj) in p.iter_mut().enumerate().take(l1) {
                        *pj += (scale * dot(qh, &k1[j]) - lse).exp();
                    }
                }
                for pj in p.iter_mut() {
                    *pj = half::bf16::from_f64(*pj).to_f64();
                }
            }
            let qb = i / bs;
            let score = |b: usize| -> f64 {
                if b < sc.init_blocks || (b <= qb && qb <= b + local) {
                    return f64::INFINITY;
                }
                let lo = (r * b).saturating_sub(1);
                let hi = (r * b + r).min(k1.len());
                if hi > lo {
                    p[lo..hi].iter().cloned().fold(f64::NEG_INFINITY, f64::max)
                } else {
                    f64::NEG_INFINITY
                }
            };
            let mut order: Vec<usize> = (0..nb).collect();
            order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
            let mut sel: Vec<usize> = order[..kk].iter().copied().filter(|&b| b <= qb).collect();
            sel.sort();
            sel
        })
        .collect()
}

/// Stage 2 in f64: each token's softmax attention over the keys of its selected blocks at or
/// before it (`sel[g][i]`), per query head.
fn infllm_attend_ref(q: &Mat, k: &Mat, v: &Mat, cfg: &Config, sel: &[Vec<Vec<usize>>]) -> Mat {
    let (nh, nkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let bs = cfg.sparse_config.block_size;
    let t_len = q.len();
    let mut o = vec![vec![0.0; nh * d]; t_len];
    for h in 0..nh {
        let g = h / (nh / nkv);
        for t in 0..t_len {
            let keys: Vec<usize> = sel[g][t]
                .iter()
                .flat_map(|&b| b * bs..((b + 1) * bs).min(t + 1))
                .collect();
            let scores: Vec<f64> = keys
                .iter()
                .map(|&s| {
                    (0..d)
                        .map(|i| q[t][h * d + i] * k[s][g * d + i])
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
            for (s, sc) in keys.iter().zip(&scores) {
                let pr = (sc - m).exp() / z;
                for i in 0..d {
                    o[t][h * d + i] += pr * v[*s][g * d + i];
                }
            }
        }
    }
    o
}

/// Dense causal attention as a selection: every block up to the token's own.
fn all_blocks(t_len: usize, bs: usize, nkv: usize) -> Vec<Vec<Vec<usize>>> {
    vec![(0..t_len).map(|t| (0..=t / bs).collect()).collect(); nkv]
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
                let (nkv, bs) = (cfg.num_key_value_heads, cfg.sparse_config.block_size);
                let sel = if cfg.sparse_runs(t_len) {
                    (0..nkv)
                        .map(|g| infllm_selection_ref(&q, &k, cfg, g))
                        .collect()
                } else {
                    all_blocks(t_len, bs, nkv)
                };
                let o = infllm_attend_ref(&q, &k, &v, cfg, &sel);
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

/// `[T][width]` rows of seeded normal values, and the same as a `[1, T, heads, d]` f32 tensor.
fn random_rows(t: usize, heads: usize, d: usize, seed: u64) -> (Mat, Tensor) {
    let mut rng = soar_gptq::rng::SplitMix64::new(seed);
    let v: Vec<f32> = rng.normals(t * heads * d);
    let rows = v
        .chunks(heads * d)
        .map(|r| r.iter().map(|&x| x as f64).collect())
        .collect();
    let t4 = Tensor::from_vec(v, (1, t, heads, d), &Device::Cpu).unwrap();
    (rows, t4)
}

fn sparse_cfg() -> Config {
    soar_gptq::model::config::preset("tiny-sparse").unwrap()
}

fn max_rel(want: &Mat, got: &[Vec<f32>]) -> f64 {
    let scale = want.iter().flatten().fold(0f64, |m, x| m.max(x.abs()));
    let err = want
        .iter()
        .flatten()
        .zip(got.iter().flatten())
        .fold(0f64, |m, (a, b)| m.max((a - *b as f64).abs()));
    err / scale
}

/// Stage 2 on hand-made selections (ragged, with gaps, −1 padding, the own block always in):
/// the composed form equals the f64 reference; a selection of every block is dense attention.
#[test]
fn block_sparse_attention_matches_the_f64_reference_on_hand_made_selections() {
    use soar_gptq::model::infllm;
    let cfg = sparse_cfg();
    let ic = cfg.infllm().unwrap();
    let (nh, nkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    for t in [70, 300, 641] {
        let (q, qt) = random_rows(t, nh, d, 1 + t as u64);
        let (k, kt) = random_rows(t, nkv, d, 2 + t as u64);
        let (v, vt) = random_rows(t, nkv, d, 3 + t as u64);
        let kk = ic.k(t);
        let mut rng = soar_gptq::rng::SplitMix64::new(t as u64);
        // Per token: its own block, then random earlier ones, up to k.
        let hand: Vec<Vec<Vec<usize>>> = (0..nkv)
            .map(|_| {
                (0..t)
                    .map(|i| {
                        let qb = i / ic.block_size;
                        let mut s = vec![qb];
                        for _ in 0..kk - 1 {
                            let b = rng.below(qb + 1);
                            if !s.contains(&b) && rng.below(3) > 0 {
                                s.push(b);
                            }
                        }
                        s.sort();
                        s
                    })
                    .collect()
            })
            .collect();
        let flat: Vec<i32> = hand
            .iter()
            .flat_map(|g| {
                g.iter().flat_map(|s| {
                    let mut row: Vec<i32> = s.iter().map(|&b| b as i32).collect();
                    row.resize(kk, -1);
                    row
                })
            })
            .collect();
        let got = infllm::block_sparse_attention(&qt, &kt, &vt, &flat, &ic).unwrap();
        let got: Vec<Vec<f32>> = got.get(0).unwrap().to_vec2().unwrap();
        let want = infllm_attend_ref(&q, &k, &v, &cfg, &hand);
        let e = max_rel(&want, &got);
        assert!(e < 1e-5, "T = {t}: max |Δ| / max |o| = {e}");
        // Every block selected: dense causal attention.
        let all = all_blocks(t, ic.block_size, nkv);
        let flat: Vec<i32> = all
            .iter()
            .flat_map(|g| {
                g.iter().flat_map(|s| {
                    let mut row: Vec<i32> = s.iter().map(|&b| b as i32).collect();
                    row.resize(ic.blocks(t).max(kk), -1);
                    row
                })
            })
            .collect();
        let wide = infllm::InfllmV2 {
            topk: ic.blocks(t).max(kk),
            ..ic
        };
        let sparse = infllm::block_sparse_attention(&qt, &kt, &vt, &flat, &wide).unwrap();
        let dense = soar_gptq::model::nn::causal_attention_composed(&qt, &kt, &vt, false).unwrap();
        let diff = (&sparse - &dense)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            diff < 1e-5,
            "T = {t}: all blocks vs dense attention differ by {diff}"
        );
    }
}

/// The block selection (compressed keys, stage-1 scores with the second compressor's
/// normaliser, pooling, forced blocks, top-k with the lower index winning ties, the kernel's
/// visibility off-by-one at T ≡ 15 mod 16 and T ≡ 63 mod 64) equals the f64 reference, except
/// where a block's score is within one BF16 step of the cut, where the rounding of an f32 and an
/// f64 sum may order them differently.
#[test]
fn block_selection_matches_the_f64_reference() {
    use soar_gptq::model::infllm;
    let cfg = sparse_cfg();
    let ic = cfg.infllm().unwrap();
    let (nh, nkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let mut near_ties = 0;
    for t in [513, 1039, 1087, 1500] {
        let (q, qt) = random_rows(t, nh, d, 10 + t as u64);
        let (k, kt) = random_rows(t, nkv, d, 20 + t as u64);
        let got = infllm::selection(&ic, &qt, &kt).unwrap();
        let kk = ic.k(t);
        for g in 0..nkv {
            let want = infllm_selection_ref(&q, &k, &cfg, g);
            for (i, w) in want.iter().enumerate() {
                let row = &got[(g * t + i) * kk..][..kk];
                let mine: Vec<usize> = row
                    .iter()
                    .filter(|&&b| b >= 0)
                    .map(|&b| b as usize)
                    .collect();
                assert!(
                    row.iter().skip(mine.len()).all(|&b| b == -1),
                    "T {t} token {i}: {row:?}"
                );
                if &mine != w {
                    near_ties += 1;
                    assert!(
                        mine.len() == w.len()
                            && mine.iter().filter(|b| !w.contains(b)).count() == 1,
                        "T {t} kv {g} token {i}: {mine:?} vs the reference's {w:?}"
                    );
                }
            }
        }
        // Tokens that see no more than k blocks take all of them (dense); later ones take k.
        let row = |i: usize| -> Vec<i32> { got[i * kk..(i + 1) * kk].to_vec() };
        assert_eq!(row(64 * 3 + 5), vec![0, 1, 2, 3, -1, -1]);
        assert!(row(t - 1).iter().all(|&b| b >= 0));
    }
    assert!(near_ties <= 4, "{near_ties} rows differ from the reference");
}

/// The whole forward above `sparse_config.dense_len` (InfLLM-v2 in both sparse layers) against
/// the f64 reference, at a length where the kernel's K2 visibility off-by-one applies
/// (1087 ≡ 63 mod 64); and `--sparse-attention always` below it equals dense attention while
/// every block is selected.
#[test]
fn sparse_forward_above_dense_len_matches_the_f64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let cfg = sparse_cfg();
    soar_gptq::synth::synth(
        &cfg.clone().into(),
        &soar_gptq::synth::SynthOptions {
            out: dir.clone(),
            seed: 5,
            tokenizer: None,
            config_file: None,
            shard_bytes: 4_000_000,
            force: false,
        },
    )
    .unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let forward = |cfg: &Config, seq: &[u32]| -> Vec<Vec<f32>> {
        let model = Model::load(&ck, cfg, DType::F32, &Device::Cpu).unwrap();
        let layers: Vec<_> = (0..cfg.num_hidden_layers)
            .map(|i| model.load_layer(&ck, i).unwrap())
            .collect();
        let ids = Tensor::from_vec(seq.to_vec(), (1, seq.len()), &Device::Cpu).unwrap();
        model
            .forward(&ids, &layers)
            .unwrap()
            .get(0)
            .unwrap()
            .to_vec2()
            .unwrap()
    };
    let seq: Vec<u32> = (0..1087u32).map(|i| (i * 37 + 5) % 4000).collect();
    assert!(cfg.sparse_runs(seq.len()));
    let want = reference_logits(&ck, &cfg, &seq);
    let e = max_rel(&want, &forward(&cfg, &seq));
    assert!(e < 1e-4, "max |Δ| / max |logit| = {e}");
    // Below dense_len with the sparse path forced: 6 blocks of 64 tokens are kept per token, so
    // up to 384 tokens every block is, and the result is dense attention.
    let short = &seq[..380];
    let mut always = cfg.clone();
    always.sparse_attention = soar_gptq::model::SparseAttention::Always;
    let (a, b) = (forward(&always, short), forward(&cfg, short));
    let diff = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff < 1e-4, "always vs auto below dense_len: {diff}");
}
