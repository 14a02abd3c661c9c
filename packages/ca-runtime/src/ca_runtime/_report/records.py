"""What the runtime records for ``ca_runtime.report()``: captures, first runs and fallbacks.

Everything here runs on the miss path only (``Runtime.capture``,
``Runtime.run_first``, ``Runtime._fallback``), never on a cache hit. A record
holds plain strings and numbers, never a tensor, hook or graph: the report must
not keep a model alive. Records live in ``RECORDER``'s log (bounded: the
latest ``REPORT_LIMIT`` captures and fallbacks).

[Note: How a node ran]
The drawing colours each node of a captured backward by how it ran. The
capture decides per node (``_capture.py``) and says so in ``Capture.handlings``;
the record only translates that, without re-deciding anything:

- TRACE is *traced*, FUNCTION a Python *Function* backward traced from the
  graph, AOT a compiled region's backward copied in (*aot*), BREAK a graph
  *break*;
- a node listed in the capture's ``graph_breaks`` (also for a retain_grad or C++
  hook on a traced node) is a *break*;
- AccumulateGrad nodes are *leaf*, nodes the backward does not need *unused*;
- every node of a backward that fell back (capture, compile or first run
  failed, then eager ran it) ran *eager*.

Hooks (tensor pre-hooks, grad_fn pre/post hooks, post-accumulate-grad hooks)
are a separate mark: a node can be traced *and* have hooks.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import ca_core
import torch

from ca_runtime._node_rules import Handling

if TYPE_CHECKING:
    from ca_runtime._capture import Capture

__all__ = [
    "RECORDER",
    "REPORT_LIMIT",
    "BreakRecord",
    "CaptureRecord",
    "FallbackRecord",
    "HookKind",
    "HookRecord",
    "LiftedInputs",
    "NodeKind",
    "NodeRecord",
    "Outcome",
    "ReasonKind",
    "Recorder",
    "ReportLog",
    "Stage",
    "begin_capture",
    "capture_built",
    "capture_compiled",
    "capture_failed",
    "describe_inputs",
    "first_run_done",
    "miss_category",
    "record_fallback",
]


#: How a node ran, in the legend's order; see [Note: How a node ran].
class NodeKind(enum.StrEnum):
    """How a node of a captured backward ran; see [Note: How a node ran]."""

    TRACED = "traced"
    AOT = "aot"
    FUNCTION = "function"
    BREAK = "break"
    EAGER = "eager"
    LEAF = "leaf"
    UNUSED = "unused"

    @property
    def description(self) -> str:
        """In the report's legend."""
        return _NODE_KIND_DESCRIPTIONS[self]


_NODE_KIND_DESCRIPTIONS = {
    NodeKind.TRACED: "traced into the compiled graph (apply_node)",
    NodeKind.AOT: "a torch.compile'd region's backward, copied into the graph",
    NodeKind.FUNCTION: "a Python autograd.Function's backward, traced from the graph",
    NodeKind.BREAK: "runs eagerly behind a graph break",
    NodeKind.EAGER: "ran on the eager engine (the backward fell back)",
    NodeKind.LEAF: "AccumulateGrad: a leaf's grad",
    NodeKind.UNUSED: "not needed by this backward",
}

#: Seconds are counted from here (the import of ca_runtime).
_T0 = time.perf_counter()
#: Longest repr of a hook, and most lifted tensors/scalars described per capture.
_MAX_REPR = 160
_MAX_LISTED = 256


class HookKind(enum.StrEnum):
    """Where a node's hook is registered, in the report's words."""

    TENSOR_PRE_PYTHON = "tensor pre-hook (python)"
    TENSOR_PRE_CPP = "tensor pre-hook (cpp)"
    TENSOR_PRE_RETAINS_GRAD = "tensor pre-hook (retains_grad)"
    TENSOR_PRE_OPAQUE = "tensor pre-hook (opaque)"
    GRAD_FN_PRE = "grad_fn pre-hook"
    GRAD_FN = "grad_fn hook"
    POST_ACCUMULATE_GRAD = "post-accumulate-grad hook"
    ACCUMULATE_GRAD_PRE = "AccumulateGrad pre-hook"
    ACCUMULATE_GRAD = "AccumulateGrad hook"


#: The report's kind of each ca_core tensor pre-hook kind.
_TENSOR_PRE_HOOK_KINDS = {
    ca_core.TensorPreHookKind.python: HookKind.TENSOR_PRE_PYTHON,
    ca_core.TensorPreHookKind.cpp: HookKind.TENSOR_PRE_CPP,
    ca_core.TensorPreHookKind.retains_grad: HookKind.TENSOR_PRE_RETAINS_GRAD,
    ca_core.TensorPreHookKind.opaque: HookKind.TENSOR_PRE_OPAQUE,
}


@dataclasses.dataclass
class HookRecord:
    """A hook of a node: its kind and, once the graph ran, its ``repr``."""

    kind: HookKind
    #: Index in the hooks list the graph gets (a Python object), or None (a C++ hook).
    index: int | None = None
    repr: str = ""


@dataclasses.dataclass
class NodeRecord:
    """One autograd node of a captured backward."""

    index: int
    name: str
    type_name: str
    sequence_nr: int
    needed: bool
    is_leaf: bool
    #: Walk indices of the nodes its output grads flow to.
    edges: list[int]
    hooks: list[HookRecord] = dataclasses.field(default_factory=list)
    #: How it ran; see [Note: How a node ran].
    kind: NodeKind = NodeKind.TRACED
    #: How it ran, in words (a break's reason, where a leaf was accumulated).
    detail: str = ""


@dataclasses.dataclass
class BreakRecord:
    """One call of a captured graph that runs eagerly behind a graph break."""

    node_index: int
    node_name: str
    reason: str


@dataclasses.dataclass
class LiftedInputs:
    """The inputs a captured graph takes: counts at capture, descriptions after the first run."""

    num_tensors: int
    num_sizes: int
    num_dynamic_sizes: int
    num_scalars: int
    num_hooks: int = 0
    #: ``float32[4, 8]`` per lifted tensor (the first _MAX_LISTED), from the first run.
    tensors: list[str] = dataclasses.field(default_factory=list)
    scalars: list[str] = dataclasses.field(default_factory=list)


class Stage(enum.StrEnum):
    """A step of a capture: what the report times (``seconds``) and where a capture failed."""

    #: Building the FX graph from the walked nodes (build_graph_module).
    CAPTURE = "capture"
    #: The compiler_fn call.
    COMPILE = "compile"
    #: The compiled graph's first call (where torch.compile compiles, lazily).
    FIRST_RUN = "first_run"

    @property
    def label(self) -> str:
        """In the report's words."""
        return _STAGE_LABELS[self]


_STAGE_LABELS = {Stage.CAPTURE: "capture", Stage.COMPILE: "compiler_fn", Stage.FIRST_RUN: "first run"}


class ReasonKind(enum.StrEnum):
    """What the report counts reasons of (its "Top ... reasons" tables), in their order."""

    BREAK = "break"
    FALLBACK = "fallback"
    MISS = "miss"

    @property
    def heading(self) -> str:
        """The report's title of its table."""
        return _REASON_HEADINGS[self]


_REASON_HEADINGS = {
    ReasonKind.BREAK: "Top graph-break reasons",
    ReasonKind.FALLBACK: "Top fallback reasons",
    ReasonKind.MISS: "Top miss reasons",
}


class Outcome(enum.StrEnum):
    """How far a capture got."""

    CAPTURING = "capturing"
    #: compiler_fn returned a callable.
    COMPILED = "compiled"
    #: Its first run succeeded.
    RAN = "ran"
    FAILED = "failed"


@dataclasses.dataclass
class CaptureRecord:
    """One call of ``Runtime.capture``: a backward captured (or not) into an FX graph."""

    id: int
    #: Seconds since ca_runtime was imported.
    at_s: float
    compiler: str
    #: The cache_tree() id of the entry the graph is stored at.
    entry_id: int
    thread: str
    nodes: list[NodeRecord]
    #: Walk index of the node where this backward left the cached paths, or
    #: None (the first capture of this backward); see [Note: Explained misses] in ca_core.
    miss_node: int | None
    miss_reason: str
    create_graph: bool
    lifted: LiftedInputs
    code: str = ""
    breaks: list[BreakRecord] = dataclasses.field(default_factory=list)
    #: build_graph_module, the compiler_fn call, and the first run of the
    #: compiled graph (where torch.compile compiles, lazily); None: not reached.
    capture_s: float | None = None
    compile_s: float | None = None
    first_run_s: float | None = None
    outcome: Outcome = Outcome.CAPTURING
    #: Where it failed and why.
    failure_stage: Stage | None = None
    failure: str = ""
    #: Walk index of the node the capture could not take, or None.
    failed_node: int | None = None
    #: The backward ran on the eager engine instead (a fallback was reported).
    ran_eagerly: bool = False


@dataclasses.dataclass
class FallbackRecord:
    """One backward that ran wholly on the eager engine, with the warning's reason."""

    id: int
    at_s: float
    compiler: str
    #: What failed: a node name, "capture", "compiler_fn" or "compiled graph".
    where: str
    reason: str
    #: The CaptureRecord it belongs to, or None (the walk failed: nothing was captured).
    capture_id: int | None = None


#: Captures (and fallbacks) ``report()`` shows: the latest ones.
REPORT_LIMIT = 200


class ReportLog:
    """What ``ca_runtime.report()`` shows, recorded on the miss path.

    The latest ``REPORT_LIMIT`` capture and fallback records, plus totals that
    count every one since the last reset: seconds per stage and how often each
    (normalised) break, fallback and miss reason occurred.
    """

    def __init__(self) -> None:
        self.captures: deque[CaptureRecord] = deque(maxlen=REPORT_LIMIT)
        self.fallbacks: deque[FallbackRecord] = deque(maxlen=REPORT_LIMIT)
        #: Records made since the reset (the deques keep the latest).
        self.num_captures = 0
        self.num_fallbacks = 0
        #: Seconds spent per stage.
        self.seconds: dict[Stage, float] = {}
        #: Per kind ("break", "fallback", "miss"): how often each reason occurred.
        self.reasons: dict[ReasonKind, Counter[str]] = {}


class Recorder:
    """The report's log of the runtime's events (captures, first runs, fallbacks), under its own lock.

    The runtime tells it what happened through this module's functions
    (``begin_capture``, ``capture_built``, ``capture_compiled``,
    ``capture_failed``, ``first_run_done``, ``record_fallback``); ``report()``
    reads a ``snapshot()``; ``ca_runtime.reset()`` starts a new log.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The current log; replaced whole by reset().
        self.log = ReportLog()

    def add_capture_record(self, record: CaptureRecord) -> None:
        """Stores ``record`` (its id is set here); the oldest one goes beyond REPORT_LIMIT."""
        with self._lock:
            log = self.log
            log.num_captures += 1
            record.id = log.num_captures
            log.captures.append(record)

    def add_fallback_record(self, record: FallbackRecord) -> None:
        with self._lock:
            log = self.log
            log.num_fallbacks += 1
            record.id = log.num_fallbacks
            log.fallbacks.append(record)

    def add_seconds(self, stage: Stage, seconds: float) -> None:
        with self._lock:
            seconds_by_stage = self.log.seconds
            seconds_by_stage[stage] = seconds_by_stage.get(stage, 0.0) + seconds

    def count_reasons(self, kind: ReasonKind, reasons: Iterable[str]) -> None:
        with self._lock:
            self.log.reasons.setdefault(kind, Counter()).update(reasons)

    def snapshot(self) -> ReportLog:
        """A copy of the log (the records themselves are shared, not copied)."""
        with self._lock:
            log = self.log
            copy = ReportLog()
            copy.captures = deque(log.captures, maxlen=log.captures.maxlen)
            copy.fallbacks = deque(log.fallbacks, maxlen=log.fallbacks.maxlen)
            copy.num_captures, copy.num_fallbacks = log.num_captures, log.num_fallbacks
            copy.seconds = dict(log.seconds)
            copy.reasons = {kind: Counter(counts) for kind, counts in log.reasons.items()}
            return copy

    def reset(self) -> None:
        """A new, empty log (bounded at the current REPORT_LIMIT)."""
        with self._lock:
            self.log = ReportLog()


#: The one recorder: what report() shows.
RECORDER = Recorder()


def _now() -> float:
    return time.perf_counter() - _T0


def _hooks_of(node: ca_core.NodeInfo) -> list[HookRecord]:
    hooks = [
        HookRecord(
            _TENSOR_PRE_HOOK_KINDS[hook.kind],
            hook.hook if hook.kind is ca_core.TensorPreHookKind.python else None,
        )
        for hook in node.tensor_pre_hooks
    ]
    hooks += [HookRecord(HookKind.GRAD_FN_PRE, i) for i in node.pre_hooks]
    hooks += [HookRecord(HookKind.GRAD_FN, i) for i in node.post_hooks]
    hooks += [HookRecord(HookKind.POST_ACCUMULATE_GRAD, i) for i in node.post_acc_grad_hooks]
    # Hooks of a leaf's real AccumulateGrad node run in C++ (see [Note: Leaf node hooks] in ca_core).
    if node.is_accumulate_grad:
        hooks += [HookRecord(HookKind.ACCUMULATE_GRAD_PRE)] * node.num_grad_fn_pre_hooks
        hooks += [HookRecord(HookKind.ACCUMULATE_GRAD)] * node.num_grad_fn_post_hooks
    return hooks


def begin_capture(graph: ca_core.BackwardGraph, compiler: str) -> CaptureRecord:
    """A record of a capture starting now; stored at once, filled in as the capture goes on."""
    nodes = [
        NodeRecord(
            index=node.index,
            name=node.name,
            type_name=node.type_name,
            sequence_nr=node.sequence_nr,
            needed=node.needed,
            is_leaf=node.is_accumulate_grad,
            edges=[edge[0] for edge in node.next_edges if edge is not None],
            hooks=_hooks_of(node),
            kind=NodeKind.UNUSED
            if not node.needed
            else NodeKind.LEAF
            if node.is_accumulate_grad
            else NodeKind.TRACED,
        )
        for node in graph.nodes
    ]
    record = CaptureRecord(
        id=0,
        at_s=_now(),
        compiler=compiler,
        entry_id=graph.entry_id,
        thread=threading.current_thread().name,
        nodes=nodes,
        miss_node=graph.miss_node,
        miss_reason=graph.miss_reason,
        create_graph=graph.create_graph,
        lifted=LiftedInputs(
            num_tensors=graph.num_tensors,
            num_sizes=graph.num_sizes,
            num_dynamic_sizes=sum(graph.dynamic_sizes),
            num_scalars=graph.num_scalars,
        ),
    )
    RECORDER.add_capture_record(record)
    RECORDER.count_reasons(ReasonKind.MISS, [miss_category(graph.miss_node, graph.miss_reason)])
    return record


def miss_category(miss_node: int | None, miss_reason: str) -> str:
    """A miss reason without its numbers, to count alike misses together.

    ``a size SumBackward0 (node 1) saved in the forward (#0) changed from 4
    to 8 and is now dynamic`` -> ``a size changed and is now dynamic``;
    ``a hook was added to its Python tensor hooks (1 now, 0 in the cached
    graph)`` -> ``a hook was added to its Python tensor hooks``.
    """
    if miss_node is None:
        return "first capture of this backward (no cached graph on its path)"
    parts: list[str] = []
    for reason in miss_reason.split("; "):
        if reason.startswith("and "):
            continue
        size_change = re.match(r".* changed from -?\d+ to -?\d+(.*)", reason)
        part = "a size changed" + size_change.group(1) if size_change else reason
        part = re.sub(r"\(node \d+\)|\(#\d+\)|#\d+|\(\d+ now, \d+ in the cached graph\)", "", part)
        part = re.sub(r"\s+", " ", part).strip()
        if part not in parts:
            parts.append(part)
    return "; ".join(parts) or "a specialised value changed"


#: How a node ran in the report, by how the capture took it.
_KIND_OF_HANDLING: dict[Handling, NodeKind] = {
    Handling.TRACE: NodeKind.TRACED,
    Handling.FUNCTION: NodeKind.FUNCTION,
    Handling.AOT: NodeKind.AOT,
    Handling.BREAK: NodeKind.BREAK,
}


def capture_built(record: CaptureRecord, captured: Capture, seconds: float) -> None:
    """The FX graph is built: its code, breaks and how each node runs ([Note: How a node ran])."""
    record.capture_s = seconds
    record.code = captured.graph_module.code
    record.breaks = [BreakRecord(b.node_index, b.node_name, b.reason) for b in captured.graph_breaks]
    breaks: dict[int, list[str]] = {}
    for brk in captured.graph_breaks:
        breaks.setdefault(brk.node_index, []).append(brk.reason)
    leaf_outputs = dict(zip(captured.leaf_outputs, captured.leaf_hooks_only))
    for node in record.nodes:
        if not node.needed:
            continue
        reasons = breaks.get(node.index, [])
        if node.is_leaf:
            if node.index in leaf_outputs and not leaf_outputs[node.index]:
                node.detail = "accumulated after the graph by its AccumulateGrad node"
            elif not reasons:
                node.detail = "accumulated inside the graph"
        elif node.index in captured.handlings:
            node.kind = _KIND_OF_HANDLING.get(captured.handlings[node.index], node.kind)
        if reasons:
            ran = "" if node.is_leaf else f"the node is {node.kind}; "
            node.kind = NodeKind.BREAK
            node.detail = ran + "; ".join(reasons)
    RECORDER.add_seconds(Stage.CAPTURE, seconds)
    RECORDER.count_reasons(ReasonKind.BREAK, (b.reason for b in record.breaks))


def capture_compiled(record: CaptureRecord, seconds: float) -> None:
    """``compiler_fn`` returned a callable after ``seconds``."""
    record.compile_s = seconds
    record.outcome = Outcome.COMPILED
    RECORDER.add_seconds(Stage.COMPILE, seconds)


def capture_failed(record: CaptureRecord, stage: Stage, reason: str, node: int | None = None) -> None:
    """The capture, the compiler_fn or the first run failed."""
    record.outcome = Outcome.FAILED
    record.failure_stage = stage
    record.failure = reason
    record.failed_node = node


def _describe_tensor(value: object) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    dtype = str(value.dtype).removeprefix("torch.")
    device = "" if value.device.type == "cpu" else f" {value.device}"
    return f"{dtype}{list(value.shape)}{device}"


def _safe_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user object's repr must not break the backward
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def describe_inputs(inputs: Sequence[object]) -> list[str]:
    """The lifted tensors as the report lists them (the first ones), taken before the graph consumes them."""
    return [_describe_tensor(t) for t in inputs[:_MAX_LISTED]]


def first_run_done(
    record: CaptureRecord,
    seconds: float,
    described_inputs: list[str],
    scalars: Sequence[object],
    hooks: Sequence[object],
    failure: str = "",
) -> None:
    """The compiled graph's first call (lazy compilers compile here) took ``seconds``.

    The inputs are at hand only now, so the lifted tensors (``describe_inputs``)
    and the hooks are described here.
    """
    record.first_run_s = seconds
    RECORDER.add_seconds(Stage.FIRST_RUN, seconds)
    record.lifted.num_hooks = len(hooks)
    record.lifted.tensors = described_inputs
    record.lifted.scalars = [_safe_repr(s) for s in scalars[:_MAX_LISTED]]
    for node in record.nodes:
        for hook in node.hooks:
            if hook.index is not None and 0 <= hook.index < len(hooks):
                hook.repr = _safe_repr(hooks[hook.index])
    if failure:
        capture_failed(record, Stage.FIRST_RUN, failure)
    else:
        record.outcome = Outcome.RAN


def record_fallback(compiler: str, where: str, reason: str, capture: CaptureRecord | None) -> None:
    """A backward ran on the eager engine (``EagerFallbackWarning``); ``capture`` is its record, if any."""
    if capture is not None:
        capture.ran_eagerly = True
        for node in capture.nodes:
            if node.needed:
                node.detail = f"planned: {node.kind}" + (f" ({node.detail})" if node.detail else "")
                node.kind = NodeKind.EAGER
    RECORDER.add_fallback_record(
        FallbackRecord(0, _now(), compiler, where, reason, None if capture is None else capture.id)
    )
    RECORDER.count_reasons(ReasonKind.FALLBACK, [f"{where}: {reason}"])
