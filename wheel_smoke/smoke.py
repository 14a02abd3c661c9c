"""Smoke test of the installed ca-core and ca-runtime wheels, run by ``nox -s wheels`` from a temporary directory.

Checks that the packages come from the environment's site-packages (not a
source tree), that an MLP's backward is captured once and then served from
the cache with eager's gradients, that the report is written, and that
ca-core refuses a torch other than the one it is bound to, saying what to do.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import sysconfig

import ca_core
import ca_runtime
import torch

SITE = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()


def _installed(module: object) -> None:
    path = pathlib.Path(module.__file__).resolve()  # type: ignore[attr-defined]
    assert SITE in path.parents, f"{module.__name__} is imported from {path}, not from {SITE}"  # type: ignore[attr-defined]


def _mlp_grads(steps: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(16, 8)
    grads = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(x).log_softmax(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def main() -> None:
    for module in (ca_core, ca_runtime):
        _installed(module)
    print(
        f"ca-core {ca_core.__version__} (bound to torch {ca_core.TORCH_VERSION}), ca-runtime {ca_runtime.__version__}"
    )
    assert ca_core.__version__.endswith(f"+torch{torch.__version__.split('+')[0]}"), ca_core.__version__

    eager = _mlp_grads(4)
    ca_runtime.reset()
    with ca_runtime.enable("eager"):
        compiled = _mlp_grads(4)
    stats = ca_runtime.stats()
    # The default capture_after=2: step 1 eager, step 2 captured, then hits.
    assert stats["deferred_captures"] == 1 and stats["captures"] == 1 and stats["cache_hits"] == 2, stats
    assert stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    for step_eager, step_ca in zip(eager, compiled):
        for e, c in zip(step_eager, step_ca):
            assert torch.equal(e, c), "grads differ from eager's"
    print("MLP backward: 1 deferred, 1 capture, 2 cache hits, grads bitwise eager's")

    page = ca_runtime.report("smoke-report.html")
    assert page.stat().st_size > 0 and page.with_suffix(".json").is_file()
    print(f"report written: {page}")

    # A torch other than the bound one: importing ca_core fails, naming both and the fix.
    code = "import torch; torch.__version__ = '2.99.0'; import ca_core"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.returncode != 0 and "built against torch" in run.stderr and "torch==" in run.stderr, run.stderr
    print("a mismatched torch: " + run.stderr.strip().splitlines()[-1][:160])


if __name__ == "__main__":
    main()
