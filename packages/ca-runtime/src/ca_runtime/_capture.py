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
AccumulateGrad carries Python grad_fn pre/post hooks has them called in the
graph around that accumulation (see [Note: Leaf node hooks] in ca_core). A
leaf whose AccumulateGrad carries C++ hooks (DDP's Reducer) keeps its real
node: after the graph, or behind a graph break (``accumulate_grad_now``) at
its eager position when a later hook must see it first (for a reader of leaf
grads, ``NodeRule.reads_leaf_grads``, too). A checkpoint region's recompute
(its unpack hooks) is not counted as such user code: it reruns the forward,
which reads parameters, not grads, so DDP with checkpointing keeps one graph.
"""

from __future__ import annotations

import operator
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ca_core
import torch
import torch.fx

from ca_runtime import _graph_ops as ops
from ca_runtime._aot import NotCopyable, copy_aot_backward
from ca_runtime._checkpoint import recomputable, recompute_region
from ca_runtime._node_rules import HOOK_RULES, Handling, NodeRule, rule_for
from ca_runtime._torch_interop import (
    checkpoint_frame,
    checkpoint_inputs_have_hooks,
    checkpoint_saved_index,
    dynamo_skips,
    is_generated_vmap_rule,
)

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
    #: How each node that runs (not AccumulateGrad) was taken, by walk index:
    #: TRACE, FUNCTION, AOT or BREAK (a probe or a failed AOT copy resolved).
    handlings: dict[int, Handling] = field(default_factory=dict)
    #: Walk index of each node with grad_fn pre or post hooks.
    hooked: frozenset[int] = frozenset()
    #: A user callable of the graph names a node's saved tensors
    #: (``grad_fn._saved_self``); see [Note: Hooks that read saved tensors].
    hooks_read_saved: bool = False

    def free_early(self) -> list[int]:
        """Nodes whose saved tensors ca_core may drop before the graph runs on a hit.

        Those the graph traces or copies (TRACE, AOT): it never runs them
        for real; see [Note: Saved tensors freed early] in ca_core. Not a node
        with grad_fn hooks: eager runs them while the node still holds its
        saved tensors, and a hook may read them (``grad_fn._saved_self``).
        """
        if self.hooks_read_saved:
            return []
        return sorted(
            i
            for i, h in self.handlings.items()
            if h in (Handling.TRACE, Handling.AOT) and i not in self.hooked
        )


# [Note: Hooks that read saved tensors]
# A hook may read another node's saved tensors before that node runs
# (``h.grad_fn._saved_self`` in a hook on a later tensor): eager frees a node's
# saved tensors only once the node has run, so the read works. On a cache hit
# ca_core frees the saved tensors of the nodes the graph traces before the
# graph runs (see [Note: Saved tensors freed early] in ca_core), and such a
# read would raise "Trying to backward through the graph a second time". So
# when any callable of the graph names a saved-tensor attribute of a node
# (``_saved_*``, ``_raw_saved_*``) in its code or in the code of functions
# nested in it, nothing is freed early for that graph: its saved tensors live
# until the graph ends (memory, not results). A read through a helper defined
# elsewhere or ``getattr`` with a computed name is not seen.
_SAVED_ATTRIBUTE_PREFIXES = ("_saved_", "_raw_saved_")


def _names_saved_tensors(obj: object) -> bool:
    """Whether ``obj`` (a hook, a partial of one, a bound method) names a node's saved tensors in its code."""
    obj = getattr(obj, "func", obj)  # functools.partial
    obj = getattr(obj, "__func__", obj)  # a bound method
    code = getattr(obj, "__code__", None)
    if code is None and callable(obj):
        code = getattr(type(obj).__call__, "__code__", None)  # an object with __call__
    pending = [code] if isinstance(code, types.CodeType) else []
    while pending:
        code = pending.pop()
        if any(name.startswith(_SAVED_ATTRIBUTE_PREFIXES) for name in code.co_names):
            return True
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


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
        recompute_region,
    }
)


def _is_impure(node: torch.fx.Node) -> bool:
    return node.is_impure() or (node.op == "call_function" and node.target in _EFFECTFUL)


def _runs_leaf_hooks(node: ca_core.NodeInfo) -> bool:
    """Whether accumulating leaf ``node`` calls user code (see [Note: Leaf node hooks] in ca_core)."""
    return bool(node.num_grad_fn_pre_hooks or node.num_grad_fn_post_hooks or node.num_post_acc_grad_hooks)


def _leaf_hooks_collected(node: ca_core.NodeInfo) -> bool:
    """Whether the graph can call leaf ``node``'s grad_fn hooks (none are C++); see [Note: Leaf node hooks] in ca_core."""
    return (
        len(node.pre_hooks) == node.num_grad_fn_pre_hooks
        and len(node.post_hooks) == node.num_grad_fn_post_hooks
    )


def _accumulates_in_graph(
    node: ca_core.NodeInfo, graph: ca_core.BackwardGraph, user_code_follows: bool
) -> bool:
    """A leaf the graph accumulates itself; see [Note: Leaves accumulated in the graph] in ca_core.

    When it has post-accumulate-grad hooks, or when user code runs after it
    (``user_code_follows``) and could read its ``.grad``; not when it has C++
    grad_fn pre-hooks.
    """
    return bool(
        graph.accumulate_grad
        and not graph.create_graph
        and node.tensor_slots
        and (node.post_acc_grad_hooks or user_code_follows)
        and (_leaf_hooks_collected(node) or not node.num_grad_fn_pre_hooks)
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
    call.meta["sequence_nr"] = node.sequence_nr
    return call


def build_graph_module(graph: ca_core.BackwardGraph) -> Capture:
    """The FX graph of one backward; raises UnsupportedNode for a node it cannot take."""
    builder = _GraphBuilder(graph)
    try:
        return builder.build()
    finally:
        # The builder and its _Unpacker refer to each other (bound methods),
        # and the builder holds the walk's nodes, ctxs and hooks: without this
        # they would wait for a full gc (see [Note: Dynamo's tracing cycles]
        # in _runtime.py for the other cycle a capture leaves).
        builder.release()


# [Note: Hooks taken up front]
# The graph's `hooks` input holds every Python object the walk collected:
# hooks, packed saved tensors, and the ctx of each Python Function node, also
# of nodes that run behind a graph break and never read theirs. At a graph
# break Dynamo looks through every local it still holds for aliases of the
# lists it steals (OutputGraph.handle_aliases_for_stolen_lists), and that
# realizes each item of `hooks`: a Function's ctx is then read for its
# saved_tensors, which runs their unpack hooks once more than eager does
# (a non-reentrant checkpoint raises CheckpointError, "Unpack is being
# triggered for a tensor that was already unpacked once") and guards on
# them. So the graph takes the items it uses right at its start, in order of
# first use, and `hooks` dies there, before any break: the items no step uses
# are never seen by Dynamo.


class _GraphBuilder:
    """Writes out the eager engine's loop for one walked backward, node by node.

    ``build()`` visits the nodes in walk order. For each node, in eager's order
    (see the module docstring): record the ``torch.autograd.grad`` outputs it
    holds, ``_tensor_pre_hooks``, then the step its ``Handling`` selects in
    ``_STEPS`` (a leaf: ``_leaf``; a node that runs: ``_node``, which calls
    its grad_fn pre-hooks, its ``_APPLY`` emitter, ``validate_outputs``, its
    post-hooks and ``_route`` to the nodes its edges lead to). Each node's rule
    and handling are computed once, in ``__init__``.
    """

    def __init__(self, graph: ca_core.BackwardGraph) -> None:
        self.graph = graph
        self.nodes = graph.nodes
        self.fx = fx = torch.fx.Graph()
        inputs = fx.placeholder("inputs")
        self._sizes = fx.placeholder("sizes")
        scalars = fx.placeholder("scalars")
        self._hooks = fx.placeholder("hooks")
        # Dynamo steals `inputs` and empties it (see [Note: Saved tensors freed
        # early] in ca_core): a graph break must not read it again, so its
        # items are taken once, up front, and read from the tuple.
        lifted_tuple = fx.call_function(tuple, (inputs,))
        lifted_tuple.name = "lifted"
        self.lifted = _LazyItems(fx, lifted_tuple, graph.num_tensors)
        self.lifted_scalars = _LazyItems(fx, scalars, graph.num_scalars)
        self._hook_nodes: dict[int, torch.fx.Node] = {}
        #: Where the next item of ``hooks`` is taken: up front; see [Note: Hooks taken up front].
        self._hooks_taken_after = lifted_tuple
        self._dynamic_positions = {
            k: j for j, k in enumerate(k for k, dyn in enumerate(graph.dynamic_sizes) if dyn)
        }
        self._size_nodes: dict[int, torch.fx.Node] = {}
        #: Buffers of input grads per node index, filled by the nodes before it.
        self._buffers: dict[int, list[Any]] = {}
        self._grad_outputs: list[Any] = [None] * graph.num_outputs
        self._leaf_grads: list[Any] = []
        #: Holds the attributes copied AOT backward graphs read (see [Note: AOT backwards]).
        self.root = torch.nn.Module()
        #: What the Capture will hold besides the graph module (made at the end of build()).
        self.leaf_outputs: list[int] = []
        self.leaf_hooks_only: list[bool] = []
        self.graph_breaks: list[GraphBreak] = []
        # Per-node rules, once: see [Note: Leaf accumulation order].
        self._rules = {n.index: rule_for(n, graph) for n in self.nodes if n.needed}
        self._handlings = {
            n.index: _handling_of(n, self._rules[n.index], graph.create_graph)
            for n in self.nodes
            if n.needed and not n.is_accumulate_grad
        }
        self._last_effect = max((n.index for n in self.nodes if self._has_effects(n)), default=-1)
        self._last_reader = max(
            (
                n.index
                for n in self.nodes
                if n.needed and not n.is_accumulate_grad and self._rules[n.index].reads_leaf_grads
            ),
            default=-1,
        )
        self._unpacker = _Unpacker(fx, self.hook_at, self.graph_break, self.nodes, self._handlings)

    def release(self) -> None:
        """Breaks the builder <-> _Unpacker reference cycle."""
        del self._unpacker

    # -- graph values ---------------------------------------------------------

    def getitem(self, seq: torch.fx.Node, i: int) -> torch.fx.Node:
        return self.fx.call_function(operator.getitem, (seq, i))

    def unpack(self, result: torch.fx.Node, n: int) -> list[Any]:
        return [self.getitem(result, i) for i in range(n)]

    def hook_at(self, i: int) -> torch.fx.Node:
        """The graph value of collected Python object ``i`` (a hook, a ctx); see [Note: Hooks taken up front]."""
        if i not in self._hook_nodes:
            with self.fx.inserting_after(self._hooks_taken_after):
                self._hook_nodes[i] = self._hooks_taken_after = self.getitem(self._hooks, i)
        return self._hook_nodes[i]

    def size_at(self, k: int) -> torch.fx.Node | None:
        """Graph value of size input ``k`` if it is dynamic, else None (static)."""
        if k not in self._dynamic_positions:
            return None
        if k not in self._size_nodes:
            self._size_nodes[k] = self.fx.call_function(
                ops.unwrap_size, (self.getitem(self._sizes, self._dynamic_positions[k]),)
            )
        return self._size_nodes[k]

    def sizes_for(self, first: int, count: int) -> list[Any] | None:
        values = [self.size_at(first + i) for i in range(count)]
        return None if all(v is None for v in values) else values

    def graph_break(self, node: ca_core.NodeInfo, reason: str) -> None:
        self.graph_breaks.append(GraphBreak(node.name, node.index, reason))

    def _has_effects(self, node: ca_core.NodeInfo) -> bool:
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
        # A checkpoint region's recompute reruns the user's forward, which
        # reads parameters, not grads: not a reader of leaf grads.
        if any(checkpoint_frame(hook) is None for hook in node.unpack_hook_fns):
            return True
        return self._rules[node.index].handling not in (Handling.TRACE, Handling.AOT)

    # -- the walk -------------------------------------------------------------

    def build(self) -> Capture:
        for node in self.nodes:
            self._visit(node)
        self.fx.output(self._grad_outputs + self._leaf_grads)
        self.fx.eliminate_dead_code(is_impure_node=_is_impure)
        graph_module = torch.fx.GraphModule(self.root, self.fx, "CompiledBackward")
        handlings = {index: handling for index, (handling, _) in self._handlings.items()}
        hooked = frozenset(n.index for n in self.nodes if n.num_grad_fn_pre_hooks or n.num_grad_fn_post_hooks)
        return Capture(
            graph_module,
            self.leaf_outputs,
            self.leaf_hooks_only,
            self.graph_breaks,
            handlings,
            hooked,
            any(_names_saved_tensors(self._hook_object(i)) for i in self._user_hook_indices()),
        )

    @staticmethod
    def _hook_object(i: int) -> object:
        """Collected Python object ``i`` of the backward being captured (None outside one)."""
        try:
            return ca_core.running_graph_hook(i)
        except (ValueError, IndexError):
            return None

    def _user_hook_indices(self) -> set[int]:
        """Indices in the graph's ``hooks`` of every hook function the walk collected (no ctx, no packed data)."""
        found: set[int] = set()
        for node in self.nodes:
            # A C++ or opaque hook's index is its node's own, not one of `hooks`.
            found.update(h.hook for h in node.tensor_pre_hooks if h.kind == ca_core.TensorPreHookKind.python)
            found.update(node.pre_hooks)
            found.update(node.post_hooks)
            found.update(node.post_acc_grad_hooks)
        return found

    def _visit(self, node: ca_core.NodeInfo) -> None:
        buffer = self._buffers.pop(node.index, None) or [None] * node.num_inputs
        # Eager captures torch.autograd.grad outputs before the tensor
        # pre-hooks of a node that runs, after them for one that does not.
        if node.needed:
            self._record_outputs(node, buffer)
        buffer = self._tensor_pre_hooks(node, buffer)
        if not node.needed:
            self._record_outputs(node, buffer)
            return
        rule = self._rules[node.index]
        step = _STEPS.get(rule.handling, _GraphBuilder._node)
        step(self, node, buffer, rule.reason)

    def _record_outputs(self, node: ca_core.NodeInfo, buffer: list[Any]) -> None:
        for input_nr, output_idx in node.graph_output:
            self._grad_outputs[output_idx] = buffer[input_nr]

    def _tensor_pre_hooks(self, node: ca_core.NodeInfo, buffer: list[Any]) -> list[Any]:
        """Tensor pre-hooks on the node's input grads, in registration order; see [Note: Hook order] in ca_core."""
        for hook in node.tensor_pre_hooks:
            hook_rule = HOOK_RULES[hook.kind]
            grad = buffer[hook.input_nr]
            if hook_rule.handling is Handling.TRACE:
                buffer[hook.input_nr] = self.fx.call_function(
                    ops.call_tensor_hook, (self.hook_at(hook.hook), grad)
                )
            elif hook.kind is ca_core.TensorPreHookKind.opaque:
                self.graph_break(node, hook_rule.reason)
                buffer = self.unpack(
                    self.fx.call_function(
                        ops.call_opaque_tensor_pre_hook, (node.index, hook.hook, list(buffer))
                    ),
                    node.num_inputs,
                )
            else:
                self.graph_break(node, hook_rule.reason)
                buffer[hook.input_nr] = self.fx.call_function(
                    ops.call_cpp_tensor_pre_hook, (node.index, hook.hook, grad)
                )
        return buffer

    def _computed_here(self, value: Any) -> bool:
        """Whether ``value`` is a tensor the graph computes, not one of its inputs; see [Note: A leaf steals its first grad]."""
        while isinstance(value, torch.fx.Node) and value.target is operator.getitem:
            value = value.args[0]
        return isinstance(value, torch.fx.Node) and value.op != "placeholder"

    def _unsupported(self, node: ca_core.NodeInfo, buffer: list[Any], reason: str) -> None:
        raise UnsupportedNode(node, reason)

    def _leaf(self, node: ca_core.NodeInfo, buffer: list[Any], reason: str) -> None:
        """An AccumulateGrad node; see [Note: Leaf accumulation order]."""
        user_code_follows = node.index < max(self._last_effect, self._last_reader)
        if _accumulates_in_graph(node, self.graph, user_code_follows):
            # Python grad_fn pre-hooks, the accumulation (and its
            # post-accumulate-grad hooks), then grad_fn post-hooks, as
            # eager's call_function runs them (see [Note: Leaf node hooks]).
            for pre_hook in node.pre_hooks:
                buffer = self.unpack(
                    self.fx.call_function(ops.call_pre_hook, (self.hook_at(pre_hook), list(buffer))), 1
                )
            self.fx.call_function(
                ops.accumulate_leaf,
                (
                    self.lifted[node.tensor_slots[0]],
                    buffer[0],
                    [self.hook_at(h) for h in node.post_acc_grad_hooks],
                    bool(node.post_hooks) and self._computed_here(buffer[0]),
                ),
            )
            for post_hook in node.post_hooks:
                self.fx.call_function(ops.call_post_hook, (self.hook_at(post_hook), [], list(buffer)))
            if node.num_grad_fn_post_hooks and not _leaf_hooks_collected(node):
                self.leaf_outputs.append(node.index)
                self.leaf_hooks_only.append(True)
                self._leaf_grads.append(buffer[0])
        elif node.index < self._last_reader:
            self.graph_break(node, f"{self.nodes[self._last_reader].name} reads this leaf's .grad later")
            self.fx.call_function(ops.accumulate_grad_now, (node.index, buffer[0]))
        elif _runs_leaf_hooks(node) and node.index < self._last_effect:
            self.graph_break(node, "a leaf's hooks must run before later hooks")
            self.fx.call_function(ops.accumulate_grad_now, (node.index, buffer[0]))
        else:
            self.leaf_outputs.append(node.index)
            self.leaf_hooks_only.append(False)
            self._leaf_grads.append(buffer[0])

    def _node(self, node: ca_core.NodeInfo, buffer: list[Any], reason: str) -> None:
        """A node that runs: pre-hooks, the node itself, its output check, post-hooks, edges."""
        fx = self.fx
        for pre_hook in node.pre_hooks:
            buffer = self.unpack(
                fx.call_function(ops.call_pre_hook, (self.hook_at(pre_hook), list(buffer))), node.num_inputs
            )
        handling, why = self._handlings[node.index]
        outputs: Any = None
        if handling is Handling.AOT:
            try:
                outputs = _copy_aot_backward(
                    fx,
                    self.root,
                    node,
                    buffer,
                    self.lifted,
                    self.hook_at,
                    self.size_at,
                    self.graph.create_graph,
                )
            except NotCopyable as e:
                handling, why = Handling.BREAK, f"the backward of a torch.compile'd region runs eagerly: {e}"
                self._handlings[node.index] = (handling, why)
            else:
                outputs = self._validated(node, outputs)
        if handling is not Handling.AOT:
            outputs = _APPLY[handling](self, node, buffer, why)
        grads = self.unpack(outputs, node.num_outputs)
        for post_hook in node.post_hooks:
            grads = self.unpack(
                fx.call_function(ops.call_post_hook, (self.hook_at(post_hook), grads, list(buffer))),
                node.num_outputs,
            )
        self._route(node, grads)

    def _validated(self, node: ca_core.NodeInfo, outputs: Any) -> torch.fx.Node:
        validate_sizes = self.sizes_for(node.size_offset + node.num_apply_sizes, node.num_validate_sizes)
        return self.fx.call_function(ops.validate_outputs, (node.index, outputs, validate_sizes))

    def _saved(self, node: ca_core.NodeInfo) -> tuple[list[Any], list[Any] | None, list[Any]]:
        """The node's own slice of lifted tensors, apply sizes and scalars."""
        saved = [self.lifted[slot] for slot in node.tensor_slots]
        apply_sizes = self.sizes_for(node.size_offset, node.num_apply_sizes)
        scalars = self.lifted_scalars[node.scalar_offset : node.scalar_offset + node.num_scalars]
        return saved, apply_sizes, scalars

    def _apply_traced(self, node: ca_core.NodeInfo, buffer: list[Any], why: str) -> torch.fx.Node:
        """One call for the node and its output check; see [Note: One call per node] in ca_core."""
        saved, apply_sizes, scalars = self._saved(node)
        saved += self._unpacker.unpacked(node, buffer)
        validate_sizes = self.sizes_for(node.size_offset + node.num_apply_sizes, node.num_validate_sizes)
        return _call_for(
            self.fx,
            node,
            ops.apply_node,
            (node.index, list(buffer), saved, apply_sizes, scalars, validate_sizes),
        )

    def _apply_break(self, node: ca_core.NodeInfo, buffer: list[Any], why: str) -> torch.fx.Node:
        """``apply_with_saved`` behind a graph break: runs on real tensors every backward."""
        self.graph_break(node, why or "it cannot be traced")
        saved, _, scalars = self._saved(node)
        # No replacement sizes: the real node's own are this backward's, and
        # with none it runs as eager runs it, its unpacked saved tensors
        # attached to their graph for a create_graph=True backward (see
        # [Note: Eager fast path] in ca_core).
        outputs = _call_for(
            self.fx, node, ops.apply_with_saved_eager, (node.index, list(buffer), saved, None, scalars)
        )
        return self._validated(node, outputs)

    def _apply_function(self, node: ca_core.NodeInfo, buffer: list[Any], why: str) -> torch.fx.Node:
        """A Python Function's backward called from the graph; see [Note: Python Functions in the graph]."""
        outputs = _call_function(self.fx, node, buffer, self.lifted, self.hook_at, self.size_at)
        return self._validated(node, outputs)

    def _route(self, node: ca_core.NodeInfo, grads: list[Any]) -> None:
        """Each output grad into the buffer of the node its edge leads to, summed as InputBuffer does."""
        for output_nr, edge in enumerate(node.next_edges):
            if edge is None:
                continue
            target, input_nr = edge
            target_buffer = self._buffers.setdefault(target, [None] * self.nodes[target].num_inputs)
            prior = target_buffer[input_nr]
            grad = grads[output_nr]
            target_buffer[input_nr] = (
                grad if prior is None else self.fx.call_function(ops.accumulate, (prior, grad))
            )


#: What a needed node becomes, by its rule's Handling (the rest: ``_GraphBuilder._node``).
_STEPS: dict[Handling, Callable[[_GraphBuilder, ca_core.NodeInfo, list[Any], str], None]] = {
    Handling.ACCUMULATE: _GraphBuilder._leaf,
    Handling.UNSUPPORTED: _GraphBuilder._unsupported,
}

#: How a node that runs is called, by its handling after probes (see ``_handling_of``).
_APPLY: dict[Handling, Callable[[_GraphBuilder, ca_core.NodeInfo, list[Any], str], torch.fx.Node]] = {
    Handling.TRACE: _GraphBuilder._apply_traced,
    Handling.BREAK: _GraphBuilder._apply_break,
    Handling.FUNCTION: _GraphBuilder._apply_function,
}


def _defines_vjp(forward_cls: type) -> bool:
    """Whether a Python Function's class defines ``vjp``, the documented alias of ``backward``."""
    return forward_cls.vjp is not torch.autograd.Function.vjp  # type: ignore[attr-defined]


#: Python Functions whose backward runs behind a graph break, by their class: (test, reason).
_FUNCTIONS_RUN_EAGERLY: tuple[tuple[Callable[[type], bool], str], ...] = (
    # Eager's PyNode picks vjp (or refuses a Function defining both); Dynamo
    # inlines only `backward`.
    (_defines_vjp, "a Python Function defining vjp (backward's alias) runs eagerly"),
    (
        is_generated_vmap_rule,
        (
            "a Function vmapped by its generated vmap rule (generate_vmap_rule=True) runs eagerly: "
            "Dynamo cannot trace the ctx that rule wraps"
        ),
    ),
)


def _function_run_eagerly(function: ca_core.FunctionInfo | None) -> str | None:
    """Why a Python Function's backward runs behind a graph break (``_FUNCTIONS_RUN_EAGERLY``), or None."""
    forward_cls = getattr(function.ctx, "_forward_cls", None) if function is not None else None
    if forward_cls is None:
        return None
    return next((reason for test, reason in _FUNCTIONS_RUN_EAGERLY if test(forward_cls)), None)


def _handling_of(node: ca_core.NodeInfo, rule: NodeRule, create_graph: bool) -> tuple[Handling, str]:
    """How the capture takes a node that runs: its rule, with the probes and exceptions applied."""
    handling, reason = rule.handling, rule.reason
    if handling is Handling.PROBE:
        handling = Handling.TRACE if ca_core.probe_traceable(node.index) else Handling.BREAK
    if handling in (Handling.FUNCTION, Handling.AOT) and node.function is None:
        handling = Handling.BREAK
        if node.num_saved_tensor_hooks:
            reason = "a Python Function whose saved tensors have unpack hooks runs eagerly"
    elif handling is Handling.FUNCTION and (eager_reason := _function_run_eagerly(node.function)):
        handling, reason = Handling.BREAK, eager_reason
    if handling is Handling.TRACE and node.unpack_hooks and create_graph:
        # A swapped-in unpacked tensor would lose the grad_fn eager's unpack gives it.
        handling = Handling.BREAK
        reason = "create_graph=True: its saved tensors' unpack hooks run with the node, eagerly"
    return handling, reason


class _Unpacker:
    """Emits the unpack hooks of traced nodes' saved tensors; see [Note: Unpack hooks in the graph] in ca_core.

    A hook Dynamo inlines is called where eager calls it, just before its
    node. Hooks Dynamo would skip are grouped, each group called at its first
    unpack: all unpacks of one non-reentrant checkpoint region in one call
    (that unpack recomputes the whole region and the others only hand out
    what it saved), in the graph through one opaque op when the region
    recorded its tensors' metadata (see [Note: Checkpoint regions in the
    graph]), else behind a graph break of ours; any other node's behind one
    graph break per node.
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
        #: Per checkpoint group: its first hook, the hook's frame cell and
        #: each member's index in the frame's records; see
        #: [Note: Checkpoint regions in the graph].
        self._regions: dict[tuple[Any, ...], tuple[Any, int, list[int | None]]] = {}
        #: Checkpoint groups whose region inputs were packed by user hooks;
        #: see [Note: Side effects beside a region's recompute].
        self._hooked_inputs: set[tuple[Any, ...]] = set()
        for node in nodes:
            if handlings.get(node.index, (None,))[0] is not Handling.TRACE:
                continue
            for pair, hook, packed in zip(node.unpack_hooks, node.unpack_hook_fns, node.unpack_packed):
                if dynamo_skips(hook):
                    region = checkpoint_frame(hook)
                    group = ("node", node.index) if region is None else ("checkpoint", id(region[0]))
                    self._group_of[pair] = group
                    self._members.setdefault(group, []).append(pair)
                    if region is not None:
                        frame, cell = region
                        if checkpoint_inputs_have_hooks(frame):
                            self._hooked_inputs.add(group)
                        self._regions.setdefault(group, (hook, cell, []))[2].append(
                            checkpoint_saved_index(frame, packed)
                        )

    def unpacked(self, node: ca_core.NodeInfo, buffer: Sequence[Any]) -> list[Any]:
        """Graph values of ``node``'s unpacked saved tensors, in packed-input order."""
        values: list[Any] = []
        for pair in node.unpack_hooks:
            group = self._group_of.get(pair)
            if group is None:
                hook, packed = (self._hook_at(i) for i in pair)
                values.append(self._fx.call_function(ops.call_unpack_hook, (hook, packed)))
                continue
            members = self._members[group]
            region = self._regions.get(group)
            # [Note: Side effects beside a region's recompute]
            # The recompute op runs user code Dynamo does not see: the region's
            # forward and, when saved_tensors_hooks were active around the
            # checkpoint call, the user's unpack hook on the region's inputs
            # (the checkpoint frame saves them as SavedTensors). Dynamo replays
            # the side effects of the hooks it inlines after its graph by
            # rebuilding each object it saw mutated (a list the hooks append
            # to is rewritten whole), which erases what the op's calls did to
            # the same object: eager's log of unpacks lost the region's (found
            # by the fuzzer's combined mode). So a region whose inputs were
            # packed by user hooks runs behind a graph break, after Dynamo has
            # applied the side effects before it. A region's forward that
            # mutates what a traced hook mutates is not detected.
            if (
                group not in self._called
                and region is not None
                and group not in self._hooked_inputs
                and recomputable(*region)
            ):
                _, cell, indices = region
                self._called[group] = self._fx.call_function(
                    recompute_region,
                    (
                        self._hook_at(members[0][0]),
                        cell,
                        indices,
                        [h for h, _ in members],
                        [d for _, d in members],
                        # Where eager recomputes: after the node's input grads exist.
                        next((grad for grad in buffer if grad is not None), None),
                    ),
                )
            if group not in self._called:
                what = "a checkpoint region's" if group[0] == "checkpoint" else "its"
                why = "are skipped by Dynamo"
                if group in self._hooked_inputs:
                    why = "include yours"  # see [Note: Side effects beside a region's recompute]
                self._graph_break(node, f"{what} saved tensors' unpack hooks {why}")
                self._called[group] = self._fx.call_function(
                    ops.call_unpack_hooks_eager,
                    ([self._hook_at(h) for h, _ in members], [self._hook_at(d) for _, d in members]),
                )
            values.append(
                self._fx.call_function(operator.getitem, (self._called[group], members.index(pair)))
            )
        return values


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
