"""Runs of nodes in one call: the graph compiler_fn receives.

The capture's graph calls ``apply_node`` once per traced node, which reads
well (``ca_runtime.last_graph()``, the report) and traces the same as any
other form. Where the graph runs as Python, though, each call costs about as
much as the eager engine spends on the whole node, so ``fuse_node_runs``
rewrites each run of consecutive ``apply_node`` calls that feed only one
another into one ``apply_nodes`` call whose plan ca_core keeps; see
[Note: Runs of nodes in one call] in ca_core.

A run is a maximal sequence of ``apply_node`` calls with nothing but
``getitem`` between them. Its nodes' grads and saved tensors that come from
outside the run become the call's tensor operands (each once); their sizes
and scalars lists its other operands; the grads of its nodes that anything
after the run reads, its results.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, cast

import ca_core
import torch.fx

from ca_runtime import _graph_ops as ops

__all__ = ["fuse_node_runs"]

#: Fewer nodes than this stay separate calls: one call saves nothing.
_MIN_RUN = 2


def _is_apply_node(node: torch.fx.Node) -> bool:
    """An ``apply_node`` call whose result only ``getitem`` with constant indices reads."""
    return (
        node.op == "call_function"
        and node.target is ops.apply_node
        and all(
            user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
            for user in node.users
        )
    )


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _item(getitem: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """``(seq, i)`` of a ``seq[i]`` node."""
    return cast(torch.fx.Node, getitem.args[0]), cast(int, getitem.args[1])


def _runs(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    runs: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    for node in graph.nodes:
        if _is_apply_node(node):
            current.append(node)
        elif not _is_getitem(node):
            if len(current) >= _MIN_RUN:
                runs.append(current)
            current = []
    if len(current) >= _MIN_RUN:
        runs.append(current)
    return runs


class _Plan:
    """Builds one run's plan (ca_core.plan_node_run's arguments) and operands."""

    def __init__(self, run: list[torch.fx.Node]) -> None:
        self.members = set(run)
        #: (member, output index) -> register.
        self.registers: dict[tuple[torch.fx.Node, int], int] = {}
        self.tensors: list[torch.fx.Node] = []
        self._tensor_index: dict[torch.fx.Node, int] = {}
        self.others: list[Any] = []
        self.steps: list[ca_core.NodeRunStep] = []
        for member in run:
            self._add(member)

    def _ref(self, value: Any) -> int:
        if value is None:
            return -1
        if not isinstance(value, torch.fx.Node):
            raise TypeError(f"apply_node operand {value!r} is not a graph value")
        if _is_getitem(value) and value.args[0] in self.members:
            return -self.registers[_item(value)] - 2
        if value not in self._tensor_index:
            self._tensor_index[value] = len(self.tensors)
            self.tensors.append(value)
        return self._tensor_index[value]

    def _other(self, value: Any) -> int:
        if value is None or (isinstance(value, (list, tuple)) and not value):
            return -1
        self.others.append(value)
        return len(self.others) - 1

    def _add(self, member: torch.fx.Node) -> None:
        node_idx, inputs, saved, apply_sizes, scalars, validate_sizes = member.args
        grads = [self._ref(v) for v in cast(list[Any], inputs)]
        saved_refs = [self._ref(v) for v in cast(list[Any], saved)]
        num_outputs = 1 + max((_item(user)[1] for user in member.users), default=-1)
        first = len(self.registers)
        for j in range(num_outputs):
            self.registers[(member, j)] = first + j
        self.steps.append(
            ca_core.NodeRunStep(
                node_idx=cast(int, node_idx),
                grads=grads,
                saved_tensors=saved_refs,
                apply_sizes=self._other(apply_sizes),
                saved_scalars=self._other(scalars),
                validate_sizes=self._other(validate_sizes),
                num_outputs=num_outputs,
            )
        )


def _fuse(graph: torch.fx.Graph, run: list[torch.fx.Node]) -> int:
    """Replaces ``run`` by one apply_nodes call; returns the id of the plan it registered."""
    plan = _Plan(run)
    members = plan.members
    # Getitems of the run's grads that something after the run reads.
    exported = [user for member in run for user in member.users if any(r not in members for r in user.users)]
    plan_id = ca_core.plan_node_run(plan.steps, [-plan.registers[_item(g)] - 2 for g in exported])
    with graph.inserting_after(run[-1]):
        call = graph.call_function(ops.apply_nodes, (plan_id, list(plan.tensors), list(plan.others)))
    call.meta["autograd_nodes"] = [m.meta.get("autograd_node") for m in run]
    last = call
    for i, getitem in enumerate(exported):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, i))
        getitem.replace_all_uses_with(last, delete_user_cb=lambda user: user not in members)
    for member in reversed(run):
        for user in list(member.users):
            graph.erase_node(user)
        graph.erase_node(member)
    return plan_id


def fuse_node_runs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with each run of ``apply_node`` calls made one ``apply_nodes`` call."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    runs = _runs(graph)
    if not runs:
        return gm
    plan_ids: list[int] = []
    try:
        for run in runs:
            plan_ids.append(_fuse(graph, run))
        graph.lint()
        fused = torch.fx.GraphModule(gm, graph, gm.__class__.__name__)
    except BaseException:
        ca_core.release_node_run_plans(plan_ids)
        raise
    fused.meta.update(gm.meta)
    # The plans live as long as the graph that calls them; see [Note: Runs of nodes in one call] in ca_core.
    weakref.finalize(fused, ca_core.release_node_run_plans, plan_ids).atexit = False
    return fused
