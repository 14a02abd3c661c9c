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
import types
from collections.abc import Callable
from dataclasses import dataclass

import ca_core

from ca_runtime._aot import is_aot_backward

__all__ = ["HOOK_RULES", "NODE_RULES", "Handling", "HookRule", "NodeRule", "dynamo_skips", "rule_for"]


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
    #: Extra condition on the node; None matches every node.
    condition: Callable[[ca_core.NodeInfo], bool] | None = None
    #: Its backward reads leaf ``.grad`` fields this backward wrote: the
    #: leaves before it are accumulated at their eager position; see
    #: [Note: Leaf accumulation order].
    reads_leaf_grads: bool = False


NODE_RULES: tuple[NodeRule, ...] = (
    NodeRule(
        "torch::autograd::PyNode",
        Handling.BREAK,
        "reentrant checkpoint runs a backward inside its backward",
        name="CheckpointFunctionBackward",
    ),
    NodeRule("torch::autograd::PyNode", Handling.AOT, condition=is_aot_backward),
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
    NodeRule(
        "torch::autograd::CppNode<*>",
        Handling.PROBE,
        "a C++ autograd Function with is_traceable = false runs eagerly",
    ),
)

_DEFAULT = NodeRule("*", Handling.TRACE)
_ACCUMULATE = NodeRule("torch::autograd::AccumulateGrad", Handling.ACCUMULATE)


def rule_for(node: ca_core.NodeInfo) -> NodeRule:
    """ACCUMULATE for ca_core's AccumulateGrad nodes, else the first matching rule."""
    if node.is_accumulate_grad:
        return _ACCUMULATE
    for rule in NODE_RULES:
        if (
            fnmatch.fnmatchcase(node.type_name, rule.pattern)
            and fnmatch.fnmatchcase(node.name, rule.name)
            and (rule.condition is None or rule.condition(node))
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
HOOK_RULES: dict[str, HookRule] = {
    "python": HookRule(Handling.TRACE),
    "cpp": HookRule(Handling.BREAK, "a C++ tensor hook runs eagerly"),
    "retains_grad": HookRule(Handling.BREAK, "retain_grad() sets .grad eagerly"),
    "opaque": HookRule(Handling.BREAK, "a C++ tensor hook without compiled_args runs eagerly"),
}


def dynamo_skips(hook: object) -> bool:
    """Whether Dynamo would skip (not inline) a call of ``hook``, e.g. checkpoint's unpack hook.

    Such a hook is called behind a graph break of ours instead of splitting
    the graph wherever Dynamo meets it; see [Note: Unpack hooks in the graph]
    in ca_core.
    """
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import SkipFunctionVariable

    target: object = hook
    if isinstance(hook, types.MethodType):
        target = hook.__func__
    elif not isinstance(hook, (types.FunctionType, types.BuiltinFunctionType)):
        target = getattr(type(hook), "__call__", hook)  # noqa: B004 - a callable object: Dynamo inlines __call__
    try:
        rule = trace_rules.lookup(target)
    except Exception:  # noqa: BLE001 - a callable Dynamo cannot classify is not inlined either
        return True
    return isinstance(rule, type) and issubclass(rule, SkipFunctionVariable)
