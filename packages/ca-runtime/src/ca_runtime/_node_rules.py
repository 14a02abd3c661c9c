"""How each kind of autograd node and hook is captured: data tables, not if chains.

A node rule matches a node by its demangled C++ type (``NodeInfo.type_name``,
an ``fnmatch`` pattern), its name (``NodeInfo.name``) and an optional
condition; the first matching rule wins and the default is to trace the node
through ``apply_node``. AccumulateGrad is not a row: ca_core decides
which nodes are leaves (``NodeInfo.is_accumulate_grad``) and the capture must
follow that same flag.
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

import ca_core

from ca_runtime._aot import is_aot_backward
from ca_runtime._torch_interop import dynamo_skips

__all__ = ["HOOK_RULES", "NODE_RULES", "Handling", "HookRule", "NodeRule", "rule_for"]


class Handling(enum.Enum):
    """What the capture does with a node or a hook."""

    #: A call Dynamo traces into the compiled graph.
    TRACE = "trace"
    #: A Python autograd.Function: the graph calls its backward itself.
    FUNCTION = "function"
    #: A torch.compile'd region's backward: its ATen graph is copied into
    #: ours, or BREAK where it cannot be; see [Note: AOT backwards].
    AOT = "aot"
    #: Traced if ``ca_core.probe_traceable`` says so, else BREAK.
    PROBE = "probe"
    #: Runs eagerly behind a graph break; see [Note: Graph call kinds].
    BREAK = "break"
    #: Its input grad is a leaf grad; see [Note: Leaf accumulation order].
    ACCUMULATE = "accumulate"
    #: Cannot be captured: the whole backward runs on the eager engine.
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class NodeRule:
    """One row of NODE_RULES."""

    pattern: str
    handling: Handling
    reason: str = ""
    #: fnmatch pattern on ``NodeInfo.name`` (e.g. the Function's class).
    name: str = "*"
    #: Extra condition on the node in its backward; None matches every node.
    condition: Callable[[ca_core.NodeInfo, ca_core.BackwardGraph], bool] | None = None
    #: Its backward reads leaf ``.grad`` fields this backward wrote: the
    #: leaves before it are accumulated at their eager position; see
    #: [Note: Leaf accumulation order].
    reads_leaf_grads: bool = False


def _unpacks_before_it_could_fail(node: ca_core.NodeInfo, graph: ca_core.BackwardGraph) -> bool:
    """Its unpack hooks, called before it, would run where eager's CopySlices fails first; see its row."""
    if not node.unpack_hook_fns:
        return False
    return graph.inside_a_vmap or any(dynamo_skips(hook) for hook in node.unpack_hook_fns)


def _is_aot_backward(node: ca_core.NodeInfo, graph: ca_core.BackwardGraph) -> bool:
    return is_aot_backward(node)


NODE_RULES: tuple[NodeRule, ...] = (
    NodeRule(
        "torch::autograd::PyNode",
        Handling.BREAK,
        "reentrant checkpoint runs a backward inside its backward",
        name="CheckpointFunctionBackward",
    ),
    NodeRule("torch::autograd::PyNode", Handling.AOT, condition=_is_aot_backward),
    # FSDP2's post-backward reduce-scatters the unsharded parameters' .grad.
    NodeRule(
        "torch::autograd::PyNode",
        Handling.FUNCTION,
        name="RegisterPostBackwardFunctionBackward",
        reads_leaf_grads=True,
    ),
    NodeRule("torch::autograd::PyNode", Handling.FUNCTION),
    # Found by the OpInfo sweep (complex64, sample 0, max error 55): traced
    # through AOTAutograd, this backward is wrong in torch 2.13 (torch's own
    # compiled autograd gives the same wrong grad); Dynamo alone is right.
    NodeRule(
        "torch::autograd::generated::LinalgLstsqBackward0",
        Handling.BREAK,
        "torch 2.13's AOTAutograd computes a wrong grad for linalg.lstsq's backward (complex inputs)",
    ),
    # CopySlices slices (as_strided) its grad before its inner node unpacks
    # the saved tensors, and under vmap that slicing fails where the batch dim
    # is not in front (an empty tensor's strides): eager raises before any
    # unpack hook runs. The graph calls the hooks before the node, so where
    # that order shows -- hooks Dynamo skips (called behind a graph break of
    # ours) or a backward inside a vmap (is_grads_batched, torch.func; Dynamo cannot trace
    # batched tensors; the graph runs as Python) -- the node runs as it is,
    # behind a break, and its hooks run inside it, in eager's order (found by
    # the fuzzer's combined mode).
    NodeRule(
        "torch::autograd::CopySlices",
        Handling.BREAK,
        "its saved tensors' unpack hooks run inside it, after it slices its grad, as in eager",
        condition=_unpacks_before_it_could_fail,
    ),
    NodeRule(
        "torch::autograd::CppNode<*>",
        Handling.PROBE,
        "a C++ autograd Function with is_traceable = false runs eagerly",
    ),
)

_DEFAULT = NodeRule("*", Handling.TRACE)
_ACCUMULATE = NodeRule("torch::autograd::AccumulateGrad", Handling.ACCUMULATE)


def rule_for(node: ca_core.NodeInfo, graph: ca_core.BackwardGraph) -> NodeRule:
    """ACCUMULATE for ca_core's AccumulateGrad nodes, else the first matching rule for ``node`` in ``graph``."""
    if node.is_accumulate_grad:
        return _ACCUMULATE
    for rule in NODE_RULES:
        if (
            fnmatch.fnmatchcase(node.type_name, rule.pattern)
            and fnmatch.fnmatchcase(node.name, rule.name)
            and (rule.condition is None or rule.condition(node, graph))
        ):
            return rule
    return _DEFAULT


@dataclass(frozen=True)
class HookRule:
    """How one kind of tensor pre-hook (``TensorPreHookInfo.kind``) is captured."""

    handling: Handling
    reason: str = ""


#: Tensor pre-hooks by kind. grad_fn pre/post hooks are always traced, and
#: post-accumulate-grad hooks run inside the real AccumulateGrad node.
HOOK_RULES: dict[ca_core.TensorPreHookKind, HookRule] = {
    ca_core.TensorPreHookKind.python: HookRule(Handling.TRACE),
    ca_core.TensorPreHookKind.cpp: HookRule(Handling.BREAK, "a C++ tensor hook runs eagerly"),
    ca_core.TensorPreHookKind.retains_grad: HookRule(Handling.BREAK, "retain_grad() sets .grad eagerly"),
    ca_core.TensorPreHookKind.opaque: HookRule(
        Handling.BREAK, "a C++ tensor hook without compiled_args runs eagerly"
    ),
}
