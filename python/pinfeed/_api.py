"""The loader's Python side (pinfeed.Loader and friends): imported, with
torch, on first use of any of them through the package (pinfeed/__init__.py),
so that the command-line tools start without torch."""

import array
import contextlib
import gc
import hashlib
import json
import math
import numbers
import operator
import os
import struct
import threading
import warnings

try:
    import torch
    from torch.utils.dlpack import from_dlpack
except ImportError as e:  # an operator's host: the tools work, the loader needs torch
    raise ImportError(f"pinfeed's Loader needs PyTorch (torch >= 1.13), which cannot be imported here ({e}): "
                      "pip install torch, or pip install 'pinfeed[torch]'. The command-line tools "
                      "(pinfeed-diag, pinfeed-data, pinfeed-train, pinfeed-bench) do not need it") from e

from . import _data, _pinfeed
from ._data import FakeData


# The loader's options, declared once in C++ (loader/include/pinfeed/loader/
# options.hpp): the keyword defaults below, the checks and the docstring's
# option list all come from that table.
_OPTIONS = {o["name"]: o for o in _pinfeed.loader_options()}
def _shortest(v):
    """A float32 default as the shortest decimal that is the same float32
    (0.485, not 0.48500001430511475; 1.3333334 for 4/3)."""
    if not isinstance(v, float):
        return v
    exact = struct.pack("f", v)
    for digits in range(1, 10):
        short = float(f"{v:.{digits}g}")
        if struct.pack("f", short) == exact:
            return short
    return v


_IMAGENET_MEAN, _IMAGENET_STD = ([_shortest(v) for v in t] for t in _pinfeed.default_normalization())
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


# The table's options that Loader takes under another keyword (DataLoader's
# and torchvision's words) or through another argument. Passed under the
# table's name they are refused, naming the keyword; the docstring lists them
# under the keyword. The checks, the construction and the docstring read this
# one table.
_KEYWORD_FOR = {
    "crop": "transform",
    "drop_last_batch": "drop_last",
    "drop_last": "sampler=DistributedSampler(drop_last=...)",
    "pin": "pin_memory='auto'",
    "require_pinned": "pin_memory='require'",
}
# Where a keyword of Loader means something else than the table's option of
# the same name (DataLoader's meanings), or has another default.
_PY_NOTES = {
    "shuffle": "Loader's shuffle defaults to False, as DataLoader's",
    "drop_last": "the sampler's trim; Loader's drop_last is the last batch's",
    "prefetch": "or prefetch_factor",
    "threads": "or num_workers",
}


def _options_doc():
    lines = []
    for o in _OPTIONS.values():
        name = o["name"]
        keyword = _KEYWORD_FOR.get(name, name)
        default = o["default"]
        default = [_shortest(v) for v in default] if isinstance(default, list) else _shortest(default)
        shown = keyword if "=" in keyword else f"{keyword}={default!r}"
        note = [_PY_NOTES[name]] if name in _PY_NOTES else []
        if keyword != name:
            note.append(f"the C ABI's and pinfeed-train's {name}, default {default!r}")
        suffix = f" [{'; '.join(note)}]" if note else ""
        lines.append(f"    {shown}: {o['help']} ({o['range']}){suffix}")
    return "\n".join(lines)


def _threads_from_num_workers(value):
    return _int_arg("num_workers", value, 0, _OPTIONS["threads"]["max"])


def _prefetch_from_factor(value):
    # DataLoader's prefetch_factor batches ahead, plus the one the loop holds.
    return _int_arg("prefetch_factor", value, 1, _OPTIONS["prefetch"]["max"] - 1) + 1


# DataLoader's names for Loader's keywords: DataLoader's name -> (Loader's
# keyword, what that is, the conversion).
_DATALOADER_ALIASES = {
    "num_workers": ("threads", "decode threads", _threads_from_num_workers),
    "prefetch_factor": ("prefetch", "pool slots", _prefetch_from_factor),
}


def _triple(name, value):
    """Three finite numbers (R, G, B) from a sequence, a numpy array, a torch
    tensor or one number for all three (as torchvision's Normalize takes
    them), or ValueError/TypeError naming the argument."""
    if hasattr(value, "tolist"):  # torch.Tensor, numpy.ndarray (0-d: a number)
        if getattr(value, "ndim", 0) > 1 and (value.size if isinstance(value.size, int) else value.numel()) == 3:
            value = value.reshape(-1)  # (3, 1, 1), (1, 3, 1, 1): the broadcasting shapes
        value = value.tolist()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = [value] * 3
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be 3 numbers (R, G, B) or one number, not {type(value).__name__} ({value!r})")
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




def _parse_device(device, local_rank):
    """A torch.device for device=, or None (CPU tensors over the slots).
    "auto": cuda:LOCAL_RANK when torch sees CUDA, else None."""
    if device is None:
        return None
    if isinstance(device, str) and device == "auto":
        if not torch.cuda.is_available():
            return None
        count = torch.cuda.device_count()
        if local_rank < count:
            return torch.device("cuda", local_rank)
        if count == 1:  # one GPU per rank (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank)
            return torch.device("cuda", 0)
        raise ValueError(f"device='auto': local rank {local_rank} but {count} CUDA devices visible: pass device=")
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device must be None, 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from e
    if d.type == "cuda":
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        return d
    if d.type == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device {device!r}: pinfeed feeds 'cuda' devices (and 'cpu', its test backend)")


class DistributedSampler:
    """The sampler's options under torch.utils.data.DistributedSampler's
    names, for Loader(sampler=...):

        loader = pinfeed.Loader(root, batch_size=256,
                                sampler=pinfeed.DistributedSampler(shuffle=True, seed=0, drop_last=True))

    num_replicas, rank: the shard (default: the launch, pinfeed.launch_env()).
    shuffle, seed: the order of every epoch, from (seed, epoch).
    drop_last: False pads the shards with the first samples so that every rank
        has as many; True trims the dataset to a multiple of num_replicas.
    set_epoch(e): pins the epoch of the loader's following iterations, as
        Loader.set_epoch does (without it, each completed epoch advances).
    The first argument (a dataset) is accepted and ignored, so that
    DistributedSampler(dataset, ...) lines keep working; an instance of
    torch's own DistributedSampler is accepted by Loader too (its options are
    read from it, its dataset is not used, and its epoch is read at every
    iter(): set_epoch on it works as with DataLoader, and without it every
    epoch repeats epoch 0, as with DataLoader). Any other sampler (a
    subclass that overrides __iter__, RandomSampler, SubsetRandomSampler, your
    own) is iterated: the loader takes its indices.
    """

    def __init__(self, dataset=None, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        del dataset  # pinfeed's loader owns the dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._epoch_set = False  # set_epoch() was called: the loader follows self.epoch

    def set_epoch(self, epoch):
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = int(epoch)
        self._epoch_set = True

    def __repr__(self):
        return (f"pinfeed.DistributedSampler(num_replicas={self.num_replicas}, rank={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})")


_warned_num_workers = False


def _pair(name, value, parts):
    """(lo, hi) of two numbers, or ValueError/TypeError naming the argument."""
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair ({parts}), got {value!r}") from None
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a pair of numbers ({parts}), got {value!r}")
    return float(lo), float(hi)


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


_ORDERS = ("pinfeed", "torch")


def _is_torchs_distributed_sampler(sampler):
    torch_ds = getattr(getattr(torch.utils.data, "distributed", None), "DistributedSampler", None)
    return torch_ds is not None and type(sampler) is torch_ds  # pylint: disable=unidiomatic-typecheck


def _iterated(sampler):
    """True when the loader takes the sampler's own indices (its __iter__):
    any sampler but pinfeed's DistributedSampler and torch's own class, whose
    options are read instead (their orders are reproduced: order="pinfeed"
    or "torch"). A subclass that overrides __iter__ is never ignored."""
    if isinstance(sampler, DistributedSampler) and not hasattr(type(sampler), "__iter__"):
        return False
    if _is_torchs_distributed_sampler(sampler):
        return False
    if not hasattr(sampler, "__iter__"):
        raise TypeError(f"sampler must be an iterable of dataset indices (a torch Sampler) or a "
                        f"pinfeed.DistributedSampler, not {type(sampler).__name__}")
    return True


def _reconcile_sampler(sampler, shuffle, seed, rank, world_size, order):
    """(shuffle, seed, the sampler's trim, rank, world_size, iterated, order):
    pinfeed's sampler, torch's DistributedSampler read for its options (its
    order then torch's unless order= says otherwise), or any other sampler
    whose indices the loader takes, against Loader's own arguments."""
    if order is None:
        order = "torch" if _is_torchs_distributed_sampler(sampler) else "pinfeed"
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS} (pinfeed's permutation, or torch's DistributedSampler's "
                         f"randperm), got {order!r}")
    trim, iterated = _default("drop_last"), False
    if sampler is not None:
        iterated = _iterated(sampler)
        if shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle=True (as in DataLoader): "
                             "pass shuffle to the sampler")
        theirs = getattr(sampler, "seed", None)
        if seed is not None and theirs is not None and seed != theirs:
            raise ValueError(f"seed={seed} disagrees with the sampler's seed={theirs}")
        shuffle = bool(getattr(sampler, "shuffle", False))
        seed = theirs if seed is None else seed
        trim = bool(getattr(sampler, "drop_last", trim))
        for name, mine, attr in (("rank", rank, "rank"), ("world_size", world_size, "num_replicas")):
            theirs = getattr(sampler, attr, None)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"{name}={mine} disagrees with the sampler's {theirs}")
        rank = getattr(sampler, "rank", None) if rank is None else rank
        world_size = getattr(sampler, "num_replicas", None) if world_size is None else world_size
    shuffle = False if shuffle is None else shuffle
    seed = _default("seed") if seed is None else seed
    return shuffle, seed, trim, rank, world_size, iterated, order


def _digest(order):
    """A short hash of an epoch's order (a state's check of a sampler's)."""
    return hashlib.blake2b(array.array("q", order).tobytes(), digest_size=8).hexdigest()


def _state_field(state, key, check, what):
    if key in state and not check(state[key]):
        raise ValueError(f"state_dict[{key!r}] must be {what}, got {state[key]!r}")


def _is_int(v, lo=0, hi=2**63 - 1):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and lo <= v <= hi


def _check_state(state):
    """A state_dict's fields, each checked by name (a tampered or truncated
    checkpoint fails here, naming the field, not deep inside)."""
    if not isinstance(state, dict):
        raise TypeError(f"state_dict must be a dict (Loader.state_dict()'s), not {type(state).__name__}")
    missing = {"seed", "epoch", "position", "world_size", "rank"} - set(state)
    if missing:
        raise ValueError(f"state_dict lacks {sorted(missing)}")
    _state_field(state, "seed", lambda v: _is_int(v, 0, 2**64 - 1), "a non-negative integer")
    for key in ("epoch", "position"):
        _state_field(state, key, _is_int, "a non-negative integer")
    _state_field(state, "world_size", lambda v: _is_int(v, 1, 2**31 - 1), "an integer in [1, 2^31 - 1]")
    _state_field(state, "rank", lambda v: _is_int(v, 0, state["world_size"] - 1),
                 f"an integer in [0, world_size={state['world_size']})")
    _state_field(state, "order", lambda v: v in _ORDERS + ("sampler",), f"one of {_ORDERS + ('sampler',)}")
    for key in ("shuffle", "sampler_drop_last"):
        _state_field(state, key, lambda v: isinstance(v, bool), "True or False")
    for key in ("subset", "order_digest"):
        _state_field(state, key, lambda v: v is None or isinstance(v, str), "a digest (str) or None")
    _state_field(state, "resharded_from", lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and _is_int(p[0], 1, 2**31 - 1) and _is_int(p[1]) for p in v),
        "a list of [world_size, position] pairs")
    d = state.get("dataset")
    if d is not None:
        if not isinstance(d, dict) or {"samples", "num_classes", "hash"} - set(d):
            raise ValueError(f"state_dict['dataset'] must be the dataset's fingerprint (samples, num_classes, "
                             f"classes, hash), got {d!r}")
        for key in ("samples", "num_classes"):
            if not _is_int(d[key]):
                raise ValueError(f"state_dict['dataset'][{key!r}] must be a non-negative integer, got {d[key]!r}")
        if not isinstance(d["hash"], str):
            raise ValueError(f"state_dict['dataset']['hash'] must be a str, got {d['hash']!r}")
        classes = d.get("classes")
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise ValueError(f"state_dict['dataset']['classes'] must be a list of class names or None, "
                             f"got {classes!r}")


def _pad_or_trim(indices, world, trim):
    """An epoch's list over `world` ranks, as torch's DistributedSampler makes
    it (and pinfeed's): padded with its first indices (repeated as often as
    needed) to a multiple of world, or trimmed to one (trim=True); rank r
    takes every world-th from r."""
    n = len(indices)
    if n == 0:
        return []
    if trim and n % world != 0:
        total = max(0, math.ceil((n - world) / world)) * world
    else:
        total = math.ceil(n / world) * world
    if total <= n:
        return list(indices[:total])
    return (list(indices) * math.ceil(total / n))[:total]


def _remaining(indices, segments, trim):
    """What is left of an epoch's list once each of `segments` ((world,
    position): ranks that ran in lockstep to that position) has run over what
    the one before left: the samples not yet delivered to any rank, each
    once (the padding of a segment is not carried into the next)."""
    for world, position in segments:
        # The padded (or trimmed) list is never built: a state of a huge
        # world would cost its size; only its length and head matter.
        n = len(indices)
        total = _data.per_rank(n, world, trim) * world if n else 0
        if position * world > total:
            raise ValueError(f"state_dict's position {position} is outside the epoch: each of its {world} ranks had "
                             f"{total // world} samples")
        indices = indices[position * world:min(total, n)]
    return indices


def _fold_transform_arguments(options, scale, ratio, size, flip, interpolation):
    """torchvision's spellings into the table's options: scale=/ratio= pairs,
    size=(h, w), flip=p, interpolation as a string or an InterpolationMode.
    Returns (size, flip); the rest goes into `options`."""
    for name, value, keys, parts in (("scale", scale, ("scale_min", "scale_max"), "min area share, max"),
                                     ("ratio", ratio, ("ratio_min", "ratio_max"), "min aspect ratio, max")):
        if value is None:
            continue
        if any(k in options for k in keys):
            raise TypeError(f"pass {name}=(lo, hi) or {keys[0]}/{keys[1]}, not both")
        options[keys[0]], options[keys[1]] = _pair(name, value, parts)
    if isinstance(size, (tuple, list)):
        if "height" in options:
            raise TypeError("pass size=(h, w) or size= and height=, not both")
        if len(size) != 2:
            raise ValueError(f"size must be an int or (height, width), got {size!r}")
        for v in size:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"size must be positive integers (height, width), got {size!r}")
        options["height"], size = size
    if not isinstance(flip, bool) and isinstance(flip, numbers.Real) and not isinstance(flip, numbers.Integral):
        if "flip_p" in options:
            raise TypeError("pass flip=p or flip_p=, not both")
        options["flip_p"], flip = float(flip), float(flip) > 0
    if interpolation is not None:
        name = getattr(interpolation, "value", interpolation)  # torchvision.transforms.InterpolationMode
        if not isinstance(name, str):
            raise TypeError(f"interpolation must be a string or an InterpolationMode, not {interpolation!r}")
        options["interpolation"] = {"nearest-exact": "nearest"}.get(name.lower(), name.lower())
    return size, flip


def _check_device_arguments(dtype, memory_format, copy_delay_us):
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    if memory_format not in (None, torch.contiguous_format, torch.channels_last):
        raise ValueError(f"memory_format must be torch.contiguous_format or torch.channels_last, got {memory_format!r}")
    if isinstance(copy_delay_us, bool) or not isinstance(copy_delay_us, numbers.Integral) or copy_delay_us < 0:
        raise ValueError(f"_copy_delay_us must be a non-negative integer, got {copy_delay_us!r}")


def _normalization(mean, std):
    """mean= and std= as two lists of three floats, checked (std > 0, a warning for 0-255 statistics)."""
    mean, std = _triple("mean", mean), _triple("std", std)
    if any(v <= 0 for v in std):
        raise ValueError(f"std must be positive, got {std!r}")
    if any(v < 1e-6 for v in std):
        raise ValueError(f"std={std!r}: a std under 1e-6 scales pixel steps past a million (float32 loses them, "
                         "and overflows to inf and NaN); pinfeed normalizes pixels on the [0, 1] scale")
    _warn_if_0_255(mean, std)
    return mean, std


def _hooks(batch_transform, batch_fn):
    for name, hook in (("batch_transform", batch_transform), ("batch_fn", batch_fn)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable, not {type(hook).__name__}")
    return batch_transform, batch_fn


def _warn_if_0_255(mean, std):
    """Statistics on the 0-255 scale normalize [0, 1] pixels to nonsense (a
    batch mean near -2, a std near 0.01): say so."""
    if max(mean) > 1.5 or max(std) > 1.5:
        warnings.warn(f"pinfeed: mean={mean} and std={std} look like statistics of 0-255 pixels, but pinfeed "
                      "normalizes pixels scaled to [0, 1] (as torchvision's ToTensor then Normalize): divide them "
                      "by 255 (ImageNet's are the default)", UserWarning, stacklevel=4)


def _place_in_launch(rank, world_size, local_rank, options):
    """(rank, world_size, local_rank), the unset ones from the launch; the
    ranks on this host (local_ranks) split its memory and, threads=0, its
    cores."""
    if rank is None or world_size is None or local_rank is None or "local_ranks" not in options:
        env = launch_env()
        rank = env["rank"] if rank is None else rank
        world_size = env["world_size"] if world_size is None else world_size
        local_rank = env["local_rank"] if local_rank is None else local_rank
        options.setdefault("local_ranks", env["local_world_size"])
    rank = _int_arg("rank", rank, 0, 2**31 - 1)
    world_size = _int_arg("world_size", world_size, 1, 2**31 - 1)
    local_rank = _int_arg("local_rank", local_rank, 0, 2**31 - 1)
    if not (0 <= rank < world_size):
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size, local_rank


class Loader:
    """An iterable over (images, labels) batches, like torch.utils.data.DataLoader
    with a DistributedSampler; DataLoader's argument names mean what they mean
    there (docs/porting.md's migration table).

    data: an ImageFolder root, a file list ("relative/path label" lines), or
        tar shards ("train-{000000..000099}.tar"); a torch.utils.data.Subset
        of an ImageFolder or of a loader's .dataset (its indices, in its
        order); or a FakeData (pinfeed's or torchvision's: batches made in
        memory, no files). indices=: a range or list of sample indices, as
        a Subset.
    dataset, sampler: as DataLoader's: loader.dataset (len, classes,
        samples, targets, root) and loader.sampler (the one passed, or one
        whose set_epoch is the loader's).
    batch_size, shuffle, drop_last: as DataLoader. shuffle defaults to False
        (True with a sampler that says so); drop_last=True drops each rank's
        last incomplete batch.
    sampler: pinfeed.DistributedSampler(num_replicas, rank, shuffle, seed,
        drop_last), or torch's DistributedSampler: the shard, the order and the
        sampler's own drop_last (trim the dataset to a multiple of the ranks
        instead of padding). Any other sampler (a subclass that overrides
        __iter__, RandomSampler, SubsetRandomSampler, WeightedRandomSampler,
        your own iterable of indices) is iterated every epoch and its indices
        are loaded in its order.
    num_workers: taken as decode threads (threads=); pinfeed decodes on
        threads of this process, not in worker processes. prefetch_factor:
        batches loaded ahead of the one the loop holds (pool slots =
        prefetch_factor + 1): the decode threads share every batch, so no
        multiple of num_workers is needed to keep them busy.
        persistent_workers: accepted; the threads always persist.
    Epochs: each completed epoch advances to the next (a new order and new
        augmentation, from the seed). In one process (world_size 1) a new
        iter() after a pass stopped early (islice, a step budget) advances
        too, as DataLoader's RandomSampler draws anew; across ranks an
        unfinished iteration (a peek at the first batch) does not, so ranks
        stay in step. set_epoch(e) pins it, as DistributedSampler users do
        every epoch (on the loader or on the sampler passed to it).
    Held batches: a batch you keep (images[0], a loss whose graph holds the
        input, a list of batches) is your memory, as with DataLoader: the
        pool lends its slot out and takes fresh memory, so the loop never
        stops for it; labels are never views of a slot. held_warning /
        held_limit (bytes) warn or refuse (HeldLimitError) past a bound.
    Threads and processes: a Loader may be shared by threads. Batches are
        taken one at a time, each whole; iter() on one thread while another
        waits in next() lets that batch finish, then restarts the epoch, and
        the older iterator raises RuntimeError ("superseded") when asked
        again. A Loader belongs to the process that made it: used in a
        forked child (multiprocessing's 'fork') it raises RuntimeError; make
        it in the child instead.
    transform: "random" (RandomResizedCrop(size, scale, ratio) + horizontal
        flip), "center" (Resize(resize) + CenterCrop(size)) or "full" (the
        whole image resized). size: an int or (height, width); scale=(0.08,
        1.0) and ratio=(3/4, 4/3) as RandomResizedCrop's; flip: True (p=0.5),
        False, or the flip's probability; interpolation: "bilinear"
        (antialiased, the default), "bicubic" (PIL's, antialiased) or
        "nearest", or torchvision's InterpolationMode.BILINEAR / BICUBIC /
        NEAREST / NEAREST_EXACT.
    layout: "nchw-f32" (normalized with mean/std, float32) or "nhwc-u8" (uint8,
        to normalize on the GPU).
    rank, world_size: the shard; default from the sampler or the launch
        (pinfeed.launch_env(): torch.distributed, torchrun, mpirun, srun), else
        0 of 1. The local rank is kept as `loader.local_rank`: the GPU this
        process feeds (`images.cuda(loader.local_rank, non_blocking=True)`);
        the local world size splits this host's pinned budget and, with
        threads=0, its cores.
    pin_memory: "auto" (pin within the host's budget, pageable beyond it),
        True (the same, but a RuntimeWarning names the reason when fewer slots
        than `prefetch` can be pinned), "require" (raise pinfeed.ConfigError
        instead), or False (pageable). Ranks on one host split the host's
        pinned budget between them. Under critical memory pressure the pool
        gives every slot beyond `pressure_floor` (default 2; it also stays
        above the batches you hold) back to the kernel and re-pins them when
        the pressure is gone: stats()["pool"] shows live_slots,
        released_slots and given_back_bytes.
    bad_sample: "replace" (a deterministic substitute, logged and counted) or
        "fail" (raise pinfeed.DataError naming the file). With "replace" the
        epoch still fails once more than `max_replaced_share` (default 1%) of
        it (at least one sample) was replaced, or when every sample of a class
        failed to decode.
    max_classes: a label at or over it refuses the dataset (default 1,000,000).
    copy: yield tensors that own their memory (the slot is returned at once).
    device: None (CPU tensors over the slots), "cuda", "cuda:N", a
        torch.device, "auto" (cuda:LOCAL_RANK when torch sees CUDA, else
        None) or "cpu" (the same mechanism on pinfeed's CPU backend). The
        batch is copied on the loader's stream and normalized there
        (layout="nchw-f32"; "nhwc-u8" keeps uint8); the consumer stream
        (stream=, else torch's current stream of the device) waits for it.
        The slot goes back after the copy; the device buffers after the work
        queued on the consumer stream when the batch's tensors die.
        labels_device=False keeps the labels on the CPU; dtype=torch.float16
        or torch.bfloat16 is written by the normalization on the copy stream
        (rounded to nearest even, as .to(dtype)); memory_format=
        torch.channels_last converts on the consumer stream.
    stream: the torch.cuda.Stream batches are handed to (device=), or whose
        queued copies a slot waits for (device=None).
    return_indices: yield (images, labels, indices) with the dataset indices
        (an int64 tensor);
    return_paths: yield the samples' paths too (after the indices if both):
        (images, labels, paths).
    order: "pinfeed" (its own permutation of seed + epoch) or "torch" (torch's
        DistributedSampler's randperm, sample for sample: two pipelines can
        be compared index by index). Default: "torch" with torch's
        DistributedSampler as sampler=, else "pinfeed".
    batch_transform: a callable applied to each batch's images tensor before
        it is yielded (on the device with device=, on torch's current stream
        or stream=): torchvision.transforms.v2 or kornia ops on whole batches.
    batch_fn: a callable given (images, labels[, indices][, paths]) whose
        result is yielded instead (DataLoader's collate_fn comes too early
        here: samples are written into their batch in C++).
    Accepted at DataLoader's defaults only, otherwise refused with what to
        use instead: collate_fn, batch_sampler, worker_init_fn, generator,
        timeout, multiprocessing_context, pin_memory_device, in_order. Not
        taken: a Python transform= (use batch_transform=); a Dataset object
        as data (pass its folder).
    classes, class_to_idx, samples: as torchvision's ImageFolder (for file
        lists and shards the classes are the labels' numbers).
    classes=: the class names this dataset must have, as a list, or a
        Loader to follow (the training loader, for a validation loader): a
        class folder renamed, missing or extra is refused naming the first
        difference, since labels are folder positions. For file lists and
        shards (numeric labels), a label past the list's end is refused.

    Any other loader option of the table below is a keyword argument too
    (max_replacements=4, dct_scaling=True, ...).

    Waiting for a batch never blocks Ctrl-C: KeyboardInterrupt comes within
    ~50 ms and the loader stays usable. One iteration runs at a time: iter()
    restarts the epoch, and an older iterator that is asked for more raises
    RuntimeError instead of taking the new run's batches.
    """

    def __new__(cls, data=None, *args, **kwargs):
        # A FakeData (pinfeed's or torchvision's) gets the loader of batches
        # made in memory: the --dummy of training scripts, same loop.
        if _data.is_fake(data):
            return _fake_loader(data, *args, **kwargs)
        return super().__new__(cls)

    def __copy__(self):
        raise TypeError("a pinfeed.Loader cannot be copied: it owns decode threads, a pinned pool and an epoch's "
                        "position, which a copy would share. Make a second Loader with the same arguments")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce__(self):
        raise TypeError("a pinfeed.Loader cannot be pickled (decode threads, a pinned pool): pickle its "
                        "state_dict() and make a Loader with the same arguments where it is loaded")

    def __init__(self, data, batch_size=_default("batch_size"), shuffle=None, sampler=None, *,
                 num_workers=None, pin_memory="auto", drop_last=False, prefetch_factor=None,
                 persistent_workers=False, transform=_default("crop"), size=_default("size"),
                 resize=_default("resize"), scale=None, ratio=None, flip=_default("flip"), interpolation=_default("interpolation"),
                 layout=_default("layout"), mean=_IMAGENET_MEAN, std=_IMAGENET_STD, rank=None, world_size=None,
                 seed=None, threads=None, prefetch=None, bad_sample=_default("bad_sample"), copy=False,
                 return_indices=False, return_paths=False, list_root=None, local_rank=None, classes=None,
                 max_classes=_default("max_classes"), max_replaced_share=_default("max_replaced_share"),
                 device=None, stream=None, labels_device=True, dtype=None, memory_format=None, order=None,
                 batch_transform=None, batch_fn=None, indices=None, _copy_delay_us=0, **options):
        given = data
        data, self._subset, folder = _data.resolve(data, indices)
        _check_arguments(data, pin_memory, transform, persistent_workers, options)
        threads = _dataloader_alias("num_workers", num_workers, threads)
        prefetch = _dataloader_alias("prefetch_factor", prefetch_factor, prefetch)
        threads = _default("threads") if threads is None else threads
        prefetch = _default("prefetch") if prefetch is None else prefetch
        shuffle, seed, sampler_trim, rank, world_size, iterated, order = _reconcile_sampler(
            sampler, shuffle, seed, rank, world_size, order)
        size, flip = _fold_transform_arguments(options, scale, ratio, size, flip, interpolation)
        if isinstance(layout, str):
            layout = _LAYOUT_ALIASES.get(layout, layout)
        if layout == "nhwc-u8" and (mean is not _IMAGENET_MEAN or std is not _IMAGENET_STD):
            raise ValueError("layout='nhwc-u8' yields the decoded uint8 pixels: mean= and std= are not applied. "
                             "Normalize on the device (device= with layout='nchw-f32' does it on the copy stream), "
                             "or use layout='nchw-f32'")
        _check_device_arguments(dtype, memory_format, _copy_delay_us)
        mean, std = _normalization(mean, std)
        self.batch_transform, self.batch_fn = _hooks(batch_transform, batch_fn)
        rank, world_size, self.local_rank = _place_in_launch(rank, world_size, local_rank, options)
        # device=: the batches go to a device through the loader's own copy
        # stream; uint8 from the decoders, normalized there.
        self._device = _parse_device(device, self.local_rank)
        layout, feed = self._device_feed(layout, copy, dtype, memory_format, labels_device, stream, _copy_delay_us)
        self._stream, self._labels_device = stream, bool(labels_device)
        self._cuda_seen = False  # CUDA was initialized once: stays so
        self._dtype = None if dtype in (None, torch.float32) else dtype
        self._memory_format = None if memory_format in (None, torch.contiguous_format) else memory_format
        # Ranges, types and choices of the table's options are checked in C++
        # (ConfigError is a ValueError; a wrong type is a TypeError), named.
        self._impl = _pinfeed.Loader({
            "dataset": os.fsencode(data), "list_root": None if list_root is None else os.fsencode(list_root),
            "rank": rank, "world_size": world_size, "mean": list(mean), "std": list(std),
            "cuda_device": self._pinned_for_device(),
            "batch_size": batch_size, "threads": threads, "prefetch": prefetch, "shuffle": shuffle,
            "drop_last": sampler_trim, "drop_last_batch": drop_last, "seed": seed, "crop": transform,
            "size": size, "resize": resize, "flip": flip, "layout": layout, "bad_sample": bad_sample,
            "pin": pin_memory is not False, "require_pinned": pin_memory == "require",
            "max_classes": max_classes, "max_replaced_share": max_replaced_share, **options,
        }, feed)
        self.batch_size, self.drop_last, self.shuffle = batch_size, drop_last, shuffle
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_workers, self.prefetch = self._impl.threads(), prefetch
        self.copy, self.return_indices, self.return_paths = copy, return_indices, return_paths
        self.pin_memory = pin_memory
        if self._subset is not None:
            self._subset.check(self._impl.dataset_size(), os.fsdecode(data))
        # DataLoader's .dataset (the object given, or a view of the path's)
        # and .sampler (the one given, or one that shows the loader's).
        self.dataset = given if not isinstance(given, (str, bytes, os.PathLike)) and not isinstance(
            given, _data.DatasetView) else _data.DatasetView(self, data, self._subset)
        if folder is not None:
            _data.check_folder(folder, self, data)
        self.sampler = sampler if sampler is not None else _data.SamplerView(self)
        self._init_epochs(sampler, iterated, order, sampler_trim)
        self._active = None  # the running iteration's token
        # Threads: one batch is taken at a time (next() and iter() of any
        # thread hold it); processes: only this one has the decode threads.
        self._lock = threading.RLock()  # reentrant: a generator finalized by GC under it
        self._pid = os.getpid()
        self._classes = None
        if classes is not None:
            self._check_classes(classes)
        if pin_memory is True:
            report = self._impl.pin_report()
            if report["pinned_slots"] < report["slots"]:
                warnings.warn(f"pinfeed: pin_memory=True, but {report['reason']}; the other slots are pageable "
                              "(pin_memory='require' makes this an error)", RuntimeWarning, stacklevel=2)

    def _init_epochs(self, sampler, iterated, order, trim):
        """The state of epochs and orders a new loader starts with."""
        self._epoch = 0          # the epoch the next iteration runs
        self._pinned_epoch = False  # set_epoch() was called: no advancing
        self._current = None     # the epoch of the latest iteration
        self._completed = False  # the latest iteration ran to its end
        # A sampler whose epoch the loader follows: torch's always (as
        # DataLoader does), pinfeed's once its set_epoch() was called.
        self._sampler = sampler
        # Where epochs' indices come from (_order_for): the sampler's own
        # (iterated), torch's permutation (order="torch"), the remainder of an
        # epoch resumed with another world size (_segments: (epoch, [(world,
        # position), ...])), else pinfeed's sampler in C++.
        self._iter_sampler = sampler if iterated else None
        self._order, self._trim = order, trim
        self._check_samplers_dataset(sampler)
        self._segments = None
        self._running = None  # (epoch, samples) of the latest iteration's order
        self._digest = None  # the iterated sampler's order this epoch, as _digest() gives it
        self._pending_order = None  # drawn by load_state_dict for the resumed epoch
        self._resume = None
        self._delivered_any = False  # the latest iteration yielded a batch

    def _device_feed(self, layout, copy, dtype, memory_format, labels_device, stream, copy_delay_us):
        """(layout, feed): what the C++ loader is asked for with device= (uint8
        slots, and the feed's settings), or the layout as it is and None."""
        if self._device is None:
            if stream is not None and not (hasattr(stream, "cuda_stream") or isinstance(stream, _pinfeed.CpuConsumer)):
                raise TypeError(f"stream must be a torch.cuda.Stream, not {type(stream).__name__}")
            if dtype not in (None, torch.float32) or memory_format not in (None, torch.contiguous_format):
                raise ValueError("dtype= and memory_format= go with device= (convert CPU batches yourself)")
            return layout, None
        if copy:
            raise ValueError("copy=True is for device=None: device batches own their memory already")
        if layout not in ("nchw-f32", "nhwc-u8"):
            raise ValueError(f"layout must be 'nchw-f32' or 'nhwc-u8', got {layout!r}")
        normalize_on_device = layout == "nchw-f32"
        if not normalize_on_device and (dtype is not None or memory_format is not None):
            raise ValueError("dtype= and memory_format= apply to normalized float batches (layout='nchw-f32'), "
                             "not to layout='nhwc-u8'")
        if not isinstance(labels_device, bool):
            raise TypeError(f"labels_device must be True or False, not {labels_device!r}")
        feed = {"type": self._device.type, "index": 0 if self._device.index is None else self._device.index,
                "normalize": normalize_on_device, "copy_delay_us": int(copy_delay_us),
                "dtype": {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")}
        if stream is not None:
            if self._device.type != "cuda" or not hasattr(stream, "cuda_stream"):
                raise TypeError(f"stream= must be a torch.cuda.Stream on the device, not {stream!r}")
            if stream.device != self._device:
                raise ValueError(f"stream= is on {stream.device}, the batches go to {self._device}")
        return "nhwc-u8", feed

    def _pinned_for_device(self):
        """The GPU the pinned slots are registered with: the device= one, else
        torch's current device once torch has a context, else the local
        rank's (DDP's convention; none on a host without it). Not device 0
        in every rank."""
        if self._device is not None:
            return self._device.index if self._device.type == "cuda" else None
        if torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return self.local_rank

    def _check_samplers_dataset(self, sampler):
        """torch's DistributedSampler is read for its options: a dataset of
        another length than the loader's (a Subset) would be ignored."""
        dataset = getattr(sampler, "dataset", None) if _is_torchs_distributed_sampler(sampler) else None
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) != self._dataset_size():
            raise ValueError(f"the sampler's dataset has {len(dataset)} samples, the loader's data "
                             f"{self._dataset_size()}: torch's DistributedSampler is read for its options (the "
                             "loader shards its own data); for a subset, pass the Subset as data= (or indices=)")

    def _dataset_size(self):
        """Samples of the loader's dataset (its subset's, with one)."""
        return self._impl.dataset_size() if self._subset is None else len(self._subset)

    def _check_classes(self, expected):
        if isinstance(expected, Loader):
            if not expected._impl.named_classes():
                expected = [str(c) for c in range(expected.num_classes)]
            else:
                expected = expected.classes
        if isinstance(expected, (str, bytes)):
            raise TypeError("classes= must be a list of class names (str) or a pinfeed.Loader to follow")
        expected = list(expected)
        if not all(isinstance(c, str) for c in expected):
            raise TypeError("classes= must be a list of class names (str) or a pinfeed.Loader to follow")
        if self._impl.named_classes():
            _pinfeed.check_same_classes([os.fsencode(c) for c in expected], [os.fsencode(c) for c in self.classes])
        elif self.num_classes > len(expected):
            raise ValueError(f"this dataset's labels go up to {self.num_classes - 1}, past the {len(expected)} "
                             "classes of classes=")

    def pin_report(self):
        """How the pool was pinned: slots, pinned_slots, budget_bytes, limiting, local_ranks, reason."""
        return dict(self._impl.pin_report())

    def set_epoch(self, epoch):
        """Pins the epoch the following iterations run (their order and
        augmentation), as DistributedSampler.set_epoch does; without it each
        completed epoch advances to the next."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._epoch = int(epoch)
        self._pinned_epoch = True
        # The sampler follows (DataLoader users call it there; both must agree).
        if self._sampler is not None and callable(getattr(self._sampler, "set_epoch", None)):
            self._sampler.set_epoch(self._epoch)
        # A set_epoch after load_state_dict that names another epoch than the
        # state's wins: that epoch runs from its start.
        if self._resume is not None and self._resume["epoch"] != self._epoch:
            self._resume = None
        if self._segments is not None and self._segments[0] != self._epoch:
            self._segments = None  # the resharded epoch will not run: len() is a whole epoch's again

    def _sampler_epoch(self):
        """The epoch the sampler pins, or None."""
        sampler = self._sampler
        if sampler is None or (isinstance(sampler, DistributedSampler) and not sampler._epoch_set):
            return None
        if not hasattr(sampler, "epoch"):
            return None  # RandomSampler and the like: the loader's own epochs
        epoch = sampler.epoch
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"the sampler's epoch must be a non-negative integer, got {epoch!r}")
        return int(epoch)

    @property
    def epoch(self):
        """The epoch of the latest iteration (None before the first)."""
        return self._current

    @property
    def classes(self):
        """The class names, index = label (torchvision's ImageFolder.classes)."""
        if self._classes is None:
            self._classes = [os.fsdecode(name) for name in self._impl.classes()]
        return self._classes

    @property
    def class_to_idx(self):
        """{class name: label}, as torchvision's ImageFolder."""
        return {name: i for i, name in enumerate(self.classes)}

    @property
    def samples(self):
        """Every sample's (path, label) in dataset order (index = the indices
        return_indices yields), as torchvision's ImageFolder.samples."""
        return [(os.fsdecode(path), label) for path, label in self._impl.samples()]

    def paths(self, indices):
        """The paths of dataset indices (a path, or "shard.tar:member")."""
        return [os.fsdecode(path) for path in self._impl.describe([int(i) for i in indices])]

    def crop_params(self, index, epoch=None):
        """(top, left, height, width, flipped): the box of the source image
        that dataset sample `index` shows in `epoch` (default: the epoch of
        the latest iteration, else the next), as torchvision's
        RandomResizedCrop.get_params gives it; the whole image for
        transform="center" and "full". The sample is that box resized to
        `size` (and mirrored if flipped): torchvision's
        F.resized_crop(img, top, left, height, width, size, antialias=True)
        reproduces it. Reads the file's header only."""
        if epoch is None:
            epoch = self._current if self._current is not None else self._epoch
        index = operator.index(index)
        if index < 0 or index >= self._impl.dataset_size():
            raise IndexError(f"sample {index} is not in the dataset of {self._impl.dataset_size()}")
        return tuple(self._impl.crop_params(index, int(epoch)))

    def __len__(self):
        """Batches of a whole epoch on this rank, as len(DataLoader): this
        rank's samples over batch_size, the last incomplete batch counted
        unless drop_last. Also after load_state_dict(), as torchdata's
        StatefulDataLoader: len() is the epoch's, while the iteration that
        resumes yields only the batches left (also when a state of another
        world size is resharded: the rest of that epoch over this world)."""
        return self._batch_count(self._samples_in_epoch())

    def _batch_count(self, samples):
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def _samples_in_epoch(self):
        """This rank's samples in a whole epoch."""
        if self._iter_sampler is not None:
            try:
                return len(self._iter_sampler)
            except TypeError:
                if self._running is not None:
                    return self._running[1]
                raise TypeError(f"len(loader): the sampler ({type(self._iter_sampler).__name__}) has no len(), "
                                "and no epoch has run yet") from None
        if self._subset is not None:
            return _data.per_rank(len(self._subset), self.world_size, self._trim)
        return self._impl.samples_per_epoch()

    def _perm(self, epoch):
        """The epoch's order of the whole dataset, before padding and sharding:
        pinfeed's permutation, or torch's DistributedSampler's (randperm with
        a generator seeded seed + epoch)."""
        n = self._dataset_size()
        if self._order == "torch":
            if not self.shuffle:
                return list(range(n))
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(_pinfeed.sampler_indices(n, 0, 1, self.shuffle, self.seed, False, epoch))

    def _drawn(self):
        """The iterated sampler's indices for this epoch (the ones drawn by
        load_state_dict to check a resumed order, if it drew them)."""
        if self._pending_order is not None:
            out, self._pending_order = self._pending_order, None
            return out
        out = []
        for i in self._iter_sampler:
            try:
                index = operator.index(i)
            except TypeError:
                raise TypeError(f"the sampler ({type(self._iter_sampler).__name__}) yielded {i!r}, not a dataset index "
                                "(a batch sampler? pinfeed batches itself: pass its sampler and batch_size=)") from None
            if index < 0:
                raise ValueError(f"the sampler ({type(self._iter_sampler).__name__}) yielded index {index}")
            out.append(index)
        return out

    def _order_for(self, epoch):
        """This rank's sample indices for `epoch`, or None for pinfeed's own
        sampler's (the C++ one, over the whole data)."""
        if self._subset is None:
            return self._view_order(epoch, explicit=False)
        source = f"the sampler ({type(self._iter_sampler).__name__})" if self._iter_sampler is not None else "the order"
        return self._subset.map(self._view_order(epoch), source)

    def _view_order(self, epoch, explicit=True):
        """This rank's indices of the loader's dataset (positions in its
        subset, with one) for `epoch`; explicit=False: None for pinfeed's
        own sampler."""
        if self._segments is not None and self._segments[0] == epoch:
            left = _remaining(self._perm(epoch), self._segments[1], self._trim)
            return _pad_or_trim(left, self.world_size, self._trim)[self.rank::self.world_size]
        if self._iter_sampler is not None:
            return self._drawn()
        if self._order == "torch":
            return _pad_or_trim(self._perm(epoch), self.world_size, self._trim)[self.rank::self.world_size]
        if not explicit:
            return None
        return list(_pinfeed.sampler_indices(self._dataset_size(), self.rank, self.world_size, self.shuffle, self.seed,
                                             self._trim, epoch))

    @property
    def num_classes(self):
        """The number of classes: one more than the largest label (the class
        folders of an ImageFolder root)."""
        return self._impl.num_classes()

    def _check_process(self):
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"pinfeed.Loader: this loader was created in process {self._pid} and is used in process "
                f"{os.getpid()}, a fork of it (multiprocessing's 'fork' start method, os.fork, a DataLoader worker). "
                "Its decode threads do not exist in a forked process, so it would wait forever: create the Loader "
                "in the child process (or use the 'spawn' start method)")

    def __iter__(self):
        # One epoch runs at a time: a new iteration supersedes an older one,
        # which raises RuntimeError if asked for more instead of silently
        # taking batches of the new run. Across threads too: iter() waits
        # for a next() in flight on another thread (that batch is whole),
        # then that thread's iterator is superseded.
        self._check_process()
        with self._lock:
            delivered = self._start()
            token = object()
            self._active = token
        return self._batches(token, delivered)

    def _epoch_end(self, samples=None):
        """The position (samples of this rank) at the end of an epoch."""
        n = self._samples_in_epoch() if samples is None else samples
        return (n // self.batch_size) * self.batch_size if self.drop_last else n

    def _start(self):
        """Starts the iteration's epoch; returns the batches already delivered
        in it (a resumed position)."""
        if self._current is not None and not self._completed and self._delivered_any and not self._pinned_epoch \
                and self.world_size == 1 and self._resume is None:
            # A pass stopped early (islice, a step budget): a new iter() runs
            # the next epoch, a fresh order and augmentation, as DataLoader's
            # RandomSampler draws anew. Across ranks (world_size > 1) only a
            # completed epoch advances, as DistributedSampler's epoch only
            # moves with set_epoch: one rank's peek must not put it ahead.
            self._epoch = self._current + 1
        self._delivered_any = False
        self._completed = False
        pinned = self._sampler_epoch()
        if pinned is not None:
            self._epoch, self._pinned_epoch = pinned, True
        epoch, position, resumed = self._epoch, 0, False
        if self._resume is not None:
            s, self._resume = self._resume, None
            # The sampler's set_epoch after load_state_dict wins: its epoch from the start.
            if pinned is None or pinned == int(s["epoch"]):
                epoch, position, resumed = int(s["epoch"]), int(s["position"]), True
        for _ in range(2):
            if self._segments is not None and self._segments[0] != epoch:
                self._segments = None  # the resharded epoch is over, or another one was pinned
            order = self._order_for(epoch)
            size = self._impl.samples_per_epoch() if order is None else len(order)
            if not (resumed and position >= self._epoch_end(size)):
                break
            # A state taken at the very end of an epoch: that epoch is done.
            epoch, position, resumed = (pinned if pinned is not None else epoch + 1), 0, False
        self._running = (epoch, size)
        self._digest = _digest(order) if self._iter_sampler is not None else None
        if order is not None:
            self._impl.begin_order(epoch, order, position)
        elif position > 0:
            self._impl.restore(self.seed, epoch, position, self.world_size, self.rank)
        else:
            self._impl.begin_epoch(epoch)
        self._epoch = self._current = epoch
        return position // self.batch_size

    def _finished(self):
        """The epoch's last batch was delivered: unless pinned, the next
        iteration runs the next epoch."""
        if self._completed:
            return
        self._completed = True
        if self._segments is not None and self._segments[0] == self._current:
            self._segments = None  # the next epoch is a whole one over this world
        if not self._pinned_epoch:
            self._epoch = self._current + 1

    def _batches(self, token, delivered):
        last = self._batch_count(self._running[1])  # this run's order (a resharded remainder is shorter)
        try:
            while True:
                self._check_process()
                with self._lock:
                    if self._active is not token:
                        raise RuntimeError("this iterator of a pinfeed.Loader was superseded: iter() was called again "
                                           "on the loader (here or on another thread), which restarted the epoch "
                                           "there. One iteration runs at a time; use the newest iterator")
                    if self._device is not None:
                        try:
                            item = self._impl.next_device(self._consumer())
                        except _pinfeed.HeldLimitError:
                            gc.collect()  # batches held only by cycles first
                            item = self._impl.next_device(self._consumer())
                        if item is None:
                            self._finished()
                            return
                        images_capsule, labels_capsule, host_labels, indices, pinned = item
                    else:
                        item = self._next_host()
                        if item is None:
                            self._finished()
                            return
                        images_capsule, labels_capsule, indices, pinned = item
                    delivered += 1
                    self._delivered_any = True
                    if delivered >= last:
                        # Done with the last batch, even if the loop stops at it
                        # (itertools.islice, a step count) and never asks again.
                        self._finished()
                images, labels = from_dlpack(images_capsule), from_dlpack(labels_capsule)
                del images_capsule, labels_capsule
                if self._device is not None and self._memory_format is not None:
                    # On the consumer's stream, which already waits for the copy
                    # (dtype= was written by the copy stream's normalization).
                    with (torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()):
                        images = images.contiguous(memory_format=self._memory_format)
                if self._device is not None:
                    if not self._labels_device:
                        labels = torch.tensor(host_labels, dtype=torch.int64)
                if self.copy:
                    images, labels = images.clone(), labels.clone()  # the slot goes back now
                yield self._delivered(images, labels, indices)
        finally:
            if self._active is token and os.getpid() == self._pid:
                with self._lock:
                    if self._active is token:
                        self._active = None

    def _next_host(self):
        """The next host batch. Past held_limit, batches the program holds
        only through reference cycles are collected once before the
        refusal (HeldLimitError) stands."""
        try:
            return self._impl.next(self._host_consumer())
        except _pinfeed.HeldLimitError:
            gc.collect()
            return self._impl.next(self._host_consumer())

    def _delivered(self, images, labels, indices):
        """What the loop gets: the batch through batch_transform (on the
        consumer stream with device=) and batch_fn."""
        if self.batch_transform is not None:
            with (torch.cuda.stream(self._stream) if self._device is not None and self._stream is not None
                  else contextlib.nullcontext()):
                images = self.batch_transform(images)
        out = (images, labels)
        if self.return_indices:
            out += (torch.tensor(indices, dtype=torch.int64),)
        if self.return_paths:
            out += ([os.fsdecode(path) for path in self._impl.describe(indices)],)
        return self.batch_fn(*out) if self.batch_fn is not None else out

    def state_dict(self):
        """Where the loader stands: load_state_dict() continues from here. Once
        an epoch's last batch was delivered, that is the start of the next
        epoch (set_epoch pinned or not); before the first iteration, the epoch
        it will run; with a load_state_dict() not yet used, that state. After
        load_state_dict(), a set_epoch (on the loader or its sampler) naming
        another epoch than the state's wins: that epoch runs from its start."""
        if self._resume is not None:
            # Taken as this dataset's (strict=False accepted a change): the
            # next load checks against this dataset, not the old one.
            pinned = self._sampler_epoch()
            if pinned is None or pinned == self._resume["epoch"]:
                return dict(self._resume, dataset=self._fingerprint())
            state = dict(self._resume, epoch=pinned, position=0)  # the sampler's set_epoch won
            for key in ("resharded_from", "order_digest"):
                state.pop(key, None)
            return dict(state, dataset=self._fingerprint())
        state = dict(self._impl.state(), **self._order_keys())
        state["dataset"] = self._fingerprint()
        if self._current is None:
            pinned = self._sampler_epoch()
            state["epoch"], state["position"] = (self._epoch if pinned is None else pinned), 0
        elif self._completed:
            state["epoch"], state["position"] = self._current + 1, 0
        else:
            if self._segments is not None and self._segments[0] == self._current:
                # An epoch resumed with another world size: what ran before it.
                state["resharded_from"] = [list(segment) for segment in self._segments[1]]
            if self._digest is not None:
                state["order_digest"] = self._digest  # the sampler's order, checked on resume
        return state

    def _order_keys(self):
        """What decides the order besides the seed, as a state records it."""
        return {"order": "sampler" if self._iter_sampler is not None else self._order, "shuffle": bool(self.shuffle),
                "sampler_drop_last": bool(self._trim),
                "subset": None if self._subset is None else self._subset.digest()}

    def _fingerprint(self):
        """The dataset's fingerprint as state_dict() carries it (computed once:
        a stat per file): samples, num_classes, classes (None for numeric
        labels), hash."""
        f = dict(self._impl.fingerprint())
        if f["classes"] is not None:
            f["classes"] = [os.fsdecode(name) for name in f["classes"]]
        return f

    def load_state_dict(self, state, strict=True):
        """Continues from state_dict()'s position. A state taken on another
        dataset (classes added, removed or renamed, samples added or removed,
        files replaced) is refused with what changed, as is a position past
        the epoch's end: index i would no longer be the same sample. strict=False
        takes a changed dataset anyway (the position then points into the new
        order), as torch's load_state_dict(strict=False) takes a changed model;
        a state of another seed is refused the same way.

        Ranks run in lockstep, so any rank's state resumes every rank (a
        checkpoint saved by rank 0 alone). Elastic: a state saved by N ranks
        loads into a loader of M ranks. The epoch it was taken in then
        finishes with the samples no rank was given yet, each once,
        resharded over the M ranks (padded or trimmed as the sampler says);
        the epochs after it are whole ones over M ranks. Its state_dict()
        says "resharded_from" meanwhile, so it can be resumed again. A
        sampler that orders each rank itself (iterated) cannot be resharded:
        that is refused."""
        _check_state(state)
        self._check_order_keys(state, strict)
        self._check_dataset(state.get("dataset"), strict)
        epoch, position = int(state["epoch"]), int(state["position"])
        segments = [(int(w), int(p)) for w, p in state.get("resharded_from", [])]
        if self._iter_sampler is not None and (state["world_size"] != self.world_size or state["rank"] != self.rank):
            raise ValueError(f"state_dict is for rank {state['rank']} of {state['world_size']}, this loader is rank "
                             f"{self.rank} of {self.world_size}, and its sampler "
                             f"({type(self._iter_sampler).__name__}) orders each rank itself: another rank's "
                             "position, or the remaining samples resharded, cannot be known. Resume each rank from "
                             "its own state with the same world size, or use pinfeed's or torch's "
                             "DistributedSampler")
        if state["world_size"] != self.world_size:
            segments.append((int(state["world_size"]), position))
            position = 0
        if any(w < 1 or p < 0 for w, p in segments):
            raise ValueError(f"state_dict's resharded_from is not a list of (world_size, position): {segments!r}")
        # A sampler the loader reads the epoch of pins the loaded one (a fresh
        # torch sampler says 0); pinfeed's, until its set_epoch is used, does not.
        sampler = self._sampler
        if callable(getattr(sampler, "set_epoch", None)) and not (
                isinstance(sampler, DistributedSampler) and not sampler._epoch_set):
            sampler.set_epoch(epoch)
        self._segments = (epoch, segments) if segments else None
        self._epoch, self._running, self._pending_order = epoch, None, None
        self._check_position(state, position, strict)
        # Another rank's state of the same world is taken as this rank's:
        # ranks run in lockstep (every rank saves the same position), so a
        # checkpoint saved by rank 0 alone resumes every rank.
        self._resume = dict(state, seed=self.seed, world_size=self.world_size, rank=self.rank, position=position,
                            **self._order_keys())
        self._resume.pop("resharded_from", None)
        if segments:
            self._resume["resharded_from"] = [list(segment) for segment in segments]

    def _check_order_keys(self, state, strict):
        """The seed, the order, shuffle and the sampler's trim of a state
        against this loader's: another one would point the position into
        another order."""
        mine = dict(self._order_keys(), seed=self.seed)
        for key in ("seed", "order", "shuffle", "sampler_drop_last", "subset"):
            if key not in state or state[key] == mine[key]:
                continue  # (states before 2026-12-05 carry only the seed)
            message = (f"state_dict was taken with {key}={state[key]!r}, this loader has {key}={mine[key]!r}: the "
                       "position would point into another order (other samples, other augmentation)")
            if strict:
                raise ValueError(message + f"; pass the same {key}, or load_state_dict(state, strict=False) to "
                                 "continue at that position of this loader's order")
            warnings.warn(f"pinfeed: {message}; continuing with this loader's (strict=False)", RuntimeWarning,
                          stacklevel=3)

    def _check_position(self, state, position, strict):
        """The position against the epoch it resumes; for a sampler the
        loader iterates, the order it gives now against the saved one."""
        epoch = self._epoch
        if self._iter_sampler is not None and position > 0:
            self._pending_order = self._drawn()  # _start takes these: a random sampler is drawn once
            if "order_digest" in state and state["order_digest"] != _digest(self._pending_order):
                message = (f"the sampler ({type(self._iter_sampler).__name__}) gives another order for epoch "
                           f"{epoch} than when the state was saved (a random sampler whose generator is not "
                           "restored, or another sampler): resuming at its position would repeat some samples and "
                           "skip others")
                if strict:
                    self._pending_order = None
                    raise ValueError(message + "; give the sampler the same order again (a seeded generator, "
                                     "set_epoch), or load_state_dict(state, strict=False) to resume anyway")
                warnings.warn(f"pinfeed: {message} (strict=False: resuming anyway)", RuntimeWarning, stacklevel=3)
            size = len(self._pending_order)
        elif self._segments is not None:
            size = len(self._order_for(epoch))
        else:
            try:
                size = self._samples_in_epoch()
            except TypeError:
                return  # a sampler without len(): the C++ loader checks the position against the order it gets
        end = self._epoch_end(size)
        if position < 0 or position > end:
            raise ValueError(f"state_dict's position {position} is outside the epoch: this rank has {end} samples "
                             "per epoch")

    def _check_dataset(self, was, strict):
        """A state's dataset fingerprint against this dataset."""
        if was is None:
            warnings.warn("pinfeed: this state_dict carries no dataset fingerprint (saved by a pinfeed before "
                          "2026-12-03): whether it was taken on this dataset cannot be checked", RuntimeWarning,
                          stacklevel=3)
            return
        classes = was.get("classes")
        change = self._impl.dataset_change({
            "samples": was["samples"], "num_classes": was["num_classes"], "hash": was["hash"],
            "classes": None if classes is None else [os.fsencode(name) for name in classes]})
        if change and strict:
            raise ValueError(f"state_dict was taken on another dataset: {change}. Resuming would give other "
                             "samples and labels at the same positions; load_state_dict(state, strict=False) "
                             "resumes anyway")
        if change:
            warnings.warn(f"pinfeed: resuming on a changed dataset (strict=False): {change}", RuntimeWarning,
                          stacklevel=3)

    def _consumer(self):
        """The stream the batch is handed to (Note [Consumer streams]): the
        given stream=, else torch's current stream of the device; 0 on the
        CPU backend (this thread)."""
        if self._device.type != "cuda":
            return 0
        stream = self._stream if self._stream is not None else torch.cuda.current_stream(self._device)
        return int(stream.cuda_stream)

    def _host_consumer(self):
        """device=None: where the batch may still be read after its tensors
        die. Once CUDA is initialized in the process, torch's current stream
        (or stream=) at the time the batch is yielded: a
        tensor.cuda(non_blocking=True) copy queued there reads the slot
        after the tensor is gone, so the slot goes back only after an event
        recorded on that stream when the tensors die."""
        if self._stream is not None:
            if isinstance(self._stream, _pinfeed.CpuConsumer):
                return self._stream
            index = self._stream.device.index
            return [("cuda", torch.cuda.current_device() if index is None else index, int(self._stream.cuda_stream))]
        if self._cuda_seen or (torch.cuda.is_available() and torch.cuda.is_initialized()):
            self._cuda_seen = True
            # The current device's stream, and local_rank's (docs/usage.md's
            # images.cuda(loader.local_rank, non_blocking=True)) when they differ.
            devices = {torch.cuda.current_device()}
            if self.local_rank < torch.cuda.device_count():
                devices.add(self.local_rank)
            return [("cuda", d, int(torch.cuda.current_stream(d).cuda_stream)) for d in sorted(devices)]
        return None

    @property
    def device(self):
        """The device batches are delivered on (None: CPU tensors over the pool's slots)."""
        return self._device

    def stats(self):
        """The current epoch's stats: images/s, stage times, pool and pressure
        state; with a device, "device": batches and bytes copied, device
        buffers made and the host's wait for copies."""
        out = json.loads(self._impl.stats_json())
        if self._device is not None:
            out["device"] = dict(self._impl.feed_stats())
        return out

    def live_batches(self):
        """Host batches whose tensors are still alive (each holds a pool slot;
        with device= the batches hold device buffers instead, and this is 0)."""
        return self._impl.live_batches()




def _fake_loader(data, batch_size=_default("batch_size"), shuffle=None, sampler=None, *, drop_last=False,
                 layout=_default("layout"), mean=_IMAGENET_MEAN, std=_IMAGENET_STD, rank=None, world_size=None,
                 local_rank=None, seed=None, device=None, copy=False, return_indices=False, size=None, **others):
    """Loader(FakeData(...), ...): the arguments that shape its batches are
    read; the others (threads, transform, ...) are checked by name and have
    nothing to do."""
    import inspect  # pylint: disable=import-outside-toplevel
    known = set(inspect.signature(Loader.__init__).parameters) | set(_OPTIONS) | set(_INSTEAD)
    for name in others:
        if name not in known:
            raise TypeError(f"Loader() got an unexpected keyword argument {name!r}")
    if sampler is not None and _iterated(sampler):
        raise TypeError("Loader(FakeData(...)) shards by rank as DistributedSampler does: pass no sampler, or a "
                        "DistributedSampler (torch's or pinfeed's)")
    shuffle, seed, trim, rank, world_size, _, _ = _reconcile_sampler(sampler, shuffle, seed, rank, world_size, None)
    rank, world_size, local_rank = _place_in_launch(rank, world_size, local_rank, {})
    layout = _LAYOUT_ALIASES.get(layout, layout) if isinstance(layout, str) else layout
    if layout not in _OPTIONS["layout"]["choices"]:
        raise ValueError(f"layout must be one of {_OPTIONS['layout']['choices']}, got {layout!r}")
    mean, std = _normalization(mean, std)
    batch_size = _int_arg("batch_size", batch_size, 1, 1 << 20)
    if isinstance(size, numbers.Integral):
        size = (size, size)
    out = _data.FakeLoader(data, batch_size, shuffle, seed, rank, world_size, trim, drop_last, layout, mean, std,
                           _parse_device(device, local_rank), copy, return_indices, size)
    if sampler is not None:
        out.sampler = sampler
    return out


# help() and IDEs show __init__'s arguments, not __new__'s (data, *args,
# **kwargs: it only routes a FakeData to its loader).
def _init_signature():
    import inspect  # pylint: disable=import-outside-toplevel
    sig = inspect.signature(Loader.__init__)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


Loader.__signature__ = _init_signature()

# The public classes are pinfeed's (pickles, reprs, help): not pinfeed._api's.
Loader.__module__ = DistributedSampler.__module__ = FakeData.__module__ = "pinfeed"

if Loader.__doc__ is not None:  # None under python -OO
    Loader.__doc__ += "\n    The loader's options (name=default: what; range), from its table:\n\n" + _options_doc() + "\n"
