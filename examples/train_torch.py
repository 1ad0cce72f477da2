#!/usr/bin/env python3
"""Train a small CNN with PyTorch, fed by pinfeed's loader — and, with
--also-torch, again with torch's DataLoader on the same data — printing the
throughput of both. The only line a training script changes is the loader's
construction (see `make_loader`); under torchrun, mpirun or srun, pinfeed
reads the rank and world size itself (pinfeed.launch_env()). For DDP across
processes, see examples/ddp_torchrun.py.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/train_torch.py \\
        --data build/demo-data/train --epochs 3 --also-torch
"""
import argparse
import os
import time

import torch
from torch import nn


def make_loader(kind, data, batch, size, workers):
    if kind == "pinfeed":
        import pinfeed
        # was: DataLoader(ImageFolder(data, RandomResizedCrop+Flip+ToTensor+Normalize), batch_size=batch,
        #                 shuffle=True, num_workers=workers, pin_memory=True)
        return pinfeed.Loader(data, batch_size=batch, shuffle=True, transform="random", size=size, threads=workers,
                              drop_last=True)
    import torchvision
    from torchvision import transforms
    tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    return torch.utils.data.DataLoader(torchvision.datasets.ImageFolder(data, transform=tf), batch_size=batch,
                                       shuffle=True, num_workers=workers, drop_last=True,
                                       pin_memory=torch.cuda.is_available(), persistent_workers=True)


def model_for(classes):
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def train(kind, a, device):
    torch.manual_seed(0)
    loader = make_loader(kind, a.data, a.batch, a.size, a.workers)
    classes = len(os.listdir(a.data))
    model = model_for(classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    rates = []
    for epoch in range(a.epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        t0, seen, loss_sum, correct = time.perf_counter(), 0, 0.0, 0
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(images)
            loss = nn.functional.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += labels.shape[0]
            loss_sum += loss.item() * labels.shape[0]
            correct += (logits.argmax(1) == labels).sum().item()
        rate = seen / (time.perf_counter() - t0)
        rates.append(rate)
        print(f"{kind:>8} epoch {epoch + 1}: loss {loss_sum / seen:.4f}  accuracy {100 * correct / seen:.1f}%  "
              f"{rate:.0f} images/s")
    return sorted(rates)[len(rates) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--also-torch", action="store_true", help="train again with torch's DataLoader and compare")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    ours = train("pinfeed", a, device)
    print(f"pinfeed: {ours:.0f} images/s (median epoch) on {device}")
    if a.also_torch:
        theirs = train("torch", a, device)
        print(f"torch DataLoader: {theirs:.0f} images/s (median epoch); pinfeed / torch = {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
