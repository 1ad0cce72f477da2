"""The loader's option table (options.hpp) against Python and the C ABI: the
keyword defaults are the table's, what the table rejects Python rejects with
the option's name, and the C ABI's init gives the table's defaults."""
import ctypes
import inspect
import struct
import os

import pytest

import pinfeed
from pinfeed import _pinfeed

from test_loader import _Config

OPTIONS = {o["name"]: o for o in _pinfeed.loader_options()}
# Table name -> Loader's keyword, where Loader takes another word (the
# module's own table: the checks and the docstring read it too).
KEYWORD_FOR = pinfeed._options._KEYWORD_FOR
# Python keyword -> table name, where Python keeps the torchvision-like word.
PY_NAMES = {"transform": "crop"}


def small(dataset, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("size", 32)
    kw.setdefault("threads", 2)
    return pinfeed.Loader(str(dataset), **kw)


def test_python_keyword_defaults_are_the_tables():
    params = inspect.signature(pinfeed.Loader.__init__).parameters
    checked = 0
    # DataLoader's names keep DataLoader's defaults (None: from the sampler
    # or the table); drop_last is DataLoader's, the table's is the sampler's.
    dataloader = {"shuffle": None, "drop_last": False, "seed": None, "threads": None, "prefetch": None}
    for name, p in params.items():
        table = OPTIONS.get(PY_NAMES.get(name, name))
        if name in dataloader:
            assert p.default == dataloader[name], name
            continue
        if table is None or p.default is inspect.Parameter.empty:
            continue
        assert p.default == table["default"], name
        checked += 1
    assert checked >= 9
    # Every option is documented in the docstring with its range, under the
    # keyword Loader() takes: the help a user reads is the API they call.
    doc_lines = [line.strip() for line in pinfeed.Loader.__doc__.splitlines()]
    for o in OPTIONS.values():
        keyword = KEYWORD_FOR.get(o["name"], o["name"])
        default = o["default"]
        if isinstance(default, float):  # the float32 default's shortest form (0.08, not 0.07999999821186066)
            default = pinfeed._options._shortest(default)
            assert struct.pack("f", default) == struct.pack("f", o["default"])
        shown = keyword if "=" in keyword else f"{keyword}={default!r}"
        assert any(line.startswith(f"{shown}: ") for line in doc_lines), shown
    # No line offers a keyword that Loader() refuses (drop_last is Loader's
    # own keyword, for the table's drop_last_batch).
    for name in set(KEYWORD_FOR) - {"drop_last"}:
        assert not any(line.startswith(f"{name}=") for line in doc_lines), name


@pytest.mark.parametrize("name", sorted(KEYWORD_FOR))
def test_a_table_name_loader_takes_under_another_keyword_is_refused_naming_it(dataset, name):
    if name == "drop_last":  # Loader's own drop_last keyword (the last batch's)
        return
    value = OPTIONS[name]["default"]
    with pytest.raises(TypeError, match=name):
        small(dataset, **{name: value})


def _just_outside(o):
    if o["type"] == "integer":
        return o["max"] + 1
    if o["type"] == "real":
        return o["min"] if o["min_exclusive"] else o["max"] + 0.5
    if o["type"] == "choice":
        return "no-such-word"
    return None


@pytest.mark.parametrize("name", [n for n, o in OPTIONS.items()
                                  if o["type"] != "boolean" and n not in KEYWORD_FOR])
def test_python_rejects_what_the_table_rejects_naming_the_option(dataset, name):
    with pytest.raises(ValueError, match=name):
        small(dataset, **{name: _just_outside(OPTIONS[name])})


def test_booleans_want_booleans_and_unknown_keywords_are_refused(dataset):
    with pytest.raises(TypeError, match="roi_decode"):
        small(dataset, roi_decode="yes")
    with pytest.raises(TypeError, match="no_such_option"):
        small(dataset, no_such_option=1)
    # Options beyond the named keywords reach the loader.
    loader = small(dataset, scale_min=0.5, ratio_max=1.5, dct_scaling=False)
    images, _ = next(iter(loader))
    assert images.shape == (8, 3, 32, 32)


def test_the_c_abis_defaults_are_the_tables(capi):
    lib = ctypes.CDLL(capi)
    cfg = _Config()
    lib.pinfeed_loader_config_init(ctypes.byref(cfg))
    for field, _ in _Config._fields_:
        o = OPTIONS.get(field)
        if o is None:
            continue
        value = getattr(cfg, field)
        if o["type"] == "choice":
            value = value.decode()
        elif o["type"] == "boolean":
            value = bool(value)
        assert value == o["default"], field
    mean, std = _pinfeed.default_normalization()
    assert tuple(cfg.mean) == pytest.approx(mean) and tuple(cfg.std) == pytest.approx(std)


def test_numpy_numbers_and_int_enums_are_numbers_and_nothing_wraps(dataset):
    np = pytest.importorskip("numpy")
    import enum

    class Threads(enum.IntEnum):
        TWO = 2

    loader = small(dataset, batch_size=np.int64(8), threads=Threads.TWO, seed=np.uint32(7),
                   max_replaced_share=np.float32(0.05), flip=np.bool_(True), shuffle=np.int64(1))
    images, _ = next(iter(loader))
    assert images.shape[0] == 8
    with pytest.raises(ValueError, match="threads"):
        small(dataset, threads=2**32)  # not 0, "every core"
    with pytest.raises(TypeError, match="flip"):
        small(dataset, flip=2**70)


def test_the_package_imports_without_docstrings():
    import subprocess
    import sys
    subprocess.run([sys.executable, "-OO", "-c", "import pinfeed"], check=True, env=dict(os.environ))


def test_every_option_is_in_the_signature_with_the_tables_default_and_type():
    # help(pinfeed.Loader) and IDEs see every row: Loader's named arguments
    # plus LoaderOptions (the **options of PEP 692), which is exactly the
    # rows that have no named argument, each typed as the table types it,
    # and DataLoader's arguments that Loader accepts at their default.
    import typing
    from pinfeed._compat import _DATALOADER_DEFAULTS
    from pinfeed._options import LoaderOptions
    explicit = set(inspect.signature(pinfeed.Loader.__init__).parameters)
    named_elsewhere = {name for name in OPTIONS if name in explicit or name in KEYWORD_FOR}
    assert set(LoaderOptions.__annotations__) == (set(OPTIONS) - named_elsewhere) | set(_DATALOADER_DEFAULTS)
    python_type = {"boolean": bool, "integer": int, "real": float}
    for name, kind in LoaderOptions.__annotations__.items():
        row = OPTIONS.get(name)
        if row is None:
            continue  # DataLoader's
        if row["type"] == "choice":
            assert typing.get_origin(kind) is typing.Literal and list(typing.get_args(kind)) == row["choices"], name
        else:
            assert kind is python_type[row["type"]], name
    shown = inspect.signature(pinfeed.Loader).parameters
    assert not any(p.kind is p.VAR_KEYWORD or p.name.startswith("_") for p in shown.values())
    for name in LoaderOptions.__annotations__:
        want = OPTIONS[name]["default"] if name in OPTIONS else _DATALOADER_DEFAULTS[name]
        assert shown[name].kind is inspect.Parameter.KEYWORD_ONLY and shown[name].default == want, name
    assert "held_limit: int = 0" in str(inspect.signature(pinfeed.Loader))
    # What DataLoader code forwards binds, and what nothing takes does not.
    inspect.signature(pinfeed.Loader).bind("data", timeout=0, collate_fn=None, held_limit=1)
    with pytest.raises(TypeError):
        inspect.signature(pinfeed.Loader).bind("data", no_such_option=1)
    # Run-time introspection (jsonargparse, LightningCLI) resolves the hints.
    hints = typing.get_type_hints(pinfeed.Loader.__init__)
    assert "options" in hints
