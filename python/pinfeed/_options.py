"""The loader's options and their Python spellings: the option table from
C++ (the keyword defaults, the checks, the docstring's option list), and
the conversions of torchvision's and DataLoader's argument forms into it."""

import numbers
import struct
import warnings
from typing import Any, Callable, Literal, Optional, TypedDict

import torch  # pinfeed._api imported it first, or said why it cannot

from . import _pinfeed


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


class LoaderOptions(TypedDict, total=False):
    """The option table's rows that Loader takes by their own name only (its
    other rows are among Loader's named arguments, some in DataLoader's or
    torchvision's spelling: _KEYWORD_FOR). Loader's signature ends with
    ``**options: Unpack[LoaderOptions]``, so IDEs and type checkers know
    every keyword; help(pinfeed.Loader) shows each with its default.
    tests/python/test_options.py holds this list to the C++ table."""
    height: int
    scale_min: float
    scale_max: float
    ratio_min: float
    ratio_max: float
    flip_p: float
    dct_scaling: bool
    roi_decode: bool
    max_replacements: int
    max_image_pixels: int
    pin_method: Literal["auto", "mlock", "cuda"]
    pinned_fraction: float
    local_ranks: int
    watch_pressure: bool
    pressure_floor: int
    held_warning: int
    held_limit: int
    cache_limit: int
    remote_timeout: float
    remote_min_rate: float
    remote_retries: int
    remote_readahead: int
    remote_streams: int
    # DataLoader's arguments that Loader accepts only at DataLoader's default
    # (so that **loader_kwargs written for DataLoader pass through):
    # _compat._DATALOADER_DEFAULTS, and _INSTEAD says what to use instead.
    collate_fn: Optional[Callable[..., Any]]
    batch_sampler: Any
    worker_init_fn: Optional[Callable[[int], None]]
    generator: Any
    timeout: float
    multiprocessing_context: Any
    pin_memory_device: str
    in_order: bool


def _default(name):
    return _OPTIONS[name]["default"]


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
