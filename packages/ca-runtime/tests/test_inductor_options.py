"""Inductor options set for backward graphs; see [Note: Inductor options for backward graphs]."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import ca_runtime
import pytest
import torch
from ca_runtime import _inductor_buffer_reuse
from ca_runtime._backward_inductor_options import BACKWARD_INDUCTOR_OPTIONS
from ca_runtime._inductor_buffer_reuse import keeps_peak
from ca_runtime._inductor_passes import MULTIPLY_OUT_ADD_ALPHA, UNFUSE_LATE_ADDMM
from ca_runtime._torch_interop import InductorReuseCandidate
from ca_testkit import compare
from ca_testkit.memory import backward_tensor_peak_bytes
from ca_testkit.scenarios import Decoder, make_mlp, mlp_step

aten = torch.ops.aten


def _recording_compiler(seen: list[dict[str, Any]]) -> Any:
    """torch.compile with a backend that records Inductor's config as the graph compiles."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append({name: getattr(torch._inductor.config, name) for name in BACKWARD_INDUCTOR_OPTIONS})
        return gm.forward

    return lambda gm: torch.compile(gm, backend=backend)


def test_a_backward_graph_compiles_with_the_options() -> None:
    model = make_mlp()
    seen: list[dict[str, Any]] = []
    result = compare(mlp_step(model), _recording_compiler(seen), tensors=model, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0
    assert seen == [BACKWARD_INDUCTOR_OPTIONS]
    # Only while the graph compiled, and unset again after it: the next
    # capture gets them too.
    assert torch._inductor.config.reorder_for_locality is True
    assert torch._inductor.config._is_default("reorder_for_locality")
    other = make_mlp(sizes=(8, 12, 4))
    compare(mlp_step(other), _recording_compiler(seen), tensors=other, steps=1).assert_ok()
    assert seen == [BACKWARD_INDUCTOR_OPTIONS, BACKWARD_INDUCTOR_OPTIONS]


def test_an_option_the_user_set_is_kept() -> None:
    model = make_mlp()
    seen: list[dict[str, Any]] = []
    # As `torch._inductor.config.reorder_for_locality = True` would, but
    # revertibly (config.patch leaves it set when it exits).
    revert = torch._inductor.config._make_closure_patcher(reorder_for_locality=True)()
    try:
        result = compare(mlp_step(model), _recording_compiler(seen), tensors=model, steps=2)
    finally:
        revert()
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 1
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0
    assert seen == [{**BACKWARD_INDUCTOR_OPTIONS, "reorder_for_locality": True}]


def _addmm_graph(late_input: bool, rows: int = 16) -> torch.fx.GraphModule:
    """addmm(c, a, b) with a, b graph inputs and c computed (late_input) or a graph input (a bias)."""
    graph = torch.fx.Graph()
    values = {"a": torch.randn(4, rows), "b": torch.randn(rows, 4), "c0": torch.randn(4, 4)}
    nodes = {name: graph.placeholder(name) for name in values}
    for name, node in nodes.items():
        node.meta["val"] = values[name]
    first = graph.call_function(aten.mul.Tensor, (nodes["c0"], 2.0))
    first.meta["val"] = values["c0"] * 2.0
    inp = graph.call_function(aten.sin.default, (first,)) if late_input else nodes["c0"]
    inp.meta["val"] = inp.meta.get("val", first.meta["val"].sin())
    out = graph.call_function(aten.addmm.default, (inp, nodes["a"], nodes["b"]))
    out.meta["val"] = torch.addmm(inp.meta["val"], values["a"], values["b"])
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_late_addmm_is_split_into_the_mm_first_and_the_add_where_it_was() -> None:
    """See [Note: An accumulated mm computed where its inputs are]."""
    gm = _addmm_graph(late_input=True)
    args = [torch.randn(4, 16), torch.randn(16, 4), torch.randn(4, 4)]
    expected = gm(*args)
    UNFUSE_LATE_ADDMM(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert _targets(gm) == [aten.mm.default, aten.mul.Tensor, aten.sin.default, aten.add.Tensor]
    torch.testing.assert_close(gm(*args), expected)


@pytest.mark.parametrize(("late_input", "rows"), [(False, 16), (True, 1)], ids=["bias", "small-matrices"])
def test_a_bias_addmm_or_one_of_small_matrices_is_kept(late_input: bool, rows: int) -> None:
    gm = _addmm_graph(late_input=late_input, rows=rows)
    before = _targets(gm)
    UNFUSE_LATE_ADDMM(gm.graph)
    assert _targets(gm) == before and aten.addmm.default in before


@pytest.mark.parametrize("mm_first", [False, True], ids=["add-of-an-mm", "mm-plus-scaled"])
def test_an_adds_alpha_beside_an_mm_is_multiplied_out(mm_first: bool) -> None:
    """See [Note: An add's alpha beside an mm]: the add keeps its arithmetic, with no alpha for Inductor to drop."""

    def f(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mm = aten.mm.default(a, b)
        return aten.add.Tensor(mm, w, alpha=-0.01) if mm_first else aten.add.Tensor(w, mm, alpha=-0.01)

    gm = torch.fx.symbolic_trace(f)
    args = [torch.randn(4, 3), torch.randn(4, 2), torch.randn(2, 3)]
    expected = gm(*args)
    MULTIPLY_OUT_ADD_ALPHA(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert _targets(gm) == [aten.mm.default, aten.mul.Tensor, aten.add.Tensor]
    assert all("alpha" not in n.kwargs for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*args), expected)
    # An add without alpha, or of no mm, is left as it is.
    plain = torch.fx.symbolic_trace(lambda w, a, b: aten.add.Tensor(w, aten.mm.default(a, b)))
    scaled = torch.fx.symbolic_trace(lambda w, a, b: aten.add.Tensor(w, a.sum() * b.sum(), alpha=2))
    for untouched in (plain, scaled):
        before = [(n.target, n.args, n.kwargs) for n in untouched.graph.nodes]
        MULTIPLY_OUT_ADD_ALPHA(untouched.graph)
        assert [(n.target, n.args, n.kwargs) for n in untouched.graph.nodes] == before


@pytest.mark.inductor
def test_an_sgd_step_with_alpha_in_a_post_accumulate_grad_hook_moves_the_weight_as_eager() -> None:
    """Found by trying issue 36's optimizer-in-backward: Inductor's add-of-an-mm pattern dropped the step's alpha,
    moving the weight by +grad instead of -lr * grad (see [Note: An add's alpha beside an mm]). The learning
    rate changes on the third step, where Dynamo recompiles during a hit: that compile dropped it too, until it
    got the backward options (see [Note: Compiles during a hit keep the backward options])."""
    torch.manual_seed(1)
    w1, w2, x = torch.randn(16, 32), torch.randn(32, 4), torch.randn(8, 16)
    lr = [0.01]

    def sgd(p: torch.Tensor) -> None:
        with torch.no_grad():
            p.add_(p.grad, alpha=-lr[0])
        p.grad = None

    params = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    for p in params:
        p.register_post_accumulate_grad_hook(sgd)

    def step(i: int) -> list[torch.Tensor]:
        lr[0] = 0.01 if i < 2 else 0.005
        (x @ params[0]).sigmoid().matmul(params[1]).pow(2).sum().backward()
        return [p.detach().clone() for p in params]

    result = compare(step, "inductor", steps=3, tensors=params, rtol=1e-5, atol=1e-5)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2, result.stats
    assert result.stats["eager_fallbacks"] == 0 and result.stats["uncompiled_runs"] == 0, result.stats


@pytest.mark.parametrize("graph_break", [False, True], ids=["whole", "behind_a_graph_break"])
def test_a_compile_during_a_hit_gets_the_options(graph_break: bool) -> None:
    """See [Note: Compiles during a hit keep the backward options]: a hook's closure float changes, Dynamo
    recompiles during the hit (the graph's frame, or behind a retain_grad graph break the frame that
    continues it), with the same options as the first compile; a hit that compiles nothing leaves
    Inductor's config as it was."""
    model = make_mlp()
    seen: list[dict[str, Any]] = []
    scale = [2.0]
    step = mlp_step(model)
    if graph_break:
        model[0].register_forward_hook(lambda module, args, out: out.retain_grad())

    def scaled_step(i: int) -> Any:
        scale[0] = 2.0 if i < 2 else 3.0
        handle = model[0].weight.register_hook(lambda grad: grad * scale[0])
        try:
            return step(i)
        finally:
            handle.remove()

    result = compare(scaled_step, _recording_compiler(seen), tensors=model, steps=4)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 3, result.stats
    assert result.stats["eager_fallbacks"] == 0 and result.stats["uncompiled_runs"] == 0, result.stats
    assert result.stats["graph_breaks"] == (1 if graph_break else 0), result.stats
    first_run = 2 if graph_break else 1  # the graph's frame, and the one after the graph break
    assert len(seen) > first_run and all(options == BACKWARD_INDUCTOR_OPTIONS for options in seen), seen
    assert torch._inductor.config.reorder_for_locality is True
    assert torch._inductor.config._is_default("reorder_for_locality")


def _zeroed_forward_and_step(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[Any, Any]:
    """``forward()`` (grads set to None, then the loss) and ``step()`` (forward and backward) of ``model`` on ``tokens``."""

    def forward() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return model(tokens)

    def step() -> torch.Tensor:
        loss = forward()
        loss.backward()
        return loss

    return forward, step


class _TiedHead(torch.nn.Module):
    """An embedding tied to the output head, as a GPT's: the weight's two grads are summed at the end."""

    def __init__(self, vocab: int = 256, d: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Linear(d, 8 * d)
        self.down = torch.nn.Linear(8 * d, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = x + self.down(torch.relu(self.up(x)))
        logits = h @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@pytest.mark.inductor
def test_a_tied_heads_backward_with_inductor_frees_the_logits_grad_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's addmm fusion held the logits' grad to the end; see the Notes of BACKWARD_INDUCTOR_OPTIONS.

    Eager's grads with the options; then the peak of live tensor bytes with
    and without them: with, at most eager's (+10 %) and at least the logits'
    grad (8 x 64 x 256 floats, 512 KiB) below the peak without.
    """
    torch.manual_seed(0)
    model = _TiedHead()
    tokens = torch.randint(0, 256, (8, 64))
    forward, step = _zeroed_forward_and_step(model, tokens)

    compiler = lambda gm: torch.compile(gm, backend="inductor")
    result = compare(step, compiler, tensors=model, steps=3, rtol=1e-4, atol=1e-5)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0

    def ours_peak() -> int:
        ca_runtime.reset()
        torch._dynamo.reset()
        with ca_runtime.enable(compiler, eager_if_faster=False, capture_after=1):
            for _ in range(2):
                forward().backward()
            peak, _ = backward_tensor_peak_bytes(forward)
            stats = ca_runtime.stats()
        assert stats["captures"] == 1 and stats["cache_hits"] == 2 and stats["eager_fallbacks"] == 0, stats
        return peak

    with ca_runtime.disable():
        eager, _ = backward_tensor_peak_bytes(forward)
    with_options = ours_peak()
    monkeypatch.setattr(
        ca_runtime._backward_inductor_options, "BACKWARD_INDUCTOR_OPTIONS", {"reorder_for_locality": False}
    )
    without = ours_peak()
    logits_grad = 8 * 64 * 256 * 4
    assert with_options <= eager * 1.1 and with_options <= without - logits_grad, (
        with_options,
        without,
        eager,
    )


def _counts_on_hits(result: Any, per_backward: list[int]) -> list[int]:
    """The counts of a 3-step compare's two hits, after checking it was one capture and two hits, eager's grads."""
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0
    return per_backward[4:]  # eager's three backwards, the capture, then the two hits


def _counted_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """A list that gets an item per call of ``torch._C._dynamo.guards.<name>``, which Inductor's code calls.

    Inductor's code binds the function when its module loads, after this.
    """
    calls: list[int] = []
    function = getattr(torch._C._dynamo.guards, name)

    def counting(*args: Any) -> Any:
        calls.append(1)
        return function(*args)

    monkeypatch.setattr(torch._C._dynamo.guards, name, counting)
    return calls


@pytest.mark.inductor
@pytest.mark.parametrize("user_set", [None, True], ids=["ours", "user-set-true"])
def test_a_hit_runs_no_size_asserts_of_its_inputs(
    monkeypatch: pytest.MonkeyPatch, user_set: bool | None
) -> None:
    """size_asserts off: Inductor's code does not re-check each input's sizes and strides on a hit.

    Dynamo's guards checked them before the call; see [Note: Inductor options
    for backward graphs]. A size_asserts the user set is kept.
    """
    calls = _counted_calls(monkeypatch, "assert_size_stride")
    cell = torch.nn.RNNCell(4, 6)
    xs = torch.randn(3, 2, 4)
    per_backward: list[int] = []

    def step(i: int) -> torch.Tensor:
        cell.zero_grad(set_to_none=True)  # the same graph every step: accumulating into .grad is another
        h = torch.zeros(2, 6)
        for x in xs:
            h = cell(x, h)
        calls.clear()
        h.square().sum().backward()
        per_backward.append(len(calls))
        return h.detach()

    revert = torch._inductor.config._make_closure_patcher(
        fx_graph_cache=False, **({} if user_set is None else {"size_asserts": user_set})
    )()
    try:
        result = compare(step, "inductor", tensors=cell, steps=3)
    finally:
        revert()
    hits = _counts_on_hits(result, per_backward)
    inputs = 2 + 3 * 2  # at least: the two weights and two saved tensors per step
    assert hits == [0, 0] if user_set is None else all(n >= inputs for n in hits), per_backward


class _Plan:
    """Stands for one graph's memory plan (keeps_peak caches per plan)."""


def _reuse(
    levels: list[int],
    inputs: list[tuple[int, int]],
    freed_after: int,
    allocated_at: int,
    size: int,
    plan: _Plan | None = None,
) -> InductorReuseCandidate:
    """A reuse over Inductor's estimated ``levels`` per node, with ``inputs`` as (last reader, bytes)."""
    return InductorReuseCandidate(
        freed_after=freed_after,
        allocated_at=allocated_at,
        size=size,
        estimated_level=lambda first, last: max(levels[first : last + 1]),
        input_bytes_freed_by=lambda node: sum(nbytes for reader, nbytes in inputs if reader <= node),
        plan=plan if plan is not None else _Plan(),  # a plan of its own: nothing cached between them
    )


def _inductors_own_check(levels: list[int], freed_after: int, allocated_at: int, size: int) -> bool:
    """Inductor's check (AllocateLine.should_reuse_buffer): the range's estimated peak plus the buffer, within the graph's."""
    return size + max(levels[freed_after + 1 : allocated_at]) <= max(levels)


def test_keeps_peak_reuses_a_buffer_freed_by_the_node_before() -> None:
    """No node holds the dead buffer longer: as Inductor's own check; see [Note: Buffer reuse that keeps the peak]."""
    assert keeps_peak(_reuse([10, 50], [], freed_after=0, allocated_at=1, size=40))


def test_keeps_peak_reuses_within_a_level_the_graphs_own_buffers_reached_before() -> None:
    # Node 0 reached 12 (its own buffers); the buffer (2 bytes) dies after node 1 and is held through node 2 (5).
    assert keeps_peak(_reuse([12, 6, 5, 7], [], freed_after=1, allocated_at=3, size=2))
    # A range that would go above: 2 + 11 > 12.
    assert not keeps_peak(_reuse([12, 6, 11, 7], [], freed_after=1, allocated_at=3, size=2))


def test_keeps_peak_counts_an_input_the_estimate_frees_as_held() -> None:
    """The estimate's room from an input freed after its last reader is not the graph's to use.

    Node 0 reads an 8-byte input (a parameter, which the model keeps) and
    last reads a 2-byte buffer; node 1 allocates 6 bytes. Inductor's estimate
    (8 + 2 at node 0, 6 after) lets the 2 bytes be held through nodes 1-2;
    with the parameter held, the real level there is 14, and 16 with the
    reuse: above every level the backward had.
    """
    levels = [10, 6, 6, 2]
    assert _inductors_own_check(levels, freed_after=0, allocated_at=3, size=2)
    assert not keeps_peak(_reuse(levels, [(0, 8)], freed_after=0, allocated_at=3, size=2))
    # The same levels with no input: the graph's own buffers reached 10 before, 2 + 6 stays under it.
    assert keeps_peak(_reuse(levels, [], freed_after=0, allocated_at=3, size=2))


def _unrolled(cell: torch.nn.LSTMCell, xs: torch.Tensor) -> torch.Tensor:
    """The last hidden state of ``cell`` run over the steps of ``xs`` (steps x batch x features) from zeros."""
    h = c = torch.zeros(xs.shape[1], cell.hidden_size)
    for x in xs:
        h, c = cell(x, (h, c))
    return h


def _allocations_per_hit(monkeypatch: pytest.MonkeyPatch, **options: Any) -> int:
    """Buffers Inductor's code allocates on each hit of an unrolled LSTMCell's backward, with eager's grads."""
    calls = _counted_calls(monkeypatch, "_empty_strided_cpu")
    torch.manual_seed(0)
    cell = torch.nn.LSTMCell(4, 8)
    # Steps enough for a grad's buffers to die and come back in a range
    # below earlier levels (with 6 or 12 steps, none is).
    xs = torch.randn(16, 4, 4)
    per_backward: list[int] = []

    def step(i: int) -> torch.Tensor:
        cell.zero_grad(set_to_none=True)
        h = _unrolled(cell, xs)
        calls.clear()
        h.square().sum().backward()
        per_backward.append(len(calls))
        return h.detach()

    # No cache: the two configurations share its keys.
    revert = torch._inductor.config._make_closure_patcher(fx_graph_cache=False, **options)()
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            result = compare(step, "inductor", tensors=cell, steps=3, rtol=1e-5, atol=1e-6)
    finally:
        revert()
    hits = _counts_on_hits(result, per_backward)
    assert len(hits) == 2 and hits[0] == hits[1] > 0, per_backward
    return hits[0]


def test_keeps_peak_reads_each_nodes_level_once_per_plan() -> None:
    """The running maximum up to the free is kept per plan: a graph of n nodes costs n reads, not n per reuse."""
    levels = [12, 6, 5, 7, 3, 4, 2, 9]
    read: list[int] = []
    plan = _Plan()

    def candidate(freed_after: int, allocated_at: int) -> InductorReuseCandidate:
        base = _reuse(levels, [], freed_after, allocated_at, size=1, plan=plan)

        def level(first: int, last: int) -> int:
            if first == last:
                read.append(first)
            return base.estimated_level(first, last)

        return dataclasses.replace(base, estimated_level=level)

    assert keeps_peak(candidate(1, 4)) and keeps_peak(candidate(3, 6)) and keeps_peak(candidate(2, 7))
    assert sorted(read) == [0, 1, 2, 3] and len(read) == 4


@pytest.mark.inductor
def test_a_hit_allocates_fewer_buffers_with_reuse_that_keeps_the_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """allow_buffer_reuse on with our rule: fewer allocations per hit than with it off (which a user may set).

    Some of them held across nodes, which our rule (keeps_peak) allowed;
    Inductor reuses a buffer freed by the node just before without asking it.
    """
    allowed_across: list[int] = []

    def recording_keeps_peak(candidate: InductorReuseCandidate) -> bool:
        keeps = keeps_peak(candidate)
        if keeps and candidate.allocated_at > candidate.freed_after + 1:
            allowed_across.append(candidate.allocated_at - candidate.freed_after)
        return keeps

    monkeypatch.setattr(_inductor_buffer_reuse, "keeps_peak", recording_keeps_peak)
    ours = _allocations_per_hit(monkeypatch)
    assert allowed_across, "keeps_peak allowed no reuse across nodes"
    ca_runtime.reset()
    torch._dynamo.reset()
    without = _allocations_per_hit(monkeypatch, allow_buffer_reuse=False)
    assert ours < without, (ours, without)


@pytest.mark.inductor
def test_a_decoders_peak_stays_at_eagers_with_our_reuse_and_not_with_inductors_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's own reuse check raises this backward's peak of live tensor bytes above eager's; ours does not.

    See [Note: Buffer reuse that keeps the peak]: Inductor's estimate frees
    the parameters the nodes read, so its later levels look lower than they are.
    """
    torch.manual_seed(0)
    model = Decoder(vocab=256, d=64, heads=2, layers=2, seq=32)
    tokens = torch.randint(0, 256, (2, 32))
    forward, step = _zeroed_forward_and_step(model, tokens)

    def peak() -> int:
        ca_runtime.reset()
        torch._dynamo.reset()
        compiler = lambda gm: torch.compile(gm, backend="inductor")
        result = compare(step, compiler, tensors=model, steps=2, rtol=1e-4, atol=1e-5)
        result.assert_ok()
        assert result.stats["captures"] == 1 and result.stats["cache_hits"] >= 1, result.stats
        assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0, result.stats
        hits = ca_runtime.stats()["cache_hits"]
        with ca_runtime.enable(compiler, capture_after=1):
            found, _ = backward_tensor_peak_bytes(forward)
        assert ca_runtime.stats()["cache_hits"] == hits + 1, ca_runtime.stats()
        return found

    with ca_runtime.disable():
        eager, _ = backward_tensor_peak_bytes(forward)
    # No cache: the two reuse rules share its keys.
    revert = torch._inductor.config._make_closure_patcher(fx_graph_cache=False)()
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            ours = peak()
            monkeypatch.setattr(
                ca_runtime._backward_inductor_options,
                "peak_keeping_reuse",
                lambda applies: contextlib.nullcontext(),
            )
            inductors = peak()
    finally:
        revert()
    assert ours <= eager < inductors, (ours, eager, inductors)


def _kernels_per_hit(**options: Any) -> tuple[int, Any]:
    """Inductor kernels one hit of an LSTMCell's backward (48 steps) runs, and the compare result of its steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    cell, head = torch.nn.LSTMCell(8, 64), torch.nn.Linear(64, 1)
    xs, target = torch.randn(48, 16, 8), torch.randn(16, 1)
    params = torch.nn.ModuleList([cell, head])
    kernels: list[int] = []

    def step(i: int) -> torch.Tensor:
        params.zero_grad(set_to_none=True)
        h = _unrolled(cell, xs)
        loss = torch.nn.functional.mse_loss(head(h), target)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss.backward()
        kernels.append(sum(1 for e in prof.events() if "cpp_fused" in e.name))
        return loss.detach()

    # Each kernel in a profiler range of its own (cpp.enable_kernel_profile); no cache: configurations share keys.
    revert = torch._inductor.config._make_closure_patcher(
        fx_graph_cache=False, **{"cpp.enable_kernel_profile": True}, **options
    )()
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            result = compare(step, "inductor", tensors=params, steps=2, rtol=1e-4, atol=1e-6)
    finally:
        revert()
    return kernels[-1], result


@pytest.mark.inductor
def test_an_unrolled_cells_per_step_grad_sums_run_in_one_kernel() -> None:
    """max_fusion_size 512: the 48 steps' bias-grad sums fuse into one kernel at the end, as torch.compile's backward has.

    See [Note: Inductor options for backward graphs]: with Inductor's 64, 19
    of them ran as kernels of their own (69 kernels a hit against 49).
    """
    ours, result = _kernels_per_hit()
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] >= 1, result.stats
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0, result.stats
    ca_runtime.reset()
    torch._dynamo.reset()
    inductors_default, _ = _kernels_per_hit(max_fusion_size=64)
    assert ours < inductors_default, (ours, inductors_default)
