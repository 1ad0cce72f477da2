#!/usr/bin/env bash
# What `pinfeed-data pack --max-side N` buys and costs, measured:
#   bench/pack_figures.sh [DATASET_DIR ...] [--sides 256,320,512] [--rounds N]
# (default datasets: build/real-photos/train from bench/real_photos.sh and
# build/synth/train, a `pinfeed-data make` set of 900 JPEGs of 500x375 +-30%).
# For each dataset: tar shards of the files as they are, and for each N
# shards re-encoded with the longer side at most N (quality 90). The loader's
# images/s on each (RandomResizedCrop 224 + flip + normalize, float32, batch
# 64, every core; `pinfeed-bench loader`, the variants in alternating rounds,
# medians) and the mean absolute difference of the 224x224 centre-crop
# output against the original files (bench/pack_output_diff.py, uint8
# levels). Prints a table and writes it to build/packs/pack-figures.md.
set -euo pipefail
cd "$(dirname "$0")/.."
sides="256,320,512" rounds=3 sets=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --sides) sides=${2:?}; shift 2 ;;
    --rounds) rounds=${2:?}; shift 2 ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    -*) echo "pack_figures.sh: unknown option $1 (--sides, --rounds)" >&2; exit 2 ;;
    *) [[ -d $1 ]] || { echo "pack_figures.sh: $1 is not a folder" >&2; exit 2; }; sets+=("$1"); shift ;;
  esac
done
[[ -x build/release/bench/pinfeed-bench ]] ||
  { bash scripts/install-deps.sh; cmake --preset release >/dev/null; cmake --build --preset release; }
if [[ ${#sets[@]} -eq 0 ]]; then
  bash bench/real_photos.sh build/real-photos
  [[ -d build/synth/train ]] || build/release/tools/pinfeed-data -q make --out build/synth --classes 10 --per-class 90 --seed 1
  sets=(build/real-photos/train build/synth/train)
fi
IFS=, read -r -a side_list <<< "$sides"
mkdir -p build/packs
table=build/packs/pack-figures.md
{
  echo "| dataset | images | MB of images | pack s | loader images/s per round | median | vs files as they are | centre-crop mean abs diff (worst image) |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
} > "$table"
for data in "${sets[@]}"; do
  # Named after the folder above train/ (build/real-photos/train: real-photos),
  # with the folder's own name added when it is not train.
  name=$(basename "$(dirname "$(realpath "$data")")")
  [[ $(basename "$data") == train ]] || name="$name-$(basename "$data")"
  declare -A pattern=() mb=() secs=() rates=()
  variants=(0 "${side_list[@]}")
  for n in "${variants[@]}"; do
    prefix=build/packs/$name-$n
    rm -f "$prefix"-*.tar
    t0=$(date +%s.%N)
    line=$(build/release/tools/pinfeed-data -q pack --from "$data" --out "$prefix" --per-shard 300 --max-side "$n" --quality 90 | head -1)
    secs[$n]=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
    pattern[$n]=$(echo "$line" | sed -E 's/.* into (.*) in [0-9.]+ s$/\1/')
    mb[$n]=$(du -cb "$prefix"-*.tar | tail -1 | awk '{printf "%.1f", $1 / 1e6}')
  done
  for ((r = 1; r <= rounds; ++r)); do
    for n in "${variants[@]}"; do
      rate=$(build/release/bench/pinfeed-bench loader --data "${pattern[$n]}" --batch 64 --repeat 1 --epochs 3 --json |
        /usr/bin/python3 -c "import json, sys; print(round(json.load(sys.stdin)['loader']['images_per_s']))")
      rates[$n]="${rates[$n]:-}${rates[$n]:+ }$rate"
      echo "  $name max-side $n round $r: $rate images/s"
    done
  done
  med() { tr ' ' '\n' | sort -n | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
  base=$(echo "${rates[0]}" | med)
  images=$(find "$data" -type f | wc -l)
  for n in "${variants[@]}"; do
    m=$(echo "${rates[$n]}" | med)
    if [[ $n == 0 ]]; then
      label="files as they are"; diff="0 (the same bytes)"
    else
      label="--max-side $n"
      diff=$(PYTHONPATH=build/release/python /usr/bin/python3 bench/pack_output_diff.py --original "$data" --packed "${pattern[$n]}" |
        /usr/bin/python3 -c "import json, sys; j = json.load(sys.stdin); print(f\"{j['mean_abs_diff']:.2f} ({j['worst_sample_mean_abs_diff']:.2f})\")")
    fi
    echo "| $name, $label | $images | ${mb[$n]} | ${secs[$n]} | ${rates[$n]// /, } | $m | $(awk -v a="$m" -v b="$base" 'BEGIN {printf "%.2fx", a / b}') | $diff |" >> "$table"
  done
  unset pattern mb secs rates
done
cat "$table"
