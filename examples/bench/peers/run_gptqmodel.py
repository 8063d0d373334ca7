"""GPTQModel on the exported calibration windows: GPTQ W4A16, symmetric, desc_act with
static groups, damp 0.01, optional MSE clipping search (norm 2.4, grid 100, maxshrink 0.8: the
quantizer's defaults, the same as soar-gptq's --mse), lm_head not quantized. Writes GPTQ v1
(format=gptq) with GPTQModel's own save, and a result record.

  python3 run_gptqmodel.py --model DIR --calib tokens.json --out DIR --group-size 64 [--mse 2.4]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import driver_parser, load_windows, memory_record, start_driver, torch_device, versions, write_result  # noqa: E402


def main():
    ap = driver_parser()
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--mse", type=float, default=0.0, help="norm of the MSE clipping search; 0 = off (plain min/max)")
    ap.add_argument("--desc-act", default="static", choices=["static", "dynamic", "off"])
    ap.add_argument("--batch-size", type=int, default=1)
    a = ap.parse_args()
    ph = start_driver(a)

    # GPTQModel's thread pool asks for 2 model-loader workers under a 'cpu' pool sized
    # (cores + 1) // 2: on a 2-core machine that pool has 1 and it refuses to start.
    if (os.cpu_count() or 1) < 4:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    wins, doc = load_windows(a.calib)
    dev = torch_device(a.device)
    qcfg = QuantizeConfig(
        bits=a.bits,
        group_size=a.group_size,
        sym=True,
        desc_act=a.desc_act != "off",
        static_groups=a.desc_act == "static",
        act_group_aware=False,
        damp_percent=a.damp,
        mse=a.mse,
        true_sequential=True,
        lm_head=False,
        # On a GPU GPTQModel picks the device itself (its README's way); on the CPU it must be told.
        device="cpu" if dev == "cpu" else None,
    )
    model = ph.run("load", GPTQModel.load, a.model, qcfg, backend=BACKEND.TORCH)
    calib = [{"input_ids": w, "attention_mask": [1] * len(w)} for w in wins]
    ph.run("quantize", model.quantize, calib, batch_size=a.batch_size, backend=BACKEND.TORCH,
           calibration_sort=None)
    ph.run("save", model.save, a.out)
    rec = {
        "tool": "gptqmodel",
        "versions": versions("gptqmodel", "torch", "transformers"),
        "device": dev,
        "windows": len(wins),
        "seqlen": len(wins[0]),
        "calibration_sha256": doc.get("calibration_sha256"),
        "settings": {"bits": a.bits, "group_size": a.group_size, "sym": True, "desc_act": a.desc_act,
                     "damp_percent": a.damp, "mse": a.mse, "true_sequential": True, "lm_head": False,
                     "backend": "torch", "batch_size": a.batch_size,
                     # JIT-built native paths, allowed unless disabled (peers.sh disables both by default)
                     "gptq_block_cuda_ext_allowed": os.environ.get("GPTQMODEL_DISABLE_GPTQ_CUDA") != "1",
                     "pack_block_cpu_ext_allowed": os.environ.get("GPTQMODEL_DISABLE_PACK_EXT") != "1"},
        "phases": ph.t,
        "total_s": ph.total(),
    }
    rec.update(memory_record())
    write_result(a.result, rec)


if __name__ == "__main__":
    main()
