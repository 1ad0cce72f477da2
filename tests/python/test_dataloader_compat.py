"""DataLoader's argument names mean what they mean in DataLoader: every row
of the migration table (docs/porting.md), through the real loader."""
import os
import warnings

import pytest
import torch

import pinfeed


def loader(dataset, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("size", 16)
    kw.setdefault("threads", 2)
    return pinfeed.Loader(str(dataset), **kw)


def order(l):
    return [int(i) for _, _, idx in l for i in idx]


def test_drop_last_drops_the_last_incomplete_batch_as_dataloader(dataset):
    # 40 samples in batches of 6: six full batches and one of 4.
    sizes = [len(labels) for _, labels in loader(dataset, batch_size=6)]
    assert sizes == [6] * 6 + [4]
    sizes = [len(labels) for _, labels in loader(dataset, batch_size=6, drop_last=True)]
    assert sizes == [6] * 6
    assert len(loader(dataset, batch_size=6, drop_last=True)) == 6
    with pytest.raises(TypeError, match="drop_last_batch is now drop_last"):
        loader(dataset, drop_last_batch=True)


def test_the_samplers_drop_last_trims_the_dataset_as_distributedsampler(dataset):
    def per_rank(trim):
        s = pinfeed.DistributedSampler(num_replicas=3, rank=0, shuffle=False, drop_last=trim)
        return sum(len(labels) for _, labels in loader(dataset, sampler=s))
    assert per_rank(False) == 14  # ceil(40 / 3): padded
    assert per_rank(True) == 13   # floor(40 / 3): trimmed
    ds = torch.utils.data.DistributedSampler(range(40), num_replicas=3, rank=0, shuffle=False, drop_last=True)
    assert sum(len(y) for _, y in loader(dataset, sampler=ds)) == 13


def test_a_torch_distributedsampler_gives_its_shard_order_and_seed(dataset):
    ds = torch.utils.data.DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=7)
    l = loader(dataset, sampler=ds, return_indices=True)
    assert (l.rank, l.world_size, l.seed, l.shuffle) == (1, 2, 7, True)
    mine = pinfeed.DistributedSampler(None, num_replicas=2, rank=1, shuffle=True, seed=7)
    # torch's sampler gives torch's order (order="torch"); pinfeed's, pinfeed's.
    ds.set_epoch(0)
    assert order(l) == list(ds) == order(loader(dataset, sampler=mine, order="torch", return_indices=True))
    assert order(loader(dataset, sampler=ds, order="pinfeed", return_indices=True)) == order(
        loader(dataset, sampler=mine, return_indices=True))
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        loader(dataset, sampler=mine, shuffle=True)
    # shuffle=False beside a sampler is fine, as in DataLoader: the sampler decides.
    assert loader(dataset, sampler=mine, shuffle=False).shuffle is True
    with pytest.raises(ValueError, match="rank=0 disagrees"):
        loader(dataset, sampler=mine, rank=0)
    # Any other sampler is iterated (tests/python/test_samplers.py); one that
    # yields no indices is refused naming what it needs.
    with pytest.raises(TypeError, match="iterable of dataset indices"):
        loader(dataset, sampler=object())


def test_shuffle_defaults_to_false_as_dataloader(dataset):
    assert order(loader(dataset, return_indices=True)) == list(range(40))
    assert order(loader(dataset, shuffle=True, return_indices=True)) != list(range(40))


def test_each_new_iteration_runs_the_next_epoch_unless_set_epoch_pinned_it(dataset):
    l = loader(dataset, shuffle=True, seed=3, return_indices=True)
    assert l.epoch is None
    e0 = order(l)
    assert l.epoch == 0
    e1 = order(l)
    assert l.epoch == 1
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(40))
    # Deterministic from the seed: a new loader walks the same epochs.
    again = loader(dataset, shuffle=True, seed=3, return_indices=True)
    assert [order(again), order(again)] == [e0, e1]
    # set_epoch pins: the same epoch on every iteration, as DistributedSampler.
    again.set_epoch(1)
    assert order(again) == e1 and order(again) == e1 and again.epoch == 1


def test_augmentation_changes_with_the_epoch_without_set_epoch(dataset):
    l = loader(dataset, transform="random", seed=1)
    first = next(iter(l))[0].clone()
    for _ in l:  # epoch 0 again (a peek does not advance), to its end
        pass
    second = next(iter(l))[0]  # epoch 1, the same first samples (no shuffle)
    assert not torch.equal(first, second)


def test_a_peek_at_the_first_batch_advances_alone_but_not_across_ranks(dataset):
    # One process: a new iter() after a partial pass draws a fresh epoch, as
    # DataLoader's RandomSampler does (issue 38: islice loops saw the same
    # samples every pass).
    l = loader(dataset, shuffle=True, seed=5, return_indices=True)
    peek = [int(i) for i in next(iter(l))[2]]
    e1 = order(l)
    assert l.epoch == 1 and e1[:len(peek)] != peek
    # Ranks: rank 0 looking at one batch (shapes, a logged sample) must not
    # put it an epoch ahead of the other ranks: only a completed epoch
    # advances, as DistributedSampler's epoch moves only with set_epoch.
    r = loader(dataset, shuffle=True, seed=5, return_indices=True, rank=0, world_size=2)
    peek = [int(i) for i in next(iter(r))[2]]
    e0 = order(r)
    assert e0[:len(peek)] == peek and r.epoch == 0
    assert order(r) != e0 and r.epoch == 1


def test_set_epoch_on_the_sampler_is_followed_as_dataloader_does(dataset):
    pinned = loader(dataset, shuffle=True, seed=2, return_indices=True, order="torch")
    pinned.set_epoch(3)
    e3 = order(pinned)
    # torch's sampler: its epoch is read at every iter(), as DataLoader reads it.
    ds = torch.utils.data.DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=True, seed=2)
    l = loader(dataset, sampler=ds, return_indices=True)
    e0 = order(l)
    assert order(l) == e0  # never set: epoch 0 every time, as with DataLoader
    ds.set_epoch(3)
    assert order(l) == e3 and l.epoch == 3
    # pinfeed's sampler: set_epoch pins; before it, completed epochs advance.
    mine = pinfeed.DistributedSampler(num_replicas=1, rank=0, shuffle=True, seed=2)
    m = loader(dataset, sampler=mine, return_indices=True, order="torch")
    assert order(m) == e0 and m.epoch == 0
    assert order(m) != e0 and m.epoch == 1
    mine.set_epoch(3)
    assert order(m) == e3 and order(m) == e3
    with pytest.raises(ValueError, match="non-negative"):
        mine.set_epoch(-1)


def test_state_dict_after_a_completed_epoch_resumes_at_the_next(dataset):
    l = loader(dataset, shuffle=True, seed=4, return_indices=True)
    assert l.state_dict()["epoch"] == 0 and l.state_dict()["position"] == 0
    order(l)
    state = l.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    e1 = order(l)
    fresh = loader(dataset, shuffle=True, seed=4, return_indices=True)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state  # pending, not yet used
    assert order(fresh) == e1
    assert fresh.state_dict()["epoch"] == 2


def test_num_workers_is_taken_as_threads_with_one_warning(dataset):
    pinfeed._compat._warned_num_workers = False
    with pytest.warns(UserWarning, match="num_workers=3 is taken as threads=3"):
        l = loader(dataset, threads=None, num_workers=3)
    assert l.num_workers == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader(dataset, threads=None, num_workers=2)  # once per process
    with pytest.raises(TypeError, match="not both"):
        loader(dataset, threads=2, num_workers=2)


def test_prefetch_factor_counts_batches_ahead_and_persistent_workers_is_accepted(dataset):
    l = loader(dataset, threads=None, num_workers=2, prefetch_factor=2, persistent_workers=True)
    assert l.pin_report()["slots"] == 2 + 1  # ahead, plus the batch the loop holds
    assert l.prefetch == 3
    with pytest.raises(ValueError, match="prefetch_factor"):
        loader(dataset, prefetch_factor=0)
    with pytest.raises(TypeError, match="not both"):
        loader(dataset, prefetch=3, prefetch_factor=2)
    with pytest.raises(TypeError, match="persistent_workers"):
        loader(dataset, persistent_workers="yes")


def test_pin_memory_false_gives_pageable_batches(dataset):
    assert loader(dataset, pin_memory=False).pin_report()["pinned_slots"] == 0


def test_scale_and_ratio_are_randomresizedcrops(dataset):
    wide = loader(dataset, transform="random", scale=(0.9, 1.0), ratio=(0.99, 1.01), flip=False, seed=2)
    tight = loader(dataset, transform="random", scale=(0.08, 0.1), ratio=(0.99, 1.01), flip=False, seed=2)
    assert not torch.equal(next(iter(wide))[0], next(iter(tight))[0])
    with pytest.raises(ValueError):
        loader(dataset, scale=(0.9, 0.5))  # out of order: named by the C++ check
    with pytest.raises(TypeError, match="not both"):
        loader(dataset, scale=(0.5, 1.0), scale_min=0.3)
    with pytest.raises(TypeError, match="pair"):
        loader(dataset, ratio=0.75)


def test_classes_class_to_idx_and_samples_are_imagefolders(dataset):
    torchvision = pytest.importorskip("torchvision")
    ref = torchvision.datasets.ImageFolder(str(dataset))
    l = loader(dataset)
    assert l.classes == ref.classes
    assert l.class_to_idx == ref.class_to_idx
    assert [(os.path.realpath(p), y) for p, y in l.samples] == [(os.path.realpath(p), y) for p, y in ref.samples]


def test_hidden_and_empty_class_folders_are_treated_as_torchvision_treats_them(tmp_path):
    """Every sub-folder is a class, hidden ones too; one without an image is refused by both."""
    torchvision = pytest.importorskip("torchvision")
    from PIL import Image
    root = tmp_path / "train"
    for name in ("cat", "dog", ".hidden"):
        (root / name).mkdir(parents=True)
        Image.new("RGB", (40, 30), (200, 100, 50)).save(root / name / "0.jpg")
    ref = torchvision.datasets.ImageFolder(str(root))
    l = loader(root)
    assert l.classes == ref.classes == [".hidden", "cat", "dog"]
    assert [y for _, y in l.samples] == [y for _, y in ref.samples]
    (root / ".ipynb_checkpoints").mkdir()  # what Jupyter leaves behind
    with pytest.raises(FileNotFoundError, match=r"\.ipynb_checkpoints"):
        torchvision.datasets.ImageFolder(str(root))
    with pytest.raises(pinfeed.DataError, match=r"no image file .* class folder '\.ipynb_checkpoints'"):
        loader(root)


def test_return_paths_names_the_files_of_every_batch(dataset):
    l = loader(dataset, shuffle=True, return_indices=True, return_paths=True)
    samples = l.samples
    for images, labels, indices, paths in l:
        assert len(paths) == len(indices) == images.shape[0]
        assert paths == [samples[i][0] for i in indices]
        assert labels.tolist() == [samples[i][1] for i in indices]
    assert l.paths([0]) == [samples[0][0]]


def test_size_as_height_width_gives_non_square_batches(dataset):
    images, _ = next(iter(loader(dataset, size=(12, 20))))
    assert images.shape == (8, 3, 12, 20)
    images, _ = next(iter(loader(dataset, size=(12, 20), layout="nhwc-u8")))
    assert images.shape == (8, 12, 20, 3)
    with pytest.raises(TypeError, match="not both"):
        loader(dataset, size=(12, 20), height=12)


def test_flip_takes_a_probability(dataset):
    def first(**kw):
        return next(iter(loader(dataset, transform="random", seed=4, layout="nhwc-u8", **kw)))[0]
    never, always = first(flip=False), first(flip=1.0)
    assert torch.equal(torch.flip(never, dims=[2]), always), "p=1 flips every sample, after the same crop"
    assert torch.equal(first(flip=0.0), never)
    with pytest.raises(ValueError):
        loader(dataset, flip=1.5)


def test_interpolation_as_a_string_or_torchvisions_mode(dataset):
    def first(**kw):
        return next(iter(loader(dataset, transform="full", layout="nhwc-u8", **kw)))[0]
    nearest, bilinear = first(interpolation="nearest"), first()
    assert not torch.equal(nearest, bilinear)
    transforms = pytest.importorskip("torchvision.transforms")
    modes = transforms.InterpolationMode
    assert torch.equal(first(interpolation=modes.NEAREST), nearest)
    if hasattr(modes, "NEAREST_EXACT"):  # torchvision >= 0.15
        assert torch.equal(first(interpolation=modes.NEAREST_EXACT), nearest)
    assert torch.equal(first(interpolation=transforms.InterpolationMode.BILINEAR), bilinear)
    assert not torch.equal(first(interpolation=modes.BICUBIC), bilinear)
    assert torch.equal(first(interpolation=modes.BICUBIC), first(interpolation="bicubic"))
    with pytest.raises(ValueError, match="interpolation"):
        loader(dataset, interpolation="lanczos")


def test_a_checkpoint_at_an_epochs_end_resumes_at_the_epoch_the_sampler_names(dataset):
    # The DDP loop: sampler.set_epoch(e) every epoch, state_dict() saved after
    # it, a restart that loads it and calls set_epoch(e + 1).
    def torch_loader():
        ds = torch.utils.data.DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=True, seed=6)
        return ds, loader(dataset, sampler=ds, return_indices=True)
    ds, l = torch_loader()
    ds.set_epoch(2)
    order(l)
    state = l.state_dict()
    assert (state["epoch"], state["position"]) == (3, 0)
    ds.set_epoch(3)
    e3 = order(l)
    ds2, resumed = torch_loader()
    resumed.load_state_dict(state)
    ds2.set_epoch(3)
    assert order(resumed) == e3 and resumed.epoch == 3
    # A set_epoch that disagrees with the state wins: its epoch from the start.
    ds3, other = torch_loader()
    other.load_state_dict(state)
    ds3.set_epoch(2)
    assert len(order(other)) == 40 and other.epoch == 2
    # An older checkpoint taken at the very end of epoch 2: epoch 2 is done.
    ds4, old = torch_loader()
    old.load_state_dict(dict(state, epoch=2, position=40))
    ds4.set_epoch(2)
    assert len(order(old)) == 40 and old.epoch == 2  # the sampler said 2: it runs
    plain = loader(dataset, shuffle=True, seed=6, return_indices=True, order="torch")
    plain.load_state_dict(dict(state, epoch=2, position=40))
    assert order(plain) == e3 and plain.epoch == 3  # nobody pinned: the next epoch


def test_loader_set_epoch_reaches_a_torch_sampler(dataset):
    ds = torch.utils.data.DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=True, seed=2)
    l = loader(dataset, sampler=ds, return_indices=True)
    l.set_epoch(3)
    assert ds.epoch == 3
    pinned = loader(dataset, shuffle=True, seed=2, return_indices=True, order="torch")
    pinned.set_epoch(3)
    assert order(l) == order(pinned) and l.epoch == 3


def test_an_epoch_counts_as_done_at_its_last_batch_without_stopiteration(dataset):
    # A loop that stops after len(loader) steps (islice, a step budget) never
    # asks for the StopIteration; the epoch is over all the same.
    import itertools
    l = loader(dataset, shuffle=True, seed=8, return_indices=True)
    e0 = [int(i) for _, _, idx in itertools.islice(l, len(l)) for i in idx]
    assert sorted(e0) == list(range(40))
    assert (l.state_dict()["epoch"], l.state_dict()["position"]) == (1, 0)
    e1 = order(l)
    assert l.epoch == 1 and e1 != e0
    # One batch short of the end is not done: state_dict resumes there; a new
    # iteration (one process) runs the next epoch, as DataLoader would.
    short = loader(dataset, shuffle=True, seed=8, return_indices=True)
    list(itertools.islice(short, len(short) - 1))
    assert short.state_dict()["epoch"] == 0 and 0 < short.state_dict()["position"] < 40
    assert order(short) == e1 and short.epoch == 1
