#!/usr/bin/env bash
# Two builds, the same results? For changes that move code and must not
# change what it computes: the delivered batches' digest (batch_digest.py)
# and CPU training's step losses and validation, MLP and CNN, 2 workers.
#   bash bench/same_results.sh BEFORE_BUILD AFTER_BUILD DATA_DIR [VAL_DIR]
# (builds as build/release: python/, tools/). Exits 1 on any difference.
set -euo pipefail
before=$1 after=$2 data=$3 val=${4:-}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
digest() { PYTHONPATH="$1/python:$here/../build/pydeps" "$python" "$here/batch_digest.py" "$data"; }
a=$(digest "$before") b=$(digest "$after")
echo "batch digest: $a / $b"
[[ $a == "$b" ]] || { echo "the delivered batches differ"; status=1; }
for model in mlp cnn:8,16; do
  for side in before after; do
    build=$before; [[ $side == after ]] && build=$after
    "$build/tools/pinfeed-train" --data "$data" ${val:+--val "$val"} --devices cpu:2 --epochs 2 --batch-size 32 \
      --size 32 --model "$model" --threads 2 --seed 5 --json -q >"$work/$side.json"
  done
  "$python" - "$model" "$work/before.json" "$work/after.json" <<'PY' || status=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[2:4])
la = [x for e in a["epochs"] for x in e["step_loss"]]
lb = [x for e in b["epochs"] for x in e["step_loss"]]
va = [(e["val_loss"], e["val_accuracy"]) for e in a["epochs"]]
vb = [(e["val_loss"], e["val_accuracy"]) for e in b["epochs"]]
print(f"{sys.argv[1]}: {len(la)} steps, step losses identical: {la == lb}, validation identical: {va == vb}")
sys.exit(0 if la == lb and va == vb else 1)
PY
done
exit $status
