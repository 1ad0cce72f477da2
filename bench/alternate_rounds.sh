#!/usr/bin/env bash
# images/s of two builds in alternating rounds (bench/loader_rate.py), so
# that the machine's drift falls on both alike; prints each round, then the
# medians and their ratio.
#   bash bench/alternate_rounds.sh BEFORE_BUILD AFTER_BUILD DATASET [ROUNDS]
# (builds as build/release: python/). PYTHON picks the interpreter (its torch).
set -euo pipefail
before=$1 after=$2 data=$3 rounds=${4:-4}
python=${PYTHON:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
out=$(for ((r = 1; r <= rounds; ++r)); do
  for side in before after; do
    build=$before; [[ $side == after ]] && build=$after
    echo "$r $side $(PYTHONPATH="$build/python" "$python" "$here/loader_rate.py" "$data")"
  done
done)
echo "$out"
"$python" - <<PY
import statistics
rows = [l.split() for l in """$out""".splitlines()]
med = {s: statistics.median(float(v) for _, side, v in rows if side == s) for s in ("before", "after")}
print(f"median before {med['before']:.1f}, after {med['after']:.1f} images/s, ratio {med['after'] / med['before']:.3f}")
PY
