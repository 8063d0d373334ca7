"""Runs one tool as a child process and measures it from the outside, the same way for every
tool: wall seconds, peak GPU memory (nvidia-smi's device-level memory.used, polled every 0.2 s
by one `nvidia-smi -lms 200` stream, minus the reading before the start: it includes the CUDA
context and the caching allocators' reserve), peak host memory (the largest of the summed RSS of
the child's process tree, polled every 0.2 s from /proc, and the child's own ru_maxrss from
wait4), the exit status, and whether a timeout stopped it.

  python3 measure.py --json OUT.json --timeout 540 --log LOG [--stdout FILE] -- CMD ARGS...
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time


def tree_rss(root):
    """Summed VmRSS (bytes) of root and its descendants, from /proc."""
    kids = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(p)
        except (OSError, ValueError, IndexError):
            pass
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
        todo.extend(kids.get(p, []))
    return total


class GpuPoll:
    def __init__(self, index):
        self.peak = None
        self.base = None
        self.samples = 0
        self.proc = None
        self.index = index
        try:
            q = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)]
            self.base = float(subprocess.check_output(q, timeout=20).decode().split()[0])
            self.proc = subprocess.Popen(q + ["-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        except Exception as e:  # noqa: BLE001 (no GPU, no nvidia-smi)
            self.error = str(e)

    def _read(self):
        for line in self.proc.stdout:
            try:
                v = float(line.split()[0])
            except (ValueError, IndexError):
                continue
            self.samples += 1
            self.peak = v if self.peak is None else max(self.peak, v)

    def stop(self):
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--timeout", type=float, default=0)
    ap.add_argument("--log", help="stdout and stderr of the child (stderr only with --stdout)")
    ap.add_argument("--stdout", help="the child's stdout alone into this file")
    ap.add_argument("--gpu", type=int, default=int(os.environ.get("PEERS_GPU", "0")))
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    gpu = GpuPoll(a.gpu)
    log = open(a.log, "w") if a.log else None
    out = open(a.stdout, "w") if a.stdout else None
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=out or log or None, stderr=log if log else None, start_new_session=True)
    peak_tree, timed_out, ru = 0, False, None
    while True:
        try:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        except ChildProcessError:
            status = 0
            break
        if pid:
            break
        peak_tree = max(peak_tree, tree_rss(p.pid))
        if a.timeout and time.perf_counter() - t0 > a.timeout and not timed_out:
            timed_out = True
            os.killpg(p.pid, signal.SIGTERM)
            time.sleep(5)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    time.sleep(0.3)
    gpu.stop()
    rc = os.waitstatus_to_exitcode(status) if ru is not None else None
    maxrss = ru.ru_maxrss * 1024 if ru is not None else 0
    rec = {
        "cmd": cmd,
        "rc": rc,
        "timed_out": timed_out,
        "wall_s": round(wall, 2),
        "peak_host_gb": round(max(peak_tree, maxrss) / 1e9, 3),
        "peak_host_tree_polled_gb": round(peak_tree / 1e9, 3),
        "child_maxrss_gb": round(maxrss / 1e9, 3),
        "gpu_baseline_mib": gpu.base,
        "gpu_peak_mib": gpu.peak,
        "gpu_samples": gpu.samples,
        "peak_gpu_gb": None if gpu.peak is None else round((gpu.peak - (gpu.base or 0)) * 1048576 / 1e9, 3),
    }
    json.dump(rec, open(a.json, "w"), indent=1)
    print(f"[measure] rc {rc}{' (timeout)' if timed_out else ''}, wall {wall:.1f} s, host {rec['peak_host_gb']} GB, "
          f"GPU {rec['peak_gpu_gb']} GB", file=sys.stderr)
    sys.exit(0)


if __name__ == "__main__":
    main()
