"""Images/s through Python into device memory: pinfeed.Loader(device=...)
against the old way (CPU tensors over the slots, then
.to(device, non_blocking=True)) and against the same loader into host
memory alone (the same uint8 decode device= does, no copy: the feed's
ceiling), in alternating rounds, medians printed.

    PYTHONPATH=build/release/python python3 bench/python_device_bench.py DATA [--device cuda] [--json]

DATA is an ImageFolder (pinfeed-data make). On a machine without a GPU,
--device cpu runs the same mechanism on the CPU backend (a smoke run, not a
GPU figure)."""
import argparse
import json
import statistics
import time

import torch

import pinfeed


def epoch_rate(loader, device, by_hand, host_only=False):
    n = 0
    sync = torch.cuda.synchronize if device.startswith("cuda") and not host_only else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for images, labels in loader:
        if by_hand:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
        n += images.shape[0]
    sync()
    return n / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    kw = dict(batch_size=a.batch_size, size=a.size, threads=a.threads, transform="random", shuffle=True, drop_last=True)
    if a.device.startswith("cuda"):
        torch.cuda.init()  # so that the by-hand path fences its slots on torch's stream
    by_hand = pinfeed.Loader(a.data, **kw)
    feed = pinfeed.Loader(a.data, device=a.device, **kw)
    # What device= does on the host: decode to uint8 (it normalizes on the
    # device). Into host memory alone, that is the feed's ceiling.
    host = pinfeed.Loader(a.data, layout="nhwc-u8", **kw)
    rates = {"by_hand": [], "device": [], "host": []}
    for _ in range(a.rounds):
        rates["by_hand"].append(epoch_rate(by_hand, a.device, True))
        rates["device"].append(epoch_rate(feed, a.device, False))
        rates["host"].append(epoch_rate(host, a.device, False, host_only=True))
    stats = feed.stats()["device"]
    out = {
        "device": stats["device"],
        "images_per_second_device": statistics.median(rates["device"]),
        "images_per_second_by_hand": statistics.median(rates["by_hand"]),
        "images_per_second_host": statistics.median(rates["host"]),
        "device_over_by_hand": statistics.median(rates["device"]) / statistics.median(rates["by_hand"]),
        "device_over_host": statistics.median(rates["device"]) / statistics.median(rates["host"]),
        "bytes_per_image_copied": stats["bytes"] / max(1, stats["batches"] * a.batch_size),
        "device_buffers": stats["device_buffers"],
        "rounds": rates,
    }
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['device']}: device= {out['images_per_second_device']:.0f} images/s, "
              f"slots + .to(non_blocking=True) {out['images_per_second_by_hand']:.0f} images/s "
              f"(ratio {out['device_over_by_hand']:.2f}), to host memory alone {out['images_per_second_host']:.0f} "
              f"images/s (device= at {out['device_over_host']:.2f} of it); {out['bytes_per_image_copied']:.0f} "
              f"bytes copied per image "
              f"(uint8, normalized on the device), {out['device_buffers']} device buffers")


if __name__ == "__main__":
    main()
