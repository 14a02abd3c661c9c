"""``run_ranks()``: one function on N gloo CPU processes, with a hard timeout.

For differential tests of distributed training (DDP, FSDP) under compiled
autograd: each rank calls ``compare()`` on its own model replica, and the
results come back to the caller. The ranks are spawned processes (so ``fn``
must be importable: a module-level function of an importable module or of the
``__main__`` script), the process group is initialised from a file in a fresh
temporary directory (no network) and destroyed in a ``finally`` while the
interpreter is still whole: a gloo group left to interpreter shutdown can hang
it.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised, died or did not finish in time; the message has its traceback."""


def _rank_main(
    rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, results: Any
) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world_size)
    try:
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - every failure of a rank is reported to the parent
            results.put((rank, False, traceback.format_exc()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 300.0) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns results by rank.

    Raises RankError if a rank raises, exits without a result, or the ranks
    are not all done within ``timeout`` seconds (they are killed then).
    """
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="ca_ranks_") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            context.Process(target=_rank_main, args=(rank, world_size, init_file, fn, args, results))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[bool, Any]] = {}
        try:
            while len(got) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RankError(
                        f"ranks {sorted(set(range(world_size)) - set(got))} did not finish in {timeout} s"
                    )
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                    got[rank] = (ok, value)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                    if dead:
                        # A result may still be in flight from a rank that just exited.
                        time.sleep(0.5)
                        if results.empty():
                            raise RankError(
                                f"ranks {dead} exited without a result (exit codes "
                                f"{[procs[r].exitcode for r in dead]})"
                            ) from None
            for p in procs:
                p.join(max(deadline - time.monotonic(), 1.0))
                if p.is_alive():
                    raise RankError(f"a rank did not exit within {timeout} s after its result")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = {rank: value for rank, (ok, value) in got.items() if not ok}
    if failed:
        raise RankError("\n".join(f"rank {rank} raised:\n{tb}" for rank, tb in sorted(failed.items())))
    return [got[rank][1] for rank in range(world_size)]
