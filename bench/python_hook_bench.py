"""What a Python batch hook costs: pinfeed.Loader's images/s with no hook,
with batch_transform=identity (the call itself), and with torchvision ops on
each CPU batch (flip + normalize), in alternating rounds; plus the hook's own
time per batch, timed inside it. Medians printed.

    PYTHONPATH=build/release/python /usr/bin/python3 bench/python_hook_bench.py DATA [--rounds 5] [--json]

DATA is an ImageFolder (pinfeed-data make). The hook runs on the thread that
iterates, while the decode threads keep filling the pool: it slows the loop
by its own time only where the loop, not decoding, is the bottleneck."""
import argparse
import json
import statistics
import time

import torch

import pinfeed


def tv_ops():
    import torchvision.transforms as T  # pylint: disable=import-outside-toplevel
    return T.Compose([T.RandomHorizontalFlip(p=0.5), T.Normalize(mean=[0.0] * 3, std=[1.0] * 3)])


def run(data, args, hook):
    spent = []

    def timed(images):
        t0 = time.perf_counter()
        out = hook(images)
        spent.append(time.perf_counter() - t0)
        return out
    loader = pinfeed.Loader(data, batch_size=args.batch_size, size=args.size, threads=args.threads, shuffle=True,
                            transform="random", batch_transform=None if hook is None else timed)
    n, t0 = 0, time.perf_counter()
    for images, _ in loader:
        n += images.shape[0]
    rate = n / (time.perf_counter() - t0)
    return rate, (statistics.median(spent) * 1e3 if spent else 0.0), len(spent)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)  # the hook's ops on the iterating thread only: the cores decode
    ways = {"none": None, "identity": lambda x: x, "torchvision flip+normalize": tv_ops()}
    rates = {k: [] for k in ways}
    hook_ms = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, hook in ways.items():
            rate, ms, _ = run(args.data, args, hook)
            rates[name].append(rate)
            hook_ms[name].append(ms)
    out = {name: {"images_per_s": statistics.median(rates[name]), "hook_ms_per_batch": statistics.median(hook_ms[name])}
           for name in ways}
    base = out["none"]["images_per_s"]
    for name, o in out.items():
        o["ratio_to_none"] = o["images_per_s"] / base
    if args.json:
        print(json.dumps(dict(batch_size=args.batch_size, size=args.size, rounds=args.rounds, ways=out)))
        return
    print(f"batch {args.batch_size} x {args.size} px, {args.rounds} alternating rounds, medians")
    for name, o in out.items():
        print(f"  {name:<28} {o['images_per_s']:8.1f} images/s  ({o['ratio_to_none']:.3f}x)  "
              f"hook {o['hook_ms_per_batch'] * 1e3:9.1f} us per batch")


if __name__ == "__main__":
    main()
