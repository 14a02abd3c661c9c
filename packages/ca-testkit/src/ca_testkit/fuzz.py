"""The random-graph fuzzer: hypothesis builds autograd programs, eager is the oracle.

A ``Program`` is a list of ``Step`` rows over a pool of tensors: a few leaves
(shape ``rows x 4``, random ``requires_grad``), a 4x4 weight ``W`` and a
``Linear(4, 4)`` module ``lin``, then ops that each append one tensor to the
pool. Ops come from ``OPS``, a table of elementwise, matmul, reduction,
broadcasting, view, indexing, in-place (on views too: CopySlices), ``detach``,
multi-output rows, a Python ``autograd.Function`` with a ctx scalar, a
non-reentrant checkpoint region and ops whose saved sizes or scalars depend
on the step. Hooks of every kind are
attached: tensor hooks, grad_fn pre and post hooks, post-accumulate-grad hooks
on leaves and a module full backward hook. The backward runs from one or more
roots, once or several times (``retain_graph``).

The cache is what is fuzzed: each program runs as a **sequence of backwards**
in one process (its ``variants``), and between them the leaves' row count
(0, 1 and others), the scalar ``s`` the ops save, ``requires_grad``, whether
``.grad`` is defined and whether the hooks are registered change. Eager runs
the same sequence; every step's grads and hook log are compared. Hypothesis
shrinks both the program and the sequence; ``Program.snippet()`` replays the
failing run exactly, with its backend, and prints both hook logs.

The combined mode (``--combined``) also draws what autograd's features do
together: a forward under ``saved_tensors_hooks`` whose pack and unpack
hooks log each call (so that an unpack run twice, or not at all, is a
mismatch), or under ``save_on_cpu``, or both, a
``register_multi_grad_hook`` (mode ``"all"`` or ``"any"``) over a few pool
tensors, a custom Function written with ``setup_context`` and
``once_differentiable``, a tensor hook that registers a hook on its step's
first operand in the variants that say so (eager calls it later in the same
backward; ca runs such graphs eagerly), a tensor hook that scales its grad by
the variant's scalar as an add's alpha (a new scalar recompiles the graph
during a cache hit), and a double backward (``autograd.grad`` with
``create_graph=True``, then a backward of the grads' sum; or a third
derivative, the grads differentiated with ``create_graph=True`` once more
before that backward) or a batched grad
(``autograd.grad(..., is_grads_batched=True)``: ``torch.func.vmap`` over the
engine, two grad_outputs at once), on top of the checkpoint regions,
Functions and hooks of every program.

Under a backend outside ``EXACT_BACKENDS`` (inductor) a grad that differs is
judged against the program run in float64 as well; see [Note: A float64
reference for rounding backends] in compare.py.

    python -m ca_testkit fuzz --examples 5000 --backend none --seed 0
    python -m ca_testkit fuzz --examples 5000 --backend none --combined
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.utils.checkpoint

__all__ = [
    "ALL_OPS",
    "COMBINED_OPS",
    "EXACT_BACKENDS",
    "OPS",
    "Program",
    "Step",
    "Variant",
    "check_program",
    "programs",
    "replay",
    "run_program",
]

COLS = 4


class Scale(torch.autograd.Function):
    """A Python Function whose backward reads a ctx scalar and a saved tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        ctx.save_for_backward(x)
        return x * k + x.sin()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * (ctx.k + x.cos()), None


class SetupScale(torch.autograd.Function):
    """A Function in the ``setup_context`` style whose backward is ``once_differentiable``."""

    @staticmethod
    def forward(x: torch.Tensor, k: float) -> torch.Tensor:
        return x * k + x.tanh()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, k = inputs
        ctx.k = k
        ctx.save_for_backward(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * (ctx.k + 1.0 - x.tanh() ** 2), None


def view_inplace(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An in-place op on a view of a non-leaf: the base's grad_fn becomes CopySlices."""
    c = a * 1.0
    c[:, :2].mul_(b[:, 2:] + 1.0)
    return c


def checkpointed(a: torch.Tensor, b: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """A non-reentrant checkpoint region saving an input, the weight and its activations."""
    return torch.utils.checkpoint.checkpoint(
        lambda x, y: ((x * y).sin() @ W).relu() + x, a, b, use_reentrant=False
    )


def split_rows(a: torch.Tensor) -> torch.Tensor:
    """Two narrows whose saved start/length depend on the row count."""
    half = a.shape[0] // 2
    return torch.cat([a.narrow(0, 0, half), a.narrow(0, half, a.shape[0] - half) * 2.0])


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One row of OPS: arity and the expression (as code and as a function)."""

    arity: int
    code: str
    fn: Callable[..., torch.Tensor]


_OP_NAMESPACE = {
    "torch": torch,
    "Scale": Scale,
    "SetupScale": SetupScale,
    "view_inplace": view_inplace,
    "split_rows": split_rows,
    "checkpointed": checkpointed,
}


def _op(arity: int, code: str) -> OpSpec:
    # The code is the single source of truth: the function is compiled from it,
    # and a snippet prints it next to the program it replays.
    args = ", ".join("abc"[:arity])
    fn = eval(f"lambda {args}, W, lin, s: {code}", _OP_NAMESPACE)
    return OpSpec(arity, code, fn)


#: Each op maps pool tensors a, b (rows x 4), the weight W (4x4), the module
#: lin and the step's scalar s to a rows x 4 tensor, for any row count >= 0.
OPS: dict[str, OpSpec] = {
    "sin": _op(1, "a.sin()"),
    "tanh": _op(1, "a.tanh()"),
    "exp": _op(1, "(a * 0.1).exp()"),
    "relu": _op(1, "a.relu()"),
    "square": _op(1, "a * a"),
    "scale": _op(1, "a * s"),
    "pow": _op(1, "(a.abs() + 1.0).pow(s)"),
    "clamp": _op(1, "a.clamp(-abs(s), abs(s))"),
    "tril": _op(1, "a.tril(int(s))"),
    "function": _op(1, "Scale.apply(a, s)"),
    "add": _op(2, "a + b"),
    "mul": _op(2, "a * b"),
    "sub": _op(2, "a - b"),
    "div": _op(2, "a / (b.abs() + 1.0)"),
    "matmul": _op(1, "a @ W"),
    "linear": _op(1, "lin(a)"),
    "sum_bcast": _op(2, "a + b.sum(0, keepdim=True)"),
    "mean_row": _op(1, "a * a.mean(1, keepdim=True)"),
    "amax": _op(1, "a - a.amax(1, keepdim=True)"),
    "view": _op(1, "a.reshape(-1, 2).t().t().reshape(a.shape)"),
    "transpose": _op(1, "a.t().contiguous().t()"),
    "expand": _op(1, "a[:1].expand_as(a) * a"),
    "flip": _op(1, "a.flip(0)"),
    "split_rows": _op(1, "split_rows(a)"),
    "gather": _op(1, "a.index_select(1, torch.tensor([3, 1, 0, 2]))"),
    "inplace": _op(2, "a.clone().mul_(2).add_(b)"),
    "view_inplace": _op(2, "view_inplace(a, b)"),
    "detach": _op(2, "a.detach() * b"),
    "chunk_cat": _op(1, "torch.cat(list(reversed(a.chunk(2, dim=1))), dim=1)"),
    "unbind_stack": _op(1, "torch.stack(a.unbind(1)[::-1], dim=1)"),
    "checkpoint": _op(2, "checkpointed(a, b, W)"),
}

#: Ops only the combined mode draws. SetupScale's backward is once
#: differentiable: a double backward through it raises, in eager as under ca.
COMBINED_OPS: dict[str, OpSpec] = {
    "setup_function": _op(1, "SetupScale.apply(a, s)"),
}
ALL_OPS: dict[str, OpSpec] = {**OPS, **COMBINED_OPS}

#: Hooks a step may attach to its output: tensor hooks and grad_fn pre/post hooks.
HOOKS: tuple[str, ...] = ("double", "observe", "pre_half", "post_observe")

#: Hooks only the combined mode draws: a tensor hook that, in a variant with
#: ``registers_hooks``, registers a tensor hook on the step's first operand,
#: whose node runs later in the same backward (eager calls it there).
REGISTERING_HOOKS: tuple[str, ...] = ("register_on_operand",)

#: Hooks only the combined mode draws that read the variant's scalar from
#: their closure, as an add's alpha (``grad.add(grad, alpha=s - 1)``, which is
#: ``grad * s``): a variant with another scalar makes Dynamo recompile the
#: graph during a cache hit, where the add may meet an mm (ca_runtime's
#: [Note: Compiles during a hit keep the backward options]).
SCALING_HOOKS: tuple[str, ...] = ("scale_by_scalar",)

#: Values a variant draws from; the first is the default that shrinking goes to.
ROWS: tuple[int, ...] = (3, 0, 1, 5)
SCALARS: tuple[float, ...] = (2.5, -1.5, 0.5, 1.0)


@dataclasses.dataclass(frozen=True)
class Step:
    """Appends ``OPS[op](pool[args...], W, lin, s)`` to the pool, with an optional hook."""

    op: str
    args: tuple[int, ...]
    hook: str | None = None


@dataclasses.dataclass(frozen=True)
class Variant:
    """One backward of a program's sequence: what changed since the previous one."""

    #: Leaves are ``rows x 4``.
    rows: int = 3
    #: The ``s`` the ops save (a float, a ctx attribute, ``int(s)`` as tril's diagonal).
    scalar: float = 2.5
    #: Per leaf; None keeps the program's.
    requires_grad: tuple[bool, ...] | None = None
    #: Every grad-requiring leaf (and W, lin) starts with ``.grad`` = ones.
    grad_defined: bool = False
    #: The program's hooks are registered for this backward.
    hooks: bool = True
    #: Its ``register_on_operand`` hooks register a hook when they run (combined mode).
    registers_hooks: bool = False


@dataclasses.dataclass(frozen=True)
class Program:
    """Leaves, steps, roots, hooks and the sequence of backwards."""

    requires_grad: tuple[bool, ...]
    steps: tuple[Step, ...]
    roots: tuple[int, ...]
    seed: int = 0
    #: Per leaf: a post-accumulate-grad hook.
    leaf_hooks: tuple[bool, ...] = ()
    #: A full backward hook on ``lin`` (used by the ``linear`` op).
    module_hook: bool = False
    #: Backwards per variant; all but the last with ``retain_graph=True``.
    backwards: int = 1
    variants: tuple[Variant, ...] = (Variant(),)
    #: The forward runs under saved_tensors_hooks whose pack/unpack log each call (combined mode).
    saved_hooks: bool = False
    #: The backward is a double backward: grad(create_graph=True), then backward of the grads (combined mode).
    double: bool = False
    #: The forward runs under ``torch.autograd.graph.save_on_cpu`` (inside the
    #: logging hooks if both: the innermost hooks pack) (combined mode).
    save_on_cpu: bool = False
    #: Pool tensors given to one ``register_multi_grad_hook`` after the forward (combined mode).
    multi_hook: tuple[int, ...] = ()
    #: Its mode: ``"all"`` or ``"any"``.
    multi_mode: Literal["all", "any"] = "all"
    #: The backward is ``autograd.grad(..., is_grads_batched=True)``: vmap over
    #: the engine, two grad_outputs at once (combined mode; never with ``double``).
    batched: bool = False
    #: With ``double``: the first-order grads are differentiated once more with
    #: ``create_graph=True`` before the last backward (a third derivative).
    third_order: bool = False

    def literal(self) -> str:
        """The constructor call that rebuilds this program."""
        return (
            f"Program(requires_grad={self.requires_grad!r},\n"
            f"    steps=({''.join(f'{s!r}, ' for s in self.steps)}),\n"
            f"    roots={self.roots!r}, seed={self.seed!r}, leaf_hooks={self.leaf_hooks!r},\n"
            f"    module_hook={self.module_hook!r}, backwards={self.backwards!r},\n"
            f"    variants=({''.join(f'{v!r}, ' for v in self.variants)}),\n"
            f"    saved_hooks={self.saved_hooks!r}, double={self.double!r},\n"
            f"    save_on_cpu={self.save_on_cpu!r}, multi_hook={self.multi_hook!r}, multi_mode={self.multi_mode!r},\n"
            f"    batched={self.batched!r}, third_order={self.third_order!r})"
        )

    def listing(self) -> list[str]:
        """The program as commented pseudo-code (the replay runs exactly this)."""
        n = len(self.requires_grad)
        lines = [
            f"#   t{i} = leaf (rows, 4), requires_grad={rg}"
            + (", post-accumulate-grad hook" if i < len(self.leaf_hooks) and self.leaf_hooks[i] else "")
            for i, rg in enumerate(self.requires_grad)
        ]
        for k, step in enumerate(self.steps):
            operands = ", ".join(f"{'abc'[j]}=t{a}" for j, a in enumerate(step.args))
            hook = f"   hook: {step.hook}" if step.hook else ""
            lines.append(f"#   t{n + k} = {ALL_OPS[step.op].code}   [{operands}]{hook}")
        kind = (
            ("third-order backward" if self.third_order else "double backward")
            if self.double
            else "batched grad"
            if self.batched
            else "backward"
        )
        lines.append(
            f"#   {kind} of {' + '.join(f't{r}.sum()' for r in self.roots)}, {self.backwards} time(s)"
        )
        if self.saved_hooks:
            lines.append("#   the forward runs under logging saved_tensors_hooks")
        if self.save_on_cpu:
            lines.append("#   the forward runs under save_on_cpu")
        if self.multi_hook:
            tensors = ", ".join(f"t{i}" for i in self.multi_hook)
            lines.append(f"#   register_multi_grad_hook([{tensors}], mode={self.multi_mode!r})")
        if self.module_hook:
            lines.append("#   lin has a full backward hook")
        return lines

    def snippet(self, backend: str = "none", impl: str = "ca") -> str:
        """A script that replays this program eagerly and compiled (by ``impl``), step by step."""
        impl_arg = "" if impl == "ca" else f", impl={impl!r}"
        return "\n".join(
            [
                f"# ca_testkit fuzz reproduction, backend {backend!r}; the program:",
                *self.listing(),
                "from ca_testkit.fuzz import Program, Step, Variant, replay",
                f"program = {self.literal()}",
                f"replay(program, {backend!r}{impl_arg})",
            ]
        )

    def __repr__(self) -> str:
        return "Program, replayed by:\n" + self.snippet()


def _leaf_requires_grad(program: Program, variant: Variant) -> tuple[bool, ...]:
    rg = variant.requires_grad if variant.requires_grad is not None else program.requires_grad
    return tuple(
        rg[i] if i < len(rg) else program.requires_grad[i] for i in range(len(program.requires_grad))
    )


def run_program(
    program: Program, index: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor | None], list[str]]:
    """Builds variant ``index`` of the program and runs its backward(s); returns grads and the hook log.

    The inputs are drawn in float32 whatever ``dtype`` is and then converted,
    so that a float64 run computes the same program on the same values: the
    reference of [Note: A float64 reference for rounding backends].
    """
    variant = program.variants[index]
    log: list[str] = []
    weight = torch.randn(COLS, COLS, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    lin = torch.nn.Linear(COLS, COLS, dtype=dtype)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    leaves = [
        torch.randn(variant.rows, COLS, generator=torch.Generator().manual_seed(program.seed + i))
        .to(dtype)
        .requires_grad_(rg)
        for i, rg in enumerate(_leaf_requires_grad(program, variant))
    ]
    params: list[torch.Tensor] = [weight, *lin.parameters(), *leaves]
    if variant.grad_defined:
        for tensor in params:
            if tensor.requires_grad:
                tensor.grad = torch.ones_like(tensor)
    if variant.hooks:
        for i, leaf in enumerate(leaves):
            if i < len(program.leaf_hooks) and program.leaf_hooks[i] and leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(_logging_acc_hook(log, f"acc{i}"))
        if program.module_hook:
            lin.register_full_backward_hook(_logging_module_hook(log))
    pool: list[torch.Tensor] = list(leaves)
    with contextlib.ExitStack() as forward_context:
        if program.saved_hooks:
            forward_context.enter_context(_saved_tensors_hooks(log))
        if program.save_on_cpu:
            forward_context.enter_context(torch.autograd.graph.save_on_cpu())
        for k, step in enumerate(program.steps):
            out = ALL_OPS[step.op].fn(*(pool[j] for j in step.args), weight, lin, variant.scalar)
            if variant.hooks and step.hook and out.grad_fn is not None:
                operand = pool[step.args[0]]
                register_on = operand if variant.registers_hooks else None
                _attach_hook(out, step.hook, f"h{k}", log, register_on, variant.scalar)
            pool.append(out)
    if variant.hooks and program.multi_hook:
        watched = [pool[i] for i in program.multi_hook if pool[i].requires_grad]
        if watched:
            torch.autograd.graph.register_multi_grad_hook(
                watched, _logging_multi_hook(log, program.multi_mode), mode=program.multi_mode
            )
    roots = [pool[r].sum() for r in program.roots if pool[r].requires_grad]
    batched: list[torch.Tensor | None] = []
    for b in range(program.backwards if roots else 0):
        retain = b + 1 < program.backwards
        if program.double:
            _double_backward(roots, params, retain, log, program.third_order)
        elif program.batched:
            batched.extend(_batched_grad(roots, params, retain, log))
        else:
            torch.autograd.backward(roots, retain_graph=retain)
    return [*(p.grad for p in params), *batched], log


def _saved_tensors_hooks(log: list[str]) -> Any:
    """Pack hooks that copy (so that the unpacked tensor is not the original), both logged."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        log.append(f"pack {tuple(t.shape)}")
        return t * 1

    def unpack(t: torch.Tensor) -> torch.Tensor:
        log.append(f"unpack {tuple(t.shape)}")
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _double_backward(
    roots: list[torch.Tensor], params: list[torch.Tensor], retain: bool, log: list[str], third_order: bool
) -> None:
    """grad(create_graph=True) of the roots' sum w.r.t. every grad-requiring tensor, then backward of the grads.

    With ``third_order``, the grads' squares are differentiated with
    ``create_graph=True`` once more first, and the backward is of those grads.
    """
    wrt = [p for p in params if p.requires_grad]
    try:
        grads = torch.autograd.grad(torch.stack(roots).sum(), wrt, create_graph=True, allow_unused=True)
        # Which first-order grads carry a graph is part of the comparison.
        log.append(f"grad graph {[None if g is None else g.requires_grad for g in grads]}")
        second = [(g * g).sum() for g in grads if g is not None and g.requires_grad]
        if second and third_order:
            grads = torch.autograd.grad(torch.stack(second).sum(), wrt, create_graph=True, allow_unused=True)
            log.append(f"second grad graph {[None if g is None else g.requires_grad for g in grads]}")
            second = [(g * g).sum() for g in grads if g is not None and g.requires_grad]
        if second:
            torch.autograd.backward(second, retain_graph=retain)
    except RuntimeError as e:  # a once_differentiable backward: the error is part of the comparison
        log.append(f"error {str(e).splitlines()[0]}")


#: The grad_outputs of a batched grad: two at once, for the roots' (scalar) sum.
_GRAD_BATCH = (1.0, -0.5)


def _batched_grad(
    roots: list[torch.Tensor], params: list[torch.Tensor], retain: bool, log: list[str]
) -> list[torch.Tensor | None]:
    """grad of the roots' sum w.r.t. every grad-requiring tensor for two grad_outputs at once (is_grads_batched)."""
    wrt = [p for p in params if p.requires_grad]
    try:
        return list(
            torch.autograd.grad(
                torch.stack(roots).sum(),
                wrt,
                grad_outputs=torch.tensor(_GRAD_BATCH, dtype=roots[0].dtype),
                retain_graph=retain,
                allow_unused=True,
                is_grads_batched=True,
            )
        )
    except RuntimeError as e:  # e.g. an op without a batching rule: the error is part of the comparison
        log.append(f"error {str(e).splitlines()[0]}")
        return []


def _attach_hook(
    out: torch.Tensor,
    kind: str,
    name: str,
    log: list[str],
    register_on: torch.Tensor | None = None,
    scalar: float = 1.0,
) -> None:
    if kind in ("double", "observe"):
        out.register_hook(_logging_hook(log, name, 2.0 if kind == "double" else None))
    elif kind == "scale_by_scalar":
        alpha = scalar - 1.0

        def scaling(grad: torch.Tensor) -> torch.Tensor:
            log.append(f"{name} {tuple(grad.shape)}")
            return grad.add(grad, alpha=alpha)

        out.register_hook(scaling)
    elif kind == "register_on_operand":

        def registering(grad: torch.Tensor) -> None:
            log.append(f"{name} {tuple(grad.shape)}")
            if register_on is not None and register_on.requires_grad:
                register_on.register_hook(_logging_hook(log, f"{name} registered", 3.0))

        out.register_hook(registering)
    elif kind == "pre_half":

        def pre(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
            log.append(f"{name} pre {[None if g is None else tuple(g.shape) for g in grads]}")
            return tuple(None if g is None else g * 0.5 for g in grads)

        assert out.grad_fn is not None
        out.grad_fn.register_prehook(pre)
    else:

        def post(inputs: tuple[torch.Tensor | None, ...], outputs: tuple[torch.Tensor | None, ...]) -> None:
            log.append(f"{name} post {[None if g is None else tuple(g.shape) for g in inputs]}")

        assert out.grad_fn is not None
        out.grad_fn.register_hook(post)


def _logging_hook(log: list[str], name: str, factor: float | None) -> Callable[[torch.Tensor], Any]:
    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        log.append(f"{name} {tuple(grad.shape)}")
        return None if factor is None else grad * factor

    return hook


def _logging_acc_hook(log: list[str], name: str) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        log.append(f"{name} {None if param.grad is None else tuple(param.grad.shape)}")

    return hook


def _logging_multi_hook(log: list[str], mode: str) -> Callable[[Any], None]:
    def hook(grads: Any) -> None:
        if mode == "any":  # one grad: the first that was computed
            log.append(f"multi any {tuple(grads.shape)}")
        else:
            log.append(f"multi all {[None if g is None else tuple(g.shape) for g in grads]}")

    return hook


def _logging_module_hook(log: list[str]) -> Callable[..., None]:
    def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
        log.append(f"module {[None if g is None else tuple(g.shape) for g in grad_input]}")

    return hook


def programs(max_steps: int = 8, max_variants: int = 4, combined: bool = False) -> Any:
    """Hypothesis strategy for Programs (each with a sequence of variants); ``combined`` draws the combined mode."""
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
            name = draw(st.sampled_from(sorted(ALL_OPS if combined else OPS)))
            args = tuple(draw(st.integers(0, pool_size - 1)) for _ in range(ALL_OPS[name].arity))
            drawn_hooks = [*HOOKS, *(REGISTERING_HOOKS + SCALING_HOOKS if combined else ())]
            hook = draw(st.sampled_from([None, None, None, *drawn_hooks]))
            steps.append(Step(name, args, hook))
        total = n_leaves + len(steps)
        roots = tuple(sorted(draw(st.sets(st.integers(n_leaves, total - 1), min_size=1, max_size=2))))
        leaf_hooks = tuple(draw(st.sampled_from([False, False, True])) for _ in range(n_leaves))
        double = combined and draw(st.booleans())
        variants = [Variant()]
        for _ in range(draw(st.integers(1, max_variants)) - 1):
            flip = draw(st.booleans())
            variants.append(
                Variant(
                    rows=draw(st.sampled_from(ROWS)),
                    scalar=draw(st.sampled_from(SCALARS)),
                    requires_grad=tuple(draw(st.booleans()) for _ in range(n_leaves)) if flip else None,
                    grad_defined=draw(st.booleans()),
                    hooks=draw(st.sampled_from([True, True, False])),
                    registers_hooks=combined and draw(st.booleans()),
                )
            )
        return Program(
            requires_grad,
            tuple(steps),
            roots,
            draw(st.integers(0, 1000)),
            leaf_hooks=leaf_hooks if any(leaf_hooks) else (),
            module_hook=draw(st.sampled_from([False, False, True])),
            backwards=draw(st.sampled_from([1, 1, 1, 2])),
            variants=tuple(variants),
            saved_hooks=combined and draw(st.booleans()),
            double=double,
            save_on_cpu=combined and draw(st.sampled_from([False, False, True])),
            multi_hook=(
                tuple(sorted(draw(st.sets(st.integers(0, total - 1), min_size=1, max_size=3))))
                if combined and draw(st.booleans())
                else ()
            ),
            multi_mode=draw(st.sampled_from(["all", "any"])) if combined else "all",
            batched=combined and not double and draw(st.sampled_from([False, False, True])),
            third_order=double and draw(st.sampled_from([False, False, True])),
        )

    return build()


def _runs_a_backward(program: Program, index: int) -> bool:
    """Whether variant ``index`` has a root that requires grad (the forward alone, no backward)."""
    variant = program.variants[index]
    leaves = [
        torch.zeros(variant.rows, COLS).requires_grad_(rg) for rg in _leaf_requires_grad(program, variant)
    ]
    weight, lin = torch.zeros(COLS, COLS, requires_grad=True), torch.nn.Linear(COLS, COLS)
    pool = list(leaves)
    for step in program.steps:
        pool.append(ALL_OPS[step.op].fn(*(pool[j] for j in step.args), weight, lin, variant.scalar))
    return any(pool[r].requires_grad for r in program.roots)


#: Backends whose float arithmetic is eager's, op for op: compared with rtol/atol alone.
#: Any other (inductor) is judged against a float64 run as well; see
#: [Note: A float64 reference for rounding backends].
EXACT_BACKENDS = ("none", "eager", "aot_eager")


#: impl -> how many times in a row each variant of a program runs. Under
#: ``ca-capture-after-2`` (``enable()``'s default) a variant's first backward
#: runs on the eager engine: run once, a program would check nothing compiled,
#: so each variant runs twice (deferred, then captured or a hit).
RUNS_PER_VARIANT = {"ca-capture-after-2": 2}


def check_program(
    program: Program, compiler_fn: Any, impl: str = "ca", float64_reference: bool = False
) -> Any:
    """compare() of one program's sequence: eager vs compiled grads and hook logs, every step.

    A sequence with a backward must capture something and fall back nowhere:
    eager's answer from a silent fallback is no pass. A program with a hook
    whose code registers hooks (``register_on_operand``) is the exception:
    its graphs are never compiled (ca_runtime's [Note: Which captures
    wait]), so it must have run them eagerly by that rule, deferred or
    declined, and may capture only graphs without that hook. With
    ``float64_reference`` a value outside rtol/atol passes when it is within
    a rounding backend's error of the program run in float64.
    """
    from ca_testkit.compare import TensorDiff, compare

    backward = any(_runs_a_backward(program, i) for i in range(len(program.variants)))
    registering = any(step.hook in REGISTERING_HOOKS for step in program.steps)
    runs = RUNS_PER_VARIANT.get(impl, 1)
    steps = len(program.variants) * runs

    def step(i: int) -> Any:
        if impl == "ca-background" and i == steps // 2:
            # The first half runs before Inductor's kernels are ready (op by
            # op), the second half with them.
            import ca_runtime

            ca_runtime.wait_for_background_compiles()
        return run_program(program, i // runs)

    def reference(i: int) -> Any:
        return run_program(program, i // runs, dtype=torch.float64)

    with warnings.catch_warnings():
        if registering:  # the rule's one warning is expected; the counters below show the rule ran
            warnings.filterwarnings(
                "ignore", message=r"ca_runtime: .* (registers or removes|registered or removed)"
            )
        result = compare(
            step,
            compiler_fn,
            steps=steps,
            impl=impl,
            expect_capture=backward and not registering,
            reference=reference if float64_reference else None,
        )
    fallbacks = result.stats.get("eager_fallbacks", 0)
    if fallbacks and not registering:
        note = f"{fallbacks} backward(s) fell back to the eager engine"
        extra = TensorDiff("eager_fallbacks", False, 0.0, 0.0, None, None, note)
        result = dataclasses.replace(result, diffs=(*result.diffs, extra))
    if (
        registering
        and _registering_hook_runs(program)
        and not (fallbacks or result.stats.get("deferred_captures"))
    ):
        note = "a graph with a hook that registers hooks ran, and none was deferred or declined"
        extra = TensorDiff("deferred_captures", False, 0.0, 0.0, None, None, note)
        result = dataclasses.replace(result, diffs=(*result.diffs, extra))
    return result


def _registering_hook_runs(program: Program) -> bool:
    """Whether some variant's backward calls a ``register_on_operand`` hook (its log names it)."""
    names = {f"h{k}" for k, step in enumerate(program.steps) if step.hook in REGISTERING_HOOKS}
    for index, variant in enumerate(program.variants):
        if not variant.hooks or not _runs_a_backward(program, index):
            continue
        _, log = run_program(program, index)
        if any(entry.split()[0] in names for entry in log):
            return True
    return False


def replay(program: Program, backend: str = "none", impl: str = "ca") -> Any:
    """Runs the program's sequence eagerly and compiled; prints the comparison and both hook logs."""
    import ca_runtime

    from ca_testkit.implementations import get_implementation

    compiler = resolve_backend(backend)  # one compiler object: one cache over the whole sequence
    result = check_program(program, compiler, impl, float64_reference=backend not in EXACT_BACKENDS)
    print(result.report())
    implementation = get_implementation(impl)
    runs = RUNS_PER_VARIANT.get(impl, 1)
    for label, compiled in (("eager", False), ("compiled", True)):
        implementation.reset()
        for i in range(len(program.variants) * runs):
            with implementation.enable(compiler) if compiled else ca_runtime.disable():
                _, log = run_program(program, i // runs)
            print(f"step {i} {label} hook log: {log}")
    return result


def resolve_backend(name: str) -> Any:
    """``none`` compiles nothing (the captured graph runs as is); else a torch.compile backend."""
    return (lambda gm: gm) if name == "none" else name


def fuzz(
    examples: int,
    backend: str = "none",
    seed: int = 0,
    impl: str = "ca",
    compiler_fn: Any = None,
    combined: bool = False,
) -> Program | None:
    """Runs ``examples`` random programs; returns the shrunk failing one, or None."""
    import warnings

    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    failure: list[Program] = []
    compiler = compiler_fn if compiler_fn is not None else resolve_backend(backend)
    reference = compiler_fn is None and backend not in EXACT_BACKENDS

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(programs(combined=combined))
    def check(program: Program) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = check_program(program, compiler, impl, float64_reference=reference)
        if not result.ok:
            failure[:] = [program]
            raise AssertionError(result.report())

    try:
        check()
    except AssertionError:
        return failure[0] if failure else None
    return None


def fuzz_slice(
    examples: int, backend: str, seed: int, impl: str = "ca", combined: bool = False
) -> str | None:
    """One worker's share of ``python -m ca_testkit fuzz --jobs N``: the failing program's snippet, or None.

    Module-level (not in ``__main__``) so that spawned worker processes can import it.
    """
    failing = fuzz(examples, backend, seed=seed, impl=impl, combined=combined)
    return None if failing is None else failing.snippet(backend, impl)


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
