"""Capture: turns a walked backward (``ca_core.BackwardGraph``) into an FX graph.

The graph is the eager engine's loop written out for this one graph. For every
node in eager's order, as the engine's ``call_function`` does:

1. tensor pre-hooks on its input grads (Python hooks inlined, C++ hooks and
   ``retain_grad`` behind a graph break), in registration order;
2. grad_fn pre-hooks;
3. the node: ``apply_node`` (``apply_with_saved`` and ``validate_outputs`` in
   one call) with its own slice of the lifted tensors and scalars, a Python
   Function's backward called directly, or ``apply_with_saved`` behind a graph
   break (see [Note: Graph call kinds]);
4. ``validate_outputs`` (unless ``apply_node`` did), then grad_fn post-hooks;
5. each output grad added into the buffer of the node its edge leads to.

Inputs of AccumulateGrad nodes and the buffers ``torch.autograd.grad`` asked
for become the graph's outputs::

    def forward(inputs, sizes, scalars, hooks) -> [*grad_outputs, *leaf_grads]

``hooks`` holds every Python object the walk collected (hook functions,
Function ctx objects) in walk order; NodeInfo gives each one's index.

[Note: Leaf accumulation order]
A leaf is accumulated where eager accumulates it whenever that can be
observed: if it has post-accumulate-grad hooks, or if user code (a hook, a
Function's backward, FSDP2's post-backward) runs after it in the walk and may
read its ``.grad``, the graph accumulates it itself at its eager position
(``accumulate_leaf``, traced; see [Note: Leaves accumulated in the graph] in
ca_core). Every other leaf's grad is a graph output that ca_core applies
through the real AccumulateGrad node after the graph (eager's stealing and
layout rules, no copy), where nothing can tell the difference. A leaf whose
AccumulateGrad carries grad_fn pre-hooks or C++ post hooks (DDP's Reducer)
keeps its real node: after the graph, or behind a graph break
(``accumulate_grad_now``) at its eager position when a later hook must see it
first (for a reader of leaf grads, ``NodeRule.reads_leaf_grads``, too).
"""

from __future__ import annotations

import operator
import re
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ca_core
import torch
import torch.fx
import torch.utils.checkpoint

from ca_runtime import _graph_ops as ops
from ca_runtime._aot import NotCopyable, copy_aot_backward
from ca_runtime._node_rules import HOOK_RULES, Handling, dynamo_skips, rule_for

__all__ = ["Capture", "GraphBreak", "UnsupportedNode", "build_graph_module"]


class UnsupportedNode(Exception):
    """A node the capture cannot put in a graph; the backward runs eagerly."""

    def __init__(self, node: ca_core.NodeInfo, reason: str) -> None:
        super().__init__(f"{node.name} (node {node.index}): {reason}")
        self.node_name = node.name
        self.node_index = node.index
        self.reason = reason


@dataclass(frozen=True)
class GraphBreak:
    """One call of the graph that runs eagerly behind a graph break."""

    node_name: str
    node_index: int
    reason: str


@dataclass
class Capture:
    """What ``build_graph_module`` made of one backward."""

    graph_module: torch.fx.GraphModule
    #: Walk index of each AccumulateGrad node whose grad the graph returns.
    leaf_outputs: list[int]
    #: Per leaf output: the graph accumulated that leaf itself and only its
    #: grad_fn post hooks run after the graph (see [Note: Leaves accumulated
    #: in the graph] in ca_core).
    leaf_hooks_only: list[bool] = field(default_factory=list)
    graph_breaks: list[GraphBreak] = field(default_factory=list)


#: Calls that run user code or mutate state: kept even when their result is unused.
_EFFECTFUL = frozenset(
    {
        ops.accumulate_grad_now,
        ops.accumulate_leaf,
        ops.apply_with_saved_eager,
        ops.call_cpp_tensor_pre_hook,
        ops.call_function_backward,
        ops.call_opaque_tensor_pre_hook,
        ops.call_post_hook,
        ops.call_pre_hook,
        ops.call_tensor_hook,
        ops.call_unpack_hook,
        ops.call_unpack_hooks_eager,
    }
)


def _is_impure(node: torch.fx.Node) -> bool:
    return node.is_impure() or (node.op == "call_function" and node.target in _EFFECTFUL)


def _has_effects(node: ca_core.NodeInfo) -> bool:
    """Whether the graph calls user code for ``node`` (hooks, unpack hooks, a Function, a break).

    A torch.compile'd region's copied backward (AOT) calls none.
    """
    if node.tensor_pre_hooks or node.pre_hooks or node.post_hooks:
        return True
    if not node.needed:
        return False
    if node.is_accumulate_grad:
        # Its post-accumulate-grad hooks are called from the graph; see
        # [Note: Leaves accumulated in the graph] in ca_core.
        return bool(node.post_acc_grad_hooks)
    return bool(node.unpack_hooks) or rule_for(node).handling not in (Handling.TRACE, Handling.AOT)


def _runs_leaf_hooks(node: ca_core.NodeInfo) -> bool:
    """Whether accumulating leaf ``node`` calls user code (see [Note: Leaf node hooks] in ca_core)."""
    return any(node.hooks.get(kind) for kind in ("pre", "post", "post_acc_grad"))


def _accumulates_in_graph(
    node: ca_core.NodeInfo, graph: ca_core.BackwardGraph, user_code_follows: bool
) -> bool:
    """A leaf the graph accumulates itself; see [Note: Leaves accumulated in the graph] in ca_core.

    When it has post-accumulate-grad hooks, or when user code runs after it
    (``user_code_follows``) and could read its ``.grad``.
    """
    return bool(
        graph.accumulate_grad
        and not graph.create_graph
        and node.tensor_slots
        and (node.post_acc_grad_hooks or user_code_follows)
        and not node.hooks.get("pre")
    )


class _LazyItems:
    """``seq[i]`` of a placeholder, emitted at its first use so the code reads in walk order."""

    def __init__(self, fx: torch.fx.Graph, seq: torch.fx.Node, length: int) -> None:
        self._fx, self._seq, self._length = fx, seq, length
        self._nodes: dict[int, torch.fx.Node] = {}

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if not 0 <= index < self._length:
            raise IndexError(index)
        if index not in self._nodes:
            self._nodes[index] = self._fx.call_function(operator.getitem, (self._seq, index))
        return self._nodes[index]


def _fx_name(autograd_name: str) -> str:
    """``AddmmBackward0`` -> ``addmm_backward0``: the FX value named after the node it runs."""
    short = autograd_name.rsplit("::", 1)[-1]
    return re.sub(r"(?<!^)(?=[A-Z][a-z])|(?<=[a-z0-9])(?=[A-Z])", "_", short).lower()


def _call_for(
    fx: torch.fx.Graph, node: ca_core.NodeInfo, target: Any, args: tuple[Any, ...]
) -> torch.fx.Node:
    """A call that runs autograd node ``node``, named after it and tagged in ``meta``."""
    call = fx.create_node("call_function", target, args, name=_fx_name(node.name))
    call.meta["autograd_node"] = node.name
    call.meta["walk_index"] = node.index
    return call


def build_graph_module(graph: ca_core.BackwardGraph) -> Capture:
    """The FX graph of one backward; raises UnsupportedNode for a node it cannot take."""
    fx = torch.fx.Graph()
    inputs = fx.placeholder("inputs")
    sizes = fx.placeholder("sizes")
    scalars = fx.placeholder("scalars")
    hooks = fx.placeholder("hooks")

    def getitem(seq: torch.fx.Node, i: int) -> torch.fx.Node:
        return fx.call_function(operator.getitem, (seq, i))

    def unpack(result: torch.fx.Node, n: int) -> list[Any]:
        return [getitem(result, i) for i in range(n)]

    lifted = _LazyItems(fx, inputs, graph.num_tensors)
    lifted_scalars = _LazyItems(fx, scalars, graph.num_scalars)
    hook_nodes: dict[int, torch.fx.Node] = {}
    dynamic_positions = {k: j for j, k in enumerate(k for k, dyn in enumerate(graph.dynamic_sizes) if dyn)}
    size_nodes: dict[int, torch.fx.Node] = {}

    def size_at(k: int) -> torch.fx.Node | None:
        """Graph value of size input ``k`` if it is dynamic, else None (static)."""
        if k not in dynamic_positions:
            return None
        if k not in size_nodes:
            size_nodes[k] = fx.call_function(ops.unwrap_size, (getitem(sizes, dynamic_positions[k]),))
        return size_nodes[k]

    def sizes_for(first: int, count: int) -> list[Any] | None:
        values = [size_at(first + i) for i in range(count)]
        return None if all(v is None for v in values) else values

    def hook_at(i: int) -> torch.fx.Node:
        if i not in hook_nodes:
            hook_nodes[i] = getitem(hooks, i)
        return hook_nodes[i]

    nodes = graph.nodes
    # See [Note: Leaf accumulation order].
    last_effect = max((n.index for n in nodes if _has_effects(n)), default=-1)
    last_reader = max(
        (n.index for n in nodes if n.needed and not n.is_accumulate_grad and rule_for(n).reads_leaf_grads),
        default=-1,
    )
    buffers: dict[int, list[Any]] = {}
    grad_outputs: list[Any] = [None] * graph.num_outputs
    leaf_grads: list[Any] = []
    # Holds the attributes copied AOT backward graphs read (see [Note: AOT backwards]).
    root = torch.nn.Module()
    capture = Capture(torch.fx.GraphModule(root, torch.fx.Graph()), [])

    def graph_break(node: ca_core.NodeInfo, reason: str) -> None:
        capture.graph_breaks.append(GraphBreak(node.name, node.index, reason))

    def record_outputs(node: ca_core.NodeInfo, buffer: list[Any]) -> None:
        for input_nr, output_idx in node.graph_output:
            grad_outputs[output_idx] = buffer[input_nr]

    handlings = {
        n.index: _handling_of(n, graph.create_graph) for n in nodes if n.needed and not n.is_accumulate_grad
    }
    unpacker = _Unpacker(fx, hook_at, graph_break, nodes, handlings)

    for node in nodes:
        buffer = buffers.pop(node.index, None) or [None] * node.num_inputs
        # Eager captures torch.autograd.grad outputs before the tensor
        # pre-hooks of a node that runs, after them for one that does not.
        if node.needed:
            record_outputs(node, buffer)
        for hook in node.tensor_pre_hooks:
            hook_rule = HOOK_RULES[hook.kind]
            grad = buffer[hook.input_nr]
            if hook_rule.handling is Handling.TRACE:
                buffer[hook.input_nr] = fx.call_function(ops.call_tensor_hook, (hook_at(hook.hook), grad))
            elif hook.kind == "opaque":
                graph_break(node, hook_rule.reason)
                buffer = unpack(
                    fx.call_function(ops.call_opaque_tensor_pre_hook, (node.index, hook.hook, list(buffer))),
                    node.num_inputs,
                )
            else:
                graph_break(node, hook_rule.reason)
                buffer[hook.input_nr] = fx.call_function(
                    ops.call_cpp_tensor_pre_hook, (node.index, hook.hook, grad)
                )
        if not node.needed:
            record_outputs(node, buffer)
            continue
        rule = rule_for(node)
        if rule.handling is Handling.ACCUMULATE:
            user_code_follows = node.index < max(last_effect, last_reader)
            if _accumulates_in_graph(node, graph, user_code_follows):
                fx.call_function(
                    ops.accumulate_leaf,
                    (
                        lifted[node.tensor_slots[0]],
                        buffer[0],
                        [hook_at(h) for h in node.post_acc_grad_hooks],
                    ),
                )
                if node.hooks.get("post"):
                    capture.leaf_outputs.append(node.index)
                    capture.leaf_hooks_only.append(True)
                    leaf_grads.append(buffer[0])
            elif node.index < last_reader:
                graph_break(node, f"{nodes[last_reader].name} reads this leaf's .grad later")
                fx.call_function(ops.accumulate_grad_now, (node.index, buffer[0]))
            elif _runs_leaf_hooks(node) and node.index < last_effect:
                graph_break(node, "a leaf's hooks must run before later hooks")
                fx.call_function(ops.accumulate_grad_now, (node.index, buffer[0]))
            else:
                capture.leaf_outputs.append(node.index)
                capture.leaf_hooks_only.append(False)
                leaf_grads.append(buffer[0])
            continue
        if rule.handling is Handling.UNSUPPORTED:
            raise UnsupportedNode(node, rule.reason)

        for pre_hook in node.pre_hooks:
            buffer = unpack(
                fx.call_function(ops.call_pre_hook, (hook_at(pre_hook), list(buffer))),
                node.num_inputs,
            )
        handling, reason = handlings[node.index]
        outputs: Any
        if handling is Handling.AOT:
            try:
                outputs = _copy_aot_backward(
                    fx, root, node, buffer, lifted, hook_at, size_at, graph.create_graph
                )
            except NotCopyable as e:
                handling = Handling.BREAK
                reason = f"the backward of a torch.compile'd region runs eagerly: {e}"
        if handling is Handling.FUNCTION:
            outputs = _call_function(fx, node, buffer, lifted, hook_at, size_at)
        elif handling is not Handling.AOT:
            saved = [lifted[slot] for slot in node.tensor_slots]
            if handling is Handling.TRACE:
                saved += unpacker.unpacked(node)
            saved_scalars = lifted_scalars[node.scalar_offset : node.scalar_offset + node.num_scalars]
            if handling is Handling.BREAK:
                graph_break(node, reason or "it cannot be traced")
            apply_sizes = sizes_for(node.size_offset, node.num_apply_sizes)
        validate_sizes = sizes_for(node.size_offset + node.num_apply_sizes, node.num_validate_sizes)
        if handling is Handling.TRACE:
            # One call for the node and its output check; see [Note: One call per node] in ca_core.
            outputs = _call_for(
                fx,
                node,
                ops.apply_node,
                (node.index, list(buffer), saved, apply_sizes, saved_scalars, validate_sizes),
            )
        else:
            if handling is Handling.BREAK:
                outputs = _call_for(
                    fx,
                    node,
                    ops.apply_with_saved_eager,
                    (node.index, list(buffer), saved, apply_sizes, saved_scalars),
                )
            outputs = fx.call_function(ops.validate_outputs, (node.index, outputs, validate_sizes))
        grads = unpack(outputs, node.num_outputs)
        for post_hook in node.post_hooks:
            grads = unpack(
                fx.call_function(ops.call_post_hook, (hook_at(post_hook), grads, list(buffer))),
                node.num_outputs,
            )
        for output_nr, edge in enumerate(node.next_edges):
            if edge is None:
                continue
            target, input_nr = edge
            target_buffer = buffers.setdefault(target, [None] * nodes[target].num_inputs)
            prior = target_buffer[input_nr]
            grad = grads[output_nr]
            target_buffer[input_nr] = (
                grad if prior is None else fx.call_function(ops.accumulate, (prior, grad))
            )

    fx.output(grad_outputs + leaf_grads)
    fx.eliminate_dead_code(is_impure_node=_is_impure)
    capture.graph_module = torch.fx.GraphModule(root, fx, "CompiledBackward")
    return capture


def _handling_of(node: ca_core.NodeInfo, create_graph: bool) -> tuple[Handling, str]:
    """How the capture takes a node that runs: its rule, with the probes and exceptions applied."""
    rule = rule_for(node)
    handling, reason = rule.handling, rule.reason
    if handling is Handling.PROBE:
        handling = Handling.TRACE if ca_core.probe_traceable(node.index) else Handling.BREAK
    if handling in (Handling.FUNCTION, Handling.AOT) and node.function is None:
        handling = Handling.BREAK
        if node.num_saved_tensor_hooks:
            reason = "a Python Function whose saved tensors have unpack hooks runs eagerly"
    if handling is Handling.TRACE and node.unpack_hooks and create_graph:
        # A swapped-in unpacked tensor would lose the grad_fn eager's unpack gives it.
        handling = Handling.BREAK
        reason = "create_graph=True: its saved tensors' unpack hooks run with the node, eagerly"
    return handling, reason


class _Unpacker:
    """Emits the unpack hooks of traced nodes' saved tensors; see [Note: Unpack hooks in the graph] in ca_core.

    A hook Dynamo inlines is called where eager calls it, just before its
    node. Hooks Dynamo would skip are called behind a graph break of ours,
    grouped: all unpacks of one non-reentrant checkpoint region in one call
    at its first unpack (that unpack recomputes the whole region and the
    others only hand out what it saved), any other node's in one call per node.
    """

    def __init__(
        self,
        fx: torch.fx.Graph,
        hook_at: Any,
        graph_break: Any,
        nodes: Sequence[ca_core.NodeInfo],
        handlings: dict[int, tuple[Handling, str]],
    ) -> None:
        self._fx = fx
        self._hook_at = hook_at
        self._graph_break = graph_break
        #: Per skipped hook (hook index, packed index): its group key.
        self._group_of: dict[tuple[int, int], tuple[Any, ...]] = {}
        #: Per group: its members in eager's unpack order.
        self._members: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
        #: Per group already called: the graph value of its unpacked list.
        self._called: dict[tuple[Any, ...], torch.fx.Node] = {}
        for node in nodes:
            if handlings.get(node.index, (None,))[0] is not Handling.TRACE:
                continue
            for pair, hook in zip(node.unpack_hooks, node.unpack_hook_fns):
                if dynamo_skips(hook):
                    frame = checkpoint_frame(hook)
                    group = ("node", node.index) if frame is None else ("checkpoint", id(frame))
                    self._group_of[pair] = group
                    self._members.setdefault(group, []).append(pair)

    def unpacked(self, node: ca_core.NodeInfo) -> list[Any]:
        """Graph values of ``node``'s unpacked saved tensors, in packed-input order."""
        values: list[Any] = []
        for pair in node.unpack_hooks:
            group = self._group_of.get(pair)
            if group is None:
                hook, packed = (self._hook_at(i) for i in pair)
                values.append(self._fx.call_function(ops.call_unpack_hook, (hook, packed)))
                continue
            members = self._members[group]
            if group not in self._called:
                what = "a checkpoint region's" if group[0] == "checkpoint" else "its"
                self._graph_break(node, f"{what} saved tensors' unpack hooks are skipped by Dynamo")
                self._called[group] = self._fx.call_function(
                    ops.call_unpack_hooks_eager,
                    ([self._hook_at(h) for h, _ in members], [self._hook_at(d) for _, d in members]),
                )
            values.append(
                self._fx.call_function(operator.getitem, (self._called[group], members.index(pair)))
            )
        return values


def checkpoint_frame(hook: object) -> object | None:
    """The region (``_CheckpointFrame``) of non-reentrant checkpoint's unpack hook, else None."""
    code = getattr(hook, "__code__", None)
    if code not in _CHECKPOINT_UNPACK_CODES:
        return None
    cells = dict(zip(code.co_freevars, hook.__closure__ or ()))  # type: ignore[attr-defined]
    frame = cells.get("frame")
    return None if frame is None else frame.cell_contents


#: Code of torch.utils.checkpoint's unpack hooks (plain and with a debug callback).
_CHECKPOINT_UNPACK_CODES = frozenset(
    c
    for c in torch.utils.checkpoint._checkpoint_hook.__init__.__code__.co_consts
    if isinstance(c, types.CodeType) and c.co_name.startswith("unpack_hook")
)


def _call_function(
    fx: torch.fx.Graph,
    node: ca_core.NodeInfo,
    buffer: list[Any],
    lifted: _LazyItems,
    hook_at: Any,
    size_at: Any,
) -> torch.fx.Node:
    """The graph calls a Python Function's backward itself.

    [Note: Python Functions in the graph]
    A PyNode's own apply_with_saved would run the backward inside an opaque
    call that Dynamo executes once on FakeTensors: side effects would happen
    at compile time only and ``ctx`` attributes would be baked in without a
    guard. Calling the backward from the graph lets Dynamo trace it (or graph
    break inside it), replay its side effects and guard on the ctx values it
    read, so a changed ``ctx.scale`` recompiles instead of reusing a stale
    constant. Undefined grads are materialised as eager does.
    """
    function = node.function
    assert function is not None
    grads = _materialized_grads(fx, node, buffer, size_at)
    saved = [None if slot is None else lifted[slot] for slot in function.saved_slots]
    return _call_for(
        fx,
        node,
        ops.call_function_backward,
        (hook_at(function.ctx_hook), saved, tuple(function.is_variable_input), node.name, *grads),
    )


def _materialized_grads(
    fx: torch.fx.Graph, node: ca_core.NodeInfo, buffer: list[Any], size_at: Any
) -> list[Any]:
    """A Python Function's input grads, undefined ones replaced by zeros as eager's PyNode does."""
    function = node.function
    assert function is not None
    grads: list[Any] = []
    for buffered, spec in zip(buffer, function.materialize):
        grad = buffered
        if spec is not None:
            dims = [size_at(node.size_offset + spec.first_size + d) for d in range(len(spec.shape))]
            shape = [extent if dim is None else dim for dim, extent in zip(dims, spec.shape)]
            grad = fx.call_function(ops.materialize_grad, (buffered, shape, spec.dtype, spec.device))
        grads.append(grad)
    return grads


def _copy_aot_backward(
    fx: torch.fx.Graph,
    root: torch.nn.Module,
    node: ca_core.NodeInfo,
    buffer: list[Any],
    lifted: _LazyItems,
    hook_at: Any,
    size_at: Any,
    create_graph: bool,
) -> list[Any]:
    """A torch.compile'd region's backward, copied into the graph; see [Note: AOT backwards]."""
    function = node.function
    assert function is not None
    symints = [
        value if (dim := size_at(node.size_offset + i)) is None else dim
        for i, value in enumerate(function.symints)
    ]
    return copy_aot_backward(
        fx,
        root,
        node,
        _materialized_grads(fx, node, buffer, size_at),
        saved=[None if slot is None else lifted[slot] for slot in function.saved_slots],
        symints=symints,
        opaque=[hook_at(i) for i in function.opaque_hooks],
        backward_state=(
            None if function.backward_state_hook is None else hook_at(function.backward_state_hook)
        ),
        create_graph=create_graph,
    )
