"""Custom autograd Functions, saved-tensor hooks and checkpoint, against eager."""

from __future__ import annotations

import functools
import gc
import warnings
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import ca_runtime
import pytest
import torch
import torch.utils.checkpoint
from ca_testkit import compare

pytestmark = pytest.mark.filterwarnings("ignore::ca_runtime.GraphBreakWarning")

_calls: list[str] = []


class ScaledMul(torch.autograd.Function):
    """x * w * scale with saved tensors, a float and a str on ctx."""

    @staticmethod
    def forward(ctx, x, w, scale: float, tag: str):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        ctx.tag = tag
        return x * w * scale

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        _calls.append(f"{ctx.tag} needs={ctx.needs_input_grad}")
        grad_x = grad * w * ctx.scale if ctx.needs_input_grad[0] else None
        grad_w = grad * x * ctx.scale if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


class OnceDifferentiableSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class TwoOutputs(torch.autograd.Function):
    """Two outputs, only one used: the other's grad is materialised as zeros."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, grad_a, grad_b):  # type: ignore[override]
        _calls.append(f"zeros={bool((grad_b == 0).all())}")
        return grad_a * 2 + grad_b * 3


class WritesCtxInBackward(torch.autograd.Function):
    """A backward that leaves a flag, a Python int and a tensor on its ctx."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        ctx.backward_ran = True
        ctx.rows = grad.shape[0]
        ctx.grad_seen = grad * x
        return grad * 2


def _leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen).requires_grad_() for s in shapes]


def test_python_function_with_ctx_attributes(backend: str) -> None:
    x, w = _leaves((4,), (4,))

    def step(i: int) -> list[str]:
        _calls.clear()
        ScaledMul.apply(x, w, 1.5, "tag").pow(2).sum().backward()
        return list(_calls)

    result = compare(step, backend, tensors=[x, w], steps=3)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0


class CubeByVjp(torch.autograd.Function):
    """Defines ``vjp``, the documented alias of ``backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def vjp(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class BackwardAndVjp(CubeByVjp):
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _one_function_step(function: type[torch.autograd.Function]) -> tuple[Callable[[int], Any], torch.Tensor]:
    """A step applying ``function`` to a scaled leaf; it returns the leaf's grad."""
    (x,) = _leaves((4,))

    def step(i: int) -> torch.Tensor:
        x.grad = None
        function.apply(x * 1.5).sum().backward()
        return x.grad

    return step, x


def test_a_function_defining_vjp_is_captured(backend: str) -> None:
    step, x = _one_function_step(CubeByVjp)
    with pytest.warns(ca_runtime.GraphBreakWarning, match="defining vjp"):
        result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    # Run by the real node behind one graph break: eager's choice of vjp.
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 1


def test_a_function_defining_backward_and_vjp_raises_eagers_error(backend: str) -> None:
    (x,) = _leaves((4,))

    def step(i: int) -> str:
        x.grad = None
        try:
            BackwardAndVjp.apply(x * 1.5).sum().backward()
        except RuntimeError as e:
            return str(e)
        return "no error"

    result = compare(step, backend, tensors=[x], steps=2, expect_capture=False)
    result.assert_ok()  # the same message on both steps
    with ca_runtime.disable():
        assert step(0).startswith("Implementing both 'backward' and 'vjp'")
    assert result.stats["eager_fallbacks"] == 0


class ChecksItsNode(torch.autograd.Function):
    """A backward that inspects its ctx as libraries do."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        scale = (
            3.0
            if isinstance(ctx, torch.autograd.graph.Node) and ctx.name() == "ChecksItsNodeBackward"
            else 1.0
        )
        return grad * scale


def test_a_functions_ctx_is_a_node_in_the_graph(backend: str) -> None:
    """See [Note: The ctx a backward sees is a Node] in _torch_interop.py."""
    step, x = _one_function_step(ChecksItsNode)
    result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0


_ctx_table: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


class DeletesWhatForwardSet(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.scale = 3.0
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        scale = ctx.scale
        del ctx.scale
        return grad * scale * (1.0 if hasattr(ctx, "scale") else 2.0)


class KeyedByItsCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        _ctx_table[ctx] = 4.0
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * _ctx_table[ctx]


@pytest.mark.parametrize("function", [DeletesWhatForwardSet, KeyedByItsCtx], ids=["del", "weak_key"])
def test_a_backward_uses_its_ctx_as_the_real_one(
    function: type[torch.autograd.Function], backend: str
) -> None:
    """See [Note: The ctx a backward sees is the real one to the user]: ``del ctx.attr``, the ctx as a dict key."""
    step, x = _one_function_step(function)
    result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0


class WritesThenRaises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.seen = grad.sum()
        raise ValueError("a user's error in backward")


def test_what_a_raising_backward_wrote_on_its_ctx_stays(backend: str) -> None:
    """The user's error propagates; attributes set before it stay on the grad_fn, as in eager."""
    (x,) = _leaves((3,))

    def step(i: int) -> tuple[str, object]:
        y = WritesThenRaises.apply(x * 1.5)
        with pytest.raises(ValueError, match="a user's error") as raised:
            y.sum().backward()
        return str(raised.value), y.grad_fn.seen

    result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0


def test_ctx_attributes_set_in_backward_stay_on_the_grad_fn(backend: str) -> None:
    """See [Note: ctx writes in a backward]; fresh grad_fns on hits too."""
    (x,) = _leaves((3,))

    def step(i: int) -> tuple[object, object, torch.Tensor]:
        x.grad = None
        y = WritesCtxInBackward.apply(x * 1.5)
        (y * y).sum().backward()
        return y.grad_fn.backward_ran, y.grad_fn.rows, y.grad_fn.grad_seen

    result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0


def test_ctx_dies_with_its_output_after_a_capturing_backward(backend: str) -> None:
    """See [Note: Dynamo's tracing cycles]: no gc.collect() needed, as in eager."""
    (x,) = _leaves((3,))
    frozen_before = gc.get_freeze_count()

    def step(i: int) -> tuple[bool, bool]:
        x.grad = None
        y = WritesCtxInBackward.apply(x * 1.5)
        ctx, payload = weakref.ref(y.grad_fn), weakref.ref(y.grad_fn.saved_tensors[0])
        (y * y).sum().backward()
        del y
        return ctx() is None, payload() is None

    result = compare(step, backend, tensors=[x], steps=2)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 1
    assert gc.get_freeze_count() == frozen_before


_LOG_KEPT_ACROSS_STEPS: list[int] = []


class _AppendsToAGlobalLog(torch.autograd.Function):
    """Its backward appends to a list kept across steps: Dynamo guards the list's length and recompiles each hit."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, payload: object) -> torch.Tensor:
        ctx.payload = payload
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _LOG_KEPT_ACROSS_STEPS.append(1)
        return grad * 2, None


class _Payload:
    pass


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_ctx_dies_with_its_output_after_a_hit_that_dynamo_recompiles(backend: str) -> None:
    """See [Note: Dynamo's tracing cycles]: a recompile on a hit keeps no ctx alive either."""
    (x,) = _leaves((3,))
    _LOG_KEPT_ACROSS_STEPS.clear()

    def step(i: int) -> bool:
        x.grad = None
        payload = _Payload()
        alive = weakref.ref(payload)
        y = _AppendsToAGlobalLog.apply(x * 1.5, payload)
        del payload
        y.sum().backward()
        del y
        return alive() is None

    frozen_before = gc.get_freeze_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's recompile warnings
        result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert gc.get_freeze_count() == frozen_before
    assert len(_LOG_KEPT_ACROSS_STEPS) == 6  # each backward ran it, eagerly and compiled


def test_python_function_float_changes_between_steps(backend: str) -> None:
    x, w = _leaves((4,), (4,))

    def step(i: int) -> list[str]:
        _calls.clear()
        ScaledMul.apply(x, w, 0.5 + i, f"step{i % 2}").sum().backward()
        return list(_calls)

    compare(step, backend, tensors=[x, w], steps=4).assert_ok()


def test_python_function_needs_input_grad(backend: str) -> None:
    x, w = _leaves((4,), (4,))
    frozen = w.detach()

    def step() -> list[str]:
        _calls.clear()
        ScaledMul.apply(x, frozen, 2.0, "frozen").sum().backward()
        return list(_calls)

    compare(step, backend, tensors=[x], steps=2).assert_ok()


def test_once_differentiable_and_materialized_grads(backend: str) -> None:
    (x,) = _leaves((3, 2))

    def step() -> list[str]:
        _calls.clear()
        a, _unused = TwoOutputs.apply(OnceDifferentiableSquare.apply(x))
        a.sum().backward()
        return list(_calls)

    result = compare(step, backend, tensors=[x], steps=2)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0


class _WithANonTensorOutput(torch.autograd.Function):
    """Returns a tensor and the non-tensor it was given; its backward records the grad it gets for each."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tag: object) -> tuple[torch.Tensor, object]:
        return x * 2, tag

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_of_tag: Any) -> tuple[torch.Tensor, None]:
        _calls.append(f"grads {type(grad).__name__} {grad_of_tag!r}")
        return grad * 2, None


def test_a_non_tensor_outputs_grad_is_none(backend: str) -> None:
    """Eager's zeros for an undefined grad are none for a non-tensor output (its VariableInfo is empty)."""
    (x,) = _leaves((3,))

    def step() -> list[str]:
        _calls.clear()
        y, _tag = _WithANonTensorOutput.apply(x * 1.0, "a tag")
        y.sum().backward()
        return list(_calls)

    result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()  # "grads Tensor None" each step, not a zero tensor for the tag
    # x.grad None, then defined: two keys.
    assert result.stats["captures"] == 2 and result.stats["cache_hits"] == 1


@pytest.mark.inductor
def test_python_function_inductor() -> None:
    x, w = _leaves((4,), (4,))

    def step(i: int) -> list[str]:
        _calls.clear()
        ScaledMul.apply(x, w, 0.5 + i, "ind").sum().backward()
        return list(_calls)

    compare(step, "inductor", tensors=[x, w], steps=2).assert_ok()


@pytest.mark.parametrize("traceable", [True, False], ids=["traceable", "untraceable"])
@pytest.mark.parametrize("expanded", [False, True], ids=["dense", "expanded"])
def test_cpp_function(backend: str, cpp_ext: ModuleType, traceable: bool, expanded: bool) -> None:
    x, w = _leaves((3, 4), (4,))

    def step(i: int) -> torch.Tensor:
        weight = w.expand(3, 4) if expanded else w * 1.0
        out = cpp_ext.scaled_mul(x, weight, 0.5 + i, traceable)
        (out.sum() if expanded else out.pow(2).sum()).backward()
        return out.detach()

    result = compare(step, backend, tensors=[x, w], steps=3)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert (result.stats["graph_breaks"] > 0) == (not traceable)


_WITH_INDUCTOR = ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)]


@pytest.mark.parametrize("backend", _WITH_INDUCTOR)
def test_r2_untraceable_cpp_function_writes_through_data_ptr(backend: str, cpp_ext: ModuleType) -> None:
    """An untraceable C++ Function: a graph break runs its backward on the real grad."""
    x = torch.ones(2, 2, requires_grad=True)

    def step() -> None:
        cpp_ext.writes_through_data_ptr(x).sum().backward()

    result = compare(step, backend, tensors=[x])
    result.assert_ok()
    torch.testing.assert_close(x.grad, torch.full((2, 2), 3.14))
    assert result.stats["graph_breaks"] == 1
    assert result.stats["eager_fallbacks"] == 0


@pytest.mark.parametrize("backend", _WITH_INDUCTOR)
def test_r2_no_guessed_metadata(backend: str, cpp_ext: ModuleType) -> None:
    """A layout-dependent C++ Function sees the real, non-contiguous grad."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    seen: list[bool] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(grad.is_contiguous())
        return grad.contiguous()

    def step() -> list[bool]:
        seen.clear()
        z = cpp_ext.branches_on_contiguity(x).clone()
        z.register_hook(hook)
        z.sum().backward()
        return list(seen)

    result = compare(step, backend, tensors=[x])
    result.assert_ok()
    torch.testing.assert_close(x.grad, torch.full((2, 3), 2.0))
    assert seen == [False]
    assert result.stats["graph_breaks"] == 0


def test_saved_tensor_hooks_fire_as_in_eager(backend: str) -> None:
    x, w = _leaves((4, 4), (4, 4))
    counts = {"pack": 0, "unpack": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts["pack"] += 1
        return t * 1

    def unpack(t: torch.Tensor) -> torch.Tensor:
        counts["unpack"] += 1
        return t

    def step() -> dict[str, int]:
        counts.update(pack=0, unpack=0)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x @ w).tanh() * x
        y.sum().backward()
        return dict(counts)

    result = compare(step, backend, tensors=[x, w], steps=3)
    result.assert_ok()
    # Traced into the graph: see [Note: Unpack hooks in the graph].
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0


class _Offload:
    """CPU-offload style hooks as a callable object holding state: pack to float64, unpack back."""

    def __init__(self) -> None:
        self.unpacked = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64)

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        self.unpacked += 1
        return packed.to(torch.float32)


def test_offload_hooks_in_an_mlp_are_traced(backend: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))
    x = torch.randn(5, 6)
    offload = _Offload()

    def step() -> int:
        offload.unpacked = 0
        with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload):
            loss = model(x).pow(2).sum()
        loss.backward()
        return offload.unpacked

    result = compare(step, backend, tensors=model, steps=3)
    result.assert_ok()
    assert result.stats["captures"] >= 1
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0


def test_unpack_hook_dynamo_skips_breaks_at_its_node_only(backend: str) -> None:
    """A hook Dynamo would not inline (a torch.utils function) runs behind one break per node."""
    x, w = _leaves((3, 3), (3, 3))

    def step() -> None:
        # default_convert returns a tensor unchanged; torch.utils is on Dynamo's skip list.
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, torch.utils.data.default_convert):
            y = (x * w).sin()
        y.sum().backward()

    result = compare(step, backend, tensors=[x, w], steps=2)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    # MulBackward0 and SinBackward0, per captured graph.
    assert result.stats["graph_breaks"] == 2 * result.stats["captures"]


#: Pack hooks: the tensor itself, a new tensor (no autograd metadata: eager's
#: unpack gives the result the saved tensor's grad_fn or grad accumulator
#: back), and a detached copy as offloading hooks make.
_PACKS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda t: t,
    "times_one": lambda t: t * 1,
    "detached_copy": lambda t: t.detach().clone(),
}


@pytest.mark.parametrize("pack", list(_PACKS))
def test_unpack_hooks_under_create_graph_run_with_their_node(backend: str, pack: str) -> None:
    """A double backward differentiates through what the unpack hooks give, as eager's does."""
    (x,) = _leaves((4,))
    unpacks: list[int] = []

    def step() -> tuple[torch.Tensor, int]:
        x.grad = None
        unpacks.clear()
        with torch.autograd.graph.saved_tensors_hooks(_PACKS[pack], lambda t: unpacks.append(1) or t):
            y = (x * x * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward()
        return g.detach(), len(unpacks)

    result = compare(step, backend, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["captures"] == 2 and result.stats["cache_hits"] == 4, result.stats
    assert result.stats["graph_breaks"] >= 1


def _checkpointed_step(use_reentrant: bool) -> tuple[object, list[torch.Tensor]]:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    (x,) = _leaves((3, 4))

    def step() -> None:
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)
        out.pow(2).sum().backward()

    return step, [x, *block.parameters()]


def test_non_reentrant_checkpoint(backend: str) -> None:
    step, tensors = _checkpointed_step(use_reentrant=False)
    result = compare(step, backend, tensors=tensors, steps=3)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    # The region recomputed in the graph by one opaque op, its nodes traced.
    assert result.stats["graph_breaks"] == 0


def _checkpointed_blocks(block: str) -> tuple[torch.nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)
    if block == "mlp":
        blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
            for _ in range(3)
        )
        x = torch.randn(4, 8)
    else:
        blocks = torch.nn.ModuleList(
            [torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)]
        )
        x = torch.randn(2, 5, 16)
    return blocks, x


@pytest.mark.parametrize("block", ["mlp", "transformer"])
def test_non_reentrant_checkpoint_regions_compile_without_breaks(backend: str, block: str) -> None:
    blocks, x = _checkpointed_blocks(block)

    def step() -> None:
        h = x
        for b in blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
        h.pow(2).mean().backward()

    result = compare(step, backend, tensors=blocks, steps=3, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["captures"] <= 2  # the second: .grad became defined
    assert result.stats["graph_breaks"] == 0


@pytest.mark.inductor
def test_non_reentrant_checkpoint_regions_compile_with_inductor_without_breaks() -> None:
    """Inductor may reuse a dead buffer's memory: the op's outputs never alias a parameter or each other."""
    blocks, x = _checkpointed_blocks("mlp")
    mask = (torch.randn(4, 8) > 0).float()  # saved as it is by the region, as a module buffer would be
    untouched = [*(p.detach() for p in blocks.parameters()), x, mask]
    before = [t.clone() for t in untouched]

    def step() -> None:
        h = x
        for b in blocks:
            h = torch.utils.checkpoint.checkpoint(lambda t, b=b: b(t) * mask, h, use_reentrant=False)
        h.pow(2).mean().backward()

    result = compare(step, "inductor", tensors=blocks, steps=3, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0
    for was, now in zip(before, untouched):
        torch.testing.assert_close(now, was, rtol=0, atol=0)


class FusedGelu(torch.autograd.Function):
    """A hand-written op, as fused kernels and attention implementations are: saves its input and output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(x)
        ctx.save_for_backward(x, y)
        ctx.scale = 1.0
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x, _output = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
        pdf = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
        return ctx.scale * grad * (cdf + x * pdf)


@pytest.mark.parametrize("regions", [1, 3])
def test_a_custom_function_inside_a_checkpointed_region(backend: str, regions: int) -> None:
    """Its saved tensors carry checkpoint's unpack hooks; it runs behind a graph break, each unpack once.

    See [Note: Hooks taken up front] in _capture.py: before, Dynamo read the
    ctx's saved_tensors at the graph break and checkpoint raised
    CheckpointError ("already unpacked once").
    """
    blocks, x = _checkpointed_blocks("mlp")
    blocks = blocks[:regions]

    def block(b: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return b[2](FusedGelu.apply(b[0](h)))

    def step() -> None:
        h = x
        for b in blocks:
            h = torch.utils.checkpoint.checkpoint(functools.partial(block, b), h, use_reentrant=False)
        h.pow(2).mean().backward()

    with pytest.warns(ca_runtime.GraphBreakWarning, match="FusedGeluBackward"):
        result = compare(step, backend, tensors=blocks, steps=3, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["cache_hits"] >= 1
    assert result.stats["graph_breaks"] == regions * result.stats["captures"]


def test_non_reentrant_checkpoint_without_metadata_breaks_once_per_region(backend: str) -> None:
    """determinism_check="none" records no shapes for the opaque op: one break per region, as before."""
    blocks, x = _checkpointed_blocks("mlp")

    def step() -> None:
        h = x
        for b in blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False, determinism_check="none")
        h.pow(2).mean().backward()

    result = compare(step, backend, tensors=blocks, steps=3, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == len(blocks) * result.stats["captures"]


def test_a_region_without_records_on_a_hit_of_a_graph_captured_with_them(backend: str) -> None:
    """[Note: A region without records on a hit]: the same graph shape, determinism_check alternating.

    The first backward captures the regions into the recompute op; the
    "none" steps hit that graph with regions that record no shapes. Before,
    their hit failed inside Dynamo's re-trace with a TypeError.
    """
    blocks, x = _checkpointed_blocks("mlp")

    def step(i: int) -> None:
        check = ("default", "none")[i % 2]
        blocks.zero_grad(set_to_none=True)  # one key for every step
        h = x
        for b in blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False, determinism_check=check)
        h.pow(2).mean().backward()

    result = compare(step, backend, tensors=blocks, steps=4, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0  # ca's; Dynamo breaks inside the re-traced graph
    assert result.stats["captures"] == 1
    assert result.stats["cache_hits"] == 3


def test_non_reentrant_checkpoint_with_a_new_batch_size_recompiles(backend: str) -> None:
    """The graph is guarded on the shapes the region recorded: a new batch size gives eager's grads."""
    blocks, _ = _checkpointed_blocks("mlp")
    inputs = [torch.randn(4, 8), torch.randn(6, 8), torch.randn(4, 8), torch.randn(9, 8)]
    calls = iter(range(100))

    def step() -> None:
        h = inputs[next(calls) % len(inputs)]
        for b in blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
        h.pow(2).mean().backward()

    result = compare(step, backend, tensors=blocks, steps=len(inputs), atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0
    assert result.stats["captures"] >= 1


def test_an_error_in_a_checkpoint_recompute_is_eagers(backend: str) -> None:
    """The region's forward raising in the in-graph recompute raises eager's error, on a capture and on a hit."""
    blocks, x = _checkpointed_blocks("mlp")
    failing = {"now": False}

    def region(h: torch.Tensor) -> torch.Tensor:
        if failing["now"] and torch._C._current_graph_task_id() != -1:
            raise ValueError("recompute failed")
        return blocks[0](h)

    def step(i: int) -> str:
        failing["now"] = i in (0, 3)
        out = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
        try:
            out.pow(2).mean().backward()
        except ValueError as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    result = compare(step, backend, tensors=blocks, steps=5, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0
    assert result.stats["cache_hits"] >= 2


def test_reentrant_checkpoint_breaks_with_a_warning(backend: str) -> None:
    step, tensors = _checkpointed_step(use_reentrant=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compare(step, backend, tensors=tensors, steps=2)
    result.assert_ok()
    messages = [str(w.message) for w in caught if issubclass(w.category, ca_runtime.GraphBreakWarning)]
    assert any("CheckpointFunctionBackward" in m and "reentrant" in m for m in messages), messages


def test_checkpoint_ops_outputs_share_no_memory_and_are_dense() -> None:
    """What Inductor may write over is ours alone: parameters and shared storages are cloned, views made dense."""
    from ca_runtime._checkpoint import _fresh_and_dense

    weight = torch.nn.Parameter(torch.randn(3, 4))
    fresh = torch.randn(4, 3)
    held = torch.randn(2, 2)  # checkpoint hands back a tensor without grad as it is: the user's own
    tensors = [
        weight.detach().t(),
        fresh.detach(),
        fresh.detach(),
        torch.randn(3, 5).t(),
        torch.randn(2, 1).detach(),  # never bound to a name: nothing else holds it
        held,
        torch.randn(5, 3)[2:],
    ]
    alone_memory = tensors[4].untyped_storage().data_ptr()
    del fresh
    shapes = [list(t.shape) for t in tensors]
    out = _fresh_and_dense(tensors, shapes, [t.dtype for t in tensors])
    for t, o in zip(tensors, out):
        torch.testing.assert_close(o, t, rtol=0, atol=0)
        assert o.is_contiguous() and o.stride() == torch.empty(o.shape).stride()
    pointers = [o.untyped_storage().data_ptr() for o in out]
    assert weight.untyped_storage().data_ptr() not in pointers
    assert held.untyped_storage().data_ptr() not in pointers
    assert out[6].storage_offset() == 0
    assert len(set(pointers)) == len(out)
    # Nothing else holds the last one: it is handed out as it is.
    assert out[4].untyped_storage().data_ptr() == alone_memory
    with pytest.raises(RuntimeError, match=r"recomputed a torch\.float32 tensor of shape"):
        _fresh_and_dense([torch.randn(2)], [[3]], [torch.float32])


def _checkpoint_variant(variant: str) -> tuple[object, list[torch.Tensor]]:
    """A step checkpointing one small region the way ``variant`` says."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    w, x = _leaves((3, 4), (3, 4))
    checkpoint = torch.utils.checkpoint.checkpoint

    def region(h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.nn.functional.gelu(lin(h * w) * scale).sin()

    def dropout_region(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(lin(h), p=0.5, training=True).sin()

    def run(i: int) -> torch.Tensor:
        torch.manual_seed(i)
        if variant == "no early stop":
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                return checkpoint(region, x, use_reentrant=False)
        if variant == "kwargs":
            return checkpoint(region, x, use_reentrant=False, scale=2.0)
        if variant == "region input saved":
            return checkpoint(torch.sin, x, use_reentrant=False).cos()
        if variant == "dropout":
            return checkpoint(dropout_region, x, use_reentrant=False)
        if variant == "nested":
            return checkpoint(
                lambda h: checkpoint(region, h, use_reentrant=False).cos(), x, use_reentrant=False
            )
        if variant == "selective":
            # Selective activation checkpointing: matmuls are saved, the rest recomputed.
            policy = functools.partial(
                torch.utils.checkpoint.create_selective_checkpoint_contexts,
                [torch.ops.aten.mm.default, torch.ops.aten.addmm.default],
            )
            return checkpoint(region, x, use_reentrant=False, context_fn=policy)
        if variant == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return checkpoint(region, x, use_reentrant=False).float()
        if variant == "tuple output":
            a, b = checkpoint(lambda h: (region(h), h.exp()), x, use_reentrant=False)
            return a * b
        if variant in ("retain_graph", "autograd.grad"):
            return checkpoint(region, x, use_reentrant=False)
        raise AssertionError(variant)

    def step(i: int) -> None:
        out = run(i)
        if variant == "retain_graph":
            out.sum().backward(retain_graph=True)
        if variant == "autograd.grad":
            (g,) = torch.autograd.grad((out * out).sum(), w)
            w.grad = g if w.grad is None else w.grad + g
            return
        (out * out).sum().add(out.sum()).backward()

    return step, [x, w, *lin.parameters()]


# Not debug=True: in plain eager, a second test using it in one pytest process
# fails its forward (torch's debug logging mode against pytest's log capture).
@pytest.mark.parametrize(
    "variant",
    [
        "no early stop",
        "kwargs",
        "region input saved",
        "dropout",
        "nested",
        "selective",
        "autocast",
        "tuple output",
        "retain_graph",
        "autograd.grad",
    ],
)
def test_checkpoint_variants_recompute_in_the_graph(backend: str, variant: str) -> None:
    step, tensors = _checkpoint_variant(variant)
    result = compare(step, backend, tensors=tensors, steps=3, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["graph_breaks"] == 0
