#!/usr/bin/env bash
# Runs tessel-convert over impossible arguments and models: each must end with a message on stderr
# and exit status 1 or 2 (no crash, no hang, no silent success). Then the committed tiny models must
# import, optimize, plan and run (random inputs, and .npy inputs written back out as .npy).
# Usage: tests/tools/tessel_convert_args.sh path/to/tessel-convert path/to/source
set -u
bin=$1
src=$2
models=$src/tests/graph/onnx
fails=0
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
bad() {
  local err rc
  err=$(timeout 60 "$bin" "$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 1 && $rc -ne 2 ]] || [[ -z $err ]]; then
    echo "FAIL: tessel-convert $* -> exit $rc, stderr '${err:0:200}'"; fails=$((fails + 1))
  else
    echo "ok:   tessel-convert $* -> exit $rc: ${err%%$'\n'*}"
  fi
}
good() {
  local out rc
  out=$(timeout 300 "$bin" "$@" 2>&1); rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "FAIL: tessel-convert $* -> exit $rc: ${out:0:400}"; fails=$((fails + 1))
  else
    echo "ok:   tessel-convert $*"
  fi
  last_out=$out
}
printf 'not a model' > "$scratch/junk.onnx"
head -c 300 "$models/gpt2_tiny_op17.onnx" > "$scratch/cut.onnx"
bad
bad --frobnicate
bad "$models/gpt2_tiny_op17.onnx" "$models/gpt2_tiny_op14.onnx"
bad "$models/gpt2_tiny_op17.onnx" --dtype f8
bad "$models/gpt2_tiny_op17.onnx" --device gpu
bad "$models/gpt2_tiny_op17.onnx" --threads 0
bad "$models/gpt2_tiny_op17.onnx" --bind batch
bad "$models/gpt2_tiny_op17.onnx" --bind batch=-1
bad "$models/gpt2_tiny_op17.onnx" --repeat
bad /nonexistent.onnx
bad "$scratch/junk.onnx"
bad "$scratch/cut.onnx"
bad "$models/gpt2_tiny_op17.onnx" --input nosuchinput=/nonexistent.npy
bad "$models/gpt2_tiny_op17.onnx" --input "$scratch/junk.onnx"

# Every committed model imports, optimizes and plans; the transformers run (the executor has no
# Resize kernel yet, which the U-Net needs).
for m in "$models"/*.onnx; do
  good "$m" --report --bind batch=2
done
for m in "$models"/gpt2_*.onnx "$models"/llama_*.onnx; do
  good "$m" --run --bind batch=2
done
good "$models/llama_tiny_op17.onnx" --run --device card --threads 1 --dtype bf16
# an output written as .npy and fed back as an input file must read
good "$models/gpt2_tiny_op17.onnx" --bind batch=1 --out "$scratch/out"
if ! ls "$scratch/out"/*.npy >/dev/null 2>&1; then echo "FAIL: --out wrote no .npy"; fails=$((fails + 1)); fi
if ! grep -q "fused pattern" <<<"$(timeout 300 "$bin" "$models/gpt2_tiny_op17.onnx" --report)"; then
  echo "FAIL: --report printed no pattern table"; fails=$((fails + 1))
fi
echo "$fails failure(s)"
exit $((fails > 0))
