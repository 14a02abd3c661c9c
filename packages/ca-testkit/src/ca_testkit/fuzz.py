"""The random-graph fuzzer: hypothesis builds autograd graphs, eager is the oracle.

A ``Program`` is a list of ``Step`` rows over a pool of tensors: a few leaves
(shape 3x4, random ``requires_grad``) and a 4x4 weight, then ops that each
append one tensor to the pool. Ops come from ``OPS``, a table of elementwise,
matmul, reduction, broadcasting, view, indexing, in-place, ``detach`` and
multi-output rows. Random tensor hooks are attached to intermediates, and the
backward runs from one or more roots. ``Program.snippet()`` prints a runnable
reproduction; hypothesis shrinks a failing program to a minimal one.

    python -m ca_testkit fuzz --examples 5000 --backend none --seed 0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["OPS", "Program", "Step", "check_program", "programs", "run_program"]

SHAPE = (3, 4)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One row of OPS: arity and the expression (as code and as a function)."""

    arity: int
    code: str
    fn: Callable[..., torch.Tensor]


def _op(arity: int, code: str) -> OpSpec:
    # The code is the single source of truth: the function is compiled from it,
    # so a printed snippet runs exactly what the fuzzer ran.
    args = ", ".join("abc"[:arity])
    fn = eval(f"lambda {args}, W: {code}", {"torch": torch})  # noqa: S307
    return OpSpec(arity, code, fn)


#: Each op maps pool tensors a, b (3x4) and the weight W (4x4) to a 3x4 tensor.
OPS: dict[str, OpSpec] = {
    "sin": _op(1, "a.sin()"),
    "tanh": _op(1, "a.tanh()"),
    "exp": _op(1, "(a * 0.1).exp()"),
    "relu": _op(1, "a.relu()"),
    "square": _op(1, "a * a"),
    "scale": _op(1, "a * 2.5"),
    "add": _op(2, "a + b"),
    "mul": _op(2, "a * b"),
    "sub": _op(2, "a - b"),
    "div": _op(2, "a / (b.abs() + 1.0)"),
    "matmul": _op(1, "a @ W"),
    "sum_bcast": _op(2, "a + b.sum(0, keepdim=True)"),
    "mean_row": _op(1, "a * a.mean(1, keepdim=True)"),
    "amax": _op(1, "a - a.amax(1, keepdim=True)"),
    "view": _op(1, "a.reshape(4, 3).t().t().reshape(3, 4)"),
    "transpose": _op(1, "a.t().contiguous().t()"),
    "expand": _op(1, "a[:1].expand(3, 4) * a"),
    "index": _op(1, "a[[2, 0, 1]]"),
    "gather": _op(1, "a.index_select(1, torch.tensor([3, 1, 0, 2]))"),
    "inplace": _op(2, "a.clone().mul_(2).add_(b)"),
    "detach": _op(2, "a.detach() * b"),
    "chunk_cat": _op(1, "torch.cat(list(reversed(a.chunk(2, dim=1))), dim=1)"),
    "unbind_stack": _op(1, "torch.stack(a.unbind(0)[::-1])"),
}

HOOKS: dict[str, str] = {
    "double": "lambda g: g * 2",
    "observe": "lambda g: None",
}


@dataclasses.dataclass(frozen=True)
class Step:
    """Appends ``OPS[op](pool[args...], W)`` to the pool, with an optional hook."""

    op: str
    args: tuple[int, ...]
    hook: str | None = None


@dataclasses.dataclass(frozen=True)
class Program:
    """Leaves, steps and the roots the backward starts from."""

    requires_grad: tuple[bool, ...]
    steps: tuple[Step, ...]
    roots: tuple[int, ...]
    seed: int = 0

    def snippet(self) -> str:
        """A standalone script that runs this program eagerly and compiled."""
        lines = [
            "import torch, ca_runtime",
            "def run():",
            "    W = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()",
        ]
        for i, rg in enumerate(self.requires_grad):
            lines.append(
                f"    t{i} = torch.randn(3, 4, generator=torch.Generator().manual_seed({self.seed + i}))"
                f".requires_grad_({rg})"
            )
        n = len(self.requires_grad)
        for k, step in enumerate(self.steps):
            operands = ", ".join(f"t{j}" for j in step.args)
            lines.append(f"    {', '.join('abc'[: len(step.args)])}, = {operands},")
            lines.append(f"    t{n + k} = {OPS[step.op].code}")
            if step.hook:
                lines.append(
                    f"    if t{n + k}.requires_grad: t{n + k}.register_hook({HOOKS[step.hook]})"
                )
        roots = ", ".join(f"t{r}.sum()" for r in self.roots)
        lines += [
            f"    torch.autograd.backward([r for r in [{roots}] if r.requires_grad])",
            f"    return [t.grad for t in [W, {', '.join(f't{i}' for i in range(n))}]]",
            "eager = run()",
            "with ca_runtime.enable(lambda gm: gm):",
            "    compiled = run()",
            "print([(e is None and c is None) or torch.allclose(e, c) for e, c in zip(eager, compiled)])",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return "Program, runnable as:\n" + self.snippet()


def run_program(program: Program) -> tuple[list[torch.Tensor | None], list[str]]:
    """Builds the program's graph and runs its backward; returns leaf grads and the hook log."""
    log: list[str] = []
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    leaves = [
        torch.randn(*SHAPE, generator=torch.Generator().manual_seed(program.seed + i)).requires_grad_(rg)
        for i, rg in enumerate(program.requires_grad)
    ]
    pool: list[torch.Tensor] = list(leaves)
    for k, step in enumerate(program.steps):
        out = OPS[step.op].fn(*(pool[j] for j in step.args), weight)
        if step.hook and out.requires_grad:
            factor = 2.0 if step.hook == "double" else None
            out.register_hook(_logging_hook(log, f"h{k}", factor))
        pool.append(out)
    roots = [pool[r].sum() for r in program.roots if pool[r].requires_grad]
    if roots:
        torch.autograd.backward(roots)
    return [weight.grad, *(t.grad for t in leaves)], log


def _logging_hook(log: list[str], name: str, factor: float | None) -> Callable[[torch.Tensor], Any]:
    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        log.append(f"{name} {tuple(grad.shape)}")
        return None if factor is None else grad * factor

    return hook


def programs(max_steps: int = 8) -> Any:
    """Hypothesis strategy for Programs."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> Program:
        n_leaves = draw(st.integers(1, 3))
        requires_grad = tuple(draw(st.booleans()) for _ in range(n_leaves))
        if not any(requires_grad):
            requires_grad = (True, *requires_grad[1:])
        steps = []
        for k in range(draw(st.integers(1, max_steps))):
            pool_size = n_leaves + k
            name = draw(st.sampled_from(sorted(OPS)))
            args = tuple(draw(st.integers(0, pool_size - 1)) for _ in range(OPS[name].arity))
            hook = draw(st.sampled_from([None, None, None, *sorted(HOOKS)]))
            steps.append(Step(name, args, hook))
        total = n_leaves + len(steps)
        roots = tuple(sorted(draw(st.sets(st.integers(n_leaves, total - 1), min_size=1, max_size=2))))
        return Program(requires_grad, tuple(steps), roots, draw(st.integers(0, 1000)))

    return build()


def check_program(program: Program, compiler_fn: Any, impl: str = "ca") -> Any:
    """compare() of one program: eager vs compiled grads and hook logs."""
    from ca_testkit.compare import compare

    return compare(lambda: run_program(program), compiler_fn, impl=impl)


def resolve_backend(name: str) -> Any:
    """``none`` compiles nothing (the captured graph runs as is); else a torch.compile backend."""
    return (lambda gm: gm) if name == "none" else name


def fuzz(
    examples: int,
    backend: str = "none",
    seed: int = 0,
    impl: str = "ca",
    compiler_fn: Any = None,
) -> Program | None:
    """Runs ``examples`` random programs; returns the shrunk failing one, or None."""
    import warnings

    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    failure: list[Program] = []
    compiler = compiler_fn if compiler_fn is not None else resolve_backend(backend)

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(programs())
    def check(program: Program) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = check_program(program, compiler, impl)
        if not result.ok:
            failure[:] = [program]
            raise AssertionError(result.report())

    try:
        check()
    except AssertionError:
        return failure[0] if failure else None
    return None


def planted_bug_compiler() -> Callable[..., Any]:
    """A deliberately wrong compiler_fn: where two grads are summed, every grad is 1% off.

    The fuzzer must find it and shrink it to a program where one tensor is used
    twice (e.g. ``a * a``).
    """
    from ca_runtime import _graph_ops

    def compiler(gm: torch.fx.GraphModule) -> Callable[..., Any]:
        wrong = any(n.op == "call_function" and n.target is _graph_ops.accumulate for n in gm.graph.nodes)

        def run(*args: Any) -> Sequence[Any]:
            outputs = gm(*args)
            return [None if g is None else g * 1.01 for g in outputs] if wrong else outputs

        return run

    return compiler
