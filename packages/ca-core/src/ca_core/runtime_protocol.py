"""What ca_core's engine hook calls on the runtime object it is installed with.

The C++ side calls these attributes by name (``engine_hook.cpp``), so this
Protocol is the typed form of that seam: ``install_engine_hook`` takes a
``EngineRuntime`` and mypy checks ``ca_runtime.Runtime`` against it. The
contract of each method is ca_runtime's [Note: Capture methods].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ca_core._C import BackwardGraph, CapturedGraph

__all__ = ["EngineRuntime"]


class EngineRuntime(Protocol):
    #: Why the last capture or first run failed (stored on the failed cache entry).
    last_failure: str

    def capture(self, graph: BackwardGraph) -> CapturedGraph | None:
        """Build and compile the graph of a walked backward, or None to run it eagerly.

        Returns a ``CapturedGraph`` (compiled, leaf_outputs, leaf_hooks_only, free_early,
        eager_if_faster_allowed); see ca_runtime's [Note: Capture methods].
        """
        ...

    def run_first(
        self,
        compiled: Callable[..., Any],
        inputs: list[torch.Tensor],
        sizes: list[torch.Tensor],
        scalars: list[int | float],
        hooks: list[Any],
        dynamic_dims: Sequence[tuple[int, int]] = (),
    ) -> Sequence[torch.Tensor | None] | None:
        """First call of a fresh graph; None (with ``last_failure`` set) if it failed."""
        ...

    # Optional: ``take_compiling() -> Callable[[], bool] | None``, called after a
    # first run that succeeded; see [Note: Eager while compiling] in engine_hook.cpp.
    # Optional: ``eager_if_faster: bool`` (read at install) and
    # ``report_eager_if_faster(entry_id, eager, compiled_s, eager_s, compiled_over_eager) -> None``; see
    # [Note: Eager if faster] in eager_if_faster.h.
    # Optional: ``defer_capture(sightings: int, hooks: list[Any], sizes_changed: bool) -> bool | str``,
    # asked before a capture with the Python objects the graph would call and whether its
    # sizes differ from the last deferred sighting's; True runs this backward eagerly
    # instead; a string (why, already reported as a fallback) marks the entry failed, so
    # that it and every later backward there run eagerly; see [Note: Deferred captures]
    # in engine_hook.cpp.
    # Optional: ``report_hooks_changed(node: str, graph_ran: bool) -> None``, called
    # after a backward during which a hook changed the hooks of ``node``: a graph run
    # (``graph_ran``) or a deferred backward on the eager engine; see [Note: Hooks
    # changed while a graph runs] in engine_hook.cpp.

    def report_fallback(self, node: str, reason: str) -> None:
        """Warn that this backward runs eagerly because ``node`` failed for ``reason``."""
        ...
