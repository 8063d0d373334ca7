"""compressed-tensors pack-quantized (llm-compressor's output: int4, symmetric, group strategy,
actorder static/weight or none) -> a standard GPTQ v1 checkpoint:
  qweight int32 [in/8, out] (codes q = c + 8 in 0..15 packed along the input dim, low nibble first),
  qzeros int32 [groups, out/8] (the symmetric zero 8 stored as 7), scales fp16 [groups, out],
  g_idx int32 [in] (k // group_size: the static groups llm-compressor's "static" actorder keeps),
with quantization_config {quant_method gptq, checkpoint_format gptq, sym, static_groups}.
Every other tensor (embeddings, norms, an unquantized lm_head) is copied as stored.

llm-compressor stores the scales in the model's dtype (bf16); GPTQ stores fp16. Every bf16 scale
is checked to convert exactly (no scale of a 4-bit group is out of fp16's range in practice);
an inexact one is counted and the conversion fails unless --allow-inexact.

--verify (default on) proves the conversion: the source is decoded with compressed-tensors' own
unpack_from_int32 and dequantize (f32), the written GPTQ folder with gptq_io.py, and the two
dense weights must be equal bit for bit, module by module.

  python3 ct_to_gptq.py CT_DIR GPTQ_DIR [--no-verify] [--allow-inexact]
"""

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gptq_io import ct_codes, ct_modules, gptq_dequant, load_tensors, pack_cols, pack_rows  # noqa: E402

COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
        "chat_template.jinja", "tokenizer.model")


def convert(src, dst, verify=True, allow_inexact=False, shard_bytes=4_000_000_000):
    cfg = json.load(open(os.path.join(src, "config.json")))
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        sys.exit(f"{src}: not a compressed-tensors pack-quantized checkpoint ({qc.get('quant_method')}, {qc.get('format')})")
    groups = list(qc["config_groups"].values())
    if len(groups) != 1:
        sys.exit(f"{src}: {len(groups)} config groups; one expected")
    w = groups[0]["weights"]
    if not (w["num_bits"] == 4 and w["type"] == "int" and w["symmetric"] and w["strategy"] == "group"):
        sys.exit(f"{src}: only int4 symmetric group quantization converts to GPTQ v1 here ({w})")
    if w.get("actorder") not in (None, "static", "weight"):
        sys.exit(f"{src}: actorder {w.get('actorder')} (g_idx on disk) is not converted here")
    gs = int(w["group_size"])
    t = load_tensors(src)
    mods = ct_modules(t)
    out, inexact, nscales = {}, 0, 0
    for m in mods:
        codes, scales, zp, g = ct_codes(t, m)  # [out, in] signed, [out, G], [out, G]
        if (zp != 0).any():
            sys.exit(f"{m}: non-zero zero points in a symmetric checkpoint")
        if g is not None and not torch.equal(g, torch.arange(codes.shape[1]) // gs):
            sys.exit(f"{m}: a non-trivial g_idx")
        n_out, n_in = codes.shape
        q = (codes + 8).to(torch.int32)
        if q.min() < 0 or q.max() > 15:
            sys.exit(f"{m}: codes out of range")
        s_src = t[m + ".weight_scale"]
        s16 = s_src.to(torch.float16)
        nscales += s16.numel()
        bad = (s16.float() != s_src.float()) | ~torch.isfinite(s16.float())
        inexact += int(bad.sum())
        out[m + ".qweight"] = pack_rows(q.t().contiguous())
        out[m + ".qzeros"] = pack_cols(torch.full((scales.shape[1], n_out), 7, dtype=torch.int32))
        out[m + ".scales"] = s16.t().contiguous()
        out[m + ".g_idx"] = (torch.arange(n_in, dtype=torch.int32) // gs)
    if inexact and not allow_inexact:
        sys.exit(f"{inexact} of {nscales} scales do not convert exactly from {s_src.dtype} to fp16")
    skip = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape")
    for k, v in t.items():
        if not k.endswith(skip):
            out[k] = v.contiguous()
    os.makedirs(dst, exist_ok=True)
    # Shards by size, with an index when there is more than one.
    shards, cur, size = [], {}, 0
    for k in sorted(out):
        n = out[k].numel() * out[k].element_size()
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = out[k]
        size += n
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    else:
        wm = {}
        for i, sh in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, os.path.join(dst, name), metadata={"format": "pt"})
            wm.update({k: name for k in sh})
        json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(dst, "model.safetensors.index.json"), "w"), indent=1)
    cfg["quantization_config"] = {
        "quant_method": "gptq", "checkpoint_format": "gptq", "bits": 4, "group_size": gs, "sym": True,
        "desc_act": False, "static_groups": w.get("actorder") in ("static", "weight"), "true_sequential": True,
        "lm_head": not any(x in ("lm_head", "re:.*lm_head") for x in qc.get("ignore", [])) and "lm_head.qweight" in out,
        "damp_percent": None,
        "meta": {"quantizer": [f"llm-compressor (compressed-tensors {qc.get('version')})", "ct_to_gptq.py"],
                 "source_actorder": w.get("actorder"), "source_observer": w.get("observer")},
    }
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    for f in COPY:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    rec = {"modules": len(mods), "scales": nscales, "inexact_scales": inexact, "scale_dtype_source": str(s_src.dtype)}
    if verify:
        rec.update(verify_folders(src, dst, w))
    print(f"[ct_to_gptq] {src} -> {dst}: {rec}", file=sys.stderr)
    return rec


def verify_folders(src, dst, wargs):
    """Both folders decoded to f32 dense weights, compared bit for bit: the source through
    compressed-tensors' own unpack_from_int32 and dequantize, the GPTQ copy through gptq_io."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(**{k: v for k, v in wargs.items() if k in ("num_bits", "type", "symmetric", "strategy", "group_size")})
    a, b = load_tensors(src), load_tensors(dst)
    mods = ct_modules(a)
    differ, maxdiff, elems = [], 0.0, 0
    for m in mods:
        shape = torch.Size(a[m + ".weight_shape"].tolist())
        xq = unpack_from_int32(a[m + ".weight_packed"], args.num_bits, shape)
        zp = a.get(m + ".weight_zero_point")
        ref = dequantize(xq, a[m + ".weight_scale"].float(), None if zp is None else zp, args, dtype=torch.float32)
        got = gptq_dequant(b, m)
        elems += ref.numel()
        if not torch.equal(ref, got):
            differ.append(m)
            maxdiff = max(maxdiff, (ref - got).abs().max().item())
    for k in a:
        if not k.endswith((".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape")):
            if not torch.equal(a[k], b[k]):
                differ.append(k)
    res = {"verified_modules": len(mods), "verified_weights": elems, "differ": differ[:8], "n_differ": len(differ),
           "max_abs_diff": maxdiff, "bit_exact": not differ}
    if differ:
        sys.exit(f"[ct_to_gptq] verification FAILED: {res}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--allow-inexact", action="store_true")
    a = ap.parse_args()
    print(json.dumps(convert(a.src, a.dst, verify=not a.no_verify, allow_inexact=a.allow_inexact)))


if __name__ == "__main__":
    main()
