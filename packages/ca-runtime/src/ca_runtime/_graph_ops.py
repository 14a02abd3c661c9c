"""The calls a captured backward graph is made of.

Each is a plain Python function so that an FX graph can call it and Dynamo can
compile that graph: ``apply_with_saved`` and ``validate_outputs`` are marked
``allow_in_graph`` (Dynamo keeps the call and runs it on FakeTensors to learn
its outputs; AOTAutograd traces through it down to ATen ops), while
``accumulate`` is ordinary Python that Dynamo inlines.
"""

from __future__ import annotations

from collections.abc import Sequence

import ca_core
import torch

__all__ = ["accumulate", "apply_with_saved", "validate_outputs"]


@torch._dynamo.allow_in_graph
def apply_with_saved(
    node_idx: int,
    inputs: Sequence[torch.Tensor | None],
    saved_tensors: Sequence[torch.Tensor],
    saved_sizes: Sequence[int | None] | None,
    saved_scalars: Sequence[int | float],
) -> list[torch.Tensor | None]:
    """Runs node ``node_idx`` of the running backward with the saved values given."""
    return ca_core.apply_with_saved(node_idx, inputs, saved_tensors, saved_sizes, saved_scalars)


@torch._dynamo.allow_in_graph
def validate_outputs(
    node_idx: int,
    outputs: Sequence[torch.Tensor | None],
    saved_sizes: Sequence[int | None] | None,
) -> list[torch.Tensor | None]:
    """Checks/casts node ``node_idx``'s output grads as the eager engine does."""
    return ca_core.validate_outputs(node_idx, outputs, saved_sizes)


def accumulate(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Sums two grads flowing into one input, as the engine's InputBuffer does."""
    if old is None:
        return new
    if new is None:
        return old
    return torch.add(old, new)
