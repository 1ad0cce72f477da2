#!/usr/bin/env python3
"""Data-parallel training with real PyTorch: torchvision's MobileNetV2 (or
ResNet-18) under torchrun with DistributedDataParallel (gloo on CPUs, NCCL on
GPUs), fed by pinfeed.Loader or by DataLoader + DistributedSampler.

One process per GPU (or per CPU worker):

    torchrun --redirects 9:1 --tee 9:1 --standalone --nproc_per_node 2 examples/ddp_torchrun.py \\
        --data build/demo-data/train --loader pinfeed --epochs 2 --width 0.25 --size 64

(`--redirects 9:1 --tee 9:1`: torch 1.13's torchrun crashes on Python 3.11
without non-zero values; README, "Launching".) Rank 0 prints images/s and the
share of each step spent waiting for data, and appends every step to
--csv.

The question behind the project, answered in one command:

    /usr/bin/python3 examples/ddp_torchrun.py --compare 2 --data build/demo-data/train \\
        --out docs/ddp-torchrun --epochs 3 --width 0.25 --size 64

runs three torchrun launches on the same data with the same global batch:
1 process and N processes fed by pinfeed, and N processes fed by DataLoader
+ DistributedSampler; then writes PREFIX.csv (every step of every run) and
PREFIX.png: the loss curves of 1 vs N processes (the same optimization
problem: the curves should lie on top of each other) and the images/s and
data-wait share of pinfeed against DataLoader.

The learning rate is --lr per 256 samples, scaled linearly with the global
batch (Goyal et al.), so 1 and N processes train with the same rate.
"""
import argparse
import csv
import gc
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="an ImageFolder root (pinfeed-data make writes one)")
    p.add_argument("--loader", choices=["pinfeed", "torch"], default="pinfeed")
    p.add_argument("--model", choices=["mobilenet_v2", "resnet18"], default="mobilenet_v2")
    p.add_argument("--width", type=float, default=1.0, help="MobileNetV2 width multiplier (0.25 on CPUs)")
    p.add_argument("--size", type=int, default=224, help="input height and width (64 on CPUs)")
    p.add_argument("--batch", type=int, default=64, help="global batch: every process gets batch / processes")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: the epoch)")
    p.add_argument("--lr", type=float, default=0.1, help="per 256 samples; the rate used is lr x batch / 256")
    p.add_argument("--workers", type=int, default=0, help="num_workers of either loader (0: pinfeed's share of the "
                                                          "cores; DataLoader gets cores / processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", help="append every step here (rank 0)")
    p.add_argument("--label", default="", help="the run's name in the CSV")
    p.add_argument("--compare", type=int, default=0, metavar="N",
                   help="launch 1 vs N processes (pinfeed) and N processes (DataLoader) with torchrun, then plot")
    p.add_argument("--out", default="ddp-torchrun", help="--compare: PREFIX of the CSV and PNG")
    return p.parse_args()


def make_model(a, classes):
    import torchvision
    if a.model == "resnet18":
        return torchvision.models.resnet18(num_classes=classes)
    return torchvision.models.mobilenet_v2(num_classes=classes, width_mult=a.width)


def make_loader(a, per_rank, rank, world):
    workers = a.workers
    if a.loader == "pinfeed":
        import pinfeed
        # was: DataLoader(ImageFolder(root, RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize),
        #                 batch_size, sampler=DistributedSampler(ds, seed=seed), num_workers, pin_memory, drop_last)
        return pinfeed.Loader(a.data, batch_size=per_rank, sampler=pinfeed.DistributedSampler(shuffle=True, seed=a.seed),
                              num_workers=workers, pin_memory=True, drop_last=True, transform="random", size=a.size)
    import torchvision
    from torchvision import transforms
    tf = transforms.Compose([transforms.RandomResizedCrop(a.size), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(a.data, transform=tf)
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=a.seed)
    if workers == 0:
        workers = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return torch.utils.data.DataLoader(ds, batch_size=per_rank, sampler=sampler, num_workers=workers,
                                       pin_memory=torch.cuda.is_available(), drop_last=True,
                                       persistent_workers=True)


def train(a):
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        run(a, cuda)
    finally:
        # Teardown order: the loader (its decode threads) goes first, then the
        # process group, explicitly, on every exit path. A process group left
        # to the interpreter's exit can hang there in torch's own destructors
        # (~ProcessGroupGloo joining a thread that waits for the GIL: pytorch
        # issues 56297, 109478); bench/teardown_loop.py measures both orders.
        gc.collect()
        dist.destroy_process_group()


def run(a, cuda):
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch} does not divide over {world} processes")
    per_rank = a.batch // world
    loader = make_loader(a, per_rank, rank, world)
    classes = len(loader.classes) if hasattr(loader, "classes") else len(loader.dataset.classes)
    torch.manual_seed(a.seed)  # the same initial weights in every launch (DDP broadcasts rank 0's anyway)
    model = make_model(a, classes).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    lr = a.lr * a.batch / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=4e-5)
    rows = []
    for epoch in range(a.epochs):
        if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        else:
            loader.set_epoch(epoch)
        model.train()
        it = iter(loader)
        steps, images, wait, loss_sum, t_epoch = 0, 0, 0.0, 0.0, time.perf_counter()
        while a.max_steps == 0 or steps < a.max_steps:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t1 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean = mean.item() / world
            t2 = time.perf_counter()
            wait += t1 - t0
            loss_sum += mean
            steps += 1
            images += y.shape[0] * world
            rows.append(dict(label=a.label or f"{a.loader} x{world}", loader=a.loader, processes=world, batch=a.batch,
                             lr=lr, epoch=epoch, step=steps, loss=mean, step_seconds=t2 - t0, wait_seconds=t1 - t0))
        del it
        seconds = time.perf_counter() - t_epoch
        # The slowest rank sets the pace: report the largest wait share.
        share = torch.tensor([wait / max(seconds, 1e-9)])
        dist.all_reduce(share, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"epoch {epoch + 1}/{a.epochs}  loss {loss_sum / max(steps, 1):.4f}  {images / seconds:.0f} img/s  "
                  f"data wait {100 * share.item():.1f}% of each step  ({a.loader}, {world} processes, "
                  f"batch {a.batch}, lr {lr:.4g})", flush=True)
    if rank == 0 and a.csv:
        new = not os.path.exists(a.csv)
        with open(a.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    del loader  # its decode threads end here, before the process group (train's finally)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(a):
    """1 vs N processes (pinfeed), N processes (DataLoader): three torchrun launches, then the plot."""
    csv_path = a.out + ".csv"
    if os.path.exists(csv_path):
        os.remove(csv_path)
    common = ["--data", a.data, "--model", a.model, "--width", str(a.width), "--size", str(a.size), "--batch",
              str(a.batch), "--epochs", str(a.epochs), "--max-steps", str(a.max_steps), "--lr", str(a.lr),
              "--workers", str(a.workers), "--seed", str(a.seed), "--csv", csv_path]
    for n, kind in ((1, "pinfeed"), (a.compare, "pinfeed"), (a.compare, "torch")):
        cmd = ["torchrun", "--redirects", "9:1", "--tee", "9:1", "--master_port", str(free_port()),
               "--nproc_per_node", str(n), os.path.abspath(__file__)] + common + [
                   "--loader", kind, "--label", f"{kind} x{n}"]
        print("==", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    plot(csv_path, a.out + ".png")


def plot(csv_path, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {}
    with open(csv_path) as f:
        for r in csv.DictReader(f):
            runs.setdefault(r["label"], []).append(r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    summary = []
    window = 10  # steps: a running mean, the raw curve faint behind it
    for i, (label, rows) in enumerate(runs.items()):
        if rows[0]["loader"] == "pinfeed":
            loss = [float(r["loss"]) for r in rows]
            smooth = [sum(loss[max(0, k - window + 1):k + 1]) / len(loss[max(0, k - window + 1):k + 1])
                      for k in range(len(loss))]
            left.plot(range(1, len(loss) + 1), loss, color=f"C{i}", alpha=0.25, linewidth=0.8)
            left.plot(range(1, len(loss) + 1), smooth, color=f"C{i}", label=f"{label} (mean of {window} steps)")
        # Throughput and wait share over the steps after the first epoch's first (warm-up) step.
        body = rows[1:] or rows
        seconds = sum(float(r["step_seconds"]) for r in body)
        images = len(body) * int(rows[0]["batch"])
        wait = sum(float(r["wait_seconds"]) for r in body) / max(seconds, 1e-9)
        last = [float(r["loss"]) for r in rows if r["epoch"] == rows[-1]["epoch"]]
        summary.append((label, images / max(seconds, 1e-9), wait, sum(last) / len(last)))
    left.set_xlabel("step (same global batch)")
    left.set_ylabel("training loss (mean over ranks)")
    left.set_title("1 vs N processes, pinfeed.Loader")
    left.legend()
    names = [s[0] for s in summary]
    bars = right.bar(names, [s[1] for s in summary], color=["C0", "C1", "C2"][:len(summary)])
    for b, s in zip(bars, summary):
        right.annotate(f"{s[1]:.0f} img/s\nwait {100 * s[2]:.0f}%", (b.get_x() + b.get_width() / 2, b.get_height()),
                       ha="center", va="bottom", fontsize=9)
    right.set_ylim(0, 1.2 * max(s[1] for s in summary))
    right.set_ylabel("images/s (global)")
    right.set_title("throughput and data-wait share")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    for label, rate, wait, loss in summary:
        print(f"{label:12s} {rate:8.0f} img/s  data wait {100 * wait:5.1f}%  last epoch's mean loss {loss:.4f}")
    print(f"wrote {csv_path} and {png}")


def main():
    a = parse()
    if a.compare:
        compare(a)
    else:
        train(a)


if __name__ == "__main__":
    sys.exit(main())
