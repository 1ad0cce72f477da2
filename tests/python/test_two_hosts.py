"""Two hosts, for real: two network namespaces joined by a veth pair
(10.77.0.1 "host-a" and 10.77.0.2 "host-b", nothing routed outside), each
with its own host name, one torchrun agent on each, c10d rendezvous on
host-a. pinfeed-train (Gloo) and a torch DDP script fed by pinfeed.Loader,
4 ranks, 2 per host, against the same 4 ranks on one host; then host-b is
lost mid-run and both hosts resume from the checkpoint.

Needs root (ip netns, as in CI); skipped with the reason otherwise."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from pinfeed import _tools

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
               "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
               "SLURM_STEP_ID", "GLOO_SOCKET_IFNAME")
TRAIN = ["--devices", "cpu:1", "--batch-size", "16", "--size", "16", "--pool", "2", "--loader-threads", "1",
         "--comm-timeout", "20", "--json"]
DDP_SCRIPT = r'''
import json, os, sys
import torch, torch.distributed as dist
import pinfeed
dist.init_process_group("gloo")
loader = pinfeed.Loader(sys.argv[1], batch_size=4, size=16, shuffle=True, seed=5, threads=1, return_indices=True)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3 * 16 * 16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen, loss = [], None
for epoch in range(2):
    for images, labels, indices in loader:
        seen += [int(i) for i in indices] if epoch == 0 else []
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
        loss.backward()
        opt.step()
report = dict(rank=dist.get_rank(), world=dist.get_world_size(), local_ranks=loader.pin_report()["local_ranks"],
              seen=seen, loss=float(loss), weights=model.module.weight.detach().flatten()[:64].tolist(),
              host=os.uname().nodename)
with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


def train_tool():
    return os.environ.get("PINFEED_TRAIN_TOOL") or _tools.path("pinfeed-train")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


class Hosts:
    """Two network namespaces on one veth pair; /etc/netns/<ns>/hosts (which
    `ip netns exec` mounts over /etc/hosts) names both hosts in both."""
    ADDR = {"host-a": "10.77.0.1", "host-b": "10.77.0.2"}

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.ns = {"host-a": f"pfa{tag}", "host-b": f"pfb{tag}"}
        self.created = []
        for ns in self.ns.values():
            r = sh("ip", "netns", "add", ns)
            if r.returncode != 0:
                self.close()
                pytest.skip(f"network namespaces are not allowed here (ip netns add: {r.stderr.strip()})")
            self.created.append(ns)
        a, b = self.ns["host-a"], self.ns["host-b"]
        steps = [("ip", "link", "add", f"pfva{tag}", "type", "veth", "peer", "name", f"pfvb{tag}"),
                 ("ip", "link", "set", f"pfva{tag}", "netns", a), ("ip", "link", "set", f"pfvb{tag}", "netns", b),
                 ("ip", "-n", a, "addr", "add", "10.77.0.1/24", "dev", f"pfva{tag}"),
                 ("ip", "-n", b, "addr", "add", "10.77.0.2/24", "dev", f"pfvb{tag}"),
                 ("ip", "-n", a, "link", "set", f"pfva{tag}", "up"), ("ip", "-n", b, "link", "set", f"pfvb{tag}", "up"),
                 ("ip", "-n", a, "link", "set", "lo", "up"), ("ip", "-n", b, "link", "set", "lo", "up")]
        for step in steps:
            r = sh(*step)
            if r.returncode != 0:
                self.close()
                pytest.skip(f"cannot join two namespaces by a veth pair ({' '.join(step)}: {r.stderr.strip()})")
        for ns in self.ns.values():
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in self.ADDR.items()))

    def close(self):
        for ns in self.created:
            sh("ip", "netns", "pids", ns)
            for pid in sh("ip", "netns", "pids", ns).stdout.split():
                sh("kill", "-9", pid)
            sh("ip", "netns", "del", ns)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def start(self, host, cmd, env):
        """`cmd` on `host`: its network namespace, its own host name."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c",
                                 f'hostname {host} && exec "$@"', "sh", *cmd], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def pids_of(self, host, name):
        found = []
        for pid in sh("ip", "netns", "pids", self.ns[host]).stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if name.encode() in f.read().split(b"\0")[0]:
                        found.append(pid)
            except OSError:
                pass
        return found

    def kill_all(self, host):
        for pid in sh("ip", "netns", "pids", self.ns[host]).stdout.split():
            sh("kill", "-9", pid)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0:
        pytest.skip("two hosts are two network namespaces: that needs root (ip netns), as in CI")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("iproute2 (ip) or util-linux (unshare) is missing")
    try:
        import torch.distributed.run  # noqa: F401  (torchrun's module)
    except ImportError:
        pytest.skip("torch is not installed: torchrun launches the two hosts")
    h = Hosts()
    yield h
    h.close()


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    return env


def torchrun(nnodes, rdzv, program):
    # --redirects/--tee 9:1: torch 1.13's dodge for its crash on Python 3.11 (docs/usage.md, "Launching").
    base = [sys.executable, "-m", "torch.distributed.run", "--redirects", "9:1", "--tee", "9:1"]
    if nnodes == 1:
        return base + ["--standalone", "--nproc_per_node", "4", *program]
    return base + ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", rdzv,
                   "--rdzv_id", f"two-{rdzv}", *program]


def two_hosts(hosts, program, env, timeout=180):
    rdzv = f"10.77.0.1:{free_port()}"
    procs = {h: hosts.start(h, torchrun(2, rdzv, program), env) for h in ("host-a", "host-b")}
    out = {h: p.communicate(timeout=timeout) for h, p in procs.items()}
    return {h: (procs[h].returncode, *out[h]) for h in procs}


def one_host(program, env, timeout=180):
    p = subprocess.run(torchrun(1, None, program), env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def summary(stdout):
    return json.loads(stdout[stdout.index("{"):])


def test_pinfeed_train_on_two_hosts_equals_four_ranks_on_one(hosts, dataset, tmp_path):
    env = clean_env()
    args = ["--no_python", train_tool(), "--data", str(dataset), *TRAIN, "--epochs", "3"]
    split = two_hosts(hosts, args + ["--checkpoint", str(tmp_path / "two.ckpt")], env)
    assert all(rc == 0 for rc, _, _ in split.values()), split
    rc, out, err = one_host(args + ["--checkpoint", str(tmp_path / "one.ckpt")], env)
    assert rc == 0, err
    two, one = summary(split["host-a"][1]), summary(out)
    assert two["world_size"] == one["world_size"] == 4 and two["communicator"] == "gloo"
    assert [e["loss"] for e in two["epochs"]] == [e["loss"] for e in one["epochs"]]
    assert (tmp_path / "two.ckpt").read_bytes() == (tmp_path / "one.ckpt").read_bytes()


def test_mpirun_across_two_hosts_equals_four_ranks_on_one(hosts, dataset, tmp_path, mpirun):
    """mpirun on host-a starts host-b's daemon through an rsh agent that
    enters host-b's namespace (what ssh would do between machines)."""
    agent = tmp_path / "agent.sh"
    agent.write_text("#!/bin/sh\nhost=$1; shift\ncase $host in\n"
                     + "".join(f"  {h}) ns={ns};;\n" for h, ns in hosts.ns.items())
                     + '  *) echo "unknown host $host" >&2; exit 1;;\nesac\n'
                     'exec ip netns exec $ns unshare --uts sh -c "hostname $host; $*"\n')
    agent.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("host-a slots=2\nhost-b slots=2\n")
    env = clean_env(OMPI_MCA_btl_vader_single_copy_mechanism="none")
    program = [train_tool(), "--data", str(dataset), *TRAIN, "--epochs", "3"]
    p = hosts.start("host-a", [mpirun, "--allow-run-as-root", "--hostfile", str(hostfile), "-np", "4", "--mca",
                               "plm_rsh_agent", str(agent), "--mca", "btl_tcp_if_include", "10.77.0.0/24", "--mca",
                               "oob_tcp_if_include", "10.77.0.0/24", *program,
                               "--checkpoint", str(tmp_path / "two.ckpt")], env)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    one = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", *program, "--checkpoint",
                          str(tmp_path / "one.ckpt")], env=env, capture_output=True, text=True, timeout=180)
    assert one.returncode == 0, one.stderr
    two, single = summary(out), summary(one.stdout)
    assert two["communicator"] == single["communicator"] == "mpi" and two["world_size"] == 4
    assert [e["loss"] for e in two["epochs"]] == [e["loss"] for e in single["epochs"]]
    assert (tmp_path / "two.ckpt").read_bytes() == (tmp_path / "one.ckpt").read_bytes()


def test_a_torch_ddp_script_on_two_hosts_shards_like_one_host(hosts, dataset, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    env = clean_env(PYTHONPATH=os.pathsep.join(sys.path))
    reports = {}
    for kind in ("two", "one"):
        out_dir = tmp_path / kind
        out_dir.mkdir()
        program = [str(script), str(dataset), str(out_dir)]
        if kind == "two":
            r = two_hosts(hosts, program, env)
            assert all(rc == 0 for rc, _, _ in r.values()), r
        else:
            rc, out, err = one_host(program, env)
            assert rc == 0, err
        reports[kind] = {int(p.stem[4:]): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}
    two, one = reports["two"], reports["one"]
    assert sorted(two) == sorted(one) == [0, 1, 2, 3]
    assert {r: two[r]["host"] for r in two} == {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}
    assert all(two[r]["local_ranks"] == 2 for r in two)  # each host's budget split between its 2 ranks
    assert all(one[r]["local_ranks"] == 4 for r in one)
    # Disjoint and complete across hosts (DistributedSampler's padding aside).
    seen = [i for r in sorted(two) for i in two[r]["seen"]]
    n = len(set(seen))
    assert n == len({i for r in one for i in one[r]["seen"]})
    assert len(seen) - n < 4
    assert [two[r]["seen"] for r in sorted(two)] == [one[r]["seen"] for r in sorted(one)]
    assert [two[r]["loss"] for r in sorted(two)] == [one[r]["loss"] for r in sorted(one)]
    assert two[0]["weights"] == one[0]["weights"]


def test_a_host_lost_mid_run_is_named_and_both_hosts_resume_bit_identically(hosts, dataset, tmp_path):
    env = clean_env()
    args = ["--no_python", train_tool(), "--data", str(dataset), *TRAIN, "--epochs", "60", "--checkpoint-every", "2"]
    full = two_hosts(hosts, args + ["--checkpoint", str(tmp_path / "full.ckpt")], env)
    assert all(rc == 0 for rc, _, _ in full.values()), full

    ckpt = tmp_path / "cut.ckpt"
    rdzv = f"10.77.0.1:{free_port()}"
    procs = {h: hosts.start(h, torchrun(2, rdzv, args + ["--checkpoint", str(ckpt)]), env) for h in ("host-a", "host-b")}
    end = time.time() + 120
    while not ckpt.exists() and time.time() < end and procs["host-a"].poll() is None:
        time.sleep(0.02)
    assert ckpt.exists(), procs["host-a"].communicate()
    hosts.kill_all("host-b")
    lost_at = time.time()
    # host-a's ranks end within the timeout. (torchrun's agent then waits in
    # its exit barrier for host-b's agent, 300 s in torch 1.13: not ours.)
    while time.time() - lost_at < 40 and hosts.pids_of("host-a", "pinfeed-train"):
        time.sleep(0.1)
    assert not hosts.pids_of("host-a", "pinfeed-train"), "host-a's ranks outlived host-b"
    assert time.time() - lost_at < 20 + 10
    hosts.kill_all("host-a")
    _, err = procs["host-a"].communicate(timeout=60)
    procs["host-b"].communicate(timeout=60)
    assert "ranks 2 or 3 at 10.77.0.2: lost, stopped or failed" in err, err[-3000:]

    resumed = two_hosts(hosts, args + ["--checkpoint", str(ckpt), "--resume"], env)
    assert all(r == 0 for r, _, _ in resumed.values()), resumed
    assert ckpt.read_bytes() == (tmp_path / "full.ckpt").read_bytes()
