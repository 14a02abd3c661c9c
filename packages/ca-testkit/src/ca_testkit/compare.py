"""``compare()``: one step run eagerly and compiled, every tensor compared.

Eager autograd is the oracle. The step runs ``steps`` times on the eager
engine (inside ``ca_runtime.disable()``), the values and ``.grad`` fields of
``tensors`` are put back as they were (a step may update parameters, e.g. an
optimizer in a post-accumulate-grad hook), then it runs ``steps`` times inside
``ca_runtime.enable(compiler_fn, capture_after=1)`` (see [Note: Differential
runs capture at once] in ca_testkit.implementations). Returned values (any pytree of tensors)
and ``.grad`` fields after each step are compared pairwise.

[Note: A float64 reference for rounding backends]
Inductor fuses and reorders float arithmetic, so its float32 results are
not eager's bit for bit, and a fixed rtol/atol cannot tell its rounding from
a wrong gradient: a second derivative through ``pow`` and ``tanh`` differs
from eager by 5e-5 relative under Inductor with neither of them wrong. A
``reference`` step (the same program on the same values in float64) settles
it as torch's own Inductor tests do: a returned tensor outside rtol/atol
still passes when the compiled value is no farther from the float64 value
than twice eager's distance plus atol/10 (its note says so, with both
distances). A wrong gradient is far from both; rounding is as close as
eager's. Only returned values are judged this way (the reference builds its
own tensors, not ``tensors``), the reference runs only when such a tensor
differs, and without ``reference`` nothing changes: backends that keep
eager's arithmetic (eager, aot_eager) are compared as before.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ca_runtime
import torch
import torch.utils._pytree as pytree

from ca_testkit.implementations import get_implementation

__all__ = ["Comparison", "TensorDiff", "compare"]

Tensors = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[torch.Tensor | torch.nn.Module]


@dataclasses.dataclass(frozen=True)
class TensorDiff:
    """How one tensor of the compiled run differs from eager."""

    name: str
    ok: bool
    max_abs: float
    max_rel: float
    shape: tuple[int, ...] | None
    dtype: str | None
    note: str = ""

    def line(self) -> str:
        status = "ok      " if self.ok else "MISMATCH"
        shape = "None" if self.shape is None else "x".join(map(str, self.shape)) or "scalar"
        text = (
            f"{status} {self.name:<40} max_abs={self.max_abs:.3g} max_rel={self.max_rel:.3g} "
            f"shape={shape} dtype={self.dtype}"
        )
        return f"{text} ({self.note})" if self.note else text


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The result of ``compare()``."""

    diffs: tuple[TensorDiff, ...]
    stats: Mapping[str, int]
    steps: int
    impl: str = "ca"

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.diffs)

    @property
    def mismatches(self) -> tuple[TensorDiff, ...]:
        return tuple(d for d in self.diffs if not d.ok)

    def summary(self) -> str:
        """One line: what failed (values, hook order/log, captures), or ``ok``."""
        bad = self.mismatches
        if not bad:
            return f"[{self.impl}] ok"
        captures = [d for d in bad if d.name == "captures"]
        tensors = [d for d in bad if d.shape is not None or d.max_abs == float("inf")]
        others = [d for d in bad if d not in captures and d not in tensors]
        parts = []
        if tensors:
            parts.append(
                f"{len(tensors)} value(s) differ ({', '.join(d.name for d in tensors[:3])}"
                + (", ..." if len(tensors) > 3 else "")
                + ")"
            )
        if others:
            parts.append(f"{len(others)} non-tensor result(s) differ, e.g. hook order/log ({others[0].name})")
        if captures:
            parts.append("nothing was captured")
        return f"[{self.impl}] " + "; ".join(parts)

    def report(self) -> str:
        head = (
            f"[{self.impl}] {len(self.mismatches)} of {len(self.diffs)} values differ over "
            f"{self.steps} step(s); stats: " + ", ".join(f"{k}={v}" for k, v in self.stats.items())
        )
        return "\n".join([head, *(d.line() for d in self.diffs)])

    def assert_ok(self) -> None:
        if not self.ok:
            raise AssertionError("compiled autograd differs from eager:\n" + self.report())


def _named(tensors: Tensors) -> dict[str, torch.Tensor]:
    if isinstance(tensors, torch.nn.Module):
        return dict(tensors.named_parameters())
    if isinstance(tensors, Mapping):
        return dict(tensors)
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors must be a module, a mapping or a sequence of tensors, not a tensor")
    named: dict[str, torch.Tensor] = {}
    for i, item in enumerate(tensors):
        if isinstance(item, torch.nn.Module):  # compare(tensors=[model, head]): each module's parameters
            named.update({f"{i}.{name}": p for name, p in item.named_parameters()})
        elif isinstance(item, torch.Tensor):
            named[str(i)] = item
        else:
            raise TypeError(f"tensors[{i}] must be a tensor or a module, not {type(item).__name__}")
    return named


def _as_step(step: Callable[..., Any]) -> Callable[[int], Any]:
    if not callable(step):
        raise TypeError(f"step must be callable, got {type(step).__name__}")
    try:
        takes_index = bool(inspect.signature(step).parameters)
    except (TypeError, ValueError):
        takes_index = True
    return step if takes_index else (lambda _i: step())


def _snapshot(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "full_tensor"):  # a sharded DTensor (FSDP2): compare the whole tensor
        value = value.full_tensor()
    return value.detach().clone()


def _run(step: Callable[[int], Any], steps: int, named: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    records = []
    for i in range(steps):
        out = step(i)
        leaves, _ = pytree.tree_flatten(out)
        record = {f"step{i}.return[{k}]": _snapshot(v) for k, v in enumerate(leaves)}
        record.update({f"step{i}.grad[{name}]": _snapshot(t.grad) for name, t in named.items()})
        records.append(record)
    return records


def _diff(name: str, eager: Any, compiled: Any, rtol: float, atol: float) -> TensorDiff:
    if not isinstance(eager, torch.Tensor) or not isinstance(compiled, torch.Tensor):
        same = type(eager) is type(compiled) and (
            eager == compiled
            if not isinstance(eager, float)
            else math.isclose(eager, compiled, rel_tol=rtol, abs_tol=atol)
        )
        note = "" if same else f"eager {eager!r} vs compiled {compiled!r}"
        return TensorDiff(name, bool(same), 0.0, 0.0, None, None, note)
    shape, dtype = tuple(eager.shape), str(eager.dtype).removeprefix("torch.")
    if eager.shape != compiled.shape or eager.dtype != compiled.dtype:
        note = f"compiled has shape {tuple(compiled.shape)} dtype {compiled.dtype}"
        return TensorDiff(name, False, math.inf, math.inf, shape, dtype, note)
    if eager.numel() == 0:
        return TensorDiff(name, True, 0.0, 0.0, shape, dtype)
    e, c = eager.double(), compiled.double()
    err = (e - c).abs().nan_to_num(nan=math.inf)
    both_nan = e.isnan() & c.isnan()
    err = torch.where(both_nan, torch.zeros_like(err), err)
    max_abs = float(err.max())
    max_rel = float((err / e.abs().clamp_min(torch.finfo(torch.float64).tiny)).max())
    ok = bool(torch.allclose(c, e, rtol=rtol, atol=atol, equal_nan=True))
    return TensorDiff(name, ok, max_abs, max_rel, shape, dtype)


#: How much farther from the float64 reference than eager a rounding backend's value may be.
_REFERENCE_ERROR_FACTOR = 2.0


def _judged_by_reference(
    diffs: list[TensorDiff],
    eager: list[dict[str, Any]],
    compiled: list[dict[str, Any]],
    reference: Callable[[int], Any],
    steps: int,
    atol: float,
) -> list[TensorDiff]:
    """``diffs`` with each differing returned tensor re-judged against a float64 run; see [Note: A float64 reference for rounding backends]."""
    if all(d.ok or ".return[" not in d.name or d.shape is None for d in diffs):
        return diffs
    with ca_runtime.disable():
        expected = _run(reference, steps, {})
    by_name = {name: value for record in expected for name, value in record.items()}
    by_name_eager = {name: value for record in eager for name, value in record.items()}
    by_name_compiled = {name: value for record in compiled for name, value in record.items()}
    judged = []
    for d in diffs:
        ref = by_name.get(d.name)
        if d.ok or d.shape is None or not isinstance(ref, torch.Tensor) or tuple(ref.shape) != d.shape:
            judged.append(d)
            continue
        ref64 = ref.double()
        eager_error = float((by_name_eager[d.name].double() - ref64).abs().nan_to_num(nan=math.inf).max())
        compiled_error = float(
            (by_name_compiled[d.name].double() - ref64).abs().nan_to_num(nan=math.inf).max()
        )
        ok = math.isfinite(compiled_error) and compiled_error <= (
            _REFERENCE_ERROR_FACTOR * eager_error + atol / 10
        )
        note = f"float64 reference: compiled {compiled_error:.3g} from it, eager {eager_error:.3g}"
        judged.append(dataclasses.replace(d, ok=ok, note=f"{d.note}; {note}" if d.note else note))
    return judged


def compare(
    step: Callable[..., Any],
    compiler_fn: Callable[..., Any] | str,
    *,
    tensors: Tensors = (),
    steps: int = 1,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    impl: str = "ca",
    expect_capture: bool = True,
    reference: Callable[..., Any] | None = None,
) -> Comparison:
    """Runs ``step`` eagerly and under compiled autograd ``impl``; compares.

    ``impl`` is ``"ca"`` (``ca_runtime.enable(compiler_fn, capture_after=1)``) or ``"torch"``
    (torch's built-in compiled autograd); see ``ca_testkit.implementations``.

    ``step`` is called as ``step(i)`` (or ``step()``) for ``i in range(steps)``;
    whatever it returns is compared, and so is ``.grad`` of every tensor in
    ``tensors`` after each step. The counters in ``Comparison.stats`` are those
    of the compiled run alone (the cache and counters are reset before it).

    With ``expect_capture`` (the default) a run where nothing was captured is
    a failure too: eager's answer from a backward that never compiled proves
    nothing. Pass False where no backward may happen at all.

    ``reference``, called as ``step`` is, runs the same step in float64 on the
    eager engine; a returned tensor that differs passes if it is within a
    rounding backend's error of it (see [Note: A float64 reference for
    rounding backends]).
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if reference is not None and not callable(reference):
        raise TypeError(f"reference must be callable or None, got {type(reference).__name__}")
    implementation = get_implementation(impl)
    run = _as_step(step)
    named = _named(tensors)
    initial = {name: _snapshot(t.grad) for name, t in named.items()}
    initial_values = {name: t.detach().clone() for name, t in named.items()}

    with ca_runtime.disable():
        eager = _run(run, steps, named)
    with torch.no_grad():
        for name, t in named.items():
            t.copy_(initial_values[name])
            t.grad = None if initial[name] is None else initial[name].clone()

    implementation.reset()
    with implementation.enable(compiler_fn):
        compiled = _run(run, steps, named)
    stats = implementation.stats()

    diffs = []
    for eager_record, compiled_record in zip(eager, compiled):
        names = list(eager_record) + [n for n in compiled_record if n not in eager_record]
        for name in names:
            if name not in compiled_record or name not in eager_record:
                diffs.append(TensorDiff(name, False, math.inf, math.inf, None, None, "missing in one run"))
                continue
            diffs.append(_diff(name, eager_record[name], compiled_record[name], rtol, atol))
    if reference is not None:
        diffs = _judged_by_reference(diffs, eager, compiled, _as_step(reference), steps, atol)
    if expect_capture and stats.get("captures", 0) + stats.get("cache_hits", 0) == 0:
        note = "nothing was captured: every backward ran on the eager engine"
        diffs.append(TensorDiff("captures", False, 0.0, 0.0, None, None, note))
    return Comparison(tuple(diffs), stats, steps, impl)
