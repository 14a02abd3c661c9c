"""The calls a captured backward graph is made of.

Each is a plain Python function so that an FX graph can call it and Dynamo can
compile that graph. Three kinds, see [Note: Graph call kinds]:

- ``allow_in_graph`` (``apply_node``, ``apply_nodes``, ``validate_outputs``): Dynamo keeps the
  call and runs it on FakeTensors to learn its outputs; AOTAutograd traces
  through it down to ATen ops.
- inlined (``accumulate``, the ``call_*_hook`` helpers,
  ``call_function_backward``, ``materialize_grad``): ordinary Python that
  Dynamo traces into, so a user hook or a Python Function's backward becomes
  part of the compiled graph, with its side effects replayed by Dynamo and
  guards on what it read (a ``ctx`` float, a hook's closure).
- graph breaks (``*_eager``, ``call_cpp_tensor_pre_hook``,
  ``accumulate_grad_now``): ``torch._dynamo.disable``-d, so Dynamo splits the
  graph and runs the call eagerly on real tensors, every backward.

[Note: Graph call kinds]
What runs eagerly behind a graph break is what cannot be traced without
changing its meaning: a C++ autograd Function declared untraceable (it may
write through ``data_ptr``), C++ tensor hooks and ``retain_grad`` (opaque
``std::function``s with side effects), saved tensors with unpack hooks (the
hook must run once per unpack, on the real packed value), reentrant
checkpoint (a backward inside a backward) and leaf accumulation that must
happen before a later hook (see [Note: Leaf accumulation order] in
``_capture.py``). Without Dynamo (``compiler_fn`` returns the graph as is)
every call simply runs.

[Note: User errors are tagged]
An exception from a user's callable (a tensor, grad_fn, post-accumulate-grad
or unpack hook, a Function's backward) is tagged where the graph calls it
(``call_user``: ``__ca_user_error__`` set on the exception, then re-raised),
and so are the mistakes eager reports in those calls (a backward returning the
wrong number of grads). Dynamo traces the try/except without a graph break; an
exception the user's code raises while Dynamo traces it, or while the
compiled graph runs, passes the handler either way. On a first run
(``Runtime.run_first``) a tagged exception propagates at once, untagged,
because eager would raise it and re-running the hooks eagerly would repeat
their side effects; on a cache hit ca_core removes the tag as the exception
leaves the graph. Anything else is judged by the eager engine (see
[Note: Whose failure] in ca_core): a user error that surfaces as a compile
error (an op Dynamo's fake tensors reject: ``softmax(g, dim=5)`` in a hook)
is raised by eager too and leaves the cache usable.

An exception a node's own backward raises while the graph runs it on real
tensors (``apply_node``, ``apply_nodes``, ``apply_with_saved_eager``: the
node's C++ ``apply``, as the engine calls it) is tagged too: eager runs that
same code on the same grads and saved tensors and raises the same error (an
op without a batching rule under ``is_grads_batched``, a custom Function's
backward failing in C++). Judging it by a second, eager run would call the
hooks that ran before the node a second time. While Dynamo or AOTAutograd
trace the graph those calls see fake tensors; an exception then is no
verdict on eager (a fake-tensor limit) and stays untagged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import ca_core
import torch

from ca_runtime._torch_interop import call_backward, on_fake_tensors

__all__ = [
    "USER_ERROR_TAG",
    "accumulate",
    "accumulate_grad_now",
    "accumulate_leaf",
    "apply_node",
    "apply_nodes",
    "apply_with_saved_eager",
    "call_cpp_tensor_pre_hook",
    "call_function_backward",
    "call_opaque_tensor_pre_hook",
    "call_post_hook",
    "call_pre_hook",
    "call_tensor_hook",
    "call_unpack_hook",
    "call_unpack_hooks_eager",
    "call_user",
    "materialize_grad",
    "unwrap_size",
    "user_error",
    "user_error_behind",
    "validate_outputs",
]

Grads = list[torch.Tensor | None]

#: The attribute [Note: User errors are tagged] sets on a user's exception.
USER_ERROR_TAG = "__ca_user_error__"


def call_user(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for a user's callable; see [Note: User errors are tagged]."""
    try:
        return fn(*args)
    except Exception as e:
        _tag(e)
        raise


def user_error(error: Exception) -> Exception:
    """``error``, tagged as the user's (a mistake eager reports too)."""
    _tag(error)
    return error


def _tag(error: BaseException) -> None:
    """Sets the tag of [Note: User errors are tagged], also on a class that refuses attribute writes."""
    try:
        error.__ca_user_error__ = True  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - whatever its __setattr__ raises
        # Its __setattr__ raises (a frozen exception class): the instance
        # dict still takes the tag, and the user's exception stays the one raised.
        object.__setattr__(error, USER_ERROR_TAG, True)


def _tag_if_real(error: Exception, tensors: Sequence[torch.Tensor | None]) -> None:
    """Tags a node's own error when it ran on real tensors; see [Note: User errors are tagged]."""
    if not on_fake_tensors(tensors):
        _tag(error)


#: How far along ``__context__`` user_error_behind looks.
_CONTEXT_DEPTH = 8


def user_error_behind(error: BaseException) -> BaseException | None:
    """The user's exception that ``error`` is, or that it replaced on its way out of the graph; its tag removed.

    See [Note: User errors are tagged]: an exception whose ``__context__``
    chain holds a tagged one was raised while the user's propagated (no
    user code runs in the graph after its callable raised), by machinery
    around the graph: a ``@contextmanager``'s ``__exit__`` (Dynamo's) sets
    ``__traceback__`` through ``setattr``, which a user's exception class
    may refuse. Eager raises the user's exception itself.
    """
    current: BaseException | None = error
    for _ in range(_CONTEXT_DEPTH):
        if current is None:
            return None
        if getattr(current, USER_ERROR_TAG, False) is True:
            with contextlib.suppress(AttributeError):
                object.__delattr__(current, USER_ERROR_TAG)  # past a class's own __delattr__, as it was set
            return current
        current = current.__context__
    return None


@torch.compiler.allow_in_graph
def apply_node(
    node_idx: int,
    inputs: Sequence[torch.Tensor | None],
    saved_tensors: Sequence[torch.Tensor],
    apply_sizes: Sequence[int | None] | None,
    saved_scalars: Sequence[int | float],
    validate_sizes: Sequence[int | None] | None,
) -> Grads:
    """``apply_with_saved`` then ``validate_outputs`` on node ``node_idx``, in one call."""
    try:
        return ca_core.apply_node(node_idx, inputs, saved_tensors, apply_sizes, saved_scalars, validate_sizes)
    except Exception as e:
        _tag_if_real(e, (*inputs, *saved_tensors))
        raise


@torch.compiler.allow_in_graph
def apply_nodes(plan_id: int, tensors: Sequence[torch.Tensor | None], others: list[Any]) -> Grads:
    """Consecutive ``apply_node`` calls in one; see [Note: Runs of nodes in one call] in ca_core."""
    try:
        return ca_core.apply_nodes(plan_id, tensors, others)
    except Exception as e:
        _tag_if_real(e, tensors)
        raise


@torch.compiler.disable
def apply_with_saved_eager(*args: Any) -> Grads:
    """``apply_with_saved(*args)`` behind a graph break: runs on real tensors every backward."""
    try:
        return ca_core.apply_with_saved(*args)
    except Exception as e:
        _tag(e)  # see [Note: User errors are tagged]
        raise


@torch.compiler.allow_in_graph
def validate_outputs(
    node_idx: int,
    outputs: Sequence[torch.Tensor | None],
    saved_sizes: Sequence[int | None] | None,
) -> Grads:
    """Checks/casts node ``node_idx``'s output grads as the eager engine does."""
    return ca_core.validate_outputs(node_idx, outputs, saved_sizes)


def accumulate(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Sums two grads flowing into one input, as the engine's InputBuffer does."""
    if old is None:
        return new
    if new is None:
        return old
    return torch.add(old, new)


# [Note: Hook results checked as eager checks them]
# Eager's Python hooks (torch/csrc/autograd/python_hook.cpp) check what a hook
# returns before using it: a tensor hook's value must be a tensor (TypeError
# "expected Variable, but hook returned 'int'") of the grad's type and size,
# and a grad_fn pre- or post-hook's a tuple (TypeError "expected tuple") as
# long as what it was given, each value checked the same way; a None grad may
# not be replaced. The checks below raise eager's errors, with its messages,
# as the user's (see [Note: User errors are tagged]): they read only dtypes,
# devices, layouts and sizes, which are static to Dynamo, so they cost nothing
# in a compiled graph.

#: The legacy type names eager's messages use (``Tensor.type()``).
_TYPE_NAMES = {
    torch.float32: "FloatTensor",
    torch.float64: "DoubleTensor",
    torch.float16: "HalfTensor",
    torch.bfloat16: "BFloat16Tensor",
    torch.complex64: "ComplexFloatTensor",
    torch.complex128: "ComplexDoubleTensor",
    torch.int64: "LongTensor",
    torch.int32: "IntTensor",
    torch.int16: "ShortTensor",
    torch.int8: "CharTensor",
    torch.uint8: "ByteTensor",
    torch.bool: "BoolTensor",
}


def _type_name(t: torch.Tensor) -> str:
    device = "" if t.device.type == "cpu" else f"{t.device.type}."
    return f"torch.{device}{_TYPE_NAMES.get(t.dtype, str(t.dtype))}"


def _hook_name(hook: object) -> str:
    name = getattr(hook, "__name__", None)
    return name if isinstance(name, str) else "<unknown>"


def _checked_value(hook: object, original: torch.Tensor | None, result: object) -> torch.Tensor | None:
    """One value a hook returned, checked as eager's check_single_result; see [Note: Hook results checked as eager checks them]."""
    if result is None:
        return original
    if original is None:
        raise user_error(RuntimeError("can't replace a None gradient with a non-None value"))
    if not isinstance(result, torch.Tensor):
        raise user_error(TypeError(f"expected Variable, but hook returned '{type(result).__name__}'"))
    if (
        result.dtype != original.dtype
        or result.device.type != original.device.type
        or result.layout != original.layout
    ):
        raise user_error(
            RuntimeError(
                f"hook '{_hook_name(hook)}' has changed the type of value "
                f"(was {_type_name(original)} got {_type_name(result)})"
            )
        )
    if result.shape != original.shape:
        raise user_error(RuntimeError(f"hook '{_hook_name(hook)}' has changed the size of value"))
    return result


def _checked_values(hook: object, originals: Sequence[torch.Tensor | None], result: object) -> Grads:
    """A pre- or post-hook's tuple, checked as eager's check_result."""
    if not isinstance(result, tuple):
        raise user_error(TypeError(f"expected tuple, but hook returned '{type(result).__name__}'"))
    if len(result) != len(originals):
        raise user_error(
            RuntimeError(
                f"hook '{_hook_name(hook)}' has returned an incorrect number of values "
                f"(got {len(result)}, but expected {len(originals)})"
            )
        )
    return [_checked_value(hook, original, value) for original, value in zip(originals, result)]


def call_tensor_hook(
    hook: Callable[[torch.Tensor | None], torch.Tensor | None], grad: torch.Tensor | None
) -> torch.Tensor | None:
    """A ``Tensor.register_hook`` hook: its result replaces the grad unless None."""
    result = call_user(hook, grad)
    return grad if result is None else _checked_value(hook, grad, result)


def call_pre_hook(hook: Callable[..., Any], grads: Sequence[torch.Tensor | None]) -> Grads:
    """A ``grad_fn.register_prehook`` hook on the node's input grads."""
    result = call_user(hook, tuple(grads))
    return list(grads) if result is None else _checked_values(hook, grads, result)


def call_post_hook(
    hook: Callable[..., Any],
    outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor | None],
) -> Grads:
    """A ``grad_fn.register_hook`` hook: (grad_inputs, grad_outputs) of the node."""
    result = call_user(hook, tuple(outputs), tuple(inputs))
    return list(outputs) if result is None else _checked_values(hook, outputs, result)


def unwrap_size(size: torch.Tensor) -> int:
    """A dynamic size, passed as an empty (0, size) tensor, or (0, 0, -size) when negative.

    See [Note: Signed dynamic sizes] in ca_core: the rank is static to Dynamo,
    so the branch is a guard.
    """
    if size.dim() == 2:
        return size.size(1)
    return -size.size(2)


def materialize_grad(
    grad: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The zeros a Python Function's backward sees for an undefined grad."""
    if grad is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return grad


def call_function_backward(
    ctx: Any,
    saved_tensors: Sequence[torch.Tensor | None],
    is_variable_input: tuple[bool, ...],
    name: str,
    *grads: torch.Tensor | None,
) -> Grads:
    """A Python ``torch.autograd.Function``'s backward, checked as eager checks it.

    ``call_backward`` hands the backward a ctx whose ``saved_tensors`` are the
    given ones, in a form Dynamo inlines, and keeps what the backward writes
    on it (see [Note: ctx writes in a backward] in _torch_interop.py).
    """
    result = call_user(call_backward, ctx, list(saved_tensors), *grads)
    expected = len(is_variable_input)
    if len(result) > expected and all(g is None for g in result[expected:]):
        result = result[:expected]
    if len(result) != expected:
        raise user_error(
            RuntimeError(
                f"function {name} returned an incorrect number of gradients "
                f"(expected {expected}, got {len(result)})"
            )
        )
    grads_out: Grads = []
    for position, (grad, is_tensor) in enumerate(zip(result, is_variable_input)):
        if is_tensor:
            grads_out.append(grad)
        elif grad is not None:
            raise user_error(
                RuntimeError(
                    f"function {name} returned a gradient different than None at position "
                    f"{position + 1}, but the corresponding forward input was not a Variable"
                )
            )
    return grads_out


@torch.compiler.disable
def call_cpp_tensor_pre_hook(node_idx: int, hook_id: int, grad: torch.Tensor | None) -> torch.Tensor | None:
    """A C++ tensor hook or ``retain_grad`` of node ``node_idx``, behind a graph break."""
    return ca_core.call_cpp_tensor_pre_hook(node_idx, hook_id, grad)


@torch.compiler.disable
def call_opaque_tensor_pre_hook(
    node_idx: int, hook_index: int, grads: Sequence[torch.Tensor | None]
) -> Grads:
    """A C++ tensor hook without compiled_args, on all of the node's grads, behind a graph break."""
    return ca_core.call_opaque_tensor_pre_hook(node_idx, hook_index, grads)


def accumulate_leaf(
    variable: torch.Tensor,
    grad: torch.Tensor | None,
    hooks: Sequence[Callable[[torch.Tensor], Any]],
    may_steal: bool,
) -> None:
    """A leaf accumulated in the graph, then its post-accumulate-grad hooks.

    See [Note: Leaves accumulated in the graph] in ca_core and [Note: A leaf
    steals its first grad]. ``inductor::accumulate_grad_`` is torch's op for
    adding to a ``.grad`` that exists (Dynamo traces it as a side effect on
    ``variable.grad``). An undefined grad accumulates nothing and calls no
    hook, as AccumulateGrad does.
    """
    if grad is None:
        return
    current = variable.grad
    if may_steal and current is None and _obeys_layout_contract(grad, variable):
        variable.grad = grad.detach()
    elif current is not None and _adds_in_place(current, grad):
        current.add_(grad)  # see [Note: A leaf's grad is added to in place]
    else:
        torch.ops.inductor.accumulate_grad_.default(variable, current, grad)
    for hook in hooks:
        result = call_user(hook, variable)
        if result is None:
            continue
        # Eager's order of checks (python_hook.cpp): a value is a tensor first, then None.
        if not isinstance(result, torch.Tensor):
            raise user_error(TypeError(f"expected Variable, but hook returned '{type(result).__name__}'"))
        raise user_error(RuntimeError("Tensor post accumulate grad hooks should return None."))


# [Note: A leaf's grad is added to in place]
# With grad mode off, eager's AccumulateGrad adds a new grad into the leaf's
# existing dense .grad in place (``variable_grad += new_grad``): the .grad
# tensor keeps its identity, so a reference kept from an earlier step, or a
# .grad that is a view into a flat buffer (an optimizer's or a communication
# library's contiguous grads), sees every grad. inductor::accumulate_grad_
# returns a new tensor instead. So a leaf accumulated in the graph whose
# .grad exists is added to with ``add_`` when eager would: grad mode off and
# neither grad sparse (a sparse .grad gets a dense sum; a sparse grad into a
# dense one stays the op's). Dynamo traces the add as a mutation of a graph
# input, which AOTAutograd and Inductor write back into the same tensor.
def _adds_in_place(current: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether eager's AccumulateGrad would add ``grad`` into the existing ``.grad`` ``current`` in place."""
    return not torch.is_grad_enabled() and current.layout == torch.strided and grad.layout == torch.strided


# [Note: A leaf steals its first grad]
# Eager's AccumulateGrad does not copy the grad it receives when the leaf has
# no .grad yet: it stores a detached alias of it as .grad (when grad mode is
# off, nothing else holds the grad, and its strides obey the layout contract;
# torch/csrc/autograd/functions/accumulate_grad.h). The node's own post hooks
# (grad_acc.register_hook) then see in their inputs the tensor that became
# .grad, so a post-accumulate-grad hook's in-place change to p.grad shows in
# them. The graph does the same for a leaf with such post hooks (where the
# difference shows): the capture passes may_steal when the grad is a value the
# graph computes (not one of its inputs, which the caller holds), and the
# layout contract is checked on the values as eager checks it. Every other
# leaf accumulated in the graph gets a copy, which nothing can tell apart. A
# hook that keeps a reference to the grad it returned (eager would copy then)
# or a grad passed through unchanged from a graph input is not seen.
def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once, in some order of its dimensions (c10's check)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    """Whether ``grad`` may become ``variable.grad`` as it is (torch's utils::obeys_layout_contract, dense case)."""
    if grad.layout != torch.strided or variable.layout != torch.strided or variable.is_nested:
        return False
    if _non_overlapping_and_dense(variable):
        # A dimension of size 1 may have any stride but 0 (a view, as cat's).
        return all(
            g_stride != 0 if size == 1 else g_stride == v_stride
            for size, g_stride, v_stride in zip(grad.shape, grad.stride(), variable.stride())
        )
    return grad.is_contiguous()


@torch.compiler.disable
def accumulate_grad_now(node_idx: int, grad: torch.Tensor | None) -> None:
    """Runs AccumulateGrad node ``node_idx`` (and its post hooks) now, behind a graph break."""
    ca_core.accumulate_grad_now(node_idx, grad)


def call_unpack_hook(hook: Callable[[Any], torch.Tensor], packed: Any) -> torch.Tensor:
    """A saved tensor's unpack hook on its packed data; see [Note: Unpack hooks in the graph] in ca_core."""
    return call_user(hook, packed)


@torch.compiler.disable
def call_unpack_hooks_eager(
    hooks: Sequence[Callable[[Any], torch.Tensor]], packed: Sequence[Any]
) -> list[torch.Tensor]:
    """Unpack hooks Dynamo would skip, in eager's order, behind one graph break."""
    return [call_user(hook, data) for hook, data in zip(hooks, packed)]
