"""The compiled-autograd implementations a comparison can run: ours and torch's.

Each is a row of ``IMPLEMENTATIONS``: how to enable it around a step, reset
its caches and counters, and read its counters. ``"ca"`` is ``ca_runtime``;
``"torch"`` is torch's built-in ``torch._dynamo.compiled_autograd``, so every
comparison can be run for both side by side.

[Note: Differential runs capture at once]
Every ``ca`` implementation but ``ca-capture-after-2`` enables ours with
``capture_after=1``: a comparison's first backward is captured and its graph
runs, as torch's compiled autograd does, so a one-step comparison checks the
compiled path rather than the eager engine that ``enable()``'s default
(``capture_after=2``) runs a graph's first backward on. ``ca-capture-after-2``
is that default, said explicitly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["IMPLEMENTATIONS", "Implementation", "as_compiler", "get_implementation"]

CompilerFn = Callable[[torch.fx.GraphModule], Callable[..., Any]]


def as_compiler(compiler_fn: CompilerFn | str) -> CompilerFn:
    """A backend name as a compiler_fn (``torch.compile(gm, backend=name)``); a callable unchanged."""
    if isinstance(compiler_fn, str):
        backend = compiler_fn
        return lambda gm: torch.compile(gm, backend=backend)
    return compiler_fn


@dataclass(frozen=True)
class Implementation:
    """One compiled autograd: context, reset and counters."""

    name: str
    enable: Callable[[CompilerFn | str], contextlib.AbstractContextManager[Any]]
    reset: Callable[[], None]
    stats: Callable[[], dict[str, int]]


def _ca_enable(compiler_fn: CompilerFn | str, **options: Any) -> contextlib.AbstractContextManager[Any]:
    import ca_runtime

    return ca_runtime.enable(compiler_fn, **options)


def _ca_enable_with(**options: Any) -> Callable[[CompilerFn | str], contextlib.AbstractContextManager[Any]]:
    """``ca_runtime.enable(compiler_fn, **options)`` as an implementation's ``enable``."""
    return functools.partial(_ca_enable, **options)


def _ca_reset() -> None:
    import ca_runtime

    ca_runtime.reset()


def _ca_stats() -> dict[str, int]:
    import ca_runtime

    return ca_runtime.stats()


@contextlib.contextmanager
def _torch_enable(compiler_fn: CompilerFn | str) -> Iterator[None]:
    import ca_runtime

    # Ours must not be installed underneath torch's.
    with ca_runtime.disable(), torch._dynamo.compiled_autograd._enable(as_compiler(compiler_fn)):
        yield


def _torch_reset() -> None:
    torch._dynamo.compiled_autograd.reset()
    torch._dynamo.utils.counters["compiled_autograd"].clear()


def _torch_stats() -> dict[str, int]:
    counters = torch._dynamo.utils.counters["compiled_autograd"]
    return {"captures": int(counters["captures"])}


IMPLEMENTATIONS: dict[str, Implementation] = {
    # capture_after=1 in all but the last: see [Note: Differential runs capture at once].
    "ca": Implementation("ca", _ca_enable_with(capture_after=1), _ca_reset, _ca_stats),
    # Ours with Inductor compiling in the background (compiler_fn "inductor" only).
    "ca-background": Implementation(
        "ca-background", _ca_enable_with(compile_in_background=True, capture_after=1), _ca_reset, _ca_stats
    ),
    # Ours always running the compiled graph (enable(eager_if_faster=False), the default said explicitly).
    "ca-compiled": Implementation(
        "ca-compiled", _ca_enable_with(eager_if_faster=False, capture_after=1), _ca_reset, _ca_stats
    ),
    # Ours choosing the eager engine where it times faster (enable(eager_if_faster=True)).
    "ca-timed": Implementation(
        "ca-timed", _ca_enable_with(eager_if_faster=True, capture_after=1), _ca_reset, _ca_stats
    ),
    # Ours capturing a graph on its second backward (enable(capture_after=2), the default said explicitly).
    "ca-capture-after-2": Implementation(
        "ca-capture-after-2", _ca_enable_with(capture_after=2), _ca_reset, _ca_stats
    ),
    "torch": Implementation("torch", _torch_enable, _torch_reset, _torch_stats),
}


def get_implementation(name: str) -> Implementation:
    """The implementation called ``name``; ValueError naming the valid ones otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"impl must be a str, got {type(name).__name__}")
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"impl: unknown implementation {name!r}; valid: {sorted(IMPLEMENTATIONS)}") from None
