#!/usr/bin/env python3
"""PyTorch's DataLoader over the same dataset and transforms as pinfeed-bench.

torchvision ImageFolder + RandomResizedCrop(224) + RandomHorizontalFlip +
ToTensor + Normalize (or Resize(256) + CenterCrop(224)), num_workers = cores,
pin_memory as a training job would set it. Prints images/s as a table line,
or JSON with --json. Uses Debian's python3-torch / python3-torchvision.
"""
import argparse
import json
import os

import torch
import torchvision
from torchvision import transforms

from epoch_timer import time_epochs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--crop", choices=["random", "center"], default="random")
    p.add_argument("--epochs", type=int, default=3, help="measured epochs; the median epoch rate is reported")
    p.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    if a.crop == "random":
        tf = transforms.Compose([transforms.RandomResizedCrop(a.size), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor(), normalize])
    else:
        tf = transforms.Compose([transforms.Resize(a.size * 256 // 224), transforms.CenterCrop(a.size),
                                 transforms.ToTensor(), normalize])
    ds = torchvision.datasets.ImageFolder(a.data, transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                     pin_memory=a.pin_memory and torch.cuda.is_available(),
                                     persistent_workers=a.workers > 0)
    images, seconds, rate = time_epochs(dl, a.epochs)
    if a.json:
        print(json.dumps({"loader": "pytorch", "torch": torch.__version__, "workers": a.workers,
                          "images": images, "seconds": seconds, "images_per_s": rate}))
    else:
        print(f"  {'pytorch DataLoader (' + str(a.workers) + ' workers)':<34} {rate:>10.1f} images/s  "
              f"(median of {a.epochs} epochs; {images} images in {seconds:.2f} s, torch {torch.__version__})")


if __name__ == "__main__":
    main()
