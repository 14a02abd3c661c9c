"""The OpInfo sweep: every autograd op of torch's op_db, eager vs compiled.

For each op that supports autograd in float32 on CPU, up to ``max_samples``
sample inputs are run: the backward of the sum of the op's differentiable
outputs, eagerly and under compiled autograd, comparing the grads of every
input that requires grad. Each op gets the worst class over its samples:

    mismatch > error > eager-fallback > graph-break-pass > pass

A sample whose *eager* run fails is skipped (not the compiler's fault); a
compiled run that raises is an ``error`` with its first line, never a pass;
grads are compared only when both runs completed, so a wrong grad cannot
hide as an error.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import sys
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

__all__ = ["CLASSES", "OpResult", "run_sweep", "select_ops", "sweep_op"]

#: Result classes, worst first.
CLASSES = ("mismatch", "error", "eager-fallback", "graph-break-pass", "pass", "skipped")


@dataclasses.dataclass(frozen=True)
class OpResult:
    """The class of one op and what decided it."""

    op: str
    result: str
    detail: str = ""
    samples: int = 0
    #: Graphs captured over the op's samples (0 would mean nothing was compiled).
    captures: int = 0


def select_ops(pattern: str = "*") -> list[str]:
    """Names (``name.variant``) of op_db ops with autograd in float32 on CPU matching ``pattern``."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    names = []
    for op in op_db:
        name = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
        if not op.supports_autograd or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        if fnmatch.fnmatchcase(name, pattern):
            names.append(name)
    return names


def _op_by_name(name: str) -> Any:
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if (f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name) == name:
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


def _grads_of(op: Any, sample: Any) -> list[Any] | None:
    """Fresh copies of the sample, backward of the summed outputs; grads of its leaves."""
    import torch
    import torch.utils._pytree as pytree

    inp, args, kwargs = _fresh(sample.input), _fresh(sample.args), _fresh(sample.kwargs)
    leaves = _leaves((inp, args, kwargs))
    out = op(inp, *args, **kwargs)
    outs = [
        t
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    if not outs or not leaves:
        return None
    sum(o.sum() for o in outs).backward()
    return [None if t.grad is None else t.grad.detach().clone() for t in leaves]


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        if x.layout != torch.strided or y.layout != torch.strided:
            x, y = x.to_dense(), y.to_dense()
        if x.shape != y.shape or not torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True):
            return False
    return True


def sweep_op(name: str, backend: str, impl: str, max_samples: int = 2) -> OpResult:
    """Classifies one op; see the module docstring."""
    import torch

    from ca_testkit.implementations import get_implementation

    implementation = get_implementation(impl)
    op = _op_by_name(name)
    torch.manual_seed(0)
    samples = []
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
        samples.append(sample)
        if len(samples) >= max_samples:
            break
    worst, detail, compared, captures = "skipped", "no sample with a differentiable output", 0, 0
    for sample in samples:
        try:
            eager = _grads_of(op, sample)
        except Exception:
            continue
        if eager is None:
            continue
        implementation.reset()
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with implementation.enable(backend):
                    compiled = _grads_of(op, sample)
            except Exception as e:
                first = (str(e).strip().splitlines() or [""])[0]
                result, why = "error", f"{type(e).__name__}: {first}"[:200]
            else:
                stats = implementation.stats()
                captures += stats.get("captures", 0)
                fallback = [w for w in caught if w.category.__name__ == "EagerFallbackWarning"]
                if compiled is None or not _same(eager, compiled):
                    result, why = "mismatch", "grads differ from eager"
                elif fallback:
                    result, why = "eager-fallback", str(fallback[0].message)[:200]
                elif not stats.get("captures", 0):
                    result, why = "eager-fallback", "nothing was captured"
                elif stats.get("graph_breaks", 0):
                    result, why = "graph-break-pass", f"{stats['graph_breaks']} graph break(s)"
                else:
                    result, why = "pass", ""
        compared += 1
        if CLASSES.index(result) < CLASSES.index(worst):
            worst, detail = result, why
    return OpResult(name, worst, detail, compared, captures)


def _sweep_one(name: str, backend: str, impl: str, max_samples: int) -> OpResult:
    """sweep_op, but a failure of the harness itself is reported, not raised."""
    try:
        return sweep_op(name, backend, impl, max_samples)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        return OpResult(name, "error", f"harness: {type(e).__name__}: {first}"[:200])


def _sweep_chunk(names: Sequence[str], backend: str, impl: str, max_samples: int) -> list[OpResult]:
    return [_sweep_one(n, backend, impl, max_samples) for n in names]


def run_sweep(
    names: Sequence[str],
    backend: str,
    impl: str,
    *,
    jobs: int = 1,
    max_samples: int = 2,
    progress: bool = False,
) -> list[OpResult]:
    """Sweeps ``names`` (in ``jobs`` processes), printing progress on a terminal."""
    results: list[OpResult] = []

    def report(batch: Iterable[OpResult]) -> None:
        for r in batch:
            results.append(r)
            if progress:
                print(f"\r[{len(results)}/{len(names)}] {r.op:<40.40} {r.result:<16}", end="", file=sys.stderr)

    if jobs <= 1:
        for name in names:
            report([_sweep_one(name, backend, impl, max_samples)])
    else:
        import multiprocessing

        chunks = [list(names[i::jobs * 4]) for i in range(jobs * 4)]
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_sweep_chunk, c, backend, impl, max_samples) for c in chunks if c]
            for future in futures:
                report(future.result())
    if progress:
        print(file=sys.stderr)
    return sorted(results, key=lambda r: r.op)


def summary_table(results: Sequence[OpResult]) -> str:
    counts = Counter(r.result for r in results)
    width = max(len(c) for c in CLASSES)
    lines = [f"{c:<{width}}  {counts.get(c, 0):>5}" for c in CLASSES]
    return "\n".join(lines + [f"{'total':<{width}}  {len(results):>5}"])


def to_json(results: Sequence[OpResult], backend: str, impl: str) -> dict[str, Any]:
    return {
        "impl": impl,
        "backend": backend,
        "counts": dict(Counter(r.result for r in results)),
        "ops": {
            r.op: {"result": r.result, "detail": r.detail, "samples": r.samples, "captures": r.captures}
            for r in results
        },
    }


def markdown_comparison(reports: Sequence[dict[str, Any]]) -> str:
    """Counts per class side by side, then every op whose class differs between reports."""
    head = "| class | " + " | ".join(f"{r['impl']} ({r['backend']})" for r in reports) + " |"
    lines = [head, "|---|" + "---|" * len(reports)]
    for c in CLASSES:
        lines.append(f"| {c} | " + " | ".join(str(r["counts"].get(c, 0)) for r in reports) + " |")
    ops = sorted(set().union(*(r["ops"] for r in reports)))
    differing = [o for o in ops if len({r["ops"].get(o, {}).get("result") for r in reports}) > 1]
    if differing:
        lines += ["", "| op | " + " | ".join(r["impl"] for r in reports) + " |", "|---|" + "---|" * len(reports)]
        for o in differing:
            cells = [r["ops"].get(o, {}).get("result", "-") for r in reports]
            lines.append(f"| {o} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
