#!/usr/bin/env python3
"""NVIDIA DALI's CPU-only pipeline over the same dataset and transforms as
pinfeed-bench and torch_dataloader.py, for bench/peers/compare.sh.

fn.readers.file over the ImageFolder (shuffled), then either
decoders.image_random_crop (RandomResizedCrop's scale and ratio ranges) +
resize to size x size + crop_mirror_normalize with a coin-flip mirror, or
decoders.image + resize(shorter = size * 256 / 224) + crop_mirror_normalize's
centre crop; float32 CHW, ImageNet's mean and std. `device_id=None` runs
with no GPU and no driver. The reader pads the last batch; only the real
images are counted. Runs in its own venv (compare.sh installs it on first
use: PyPI's nvidia-dali-cuda130).
"""
import argparse
import json
import math
import os
import statistics
import time

from nvidia.dali import fn, pipeline_def, types
import nvidia.dali as dali

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--crop", choices=["random", "center"], default="random")
    p.add_argument("--epochs", type=int, default=3, help="measured epochs; the median epoch rate is reported")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    @pipeline_def(batch_size=a.batch, num_threads=a.threads, device_id=None, seed=1, prefetch_queue_depth=2)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=a.data, random_shuffle=True, pad_last_batch=True, name="reader")
        if a.crop == "random":
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
            images = fn.resize(images, resize_x=a.size, resize_y=a.size)
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=a.size * 256 // 224)
            mirror = 0
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", crop=(a.size, a.size),
                                          mean=MEAN, std=STD, mirror=mirror)
        return images, labels

    pl = pipe()
    pl.build()
    epoch_size = pl.epoch_size("reader")
    steps = math.ceil(epoch_size / a.batch)

    def run_epoch() -> int:
        # With pad_last_batch, every epoch is `steps` batches and the last of
        # them is padded (its padding repeats an image): any `steps`
        # consecutive batches hold one epoch's epoch_size real images.
        for _ in range(steps):
            pl.run()
        return epoch_size

    for _ in range(3):  # warm-up: threads started, page cache filled
        pl.run()
    images, seconds, rates = 0, 0.0, []
    for _ in range(a.epochs):
        t0 = time.perf_counter()
        n = run_epoch()
        dt = time.perf_counter() - t0
        images += n
        seconds += dt
        rates.append(n / dt)
    rate = statistics.median(rates)
    if a.json:
        print(json.dumps({"loader": "dali-cpu", "dali": dali.__version__, "threads": a.threads, "images": images,
                          "seconds": seconds, "images_per_s": rate}))
    else:
        print(f"  {'DALI CPU (' + str(a.threads) + ' threads)':<34} {rate:>10.1f} images/s  "
              f"(median of {a.epochs} epochs; {images} images in {seconds:.2f} s, DALI {dali.__version__})")


if __name__ == "__main__":
    main()
