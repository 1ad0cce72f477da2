#!/usr/bin/env bash
# pinfeed (C++ and through its Python module) and PyTorch's DataLoader side
# by side, same files, same transforms, same run:
#   bench/peers/compare.sh DATASET_DIR [random|center] [batch]
# Installs Debian's python3-torch and python3-torchvision if missing (large:
# a few hundred MB), builds the release preset if needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${1:?usage: bench/peers/compare.sh DATASET_DIR [random|center] [batch]}
crop=${2:-random}
batch=${3:-64}

if ! dpkg-query -W -f='${Status}' python3-torchvision 2>/dev/null | grep -q "install ok installed"; then
  sudo=""; [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-torch python3-torchvision >/dev/null
fi
[[ -x build/release/bench/pinfeed-bench && -d build/release/python/pinfeed ]] ||
  { bash scripts/install-deps.sh; cmake --preset release >/dev/null; cmake --build --preset release; }

out=$(mktemp)
build/release/bench/pinfeed-bench loader --data "$data" --crop "$crop" --batch "$batch" --repeat 3 | tee "$out"
py_line=$(PYTHONPATH=build/release/python /usr/bin/python3 bench/peers/pinfeed_python.py --data "$data" --crop "$crop" \
  --batch "$batch" --epochs 3)
echo "$py_line"
torch_line=$(/usr/bin/python3 bench/peers/torch_dataloader.py --data "$data" --crop "$crop" --batch "$batch" --epochs 3)
echo "$torch_line"
rate() { awk '{for (i = 1; i <= NF; ++i) if ($i == "images/s") print $(i - 1)}'; }
ours=$(awk '/pinfeed loader/ {print $3}' "$out")
python=$(echo "$py_line" | rate)
theirs=$(echo "$torch_line" | rate)
awk -v a="$ours" -v p="$python" -v b="$theirs" 'BEGIN {
  printf "  %-34s %10.2fx\n", "pinfeed (C++) / pytorch", a / b
  printf "  %-34s %10.2fx\n", "pinfeed (Python) / pytorch", p / b
  printf "  %-34s %10.2fx\n", "pinfeed Python / C++", p / a }'
rm -f "$out"
