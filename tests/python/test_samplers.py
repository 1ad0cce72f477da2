"""Samplers and orders as PyTorch users rely on them (issue 29): any
sampler's own indices are taken (never silently replaced by pinfeed's
order), order="torch" reproduces torch's DistributedSampler exactly, and a
state saved by N ranks resumes on M ranks with every sample of the epoch
seen once. Through the real loader on the suite's 40-image dataset."""
import collections
import itertools

import pytest
import torch

import pinfeed

N = 40  # conftest's dataset: 4 classes x 12, minus the val split


def loader(dataset, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("size", 16)
    kw.setdefault("threads", 2)
    kw.setdefault("return_indices", True)
    return pinfeed.Loader(str(dataset), **kw)


def order(l, batches=None):
    """The indices of the next `batches` batches (all: the rest of the epoch)."""
    return [int(i) for _, _, idx in itertools.islice(l, batches) for i in idx]


class SkipFirst(torch.utils.data.DistributedSampler):
    """A subclass that changes the order: drops the first `skip` indices of each epoch."""

    def __init__(self, skip, **kw):
        super().__init__(range(N), **kw)
        self.skip = skip

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self):
        return super().__len__() - self.skip


def test_a_sampler_subclass_is_iterated_not_replaced(dataset):
    s = SkipFirst(10, num_replicas=1, rank=0, shuffle=True, seed=4)
    l = loader(dataset, sampler=s)
    s.set_epoch(2)
    assert order(l) == list(s)
    assert len(l) == 30 // 4 + 1 and l.epoch == 2
    s.set_epoch(3)
    assert order(l) == list(s) and l.epoch == 3


def test_any_torch_sampler_gives_its_indices(dataset):
    seq = torch.utils.data.SequentialSampler(range(N))
    assert order(loader(dataset, sampler=seq)) == list(range(N))
    subset = torch.utils.data.SubsetRandomSampler(torch.tensor([3, 1, 4, 15, 9, 26]),
                                                  generator=torch.Generator().manual_seed(1))
    expected = list(torch.utils.data.SubsetRandomSampler(torch.tensor([3, 1, 4, 15, 9, 26]),
                                                         generator=torch.Generator().manual_seed(1)))
    assert order(loader(dataset, sampler=subset)) == [int(i) for i in expected]
    weighted = torch.utils.data.WeightedRandomSampler([0.0] * 20 + [1.0] * 20, 12,
                                                      generator=torch.Generator().manual_seed(2))
    got = order(loader(dataset, sampler=weighted))
    assert len(got) == 12 and all(i >= 20 for i in got)


def test_a_sampler_yielding_no_index_is_refused_naming_it(dataset):
    batches = torch.utils.data.BatchSampler(range(N), 4, False)
    with pytest.raises(TypeError, match="yielded \\[0, 1, 2, 3\\], not a dataset index"):
        order(loader(dataset, sampler=batches))
    with pytest.raises(ValueError, match="index 40 at place 1, outside the dataset's 40 samples"):
        order(loader(dataset, sampler=[0, 40, 1]))
    with pytest.raises(ValueError, match="yielded index -1"):
        order(loader(dataset, sampler=[0, -1]))


@pytest.mark.parametrize("world,shuffle,trim", [(1, True, False), (3, True, False), (3, True, True),
                                                (7, False, False), (6, True, True)])
def test_order_torch_is_torchs_distributedsampler_sample_for_sample(dataset, world, shuffle, trim):
    for rank in sorted({0, world - 1}):
        ours = loader(dataset, order="torch", sampler=pinfeed.DistributedSampler(
            num_replicas=world, rank=rank, shuffle=shuffle, seed=11, drop_last=trim))
        theirs = torch.utils.data.DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=shuffle,
                                                     seed=11, drop_last=trim)
        for epoch in (0, 5):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert order(ours) == list(theirs), (rank, epoch)
        assert len(ours) == -(-len(theirs) // 4)
    # torch's own sampler with order="torch" is iterated as it is.
    theirs = torch.utils.data.DistributedSampler(range(N), num_replicas=2, rank=1, shuffle=True, seed=3)
    theirs.set_epoch(4)
    assert order(loader(dataset, order="torch", sampler=theirs)) == list(theirs)
    with pytest.raises(ValueError, match="order must be one of"):
        loader(dataset, order="numpy")


def seen_by(loaders, batches):
    """Every rank's first `batches` batches, in lockstep; then each rank's state."""
    seen = []
    for l in loaders:
        seen += order(l, batches)
    return seen, [l.state_dict() for l in loaders]


@pytest.mark.parametrize("ordering", ["pinfeed", "torch"])
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4)])
def test_an_epoch_resumed_on_another_world_size_sees_each_sample_once(dataset, ordering, before, after):
    def ranks(world):
        return [loader(dataset, order=ordering, rank=r, world_size=world, shuffle=True, seed=5) for r in range(world)]
    first = ranks(before)
    for l in first:
        l.set_epoch(1)
    seen, states = seen_by(first, 3)
    assert len(seen) == 3 * 4 * before
    second = ranks(after)
    for l in second:
        l.load_state_dict(states[0])  # rank 0's checkpoint resumes every rank
    rest = []
    for l in second:
        rest += order(l)
        assert l.epoch == 1
    counts = collections.Counter(seen + rest)
    assert sorted(counts) == list(range(N))
    assert set(counts.values()) == {1}, "every sample of the epoch once"
    # The next epoch is a whole one over the new world.
    nxt = []
    for l in second:
        nxt += order(l)
        assert l.epoch == 2
    assert sorted(nxt) == list(range(N))


def test_a_resharded_epoch_can_be_saved_and_resumed_again(dataset):
    two = [loader(dataset, rank=r, world_size=2, shuffle=True, seed=8) for r in range(2)]
    seen, states = seen_by(two, 2)          # 16 seen
    one = loader(dataset, shuffle=True, seed=8)
    one.load_state_dict(states[1])          # any rank's state
    assert len(one) == N // 4            # a whole epoch (StatefulDataLoader); 24 // 4 batches run
    seen += order(one, 2)                   # 8 more
    state = one.state_dict()
    assert state["resharded_from"] == [[2, 8]] and state["position"] == 8 and state["world_size"] == 1
    again = [loader(dataset, rank=r, world_size=2, shuffle=True, seed=8) for r in range(2)]
    for l in again:
        l.load_state_dict(state)
    for l in again:
        seen += order(l)
    assert sorted(seen) == list(range(N))
    # A position past the resharded epoch's end is refused.
    bad = dict(states[0], position=21)
    with pytest.raises(ValueError, match="outside the epoch"):
        loader(dataset, shuffle=True, seed=8).load_state_dict(bad)


def test_padding_repeats_only_as_distributedsampler_does(dataset):
    # 1 -> 3 ranks: 28 samples left, 10 per rank, 2 repeated as padding.
    one = loader(dataset, shuffle=True, seed=2)
    seen = order(one, 3)
    three = [loader(dataset, rank=r, world_size=3, shuffle=True, seed=2) for r in range(3)]
    rest = []
    for l in three:
        l.load_state_dict(one.state_dict())
        got = order(l)
        assert len(got) == 10
        rest += got
    counts = collections.Counter(seen + rest)
    assert sorted(counts) == list(range(N))
    assert sum(c - 1 for c in counts.values()) == 2


def test_an_iterated_sampler_cannot_be_resharded(dataset):
    s = SkipFirst(0, num_replicas=2, rank=0, shuffle=False)
    l = loader(dataset, sampler=s)
    order(l, 1)
    state = l.state_dict()
    with pytest.raises(ValueError, match="orders each rank itself"):
        loader(dataset, sampler=SkipFirst(0, num_replicas=1, rank=0, shuffle=False)).load_state_dict(state)
    # The same world size resumes it where it stopped.
    again = loader(dataset, sampler=SkipFirst(0, num_replicas=2, rank=0, shuffle=False))
    again.load_state_dict(state)
    assert order(again) == list(s)[4:]


def test_a_random_samplers_resumed_order_is_checked(dataset):
    def sampler(seed):
        return torch.utils.data.RandomSampler(range(N), generator=torch.Generator().manual_seed(seed))
    l = loader(dataset, sampler=sampler(1))
    seen = order(l, 2)
    state = l.state_dict()
    assert state["order"] == "sampler" and "order_digest" in state
    # The same generator state gives the same order: the rest of the epoch, once.
    again = loader(dataset, sampler=sampler(1))
    again.load_state_dict(state)
    assert sorted(seen + order(again)) == list(range(N))
    # Another draw is refused (it would repeat and skip samples) unless strict=False.
    other = loader(dataset, sampler=sampler(2))
    with pytest.raises(ValueError, match="gives another order for epoch 0"):
        other.load_state_dict(state)
    with pytest.warns(RuntimeWarning, match="another order"):
        other.load_state_dict(state, strict=False)
    assert len(order(other)) == N - 8


def test_a_fresh_torch_sampler_follows_the_loaded_epoch(dataset):
    def ranks():
        return torch.utils.data.DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=6)
    s = ranks()
    l = loader(dataset, sampler=s)
    s.set_epoch(3)
    seen = order(l, 2)
    state = l.state_dict()
    assert state["epoch"] == 3 and state["order"] == "torch"
    fresh = loader(dataset, sampler=ranks())   # its epoch is 0 until told
    fresh.load_state_dict(state)
    rest = order(fresh)
    assert fresh.epoch == 3 and seen + rest == list(ranks_epoch(3))


def ranks_epoch(epoch):
    s = torch.utils.data.DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=6)
    s.set_epoch(epoch)
    return list(s)


def test_a_state_of_another_order_or_trim_is_refused(dataset):
    l = loader(dataset, shuffle=True, seed=3)
    order(l, 1)
    state = l.state_dict()
    with pytest.raises(ValueError, match="order='pinfeed', this loader has order='torch'"):
        loader(dataset, shuffle=True, seed=3, order="torch").load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True, this loader has shuffle=False"):
        loader(dataset, seed=3).load_state_dict(state)
    trimmed = pinfeed.DistributedSampler(num_replicas=1, rank=0, shuffle=True, seed=3, drop_last=True)
    with pytest.raises(ValueError, match="sampler_drop_last"):
        loader(dataset, sampler=trimmed).load_state_dict(dict(state, sampler_drop_last=False))


def test_torchs_sampler_of_another_dataset_is_refused(dataset):
    with pytest.raises(ValueError, match="the sampler's dataset has 30 samples, the loader's data 40"):
        loader(dataset, sampler=torch.utils.data.DistributedSampler(range(30), num_replicas=1, rank=0))


def test_len_follows_the_epoch_that_runs_next(dataset):
    two = [loader(dataset, rank=r, world_size=2, shuffle=True, seed=8) for r in range(2)]
    _, states = seen_by(two, 2)
    one = loader(dataset, shuffle=True, seed=8)
    one.load_state_dict(states[0])
    assert len(one) == N // 4           # len() is an epoch's, as StatefulDataLoader's after a resume
    assert sum(1 for _ in one) == 24 // 4  # the resharded remainder runs
    one.set_epoch(1)
    assert len(one) == N // 4
