//! SGLang (upstream, PR #30360 for MiniCPM-SALA): `MiniCPMSALAForCausalLM` and the Llama family
//! built in, fused `qkv_proj` / `gate_up_proj`, `o_gate` / `z_proj` built with the quant config,
//! `dynamic` rules matched against the fused names, gptq_marlin when the settings allow it and
//! plain gptq (float16 only) otherwise, `KeyError` on a tensor it builds no parameter for.

use super::linears::{
    apply_dynamic, marlin_incompatibility, LinearMethod, Quantized, RELABELLED_FIX,
};
use super::rules::{trust_remote_code_flag, Rules};
use super::Findings;
use crate::format::quantized::QuantFormat;

pub(super) const RULES: Rules = Rules {
    name: "sglang",
    label: "SGLang",
    unbuilt: &[],
    derived_keys_fatal: true,
    own_config_class: true,
    imports_all_remote_code: false,
    needs_model_code: false,
    dtype_auto_float16: true,
    quantized_note: None,
    fuses: true,
    method,
    module: apply_dynamic,
    drops_g_idx: false,
    quantizes_head: false,
    ignores_stray_bias: true,
    unused_fatal: true,
    unused: "SGLang's load_weights looks every name up in the model's parameters and raises \
             KeyError on the first one it does not build",
    plain_gptq_fallback: true,
    shape_limit_fix: "serve with --quantization gptq --dtype float16 (the plain gptq kernels), \
                      or keep those modules in 16 bits (--skip)",
    serve,
};

/// `GPTQMarlinConfig.override_quantization_method`: gptq_marlin when the settings allow it,
/// plain gptq otherwise.
fn method(q: &Quantized, f: &mut Findings) -> LinearMethod {
    if q.info.format == QuantFormat::Marlin {
        return marlin_format(q, f);
    }
    match marlin_incompatibility(q.info) {
        None => LinearMethod::GptqMarlin,
        Some(why) => {
            f.warning(
                &format!("SGLang does not select gptq_marlin: {why}"),
                "quantize with --bits 4 (or 8), symmetric, group size -1, 32, 64 or 128 for the \
                 Marlin kernels",
            );
            LinearMethod::Gptq
        }
    }
}

/// `checkpoint_format: "marlin"`: gptq_marlin refuses it, and the legacy `marlin` method exists
/// only with a vLLM ≤ 0.10.1.1 installed.
fn marlin_format(q: &Quantized, f: &mut Findings) -> LinearMethod {
    if q.relabelled_gptq {
        f.problem(
            "checkpoint_format is \"marlin\", but the folder holds GPTQ tensors (qweight, \
             qzeros, scales) and no Marlin tiles (B, s): the label is wrong. No current SGLang \
             release reads checkpoint_format \"marlin\" (gptq_marlin refuses it), so SGLang does \
             not select gptq_marlin and falls back to the plain gptq method; readers that trust \
             the label (a legacy marlin release, GPTQModel) look for B/s and find qweight",
            RELABELLED_FIX,
        );
    } else if !q.legacy_marlin {
        f.problem(
            "checkpoint_format is \"marlin\": no current SGLang release reads it (gptq_marlin \
             refuses Marlin-format checkpoints, and the legacy `marlin` method is imported from \
             vLLM, which removed it after 0.10.1.1; it also ran fp16 activations only), so \
             SGLang falls back to plain gptq and finds B/s where it expects qweight/scales",
            "serve the GPTQ folder that pack-marlin read: SGLang repacks it to Marlin at load \
             (gptq_marlin)",
        );
    }
    if q.legacy_marlin {
        LinearMethod::MarlinLegacy
    } else {
        LinearMethod::Gptq
    }
}

fn serve(dir: &str, sala: bool, remote_code: bool) -> String {
    if sala {
        return format!(
            "python3 -m sglang.launch_server --model-path {dir} --trust-remote-code --dtype \
             bfloat16 --disable-radix-cache"
        );
    }
    format!(
        "python3 -m sglang.launch_server --model-path {dir}{}",
        trust_remote_code_flag(remote_code)
    )
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::Engine::Sglang;
    use crate::checkpoint::Dtype;
    use serde_json::json;

    /// Every finding SGLang's rules can give, one row each.
    #[test]
    fn every_finding() {
        #[rustfmt::skip]
        let rows = [
            Row::new("good SALA", Sglang, sala)
            .loads(In::Linears, "20 gptq_marlin"),
            Row::new("good SALA", Sglang, sala)
            .loads(In::Note, "gptq_marlin repacks"),
            Row::new("good SALA", Sglang, sala)
            .loads(In::Serve, "--trust-remote-code --dtype bfloat16 --disable-radix-cache"),
            Row::new("good Llama", Sglang, llama)
            .loads(In::Serve, "sglang.launch_server --model-path the folder"),
            // Before the module set.
            Row::new("no config.json", Sglang, sala)
            .edit(|v| v.config = serde_json::Value::Null)
            .fails(In::Problem, "has no config.json"),
            // Config rules.
            Row::new("derived key", Sglang, sala)
            .edit(|v| v.config["has_sparse_attention"] = json!(true))
            .fails(In::Problem, "can't set attribute"),
            Row::new("AutoConfig over SGLang's own class", Sglang, sala)
            .edit(with_remote_code)
            .fails(In::Problem, "auto_map has AutoConfig"),
            Row::new("code in another repo", Sglang, llama)
            .edit(|v| v.config["auto_map"] = json!({"AutoModelForCausalLM": "org/repo--m.M"}))
            .loads(In::Note, "code from another hub repo"),
            Row::new("model code missing (not transformers)", Sglang, llama)
            .edit(|v| v.config["auto_map"] = json!({"AutoModelForCausalLM": "m.M"}))
            .loads(In::Warning, "m.py is missing"),
            Row::new("config code missing", Sglang, llama)
            .edit(|v| v.config["auto_map"] = json!({"AutoConfig": "c.C"}))
            .fails(In::Problem, "c.py is missing (needed by config.json auto_map.AutoConfig)"),
            Row::new("unsupported architecture", Sglang, llama)
            .edit(|v| v.config["architectures"] = json!(["GPT2LMHeadModel"]))
            .fails(In::Problem, "cannot be read as a supported architecture"),
            Row::new("unreadable settings", Sglang, llama)
            .edit(|v| qc(v)["bits"] = json!("four"))
            .fails(In::Problem, "the quantization settings cannot be read"),
            Row::new("integer tensors, no settings", Sglang, llama)
            .edit(|v| {
                    v.config.as_object_mut().unwrap().remove("quantization_config");
                })
            .fails(In::Problem, "config.json has no quantization_config"),
            // dtype.
            Row::new("SALA float16", Sglang, sala)
            .edit(|v| v.config["dtype"] = json!("float16"))
            .fails(In::Problem, "dtype is float16: SGLang serves those activations"),
            Row::new("SALA float32", Sglang, sala)
            .edit(|v| v.config["dtype"] = json!("float32"))
            .fails(In::Problem, "dtype is float32: SGLang serves float16 (SGLang's --dtype auto"),
            Row::new("SALA without dtype", Sglang, sala)
            .edit(|v| {
                    v.config.as_object_mut().unwrap().remove("dtype");
                })
            .fails(In::Problem, "dtype is absent (torch_dtype/dtype)"),
            Row::new("SALA torch_dtype", Sglang, sala)
            .edit(|v| {
                let o = v.config.as_object_mut().unwrap();
                o.remove("dtype");
                o.insert("torch_dtype".into(), json!("bfloat16"));
            })
            .loads(In::Linears, "20 gptq_marlin"),
            Row::new("SALA 3-bit (plain gptq, BF16)", Sglang, || quantized(sala_config(), json!({"bits": 3})))
            .fails(In::Problem, "float16 activations only"),
            Row::new("Llama 3-bit (plain gptq, BF16)", Sglang, || quantized(llama_config(), json!({"bits": 3})))
            .loads(In::Warning, "serve with --dtype float16"),
            Row::new("Llama 3-bit (plain gptq, BF16)", Sglang, || quantized(llama_config(), json!({"bits": 3})))
            .loads(In::Serve, "--model-path the folder --dtype float16"),
            // Shapes.
            Row::new("SALA beyond Marlin shapes", Sglang, sala_odd)
            .fails(In::Problem, "exceed the Marlin kernels' shape limits"),
            Row::new("SALA beyond Marlin shapes", Sglang, sala_odd)
            .fails(In::Problem, "in_features 704 is not a multiple of 128, in_features 704 is not a multiple of the group size"),
            Row::new("Llama beyond Marlin shapes", Sglang, llama_odd)
            .loads(In::Warning, "serve with --quantization gptq --dtype float16"),
            Row::new("Llama beyond Marlin shapes", Sglang, llama_odd)
            .loads(In::Serve, "--model-path the folder --quantization gptq --dtype float16"),
            // SGLang's method.
            Row::new("no quant_method", Sglang, || quantized(llama_config(), json!({"quant_method": null})))
            .loads(In::Warning, "SGLang does not select gptq_marlin: quant_method is \"(missing)\""),
            Row::new("a key missing", Sglang, || quantized(llama_config(), json!({"sym": null, "desc_act": null})))
            .loads(In::Warning, "sym, desc_act missing from the quantization settings"),
            Row::new("asymmetric", Sglang, || quantized(llama_config(), json!({"sym": false})))
            .loads(In::Warning, "4-bit asymmetric (gptq_marlin takes 4 or 8 bits, symmetric)"),
            Row::new("group 256", Sglang, || quantized(llama_config(), json!({"group_size": 256})))
            .loads(In::Warning, "group_size 256 (gptq_marlin takes -1, 32, 64, 128)"),
            Row::new("plain gptq", Sglang, || quantized(llama_config(), json!({"sym": false})))
            .loads(In::Linears, "8 gptq"),
            // The Marlin format.
            Row::new("Marlin format", Sglang, sala_marlin)
            .fails(In::Problem, "no current SGLang release reads it"),
            Row::new("Marlin format, legacy release", Sglang, sala_marlin)
            .legacy()
            .loads(In::Linears, "20 marlin"),
            Row::new("Marlin format, legacy release", Sglang, sala_marlin)
            .legacy()
            .loads(In::Note, "exists only in vLLM ≤ 0.10.1.1"),
            Row::new("legacy marlin, group 64", Sglang, || quantized(sala_config(), json!({"checkpoint_format": "marlin", "group_size": 64})))
            .legacy()
            .fails(In::Problem, "group size 64; the legacy marlin method takes 128 or -1"),
            Row::new("legacy marlin, desc_act", Sglang, || quantized(sala_config(), json!({"checkpoint_format": "marlin", "desc_act": true})))
            .legacy()
            .fails(In::Problem, "the legacy marlin method has no act-order"),
            Row::new("legacy marlin, skipped modules", Sglang, || quantized(llama_config(), json!({"checkpoint_format": "marlin", "dynamic": {r"-:.*self_attn\.o_proj": {}}})))
            .legacy()
            .loads(In::Warning, "applies no per-module rules"),
            Row::new("Marlin label over GPTQ tensors", Sglang, sala)
            .edit(|v| qc(v)["checkpoint_format"] = json!("marlin"))
            .fails(In::Problem, "the label is wrong. No current SGLang release"),
            Row::new("Marlin label over GPTQ tensors, legacy release", Sglang, sala)
            .edit(|v| qc(v)["checkpoint_format"] = json!("marlin"))
            .legacy()
            .fails(In::Linears, "20 marlin"),
            Row::new("lm_head quantized for SGLang", Sglang, llama)
            .edit(|v| {
                qc(v)["lm_head"] = json!(true);
                put(v, "lm_head.qweight", Dtype::I32, &[32, 4096]);
            })
            .fails(In::UnusedTensors, "lm_head.qweight"),
            // dynamic rules.
            Row::new("-: rule", Sglang, llama_skip_o)
            .loads(In::Linears, "6 gptq_marlin, 2 unquantized"),
            Row::new("+: rule to 3 bits", Sglang, llama_plus3)
            .fails(In::Problem, "gives model.layers.0.mlp.down_proj 3-bit sym group 128, which gptq_marlin cannot run"),
            Row::new("+: rule to group 64", Sglang, || quantized(llama_config(), json!({"dynamic": {r"+:model\.layers\.0\.mlp\.down_proj": {"group_size": 64}}})))
            .loads(In::Linears, "8 gptq_marlin"),
            Row::new("a rule on a member name", Sglang, llama_skip_k)
            .fails(In::MissingTensors, "model.layers.0.self_attn.k_proj.qweight"),
            Row::new("a rule on a member name", Sglang, llama_skip_k)
            .fails(In::Problem, "KeyError on the first one it does not build): model.layers.0.self_attn.k_proj.weight"),
            Row::new("o_gate kept BF16 without a rule", Sglang, || quantized(sala_config(), json!({"dynamic": {r"-:.*self_attn\.o_gate": {}}})))
            .edit(|v| qc(v)["dynamic"] = json!({}))
            .fails(In::Problem, "model.layers.0.self_attn.o_gate.qweight"),
            Row::new("o_gate kept BF16 without a rule", Sglang, || quantized(sala_config(), json!({"dynamic": {r"-:.*self_attn\.o_gate": {}}})))
            .edit(|v| qc(v)["dynamic"] = json!({}))
            .fails(In::Problem, "KeyError"),
            Row::new("the first rule in file order wins", Sglang, llama_skip_o)
            .edit(|v| {
                    qc(v)["dynamic"][r"+:.*"] = json!({"bits": 4});
                    v.dynamic_order = vec![r"-:.*self_attn\.o_proj".into(), r"+:.*".into()];
                })
            .loads(In::Linears, "6 gptq_marlin, 2 unquantized"),
            // The tensors.
            Row::new("a tensor missing", Sglang, llama)
            .edit(|v| {
                v.tensors.remove("model.layers.1.mlp.up_proj.scales");
            })
            .fails(In::Problem, "1 tensor(s) that SGLang would load are not in the shards, so those parameters stay uninitialized (garbage output): model.layers.1.mlp.up_proj.scales"),
            Row::new("g_idx without desc_act", Sglang, llama)
            .edit(|v| {
                v.tensors.remove("model.layers.0.mlp.up_proj.g_idx");
            })
            .loads(In::Linears, "8 gptq_marlin"),
            Row::new("a shape that does not fit", Sglang, llama)
            .edit(|v| {
                put(v, "model.layers.0.mlp.up_proj.scales", Dtype::F16, &[4, 512]);
            })
            .fails(In::Problem, "model.layers.0.mlp.up_proj.scales is F16 [4, 512], the engine's parameter is BF16/F16/F32 [2, 512]"),
            Row::new("an extra tensor", Sglang, llama)
            .edit(|v| put(v, "model.extra", Dtype::BF16, &[4]))
            .fails(In::Problem, "1 tensor(s) in the shards match no parameter the engine builds (SGLang's load_weights"),
            Row::new("a stray bias", Sglang, llama)
            .edit(|v| put(v, "model.layers.0.self_attn.o_proj.bias", Dtype::BF16, &[256]))
            .loads(In::Linears, "8 gptq_marlin"),
        ];
        run("sglang", &rows);
    }
}
