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
  returns at once a boxed callable that runs a copy of the ATen graph op by
  op, as the ``aot_eager`` backend would. After its first call (the
  capturing backward itself, which so runs without competing for the GIL;
  see [Note: The GIL while compiling in the background]) it starts a thread
  that calls Inductor's real ``compile_fx_inner`` on the graph, with the
  tracing and compile contexts of the capture re-entered there (AOTAutograd's
  lazy backward compile runs it the same way, after ``compile_fx`` returned);
- when the kernels are ready, the thread puts Inductor's compiled graph
  into that callable's closure cell, so the next call runs it; the cost left
  on a hit is one Python call.

The uncompiled runs execute the very graph Inductor compiles (a deep copy
of the module, subgraphs included, taken before Inductor's post-grad passes
rewrite the original in place), with the same Dynamo
guards, hooks and side effects around it, so a backward gives the same result
whichever way it ran. Only the capturing backward normally runs so: the
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
(``create_graph=True``), one with symbolic sizes (Inductor may add guards
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
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from ca_runtime._log import EagerFallbackWarning, log, warn_at_user_line

__all__ = [
    "BackgroundInductor",
    "background_counts",
    "compiles_done",
    "reset_background_counts",
    "take_started",
    "wait_for_background_compiles",
]


class _Counts:
    """``stats()``'s background counters, bumped under the GIL."""

    background_compiles = 0
    uncompiled_runs = 0


_COUNTS = _Counts()
#: Compile threads started and not yet finished.
_live: set[threading.Thread] = set()
_live_lock = threading.Lock()

#: ATen ops that communicate with other processes: a graph with any compiles
#: on the calling thread (see [Note: Compiling in the background]).
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_dtensor", "c10d"})


def background_counts() -> dict[str, int]:
    """Compiles started in the background and graph calls run uncompiled meanwhile."""
    return {
        "background_compiles": _COUNTS.background_compiles,
        "uncompiled_runs": _COUNTS.uncompiled_runs,
    }


def reset_background_counts() -> None:
    _COUNTS.background_compiles = 0
    _COUNTS.uncompiled_runs = 0


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
    _COUNTS.background_compiles += 1
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
    if getattr(torch._inductor.config, "distributed_max_autotune_gemm", False):
        return "distributed autotuning talks to other ranks while compiling"
    from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache

    if should_bundle_autograd_cache():
        return "AOTAutograd's bundled cache needs Inductor's output at once"
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
            return f"it calls the collective {node.target}"
    return None


def _changed_since(global_state: Any) -> str:
    """Which process-global torch state differs from the capture's, or ""; see [Note: State at capture time]."""
    return "" if global_state.check() else f"torch's global state ({global_state.reason()})"


def _uncompiled_copy(gm: torch.fx.GraphModule) -> Callable[[list[Any]], Any]:
    """A boxed callable running ``gm``'s graph op by op, on a copy Inductor's passes do not touch.

    The whole module is copied, subgraphs of higher-order ops included:
    Inductor's post-grad passes rewrite those in place too.
    """
    copied = copy.deepcopy(gm)
    copied.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    copied.recompile()
    forward: Callable[[list[Any]], Any] = copied.forward

    def run_uncompiled(args: list[Any]) -> Any:
        _COUNTS.uncompiled_runs += 1
        return forward(args)

    return run_uncompiled


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


def _start(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """The boxed callable for ``gm``: op by op, until a thread started after its first call has compiled it."""
    from torch._dynamo.convert_frame import compile_lock
    from torch._inductor.compile_fx import compile_fx_inner

    run_uncompiled = _uncompiled_copy(gm)
    tracing = torch._guards.TracingContext.try_get()
    compiling = torch._guards.CompileContext.try_get()
    # See [Note: State at capture time].
    global_state = torch._C._dynamo.guards.GlobalStateGuard()
    context = contextvars.copy_context()
    first_run_lock = threading.Lock()
    started = False

    def compile_now() -> Any:
        with (
            compile_lock,  # see [Note: One Inductor compile at a time]
            torch._guards.compile_context(compiling),
            torch._guards.tracing(tracing),
        ):
            return compile_fx_inner(gm, example_inputs, **kwargs)

    def compile_graph() -> None:
        begun = time.perf_counter()
        try:
            with torch.no_grad(), torch._C._DisableAutocast():
                changed = _changed_since(global_state)
                if changed:
                    # See [Note: State at capture time].
                    cell.cell_contents = compile_on_next_call
                    log.info("ca_runtime: %s changed since the capture; compiling on the next call", changed)
                    return
                compiled = compile_now()
        except BaseException as e:  # noqa: BLE001 - reported; the graph keeps running uncompiled
            if _Shutdown.started:
                log.debug("ca_runtime: background compile stopped by interpreter shutdown: %s", e)
                return
            _report_failure(e, " in the background", on_compile_thread=True)
        else:
            cell.cell_contents = compiled
            log.info(
                "ca_runtime: backward graph compiled in the background in %.1f s", time.perf_counter() - begun
            )
        finally:
            _finished(threading.current_thread())

    def compile_on_next_call(args: list[Any]) -> Any:
        # The state Dynamo's guards just checked for this call is the capture's.
        cell.cell_contents = run_uncompiled
        try:
            compiled = context.copy().run(compile_now)
        except Exception as e:  # noqa: BLE001 - as a failed background compile
            _report_failure(e, "", on_compile_thread=False)
            return run_uncompiled(args)
        cell.cell_contents = compiled
        return compiled(args)

    def first_run(args: list[Any]) -> Any:
        # The first run (the capturing backward) goes before the thread starts:
        # it would otherwise wait for the GIL behind the compile at every op.
        # Two threads' backwards may both get here: one starts the compile.
        nonlocal started
        with first_run_lock:
            start, started = not started, True
            if start:
                cell.cell_contents = run_uncompiled
        try:
            return run_uncompiled(args)
        finally:
            if start:
                _begin(
                    threading.Thread(
                        target=context.run, args=(compile_graph,), name="ca-inductor-compile", daemon=False
                    )
                )

    target = first_run

    def run_graph(args: list[Any]) -> Any:
        return target(args)

    run_graph._boxed_call = True  # type: ignore[attr-defined]
    cell = run_graph.__closure__[0]  # type: ignore[index]
    return run_graph


def _inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's ``inner_compile`` for ``BackgroundInductor``; see [Note: Compiling in the background]."""
    from torch._inductor.compile_fx import compile_fx_inner

    reason = _reason_to_compile_here(gm, example_inputs, kwargs)
    if reason is not None:
        log.debug("ca_runtime: compiling a backward graph on the calling thread: %s", reason)
        return compile_fx_inner(gm, example_inputs, **kwargs)
    return _start(gm, example_inputs, kwargs)


class BackgroundInductor(torch._TorchCompileInductorWrapper):
    """The Dynamo backend of ``compile_in_background=True``: Inductor, its kernels compiled on a thread."""

    def __init__(self) -> None:
        super().__init__(None, None, None)

    def __call__(
        self, model_: torch.fx.GraphModule, inputs_: Sequence[Any], *, config_patches: Any = None
    ) -> Any:
        from torch._inductor.compile_fx import compile_fx

        if self.config or config_patches:
            return super().__call__(model_, inputs_, config_patches=config_patches)
        return compile_fx(model_, inputs_, inner_compile=_inner_compile, compile_region_name=self.name)
