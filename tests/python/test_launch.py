"""The launch: pinfeed.launch_env() and the loader's shard, from torchrun's,
OpenMPI's, PMI's and Slurm's variables and from torch.distributed, read by
the same C++ reader as pinfeed-train's."""
import json
import os
import subprocess
import sys

import pytest

import pinfeed

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
               "PMI_SIZE", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID",
               "SLURM_STEP_TASKS_PER_NODE")


def run(code, **env):
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run([sys.executable, "-c", code], env=dict(clean, **env), capture_output=True, text=True)


LAUNCHERS = {
    "torchrun": lambda r: dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2"),
    "mpi": lambda r: dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                          OMPI_COMM_WORLD_LOCAL_SIZE="2"),
    "pmi": lambda r: dict(PMI_RANK=str(r), PMI_SIZE="2"),
    "slurm": lambda r: dict(SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID=str(r),
                            SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2"),
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_ranks_of_every_launcher_cover_every_sample_once(dataset, launcher):
    code = ("import json, pinfeed; e = pinfeed.launch_env(); "
            "l = pinfeed.Loader(%r, batch_size=4, size=16, threads=1, shuffle=True, return_indices=True); "
            "l.set_epoch(1); print(json.dumps([e, l.rank, l.world_size, [int(i) for _, _, x in l for i in x]]))"
            % str(dataset))
    seen = []
    for rank in (0, 1):
        out = run(code, **LAUNCHERS[launcher](rank))
        assert out.returncode == 0, out.stderr
        env, r, world, mine = json.loads(out.stdout)
        assert env["launcher"] == launcher and (r, world) == (rank, 2)
        assert len(mine) == 20
        seen += mine
    assert sorted(seen) == list(range(40))


def test_launch_variables_that_disagree_are_an_error_naming_both(dataset):
    out = run("import pinfeed; pinfeed.Loader(%r, size=16)" % str(dataset),
              RANK="0", WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2")
    assert out.returncode != 0
    assert "RANK/WORLD_SIZE" in out.stderr and "OMPI_COMM_WORLD_RANK" in out.stderr, out.stderr


def test_an_initialized_torch_distributed_outranks_the_variables(tmp_path):
    code = ("import torch.distributed as d, pinfeed; "
            "d.init_process_group('gloo', init_method='file://%s', rank=0, world_size=1); "
            "print(pinfeed.launch_env()['launcher'])" % (tmp_path / "store"))
    out = run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.distributed"
    out = run(code, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")  # a group of 1 inside a launch of 2
    assert out.returncode != 0
    assert "torch.distributed is initialized as rank 0 of 1" in out.stderr, out.stderr


def test_threads_zero_takes_this_hosts_cores_over_its_local_ranks(dataset):
    cores = len(os.sched_getaffinity(0))
    code = "import pinfeed; print(pinfeed.Loader(%r, size=16, threads=0).num_workers)" % str(dataset)
    out = run(code, **LAUNCHERS["torchrun"](0))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == max(1, cores // 2)
    out = run(code)
    assert int(out.stdout) == cores


def _torch_version():
    import torch
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _store_servers():
    """torch's TCPStore server kinds this torch has: the classic daemon, and
    libuv's (torch >= 2.2, the default since 2.4)."""
    try:
        return [False, True] if _torch_version() >= (2, 2) else [False]
    except ImportError:
        return [False]


@pytest.mark.parametrize("libuv", _store_servers(), ids=lambda v: "libuv" if v else "classic")
def test_the_rendezvous_client_speaks_to_torchs_own_tcpstore(libuv):
    """pinfeed's C++ store client (what pinfeed-train uses under torchrun)
    against a TCPStore server of whichever torch is installed: 1.13 speaks
    the old protocol, >= 2.1 the validated one, and the probe must find it."""
    binary = os.environ.get("PINFEED_TCP_STORE_TEST")
    if not binary:
        pytest.skip("PINFEED_TCP_STORE_TEST is not set (the build tree's tcp_store_test)")
    import socket
    import torch.distributed as dist
    from datetime import timedelta
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = {"use_libuv": libuv} if libuv or _torch_version() >= (2, 2) else {}
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=20), wait_for_workers=False, **kwargs)
    store.set("interop/from-torch", "torch")
    env = dict(os.environ, PINFEED_TEST_STORE_PORT=str(port))
    version = _torch_version()
    if version < (2, 0):
        env["PINFEED_TEST_STORE_DIALECT"] = "v1"
    elif version >= (2, 2):
        env["PINFEED_TEST_STORE_DIALECT"] = "v2"
    out = subprocess.run([binary, "--gtest_filter=TcpStoreTest.ExternalStoreFromTorch"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[  PASSED  ] 1 test" in out.stdout, out.stdout
    assert store.get("interop/from-pinfeed") == b"pf"
    assert store.add("interop/counter", 0) == 5
