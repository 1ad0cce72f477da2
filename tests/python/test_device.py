"""device=: batches delivered on a device by the loader's own copy stream
(Note [Consumer streams] in trainer/device/include/pinfeed/trainer/device_feed.hpp).
Here the device is the CPU backend ("cpu": real memory, a copy thread per
stream, copies delayed on demand), so the whole mechanism runs: the copy
from the pool slot, the slot's return after the copy's event, normalization
on the "device", the hand-over to the consumer and the reuse of the device
buffers. bench/gpu_check.sh runs the CUDA twin of these checks."""
import os

import pytest
import torch

import pinfeed


def loader(dataset, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("size", 16)
    kw.setdefault("threads", 2)
    kw.setdefault("return_indices", True)
    return pinfeed.Loader(str(dataset), **kw)


def reference(dataset, **kw):
    """The same batches through the host path, copied out of their slots."""
    return [(x.clone(), y.clone(), list(i)) for x, y, i in loader(dataset, copy=True, **kw)]


@pytest.mark.parametrize("layout", ["nchw-f32", "nhwc-u8"])
def test_device_batches_equal_the_host_batches(dataset, layout):
    kw = dict(transform="center", layout=layout)
    want = reference(dataset, **kw)
    l = loader(dataset, device="cpu", **kw)
    assert l.device == torch.device("cpu")
    got = [(x.clone(), y.clone(), list(i)) for x, y, i in l]
    assert len(got) == len(want) == len(l)
    for (a, b, i), (c, d, j) in zip(want, got):
        assert i == j
        assert c.dtype == a.dtype and c.shape == a.shape and d.dtype == torch.int64
        # Normalized on the device by the trainer's kernel: the same numbers
        # as the decoders' own float output.
        assert torch.equal(a, c)
        assert torch.equal(b, d)


def test_a_slot_goes_back_only_after_the_copy_has_read_it(dataset):
    # Each copy sleeps 20 ms before it reads the slot, and the decoders
    # refill every slot the pool hands back at once (prefetch 2). Were the
    # slot returned when the copy is enqueued instead of after its event, the
    # next batches would be decoded into it first and the copies would read
    # them: the augmented batches would not match the host path's.
    kw = dict(transform="random", seed=11, prefetch=2, shuffle=True)
    want = reference(dataset, **kw)
    l = loader(dataset, device="cpu", _copy_delay_us=20000, **kw)
    for epoch in range(2):
        if epoch:
            want = reference(dataset, **dict(kw))
            l.set_epoch(0)
        got = [(x.clone(), y.clone(), list(i)) for x, y, i in l]
        assert [i for _, _, i in got] == [i for _, _, i in want]
        for (a, b, _), (c, d, _) in zip(want, got):
            assert torch.equal(a, c) and torch.equal(b, d)
    stats = l.stats()["device"]
    assert stats["wait_copy_seconds"] > 0  # this thread waited for the slow copies
    assert stats["copy_seconds"] >= 2 * len(l) * 2 * 0.02 * 0.9  # two copies a batch, 20 ms each, two epochs
    assert 0 < stats["copy_gb_per_s"] and stats["wait_batch_seconds"] >= 0 and stats["wait_consumer_seconds"] >= 0


def test_device_buffers_are_reused_and_a_kept_batch_stays_valid(dataset):
    l = loader(dataset, device="cpu", transform="center", _copy_delay_us=2000)
    kept = None
    for epoch in range(3):
        for step, (x, y, _) in enumerate(l):
            if epoch == 0 and step == 0:
                kept, first = x, x.clone()
            float(x.sum())  # the loop's use of the batch; then it is dropped
    stats = l.stats()["device"]
    # One batch in the loop's hands, one copied ahead, the kept one, and one
    # more while a dropped batch's release is pending: a ring, not a buffer
    # per batch.
    assert stats["batches"] == 3 * len(l)
    assert stats["device_buffers"] <= 4, stats
    assert torch.equal(kept, first)  # never written again while it was alive


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_memory_format_and_host_labels(dataset, dtype):
    want = reference(dataset, transform="center")
    l = loader(dataset, device="cpu", transform="center", dtype=dtype,
               memory_format=torch.channels_last, labels_device=False)
    n = 0
    for (a, b, _), (c, d, _) in zip(want, l):
        assert c.dtype == dtype and c.is_contiguous(memory_format=torch.channels_last)
        # Written by the normalization in the copy stream, rounded as torch rounds.
        assert torch.equal(c, a.to(dtype))
        assert torch.equal(b, d) and not d.is_cuda
        n += 1
    assert n == len(want)


def test_device_arguments_are_checked(dataset):
    with pytest.raises(ValueError, match="device"):
        loader(dataset, device="tpu")
    with pytest.raises(ValueError, match="copy=True is for device=None"):
        loader(dataset, device="cpu", copy=True)
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream"):
        loader(dataset, stream=object())
    with pytest.raises(ValueError, match="go with device="):
        loader(dataset, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype must be"):
        loader(dataset, device="cpu", dtype=torch.int8)
    if not torch.cuda.is_available():
        # A CUDA device where none is visible: named, not a crash.
        with pytest.raises(pinfeed.ConfigError, match="cuda"):
            loader(dataset, device="cuda:0")
        # "auto" without CUDA: CPU tensors over the slots, as device=None.
        assert loader(dataset, device="auto").device is None


def test_an_epoch_restarted_midway_drops_the_batch_copied_ahead(dataset):
    kw = dict(transform="center", shuffle=True, seed=2)
    want = reference(dataset, **kw)
    l = loader(dataset, device="cpu", **kw)
    it = iter(l)
    next(it)
    next(it)
    l.set_epoch(0)
    got = [list(i) for _, _, i in l]  # restarted: from the first batch again
    assert got == [i for _, _, i in want]


def test_without_a_device_a_slot_outlives_its_tensors_until_the_consumers_copy(dataset):
    # device=None with images.cuda(non_blocking=True): the copy is queued on
    # a stream and reads the slot after the loop has dropped the tensors. A
    # CpuConsumer models that stream on the CPU backend: each read happens
    # 15 ms after it is asked for. Were the slot returned when the tensors
    # die, the decoders would refill it first and the reads would see later
    # batches.
    if not hasattr(pinfeed._pinfeed, "CpuConsumer"):
        pytest.skip("CpuConsumer is built with the tests only (PINFEED_BUILD_TESTS); an installed wheel has none")
    kw = dict(transform="random", seed=4, prefetch=2, shuffle=True)
    want = reference(dataset, **kw)
    consumer = pinfeed._pinfeed.CpuConsumer(15000)
    l = loader(dataset, stream=consumer, **kw)
    reads = []
    for x, y, _ in l:
        reads.append((consumer.read(x.data_ptr(), x.numel() * x.element_size()), x.shape))
        del x, y  # dropped at once, as the loop body of a real training step
    consumer.synchronize()
    assert len(reads) == len(want)
    for (k, shape), (a, _, _) in zip(reads, want):
        got = torch.frombuffer(bytearray(consumer.result(k)), dtype=torch.float32).reshape(shape)
        assert torch.equal(got, a)


def test_state_dict_does_not_count_the_batch_copied_ahead(dataset):
    kw = dict(transform="center", shuffle=True, seed=9)
    want = reference(dataset, **kw)
    l = loader(dataset, device="cpu", **kw)
    it = iter(l)
    seen = [list(next(it)[2]) for _ in range(2)]
    state = l.state_dict()
    assert state["position"] == 16  # two batches of 8 yielded (a third is on its way)
    resumed = loader(dataset, device="cpu", **kw)
    resumed.load_state_dict(state)
    rest = [list(i) for _, _, i in resumed]
    assert seen + rest == [i for _, _, i in want]
    # One short of the end: the last batch is still to come.
    l2 = loader(dataset, device="cpu", **kw)
    it2 = iter(l2)
    for _ in range(len(l2) - 1):
        next(it2)
    last = loader(dataset, device="cpu", **kw)
    last.load_state_dict(l2.state_dict())
    assert [list(i) for _, _, i in last] == [want[-1][2]]


def test_uint8_batches_take_no_dtype_and_a_cpu_device_no_cuda_stream(dataset):
    with pytest.raises(ValueError, match="layout='nhwc-u8'"):
        loader(dataset, device="cpu", layout="nhwc-u8", dtype=torch.float16)
    with pytest.raises(TypeError, match="labels_device"):
        loader(dataset, device="cpu", labels_device="yes")

    class FakeStream:
        cuda_stream = 0
        device = torch.device("cpu")
    with pytest.raises(TypeError, match="torch.cuda.Stream on the device"):
        loader(dataset, device="cpu", stream=FakeStream())


def test_diag_reports_a_loaders_copy_stream(dataset):
    l = loader(dataset, device="cpu", transform="center")
    for _ in l:
        pass
    report = pinfeed.diag(sample_ms=0, loader=l)
    assert report["copy_stream"]["batches"] == len(l) and report["copy_stream"]["copy_gb_per_s"] > 0
    assert pinfeed.diag(sample_ms=0, loader=loader(dataset))["copy_stream"]["device"] is None
    with pytest.raises(TypeError, match="pinfeed.Loader"):
        pinfeed.diag(sample_ms=0, loader="x")


def test_the_test_hook_is_in_the_build_tree_and_not_in_the_wheel():
    # CpuConsumer is compiled with the tests (PINFEED_BUILD_TESTS), which
    # pyproject.toml turns off: an installed wheel must not carry it.
    installed = bool(os.environ.get("PINFEED_EXPECT_INSTALLED"))
    assert hasattr(pinfeed._pinfeed, "CpuConsumer") != installed
