//! Quantized checkpoints end to end through the library: reading a hand-made GPTQ file,
//! pack-marlin round trips (trivial and act-order g_idx), refusals that leave nothing behind, and
//! inspect (manifest corruption, gptq_marlin eligibility, fused groups, validation errors).

use serde_json::{json, Value};
use soar_gptq::checkpoint::manifest::write_manifest;
use soar_gptq::checkpoint::output_dir::partial_path;
use soar_gptq::checkpoint::shards::{write_sharded, TensorSpec};
use soar_gptq::checkpoint::{Checkpoint, Dtype};
use soar_gptq::engine::Engine;
use soar_gptq::format::{
    dequantize_module, pack_qweight, pack_qzeros, quantized_prefixes, read_quant_info,
    validate_quantized_modules, QuantFormat,
};
use soar_gptq::inspect::quantized::inspect_quantized;

fn pack_marlin_checkpoint(
    input: &Path,
    out: &Path,
    force: bool,
) -> anyhow::Result<soar_gptq::pack_marlin::PackMarlinReport> {
    soar_gptq::pack_marlin::pack_marlin_checkpoint(input, out, force, Some(Engine::Sglang))
}
use soar_gptq::model::config::preset;
use soar_gptq::rng::SplitMix64;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy)]
struct Q {
    bits: u8,
    group: i32,
    sym: bool,
    v2: bool,
    act_order: bool,
}

const SYM4: Q = Q {
    bits: 4,
    group: 128,
    sym: true,
    v2: false,
    act_order: false,
};

fn quant_config(q: Q) -> Value {
    json!({
        "quant_method": "gptq", "bits": q.bits, "group_size": q.group, "desc_act": q.act_order,
        "sym": q.sym, "lm_head": false,
        "checkpoint_format": if q.v2 { "gptq_v2" } else { "gptq" },
        "pack_dtype": "int32", "damp_percent": 0.01, "true_sequential": true,
        "static_groups": !q.act_order, "meta": {"quantizer": ["format-test"]}
    })
}

/// Writes a GPTQ checkpoint: `quantized` modules `(prefix, N, K)` with random codes, zeros,
/// scales and (act-order) g_idx, `plain` BF16 tensors, `config` as config.json and its
/// quantization_config as quantize_config.json. Small shards, so several files.
fn write_gptq(
    dir: &Path,
    quantized: &[(String, usize, usize)],
    plain: &[(String, Vec<usize>)],
    q: Q,
    config: &Value,
    seed: u64,
) {
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = SplitMix64::new(seed);
    let mut data: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    let le = |w: &[i32]| w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    for (p, n, k) in quantized {
        let (n, k) = (*n, *k);
        let maxq = (1u64 << q.bits) - 1;
        let g = if q.group < 0 { k } else { q.group as usize };
        let groups = k.div_ceil(g);
        let codes: Vec<u8> = (0..k * n)
            .map(|_| rng.below(maxq as usize + 1) as u8)
            .collect();
        let zeros: Vec<u8> = (0..groups * n)
            .map(|_| {
                if q.sym {
                    1u8 << (q.bits - 1)
                } else {
                    let lo = u64::from(!q.v2);
                    (lo as usize + rng.below((maxq + 1 - lo) as usize)) as u8
                }
            })
            .collect();
        let scales: Vec<u8> = (0..groups * n)
            .flat_map(|_| half::f16::from_f32(0.001 + 0.05 * (rng.unit() as f32)).to_le_bytes())
            .collect();
        let mut g_idx: Vec<i32> = (0..k).map(|i| (i / g) as i32).collect();
        if q.act_order {
            let mut perm: Vec<usize> = (0..k).collect();
            for i in (1..k).rev() {
                perm.swap(i, rng.below(i + 1));
            }
            for (i, &row) in perm.iter().enumerate() {
                g_idx[row] = (i / g) as i32;
            }
        }
        let per = 32 / q.bits as usize;
        let qweight = pack_qweight(&codes, k, n, q.bits).unwrap();
        let qzeros = pack_qzeros(
            &zeros,
            groups,
            n,
            q.bits,
            if q.v2 {
                soar_gptq::scheme::QuantFormat::GptqV2
            } else {
                soar_gptq::scheme::QuantFormat::GptqV1
            },
        )
        .unwrap();
        data.insert(
            format!("{p}.qweight"),
            (Dtype::I32, vec![k / per, n], le(&qweight)),
        );
        data.insert(
            format!("{p}.qzeros"),
            (Dtype::I32, vec![groups, n / per], le(&qzeros)),
        );
        data.insert(format!("{p}.scales"), (Dtype::F16, vec![groups, n], scales));
        data.insert(format!("{p}.g_idx"), (Dtype::I32, vec![k], le(&g_idx)));
    }
    for (name, shape) in plain {
        let numel: usize = shape.iter().product();
        let bytes = (0..numel)
            .flat_map(|_| half::bf16::from_f32((rng.unit() as f32) - 0.5).to_le_bytes())
            .collect();
        data.insert(name.clone(), (Dtype::BF16, shape.clone(), bytes));
    }
    let specs: Vec<TensorSpec> = data
        .iter()
        .map(|(n, (d, s, _))| TensorSpec::new(n.clone(), *d, s.clone()))
        .collect();
    write_sharded(dir, &specs, 1 << 20, |s, w| {
        w.write_all(&data[&s.name].2)?;
        Ok(())
    })
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    if let Some(qc) = config.get("quantization_config") {
        std::fs::write(
            dir.join("quantize_config.json"),
            serde_json::to_string_pretty(qc).unwrap(),
        )
        .unwrap();
    }
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
}

/// The tiny MiniCPM-SALA preset quantized with `q`; modules matching `skip` (a dynamic rule
/// pattern) kept BF16.
fn tiny_gptq(dir: &Path, q: Q, skip: Option<&str>, seed: u64) {
    let cfg = preset("tiny").unwrap();
    let re = skip.map(|s| regex::Regex::new(&format!("^(?:{s})")).unwrap());
    let (mut quantized, mut plain) = (vec![], vec![]);
    for (name, shape) in cfg.expected_tensors() {
        let prefix = name.strip_suffix(".weight").unwrap_or(&name).to_string();
        let linear = name.starts_with("model.layers.") && shape.len() == 2;
        if linear && !re.as_ref().is_some_and(|r| r.is_match(&prefix)) {
            quantized.push((prefix, shape[0], shape[1]));
        } else {
            plain.push((name, shape));
        }
    }
    let mut qc = quant_config(q);
    if let Some(s) = skip {
        qc["dynamic"] = json!({ format!("-:{s}"): {} });
    }
    let mut config = serde_json::to_value(&cfg).unwrap();
    config["quantization_config"] = qc;
    write_gptq(dir, &quantized, &plain, q, &config, seed);
}

/// A non-MiniCPM architecture: modules `(prefix, N, K)` plus a BF16 embedding.
fn generic_gptq(dir: &Path, modules: &[(&str, usize, usize)], q: Q) {
    let quantized: Vec<(String, usize, usize)> = modules
        .iter()
        .map(|(p, n, k)| (p.to_string(), *n, *k))
        .collect();
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "quantization_config": quant_config(q)
    });
    write_gptq(
        dir,
        &quantized,
        &[("model.embed_tokens.weight".into(), vec![32, 64])],
        q,
        &config,
        7,
    );
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every module of `gptq` dequantizes to exactly the same weights from `marlin`.
fn assert_same_weights(gptq: &Path, marlin: &Path) -> usize {
    let (gi, mi) = (
        read_quant_info(gptq).unwrap().unwrap(),
        read_quant_info(marlin).unwrap().unwrap(),
    );
    assert_eq!(mi.format, QuantFormat::Marlin);
    let (gc, mc) = (
        Checkpoint::open(gptq).unwrap(),
        Checkpoint::open(marlin).unwrap(),
    );
    let prefixes = quantized_prefixes(&gc, &gi);
    assert_eq!(prefixes, quantized_prefixes(&mc, &mi));
    for p in &prefixes {
        let (a, an, ak) = dequantize_module(&gc, &gi, p).unwrap();
        let (b, bn, bk) = dequantize_module(&mc, &mi, p).unwrap();
        assert_eq!((an, ak), (bn, bk), "{p}");
        assert!(
            bits(&a) == bits(&b),
            "{p}: Marlin dequant differs from GPTQ"
        );
    }
    prefixes.len()
}

fn safetensors_file(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut off = 0;
    for (name, dtype, shape, bytes) in tensors {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        header += &format!(
            ",\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{off},{}]}}",
            dims.join(","),
            off + bytes.len()
        );
        off += bytes.len();
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for (_, _, _, b) in tensors {
        out.extend_from_slice(b);
    }
    out
}

#[test]
fn hand_written_gptq_file_dequantizes_to_hand_computed_values() {
    // K = 32, N = 8, 4-bit, group 16, asymmetric GPTQ v1 (zeros stored minus one).
    let (k, n, g) = (32usize, 8usize, 16usize);
    let code = |k: usize, n: usize| ((3 * k + 5 * n + 1) % 16) as u32;
    let zero = |g: usize, n: usize| (1 + (g * 8 + n) % 15) as u32;
    let scale = |g: usize, n: usize| half::f16::from_f32(0.1 * (g + 1) as f32 + 0.013 * n as f32);
    let mut qweight = vec![];
    for r in 0..k / 8 {
        for col in 0..n {
            let w = (0..8).fold(0u32, |acc, i| acc | code(8 * r + i, col) << (4 * i));
            qweight.extend_from_slice(&w.to_le_bytes());
        }
    }
    let mut qzeros = vec![];
    for grp in 0..k / g {
        let w = (0..8).fold(0u32, |acc, i| acc | (zero(grp, i) - 1) << (4 * i));
        qzeros.extend_from_slice(&w.to_le_bytes());
    }
    let scales: Vec<u8> = (0..k / g)
        .flat_map(|grp| (0..n).flat_map(move |col| scale(grp, col).to_le_bytes()))
        .collect();
    let g_idx: Vec<u8> = (0..k)
        .flat_map(|i| ((i / g) as i32).to_le_bytes())
        .collect();
    let norm: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let p = "model.layers.0.mlp.down_proj";
    let file = safetensors_file(&[
        (&format!("{p}.qweight"), "I32", vec![k / 8, n], qweight),
        (&format!("{p}.qzeros"), "I32", vec![k / g, 1], qzeros),
        (&format!("{p}.scales"), "F16", vec![k / g, n], scales),
        (&format!("{p}.g_idx"), "I32", vec![k], g_idx),
        ("model.norm.weight", "F32", vec![n], norm),
    ]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), file).unwrap();
    // Settings only in quantize_config.json, AutoGPTQ style (no quant_method).
    std::fs::write(
        dir.path().join("quantize_config.json"),
        r#"{"bits": 4, "group_size": 16, "desc_act": false, "sym": false}"#,
    )
    .unwrap();
    let info = read_quant_info(dir.path()).unwrap().unwrap();
    assert_eq!(info.format, QuantFormat::GptqV1);
    assert!(!info.in_config_json);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(quantized_prefixes(&ck, &info), vec![p.to_string()]);
    let modules = validate_quantized_modules(&ck, &info, None).unwrap();
    assert_eq!((modules[0].n, modules[0].k, modules[0].groups), (n, k, 2));
    let (w, wn, wk) = dequantize_module(&ck, &info, p).unwrap();
    assert_eq!((wn, wk), (n, k));
    for row in 0..n {
        for col in 0..k {
            let grp = col / g;
            let want =
                scale(grp, row).to_f32() * (code(col, row) as i32 - zero(grp, row) as i32) as f32;
            assert_eq!(
                w[row * k + col].to_bits(),
                want.to_bits(),
                "W[{row}][{col}]"
            );
        }
    }
}

#[test]
fn pack_marlin_keeps_weights_bit_exact_with_trivial_g_idx() {
    let root = tempfile::tempdir().unwrap();
    let (gptq, out) = (root.path().join("gptq"), root.path().join("marlin"));
    let skip = r"model\.layers\.1\.mlp\.down_proj";
    tiny_gptq(&gptq, SYM4, Some(skip), 1);
    let report = pack_marlin_checkpoint(&gptq, &out, false).unwrap();
    assert_eq!(report.modules_packed, 4 * 8 - 1);
    assert_eq!(report.act_order_modules, 0);
    assert!(report.verified);
    assert_eq!(assert_same_weights(&gptq, &out), 31);

    let mc = Checkpoint::open(&out).unwrap();
    let b = mc.get("model.layers.0.self_attn.q_proj.B").unwrap();
    assert_eq!(
        (b.dtype, b.shape.clone()),
        (Dtype::I32, vec![256 / 16, 2 * 256])
    );
    let s = mc.get("model.layers.0.mlp.down_proj.s").unwrap();
    assert_eq!(
        (s.dtype, s.shape.clone()),
        (Dtype::F16, vec![768 / 128, 256])
    );
    assert!(!mc.names().any(|n| n.ends_with("g_idx_sort_indices")
        || n.ends_with(".qweight")
        || n.ends_with(".g_idx")));
    // The skipped module and the embeddings are byte-identical copies.
    let gc = Checkpoint::open(&gptq).unwrap();
    for name in [
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ] {
        assert_eq!(mc.bytes(name).unwrap(), gc.bytes(name).unwrap(), "{name}");
    }
    for file in ["config.json", "quantize_config.json"] {
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join(file)).unwrap()).unwrap();
        let q = if file == "config.json" {
            &v["quantization_config"]
        } else {
            &v
        };
        assert_eq!(q["checkpoint_format"], "marlin", "{file}");
        assert_eq!(q["quant_method"], "gptq", "{file}");
        assert!(q["dynamic"].get(format!("-:{skip}")).is_some(), "{file}");
    }
    assert!(out.join("tokenizer_config.json").is_file());
    assert!(out.join("manifest.json").is_file());
    assert!(!partial_path(&out).exists());

    // inspect of the Marlin output: valid, but not gptq_marlin for either engine.
    let r = inspect_quantized(&out).unwrap();
    assert_eq!(r.settings.checkpoint_format, "marlin");
    assert_eq!(r.quantized_modules.len(), 31);
    assert!(
        r.marlin_check.contains("31 module(s)"),
        "{}",
        r.marlin_check
    );
    for e in &r.engines {
        assert!(!e.gptq_marlin, "{e:?}");
        assert!(e.reasons.iter().any(|x| x.contains("arlin")), "{e:?}");
    }
}

#[test]
fn pack_marlin_stores_sort_indices_for_act_order() {
    let root = tempfile::tempdir().unwrap();
    let (gptq, out) = (root.path().join("gptq"), root.path().join("marlin"));
    let q = Q {
        act_order: true,
        v2: true,
        ..SYM4
    };
    tiny_gptq(&gptq, q, None, 2);
    // No engine reads the sort-indices extension: packing for SGLang is refused, naming why.
    let e = pack_marlin_checkpoint(&gptq, &out, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no act-order"), "{e}");
    assert!(!out.exists());
    let report = soar_gptq::pack_marlin::pack_marlin_checkpoint(&gptq, &out, false, None).unwrap();
    assert_eq!(report.act_order_modules, 32);
    assert_eq!(assert_same_weights(&gptq, &out), 32);
    let mc = Checkpoint::open(&out).unwrap();
    let si = mc
        .i32_data("model.layers.2.mlp.gate_proj.g_idx_sort_indices")
        .unwrap();
    assert_eq!(si.len(), 256);
    assert!(si.iter().enumerate().any(|(i, &r)| r as usize != i));
    let r = inspect_quantized(&out).unwrap();
    assert!(r.quantized_modules.iter().all(|m| m.act_order));

    // Per-channel (group -1) with act-order on another architecture: the single-group scale
    // permutation.
    let (g2, o2) = (root.path().join("g2"), root.path().join("o2"));
    let q = Q {
        group: -1,
        act_order: true,
        ..SYM4
    };
    generic_gptq(&g2, &[("model.layers.0.mlp.up_proj", 128, 256)], q);
    pack_marlin_checkpoint(&g2, &o2, false).unwrap();
    assert_eq!(assert_same_weights(&g2, &o2), 1);
}

#[test]
fn pack_marlin_refusals_name_the_module_and_leave_nothing() {
    let root = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Q, (usize, usize), &str)> = vec![
        (
            "asym",
            Q {
                sym: false,
                v2: true,
                ..SYM4
            },
            (128, 256),
            "asymmetric",
        ),
        ("bits8", Q { bits: 8, ..SYM4 }, (128, 256), "bits = 8"),
        (
            "g256",
            Q { group: 256, ..SYM4 },
            (128, 256),
            "group size 256",
        ),
        (
            "k64",
            Q { group: 64, ..SYM4 },
            (128, 64),
            "not a positive multiple of 128",
        ),
        ("n32", SYM4, (32, 256), "not a positive multiple of 64"),
    ];
    for (name, q, (n, k), needle) in cases {
        let input = root.path().join(format!("in-{name}"));
        let out = root.path().join(format!("out-{name}"));
        generic_gptq(
            &input,
            &[
                ("model.layers.0.self_attn.o_proj", n, k),
                ("model.layers.0.mlp.up_proj", 128, 256),
            ],
            q,
        );
        let err = format!(
            "{:#}",
            pack_marlin_checkpoint(&input, &out, false).unwrap_err()
        );
        assert!(
            err.contains("model.layers.0.self_attn.o_proj") && err.contains(needle),
            "{name}: {err}"
        );
        assert!(!out.exists() && !partial_path(&out).exists(), "{name}");
    }

    // Not a quantized checkpoint; already Marlin; an existing --out without --force.
    let plain = root.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let out = root.path().join("out-plain");
    let err = format!(
        "{:#}",
        pack_marlin_checkpoint(&plain, &out, false).unwrap_err()
    );
    assert!(err.contains("no quantization_config"), "{err}");
    assert!(!out.exists() && !partial_path(&out).exists());

    let (gptq, marlin) = (root.path().join("ok"), root.path().join("ok-marlin"));
    generic_gptq(&gptq, &[("model.layers.0.mlp.up_proj", 128, 256)], SYM4);
    pack_marlin_checkpoint(&gptq, &marlin, false).unwrap();
    let again = root.path().join("again");
    let err = format!(
        "{:#}",
        pack_marlin_checkpoint(&marlin, &again, false).unwrap_err()
    );
    assert!(err.contains("already a Marlin checkpoint"), "{err}");
    assert!(!again.exists() && !partial_path(&again).exists());
    let err = format!(
        "{:#}",
        pack_marlin_checkpoint(&gptq, &marlin, false).unwrap_err()
    );
    assert!(err.contains("--force"), "{err}");
    pack_marlin_checkpoint(&gptq, &marlin, true).unwrap();
    let err = format!(
        "{:#}",
        pack_marlin_checkpoint(&gptq, &gptq, true).unwrap_err()
    );
    assert!(err.contains("is the input --in"), "{err}");
    assert!(gptq.join("config.json").is_file());
}

#[test]
fn inspect_flags_a_file_corrupted_after_the_manifest() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gptq");
    tiny_gptq(&dir, SYM4, None, 3);
    write_manifest(&dir, &[]).unwrap();
    let r = inspect_quantized(&dir).unwrap();
    assert_eq!(r.manifest.as_deref(), Some("all files match their SHA-256"));
    assert!(
        r.validated_against.starts_with("MiniCPM-SALA"),
        "{}",
        r.validated_against
    );
    assert_eq!(r.quantized_modules.len(), 32);
    assert!(r.kept_modules.iter().any(|t| t.name == "lm_head.weight"));
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    // q/k/v and gate/up of 4 layers.
    assert_eq!(r.fused_groups.len(), 8);

    let mut shards: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    shards.sort();
    assert!(shards.len() > 1, "{shards:?}");
    let victim = shards.last().unwrap().clone();
    let shard = dir.join(&victim);
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let err = format!("{:#}", inspect_quantized(&dir).unwrap_err());
    assert!(
        err.contains("manifest.json") && err.contains(&victim),
        "{err}"
    );
}

#[test]
fn inspect_reports_gptq_marlin_eligibility_and_reasons() {
    let root = tempfile::tempdir().unwrap();
    let ok = root.path().join("ok");
    tiny_gptq(&ok, SYM4, None, 4);
    let r = inspect_quantized(&ok).unwrap();
    for e in &r.engines {
        assert!(e.gptq_marlin, "{e:?}");
    }
    assert_eq!(r.engines.len(), 2);

    let reasons = |dir: &Path| -> Vec<String> {
        let r = inspect_quantized(dir).unwrap();
        assert!(r.engines.iter().all(|e| !e.gptq_marlin), "{:?}", r.engines);
        r.engines[0].reasons.clone()
    };
    let asym = root.path().join("asym");
    tiny_gptq(
        &asym,
        Q {
            sym: false,
            v2: true,
            ..SYM4
        },
        None,
        5,
    );
    let why = reasons(&asym).join("\n");
    assert!(why.contains("asymmetric"), "{why}");

    let g256 = root.path().join("g256");
    generic_gptq(
        &g256,
        &[("model.layers.0.mlp.up_proj", 128, 512)],
        Q { group: 256, ..SYM4 },
    );
    let why = reasons(&g256).join("\n");
    assert!(why.contains("group_size 256"), "{why}");

    let narrow = root.path().join("narrow");
    generic_gptq(
        &narrow,
        &[("model.layers.0.self_attn.k_proj", 32, 256)],
        SYM4,
    );
    let why = reasons(&narrow).join("\n");
    assert!(
        why.contains("model.layers.0.self_attn.k_proj: N = 32"),
        "{why}"
    );

    // Settings only in quantize_config.json: not auto-detected.
    let noauto = root.path().join("noauto");
    generic_gptq(&noauto, &[("model.layers.0.mlp.up_proj", 128, 256)], SYM4);
    std::fs::write(
        noauto.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"]}"#,
    )
    .unwrap();
    let why = reasons(&noauto).join("\n");
    assert!(
        why.contains("config.json has no quantization_config"),
        "{why}"
    );
}

#[test]
fn inspect_rejects_split_fused_groups_and_broken_sets() {
    let root = tempfile::tempdir().unwrap();
    let split = root.path().join("split");
    tiny_gptq(
        &split,
        SYM4,
        Some(r"model\.layers\.0\.self_attn\.k_proj"),
        6,
    );
    let err = format!("{:#}", inspect_quantized(&split).unwrap_err());
    assert!(
        err.contains("fused group model.layers.0.self_attn.qkv_proj")
            && err.contains("model.layers.0.self_attn.k_proj"),
        "{err}"
    );

    // Engines match dynamic rules against fused names: a rule that only names the members of a
    // kept fused group is flagged, one that also matches gate_up_proj is not.
    let members = root.path().join("members");
    tiny_gptq(
        &members,
        SYM4,
        Some(r"model\.layers\.3\.mlp\.(gate|up)_proj"),
        6,
    );
    let r = inspect_quantized(&members).unwrap();
    assert!(
        r.warnings.len() == 1 && r.warnings[0].contains("model.layers.3.mlp.gate_up_proj"),
        "{:?}",
        r.warnings
    );
    let fused = root.path().join("fused");
    tiny_gptq(&fused, SYM4, Some(r"model\.layers\.3\.mlp\.(gate|up)"), 6);
    assert!(inspect_quantized(&fused).unwrap().warnings.is_empty());

    // A missing qzeros: the checkpoint is rebuilt without it.
    let broken = root.path().join("broken");
    generic_gptq(
        &broken,
        &[
            ("model.layers.0.mlp.up_proj", 128, 256),
            ("model.layers.0.mlp.down_proj", 256, 128),
        ],
        SYM4,
    );
    let ck = Checkpoint::open(&broken).unwrap();
    let keep: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = ck
        .entries()
        .filter(|(n, _)| n.as_str() != "model.layers.0.mlp.down_proj.qzeros")
        .map(|(n, e)| {
            (
                n.clone(),
                e.dtype,
                e.shape.clone(),
                ck.bytes(n).unwrap().to_vec(),
            )
        })
        .collect();
    drop(ck);
    for f in std::fs::read_dir(&broken).unwrap() {
        let p: PathBuf = f.unwrap().path();
        if p.to_string_lossy().contains("safetensors") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let specs: Vec<TensorSpec> = keep
        .iter()
        .map(|(n, d, s, _)| TensorSpec::new(n.clone(), *d, s.clone()))
        .collect();
    write_sharded(&broken, &specs, u64::MAX, |s, w| {
        w.write_all(&keep.iter().find(|t| t.0 == s.name).unwrap().3)?;
        Ok(())
    })
    .unwrap();
    let err = format!("{:#}", inspect_quantized(&broken).unwrap_err());
    assert!(
        err.contains("model.layers.0.mlp.down_proj.qzeros is missing")
            && err.contains("model-00001-of-00001.safetensors"),
        "{err}"
    );
}
