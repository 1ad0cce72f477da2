"""What DataLoader users reach through the loader besides batches:
loader.dataset and loader.sampler with DataLoader's meaning, the subsets a
loader takes (torch.utils.data.Subset of a path-backed dataset, indices=),
and FakeData, the --dummy of training scripts (batches from memory, no
files). Imported by pinfeed._api (torch)."""

import array
import numbers
import operator
import os
import weakref

import torch

from . import _pinfeed
from ._compat import _INSTEAD
from ._device import _parse_device
from ._launch import _place_in_launch
from ._options import _IMAGENET_MEAN, _IMAGENET_STD, _LAYOUT_ALIASES, _OPTIONS, _default, _int_arg, _normalization


def per_rank(n, world, trim):
    """Samples per rank of an epoch of n over `world` ranks, as torch's
    DistributedSampler counts them (padded, or trimmed with drop_last)."""
    if trim and n % world != 0:
        return max(0, -(-(n - world) // world))
    return -(-n // world)


class Subset:
    """The sample indices a loader is restricted to (a Subset's, or
    indices=): position i of the loader's dataset is sample indices[i] of
    the data's. A range stays a range; a list is kept as int64."""

    def __init__(self, indices):
        if isinstance(indices, range):
            self.indices = indices
        else:
            try:
                self.indices = array.array("q", (operator.index(i) for i in indices))
            except TypeError:
                raise TypeError("indices must be integers (a range, a list, a tensor of sample indices)") from None

    def __len__(self):
        return len(self.indices)

    def check(self, size, data):
        """Every index is a sample of the data (size samples)."""
        if len(self.indices) == 0:
            raise ValueError(f"the subset of {data} is empty: no sample to load")
        lo, hi = min(self.indices), max(self.indices)
        if lo < 0 or hi >= size:
            bad = lo if lo < 0 else hi
            raise IndexError(f"subset index {bad} is not a sample of {data} ({size} samples: 0..{size - 1})")

    def map(self, order, source):
        """An order of positions in the subset as sample indices of the data."""
        n, idx = len(self.indices), self.indices
        out = []
        for k, i in enumerate(order):
            if not 0 <= i < n:
                raise ValueError(f"{source} gave index {i} at place {k}: the loader's dataset is a subset of {n} "
                                 f"samples (0..{n - 1})")
            out.append(idx[i])
        return out

    def digest(self):
        import hashlib  # pylint: disable=import-outside-toplevel
        if isinstance(self.indices, range):
            key = f"range({self.indices.start},{self.indices.stop},{self.indices.step})".encode()
        else:
            key = self.indices.tobytes()
        return hashlib.blake2b(key, digest_size=8).hexdigest()


def _is_torch_subset(data):
    return isinstance(data, torch.utils.data.Subset)


def is_fake(data):
    """pinfeed.FakeData, or torchvision's FakeData (read for its size, image
    size and classes)."""
    if isinstance(data, FakeData):
        return True
    cls = type(data)
    return cls.__name__ == "FakeData" and cls.__module__.startswith("torchvision") and hasattr(data, "image_size")


def resolve(data, indices):
    """(path, Subset or None) for data= and indices=: a path, or a
    torch.utils.data.Subset (nested too) of a path-backed dataset (a
    loader's .dataset, or a torchvision ImageFolder/DatasetFolder, checked
    against the loader's own scan by the caller)."""
    subset_of, folder = None, None
    chain = []
    while _is_torch_subset(data):
        chain.append(data.indices)
        data = data.dataset
    if chain:
        composed = list(range(len(data))) if hasattr(data, "__len__") else None
        if composed is None:
            raise TypeError(f"the Subset's dataset ({type(data).__name__}) has no len()")
        for level in reversed(chain):  # the innermost Subset first
            composed = [composed[operator.index(i)] for i in level]
        subset_of = composed
    if isinstance(data, DatasetView):
        folder, view = data, data._subset
        data = data._spec
        if view is not None:  # a Subset of a subset's view: indices of the view's subset
            subset_of = list(view.indices) if subset_of is None else [view.indices[i] for i in subset_of]
    elif not isinstance(data, (str, os.PathLike)) and chain:
        root = getattr(data, "root", None)
        if not isinstance(root, (str, os.PathLike)) or not hasattr(data, "samples"):
            raise TypeError(f"a Subset of {type(data).__name__}: pinfeed loads a Subset of a dataset with files on "
                            "disk (a loader's .dataset, or an ImageFolder/DatasetFolder: .root and .samples)")
        folder, data = data, root
    if indices is not None:
        if subset_of is not None:
            raise TypeError("pass a Subset as data= or indices=, not both")
        subset_of = indices
    return data, (None if subset_of is None else Subset(subset_of)), folder


def check_folder(folder, loader, root):
    """A torchvision dataset a Subset was taken of: its samples must be the
    loader's, index for index (a custom is_valid_file or loader would shift
    every index)."""
    if isinstance(folder, DatasetView):
        if folder._base_size != loader._impl.dataset_size():
            raise ValueError(f"the Subset's dataset had {folder._base_size} samples, {folder.root} now has "
                             f"{loader._impl.dataset_size()}: the indices would name other files")
        return
    theirs, mine = folder.samples, loader.samples
    if len(theirs) != len(mine):
        raise ValueError(f"the Subset's {type(folder).__name__} has {len(theirs)} samples, pinfeed finds {len(mine)} "
                         f"in {folder.root}: the indices would name other files")
    root_t, root_m = os.fspath(folder.root), os.fsdecode(root)
    for i, ((pt, lt), (pm, lm)) in enumerate(zip(theirs, mine)):
        if lt != lm or os.path.relpath(pt, root_t) != os.path.relpath(pm, root_m):
            raise ValueError(f"the Subset's {type(folder).__name__} and pinfeed disagree on sample {i}: {pt} (label "
                             f"{lt}) there, {pm} (label {lm}) here: the indices would name other files")
    if getattr(folder, "transform", None) is not None:
        import warnings  # pylint: disable=import-outside-toplevel
        warnings.warn(f"pinfeed: the Subset's {type(folder).__name__} has a transform, which pinfeed does not run: "
                      "the loader's own transform=, size=, mean=, std= apply", UserWarning, stacklevel=4)


class DatasetView:
    """loader.dataset for a loader given a path: what DataLoader users read
    of an ImageFolder (len, classes, class_to_idx, samples, targets, root).
    A Subset of it is a loader's data too. Samples are decoded in batches
    by the loader, so there is no dataset[i]."""

    def __init__(self, loader, root, subset):
        self._loader = weakref.ref(loader)
        self._spec = os.fsdecode(root) if isinstance(root, bytes) else root  # as given: the loader's to open
        # As shown (repr, errors, a user's print): URLs without credentials,
        # signatures or a pipe: command's arguments (_pinfeed.redact_spec).
        self.root = _pinfeed.redact_spec(self._spec) if isinstance(self._spec, str) else self._spec
        self._subset = subset
        self._base_size = loader._impl.dataset_size()
        self._size = self._base_size if subset is None else len(subset)

    def _owner(self):
        loader = self._loader()
        if loader is None:
            raise ReferenceError(f"the pinfeed.Loader of this dataset ({self.root}) was deleted")
        return loader

    def __len__(self):
        return self._size

    def _pick(self, items):
        if self._subset is None:
            return items
        return [items[i] for i in self._subset.indices]

    @property
    def samples(self):
        """(path, label) of each sample, as ImageFolder.samples."""
        return self._pick(self._owner().samples)

    imgs = samples

    @property
    def targets(self):
        """The label of each sample, as ImageFolder.targets."""
        return [label for _, label in self.samples]

    @property
    def classes(self):
        return self._owner().classes

    @property
    def class_to_idx(self):
        return self._owner().class_to_idx

    def __getitem__(self, index):
        raise TypeError("pinfeed's dataset has no per-sample access: the loader decodes whole batches in C++. "
                        "dataset.samples[i] is sample i's (path, label); iterate the loader for pixels")

    def __repr__(self):
        kind = "Subset of " if self._subset is not None else ""
        return f"Dataset pinfeed ({kind}{self.root})\n    Number of datapoints: {self._size}"


class SamplerView:
    """loader.sampler for a loader without sampler=: this rank's indices of
    the loader's dataset in the epoch the loader runs next (pinfeed's
    DistributedSampler of the launch), len() of them, and set_epoch(e),
    which is the loader's (DDP scripts call loader.sampler.set_epoch)."""

    def __init__(self, loader):
        self._loader = weakref.ref(loader)

    def _owner(self):
        loader = self._loader()
        if loader is None:
            raise ReferenceError("the pinfeed.Loader of this sampler was deleted")
        return loader

    def set_epoch(self, epoch):
        self._owner().set_epoch(epoch)

    @property
    def epoch(self):
        return self._owner()._epoch

    def __len__(self):
        return self._owner()._samples_in_epoch()

    def __iter__(self):
        return iter(self._owner()._view_order(self._owner()._epoch))

    @property
    def num_replicas(self):
        return self._owner().world_size

    @property
    def rank(self):
        return self._owner().rank

    @property
    def shuffle(self):
        return self._owner().shuffle

    @property
    def seed(self):
        return self._owner().seed

    @property
    def drop_last(self):
        return self._owner()._trim

    def __repr__(self):
        o = self._owner()
        return (f"pinfeed sampler of the loader (rank {o.rank} of {o.world_size}, shuffle={o.shuffle}, "
                f"seed={o.seed})")


class FakeData:
    """torchvision.datasets.FakeData's counterpart for pinfeed.Loader: `size`
    samples of `image_size` (C, H, W) with labels in [0, num_classes), made
    in memory, no files: Loader(FakeData(...), batch_size=..., device=...)
    yields batches of the configured layout as fast as the loop takes them
    (the --dummy of training scripts, smoke tests, a model's speed without
    input). A torchvision FakeData instance is taken the same way."""

    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, random_offset=0, shared_batches=False):
        self.size = _positive("size", size)
        # Each batch is a tensor of its own (x.mul_(2) in a loop changes that
        # batch only); shared_batches=True hands out views of one tensor,
        # for a loop that only reads them (no copy per batch).
        self.shared_batches = bool(shared_batches)
        try:
            c, h, w = image_size
        except (TypeError, ValueError):
            raise ValueError(f"image_size must be (channels, height, width), got {image_size!r}") from None
        if c != 3:
            raise ValueError(f"image_size: pinfeed's batches are RGB (3 channels), got {c}")
        self.image_size = (3, _positive("image_size height", h, 1 << 15), _positive("image_size width", w, 1 << 15))
        self.num_classes = _positive("num_classes", num_classes)
        self.random_offset = operator.index(random_offset)

    def __len__(self):
        return self.size

    def __repr__(self):
        shared = ", shared_batches=True" if self.shared_batches else ""
        return (f"pinfeed.FakeData(size={self.size}, image_size={self.image_size}, num_classes={self.num_classes}, "
                f"random_offset={self.random_offset}{shared})")


def _positive(name, value, hi=1 << 40):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= hi:
        raise ValueError(f"{name} must be an integer in [1, {hi}], got {value!r}")
    return int(value)


def dataloader_attributes(loader):
    """DataLoader's attributes that a script may read (to log its loader, or
    to pass on), at the only values Loader takes for them: its defaults as
    arguments (_compat._DATALOADER_DEFAULTS); batching and collation are the
    loader's own."""
    loader.batch_sampler = loader.generator = loader.collate_fn = loader.worker_init_fn = None
    loader.multiprocessing_context = None
    loader.timeout = 0


class FakeLoader:
    """The loader of a FakeData: DataLoader's loop, sharding, len(),
    set_epoch, .dataset, .sampler, state_dict, with batches made once in
    memory (random pixels of the shape and layout asked for, normalized as
    the real loader normalizes; labels a fixed function of the index).
    Every batch is a tensor of its own, unless FakeData(shared_batches=True)
    asks for views of one (copy=True: always its own)."""

    def __init__(self, data, batch_size, shuffle, seed, rank, world_size, trim, drop_last, layout, mean, std,
                 device, copy, return_indices, size_given):
        self.dataset = data
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size, self._trim, self.drop_last = rank, world_size, trim, drop_last
        self.copy, self.return_indices = copy or not getattr(data, "shared_batches", False), return_indices
        self._n, self.num_classes = int(data.size), int(data.num_classes)
        self._offset = int(getattr(data, "random_offset", 0))
        _, h, w = (int(v) for v in data.image_size)
        if size_given is not None and tuple(size_given) != (h, w):
            raise ValueError(f"size={size_given} but the FakeData's image_size is {(h, w)}: its batches have its "
                             "size (pass one of them)")
        g = torch.Generator()
        g.manual_seed(seed + self._offset)
        pixels = torch.randint(0, 256, (batch_size, h, w, 3), dtype=torch.uint8, generator=g)
        if layout == "nhwc-u8":
            images = pixels
        else:
            m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
            s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
            images = ((pixels.permute(0, 3, 1, 2).float() / 255.0) - m) / s
            images = images.contiguous()
        self.device = device
        self._images = images if device is None else images.to(device)
        self._epoch, self._pinned, self._current, self._completed = 0, False, None, False
        self._resume = 0
        self.sampler = SamplerView(self)
        dataloader_attributes(self)

    def __len__(self):
        n = self._samples_in_epoch()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _samples_in_epoch(self):
        return per_rank(self._n, self.world_size, self._trim)

    def _view_order(self, epoch):
        return list(_pinfeed.sampler_indices(self._n, self.rank, self.world_size, self.shuffle, self.seed,
                                             self._trim, epoch))

    def set_epoch(self, epoch):
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._epoch, self._pinned = int(epoch), True

    @property
    def epoch(self):
        return self._current

    def _labels(self, indices):
        t = torch.tensor(indices, dtype=torch.int64)
        # A fixed mix of the index (splitmix's multiplier): labels spread over
        # every class, the same for an index in every epoch and run.
        return ((t + self._offset) * 0x9E3779B1 % 2147483647) % self.num_classes

    def __iter__(self):
        given = self.sampler
        if not isinstance(given, SamplerView) and getattr(given, "_epoch_set", True) and \
                isinstance(getattr(given, "epoch", None), int):
            self._epoch, self._pinned = given.epoch, True  # a DistributedSampler's set_epoch, as DataLoader reads it
        epoch, start = self._epoch, self._resume
        self._resume, self._current, self._completed = 0, epoch, False
        order = self._view_order(epoch)
        end = (len(order) // self.batch_size) * self.batch_size if self.drop_last else len(order)
        for pos in range(start, end, self.batch_size):
            indices = order[pos:min(pos + self.batch_size, end)]
            images = self._images[:len(indices)]
            if self.copy:
                images = images.clone()
            labels = self._labels(indices)
            if self.device is not None:
                labels = labels.to(self.device)
            self._position = pos + len(indices)
            if self._position >= end:
                self._finish()
            yield (images, labels, torch.tensor(indices)) if self.return_indices else (images, labels)
        self._finish()

    def _finish(self):
        if not self._completed:
            self._completed = True
            if not self._pinned:
                self._epoch = self._current + 1

    def state_dict(self):
        if self._current is None or self._completed:
            epoch = self._epoch if self._current is None else self._current + 1 if not self._pinned else self._epoch
            return {"fake": True, "seed": self.seed, "epoch": epoch, "position": 0, "world_size": self.world_size}
        return {"fake": True, "seed": self.seed, "epoch": self._current, "position": self._position,
                "world_size": self.world_size}

    def load_state_dict(self, state, strict=True):
        """A FakeData loader's own state_dict(), for this world size and
        seed (strict=False: another seed is taken with a warning)."""
        if not isinstance(state, dict) or state.get("fake") is not True:
            raise ValueError("load_state_dict: not a FakeData loader's state_dict() (a real pinfeed.Loader's state "
                             "goes to a Loader over the same data)")
        for key in ("epoch", "position"):
            v = state.get(key)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"state_dict[{key!r}] must be a non-negative integer, got {v!r}")
        if state.get("world_size") != self.world_size:
            raise ValueError(f"state_dict is of world_size {state.get('world_size')!r}, this loader's is "
                             f"{self.world_size}: positions are per rank")
        if state.get("seed") != self.seed:
            if strict:
                raise ValueError(f"state_dict is of seed {state.get('seed')!r}, this loader's is {self.seed}: "
                                 "another order (strict=False resumes anyway)")
            import warnings  # pylint: disable=import-outside-toplevel
            warnings.warn(f"pinfeed: resuming a state_dict of seed {state.get('seed')!r} with seed {self.seed}",
                          RuntimeWarning, stacklevel=2)
        n = self._samples_in_epoch()
        end = n // self.batch_size * self.batch_size if self.drop_last else n
        if state["position"] > end:
            raise ValueError(f"state_dict position {state['position']} is past the epoch's end ({end} samples "
                             "per rank)")
        self._epoch, self._resume = int(state["epoch"]), int(state["position"])

    def stats(self):
        return {"fake": True, "samples": self._n}

    def __repr__(self):
        return f"pinfeed.Loader({self.dataset!r}, batch_size={self.batch_size}) (batches from memory)"


def fake_loader(data, batch_size=_default("batch_size"), shuffle=None, sampler=None, *, drop_last=False,
                 layout=_default("layout"), mean=_IMAGENET_MEAN, std=_IMAGENET_STD, rank=None, world_size=None,
                 local_rank=None, seed=None, device=None, copy=False, return_indices=False, size=None, **others):
    """Loader(FakeData(...), ...): the arguments that shape its batches are
    read; the others (threads, transform, ...) are checked by name and have
    nothing to do."""
    import inspect  # pylint: disable=import-outside-toplevel
    from ._api import Loader  # pylint: disable=import-outside-toplevel  (the caller: imported)
    from ._order import _iterated, _reconcile_sampler  # pylint: disable=import-outside-toplevel  (it imports this)
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
    out = FakeLoader(data, batch_size, shuffle, seed, rank, world_size, trim, drop_last, layout, mean, std,
                     _parse_device(device, local_rank), copy, return_indices, size)
    if sampler is not None:
        out.sampler = sampler
    return out
