#!/usr/bin/env python3
"""Eager PyTorch GPTQ solver: the baseline of the GPU benchmark in docs/benchmarks.md.

Written from docs/algorithm.md (Preprocessing of H, The quantizer, The column loop,
Post-processing), not copied from any tool. It solves one Linear at a time, the way the reference
tools' `fasterquant` does: column by column in float32 on the device, in blocks with lazy updates.

    python3 examples/bench/gptq_eager.py DIR [--device cuda] [--warmup 1] [--repeat 5] [--json]

DIR (or a single file) holds `*.safetensors` files written by the Rust benchmark. Each one has
  tensors   w  float32 [N, K]  the Linear's weight (rows = output channels)
            h  float32 [K, K]  the Hessian of its inputs (any positive scale)
  metadata  bits ("4"), group_size ("128"; "-1" = one group), act_order ("static" | "dynamic" |
            "off"), sym ("true" | "false"), damp ("0.01"), block_size ("128").
The timed region is the whole solve on the device (dead columns, permutation, damping, the
Cholesky / inverse / Cholesky pipeline and the column loop), not the host-to-device copy.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

REQUIRED = ("bits", "group_size", "act_order", "sym", "damp", "block_size")


def find_params(x, maxq, sym):
    """Per-row scale and zero over the columns of x [N, cols] (docs/algorithm.md, The quantizer)."""
    zero_row = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)
    xmin = torch.minimum(x.min(dim=1).values, zero_row)
    xmax = torch.maximum(x.max(dim=1).values, zero_row)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)  # an all-nonnegative row keeps xmin = 0
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both_zero, -torch.ones_like(xmin), xmin)
    xmax = torch.where(both_zero, torch.ones_like(xmax), xmax)
    scale = (xmax - xmin) / maxq
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.round(-xmin / scale)
    return scale, zero


def quantize(w, scale, zero, maxq):
    """Fake-quantized value of w with per-row scale/zero (torch.round = half to even)."""
    code = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
    return scale * (code - zero)


def inverse_cholesky_upper(h, damp):
    """U with inv(H + damp*mean(diag H)*I) = U^T U; on failure doubles damp (up to 1.0)."""
    diag = h.diagonal()
    undamped = diag.clone()
    mean_diag = undamped.mean()
    while True:
        diag.copy_(undamped + damp * mean_diag)
        try:
            lower = torch.linalg.cholesky(h)
            hinv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(hinv, upper=True), damp
        except torch.linalg.LinAlgError:
            if damp >= 1.0:
                raise
            damp = min(2.0 * damp, 1.0)


def solve(w, h, bits, group_size, act_order, sym, damp, block_size):
    """GPTQ of w [N, K] against h [K, K]; returns (Q [N, K] in original order, loss, damp used)."""
    w = w.clone()
    h = h.clone()
    n, k = w.shape
    maxq = 2**bits - 1
    g = k if group_size <= 0 else group_size
    # One group: parameters from the whole matrix, before dead columns are zeroed
    # (docs/algorithm.md, Post-processing).
    whole = find_params(w, maxq, sym) if group_size <= 0 else None

    dead = torch.diag(h) == 0  # dead columns (docs/algorithm.md, Preprocessing of H)
    h[dead, dead] = 1
    w[:, dead] = 0

    static = None
    if act_order == "static" and whole is None:  # original groups, before permuting
        static = [find_params(w[:, t : t + g], maxq, sym) for t in range(0, k, g)]

    if act_order == "off":
        perm = torch.arange(k, device=w.device)
    else:  # stable, so equal diagonals keep index order
        perm = torch.sort(torch.diag(h), descending=True, stable=True).indices
        w = w[:, perm]
        h = h[perm][:, perm]
    invperm = torch.argsort(perm)
    static_row = (perm // g).tolist() if static is not None else None

    u, damp_used = inverse_cholesky_upper(h, damp)  # damping, factor (Preprocessing of H)
    del h

    q_all = torch.zeros_like(w)
    losses = torch.zeros_like(w)
    scale, zero = whole if whole is not None else (None, None)
    for i1 in range(0, k, block_size):  # docs/algorithm.md, The column loop
        i2 = min(i1 + block_size, k)
        count = i2 - i1
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        loss1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(count):
            c = i1 + i
            if static is not None:
                scale, zero = static[static_row[c]]
            elif whole is None and c % g == 0:  # params from the current W (lazy updates only)
                scale, zero = find_params(w[:, c : c + g], maxq, sym)
            col = w1[:, i]
            d = u1[i, i]
            q = quantize(col, scale, zero, maxq)
            q1[:, i] = q
            loss1[:, i] = (col - q) ** 2 / d**2 / 2
            err = (col - q) / d
            w1[:, i:] -= err.unsqueeze(1).matmul(u1[i, i:].unsqueeze(0))
            err1[:, i] = err
        q_all[:, i1:i2] = q1
        losses[:, i1:i2] = loss1
        w[:, i2:] -= err1.matmul(u[i1:i2, i2:])

    loss = losses.to(torch.float64).sum().item()
    return q_all[:, invperm], loss, damp_used


def read_problem(path):
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    missing = [key for key in REQUIRED if key not in meta]
    if missing or "w" not in tensors or "h" not in tensors:
        sys.exit(f"{path}: needs tensors w, h and metadata {', '.join(REQUIRED)}; missing {missing}")
    if meta["act_order"] not in ("static", "dynamic", "off"):
        sys.exit(f"{path}: act_order must be static, dynamic or off, got {meta['act_order']!r}")
    opts = dict(
        bits=int(meta["bits"]),
        group_size=int(meta["group_size"]),
        act_order=meta["act_order"],
        sym=meta["sym"].lower() == "true",
        damp=float(meta["damp"]),
        block_size=int(meta["block_size"]),
    )
    return tensors["w"].to(torch.float32), tensors["h"].to(torch.float32), opts


def timed(fn, device):
    """Seconds of one call of fn on the device, and its result."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0, out
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path, help="folder of *.safetensors problems (or one file)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    args = ap.parse_args()
    if args.repeat < 1:
        sys.exit("--repeat must be at least 1")
    # The peers solve in true float32: no TF32 in the matmuls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    files = [args.dir] if args.dir.is_file() else sorted(args.dir.glob("*.safetensors"))
    if not files:
        sys.exit(f"no *.safetensors in {args.dir}")

    results = []
    for path in files:
        w_host, h_host, opts = read_problem(path)
        w, h = w_host.to(device), h_host.to(device)
        for _ in range(args.warmup):
            solve(w, h, **opts)
        times = []
        for _ in range(args.repeat):
            seconds, (_, loss, damp_used) = timed(lambda: solve(w, h, **opts), device)
            times.append(seconds)
        results.append(dict(
            file=path.name, n=w.shape[0], k=w.shape[1],
            seconds_median=statistics.median(times), seconds_min=min(times),
            loss=loss, damp=damp_used, device=str(device), torch_version=torch.__version__,
        ))
        del w, h

    if args.json:
        print(json.dumps(results, indent=2))
        return
    name_w = max(len("file"), *(len(r["file"]) for r in results))
    print(f"{'file':<{name_w}}  {'shape':>11}  {'median s':>9}  {'min s':>9}  {'loss':>12}  damp")
    for r in results:
        shape = f"{r['n']}x{r['k']}"
        print(f"{r['file']:<{name_w}}  {shape:>11}  {r['seconds_median']:>9.4f}  "
              f"{r['seconds_min']:>9.4f}  {r['loss']:>12.5g}  {r['damp']:g}")
    print(f"device {device}, torch {torch.__version__}, warmup {args.warmup}, repeat {args.repeat}")


if __name__ == "__main__":
    main()
