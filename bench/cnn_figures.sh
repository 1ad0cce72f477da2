#!/usr/bin/env bash
# The reference models side by side (issue 15's figures, docs/results.md):
#   1. validation accuracy of the MLP and the CNN on the demo's "photo" classes
#      (hue and grating: a colour average separates them) and on "texture"
#      classes (fine stripes, checks or blobs under random colours), same data,
#      epochs, batch and learning rate;
#   2. where a CNN step's time goes (--profile) and the loader/compute split;
#   3. the four --compare curves with the CNN (OUT_DIR/compare-cnn.{csv,png};
#      docs/compare-cnn.* are a copy of one run's).
#
#   bench/cnn_figures.sh [OUT_DIR]     (default: build/cnn-figures; ~2 min on 2 cores)
# Needs the release build (cmake --preset release && cmake --build --preset
# release) and python3 (it reads pinfeed-train's JSON).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/cnn-figures}
bin=build/release/tools
mkdir -p "$out"
for style in photo texture; do
  [[ -d $out/$style ]] || "$bin/pinfeed-data" -q make --out "$out/$style" --classes 4 --per-class 75 --val 0.2 \
    --seed 5 --style "$style"
done

common=(--devices cpu:2 --batch-size 32 --size 64 --lr 0.4 --seed 1 --json)
final() {  # final() STYLE EPOCHS MODEL: "val_acc loss img/s data_wait" of the last epoch
  "$bin/pinfeed-train" --data "$1/train" --val "$1/val" --epochs "$2" --model "$3" "${common[@]}" |
    python3 -c 'import json, sys
e = json.load(sys.stdin)["epochs"][-1]
print("%.1f%% %.3f %.0f %.1f%%" % (100 * e["val_accuracy"], e["loss"], e["images_per_second"], 100 * e["data_wait_fraction"]))'
}
echo "== validation accuracy, 4 classes, 240 train / 60 held-out images, 64 px, cpu:2, batch 32, lr 0.4"
printf '%-8s %-10s %-7s %-10s %-10s %-8s %-9s\n' data model epochs val_acc train_loss img/s data_wait
for style in photo texture; do
  for model in mlp cnn:32,64,128; do
    for epochs in 15 30; do
      read -r acc loss ips wait < <(final "$out/$style" "$epochs" "$model")
      printf '%-8s %-10s %-7s %-10s %-10s %-8s %-9s\n' "$style" "$model" "$epochs" "$acc" "$loss" "$ips" "$wait"
    done
  done
done

echo "== a CNN step, broken down (--profile), texture data"
"$bin/pinfeed-train" --data "$out/texture/train" --epochs 3 --model cnn:32,64,128 --profile \
  --devices cpu:2 --batch-size 32 --size 64 --lr 0.4 --seed 1 2>/dev/null | grep -E "^epoch 3|step ms|^cores"

echo "== --compare 4 with the CNN: 1 worker, 4 with SyncBN, 4 with BN per worker, the unscaled mistake"
"$bin/pinfeed-train" --data "$out/texture/train" --devices cpu:1 --epochs 10 --batch-size 32 --size 64 --lr 0.4 \
  --seed 1 --model cnn:32,64,128 -q --compare 4 --compare-out "$out/compare-cnn"
