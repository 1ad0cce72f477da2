#!/usr/bin/env python3
"""FFCV 1.0.2's Loader over the same dataset and transforms as pinfeed-bench
and torch_dataloader.py, for bench/peers/compare.sh.

The ImageFolder is first written to a .beton (once, next to --beton) whose
image field holds each file's original JPEG bytes: FFCV's own writer would
decode and re-encode them, and every loader must decode the same files.
Pipeline: RandomResizedCropRGBImageDecoder (or CenterCropRGBImageDecoder with
ratio 224/256), RandomHorizontalFlip, NormalizeImage to float32, ToTensor,
ToTorchImage (NCHW). ImageNet example's order puts NormalizeImage after
ToTorchImage; on the CPU that order hangs in the Loader's constructor
(FFCV 1.0.2), so the uint8 array is normalized first. Order RANDOM, os_cache.
Runs in its own venv (compare.sh builds it on first use).
"""
import argparse
import importlib.metadata
import json
import os
from pathlib import Path

import numpy as np
import torch
from ffcv.fields import IntField, RGBImageField
from ffcv.fields.basics import IntDecoder
from ffcv.fields.rgb_image import (CenterCropRGBImageDecoder, IMAGE_MODES,
                                   RandomResizedCropRGBImageDecoder)
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor, ToTorchImage
from ffcv.writer import DatasetWriter
from PIL import Image

from epoch_timer import time_epochs

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255


class OriginalJpegField(RGBImageField):
    """RGBImageField storing a file's bytes as they are (mode 'jpg'); FFCV's
    decoders read them as any JPEG it wrote itself."""

    def encode(self, destination, item, malloc):
        data, width, height = item
        destination["mode"] = IMAGE_MODES["jpg"]
        destination["height"], destination["width"] = height, width
        destination["data_ptr"], storage = malloc(data.nbytes)
        storage[:] = data


class Folder:
    """ImageFolder's order: sorted class folders, sorted files."""

    def __init__(self, root: str) -> None:
        classes = sorted(d.name for d in Path(root).iterdir() if d.is_dir())
        self.items = [(f, c) for c, name in enumerate(classes)
                      for f in sorted((Path(root) / name).iterdir()) if f.is_file()]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        with Image.open(path) as im:
            width, height = im.size
        return (data, width, height), label


def write_beton(root: str, beton: Path) -> None:
    folder = Folder(root)
    for path, _ in folder.items:  # checked here: an error in the writer's workers would hang it
        with open(path, "rb") as f:
            if f.read(2) != b"\xff\xd8":
                raise SystemExit(f"ffcv_loader: {path} is not a JPEG: FFCV decodes only JPEG and the .beton holds "
                                 "the files as they are (compare.sh --peers dali,torch for other formats)")
    beton.parent.mkdir(parents=True, exist_ok=True)
    tmp = beton.with_suffix(".part")
    DatasetWriter(str(tmp), {"image": OriginalJpegField(write_mode="jpg"), "label": IntField()},
                  num_workers=1).from_indexed_dataset(folder)
    tmp.rename(beton)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--beton", required=True, help="where the .beton of --data is kept (written if missing)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--crop", choices=["random", "center"], default="random")
    p.add_argument("--epochs", type=int, default=3, help="measured epochs; the median epoch rate is reported")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    beton = Path(a.beton)
    if not beton.exists():
        write_beton(a.data, beton)
    if a.crop == "random":
        decode = [RandomResizedCropRGBImageDecoder((a.size, a.size)), RandomHorizontalFlip()]
    else:
        decode = [CenterCropRGBImageDecoder((a.size, a.size), ratio=224 / 256)]
    image = decode + [NormalizeImage(MEAN, STD, np.float32), ToTensor(), ToTorchImage(channels_last=False)]
    loader = Loader(str(beton), batch_size=a.batch, num_workers=a.workers, order=OrderOption.RANDOM,
                    os_cache=True, drop_last=False, custom_fields={"image": OriginalJpegField},
                    pipelines={"image": image, "label": [IntDecoder(), ToTensor()]})

    images, seconds, rate = time_epochs(loader, a.epochs)  # warm-up included: numba compiles there
    version = importlib.metadata.version("ffcv")  # ffcv.__version__ says 0.0.3rc1 in 1.0.2
    if a.json:
        print(json.dumps({"loader": "ffcv", "ffcv": version, "workers": a.workers, "images": images,
                          "seconds": seconds, "images_per_s": rate, "torch": torch.__version__}))
    else:
        print(f"  {'FFCV (' + str(a.workers) + ' workers)':<34} {rate:>10.1f} images/s  "
              f"(median of {a.epochs} epochs; {images} images in {seconds:.2f} s, FFCV {version})")


if __name__ == "__main__":
    main()
