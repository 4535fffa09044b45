"""Process start-up: read the launcher's environment, pick device and backend, seed everything."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int


def read_launch_env() -> LaunchEnv:
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain ``python`` run is rank 0 of 1."""
    env = os.environ
    return LaunchEnv(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def device_for(local_rank: int) -> torch.device:
    """The one place that decides between CUDA and CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
