"""Hooks under compiled autograd: every kind, alone and together, against eager.

Each step returns the log of hook calls, so ca_testkit.compare checks the
calls, their number and their order, along with the grads.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import ca_core
import ca_runtime
import pytest
import torch
from ca_testkit import compare

pytestmark = pytest.mark.filterwarnings("ignore::ca_runtime.GraphBreakWarning")


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


INPUT = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def _tensor_hook(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
    hidden = model[1](model[0](INPUT))

    def double(grad: torch.Tensor) -> torch.Tensor:
        log.append(f"tensor_hook sum={grad.sum().item():.4f}")
        return grad * 2

    hidden.register_hook(double)
    return model[2](hidden)


def _tensor_hook_no_return(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
    hidden = model[0](INPUT)
    hidden.register_hook(lambda grad: log.append(f"observe {tuple(grad.shape)}"))
    return model[2](model[1](hidden))


def _leaf_hook(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
    x = INPUT.clone().requires_grad_()
    x.register_hook(lambda grad: log.append("leaf") or grad + 1)
    return model(x)


def _retain_grad(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
    hidden = model[0](INPUT)
    hidden.retain_grad()
    out = model[2](model[1](hidden))
    _retained.append(hidden)
    return out


_retained: list[torch.Tensor] = []


def _grad_fn_hooks(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
    hidden = model[1](model[0](INPUT))
    out = model[2](hidden)

    def pre(grad_outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        log.append(f"prehook {len(grad_outputs)}")
        return tuple(g * 3 for g in grad_outputs)

    def post(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        log.append(f"posthook {sum(g is not None for g in grad_inputs)}")

    hidden.grad_fn.register_prehook(pre)
    hidden.grad_fn.register_hook(post)
    out.grad_fn.register_hook(lambda gi, go: tuple(None if g is None else g * 0.5 for g in gi))
    return out


def _module_hooks(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
    handles = [
        model[0].register_full_backward_pre_hook(lambda m, go: log.append("pre0")),
        model[2].register_full_backward_pre_hook(lambda m, go: (log.append("pre2"), (go[0] * 2,))[1]),
        model[0].register_full_backward_hook(lambda m, gi, go: log.append(f"full0 {len(gi)}")),
        model[2].register_full_backward_hook(lambda m, gi, go: log.append("full2")),
    ]
    _handles.extend(handles)
    x = INPUT.clone().requires_grad_()
    return model(x)


_handles: list[Any] = []


def _post_accumulate(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
    for name, p in model.named_parameters():
        _handles.append(
            p.register_post_accumulate_grad_hook(functools.partial(_sgd_in_backward, name=name, log=log))
        )
    return model(INPUT)


def _sgd_in_backward(p: torch.Tensor, *, name: str, log: list[str]) -> None:
    """The optimizer-in-backward pattern: update the parameter from its fresh grad."""
    log.append(f"acc {name}")
    with torch.no_grad():
        p.add_(p.grad, alpha=-0.1)
        p.grad.mul_(0.5)


def _cpp_hook(model: torch.nn.Sequential, log: list[str], ext: ModuleType) -> torch.Tensor:
    hidden = model[0](INPUT)
    ext.register_doubling_hook(hidden)
    return model[2](model[1](hidden))


SCENARIOS: dict[str, Callable[..., torch.Tensor]] = {
    "tensor_hook": _tensor_hook,
    "tensor_hook_no_return": _tensor_hook_no_return,
    "leaf_hook": _leaf_hook,
    "retain_grad": _retain_grad,
    "grad_fn_hooks": _grad_fn_hooks,
    "module_hooks": _module_hooks,
    "post_accumulate": _post_accumulate,
}


def _remove_handles() -> None:
    """Module and parameter hooks are registered by each step; one set at a time."""
    for handle in _handles:
        handle.remove()
    _handles.clear()


@pytest.fixture(autouse=True)
def _clean_handles():
    yield
    _remove_handles()
    _retained.clear()


def _step_for(build: Callable[[torch.nn.Sequential, list[str]], torch.Tensor], model, log):
    def step() -> tuple[list[str], list[torch.Tensor]]:
        log.clear()
        _retained.clear()
        _remove_handles()
        out = build(model, log)
        out.pow(2).sum().backward()
        retained = [t.grad for t in _retained]
        return list(log), [p.detach().clone() for p in model.parameters()] + retained

    return step


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_hook_kind_alone(scenario: str, backend: str) -> None:
    model, log = _mlp(), []
    result = compare(_step_for(SCENARIOS[scenario], model, log), backend, tensors=model, steps=3)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["captures"] <= 2  # .grad None, then defined


def test_cpp_tensor_hook(backend: str, cpp_ext: ModuleType) -> None:
    model, log = _mlp(), []
    before = cpp_ext.cpp_hook_calls()
    build = functools.partial(_cpp_hook, ext=cpp_ext)
    result = compare(_step_for(build, model, log), backend, tensors=model, steps=2)
    result.assert_ok()
    assert cpp_ext.cpp_hook_calls() - before == 4  # once per backward, eager and compiled
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] >= 1


def test_all_hook_kinds_together(backend: str, cpp_ext: ModuleType) -> None:
    model, log = _mlp(), []

    def build(model: torch.nn.Sequential, log: list[str]) -> torch.Tensor:
        _module_hooks(model, log)
        _handles.extend(
            p.register_post_accumulate_grad_hook(functools.partial(_sgd_in_backward, name=name, log=log))
            for name, p in model.named_parameters()
        )
        x = INPUT.clone().requires_grad_()
        x.register_hook(lambda g: log.append("leaf") or g)
        hidden = model[0](x)
        hidden.retain_grad()
        _retained.append(hidden)
        cpp_ext.register_doubling_hook(hidden)
        act = model[1](hidden)
        act.register_hook(lambda g: log.append("tensor") or g * 2)
        act.grad_fn.register_prehook(lambda go: log.append("prehook") or None)
        act.grad_fn.register_hook(lambda gi, go: log.append("posthook") or None)
        return model[2](act)

    result = compare(_step_for(build, model, log), backend, tensors=model, steps=3)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0


@pytest.mark.parametrize(
    "compiler", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)]
)
def test_r2_hook_with_side_effect(compiler: str) -> None:
    """The hook sees eager's grad once and its result is used."""
    seen: list[torch.Tensor] = []
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)

    def step() -> list[torch.Tensor]:
        seen.clear()
        y = x**2
        y.register_hook(lambda grad: seen.append(grad) or 2 * grad)
        y.sum().backward()
        return list(seen)

    result = compare(step, compiler, tensors=[x], steps=2)
    result.assert_ok()
    assert torch.allclose(x.grad, 2 * 4 * x.detach())  # two steps of 2 * dy/dx
    assert len(seen) == 1 and torch.equal(seen[0], torch.ones(3))
    assert result.stats["eager_fallbacks"] == 0


def test_adding_a_hook_between_steps_recaptures_once(backend: str) -> None:
    model, log = _mlp(), []

    def step(i: int) -> tuple[list[str], list[torch.Tensor]]:
        log.clear()
        hidden = model[1](model[0](INPUT))
        if i >= 2:
            hidden.register_hook(lambda g: log.append("new hook") or g * 3)
        model[2](hidden).sum().backward()
        return list(log), [p.grad.clone() for p in model.parameters()]

    result = compare(step, backend, tensors=model, steps=4)
    result.assert_ok()
    # step 0 (.grad None), step 1 (.grad defined), step 2 (the new hook), step 3 hit.
    assert result.stats["captures"] == 3
    assert result.stats["cache_hits"] == 1


def test_raising_hook_propagates_and_next_backward_works(backend: str) -> None:
    """The user's exception arrives unchanged, on a cache hit and on a first run.

    A backward that raises part-way leaves eager with some leaves accumulated
    (those that ran before the hook) and ours with none (leaf grads are applied
    after the graph); both are a failed step, so .grad is reset after it and
    the comparison is of the backwards that follow.
    """
    raise_now = {"flag": False}

    class HookError(Exception):
        pass

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if raise_now["flag"]:
            raise HookError("raised by the user's hook")
        return grad * 2

    def step(i: int) -> list[torch.Tensor]:
        raise_now["flag"] = i in (1, 3)  # a hit that raises, then a recompile that raises
        hidden = model[1](model[0](INPUT))
        hidden.register_hook(hook)
        try:
            model[2](hidden).sum().backward()
        except HookError:
            model.zero_grad(set_to_none=True)
            return ["raised"]
        return [p.grad.clone() for p in model.parameters()]

    model = _mlp()
    result = compare(step, backend, tensors=model, steps=5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0

    x = torch.randn(3, requires_grad=True)
    with ca_runtime.enable(backend, capture_after=1) as runtime:
        raise_now["flag"] = True
        y = x * 2
        y.register_hook(hook)
        with pytest.raises(HookError, match="raised by the user's hook"):
            y.sum().backward()
        assert ca_core.installed_runtime() is runtime


def test_raising_hook_on_first_run_is_not_a_compile_failure(backend: str) -> None:
    x = torch.randn(3, requires_grad=True)

    def boom(grad: torch.Tensor) -> None:
        raise KeyError("first-run hook failure")

    with ca_runtime.enable(backend, capture_after=1):
        y = x * 2
        y.register_hook(boom)
        with pytest.raises(KeyError, match="first-run hook failure"):
            y.sum().backward()
        (x * 2).sum().backward()
    assert ca_runtime.stats()["eager_fallbacks"] == 0
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_graph_breaks_are_counted_and_warned_once(backend: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ca_runtime.enable(backend, capture_after=1):
            for i in range(3):
                y = x * (2 + i)  # a new scalar each step: three captures, one break each
                y.retain_grad()
                (y * y).sum().backward()
    breaks = [str(w.message) for w in caught if issubclass(w.category, ca_runtime.GraphBreakWarning)]
    assert len(breaks) == 1, breaks
    assert "graph break at MulBackward0" in breaks[0] and "retain_grad" in breaks[0]
    stats = ca_runtime.stats()
    assert stats["graph_breaks"] == stats["captures"]
    assert stats["eager_fallbacks"] == 0


def test_a_warning_raised_in_a_hook_reaches_the_user_once_per_backward(backend: str) -> None:
    """See [Note: Warnings while Dynamo traces]: tracing the hook does not repeat it."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)

    def triple_into_a_too_small_buffer(grad: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(1)
        torch.mul(grad, 3, out=buffer)  # torch warns that it resizes `buffer`
        return buffer

    def step(i: int) -> int:
        x.grad = None
        y = x * 2
        y.register_hook(triple_into_a_too_small_buffer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y.sum().backward()
        return sum("was resized" in str(w.message) for w in caught)

    filters_before = list(warnings.filters)
    result = compare(step, backend, tensors=[x], steps=2)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 1
    assert result.stats["eager_fallbacks"] == 0
    assert warnings.filters == filters_before


@pytest.mark.parametrize("hooks", ["pre", "post", "pre+post"])
def test_python_hooks_on_a_leafs_grad_accumulator_run_in_eager_order_without_a_break(
    hooks: str, backend: str
) -> None:
    """See [Note: Leaf node hooks]: Megatron/DeepSpeed-style ``grad_acc.register_hook`` per parameter."""
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    log: list[str] = []

    def step(i: int) -> list[str]:
        log.clear()
        a.grad = b.grad = None
        z = b * 3  # created first, so its branch runs after a's accumulation
        h = a * 2
        grad_acc = h.grad_fn.next_functions[0][0]
        if "pre" in hooks:
            grad_acc.register_prehook(lambda go: (log.append(f"pre {go[0].tolist()}"), (go[0] * 10,))[1])
        if "post" in hooks:
            grad_acc.register_hook(lambda gi, go: log.append(f"post {list(gi)} {go[0].tolist()}"))
        z.register_hook(lambda g: log.append(f"z hook sees a.grad={a.grad.tolist()}"))
        (h.sum() + z.sum()).backward()
        return list(log)

    result = compare(step, backend, tensors=[a, b], steps=2)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 1
    assert result.stats["graph_breaks"] == 0 and result.stats["eager_fallbacks"] == 0


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_leafs_post_hook_sees_the_grad_that_became_its_grad(layout: str, backend: str) -> None:
    """See [Note: A leaf steals its first grad]: AccumulateGrad's post hook sees .grad's storage.

    A transposed grad breaks the layout contract: eager copies it, and the
    post-accumulate hook's change does not show in the post hook's input.
    """

    def step(i: int) -> torch.Tensor:
        t = torch.ones(2, 2, requires_grad=True)  # a fresh leaf: its hooks are the step's own
        acc = t.view_as(t).grad_fn.next_functions[0][0]
        t.register_hook(lambda g: g.sub(2.0) if layout == "contiguous" else g.sub(2.0).t().contiguous().t())
        acc.register_prehook(lambda go: (go[0].div(5.0),))
        t.register_post_accumulate_grad_hook(lambda p: (p.grad.add_(0.5), None)[1])
        acc.register_hook(lambda gi, go: setattr(t, "grad", go[0].mul(10)))
        (t * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
        return t.grad

    result = compare(step, backend, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["graph_breaks"] == 0 and result.stats["eager_fallbacks"] == 0


@pytest.mark.parametrize("grads", ["views of a flat buffer", "kept from the first step"])
def test_a_leafs_existing_grad_is_added_to_in_place(grads: str, backend: str) -> None:
    """See [Note: A leaf's grad is added to in place]: leaves accumulated in the graph keep their .grad tensor.

    The post-accumulate-grad hooks put the leaves in the graph; they read the
    flat buffer (contiguous grads, as optimizers and communication libraries
    keep them) or the .grad tensors kept after the first step. Before, every
    later grad went into a fresh tensor that neither saw.
    """
    state: dict[str, Any] = {}

    def step(i: int) -> dict[str, torch.Tensor]:
        if i == 0:
            model = _mlp()
            params = list(model.parameters())
            buffer = torch.zeros(sum(p.numel() for p in params))
            if grads == "views of a flat buffer":
                offset = 0
                for p in params:
                    p.grad = buffer[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
            seen: list[torch.Tensor] = []
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(p.grad.sum()))
            state.update(model=model, params=params, buffer=buffer, seen=seen, kept=None)
        model, params = state["model"], state["params"]
        model(INPUT).pow(2).mean().backward()
        if state["kept"] is None:
            state["kept"] = [p.grad for p in params]
        out = {"buffer": state["buffer"].clone(), "seen": torch.stack(state["seen"])}
        out.update({f"kept{k}": g.clone() for k, g in enumerate(state["kept"])})
        out["same tensors"] = torch.tensor([p.grad is g for p, g in zip(params, state["kept"])])
        return out

    result = compare(step, backend, steps=3)
    result.assert_ok()
    assert result.stats["captures"] <= 2  # the second: .grad became defined
    assert result.stats["cache_hits"] >= 1
    assert result.stats["graph_breaks"] == 0 and result.stats["eager_fallbacks"] == 0


class _MaybeRaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, fail):  # type: ignore[override]
        ctx.log, ctx.fail = log, fail
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.log.append("function backward")
        if ctx.fail:
            raise KeyError("user error in a Function's backward")
        return grad * 2, None, None


def _raising(log: list[str], fail: bool, kind: str) -> Callable[..., Any]:
    def hook(*args: Any) -> None:
        log.append(kind)
        if fail:
            raise KeyError(f"user error in a {kind}")

    return hook


def _build_with_raising(kind: str, x: torch.Tensor, log: list[str], fail: bool) -> torch.Tensor:
    """``x``'s graph with a user callable of ``kind`` that logs, then raises if ``fail``."""
    hook = _raising(log, fail, kind)
    if kind == "unpack hook":

        def unpack(t: torch.Tensor) -> torch.Tensor:
            hook()
            return t

        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            return (x * 1).sin().sum()
    if kind == "function backward":
        return _MaybeRaisingBackward.apply(x * 1, log, fail).sum()
    h = x * 3
    if kind == "tensor hook":
        h.register_hook(hook)
    elif kind == "grad_fn pre-hook":
        h.grad_fn.register_prehook(hook)
    elif kind == "grad_fn post-hook":
        h.grad_fn.register_hook(hook)
    elif kind == "hook calling an op with a bad argument":
        h.register_hook(lambda g: (log.append(kind), torch.nn.functional.softmax(g, dim=5))[1])
    elif kind == "hook failing inside torch's Python code":

        def check(g: torch.Tensor) -> None:
            log.append(kind)
            if fail:
                torch.testing.assert_close(g, g + 1)

        h.register_hook(check)
    return h.sin().sum()


@pytest.mark.parametrize(
    "kind",
    [
        "tensor hook",
        "grad_fn pre-hook",
        "grad_fn post-hook",
        "post-accumulate-grad hook",
        "unpack hook",
        "function backward",
        "hook calling an op with a bad argument",
        "hook failing inside torch's Python code",
    ],
)
@pytest.mark.parametrize("failing_step", [0, 1], ids=["on the capture", "on a cache hit"])
def test_a_users_exception_propagates_as_in_eager_and_runs_its_code_once(
    kind: str, failing_step: int, backend: str
) -> None:
    """See [Note: User errors are tagged]: eager's exception, untagged, side effects once, no fallback."""

    def step(i: int) -> tuple[list[str], str, bool]:
        log: list[str] = []
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        if kind == "post-accumulate-grad hook":
            x.register_post_accumulate_grad_hook(_raising(log, i == failing_step, kind))
            loss = (x * 3).sin().sum()
        else:
            loss = _build_with_raising(kind, x, log, i == failing_step)
        try:
            loss.backward()
            error = "none"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            tagged = hasattr(e, "__ca_user_error__")
        else:
            tagged = False
        return log, error, tagged

    result = compare(step, backend, steps=3)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["captures"] >= 1 and result.stats["cache_hits"] >= 1


def test_a_hook_reads_another_nodes_saved_tensor_before_that_node_runs(backend: str) -> None:
    """See [Note: Hooks that read saved tensors]: on cache hits too, as in eager."""
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)

    def step(i: int) -> list[float]:
        x.grad = None
        h = x.sin()  # SinBackward0 saves x as _saved_self
        z = h * 3.0
        seen: list[float] = []
        z.register_hook(lambda g: seen.append(h.grad_fn._saved_self.sum().item()))
        z.sum().backward()
        return seen

    result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0


class _FrozenError(Exception):
    """A user's exception class that refuses attribute writes."""

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"_FrozenError refuses {name}")


@pytest.mark.parametrize("compiler", ["graph-as-is", "eager", "aot_eager"])
@pytest.mark.parametrize("graph_break", [False, True], ids=["whole", "after-a-graph-break"])
def test_a_users_exception_that_refuses_attributes_propagates_as_itself(
    compiler: str, graph_break: bool
) -> None:
    """See [Note: User errors are tagged]: the tag goes past its __setattr__, the hook runs once a backward.

    Under Dynamo, an exception leaving its frame passes a ``@contextmanager``
    whose ``__exit__`` sets ``__traceback__``, which such a class refuses: the
    AttributeError that replaces it has the user's exception as its context,
    and the user's is raised, as eager raises it (on the first run and on hits).
    """
    calls: list[str] = []

    def step(i: int) -> tuple[str, list[str]]:
        calls.clear()
        x = torch.ones(3, requires_grad=True)
        y = x * 2

        def hook(g: torch.Tensor) -> torch.Tensor:
            calls.append(f"y{i}")
            if i % 2 == 0:
                raise _FrozenError("a user's frozen error")
            return g

        y.register_hook(hook)
        z = y * 3
        if graph_break:
            z.retain_grad()  # run eagerly behind a graph break, before y's hook
        z.register_hook(lambda g: calls.append(f"z{i}") or g)
        try:
            (z * z).sum().backward()
            error = "none"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        return error, list(calls)

    result = compare(step, (lambda gm: gm) if compiler == "graph-as-is" else compiler, steps=4)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 3
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == (1 if graph_break else 0)


#: Hooks that return what eager refuses: (where it is registered, what it returns).
_BAD_RESULTS: dict[str, Callable[[torch.Tensor], None]] = {
    "tensor_hook_wrong_size": lambda h: h.register_hook(lambda g: g[:1]),
    "tensor_hook_an_int": lambda h: h.register_hook(lambda g: 3),
    "tensor_hook_wrong_dtype": lambda h: h.register_hook(lambda g: g.double()),
    "pre_hook_a_list": lambda h: h.grad_fn.register_prehook(lambda go: [go[0] * 2]),
    "pre_hook_too_many": lambda h: h.grad_fn.register_prehook(lambda go: (go[0], go[0])),
    "post_hook_replacing_none": lambda h: h.grad_fn.register_hook(lambda gi, go: (gi[0], gi[0])),
    "post_hook_too_few": lambda h: h.grad_fn.register_hook(lambda gi, go: (gi[0],)),
}


@pytest.mark.parametrize("case", list(_BAD_RESULTS))
def test_a_hook_returning_what_eager_refuses_raises_eagers_error(backend: str, case: str) -> None:
    """See [Note: Hook results checked as eager checks them]; a good backward afterwards is still compiled."""
    x = torch.ones(2, 3, requires_grad=True)

    def step(i: int) -> str:
        x.grad = None
        hidden = x * 2
        if i % 2 == 0:
            _BAD_RESULTS[case](hidden)
        try:
            (hidden * hidden).sum().backward()
        except (TypeError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    result = compare(step, backend, tensors=[x], steps=4)
    result.assert_ok()
    with ca_runtime.disable():
        assert step(0).startswith(
            ("TypeError: expected", "RuntimeError: hook '<lambda>'", "RuntimeError: can't")
        )
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["captures"] + result.stats["cache_hits"] == 4, result.stats


def _swap_hooks(old: torch.utils.hooks.RemovableHandle, a: torch.Tensor, calls: list[str]) -> None:
    old.remove()
    a.register_hook(lambda g: calls.append("new") or g * 10)


class _HookSwapper:
    """Swaps a's hook through a method of its own: a bound-method hook whose code calls ``self._swap``."""

    def __init__(self, old: torch.utils.hooks.RemovableHandle, a: torch.Tensor, calls: list[str]) -> None:
        self.old, self.a, self.calls = old, a, calls

    def on_b(self, g: torch.Tensor) -> None:
        self.calls.append("b")
        self._swap()

    def _swap(self) -> None:
        _swap_hooks(self.old, self.a, self.calls)


class _HookSwapperThroughGetattr:
    """Swaps hooks through ``getattr``, which the look at the hook's code cannot follow without running it."""

    def __init__(self, change: bool, old: Any, a: torch.Tensor, calls: list[str]) -> None:
        self.change, self.old, self.a, self.calls = change, old, a, calls

    def on_b(self, g: torch.Tensor) -> torch.Tensor:
        self.calls.append("b")
        if self.change:
            getattr(self, "_sw" + "ap")()
        return g

    def _swap(self) -> None:
        getattr(self.old, "re" + "move")()
        self.a.register_hook(lambda g: self.calls.append("new") or g * 10)


def _changing_hooks_step(
    change_on: Callable[[int], bool], route: str = "in-the-hook"
) -> Callable[[int], tuple[list[str], torch.Tensor]]:
    """Issue 36: b's hook removes a's hook and registers another one; a's node runs after b's.

    ``route`` is where the change is made: in the hook's own code or
    through ``getattr`` (on the steps ``change_on`` picks), or, on every
    step, in a module function, a function in the hook's closure, a method
    of the hook's own object or one of another object the hook's closure
    holds.
    """

    def step(i: int) -> tuple[list[str], torch.Tensor]:
        calls: list[str] = []
        x = torch.ones(3, requires_grad=True)
        a = x * 2
        b = a * 3
        old = a.register_hook(lambda g: calls.append("old") or g * 100)

        def on_b(g: torch.Tensor) -> torch.Tensor:
            calls.append("b")
            if change_on(i):
                old.remove()
                a.register_hook(lambda g: calls.append("new") or g * 10)
            return g

        swapper = _swap_hooks  # reached by the hook through its closure
        swapping_object = _HookSwapper(old, a, calls)  # its method, reached through the closure too
        hooks: dict[str, Callable[[torch.Tensor], Any]] = {
            "in-the-hook": on_b,
            "module-function": lambda g: calls.append("b") or _swap_hooks(old, a, calls),
            "closure-function": lambda g: calls.append("b") or swapper(old, a, calls),
            "own-method": _HookSwapper(old, a, calls).on_b,
            "another-objects-method": lambda g: swapping_object.on_b(g) or g,
            "through-getattr": _HookSwapperThroughGetattr(change_on(i), old, a, calls).on_b,
        }
        b.register_hook(hooks[route])
        b.sum().backward()
        return calls, x.grad

    return step


_hook_that_changes_a_later_nodes_hooks = _changing_hooks_step(lambda i: True)


def test_a_hook_that_changes_later_hooks_runs_eagerly_from_the_first_backward(backend: str) -> None:
    """See [Note: Hooks changed while a graph runs]: the hook names a registration, so its first backward is eager's."""
    with pytest.warns(ca_runtime.EagerFallbackWarning, match="registered or removed hooks") as caught:
        result = compare(_hook_that_changes_a_later_nodes_hooks, backend, steps=3, expect_capture=False)
    messages = [str(w.message) for w in caught if "registered or removed hooks" in str(w.message)]
    assert len(messages) == 1 and "this backward ran on the eager engine" in messages[0]
    result.assert_ok()  # "new" ran, not "old", on every step: grads 60, not 600
    assert result.stats["deferred_captures"] == 1
    assert result.stats["captures"] == 0
    assert result.stats["eager_fallbacks"] == 2
    (entry,) = [e for e in ca_runtime.cache_info() if e.failed]
    assert "registered or removed hooks" in entry.failure


_DECLINED = "registers or removes autograd hooks"


def test_a_hook_that_changes_later_hooks_only_on_a_later_backward_runs_eagerly(backend: str) -> None:
    """See [Note: Which captures wait]: a hook whose code names a registration is never compiled, so a change it
    makes only on a later backward is eager's too (the graph would have called "old" there, where eager calls "new")."""
    step = _changing_hooks_step(lambda i: i == 2)

    with pytest.warns(ca_runtime.EagerFallbackWarning) as caught:
        result = compare(step, backend, steps=4, expect_capture=False)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "on_b cannot be compiled" in messages[0] and _DECLINED in messages[0]
    result.assert_ok()  # step 2: "new" ran, not "old": grads 60, not 600
    # Step 0 deferred (nothing changed), step 1 declined, step 2 and 3 eager at the failed entry.
    assert result.stats["deferred_captures"] == 1
    assert result.stats["captures"] == 0
    assert result.stats["eager_fallbacks"] == 3
    (entry,) = [e for e in ca_runtime.cache_info() if e.failed]
    assert _DECLINED in entry.failure


def test_a_hook_change_the_look_cannot_see_is_found_after_the_graph_ran(backend: str) -> None:
    """What is left (see [Note: Hooks changed while a graph runs]): code reached through getattr is not read, so a
    change it makes on a later backward is found after that backward's graph ran; its grads are the graph's, warned
    about once, and later backwards run eagerly."""
    step = _changing_hooks_step(lambda i: i == 1, "through-getattr")

    with pytest.warns(ca_runtime.EagerFallbackWarning, match="registered or removed hooks") as caught:
        result = compare(step, backend, steps=4)
    messages = [str(w.message) for w in caught if "registered or removed hooks" in str(w.message)]
    assert len(messages) == 1 and "its grads may differ from eager's" in messages[0]
    # Step 0 captured (capture_after=1); step 1 hit its graph, which called "old" where eager calls "new".
    assert {d.name for d in result.mismatches} == {"step1.return[1]", "step1.return[2]"}
    assert result.stats["captures"] == 1
    assert result.stats["eager_fallbacks"] == 2


@pytest.mark.parametrize(
    "route", ["module-function", "closure-function", "own-method", "another-objects-method"]
)
def test_a_hook_change_made_by_a_function_the_hook_calls_is_found_at_the_first_backward(
    backend: str, route: str
) -> None:
    """The look at a hook's code follows the functions it calls by name (see [Note: Which captures wait])."""
    with pytest.warns(ca_runtime.EagerFallbackWarning, match="registered or removed hooks") as caught:
        result = compare(_changing_hooks_step(lambda i: True, route), backend, steps=3, expect_capture=False)
    assert sum("registered or removed hooks" in str(w.message) for w in caught) == 1
    result.assert_ok()  # "new" ran, not "old", on every step: grads 60, not 600
    assert result.stats["deferred_captures"] == 1
    assert result.stats["captures"] == 0
    assert result.stats["eager_fallbacks"] == 2


def test_the_look_at_hook_code_follows_calls_by_name_only_and_at_most_64() -> None:
    """What it reaches and what it does not, on code objects alone (nothing is run)."""
    from ca_runtime._runtime import _MAX_FUNCTIONS_FOLLOWED, _function_naming_a_hook_change

    def chain(depth: int) -> Callable[[], None]:
        namespace: dict[str, Any] = {"_swap_hooks": _swap_hooks}
        source = "def f0():\n    _swap_hooks(None, None, [])\n" + "".join(
            f"def f{k}():\n    f{k - 1}()\n" for k in range(1, depth)
        )
        exec(source, namespace)
        return namespace[f"f{depth - 1}"]

    assert _function_naming_a_hook_change([chain(3)])  # f2 -> f1 -> f0 -> _swap_hooks, which names remove
    assert not _function_naming_a_hook_change([chain(_MAX_FUNCTIONS_FOLLOWED + 5)])  # past the bound
    assert not _function_naming_a_hook_change([lambda g: g * 2, torch.sin, functools.partial(print, 1)])
    # An attribute that shares a module function's name is not that function.
    assert not _function_naming_a_hook_change([lambda g: g._swap_hooks])

    class Other:
        def change(self) -> None:
            _swap_hooks(None, None, [])  # type: ignore[arg-type]

    class Quiet:
        def change(self) -> None:
            print("nothing registered")

    other, quiet = Other(), Quiet()
    # A method of an object the hook's closure holds, looked up on its class.
    assert _function_naming_a_hook_change([lambda g: other.change()])
    assert _function_naming_a_hook_change([other.change])
    assert not _function_naming_a_hook_change([lambda g: quiet.change()])
    # The same attribute name on an object whose class has no such method, or a builtin one.
    assert not _function_naming_a_hook_change([lambda g: (quiet.change(), [].append(g))])
    # An attribute set on the instance is not read: the look never runs code, and
    # a lambda stored there is data until called.
    quiet.__dict__["change"] = lambda: _swap_hooks(None, None, [])  # type: ignore[arg-type]
    assert not _function_naming_a_hook_change([lambda g: quiet.change()])
    # A function of a module the closure holds.
    module = ModuleType("helpers")
    exec("def change():\n    handle.remove()\n", vars(module))
    assert _function_naming_a_hook_change([lambda g: module.change()])
    # torch's own methods are not followed that way: SGD.step's code calls a
    # list's remove, and stepping an optimizer in a post-accumulate-grad hook
    # (torch's optimizer-in-backward) changes no hooks.
    optimizer = torch.optim.SGD([torch.ones(1, requires_grad=True)], lr=0.1)
    assert not _function_naming_a_hook_change([lambda p: optimizer.step()])
    # Nor the standard library's: Logger.removeHandler's code calls list.remove.
    logger = logging.getLogger("ca_runtime.tests.hook_look")
    assert not _function_naming_a_hook_change([lambda g: logger.removeHandler(logging.NullHandler())])


def test_the_look_at_hook_code_never_raises_and_reads_held_objects_statically() -> None:
    """It runs inside a backward on whatever hooks hold: an object it cannot read counts as one that may change hooks."""
    from ca_runtime._runtime import _function_naming_a_hook_change

    class Unreadable:
        def __getattribute__(self, name: str) -> Any:
            raise RuntimeError(f"read {name}")

    class Lazy:
        """A proxy whose attribute reads run code (a lazy module, a wrapt proxy)."""

        reads = 0

        def __getattr__(self, name: str) -> Any:
            Lazy.reads += 1
            return _swap_hooks

    unreadable, lazy = Unreadable(), Lazy()
    assert (
        _function_naming_a_hook_change([lambda g: unreadable.x(g) or g])
        == "a hook whose code could not be read (RuntimeError)"
    )
    assert _function_naming_a_hook_change([lambda g: lazy.change(g) or g]) is None  # __getattr__ is never run
    assert Lazy.reads == 0
    nameless = ModuleType("nameless")
    del nameless.__name__
    assert _function_naming_a_hook_change([lambda g: nameless.f(g) or g]) is None


def test_the_look_follows_names_the_hook_calls_before_a_library_an_object_leads_to() -> None:
    """A library past the bound, reached through a held module, cannot hide a change made by a function called by name."""
    from ca_runtime._runtime import _MAX_FUNCTIONS_FOLLOWED, _function_naming_a_hook_change

    library = ModuleType("a_library")
    exec(
        "def f0(g):\n    return g\n"
        + "".join(f"def f{k}(g):\n    return f{k - 1}(g)\n" for k in range(1, _MAX_FUNCTIONS_FOLLOWED + 10)),
        vars(library),
    )
    namespace: dict[str, Any] = {"library": library, "_swap_hooks": _swap_hooks}
    exec(
        f"def log_grad(g):\n    return library.f{_MAX_FUNCTIONS_FOLLOWED + 9}(g)\n"
        "def swap():\n    _swap_hooks(None, None, [])\n"
        "def hook(g):\n    log_grad(g)\n    swap()\n",
        namespace,
    )
    assert _function_naming_a_hook_change([namespace["hook"]])


def test_the_look_reads_each_attribute_name_once_and_at_most_4096(monkeypatch: pytest.MonkeyPatch) -> None:
    from ca_runtime import _runtime

    class Config:
        pass

    namespace: dict[str, Any] = {"cfg": Config(), "other": Config()}
    body = "".join(f"    x = cfg.attr{k} + other.attr{k} + cfg.attr{k}\n" for k in range(3000))
    exec("def hook(g):\n" + body, namespace)
    reads = 0
    real = _runtime.inspect.getattr_static

    def counted(obj: object, name: str, default: object = None) -> object:
        nonlocal reads
        reads += 1
        return real(obj, name, default)

    monkeypatch.setattr(_runtime.inspect, "getattr_static", counted)
    assert not _runtime._function_naming_a_hook_change([namespace["hook"]])
    # 3,000 distinct names on the first object (its class's module), none past the bound on the second.
    assert reads <= _runtime._MAX_ATTRIBUTE_LOOKUPS + 16, reads
    # Objects the look skips (torch's tensors) spend none of the bound.
    held = {"a": torch.ones(1), "b": torch.ones(1)}
    exec("def hook(g):\n    return a.x + b.y\n", held)
    scan = _runtime._HookCodeScan(follow_held_objects=True)
    assert not scan.function_names_a_hook_change(held["hook"])
    assert scan.lookups_left == _runtime._MAX_ATTRIBUTE_LOOKUPS


def test_a_hook_that_registers_hooks_outside_its_graph_changes_nothing(backend: str) -> None:
    """A hook registered from a hook on another graph's tensor is no change to this graph's hooks."""
    elsewhere = torch.ones(2, requires_grad=True) * 2

    def step(i: int) -> tuple[list[str], torch.Tensor]:
        calls: list[str] = []
        x = torch.ones(3, requires_grad=True)
        y = x * 2

        def register_elsewhere(grad: torch.Tensor) -> None:
            calls.append("y")
            elsewhere.register_hook(lambda e: e)

        y.register_hook(register_elsewhere)
        (y * y).sum().backward()
        return calls, x.grad

    with pytest.warns(ca_runtime.EagerFallbackWarning) as caught:
        result = compare(step, backend, steps=3, expect_capture=False)
    result.assert_ok()
    # The hook names register_hook: its first backward is deferred and shows no change, and the graph is declined
    # at the next (the look cannot tell which tensor a registration is on); see [Note: Which captures wait].
    assert ["register_elsewhere cannot be compiled" in str(w.message) for w in caught] == [True]
    assert result.stats["deferred_captures"] == 1
    assert result.stats["captures"] == 0
    assert result.stats["eager_fallbacks"] == 2


def test_a_hook_that_removes_itself_is_no_change_and_is_not_compiled(backend: str) -> None:
    """The one-shot pattern: a change to the first node with Python hooks came after eager read them; a hook
    registered on every forward that removes itself is still never compiled (see [Note: Which captures wait])."""
    w = torch.ones(2, requires_grad=True)

    def step(i: int) -> tuple[list[str], torch.Tensor]:
        calls: list[str] = []
        y = w * 2
        handles = []

        def once(grad: torch.Tensor) -> torch.Tensor:
            calls.append("once")
            handles[0].remove()
            return grad * 3

        handles.append(y.register_hook(once))
        (y * y).sum().backward()
        return calls, w.grad.clone()

    with pytest.warns(ca_runtime.EagerFallbackWarning) as caught:
        result = compare(step, backend, tensors=[w], steps=4, expect_capture=False)
    result.assert_ok()
    # The hook names remove, so its graph is never compiled: the first backward of each key path (w.grad None, then
    # defined) is deferred, and the change it makes is none; the next one at the second path is declined, once.
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and _DECLINED in messages[0] and "once cannot be compiled" in messages[0], (
        messages
    )
    assert result.stats["deferred_captures"] == 2
    assert result.stats["captures"] == 0
    assert result.stats["eager_fallbacks"] == 2


def test_a_hook_change_warned_as_an_error_still_sends_the_graph_to_eager(backend: str) -> None:
    """A warnings filter that makes the warning an error: the user sees it, and the graph is still never captured."""
    with ca_runtime.enable(backend, capture_after=1):
        ca_runtime.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ca_runtime.EagerFallbackWarning)
            with pytest.raises(ca_runtime.EagerFallbackWarning, match="registered or removed hooks"):
                _hook_that_changes_a_later_nodes_hooks(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ca_runtime.EagerFallbackWarning)
            calls, grad = _hook_that_changes_a_later_nodes_hooks(1)
        stats = ca_runtime.stats()
    assert calls == ["b", "new"] and torch.equal(grad, torch.full((3,), 60.0))
    assert stats["captures"] == 0 and stats["deferred_captures"] == 1 and stats["eager_fallbacks"] == 1, stats


def _add_post_hook(node: torch.autograd.graph.Node, calls: list[str]) -> None:
    node.register_hook(
        lambda grad_inputs, grad_outputs: calls.append("post") or (grad_inputs[0] * 10, *grad_inputs[1:])
    )


@pytest.mark.parametrize("through_a_function", [False, True], ids=["in-the-hook", "in-a-function-it-calls"])
def test_a_post_hook_registered_on_the_first_hooked_node_by_its_own_hook_is_a_change(
    backend: str, through_a_function: bool
) -> None:
    """The first node with Python hooks: eager reads its post hooks after its tensor hooks ran, so it calls one they
    registered; see [Note: Hooks changed while a graph runs]."""

    def step(i: int) -> tuple[list[str], torch.Tensor]:
        calls: list[str] = []
        x = torch.ones(3, requires_grad=True)
        b = (x * 2) * 3
        node = b.grad_fn
        assert node is not None

        def on_b(g: torch.Tensor) -> None:
            calls.append("b")
            node.register_hook(
                lambda grad_inputs, grad_outputs: (
                    calls.append("post") or (grad_inputs[0] * 10, *grad_inputs[1:])
                )
            )

        if through_a_function:
            b.register_hook(lambda g: calls.append("b") or _add_post_hook(node, calls))
        else:
            b.register_hook(on_b)
        b.sum().backward()
        return calls, x.grad

    with ca_runtime.disable():
        calls, grad = step(0)
    assert calls == ["b", "post"] and torch.equal(grad, torch.full((3,), 60.0))
    with pytest.warns(ca_runtime.EagerFallbackWarning, match="registered or removed hooks") as caught:
        result = compare(step, backend, steps=3, expect_capture=False)
    assert sum("registered or removed hooks" in str(w.message) for w in caught) == 1
    assert result.stats["eager_fallbacks"] == 2
    # The hook (or the function it calls) names register_hook: its first backward ran eagerly.
    result.assert_ok()
    assert result.stats["captures"] == 0 and result.stats["deferred_captures"] == 1
