"""Where this process sits in a launch (torchrun, mpirun, srun, or an
initialized torch.distributed)."""

import torch  # pinfeed._api imported it first, or said why it cannot

from . import _pinfeed
from ._options import _int_arg


def launch_env():
    """Where this process sits in a launch, as a dict: rank, world_size,
    local_rank, local_world_size, launcher and source. From, in this order,
    torch.distributed when it is initialized, torchrun's RANK/WORLD_SIZE/
    LOCAL_RANK/LOCAL_WORLD_SIZE, OpenMPI's OMPI_COMM_WORLD_*, PMI_*, and an
    srun step's SLURM_* variables: the reader pinfeed-train uses. Sources
    that disagree raise pinfeed.ConfigError naming both."""
    group = None
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        group = (dist.get_rank(), dist.get_world_size())
    return dict(_pinfeed.launch_env(group))


def _place_in_launch(rank, world_size, local_rank, options):
    """(rank, world_size, local_rank), the unset ones from the launch; the
    ranks on this host (local_ranks) split its memory and, threads=0, its
    cores."""
    if rank is None or world_size is None or local_rank is None or "local_ranks" not in options:
        env = launch_env()
        rank = env["rank"] if rank is None else rank
        world_size = env["world_size"] if world_size is None else world_size
        local_rank = env["local_rank"] if local_rank is None else local_rank
        options.setdefault("local_ranks", env["local_world_size"])
    rank = _int_arg("rank", rank, 0, 2**31 - 1)
    world_size = _int_arg("world_size", world_size, 1, 2**31 - 1)
    local_rank = _int_arg("local_rank", local_rank, 0, 2**31 - 1)
    if not (0 <= rank < world_size):
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size, local_rank
