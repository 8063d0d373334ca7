#!/usr/bin/env bash
# CI artifacts job: regenerates the artifacts from scratch on the repo's small model and prints
# them: a GPTQ checkpoint, its Marlin repack, an RTN baseline, a sensitivity plan and the
# mixed-precision checkpoint it gives, a long-context checkpoint of the small sparse model, what
# inspect says of them, and one comparison table. It fails only when a command fails; what the
# artifacts must satisfy is checked by the tests (determinism and resume: tests/integration
# quantize, safety and long_context; the quality gate: quality_gate; the engines: engines).
set -euo pipefail
cd "$(dirname "$0")/.."
# The binary: $BIN when given (.ci/run passes the one `cargo test` built), else a dev build.
# (`cargo build` alone resolves dependency features without the dev-dependencies and so builds
# candle and tokenizers a second time: on the CI machine that is minutes.)
if [ -z "${BIN:-}" ]; then
  cargo build --locked --quiet
  BIN=${CARGO_TARGET_DIR:-target}/debug/soar-gptq
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
MODEL=examples/tiny-sala
# Calibrate on the fixture's own training text (1790-1999; the evaluation is 2000-2021).
CAL="--nsamples ${NSAMPLES:-32} --seqlen ${SEQLEN:-512} --calib examples/tiny-sala/corpus/sotu-1790-1999.txt"
step() { echo "== $*" >&2; }

step "quantize GPTQ, RTN, pack-marlin"
"$BIN" quantize --model "$MODEL" --out "$WORK/gptq" $CAL > "$WORK/gptq.txt"
tail -3 "$WORK/gptq.txt"
"$BIN" quantize --model "$MODEL" --out "$WORK/rtn" --method rtn --no-mse $CAL > /dev/null
"$BIN" pack-marlin --in "$WORK/gptq" --out "$WORK/marlin" > /dev/null
step "inspect (and the SGLang load, emulated)"
"$BIN" inspect "$WORK/gptq" | tail -6
"$BIN" inspect "$WORK/gptq" --engine sglang | tail -3
"$BIN" inspect "$WORK/marlin" --engine sglang --legacy-marlin | tail -3
step "sensitivity (on calibration text) and its 10% plan, quantized with --plan"
"$BIN" sensitivity --model "$MODEL" --quantized "$WORK/gptq" \
  --data examples/tiny-sala/corpus/sotu-1790-1999.txt --seqlen 256 --max-windows 16 \
  --budget-pct 10 --plan-out "$WORK/plan.json" | tail -6
"$BIN" quantize --model "$MODEL" --out "$WORK/mixed" $CAL --plan "$WORK/plan.json" > /dev/null
step "long context: the small sparse model calibrated on 1024..2048-token windows (InfLLM-v2)"
"$BIN" synth --preset tiny-sparse --out "$WORK/ts" > /dev/null 2>&1
"$BIN" quantize --model "$WORK/ts" --out "$WORK/ts-gptq" --nsamples 4 --seqlen 1024..2048 \
  --engine none > /dev/null
"$BIN" eval-ppl --model "$WORK/ts" --compare "$WORK/ts-gptq" --seqlen 2560 --max-windows 2 \
  --batch 1 --plot "$WORK/kl.svg"
step "eval-ppl comparison"
"$BIN" eval-ppl --model "$MODEL" --compare "$WORK/gptq" --compare "$WORK/marlin" \
  --compare "$WORK/rtn" --compare "$WORK/mixed" --data default --seqlen 256 --max-windows 64
echo "artifacts: ok" >&2
