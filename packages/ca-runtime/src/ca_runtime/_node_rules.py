"""How each kind of autograd node is captured: a data table, not an if chain.

A rule matches a node's demangled C++ type (``NodeInfo.type_name``) with an
``fnmatch`` pattern; the first matching rule wins and the default is to trace
the node through ``apply_with_saved``.
"""

from __future__ import annotations

import enum
import fnmatch
from dataclasses import dataclass

import ca_core

__all__ = ["Handling", "NodeRule", "NODE_RULES", "rule_for"]


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
    NodeRule("torch::autograd::AccumulateGrad", Handling.ACCUMULATE),
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


def rule_for(node: ca_core.NodeInfo) -> NodeRule:
    """The first rule whose pattern matches ``node.type_name``."""
    for rule in NODE_RULES:
        if fnmatch.fnmatchcase(node.type_name, rule.pattern):
            return rule
    return _DEFAULT
