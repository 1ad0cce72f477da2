"""Sample order: pinfeed's DistributedSampler, reading torch's sampler, an
epoch's list over the ranks as torch's DistributedSampler makes it, and
the Loader's epoch order (a mixin of pinfeed.Loader)."""

import array
import hashlib
import math
import numbers
import operator

import torch  # pinfeed._api imported it first, or said why it cannot

from . import _data, _pinfeed
from ._options import _default


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


class _OrderMixin:
    """Loader's epochs: their order, length and draws."""

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
