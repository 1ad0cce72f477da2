#!/usr/bin/env python3
"""pinfeed through its Python module, over the same dataset and transforms as
pinfeed-bench and torch_dataloader.py: pinfeed.Loader yielding torch tensors
(zero-copy from the pool slot), threads = cores. Prints images/s in the same
table format, or JSON with --json. Needs build/<preset>/python on PYTHONPATH.
"""
import argparse
import json
import os

import pinfeed

from epoch_timer import time_epochs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, help="ImageFolder root, file list or shards")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--crop", choices=["random", "center", "full"], default="random")
    p.add_argument("--layout", choices=["nchw-f32", "nhwc-u8"], default="nchw-f32")
    p.add_argument("--epochs", type=int, default=3, help="measured epochs; the median epoch rate is reported")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    loader = pinfeed.Loader(a.data, batch_size=a.batch, transform=a.crop, size=a.size, layout=a.layout,
                            threads=a.threads, shuffle=True)
    images, seconds, rate = time_epochs(loader, a.epochs, before_epoch=lambda e: loader.set_epoch(e + 1))
    if a.json:
        print(json.dumps({"loader": "pinfeed-python", "threads": a.threads, "images": images, "seconds": seconds,
                          "images_per_s": rate}))
    else:
        print(f"  {'pinfeed via Python (' + str(a.threads) + ' threads)':<34} {rate:>10.1f} images/s  "
              f"(median of {a.epochs} epochs; {images} images in {seconds:.2f} s)")


if __name__ == "__main__":
    main()
