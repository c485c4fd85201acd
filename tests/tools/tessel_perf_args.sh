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
# --cluster, --plot, --algo lists: a missing, malformed or wrong config, a plot that cannot be written
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '{"cards": 4,, "planes": 2}\n' >"$tmp/malformed.json"
printf 'cards = 4\nplanez = 2\n' >"$tmp/badkey.conf"
printf '{"fabric": {"planes": "two"}}\n' >"$tmp/badtype.json"
printf 'cards = 4\nport_bandwidth = -5G\n' >"$tmp/range.conf"
printf 'cards = 4\nplanes = 2\nports_per_card = 2\n' >"$tmp/four.conf"
bad all_reduce --transport emulated --cluster "$tmp/missing.conf"
bad all_reduce --transport emulated --cluster "$tmp/malformed.json"
bad all_reduce --transport emulated --cluster "$tmp/badkey.conf"
bad all_reduce --transport emulated --cluster "$tmp/badtype.json"
bad all_reduce --transport emulated --cluster "$tmp/range.conf"
bad all_reduce --transport emulated --cluster "$tmp"
bad all_reduce --cluster "$tmp/four.conf"
bad all_reduce --transport threads --cluster "$tmp/four.conf"
bad all_reduce --transport emulated --cluster "$tmp/four.conf" -g 8
bad all_reduce --transport emulated --cluster
bad all_reduce --plot /nonexistent/dir/busbw.svg
bad all_reduce --plot "$tmp"
bad all_reduce --plot
bad all_reduce --algo ring,spiral
bad all_reduce --algo ring,ring
bad all_reduce --algo ring,
bad all_reduce --transport emulated -g 200
bad moe --cluster "$tmp/badkey.conf"
bad moe --cluster "$tmp/four.conf" -g 8
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
# a sweep on a non-default cluster with two algorithms and a plot: one table each, the closed-form
# column, an SVG with one line per algorithm and the closed form
total=$((total + 1))
out=$(timeout 300 "$bin" all_reduce -b 64K -e 4M -f 4 -n 2 -w 1 --transport emulated --cluster "$tmp/four.conf" \
      --algo ring,direct --plot "$tmp/busbw.svg" --progress 2>"$tmp/progress.txt"); rc=$?
lines=$(grep -c '<g class="series"' "$tmp/busbw.svg" 2>/dev/null)
if [[ $rc -ne 0 ]] || [[ $(grep -c '^# tessel-perf all_reduce' <<<"$out") -ne 2 ]] || ! grep -q "model" <<<"$out" ||
   [[ $lines -ne 3 ]] || ! grep -q "\[4/4\]" "$tmp/progress.txt"; then
  echo "FAIL: --cluster/--algo/--plot run exited $rc, $lines plot series:"; echo "$out"; cat "$tmp/progress.txt"; fails=$((fails + 1))
else
  echo "ok:   --cluster with two algorithms writes a plot of $lines series and reports progress"
fi
total=$((total + 1))
if ! "$bin" --cluster-keys | grep -q "fabric.port_bandwidth"; then
  echo "FAIL: --cluster-keys does not list the keys"; fails=$((fails + 1))
else
  echo "ok:   --cluster-keys lists the keys"
fi
echo "$((total - fails)) passed, $fails failed"
[[ $fails -eq 0 ]]
