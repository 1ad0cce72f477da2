"""What a PyTorch team keeps when it moves to pinfeed (issue 29): Python
batch transforms and post-processing, DataLoader's arguments that do not
apply refused with what to use instead, torchvision's forms of mean and
std, and indices as a tensor. Through the real loader."""
import inspect
import re
import warnings

import pytest
import torch

import pinfeed


def loader(dataset, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("size", 16)
    kw.setdefault("threads", 2)
    return pinfeed.Loader(str(dataset), **kw)


def batch_ops():
    """torchvision's transforms on whole batches: v2 where torchvision has it,
    else v1's tensor ops (which take (B, C, H, W) too; Debian 12's
    torchvision 0.14 has no v2)."""
    tv = pytest.importorskip("torchvision")
    try:
        from torchvision.transforms import v2 as T  # pylint: disable=import-outside-toplevel
    except ImportError:
        T = tv.transforms
    return T.Compose([T.RandomHorizontalFlip(p=1.0), T.Normalize(mean=[0.5] * 3, std=[2.0] * 3)])


def test_batch_transform_runs_torchvision_ops_on_each_batch(dataset):
    plain = [(x.clone(), y.clone()) for x, y in loader(dataset, seed=1, shuffle=True)]
    ops = batch_ops()
    seen = []

    def hook(images):
        seen.append(images.shape)
        return ops(images)
    hooked = [(x.clone(), y.clone()) for x, y in loader(dataset, seed=1, shuffle=True, batch_transform=hook)]
    assert len(seen) == len(plain) == len(hooked) == 5
    for (x, y), (hx, hy) in zip(plain, hooked):
        assert torch.equal(y, hy)
        assert torch.allclose(hx, (x.flip(-1) - 0.5) / 2.0, atol=1e-6)


def test_batch_fn_post_processes_the_whole_batch(dataset):
    def to_dict(images, labels, indices, paths):
        return {"x": images.mean(dim=(1, 2, 3)), "y": labels, "i": indices, "p": paths}
    batches = list(loader(dataset, return_indices=True, return_paths=True, batch_fn=to_dict, copy=True))
    assert [sorted(b) for b in batches] == [["i", "p", "x", "y"]] * 5
    first = batches[0]
    assert first["i"].dtype == torch.int64 and first["i"].tolist() == list(range(8))
    assert first["x"].shape == (8,) and len(first["p"]) == 8
    with pytest.raises(TypeError, match="batch_fn must be callable"):
        loader(dataset, batch_fn=3)


def test_return_indices_yields_an_int64_tensor(dataset):
    _, _, idx = next(iter(loader(dataset, return_indices=True)))
    assert isinstance(idx, torch.Tensor) and idx.dtype == torch.int64 and idx.tolist() == list(range(8))


@pytest.mark.parametrize("name,value,needle", [
    ("collate_fn", lambda batch: batch, "batch_fn="), ("batch_sampler", [[0, 1]], "sampler="),
    ("worker_init_fn", print, "seed="), ("generator", torch.Generator(), "seed="), ("timeout", 5, "bad_sample="),
    ("multiprocessing_context", "spawn", "worker processes"), ("pin_memory_device", "cuda", "device=")])
def test_dataloader_arguments_that_do_not_apply_say_what_to_use(dataset, name, value, needle):
    with pytest.raises(TypeError, match=f"does not take DataLoader's {name}=: .*{needle}"):
        loader(dataset, **{name: value})


def test_dataloader_arguments_at_their_defaults_are_accepted(dataset):
    kw = dict(collate_fn=None, batch_sampler=None, worker_init_fn=None, generator=None, timeout=0,
              multiprocessing_context=None, pin_memory_device="", in_order=True)
    images, _ = next(iter(loader(dataset, **kw)))
    assert images.shape == (8, 3, 16, 16)


def test_python_transforms_and_datasets_are_refused_with_the_way_that_works(dataset):
    tv = pytest.importorskip("torchvision")
    with pytest.raises(TypeError, match="batch_transform="):
        loader(dataset, transform=tv.transforms.Compose([tv.transforms.ToTensor()]))
    folder = tv.datasets.ImageFolder(str(dataset))
    with pytest.raises(TypeError, match=f"data={str(dataset)!r}"):
        pinfeed.Loader(folder)


def test_mean_and_std_take_torchvisions_forms(dataset):
    def first(**kw):
        return next(iter(loader(dataset, **kw)))[0]
    listed = first(mean=[0.5, 0.4, 0.3], std=[0.2, 0.2, 0.2])
    assert torch.equal(listed, first(mean=torch.tensor([0.5, 0.4, 0.3]), std=0.2))
    assert torch.equal(first(mean=0.5, std=torch.tensor(0.25)), first(mean=[0.5] * 3, std=[0.25] * 3))
    assert torch.equal(listed, first(mean=torch.tensor([0.5, 0.4, 0.3]).view(3, 1, 1), std=0.2))
    np = pytest.importorskip("numpy")
    assert torch.equal(listed, first(mean=np.array([0.5, 0.4, 0.3]), std=np.float64(0.2)))
    with pytest.warns(UserWarning, match="0-255 pixels"):
        loader(dataset, mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader(dataset)  # ImageNet's [0, 1] statistics: no warning


def test_num_workers_zero_says_it_is_automatic(dataset, monkeypatch):
    monkeypatch.setattr(pinfeed._compat, "_warned_num_workers", False)
    with pytest.warns(UserWarning, match="num_workers=0 .*load in the main process.* automatic"):
        loader(dataset, num_workers=0, threads=None)


def test_the_help_shows_the_defaults_as_written():
    doc = pinfeed.Loader.__doc__
    assert not re.search(r"\d\.\d*(00000|99999)\d", doc), re.search(r"\S*\d\.\d*(00000|99999)\d\S*", doc)[0]
    assert "scale_min=0.08" in doc
    assert inspect.signature(pinfeed.Loader).parameters["mean"].default == [0.485, 0.456, 0.406]
    for name in ("load_state_dict", "__len__", "state_dict", "set_epoch"):
        assert getattr(pinfeed.Loader, name).__doc__, name
    assert pinfeed.Loader.num_classes.__doc__


def test_batch_transform_runs_on_device_batches(dataset):
    # device="cpu": the device path on pinfeed's CPU backend (the same code
    # as "cuda", where the hook runs on the consumer stream).
    plain = [x.clone() for x, _ in loader(dataset, device="cpu", seed=2, shuffle=True)]
    doubled = [x.clone() for x, _ in loader(dataset, device="cpu", seed=2, shuffle=True,
                                            batch_transform=lambda images: images * 2)]
    assert len(plain) == len(doubled) == 5
    assert all(torch.equal(a * 2, b) for a, b in zip(plain, doubled))
