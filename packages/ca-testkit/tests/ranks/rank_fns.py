"""Functions the spawned ranks of test_distributed.py import (this folder is put on PYTHONPATH)."""

from __future__ import annotations

import time


def all_reduce_rank(rank: int, world_size: int, scale: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank * scale)])
    dist.all_reduce(t)
    return t.item()


def raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def sleep_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank
