#!/usr/bin/env bash
# The main job: set up, build, and run pinfeed on this machine.
# Makes a small synthetic ImageNet-like dataset, checks that the host can pin
# the loader's pool, loads the dataset through the loader (RandomResizedCrop
# 224 + flip + normalize, batches of 64 in pinned slots) against the
# machine's decode ceiling, and runs the memory benchmarks briefly. The
# trainer (issue 4) will turn the load step into load-and-train.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release

data=${PINFEED_DEMO_DATA:-build/demo-data}
if [[ ! -d $data/train ]]; then
  echo
  echo "=== pinfeed-data make: 10 classes x 100 JPEGs (~110 KB each) into $data"
  build/release/tools/pinfeed-data make --out "$data" --classes 10 --per-class 100 --val 0.1
fi
build/release/tools/pinfeed-data -q scan "$data/train"

echo
echo "=== pinfeed-diag: can this host pin the loader's pool (batch 64 x 3 x 224 x 224 float32, prefetch 4)?"
build/release/tools/pinfeed-diag --gpus 1 --batch 64x3x224x224:f32 --prefetch 4

echo
echo "=== pinfeed-bench loader: the loader against a bare full decode of the same files"
build/release/bench/pinfeed-bench loader --data "$data/train" --batch 64 --epochs 2

echo
echo "=== pinfeed-diag --watch: live pressure, with a pool allocated and following it"
build/release/tools/pinfeed-diag --watch 0.25 --count 4 --with-pool --gpus 1 --batch 64x3x224x224:f32 --prefetch 4

echo
echo "=== memory benchmarks (short run; docs/results.md has the recorded figures)"
build/release/bench/pinfeed-memory-bench --benchmark_min_time=0.05
