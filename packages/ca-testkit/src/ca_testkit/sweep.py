"""The OpInfo sweep: every autograd op of torch's op_db, eager vs compiled.

For each op that supports autograd in a given dtype on CPU (float32 unless
asked otherwise; ``supported_dtypes`` and ``supported_backward_dtypes``), its
sample inputs (the first ``max_samples``, or all of them) are run: the
backward of a real scalar loss over the op's differentiable outputs (the sum
of a real output; ``real.sum() + imag.sum()`` of a complex one), eagerly and
under compiled autograd, comparing the grads of every input that requires
grad. Results are per (op, dtype), keyed ``op[dtype]``. Each gets the worst
class over its samples:

    mismatch > error > timeout > eager-fallback > graph-break-pass > pass

[Note: Samples share the cache]
All samples of one (op, dtype) run in one process, in order, with the
compiled-autograd cache and Dynamo reset once before the first sample only,
as a training loop would meet them: later samples hit (or recapture with
dynamic sizes) the graphs of earlier ones, so a stale or wrongly generalised
cache entry shows up as a mismatch of a later sample. ``cache_hits`` counts
the backwards served from the cache (ours only; torch's implementation
reports captures alone).

A sample whose *eager* run fails is skipped (not the compiler's fault); a
compiled run that raises is an ``error`` with its first line, never a pass;
grads are compared only when both runs completed, so a wrong grad cannot
hide as an error. Every detail names the sample (its index in
``op.sample_inputs``) that decided the class.

[Note: Per-op time limit]
An (op, dtype) that runs past ``timeout`` seconds is a ``timeout``: a
SIGALRM timer raises ``OpTimeout`` in the main thread, again every 2 s until
it propagates (a library that swallows one exception cannot hide it), and a
flag set by the handler makes the op a timeout even where the exception was
swallowed and turned into something else (an eager fallback, an error).
Workers (``jobs > 1``) run one (op, dtype) at a time; a worker whose op
timed out is replaced by a fresh process (the exception may have left torch
state half-done), and the parent kills and replaces a worker that has not
answered ``KILL_GRACE`` seconds after the limit (stuck in C++, where a
Python signal handler cannot run) or that died (a crash is an ``error``).
With ``jobs == 1`` the sweep runs in-process with the same timer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import json
import signal
import sys
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "CLASSES",
    "NOT_PASSING",
    "OpResult",
    "OpTimeout",
    "markdown_comparison",
    "parse_dtypes",
    "run_sweep",
    "select",
    "select_ops",
    "summary",
    "summary_table",
    "sweep_op",
    "to_json",
    "write_json",
]

#: Result classes, worst first.
CLASSES = ("mismatch", "error", "timeout", "eager-fallback", "graph-break-pass", "pass", "skipped")
#: Classes the summary lists op by op.
NOT_PASSING = tuple(c for c in CLASSES if c not in ("pass", "skipped"))
#: Default per-(op, dtype) time limit in seconds: the slowest (op, dtype) with all its samples
#: (nn.functional.max_pool2d, 1,440 samples; linalg.solve_triangular[complex64]) takes 60-105 s
#: on an idle 2-core machine, about twice that on a busy one.
DEFAULT_TIMEOUT = 300.0
#: Seconds after the limit before the parent kills a worker that has not answered.
KILL_GRACE = 30.0
#: JSON format: 1 keyed ops by name (float32 only); 2 keys them ``op[dtype]``.
JSON_VERSION = 2

#: (rtol, atol) of the grad comparison per dtype; float32's for any other.
_TOLERANCES = {
    "float64": (1e-7, 1e-7),
    "complex128": (1e-7, 1e-7),
    "float16": (1e-2, 1e-2),
    "bfloat16": (1.6e-2, 1e-2),
}
_DEFAULT_TOLERANCE = (1e-4, 1e-5)


@dataclasses.dataclass(frozen=True)
class OpResult:
    """The class of one (op, dtype) and what decided it."""

    op: str
    result: str
    detail: str = ""
    #: Samples compared (eager completed with a differentiable output).
    samples: int = 0
    #: Graphs captured over the op's samples (0 would mean nothing was compiled).
    captures: int = 0
    dtype: str = "float32"
    #: Backwards served from the cache over the op's samples (ours only).
    cache_hits: int = 0
    #: Wall time of the whole (op, dtype), sampling included.
    seconds: float = 0.0

    @property
    def key(self) -> str:
        """``op[dtype]``, the result's name in the summary and the JSON."""
        return f"{self.op}[{self.dtype}]"


class OpTimeout(TimeoutError):
    """Raised in the main thread when an (op, dtype) runs past its time limit."""


def _op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: {name!r} is not a torch dtype (e.g. float32, float64, complex64)")
    return dtype


def parse_dtypes(text: str) -> tuple[str, ...]:
    """``"float32,complex64"`` -> ``("float32", "complex64")``, canonical names, no duplicates."""
    names: list[str] = []
    for part in text.split(","):
        if not part.strip():
            continue
        name = str(_torch_dtype(part.strip())).removeprefix("torch.")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("dtype: no dtype given")
    return tuple(names)


def select_ops(pattern: str = "*", dtype: str = "float32") -> list[str]:
    """Sorted names (``name.variant``) of op_db ops with autograd in ``dtype`` on CPU matching ``pattern``.

    ``pattern`` is an fnmatch pattern, or several separated by commas (``"add,mul*"``).
    """
    from torch.testing._internal.common_methods_invocations import op_db

    torch_dtype = _torch_dtype(dtype)
    names = set()
    for op in op_db:
        if not op.supports_autograd:
            continue
        if torch_dtype not in op.supported_dtypes("cpu") or torch_dtype not in op.supported_backward_dtypes(
            "cpu"
        ):
            continue
        name = _op_name(op)
        if any(fnmatch.fnmatchcase(name, p.strip()) for p in pattern.split(",") if p.strip()):
            names.add(name)
    return sorted(names)


def select(pattern: str = "*", dtypes: Sequence[str] = ("float32",), every: int = 1) -> list[tuple[str, str]]:
    """The (op, dtype) pairs to sweep: every ``every``-th op of the sorted ops
    supporting any of ``dtypes``, with each of those dtypes it supports."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    per_dtype = {d: set(select_ops(pattern, d)) for d in dtypes}
    names = sorted(set().union(*per_dtype.values()))[::every]
    return [(n, d) for n in names for d in dtypes if n in per_dtype[d]]


def _op_by_name(name: str) -> Any:
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if _op_name(op) == name:
            return op
    raise ValueError(f"ops: no OpInfo named {name!r}")


def _fresh(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _leaves(value: Any) -> list[Any]:
    import torch
    import torch.utils._pytree as pytree

    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _loss(outs: Sequence[Any]) -> Any:
    """A real scalar: the sum of each real output, ``real.sum() + imag.sum()`` of a complex one."""
    total = None
    for o in outs:
        term = o.real.sum() + o.imag.sum() if o.is_complex() else o.sum()
        total = term if total is None else total + term
    return total


def _grads_of(op: Any, sample: Any) -> list[Any] | None:
    """Fresh copies of the sample, backward of the loss of its outputs; grads of its leaves."""
    import torch
    import torch.utils._pytree as pytree

    inp, args, kwargs = _fresh(sample.input), _fresh(sample.args), _fresh(sample.kwargs)
    leaves = _leaves((inp, args, kwargs))
    out = op(inp, *args, **kwargs)
    outs = [
        t
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]
    if not outs or not leaves:
        return None
    _loss(outs).backward()
    return [None if t.grad is None else t.grad.detach().clone() for t in leaves]


def _difference(eager: list[Any], compiled: list[Any], dtype: str) -> str | None:
    """None if the grads match within the dtype's tolerance, else what differs first."""
    import torch

    rtol, atol = _TOLERANCES.get(dtype, _DEFAULT_TOLERANCE)
    if len(eager) != len(compiled):
        return f"{len(compiled)} grads, eager has {len(eager)}"
    for i, (a, b) in enumerate(zip(eager, compiled)):
        x, y = a, b
        if (x is None) != (y is None):
            return f"grad {i} is {'None' if y is None else 'a tensor'}, eager's is {'None' if x is None else 'a tensor'}"
        if x is None:
            continue
        if x.layout != torch.strided or y.layout != torch.strided:
            x, y = x.to_dense(), y.to_dense()
        if x.shape != y.shape:
            return f"grad {i} has shape {tuple(y.shape)}, eager's {tuple(x.shape)}"
        if x.dtype != y.dtype:
            return f"grad {i} has dtype {y.dtype}, eager's {x.dtype}"
        if not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            err = (x - y).abs()
            err = torch.where(x.isnan() & y.isnan(), torch.zeros_like(err), err).nan_to_num(nan=float("inf"))
            worst = err.max().item() if err.numel() else 0.0
            return f"grad {i} (shape {tuple(x.shape)}) differs from eager: max abs err {worst:.3g}"
    return None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


class _Limit:
    """The SIGALRM timer of one (op, dtype); see [Note: Per-op time limit]."""

    RETRY = 2.0

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.expired = False
        self.active = False
        self._previous: Any = None
        # Signals are delivered to the main thread only; elsewhere (or without
        # SIGALRM) there is no limit.
        self.usable = bool(
            seconds
            and seconds > 0
            and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
        )

    def _handler(self, signum: int, frame: Any) -> None:
        if not self.active:
            return
        self.expired = True
        raise OpTimeout(f"no result within {self.seconds:g} s")

    def arm(self) -> None:
        if not self.usable:
            return
        self._previous = signal.signal(signal.SIGALRM, self._handler)
        self.active = True
        signal.setitimer(signal.ITIMER_REAL, float(self.seconds or 0), self.RETRY)

    def disarm(self) -> None:
        """Idempotent: cancels the timer and puts the previous handler back."""
        if not self.active:
            return
        self.active = False
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, self._previous)


@dataclasses.dataclass
class _Tally:
    worst: str = "skipped"
    detail: str = "no sample with a differentiable output"
    compared: int = 0
    captures: int = 0
    cache_hits: int = 0

    def add(self, result: str, detail: str) -> None:
        if CLASSES.index(result) < CLASSES.index(self.worst):
            self.worst, self.detail = result, detail


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def _compare_sample(
    op: Any,
    sample: Any,
    index: int,
    backend: Any,
    implementation: Any,
    dtype: str,
    limit: _Limit,
    tally: _Tally,
) -> None:
    """Runs one sample eagerly then compiled (cache kept from the earlier samples) and tallies it."""
    try:
        eager = _grads_of(op, sample)
    except Exception:  # noqa: BLE001 - an op eager cannot run is skipped, whatever it raises
        if limit.expired:
            raise OpTimeout("eager run interrupted") from None
        return
    if eager is None:
        return
    before = implementation.stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with implementation.enable(backend):
                compiled = _grads_of(op, sample)
        except Exception as e:  # noqa: BLE001 - any failure of the compiled run is an error result
            if limit.expired:
                raise OpTimeout("compiled run interrupted") from None
            result, why = "error", _first_line(e)
        else:
            if limit.expired:
                # The timer's exception was swallowed (e.g. into an eager fallback).
                raise OpTimeout("compiled run interrupted")
            after = implementation.stats()
            captures, hits = _delta(after, before, "captures"), _delta(after, before, "cache_hits")
            breaks, fallbacks = (
                _delta(after, before, "graph_breaks"),
                _delta(after, before, "eager_fallbacks"),
            )
            tally.captures += captures
            tally.cache_hits += hits
            warned = [w for w in caught if w.category.__name__ == "EagerFallbackWarning"]
            difference = (
                "no differentiable output" if compiled is None else _difference(eager, compiled, dtype)
            )
            if difference is not None:
                result, why = "mismatch", difference
            elif warned:
                result, why = "eager-fallback", str(warned[0].message)
            elif fallbacks:
                result, why = (
                    "eager-fallback",
                    f"{fallbacks} backward(s) ran eagerly (failure remembered in the cache)",
                )
            elif "cache_hits" in after and not captures and not hits:
                result, why = "eager-fallback", "nothing was captured or served from the cache"
            elif breaks:
                breaks_warned = [w for w in caught if w.category.__name__ == "GraphBreakWarning"]
                why = f"{breaks} graph break(s)" + (f": {breaks_warned[0].message}" if breaks_warned else "")
                result = "graph-break-pass"
            else:
                result, why = "pass", ""
    tally.compared += 1
    tally.add(result, f"sample {index}: {why}"[:300] if why else "")


def sweep_op(
    name: str,
    backend: Any,
    impl: str,
    max_samples: int | None = 2,
    *,
    dtype: str = "float32",
    timeout: float | None = None,
) -> OpResult:
    """Classifies one (op, dtype) over its first ``max_samples`` samples (None: all); see the module docstring."""
    import torch

    from ca_testkit.implementations import get_implementation

    implementation = get_implementation(impl)
    op = _op_by_name(name)
    torch_dtype = _torch_dtype(dtype)
    start = time.perf_counter()
    tally = _Tally()
    index = -1
    # See [Note: Samples share the cache]: reset once per op, never per sample.
    implementation.reset()
    torch._dynamo.reset()
    limit = _Limit(timeout)
    try:
        limit.arm()
        try:
            torch.manual_seed(0)
            samples = list(
                itertools.islice(op.sample_inputs("cpu", torch_dtype, requires_grad=True), max_samples)
            )
            for index, sample in enumerate(samples):
                _compare_sample(op, sample, index, backend, implementation, dtype, limit, tally)
        finally:
            limit.disarm()
    except OpTimeout:
        limit.disarm()
        where = "while sampling" if index < 0 else f"at sample {index}"
        tally.add("timeout", f"no result within {timeout:g} s ({where}, {tally.compared} compared before)")
    if tally.compared and tally.worst == "pass" and not tally.captures and not tally.cache_hits:
        # An implementation without a cache-hit counter: judged over the whole op.
        tally.worst, tally.detail = "eager-fallback", "nothing was captured"
    return OpResult(
        name,
        tally.worst,
        tally.detail,
        tally.compared,
        tally.captures,
        dtype=dtype,
        cache_hits=tally.cache_hits,
        seconds=round(time.perf_counter() - start, 3),
    )


def _sweep_one(
    name: str,
    backend: Any,
    impl: str,
    max_samples: int | None,
    dtype: str = "float32",
    timeout: float | None = None,
) -> OpResult:
    """sweep_op, but a failure of the harness itself is reported, not raised."""
    start = time.perf_counter()
    try:
        return sweep_op(name, backend, impl, max_samples, dtype=dtype, timeout=timeout)
    except OpTimeout:
        # The timer fired between the op's own handling and its disarm.
        return OpResult(
            name,
            "timeout",
            f"no result within {timeout} s",
            dtype=dtype,
            seconds=round(time.perf_counter() - start, 3),
        )
    except Exception as e:  # noqa: BLE001 - a harness failure is one op's result, not the sweep's end
        return OpResult(
            name,
            "error",
            f"harness: {_first_line(e)}"[:300],
            dtype=dtype,
            seconds=round(time.perf_counter() - start, 3),
        )


def _worker(conn: Any, backend: Any, impl: str, max_samples: int | None, timeout: float | None) -> None:
    """A spawned worker: (op, dtype) tasks in, OpResults out, until None or a timeout."""
    import warnings as _warnings

    _warnings.simplefilter("ignore")
    import torch  # noqa: F401
    from torch.testing._internal.common_methods_invocations import op_db  # noqa: F401

    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        name, dtype = task
        result = _sweep_one(name, backend, impl, max_samples, dtype, timeout)
        conn.send(result)
        if result.result == "timeout":
            return  # torch state may be half-done: the parent starts a fresh worker


@dataclasses.dataclass
class _Worker:
    """The parent's view of one worker process."""

    process: Any
    conn: Any
    ready: bool = False
    #: The (op, dtype) it is running, and since when (time.monotonic()).
    task: tuple[str, str] | None = None
    since: float = 0.0


def _run_workers(
    tasks: Sequence[tuple[str, str]],
    backend: Any,
    impl: str,
    jobs: int,
    max_samples: int | None,
    timeout: float | None,
    report: Callable[[Sequence[OpResult]], None],
) -> None:
    """Runs ``tasks`` on ``jobs`` spawned workers; see [Note: Per-op time limit]."""
    import multiprocessing
    from multiprocessing.connection import Connection, wait

    ctx = multiprocessing.get_context("spawn")
    pending = deque(tasks)
    hard_limit = timeout + KILL_GRACE if timeout and timeout > 0 else None
    workers: dict[Connection, _Worker] = {}

    def start() -> None:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_worker, args=(child, backend, impl, max_samples, timeout), daemon=True)
        process.start()
        child.close()
        workers[parent] = _Worker(process, parent)

    def stop(worker: _Worker, kill: bool = False) -> None:
        workers.pop(worker.conn, None)
        if kill:
            worker.process.kill()
        else:
            with contextlib.suppress(OSError):
                worker.conn.send(None)
        worker.process.join(10)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()

    def replace(worker: _Worker, result: str, detail: str) -> None:
        """Reports the worker's op as ``result``, kills the worker, starts another if work is left."""
        stop(worker, kill=True)
        if worker.task is not None:
            seconds = round(time.monotonic() - worker.since, 3)
            report([OpResult(worker.task[0], result, detail, dtype=worker.task[1], seconds=seconds)])
        if pending:
            start()

    def dispatch(worker: _Worker) -> None:
        if pending:
            worker.task, worker.since = pending.popleft(), time.monotonic()
            worker.conn.send(worker.task)
        else:
            stop(worker)

    try:
        for _ in range(min(jobs, len(pending))):
            start()
        while workers:
            for conn in wait(list(workers), timeout=1.0):
                worker = workers[conn]  # type: ignore[index]
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError) as died:
                    worker.process.join(10)
                    if not worker.ready:
                        stop(worker, kill=True)
                        raise RuntimeError(
                            f"sweep: a worker failed to start (exit code {worker.process.exitcode})"
                        ) from died
                    replace(worker, "error", f"worker died (exit code {worker.process.exitcode})")
                    continue
                if message == "ready":
                    worker.ready = True
                    dispatch(worker)
                    continue
                worker.task = None
                report([message])
                if message.result == "timeout":
                    replace(worker, "", "")  # it exits by itself after a timeout; see _worker
                else:
                    dispatch(worker)
            if hard_limit is not None:
                now = time.monotonic()
                for worker in list(workers.values()):
                    if worker.task is not None and now - worker.since > hard_limit:
                        detail = (
                            f"no result within {timeout:g} s; worker killed after {now - worker.since:.0f} s "
                            "(did not return to Python)"
                        )
                        replace(worker, "timeout", detail)
    finally:
        for worker in list(workers.values()):
            stop(worker, kill=True)


def run_sweep(
    names: Sequence[str | tuple[str, str]],
    backend: Any,
    impl: str,
    *,
    jobs: int = 1,
    max_samples: int | None = 2,
    timeout: float | None = DEFAULT_TIMEOUT,
    progress: bool = False,
) -> list[OpResult]:
    """Sweeps ``names`` (op names, float32, or (op, dtype) pairs) in ``jobs`` processes.

    With ``progress``, writes to stderr each result that does not pass as it
    comes, and a status line (rewritten in place on a terminal, every minute
    otherwise).
    """
    tasks = [(n, "float32") if isinstance(n, str) else (n[0], n[1]) for n in names]
    results: list[OpResult] = []
    tty = progress and sys.stderr.isatty()
    started = last_line = time.monotonic()

    def report(batch: Sequence[OpResult]) -> None:
        nonlocal last_line
        for r in batch:
            results.append(r)
            if not progress:
                continue
            if r.result in NOT_PASSING:
                print(
                    ("\r\x1b[K" if tty else "") + f"  {r.result:<16} {r.key}: {r.detail}",
                    file=sys.stderr,
                    flush=True,
                )
            now = time.monotonic()
            status = f"[{len(results)}/{len(tasks)}] {now - started:6.0f} s  {r.key:<48.48} {r.result:<16}"
            if tty:
                print("\r" + status, end="", file=sys.stderr)
            elif now - last_line >= 60 or len(results) == len(tasks):
                print(status, file=sys.stderr, flush=True)
                last_line = now

    if jobs <= 1:
        for name, dtype in tasks:
            report([_sweep_one(name, backend, impl, max_samples, dtype, timeout)])
    else:
        _run_workers(tasks, backend, impl, jobs, max_samples, timeout, report)
    if tty:
        print(file=sys.stderr)
    return sorted(results, key=lambda r: (r.op, r.dtype))


def summary_table(results: Sequence[OpResult]) -> str:
    counts = Counter(r.result for r in results)
    width = max(len(c) for c in CLASSES)
    lines = [f"{c:<{width}}  {counts.get(c, 0):>5}" for c in CLASSES]
    return "\n".join([*lines, f"{'total':<{width}}  {len(results):>5}"])


def summary(results: Sequence[OpResult]) -> str:
    """The table, the counts of ops and samples compared, then every result that
    did not pass, grouped by class, with its cause."""
    lines = [summary_table(results), ""]
    ops = len({r.op for r in results})
    dtypes = sorted({r.dtype for r in results})
    lines.append(
        f"{ops} ops, {len(results)} (op, dtype) results ({', '.join(dtypes) or '-'}), "
        f"{sum(r.samples for r in results)} samples compared, "
        f"{sum(r.captures for r in results)} captures, {sum(r.cache_hits for r in results)} cache hits"
    )
    for c in NOT_PASSING:
        failing = [r for r in results if r.result == c]
        if failing:
            lines += ["", f"{c} ({len(failing)}):"]
            lines += [f"  {r.key}: {r.detail or '-'}" for r in failing]
    return "\n".join(lines)


def to_json(results: Sequence[OpResult], backend: Any, impl: str, **settings: Any) -> dict[str, Any]:
    """The report: settings (dtypes, samples, every, timeout...), counts, totals, and every result by key."""
    return {
        "version": JSON_VERSION,
        "impl": impl,
        "backend": backend if isinstance(backend, str) else repr(backend),
        **settings,
        "counts": dict(Counter(r.result for r in results)),
        "totals": {
            "ops": len({r.op for r in results}),
            "results": len(results),
            "samples": sum(r.samples for r in results),
            "captures": sum(r.captures for r in results),
            "cache_hits": sum(r.cache_hits for r in results),
        },
        "ops": {
            r.key: {
                "op": r.op,
                "dtype": r.dtype,
                "result": r.result,
                "detail": r.detail,
                "samples": r.samples,
                "captures": r.captures,
                "cache_hits": r.cache_hits,
                "seconds": r.seconds,
            }
            for r in results
        },
    }


def _ops_of(report: dict[str, Any]) -> dict[str, Any]:
    """A report's results keyed ``op[dtype]``; version 1 keyed float32 ops by name."""
    if report.get("version", 1) >= 2:
        return report["ops"]
    return {f"{name}[float32]": v for name, v in report["ops"].items()}


def markdown_comparison(reports: Sequence[dict[str, Any]]) -> str:
    """Counts per class side by side, then every (op, dtype) whose class differs between reports.

    Reads version-1 JSON (float32 results keyed by op name) as well.
    """
    ops_of = [_ops_of(r) for r in reports]
    head = "| class | " + " | ".join(f"{r['impl']} ({r['backend']})" for r in reports) + " |"
    lines = [head, "|---|" + "---|" * len(reports)]
    for c in CLASSES:
        lines.append(f"| {c} | " + " | ".join(str(r["counts"].get(c, 0)) for r in reports) + " |")
    lines.append("| (op, dtype) results | " + " | ".join(str(len(o)) for o in ops_of) + " |")
    lines.append(
        "| samples compared | "
        + " | ".join(str(sum(v.get("samples", 0) for v in o.values())) for o in ops_of)
        + " |"
    )
    keys = sorted(set().union(*ops_of))
    differing = [k for k in keys if len({o.get(k, {}).get("result") for o in ops_of}) > 1]
    if differing:
        lines += [
            "",
            "| op | " + " | ".join(r["impl"] for r in reports) + " |",
            "|---|" + "---|" * len(reports),
        ]
        for k in differing:
            cells = [o.get(k, {}).get("result", "-") for o in ops_of]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
