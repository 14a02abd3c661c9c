"""Real training setups against eager: torch.compile'd forwards, double backward, callbacks."""

from __future__ import annotations

import ca_runtime
import pytest
import torch
from ca_testkit import compare


def _mlp(seed: int = 0, width: int = 16) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 4),
    )


def _assert_captured(stats: dict[str, int], graph_breaks: int = 0, captures: int = 1) -> None:
    assert stats["captures"] >= captures, stats
    assert stats["eager_fallbacks"] == 0, stats
    assert stats["graph_breaks"] == graph_breaks, stats


# --- backward of a torch.compile'd region (see [Note: AOT backwards]) ---


def test_compiled_model_backward_is_captured(backend: str) -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(5, 8)

    def step() -> torch.Tensor:
        loss = compiled(x).pow(2).sum()
        loss.backward()
        return loss

    result = compare(step, backend, tensors=model, steps=3)
    result.assert_ok()
    _assert_captured(result.stats)


class _Sandwich(torch.nn.Module):
    """Two compiled submodules with eager code (and a leaf input grad) between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.encoder = torch.compile(
            torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.GELU()), backend="aot_eager"
        )
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.head = torch.compile(torch.nn.Linear(12, 3), backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        h = torch.sin(h) * self.scale  # eager between the compiled regions
        return self.head(h)


def test_compiled_submodules_with_eager_code_between(backend: str) -> None:
    model = _Sandwich()
    x = torch.randn(6, 8, requires_grad=True)

    def step() -> torch.Tensor:
        out = model(x)
        out.sum().backward()
        return out.detach()

    result = compare(step, backend, tensors={**dict(model.named_parameters()), "x": x}, steps=3)
    result.assert_ok()
    _assert_captured(result.stats)


def test_compiled_region_with_unused_and_integer_outputs(backend: str) -> None:
    """An output whose grad is undefined gets AOT's zeros; a non-differentiable one none."""
    w = torch.randn(4, 4, requires_grad=True)

    @torch.compile(backend="aot_eager")
    def region(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x @ w
        return y.relu(), y.exp(), y.argmax(dim=1)

    x = torch.randn(3, 4)

    def step() -> None:
        a, _unused, idx = region(x)
        (a * idx.unsqueeze(1)).sum().backward()

    result = compare(step, backend, tensors=[w], steps=2)
    result.assert_ok()
    _assert_captured(result.stats)


def test_compiled_forward_recompiled_for_new_batch_sizes(backend: str) -> None:
    """A forward that turns dynamic after a new batch size: its symints reach our graph."""
    model = _mlp(seed=2)
    compiled = torch.compile(model, backend="aot_eager")
    batches = [4, 7, 12, 7, 5]

    def step(i: int) -> None:
        torch.manual_seed(i)
        x = torch.randn(batches[i], 8)
        compiled(x).sum().backward()

    result = compare(step, backend, tensors=model, steps=len(batches))
    result.assert_ok()
    _assert_captured(result.stats)
    # Static, then one graph per forward class and .grad state at most.
    assert result.stats["captures"] <= 4, result.stats


def test_compiled_region_under_create_graph_breaks_only_that_node(backend: str) -> None:
    """AOT's backward is not differentiable: create_graph=True runs it eagerly, as eager does."""
    model = _mlp(seed=3)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 8, requires_grad=True)

    def step() -> torch.Tensor:
        (g,) = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
        return g.detach()

    result = compare(step, backend, tensors=[x], steps=2)
    result.assert_ok()
    _assert_captured(result.stats, graph_breaks=1)


@pytest.mark.inductor
def test_inductor_forward_with_inductor_backward() -> None:
    model = _mlp(seed=4, width=32)
    compiled = torch.compile(model, backend="inductor")
    x = torch.randn(16, 8)

    def step() -> None:
        compiled(x).pow(2).mean().backward()

    result = compare(step, "inductor", tensors=model, steps=3, atol=1e-5)
    result.assert_ok()
    _assert_captured(result.stats)


# --- create_graph=True: double backward captured too ---


def test_gradient_penalty(backend: str) -> None:
    """WGAN-GP: grads of the critic w.r.t. its input, penalised, then one backward."""
    critic = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(6, 4, requires_grad=True)

    def step() -> torch.Tensor:
        out = critic(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
        loss = out.mean() + 10 * gp
        loss.backward()
        return loss.detach()

    result = compare(step, backend, tensors={**dict(critic.named_parameters()), "x": x}, steps=3)
    result.assert_ok()
    _assert_captured(result.stats, captures=2)


def test_hessian_vector_product(backend: str) -> None:
    w = torch.randn(5, requires_grad=True)
    a = torch.randn(5, 5)
    v = torch.randn(5)

    def step() -> torch.Tensor:
        loss = (torch.tanh(a @ w) ** 2).sum() + (w**3).sum()
        (g,) = torch.autograd.grad(loss, w, create_graph=True)
        (hv,) = torch.autograd.grad((g * v).sum(), w)
        return hv

    result = compare(step, backend, tensors=[w], steps=3)
    result.assert_ok()
    _assert_captured(result.stats, captures=2)


def test_maml_inner_loop(backend: str) -> None:
    """Inner SGD steps with create_graph=True; the outer loss differentiates through them."""
    torch.manual_seed(5)
    w = torch.randn(4, 1, requires_grad=True)
    xs, ys = torch.randn(8, 4), torch.randn(8, 1)
    xq, yq = torch.randn(8, 4), torch.randn(8, 1)

    def step() -> torch.Tensor:
        fast = w
        for _ in range(2):
            inner = ((xs @ fast).tanh() - ys).pow(2).mean()
            (g,) = torch.autograd.grad(inner, fast, create_graph=True)
            fast = fast - 0.1 * g
        outer = ((xq @ fast).tanh() - yq).pow(2).mean()
        outer.backward()
        return outer.detach()

    result = compare(step, backend, tensors=[w], steps=3)
    result.assert_ok()
    _assert_captured(result.stats, captures=3)


# --- engine callbacks and leaf node hooks (see [Note: Final callbacks], [Note: Leaf node hooks]) ---


def _callback_step(x: torch.Tensor, log: list[str]):
    from torch.autograd import Variable

    def step() -> list[str]:
        log.clear()
        y = x * 2

        def hook(grad: torch.Tensor) -> torch.Tensor:
            log.append("hook")

            def first() -> None:
                log.append("first")
                Variable._execution_engine.queue_callback(lambda: log.append("queued by first"))

            Variable._execution_engine.queue_callback(first)
            Variable._execution_engine.queue_callback(
                lambda: log.append(f"second sees grad={x.grad is not None}")
            )
            return grad

        y.register_hook(hook)
        y.sum().backward()
        log.append("after backward")
        return list(log)

    return step


def test_queued_callbacks_run_at_the_end_in_order(backend: str) -> None:
    x = torch.randn(3, requires_grad=True)
    log: list[str] = []
    result = compare(_callback_step(x, log), backend, tensors=[x], steps=2)
    result.assert_ok()
    assert log == ["hook", "first", "second sees grad=True", "queued by first", "after backward"]
    _assert_captured(result.stats)


def test_queued_callbacks_run_once_on_an_eager_fallback() -> None:
    x = torch.randn(3, requires_grad=True)
    log: list[str] = []

    def failing_compiler(gm: torch.fx.GraphModule):
        raise RuntimeError("no compiler today")

    with pytest.warns(ca_runtime.EagerFallbackWarning):
        result = compare(_callback_step(x, log), failing_compiler, tensors=[x], steps=2, expect_capture=False)
    result.assert_ok()
    assert log.count("first") == 1 and log.count("queued by first") == 1, log
    assert result.stats["eager_fallbacks"] == 2


def test_grad_accumulator_hooks_run_as_in_eager(backend: str) -> None:
    w = torch.randn(3, requires_grad=True)
    calls: list[str] = []
    accumulator = (w * 1).grad_fn.next_functions[0][0]
    accumulator.register_prehook(lambda grads: calls.append(f"pre {grads[0].sum().item():.3f}"))
    accumulator.register_hook(lambda outs, ins: calls.append(f"post grad={w.grad is not None}"))

    def step() -> list[str]:
        calls.clear()
        (w * w).sum().backward()
        return list(calls)

    result = compare(step, backend, tensors=[w], steps=2)
    result.assert_ok()
    assert len(calls) == 2 and calls[1] == "post grad=True", calls
    _assert_captured(result.stats)


def test_compiled_region_called_twice_in_one_step(backend: str) -> None:
    """One compiled submodule applied twice (weight sharing): its backward is copied twice."""
    torch.manual_seed(6)
    shared = torch.nn.Linear(6, 6)
    region = torch.compile(shared, backend="aot_eager")
    x = torch.randn(4, 6)

    def step() -> None:
        region(torch.tanh(region(x))).sum().backward()

    result = compare(step, backend, tensors=shared, steps=2)
    result.assert_ok()
    _assert_captured(result.stats)


def test_post_accumulate_grad_hook_before_a_compiled_region_needs_no_break(backend: str) -> None:
    """A copied AOT backward calls no user code, so leaves before it stay graph outputs."""
    torch.manual_seed(7)
    head = torch.nn.Linear(6, 3)
    body = torch.compile(torch.nn.Linear(6, 6), backend="aot_eager")
    seen: list[bool] = []
    for p in head.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    x = torch.randn(4, 6)

    def step() -> None:
        head(body(x)).sum().backward()

    result = compare(step, backend, tensors=[*head.parameters(), *body.parameters()], steps=2)
    result.assert_ok()
    assert seen and all(seen)
    _assert_captured(result.stats)


def test_hook_registered_inside_a_compiled_region(backend: str) -> None:
    w = torch.randn(4, 4, requires_grad=True)
    seen: list[int] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return grad * 2

    @torch.compile(backend="aot_eager")
    def region(x: torch.Tensor) -> torch.Tensor:
        y = x @ w
        y.register_hook(hook)
        return y.relu().sum()

    x = torch.randn(3, 4)

    def step() -> int:
        seen.clear()
        region(x).backward()
        return len(seen)

    result = compare(step, backend, tensors=[w], steps=2)
    result.assert_ok()
    _assert_captured(result.stats)


def test_optimizer_in_backward_hooks_are_traced_into_the_graph(backend: str) -> None:
    """Post-accumulate-grad hooks (an SGD step, a record of the grad) run inside the graph."""
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    records: list[torch.Tensor] = []

    def sgd(p: torch.Tensor) -> None:
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)
        p.grad = None

    for p in model[0].parameters():
        p.register_post_accumulate_grad_hook(sgd)
    for p in model[2].parameters():
        p.register_post_accumulate_grad_hook(lambda p: records.append(p.grad.clone()))
    x = torch.randn(5, 6)

    def step() -> list[torch.Tensor]:
        records.clear()
        model(x).pow(2).sum().backward()
        return [*records, *(p.detach().clone() for p in model.parameters())]

    result = compare(step, backend, tensors=model, steps=3)
    result.assert_ok()
    _assert_captured(result.stats)
    graph = ca_runtime.last_graph()
    assert graph is not None and graph.code.count("_accumulate_leaf(") == 4, graph.code


def test_a_hook_reading_a_leaf_grad_mid_backward_sees_eagers_value(backend: str) -> None:
    """The leaf is accumulated at its eager position, before the hook that runs after it."""
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    seen: list[torch.Tensor | None] = []

    def step() -> list[torch.Tensor | None]:
        seen.clear()
        c = x.sin()  # lower sequence number: its SinBackward0 runs after w's AccumulateGrad
        a = w * 2
        c.grad_fn.register_prehook(lambda grads: seen.append(None if w.grad is None else w.grad.clone()))
        (a.sum() + c.sum()).backward()
        return list(seen)

    result = compare(step, backend, tensors=[w, x], steps=3)
    result.assert_ok()
    _assert_captured(result.stats)
    graph = ca_runtime.last_graph()
    assert graph is not None and "_accumulate_leaf(" in graph.code
