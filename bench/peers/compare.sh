#!/usr/bin/env bash
# pinfeed (C++ and through its Python module) against its peers, same files,
# same transforms, same batch and thread count, in alternating rounds:
#   bench/peers/compare.sh DATASET_DIR [random|center] [batch]
#       [--peers dali,ffcv,torch] [--rounds N] [--threads N] [--epochs N] [--out PREFIX]
# Every loader makes float32 NCHW batches (RandomResizedCrop 224 + flip +
# normalize, or Resize 256 + CenterCrop 224); pinfeed's uint8 NHWC rate is
# shown beside it. Each round runs every loader once for 3 epochs (the peers
# report their median epoch, pinfeed-bench the 3 epochs' images over their
# time); the table gives each loader's per-round rates, their median and
# pinfeed's ratio to it. Writes PREFIX.csv (one row per loader and round),
# PREFIX.md (the table) and PREFIX.png (a bar chart); PREFIX defaults to
# build/peers/compare-<crop>.
#
# Peers are installed on first use, each apart from the others:
#   torch  Debian's python3-torch and python3-torchvision (apt).
#   dali   NVIDIA DALI from PyPI (nvidia-dali-cuda130, ~200 MB) in
#          build/peers/dali-venv; its CPU-only pipeline needs no GPU or driver.
#   ffcv   FFCV 1.0.2 built from PyPI's sdist in build/peers/ffcv-venv
#          (Debian's torch through --system-site-packages; numba 0.57.1,
#          opencv-python 4.6), against Debian's libopencv-dev and
#          libturbojpeg0-dev (apt). Its .beton of the dataset, holding the
#          original JPEG files, is written once to build/peers/ffcv-data/.
set -euo pipefail
cd "$(dirname "$0")/../.."
usage="usage: bench/peers/compare.sh DATASET_DIR [random|center] [batch] [--peers dali,ffcv,torch] [--rounds N] [--threads N] [--epochs N] [--out PREFIX]"
positional=() peers="dali,ffcv,torch" rounds=2 threads=$(nproc) epochs=3 out=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --peers) peers=${2:?$usage}; shift 2 ;;
    --rounds) rounds=${2:?$usage}; shift 2 ;;
    --threads) threads=${2:?$usage}; shift 2 ;;
    --epochs) epochs=${2:?$usage}; shift 2 ;;
    --out) out=${2:?$usage}; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "compare.sh: unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
    *) positional+=("$1"); shift ;;
  esac
done
data=${positional[0]:-}
crop=${positional[1]:-random}
batch=${positional[2]:-64}
[[ -n $data ]] || { echo "$usage" >&2; exit 2; }
[[ -d $data ]] || { echo "compare.sh: $data is not a directory (an ImageFolder: one folder per class)" >&2; exit 2; }
[[ $crop == random || $crop == center ]] || { echo "compare.sh: crop must be random or center, got $crop" >&2; exit 2; }
for n in "$batch" "$rounds" "$threads" "$epochs"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "compare.sh: batch, --rounds, --threads and --epochs must be positive integers, got $n" >&2; exit 2; }
done
IFS=, read -r -a peer_list <<< "$peers"
for p in "${peer_list[@]}"; do
  [[ $p == dali || $p == ffcv || $p == torch ]] || { echo "compare.sh: unknown peer '$p' (dali, ffcv, torch)" >&2; exit 2; }
done
data=$(realpath "$data")
name=$(basename "$data"); [[ $name == train || $name == val ]] && name="$(basename "$(dirname "$data")")/$name"
out=${out:-build/peers/compare-$crop}
mkdir -p "$(dirname "$out")" build/peers

sudo=""; [[ $(id -u) -ne 0 ]] && sudo=sudo
apt_need() {  # installs the Debian packages that are missing
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "compare.sh: installing ${missing[*]}" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}
apt_need python3-venv python3-torch python3-torchvision python3-matplotlib
[[ -x build/release/bench/pinfeed-bench && -d build/release/python/pinfeed ]] ||
  { bash scripts/install-deps.sh; cmake --preset release >/dev/null; cmake --build --preset release; }

has() { [[ ",$peers," == *",$1,"* ]]; }
if has dali && [[ ! -f build/peers/dali-venv/.ready ]]; then
  echo "compare.sh: installing DALI into build/peers/dali-venv (first use)" >&2
  rm -rf build/peers/dali-venv
  /usr/bin/python3 -m venv build/peers/dali-venv
  build/peers/dali-venv/bin/pip install -q nvidia-dali-cuda130 numpy
  touch build/peers/dali-venv/.ready
fi
if has ffcv && [[ ! -f build/peers/ffcv-venv/.ready ]]; then
  echo "compare.sh: building FFCV 1.0.2 into build/peers/ffcv-venv (first use)" >&2
  apt_need libopencv-dev libturbojpeg0-dev pkg-config python3-dev g++
  rm -rf build/peers/ffcv-venv
  /usr/bin/python3 -m venv --system-site-packages build/peers/ffcv-venv
  build/peers/ffcv-venv/bin/pip install -q "numba==0.57.1" "opencv-python==4.6.0.66" "pytorch-pfn-extras<0.10" \
    fastargs terminaltables assertpy tqdm psutil
  build/peers/ffcv-venv/bin/pip install -q --no-build-isolation "ffcv==1.0.2"
  touch build/peers/ffcv-venv/.ready
fi

py_env="PYTHONPATH=build/release/python"
rate() { awk '{for (i = 1; i <= NF; ++i) if ($i == "images/s") {print $(i - 1); exit}}'; }
csv="$out.csv"
echo "round,loader,images_per_s" > "$csv"
record() { echo "$1,$2,$3" >> "$csv"; }
peer() {  # peer NAME COMMAND...: runs one peer, records its rate
  local name=$1 out
  shift
  if out=$("$@") && [[ -n $(echo "$out" | rate) ]]; then
    echo "$out"
    record "$r" "$name" "$(echo "$out" | rate)"
  else
    echo "compare.sh: $name failed in round $r (its output is above); left out" >&2
  fi
}
# Keyed on every file's path, size and time: a rebuilt dataset gets a new .beton.
beton="build/peers/ffcv-data/$(find "$data" -type f -printf '%p %s %T@\n' | sort | md5sum | cut -c1-12).beton"
for ((r = 1; r <= rounds; ++r)); do
  echo "== round $r of $rounds"
  for layout in nchw-f32 nhwc-u8; do
    line=$(build/release/bench/pinfeed-bench loader --data "$data" --crop "$crop" --batch "$batch" --threads "$threads" \
      --layout "$layout" --epochs "$epochs" --repeat 1 | grep "pinfeed loader")
    echo "  [$layout] $line"
    record "$r" "pinfeed-$layout" "$(echo "$line" | awk '{print $3}')"
  done
  line=$(env $py_env /usr/bin/python3 bench/peers/pinfeed_python.py --data "$data" --crop "$crop" --batch "$batch" \
    --threads "$threads" --epochs "$epochs")
  echo "$line"; record "$r" pinfeed-python "$(echo "$line" | rate)"
  # A peer that fails is named and left out of this round; the others go on.
  if has dali; then
    peer dali-cpu build/peers/dali-venv/bin/python bench/peers/dali_cpu.py --data "$data" --crop "$crop" \
      --batch "$batch" --threads "$threads" --epochs "$epochs"
  fi
  if has ffcv; then
    peer ffcv build/peers/ffcv-venv/bin/python bench/peers/ffcv_loader.py --data "$data" --beton "$beton" \
      --crop "$crop" --batch "$batch" --workers "$threads" --epochs "$epochs"
  fi
  if has torch; then
    peer pytorch /usr/bin/python3 bench/peers/torch_dataloader.py --data "$data" --crop "$crop" --batch "$batch" \
      --workers "$threads" --epochs "$epochs"
  fi
done
/usr/bin/python3 bench/peers/compare_table.py --csv "$csv" --out "$out" \
  --title "$name: $crop crop, float32, batch $batch, $threads threads, $(nproc) cores, $(date -u +%F)"
