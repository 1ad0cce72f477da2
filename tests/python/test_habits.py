"""A training loop's habits, each next to what torch's DataLoader does in the
same loop (issue 38): keeping parts of batches, loops stopped early, a
prefetching daemon thread at exit, a shard rewritten under the loader,
prefetch=1. The pressure half (a real memory cgroup) is in
tests/pressure/loop_pressure.py."""
import gc
import io
import itertools
import os
import random
import re
import subprocess
import sys
import tarfile
import textwrap

import pytest
import torch

import pinfeed
from conftest import data_tool

BATCH = 8


@pytest.fixture(scope="module")
def eighty(tmp_path_factory):
    """4 classes x 20 JPEGs: 80 samples, 10 batches of 8."""
    root = tmp_path_factory.mktemp("eighty")
    subprocess.run([data_tool(), "-q", "make", "--out", str(root), "--classes", "4", "--per-class", "20",
                    "--val", "0", "--seed", "7"], check=True)
    return root / "train"


def make(data, **kw):
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("size", 32)
    kw.setdefault("threads", 2)
    return pinfeed.Loader(str(data), **kw)


def rss_bytes():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024


class Cycle:
    """A batch held only by a reference cycle: freed by the next gc, not before."""

    def __init__(self, images):
        self.images, self.me = images, self


def habit_loop(batches, epochs):
    """What users do with batches: keep the labels, a preview image, a loss
    whose graph holds the input, and drop a reference cycle on the floor."""
    w = torch.ones(1, requires_grad=True)
    labels_kept, previews, losses = [], [], []
    seen = 0
    for _ in range(epochs):
        for images, labels in batches():
            labels_kept.append(labels)
            previews.append(images[0])
            losses.append((images.float().mean() * w).sum())  # the graph keeps `images`
            Cycle(images)
            seen += len(labels)
    return seen, labels_kept, previews, losses


def test_keeping_parts_of_batches_works_as_with_dataloader(eighty):
    import torchvision
    from torchvision import transforms
    # DataLoader: the same loop completes (its held batches cost their memory).
    tv = torchvision.datasets.ImageFolder(str(eighty), transform=transforms.Compose(
        [transforms.Resize(32), transforms.CenterCrop(32), transforms.ToTensor()]))
    dl = torch.utils.data.DataLoader(tv, batch_size=BATCH, shuffle=True)
    assert habit_loop(lambda: dl, 3)[0] == 240

    gc.collect()
    l = make(eighty, prefetch=2, shuffle=True)
    slot = l.stats()["pool"]["slot_bytes"]
    before = rss_bytes()
    seen, labels_kept, previews, losses = habit_loop(lambda: l, 3)
    assert seen == 240
    # The labels are the program's own small tensors, never views of a slot.
    assert all(t.storage().size() == len(t) for t in labels_kept)
    pool = l.stats()["pool"]
    # Every batch is still held (previews and losses keep their images): each
    # one the pool needed back was lent to the program and replaced.
    assert l.live_batches() == 30
    assert pool["lent_slots"] >= 30 - 2 and pool["lent_bytes"] == pool["lent_slots"] * slot
    # RSS: what the program holds (30 batches) plus the pool, and some slack.
    assert rss_bytes() - before <= (30 + 2) * slot + (48 << 20)
    # Dropping them gives the lent memory back (the cycles need the gc).
    del labels_kept, previews, losses
    gc.collect()
    pool = l.stats()["pool"]
    assert l.live_batches() == 0 and pool["lent_slots"] == 0 and pool["lent_bytes"] == 0
    # The pool kept its own slots all along, and runs on.
    assert pool["live_slots"] == pool["slots"] == 2
    assert sum(len(y) for _, y in l) == 80


def test_a_loop_that_keeps_every_batch_and_prefetch_1(eighty):
    for prefetch in (1, 2):
        l = make(eighty, prefetch=prefetch, return_indices=True)
        kept = [(x, i) for x, _, i in l]
        assert sorted(int(k) for _, idx in kept for k in idx) == list(range(80))
        kept = [(x, i) for x, _, i in l]  # a second epoch, the first still held
        assert len(kept) == 10
    # prefetch=0 is refused by name.
    with pytest.raises(ValueError, match="prefetch"):
        make(eighty, prefetch=0)


def test_held_limit_refuses_naming_the_cause_after_a_gc(eighty):
    l = make(eighty, prefetch=2)
    slot = l.stats()["pool"]["slot_bytes"]
    l = make(eighty, prefetch=2, held_limit=3 * slot)
    held = []
    with pytest.raises(pinfeed.Error, match=r"held by the program"):
        for images, _ in l:
            held.append(images)
    assert 3 <= len(held) <= 6
    # Batches held only by cycles are collected before a refusal.
    l = make(eighty, prefetch=2, held_limit=3 * slot)
    for images, _ in l:
        Cycle(images)
    del images
    gc.collect()


def test_held_batches_warn_once_past_the_bound(eighty, capfd):
    l = make(eighty, prefetch=2)
    slot = l.stats()["pool"]["slot_bytes"]
    l = make(eighty, prefetch=2, held_warning=2 * slot)
    held = [images for images, _ in l]
    err = capfd.readouterr().err
    assert len(re.findall(r"held by the program", err)) == 1, err
    assert len(held) == 10


def islice_passes(batches, passes=6, steps=3):
    seen, firsts = set(), []
    for _ in range(passes):
        got = [int(i) for b in itertools.islice(batches(), steps) for i in b]
        firsts.append(tuple(got[:BATCH]))
        seen.update(got)
    return seen, firsts


def test_epochs_stopped_early_advance_as_with_dataloader(eighty):
    # DataLoader, shuffle=True: each iter() draws a fresh permutation.
    torch.manual_seed(0)
    dl = torch.utils.data.DataLoader(range(80), batch_size=BATCH, shuffle=True)
    dl_seen, dl_firsts = islice_passes(lambda: dl)
    l = make(eighty, shuffle=True, seed=0, return_indices=True)
    seen, firsts = islice_passes(lambda: (idx for _, _, idx in l))
    assert len(set(firsts)) == 6 == len(set(dl_firsts))  # a new order every pass
    assert len(seen) >= min(len(dl_seen), 60), (len(seen), len(dl_seen))
    # shuffle=False: the same samples, but new augmentation each pass.
    fixed = make(eighty, shuffle=False, return_indices=True, transform="random")
    a = next(iter(fixed))
    b = next(iter(fixed))
    assert a[2].tolist() == b[2].tolist() and not torch.equal(a[0], b[0])
    # torch's DistributedSampler without set_epoch: the same order every
    # pass, as DataLoader with it; set_epoch decides.
    sampler = torch.utils.data.DistributedSampler(range(80), num_replicas=1, rank=0, shuffle=True, seed=0)
    dl = torch.utils.data.DataLoader(range(80), batch_size=BATCH, sampler=sampler)
    l = make(eighty, sampler=torch.utils.data.DistributedSampler(range(80), num_replicas=1, rank=0, shuffle=True,
                                                                 seed=0), return_indices=True)
    dl_seen, dl_firsts = islice_passes(lambda: dl)
    seen, firsts = islice_passes(lambda: (idx for _, _, idx in l))
    assert firsts == [tuple(int(i) for i in f) for f in dl_firsts] and len(set(firsts)) == 1
    assert seen == dl_seen


PREFETCHER = textwrap.dedent("""
    import queue, sys, threading, time
    import pinfeed
    loader = pinfeed.Loader(sys.argv[1], batch_size=8, size=32, threads=2, prefetch=2)
    q = queue.Queue(maxsize=2)
    def work():
        while True:
            for batch in loader:
                q.put(batch)
    threading.Thread(target=work, daemon=True).start()
    for _ in range(int(sys.argv[2])):
        q.get()
    if sys.argv[3] == "interrupt":
        import _thread
        threading.Timer(0.2, _thread.interrupt_main).start()
        try:
            time.sleep(5)
        except KeyboardInterrupt:
            sys.exit(3)
    sys.exit(0)
""")


def test_a_daemon_thread_prefetching_at_exit_never_aborts(eighty, tmp_path):
    script = tmp_path / "prefetcher.py"
    script.write_text(PREFETCHER)
    env = dict(os.environ, PYTHONFAULTHANDLER="")
    runs = [("exit", 3, 0)] * 16 + [("exit", 0, 0)] * 2 + [("interrupt", 2, 3)] * 2
    results = []
    for k in range(0, len(runs), 4):
        procs = [(subprocess.Popen([sys.executable, str(script), str(eighty), str(n), how], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), want)
                 for how, n, want in runs[k:k + 4]]
        for p, want in procs:
            out, _ = p.communicate(timeout=120)
            results.append((p.returncode, want, out[-2000:]))
    bad = [r for r in results if r[0] != r[1]]
    assert not bad, bad[0]


def write_shard(path, samples, order):
    """A WebDataset shard of (jpeg bytes, label) in `order`."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for k in order:
            data, label = samples[k]
            for name, payload in ((f"s{k:04d}.jpg", data), (f"s{k:04d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(payload), 1700000000
                tar.addfile(info, io.BytesIO(payload))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_shard_rewritten_in_place_is_refused_naming_it(eighty, tmp_path, keep_mtime):
    files = sorted(p for p in eighty.rglob("*.jpg"))
    classes = sorted({p.parent.name for p in files})
    samples = [(p.read_bytes(), classes.index(p.parent.name)) for p in files[:32]]
    shard = tmp_path / "shard.tar"
    write_shard(shard, samples, range(32))
    rewritten = tmp_path / "other.tar"
    order = list(range(32))
    random.Random(1).shuffle(order)
    write_shard(rewritten, samples, order)
    assert shard.stat().st_size == rewritten.stat().st_size
    l = make(shard, shuffle=False, prefetch=2, batch_size=4, return_paths=True)
    it = iter(l)
    first = next(it)
    stat = shard.stat()
    with open(shard, "r+b") as f:  # the same inode, the same size, other members
        f.write(rewritten.read_bytes())
    if keep_mtime:  # a copy tool that keeps times: only the member headers tell
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    truth = {f"s{k:04d}.jpg": samples[k][1] for k in range(32)}
    got = [(first[1], first[2])]
    with pytest.raises(pinfeed.DataError, match=re.escape(str(shard))):
        for _, labels, paths in it:
            got.append((labels, paths))
    # Nothing delivered came under a wrong label.
    for labels, paths in got:
        for label, path in zip(labels.tolist(), paths):
            assert truth[path.rsplit(":", 1)[1]] == label, path
