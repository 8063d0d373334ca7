"""AutoRound (optional third peer, SmolLM2 only: SMOL_RUNS=... ar): sign-gradient rounding
(signround), not GPTQ: no Hessian, no damping, no act-order; W4A16 symmetric, group G, its
default iters 200, lr and batch size 8, lm_head not quantized, on the exported windows (a list
of [1, L] token tensors, used as given). Saved as auto_gptq (GPTQ v1) with AutoRound's own save.

  python3 run_autoround.py --model DIR --calib tokens.json --out DIR --group-size 64 [--iters 200]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import driver_parser, load_windows, memory_record, start_driver, torch_device, versions, write_result  # noqa: E402


def main():
    ap = driver_parser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    a = ap.parse_args()
    ph = start_driver(a)

    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wins, doc = load_windows(a.calib)
    dev = torch_device(a.device)

    def load():
        return AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16), AutoTokenizer.from_pretrained(a.model)

    model, tok = ph.run("load", load)
    data = [torch.tensor([w]) for w in wins]
    ar = AutoRound(model=model, tokenizer=tok, scheme="W4A16", bits=4, group_size=a.group_size, sym=True,
                   dataset=data, iters=a.iters, nsamples=len(wins), seqlen=len(wins[0]), batch_size=a.batch_size,
                   device_map=0 if dev == "cuda" else "cpu")
    ph.run("quantize_and_save", ar.quantize_and_save, a.out, format="auto_gptq")
    # AutoRound writes into a subfolder named after the model and scheme: lift it into --out.
    subs = [d for d in os.listdir(a.out) if os.path.isfile(os.path.join(a.out, d, "config.json"))]
    if not os.path.isfile(os.path.join(a.out, "config.json")) and len(subs) == 1:
        for f in os.listdir(os.path.join(a.out, subs[0])):
            os.replace(os.path.join(a.out, subs[0], f), os.path.join(a.out, f))
        os.rmdir(os.path.join(a.out, subs[0]))
    rec = {
        "tool": "auto-round",
        "versions": versions("auto-round", "torch", "transformers"),
        "device": dev,
        "windows": len(wins),
        "seqlen": len(wins[0]),
        "calibration_sha256": doc.get("calibration_sha256"),
        "settings": {"scheme": "W4A16", "bits": 4, "group_size": a.group_size, "sym": True, "iters": a.iters,
                     "batch_size": a.batch_size, "format": "auto_gptq"},
        "phases": ph.t,
        "total_s": ph.total(),
    }
    rec.update(memory_record())
    write_result(a.result, rec)


if __name__ == "__main__":
    main()
