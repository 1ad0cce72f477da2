#!/usr/bin/env bash
# The main job: set up, build, and run pinfeed on this machine.
# Makes a small synthetic ImageNet-like dataset, checks that the host can pin
# the loader's pool, trains the reference classifier on it with data-parallel
# workers (every GPU if there is one, else 2 CPU workers) fed by the loader
# from pinned slots, printing loss and accuracy falling, throughput, the
# share of time spent waiting for data, and the pool's pinned/pageable state;
# then measures the loader alone against the machine's decode ceiling.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake --preset release >/dev/null
# Only what the demo runs (the tools and the loader benchmark): the tests and
# the other benchmarks are scripts/test.sh's to build.
cmake --build --preset release --target pinfeed-data pinfeed-diag pinfeed-train pinfeed-bench

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
echo "=== pinfeed-train: 6 epochs, global batch 64, RandomResizedCrop 64 + flip, normalized on the device"
build/release/tools/pinfeed-train --data "$data/train" --val "$data/val" --devices auto \
  --epochs 6 --batch-size 64 --size 64 --pool 4 --hidden 256 --lr 0.1 --seed 1 \
  --checkpoint build/demo-model.ckpt

echo
echo "=== pinfeed-bench loader: the loader alone (224 px, float32) against a bare full decode of the same files"
build/release/bench/pinfeed-bench loader --data "$data/train" --batch 64 --epochs 2

echo
echo "=== pinfeed-diag --watch: live pressure, with a pool allocated and following it"
build/release/tools/pinfeed-diag --watch 0.25 --count 4 --with-pool --gpus 1 --batch 64x3x224x224:f32 --prefetch 4
