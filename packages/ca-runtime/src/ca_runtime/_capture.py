"""Capture: turns a walked backward (``ca_core.BackwardGraph``) into an FX graph.

The graph is the eager engine's loop written out for this one graph: for every
node in eager's order, take its input buffer, call ``apply_with_saved`` with
the node's own slice of the lifted tensors and scalars, ``validate_outputs``,
and add each output grad into the buffer of the node its edge leads to
(``accumulate`` when two grads meet). Inputs of AccumulateGrad nodes and the
buffers ``torch.autograd.grad`` asked for become the graph's outputs::

    def forward(inputs, sizes, scalars) -> [*grad_outputs, *leaf_grads]
"""

from __future__ import annotations

import operator
from typing import Any

import ca_core
import torch
import torch.fx

from ca_runtime._graph_ops import accumulate, apply_with_saved, validate_outputs
from ca_runtime._node_rules import Handling, rule_for, unsupported_hooks

__all__ = ["UnsupportedNode", "build_graph_module"]


class UnsupportedNode(Exception):
    """A node the capture cannot put in a graph; the backward runs eagerly."""

    def __init__(self, node: ca_core.NodeInfo, reason: str) -> None:
        super().__init__(f"{node.name} (node {node.index}): {reason}")
        self.node_name = node.name
        self.node_index = node.index
        self.reason = reason


def build_graph_module(graph: ca_core.BackwardGraph) -> torch.fx.GraphModule:
    """The FX graph of one backward; raises UnsupportedNode for a node it cannot take."""
    fx = torch.fx.Graph()
    inputs = fx.placeholder("inputs")
    fx.placeholder("sizes")
    scalars = fx.placeholder("scalars")

    def getitem(seq: torch.fx.Node, i: int) -> torch.fx.Node:
        return fx.call_function(operator.getitem, (seq, i))

    lifted = [getitem(inputs, i) for i in range(graph.num_tensors)]
    lifted_scalars = [getitem(scalars, i) for i in range(graph.num_scalars)]
    nodes = graph.nodes
    buffers: dict[int, list[Any]] = {}
    grad_outputs: list[Any] = [None] * graph.num_outputs
    leaf_grads: list[Any] = []

    for node in nodes:
        hook_reason = unsupported_hooks(node)
        if hook_reason is not None:
            raise UnsupportedNode(node, hook_reason)
        buffer = buffers.pop(node.index, None) or [None] * node.num_inputs
        for input_nr, output_idx in node.graph_output:
            grad_outputs[output_idx] = buffer[input_nr]
        if not node.needed:
            continue
        rule = rule_for(node)
        if rule.handling is Handling.ACCUMULATE:
            leaf_grads.append(buffer[0])
            continue
        if rule.handling is Handling.UNSUPPORTED:
            raise UnsupportedNode(node, rule.reason)

        saved = [lifted[slot] for slot in node.tensor_slots]
        saved_scalars = lifted_scalars[node.scalar_offset : node.scalar_offset + node.num_scalars]
        outputs = fx.call_function(
            apply_with_saved, (node.index, list(buffer), saved, None, saved_scalars)
        )
        outputs = fx.call_function(validate_outputs, (node.index, outputs, None))
        for output_nr, edge in enumerate(node.next_edges):
            if edge is None:
                continue
            target, input_nr = edge
            grad = getitem(outputs, output_nr)
            target_buffer = buffers.setdefault(target, [None] * nodes[target].num_inputs)
            prior = target_buffer[input_nr]
            target_buffer[input_nr] = (
                grad if prior is None else fx.call_function(accumulate, (prior, grad))
            )

    fx.output(grad_outputs + leaf_grads)
    fx.eliminate_dead_code()
    return torch.fx.GraphModule(torch.nn.Module(), fx, "CompiledBackward")
