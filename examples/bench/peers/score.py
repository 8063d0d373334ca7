"""A second scorer, in plain PyTorch/transformers, for cross-checking `soar-gptq eval-ppl`:
the quantized folders (GPTQ v1 or compressed-tensors) are dequantized to dense weights
(gptq_io.py) and loaded into the reference model's architecture; the windows follow
docs/eval.md (text tokenized once without special tokens, consecutive windows of --seqlen,
every next-token prediction scored). Prints ppl, mean KL(P_ref || P_q) and top-1 agreement per
model, and --json writes them.

  python3 score.py --model BF16_DIR --compare Q1 --compare Q2 --data calibration/eval/sotu-2000-2021.txt \
      --seqlen 2048 --max-windows 16 [--device cuda --dtype bf16]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gptq_io import dequant_folder  # noqa: E402


def windows(model_dir, data, seqlen, max_windows):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = tok.encode(open(data, encoding="utf-8").read(), add_special_tokens=False).ids
    n = len(ids) // seqlen
    if max_windows:
        n = min(n, max_windows)
    return [ids[i * seqlen:(i + 1) * seqlen] for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--compare", action="append", default=[])
    ap.add_argument("--data", required=True)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "f32", "bf16"])
    ap.add_argument("--json")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    dev = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}.get(a.dtype, torch.float32 if dev == "cpu" else torch.bfloat16)
    wins = windows(a.model, a.data, a.seqlen, a.max_windows)
    ref = AutoModelForCausalLM.from_pretrained(a.model, dtype=dt).to(dev).eval()

    @torch.no_grad()
    def logprobs(model, w):
        x = torch.tensor([w], device=dev)
        return torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)

    ref_nll, tokens = 0.0, 0
    for w in wins:
        lp = logprobs(ref, w)
        tgt = torch.tensor(w[1:], device=dev)
        ref_nll += -lp.gather(1, tgt[:, None]).sum().item()
        tokens += len(w) - 1
    res = {"reference": {"model": a.model, "ppl": float(torch.tensor(ref_nll / tokens).exp()), "tokens": tokens,
                         "windows": len(wins), "seqlen": a.seqlen, "dtype": str(dt)}, "compared": []}
    print(f"{'model':50} {'ppl':>10} {'mean KL':>10} {'top-1':>8}")
    print(f"{a.model:50} {res['reference']['ppl']:10.4f}")
    for q in a.compare:
        dense, mods = dequant_folder(q)
        qm = AutoModelForCausalLM.from_pretrained(a.model, dtype=dt)
        sd = qm.state_dict()
        load = {k: v.to(sd[k].dtype) for k, v in dense.items() if k in sd and sd[k].shape == v.shape}
        missing = [m for m in mods if m + ".weight" not in load]
        if missing:
            sys.exit(f"{q}: quantized modules not in the model: {missing[:4]}")
        qm.load_state_dict(load, strict=False)
        qm = qm.to(dev).eval()
        nll, kl, top1 = 0.0, 0.0, 0
        for w in wins:
            lr = logprobs(ref, w)
            lq = logprobs(qm, w)
            tgt = torch.tensor(w[1:], device=dev)
            nll += -lq.gather(1, tgt[:, None]).sum().item()
            kl += (lr.exp() * (lr - lq)).sum().item()
            top1 += (lr.argmax(-1) == lq.argmax(-1)).sum().item()
        r = {"model": q, "ppl": float(torch.tensor(nll / tokens).exp()), "mean_kl": kl / tokens,
             "top1_agreement": top1 / tokens, "modules_dequantized": len(mods),
             "tensors_loaded": len(load)}
        res["compared"].append(r)
        print(f"{q:50} {r['ppl']:10.4f} {r['mean_kl']:10.5f} {100 * r['top1_agreement']:7.2f}%", flush=True)
        del qm
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
