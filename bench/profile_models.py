"""Where a steady-state backward spends its time: torch.profiler per implementation.

Profiles one warm ``loss.backward()`` of the MLP and the transformer workloads
of ``bench/run.py`` under eager autograd, ours and torch's built-in compiled
autograd (same ``compiler_fn``, 1 CPU thread) and prints each one's top
operators by self CPU time. This is the profile evidence the README's
performance section cites (what bounds the steady-state ratios).

    python bench/profile_models.py [--backend inductor] [--rows 12]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from run import IMPLS, backend, implementation, mlp, time_backward, transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for make in (mlp, transformer):
        work = make()
        work.compiler = backend(args.backend)
        for impl in IMPLS:
            times = [time_backward(work, impl) for _ in range(23)]
            loss = work.forward(0)
            for p in work.params:
                p.grad = None
            with torch.profiler.profile() as prof, implementation(impl, work.compiler):
                loss.backward()
            print(
                f"===== {work.name} / {impl}: median of 20 warm backwards {statistics.median(times[3:]) * 1e3:.2f} ms"
            )
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
