"""A DataLoader script ported by changing its constructor only: what such
scripts read besides batches (loader.dataset, loader.sampler.set_epoch,
Subset of the dataset, FakeData for --dummy), the default log, and the
arguments that used to be accepted without a word (issue 39)."""
import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torchvision

import pinfeed

N = 40  # the dataset fixture's samples


def make(data, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("size", 16)
    kw.setdefault("threads", 1)
    return pinfeed.Loader(data, **kw)


def run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


# --- The same script, two loaders ----------------------------------------

def imagenet_style_epochs(train_loader, val_loader, world_size, epochs=2):
    """What pytorch/examples' imagenet/main.py does with its loaders (the
    sampler's set_epoch, len(dataset), the validation remainder as a Subset
    of val_loader.dataset, validated by a second loader), written once."""
    seen = []
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)
        labels = []
        for _, target in train_loader:
            labels += target.tolist()
        seen.append(labels)
    val = [t for _, t in val_loader for t in t.tolist()]
    n_val = len(val_loader.sampler) * world_size
    rest = None
    if len(val_loader.dataset) > n_val:
        rest = torch.utils.data.Subset(val_loader.dataset, range(n_val, len(val_loader.dataset)))
    return seen, val, rest, list(train_loader.dataset.classes), len(train_loader.dataset)


def test_a_dataloader_script_runs_unchanged_but_the_constructor(dataset):
    """Rank 0 of 3: the validation set (40) leaves 40 - 3 * 13 = 1 sample
    to the remainder Subset, which a second loader of each kind loads."""
    tv = torchvision.datasets.ImageFolder(str(dataset), transform=torchvision.transforms.Compose([
        torchvision.transforms.Resize((16, 16)), torchvision.transforms.ToTensor()]))
    sampler = torch.utils.data.DistributedSampler(tv, num_replicas=3, rank=0, shuffle=True, seed=1)
    val_sampler = torch.utils.data.DistributedSampler(tv, num_replicas=3, rank=0, shuffle=False, drop_last=True)
    theirs = imagenet_style_epochs(torch.utils.data.DataLoader(tv, batch_size=4, sampler=sampler),
                                   torch.utils.data.DataLoader(tv, batch_size=4, sampler=val_sampler), 3)
    sampler = torch.utils.data.DistributedSampler(range(N), num_replicas=3, rank=0, shuffle=True, seed=1)
    val_sampler = torch.utils.data.DistributedSampler(range(N), num_replicas=3, rank=0, shuffle=False,
                                                      drop_last=True)
    mine = imagenet_style_epochs(make(str(dataset), sampler=sampler), make(str(dataset), sampler=val_sampler), 3)
    assert mine[0] == theirs[0], "the same labels in the same order, epoch after epoch (set_epoch through .sampler)"
    assert mine[1] == theirs[1]
    assert mine[3:] == theirs[3:]
    assert len(mine[2]) == len(theirs[2]) == 1
    rest_tv = [t for _, t in torch.utils.data.DataLoader(theirs[2], batch_size=4) for t in t.tolist()]
    rest_mine = [t for _, t in make(mine[2]) for t in t.tolist()]
    assert rest_mine == rest_tv


def test_dataset_and_sampler_mean_what_dataloader_gives(dataset):
    ref = torchvision.datasets.ImageFolder(str(dataset))
    loader = make(str(dataset), rank=1, world_size=3, shuffle=True, seed=4, drop_last=True, return_indices=True)
    d = loader.dataset
    assert len(d) == N and d.classes == ref.classes and d.class_to_idx == ref.class_to_idx
    assert d.samples == ref.samples and d.targets == ref.targets and d.root == str(dataset)
    assert (loader.batch_size, loader.drop_last) == (4, True)
    with pytest.raises(TypeError, match="no per-sample access"):
        d[0]
    s = loader.sampler
    assert len(s) == 14 and (s.num_replicas, s.rank, s.shuffle, s.seed) == (3, 1, True, 4)
    for epoch in (3, 0):
        s.set_epoch(epoch)
        expected = list(s)
        got = [i for _, _, idx in loader for i in idx.tolist()]
        assert loader.epoch == epoch
        assert got == expected[:12], "the sampler's indices, in its order (drop_last: 3 whole batches)"
    given = torch.utils.data.SequentialSampler(range(N))
    assert make(str(dataset), sampler=given).sampler is given


def test_a_subset_loads_its_indices_with_torchvisions_labels(dataset):
    ref = torchvision.datasets.ImageFolder(str(dataset))
    picks = [39, 0, 17, 17, 5, 22, 31]
    subset = torch.utils.data.Subset(ref, picks)
    loader = make(subset, return_indices=True)
    assert loader.dataset is subset and len(loader.dataset) == 7 and len(loader) == 2
    indices, labels = [], []
    for _, y, i in loader:
        indices += i.tolist()
        labels += y.tolist()
    assert indices == picks, "indices are the data's: loader.samples[i] is the sample"
    assert labels == [ref.targets[i] for i in picks]
    # indices= is the same, and a Subset of a Subset composes.
    assert [i for *_, i in make(str(dataset), indices=range(30, 37), return_indices=True) for i in i.tolist()] == \
        list(range(30, 37))
    nested = torch.utils.data.Subset(torch.utils.data.Subset(ref, range(10, 30)), [0, 19])
    assert [i for *_, i in make(nested, return_indices=True) for i in i.tolist()] == [10, 29]
    # Sharded as DistributedSampler shards the Subset: positions in it.
    sharded = torch.utils.data.DistributedSampler(subset, num_replicas=2, rank=1, shuffle=True, seed=2)
    expected = [picks[k] for k in sharded]
    got = [i for *_, i in make(subset, sampler=sharded, return_indices=True) for i in i.tolist()]
    assert got == expected
    with pytest.raises(IndexError, match="subset index 40 is not a sample"):
        make(str(dataset), indices=[3, 40])
    with pytest.raises(ValueError, match="empty"):
        make(str(dataset), indices=[])


def test_a_subset_of_another_folder_or_order_is_refused(dataset, tmp_path):
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    src = next(p for p in (dataset / os.listdir(dataset)[0]).iterdir())
    for k in range(3):
        os.symlink(src, other / "x" / f"{k}.jpg")
    ref = torchvision.datasets.ImageFolder(str(other))
    os.symlink(src, other / "x" / "9.jpg")  # pinfeed's scan now has one more
    with pytest.raises(ValueError, match="has 3 samples, pinfeed finds 4"):
        make(torch.utils.data.Subset(ref, [0]))
    state = make(str(dataset), indices=range(0, 20)).state_dict()
    with pytest.raises(ValueError, match="subset="):
        make(str(dataset), indices=range(20, 40)).load_state_dict(state)


def test_fakedata_gives_batches_from_memory_sharded_as_the_real_loader(dataset):
    fake = torchvision.datasets.FakeData(size=50, image_size=(3, 32, 24), num_classes=7)
    ranks = [pinfeed.Loader(fake, batch_size=8, rank=r, world_size=2, shuffle=True, seed=1, return_indices=True)
             for r in range(2)]
    assert [len(l) for l in ranks] == [4, 4] and len(ranks[0].dataset) == 50
    seen = []
    for l in ranks:
        l.sampler.set_epoch(2)
        for images, labels, indices in l:
            assert images.shape[1:] == (3, 32, 24) and images.dtype == torch.float32
            assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() < 7
            seen += indices.tolist()
    assert sorted(set(seen)) == list(range(50)) and len(seen) == 50, "each sample once over the ranks"
    assert abs(float(images.mean())) < 0.5, "normalized as the real loader's batches"
    u8 = pinfeed.Loader(pinfeed.FakeData(size=9, image_size=(3, 8, 8)), batch_size=4, layout="nhwc-u8",
                        drop_last=True, num_workers=8, pin_memory=True)
    batches = [x for x, _ in u8]
    assert len(batches) == len(u8) == 2 and batches[0].shape == (4, 8, 8, 3) and batches[0].dtype == torch.uint8
    with pytest.raises(ValueError, match="FakeData's image_size"):
        make(fake, size=224)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        pinfeed.Loader(fake, bogus=1)


def test_fakedata_batches_are_their_own_and_a_foreign_state_is_refused():
    """x.mul_(2) in a loop changes that batch only, as with DataLoader; a
    state of another kind, world size, seed or past the epoch is refused."""
    loader = pinfeed.Loader(pinfeed.FakeData(size=12, image_size=(3, 8, 8)), batch_size=4, seed=5)
    first = [x.clone() for x, _ in loader]
    for x, _ in loader:
        x.mul_(2)
    assert all(torch.equal(a, b) for a, b in zip(first, (x for x, _ in loader))), "an in-place op compounded"
    shared = pinfeed.Loader(pinfeed.FakeData(size=12, image_size=(3, 8, 8), shared_batches=True), batch_size=4)
    a, b = (x for x, _ in list(shared)[:2])
    assert a.data_ptr() == b.data_ptr(), "shared_batches=True: views of one tensor"
    state = loader.state_dict()
    for bad, says in (({**state, "position": 10**9}, "past the epoch's end"),
                      ({**state, "world_size": 2}, "world_size"),
                      ({**state, "seed": 6}, "seed"),
                      ({"epoch": 0, "position": 0, "seed": 5, "world_size": 1}, "not a FakeData")):
        with pytest.raises(ValueError, match=says):
            pinfeed.Loader(pinfeed.FakeData(size=12, image_size=(3, 8, 8)), batch_size=4, seed=5).load_state_dict(bad)
    with pytest.warns(RuntimeWarning, match="seed"):
        pinfeed.Loader(pinfeed.FakeData(size=12, image_size=(3, 8, 8)), batch_size=4, seed=5).load_state_dict(
            {**state, "seed": 6}, strict=False)


def test_dataloaders_attributes_are_there_at_their_values(dataset):
    """batch_sampler, generator, collate_fn and the rest: DataLoader has
    them, and a script that reads them (logging its loader) must not fail."""
    reference = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    for loader in (make(str(dataset)), pinfeed.Loader(pinfeed.FakeData(size=8, image_size=(3, 8, 8)), batch_size=4)):
        for name in ("batch_sampler", "generator", "collate_fn", "worker_init_fn", "timeout",
                     "multiprocessing_context"):
            assert hasattr(reference, name) and hasattr(loader, name), name
        assert loader.batch_sampler is None and loader.generator is None and loader.timeout == 0


def test_len_is_the_whole_epoch_after_a_resume_as_statefuldataloader(dataset):
    """torchdata's StatefulDataLoader keeps len() after load_state_dict; the
    resumed iteration yields the rest. The same with another world size."""
    for world in (1, 2):
        first = make(str(dataset), shuffle=True, seed=3, rank=0, world_size=world)
        it = iter(first)
        next(it), next(it)
        state = first.state_dict()
        resumed = make(str(dataset), shuffle=True, seed=3)
        resumed.load_state_dict(state)
        assert len(resumed) == N // 4
        left = sum(1 for _ in resumed)
        assert left == (N - 2 * 4 * world) // 4
        assert len(resumed) == N // 4


def test_the_default_log_is_warnings_only(dataset):
    out = run(f"import pinfeed; l = pinfeed.Loader({str(dataset)!r}, batch_size=4, size=16, threads=1); "
              "[b for b in l]")
    assert out.returncode == 0, out.stderr
    assert "[info]" not in out.stderr, out.stderr
    out = run(f"import pinfeed; pinfeed.set_log_level('info'); "
              f"l = pinfeed.Loader({str(dataset)!r}, batch_size=4, size=16, threads=1, sampler=[7]); [b for b in l]")
    assert out.returncode == 0, out.stderr
    assert "epoch 0: 1 samples on rank 0 of 1" in out.stderr, out.stderr
    assert "per rank per epoch" not in out.stderr


@pytest.mark.parametrize("kwargs,message", [
    (dict(size=(0, 16)), "size must be positive integers"),
    (dict(size=(16, -1)), "size must be positive integers"),
    (dict(layout="nhwc-u8", mean=(0.5, 0.5, 0.5)), "mean= and std= are not applied"),
    (dict(layout="uint8", std=0.2), "mean= and std= are not applied"),
    (dict(std=1e-45), "std under 1e-6"),
])
def test_arguments_that_used_to_be_taken_silently_are_refused(dataset, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(str(dataset), **kwargs)


def test_half_a_launch_is_refused_naming_the_missing_variable(dataset):
    code = f"import pinfeed; pinfeed.Loader({str(dataset)!r}, batch_size=4, size=16, threads=1)"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(env, RANK="1"),
                         timeout=120)
    assert out.returncode != 0 and "RANK=1 is set but WORLD_SIZE is not" in out.stderr, out.stderr


def test_a_loader_is_not_copied_or_pickled(dataset):
    l = make(str(dataset))
    for f in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be"):
            f(l)


@pytest.mark.parametrize("field,value", [
    ("epoch", "3"), ("position", -4), ("world_size", 0), ("rank", 5), ("seed", 1.5), ("shuffle", "yes"),
    ("order", "random"), ("resharded_from", [[2]]), ("dataset", {"samples": 40}), ("subset", 7)])
def test_a_tampered_state_names_the_field(dataset, field, value):
    l = make(str(dataset))
    state = l.state_dict()
    state[field] = value
    with pytest.raises(ValueError, match=f"state_dict\\['{field}'\\]"):
        l.load_state_dict(state)


def test_a_state_of_a_huge_world_costs_no_memory_of_its_size(dataset):
    """A (tampered or foreign) state saying 50,000,000 ranks: the remainder
    is computed from the list's length, not by building the padded list
    (+760 MiB before). In a fresh process, so that its peak RSS is this."""
    out = run(f"""
import resource, pinfeed
l = pinfeed.Loader({str(dataset)!r}, batch_size=4, size=16, threads=1, shuffle=True)
state = dict(l.state_dict(), world_size=50_000_000, rank=0, position=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
l.load_state_dict(state)
got = sum(len(y) for _, y in l)
print(got, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)""")
    assert out.returncode == 0, out.stderr
    got, grown_mib = map(int, out.stdout.split())
    assert got == N
    assert grown_mib < 64, f"loading the state grew the process by {grown_mib} MiB"


def test_a_million_line_file_list_costs_its_names_and_goes_with_the_loader(tmp_path):
    """1,000,000 entries: their names once, in one buffer (a path object per
    entry cost +294 MiB, twice torchvision's list, and stayed after del)."""
    listing = tmp_path / "list.txt"
    with open(listing, "w") as f:
        f.writelines(f"class_{i % 1000:03d}/n{i:08d}.JPEG {i % 1000}\n" for i in range(1_000_000))
    out = run(f"""
import gc, pinfeed
pinfeed.Loader  # torch and the module imported before the first reading
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = rss()
l = pinfeed.Loader({str(listing)!r}, list_root={str(tmp_path)!r}, batch_size=4, size=16, threads=1)
assert len(l.dataset) == 1_000_000
held = rss() - before
del l
gc.collect()
print(round(held), round(rss() - before))""")
    assert out.returncode == 0, out.stderr
    held, left = map(int, out.stdout.split())
    assert held < 80, f"the loader of a 1,000,000-line list holds {held} MiB"
    assert left < 16, f"{left} MiB stay after the loader is gone"
