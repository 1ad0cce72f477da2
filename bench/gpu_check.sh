#!/usr/bin/env bash
# GPU checks: the tests labelled "gpu" and the GPU figures, on a machine
# that has a CUDA device. On a machine without one the tests skip (with the
# reason) and the figures say "no GPU"; nothing is faked. On a GPU host a
# skipped GPU test fails the check, and pinned copies must be clearly faster
# than pageable ones. (Still to add, issue 11: the mpirun one-context check,
# the abort-reaches-every-rank run, the Python GPU path with the machine's
# torch, and a compute-bound run asserting copy/compute overlap.)
#
#   bench/gpu_check.sh            build (if cmake is here), run, print figures
#   bench/gpu_check.sh --pack     build here and copy the shared libraries the
#                                 binaries need into build/release/carry-libs,
#                                 for a device machine without Debian packages
#
# On the device machine, with build/release carried along:
#   bench/gpu_check.sh            (uses build/release and its carry-libs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/release
bins=("$build/tools/pinfeed-diag" "$build/tools/pinfeed-data" "$build/tools/pinfeed-train"
      "$build/bench/pinfeed-memory-bench" "$build/bench/pinfeed-bench"
      "$build/tests/memory/pinned_resource_gpu_test" "$build/tests/trainer/device_backend_gpu_test"
      "$build/tests/trainer/ddp_gpu_test")

if command -v cmake >/dev/null 2>&1 && { [[ ${1:-} == --pack ]] || [[ ! -x $build/tools/pinfeed-diag ]]; }; then
  bash scripts/install-deps.sh
  cmake --preset release >/dev/null
  cmake --build --preset release
fi

if [[ ${1:-} == --pack ]]; then
  mkdir -p "$build/carry-libs"
  for b in "${bins[@]}"; do
    ldd "$b" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
      xargs -r cp -uL -t "$build/carry-libs"
  done
  # Loaded at run time (dlopen) by the CUDA backend and the NCCL communicator.
  for lib in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    [[ -e /usr/local/cuda/lib64/$lib ]] && cp -uL "/usr/local/cuda/lib64/$lib" "$build/carry-libs/"
  done
  echo "gpu_check: $(ls "$build/carry-libs" | wc -l) libraries in $build/carry-libs ($(du -sh "$build/carry-libs" | cut -f1))"
  exit 0
fi

if [[ -d $build/carry-libs ]]; then export LD_LIBRARY_PATH="$PWD/$build/carry-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
nvidia-smi --query-gpu=name,memory.total,pci.bus_id,driver_version --format=csv 2>/dev/null || echo "gpu_check: no nvidia-smi"

gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l || true)
echo "== GPU tests (label gpu); GPUs visible: $gpus"
status=0
for t in "$build/tests/memory/pinned_resource_gpu_test" "$build/tests/trainer/device_backend_gpu_test" \
         "$build/tests/trainer/ddp_gpu_test"; do
  out=$("$t" 2>&1) || status=1
  echo "$out" | grep -E "^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure|error" || true
  # A skipped GPU test is not a pass on a machine that has a GPU.
  if [[ $gpus -gt 0 ]] && grep -q "^\[  SKIPPED \]" <<<"$out"; then
    echo "gpu_check: $(basename "$t") skipped tests on a GPU host"; status=1
  fi
done
# The whole suite where ctest is installed (not on a bare device machine).
if command -v ctest >/dev/null 2>&1 && [[ -f $build/CTestTestfile.cmake ]]; then
  echo "== the whole ctest suite"
  ctest --test-dir "$build" -j "$(nproc)" --output-on-failure | tail -n 30 || status=1
else
  echo "gpu_check: no ctest here: the CPU suites run in CI; only the GPU binaries ran"
fi

echo "== pinfeed-diag (GPU section)"
"$build/tools/pinfeed-diag" --gpus 1 --batch 256x3x224x224:u8 --prefetch 4 --sample-ms 100 || status=1

# The benchmark's resource pins automatically: cudaHostRegister with a device,
# so the pool and its pressure round trip run on the CUDA path here.
echo "== GPU figures: pinning through cudaHostRegister"
"$build/bench/pinfeed-memory-bench" --benchmark_filter='Pinned|Pool' --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true || status=1
echo "== GPU figures: host-to-device copies from pinned and from pageable memory (a slot after a fallback)"
if copy=$("$build/bench/pinfeed-bench" copy --device cuda:0 --mib 256 --repeat 10 --json); then
  echo "$copy"
  # Pinned copies must beat pageable ones clearly (DMA straight from the
  # slot vs a staged copy); asserted, not only printed.
  ratio=$(grep -o '"pageable_over_pinned": *[0-9.]*' <<<"$copy" | grep -o '[0-9.]*$')
  if ! awk -v r="$ratio" 'BEGIN { exit !(r > 0 && r < 0.8) }'; then
    echo "gpu_check: pageable/pinned bandwidth ratio $ratio: pinned copies are not clearly faster"; status=1
  fi
else
  status=1
fi

echo "== GPU figures: training on every GPU, fed by the loader"
data=$(mktemp -d)
"$build/tools/pinfeed-data" -q make --out "$data" --classes 10 --per-class 100 --val 0.1 || status=1
"$build/tools/pinfeed-train" --data "$data/train" --val "$data/val" --devices cuda:all --epochs 3 --batch-size 256 \
  --size 224 --pool 8 || status=1
"$build/tools/pinfeed-train" --data "$data/train" --devices cuda:all --epochs 2 --batch-size 256 --size 224 \
  --pool 8 --host-normalize -q --json | grep -E '"images_per_second"|"data_wait_fraction"' || status=1
rm -rf "$data"
exit $status
