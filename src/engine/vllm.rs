//! vLLM (0.34.0): the Llama family built in, MiniCPM-SALA in no release; fused `qkv_proj` /
//! `gate_up_proj`; every GPTQ checkpoint through one `auto_gptq` method (4/8-bit symmetric,
//! no `desc_act` since 0.30, `g_idx` dropped); `dynamic` rules as SGLang applies them, and a
//! Linear quantized only if its tensors are; the head quantized when `lm_head` is true;
//! "There is no module or parameter named ..." on a tensor it builds no parameter for.

use super::linears::{
    apply_dynamic, marlin_incompatibility, Decision, EngineLinear, LinearMethod, Quantized,
    RELABELLED_FIX,
};
use super::rules::{trust_remote_code_flag, Rules};
use super::Findings;
use crate::format::quantized::QuantFormat;
use crate::scheme::GroupSize;

pub(super) const RULES: Rules = Rules {
    name: "vllm",
    label: "vLLM",
    unbuilt: &[(
        "MiniCPMSALAForCausalLM",
        "vLLM has no MiniCPM-SALA implementation in any release (checked up to 0.34.0; the ports \
         in PRs #44095 and #48999 are not merged), so it cannot build MiniCPMSALAForCausalLM",
        "serve MiniCPM-SALA with SGLang (--engine sglang)",
    )],
    derived_keys_fatal: false,
    own_config_class: false,
    imports_all_remote_code: false,
    needs_model_code: false,
    dtype_auto_float16: false,
    quantized_note: None,
    fuses: true,
    method,
    module,
    drops_g_idx: true,
    quantizes_head: true,
    ignores_stray_bias: true,
    unused_fatal: true,
    unused: "vLLM's weight loader raises \"There is no module or parameter named ...\" on the \
             first one",
    plain_gptq_fallback: false,
    shape_limit_fix: "keep those modules in 16 bits (--skip); vLLM may find another kernel for \
                      them, which this check does not model",
    serve,
};

/// `auto_gptq` for every GPTQ checkpoint, with the settings it refuses.
fn method(q: &Quantized, f: &mut Findings) -> LinearMethod {
    if q.relabelled_gptq {
        f.problem(
            "checkpoint_format is \"marlin\", but the folder holds GPTQ tensors (qweight, \
             qzeros, scales) and no Marlin tiles (B, s): the label is wrong. vLLM ignores \
             checkpoint_format and reads the qweight/scales, but readers that trust the label \
             (GPTQModel, this tool) look for B/s",
            RELABELLED_FIX,
        );
    } else if q.info.format == QuantFormat::Marlin {
        f.problem(
            "checkpoint_format is \"marlin\": vLLM removed the legacy marlin method in PR #23204 \
             (0.10.1.1 was the last release with it) and ignores checkpoint_format, so it \
             expects qweight/scales where the folder has B/s",
            "serve the GPTQ folder that pack-marlin read",
        );
    }
    if let Some(why) = marlin_incompatibility(q.info) {
        f.problem(
            &format!(
                "vLLM's GPTQ method (auto_gptq) takes 4- or 8-bit symmetric checkpoints with \
                 group size -1, 32, 64 or 128 and all of bits, group_size, sym, desc_act \
                 present; this one has {why}"
            ),
            "re-quantize with --bits 4 (or 8), symmetric, --group-size 128",
        );
    }
    if q.info.desc_act && q.info.group_size != GroupSize::PerRow {
        f.problem(
            "desc_act is true: vLLM ≥ 0.30 refuses group activation ordering (\"desc_act=True \
             is no longer supported\", PR #54809)",
            "re-quantize with --act-order static (the default): same accuracy, trivial g_idx",
        );
    }
    LinearMethod::AutoGptq
}

/// `dynamic` rules, then `is_layer_gptq_quantized`: a Linear is built quantized only if its
/// tensors are (listed in `modules_in_block_to_quantize`, else found quantized in the shards),
/// and the members of a fused Linear must agree.
fn module(q: &Quantized, l: &EngineLinear, d: &mut Decision, f: &mut Findings) {
    apply_dynamic(q, l, d, f);
    if !d.method.quantized() {
        return;
    }
    let flags: Vec<bool> = l
        .members
        .iter()
        .map(|m| match &q.listed {
            Some(list) => list.iter().any(|x| m.prefix.contains(x.as_str())),
            None => q.in_shards.contains(m.prefix.as_str()),
        })
        .collect();
    if flags.iter().any(|&f| f) && !flags.iter().all(|&f| f) {
        f.problem(
            &format!(
                "{}: some but not all of {} are quantized; vLLM loads them as one layer and \
                 raises \"Detected some but not all shards ... are quantized\"",
                l.name,
                l.member_names().join(", ")
            ),
            "quantize all members of a fused group or none",
        );
    } else if !flags.iter().any(|&f| f) {
        d.method = LinearMethod::Unquantized;
    }
}

fn serve(dir: &str, _sala: bool, remote_code: bool) -> String {
    format!("vllm serve {dir}{}", trust_remote_code_flag(remote_code))
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::Engine::Vllm;
    use crate::checkpoint::Dtype;
    use serde_json::json;

    /// Every finding vLLM's rules can give, one row each.
    #[test]
    fn every_finding() {
        #[rustfmt::skip]
        let rows = [
            Row::new("good Llama", Vllm, llama)
            .loads(In::Serve, "vllm serve the folder"),
            Row::new("BF16 Llama", Vllm, || folder(llama_config()))
            .loads(In::Linears, "8 unquantized"),
            Row::new("vLLM has no MiniCPM-SALA", Vllm, sala)
            .fails(In::Problem, "no MiniCPM-SALA implementation"),
            Row::new("tokenizer code missing", Vllm, llama)
            .edit(|v| v.tokenizer_config = Some(json!({"auto_map": {"AutoTokenizer": ["t.T", null]}})))
            .fails(In::Problem, "t.py is missing (needed by tokenizer_config.json auto_map.AutoTokenizer)"),
            Row::new("Llama beyond Marlin shapes", Vllm, llama_odd)
            .fails(In::Problem, "vLLM may find another kernel"),
            Row::new("Marlin label over GPTQ tensors", Vllm, llama)
            .edit(|v| qc(v)["checkpoint_format"] = json!("marlin"))
            .fails(In::Problem, "vLLM ignores checkpoint_format and reads the qweight/scales"),
            Row::new("Marlin format", Vllm, || quantized(llama_config(), json!({"checkpoint_format": "marlin"})))
            .fails(In::Problem, "vLLM removed the legacy marlin method"),
            // vLLM's method.
            Row::new("vLLM 3-bit", Vllm, || quantized(llama_config(), json!({"bits": 3})))
            .fails(In::Problem, "auto_gptq) takes 4- or 8-bit symmetric checkpoints with group size -1, 32, 64 or 128 and all of bits, group_size, sym, desc_act present; this one has 3-bit symmetric"),
            Row::new("vLLM desc_act", Vllm, || quantized(llama_config(), json!({"desc_act": true})))
            .fails(In::Problem, "vLLM ≥ 0.30 refuses group activation ordering"),
            Row::new("vLLM desc_act, one group", Vllm, || quantized(llama_config(), json!({"desc_act": true, "group_size": -1})))
            .loads(In::Linears, "8 auto_gptq"),
            Row::new("vLLM lm_head", Vllm, llama)
            .edit(|v| qc(v)["lm_head"] = json!(true))
            .fails(In::MissingTensors, "lm_head.qweight"),
            Row::new("vLLM lm_head", Vllm, llama)
            .edit(|v| {
                    qc(v)["lm_head"] = json!(true);
                    v.tensors.remove("lm_head.weight");
                    put(v, "lm_head.qweight", Dtype::I32, &[32, 4096]);
                    put(v, "lm_head.qzeros", Dtype::I32, &[2, 512]);
                    put(v, "lm_head.scales", Dtype::F16, &[2, 4096]);
                })
            .loads(In::Linears, "8 auto_gptq"),
            Row::new("-: rule", Vllm, llama_skip_o)
            .loads(In::Linears, "6 auto_gptq, 2 unquantized"),
            Row::new("+: rule to 3 bits", Vllm, llama_plus3)
            .fails(In::Problem, "which auto_gptq cannot run"),
            Row::new("a fused group split", Vllm, llama_skip_k)
            .fails(In::Problem, "model.layers.0.self_attn.qkv_proj: some but not all of model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj are quantized"),
            Row::new("a layer kept BF16 without a rule (vLLM scans the shards)", Vllm, || quantized(llama_config(), json!({"dynamic": {r"-:model\.layers\.0\.self_attn\.o_proj": {}}})))
            .edit(|v| qc(v)["dynamic"] = json!({}))
            .loads(In::Linears, "7 auto_gptq, 1 unquantized"),
            Row::new("a dtype that does not fit", Vllm, llama)
            .edit(|v| {
                put(v, "model.layers.0.mlp.up_proj.qweight", Dtype::F16, &[32, 512]);
            })
            .fails(In::Problem, "do not fit the parameter the engine builds"),
            Row::new("an extra tensor", Vllm, llama)
            .edit(|v| put(v, "model.extra", Dtype::BF16, &[4]))
            .fails(In::Problem, "There is no module or parameter named"),
            Row::new("a stray g_idx", Vllm, llama)
            .edit(|v| put(v, "model.layers.0.self_attn.rot.g_idx", Dtype::I32, &[256]))
            .loads(In::Linears, "8 auto_gptq"),
            Row::new("a Linear's bias", Vllm, || {
                    let mut c = llama_config();
                    c["attention_bias"] = json!(true);
                    quantized(c, json!({}))
                })
            .edit(|v| {
                    v.tensors.remove("model.layers.1.self_attn.o_proj.bias");
                })
            .fails(In::MissingTensors, "model.layers.1.self_attn.o_proj.bias"),
        ];
        run("vllm", &rows);
    }
}
