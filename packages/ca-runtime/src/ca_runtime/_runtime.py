"""The object ca_core's engine hook calls back into.

[Note: Capture methods]
ca_core calls exactly these methods, all on a cache miss, a first run or a
failure, never on a cache hit (typed as ``ca_core.runtime_protocol.EngineRuntime``,
which mypy checks ``Runtime`` against):

- ``capture(graph)``: build the FX graph of a walked backward and compile it
  with ``compiler_fn`` (its runs of nodes fused, see _node_runs.py); return a
  ``ca_core.CapturedGraph`` (``compiled``, ``leaf_outputs``, ``leaf_hooks_only``,
  ``free_early``, ``eager_if_faster_allowed``) -- the compiled callable, the walk index of each AccumulateGrad
  node whose grad the graph returns, per such node whether the graph
  accumulated it already (only its grad_fn post hooks are left to run),
  the nodes whose saved tensors may be dropped before a cache hit runs (see
  [Note: Saved tensors freed early] in ca_core), and whether its hits may
  run on the eager engine where that measures faster (see
  [Note: Eager if faster] in ca_core (eager_if_faster.h)) -- or None to run this
  backward (and every later one with the same key path) eagerly.
- ``run_first(compiled, inputs, sizes, scalars, hooks, dynamic_dims)``: the
  first call of a freshly compiled graph, where lazy compilers
  (``torch.compile``) do their work, after marking the dynamic sizes and the
  tensor dims that changed (``dynamic_dims``) dynamic; return its outputs, or
  None if it failed, with ``last_failure`` saying why: ca_core then runs the
  backward eagerly and calls ``report_fallback`` (and marks the entry failed)
  only if eager succeeds; an error eager raises too was the user's and leaves
  the entry usable. An exception raised by user code the graph calls (a
  hook, a Function's backward) is re-raised at once, unchanged (see
  [Note: User errors are tagged] in _graph_ops.py).
- ``take_compiling()``: right after a first run that succeeded, a callable
  that says whether the kernels that run started compiling in the background
  are ready, or None; see [Note: Eager while compiling] in ca_core and
  [Note: Compiling in the background] in _background.py. Optional: a runtime
  without it compiles nothing in the background.
- ``report_eager_if_faster(entry_id, eager, compiled_s, eager_s, compiled_over_eager)``: a cache entry has
  timed its hits both ways and chose (logged at INFO). Optional, as is the
  attribute ``eager_if_faster`` that ca_core reads at install (absent: off).
- ``report_fallback(node, reason)``: ca_core could not even walk the graph.
- ``defer_capture(sightings)``: asked before each capture; True runs this
  backward eagerly and captures later (see [Note: Which captures wait]).
- ``proxy_call_backward(...)``: torch's PyNode calls this on the installed
  compiler object when a Python Function's node is applied through
  ``apply_with_saved`` (only behind a graph break, see
  [Note: Python Functions in the graph]); it runs the backward.

Each failure warns once (``EagerFallbackWarning``) naming the node and the
reason; ca_core counts it and remembers the failing key path. Each graph break
is counted, and logged (logger ``ca_runtime``, INFO) and warned
(``GraphBreakWarning``) once per node name and reason. Each capture, first run
and fallback is also recorded for ``ca_runtime.report()`` (``_report/records.py``),
with the time each stage took.
"""

from __future__ import annotations

import dis
import functools
import inspect
import logging
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ca_core
import torch

from ca_runtime._aot import is_aot_backward
from ca_runtime._background import compiles_done, take_started
from ca_runtime._backward_inductor_options import backward_inductor_options
from ca_runtime._capture import UnsupportedNode, build_graph_module
from ca_runtime._compiler_key import compiler_name, note_first_capture
from ca_runtime._dynamo_direct import collecting_tracing_cycles, wrap_if_dynamo_module
from ca_runtime._graph_ops import call_user, user_error_behind
from ca_runtime._log import (
    EagerFallbackWarning,
    GraphBreakWarning,
    describe_error,
    log,
    miss_log,
    warn_at_user_line,
)
from ca_runtime._node_runs import fuse_node_runs
from ca_runtime._report import records
from ca_runtime._state import STATE
from ca_runtime._torch_interop import (
    FakeBackwardCFunction,
    call_backward,
    compiles_with_dynamo_eager,
    forget_metric_stacks,
    forget_sources_with,
    is_plain_torch_compile_of,
    maybe_mark_dynamic,
    release_dynamo_state_with,
    set_locals_to_steal,
    sources_made,
    warnings_ignored_while_dynamo_compiles,
)

__all__ = ["Runtime", "last_graph"]


def last_graph() -> torch.fx.GraphModule | None:
    """The FX graph of the most recent capture (``print(last_graph().code)``), or None."""
    return STATE.last_graph


CompilerFn = Callable[[torch.fx.GraphModule], Callable[..., Any]]


class _CompiledOutputError(TypeError):
    """A compiled graph's first run returned something else than its outputs; see [Note: What a compiled graph returns]."""


def _what(value: object) -> str:
    """A returned value in a message: ``None``, ``a list of 0 values``, ``an int``."""
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} values"
    name = type(value).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _in_multi_process_group() -> bool:
    """A process group of more than one rank is running: see [Note: Eager if faster] in ca_core (eager_if_faster.h).

    Each rank's timing would include its waits for the others, and the ranks
    would choose apart; their graphs stay compiled.
    """
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


# [Note: create_graph=True graphs stay differentiable]
# A backward with create_graph=True returns grads that carry a graph of their
# own, and a program may differentiate that graph again with create_graph=True:
# torch.autograd.functional.hessian and hvp, a third derivative, a PINN whose
# second derivative comes from its first. In eager that works to any order.
# A graph compiled through AOTAutograd (the "aot_eager" and "inductor"
# backends) records one CompiledFunctionBackward node for the whole graph,
# and AOTAutograd's backward is not differentiable: a create_graph=True
# backward through it raises "torch.compile with aot_autograd does not
# currently support double backward". Which grads a program will
# differentiate how often is not known when their graph is captured, so a
# create_graph=True graph that compiler_fn would hand to an AOTAutograd
# backend is compiled with Dynamo's "eager" backend instead: Dynamo traces
# it and runs its ops as they are, so autograd records eager's nodes, which
# later backwards capture and compile like any others (a create_graph=False
# backward through them is compiled with compiler_fn). What compiler_fn
# returned decides: a torch.compile result whose backend is any other than
# Dynamo's "eager" (a backend of the user's own may call AOTAutograd too;
# compile_in_background's is Inductor) is replaced by one with "eager"; any
# other callable is used as it is, so a compiler_fn that calls AOTAutograd
# without torch.compile keeps the limit (README, Known differences). A
# torch.compile'd region of the user's own stays once differentiable, as in
# eager (see [Note: AOT backwards] in _aot.py).


def _once_differentiable(compiled: object) -> bool:
    """Whether ``compiled`` may run its graph through AOTAutograd; see [Note: create_graph=True graphs stay differentiable]."""
    return compiles_with_dynamo_eager(compiled) is False


def _compiled_form(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """What compiler_fn gets: ``gm`` with its runs of nodes fused (see _node_runs.py).

    A fusion that fails (a bug of ours) leaves the graph as captured, which
    computes the same.
    """
    try:
        return fuse_node_runs(gm)
    except Exception:  # noqa: BLE001 - the captured graph is as correct, only slower as Python
        log.debug("runs of nodes left unfused", exc_info=True)
        return gm


# [Note: Graphs of a backward inside a vmap]
# A backward inside a vmap (``autograd.grad(is_grads_batched=True)``, which
# runs the engine under torch's legacy vmap, or ``autograd.grad`` inside
# ``torch.func.vmap``) hands its graph batched tensors. Dynamo cannot make
# fake tensors of them ("meta converter nyi"): torch.compile's first call
# logs a warning per frame it tries and runs the frame as plain Python. So
# where the compiler_fn returns ``torch.compile(gm)`` (every backend name
# does), such a graph is kept as the GraphModule and run as it is: the same
# ops, with no Dynamo trace that cannot succeed and nothing logged. A
# compiler_fn that returns anything else is called and used as always.
# ca_core keys these backwards apart from the same graph outside a vmap
# ([Note: Backwards inside a vmap] in graph_walk.cpp), so a graph compiled
# outside one never sees batched tensors; the walk's reading, the one that
# key holds, is ``BackwardGraph.inside_a_vmap``, and it is the only one the
# capture reads (the CopySlices row of _node_rules.py too).


#: The file of torch.autograd.gradcheck and gradgradcheck; see [Note: Which captures wait].
_GRADCHECK_FILE = torch.autograd.gradcheck.__code__.co_filename


def _inside_gradcheck() -> bool:
    """Whether this thread's Python stack runs gradcheck or gradgradcheck; see [Note: Which captures wait]."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _GRADCHECK_FILE:
            return True
        frame = frame.f_back
    return False


#: Names whose use in a hook's code may change other nodes' hooks; see [Note: Which captures wait].
_HOOK_CHANGES = frozenset(
    {
        "register_hook",
        "register_prehook",
        "register_post_accumulate_grad_hook",
        "register_multi_grad_hook",
        "remove",
    }
)


#: How many functions the look at one graph's hook code follows at most; see [Note: Which captures wait].
_MAX_FUNCTIONS_FOLLOWED = 64


class _HookCodeScan:
    """The look at the code a graph's hooks run: theirs, code defined in it, and the functions it calls by name.

    A called function is followed when the name resolves, without running
    anything, to a Python function: a global of the calling function's
    module, a function or bound method in its closure, or (for a bound
    method's code) a method of its object's class; with
    ``follow_held_objects``, also a method of an object such a name holds
    (``helper.swap()``, looked up on the object's class, never on the
    instance) or a function of a module such a name holds (``mod.swap()``),
    neither torch's nor the standard library's (see ``_attributes_named``).
    At most ``_MAX_FUNCTIONS_FOLLOWED`` functions, each once, and
    ``_MAX_ATTRIBUTE_LOOKUPS`` lookups of held objects' attributes.
    """

    def __init__(self, follow_held_objects: bool) -> None:
        self.seen: set[types.CodeType] = set()
        self.follow_held_objects = follow_held_objects
        self.lookups_left = _MAX_ATTRIBUTE_LOOKUPS

    def function_names_a_hook_change(self, function: types.FunctionType, owner: type | None = None) -> bool:
        closure = tuple(cell.cell_contents for cell in function.__closure__ or () if _cell_has_contents(cell))
        return self.code_names_a_hook_change(function.__code__, function.__globals__, closure, owner)

    def code_names_a_hook_change(
        self,
        code: types.CodeType,
        globals_: dict[str, Any],
        closure: tuple[object, ...] = (),
        owner: type | None = None,
    ) -> bool:
        if code in self.seen:
            return False
        self.seen.add(code)
        if not _HOOK_CHANGES.isdisjoint(code.co_names):
            return True
        for const in code.co_consts:
            if isinstance(const, types.CodeType) and self.code_names_a_hook_change(
                const, globals_, (), owner
            ):
                return True
        global_names, attribute_names = _names_loaded(code)
        named = [globals_.get(name) for name in global_names]
        named += closure
        # (what a name resolves to, the class whose methods its code may call, reached through a held object)
        called: list[tuple[object, type | None, bool]] = [(value, owner, False) for value in named]
        if owner is not None:
            called += [(inspect.getattr_static(owner, name, None), owner, False) for name in attribute_names]
        if self.follow_held_objects:
            for value in {id(v): v for v in named}.values():
                found = _attributes_named(value, attribute_names, self.lookups_left)
                self.lookups_left -= len(found)  # one lookup per name read; none for an object skipped
                called += [(target, target_owner, True) for target, target_owner in found]
        for target, target_owner, via_held_object in called:
            function: object
            function_owner: type | None
            if isinstance(target, types.MethodType):
                function, function_owner = target.__func__, type(target.__self__)
            elif isinstance(target, (staticmethod, classmethod)):
                function, function_owner = target.__func__, target_owner
            else:
                function, function_owner = target, target_owner
            if not isinstance(function, types.FunctionType) or function.__code__ in self.seen:
                continue
            if via_held_object and _torch_or_stdlib(function.__module__):
                continue
            if len(self.seen) >= _MAX_FUNCTIONS_FOLLOWED:
                return False
            if self.function_names_a_hook_change(function, function_owner):
                return True
        return False


#: How many attributes of held objects one look reads at most; see _HookCodeScan.
_MAX_ATTRIBUTE_LOOKUPS = 4096

#: The descriptor of a module's namespace, read without a subclass's code.
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]


def _attributes_named(value: object, names: list[str], budget: int) -> list[tuple[object, type | None]]:
    """What ``value.name`` is, for each of ``names``, where that reads no code: a module's
    own attribute, or what an object's class holds under that name (with that
    class, as its owner). Nothing once ``budget`` lookups are spent.

    Every read is static (``inspect.getattr_static``): no ``__getattr__``,
    property or proxy of the user's runs. Objects and modules of torch or the
    standard library (builtins included) are not followed this way, nor are
    functions of theirs found through another object: an optimizer's
    ``step`` or a scheduler called from a post-accumulate-grad hook (torch's
    documented optimizer-in-backward) changes no hooks, and its code calls
    ``list.remove``/``set.remove``, which a look at names alone cannot tell
    from a handle's ``remove`` (following it would run the first backward of
    every such training loop eagerly); and a ``logger.debug`` in FSDP's
    hooks would lead the look through ``logging`` and ``traceback`` (10 ms
    a look, for code that registers no hooks).
    """
    if budget < len(names):
        return []
    if isinstance(value, types.ModuleType):
        # ModuleType's own __dict__ slot: a subclass's __dict__ property is not run.
        attributes = _MODULE_DICT.__get__(value)
        if not isinstance(attributes, dict) or _torch_or_stdlib(attributes.get("__name__")):
            return []
        return [(attributes.get(name), None) for name in names]
    cls = type(value)
    if _torch_or_stdlib(inspect.getattr_static(cls, "__module__", None)) or isinstance(
        value, (type, types.FunctionType, types.MethodType)
    ):
        return []
    return [(inspect.getattr_static(cls, name, None), cls) for name in names]


def _torch_or_stdlib(module: object) -> bool:
    """Whether a module name is torch's or the standard library's (builtins included)."""
    if not isinstance(module, str):
        return False
    top = module.partition(".")[0]
    return top == "torch" or top in sys.stdlib_module_names


def _names_loaded(code: types.CodeType) -> tuple[list[str], list[str]]:
    """The names ``code`` loads as globals, and those it loads as attributes (``x.name``), each once, in order."""
    global_names: dict[str, None] = {}
    attribute_names: dict[str, None] = {}
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            global_names[instruction.argval] = None
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            attribute_names[instruction.argval] = None
    return list(global_names), list(attribute_names)


def _cell_has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _functions_run_by(obj: object) -> Iterator[tuple[types.FunctionType, type | None]]:
    """The Python functions calling ``obj`` runs first, each with the class whose methods it may call by name.

    A function's own, a bound method's (its object's class), a partial's
    function, a callable instance's ``__call__`` (its class), a Python
    Function ctx's backward and vjp (the Function's class).
    """
    forward_cls = getattr(type(obj), "_forward_cls", None)
    if forward_cls is not None:
        for name in ("backward", "vjp"):
            method = inspect.getattr_static(forward_cls, name, None)
            function = getattr(method, "__func__", method)
            if isinstance(function, types.FunctionType):
                yield function, forward_cls
        return
    while isinstance(obj, functools.partial):
        obj = obj.func
    if isinstance(obj, types.MethodType):
        function, owner = obj.__func__, type(obj.__self__)
    elif isinstance(obj, types.FunctionType):
        function, owner = obj, None
    elif callable(obj) and not isinstance(obj, type):
        function, owner = inspect.getattr_static(type(obj), "__call__", None), type(obj)
    else:
        return
    if isinstance(function, types.FunctionType):
        yield function, owner


def _function_naming_a_hook_change(hooks: Sequence[object]) -> str | None:
    """Which code the graph would call names a hook registration or removal, or None; see [Note: Which captures wait].

    The answer is the qualified name of the hook or Function backward whose
    code, or code it calls, names one. Two looks: the names that resolve
    directly first, then with held objects' methods and modules' functions
    too (``_HookCodeScan``), each with its own bound, so that a library
    reached through an object cannot spend the bound before a function the
    hook calls by name is read. The look runs inside a backward on whatever
    the hooks hold: if it fails on an object it cannot read, the hooks are
    taken as ones that may change hooks (they then run on the eager engine,
    which is eager's answer), never raised.
    """
    try:
        for scan in (_HookCodeScan(follow_held_objects=False), _HookCodeScan(follow_held_objects=True)):
            for obj in hooks:
                for function, owner in _functions_run_by(obj):
                    if scan.function_names_a_hook_change(function, owner):
                        return f"{function.__module__}.{function.__qualname__}"
    except Exception as e:  # noqa: BLE001 - see the docstring: a look that fails answers "may change"
        return f"a hook whose code could not be read ({type(e).__name__})"
    return None


class Runtime:
    """Serves one ``enable()`` context: its compiler and its last captured graph."""

    def __init__(self, compiler_fn: CompilerFn, shown_as: object = None) -> None:
        #: What the user passed to ``enable()``: a backend name or their callable.
        self.compiler_fn: object = compiler_fn if shown_as is None else shown_as
        #: The callable each captured graph is compiled with (a backend name resolved).
        self._compile = compiler_fn
        #: The reason of the last fallback warned about; ca_core stores it on
        #: the failed cache entry (``cache_info()``).
        self.last_failure = ""
        #: Which cache it serves; see [Note: One cache per compiler] in ca_core.
        self.compiler_key = "default"
        #: Read by ca_core at install: cache entries may serve their hits on
        #: the eager engine where it measures faster (``enable(eager_if_faster=)``).
        self.eager_if_faster = False
        #: A key path is captured on its capture_after-th backward (``enable(capture_after=)``);
        #: see [Note: Which captures wait].
        self.capture_after = 2
        #: Per thread: the report record of the capture whose first run is due
        #: (``pending``) or failed (``failed_first_run``); see _report/records.py.
        self._records = threading.local()

    def defer_capture(
        self, sightings: int, hooks: Sequence[object], sizes_changed: bool = False
    ) -> bool | str:
        """[Note: Which captures wait]
        Whether a backward at a cache entry without a graph runs eagerly
        instead of being captured now (see [Note: Deferred captures] in
        ca_core, which counts ``sightings``, the backwards the entry deferred
        before; ``hooks`` are the Python objects its graph would call;
        ``sizes_changed``: this backward's sizes differ from the last deferred
        one's). Four rules, all reading nothing that varies between runs of a
        program:

        - ``enable(capture_after=N)``: a key path is captured on its N-th
          backward; the N - 1 before run eagerly. The default, 2, serves
          programs whose backwards mostly run once (gradcheck over a
          routine, an evaluation script, a notebook trying models) without
          slowing a loop: a graph that comes back is captured the second
          time, so a training loop pays one eager step per graph (the
          capture is paid once either way), and a backward that never comes
          back costs what eager's does. 1 captures at once (ca_testkit's
          differential runs do; see [Note: Differential runs capture at
          once] in ca_testkit).
        - A sighting whose sizes changed since the one before (ca_core's
          [Note: Sightings whose sizes changed]; only with N >= 2, as the
          first backward has none before it) does not count toward N: the
          same model run at several sizes once each (a notebook trying
          widths) shares one key path, and no size of it comes back. A loop
          whose sizes change every step is captured one backward later, and
          what changed is dynamic in its first graph.
        - A backward that ``torch.autograd.gradcheck`` or ``gradgradcheck``
          runs is never captured: each of their perturbed inputs builds a
          new graph that runs once (the numerical Jacobian), so capturing
          them costs seconds each for no hit, and what they check is the
          nodes' derivative formulas, which the eager engine runs too. A
          backward of an entry captured before still hits its graph there.
        - An entry whose graph would call code that names a hook
          registration or a handle's removal (``_function_naming_a_hook_change``:
          a hook that registers or removes hooks of other nodes, which eager
          reads only when it reaches them) is never compiled. Its first
          backward (the one that would capture) runs eagerly, deferred, and
          ca_core compares the nodes' hooks after it, so a change made on
          every backward is reported as one; the next (``sightings`` > 0)
          answers a reason instead of True or False, after reporting it as
          a fallback (one ``EagerFallbackWarning``), and ca_core marks the
          entry failed: each of its backwards runs on the eager engine,
          which reads the hooks as they are, so a change made only on some
          later backward is eager's too. The first backward is only
          deferred, not failed, for the one-shot pattern: a hook that
          removes itself leaves a graph with no such hook, whose key
          differs, so the entry never comes back. See [Note: Hooks changed
          while a graph runs] in ca_core. The look reads the hooks' code,
          code defined in it, and the Python functions that code calls by
          a name that resolves without running anything (``_HookCodeScan``:
          a global of its module, a function in its closure, a method of a
          bound method's class or of an object or module its globals or
          closure hold), theirs in turn, up to 64 functions: a hook that
          swaps hooks through a helper is found as one that does it itself.
        """
        if _inside_gradcheck():
            return True
        if sightings + 1 < self.capture_after + (1 if sizes_changed else 0):
            return True
        changer = _function_naming_a_hook_change(hooks)
        if changer is None:
            return False
        if sightings == 0:
            return True
        reason = (
            "its code registers or removes autograd hooks, which eager reads as it reaches each node "
            "and a compiled graph reads when it starts"
        )
        self._fallback(changer, reason)
        return reason

    def capture(self, graph: ca_core.BackwardGraph) -> ca_core.CapturedGraph | None:
        record = records.begin_capture(graph, self.compiler_key)
        self._records.pending = self._records.failed_first_run = None
        note_first_capture(self.compiler_key)  # see [Note: Compilers made anew]
        with sources_made() as sources:  # see [Note: Sources of our graphs] in _torch_interop.py
            compiled = self._capture_and_compile(graph, record)
        if compiled is not None:
            forget_sources_with(compiled.compiled, sources)
        return compiled

    def _capture_and_compile(
        self, graph: ca_core.BackwardGraph, record: records.CaptureRecord
    ) -> ca_core.CapturedGraph | None:
        start = time.perf_counter()
        try:
            captured = build_graph_module(graph)
        except UnsupportedNode as e:
            records.capture_failed(record, records.Stage.CAPTURE, e.reason, e.node_index)
            self._fallback(e.node_name, e.reason, record)
            return None
        except Exception as e:  # noqa: BLE001 - a capture bug must not kill the training step
            records.capture_failed(record, records.Stage.CAPTURE, describe_error(e))
            self._fallback("capture", describe_error(e), record)
            return None
        records.capture_built(record, captured, time.perf_counter() - start)
        gm = captured.graph_module
        # See [Note: Saved tensors freed early] in ca_core.
        set_locals_to_steal(gm, ["inputs"])
        STATE.set_last_graph(gm)
        self._log_miss(graph)
        log.debug("captured backward of %d nodes:\n%s", len(graph.nodes), gm.code)
        start = time.perf_counter()
        form = _compiled_form(gm)
        try:
            compiled = self._compile(form)
        except Exception as e:  # noqa: BLE001 - any compiler failure is a fallback with a warning
            records.capture_failed(record, records.Stage.COMPILE, describe_error(e))
            self._fallback("compiler_fn", describe_error(e), record)
            return None
        if not callable(compiled):
            reason = (
                f"{self._describe_compiler()} returned {_what(compiled)}, not a callable: return gm, "
                "torch.compile(gm, ...) or a wrapper that calls one of them"
            )
            records.capture_failed(record, records.Stage.COMPILE, reason)
            self._fallback("compiler_fn", reason, record)
            return None
        if graph.create_graph and _once_differentiable(compiled):
            # See [Note: create_graph=True graphs stay differentiable].
            release_dynamo_state_with(form, type(form).forward.__code__, compiled)
            compiled = torch.compile(form, backend="eager", dynamic=None)
        # See [Note: Calling Dynamo's cached code directly] in _dynamo_direct.py.
        returned, compiled = compiled, wrap_if_dynamo_module(compiled, form)
        if graph.inside_a_vmap and is_plain_torch_compile_of(returned, form):
            compiled = form  # see [Note: Graphs of a backward inside a vmap]
            log.info(
                "ca_runtime: a backward inside a vmap or another torch.func transform (is_grads_batched=True, "
                "torch.func.vmap) runs its captured graph uncompiled: Dynamo cannot take their wrapped "
                "tensors as graph inputs"
            )
        # See [Note: What Dynamo keeps of a dropped graph] in _torch_interop.py.
        release_dynamo_state_with(compiled, type(form).forward.__code__, returned)
        records.capture_compiled(record, time.perf_counter() - start)
        self._records.pending = record
        self._records.num_outputs = graph.num_outputs + len(captured.leaf_outputs)
        # See take_compiling(): a torch.compile'd region's real backward, run
        # eagerly, would compile AOTAutograd's own backward graph.
        eager_is_cheap = not any(is_aot_backward(node) for node in graph.nodes)
        self._records.eager_while_compiling = eager_is_cheap
        for brk in STATE.record_capture(gm, captured.graph_breaks):
            message = f"ca_runtime: graph break at {brk.node_name} (node {brk.node_index}): {brk.reason}"
            log.info(message)
            warn_at_user_line(message, GraphBreakWarning)
        # Whether eager_if_faster may apply to this graph; whether it does is
        # the installed enable()'s (read by ca_core at install).
        eager_if_faster_allowed = eager_is_cheap and not _in_multi_process_group()
        return ca_core.CapturedGraph(
            compiled=compiled,
            leaf_outputs=captured.leaf_outputs,
            leaf_hooks_only=captured.leaf_hooks_only,
            free_early=captured.free_early(),
            eager_if_faster_allowed=eager_if_faster_allowed,
        )

    def run_first(
        self,
        compiled: Callable[..., Any],
        inputs: list[torch.Tensor],
        sizes: list[torch.Tensor],
        scalars: list[int | float],
        hooks: list[Any],
        dynamic_dims: Sequence[tuple[int, int]] = (),
    ) -> Sequence[torch.Tensor | None] | None:
        # See [Note: Dynamic sizes] in ca_core: marks only matter while compiling.
        for size in sizes:
            maybe_mark_dynamic(size, size.dim() - 1)
        for tensor_idx, dim in dynamic_dims:
            maybe_mark_dynamic(inputs[tensor_idx], dim)
        # The record of the capture just made on this thread (None: another
        # thread's capture, whose first run this backward happens to make).
        record: records.CaptureRecord | None = getattr(self._records, "pending", None)
        num_outputs: int | None = getattr(self._records, "num_outputs", None) if record is not None else None
        self._records.pending = None
        # Described before the call: Dynamo takes the items of `inputs` over
        # (see [Note: Saved tensors freed early] in ca_core).
        described = records.describe_inputs(inputs) if record is not None else []
        take_started()  # only the compiles this run starts; see take_compiling()
        start = time.perf_counter()
        failed: Exception | None = None
        # See [Note: Dynamo's tracing cycles] and, in _torch_interop.py,
        # [Note: Warnings while Dynamo traces].
        with (
            collecting_tracing_cycles(),
            warnings_ignored_while_dynamo_compiles(),
            backward_inductor_options(),
            sources_made() as sources,  # Dynamo's graphs, made by a lazy compiler now
        ):
            # Caught inside: an exception leaving a @contextmanager gets its
            # __traceback__ set through setattr, which a user's exception
            # class may refuse (the AttributeError would replace it).
            try:
                outputs = compiled(inputs, sizes, scalars, hooks)
            except Exception as e:  # noqa: BLE001 - judged below, outside the contexts
                failed = e
        forget_sources_with(compiled, sources)  # see [Note: Sources of our graphs] in _torch_interop.py
        forget_metric_stacks()  # see [Note: Stacks Dynamo's metrics keep] in _torch_interop.py
        try:
            if failed is not None:
                raise failed
            self._check_outputs(outputs, num_outputs)
        except Exception as e:
            user_error = user_error_behind(e)  # see [Note: User errors are tagged] in _graph_ops.py
            if user_error is e:
                raise
            if user_error is not None:
                raise user_error from None
            # ca_core runs this backward eagerly and calls report_fallback only
            # if eager succeeds (see [Note: Whose failure] in ca_core).
            self.last_failure = (
                str(e) if isinstance(e, _CompiledOutputError) else "first run failed: " + describe_error(e)
            )
            if record is not None:
                records.first_run_done(
                    record, time.perf_counter() - start, described, scalars, hooks, self.last_failure
                )
                self._records.failed_first_run = record
            return None
        if record is not None:
            records.first_run_done(record, time.perf_counter() - start, described, scalars, hooks)
        return outputs

    def _describe_compiler(self) -> str:
        """The compiler_fn as the user passed it, for messages."""
        if isinstance(self.compiler_fn, str):
            return f"compiler_fn {self.compiler_fn!r}"
        return f"compiler_fn {compiler_name(self.compiler_fn)}"

    def _check_outputs(self, outputs: object, num_outputs: int | None) -> None:
        """[Note: What a compiled graph returns]
        The callable a compiler_fn returns is called as the GraphModule is,
        ``compiled(inputs, sizes, scalars, hooks)``, and must return what it
        returns: a list or tuple of ``num_outputs`` values (tensors or None).
        On its first run anything else is a compile failure of that graph,
        like a compiler_fn that raises: one EagerFallbackWarning naming the
        compiler and what it returned, and the backward runs eagerly (on a
        hit, ca_core raises TypeError/RuntimeError: the graph changed what
        it returns after it was checked).
        """
        ok = isinstance(outputs, (list, tuple)) and (num_outputs is None or len(outputs) == num_outputs)
        if not ok:
            wanted = "a list or tuple" + (f" of {num_outputs} values" if num_outputs is not None else "")
            raise _CompiledOutputError(
                f"the callable returned by {self._describe_compiler()} gave {_what(outputs)}, not {wanted} "
                "(the graph's outputs): return gm, torch.compile(gm, ...) or a wrapper that returns their result"
            )

    @staticmethod
    def _log_miss(graph: ca_core.BackwardGraph) -> None:
        """See [Note: Explained misses] in ca_core."""
        if graph.miss_node is None or not miss_log.isEnabledFor(logging.INFO):
            return
        node = graph.nodes[graph.miss_node]
        miss_log.info(
            "cache miss at %s (node %d of %d in the walk): %s",
            node.name,
            node.index,
            len(graph.nodes),
            graph.miss_reason,
        )

    def take_compiling(self) -> Callable[[], bool] | None:
        """See [Note: Capture methods]: whether the compiles the last first run started have ended.

        None, so that the graph serves the backwards meanwhile (uncompiled),
        when the capture holds the backward of a ``torch.compile``'d region:
        eagerly, that node would make AOTAutograd compile its own backward
        graph (seconds, behind the compile under way) that our graph never
        needs.
        """
        threads = take_started()
        if not threads or not getattr(self._records, "eager_while_compiling", True):
            return None
        return lambda: compiles_done(threads)

    def report_eager_if_faster(
        self, entry_id: int, eager: bool, compiled_s: float, eager_s: float, compiled_over_eager: float
    ) -> None:
        """See [Note: Capture methods]: cache entry ``entry_id`` timed both ways and chose."""
        log.info(
            "ca_runtime: cache entry %d: a backward takes %.3g ms compiled, %.3g ms on the eager engine "
            "(medians), compiled/eager %.3f (median of paired runs); its backwards now run %s",
            entry_id,
            compiled_s * 1e3,
            eager_s * 1e3,
            compiled_over_eager,
            "on the eager engine" if eager else "compiled",
        )

    def report_fallback(self, node: str, reason: str) -> None:
        # After a failed first run, ca_core reports the fallback of that capture.
        record: records.CaptureRecord | None = None
        if node == "compiled graph":
            record = getattr(self._records, "failed_first_run", None)
        self._records.failed_first_run = None
        self._fallback(node, reason, record)

    def report_hooks_changed(self, node: str, graph_ran: bool) -> None:
        """Warn that a hook changed ``node``'s hooks during a backward; its graph's later backwards run eagerly.

        See [Note: Hooks changed while a graph runs] in ca_core: a graph run
        (``graph_ran``) called the hooks registered when it started; a
        deferred backward ran on the eager engine, so its grads are eager's.
        ca_core marks the entry failed.
        """
        reason = "a hook registered or removed hooks of the graph's nodes while it ran"
        self.last_failure = f"{node}: {reason}"
        records.record_fallback(self.compiler_key, node, reason, None)
        this_backward = (
            "this backward called the hooks registered when it started, where eager calls the changed ones, "
            "so its grads may differ from eager's"
            if graph_ran
            else "this backward ran on the eager engine"
        )
        message = f"ca_runtime: {reason} ({node}); {this_backward}; later backwards of this graph run on the eager engine"
        log.info(message)
        warn_at_user_line(message, EagerFallbackWarning)

    def proxy_call_backward(
        self,
        inputs: tuple[torch.Tensor | None, ...],
        output_metadatas: Any,
        saved_tensors: tuple[torch.Tensor | None, ...],
        backward_idx: int,
        ctx: Any,
        backward_state_idx: int | None,
        opaque_object_indices: list[int],
    ) -> tuple[torch.Tensor | None, ...]:
        """Runs a Python Function's backward for torch's PyNode::apply_with_saved.

        AOTAutograd's CompiledFunction (``boxed_grads_call``) takes its grads
        as one list, which it may empty as it frees them.
        """
        if getattr(ctx._forward_cls, "boxed_grads_call", False):
            fake = FakeBackwardCFunction(ctx, list(saved_tensors))  # type: ignore[arg-type]
            grads = fake._forward_cls.backward(fake, list(inputs))
            return grads if isinstance(grads, tuple) else (grads,)
        result: tuple[torch.Tensor | None, ...] = call_user(call_backward, ctx, list(saved_tensors), *inputs)
        return result

    def _fallback(self, node: str, reason: str, record: records.CaptureRecord | None = None) -> None:
        first_line = reason.strip().splitlines()[0] if reason.strip() else reason
        self.last_failure = f"{node}: {first_line}"
        records.record_fallback(self.compiler_key, node, first_line, record)
        message = (
            f"ca_runtime: {node} cannot be compiled ({first_line}); this backward runs on the eager engine"
        )
        log.info(message)
        warn_at_user_line(message, EagerFallbackWarning)
