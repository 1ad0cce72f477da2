"""Tar shards as the webdataset package writes and reads them: its
ShardWriter makes the shards, its reader is the oracle of which members
form a sample (the key rule: the name up to the first dot of its last
path component). scripts/test.sh installs webdataset from PyPI for this."""
import io
import os

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

import pinfeed


def jpeg(seed, size=(20, 16)):
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def write(path, samples):
    with wds.TarWriter(str(path)) as sink:
        for s in samples:
            sink.write(s)


def theirs(path):
    """(key, label) of each sample, as webdataset's reader groups them."""
    return [(k, int(c)) for k, c in wds.WebDataset(str(path), shardshuffle=False).to_tuple("__key__", "cls")]


def mine(path):
    loader = pinfeed.Loader(str(path), batch_size=4, size=16, threads=1, return_indices=True)
    out = []
    for _, labels, indices in loader:
        for label, member in zip(labels.tolist(), loader.paths(indices)):
            name = member.split(".tar:", 1)[1]
            slash = name.rfind("/")
            out.append((name[:name.index(".", slash + 1)], label))
    return out


def test_slashed_keys_and_extra_dotted_fields_give_webdatasets_samples(tmp_path):
    shard = tmp_path / "train-000000.tar"
    samples = [{"__key__": "n01/img_0001", "jpg": jpeg(1), "cls": 3},
               {"__key__": "deep/dir.v2/x", "jpg": jpeg(2), "cls": 0, "seg.png": b"not read"},
               {"__key__": "plain", "JPG": jpeg(3), "cls": 7, "meta.json": b"{}"},
               {"__key__": "n01/img_0002", "jpeg": jpeg(4), "cls": 1}]
    with wds.ShardWriter(str(tmp_path / "train-%06d.tar"), maxcount=100) as sink:
        for s in samples:
            sink.write(s)
    ref = sorted(theirs(shard))
    assert ref == sorted([("n01/img_0001", 3), ("deep/dir.v2/x", 0), ("plain", 7), ("n01/img_0002", 1)])
    assert sorted(mine(shard)) == ref


@pytest.mark.parametrize("key", ["photo.2019", "a.b.c", "dir/photo.v1"])
def test_a_dotted_key_is_refused_naming_the_member_never_dropped(tmp_path, key):
    """ShardWriter writes "photo.2019.jpg": webdataset's reader sees key
    "photo" with a field "2019.jpg" (no "jpg": to_tuple fails). pinfeed
    refuses it, naming the member, instead of loading 4 of 5 samples."""
    shard = tmp_path / "s.tar"
    write(shard, [{"__key__": f"k{i}", "jpg": jpeg(i), "cls": i} for i in range(4)] +
          [{"__key__": key, "jpg": jpeg(9), "cls": 2}])
    with pytest.raises(Exception):
        theirs(shard)  # webdataset's own reader does not find the image either
    with pytest.raises(pinfeed.DataError, match="field is") as e:
        pinfeed.Loader(str(shard), batch_size=4, size=16, threads=1)
    assert key in str(e.value) and os.path.basename(str(shard)) in str(e.value), str(e.value)


def test_a_label_without_an_image_it_can_decode_is_refused(tmp_path):
    shard = tmp_path / "s.tar"
    write(shard, [{"__key__": "a", "jpg": jpeg(1), "cls": 0}, {"__key__": "b", "tiff": b"II*\0", "cls": 1}])
    with pytest.raises(pinfeed.DataError, match="key 'b' has a .cls label but no image member"):
        pinfeed.Loader(str(shard), batch_size=4, size=16, threads=1)
