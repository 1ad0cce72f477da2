#!/usr/bin/env bash
# GPU checks: the tests labelled "gpu" and the GPU figures, on a machine
# that has a CUDA device. On a machine without one the tests skip (with the
# reason) and the figures say "no GPU"; nothing is faked. On a GPU host a
# skipped GPU test fails the check, and pinned copies must be clearly faster
# than pageable ones. It also checks, on the GPU:
#   - one CUDA context per process, on its own GPU only (nvidia-smi's
#     process list while training runs; needs 2 GPUs to show anything, and
#     says "not checked" on one);
#   - a rank that fails mid-epoch ends every rank within seconds (NCCL:
#     threads in one process, and two processes under mpirun; 2 GPUs);
#   - a compute-bound run (a wide MLP on small images): the GPU must never
#     wait for data (data_wait_fraction < 0.1);
#   - the CNN: accuracy on texture classes, images/s and --profile's step
#     breakdown on one GPU, and --compare over every GPU (2 or more);
#   - the Python tests with the machine's own torch, when it has CUDA and
#     the built module matches its Python: device="cuda" batches against CPU
#     batches moved by hand, both under a slow consumer stream, and the
#     non_blocking rule of device=None (tests/python/test_device_gpu.py);
#     then images/s through Python into GPU memory
#     (bench/python_device_bench.py).
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

# --- one context per process --------------------------------------------
# While a run trains on GPU g, nvidia-smi must list its pid on g only: a
# thread that touched CUDA with no current device would have made a context
# on GPU 0 as well (issue 11, item 1).
mapfile -t busids < <(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null || true)
gpus_of_pid() {  # the bus ids the pid has a context on
  nvidia-smi --query-compute-apps=pid,gpu_bus_id --format=csv,noheader 2>/dev/null |
    awk -F', *' -v p="$1" '$1 == p {print $2}' | sort -u
}
watch_contexts() {  # watch_contexts <expected bus id> <pid>...: fails on a context elsewhere
  local want=$1; shift
  local seen_any=0
  for _ in $(seq 1 40); do
    for pid in "$@"; do
      for bus in $(gpus_of_pid "$pid"); do
        seen_any=1
        if [[ ${bus,,} != "${want,,}" ]]; then
          echo "gpu_check: pid $pid has a context on $bus as well as on $want"; return 1
        fi
      done
    done
    sleep 0.25
  done
  [[ $seen_any == 1 ]] || { echo "gpu_check: no context seen at all (nvidia-smi cannot list processes here?)"; return 1; }
}
echo "== one CUDA context per process"
if [[ $gpus -ge 2 ]]; then
  "$build/tools/pinfeed-train" --data "$data/train" --devices cuda:1 --epochs 4 --batch-size 128 --size 64 --pool 4 -q &
  pid=$!
  watch_contexts "${busids[1]}" "$pid" || status=1
  wait "$pid" || status=1
  if command -v mpirun >/dev/null 2>&1; then
    # Two processes, one GPU each (local rank 0 -> cuda:0, 1 -> cuda:1).
    mpirun --allow-run-as-root -np 2 "$build/tools/pinfeed-train" --data "$data/train" --devices cuda:all --epochs 4 \
      --batch-size 128 --size 64 --pool 4 -q &
    sleep 3
    for pid in $(pgrep -f "pinfeed-train --data $data/train --devices cuda:all"); do
      n=$(gpus_of_pid "$pid" | wc -l)
      [[ $n -le 1 ]] || { echo "gpu_check: mpirun rank pid $pid holds contexts on $n GPUs"; status=1; }
    done
    wait || status=1
  else
    echo "gpu_check: no mpirun here: the two-process context check did not run"
  fi
else
  echo "gpu_check: NOT CHECKED: one GPU cannot show a stray context on another (needs 2 GPUs)"
fi

# --- a failing rank ends every rank --------------------------------------
echo "== a rank failing mid-epoch ends every rank at once"
if [[ $gpus -ge 2 ]]; then
  bad=$(mktemp -d)
  cp -r "$data/train" "$bad/"
  printf 'not an image' >"$bad/train/class_003/$(ls "$bad/train/class_003" | head -n 1)"
  for launch in "" "mpirun --allow-run-as-root -np 2"; do
    [[ -z $launch ]] && devices=cuda:0,1 || devices=cuda:all
    if [[ -n $launch ]] && ! command -v mpirun >/dev/null 2>&1; then echo "gpu_check: no mpirun: skipped"; continue; fi
    start=$(date +%s)
    if $launch "$build/tools/pinfeed-train" --data "$bad/train" --devices "$devices" --epochs 50 --batch-size 64 \
        --size 64 --pool 4 --max-replaced-share 0 -q; then
      echo "gpu_check: a run with an undecodable file and max_replaced_share 0 succeeded"; status=1
    fi
    took=$(( $(date +%s) - start ))
    echo "gpu_check: ${launch:-one process}, $devices: every rank ended ${took}s after the start"
    [[ $took -lt 60 ]] || { echo "gpu_check: ranks waited for the collective timeout"; status=1; }
  done
  rm -rf "$bad"
else
  echo "gpu_check: NOT CHECKED: an NCCL group needs 2 GPUs (NCCL refuses two ranks on one device)"
fi

# --- compute-bound: the loader and the copies must keep up ----------------
echo "== compute-bound training (wide MLP, small images): the GPU must not wait for data"
if cb=$("$build/tools/pinfeed-train" --data "$data/train" --devices cuda:0 --epochs 2 --batch-size 256 --size 32 \
      --pool 1 --hidden 16384,16384,16384 -q --json); then
  grep -E '"images_per_second"|"data_wait_fraction"' <<<"$cb"
  wait_fraction=$(grep -o '"data_wait_fraction": *[0-9.e-]*' <<<"$cb" | tail -n 1 | grep -o '[0-9.e-]*$')
  if ! awk -v w="$wait_fraction" 'BEGIN { exit !(w < 0.1) }'; then
    echo "gpu_check: data_wait_fraction $wait_fraction in a compute-bound run: copies or the loader stall the GPU"
    status=1
  fi
else
  status=1
fi

# --- the CNN on the GPU: kernels against the CPU, images/s, step breakdown --
# (its forward/backward twins are in device_backend_gpu_test and
# ddp_gpu_test above: every layer against a definition or finite
# differences, and CUDA training with SyncBN against one CPU worker)
echo "== GPU figures: the CNN (conv3x3 + BatchNorm blocks) on texture classes, step breakdown"
tex=$(mktemp -d)
"$build/tools/pinfeed-data" -q make --out "$tex" --classes 4 --per-class 250 --val 0.2 --style texture || status=1
"$build/tools/pinfeed-train" --data "$tex/train" --val "$tex/val" --devices cuda:0 --epochs 6 --batch-size 256 \
  --size 64 --model cnn:32,64,128 --lr 0.4 --profile || status=1
"$build/tools/pinfeed-train" --data "$tex/train" --devices cuda:0 --epochs 2 --batch-size 256 --size 224 \
  --model cnn:64,128,256,512 --profile -q --json | grep -E '"images_per_second"|"data_wait_fraction"|"forward"|"backward"' ||
  status=1
if [[ $gpus -ge 2 ]]; then
  echo "== the CNN on 1 vs $gpus GPUs (NCCL): SyncBN, BN per GPU, and the unscaled mistake"
  "$build/tools/pinfeed-train" --data "$tex/train" --devices cuda --epochs 6 --batch-size 256 --size 64 \
    --model cnn:32,64,128 --lr 0.4 -q --compare "$gpus" --compare-out "$tex/compare-gpu" || status=1
else
  echo "gpu_check: NOT CHECKED: 1 vs N GPUs with the CNN needs 2 GPUs"
fi
rm -rf "$data" "$tex"

# --- Python with the machine's own torch ---------------------------------
echo "== Python tests with this machine's torch"
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if PYTHONPATH="$build/python" python3 -c 'import pinfeed' 2>/dev/null; then
    PYTHONPATH="$build/python" PINFEED_DATA_TOOL="$build/tools/pinfeed-data" \
      python3 -m pytest -q tests/python || status=1
    # device="cuda" against slots + .cuda(non_blocking=True), and the
    # trainer's own copy figure above for comparison (pinfeed-bench copy).
    echo "== GPU figures: images/s through Python into GPU memory"
    pydata=$(mktemp -d)
    "$build/tools/pinfeed-data" -q make --out "$pydata" --classes 10 --per-class 200 --val 0 || status=1
    PYTHONPATH="$build/python" python3 bench/python_device_bench.py "$pydata/train" --device cuda:0 \
      --batch-size 256 --size 224 --rounds 3 --json || status=1
    rm -rf "$pydata"
  else
    echo "gpu_check: NOT CHECKED: the built module does not import with $(python3 --version 2>&1)" \
         "(built for another Python; pip install . builds one for this Python)"
  fi
else
  echo "gpu_check: NOT CHECKED: no torch with CUDA in this machine's python3"
fi
exit $status
