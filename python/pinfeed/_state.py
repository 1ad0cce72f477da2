"""State and resume: a state_dict's checks, and the Loader's state_dict /
load_state_dict (a mixin of pinfeed.Loader)."""

import numbers
import os
import warnings

from ._order import DistributedSampler, _ORDERS, _digest


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


class _StateMixin:
    """Loader's state_dict and load_state_dict, and their checks."""

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
