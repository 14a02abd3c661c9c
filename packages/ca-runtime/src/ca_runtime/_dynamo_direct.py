"""Calling a ``torch.compile``'d backward graph's cached Dynamo code directly on a cache hit.

[Note: Calling Dynamo's cached code directly]
A compiler_fn that returns ``torch.compile(gm, ...)`` gives ca_core an
``OptimizedModule``. Each call of it on a cache hit goes through
``OptimizedModule.__call__``, ``nn.Module._call_impl`` (twice: the wrapper and
our GraphModule), Dynamo's ``compile_wrapper`` (eval-frame callback, stance,
dispatch-key and functorch state saved and restored) and Dynamo's frame
evaluation, which looks the frame up in the cache Dynamo keeps on the code
object of ``gm.forward`` and runs the transformed code of the first entry
whose guards pass. Measured on this project's bench (CPU, one thread), those
layers cost 45 us on a ten-node chain and 0.1-0.2 ms on the MLP and the
transformer: most of what separated ours from eager there.

``DirectDynamoCall`` does the lookup itself and runs the entry's transformed
code as a plain function, with the same globals, so that Dynamo computes
exactly what it would. It takes that path only where it is the same
computation as Dynamo's:

- the entry's guards pass (its full guard set, ``guard_manager.check`` on the
  frame's locals, as Dynamo's lookup runs it; an error of a guard, no entry
  that passes, and an empty cache after ``torch._dynamo.reset()`` take the
  normal call, where Dynamo recompiles as usual). Dynamo runs the first
  entry that passes, most recently compiled first; this takes the first that
  passes and meets the next two points, which may be an older one (a
  recompile that ran a hook eagerly behind a Dynamo graph break leaves the
  fully traced entry valid). Either is correct: passing its guards is what
  makes an entry valid for the frame;
- the entry was compiled by this ``OptimizedModule``'s backend (the one
  Dynamo's lookup matches, ``innermost_backend`` of its callback, compared by
  identity: an entry a forced backend or stance compiled is not taken);
- the transformed code calls nothing but its one compiled graph and Dynamo's
  two bytecode-profiling helpers (checked once per code object by
  ``_runs_one_graph``): no resume function after a Dynamo graph break, no
  user function (a hook) that Dynamo's callback would have traced, no
  closure, global store or import;
- nothing would make Dynamo's wrappers behave differently on this call: the
  compile stance is ``"default"`` with no forced backend, no eval-frame
  callback is active on this thread (a backward called inside a compiled
  region), nothing traces (``torch.jit.trace``, FX symbolic tracing, a
  Dynamo/export tracing context: ``compile_wrapper`` runs the plain code
  then), no global ``nn.Module`` hook is registered, and neither module has
  hooks of its own (checked once: both are ours), and Dynamo's context has no
  per-call enter hook but those that matter only to a compile
  (``_COMPILE_ONLY_HOOKS``). What Dynamo keeps and checks here is read
  through _torch_interop.py (items 23 and 24).

Anything else calls the ``OptimizedModule`` as before; see [Note: A
recompile that fails on a hit] for when that call's compile fails.

[Note: A later frame that fails to compile]
Behind a Dynamo graph break (an untraceable call in the graph, a hook that
Dynamo cannot trace through) Dynamo compiles more frames while the graph
runs: the hook's own frame, the resume function that continues the graph.
When one of those compiles fails, part of the graph and its hooks already
ran, so neither answer for a failed graph fits: the eager engine would run
those hooks a second time, and raising (Dynamo's default) ends the user's
training step with an error of a compiler, not theirs. So for each call of
the OptimizedModule, once a frame other than the graph's own starts to
compile, Dynamo's ``suppress_errors`` is on until the call returns
(torch_interop item 18): the frame that fails runs uncompiled (Dynamo skips
its code from then on, so later backwards run it uncompiled without trying
again), the rest of the graph goes on, every hook runs once, and the
backward's results are those of the graph's own ops. Dynamo's log record of
the error is taken off its log, and one ``EagerFallbackWarning`` per graph
names it. The graph's own frame is never suppressed: its failure is the
first run's (the backward runs eagerly, before any hook ran) or [Note: A
recompile that fails on a hit]'s. Dynamo's config is a context variable per
option in torch 2.13 (``user_override``), so a compile on another thread
does not see ``suppress_errors`` set here.

[Note: Later frames keep static strides]
Those later frames also infer no dynamic stride (sizes still go dynamic as
Dynamo infers them: a hook on a batch-sized grad keeps one entry for all
batch sizes). torch 2.13's automatic dynamic strides, which its own
``FrameStateSizeEntry.is_stride_dynamic`` calls "a bit buggy", break on what
a hook reads: a post-accumulate-grad hook reading ``p.grad``, whose layout
changes between steps (``p.grad.set_(...)`` to a strided view), recompiles
with a symbolic stride that Dynamo cannot guard (``IndexError`` in
``produce_guards``; plain ``torch.compile`` of the hook raises it to the
user), and with a warm Inductor cache the recompile instead ran code
compiled for the old stride: Inductor's ``assert_size_stride`` raised from
the middle of the backward. With static strides each layout a hook sees is
one guarded entry. torch's reading is wrapped on the class (installed once,
at the first such compile) by one that answers False where a per-thread
flag is set for the call, as ``suppress_errors`` is set: swapping the
method for the call instead left it swapped for good when two threads'
calls overlapped.

[Note: Compiles during a hit keep the backward options]
The first run of a captured graph compiles inside backward_inductor_options
(see [Note: Inductor options for backward graphs] in
_backward_inductor_options.py). A hit that goes Dynamo's normal way can
compile too: Dynamo recompiles the graph's frame when no entry's guards pass
(a float in a hook's closure changed: an LR schedule in an optimizer step
run by a post-accumulate-grad hook), or a frame behind a Dynamo graph break.
Such a compile gets the same options: the options are not only for speed,
one of them ([Note: An add's alpha beside an mm]) keeps Inductor from
dropping an add's alpha, and a recompile without it moved each parameter
by +grad instead of -lr * grad. Patching Inductor's config costs about
25 us, more than many hits, so it is entered from Dynamo's compile start
callback, only when a compile starts (entered_when_dynamo_compiles), and
left when the call returns. A compiler_fn whose result is not a plain
torch.compile of the graph is called as it is: its recompiles use whatever
options it gives.

[Note: A recompile that fails on a hit]
On a cache hit Dynamo may recompile the graph (a guard failed: a hook's
closure value changed, a size went dynamic). If that compile fails, the
backward cannot go back to the eager engine as a failed first run does: the
nodes' saved tensors were dropped before the graph ran (see [Note: Saved
tensors freed early] in ca_core), and only the graph's ``inputs`` hold them.
The GraphModule itself can still run them: it is the same computation, op by
op, with the node calls eager makes. So when the call fails with an error
that is not the user's (see [Note: User errors are tagged] in _graph_ops.py)
while Dynamo compiled the graph's own frame (the error's compile id names
that frame: its compile runs when the frame is entered, before any of the
graph ran), the graph runs uncompiled, ``EagerFallbackWarning`` says why once
per graph, and every later call whose guards no compiled entry passes runs
uncompiled too instead of compiling again (each attempt is a whole Dynamo
trace that would fail the same way). Such calls count in
``stats()["uncompiled_runs"]``. A failure in another frame's compile runs
that frame uncompiled instead; see [Note: A later frame that fails to
compile]. One that Dynamo raises all the same (not a compile error), or one
without a compile id, is raised: running the graph again would run the
hooks that already ran twice. While ``torch.profiler``
records, the direct call is wrapped in the "Torch-Compiled Region: <compile
id>" range Dynamo puts around a hit, and the lookup (ours, in place of
Dynamo's "TorchDynamo Cache Lookup") in "ca: Dynamo guard check", so that a
profile shows what the guards cost. Differential tests run every
``torch.compile`` backend through this path; tests/test_dynamo_direct.py
checks each condition above sends the call the normal way.
"""

from __future__ import annotations

import contextlib
import dis
import enum
import gc
import types
from collections.abc import Iterator
from typing import Any

import torch

from ca_runtime._backward_inductor_options import backward_inductor_options
from ca_runtime._counters import PYTHON_COUNTS
from ca_runtime._graph_ops import USER_ERROR_TAG
from ca_runtime._log import EagerFallbackWarning, describe_error, log, warn_at_user_line
from ca_runtime._torch_interop import (
    bump_dynamo_generation,
    clear_finished_tracked_fakes,
    compiled_frame_id,
    dynamo_cache_entries,
    dynamo_recompile_limit,
    dynamo_wrappers_inert,
    entered_when_dynamo_compiles,
    failed_compile_frame_id,
    is_plain_torch_compile_of,
    later_frames_static_and_uncompiled_on_failure,
    optimized_module_backend,
    profiler_enabled,
)

__all__ = [
    "DirectDynamoCall",
    "collecting_tracing_cycles",
    "direct_calls",
    "wrap_if_dynamo_module",
]

#: Opcodes (CPython 3.10-3.12) that move values between the stack, locals and
#: containers, or call what was loaded: what Dynamo emits to call its graph
#: and rebuild the frame's return value. EXTENDED_ARG only widens the next
#: instruction's argument: a graph with more than 256 outputs or locals has it.
_PURE_OPCODES = frozenset(
    {
        "EXTENDED_ARG", "RESUME", "NOP", "CACHE", "PRECALL", "CALL", "PUSH_NULL", "KW_NAMES", "RETURN_VALUE",
        "RETURN_CONST", "POP_TOP", "COPY", "SWAP", "DUP_TOP", "ROT_TWO", "ROT_THREE", "ROT_FOUR",
        "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "STORE_FAST", "DELETE_FAST", "LOAD_CONST",
        "BUILD_LIST", "BUILD_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP", "LIST_EXTEND", "LIST_APPEND",
        "LIST_TO_TUPLE", "UNPACK_SEQUENCE", "BINARY_SUBSCR", "CALL_FUNCTION", "CALL_METHOD",
        "CALL_FUNCTION_KW", "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD",
    }
)  # fmt: skip
_CALL_OPCODES = frozenset({"CALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW"})
#: The helpers around the graph call that Dynamo's bytecode may load.
_PROFILING_HELPERS = frozenset({"record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit"})


#: Transformed codes remembered per graph; Dynamo recompiles a frame at most
#: ``recompile_limit`` (8) times.
_MAX_CODES = 16


class _Counts:
    """Graph calls served directly, bumped under the GIL (not a ``stats()`` counter)."""

    direct_calls = 0


_COUNTS = _Counts()


def direct_calls() -> int:
    """Graph calls served by ``DirectDynamoCall`` since the process started (for tests and the bench)."""
    return _COUNTS.direct_calls


def _runs_one_graph(code: types.CodeType) -> bool:
    """Whether Dynamo's transformed ``code`` calls its one compiled graph and nothing but profiling helpers.

    Every call in it must be of a callable loaded by name from that list:
    the count of calls equals the count of those loads, and no other load of
    a global or attribute (which could be called) appears.
    """
    if code.co_freevars or code.co_cellvars:
        return False
    graphs = helpers = calls = 0
    for instruction in dis.get_instructions(code):
        op = instruction.opname
        if op not in _PURE_OPCODES:
            return False
        if op in _CALL_OPCODES:
            calls += 1
        elif op == "LOAD_GLOBAL":
            name = instruction.argval
            if name.startswith("__compiled_fn_"):
                graphs += 1
            elif not name.startswith("__import_"):
                return False
        elif op in ("LOAD_ATTR", "LOAD_METHOD"):
            if instruction.argval not in _PROFILING_HELPERS:
                return False
            helpers += 1
    return graphs == 1 and calls == graphs + helpers


# [Note: Dynamo's tracing cycles]
# A lazy compiler (torch.compile) traces our graph on its first run, and
# Dynamo's tracing state is a web of reference cycles (translator, output
# graph, VariableTrackers) that holds the real objects it saw: a Function's
# ctx, hooks, the lifted tensors. Eager frees a ctx when its output dies; after
# a capturing backward it would live until the next full collection, which can
# be far away. A full gc.collect() costs ~0.2 s in a process with torch loaded,
# so the first run instead freezes every object that exists before it
# (gc.freeze moves them to the permanent generation, O(1)), collects what the
# run created (milliseconds; with the ShapeEnvs of its finished compiles let
# go of their fakes first), and unfreezes. A hit whose call Dynamo
# recompiles (no cached entry's guards pass: a hook's global list grew, a
# closure value changed) does the same (DirectDynamoCall.__call__), so that
# what that trace saw dies with its output as on the first run; past
# Dynamo's recompile limit, or after a recompile failed, nothing is traced
# and a hit pays nothing for this. A program
# that freezes objects itself (gc.get_freeze_count() > 0) or has turned gc
# off is left alone.
@contextlib.contextmanager
def collecting_tracing_cycles() -> Iterator[None]:
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        try:
            # See [Note: Fakes a finished compile still tracks] in _torch_interop.py.
            clear_finished_tracked_fakes(gc.get_objects())
            gc.collect()
        finally:
            gc.unfreeze()


class _NotFound(enum.Enum):
    """Why ``DirectDynamoCall._find`` has no transformed code to run directly."""

    #: Entries passed their guards but none is direct-callable (or a guard raised): Dynamo's call runs one.
    NOT_DIRECT = enum.auto()
    #: No entry's guards pass: Dynamo's call compiles the frame again, up to its recompile limit.
    NO_ENTRY_PASSED = enum.auto()


class DirectDynamoCall:
    """``compiled``, an ``OptimizedModule`` of ``gm``, called through Dynamo's cache directly.

    See [Note: Calling Dynamo's cached code directly].
    """

    __slots__ = (
        "__weakref__",
        "_code",
        "_found_compile_id",
        "_frame_id",
        "_functions",
        "_globals",
        "_later_frames_failed",
        "_ran_once",
        "_recompile_failed",
        "backend",
        "compiled",
        "gm",
    )

    def __init__(self, compiled: Any, gm: torch.fx.GraphModule) -> None:
        #: The OptimizedModule: every call that the direct path does not take.
        self.compiled = compiled
        #: The GraphModule it compiles (the ``self`` of its frame).
        self.gm = gm
        #: The code object Dynamo keeps its cache entries on.
        self._code = type(gm).forward.__code__
        #: The globals its frame runs with, where Dynamo put the compiled graphs.
        self._globals = type(gm).forward.__globals__
        #: The backend Dynamo stores on the entries ``compiled`` makes (as
        #: Dynamo's lookup derives it from the callback).
        self.backend = optimized_module_backend(compiled)
        #: Per transformed code seen, by id (a code object whose constants
        #: include a dict, as Dynamo's replay of a hook registered by a hook
        #: has, cannot be hashed): the code, kept alive so that its id stays
        #: its own, and its function, or None if not direct-callable.
        self._functions: dict[int, tuple[types.CodeType, types.FunctionType | None]] = {}
        #: A call returned: the graph's first run (run_first judges its failures) is over.
        self._ran_once = False
        #: A recompile failed; see [Note: A recompile that fails on a hit].
        self._recompile_failed = False
        #: Dynamo's id of the graph's frame (its compile ids' frame_id), known after the first run.
        self._frame_id: int | None = None
        #: A frame after the graph's own failed to compile and ran uncompiled (warned once).
        self._later_frames_failed = False
        #: The compile id of the entry ``_find`` found last (for the profiler's range).
        self._found_compile_id: Any = None

    def _function_for(self, code: types.CodeType) -> types.FunctionType | None:
        known = self._functions.get(id(code))
        if known is not None:
            return known[1]
        if len(self._functions) >= _MAX_CODES:
            self._functions.clear()  # recompiled more than Dynamo's own limit: start over
        function = types.FunctionType(code, self._globals, "forward") if _runs_one_graph(code) else None
        self._functions[id(code)] = (code, function)
        return function

    def _find(self, frame_locals: dict[str, Any]) -> types.FunctionType | _NotFound:
        """The transformed code to run for ``frame_locals``, as the Note says, or why there is none (call Dynamo).

        Its entry's compile id is left in ``_found_compile_id`` (no tuple per hit).
        """
        passed_any = False
        for entry in dynamo_cache_entries(self._code):
            # Read at once: the entry is Dynamo's C++ object, which a reset on
            # another thread could free. No object of ours is made per entry:
            # this is the cache-hit path.
            backend, guards, code, compile_id = (
                entry.backend,
                entry.guard_manager,
                entry.code,
                entry.compile_id,
            )
            if backend is not self.backend:
                continue
            try:
                passed = guards.check(frame_locals)
            except Exception:  # noqa: BLE001 - Dynamo's own call reports a guard error
                return _NotFound.NOT_DIRECT
            if not passed:
                continue
            passed_any = True
            function = self._function_for(code)
            if function is not None:
                self._found_compile_id = compile_id
                return function
        return _NotFound.NOT_DIRECT if passed_any else _NotFound.NO_ENTRY_PASSED

    def __call__(self, inputs: list[Any], sizes: list[Any], scalars: list[Any], hooks: list[Any]) -> Any:
        if dynamo_wrappers_inert():
            frame_locals = {
                "self": self.gm,
                "inputs": inputs,
                "sizes": sizes,
                "scalars": scalars,
                "hooks": hooks,
            }
            if profiler_enabled():
                # The guard check and the region as ranges; Dynamo's own
                # call shows "TorchDynamo Cache Lookup" for the first.
                with torch.autograd.profiler.record_function("ca: Dynamo guard check"):
                    function = self._find(frame_locals)
                if not isinstance(function, _NotFound):
                    _COUNTS.direct_calls += 1
                    bump_dynamo_generation()
                    with torch.autograd.profiler.record_function(
                        f"Torch-Compiled Region: {self._found_compile_id}"
                    ):
                        return function(self.gm, inputs, sizes, scalars, hooks)
            else:
                function = self._find(frame_locals)
                if not isinstance(function, _NotFound):
                    _COUNTS.direct_calls += 1
                    # What Dynamo's per-call enter hook does besides its
                    # one-time patch; see _torch_interop's _COMPILE_ONLY_HOOKS.
                    bump_dynamo_generation()
                    return function(self.gm, inputs, sizes, scalars, hooks)
            if function is _NotFound.NO_ENTRY_PASSED and self._dynamo_traces_again():
                # See [Note: Dynamo's tracing cycles].
                with collecting_tracing_cycles():
                    return self._dynamo_call(inputs, sizes, scalars, hooks)
        return self._dynamo_call(inputs, sizes, scalars, hooks)

    def _dynamo_traces_again(self) -> bool:
        """Whether a call that no cached entry's guards pass makes Dynamo trace the graph's frame again.

        After the first run, unless a recompile failed (the graph then runs
        uncompiled) or the frame has as many entries as Dynamo's recompile
        limit (Dynamo then runs it without tracing). Read off the hit's fast
        path only.
        """
        if not self._ran_once or self._recompile_failed:
            return False
        return len(dynamo_cache_entries(self._code)) < dynamo_recompile_limit()

    def _dynamo_call(self, inputs: list[Any], sizes: list[Any], scalars: list[Any], hooks: list[Any]) -> Any:
        """The OptimizedModule called as Dynamo calls it; see the Notes above for its failures."""
        if self._recompile_failed:
            return self._run_uncompiled(inputs, sizes, scalars, hooks)
        # See [Note: A later frame that fails to compile] and [Note: Later frames keep static strides].
        later_failures: list[BaseException] = []
        if not self._ran_once:
            with later_frames_static_and_uncompiled_on_failure(None, later_failures):
                outputs = self.compiled(inputs, sizes, scalars, hooks)
            self._ran_once = True
            self._frame_id = compiled_frame_id(self._code)
            self._warn_later_failures(later_failures)
            return outputs
        try:
            # See [Note: Compiles during a hit keep the backward options].
            with (
                entered_when_dynamo_compiles(backward_inductor_options),
                later_frames_static_and_uncompiled_on_failure(self._frame_id, later_failures),
            ):
                outputs = self.compiled(inputs, sizes, scalars, hooks)
            self._warn_later_failures(later_failures)
            return outputs
        except Exception as e:
            # The tag stays for ca_core, which takes it off (see [Note: User errors are tagged]).
            if getattr(e, USER_ERROR_TAG, False) is True or self._frame_id is None:
                raise
            if failed_compile_frame_id(e) != self._frame_id:
                raise  # another frame's, which Dynamo did not let run uncompiled: part of the graph ran
            self._recompile_failed = True
            warn_at_user_line(
                "ca_runtime: recompiling a cached backward graph failed (" + describe_error(e) + "); "
                "this backward and later ones that its compiled code does not fit run the graph uncompiled",
                EagerFallbackWarning,
            )
            log.debug("recompile failure", exc_info=True)
        return self._run_uncompiled(inputs, sizes, scalars, hooks)

    def _warn_later_failures(self, failures: list[BaseException]) -> None:
        """One warning per graph for frames after its own that ran uncompiled; see [Note: A later frame that fails to compile]."""
        if not failures or self._later_frames_failed:
            return
        self._later_frames_failed = True
        warn_at_user_line(
            "ca_runtime: compiling the part of a backward graph behind a Dynamo graph break failed ("
            + describe_error(failures[0])
            + "); that part runs uncompiled, in this backward and later ones",
            EagerFallbackWarning,
        )

    def _run_uncompiled(
        self, inputs: list[Any], sizes: list[Any], scalars: list[Any], hooks: list[Any]
    ) -> Any:
        PYTHON_COUNTS.uncompiled_runs += 1  # see [Note: A recompile that fails on a hit]
        return self.gm(inputs, sizes, scalars, hooks)


def wrap_if_dynamo_module(compiled: Any, gm: torch.fx.GraphModule) -> Any:
    """``compiled`` as a ``DirectDynamoCall`` when it is ``torch.compile(gm)`` as the Note needs; else unchanged."""
    if is_plain_torch_compile_of(compiled, gm):
        return DirectDynamoCall(compiled, gm)
    return compiled
