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
memory. Under torchrun, mpirun or srun (or with torch.distributed initialized)
the rank and world size come from the launch: see pinfeed.launch_env().
"""

import json
import numbers
import os
import warnings

import torch
from torch.utils.dlpack import from_dlpack

from . import _pinfeed
from ._pinfeed import ConfigError, DataError, Error

__all__ = ["Loader", "diag", "launch_env", "set_log_level", "Error", "ConfigError", "DataError"]
__version__ = "0.1.0"

# The loader's options, declared once in C++ (loader/include/pinfeed/loader/
# options.hpp): the keyword defaults below, the checks and the docstring's
# option list all come from that table.
_OPTIONS = {o["name"]: o for o in _pinfeed.loader_options()}
_IMAGENET_MEAN, _IMAGENET_STD = _pinfeed.default_normalization()
_LAYOUT_ALIASES = {"float32": "nchw-f32", "uint8": "nhwc-u8"}


def _default(name):
    return _OPTIONS[name]["default"]


def launch_env():
    """Where this process sits in a launch, as a dict: rank, world_size,
    local_rank, local_world_size, launcher and source. From, in this order,
    torch.distributed when it is initialized, torchrun's RANK/WORLD_SIZE/
    LOCAL_RANK/LOCAL_WORLD_SIZE, OpenMPI's OMPI_COMM_WORLD_*, PMI_*, and an
    srun step's SLURM_* variables: the reader pinfeed-train uses. Sources
    that disagree raise pinfeed.ConfigError naming both."""
    group = None
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        group = (dist.get_rank(), dist.get_world_size())
    return dict(_pinfeed.launch_env(group))


def _int_arg(name, value, lo, hi):
    """An integer argument within [lo, hi], or ValueError/TypeError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__} ({value!r})")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _options_doc():
    lines = []
    for o in _OPTIONS.values():
        lines.append(f"    {o['name']}={o['default']!r}: {o['help']} ({o['range']})")
    return "\n".join(lines)


def _triple(name, value):
    """Three finite numbers (R, G, B), or ValueError/TypeError naming the argument."""
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{name} must be 3 numbers (R, G, B), not {type(value).__name__}") from None
    if len(items) != 3:
        raise ValueError(f"{name} must have 3 values (R, G, B), got {len(items)}")
    out = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be 3 numbers (R, G, B), got {value!r}")
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"{name} must be finite numbers, got {value!r}")
        out.append(float(v))
    return out




class Loader:
    """An iterable over (images, labels) batches, like torch.utils.data.DataLoader
    with a DistributedSampler.

    data: an ImageFolder root, a file list ("relative/path label" lines), or
        tar shards ("train-{000000..000099}.tar").
    transform: "random" (RandomResizedCrop + horizontal flip), "center"
        (Resize(resize) + CenterCrop(size)) or "full" (the whole image resized).
    layout: "nchw-f32" (normalized with mean/std, float32) or "nhwc-u8" (uint8,
        to normalize on the GPU).
    rank, world_size: the shard; default from the launch (pinfeed.launch_env():
        torch.distributed, torchrun, mpirun, srun), else 0 of 1. The local
        rank is kept as `loader.local_rank`: the GPU this process feeds
        (`images.cuda(loader.local_rank, non_blocking=True)`); the local world
        size splits this host's pinned budget and, with threads=0, its cores.
    pin_memory: "auto" (pin within the host's budget, pageable beyond it or
        under memory pressure), True (the same, but a RuntimeWarning names the
        reason when fewer slots than `prefetch` can be pinned), "require"
        (raise pinfeed.ConfigError instead), or False (pageable). Ranks on one
        host (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE,
        an srun step's SLURM_STEP_TASKS_PER_NODE) split the host's pinned budget between them.
    bad_sample: "replace" (a deterministic substitute, logged and counted) or
        "fail" (raise pinfeed.DataError naming the file). With "replace" the
        epoch still fails once more than `max_replaced_share` (default 1%) of
        it (at least one sample) was replaced, or when every sample of a class
        failed to decode.
    max_classes: a label at or over it refuses the dataset (default 1,000,000).
    copy: yield tensors that own their memory (the slot is returned at once).
    return_indices: yield (images, labels, indices) with the dataset indices.

    Any other loader option of the table below is a keyword argument too
    (scale_min=0.25, ratio_max=2.0, max_replacements=4, ...).

    Waiting for a batch never blocks Ctrl-C: KeyboardInterrupt comes within
    ~50 ms and the loader stays usable. One iteration runs at a time: iter()
    restarts the epoch, and an older iterator that is asked for more raises
    RuntimeError instead of taking the new run's batches.
    """

    def __init__(self, data, batch_size=_default("batch_size"), *, transform=_default("crop"),
                 size=_default("size"), resize=_default("resize"), flip=_default("flip"), layout=_default("layout"),
                 mean=_IMAGENET_MEAN, std=_IMAGENET_STD, rank=None, world_size=None, seed=_default("seed"),
                 shuffle=_default("shuffle"), drop_last=_default("drop_last"),
                 drop_last_batch=_default("drop_last_batch"), threads=_default("threads"),
                 prefetch=_default("prefetch"), pin_memory="auto", bad_sample=_default("bad_sample"), copy=False,
                 return_indices=False, list_root=None, local_rank=None, max_classes=_default("max_classes"),
                 max_replaced_share=_default("max_replaced_share"), **options):
        if not isinstance(data, (str, os.PathLike)):
            raise TypeError(f"data must be a path or a shard pattern, not {type(data).__name__}")
        if not any(pin_memory is v for v in (True, False)) and pin_memory not in ("auto", "require"):
            raise ValueError(f"pin_memory must be 'auto', True, 'require' or False, got {pin_memory!r}")
        crops = _OPTIONS["crop"]["choices"]
        if not isinstance(transform, str) or transform not in crops:
            raise ValueError(f"transform must be one of {crops}, got {transform!r}")
        for name in options:
            if name not in _OPTIONS or name in ("crop", "pin", "require_pinned"):
                raise TypeError(f"Loader() got an unexpected keyword argument {name!r}")
        if isinstance(layout, str):
            layout = _LAYOUT_ALIASES.get(layout, layout)
        mean, std = _triple("mean", mean), _triple("std", std)
        if any(v <= 0 for v in std):
            raise ValueError(f"std must be positive, got {std!r}")
        if rank is None or world_size is None or local_rank is None or "local_ranks" not in options:
            env = launch_env()
            rank = env["rank"] if rank is None else rank
            world_size = env["world_size"] if world_size is None else world_size
            local_rank = env["local_rank"] if local_rank is None else local_rank
            # Ranks on this host split its memory and (threads=0) its cores.
            options.setdefault("local_ranks", env["local_world_size"])
        rank = _int_arg("rank", rank, 0, 2**31 - 1)
        world_size = _int_arg("world_size", world_size, 1, 2**31 - 1)
        self.local_rank = _int_arg("local_rank", local_rank, 0, 2**31 - 1)
        if not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        # Ranges, types and choices of the table's options are checked in C++
        # (ConfigError is a ValueError; a wrong type is a TypeError), named.
        self._impl = _pinfeed.Loader({
            "dataset": os.fspath(data), "list_root": None if list_root is None else os.fspath(list_root),
            "rank": rank, "world_size": world_size, "mean": list(mean), "std": list(std),
            "batch_size": batch_size, "threads": threads, "prefetch": prefetch, "shuffle": shuffle,
            "drop_last": drop_last, "drop_last_batch": drop_last_batch, "seed": seed, "crop": transform,
            "size": size, "resize": resize, "flip": flip, "layout": layout, "bad_sample": bad_sample,
            "pin": pin_memory is not False, "require_pinned": pin_memory == "require",
            "max_classes": max_classes, "max_replaced_share": max_replaced_share, **options,
        })
        self.batch_size = batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.copy, self.return_indices = copy, return_indices
        self.pin_memory = pin_memory
        self._epoch = 0
        self._resume = None
        self._active = None  # the running iteration's token
        if pin_memory is True:
            report = self._impl.pin_report()
            if report["pinned_slots"] < report["slots"]:
                warnings.warn(f"pinfeed: pin_memory=True, but {report['reason']}; the other slots are pageable "
                              "(pin_memory='require' makes this an error)", RuntimeWarning, stacklevel=2)

    def pin_report(self):
        """How the pool was pinned: slots, pinned_slots, budget_bytes, limiting, local_ranks, reason."""
        return dict(self._impl.pin_report())

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
        # One epoch runs at a time: a new iteration supersedes an older one,
        # which raises RuntimeError if asked for more instead of silently
        # taking batches of the new run.
        self._start()
        token = object()
        self._active = token
        return self._batches(token)

    def _start(self):
        if self._resume is not None:
            s, self._resume = self._resume, None
            self._impl.restore(s["seed"], s["epoch"], s["position"], s["world_size"], s["rank"])
            self._epoch = s["epoch"]
        else:
            self._impl.begin_epoch(self._epoch)

    def _batches(self, token):
        try:
            while True:
                if self._active is not token:
                    raise RuntimeError("this iterator of a pinfeed.Loader was superseded: iter() was called again on "
                                       "the loader, which restarted the epoch there. One iteration runs at a time; "
                                       "use the newest iterator")
                item = self._impl.next()
                if item is None:
                    return
                images_capsule, labels_capsule, indices, pinned = item
                images, labels = from_dlpack(images_capsule), from_dlpack(labels_capsule)
                del images_capsule, labels_capsule
                if self.copy:
                    images, labels = images.clone(), labels.clone()  # the slot goes back now
                yield (images, labels, indices) if self.return_indices else (images, labels)
        finally:
            if self._active is token:
                self._active = None

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




if Loader.__doc__ is not None:  # None under python -OO
    Loader.__doc__ += "\n    The loader's options (name=default: what; range), from its table:\n\n" + _options_doc() + "\n"

def set_log_level(level):
    """pinfeed's own log on stderr: "trace", "debug", "info", "warning" (the default), "error", "off"."""
    _pinfeed.set_log_level({"warning": "warn"}.get(level, level))


set_log_level("warning")


def diag(root="/", gpus=1, batch=None, prefetch=2, sample_ms=100):
    """The memory diagnostics report of `pinfeed-diag --json`, as a dict. With
    batch="256x3x224x224:u8" it includes the pinned pool plan and its verdict."""
    return json.loads(_pinfeed.diag_json(os.fspath(root), gpus, batch or "", prefetch, sample_ms))
