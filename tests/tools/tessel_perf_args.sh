#!/usr/bin/env bash
# Runs tessel-perf over a table of impossible arguments: each must end with a message on stderr and
# exit status 1 or 2 (no crash, no hang, no silent success); then one small valid run must pass.
# Usage: tests/tools/tessel_perf_args.sh path/to/tessel-perf
set -u
bin=$1
fails=0
total=0
bad() {
  local err rc
  total=$((total + 1))
  err=$(timeout 60 "$bin" "$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 1 && $rc -ne 2 ]] || [[ -z $err ]]; then
    echo "FAIL: tessel-perf $* -> exit $rc, stderr '${err:0:200}'"; fails=$((fails + 1))
  else
    echo "ok:   tessel-perf $* -> exit $rc: ${err%%$'\n'*}"
  fi
}
bad
bad frobnicate
bad all_reduce -b
bad all_reduce -g 100000 --transport threads
bad all_reduce -b 1G -e 8
bad all_reduce -b 99999999999999999999
bad all_reduce -e 1e30
bad all_reduce -b -5
bad all_reduce -b 8x
bad all_reduce -b 1.5
bad all_reduce -g 0
bad all_reduce -g 2x
bad all_reduce -g 99999999999999999999
bad all_reduce -n 0
bad all_reduce -w -1
bad all_reduce -f 0.5
bad all_reduce -f nan
bad all_reduce -d f128
bad all_reduce -o xor
bad all_reduce --algo spiral
bad all_reduce --transport carrier-pigeon
bad all_reduce -g 2 -r 5
bad all_reduce --segment 8
bad all_reduce --compress int4 -d f64
bad all_reduce --compress zip
bad all_reduce --frobnicate
bad moe --tokens -1
bad moe --hidden 0
bad moe --topk 300 --experts 256
bad moe -g 0
total=$((total + 1))
out=$(timeout 120 "$bin" all_reduce -b 8 -e 1K -f 4 -g 2 -n 1 -w 0 --check 2>&1); rc=$?
if [[ $rc -ne 0 ]] || ! grep -q "Out of bounds values : 0 OK" <<<"$out"; then
  echo "FAIL: a valid run exited $rc:"; echo "$out"; fails=$((fails + 1))
else
  echo "ok:   a valid small run passes its --check"
fi
echo "$((total - fails)) passed, $fails failed"
[[ $fails -eq 0 ]]
