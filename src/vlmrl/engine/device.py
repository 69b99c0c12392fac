"""The process's device, rank and seeds: what every command sets up first."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from vlmrl.config import ConfigError


def env_world() -> tuple[int, int, int]:
    """(world_size, rank, local_rank) from the launcher's environment (torchrun / accelerate launch / MPI)."""

    def first(names: tuple[str, ...], default: int) -> int:
        for name in names:
            if os.environ.get(name, "") != "":
                return int(os.environ[name])
        return default

    world = first(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), 1)
    rank = first(("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"), 0)
    local = first(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"), 0)
    return world, rank, local


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"training.device={name!r} but CUDA is not available; use training.device=cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
