#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, in one script for the H200 machine.
#
# Build here (no GPU needed), with a CUDA 12/13 toolchain (nvcc) on PATH or under CUDA_HOME and
# CUDA_COMPUTE_CAP=90 (docs/gpu.md says how the project's build machines get one):
#   CARGO_TARGET_DIR=target-cuda cargo build --release --features cuda --examples
#   CARGO_TARGET_DIR=target-cuda cargo test --release --features cuda --no-run
# then put xz-compressed copies into .gpu/ (git-ignored):
#   soar-gptq.xz, bench_solver.xz, cuda.xz (the tests/cuda binary)
# and run on the GPU machine, carrying .gpu:
#   bash examples/bench/gpu_bench.sh twins solver small e2e128 e2e256
#
# Stages (any order, any subset):
#   twins   the CUDA kernels against their CPU twins (tests/cuda; TWINS_ARGS: test-harness
#           arguments, e.g. "twins::" for the GPTQ kernels only)
#   cmp128  the 9.5B at 128 x 2048 with .gpu/soar-base.xz and this build
#   long    the 9.5B at LONG_N x LONG_LEN (default 16 x 49152; LONG_LEN may be MIN..MAX), LONG_FLAGS,
#           cut at LONG_TIMEOUT s (each layer's down_proj line, stamped, shows the pace)
#   hostcache the 9.5B at HC_N x HC_LEN (default 16 x 49152) three ways: every layer cache on the
#           GPU, the mixer outputs in page-locked host memory (--max-gpu-memory HC_CAP, default
#           17.7: the hidden states and the fixed working set fill it), and recomputed (the same
#           cap and --max-host-memory 4); stage tables and the outputs compared byte for byte
#   evallong  eval-ppl --seqlen EVAL_LEN (32768) of the 9.5B against long's output (KEEP_LONG=1), plot
#   ptx     the shipped model with CUDA_FORCE_PTX_JIT=1 (all-architecture build .gpuall/soar-allarch.xz)
#   sm80    the shipped model with a CUDA_COMPUTE_CAP=80 build (.gpuall/soar-sm80.xz), whose PTX
#           the driver must JIT on this GPU, against this build: files and codes compared
#   solver  GPTQ solver on the MiniCPM-SALA shapes: our GPU and CPU solvers, and the eager
#           PyTorch baseline (examples/bench/gptq_eager.py) on the same saved W and H;
#           tensor-core XᵀX rates
#   trace   the phases of one GPU solve per shape (SOAR_GPTQ_TRACE=1 and 2)
#   small   the shipped tiny-sala model: GPU vs CPU quantize (codes, perplexity), two GPU
#           runs (manifests), eval-ppl of GPTQ and Marlin folders on the GPU
#   train   retrain the fixture on the GPU (time budget TRAIN_SECS, default 240 s)
#   quality the fixture's quality table: BF16, RTN, GPTQ static/dynamic/skip at 4 and 3 bits
#   e2e128 / e2e256   synth --preset minicpm-sala-9b, then quantize with 128 (256) x 2048
#           calibration tokens on the GPU: report with per-stage times and GPU memory
#   writecmp / packcmp   side by side on the 9.5B: quantize (write stage) and pack-marlin with
#           this build (--no-mse, the old default quantizer) and with .gpu/soar-old.xz (a build
#           of the commit before the parallel writer), outputs compared byte for byte through
#           their manifests
#   gptaq   the shipped model with --method gptaq --mse --refit on the GPU and the CPU: codes
#           compared, both scored against the source on the GPU
#   e2eq    the 9.5B at 128 x 2048: the default (MSE search; vanilla GPTQ is writecmp's run),
#           --method gptaq and --refit, one after the other: their stage tables side by side
#   jit     the first-use tax: the shipped model quantized on the GPU with the JIT cache off
#           (CUDA_CACHE_DISABLE=1, so every run pays what a fresh machine pays), twice each with
#           this build (fatbins: SASS, no JIT) and with .gpu/soar-ptx.xz (a build that embeds PTX)
#   glacmp  the chunk-parallel Simple-GLA against .gpu/soar-old.xz (a build with the chunk-by-chunk
#           loop): the shipped model quantized on the GPU by both (codes compared, both scored),
#           then the 9.5B at 128 x 2048 by both, one after the other: their stage tables
#   basecmp this build against .gpu/soar-base.xz (the previous commit's build): the shipped model
#           on the GPU by both and on the CPU (codes compared, scored), two GPU runs and a
#           stopped-and-resumed GPU run compared byte for byte, then the 9.5B at 128 x 2048 by
#           both, one after the other: their stage tables
#   marlincmp  pack-marlin of the 9.5B output by .gpu/soar-base.xz and by this build,
#           alternating, twice each; outputs compared
#   serve   the 9.5B output for SGLang: inspect --engine for each engine, pack-marlin and its
#           legacy-marlin check; config, model card and verdicts come back
# Logs and reports go to $OUT (default /tmp/gpu-bench).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
G=/tmp/soar-bin
mkdir -p "$G"
# Unpacks F.xz into $G/F once (kept between calls while the machine stays warm).
unpack() {
  local b
  b=$(basename "$1" .xz)
  [ -x "$G/$b" ] || { xz -dc "$1" > "$G/$b" && chmod +x "$G/$b"; }
}
for f in .gpu/*.xz; do unpack "$f"; done
SG=$G/soar-gptq
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
# Wall seconds of a command, on stderr (no /usr/bin/time on every image).
timed() {
  local t0=$EPOCHREALTIME
  "$@"
  local rc=$?
  awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "wall %.1f s\n", b - a }' >&2
  return $rc
}
# Whether two outputs hold the same bytes in their shards and config (by their manifests; the
# reports and cards carry timings and build ids).
same_files() {
  python3 - "$1" "$2" "$3" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
a, b, what = sys.argv[1:4]
ma, mb = (json.load(open(d + "/manifest.json"))["files"] for d in (a, b))
keys = [k for k in ma if k.endswith(".safetensors") or k in ("config.json", "model.safetensors.index.json")]
diff = [k for k in keys if ma.get(k) != mb.get(k)]
print(f"{what}: {len(keys) - len(diff)} of {len(keys)} shard/config/index files identical" + (f"; differ: {diff}" if diff else ""))
PY
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader >> "$OUT/summary.txt" 2>&1

for stage in "$@"; do
  case "$stage" in
  jit)
    log "jit"
    for bin in soar-gptq soar-ptx soar-gptq soar-ptx; do
      [ -x "$G/$bin" ] || { echo "no $bin" | tee -a "$OUT/summary.txt"; continue; }
      rm -rf /tmp/jit-$bin
      echo -n "$bin, JIT cache off: " | tee -a "$OUT/summary.txt"
      CUDA_CACHE_DISABLE=1 timed "$G/$bin" quantize --model examples/tiny-sala --out /tmp/jit-$bin \
        --device cuda > /dev/null 2> /tmp/jit-$bin.err
      tail -1 /tmp/jit-$bin.err | tee -a "$OUT/summary.txt"
    done
    same_files /tmp/jit-soar-gptq /tmp/jit-soar-ptx "fatbin vs PTX build, shipped model"
    ;;
  glacmp)
    log "glacmp"
    S=/tmp/glacmp
    rm -rf $S; mkdir -p $S
    for bin in soar-old soar-gptq; do
      "$G/$bin" quantize --model examples/tiny-sala --out $S/tiny-$bin --device cuda > /dev/null 2> $S/tiny-$bin.err
      echo "tiny $bin rc $?" | tee -a "$OUT/summary.txt"
    done
    python3 examples/bench/compare_codes.py $S/tiny-soar-old $S/tiny-soar-gptq | tee -a "$OUT/summary.txt"
    "$SG" eval-ppl --model examples/tiny-sala --compare $S/tiny-soar-old --compare $S/tiny-soar-gptq \
      --data default --seqlen 256 --max-windows 64 --device cuda 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    for bin in soar-old soar-gptq; do
      rm -rf /tmp/qg /tmp/qg.partial
      timed "$G/$bin" quantize --model $B --out /tmp/qg --device cuda > /tmp/qg.txt 2> /tmp/qg.err
      echo "9.5B $bin rc $?" | tee -a "$OUT/summary.txt"
      grep -E "preflight|wall" /tmp/qg.err | tee -a "$OUT/summary.txt"
      grep -E "^stages|GPU memory" /tmp/qg.txt | tee -a "$OUT/summary.txt"
    done
    rm -rf /tmp/qg
    ;;
  basecmp)
    # This build against .gpu/soar-base.xz (the previous commit's build), as glacmp; and a
    # resumed GPU run against an uninterrupted one (the layers it replays are decoded from the
    # journal, the others from the solve's codes).
    log "basecmp"
    S=/tmp/basecmp
    rm -rf $S; mkdir -p $S
    for bin in soar-base soar-gptq; do
      "$G/$bin" quantize --model examples/tiny-sala --out $S/tiny-$bin --device cuda > /dev/null 2> $S/tiny-$bin.err
      echo "tiny $bin rc $?" | tee -a "$OUT/summary.txt"
    done
    python3 examples/bench/compare_codes.py $S/tiny-soar-base $S/tiny-soar-gptq | tee -a "$OUT/summary.txt"
    "$SG" quantize --model examples/tiny-sala --out $S/tiny-cpu --device cpu > /dev/null 2> $S/tiny-cpu.err
    python3 examples/bench/compare_codes.py $S/tiny-cpu $S/tiny-soar-gptq | tee -a "$OUT/summary.txt"
    "$SG" quantize --model examples/tiny-sala --out $S/tiny-gpu2 --device cuda > /dev/null 2>&1
    same_files $S/tiny-soar-gptq $S/tiny-gpu2 "two GPU runs, shipped model"
    "$SG" quantize --model examples/tiny-sala --out $S/tiny-res --device cuda --stop-after-layers 2 > /dev/null 2>&1
    "$SG" quantize --model examples/tiny-sala --out $S/tiny-res --device cuda --resume > /dev/null 2> $S/tiny-res.err
    echo "resume rc $?" | tee -a "$OUT/summary.txt"
    same_files $S/tiny-soar-gptq $S/tiny-res "GPU: stopped after 2 layers and resumed vs uninterrupted"
    "$SG" eval-ppl --model examples/tiny-sala --compare $S/tiny-soar-base --compare $S/tiny-soar-gptq \
      --compare $S/tiny-cpu --data default --seqlen 256 --max-windows 64 --device cuda 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    # BASE9B=0: the 9.5B with this build only (the previous build's figures taken earlier).
    bins="soar-base soar-gptq"
    [ "${BASE9B:-1}" = 0 ] && bins=soar-gptq
    for bin in $bins; do
      rm -rf /tmp/qg /tmp/qg.partial
      timed "$G/$bin" quantize --model $B --out /tmp/qg --device cuda > /tmp/qg.txt 2> /tmp/qg.err
      echo "9.5B $bin rc $?" | tee -a "$OUT/summary.txt"
      grep -E "preflight|wall" /tmp/qg.err | tee -a "$OUT/summary.txt"
      grep -E "^stages|GPU memory" /tmp/qg.txt | tee -a "$OUT/summary.txt"
      grep -E "down_proj" /tmp/qg.err | tail -1 | tee -a "$OUT/summary.txt"
    done
    rm -rf /tmp/qg
    ;;
  twins)
    # Every GPU kernel against its CPU twin (tests/cuda: the GPTQ kernels, Simple-GLA, InfLLM-v2).
    log "twins"
    # shellcheck disable=SC2086
    timeout "${TWINS_TIMEOUT:-420}" "$G/cuda" --nocapture --test-threads=1 ${TWINS_ARGS:-} > /tmp/twins.log 2>&1
    echo "rc $?" >> /tmp/twins.log
    cp /tmp/twins.log "$OUT/twins.log"
    grep -E "^test |test result|GPU vs CPU|differ|damp used|rc |panicked|assert|ms|TFLOP|GB/s" /tmp/twins.log | tee -a "$OUT/summary.txt"
    ;;
  cmp128)
    # The 9.5B at 128 x 2048 (all defaults) with .gpu/soar-base.xz and this build, one after
    # the other: their stage tables.
    log "cmp128"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    for bin in soar-base soar-gptq; do
      rm -rf /tmp/qg /tmp/qg.partial
      timed "$G/$bin" quantize --model $B --out /tmp/qg --device cuda > /tmp/qg.txt 2> /tmp/qg.err
      echo "9.5B 128x2048 $bin rc $?" | tee -a "$OUT/summary.txt"
      grep -E "preflight|activations|wall" /tmp/qg.err | tee -a "$OUT/summary.txt"
      grep -E "^stages|GPU memory|peak memory" /tmp/qg.txt | tee -a "$OUT/summary.txt"
    done
    rm -rf /tmp/qg
    ;;
  sparse)
    # The small sparse model (InfLLM-v2 from 512 tokens) on the GPU against the CPU: the GPU's
    # InfLLM-v2 and Simple-GLA kernels end to end, scored against the source on the GPU.
    log "sparse"
    S=/tmp/sparse; rm -rf $S; mkdir -p $S
    "$SG" synth --preset tiny-sparse --out $S/ts > /dev/null 2>&1
    for dev in cuda cpu; do
      timed "$SG" quantize --model $S/ts --out $S/q-$dev --nsamples 8 --seqlen 600..3000 \
        --engine none --device $dev > /dev/null 2> $S/q-$dev.err
      echo "tiny-sparse $dev rc $?" | tee -a "$OUT/summary.txt"
      grep wall $S/q-$dev.err | tee -a "$OUT/summary.txt"
    done
    python3 examples/bench/compare_codes.py $S/q-cpu $S/q-cuda | tee -a "$OUT/summary.txt"
    "$SG" eval-ppl --model $S/ts --compare $S/q-cuda --compare $S/q-cpu --seqlen 3000 \
      --max-windows 4 --batch 1 --device cuda 2>&1 | tail -8 | tee -a "$OUT/summary.txt"
    ;;
  ptx)
    # The PTX path forced on this GPU (CUDA_FORCE_PTX_JIT=1) against the SASS: same codes.
    # Uses the all-architecture build (.gpuall/soar-allarch.xz, which embeds PTX) when carried;
    # a CUDA_COMPUTE_CAP=90 build has SASS only and cannot run with the PTX path forced.
    log "ptx"
    PB=$SG
    if [ -f .gpuall/soar-allarch.xz ]; then
      unpack .gpuall/soar-allarch.xz
      PB=$G/soar-allarch
    fi
    echo "binary: $PB ($("$PB" --version 2>&1 | head -1))" | tee -a "$OUT/summary.txt"
    CO=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    for what in elf ptx; do
      echo -n "$what: " | tee -a "$OUT/summary.txt"
      "$CO" --list-$what "$PB" 2>/dev/null | grep -oE "sm_[0-9]+a?" | sort | uniq -c | tr '\n' ' ' | tee -a "$OUT/summary.txt"
      echo | tee -a "$OUT/summary.txt"
    done
    S=/tmp/ptx; rm -rf $S; mkdir -p $S
    timed "$PB" quantize --model examples/tiny-sala --out $S/sass --device cuda > /dev/null 2> $S/sass.err
    echo "SASS rc $?" | tee -a "$OUT/summary.txt"
    grep wall $S/sass.err | tee -a "$OUT/summary.txt"
    CUDA_FORCE_PTX_JIT=1 CUDA_CACHE_DISABLE=1 timed "$PB" quantize --model examples/tiny-sala \
      --out $S/ptx --device cuda > /dev/null 2> $S/ptx.err
    echo "forced PTX rc $?" | tee -a "$OUT/summary.txt"
    grep -v "^ *[0-9]*: \|^ *at " $S/ptx.err | tail -6 | tee -a "$OUT/summary.txt"
    same_files $S/sass $S/ptx "SASS vs forced PTX JIT, shipped model"
    ;;
  sm80)
    # The PTX path on this GPU without forcing it: a build with CUDA_COMPUTE_CAP=80 only
    # (.gpuall/soar-sm80.xz: sm_80 SASS, which a Hopper cannot load, and compute_80 PTX, which
    # the driver JIT-compiles) against this build's SASS, on the shipped model: files compared.
    log "sm80"
    [ -f .gpuall/soar-sm80.xz ] || { echo "no .gpuall/soar-sm80.xz" | tee -a "$OUT/summary.txt"; continue; }
    unpack .gpuall/soar-sm80.xz
    S=/tmp/sm80; rm -rf $S; mkdir -p $S
    for bin in soar-gptq soar-sm80; do
      rm -rf $S/$bin
      echo -n "$bin (JIT cache off): " | tee -a "$OUT/summary.txt"
      CUDA_CACHE_DISABLE=1 timed "$G/$bin" quantize --model examples/tiny-sala --out $S/$bin --device cuda \
        > /dev/null 2> $S/$bin.err
      echo "rc $? $(grep -E '^error' $S/$bin.err | head -1)" | tee -a "$OUT/summary.txt"
      grep wall $S/$bin.err | tee -a "$OUT/summary.txt"
    done
    same_files $S/soar-gptq $S/soar-sm80 "sm_90a SASS vs compute_80 PTX (JIT), shipped model"
    python3 examples/bench/compare_codes.py $S/soar-gptq $S/soar-sm80 | tee -a "$OUT/summary.txt"
    ;;
  p9b)
    # The 9.5B at 128 x 2048: the default (f64 factorization, no memory cap), then
    # --factor-precision f32 (codes compared), then --max-gpu-memory 24 and 16 (bytes compared);
    # P9B_ONLY: a subset of "def f32 m24 m16".
    log "p9b"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    for v in "def:" "f32:--factor-precision f32" "m24:--max-gpu-memory 24" "m16:--max-gpu-memory 16"; do
      name=${v%%:*}; flags=${v#*:}
      [ "$name" = m16 ] && [ "${P9B_M16:-1}" = 0 ] && continue
      case " ${P9B_ONLY:-def f32 m24 m16} " in *" $name "*) ;; *) continue ;; esac
      rm -rf /tmp/p-$name /tmp/p-$name.partial
      # shellcheck disable=SC2086
      timed "$SG" quantize --model $B --out /tmp/p-$name --device cuda $flags > /tmp/p-$name.txt 2> /tmp/p-$name.err
      echo "9.5B 128x2048 $name ($flags) rc $?" | tee -a "$OUT/summary.txt"
      grep -E "activations|wall|error" /tmp/p-$name.err | tee -a "$OUT/summary.txt"
      grep -E "^stages|GPU memory|peak memory" /tmp/p-$name.txt | tee -a "$OUT/summary.txt"
      case $name in
        f32) python3 examples/bench/compare_codes.py /tmp/p-def /tmp/p-f32 | tee -a "$OUT/summary.txt"; rm -rf /tmp/p-f32 ;;
        m24|m16) same_files /tmp/p-def /tmp/p-$name "default vs $flags"; rm -rf /tmp/p-$name ;;
      esac
    done
    rm -rf /tmp/p-def
    ;;
  long)
    # The 9.5B at LONG_N windows of LONG_LEN tokens (a length or MIN..MAX), default 16 x 49152,
    # with LONG_FLAGS: the report's stages, GPU and host memory.
    N=${LONG_N:-16}; L=${LONG_LEN:-49152}
    log "long $N x $L ${LONG_FLAGS:-}"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    rm -rf /tmp/ql /tmp/ql.partial
    # Cut at LONG_TIMEOUT s (default: none); a sampler notes every 10 s how many layers are
    # done (their down_proj lines), so a cut run still shows how far it got and at what pace.
    t0=$EPOCHREALTIME
    # shellcheck disable=SC2086
    timeout "${LONG_TIMEOUT:-0}" "$SG" quantize --model $B --out /tmp/ql --device cuda \
        --nsamples $N --seqlen $L ${LONG_FLAGS:-} --json > /tmp/ql.json 2> /tmp/ql.err &
    qpid=$!
    while kill -0 $qpid 2>/dev/null; do
      sleep 10
      awk -v a="$t0" -v b="$EPOCHREALTIME" -v n="$(grep -cE 'layers\.[0-9]+\.mlp\.down_proj' /tmp/ql.err)" \
        'BEGIN { printf "pace %.0f s: %d layers done\n", b - a, n }' >> /tmp/ql.pace
    done
    wait $qpid; echo "rc $?" >> /tmp/ql.err
    awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "wall %.1f s\n", b - a }' >> /tmp/ql.err
    cat /tmp/ql.pace >> /tmp/ql.err; rm -f /tmp/ql.pace
    grep -E "preflight|activations|wall|error|rc [0-9]" /tmp/ql.err | tee -a "$OUT/summary.txt"
    grep -E "layers\.[0-9]+\.mlp\.down_proj" /tmp/ql.err | tee -a "$OUT/summary.txt"
    cp /tmp/ql.err "$OUT/long-$N-${L//./_}.err"
    python3 - /tmp/ql.json <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no report: {e}")
st = r.get("stages") or {}
print("stages (s):", {k: round(v, 2) for k, v in st.items() if isinstance(v, float)})
print("total", round(r["total_seconds"], 1), "s; peak host", (r.get("peak_rss_bytes") or 0) / 1e9, "GB; gpu",
      {k: round(v / 1e9, 1) for k, v in (r.get("gpu_memory") or {}).items()})
PY
    [ "${KEEP_LONG:-0}" = 1 ] || rm -rf /tmp/ql
    ;;
  hostcache)
    N=${HC_N:-16}; L=${HC_LEN:-49152}; CAP=${HC_CAP:-17.7}
    log "hostcache $N x $L, cap $CAP GB"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    for how in device host recompute; do
      case $how in
        device) a="" ;;
        host) a="--max-gpu-memory $CAP" ;;
        recompute) a="--max-gpu-memory $CAP --max-host-memory 4" ;;
      esac
      rm -rf /tmp/hc-$how /tmp/hc-$how.partial
      # shellcheck disable=SC2086
      timed "$SG" quantize --model $B --out /tmp/hc-$how --device cuda --nsamples $N --seqlen $L \
        $a > /tmp/hc-$how.txt 2> /tmp/hc-$how.err
      echo "$how: rc $?" | tee -a "$OUT/summary.txt"
      grep -E "activations|wall|error" /tmp/hc-$how.err | tee -a "$OUT/summary.txt"
      grep -E "^stages|GPU memory" /tmp/hc-$how.txt | tee -a "$OUT/summary.txt"
      cp /tmp/hc-$how.err "$OUT/hostcache-$how.err"
    done
    same_files /tmp/hc-device /tmp/hc-host "host-memory mixer cache against all on the GPU"
    same_files /tmp/hc-device /tmp/hc-recompute "recomputed mixers against all on the GPU"
    rm -rf /tmp/hc-device /tmp/hc-host /tmp/hc-recompute
    ;;
  evallong)
    # eval-ppl of the 9.5B and the long-calibrated output at EVAL_LEN tokens (default 32768),
    # with the position ranges and the KL plot.
    log "evallong ${EVAL_LEN:-32768}"
    timed "$SG" eval-ppl --model /tmp/sala9b --compare /tmp/ql --seqlen "${EVAL_LEN:-32768}" \
      --max-windows "${EVAL_WINDOWS:-2}" --batch 1 --device cuda --plot "$OUT/kl.svg" \
      > /tmp/ev.txt 2> /tmp/ev.err
    echo "rc $?" | tee -a "$OUT/summary.txt"
    cat /tmp/ev.txt | tee -a "$OUT/summary.txt"
    grep -E "wall|error" /tmp/ev.err | tee -a "$OUT/summary.txt"
    ;;
  solver)
    log "solver"
    "$G/bench_solver" --devices cuda --repeat 5 --save /tmp/wh --hessian-tokens 65536 \
      2>&1 | tee -a "$OUT/summary.txt"
    "$G/bench_solver" --devices cpu --repeat 1 2>&1 | tee -a "$OUT/summary.txt"
    python3 examples/bench/gptq_eager.py /tmp/wh --device cuda --warmup 1 --repeat 3 \
      2>&1 | tee -a "$OUT/summary.txt"
    ;;
  trace)
    # Phase times of one GPU solve per shape (synchronizing: slower than the medians above).
    log "trace"
    SOAR_GPTQ_TRACE=1 "$G/bench_solver" --devices cuda --repeat 2 2>&1 | tee -a "$OUT/summary.txt"
    SOAR_GPTQ_TRACE=2 "$G/bench_solver" --devices cuda --repeat 2 2>&1 | grep "of which" \
      | tee -a "$OUT/summary.txt"
    ;;
  small)
    log "small"
    M=examples/tiny-sala
    S=/tmp/small
    rm -rf $S; mkdir -p $S
    CAL="--nsamples 32 --seqlen 512"
    timed "$SG" quantize --model $M --out $S/gpu $CAL --device cuda > $S/gpu.txt 2> $S/gpu.err
    "$SG" quantize --model $M --out $S/gpu2 $CAL --device cuda > /dev/null 2>&1
    "$SG" quantize --model $M --out $S/cpu $CAL --device cpu > $S/cpu.txt 2>&1
    "$SG" quantize --model $M --out $S/gpu-f32 $CAL --device cuda --dtype f32 > /dev/null 2>&1
    tail -4 $S/gpu.txt | tee -a "$OUT/summary.txt"
    grep -E "wall|preflight" $S/gpu.err | tee -a "$OUT/summary.txt"
    if cmp -s $S/gpu/manifest.json $S/gpu2/manifest.json; then
      echo "two GPU runs: identical manifests" | tee -a "$OUT/summary.txt"
    else
      echo "two GPU runs: DIFFERENT manifests" | tee -a "$OUT/summary.txt"
    fi
    echo "codes, GPU bf16 forward vs CPU f32:" | tee -a "$OUT/summary.txt"
    python3 examples/bench/compare_codes.py $S/gpu $S/cpu | tee -a "$OUT/summary.txt"
    echo "codes, GPU f32 forward vs CPU f32:" | tee -a "$OUT/summary.txt"
    python3 examples/bench/compare_codes.py $S/gpu-f32 $S/cpu | tee -a "$OUT/summary.txt"
    "$SG" pack-marlin --in $S/gpu --out $S/gpu-marlin > /dev/null
    "$SG" eval-ppl --model $M --compare $S/gpu --compare $S/gpu-marlin --compare $S/cpu --compare $S/gpu-f32 \
      --data default --seqlen 256 --max-windows 16 --device cuda 2>&1 | tee -a "$OUT/summary.txt"
    "$SG" eval-ppl --model $M --compare $S/gpu --compare $S/cpu --compare $S/gpu-f32 \
      --data default --seqlen 256 --max-windows 16 --device cpu 2>&1 | tee -a "$OUT/summary.txt"
    cp $S/gpu/quantize_report.json "$OUT/small_gpu_report.json"
    ;;
  train)
    # Retrains the fixture on the GPU (examples/train_tiny_sala.rs) within a time budget; the
    # model comes back as $OUT/fixture.tar and later stages of this call use it.
    log "train"
    rm -rf /tmp/tiny-new
    timed "$G/train_tiny_sala" --out /tmp/tiny-new --device cuda --workers 1 \
      --steps ${TRAIN_STEPS:-6000} --batch ${TRAIN_BATCH:-32} --seqlen 256 --lr 3e-3 --warmup 100 \
      --seed 0 --eval-every 100 --eval-windows 48 --time-budget-secs ${TRAIN_SECS:-240} \
      --log-every 100 > /tmp/train.log 2>&1
    echo "rc $?" >> /tmp/train.log
    tail -25 /tmp/train.log | tee -a "$OUT/summary.txt"
    cp /tmp/train.log "$OUT/train.log"
    [ -f /tmp/tiny-new/config.json ] && tar -C /tmp -cf "$OUT/fixture.tar" tiny-new && QMODEL=/tmp/tiny-new
    ;;
  quality)
    # The quality table of docs/benchmarks.md on the fixture ($QMODEL, default the shipped one):
    # f32 forward and f32 eval (the CPU protocol), default calibration (128 x 2048) and the
    # model's own training text.
    log "quality"
    M=${QMODEL:-examples/tiny-sala}
    [ -d $M/corpus ] || { mkdir -p $M/corpus; cp examples/tiny-sala/corpus/* $M/corpus/; }
    Q=/tmp/quality
    rm -rf $Q; mkdir -p $Q
    for calib in default corpus; do
      if [ $calib = corpus ]; then C="--calib $M/corpus/sotu-1790-1999.txt"; else C=""; fi
      for bits in 4 3; do
        for v in rtn static dynamic skip; do
          case $v in
            rtn) a="--method rtn" ;;
            static) a="" ;;
            dynamic) a="--act-order dynamic" ;;
            skip) a="--skip o_gate --skip z_proj" ;;
          esac
          # Quality comparisons, not serving: no engine check (3-bit SALA is not servable in BF16).
          "$SG" quantize --model $M --out $Q/$calib-$bits-$v --bits $bits $a $C --device cuda --dtype f32 --engine none > /dev/null 2> $Q/err || { echo "FAIL $calib $bits $v"; cat $Q/err; }
        done
      done
    done
    for calib in default corpus; do
      for bits in 4 3; do
        echo "-- calibration $calib, $bits bits" | tee -a "$OUT/summary.txt"
        "$SG" eval-ppl --model $M --compare $Q/$calib-$bits-rtn --compare $Q/$calib-$bits-static \
          --compare $Q/$calib-$bits-dynamic --compare $Q/$calib-$bits-skip \
          --data default --seqlen 512 --device cuda --dtype f32 2>&1 | tee -a "$OUT/summary.txt"
      done
    done
    ;;
  e2e128 | e2e256)
    n=${stage#e2e}
    log "$stage"
    B=/tmp/sala9b
    if [ ! -f $B/config.json ]; then
      timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
      # The first quantize reads the shards through the page cache either way.
    fi
    rm -rf /tmp/q$n /tmp/q$n.partial
    timed "$SG" quantize --model $B --out /tmp/q$n \
      --nsamples $n --seqlen 2048 --device cuda > /tmp/e2e$n.txt 2> /tmp/e2e$n.err
    echo "rc $?" >> /tmp/e2e$n.err
    grep -E "preflight|rc " /tmp/e2e$n.err | tee -a "$OUT/summary.txt"
    tail -3 /tmp/e2e$n.err | tee -a "$OUT/summary.txt"
    tail -6 /tmp/e2e$n.txt | tee -a "$OUT/summary.txt"
    [ -f /tmp/q$n/quantize_report.json ] && python3 -c "
import json,sys
r=json.load(open('/tmp/q$n/quantize_report.json'))
r['modules']=r['modules'][:8]
json.dump(r,open('$OUT/e2e${n}_report.json','w'),indent=1)
"
    rm -rf /tmp/q$n
    ;;
  writecmp)
    log "writecmp"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    for bin in soar-gptq soar-old; do
      rm -rf /tmp/wq-$bin /tmp/wq-$bin.partial
      # The old build's default quantizer: plain min/max (the MSE search is the default now).
      flags=""; [ $bin = soar-gptq ] && flags="--no-mse"
      timed "$G/$bin" quantize --model $B --out /tmp/wq-$bin $flags --device cuda > /tmp/wq-$bin.txt 2> /tmp/wq-$bin.err
      echo "$bin quantize rc $?" | tee -a "$OUT/summary.txt"
      grep -E "wall" /tmp/wq-$bin.err | tee -a "$OUT/summary.txt"
      grep -E "^stages" /tmp/wq-$bin.txt | tee -a "$OUT/summary.txt"
    done
    same_files /tmp/wq-soar-gptq /tmp/wq-soar-old "quantize"
    rm -rf /tmp/wq-soar-old
    ;;
  packcmp)
    log "packcmp"
    for bin in soar-old soar-gptq; do
      rm -rf /tmp/wm-$bin
      timed "$G/$bin" pack-marlin --in /tmp/wq-soar-gptq --out /tmp/wm-$bin > /tmp/wm-$bin.txt 2>&1
      echo "$bin pack-marlin rc $?" | tee -a "$OUT/summary.txt"
      grep -E "^time|wall" /tmp/wm-$bin.txt | tee -a "$OUT/summary.txt"
    done
    same_files /tmp/wm-soar-gptq /tmp/wm-soar-old "pack-marlin"
    rm -rf /tmp/wm-soar-old /tmp/wm-soar-gptq
    ;;
  marlincmp)
    # pack-marlin of the 9.5B output by .gpu/soar-base.xz and by this build, alternating, twice
    # each; outputs compared through their manifests.
    log "marlincmp"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    rm -rf /tmp/wq /tmp/wq.partial
    timed "$SG" quantize --model $B --out /tmp/wq --device cuda > /dev/null 2> /tmp/wq.err
    grep wall /tmp/wq.err | tee -a "$OUT/summary.txt"
    for bin in soar-base soar-gptq soar-base soar-gptq; do
      rm -rf /tmp/wm-$bin
      timed "$G/$bin" pack-marlin --in /tmp/wq --out /tmp/wm-$bin > /tmp/wm-$bin.txt 2>&1
      echo "$bin pack-marlin rc $?" | tee -a "$OUT/summary.txt"
      grep -E "^time|wall" /tmp/wm-$bin.txt | tee -a "$OUT/summary.txt"
    done
    same_files /tmp/wm-soar-gptq /tmp/wm-soar-base "pack-marlin, previous build vs this one"
    rm -rf /tmp/wm-soar-base /tmp/wm-soar-gptq /tmp/wq
    ;;
  gptaq)
    log "gptaq"
    M=examples/tiny-sala
    S=/tmp/gq
    rm -rf $S; mkdir -p $S
    CAL="--nsamples 32 --seqlen 512 --method gptaq --refit --engine none"
    timed "$SG" quantize --model $M --out $S/gpu $CAL --device cuda > $S/gpu.txt 2> $S/gpu.err
    echo "gpu rc $?" | tee -a "$OUT/summary.txt"
    "$SG" quantize --model $M --out $S/cpu $CAL --device cpu > $S/cpu.txt 2>&1
    echo "cpu rc $?" | tee -a "$OUT/summary.txt"
    grep -E "stages" $S/gpu.txt | tee -a "$OUT/summary.txt"
    python3 examples/bench/compare_codes.py $S/gpu $S/cpu | tee -a "$OUT/summary.txt"
    "$SG" eval-ppl --model $M --compare $S/gpu --compare $S/cpu \
      --data default --seqlen 256 --max-windows 64 --device cuda 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
    ;;
  e2eq)
    log "e2eq"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    for v in "" "--method gptaq" "--refit"; do
      rm -rf /tmp/qq /tmp/qq.partial
      timed "$SG" quantize --model $B --out /tmp/qq $v --device cuda > /tmp/qq.txt 2> /tmp/qq.err
      echo "$v rc $?" | tee -a "$OUT/summary.txt"
      grep -E "preflight|wall" /tmp/qq.err | tee -a "$OUT/summary.txt"
      grep -E "^stages|GPU memory" /tmp/qq.txt | tee -a "$OUT/summary.txt"
    done
    rm -rf /tmp/qq
    ;;
  serve)
    # The serving-ready output on the full model: quantize for SGLang (default settings), the
    # SGLang load emulated on it, pack-marlin with its legacy-marlin check; config, card and the
    # engine verdicts come back.
    log "serve"
    B=/tmp/sala9b
    [ -f $B/config.json ] || timed "$SG" synth --preset minicpm-sala-9b --out $B 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
    rm -rf /tmp/qs /tmp/qs.partial /tmp/qm
    timed "$SG" quantize --model $B --out /tmp/qs --device cuda > /tmp/serve.txt 2> /tmp/serve.err
    echo "rc $?" | tee -a "$OUT/summary.txt"
    grep -E "preflight|rc |wall" /tmp/serve.err | tee -a "$OUT/summary.txt"
    tail -4 /tmp/serve.txt | tee -a "$OUT/summary.txt"
    "$SG" inspect /tmp/qs --engine sglang > $OUT/serve_inspect.txt 2>&1; echo "inspect --engine sglang rc $?" | tee -a "$OUT/summary.txt"
    "$SG" inspect /tmp/qs --engine sglang --json > $OUT/serve_inspect.json 2> /dev/null
    for e in vllm transformers; do
      "$SG" inspect /tmp/qs --engine $e > /dev/null 2> $OUT/serve_$e.err; echo "inspect --engine $e rc $?" | tee -a "$OUT/summary.txt"
    done
    cp /tmp/qs/config.json $OUT/serve_config.json; cp /tmp/qs/README.md $OUT/serve_card.md
    cp /tmp/qs/manifest.json $OUT/serve_manifest.json
    timed "$SG" pack-marlin --in /tmp/qs --out /tmp/qm > $OUT/serve_marlin.txt 2>&1; echo "pack-marlin rc $?" | tee -a "$OUT/summary.txt"
    grep wall $OUT/serve_marlin.txt | tee -a "$OUT/summary.txt"
    "$SG" inspect /tmp/qm --engine sglang --legacy-marlin > /dev/null 2>&1; echo "inspect marlin --legacy-marlin rc $?" | tee -a "$OUT/summary.txt"
    "$SG" inspect /tmp/qm --engine sglang > /dev/null 2> $OUT/serve_marlin_current.err; echo "inspect marlin (current releases) rc $?" | tee -a "$OUT/summary.txt"
    rm -rf /tmp/qs /tmp/qm
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
  esac
done
log "done"
