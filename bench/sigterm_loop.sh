#!/usr/bin/env bash
# SIGTERM at random moments of a pinfeed-train run that saves a checkpoint
# at every step: every run must exit 143 and leave no temporary beside the
# checkpoint (docs/results.md, "Tables, signals and CI time").
#   bench/sigterm_loop.sh DATASET [RUNS] [PINFEED_TRAIN]
set -uo pipefail
data=${1:?dataset (an ImageFolder train/ folder)}
runs=${2:-8}
train=${3:-build/release/tools/pinfeed-train}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bad=0
for i in $(seq "$runs"); do
  "$train" --data "$data" --devices cpu:1 --batch-size 8 --size 16 --pool 2 --threads 1 -q \
    --checkpoint "$work/m.ckpt" --epochs 1000 --checkpoint-every 1 2>"$work/err" &
  pid=$!
  sleep "$((RANDOM % 3)).$((RANDOM % 10))$((RANDOM % 10))"
  kill -TERM "$pid"
  wait "$pid"
  rc=$?
  left=$(find "$work" -name '.m.ckpt.tmp.*' | wc -l)
  echo "run $i: exit $rc, temporaries left $left"
  if [[ $rc -ne 143 || $left -ne 0 ]]; then bad=$((bad + 1)); cat "$work/err"; fi
  rm -f "$work"/.m.ckpt.tmp.* "$work/m.ckpt"
done
echo "$bad of $runs runs wrong"
exit $((bad > 0))
