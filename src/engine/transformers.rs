//! transformers (5.x, through optimum and GPTQModel): Llama, Mistral and Qwen2 built in, other
//! architectures through `auto_map` remote code; separate q/k/v and gate/up Linears; `dynamic`
//! ignored, so every decoder Linear is GPTQ unless `modules_in_block_to_quantize` lists the
//! quantized ones; an "unexpected keys" warning (the weight is lost) on a tensor it builds no
//! parameter for.

use super::linears::{Decision, EngineLinear, LinearMethod, Quantized};
use super::rules::Rules;
use super::Findings;
use crate::format::quantized::QuantFormat;

pub(super) const RULES: Rules = Rules {
    name: "transformers",
    label: "transformers",
    unbuilt: &[],
    derived_keys_fatal: false,
    own_config_class: false,
    imports_all_remote_code: true,
    needs_model_code: true,
    dtype_auto_float16: false,
    quantized_note: Some(
        "transformers loads GPTQ through optimum and gptqmodel (pip install optimum gptqmodel)",
    ),
    fuses: false,
    method,
    module,
    drops_g_idx: false,
    quantizes_head: false,
    ignores_stray_bias: false,
    unused_fatal: false,
    unused: "transformers ignores them with an \"unexpected keys\" warning, so those weights are \
             lost",
    plain_gptq_fallback: false,
    shape_limit_fix: "keep those modules in 16 bits (--skip); vLLM may find another kernel for \
                      them, which this check does not model",
    serve,
};

/// GPTQModel's QuantLinear for every Linear, with the settings `GPTQConfig` refuses and the
/// `dynamic` rules it ignores.
fn method(q: &Quantized, f: &mut Findings) -> LinearMethod {
    let info = q.info;
    if info.format == QuantFormat::Marlin {
        f.problem(
            "checkpoint_format is \"marlin\": transformers loads GPTQ through GPTQModel, which \
             refuses the legacy Marlin format",
            "load the GPTQ folder that pack-marlin read",
        );
    }
    if ![2, 3, 4, 8].contains(&info.bits) {
        f.problem(
            &format!(
                "bits is {}: transformers' GPTQConfig takes 2, 3, 4 or 8",
                info.bits
            ),
            "re-quantize with --bits 4",
        );
    }
    let positive: Vec<&str> = info
        .dynamic
        .iter()
        .filter(|r| !r.skip)
        .map(|r| r.key.as_str())
        .collect();
    if !positive.is_empty() {
        f.problem(
            &format!(
                "dynamic rules {positive:?} set per-module bits or group sizes, but transformers \
                 ignores `dynamic` and quantizes every module with the global settings"
            ),
            "serve mixed-precision checkpoints with SGLang or vLLM",
        );
    }
    if info.dynamic.iter().any(|r| r.skip) && q.listed.is_none() {
        f.problem(
            "dynamic \"-:\" rules keep modules unquantized, but transformers ignores `dynamic`: \
             without modules_in_block_to_quantize it builds every Linear of the decoder layers \
             as a GPTQ layer and finds .weight where it expects .qweight",
            "quantize with --engine transformers, which writes modules_in_block_to_quantize",
        );
    }
    LinearMethod::GptqModel
}

/// optimum's `convert_model`: with `modules_in_block_to_quantize`, only the Linears whose names
/// end with an entry are quantized.
fn module(q: &Quantized, l: &EngineLinear, d: &mut Decision, _: &mut Findings) {
    if let Some(list) = &q.listed {
        let m = &l.members[0];
        if !list.iter().any(|x| m.prefix.ends_with(x.as_str())) {
            d.method = LinearMethod::Unquantized;
        }
    }
}

fn serve(dir: &str, _sala: bool, remote_code: bool) -> String {
    format!(
        "python3 -c \"from transformers import AutoModelForCausalLM; \
         AutoModelForCausalLM.from_pretrained('{dir}', device_map='auto'{})\"",
        if remote_code {
            ", trust_remote_code=True"
        } else {
            ""
        }
    )
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::Engine::Transformers;
    use crate::checkpoint::Dtype;
    use serde_json::json;

    /// Every finding transformers' rules can give, one row each.
    #[test]
    fn every_finding() {
        #[rustfmt::skip]
        let rows = [
            Row::new("good Llama", Transformers, llama)
            .loads(In::Serve, "from_pretrained('the folder', device_map='auto')"),
            Row::new("transformers note", Transformers, llama)
            .loads(In::Note, "pip install optimum gptqmodel"),
            Row::new("derived key (not SGLang)", Transformers, sala)
            .edit(|v| {
                    with_remote_code(v);
                    v.config["sparse_layer_ids"] = json!([0]);
                })
            .loads(In::Warning, "[\"sparse_layer_ids\"], which SGLang's MiniCPMHybridConfig"),
            Row::new("remote code missing", Transformers, sala)
            .edit(|v| {
                    with_remote_code(v);
                    v.files.remove("modeling_minicpm_sala.py");
                })
            .fails(In::Problem, "modeling_minicpm_sala.py is missing (needed by config.json auto_map.AutoModelForCausalLM)"),
            Row::new("relative import missing", Transformers, sala)
            .edit(|v| {
                    with_remote_code(v);
                    v.texts.insert("modeling_minicpm_sala.py".into(), "from .utils import x\n".into());
                })
            .fails(In::Problem, "utils.py is missing (needed by a relative import in modeling_minicpm_sala.py)"),
            Row::new("no model code", Transformers, sala)
            .fails(In::Problem, "has no built-in MiniCPMSALAForCausalLM and config.json's auto_map lacks AutoConfig"),
            Row::new("no AutoModelForCausalLM", Transformers, sala)
            .edit(|v| {
                    with_remote_code(v);
                    v.config["auto_map"].as_object_mut().unwrap().remove("AutoModelForCausalLM");
                })
            .fails(In::Problem, "auto_map lacks AutoModelForCausalLM"),
            Row::new("SALA with remote code", Transformers, sala)
            .edit(with_remote_code)
            .loads(In::Linears, "32 gptqmodel"),
            Row::new("Marlin format", Transformers, || quantized(llama_config(), json!({"checkpoint_format": "marlin"})))
            .fails(In::Problem, "GPTQModel, which refuses the legacy Marlin format"),
            // transformers' method.
            Row::new("transformers 5-bit", Transformers, || quantized(llama_config(), json!({"bits": 5})))
            .fails(In::Problem, "bits is 5: transformers' GPTQConfig takes 2, 3, 4 or 8"),
            Row::new("transformers 3-bit", Transformers, || quantized(llama_config(), json!({"bits": 3})))
            .loads(In::Linears, "14 gptqmodel"),
            Row::new("transformers +: rule", Transformers, llama_plus3)
            .fails(In::Problem, "set per-module bits or group sizes, but transformers ignores `dynamic`"),
            Row::new("transformers -: rule without a list", Transformers, llama_skip_o)
            .fails(In::Problem, "without modules_in_block_to_quantize"),
            Row::new("transformers -: rule with a list", Transformers, llama_skip_o)
            .edit(|v| qc(v)["modules_in_block_to_quantize"] = json!([["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]]))
            .loads(In::Linears, "12 gptqmodel, 2 unquantized"),
            Row::new("g_idx with desc_act", Transformers, || quantized(llama_config(), json!({"desc_act": true})))
            .edit(|v| {
                v.tensors.remove("model.layers.0.mlp.up_proj.g_idx");
            })
            .fails(In::MissingTensors, "model.layers.0.mlp.up_proj.g_idx"),
            Row::new("an extra tensor", Transformers, llama)
            .edit(|v| put(v, "model.extra", Dtype::BF16, &[4]))
            .loads(In::Warning, "\"unexpected keys\" warning"),
            Row::new("rotary buffers", Transformers, llama)
            .edit(|v| put(v, "model.layers.0.self_attn.rotary_emb.inv_freq", Dtype::F32, &[32]))
            .loads(In::Linears, "14 gptqmodel"),
            Row::new("a stray bias", Transformers, llama)
            .edit(|v| put(v, "model.layers.0.self_attn.o_proj.bias", Dtype::BF16, &[256]))
            .loads(In::UnusedTensors, "model.layers.0.self_attn.o_proj.bias"),
        ];
        run("transformers", &rows);
    }
}
