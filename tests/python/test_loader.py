"""The Python module end to end: pinfeed.Loader over real JPEGs."""
import ctypes
import gc
import json
import os
import subprocess
import sys

import pytest
import torch

import pinfeed
from conftest import data_tool


def small(dataset, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("size", 32)
    kw.setdefault("threads", 2)
    return pinfeed.Loader(str(dataset), **kw)


def test_iterates_torch_tensors_of_the_right_shape(dataset):
    loader = small(dataset)
    assert len(loader) == 5  # 40 images / 8
    assert loader.num_classes == 4
    batches = 0
    for images, labels in loader:
        assert isinstance(images, torch.Tensor) and images.dtype == torch.float32
        assert images.shape == (8, 3, 32, 32)
        assert labels.dtype == torch.int64 and labels.shape == (8,)
        assert int(labels.min()) >= 0 and int(labels.max()) < 4
        assert torch.isfinite(images).all()
        batches += 1
    assert batches == 5
    u8 = small(dataset, layout="nhwc-u8")
    images, labels = next(iter(u8))
    assert images.dtype == torch.uint8 and images.shape == (8, 32, 32, 3)


class _Config(ctypes.Structure):
    _fields_ = [("dataset", ctypes.c_char_p), ("list_root", ctypes.c_char_p), ("batch_size", ctypes.c_size_t),
                ("threads", ctypes.c_uint), ("prefetch", ctypes.c_size_t), ("rank", ctypes.c_uint),
                ("world_size", ctypes.c_uint), ("shuffle", ctypes.c_int), ("drop_last", ctypes.c_int),
                ("drop_last_batch", ctypes.c_int), ("seed", ctypes.c_uint64), ("crop", ctypes.c_char_p),
                ("size", ctypes.c_int), ("resize", ctypes.c_int), ("flip", ctypes.c_int), ("layout", ctypes.c_char_p),
                ("mean", ctypes.c_float * 3), ("std", ctypes.c_float * 3), ("bad_sample", ctypes.c_char_p),
                ("pin", ctypes.c_int), ("watch_pressure", ctypes.c_int)]


class _View(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("bytes", ctypes.c_size_t), ("size", ctypes.c_size_t),
                ("sample_bytes", ctypes.c_size_t), ("shape", ctypes.c_int64 * 4), ("dtype", ctypes.c_char_p),
                ("layout", ctypes.c_char_p), ("labels", ctypes.POINTER(ctypes.c_int64)),
                ("indices", ctypes.POINTER(ctypes.c_size_t)), ("pinned", ctypes.c_int), ("epoch", ctypes.c_uint64),
                ("index", ctypes.c_size_t), ("position", ctypes.c_size_t)]


def test_batches_equal_the_cpp_loaders_through_the_c_abi(dataset, capi):
    lib = ctypes.CDLL(capi)
    cfg = _Config()
    lib.pinfeed_loader_config_init(ctypes.byref(cfg))
    cfg.dataset = str(dataset).encode()
    cfg.batch_size, cfg.size, cfg.threads, cfg.seed = 8, 32, 2, 5
    handle = ctypes.c_void_p()
    assert lib.pinfeed_loader_create(ctypes.byref(cfg), ctypes.byref(handle)) == 0, lib.pinfeed_last_error
    lib.pinfeed_loader_begin_epoch(handle, ctypes.c_uint64(2))
    py = small(dataset, seed=5, shuffle=True)  # the C ABI's default
    py.set_epoch(2)
    for images, labels in py:
        batch = ctypes.c_void_p()
        assert lib.pinfeed_loader_next(handle, ctypes.byref(batch)) == 0
        view = _View()
        assert lib.pinfeed_batch_get_view(batch, ctypes.byref(view)) == 0
        assert ctypes.string_at(view.data, view.bytes) == images.numpy().tobytes(), "byte-identical batches"
        assert [view.labels[i] for i in range(view.size)] == labels.tolist()
        lib.pinfeed_batch_release(batch)
    lib.pinfeed_loader_destroy(handle)


def _non_default(option):
    """A valid value other than the default, as text, for one row of
    pinfeed_options_list_json."""
    kind, default, rng = option["type"], option["default"], option["range"]
    if kind == "boolean":
        return "false" if default == "true" else "true"
    if kind == "choice":
        return next(c for c in rng.removeprefix("one of ").split(", ") if c != default)
    if kind == "rgb":
        return "0.25,0.5,0.75"
    if kind == "text":
        return "/some/where"
    if option["name"] in ("rank", "world_size", "cuda_device"):
        return str(int(default) + 1)
    low, high = (float(x) if x != "2^64-1" else 2.0 ** 64 for x in rng.strip("[(]").replace("..", ", ").split(", "))
    if kind == "integer":
        return str(int(default) + 1 if int(default) + 1 <= high else int(default) - 1)
    d = float(default)
    return f"{(d + high) / 2 if d < high else (low + d) / 2:.4g}"


def test_every_option_of_the_table_reaches_c_by_name(capi):
    """Every row of the option table (and the fields outside it) is set and
    read back through the C ABI by name: an option added to the table
    reaches C callers with no change to pinfeed.h."""
    lib = ctypes.CDLL(capi)
    lib.pinfeed_last_error.restype = ctypes.c_char_p
    out = ctypes.c_char_p()
    assert lib.pinfeed_options_list_json(ctypes.byref(out)) == 0
    options = json.loads(out.value)
    table = {o["name"] for o in pinfeed._pinfeed.loader_options()}
    assert table <= {o["name"] for o in options}, "every table option is listed"
    handle = ctypes.c_void_p()
    assert lib.pinfeed_options_create(ctypes.byref(handle)) == 0
    for o in options:
        value = _non_default(o)
        assert lib.pinfeed_options_set(handle, o["name"].encode(), value.encode()) == 0, \
            (o["name"], value, lib.pinfeed_last_error())
        got = ctypes.c_char_p()
        assert lib.pinfeed_options_get(handle, o["name"].encode(), ctypes.byref(got)) == 0
        if o["type"] == "real":  # read back exactly (the shortest form that gives the same double)
            assert float(got.value) == float(value), o["name"]
        else:
            assert got.value.decode() == value, o["name"]
        assert value != o["default"], o["name"]
    bad = lib.pinfeed_options_set(handle, b"size", b"-3")
    assert bad == 2 and b"size" in lib.pinfeed_last_error()
    lib.pinfeed_options_destroy(handle)


def test_a_loader_made_by_name_in_c_gives_pythons_batches(dataset, capi):
    """Options the fixed struct never had (height, flip_p, interpolation):
    the same bytes as pinfeed.Loader with the same options."""
    lib = ctypes.CDLL(capi)
    opts = ctypes.c_void_p()
    assert lib.pinfeed_options_create(ctypes.byref(opts)) == 0
    for name, value in (("dataset", str(dataset)), ("batch_size", "8"), ("size", "32"), ("height", "24"),
                        ("threads", "2"), ("seed", "5"), ("flip_p", "0.3"), ("interpolation", "nearest")):
        assert lib.pinfeed_options_set(opts, name.encode(), value.encode()) == 0, name
    handle = ctypes.c_void_p()
    assert lib.pinfeed_loader_create_from_options(opts, ctypes.byref(handle)) == 0
    lib.pinfeed_options_destroy(opts)
    lib.pinfeed_loader_begin_epoch(handle, ctypes.c_uint64(1))
    py = small(dataset, size=(24, 32), seed=5, flip=0.3, interpolation="nearest", shuffle=True)  # C: the table's default
    py.set_epoch(1)
    n = 0
    for images, labels in py:
        batch = ctypes.c_void_p()
        assert lib.pinfeed_loader_next(handle, ctypes.byref(batch)) == 0
        view = _View()
        assert lib.pinfeed_batch_get_view(batch, ctypes.byref(view)) == 0
        assert list(view.shape) == [8, 3, 24, 32]
        assert ctypes.string_at(view.data, view.bytes) == images.numpy().tobytes(), "byte-identical batches"
        assert [view.labels[i] for i in range(view.size)] == labels.tolist()
        lib.pinfeed_batch_release(batch)
        n += 1
    assert n == 5
    lib.pinfeed_loader_destroy(handle)


def indices_of(loader):
    return [int(i) for _, _, idx in loader for i in idx]


def test_set_epoch_changes_the_order_and_the_same_epoch_repeats_it(dataset):
    loader = small(dataset, return_indices=True, shuffle=True)
    loader.set_epoch(0)
    first = indices_of(loader)
    assert indices_of(loader) == first, "after set_epoch, iterating again repeats the epoch"
    loader.set_epoch(1)
    second = indices_of(loader)
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second


def test_state_dict_resumes_where_it_stopped(dataset):
    loader = small(dataset, return_indices=True, seed=9)
    loader.set_epoch(3)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = loader.state_dict()
    assert state["epoch"] == 3 and state["position"] == 16
    rest = [(img.clone(), idx.tolist()) for img, _, idx in it]
    resumed = small(dataset, return_indices=True, seed=9)
    resumed.load_state_dict(state)
    again = [(img.clone(), idx.tolist()) for img, _, idx in resumed]
    assert [idx for _, idx in again] == [idx for _, idx in rest]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(again, rest))
    with pytest.raises(ValueError, match="taken with seed=9, this loader has seed=0"):
        small(dataset).load_state_dict(state)


def test_tensors_outlive_their_loader(dataset):
    loader = small(dataset)
    images, labels = next(iter(loader))
    expected = images.clone()
    del loader
    gc.collect()
    assert torch.equal(images, expected)  # the slot (and the C++ loader) are still alive
    assert images.sum().item() == expected.sum().item()
    del images, labels
    gc.collect()


def test_slots_return_when_tensors_die_and_holding_them_all_is_lent_out(dataset):
    loader = small(dataset, prefetch=3)
    held = []
    for images, labels in loader:
        held.append(images)  # never released: lent out of the pool (Note [Lent slots])
    assert loader.live_batches() == 5
    assert loader.stats()["pool"]["lent_slots"] >= 2
    held.clear()
    del images, labels  # the loop variables hold the last batch too
    gc.collect()
    assert loader.live_batches() == 0
    copied = small(dataset, prefetch=3, copy=True)
    kept = [images for images, _ in copied]
    assert len(kept) == 5 and copied.live_batches() == 0


def test_bad_arguments_are_python_exceptions_with_clear_messages(dataset, tmp_path):
    with pytest.raises(pinfeed.DataError, match="/nonexistent/pinfeed"):
        pinfeed.Loader("/nonexistent/pinfeed")
    with pytest.raises(ValueError, match="batch_size"):
        small(dataset, batch_size=0)
    with pytest.raises(ValueError, match="diagonal"):
        small(dataset, transform="diagonal")
    with pytest.raises(ValueError, match="layout"):
        small(dataset, layout="rgb")
    with pytest.raises(ValueError, match="rank 2"):
        small(dataset, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pin_memory"):
        small(dataset, pin_memory="yes")
    with pytest.raises(TypeError):
        pinfeed.Loader(42)
    bad = tmp_path / "bad" / "cls"
    bad.mkdir(parents=True)
    (bad / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(pinfeed.DataError, match="broken.jpg"):
        for _ in pinfeed.Loader(str(tmp_path / "bad"), batch_size=1, bad_sample="fail", size=16):
            pass


def test_two_ranks_from_the_environment_cover_every_sample_once(dataset):
    code = ("import json, os, pinfeed; l = pinfeed.Loader(%r, batch_size=4, size=16, threads=1, return_indices=True); "
            "assert (l.rank, l.world_size, l.local_rank) == (int(os.environ['RANK']), 2, int(os.environ['RANK'])); "
            "l.set_epoch(1); print(json.dumps([int(i) for _, _, idx in l for i in idx]))" % str(dataset))
    seen = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        mine = json.loads(out.stdout)
        assert len(mine) == 20
        seen += mine
    assert sorted(seen) == list(range(40))


def test_folder_file_list_and_shards_give_the_same_batches(dataset, tmp_path):
    subprocess.run([data_tool(), "-q", "pack", "--from", str(dataset), "--out",
                    str(tmp_path / "shards" / "train"), "--per-shard", "16"], check=True)
    listing = tmp_path / "list.txt"
    classes = sorted(os.listdir(dataset))
    with open(listing, "w") as f:
        for label, cls in enumerate(classes):
            for name in sorted(os.listdir(dataset / cls)):
                f.write(f"{cls}/{name} {label}\n")
    kw = dict(batch_size=8, size=16, threads=2, seed=4, return_indices=True)
    sources = [str(dataset), str(tmp_path / "shards" / "train-{000000..000002}.tar")]
    results = []
    for source in sources:
        results.append([(img.clone(), lab.clone(), idx.tolist()) for img, lab, idx in pinfeed.Loader(source, **kw)])
    results.append([(img.clone(), lab.clone(), idx.tolist())
                    for img, lab, idx in pinfeed.Loader(str(listing), list_root=str(dataset), **kw)])
    first = results[0]
    for other in results[1:]:
        assert [idx for _, _, idx in other] == [idx for _, _, idx in first]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, other))


def test_diag_returns_the_report_as_a_dict():
    report = pinfeed.diag(batch="8x3x32x32:u8", sample_ms=0)
    assert report["memory"]["total_bytes"] > 0
    assert report["plan"]["verdict"] in ("pin", "pin-partial", "pageable")
    with pytest.raises(ValueError):
        pinfeed.diag(batch="8xZ:u8")
