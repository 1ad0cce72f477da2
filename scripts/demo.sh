#!/usr/bin/env bash
# The main job: set up, build, and run pinfeed on this machine.
# For now (memory module): the host report with a planned pinned pool, a few
# seconds of live pressure watching with a real pool, and the memory
# benchmarks. Later modules extend this into the full load-and-train demo.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release

diag=build/release/tools/pinfeed-diag
echo
echo "=== pinfeed-diag: can this host pin a pool for 1 GPU, batches of 256x3x224x224 uint8, prefetch 4?"
"$diag" --gpus 1 --batch 256x3x224x224:u8 --prefetch 4
echo
echo "=== pinfeed-diag --watch: live pressure, with that pool allocated and following it"
"$diag" --watch 0.25 --count 8 --with-pool --gpus 1 --batch 256x3x224x224:u8 --prefetch 4
echo
echo "=== memory benchmarks (short run; see docs/results.md for the recorded figures)"
build/release/bench/pinfeed-memory-bench --benchmark_min_time=0.1
