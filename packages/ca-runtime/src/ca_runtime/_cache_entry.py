"""``CacheEntry``: one node of the shadow-graph cache, the one type of both views of the cache.

``cache_info()`` lists the nodes where a backward's walk ends (a captured or a
failed backward); ``report()`` draws every node as a tree. Both read
``ca_core.cache_tree()`` (one walk of the C++ cache, ``CacheTreeNode``) and
make this type of each node.
"""

from __future__ import annotations

import dataclasses
import enum

import ca_core

__all__ = ["CacheEntry", "EagerIfFasterChoice"]


class EagerIfFasterChoice(enum.StrEnum):
    """How a cache entry's hits run: ``ca_core.EagerIfFasterChoice``, member for member; equal to its string."""

    #: No graph at this node.
    NONE = ""
    #: Its compiled graph (the default; also before and while it is timed).
    COMPILED = "compiled"
    #: The eager engine: its timing found compiled not measurably faster (``eager_if_faster``).
    EAGER = "eager"

    @classmethod
    def of(cls, eager_if_faster_choice: ca_core.EagerIfFasterChoice) -> EagerIfFasterChoice:
        return cls[eager_if_faster_choice.name.upper()]


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One node of the shadow-graph cache: a captured backward where a walk ends, or a node on the way to one."""

    #: Number of nodes on its key path (the backward's node count).
    key_path_length: int
    #: Backwards served from it since it was captured.
    hits: int
    #: Capture or compile failed here: matching backwards run eagerly.
    failed: bool
    #: Sizes that are graph inputs (changed since the first capture).
    dynamic_sizes: int
    #: All size inputs of the backward.
    sizes: int
    #: The compiler it was compiled with: ``backend:NAME`` or ``callable:ID``.
    compiler: str
    #: Why it failed (the fallback warning's reason), or "".
    failure: str
    #: What its timing chose: ``EagerIfFasterChoice.COMPILED``, ``EagerIfFasterChoice.EAGER`` (compiled
    #: was not measurably faster, see ``enable(eager_if_faster=...)``; under
    #: ``eager_if_faster=False`` it runs compiled all the same) or
    #: ``EagerIfFasterChoice.NONE`` (no graph); each equal to its string ("compiled", "eager", "").
    eager_if_faster_choice: EagerIfFasterChoice = EagerIfFasterChoice.NONE
    #: Backwards it ran on the eager engine, by that choice or to time it.
    eager_runs: int = 0
    #: Median seconds of a compiled backward in its last timing (0.0 before one).
    compiled_median_s: float = 0.0
    #: Median seconds of an eager backward in its last timing (0.0 before one).
    eager_median_s: float = 0.0
    #: Median of its last timing's per-pair ratios, compiled over eager: it runs
    #: compiled only below 0.99 (0.0 before a timing).
    compiled_over_eager: float = 0.0
    #: Holds a compiled graph (a walk ended here and compiled).
    has_graph: bool = False
    #: Its sizes stay static; see [Note: Static when dynamic fails] in ca_core.
    static_sizes: bool = False
    #: Its place in the tree: its id, and its parent's (-1 for a compiler's root).
    id: int = 0
    parent: int = -1
    #: The autograd node whose key leads here ("" for a root).
    node_name: str = ""
    #: What that node looked like (hooks, ``.grad``, saved tensors): what
    #: tells siblings of one name apart.
    node_detail: str = ""

    @classmethod
    def of(cls, node: ca_core.CacheTreeNode) -> CacheEntry:
        """The entry of one node of ``ca_core.cache_tree()``."""
        return cls(
            key_path_length=node.depth,
            hits=node.hits,
            failed=node.failed,
            dynamic_sizes=node.num_dynamic_sizes,
            sizes=node.num_sizes,
            compiler=node.compiler,
            failure=node.failure,
            eager_if_faster_choice=EagerIfFasterChoice.of(node.eager_if_faster_choice),
            eager_runs=node.eager_runs,
            compiled_median_s=node.compiled_median_s,
            eager_median_s=node.eager_median_s,
            compiled_over_eager=node.compiled_over_eager,
            has_graph=node.has_graph,
            static_sizes=node.static_sizes,
            id=node.id,
            parent=node.parent,
            node_name=node.node_name,
            node_detail=node.node_detail,
        )
