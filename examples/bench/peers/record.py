"""Merges what examples/bench/peers.sh learned about one run into $P/runs/RUN.json: the outside
measurement (measure.py), the peer driver's own record (phases, torch allocator peaks), soar-gptq's
report (--json: stages, its own GPU and host peaks, calibration hash), the calibration hash of
the exported windows, how far a stopped run got, and the last error line of a failed one.

  python3 record.py P RUN TOOL SETTING MODEL CALIB_JSON [SCORED_AS]
"""

import json
import os
import re
import sys


def load(p):
    try:
        return json.load(open(p))
    except Exception:  # noqa: BLE001
        return None


def main():
    p, run, tool, setting, model, calib = sys.argv[1:7]
    scored_as = sys.argv[7] if len(sys.argv) > 7 else run
    logs = os.path.join(p, "logs")
    rec = {"run": run, "tool": tool, "setting": setting, "model": model, "scored_as": scored_as}
    rec["measure"] = load(os.path.join(logs, run + ".measure.json")) or {}
    peer = load(os.path.join(logs, run + ".peer.json"))
    if peer:
        rec["peer"] = peer
    rep = load(os.path.join(logs, run + ".report.json"))
    if rep:
        rec["soar_report"] = {k: rep.get(k) for k in ("settings", "calibration_sha256", "total_seconds", "seconds",
                                                        "peak_rss_bytes", "gpu_memory", "stages", "preflight")}
    cdoc = load(calib) or {}
    rec["calibration_sha256_exported"] = cdoc.get("calibration_sha256")
    used = (rep or {}).get("calibration_sha256") or (peer or {}).get("calibration_sha256")
    rec["calibration_sha256_used"] = used
    # soar-gptq's own draw against the exported windows; a peer driver records the file it was given.
    rec["same_calibration"] = None if not used else used == cdoc.get("calibration_sha256")
    try:
        text = open(os.path.join(logs, run + ".log"), errors="replace").read()
    except OSError:
        text = ""
    seen = [int(x) for x in re.findall(r"layers\.(\d+)\.", text)]
    seen += [int(x) - 1 for x in re.findall(r"Quantizing layer (\d+) of", text)]
    if seen:
        rec["last_layer_seen"] = max(seen)
    if rec["measure"].get("rc") not in (0, None) or rec["measure"].get("timed_out"):
        errs = [l.strip() for l in text.splitlines() if re.search(r"(Error|error:|Exception|Traceback|panicked)", l)]
        rec["error"] = errs[-3:] if errs else text.strip().splitlines()[-3:]
    json.dump(rec, open(os.path.join(p, "runs", run + ".json"), "w"), indent=1)
    m = rec["measure"]
    print(f"{run}: rc {m.get('rc')}{' TIMEOUT' if m.get('timed_out') else ''}, wall {m.get('wall_s')} s, "
          f"GPU {m.get('peak_gpu_gb')} GB, host {m.get('peak_host_gb')} GB, same calibration: {rec['same_calibration']}"
          + (f", last layer seen {rec.get('last_layer_seen')}" if m.get("timed_out") else "")
          + (f"\n  error: {rec['error']}" if rec.get("error") else ""))


if __name__ == "__main__":
    main()
