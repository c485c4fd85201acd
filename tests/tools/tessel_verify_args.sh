#!/usr/bin/env bash
# Runs tessel-verify over impossible arguments (each must exit 2 with a message on stderr), then
# --list and one quick valid run.
# Usage: tests/tools/tessel_verify_args.sh path/to/tessel-verify
set -u
bin=$1
fails=0
bad() {
  local err rc
  err=$(timeout 60 "$bin" "$@" 2>&1 >/dev/null); rc=$?
  if [[ $rc -ne 2 ]] || [[ -z $err ]]; then
    echo "FAIL: tessel-verify $* -> exit $rc, stderr '${err:0:200}'"; fails=$((fails + 1))
  else
    echo "ok:   tessel-verify $* -> exit $rc: ${err%%$'\n'*}"
  fi
}
bad
bad frobnicate
bad --all softmax
bad --threads
bad --threads 0
bad --threads 2x
bad --threads 99999999999999999999
bad --seed -1
bad --frobnicate
out=$(timeout 60 "$bin" --list); rc=$?
if [[ $rc -ne 0 ]] || ! grep -q "^gemm/f32" <<<"$out"; then echo "FAIL: --list exited $rc"; fails=$((fails + 1)); else echo "ok:   --list"; fi
out=$(timeout 300 "$bin" softmax --quick --threads 2); rc=$?
if [[ $rc -ne 0 ]] || ! grep -q "1 of 1 operators passed" <<<"$out"; then echo "FAIL: a valid run exited $rc:"; echo "$out"; fails=$((fails + 1)); else echo "ok:   softmax --quick"; fi
echo "$fails failed"
[[ $fails -eq 0 ]]
