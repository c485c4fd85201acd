#!/usr/bin/env bash
# Runs tessel-plan over impossible arguments and inputs: each must end with a message on stderr and
# exit status 1 or 2 (no crash, no hang, no silent success). Then a valid plan must exit 0 with a
# ranked table, and --json must be JSON with the plans.
# Usage: tests/tools/tessel_plan_args.sh path/to/tessel-plan path/to/source
set -u
bin=$1
src=$2
model=$src/configs/models/llama-3.1-8b.json
fails=0
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
bad() {
  local err rc
  err=$(timeout 60 "$bin" "$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 1 && $rc -ne 2 ]] || [[ -z $err ]]; then
    echo "FAIL: tessel-plan $* -> exit $rc, stderr '${err:0:200}'"; fails=$((fails + 1))
  else
    echo "ok:   tessel-plan $* -> exit $rc: ${err%%$'\n'*}"
  fi
}
printf 'cards = 0\n' > "$scratch/zero.conf"
printf 'cards = 8\nplanes = banana\n' > "$scratch/nan.conf"
printf '{"model_type": "llama", "hidden_size": -4}' > "$scratch/bad.json"
printf 'cards = 2\nmemory = 1Gi\n' > "$scratch/small.conf"
bad
bad --frobnicate
bad --model "$model"
bad --model "$model" --batch 8
bad --model "$model" --seq 512
bad --model "$model" --batch 0 --seq 512
bad --model "$model" --batch -3 --seq 512
bad --model "$model" --batch 8x --seq 512
bad --model "$model" --batch 8 --seq 512 --top 0
bad --model "$model" --batch 8 --seq 512 --zero 4
bad --model "$model" --batch 8 --seq 512 --schedule gpipe
bad --model "$model" --batch 8 --seq 512 --recompute sometimes
bad --model "$model" --batch 8 --seq 512 --memory-fraction 2
bad --model "$model" --batch 8 --seq 512 --cards 1000
bad --model /nonexistent.json --batch 8 --seq 512
bad --model "$scratch/bad.json" --batch 8 --seq 512
bad --model "$model" --cluster /nonexistent.conf --batch 8 --seq 512
bad --model "$model" --cluster "$scratch/zero.conf" --batch 8 --seq 512
bad --model "$model" --cluster "$scratch/nan.conf" --batch 8 --seq 512
bad --model "$model" --cluster "$scratch/small.conf" --batch 2 --seq 4096
out=$(timeout 60 "$bin" --model "$model" --cluster "$src/configs/clusters/ubl128.conf" --batch 256 --seq 4096 --top 5); rc=$?
if [[ $rc -ne 0 ]] || ! grep -q "^1 " <<<"$out" || ! grep -q "layouts considered" <<<"$out"; then
  echo "FAIL: a valid plan -> exit $rc: ${out:0:300}"; fails=$((fails + 1))
else
  echo "ok:   a valid plan ranks layouts"
fi
out=$(timeout 60 "$bin" --model "$model" --batch 256 --seq 4096 --top 3 --json --built-only); rc=$?
if [[ $rc -ne 0 ]] || ! /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin); assert len(j["plans"]) == 3 and all(p["built"] for p in j["plans"])' <<<"$out"; then
  echo "FAIL: --json --built-only -> exit $rc: ${out:0:300}"; fails=$((fails + 1))
else
  echo "ok:   --json gives three built plans"
fi
echo "$fails failures"
exit $((fails > 0))
