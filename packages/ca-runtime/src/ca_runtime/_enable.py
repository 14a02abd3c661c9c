"""``enable()``, ``disable()``, ``reset()`` and ``stats()``.

[Note: Restoring the engine hook]
torch's engine has one slot for a compiled-autograd function and no getter
(see [Note: Engine hook lifetime] in ca_core). ``enable()`` therefore records
what was active when it started -- our hook with some runtime, torch's
built-in compiled autograd, or nothing -- and puts exactly that back when it
exits, whether by return or by exception. torch's hook is re-armed through
``torch._C._dynamo.compiled_autograd.set_autograd_compiler``, which keeps
torch's own compiler object.

[Note: Contexts entered on several threads]
The engine hook is process-global, so ``enable()`` and ``disable()`` on
different threads share it. Open contexts form one list in entry order (under
a lock), each holding what it replaced. Leaving the innermost one restores
what it replaced, as above. Leaving an outer one while an inner one is still
open (thread A enters, thread B enters, A leaves) changes nothing installed:
the inner one stays in force and inherits what the outer one had replaced. So
the hook in force is always that of the most recently entered open context,
and once every context has exited, what was installed before the first one is
back. Tested in tests/test_enable.py.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import difflib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import ca_core
import torch
from ca_core.runtime_protocol import EngineRuntime

from ca_runtime._background import BackgroundInductor
from ca_runtime._cache_entry import CacheEntry
from ca_runtime._compiler_key import compiler_key, forget_captures, forget_compiler_keys
from ca_runtime._counters import reset_counters
from ca_runtime._counters import stats as counter_values
from ca_runtime._log import warn_at_user_line
from ca_runtime._report.records import RECORDER
from ca_runtime._runtime import CompilerFn, Runtime
from ca_runtime._torch_interop import (
    keep_hook_across_torch_disable,
    rearm_torch_compiled_autograd,
    routed_torch_compiled_autograd,
    stable_generated_vmap_rule_ids,
    torch_compiled_autograd_enabled,
)

__all__ = [
    "CacheEntry",
    "cache_clear_failed",
    "cache_info",
    "disable",
    "enable",
    "replace_torch",
    "reset",
    "stats",
]


@dataclasses.dataclass(frozen=True)
class _HookState:
    """What held the engine's compiled-autograd slot."""

    ours: EngineRuntime | None
    torch_builtin: bool

    @staticmethod
    def current() -> _HookState:
        ours = ca_core.installed_runtime()
        torch_builtin = ours is None and torch_compiled_autograd_enabled()
        return _HookState(ours, torch_builtin)

    def restore(self) -> None:
        if self.ours is not None:
            ca_core.install_engine_hook(self.ours, getattr(self.ours, "compiler_key", "default"))
            return
        ca_core.uninstall_engine_hook()
        if self.torch_builtin:
            rearm_torch_compiled_autograd()


def _valid_backends() -> list[str]:
    return sorted(torch.compiler.list_backends(exclude_tags=()))


#: Backend names found valid before: ``enable("inductor")`` around every
#: backward checks its name once, not once a step (torch's list_backends
#: costs about half of an enable()'s 22 µs). Backends only get registered, so
#: a name once valid stays valid; an unknown name reads the list again. It
#: starts with the backends that torch (pinned at 2.13) registers itself: the
#: first list_backends imports every backend module (AOTAutograd, Inductor's
#: code cache, networkx: about 0.4 s), which a program whose backwards all run
#: before their capture (``capture_after``) never needs; a capture imports what
#: its backend needs when it compiles.
_BACKENDS_FOUND_VALID: set[str] = {"eager", "aot_eager", "inductor"}


@functools.cache
def _background_inductor() -> BackgroundInductor:
    """One backend object for every graph and every enable(), as torch.compile's string backend would be."""
    return BackgroundInductor()


def _compile_in_thread(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """compiler_fn of ``compile_in_background=True``; see [Note: Compiling in the background]."""
    return torch.compile(gm, backend=_background_inductor(), dynamic=None)


def _resolve_compiler(compiler_fn: object, compile_in_background: object = False) -> CompilerFn:
    if not isinstance(compile_in_background, bool):
        raise TypeError(f"compile_in_background must be a bool, got {type(compile_in_background).__name__}")
    if compile_in_background and compiler_fn != "inductor":
        raise ValueError(
            "compile_in_background=True needs compiler_fn='inductor' (the backend whose compile it moves to a "
            f"thread), got {compiler_fn!r}"
        )
    if compile_in_background:
        return _compile_in_thread
    if isinstance(compiler_fn, str):
        if compiler_fn not in _BACKENDS_FOUND_VALID:
            valid = _valid_backends()
            if compiler_fn not in valid:
                shown = [name for name in valid if "TESTING_ONLY" not in name]
                close = difflib.get_close_matches(compiler_fn, shown, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"compiler_fn: unknown backend name {compiler_fn!r}; {hint}valid names are "
                    + ", ".join(shown)
                )
            _BACKENDS_FOUND_VALID.add(compiler_fn)
        backend = compiler_fn

        def compile_with_backend(gm: torch.fx.GraphModule) -> Callable[..., Any]:
            # dynamic=None: static first, and the dims ca_core marks dynamic
            # (see [Note: Dynamic sizes]) are honoured.
            return torch.compile(gm, backend=backend, dynamic=None)

        return compile_with_backend
    if not callable(compiler_fn):
        raise TypeError(
            "compiler_fn must be a callable taking a torch.fx.GraphModule and returning "
            f"a callable, or a backend name string; got {type(compiler_fn).__name__}"
        )
    return compiler_fn


#: Open enable()/disable() contexts, in entry order; see [Note: Contexts entered on several threads].
_open_contexts: list[_HookContext] = []
_open_lock = threading.Lock()


class _HookContext(contextlib.AbstractContextManager[Any]):
    """Installs a hook state on entry; on exit restores what it replaced (see the Notes above)."""

    _prior: _HookState

    def _install(self) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Any:
        with _open_lock:
            if self in _open_contexts:
                raise RuntimeError(
                    "this enable()/disable() context is already open; call ca_runtime.enable(...) again "
                    "for a nested one"
                )
            self._prior = _HookState.current()
            _open_contexts.append(self)
            try:
                return self._install()
            except BaseException:
                _open_contexts.remove(self)
                self._prior.restore()
                raise

    def __exit__(self, *exc_info: object) -> None:
        with _open_lock:
            i = _open_contexts.index(self)
            del _open_contexts[i]
            if i < len(_open_contexts):
                # An inner context is still open: it stays in force and now
                # stands in for what this one replaced.
                _open_contexts[i]._prior = self._prior
            else:
                self._prior.restore()


class _EnableContext(_HookContext):
    """What ``enable()`` returns: installs our hook on entry, restores the prior one on exit.

    It warns if it is never entered: ``ca_runtime.enable("inductor")`` as a
    plain statement would otherwise do nothing at all, silently.
    """

    def __init__(
        self,
        compiler_fn: CompilerFn | str,
        compile_in_background: bool = False,
        eager_if_faster: bool = False,
        capture_after: int = 2,
    ) -> None:
        if not isinstance(eager_if_faster, bool):
            raise TypeError(f"eager_if_faster must be a bool, got {type(eager_if_faster).__name__}")
        if not isinstance(capture_after, int) or isinstance(capture_after, bool):
            raise TypeError(f"capture_after must be an int, got {type(capture_after).__name__}")
        if capture_after < 1:
            raise ValueError(f"capture_after must be at least 1, got {capture_after}")
        self._compiler_fn = compiler_fn
        self._compiler = _resolve_compiler(compiler_fn, compile_in_background)
        self._compile_in_background = compile_in_background
        self._eager_if_faster = eager_if_faster
        self._capture_after = capture_after
        self._entered = False  # set last: a rejected compiler_fn does not warn

    def _install(self) -> Runtime:
        self._entered = True
        keep_hook_across_torch_disable()
        stable_generated_vmap_rule_ids()  # see [Note: Generated vmap rules share a key]
        runtime = Runtime(self._compiler, shown_as=self._compiler_fn)
        runtime.compiler_key = compiler_key(self._compiler_fn, self._compile_in_background)
        runtime.eager_if_faster = self._eager_if_faster and not _deterministic_refuses_timing()
        runtime.capture_after = self._capture_after
        ca_core.install_engine_hook(runtime, runtime.compiler_key)
        return runtime

    def __enter__(self) -> Runtime:
        runtime: Runtime = super().__enter__()
        return runtime

    def __del__(self) -> None:
        if not getattr(self, "_entered", True):
            warnings.warn(
                "ca_runtime.enable(...) was called but never entered, so nothing is compiled: "
                "use it as `with ca_runtime.enable(...):` around the backward",
                RuntimeWarning,
                stacklevel=2,
            )


class _DisableContext(_HookContext):
    """What ``disable()`` returns."""

    def _install(self) -> None:
        ca_core.uninstall_engine_hook()


#: Warnings given once per process ("deterministic": eager_if_faster under deterministic algorithms).
_warned_once: set[str] = set()


def _deterministic_refuses_timing() -> bool:
    """[Note: A reproducible default]
    Which way a timed cache entry serves its hits (compiled or on the eager
    engine) depends on the machine's timing, and the two round differently
    (Inductor's kernels are not eager's), so with ``eager_if_faster=True`` a
    seeded program's gradients can differ between runs and machines. That is
    why it is opt-in, as ``torch.backends.cudnn.benchmark`` is: the default
    runs a graph that compiled, compiled, every time. Under
    ``torch.use_deterministic_algorithms(True)`` (checked when the context is
    entered) it does not time at all: it warns once and runs compiled.
    """
    if not torch.are_deterministic_algorithms_enabled():
        return False
    if "deterministic" not in _warned_once:
        _warned_once.add("deterministic")
        warn_at_user_line(
            "ca_runtime.enable(eager_if_faster=True) chooses between compiled and eager by timing, which is not "
            "reproducible; torch.use_deterministic_algorithms(True) is on, so backwards run compiled and "
            "are not timed",
            RuntimeWarning,
        )
    return True


def enable(
    compiler_fn: CompilerFn | str,
    *,
    compile_in_background: bool = False,
    eager_if_faster: bool = False,
    capture_after: int = 2,
) -> _EnableContext:
    """Compiles every ``backward()``/``autograd.grad`` inside the context.

    ``compiler_fn`` takes the captured ``torch.fx.GraphModule`` and returns a
    callable (e.g. ``lambda gm: torch.compile(gm, backend="inductor")``), or is
    a backend name accepted by ``torch.compile``. With
    ``compile_in_background=True`` (backend ``"inductor"`` only), Inductor
    compiles each new graph's kernels on a thread while backwards run op by op
    or on the eager engine; see [Note: Compiling in the background] and
    ``wait_for_background_compiles()``. By default a graph that compiled
    runs compiled on every hit, so the same program gives the same gradients
    every run. With ``eager_if_faster=True`` (opt-in, timing-based and not
    bitwise reproducible; see [Note: A reproducible default]), each captured
    graph is timed against the eager engine over a few of its cache hits,
    and its backwards run on the eager engine if that was faster (timed
    again later; see [Note: Eager if faster] in ca_core and
    ``cache_info()``). A graph is captured on its ``capture_after``-th
    backward (default 2: the first runs on the eager engine, so a backward
    that runs once is never compiled; 1 captures at once); backwards run by
    ``torch.autograd.gradcheck``/``gradgradcheck`` are never captured (see
    [Note: Which captures wait]). Use it as ``with
    enable(...) as runtime:``; on exit, by return or by exception, the engine
    hook that was active before is restored (see [Note: Restoring the engine
    hook]). A call that is never entered warns.

    The engine hook is process-global: while the context is open, a backward
    on any thread is compiled. Contexts opened on several threads may exit in
    any order; see [Note: Contexts entered on several threads].
    """
    return _EnableContext(compiler_fn, compile_in_background, eager_if_faster, capture_after)


def disable() -> _DisableContext:
    """Runs backwards on the eager engine inside the context, then restores."""
    return _DisableContext()


@contextlib.contextmanager
def replace_torch() -> Iterator[None]:
    """[Note: Running torch's entry points on ca]
    Code written for torch's compiled autograd turns it on with
    ``torch._dynamo.config.compiled_autograd = True`` around ``torch.compile``,
    or with ``torch._dynamo.compiled_autograd._enable(compiler_fn)``. Inside
    ``with ca_runtime.replace_torch():`` both run on ca instead: torch's
    ``_enable`` is replaced by one that enters ``enable(compiler_fn,
    capture_after=1)`` (its ``dynamic`` argument is ignored: ca decides
    dynamic sizes itself; the first backward is captured, as torch's
    compiled autograd captures it, since code written for it may count on
    that), so the
    config path's context, made anew on every call of the compiled function,
    finds one cache (see [Note: Compilers made anew]). On exit torch's own
    ``_enable`` is back. It changes nothing that does not go through those
    entry points; ``TORCH_LOGS=compiled_autograd`` prints ca's logs too (see
    ``_log.py``).
    """
    keep_hook_across_torch_disable()
    with routed_torch_compiled_autograd(functools.partial(enable, capture_after=1)):
        yield


def reset() -> None:
    """Empties the shadow-graph cache (of every compiler), zeroes the counters, forgets ``last_graph()`` and what ``report()`` would show."""
    ca_core.clear_cache()
    forget_captures()
    reset_counters()
    RECORDER.reset()


def cache_clear_failed() -> None:
    """Forgets every failed cache entry: those backwards are captured and compiled again."""
    ca_core.clear_failed()


@atexit.register
def _release_at_exit() -> None:
    """[Note: Releasing at exit]
    The cache holds compiled graphs (Dynamo and Inductor objects, tensors they
    captured) from C++, and the engine hook a runtime. At interpreter exit,
    while Python is still whole, the hook is taken out of the engine (a
    backward started by a late thread runs eagerly) and the cache is
    emptied, so none of these objects is left to be dropped during
    finalisation, where a decref from a non-Python thread (a gloo worker
    finishing a collective) would wait for the GIL that shutdown holds.
    """
    forget_compiler_keys()  # no compiler's weakref callback runs during finalisation
    ca_core.uninstall_engine_hook()
    ca_core.clear_cache()


def stats() -> dict[str, int]:
    """Counters since the last ``reset()``: ``{name: count}``, one per row of the table below.

    ``captures`` (graphs captured and compiled), ``cache_hits`` (backwards
    served from the cache), ``graph_breaks`` (calls that run eagerly behind a
    graph break, summed over the captured graphs), ``eager_fallbacks``
    (backwards run wholly eagerly), ``background_compiles`` and
    ``eager_while_compiling`` (``compile_in_background``), ``uncompiled_runs``
    (graph calls run op by op), ``eager_if_faster_runs`` and ``eager_if_faster_without_walk``
    (``enable(eager_if_faster=True)``). Each counter's meaning is in
    ``ca_runtime._counters.COUNTERS``, their one table.
    """
    return counter_values()


def cache_info() -> list[CacheEntry]:
    """Every captured or failed backward of the shadow-graph cache; see also ``last_graph()``."""
    return [CacheEntry.of(node) for node in ca_core.cache_tree() if node.has_graph or node.failed]
