"""Remote shards against hostile servers and hostile neighbours (issue 51):
every wait ends within its budget, every byte count has a bound, secrets
never reach a person, a plain server works, and a shard that changed is
never read from a stale copy. Real servers the tests start on loopback:
nginx, Python's own http.server (no Range, no ETag), and a Python server
with hostile modes (a 1 byte/s trickle, an endless chunked body, a 2 MiB
header, redirects to file://, a listing that never ends). The cache's own
rules (symlinks, other people's files, locks, pipe: process groups) are
tests/loader/remote_test.cpp's."""
import functools
import hashlib
import http.server
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import threading
import time

import pytest

import pinfeed
from conftest import data_tool
from test_remote import SHARDS, Server, batches, loader_for, pattern, shards, nginx, url_for  # noqa: F401 (fixtures)


class Hostile(http.server.BaseHTTPRequestHandler):
    """Serves www/ (Range supported, no ETag, no Last-Modified) in one of
    the modes: "ok"; "trickle" (the body at 1 byte/s); "slowhead" (the
    status line, then a header byte a second); "endless" (a chunked body
    that never ends); "bighead" (a 2 MiB header); "tofile" (a redirect to
    file:///etc/passwd); "s3moved" (S3's 301 PermanentRedirect);
    "listing" (an S3 listing whose continuation token repeats)."""
    protocol_version = "HTTP/1.1"
    root, mode, requests = None, "ok", []

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_GET(self, head=False):
        type(self).requests.append((self.command, self.path, self.headers.get("Range")))
        if self.mode == "slowhead":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for c in b"X-Slow: " + b"a" * 100:
                self.wfile.write(bytes([c]))
                self.wfile.flush()
                time.sleep(1)
            return
        if self.mode == "tofile":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.mode == "s3moved":
            body = (b"<?xml version='1.0'?><Error><Code>PermanentRedirect</Code><Message>The bucket you are attempting "
                    b"to access must be addressed using the specified endpoint.</Message></Error>")
            self.send_response(301)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.mode == "listing":
            body = (b"<ListBucketResult><IsTruncated>true</IsTruncated><Contents><Key>a.tar</Key></Contents>"
                    b"<NextContinuationToken>same</NextContinuationToken></ListBucketResult>")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.mode == "bighead":
            self.send_response(200)
            self.send_header("X-Big", "b" * (2 << 20))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.mode == "endless" and not self.path.endswith(".tar"):
            self.send_error(404)  # no sidecar: the shard is staged
            return
        if self.mode in ("endless", "endless-sidecar"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"\0" * 65536
            try:
                for _ in range(100000):  # 6.5 GB at most: bounded even if the client never stops
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                pass
            self.close_connection = True
            return
        path = os.path.join(self.root, self.path.lstrip("/").split("?")[0])
        if not os.path.isfile(path):
            self.send_error(404)
            return
        body = open(path, "rb").read()
        start, end = 0, len(body)
        rng = self.headers.get("Range")
        if rng:
            first, _, last = rng.split("=")[1].partition("-")
            start, end = int(first), (int(last) + 1 if last else len(body))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if head:
            return
        if self.mode == "trickle" or (self.mode == "trickle-tar" and self.path.endswith(".tar")):
            try:
                for b in body[start:end]:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(1)
            except OSError:
                pass
            return
        self.wfile.write(body[start:end])


@pytest.fixture
def hostile(shards):
    servers = []

    def start(mode, handler=None, root=None):
        cls = handler or type("Handler", (Hostile,), {"root": str(root or shards / "www"), "mode": mode, "requests": []})
        server = Server(("127.0.0.1", 0), cls)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", cls

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def plain_http_server(root):
    """Python's http.server as `python3 -m http.server` runs it: no Range,
    no ETag, Last-Modified from the file's mtime."""
    return type("Plain", (http.server.SimpleHTTPRequestHandler,),
                {"log_message": lambda *a: None, "__init__": functools.partialmethod(
                    http.server.SimpleHTTPRequestHandler.__init__, directory=str(root))})


# ---------------------------------------------------------------- every wait ends

@pytest.mark.parametrize("mode,folder", [("trickle", "data"), ("slowhead", "data"), ("trickle", "stream"),
                                         ("trickle-tar", "stream")])
def test_a_trickling_server_is_a_stall_within_the_budget(hostile, mode, folder):
    """1 byte/s in the body, in the headers, in a sidecar, or in the samples
    a stream reads (a first batch that never came): under
    remote_min_rate, so a stall after remote_timeout, and an error after the
    retries; libcurl's own 1 byte/s limit let each run forever."""
    base, _ = hostile(mode)
    start = time.monotonic()
    with pytest.raises(pinfeed.Error, match="remote_min_rate"):
        batches(loader_for(pattern(f"{base}/{folder}"), remote_timeout=1, remote_retries=1))
    assert time.monotonic() - start < 20  # two tries of 1-2 s and a backoff; never is the failure


def test_an_endless_body_stops_at_the_byte_budget_and_leaves_nothing(hostile, tmp_path):
    base, _ = hostile("endless")
    start = time.monotonic()
    with pytest.raises(pinfeed.Error, match="cache_limit"):
        loader_for(f"{base}/data/train-000000.tar", cache_dir=tmp_path / "c", cache_limit=1_000_000, remote_retries=3)
    assert time.monotonic() - start < 5, "a bound is final, never retried"
    left = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and not p.name.endswith((".fetch", ".lock"))]
    assert [p.name for p in left] == [".pinfeed-cache"], left
    assert sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file()) < 100


def test_an_endless_sidecar_stops_at_its_limit_naming_it(hostile):
    base, _ = hostile("endless-sidecar")
    with pytest.raises(pinfeed.Error, match="over 64 MiB, the limit for a shard's index sidecar"):
        loader_for(f"{base}/stream/train-000000.tar")


def test_ctrl_c_ends_an_open_that_waits_on_a_server_or_a_command(tmp_path):
    """KeyboardInterrupt within a second, whatever the C++ open waits for."""
    with socket.socket() as s:  # listens, never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        for spec in (f"http://127.0.0.1:{s.getsockname()[1]}/x/train-000000.tar", "pipe:sleep 63.21 # x.tar"):
            code = textwrap.dedent(f"""
                import sys, pinfeed
                pinfeed.Loader  # torch imported before the signal comes
                print("opening", flush=True)
                try:
                    pinfeed.Loader({spec!r}, batch_size=2, remote_timeout=60, cache_dir={str(tmp_path / 'c')!r})
                except KeyboardInterrupt:
                    print("interrupted", flush=True)
                    sys.exit(3)
            """)
            # SIGINT at its default in the child whatever this process
            # inherited (a background job starts with it ignored, and Python
            # then installs no handler of its own).
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            assert p.stdout.readline().strip() == "opening"
            time.sleep(1.0)
            p.send_signal(signal.SIGINT)
            sent = time.monotonic()
            try:
                out, err = p.communicate(timeout=10)
            finally:
                p.kill()
            assert p.returncode == 3, (spec, out, err)
            # The cancel is polled every 50 ms; a transfer sees it at its next
            # progress call (about a second), then the interpreter ends.
            assert time.monotonic() - sent < 5, spec
    assert subprocess.run(["pgrep", "-f", "sleep 63[.]21"], capture_output=True).returncode != 0, "the command lives"


def test_a_read_only_cache_dir_says_so(shards, nginx, tmp_path):
    """A cache_dir on a read-only mount (a real one: a bind mount remounted
    read-only in a mount namespace of its own) is named with the reason,
    where "No such file or directory" was said for its lock."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    cache = tmp_path / "ro"
    cache.mkdir()
    code = (f"import pinfeed\ntry:\n    pinfeed.Loader({url_for(nginx, 'data') + '/train-000000.tar'!r}, "
            f"cache_dir={str(cache)!r})\nexcept pinfeed.Error as e:\n    print(e)")
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {cache} {cache} && "
                        f"mount -o remount,bind,ro {cache} && exec {sys.executable} -c \"$0\"", code],
                       capture_output=True, text=True, timeout=60)
    if "mount:" in r.stderr:
        pytest.skip(f"no read-only bind mount here: {r.stderr[-300:]}")
    assert "Read-only file system" in r.stdout and str(cache) in r.stdout, (r.stdout, r.stderr[-2000:])


# ---------------------------------------------------------------- answers no retry changes

def test_permanent_failures_fail_at_once(hostile, monkeypatch):
    """A URL with a space, a redirect to file://, a 2 MiB header and S3's 301
    fail on the first answer, naming why; retrying them took 15 s."""
    base, _ = hostile("ok")
    cases = [(f"{base}/da ta/train-000000.tar", "URL"), (f"{hostile('tofile')[0]}/data/train-000000.tar", "rotocol"),
             (f"{hostile('bighead')[0]}/data/train-000000.tar", "header")]
    for url, says in cases:
        start = time.monotonic()
        with pytest.raises(pinfeed.Error, match=says):
            loader_for(url, remote_retries=5)
        assert time.monotonic() - start < 3, url
    monkeypatch.setenv("AWS_ENDPOINT_URL", hostile("s3moved")[0])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI")
    start = time.monotonic()
    with pytest.raises(pinfeed.Error, match="301 PermanentRedirect"):
        loader_for("s3://bucket/data/train-000000.tar", remote_retries=5)
    assert time.monotonic() - start < 3


def test_an_s3_listing_that_repeats_its_token_is_an_error(hostile, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", hostile("listing")[0])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI")
    start = time.monotonic()
    with pytest.raises(pinfeed.Error, match="continuation token"):
        loader_for("s3://bucket/prefix/")
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------- a plain server, a changed shard

def test_a_plain_http_server_serves_packed_shards_by_staging_them(shards, hostile, caplog):
    """python3 -m http.server ignores Range: shards with sidecars are staged
    whole, as without, and the log says so once."""
    local = batches(loader_for(pattern(shards / "www" / "data")))
    base, _ = hostile(None, handler=plain_http_server(shards / "www"))
    loader = loader_for(pattern(f"{base}/stream"))
    assert batches(loader) == local
    assert "remote" not in loader.stats(), "staged, not streamed"


def relabel(tar_path):
    """The same shard, byte for byte the same size, with every label moved
    to the next class (a dataset fixed in place)."""
    blob = bytearray(open(tar_path, "rb").read())
    with tarfile.open(tar_path) as t:
        for m in t.getmembers():
            if m.name.endswith(".cls"):
                label = str((int(blob[m.offset_data:m.offset_data + m.size]) + 1) % 3).encode()
                assert len(label) == m.size
                blob[m.offset_data:m.offset_data + m.size] = label
    return bytes(blob)


@pytest.mark.parametrize("server", ["plain", "bare"])
def test_a_shard_rewritten_in_place_is_never_read_from_the_stale_copy(shards, hostile, tmp_path, server):
    """No ETag: Last-Modified decides (plain http.server); with neither, the
    first and last 64 KiB (a server that sends no validator at all)."""
    www = tmp_path / "www"
    shutil.copytree(shards / "www" / "data", www / "data")
    base, _ = hostile("ok", root=www) if server == "bare" else hostile(None, handler=plain_http_server(www))
    url = f"{base}/data/train-000000.tar"

    def labels():
        return sorted(l for _, ls, _ in batches(loader_for(url, cache_dir=tmp_path / "c")) for l in ls)

    before = labels()
    shard = www / "data" / "train-000000.tar"
    blob = relabel(shard)
    shard.write_bytes(blob)
    later = time.time() + 10
    os.utime(shard, (later, later))
    after = labels()
    assert after != before and sorted((l - 1) % 3 for l in after) == before


# ---------------------------------------------------------------- sidecars

def test_a_sidecar_entry_naming_another_members_bytes_is_refused(shards, nginx):
    """Two entries' keys swapped (offsets, sizes and checksums the members'
    own): each header's name says whose bytes they are."""
    www = shards / "www" / "swapped"
    www.mkdir(exist_ok=True)
    shutil.copy(shards / "www" / "stream" / "train-000000.tar", www / "train-000000.tar")
    index = json.loads((shards / "www" / "stream" / "train-000000.tar.index.json").read_text())
    a, b = index["samples"][0], index["samples"][1]
    a[0], b[0] = b[0], a[0]
    (www / "train-000000.tar.index.json").write_text(json.dumps(index))
    with pytest.raises(pinfeed.DataError, match="not the indexed one"):
        batches(loader_for(url_for(nginx, "swapped") + "/train-000000.tar", bad_sample="fail"))


# ---------------------------------------------------------------- a second S3 implementation

S3DEPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "s3deps")


@pytest.fixture
def localbucket(shards, tmp_path):
    """LocalBucket (PyPI, stdlib only; scripts/test.sh installs it into
    build/s3deps): another S3 the code was never tuned to, serving a bucket
    folder with the shards, their sidecars, and a prefix without sidecars."""
    if not os.path.exists(os.path.join(S3DEPS, "localbucket.py")):
        pytest.skip(f"localbucket is not installed in {S3DEPS} (scripts/test.sh installs it)")
    bucket = tmp_path / "s3" / "bucket"
    shutil.copytree(shards / "www" / "stream", bucket / "stream")
    shutil.copytree(shards / "www" / "data", bucket / "staged")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, os.path.join(S3DEPS, "localbucket.py"), str(tmp_path / "s3"), "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            if proc.poll() is None:  # ours answering, not another process that took the port
                break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            proc.wait()
            pytest.skip("localbucket did not start (its port taken?)")
        time.sleep(0.05)
    yield {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "AKIDLOCAL",
           "AWS_SECRET_ACCESS_KEY": "local", "AWS_REGION": "us-east-1"}
    proc.terminate()
    proc.wait(10)


def test_another_s3_implementation_streams_lists_caches_and_takes_uploads(shards, localbucket, monkeypatch, tmp_path):
    for k, v in localbucket.items():
        monkeypatch.setenv(k, v)
    local = batches(loader_for(pattern(shards / "www" / "data")))
    streamed = loader_for(pattern("s3://bucket/stream"), remote_streams=4)
    assert batches(streamed) == local
    assert streamed.stats()["remote"]["requests"] > 0, "streamed by Range requests"
    listed = loader_for("s3://bucket/staged/", cache_dir=tmp_path / "c")
    assert batches(listed) == local
    again = loader_for("s3://bucket/staged/", cache_dir=tmp_path / "c")  # HEAD confirms its ETag: no GET
    assert batches(again) == local
    subprocess.run([data_tool(), "-q", "pack", "--from", str(shards / "set" / "train"), "--out",
                    "s3://bucket/packed/train", "--per-shard", "6"], check=True, env=dict(os.environ, **localbucket))
    assert batches(loader_for(pattern("s3://bucket/packed"), remote_streams=4)) == local


def test_shards_with_hard_links_and_non_ascii_names_stream_as_they_read_from_disk(shards, nginx):
    """The name check spares what tar itself makes: a GNU tar hard link
    (its entry is its target's header and bytes) and a pax name that is not
    ASCII (the header holds '?' for each character)."""
    www = shards / "www" / "made"
    www.mkdir(exist_ok=True)
    src = sorted((shards / "set" / "train").rglob("*.jpg"))[:3]
    work = shards / "made-src"
    work.mkdir(exist_ok=True)
    shutil.copy(src[0], work / "a.jpg")
    os.link(work / "a.jpg", work / "b.jpg")
    for k, label in (("a", "0"), ("b", "1")):
        (work / f"{k}.cls").write_text(label)
    subprocess.run(["tar", "cf", str(www / "links.tar"), "a.jpg", "a.cls", "b.jpg", "b.cls"], cwd=work, check=True)
    with tarfile.open(www / "pax.tar", "w", format=tarfile.PAX_FORMAT) as t:
        for k, (img, label) in enumerate(zip(src[1:], ("2", "1"))):
            t.add(img, arcname=f"caf\u00e9-{k}.jpg")
            info = tarfile.TarInfo(f"caf\u00e9-{k}.cls")
            info.size = 1
            t.addfile(info, io.BytesIO(label.encode()))
    for name in ("links.tar", "pax.tar"):
        subprocess.run([data_tool(), "-q", "index", str(www / name)], check=True)
        local = batches(loader_for(str(www / name)))
        remote = loader_for(url_for(nginx, "made") + "/" + name)
        assert batches(remote) == local, name
        assert remote.stats()["remote"]["requests"] > 0, "streamed"


# ---------------------------------------------------------------- secrets

def test_credentials_and_signatures_never_reach_a_person(shards, nginx, tmp_path):
    secret_url = pattern(url_for(nginx, "data").replace("http://", "http://alice:hunter2@")) + "?X-Amz-Signature=s3cr3t"
    loader = loader_for(secret_url)
    shown = [repr(loader.dataset), str(loader.dataset.root), repr(loader)]
    missing = url_for(nginx, "data").replace("http://", "http://alice:hunter2@") + "/nope-000000.tar?token=s3cr3t"
    with pytest.raises(pinfeed.Error) as e:
        loader_for(missing)
    shown.append(str(e.value))
    with pytest.raises((pinfeed.Error, ValueError)) as e:
        loader_for("http://alice:hunter2@127.0.0.1:1/dir/?token=s3cr3t")
    shown.append(str(e.value))
    scan = subprocess.run([data_tool(), "scan", secret_url], capture_output=True, text=True)
    shown += [scan.stdout, scan.stderr]
    env = dict(os.environ, AWS_ENDPOINT_URL="http://bob:hunter2@127.0.0.1:1/?sig=s3cr3t")
    code = "import pinfeed; pinfeed.set_log_level('debug'); import pinfeed._pinfeed as p; " \
           "p.redact_spec('s3://b/k.tar'); pinfeed.Loader('s3://b/k.tar', remote_retries=0)"
    debug = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    shown += [debug.stdout, debug.stderr]
    pipe = "pipe:curl -s -H 'Authorization: Bearer hunter2' " + url_for(nginx, "data") + "/train-000000.tar"
    shown.append(repr(loader_for(pipe, cache_dir=tmp_path / "c").dataset))
    quoted = "pipe:AUTH='Bearer hunter2' KEY=ab/hunter2 curl -s " + url_for(nginx, "data") + "/train-000001.tar"
    shown.append(repr(loader_for(quoted, cache_dir=tmp_path / "c").dataset))
    shown += [p.read_text() for p in (tmp_path / "c").rglob("*.meta")]
    for text in shown:
        assert "hunter2" not in text and "s3cr3t" not in text, text[-2000:]
    assert "AWS_ENDPOINT_URL=http://127.0.0.1:1/" in debug.stderr, debug.stderr[-2000:]
    assert all(p.stat().st_mode & 0o077 == 0 for p in (tmp_path / "c").rglob("*.meta"))


# ---------------------------------------------------------------- patterns

def test_patterns_expand_every_group_as_webdataset_does(shards, tmp_path):
    braceexpand = pytest.importorskip("braceexpand")
    for p in ("s-{0..1}-{0..1}.tar", "other/{a,b}.tar", "x-{000..002}-{a..b}.tar", "{x,y{1..2}}.tar",
              "s-{x..1}.tar", "s-{one}-{0..1}.tar", "s-{-1..1}.tar", "s-{3..1}.tar", "s-{0..10..5}.tar"):
        assert [str(x) for x in pinfeed._pinfeed.expand_shard_pattern(p)] == list(braceexpand.braceexpand(p)), p
    assert pinfeed._pinfeed.expand_shard_pattern("pipe:cut -d\\, -f1 a.tar,b.tar") == ["pipe:cut -d, -f1 a.tar", "b.tar"]
