"""Living next to torch's built-in compiled autograd.

[Note: torch clears the engine slot]
AOTAutograd and Inductor compile under
``torch._dynamo.compiled_autograd._disable()``, which empties the engine's
compiled-autograd slot and, on exit, puts back *torch's* prior compiler --
nothing, when torch's compiled autograd is off. Any ``torch.compile`` run inside
``ca_runtime.enable()`` (our own capture, or the user's compiled forward) would
therefore silently switch our hook off for the rest of the context. We wrap
``_disable`` once per process: the slot stays empty inside it (AOTAutograd's
tracing must not reach us), and on exit our hook is re-armed if a ca_runtime
context is still active.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import ca_core
import torch

__all__ = ["keep_hook_across_torch_disable"]


def keep_hook_across_torch_disable() -> None:
    """Installs the ``_disable`` wrapper of [Note: torch clears the engine slot] (idempotent)."""
    module = torch._dynamo.compiled_autograd
    original: Callable[..., Any] = module._disable
    if getattr(original, "_ca_rearms", False):
        return

    @functools.wraps(original)
    @contextlib.contextmanager
    def _disable(*args: Any, **kwargs: Any) -> Iterator[None]:
        try:
            with original(*args, **kwargs):
                yield
        finally:
            ca_core.rearm_engine_hook()

    _disable._ca_rearms = True  # type: ignore[attr-defined]
    module._disable = _disable
