"""The CUDA twin of test_device.py: device="cuda" and the non_blocking rule
on a real GPU, with torch's own streams. Skipped where torch sees no CUDA
device; bench/gpu_check.sh runs it on a GPU machine."""
import pytest
import torch

import pinfeed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")


def loader(dataset, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("size", 32)
    kw.setdefault("threads", 2)
    kw.setdefault("return_indices", True)
    return pinfeed.Loader(str(dataset), **kw)


def reference(dataset, **kw):
    return [(x.clone(), y.clone(), list(i)) for x, y, i in loader(dataset, copy=True, **kw)]


def test_cuda_batches_equal_cpu_batches_moved_by_hand(dataset):
    kw = dict(transform="center", shuffle=True, seed=1)
    want = reference(dataset, **kw)
    l = loader(dataset, device="cuda", **kw)
    n = 0
    for (a, b, i), (c, d, j) in zip(want, l):
        assert c.is_cuda and d.is_cuda and c.dtype == torch.float32 and d.dtype == torch.int64
        assert i == j
        assert torch.allclose(c, a.cuda(), atol=1e-6, rtol=0), float((c - a.cuda()).abs().max())
        assert torch.equal(d, b.cuda())
        n += 1
    assert n == len(want)


def test_device_batches_under_a_slow_consumer_stream(dataset):
    # Every batch waits behind a long kernel on torch's current stream: the
    # copies run ahead on the loader's stream, the hand-over makes the
    # consumer wait for them, and the buffers are reused only after it.
    kw = dict(transform="random", seed=7, shuffle=True, prefetch=2)
    for epoch in range(3):
        want = [(a.cuda(), b.cuda()) for a, b, _ in reference(dataset, **kw)]
        l = loader(dataset, device="cuda", **kw)
        sums = []
        for x, y, _ in l:
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the batch is read
            sums.append((x.double().sum(), y.sum()))
        torch.cuda.synchronize()
        assert len(sums) == len(want)
        for (s, t), (a, b) in zip(sums, want):
            assert torch.allclose(s, a.double().sum(), rtol=1e-9) and int(t) == int(b.sum())


def test_non_blocking_copies_from_slots_under_a_slow_stream(dataset):
    # device=None, the README's old advice: images.cuda(non_blocking=True),
    # the tensors dropped at once. The copy is queued behind a long kernel;
    # the slot must not go back before it has run.
    kw = dict(transform="random", seed=3, shuffle=True, prefetch=2)
    want = [(a.cuda(), b.cuda()) for a, b, _ in reference(dataset, **kw)]
    torch.cuda.init()
    l = loader(dataset, **kw)
    got = []
    for x, y, _ in l:
        torch.cuda._sleep(5_000_000)
        got.append((x.cuda(non_blocking=True), y.cuda(non_blocking=True)))
        del x, y
    torch.cuda.synchronize()
    assert len(got) == len(want)
    for (a, b), (c, d) in zip(want, got):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_stream_argument_and_dtype_on_cuda(dataset):
    want = reference(dataset, transform="center")
    s = torch.cuda.Stream()
    l = loader(dataset, device="cuda", transform="center", stream=s, dtype=torch.float16,
               memory_format=torch.channels_last)
    with torch.cuda.stream(s):
        for (a, _, _), (c, _, _) in zip(want, l):
            assert c.dtype == torch.float16 and c.is_contiguous(memory_format=torch.channels_last)
            assert torch.allclose(c.float(), a.cuda(), atol=0.01, rtol=0.001)


def test_slots_belong_to_the_rank_s_gpu_and_torch_keeps_its_device(dataset):
    """The pool registers its slots with the GPU the batches go to (device=),
    else the local rank's: never device 0 in every rank. Making a loader and
    its feed, iterating and dropping them leave torch's current device as
    torch set it."""
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)
    feed = loader(dataset, device=f"cuda:{last}")
    assert feed.pin_report()["cuda_device"] == last
    assert sum(1 for _ in feed) > 0 and torch.cuda.current_device() == last
    plain = loader(dataset, local_rank=last)
    assert plain.pin_report()["cuda_device"] == last  # torch has a context: its current device
    del feed, plain
    assert torch.cuda.current_device() == last
