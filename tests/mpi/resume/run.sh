#!/usr/bin/env bash
# The MPI restart path of issue 20: a 2-rank job whose last rank dies once at step 5 is relaunched
# by tools/mpirun-resume and resumes from its tiers; its final state must equal an uninterrupted
# run's, and it must have resumed from a checkpoint rather than started over.
#   run.sh <mpi_resume_demo> <mpiexec> <tools/mpirun-resume>
set -euo pipefail
demo=$1 mpiexec=$2 launcher=$3
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
export MPIRUN="$mpiexec --allow-run-as-root --oversubscribe"
"$launcher" --max-restarts 2 -- -np 2 "$demo" "$root/a" 8 --die-at 5 > "$root/a.log" 2>&1 || { cat "$root/a.log"; exit 1; }
$MPIRUN -np 2 "$demo" "$root/b" 8 > "$root/b.log" 2>&1 || { cat "$root/b.log"; exit 1; }
grep -E "fresh start|resumed|final|mpirun-resume" "$root/a.log"
test -f "$root/a/died" || { echo "FAILED: the job never died"; exit 1; }
grep -q "resumed from step [1-9]" "$root/a.log" || { echo "FAILED: the relaunch did not resume from a checkpoint"; exit 1; }
if ! cmp -s "$root/a/final.txt" "$root/b/final.txt"; then
  echo "FAILED: interrupted $(cat "$root/a/final.txt"), uninterrupted $(cat "$root/b/final.txt")"
  exit 1
fi
echo "the resumed job's final state equals the uninterrupted one's: $(cat "$root/b/final.txt")"
