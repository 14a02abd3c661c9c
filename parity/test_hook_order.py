"""Hook order: every kind of backward hook, alone and together on one graph, as eager runs them.

Each test records the hook calls in a list and asserts eager's list (which
hooks ran, how often, in which order) and the grads the hooks' return values
lead to.
"""

from __future__ import annotations

import torch


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_tensor_hooks_run_from_the_output_back_to_the_leaf() -> None:
    calls: list[str] = []
    x = _leaf(1.0, 2.0, 3.0)
    y = x * 2
    z = y * y
    for name, tensor in (("x", x), ("y", y), ("z", z)):
        tensor.register_hook(lambda grad, name=name: calls.append(name))
    z.sum().backward()
    assert calls == ["z", "y", "x"]
    assert torch.equal(x.grad, torch.tensor([8.0, 16.0, 24.0]))


def test_hooks_on_one_tensor_chain_in_registration_order() -> None:
    calls: list[tuple[str, list[float]]] = []
    x = _leaf(1.0, 2.0)
    y = x * 3

    def add_one(grad: torch.Tensor) -> torch.Tensor:
        calls.append(("add_one", grad.tolist()))
        return grad + 1

    def double(grad: torch.Tensor) -> torch.Tensor:
        calls.append(("double", grad.tolist()))
        return grad * 2

    y.register_hook(add_one)
    y.register_hook(double)
    y.sum().backward()
    assert calls == [("add_one", [1.0, 1.0]), ("double", [2.0, 2.0])]
    assert torch.equal(x.grad, torch.tensor([12.0, 12.0]))


def test_hook_on_a_view_sees_and_changes_the_views_grad_only() -> None:
    seen: list[list[float]] = []
    x = _leaf(1.0, 2.0, 3.0, 4.0)
    y = x * 1
    tail = y[2:]

    def scale_tail(grad: torch.Tensor) -> torch.Tensor:
        seen.append(grad.tolist())
        return grad * 5

    tail.register_hook(scale_tail)
    (tail * tail).sum().backward()
    assert seen == [[6.0, 8.0]]
    assert torch.equal(x.grad, torch.tensor([0.0, 0.0, 30.0, 40.0]))


def test_tensor_hook_then_grad_fn_prehook_then_posthook() -> None:
    calls: list[str] = []
    x = _leaf(1.0, 2.0)
    y = x.exp()
    z = y.sin()

    def prehook(grad_outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        calls.append("grad_fn prehook")
        return tuple(g * 2 for g in grad_outputs)

    def posthook(grad_inputs: tuple[torch.Tensor, ...], grad_outputs: tuple[torch.Tensor, ...]) -> None:
        calls.append(f"grad_fn posthook inputs={len(grad_inputs)} outputs={len(grad_outputs)}")

    y.grad_fn.register_prehook(prehook)
    y.grad_fn.register_hook(posthook)
    y.register_hook(lambda grad: calls.append("tensor hook"))
    z.sum().backward()
    assert calls == ["tensor hook", "grad_fn prehook", "grad_fn posthook inputs=1 outputs=1"]
    expected = 2 * y.detach().cos() * y.detach()
    assert torch.allclose(x.grad, expected)


def test_grad_fn_posthook_replacing_grad_inputs_changes_the_leaf_grad() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 4

    def zero_first(grad_inputs: tuple[torch.Tensor, ...], grad_outputs: tuple[torch.Tensor, ...]):
        return (grad_inputs[0] * torch.tensor([0.0, 1.0]), *grad_inputs[1:])

    y.grad_fn.register_hook(zero_first)
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 4.0]))


def test_post_accumulate_grad_hook_runs_after_the_leafs_tensor_hook_and_sees_its_grad() -> None:
    calls: list[tuple[str, list[float] | None]] = []
    w = _leaf(1.0, 2.0)
    w.register_hook(lambda grad: calls.append(("tensor hook", grad.tolist())))
    w.register_post_accumulate_grad_hook(lambda leaf: calls.append(("post accumulate", leaf.grad.tolist())))
    (w * 3).sum().backward()
    (w * 3).sum().backward()
    assert calls == [
        ("tensor hook", [3.0, 3.0]),
        ("post accumulate", [3.0, 3.0]),
        ("tensor hook", [3.0, 3.0]),
        ("post accumulate", [6.0, 6.0]),
    ]


def test_post_accumulate_grad_hook_updating_the_parameter_in_backward() -> None:
    """The optimizer-in-backward pattern: an SGD step from the hook, then the grad is dropped."""
    w = _leaf(1.0, 2.0)

    def sgd_step(leaf: torch.Tensor) -> None:
        with torch.no_grad():
            leaf.sub_(0.25 * leaf.grad)
        leaf.grad = None

    w.register_post_accumulate_grad_hook(sgd_step)
    for _ in range(2):
        (w * w).sum().backward()  # grad 2 * w: each step halves w
    assert w.grad is None
    assert torch.equal(w.detach(), torch.tensor([0.25, 0.5]))


def test_a_reference_to_grad_kept_from_the_last_step_sees_the_accumulation() -> None:
    """Eager accumulates into the existing ``.grad`` tensor in place."""
    w = _leaf(1.0, 2.0)
    w.register_post_accumulate_grad_hook(lambda leaf: None)
    (w * 2).sum().backward()
    first_grad = w.grad
    (w * 2).sum().backward()
    assert w.grad is first_grad, "the second backward replaced .grad instead of accumulating into it"
    assert torch.equal(first_grad, torch.tensor([4.0, 4.0]))


def test_hook_reads_a_leaf_grad_accumulated_earlier_in_the_same_backward() -> None:
    """AccumulateGrad of ``w`` runs as soon as it is ready, before ``v``'s branch reaches its hook."""
    seen: list[list[float] | None] = []
    v = _leaf(1.0, 2.0)
    w = _leaf(3.0, 4.0)
    h = v * 3
    h.register_hook(lambda grad: seen.append(None if w.grad is None else w.grad.tolist()))
    (w * h).sum().backward(retain_graph=True)
    (w * h).sum().backward()
    assert seen == [[3.0, 6.0], [6.0, 12.0]]
    assert torch.equal(v.grad, torch.tensor([18.0, 24.0]))


def test_hook_on_the_leafs_accumulate_grad_node_runs_before_later_hooks() -> None:
    calls: list[str] = []
    v = _leaf(1.0, 2.0)
    w = _leaf(3.0, 4.0)
    h = v * 3
    accumulate_w = w.view_as(w).grad_fn.next_functions[0][0]
    accumulate_w.register_prehook(lambda grad_outputs: calls.append("w AccumulateGrad prehook"))
    h.register_hook(lambda grad: calls.append(f"h hook, w.grad={w.grad.tolist()}"))
    (w * h).sum().backward()
    assert calls == ["w AccumulateGrad prehook", "h hook, w.grad=[3.0, 6.0]"]


def test_retain_grad_keeps_the_grad_after_every_tensor_hook() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 2
    y.retain_grad()
    y.register_hook(lambda grad: grad * 3)
    (y * y).sum().backward()
    assert torch.equal(y.grad, torch.tensor([12.0, 24.0]))
    assert torch.equal(x.grad, torch.tensor([24.0, 48.0]))


def test_module_backward_hooks_run_from_the_last_layer_back() -> None:
    calls: list[str] = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    for index in (0, 2):
        layer = model[index]
        layer.register_full_backward_pre_hook(lambda module, go, i=index: calls.append(f"pre {i}"))
        layer.register_full_backward_hook(lambda module, gi, go, i=index: calls.append(f"full {i}"))
    x = torch.ones(2, 3, requires_grad=True)
    model(x).sum().backward()
    assert calls == ["pre 2", "full 2", "pre 0", "full 0"]


def test_removed_hooks_do_not_run_on_the_next_step() -> None:
    calls: list[str] = []
    w = _leaf(1.0, 2.0)
    y_handles = []
    for step in range(3):
        y = w * 2
        if step == 0:
            tensor_handle = w.register_hook(lambda grad: calls.append("w hook") or grad * 10)
            post_handle = w.register_post_accumulate_grad_hook(lambda leaf: calls.append("post"))
        y_handles.append(y.register_hook(lambda grad, step=step: calls.append(f"y hook {step}")))
        if step == 1:
            tensor_handle.remove()
        if step == 2:
            post_handle.remove()
            y_handles[-1].remove()
        y.sum().backward()
    assert calls == ["y hook 0", "w hook", "post", "y hook 1", "post"]
    assert torch.equal(w.grad, torch.tensor([24.0, 24.0]))


def test_every_hook_kind_on_one_graph_in_eagers_order() -> None:
    calls: list[str] = []

    def log(name: str):
        return lambda *args: calls.append(name)

    torch.manual_seed(0)
    layer = torch.nn.Linear(2, 2)
    layer.register_full_backward_pre_hook(log("module pre"))
    layer.register_full_backward_hook(log("module full"))
    layer.weight.register_post_accumulate_grad_hook(log("weight post accumulate"))
    x = _leaf(1.0, 2.0)
    x.register_hook(log("x hook"))
    x.register_post_accumulate_grad_hook(log("x post accumulate"))
    hidden = (x * 2).unsqueeze(0)
    hidden.retain_grad()
    hidden.register_hook(log("hidden hook"))
    hidden.grad_fn.register_prehook(log("hidden grad_fn prehook"))
    hidden.grad_fn.register_hook(log("hidden grad_fn posthook"))
    out = layer(hidden).tanh()
    out.register_hook(log("out hook"))
    out.sum().backward()
    assert calls == [
        "out hook",
        "module pre",
        "weight post accumulate",
        "module full",
        "hidden hook",
        "hidden grad_fn prehook",
        "hidden grad_fn posthook",
        "x hook",
        "x post accumulate",
    ]
    assert torch.allclose(x.grad, 2 * hidden.grad[0])


def test_multi_grad_hook_sees_every_grad_once() -> None:
    seen: list[list[list[float] | None]] = []
    a = _leaf(1.0, 2.0)
    b = _leaf(3.0)
    c = _leaf(5.0)
    torch.autograd.graph.register_multi_grad_hook(
        (a, b, c), lambda grads: seen.append([None if g is None else g.tolist() for g in grads])
    )
    (a * b).sum().backward()
    assert seen == [[[3.0, 3.0], [3.0], None]]


def test_a_hook_that_removes_a_later_hook_and_registers_another() -> None:
    # Eager reads a node's hooks when the node runs: y's hook runs first and
    # swaps x2's hook, so the new one runs and the removed one does not.
    calls: list[str] = []
    x = _leaf(1.0, 2.0, 3.0)
    x2 = x * 2
    y = x2 * 3
    old = x2.register_hook(lambda grad: calls.append("old") or grad * 100)

    def swap(grad: torch.Tensor) -> None:
        calls.append("y")
        old.remove()
        x2.register_hook(lambda grad: calls.append("new") or grad * 10)

    y.register_hook(swap)
    y.sum().backward()
    assert calls == ["y", "new"]
    assert torch.equal(x.grad, torch.tensor([60.0, 60.0, 60.0]))


def test_a_hook_that_swaps_a_later_hook_only_on_its_third_backward() -> None:
    # The same swap, made by a hook registered on every forward but only on
    # the third backward: the backwards before it call the old hook, that one
    # and the ones after it the new one.
    calls: list[str] = []
    grads = []
    for step in range(4):
        x = _leaf(1.0, 2.0, 3.0)
        x2 = x * 2
        y = x2 * 3
        old = x2.register_hook(lambda grad: calls.append("old") or grad * 100)

        def swap(grad: torch.Tensor, step: int = step, old: object = old, x2: torch.Tensor = x2) -> None:
            calls.append("y")
            if step >= 2:
                old.remove()  # type: ignore[attr-defined]
                x2.register_hook(lambda grad: calls.append("new") or grad * 10)

        y.register_hook(swap)
        y.sum().backward()
        grads.append(x.grad[0].item())
    assert calls == ["y", "old", "y", "old", "y", "new", "y", "new"]
    assert grads == [600.0, 600.0, 60.0, 60.0]


def test_a_hook_that_removes_itself_runs_on_the_first_backward_only() -> None:
    calls: list[str] = []
    w = _leaf(1.0, 2.0)
    handles = []

    def once(grad: torch.Tensor) -> torch.Tensor:
        calls.append("once")
        handles[0].remove()
        return grad * 3

    for step in range(3):
        y = w * 2
        if step == 0:
            handles.append(w.register_hook(once))
        y.sum().backward()
    assert calls == ["once"]
    assert torch.equal(w.grad, torch.tensor([10.0, 10.0]))
