"""Reading quantized checkpoints back into dense weights, for the converter's proof and the
second scorer (examples/bench/peers.sh).

GPTQ v1 (what GPTQModel writes with format=gptq and what ct_to_gptq.py writes), per linear:
  qweight int32 [in/8, out]   eight 4-bit codes per word along the input dim, low nibble first
  qzeros  int32 [groups, out/8]  zero points packed along the output dim, stored as zero - 1
  scales  fp16  [groups, out]
  g_idx   int32 [in]          the group of each input column (trivial k // g for static groups)
  W[k, j] = scales[g_idx[k], j] * (q[k, j] - (qzeros[g_idx[k], j] + 1))   (HF weight = W^T)

compressed-tensors pack-quantized (llm-compressor), per linear:
  weight_packed int32 [out, in/8]  eight 4-bit codes per word along the input dim, low nibble
                                   first, stored as q + 8 (offset binary of a signed code)
  weight_scale  [out, groups], weight_zero_point [out, groups] (asymmetric only),
  weight_g_idx  [in] (actorder group only), weight_shape [2]
  W[j, k] = weight_scale[j, g(k)] * (code[j, k] - 8 - zero_point[j, g(k)])
"""

import json
import os

import torch
from safetensors import safe_open


def load_tensors(folder):
    """All tensors of a checkpoint folder (any shards), on the CPU."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise SystemExit(f"{folder}: no .safetensors files")
    out = {}
    for f in files:
        with safe_open(os.path.join(folder, f), framework="pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def unpack_rows(packed, bits=4):
    """int32 [R, C] holding 32/bits codes per word along R -> int32 [R*32/bits, C]."""
    per = 32 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(per, dtype=torch.int32) * bits
    x = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & mask  # [R, per, C]
    return x.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed, bits=4):
    """int32 [R, C] holding 32/bits codes per word along C -> int32 [R, C*32/bits]."""
    return unpack_rows(packed.t().contiguous(), bits).t().contiguous()


def pack_rows(codes, bits=4):
    """int32 [R, C] of codes -> int32 [R/per, C] (inverse of unpack_rows)."""
    per = 32 // bits
    r, c = codes.shape
    assert r % per == 0, (r, per)
    x = codes.to(torch.int64).reshape(r // per, per, c)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (x << shifts.view(1, per, 1)).sum(dim=1)  # < 2^32
    return (words - ((words >> 31) << 32)).to(torch.int32)  # wrap into int32


def pack_cols(codes, bits=4):
    return pack_rows(codes.t().contiguous(), bits).t().contiguous()


def gptq_modules(tensors):
    return sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))


def gptq_codes(tensors, name, bits=4):
    """(codes int32 [in, out], zeros int32 [groups, out] as true zero points, scales f32
    [groups, out], g_idx int64 [in]) of one GPTQ v1 module."""
    qw = tensors[name + ".qweight"]
    codes = unpack_rows(qw, bits)
    zeros = unpack_cols(tensors[name + ".qzeros"], bits)[:, : codes.shape[1]] + 1
    scales = tensors[name + ".scales"].float()
    g = tensors.get(name + ".g_idx")
    if g is None:
        gs = codes.shape[0] // scales.shape[0]
        g = torch.arange(codes.shape[0]) // gs
    return codes, zeros, scales, g.long()


def gptq_dequant(tensors, name, bits=4):
    """The HF-layout weight [out, in] (float32) of one GPTQ v1 module."""
    codes, zeros, scales, g = gptq_codes(tensors, name, bits)
    w = scales[g] * (codes - zeros[g]).float()  # [in, out]
    return w.t().contiguous()


def ct_modules(tensors):
    return sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))


def ct_codes(tensors, name, bits=4):
    """(signed codes int32 [out, in], scales f32 [out, groups], zero points int32 [out, groups],
    g_idx int64 [in] or None) of one compressed-tensors pack-quantized module."""
    packed = tensors[name + ".weight_packed"]
    shape = tensors[name + ".weight_shape"].tolist()
    codes = unpack_cols(packed, bits)[:, : shape[1]] - (1 << (bits - 1))
    scales = tensors[name + ".weight_scale"].float()
    zp = tensors.get(name + ".weight_zero_point")
    zp = torch.zeros_like(scales, dtype=torch.int32) if zp is None else zp.to(torch.int32)
    g = tensors.get(name + ".weight_g_idx")
    return codes, scales, zp, (None if g is None else g.long())


def ct_dequant(tensors, name, bits=4):
    codes, scales, zp, g = ct_codes(tensors, name, bits)
    if g is None:
        gs = codes.shape[1] // scales.shape[1]
        g = torch.arange(codes.shape[1]) // gs
    return scales[:, g] * (codes - zp[:, g]).float()


def dequant_folder(folder):
    """{module name: dense HF weight [out, in] f32} of a GPTQ or compressed-tensors folder,
    plus every other (unquantized) tensor as stored."""
    t = load_tensors(folder)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    qc = cfg.get("quantization_config") or {}
    dense = {}
    if any(k.endswith(".qweight") for k in t):
        bits = int(qc.get("bits", 4))
        mods = gptq_modules(t)
        for m in mods:
            dense[m + ".weight"] = gptq_dequant(t, m, bits)
        skip = (".qweight", ".qzeros", ".scales", ".g_idx")
    else:
        mods = ct_modules(t)
        for m in mods:
            dense[m + ".weight"] = ct_dequant(t, m)
        skip = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape")
    for k, v in t.items():
        if not k.endswith(skip):
            dense.setdefault(k, v)
    return dense, mods
