"""llm-compressor on the exported calibration windows: GPTQModifier, W4A16 int, symmetric,
group strategy, actorder "static" (= "weight": processing order by diag(H), groups fixed by
original position, no g_idx on disk), dampening_frac 0.01, block_size 128, lm_head ignored.
Weight observer: "memoryless_minmax" (plain ranges), or with --mse "memoryless_mse" with
maxshrink 0.8, grid 100, norm 2.4 and patience 1000 (no early stop): soar-gptq's --mse search.
The windows go in as a torch DataLoader (oneshot takes one as is: no datasets processing).
Its group scales are in the model's dtype (bf16), not fp16 as GPTQ stores them: QuantizationArgs'
scale_dtype=float16 is accepted but changes nothing for int4 group quantization in 0.14.0.1 /
compressed-tensors 0.19.0 (byte-identical output), so it is left at the default.
Writes compressed-tensors pack-quantized with llm-compressor's own save_pretrained, then
(--gptq-out) a GPTQ v1 copy through ct_to_gptq.py for the common scorer.

  python3 run_llmc.py --model DIR --calib tokens.json --out DIR --group-size 64 [--mse] [--gptq-out DIR]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import driver_parser, load_windows, memory_record, start_driver, torch_device, versions, write_result  # noqa: E402


def main():
    ap = driver_parser()
    ap.add_argument("--gptq-out")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--mse", action="store_true")
    ap.add_argument("--actorder", default="static", choices=["static", "group", "none"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--pipeline", default="sequential")
    a = ap.parse_args()
    ph = start_driver(a, ("model", "calib", "out", "result", "gptq_out"))

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wins, doc = load_windows(a.calib)
    dev = torch_device(a.device)
    observer = "memoryless_mse" if a.mse else "memoryless_minmax"
    okw = {"maxshrink": 0.8, "grid": 100.0, "norm": 2.4, "patience": 1000} if a.mse else {}
    actorder = None if a.actorder == "none" else a.actorder
    weights = QuantizationArgs(num_bits=a.bits, type="int", symmetric=True, strategy="group",
                               group_size=a.group_size, actorder=actorder, observer=observer,
                               observer_kwargs=okw)
    recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                          ignore=["lm_head"], dampening_frac=a.damp, block_size=128, actorder=actorder)

    def load():
        m = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
        return m, AutoTokenizer.from_pretrained(a.model)

    model, tok = ph.run("load", load)
    data = [{"input_ids": torch.tensor(w), "attention_mask": torch.ones(len(w), dtype=torch.long)} for w in wins]
    loader = DataLoader(data, batch_size=a.batch_size, shuffle=False)
    ph.run("quantize", oneshot, model=model, processor=tok, recipe=recipe, dataset=loader,
           num_calibration_samples=len(wins), pipeline=a.pipeline)

    def save():
        model.save_pretrained(a.out, save_compressed=True)
        tok.save_pretrained(a.out)

    ph.run("save", save)
    rec = {
        "tool": "llm-compressor",
        "versions": versions("llmcompressor", "compressed-tensors", "torch", "transformers"),
        "device": dev,
        "windows": len(wins),
        "seqlen": len(wins[0]),
        "calibration_sha256": doc.get("calibration_sha256"),
        "settings": {"bits": a.bits, "group_size": a.group_size, "symmetric": True, "actorder": a.actorder,
                     "dampening_frac": a.damp, "block_size": 128, "observer": observer, "observer_kwargs": okw,
                     "ignore": ["lm_head"], "pipeline": a.pipeline, "batch_size": a.batch_size,
                     "triton_gptq_block": dev == "cuda" and os.environ.get("LLMCOMPRESSOR_DISABLE_GPTQ_TRITON") != "1"
                     and not os.environ.get("CT_ENFORCE_EAGER")},
        "phases": ph.t,
        "total_s": ph.total(),
    }
    rec.update(memory_record())
    if a.gptq_out:
        from ct_to_gptq import convert

        rec["conversion"] = ph.run("convert", convert, a.out, a.gptq_out)
    write_result(a.result, rec)


if __name__ == "__main__":
    main()
