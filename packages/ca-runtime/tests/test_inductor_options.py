"""Inductor options set for backward graphs; see [Note: Inductor options for backward graphs]."""

from __future__ import annotations

from typing import Any

import torch
from ca_runtime._runtime import BACKWARD_INDUCTOR_OPTIONS
from ca_testkit import compare
from ca_testkit.scenarios import make_mlp, mlp_step


def _recording_compiler(seen: list[dict[str, Any]]) -> Any:
    """torch.compile with a backend that records Inductor's config as the graph compiles."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append({name: getattr(torch._inductor.config, name) for name in BACKWARD_INDUCTOR_OPTIONS})
        return gm.forward

    return lambda gm: torch.compile(gm, backend=backend)


def test_a_backward_graph_compiles_with_the_options() -> None:
    model = make_mlp()
    seen: list[dict[str, Any]] = []
    result = compare(mlp_step(model), _recording_compiler(seen), tensors=model, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0
    assert seen == [BACKWARD_INDUCTOR_OPTIONS]
    # Only while the graph compiled, and unset again after it: the next
    # capture gets them too.
    assert torch._inductor.config.reorder_for_locality is True
    assert torch._inductor.config._is_default("reorder_for_locality")
    other = make_mlp(sizes=(8, 12, 4))
    compare(mlp_step(other), _recording_compiler(seen), tensors=other, steps=1).assert_ok()
    assert seen == [BACKWARD_INDUCTOR_OPTIONS, BACKWARD_INDUCTOR_OPTIONS]


def test_an_option_the_user_set_is_kept() -> None:
    model = make_mlp()
    seen: list[dict[str, Any]] = []
    # As `torch._inductor.config.reorder_for_locality = True` would, but
    # revertibly (config.patch leaves it set when it exits).
    revert = torch._inductor.config._make_closure_patcher(reorder_for_locality=True)()
    try:
        result = compare(mlp_step(model), _recording_compiler(seen), tensors=model, steps=2)
    finally:
        revert()
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 1
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0
    assert seen == [{"reorder_for_locality": True}]
