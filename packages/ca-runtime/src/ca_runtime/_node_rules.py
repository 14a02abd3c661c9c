"""How each kind of autograd node is captured: a data table, not an if chain.

A rule matches a node's demangled C++ type (``NodeInfo.type_name``) with an
``fnmatch`` pattern; the first matching rule wins and the default is to trace
the node through ``apply_with_saved``. AccumulateGrad is not a row: ca_core
decides which nodes it applies after the graph (``NodeInfo.is_accumulate_grad``)
and the capture must follow that same flag.
"""

from __future__ import annotations

import enum
import fnmatch
from dataclasses import dataclass

import ca_core

__all__ = ["HOOK_RULES", "Handling", "NodeRule", "NODE_RULES", "rule_for", "unsupported_hooks"]


class Handling(enum.Enum):
    """What the capture does with a node."""

    #: ``apply_with_saved`` + ``validate_outputs`` calls in the graph.
    TRACE = "trace"
    #: Its input grad becomes a graph output; ca_core applies the real node afterwards.
    ACCUMULATE = "accumulate"
    #: Cannot be captured yet: the whole backward runs on the eager engine.
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class NodeRule:
    """One row of the table."""

    pattern: str
    handling: Handling
    reason: str = ""


NODE_RULES: tuple[NodeRule, ...] = (
    NodeRule(
        "torch::autograd::PyNode",
        Handling.UNSUPPORTED,
        "the backward of a Python torch.autograd.Function is not captured yet",
    ),
    NodeRule(
        "torch::autograd::CppNode<*>",
        Handling.UNSUPPORTED,
        "the backward of a C++ torch::autograd::Function is not captured yet",
    ),
)

_DEFAULT = NodeRule("*", Handling.TRACE)
_ACCUMULATE = NodeRule("torch::autograd::AccumulateGrad", Handling.ACCUMULATE)


def rule_for(node: ca_core.NodeInfo) -> NodeRule:
    """ACCUMULATE for ca_core's AccumulateGrad nodes, else the first rule whose pattern matches."""
    if node.is_accumulate_grad:
        return _ACCUMULATE
    for rule in NODE_RULES:
        if fnmatch.fnmatchcase(node.type_name, rule.pattern):
            return rule
    return _DEFAULT


#: Per hook kind (``NodeInfo.hooks``): supported, or the reason it is not yet.
#: post_acc_grad hooks run inside the real AccumulateGrad node, as in eager.
HOOK_RULES: dict[str, str | None] = {
    "post_acc_grad": None,
    "tensor_pre": "tensor hooks (Tensor.register_hook) are not captured yet",
    "cpp_tensor_pre": "C++ tensor hooks and retain_grad() are not captured yet",
    "pre": "grad_fn pre-hooks are not captured yet",
    "post": "grad_fn hooks are not captured yet",
    "saved_tensor": "saved-tensor hooks are not captured yet",
}


def unsupported_hooks(node: ca_core.NodeInfo) -> str | None:
    """Why a hook on ``node`` prevents capture, or None when all its hooks are supported."""
    for kind in node.hooks:
        reason = HOOK_RULES.get(kind, f"{kind} hooks are not known to ca_runtime")
        if reason is not None:
            return reason
    return None
