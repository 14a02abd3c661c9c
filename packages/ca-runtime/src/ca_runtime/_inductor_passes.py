"""Inductor graph passes for captured backward graphs; set by _backward_inductor_options.py."""

from __future__ import annotations

from typing import Any

import torch

from ca_runtime import _inductor_buffer_reuse, _torch_interop
from ca_runtime._torch_interop import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten

# [Note: An accumulated mm computed where its inputs are]
# A weight used twice in the forward (a GPT's embedding tied to its output
# head) gets two grads in the backward: one early (the head's weight-grad
# mm, from the loss's grad and the last activation) and one at the end (the
# embedding's). Our graph sums them where eager's InputBuffer does, when the
# second arrives, so it holds the early mm's output, as eager does. Inductor's
# post-grad pattern `add(mm(a, b), c) -> addmm(c, a, b)` (fx_passes/post_grad.py,
# no option turns it off) moves that mm to the sum: `a` and `b` are then held
# through the whole backward instead of the smaller output. On the bench's
# GPT-style decoder that was 1 MiB more at the peak (the 512x512 grad of the
# logits and the 512x384 last activation, against the 512x384 weight grad).
# This pass, run after Inductor's patterns (post_grad_custom_post_pass),
# splits such an addmm back into the mm, placed right after the later of its
# two matrices, and an add where the addmm was. Only where the addmm's input
# is computed after both matrices (so it is no bias: a graph input is there
# first) and the matrices are larger than the output; the split is the mm
# then add that the captured graph (and eager) computed, the same arithmetic.


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


class UnfuseLateAddmm(CustomGraphPass):
    """See [Note: An accumulated mm computed where its inputs are]."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        # Graph inputs are all there from the start.
        order = {node: -1 if node.op == "placeholder" else i for i, node in enumerate(graph.nodes)}
        first_computed = next((n for n in graph.nodes if n.op != "placeholder"), None)
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.addmm.default:
                continue
            if len(node.args) != 3 or node.kwargs:
                continue
            inp, mat1, mat2 = node.args
            if not (
                isinstance(inp, torch.fx.Node)
                and isinstance(mat1, torch.fx.Node)
                and isinstance(mat2, torch.fx.Node)
            ):
                continue
            ready = mat1 if order[mat1] >= order[mat2] else mat2
            if order[inp] <= order[ready] or _nbytes(mat1) + _nbytes(mat2) <= _nbytes(node):
                continue
            where = first_computed if ready.op == "placeholder" else ready.next
            with graph.inserting_before(where):
                mm = graph.call_function(aten.mm.default, (mat1, mat2))
            with graph.inserting_before(node):
                add = graph.call_function(aten.add.Tensor, (inp, mm))
            # Same shape, dtype and (contiguous) layout as the addmm's output.
            mm.meta = dict(node.meta)
            add.meta = dict(node.meta)
            order[mm], order[add] = order[ready], order[node]
            node.replace_all_uses_with(add)
            graph.erase_node(node)

    def uuid(self) -> Any:
        # Keys Inductor's cache for our graphs, whose buffer reuse the other two files decide.
        return get_hash_for_files((__file__, _inductor_buffer_reuse.__file__, _torch_interop.__file__))


#: The one instance BACKWARD_INDUCTOR_OPTIONS sets (Inductor keys its caches by its uuid).
UNFUSE_LATE_ADDMM = UnfuseLateAddmm()


# [Note: An add's alpha beside an mm]
# Inductor's post-grad pattern `add(inp, mm(a, b)) -> addmm(inp, a, b)`
# (fx_passes/post_grad.py, torch 2.13) also matches an add with an `alpha`
# and drops it: `w.add(x @ y, alpha=-0.01)` compiles to `w + x @ y`, in a
# plain torch.compile too. In a backward graph that add is user code: an
# optimizer step in a post-accumulate-grad hook (`p.add_(p.grad, alpha=-lr)`,
# the grad being the weight-grad mm that the leaf stole) moved the
# parameters by +grad instead of -lr * grad. This pass, run before
# Inductor's patterns (post_grad_custom_pre_pass), writes each add.Tensor
# whose alpha is not 1 and one of whose operands is an mm as the add of
# that operand times alpha, the arithmetic the add defines; the pattern then
# finds no add of an mm there.


class MultiplyOutAddAlpha(CustomGraphPass):
    """See [Note: An add's alpha beside an mm]."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.add.Tensor:
                continue
            alpha = node.kwargs.get("alpha", 1)
            if alpha == 1 or len(node.args) != 2:
                continue
            if not any(isinstance(a, torch.fx.Node) and a.target is aten.mm.default for a in node.args):
                continue
            inp, other = node.args
            with graph.inserting_before(node):
                scaled = graph.call_function(aten.mul.Tensor, (other, alpha))
            scaled.meta = dict(other.meta) if isinstance(other, torch.fx.Node) else {}
            node.args = (inp, scaled)
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


#: The one instance BACKWARD_INDUCTOR_OPTIONS sets.
MULTIPLY_OUT_ADD_ALPHA = MultiplyOutAddAlpha()
