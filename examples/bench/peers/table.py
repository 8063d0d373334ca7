"""Gathers the records of examples/bench/peers.sh (one JSON per run under $P/runs, the scores
under $P/scores) into one table and one JSON document.

  python3 table.py P_DIR OUT_JSON
"""

import glob
import json
import os
import sys


def load(p):
    try:
        return json.load(open(p))
    except Exception:  # noqa: BLE001
        return None


def fmt(v, spec):
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if v is None else format(v, spec)


def order(r):
    n = r["run"]
    return ({"smol": 0, "l8b": 1, "sala": 2}.get(n.split("-")[0], 3), n)


def main():
    pdir, out = sys.argv[1], sys.argv[2]
    runs = sorted((r for r in (load(p) for p in glob.glob(os.path.join(pdir, "runs", "*.json"))) if r), key=order)
    scores = {}
    for p in sorted(glob.glob(os.path.join(pdir, "scores", "*-eval.json"))):
        d = load(p) or {}
        for c in d.get("compared", []):
            scores[os.path.basename(c["model"].rstrip("/"))] = {"ppl": c["ppl"], "mean_kl": c["mean_kl"],
                                                                "top1": c["top1_agreement"]}
        if "reference" in d:
            scores["__ref__" + os.path.basename(p)] = d["reference"]
    py = {}
    for p in sorted(glob.glob(os.path.join(pdir, "scores", "*-py.json"))):
        d = load(p) or {}
        for c in d.get("compared", []):
            py[os.path.basename(c["model"].rstrip("/"))] = c
    for r in runs:
        key = r.get("scored_as") or r["run"]
        if key in scores:
            r["score"] = scores[key]
        # The second scorer: for llm-compressor its own compressed-tensors folder (independent of
        # ct_to_gptq.py), for the others the GPTQ folder the first scorer read.
        if key + "-ct" in py:
            r["score_python"] = py[key + "-ct"]
            r["score_python_gptq_copy"] = py.get(key)
        elif key in py:
            r["score_python"] = py[key]
    hdr = f"{'run':22} {'tool':15} {'setting':34} {'wall s':>8} {'GPU GB':>7} {'host GB':>8} {'KL':>8} {'ppl':>9} {'top-1':>7} {'KL(py)':>8}"
    lines = [hdr, "-" * len(hdr)]
    for r in runs:
        m = r.get("measure", {})
        s = r.get("score", {})
        q = r.get("score_python") or {}
        status = ""
        if m.get("timed_out"):
            status = " TIMEOUT"
        elif m.get("rc") not in (0, None):
            status = f" rc={m.get('rc')}"
        lines.append(
            f"{r['run']:22} {r.get('tool', '?'):15} {r.get('setting', '')[:34]:34} {fmt(m.get('wall_s'), '8.1f')} "
            f"{fmt(m.get('peak_gpu_gb'), '7.2f')} {fmt(m.get('peak_host_gb'), '8.2f')} {fmt(s.get('mean_kl'), '8.4f')} "
            f"{fmt(s.get('ppl'), '9.3f')} {fmt(None if s.get('top1') is None else 100 * s['top1'], '6.2f')}{'%' if s.get('top1') is not None else ' '} "
            f"{fmt(q.get('mean_kl'), '8.4f')}{status}")
    refs = {k[len("__ref__"):]: v for k, v in scores.items() if k.startswith("__ref__")}
    for k, v in refs.items():
        lines.append(f"reference ({k}): ppl {v.get('ppl'):.3f} on {v.get('tokens')} tokens, {v.get('windows')} windows of {v.get('seqlen')}")
    text = "\n".join(lines)
    print(text)
    json.dump({"runs": runs, "references": refs, "table": text}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
