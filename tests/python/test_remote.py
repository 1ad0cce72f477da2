"""Shards in object storage (issue 43), against real servers on loopback:
nginx (Debian's nginx-light, started here on a free port, Range requests
on) and, for faults, a Python HTTP server that drops or stalls a transfer
the way a flaky link does. The same shards read from disk are the oracle:
indices, labels and pixels, batch for batch, and a resume state taken from
one works on the other. Shards with index sidecars (www/stream, as pack
writes them) stream sample by sample; without (www/data) they are staged
whole: both paths meet the same oracle."""
import collections
import gc
import hashlib
import http.server
import os
import shutil
import socket
import subprocess
import threading
import time
import weakref

import pytest

import pinfeed
from conftest import data_tool

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
SHARDS = 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    subprocess.run([data_tool(), "-q", "make", "--out", str(root / "set"), "--classes", "3", "--per-class", "8",
                    "--val", "0", "--seed", "4"], check=True)
    (root / "www" / "stream").mkdir(parents=True)
    subprocess.run([data_tool(), "-q", "pack", "--from", str(root / "set" / "train"), "--out",
                    str(root / "www" / "stream" / "train"), "--per-shard", "6"], check=True)
    names = sorted(os.listdir(root / "www" / "stream"))
    assert len(names) == 2 * SHARDS and all(n.endswith(".tar.index.json") for n in names[1::2]), names
    (root / "www" / "data").mkdir()
    for n in names[::2]:  # the same shards without their sidecars: staged whole
        shutil.copy(root / "www" / "stream" / n, root / "www" / "data" / n)
    return root


@pytest.fixture(params=["staged", "streamed"])
def mode(request):
    """The folder on the servers: shards alone, or with index sidecars."""
    return {"staged": "data", "streamed": "stream"}[request.param]


def start_nginx(www, run, port, single=False):
    """nginx serving `www` on 127.0.0.1:port (Range requests on, as always);
    single: one process (master_process off), so SIGKILL takes every
    connection with it. Returns the process, or skips naming why not."""
    if NGINX is None:
        pytest.skip("nginx is not installed (scripts/install-deps.sh installs nginx-light)")
    run.mkdir(exist_ok=True)
    conf = run / "nginx.conf"
    temp = "".join(f"  {k}_temp_path {run}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # As root, nginx's workers would drop to nobody, who cannot read pytest's
    # private tmp folders: they stay the test's user.
    user = "user root;\n" if os.geteuid() == 0 else ""
    master = "master_process off;\n" if single else ""
    conf.write_text(f"""daemon off;
{user}{master}pid {run}/nginx.pid;
error_log {run}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log {run}/access.log;
{temp}  server {{
    listen 127.0.0.1:{port};
    root {www};
  }}
}}
""")
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(run)], stderr=subprocess.PIPE)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                pytest.skip(f"nginx did not start: {proc.stderr.read().decode(errors='replace')[-400:]}")
            time.sleep(0.05)
    pytest.skip("nginx did not listen within 10 s")


@pytest.fixture(scope="module")
def nginx(shards):
    port = free_port()
    proc = start_nginx(shards / "www", shards / "nginx", port)
    yield {"url": f"http://127.0.0.1:{port}/data", "log": shards / "nginx" / "access.log"}
    proc.terminate()
    proc.wait(10)


def batches(loader, epochs=1):
    """(indices, labels, sha256 of the pixels) per batch."""
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels, indices in loader:
            out.append((indices.tolist(), labels.tolist(), hashlib.sha256(images.numpy().tobytes()).hexdigest()))
    return out


def loader_for(data, **kw):
    return pinfeed.Loader(data, batch_size=5, size=32, threads=2, prefetch=2, seed=7, shuffle=True,
                          return_indices=True, **kw)


def pattern(base):
    return f"{base}/train-{{000000..{SHARDS - 1:06d}}}.tar"


def shard_gets(log, folder):
    """GETs of shards (not of their index sidecars) under /folder/ in an access log."""
    return sum(1 for line in log.splitlines() if f'"GET {folder}train-' in line and ".tar HTTP" in line)


def url_for(nginx, folder):
    return nginx["url"].rsplit("/", 1)[0] + "/" + folder


def test_http_shards_give_the_batches_of_the_same_shards_on_disk(shards, nginx, mode):
    local = batches(loader_for(pattern(shards / "www" / "data")), epochs=2)
    loader = loader_for(pattern(url_for(nginx, mode)))
    remote = batches(loader, epochs=2)
    assert remote == local
    assert ("remote" in loader.stats()) == (mode == "stream")
    assert sorted(i for b in remote[:len(remote) // 2] for i in b[0]) == list(range(24))  # every sample once


def test_a_resume_state_from_disk_resumes_the_same_epoch_over_http(shards, nginx, mode):
    local = loader_for(pattern(shards / "www" / "data"))
    it = iter(local)
    for _ in range(2):
        next(it)
    state = local.state_dict()
    rest = [(i.tolist(), l.tolist()) for _, l, i in it]
    remote = loader_for(pattern(url_for(nginx, mode)))
    remote.load_state_dict(state)  # the fingerprint names shards by file name: the same set
    assert [(i.tolist(), l.tolist()) for _, l, i in remote] == rest


def test_two_ranks_on_disk_resume_on_three_ranks_over_http_sharing_one_cache(shards, nginx, tmp_path, mode):
    def ranks(data, world, **kw):
        return [pinfeed.Loader(data, batch_size=2, size=32, threads=1, prefetch=2, seed=3, shuffle=True, rank=r,
                               world_size=world, return_indices=True, **kw) for r in range(world)]
    seen, states = [], []
    for loader in ranks(pattern(shards / "www" / "data"), 2):
        it = iter(loader)
        for _ in range(2):
            seen += next(it)[2].tolist()
        states.append(loader.state_dict())
    rest = []
    for loader in ranks(pattern(url_for(nginx, mode)), 3, cache_dir=tmp_path / "cache"):  # one fetch for the node's ranks
        loader.load_state_dict(states[0])
        rest += [i for _, _, idx in loader for i in idx.tolist()]
    # 16 left over 3 ranks: 6 each, 2 repeated as DistributedSampler pads.
    counts = collections.Counter(seen + rest)
    assert sorted(counts) == list(range(24)) and sum(c - 1 for c in counts.values()) == 2


def test_ranks_starting_together_fetch_each_shard_once(shards, nginx, tmp_path):
    import sys
    # A fresh URL folder (a symlink the server follows): its shards were never fetched.
    name = f"together-{tmp_path.name}"
    os.symlink(shards / "www" / "data", shards / "www" / name)
    url = pattern(nginx["url"].rsplit("/", 1)[0] + "/" + name)
    code = ("import pinfeed, sys; l = pinfeed.Loader(sys.argv[1], cache_dir=sys.argv[2], batch_size=4, size=32); "
            "print(sum(len(b[1]) for b in l))")
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(tmp_path / "cache")], stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    assert [p.communicate(timeout=120)[0].strip() for p in procs] == ["24"] * 3
    assert shard_gets(nginx["log"].read_text(), f"/{name}/") == SHARDS


def test_the_cache_is_reused_after_the_server_confirms_size_and_etag(shards, nginx, tmp_path):
    cache = tmp_path / "cache"
    first = batches(loader_for(pattern(nginx["url"]), cache_dir=cache))
    before = nginx["log"].read_text()
    second = batches(loader_for(pattern(nginx["url"]), cache_dir=str(cache)))
    new = nginx["log"].read_text()[len(before):]  # this run's requests
    assert first == second
    assert shard_gets(new, "/data/") == 0, "a cached shard was fetched again"
    assert new.count('"HEAD /data/train-') == SHARDS
    # A torn copy (the sidecar says another size) is never read: fetched again.
    victim = next(cache.rglob("train-000001.tar"))
    with open(victim, "r+b") as f:
        f.truncate(100)
    before = nginx["log"].read_text()
    assert batches(loader_for(pattern(nginx["url"]), cache_dir=cache)) == first
    new = nginx["log"].read_text()[len(before):]
    assert new.count('"GET /data/train-000001.tar HTTP') == 1 and shard_gets(new, "/data/") == 1


def test_cache_limit_evicts_the_least_recently_used_shards_nobody_holds(shards, nginx, tmp_path):
    cache = tmp_path / "cache"
    one = f"{nginx['url']}/train-000000.tar"
    batches(loader_for(one, cache_dir=cache))
    size = os.path.getsize(next(cache.rglob("train-000000.tar")))
    time.sleep(0.05)
    # The other three, with room for about three: the oldest (000000) goes.
    batches(loader_for(f"{nginx['url']}/train-{{000001..000003}}.tar", cache_dir=cache, cache_limit=3 * size + size // 2))
    assert not list(cache.rglob("train-000000.tar"))
    assert len(list(cache.rglob("train-00000[123].tar"))) == 3


def test_a_missing_shard_fails_at_once_naming_the_url_and_status(nginx):
    url = f"{nginx['url']}/train-000009.tar"
    start = time.monotonic()
    with pytest.raises(pinfeed.Error, match=r"train-000009\.tar.*HTTP status 404"):
        loader_for(url)
    assert time.monotonic() - start < 5, "a 404 is final: no retries"


def test_pipe_shards_read_a_commands_output(shards):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    piped = ",".join(f"pipe:cat {shards / 'www' / 'data' / f'train-{k:06d}.tar'}" for k in range(SHARDS))
    assert batches(loader_for(piped)) == local
    with pytest.raises(pinfeed.Error, match="exited with status"):
        loader_for("pipe:false shard.tar", remote_retries=0)


class Server(http.server.ThreadingHTTPServer):
    """A listen backlog for the streaming reader's 32 connections at once
    (socketserver's default of 5 drops SYNs, and each dropped one costs a
    1-3 s retransmit: a slow test, not a fault under test)."""
    request_queue_size = 128


class Flaky(http.server.BaseHTTPRequestHandler):
    """Serves the shards with Range support; the first GET of each file is
    cut (mode "drop": the connection closes after half the body) or stalls
    (mode "stall": half the body, then nothing). Mode "hold": every Range
    request gets no answer while `hold` is set (until `free` is)."""
    protocol_version = "HTTP/1.1"
    root, mode, seen, ranges, lock = None, "drop", set(), [], threading.Lock()
    hold, free = threading.Event(), threading.Event()

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = os.path.join(self.root, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_error(404)
            return
        body = open(path, "rb").read()
        if self.mode == "busy":
            with self.lock:
                first = path not in self.seen
                self.seen.add(path)
            if first:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        start = 0
        rng = self.headers.get("Range")
        with self.lock:
            self.ranges.append(rng)
        if rng and self.mode == "hold" and self.hold.is_set():
            self.free.wait(60)
            self.close_connection = True
            return
        if rng and self.mode != "norange":
            first, _, last = rng.split("=")[1].partition("-")
            start = int(first)
            body = body[:int(last) + 1] if last else body
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{os.path.getsize(path)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        with self.lock:
            first = path not in self.seen
            self.seen.add(path)
        if first and self.mode in ("drop", "stall", "norange"):
            self.wfile.write(body[start:start + (len(body) - start) // 2])
            self.wfile.flush()
            if self.mode == "stall":
                time.sleep(30)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body[start:])


@pytest.fixture
def flaky(shards):
    servers = []

    def start(mode):
        handler = type("Handler", (Flaky,), {"root": str(shards / "www"), "mode": mode, "seen": set(), "ranges": [],
                                             "hold": threading.Event(), "free": threading.Event()})
        start.handlers.append(handler)
        server = Server(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/data", handler.ranges

    start.handlers = []
    yield start
    for h in start.handlers:
        h.free.set()
    for s in servers:
        s.shutdown()


def test_a_dropped_transfer_resumes_with_a_range_request(shards, flaky):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    url, ranges = flaky("drop")
    assert batches(loader_for(pattern(url), remote_retries=3)) == local
    resumed = [r for r in ranges if r and not r.startswith("bytes=0-")]
    assert len(resumed) == SHARDS, f"each cut shard resumes where it stopped: {ranges}"


def test_a_stalled_transfer_is_retried_after_remote_timeout(shards, flaky):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    start = time.monotonic()
    url, ranges = flaky("stall")
    assert batches(loader_for(pattern(url), remote_timeout=1, remote_retries=2)) == local
    assert sum(1 for r in ranges if r) == SHARDS
    assert time.monotonic() - start < 20


def test_a_server_without_range_support_is_read_again_from_the_start(shards, flaky):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    url, ranges = flaky("norange")  # cuts each first transfer, then answers a Range with the whole object (200)
    assert batches(loader_for(pattern(url), remote_retries=3)) == local
    assert any(ranges) and ranges.count(None) >= 2 * SHARDS, ranges  # resumed, refused, then from the start


def test_a_busy_server_is_asked_again(shards, flaky):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    url, _ = flaky("busy")  # 503 to each shard's first GET
    assert batches(loader_for(pattern(url), remote_retries=2)) == local


def test_a_server_that_never_answers_ends_in_an_error_within_the_budget():
    with socket.socket() as s:  # listens, never accepts: connects, then nothing
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        url = f"http://127.0.0.1:{s.getsockname()[1]}/x/train-000000.tar"
        start = time.monotonic()
        with pytest.raises(pinfeed.Error, match=r"train-000000\.tar.*gave up after 2 tries"):
            loader_for(url, remote_timeout=1, remote_retries=1)
        assert time.monotonic() - start < 10


# ---------------------------------------------------------------- streaming


def tar_bytes(shards):
    return sum(os.path.getsize(p) for p in (shards / "www" / "data").iterdir())


def copy_of_stream(shards, name):
    www = shards / "www" / name
    shutil.copytree(shards / "www" / "stream", www)
    return www


def test_streamed_shards_give_the_first_batch_before_the_set_and_stay_within_the_read_ahead(shards, nginx):
    def small(data, **kw):  # one batch in flight: what was fetched by the first batch is the first batch's
        return pinfeed.Loader(data, batch_size=2, size=32, threads=2, prefetch=1, seed=7, shuffle=True,
                              return_indices=True, **kw)
    local = batches(small(pattern(shards / "www" / "data")))
    before = nginx["log"].read_text()
    bound = 300_000  # about 3 samples
    loader = small(pattern(url_for(nginx, "stream")), remote_readahead=bound)
    loader.set_epoch(0)
    it = iter(loader)
    images, labels, indices = next(it)
    first = loader.stats()["remote"]
    got = [(indices.tolist(), labels.tolist(), hashlib.sha256(images.numpy().tobytes()).hexdigest())]
    got += [(i.tolist(), l.tolist(), hashlib.sha256(x.numpy().tobytes()).hexdigest()) for x, l, i in it]
    assert got == local
    assert 0 < first["bytes"] < tar_bytes(shards) / 2, (first, tar_bytes(shards))  # not the whole set first
    st = loader.stats()["remote"]
    assert st["readahead_limit"] == bound and 0 < st["readahead_peak"] <= bound, st
    new = [l for l in nginx["log"].read_text()[len(before):].splitlines() if '"GET /stream/train-' in l]
    shard_gets = [l for l in new if ".tar HTTP" in l]
    # Each sample once: a read that ran ahead of the read-ahead took its sample on demand, and the
    # read-ahead does not fetch it again.
    assert len(shard_gets) == st["requests"] == 24 and all('" 206 ' in l for l in shard_gets), new[:3]
    assert sum(".tar.index.json HTTP" in l for l in new) == SHARDS  # one small GET per shard to open


def test_streaming_with_cache_dir_reads_the_next_run_from_disk(shards, nginx, tmp_path):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    loader = loader_for(pattern(url_for(nginx, "stream")), cache_dir=tmp_path / "cache")
    assert batches(loader) == local
    deadline = time.monotonic() + 30
    while loader.stats()["remote"]["shards_local"] < SHARDS and time.monotonic() < deadline:
        time.sleep(0.05)  # the whole shards are cached while the epoch streams
    assert loader.stats()["remote"]["shards_local"] == SHARDS
    del loader
    before = nginx["log"].read_text()
    again = loader_for(pattern(url_for(nginx, "stream")), cache_dir=tmp_path / "cache")
    assert batches(again, epochs=2)[:len(local)] == local
    new = nginx["log"].read_text()[len(before):]
    assert again.stats()["remote"]["requests"] == 0 and new.count(".tar HTTP") == SHARDS  # HEADs only
    assert new.count('"GET /stream/train-') == SHARDS  # the sidecars


def test_a_server_killed_and_restarted_mid_epoch_costs_a_pause_not_a_sample(shards, tmp_path):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    port = free_port()
    server = start_nginx(shards / "www", tmp_path / "run", port, single=True)
    restarted = []
    try:
        # No read-ahead: every sample after the kill is asked for while the server is down.
        loader = loader_for(pattern(f"http://127.0.0.1:{port}/stream"), remote_readahead=1, remote_retries=8)
        loader.set_epoch(0)
        got = []
        for k, (x, l, i) in enumerate(loader):
            got.append((i.tolist(), l.tolist(), hashlib.sha256(x.numpy().tobytes()).hexdigest()))
            if k == 1:
                server.kill()  # SIGKILL: listening socket and open connections gone at once
                server.wait(10)

                def restart():
                    restarted.append(start_nginx(shards / "www", tmp_path / "run", port, single=True))
                threading.Timer(2.0, restart).start()
        assert got == local
        st = loader.stats()["remote"]
        assert st["retries"] > 0 and restarted, st
        assert st["requests"] == 24, st  # each sample once: what a read took on demand is not fetched again
    finally:
        time.sleep(2.5)
        for p in [server] + restarted:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_shards_made_elsewhere_stream_once_pinfeed_data_index_has_run(shards, nginx):
    www = shards / "www" / "indexed"
    shutil.copytree(shards / "www" / "data", www)  # shards without sidecars, as another tool writes them
    loader = loader_for(pattern(url_for(nginx, "indexed")))
    assert "remote" not in loader.stats()  # staged whole
    made = subprocess.run([data_tool(), "index", str(www / "train-{000000..000003}.tar")], capture_output=True, text=True)
    assert made.returncode == 0 and f"indexed {SHARDS} shards" in made.stdout, made
    local = batches(loader_for(pattern(shards / "www" / "data")))
    streamed = loader_for(pattern(url_for(nginx, "indexed")))
    assert batches(streamed) == local and streamed.stats()["remote"]["requests"] == 24
    refused = subprocess.run([data_tool(), "index", f"{url_for(nginx, 'indexed')}/train-000000.tar"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "index reads local copies" in refused.stderr, refused


DELAY_PROXY = os.environ.get("PINFEED_DELAY_PROXY") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "release", "bench", "pinfeed-delay-proxy")


def test_a_long_link_that_resets_connections_gives_the_same_batches(shards, nginx):
    """50 ms round trips and connections reset mid-body (bench/delay_proxy.cpp
    between the loader and nginx: no tc netem on this kernel), streamed and
    staged: the same batches after retries."""
    if not os.path.exists(DELAY_PROXY):
        pytest.skip(f"{DELAY_PROXY} is not built (the CMake build's bench/ makes it)")
    local = batches(loader_for(pattern(shards / "www" / "data")))
    port = nginx["url"].split(":")[2].split("/")[0]
    proxy = subprocess.Popen([DELAY_PROXY, "--to", f"127.0.0.1:{port}", "--delay-ms", "25", "--reset-one-in", "12"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        via = f"http://127.0.0.1:{int(proxy.stdout.readline())}"
        for folder in ("stream", "data"):
            loader = loader_for(pattern(f"{via}/{folder}"), remote_retries=10, remote_timeout=5)
            assert batches(loader) == local, folder
    finally:
        proxy.terminate()
        err = proxy.communicate(timeout=10)[1]
    resets = int(err.rsplit(",", 1)[1].split()[0])
    assert resets > 0, err


def test_a_stale_index_is_refused_naming_the_shard_never_read_as_other_samples(shards, nginx):
    www = copy_of_stream(shards, "stale")
    shutil.copy(www / "train-000001.tar.index.json", www / "train-000000.tar.index.json")  # another shard's
    with pytest.raises(pinfeed.Error, match=r"stale/train-000000\.tar.*index"):
        batches(loader_for(pattern(url_for(nginx, "stale"))))


def test_a_streamed_shard_gone_from_the_server_fails_naming_the_url_and_404(shards, nginx):
    www = copy_of_stream(shards, "gone")
    os.remove(www / "train-000002.tar")
    start = time.monotonic()
    with pytest.raises(pinfeed.Error, match=r"gone/train-000002\.tar.*HTTP status 404"):
        batches(loader_for(pattern(url_for(nginx, "gone"))))
    assert time.monotonic() - start < 5, "a 404 is final: no retries"


def test_a_cut_or_refused_sample_transfer_is_asked_again(shards, flaky):
    local = batches(loader_for(pattern(shards / "www" / "data")))
    for mode in ("drop", "busy"):
        url, _ = flaky(mode)  # each shard's first GET is cut halfway, or answered 503
        loader = loader_for(pattern(url.replace("/data", "/stream")), remote_retries=3, remote_timeout=5)
        assert batches(loader) == local
        assert loader.stats()["remote"]["retries"] >= SHARDS


def test_a_server_that_ignores_range_gets_its_shards_staged_and_says_so(shards, flaky, capfd):
    """Sidecars are asked for as a Range: a 200 says the server cannot
    stream, and the set is staged whole (issue 51: it was refused)."""
    local = batches(loader_for(pattern(shards / "www" / "data")))
    url, _ = flaky("norange")
    loader = loader_for(pattern(url.replace("/data", "/stream")), remote_retries=3, remote_timeout=5)
    assert batches(loader) == local
    assert "remote" not in loader.stats()
    assert capfd.readouterr().err.count("no Range support") == 1


def test_a_loader_dropped_while_the_server_stalls_is_gone_at_once(shards, flaky):
    """A program that leaves mid-epoch (del, an exception, the end of a
    function) while the server stalls: the decoding threads stop waiting for
    their bytes, and the loader goes at once, not after remote_timeout (20 s
    here) and its retries. The server runs in this process, as a user's
    proxy or test server might: stopping the loader must not hold the GIL."""
    url, _ = flaky("hold")
    handler = flaky.handlers[-1]
    loader = loader_for(pattern(url.replace("/data", "/stream")), remote_readahead=1, remote_timeout=20)
    loader.set_epoch(0)
    it = iter(loader)
    next(it)
    deadline = time.monotonic() + 10  # batch 2 is ready, and the loader idles: the consumer holds the other slot
    while time.monotonic() < deadline and not (loader.stats()["ready_batches"] == 1 and loader.stats()["in_flight"] == 0):
        time.sleep(0.02)
    handler.hold.set()  # from now on no sample comes
    waits = loader.stats()["remote"]["waits"]
    next(it)  # batch 2; batch 1's slot is free, and batch 3 waits for its samples
    deadline = time.monotonic() + 10
    while loader.stats()["remote"]["waits"] == waits and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loader.stats()["remote"]["waits"] > waits, "premise: a read waits for the stalled server"
    gone = weakref.ref(loader)
    start = time.monotonic()
    del it, loader
    gc.collect()
    took = time.monotonic() - start
    assert gone() is None and took < 5, took


def test_a_crop_params_read_waits_through_another_epochs_stop(shards, flaky):
    """Only the stopped epoch's reads give up: crop_params() on another
    thread, waiting for a sample from a stalled server while the program
    starts the next epoch, gets its answer once the server answers."""
    order = [i for ind, _, _ in batches(loader_for(pattern(shards / "www" / "data"))) for i in ind]
    url, _ = flaky("hold")
    handler = flaky.handlers[-1]
    loader = loader_for(pattern(url.replace("/data", "/stream")), remote_readahead=1, remote_timeout=20)
    expected = loader_for(pattern(shards / "www" / "data")).crop_params(order[-1], 0)
    loader.set_epoch(0)
    it = iter(loader)
    next(it)
    handler.hold.set()
    got = []
    asking = threading.Thread(target=lambda: got.append(loader.crop_params(order[-1], 0)))  # the epoch's last: not fetched
    asking.start()
    time.sleep(0.5)
    loader.set_epoch(1)
    again = iter(loader)  # stops epoch 0: its reads give up, the crop's does not
    time.sleep(0.5)
    assert asking.is_alive() and not got, "premise: the crop waits for the held server"
    handler.hold.clear()
    handler.free.set()  # the held requests end unanswered, and their retries are served
    asking.join(30)
    assert got == [expected]
    del again, it, loader


# ---------------------------------------------------------------- S3

S3DEPS = os.environ.get("PINFEED_S3DEPS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                         "build", "s3deps")
SETUP = """
import boto3, json, sys
kw = dict(endpoint_url=sys.argv[1], region_name="us-east-1", aws_access_key_id="setup", aws_secret_access_key="setup")
iam = boto3.client("iam", **kw)
iam.create_user(UserName="trainer")
key = iam.create_access_key(UserName="trainer")["AccessKey"]
iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
boto3.client("s3", **kw).create_bucket(Bucket="pinfeed-test")
boto3.client("s3", **kw).create_bucket(Bucket="pinfeed-list")
print(key["AccessKeyId"], key["SecretAccessKey"])
"""
UPLOAD = """
import boto3, os, sys
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
for path in sys.argv[3:]:
    bucket, _, prefix = sys.argv[2].partition("/")
    s3.upload_file(path, bucket, prefix + os.path.basename(path))
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server (scripts/test.sh installs it into build/s3deps), with
    authentication on after the 5 setup calls: a request whose signature is
    wrong is refused, so a passing read proves libcurl's SigV4 signing."""
    import sys
    if not os.path.isdir(os.path.join(S3DEPS, "moto")):
        pytest.skip(f"moto is not installed in {S3DEPS} (scripts/test.sh installs it)")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=S3DEPS, INITIAL_NO_AUTH_ACTION_COUNT="5", PYTHONWARNINGS="ignore")
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.skip("moto's server did not start")
                time.sleep(0.1)
        key, secret = subprocess.run([sys.executable, "-c", SETUP, endpoint], env=env, check=True,
                                     capture_output=True, text=True).stdout.split()
        yield {"endpoint": endpoint, "env": {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                                             "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}, "deps": env}
    finally:
        proc.terminate()
        proc.wait(10)


def test_s3_shards_packed_by_pinfeed_and_by_boto3_read_as_on_disk(shards, s3, monkeypatch, tmp_path):
    import sys
    for k, v in s3["env"].items():
        monkeypatch.setenv(k, v)
    local = batches(loader_for(pattern(shards / "www" / "data")))
    subprocess.run([data_tool(), "-q", "pack", "--from", str(shards / "set" / "train"), "--out",
                    "s3://pinfeed-test/packed/train", "--per-shard", "6"], check=True)
    assert batches(loader_for(pattern("s3://pinfeed-test/packed"))) == local
    files = sorted(str(p) for p in (shards / "www" / "data").iterdir())
    for where in ("pinfeed-test/boto/", "pinfeed-list/"):
        subprocess.run([sys.executable, "-c", UPLOAD, s3["endpoint"], where] + files, check=True,
                       env=dict(s3["deps"], **s3["env"]))
    assert batches(loader_for(pattern("s3://pinfeed-test/boto"), cache_dir=tmp_path / "c")) == local
    # A key with a space (s3:// names the key as it is; it is sent percent-encoded; moto refuses even
    # boto3's own signature for a key with a %, which remote_test checks without a server).
    subprocess.run([sys.executable, "-c", UPLOAD, s3["endpoint"], "pinfeed-test/odd key/"] + files, check=True,
                   env=dict(s3["deps"], **s3["env"]))
    assert batches(loader_for(pattern("s3://pinfeed-test/odd key"))) == local
    # A prefix ending in '/': its .tar objects, listed (ListObjectsV2, signed), in key order. A
    # bucket's root here: moto's signature check fails a '/' in the query even for boto3's own
    # ListObjectsV2 (Prefix="boto/"), so nested prefixes are listed unsigned-checked only.
    assert batches(loader_for("s3://pinfeed-list/")) == local
    assert len(loader_for("s3://pinfeed-test/").samples) == 72  # packed/, boto/, odd key/: keys under the prefix, nested too
    scan = subprocess.run([data_tool(), "scan", pattern("s3://pinfeed-test/boto")], capture_output=True, text=True)
    assert scan.returncode == 0 and "24 images" in scan.stdout, scan.stdout + scan.stderr


def test_s3_refuses_a_wrong_secret_and_a_missing_key_naming_them(shards, s3, monkeypatch):
    for k, v in s3["env"].items():
        monkeypatch.setenv(k, v)
    with pytest.raises(pinfeed.Error, match=r"s3://pinfeed-test/nothing/train-000000\.tar: HTTP status 404 NoSuch"):
        loader_for("s3://pinfeed-test/nothing/train-000000.tar")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(pinfeed.Error, match=r"HTTP status 403 SignatureDoesNotMatch"):
        loader_for("s3://pinfeed-test/packed/train-000000.tar")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("HOME", str(shards))  # no ~/.aws either
    with pytest.raises(pinfeed.Error, match="no S3 credentials"):
        loader_for("s3://pinfeed-test/packed/train-000000.tar")
    # pack says so before it packs anything.
    start = time.monotonic()
    packed = subprocess.run([data_tool(), "pack", "--from", str(shards / "set" / "train"), "--out",
                             "s3://pinfeed-test/nocreds/train", "--per-shard", "6"], capture_output=True, text=True)
    assert packed.returncode != 0 and "no S3 credentials" in packed.stderr and "packed" not in packed.stdout, packed
    assert time.monotonic() - start < 5
