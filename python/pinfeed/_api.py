"""The loader's Python side (pinfeed.Loader and friends): imported, with
torch, on first use of any of them through the package (pinfeed/__init__.py),
so that the command-line tools start without torch."""

import contextlib
import gc
import json
import numbers
import operator
import os
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
from ._compat import _DATALOADER_DEFAULTS, _check_arguments, _dataloader_alias
from ._device import _DeviceMixin, _parse_device
from ._launch import _place_in_launch, launch_env
from ._options import (_IMAGENET_MEAN, _IMAGENET_STD, _LAYOUT_ALIASES, LoaderOptions, _check_device_arguments,
                       _default, _fold_transform_arguments, _hooks, _normalization, _options_doc)
from ._order import DistributedSampler, _OrderMixin, _digest, _reconcile_sampler
from ._state import _StateMixin

try:  # PEP 692's Unpack, for **options (typing's from 3.11; type checkers bring typing_extensions)
    from typing import Unpack
except ImportError:
    Unpack = None


class Loader(_StateMixin, _DeviceMixin, _OrderMixin):
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
    Shards in object storage: data= may name http://, https://, s3://bucket/
        key and pipe:COMMAND shards (brace patterns too). Shards with index
        sidecars (NAME.tar.index.json: written by pinfeed-data pack, or
        pinfeed-data index) stream: each sample is a Range request made
        ahead along the epoch's order, at most remote_readahead bytes ahead
        (shrunk under memory pressure), remote_streams at once; stats()
        ["remote"] counts them. If any shard lacks a sidecar (or is pipe:
        or a presigned URL), the whole set is fetched first instead (Range
        resume, retries: remote_timeout, remote_retries). Either way
        cache_dir keeps whole shards across runs (shared by a node's ranks,
        bounded by cache_limit bytes); without it nothing stays. Order,
        fingerprint and resume are those of the same shards on disk. S3 takes
        AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials),
        AWS_REGION, AWS_ENDPOINT_URL. A transfer that fails for good raises
        pinfeed.Error naming the URL and the HTTP status.
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
            return _data.fake_loader(data, *args, **kwargs)
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
                 batch_transform=None, batch_fn=None, indices=None, cache_dir=None, _copy_delay_us=0,
                 **options: "Unpack[LoaderOptions]"):
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
            "max_classes": max_classes, "max_replaced_share": max_replaced_share,
            **({} if cache_dir is None else {"cache_dir": os.fspath(cache_dir)}), **options,
        }, feed)
        self.batch_size, self.drop_last, self.shuffle = batch_size, drop_last, shuffle
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_workers, self.prefetch = self._impl.threads(), prefetch
        self.copy, self.return_indices, self.return_paths = copy, return_indices, return_paths
        self.pin_memory = pin_memory
        _data.dataloader_attributes(self)
        if self._subset is not None:
            self._subset.check(self._impl.dataset_size(), _pinfeed.redact_spec(os.fsdecode(data)))
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


    def stats(self):
        """The current epoch's stats: images/s, stage times, pool and pressure
        state; with a device, "device": batches and bytes copied, device
        buffers made and the host's wait for copies; with streamed remote
        shards, "remote": requests, bytes, retries, waits and the read-ahead
        (bytes now, peak, bound)."""
        out = json.loads(self._impl.stats_json())
        if self._device is not None:
            out["device"] = dict(self._impl.feed_stats())
        return out

    def live_batches(self):
        """Host batches whose tensors are still alive (each holds a pool slot;
        with device= the batches hold device buffers instead, and this is 0)."""
        return self._impl.live_batches()


# help() shows __init__'s arguments (not __new__'s, which routes FakeData), **options spelled
# out (a keyword per LoaderOptions row, its default) and no private test knob (_copy_delay_us).
def _init_signature():
    import inspect  # pylint: disable=import-outside-toplevel
    sig = inspect.signature(Loader.__init__)
    params = [p for p in list(sig.parameters.values())[1:] if p.kind is not p.VAR_KEYWORD and p.name[0] != "_"]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind, default=_DATALOADER_DEFAULTS[
        name] if name in _DATALOADER_DEFAULTS else _default(name)) for name, kind in LoaderOptions.__annotations__.items()]
    return sig.replace(parameters=params)


Loader.__signature__ = _init_signature()

# pinfeed.launch_env is looked up here (pinfeed/__init__.py's _HOME): after
# the torch check above.
__all__ = ["Loader", "DistributedSampler", "FakeData", "launch_env"]

# The public classes are pinfeed's (pickles, reprs, help): not pinfeed._api's.
Loader.__module__ = DistributedSampler.__module__ = FakeData.__module__ = "pinfeed"

if Loader.__doc__ is not None:  # None under python -OO
    Loader.__doc__ += "\n    The loader's options (name=default: what; range), from its table:\n\n" + _options_doc() + "\n"
