"""pinfeed: a drop-in, pinned-memory-safe image loader for PyTorch training.

    import pinfeed
    loader = pinfeed.Loader("data/train", batch_size=256, transform="random", threads=8)
    for epoch in range(epochs):
        loader.set_epoch(epoch)              # like DistributedSampler.set_epoch
        for images, labels in loader:        # torch tensors: float32 NCHW (or uint8 NHWC), int64
            images = images.cuda(non_blocking=True)
            ...

Tensors are zero-copy views of the loader's pool slot (page-locked when the
host can afford it). The slot goes back to the pool when the last tensor made
from the batch is freed, so keep at most `prefetch - 1` batches alive at a
time (the usual loop does), or pass copy=True to get tensors that own their
memory. Under torchrun the rank and world size come from RANK and WORLD_SIZE.
"""

import json
import os

import torch
from torch.utils.dlpack import from_dlpack

from . import _pinfeed
from ._pinfeed import ConfigError, DataError, Error

__all__ = ["Loader", "diag", "set_log_level", "Error", "ConfigError", "DataError"]
__version__ = "0.1.0"

_LAYOUTS = {"nchw-f32": "nchw-f32", "float32": "nchw-f32", "nhwc-u8": "nhwc-u8", "uint8": "nhwc-u8"}
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def _env_int(name):
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


class Loader:
    """An iterable over (images, labels) batches, like torch.utils.data.DataLoader
    with a DistributedSampler.

    data: an ImageFolder root, a file list ("relative/path label" lines), or
        tar shards ("train-{000000..000099}.tar").
    transform: "random" (RandomResizedCrop + horizontal flip), "center"
        (Resize(resize) + CenterCrop(size)) or "full" (the whole image resized).
    layout: "nchw-f32" (normalized with mean/std, float32) or "nhwc-u8" (uint8,
        to normalize on the GPU).
    rank, world_size: the shard; default RANK / WORLD_SIZE from the
        environment (torchrun), else 0 of 1. LOCAL_RANK is read too and kept
        as `loader.local_rank`: the GPU this process feeds
        (`images.cuda(loader.local_rank, non_blocking=True)`).
    pin_memory: "auto" (pin within the host's budget, pageable beyond it or
        under memory pressure), True (the same, but say so when it cannot pin),
        or False (pageable).
    bad_sample: "replace" (a deterministic substitute, logged and counted) or
        "fail" (raise pinfeed.DataError naming the file).
    copy: yield tensors that own their memory (the slot is returned at once).
    return_indices: yield (images, labels, indices) with the dataset indices.
    """

    def __init__(self, data, batch_size=64, *, transform="random", size=224, resize=256, flip=True,
                 layout="nchw-f32", mean=_IMAGENET_MEAN, std=_IMAGENET_STD, rank=None, world_size=None,
                 seed=0, shuffle=True, drop_last=False, drop_last_batch=False, threads=0, prefetch=4,
                 pin_memory="auto", bad_sample="replace", copy=False, return_indices=False, list_root=None,
                 local_rank=None):
        if not isinstance(data, (str, os.PathLike)):
            raise TypeError(f"data must be a path or a shard pattern, not {type(data).__name__}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
        if pin_memory not in ("auto", True, False):
            raise ValueError(f"pin_memory must be 'auto', True or False, got {pin_memory!r}")
        if rank is None:
            rank = _env_int("RANK") or 0
        if world_size is None:
            world_size = _env_int("WORLD_SIZE") or 1
        if local_rank is None:
            local_rank = _env_int("LOCAL_RANK") or 0
        self.local_rank = local_rank
        if not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.batch_size = batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.copy, self.return_indices = copy, return_indices
        self.pin_memory = pin_memory
        self._epoch = 0
        self._resume = None
        self._impl = _pinfeed.Loader({
            "dataset": os.fspath(data), "list_root": None if list_root is None else os.fspath(list_root),
            "batch_size": batch_size, "threads": threads, "prefetch": prefetch, "rank": rank,
            "world_size": world_size, "shuffle": shuffle, "drop_last": drop_last,
            "drop_last_batch": drop_last_batch, "seed": seed, "crop": transform, "size": size,
            "resize": resize, "flip": flip, "layout": _LAYOUTS[layout], "mean": list(mean), "std": list(std),
            "bad_sample": bad_sample, "pin": pin_memory is not False, "watch_pressure": True,
        })

    def set_epoch(self, epoch):
        """The epoch the next iteration runs (its shuffle and augmentation)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._epoch = epoch

    def __len__(self):
        return self._impl.batches_per_epoch()

    @property
    def num_classes(self):
        return self._impl.num_classes()

    def __iter__(self):
        if self._resume is not None:
            s, self._resume = self._resume, None
            self._impl.restore(s["seed"], s["epoch"], s["position"], s["world_size"], s["rank"])
            self._epoch = s["epoch"]
        else:
            self._impl.begin_epoch(self._epoch)
        while True:
            item = self._impl.next()
            if item is None:
                return
            images_capsule, labels_capsule, indices, pinned = item
            images, labels = from_dlpack(images_capsule), from_dlpack(labels_capsule)
            del images_capsule, labels_capsule
            if self.copy:
                images, labels = images.clone(), labels.clone()  # the slot goes back now
            yield (images, labels, indices) if self.return_indices else (images, labels)

    def state_dict(self):
        """Where the current epoch stands: load_state_dict() continues from here."""
        return dict(self._impl.state())

    def load_state_dict(self, state):
        missing = {"seed", "epoch", "position", "world_size", "rank"} - set(state)
        if missing:
            raise ValueError(f"state_dict lacks {sorted(missing)}")
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise ValueError(f"state_dict is for rank {state['rank']} of {state['world_size']}, "
                             f"this loader is rank {self.rank} of {self.world_size}")
        self._resume = dict(state)

    def stats(self):
        """The current epoch's stats: images/s, stage times, pool and pressure state."""
        return json.loads(self._impl.stats_json())

    def live_batches(self):
        """Batches whose tensors are still alive (each holds a pool slot)."""
        return self._impl.live_batches()


def set_log_level(level):
    """pinfeed's own log on stderr: "trace", "debug", "info", "warning" (the default), "error", "off"."""
    _pinfeed.set_log_level({"warning": "warn"}.get(level, level))


set_log_level("warning")


def diag(root="/", gpus=1, batch=None, prefetch=2, sample_ms=100):
    """The memory diagnostics report of `pinfeed-diag --json`, as a dict. With
    batch="256x3x224x224:u8" it includes the pinned pool plan and its verdict."""
    return json.loads(_pinfeed.diag_json(os.fspath(root), gpus, batch or "", prefetch, sample_ms))
