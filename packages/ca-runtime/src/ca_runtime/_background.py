"""Inductor compiling a captured graph on a thread of its own: ``enable("inductor", compile_in_background=True)``.

[Note: Compiling in the background]
With Inductor, most of a first backward's time is Inductor's own work on the
graph AOTAutograd hands it: lowering, code generation and the C++ (or
Triton) compile of its kernels, seconds to a minute. Dynamo's and
AOTAutograd's tracing before it is a small part, and it must happen during
the backward: it calls the live autograd nodes (``apply_node``), which only
exist then. So ``BackgroundInductor``, the Dynamo backend of this mode, is
Inductor's own ``compile_fx`` with one change, its ``inner_compile``:

- on the calling thread, as always: Dynamo traces our graph, AOTAutograd
  traces it to ATen ops and runs Inductor's joint-graph passes, and Dynamo
  installs its guards and cache entry;
- ``inner_compile`` (what turns that ATen graph into kernels) instead
  hands the graph to a ``_DeferredCompile`` and returns at once; the backend
  returns that object's ``run`` to Dynamo. Until the kernels exist, ``run``
  calls a copy of Dynamo's own graph, taken before Inductor's passes, op by
  op as the ``eager`` backend would: the nodes' formulas themselves, so such
  a run gives eager's gradients bit for bit (the ATen graph already has
  Inductor's decompositions in it, which round differently). After its
  first call (the capturing backward itself, which so runs without
  competing for the GIL; see [Note: The GIL while compiling in the
  background]) it starts a thread that calls Inductor's real
  ``compile_fx_inner`` on the ATen graph, with the tracing and compile
  contexts of the capture re-entered there (AOTAutograd's lazy backward
  compile runs it the same way, after ``compile_fx`` returned);
- when the kernels are ready, the thread stores them, and from the next call
  on ``run`` calls AOTAutograd's wrapper, which calls them; the cost left
  on a hit is one Python call.

The uncompiled runs execute the graph Dynamo traced, with the same Dynamo
guards, hooks and side effects around it, so a backward gives eager's result
whichever way it ran until the kernels take over (then Inductor's rounding).
Only the capturing backward normally runs so: the
runtime hands ca_core a readiness check for the compiles that first run
started (``Runtime.take_compiling``), and until they end, later backwards
that reach the entry run on the eager engine, whose nodes do not need the
GIL (see [Note: Eager while compiling] in ca_core). Not so where the
backward holds a ``torch.compile``'d region's: eagerly, that node would
make AOTAutograd compile its own backward graph (seconds, behind the compile
under way), so those graphs serve the backwards meanwhile uncompiled, as
does a graph Dynamo recompiles during a hit until its own compile ends.
``stats()`` adds ``background_compiles``, ``uncompiled_runs`` and
``eager_while_compiling``.

The graph compiles on the calling thread, as without this mode, where a
background compile could differ from it: a graph that needs autograd
(none of ca's own: see [Note: create_graph=True graphs stay differentiable]
in _runtime.py), one with symbolic sizes (Inductor may add guards
while lowering, which Dynamo must have installed before the first run),
collectives (every rank must run them alike), CUDA graphs, ``cpp_wrapper``,
freezing, or options given to the backend.

[Note: One Inductor compile at a time]
Inductor keeps per-compile state in class attributes (``TritonBundler``
asserts that no other compile is under way, and two concurrent compiles
failed on it here). torch serialises its own compiles through Dynamo's
``compile_lock``: every Dynamo frame compile holds it, and so does
AOTAutograd's lazy backward compile, which may run on another thread. The
compile thread holds it too, for the whole of ``compile_fx_inner``. So
background compiles run one after another, and a compile the training
thread needs meanwhile (a new capture, the user's forward recompiling) waits
for the one under way to finish, as a compile on another thread would make
it wait without this mode.

[Note: State at capture time]
Inductor reads two kinds of state while it lowers. Its config (and
Dynamo's and AOTAutograd's) lives in context variables in torch 2.13: a
value set or patched on one thread is not seen on another, which starts
from the defaults. So the thread compiles inside a copy of the capturing
thread's context (``contextvars.copy_context()`` at the capture), with the
config the capture had, ``compile_fx``'s own patches included, whatever the
user sets afterwards. torch's deterministic-algorithms and TF32 flags are
process-global; Dynamo's global-state guard fixed them for this graph at
capture. The thread checks them first (a ``GlobalStateGuard`` taken at the
capture); if the user changed one meanwhile, it compiles nothing, and the
graph's next call, which Dynamo's guards have just matched to the
capture's state, compiles it on the calling thread instead (in a copy of the
same context).

The thread is not a daemon: at exit Python waits for a compile under way
before it runs ``atexit`` handlers (Inductor's compile workers stop in one);
a compile that fails because shutdown has begun (its worker pools refuse new
work) stays quiet.
``wait_for_background_compiles()`` waits for every compile started. A failed
compile warns once (``EagerFallbackWarning``) and leaves that graph running
uncompiled; nothing else changes.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from ca_runtime._counters import PYTHON_COUNTS
from ca_runtime._log import EagerFallbackWarning, log, warn_at_user_line
from ca_runtime._torch_interop import (
    DynamoCompileContexts,
    TorchCompileInductorWrapper,
    TorchGlobalState,
    aot_autograd_bundles_its_cache,
    autocast_disabled,
    dynamo_compile_lock,
    inductor_autotunes_across_ranks,
    inductor_compile_fx,
    inductor_compile_fx_inner,
)

__all__ = [
    "BackgroundInductor",
    "compiles_done",
    "take_started",
    "wait_for_background_compiles",
]


#: Compile threads started and not yet finished.
_live: set[threading.Thread] = set()
_live_lock = threading.Lock()

#: ATen ops that communicate with other processes: a graph with any compiles
#: on the calling thread (see [Note: Compiling in the background]).
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_dtensor", "c10d"})


def wait_for_background_compiles(timeout: float | None = None) -> bool:
    """Waits until every compile started in the background has finished.

    Returns whether all have (False only when ``timeout``, in seconds, ran out).
    A backward that starts afterwards runs its compiled kernels.
    """
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout < 0
    ):
        raise ValueError(f"timeout must be None or a non-negative number of seconds, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _live_lock:
            pending = next(iter(_live), None)
        if pending is None:
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        pending.join(left)
        if not pending.is_alive():
            _finished(pending)  # normally done by the thread itself; idempotent


#: Per thread: the compile threads it started since the last take_started().
_started_here = threading.local()


def take_started() -> list[threading.Thread]:
    """The compile threads this thread started since the last call; see [Note: Eager while compiling] in ca_core."""
    threads: list[threading.Thread] = getattr(_started_here, "threads", [])
    _started_here.threads = []
    return threads


def compiles_done(threads: list[threading.Thread]) -> bool:
    """Whether every one of ``threads`` has finished its compile, as ``wait_for_background_compiles`` sees it.

    Not ``Thread.is_alive()``: a thread has stored its kernels (or reported
    its failure) and left the live set a moment before it exits, and a
    backward right after ``wait_for_background_compiles()`` must find its
    graph ready.
    """
    with _live_lock:
        return not any(thread in _live for thread in threads)


def _begin(thread: threading.Thread) -> bool:
    """Starts ``thread``; False if it could not be started (the graph then stays uncompiled)."""
    with _live_lock:
        if not _live:
            _SWITCH.lower()
        _live.add(thread)
    try:
        thread.start()
    except RuntimeError as e:  # no more threads, or the interpreter is shutting down
        log.info("ca_runtime: could not start a background compile (%s); the graph stays uncompiled", e)
        _finished(thread)
        return False
    PYTHON_COUNTS.background_compiles += 1
    if not hasattr(_started_here, "threads"):
        _started_here.threads = []
    _started_here.threads.append(thread)
    return True


def _finished(thread: threading.Thread) -> None:
    with _live_lock:
        _live.discard(thread)
        if not _live:
            _SWITCH.restore()


class _SwitchInterval:
    """[Note: The GIL while compiling in the background]
    Inductor's compile is mostly Python and holds the GIL. The training thread
    gives the GIL up at every ATen op (torch's bindings release it around the
    kernel) and then waits for it behind the compile thread, up to Python's
    switch interval (5 ms by default) each time: an uncompiled backward of a
    few thousand ops took 10-20x as long. While a compile runs, the interval
    is lowered to 0.1 ms, so that the training thread gets the GIL back soon
    after each op; when the last compile ends the previous interval is put
    back, unless someone else changed it meanwhile.
    """

    WHILE_COMPILING = 1e-4

    def __init__(self) -> None:
        self._prior: float | None = None

    def lower(self) -> None:
        current = sys.getswitchinterval()
        if current > self.WHILE_COMPILING:
            self._prior = current
            sys.setswitchinterval(self.WHILE_COMPILING)

    def restore(self) -> None:
        prior, self._prior = self._prior, None
        if prior is not None and math.isclose(sys.getswitchinterval(), self.WHILE_COMPILING):
            sys.setswitchinterval(prior)


_SWITCH = _SwitchInterval()


class _Shutdown:
    """Set when the interpreter starts shutting down (see [Note: Compiling in the background])."""

    started = False

    @classmethod
    def mark(cls) -> None:
        cls.started = True


# concurrent.futures stops taking work in the same threading-shutdown hooks,
# before Python joins the compile thread: a compile under way then fails, and
# that failure is no news to anyone.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_Shutdown.mark)


def _is_symbolic(value: object) -> bool:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(value, torch.Tensor):
        return any(
            isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset())
        )
    return False


def _reason_to_compile_here(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any]
) -> str | None:
    """Why this graph compiles on the calling thread, or None; see [Note: Compiling in the background]."""
    if not kwargs.get("is_inference", False):
        return "it needs autograd (create_graph=True)"
    cudagraphs = kwargs.get("cudagraphs")
    if bool(getattr(cudagraphs, "value", cudagraphs)):
        return "it uses CUDA graphs"
    if kwargs.get("cpp_wrapper") or kwargs.get("fx_wrapper"):
        return "it uses Inductor's cpp_wrapper/fx_wrapper"
    if kwargs.get("layout_opt") is not None:
        # Freezing: compile_fx patches the fake mode around inner_compile only.
        return "Inductor's freezing is on"
    if any(_is_symbolic(x) for x in example_inputs):
        return "it has symbolic sizes"
    if inductor_autotunes_across_ranks():
        return "distributed autotuning talks to other ranks while compiling"
    if aot_autograd_bundles_its_cache():
        return "AOTAutograd's bundled cache needs Inductor's output at once"
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
            return f"it calls the collective {node.target}"
    return None


def _changed_since(global_state: TorchGlobalState) -> str:
    """Which process-global torch state differs from the capture's, or ""; see [Note: State at capture time]."""
    return "" if global_state.unchanged() else f"torch's global state ({global_state.changes()})"


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module running ``gm``'s graph, on a copy of the graph that Inductor's passes do not touch.

    Only the graphs are copied (subgraphs of higher-order ops included, which
    Inductor's pre-grad passes rewrite in place too); tensors and other
    attributes are shared, so the copy reads the values the original would.
    """
    copied = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    for name, child in gm.named_children():
        if isinstance(child, torch.fx.GraphModule):
            setattr(copied, name, _graph_copy(child))
    return copied


def _report_failure(error: BaseException, where: str, on_compile_thread: bool) -> None:
    """One EagerFallbackWarning for a compile that failed; the graph keeps running uncompiled.

    From the compile thread it names this module (no user line is on that
    thread's stack); otherwise the user's line that ran the backward.
    """
    first = (str(error).strip().splitlines() or [""])[0]
    message = (
        f"ca_runtime: Inductor failed to compile a backward graph{where} "
        f"({type(error).__name__}: {first}); that graph keeps running op by op, uncompiled"
    )
    log.info(message, exc_info=error)
    if on_compile_thread:
        warnings.warn(message, EagerFallbackWarning, stacklevel=2)
    else:
        warn_at_user_line(message, EagerFallbackWarning)


class _DeferredCompile:
    """One Dynamo graph's Inductor compile, deferred to a thread; see [Note: Compiling in the background].

    ``BackgroundInductor`` makes one per graph. Inductor's ``inner_compile``
    (``attach``) hands it the ATen graph AOTAutograd traced and gets back the
    callable AOTAutograd will call; that callable runs the kernels once they
    are there, and ``run`` only calls AOTAutograd's wrapper then. Until
    then ``run`` calls a copy of Dynamo's graph itself, as the ``eager``
    backend would: the nodes' own formulas, so those runs give eager's values
    bit for bit (AOTAutograd's ATen graph has Inductor's decompositions in it).
    """

    def __init__(self, uncompiled: torch.fx.GraphModule) -> None:
        #: Dynamo's graph, copied before Inductor's passes rewrote it.
        self.uncompiled = uncompiled
        #: AOTAutograd's wrapper around ``kernels``; set once ``compile_fx`` returns.
        self.compiled: Callable[..., Any] | None = None
        #: Inductor's compiled graph (boxed), None until the compile ends.
        self.kernels: Callable[[list[Any]], Any] | None = None
        #: ``compile_fx_inner``'s arguments, or None if nothing was deferred.
        self.aten: tuple[torch.fx.GraphModule, Sequence[Any], dict[str, Any]] | None = None
        #: Set by the thread when the global state changed: the next call compiles here.
        self.compile_on_next_call = False
        #: Whether a first run has claimed starting the thread.
        self.started = False
        self._first_run_lock = threading.Lock()
        # Taken in ``attach``, inside compile_fx: see [Note: State at capture time].
        self._global_state: TorchGlobalState | None = None
        self._context = contextvars.Context()
        self._compile_contexts: DynamoCompileContexts | None = None

    def attach(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any]
    ) -> Callable[[list[Any]], Any]:
        """Takes AOTAutograd's ATen graph; returns the callable AOTAutograd calls (only once the kernels exist)."""
        self.aten = (gm, example_inputs, kwargs)
        self._global_state = TorchGlobalState()
        self._context = contextvars.copy_context()
        self._compile_contexts = DynamoCompileContexts()

        def call_kernels(args: list[Any]) -> Any:
            assert self.kernels is not None, "ca_runtime: AOTAutograd called a backward graph still compiling"
            return self.kernels(args)

        call_kernels._boxed_call = True  # type: ignore[attr-defined]
        return call_kernels

    def run(self, *args: Any) -> Any:
        """Dynamo's call of the graph: the kernels when they are there, else Dynamo's graph op by op."""
        if self.kernels is not None or (self.compile_on_next_call and self._compile_on_this_call()):
            assert self.compiled is not None
            return self.compiled(*args)
        # The first run (the capturing backward) goes before the thread starts:
        # it would otherwise wait for the GIL behind the compile at every op.
        # Two threads' backwards may both get here: one starts the compile.
        with self._first_run_lock:
            start, self.started = not self.started, True
        try:
            PYTHON_COUNTS.uncompiled_runs += 1
            return self.uncompiled(*args)
        finally:
            if start:
                _begin(
                    threading.Thread(
                        target=self._context.run,
                        args=(self._compile_graph,),
                        name="ca-inductor-compile",
                        daemon=False,
                    )
                )

    def _compile_now(self) -> Any:
        assert self.aten is not None and self._compile_contexts is not None
        gm, example_inputs, kwargs = self.aten
        with (
            dynamo_compile_lock(),  # see [Note: One Inductor compile at a time]
            self._compile_contexts.reentered(),
        ):
            return inductor_compile_fx_inner(gm, example_inputs, **kwargs)

    def _compile_graph(self) -> None:
        """The thread's work: compile, then hand the kernels to ``run``."""
        begun = time.perf_counter()
        try:
            with torch.no_grad(), autocast_disabled():
                assert self._global_state is not None  # taken in attach, before the thread starts
                changed = _changed_since(self._global_state)
                if changed:
                    # See [Note: State at capture time].
                    self.compile_on_next_call = True
                    log.info("ca_runtime: %s changed since the capture; compiling on the next call", changed)
                    return
                kernels = self._compile_now()
        except BaseException as e:  # noqa: BLE001 - reported; the graph keeps running uncompiled
            if _Shutdown.started:
                log.debug("ca_runtime: background compile stopped by interpreter shutdown: %s", e)
                return
            _report_failure(e, " in the background", on_compile_thread=True)
        else:
            self.kernels = kernels
            log.info(
                "ca_runtime: backward graph compiled in the background in %.1f s", time.perf_counter() - begun
            )
        finally:
            _finished(threading.current_thread())

    def _compile_on_this_call(self) -> bool:
        """Compiles on the calling thread; the state Dynamo's guards just checked for this call is the capture's."""
        self.compile_on_next_call = False
        try:
            self.kernels = self._context.copy().run(self._compile_now)
        except Exception as e:  # noqa: BLE001 - as a failed background compile
            _report_failure(e, "", on_compile_thread=False)
            return False
        return True


def _inner_compile(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], deferred: _DeferredCompile, **kwargs: Any
) -> Any:
    """Inductor's ``inner_compile`` for ``BackgroundInductor``; see [Note: Compiling in the background]."""
    reason = _reason_to_compile_here(gm, example_inputs, kwargs)
    if reason is None and deferred.aten is not None:
        reason = "its Dynamo graph already has an ATen graph compiling"
    if reason is not None:
        log.debug("ca_runtime: compiling a backward graph on the calling thread: %s", reason)
        return inductor_compile_fx_inner(gm, example_inputs, **kwargs)
    return deferred.attach(gm, example_inputs, kwargs)


class BackgroundInductor(TorchCompileInductorWrapper):
    """The Dynamo backend of ``compile_in_background=True``: Inductor, its kernels compiled on a thread."""

    def __init__(self) -> None:
        super().__init__(None, None, None)

    def __call__(
        self, model_: torch.fx.GraphModule, inputs_: Sequence[Any], *, config_patches: Any = None
    ) -> Any:
        if self.config or config_patches:
            return super().__call__(model_, inputs_, config_patches=config_patches)
        deferred = _DeferredCompile(_graph_copy(model_))  # before Inductor's passes rewrite model_
        compiled = inductor_compile_fx(
            model_,
            inputs_,
            inner_compile=functools.partial(_inner_compile, deferred=deferred),
            compile_region_name=self.name,
        )
        if deferred.aten is None:
            return compiled
        assert callable(compiled), compiled
        deferred.compiled = compiled
        return deferred.run
