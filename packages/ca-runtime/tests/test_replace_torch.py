"""Code written for torch's compiled autograd, run on ca with ``replace_torch()``.

See [Note: Running torch's entry points on ca] (_enable.py). Each pattern is
torch's documented one: ``torch._dynamo.config.compiled_autograd = True``
around a ``torch.compile``'d step, and ``compiled_autograd._enable(compiler_fn)``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ca_core
import ca_runtime
import pytest
import torch
from ca_testkit import compare

STEPS = 3


def _model() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, [torch.randn(3, 4) for _ in range(STEPS)]


def test_config_compiled_autograd_runs_on_ca(backend: str) -> None:
    """config.compiled_autograd=True: each call of the compiled step enters torch's _enable, now ca's."""
    model, xs = _model()

    @torch.compile(backend=backend)
    def step_fn(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss.detach()

    def step(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if ca_core.installed_runtime() is None:  # compare()'s eager run
            with torch._dynamo.config.patch(compiled_autograd=False):
                return step_fn(xs[i])
        with torch._dynamo.config.patch(compiled_autograd=True), ca_runtime.replace_torch():
            return step_fn(xs[i])

    torch._dynamo.reset()
    result = compare(step, backend, tensors=model, steps=STEPS)
    result.assert_ok()
    # One capture: the torch.compile context, remade per call, keys one cache.
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == STEPS - 1, result.stats
    assert not torch._dynamo.compiled_autograd.compiled_autograd_enabled  # torch's own never ran


def test_enable_of_torch_runs_on_ca_and_is_restored(backend: str) -> None:
    model, xs = _model()
    original = torch._dynamo.compiled_autograd._enable

    def step(i: int) -> None:
        model.zero_grad(set_to_none=True)
        if ca_core.installed_runtime() is None:
            model(xs[i]).sum().backward()
            return
        with ca_runtime.replace_torch():
            assert torch._dynamo.compiled_autograd._enable is not original
            with torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend=backend)):
                assert isinstance(ca_core.installed_runtime(), ca_runtime.Runtime)
                model(xs[i]).sum().backward()

    result = compare(step, backend, tensors=model, steps=STEPS)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == STEPS - 1, result.stats
    assert torch._dynamo.compiled_autograd._enable is original


def test_force_eager_stance_and_an_active_disable_stay_eager() -> None:
    x = torch.randn(3, requires_grad=True)
    with ca_runtime.replace_torch():
        with torch.compiler.set_stance("force_eager"), torch._dynamo.compiled_autograd._enable(lambda gm: gm):
            (x * 2).sum().backward()
        with (
            torch._dynamo.compiled_autograd._disable(),
            torch._dynamo.compiled_autograd._enable(lambda gm: gm, ignore_active_disable_ctx=False),
        ):
            (x * 2).sum().backward()
    assert ca_runtime.stats()["captures"] == 0
    assert torch.equal(x.grad, torch.full((3,), 4.0))


@pytest.mark.parametrize(
    ("setting", "shows_code"), [("compiled_autograd", False), ("compiled_autograd_verbose", True)]
)
def test_torch_logs_compiled_autograd_shows_ca_logs(setting: str, shows_code: bool) -> None:
    program = (
        "import torch, ca_runtime\n"
        "x = torch.randn(3, requires_grad=True)\n"
        "with ca_runtime.enable('eager', capture_after=1):\n"
        "    (x * 2).sum().backward()\n"
        "    x.sin().sum().backward()\n"
    )
    env = {**os.environ, "TORCH_LOGS": setting}
    done = subprocess.run(
        [sys.executable, "-c", program], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ca_runtime.misses: cache miss at SinBackward0" in done.stderr, done.stderr[-2000:]
    assert ("ca_runtime: captured backward of" in done.stderr) == shows_code, done.stderr[-2000:]
