"""DataLoader compatibility: its argument names mapped onto Loader's, and
its arguments Loader does not take, refused with what to use instead."""

import os
import warnings

from ._options import _KEYWORD_FOR, _OPTIONS, _prefetch_from_factor, _threads_from_num_workers


# DataLoader's names for Loader's keywords: DataLoader's name -> (Loader's
# keyword, what that is, the conversion).
_DATALOADER_ALIASES = {
    "num_workers": ("threads", "decode threads", _threads_from_num_workers),
    "prefetch_factor": ("prefetch", "pool slots", _prefetch_from_factor),
}


_warned_num_workers = False


# DataLoader's arguments Loader does not take, and what to use instead; at
# DataLoader's default value (forwarded **loader_kwargs) they are accepted.
_DATALOADER_DEFAULTS = {"collate_fn": None, "batch_sampler": None, "worker_init_fn": None, "generator": None,
                        "timeout": 0, "multiprocessing_context": None, "pin_memory_device": "", "in_order": True}
_INSTEAD = {
    "collate_fn": "samples are written straight into their batch in C++; post-process each batch with "
                  "batch_fn=callable(images, labels[, indices][, paths]) -> anything, or batch_transform= for the "
                  "images alone",
    "batch_sampler": "pass its sampler as sampler= and its batch size as batch_size= (drop_last= as well)",
    "worker_init_fn": "there are no worker processes: the decode threads run C++ only; seed= fixes the order and "
                      "the augmentation",
    "generator": "the order and the augmentation come from seed= (and the epoch); a torch sampler with its own "
                 "generator is iterated as it is (sampler=)",
    "timeout": "a batch that cannot be decoded is replaced or raises pinfeed.DataError (bad_sample=), and Ctrl-C "
               "interrupts a wait within ~50 ms",
    "multiprocessing_context": "there are no worker processes (decode threads in this process)",
    "pin_memory_device": "device= copies each batch to that device on the loader's own stream",
    "in_order": "batches always come in order",
}


def _check_arguments(data, pin_memory, transform, persistent_workers, options):
    """The arguments Loader checks itself (the table's options are checked in C++)."""
    if not isinstance(data, (str, os.PathLike)):
        root = getattr(data, "root", None)
        hint = f" (this one's root is {root!r}: data={root!r})" if isinstance(root, (str, os.PathLike)) else ""
        raise TypeError(f"data must be a path (an ImageFolder root, a file list, or tar shards), not "
                        f"{type(data).__name__}: pinfeed reads and decodes the files itself, so a Dataset object's "
                        f"__getitem__ is not used; pass the folder it reads{hint}")
    if not any(pin_memory is v for v in (True, False)) and pin_memory not in ("auto", "require"):
        raise ValueError(f"pin_memory must be 'auto', True, 'require' or False, got {pin_memory!r}")
    crops = _OPTIONS["crop"]["choices"]
    if callable(transform):
        raise TypeError(f"transform= takes one of {crops} (decoded, cropped and resized in C++ on every core), not "
                        f"a Python callable ({type(transform).__name__}): per-sample Python would run on one thread. "
                        "Run Python transforms on whole batches with batch_transform= (torchvision.transforms.v2 "
                        "and kornia ops take batches; on the GPU with device=)")
    if not isinstance(transform, str) or transform not in crops:
        raise ValueError(f"transform must be one of {crops}, got {transform!r}")
    for name in options:
        if name == "drop_last_batch":
            raise TypeError("drop_last_batch is now drop_last (DataLoader's meaning: drop the last incomplete "
                            "batch); the sampler's trim is DistributedSampler(drop_last=True)")
        if name in _INSTEAD:
            value, default = options[name], _DATALOADER_DEFAULTS[name]
            if value is default or (not callable(value) and value == default):
                continue
            raise TypeError(f"Loader() does not take DataLoader's {name}=: {_INSTEAD[name]}")
        if name in _KEYWORD_FOR:
            raise TypeError(f"Loader() got an unexpected keyword argument {name!r}: Loader takes it as "
                            f"{_KEYWORD_FOR[name]}")
        if name not in _OPTIONS:
            raise TypeError(f"Loader() got an unexpected keyword argument {name!r}")
    for name in _INSTEAD:
        options.pop(name, None)  # accepted at DataLoader's default: nothing to do
    if not isinstance(persistent_workers, bool):
        raise TypeError(f"persistent_workers must be True or False, not {persistent_workers!r}")


def _dataloader_alias(alias, value, mine):
    """Loader's keyword from DataLoader's name for it (num_workers, prefetch_factor)."""
    global _warned_num_workers
    if value is None:
        return mine
    keyword, what, convert = _DATALOADER_ALIASES[alias]
    if mine is not None:
        raise TypeError(f"pass {keyword} ({what}) or {alias} (its DataLoader name), not both")
    converted = convert(value)
    if alias == "num_workers" and not _warned_num_workers:
        # DataLoader's workers are processes; pinfeed's are decode threads.
        _warned_num_workers = True
        zero = (" num_workers=0 (DataLoader: load in the main process) is pinfeed's automatic choice: this "
                "process's share of the cores" if converted == 0 else "")
        warnings.warn(f"pinfeed: num_workers={converted} is taken as threads={converted}: pinfeed decodes on "
                      f"threads of this process, not in worker processes.{zero}", UserWarning, stacklevel=3)
    return converted
