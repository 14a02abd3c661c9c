"""Non-reentrant checkpoint regions recomputed inside the compiled graph, as one opaque op.

[Note: Checkpoint regions in the graph]
Non-reentrant ``torch.utils.checkpoint`` saves a ``_Holder`` for each tensor
of a region; its unpack hook recomputes the whole region at the first unpack
(running the user's forward again under its own pack hooks) and hands out the
recomputed tensors. Dynamo skips that hook (``torch.utils`` is on its skip
list), and its work cannot be traced anyway: it records an autograd graph to
catch what the forward saves. So the capture calls it through a custom op,
``ca::checkpoint_recompute``, that Dynamo, AOTAutograd and Inductor keep as
one opaque call: the graph does not break.

- Arguments: the indices in the graph's ``hooks`` input of each unpack hook
  and its packed data, in eager's unpack order. The op reads the objects of
  the graph running on this thread (``ca_core.running_graph_hook``, see
  [Note: The running graph's hooks] in ca_core), because a custom op takes no
  Python objects. It calls the hooks exactly as eager would (the first one
  recomputes, the rest hand out), through ``call_user`` (see [Note: User
  errors are tagged]).
- Outputs' metadata: the op's fake implementation must know each tensor's
  shape, dtype and device before anything is recomputed. Checkpoint records
  them at pack time in the frame's ``x_metadatas`` (its determinism check);
  ``recompute_region`` reads them with plain attribute reads that Dynamo
  inlines, so the compiled graph is guarded on them like on any input's
  shape: a region saving other shapes recompiles. A region without that
  record (``determinism_check="none"``) is called behind one graph break,
  as before. The op checks what it returns against the claim and raises
  rather than hand Inductor a tensor of another shape.
- Position: the op also takes the first input grad of the node that unpacks
  first (``after``), and ignores it. With no tensor input nothing orders the
  op, and Inductor ran every region's recompute at the start of the graph,
  which keeps all regions' recomputed activations alive at once: the memory
  checkpointing exists to save. With it, a region is recomputed where eager
  recomputes it, after the regions after it have been used and freed.
- Outputs are fresh, dense tensors. Inductor may reuse a dead buffer's memory
  for a later result, which is only safe for memory nothing else sees, while
  a recomputed tensor may be a parameter's view, a region input or buffer
  (checkpoint hands a tensor that does not require grad back as it is), or
  share storage with another recomputed tensor (one activation saved by two
  nodes). The op clones those (judged by the tensor's and its storage's
  reference counts), and anything at a storage offset or not contiguous with
  the standard strides its fake implementation promised. This costs a copy
  of each parameter and region input a region saves, per backward; the
  break it replaces cost a Dynamo resume per region.
- Limits. The region's record indices are fixed at capture: a region whose
  forward saves a different number of tensors before one of ours, with an
  unchanged backward graph, gets an error from the op rather than a wrong
  tensor. A tensor subclass (DTensor) recomputed in a region raises too: its
  recorded shape is not its local one. The op is tagged cudagraph_unsafe: it
  runs Python.
- Capture reads only the records (``recomputable``): unpacking anything,
  even a region's saved inputs, could run another (outer, nested) region's
  recompute before the graph does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import ca_core
import torch

from ca_runtime._graph_ops import call_user
from ca_runtime._torch_interop import (
    checkpoint_saved_metadata,
    dispatch_keys_excluded_as,
    excluded_dispatch_keys,
    privateuse1_device_type,
    storage_key,
    storage_use_count,
    tensor_use_count,
)

__all__ = ["recomputable", "recompute_region"]

#: Every dtype, by a code a custom op can take (a list of ints).
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
)
_DTYPE_CODE: dict[torch.dtype, int] = {d: i for i, d in enumerate(_DTYPES)}
#: Device types, by code; a device is passed as (type code, index or -1).
_DEVICE_TYPES: tuple[str, ...] = (
    "cpu",
    "cuda",
    "xpu",
    "mps",
    "hpu",
    "mtia",
    "meta",
    privateuse1_device_type(),
)


def _device(code: int, index: int) -> torch.device:
    return torch.device(_DEVICE_TYPES[code]) if index < 0 else torch.device(_DEVICE_TYPES[code], index)


def recomputable(hook: Any, cell: int, indices: Sequence[int | None]) -> bool:
    """Whether the op can recompute this region: metadata recorded for every tensor, on known devices.

    Reads nothing but the records: unpacking anything here (the region's
    saved inputs) could run another region's recompute at capture.
    """
    for index in indices:
        record = None if index is None else checkpoint_saved_metadata(hook, cell, index)
        if record is None or record["device"].type not in _DEVICE_TYPES:
            return False
    return True


def recompute_region(
    hook: Any,
    cell: int,
    indices: Sequence[int],
    hook_ids: list[int],
    packed_ids: list[int],
    after: torch.Tensor | None,
) -> list[torch.Tensor]:
    """The region's unpacked tensors, in ``hook_ids`` order; see [Note: Checkpoint regions in the graph].

    Inlined by Dynamo: ``hook`` (any of the region's unpack hooks) leads to
    the recorded metadata, and ``indices`` says which record each tensor has.
    """
    records = [checkpoint_saved_metadata(hook, cell, index) for index in indices]
    known = [record for record in records if record is not None]
    if len(known) != len(records):
        # A region of the same shape of graph whose checkpoint records nothing
        # (determinism_check="none"): see [Note: A region without records on a hit].
        return _unpack_behind_a_break(hook_ids, packed_ids)
    sizes: list[int] = []
    ranks: list[int] = []
    dtypes: list[int] = []
    devices: list[int] = []
    for metadata in known:
        shape = metadata["shape"]
        sizes.extend(shape)
        ranks.append(len(shape))
        dtypes.append(_DTYPE_CODE[metadata["dtype"]])
        device = metadata["device"]
        devices.append(_DEVICE_TYPES.index(device.type))
        devices.append(-1 if device.index is None else device.index)
    result: list[torch.Tensor] = torch.ops.ca.checkpoint_recompute(
        after, hook_ids, packed_ids, sizes, ranks, dtypes, devices
    )
    return result


# [Note: A region without records on a hit]
# Whether a region is recomputed by the op is decided at capture, from its
# records, and the cache key does not see the records: a later backward of
# the same graph shape may come from a checkpoint with
# ``determinism_check="none"`` (another module, a changed setting), whose
# records are None. Dynamo guards on the records ``recompute_region`` read,
# so such a backward re-traces it; it then unpacks the region behind a graph
# break, as a capture of that region would have, instead of failing inside
# the trace.


def _call_unpack_hooks(hook_ids: list[int], packed_ids: list[int]) -> list[torch.Tensor]:
    """The region's unpack hooks, read from the running graph's ``hooks`` input, called on their data in order."""
    return [
        call_user(ca_core.running_graph_hook(h), ca_core.running_graph_hook(d))
        for h, d in zip(hook_ids, packed_ids)
    ]


@torch.compiler.disable
def _unpack_behind_a_break(hook_ids: list[int], packed_ids: list[int]) -> list[torch.Tensor]:
    """The region's unpack hooks called in eager's order on real tensors; see [Note: A region without records on a hit]."""
    return _call_unpack_hooks(hook_ids, packed_ids)


#: Dispatch keys excluded outside any compiled code (autocast's, while it is off).
_EAGER_EXCLUDED_KEYS = excluded_dispatch_keys()

# [Note: Recomputing with autograd on]
# The recompute must record an autograd graph: checkpoint's pack hooks, which
# catch the recomputed tensors, only fire when an op saves for backward. A
# backward compiled by AOTAutograd runs its graph with every dispatch key
# above the backend excluded, autograd's included, and so its custom ops'
# kernels run that way too; the op puts the eager excluded set back for the
# recompute (autocast is then set by checkpoint's recompute itself, as the
# forward had it).


def _shapes(sizes: Sequence[int], ranks: Sequence[int]) -> list[list[int]]:
    shapes, start = [], 0
    for rank in ranks:
        shapes.append(list(sizes[start : start + rank]))
        start += rank
    return shapes


# Not replayable by a CUDA graph: it runs the user's forward in Python.
@torch.library.custom_op("ca::checkpoint_recompute", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _checkpoint_recompute(
    after: torch.Tensor | None,
    hook_ids: list[int],
    packed_ids: list[int],
    sizes: list[int],
    ranks: list[int],
    dtypes: list[int],
    devices: list[int],
) -> list[torch.Tensor]:
    # See [Note: Recomputing with autograd on].
    with dispatch_keys_excluded_as(_EAGER_EXCLUDED_KEYS):
        unpacked = _call_unpack_hooks(hook_ids, packed_ids)
    return _fresh_and_dense(unpacked, _shapes(sizes, ranks), [_DTYPES[d] for d in dtypes])


@_checkpoint_recompute.register_fake
def _(
    after: torch.Tensor | None,
    hook_ids: list[int],
    packed_ids: list[int],
    sizes: list[int],
    ranks: list[int],
    dtypes: list[int],
    devices: list[int],
) -> list[torch.Tensor]:
    return [
        torch.empty(shape, dtype=_DTYPES[d], device=_device(devices[2 * i], devices[2 * i + 1]))
        for i, (shape, d) in enumerate(zip(_shapes(sizes, ranks), dtypes))
    ]


# [Note: The recompute under vmap over the engine]
# ``autograd.grad(..., is_grads_batched=True)`` runs the backward under
# torch's legacy vmap (``torch._vmap_internals``, the ``Batched`` dispatch
# key), whose fallback cannot batch an op returning a list. Only ``after``,
# a grad that orders the recompute in the graph, can be batched there; the
# recompute reads the region's saved inputs alone, as eager's does under
# vmap. So the ``Batched`` kernel drops ``after`` (the op is already in
# program order) and returns unbatched tensors. ``torch.func.vmap`` (the
# ``FuncTorchBatched`` key) gets the same rule through ``register_vmap``.
_BATCHED_LIBRARY = torch.library.Library("ca", "IMPL")


def _recompute_unbatched(after: torch.Tensor | None, *metadata: Any) -> list[torch.Tensor]:
    """See [Note: The recompute under vmap over the engine]; ``metadata``: the op's other arguments."""
    result: list[torch.Tensor] = torch.ops.ca.checkpoint_recompute(None, *metadata)
    return result


_BATCHED_LIBRARY.impl("checkpoint_recompute", _recompute_unbatched, "Batched")


@_checkpoint_recompute.register_vmap
def _(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[list[torch.Tensor], list[None]]:
    result = _recompute_unbatched(*args)
    return result, [None] * len(result)


def _dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _references(t: torch.Tensor) -> int:
    """Python references to ``t``, called as ``_references(a_list[i])``."""
    return sys.getrefcount(t)


#: A tensor held by one list slot alone: its _references, counted at each
#: use, is the baseline. Counted then, not once at import: a tracer
#: (sys.settrace: a debugger, coverage) that reads frames' locals adds a
#: reference to what a frame holds, and must be in force for both counts or
#: for neither.
_PROBE = [torch.empty(0)]


def _fresh_and_dense(
    tensors: list[torch.Tensor], shapes: list[list[int]], dtypes: list[torch.dtype]
) -> list[torch.Tensor]:
    """``tensors`` as the op promised them; see [Note: Checkpoint regions in the graph].

    Each output is a plain tensor of the claimed shape and dtype, with
    standard contiguous strides and storage offset 0, whose memory nothing
    else can see: a tensor anyone else holds (checkpoint hands back a tensor
    that does not require grad as it is: a region input, a module buffer), or
    whose storage anyone else holds (a parameter's view), or that shares a
    storage with an earlier output, is cloned.
    """
    # Per storage: the Python storage object we hold while counting, and its users.
    storages: dict[int, tuple[torch.UntypedStorage, list[int]]] = {}
    alone = [False] * len(tensors)
    list_slot_only = _references(_PROBE[0])
    for i in range(len(tensors)):
        t, shape, dtype = tensors[i], shapes[i], dtypes[i]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise RuntimeError(
                f"ca_runtime: a checkpoint region recomputed a {type(t).__name__}; only plain tensors "
                "can be recomputed inside the compiled graph"
            )
        if list(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(
                f"ca_runtime: a checkpoint region recomputed a {t.dtype} tensor of shape {list(t.shape)} "
                f"where its forward saved {dtype} of shape {shape}; the compiled graph cannot use it"
            )
        del t
        # Held by our list alone, in Python and in C++.
        alone[i] = _references(tensors[i]) == list_slot_only and tensor_use_count(tensors[i]) == 1
        storage = tensors[i].untyped_storage()
        storages.setdefault(storage_key(storage), (storage, []))[1].append(i)
    out = list(tensors)
    for key, (_, users) in storages.items():
        # References: the storage object we hold, one per distinct tensor of
        # ours; any other is an alias (a parameter, a region input) we cannot see.
        distinct = len({id(tensors[i]) for i in users})
        shared = storage_use_count(key) - 1 > distinct or not all(alone[i] for i in users)
        for n, i in enumerate(users):
            if shared or n > 0:
                out[i] = tensors[i].clone(memory_format=torch.contiguous_format)
    for i, t in enumerate(out):
        strides = _dense_strides(shapes[i])
        if t.storage_offset() != 0 or not t.is_contiguous():
            # An offset view may be misaligned for a kernel that assumes a fresh allocation.
            out[i] = t.clone(memory_format=torch.contiguous_format)
        elif t.stride() != strides:
            out[i] = t.as_strided(shapes[i], strides)
    return out
