"""One-off backwards: programs whose backwards mostly run once, eager against ca.

Issue 36's programs, each run whole in a fresh process per implementation
(a capture's cost is the point, so nothing is warm), 1 thread:

- ``gradcheck``: ``gradcheck`` and ``gradgradcheck`` of a linear-algebra
  routine (``a @ a.mT + 3I``, ``cholesky``, ``cholesky_solve``, ``qr``,
  ``solve``, ``tanh``, ``sin``, ``logdet``; float64, n = 2, 3, 4);
- ``notebook``: eight different small models (MLPs of other widths and
  depths), one backward each, as cells of a notebook would run them;
- ``training``: one model, 20 steps (the loop ``capture_after`` must not
  slow down).

Implementations: ``eager``; ``ca`` (``enable(COMPILER)``, the default
``capture_after=2``); ``ca-after-1`` (``capture_after=1``). Prints a
Markdown table of seconds per program and implementation (the program
alone: ``import ca_runtime``, which imports Dynamo, is done before the clock
starts in every implementation), with ca's counters.

    python bench/one_off.py [--compiler aot_eager] [--programs gradcheck,notebook,training]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable

import torch

PROGRAMS = ("gradcheck", "notebook", "training")
IMPLS = ("eager", "ca", "ca-after-1")
ENABLE_KWARGS = {"ca": {}, "ca-after-1": {"capture_after": 1}}


def _routine(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype)
    spd = a @ a.mT + 3 * eye
    chol = torch.linalg.cholesky(spd)
    y = torch.cholesky_solve(b, chol)
    q, r = torch.linalg.qr(spd)
    y = y + torch.linalg.solve(r + 3 * eye, q.mT @ x)
    return (y.tanh() + x.sin()).sum() + torch.logdet(spd)


def gradcheck_program() -> None:
    for n in (2, 3, 4):
        gen = torch.Generator().manual_seed(n)
        inputs = tuple(
            torch.randn(n, k, dtype=torch.float64, generator=gen).requires_grad_() for k in (n, 2, 2)
        )
        assert torch.autograd.gradcheck(_routine, inputs)
        assert torch.autograd.gradgradcheck(_routine, inputs)


def _mlp(widths: tuple[int, ...]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def notebook_program() -> None:
    torch.manual_seed(0)
    for depth in (2, 3, 4, 5):
        for width in (16, 32):
            model = _mlp((8,) + (width,) * depth + (1,))
            model(torch.randn(64, 8)).square().mean().backward()


def training_program() -> None:
    torch.manual_seed(0)
    model = _mlp((8, 64, 64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(20):
        model(torch.randn(64, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()


_PROGRAMS: dict[str, Callable[[], None]] = {
    "gradcheck": gradcheck_program,
    "notebook": notebook_program,
    "training": training_program,
}


def _child(program: str, impl: str, compiler: str) -> None:
    """Runs one program under one implementation; prints its seconds and counters as JSON."""
    torch.set_num_threads(1)
    run = _PROGRAMS[program]
    import ca_runtime  # imported before the clock starts (about 1 s, Dynamo's import) in every impl

    start = time.perf_counter()
    counters: dict[str, int] = {}
    if impl == "eager":
        run()
    else:
        with ca_runtime.enable(compiler, **ENABLE_KWARGS[impl]):
            run()
        counters = ca_runtime.stats()
    print(json.dumps({"seconds": time.perf_counter() - start, "counters": counters}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compiler", default="aot_eager")
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--child", nargs=2, metavar=("PROGRAM", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, args.compiler)
        return
    programs = [p for p in args.programs.split(",") if p]
    for p in programs:
        if p not in _PROGRAMS:
            parser.error(f"--programs: unknown program {p!r}; choose from {', '.join(PROGRAMS)}")
    print(f"compiler {args.compiler}, torch {torch.__version__}, 1 thread, seconds (a fresh process each)\n")
    print("| program | " + " | ".join(IMPLS) + " | ca counters | ca-after-1 counters |")
    print("|---" * (len(IMPLS) + 3) + "|")
    keys = ("captures", "cache_hits", "deferred_captures", "eager_fallbacks")
    for program in programs:
        results = {}
        for impl in IMPLS:
            out = subprocess.run(
                [sys.executable, __file__, "--compiler", args.compiler, "--child", program, impl],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[impl] = json.loads(out.strip().splitlines()[-1])
        eager_s = results["eager"]["seconds"]
        cells = [f"{results[i]['seconds']:.2f} ({results[i]['seconds'] / eager_s:.1f}x)" for i in IMPLS]
        counts = [", ".join(f"{k} {results[i]['counters'].get(k, 0)}" for k in keys) for i in IMPLS[1:]]
        print(f"| {program} | " + " | ".join(cells + counts) + " |", flush=True)


if __name__ == "__main__":
    main()
