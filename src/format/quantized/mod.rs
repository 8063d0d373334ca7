//! Reading quantized checkpoints: GPTQ v1 (`checkpoint_format: "gptq"`, zeros stored minus one),
//! GPTQ v2 (`"gptq_v2"`, real zeros) and Marlin (`"marlin"`, `is_marlin_format: true` or
//! `quant_method: "marlin"`), whoever wrote them and whatever the architecture: quantized modules
//! are found by their tensors (`{p}.qweight`, or `{p}.B` for Marlin), not by a model definition.
//!
//! * [`read_quant_info`] parses the settings (`config.json` `quantization_config`, else
//!   `quantize_config.json`), including GPTQModel `dynamic` rules (`-:REGEX` keeps a module
//!   unquantized, `+:REGEX` / `REGEX` override its bits, group size, sym or desc_act). Patterns
//!   are matched from the start of the module name, as Python's `re.match` in the engines does.
//! * [`validate_quantized`] checks a checkpoint against the BF16 layout a config implies (or, with
//!   [`validate_quantized_modules`] and no layout, the quantized sets alone): shapes, dtypes,
//!   `g_idx` against `desc_act`, the `qzeros` convention of symmetric checkpoints, Marlin shapes
//!   and sort indices. Every message names the tensor and the file.
//! * [`dequantize_module`] rebuilds one Linear's weight `[N, K]` (HF layout) bit-exactly:
//!   `f32(scale_f16) · (code − zero)`, one rounding per value.
//!
//! Marlin act-order (soar-gptq extension, see [`pack_marlin`](mod@crate::pack_marlin)): a
//! module whose `desc_act` is true stores `{p}.g_idx_sort_indices` I32 `[K]`; Marlin row `k'`
//! holds original row `sort[k']` and belongs to group `k' / g`.

mod decode;
mod settings;
mod validate;

pub use decode::{dequantize_gptq_tensor, dequantize_module, read_module_codes, ModuleCodes};
pub(crate) use settings::read_json;
pub use settings::{
    dynamic_key_order, engine_name, exact_pattern, natural_cmp, read_plan_rules, read_quant_info,
    skip_rules, DynamicRule, GptqConfig, ModuleQuant, QuantInfo, QuantOverride, MAX_PLAN_RULES,
};
pub(crate) use validate::at;
pub use validate::{
    check_quantized_module, quantized_prefixes, validate_quantized, validate_quantized_modules,
    QuantModule,
};

use crate::checkpoint::Checkpoint;
use std::collections::HashMap;

pub const CONFIG_FILE: &str = "config.json";
pub const QUANTIZE_CONFIG_FILE: &str = "quantize_config.json";
/// Tensor suffixes of one GPTQ-quantized Linear.
pub const GPTQ_SUFFIXES: [&str; 4] = ["qweight", "qzeros", "scales", "g_idx"];
/// Marlin act-order sort indices (our extension to the legacy Marlin format).
pub const SORT_INDICES_SUFFIX: &str = "g_idx_sort_indices";

pub use crate::scheme::QuantFormat;

/// Groups of modules the engines fuse into one layer (SGLang/vLLM `qkv_proj`, `gate_up_proj`):
/// `(fused name, member suffixes)`.
pub const FUSED_GROUPS: [(&str, &[&str]); 2] = [
    ("qkv_proj", &["q_proj", "k_proj", "v_proj"]),
    ("gate_up_proj", &["gate_proj", "up_proj"]),
];

/// For every parent module that holds members of a fused group: `(parent.fused, members that
/// exist)`, where a member exists when either `{p}.weight` or a quantized set is present.
pub fn fused_groups(ck: &Checkpoint, quantized: &[String]) -> Vec<(String, Vec<String>)> {
    let mut found: HashMap<String, Vec<String>> = HashMap::new();
    let candidates = ck
        .names()
        .filter_map(|n| n.strip_suffix(".weight"))
        .chain(quantized.iter().map(String::as_str));
    for p in candidates {
        let Some((parent, leaf)) = p.rsplit_once('.') else {
            continue;
        };
        for (fused, members) in FUSED_GROUPS {
            if members.contains(&leaf) {
                let list = found.entry(format!("{parent}.{fused}")).or_default();
                if !list.iter().any(|x| x == p) {
                    list.push(p.to_string());
                }
            }
        }
    }
    let mut out: Vec<(String, Vec<String>)> = found.into_iter().collect();
    for (_, members) in &mut out {
        members.sort_by(|a, b| natural_cmp(a, b));
    }
    out.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::shards::{write_sharded, TensorSpec};
    use crate::checkpoint::Dtype;
    use crate::format::pack::{i32_to_le_bytes, pack_qweight};
    use crate::scheme::GroupSize;
    use anyhow::Result;
    use serde_json::json;
    use serde_json::Value;
    use std::io::Write;
    use std::path::Path;

    fn info(v: Value) -> Result<QuantInfo> {
        QuantInfo::from_json(v, Path::new("quantize_config.json"), false)
    }

    #[test]
    fn formats_and_defaults_are_recognised() {
        let base = json!({"bits": 4, "group_size": 128});
        let i = info(base.clone()).unwrap();
        assert_eq!(i.format, QuantFormat::GptqV1);
        assert!(i.sym && !i.desc_act);
        assert_eq!(i.missing_keys, vec!["sym", "desc_act"]);
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            info(b)
        };
        assert_eq!(
            with("checkpoint_format", json!("gptq_v2")).unwrap().format,
            QuantFormat::GptqV2
        );
        assert_eq!(
            with("format", json!("marlin")).unwrap().format,
            QuantFormat::Marlin
        );
        assert_eq!(
            with("is_marlin_format", json!(true)).unwrap().format,
            QuantFormat::Marlin
        );
        assert_eq!(
            with("quant_method", json!("marlin")).unwrap().format,
            QuantFormat::Marlin
        );
        let e = with("quant_method", json!("awq")).unwrap_err().to_string();
        assert!(e.contains("quant_method is \"awq\""), "{e}");
        let e = with("checkpoint_format", json!("bitblas"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bitblas"), "{e}");
        let e = with("group_size", json!(0)).unwrap_err().to_string();
        assert!(e.contains("group_size is 0"), "{e}");
        let e = info(json!({"group_size": 128})).unwrap_err().to_string();
        assert!(e.contains("no bits"), "{e}");
    }

    /// What the writer records, the reader reads back: every setting, the layout, and which
    /// modules the `dynamic` rules keep in 16 bits (search patterns, exact fused names).
    #[test]
    fn written_settings_read_back_the_same() {
        for (bits, group, sym, desc_act, format) in [
            (4, GroupSize::G128, true, true, QuantFormat::GptqV1),
            (
                8,
                GroupSize::from_i64(-1).unwrap(),
                false,
                false,
                QuantFormat::GptqV2,
            ),
            (
                3,
                GroupSize::from_i64(32).unwrap(),
                true,
                false,
                QuantFormat::GptqV1,
            ),
        ] {
            let skip = vec!["mlp\\.down_proj".to_string()];
            let kept = vec![
                "model.layers.3.self_attn.qkv_proj".to_string(),
                "model.layers.5.mlp.down_proj".to_string(),
            ];
            let written = GptqConfig {
                bits,
                group_size: group,
                sym,
                desc_act,
                static_groups: false,
                format,
                damp_percent: 0.01,
                true_sequential: true,
                dynamic: skip_rules(&skip, &kept).unwrap(),
                modules_in_block_to_quantize: None,
                meta: json!({"quantizer": ["test"]}),
            }
            .to_json();
            let i = info(written.clone()).unwrap();
            assert_eq!(
                (i.bits, i.group_size, i.sym, i.desc_act, i.format),
                (bits, group, sym, desc_act, format)
            );
            assert!(i.missing_keys.is_empty(), "{:?}", i.missing_keys);
            assert_eq!(i.quant_method(), Some("gptq"));
            assert_eq!(i.raw, written);
            // The search pattern covers down_proj anywhere; the covered fused name gets no rule
            // of its own, the other one an exact rule.
            let keys: Vec<&str> = i.dynamic.iter().map(|r| r.key.as_str()).collect();
            assert_eq!(
                keys,
                [
                    "-:.*(?:mlp\\.down_proj)",
                    "-:model\\.layers\\.3\\.self_attn\\.qkv_proj"
                ]
            );
            assert!(i.module_settings("model.layers.0.mlp.down_proj").is_none());
            assert!(i
                .module_settings("model.layers.3.self_attn.qkv_proj")
                .is_none());
            assert!(i
                .module_settings("model.layers.31.self_attn.qkv_proj")
                .is_some());
            assert!(i.module_settings("model.layers.3.mlp.up_proj").is_some());
        }
        let e = skip_rules(&["(".to_string()], &[]).unwrap_err().to_string();
        assert!(e.contains("skip pattern \"(\""), "{e}");
    }

    #[test]
    fn dynamic_rules_skip_and_override_from_the_start_of_the_name() {
        let i = info(json!({
            "bits": 4, "group_size": 128, "sym": true, "desc_act": false,
            "dynamic": {
                "-:.*\\.mlp\\.down_proj": {},
                "+:model\\.layers\\.1\\..*": {"bits": 8, "group_size": 64},
            }
        }))
        .unwrap();
        assert!(i.module_settings("model.layers.0.mlp.down_proj").is_none());
        assert_eq!(
            i.skip_rule("model.layers.3.mlp.down_proj").unwrap().key,
            "-:.*\\.mlp\\.down_proj"
        );
        let m = i
            .module_settings("model.layers.1.self_attn.q_proj")
            .unwrap();
        assert_eq!((m.bits, m.group_size.to_i64()), (8, 64));
        let m = i
            .module_settings("model.layers.0.self_attn.q_proj")
            .unwrap();
        assert_eq!((m.bits, m.group_size), (4, GroupSize::G128));
        // Anchored at the start: "layers\.1" does not match in the middle of the name.
        let j =
            info(json!({"bits": 4, "group_size": 128, "dynamic": {"-:layers\\.1": {}}})).unwrap();
        assert!(j.module_settings("model.layers.1.mlp.up_proj").is_some());
        let e = info(json!({"bits": 4, "group_size": 128, "dynamic": {"-:(?<=x)a": {}}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("dynamic rule"), "{e}");
    }

    #[test]
    fn natural_order_sorts_layer_numbers() {
        let mut v = vec!["l.10.a", "l.2.b", "l.2.a", "l.1"];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(v, vec!["l.1", "l.2.a", "l.2.b", "l.10.a"]);
    }

    /// One 4-bit GPTQ module `p` with K = 256, N = 64, group 128, written by our writer.
    fn write_module(dir: &Path, g_idx: &[i32], qzero_word: u32) -> Checkpoint {
        let (k, n, g) = (256usize, 64usize, 2usize);
        let codes: Vec<u8> = (0..k * n).map(|i| (i * 7 % 16) as u8).collect();
        let qweight = pack_qweight(&codes, k, n, 4).unwrap();
        let qzeros = vec![qzero_word as i32; g * n / 8];
        let scales: Vec<u8> = (0..g * n)
            .flat_map(|i| half::f16::from_f32(0.01 * (1 + i % 5) as f32).to_le_bytes())
            .collect();
        let specs = vec![
            TensorSpec::new("p.g_idx", Dtype::I32, vec![k]),
            TensorSpec::new("p.qweight", Dtype::I32, vec![k / 8, n]),
            TensorSpec::new("p.qzeros", Dtype::I32, vec![g, n / 8]),
            TensorSpec::new("p.scales", Dtype::F16, vec![g, n]),
        ];
        write_sharded(dir, &specs, u64::MAX, |s, w: &mut dyn Write| {
            let bytes = match s.name.as_str() {
                "p.g_idx" => i32_to_le_bytes(g_idx),
                "p.qweight" => i32_to_le_bytes(&qweight),
                "p.qzeros" => i32_to_le_bytes(&qzeros),
                _ => scales.clone(),
            };
            w.write_all(&bytes)?;
            Ok(())
        })
        .unwrap();
        Checkpoint::open(dir).unwrap()
    }

    #[test]
    fn g_idx_and_qzeros_conventions_are_enforced() {
        let trivial: Vec<i32> = (0..256).map(|k| k / 128).collect();
        let v1 =
            info(json!({"bits": 4, "group_size": 128, "sym": true, "desc_act": false})).unwrap();
        let d = tempfile::tempdir().unwrap();
        let ck = write_module(d.path(), &trivial, 0x7777_7777);
        let m = validate_quantized_modules(&ck, &v1, None).unwrap();
        assert_eq!(
            (m[0].n, m[0].k, m[0].groups, m[0].act_order),
            (64, 256, 2, false)
        );
        let expected = vec![("p.weight".to_string(), vec![64, 256])];
        validate_quantized(&ck, &v1, &expected).unwrap();
        let e = validate_quantized(&ck, &v1, &[("p.weight".to_string(), vec![64, 128])])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("p.qweight in") && e.contains("[N, K] = [64, 128]"),
            "{e}"
        );

        // v2 reading the same file: wrong convention.
        let mut v2j = v1.raw.clone();
        v2j["checkpoint_format"] = json!("gptq_v2");
        let v2 = info(v2j).unwrap();
        let e = validate_quantized(&ck, &v2, &expected)
            .unwrap_err()
            .to_string();
        assert!(e.contains("p.qzeros in") && e.contains("0x88888888"), "{e}");

        // A permuted g_idx needs desc_act.
        let mut perm = trivial.clone();
        perm.swap(0, 200);
        let d2 = tempfile::tempdir().unwrap();
        let ck2 = write_module(d2.path(), &perm, 0x7777_7777);
        let e = validate_quantized(&ck2, &v1, &expected)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("g_idx[0] = 1") && e.contains("desc_act is false"),
            "{e}"
        );
        let mut actj = v1.raw.clone();
        actj["desc_act"] = json!(true);
        let act = info(actj).unwrap();
        let m = validate_quantized_modules(&ck2, &act, Some(&expected)).unwrap();
        assert!(m[0].act_order);
        // Unequal groups are refused under act-order.
        let mut bad = trivial.clone();
        bad[0] = 1;
        let d3 = tempfile::tempdir().unwrap();
        let ck3 = write_module(d3.path(), &bad, 0x7777_7777);
        let e = validate_quantized(&ck3, &act, &expected)
            .unwrap_err()
            .to_string();
        assert!(e.contains("group 0 is used by 127 rows"), "{e}");

        // Unexpected and missing tensors.
        let e = validate_quantized(&ck, &v1, &[]).unwrap_err().to_string();
        assert!(e.contains("unexpected tensor p.g_idx"), "{e}");
        let mut more = expected.clone();
        more.push(("norm.weight".into(), vec![64]));
        let e = validate_quantized(&ck, &v1, &more).unwrap_err().to_string();
        assert!(e.contains("norm.weight") && e.contains("missing"), "{e}");
        // A skip rule that covers a quantized module.
        let mut skipj = v1.raw.clone();
        skipj["dynamic"] = json!({"-:p$": {}});
        let e = validate_quantized(&ck, &info(skipj).unwrap(), &expected)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("-:p$") && e.contains("keeps module p unquantized"),
            "{e}"
        );
    }

    #[test]
    fn gptq_dequant_is_transposed_scale_times_code_minus_zero() {
        let trivial: Vec<i32> = (0..256).map(|k| k / 128).collect();
        let d = tempfile::tempdir().unwrap();
        let ck = write_module(d.path(), &trivial, 0x7777_7777);
        let i =
            info(json!({"bits": 4, "group_size": 128, "sym": true, "desc_act": false})).unwrap();
        let (w, n, k) = dequantize_module(&ck, &i, "p").unwrap();
        assert_eq!((n, k), (64, 256));
        for (row, col) in [(0usize, 0usize), (5, 130), (63, 255), (17, 127)] {
            let code = ((col * n + row) * 7 % 16) as i32;
            let grp = col / 128;
            let s = half::f16::from_f32(0.01 * (1 + (grp * n + row) % 5) as f32).to_f32();
            assert_eq!(w[row * k + col], s * (code - 8) as f32, "W[{row}][{col}]");
        }
    }
}
