"""The object ca_core's engine hook calls back into.

[Note: Capture methods]
ca_core calls exactly three methods, all on a cache miss or a failure, never
on a cache hit:

- ``capture(graph)``: build the FX graph of a walked backward and compile it
  with ``compiler_fn``; return the compiled callable, or None to run this
  backward (and every later one with the same key path) eagerly.
- ``run_first(compiled, inputs, sizes, scalars)``: the first call of a freshly
  compiled graph, where lazy compilers (``torch.compile``) do their work;
  return its outputs, or None if it failed, with the same effect as above.
- ``report_fallback(node, reason)``: ca_core could not even walk the graph.

Each failure warns once (``EagerFallbackWarning``) naming the node and the
reason; ca_core counts it and remembers the failing key path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ca_core
import torch

from ca_runtime._capture import UnsupportedNode, build_graph_module
from ca_runtime._log import EagerFallbackWarning, log

__all__ = ["Runtime"]

CompilerFn = Callable[[torch.fx.GraphModule], Callable[..., Any]]


class Runtime:
    """Serves one ``enable()`` context: its compiler and its last captured graph."""

    def __init__(self, compiler_fn: CompilerFn, description: str) -> None:
        self.compiler_fn = compiler_fn
        self.description = description
        self.last_graph: torch.fx.GraphModule | None = None

    def capture(self, graph: ca_core.BackwardGraph) -> Callable[..., Any] | None:
        try:
            gm = build_graph_module(graph)
        except UnsupportedNode as e:
            self._fallback(e.node_name, e.reason)
            return None
        except Exception as e:  # a capture bug must not kill the training step
            self._fallback("capture", f"{type(e).__name__}: {e}")
            return None
        self.last_graph = gm
        log.debug("captured backward of %d nodes:\n%s", len(graph.nodes), gm.code)
        try:
            compiled = self.compiler_fn(gm)
        except Exception as e:
            self._fallback("compiler_fn", f"{type(e).__name__}: {e}")
            return None
        if not callable(compiled):
            self._fallback("compiler_fn", f"returned {type(compiled).__name__}, not a callable")
            return None
        return compiled

    def run_first(
        self,
        compiled: Callable[..., Any],
        inputs: list[torch.Tensor],
        sizes: list[int],
        scalars: list[int | float],
    ) -> Sequence[torch.Tensor | None] | None:
        try:
            return compiled(inputs, sizes, scalars)
        except Exception as e:
            self._fallback("compiled graph", f"first run failed: {type(e).__name__}: {e}")
            return None

    def report_fallback(self, node: str, reason: str) -> None:
        self._fallback(node, reason)

    @staticmethod
    def _fallback(node: str, reason: str) -> None:
        first_line = reason.strip().splitlines()[0] if reason.strip() else reason
        message = (
            f"ca_runtime: {node} cannot be compiled ({first_line}); "
            "this backward runs on the eager engine"
        )
        log.info(message)
        warnings.warn(message, EagerFallbackWarning, stacklevel=2)
