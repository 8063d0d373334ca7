"""Shared helpers of the peer drivers (examples/bench/peers.sh): the calibration windows that
`soar-gptq export-calib` writes, timings, memory figures and the result record."""

import json
import os
import resource
import sys
import time


def load_windows(path):
    """The token-id windows of an export-calib JSON file: a list of lists of ints."""
    with open(path) as f:
        doc = json.load(f)
    wins = doc["windows"]
    if not wins or not all(isinstance(w, list) and w for w in wins):
        sys.exit(f"{path}: no windows")
    return wins, doc


def torch_device(arg):
    import torch

    if arg == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return arg


class Phases:
    """Wall seconds of named phases (load, quantize, save, ...)."""

    def __init__(self):
        self.t = {}
        self.t0 = time.perf_counter()

    def run(self, name, fn, *a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.t[name] = round(time.perf_counter() - s, 2)
            print(f"[peer] {name}: {self.t[name]:.1f} s", file=sys.stderr, flush=True)

    def total(self):
        return round(time.perf_counter() - self.t0, 2)


def memory_record():
    """Peak figures as the process itself sees them: torch's allocator peaks on the GPU and
    this process's peak RSS (ru_maxrss)."""
    rec = {"peak_rss_gb_self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)}
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rec["torch_max_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
            rec["torch_max_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 3)
    except Exception as e:  # noqa: BLE001
        rec["torch_memory_error"] = str(e)
    return rec


def write_result(path, rec):
    if not path:
        print(json.dumps(rec, indent=1))
        return
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"[peer] result -> {path}", file=sys.stderr)


def versions(*names):
    out = {}
    from importlib import metadata

    for n in names:
        try:
            out[n] = metadata.version(n)
        except Exception:  # noqa: BLE001
            out[n] = None
    return out


def set_threads():
    # Deterministic-ish CPU runs on the small dev machine; leaves GPU runs alone.
    n = os.environ.get("PEERS_THREADS")
    if n:
        import torch

        torch.set_num_threads(int(n))


def driver_parser():
    """The flags every driver takes: the model, the export-calib windows, the output folder, the
    group size, the device and the result record; each driver adds its own."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--result")
    return ap


def start_driver(a, paths=("model", "calib", "out", "result")):
    """Makes the path flags absolute, moves into the output's parent folder (peers write logs/
    into the working directory: they stay beside the output), sets the CPU threads and starts
    the phase clock."""
    for k in paths:
        if getattr(a, k, None):
            setattr(a, k, os.path.abspath(getattr(a, k)))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    os.chdir(os.path.dirname(a.out))
    set_threads()
    return Phases()
