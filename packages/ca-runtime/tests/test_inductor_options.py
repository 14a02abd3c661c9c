"""Inductor options set for backward graphs; see [Note: Inductor options for backward graphs]."""

from __future__ import annotations

from typing import Any

import ca_runtime
import pytest
import torch
from ca_runtime._inductor_passes import UNFUSE_LATE_ADDMM
from ca_runtime._runtime import BACKWARD_INDUCTOR_OPTIONS
from ca_testkit import compare
from ca_testkit.memory import backward_tensor_peak_bytes
from ca_testkit.scenarios import make_mlp, mlp_step

aten = torch.ops.aten


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
    assert seen == [{**BACKWARD_INDUCTOR_OPTIONS, "reorder_for_locality": True}]


def _addmm_graph(late_input: bool, rows: int = 16) -> torch.fx.GraphModule:
    """addmm(c, a, b) with a, b graph inputs and c computed (late_input) or a graph input (a bias)."""
    graph = torch.fx.Graph()
    values = {"a": torch.randn(4, rows), "b": torch.randn(rows, 4), "c0": torch.randn(4, 4)}
    nodes = {name: graph.placeholder(name) for name in values}
    for name, node in nodes.items():
        node.meta["val"] = values[name]
    first = graph.call_function(aten.mul.Tensor, (nodes["c0"], 2.0))
    first.meta["val"] = values["c0"] * 2.0
    inp = graph.call_function(aten.sin.default, (first,)) if late_input else nodes["c0"]
    inp.meta["val"] = inp.meta.get("val", first.meta["val"].sin())
    out = graph.call_function(aten.addmm.default, (inp, nodes["a"], nodes["b"]))
    out.meta["val"] = torch.addmm(inp.meta["val"], values["a"], values["b"])
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_late_addmm_is_split_into_the_mm_first_and_the_add_where_it_was() -> None:
    """See [Note: An accumulated mm computed where its inputs are]."""
    gm = _addmm_graph(late_input=True)
    args = [torch.randn(4, 16), torch.randn(16, 4), torch.randn(4, 4)]
    expected = gm(*args)
    UNFUSE_LATE_ADDMM(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert _targets(gm) == [aten.mm.default, aten.mul.Tensor, aten.sin.default, aten.add.Tensor]
    torch.testing.assert_close(gm(*args), expected)


@pytest.mark.parametrize(("late_input", "rows"), [(False, 16), (True, 1)], ids=["bias", "small-matrices"])
def test_a_bias_addmm_or_one_of_small_matrices_is_kept(late_input: bool, rows: int) -> None:
    gm = _addmm_graph(late_input=late_input, rows=rows)
    before = _targets(gm)
    UNFUSE_LATE_ADDMM(gm.graph)
    assert _targets(gm) == before and aten.addmm.default in before


class _TiedHead(torch.nn.Module):
    """An embedding tied to the output head, as a GPT's: the weight's two grads are summed at the end."""

    def __init__(self, vocab: int = 256, d: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Linear(d, 8 * d)
        self.down = torch.nn.Linear(8 * d, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = x + self.down(torch.relu(self.up(x)))
        logits = h @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@pytest.mark.inductor
def test_a_tied_heads_backward_with_inductor_frees_the_logits_grad_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's addmm fusion held the logits' grad to the end; see the Notes of BACKWARD_INDUCTOR_OPTIONS.

    Eager's grads with the options; then the peak of live tensor bytes with
    and without them: with, at most eager's (+10 %) and at least the logits'
    grad (8 x 64 x 256 floats, 512 KiB) below the peak without.
    """
    torch.manual_seed(0)
    model = _TiedHead()
    tokens = torch.randint(0, 256, (8, 64))

    def forward() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return model(tokens)

    def step() -> torch.Tensor:
        loss = forward()
        loss.backward()
        return loss

    compiler = lambda gm: torch.compile(gm, backend="inductor")
    result = compare(step, compiler, tensors=model, steps=3, rtol=1e-4, atol=1e-5)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0

    def ours_peak() -> int:
        ca_runtime.reset()
        torch._dynamo.reset()
        with ca_runtime.enable(compiler, eager_if_faster=False):
            for _ in range(2):
                forward().backward()
            peak, _ = backward_tensor_peak_bytes(forward)
            stats = ca_runtime.stats()
        assert stats["captures"] == 1 and stats["cache_hits"] == 2 and stats["eager_fallbacks"] == 0, stats
        return peak

    with ca_runtime.disable():
        eager, _ = backward_tensor_peak_bytes(forward)
    with_options = ours_peak()
    monkeypatch.setattr(ca_runtime._runtime, "BACKWARD_INDUCTOR_OPTIONS", {"reorder_for_locality": False})
    without = ours_peak()
    logits_grad = 8 * 64 * 256 * 4
    assert with_options <= eager * 1.1 and with_options <= without - logits_grad, (
        with_options,
        without,
        eager,
    )


@pytest.mark.inductor
@pytest.mark.parametrize("user_set", [None, True], ids=["ours", "user-set-true"])
def test_a_hit_runs_no_size_asserts_of_its_inputs(
    monkeypatch: pytest.MonkeyPatch, user_set: bool | None
) -> None:
    """size_asserts off: Inductor's code does not re-check each input's sizes and strides on a hit.

    Dynamo's guards checked them before the call; see [Note: Inductor options
    for backward graphs]. A size_asserts the user set is kept.
    """
    calls: list[int] = []
    check = torch._C._dynamo.guards.assert_size_stride

    def counting_assert_size_stride(*args: Any) -> Any:
        calls.append(1)
        return check(*args)

    # Inductor's code binds the function when its module loads, after this.
    monkeypatch.setattr(torch._C._dynamo.guards, "assert_size_stride", counting_assert_size_stride)
    cell = torch.nn.RNNCell(4, 6)
    xs = torch.randn(3, 2, 4)
    per_backward: list[int] = []

    def step(i: int) -> torch.Tensor:
        cell.zero_grad(set_to_none=True)  # the same graph every step: accumulating into .grad is another
        h = torch.zeros(2, 6)
        for x in xs:
            h = cell(x, h)
        calls.clear()
        h.square().sum().backward()
        per_backward.append(len(calls))
        return h.detach()

    revert = torch._inductor.config._make_closure_patcher(
        fx_graph_cache=False, **({} if user_set is None else {"size_asserts": user_set})
    )()
    try:
        result = compare(step, "inductor", tensors=cell, steps=3)
    finally:
        revert()
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0
    hits = per_backward[4:]  # eager's three backwards, the capture, then the two hits
    inputs = 2 + 3 * 2  # at least: the two weights and two saved tensors per step
    assert hits == [0, 0] if user_set is None else all(n >= inputs for n in hits), per_backward
