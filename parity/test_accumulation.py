"""How AccumulateGrad puts a grad into ``.grad``: stolen or copied, added in place or not, its layout."""

from __future__ import annotations

import torch

STEPS = 3  # a capture, then cache hits when wrapped


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_a_leafs_post_hook_sees_the_tensor_that_became_its_grad() -> None:
    """AccumulateGrad stores the grad it receives as .grad (no copy), and its post hook's input is that tensor."""
    t = torch.ones(3, requires_grad=True)
    acc = t.view_as(t).grad_fn.next_functions[0][0]
    t.register_hook(lambda g: g.sub(2.0))
    acc.register_prehook(lambda go: (go[0].div(5.0),))
    t.register_post_accumulate_grad_hook(lambda p: (p.grad.add_(0.5), None)[1])
    acc.register_hook(lambda gi, go: setattr(t, "grad", go[0].mul(10)))
    (t * 1.0).sum().backward()
    assert torch.allclose(t.grad, torch.full((3,), 3.0))


def test_grads_from_two_paths_are_summed_before_accumulating() -> None:
    seen: list[list[float]] = []
    w = _leaf(1.0, 2.0)
    w.register_hook(lambda g: seen.append(g.tolist()))
    for _ in range(STEPS):
        (w * 2 + w.exp()).sum().backward()
    assert seen == [(2 + w.detach().exp()).tolist()] * STEPS
    torch.testing.assert_close(w.grad, STEPS * (2 + w.detach().exp()))


def test_a_leafs_grad_keeps_the_leafs_channels_last_strides() -> None:
    """The layout contract: .grad has the strides of its (dense) leaf, first grad and accumulated."""
    w = torch.linspace(-1, 1, 2 * 3 * 4 * 5).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last)
    w.requires_grad_()
    for step in range(STEPS):
        (w.contiguous() * 3.0).sum().backward()
        assert w.grad.stride() == w.stride()
        assert torch.equal(w.grad, torch.full_like(w, 3.0 * (step + 1)))


def test_a_grad_set_to_a_strided_view_is_accumulated_into() -> None:
    """A .grad the user set (a view into a flat buffer) receives the next grads in place."""
    buffer = torch.zeros(2, 6)
    w = _leaf(1.0, 2.0, 3.0)
    w.grad = buffer[1, ::2]
    for _ in range(STEPS):
        (w * w).sum().backward()
    assert w.grad.data_ptr() == buffer[1, ::2].data_ptr()
    assert buffer[1, ::2].tolist() == [2.0 * STEPS, 4.0 * STEPS, 6.0 * STEPS]
    assert buffer[1, 1::2].tolist() == [0.0, 0.0, 0.0]


def test_create_graph_accumulates_out_of_place_into_a_differentiable_grad() -> None:
    w = _leaf(1.0, 2.0)
    (w**3).sum().backward(create_graph=True)
    first = w.grad
    assert first.requires_grad
    (w**3).sum().backward(create_graph=True)
    assert w.grad is not first
    torch.testing.assert_close(w.grad, 6 * w.detach() ** 2)
    (g,) = torch.autograd.grad(w.grad.sum(), w)
    torch.testing.assert_close(g, 12 * w.detach())


def test_backward_inputs_accumulate_only_into_the_named_leaves() -> None:
    a, b = _leaf(1.0, 2.0), _leaf(3.0, 4.0)
    for _ in range(STEPS):
        (a * b).sum().backward(inputs=[a])
    assert b.grad is None
    assert torch.equal(a.grad, STEPS * b.detach())


def test_retain_grad_on_an_intermediate_accumulates_over_backwards() -> None:
    x = _leaf(1.0, 2.0)
    h = x * 3
    h.retain_grad()
    out = (h * h).sum()
    for _ in range(STEPS):
        out.backward(retain_graph=True)
    torch.testing.assert_close(h.grad, STEPS * 2 * h.detach())
    torch.testing.assert_close(x.grad, STEPS * 6 * h.detach())


def test_a_post_accumulate_hook_that_sets_grad_to_none() -> None:
    """An optimizer step in the hook with zero_grad(set_to_none): each backward starts without a grad."""
    w = _leaf(1.0, 2.0)
    seen: list[list[float]] = []

    def step(p: torch.Tensor) -> None:
        seen.append(p.grad.tolist())
        with torch.no_grad():
            p.sub_(0.25 * p.grad)
        p.grad = None

    w.register_post_accumulate_grad_hook(step)
    for _ in range(STEPS):
        (w * w).sum().backward()
    assert w.grad is None
    assert seen == [[2.0, 4.0], [1.0, 2.0], [0.5, 1.0]]


def test_sparse_grads_accumulate_as_sparse() -> None:
    emb = torch.nn.Embedding(6, 3, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(18.0).reshape(6, 3))
    for _ in range(STEPS):
        emb(torch.tensor([1, 4, 1])).sum().backward()
    assert emb.weight.grad.is_sparse
    expected = torch.zeros(6, 3)
    expected[1] = 2.0 * STEPS
    expected[4] = 1.0 * STEPS
    assert torch.equal(emb.weight.grad.to_dense(), expected)


def test_a_grad_accumulated_into_an_expanded_leaf_use() -> None:
    w = _leaf(1.0, 2.0, 3.0)
    for _ in range(STEPS):
        (w.expand(4, 3) * torch.arange(4.0).unsqueeze(1)).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 6.0 * STEPS))


def test_a_grad_view_into_a_buffer_with_a_post_accumulate_hook() -> None:
    """As above, with a post-accumulate-grad hook reading the buffer: eager adds into the view in place."""
    buffer = torch.zeros(2, 3)
    w = _leaf(1.0, 2.0, 3.0)
    w.grad = buffer[0]
    seen: list[list[float]] = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(buffer[0].tolist()))
    for _ in range(STEPS):
        (w * w).sum().backward()
    assert seen == [[2.0 * k, 4.0 * k, 6.0 * k] for k in range(1, STEPS + 1)]
    assert w.grad.data_ptr() == buffer.data_ptr()
