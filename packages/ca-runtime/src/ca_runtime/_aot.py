"""The backward of a ``torch.compile``'d region, copied into the captured graph.

[Note: AOT backwards]
A forward compiled by ``torch.compile`` reaches autograd as one Python
Function node, AOTAutograd's ``CompiledFunction`` (node name
``CompiledFunctionBackward``). Its backward is an FX graph of ATen ops that
AOTAutograd traced together with the forward and compiles lazily, the first
time the backward runs. Calling that backward opaquely from our graph would
hide it from Dynamo and split the step into two compiled pieces; instead the
capture copies it in, so the compiler sees one backward graph:

1. ``prologue``: AOTAutograd's own backward prologue, called through an
   ``allow_in_graph`` wrapper. It checks the grads, drops those of outputs
   that need none, coerces their memory format and returns the backward
   graph's flat inputs ``[*symints, *saved tensors, *opaque objects, *grads,
   ...]``.
2. the backward graph's nodes, copied one by one, its placeholders bound to
   the prologue's outputs, except the symints: those are this node's first
   size inputs (constants while static, graph inputs once dynamic; see
   [Note: Dynamic sizes] in ca_core), so a forward that recompiled for a new
   batch size is served by the same graph. ``aten.view`` becomes
   ``aten.reshape``, as torch's compiled autograd does, because the forward
   was compiled with the view-to-reshape pass the lazy backward has not seen.
3. the epilogue (dropping effect tokens), applied while capturing: for plain
   tensors it only reorders the outputs.

The graph never calls ``CompiledFunction.backward``, so AOTAutograd's lazy
backward compile does not happen; the backward is compiled by our
``compiler_fn`` as part of the whole graph. What cannot be copied raises
``NotCopyable`` with the reason, and that node alone runs its real backward
behind a graph break: tensor-subclass grads, functionalised RNG state, the
tensors AOTAutograd saves without a version check, a region whose backward
graph AOTAutograd does not keep, and ``create_graph=True`` (AOTAutograd's
backward is not differentiable; eager raises on a double backward through it
and so must we).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import ca_core
import torch
import torch.fx

__all__ = ["NotCopyable", "copy_aot_backward", "is_aot_backward"]


class NotCopyable(Exception):
    """An AOT backward the capture cannot copy into the graph; the message says why."""


def is_aot_backward(node: ca_core.NodeInfo) -> bool:
    """Whether ``node`` is the backward of a ``torch.compile``'d region (AOTAutograd)."""
    function = node.function
    if function is None:
        return False
    return hasattr(getattr(function.ctx, "_forward_cls", None), "_aot_id")


#: Per CompiledFunction class, its prologue wrapped with allow_in_graph (kept
#: as long as the class lives, so the allow-list entry stays valid).
_prologues: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def _prologue_for(compiled_function: type) -> Callable[..., Any]:
    wrapped = _prologues.get(compiled_function)
    if wrapped is None:
        prologue = compiled_function._bw_prologue_fn  # type: ignore[attr-defined]

        def aot_backward_prologue(
            saved: Sequence[torch.Tensor],
            symints: Sequence[int],
            opaque: Sequence[Any],
            grads: Sequence[torch.Tensor | None],
        ) -> list[Any]:
            return prologue(list(saved), list(symints), list(opaque), list(grads))

        wrapped = torch.compiler.allow_in_graph(aot_backward_prologue)
        _prologues[compiled_function] = wrapped
    return wrapped


def _backward_module(compiled_function: type) -> torch.fx.GraphModule:
    from torch._dynamo.compiled_autograd import extract_bw_module

    try:
        module: torch.fx.GraphModule = extract_bw_module(compiled_function)  # type: ignore[assignment]
        return module
    except Exception as e:
        raise NotCopyable(f"its backward graph is not available ({type(e).__name__}: {e})") from e


def _check_copyable(ctx: Any, create_graph: bool) -> type:
    compiled_function = ctx._forward_cls
    if create_graph:
        raise NotCopyable("create_graph=True: a torch.compile'd region's backward is not differentiable")
    if compiled_function.maybe_subclass_metadata is not None:
        raise NotCopyable("its grads are tensor subclasses")
    metadata = compiled_function.metadata
    if metadata.is_rng_op_functionalized:
        raise NotCopyable("its RNG state is functionalised")
    if getattr(ctx, "_tensors_no_vc_check", None):
        raise NotCopyable("it saves tensors without a version check")
    return compiled_function


def copy_aot_backward(
    fx: torch.fx.Graph,
    root: torch.nn.Module,
    node: ca_core.NodeInfo,
    grads: list[Any],
    saved: list[Any],
    symints: list[Any],
    opaque: list[Any],
    backward_state: Any,
    create_graph: bool,
) -> list[Any]:
    """Copies ``node``'s AOT backward into ``fx``; returns its grads, one per tensor input.

    See [Note: AOT backwards]. ``symints`` are this node's symint values (ints
    or graph values), ``saved`` its saved tensors, ``opaque`` and
    ``backward_state`` graph values of the objects ctx carries.
    """
    function = node.function
    assert function is not None
    compiled_function = _check_copyable(function.ctx, create_graph)
    bw_module = _backward_module(compiled_function)
    placeholders = [n for n in bw_module.graph.nodes if n.op == "placeholder"]
    num_flat = len(placeholders) - (backward_state is not None)
    if len(symints) > num_flat:
        raise NotCopyable("its backward graph takes fewer inputs than ctx has symints")

    flat = fx.call_function(_prologue_for(compiled_function), (saved, symints, opaque, list(grads)))
    bound: list[Any] = [
        symints[i] if i < len(symints) else fx.call_function(operator.getitem, (flat, i))
        for i in range(num_flat)
    ]
    if backward_state is not None:
        bound.append(backward_state)

    remap: dict[torch.fx.Node, Any] = dict(zip(placeholders, bound))
    outputs: list[Any] | None = None
    for bw_node in bw_module.graph.nodes:
        if bw_node.op == "placeholder":
            continue
        if bw_node.op == "output":
            outputs = [remap[v] if isinstance(v, torch.fx.Node) else v for v in bw_node.args[0]]
            continue
        if bw_node.op in ("get_attr", "call_module"):
            name = _fresh_attribute(root, str(bw_node.target))
            setattr(root, name, getattr(bw_module, str(bw_node.target)))
            copied = fx.node_copy(bw_node, lambda n: remap[n])
            copied.target = name
        elif bw_node.op == "call_function":
            copied = fx.node_copy(bw_node, lambda n: remap[n])
            if copied.target is torch.ops.aten.view.default:
                copied.target = torch.ops.aten.reshape.default
        else:
            raise NotCopyable(f"its backward graph has a {bw_node.op} node")
        remap[bw_node] = copied
    if outputs is None:
        raise NotCopyable("its backward graph has no output")

    try:
        result = tuple(compiled_function._bw_epilogue_fn(outputs))  # type: ignore[attr-defined]
    except Exception as e:
        raise NotCopyable(f"its backward epilogue cannot be applied while capturing ({e})") from e
    is_input = function.is_variable_input
    if len(result) != len(is_input):
        raise NotCopyable(f"its backward returns {len(result)} grads for {len(is_input)} forward inputs")
    return [grad for grad, is_tensor in zip(result, is_input) if is_tensor]


def _fresh_attribute(root: torch.nn.Module, name: str) -> str:
    base = "aot_" + name.replace(".", "_")
    candidate, k = base, 0
    while hasattr(root, candidate):
        k += 1
        candidate = f"{base}_{k}"
    return candidate
