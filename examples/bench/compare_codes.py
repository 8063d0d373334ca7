"""Compares the integer codes of two GPTQ checkpoints of the same model (e.g. a GPU and a CPU
quantize run): per quantized module, the fraction of codes that differ and the largest
difference, plus the largest relative scale difference. Used by examples/bench/gpu_bench.sh.

    python3 compare_codes.py A_DIR B_DIR

Only the standard library, numpy and safetensors.
"""
import glob
import json
import os
import sys

import numpy as np
from safetensors import safe_open


def load(d):
    """The qweight and scales tensors of a folder (numpy has no bfloat16 for the rest)."""
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with safe_open(f, framework="np") as st:
            for name in st.keys():
                if name.endswith((".qweight", ".scales")):
                    out[name] = st.get_tensor(name)
    cfg = json.load(open(os.path.join(d, "config.json")))["quantization_config"]
    return out, int(cfg["bits"])


def codes(qweight, bits):
    """[K*bits/32, N] int32 words -> [K, N] codes (LSB-first bit stream along K)."""
    w = qweight.astype(np.uint32)
    rows, n = w.shape
    k = rows * 32 // bits
    bitpos = np.arange(k, dtype=np.int64) * bits
    wi, sh = bitpos // 32, (bitpos % 32).astype(np.uint32)
    lo = w[wi] >> sh[:, None]
    nxt = np.minimum(wi + 1, rows - 1)
    spill = (sh + bits > 32)[:, None]
    hi = np.where(spill, w[nxt] << ((32 - sh) % 32)[:, None], 0).astype(np.uint32)
    return ((lo | hi) & ((1 << bits) - 1)).astype(np.int16)


def main():
    a, bits = load(sys.argv[1])
    b, bits_b = load(sys.argv[2])
    assert bits == bits_b, "different bit widths"
    total = differ = 0
    max_diff = 0
    max_scale = 0.0
    for name in sorted(x for x in a if x.endswith(".qweight")):
        ca, cb = codes(a[name], bits), codes(b[name], bits)
        d = np.abs(ca - cb)
        total += d.size
        differ += int((d != 0).sum())
        max_diff = max(max_diff, int(d.max()))
        sa = a[name.replace("qweight", "scales")].astype(np.float32)
        sb = b[name.replace("qweight", "scales")].astype(np.float32)
        max_scale = max(max_scale, float((np.abs(sa - sb) / np.maximum(np.abs(sa), 1e-12)).max()))
    print(json.dumps({
        "codes": total,
        "codes_differing": differ,
        "fraction_differing": differ / max(total, 1),
        "largest_code_difference": max_diff,
        "largest_relative_scale_difference": max_scale,
    }))


if __name__ == "__main__":
    main()
